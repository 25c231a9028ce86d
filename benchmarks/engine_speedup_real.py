"""`engine_speedup.py --real`: the same table on REAL compute, both engines, p pipeline ranks
(`-p`, default 2; the GPT gets 2p layers when 8 are too few for 2p virtual stages).

- megatron: the megatron-core GPT of examples/megatron_gpt (GPTModel, local layer spec, fp32)
  through koala_ds.megatron;
- deepspeed: a plain-torch GPT (koala_ds.profiler.models.gpt_layer_specs: embedding, blocks of
  nn.Linear / LayerNorm / SDPA, LM head) as a DeepSpeed layer list through koala_ds.deepspeed.

Each model is profiled first, in a fresh process, as the runtime runs it at each v: p virtual
stages for the v = 1 schedules and 2p for the v = 2 ones, each split into layers as the engine
splits it at that size (merging the 2p stages pairwise is not what DeepSpeed runs at v = 1: its
uniform partition of 10 layers is 5 + 5 on two stages but 3 + 3 + 2 + 2 on four). F, I and W
(the layer-level split of koala_ds.runtime.wgrad) and the full backward B (the profile's `backward`).
The simulator and the search cost B actions with B and split ones with I + W, so the searched
row is whichever kind is faster here.

The model of this machine adds the p2p latency and the runtime's overhead per action (the
emulated calibration: sleeping stages, the runtime alone). A second calibration runs 1f1b and
interleaved-1f1b on the real GPT and fits one factor per v on that v's profile
(`_calibrate_real`): on this shared machine a stage's speed drifts by up to 30% within minutes,
so a profile taken alone, before, is off by that much; the scaled profiles choose the schedules
and predict the rows ("profile-only" is the profile as measured).

The searched row keeps 1f1b unless a schedule is predicted more than 3% faster (`--min-gain`,
as `koala search --min-gain 3`): one schedule run twice in this benchmark measured 1-6% apart,
so a predicted gain below that says nothing about which schedule is faster here. For the same
reason the searched schedule runs in a second engine instance too ("searched again"), and the
verdict adds the speedup of the mean of its two instances over the mean of 1f1b's two.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

#: The test and benchmark harness (deepspeed_jobs, engine_runs) lives in tests/, outside the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from koala_ds.sim import CostProfile  # noqa: E402

MODEL = {"num_layers": 8, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 64, "micro_batch_size": 1,
         "vocab_size": 128}


def model_for(p: int) -> dict:
    """MODEL, with at least one transformer layer per virtual stage at v = 2 (2p layers)."""
    return dict(MODEL, num_layers=max(MODEL["num_layers"], 2 * p))

#: The label of the control row (1f1b run twice).
CONTROL = "1f1b again (control)"
#: The searched schedule a second time, in its own engine instance: one instance of a schedule may
#: run a few percent slower than another here, so the verdict uses both (E.summary)
SEARCHED_AGAIN = "searched again (second instance)"

BANNER = ("REAL compute: a GPT on CPU (p pipeline ranks = p processes, one torch thread each, on {cores} cores): "
          "megatron-core's GPTModel through koala_ds.megatron and a plain-torch GPT layer list through "
          "koala_ds.deepspeed; each profiled first with koala_ds.profiler.").format(cores=os.cpu_count())


def _profile(engine: str, p: int, v: int) -> dict:
    """The profile of the p * v virtual stages the runtime runs at v (a fresh process)."""
    from koala_ds.runtime.spawn import spawn

    if engine == "megatron":
        return spawn("engine_runs:profile_gpt_worker", 1,
                     dict(model_for(p), p=p, v=v, warmup=2, iters=10, p2p=False), timeout_s=600)[0]
    return spawn("engine_runs:profile_deepspeed_gpt_worker", 1,
                 {"model": model_for(p), "stages": v * p, "warmup": 2, "iters": 10}, timeout_s=600)[0]


def _run_jobs(engine: str, p: int, jobs: list, steps: int) -> list:
    from koala_ds.runtime.spawn import spawn

    spec = {"jobs": jobs, "model": model_for(p), "warmup": 2, "steps": steps}
    if engine == "megatron":
        return spawn("engine_runs:megatron_gpt_worker", p, spec, timeout_s=1200, pg_timeout_s=600)
    from deepspeed_jobs import launch

    return [r["value"] for r in launch("engine_runs:deepspeed_gpt_worker", p, spec,
                                       timeout_s=1200, pg_timeout_s=600)]


def _calibrate(engine: str, p: int, m: int, latency: float, steps: int, E) -> tuple[dict, float]:
    """The runtime's overhead (emulated 1 ms ops, 1f1b at m and m/2, zero compute) and, per
    action of a two-chunk schedule (interleaved-1f1b at 0.5 ms ops), `oh["action_v"]`."""
    from koala_ds.resolve import load_schedule
    from engine_runs import cpu_ms_per_step, step_times_ms

    cal_jobs, calib, one, zero = E.calibration_jobs(p, m, latency)
    two = load_schedule("interleaved-1f1b", p, m, 2)
    half = CostProfile.uniform(2 * p, 0.5, 0.5, 0.5, p2p_latency=latency)
    cal_jobs.append({"key": "calibration 0.5 ms, v=2", "schedule": two.to_dict(), "costs": E.costs_of(half, two)})
    res = E.run_engine(engine, p, {"jobs": cal_jobs, "warmup": 2, "steps": steps}, timeout_s=600)
    times = step_times_ms(res, 2)
    oh = E.overheads(calib, one, zero, times[:3])
    t_two = statistics.median(times[3]) - oh["step"]
    oh["action_v"] = {1: oh["action"], 2: E.fit_overhead(two, half, t_two)}
    return oh, cpu_ms_per_step(res, 2)[2] / calib.num_actions


def _calibrate_real(engine: str, p: int, m: int, models: dict, latency: float, oh: dict, steps: int, E
                    ) -> dict[int, float]:
    """How much slower (or faster) the real GPT's stages run inside the pipeline than the profile
    measured them, per v: 1f1b (v = 1) and interleaved-1f1b (v = 2) run on the real GPT, and the
    factor k_v on every F, I, W and B of that v's profile such that the simulator, with the
    emulated calibration's overhead per action and per step, gives the measured step time.
    It holds what the profile, taken alone in one process, does not: this shared machine's speed
    drifting between profiling and running (a stage measured 13.8 and 17.8 ms in two profiles
    minutes apart), and the real chunks' cost inside the pipeline. The constants are fitted on
    library schedules, not on the rows, as a user who profiles and tries 1f1b would."""
    from koala_ds.resolve import load_schedule
    from engine_runs import step_times_ms

    scheds = {1: load_schedule("1f1b", p, m, 1), 2: load_schedule("interleaved-1f1b", p, m, 2)}
    jobs = [{"key": f"real calibration v={v}", "schedule": sched.to_dict()} for v, sched in scheds.items()]
    times = step_times_ms(_run_jobs(engine, p, jobs, steps), 2)
    factors = {}
    for (v, sched), t in zip(scheds.items(), times):
        c = oh["action_v"][v]
        factors[v] = E.solve_increasing(
            lambda k: E.predict(sched, E.with_latency(E.scaled(models[v], k), latency), c),
            statistics.median(t) - oh["step"], 0.2, 5.0, iters=40)
    return factors


def _row(engine, label, sched, model, raw, steps, latency, oh, cpu, base, E) -> dict:
    """One table row; `model` is the machine's model of that v (the profile scaled), `raw` the profile."""
    ms = statistics.median(steps)
    c, k = oh["action_v"].get(sched.v, oh["action"]), oh["step"]
    pred = E.predict(sched, E.with_latency(model, latency), c) + k
    pred_profile = E.predict(sched, raw)
    base = base or (ms, pred, pred_profile)
    return {"engine": engine, "profile": "real-gpt", "p": sched.p, "m": sched.m, "v": sched.v, "schedule": label,
            "measured_ms": round(ms, 3), "predicted_ms": round(pred, 3), "predicted_profile_ms": round(pred_profile, 3),
            "error": round(ms / pred - 1, 4), "error_profile": round(ms / pred_profile - 1, 4),
            "speedup_vs_1f1b": round(base[0] / ms, 4), "predicted_speedup_vs_1f1b": round(base[1] / pred, 4),
            "predicted_profile_speedup_vs_1f1b": round(base[2] / pred_profile, 4), "overhead_ms": round(c, 4),
            "overhead_step_ms": round(k, 3), "overhead_single_ms": round(oh["single"], 4),
            "overhead_zero_ms": round(oh["zero"], 4), "cpu_ms_per_action": round(cpu, 4),
            "p2p_latency_ms": round(latency, 4), "steps_ms": [round(x, 2) for x in steps],
            "scale": round(model.stages[0].forward / raw.stages[0].forward, 4) if raw.stages[0].forward else 1.0,
            "schedule_json": sched.to_dict()}, base


def run_real(engine: str, p: int, m: int, args, say) -> list:
    """Profile, calibrate, choose (1f1b, best predefined, searched) and run one engine's real GPT."""
    import engine_speedup as E
    from engine_runs import step_times_ms
    from koala_ds.profiler.p2p import measure_p2p_latency

    model = model_for(p)
    say(f"[{engine}] real GPT {model}, p={p}, m={m}: profiling {p} and {2 * p} virtual stages (1 thread per "
        f"process) ...")
    numel = model["seq_length"] * model["micro_batch_size"] * model["hidden_size"]
    latency = measure_p2p_latency(numel, iters=100)
    out_dir = E.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    models = {}
    for v in (1, 2):
        prof = dict(_profile(engine, p, v), p2p_latency=round(latency, 6))
        (out_dir / f"real_gpt_profile_{engine}_v{v}.json").write_text(json.dumps(prof, indent=1) + "\n")
        models[v] = CostProfile.from_dict(prof, source=f"real GPT profile ({engine}, v={v})")
        say(f"  profile v={v} (ms): " + "; ".join(
            f"s{s}: F {c.forward:.2f} I {c.backward_input:.2f} W {c.backward_weight:.2f} B {c.backward:.2f}"
            for s, c in enumerate(models[v].stages)) + f"; p2p {latency:.3f} ms")
    oh, cpu = _calibrate(engine, p, m, latency, args.steps, E)
    say(f"  runtime overhead (emulated calibration): {oh['action']:.3f} ms per action + {oh['step']:.2f} ms per step; "
        f"{oh['action_v'][2]:.3f} ms per action with two chunks per rank")
    factor = _calibrate_real(engine, p, m, models, latency, oh, args.steps, E)
    say(f"  the real GPT in the pipeline (1f1b, interleaved-1f1b) against its profile: x{factor[1]:.3f} at v=1, "
        f"x{factor[2]:.3f} at v=2; the profiles scaled by these choose the schedules and predict the rows")
    raw, models = models, {v: E.scaled(model, factor[v]) for v, model in models.items()}
    min_gain = 3.0 if args.min_gain is None else args.min_gain
    chosen, _ = E.candidates(models, p, m, args.search_budget, latency=latency, overhead=oh["action_v"],
                             min_gain=min_gain / 100)
    say(f"  the searched row keeps 1f1b unless a schedule is predicted more than {min_gain:g}% faster (--min-gain)")
    # the control: 1f1b a second time (its own model copy, in the same round-robin): how far apart two
    # runs of one schedule measure here, the resolution of every speedup in the table
    searched = next(v for k, v in chosen.items() if k.startswith("searched"))
    plan = list(chosen.items()) + [(CONTROL, chosen["1f1b"]), (SEARCHED_AGAIN, searched)]
    jobs = [{"key": label, "schedule": sched.to_dict()} for label, (sched, _) in plan]
    say(f"  running {len(jobs)} schedules on the real GPT ...")
    t0 = time.time()
    res = _run_jobs(engine, p, jobs, args.steps)
    say(f"  done in {time.time() - t0:.0f} s")
    rows, base = [], None
    for (label, (sched, model)), steps in zip(plan, step_times_ms(res, 2)):
        row, base = _row(engine, label, sched, model, raw[sched.v], steps, latency, oh, cpu, base, E)
        rows.append(row)
        if args.json:
            print(json.dumps({k: row[k] for k in row if k not in ("steps_ms", "schedule_json")}), file=args.json_out,
                  flush=True)
    return rows


def main_real(args, say) -> int:
    import engine_speedup as E

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    say(BANNER)
    p = (args.p or [2])[0]
    m = 2 * p if p > 2 else 8
    rows = []
    for engine in args.engines:
        missing = E.deepspeed_available() if engine == "deepspeed" else None
        if missing:
            say(f"deepspeed engine skipped: {missing}")
            continue
        rows += run_real(engine, p, m, args, say)
    E.write_outputs(rows, E.Path(args.out), "real", say, banner=BANNER)
    return 0
