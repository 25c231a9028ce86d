"""JSON text as the user's files give it: every way `json.loads` can fail, as one place and reason.

`json.loads` raises JSONDecodeError (with a line and column) for text that is not JSON, but also
a plain ValueError for an integer of more than 4300 digits (Python's limit on converting them)
and RecursionError for arrays or objects nested deeper than the interpreter's recursion limit.
"""
from __future__ import annotations

import json
from typing import Any


class NotJson(ValueError):
    """Text `json.loads` refused: `where` is ':LINE:COL' (or '' where no place is known),
    `reason` why, in a few words."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason


def parse_json(text: str) -> Any:
    """`json.loads(text)`, or NotJson."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise NotJson(f":{exc.lineno}:{exc.colno}", exc.msg) from None
    except RecursionError:
        raise NotJson("", "nested too deeply to read") from None
    except ValueError as exc:  # an integer too long to convert
        raise NotJson("", str(exc).split(";")[0]) from None
