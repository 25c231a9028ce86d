"""Small multi-process DeepSpeed jobs on CPU, shared by the tests and the benchmarks (a test
harness: it lives in tests/, not in the installed koala_ds package; benchmarks put tests/ on
sys.path, and spawned workers find it on the parent's sys.path).

`launch(worker, world_size, spec)` starts `world_size` spawned processes with the environment
DeepSpeed needs on CPU (DS_ACCELERATOR=cpu, RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT, TORCH_EXTENSIONS_DIR in this checkout's .cache), initialises gloo, runs
`worker(rank, world_size, spec)` in each, and returns the per-rank results. Every launch has
a deadline; processes still running after it (or after a rank failed) are killed.

`build_cpu_extension()` builds DeepSpeed's CPU communication extension (deepspeed_shm_comm, a
JIT-compiled C++ op every DeepSpeed process loads on CPU) once, in one child process with its own
deadline, before any multi-process job needs it (tests/conftest.py does this per test session);
`clear_stale_locks()` removes the build lock a killed build left behind, which would otherwise
make every later DeepSpeed process wait on it forever. `launch()` clears such locks too.

`tiny_layers()` builds the layer list of a small pipeline model (linear blocks, optionally a
weight tied between the first and the last layer) with a deterministic initialisation that
does not depend on how the layers are partitioned.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import torch

from koala_ds.runtime.spawn import SpawnError, launch as spawn_launch
from rank_processes import PRELOAD

logger = logging.getLogger(__name__)

_REPO = Path(__file__).resolve().parents[1]  # the checkout (this file is tests/deepspeed_jobs.py)
DEFAULT_EXTENSIONS_DIR = _REPO / ".cache" / "torch_extensions"
SHM_COMM = "deepspeed_shm_comm"  # DeepSpeed's CPU shared-memory communication op
BUILD_TIMEOUT_S = 900.0  # the first build: 1-3 minutes on 2 cores (143 s measured on a busy machine)


LaunchError = SpawnError  # a worker failed or the launch ran past its deadline


class ExtensionBuildError(RuntimeError):
    """DeepSpeed's CPU extension could not be built (failed, or ran past its deadline)."""


def extensions_dir() -> Path:
    """Where DeepSpeed's JIT extensions are built: $TORCH_EXTENSIONS_DIR, else this checkout's
    .cache/torch_extensions (never the user's home or an installed package's directory)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or DEFAULT_EXTENSIONS_DIR)


def lock_holders(path: str | os.PathLike) -> list[int] | None:
    """Ids of the processes that have `path` open, or None where that cannot be told (no /proc).

    torch's build lock keeps the `lock` file open while it is held: in torch 2.13 a
    torch.utils.file_baton.FileBaton, from the moment it creates the file until just before it
    removes it; in torch 2.15 a filelock.FileLock (an flock on the file, which stays in place
    after), until it unlocks it. An open descriptor is its owner."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    target = os.path.realpath(path)
    holders = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # gone, or another user's process
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    holders.append(int(entry.name))
                    break
            except OSError:
                continue
    return holders


def clear_stale_locks(ext_dir: str | os.PathLike | None = None, grace_s: float = 0.5) -> list[Path]:
    """Remove each `<ext_dir>/<extension>/lock` that no process holds open (its owner was killed
    mid-build); return the removed paths. A lock with a live owner is left alone, and so is every
    lock where owners cannot be seen (no /proc).

    In torch 2.13 the file's existence is the lock: one left behind makes every later build or
    load wait forever. torch 2.15 flocks it instead (the kernel drops an flock whose owner dies)
    and leaves the file in place after every build, so there an unheld file is free, and removing
    it is harmless. It is still removed: the extensions dir is the checkout's, whichever torch runs
    the tests, and a file torch 2.15 left would make a torch 2.13 process wait on it forever."""
    root = Path(ext_dir) if ext_dir is not None else extensions_dir()
    candidates = [lock for lock in root.glob("*/lock") if lock_holders(lock) == []]
    if not candidates:
        return []
    time.sleep(grace_s)  # a releasing owner closes the file just before it removes it
    removed = []
    for lock in candidates:
        if lock.exists() and lock_holders(lock) == []:
            try:
                lock.unlink()
            except FileNotFoundError:
                continue
            logger.warning("removed the stale build lock %s (the process that created it is gone)", lock)
            removed.append(lock)
    return removed


_BUILD_CODE = ("import importlib, sys; "  # `import deepspeed.comm.torch as t` would give torch itself
               "t = importlib.import_module('deepspeed.comm.torch'); "
               "sys.exit(0 if t.build_shm_op() is not None else 3)")


def build_cpu_extension(ext_dir: str | os.PathLike | None = None, timeout_s: float = BUILD_TIMEOUT_S) -> float:
    """Build DeepSpeed's CPU communication extension (deepspeed_shm_comm) into `ext_dir`, or check
    that it is built, in ONE child process with a deadline; return the seconds it took.

    DeepSpeed builds it on first use in every process that initialises its communication on CPU;
    several workers doing that at once, under a short job deadline, is how a killed build leaves a
    stale lock. Stale locks are cleared first; a build past `timeout_s` is killed (with its
    compiler processes), its lock removed, and `ExtensionBuildError` raised with one line."""
    root = Path(ext_dir) if ext_dir is not None else extensions_dir()
    root.mkdir(parents=True, exist_ok=True)
    clear_stale_locks(root)
    log_path = root / f"{SHM_COMM}-build.log"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(root), "PYTHONUNBUFFERED": "1"}
    what = f"DeepSpeed's CPU communication extension {SHM_COMM} (into {root})"
    start = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen([sys.executable, "-c", _BUILD_CODE], env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:  # the child ran in a session of its own: end what is left of it, compilers included
            if proc.poll() is None:
                proc.kill()
            _kill_session(proc.pid)
            proc.wait(timeout=30)
    seconds = time.monotonic() - start
    if code is None:
        clear_stale_locks(root)
        raise ExtensionBuildError(f"building {what} ran past its deadline of {timeout_s:.0f} s; log: {log_path}")
    if code == 3:
        raise ExtensionBuildError(f"DeepSpeed reports {SHM_COMM} as not compatible with this machine; log: {log_path}")
    if code != 0:
        raise ExtensionBuildError(f"building {what} failed (exit {code}): {_last_error_line(log_path)}; "
                                  f"log: {log_path}")
    logger.info("%s ready in %.1f s", what, seconds)
    return seconds


def _kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid`. ninja starts each compiler in a process group of
    its own, so killing the child's group would leave them compiling into the build dir."""
    victims = set()
    proc = Path("/proc")
    if proc.is_dir():
        for entry in proc.iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                fields = stat[stat.rfind(")") + 2:].split()  # state ppid pgrp session ...
                if len(fields) > 3 and int(fields[3]) == sid:
                    victims.add(int(entry.name))
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _last_error_line(log_path: Path) -> str:
    lines = [line.strip() for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines()
             if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error:" in line:
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def launch(worker: Callable | str, world_size: int, spec: Any = None, timeout_s: float = 240.0,
           pg_timeout_s: float = 120.0, allow_failures: bool = False,
           wait_ranks: list[int] | None = None) -> list[dict]:
    """Run `worker(rank, world_size, spec)` in `world_size` processes with DeepSpeed's CPU
    environment; return each rank's result dict (see `koala_ds.runtime.spawn.launch`)."""
    ext_dir = extensions_dir()
    clear_stale_locks(ext_dir)  # else every worker would wait on a lock a killed process left
    env = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(ext_dir)}
    return spawn_launch(worker, world_size, spec, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s, init="deepspeed",
                        env=env, allow_failures=allow_failures, wait_ranks=wait_ranks, preload=PRELOAD)


# -- a tiny model --------------------------------------------------------------------------
class Block(torch.nn.Module):
    """Linear + tanh: the repeated layer of the tiny test model."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def tiny_layers(dim: int = 16, blocks: int = 8, tied: bool = False, seed: int = 1234) -> list:
    """Layer list: [tied Linear] + `blocks` x Block + [the same tied Linear]. Every layer is
    initialised from `seed` and its index, so any partition gives the same weights.

    The tied Linear has no bias: DeepSpeed ties only `tied_weight_attr` ("weight") across
    ranks, while a V-shape placement puts both uses on rank 0, sharing the whole module."""
    from deepspeed.pipe import TiedLayerSpec

    layers: list = []
    if tied:
        layers.append(TiedLayerSpec("embed", torch.nn.Linear, dim, dim, bias=False))
    for i in range(blocks):
        torch.manual_seed(seed + i)
        layers.append(Block(dim))
    if tied:
        layers.append(TiedLayerSpec("embed", torch.nn.Linear, dim, dim, bias=False))
    return layers


def tiny_batches(steps: int, micro_batches: int, micro_batch_size: int, dim: int, dp_rank: int,
                 seed: int = 7, target_scale: float = 1.0) -> list:
    """steps x micro_batches (input, target) pairs for one data-parallel rank; targets are
    scaled by `target_scale` (large targets give gradient norms that clipping acts on)."""

    gen = torch.Generator().manual_seed(seed * 1000 + dp_rank)
    return [(torch.randn(micro_batch_size, dim, generator=gen),
             torch.randn(micro_batch_size, dim, generator=gen) * target_scale)
            for _ in range(steps * micro_batches)]


def ds_config(micro_batches: int, micro_batch_size: int, dp: int, koala: dict | None = None,
              schedule: str | None = None, gradient_clipping: float | None = None, bf16: bool = False) -> dict:
    """A DeepSpeed config for the tiny model; `gradient_clipping` None keeps DeepSpeed's default (1.0);
    `bf16`: bf16 parameters and activations with DeepSpeed's bf16 optimizer (fp32 master weights)."""
    config = {"train_micro_batch_size_per_gpu": micro_batch_size,
              "gradient_accumulation_steps": micro_batches,
              "train_batch_size": micro_batch_size * micro_batches * dp,
              "steps_per_print": 10 ** 9,
              "wall_clock_breakdown": False,
              "pipeline": {"pipe_partitioned": False, "grad_partitioned": False}}
    if gradient_clipping is not None:
        config["gradient_clipping"] = gradient_clipping
    if schedule is not None:
        config["pipeline"]["schedule"] = schedule
    if koala is not None:
        config["pipeline"]["koala"] = koala
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


# -- workers -------------------------------------------------------------------------------
def _mse(outputs, labels):
    return torch.nn.functional.mse_loss(outputs, labels)


def build_model(pp: int, dim: int, blocks: int, tied: bool, chunks: int = 1, placement: str = "linear",
                parts: list | None = None, config: dict | None = None, checkpoint_interval: int = 0, mp: int = 1):
    """A PipelineModule (chunks == 1, no parts, no config) or a KoalaPipelineModule over `tiny_layers`
    (`parts`: a given cut; `config`: the DeepSpeed config whose pipeline.koala.parts gives it;
    `checkpoint_interval`: the module's activation_checkpoint_interval; `mp` > 1: a pipe x model x
    data topology with `mp` model-parallel ranks, each holding the whole (replicated) layers)."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from koala_ds.deepspeed.module import KoalaPipelineModule

    layers = tiny_layers(dim, blocks, tied)
    stages = {"num_stages": pp}
    if mp > 1:
        import torch.distributed as dist

        stages = {"topology": PipeModelDataParallelTopology(num_pp=pp, num_mp=mp,
                                                            num_dp=dist.get_world_size() // (pp * mp))}
    common = dict(**stages, loss_fn=_mse, partition_method="uniform", seed_layers=True,
                  activation_checkpoint_interval=checkpoint_interval)
    if chunks == 1 and placement == "linear" and parts is None and config is None:
        return PipelineModule(layers, **common)
    return KoalaPipelineModule(layers, chunks=chunks, placement=placement, parts=parts, config=config, **common)


def _engine(model, case: dict, config: dict):
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    from koala_ds.deepspeed.engine import KoalaPipelineEngine

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if case.get("via") == "direct":
        return KoalaPipelineEngine(args=None, model=model, optimizer=optimizer, model_parameters=None,
                                   training_data=None, lr_scheduler=None, mpu=model.mpu(), dist_init_required=None,
                                   collate_fn=None, config=config, config_class=DeepSpeedConfig(config, model.mpu()),
                                   koala_schedule=case["schedule"])
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def case_engine(case: dict, spec: dict, dp: int):
    """(model, engine) for one case of `train_worker` on the tiny model of `spec` ("pp", "gas",
    "mbs", "dim", "blocks") with `dp` data-parallel replicas."""
    gas, mbs = spec["gas"], spec["mbs"]
    koala = None
    if case.get("schedule") is not None and case.get("via", "config") == "config":
        koala = {"schedule": case["schedule"], **case.get("koala", {})}
    config = ds_config(gas, mbs, dp, koala=koala, schedule="koala" if koala is not None else None,
                       gradient_clipping=case.get("clip"), bf16=case.get("bf16", False))
    if case.get("partitioned"):  # the tensors sent between stages split over the model-parallel ranks
        config["pipeline"].update(pipe_partitioned=True, grad_partitioned=True)
    if case.get("zero"):  # DeepSpeed's zero_optimization section; the tests' optimizer is torch's SGD
        config["zero_optimization"] = case["zero"]
        config["zero_allow_untested_optimizer"] = True
    model = build_model(spec["pp"], spec["dim"], spec["blocks"], case.get("tied", False), case.get("chunks", 1),
                        case.get("placement", "linear"), case.get("parts"),
                        config if case.get("module_config") else None, case.get("checkpoint_interval", 0),
                        spec.get("mp", 1))
    if case.get("aux") is not None:  # the module's additional losses (an MoE auxiliary loss, say)
        model.get_additional_losses = lambda: OrderedDict(aux=torch.tensor(case["aux"]), z=torch.tensor(2.0))
    return model, _engine(model, case, config)


def case_batches(case: dict, spec: dict, steps: int, dp_rank: int) -> list:
    """`steps` steps of microbatches for one data-parallel rank (spec["target_scale"] scales the
    targets); bf16 tensors for a bf16 case (DeepSpeed feeds the batch as given)."""
    data = tiny_batches(steps, spec["gas"], spec["mbs"], spec["dim"], dp_rank, target_scale=spec.get("target_scale", 1.0))
    if case.get("bf16"):
        data = [(x.bfloat16(), y.bfloat16()) for x, y in data]
    return data


def _weights(model) -> dict:
    return {n: q.detach().clone() for n, q in model.named_parameters()}


def train_worker(rank: int, world: int, spec: dict) -> dict:
    """Train each case of `spec["cases"]` for spec["steps"] steps on fresh model copies.

    A case: {"label", "schedule" (None = DeepSpeed's stock TrainSchedule), "chunks", "placement",
    "tied", "via" ("config" | "direct"), "koala": extra pipeline.koala keys, "clip": gradient_clipping
    (absent: DeepSpeed's default), "parts": the module's cut (KoalaPipelineModule(parts=...)),
    "module_config": build the module with config= (its pipeline.koala.parts), "aux": the value of the
    module's additional loss 'aux' (get_additional_losses, beside 'z' = 2), "bf16", "zero": the
    config's zero_optimization section, "checkpoint_interval": the module's
    activation_checkpoint_interval, "partitioned": pipe_partitioned and grad_partitioned on}; spec["mp"]:
    model-parallel ranks per stage. Returns per case the engine's and its optimizer's class names,
    the module's checkpoint interval, the step losses, an eval_batch loss, the final parameters,
    the step times (seconds), the message kinds the Koala engine sends as model-parallel shares and
    the additional losses of the last step (engine.agg_additional_losses).
    spec["target_scale"] scales the targets (see `tiny_batches`)."""
    import koala_ds.deepspeed  # noqa: F401  (registers the engine with deepspeed.initialize)

    gas, steps = spec["gas"], spec["steps"]
    out: dict[str, Any] = {"cases": {}}
    for case in spec["cases"]:
        model, engine = case_engine(case, spec, world // (spec["pp"] * spec.get("mp", 1)))
        dp_rank = model._grid.data_parallel_id
        out["dp"], out["pipe"] = dp_rank, model._grid.get_stage_id()
        out["mp"] = (model._grid.get_slice_parallel_rank(), model._grid.get_slice_parallel_world_size())
        data = case_batches(case, spec, steps + 1, dp_rank)
        losses, times = [], []
        for step in range(steps):
            start = time.perf_counter()
            loss = engine.train_batch(iter(data[step * gas:(step + 1) * gas]))
            times.append(time.perf_counter() - start)
            losses.append(float(loss))
        eval_loss = None
        if spec.get("eval", True):
            eval_loss = float(engine.eval_batch(iter(data[steps * gas:(steps + 1) * gas])))
        out["cases"][case["label"]] = {
            "engine": type(engine).__name__, "optimizer": type(engine.optimizer).__name__,
            "checkpoint_interval": engine.module.activation_checkpoint_interval, "losses": losses,
            "eval": eval_loss, "times": times, "split": sorted(getattr(engine, "_split_kinds", ())),
            "params": _weights(model) if spec.get("params", True) else {},
            "additional": {k: float(x) for k, x in (engine.agg_additional_losses or {}).items()},
        }
        if hasattr(engine, "close_trace"):  # "pipeline.koala.trace": end the file (workers leave by os._exit)
            engine.close_trace()
        del engine, model
    return out


def checkpoint_worker(rank: int, world: int, spec: dict) -> dict:
    """Save and resume through DeepSpeed checkpoints: case spec["save"] (a `train_worker` case)
    trains 2 steps and saves to spec["dir"]; case spec["load"] (a fresh model) loads it with
    spec["load_kwargs"] (keywords of load_checkpoint) and trains steps 3-4; also case "save"
    trained 4 steps straight. Returns the losses of both runs and this rank's weights as saved,
    as loaded, after the resumed steps and after the straight run, or the error the load raised
    (its class name and text)."""
    import koala_ds.deepspeed  # noqa: F401  (registers the engine with deepspeed.initialize)

    gas = spec["gas"]
    data = case_batches(spec["save"], spec, 4, 0)

    def train(engine, steps) -> list:
        return [float(engine.train_batch(iter(data[s * gas:(s + 1) * gas]))) for s in steps]

    model, engine = case_engine(spec["save"], spec, 1)
    straight, straight_trained = train(engine, range(4)), _weights(model)
    model, engine = case_engine(spec["save"], spec, 1)
    resumed = train(engine, range(2))
    engine.save_checkpoint(spec["dir"], tag="t")
    saved = _weights(model)
    model, engine = case_engine(spec["load"], spec, 1)
    try:
        engine.load_checkpoint(spec["dir"], tag="t", **spec["load_kwargs"])
    except Exception as exc:  # noqa: BLE001  (reported to the test)
        return {"error": type(exc).__name__, "text": str(exc)}
    loaded = _weights(model)
    resumed += train(engine, range(2, 4))
    return {"straight": straight, "resumed": resumed, "saved": saved, "loaded": loaded, "trained": _weights(model),
            "straight_trained": straight_trained}


def _stop_before(engine, method: str) -> None:
    """Make this process SIGSTOP itself when `engine.<method>` is next called (a peer that
    stops mid-step, after its point-to-point work)."""
    import signal

    original = getattr(engine, method)

    def stop_then_call(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGSTOP)
        return original(*args, **kwargs)

    object.__setattr__(engine, method, stop_then_call)


def hang_worker(rank: int, world: int, spec: dict) -> dict:
    """Rank `spec["hung_rank"]` stops answering; the others must time out.

    spec["mode"]: "hang" (sleeps after set-up), "kill" (exits after set-up) or "stop" (SIGSTOPs
    itself inside the step, just before `engine.<spec["stop_before"]>`, e.g. DeepSpeed's
    end-of-step loss broadcast `_aggregate_total_loss` or the clipping `clip_fp32_gradients`)."""
    import koala_ds.deepspeed  # noqa: F401

    from koala_ds.deepspeed import PipelineTimeoutError

    from koala_ds.deepspeed import KoalaConfigError

    pp, gas, mbs, dim = spec["pp"], spec["gas"], spec["mbs"], spec["dim"]
    refused = None
    if spec.get("mismatch") is not None:  # must fail before any communication, leaving the group usable
        model = build_model(pp, dim, 4, False)
        try:
            _engine(model, {}, ds_config(gas, mbs, world // pp, koala={"schedule": spec["mismatch"]}, schedule="koala"))
        except KoalaConfigError as exc:
            refused = str(exc)
    model = build_model(pp, dim, 4, False)
    config = ds_config(gas, mbs, world // pp, koala={"schedule": spec["schedule"], "timeout_s": spec["timeout_s"]},
                       schedule="koala")
    engine = _engine(model, {}, config)
    if rank == spec["hung_rank"]:
        if spec.get("mode") == "kill":
            os._exit(3)
        if spec.get("mode") == "stop":
            _stop_before(engine, spec["stop_before"])
        else:
            time.sleep(3600)
    start = time.perf_counter()
    try:
        engine.train_batch(iter(tiny_batches(1, gas, mbs, dim, 0, target_scale=spec.get("target_scale", 1.0))))
    except PipelineTimeoutError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "elapsed": time.perf_counter() - start,
                "refused": refused, "raised_at": time.time()}
    return {"error": None, "elapsed": time.perf_counter() - start, "refused": refused}


def save_hang_worker(rank: int, world: int, spec: dict) -> dict:
    """Rank 0 SIGSTOPs itself in save_checkpoint where it writes koala_layout.json, after
    DeepSpeed's own save: the other ranks wait for it at the save's last barrier and must raise
    PipelineTimeoutError within timeout_s (the barrier used to wait the process-group timeout)."""
    import signal

    import koala_ds.deepspeed  # noqa: F401
    import koala_ds.deepspeed.checkpoint as koala_checkpoint
    from koala_ds.deepspeed import PipelineTimeoutError

    model = build_model(spec["pp"], spec["dim"], 4, False)
    config = ds_config(spec["gas"], spec["mbs"], world // spec["pp"],
                       koala={"schedule": "1f1b", "timeout_s": spec["timeout_s"]}, schedule="koala")
    engine = _engine(model, {}, config)
    if rank == 0:
        koala_checkpoint.write_layout = lambda *_: os.kill(os.getpid(), signal.SIGSTOP)
    start = time.perf_counter()
    try:
        engine.save_checkpoint(spec["dir"], tag="t")
    except PipelineTimeoutError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "elapsed": time.perf_counter() - start}
    return {"error": None, "elapsed": time.perf_counter() - start}


def allreduce_worker(rank: int, world: int, spec: dict) -> float | list:
    """One allreduce through deepspeed.comm (DeepSpeed's CPU shared-memory path): its result, or
    with spec["port"] [result, the job's MASTER_PORT] (its shared-memory buffers are named by it)."""
    from deepspeed import comm as dist

    t = torch.ones(spec.get("size", 4))
    dist.all_reduce(t)
    return [float(t[0]), os.environ["MASTER_PORT"]] if spec.get("port") else float(t[0])


def switch_worker(rank: int, world: int, spec: dict) -> dict:
    """One engine, schedules taking turns (set_koala_schedule): per step the loss and whether the
    forwards ran plain (koala_ds.runtime.wgrad's flag, seen by a hook on the module); the losses of
    an engine that ran spec["first"] throughout; and what set_koala_schedule said of spec["misfit"]."""
    import koala_ds.deepspeed  # noqa: F401  (registers the engine with deepspeed.initialize)
    from koala_ds.core.ir import KoalaError
    from koala_ds.runtime import wgrad

    gas, steps = spec["gas"], len(spec["turns"])
    out: dict[str, Any] = {}
    for label, turns in (("turns", spec["turns"]), ("one", [spec["first"]] * steps)):
        model, engine = case_engine({"schedule": spec["first"]}, spec, 1)
        plain: list[bool] = []
        model.register_forward_pre_hook(lambda *_: plain.append(wgrad._PLAIN_FORWARD))
        data = case_batches({}, spec, steps, model._grid.data_parallel_id)
        losses, plains, names = [], [], []
        for step, name in enumerate(turns):
            names.append(engine.set_koala_schedule(name).name)
            plain.clear()
            losses.append(float(engine.train_batch(iter(data[step * gas:(step + 1) * gas]))))
            plains.append(sorted(set(plain)))
        out[label] = {"losses": losses, "plain": plains, "names": names}
        if label == "turns":
            try:
                engine.set_koala_schedule(spec["misfit"])
            except KoalaError as exc:
                out["misfit"] = str(exc)
        del engine, model
    return out
