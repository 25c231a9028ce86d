"""torch.distributed.pipelining adapter: run any Koala schedule on torch's own pipeline runtime.

    from koala_ds.torch import schedule
    pipe = schedule(stages, n_microbatches=8, loss_fn=loss_fn, spec="zb-v")  # or a .koala/.json/.csv file
    pipe.step(x, target=y, losses=losses)  # torch's step(): the same call as torch's own schedule classes

`stages` are this rank's `torch.distributed.pipelining.PipelineStage` objects, built for the
stage indices the schedule's placement gives this rank (`stage_indices(spec, ...)`). The
schedule is handed, as per-rank compute actions, to torch's `_PipelineScheduleRuntime`, which
adds its own send / recv actions and runs it: the split backward (I / W) is torch's
(`PipelineStage.backward_one_chunk(full_backward=False)` and `backward_weight_one_chunk`).
Every wait is torch's, bounded by the process group's timeout (`init_process_group(timeout=...)`).
torch is imported here only (koala_ds/torch/adapter.py), not by the rest of koala_ds.
"""
from __future__ import annotations

from ..resolve import TORCH
from .adapter import KoalaPipelineSchedule, schedule, stage_indices, torch_actions, torchtitan_schedule_name

__all__ = ["schedule", "stage_indices", "KoalaPipelineSchedule", "torch_actions", "torchtitan_schedule_name", "TORCH"]
