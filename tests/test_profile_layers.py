"""The per-layer profile (koala profile ... --per-layer): one entry per layer, the format of
/work/notes/layer_profile.md (docs/profiling.md, "Per-layer profile"), and sums that agree with
a per-stage profile of the same model: memory exactly (up to tensors that several layers share,
counted once per layer); times in form and meaning only (every step timed each round, and a cut's
stage costs the sums of its layers' entries), never in magnitude: two separate wall-clock
measurements on a shared CPU can differ by any factor."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from koala_ds.profiler.layers import KINDS, stage_shaped  # noqa: E402
from koala_ds.sim import CostProfile  # noqa: E402

STAGE_FIELDS = ("forward", "backward_input", "backward_weight", "backward", "activation_mb", "w_hold_mb")
TIME_FIELDS = ("forward", "backward_input", "backward_weight", "backward_full")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def check_format(data: dict, kinds: list[str]) -> None:
    """What the spec asks of a per-layer profile file."""
    assert data["version"] == 1 and "stages" not in data and isinstance(data["layers"], list)
    assert [layer["kind"] for layer in data["layers"]] == kinds
    names = [layer["name"] for layer in data["layers"]]
    assert len(set(names)) == len(names)
    for layer in data["layers"]:
        assert layer["kind"] in KINDS
        for key in STAGE_FIELDS + ("output_mb", "param_mb"):
            assert isinstance(layer[key], (int, float)) and layer[key] >= 0, (layer["name"], key)
        assert layer["w_hold_mb"] <= layer["activation_mb"]
    assert data["layers"][-1]["output_mb"] == 0  # the loss: nothing is sent on
    assert all(layer["output_mb"] > 0 for layer in data["layers"][:-1])
    assert data["p2p_latency"] >= 0
    CostProfile.from_dict(stage_shaped(data), source="<per-layer>")  # valid stage fields


def check_timed(measurements, iters: int) -> None:
    """Every step of every layer or stage was timed once per measured round, and took time."""
    for m in measurements:
        for f in TIME_FIELDS:
            samples = getattr(m, f)
            assert len(samples) == iters and all(x > 0 for x in samples), (f, samples)


def test_megatron_gpt_layers_sum_to_the_stage_profile(single_process_megatron):
    pytest.importorskip("megatron.core")
    from koala_ds.profiler.models import megatron_gpt_stages, profile_megatron_gpt, profile_megatron_gpt_layers

    L, H, S, B = 4, 128, 64, 2
    # every covered layer deferred (max_hold=None): W-hold is additive over layers; under the hold
    # policy a stage plans its layers together (tests/test_wgrad_policy.py)
    kw = dict(num_layers=L, hidden_size=H, num_attention_heads=4, seq_length=S, micro_batch_size=B,
              vocab_size=128, warmup=1, iters=5, max_hold=None)
    layers = profile_megatron_gpt_layers(p=2, optimizer_bytes_per_param_byte=3.0, **kw)
    stages = profile_megatron_gpt(p=2, **kw)
    data = layers.to_dict()
    check_format(data, ["embedding"] + ["transformer"] * L + ["output"])
    assert [x["name"] for x in data["layers"]] == ["embedding"] + [f"layer.{i}" for i in range(L)] + ["output"]
    assert data["optimizer_bytes_per_param_byte"] == 3.0 and data["meta"]["p"] == 2
    # the boundary tensor: [seq, batch, hidden] fp32
    assert data["layers"][0]["output_mb"] == pytest.approx(S * B * H * 4 / 2**20)
    # parameters: the whole model's, once
    whole, _ = megatron_gpt_stages(L, H, 4, S, B, 128, 1)
    stage_params = sum(p.numel() * 4 for p in whole[0].parameters())
    assert sum(x["param_mb"] for x in data["layers"]) * 2**20 == pytest.approx(stage_params)
    # stage 0 = embedding + layers 0-1, stage 1 = layers 2-3 + output
    mask_bytes = S * S  # the causal mask (bool): one tensor all attention layers save, counted once per layer
    for s, group in enumerate((layers.result.stages[:3], layers.result.stages[3:])):
        st = stages.stages[s]
        assert sum(m.activation_bytes for m in group) == st.activation_bytes + (L // 2 - 1) * mask_bytes
        assert sum(m.w_hold_bytes for m in group) == st.w_hold_bytes
    check_timed(layers.result.stages + stages.stages, iters=5)
    # the same cut of the per-layer profile costs the sums of its layers' entries
    from koala_ds.sim.layers import LayerProfile

    cut = LayerProfile.from_dict(data).stage_profile([3, 3], 2)
    for stage, group in zip(cut.stages, (data["layers"][:3], data["layers"][3:])):
        for f in ("forward", "backward_input", "backward_weight", "backward"):
            assert getattr(stage, "backward_full" if f == "backward" else f) == \
                pytest.approx(sum(layer[f] for layer in group)), f


def test_deepspeed_layer_list_layers_sum_to_the_stage_profile():
    pytest.importorskip("deepspeed")
    from koala_ds.profiler.models import gpt_layers, profile_pipeline_module, profile_pipeline_module_layers

    torch.manual_seed(0)
    layers = gpt_layers(2, 32, 4, 16, 64)
    x = torch.randint(0, 64, (2, 16))
    stages = profile_pipeline_module(layers, x, 2, partition_method="uniform", warmup=1, iters=3, max_hold=None)
    per_layer = profile_pipeline_module_layers(layers, x, warmup=1, iters=3, max_hold=None)
    data = per_layer.to_dict()
    check_format(data, ["embedding", "transformer", "transformer", "output"])
    assert [x["name"] for x in data["layers"]] == ["0.GPTEmbedding", "1.GPTBlock", "2.GPTBlock", "3.GPTHead"]
    assert "optimizer_bytes_per_param_byte" not in data  # not given: the format's default
    for i, layer in enumerate(layers):
        assert data["layers"][i]["param_mb"] * 2**20 == pytest.approx(sum(p.numel() * 4 for p in layer.parameters()))
    for s, group in enumerate((per_layer.result.stages[:2], per_layer.result.stages[2:])):
        assert sum(m.activation_bytes for m in group) == stages.stages[s].activation_bytes
        assert sum(m.w_hold_bytes for m in group) == stages.stages[s].w_hold_bytes


def test_per_layer_w_hold_under_the_hold_policy_stays_within_the_bound():
    """Under the default bound (0.75) each layer plans alone: each stays within it, so any cut's sum does."""
    from koala_ds.profiler.models import gpt_layers, profile_pipeline_module_layers

    torch.manual_seed(0)
    per_layer = profile_pipeline_module_layers(gpt_layers(2, 32, 4, 16, 64), torch.randint(0, 64, (2, 16)),
                                               warmup=0, iters=1)
    blocks = per_layer.result.stages[1:3]
    for m in per_layer.result.stages:
        assert m.w_hold_bytes <= 0.75 * m.activation_bytes
    assert all(0 < m.w_hold_bytes and 0 < m.w_flops_deferred < 1 for m in blocks)  # some deferred, some in I


def _cli(*args, timeout=150):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "koala_ds.cli", "profile", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_cli_per_layer_megatron_gpt_with_measured_p2p(tmp_path):
    pytest.importorskip("megatron.core")
    out = tmp_path / "layers.json"
    proc = _cli("megatron-gpt", "--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "2",
                "--seq-length", "16", "-p", "2", "--warmup", "1", "--iters", "2", "--per-layer", "-o", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    check_format(data, ["embedding", "transformer", "transformer", "transformer", "output"])
    assert data["p2p_latency"] > 0 and data["meta"]["p2p_latency"].startswith("measured")
    assert "profiling layer 5/5" in proc.stderr and "per-layer profile" in proc.stdout


MODEL = """
import torch
from koala_ds.profiler.models import gpt_layers

class Pair(torch.nn.Module):
    def forward(self, x):
        return x, x

def layers():
    torch.manual_seed(0)
    return gpt_layers(1, 16, 2, 8, 32)

def bad_layers():
    return layers()[:2] + [Pair()] + layers()[2:]

def sample():
    return torch.randint(0, 32, (2, 8))
"""


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_cli_per_layer_deepspeed_and_one_line_errors(tmp_path):
    pytest.importorskip("deepspeed")
    (tmp_path / "tinymodel.py").write_text(MODEL)
    out = tmp_path / "layers.json"
    common = ("--input", "tinymodel:sample", "-p", "2", "--p2p-latency", "0.01", "--warmup", "1", "--iters", "2",
              "--per-layer", "--optimizer-bytes-per-param-byte", "1")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        ok = _cli("deepspeed", "--layers", "tinymodel:layers", *common, "-o", str(out))
        bad = _cli("deepspeed", "--layers", "tinymodel:bad_layers", *common, "-o", str(tmp_path / "bad.json"))
    finally:
        os.chdir(cwd)
    assert ok.returncode == 0, ok.stderr[-3000:]
    data = json.loads(out.read_text())
    check_format(data, ["embedding", "transformer", "output"])
    assert data["p2p_latency"] == 0.01 and data["optimizer_bytes_per_param_byte"] == 1.0
    assert bad.returncode != 0 and not (tmp_path / "bad.json").exists()
    lines = [x for x in bad.stderr.splitlines() if "error" in x.lower()]
    assert len(lines) == 1 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert "--layers" in lines[0] and "one tensor" in lines[0]


def test_per_layer_ignores_the_stage_divisibility_check_and_bad_flags_are_one_line(tmp_path):
    from koala_ds.cli import main

    with pytest.raises(SystemExit):  # argparse: a negative byte ratio
        main(["profile", "megatron-gpt", "--per-layer", "-p", "2", "-o", str(tmp_path / "x.json"),
              "--optimizer-bytes-per-param-byte", "-1"])
    assert main(["profile", "megatron-gpt", "--per-layer", "--num-layers", "0", "-p", "2",
                 "-o", str(tmp_path / "x.json")]) != 0
    assert not (tmp_path / "x.json").exists()


def test_a_layer_that_passes_on_a_tuple_is_named():
    """Was an AttributeError ('tuple' object has no attribute 'shape') from inside the measurement."""
    from koala_ds.profiler.core import profile_stages

    class Pair(torch.nn.Module):
        def forward(self, x):
            return x, x

    with pytest.raises(ValueError, match=r"^stage 1 returns tuple: stages must pass one tensor on$"):
        profile_stages([torch.nn.Linear(4, 4), Pair(), torch.nn.Linear(4, 4)], torch.randn(2, 4), warmup=0, iters=1)
