"""megatron-core's pipeline layout (`--pipeline-model-parallel-layout`, e.g. "Et*3|t*2|t*2|tL")
under a Koala schedule: which layers each virtual stage builds.

The layout lists the p*v virtual stages in pipeline order (megatron-core's order: stage
vpp * p + pp_rank). A Koala schedule's placement decides which rank runs which stage; chunk c
of rank r runs `stages_of(r)[c]` (`koala_ds.megatron.chunk_stages`). For the interleaved
placement that is megatron-core's own mapping; a V-shape placement puts stage 2p-1-r in chunk 1
of rank r, so build chunks from `stage_layers(layout, p, stage)`, not from megatron-core's
`vp_stage` lookup. megatron-core itself parses and validates the layout (`check_layout`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.ir import KoalaError

FLAG = "--pipeline-model-parallel-layout"


@dataclass(frozen=True)
class StageLayers:
    """What one virtual stage of a layout builds."""

    num_layers: int  # transformer (decoder) layers
    offset: int  # global index of its first transformer layer
    pre_process: bool  # holds the embedding
    post_process: bool  # holds the output layer and the loss (and the final norm)


def check_layout(layout, pp: int, num_layers: int, flag: str = FLAG):
    """megatron-core's `PipelineParallelLayerLayout` for a layout string (or list), validated by
    megatron-core for `pp` ranks and `num_layers` transformer layers; KoalaError naming `flag`."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    if isinstance(layout, PipelineParallelLayerLayout):
        parsed = layout
    else:
        try:
            parsed = PipelineParallelLayerLayout(layout, pp)
        except (AssertionError, KeyError, ValueError) as exc:
            raise KoalaError(f"{flag} {layout!r}: {exc} (with --pipeline-model-parallel-size {pp})") from None
    try:
        parsed.validate_layer_layout(num_layers=num_layers, mtp_num_layers=None)
    except (AssertionError, NotImplementedError) as exc:
        raise KoalaError(f"{flag} {layout!r}: {exc} (--num-layers {num_layers})") from None
    return parsed


def stage_layers(layout, stage: int) -> StageLayers:
    """The layers of virtual stage `stage` (pipeline order) of a checked layout."""
    from megatron.core.transformer.enums import LayerType

    p = layout.pipeline_model_parallel_size
    stages = [layout.layout[s % p][s // p] for s in range(p * layout.virtual_pipeline_model_parallel_size)]
    if not 0 <= stage < len(stages):
        raise KoalaError(f"{FLAG}: no virtual stage {stage} (the layout has {len(stages)})")
    offset = sum(st.count(LayerType.decoder) for st in stages[:stage])
    mine = stages[stage]
    return StageLayers(mine.count(LayerType.decoder), offset, LayerType.embedding in mine, LayerType.loss in mine)


def uniform_layout(num_layers: int, stages: int) -> str:
    """The layout of megatron-core's default split: num_layers / stages transformer layers per
    stage, the embedding on the first, the output layer and loss on the last."""
    if stages < 1 or num_layers % stages:
        raise KoalaError(f"--num-layers {num_layers} is not a multiple of the {stages} virtual stages")
    per = "t" * (num_layers // stages)
    return "|".join(("E" if s == 0 else "") + per + ("L" if s == stages - 1 else "") for s in range(stages))


def layout_chunks(args) -> int | None:
    """Model chunks per rank that `--pipeline-model-parallel-layout` implies (None without one);
    megatron-core counts the layout's stages."""
    layout, p = getattr(args, "pipeline_model_parallel_layout", None), getattr(args, "pipeline_model_parallel_size", 1)
    if not isinstance(layout, str) or not p:
        return None
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    try:
        stages = PipelineParallelLayerLayout.get_num_stages_from_str(layout)
    except (AssertionError, KeyError, ValueError) as exc:
        raise KoalaError(f"{FLAG} {layout!r}: {exc}") from None
    if stages % p:
        raise KoalaError(f"{FLAG} {layout!r} has {stages} stages, not a multiple of --pipeline-model-parallel-size {p}")
    return stages // p


def tied_embeddings_conflict(placement) -> str | None:
    """Why megatron-core cannot tie the input and output embeddings under `placement` (None when
    it can): it keeps one copy in chunk 0 of pipeline rank 0 and one in the last chunk of rank p-1
    (its embedding group, and the chunks finalize_model_grads all-reduces), so stage 0 and the
    last stage must be there. None for the linear and interleaved placements; a V-shape puts both
    ends on rank 0."""
    p, last = placement.p, placement.num_stages - 1
    if p == 1 or (placement.stages_of(0)[0] == 0 and placement.stages_of(p - 1)[-1] == last):
        return None
    return (f"runs the embedding (stage 0) on pipeline rank {placement.rank_of(0)} and the output layer "
            f"(stage {last}) on rank {placement.rank_of(last)}, where megatron-core ties the two only between "
            f"chunk 0 of rank 0 and the last chunk of rank {p - 1}")
