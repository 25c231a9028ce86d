"""Does taking turns in one run change a schedule's step time? The A/B behind fidelity.py's paired rounds.

    python benchmarks/turns_bias.py              # DeepSpeed --dim 1024: 1f1b and zb-v (v = 2), 5 rounds (~7 min)
    python benchmarks/turns_bias.py --engine megatron --size gpt-8L-h256-s64 --other zb-h1
    python benchmarks/turns_bias.py --other best.koala --v 2 --placement vshape   # a searched schedule
    python benchmarks/turns_bias.py --dry-run    # the commands, nothing run

fidelity.py's paired rounds time the schedules taking turns in one torchrun (the examples'
--alternate-schedules), so that a drift of the machine hits them alike; a schedule of another v
or placement takes its turns on a model copy of its own in that process. A user runs one
schedule in a process of its own. Each round here runs four torchruns, in an order rotated by
one every round: A alone and B alone (--iterations each), A and B taking turns of --block
iterations with A's engine built first, and the same with B's first (2 x --iterations), each
schedule as its exported JSON file (koala export), as fidelity.py gives them. Kept: the
iterations after --warmup and, taking turns, all but the first of each turn; a round's figure
per schedule is the median of its kept step periods (--loss-log period_ms). It prints each
round's medians and, over the rounds, the mean and standard error of: B's speedup over A alone
(fresh) and taking turns; each schedule's step taking turns over its step alone.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity import (MEGATRON_SIZES, MICROBATCHES, ROOT, BenchError, Candidate, Example,  # noqa: E402
                      add_round_args, check_round_args, end_report, read_schedules, read_times, refuse_out,
                      report_head, run, schedule_file, work_folder)

from koala_ds.core.ir import KoalaError  # noqa: E402
from koala_ds.resolve import load_schedule  # noqa: E402
from koala_ds.runtime.turns import kept_periods  # noqa: E402

#: the runs of a round: (label, the schedules in the order their engines are built)
RUNS = (("A alone", "A"), ("B alone", "B"), ("A, B taking turns", "AB"), ("B, A taking turns", "BA"))


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("deepspeed", "megatron"), default="deepspeed")
    ap.add_argument("--size", default=None, help="DeepSpeed: --dim N (default 1024); Megatron: one of "
                                                 f"{', '.join(MEGATRON_SIZES)} (default the second)")
    ap.add_argument("--base", default="1f1b", metavar="NAME", help="schedule A (default 1f1b)")
    ap.add_argument("--other", default="zb-v", metavar="NAME", help="schedule B (default zb-v)")
    ap.add_argument("--v", type=int, default=None, help="B's chunks per rank (default: the first of 1, 2 it is "
                                                        "made for)")
    ap.add_argument("--placement", default=None, choices=("linear", "interleaved", "vshape"),
                    help="B's placement (default: the schedule's own)")
    add_round_args(ap, 5, "iterations of a run alone (taking turns: twice)", "first iterations of a run dropped "
                   "(default 8)")
    args = ap.parse_args(argv)
    check_round_args(ap, args)
    if args.size is None:
        args.size = list(MEGATRON_SIZES)[1] if args.engine == "megatron" else "1024"
    if args.engine == "megatron" and args.size not in MEGATRON_SIZES:
        ap.error(f"--size: one of {', '.join(MEGATRON_SIZES)} for --engine megatron")
    if args.engine == "deepspeed" and not args.size.isdigit():
        ap.error("--size: the DeepSpeed example's --dim, a whole number (e.g. 1024)")
    return args


def example(args) -> Example:
    if args.engine == "megatron":
        return Example("megatron", args.size, 2, dict(MEGATRON_SIZES[args.size]))
    return Example("deepspeed", f"dim{args.size}", 2, {"dim": int(args.size)})


def candidate(spec: str, flag: str, p: int, v: int | None = None, placement: str | None = None) -> Candidate:
    """`spec` (a library name or a file) as it runs: its v (`v`, else the first of 1, 2 it is
    made for) and placement (`placement`, else its own, koala_ds.resolve); `flag` names it in an error."""
    for tried in [v] if v else [1, 2]:
        try:
            schedule = load_schedule(spec, p, MICROBATCHES, tried)
        except (KoalaError, OSError) as exc:
            why = exc
            continue
        return Candidate(spec, spec, tried, placement or schedule.placement.style)
    raise BenchError(f"{flag} {spec}: {why}")


def candidates(args, p: int) -> dict[str, Candidate]:
    return {"A": candidate(args.base, "--base", p), "B": candidate(args.other, "--other", p, args.v, args.placement)}


def one_round(ex: Example, files: dict[str, Candidate], r: int, args, work: Path, say) -> dict[str, dict[str, float]]:
    """Per run label, each schedule's median kept step period (ms) in that run."""
    out = {}
    for label, order in RUNS[r % len(RUNS):] + RUNS[:r % len(RUNS)]:
        log = work / f"r{r}_{order}.json"
        first, rest = files[order[0]], tuple(files[k] for k in order[1:])
        iterations = args.iterations * len(order)
        run(ex.run_cmd(first, iterations, log, alternate=rest, block=args.block), log.with_suffix(".log"),
            ex.env(work), ROOT, args.dry_run, say)
        if args.dry_run:
            continue
        times = read_times(ex, log)
        if len(order) == 1:
            out[label] = {order: statistics.median(times[args.warmup:])}
            continue
        kept = kept_periods(times, read_schedules(log), args.warmup, args.block)
        out[label] = {k: statistics.median(kept[files[k].schedule]) for k in order if kept.get(files[k].schedule)}
    return out


def _mean_se(values: list[float]) -> str:
    if not values:
        return "-"
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return f"{statistics.fmean(values):.3f} (SE {se:.3f}; rounds {' '.join(f'{x:.3f}' for x in values)})"


def report(rounds: list[dict[str, dict[str, float]]], names: dict[str, str]) -> list[str]:
    a, b = names["A"], names["B"]
    lines = [f"| round | {a} alone | {b} alone | {a}, {b} taking turns ({a} first) | {b}, {a} taking turns "
             f"({b} first) |", "|---|---|---|---|---|"]
    for r, got in enumerate(rounds):
        ab, ba = got[RUNS[2][0]], got[RUNS[3][0]]
        lines.append(f"| {r} | {got[RUNS[0][0]]['A']:.1f} | {got[RUNS[1][0]]['B']:.1f} | {ab['A']:.1f}, {ab['B']:.1f} "
                     f"| {ba['B']:.1f}, {ba['A']:.1f} |")
    alone = [(g[RUNS[0][0]]["A"], g[RUNS[1][0]]["B"]) for g in rounds]
    turns = [(g[RUNS[2][0]], g[RUNS[3][0]]) for g in rounds]
    lines += ["", "over the rounds, mean (standard error):",
              f"{b} over {a}, each alone (fresh): {_mean_se([x / y for x, y in alone])}",
              f"{b} over {a}, taking turns, {a} first: {_mean_se([t['A'] / t['B'] for t, _ in turns])}",
              f"{b} over {a}, taking turns, {b} first: {_mean_se([t['A'] / t['B'] for _, t in turns])}",
              f"{a} taking turns / alone, {a} first: {_mean_se([t['A'] / x for (t, _), (x, _) in zip(turns, alone)])}",
              f"{a} taking turns / alone, {b} first: {_mean_se([t['A'] / x for (_, t), (x, _) in zip(turns, alone)])}",
              f"{b} taking turns / alone, {a} first: {_mean_se([t['B'] / y for (t, _), (_, y) in zip(turns, alone)])}",
              f"{b} taking turns / alone, {b} first: {_mean_se([t['B'] / y for (_, t), (_, y) in zip(turns, alone)])}"]
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if refuse_out(args.out, "turns_bias.py"):
        return 2
    ex = example(args)
    say = (lambda s: print(s, file=sys.stderr, flush=True))
    work = work_folder(args, "koala-turns-")
    head = report_head("turns_bias.py", argv) + [
            f"{ex.engine} {ex.label} p={ex.p}: A = {args.base}, B = {args.other}; {args.rounds} rounds of 4 torchruns "
            f"(alone: {args.iterations} iterations; taking turns: {2 * args.iterations}, turns of {args.block}); "
            f"kept: after {args.warmup} iterations, and the first of each turn dropped; per run the median step "
            f"period (ms)"]
    print("\n".join(head), flush=True)
    try:
        if not args.dry_run:
            work.mkdir(parents=True, exist_ok=True)
        cands = candidates(args, ex.p)
        files = {k: Candidate(c.label, str(schedule_file(ex, c, work, args.dry_run, say)), c.v, c.placement)
                 for k, c in cands.items()}
        rounds = [one_round(ex, files, r, args, work, say) for r in range(args.rounds)]
    except BenchError as exc:
        print(f"turns_bias.py: {exc}", file=sys.stderr)
        return 1
    if args.dry_run:
        return 0
    return end_report(head, report(rounds, {"A": Path(args.base).name, "B": Path(args.other).name}), work, args.out)


if __name__ == "__main__":
    sys.exit(main())
