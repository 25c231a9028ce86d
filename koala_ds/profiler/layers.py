"""Per-layer profile: measure each layer of a model on its own and write the per-layer profile
(the stage profile's versioned extension, `layers` in place of `stages`; docs/profiling.md,
"Per-layer profile").

Every layer (the embedding, each transformer layer, the output layer with the loss) is measured
exactly as `profile_stages` measures a stage, with the same timers and the same split backward
(`koala_ds.runtime.wgrad`): the layers are handed to it as one-layer stages. On top of the stage fields
each entry has the layer's `name` and `kind`, `output_mb` (the boundary tensor it passes on: what
is sent when a cut follows it; 0 for the last layer) and `param_mb` (its parameter bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .core import MIB, ProfileFile, ProfileResult, profile_stages

#: The layer kinds of the format.
KINDS = ("embedding", "transformer", "output", "other")


@dataclass(frozen=True)
class LayerInfo:
    """What the profiler knows of a layer without running it."""

    name: str
    kind: str = "other"
    param_bytes: int = 0


def param_bytes(module) -> int:
    """Bytes of the distinct storages of a module's trainable parameters."""
    from ..runtime.wgrad import storage_bytes

    return storage_bytes((p.untyped_storage().data_ptr(), p.untyped_storage().nbytes())
                         for p in module.parameters() if p.requires_grad)


@dataclass
class LayerProfileResult(ProfileFile):
    """The measurements of every layer; `to_dict()` is a per-layer profile (version 1)."""

    result: ProfileResult
    layers: list[LayerInfo]
    optimizer_bytes_per_param_byte: float | None = None
    extra_meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        data = self.result.to_dict()
        stages, meta = data["stages"], data.pop("meta")
        layers = []
        spreads = []
        for info, entry, m in zip(self.layers, stages, self.result.stages):
            spreads.append(entry.pop("spread", None))  # not a field of a layer: in meta (docs/profiling.md)
            layers.append({"name": info.name, "kind": info.kind, **entry,
                           "output_mb": round(m.output_bytes / MIB, 9),
                           "param_mb": round(info.param_bytes / MIB, 9)})
        meta["layers"] = [{"name": info.name, **lm, **({"spread": sp} if sp else {})}
                          for info, lm, sp in zip(self.layers, meta.pop("stages"), spreads)]
        meta["format"] = "koala per-layer profile (docs/profiling.md)"
        meta.update(self.extra_meta)
        out: dict[str, Any] = {("layers" if k == "stages" else k): (layers if k == "stages" else v)
                               for k, v in data.items()}
        if self.optimizer_bytes_per_param_byte is not None:
            out["optimizer_bytes_per_param_byte"] = self.optimizer_bytes_per_param_byte
        out["meta"] = meta
        return out


def profile_layers(layer_modules: Sequence, infos: Sequence[LayerInfo], sample_input, *,
                   optimizer_bytes_per_param_byte: float | None = None, **kwargs) -> LayerProfileResult:
    """Profile a model layer by layer: `layer_modules` in model order (each passes one tensor
    on; the last one's output goes through `loss_fn`), `infos` their names and kinds. kwargs go
    to `profile_stages` (warmup, iters, device, p2p, memory_limit_mb, loss_fn, progress, ...)."""
    if len(layer_modules) != len(infos):
        raise ValueError(f"profile_layers: {len(layer_modules)} modules but {len(infos)} layer infos")
    bad = [i.kind for i in infos if i.kind not in KINDS]
    if bad:
        raise ValueError(f"profile_layers: unknown layer kind {bad[0]!r} (known: {', '.join(KINDS)})")
    result = profile_stages(layer_modules, sample_input, **kwargs)
    return LayerProfileResult(result, list(infos), optimizer_bytes_per_param_byte)


def stage_shaped(data: dict) -> dict:
    """A per-layer profile dict as a stage profile with one stage per layer (for checks that
    what is written carries valid stage fields: `CostProfile.from_dict(stage_shaped(d))`)."""
    keep = ("forward", "backward_input", "backward_weight", "backward", "activation_mb", "w_hold_mb")
    out = {k: v for k, v in data.items() if k not in ("layers", "optimizer_bytes_per_param_byte", "meta",
                                                      "memory_limit_mb")}
    out["stages"] = [{k: layer[k] for k in keep if k in layer} for layer in data["layers"]]
    return out
