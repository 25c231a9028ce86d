"""The schedule library: one `.koala` file per known schedule, found by name.

User files (a `.koala` program, a schedule `.json` as written by `koala export --format json`,
a torch compute-only `.csv`) and the fit to a run's (p, m, v) are the resolver's
(`koala_ds.resolve.load_schedule`, a layer above this one).
"""
from __future__ import annotations

import difflib
import re
from functools import lru_cache
from pathlib import Path

from ..dsl import Program, parse, parse_program
from ..core.ir import KoalaError, Schedule, ScheduleError, change_hint
from ..core.json_input import NotJson, parse_json

LIBRARY_DIR = Path(__file__).resolve().parent
#: The schedule JSON versions this koala-ds reads.
SCHEDULE_JSON_VERSIONS = (1,)


def did_you_mean(value: str, choices: list[str]) -> str:
    """" (did you mean 'x'?)" for the closest of `choices`, or "" when none is close."""
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def read_text(path: str | Path, what: str = "schedule file") -> str:
    """A text file's contents (a UTF-8 byte-order mark is dropped), or a one-line error: it does
    not exist, is a directory, cannot be read, or is not UTF-8 text."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise KoalaError(f"{what} {path} is a directory, not a file") from None
    except UnicodeDecodeError as exc:
        raise KoalaError(f"{path}: not a UTF-8 text file (byte {exc.start} cannot be decoded)") from None
    except OSError as exc:
        raise KoalaError(f"{what} {path}: cannot read ({exc.strerror or exc})") from None


def load_program_file(path: str | Path) -> Program:
    """A `.koala` program from a file (see `read_text` for the errors)."""
    return parse_program(read_text(path), str(path))


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
        raise KoalaError(f"unknown schedule {name!r}{did_you_mean(name, names())}; library schedules: "
                         f"{', '.join(names())} (or give a path to a .koala, .json or .csv file)") from None


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
    written: `koala_ds.resolve.check_fit` checks that it fits a run's (p, m, v)."""
    path = Path(path)
    text = read_text(path)
    if path.suffix == ".json":
        _check_json_version(text, path)
        return Schedule.from_json(text, str(path))
    if path.suffix == ".csv":
        return Schedule.from_torch_csv(text, name=path.stem, source=str(path))
    raise KoalaError(f"{path}: a fixed schedule file ends in {' or '.join(FIXED_SUFFIXES)}")


def _check_json_version(text: str, path: Path) -> None:
    try:
        data = parse_json(text)
    except NotJson:
        return  # Schedule.from_json says where
    version = data.get("version", 1) if isinstance(data, dict) else 1
    if version not in SCHEDULE_JSON_VERSIONS:
        raise ScheduleError(f"{path}: field 'version' is {version!r}; this koala-ds reads schedule JSON version "
                            f"{', '.join(map(str, SCHEDULE_JSON_VERSIONS))} (re-export it with `koala export "
                            f"--format json`)")


@lru_cache(maxsize=256)
def _explicit_ranks(text: str, file: str) -> tuple[int, ...]:
    return tuple(sorted(r for r in parse(text, file).ranks if r is not None))


def check_rank_blocks(program: Program, p: int, names: dict | None = None) -> None:
    """A `rank R:` block with R >= p would be silently unused: refuse it, naming -p (or `names["p"]`)."""
    if not program.text:
        return
    extra = [r for r in _explicit_ranks(program.text, program.file or program.name) if r >= p]
    if not extra:
        return
    r = extra[0]
    match = re.search(rf"^[ \t]*rank[ \t]+{r}[ \t]*:", program.text, re.M)
    line = f":{program.text.count(chr(10), 0, match.start()) + 1}" if match else ""
    raise KoalaError(f"{program.file or program.name}{line}: block 'rank {r}:' but p={p} has ranks 0..{p - 1}: "
                     f"{change_hint('p', names)} (to at least {r + 1}) or remove the block")


def compile_program(program: Program, p: int, m: int, v: int = 1, names: dict | None = None) -> Schedule:
    """`program.compile(p, m, v)`, refusing rank blocks that p leaves unused. Errors name the
    settings in `names` ({"p": ..., "m": ..., "v": ...}; default koala's -p, -m, -v)."""
    check_rank_blocks(program, p, names)
    return program.compile(p, m, v, names)
