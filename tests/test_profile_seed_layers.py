"""`koala profile deepspeed` runs a stage's layers as DeepSpeed's PipelineModule runs them, the
per-layer reseed of `seed_layers=True` included (koala_ds.profiler.models.LayerSeeding): host time
in every forward that the layers alone do not show (on the CPU more than the DeepSpeed example's
layers' compute)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
D = 8


@pytest.fixture()
def seeds(monkeypatch):
    """The seeds DeepSpeed's set_random_seed is called with, in order."""
    pytest.importorskip("deepspeed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime import utils as ds_utils

    calls: list[int] = []
    monkeypatch.setattr(ds_utils, "set_random_seed", calls.append)
    return calls


def _layers(n: int) -> list:
    return [torch.nn.Linear(D, D) for _ in range(n)]


def _deepspeed_forward_seeds(funcs: list, local_start: int, forwards: int, seeds: list, **module) -> list[int]:
    """The seeds DeepSpeed's own PipelineModule.forward sets running `funcs` (a stage's layers from
    layer `local_start`) `forwards` times: its code, on an object with the attributes it reads."""
    from deepspeed.runtime.pipe.module import PipelineModule

    fake = SimpleNamespace(forward_funcs=funcs, _local_start=local_start, micro_offset=0, seed_layers=True,
                           base_seed=module.get("base_seed", 1234), seed_fn=module.get("seed_fn"),
                           activation_checkpoint_interval=0, curr_layer=0)
    del seeds[:]
    for _ in range(forwards):
        PipelineModule.forward(fake, torch.randn(2, D))
    got = list(seeds)
    del seeds[:]
    return got


def test_a_stage_reseeds_before_each_layer_with_deepspeeds_seeds(seeds):
    from koala_ds.profiler.models import pipeline_module_stages

    layers = _layers(5)
    stages = pipeline_module_stages(layers, 2, "uniform", seed_layers=True)
    for stage, start in zip(stages, (0, len(stages[0].funcs))):
        want = _deepspeed_forward_seeds(stage.funcs, start, 3, seeds)
        for _ in range(3):
            stage(torch.randn(2, D))
        assert seeds == want and len(want) == 3 * len(stage.funcs)
        del seeds[:]


def test_without_seed_layers_a_stage_does_not_reseed(seeds):
    from koala_ds.profiler.models import pipeline_module_stages

    for flag in (None, False):
        stage = pipeline_module_stages(_layers(4), 2, "uniform", seed_layers=flag)[1]
        stage(torch.randn(2, D))
    assert seeds == []


def test_a_pipeline_modules_own_seeding_counts():
    """A PipelineModule's seed_layers, base_seed and seed_fn, whatever the flag says."""
    from koala_ds.profiler.models import LayerSeeding

    fn = [].append
    own = SimpleNamespace(seed_layers=True, base_seed=7, seed_fn=fn)
    assert LayerSeeding.of(own) == LayerSeeding(7, fn) == LayerSeeding.of(own, seed_layers=False)
    assert LayerSeeding.of(SimpleNamespace(seed_layers=False, base_seed=7, seed_fn=None), seed_layers=True) is None
    assert LayerSeeding.of([], seed_layers=True) == LayerSeeding() and LayerSeeding.of([]) is None


def test_the_seed_fn_is_called_with_deepspeeds_seeds(seeds):
    from koala_ds.profiler.models import LayerSeeding, _Layers

    got: list[int] = []
    funcs = _layers(2)
    stage = _Layers(funcs, LayerSeeding(11, got.append), first_layer=4)
    stage(torch.randn(2, D))
    stage(torch.randn(2, D))
    want: list[int] = []
    _deepspeed_forward_seeds(funcs, 4, 2, seeds, base_seed=11, seed_fn=want.append)
    assert got == want == [11 * 2 + 4, 11 * 2 + 5, 11 * 3 + 4, 11 * 3 + 5] and seeds == []


def test_profile_and_per_layer_profile_pass_seed_layers_on(seeds):
    """Both profilers' forwards reseed (the timed F includes it)."""
    from koala_ds.profiler.models import profile_pipeline_module, profile_pipeline_module_layers

    profile_pipeline_module(_layers(4), torch.randn(2, D), 2, partition_method="uniform", seed_layers=True,
                            warmup=0, iters=2, p2p=False)
    assert len(seeds) > 0 and len(seeds) % 2 == 0
    del seeds[:]
    profile_pipeline_module_layers(_layers(3), torch.randn(2, D), seed_layers=True, warmup=0, iters=2, p2p=False)
    assert {s % 1234 for s in seeds} == {0, 1, 2}


PIPELINE_MODULE = '''
import os
import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule

def module(seed_layers):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["TEST_PORT"], RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    return PipelineModule([LayerSpec(torch.nn.Linear, 8, 8) for _ in range(4)], num_stages=1,
                          partition_method="uniform", seed_layers=seed_layers)

def seeded():
    return module(True)

def unseeded():
    return module(False)

def sample():
    return torch.randn(2, 8)
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("func,flag,ok", [("seeded", [], True), ("unseeded", ["--seed-layers"], False)])
def test_cli_takes_a_pipeline_modules_seeding_and_refuses_a_contradicting_flag(tmp_path, func, flag, ok):
    pytest.importorskip("deepspeed")
    from deepspeed_jobs import extensions_dir

    from koala_ds.runtime.spawn import free_port

    (tmp_path / "pm.py").write_text(PIPELINE_MODULE)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), DS_ACCELERATOR="cpu", TEST_PORT=str(free_port()),
               TORCH_EXTENSIONS_DIR=str(extensions_dir()))
    koala = str(Path(sys.executable).parent / "koala")
    res = subprocess.run([koala, "profile", "deepspeed", "--layers", f"pm:{func}", "--input", "pm:sample", "-p", "2",
                          "--p2p-latency", "0.1", "--warmup", "1", "--iters", "2", "-o", str(tmp_path / "p.json"),
                          *flag], capture_output=True, text=True, timeout=280, cwd=tmp_path, env=env)
    if ok:
        assert res.returncode == 0, res.stderr[-2000:]
        assert (tmp_path / "p.json").exists()
    else:
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert "--seed-layers" in lines[-1] and "seed_layers=False" in lines[-1], lines
        assert not (tmp_path / "p.json").exists()
