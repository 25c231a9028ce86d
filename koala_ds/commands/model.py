"""`koala simulate | compare`, and the --profile/--gantt/--trace options of `koala show`.

`--profile` takes a path to a cost profile (JSON v1) or the name of a bundled one
(`uniform-4`, `gpt-lmhead-8`, `gpt-chunks-8`).
"""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from ..core.ir import KoalaError, Schedule, size_error
from ..library import FIXED_SUFFIXES
from ..core.outputs import OutputError, check_output
from . import dumps_json, positive_float
from .bounds import NO_FIT, ConfigBound, configuration_bound
from . import partition
from .table import format_table
from ..search.problem import weight_copies
from ..sim.layers import LayerProfile
from ..sim import (MODES, CostProfile, SimResult, bundled_profiles, load_profile, simulate,
                   unit_profile)

log = logging.getLogger(__name__)
BASELINES = ("1f1b", "interleaved-1f1b")


# -- shared pieces ------------------------------------------------------------------------
def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--profile, --gantt and --trace (used by `koala show`, `koala simulate`)."""
    parser.add_argument("--profile", metavar="P.json",
                        help=f"cost profile: a JSON file or a bundled name ({', '.join(bundled_profiles())}); "
                             f"default: unit costs (F = I = W = 1)")
    parser.add_argument("--gantt", metavar="OUT.png|OUT.svg", help="draw a Gantt chart of the simulated timeline")
    parser.add_argument("--trace", metavar="OUT.json",
                        help="write the simulated timeline as a Chrome trace (Perfetto, chrome://tracing)")


def _profile_for(schedule: Schedule, args: argparse.Namespace) -> CostProfile:
    name = getattr(args, "profile", None)
    return load_profile(name) if name else unit_profile(schedule)


def summary_line(result: SimResult, profile: CostProfile) -> str:
    fits = "" if all(x is None for x in result.memory_limit_mb) else \
        (", fits the memory limit" if result.fits_memory else ", DOES NOT FIT the memory limit")
    return (f"simulated with {profile.source} ({result.mode}): makespan {result.makespan:.4g} ms, "
            f"bubble {result.bubble_ratio:.1%}, peak memory {result.peak_memory_max:.4g} MB{fits}")


GANTT_SUFFIXES = (".png", ".svg", ".pdf")


def check_output_flags(args: argparse.Namespace) -> None:
    """--gantt and --trace can be written (before any work)."""
    if getattr(args, "gantt", None):
        check_output(args.gantt, "--gantt", GANTT_SUFFIXES)
    if getattr(args, "trace", None):
        check_output(args.trace, "--trace")
        if getattr(args, "gantt", None) and os.path.realpath(args.gantt) == os.path.realpath(args.trace):
            raise OutputError(f"--gantt and --trace both name {args.trace}: the trace would overwrite the chart; "
                              f"give each its own file")


def prepare_outputs(schedule: Schedule, args: argparse.Namespace) -> CostProfile | None:
    """For `koala show`, before it prints: the profile (checked against the schedule) when
    --profile, --gantt or --trace is given, and the output paths."""
    if not (getattr(args, "profile", None) or getattr(args, "gantt", None) or getattr(args, "trace", None)):
        return None
    check_output_flags(args)
    profile = _profile_for(schedule, args)
    check_profile_fits(profile, schedule.p, schedule.v, schedule.placement, _fixed_file(args))
    return profile


def render_outputs(schedule: Schedule, args: argparse.Namespace, profile: CostProfile | None = None
                   ) -> SimResult | None:
    """For `koala show`: simulate when --profile, --gantt or --trace is given; write the files."""
    if profile is None:
        profile = prepare_outputs(schedule, args)
        if profile is None:
            return None
    result = simulate(schedule, profile, mode=getattr(args, "mode", None) or "async", timeline=True)
    print(summary_line(result, profile))
    _write_files(schedule, result, args)
    return result


def _write_files(schedule: Schedule, result: SimResult, args: argparse.Namespace) -> None:
    if getattr(args, "gantt", None):
        from ..viz.gantt import write_gantt

        path = write_gantt(result, args.gantt, schedule)
        print(f"wrote Gantt chart {path}")
    if getattr(args, "trace", None):
        from ..viz.trace import write_chrome_trace

        path = write_chrome_trace(result, args.trace, schedule)
        print(f"wrote Chrome trace {path} (open it in https://ui.perfetto.dev or chrome://tracing)")


def check_profile_fits(profile: CostProfile, p: int, v: int, placement=None, fixed: str | None = None) -> None:
    """A one-line error naming -p / -v when the profile's stages are not the configuration's;
    `fixed`: the schedule file that fixes p and v (then the profile is what can change)."""
    stages = p * v if placement is None else placement.num_stages
    pipelines = 1 if placement is None else placement.pipelines
    if profile.num_stages in (stages, stages // pipelines):
        return
    if fixed is not None:
        raise KoalaError(f"{profile.source} has {profile.num_stages} stages but {fixed} is a schedule of p x v = "
                         f"{p} x {v} = {stages} stages: give --profile a profile of {stages // pipelines} stages")
    hint = f" (-p {profile.num_stages // v} for v={v})" if profile.num_stages % v == 0 else ""
    raise KoalaError(f"{profile.source} has {profile.num_stages} stages but p x v = {p} x {v} = {stages}: "
                     f"change -p or -v to match the profile{hint}")


def _fixed_file(args: argparse.Namespace) -> str | None:
    """The schedule argument when it is a fixed schedule file (.json, .csv: p and v are its own)."""
    name = getattr(args, "schedule", None)
    return name if isinstance(name, str) and Path(name).suffix in FIXED_SUFFIXES else None


def _default_p(profile: CostProfile | None, v: int, flag: str = "-p") -> int:
    if profile is None:
        raise KoalaError(f"{flag} is needed when no --profile is given")
    if profile.num_stages % v:
        divisors = [d for d in range(1, profile.num_stages + 1) if profile.num_stages % d == 0]
        raise KoalaError(f"{profile.source} has {profile.num_stages} stages, not a multiple of v={v} (the stages are "
                         f"p x v): change -v to one of {', '.join(map(str, divisors))}")
    return profile.num_stages // v


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


# -- koala simulate -----------------------------------------------------------------------
def _bound_line(schedule: Schedule, result: SimResult, bound: ConfigBound | None) -> str:
    if bound is None:
        return "lower bound -: the profile does not describe this configuration for the search's model"
    fits = bound.fits(result.peak_memory_mb)
    gap = bound.text(result.makespan, fits, weight_copies(schedule.placement))
    tail = "the schedule does not fit that memory limit" if gap == NO_FIT else f"makespan {gap} over it"
    return f"{bound.describe()}; {tail}"


def _rank_rows(result: SimResult) -> list[tuple]:
    return [(r, f"{result.busy[r]:.6g}", f"{result.idle[r]:.6g}", f"{result.idle[r] / result.makespan:.1%}"
             if result.makespan else "-", f"{result.finish[r]:.6g}", f"{result.peak_memory_mb[r]:.6g}",
             _mb(result.memory_limit_mb[r]),
             "-" if result.memory_limit_mb[r] is None else
             ("yes" if result.peak_memory_mb[r] <= result.memory_limit_mb[r] * (1 + 1e-9) else "NO"))
            for r in range(result.p)]


def _print_simulation(schedule: Schedule, profile: CostProfile, result: SimResult, bound: ConfigBound | None,
                      args: argparse.Namespace) -> None:
    print(f"{schedule.name}: p={schedule.p} m={schedule.m} v={schedule.v} "
          f"placement={schedule.placement.describe()} backward={schedule.backward}, {profile.source}, "
          f"{result.mode} sends")
    print(f"makespan {result.makespan:.6g} ms   bubble {result.bubble_ratio:.2%}")
    print(_bound_line(schedule, result, bound))
    print(format_table(_rank_rows(result), ("rank", "busy ms", "idle ms", "idle %", "finish ms", "peak MB",
                                            "limit MB", "fits"), ">>>>>>>>"))
    if any(x is not None for x in result.memory_limit_mb):
        print("fits the memory limit" if result.fits_memory else "does NOT fit the memory limit")
    if args.timeline:
        for t in result.timeline or ():
            print(f"rank {t.rank}  {str(t.action):>8}  {t.start:10.4f}  {t.end:10.4f}")


def cmd_simulate(args: argparse.Namespace) -> int:
    from .schedules import check_counts, resolve_schedule

    check_counts(args)
    check_output_flags(args)
    profile = partition.load_model_profile(args)
    layers = profile if isinstance(profile, LayerProfile) else None
    if Path(args.schedule).suffix not in FIXED_SUFFIXES and args.p is None:
        args.p = partition.default_p(layers, args, args.v or 1) if layers else _default_p(profile, args.v or 1)
    schedule = resolve_schedule(args)
    if layers is not None:  # the stage profile of --partition (default: the uniform split)
        profile, part = partition.stage_profile(layers, args, schedule.p, schedule.v, [schedule.placement])
        if not args.json:
            print(partition.split_line(layers, part, schedule.p, bool(args.partition)))
    if profile is None:
        profile = unit_profile(schedule)
    check_profile_fits(profile, schedule.p, schedule.v, schedule.placement, _fixed_file(args))
    result = simulate(schedule, profile, mode=args.mode, timeline=bool(args.gantt or args.trace or args.timeline))
    found = configuration_bound(profile, schedule.p, schedule.m, schedule.v)
    bound = found[0] if found else None
    if args.json:
        fits = bound is not None and bound.fits(result.peak_memory_mb)
        copies = weight_copies(schedule.placement)
        out = {"schedule": schedule.name, "profile": profile.source, **result.to_dict(timeline=args.timeline),
               "lower_bound": None if bound is None else bound.to_dict(),
               "over_bound": None if bound is None else bound.over(result.makespan, fits, copies),
               "fits_bound_memory_limit": fits}
        print(dumps_json(out, indent=1))
    else:
        _print_simulation(schedule, profile, result, bound, args)
    _write_files(schedule, result, args)
    return 0


# -- koala compare ------------------------------------------------------------------------
def compare_rows(profile: CostProfile, p: int, m: int, v: int, mode: str = "async",
                 memory_limit: float | None = None) -> tuple[list[dict], list[str]]:
    """Every library schedule valid for (p, m, v) under `profile`, sorted by makespan; and the
    skipped ones with the reason. Memory fits, and the gap to the bound, are against the limit
    in force (`bounds.configuration_bound`: --memory-limit, else the profile's, else 1F1B's peak)."""
    from .. import library

    found = configuration_bound(profile, p, m, v, memory_limit)
    bound, sim_profile = (found[0], found[1].search_profile) if found else (None, profile)
    rows, skipped = [], []
    for name in library.names():
        program = library.get(name)
        reason = program.supports(p, m, v)
        if reason is not None:
            skipped.append(f"{name}: {reason}")
            continue
        schedule = program.compile(p, m, v)
        try:
            result = simulate(schedule, sim_profile, mode=mode, timeline=False)
        except KoalaError as exc:
            skipped.append(f"{name}: {exc}".splitlines()[0])
            continue
        rows.append(_compare_row(name, schedule, result, bound))
    # The baseline is 1f1b; with chunks (where 1f1b does not apply) its chunked form.
    base_row = next((r for name in BASELINES for r in rows if r["schedule"] == name), None)
    for r in rows:
        r["baseline"] = None if base_row is None else base_row["schedule"]
        r["speedup"] = None if base_row is None or r["makespan"] == 0 else base_row["makespan"] / r["makespan"]
    rows.sort(key=lambda r: (r["makespan"], r["schedule"]))
    return rows, skipped


def _compare_row(name: str, schedule: Schedule, result: SimResult, bound: ConfigBound | None) -> dict:
    copies = weight_copies(schedule.placement)
    return {"schedule": name, "placement": schedule.placement.describe(), "backward": schedule.backward,
            "makespan": result.makespan, "bubble_ratio": result.bubble_ratio,
            "peak_memory_mb": result.peak_memory_max, "fits_memory": result.fits_memory,
            "has_limit": any(x is not None for x in result.memory_limit_mb),
            "lower_bound": None if bound is None else bound.value,
            "over_bound": None if bound is None else bound.over(result.makespan, result.fits_memory, copies),
            "over_bound_text": "-" if bound is None else bound.text(result.makespan, result.fits_memory, copies)}


def cmd_compare(args: argparse.Namespace) -> int:
    from .schedules import check_counts

    check_counts(args)
    profile = partition.load_model_profile(args)
    v = args.v or 1
    if isinstance(profile, LayerProfile):  # the stage profile of --partition (default: the uniform split)
        from ..search.problem import default_placements

        layers, p = profile, partition.default_p(profile, args, v)
        profile, part = partition.stage_profile(layers, args, p, v, default_placements(p, v))
        args.memory_limit = None  # folded in: the whole memory of a rank, static memory taken off
        if not args.json:
            print(partition.split_line(layers, part, p, bool(args.partition)))
    p = args.p if args.p is not None else _default_p(profile, v)
    check_profile_fits(profile, p, v)
    too_big = size_error(p, args.m, v)  # with the fewest actions per microbatch: no schedule fits
    if too_big:
        raise KoalaError(too_big)
    found = configuration_bound(profile, p, args.m, v, args.memory_limit)
    rows, skipped = compare_rows(profile, p, args.m, v, args.mode, args.memory_limit)
    if args.json:
        print(dumps_json({"profile": profile.source, "p": p, "m": args.m, "v": v, "mode": args.mode,
                          "lower_bound": None if found is None else found[0].to_dict(),
                          "schedules": rows, "skipped": skipped}, indent=1))
        return 0
    if not rows:
        raise KoalaError(f"no library schedule supports p={p}, m={args.m}, v={v}: " + "; ".join(skipped))
    _print_compare(profile, p, args, v, rows, skipped, None if found is None else found[0])
    return 0


def _print_compare(profile: CostProfile, p: int, args: argparse.Namespace, v: int, rows: list[dict],
                   skipped: list[str], bound: ConfigBound | None) -> None:
    print(f"{profile.source}: p={p} m={args.m} v={v}, {args.mode} sends")
    print(bound.describe() if bound is not None else "lower bound -")
    table = [(r["schedule"], r["placement"], r["backward"], f"{r['makespan']:.6g}",
              "-" if r["speedup"] is None else f"{r['speedup']:.3f}x",
              f"{r['bubble_ratio']:.1%}", f"{r['peak_memory_mb']:.6g}",
              ("yes" if r["fits_memory"] else "NO") if r["has_limit"] else "-", r["over_bound_text"])
             for r in rows]
    baseline = f"vs {rows[0]['baseline']}" if rows[0]["baseline"] else "speedup"
    print(format_table(table, ("schedule", "placement", "backward", "makespan ms", baseline, "bubble", "peak MB",
                               "fits", "over bound"), "<<<>>>>>>"))
    if skipped:
        print(f"not valid for this configuration: {len(skipped)}")
        for line in skipped:
            print(f"  {line}")


def register(sub: argparse._SubParsersAction) -> None:
    from .schedules import add_schedule_arguments

    p = sub.add_parser("simulate", help="simulate a schedule under a cost profile: makespan, bubble, memory")
    add_schedule_arguments(p)
    add_model_arguments(p)
    p.add_argument("--mode", choices=MODES, default="async",
                   help="async: non-blocking sends (default); rendezvous: a send waits for its receiver")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--timeline", action="store_true", help="also print (or include in --json) every action's times")
    partition.add_partition_argument(p)
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("compare", help="simulate every library schedule valid for a configuration")
    p.add_argument("--profile", required=True, metavar="P.json",
                   help=f"cost profile: a JSON file or a bundled name ({', '.join(bundled_profiles())})")
    p.add_argument("-m", type=int, required=True, help="microbatches per step")
    p.add_argument("-p", type=int, default=None, help="pipeline ranks (default: the profile's stages / v)")
    p.add_argument("-v", type=int, default=None, help="model chunks per rank (default 1)")
    p.add_argument("--mode", choices=MODES, default="async", help="communication mode (default async)")
    p.add_argument("--memory-limit", type=positive_float, default=None, metavar="MB",
                   help="per-rank activation memory limit (default: the profile's, else 1F1B's peak, as in "
                        "`koala search`)")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    partition.add_partition_argument(p)
    p.set_defaults(func=cmd_compare)
