"""Where the runtimes' CPU per action goes at zero compute: koala's code, the engine's, torch's, gloo's.

    python benchmarks/runtime_cpu.py                      # both engines, 1f1b, p=2, m=16
    python benchmarks/runtime_cpu.py --engines megatron --schedule zb-h1 --steps 80
    python benchmarks/runtime_cpu.py --plain -p 4 --engines megatron megatron-bare deepspeed deepspeed-stock torch-bare

Each pipeline rank runs the schedule on zero-cost `EmulatedStage` chunks (tests/engine_runs.py:
megatron-core's forward_step / backward_step through koala_ds.megatron, or DeepSpeed's
train_batch through koala_ds.deepspeed) under cProfile with a CPU-time clock, after 5 warm-up
steps. The table gives the profiled CPU per action (all ranks' processes), the part of it in
user mode (the rest is the kernel's: on this machine mostly waking the threads that wait for a
message, and socket calls; no runtime on torch + gloo avoids it) and rank 0's CPU split
by whose function it was spent in (a function's own time, not its callees'): koala_ds (the
runtime, p2p layer and lowering; the emulated model and its harness are counted apart), the engine (megatron /
deepspeed), torch's Python and C++ (autograd, modules), c10d (gloo's send / recv / wait) and the
rest (Python's builtins and standard library). cProfile charges every Python call some overhead,
so Python-heavy parts (koala's and the engines') weigh more here than in an unprofiled run: read
the split as an upper bound on koala's share. benchmarks/engine_speedup.py --overhead-only gives
the unprofiled CPU per action.

Three references, 1F1B only: deepspeed-stock (DeepSpeed's own engine and schedule), torch-bare
(`_TorchBare`: the lowered stream the runtimes run, on torch + gloo alone, no engine: the floor of
any Python runtime on this machine; at zero compute its CPU is mostly gloo's and the kernel's,
waking ranks that wait for messages) and megatron-bare (`_MegatronBare`: that loop computing with
megatron-core's forward_step / backward_step: megatron-core without koala's runtime). So
megatron - megatron-bare is koala's runtime, megatron-bare - torch-bare megatron-core's steps.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the harness: engine_runs, deepspeed_jobs
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this module, for the workers

from koala_ds.core.ir import Op  # noqa: E402  (pure: no torch)
from koala_ds.runtime.lowering import COMPUTE, RECV, SEND, lower, received_message, recv_lookahead  # noqa: E402

OWNERS = ("koala_ds", "engine", "torch", "c10d", "emulated model", "other")


def _owner(path: str, name: str) -> str:
    if "emulate" in path or "/tests/" in path:  # the harness model
        return "emulated model"
    if "koala_ds" in path:
        return "koala_ds"
    if "/megatron/" in path or "/deepspeed/" in path:
        return "engine"
    if "c10d" in name:
        return "c10d"
    return "torch" if "torch" in path or "torch" in name else "other"


def _cpu_and_user() -> tuple[float, float]:
    """This process's CPU seconds so far and those in user mode, from one reading (the CPU clock
    and getrusage read apart let the user part exceed the whole: 0.259 vs 0.257 ms per action in
    a fresh clone's CI run on 2026-12-06)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_utime


def _profiled(runner, steps: int, profile: bool = True) -> dict:
    """CPU seconds of `steps` steps after 5 warm-up steps, and those in user mode (the rest is
    the kernel's: at zero compute mostly waking threads for messages); with `profile`, under
    cProfile (CPU clock), and rank 0's split by owner and its costliest functions."""
    import torch.distributed as dist

    for _ in range(5):
        runner.step()
    dist.barrier()
    prof = cProfile.Profile(time.process_time) if profile else None
    cpu0, user0 = _cpu_and_user()
    if prof is not None:
        prof.enable()
    for _ in range(steps):
        runner.step()
    if prof is not None:
        prof.disable()
    cpu, user = (now - then for now, then in zip(_cpu_and_user(), (cpu0, user0)))
    dist.barrier()
    split = dict.fromkeys(OWNERS, 0.0)
    functions = []
    for (path, line, name), (_cc, calls, own, _cum, _callers) in (pstats.Stats(prof).stats.items() if prof else ()):
        split[_owner(path, name)] += own
        functions.append((own, calls, f"{_short(path)}:{line}({name})"))
    return {"cpu_s": cpu, "user_s": user, "split_s": split, "functions": sorted(functions, reverse=True)[:40]}


def _short(path: str) -> str:
    """A function's file from its package on: koala_ds/..., megatron/..., torch/..."""
    for root in ("koala_ds/", "megatron/", "deepspeed/", "torch/", "tests/"):
        if root in path:
            return root + path.split(root, 1)[1]
    return path


def _on_megatron(world: int, spec: dict, make_runner) -> dict:
    """`_profiled` on the runner `make_runner()` builds, inside megatron-core's parallel state (pp = world)."""
    import torch
    from megatron.core import parallel_state as ps

    torch.set_num_threads(1)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=world)
    try:
        return _profiled(make_runner(), spec["steps"], spec["profile"])
    finally:
        ps.destroy_model_parallel()


def megatron_worker(rank: int, world: int, spec: dict) -> dict:
    from engine_runs import _MegatronRunner

    return _on_megatron(world, spec, lambda: _MegatronRunner(spec["job"], rank, 8, 2, 60))


def megatron_bare_worker(rank: int, world: int, spec: dict) -> dict:
    return _on_megatron(world, spec, lambda: _MegatronBare(rank, world, spec["m"]))


class _TorchBare:
    """The floor of a Python runtime on torch + gloo: the lowered stream of 1F1B
    (koala_ds.runtime.lowering, receives posted as both runtimes post them on gloo: recv_lookahead) run by
    a bare loop: a zero-cost `EmulatedStage`, the default process group's own send / recv, no
    engine, no timeouts, no checks, one tensor per message. A reference, not a runtime."""

    def __init__(self, rank: int, p: int, m: int, hidden: int = 8, seq: int = 2):
        import torch
        import torch.distributed as dist

        from koala_ds.resolve import load_schedule

        schedule = load_schedule("1f1b", p, m, 1)
        self.torch, self.shape, self.last = torch, (seq, 1, hidden), schedule.num_stages - 1
        self.data = [torch.randn(self.shape) for _ in range(m)]
        self.stage = self._model(rank, p, hidden)
        pg = dist.distributed_c10d._get_default_group()
        self._send, self._recv = pg.send, pg.recv
        self.program = []  # (kind, action, the message it consumes) or (kind, message, peer)
        for st in lower(schedule, lookahead=recv_lookahead(True)).ranks[rank]:
            if st.kind == COMPUTE:
                need = received_message(schedule, rank, st.action)
                self.program.append((st.kind, st.action, need and need[1]))
            else:
                self.program.append((st.kind, st.message, st.peer))

    def _model(self, rank: int, p: int, hidden: int):
        from koala_ds.profiler.emulate import EmulatedStage

        return EmulatedStage(0.0, 0.0, 0.0, hidden=hidden)

    def step(self) -> None:
        torch, posted, stash, sends, out = self.torch, {}, {}, [], None
        self.batches = iter(self.data)
        for kind, what, arg in self.program:
            if kind == RECV:
                buf = torch.empty(self.shape)
                posted[what] = (buf, self._recv([buf], arg, 0))
            elif kind == SEND:
                sends.append(self._send([out.detach()], arg, 0))
            else:
                received = None
                if arg is not None:
                    received, work = posted.pop(arg)
                    work.wait()
                out = self._compute(what, received, stash)
        for work in sends:
            work.wait()

    def _compute(self, a, received, stash: dict):
        """F or B of action `a` on its received tensor (None: data, or the loss); what it sends."""
        key = (a.stage, a.microbatch)
        if a.op is Op.F:
            x = next(self.batches) if received is None else received.requires_grad_()
            y = self.stage(x)
            stash[key] = (x, y.float().mean() if a.stage == self.last else y)
            return y
        x, y = stash.pop(key)
        self.torch.autograd.backward(y, received)
        return x.grad


class _MegatronBare(_TorchBare):
    """`_TorchBare` computing with megatron-core's forward_step / backward_step on the chunks
    the koala runtime runs (tests/engine_runs.py): megatron-core without koala's runtime."""

    def _model(self, rank: int, p: int, hidden: int):
        from megatron.core.pipeline_parallel import schedules

        from engine_runs import _forward_step, _MegatronChunk, chunk_config

        self.schedules, self.forward_step_func = schedules, _forward_step
        self.config = chunk_config(p, hidden, p, 1)
        return _MegatronChunk(self.config, rank, p, [0.0, 0.0, 0.0], hidden)

    def _compute(self, a, received, stash: dict):
        key, chunk = (a.stage, a.microbatch), self.stage
        if a.op is Op.F:
            x = None if received is None else received.requires_grad_()
            out, _ = self.schedules.forward_step(self.forward_step_func, self.batches, chunk, len(self.data), x, [],
                                                 self.config, 1, is_first_microbatch=a.microbatch == 0,
                                                 current_microbatch=a.microbatch, is_last_stage=a.stage == self.last)
            stash[key] = (x, out)
            return out
        x, out = stash.pop(key)
        return self.schedules.backward_step(x, out, received, chunk.model_type, self.config)


def torch_bare_worker(rank: int, world: int, spec: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    return _profiled(_TorchBare(rank, world, spec["m"]), spec["steps"], spec["profile"])


def deepspeed_worker(rank: int, world: int, spec: dict) -> dict:
    import logging

    import torch

    import koala_ds.deepspeed  # noqa: F401  (registers the engine with deepspeed.initialize)
    from engine_runs import _DeepSpeedRunner

    torch.set_num_threads(1)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    return _profiled(_DeepSpeedRunner(spec["job"], world, 8, 2, 60), spec["steps"], spec["profile"])


def run(engine: str, spec: dict, p: int) -> list[dict]:
    if engine.startswith(("megatron", "torch")):
        from koala_ds.runtime.spawn import spawn
        from rank_processes import PRELOAD  # ranks forked with torch and megatron-core imported (CPU only)

        return spawn(f"runtime_cpu:{engine.replace('-', '_')}_worker", p, spec, timeout_s=600, preload=PRELOAD)
    from deepspeed_jobs import launch

    return [r["value"] for r in launch("runtime_cpu:deepspeed_worker", p, spec, timeout_s=600)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", nargs="*", default=["megatron", "deepspeed"],
                    choices=["megatron", "megatron-bare", "deepspeed", "deepspeed-stock", "torch-bare"],
                    help="torch-bare: the lowered 1F1B stream on torch + gloo alone, the floor of any runtime; "
                         "megatron-bare: the same loop with megatron-core's forward_step / backward_step, no koala "
                         "runtime; deepspeed-stock: DeepSpeed's own PipelineEngine and 1F1B (all three with "
                         "--schedule 1f1b)")
    ap.add_argument("--schedule", default="1f1b", help="library schedule (default 1f1b)")
    ap.add_argument("-p", type=int, default=2, help="pipeline ranks (default 2)")
    ap.add_argument("-m", type=int, default=16, help="microbatches (default 16)")
    ap.add_argument("--steps", type=int, default=40, help="profiled steps (default 40)")
    ap.add_argument("--top", type=int, default=0, help="also list rank 0's N functions with the most own CPU per action")
    ap.add_argument("--plain", action="store_true", help="no cProfile: the CPU per action only, unprofiled")
    args = ap.parse_args(argv)
    if {"megatron-bare", "deepspeed-stock", "torch-bare"} & set(args.engines) and args.schedule != "1f1b":
        ap.error("--engines megatron-bare, deepspeed-stock and torch-bare run 1F1B: use --schedule 1f1b")

    from koala_ds.resolve import load_schedule

    schedule = load_schedule(args.schedule, args.p, args.m, 1)
    job = {"key": 0, "schedule": schedule.to_dict(), "costs": [[0.0, 0.0, 0.0]] * schedule.num_stages}
    actions = sum(len(r) for r in schedule.ranks)
    print(f"{args.schedule}, p={args.p}, m={args.m}, zero compute, {args.steps} "
          + ("unprofiled steps" if args.plain else "profiled steps; rank 0's CPU by owner (own time, % of its profiled CPU)"))
    owners = () if args.plain else OWNERS
    print(f"{'engine':<15} {'ms/action':>9} {'user mode':>9}  " + "  ".join(f"{o:>14}" for o in owners))
    for engine in args.engines:
        spec = {"job": {**job, "stock": engine == "deepspeed-stock"}, "m": args.m, "steps": args.steps,
                "profile": not args.plain}
        results = run(engine, spec, args.p)
        per_action = sum(r["cpu_s"] for r in results) * 1000.0 / (args.steps * actions)
        user = sum(r["user_s"] for r in results) * 1000.0 / (args.steps * actions)
        split = results[0]["split_s"]
        total = sum(split.values()) or 1.0
        print(f"{engine:<15} {per_action:>9.3f} {user:>9.3f}  " + "  ".join(f"{100 * split[o] / total:>13.1f}%" for o in owners))
        rank_actions = args.steps * len(schedule.ranks[0])
        for own, calls, where in results[0]["functions"][:args.top]:
            print(f"    {1e3 * own / rank_actions:7.4f} ms/action {calls / rank_actions:6.2f} calls/action  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
