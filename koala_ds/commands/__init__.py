"""Subcommands of the `koala` CLI, one module each (see koala_ds.cli), and what they share:
float options checked as finite, and JSON output that is always valid JSON."""
from __future__ import annotations

import argparse
import json
import math
from typing import Any, Callable

from ..core.ir import KoalaError


def finite_float(minimum: float = 0.0, *, strict: bool = True) -> Callable[[str], float]:
    """An argparse `type`: a finite number > `minimum` (>= with strict=False). argparse names
    the flag in its error, which `koala` prints as one line."""
    sign = ">" if strict else ">="

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"must be a finite number {sign} {minimum:g}, got {text!r}")
        return value

    parse.__name__ = "finite number"
    return parse


#: Seconds, MB and the like: finite and > 0.
positive_float = finite_float(0.0)
#: A latency or an offset: finite and >= 0.
nonnegative_float = finite_float(0.0, strict=False)


def cli_words(text: str) -> str:
    """A text of the search's in the CLI's words: its parameter `memory_limit` as --memory-limit."""
    return text.replace("`memory_limit`", "--memory-limit")


def _whole_number(text: str, low: int) -> int:
    """A whole number >= `low` from an argparse argument (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """An argparse `type`: a whole number >= 0."""
    return _whole_number(text, 0)


def positive_int(text: str) -> int:
    """An argparse `type`: a whole number >= 1."""
    return _whole_number(text, 1)


def dumps_json(data: Any, **kwargs: Any) -> str:
    """JSON text for `koala ... --json`: strict JSON, never Infinity or NaN (those are refused:
    the inputs' numbers are bounded, so a non-finite result is a bug worth a message)."""
    try:
        return json.dumps(data, allow_nan=False, **kwargs)
    except ValueError:
        raise KoalaError("the result has a number that is not finite (inf or nan), which JSON cannot "
                         "hold: check the profile's times and sizes") from None
