"""koala-ds: pipeline schedules as data.

The language (`koala_ds.dsl`, `koala_ds.library`), the model (`koala_ds.sim`) and the search
(`koala_ds.search`) never import torch; the engine adapters (`koala_ds.deepspeed`,
`koala_ds.megatron`) import their engines lazily.
"""
from .ir import Action, KoalaError, Op, Placement, Schedule, ScheduleError

__version__ = "0.1.0"
__all__ = ["Action", "KoalaError", "Op", "Placement", "Schedule", "ScheduleError", "load_schedule", "__version__"]


def load_schedule(name_or_path: str, p: int, m: int, v: int = 1) -> Schedule:
    """Compile a library schedule (by name), a .koala file, or a schedule .json/.csv file."""
    from .library import load_schedule as _load

    return _load(name_or_path, p, m, v)
