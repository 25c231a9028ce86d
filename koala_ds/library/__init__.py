"""The schedule library: one `.koala` file per known schedule, found by name.

`load_schedule` also takes user files: a `.koala` program, a schedule `.json` (as written
by `koala export --format json`) or a torch compute-only `.csv`.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from ..dsl import Program, load_program_file, parse_program
from ..ir import KoalaError, Schedule, ScheduleError
from ..validate import validate

LIBRARY_DIR = Path(__file__).resolve().parent


@lru_cache(maxsize=None)
def _registry() -> dict[str, Program]:
    programs: dict[str, Program] = {}
    for path in sorted(LIBRARY_DIR.glob("*.koala")):
        program = parse_program(path.read_text(encoding="utf-8"), f"koala_ds/library/{path.name}")
        if program.name in programs:
            raise KoalaError(f"two library files define schedule {program.name!r}")
        programs[program.name] = program
    return programs


def names() -> list[str]:
    return list(_registry())


def get(name: str) -> Program:
    try:
        return _registry()[name]
    except KeyError:
        raise KoalaError(f"unknown schedule {name!r}; library schedules: {', '.join(names())} "
                         f"(or give a path to a .koala, .json or .csv file)") from None


def load_program(name_or_path: str) -> Program:
    """A library Program by name, or a `.koala` file by path."""
    if name_or_path in _registry():
        return _registry()[name_or_path]
    path = Path(name_or_path)
    if path.suffix == ".koala" or path.exists():
        if path.suffix in (".json", ".csv"):
            raise KoalaError(f"{path} is a fixed schedule, not a program; load it with load_schedule()")
        return load_program_file(path)
    return get(name_or_path)


FIXED_SUFFIXES = (".json", ".csv")


def read_schedule_file(path: str | Path) -> Schedule:
    """A fixed schedule from a `.json` (koala export) or torch compute-only `.csv` file, as
    written: the caller checks that it fits its (p, m, v) and says which setting to change."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"schedule file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return Schedule.from_json(text, str(path))
    if path.suffix == ".csv":
        return Schedule.from_torch_csv(text, name=path.stem, source=str(path))
    raise KoalaError(f"{path}: a fixed schedule file ends in {' or '.join(FIXED_SUFFIXES)}")


def load_schedule(name_or_path: str, p: int, m: int, v: int = 1) -> Schedule:
    """Compile a library schedule or a `.koala` file for (p, m, v), or load a fixed `.json` /
    `.csv` schedule and check that it was made for (p, m, v)."""
    path = Path(name_or_path)
    if path.suffix in FIXED_SUFFIXES and name_or_path not in _registry():
        schedule = read_schedule_file(path)
        for key, want in (("p", p), ("m", m), ("v", v)):
            have = getattr(schedule, key)
            if have != want:
                raise ScheduleError(f"{path} was made for {key}={have} but {key}={want} was asked for: "
                                    f"change -{key} (or the engine's setting) to {have}, or re-export the schedule")
        validate(schedule)
        return schedule
    return load_program(name_or_path).compile(p, m, v)
