"""The profiler (koala profile) and the emulated-compute stages of benchmarks/engine_speedup.py.

Real engines, small: one 2-process megatron-core run through koala_ds.megatron, one 2-process
gloo ping-pong, one `koala profile megatron-gpt` on a 2-layer GPT. Every multi-process part
has a deadline. The whole file takes well under 2 minutes on 2 CPU cores.
"""
from __future__ import annotations

import json
import os
import statistics

import pytest

torch = pytest.importorskip("torch")

from koala_ds.profiler.core import measure_stage, profile_stages  # noqa: E402
from koala_ds.profiler.emulate import EmulatedStage  # noqa: E402
from koala_ds.sim import CostProfile, load_profile, simulate  # noqa: E402

B, D, H = 16, 24, 40


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def linear_stack():
    return torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.ReLU(), torch.nn.Linear(H, D))


def test_linear_stack_profile_times_memory_and_json(tmp_path):
    torch.manual_seed(0)
    stages = [linear_stack() for _ in range(3)]
    result = profile_stages(stages, torch.randn(B, D), warmup=1, iters=3, max_hold=None)  # W defers every layer
    data = result.to_dict()
    # saved for backward per stage: the input of the first Linear (B x D) and the ReLU output, which is
    # also the second Linear's input (B x H, one storage); weights are parameters and do not count
    expected = 4 * B * (D + H)
    assert [m.activation_bytes for m in result.stages] == [expected] * 3
    for st, m in zip(data["stages"], result.stages):
        assert st["activation_mb"] == pytest.approx(expected / 2**20, rel=1e-5)
        assert 0 < st["w_hold_mb"] <= st["activation_mb"]
        assert st["forward"] > 0 and st["backward_weight"] > 0 and st["backward_input"] > 0
        assert m.backward_full and all(x > 0 for x in m.backward_full)
    # the first stage's input is data (no gradient): I has nothing to do, W runs the whole backward
    assert data["meta"]["stages"][0]["input_gradient"] is False
    assert data["meta"]["stages"][1]["input_gradient"] is True
    path = tmp_path / "prof.json"
    result.write(path)
    prof = load_profile(path)
    assert prof.num_stages == 3 and prof.p2p_latency == 0.0
    simulate(__import__("koala_ds.resolve", fromlist=["x"]).load_schedule("1f1b", 3, 4), prof)


def test_w_hold_counts_what_the_weight_step_still_needs():
    # one Linear: its saved input is all the activation, and W needs it: w_hold == activation
    lin = torch.nn.Linear(D, D)
    meas = measure_stage(lin, lambda: torch.randn(B, D, requires_grad=True), is_last=False, warmup=0, iters=2,
                         max_hold=None)
    assert meas.activation_bytes == 4 * B * D
    assert meas.w_hold_bytes >= meas.activation_bytes  # the input plus the gradient recorded for W
    assert meas.w_flops_deferred == 1.0


def test_w_hold_under_the_default_bound_keeps_a_layer_that_would_hold_too_much_in_i():
    # the same Linear would hold 2x its activation: under the default bound (0.75) I computes it
    lin = torch.nn.Linear(D, D)
    meas = measure_stage(lin, lambda: torch.randn(B, D, requires_grad=True), is_last=False, warmup=0, iters=2)
    assert meas.activation_bytes == 4 * B * D
    assert meas.w_hold_bytes == 0 and meas.w_flops_deferred == 0.0


def _near(got: float, want: float, slack: float) -> bool:
    """A sleep never ends early; what comes on top of it (Python, a loaded machine) stays below
    `slack`, the stage's smallest sleep: less than a sleep in the wrong step would add."""
    return want - 0.05 <= got < want + slack


def test_emulated_stage_measures_its_sleep_times():
    """What makes the benchmark faithful: F, I and W each take their own sleep, no more.
    (The values are far enough apart that a sleep in the wrong step would be caught.)"""
    f, i, w = 4.0, 9.0, 16.0
    stage = EmulatedStage(f, i, w)
    meas = measure_stage(stage, lambda: torch.randn(2, 1, 8, requires_grad=True), is_last=False, warmup=2, iters=7,
                         clock="wall")  # a sleep takes no CPU time
    for name, want in (("forward", f), ("backward_input", i), ("backward_weight", w), ("backward_full", i + w)):
        got = min(getattr(meas, name))  # a sleep never ends early: the fastest sample is the least disturbed
        assert _near(got, want, f), f"{name}: measured {got:.3f} ms for a {want} ms sleep"
    # through the profiler: an emulated model profiles back to its own costs, stage 0 (input = data,
    # no input gradient) too: its I still backpropagates to its weights, as on the runtimes
    costs = [(2.0, 6.0, 12.0), (6.0, 8.0, 16.0)]
    result = profile_stages([EmulatedStage(*c) for c in costs], torch.randn(2, 1, 8), warmup=2, iters=5,
                            full_backward=False, clock="wall")
    st = result.stages  # the fastest sample again: the profile's medians move with the machine's load
    assert _near(min(st[0].backward_input), 6.0, 2.0) and _near(min(st[0].backward_weight), 12.0, 2.0), st[0]
    for name, want in zip(("forward", "backward_input", "backward_weight"), costs[1]):
        assert _near(min(getattr(st[1], name)), want, 6.0), (name, st[1])


def test_pipeline_module_layers_are_partitioned_like_deepspeed():
    pytest.importorskip("deepspeed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.pipe import LayerSpec
    from deepspeed.runtime.utils import partition_uniform

    from koala_ds.profiler.models import pipeline_module_stages, profile_pipeline_module

    layers = [LayerSpec(torch.nn.Linear, D, D) for _ in range(4)] + [torch.nn.ReLU()]
    parts = partition_uniform(num_items=5, num_parts=2)
    stages = pipeline_module_stages(layers, 2, "uniform")
    assert [len(s.funcs) for s in stages] == [parts[1] - parts[0], parts[2] - parts[1]]
    result = profile_pipeline_module(layers, torch.randn(B, D), 2, partition_method="uniform", warmup=0, iters=2)
    # each Linear saves its input (B x D); the trailing ReLU saves its output (B x D)
    saved = [sum(1 for _ in s.funcs) for s in stages]
    assert [m.activation_bytes for m in result.stages] == [4 * B * D * n for n in saved]


def test_pipeline_module_profile_runs_on_the_device_asked_for(monkeypatch):
    """`koala profile deepspeed --device cuda` ran the layers where their code built them (the
    CPU): the stages, the sample input and the labels must go to the device."""
    pytest.importorskip("deepspeed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from koala_ds.profiler import core, models

    moved = []

    class Recorder(torch.nn.Linear):
        def _apply(self, fn, recurse=True):
            moved.append(type(self).__name__)
            return super()._apply(fn, recurse)

    seen, sent = {}, []
    to_device = models.to_device
    monkeypatch.setattr(models, "to_device", lambda x, device: sent.append(device) or to_device(x, device))

    def fake_profile_stages(stages, sample_input, **kwargs):
        seen.update(stages=stages, sample=sample_input, device=kwargs.get("device"))
        return core.ProfileResult([])

    monkeypatch.setattr(core, "profile_stages", fake_profile_stages)
    sample = torch.randn(B, D)
    models.profile_pipeline_module([Recorder(D, D), Recorder(D, D)], sample, 2, partition_method="uniform")
    assert moved == [] and sent == []  # no device: left where it is
    models.profile_pipeline_module([Recorder(D, D), Recorder(D, D)], sample, 2, partition_method="uniform",
                                   device="cpu")
    assert moved == ["Recorder", "Recorder"] and sent == ["cpu"] and seen["device"] == "cpu"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_p2p_pingpong_latency_and_cpu_per_message():
    from koala_ds.profiler.p2p import measure_p2p

    cost = measure_p2p(1024, iters=20, timeout_s=80)
    assert 0 < cost.latency_ms < 100
    # a message costs its rank some CPU time (at most its wall time on every core, plus slack)
    assert 0 < cost.cpu_ms_per_message < 2 * 2 * cost.latency_ms * 4


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_koala_profile_megatron_gpt_cli(tmp_path):
    pytest.importorskip("megatron.core")
    import subprocess
    import sys

    out = tmp_path / "gpt.json"
    proc = subprocess.run([sys.executable, "-m", "koala_ds.cli", "profile", "megatron-gpt", "--num-layers", "2",
                           "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8", "-p", "2",
                           "--warmup", "1", "--iters", "2", "--p2p-latency", "0.05", "--action-overhead", "0.3",
                           "-o", str(out)],
                          capture_output=True, text=True, timeout=110,
                          env={k: v for k, v in dict(os.environ, OMP_NUM_THREADS="1").items()
                               if k != "PYTHONWARNINGS"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # megatron-core's 7 warnings that Apex / Transformer Engine are missing and its deprecated
    # cuda_graph_scope default are not the user's to act on: none of them
    assert "Warning" not in proc.stderr, proc.stderr
    prof = load_profile(out)
    assert prof.num_stages == 2 and prof.p2p_latency == 0.05
    data = json.loads(out.read_text())
    assert data["meta"]["model"] == "megatron-gpt" and data["action_overhead"] == 0.3
    assert prof.stages[0].forward == pytest.approx(data["stages"][0]["forward"] + 0.3)  # loading adds it
    # seq 8 x micro-batch 2 x hidden 16 fp32 crosses the stage boundary
    assert data["meta"]["stages"][0]["output_shape"] == [8, 2, 16]
    for st in prof.stages:
        assert st.forward > 0 and st.backward_weight > 0 and st.activation_mb > 0
        assert st.backward_full is not None and st.backward_full > 0  # B, measured
    assert prof.stages[1].backward_input > 0
    assert "koala search --profile" in proc.stdout and "(I+W)/B" in proc.stdout
    assert "profiling stage 1/2 on cpu" in proc.stderr and "profiling stage 2/2" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_emulated_model_through_koala_megatron_matches_the_simulator():
    """Sanity check with wide bounds, not a performance claim: 2 ranks, 10 ms per op."""
    pytest.importorskip("megatron.core")
    from koala_ds.resolve import load_schedule
    from engine_runs import step_times_ms
    from koala_ds.runtime.spawn import spawn
    from rank_processes import PRELOAD

    p, m = 2, 4
    profile = CostProfile.uniform(p, 10.0, 10.0, 10.0)
    jobs, sims = [], []
    for name in ("1f1b", "zb-h1"):
        sched = load_schedule(name, p, m)
        costs = [[10.0, 10.0, 10.0]] * p
        jobs.append({"key": name, "schedule": sched.to_dict(), "costs": costs, "warmup": 1, "steps": 4})
        # the runtime has no input gradient on stage 0: its I is empty and W runs the whole backward
        folded = CostProfile((profile.stages[0].__class__(10.0, 0.0, 20.0),) + profile.stages[1:])
        sims.append(simulate(sched, folded).makespan)
    res = spawn("engine_runs:megatron_worker", p, {"jobs": jobs, "timeout_s": 60}, timeout_s=140, preload=PRELOAD)
    for (job, steps), sim in zip(zip(jobs, step_times_ms(res, 1)), sims):
        got = statistics.median(steps)
        assert 0.97 * sim <= got <= 1.6 * sim, f"{job['key']}: measured {got:.1f} ms, simulated {sim:.1f} ms"


def test_single_process_megatron_leaves_no_master_port_for_children(monkeypatch, single_process_megatron):
    """The profiler's one-process group used to set MASTER_PORT in os.environ to the port it
    listens on, so a `koala profile` started later from the same process (children inherit
    os.environ) failed with EADDRINUSE. In this process: the fixture destroys the group after."""
    import torch.distributed as dist

    from koala_ds.profiler.models import _init_single_process_megatron

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert not dist.is_initialized()  # the group is made here (tests/conftest.py: no test leaves one)
    _init_single_process_megatron(1)
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert sorted(k for k in ("MASTER_ADDR", "MASTER_PORT") if k in os.environ) == []


def test_profile_forward_is_the_plain_forward_and_i_carries_the_deferrals_extra():
    """A full-backward schedule runs an unprepared model; a split one the deferrable forward.
    The profile's F is the former; the difference (never negative) is charged to I."""
    from koala_ds.profiler.core import StageMeasurement

    m = StageMeasurement(forward=[10.0, 11.0, 12.0], backward_input=[5.0] * 3, backward_weight=[4.0] * 3,
                         backward_full=[8.0] * 3, forward_full=[9.0, 10.0, 10.5])
    assert m.costs() == (10.0, 6.0, 4.0, 8.0)
    m.forward_full = [13.0] * 3   # noise may make the plain forward slower: I is never lowered
    assert m.costs() == (13.0, 5.0, 4.0, 8.0)
    assert StageMeasurement(forward=[2.0], backward_input=[1.0], backward_weight=[1.0]).costs() == (2.0, 1.0, 1.0, None)
    torch.manual_seed(0)
    stack = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    meas = measure_stage(stack, lambda: torch.randn(4, 16, requires_grad=True), is_last=False, warmup=1, iters=3)
    assert len(meas.forward_full) == 3 and len(meas.backward_full) == 3
    sleeping = measure_stage(EmulatedStage(0.1, 0.1, 0.1), lambda: torch.randn(2, 1, 8, requires_grad=True),
                             is_last=False, warmup=1, iters=2)
    assert sleeping.forward_full == []   # no nn.Linear: the one forward is what both kinds run


TINY_MODEL = '''import torch

def layers():
    torch.manual_seed(0)
    return [torch.nn.Linear(8, 8) for _ in range(4)]

def sample():
    return torch.randn(2, 8)
'''


@pytest.mark.parametrize("overhead,short_ms", [(None, None), ("0.5", None), (None, 0.0)])
def test_profile_of_short_stages_warns_without_an_action_overhead(tmp_path, monkeypatch, caplog, overhead, short_ms):
    """Stages of microseconds: the runtime's cost per action would decide which schedule wins, so
    `koala profile` says to measure and give it, unless --action-overhead was given (or the
    stages are not short: a threshold of 0 ms here)."""
    pytest.importorskip("deepspeed")
    from koala_ds.cli import main
    from koala_ds.commands import profile as profile_cmd

    if short_ms is not None:
        monkeypatch.setattr(profile_cmd, "SHORT_STAGE_MS", short_ms)

    (tmp_path / "tinymodel.py").write_text(TINY_MODEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["profile", "deepspeed", "--layers", "tinymodel:layers", "--input", "tinymodel:sample", "-p", "2",
            "--p2p-latency", "0", "--warmup", "1", "--iters", "2", "-o", "prof.json"]
    with caplog.at_level("WARNING", logger="koala_ds.commands.profile"):
        assert main(argv + (["--action-overhead", overhead] if overhead else [])) == 0
    warned = [r.getMessage() for r in caplog.records if "action_overhead" in r.getMessage()]
    data = json.loads((tmp_path / "prof.json").read_text())
    if overhead or short_ms is not None:
        assert not warned and data.get("action_overhead") == (0.5 if overhead else None)
    else:
        assert len(warned) == 1 and "--action-overhead MS" in warned[0] and "action_overhead" not in data


def test_w_hold_measurement_leaves_the_processs_own_gc_freeze_alone():
    """The profiler freezes older objects around its W-hold collection; a process that froze
    objects itself (as servers that fork do) keeps them frozen."""
    import gc

    marker = ["frozen by the process"]
    gc.freeze()
    try:
        stage = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
        meas = measure_stage(stage, lambda: torch.randn(4, 8, requires_grad=True), is_last=False, warmup=0, iters=1)
        assert meas.activation_bytes > 0  # the memory microbatch ran
        assert not any(o is marker for o in gc.get_objects())  # still in the permanent generation
    finally:
        gc.unfreeze()
    measure_stage(stage, lambda: torch.randn(4, 8, requires_grad=True), is_last=False, warmup=0, iters=1)
    assert gc.get_freeze_count() == 0  # nothing left frozen by the profiler itself


class _Emb(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(1024, 32) * 0.01)

    def forward(self, x):
        return x @ self.weight.t() @ self.weight  # a stand-in: (B, 32) -> (B, 32)


def test_a_tied_head_counts_its_parameters_as_deepspeed_counts_them():
    """--partition-method parameters counted a tied layer with a forward_fn as 0 parameters (a
    function, not a module): the profiler cut 8 layers 2 + 6 where DeepSpeed cuts 4 + 4."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    from deepspeed.runtime.utils import partition_balanced

    from koala_ds.profiler.models import pipeline_module_stages

    layers = ([TiedLayerSpec("emb", _Emb)] + [LayerSpec(torch.nn.Linear, 32, 32) for _ in range(6)]
              + [TiedLayerSpec("emb", _Emb, forward_fn=lambda mod, x: x @ mod.weight.t() @ mod.weight)])
    weights = [1024 * 32] + [32 * 32 + 32] * 6 + [1024 * 32]  # DeepSpeed builds and counts each spec
    parts = partition_balanced(weights=weights, num_parts=2)
    stages = pipeline_module_stages(layers, 2, "parameters")
    assert [len(s.funcs) for s in stages] == [parts[1] - parts[0], parts[2] - parts[1]] == [4, 4]


def test_a_tuple_input_goes_to_the_first_layer_as_one_argument():
    """DeepSpeed hands a tuple input to the first layer whole; the profiler unpacked it into the
    stage's forward, which took one argument (a TypeError for every such model)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from koala_ds.profiler.models import profile_pipeline_module

    def first(inp):
        x, scale = inp
        return x * scale

    layers = [first, torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    result = profile_pipeline_module(layers, (torch.randn(2, 4), torch.tensor(2.0)), 2, partition_method="uniform",
                                     warmup=0, iters=1)
    assert len(result.stages) == 2


@pytest.mark.parametrize("argv, says", [
    (["profile", "p2p", "--numel", "1000", "--dtype", "qint8"], "--dtype qint8: not a dtype gloo sends"),
    (["profile", "megatron-gpt", "-p", "2", "-o", "x.json", "--max-w-hold", "inf"],
     "argument --max-w-hold: expected a finite number >= 0 or none, got 'inf'"),
])
def test_a_dtype_gloo_cannot_send_and_an_infinite_hold_are_one_line(capsys, argv, says):
    """qint8 was a 260-line traceback from the ping-pong's processes; --max-w-hold inf profiled every
    stage and then failed writing the JSON, naming no option."""
    from koala_ds.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and says in err, err


def test_a_stage_with_nothing_to_backpropagate_costs_no_backward():
    """Leading parameter-free layers passing integer token ids on (DeepSpeed runs them): the
    profiler called backward on an output with no graph ('does not require grad')."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from koala_ds.profiler.models import profile_pipeline_module

    layers = [lambda ids: ids + 0, lambda ids: ids * 1, torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8)]
    result = profile_pipeline_module(layers, torch.randint(0, 16, (2, 4)), 2, partition_method="uniform",
                                     warmup=0, iters=1)
    first = result.stages[0]
    assert first.activation_bytes == 0 and first.w_hold_bytes == 0 and not first.input_grad
    assert len(first.backward_input) == len(first.backward_weight) == len(first.backward_full) == 1  # timed, ran
