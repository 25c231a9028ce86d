"""Predicted vs measured step time on real compute, through the user's own path.

    python benchmarks/fidelity.py                 # both examples, two sizes each, p = 2 (~20 min on 2 cores)
    python benchmarks/fidelity.py --quick         # the examples' default sizes, v = 1, one round (~3 min)
    python benchmarks/fidelity.py --out benchmarks/results/fidelity.txt   # also write the report
    python benchmarks/fidelity.py --dry-run       # the plan and the commands, nothing run

For each engine's example (examples/megatron_gpt/pretrain_gpt.py: its README's GPT, 4 layers,
hidden 64, seq 32, micro-batch 2, and 8 layers, hidden 256, seq 64; examples/deepspeed_pipe/train.py:
--dim 64 and --dim 1024), at p = 2 pipeline ranks (p = 4 too where os.cpu_count() >= 8), and
v = 1 and 2 chunks per rank where the model has the layers, it runs what a user runs:

1. `koala profile megatron-gpt ...` / `koala profile deepspeed --layers ... --input ...` (the
   example's own layer list, `train:layers`, or a two-line module returning `build_layers(dim)`
   for another --dim), one profile per v (DeepSpeed cuts p x v parts anew);
2. `calibrate()`: short traced runs of the library schedules of every v on the real engine
   (v = 1: 1f1b and zb-h1; v = 2: interleaved-1f1b and zb-v), all of them TAKING TURNS in one
   run, CALIB_BLOCK iterations each (the examples' --alternate-schedules with Megatron
   --koala-trace FILE / DeepSpeed --trace FILE: a trace per schedule, FILE.<name>), `--calib-rounds`
   such runs of `--calib-iterations`, the first schedule rotated; then one `koala calibrate
   TRACE... --profile profile_v1.json -o calibrated_v1.json --profile profile_v2.json -o
   calibrated_v2.json` (each v's profile fitted to its traces), leaving out each schedule's
   first turn and the first TURN_SETTLE steps of every turn: the stage times as they ran in the
   engine, the per-action, per-step and p2p costs, every schedule over the same minutes of the
   machine (fresh runs minutes apart put one schedule 10-40% apart); what it printed goes into
   the report, with the runs' speedups within and across v beside the calibrated profiles';
3. on the CALIBRATED profiles, `koala compare --json` per v: 1f1b and the best predefined
   schedule (the fastest that fits the memory limit and that the engines run: one pipeline),
   and `koala search --min-gain 0 --ignore-spread` per v: the searched schedule (the faster v's;
   the model's own pick, which the profile's spread would otherwise keep back); predictions
   by `koala simulate --json`; and `koala search` with its defaults (--min-gain 5, the spread),
   what a user gets: the report says which measured schedule that is, and where it is none of
   them it is measured too ("default search (placement, v=V)");
4. the example with each distinct schedule (a searched schedule equal to a library one runs
   once), ALTERNATING: `--rounds` rounds, each a fresh torchrun of every schedule in a rotated
   order, `--iterations` iterations each, the first `--warmup` dropped; the examples' own
   per-iteration step periods (`--loss-log FILE`: period_ms, from one iteration's start to the
   next's, the step koala calibrate fits; Megatron: the last pipeline rank, DeepSpeed: rank 0),
   median over every kept iteration of every round. Every measured run also records its
   trace, as every schedule alike (the DeepSpeed example's traced steps vs untraced ones in one
   run: +0.72 and -0.42 ms of a 35 ms step, each +-0.6-0.8 ms, benchmarks/trace_overhead.py
   --deepspeed 600); `--untraced` leaves it off, and step 5 with it;
   PAIRED: `--paired-rounds` more runs, untraced, in each of which every distinct schedule
   takes turns, PAIRED_BLOCK iterations each (the examples' --alternate-schedules: Megatron
   builds a forward_backward_func per schedule, DeepSpeed switches with
   KoalaPipelineEngine.set_koala_schedule; a schedule of another v or placement runs on a model
   copy of its own, built as the same model), `--paired-iterations` iterations, the
   first `--warmup` and the first TURN_SETTLE of each turn dropped: a drift of the machine within
   the run hits every schedule alike, where fresh runs minutes apart differ by tens of percent;
5. `recalibrate()`: per v, `koala calibrate` on the measured runs' traces of that v (every
   schedule, the searched one too) and `koala simulate` of each schedule on that profile: the
   step time the model gives each schedule when calibrated on the same minutes of the machine
   as the measurement (step 2's calibration is minutes older, and a busy machine drifts by tens
   of percent in minutes).

The report: the exact command, the machine (cores, CPU model, load average before and after), the
calibration used, one row per (example, schedule): predicted and measured step time, the per-round
medians' range, speedup over 1f1b (predicted, measured, and measured round by round: each round's
1f1b median over its own; their standard error), the speedup error (measured - predicted) and the
step-time error (measured / predicted - 1); then, per searched schedule, the targets (speedup
error within 0.05, at least 0.98x of 1f1b) and whether the rounds resolve that much (2 standard
errors of their speedups within 0.05), for the fresh rounds and for the paired ones (their
columns: paired speedup, per paired round, their SE, paired error = paired - predicted).
Printed; written (atomically) only with `--out FILE`. A failing step is one line naming the
command and its log file; the work folder (`--work`, default a temporary one) keeps every
profile, schedule and log.

THE MACHINE IS SHARED: ranks that sleep or wait give their core to other processes, and a busy
machine changes a step's time by tens of percent within minutes; the alternation makes such
drifts hit every schedule alike, and the per-round range shows what is left. Measured on the
2-core VM (2026-12-06, DeepSpeed dim 1024, 1f1b and zb-h1 in 12 alternating pairs of fresh runs,
20 iterations each): one schedule's run medians 113-144 ms, a pair's speedup 0.92-1.18x; hence
several calibration rounds and 8 measured rounds by default, and the standard error beside
the speedups.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from koala_ds.commands.search import DEFAULT_MIN_GAIN_PCT  # noqa: E402  (what the report names)
from koala_ds.runtime.trace_record import schedule_file as schedule_trace_file  # noqa: E402  (the recorder's names)
from koala_ds.runtime.turns import kept_periods  # noqa: E402  (plain Python: the examples' own rule)
from koala_ds.sim.turn_speedups import SPEEDUP_TOLERANCE  # noqa: E402  (the target koala calibrate checks)
MEGATRON_EXAMPLE = ROOT / "examples" / "megatron_gpt" / "pretrain_gpt.py"
DEEPSPEED_EXAMPLE = ROOT / "examples" / "deepspeed_pipe" / "train.py"
MICROBATCHES = 8  # both examples' default step: Megatron --global-batch-size 16 / --micro-batch-size 2
#: Megatron sizes: the README's, and a larger GPT (flags of pretrain_gpt.py and `koala profile megatron-gpt`)
MEGATRON_SIZES = {"gpt-4L-h64-s32": {"num-layers": 4, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 32,
                                     "micro-batch-size": 2},
                  "gpt-8L-h256-s64": {"num-layers": 8, "hidden-size": 256, "num-attention-heads": 4, "seq-length": 64,
                                      "micro-batch-size": 2}}
DEEPSPEED_DIMS = (64, 1024)  # train.py --dim: its default and a size whose layers cost more than the runtime
DEEPSPEED_LAYERS = 9  # train.py's build_layers: 8 blocks and a head
#: train.py's SEED_LAYERS: its PipelineModule reseeds before every layer (koala profile --seed-layers)
DEEPSPEED_SEED_LAYERS = True
STEP_TIMEOUT_S = 600  # every subprocess (a profile, a search, one torchrun)
#: paired rounds: iterations of a schedule's turn in the run where the schedules take turns (the
#: example's --alternate-block); the first TURN_SETTLE of each turn are dropped, so that every
#: kept step follows steps of its own schedule on every rank
PAIRED_BLOCK = 4
#: iterations dropped at the start of every turn, in the paired rounds and the calibration (koala
#: calibrate --settle-steps): on Megatron 8x256, where the schedules run on model copies of their
#: own, a turn's first two iterations measured about 0.06 off its third and fourth (README, "A
#: step is one step"; benchmarks/results/turn_positions.txt); 2 of 4 keep as many as 1 of 2 did
TURN_SETTLE = 2


class BenchError(RuntimeError):
    """A step failed: the message is one line naming the command and its log."""


def venv_bin() -> Path:
    """The folder of `koala` and `torchrun`: the checkout's .venv, else this interpreter's."""
    own = ROOT / ".venv" / "bin"
    return own if (own / "koala").exists() else Path(sys.executable).parent


# -- what runs -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Example:
    """One example at one size and p: how to profile it and how to run it."""

    engine: str  # "megatron" | "deepspeed"
    label: str
    p: int
    size: dict = field(default_factory=dict)  # Megatron flags, or {"dim": N}

    @property
    def num_layers(self) -> int:
        return self.size["num-layers"] if self.engine == "megatron" else DEEPSPEED_LAYERS

    def chunks(self, wanted: tuple[int, ...]) -> tuple[int, ...]:
        """The v of `wanted` this model can be cut into (Megatron: layers divisible by p x v)."""
        if self.engine == "megatron":
            return tuple(v for v in wanted if self.num_layers % (self.p * v) == 0)
        return tuple(v for v in wanted if self.num_layers >= self.p * v)

    def env(self, work: Path) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.engine == "deepspeed":
            env["DS_ACCELERATOR"] = "cpu"
            paths = [str(work), str(DEEPSPEED_EXAMPLE.parent)]
            env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
        return env

    def profile_cmd(self, v: int, out: Path, work: Path, quick: bool) -> list[str]:
        koala = str(venv_bin() / "koala")
        rounds = ["--warmup", "3", "--iters", "10"] if quick else []
        if self.engine == "megatron":
            flags = [x for k, val in self.size.items() for x in (f"--{k}", str(val))]
            return [koala, "profile", "megatron-gpt", *flags, "-p", str(self.p), "-v", str(v), "-o", str(out), *rounds]
        module = self.layers_module(work)
        seed = ["--seed-layers"] if DEEPSPEED_SEED_LAYERS else []
        return [koala, "profile", "deepspeed", "--layers", f"{module}:layers", "--input", f"{module}:sample",
                "--partition-method", "uniform", *seed, "-p", str(self.p), "-v", str(v), "-o", str(out), *rounds]

    def layers_module(self, work: Path) -> str:
        """The module `koala profile deepspeed` imports: the example itself at its default --dim,
        else a module of two functions returning `build_layers(dim)` / `sample_input(dim)`."""
        dim = self.size["dim"]
        if dim == 64:
            return "train"
        name = f"fidelity_ds_dim{dim}"
        if not work.is_dir():  # --dry-run
            return name
        (work / f"{name}.py").write_text(
            f'"""examples/deepspeed_pipe/train.py at --dim {dim}, for koala profile deepspeed."""\n'
            f"from train import build_layers, sample_input\n\n\n"
            f"def layers():\n    return build_layers({dim})\n\n\n"
            f"def sample():\n    return sample_input({dim})\n", encoding="utf-8")
        return name

    def run_cmd(self, sched: "Candidate", iterations: int, log: Path, trace: Path | None = None,
                alternate: tuple = (), block: int = PAIRED_BLOCK, settle: int = 1) -> list[str]:
        """The example's torchrun for `sched`; `trace`: also record the measured trace there
        (Megatron --koala-trace FILE, the DeepSpeed example's --trace FILE; with `alternate`, each
        other schedule's in FILE.<its name>); `alternate`: candidates taking turns with `sched` in
        the same run, `block` iterations each, the example's end line leaving out the first `settle`
        of every turn."""
        torchrun = [str(venv_bin() / "torchrun"), "--standalone", "--nproc-per-node", str(self.p)]
        flag = "--koala-trace" if self.engine == "megatron" else "--trace"
        traced = [flag, str(trace)] if trace is not None else []
        if self.engine == "megatron":
            flags = [x for k, val in self.size.items() for x in (f"--{k}", str(val))]
            chunks = ["--virtual-pipeline-model-parallel-size", str(sched.v)] if sched.v > 1 else []
            gbs = self.size["micro-batch-size"] * MICROBATCHES
            return [*torchrun, str(MEGATRON_EXAMPLE), "--pipeline-model-parallel-size", str(self.p), *chunks, *flags,
                    "--global-batch-size", str(gbs), "--train-iters", str(iterations), "--log-interval",
                    str(iterations), "--pipeline-schedule", "koala", "--koala-schedule", sched.schedule,
                    "--loss-log", str(log), *traced, *self._alternate_flags(alternate, block, settle)]
        chunks = ["--chunks", str(sched.v), "--placement", sched.placement] if sched.v > 1 else []
        return [*torchrun, str(DEEPSPEED_EXAMPLE), "--dim", str(self.size["dim"]), "--microbatches",
                str(MICROBATCHES), "--steps", str(iterations), "--schedule", sched.schedule, *chunks,
                "--loss-log", str(log), *traced, *self._alternate_flags(alternate, block, settle)]


    @staticmethod
    def _alternate_flags(alternate: tuple, block: int, settle: int) -> list[str]:
        """Both examples' --alternate-schedules (Megatron: a forward_backward_func per schedule;
        DeepSpeed: KoalaPipelineEngine.set_koala_schedule) and, above their default 1,
        --alternate-settle."""
        if not alternate:
            return []
        return ["--alternate-schedules", ",".join(c.schedule for c in alternate), "--alternate-block", str(block),
                *(["--alternate-settle", str(settle)] if settle > 1 else [])]


def plan(args) -> list[Example]:
    """The examples to run, in order (Megatron first)."""
    ps = [2] + ([4] if (os.cpu_count() or 1) >= 8 else [])
    out = []
    for p in ps:
        if "megatron" in args.engines:
            sizes = list(MEGATRON_SIZES.items())[:1 if args.quick else None]
            out += [Example("megatron", label, p, dict(size)) for label, size in sizes]
        if "deepspeed" in args.engines:
            dims = DEEPSPEED_DIMS[:1 if args.quick else None]
            out += [Example("deepspeed", f"dim{dim}", p, {"dim": dim}) for dim in dims]
    return out


# -- subprocesses --------------------------------------------------------------------------------
def run(cmd: list[str], log: Path, env: dict | None = None, cwd: Path | None = None, dry: bool = False,
        say=print) -> str:
    """`cmd` with stdout and stderr into `log`, within STEP_TIMEOUT_S (its process group killed
    after); its stdout text. BenchError (one line) when it fails."""
    say("  $ " + shlex.join(cmd))
    if dry:
        return ""
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=fh, env=env, cwd=cwd, text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=STEP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise BenchError(f"{Path(cmd[0]).name} ran past {STEP_TIMEOUT_S} s: {shlex.join(cmd[:6])} ... "
                             f"(log {log})") from None
        fh.write(out)
    if proc.returncode != 0:
        raise BenchError(f"exit {proc.returncode}: {shlex.join(cmd[:6])} ... ({last_line(log)}; log {log})")
    return out


def last_line(log: Path) -> str:
    """The last error-looking line of a log, else its last line."""
    lines = [x.strip() for x in log.read_text(encoding="utf-8", errors="replace").splitlines() if x.strip()]
    errors = [x for x in lines if "Error" in x or "error:" in x]
    return (errors or lines or ["no output"])[-1][:300]


def koala_json(args: list[str], log: Path, ex: Example, work: Path, dry: bool, say) -> dict:
    out = run([str(venv_bin() / "koala"), *args, "--json"], log, ex.env(work), work, dry, say)
    return json.loads(out) if not dry else {}


# -- choosing the schedules -----------------------------------------------------------------------
@dataclass
class Candidate:
    """A schedule to run: `schedule` is a library name or a file; `same_as` the label of an
    identical candidate run in its place (a searched schedule equal to a library one)."""

    label: str
    schedule: str
    v: int
    placement: str = "linear"
    predicted_ms: float = float("nan")
    same_as: str | None = None


#: The library schedules a user traces to calibrate each v (koala calibrate fits every traced
#: run of that v at once): per v one with a full and one with a split backward, so that B and I / W
#: are all measured. v = 2 needs zb-v beside interleaved-1f1b: calibrated on interleaved-1f1b
#: alone, DeepSpeed dim64's I / W were the profile's times the F ratio (x20-76: F's span holds the
#: runtime's per-action work) and zb-v was predicted at 244 ms where it ran 130 (+88%); fitted on
#: both, -3.4% / -9.6% (2026-12-05, /work/notes/fidelity_findings.md).
CALIBRATION_SCHEDULES = {1: (("1f1b", "linear"), ("zb-h1", "linear")),
                         2: (("interleaved-1f1b", "interleaved"), ("zb-v", "vshape"))}
#: calibration runs: iterations of a schedule's turn (its first TURN_SETTLE, after another schedule's, left out)
CALIB_BLOCK = 4
#: iterations per calibration run: with the four schedules of v = 1, 2 taking turns of 4, 18 kept
#: steps per schedule and run since TURN_SETTLE is 2 (27 when only a turn's first was left out; 64
#: iterations kept 9: the calibrated prediction of a run then missed it by up to 22% on Megatron
#: 4x64 and its speedups followed the few steps' noise; 2026-12-07, README)
CALIB_ITERATIONS = 160


def calibrate(ex: Example, profiles: dict[int, Path], args, work: Path, say) -> tuple[dict[int, Path], str]:
    """The user's calibration, its schedules taking turns: `args.calib_rounds` traced torchruns,
    in each of which every v's library schedules (CALIBRATION_SCHEDULES, each as its exported
    JSON, which keeps its own v and placement) take turns, CALIB_BLOCK iterations each (the
    examples' --alternate-schedules with --koala-trace / --trace: a trace per schedule, FILE and
    FILE.<name>; the first schedule rotated every round). A drift of the machine then hits every
    calibration schedule alike, as the paired rounds' does the measured ones; fresh runs minutes
    apart measured one schedule 10-40% apart on this VM, and the per-schedule predictions missed
    by that (benchmarks/results/fidelity.txt, the run of 23:55). Then one `koala calibrate` over
    every round's traces with a --profile (and -o) per v: each v's profile fitted to its traces,
    `--skip-steps` each schedule's first turn and `--settle-steps` the first TURN_SETTLE steps
    of every turn, after another schedule's), and the speedups across v printed beside the
    calibrated profiles'. The calibrated profiles, and what koala calibrate printed."""
    named = [Candidate(name, name, v, placement) for v in profiles for name, placement in CALIBRATION_SCHEDULES.get(v, ())]
    files = [dataclasses.replace(c, schedule=str(schedule_file(ex, c, work, args.dry_run, say))) for c in named]
    # read from the files just exported: schedule_json would export them again (and print it, in --dry-run)
    names = {f.schedule: read_json(Path(f.schedule), args.dry_run).get("name", c.label) for c, f in zip(named, files)}
    traced: dict[int, list[Path]] = {v: [] for v in profiles}
    skip = len(files) * CALIB_BLOCK
    for r in range(args.calib_rounds if files else 0):
        order = files[r % len(files):] + files[:r % len(files)]
        trace, log = work / f"trace_r{r}.json", work / f"calib_r{r}"
        run(ex.run_cmd(order[0], args.calib_iterations, log.with_suffix(".json"), trace, tuple(order[1:]),
                       CALIB_BLOCK, TURN_SETTLE), log.with_suffix(".log"), ex.env(work), ROOT, args.dry_run, say)
        taken = {str(trace)}  # the trace's file per schedule, as the runtimes' recorder names them
        for k, c in enumerate(order):
            file = str(trace) if k == 0 else schedule_trace_file(str(trace), names[c.schedule], taken)
            taken.add(file)
            traced[c.v].append(Path(file))
    out = {v: (work / f"calibrated_v{v}.json" if traced[v] else prof) for v, prof in profiles.items()}
    printed = [f"v={v}: no library schedule to trace; the profile as measured" for v in profiles if not traced[v]]
    fitted = [v for v in profiles if traced[v]]
    if fitted:
        args_ = [a for v in fitted for a in ("--profile", str(profiles[v]), "-o", str(out[v]))]
        text = run([str(venv_bin() / "koala"), "calibrate", *(str(t) for v in fitted for t in traced[v]), *args_,
                    "--skip-steps", str(skip), "--settle-steps", str(TURN_SETTLE)], work / "calibrate.log",
                   ex.env(work), work, args.dry_run, say)
        printed.append(f"koala calibrate, a --profile per v ({', '.join(f'v={v}' for v in fitted)}): "
                       f"{' '.join(t.stem for v in fitted for t in traced[v])} ({args.calib_rounds} round(s) of "
                       f"{args.calib_iterations} iterations, the schedules taking turns of {CALIB_BLOCK}, the first "
                       f"{skip} and the first {TURN_SETTLE} of each turn left out):\n"
                       + "\n".join("    " + line for line in text.splitlines() if not line.startswith("wrote ")))
    return out, "\n  ".join(["koala calibrate on traced runs where the library schedules take turns", *printed])


def choose(ex: Example, profiles: dict[int, Path], budget: float, work: Path, dry: bool, say) -> list[Candidate]:
    """1f1b, the best predefined schedule (koala compare) and the searched one (koala search
    --min-gain 0 --ignore-spread: the model's own pick, not kept back by the profile's spread), each with its predicted step time (koala simulate)."""
    base = ["-p", str(ex.p), "-m", str(MICROBATCHES)]
    best = None
    searched = []
    for v, prof in profiles.items():
        table = koala_json(["compare", "--profile", str(prof), *base, "-v", str(v)], work / f"compare_v{v}.log",
                           ex, work, dry, say)
        for row in table.get("schedules", []):
            if row["schedule"] != "1f1b" and row["fits_memory"] and row["placement"] != "bidirectional" and \
                    (best is None or row["makespan"] < best.predicted_ms):
                best = Candidate(f"best predefined ({row['schedule']})", row["schedule"], v, row["placement"],
                                 row["makespan"])
        out = work / f"searched_v{v}.koala"
        run([str(venv_bin() / "koala"), "search", "--profile", str(prof), *base, "-v", str(v), "--min-gain", "0",
             "--ignore-spread", "--quiet", "--time-budget", str(budget), "-o", str(out)], work / f"search_v{v}.log", ex.env(work), work,
            dry, say)
        searched.append(Candidate(f"searched (v={v})", str(out), v))
    one = Candidate("1f1b", "1f1b", 1)
    for cand in [one, *searched]:
        cand.predicted_ms, cand.placement = predict(ex, cand, profiles[cand.v], work, dry, say)
    search = min(searched, key=lambda c: c.predicted_ms) if not dry else searched[0]
    search.label = f"searched ({search.placement}, v={search.v})"
    if dry:  # what koala compare would name
        best = Candidate("best predefined (from koala compare)", "<best predefined>", 1)
    chosen = [one] + ([best] if best is not None else []) + [search]
    mark_duplicates(ex, chosen, work, dry, say)
    return chosen


def predict(ex: Example, cand: Candidate, profile: Path, work: Path, dry: bool, say) -> tuple[float, str]:
    """(simulated step time in ms, placement style) of `cand` under `profile` (koala simulate)."""
    res = koala_json(["simulate", cand.schedule, "-p", str(ex.p), "-m", str(MICROBATCHES), "-v", str(cand.v),
                      "--profile", str(profile)],
                     work / f"simulate_{Path(cand.schedule).stem}_v{cand.v}_{profile.stem}.log", ex, work, dry, say)
    if dry:
        return float("nan"), cand.placement
    return float(res["makespan"]), schedule_json(ex, cand, work, dry, say).get("placement", {}).get("style", "linear")


def schedule_file(ex: Example, cand: Candidate, work: Path, dry: bool, say) -> Path:
    """`cand` as koala export writes it (a fixed JSON schedule, which keeps its own v and
    placement where it takes turns: keeps_own_shape), cached in the work folder."""
    out = work / f"export_{Path(cand.schedule).stem}_v{cand.v}.json"
    if not out.exists():
        run([str(venv_bin() / "koala"), "export", cand.schedule, "-p", str(ex.p), "-m", str(MICROBATCHES), "-v",
             str(cand.v), "-o", str(out)], out.with_suffix(".log"), ex.env(work), work, dry, say)
    return out


def schedule_json(ex: Example, cand: Candidate, work: Path, dry: bool, say) -> dict:
    """`cand` as koala export writes it (JSON)."""
    return read_json(schedule_file(ex, cand, work, dry, say), dry)


def read_json(path: Path, dry: bool) -> dict:
    """An exported schedule's JSON; {} with --dry-run (nothing was written)."""
    return {} if dry else json.loads(path.read_text(encoding="utf-8"))


def schedule_key(ex: Example, cand: Candidate, work: Path, dry: bool, say) -> str:
    """What makes two schedules the same run: their ranks' actions, placement and backward."""
    d = schedule_json(ex, cand, work, dry, say)
    return json.dumps([d.get("ranks"), d.get("placement", {}).get("stage_ranks"), d.get("backward")])


def default_answer(ex: Example, profiles: dict[int, Path], chosen: list[Candidate], budget: float, work: Path,
                   dry: bool, say) -> str | None:
    """What a user gets from `koala search` with its defaults (--min-gain 5 and the profile's
    spread keeping a known schedule back) on the calibrated profiles, one search per v; another
    v's answer only where it is faster than the first v's by more than --min-gain's default
    (docs/search.md: the same margin between v's as within one; at 2cf472c the faster v's answer
    won by 0.1% and measured 0.908x of 1f1b). The label of the measured candidate it equals;
    where it equals none of them, it joins `chosen` as "default search (placement, v=V)",
    measured like them (what a user would run); None with --dry-run."""
    base = ["-p", str(ex.p), "-m", str(MICROBATCHES)]
    answers = []
    for v, prof in profiles.items():
        out = work / f"default_v{v}.koala"
        run([str(venv_bin() / "koala"), "search", "--profile", str(prof), *base, "-v", str(v), "--quiet",
             "--time-budget", str(budget), "-o", str(out)], work / f"default_v{v}.log", ex.env(work), work, dry, say)
        answers.append(Candidate(f"default (v={v})", str(out), v))
    if dry:
        return None
    for cand in answers:
        cand.predicted_ms, cand.placement = predict(ex, cand, profiles[cand.v], work, dry, say)
    answer = answers[0]
    for cand in answers[1:]:
        if cand.predicted_ms * (1 + DEFAULT_MIN_GAIN_PCT / 100) < answer.predicted_ms:
            answer = cand
    key = schedule_key(ex, answer, work, dry, say)
    label = next((c.label for c in chosen if schedule_key(ex, c, work, dry, say) == key), None)
    if label is None:
        answer.label = label = f"default search ({answer.placement}, v={answer.v})"
        chosen.append(answer)
    return label


def mark_duplicates(ex: Example, chosen: list[Candidate], work: Path, dry: bool, say) -> None:
    """A candidate whose schedule (ranks, placement, backward) equals an earlier one's runs as that one."""
    if dry:
        return
    seen = {}
    for c in chosen:
        k = schedule_key(ex, c, work, dry, say)
        if k in seen:
            c.same_as = seen[k].label
            c.label += f" = {seen[k].schedule}"
        else:
            seen[k] = c


# -- measuring -----------------------------------------------------------------------------------
def read_times(ex: Example, log: Path) -> list[float]:
    """The per-iteration step times (ms) the example wrote: `period_ms` of its --loss-log, from one
    iteration's start to the next's, the step `koala calibrate` fits (the loop's data and logging
    included); `iteration_ms` (the step's own work) where an older example wrote no periods."""
    try:
        record = json.loads(log.read_text(encoding="utf-8"))
        return [float(x) for x in record.get("period_ms") or record["iteration_ms"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"{log}: no iteration times ({exc})") from None


def measure(ex: Example, chosen: list[Candidate], args, work: Path,
            say) -> tuple[dict[str, list[list[float]]], dict[str, list[Path]]]:
    """Per distinct candidate label, the kept iteration times of each round: `args.rounds` rounds,
    each a fresh torchrun of every distinct schedule, the order rotated by one every round; and
    the runs' traces (none with --untraced)."""
    runs = [c for c in chosen if c.same_as is None]
    times: dict[str, list[list[float]]] = {c.label: [] for c in runs}
    traces: dict[str, list[Path]] = {c.label: [] for c in runs}
    for r in range(args.rounds):
        for c in runs[r % len(runs):] + runs[:r % len(runs)]:
            log = work / f"times_round{r}_{runs.index(c)}.json"
            trace = None if args.untraced else work / f"measured_round{r}_{runs.index(c)}.json"
            run(ex.run_cmd(c, args.iterations, log, trace), log.with_suffix(".log"), ex.env(work), ROOT,
                args.dry_run, say)
            if trace is not None:
                traces[c.label].append(trace)
            if not args.dry_run:
                times[c.label].append(read_times(ex, log)[args.warmup:])
    return times, traces


def paired_candidates(chosen: list[Candidate]) -> list[Candidate]:
    """The distinct candidates that take turns with 1f1b in one run (the paired rounds; both
    examples take --alternate-schedules, a schedule of another placement or v on a model copy of
    its own), where there is another beside 1f1b; else none."""
    runs = [c for c in chosen if c.same_as is None]
    return runs if len(runs) > 1 else []


def measure_paired(ex: Example, chosen: list[Candidate], args, work: Path, say) -> dict[str, list[list[float]]]:
    """Per label of `paired_candidates`, the kept step periods of each paired round: one torchrun
    per round in which the schedules take turns, PAIRED_BLOCK iterations each (the first schedule
    rotated every round), so that a drift of the machine within the run hits them alike; kept:
    after the first `args.warmup` iterations, every iteration but the first of its turn. Each
    schedule is given as its exported JSON file (schedule_file), so that it keeps its own v and
    placement whichever schedule comes first."""
    runs = [dataclasses.replace(c, schedule=str(schedule_file(ex, c, work, args.dry_run, say)))
            for c in paired_candidates(chosen)]
    times: dict[str, list[list[float]]] = {c.label: [] for c in runs}
    for r in range(args.paired_rounds if runs else 0):
        order = runs[r % len(runs):] + runs[:r % len(runs)]
        log = work / f"paired_round{r}.json"
        run(ex.run_cmd(order[0], args.paired_iterations, log, alternate=tuple(order[1:]), settle=TURN_SETTLE),
            log.with_suffix(".log"), ex.env(work), ROOT, args.dry_run, say)
        if args.dry_run:
            continue
        kept = kept_periods(read_times(ex, log), read_schedules(log), args.warmup, PAIRED_BLOCK, TURN_SETTLE)
        for c in runs:
            times[c.label].append(kept.get(c.schedule, []))
    return times


def read_schedules(log: Path) -> list[str]:
    """The schedule of each iteration, as the example's --loss-log names it (iteration_schedules)."""
    try:
        return [str(x) for x in json.loads(log.read_text(encoding="utf-8"))["iteration_schedules"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"{log}: no schedule per iteration ({exc})") from None


def recalibrate(ex: Example, chosen: list[Candidate], traces: dict[str, list[Path]], profiles: dict[int, Path],
                args, work: Path, say) -> dict[str, float]:
    """Per candidate label, its step time simulated on the profile `koala calibrate` fits to the
    measured runs' traces of its v (all its schedules; the dropped warm-up iterations skipped),
    from the measured `profiles` (profile_v{v}.json): the model against the same minutes of the
    machine as the measurement."""
    out: dict[str, float] = {}
    for v in sorted({c.v for c in chosen}):
        files = [t for c in chosen if c.v == v and c.same_as is None for t in traces[c.label]]
        if not files:
            continue
        fitted = work / f"recalibrated_v{v}.json"
        run([str(venv_bin() / "koala"), "calibrate", *map(str, files), "--profile", str(profiles[v]),
             "--skip-steps", str(args.warmup), "-o", str(fitted)], work / f"recalibrate_v{v}.log", ex.env(work),
            work, args.dry_run, say)
        for c in (c for c in chosen if c.v == v):
            out[c.label] = predict(ex, c, fitted, work, args.dry_run, say)[0]
    return out


# -- the report ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    example: str
    schedule: str
    v: int
    predicted_ms: float
    measured_ms: float
    round_medians: tuple[float, ...]
    speedup_predicted: float
    speedup_measured: float
    #: per round: 1f1b's median / this schedule's median, both from that round (adjacent runs)
    round_speedups: tuple[float, ...] = ()
    #: simulated on the profile koala calibrate fits to the measured runs' traces (recalibrate())
    recalibrated_ms: float = float("nan")
    #: the paired rounds (measure_paired): 1f1b's median over every round / this schedule's, and
    #: round by round; NaN and () where the schedule did not take turns with 1f1b
    paired_speedup: float = float("nan")
    paired_round_speedups: tuple[float, ...] = ()
    #: koala search with its defaults answers this schedule (default_answer)
    default: bool = False

    @property
    def recalibrated_error(self) -> float:
        return self.measured_ms / self.recalibrated_ms - 1

    @property
    def error(self) -> float:
        return self.measured_ms / self.predicted_ms - 1

    @property
    def speedup_error(self) -> float:
        return self.speedup_measured - self.speedup_predicted

    @property
    def speedup_se(self) -> float | None:
        """The standard error of the rounds' mean speedup (their standard deviation / sqrt(rounds));
        None with fewer than 2 rounds."""
        return _se(self.round_speedups)

    @property
    def paired_error(self) -> float:
        return self.paired_speedup - self.speedup_predicted

    @property
    def paired_se(self) -> float | None:
        return _se(self.paired_round_speedups)


def _se(values: tuple[float, ...]) -> float | None:
    n = len(values)
    return statistics.stdev(values) / n ** 0.5 if n > 1 else None


def _speedups(base: list[list[float]], rounds: list[list[float]]) -> tuple[float, tuple[float, ...]]:
    """(median of every kept time of `base` / that of `rounds`, and the same round by round)."""
    a, b = [x for r in base for x in r], [x for r in rounds for x in r]
    if not a or not b:
        return float("nan"), ()
    return (statistics.median(a) / statistics.median(b),
            tuple(statistics.median(x) / statistics.median(y) for x, y in zip(base, rounds) if x and y))


def rows_of(ex: Example, chosen: list[Candidate], times: dict[str, list[list[float]]],
            recalibrated: dict[str, float] | None = None, paired: dict[str, list[list[float]]] | None = None,
            default: str | None = None) -> list[Row]:
    """One row per candidate; speedups over the 1f1b row (the first): of the medians over every
    round, and round by round (the rounds alternate the schedules, so a round's runs are minutes
    apart at most and a drift of the machine hits them alike); and those of the paired rounds
    (`paired`, measure_paired: the schedules taking turns within one run). `default`: the label of
    the candidate koala search's defaults answer (default_answer)."""
    paired = paired or {}
    base = paired.get(chosen[0].label, [])
    out = []
    for c in chosen:
        rounds = times[c.same_as or c.label]
        kept = [x for r in rounds for x in r]
        out.append(Row(f"{ex.engine} {ex.label} p={ex.p}", c.label, c.v, c.predicted_ms,
                       statistics.median(kept) if kept else float("nan"),
                       tuple(statistics.median(r) for r in rounds if r), 1.0, 1.0,
                       recalibrated_ms=(recalibrated or {}).get(c.label, float("nan")), default=c.label == default))
    one = out[0]
    fresh = [_speedups(times[chosen[0].label], times[c.same_as or c.label]) for c in chosen]
    pairs = [_speedups(base, paired.get(c.same_as or c.label, [])) for c in chosen]
    return [dataclasses.replace(r, speedup_predicted=one.predicted_ms / r.predicted_ms, speedup_measured=f[0],
                                round_speedups=f[1], paired_speedup=pair[0], paired_round_speedups=pair[1])
            for r, f, pair in zip(out, fresh, pairs)]


COLUMNS = ("example", "schedule", "v", "predicted ms", "measured ms", "rounds' medians", "speedup predicted",
           "speedup measured", "rounds' speedups", "their SE", "speedup error", "error", "recalibrated ms",
           "its error", "paired speedup", "paired rounds' speedups", "their SE", "paired error")
#: the issue's targets: a searched schedule's measured speedup within SPEEDUP_TOLERANCE of the
#: predicted one (koala_ds.sim.turn_speedups's, what koala calibrate warns beyond) ...
#: ... and never below this much of 1f1b's speed; after koala calibrate, every schedule's step
#: time within this of the measured one
SEARCHED_FLOOR = 0.98
STEP_TOLERANCE = 0.10


def _range(values: tuple[float, ...], fmt: str) -> str:
    return f"{min(values):{fmt}}-{max(values):{fmt}}" if values else "-"


def _or_dash(value: float, fmt: str) -> str:
    return "-" if value != value else f"{value:{fmt}}"


def format_table(rows: list[Row]) -> str:
    """The rows as a Markdown table (COLUMNS), one line per row."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append(f"| {r.example} | {r.schedule} | {r.v} | {r.predicted_ms:.1f} | {r.measured_ms:.1f} "
                     f"| {_range(r.round_medians, '.1f')} | {r.speedup_predicted:.3f}x | {r.speedup_measured:.3f}x "
                     f"| {_range(r.round_speedups, '.3f')} | {'-' if r.speedup_se is None else f'{r.speedup_se:.3f}'} "
                     f"| {r.speedup_error:+.3f} | {r.error:+.1%} | {_or_dash(r.recalibrated_ms, '.1f')} "
                     f"| {_or_dash(r.recalibrated_error, '+.1%')} | {_or_dash(r.paired_speedup, '.3f')}"
                     f"{'' if r.paired_speedup != r.paired_speedup else 'x'} "
                     f"| {_range(r.paired_round_speedups, '.3f')} "
                     f"| {'-' if r.paired_se is None else f'{r.paired_se:.3f}'} "
                     f"| {_or_dash(r.paired_error, '+.3f')} |")
    return "\n".join(lines)


def verdict(rows: list[Row]) -> list[str]:
    """The targets, row by row of the searched schedules (and of the default search's answer
    where it is none of them): the speedup error within
    SPEEDUP_TOLERANCE, the measured speedup at least SEARCHED_FLOOR; and whether the rounds
    resolve that much (2 standard errors of their speedups within SPEEDUP_TOLERANCE)."""
    out = []
    for example in dict.fromkeys(r.example for r in rows):
        errors = [r.recalibrated_error for r in rows if r.example == example]
        if all(e == e for e in errors):  # no NaN: recalibrated (not --untraced)
            worst = max(errors, key=abs)
            out.append(f"{example}: after koala calibrate on the measured runs' traces, step-time errors "
                       f"{min(errors):+.1%}..{max(errors):+.1%} "
                       f"({'within' if abs(worst) <= STEP_TOLERANCE else 'beyond'} {STEP_TOLERANCE:.0%})")
    for example in dict.fromkeys(r.example for r in rows):
        answer = next((r for r in rows if r.example == example and r.default), None)
        paired = "" if answer is None or answer.paired_speedup != answer.paired_speedup else \
            f", {answer.paired_speedup:.3f}x in the paired rounds"
        out.append(f"{example}: koala search with its defaults (--min-gain {DEFAULT_MIN_GAIN_PCT:g}, the profile's "
                   f"spread) answers " + ("a schedule not measured here" if answer is None else
                                          f"{answer.schedule}: measured {answer.speedup_measured:.3f}x of 1f1b"
                                          f"{paired}"))
    for r in (r for r in rows if r.schedule.startswith(("searched", "default search"))):
        out.append(f"{r.example}, {r.schedule}: "
                   + _target(r.speedup_measured, r.speedup_error, r.round_speedups, "rounds"))
        if r.paired_round_speedups:
            out.append(f"{r.example}, {r.schedule}, paired rounds (taking turns with 1f1b in one run): "
                       + _target(r.paired_speedup, r.paired_error, r.paired_round_speedups, "paired rounds"))
    return out


def _target(speedup: float, error: float, rounds: tuple[float, ...], what: str) -> str:
    """The targets for one measured speedup (its error within SPEEDUP_TOLERANCE, at least
    SEARCHED_FLOOR) and whether its rounds resolve that much (2 standard errors within it)."""
    se = _se(rounds)
    tell = ("one round: no spread to judge it by" if se is None else
            f"the {what}' speedups span {max(rounds) - min(rounds):.3f}, their mean +-{2 * se:.3f} "
            f"(2 standard errors)"
            + ("" if 2 * se <= SPEEDUP_TOLERANCE else ": wider than the target, this run cannot resolve it"))
    return (f"speedup error {error:+.3f} ({'within' if abs(error) <= SPEEDUP_TOLERANCE else 'beyond'} "
            f"{SPEEDUP_TOLERANCE}); measured {speedup:.3f}x of 1f1b "
            f"({'at least' if speedup >= SEARCHED_FLOOR else 'below'} {SEARCHED_FLOOR}x); {tell}")


def machine() -> str:
    """Cores, CPU model and the load average now."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {model}"


def load_average() -> str:
    try:
        return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1, 5, 15 min)"
    except OSError:
        return "load average unknown"


def header(argv: list[str], args) -> list[str]:
    return [f"$ {shlex.join(['python', 'benchmarks/fidelity.py', *argv])}",
            f"machine: {machine()}; {load_average()} before",
            f"started {time.strftime('%Y-%m-%d %H:%M:%S')}; calibration: {args.calib_rounds} traced run(s) in which the "
            f"library schedules take turns of {CALIB_BLOCK} iterations; "
            f"{args.rounds} measured round(s), each a fresh torchrun per schedule, "
            f"{args.iterations} iterations of {MICROBATCHES} microbatches, the first {args.warmup} dropped; "
            f"measured = median of the kept iterations' step periods (--loss-log period_ms, from one iteration's "
            f"start to the next's, as koala calibrate measures a step; Megatron: the last pipeline rank, "
            f"DeepSpeed: rank 0); predicted = koala simulate on the calibrated profile; searched = koala search "
            f"--min-gain 0 --ignore-spread (the model's own pick); "
            + ("measured runs untraced" if args.untraced else
               "measured runs traced; recalibrated = koala simulate on the profile koala calibrate fits to the "
               "measured runs' traces of the schedule's v")
            + f"; paired: {args.paired_rounds} round(s), each one untraced torchrun of {args.paired_iterations} "
              f"iterations in which every distinct schedule takes turns, {PAIRED_BLOCK} iterations each "
              f"(the examples' --alternate-schedules; another v or placement on a model copy of its own; the "
              f"first {args.warmup} iterations and the first {TURN_SETTLE} of each turn dropped)"]


# -- main ----------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", nargs="+", choices=("megatron", "deepspeed"), default=["megatron", "deepspeed"])
    ap.add_argument("--chunks", default=None, help="v values to profile and search, comma-separated (default 1,2; "
                                                   "--quick: 1)")
    ap.add_argument("--rounds", type=int, default=None, help="fresh torchruns per schedule (default 8; --quick: 1)")
    ap.add_argument("--paired-rounds", type=int, default=None,
                    help="torchruns in which the schedules take turns (the example's --alternate-schedules; "
                         "default 6; --quick: 1; 0: none)")
    ap.add_argument("--paired-iterations", type=int, default=None,
                    help="iterations per paired run (default 48; --quick: 20)")
    ap.add_argument("--calib-rounds", type=int, default=None,
                    help="traced calibration runs, in each of which the calibration schedules take turns "
                         "(default 3; --quick: 1)")
    ap.add_argument("--iterations", type=int, default=None, help="iterations per torchrun (default 20; --quick: 8)")
    ap.add_argument("--warmup", type=int, default=None, help="first iterations dropped (default 4; --quick: 3)")
    ap.add_argument("--calib-iterations", type=int, default=None,
                    help=f"iterations per traced calibration run (default 160; --quick: 24), {CALIB_BLOCK} per turn "
                         f"of a schedule; koala calibrate leaves out each schedule's first turn")
    ap.add_argument("--search-budget", type=float, default=None, help="koala search --time-budget S (default 5; "
                                                                      "--quick: 2)")
    ap.add_argument("--quick", action="store_true", help="the examples' default sizes, v = 1, one round")
    ap.add_argument("--untraced", action="store_true",
                    help="measured runs without a trace, and so no calibration on them (recalibrated ms)")
    ap.add_argument("--work", default=None,
                    help="folder for profiles, schedules and logs (default: a new temporary one)")
    ap.add_argument("--out", default=None, help="also write the report to this file (atomically)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the commands; run nothing")
    args = ap.parse_args(argv)
    q = args.quick
    for name, full, quick in (("rounds", 8, 1), ("calib_rounds", 3, 1), ("iterations", 20, 8), ("warmup", 4, 3),
                              ("search_budget", 5.0, 2.0), ("calib_iterations", CALIB_ITERATIONS, 24),
                              ("paired_rounds", 6, 1), ("paired_iterations", 48, 20)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    text = args.chunks or ("1" if q else "1,2")
    try:
        args.chunks = tuple(int(x) for x in text.split(","))
    except ValueError:
        ap.error(f"--chunks {text!r}: expected comma-separated integers, e.g. 1,2")
    if any(v < 1 for v in args.chunks) or 1 not in args.chunks:
        ap.error(f"--chunks {text}: each v >= 1, and 1 among them (1f1b is the baseline)")
    for name in ("rounds", "calib_rounds", "iterations"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    turn = CALIB_BLOCK * sum(len(CALIBRATION_SCHEDULES.get(v, ())) for v in args.chunks)
    if args.calib_iterations < 2 * turn:
        ap.error(f"--calib-iterations {args.calib_iterations} must be at least {2 * turn}: two turns of "
                 f"{CALIB_BLOCK} iterations of each calibration schedule (the first turn is left out)")
    if not 0 <= args.warmup < args.iterations:
        ap.error(f"--warmup {args.warmup} must be >= 0 and below --iterations {args.iterations}")
    if args.paired_rounds < 0:
        ap.error(f"--paired-rounds must be >= 0, got {args.paired_rounds}")
    if args.paired_rounds and args.paired_iterations < args.warmup + 4 * PAIRED_BLOCK:
        ap.error(f"--paired-iterations {args.paired_iterations} must be at least --warmup {args.warmup} + "
                 f"{4 * PAIRED_BLOCK} (two kept turns of two schedules)")
    if not args.search_budget > 0:
        ap.error(f"--search-budget must be > 0 seconds, got {args.search_budget}")
    return args


def bench_one(ex: Example, args, work: Path, say) -> tuple[list[Row], str]:
    """Profile, calibrate, choose and measure one example; its rows and calibration line."""
    say(f"[{ex.engine} {ex.label} p={ex.p}]")
    profiles = {}
    for v in ex.chunks(args.chunks):
        profiles[v] = work / f"profile_v{v}.json"
        run(ex.profile_cmd(v, profiles[v], work, args.quick), work / f"profile_v{v}.log", ex.env(work), work,
            args.dry_run, say)
    measured = dict(profiles)
    profiles, how = calibrate(ex, profiles, args, work, say)
    chosen = choose(ex, profiles, args.search_budget, work, args.dry_run, say)
    default = default_answer(ex, profiles, chosen, args.search_budget, work, args.dry_run, say)
    times, traces = measure(ex, chosen, args, work, say)
    paired = measure_paired(ex, chosen, args, work, say)
    recalibrated = recalibrate(ex, chosen, traces, measured, args, work, say)
    return ([] if args.dry_run else rows_of(ex, chosen, times, recalibrated, paired, default)), how


def refuse_out(out: str | None, script: str) -> bool:
    """Whether `out` (--out) cannot be written: then one line on stderr naming `script`; checked
    before anything runs."""
    if not out:
        return False
    from koala_ds.core.outputs import OutputError, check_output

    try:
        check_output(out, "--out")
    except OutputError as exc:
        print(f"{script}: {exc}", file=sys.stderr)
        return True
    return False


def add_round_args(ap: argparse.ArgumentParser, rounds: int, iterations: str, warmup: str) -> None:
    """The arguments of a benchmark of rounds of turns (turns_bias.py, beside_pipeline.py): --rounds
    (default `rounds`), --iterations and --warmup (their help `iterations`, `warmup`), --block,
    --work, --out, --dry-run; `check_round_args` checks them."""
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--iterations", type=int, default=48, help=iterations)
    ap.add_argument("--block", type=int, default=4, help="iterations of a turn (default 4)")
    ap.add_argument("--warmup", type=int, default=8, help=warmup)
    ap.add_argument("--work", default=None, help="folder for the runs' files (default a new temporary one)")
    ap.add_argument("--out", default=None, help="also write the report to this file")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")


def check_round_args(ap: argparse.ArgumentParser, args) -> None:
    """--rounds, --iterations and --block at least 1; --warmup below --iterations (ap.error)."""
    for name in ("rounds", "iterations", "block"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if args.warmup < 0 or args.warmup >= args.iterations:
        ap.error("--warmup must be at least 0 and below --iterations")


def work_folder(args, prefix: str) -> Path:
    """The runs' folder of a benchmark with --work / --dry-run: --work, else a new temporary one
    (with --dry-run a name only: nothing is made)."""
    if args.work:
        return Path(args.work)
    return Path(tempfile.gettempdir()) / f"{prefix}DRYRUN" if args.dry_run else Path(tempfile.mkdtemp(prefix=prefix))


def report_head(script: str, argv: list[str]) -> list[str]:
    """A report's first lines: the command, the machine and when it started."""
    return [f"$ python benchmarks/{script} {' '.join(argv)}".rstrip(),
            f"machine: {machine()}; {load_average()} before; started {time.strftime('%Y-%m-%d %H:%M:%S')}"]


def end_report(head: list[str], lines: list[str], work: Path, out: str | None) -> int:
    """Print the report's `lines` and when it finished; with `out` (--out), write the whole report there."""
    lines = lines + [f"finished {time.strftime('%H:%M:%S')}; {load_average()} after; work folder {work}"]
    print("\n".join(lines), flush=True)
    if out:
        from koala_ds.core.outputs import atomic_write

        atomic_write(out, "\n".join(head + [""] + lines) + "\n", "--out")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if refuse_out(args.out, "fidelity.py"):
        return 2
    lines = header(argv, args)
    print("\n".join(lines), flush=True)
    work_root = work_folder(args, "koala-fidelity-")  # with --dry-run a name only: nothing is made
    rows, calibrations = [], []
    try:
        for ex in plan(args):
            work = work_root / f"{ex.engine}-{ex.label}-p{ex.p}"
            if not args.dry_run:
                work.mkdir(parents=True, exist_ok=True)
            got, how = bench_one(ex, args, work, lambda s: print(s, file=sys.stderr, flush=True))
            rows += got
            calibrations.append(f"{ex.engine} {ex.label} p={ex.p}: {how}")
    except BenchError as exc:
        print(f"fidelity.py: {exc}", file=sys.stderr)
        return 1
    lines += [f"calibration: {c}" for c in calibrations]
    lines += ["", format_table(rows), "", *verdict(rows), "",
              f"finished {time.strftime('%H:%M:%S')}; {load_average()} after; work folder {work_root}"]
    report = "\n".join(lines[len(header(argv, args)):])
    print(report, flush=True)
    if args.out and not args.dry_run:
        from koala_ds.core.outputs import atomic_write

        atomic_write(args.out, "\n".join(lines) + "\n", "--out")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
