"""`koala-run`: torchrun, with a user error left at the one line the failing rank printed.

    koala-run --nproc-per-node 2 examples/megatron_gpt/pretrain_gpt.py ... --koala-schedule zb-h1

It takes exactly torchrun's arguments and runs torchrun's own launcher (`torch.distributed.run`).
What it changes is the end of a failed run. torchrun stops the other ranks with SIGTERM, logs
that, and ends in a traceback of its own plus a `ChildFailedError` table (about 40 lines),
even when the script already said what to fix. Here:

- the root cause exited with `USER_ERROR_EXIT` (2: a `KoalaError` reported by
  `koala_ds.core.errors.run_main`, or an argument error): nothing more is printed, exit code 2;
- any other failure: torchrun's failure table (which ranks, exit codes, error files), without
  the launcher's own traceback, and the root cause's exit code (1 for a signal);
- a bad option, a bad `--nproc-per-node` or `--nnodes`, or a training script that does not
  exist: one line, exit code 2 (torchrun prints its usage, about 40 lines, or its traceback, or
  starts every rank to fail on the missing file);
- a `--nproc-per-node` above `max_processes_per_node()` (64, or 4 per CPU core this process
  may use where that is more): one line, exit code 2, before any rank starts (torchrun starts
  processes until the machine gives out, then ends in its traceback);
- a `--log-dir` that is a file, lies under a file, or cannot be created or written: one line,
  exit code 2 (torchrun ends in its traceback, or in the ranks' start);
- any other option value torchrun refuses before it starts a rank (`--max-restarts -1`,
  `--rdzv-conf`, `--redirects`, `--rdzv-backend`, a port out of range, ...): one line naming
  the option, with torchrun's reason, exit code 2 (torchrun ends in its traceback);
- a `--master-port` (or a static rendezvous's `--rdzv-endpoint`) already in use on this
  machine, by another run or one that has not ended: one line naming the option, exit code 2
  (torchrun prints its own traceback, about 40 lines).
  Without `--master-port`, a one-node run binds a port the system picks.
- a c10d `--rdzv-endpoint`, or node 0's address for a static rendezvous's other nodes, where
  no rendezvous store answers (on this machine, a port held by a process of another kind; on
  another machine, no store up, or not a store): one line after the rendezvous timeout
  (`--rdzv-conf read_timeout`, default 60 s; static: `timeout`, 600 s), exit code 2 (torch's
  store client waits for a process that never answers with no deadline, and ends a wait for a
  store in its traceback); a wait of more than WAIT_NOTICE_S is announced in one line.

torchrun's 4-line notice that it sets OMP_NUM_THREADS to 1 (unset, 2 or more processes per
node) is dropped, so that a user error stays one line; the variable is still set to 1.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import sys
import threading
import traceback
from collections.abc import Iterator
from datetime import timedelta
from typing import TextIO

from ..core.errors import USER_ERROR_EXIT, rank_zero_argument_errors, report_user_error
from ..core.ir import KoalaError
from ..core.machine import max_processes_per_node, processes_bound_text

#: torchrun's log lines about ending a failed run, which the exit code and table already say.
_ENDING_MESSAGES = ("Sending process", "failed (exitcode")
_ELASTIC_API_LOGGER = "torch.distributed.elastic.multiprocessing.api"


class _DropEndingLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_ENDING_MESSAGES)


#: torchrun's logger, and its notice that it sets OMP_NUM_THREADS (a banner of 4 lines).
_RUN_LOGGER, _OMP_NOTICE = "torch.distributed.run", "Setting OMP_NUM_THREADS environment variable"


class _DropOmpNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _OMP_NOTICE not in str(record.msg)


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with `argv` (default: the command line); return the exit code."""
    from torch.distributed import DistNetworkError
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parser = rank_zero_argument_errors(torchrun.get_args_parser())
    parser.prog = "koala-run"
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    bad = (bad_numbers(args, torchrun) or missing_script(args) or bad_log_dir(args)
           or store_not_answering(args))
    if bad is not None:
        report_user_error(bad, "koala-run")
        return USER_ERROR_EXIT
    logging.getLogger(_ELASTIC_API_LOGGER).addFilter(_DropEndingLines())
    logging.getLogger(_RUN_LOGGER).addFilter(_DropOmpNotice())
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        return failure_exit_code(exc)
    except (DistNetworkError, ValueError, AssertionError) as exc:
        error = port_taken(args, exc) if isinstance(exc, DistNetworkError) else refused_option(args, exc)
        if error is None:
            raise
        report_user_error(error, "koala-run")
        return USER_ERROR_EXIT
    return 0


def bad_numbers(args, torchrun) -> KoalaError | None:
    """The one-line error for a `--nproc-per-node`, `--nnodes` or `--monitor-interval` that
    torchrun would refuse with a traceback, some with no message (the first two checked with
    torchrun's own parsers); None when all are valid."""
    try:
        nproc = torchrun.determine_local_world_size(args.nproc_per_node)
    except ValueError as exc:
        return KoalaError(f"--nproc-per-node {args.nproc_per_node}: {str(exc).rstrip('.')} (use an integer >= 1, "
                          f"or cpu, gpu, xpu or auto)")
    if nproc < 1:
        return KoalaError(f"--nproc-per-node {args.nproc_per_node}: at least 1 process per node")
    if nproc > max_processes_per_node() and _is_count(args.nproc_per_node):  # cpu, gpu, auto: the machine counts
        return too_many_processes(args.nproc_per_node)
    try:
        low, high = torchrun.parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError):
        low = high = 0
    if not 0 < low <= high:
        return KoalaError(f"--nnodes {args.nnodes}: a number of nodes N or a range MIN:MAX, with 0 < MIN <= MAX")
    if not args.monitor_interval > 0:  # torch's WorkerSpec asserts it, with no message
        return KoalaError(f"--monitor-interval {args.monitor_interval}: seconds between checks of the ranks, > 0")
    return None


def _is_count(value: str) -> bool:
    """Whether a `--nproc-per-node` is a number (not one of the names torchrun counts devices for)."""
    try:
        int(value)
    except ValueError:
        return False
    return True


def too_many_processes(value: str) -> KoalaError:
    """The one-line error for a `--nproc-per-node` above `max_processes_per_node()`."""
    return KoalaError(f"--nproc-per-node {value}: at most {max_processes_per_node()} processes per node "
                      f"({processes_bound_text()}; more would start processes until this machine gives out)")


def bad_log_dir(args) -> KoalaError | None:
    """The one-line error for a `--log-dir` that is a file, lies under a file, or cannot be
    created or written (torchrun creates it as koala-run does here, and ends in its traceback
    for a file, or in the ranks' start for a directory it cannot write); None when it is one
    torchrun can use, or one a `--logs-specs` of its own reads."""
    path = args.log_dir
    if not path or path == os.devnull or args.logs_specs is not None:
        return None
    fix = "pass a directory koala-run can create or write to"
    if os.path.exists(path) and not os.path.isdir(path):
        return KoalaError(f"--log-dir {path}: is a file, not a directory: {fix}")
    try:
        os.makedirs(path, exist_ok=True)  # as torchrun's DefaultLogsSpecs does before it starts a rank
    except OSError as exc:
        above = _file_above(path)
        why = f"{above} is a file, not a directory" if above else f"cannot create it ({exc.strerror})"
        return KoalaError(f"--log-dir {path}: {why}: {fix}")
    if not os.access(path, os.W_OK | os.X_OK):
        return KoalaError(f"--log-dir {path}: cannot write to it (permission denied): {fix}")
    return None


def _file_above(path: str) -> str | None:
    """The nearest path above `path` that exists, as the user wrote it, where it is not a
    directory (a file); else None."""
    parent = os.path.dirname(os.path.normpath(path))
    while parent and not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    return parent if parent and not os.path.isdir(parent) else None


def missing_script(args) -> KoalaError | None:
    """The one-line error for a training script that is not a file (unless it names a module,
    `-m`, or a program on the PATH, `--no-python`); None when it is one."""
    if args.module or args.no_python or os.path.isfile(args.training_script):
        return None
    return KoalaError(f"training script {args.training_script!r} does not exist (from {os.getcwd()})")


#: torch's c10d rendezvous: its port when the endpoint names none, and its store's read timeout.
C10D_DEFAULT_PORT, C10D_READ_TIMEOUT_S = 29400, 60
#: torch's static rendezvous: node 0's port when --master-port is not given, and its timeout.
STATIC_DEFAULT_PORT, STATIC_TIMEOUT_S = 29500, 600
#: How much longer than its read timeout the store client is given before it counts as stuck.
PROBE_GRACE_S = 2.0
PROBE_THREAD = "koala-run store probe"
#: After this many seconds without an answer, koala-run says that it waits for the store.
WAIT_NOTICE_S = 5.0


def store_not_answering(args) -> KoalaError | None:
    """The one-line error for a rendezvous store that does not answer where this agent connects
    to it: a c10d `--rdzv-endpoint`, or node 0's for a static rendezvous's other nodes
    (`--node-rank` > 0: `--master-addr`/`--master-port`, or `--rdzv-endpoint`). There, a port on
    this machine in use by another kind of process, or an endpoint on another machine with no
    store up or a process that is not one. torch's store client waits for a process that
    accepts and never answers with no deadline (its timeout not kept), and ends a wait for a
    store that never comes up in its traceback: koala-run tries a client first, and gives up
    after the rendezvous timeout. None when this agent hosts the store or a store answered."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint

    client = _store_client(args)
    if client is None:
        return None
    option, endpoint, timeout_key, timeout_default = client
    c10d = args.rdzv_backend == "c10d"
    try:
        host, port = parse_rendezvous_endpoint(endpoint, default_port=C10D_DEFAULT_PORT if c10d else -1)
        params = _rendezvous_params(args, endpoint)
        timeout_s, is_host = params.get_as_int(timeout_key, timeout_default), params.get_as_bool("is_host")
    except ValueError:
        return None  # torchrun says what is wrong (refused_option)
    if port <= 0 or timeout_s <= 0:
        return None  # c10d's port 0 (this agent hosts the store on any port), or torchrun's own error
    here = _matches_machine_hostname(host)
    taken = here and not _port_free(host, port)
    hosts = c10d and (here and not taken if is_host is None else is_host)  # as torch's c10d backend decides
    if hosts or _store_answers(host, port, timeout_s, option, timeout_key):
        return None
    where = (f"port {port} is in use on this machine, but no rendezvous store answered there" if taken else
             f"no rendezvous store answered at {host}:{port}")
    fix = (("pass a free port, or --standalone to have one picked" if taken else
            "start the agent that hosts it (on that machine, the same koala-run), or check the address and port")
           if c10d else "pass the port node 0 listens on" if taken else
           "start node 0 (--node-rank 0) at this address and port, or check them")
    return KoalaError(f"{option} {endpoint}: {where} within {timeout_s} s (--rdzv-conf {timeout_key}): {fix}")


def _store_client(args) -> tuple[str, str, str, int] | None:
    """Where this agent may be a rendezvous store's client: (the option naming the endpoint, the
    endpoint, the --rdzv-conf key of its timeout, that timeout's default); None where it never is."""
    from torch.distributed.run import parse_min_max_nnodes

    if args.standalone:
        return None
    if args.rdzv_backend == "c10d" and args.rdzv_endpoint:
        return "--rdzv-endpoint", args.rdzv_endpoint, "read_timeout", C10D_READ_TIMEOUT_S
    if args.rdzv_backend == "static" and args.node_rank > 0:
        if args.rdzv_endpoint:
            return "--rdzv-endpoint", args.rdzv_endpoint, "timeout", STATIC_TIMEOUT_S
        if args.master_port is None and parse_min_max_nnodes(args.nnodes)[1] == 1:
            return None  # torchrun runs one node on a c10d store of its own
        endpoint = f"{args.master_addr}:{args.master_port or STATIC_DEFAULT_PORT}"
        return "--master-addr / --master-port", endpoint, "timeout", STATIC_TIMEOUT_S
    return None


def _store_answers(host: str, port: int, timeout_s: int, option: str, timeout_key: str) -> bool:
    """Whether a TCPStore client at host:port connects within `timeout_s` (+ PROBE_GRACE_S): it
    runs in a daemon thread, so a client stuck in torch's C++ wait is left behind. A wait longer
    than WAIT_NOTICE_S is announced in one line (torch's own retry logs are dropped)."""
    from torch.distributed import TCPStore

    answer: list = []

    def connect() -> None:
        try:
            answer.append(TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s)))
        except Exception as exc:  # noqa: BLE001 - whatever the client raises, no store answered
            answer.append(exc)

    client = threading.Thread(target=connect, name=PROBE_THREAD, daemon=True)
    limit = timeout_s + PROBE_GRACE_S
    with _cpp_logs_dropped() as stderr:
        client.start()
        client.join(min(WAIT_NOTICE_S, limit))
        if client.is_alive() and limit > WAIT_NOTICE_S:
            stderr.write(f"koala-run: waiting for the rendezvous store at {host}:{port} ({option}), up to "
                         f"{timeout_s} s (--rdzv-conf {timeout_key})\n")
            stderr.flush()
            client.join(limit - WAIT_NOTICE_S)
    return bool(answer) and not isinstance(answer[0], Exception)


@contextlib.contextmanager
def _cpp_logs_dropped() -> Iterator[TextIO]:
    """Inside, file descriptor 2 goes to /dev/null: torch's C++ store client logs each failed
    try to connect there, with a C++ stack of 30 frames, and koala-run says it in one line.
    Yields the real standard error."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        with os.fdopen(os.dup(saved), "w") as stderr:
            yield stderr
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _rendezvous_params(args, endpoint: str):
    """`--rdzv-conf` read by torch's own parser into the parameters its rendezvous backends get
    (raises ValueError where torchrun would refuse them)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.run import _parse_rendezvous_config, parse_min_max_nnodes

    low, high = parse_min_max_nnodes(args.nnodes)
    return RendezvousParameters(args.rdzv_backend, endpoint, args.rdzv_id, low, high,
                                **_parse_rendezvous_config(args.rdzv_conf))


def _port_free(host: str, port: int) -> bool:
    """Whether `port` can be bound on `host` (a port in TIME_WAIT counts as free)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


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


#: Words in torchrun's refusal of an option value, and the option: (words, attribute of the
#: parsed arguments, option).
_REFUSED = (
    ("max_restarts", "max_restarts", "--max-restarts"),
    ("local_ranks_filter", "local_ranks_filter", "--local-ranks-filter"),
    ("rendezvous configuration", "rdzv_conf", "--rdzv-conf"),
    ("rendezvous backend", "rdzv_backend", "--rdzv-backend"),
    ("torchrun.logs_specs", "logs_specs", "--logs-specs"),
    ("shutdown_timeout", "shutdown_timeout", "--shutdown-timeout"),
)
#: torch's Std.from_str refuses --redirects and --tee in these words.
_STD = "does not match"
#: The agent's loop, in which ranks start: a ValueError from there is not about an option.
_AGENT_LOOP = "_invoke_run"


def refused_option(args, exc: Exception) -> KoalaError | None:
    """The one-line error for an option value torchrun refused (a ValueError or an
    AssertionError raised before the agent's loop started any rank); None for anything else."""
    if any(frame.name == _AGENT_LOOP for frame in traceback.extract_tb(exc.__traceback__)):
        return None
    said = str(exc) or type(exc).__name__
    if args.no_python and args.module and "--no-python" in said:
        return KoalaError("--no-python and -m (--module) cannot be used together")
    if _STD in said:
        option, value = ("--redirects", args.redirects) if said.startswith(f"{args.redirects} ") else ("--tee", args.tee)
        return KoalaError(f"{option} {value}: 0 (none), 1 (stdout), 2 (stderr) or 3 (both), or per local rank "
                          f"as RANK:N,... (e.g. 0:3,1:0)")
    if "rendezvous endpoint" in said:  # a static rendezvous's is --master-addr and --master-port
        option = (f"--rdzv-endpoint {args.rdzv_endpoint}" if args.rdzv_endpoint else
                  f"--master-addr {args.master_addr} / --master-port {args.master_port}")
        return KoalaError(f"{option}: {said}")
    for words, attribute, option in _REFUSED:
        if words in said:
            return KoalaError(f"{option} {getattr(args, attribute)}: {said}")
    return KoalaError(f"torchrun refused its options: {said} (see koala-run -h)")


def failure_exit_code(exc) -> int:
    """The exit code for a failed run; prints torchrun's table unless it was a user error."""
    _, root = exc.get_first_failure()
    if root.exitcode == USER_ERROR_EXIT:
        return USER_ERROR_EXIT
    sys.stderr.write(exc.format_msg() + "\n")
    return root.exitcode if root.exitcode > 0 else 1


def cli() -> None:
    """The `koala-run` command: `main`, then exit with its code. When a store probe is still
    waiting in torch's C++ client (`store_not_answering`), the process ends without the
    interpreter's teardown, which then aborts it (std::terminate: exit code 134, not 2)."""
    code = main()
    if any(thread.name == PROBE_THREAD and thread.is_alive() for thread in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    cli()
