"""The profiler: measure a real model's per-stage costs and write a cost profile (v1).

    from koala_ds.profiler import profile_stages
    result = profile_stages([stage0, stage1, stage2, stage3], sample_input, p2p=True)
    result.write("prof.json")          # then: koala search --profile prof.json -m 16 -o best.koala

`profile_layers` / `profile_megatron_gpt_layers` / `profile_pipeline_module_layers` write the
per-layer profile instead (koala_ds/profiler/layers.py).

`profile_megatron_gpt(...)` profiles the megatron-core GPT of examples/megatron_gpt,
`profile_pipeline_module(...)` the layers of a DeepSpeed PipelineModule; `measure_p2p_latency`
is the 2-process gloo ping-pong. torch is imported only when a function is called.
"""
from __future__ import annotations

__all__ = ["profile_stages", "profile_megatron_gpt", "profile_pipeline_module", "measure_p2p_latency",
           "ProfileResult", "StageMeasurement", "profile_layers", "LayerInfo", "LayerProfileResult",
           "profile_megatron_gpt_layers", "profile_pipeline_module_layers"]


def __getattr__(name):
    if name in ("profile_stages", "ProfileResult", "StageMeasurement", "SavedTensorTracker"):
        from . import core

        return getattr(core, name)
    if name in ("profile_layers", "LayerInfo", "LayerProfileResult"):
        from . import layers

        return getattr(layers, name)
    if name in ("profile_megatron_gpt", "profile_pipeline_module", "megatron_gpt_stages", "pipeline_module_stages",
                "profile_megatron_gpt_layers", "profile_pipeline_module_layers"):
        from . import models

        return getattr(models, name)
    if name == "measure_p2p_latency":
        from .p2p import measure_p2p_latency

        return measure_p2p_latency
    raise AttributeError(name)
