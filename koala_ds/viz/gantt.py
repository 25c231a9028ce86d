"""Gantt charts of a simulated timeline (PNG or SVG), drawn with matplotlib; and `koala
calibrate --gantt`'s picture of a measured step above its calibrated prediction.

Time on the x axis, one row per rank (rank 0 on top), F/B/I/W in distinct colours (later
chunks of a rank in lighter shades), the microbatch number on each box wide enough to hold
it, idle time as the grey row background, and makespan and bubble ratio in the title. A
measured action's wait for its input is the hatched, lighter start of its box. Both pictures
draw with `draw_timeline` (boxes: `simulated_boxes`, `measured_boxes`). matplotlib is imported
only when a chart is drawn (it is the `viz` extra).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..core.ir import Action, KoalaError, Op, Schedule
from ..core.outputs import atomic_open
from ..sim.measured import Step, TracedRun
from ..sim.profile import CostProfile
from ..sim.simulator import SimResult, simulate

OP_COLOURS = {Op.F: "#3b75af", Op.B: "#4e9a4c", Op.I: "#e08a2c", Op.W: "#8466b5"}
OP_LABELS = {Op.F: "F forward", Op.B: "B backward", Op.I: "I backward (input)", Op.W: "W backward (weight)"}
IDLE_COLOUR = "#e6e6e6"
FORMATS = ("png", "svg", "pdf")
BAR_H = 0.8
#: How much lighter (mixed with white) a wait is drawn than its action's compute.
WAIT_LIGHTEN = 0.6


@dataclass(frozen=True)
class Box:
    """One action drawn on row `rank`: from `start` to `end` (ms), of which the first `wait` ms
    waited for its input (drawn hatched); `chunk` is the stage's chunk on its rank (its shade)."""

    rank: int
    action: Action
    chunk: int
    start: float
    end: float
    wait: float = 0.0


def _matplotlib():
    """matplotlib's Figure and Patch, or one line saying how to install it."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:  # pragma: no cover - matplotlib is a listed dependency of the viz extra
        raise KoalaError("Gantt charts need matplotlib: pip install 'koala-ds[viz]'") from None
    return Figure, Patch, Line2D


def _shade(colour: str, chunk: int, chunks: int, lighten: float = 0.0) -> tuple[float, float, float]:
    """Mix `colour` with white: chunk 0 is the full colour, later chunks are lighter; `lighten`
    mixes in that much more white (a wait)."""
    rgb = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    mix = 0.0 if chunks <= 1 else 0.5 * chunk / (chunks - 1)
    mix = mix + (1 - mix) * lighten
    return tuple(c + (1 - c) * mix for c in rgb)  # type: ignore[return-value]


def simulated_boxes(result: SimResult, schedule: Schedule | None = None, shift: float = 0.0) -> list[Box]:
    """The boxes of a simulated timeline (no waits), `shift` ms later."""
    if result.timeline is None:
        raise KoalaError("a Gantt chart needs a result simulated with timeline=True")
    chunk = schedule.placement.chunk_of if schedule is not None else (lambda stage: 0)
    return [Box(t.rank, t.action, chunk(t.action.stage), t.start + shift, t.end + shift) for t in result.timeline]


def measured_boxes(run: TracedRun, step: Step) -> list[Box]:
    """The boxes of one measured step of `run`: every rank's actions, in ms from the step's
    start (the earliest "step" event's), each with its measured input wait."""
    schedule = run.schedule
    out = []
    for r, spans in enumerate(step.ranks):
        for span in spans:
            a = schedule.ranks[r][span.index]
            out.append(Box(r, a, schedule.placement.chunk_of(a.stage), span.start - step.start,
                           span.end - step.start, span.wait))
    return out


def draw_timeline(ax, boxes: Sequence[Box], p: int, extent: tuple[float, float], chunks: int,
                  axes_width_pt: float) -> None:
    """Draw `boxes` on the axes `ax`: rows of p ranks, the grey idle background over `extent`
    (ms), each box's wait hatched and lighter, then its compute in the op's colour (chunk
    shade), a white outline, and the microbatch number where it fits."""
    lo, hi = extent
    for r in range(p):
        ax.broken_barh([(lo, hi - lo)], (r - BAR_H / 2, BAR_H), facecolors=IDLE_COLOUR, edgecolors="none")
    groups: dict[tuple[int, Op, int], list[Box]] = {}
    for b in boxes:
        groups.setdefault((b.rank, b.action.op, b.chunk), []).append(b)
    for (r, op, chunk), group in groups.items():
        rows = (r - BAR_H / 2, BAR_H)
        waits = [(b.start, b.wait) for b in group if b.wait > 0]
        if waits:
            ax.broken_barh(waits, rows, facecolors=[_shade(OP_COLOURS[op], chunk, chunks, WAIT_LIGHTEN)],
                           edgecolors=[_shade(OP_COLOURS[op], chunk, chunks, 0.2)], linewidth=0, hatch="////")
        ax.broken_barh([(b.start + b.wait, b.end - b.start - b.wait) for b in group], rows,
                       facecolors=[_shade(OP_COLOURS[op], chunk, chunks)], edgecolors="none")
        ax.broken_barh([(b.start, b.end - b.start) for b in group], rows, facecolors="none", edgecolors="white",
                       linewidth=0.6)
    _label_boxes(ax, boxes, max(hi - lo, 1e-9), axes_width_pt)
    ax.set_xlim(lo, hi)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {r}" for r in range(p)])
    ax.grid(axis="x", color="#bbbbbb", linewidth=0.4, linestyle=":")
    ax.set_axisbelow(True)


def _label_boxes(ax, boxes: Sequence[Box], span: float, axes_width_pt: float) -> None:
    """The microbatch number in the middle of each box's compute, when the number fits there."""
    fontsize = 7.0
    for b in boxes:
        text = str(b.action.microbatch)
        start = b.start + b.wait
        box_pt = (b.end - start) / span * axes_width_pt
        if box_pt >= 0.62 * fontsize * len(text) + 2:
            dark = b.action.op is not Op.W and b.chunk == 0
            ax.text(start + (b.end - start) / 2, b.rank, text, ha="center", va="center", fontsize=fontsize,
                    color="white" if dark else "black", clip_on=True)


def legend_handles(ops: set[Op], chunks: int, waits: bool = False, marks: Sequence[tuple[str, str]] = ()) -> list:
    """The legend: each op drawn, idle, the wait's hatching, the chunks' shades, and vertical
    lines `marks` ((label, line style) each)."""
    _, Patch, Line2D = _matplotlib()
    used = sorted(ops, key=lambda op: "FBIW".index(op.value))
    handles = [Patch(facecolor=OP_COLOURS[op], label=OP_LABELS[op]) for op in used]
    handles.append(Patch(facecolor=IDLE_COLOUR, label="idle"))
    if waits:
        handles.append(Patch(facecolor=_shade("#777777", 0, 1, WAIT_LIGHTEN), edgecolor="#777777", linewidth=0,
                             hatch="////", label="waiting for input"))
    if chunks > 1:
        handles.append(Patch(facecolor=_shade("#777777", chunks - 1, chunks), label="lighter: later chunk"))
    handles += [Line2D([], [], color="black", linestyle=style, linewidth=1.0, label=label) for label, style in marks]
    return handles


def chart_width(boxes: Sequence[Box], p: int) -> float:
    """The figure width (inches) for rows of these boxes."""
    per_rank = max(sum(1 for b in boxes if b.rank == r) for r in range(p))
    return min(60.0, max(9.0, 0.22 * per_rank + 2.0))


def gantt_figure(result: SimResult, schedule: Schedule | None = None, title: str | None = None):
    """A matplotlib Figure of the timeline (not attached to pyplot; safe in any thread)."""
    Figure, _, _ = _matplotlib()
    boxes = simulated_boxes(result, schedule)
    p, makespan = result.p, max(result.makespan, 1e-9)
    chunks = schedule.placement.chunks_per_rank if schedule is not None else 1
    width = chart_width(boxes, p)
    fig = Figure(figsize=(width, 1.6 + 0.48 * p), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    draw_timeline(ax, boxes, p, (0.0, makespan), chunks, width * 72 * 0.84)
    ax.set_xlabel("time (ms)")
    handles = legend_handles({b.action.op for b in boxes}, chunks)
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(handles), fontsize=8,
              frameon=False)
    heading = title or result.name
    config = f"p={result.p}, m={result.m}, v={result.v}" + ("" if result.mode == "async" else f", {result.mode}")
    fig.suptitle(f"{heading} ({config}): makespan {result.makespan:.4g} ms, bubble {result.bubble_ratio:.1%}, "
                 f"peak memory {result.peak_memory_max:.4g} MB", fontsize=10)
    fig.tight_layout()
    return fig


def image_format(path: Path, flag: str = "--gantt") -> str:
    """The image format of `path`'s suffix (png, svg or pdf), or one line saying which to use."""
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise KoalaError(f"{flag} {path}: unknown image format {path.suffix or '(none)'!r}; "
                         f"use one of {', '.join('.' + f for f in FORMATS)}")
    return fmt


def save_figure(fig, path: str | os.PathLike, flag: str = "--gantt") -> Path:
    """Write `fig` to `path` atomically, in the format of its suffix."""
    path = Path(path)
    fmt = image_format(path, flag)
    with atomic_open(path, "wb", flag) as fh:
        fig.savefig(fh, format=fmt)
    return path


def write_gantt(result: SimResult, path: str | os.PathLike, schedule: Schedule | None = None,
                title: str | None = None) -> Path:
    """Draw the chart to `path`; the format comes from the suffix (.png, .svg or .pdf)."""
    image_format(Path(path))
    return save_figure(gantt_figure(result, schedule, title), path)


# -- koala calibrate --gantt: the measured step above its calibrated prediction ---------------
@dataclass(frozen=True)
class CalibrationPanels:
    """One traced run drawn: its median step's boxes (ms from the step's start) and the
    calibrated prediction's, its first compute at the measured pipeline's start."""

    run: TracedRun
    step: Step
    measured: list[Box]
    predicted: list[Box]
    result: SimResult

    @property
    def lead(self) -> float:
        """The measured pipeline's start (its first compute), ms after the step's start."""
        return self.step.anchor - self.step.start

    @property
    def extent(self) -> tuple[float, float]:
        """Both panels' time axis: the step's start to the later of the two steps' ends."""
        ends = [self.step.end - self.step.start, self.lead + self.step.time, self.lead + self.result.makespan]
        return 0.0, max(ends + [b.end for b in self.measured])


def calibration_panels(run: TracedRun, calibrated: CostProfile, mode: str = "async") -> CalibrationPanels:
    """`run`'s median step (TracedRun.median_step) and its schedule simulated with `calibrated`."""
    step = run.median_step()
    result = simulate(run.schedule, calibrated, mode=mode, timeline=True)
    return CalibrationPanels(run, step, measured_boxes(run, step),
                             simulated_boxes(result, run.schedule, step.anchor - step.start), result)


#: The vertical lines of the calibration picture: (legend label, line style). The step ends,
#: measured, at the next step's first compute (the step time is that period); predicted, at the
#: makespan (its step_overhead included).
PIPELINE_START = ("pipeline start (first compute)", ":")
STEP_END = ("step end", "--")


def calibration_figure(panels: Sequence[CalibrationPanels], profile_name: str = ""):
    """Per traced run, its measured median step above the calibrated prediction on one time axis
    (a matplotlib Figure, not attached to pyplot)."""
    Figure, _, _ = _matplotlib()
    if not panels:
        raise KoalaError("a calibration chart needs at least one traced run")
    width = max(chart_width(pan.measured, pan.run.schedule.p) for pan in panels)
    heights = [0.95 + 0.42 * pan.run.schedule.p for pan in panels for _ in (0, 1)]
    fig = Figure(figsize=(width, 1.0 + sum(heights)), dpi=110, layout="constrained")
    axes = fig.subplots(len(heights), 1, gridspec_kw={"height_ratios": heights}, squeeze=False)[:, 0]
    for i, pan in enumerate(panels):
        _draw_pair(axes[2 * i], axes[2 * i + 1], pan, width * 72 * 0.84)
    ops = {b.action.op for pan in panels for b in pan.measured}
    chunks = max(pan.run.schedule.placement.chunks_per_rank for pan in panels)
    handles = legend_handles(ops, chunks, waits=True, marks=(PIPELINE_START, STEP_END))
    fig.legend(handles=handles, loc="outside lower center", ncol=(len(handles) + 1) // 2, fontsize=8, frameon=False)
    fig.suptitle("koala calibrate: the measured median step above its prediction with the calibrated profile"
                 + (f" {profile_name}" if profile_name else ""), fontsize=10)
    return fig


def _draw_pair(top, bottom, pan: CalibrationPanels, axes_width_pt: float) -> None:
    """The measured step on `top`, the prediction on `bottom`, one x axis; their titles."""
    run, step, s = pan.run, pan.step, pan.run.schedule
    chunks = s.placement.chunks_per_rank
    for ax, boxes, end in ((top, pan.measured, step.time), (bottom, pan.predicted, pan.result.makespan)):
        draw_timeline(ax, boxes, s.p, pan.extent, chunks, axes_width_pt)
        for x, (_, style) in ((pan.lead, PIPELINE_START), (pan.lead + end, STEP_END)):
            ax.axvline(x, color="black", linestyle=style, linewidth=1.0)
    bottom.sharex(top)
    top.tick_params(labelbottom=False)
    bottom.set_xlabel("time from the step's start (ms)", fontsize=8)
    where = f", pipeline {step.pipeline}" if any(x.pipeline for x in run.steps) else ""
    median = "" if abs(step.time - run.measured_ms) < 5e-4 * run.measured_ms else f" (median {run.measured_ms:.4g} ms)"
    _title(top, f"{s.name} measured (p={s.p}, m={s.m}, v={s.v}, {run.engine}): step time {step.time:.4g} ms{median}",
           f"step {step.number}{where} of {Path(run.name).name}: the median of {len(run.timed_steps)} steps",
           axes_width_pt)
    error = pan.result.makespan / run.measured_ms - 1 if run.measured_ms > 0 else 0.0
    _title(bottom, f"{s.name} calibrated prediction: step time {pan.result.makespan:.4g} ms ({error:+.1%} of the "
                   f"measured {run.measured_ms:.4g} ms)", f"bubble {pan.result.bubble_ratio:.1%}", axes_width_pt)


def _title(ax, head: str, detail: str, axes_width_pt: float) -> None:
    """`head; detail` as the axes' title, `detail` on a line of its own where one line is too long."""
    fontsize = 9.0
    one_line = f"{head}; {detail}"
    fits = len(one_line) * 0.55 * fontsize <= axes_width_pt
    ax.set_title(one_line if fits else f"{head}\n{detail}", fontsize=fontsize, loc="left")


def write_calibration_gantt(runs: Sequence[TracedRun], calibrated: Sequence[CostProfile], path: str | os.PathLike,
                            mode: str = "async", profile_name: str = "") -> Path:
    """`koala calibrate --gantt`: draw `calibration_figure` of every run (run i predicted with
    `calibrated[i]`) to `path` (.png, .svg, .pdf)."""
    image_format(Path(path))
    panels = [calibration_panels(run, prof, mode) for run, prof in zip(runs, calibrated)]
    return save_figure(calibration_figure(panels, profile_name), path)
