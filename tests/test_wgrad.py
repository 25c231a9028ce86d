"""Deferred weight gradients (koala_ds.runtime.wgrad): I + W gives the gradients of one full backward,
runs every backward once, and defers the weight-gradient GEMMs of the layers it covers."""
from __future__ import annotations

import contextlib
import logging

import pytest

torch = pytest.importorskip("torch")

from koala_ds.runtime import wgrad  # noqa: E402


class _Branchy(torch.nn.Module):
    """Weights used twice, a residual, a parameter used apart from the input, a norm."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(6)
        self.a = torch.nn.Linear(6, 12)
        self.b = torch.nn.Linear(12, 6)
        self.scale = torch.nn.Parameter(torch.randn(6))
        self.bias_only = torch.nn.Parameter(torch.randn(6))

    def forward(self, x):
        h = self.b(torch.tanh(self.a(self.norm(x)))) * self.scale
        h = h + self.b(torch.relu(self.a(h)))  # a and b used twice
        return h + x + self.bias_only.exp()


def _reference(mod, xs, gs, needs_input_grad):
    dxs = []
    for x, g in zip(xs, gs):
        xx = x.clone().requires_grad_(needs_input_grad)
        mod(xx).backward(g)
        dxs.append(xx.grad)
    grads = [p.grad.clone() for p in mod.parameters()]
    mod.zero_grad(set_to_none=True)
    return grads, dxs


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("first_stage", [False, True])
def test_linear_stack_split_equals_full_backward_and_defers_the_weights(first_stage, direct):
    torch.manual_seed(0)
    mod = _Branchy().double()
    xs = [torch.randn(2, 3, 6, dtype=torch.double) for _ in range(3)]
    gs = [torch.randn(2, 3, 6, dtype=torch.double) for _ in range(3)]
    ref, ref_dx = _reference(mod, xs, gs, not first_stage)
    prepared = wgrad.prepare(mod, max_hold=None)
    assert prepared.linears == 2 and not prepared.uncovered
    queues, dxs = [], []
    for x, g in zip(xs, gs):  # every I first, then every W (as a zero-bubble schedule may)
        xx = x.clone().requires_grad_(not first_stage)
        with prepared.input_step(direct=direct) as queue:
            mod(xx).backward(g)
        queues.append(queue)
        dxs.append(xx.grad)
    assert mod.a.weight.grad is None and mod.b.weight.grad is None  # deferred to W
    assert mod.norm.weight.grad is not None and mod.a.bias.grad is not None  # computed in I
    assert all(len(q.work) == 4 for q in queues)  # a and b, twice each
    for q in queues:
        q.run()
    for p, r in zip(mod.parameters(), ref):
        assert torch.allclose(p.grad, r, rtol=1e-12, atol=1e-12), (p.shape, (p.grad - r).abs().max())
    for dx, r in zip(dxs, ref_dx):
        assert (dx is None and r is None) or torch.allclose(dx, r, rtol=1e-12, atol=1e-12)


def test_a_full_backward_after_prepare_is_unchanged():
    torch.manual_seed(1)
    mod = _Branchy().double()
    x, g = torch.randn(4, 6, dtype=torch.double), torch.randn(4, 6, dtype=torch.double)
    ref, _ = _reference(mod, [x], [g], True)
    wgrad.prepare(mod)
    mod(x.clone().requires_grad_()).backward(g)
    for p, r in zip(mod.parameters(), ref):
        assert torch.allclose(p.grad, r, rtol=1e-12, atol=1e-12)


def test_a_plain_torch_model_is_prepared_without_importing_megatron_core(monkeypatch):
    """prepare() looks for megatron-core's tensor-parallel linears only once their module is
    loaded (a model cannot hold one before): importing megatron-core costs ~5 s of CPU."""
    import sys

    import koala_ds.runtime

    monkeypatch.delitem(sys.modules, "megatron.core.tensor_parallel.layers", raising=False)
    monkeypatch.delattr(koala_ds.runtime, "_wgrad_megatron", raising=False)
    monkeypatch.setitem(sys.modules, "koala_ds.runtime._wgrad_megatron", None)  # importing it raises ImportError
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    prepared = wgrad.prepare(model, max_hold=None)
    assert prepared.linears == 2 and len(prepared.weights) == 2 and not prepared.uncovered


@pytest.mark.parametrize("direct", [False, True])
def test_weight_gradients_go_through_the_accumulators_hooks(direct):
    """DDP and DeepSpeed watch the AccumulateGrad nodes: W must pass through them (a weight with
    a visible hook does so under direct=True too; its gradient is added once per W)."""
    mod = torch.nn.Linear(4, 4)
    seen, doubled = [], []
    def hook(p):
        if p.grad is not None:
            seen.append(p.grad.clone())

    mod.weight.register_post_accumulate_grad_hook(hook)
    mod.bias.register_hook(lambda g: g * 2)
    mod.register_forward_hook(lambda m, i, o: doubled.append(o))
    prepared = wgrad.prepare(mod, max_hold=None)
    with prepared.input_step(direct=direct) as queue:
        (mod(torch.randn(3, 4)) + mod(torch.randn(3, 4))).sum().backward()  # the weight used twice
    assert seen == [] and mod.weight.grad is None
    queue.run()
    assert len(seen) == 1 and torch.equal(seen[0], mod.weight.grad)
    assert torch.equal(mod.bias.grad, torch.full((4,), 12.0))  # 2 x (3 + 3) rows through the tensor hook


def test_direct_weight_gradients_are_added_in_the_gemm_not_through_autograd():
    """direct=True (what the DeepSpeed runtime runs): a hook-free weight's gradient is added into
    .grad in place by its GEMM; nothing passes the AccumulateGrad node (whose hooks are not
    visible: that is why only a runtime that knows none are there may ask for it)."""
    torch.manual_seed(3)
    mod = torch.nn.Linear(5, 3)
    node_calls = []
    node = mod.weight.view_as(mod.weight).grad_fn.next_functions[0][0]
    node.register_hook(lambda *a: node_calls.append(1))
    x = torch.randn(4, 5)
    mod(x).sum().backward()  # a full backward goes through the node
    assert node_calls == [1]
    first = mod.weight.grad.clone()
    storage = mod.weight.grad.data_ptr()
    prepared = wgrad.prepare(mod, max_hold=None)
    with prepared.input_step(direct=True) as queue:
        mod(x).sum().backward()
    after_i = len(node_calls)  # autograd runs the node in I too (with no weight gradient)
    queue.run()
    assert len(node_calls) == after_i and mod.weight.grad.data_ptr() == storage  # added in place, no autograd
    assert torch.allclose(mod.weight.grad, 2 * first, rtol=1e-6, atol=1e-6)


class _FusedAccumulation(torch.autograd.Function):
    """The gradient_accumulation_fusion pattern: the backward adds the weight gradient into
    `weight.main_grad` itself and returns no gradient for the weight."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        ctx.main_grad = weight.main_grad
        return x.matmul(weight.t())

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        ctx.main_grad.add_(grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1])))
        return grad.matmul(weight), None


class _FusedLayer(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, n, dtype=torch.double) / n)
        self.weight.main_grad = torch.zeros_like(self.weight)

    def forward(self, x):  # main_grad goes by ctx, as in megatron-core (saved tensors may come back as new objects)
        return torch.tanh(_FusedAccumulation.apply(x, self.weight))


def _fused_stage():
    torch.manual_seed(2)
    return torch.nn.Sequential(torch.nn.Linear(5, 5).double(), _FusedLayer(5), torch.nn.Linear(5, 5).double())


def test_an_uncovered_custom_function_runs_its_backward_once(caplog):
    """A layer this module does not know keeps its whole backward in I, once: its main_grad
    gets the gradient exactly once (a graph-level split ran it in I and again in W)."""
    stage = _fused_stage()
    x, g = torch.randn(3, 5, dtype=torch.double), torch.randn(3, 5, dtype=torch.double)
    stage(x.clone().requires_grad_()).backward(g)
    ref = stage[1].weight.main_grad.clone()
    stage[1].weight.main_grad.zero_()
    with caplog.at_level(logging.WARNING, logger="koala_ds.runtime.wgrad"):
        prepared = wgrad.prepare(stage)
    assert prepared.uncovered == ["1 (_FusedLayer)"]
    assert "layer 1 (_FusedLayer)" in caplog.text and "computed in I" in caplog.text
    with prepared.input_step() as queue:
        stage(x.clone().requires_grad_()).backward(g)
    queue.run()
    assert torch.allclose(stage[1].weight.main_grad, ref, rtol=1e-12, atol=1e-12)


def test_profiler_split_adds_main_grad_once_per_microbatch():
    """The profiler runs I and W as the runtimes do: each microbatch adds its gradient once."""
    from koala_ds.profiler.core import measure_stage

    stage = _fused_stage()
    x = torch.randn(3, 5, dtype=torch.double)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):  # 3 timed microbatches and the one measured for memory, same draws
        grad = torch.randn((3, 5), generator=gen).to(torch.double)
        stage(x.clone().requires_grad_()).backward(grad)
    ref = stage[1].weight.main_grad.clone()
    stage[1].weight.main_grad.zero_()
    measure_stage(stage, lambda: x.clone().requires_grad_(), is_last=False, warmup=0, iters=3,
                  full_backward=False, seed=0)
    assert torch.allclose(stage[1].weight.main_grad, ref, rtol=1e-12, atol=1e-12)


def test_nested_input_steps_are_refused():
    with wgrad.deferring():
        with pytest.raises(RuntimeError, match="already running"):
            with wgrad.deferring():
                pass
    assert wgrad.active_queue() is None


def test_queue_holds_only_what_the_weight_gradient_needs():
    """After I the graph is gone: what W keeps is each deferred layer's input and output gradient."""
    mod = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    prepared = wgrad.prepare(mod, max_hold=None)
    x = torch.randn(32, 64, requires_grad=True)
    with prepared.input_step() as queue:
        mod(x).backward(torch.randn(32, 64))
    held = queue.held_bytes()
    # inputs of the two layers (32x64 and 32x256) and their output gradients (32x256, 32x64)
    assert held == 4 * 32 * (64 + 256 + 256 + 64)


def _megatron_linear(fusion: bool, monkeypatch):
    """A ColumnParallelLinear (TP=1, one process) with main_grad as Megatron's DDP gives it;
    under fusion, a CPU stand-in for fused_weight_gradient_mlp_cuda (main_grad += g^T x)."""
    pytest.importorskip("megatron.core")
    from megatron.core.tensor_parallel import ColumnParallelLinear, layers
    from megatron.core.transformer.transformer_config import TransformerConfig

    from koala_ds.profiler.models import _init_single_process_megatron

    _init_single_process_megatron(7)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
                               gradient_accumulation_fusion=False)
    torch.manual_seed(3)
    lin = ColumnParallelLinear(8, 16, config=config, init_method=torch.nn.init.normal_, bias=True,
                               gather_output=True)
    lin.gradient_accumulation_fusion = fusion
    if fusion:
        class _Kernel:
            calls = 0

            @staticmethod
            def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
                _Kernel.calls += 1
                main_grad.add_(grad_output.t().matmul(total_input))

        monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", _Kernel, raising=False)
    lin.weight.main_grad = torch.zeros_like(lin.weight)
    return lin


@pytest.mark.parametrize("fusion", [False, True])
def test_megatron_linear_split_keeps_main_grad_semantics(fusion, monkeypatch, single_process_megatron):
    lin = _megatron_linear(fusion, monkeypatch)
    xs = [torch.randn(5, 2, 8) for _ in range(3)]
    gs = [torch.randn(5, 2, 16) for _ in range(3)]

    def run(split: bool):
        lin.weight.main_grad.zero_()
        lin.weight.grad = lin.bias.grad = None
        queues, dxs = [], []
        for x, g in zip(xs, gs):
            xx = x.clone().requires_grad_()
            with (prepared.input_step() if split else contextlib.nullcontext()) as queue:
                lin(xx)[0].backward(g)
            queues.append(queue)
            dxs.append(xx.grad)
        for q in queues if split else ():
            q.run()
        weight = lin.weight.main_grad.clone() if fusion else lin.weight.grad.clone()
        return weight, lin.bias.grad.clone(), dxs

    prepared = wgrad.prepare(lin, max_hold=None)
    assert prepared.linears == 1
    ref_w, ref_b, ref_dx = run(split=False)
    got_w, got_b, got_dx = run(split=True)
    assert torch.allclose(got_w, ref_w, rtol=1e-6, atol=1e-6) and ref_w.abs().sum() > 0
    assert torch.allclose(got_b, ref_b, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_dx, ref_dx):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    if fusion:  # the kernel ran once per microbatch in each run, and nothing went to .grad
        from megatron.core.tensor_parallel import layers

        assert layers.fused_weight_gradient_mlp_cuda.calls == 6 and lin.weight.grad is None


def _megatron_ddp_hook(param) -> None:
    """What Megatron DDP's backward hook does with overlap_grad_reduce (its buffers need CUDA)."""
    def hook(p):
        assert p.grad is not None, "param.grad being None is not safe when overlap_grad_reduce is True"
        if not p.grad_added_to_main_grad:
            p.main_grad.add_(p.grad)
        p.grad = None

    param.grad_added_to_main_grad = False
    param.register_post_accumulate_grad_hook(hook)


@pytest.mark.parametrize("max_hold", [None, 0.0], ids=["deferred", "kept"])
@pytest.mark.parametrize("fusion", [False, True])
def test_megatron_linear_split_under_saved_tensor_hooks_loses_no_weight_gradient(fusion, max_hold, monkeypatch,
                                                                                 single_process_megatron):
    """Under saved-tensor hooks (the hold policy watches a chunk's first forward with them; so
    do the profiler and activation offloading) ctx.saved_tensors gives a copy of the weight that
    only borrows its gradient accumulator while a graph holds it, and has none of its attributes.
    Deferred, W used that copy: once the graph was gone (the runtime drops a microbatch's output
    after I) the weight gradient went to the copy, silently (Megatron GPT training with zb-h1 lost
    the last layer's linear_fc2 weight gradient of the first microbatch, 21% of it). Kept (computed
    in I), megatron-core's own backward looked for grad_added_to_main_grad on the copy and, under
    gradient_accumulation_fusion, returned no gradient: Megatron DDP with overlap_grad_reduce
    asserts on that."""
    lin = _megatron_linear(fusion, monkeypatch)
    xs = [torch.randn(5, 2, 8) for _ in range(3)]
    gs = [torch.randn(5, 2, 16) for _ in range(3)]
    for x, g in zip(xs, gs):
        lin(x.clone().requires_grad_())[0].backward(g)
    ref = (lin.weight.main_grad if fusion else lin.weight.grad).clone()
    lin.weight.main_grad.zero_()
    lin.weight.grad = None
    if fusion:  # after the reference: megatron-core allocates its own dummy gradient on CUDA
        _megatron_ddp_hook(lin.weight)
    prepared = wgrad.prepare(lin, max_hold=max_hold)
    for x, g in zip(xs, gs):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t):
            out = lin(x.clone().requires_grad_())[0]
        with prepared.input_step() as queue:
            out.backward(g)
        assert len(queue.work) == (1 if max_hold is None else 0)
        del out  # the graph goes, as in a pipeline runtime between I and W
        queue.run()
    got = lin.weight.main_grad if fusion else lin.weight.grad
    assert got is not None and torch.allclose(got, ref, rtol=1e-6, atol=1e-6), (got - ref).abs().max()


def _gpt_last_stage_split_equals_a_full_backward(config: dict | None = None, max_hold=wgrad.DEFAULT) -> list:
    """The runtime's order on the last stage of zb-h1 (F I, then each W after the next I), the
    outputs dropped after I; asserts every gradient equals a full backward's. Returns the number
    of weight gradients each I queued."""
    from koala_ds.profiler.models import megatron_gpt_stages

    stages, _ = megatron_gpt_stages(4, 64, 4, 32, 2, 128, 2, 1234, None, config)
    mod = stages[1]
    xs = [torch.randn(32, 2, 64) for _ in range(4)]
    for x in xs:
        mod(x.clone().requires_grad_()).float().mean().backward()
    ref = [q.grad.clone() for q in mod.parameters()]
    mod.zero_grad(set_to_none=True)
    prepared = wgrad.prepare(mod, max_hold)
    waiting, queued = [], []
    for x in xs:
        out = mod(x.clone().requires_grad_()).float().mean()
        with prepared.input_step() as queue:
            out.backward()
        del out
        waiting.append(queue)
        queued.append(len(queue.work))
        if len(waiting) == 2:
            waiting.pop(0).run()
    for queue in waiting:
        queue.run()
    for (name, q), r in zip(mod.named_parameters(), ref):
        assert q.grad is not None and torch.allclose(q.grad, r, rtol=1e-6, atol=1e-6), \
            (name, (q.grad - r).abs().max())
    return queued


def test_megatron_gpt_last_stage_split_under_the_hold_policy_equals_a_full_backward(single_process_megatron):
    """The default hold policy (which watches the first forward): some layers kept, the rest deferred."""
    pytest.importorskip("megatron.core")
    queued = _gpt_last_stage_split_equals_a_full_backward()
    assert 0 < queued[0] < 9 and len(set(queued)) == 1  # of 2 layers x 4 linears + the output layer


@pytest.fixture
def cpu_rng_for_megatron_checkpointing(monkeypatch):
    """megatron-core's activation checkpointing saves and restores the CUDA RNG state around the
    recomputed forward; on a CPU-only torch that state is the CPU generator's (the model has no
    dropout, so no draw depends on it). Only the state bookkeeping is replaced: the checkpointing,
    its recomputation and its nested backward are megatron-core's own."""
    random = pytest.importorskip("megatron.core.tensor_parallel.random")
    monkeypatch.setattr(random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state())
    monkeypatch.setattr(random, "_set_cuda_rng_state", lambda *args, **kwargs: None)


@pytest.mark.parametrize("granularity", ["full", "selective"])
@pytest.mark.parametrize("max_hold", [None, wgrad.DEFAULT], ids=["all-deferred", "default-policy"])
def test_megatron_gpt_with_recomputation_split_equals_a_full_backward(granularity, max_hold, single_process_megatron,
                                                                     cpu_rng_for_megatron_checkpointing):
    """megatron-core's activation recomputation (--recompute-granularity full / selective): the
    recomputed forward and its backward run inside I; deferred linears queue the recomputed input.
    With no bound every linear defers; the default bound keeps in I what deferring would hold
    beyond the checkpoints (under full recomputation all but the output layer)."""
    config = {"recompute_granularity": granularity}
    if granularity == "full":
        config.update(recompute_method="uniform", recompute_num_layers=1)
    queued = _gpt_last_stage_split_equals_a_full_backward(config, max_hold)
    if max_hold is None:
        assert queued == [9] * 4
    elif granularity == "full":
        assert queued == [1] * 4


def sequence_parallel_worker(rank: int, world: int, spec: dict) -> dict:
    """A ColumnParallelLinear -> gelu -> RowParallelLinear pair, TP=2 with sequence parallelism
    (input sharded along the sequence), run as a full backward and as I then W under saved-tensor
    hooks with the output dropped between them; the largest differences, per gradient."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from koala_ds.megatron.cpu import prepare_cpu

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    prepare_cpu(seed=7)  # megatron-core's all-gather buffer on the CPU
    # megatron-core's sequence-parallel mappings allocate on torch.cuda.current_device(): here
    # (this process only) the CPU is that device; the collectives and the layers are its own
    torch.cuda.current_device = lambda: "cpu"
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
                               tensor_model_parallel_size=world, sequence_parallel=True,
                               gradient_accumulation_fusion=False)
    torch.manual_seed(3)  # the same full weights on every rank; each keeps its shard
    init = torch.nn.init.normal_
    col = ColumnParallelLinear(8, 16, config=config, init_method=init, bias=True, gather_output=False)
    row = RowParallelLinear(16, 8, config=config, init_method=init, bias=True, input_is_parallel=True,
                            skip_bias_add=False)
    model = torch.nn.ModuleList([col, row])

    def forward(x):
        return row(torch.nn.functional.gelu(col(x)[0]))[0]

    shard = slice(rank * 3, (rank + 1) * 3)  # sequence 6 over 2 ranks
    xs = [torch.randn(6, 2, 8)[shard] for _ in range(3)]
    gs = [torch.randn(6, 2, 8)[shard] for _ in range(3)]

    def run(split: bool):
        model.zero_grad(set_to_none=True)
        dxs, deferred = [], 0
        for x, g in zip(xs, gs):
            xx = x.clone().requires_grad_()
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t):
                out = forward(xx)
            with (prepared.input_step() if split else contextlib.nullcontext()) as queue:
                out.backward(g)
            del out
            if split:
                deferred += len(queue.work)
                queue.run()
            dxs.append(xx.grad)
        return [q.grad.clone() for q in model.parameters()], dxs, deferred

    prepared = wgrad.prepare(model, max_hold=None)
    ref, ref_dx, _ = run(split=False)
    got, got_dx, deferred = run(split=True)
    ps.destroy_model_parallel()
    return {"deferred": deferred,
            "grads": [(a - b).abs().max().item() / max(b.abs().max().item(), 1e-30) for a, b in zip(got, ref)],
            "input_grads": [(a - b).abs().max().item() for a, b in zip(got_dx, ref_dx)]}


@pytest.mark.slow  # two processes
def test_megatron_linears_with_sequence_parallelism_split_equals_a_full_backward():
    """TP=2 with sequence parallelism (megatron-core's GPT needs Apex or TE LayerNorm for it, so
    the engine tests cannot run it on CPU): I reduce-scatters the input gradient, W all-gathers
    the sequence-sharded input, and the gradients are those of megatron-core's own backward."""
    pytest.importorskip("megatron.core")
    from koala_ds.runtime.spawn import spawn
    from rank_processes import PRELOAD

    for rank, got in enumerate(spawn("test_wgrad:sequence_parallel_worker", 2, {}, timeout_s=180, preload=PRELOAD)):
        assert got["deferred"] == 6, (rank, got)  # both linears, three microbatches
        assert max(got["grads"]) <= 1e-6 and max(got["input_grads"]) <= 1e-6, (rank, got)


def test_transformer_engine_layers_defer_through_backward_dw():
    """TE >= 2.3 layers built with delay_wgrad_compute=True: I leaves their weight gradient to
    backward_dw(), which W calls."""
    te = pytest.importorskip("transformer_engine.pytorch", reason="Transformer Engine is not installed here")
    if not torch.cuda.is_available():
        pytest.skip("Transformer Engine layers need CUDA")
    torch.manual_seed(4)
    ref = te.Linear(64, 64, params_dtype=torch.float32).cuda()
    lin = te.Linear(64, 64, params_dtype=torch.float32, delay_wgrad_compute=True).cuda()
    lin.load_state_dict(ref.state_dict())
    x, g = torch.randn(16, 64, device="cuda"), torch.randn(16, 64, device="cuda")
    ref(x).backward(g)
    prepared = wgrad.prepare(lin)
    assert prepared.te_modules == [lin] and not prepared.uncovered
    with prepared.input_step() as queue:
        lin(x).backward(g)
    assert lin.weight.grad is None or not lin.weight.grad.any()
    queue.run()
    assert torch.allclose(lin.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)


def test_linear_under_autocast_defers_in_the_autocast_dtype():
    torch.manual_seed(5)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    mod = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    mod.load_state_dict(ref.state_dict())
    x, g = torch.randn(4, 16), torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref = ref(x.clone().requires_grad_())
    out_ref.backward(g.to(out_ref.dtype))
    prepared = wgrad.prepare(mod, max_hold=None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mod(x.clone().requires_grad_())
    assert out.dtype == out_ref.dtype == torch.bfloat16
    with prepared.input_step() as queue:
        out.backward(g.to(out.dtype))
    queue.run()
    for p, r in zip(mod.parameters(), ref.parameters()):
        assert p.grad.dtype == r.grad.dtype == torch.float32
        assert torch.allclose(p.grad, r.grad, rtol=2e-2, atol=2e-2), (p.shape, (p.grad - r.grad).abs().max())


def test_megatron_runtime_accepts_gradient_accumulation_fusion_with_a_split_schedule():
    """It used to refuse it (the graph-level split added main_grad twice); with the layer-level
    split it is exact (test_megatron_linear_split_keeps_main_grad_semantics), so it is allowed.
    megatron-core's own embedding wgrad deferral still is not."""
    from types import SimpleNamespace

    pytest.importorskip("megatron.core")
    from koala_ds.megatron.resolve import MegatronScheduleError
    from koala_ds.megatron.runtime import KoalaForwardBackward

    fused = SimpleNamespace(gradient_accumulation_fusion=True, defer_embedding_wgrad_compute=False)
    KoalaForwardBackward._check_config(fused, split=True, forward_only=False, p=2)
    deferred = SimpleNamespace(gradient_accumulation_fusion=False, defer_embedding_wgrad_compute=True)
    with pytest.raises(MegatronScheduleError, match="defer_embedding_wgrad_compute"):
        KoalaForwardBackward._check_config(deferred, split=True, forward_only=False, p=2)


def test_plain_forward_runs_torchs_own_linear_and_stays_exact():
    """Inside plain_forward() a prepared nn.Linear runs as an unprepared one (what a
    full-backward schedule runs): no custom Function, and even an I step then defers nothing."""
    torch.manual_seed(4)
    mod = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    x = torch.randn(5, 4)
    mod(x).sum().backward()
    ref = [p.grad.clone() for p in mod.parameters()]
    mod.zero_grad(set_to_none=True)
    prepared = wgrad.prepare(mod, max_hold=None)
    assert "_Linear" in type(mod(x).grad_fn).__name__   # deferrable outside
    with wgrad.plain_forward():
        out = mod(x)
    assert "_Linear" not in type(out.grad_fn).__name__ and out.grad_fn.name().startswith("Addmm")
    with prepared.input_step() as queue:
        out.sum().backward()
    assert not queue.work   # nothing to defer: the native backward computed the weight gradients
    for p, r in zip(mod.parameters(), ref):
        assert torch.allclose(p.grad, r, rtol=1e-6, atol=1e-7)


def test_full_backward_forwards_are_the_b_actions_of_a_split_schedule():
    """dualpipe-v runs some backwards whole: the runtimes run those microbatches' forwards plain."""
    from koala_ds import library
    from koala_ds.core.ir import Op

    sched = library.get("dualpipe-v").compile(4, 8, 2)
    assert sched.backward == "split"
    for rank in range(4):
        found = wgrad.full_backward_forwards(sched, rank)
        assert found == {(a.stage, a.microbatch) for a in sched.ranks[rank] if a.op is Op.B}
    assert any(wgrad.full_backward_forwards(sched, rank) for rank in range(4))
    zb = library.get("zb-h1").compile(4, 8, 1)
    assert not any(wgrad.full_backward_forwards(zb, rank) for rank in range(4))


def test_plain_forwards_follow_the_call_and_whether_a_split_schedule_prepared_the_chunks():
    """The runtimes' one rule (Megatron's step runner, DeepSpeed's set_koala_schedule): nothing
    plain on unprepared chunks; a deferring call runs its full-B microbatches' forwards plain;
    any other call on prepared chunks (1f1b taking turns with zb-h1) runs every forward plain."""
    from koala_ds import library

    dualpipe = library.get("dualpipe-v").compile(4, 8, 2)
    one = library.get("1f1b").compile(4, 8, 1)
    mod = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert wgrad.plain_forwards(one, 0, [mod], False) == frozenset()
    assert wgrad.plain_forwards(dualpipe, 1, [mod], True) == frozenset()
    wgrad.prepare(mod)
    for rank in range(4):
        assert wgrad.plain_forwards(dualpipe, rank, [mod], True) == wgrad.full_backward_forwards(dualpipe, rank)
        assert wgrad.plain_forwards(one, rank, [torch.nn.Linear(2, 2), mod], False) == \
            {(a.stage, a.microbatch) for a in one.ranks[rank] if a.op.name == "F"}
