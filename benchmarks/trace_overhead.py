"""What recording a measured trace (koala_ds/runtime/trace_record.py) costs a training step.

1. In isolation (--actions N, --steps K): the interpreter loop of the Megatron runtime over a
   program of no-op actions, plain and with the recorder's marks (`_traced`), each action's
   input wait through `timed_wait` as a recorded step does, and `end_step` (formatting and the
   one write per step) included: the added microseconds per action.
2. --example R: the Megatron example (examples/megatron_gpt, p=2, zb-h1, gloo on CPU), R runs
   with and R without --koala-trace, alternating; the median iteration time of each run
   (iterations after the first two).

    .venv/bin/python benchmarks/trace_overhead.py --actions 24 --steps 2000 --example 3
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--actions", type=int, default=24, help="actions per rank and step (zb-h1 at p=2: 3 x m)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--example", type=int, default=0, help="runs of the Megatron example with and without trace")
    ap.add_argument("--iters", type=int, default=12)
    args = ap.parse_args()
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
