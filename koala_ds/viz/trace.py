"""Chrome trace format (JSON) of a simulated timeline: opens in Perfetto and chrome://tracing.

One process ("pipeline"), one thread per rank, one complete event ("ph": "X") per action.
Times in the profile are milliseconds; the trace format counts microseconds.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..core.ir import KoalaError, Op, Schedule
from ..core.outputs import atomic_write
from ..sim.simulator import SimResult

OP_NAMES = {Op.F: "forward", Op.B: "backward", Op.I: "backward-input", Op.W: "backward-weight"}
#: Chrome's reserved colour names, so that the four ops look different in chrome://tracing.
OP_COLOURS = {Op.F: "thread_state_running", Op.B: "good", Op.I: "rail_response", Op.W: "rail_animation"}


def chrome_trace(result: SimResult, schedule: Schedule | None = None) -> dict:
    """The trace as a dict (`{"traceEvents": [...], ...}`)."""
    if result.timeline is None:
        raise KoalaError("chrome_trace needs a result simulated with timeline=True")
    placement = schedule.placement if schedule is not None else None
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"pipeline {result.name}"}}]
    for r in range(result.p):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r, "args": {"sort_index": r}})
    for t in result.timeline:
        a = t.action
        args = {"stage": a.stage, "microbatch": a.microbatch, "op": OP_NAMES[a.op], "index": t.index,
                "start_ms": t.start, "end_ms": t.end}
        if placement is not None:
            args["chunk"] = placement.chunk_of(a.stage)
        events.append({"name": str(a), "cat": OP_NAMES[a.op], "ph": "X", "pid": 0, "tid": t.rank,
                       "ts": t.start * 1000.0, "dur": (t.end - t.start) * 1000.0, "cname": OP_COLOURS[a.op],
                       "args": args})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"schedule": result.name, "p": result.p, "m": result.m, "v": result.v, "mode": result.mode,
                      "makespan_ms": result.makespan, "bubble_ratio": result.bubble_ratio,
                      "peak_memory_mb": list(result.peak_memory_mb)},
    }


def write_chrome_trace(result: SimResult, path: str | os.PathLike, schedule: Schedule | None = None) -> Path:
    return atomic_write(path, json.dumps(chrome_trace(result, schedule)), "--trace")
