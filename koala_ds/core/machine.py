"""What this machine allows koala to start: the CPU cores this process may use, and the most
processes a koala command starts on one node (search workers, koala-run's ranks per node)."""
from __future__ import annotations

import os

#: The fewest processes per node koala allows whatever the machine (this project's tests run 8
#: ranks on 2 cores), and how many per usable CPU core it allows where that is more.
MIN_PROCESSES_PER_NODE, PROCESSES_PER_CORE = 64, 4


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the system says it, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def max_processes_per_node() -> int:
    """The most processes one koala command may start on a node: no real run needs more (a rank
    per accelerator, or a few per core), and more would start processes until the machine gives
    out."""
    return max(MIN_PROCESSES_PER_NODE, PROCESSES_PER_CORE * usable_cores())


def processes_bound_text() -> str:
    """Why the bound is what it is, for a one-line error."""
    return (f"the larger of {MIN_PROCESSES_PER_NODE} and {PROCESSES_PER_CORE} per CPU core this process may "
            f"use, {usable_cores()}")
