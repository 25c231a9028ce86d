"""koala-ds: pipeline schedules as data.

The language (`koala_ds.dsl`, `koala_ds.library`), the model (`koala_ds.sim`), the search
(`koala_ds.search`) and the resolver every front end shares (`koala_ds.resolve`: a schedule
name or file and a run's p, m, v -> the schedule that fits) never import torch.
`koala_ds.megatron` and `koala_ds.profiler` import torch (and their engine) only when a
function that needs them is called. `koala_ds.deepspeed` is not lazy: importing it imports
torch and DeepSpeed and registers the Koala engine with `deepspeed.initialize`.
The test and benchmark harness is not part of the package: it lives in the checkout's tests/.
"""
from .core.ir import Action, KoalaError, Op, Placement, Schedule, ScheduleError

__version__ = "0.1.0"
__all__ = ["Action", "KoalaError", "Op", "Placement", "Schedule", "ScheduleError", "load_schedule", "__version__"]


def load_schedule(name_or_path: str, p: int, m: int, v: int = 1) -> Schedule:
    """Compile a library schedule (by name), a .koala file, or a schedule .json/.csv file."""
    from .resolve import load_schedule as _load

    return _load(name_or_path, p, m, v)
