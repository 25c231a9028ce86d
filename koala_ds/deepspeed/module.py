"""`KoalaPipelineModule`: a DeepSpeed `PipelineModule` cut into p x v virtual stages.

A schedule with v chunks per rank (interleaved-1f1b, zb-v, dualpipe-v, ...) needs the layer
list cut into p*v virtual stages, rank r holding the stages `placement.stages_of(r)`.
The module takes the same layer list and arguments as `PipelineModule`, plus `chunks` (v) and
`placement` ("interleaved" or "vshape"): the layers are partitioned into p*v parts with
DeepSpeed's own partitioner, and each rank builds its chunks, exposing one at a time through
`forward()` (`activate_chunk(c)`), as DeepSpeed's `DualPipeVModule` does for its two phases.
Layer indices (and so parameter names and per-layer checkpoint files) stay global.

With chunks=1 and placement "linear" it behaves exactly as a `PipelineModule`.

A given cut (a searched partition, docs/deepspeed.md "Running a searched split"): `parts=[0, a,
b, ..., n]`, DeepSpeed's own boundary list (`PipelineModule.parts`): virtual stage s holds layers
`parts[s]:parts[s+1]`, p*v+1 entries for p ranks x v chunks, in pipeline order. Or
`config=<the DeepSpeed config, dict or JSON path>`, whose `"pipeline": {"koala": {"parts": [...]}}`
is read; the engine checks that the module it gets was cut as that key says.

Gradient clipping: DeepSpeed's fp32 path (`clip_grad_norm_` in deepspeed/runtime/utils.py,
0.19.8) measures the gradient norm on model-parallel rank 0 only, which for a PipelineModule is
pipeline rank 0: the norm is that of the layers the stock engine places on the first rank.
`clip_norm_parameters()` names those same layers' parameters wherever the p x v cut put them,
so that the Koala engine clips by the same norm as the stock engine (see
`KoalaPipelineEngine.clip_fp32_gradients`).
"""
from __future__ import annotations

from deepspeed.runtime import utils as ds_utils
from deepspeed.runtime.pipe.module import PipelineModule, TiedLayerSpec

from ..core.ir import KoalaError, Placement, ScheduleError


class KoalaPipelineModule(PipelineModule):
    """`PipelineModule(layers, num_stages=p, ...)` holding `chunks` virtual stages per rank.

    Args:
        layers, num_stages, topology, **kwargs: as for `deepspeed.pipe.PipelineModule`;
            `num_stages` (or the topology's pipe dimension) is the number of pipeline ranks p.
        chunks: virtual stages per rank (v).
        placement: "interleaved" (stage s on rank s % p) or "vshape" (zig-zag: rank 0 holds
            the first and the last stage), or a `koala_ds.Placement` with p*v stages.
        parts: the layer boundaries of the p*v virtual stages ([0, ..., len(layers)], pipeline
            order) in place of `partition_method`'s cut.
        config: a DeepSpeed config (dict or JSON file) whose "pipeline.koala.parts" gives `parts`.
    """

    def __init__(self, layers, num_stages=None, topology=None, chunks: int = 1,
                 placement: str | Placement = "interleaved", parts=None, config=None, **kwargs):
        if chunks < 1:
            raise KoalaError(f"KoalaPipelineModule: chunks must be >= 1, got {chunks}")
        source = "KoalaPipelineModule(parts=...)"
        if parts is None and config is not None:
            parts, source = parts_from_config(config), PARTS_KEY
        object.__setattr__(self, "koala_chunks", int(chunks))
        object.__setattr__(self, "_koala_placement_arg", placement)
        object.__setattr__(self, "_koala_parts_arg", (parts, source))
        super().__init__(layers, num_stages=num_stages, topology=topology, **kwargs)

    # -- partitioning -------------------------------------------------------------------
    def _partition_layers(self, method="uniform"):
        p, v = self.num_stages, self.koala_chunks
        arg = self._koala_placement_arg
        try:
            if isinstance(arg, Placement):
                placement = arg
            else:
                placement = Placement.named("linear" if v == 1 and arg in ("linear", "interleaved", "vshape")
                                            else arg, p, v)
        except ScheduleError as exc:
            raise KoalaError(f"KoalaPipelineModule(placement={arg!r}): {exc}") from None
        if placement.p != p or placement.num_stages != p * v or placement.pipelines != 1:
            raise KoalaError(f"KoalaPipelineModule: placement {placement.describe()} has {placement.p} ranks and "
                             f"{placement.num_stages} stages; expected num_stages={p} ranks x chunks={v}")
        if len(self._layer_specs) < p * v:
            raise KoalaError(f"KoalaPipelineModule: {len(self._layer_specs)} layers cannot fill {p} ranks x {v} "
                             f"chunks = {p * v} virtual stages; use fewer chunks or more layers")
        self.koala_placement = placement
        self.num_ranks = p
        self.koala_stock_parts = self._layer_parts(method, p)  # the stock engine's cut into p stages
        self.num_stages = p * v  # virtual stages, as DualPipeVModule does
        parts, source = self._koala_parts_arg
        if parts is None:
            super()._partition_layers(method)
        else:
            self.parts = check_parts(parts, p, v, len(self._layer_specs), source)
        rank = self._topo.get_coord(self.global_rank).pipe
        self.koala_stages = placement.stages_of(rank)
        self.chunk_bounds = [(self.parts[s], self.parts[s + 1]) for s in self.koala_stages]

    def _layer_parts(self, method: str, num_parts: int) -> list:
        """Layer boundaries of `num_parts` stages, as `PipelineModule._partition_layers` cuts them."""
        method = method.lower()
        if method == "uniform":
            return ds_utils.partition_uniform(num_items=len(self._layer_specs), num_parts=num_parts)
        if method == "parameters":
            return ds_utils.partition_balanced(weights=self._count_layer_params(), num_parts=num_parts)
        if method.startswith("type:"):
            weights = [0] * len(self._layer_specs)
            for idx in self._find_layer_type(method.split(":")[1]):
                weights[idx] = 1
            return ds_utils.partition_balanced(weights=weights, num_parts=num_parts)
        raise NotImplementedError(f"Partitioning method {method} not implemented.")

    def stage_owner(self, layer_idx):
        """The pipeline rank that holds `layer_idx` (used to group tied weights)."""
        return self.koala_placement.rank_of(super().stage_owner(layer_idx))

    def _build(self):
        self.chunk_funcs = []
        self.chunk_checkpointable = [[] for _ in self.chunk_bounds]
        for start, stop in self.chunk_bounds:
            self._set_bounds(start, stop)
            super()._build()
            self.chunk_funcs.append(self.forward_funcs)
            self.forward_funcs = []
        self.activate_chunk(0)

    # -- gradient clipping ----------------------------------------------------------------
    def clip_norm_parameters(self) -> list:
        """This rank's parameters whose gradients DeepSpeed's stock engine counts in its
        clipping norm: those of the layers its p-stage cut gives pipeline rank 0 (a tied
        module once, on the rank holding its first such layer). Parameters marked model
        parallel count on every rank, as in stock (added by the engine)."""
        if self._grid.get_slice_parallel_rank() != 0:
            return []
        first, stop = self.koala_stock_parts[0], self.koala_stock_parts[1]
        local = {i for start, end in self.chunk_bounds for i in range(start, end)}
        params: dict[int, object] = {}
        seen_keys: set = set()
        for idx in range(first, stop):
            spec = self._layer_specs[idx]
            if isinstance(spec, TiedLayerSpec):
                if spec.key in seen_keys:
                    continue
                seen_keys.add(spec.key)
                owner = self.tied_modules[spec.key] if idx in local else None
            else:
                owner = self._modules.get(str(idx)) if idx in local else None
            for param in owner.parameters() if owner is not None else ():
                params[id(param)] = param
        return list(params.values())

    # -- chunks -------------------------------------------------------------------------
    def activate_chunk(self, chunk: int) -> None:
        """Expose the layers of local chunk `chunk` (0 .. v-1) through `forward()`."""
        self.active_chunk = chunk
        self.forward_funcs = self.chunk_funcs[chunk]
        self.is_checkpointable_results = self.chunk_checkpointable[chunk]
        self._local_start, self._local_stop = self.chunk_bounds[chunk]

    def _precompute_checkpointable_values(self):
        for chunk in range(len(self.chunk_bounds)):
            self.activate_chunk(chunk)
            self.is_checkpointable_results_interval = None
            super()._precompute_checkpointable_values()
            self.chunk_checkpointable[chunk] = self.is_checkpointable_results
        self.activate_chunk(0)

    def save_state_dict(self, *args, **kwargs):
        for chunk in range(len(self.chunk_bounds)):
            self.activate_chunk(chunk)
            super().save_state_dict(*args, **kwargs)
        self.activate_chunk(0)

    def load_state_dir(self, *args, **kwargs):
        for chunk in range(len(self.chunk_bounds)):
            self.activate_chunk(chunk)
            super().load_state_dir(*args, **kwargs)
        self.activate_chunk(0)


# -- a given cut ----------------------------------------------------------------------------
PARTS_KEY = 'DeepSpeed config "pipeline.koala.parts"'


def check_parts(parts, p: int, v: int, num_layers: int, source: str) -> list:
    """`parts` as a list of layer boundaries for p x v virtual stages, or KoalaError naming `source`."""
    stages = p * v
    shape = f"{stages + 1} layer boundaries [0, ..., {num_layers}] for num_stages={p} x chunks={v} virtual stages"
    if not isinstance(parts, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in parts):
        raise KoalaError(f"{source}: expected a list of {shape}, got {parts!r}")
    parts = list(parts)
    if len(parts) != stages + 1:
        raise KoalaError(f"{source} = {parts} has {len(parts)} entries; expected {shape}")
    if parts[0] != 0 or parts[-1] != num_layers:
        raise KoalaError(f"{source} = {parts} must start at 0 and end at {num_layers} (the number of layers)")
    empty = [s for s in range(stages) if parts[s + 1] <= parts[s]]
    if empty:
        raise KoalaError(f"{source} = {parts}: virtual stage {empty[0]} gets no layer (parts[{empty[0]}] = "
                         f"{parts[empty[0]]} >= parts[{empty[0] + 1}] = {parts[empty[0] + 1]}); the boundaries "
                         f"must increase")
    return parts


def parts_from_config(config):
    """The "pipeline.koala.parts" of a DeepSpeed config (a dict or a JSON file), or None."""
    import json

    if not isinstance(config, dict):
        try:
            with open(config) as fh:
                config = json.load(fh)
        except (OSError, ValueError) as exc:
            raise KoalaError(f"KoalaPipelineModule(config={config!r}): cannot read the DeepSpeed config ({exc})") \
                from None
    koala = (config.get("pipeline") or {}).get("koala") or {}
    return koala.get("parts") if isinstance(koala, dict) else None


def check_model_parts(model, parts, p: int, v: int) -> None:
    """The engine's check: a config that gives "pipeline.koala.parts" gets a model cut that way."""
    parts = check_parts(parts, p, v, len(model._layer_specs), PARTS_KEY)
    if list(model.parts) != parts:
        raise KoalaError(f"{PARTS_KEY} is {parts} but the model was cut at {list(model.parts)}: build it as "
                         f"koala_ds.deepspeed.KoalaPipelineModule(layers, num_stages={p}, chunks={v}, "
                         f"parts={parts}) or with config=<this config>")
