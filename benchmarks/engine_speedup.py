"""Measured vs predicted step time of Koala schedules on the real engines (emulated compute).

    python benchmarks/engine_speedup.py            # every bundled profile, p = 4 and 8
    python benchmarks/engine_speedup.py --quick    # gpt-lmhead-8 at p = 4 only
    python benchmarks/engine_speedup.py --real     # the tiny real GPT of examples/megatron_gpt
    python benchmarks/engine_speedup.py --json     # one JSON object per row on stdout
    python benchmarks/engine_speedup.py --overhead-only -p 4   # the runtimes' CPU per action only

THIS MEASURES THE SCHEDULE AND THE RUNTIME, NOT KERNELS. Each virtual stage is an
`EmulatedStage` (koala_ds/profiler/emulate.py) whose forward, backward-input and
backward-weight steps *sleep* for the profile's times while real tensors go through the real
engine (koala_ds.megatron: megatron-core's forward_step / backward_step, the Koala p2p layer,
the split backward; koala_ds.deepspeed when installed), one process per pipeline rank over gloo.
Sleeping ranks use no CPU, so 4 to 8 ranks measure faithfully on a 2-core machine.

Per (engine, profile, p), three rows: 1f1b; the best predefined schedule (library schedules the
engine runs: one pipeline, by simulated makespan, among those that fit the memory limit: the
profile's, else 1F1B's peak); the searched schedule (koala_ds.search, short budget, one-pipeline
placements, split and full backward both searched: the better one; when the search finds nothing
faster than a library schedule, a tie included, its answer is that schedule, marked '= name';
`--min-gain PCT` keeps 1f1b unless a schedule is predicted more than PCT% faster). Step time = latest end -
earliest start over ranks of one forward_backward call (Megatron) or train_batch (DeepSpeed,
which also reduces gradients and steps the optimizer), median of 30 steps after 2 warm-up
steps (10 with --quick, 20 with --real; `--steps N`), each round in a new job order. m = 2p
microbatches. Why: at 1 ms ops, 4 to 8 ranks on 2 cores make one step vary by +-30%, and on this
machine a step's time also depends on the jobs run just before it: in a fixed order two runs of
the *same* schedule in one launch measured up to 25% apart (1f1b and a searched schedule equal
to it: 68.7 vs 76.5 ms, 344 vs 447 ms), also with 30 steps; with a new order every round
(tests/engine_runs.py) they agree within a few percent.

How a profile meets p (documented choice): an 8-stage profile at p = 4 is run both ways: as
v = 1 with stages merged pairwise (1f1b and every v = 1 schedule) and as v = 2 (8 virtual
stages: interleaved / V-shape schedules); the best predefined and the searched row take the
better of the two. A 4-stage profile at p = 8 has each stage split into two halves.

The first stage's I backpropagates through its layers (with the weight GEMMs deferred) though
it computes no input gradient; the emulated stage 0 sleeps I in its I and W in its W, as the
profile says and as `koala profile` measures a real model (koala_ds.runtime.wgrad).

Two predictions per row: `predicted_profile_ms` is the simulator on the profile as written;
`predicted_ms` adds constants measured on this machine: the p2p latency (2-process gloo
ping-pong, one way, for the activation size) and the runtime's overhead, c ms per action plus
k ms per step, fitted on calibration runs that are not rows (1f1b with uniform 1 ms ops at m
and at m / 2 microbatches: two lengths give the two constants; the per-action overhead at zero
compute is reported too). Both predictions are printed. With `--real` a third calibration run
(interleaved-1f1b, two chunks per rank, 0.5 ms ops) gives the per-action overhead of two-chunk
schedules, which is higher than one chunk's on both engines; v = 2 rows and the search at v = 2
use it.

One launch per (engine, p): the calibration runs first; rank 0 then chooses the schedules
(best predefined, search) on the model of this machine (profile + the two constants), as a
user who profiles first would; then the calibration runs and every row run round-robin (step k
of every run, then step k + 1, ...) so that load drifts of a shared machine hit them alike, and
the constants used for the predictions come from these interleaved calibration runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness: engine_runs, deepspeed_jobs

from koala_ds.core.ir import Schedule  # noqa: E402
from koala_ds.library import get as library_get, names as library_names  # noqa: E402
from koala_ds.resolve import load_schedule  # noqa: E402
from koala_ds.sim import CostProfile, Simulator, StageCost, load_profile  # noqa: E402
from koala_ds.sim.profile import with_action_overhead  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BANNER = ("NOTE: emulated compute. Every stage SLEEPS for the profile's F / I / W times while real tensors go "
          "through the real engine: this measures the schedule and the runtime, not kernels.")


# -- profiles ------------------------------------------------------------------------------------
def merge_pairs(profile: CostProfile) -> CostProfile:
    st = profile.stages
    merged = [StageCost(*(getattr(a, f) + getattr(b, f) for f in ("forward", "backward_input", "backward_weight",
                                                                    "activation_mb", "w_hold_mb")),
                        backward_full=None if a.backward_full is None and b.backward_full is None
                        else a.backward + b.backward)
              for a, b in zip(st[0::2], st[1::2])]
    return CostProfile(tuple(merged), profile.p2p_latency, profile.memory_limit_mb, profile.source + " (merged x2)")


def split_halves(profile: CostProfile) -> CostProfile:
    halves = []
    for s in profile.stages:
        h = StageCost(s.forward / 2, s.backward_input / 2, s.backward_weight / 2, s.activation_mb / 2, s.w_hold_mb / 2,
                      None if s.backward_full is None else s.backward_full / 2)
        halves += [h, h]
    return CostProfile(tuple(halves), profile.p2p_latency, profile.memory_limit_mb, profile.source + " (split /2)")


def with_latency(profile: CostProfile, latency: float) -> CostProfile:
    return dataclasses.replace(profile, p2p_latency=latency)


def scaled(profile: CostProfile, k: float) -> CostProfile:
    if k == 1:
        return profile
    st = tuple(dataclasses.replace(s, forward=s.forward * k, backward_input=s.backward_input * k,
                                   backward_weight=s.backward_weight * k,
                                   backward_full=None if s.backward_full is None else s.backward_full * k)
               for s in profile.stages)
    return dataclasses.replace(profile, stages=st)


def variants(profile: CostProfile, p: int) -> dict[int, CostProfile]:
    """The profile for each v it can run at on p ranks (see the module docstring)."""
    n = profile.num_stages
    if n == p:
        return {1: profile}
    if n == 2 * p:
        return {1: merge_pairs(profile), 2: profile}
    if 2 * n == p:
        return {1: split_halves(profile)}
    raise SystemExit(f"{profile.source}: {n} stages cannot be run at p={p}")


# -- prediction ----------------------------------------------------------------------------------
def predict(schedule: Schedule, profile: CostProfile, overhead_ms: float = 0.0) -> float:
    """Simulated makespan (async sends) with `overhead_ms` added to every action (F, I, W, B)."""
    profile = with_overhead(profile, overhead_ms)
    return Simulator(profile, schedule.placement, schedule.m, schedule.backward).makespan(schedule.ranks)


def solve_increasing(f, target: float, lo: float, hi: float, iters: int = 50) -> float:
    """x in [lo, hi] with f(x) == target for an increasing f: bisection, `iters` halvings."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def fit_overhead(schedule: Schedule, profile: CostProfile, measured: float) -> float:
    """The per-action overhead c (ms) with predict(schedule, profile, c) == measured."""
    if predict(schedule, profile, 0.0) >= measured:
        return 0.0
    return solve_increasing(lambda c: predict(schedule, profile, c), measured, 0.0, 50.0)


# -- choosing the schedules ------------------------------------------------------------------------
def with_overhead(profile: CostProfile, overhead_ms: float) -> CostProfile:
    """`overhead_ms` added to every action: F, I, W and B (B is one action: once, not as I + W
    twice, so a profile without `backward` gets one with B = I + W + overhead)."""
    if not overhead_ms:
        return profile
    return dataclasses.replace(profile, stages=tuple(with_action_overhead(s, overhead_ms) for s in profile.stages))


def overhead_for(overhead: float | dict, v: int) -> float:
    """The per-action overhead for schedules with v chunks per rank: one number, or one per v
    (the runtimes' overhead per action differs with the number of chunks)."""
    return overhead.get(v, overhead[1]) if isinstance(overhead, dict) else overhead


def candidates(profile: CostProfile | dict[int, CostProfile], p: int, m: int, budget: float, seed: int = 0,
               latency: float | None = None, overhead: float | dict = 0.0, min_gain: float = 0.0
               ) -> tuple[dict, float]:
    """{'1f1b': (schedule, model profile), 'best predefined (..)': ..., 'searched (..)': ...} and the
    memory limit. The choice (simulated makespan) uses the model of this machine: the profile with
    the measured p2p `latency` and per-action `overhead` (the search adds it to F, I and W).
    `profile`: one profile (`variants` gives each v its model) or the model of each v ({v: profile
    of p * v stages}: what the runtime runs at that v, measured). `min_gain` (a fraction): the
    searched row is 1f1b unless a schedule is predicted faster than it by more than that
    (`koala search --min-gain`, applied within each search and across v and backward kinds)."""
    from koala_ds.search import SearchProblem, search

    models = profile if isinstance(profile, dict) else variants(profile, p)

    def machine(model):
        return with_latency(model, model.p2p_latency if latency is None else latency)
    limit_problem = SearchProblem(models[1], p, m, 1, "full")
    limit = limit_problem.memory_limit_mb
    rows = []
    for v, model in models.items():
        for name in library_names():
            program = library_get(name)
            if program.supports(p, m, v) is not None:
                continue
            sched = program.compile(p, m, v)
            if sched.placement.pipelines != 1 or (v > 1 and sched.v != v):
                continue
            sim = Simulator(dataclasses.replace(model, memory_limit_mb=limit), sched.placement, m, sched.backward)
            fits = sim.run(sched.ranks, name=name).fits_memory
            rows.append((predict(sched, machine(model), overhead_for(overhead, v)), name, v, sched, model, fits))
    one = next(r for r in rows if r[1] == "1f1b")
    fitting = sorted((r for r in rows if r[5] and r[1] != "1f1b"), key=lambda r: (r[0], r[1]))
    best = fitting[0]
    searched = []
    for v, model in models.items():
        for backward in ("split", "full"):  # split backward costs one more action per microbatch
            problem = SearchProblem(with_overhead(machine(model), overhead_for(overhead, v)), p, m, v, backward, limit)
            result = search(problem, time_budget=budget, seed=seed, min_gain=min_gain)
            # the search's answer: a library schedule when nothing faster was found (a tie included)
            sched = result.schedule
            if sched.placement.pipelines == 1:
                same = result.origin.removeprefix("library ") if result.origin.startswith("library ") else ""
                searched.append((predict(sched, machine(model), overhead_for(overhead, v)), v, sched.with_name("searched"),
                                 model, same))
    ms, v, sched, model, same = min(searched, key=lambda r: r[0])
    if ms * (1 + min_gain) >= one[0]:   # no predicted gain above min_gain: keep 1f1b
        ms, v, sched, model, same = one[0], 1, one[3].with_name("searched"), one[4], "1f1b"
    label = (f"searched ({sched.placement.describe()}, {sched.backward}{', v=2' if v == 2 else ''}"
             f"{f' = {same}' if same else ''})")
    return {"1f1b": (one[3], one[4]), f"best predefined ({best[1]}{', v=2' if best[2] == 2 else ''})": (best[3], best[4]),
            label: (sched, model)}, limit


def costs_of(profile: CostProfile, schedule: Schedule) -> list:
    return [[s.forward, s.backward_input, s.backward_weight] for s in profile.stages]


# -- runs ---------------------------------------------------------------------------------------
def calibration_jobs(p: int, m: int, latency: float) -> tuple[list, Schedule, CostProfile, CostProfile]:
    """Three runs that are not rows: 1f1b with uniform 1 ms ops at m and at m / 2 microbatches
    (two lengths: a per-action and a per-step constant), and 1f1b at zero compute."""
    calib = load_schedule("1f1b", p, m, 1)
    half = load_schedule("1f1b", p, max(1, m // 2), 1)
    one = CostProfile.uniform(p, 1.0, 1.0, 1.0, p2p_latency=latency)
    zero = CostProfile.uniform(p, 0.0, 0.0, 0.0, p2p_latency=latency)
    jobs = [{"key": "calibration 1 ms", "schedule": calib.to_dict(), "costs": costs_of(one, calib)},
            {"key": "calibration 1 ms, m/2", "schedule": half.to_dict(), "costs": costs_of(one, half)},
            {"key": "calibration 0 ms", "schedule": calib.to_dict(), "costs": costs_of(zero, calib)}]
    return jobs, calib, one, zero


def overheads(calib: Schedule, one: CostProfile, zero: CostProfile, steps: list[list[float]]) -> dict:
    """The runtime's overhead, fitted on the calibration runs (steps: their step times, in order):
    `action` ms per action and `step` ms per step (from the two lengths), `single` = the one
    per-action constant that explains the m-run alone, `zero` = that at zero compute."""
    half = load_schedule("1f1b", calib.p, max(1, calib.m // 2), 1)
    t_full, t_half, t_zero = (statistics.median(x) for x in steps[:3])

    def diff(c):
        return predict(calib, one, c) - predict(half, one, c)

    target = t_full - t_half
    c = 0.0 if diff(0.0) >= target else solve_increasing(diff, target, 0.0, 50.0)
    k = t_full - predict(calib, one, c)
    if k < 0:  # no per-step cost visible: one constant
        c, k = fit_overhead(calib, one, t_full), 0.0
    return {"action": c, "step": k, "single": fit_overhead(calib, one, t_full),
            "zero": fit_overhead(calib, zero, t_zero)}


def choose_jobs(cfg: dict, calib_steps: list[list[float]]) -> dict:
    """Run by rank 0 of the engine job after the first calibration: the schedules of every row,
    chosen on the model of this machine (profile + measured p2p latency + per-action overhead)."""
    p, m, latency = cfg["p"], cfg["m"], cfg["latency"]
    _, calib, one, zero = calibration_jobs(p, m, latency)
    oh = overheads(calib, one, zero, calib_steps)
    jobs, plan = [], []
    for name in cfg["profiles"]:
        base = scaled(load_profile(name), cfg["scale"])
        chosen, _ = candidates(base, p, m, cfg["budget"], latency=latency, overhead=oh["action"],
                               min_gain=cfg.get("min_gain", 0.0) / 100)
        for label, (sched, model) in chosen.items():
            raw = variants(base, p)[sched.v]  # the emulated stages sleep the profile as written
            jobs.append({"key": f"{name}/{label}", "schedule": sched.to_dict(), "costs": costs_of(raw, sched)})
            plan.append({"profile": name, "label": label, "model": model.to_dict()})
    return {"jobs": jobs, "plan": plan, "overhead": oh}


def run_engine(engine: str, p: int, spec: dict, timeout_s: float) -> list:
    """Per-rank results of the engine's worker (tests/engine_runs.py)."""
    from koala_ds.runtime.spawn import spawn

    spec = dict(spec, timeout_s=120)
    if engine == "deepspeed":  # DeepSpeed's own CPU set-up (DS_ACCELERATOR=cpu, deepspeed.init_distributed)
        from deepspeed_jobs import launch

        return [r["value"] for r in launch("engine_runs:deepspeed_worker", p, spec,
                                           timeout_s=timeout_s, pg_timeout_s=600)]
    return spawn("engine_runs:megatron_worker", p, spec, timeout_s=timeout_s, pg_timeout_s=600)


def deepspeed_available() -> str | None:
    try:
        import koala_ds.deepspeed  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"koala_ds.deepspeed not importable ({type(exc).__name__}: {exc})"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="gpt-lmhead-8 at p=4 only, both engines")
    ap.add_argument("--real", action="store_true", help="the tiny real GPT of examples/megatron_gpt, profiled first")
    ap.add_argument("--json", action="store_true", help="one JSON object per row on stdout")
    ap.add_argument("--profiles", nargs="*", default=None, help="bundled profile names (default: all)")
    ap.add_argument("-p", nargs="*", type=int, default=None, help="pipeline sizes (default 4 8)")
    ap.add_argument("--engines", nargs="*", default=["megatron", "deepspeed"])
    ap.add_argument("--search-budget", type=float, default=5.0, metavar="S")
    ap.add_argument("--steps", type=int, default=None,
                    help="measured steps per run, after 2 warm-up steps (default 30; 10 with --quick, 20 with --real)")
    ap.add_argument("--min-gain", type=float, default=None, metavar="PCT",
                    help="the searched row keeps 1f1b unless a schedule is predicted more than PCT%% faster "
                         "(koala search --min-gain; default 0, 3 with --real: the model's resolution on real compute)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every F/I/W time (default 1)")
    ap.add_argument("--out", default=str(RESULTS), help="results folder (default benchmarks/results)")
    ap.add_argument("--overhead-only", action="store_true",
                    help="only the calibration runs (1f1b, m = 2p) and 1f1b at zero compute with m = 8p: the runtime's "
                         "CPU per action at zero compute (per step / actions, and as the slope between the two "
                         "lengths, next to the same streams on torch + gloo alone) and its overhead per action; no "
                         "schedule rows, no search, nothing written")
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 10 if args.quick else 20 if args.real else 30
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    if args.json:  # stdout carries the JSON rows only: everything else (engines, workers) goes to stderr
        sys.stdout.flush()
        args.json_out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
    if args.real:
        from engine_speedup_real import main_real  # benchmarks/engine_speedup_real.py

        return main_real(args, say)
    say(BANNER)
    from koala_ds.sim import bundled_profiles

    profiles = args.profiles or (["gpt-lmhead-8"] if args.quick else bundled_profiles())
    ps = args.p or ([4] if args.quick else [4, 8])
    engines = list(args.engines)
    missing = deepspeed_available() if "deepspeed" in engines else None
    if missing:
        say(f"deepspeed engine skipped: {missing}")
        engines.remove("deepspeed")

    from koala_ds.profiler.p2p import measure_p2p

    t_start = time.time()
    p2p = measure_p2p(8 * 2, iters=100)  # the emulated activation: seq 2 x mbs 1 x hidden 8
    latency = p2p.latency_ms
    say(f"measured p2p latency (gloo ping-pong, one way, 64-byte message): {latency:.3f} ms; "
        f"CPU {p2p.cpu_ms_per_message:.3f} ms per message sent or received, per rank")
    if args.overhead_only:
        return overhead_only(engines, ps, latency, args.steps, say, p2p.cpu_ms_per_message)
    rows = []
    for p in ps:
        cal_jobs, calib, one, zero = calibration_jobs(p, 2 * p, latency)
        run = Calibrated(p, cal_jobs, calib, one, zero, latency, p2p.cpu_ms_per_message,
                         torch_bare_cpu_per_action(p, calib, 2 * args.steps))
        for engine in engines:
            for row in engine_rows(engine, run, profiles, args, say):
                rows.append(row)
                if args.json:
                    print(json.dumps({k: row[k] for k in row if k not in ("steps_ms", "schedule_json")}),
                          file=args.json_out, flush=True)
    say(f"total {time.time() - t_start:.0f} s")
    write_outputs(rows, Path(args.out), "quick" if args.quick else "full", say)
    return 0


@dataclasses.dataclass(frozen=True)
class Calibrated:
    """What the launches at one p share: the calibration jobs and their schedule (1f1b, m = 2p),
    its two emulated profiles (1 ms and zero-cost ops), and this machine's constants measured in
    the run (gloo latency and CPU per message end, the bare stream's CPU per action)."""

    p: int
    jobs: list
    schedule: Schedule
    one: CostProfile
    zero: CostProfile
    latency: float
    msg_cpu_ms: float
    bare_cpu: float


def engine_rows(engine: str, run: Calibrated, profiles: list[str], args, say) -> list[dict]:
    """One launch of `engine` at p: the calibration, the choice of the schedules on the model of
    this machine (engine_speedup:choose_jobs), then every run round-robin; a row per chosen run."""
    from engine_runs import cpu_ms_per_step, step_times_ms

    p, m, ncal = run.p, run.schedule.m, len(run.jobs)
    say(f"{engine} p={p}, m={m}: calibration, choice of the schedules (search {args.search_budget:g} s per "
        f"profile and v), then every run round-robin with the calibration runs ...")
    t0 = time.time()
    cfg = {"p": p, "m": m, "latency": run.latency, "profiles": profiles, "scale": args.scale,
           "budget": args.search_budget, "min_gain": args.min_gain or 0.0}
    spec = {"calibration": run.jobs, "chooser": "engine_speedup:choose_jobs", "chooser_args": cfg,
            "warmup": 2, "steps": args.steps}
    res = run_engine(engine, p, spec, timeout_s=1800)
    say(f"  done in {time.time() - t0:.0f} s")
    chooser, measured = res[0]["chooser"], step_times_ms(res, 2)
    oh = overheads(run.schedule, run.one, run.zero, measured[:ncal])
    cpu = cpu_ms_per_step(res, 2)[ncal - 1] / run.schedule.num_actions  # the zero-compute run
    say(f"  CPU time of the runtime at zero compute: {cpu:.3f} ms per action (all ranks' processes; "
        f"{p} ranks share {os.cpu_count()} cores here); the same stream on torch + gloo alone: {run.bare_cpu:.3f}")
    say(f"  runtime overhead: {oh['action']:.3f} ms per action + {oh['step']:.2f} ms per step (fitted on 1f1b at m "
        f"and m/2, 1 ms ops; one constant alone: {oh['single']:.3f} ms per action; at zero compute "
        f"{oh['zero']:.3f} ms per action); first calibration (used to choose the schedules): "
        f"{chooser['overhead']['action']:.3f} ms per action; p2p latency {run.latency:.3f} ms")
    constants = {"overhead_ms": round(oh["action"], 4), "overhead_step_ms": round(oh["step"], 3),
                 "overhead_single_ms": round(oh["single"], 4), "overhead_zero_ms": round(oh["zero"], 4),
                 "cpu_ms_per_action": round(cpu, 4), "bare_cpu_ms_per_action": round(run.bare_cpu, 4),
                 "p2p_latency_ms": round(run.latency, 4), "p2p_cpu_ms_per_message": round(run.msg_cpu_ms, 4)}
    rows, base_1f1b = [], {}
    for item, steps in zip(chooser["plan"], measured[ncal:]):
        name, label = item["profile"], item["label"]
        model = CostProfile.from_dict(item["model"], source=name)
        job = next(j for j in chooser["jobs"] if j["key"] == f"{name}/{label}")
        sched = Schedule.from_dict(job["schedule"])
        ms = statistics.median(steps)
        pred_profile = predict(sched, model)
        pred = predict(sched, with_latency(model, run.latency), oh["action"]) + oh["step"]
        if label == "1f1b":
            base_1f1b[name] = (ms, pred, pred_profile)
        b = base_1f1b[name]
        rows.append({"engine": engine, "profile": name, "p": p, "m": m, "v": sched.v, "schedule": label,
                     "measured_ms": round(ms, 3), "predicted_ms": round(pred, 3),
                     "predicted_profile_ms": round(pred_profile, 3),
                     "error": round(ms / pred - 1, 4), "error_profile": round(ms / pred_profile - 1, 4),
                     "speedup_vs_1f1b": round(b[0] / ms, 4), "predicted_speedup_vs_1f1b": round(b[1] / pred, 4),
                     "predicted_profile_speedup_vs_1f1b": round(b[2] / pred_profile, 4), **constants,
                     "steps_ms": [round(x, 2) for x in steps], "scale": args.scale, "schedule_json": job["schedule"]})
    return rows


def overhead_only(engines: list[str], ps: list[int], latency: float, steps: int, say, msg_cpu_ms: float) -> int:
    """--overhead-only: per engine and p, the calibration runs alone (see the module docstring), plus
    1f1b at zero compute with 4 times as many microbatches: the CPU per action is also printed as
    the slope between the two lengths (the per-step costs, such as DeepSpeed's gradient all-reduce
    and optimizer step, cancel out), next to the floor: the same two 1F1B streams run on torch +
    gloo alone, no engine (benchmarks/runtime_cpu.py's torch-bare), in this launch. Each figure
    also in user mode alone: the rest is the kernel's (waking the threads that wait for a message,
    socket calls), which no runtime on torch + gloo avoids."""
    from engine_runs import cpu_ms_per_step, step_times_ms

    from koala_ds.profiler.emulate import autograd_cpu_ms

    pair = autograd_cpu_ms()
    say(f"floors on this machine: torch autograd, forward + backward of a zero-cost emulated stage: {pair:.3f} ms "
        f"CPU per F + B pair ({pair / 2:.3f} per action); gloo: {msg_cpu_ms:.3f} ms CPU per message end "
        f"(sent or received), 2 processes")
    for p in ps:
        cal_jobs, calib, one, zero = calibration_jobs(p, 2 * p, latency)
        long = load_schedule("1f1b", p, 8 * p, 1)
        jobs = cal_jobs + [{"key": "calibration 0 ms, 4m", "schedule": long.to_dict(), "costs": costs_of(zero, long)}]
        bare = PerAction.of(calib, long, torch_bare_ms_per_step(p, calib.m, 2 * steps),
                            torch_bare_ms_per_step(p, long.m, 2 * steps))
        say(f"torch-bare p={p}: the same 1F1B streams on torch + gloo alone, no engine, no checks (the floor of a "
            f"Python runtime here): {bare.text(calib, long)}")
        for engine in engines:
            res = run_engine(engine, p, {"calibration": jobs, "warmup": 2, "steps": steps}, timeout_s=1800)
            oh = overheads(calib, one, zero, step_times_ms(res, 2)[:len(cal_jobs)])
            at = [len(cal_jobs) - 1, -1]  # the zero-compute runs: m = 2p and m = 8p
            cpu, user = cpu_ms_per_step(res, 2), cpu_ms_per_step(res, 2, user=True)
            run = PerAction.of(calib, long, (cpu[at[0]], user[at[0]]), (cpu[at[1]], user[at[1]]))
            say(f"{engine} p={p}: CPU time of the runtime at zero compute (all ranks' processes, {os.cpu_count()} "
                f"cores; per action: CPU per step / actions): {run.text(calib, long)}; above torch-bare: "
                f"{run.cpu - bare.cpu:+.3f} and {run.slope - bare.slope:+.3f} ms per action, in user mode "
                f"{run.user - bare.user:+.3f} and {run.user_slope - bare.user_slope:+.3f} (the engine's and koala's "
                f"own code); overhead {oh['action']:.3f} ms per action + {oh['step']:.2f} ms per step (1 ms ops), "
                f"{oh['zero']:.3f} ms per action at zero compute")
    return 0


@dataclasses.dataclass(frozen=True)
class PerAction:
    """CPU ms per action of a runtime at zero compute, all ranks' processes: at m = 2p (`cpu`) and
    as the slope between m = 2p and m = 8p (`slope`: per-step costs cancel), each also in user
    mode alone (`user`, `user_slope`)."""

    cpu: float
    slope: float
    user: float
    user_slope: float

    @classmethod
    def of(cls, short: Schedule, long: Schedule, at_short: tuple[float, float], at_long: tuple[float, float]):
        """From the (CPU, user-mode CPU) ms per step of the two streams."""
        n, extra = short.num_actions, long.num_actions - short.num_actions
        return cls(at_short[0] / n, (at_long[0] - at_short[0]) / extra,
                   at_short[1] / n, (at_long[1] - at_short[1]) / extra)

    def text(self, short: Schedule, long: Schedule) -> str:
        return (f"{self.cpu:.3f} ms CPU per action at m={short.m}, {self.slope:.3f} ms as the slope between m={short.m} "
                f"and m={long.m}; in user mode {self.user:.3f} and {self.user_slope:.3f} (the rest is the kernel's)")


def torch_bare_cpu_per_action(p: int, calib: Schedule, steps: int) -> float:
    """CPU ms per action of the calibration's 1F1B stream (p ranks, zero compute) on torch + gloo
    alone: the floor of a Python runtime's CPU on this machine, which the engines' figures sit on."""
    return torch_bare_ms_per_step(p, calib.m, steps)[0] / calib.num_actions


def torch_bare_ms_per_step(p: int, m: int, steps: int) -> tuple[float, float]:
    """CPU ms per step of 1F1B (p ranks, m microbatches, zero compute) on torch + gloo alone, and
    those in user mode: all ranks' processes, `steps` steps after 5 warm-up steps
    (benchmarks/runtime_cpu.py's torch-bare)."""
    from runtime_cpu import run as run_reference

    results = run_reference("torch-bare", {"m": m, "steps": steps, "profile": False}, p)
    return (sum(r["cpu_s"] for r in results) * 1e3 / steps, sum(r["user_s"] for r in results) * 1e3 / steps)


def markdown(rows: list[dict]) -> str:
    head = ("| engine | profile | p | schedule | measured ms | predicted ms | error | measured speedup | "
            "predicted speedup | profile-only prediction ms (error) |\n|---|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['engine']} | {r['profile']} | {r['p']} | {r['schedule']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} "
        f"| {r['error']:+.1%} | {r['speedup_vs_1f1b']:.3f}x | {r['predicted_speedup_vs_1f1b']:.3f}x "
        f"| {r['predicted_profile_ms']:.1f} ({r['error_profile']:+.1%}) |\n" for r in rows)
    return head + body


def two_instances(rows: list[dict], searched: dict) -> str:
    """With a second instance of the searched schedule and of 1f1b (the control) in the run: the
    speedup of the mean of the two against the mean of the two (per-instance differences halved)."""
    key = (searched["engine"], searched["profile"], searched["p"])
    same = [r for r in rows if (r["engine"], r["profile"], r["p"]) == key]
    again = [r["measured_ms"] for r in same if r["schedule"].startswith("searched again")]
    ones = [r["measured_ms"] for r in same if r["schedule"] == "1f1b" or r["schedule"].endswith("(control)")]
    if not again or len(ones) < 2:
        return ""
    speedup = statistics.mean(ones) / statistics.mean([searched["measured_ms"], *again])
    return (f"; two instances of each: {speedup:.3f}x ({speedup / searched['predicted_speedup_vs_1f1b']:.1%} of "
            f"predicted)")


def summary(rows: list[dict]) -> str:
    if not rows:
        return "no rows"
    errs = [abs(r["error"]) for r in rows]
    errs_p = [abs(r["error_profile"]) for r in rows]
    lines = [f"median |prediction error|: {statistics.median(errs):.1%} with the measured constants "
             f"(target <= 10%), {statistics.median(errs_p):.1%} with the profile alone"]
    spread = {(r["engine"], r["profile"], r["p"]): abs(r["speedup_vs_1f1b"] - 1) for r in rows
              if r["schedule"].endswith("(control)")}
    for r in rows:
        if r["schedule"].startswith("searched") and not r["schedule"].startswith("searched again"):
            pred_gain = r["predicted_speedup_vs_1f1b"] - 1
            got = r["speedup_vs_1f1b"] - 1
            ratio = r["speedup_vs_1f1b"] / r["predicted_speedup_vs_1f1b"]
            key = (r["engine"], r["profile"], r["p"])
            noise = (f"; 1f1b run twice measured {spread[key]:.1%} apart (the control row): differences within that "
                     f"are noise") if key in spread else ""
            lines.append(f"{r['engine']} {r['profile']} p={r['p']}: searched measured {r['speedup_vs_1f1b']:.3f}x vs "
                         f"predicted {r['predicted_speedup_vs_1f1b']:.3f}x over 1f1b ({ratio:.1%} of predicted; "
                         f"gain {got:+.1%} vs {pred_gain:+.1%}; target >= 90%{noise}){two_instances(rows, r)}")
    consts = sorted({(r["engine"], r["p"], r["overhead_ms"], r.get("overhead_step_ms", 0.0), r["overhead_zero_ms"],
                      r.get("cpu_ms_per_action", float("nan")), r["p2p_latency_ms"]) for r in rows})
    cores = os.cpu_count() or 1
    for e, p, c, k, c0, cpu, lat in consts:
        lines.append(f"{e} p={p}: measured runtime overhead {c:.3f} ms per action + {k:.1f} ms per step "
                     f"(1 ms ops; {c0:.3f} ms per action at zero compute, of which CPU {cpu:.3f} ms per action; "
                     f"{p} ranks share {cores} cores: p x CPU / cores = {p * cpu / cores:.3f} ms); "
                     f"gloo p2p latency {lat:.3f} ms one way")
    scales = sorted({(r["engine"], r["p"], r["v"], r["scale"]) for r in rows if r.get("scale", 1.0) != 1.0})
    for e, p, v, k in scales:
        lines.append(f"{e} p={p} v={v}: predictions use the profile x{k:.3f} (fitted on library schedules run on the "
                     f"real model: the stages' speed inside the pipeline, and this machine's drift since profiling)")
    floor = floor_line(rows, cores)
    if floor:
        lines.append(floor)
    return "\n".join(lines)


def floor_line(rows: list[dict], cores: int) -> str:
    """The floor of the runtimes' CPU on this machine, measured in the run: the calibration's 1F1B
    stream at zero compute on torch + gloo alone (runtime_cpu.py's torch-bare), and each engine above
    it; '' for rows without it (written before it was measured)."""
    bare = {r["p"]: r["bare_cpu_ms_per_action"] for r in rows if "bare_cpu_ms_per_action" in r}
    if not bare:
        return ""
    above = sorted({(r["engine"], r["p"], r["cpu_ms_per_action"] - bare[r["p"]]) for r in rows if r["p"] in bare})
    msgs = {r.get("p2p_cpu_ms_per_message") for r in rows} - {None}
    gloo = f" (gloo ping-pong, 2 processes: {max(msgs):.3f} ms of CPU per message end)" if msgs else ""
    return ("floor of the runtimes' CPU on this machine: the same 1F1B streams at zero compute on torch + gloo "
            "alone, no engine (benchmarks/runtime_cpu.py torch-bare, this run): "
            + ", ".join(f"p={p}: {c:.3f} ms CPU per action ({p * c / cores:.2f} ms wait with {p} ranks on {cores} "
                        f"cores)" for p, c in sorted(bare.items())) + gloo
            + "; the engines above it (their own code and koala's): "
            + ", ".join(f"{e} p={p} {d:+.3f} ms" for e, p, d in above)
            + " per action: at 1 ms ops the overhead cannot be small here; that needs >= p cores")


def write_outputs(rows: list[dict], out: Path, tag: str, say, banner: str = BANNER) -> None:
    out.mkdir(parents=True, exist_ok=True)
    ms = ", ".join(f"m={m} at p={p}" for p, m in sorted({(r["p"], r["m"]) for r in rows}))
    steps = "/".join(str(n) for n in sorted({len(r["steps_ms"]) for r in rows if r.get("steps_ms")})) or "?"
    md = (f"{banner}\n\n{ms} microbatches; step time = median of {steps} steps after 2 warm-up steps; predicted = "
          f"simulator with the measured p2p latency and runtime overhead (per action + per step); profile-only = the simulator on the "
          f"profile as written.\n\n" + markdown(rows) + "\n" + "\n".join("- " + x for x in summary(rows).splitlines()) + "\n")
    (out / f"engine_speedup_{tag}.md").write_text(md, encoding="utf-8")
    with open(out / f"engine_speedup_{tag}.jsonl", "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps({k: v for k, v in r.items() if k != "schedule_json"}) + "\n")
    for r in rows:  # the schedules that ran, as JSON (koala simulate / show read them)
        if not r["schedule"].startswith("1f1b") and "schedule_json" in r:
            label = r["schedule"].split(" ")[0]
            (out / "schedules").mkdir(exist_ok=True)
            (out / "schedules" / f"{tag}-{r['engine']}-{r['profile']}-p{r['p']}-{label}.json").write_text(
                json.dumps(r["schedule_json"], indent=1) + "\n", encoding="utf-8")
    plot(rows, out / f"engine_speedup_{tag}.png")
    say(f"wrote {out / f'engine_speedup_{tag}.md'}, .jsonl and .png")
    say("\n---- README 'Results' block ----\n" + md + "---- end ----")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    marks = {"1f1b": "o", "best": "s", "searched": "*"}
    for r in rows:
        kind = "1f1b" if r["schedule"] == "1f1b" else ("best" if r["schedule"].startswith("best") else "searched")
        color = "tab:blue" if r["engine"] == "megatron" else "tab:orange"
        ax.scatter(r["predicted_ms"], r["measured_ms"], marker=marks[kind], color=color, s=60 if kind != "searched" else 120)
        ax.scatter(r["predicted_profile_ms"], r["measured_ms"], marker=marks[kind], facecolors="none", edgecolors="gray")
    hi = max([r["measured_ms"] for r in rows] + [r["predicted_ms"] for r in rows]) * 1.05
    ax.plot([0, hi], [0, hi], "k--", lw=1)
    ax.fill_between([0, hi], [0, hi * 0.9], [0, hi * 1.1], color="gray", alpha=0.15, label="±10%")
    for kind, mk in marks.items():
        ax.scatter([], [], marker=mk, color="k", label=kind)
    ax.scatter([], [], marker="o", facecolors="none", edgecolors="gray", label="profile-only prediction")
    ax.set_xlabel("predicted step time (ms)")
    ax.set_ylabel("measured step time (ms)")
    ax.set_title("Emulated compute (sleeps) on the real engines\nblue = megatron, orange = deepspeed")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
