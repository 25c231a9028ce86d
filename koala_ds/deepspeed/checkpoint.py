"""Which layers each pipeline rank held when a DeepSpeed checkpoint was saved.

DeepSpeed writes a pipeline's weights as one file per layer (placement-free) but each pipeline
rank's optimizer states (and ZeRO's partitions of them, and the bf16 optimizer's fp32 master
weights) as one file per rank, in the order of that rank's parameters. A checkpoint saved with
one assignment of layers to ranks (the stock engine's p-way cut, an interleaved or V-shape
placement, a searched `parts`) and loaded with another would give each parameter another
parameter's optimizer state, silently. So the Koala engine writes the assignment beside the
checkpoint (`koala_layout.json` in the tag's directory; a checkpoint without it was saved by
the stock engine, whose cut is known), and refuses, before loading anything, to load optimizer
states into a different one. Weights alone (`load_module_only=True`; with the Koala engine also
`load_optimizer_states=False`) load across any.
"""
from __future__ import annotations

import json
import os

from ..ir import KoalaError
from ..outputs import atomic_write

LAYOUT_FILE = "koala_layout.json"


def rank_layers(parts: list, stages_of_rank: list) -> list:
    """Per pipeline rank, the [start, stop) layer ranges of its stages, in the order it holds them."""
    return [[[parts[s], parts[s + 1]] for s in stages] for stages in stages_of_rank]


def module_layout(module) -> list:
    """The layer ranges of every pipeline rank for `module` (a PipelineModule, or a
    KoalaPipelineModule with its placement)."""
    placement = getattr(module, "koala_placement", None)
    if placement is None:  # a plain PipelineModule: the stock engine's cut
        return stock_layout(module)
    return rank_layers(module.parts, [placement.stages_of(r) for r in range(placement.p)])


def stock_layout(module) -> list:
    """The layer ranges the stock engine gives each rank for `module` (its p-way cut)."""
    parts = getattr(module, "koala_stock_parts", None) or module.parts
    return rank_layers(parts, [[r] for r in range(len(parts) - 1)])


def write_layout(directory: str, layout: list) -> None:
    """`koala_layout.json` in `directory`, written whole or not at all (mode as the umask gives)."""
    atomic_write(os.path.join(directory, LAYOUT_FILE), json.dumps({"rank_layers": layout}))


def saved_layout(directory: str, module) -> tuple[list, str]:
    """(the layer ranges per rank the checkpoint in `directory` was saved with, who saved it)."""
    path = os.path.join(directory, LAYOUT_FILE)
    if not os.path.isfile(path):
        return stock_layout(module), "the stock engine"
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)["rank_layers"], "the Koala engine"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KoalaError(f"{path}: not a Koala checkpoint layout ({exc})") from None


def check_optimizer_layout(directory: str, module) -> None:
    """Refuse, in one line, optimizer states saved for another assignment of layers to ranks."""
    saved, saver = saved_layout(directory, module)
    mine = module_layout(module)
    if saved == mine:
        return
    advice = ("load the weights only (load_checkpoint(..., load_module_only=True)) or resume with the "
              "placement it was saved with")
    if len(saved) != len(mine):
        raise KoalaError(f"checkpoint {directory} was saved by {saver} with {len(saved)} pipeline ranks, this run "
                         f"has {len(mine)}: {advice}")
    rank = next(r for r, (then, now) in enumerate(zip(saved, mine)) if then != now)
    raise KoalaError(f"checkpoint {directory} was saved by {saver} with pipeline rank {rank} holding layers "
                     f"{_ranges(saved[rank])}; this run's placement gives it layers {_ranges(mine[rank])}, so its "
                     f"optimizer states belong to other parameters here: {advice}")


def _ranges(ranges: list) -> str:
    """[[0, 2], [5, 6]] -> '0-1 and 5'."""
    return " and ".join(f"{a}" if b - a == 1 else f"{a}-{b - 1}" for a, b in ranges)
