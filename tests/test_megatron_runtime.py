"""The Megatron-core runtime on real megatron-core, CPU, gloo, several processes.

Two launches (tests/megatron_worker.py): 2 processes (PP=2 with v=1 and the PP=2, v=2 trap
case, plus bad inputs) and 4 processes (PP=4, PP=2 x TP=2, PP=2 x DP=2). Each runs every
schedule of its topologies in one go; the tests read the JSON it writes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rank_processes import on_a_free_port

pytestmark = pytest.mark.slow  # multi-process
torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = 1e-6
M = 4


@pytest.fixture(autouse=True, scope="module")
def _megatron_core():
    """Imported when a test here runs, not at collection, which every xdist worker pays (~3 s)."""
    pytest.importorskip("megatron.core")


def _launch(tmp_path_factory, world: int, suite: str, timeout: int) -> list[dict]:
    # a free port, not a fixed one: under xdist two workers may each launch a suite at once; and
    # again on a new one when another process took it before rank 0 bound it (EADDRINUSE)
    out = tmp_path_factory.mktemp(suite) / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = on_a_free_port(lambda port: subprocess.run(
        [sys.executable, os.path.join(HERE, "megatron_worker.py"), "--world", str(world), "--suite", suite,
         "--out", str(out), "--port", port], capture_output=True, text=True, timeout=timeout, env=env))
    assert proc.returncode == 0 and out.exists(), f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())["ranks"]


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    return _launch(tmp_path_factory, 2, "pp2", 400)


@pytest.fixture(scope="module")
def pp4(tmp_path_factory):
    return _launch(tmp_path_factory, 4, "pp4", 600)


def _entries(ranks, topology):
    found = [e for r in ranks for e in r["results"] if e["topology"] == topology]
    assert found, f"no results for {topology}"
    return found


def _check_step(entries, expect_schedules):
    assert sorted({e["schedule"] for e in entries}) == sorted(expect_schedules)
    for e in entries:
        where = f"{e['topology']} / {e['schedule']} / rank {e['rank']}"
        assert "error" not in e, f"{where}: {e.get('error')}"
        assert not e["missing_grads"], f"{where}: parameters without gradient {e['missing_grads']}"
        assert e["grad_abs_sum"] > 0, where
        assert e["max_grad_diff"] <= TOL, f"{where}: gradient differs from the single-process reference by {e['max_grad_diff']}"
        if "max_diff_vs_megatron" in e:
            assert e["max_diff_vs_megatron"] <= TOL, f"{where}: differs from megatron-core's 1F1B by {e['max_diff_vs_megatron']}"
        # contract: one loss dict per microbatch on the last pipeline rank, [] elsewhere
        if e["is_last_pp_rank"]:
            assert e["num_losses"] == M and e["loss_keys"] == ["lm loss"], where
            assert e["max_loss_diff"] <= TOL * 10, f"{where}: loss differs by {e['max_loss_diff']}"
        else:
            assert e["num_losses"] == 0, where
        if "fo_num_losses" in e:  # forward_only: same losses, no gradients
            assert e["fo_num_losses"] == (M if e["is_last_pp_rank"] else 0), where
            assert e["fo_max_loss_diff"] <= TOL * 10 and e["fo_grads"] == 0, where


@pytest.mark.timeout(450)
def test_pp2_gradients_match_reference_and_megatron_1f1b(pp2):
    entries = _entries(pp2, "pp2")
    _check_step(entries, ["megatron-1f1b", "1f1b", "zb-h1", "file:zb-h1"])
    assert any("max_diff_vs_megatron" in e for e in entries)


@pytest.mark.timeout(450)
def test_pp2_two_chunks_per_rank_is_exact(pp2):
    """The trap case: both neighbours are the same rank; activations and gradients share a channel."""
    _check_step(_entries(pp2, "pp2-v2"), ["interleaved-1f1b", "zb-v", "file:zb-v"])


@pytest.mark.timeout(450)
def test_pp2_loss_scaling_path_is_exact(pp2):
    """config.grad_scale_func (Megatron's loss scaler): gradients are the reference times the scale,
    as in megatron-core's own 1F1B, also with the split backward (zb-h1)."""
    entries = _entries(pp2, "pp2-scaled")
    _check_step(entries, ["megatron-1f1b", "1f1b", "zb-h1"])
    assert any("max_diff_vs_megatron" in e for e in entries)


@pytest.mark.timeout(450)
def test_bad_input_fails_before_communication(pp2):
    for rank in pp2:
        bad = rank["bad"]
        for case, must in {"pp_mismatch": "--pipeline-model-parallel-size",
                           "v_mismatch": "--virtual-pipeline-model-parallel-size",
                           "m_mismatch": "microbatches", "missing_file": "no such file"}.items():
            # MegatronScheduleError is the Megatron name of the one resolver error, ScheduleFitError
            assert bad[case]["koala"] and bad[case]["raised"] == "ScheduleFitError", (case, bad[case])
            assert must in bad[case]["message"], (case, bad[case]["message"])
            assert bad[case]["seconds"] < 5, case  # no wait on a peer (p2p timeout is 60 s)


@pytest.mark.timeout(650)
def test_pp4_gradients(pp4):
    _check_step(_entries(pp4, "pp4"), ["megatron-1f1b", "1f1b", "zb-h1", "file:zb-h1"])


@pytest.mark.timeout(650)
def test_pp2_tp2_gradients(pp4):
    _check_step(_entries(pp4, "pp2-tp2"), ["megatron-1f1b", "1f1b", "zb-h1"])


@pytest.mark.timeout(650)
def test_pp2_dp2_gradients(pp4):
    _check_step(_entries(pp4, "pp2-dp2"), ["1f1b", "zb-h1"])
