"""`engine_speedup.py --real`: the same table for the tiny real GPT of examples/megatron_gpt
(real compute, megatron-core GPTModel on CPU, 2 pipeline ranks), profiled first with
`koala_ds.profiler.profile_megatron_gpt` (p * 2 virtual stages; v = 1 merges them pairwise,
as for the bundled profiles). Megatron engine only.

A cost profile has B = I + W by definition. On this model the split backward (I then W,
koala_ds/megatron/split_backward.py) costs about twice the plain backward (its graph walk in
Python dominates such small layers), so full-backward schedules (1f1b, ...) are predicted and
searched with each stage's measured full-backward time (the profile's `meta`), split ones with
I and W."""
from __future__ import annotations

import json
import statistics
import time

from koala_ds.library import load_schedule
from koala_ds.sim import CostProfile

MODEL = {"num_layers": 8, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "micro_batch_size": 2,
         "vocab_size": 128}


BANNER = ("REAL compute: the megatron-core GPT of examples/megatron_gpt on CPU (2 pipeline ranks = 2 processes on "
          "this 2-core machine), through koala_ds.megatron; profiled first with koala_ds.profiler.")


def main_real(args, say) -> int:
    import engine_speedup as E
    from koala_ds.profiler.engine_runs import cpu_ms_per_step

    say(BANNER)
    from koala_ds.profiler.engine_runs import step_times_ms
    from koala_ds.spawn import spawn
    from koala_ds.profiler.p2p import measure_p2p_latency

    p = (args.p or [2])[0]
    m = 2 * p if p > 2 else 8
    say(f"real GPT {MODEL}, p={p}, m={m}: profiling {2 * p} virtual stages (1 thread per process) ...")
    prof_dict = spawn("koala_ds.profiler.engine_runs:profile_gpt_worker", 1,
                      dict(MODEL, p=p, v=2, warmup=2, iters=10, p2p=False), timeout_s=600)[0]
    numel = MODEL["seq_length"] * MODEL["micro_batch_size"] * MODEL["hidden_size"]
    latency = measure_p2p_latency(numel, iters=100)
    prof_dict["p2p_latency"] = round(latency, 6)
    out_dir = E.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "real_gpt_profile.json").write_text(json.dumps(prof_dict, indent=1) + "\n")
    profile = CostProfile.from_dict({k: v for k, v in prof_dict.items()}, source="real GPT profile")
    say("profile (ms): " + "; ".join(f"s{s}: F {c.forward:.2f} I {c.backward_input:.2f} W {c.backward_weight:.2f}"
                                     for s, c in enumerate(profile.stages)) + f"; p2p {latency:.3f} ms")
    # the runtime's overhead (per action, per step): the emulated calibration runs at this p and m
    cal_jobs, calib, one, zero = E.calibration_jobs(p, m, latency)
    res = E.run_engine("megatron", p, {"jobs": cal_jobs, "warmup": 2, "steps": args.steps}, timeout_s=600)
    oh = E.overheads(calib, one, zero, step_times_ms(res, 2))
    c, k = oh["action"], oh["step"]
    cpu = cpu_ms_per_step(res, 2)[len(cal_jobs) - 1] / calib.num_actions
    say(f"runtime overhead (emulated 1f1b calibration): {c:.3f} ms per action + {k:.2f} ms per step")
    # the profile already has stage 0 as the runtime runs it (I ~ 0): no folding needed, it is a no-op
    # the profiler also measured each stage's full backward (meta): B actions (1f1b, ...) cost that, not I + W
    full_ms = [st["backward_full_ms"] for st in prof_dict["meta"]["stages"]]
    say("full backward B (ms) per stage: " + ", ".join(f"{b:.2f}" for b in full_ms) + " vs I + W: " +
        ", ".join(f"{x.backward_input + x.backward_weight:.2f}" for x in profile.stages))
    chosen, _ = E.candidates(profile, p, m, args.search_budget, latency=latency, overhead=c, full_ms=full_ms)
    plan = list(chosen.items())
    jobs = [{"key": label, "schedule": sched.to_dict()} for label, (sched, _) in plan]
    say(f"running the real GPT through koala_ds.megatron: {len(jobs)} schedules ...")
    t0 = time.time()
    res = spawn("koala_ds.profiler.engine_runs:megatron_gpt_worker", p,
                {"jobs": jobs, "model": MODEL, "warmup": 2, "steps": args.steps}, timeout_s=1200, pg_timeout_s=600)
    say(f"  done in {time.time() - t0:.0f} s")
    rows, base = [], None
    for (label, (sched, model)), steps in zip(plan, step_times_ms(res, 2)):
        ms = statistics.median(steps)
        pred = E.predict(sched, E.with_latency(model, latency), c) + k
        pred_profile = E.predict(sched, model)
        base = base or (ms, pred, pred_profile)
        row = {"engine": "megatron (real GPT)", "profile": "real-gpt", "p": p, "m": m, "v": sched.v, "schedule": label,
               "measured_ms": round(ms, 3), "predicted_ms": round(pred, 3), "predicted_profile_ms": round(pred_profile, 3),
               "error": round(ms / pred - 1, 4), "error_profile": round(ms / pred_profile - 1, 4),
               "speedup_vs_1f1b": round(base[0] / ms, 4), "predicted_speedup_vs_1f1b": round(base[1] / pred, 4),
               "predicted_profile_speedup_vs_1f1b": round(base[2] / pred_profile, 4), "overhead_ms": round(c, 4),
               "overhead_step_ms": round(k, 3), "overhead_single_ms": round(oh["single"], 4),
               "overhead_zero_ms": round(oh["zero"], 4), "cpu_ms_per_action": round(cpu, 4), "p2p_latency_ms": round(latency, 4),
               "steps_ms": [round(x, 2) for x in steps], "scale": 1.0, "schedule_json": sched.to_dict()}
        rows.append(row)
        if args.json:
            print(json.dumps({k: row[k] for k in row if k not in ("steps_ms", "schedule_json")}), file=args.json_out,
                  flush=True)
    E.write_outputs(rows, out_dir, "real", say, banner=BANNER)
    return 0
