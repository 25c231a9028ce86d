"""`koala-run`: torchrun, with a user error left at the one line the failing rank printed.

    koala-run --nproc-per-node 2 examples/megatron_gpt/pretrain_gpt.py ... --koala-schedule zb-h1

It takes exactly torchrun's arguments and runs torchrun's own launcher (`torch.distributed.run`).
What it changes is the end of a failed run. torchrun stops the other ranks with SIGTERM, logs
that, and ends in a traceback of its own plus a `ChildFailedError` table (about 40 lines),
even when the script already said what to fix. Here:

- the root cause exited with `USER_ERROR_EXIT` (2: a `KoalaError` reported by
  `koala_ds.errors.run_main`, or an argument error): nothing more is printed, exit code 2;
- any other failure: torchrun's failure table (which ranks, exit codes, error files), without
  the launcher's own traceback, and the root cause's exit code (1 for a signal);
- a bad option, a bad `--nproc-per-node` or `--nnodes`, or a training script that does not
  exist: one line, exit code 2 (torchrun prints its usage, about 40 lines, or its traceback, or
  starts every rank to fail on the missing file);
- a `--master-port` (or a static rendezvous's `--rdzv-endpoint`) already in use on this
  machine, by another run or one that has not ended: one line naming the option, exit code 2
  (torchrun prints its own traceback, about 40 lines).
  Without `--master-port`, a one-node run binds a port the system picks.
"""
from __future__ import annotations

import logging
import os
import re
import sys

from .errors import USER_ERROR_EXIT, rank_zero_argument_errors, report_user_error
from .ir import KoalaError

#: torchrun's log lines about ending a failed run, which the exit code and table already say.
_ENDING_MESSAGES = ("Sending process", "failed (exitcode")
_ELASTIC_API_LOGGER = "torch.distributed.elastic.multiprocessing.api"


class _DropEndingLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_ENDING_MESSAGES)


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with `argv` (default: the command line); return the exit code."""
    from torch.distributed import DistNetworkError
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parser = rank_zero_argument_errors(torchrun.get_args_parser())
    parser.prog = "koala-run"
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    bad = bad_sizes(args, torchrun) or missing_script(args)
    if bad is not None:
        report_user_error(bad, "koala-run")
        return USER_ERROR_EXIT
    logging.getLogger(_ELASTIC_API_LOGGER).addFilter(_DropEndingLines())
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        return failure_exit_code(exc)
    except DistNetworkError as exc:
        taken = port_taken(args, exc)
        if taken is None:
            raise
        report_user_error(taken, "koala-run")
        return USER_ERROR_EXIT
    return 0


def bad_sizes(args, torchrun) -> KoalaError | None:
    """The one-line error for a `--nproc-per-node` or `--nnodes` that torchrun would refuse with
    a traceback (checked with torchrun's own parsers); None when both are valid."""
    try:
        nproc = torchrun.determine_local_world_size(args.nproc_per_node)
    except ValueError as exc:
        return KoalaError(f"--nproc-per-node {args.nproc_per_node}: {str(exc).rstrip('.')} (use an integer >= 1, "
                          f"or cpu, gpu, xpu or auto)")
    if nproc < 1:
        return KoalaError(f"--nproc-per-node {args.nproc_per_node}: at least 1 process per node")
    try:
        low, high = torchrun.parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError):
        low = high = 0
    if not 0 < low <= high:
        return KoalaError(f"--nnodes {args.nnodes}: a number of nodes N or a range MIN:MAX, with 0 < MIN <= MAX")
    return None


def missing_script(args) -> KoalaError | None:
    """The one-line error for a training script that is not a file (unless it names a module,
    `-m`, or a program on the PATH, `--no-python`); None when it is one."""
    if args.module or args.no_python or os.path.isfile(args.training_script):
        return None
    return KoalaError(f"training script {args.training_script!r} does not exist (from {os.getcwd()})")


def port_taken(args, exc: Exception) -> KoalaError | None:
    """The one-line error for a static rendezvous (torchrun's with `--master-port`, or on more
    than one node) whose port is already in use; None for any other failure."""
    if args.rdzv_backend != "static" or "EADDRINUSE" not in str(exc):
        return None
    port = re.search(r"\bport: (\d+)", str(exc))  # the port bound (a multi-node run's default is 29500)
    option = "--rdzv-endpoint" if args.rdzv_endpoint else "--master-port"  # static: the endpoint wins
    return KoalaError(f"port {port.group(1) if port else args.master_port} of {option} is already in use on this "
                      f"machine (another run, or one that has not ended, holds it): pass a free port with {option}, "
                      f"or --standalone to have one picked")


def failure_exit_code(exc) -> int:
    """The exit code for a failed run; prints torchrun's table unless it was a user error."""
    _, root = exc.get_first_failure()
    if root.exitcode == USER_ERROR_EXIT:
        return USER_ERROR_EXIT
    sys.stderr.write(exc.format_msg() + "\n")
    return root.exitcode if root.exitcode > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
