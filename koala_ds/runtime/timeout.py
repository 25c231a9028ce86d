"""The pipeline timeout of both engines: where it comes from and what values it may take.

One setting bounds every wait of a pipeline step, on DeepSpeed (`KoalaPipelineEngine`) and on
Megatron-core (`get_forward_backward_func`). In order of precedence it comes from:

1. the engine's own setting: `"pipeline": {"koala": {"timeout_s": ...}}` in the DeepSpeed
   config, `get_forward_backward_func(timeout_s=...)` or `--koala-p2p-timeout` for Megatron;
2. the environment variable `KOALA_TIMEOUT_S` (both engines);
3. `KOALA_P2P_TIMEOUT`, its older name (read when `KOALA_TIMEOUT_S` is unset);
4. `DEFAULT_TIMEOUT_S` (600 s).

A value must be a number of seconds from `MIN_TIMEOUT_S` (0.1 s: shorter deadlines would
fire on an ordinary scheduling hiccup, and gloo rounds a wait to milliseconds) to
`MAX_TIMEOUT_S` (about a year; a wait's timedelta overflows past ~8.6e13 s). A bad value
raises `TimeoutSettingError` in one line that names the setting it came from.
No torch import: the launchers check the setting before any process starts.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Mapping

from ..core.ir import KoalaError

log = logging.getLogger(__name__)

ENV_TIMEOUT = "KOALA_TIMEOUT_S"
#: older names, read when ENV_TIMEOUT is unset (the Megatron runtime used the first)
ENV_ALIASES = ("KOALA_P2P_TIMEOUT",)
DEFAULT_TIMEOUT_S = 600.0
MIN_TIMEOUT_S = 0.1
#: About a year: longer is no deadline at all, and a wait's timedelta overflows past ~8.6e13 s.
MAX_TIMEOUT_S = 3.2e7


class TimeoutSettingError(KoalaError, ValueError):
    """A timeout setting is not a number of seconds from MIN_TIMEOUT_S to MAX_TIMEOUT_S."""


def check_timeout(value, source: str) -> float:
    """`value` as seconds; `source` names where it came from (e.g. 'KOALA_TIMEOUT_S')."""
    shown = f"{source}={value!r}" if source.isidentifier() else f"{source} = {value!r}"  # VAR='x' / "key" = x
    need = (f"must be a number of seconds from {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g} "
            f"(default {DEFAULT_TIMEOUT_S:g})")
    if isinstance(value, bool):
        raise TimeoutSettingError(f"{shown}: the pipeline timeout {need}")
    try:
        seconds = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an integer past any float
        raise TimeoutSettingError(f"{shown}: the pipeline timeout {need}") from None
    if not math.isfinite(seconds) or not MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S:
        raise TimeoutSettingError(f"{shown}: the pipeline timeout {need}")
    return seconds


def timeout_from_env(env: Mapping[str, str] | None = None) -> tuple[float, str] | None:
    """(seconds, variable name) from KOALA_TIMEOUT_S or an alias; None when none is set
    (an empty value counts as unset)."""
    env = os.environ if env is None else env
    names = [n for n in (ENV_TIMEOUT, *ENV_ALIASES) if env.get(n, "").strip()]
    if not names:
        return None
    if len(names) > 1 and env[names[0]].strip() != env[names[1]].strip():
        log.warning("%s=%s overrides %s=%s", names[0], env[names[0]], names[1], env[names[1]])
    return check_timeout(env[names[0]].strip(), names[0]), names[0]


def timeout_setting(value=None, source: str = "timeout_s",
                    env: Mapping[str, str] | None = None) -> tuple[float, str]:
    """(seconds, the setting they came from): `value` (from the setting named `source`) when not
    None, else the environment (KOALA_TIMEOUT_S, then its aliases), else DEFAULT_TIMEOUT_S."""
    if value is not None:
        return check_timeout(value, source), source
    found = timeout_from_env(env)
    return (DEFAULT_TIMEOUT_S, "the default") if found is None else found


def resolve_timeout(value=None, source: str = "timeout_s", env: Mapping[str, str] | None = None) -> float:
    """The pipeline timeout in seconds (see `timeout_setting`)."""
    return timeout_setting(value, source, env)[0]
