"""DeepSpeed adapter: run Koala schedules on DeepSpeed's pipeline engine.

Importing this package registers the engine with `deepspeed.initialize` (see `install`).
Then a config with `"pipeline": {"schedule": "koala", "koala": {"schedule": "zb-h1"}}`, or the
patched launcher's `--pipeline_schedule koala --koala_schedule zb-h1`, selects it. See
docs/deepspeed.md.
"""
from .config import KoalaConfigError, KoalaPipelineConfig, PipelineTimeoutError, check_schedule, resolve_schedule
from .engine import KoalaPipelineEngine
from .install import EngineSelector, install, installed, select_engine_class, uninstall
from .module import KoalaPipelineModule
from .schedule import (BackwardInputPass, BackwardWeightPass, KoalaInferenceSchedule, KoalaPipeSchedule, WaitSends)
from .teardown import install_exit_wait, wait_for_gloo_workers

__all__ = ["KoalaPipelineEngine", "KoalaPipelineModule", "KoalaPipeSchedule", "KoalaInferenceSchedule",
           "KoalaPipelineConfig", "KoalaConfigError", "PipelineTimeoutError", "BackwardInputPass",
           "BackwardWeightPass", "WaitSends", "EngineSelector", "install", "uninstall", "installed",
           "select_engine_class", "check_schedule", "resolve_schedule", "wait_for_gloo_workers"]

install()
install_exit_wait()  # no abort at exit after the last collective: see teardown.py
