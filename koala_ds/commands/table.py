"""Plain-text tables for the CLI."""
from __future__ import annotations


def format_table(rows: list[tuple], header: tuple, align: str) -> str:
    """Columns padded to width; `align` has one '<' (left) or '>' (right) per column."""
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for n, row in enumerate(cells):
        parts = [f"{c:<{w}}" if a == "<" else f"{c:>{w}}" for c, w, a in zip(row, widths, align)]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
