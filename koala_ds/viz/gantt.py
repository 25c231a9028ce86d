"""Gantt charts of a simulated timeline (PNG or SVG), drawn with matplotlib.

Time on the x axis, one row per rank (rank 0 on top), F/B/I/W in distinct colours (later
chunks of a rank in lighter shades), the microbatch number on each box wide enough to hold
it, idle time as the grey row background, and makespan and bubble ratio in the title.
matplotlib is imported only when a chart is drawn (it is the `viz` extra).
"""
from __future__ import annotations

import os
from pathlib import Path

from ..ir import KoalaError, Op, Schedule
from ..outputs import atomic_open
from ..sim.simulator import SimResult

OP_COLOURS = {Op.F: "#3b75af", Op.B: "#4e9a4c", Op.I: "#e08a2c", Op.W: "#8466b5"}
OP_LABELS = {Op.F: "F forward", Op.B: "B backward", Op.I: "I backward (input)", Op.W: "W backward (weight)"}
IDLE_COLOUR = "#e6e6e6"
FORMATS = ("png", "svg", "pdf")


def _shade(colour: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """Mix `colour` with white: chunk 0 is the full colour, later chunks are lighter."""
    rgb = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    mix = 0.0 if chunks <= 1 else 0.5 * chunk / (chunks - 1)
    return tuple(c + (1 - c) * mix for c in rgb)  # type: ignore[return-value]


def gantt_figure(result: SimResult, schedule: Schedule | None = None, title: str | None = None):
    """A matplotlib Figure of the timeline (not attached to pyplot; safe in any thread)."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:  # pragma: no cover - matplotlib is a listed dependency of the viz extra
        raise KoalaError("Gantt charts need matplotlib: pip install 'koala-ds[viz]'") from None
    if result.timeline is None:
        raise KoalaError("a Gantt chart needs a result simulated with timeline=True")
    p, makespan = result.p, max(result.makespan, 1e-9)
    per_rank = max(sum(1 for t in result.timeline if t.rank == r) for r in range(p))
    width = min(60.0, max(9.0, 0.22 * per_rank + 2.0))
    height = 1.6 + 0.48 * p
    fig = Figure(figsize=(width, height), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    chunks = 1
    if schedule is not None:
        chunks = schedule.placement.chunks_per_rank

    def chunk_of(stage: int) -> int:
        return schedule.placement.chunk_of(stage) if schedule is not None else 0

    bar_h = 0.8
    for r in range(p):
        ax.broken_barh([(0, makespan)], (r - bar_h / 2, bar_h), facecolors=IDLE_COLOUR, edgecolors="none")
    groups: dict[tuple[int, Op, int], list[tuple[float, float]]] = {}
    for t in result.timeline:
        groups.setdefault((t.rank, t.action.op, chunk_of(t.action.stage)), []).append((t.start, t.end - t.start))
    for (r, op, chunk), spans in groups.items():
        ax.broken_barh(spans, (r - bar_h / 2, bar_h), facecolors=[_shade(OP_COLOURS[op], chunk, chunks)],
                       edgecolors="white", linewidth=0.6)
    # Label a box with its microbatch when the number fits inside it.
    axes_width_pt = width * 72 * 0.84
    fontsize = 7.0
    for t in result.timeline:
        text = str(t.action.microbatch)
        box_pt = (t.end - t.start) / makespan * axes_width_pt
        if box_pt >= 0.62 * fontsize * len(text) + 2:
            dark = t.action.op is not Op.W and chunk_of(t.action.stage) == 0
            ax.text(t.start + (t.end - t.start) / 2, t.rank, text, ha="center", va="center", fontsize=fontsize,
                    color="white" if dark else "black", clip_on=True)
    ax.set_xlim(0, makespan)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {r}" for r in range(p)])
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", color="#bbbbbb", linewidth=0.4, linestyle=":")
    ax.set_axisbelow(True)
    used = sorted({t.action.op for t in result.timeline}, key=lambda op: "FBIW".index(op.value))
    handles = [Patch(facecolor=OP_COLOURS[op], label=OP_LABELS[op]) for op in used]
    handles.append(Patch(facecolor=IDLE_COLOUR, label="idle"))
    if chunks > 1:
        handles.append(Patch(facecolor=_shade("#777777", chunks - 1, chunks), label="lighter: later chunk"))
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(handles), fontsize=8,
              frameon=False)
    heading = title or result.name
    config = f"p={result.p}, m={result.m}, v={result.v}" + ("" if result.mode == "async" else f", {result.mode}")
    fig.suptitle(f"{heading} ({config}): makespan {result.makespan:.4g} ms, bubble {result.bubble_ratio:.1%}, "
                 f"peak memory {result.peak_memory_max:.4g} MB", fontsize=10)
    fig.tight_layout()
    return fig


def write_gantt(result: SimResult, path: str | os.PathLike, schedule: Schedule | None = None,
                title: str | None = None) -> Path:
    """Draw the chart to `path`; the format comes from the suffix (.png, .svg or .pdf)."""
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise KoalaError(f"--gantt {path}: unknown image format {path.suffix or '(none)'!r}; "
                         f"use one of {', '.join('.' + f for f in FORMATS)}")
    fig = gantt_figure(result, schedule, title)
    with atomic_open(path, "wb", "--gantt") as fh:
        fig.savefig(fh, format=fmt)
    return path
