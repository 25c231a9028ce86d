"""Make `deepspeed.initialize` build the Koala engine when asked, on an unpatched DeepSpeed.

`deepspeed.initialize` looks up `deepspeed.PipelineEngine` (a module global) when it is given
a `PipelineModule`. `install()` replaces that global with `EngineSelector`, which builds

- `KoalaPipelineEngine` when the config says `"pipeline": {"schedule": "koala", ...}`, when the
  environment says `DS_PIPELINE_SCHEDULE=koala` (what the patched launcher's
  `--pipeline_schedule koala` sets, with `--koala_schedule` in `KOALA_SCHEDULE`), or when the
  model is a `KoalaPipelineModule` with more than one chunk per rank;
- DeepSpeed's own engine otherwise (`DualPipeVEngine` for a `DualPipeVModule`).

`isinstance(engine, deepspeed.PipelineEngine)` keeps meaning "is a pipeline engine".
"""
from __future__ import annotations

import logging
import os

import deepspeed
from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine, DualPipeVModule
from deepspeed.runtime.pipe.engine import PipelineEngine

from ..core.errors import process_rank
from .config import ENV_KOALA_SCHEDULE, ENV_PIPELINE_SCHEDULE, KoalaConfigError, ensure_config_class, koala_requested
from .engine import KoalaPipelineEngine

logger = logging.getLogger(__name__)

__all__ = ["install", "uninstall", "installed", "select_engine_class", "EngineSelector"]


def select_engine_class(model, pipeline_section: dict | None) -> type:
    """The engine class for `model` under the config's `"pipeline"` section and the environment."""
    chunks = getattr(model, "koala_chunks", 1)
    wants = koala_requested(pipeline_section) or chunks > 1
    if isinstance(model, DualPipeVModule):
        if wants:
            raise KoalaConfigError("the model is DeepSpeed's DualPipeVModule, which only runs DeepSpeed's DualPipeV "
                                   "engine: build a koala_ds.deepspeed.KoalaPipelineModule(..., chunks=2, "
                                   "placement='vshape') to run dualpipe-v with Koala")
        return DualPipeVEngine
    if not wants:
        _warn_unused_koala_settings(pipeline_section)
    return KoalaPipelineEngine if wants else PipelineEngine


def _warn_unused_koala_settings(pipeline_section: dict | None) -> None:
    """Koala settings while DeepSpeed's own engine is chosen: said once, on rank 0, not refused (a
    config can keep them to compare with the stock schedule)."""
    given = ['"pipeline.koala"'] if isinstance((pipeline_section or {}).get("koala"), dict) else []
    given += [ENV_KOALA_SCHEDULE] if os.environ.get(ENV_KOALA_SCHEDULE) else []
    if given and process_rank() == 0:
        logger.warning("%s set, but DeepSpeed's own pipeline engine and schedule run (\"pipeline.schedule\" is not "
                       "\"koala\", nor %s): the Koala settings are ignored; set \"pipeline\": {\"schedule\": "
                       "\"koala\"} to run them", " and ".join(given), ENV_PIPELINE_SCHEDULE)


class _SelectorMeta(type):
    def __call__(cls, *args, **kwargs):
        engine_cls = select_engine_class(kwargs.get("model"), ensure_config_class(kwargs).pipeline)
        logger.debug("deepspeed.initialize: pipeline engine %s", engine_cls.__name__)
        return engine_cls(*args, **kwargs)

    def __instancecheck__(cls, obj):
        return isinstance(obj, PipelineEngine)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, PipelineEngine)


class EngineSelector(metaclass=_SelectorMeta):
    """Stands in for `deepspeed.PipelineEngine`; calling it builds the selected engine."""


def install() -> None:
    """Route `deepspeed.initialize` through `EngineSelector` (idempotent)."""
    if deepspeed.PipelineEngine is not EngineSelector:
        deepspeed.PipelineEngine = EngineSelector


def uninstall() -> None:
    """Give `deepspeed.PipelineEngine` back to DeepSpeed's class."""
    deepspeed.PipelineEngine = PipelineEngine


def installed() -> bool:
    return deepspeed.PipelineEngine is EngineSelector
