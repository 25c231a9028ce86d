"""The fidelity targets judged over several runs of benchmarks/fidelity.py, not one.

    python benchmarks/fidelity_runs.py                     # every run in benchmarks/results/fidelity.txt
                                                           # whose calibration took turns (since 62cee92)
    python benchmarks/fidelity_runs.py --since "2026-12-07 02:00" --out pooled.txt
    python benchmarks/fidelity_runs.py --file my_runs.txt  # reports of fidelity.py --out, one after another

One run's paired speedups have standard errors of 0.01-0.04 on a 2-core VM, but the same
schedule measures differently from run to run by more than that (the machine's state moves the
answer, not only the noise within a run), so a single run's miss or hit of a 0.05 target says
little. This reads the runs' tables back (fidelity.py's report: one Markdown table per run) and
prints, per example and row (the searched schedule, the best predefined one, the default
search's answer where it was none of them), each run's paired and fresh speedup error (measured
less predicted), their mean over the runs and its standard error, how many runs were within the
target and, for what a search answered, how many measured below 0.98x of 1f1b. A mean error
beyond the target by more than two standard errors is a bias of the model on that row; within
them, run-to-run scatter. A searched row that is 1f1b itself (`= 1f1b`) has no error to pool and
is left out.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity import ROOT, SEARCHED_FLOOR, SPEEDUP_TOLERANCE, _se, load_average, refuse_out  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "fidelity.txt"
#: the first line of every report fidelity.py writes
RUN_START = "$ python benchmarks/fidelity.py"
#: a report's start time, in its header (fidelity.header)
STARTED = re.compile(r"^started (\S+ \S+?);")
#: the rows pooled, by how the table's schedule column begins
KINDS = ("searched", "best predefined", "default search")


class PoolError(Exception):
    """Input this script cannot use: one line for the user."""


@dataclass(frozen=True)
class RunRow:
    """One table row of one run: a schedule's predicted and measured speedups over 1f1b."""

    started: str
    example: str
    kind: str
    schedule: str
    predicted: float
    fresh: float
    paired: float  # NaN where the run had no paired rounds of it

    @property
    def fresh_error(self) -> float:
        return self.fresh - self.predicted

    @property
    def paired_error(self) -> float:
        return self.paired - self.predicted


def _number(cell: str) -> float:
    cell = cell.strip().rstrip("x")
    return float("nan") if cell in ("", "-") else float(cell)


def parse_runs(text: str, source: str) -> list[tuple[str, str, list[RunRow]]]:
    """Per report in `text` (newest first, as the results file keeps them): its start time, its
    header (the lines before the table) and its pooled rows."""
    out = []
    chunks = [c for c in text.split(RUN_START) if c.strip()]
    for chunk in chunks:
        lines = chunk.splitlines()
        started = next((m.group(1) for m in map(STARTED.match, lines) if m), None)
        head = next((i for i, line in enumerate(lines) if line.startswith("| example |")), None)
        if started is None or head is None:
            continue
        columns = [c.strip() for c in lines[head].strip("|").split("|")]
        rows = []
        for line in lines[head + 2:]:
            if not line.startswith("| "):
                break
            cells = dict(zip(columns, (c.strip() for c in line.strip().strip("|").split("|"))))
            kind = next((k for k in KINDS if cells.get("schedule", "").startswith(k)), None)
            if kind is None or cells["schedule"].endswith("= 1f1b"):
                continue
            try:
                rows.append(RunRow(started, cells["example"], kind, cells["schedule"],
                                   _number(cells["speedup predicted"]), _number(cells["speedup measured"]),
                                   _number(cells.get("paired speedup", "-"))))
            except (KeyError, ValueError) as exc:
                raise PoolError(f"{source}: the run started {started} has a table row it cannot read ({exc}): "
                                f"{line[:80]}") from None
        out.append((started, "\n".join(lines[:head]), rows))
    return out


@dataclass(frozen=True)
class Pooled:
    example: str
    kind: str
    rows: tuple[RunRow, ...]

    def errors(self, paired: bool) -> list[float]:
        values = [r.paired_error if paired else r.fresh_error for r in self.rows]
        return [e for e in values if e == e]

    def line(self) -> str:
        paired, fresh = self.errors(True), self.errors(False)
        below = ("-" if self.kind == "best predefined" else  # the floor is a searched schedule's target
                 str(sum(1 for r in self.rows if r.paired == r.paired and r.paired < SEARCHED_FLOOR)))
        within = sum(1 for e in paired if abs(e) <= SPEEDUP_TOLERANCE)
        return (f"| {self.example} | {self.kind} | {len(self.rows)} | {' '.join(f'{e:+.3f}' for e in paired) or '-'} "
                f"| {_mean_se(paired)} | {within} of {len(paired)} | {below} | {_mean_se(fresh)} "
                f"| {_verdict(paired)} |")


def _mean_se(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:+.3f}"
    return f"{statistics.fmean(values):+.3f} ({_se(values):.3f})"


def _verdict(errors: list[float]) -> str:
    """Whether the runs show a bias of the model on the row: the mean error beyond the target by
    more than two standard errors (a bias), within the target (none), or neither (cannot tell)."""
    if len(errors) < 2:
        return "too few runs"
    mean, se = statistics.fmean(errors), _se(errors)
    if abs(mean) - 2 * se > SPEEDUP_TOLERANCE:
        return f"biased by {mean:+.3f}"
    if abs(mean) + 2 * se <= SPEEDUP_TOLERANCE:
        return "within the target"
    if abs(mean) - 2 * se > 0:
        return f"off by {mean:+.3f} (+-{2 * se:.3f}): not 0, within the target or not"
    return "no bias seen, the runs too few to bound it within the target"


def pool(runs: list[tuple[str, str, list[RunRow]]]) -> list[Pooled]:
    groups: dict[tuple[str, str], list[RunRow]] = {}
    for _, _, rows in runs:
        for r in rows:
            groups.setdefault((r.example, r.kind), []).append(r)
    return [Pooled(example, kind, tuple(rows)) for (example, kind), rows in groups.items()]


def report(runs: list[tuple[str, str, list[RunRow]]]) -> list[str]:
    pooled = pool(runs)
    lines = [f"{len(runs)} run(s): " + ", ".join(s for s, _, _ in runs), "",
             "| example | row | runs | paired errors, newest first | their mean (SE) | within "
             f"{SPEEDUP_TOLERANCE} | below {SEARCHED_FLOOR}x | fresh errors' mean (SE) | over the runs |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [p.line() for p in pooled]
    for kind in KINDS:
        errors = [e for p in pooled if p.kind == kind for e in p.errors(True)]
        if errors:
            lines.append(f"{kind}, every example: paired errors' mean {_mean_se(errors)} over {len(errors)} row(s); "
                         f"{_verdict(errors)}")
    return lines


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default=str(RESULTS), help="fidelity.py reports, one after another (default "
                                                         "benchmarks/results/fidelity.txt)")
    ap.add_argument("--since", default=None, metavar="'YYYY-MM-DD HH:MM'",
                    help="only runs started then or later (default: every run whose calibration took turns)")
    ap.add_argument("--out", default=None, help="also write the report to this file (atomically)")
    args = ap.parse_args(argv)
    if args.since is not None and not re.fullmatch(r"\d{4}-\d\d-\d\d( \d\d:\d\d(:\d\d)?)?", args.since):
        ap.error(f"--since {args.since!r}: give a start time as 'YYYY-MM-DD HH:MM'")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if refuse_out(args.out, "fidelity_runs.py"):
        return 2
    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"fidelity_runs.py: --file {args.file}: cannot read it ({exc.__class__.__name__})", file=sys.stderr)
        return 2
    try:
        runs = parse_runs(text, args.file)
    except PoolError as exc:
        print(f"fidelity_runs.py: {exc}", file=sys.stderr)
        return 1
    runs = [r for r in runs if (r[0] >= args.since if args.since else "take turns of" in r[1])]
    if not runs:
        print(f"fidelity_runs.py: --file {args.file}: no fidelity.py report "
              + (f"started at or after --since {args.since}" if args.since else "whose calibration took turns"),
              file=sys.stderr)
        return 1
    lines = [f"$ python benchmarks/fidelity_runs.py {' '.join(argv)}".rstrip(), f"{load_average()}", *report(runs)]
    print("\n".join(lines))
    if args.out:
        from koala_ds.core.outputs import atomic_write

        atomic_write(args.out, "\n".join(lines) + "\n", "--out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
