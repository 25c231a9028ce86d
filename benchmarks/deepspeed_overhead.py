"""Step time of Koala's DeepSpeed engine vs DeepSpeed's stock TrainSchedule (same model, same data).

Runs one multi-process CPU job (gloo), trains the same PipelineModule under the stock engine
and under KoalaPipelineEngine with the 1f1b schedule, alternating the two for several rounds so
that machine load drifts hit both, and prints the median step time over `--steps` measured
steps per round (after `--warmup` steps), and the ratio Koala / stock (target <= 1.03).

    python benchmarks/deepspeed_overhead.py [--pp 2] [--dim 512] [--blocks 8] [--gas 8] [--mbs 16]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

#: The test and benchmark harness (deepspeed_jobs, engine_runs) lives in tests/, outside the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from deepspeed_jobs import launch, train_worker  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks (processes)")
    parser.add_argument("--dim", type=int, default=512, help="hidden size of each linear block")
    parser.add_argument("--blocks", type=int, default=8, help="linear blocks in the model")
    parser.add_argument("--gas", type=int, default=8, help="microbatches per step (gradient accumulation)")
    parser.add_argument("--mbs", type=int, default=16, help="micro batch size")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per engine")
    parser.add_argument("--extra", nargs="*", default=["zb-h1"], help="more Koala schedules to list (v=1)")
    args = parser.parse_args()

    rows = [("stock TrainSchedule", None), ("koala 1f1b", "1f1b")] + [(f"koala {n}", n) for n in args.extra]
    cases = []
    for rnd in range(args.rounds):
        for label, schedule in rows:
            cases.append({"label": f"{label}#{rnd}", "schedule": schedule})
    spec = {"pp": args.pp, "gas": args.gas, "mbs": args.mbs, "dim": args.dim, "blocks": args.blocks,
            "steps": args.warmup + args.steps, "cases": cases, "eval": False, "params": False}
    results = launch(train_worker, args.pp, spec, timeout_s=1800)
    # a step ends on every rank at the same optimizer step; rank 0 also waits for the others
    times: dict[str, list[float]] = {label: [] for label, _ in rows}
    for case in cases:
        label = case["label"].split("#")[0]
        per_rank = [r["value"]["cases"][case["label"]]["times"][args.warmup:] for r in results]
        times[label] += [max(step) for step in zip(*per_rank)]
    stock = statistics.median(times[rows[0][0]])
    print(f"pp={args.pp} dim={args.dim} blocks={args.blocks} microbatches={args.gas} micro batch={args.mbs}; "
          f"{args.rounds} rounds x {args.steps} steps per engine (CPU, gloo)")
    print(f"{'engine':<22} {'median ms':>10} {'p25 ms':>9} {'p75 ms':>9} {'vs stock':>9}")
    for label, _ in rows:
        values = sorted(times[label])
        q = statistics.quantiles(values, n=4)
        med = statistics.median(values)
        print(f"{label:<22} {med * 1e3:>10.2f} {q[0] * 1e3:>9.2f} {q[2] * 1e3:>9.2f} {med / stock:>9.3f}")
    ratio = statistics.median(times["koala 1f1b"]) / stock
    print(f"ratio koala 1f1b / stock = {ratio:.3f} (target <= 1.03): {'OK' if ratio <= 1.03 else 'ABOVE TARGET'}")


if __name__ == "__main__":
    main()
