"""koala_ds.runtime.packed: a V-shape step's loss values as one byte tensor and back."""
from __future__ import annotations

import pickle

import pytest
import torch

from koala_ds.runtime import packed


def _same(a, b) -> bool:
    """Equal structure and values, tensors of equal dtype and shape."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_megatron_loss_values_come_back_whole():
    """What the Megatron runtime ships from a V-shape's loss rank: megatron-core's per-microbatch
    dicts (a loss and a token count per microbatch) and the step's token count."""
    losses = [{"lm loss": torch.tensor([4.1 + mb, 64.0])} for mb in range(8)]
    obj = (losses, torch.tensor(512, dtype=torch.int32))
    data = packed.pack(obj)
    assert data.dtype == torch.uint8 and data.dim() == 1
    assert _same(packed.unpack(data), obj)
    assert _same(packed.unpack(data.clone()), obj)  # from a received buffer, not the sent one


@pytest.mark.parametrize("value", [
    torch.ones(2, 3, dtype=torch.bfloat16),
    torch.arange(12, dtype=torch.float64).reshape(3, 4).t(),  # not contiguous
    torch.tensor(True),
    torch.zeros(0, 5),
    torch.tensor(7, dtype=torch.int64),
], ids=["bf16", "transposed", "bool", "empty", "int64-scalar"])
def test_every_dtype_and_shape_comes_back(value):
    obj = {"a": value, "b": [value, None, "text", 3]}
    assert _same(packed.unpack(packed.pack(obj)), obj)


def test_tensors_come_back_detached_on_the_device_asked_for():
    weight = torch.ones(3, requires_grad=True)
    out = packed.unpack(packed.pack([weight * 2]), torch.device("meta"))
    assert out[0].device.type == "meta" and not out[0].requires_grad and out[0].shape == (3,)
    back = packed.unpack(packed.pack([weight * 2]), "cpu")[0]
    assert not back.requires_grad and torch.equal(back, torch.full((3,), 2.0))


def test_no_tensor_is_pickled_whole():
    """The tensors travel as their bytes beside the pickle: the pickle holds no torch storage
    (what torch.save writes and torch.load reads, about 0.6 ms each on the 2-core VM)."""
    data = packed.pack([{"lm loss": torch.tensor([1.0, 2.0])}])
    width = torch.empty(0, dtype=torch.int64).element_size()
    length = int(data[:width].clone().view(torch.int64).item())
    head = data[width:width + length].numpy().tobytes()
    assert b"_rebuild_tensor" not in head and b"storage" not in head.lower()
    assert data.numel() - width - length == 8  # two float32 values
    with pytest.raises(pickle.UnpicklingError):  # its tensors are references into the bytes after it
        pickle.loads(head)
