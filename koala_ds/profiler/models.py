"""Stage modules of real models for the profiler: megatron-core's GPT (as in
examples/megatron_gpt) and the layers of a DeepSpeed PipelineModule."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..megatron.p2p import to_device


# -- megatron-core GPT ------------------------------------------------------------------------
class GPTStage(torch.nn.Module):
    """One virtual stage of the example GPT: a megatron-core GPTModel chunk with its layers,
    called the way examples/megatron_gpt's forward_step_func calls it."""

    def __init__(self, chunk, seq_length: int, micro_batch_size: int, labels: torch.Tensor | None):
        super().__init__()
        self.chunk = chunk
        self.seq_length, self.mbs = seq_length, micro_batch_size
        self.register_buffer("position_ids", torch.arange(seq_length).unsqueeze(0).expand(micro_batch_size, -1).clone(),
                             persistent=False)
        self.register_buffer("mask", torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool).tril().logical_not(),
                             persistent=False)
        self.labels = labels

    def forward(self, x):
        if self.chunk.pre_process:
            tokens = x
        else:
            self.chunk.set_input_tensor(x)
            tokens = None
        return self.chunk(tokens, self.position_ids, self.mask,
                          labels=self.labels if self.chunk.post_process else None)


def _init_single_process_megatron(seed: int, attention_elements: int = 1 << 22) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        # one rank: an in-process store, no port (a port in MASTER_PORT would be handed to every
        # child this process starts later, EADDRINUSE there; and a free one could be taken first)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1)
    from ..megatron.cpu import prepare_cpu

    prepare_cpu(seed=seed, attention_buffer_elements=max(1 << 22, attention_elements))
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def megatron_gpt_stages(num_layers: int, hidden_size: int, num_attention_heads: int, seq_length: int,
                        micro_batch_size: int, vocab_size: int, num_stages: int, seed: int = 1234, device=None,
                        extra_config: dict | None = None):
    """The GPT of examples/megatron_gpt split into `num_stages` virtual stages (num_layers /
    num_stages transformer layers each; embedding on the first, output layer and loss on the
    last), built in this process, and a sample input (token ids) for the first stage. `extra_config`:
    more TransformerConfig fields (e.g. recompute_granularity)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if num_layers % num_stages:
        raise ValueError(f"--num-layers {num_layers} is not a multiple of the {num_stages} stages")
    # megatron-core's attention scores buffer: heads x seq^2 per sample (on CPU, prepare_cpu sizes it)
    _init_single_process_megatron(seed, num_attention_heads * seq_length ** 2 * micro_batch_size)
    lps = num_layers // num_stages
    device = torch.device(device) if device is not None else torch.device("cpu")
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_length), generator=g).to(device)
    labels = torch.randint(0, vocab_size, (micro_batch_size, seq_length), generator=g).to(device)
    stages = []
    for s in range(num_stages):
        config = TransformerConfig(num_layers=lps, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                                   use_cpu_initialization=True, pipeline_dtype=torch.float32,
                                   params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                                   bias_dropout_fusion=False, gradient_accumulation_fusion=False,
                                   cuda_graph_scope=[],  # the whole layer; its default "full" is deprecated (a warning)
                                   **(extra_config or {}))
        torch.manual_seed(seed + s)
        chunk = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=vocab_size, max_sequence_length=seq_length,
                         pre_process=s == 0, post_process=s == num_stages - 1,
                         share_embeddings_and_output_weights=False)
        stages.append(GPTStage(chunk, seq_length, micro_batch_size, labels).to(device))
    return stages, tokens


def profile_megatron_gpt(num_layers: int = 8, hidden_size: int = 64, num_attention_heads: int = 4,
                         seq_length: int = 32, micro_batch_size: int = 2, vocab_size: int = 128, p: int = 4,
                         v: int = 1, seed: int = 1234, device=None, **kwargs):
    """Profile the example GPT for p ranks x v chunks (p * v virtual stages); kwargs go to
    `profile_stages` (warmup, iters, p2p, memory_limit_mb, ...)."""
    from .core import profile_stages

    stages, tokens = megatron_gpt_stages(num_layers, hidden_size, num_attention_heads, seq_length, micro_batch_size,
                                         vocab_size, p * v, seed, device)
    kwargs.setdefault("name", f"megatron-gpt-L{num_layers}-H{hidden_size}-S{p * v}")
    kwargs.setdefault("description", f"megatron-core GPTModel (local spec), {num_layers} layers, hidden {hidden_size}, "
                                     f"{num_attention_heads} heads, seq {seq_length}, micro-batch {micro_batch_size}, "
                                     f"vocab {vocab_size}; {p * v} virtual stages (p={p}, v={v})")
    result = profile_stages(stages, tokens, device=device, loss_fn=lambda out: out.float().mean(), **kwargs)
    result.extra_meta.update({"model": "megatron-gpt", "p": p, "v": v})
    return result


# -- megatron-core GPT, layer by layer -------------------------------------------------------------
class _GPTEmbedding(torch.nn.Module):
    """The GPT's embedding (token + position): token ids -> [seq, batch, hidden]."""

    def __init__(self, model, position_ids):
        super().__init__()
        self.embedding = model.embedding
        self.register_buffer("position_ids", position_ids, persistent=False)

    def forward(self, tokens):
        return self.embedding(input_ids=tokens, position_ids=self.position_ids)


class _GPTLayer(torch.nn.Module):
    """One megatron-core TransformerLayer, called as its TransformerBlock calls it."""

    def __init__(self, layer, mask):
        super().__init__()
        self.layer = layer
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, hidden):
        out, _ = self.layer(hidden_states=hidden, attention_mask=self.mask)
        return out


class _GPTOutput(torch.nn.Module):
    """The final layer norm, the output layer and the per-token loss (as GPTModel's post-process)."""

    def __init__(self, model, labels):
        super().__init__()
        self.norm, self.output_layer = model.decoder.final_layernorm, model.output_layer
        self._loss = [model.compute_language_model_loss]  # a method of the model: not a submodule
        self.labels = labels

    def forward(self, hidden):
        logits, _ = self.output_layer(self.norm(hidden))
        return self._loss[0](self.labels, logits)


def megatron_gpt_layers(num_layers: int, hidden_size: int, num_attention_heads: int, seq_length: int,
                        micro_batch_size: int, vocab_size: int, seed: int = 1234, device=None):
    """The GPT of examples/megatron_gpt as one module per layer (embedding, each transformer
    layer, output layer + loss), cut out of one megatron-core GPTModel built in this process;
    returns (modules, LayerInfos, sample token ids)."""
    from .layers import LayerInfo, param_bytes

    stages, tokens = megatron_gpt_stages(num_layers, hidden_size, num_attention_heads, seq_length,
                                         micro_batch_size, vocab_size, 1, seed, device)
    whole = stages[0]
    model = whole.chunk
    modules = [_GPTEmbedding(model, whole.position_ids)]
    modules += [_GPTLayer(layer, whole.mask) for layer in model.decoder.layers]
    modules.append(_GPTOutput(model, whole.labels))
    infos = [LayerInfo("embedding", "embedding")] + [LayerInfo(f"layer.{i}", "transformer")
                                                     for i in range(num_layers)] + [LayerInfo("output", "output")]
    infos = [LayerInfo(i.name, i.kind, param_bytes(m)) for i, m in zip(infos, modules)]
    return modules, infos, tokens


def profile_megatron_gpt_layers(num_layers: int = 8, hidden_size: int = 64, num_attention_heads: int = 4,
                                seq_length: int = 32, micro_batch_size: int = 2, vocab_size: int = 128, p: int = 4,
                                seed: int = 1234, device=None, **kwargs):
    """Per-layer profile of the example GPT; `p` is recorded (the p2p latency is measured only
    when p > 1, as for the stage profile); kwargs go to `profile_layers`."""
    from .layers import profile_layers

    modules, infos, tokens = megatron_gpt_layers(num_layers, hidden_size, num_attention_heads, seq_length,
                                                 micro_batch_size, vocab_size, seed, device)
    kwargs.setdefault("name", f"megatron-gpt-L{num_layers}-H{hidden_size}-layers")
    kwargs.setdefault("description", f"megatron-core GPTModel (local spec), {num_layers} layers, hidden {hidden_size}, "
                                     f"{num_attention_heads} heads, seq {seq_length}, micro-batch {micro_batch_size}, "
                                     f"vocab {vocab_size}; per layer")
    result = profile_layers(modules, infos, tokens, device=device, loss_fn=lambda out: out.float().mean(), **kwargs)
    result.extra_meta.update({"model": "megatron-gpt", "p": p, "num_layers": num_layers,
                              "layout_letters": "E (embedding), t (transformer layer), L (output + loss): "
                                                "--pipeline-model-parallel-layout"})
    return result


# -- a plain-torch GPT (DeepSpeed layer lists, benchmarks) -------------------------------------------
class GPTBlock(torch.nn.Module):
    """A pre-norm GPT block of plain torch layers."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):  # x: [batch, seq, hidden]
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class GPTEmbedding(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int, seq: int):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, hidden), torch.nn.Embedding(seq, hidden)

    def forward(self, ids):
        return self.tok(ids) + self.pos.weight[: ids.shape[1]]


class GPTHead(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.ln, self.out = torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, x):
        return self.out(self.ln(x))


def gpt_layers(num_layers: int, hidden: int, heads: int, seq: int, vocab: int) -> list:
    """A plain-torch GPT as a layer list: embedding, `num_layers` blocks, final norm + LM head."""
    return [GPTEmbedding(vocab, hidden, seq)] + [GPTBlock(hidden, heads) for _ in range(num_layers)] + \
        [GPTHead(vocab, hidden)]


def gpt_layer_specs(num_layers: int, hidden: int, heads: int, seq: int, vocab: int) -> list:
    """The same GPT as DeepSpeed LayerSpecs (for a PipelineModule)."""
    from deepspeed.pipe import LayerSpec

    return [LayerSpec(GPTEmbedding, vocab, hidden, seq)] + \
        [LayerSpec(GPTBlock, hidden, heads) for _ in range(num_layers)] + [LayerSpec(GPTHead, vocab, hidden)]


# -- DeepSpeed PipelineModule -------------------------------------------------------------------
@dataclass(frozen=True)
class LayerSeeding:
    """A PipelineModule's `seed_layers=True`: DeepSpeed reseeds before every layer of every
    forward (`seed_fn(seed)`, else deepspeed.runtime.utils.set_random_seed: Python's, numpy's and
    torch's generators), with seed base_seed x (forwards so far + 1) + the layer's index. That is
    host time in each F that the layers alone do not show; a profiled stage pays it too."""

    base_seed: int = 1234  # PipelineModule's default
    seed_fn: Callable[[int], Any] | None = None

    @classmethod
    def of(cls, module_or_layers, seed_layers: bool | None = None) -> "LayerSeeding | None":
        """A PipelineModule's own seeding (`seed_layers`, `base_seed`, `seed_fn`); for a layer
        list, `seed_layers` (True: DeepSpeed's defaults)."""
        own = getattr(module_or_layers, "seed_layers", None)
        if own is not None:
            return cls(module_or_layers.base_seed, module_or_layers.seed_fn) if own else None
        return cls() if seed_layers else None

    def reseed(self, forwards: int, layer: int) -> None:
        seed = self.base_seed * (forwards + 1) + layer
        if self.seed_fn is not None:
            self.seed_fn(seed)
        else:
            from deepspeed.runtime import utils as ds_utils

            ds_utils.set_random_seed(seed)


class _Layers(torch.nn.Module):
    def __init__(self, funcs: list, seeding: LayerSeeding | None = None, first_layer: int = 0):
        super().__init__()
        self.funcs = funcs
        self.mods = torch.nn.ModuleList([f for f in funcs if isinstance(f, torch.nn.Module)])
        self.seeding, self.first_layer, self.forwards = seeding, first_layer, 0

    def forward(self, *args):
        x = args[0] if len(args) == 1 else args  # a tuple input: the first layer's one argument, as DeepSpeed
        self.forwards += 1
        for i, f in enumerate(self.funcs):
            if self.seeding is not None:
                self.seeding.reseed(self.forwards, self.first_layer + i)
            x = f(x)
        return x


def layer_type_names(specs) -> list[str]:
    """The name DeepSpeed's type:REGEX partitioning matches for each layer (LayerSpec, module or
    function) of a pipeline model's layer list."""
    from deepspeed.runtime.pipe.module import LayerSpec

    def name(spec) -> str:
        if isinstance(spec, LayerSpec):
            return spec.typename.__name__
        if isinstance(spec, torch.nn.Module):
            return spec.__class__.__name__
        return getattr(spec, "__name__", "")

    return [name(spec) for spec in specs]


def pipeline_module_stages(module_or_layers, num_stages: int, partition_method: str = "parameters",
                           seed_layers: bool | None = None):
    """Build the stages of a DeepSpeed pipeline model in this process: the layer list (LayerSpec,
    TiedLayerSpec, modules, callables) of a `PipelineModule` (its `_layer_specs`) or a list,
    partitioned as PipelineModule partitions it (uniform, parameters, type:REGEX); each stage's
    forward reseeds per layer as DeepSpeed's does where the module has `seed_layers` (a list:
    where `seed_layers` is True; LayerSeeding)."""
    import re

    from deepspeed.runtime import utils as ds_utils
    from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec

    specs = list(getattr(module_or_layers, "_layer_specs", module_or_layers))
    method = getattr(module_or_layers, "partition_method", partition_method).lower()
    built, tied = [], {}
    for spec in specs:
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                tied[spec.key] = spec.build()
            mod = tied[spec.key]
            if spec.forward_fn is not None:
                built.append(lambda x, mod=mod, fn=spec.forward_fn: fn(mod, x))
                built[-1].module = mod
            else:
                built.append(mod)
        elif isinstance(spec, LayerSpec):
            built.append(spec.build())
        else:
            built.append(spec)

    if method == "uniform":
        parts = ds_utils.partition_uniform(num_items=len(specs), num_parts=num_stages)
    elif method == "parameters":
        # a tied layer with a forward_fn is a function of its module: DeepSpeed counts the module at each use
        mods = [b if isinstance(b, torch.nn.Module) else getattr(b, "module", None) for b in built]
        counts = [sum(p.numel() for p in b.parameters() if p.requires_grad) if isinstance(b, torch.nn.Module) else 0
                  for b in mods]
        parts = ds_utils.partition_balanced(weights=counts, num_parts=num_stages)
    elif method.startswith("type:"):
        rx = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        parts = ds_utils.partition_balanced(weights=[1 if rx.search(n) else 0 for n in layer_type_names(specs)],
                                            num_parts=num_stages)
    else:
        raise ValueError(f"partition method {method!r}: use uniform, parameters or type:REGEX")
    stages, seeding = [], LayerSeeding.of(module_or_layers, seed_layers)
    for s in range(num_stages):
        funcs = built[parts[s]:parts[s + 1]]
        mods = [f if isinstance(f, torch.nn.Module) else getattr(f, "module", None) for f in funcs]
        layer = _Layers(funcs, seeding, int(parts[s]))
        layer.extra = torch.nn.ModuleList([m for m in mods if m is not None and not isinstance(m, type(None))
                                           and m not in list(layer.mods)])
        stages.append(layer)
    return stages


def _on_device(module_or_layers, stages, sample_input, loss_fn, kwargs):
    """Move the stages and the input to kwargs' device; the module's loss_fn with `labels`."""
    device = kwargs.get("device")
    if device is not None:  # the layers are built where their code puts them (the CPU): move them
        stages = [stage.to(device) for stage in stages]
        sample_input = to_device(sample_input, device)
    if loss_fn is None and getattr(module_or_layers, "loss_fn", None) is not None and "labels" in kwargs:
        labels = to_device(kwargs.pop("labels"), device) if device is not None else kwargs.pop("labels")
        module_loss = module_or_layers.loss_fn
        loss_fn = lambda out: module_loss(out, labels)  # noqa: E731
    return stages, sample_input, loss_fn


def profile_pipeline_module(module_or_layers, sample_input, num_stages: int, partition_method: str = "parameters",
                            loss_fn=None, seed_layers: bool | None = None, **kwargs):
    """Profile a DeepSpeed pipeline model (a `PipelineModule` or its layer list) split into
    `num_stages` virtual stages; `loss_fn(output)` (default: the module's `loss_fn` applied to
    `(output, labels)` is not known here, so the mean of the output); `seed_layers`: a layer
    list's forwards reseed per layer as PipelineModule(seed_layers=True) does (a module: its own)."""
    from .core import profile_stages

    stages = pipeline_module_stages(module_or_layers, num_stages, partition_method, seed_layers)
    stages, sample_input, loss_fn = _on_device(module_or_layers, stages, sample_input, loss_fn, kwargs)
    kwargs.setdefault("name", f"deepspeed-pipeline-S{num_stages}")
    kwargs.setdefault("direct_wgrad", True)  # W as the DeepSpeed runtime runs it
    result = profile_stages(stages, sample_input, loss_fn=loss_fn, **kwargs)
    result.extra_meta.update({"model": "deepspeed PipelineModule", "partition_method": partition_method})
    return result


def _layer_name(spec) -> str:
    from deepspeed.runtime.pipe.module import LayerSpec

    if isinstance(spec, LayerSpec):
        return spec.typename.__name__
    if isinstance(spec, torch.nn.Module):
        return spec.__class__.__name__
    return getattr(spec, "__name__", type(spec).__name__)


def pipeline_module_layer_infos(module_or_layers, stages) -> list:
    """Names and kinds of a layer list's layers: the first is the `embedding` entry, the last the
    `output` entry (with the loss), the others `transformer` when they have parameters, else
    `other`. Names are `<index>.<class>` (the index is DeepSpeed's layer index)."""
    from ..runtime.wgrad import storage_bytes
    from .layers import LayerInfo

    specs = list(getattr(module_or_layers, "_layer_specs", module_or_layers))
    infos, seen = [], set()
    for i, (spec, stage) in enumerate(zip(specs, stages)):
        storages = {q.untyped_storage().data_ptr(): q.untyped_storage().nbytes()
                    for q in stage.parameters() if q.requires_grad}
        nbytes = storage_bytes((ptr, n) for ptr, n in storages.items() if ptr not in seen)
        seen.update(storages)
        kind = "embedding" if i == 0 else "output" if i == len(specs) - 1 else "transformer" if nbytes else "other"
        infos.append(LayerInfo(f"{i}.{_layer_name(spec)}", kind, nbytes))
    return infos


def profile_pipeline_module_layers(module_or_layers, sample_input, loss_fn=None, seed_layers: bool | None = None,
                                   **kwargs):
    """Per-layer profile of a DeepSpeed pipeline model: one entry per entry of its layer list
    (DeepSpeed's layer indices, so a partition maps to `KoalaPipelineModule(parts=...)`).
    A tied layer's parameters count where the tied module is built first; `seed_layers` as
    `profile_pipeline_module`."""
    from .layers import profile_layers

    specs = list(getattr(module_or_layers, "_layer_specs", module_or_layers))
    if len(specs) < 2:
        raise ValueError(f"a per-layer profile needs at least 2 layers; the layer list has {len(specs)}")
    stages = pipeline_module_stages(module_or_layers, len(specs), "uniform", seed_layers)
    infos = pipeline_module_layer_infos(module_or_layers, stages)
    stages, sample_input, loss_fn = _on_device(module_or_layers, stages, sample_input, loss_fn, kwargs)
    kwargs.setdefault("name", f"deepspeed-pipeline-{len(specs)}-layers")
    kwargs.setdefault("direct_wgrad", True)  # W as the DeepSpeed runtime runs it
    result = profile_layers(stages, infos, sample_input, loss_fn=loss_fn, **kwargs)
    result.extra_meta.update({"model": "deepspeed PipelineModule",
                              "partition": "KoalaPipelineModule(parts=...) or pipeline.koala.parts"})
    return result
