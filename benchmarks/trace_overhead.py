"""What recording a measured trace (koala_ds/runtime/trace_record.py) costs a training step.

1. In isolation (--actions N, --steps K): the interpreter loop of the Megatron runtime over a
   program of no-op actions, plain and with the recorder's marks (`_traced`), each action's
   input wait through `timed_wait` as a recorded step does, and `end_step` (formatting and the
   one write per step) included: the added microseconds per action.
2. --example R: the Megatron example (examples/megatron_gpt, p=2, zb-h1, gloo on CPU), R runs
   with and R without --koala-trace, alternating; the median iteration time of each run
   (iterations after the first two).

3. --deepspeed STEPS: the DeepSpeed example (examples/deepspeed_pipe/train.py's model, p=2,
   --ds-dim, --ds-schedule; gloo on CPU) in ONE run with the trace on, the recorder switched off
   and on between steps in the order on, off, off, on, ... so that the machine's drift hits
   both alike; per pair of steps the difference of rank 0's step times (train_batch, which
   returns after the step's optimizer update), and the median step time of each. Switched off,
   a step runs the untraced program; the input waits stay wrapped in the recorder's timer (two
   clock reads per receive), so the difference leaves those out.

    .venv/bin/python benchmarks/trace_overhead.py --actions 24 --steps 2000 --example 3
    .venv/bin/python benchmarks/trace_overhead.py --steps 200 --deepspeed 200 --ds-dim 64
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def isolated(actions: int, steps: int, repeats: int = 5) -> tuple[float, float]:
    """(plain, traced) microseconds per action of the interpreter loop (best of `repeats`)."""
    from koala_ds.resolve import load_schedule
    from koala_ds.megatron.runtime import _traced
    from koala_ds.runtime.trace_record import TraceRecorder, timed_wait

    m = actions // 3  # zb-h1 at p=2: 3 actions (F, I, W) per microbatch
    schedule = load_schedule("zb-h1", 2, m)

    class Runner:  # the attributes of _StepRunner the loop and the marks touch
        def __init__(self, recorder):
            self.recorder = recorder
            self._recv = (lambda msg: msg) if recorder is None else timed_wait(recorder, lambda msg: msg)

        def action(self, msg):
            self._recv(msg)

    n = len(schedule.ranks[1])
    program = tuple((Runner.action, (k,)) for k in range(n))
    spans = tuple((k, k + 1) for k in range(n))
    traced = _traced(program, spans)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for prog, rec in ((program, None), (traced, TraceRecorder(os.path.join(tmp, "t.json"), "megatron", "-"))):
            runner = Runner(rec)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(steps):
                    if rec is not None:
                        rec.begin_step(schedule, 1)
                    for fn, args in prog:
                        fn(runner, *args)
                    if rec is not None:
                        rec.end_step()
                best = min(best, (time.perf_counter() - t0) / (steps * n) * 1e6)
            out.append(best)
            if rec is not None:
                rec.close()
    return out[0], out[1]


def example_run(trace: str | None, iters: int) -> float:
    """Median ms per iteration (after the first two) of one run of the Megatron example."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "loss.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               str(ROOT / "examples/megatron_gpt/pretrain_gpt.py"), "--pipeline-model-parallel-size", "2",
               "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
               "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", str(iters),
               "--pipeline-schedule", "koala", "--koala-schedule", "zb-h1", "--loss-log", log]
        if trace:
            cmd += ["--koala-trace", os.path.join(tmp, "trace.json")]
        subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)
        return statistics.median(json.loads(Path(log).read_text())["iteration_ms"][2:])


def deepspeed_worker(steps: int, dim: int, schedule: str, out: str) -> None:
    """One rank of --deepspeed (run under torchrun): the example's model, traced; the recorder
    switched off for the steps of the pattern on, off, off, on; rank 0 writes the step times."""
    sys.path.insert(0, str(ROOT / "examples" / "deepspeed_pipe"))
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    import koala_ds.deepspeed  # noqa: F401  (registers the Koala engine)
    from train import MICRO_BATCH, SEED_LAYERS, build_layers

    m = 8
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = PipelineModule(build_layers(dim), num_stages=2, loss_fn=torch.nn.functional.mse_loss,
                           partition_method="uniform", seed_layers=SEED_LAYERS)
    trace = os.path.join(os.path.dirname(out), "trace.json")
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": m,
              "train_batch_size": MICRO_BATCH * m, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
              "pipeline": {"pipe_partitioned": False, "grad_partitioned": False, "schedule": "koala",
                           "koala": {"schedule": schedule, "trace": trace}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    recorder = engine._koala_recorder
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(MICRO_BATCH, dim, generator=gen), torch.randn(MICRO_BATCH, 1, generator=gen))
            for _ in range(m)]
    times: dict[str, list[float]] = {"on": [], "off": []}
    for step in range(steps + 4):  # 4 warm-up steps, not counted
        on = step % 4 in (0, 3)
        object.__setattr__(engine, "_koala_recorder", recorder if on else None)
        t0 = time.perf_counter()
        engine.train_batch(iter(data))
        if step >= 4:
            times["on" if on else "off"].append((time.perf_counter() - t0) * 1e3)
    object.__setattr__(engine, "_koala_recorder", recorder)
    engine.close_trace()
    if engine.global_rank == 0:
        Path(out).write_text(json.dumps(times))
    deepspeed.comm.destroy_process_group()
    from koala_ds.deepspeed import wait_for_gloo_workers

    wait_for_gloo_workers()


def deepspeed_ab(steps: int, dim: int, schedule: str) -> dict[str, list[float]]:
    """--deepspeed: rank 0's step times with the trace on and off, from one torchrun."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", __file__,
               "--ds-worker", out, "--deepspeed", str(steps), "--ds-dim", str(dim), "--ds-schedule", schedule]
        subprocess.run(cmd, check=True, capture_output=True, timeout=1800, cwd=ROOT,
                       env=dict(os.environ, DS_ACCELERATOR="cpu"))
        return json.loads(Path(out).read_text())


def print_deepspeed(times: dict[str, list[float]], dim: int, schedule: str) -> None:
    on, off = times["on"], times["off"]
    # the pattern on, off, off, on: pair each traced step with the untraced step beside it
    diffs = [a - b for a, b in zip(on, off)]
    mean = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
    med_off = statistics.median(off)
    print(f"deepspeed example dim {dim}, {schedule}, p=2, one run: {len(on)} steps traced, {len(off)} not; "
          f"median step ms on {statistics.median(on):.2f}, off {med_off:.2f}; paired difference on - off "
          f"{mean:+.3f} ms +- {2 * se:.3f} (2 SE) = {mean / med_off * 100:+.2f}% of a step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--actions", type=int, default=24, help="actions per rank and step (zb-h1 at p=2: 3 x m)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--example", type=int, default=0, help="runs of the Megatron example with and without trace")
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--deepspeed", type=int, default=0, metavar="STEPS",
                    help="steps of the DeepSpeed example in one run, the trace switched on and off between them")
    ap.add_argument("--ds-dim", type=int, default=64)
    ap.add_argument("--ds-schedule", default="zb-h1")
    ap.add_argument("--ds-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ds_worker:
        deepspeed_worker(args.deepspeed, args.ds_dim, args.ds_schedule, args.ds_worker)
        return
    if args.deepspeed:
        print_deepspeed(deepspeed_ab(args.deepspeed, args.ds_dim, args.ds_schedule), args.ds_dim, args.ds_schedule)
    plain, traced = isolated(args.actions, args.steps)
    print(f"interpreter loop, per action: plain {plain:.3f} us, traced {traced:.3f} us, "
          f"added {traced - plain:.3f} us ({(traced - plain) * args.actions:.1f} us per step of {args.actions} "
          f"actions)")
    runs: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.example):
        for key in ("off", "on"):
            runs[key].append(example_run("trace" if key == "on" else None, args.iters))
    if args.example:
        for key, values in runs.items():
            print(f"example, trace {key}: median iteration ms per run {[round(v, 1) for v in values]}")
        off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
        print(f"example: median of runs off {off:.1f} ms, on {on:.1f} ms ({(on - off) / off * 100:+.1f}%)")


if __name__ == "__main__":
    main()
