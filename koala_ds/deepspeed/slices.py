"""The tensors sent between pipeline stages, split over the model-parallel ranks of a stage.

DeepSpeed's `pipeline.pipe_partitioned` / `pipeline.grad_partitioned` (on by default when the
topology has model-parallel ranks, as Megatron-DeepSpeed's tensor parallelism does): every
model-parallel rank of a stage holds the same activation (and the same gradient), so each sends
only its 1/n share of it to its counterpart in the next (previous) stage, and the receiving
stage's model-parallel ranks all-gather the shares into the whole tensor. The wire carries 1/n of
the tensor per rank; the all-gather runs inside the stage (NVLink on a GPU node).

The sender keeps only its share of a sent output until the backward, which all-gathers it back
(the engine's `_backward_targets`), as the stock engine does. As there, only the first tensor of
a message is split (the hidden states; an
attention mask or other tail tensors go whole). Shares are the flattened tensor cut into n
equal pieces, the last padded with zeros, so the all-gather has equal sizes on every backend.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SliceSplit:
    """This rank's place among the `size` model-parallel ranks of its stage (`group`)."""

    group: object
    rank: int
    size: int

    def share_numel(self, shape) -> int:
        return -(-math.prod(shape) // self.size)

    def share(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's share of `tensor` (flattened, padded with zeros to the equal share size)."""
        flat = tensor.detach().reshape(-1)
        n = self.share_numel(tensor.shape)
        part = flat[self.rank * n:(self.rank + 1) * n]
        if part.numel() < n:
            part = torch.cat([part, part.new_zeros(n - part.numel())])
        return part.contiguous()

    def empty_share(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        return torch.empty(self.share_numel(shape), dtype=dtype, device=device)

    def whole(self, share: torch.Tensor, shape, wait: Callable[[object], None]) -> torch.Tensor:
        """The whole tensor of `shape` from every rank's `share` (an all-gather over the stage's
        model-parallel ranks, waited by `wait(work)`, which bounds it by the step's timeout)."""
        n = share.numel()
        out = share.new_empty(n * self.size)
        wait(dist.all_gather(list(out.split(n)), share, group=self.group, async_op=True))
        return out[:math.prod(shape)].view(shape)
