"""The DeepSpeed example's exit: N consecutive runs, each must end with exit code 0 and no
"terminate called" on any rank (docs/deepspeed.md, "Ending a run").

    python benchmarks/exit_check.py                        # 20 runs, DeepSpeed's own engine
    python benchmarks/exit_check.py --schedule zb-h1       # 20 runs with a Koala schedule
    python benchmarks/exit_check.py --starve               # the abort's race made likely
    python benchmarks/exit_check.py --starve --no-wait     # the same without the fix: most runs abort

Each run is `torchrun --nproc_per_node 2 examples/deepspeed_pipe/train.py` on CPU (gloo), on a
free port. The abort needs a gloo worker thread to be descheduled between completing the last
collective and dropping its tensors, so a quiet machine rarely shows it. `--starve` puts each
rank's gloo worker threads (pt_gloo_runloop) at SCHED_IDLE once deepspeed.initialize returns:
the main thread then goes on to exit while the worker waits for a CPU. `--no-wait` takes the
fix out (the example's `wait_for_gloo_workers()` and koala_ds.deepspeed's exit hook do nothing).
Prints one line per run and the count; exit code 0 when every run was clean.
"""
from __future__ import annotations

import argparse
import os
import re
import runpy
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
EXAMPLE = os.path.join(REPO, "examples", "deepspeed_pipe", "train.py")
#: The test and benchmark harness (deepspeed_jobs) lives in tests/, outside the installed package.
sys.path.insert(0, os.path.join(REPO, "tests"))
ABORT = "terminate called"
#: torchrun's line for each rank that failed
FAILED_RANK = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
AS_RANK = "--as-rank"  # how torchrun starts this file in each rank


def starve_gloo_workers() -> None:
    """After deepspeed.initialize, run this process's gloo worker threads at SCHED_IDLE."""
    import deepspeed

    from koala_ds.deepspeed.teardown import WORKER_THREAD, worker_states

    initialize = deepspeed.initialize

    def starved(*args, **kwargs):
        out = initialize(*args, **kwargs)
        for tid in worker_states(WORKER_THREAD):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return out

    deepspeed.initialize = starved


def remove_wait() -> None:
    """Take the fix out: koala_ds.deepspeed's exit hook and the example's call do nothing."""
    import atexit

    import koala_ds.deepspeed
    from koala_ds.deepspeed import teardown

    atexit.unregister(teardown.wait_for_gloo_workers)
    koala_ds.deepspeed.wait_for_gloo_workers = lambda *args, **kwargs: True


def rank_main(argv: list[str]) -> None:
    """In each rank: apply --starve / --no-wait, then run the example as its own __main__."""
    flags, example_args = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    if "--starve" in flags:
        starve_gloo_workers()
    if "--no-wait" in flags:
        remove_wait()
    sys.argv = [EXAMPLE, *example_args]
    runpy.run_path(EXAMPLE, run_name="__main__")


def one_run(flags: list[str], example_args: list[str], timeout_s: float) -> tuple[str, float, str]:
    """('clean' | 'ABORT' | 'FAILED' | 'TIMEOUT', seconds, the output's last lines)."""
    from deepspeed_jobs import _kill_session, extensions_dir

    from koala_ds.runtime.spawn import free_port, remove_deepspeed_shm

    port = free_port()
    env = dict(os.environ, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(extensions_dir()))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), os.path.abspath(__file__), AS_RANK, *flags, "--", *example_args]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        verdict = "ABORT" if ABORT in out else "clean" if proc.returncode == 0 else "FAILED"
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        out, _ = proc.communicate()
        verdict = "TIMEOUT"
    finally:
        remove_deepspeed_shm(port)
    failed = [f"rank {rank} exit code {code}" for code, rank in FAILED_RANK.findall(out)]
    errors = [line.strip() for line in out.splitlines() if "Error:" in line and "ChildFailedError" not in line]
    said = [f"{out.count(ABORT)} x '{ABORT} ...'"] if ABORT in out else []
    return verdict, time.monotonic() - t0, "; ".join(said + failed + errors[-1:])[:300]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--schedule", default=None, help="a Koala schedule for the example (default: DeepSpeed's own)")
    ap.add_argument("--starve", action="store_true", help="gloo worker threads at SCHED_IDLE in each rank")
    ap.add_argument("--no-wait", action="store_true", help="without the fix (wait_for_gloo_workers)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    args, extra = ap.parse_known_args(argv)
    flags = [flag for flag, on in (("--starve", args.starve), ("--no-wait", args.no_wait)) if on]
    example_args = (["--schedule", args.schedule] if args.schedule else []) + extra
    engine = f"Koala schedule {args.schedule}" if args.schedule else "DeepSpeed's own engine"
    clean = 0
    for k in range(args.runs):
        verdict, seconds, tail = one_run(flags, example_args, args.timeout)
        clean += verdict == "clean"
        print(f"run {k + 1:2d}: {verdict:<7} {seconds:5.1f} s  {tail if verdict != 'clean' else ''}".rstrip(),
              flush=True)
    print(f"{engine}{' ' + ' '.join(flags) if flags else ''}: {clean} of {args.runs} runs exited cleanly")
    return 0 if clean == args.runs else 1


if __name__ == "__main__":
    if AS_RANK in sys.argv[1:2]:
        rank_main(sys.argv[2:])
    else:
        sys.exit(main())
