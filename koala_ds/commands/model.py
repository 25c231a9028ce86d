"""`koala simulate | compare`, and the --profile/--gantt/--trace options of `koala show`.

`--profile` takes a path to a cost profile (JSON v1) or the name of a bundled one
(`uniform-4`, `gpt-lmhead-8`, `gpt-chunks-8`).
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ..ir import KoalaError, Schedule
from . import dumps_json
from .table import format_table
from ..sim import (MODES, CostProfile, SimResult, bundled_profiles, load_profile, lower_bound_for, simulate,
                   unit_profile)

log = logging.getLogger(__name__)
FIXED_SUFFIXES = (".json", ".csv")
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


def render_outputs(schedule: Schedule, args: argparse.Namespace) -> SimResult | None:
    """For `koala show`: simulate when --profile, --gantt or --trace is given; write the files."""
    if not (getattr(args, "profile", None) or getattr(args, "gantt", None) or getattr(args, "trace", None)):
        return None
    profile = _profile_for(schedule, args)
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


def _default_p(profile: CostProfile | None, v: int, flag: str = "-p") -> int:
    if profile is None:
        raise KoalaError(f"{flag} is needed when no --profile is given")
    if profile.num_stages % v:
        raise KoalaError(f"{profile.source} has {profile.num_stages} stages, not a multiple of v={v}: give {flag}")
    return profile.num_stages // v


def _gap(makespan: float, bound: float) -> str:
    """How far above the lower bound (float noise below it shows as +0.0%)."""
    if bound <= 0:
        return "-"
    return f"{max(makespan / bound - 1, 0.0) if makespan >= bound * (1 - 1e-9) else makespan / bound - 1:+.1%}"


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


# -- koala simulate -----------------------------------------------------------------------
def cmd_simulate(args: argparse.Namespace) -> int:
    from .schedules import resolve_schedule

    profile = load_profile(args.profile) if args.profile else None
    if Path(args.schedule).suffix not in FIXED_SUFFIXES and args.p is None:
        args.p = _default_p(profile, args.v or 1)
    schedule = resolve_schedule(args)
    if profile is None:
        profile = unit_profile(schedule)
    result = simulate(schedule, profile, mode=args.mode, timeline=bool(args.gantt or args.trace or args.timeline))
    bound = lower_bound_for(schedule, profile)
    if args.json:
        out = {"schedule": schedule.name, "profile": profile.source, **result.to_dict(timeline=args.timeline),
               "lower_bound": bound.to_dict()}
        print(dumps_json(out, indent=1))
    else:
        print(f"{schedule.name}: p={schedule.p} m={schedule.m} v={schedule.v} "
              f"placement={schedule.placement.describe()} backward={schedule.backward}, {profile.source}, "
              f"{result.mode} sends")
        gap = _gap(result.makespan, bound.value)
        print(f"makespan {result.makespan:.6g} ms   bubble {result.bubble_ratio:.2%}   "
              f"lower bound {bound.value:.6g} ms ({bound.binding}; makespan {gap} over it)")
        rows = [(r, f"{result.busy[r]:.6g}", f"{result.idle[r]:.6g}", f"{result.idle[r] / result.makespan:.1%}"
                 if result.makespan else "-", f"{result.finish[r]:.6g}", f"{result.peak_memory_mb[r]:.6g}",
                 _mb(result.memory_limit_mb[r]),
                 "-" if result.memory_limit_mb[r] is None else
                 ("yes" if result.peak_memory_mb[r] <= result.memory_limit_mb[r] * (1 + 1e-9) else "NO"))
                for r in range(result.p)]
        print(format_table(rows, ("rank", "busy ms", "idle ms", "idle %", "finish ms", "peak MB", "limit MB", "fits"),
                     ">>>>>>>>"))
        if any(x is not None for x in result.memory_limit_mb):
            print("fits the memory limit" if result.fits_memory else "does NOT fit the memory limit")
        if args.timeline:
            for t in result.timeline or ():
                print(f"rank {t.rank}  {str(t.action):>8}  {t.start:10.4f}  {t.end:10.4f}")
    _write_files(schedule, result, args)
    return 0


# -- koala compare ------------------------------------------------------------------------
def compare_rows(profile: CostProfile, p: int, m: int, v: int, mode: str = "async") -> tuple[list[dict], list[str]]:
    """Every library schedule valid for (p, m, v) under `profile`, sorted by makespan; and the
    skipped ones with the reason."""
    from .. import library

    rows, skipped = [], []
    for name in library.names():
        program = library.get(name)
        reason = program.supports(p, m, v)
        if reason is not None:
            skipped.append(f"{name}: {reason}")
            continue
        schedule = program.compile(p, m, v)
        try:
            result = simulate(schedule, profile, mode=mode, timeline=False)
        except KoalaError as exc:
            skipped.append(f"{name}: {exc}".splitlines()[0])
            continue
        bound = lower_bound_for(schedule, profile)
        rows.append({"schedule": name, "placement": schedule.placement.describe(), "backward": schedule.backward,
                     "makespan": result.makespan, "bubble_ratio": result.bubble_ratio,
                     "peak_memory_mb": result.peak_memory_max, "fits_memory": result.fits_memory,
                     "has_limit": any(x is not None for x in result.memory_limit_mb),
                     "lower_bound": bound.value})
    # The baseline is 1f1b; with chunks (where 1f1b does not apply) its chunked form.
    base_row = next((r for name in BASELINES for r in rows if r["schedule"] == name), None)
    for r in rows:
        r["baseline"] = None if base_row is None else base_row["schedule"]
        r["speedup"] = None if base_row is None or r["makespan"] == 0 else base_row["makespan"] / r["makespan"]
    rows.sort(key=lambda r: (r["makespan"], r["schedule"]))
    return rows, skipped


def cmd_compare(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    v = args.v or 1
    p = args.p if args.p is not None else _default_p(profile, v)
    rows, skipped = compare_rows(profile, p, args.m, v, args.mode)
    if args.json:
        print(dumps_json({"profile": profile.source, "p": p, "m": args.m, "v": v, "mode": args.mode,
                          "schedules": rows, "skipped": skipped}, indent=1))
        return 0
    if not rows:
        raise KoalaError(f"no library schedule supports p={p}, m={args.m}, v={v}: " + "; ".join(skipped))
    print(f"{profile.source}: p={p} m={args.m} v={v}, {args.mode} sends")
    table = [(r["schedule"], r["placement"], r["backward"], f"{r['makespan']:.6g}",
              "-" if r["speedup"] is None else f"{r['speedup']:.3f}x",
              f"{r['bubble_ratio']:.1%}", f"{r['peak_memory_mb']:.6g}",
              ("yes" if r["fits_memory"] else "NO") if r["has_limit"] else "-",
              _gap(r["makespan"], r["lower_bound"]))
             for r in rows]
    baseline = f"vs {rows[0]['baseline']}" if rows[0]["baseline"] else "speedup"
    print(format_table(table, ("schedule", "placement", "backward", "makespan ms", baseline, "bubble", "peak MB",
                         "fits", "over bound"), "<<<>>>>>>"))
    if skipped:
        print(f"not valid for this configuration: {len(skipped)}")
        for line in skipped:
            print(f"  {line}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from .schedules import add_schedule_arguments

    p = sub.add_parser("simulate", help="simulate a schedule under a cost profile: makespan, bubble, memory")
    add_schedule_arguments(p)
    add_model_arguments(p)
    p.add_argument("--mode", choices=MODES, default="async",
                   help="async: non-blocking sends (default); rendezvous: a send waits for its receiver")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--timeline", action="store_true", help="also print (or include in --json) every action's times")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("compare", help="simulate every library schedule valid for a configuration")
    p.add_argument("--profile", required=True, metavar="P.json",
                   help=f"cost profile: a JSON file or a bundled name ({', '.join(bundled_profiles())})")
    p.add_argument("-m", type=int, required=True, help="microbatches per step")
    p.add_argument("-p", type=int, default=None, help="pipeline ranks (default: the profile's stages / v)")
    p.add_argument("-v", type=int, default=None, help="model chunks per rank (default 1)")
    p.add_argument("--mode", choices=MODES, default="async", help="communication mode (default async)")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(func=cmd_compare)
