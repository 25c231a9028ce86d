"""Koala's schedules on torch.distributed.pipelining (koala_ds.torch) against torch's own classes.

    python benchmarks/torch_speed.py                    # p=2, m=8, zero and real compute, 7 rounds
    python benchmarks/torch_speed.py --rounds 12 --compute real --schedules 1f1b zb-h1 --control
    python benchmarks/torch_speed.py -p 4 --rounds 9 --compute real

For every library schedule that torch also ships (1f1b: Schedule1F1B, gpipe: ScheduleGPipe,
interleaved-1f1b: ScheduleInterleaved1F1B, looped-bfs: ScheduleLoopedBFS, zb-h1:
ScheduleInterleavedZeroBubble, zb-v: ScheduleZBVZeroBubble, dualpipe-v: ScheduleDualPipeV), one
launch of p gloo ranks (CPU) builds both, on stages with the same weights, and times them in the
same processes, alternating: each round runs every (schedule, engine) block once, in a new order (a fixed order favours
whichever runs after the other on a busy machine). A block is --steps training steps (step +
SGD update) between two barriers; its wall time per step is rank 0's, its CPU time per step
the sum of every rank's process (all threads: gloo's too). The table gives the median over
the rounds of each side and of their per-round ratio, and in how many rounds Koala's was at
most torch's. On a machine shared with other work (this one: 2 cores, often 10+ runnable
processes) wall time varies by 2x between identical runs; CPU time much less, so it is the
column to read there, next to the --control rows: a second instance of torch's own class timed
against the first in the same way, whose ratio (1 in a quiet machine) is the noise floor.

Compute: `zero` (a stage is one 8-wide linear layer: the runtimes' own cost, communication
included), `real` (a stage is --layers blocks of a --dim wide MLP on --batch samples per
microbatch: compute dominates).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this module, for the workers

PAIRS = {"1f1b": ("Schedule1F1B", 1), "gpipe": ("ScheduleGPipe", 1),
         "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2), "looped-bfs": ("ScheduleLoopedBFS", 2),
         "zb-h1": ("ScheduleInterleavedZeroBubble", 1), "zb-v": ("ScheduleZBVZeroBubble", 2),
         "dualpipe-v": ("ScheduleDualPipeV", 2)}
V_CLASSES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
#: Orders torch has a single-stage loop of its own for: koala_ds.torch runs them there by default
#: (own_loop=True); the "runtime" engine times them on the general runtime too (own_loop=False).
OWN_LOOPS = ("1f1b", "gpipe")
KOALA_ENGINES = ("koala", "runtime")
#: What each engine's rows say: Koala's schedule, on the general runtime, or (--control) a second
#: instance of torch's class in Koala's place: the same work, so its ratio is the machine's noise.
LABELS = {"koala": "{}", "runtime": "{} (own_loop=False)", "control": "{} (control: torch vs torch)"}


def _stage(index: int, spec: dict):
    import torch

    torch.manual_seed(index)
    dim = spec["dim"]
    layers = [m for _ in range(spec["layers"]) for m in (torch.nn.Linear(dim, dim), torch.nn.GELU())]
    return torch.nn.Sequential(*layers)


def _build(engine: str, name: str, rank: int, p: int, spec: dict):
    """(schedule object, its parameters, which stage indices it holds) for one side of a pair."""
    import torch
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    from koala_ds.torch import schedule, stage_indices

    class_name, v = PAIRS[name]
    m, loss = spec["m"], torch.nn.functional.mse_loss
    if engine in KOALA_ENGINES:
        indices = stage_indices(name, rank, p, m, v)
    else:
        mapping = generate_stage_to_rank_mapping(p, p * v, "v" if class_name in V_CLASSES else "loop")
        indices = tuple(s for s in range(p * v) if mapping[s] == rank)
    modules = [_stage(i, spec) for i in indices]
    stages = [PipelineStage(mod, i, p * v, torch.device("cpu")) for mod, i in zip(modules, indices)]
    if engine in KOALA_ENGINES:
        pipe = schedule(stages, m, loss, name, own_loop=engine == "koala")
    else:
        cls = getattr(schedules, class_name)
        pipe = cls(stages[0] if issubclass(cls, schedules.PipelineScheduleSingle) else stages, m, loss_fn=loss)
    params = [q for mod in modules for q in mod.parameters()]
    return pipe, torch.optim.SGD(params, lr=1e-3), indices, p * v


def _steps(built, data, steps: int) -> None:
    pipe, optimizer, indices, n = built
    x, y = data
    for _ in range(steps):
        pipe.step(*((x,) if 0 in indices else ()), target=y if n - 1 in indices else None)
        optimizer.step()
        optimizer.zero_grad()


def worker(rank: int, world: int, spec: dict) -> dict:
    """Every (schedule, engine) block once per round, in an order every rank draws alike."""
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(0)
    rows = spec["m"] * spec["batch"]
    data = (torch.randn(rows, spec["dim"], generator=gen), torch.randn(rows, spec["dim"], generator=gen))
    blocks = [(name, engine) for name in spec["schedules"] for engine in ("koala", "torch")]
    blocks += [(name, "runtime") for name in spec["schedules"] if name in OWN_LOOPS]
    blocks += [(name, "control") for name in spec["schedules"] if spec["control"]]
    order = random.Random(spec["seed"])
    order.shuffle(blocks)  # built and warmed up in a random order too: no side is always first
    built = {block: _build(block[1], block[0], rank, world, spec) for block in blocks}
    for block in blocks:  # warm-up: metadata inference, first sends
        _steps(built[block], data, 2)
    times = {block: [] for block in blocks}
    for _ in range(spec["rounds"]):
        order.shuffle(blocks)
        for block in blocks:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            _steps(built[block], data, spec["steps"])
            cpu = time.process_time() - c0
            dist.barrier()
            times[block].append(((time.perf_counter() - t0) * 1000 / spec["steps"], cpu * 1000 / spec["steps"]))
    out = {f"{name}|{engine}": t for (name, engine), t in times.items()}
    out["streams"] = {f"{name}|{engine}": _same_stream(built[(name, engine)][0], built[(name, "torch")][0], rank)
                      for name, engine in blocks if engine != "torch"}
    return out


def _same_stream(ours, theirs, rank: int) -> str:
    """Whether this rank runs the same lowered stream (compute, sends, receives) under both:
    then a difference in time is the machine's, not the runtime's."""
    if not hasattr(ours, "pipeline_order_with_comms") and not hasattr(theirs, "pipeline_order_with_comms"):
        return "same loop"  # both torch's single-stage loop (own_loop=True)
    if not hasattr(theirs, "pipeline_order_with_comms"):
        return "runtime vs loop"  # the general runtime against torch's single-stage loop
    same = [str(a) for a in ours.pipeline_order_with_comms[rank]] == \
        [str(a) for a in theirs.pipeline_order_with_comms[rank]]
    return "same" if same else "differs"


def _side(results: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(rank 0's wall ms per step, all ranks' CPU ms per step), one entry per round."""
    wall = [w for w, _ in results[0][key]]
    cpu = [sum(r[key][i][1] for r in results) for i in range(len(wall))]
    return wall, cpu


def table(results: list[dict], spec: dict, p: int, compute: str) -> list[str]:
    lines = []
    rows = [(name, "koala") for name in spec["schedules"]]
    rows += [(name, "runtime") for name in spec["schedules"] if name in OWN_LOOPS]
    rows += [(name, "control") for name in spec["schedules"] if spec["control"]]
    for name, engine in rows:
        streams = {r["streams"][f"{name}|{engine}"] for r in results}
        stream = streams.pop() if len(streams) == 1 else "differs"
        row = [LABELS[engine].format(name), PAIRS[name][0], str(p), str(spec["m"]), str(PAIRS[name][1]), compute,
               stream]
        for ours, theirs in zip(_side(results, f"{name}|{engine}"), _side(results, f"{name}|torch")):
            ratios = [a / b for a, b in zip(ours, theirs)]
            row += [f"{statistics.median(ours):.1f}", f"{statistics.median(theirs):.1f}",
                    f"{statistics.median(ratios):.3f}", f"{sum(a <= b for a, b in zip(ours, theirs))}/{len(ratios)}"]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def main() -> None:
    from koala_ds.runtime.spawn import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-p", type=int, default=2)
    parser.add_argument("-m", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--compute", choices=["zero", "real", "both"], default="both")
    parser.add_argument("--dim", type=int, default=256, help="real compute: MLP width")
    parser.add_argument("--layers", type=int, default=4, help="real compute: blocks per stage")
    parser.add_argument("--batch", type=int, default=16, help="real compute: samples per microbatch")
    parser.add_argument("--schedules", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--control", action="store_true",
                        help="also time a second instance of each torch class against the first (the noise floor)")
    args = parser.parse_args()
    print("| schedule | torch class | p | m | v | compute | lowered stream | wall ms/step koala | torch "
          "| koala / torch | rounds koala <= torch | CPU ms/step koala | torch | koala / torch "
          "| rounds koala <= torch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for compute in (("zero", "real") if args.compute == "both" else (args.compute,)):
        size = {"dim": args.dim, "layers": args.layers, "batch": args.batch} if compute == "real" else \
            {"dim": 8, "layers": 1, "batch": 1}
        spec = {"m": args.m, "rounds": args.rounds, "steps": args.steps, "schedules": args.schedules,
                "seed": args.seed, "control": args.control, **size}
        t0 = time.perf_counter()
        results = [r["value"] for r in launch(worker, args.p, spec, timeout_s=1800)]
        for line in table(results, spec, args.p, compute):
            print(line, flush=True)
        print(f"<!-- {compute}: {time.perf_counter() - t0:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
