"""koala_ds/runtime/grad_norm.py: the examples' step-end gradient clipping (the norm reduced over
a group, where the pipeline ranks meet; its effect on step times is tested with the Megatron
example in tests/test_megatron_example.py)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _params(seed: int):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(5)),
              torch.nn.Parameter(torch.zeros(2))]
    for prm in params[:2]:  # the last has no gradient
        prm.grad = torch.randn(prm.shape, generator=g)
    return params


@pytest.mark.parametrize("clip", [0.0, 0.5, 1e6])
def test_the_norm_is_torchs_and_the_gradients_are_clipped_as_torch_clips_them(one_rank_group, clip):
    from koala_ds.runtime.grad_norm import clip_grad_norm

    mine, theirs = _params(3), _params(3)
    expected = float(torch.nn.utils.clip_grad_norm_(theirs, clip) if clip else
                     torch.nn.utils.get_total_norm([p.grad for p in theirs if p.grad is not None]))
    norm = clip_grad_norm(iter(mine), clip, one_rank_group)
    assert norm == pytest.approx(expected, rel=1e-6) and norm > 1.0
    for a, b in zip(mine, theirs):
        assert (a.grad is None and b.grad is None) or torch.allclose(a.grad, b.grad, rtol=1e-6)
    after = float(torch.nn.utils.get_total_norm([p.grad for p in mine if p.grad is not None]))
    assert after == pytest.approx(min(norm, clip) if clip else norm, rel=1e-5)


def test_a_rank_without_gradients_still_takes_part(one_rank_group):
    from koala_ds.runtime.grad_norm import clip_grad_norm

    assert clip_grad_norm([torch.nn.Parameter(torch.zeros(3))], 1.0, one_rank_group) == 0.0


def test_only_the_counted_parameters_make_the_norm_and_every_gradient_is_clipped(one_rank_group):
    """A parameter held whole on every tensor-parallel rank counts once (megatron-core's
    param_is_not_tensor_parallel_duplicate): with it counted on each of two TP ranks, TP = 2 ran
    4.5e-4 off TP = 1 after 50 steps."""
    from koala_ds.runtime.grad_norm import clip_grad_norm

    mine, alone = _params(5), _params(5)[:1]
    norm = clip_grad_norm(mine, 0.5, one_rank_group, counted=lambda p: p is mine[0])
    assert norm == pytest.approx(float(alone[0].grad.norm()), rel=1e-6)
    scale = 0.5 / (norm + 1e-6)
    assert torch.allclose(mine[1].grad, _params(5)[1].grad * scale, rtol=1e-5)
