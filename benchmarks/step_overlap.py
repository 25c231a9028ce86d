"""Whether the pipeline ranks ran into each other's steps, from a measured run's traces.

    python benchmarks/step_overlap.py /tmp/fid/work/megatron-gpt-8L-h256-s64-p2/trace_r0*.rank*.json
    python benchmarks/step_overlap.py trace.json trace.zb-h1.json

The simulator models one step at a time: every pipeline rank ends step n before any starts step
n + 1 (Megatron-LM's optimizer step reduces the gradients' norm over the model-parallel group,
DeepSpeed broadcasts the loss). The runtimes' traces (--koala-trace / "pipeline.koala.trace")
record each rank's `step` event; this pools every file given (schedules that took turns in one
run write a file each, their steps numbered over all of them) and, per pipeline and per ordered
pair of pipeline ranks (a, b), takes for every step n that both recorded (n + 1 on b) the gap
from a's end of step n to b's start of step n + 1 (ms): below 0, b started its next step while
a was still in this one. Printed per pair: steps, how many began early, the gaps' median and
minimum; and per step the smallest gap over all pairs (the "any" row). docs/profiling.md, "A step
is one step".
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from koala_ds.sim.measured import TraceError, read_rank_trace, trace_paths  # noqa: E402

#: (pipeline, pipeline rank) -> step number -> the rank's `step` event (start, end), ms
StepEvents = dict[tuple[int, int], dict[int, tuple[float, float]]]


def step_events(traces: list[str]) -> StepEvents:
    """Every given file's `step` events, pooled per (pipeline, pipeline rank)."""
    out: StepEvents = defaultdict(dict)
    for arg in traces:
        for path in trace_paths(arg):
            rank = read_rank_trace(path)
            out[(rank.pipeline, rank.rank)].update(rank.steps)
    return dict(out)


def gaps(events: StepEvents) -> dict[tuple[int, str], list[float]]:
    """(pipeline, pair) -> per step n, b's start of n + 1 less a's end of n (ms); pair 'a->b',
    and 'any': per n, the smallest over the pairs."""
    out: dict[tuple[int, str], list[float]] = defaultdict(list)
    for pipeline in sorted({p for p, _ in events}):
        ranks = sorted(r for p, r in events if p == pipeline)
        steps = sorted(set.intersection(*(set(events[(pipeline, r)]) for r in ranks)))
        for n in (n for n in steps if n + 1 in steps):
            each = {f"{a}->{b}": events[(pipeline, b)][n + 1][0] - events[(pipeline, a)][n][1]
                    for a in ranks for b in ranks if a != b}
            for pair, gap in each.items():
                out[(pipeline, pair)].append(gap)
            if each:
                out[(pipeline, "any")].append(min(each.values()))
    return dict(out)


def table(found: dict[tuple[int, str], list[float]]) -> str:
    lines = ["| pipeline | ranks a->b | steps | b began n + 1 before a ended n | median gap (ms) | min gap (ms) |",
             "|---|---|---|---|---|---|"]
    for (pipeline, pair), values in sorted(found.items(), key=lambda kv: (kv[0][0], kv[0][1] == "any", kv[0][1])):
        early = sum(g < 0 for g in values)
        lines.append(f"| {pipeline} | {pair} | {len(values)} | {early} | {statistics.median(values):+.1f} | "
                     f"{min(values):+.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", metavar="TRACE",
                    help="a traced run's FILE (its FILE.rank*.json are read) or its per-rank files; all pooled")
    args = ap.parse_args(argv)
    try:
        found = gaps(step_events(args.traces))
    except TraceError as exc:
        print(f"step_overlap.py: {exc}", file=sys.stderr)
        return 2
    if not found:
        print(f"step_overlap.py: {' '.join(args.traces)}: no two consecutive steps recorded by every pipeline rank "
              f"of one pipeline (give every rank's file)", file=sys.stderr)
        return 2
    print(f"$ python benchmarks/step_overlap.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(table(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
