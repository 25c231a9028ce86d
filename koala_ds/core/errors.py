"""One-line user errors for training scripts launched on several ranks.

    from koala_ds.core.errors import run_main
    if __name__ == "__main__":
        run_main(main)

A `KoalaError` (a bad schedule, a config that does not fit it: KoalaConfigError,
MegatronScheduleError, the library's errors) is the user's to fix, and every rank detects the
same one before any communication. So instead of a traceback per rank, rank 0 prints
`error: <message>` on stderr and every rank exits with code 2 (`USER_ERROR_EXIT`). An error only
the rank raising it sees (a KoalaError with `rank_local = True`: the Megatron runtime's
P2PTimeoutError) is printed by that rank, whichever it is. Any other
exception keeps its traceback, written in one piece: ranks that fail together (every rank meets
the same bug) print theirs one after another, not mixed line by line or word by word.
`rank_zero_argument_errors(parser)` does the same for argparse errors (the koala flags'
`add_arguments` applies it to the parser it extends). torchrun itself then prints its summary
of the failed ranks (about 40 lines); `koala-run`, which takes torchrun's arguments
(koala_ds/runtime/torchrun.py), leaves a user error at the one line.

torchrun (and the deepspeed launcher) stop the other ranks as soon as one exits: were rank 1 to
exit first, rank 0 could be stopped before it printed the message. So the other ranks wait
(`OTHER_RANKS_GRACE_S`) before they exit; rank 0 exits at once and the launcher ends them.
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import time
from contextlib import contextmanager, redirect_stderr
from typing import Callable, Iterator, NoReturn

from .ir import KoalaError

#: Exit code of every rank after a user error (argparse's code for bad arguments).
USER_ERROR_EXIT = 2
#: How long ranks other than 0 wait before exiting after a user error, so rank 0 prints first.
OTHER_RANKS_GRACE_S = 5.0


def process_rank() -> int:
    """This process's global rank: torch.distributed's when it is initialised, else $RANK (0)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def one_line(exc: BaseException) -> str:
    """The message of `exc` on one line (continuation lines joined with ' | ')."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " | ".join(lines) or exc.__class__.__name__


def report_user_error(exc: KoalaError, prog: str | None = None) -> None:
    """Write `<prog>: error: <message>` to stderr, on rank 0 only; an error that only the rank
    raising it sees (`rank_local`, e.g. a pipeline timeout: rank 0 may be the rank that hangs)
    on that rank."""
    if process_rank() != 0 and not getattr(exc, "rank_local", False):
        return
    prefix = f"{prog}: " if prog else ""
    # A program's error output, not a log record: it must reach the user whatever the logging setup.
    sys.stderr.write(f"{prefix}error: {one_line(exc)}\n")
    sys.stderr.flush()


def run_main(main: Callable[[], object], prog: str | None = None,
             grace_s: float = OTHER_RANKS_GRACE_S) -> NoReturn:
    """Run `main()` and exit with its return value (0 for None); a KoalaError becomes one line
    on rank 0 and exit code USER_ERROR_EXIT on every rank, without a traceback (the other
    ranks exit `grace_s` later, unless their launcher ends them first). Any other exception: its
    traceback (what sys.excepthook prints) in one write and exit code 1, as Python's own."""
    try:
        with one_line_user_errors(prog, grace_s):
            code = main()
    except Exception:
        printed = io.StringIO()
        with redirect_stderr(printed):  # what sys.excepthook prints (Python's: the traceback)
            sys.excepthook(*sys.exc_info())
        write_whole(printed.getvalue())
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


def write_whole(text: str) -> None:
    """Write `text` to stderr in one write call: the ranks of one job share their launcher's
    stderr, and text written piece by piece, as Python prints a traceback, mixes with the other
    ranks' when they fail at the same moment. (A terminal takes a write whole; a pipe takes up
    to 4 KiB whole, PIPE_BUF.)"""
    _flush()
    try:
        fd = sys.stderr.fileno()
    except (OSError, ValueError, AttributeError):  # a replaced sys.stderr, with no file descriptor
        sys.stderr.write(text)
        _flush()
        return
    data = text.encode(sys.stderr.encoding or "utf-8", "backslashreplace")
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:  # stderr is gone (a closed pipe): nothing can be said
        pass


@contextmanager
def one_line_user_errors(prog: str | None = None, grace_s: float = OTHER_RANKS_GRACE_S) -> Iterator[None]:
    """A KoalaError raised inside: one line on rank 0 and exit code USER_ERROR_EXIT on every
    rank (as run_main does), e.g. around `koala_ds.megatron.install(args)` in a script whose
    main is not run_main's (the Megatron-LM patch)."""
    try:
        yield
    except KoalaError as exc:
        report_user_error(exc, prog)
        exit_user_error(grace_s)


def exit_user_error(grace_s: float = OTHER_RANKS_GRACE_S) -> NoReturn:
    """Exit with USER_ERROR_EXIT; ranks other than 0 first wait `grace_s` (rank 0 prints)."""
    _flush()
    if process_rank() != 0:
        time.sleep(grace_s)
    sys.exit(USER_ERROR_EXIT)


def rank_zero_argument_errors(parser: argparse.ArgumentParser,
                              grace_s: float = OTHER_RANKS_GRACE_S) -> argparse.ArgumentParser:
    """Make `parser`'s argument errors one line on rank 0 (`prog: error: message (see prog
    -h)`, no usage block) and exit code USER_ERROR_EXIT on every rank, like a KoalaError under
    run_main. Every rank parses the same command line, so every rank finds the same error.
    --help prints on rank 0 only, too."""

    def error(message: str) -> NoReturn:
        if process_rank() == 0:
            sys.stderr.write(f"{parser.prog}: error: {message} (see {parser.prog} -h)\n")
        exit_user_error(grace_s)

    parser.error = error  # type: ignore[method-assign]
    print_help = parser.print_help

    def help_on_rank_zero(file=None) -> None:  # --help: once, not once per rank
        if process_rank() == 0:
            print_help(file)

    parser.print_help = help_on_rank_zero  # type: ignore[method-assign]
    return parser


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
