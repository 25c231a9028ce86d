"""The `koala` command line: a thin argparse front over the library.

Each subcommand lives in its own module under `koala_ds.commands` and registers itself
with `register(subparsers)`; this module only lists them and turns errors into messages.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from .core.ir import KoalaError

#: Subcommand modules, in the order `koala --help` lists them.
COMMAND_MODULES = [
    "koala_ds.commands.schedules",   # list, show, validate, export
    "koala_ds.commands.model",       # simulate, compare
    "koala_ds.commands.search",      # search
    "koala_ds.commands.profile",     # profile
    "koala_ds.commands.calibrate",   # calibrate
]


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class KoalaArgumentParser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage block): `koala search: error: argument
    --time-budget: must be a finite number > 0, got 'nan' (see koala search -h)`."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = KoalaArgumentParser(prog="koala", description="Pipeline schedules as data.")
    parser.add_argument("--version", action="version", version=f"koala-ds {__version__}")
    parser.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS,
                        help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    parser.set_defaults(commands=sub.choices)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the command they were given to: `koala show: error: unrecognized arguments: ...`
        args.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (KoalaError, FileNotFoundError) as exc:
        print(f"koala {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into e.g. `head`, which stopped reading
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # a file the command reads or writes: one line, not a traceback
        if exc.errno is None:
            raise
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"koala {args.command}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"koala {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
