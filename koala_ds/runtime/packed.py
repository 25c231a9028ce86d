"""A small object of tensors (a V-shape step's loss values) as one byte tensor, for one message.

A V-shape schedule computes the loss on pipeline rank 0, and megatron-core reads it on the last
rank, so every training step ships the step's loss values (a list of dicts of small tensors)
between them after the pipeline, on the critical path (rank 0 starts the next step).
`torch.save` / `torch.load` of them took about 0.6 ms each on a quiet 2-core CPU: on the
Megatron example (4 layers, hidden 64) zb-v's steps spent 1.28 ms more beside the pipeline than
interleaved-1f1b's with them, 0.63 ms with this (benchmarks/beside_pipeline.py, three runs of
six rounds each, alternated; rank 0's time after its last action 0.86-1.53 ms -> 0.55-0.64 ms).
Here the structure is pickled with its tensors left out (`persistent_id`, microseconds) and the
tensors' bytes follow it in the same buffer:

    [length of the pickle: int64][the pickle][the tensors' bytes, in the order pickled]

Tensors come back detached, contiguous, on the device asked for, with their dtype and shape;
everything else as pickle returns it. Only for messages between the ranks of one job (the
receiver unpickles what its peer sent, as torch.load(weights_only=False) did).
"""
from __future__ import annotations

import io
import pickle

import torch

_LENGTH = torch.int64


class _Pickler(pickle.Pickler):
    """Pickles the structure; each tensor becomes (offset, bytes, dtype, shape) into `parts`."""

    def __init__(self, file, parts: list):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.parts, self.offset = parts, 0

    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor):
            return None
        flat = obj.detach().cpu().contiguous().reshape(-1)
        raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
        pid = (self.offset, raw.numel(), obj.dtype, tuple(obj.shape))
        self.parts.append(raw)
        self.offset += raw.numel()
        return pid


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, body: torch.Tensor, device: torch.device):
        super().__init__(file)
        self.body, self.device = body, device

    def persistent_load(self, pid):
        offset, size, dtype, shape = pid
        raw = self.body[offset:offset + size].clone()  # own storage: aligned for any dtype
        flat = raw.view(dtype) if size else torch.empty(0, dtype=dtype)
        return flat.reshape(shape).to(self.device)


def pack(obj) -> torch.Tensor:
    """`obj` (tensors nested in lists, tuples, dicts, ...) as one uint8 CPU tensor."""
    parts: list = []
    head = io.BytesIO()
    _Pickler(head, parts).dump(obj)
    pickled = torch.frombuffer(bytearray(head.getvalue()), dtype=torch.uint8)
    length = torch.tensor([pickled.numel()], dtype=_LENGTH).view(torch.uint8)
    return torch.cat([length, pickled, *parts])


def unpack(data: torch.Tensor, device: torch.device | str = "cpu"):
    """What `pack` was given, its tensors on `device`."""
    data = data.cpu()
    width = _LENGTH.itemsize
    length = int(data[:width].clone().view(_LENGTH).item())
    pickled = data[width:width + length].numpy().tobytes()
    return _Unpickler(io.BytesIO(pickled), data[width + length:], torch.device(device)).load()
