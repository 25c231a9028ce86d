"""Per-layer profiles on the command line: `--partition` of `koala simulate | compare | search`,
and `koala search --partition auto` (the split and the schedule searched together)."""
from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

from ..core.ir import KoalaError, Placement
from ..core.layout import run_lines
from ..sim import CostProfile, ProfileError
from ..sim.layers import LayerProfile, load_any_profile, parse_partition, partition_text
from . import cli_words
from .table import format_table

log = logging.getLogger(__name__)

PARTITION_HELP = ("with a per-layer profile: layers per virtual stage in pipeline order, comma-separated "
                  "(e.g. 6,5,5,4,4,4,4,2; the embedding and output entries count as layers); default: the "
                  "engines' uniform split")


def add_partition_argument(parser: argparse.ArgumentParser, auto: bool = False) -> None:
    extra = "; auto: search it together with the schedule" if auto else ""
    parser.add_argument("--partition", type=_partition_text, metavar="auto|N,N,..." if auto else "N,N,...",
                        default=None, help=PARTITION_HELP + extra)


def _partition_text(text: str) -> str:
    """--partition as given; an empty one is refused (it was taken as no --partition at all)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give the layers per virtual stage, N,N,..., or drop it")
    return text


def load_model_profile(args: argparse.Namespace) -> CostProfile | LayerProfile | None:
    """The --profile (None when not given); --partition only with a per-layer profile."""
    if not getattr(args, "profile", None):
        if getattr(args, "partition", None):
            raise KoalaError("--partition needs --profile with a per-layer profile (field 'layers')")
        return None
    profile = load_any_profile(args.profile)
    if isinstance(profile, CostProfile) and getattr(args, "partition", None):
        raise KoalaError(f"--partition needs a per-layer profile (field 'layers'); {profile.source} is a stage "
                         f"profile (one entry per stage): drop --partition")
    return profile


def default_p(lp: LayerProfile, args: argparse.Namespace, v: int) -> int:
    """-p, else the number of --partition counts / v."""
    if args.p is not None:
        return args.p
    part = getattr(args, "partition", None)
    if part and part != "auto":
        n = len(part.split(","))
        if n % v == 0:
            return n // v
    raise KoalaError(f"-p is needed with a per-layer profile ({lp.source}), or --partition with p x v counts")


def partition_of(lp: LayerProfile, args: argparse.Namespace, stages: int) -> list[int]:
    """--partition, checked, or the uniform split."""
    text = getattr(args, "partition", None)
    if not text:
        return lp.uniform_partition(stages)
    return parse_partition(text, lp.num_layers, stages, lp.source)


def stage_profile(lp: LayerProfile, args: argparse.Namespace, p: int, v: int,
                  placements: list[Placement] | None = None) -> tuple[CostProfile, list[int]]:
    """The stage profile of --partition (or the uniform split) on p ranks; with several
    placements each rank gets the least of its limits under them (static memory differs)."""
    lp = with_limit(lp, getattr(args, "memory_limit", None))
    part = partition_of(lp, args, p * v)
    pls = [pl for pl in placements or [] if pl.pipelines == 1 and pl.num_stages == p * v] or [None]
    profiles = [lp.stage_profile(part, p, pl) for pl in pls]
    prof = profiles[0]
    if len(profiles) > 1 and prof.memory_limit_mb is not None:
        limits = tuple(min(lim) for lim in zip(*(x.memory_limit_mb for x in profiles)))
        prof = dataclasses.replace(prof, memory_limit_mb=limits)
    return prof, part


def with_limit(lp: LayerProfile, limit: float | None) -> LayerProfile:
    """--memory-limit, with a per-layer profile: the whole memory of a rank (static included)."""
    return lp if limit is None else dataclasses.replace(lp, memory_limit_mb=float(limit))


def split_line(lp: LayerProfile, part: list[int], p: int, given: bool) -> str:
    how = "--partition" if given else "uniform, the engines' default; --partition to change it"
    return f"split of {lp.source}'s {lp.num_layers} layers: {partition_text(part)} ({how})"


# -- koala search --partition auto -----------------------------------------------------------
def _check_auto(args: argparse.Namespace) -> None:
    for flag, value, default in (("--backward", args.backward, "auto"), ("--placement", args.placement, "default")):
        if value != default:
            raise KoalaError(f"--partition auto searches {flag} {default} only: drop {flag} {value}, or give a "
                             f"--partition to search the schedules of one split")
    if args.exact:
        raise KoalaError("--exact needs one split: give --partition N,N,... instead of auto")
    if getattr(args, "min_gain", None):  # given (its default applies to one split only)
        raise KoalaError("--min-gain needs one split: give --partition N,N,... instead of auto")


def cmd_search_auto(args: argparse.Namespace, lp: LayerProfile, out: Path) -> int:
    from ..search.partition import search_partition
    from .search import _write

    _check_auto(args)
    p = default_p(lp, args, args.v)
    limit = "the profile's" if lp.memory_limit_mb is not None else "1F1B's peak on the uniform split"
    if not args.quiet:
        print(f"searching the split and the schedule of {lp.source} ({lp.num_layers} layers): p={p} m={args.m} "
              f"v={args.v}, memory limit {'--memory-limit' if args.memory_limit else limit} (whole memory per rank, "
              f"static memory included), budget {args.time_budget:g} s")
    res = search_partition(lp, p, args.m, args.v, args.memory_limit, args.time_budget, args.seed)
    schedule = res.joint.schedule.with_name(res.joint.schedule_name)  # a copy: its description changes
    schedule.meta["description"] = (f"split {partition_text(res.joint.partition)} of {Path(lp.source).name} "
                                    f"(layers per stage); " + schedule.meta.get("description", ""))
    _write(out, schedule, lp.source)
    print_auto(res, lp, p)
    if args.gantt:
        from ..sim import simulate
        from ..viz.gantt import write_gantt

        lim_lp = dataclasses.replace(lp, memory_limit_mb=res.memory_limit_mb)
        prof = lim_lp.stage_profile(res.joint.partition, p, schedule.placement)
        print(f"wrote Gantt chart {write_gantt(simulate(schedule, prof, timeline=True), args.gantt, schedule)}")
    print(f"wrote {out}")
    return 0


def print_auto(res, lp: LayerProfile, p: int) -> None:
    joint = res.joint
    sched = joint.schedule
    lim = res.memory_limit_mb
    lim_text = "none" if lim is None else (f"{lim:.6g} MB" if isinstance(lim, float) else
                                           ",".join(f"{x:.6g}" for x in lim) + " MB")
    print(f"split: {partition_text(joint.partition)} (layers per virtual stage in pipeline order)")
    print(f"schedule: {joint.schedule_name} (placement {sched.placement.describe()}, backward {sched.backward}); "
          f"makespan {joint.makespan:.6g} ms, peak activations {joint.peak:.6g} MB; memory limit {lim_text} per "
          f"rank ({cli_words(res.memory_limit_source)})")
    print(f"lower bound for any split and schedule: {res.bound.value:.6g} ms; the answer is {res.gap:+.2%} over it")
    print("over uniform split + best predefined: " + ("-" if res.speedup is None else f"{res.speedup:.2f}x"))
    base = res.uniform_predefined
    rows = []
    for ans in (res.uniform_predefined, res.uniform_searched, res.split_baseline, joint):
        if ans is None:
            continue
        rows.append((ans.label, partition_text(ans.partition), ans.schedule_name, f"{ans.makespan:.6g}",
                     "-" if base is None else f"{base.makespan / ans.makespan:.2f}x"))
    print(format_table(rows, ("", "split", "schedule", "makespan ms", "vs uniform + predefined"), "<<<>>"))
    print(f"({res.partitions_scored} splits scored with every predefined schedule, {res.schedule_searches} "
          f"schedule searches, {res.wall_s:.1f} s)")
    print("run it with:")
    for line in run_lines([x.kind for x in lp.layers], joint.partition, p, sched.placement):
        print(f"  {line}")


def print_run_lines(lp: LayerProfile, part: list[int], p: int, placement: Placement | None) -> None:
    try:
        lines = run_lines([x.kind for x in lp.layers], part, p, placement)
    except (KoalaError, ProfileError) as exc:
        log.info("no engine settings: %s", exc)
        return
    print("run it with:")
    for line in lines:
        print(f"  {line}")
