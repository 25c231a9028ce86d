"""Each schedule's speed by its iteration's position in a turn, from the examples' loss logs.

    python benchmarks/turn_positions.py /tmp/fid/work/megatron-gpt-8L-h256-s64-p2/calib_r*.json
    python benchmarks/turn_positions.py LOG... --skip 16

The examples' `--alternate-schedules` runs (the fidelity benchmark's calibration and paired
rounds) write `--loss-log` JSON with each iteration's schedule (`iteration_schedules`) and step
period (`period_ms`). Per log, and per position k in a turn (0: a turn's first iteration, after
another schedule's), this takes the first log's first schedule's median period at k over each other
schedule's (> 1: the other is faster) and prints their mean over the logs with its standard
error. A steady speed is the same at every k; where the first positions differ, what a switch
of schedule leaves behind (the ranks' phase, a model copy's cold caches) is in them
(docs/profiling.md, "A step is one step").
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def positions(log: dict, skip: int) -> dict[tuple[str, int], list[float]]:
    """(schedule, position in its turn) -> the periods of the iterations there, the first `skip` left out."""
    out: dict[tuple[str, int], list[float]] = defaultdict(list)
    previous, k = None, 0
    for i, (name, period) in enumerate(zip(log["iteration_schedules"], log["period_ms"])):
        k = k + 1 if name == previous else 0
        previous = name
        if i >= skip and period is not None:
            out[(Path(name).name, k)].append(period)
    return out


def ratios(logs: list[dict], skip: int) -> tuple[str, dict[tuple[str, int], list[float]]]:
    """The first schedule's name, and per (other schedule, k) its speed relative to it, one per log."""
    base = Path(logs[0]["iteration_schedules"][0]).name
    out: dict[tuple[str, int], list[float]] = defaultdict(list)
    for log in logs:
        by = positions(log, skip)
        for (name, k), periods in sorted(by.items()):
            if name != base and by.get((base, k)):
                out[(name, k)].append(statistics.median(by[(base, k)]) / statistics.median(periods))
    return base, out


def table(base: str, found: dict[tuple[str, int], list[float]], n_logs: int) -> str:
    ks = sorted({k for _, k in found})
    lines = [f"{base}'s median period over each schedule's, by position in a turn (mean over {n_logs} log(s), "
             f"its standard error)", "", "| schedule | " + " | ".join(f"k={k}" for k in ks) + " |",
             "|---|" + "---|" * len(ks)]
    for name in sorted({n for n, _ in found}):
        cells = []
        for k in ks:
            v = found.get((name, k), [])
            se = statistics.stdev(v) / len(v) ** 0.5 if len(v) > 1 else float("nan")
            cells.append(f"{statistics.mean(v):.3f} ({se:.3f})" if v else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", help="--loss-log files of runs in which schedules took turns")
    ap.add_argument("--skip", type=int, default=16, help="first iterations of each log left out (default 16)")
    args = ap.parse_args(argv)
    logs = []
    for name in args.logs:
        try:
            log = json.loads(Path(name).read_text(encoding="utf-8"))
            if not isinstance(log, dict) or not {"iteration_schedules", "period_ms"} <= set(log):
                raise KeyError("iteration_schedules")
        except (OSError, ValueError, KeyError) as exc:
            print(f"turn_positions.py: {name}: not a loss log of schedules taking turns "
                  f"({exc.__class__.__name__}: needs iteration_schedules and period_ms)", file=sys.stderr)
            return 2
        logs.append(log)
    print(f"$ python benchmarks/turn_positions.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(table(*ratios(logs, args.skip), len(logs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
