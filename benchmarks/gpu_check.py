"""The GPU check of issue 13 in one command: profile, split benchmark, schedules, DeepSpeed profile.

    python3 benchmarks/gpu_check.py                 # on the GPU machine (defaults: issue 13's sizes, CUDA)
    python benchmarks/gpu_check.py --small          # tiny sizes on the CPU: try the script first

Each step runs as its own subprocess (its own timeout, its process group stopped when it runs
over), so one failing or hanging step loses none of the others; the whole run stops within
--budget seconds (default 450). Everything lands in --out (default $OUT when set, else
gpu_check_out/): summary.md (the tables; rewritten after every step, so a run cut short keeps
what it measured), results.json (the numbers) and raw.tar.gz (every log and profile JSON, as
raw/...: the summary's commands name them so): three files, within what comes back from $OUT.
The summary is printed at the end. --steps a,c reruns some steps only.

Steps (default sizes; estimates are for the H200 machine, from the issue's timings and FLOP counts):
  a. `koala profile megatron-gpt` of issue 13: 24 layers, hidden 2048, 16 heads, seq 2048,
     micro-batch 1, -p 8, --device cuda, fp32 with TF32 matmuls (~60 s; the issue saw ~40 s)
     -> per stage F, I, W, B, (I+W)/B, activation and W-hold MiB, W-hold / activation.
     TF32: `koala profile` does not touch it, so it measures with torch's default for fp32
     matmuls (torch.backends.cuda.matmul.allow_tf32 = False: full fp32). As the issue's
     measurement used TF32, this step sets allow_tf32 = True before calling the same CLI
     (`python -c "...; koala_ds.cli.main(...)"`). benchmarks/split_backward.py sets it itself on CUDA.
  b. `benchmarks/split_backward.py --device cuda` at hidden 2048, 16 heads, 8 layers, seq 2048,
     p=4 (issue 13's CUDA target, (I+W)/B <= 1.10, is at hidden 2048), its three models (~75 s,
     mostly building 3 x 8 layers on the CPU) -> its table.
  c. examples/megatron_gpt under torchrun --nproc-per-node 2 (PP=2, both ranks on cuda:0,
     --distributed-backend gloo) for 1f1b, zb-h1 and zb-v (--virtual-pipeline-model-parallel-size 2:
     zb-v runs two chunks per rank), 8 layers, hidden 1024, 16 heads, seq 1024, micro-batch 1,
     global batch 8 (m = 8), 20 iterations (~35 s each: start-up, then ~0.1 s per iteration)
     -> losses equal across schedules (max abs diff against 1f1b), median iteration time
     (iterations 3 on) and zb-h1 / 1f1b, zb-v / 1f1b. Why this size: a stage's F + B is about
     4 layers x 90 GFLOP of fp32 per microbatch (~5-8 ms), while what the schedules do not share
     with the GPU is small beside it: the 4 MiB boundary tensor staged through the CPU for gloo
     (~1-2 ms) and the runtime's ~0.5 ms per action (docs/megatron.md). A smaller model would
     measure the runtime, not the schedule.
  d. `koala profile deepspeed --device cuda` of a 6-layer plain-torch GPT (hidden 2048, 16 heads,
     seq 1024, vocab 1024, -p 2) through benchmarks/gpu_models.py (~45 s) -> when it first printed,
     how long it took (before the fix it printed nothing within 100 s), and its profile.
  e. (opt-in, `--steps e`; not a GPU step) `benchmarks/engine_speedup.py --real` at p = 4 and 8 on
     the machine's 16 cores, one torch thread per rank (issue 13's real-compute target there; ~2.5 min
     per p): run it in the time left after a-d.
Total estimate ~5.5 min of the machine's time (plus its start), at most --budget.

What the GPU machine needs: it has no network; torch is there, deepspeed and megatron-core are
not. Build the wheels here once (`make gpu-wheels`: .gpu-wheels/, 7.4 MiB: deepspeed 0.19.8
built from source with `pip wheel --no-deps --no-build-isolation`, megatron-core 0.16.1, and
hjson, pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions for
Python 3.12). When deepspeed or megatron-core cannot be imported and .gpu-wheels/ exists, this
script first runs
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/koala-gpu-site .gpu-wheels/*.whl
and puts /tmp/koala-gpu-site on its steps' PYTHONPATH.

The one command for a session that has the device (the `run` tool). First, here, in the checkout
the session started in (that checkout is what travels): `make gpu-wheels` (seconds; needs PyPI)
and `python benchmarks/gpu_check.py --small` (~2 min on 2 cores). Then one call; .gpu-wheels is
ignored by git, so it is named in carry; 480 s covers the 450 s budget and leaves, within 15
minutes of device time, room to rerun failed steps at once with --steps while the machine is warm:
    run(command="PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py", carry=[".gpu-wheels"], timeout_s=480)
summary.md, results.json and raw.tar.gz come back from $OUT; the summary is also in the output.
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from koala_ds.core.outputs import atomic_write  # noqa: E402

WHEELS = ROOT / ".gpu-wheels"
SITE = Path(tempfile.gettempdir()) / "koala-gpu-site"
TF32_CLI = ("import sys, torch; torch.backends.cuda.matmul.allow_tf32 = True; "
            "print('torch.backends.cuda.matmul.allow_tf32 =', torch.backends.cuda.matmul.allow_tf32, file=sys.stderr); "
            "from koala_ds.cli import main; sys.exit(main(sys.argv[1:]))")
ENV_PROBE = ("import json, platform, torch; c = torch.cuda.is_available(); print(json.dumps({'python': "
             "platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda, 'gpu': "
             "torch.cuda.get_device_name(0) if c else None, 'gpus': torch.cuda.device_count() if c else 0, "
             "'allow_tf32_default': torch.backends.cuda.matmul.allow_tf32}))")
SCHEDULES = (("1f1b", []), ("zb-h1", []), ("zb-v", ["--virtual-pipeline-model-parallel-size", "2"]))

SIZES = {
    "full": {"a": dict(layers=24, hidden=2048, heads=16, seq=2048, mbs=1, p=8, warmup=2, iters=10, threads=8),
             "b": dict(layers=8, hidden=2048, heads=16, seq=2048, p=4, vocab=1024, warmup=2, iters=8, threads=8),
             "c": dict(layers=8, hidden=1024, heads=16, seq=1024, mbs=1, gbs=8, iters=20, vocab=128),
             "d": dict(layers=6, hidden=2048, heads=16, seq=1024, vocab=1024, p=2, warmup=2, iters=10, threads=8),
             "e": dict(p=(4, 8), steps=10)},
    "small": {"a": dict(layers=4, hidden=64, heads=4, seq=32, mbs=1, p=2, warmup=1, iters=3, threads=1),
              "b": dict(layers=4, hidden=64, heads=4, seq=32, p=2, vocab=128, warmup=1, iters=3, threads=1),
              "c": dict(layers=4, hidden=32, heads=4, seq=16, mbs=1, gbs=4, iters=4, vocab=128),
              "d": dict(layers=2, hidden=64, heads=4, seq=32, vocab=128, p=2, warmup=1, iters=3, threads=1),
              "e": dict(p=(2,), steps=3)},
}
#: (estimate, timeout) in seconds per run of each step on the GPU machine
TIMES = {"a": (60, 200), "b": (75, 200), "c": (35, 110), "d": (45, 180), "e": (150, 300)}


@dataclass
class Run:
    name: str  # its log is <name>.log in the work folder
    cmd: list
    timeout_s: float
    env: dict = field(default_factory=dict)


@dataclass
class Step:
    key: str
    title: str
    estimate_s: float
    runs: list
    report: Callable  # (work folder, run results) -> (markdown, numbers)


@dataclass
class RunResult:
    rc: int | None  # None: stopped at its timeout
    elapsed_s: float
    first_output_s: float | None
    skipped: bool = False

    @property
    def status(self) -> str:
        return "skipped (budget spent)" if self.skipped else "ok" if self.rc == 0 else \
            "TIMED OUT" if self.rc is None else f"FAILED (exit {self.rc})"


# -- running ------------------------------------------------------------------------------------
def descendants(pid: int) -> list:
    """The processes below `pid` (from /proc; empty where there is none)."""
    children: dict = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop_group(proc: subprocess.Popen) -> None:
    """Stop what this script started for `proc`: its process group, then by id whatever below it
    left that group (torchrun starts each worker in a session of its own; on SIGTERM it stops
    them itself, and the ones still there after its grace are killed)."""
    below = descendants(proc.pid)
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            pass
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_logged(run: Run, work: Path, env: dict, timeout_s: float) -> RunResult:
    """Run one command, output to <work>/<name>.log; note when it first printed."""
    log = work / f"{run.name}.log"
    with open(log, "ab") as fh:
        fh.write(f"$ {shlex.join(str(c) for c in run.cmd)}\n".encode())
        fh.flush()
        start_size, t0, first = fh.tell(), time.monotonic(), None
        proc = subprocess.Popen([str(c) for c in run.cmd], stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**env, **run.env}, start_new_session=True)
        while proc.poll() is None:
            now = time.monotonic() - t0
            if first is None and log.stat().st_size > start_size:
                first = now
            if now > timeout_s:
                stop_group(proc)
                return RunResult(None, time.monotonic() - t0, first)
            try:
                proc.wait(timeout=0.25)  # returns as soon as it ends
            except subprocess.TimeoutExpired:
                pass
        stop_group(proc)  # nothing it left behind keeps running
    if first is None and log.stat().st_size > start_size:
        first = time.monotonic() - t0
    return RunResult(proc.returncode, time.monotonic() - t0, first)


def child_env(device: str, site: Path | None) -> dict:
    path = [str(ROOT)] + ([str(site)] if site else []) + [p for p in [os.environ.get("PYTHONPATH")] if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1",
               DS_ACCELERATOR="cpu" if device == "cpu" else "cuda", PYTHONWARNINGS="ignore")
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    return env


def install_wheels(work: Path) -> tuple[Path | None, str]:
    """Install .gpu-wheels into SITE when deepspeed or megatron-core is missing."""
    missing = [m for m in ("deepspeed", "megatron") if importlib.util.find_spec(m) is None]
    if not missing:
        return None, "deepspeed and megatron-core importable: no wheels installed"
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        return None, f"{', '.join(missing)} missing and no {WHEELS.name}/ (make gpu-wheels; carry it): steps will fail"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(SITE), *wheels]
    res = run_logged(Run("wheels", cmd, 120), work, dict(os.environ), 120)
    if res.rc != 0:
        return None, f"installing {WHEELS.name}/ {res.status} (see wheels.log)"
    return SITE, f"installed {len(wheels)} wheels from {WHEELS.name}/ into {SITE} in {res.elapsed_s:.0f} s"


# -- the steps ----------------------------------------------------------------------------------
def koala(*args, tf32: bool = False) -> list:
    return [sys.executable, "-c", TF32_CLI, *args] if tf32 else [sys.executable, "-m", "koala_ds.cli", *args]


def step_a(sz: dict, device: str, work: Path) -> Step:
    s = sz["a"]
    cmd = koala("profile", "megatron-gpt", "--num-layers", s["layers"], "--hidden-size", s["hidden"],
                "--num-attention-heads", s["heads"], "--seq-length", s["seq"], "--micro-batch-size", s["mbs"],
                "-p", s["p"], "--device", device, "--threads", s["threads"], "--warmup", s["warmup"],
                "--iters", s["iters"], "-o", work / "a_profile.json", tf32=True)
    title = (f"a. koala profile megatron-gpt: {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads, seq "
             f"{s['seq']}, mbs {s['mbs']}, p={s['p']}, {device}, fp32 with TF32 matmuls")
    est, timeout = TIMES["a"]
    return Step("a", title, est, [Run("a", cmd, timeout)], lambda w, r: profile_report(w / "a_profile.json"))


def step_b(sz: dict, device: str, work: Path) -> Step:
    s = sz["b"]
    cmd = [sys.executable, ROOT / "benchmarks/split_backward.py", "--device", device, "--num-layers", s["layers"],
           "--hidden-size", s["hidden"], "--num-attention-heads", s["heads"], "--seq-length", s["seq"],
           "-p", s["p"], "--vocab-size", s["vocab"], "--threads", s["threads"], "--warmup", s["warmup"],
           "--iters", s["iters"]]
    title = (f"b. benchmarks/split_backward.py: {s['layers']} layers, hidden {s['hidden']}, seq {s['seq']}, "
             f"p={s['p']}, {device}")
    est, timeout = TIMES["b"]
    return Step("b", title, est, [Run("b", cmd, timeout)], lambda w, r: split_report(w / "b.log"))


def step_c(sz: dict, device: str, work: Path) -> Step:
    s, runs = sz["c"], []
    for name, extra in SCHEDULES:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               ROOT / "examples/megatron_gpt/pretrain_gpt.py", "--tensor-model-parallel-size", "1",
               "--pipeline-model-parallel-size", "2", "--num-layers", s["layers"], "--hidden-size", s["hidden"],
               "--num-attention-heads", s["heads"], "--seq-length", s["seq"], "--micro-batch-size", s["mbs"],
               "--global-batch-size", s["gbs"], "--train-iters", s["iters"], "--vocab-size", s["vocab"],
               "--lr", "1e-4", "--seed", "1234", "--distributed-backend", "gloo", "--pipeline-schedule", "koala",
               "--koala-schedule", name, *extra, "--loss-log", work / f"c_{name}.json"]
        runs.append(Run(f"c_{name}", cmd, TIMES["c"][1]))
    title = (f"c. examples/megatron_gpt, torchrun 2 ranks (PP=2) over gloo on {device}: {s['layers']} layers, "
             f"hidden {s['hidden']}, seq {s['seq']}, m={s['gbs'] // s['mbs']}, {s['iters']} iterations")
    return Step("c", title, TIMES["c"][0] * len(SCHEDULES), runs, lambda w, r: schedules_report(w))


def step_d(sz: dict, device: str, work: Path) -> Step:
    s = sz["d"]
    cmd = koala("profile", "deepspeed", "--layers", "benchmarks.gpu_models:layers", "--input",
                "benchmarks.gpu_models:sample", "-p", s["p"], "--device", device, "--threads", s["threads"],
                "--warmup", s["warmup"], "--iters", s["iters"], "-o", work / "d_profile.json")
    env = {"KOALA_GPT_LAYERS": str(s["layers"]), "KOALA_GPT_HIDDEN": str(s["hidden"]),
           "KOALA_GPT_HEADS": str(s["heads"]), "KOALA_GPT_SEQ": str(s["seq"]), "KOALA_GPT_VOCAB": str(s["vocab"])}
    title = (f"d. koala profile deepspeed (benchmarks/gpu_models.py): {s['layers']} layers, hidden {s['hidden']}, "
             f"seq {s['seq']}, p={s['p']}, {device}")
    est, timeout = TIMES["d"]

    def report(w: Path, results: list):
        r = results[0]
        first = "never" if r.first_output_s is None else f"after {r.first_output_s:.1f} s"
        text, numbers = profile_report(w / "d_profile.json")
        head = f"first output {first}; finished ({r.status}) after {r.elapsed_s:.1f} s\n\n"
        return head + text, {**numbers, "first_output_s": r.first_output_s, "elapsed_s": r.elapsed_s}

    return Step("d", title, est, [Run("d", cmd, timeout, env)], report)


def step_e(sz: dict, device: str, work: Path) -> Step:
    """Not a GPU step: issue 13's real-compute check at p = 4 and 8 on the machine's 16 cores (one
    torch thread per rank), opt-in (`--steps e`) when device time is left."""
    runs = [Run(f"e_p{p}", [sys.executable, ROOT / "benchmarks/engine_speedup.py", "--real", "-p", p, "--steps",
                            sz["e"]["steps"], "--out", work / f"e_p{p}"], TIMES["e"][1], {"DS_ACCELERATOR": "cpu"})
            for p in sz["e"]["p"]]
    title = f"e. benchmarks/engine_speedup.py --real on the CPU cores, p = {', '.join(map(str, sz['e']['p']))}"

    def report(w: Path, results: list):
        parts = [(w / f"e_p{p}" / "engine_speedup_real.md") for p in sz["e"]["p"]]
        text = "\n\n".join(f.read_text() for f in parts if f.exists())
        if not text:
            raise ValueError("engine_speedup.py --real wrote no table")
        return text, {}

    return Step("e", title, TIMES["e"][0] * len(runs), runs, report)


STEP_BUILDERS = {"a": step_a, "b": step_b, "c": step_c, "d": step_d, "e": step_e}


# -- reports ------------------------------------------------------------------------------------
def profile_report(path: Path) -> tuple[str, dict]:
    """A profile JSON as a table: per stage F, I, W, B, (I+W)/B, activation, W-hold, hold/act."""
    data = json.loads(path.read_text())
    head = "| stage | input grad | F ms | I ms | W ms | B ms | (I+W)/B | act MiB | W-hold MiB | hold/act | W FLOPs |"
    lines, ratios, holds = [head, "|" + "---|" * 11], [], []
    for s, (st, meta) in enumerate(zip(data["stages"], data["meta"]["stages"])):
        f, i, w, b = st["forward"], st["backward_input"], st["backward_weight"], st.get("backward")
        act, hold = st["activation_mb"], st["w_hold_mb"]
        ratio = (i + w) / b if b else None
        share = meta.get("w_flops_deferred")
        if meta.get("input_gradient") and ratio is not None:
            ratios.append(ratio)
        holds.append(hold / act if act else 0.0)
        lines.append(f"| {s} | {'yes' if meta.get('input_gradient') else 'no'} | {f:.3f} | {i:.3f} | {w:.3f} | "
                     f"{'-' if b is None else f'{b:.3f}'} | {'-' if ratio is None else f'{ratio:.3f}'} | {act:.1f} | "
                     f"{hold:.1f} | {holds[-1]:.2f} | {'-' if share is None else f'{100 * share:.0f}%'} |")
    numbers = {"stages": data["stages"], "p2p_latency_ms": data["p2p_latency"],
               "worst_split_ratio": max(ratios) if ratios else None, "worst_hold_ratio": max(holds) if holds else None}
    tail = (f"\nworst (I+W)/B over stages with an input gradient: {fmt(numbers['worst_split_ratio'])}; worst W-hold / "
            f"activation: {fmt(numbers['worst_hold_ratio'], 2)}; p2p latency {data['p2p_latency']:.4g} ms; timer: "
            f"{data['meta']['timer']}")
    return "\n".join(lines) + "\n" + tail, numbers


def split_report(log: Path) -> tuple[str, dict]:
    lines = log.read_text(errors="replace").splitlines()
    keep = [ln for ln in lines if ln.startswith(("split backward on", "|", "worst (I+W)/B"))]
    if not any(ln.startswith("worst") for ln in keep):
        raise ValueError("split_backward.py printed no table")
    worst = keep[-1].split(":")[1].split(";")[0].strip()
    return "\n".join(keep), {"worst_split_ratio": float(worst)}


def schedules_report(work: Path) -> tuple[str, dict]:
    """Losses against 1f1b and median iteration times (iterations 3 on, when there are 5 or more)."""
    logs = {name: json.loads((work / f"c_{name}.json").read_text())
            for name, _ in SCHEDULES if (work / f"c_{name}.json").exists()}
    if not logs:
        raise ValueError("no schedule run wrote its --loss-log")
    base = logs.get("1f1b")
    lines = ["| schedule | backend | device | iterations | first loss | last loss | max abs diff vs 1f1b | "
             "median ms | / 1f1b |", "|" + "---|" * 9]
    numbers = {}
    for name, d in logs.items():
        times = d["iteration_ms"][2:] if len(d["iteration_ms"]) >= 5 else d["iteration_ms"]
        med = statistics.median(times)
        diff = max(abs(x - y) for x, y in zip(d["losses"], base["losses"])) if base else None
        same_len = base is not None and len(d["losses"]) == len(base["losses"])
        ratio = med / numbers["1f1b"]["median_ms"] if "1f1b" in numbers else None
        numbers[name] = {"losses": d["losses"], "iteration_ms": d["iteration_ms"], "median_ms": med,
                         "max_abs_diff": diff if same_len else None, "ratio_to_1f1b": ratio}
        lines.append(f"| {name} | {d.get('backend')} | {d.get('device')} | {len(d['losses'])} | {d['losses'][0]:.6f} | "
                     f"{d['losses'][-1]:.6f} | {'-' if not same_len else f'{diff:.3g}'} | {med:.1f} | "
                     f"{fmt(ratio)} |")
    diffs = [n["max_abs_diff"] for n in numbers.values() if n["max_abs_diff"] is not None]
    scale = max(abs(x) for x in base["losses"]) if base else 1.0
    equal = len(diffs) == len(SCHEDULES) and max(diffs) <= 1e-5 * scale
    verdict = (f"\nlosses {'EQUAL' if equal else 'NOT EQUAL (or a run missing)'} across schedules (max abs diff "
               f"{fmt(max(diffs) if diffs else None, 3, 'g')}, tolerance 1e-5 x |loss|)")
    return "\n".join(lines) + "\n" + verdict, {"schedules": numbers, "losses_equal": equal}


def shown(cmd: list, work: Path) -> str:
    """A command as the summary shows it: paths relative to the repository's root, the work
    folder as raw/ (as in raw.tar.gz), this Python as `python`."""
    text = shlex.join(str(c) for c in cmd)
    return text.replace(shlex.quote(TF32_CLI), "<set TF32; koala_ds.cli.main>").replace(sys.executable, "python") \
        .replace(str(ROOT) + os.sep, "").replace(str(work) + os.sep, "raw/")


def fmt(x, digits: int = 3, kind: str = "f") -> str:
    return "-" if x is None else f"{x:.{digits}{kind}}"


def log_tail(work: Path, runs: list, n: int = 15) -> str:
    out = []
    for run in runs:
        log = work / f"{run.name}.log"
        if log.exists():
            lines = log.read_text(errors="replace").splitlines()[-n:]
            out.append(f"last lines of {run.name}.log:\n```\n" + "\n".join(ln[:200] for ln in lines) + "\n```")
    return "\n".join(out)


# -- the run ------------------------------------------------------------------------------------
@dataclass
class Outcome:
    step: Step
    results: list
    elapsed_s: float
    text: str = ""
    numbers: dict = field(default_factory=dict)
    running: bool = False

    @property
    def status(self) -> str:
        bad = [r.status for r in self.results if r.status != "ok"]
        return ("RUNNING (cut short?)" if self.running else "not run") if not self.results else bad[0] if bad else "ok"


def run_step(step: Step, work: Path, env: dict, deadline: float) -> Outcome:
    t0, results = time.monotonic(), []
    for run in step.runs:
        left = deadline - time.monotonic()
        results.append(RunResult(None, 0.0, None, skipped=True) if left < 5 else
                       run_logged(run, work, env, min(run.timeout_s, left)))
    out = Outcome(step, results, time.monotonic() - t0)
    try:
        out.text, out.numbers = step.report(work, results)
    except Exception as exc:  # noqa: BLE001 - a failed step reports what it left
        out.text = f"no result ({type(exc).__name__}: {exc})"
    if out.status != "ok":
        out.text += "\n\n" + log_tail(work, step.runs)
    return out


def summary(header: list, outcomes: list, work: Path) -> str:
    rows = ["| step | status | seconds | estimate |", "|---|---|---|---|"]
    rows += [f"| {o.step.title} | {o.status} | {o.elapsed_s:.0f} | {o.step.estimate_s:.0f} |" for o in outcomes]
    sections = []
    for o in outcomes:
        if o.results:
            cmds = "\n".join(shown(r.cmd, work) for r in o.step.runs)
            sections.append(f"## {o.step.title}\n{o.status} in {o.elapsed_s:.0f} s\n```\n{cmds}\n```\n{o.text}\n")
    return "\n".join(header) + "\n\n" + "\n".join(rows) + "\n\n" + "\n".join(sections)


def save(out: Path, work: Path, header: list, outcomes: list, meta: dict) -> str:
    """summary.md, results.json and raw.tar.gz (the work folder), each written atomically."""
    text = summary(header, outcomes, work)
    atomic_write(out / "summary.md", text)
    results = {**meta, "steps": {o.step.key: {"title": o.step.title, "status": o.status, "elapsed_s": o.elapsed_s,
                                              "estimate_s": o.step.estimate_s, **o.numbers} for o in outcomes}}
    atomic_write(out / "results.json", json.dumps(results, indent=1, default=str) + "\n")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(work, arcname="raw")
    atomic_write(out / "raw.tar.gz", buf.getvalue())
    return text


def probe(work: Path, env: dict) -> dict:
    res = run_logged(Run("env", [sys.executable, "-c", ENV_PROBE], 120), work, env, 120)
    lines = (work / "env.log").read_text(errors="replace").splitlines()
    found = [ln for ln in lines if ln.startswith("{")]
    return json.loads(found[-1]) if res.rc == 0 and found else {"probe": res.status}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out",
                    help="output folder (default $OUT when set, else gpu_check_out)")
    ap.add_argument("--small", action="store_true", help="tiny sizes (and --device cpu): try the script anywhere")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda; cpu with --small)")
    ap.add_argument("--steps", default="a,b,c,d", help="which steps, e.g. a,c (default a,b,c,d; e: the real-compute "
                    "benchmark at p = 4 and 8 on the CPU cores, opt-in)")
    ap.add_argument("--budget", type=float, default=450.0, metavar="S",
                    help="the whole run stops within this many seconds (default 450)")
    a = ap.parse_args(argv)
    a.device = a.device or ("cpu" if a.small else "cuda")
    a.steps = [s.strip() for s in a.steps.split(",") if s.strip()]
    bad = [s for s in a.steps if s not in STEP_BUILDERS]
    if bad:
        ap.error(f"--steps: unknown step(s) {', '.join(bad)}; choose from a, b, c, d, e")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + a.budget
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    site, wheels_note = install_wheels(work)
    env = child_env(a.device, site)
    info = probe(work, env)
    mode = "small" if a.small else "full"
    header = [f"# GPU check (issue 13): {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {mode} sizes, "
              f"--device {a.device}",
              f"machine: {json.dumps(info)}",
              f"wheels: {wheels_note}",
              "TF32: koala profile leaves torch's default (allow_tf32_default above; False = full fp32 matmuls); "
              "step a sets torch.backends.cuda.matmul.allow_tf32 = True before the CLI, split_backward.py sets it "
              "on CUDA itself; steps c and d run plain fp32."]
    meta = {"mode": mode, "device": a.device, "machine": info, "wheels": wheels_note}
    steps = [STEP_BUILDERS[k](SIZES[mode], a.device, work) for k in a.steps]
    outcomes = [Outcome(s, [], 0.0) for s in steps]
    for n, step in enumerate(steps):
        outcomes[n].running = True
        save(out, work, header, outcomes, meta)  # a run cut short still shows where it was
        print(f"[{step.key}] {step.title} (estimate {step.estimate_s:.0f} s) ...", flush=True)
        outcomes[n] = run_step(step, work, env, deadline)
        print(f"[{step.key}] {outcomes[n].status} in {outcomes[n].elapsed_s:.0f} s", flush=True)
    header.append(f"total {time.monotonic() - t_start:.0f} s (budget {a.budget:.0f} s); every log and profile in "
                  f"raw.tar.gz")
    text = save(out, work, header, outcomes, meta)
    shutil.rmtree(work, ignore_errors=True)  # all of it is in raw.tar.gz
    print(text, flush=True)
    return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
