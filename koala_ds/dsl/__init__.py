"""The Koala schedule language: `.koala` text and a Python builder with one semantics."""
from __future__ import annotations

from .parser import KoalaSyntaxError, parse
from .printer import print_schedule
from .program import KoalaCompileError, Program, RankBuilder, from_ast, python_program

__all__ = ["KoalaSyntaxError", "KoalaCompileError", "Program", "RankBuilder", "parse", "parse_program",
           "print_schedule", "python_program"]  # a program from a file: koala_ds.library.load_program_file


def parse_program(text: str, file: str = "<string>") -> Program:
    """Parse `.koala` text into a Program (raises KoalaSyntaxError)."""
    return from_ast(parse(text, file), text)
