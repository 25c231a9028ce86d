"""`koala calibrate`: fit a cost profile to what a training run measured.

    koala calibrate trace.json --profile prof.json -o calibrated.json [--skip-steps 1] [--settle-steps 1]
        [--timeline merged.json] [--gantt steps.png]
    koala calibrate t.json t.zb-v.json --profile prof_v1.json -o cal_v1.json --profile prof_v2.json -o cal_v2.json

With one --profile per v, each is fitted to the traces of its stages, and the speedups between
schedules of different v that took turns in one process are printed beside those their
calibrated profiles give (what a search weighing v = 1 against v = 2 relies on).

The fit is koala_ds.sim.calibrate's (the traces: koala_ds.sim.measured); this module loads the
inputs, prints the table (measured step time, predicted with the input and the calibrated
profile, per traced schedule; then the fitted values beside the profile's) and writes the files
(--gantt: koala_ds.viz.gantt.write_calibration_gantt).
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..core.json_input import NotJson, parse_json
from ..core.outputs import OutputError, atomic_write, check_output
from ..sim import MODES, CostProfile, bundled_profiles, resolve_profile
from ..sim.calibrate import (NOISE_SPREADS, CalibrationError, Fit, RunCheck, beside_by, calibrated_profile,
                             check_fits, check_runs, fit, matched_latency, merged_timeline)
from ..sim.measured import TracedRun, describe, load_runs
from ..sim.turn_speedups import SPEEDUP_TOLERANCE, TurnSpeedup, turn_speedups
from ..sim.profile import ProfileError
from . import nonnegative_int, positive_int
from .model import GANTT_SUFFIXES
from .table import format_table


def read_profile(name: str) -> tuple[dict, CostProfile]:
    """A stage profile's parsed JSON (kept whole in the output) and the profile it is."""
    path = resolve_profile(name)
    source = str(path) if Path(name).is_file() else path.stem
    try:
        data = parse_json(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError:
        raise ProfileError(f"{path}: not a JSON file (not UTF-8 text)") from None
    except NotJson as exc:
        raise ProfileError(f"{source}{exc.where}: not a JSON file ({exc.reason})") from None
    if isinstance(data, dict) and "layers" in data and "stages" not in data:
        raise ProfileError(f"{source}: a per-layer profile (field 'layers'); koala calibrate fits a stage profile "
                           f"(field 'stages', one entry per virtual stage of the traced run)")
    return data, CostProfile.from_dict(data, source)


@dataclass
class Calibration:
    """One --profile's calibration: its input, the traced runs it fits (those of its stages), the
    fit, the calibrated profile's JSON (`data`, written to `output`) and what koala calibrate
    prints of it."""

    name: str
    output: str
    raw: dict
    profile: CostProfile
    runs: list[TracedRun]
    data: dict = field(default_factory=dict)
    calibrated: CostProfile | None = None
    checks: list[RunCheck] = field(default_factory=list)
    printed: list[str] = field(default_factory=list)


def _match_latency(runs, data: dict, calibrated: CostProfile, notes: list[str], args, output: str) -> CostProfile:
    """The calibrated profile with the p2p latency matched to the runs' step times
    (`matched_latency`); the waits' estimate stays in meta.calibration and a note."""
    waits = calibrated.p2p_latency
    latency = matched_latency(runs, calibrated, args.mode)
    if round(latency, 6) == round(waits, 6):
        return calibrated
    data["p2p_latency"] = round(latency, 6)
    data["meta"]["calibration"]["p2p_latency_from_waits"] = round(waits, 6)
    notes.append(f"p2p_latency: {waits:.4g} ms from the waits for late messages, {latency:.4g} ms where the runs' "
                 f"predicted step times are their measured ones on average (the profile's)")
    return CostProfile.from_dict(data, source=output)


def cmd_calibrate(args: argparse.Namespace) -> int:
    _check_outputs(args)
    inputs = [(name, *read_profile(name)) for name in args.profile]
    runs = load_runs(args.traces, args.skip_steps, args.settle_steps)
    cals = [Calibration(name, out, raw, prof, group)
            for (name, raw, prof), out, group in zip(inputs, args.output, assign_runs(runs, inputs))]
    for cal in cals:
        calibrate_one(cal, args)
    across = speedups_across(cals, runs) if len(cals) > 1 else []
    for cal in cals if across else ():
        cal.data["meta"]["calibration"]["turn_speedups_across_profiles"] = [t.to_dict() for t in across]
    for i, cal in enumerate(cals):
        if len(cals) > 1:
            print("\n" * bool(i) + f"--profile {cal.name} ({cal.profile.num_stages} stages, {len(cal.runs)} traced "
                  f"run(s)):")
        print("\n".join(cal.printed))
    for line in speedup_lines(across, ACROSS_HEAD):
        print(line)
    for cal in cals:
        atomic_write(cal.output, json.dumps(cal.data, indent=1) + "\n", "-o")
        print(f"wrote calibrated profile {cal.output}")
    _write_pictures(args, cals, runs)
    return 0


def calibrate_one(cal: Calibration, args: argparse.Namespace) -> None:
    """Fit `cal.profile` to `cal.runs`; fill in the calibrated profile and what to print."""
    check_fits(cal.runs, cal.profile, _meta(cal.raw))
    fitted = fit(cal.runs, cal.profile.num_stages)
    cal.data, notes = calibrated_profile(cal.raw, fitted, cal.runs, args.skip_steps, cal.profile.source,
                                         args.settle_steps)
    cal.calibrated = CostProfile.from_dict(cal.data, source=cal.output)
    if fitted.p2p_latency.value is not None:
        cal.calibrated = _match_latency(cal.runs, cal.data, cal.calibrated, notes, args, cal.output)
    cal.checks = check_runs(cal.runs, cal.profile, cal.calibrated, args.mode)
    ranges = schedule_ranges(cal.checks)
    drift = drift_notes(ranges, len(cal.checks), any(r.took_turns for r in cal.runs))
    speedups = turn_speedups(cal.runs, [c.measured for c in cal.checks], [c.calibrated_ms for c in cal.checks])
    cal.data["meta"]["calibration"]["turn_speedups"] = [t.to_dict() for t in speedups]
    beside = step_overhead_note(cal, ranges, fitted.action_overhead.value or 0.0)
    cal.printed = ([_runs_table(cal.checks, cal.profile), "", _fit_table(cal.raw, cal.data, fitted)]
                   + [f"note: {line}" for line in [n for r in cal.runs for n in r.notes] + notes + drift + beside]
                   + miss_lines(cal.checks, ranges) + speedup_lines(speedups))


#: a schedule's own time beside the pipeline is noted where it differs from its placement's step
#: overhead by more than this fraction of the schedule's step (and by more than its noise)
BESIDE_NOTE = 0.01


def step_overhead_note(cal: Calibration, ranges: dict[str, tuple[float, float, int]], c: float) -> list[str]:
    """A note (as a list of at most one) where a traced schedule's steps spent another time beside
    the pipeline than the calibrated profile's step_overhead of its placement: by more than
    BESIDE_NOTE of its step and more than twice its own spread; per schedule, what its steps spent
    (less the fitted action overhead `c`, as the fit's step_overhead)."""
    style = {r.schedule.name: r.schedule.placement.style for r in cal.runs}
    k = {name: cal.calibrated.step_overhead_of(s) for name, s in style.items()}
    own = beside_by(cal.runs, c, lambda run: run.schedule.name)
    off = [name for name, est in own.items() if est.value is not None and ranges[name][0] > 0
           and abs(est.value - k[name]) > BESIDE_NOTE * (ranges[name][0] + ranges[name][1]) / 2
           and abs(est.value - k[name]) > 2 * (est.spread or 0.0) * (est.value + c)]
    if len(own) < 2 or not off:
        return []
    each = ", ".join(f"{name} {est.value:.4g}" for name, est in own.items() if est.value is not None)
    theirs = ", ".join(f"{name}'s ({style[name]}) {k[name]:.4g} ms" for name in off)
    return [f"time beside the pipeline per schedule (step time less its span, less action_overhead): {each} ms; "
            f"the profile's step_overhead of their placement: {theirs}: off by more than {BESIDE_NOTE:.0%} of a "
            f"step and its noise, their predictions by as much (the model has one step overhead per placement; "
            f"docs/profiling.md)"]


def assign_runs(runs: list[TracedRun], inputs: list[tuple[str, dict, CostProfile]]) -> list[list[TracedRun]]:
    """Per --profile, the traced runs it is the profile of: each run to the one profile that fits
    it (check_fits: as many stages as the run's virtual stages, or as its stages per pipeline,
    and the p and v of the profile's meta where it gives them), preferring one of as many stages
    as the run's virtual stages. With one --profile, every run (check_fits then names a misfit)."""
    if len(inputs) == 1:
        return [list(runs)]
    groups: list[list[TracedRun]] = [[] for _ in inputs]
    for run in runs:
        fits = [i for i, (_, raw, prof) in enumerate(inputs) if _fits(run, prof, raw)]
        exact = [i for i in fits if inputs[i][2].num_stages == run.schedule.placement.num_stages]
        chosen = exact or fits
        if len(chosen) != 1:
            what = f"{run.name}: a trace of {describe(run.schedule)} ({run.schedule.placement.num_stages} virtual stages)"
            raise CalibrationError(f"{what}, and --profile {', '.join(inputs[i][0] for i in chosen)} all fit it: give "
                                   f"one --profile per v" if chosen else
                                   f"{what}, which no --profile fits: give the profile of its stages too")
        groups[chosen[0]].append(run)
    for (name, _, prof), group in zip(inputs, groups):
        if not group:
            raise CalibrationError(f"--profile {name}: none of the traces is of its {prof.num_stages} stages: "
                                   f"give a trace of its v, or leave it out (and its -o)")
    return groups


def _fits(run: TracedRun, profile: CostProfile, raw: dict) -> bool:
    try:
        check_fits([run], profile, _meta(raw))
    except CalibrationError:
        return False
    return True


def _meta(raw: dict) -> dict | None:
    """A profile's `meta` (what check_fits reads of the p and v it was made for), if an object."""
    return raw["meta"] if isinstance(raw.get("meta"), dict) else None


def speedups_across(cals: list[Calibration], runs: list[TracedRun]) -> list[TurnSpeedup]:
    """The speedups between schedules that took turns in one process across --profiles (a v = 2
    schedule over 1f1b, say): per schedule of another --profile than the first trace's, its speedup
    over the first trace's schedule measured per process, and as their calibrated profiles give it
    (each on its own). What a search comparing v = 1 and v = 2 on these profiles relies on."""
    of = {id(c.run): (cal, c) for cal in cals for c in cal.checks}
    checks = [of[id(r)][1] for r in runs]
    base = of[id(runs[0])][0]
    own = {r.schedule.name for r in base.runs}
    return [t for t in turn_speedups(runs, [c.measured for c in checks], [c.calibrated_ms for c in checks])
            if t.schedule not in own]


def _write_pictures(args: argparse.Namespace, cals: list[Calibration], runs: list[TracedRun]) -> None:
    """--timeline and --gantt: every run in the order given, each predicted with its --profile's calibration."""
    of = {id(r): cal.calibrated for cal in cals for r in cal.runs}
    profiles = [of[id(r)] for r in runs]
    if args.timeline:
        atomic_write(args.timeline, json.dumps(merged_timeline(runs, profiles, args.mode)), "--timeline")
        print(f"wrote {args.timeline}: measured and predicted side by side (open it in https://ui.perfetto.dev)")
    if args.gantt:
        from ..viz.gantt import write_calibration_gantt

        write_calibration_gantt(runs, profiles, args.gantt, args.mode, ", ".join(cal.output for cal in cals))
        print(f"wrote {args.gantt}: each run's measured median step above the calibrated prediction")


def miss_lines(checks: list[RunCheck], ranges: dict[str, tuple[float, float, int]]) -> list[str]:
    """A warning per run the calibrated profile misses by more than 10% beyond the runs' noise
    (the model lacks a term that run pays); a note instead where the miss is within that noise,
    or within the range the runs of its schedule measured (`ranges`: the machine drifted between them)."""
    out = []
    for c in checks:
        lo, hi, n = ranges[c.run.schedule.name]
        head = (f"{c.run.name}: the calibrated profile predicts {c.calibrated_ms:.4g} ms, "
                f"{c.calibrated_error:+.1%} off the measured {c.measured:.4g} ms")
        if c.misses and n > 1 and lo <= c.calibrated_ms <= hi:
            out.append(f"note: {head}, within the {lo:.4g}-{hi:.4g} ms that the {n} runs of {c.run.schedule.name} "
                       f"measured: the machine's speed drifted between them")
        elif c.misses:
            out.append(f"warning: {head}: the model lacks a term this run pays (see docs/profiling.md, "
                       f"\"Calibrating from a measured run\")")
        elif c.off:
            out.append(f"note: {head}, within {NOISE_SPREADS:g} x the largest spread of the runs' medians "
                       f"(+-{c.noise:.1%}): their steps vary too much to tell a missing term from noise; "
                       f"trace more steps")
    return out


TURNS_HEAD = ("speedups between the schedules that took turns (per process, their median steps), and the calibrated "
              "profile's:")
ACROSS_HEAD = ("speedups between schedules of different --profiles that took turns (per process, their median steps), "
               "and their calibrated profiles' (each schedule on its own):")


def speedup_lines(speedups: list[TurnSpeedup], head: str = TURNS_HEAD) -> list[str]:
    """The speedups measured between schedules that took turns in one process, beside the
    calibrated profile's (koala_ds.sim.turn_speedups); a warning per one the profile misses."""
    if not speedups:
        return []
    out = [head] + [f"  {t.line()}" for t in speedups]
    for t in (t for t in speedups if t.misses):
        out.append(f"warning: the calibrated profile puts {t.schedule} at {t.predicted:.3f}x of {t.over}, the runs "
                   f"measured {t.mean:.3f}x: off by more than {SPEEDUP_TOLERANCE:g} and twice its SE; a search on "
                   f"this profile misjudges such schedules by as much (docs/profiling.md, \"Calibrating from a "
                   f"measured run\")")
    for t in (t for t in speedups if t.imprecise and not t.misses):
        how = ("in one process, its noise unknown" if t.se is None else
               f"to +-{2 * t.se:.3f} (twice its SE), more than {SPEEDUP_TOLERANCE:g}")
        out.append(f"note: {t.schedule} over {t.over} measured {how}: the runs cannot check a promise of this "
                   f"speedup to {SPEEDUP_TOLERANCE:g}; trace more runs (each a process of its own) or more steps")
    return out


def schedule_ranges(checks: list[RunCheck]) -> dict[str, tuple[float, float, int]]:
    """Per traced schedule: (lowest, highest measured step time, runs)."""
    by_schedule: dict[str, list[float]] = {}
    for c in checks:
        by_schedule.setdefault(c.run.schedule.name, []).append(c.measured)
    return {name: (min(times), max(times), len(times)) for name, times in by_schedule.items()}


def drift_notes(ranges: dict[str, tuple[float, float, int]], runs: int, took_turns: bool = False) -> list[str]:
    """Per schedule traced in several runs, how far apart their measured step times are (the
    machine's drift between runs, which the fit averages; `ranges`: `schedule_ranges`); where
    every schedule is one of `runs` > 1 runs, and they did not take turns in one run
    (`took_turns`), the advice to trace them so."""
    out = []
    for name, (lo, hi, n) in ranges.items():
        if n > 1 and lo > 0:
            out.append(f"{name}'s {n} runs measured {lo:.4g}-{hi:.4g} ms ({hi / lo - 1:.1%} apart): "
                       f"the fit averages them")
    if not out and runs > 1 and not took_turns:
        out.append("one run per schedule: where the machine's speed drifts between runs (on a shared 2-core VM "
                   "one schedule's fresh runs measured up to 28% apart), trace the schedules taking turns in one "
                   "run (the examples' --alternate-schedules with a trace: a trace per schedule; docs/profiling.md)")
    return out


def _check_outputs(args: argparse.Namespace) -> None:
    """One -o per --profile; -o, --timeline and --gantt can be written, each its own file (before any work)."""
    if len(args.output) != len(args.profile):
        raise OutputError(f"{len(args.profile)} --profile and {len(args.output)} -o: give one -o per --profile, "
                          f"in the same order (its calibrated profile)")
    named = []
    for out in args.output:
        check_output(out, "-o")
        named.append(("-o", out))
    if args.timeline:
        check_output(args.timeline, "--timeline")
        named.append(("--timeline", args.timeline))
    if args.gantt:
        check_output(args.gantt, "--gantt", GANTT_SUFFIXES)
        named.append(("--gantt", args.gantt))
    for i, (flag, path) in enumerate(named):
        for other, same in named[i + 1:]:
            if os.path.realpath(path) == os.path.realpath(same):
                raise OutputError(f"{flag} and {other} both name {path}: give each its own file")


def _runs_table(checks: list[RunCheck], profile: CostProfile) -> str:
    rows = [(c.run.name, c.run.schedule.name, c.run.schedule.p, c.run.schedule.m, c.run.schedule.v,
             len(c.run.steps), f"{c.measured:.4g}", f"+-{c.spread:.1%}", f"{c.input_ms:.4g}", f"{c.input_error:+.1%}",
             f"{c.calibrated_ms:.4g}", f"{c.calibrated_error:+.1%}") for c in checks]
    table = format_table(rows, ("traced run", "schedule", "p", "m", "v", "steps", "measured ms", "spread", "input ms",
                                "error", "calibrated ms", "error"), "<<>>>>>>>>>>")
    return table + (
        "\n(measured: the median over the complete steps of the step time, from a step's first compute to the next "
        "step's;\n spread: how precisely those steps give the median, sqrt(pi/2) x their interquartile range / "
        f"sqrt(steps), as in a profile;\n predicted with the input profile {profile.source} and the calibrated one; "
        "error = predicted / measured - 1)")


def _fit_table(raw: dict, data: dict, fitted: Fit) -> str:
    def cell(i: int, before: dict, after: dict, name: str) -> str:
        was = before.get(name, before["backward_input"] + before["backward_weight"] if name == "backward" else None)
        now = after.get(name, after["backward_input"] + after["backward_weight"] if name == "backward" else None)
        mark = "" if (i, name) in fitted.stages else "*"
        return f"{was:.4g} -> {now:.4g}{mark}"

    def switch(i: int, before: dict, after: dict) -> str:
        est = fitted.switch.get(i)
        return (f"{before.get('switch', 0.0):.4g} -> {after.get('switch', 0.0):.4g}"
                + (f" ({est.samples})" if est is not None else "*"))

    rows = [(i, *(cell(i, b, a, n) for n in ("forward", "backward_input", "backward_weight", "backward")),
             switch(i, b, a)) for i, (b, a) in enumerate(zip(raw["stages"], data["stages"]))]
    table = format_table(rows, ("stage", "F ms", "I ms", "W ms", "B ms", "switch ms"), "<>>>>>")
    lines = [table, "(profile -> calibrated; * not measured: scaled from the profile, a switch kept; switch: the "
                    "extra time of an action after one of another stage on its rank, (its samples))"]
    if fitted.forward_extra:
        lines.append("I includes what the split schedules' F took over the full ones' (both traced taking turns): "
                     + ", ".join(f"stage {i} +{est.value:.4g} ms" for i, est in fitted.forward_extra.items()))
    for name, what in (("p2p_latency", "waits"), ("action_overhead", "gaps"), ("step_overhead", "steps")):
        est = getattr(fitted, name)
        lines.append(f"{name:<16} {raw.get(name, 0.0):.4g} -> {data.get(name, 0.0):.4g} ms"
                     + (f" ({est.samples} {what})" if est.value is not None else " (not measured)"))
    before, after = raw.get("step_overhead_by_placement") or {}, data.get("step_overhead_by_placement") or {}
    for style, value in after.items():
        est = fitted.step_overhead_by_placement.get(style)
        was = before.get(style, raw.get("step_overhead", 0.0))
        lines.append(f"  of {style:<12} {was:.4g} -> {value:.4g} ms"
                     + (f" ({est.samples} steps)" if est is not None and est.value is not None else " (kept)"))
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="fit a cost profile to a measured run's traces (step, action and "
                                         "p2p overheads, stage times)")
    p.add_argument("traces", nargs="+", metavar="TRACE",
                   help="a traced run's FILE (its FILE.rank*.json files are read) or trace files; several runs "
                        "(other schedules) may be given")
    p.add_argument("--profile", required=True, action="append", metavar="P.json",
                   help=f"the stage profile to calibrate: a JSON file or a bundled name ({', '.join(bundled_profiles())}); "
                        "given once per v (each v's profile, its own -o), each is fitted to the traces of its stages, "
                        "and the speedups of schedules that took turns across them are printed")
    p.add_argument("-o", "--output", required=True, action="append", metavar="OUT.json",
                   help="write the calibrated profile here (one per --profile, in the same order)")
    p.add_argument("--skip-steps", type=nonnegative_int, default=1, metavar="N",
                   help="leave out each run's first N steps (default 1: step 0 is the warm-up); where schedules "
                        "took turns, steps are numbered over all of them, and the first of each turn is left out too")
    p.add_argument("--settle-steps", type=positive_int, default=1, metavar="N",
                   help="where schedules took turns, leave out the first N steps of each turn (default 1: the one "
                        "after another schedule's step; 2 where they ran on model copies of their own, whose second "
                        "step still runs slow)")
    p.add_argument("--timeline", metavar="MERGED.json",
                   help="write a Chrome trace of the measured step beside the calibrated prediction (Perfetto)")
    p.add_argument("--gantt", metavar="OUT.png|OUT.svg",
                   help="draw each run's measured median step (rows = pipeline ranks, waits hatched) above the "
                        "calibrated prediction, on one time axis (needs matplotlib)")
    p.add_argument("--mode", choices=MODES, default="async",
                   help="simulation mode of the predictions (default async, as `koala simulate`)")
    p.set_defaults(func=cmd_calibrate)

