"""How fast the simulator evaluates schedules (actions per second), for several sizes.

    python benchmarks/sim_speed.py [--runs 7] [--clock cpu|wall]

For each configuration it times four ways in:
  codes    Simulator.makespan(int codes, check=False): the search's inner loop
  checked  Simulator.makespan(Actions): converts and checks the orders first
  result   simulate(schedule, timeline=False): makespan, busy/idle, memory
  timeline simulate(schedule): everything, with the per-action timeline
Each figure is the median of --runs runs; a run repeats the call enough to last ~50 ms.
--clock cpu (default) times the process's CPU time, which stays fair on a shared, busy machine;
--clock wall times the wall clock (use it on an idle machine).
Target (issue 3): >= 500,000 actions/s at p=8, m=32, split backward (768 actions, ~1.5 ms).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from koala_ds import library
from koala_ds.resolve import load_schedule
from koala_ds.sim import CostProfile, Simulator, simulate

CASES = [  # (schedule, p, m, v)
    ("1f1b", 4, 16, 1),
    ("zb-h1", 8, 32, 1),
    ("interleaved-1f1b", 8, 32, 2),
    ("zb-v", 8, 32, 2),
    ("zb-h1", 16, 64, 1),
    ("zb-v", 16, 128, 2),
    ("zb-h1", 32, 256, 1),
    ("zb-v", 32, 256, 2),
]


def per_call(fn, runs: int, clock=time.process_time) -> float:
    """Median seconds per call over `runs` runs."""
    t0 = clock()
    fn()
    once = max(clock() - t0, 1e-6)
    reps = max(1, int(0.05 / once))
    samples = []
    for _ in range(runs):
        t0 = clock()
        for _ in range(reps):
            fn()
        samples.append((clock() - t0) / reps)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="runs per figure (median), default 7")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: process CPU time (default, fair on a busy machine); wall: wall clock")
    args = parser.parse_args(argv)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"median of {args.runs} runs, {args.clock} time; ms per call / million actions per second")
    header = f"{'schedule':<18} {'p':>3} {'m':>4} {'v':>2} {'actions':>8}  " + "  ".join(
        f"{k:>17}" for k in ("codes", "checked", "result", "timeline"))
    print(header)
    for name, p, m, v in CASES:
        if library.get(name).supports(p, m, v) is not None:
            print(f"{name:<18} {p:>3} {m:>4} {v:>2}  (not supported)")
            continue
        schedule = load_schedule(name, p, m, v)
        profile = CostProfile.uniform(schedule.num_stages, 1.0, 1.1, 0.9, 100.0, 20.0, p2p_latency=0.05,
                                      memory_limit_mb=10_000.0)
        sim = Simulator(profile, schedule.placement, m, schedule.backward)
        codes = sim.encode(schedule.ranks)
        n = schedule.num_actions
        timings = [
            per_call(lambda: sim.makespan(codes, check=False), args.runs, clock),
            per_call(lambda: sim.makespan(schedule.ranks), args.runs, clock),
            per_call(lambda: simulate(schedule, profile, timeline=False), args.runs, clock),
            per_call(lambda: simulate(schedule, profile), args.runs, clock),
        ]
        cells = "  ".join(f"{t * 1e3:8.3f} / {n / t / 1e6:5.2f}" + " " for t in timings)
        print(f"{name:<18} {p:>3} {m:>4} {v:>2} {n:>8}  {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
