"""Receives posted at the step's start vs two actions ahead, on gloo: step time and late messages.

    python benchmarks/recv_lookahead.py                       # DeepSpeed example, dim 1024, zb-v, 7 rounds
    python benchmarks/recv_lookahead.py --schedules zb-v work/searched_v2.koala --rounds 7
    python benchmarks/recv_lookahead.py --dry-run             # the commands, nothing run

Runs examples/deepspeed_pipe/train.py (p = 2, m = 8, --chunks 2 --placement vshape, traced) with
KOALA_RECV_LOOKAHEAD=2 (receives posted two compute actions ahead, the default before 8960f40) and
=all (every receive of a step at its start, the gloo default since), each round a fresh torchrun
of every (schedule, lookahead), the order reversed every other round. Prints per schedule and
lookahead the rounds' median step periods (--loss-log period_ms, the first --warmup iterations
dropped), the geometric mean over the rounds of all / 2, and from the traces (koala_ds.sim.measured,
the first 2 steps skipped) the waits longer than WAIT_MS for a message from the other rank: how
many, the share of them that ended more than LATE_MS after the sender's compute ended, and their
mean lateness (koala_ds.sim.calibrate.message_delays).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "deepspeed_pipe" / "train.py"
LOOKAHEADS = ("2", "all")
LATE_MS = 2.0
#: A wait shorter than this (ms) is the receive call's own time, not a wait for a late message
#: (on the 2-core VM every receive call took 0.01-0.05 ms).
WAIT_MS = 0.05
TIMEOUT_S = 600


def command(schedule: str, dim: int, steps: int, log: Path, trace: Path) -> list[str]:
    torchrun = Path(sys.executable).with_name("torchrun")
    return [str(torchrun), "--standalone", "--nproc-per-node", "2", str(EXAMPLE), "--dim", str(dim),
            "--microbatches", "8", "--steps", str(steps), "--schedule", schedule, "--chunks", "2",
            "--placement", "vshape", "--loss-log", str(log), "--trace", str(trace)]


def plan(schedules: list[str], rounds: int) -> list[tuple[int, str, str]]:
    """(round, schedule, lookahead) in run order: every pair each round, reversed every other round."""
    pairs = [(s, la) for s in schedules for la in LOOKAHEADS]
    return [(r, s, la) for r in range(rounds) for s, la in (pairs if r % 2 == 0 else pairs[::-1])]


def lateness(trace: Path) -> list[float]:
    """Per wait (longer than WAIT_MS) for a message from another rank, complete steps, the first 2
    skipped: its end less the sender's compute end, ms."""
    from koala_ds.sim.calibrate import message_delays
    from koala_ds.sim.measured import load_runs

    out: list[float] = []
    for run in load_runs([str(trace)], 2):
        for step in run.steps:
            out += message_delays(run.schedule, step, WAIT_MS)
    return out


def format_table(times: dict[tuple[str, str], list[float]], late: dict[tuple[str, str], list[float]]) -> str:
    lines = ["| schedule | lookahead | rounds' median step ms | median | all / 2 (geomean of rounds) "
             f"| waits | later than {LATE_MS:g} ms | mean lateness ms |", "|---|---|---|---|---|---|---|---|"]
    for (name, la), values in times.items():
        ratio = "-"
        if la == "all" and (name, "2") in times:
            base = times[(name, "2")]
            ratio = f"{statistics.geometric_mean([a / b for a, b in zip(values, base)]):.3f}"
        waits = late.get((name, la), [])
        share = f"{sum(x > LATE_MS for x in waits) / len(waits):.1%}" if waits else "-"
        mean = f"{statistics.fmean(waits):.2f}" if waits else "-"
        lines.append(f"| {Path(name).name} | {la} | {' '.join(f'{t:.1f}' for t in values)} | "
                     f"{statistics.median(values):.1f} | {ratio} | {len(waits)} | {share} | {mean} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", nargs="+", default=["zb-v"], help="v = 2 schedules (names or files)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--work", default=None, help="folder for the logs and traces (default: a temporary one)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps <= args.warmup + 2:
        ap.error("--rounds must be >= 1 and --steps more than --warmup + 2")
    work = Path(args.work or tempfile.mkdtemp(prefix="recv_lookahead_"))
    times: dict[tuple[str, str], list[float]] = {}
    late: dict[tuple[str, str], list[float]] = {}
    print(f"$ python benchmarks/recv_lookahead.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    for r, name, la in plan(args.schedules, args.rounds):
        tag = f"{Path(name).stem}_la{la}_r{r}"
        cmd = command(name, args.dim, args.steps, work / f"t_{tag}.json", work / f"tr_{tag}.json")
        print(f"  $ KOALA_RECV_LOOKAHEAD={la} {' '.join(cmd)}", file=sys.stderr)
        if args.dry_run:
            continue
        work.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, KOALA_RECV_LOOKAHEAD=la)
        with open(work / f"log_{tag}.txt", "w") as log:
            res = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=TIMEOUT_S, cwd=ROOT)
        if res.returncode != 0:
            print(f"recv_lookahead: {' '.join(cmd)} failed (exit {res.returncode}); see {work / f'log_{tag}.txt'}",
                  file=sys.stderr)
            return 1
        periods = json.loads((work / f"t_{tag}.json").read_text())["period_ms"][args.warmup:]
        times.setdefault((name, la), []).append(statistics.median(periods))
        late.setdefault((name, la), []).extend(lateness(work / f"tr_{tag}.json"))
    if not args.dry_run:
        print(format_table(times, late))
        print(f"(work folder {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
