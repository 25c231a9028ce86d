"""The Koala section of a DeepSpeed config, its environment variables, and the schedule it names."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.pipe.module import PipelineModule

from ..core.ir import KoalaError, Placement, Schedule
from ..core.validate import validate
from ..resolve import DEEPSPEED, ScheduleFitError, check_fit, load
from ..runtime.lowering import LookaheadSettingError, recv_lookahead
from ..runtime.timeout import DEFAULT_TIMEOUT_S, ENV_TIMEOUT, TimeoutSettingError, timeout_setting
from ..runtime.trace_record import check_trace_path

#: Environment variables read when the config does not say (set by the patched launcher).
ENV_PIPELINE_SCHEDULE = "DS_PIPELINE_SCHEDULE"
ENV_KOALA_SCHEDULE = "KOALA_SCHEDULE"
ENV_KOALA_PROFILE = "KOALA_PROFILE"
ENV_KOALA_TRACE = "KOALA_TRACE"
ENV_KOALA_TIMEOUT = ENV_TIMEOUT  # KOALA_TIMEOUT_S (KOALA_P2P_TIMEOUT is read too): see koala_ds.runtime.timeout
#: The values of `"pipeline": {"schedule": ...}` (and DS_PIPELINE_SCHEDULE): DeepSpeed's own engine or Koala's.
PIPELINE_SCHEDULES = ("default", "koala")


#: The DeepSpeed adapter's name for `koala_ds.resolve.ScheduleFitError` (the same class): the
#: DeepSpeed setup and the Koala schedule do not fit together; the message says what to change.
KoalaConfigError = ScheduleFitError


class PipelineTimeoutError(TimeoutError):
    """A pipeline rank waited longer than `pipeline.koala.timeout_s` for a peer (or the wait
    failed before: the message says which)."""


@dataclass(frozen=True)
class KoalaPipelineConfig:
    """The `"pipeline": {"schedule": "koala", "koala": {...}}` section of a DeepSpeed config."""

    schedule: Any = None  # library name, .koala / .json path, or a Schedule
    profile: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    timeout_source: str = "the default"  # the setting timeout_s came from, for messages
    parts: Any = None  # the model's layer boundaries (checked against the module; see module.py)
    profile_source: str = DEEPSPEED.profile  # the setting profile came from, for messages
    trace: str | None = None  # FILE: every process records its steps' timeline (koala_ds.runtime.trace_record)
    trace_source: str = '"pipeline.koala.trace"'  # the setting trace came from, for messages

    @classmethod
    def from_pipeline_section(cls, section: dict | None, env: dict | None = None) -> "KoalaPipelineConfig":
        env = os.environ if env is None else env
        koala = (section or {}).get("koala") or {}
        if not isinstance(koala, dict):
            raise KoalaConfigError(f'DeepSpeed config "pipeline.koala" must be an object, got {koala!r}')
        unknown = set(koala) - {"schedule", "profile", "timeout_s", "parts", "trace"}
        if unknown:
            raise KoalaConfigError(f'DeepSpeed config "pipeline.koala": unknown keys {sorted(unknown)} '
                                   f'(known: schedule, profile, timeout_s, parts, trace)')
        try:
            timeout, source = timeout_setting(koala.get("timeout_s"), '"pipeline.koala.timeout_s"', env)
        except TimeoutSettingError as exc:
            raise KoalaConfigError(str(exc)) from None
        profile, profile_source = koala.get("profile"), DEEPSPEED.profile
        if profile is None and env.get(ENV_KOALA_PROFILE):
            profile, profile_source = env[ENV_KOALA_PROFILE], ENV_KOALA_PROFILE
        schedule = koala.get("schedule")
        if schedule is not None and not isinstance(schedule, Schedule) and (not isinstance(schedule, str)
                                                                              or not schedule.strip()):
            raise KoalaConfigError(f'DeepSpeed config "pipeline.koala.schedule" is {schedule!r}: give a library '
                                   f'name, a .koala / .json / .csv file, or drop the key (default 1f1b)')
        trace, trace_source = _trace_setting(koala.get("trace"), env)
        try:  # read by the engine (koala_ds.runtime.lowering.recv_lookahead); checked before training
            recv_lookahead(True, env)
        except LookaheadSettingError as exc:
            raise KoalaConfigError(str(exc)) from None
        return cls(schedule or env.get(ENV_KOALA_SCHEDULE) or None, profile, timeout, source,
                   koala.get("parts"), profile_source, trace, trace_source)


def _trace_setting(value, env) -> tuple[str | None, str]:
    """(FILE or None, the setting it came from): "pipeline.koala.trace", else KOALA_TRACE; the
    folder is checked now, before training (koala_ds.runtime.trace_record)."""
    source, label = '"pipeline.koala.trace"', 'DeepSpeed config "pipeline.koala.trace"'
    if value is None and env.get(ENV_KOALA_TRACE):
        value, source = env[ENV_KOALA_TRACE], ENV_KOALA_TRACE
        label = source
    if value is None:
        return None, source
    if not isinstance(value, str) or not value.strip():
        raise KoalaConfigError(f"{label} is {value!r}: give a file name (each process writes "
                               f"FILE.rank<global rank>.json), or drop the key")
    try:
        check_trace_path(value, label)
    except KoalaError as exc:
        raise KoalaConfigError(str(exc)) from None
    return value, source


def koala_requested(pipeline_section: dict | None, env: dict | None = None) -> bool:
    """True when the config (`pipeline.schedule`) or the launcher (DS_PIPELINE_SCHEDULE) asks for Koala;
    KoalaConfigError for a value that is neither "koala" nor "default"."""
    return pipeline_schedule(pipeline_section, env) == "koala"


def pipeline_schedule(pipeline_section: dict | None, env: dict | None = None) -> str:
    """"koala" or "default", from `"pipeline": {"schedule": ...}` or else DS_PIPELINE_SCHEDULE."""
    env = os.environ if env is None else env
    value = (pipeline_section or {}).get("schedule")
    where = 'DeepSpeed config "pipeline.schedule"'
    if value is None or value == "":
        value = env.get(ENV_PIPELINE_SCHEDULE) or "default"
        where = f"{ENV_PIPELINE_SCHEDULE} (the launcher's --pipeline_schedule)"
    text = str(value).lower()
    if text not in PIPELINE_SCHEDULES:
        from ..library import did_you_mean

        raise KoalaConfigError(f"{where} is {value!r}{did_you_mean(text, list(PIPELINE_SCHEDULES))}; "
                               f"valid values: {', '.join(map(repr, PIPELINE_SCHEDULES))} (default: DeepSpeed's "
                               f"own schedule; the Koala schedule itself goes in \"pipeline.koala.schedule\")")
    return text


def module_placement(model: PipelineModule) -> Placement:
    """The placement a module implements: `KoalaPipelineModule`'s, else linear over its ranks."""
    placement = getattr(model, "koala_placement", None)
    if placement is not None:
        return placement
    return Placement.named("linear", model._topo.get_dim("pipe"), 1)


def resolve_schedule(spec: Any, p: int, m: int, v: int) -> Schedule:
    """A `Schedule` from a Schedule, a library name or a .koala file (compiled for p, m, v), or a
    schedule .json / .csv file (as written: `check_schedule` checks it); errors name DeepSpeed's
    settings (`koala_ds.resolve.load`)."""
    return load(spec, p, m, v, DEEPSPEED)


def check_schedule(schedule: Schedule, placement: Placement, m: int, source: str) -> None:
    """Refuse a schedule this engine cannot run, naming the property and what to change
    (`koala_ds.resolve.check_fit` against the module's placement, then validation)."""
    check_fit(schedule, placement.p, m, placement.chunks_per_rank, DEEPSPEED,
              f"Koala schedule {schedule.name!r} (from {source})", placement)
    validate(schedule)


def ensure_config_class(kwargs: dict) -> DeepSpeedConfig:
    """The DeepSpeedConfig that `PipelineEngine(**kwargs)` will use, built once and stored in
    `kwargs["config_class"]` (as `deepspeed.initialize` does) so the schedule can be checked first."""
    if kwargs.get("config_class") is None:
        config = kwargs.get("config")
        if config is None and kwargs.get("args") is not None:
            config = getattr(kwargs["args"], "deepspeed_config", None)
        kwargs["config_class"] = DeepSpeedConfig(config, kwargs["model"].mpu())
    return kwargs["config_class"]
