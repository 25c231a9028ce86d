"""A given (searched) cut on DeepSpeed: `KoalaPipelineModule(..., parts=[0, a, ..., n])` or the
config key "pipeline.koala.parts". Uneven cuts train exactly as DeepSpeed's stock engine on its
own cut of the same layers (the single-process-equivalent reference of
tests/test_deepspeed_pipeline.py); bad parts are one line naming the argument or the key."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("deepspeed")
torch = pytest.importorskip("torch")

from koala_ds.deepspeed import KoalaConfigError, KoalaPipelineConfig  # noqa: E402
from koala_ds.deepspeed.module import PARTS_KEY, check_model_parts, check_parts, parts_from_config  # noqa: E402
from deepspeed_jobs import launch, train_worker  # noqa: E402
from koala_ds.core.ir import KoalaError  # noqa: E402

TOL = 1e-6
GAS, MBS, DIM, BLOCKS, STEPS = 8, 2, 8, 8, 3


@pytest.mark.parametrize("parts,match", [
    ([0, 4], r"has 2 entries; expected 3 layer boundaries \[0, \.\.\., 8\] for num_stages=2 x chunks=1"),
    ([0, 4, 9], r"must start at 0 and end at 8"),
    ([1, 4, 8], r"must start at 0"),
    ([0, 8, 8], r"virtual stage 1 gets no layer \(parts\[1\] = 8 >= parts\[2\] = 8\)"),
    ("0,4,8", r"expected a list of 3 layer boundaries"),
    ([0, 4.0, 8], r"expected a list"),
    ([0, True, 8], r"expected a list"),
])
def test_bad_parts_are_one_line_naming_the_argument(parts, match):
    with pytest.raises(KoalaError, match=match) as info:
        check_parts(parts, 2, 1, 8, "KoalaPipelineModule(parts=...)")
    assert "\n" not in str(info.value) and str(info.value).startswith("KoalaPipelineModule(parts=...)")


def test_parts_per_virtual_stage_with_chunks():
    assert check_parts((0, 1, 4, 7, 8), 2, 2, 8, "x") == [0, 1, 4, 7, 8]
    with pytest.raises(KoalaError, match=r"5 layer boundaries .* num_stages=2 x chunks=2"):
        check_parts([0, 4, 8], 2, 2, 8, "x")


def test_config_key_is_read_from_a_dict_or_a_file_and_checked_against_the_model(tmp_path):
    config = {"pipeline": {"schedule": "koala", "koala": {"schedule": "1f1b", "parts": [0, 3, 8]}}}
    assert parts_from_config(config) == [0, 3, 8]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    assert parts_from_config(str(path)) == [0, 3, 8]
    assert parts_from_config({"pipeline": {}}) is None
    with pytest.raises(KoalaError, match=r"cannot read the DeepSpeed config"):
        parts_from_config(str(tmp_path / "missing.json"))
    assert KoalaPipelineConfig.from_pipeline_section(config["pipeline"], env={}).parts == [0, 3, 8]
    model = SimpleNamespace(_layer_specs=[None] * 8, parts=[0, 4, 8])  # what the check reads of a module
    with pytest.raises(KoalaError, match=r'"pipeline.koala.parts" is \[0, 3, 8\] but the model was cut at '
                                         r'\[0, 4, 8\]: build it as .*KoalaPipelineModule\(layers, num_stages=2, '
                                         r'chunks=1, parts=\[0, 3, 8\]\)'):
        check_model_parts(model, [0, 3, 8], 2, 1)
    check_model_parts(model, [0, 4, 8], 2, 1)
    with pytest.raises(KoalaError, match=PARTS_KEY.replace(".", r"\.") + r" = \[0, 9, 8\]"):
        check_model_parts(model, [0, 9, 8], 2, 1)


def test_unknown_koala_keys_still_listed_with_parts():
    with pytest.raises(KoalaConfigError, match=r"known: schedule, profile, timeout_s, parts"):
        KoalaPipelineConfig.from_pipeline_section({"koala": {"part": [0, 1]}}, env={})


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(b))


@pytest.mark.slow
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(420)
def test_uneven_parts_train_exactly_as_the_stock_engine():
    cases = [{"label": "stock", "schedule": None}, {"label": "stock-noclip", "schedule": None, "clip": 0.0},
             {"label": "zb-h1-2+6", "schedule": "zb-h1", "parts": [0, 2, 8]},
             {"label": "1f1b-5+3-config", "schedule": "1f1b", "koala": {"parts": [0, 5, 8]}, "module_config": True},
             {"label": "zb-v-1+3+3+1", "schedule": "zb-v", "chunks": 2, "placement": "vshape", "parts": [0, 1, 4, 7, 8]},
             {"label": "interleaved-3+1+2+2-noclip", "schedule": "interleaved-1f1b", "chunks": 2,
              "placement": "interleaved", "parts": [0, 3, 4, 6, 8], "clip": 0.0}]
    spec = {"pp": 2, "gas": GAS, "mbs": MBS, "dim": DIM, "blocks": BLOCKS, "steps": STEPS, "cases": cases,
            "target_scale": 100.0}
    results = launch(train_worker, 2, spec, timeout_s=400)
    for case in cases[2:]:
        ref = "stock-noclip" if case.get("clip") == 0.0 else "stock"
        for res in results:
            mine, stock = res["value"]["cases"][case["label"]], res["value"]["cases"][ref]
            assert mine["engine"] == "KoalaPipelineEngine" and stock["engine"] == "PipelineEngine"
            assert all(_close(a, b) for a, b in zip(mine["losses"], stock["losses"])), \
                f"{case['label']}: {mine['losses']} vs {ref} {stock['losses']}"
            assert _close(mine["eval"], stock["eval"]), case["label"]
            assert mine["losses"][0] != mine["losses"][-1]
        mine = {n: t for res in results for n, t in res["value"]["cases"][case["label"]]["params"].items()}
        stock = {n: t for res in results for n, t in res["value"]["cases"][ref]["params"].items()}
        assert set(mine) == set(stock)
        worst = max(((mine[n] - stock[n]).abs().max() / stock[n].abs().max().clamp(min=1.0)).item() for n in stock)
        assert worst <= TOL, f"{case['label']}: parameters differ from {ref} by {worst}"
    # the cut took effect: rank 0 holds layers 0-1 only with parts [0, 2, 8] (stock: 0-3)
    rank0 = next(r for r in results if r["value"]["pipe"] == 0)["value"]["cases"]
    assert {n.split(".")[0] for n in rank0["zb-h1-2+6"]["params"]} == {"0", "1"}
    assert {n.split(".")[0] for n in rank0["stock"]["params"]} == {"0", "1", "2", "3"}
