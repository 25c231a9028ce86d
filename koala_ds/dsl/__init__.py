"""The Koala schedule language: `.koala` text and a Python builder with one semantics."""
from __future__ import annotations

from pathlib import Path

from .parser import KoalaSyntaxError, parse
from .printer import print_schedule
from .program import KoalaCompileError, Program, RankBuilder, from_ast, python_program

__all__ = ["KoalaSyntaxError", "KoalaCompileError", "Program", "RankBuilder", "parse", "parse_program",
           "load_program_file", "print_schedule", "python_program"]


def parse_program(text: str, file: str = "<string>") -> Program:
    """Parse `.koala` text into a Program (raises KoalaSyntaxError)."""
    return from_ast(parse(text, file), text)


def load_program_file(path: str | Path) -> Program:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"schedule file {path} does not exist") from None
    except UnicodeDecodeError:
        from ..ir import KoalaError

        raise KoalaError(f"{path}: not a UTF-8 text file") from None
    return parse_program(text, str(path))
