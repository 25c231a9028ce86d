"""The hold policy of the split backward (koala_ds.runtime.wgrad_policy, `wgrad.prepare(max_hold=...)`):
W holds at most max_hold x the chunk's activation, the layers with the most held bytes per
weight-gradient FLOP are computed in I, and I + W still equals a full backward."""
from __future__ import annotations

import pytest

from koala_ds.runtime.wgrad_policy import LayerCost, Plan, check_max_hold, choose_deferred

H = 100  # bytes per "hidden" unit in the pure tests


def _gpt_layer(first_key: int, order: int) -> list[LayerCost]:
    """qkv (h -> 3h), proj (h -> h), fc1 (h -> 4h), fc2 (4h -> h): inputs and output gradients."""
    shapes = [(1, 3), (1, 1), (1, 4), (4, 1)]
    return [LayerCost(first_key + i, order + i, {("in", first_key + i): i_ * H}, o * H, 2.0 * i_ * o)
            for i, (i_, o) in enumerate(shapes)]


def test_the_worst_bytes_per_flop_layer_is_kept_first():
    layers = _gpt_layer(0, 0)  # held 16h; qkv 4h/3, proj 2h/1, fc1 5h/4, fc2 5h/4
    assert choose_deferred(layers, 20 * H, 0.80) == {0, 1, 2, 3}  # 16h <= 16h: everything
    assert choose_deferred(layers, 20 * H, 0.75) == {0, 2, 3}  # 15h: attention's output projection stays in I
    assert choose_deferred(layers, 20 * H, 0.0) == set()


def test_a_layer_that_does_not_fit_is_skipped_and_a_smaller_one_still_fits():
    layers = _gpt_layer(0, 0)
    # 12h: fc1 + fc2 (10h); qkv (4h) would make 14h: skipped; proj (2h) still fits -> 12h
    assert choose_deferred(layers, 16 * H, 0.75) == {1, 2, 3}


def test_an_input_shared_by_two_layers_is_held_once():
    shared = {("x",): 4 * H}
    a = LayerCost(1, 0, dict(shared), 4 * H, 16.0)
    b = LayerCost(2, 1, dict(shared), 4 * H, 16.0)
    assert choose_deferred([a, b], 12 * H, 1.0) == {1, 2}  # 4h + 4h + 4h, not 16h
    plan = Plan()
    plan.add([a, b], 12 * H, 1.0)
    assert plan.held_bytes == 12 * H and plan.deferred_fraction() == 1.0


@pytest.mark.parametrize("bad", [-0.1, "half", True, float("nan")])
def test_a_bad_max_hold_is_one_line_naming_the_setting(bad):
    with pytest.raises(ValueError, match=r"max_hold \(koala_ds.runtime.wgrad.prepare\)"):
        check_max_hold(bad)


def test_the_profile_option_takes_a_fraction_or_none():
    import argparse

    from koala_ds.commands.profile import max_w_hold

    assert max_w_hold("0.5") == 0.5 and max_w_hold("none") is None and max_w_hold("0") == 0.0
    for bad in ("-1", "lots"):
        with pytest.raises(argparse.ArgumentTypeError, match="a finite number >= 0 or none"):
            max_w_hold(bad)


torch = pytest.importorskip("torch")

from koala_ds.runtime import wgrad  # noqa: E402
from koala_ds.profiler.core import measure_stage  # noqa: E402
from koala_ds.profiler.models import GPTBlock  # noqa: E402


def _blocks(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(GPTBlock(64, 4), GPTBlock(64, 4))


def _full_backward_grads(mod, x, g):
    mod(x.clone().requires_grad_()).backward(g)
    grads = [p.grad.clone() for p in mod.parameters()]
    mod.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("max_hold", [0.75, 0.5, 0.0])
def test_split_under_the_policy_equals_a_full_backward(max_hold):
    mod = _blocks()
    xs = [torch.randn(2, 16, 64) for _ in range(3)]
    gs = [torch.randn(2, 16, 64) for _ in range(3)]
    refs = [_full_backward_grads(mod, x, g) for x, g in zip(xs, gs)]
    ref = [sum(r[i] for r in refs) for i in range(len(refs[0]))]
    prepared = wgrad.prepare(mod, max_hold=max_hold)
    queues = []
    for x, g in zip(xs, gs):  # every I first, then every W
        out = mod(x.clone().requires_grad_())
        with prepared.input_step() as queue:
            out.backward(g)
        queues.append(queue)
    kept = [lin.weight for blk in mod for lin in (blk.qkv, blk.proj, blk.fc1, blk.fc2) if id(lin.weight) in prepared.plan.kept]
    assert all(w.grad is not None for w in kept)  # computed in I
    for q in queues:
        q.run()
    for p, r in zip(mod.parameters(), ref):
        assert torch.allclose(p.grad, r, rtol=1e-6, atol=1e-6), (p.shape, (p.grad - r).abs().max())
    if max_hold == 0.0:
        assert not prepared.plan.deferred and all(not q.work for q in queues)
    else:
        assert prepared.plan.deferred and prepared.plan.kept  # some of each at these bounds
        assert all(id(blk.proj.weight) in prepared.plan.kept for blk in mod)  # the worst bytes per FLOP


def test_sdpa_blocks_hold_at_most_the_bound_and_defer_most_of_the_work():
    """Plain-torch GPT blocks with SDPA: without a bound W holds all the activation (1.00)."""
    def measure(max_hold):
        mod = _blocks(1)
        return measure_stage(mod, lambda: torch.randn(1, 32, 64, requires_grad=True), is_last=False,
                             warmup=0, iters=1, full_backward=False, max_hold=max_hold)

    everything, bounded = measure(None), measure(0.75)
    assert everything.w_hold_bytes >= 0.99 * everything.activation_bytes
    assert bounded.activation_bytes == everything.activation_bytes
    assert bounded.w_hold_bytes <= 0.75 * bounded.activation_bytes
    assert bounded.w_flops_deferred >= 0.6


def test_the_watch_plans_once_with_grad_and_leaves_no_hooks_behind():
    mod = _blocks(2)
    prepared = wgrad.prepare(mod)  # the default bound
    assert prepared.max_hold == 0.75
    with torch.no_grad():
        mod(torch.randn(1, 8, 64))
    assert not prepared.plan.deferred and not prepared.plan.kept  # nothing saved: no plan from it
    mod(torch.randn(1, 8, 64, requires_grad=True)).sum().backward()
    planned = (set(prepared.plan.deferred), set(prepared.plan.kept))
    assert planned[0] | planned[1] == prepared.weights and wgrad._WATCH is None
    mod(torch.randn(1, 8, 64, requires_grad=True)).sum().backward()
    assert (prepared.plan.deferred, prepared.plan.kept) == planned  # planned once


class _Chunks(torch.nn.Module):
    """Two chunks in one module, run one per forward (as a DeepSpeed module holding two chunks)."""

    def __init__(self):
        super().__init__()
        self.chunks = torch.nn.ModuleList([GPTBlock(32, 2), GPTBlock(32, 2)])
        self.active = 0

    def forward(self, x):
        if x.shape[-1] != 32:
            raise ValueError("wrong width")
        return self.chunks[self.active](x)


def test_layers_first_seen_in_a_later_forward_are_planned_then_and_a_failed_forward_plans_nothing():
    mod = _Chunks()
    prepared = wgrad.prepare(mod, max_hold=0.75)
    with pytest.raises(ValueError):
        mod(torch.randn(1, 8, 16, requires_grad=True))
    assert wgrad._WATCH is None and not prepared.plan.kept
    mod(torch.randn(1, 8, 32, requires_grad=True)).sum().backward()
    first = {id(p) for p in mod.chunks[0].parameters()}
    assert prepared.plan.kept | prepared.plan.deferred <= first
    mod.active = 1
    mod(torch.randn(1, 8, 32, requires_grad=True)).sum().backward()
    assert prepared.plan.kept | prepared.plan.deferred == prepared.weights
    # each chunk against its own activation: 12h of 16h fits fc1 + fc2 + proj, qkv stays in I
    assert {id(c.qkv.weight) for c in mod.chunks} == prepared.plan.kept


def test_prepare_keeps_the_first_bound_and_refuses_another():
    mod = torch.nn.Linear(4, 4)
    prepared = wgrad.prepare(mod, max_hold=0.5)
    assert wgrad.prepare(mod) is prepared and wgrad.prepare(mod, max_hold=0.5) is prepared
    with pytest.raises(ValueError, match="already prepared with max_hold=0.5"):
        wgrad.prepare(mod, max_hold=None)


def test_megatron_stage_under_the_profilers_hooks_keeps_what_the_plan_keeps(single_process_megatron):
    """The profiler measures memory with saved-tensor hooks, under which saved weights come back
    as new objects: the megatron-core linears must still find their plan (by the parameter)."""
    pytest.importorskip("megatron.core")
    from koala_ds.profiler.models import megatron_gpt_stages

    stages, tokens = megatron_gpt_stages(2, 64, 4, 64, 1, 128, 2, 1234, None)
    meas = measure_stage(stages[1], lambda: torch.randn(64, 1, 64, requires_grad=True), is_last=True,
                         loss_fn=lambda out: out.float().mean(), warmup=0, iters=1, full_backward=False)
    prepared = stages[1]._koala_wgrad
    assert prepared.plan.kept and prepared.plan.deferred
    assert meas.w_hold_bytes <= 0.75 * meas.activation_bytes
    assert meas.w_hold_bytes == prepared.plan.held_bytes  # the estimate is what the queue holds


def test_a_covered_layer_that_never_runs_stops_the_watch_after_a_while():
    mod = torch.nn.ModuleDict({"used": torch.nn.Linear(8, 8), "unused": torch.nn.Linear(8, 8)})
    mod.forward = lambda x: mod["used"](x)  # noqa: E731 - "unused" never runs
    prepared = wgrad.prepare(mod)
    for _ in range(wgrad._MAX_IDLE_WATCHES + 10):
        mod(torch.randn(2, 8, requires_grad=True)).sum().backward()
    # one forward planned "used"; then each watched forward counted one idle, up to the cap, and none after
    assert prepared._idle == wgrad._MAX_IDLE_WATCHES and wgrad._WATCH is None
    assert id(mod["used"].weight) in prepared.plan.kept | prepared.plan.deferred


class _ReadsItsWeight(torch.autograd.Function):
    """A custom Function reading an attribute of the weight it saved (as megatron-core's and
    Transformer Engine's linears read main_grad / grad_added_to_main_grad)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        _ReadsItsWeight.seen.append(getattr(weight, "tag", None))
        return grad * weight, (grad * x).sum(0)


def test_the_watched_forward_leaves_custom_functions_their_saved_parameters():
    """The watch used to run the chunk's first forward under saved-tensor hooks, under which a
    custom Function's saved parameter comes back as a copy without its attributes: megatron-core's
    and TE's linears then returned no weight gradient under gradient_accumulation_fusion, which
    Megatron DDP asserts on under overlap_grad_reduce."""
    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.scale = torch.nn.Parameter(torch.ones(8))
            self.scale.tag = "mine"

        def forward(self, x):
            return _ReadsItsWeight.apply(self.lin(x), self.scale)

    chunk = Chunk()
    prepared = wgrad.prepare(chunk)  # the default bound: the first forward is watched
    _ReadsItsWeight.seen = []
    for _ in range(2):
        out = chunk(torch.randn(4, 8, requires_grad=True))
        with prepared.input_step() as queue:
            out.sum().backward()
        queue.run()
    assert prepared.plan.deferred | prepared.plan.kept  # the watch planned
    assert _ReadsItsWeight.seen == ["mine", "mine"]
