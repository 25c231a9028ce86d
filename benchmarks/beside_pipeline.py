"""What a schedule's steps spend beside the pipeline, measured: Megatron's V-shape against interleaved.

    python benchmarks/beside_pipeline.py                           # gpt-4L-h64-s32, 6 rounds (~2 min)
    python benchmarks/beside_pipeline.py --size gpt-8L-h256-s64 --rounds 4 --out beside.txt
    python benchmarks/beside_pipeline.py --dry-run                 # the commands, nothing run

The cost model gives a profile one `step_overhead`: what a training step costs beside the
pipeline (its period less the pipeline's span), the same for every schedule of that v. On the
fidelity runs' traces `koala calibrate` found Megatron's V-shape steps paying 1.5-3.7 ms more
than interleaved ones (docs/profiling.md). Each round here is one torchrun of the Megatron
example at p = 2, v = 2 in which --base (default interleaved-1f1b) and --other (default zb-v)
take turns of --block iterations, both traced (--koala-trace), the schedule built first
alternating by round. Per schedule and round it prints the median over the kept steps (after
--warmup iterations) of: the time beside the pipeline, and per rank the time from its last
action's end to the end of forward_backward_func ("after-pipeline": the loss values' transfer
to the last rank, finalize_model_grads). Then, over the rounds, the mean and standard error of
other less base beside the pipeline.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity import (MEGATRON_SIZES, ROOT, BenchError, Candidate, Example, add_round_args,  # noqa: E402
                      check_round_args, end_report, refuse_out, report_head, run, schedule_file, work_folder)

from koala_ds.sim.calibrate import beside_samples  # noqa: E402  (what koala calibrate fits step_overhead on)
from koala_ds.sim.measured import TracedRun, load_runs, run_name  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default=list(MEGATRON_SIZES)[0], choices=list(MEGATRON_SIZES),
                    help="the Megatron example's size (default the first)")
    ap.add_argument("--base", default="interleaved-1f1b", metavar="NAME", help="default interleaved-1f1b")
    ap.add_argument("--other", default="zb-v", metavar="NAME", help="default zb-v")
    add_round_args(ap, 6, "iterations of a round, both schedules together (default 48)",
                   "first iterations of a round dropped (default 8)")
    args = ap.parse_args(argv)
    check_round_args(ap, args)
    return args


def after_pipeline(traced: TracedRun, rank: int) -> float:
    """The median "after-pipeline" event of `rank` over the run's kept steps (ms)."""
    kept = {s.number for s in traced.steps}
    f = next(f for f in traced.files if f.rank == rank)
    return statistics.median(e["dur"] / 1e3 for n, evs in f.events.items() if n in kept
                             for e in evs if e.get("name") == "after-pipeline")


def one_round(ex: Example, pair: list[Candidate], r: int, args, work: Path, say) -> dict[str, tuple]:
    """Per schedule name: (beside the pipeline, after-pipeline per rank), medians in ms."""
    first, other = pair[r % 2], pair[1 - r % 2]
    trace = work / f"r{r}.json"
    run(ex.run_cmd(first, args.iterations, work / f"r{r}_loss.json", trace=trace, alternate=(other,),
                   block=args.block), work / f"r{r}.log", ex.env(work), ROOT, args.dry_run, say)
    if args.dry_run:
        return {}
    files = sorted(str(p) for p in work.glob(f"r{r}.*rank*.json") if run_name(p).startswith(str(work / f"r{r}.")))
    out = {}
    for traced in load_runs(files, skip_steps=args.warmup):
        beside = statistics.median(beside_samples(traced))
        out[traced.schedule.name] = (beside, tuple(after_pipeline(traced, k) for k in range(ex.p)))
    return out


def _mean_se(values: list[float]) -> str:
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return f"{statistics.fmean(values):+.2f} ms (SE {se:.2f})"


def report(rounds: list[dict[str, tuple]], base: str, other: str, p: int) -> list[str]:
    ranks = " | ".join(f"after-pipeline rank {k}" for k in range(p))
    lines = [f"| round | schedule | beside the pipeline | {ranks} |", "|---|---|---|" + "---|" * p]
    for r, got in enumerate(rounds):
        for name in (base, other):
            beside, after = got[name]
            lines.append(f"| {r} | {name} | {beside:.2f} | " + " | ".join(f"{a:.2f}" for a in after) + " |")
    diffs = [got[other][0] - got[base][0] for got in rounds]
    lines += ["", f"{other} less {base} beside the pipeline, mean over {len(rounds)} rounds: {_mean_se(diffs)}"]
    for k in range(p):
        lines.append(f"after-pipeline rank {k}: {base} {statistics.fmean(g[base][1][k] for g in rounds):.2f} ms, "
                     f"{other} {statistics.fmean(g[other][1][k] for g in rounds):.2f} ms (means of the rounds)")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if refuse_out(args.out, "beside_pipeline.py"):
        return 2
    ex = Example("megatron", args.size, 2, dict(MEGATRON_SIZES[args.size]))
    say = (lambda s: print(s, file=sys.stderr, flush=True))
    work = work_folder(args, "koala-beside-")
    head = report_head("beside_pipeline.py", argv) + [
            f"megatron {ex.label} p=2 v=2: {args.base} and {args.other} taking turns of {args.block} in each of "
            f"{args.rounds} torchruns of {args.iterations} iterations, traced; kept after {args.warmup}; medians (ms)"]
    print("\n".join(head), flush=True)
    try:
        if not args.dry_run:
            work.mkdir(parents=True, exist_ok=True)
        pair = [Candidate(n, str(schedule_file(ex, Candidate(n, n, 2), work, args.dry_run, say)), 2)
                for n in (args.base, args.other)]
        rounds = [one_round(ex, pair, r, args, work, say) for r in range(args.rounds)]
    except BenchError as exc:
        print(f"beside_pipeline.py: {exc}", file=sys.stderr)
        return 1
    if args.dry_run:
        return 0
    return end_report(head, report(rounds, *(c.label for c in pair), ex.p), work, args.out)


if __name__ == "__main__":
    sys.exit(main())
