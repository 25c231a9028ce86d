"""`koala list | show | validate | export`: the language's part of the CLI."""
from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

from .. import library
from ..dsl import print_schedule
from ..core.ir import MAX_ACTIONS, KoalaError, Schedule, ScheduleError
from ..core.outputs import atomic_write, check_output
from ..resolve import resolve
from ..core.validate import render_grid, validate
from .table import format_table
from . import positive_int

log = logging.getLogger(__name__)


def add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("schedule", metavar="NAME|FILE",
                        help="a library schedule name (see `koala list`), a .koala program, or a .json/.csv schedule")
    parser.add_argument("-p", type=int, help="pipeline ranks")
    parser.add_argument("-m", type=int, help=f"microbatches per step; a schedule has p*v*m*2 actions (*3 with "
                                             f"backward split), at most {MAX_ACTIONS:,} (docs/dsl.md, Limits)")
    parser.add_argument("-v", type=int, default=None, help="model chunks per rank (default 1)")


def check_counts(args: argparse.Namespace) -> None:
    """-p, -m and -v, where given, are positive (0 is an error, not "the default")."""
    for key in ("p", "m", "v"):
        value = getattr(args, key, None)
        if value is not None and value < 1:
            raise KoalaError(f"-{key} must be a positive integer, got {value}")


def resolve_schedule(args: argparse.Namespace) -> Schedule:
    """The schedule the arguments name (`koala_ds.resolve`); fixed .json/.csv files carry their
    own p, m, v, so -p, -m and -v are optional for them and checked when given."""
    check_counts(args)
    return resolve(args.schedule, args.p, args.m, args.v)


def summary(schedule: Schedule) -> str:
    run = validate(schedule)
    return (f"{schedule.name}: p={schedule.p} m={schedule.m} v={schedule.v} placement={schedule.placement.describe()} "
            f"backward={schedule.backward}, {schedule.num_actions} actions; unit-time makespan {run.makespan}; "
            f"peak in-flight activations per rank {run.peak_in_flight}")


def _where(program) -> str:
    """" where g = ..." for the names a program's requirements use besides p, m and v."""
    used = {w for r in program.requirements for w in re.findall(r"[A-Za-z_]\w*", r.text)} - {"p", "m", "v"}
    lets = dict(re.findall(r"^let[ \t]+([A-Za-z_]\w*)[ \t]*=[ \t]*(.+?)[ \t]*(?:#.*)?$", program.text, re.M))
    defs = [f"{name} = {lets[name]}" for name in sorted(used) if name in lets]
    return f" where {', '.join(defs)}" if defs else ""


def cmd_list(args: argparse.Namespace) -> int:
    rows = []
    for name in library.names():
        prog = library.get(name)
        supports = ", ".join(r.text for r in prog.requirements) or "any p, m, v"
        supports += _where(prog)
        placement = prog.placement if isinstance(prog.placement, str) else "map"
        rows.append((name, placement, prog.backward, supports, prog.description))
    print(format_table(rows, ("name", "placement", "backward", "supports", "description"), "<<<<<"))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    schedule = resolve_schedule(args)
    run = validate(schedule)
    prepare = getattr(args, "prepare_outputs", None)
    state = prepare(schedule, args) if prepare is not None else None  # errors before anything is printed
    print(summary(schedule))
    print(render_grid(schedule, steps=run.steps, width=args.width))
    render = getattr(args, "render_outputs", None)
    if render is not None:
        render(schedule, args, state)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    schedule = resolve_schedule(args)
    print("ok: " + summary(schedule))
    return 0


EXPORTERS = {
    "koala": lambda s: print_schedule(s),
    "json": lambda s: s.to_json() + "\n",
    "torch-csv": lambda s: s.to_torch_csv(),
}


#: The format a suffix of -o stands for (what `koala validate` and the engines read it as).
SUFFIX_FORMATS = {".koala": "koala", ".json": "json", ".csv": "torch-csv"}


def export_format(fmt: str | None, output: str | None) -> str:
    """--format, else the one -o's suffix stands for (else koala); a --format that is not what
    -o's suffix stands for is refused: the file would not read back."""
    implied = SUFFIX_FORMATS.get(Path(output).suffix.lower()) if output else None
    if fmt is not None and implied is not None and fmt != implied:
        raise KoalaError(f"-o {output}: a {Path(output).suffix} file is read back as {implied}, not {fmt}: change "
                         f"the suffix of -o, or --format {implied}")
    return fmt or implied or "koala"


def cmd_export(args: argparse.Namespace) -> int:
    if args.output:
        check_output(args.output, "-o")
    args.format = export_format(args.format, args.output)
    schedule = resolve_schedule(args)
    try:
        text = EXPORTERS[args.format](schedule)
    except ScheduleError as exc:  # what that format cannot hold
        raise KoalaError(f"--format {args.format}: {exc}") from None
    if args.output:
        atomic_write(args.output, text, "-o")
        log.info("wrote %s", args.output)
        print(f"wrote {args.output} ({args.format}, {schedule.num_actions} actions)")
    else:
        print(text, end="")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="list the library schedules")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="show a schedule as a rank x time-step grid (and charts with --profile)")
    add_schedule_arguments(p)
    p.add_argument("--width", type=positive_int, default=48, help="grid columns to show (default 48)")
    try:
        from . import model
    except ImportError:  # the model's CLI is optional for `show`
        model = None
    if model is not None and hasattr(model, "add_model_arguments"):
        model.add_model_arguments(p)
        p.set_defaults(prepare_outputs=model.prepare_outputs, render_outputs=model.render_outputs)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("validate", help="check a schedule: completeness, order, deadlock freedom")
    add_schedule_arguments(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("export", help="write a schedule as .koala, JSON or torch compute-only CSV")
    add_schedule_arguments(p)
    p.add_argument("--format", choices=sorted(EXPORTERS), default=None,
                   help="default: what -o's suffix stands for (.koala, .json, .csv: torch-csv), else koala")
    p.add_argument("-o", "--output", help="output file (default: stdout)")
    p.set_defaults(func=cmd_export)
