"""The split searched together with the schedule (issue 17): per configuration, the uniform split
with the best predefined schedule, the uniform split with the searched schedule, the searched
split with 1F1B (interleaved-1F1B for v > 1), and the joint answer; its speed over the first,
the joint lower bound and the gap to it, and the wall time of the joint search.

    python benchmarks/partition_search.py [--budget 30] [--seed 0] [--only N]

Profiles (bundled, koala_ds/profiles; derived from ../shared/profiles/h200-gpt1.3b-p8.json by
benchmarks/make_layer_profiles.py): gpt-largevocab-32L (vocab 200064: the LM head is worth ~3
layers of F + I + W, 4 of forward) and gpt1.3b-24L (the measured model's own per-layer form).
Targets (issue 17): at p=8, m=32 on gpt-largevocab-32L the joint answer >= 1.10x the uniform
split with the best predefined schedule, never slower than either single-sided answer, in
under 60 s on one core.
"""
from __future__ import annotations

import argparse
import time

from koala_ds.commands.table import format_table
from koala_ds.search.partition import search_partition
from koala_ds.sim.layers import load_layer_profile, partition_text

CASES = [  # (profile, p, m, v, memory limit MB (None: the profile's))
    ("gpt-largevocab-32L", 4, 32, 1, None),
    ("gpt-largevocab-32L", 8, 32, 1, None),
    ("gpt-largevocab-32L", 8, 32, 1, 30000.0),
    ("gpt-largevocab-32L", 4, 16, 2, None),
    ("gpt1.3b-24L", 8, 32, 1, None),
]


def cell(ans) -> str:
    return "-" if ans is None else f"{ans.makespan:.1f}"


def run(case, budget: float, seed: int) -> tuple:
    name, p, m, v, limit = case
    started = time.process_time()
    res = search_partition(load_layer_profile(name), p, m, v, limit, budget, seed)
    cpu = time.process_time() - started
    j = res.joint
    config = f"{name} p={p} m={m} v={v}" + (f" M={limit:g}" if limit else "")
    sides = (res.uniform_predefined, res.uniform_searched, res.split_baseline)
    never_slower = all(s is None or j.makespan <= s.makespan * (1 + 1e-12) for s in sides)
    base = res.uniform_predefined
    return (config, f"{cell(base)} ({base.schedule_name})" if base else "-", cell(res.uniform_searched),
            f"{cell(res.split_baseline)} ({partition_text(res.split_baseline.partition)})" if res.split_baseline else "-",
            f"{j.makespan:.1f} ({partition_text(j.partition)}, {j.schedule_name})",
            "-" if res.speedup is None else f"{res.speedup:.2f}x", f"{res.bound.value:.1f}", f"{res.gap:+.2%}",
            "yes" if never_slower else "NO", f"{res.wall_s:.1f} / {cpu:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=30.0, help="time budget of each joint search (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", type=int, default=None, help="run only case N (1-based)")
    args = ap.parse_args()
    cases = CASES if args.only is None else [CASES[args.only - 1]]
    rows = [run(c, args.budget, args.seed) for c in cases]
    print(format_table(rows, ("configuration", "uniform + best predefined", "uniform + searched",
                              "searched split + 1f1b", "joint (split, schedule)", "over uniform + predefined",
                              "joint bound", "gap", "never slower", "wall / cpu s"), "<>>><>>><>"))


if __name__ == "__main__":
    main()
