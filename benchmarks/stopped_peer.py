"""A stopped peer ends the other rank within the timeout + 10 s: N consecutive runs per engine.

    python benchmarks/stopped_peer.py            # 20 runs per engine, KOALA timeout 3 s
    python benchmarks/stopped_peer.py --runs 5 --engines megatron

Each run starts 2 ranks; rank 1 stops (SIGSTOP, or stops answering) at one of several points of
a training step, cycling through them; rank 0 must raise the engine's timeout error within
timeout + 10 s. DeepSpeed: before the end-of-step loss broadcast, before the clipping
all-reduce, in the point-to-point phase (tests/test_deepspeed_pipeline.py's worker). Megatron:
in finalize_model_grads_func (PP=2, and koala's CPU data-parallel finalize at DP=2) and in the
point-to-point phase (tests/test_megatron_stopped_peer.py's worker). Prints one line per run and
a count per engine.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
#: The test and benchmark harness (deepspeed_jobs, engine_runs) lives in tests/, outside the installed package.
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
TIMEOUT_S = 3


def deepspeed_run(k: int) -> tuple[bool, float, str]:
    from deepspeed_jobs import hang_worker, launch

    mode, where = [("stop", "_aggregate_total_loss"), ("stop", "clip_fp32_gradients"), ("hang", None)][k % 3]
    spec = {"pp": 2, "gas": 4, "mbs": 2, "dim": 8, "schedule": "1f1b", "timeout_s": TIMEOUT_S, "hung_rank": 1,
            "mode": mode}
    if where:
        spec["stop_before"] = where
    res = launch(hang_worker, 2, spec, timeout_s=150, pg_timeout_s=100, allow_failures=True, wait_ranks=[0])
    v = res[0].get("value") or {}
    ok = bool(res[0]["ok"]) and v.get("error") == "PipelineTimeoutError" and v.get("elapsed", 1e9) < TIMEOUT_S + 10
    return ok, v.get("elapsed", float("nan")), where or "p2p"


def megatron_run(k: int) -> tuple[bool, float, str]:
    from test_megatron_stopped_peer import run_stopped

    stop = ["finalize", "dp-finalize", "p2p"][k % 3]
    res, ended = run_stopped(stop)
    v = res.get("value") or {}
    ok = bool(res["ok"]) and v.get("error") == "P2PTimeoutError" and v.get("elapsed", 1e9) < TIMEOUT_S + 10 \
        and ended - v.get("raised_at", 0) < 10
    return ok, v.get("elapsed", float("nan")), stop


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--engines", nargs="*", default=["deepspeed", "megatron"])
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    runs = {"deepspeed": deepspeed_run, "megatron": megatron_run}
    for engine in args.engines:
        good = 0
        for k in range(args.runs):
            t0 = time.time()
            ok, elapsed, where = runs[engine](k)
            good += ok
            print(f"{engine} run {k + 1:2d} stop at {where:<22} {'ok' if ok else 'FAILED'}  raised after "
                  f"{elapsed:.2f} s (timeout {TIMEOUT_S} s), run {time.time() - t0:.1f} s", flush=True)
        print(f"{engine}: {good} of {args.runs} runs ended within timeout + 10 s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
