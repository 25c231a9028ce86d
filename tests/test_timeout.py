"""The pipeline timeout setting shared by both engines (koala_ds.runtime.timeout) and how the engines
report a wait that ended without its message. Single process, no communication."""
from __future__ import annotations

import subprocess
import sys

import pytest

from koala_ds.runtime.timeout import (DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, MIN_TIMEOUT_S, TimeoutSettingError, check_timeout, resolve_timeout,
                              timeout_setting)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "abc", "-5", "0", "1e-9", "0.05", " ", "1e14"])
def test_bad_values_from_the_variable_name_the_variable(value):
    if not value.strip():
        assert timeout_setting(env={"KOALA_TIMEOUT_S": value}) == (DEFAULT_TIMEOUT_S, "the default")
        return
    with pytest.raises(TimeoutSettingError) as info:
        timeout_setting(env={"KOALA_TIMEOUT_S": value})
    message = str(info.value)
    assert message.startswith(f"KOALA_TIMEOUT_S={value!r}:"), message
    assert "pipeline.koala" not in message and "\n" not in message
    assert f"from {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g}" in message


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -5, 0, 1e-9, True, "x", [1], 1e14, 10 ** 400])
def test_bad_values_from_a_setting_name_the_setting(value):
    with pytest.raises(TimeoutSettingError, match=r'^"pipeline.koala.timeout_s" = '):
        check_timeout(value, '"pipeline.koala.timeout_s"')


def test_the_longest_timeout_is_one_a_wait_can_take():
    """1e14 s passed the check and overflowed the first wait's timedelta (a traceback on every
    rank); 10 ** 400 raised float()'s OverflowError from the check itself."""
    from koala_ds.runtime.bounded_collectives import _timedelta

    assert check_timeout(MAX_TIMEOUT_S, "KOALA_TIMEOUT_S") == MAX_TIMEOUT_S
    assert _timedelta(MAX_TIMEOUT_S).total_seconds() == MAX_TIMEOUT_S


def test_one_variable_for_both_engines_and_the_old_name_as_alias():
    assert timeout_setting(env={}) == (600.0, "the default")
    assert timeout_setting(env={"KOALA_TIMEOUT_S": "20"}) == (20.0, "KOALA_TIMEOUT_S")
    assert timeout_setting(env={"KOALA_P2P_TIMEOUT": "7.5"}) == (7.5, "KOALA_P2P_TIMEOUT")
    # the new name wins; a bad old name is reported under its own name
    assert timeout_setting(env={"KOALA_TIMEOUT_S": "20", "KOALA_P2P_TIMEOUT": "7"}) == (20.0, "KOALA_TIMEOUT_S")
    with pytest.raises(TimeoutSettingError, match="^KOALA_P2P_TIMEOUT='inf'"):
        timeout_setting(env={"KOALA_P2P_TIMEOUT": "inf"})
    # an explicit setting wins over the environment, and is checked under its own name
    assert timeout_setting(3, "timeout_s", env={"KOALA_TIMEOUT_S": "abc"}) == (3.0, "timeout_s")
    assert resolve_timeout(MIN_TIMEOUT_S) == MIN_TIMEOUT_S


def test_the_timeout_module_does_not_import_torch():
    code = "import sys, koala_ds.runtime.timeout; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# -- DeepSpeed ---------------------------------------------------------------------------
def test_deepspeed_config_names_where_the_timeout_came_from():
    pytest.importorskip("deepspeed")
    from koala_ds.deepspeed import KoalaConfigError, KoalaPipelineConfig

    for value in ("nan", "inf", "abc", "-5", "1e-9"):
        with pytest.raises(KoalaConfigError, match=f"^KOALA_TIMEOUT_S={value!r}"):
            KoalaPipelineConfig.from_pipeline_section({}, env={"KOALA_TIMEOUT_S": value})
    with pytest.raises(KoalaConfigError, match=r'^"pipeline.koala.timeout_s" = -5:'):
        KoalaPipelineConfig.from_pipeline_section({"koala": {"timeout_s": -5}}, env={})
    cfg = KoalaPipelineConfig.from_pipeline_section({}, env={"KOALA_P2P_TIMEOUT": "9"})
    assert (cfg.timeout_s, cfg.timeout_source) == (9.0, "KOALA_P2P_TIMEOUT")


# -- Megatron ----------------------------------------------------------------------------
def test_megatron_reads_the_same_variable_and_checks_it(monkeypatch):
    pytest.importorskip("megatron.core")
    from koala_ds.megatron import MegatronScheduleError, add_arguments, get_forward_backward_func, install

    monkeypatch.delenv("KOALA_P2P_TIMEOUT", raising=False)
    monkeypatch.setenv("KOALA_TIMEOUT_S", "12")
    func = get_forward_backward_func("1f1b")
    assert (func.timeout_s, func.timeout_source) == (12.0, "KOALA_TIMEOUT_S")
    monkeypatch.setenv("KOALA_TIMEOUT_S", "nan")
    with pytest.raises(TimeoutSettingError, match="^KOALA_TIMEOUT_S='nan'"):
        get_forward_backward_func("1f1b")
    with pytest.raises(TimeoutSettingError, match=r"^get_forward_backward_func\(timeout_s=...\) = inf"):
        get_forward_backward_func("1f1b", timeout_s=float("inf"))
    import argparse

    args = add_arguments(argparse.ArgumentParser()).parse_args(
        ["--pipeline-schedule", "koala", "--koala-schedule", "1f1b", "--koala-p2p-timeout", "inf"])
    with pytest.raises(MegatronScheduleError, match="^--koala-p2p-timeout = inf"):
        install(args)


class _FailingWork:
    """A gloo work whose wait raises at once (peer gone) or after the timeout."""

    def __init__(self, message: str, delay: float = 0.0) -> None:
        self.message, self.delay = message, delay

    def wait(self, timeout=None):
        import time

        time.sleep(self.delay)
        raise RuntimeError(self.message)


def _p2p(timeout_s: float):
    pytest.importorskip("torch")
    from koala_ds.megatron.p2p import P2P

    return P2P(0, None, (1,), None, timeout_s, None, gloo=True, timeout_source="KOALA_TIMEOUT_S")


def test_megatron_p2p_says_a_peer_closed_the_connection_not_that_time_ran_out():
    from koala_ds.megatron.p2p import P2PTimeoutError

    with pytest.raises(P2PTimeoutError) as info:
        _p2p(600)._wait(_FailingWork("Connection closed by peer [127.0.0.1]:1234"), "receive X from pipeline rank 1")
    message = str(info.value)
    assert "within 600 s" not in message and "before the 600 s timeout" in message, message
    assert "closed it or crashed" in message and "Connection closed by peer" in message


def test_megatron_p2p_timeout_names_the_setting():
    from koala_ds.megatron.p2p import P2PTimeoutError

    with pytest.raises(P2PTimeoutError) as info:
        _p2p(0.2)._wait(_FailingWork("Timed out waiting 200ms", delay=0.2), "receive X from pipeline rank 1")
    message = str(info.value)
    assert "within 0.2 s" in message and "timeout from KOALA_TIMEOUT_S" in message, message
