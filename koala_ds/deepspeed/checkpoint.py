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

from ..core.ir import KoalaError
from ..core.outputs import atomic_write
from ..resolve import ScheduleFitError as KoalaConfigError  # the DeepSpeed adapter's name (config.py)

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


def _latest_tag(load_dir: str):
    """The tag DeepSpeed's `latest` file in `load_dir` names (None without one): what
    load_checkpoint(tag=None) loads. DeepSpeed has no public function for it."""
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest, encoding="utf-8") as fh:
        return fh.read().strip()


class CheckpointLayout:
    """The checkpoint half of `KoalaPipelineEngine` (a mixin over DeepSpeed's `PipelineEngine`)."""

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
        """DeepSpeed's save_checkpoint, plus `koala_layout.json` (the layers of every pipeline
        rank) in the tag's directory, written by global rank 0 before any rank returns."""
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"  # as DeepSpeed names it
        result = super().save_checkpoint(save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest,
                                         **kwargs)
        if self.global_rank == 0:
            write_layout(os.path.join(save_dir, tag), module_layout(self.module))
        from deepspeed import comm as dist

        with self._bounded_collectives():  # within the step's timeout, as a step's collectives
            dist.barrier()  # a rank that loads right after finds the file
        return result

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """DeepSpeed's load_checkpoint; optimizer states saved with another assignment of layers
        to ranks are refused first, in one line (`checkpoint.check_optimizer_layout`).

        With the bf16 optimizer (bf16 without ZeRO) its states are read from the files it wrote,
        `bf16_zero_pp_rank_*_optim_states.pt`: DeepSpeed 0.19.8 reads the model-states file
        instead and fails (`KeyError: 0`, stock engine too)."""
        states = load_optimizer_states and not load_module_only and not self.load_universal_checkpoint()
        if states:
            tag = tag if tag is not None else _latest_tag(load_dir)
            if tag is not None and os.path.isdir(os.path.join(load_dir, str(tag))):
                try:
                    check_optimizer_layout(os.path.join(load_dir, str(tag)), self.module)
                except KoalaError as exc:
                    raise KoalaConfigError(str(exc)) from None
        bf16_states = states and not self.zero_optimization() and hasattr(self.optimizer, "bf16_groups")
        result = super().load_checkpoint(load_dir, tag=tag, load_module_strict=load_module_strict,
                                         load_optimizer_states=load_optimizer_states and not bf16_states,
                                         load_lr_scheduler_states=load_lr_scheduler_states,
                                         load_module_only=load_module_only, custom_load_fn=custom_load_fn)
        if bf16_states and result[0] is not None:
            # DeepSpeed's own reader of those files (as under ZeRO): the fp32 master weights and the
            # optimizer states of every data-parallel rank's partition
            if not self._load_zero_checkpoint(load_dir, tag, load_optimizer_states=True):
                raise KoalaConfigError(f"load_checkpoint({load_dir!r}, tag={tag!r}): the checkpoint has no bf16 "
                                       f"optimizer states (bf16_zero_*_optim_states.pt): pass "
                                       f"load_optimizer_states=False to load the weights alone")
        elif not load_optimizer_states and not load_module_only and not self.zero_optimization() \
                and hasattr(self.optimizer, "refresh_fp32_params"):
            # DeepSpeed refreshes the bf16 optimizer's fp32 master weights from loaded weights under
            # load_module_only only: without it the next step would put the old weights back
            self.optimizer.refresh_fp32_params()
        return result
