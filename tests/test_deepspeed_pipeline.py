"""The DeepSpeed adapter on real DeepSpeed 0.19.8: CPU, gloo, several processes.

Equality tests train a tiny PipelineModule for 3 steps under DeepSpeed's stock TrainSchedule
and under Koala schedules (many schedules inside ONE launch per topology: each case builds a
fresh model and engine in the same process group), then compare the step losses, an
eval_batch loss and every final parameter (max diff <= 1e-6 relative, fp32). Multi-chunk
schedules run on a KoalaPipelineModule cut into p*v virtual stages and are compared with the
stock engine on the same layers cut into p stages.

The targets are scaled (TARGET_SCALE) so that the gradient norm is far above DeepSpeed's
default gradient_clipping of 1.0: clipping acts in every equality test (cases marked
clip=0.0 turn it off and compare with a stock run without clipping).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
torch = pytest.importorskip("torch")

from koala_ds.deepspeed import (KoalaConfigError, KoalaPipeSchedule, KoalaPipelineConfig,  # noqa: E402
                                check_schedule, select_engine_class)
from koala_ds.deepspeed.schedule import BackwardInputPass, BackwardWeightPass  # noqa: E402
from koala_ds.runtime.lowering import COMPUTE, RECV, SEND, lower  # noqa: E402
from deepspeed_jobs import (DEFAULT_EXTENSIONS_DIR, checkpoint_worker, hang_worker, launch, save_hang_worker,  # noqa: E402
                            train_worker)
from koala_ds.core.ir import Action, KoalaError, Op, Placement  # noqa: E402
from koala_ds.runtime.spawn import remove_deepspeed_shm  # noqa: E402
from koala_ds.resolve import load_schedule  # noqa: E402
from koala_ds.core.validate import validate  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-6  # relative (absolute below 1)
GAS, MBS, DIM, BLOCKS, STEPS = 8, 2, 8, 8, 3
TARGET_SCALE = 100.0  # gradient norms >> 1.0, DeepSpeed's default gradient_clipping

SINGLE = ["gpipe", "1f1b", "eager-1f1b", "zb-h1", "zb-h2"]
MULTI = [("interleaved-1f1b", "interleaved"), ("zb-v", "vshape"), ("dualpipe-v", "vshape")]
OTHER_MULTI = [("looped-bfs", "interleaved"), ("v-half", "vshape"), ("v-min", "vshape"), ("hanayo", "vshape")]


def _variant(tied: bool, clip: float | None) -> str:
    return f"{'-tied' if tied else ''}{'-noclip' if clip == 0 else ''}"


def _case(name: str, placement: str = "linear", tied: bool = False, clip: float | None = None, **extra) -> dict:
    """A Koala case; clip=None keeps DeepSpeed's default gradient_clipping (1.0), 0.0 turns it off."""
    chunks = 1 if placement == "linear" else 2
    label = f"{name}{_variant(tied, clip)}{extra.pop('suffix', '')}"
    return {"label": label, "schedule": name, "chunks": chunks, "placement": placement, "tied": tied, "clip": clip,
            **extra}


def _stock(tied: bool = False, clip: float | None = None) -> dict:
    return {"label": f"stock{_variant(tied, clip)}", "schedule": None, "tied": tied, "clip": clip}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(b))


def _merged(results: list[dict], label: str, dp_rank: int) -> dict:
    params: dict = {}
    for res in results:
        value = res["value"]
        if value["dp"] == dp_rank:
            params.update(value["cases"][label]["params"])
    return params


def _assert_equal_to_stock(results: list[dict], cases: list[dict], dp: int) -> None:
    """Every Koala case equals its stock reference: losses, eval loss, parameters (all DP replicas)."""
    checked = []
    for case in cases:
        label = case["label"]
        if case["schedule"] is None:
            continue
        ref = case.get("ref") or f"stock{_variant(case.get('tied', False), case.get('clip'))}"
        for res in results:
            mine, stock = res["value"]["cases"][label], res["value"]["cases"][ref]
            assert mine["engine"] == "KoalaPipelineEngine", label
            assert stock["engine"] == "PipelineEngine", ref
            assert len(mine["losses"]) == STEPS
            assert all(_close(a, b) for a, b in zip(mine["losses"], stock["losses"])), \
                f"{label}: step losses differ from {ref}: {mine['losses']} vs {stock['losses']}"
            assert _close(mine["eval"], stock["eval"]), f"{label}: eval loss {mine['eval']} vs {stock['eval']}"
        for d in range(dp):
            mine, stock = _merged(results, label, d), _merged(results, ref, d)
            assert set(mine) == set(stock), f"{label}: parameter names differ: {set(mine) ^ set(stock)}"
            worst = max(((mine[n] - stock[n]).abs().max() / stock[n].abs().max().clamp(min=1.0)).item()
                        for n in stock)
            assert worst <= TOL, f"{label}: parameters differ from {ref} by {worst} (relative, dp replica {d})"
        # training moved the parameters: the comparison is not between two untouched models
        assert results[0]["value"]["cases"][label]["losses"][0] != results[0]["value"]["cases"][label]["losses"][-1]
        checked.append(label)
    assert checked


def _spec(pp: int, cases: list[dict]) -> dict:
    return {"pp": pp, "gas": GAS, "mbs": MBS, "dim": DIM, "blocks": BLOCKS, "steps": STEPS, "cases": cases,
            "target_scale": TARGET_SCALE}


def _assert_clipping_acted(results: list[dict], clipped: str, unclipped: str) -> None:
    """The clipped and unclipped stock runs differ: clipping acted, the equality tests test it."""
    a, b = (results[0]["value"]["cases"][label]["losses"] for label in (clipped, unclipped))
    assert not _close(a[-1], b[-1]), f"gradient clipping did not act: {clipped} {a} vs {unclipped} {b}"


# -- single process: compilation and refusals ----------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name,p,v", [("1f1b", 4, 1), ("gpipe", 2, 1), ("zb-h1", 4, 1), ("zb-h2", 2, 1),
                                      ("interleaved-1f1b", 2, 2), ("zb-v", 4, 2), ("dualpipe-v", 2, 2)])
@pytest.mark.parametrize("lookahead", [0, 2, None])
def test_instruction_streams_follow_the_lowered_schedule(name, p, v, lookahead):
    schedule = load_schedule(name, p, 8, v)
    peaks = validate(schedule).peak_in_flight
    lowered = lower(schedule, lookahead=lookahead)
    comm = {"RecvActivation": RECV, "RecvGrad": RECV, "SendActivation": SEND, "SendGrad": SEND}
    ops = {"ForwardPass": Op.F, "BackwardPass": Op.B, "BackwardInputPass": Op.I, "BackwardWeightPass": Op.W}
    for rank in range(p):
        sched = KoalaPipeSchedule(schedule, rank, lookahead=lookahead)
        assert sched.num_pipe_buffers() == peaks[rank]
        steps = list(sched.steps())
        stream = []
        for cmds in steps[:-1]:
            kinds = [type(c).__name__ for c in cmds]
            assert sum(k in ops for k in kinds) == 1, kinds
            position = next(i for i, k in enumerate(kinds) if k in ops)
            assert all(comm[k] == RECV for k in kinds[:position] if k in comm), kinds
            assert all(comm[k] == SEND for k in kinds[position + 1:]), kinds
            for c in cmds:
                name_ = type(c).__name__
                if name_ in comm:
                    assert c.kwargs["message"].kind == ("act" if "Activation" in name_ else "grad")
                    stream.append((comm[name_], c.kwargs["message"], c.kwargs["peer"]))
                elif name_ in ops:
                    stream.append((COMPUTE, Action(ops[name_], c.stage, c.microbatch)))
        # the instructions are the lowered stream, step for step
        assert stream == [(st.kind, st.message, st.peer) if st.kind != COMPUTE else (COMPUTE, st.action)
                          for st in lowered.ranks[rank]]
        assert [type(c).__name__ for c in steps[-1]] == ["WaitSends", "ReduceTiedGrads", "ReduceGrads",
                                                        "OptimizerStep"]
        assert any(isinstance(c, (BackwardInputPass, BackwardWeightPass)) for s in steps for c in s) == \
            (schedule.backward == "split" and any(a.op is Op.I for a in schedule.ranks[rank]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("style,p,v", [("linear", 4, 1), ("interleaved", 2, 2), ("vshape", 4, 2)])
def test_the_inference_order_runs_with_blocking_receives(style, p, v):
    """eval_batch learns input shapes at the first receive (blocking): its lowered order must run so."""
    from koala_ds.deepspeed.schedule import inference_order
    from koala_ds.runtime.lowering import check_lowered

    check_lowered(lower(inference_order(Placement.named(style, p, v), 5), forward_only=True, lookahead=0),
                  blocking_recv=True)


@pytest.mark.timeout(60)
def test_pp2_v2_has_both_directions_to_one_neighbour():
    """The case the tags exist for: rank 0 both sends to and receives from rank 1, for two stages;
    rank 1 posts its receives in rank 0's send order."""
    schedule = load_schedule("interleaved-1f1b", 2, 8, 2)
    sent = [c.kwargs["message"] for s in KoalaPipeSchedule(schedule, 0).steps() for c in s
            if type(c).__name__.startswith("Send") and c.kwargs["peer"] == 1]
    posted = [c.kwargs["message"] for s in KoalaPipeSchedule(schedule, 1).steps() for c in s
              if type(c).__name__.startswith("Recv")]
    assert {m.kind for m in sent} == {"act", "grad"}
    assert sent == posted


@pytest.mark.timeout(60)
def test_schedules_the_engine_cannot_run_are_refused_with_the_property_named():
    linear2 = Placement.named("linear", 2)
    chimera = load_schedule("chimera", 2, 4)
    with pytest.raises(KoalaConfigError, match="2 pipelines"):
        check_schedule(chimera, linear2, 4, "test")
    one = load_schedule("1f1b", 2, 4)
    with pytest.raises(KoalaConfigError, match="gradient_accumulation_steps=8"):
        check_schedule(one, linear2, 8, "test")
    with pytest.raises(KoalaConfigError, match="num_stages"):
        check_schedule(one, Placement.named("linear", 4), 4, "test")
    zbv = load_schedule("zb-v", 2, 4, 2)
    with pytest.raises(KoalaConfigError, match=r"KoalaPipelineModule\(layers, num_stages=2, chunks=2, "
                                               r"placement='vshape'\)"):
        check_schedule(zbv, linear2, 4, "test")
    with pytest.raises(KoalaConfigError, match="interleaved"):
        check_schedule(zbv, Placement.named("interleaved", 2, 2), 4, "test")
    check_schedule(zbv, Placement.named("vshape", 2, 2), 4, "test")


@pytest.mark.timeout(60)
def test_config_section_and_engine_selection():
    cfg = KoalaPipelineConfig.from_pipeline_section({"schedule": "koala", "koala": {"schedule": "zb-h1"}}, env={})
    assert (cfg.schedule, cfg.profile) == ("zb-h1", None)
    env = {"KOALA_SCHEDULE": "zb-v", "KOALA_PROFILE": "p.json", "KOALA_TIMEOUT_S": "5"}
    cfg = KoalaPipelineConfig.from_pipeline_section({}, env=env)
    assert (cfg.schedule, cfg.profile, cfg.timeout_s) == ("zb-v", "p.json", 5.0)
    with pytest.raises(KoalaConfigError, match="unknown keys"):
        KoalaPipelineConfig.from_pipeline_section({"koala": {"schedul": "x"}}, env={})
    with pytest.raises(KoalaConfigError, match="timeout_s"):
        KoalaPipelineConfig.from_pipeline_section({"koala": {"timeout_s": "soon"}}, env={})


def test_a_bad_profile_names_the_variable_or_the_key_it_came_from(tmp_path):
    """A bad KOALA_PROFILE was reported as "pipeline.koala.profile", which the config did not set."""
    from koala_ds.deepspeed import KoalaPipelineEngine

    bad = tmp_path / "p.json"
    bad.write_text("{}")
    schedule = load_schedule("1f1b", 2, 4)
    for section, env, setting in (({}, {"KOALA_PROFILE": str(bad)}, "KOALA_PROFILE"),
                                  ({"koala": {"profile": str(bad)}}, {"KOALA_PROFILE": "other.json"},
                                   '"pipeline.koala.profile"')):
        cfg = KoalaPipelineConfig.from_pipeline_section(section, env=env)
        assert cfg.profile == str(bad)
        with pytest.raises(KoalaError) as info:
            KoalaPipelineEngine._log_profile(schedule, cfg.profile, cfg.profile_source)
        assert str(info.value).startswith(f"{setting} {bad}: ") and "\n" not in str(info.value), str(info.value)


def test_engine_selection():
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from koala_ds.deepspeed import KoalaPipelineEngine

    model = object()
    os.environ.pop("DS_PIPELINE_SCHEDULE", None)
    assert select_engine_class(model, {}) is PipelineEngine
    assert select_engine_class(model, {"schedule": "koala"}) is KoalaPipelineEngine


def test_koala_settings_while_deepspeeds_own_engine_runs_are_said_to_be_ignored(monkeypatch, caplog):
    """"pipeline.koala" or KOALA_SCHEDULE without "pipeline.schedule": "koala": the stock engine ran
    and they were ignored without a word."""
    import logging

    from deepspeed.runtime.pipe.engine import PipelineEngine

    monkeypatch.delenv("DS_PIPELINE_SCHEDULE", raising=False)
    monkeypatch.delenv("KOALA_SCHEDULE", raising=False)
    with caplog.at_level(logging.WARNING, logger="koala_ds.deepspeed.install"):
        assert select_engine_class(object(), {"koala": {"schedule": "zb-h1"}}) is PipelineEngine
        monkeypatch.setenv("KOALA_SCHEDULE", "zb-h1")
        assert select_engine_class(object(), {}) is PipelineEngine
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all("the Koala settings are ignored" in x for x in said), said
    assert said[0].startswith('"pipeline.koala" set') and said[1].startswith("KOALA_SCHEDULE set"), said
    caplog.clear()
    monkeypatch.delenv("KOALA_SCHEDULE")
    with caplog.at_level(logging.WARNING, logger="koala_ds.deepspeed.install"):
        select_engine_class(object(), {})
    assert not caplog.records


@pytest.mark.parametrize("value", ["", "  ", 0, False, ["zb-h1"]])
def test_an_empty_or_non_text_koala_schedule_is_refused(value):
    """"schedule": "" (or 0) ran 1f1b without a word."""
    with pytest.raises(KoalaConfigError, match=r'^DeepSpeed config "pipeline.koala.schedule" is .*: give a library '
                                               r'name, a .koala / .json / .csv file, or drop the key \(default 1f1b\)$'):
        KoalaPipelineConfig.from_pipeline_section({"schedule": "koala", "koala": {"schedule": value}}, env={})


def test_a_profile_with_another_number_of_stages_is_refused():
    """A DeepSpeed config's profile was 'loaded and checked', but any number of stages passed."""
    from koala_ds.deepspeed import KoalaPipelineEngine

    schedule = load_schedule("zb-h1", 2, 4)
    with pytest.raises(KoalaError, match=r'^"pipeline.koala.profile" gpt-lmhead-8: 8 stage entries, but schedule '
                                         r"'zb-h1' has 2 stages \(p x v = 2 x 1\)"):
        KoalaPipelineEngine._log_profile(schedule, "gpt-lmhead-8", '"pipeline.koala.profile"')
    KoalaPipelineEngine._log_profile(load_schedule("zb-h1", 4, 8), "uniform-4", '"pipeline.koala.profile"')


@pytest.mark.parametrize("config,says", [
    ({"fp16": {"enabled": True}}, 'remove "fp16": {"enabled": true}'),
    ({"zero_optimization": {"stage": 2}}, '"zero_optimization": {"stage": 2} partitions the gradients'),
    ({"zero_optimization": {"stage": 3}}, "use stage 0 or 1"),
    ({"zero_optimization": {"stage": 1}}, None),
    ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}, None),
])
def test_what_the_engine_cannot_run_is_one_line_naming_the_config_key(config, says):
    from deepspeed.runtime.config import DeepSpeedConfig

    from koala_ds.deepspeed import KoalaPipelineEngine

    config_class = DeepSpeedConfig({"train_batch_size": 2, **config})
    if says is None:
        KoalaPipelineEngine._check_config(config_class)
        return
    with pytest.raises(KoalaConfigError) as info:
        KoalaPipelineEngine._check_config(config_class)
    assert says in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(120)
def test_launcher_removes_deepspeeds_shared_memory_buffers():
    # DeepSpeed's CPU allreduce leaves /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>
    # (~66 MB each) behind; without the launcher's clean-up a test run fills /dev/shm job by job
    import glob

    # (only this job's buffers, named by its port: other jobs may run at the same time)
    values = [r["value"] for r in launch("deepspeed_jobs:allreduce_worker", 2, {"size": 4, "port": True},
                                         timeout_s=100)]
    assert [v[0] for v in values] == [2.0, 2.0]
    port = values[0][1]
    assert glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*") == []


@pytest.mark.timeout(60)
def test_schedule_from_json_file_round_trips(tmp_path):
    from koala_ds.deepspeed import resolve_schedule

    schedule = load_schedule("zb-h2", 4, 8)
    path = tmp_path / "searched.json"
    path.write_text(schedule.to_json())
    assert resolve_schedule(str(path), 4, 8, 1).same_order(schedule)


@pytest.mark.timeout(60)
def test_fixed_schedule_file_for_other_sizes_names_the_deepspeed_setting(tmp_path):
    # a .json / .csv file is taken as written; the engine check names DeepSpeed's setting
    from koala_ds.deepspeed import resolve_schedule

    schedule = load_schedule("1f1b", 2, 4)
    for path, text in ((tmp_path / "m4.json", schedule.to_json()), (tmp_path / "m4.csv", schedule.to_torch_csv())):
        path.write_text(text)
        loaded = resolve_schedule(str(path), 2, 8, 1)
        assert loaded.same_order(schedule)
        with pytest.raises(KoalaConfigError, match="gradient_accumulation_steps=4"):
            check_schedule(loaded, Placement.named("linear", 2), 8, str(path))


# -- multi-process equality with DeepSpeed's stock TrainSchedule --------------------------
@pytest.mark.slow
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(420)
def test_two_stages_every_schedule_equals_stock(tmp_path):
    """Every schedule, with DeepSpeed's default gradient clipping acting (multi-chunk runs used to
    clip by the norm of other layers than the stock engine) and, for some, with clipping off."""
    json_path = tmp_path / "zb-v-searched.json"
    json_path.write_text(load_schedule("zb-v", 2, GAS, 2).to_json())
    koala_path = tmp_path / "my-1f1b.koala"
    koala_path.write_text((REPO / "koala_ds" / "library" / "1f1b.koala").read_text())
    cases = [_stock(), _stock(tied=True)]
    cases += [_case(n) for n in SINGLE]
    cases += [_case(n, pl) for n, pl in MULTI + OTHER_MULTI]
    cases += [_case("zb-h1", tied=True), _case("zb-v", "vshape", tied=True),
              _case("interleaved-1f1b", "interleaved", tied=True)]
    cases += [_case(str(json_path), "vshape", suffix="-json"), _case(str(koala_path), suffix="-koala"),
              _case("zb-h2", via="direct", suffix="-direct")]
    cases[-3]["label"], cases[-2]["label"] = "json-file", "koala-file"
    cases += [_stock(clip=0.0), _stock(tied=True, clip=0.0), _case("zb-h1", clip=0.0),
              _case("zb-v", "vshape", clip=0.0), _case("interleaved-1f1b", "interleaved", clip=0.0),
              _case("dualpipe-v", "vshape", tied=True, clip=0.0)]
    results = launch(train_worker, 2, _spec(2, cases), timeout_s=400)
    _assert_clipping_acted(results, "stock", "stock-noclip")
    _assert_equal_to_stock(results, cases, dp=1)


@pytest.mark.slow
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(600)
def test_four_stages_equal_stock():
    cases = [_stock(), _stock(tied=True)]
    cases += [_case(n) for n in ("1f1b", "eager-1f1b", "zb-h1", "zb-h2")]
    cases += [_case(n, pl) for n, pl in MULTI]
    cases += [_case("zb-h2", tied=True), _case("dualpipe-v", "vshape", tied=True)]
    results = launch(train_worker, 4, _spec(4, cases), timeout_s=580)
    _assert_equal_to_stock(results, cases, dp=1)


@pytest.mark.slow
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(600)
def test_two_stages_times_two_data_parallel_equal_stock():
    cases = [_stock(), _stock(tied=True), _case("gpipe"), _case("1f1b"), _case("zb-h1"), _case("zb-h2", tied=True)]
    cases += [_case(n, pl) for n, pl in MULTI]
    results = launch(train_worker, 4, _spec(2, cases), timeout_s=580)
    assert sorted((r["value"]["pipe"], r["value"]["dp"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # clipping acts here too: with data parallelism its norm is averaged over the replicas
    _assert_equal_to_stock(results, cases, dp=2)
    # the two data-parallel replicas saw different data yet hold the same (all-reduced) weights
    a, b = _merged(results, "zb-v", 0), _merged(results, "zb-v", 1)
    assert max((a[n] - b[n]).abs().max().item() for n in a) == 0.0


@pytest.mark.slow
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(600)
def test_zero_stage_1_equals_stock_zero_stage_1():
    """ZeRO stage 1 (optimizer states partitioned over the data-parallel replicas; DeepSpeed's
    pipeline engine allows no higher stage), 2 stages x 2 replicas, clipping on (inside ZeRO's
    step): the Koala engine trains as the stock engine under the same ZeRO settings, in fp32 with
    the gradients reduced at the step's end (with tied weights too), and in bf16 with overlap_comm
    (reduced by ZeRO's gradient hooks as they fire, in I, W and B)."""
    cases = []
    for suffix, extra in (("-zero1", {"zero": {"stage": 1}}),
                          ("-zero1-overlap-bf16", {"zero": {"stage": 1, "overlap_comm": True}, "bf16": True})):
        ref = f"stock{suffix}"
        cases.append({**_stock(), "label": ref, **extra})
        cases += [{**_case(name, placement), "label": f"{name}{suffix}", "ref": ref, **extra}
                  for name, placement in (("1f1b", "linear"), ("zb-h1", "linear"), ("zb-v", "vshape"))]
    # tied weights: across the two ranks (linear), and on one rank (the V-shape's first and last stage)
    cases.append({**_stock(tied=True), "label": "stock-tied-zero1", "zero": {"stage": 1}})
    cases += [{**_case(name, placement, tied=True), "label": f"{name}-tied-zero1", "ref": "stock-tied-zero1",
               "zero": {"stage": 1}} for name, placement in (("zb-h2", "linear"), ("zb-v", "vshape"))]
    results = launch(train_worker, 4, _spec(2, cases), timeout_s=580)
    _assert_equal_to_stock(results, cases, dp=2)
    for res in results:  # ZeRO's optimizer stepped every case
        assert {c["optimizer"] for c in res["value"]["cases"].values()} == {"DeepSpeedZeroOptimizer"}


@pytest.mark.slow
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(600)
def test_model_parallel_topology_equals_stock():
    """A pipe x model-parallel topology (2 stages x 2 model-parallel ranks, as Megatron-DeepSpeed
    builds for tensor parallelism; here each model-parallel rank holds the whole layers): every
    model-parallel rank exchanges its messages with its own counterpart in the next stage, and
    clipping (on) measures the norm as the stock engine does. With DeepSpeed's pipe_partitioned /
    grad_partitioned each rank sends only its half of every activation and gradient and the
    receiving stage all-gathers them (the Koala engine refused these settings before); also with
    tied weights. Losses and each model-parallel replica's parameters equal the stock engine's
    under the same settings."""
    cases = []
    for suffix, extra in (("-mp2", {}), ("-mp2-split", {"partitioned": True})):
        cases.append({**_stock(clip=1.0), "label": f"stock{suffix}", **extra})
        cases += [{**_case(name, placement, clip=1.0), "label": f"{name}{suffix}", "ref": f"stock{suffix}", **extra}
                  for name, placement in (("1f1b", "linear"), ("zb-h1", "linear"), ("zb-v", "vshape"))]
    # tied weights (Megatron-DeepSpeed ties its embeddings so): on one rank under the V-shape
    cases.append({**_stock(tied=True, clip=1.0), "label": "stock-tied-mp2-split", "partitioned": True})
    cases.append({**_case("zb-v", "vshape", tied=True, clip=1.0), "label": "zb-v-tied-mp2-split",
                  "ref": "stock-tied-mp2-split", "partitioned": True})
    results = launch(train_worker, 4, {**_spec(2, cases), "mp": 2}, timeout_s=580)
    assert sorted((r["value"]["pipe"], r["value"]["mp"]) for r in results) == [(0, (0, 2)), (0, (1, 2)),
                                                                              (1, (0, 2)), (1, (1, 2))]
    for res in results:  # the Koala engine split exactly the partitioned cases' messages
        assert {label: c["split"] for label, c in res["value"]["cases"].items() if c["engine"] != "PipelineEngine"} \
            == {c["label"]: ["act", "grad"] if c.get("partitioned") else [] for c in cases if c["schedule"]}
    _assert_equal_to_stock(results, cases, dp=1)
    for mp_rank in (0, 1):  # each model-parallel replica's parameters (the check above merges them)
        replica = [r for r in results if r["value"]["mp"][0] == mp_rank]
        for case in cases:
            if case["schedule"] is None:
                continue
            stock, mine = _merged(replica, case["ref"], 0), _merged(replica, case["label"], 0)
            assert set(mine) == set(stock) and all(torch.allclose(mine[n], stock[n], rtol=TOL, atol=TOL) for n in stock)


@pytest.mark.slow
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(400)
def test_activation_checkpointing_equals_stock():
    """The module's activation_checkpoint_interval (DeepSpeed's reentrant checkpointing, every
    layer): I recomputes a layer's forward inside its backward and W takes the recomputed inputs;
    the losses and parameters are the stock engine's with the same checkpointing."""
    extra = {"checkpoint_interval": 1}
    cases = [{**_stock(), "label": "stock-ckpt", **extra}]
    cases += [{**_case(name, placement), "label": f"{name}-ckpt", "ref": "stock-ckpt", **extra}
              for name, placement in (("1f1b", "linear"), ("zb-h1", "linear"), ("zb-v", "vshape"))]
    results = launch(train_worker, 2, _spec(2, cases), timeout_s=380)
    _assert_equal_to_stock(results, cases, dp=1)
    assert {c["checkpoint_interval"] for res in results for c in res["value"]["cases"].values()} == {1}


def _checkpoint(tmp_path, save: dict, load: dict, bf16: bool = False, **load_kwargs) -> list[dict]:
    spec = {"pp": 2, "gas": 4, "mbs": 2, "dim": 8, "blocks": 4, "target_scale": 10.0, "save": {**save, "bf16": bf16},
            "load": {**load, "bf16": bf16}, "load_kwargs": load_kwargs, "dir": str(tmp_path / "ckpt")}
    return [r["value"] for r in launch(checkpoint_worker, 2, spec, timeout_s=280)]


def _merge(results: list[dict], key: str) -> dict:
    return {n: t for res in results for n, t in res[key].items()}


STOCK, ZBV = {"schedule": None}, {"schedule": "zb-v", "chunks": 2, "placement": "vshape"}


@pytest.mark.slow
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(300)
def test_checkpoints_resume_exactly_and_optimizer_states_never_land_on_other_layers(tmp_path):
    """A checkpoint saved under a placement resumes exactly under it (weights, optimizer states,
    the next steps' losses). Loaded under another placement (here the stock engine's cut, then
    the V-shape, which puts layers 0 and 3 on rank 0), the weights load (DeepSpeed writes them
    per layer) but each rank's optimizer states would belong to other layers: every rank refuses
    them in one line before anything loads. DeepSpeed loaded them silently: the momentum of
    layers 0-1 went to layers 0 and 3."""
    for res in _checkpoint(tmp_path / "v", ZBV, ZBV):
        assert res["resumed"] == res["straight"]
        assert all(torch.equal(res["saved"][n], res["loaded"][n]) for n in res["saved"])
    for res in _checkpoint(tmp_path / "refused", STOCK, ZBV):
        assert res["error"] == "ScheduleFitError" and "\n" not in res["text"]
        assert "saved by the stock engine with pipeline rank 0 holding layers 0-1; this run's placement gives " \
               "it layers 0 and 3" in res["text"] and "load_module_only=True" in res["text"]
    weights = _checkpoint(tmp_path / "weights", STOCK, ZBV, load_optimizer_states=False)
    saved, loaded = _merge(weights, "saved"), _merge(weights, "loaded")
    assert set(saved) == set(loaded) and all(torch.equal(saved[n], loaded[n]) for n in saved)
    for res in weights:  # step 3 as straight (same weights, no momentum yet used); step 4 without the momentum
        assert res["resumed"][:3] == res["straight"][:3] and res["resumed"][3] != res["straight"][3]


@pytest.mark.slow
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(300)
def test_bf16_weights_only_load_trains_from_the_loaded_weights(tmp_path):
    """bf16 (DeepSpeed's bf16 optimizer keeps fp32 master weights): weights loaded without the
    optimizer states train from the loaded weights, as with load_module_only=True. DeepSpeed
    0.19.8 left the masters at their old values under load_optimizer_states=False, so the first
    step put the old weights back (stock engine too)."""
    plain = _checkpoint(tmp_path / "plain", STOCK, ZBV, bf16=True, load_optimizer_states=False)
    module_only = _checkpoint(tmp_path / "module", STOCK, ZBV, bf16=True, load_module_only=True)
    assert [r["resumed"] for r in plain] == [r["resumed"] for r in module_only]
    a, b = _merge(plain, "trained"), _merge(module_only, "trained")
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.slow
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(300)
def test_bf16_checkpoints_resume_exactly_with_their_optimizer_states(tmp_path):
    """bf16 (DeepSpeed's bf16 optimizer, no ZeRO): a checkpoint loaded with its optimizer states
    (the fp32 master weights and the momentum) resumes exactly: steps 3-4 give the straight run's
    losses and weights. DeepSpeed 0.19.8 looked for those states in the model-states file and
    failed with `KeyError: 0` (stock engine too); they are in its bf16_zero_*_optim_states.pt.
    With ZeRO stage 1 (DeepSpeed's own path, BLOOM's set-up) it resumes exactly as well."""
    zero1 = {**ZBV, "zero": {"stage": 1}}
    for label, case in (("bf16", ZBV), ("bf16-zero1", zero1)):
        for res in _checkpoint(tmp_path / label, case, case, bf16=True):
            assert "error" not in res, (label, res.get("text"))
            assert res["resumed"] == res["straight"], label
            assert all(torch.equal(res["trained"][n], res["straight_trained"][n]) for n in res["trained"]), label


@pytest.mark.slow
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(400)
def test_bf16_split_schedules_match_stock():
    """bf16 with DeepSpeed's bf16 optimizer (its gradient hand-over around every B, I and W): the
    split schedules, whose W adds bf16 weight gradients in their GEMMs, train as stock DeepSpeed
    does, to within bf16 rounding (losses equal; parameters a few bf16 steps apart at most)."""
    cases = [{**_stock(clip=0.0), "label": "stock-bf16", "bf16": True},
             {**_case("zb-h1", clip=0.0), "label": "zb-h1-bf16", "bf16": True},
             {**_case("zb-v", "vshape", clip=0.0), "label": "zb-v-bf16", "bf16": True},
             {**_case("1f1b", clip=0.0), "label": "1f1b-bf16", "bf16": True}]
    results = launch(train_worker, 2, _spec(2, cases), timeout_s=380)
    for label in ("zb-h1-bf16", "zb-v-bf16", "1f1b-bf16"):
        for res in results:
            mine, stock = res["value"]["cases"][label], res["value"]["cases"]["stock-bf16"]
            assert mine["engine"] == "KoalaPipelineEngine" and stock["engine"] == "PipelineEngine"
            assert mine["losses"] == stock["losses"] and mine["eval"] == stock["eval"], label
        mine, stock = _merged(results, label, 0), _merged(results, "stock-bf16", 0)
        assert all(t.dtype == torch.bfloat16 for t in stock.values())
        worst = max(((mine[n].float() - stock[n].float()).abs().max() / stock[n].float().abs().max()).item()
                    for n in stock)
        assert worst <= 2 ** -6, f"{label}: parameters {worst} apart (relative) from stock in bf16"
    assert len(set(results[0]["value"]["cases"]["stock-bf16"]["losses"])) > 1  # it trained


# -- failures ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["hang", "kill"])
def test_mismatch_is_refused_before_communication_and_a_lost_peer_times_out(tmp_path, mode):
    """Rank 1 stops answering (sleeps) or dies after set-up: rank 0 fails with a clear error."""
    wrong_m = tmp_path / "m2.json"
    wrong_m.write_text(load_schedule("1f1b", 2, 2).to_json())
    spec = {"pp": 2, "gas": 4, "mbs": 2, "dim": 8, "schedule": "1f1b", "timeout_s": 3, "hung_rank": 1,
            "mismatch": str(wrong_m), "mode": mode}
    results = launch(hang_worker, 2, spec, timeout_s=150, allow_failures=True, wait_ranks=[0])
    rank0 = results[0]
    assert rank0["ok"], rank0
    value = rank0["value"]
    assert value["error"] == "PipelineTimeoutError", value
    assert "rank 0" in value["message"] and "from rank 1" in value["message"]
    if mode == "hang":  # a timeout names the setting to raise
        assert "after 3 s" in value["message"] and "timeout_s" in value["message"], value["message"]
    else:  # a peer that died is reported as such, not as a timeout
        assert "closed the connection or crashed" in value["message"], value["message"]
    assert value["elapsed"] < 30
    # the m=2 schedule file was refused on every rank, naming the key to change, and since that
    # happened before any communication the next engine in the same process group worked
    assert "gradient_accumulation_steps=2" in value["refused"] and "m2.json" in value["refused"]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("stop_before", ["_aggregate_total_loss", "clip_fp32_gradients"])
def test_a_peer_stopped_inside_the_step_ends_the_other_rank_within_the_timeout(stop_before):
    """Rank 1 SIGSTOPs itself after its point-to-point work, just before DeepSpeed's end-of-step
    loss broadcast or the gradient-clipping all-reduce: rank 0 must raise PipelineTimeoutError
    within timeout_s (those collectives used to wait DeepSpeed's process-group timeout) and end."""
    import time

    timeout = 3
    spec = {"pp": 2, "gas": 4, "mbs": 2, "dim": 8, "schedule": "1f1b", "timeout_s": timeout, "hung_rank": 1,
            "mode": "stop", "stop_before": stop_before}
    results = launch(hang_worker, 2, spec, timeout_s=150, pg_timeout_s=100, allow_failures=True, wait_ranks=[0])
    ended = time.time()
    rank0 = results[0]
    assert rank0["ok"], rank0
    value = rank0["value"]
    assert value["error"] == "PipelineTimeoutError", value
    assert "DeepSpeed's" in value["message"] and f"after {timeout} s" in value["message"], value["message"]
    assert value["elapsed"] < timeout + 10, value
    assert ended - value["raised_at"] < 10, "rank 0 raised in time but took too long to end"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_rank_stopped_while_saving_ends_the_others_within_the_timeout(tmp_path):
    """save_checkpoint's last barrier (all ranks wait for rank 0's koala_layout.json) is bounded
    by the step's timeout, as the step's collectives are."""
    timeout = 3
    spec = {"pp": 2, "gas": 4, "mbs": 2, "dim": 8, "timeout_s": timeout, "dir": str(tmp_path / "ckpt")}
    results = launch(save_hang_worker, 2, spec, timeout_s=150, pg_timeout_s=100, allow_failures=True,
                     wait_ranks=[1])
    assert results[1]["ok"], results[1]
    value = results[1]["value"]
    assert value["error"] == "PipelineTimeoutError", value
    assert "barrier" in value["message"] and f"after {timeout} s" in value["message"], value["message"]
    assert value["elapsed"] < timeout + 20, value


# -- the launcher patch --------------------------------------------------------------------
_LAUNCHED = textwrap.dedent('''
    import importlib, json, os, sys
    import deepspeed, torch
    from deepspeed.pipe import PipelineModule
    # The CPU shared-memory allreduce op would be rebuilt for the copied package; it is not
    # what this test is about.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(4)]
    model = PipelineModule(layers, num_stages=2, loss_fn=torch.nn.functional.mse_loss, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "train_batch_size": 8,
              "steps_per_print": 10 ** 9, "pipeline": {"pipe_partitioned": False, "grad_partitioned": False}}
    plugin_before = "koala_ds.deepspeed" in sys.modules
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    data = [(torch.randn(2, 8), torch.randn(2, 8)) for _ in range(4)]
    loss = float(engine.train_batch(iter(data)))
    schedule = getattr(engine, "koala_schedule", None)
    print("RESULT " + json.dumps({"rank": int(os.environ["RANK"]), "engine": type(engine).__name__,
          "deepspeed": deepspeed.__file__, "plugin_before": plugin_before,
          "env": os.environ.get("DS_PIPELINE_SCHEDULE"), "schedule": schedule and schedule.name,
          "buffers": engine.num_pipe_buffers, "loss": loss}), flush=True)
''')


@pytest.fixture(scope="module")
def patched_deepspeed(tmp_path_factory) -> Path:
    """A copy of the installed DeepSpeed with patches/deepspeed applied (the folder that holds it)."""
    import deepspeed

    if shutil.which("patch") is None:
        pytest.skip("the `patch` program is not installed")
    installed = Path(deepspeed.__file__).parent
    copy = tmp_path_factory.mktemp("site")
    shutil.copytree(installed, copy / "deepspeed", ignore=shutil.ignore_patterns("__pycache__"))
    patch_file = REPO / "patches" / "deepspeed" / "0001-pipeline-schedule-koala.patch"
    applied = subprocess.run(["patch", "-p1", "--forward", "-i", str(patch_file)], cwd=copy,
                             capture_output=True, text=True, timeout=60)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert "FAILED" not in applied.stdout and "offset" not in applied.stdout, applied.stdout
    return copy


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags, says", [
    (["--pipeline_schedule", "default", "--koala_schedule", "zb-h1"],
     "--koala_schedule/--koala_profile need --pipeline_schedule koala, not default"),
    (["--koala_schedule", "zb-h3"], "--koala_schedule: unknown schedule 'zb-h3' (did you mean 'zb-h2'?)"),
    (["--koala_schedule", "mine.koala"], "--koala_schedule mine.koala:3:"),
], ids=["default-and-koala", "unknown-name", "syntax-error"])
def test_the_patched_launcher_stops_bad_koala_flags_with_one_line_before_any_rank(patched_deepspeed, tmp_path,
                                                                                   flags, says):
    """Checked by the launcher itself: one line, exit code 2, no traceback and no rank started
    (once a ValueError traceback from the launcher, or a traceback from every rank)."""
    (tmp_path / "mine.koala").write_text("schedule mine\nrank:\n  F F *\n")
    (tmp_path / "train.py").write_text("open('started', 'w').close()\n")
    env = {**os.environ, "PYTHONPATH": f"{patched_deepspeed}{os.pathsep}{REPO}", "DS_ACCELERATOR": "cpu"}
    run = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", *flags, "train.py"],
                         env=env, capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"deepspeed: error: {says}"), run.stderr
    assert not (tmp_path / "started").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launcher_patch_applies_and_the_flag_reaches_the_engine(patched_deepspeed, tmp_path):
    copy = patched_deepspeed
    script = tmp_path / "train.py"
    script.write_text(_LAUNCHED)
    env = {**os.environ, "PYTHONPATH": f"{copy}{os.pathsep}{REPO}", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": str(DEFAULT_EXTENSIONS_DIR)}
    env.pop("DS_PIPELINE_SCHEDULE", None)
    from rank_processes import on_a_free_port

    def launch(port: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", port,
               "--pipeline_schedule", "koala", "--koala_schedule", "zb-h1", str(script)]
        try:
            return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
        finally:
            remove_deepspeed_shm(int(port))

    run = on_a_free_port(launch)  # again on a new port when another process took this one first
    # two ranks print to one pipe: their lines may interleave, so pick the JSON objects out
    lines = sorted((json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", run.stdout)), key=lambda r: r["rank"])
    assert len(lines) == 2, run.stdout[-3000:] + run.stderr[-3000:]
    for res in lines:
        assert res["deepspeed"].startswith(str(copy)), res  # the patched copy ran
        assert res["plugin_before"] is False  # nothing but the patch brought the plugin in
        assert res["env"] == "koala"
        assert res["engine"] == "KoalaPipelineEngine" and res["schedule"] == "zb-h1"
    assert {res["buffers"] for res in lines} == {2, 1}  # zb-h1 holds p - r microbatches, not m
    assert lines[0]["loss"] == lines[1]["loss"]


@pytest.mark.slow
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(400)
def test_the_modules_additional_losses_are_reported_as_by_stock():
    """get_additional_losses (an MoE auxiliary loss, say): the Koala engine never added them up, so
    agg_additional_losses was 0 on the first rank and None on the last, and DeepSpeed's loss
    broadcast had 2 values on one side and 4 on the other."""
    cases = [{**_stock(), "aux": 0.25}, _case("zb-h1", aux=0.25), _case("zb-v", "vshape", aux=0.25)]
    results = launch(train_worker, 2, {**_spec(2, cases), "params": False}, timeout_s=380)
    for res in results:
        got = res["value"]["cases"]
        assert got["stock"]["additional"] == pytest.approx({"aux": 0.25, "z": 2.0}), got["stock"]
        for label in ("zb-h1", "zb-v"):
            assert got[label]["additional"] == pytest.approx(got["stock"]["additional"]), (label, got[label])
            assert all(_close(a, b) for a, b in zip(got[label]["losses"], got["stock"]["losses"])), label


_MISSPELT = textwrap.dedent('''
    import importlib, os, sys
    import deepspeed, torch
    from deepspeed.pipe import PipelineModule
    from koala_ds.core.errors import run_main

    def main():
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # not what this is about
        deepspeed.init_distributed(dist_backend="gloo")
        model = PipelineModule([torch.nn.Linear(4, 4)], num_stages=1, loss_fn=torch.nn.functional.mse_loss)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1,
                  "pipeline": {"schedule": "koalaa"}}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                          config=config)
        print("ENGINE", type(engine).__name__, "koala_ds.deepspeed" in sys.modules)

    run_main(main, "train.py")
''')


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_patched_initialize_refuses_a_misspelt_pipeline_schedule(patched_deepspeed, tmp_path):
    """With the launcher patch and no koala_ds import in the script, "pipeline.schedule": "koalaa"
    ran DeepSpeed's own engine without a word (the patch imported the plugin only for "koala")."""
    from koala_ds.runtime.spawn import free_port

    script = tmp_path / "train.py"
    script.write_text(_MISSPELT)
    env = {**os.environ, "PYTHONPATH": f"{patched_deepspeed}{os.pathsep}{REPO}", "DS_ACCELERATOR": "cpu",
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    env.pop("DS_PIPELINE_SCHEDULE", None)
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180,
                         cwd=tmp_path)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "ENGINE" not in run.stdout
    error = [x for x in run.stderr.splitlines() if "error:" in x]
    assert len(error) == 1 and "\"pipeline.schedule\" is 'koalaa' (did you mean 'koala'?)" in error[0], run.stderr


@pytest.mark.slow
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(400)
def test_schedules_taking_turns_on_one_engine_train_as_one_schedule_does():
    """set_koala_schedule (examples/deepspeed_pipe --alternate-schedules): 1f1b and zb-h1 taking
    turns give the losses of 1f1b throughout; after zb-h1 prepared the module for deferred weight
    gradients, 1f1b's forwards run plain (an unprepared module's cost); a schedule of another
    placement is one line naming the call."""
    from deepspeed_jobs import switch_worker

    turns = ["1f1b", "zb-h1", "zb-h1", "1f1b", "zb-h1", "1f1b"]
    spec = {**_spec(2, []), "first": "1f1b", "turns": turns, "misfit": "zb-v"}
    results = launch(switch_worker, 2, spec, timeout_s=300)
    for res in results:
        value = res["value"]
        assert value["turns"]["names"] == turns and value["one"]["names"] == ["1f1b"] * len(turns)
        assert value["turns"]["losses"] == pytest.approx(value["one"]["losses"], rel=1e-6)
        # before zb-h1's first step nothing is prepared; zb-h1 defers (not plain); 1f1b after it: plain
        assert value["turns"]["plain"] == [[False], [False], [False], [True], [False], [True]]
        assert value["one"]["plain"] == [[False]] * len(turns)
        assert value["misfit"].startswith("set_koala_schedule('zb-v')") and "\n" not in value["misfit"]
