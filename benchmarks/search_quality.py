"""Search quality benchmark: the search against the library, the lower bound and CP-SAT.

One row per configuration: the best library schedule that fits the memory limit, the search's
makespan, the speedup over that schedule and over 1f1b (v = 1 only), the lower bound and the gap
to it, the exact optimum where CP-SAT proves it (for the searched schedule's placement), and the
search's wall time. The gap column uses the exact optimum where proven, else the lower bound.

    python benchmarks/search_quality.py            # the full suite (several minutes)
    python benchmarks/search_quality.py --quick    # shorter budgets
    python benchmarks/search_quality.py --only 13 14 --relax-time 200   # some rows, longer relaxations
    python benchmarks/search_quality.py --only 13 14 --exact-time 200 --save benchmarks/results/optima
    python benchmarks/search_quality.py --only 1 4 12 --generations 3 --exact-max-actions 0 --relax-time 0
                                                       # deterministic makespans (before/after a change)

Where CP-SAT does not prove the optimum, relaxations that keep one-action-at-a-time on some
ranks only (koala_ds.search.exact.relaxed_bound) give a proven bound (column 'relaxed'); the gap
is to the largest proven bound.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from koala_ds.dsl import print_schedule
from koala_ds.sim import CostProfile, StageCost
from koala_ds.search import SearchProblem, best_predefined, one_f_one_b_peak, relative_gap, search
from koala_ds.search.exact import relaxed_bound, solve_exact


def uniform(S: int, lat: float = 0.05) -> CostProfile:
    st = StageCost(1.0, 1.0, 1.0, 100.0, 25.0)
    return CostProfile((st,) * S, lat, source="uniform")


def heavy_last(S: int, lat: float = 0.05) -> CostProfile:
    st = StageCost(1.0, 1.05, 0.95, 100.0, 25.0)
    last = StageCost(1.6, 1.8, 1.4, 140.0, 35.0)
    return CostProfile((st,) * (S - 1) + (last,), lat, source="heavy-last")


def slow_middle(S: int, lat: float = 0.05) -> CostProfile:
    st = StageCost(1.0, 1.0, 1.0, 100.0, 25.0)
    slow = StageCost(1.5, 1.5, 1.5, 100.0, 25.0)
    stages = [st] * S
    stages[S // 2] = slow
    return CostProfile(tuple(stages), lat, source="slow-middle")


def comm_heavy(S: int) -> CostProfile:
    p = uniform(S, lat=0.5)
    return CostProfile(p.stages, 0.5, source="comm-heavy")


@dataclass
class Config:
    label: str
    profile: CostProfile
    p: int
    m: int
    v: int
    tight: bool = False  # memory limit at 60% of 1F1B's peak


def suite() -> list[Config]:
    out = []
    cfgs = [
        ("uniform", uniform, 4, 8, 1, False),
        ("uniform", uniform, 8, 32, 1, False),
        ("uniform", uniform, 16, 64, 1, False),
        ("uniform", uniform, 4, 16, 2, False),
        ("heavy-last", heavy_last, 4, 16, 1, False),
        ("heavy-last", heavy_last, 8, 16, 1, False),
        ("heavy-last", heavy_last, 8, 16, 2, False),
        ("slow-middle", slow_middle, 4, 4, 1, False),
        ("slow-middle", slow_middle, 8, 16, 1, False),
        ("comm-heavy", comm_heavy, 4, 8, 1, False),
        ("comm-heavy", comm_heavy, 8, 32, 2, False),
        ("mem-tight", uniform, 4, 8, 1, True),
        ("mem-tight", heavy_last, 8, 16, 1, True),
        ("mem-tight", uniform, 4, 8, 2, True),
    ]
    for label, make, p, m, v, tight in cfgs:
        out.append(Config(label, make(p * v), p, m, v, tight))
    return out


def budget(cfg: Config, quick: bool) -> float:
    b = 60.0 if cfg.p >= 16 else 10.0
    return b / 4 if quick else b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a quarter of the time budgets")
    ap.add_argument("--exact-time", type=float, default=30.0, help="CP-SAT time limit per case (default 30 s)")
    ap.add_argument("--exact-max-actions", type=int, default=400,
                    help="run CP-SAT only when the configuration has at most this many actions")
    ap.add_argument("--relax-time", type=float, default=300.0, metavar="S",
                    help="time limit of the relaxation bound where CP-SAT did not prove the optimum and the gap "
                         "is above zero (default 300 s, one worker; 0 = off)")
    ap.add_argument("--workers", type=int, default=2, help="CP-SAT workers (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--placement", default="default",
                    help="placements searched (default: the single-copy ones); 'any' adds bidirectional")
    ap.add_argument("--only", type=int, nargs="*", help="row numbers to run")
    ap.add_argument("--budget", type=float, help="the search's time budget for every row (default 10 s, 60 s at p=16)")
    ap.add_argument("--generations", type=int, metavar="N",
                    help="stop each row's search after N generations instead of a time budget: with --seed, the "
                         "same makespans on every run (for before/after comparisons)")
    ap.add_argument("--save", metavar="DIR", help="write CP-SAT's best schedule of each row it ran on "
                    "(rowN.koala) and the row's profile (rowN.profile.json) to DIR")
    ap.add_argument("--verbose", action="store_true", help="log the exact solver's and the relaxations' steps")
    args = ap.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
    if args.save:
        Path(args.save).mkdir(parents=True, exist_ok=True)
    rows, gaps = [], []
    never_worse = True
    header = ("#", "config", "p", "m", "v", "limit MB", "best predefined (fits)", "pred ms", "search ms",
              "vs pred", "vs 1f1b", "bound", "gap LB", "exact", "CP-SAT found", "relaxed", "gap", "placement", "time s")
    for i, cfg in enumerate(suite(), 1):
        if args.only and i not in args.only:
            continue
        limit = 0.6 * one_f_one_b_peak(cfg.profile, cfg.p, cfg.m, cfg.v) if cfg.tight else None
        problem = SearchProblem(cfg.profile, cfg.p, cfg.m, cfg.v, "split", limit, placement=args.placement)
        t0 = time.perf_counter()
        if args.generations is not None:
            res = search(problem, time_budget=None, generations=args.generations, seed=args.seed)
        else:
            res = search(problem, time_budget=args.budget or budget(cfg, args.quick), seed=args.seed)
        wall = time.perf_counter() - t0
        pred = best_predefined(res.library)
        base = next((r.makespan for r in res.library if r.name == "1f1b"), None)
        exact_txt, found_txt, relaxed_txt, ref = "-", "-", "-", res.lower_bound
        actions = cfg.p * cfg.m * cfg.v * 3
        if actions <= args.exact_max_actions:
            part = problem.part_for(res.schedule.placement)
            ex = solve_exact(problem, part, hint=res.schedule, time_limit=args.exact_time, workers=args.workers,
                             seed=args.seed)
            if ex.makespan is not None:
                found_txt = f"{ex.makespan:.4g}"
                if args.save:
                    out = Path(args.save)
                    (out / f"row{i}.koala").write_text(print_schedule(ex.schedule.with_name(f"cp-sat-row{i}")))
                    (out / f"row{i}.profile.json").write_text(cfg.profile.to_json())
            if ex.status == "optimal":
                exact_txt, ref = f"{ex.bound:.4g}", ex.bound
            elif ex.status == "feasible":
                exact_txt = f">={ex.bound:.4g}"
                ref = max(ref, ex.bound)
            else:
                exact_txt = ex.status
            if ex.status != "optimal" and args.relax_time > 0 and relative_gap(res.makespan, ref) > 0:
                # one worker: the ranks it adds follow from the seed (with several, from timing)
                rb = relaxed_bound(problem, part, hint=res.schedule, time_limit=args.relax_time, workers=1,
                                   seed=args.seed)
                relaxed_txt = f"{rb.bound:.4g}" + (" opt" if rb.optimal else f" r{','.join(map(str, rb.machines))}")
                ref = max(ref, rb.bound)
        gap = relative_gap(res.makespan, ref)
        gaps.append(gap)
        if pred is not None and res.makespan > pred.makespan + 1e-9:
            never_worse = False
        rows.append((i, cfg.label, cfg.p, cfg.m, cfg.v, f"{problem.memory_limit_mb:.5g}" + ("*" if cfg.tight else ""),
                     pred.name if pred else "(none fits)", f"{pred.makespan:.4g}" if pred else "-",
                     f"{res.makespan:.4g}", f"{pred.makespan / res.makespan:.3f}x" if pred else "-",
                     f"{base / res.makespan:.3f}x" if base else "-", f"{res.lower_bound:.4g}",
                     f"{res.gap:+.2%}", exact_txt, found_txt, relaxed_txt, f"{gap:+.2%}", res.schedule.placement.describe(),
                     f"{wall:.1f}"))
        print(f"done {i}: {cfg.label} p={cfg.p} m={cfg.m} v={cfg.v}", file=sys.stderr, flush=True)
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[k]) for r in cells) for k in range(len(header))]
    for n, r in enumerate(cells):
        print("  ".join(f"{c:>{w}}" for c, w in zip(r, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))
    if gaps:
        print(f"\nmedian gap {statistics.median(gaps):+.2%}, worst gap {max(gaps):+.2%} "
              f"(to the exact optimum where CP-SAT proved it, else to the best proven bound)")
        print("never worse than the best predefined schedule that fits: " + ("yes" if never_worse else "NO"))
        print("limit MB: 1F1B's peak for the model; * = 60% of it (memory-tight)")
        print(f"exact: CP-SAT ({args.exact_time:g} s, {args.workers} workers, hinted with the search's result): the "
              "optimum, or >= its proven bound; CP-SAT found: the best schedule it found in that time")
        if args.relax_time > 0:
            print(f"relaxed: proven bound of relaxations with one action at a time on ranks rN only ({args.relax_time:g} s, 1 worker; "
                  "opt = the relaxation's optimum is a schedule, so optimal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
