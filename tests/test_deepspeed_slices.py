"""Unit tests of the model-parallel shares of pipeline messages (koala_ds/deepspeed/slices.py);
the engine's use of them is checked against the stock engine in
test_deepspeed_pipeline.py::test_model_parallel_topology_equals_stock."""
import pytest

torch = pytest.importorskip("torch")

from koala_ds.deepspeed.slices import SliceSplit  # noqa: E402


@pytest.mark.parametrize("shape,size", [((2, 8), 2), ((3, 5), 4), ((7,), 3), ((1, 1), 2)])
def test_shares_are_equal_sized_pieces_that_rebuild_the_tensor(shape, size):
    """Every rank's share has the same size (the all-gather needs it on every backend), the last
    one padded with zeros; in rank order they are the flattened tensor."""
    tensor = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    shares = [SliceSplit(None, r, size).share(tensor) for r in range(size)]
    n = SliceSplit(None, 0, size).share_numel(shape)
    assert n * size >= tensor.numel() > (n - 1) * size
    assert all(s.shape == (n,) and s.is_contiguous() for s in shares)
    flat = torch.cat(shares)
    assert torch.equal(flat[:tensor.numel()].view(shape), tensor)
    assert not flat[tensor.numel():].any()
    assert SliceSplit(None, 0, size).empty_share(shape, torch.bfloat16, "cpu").shape == (n,)
