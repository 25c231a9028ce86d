"""A partition (layers per virtual stage, docs/profiling.md "Per-layer profiles") as the engines'
own settings. No torch here.

- Megatron-core (0.16.1): `pipeline_model_parallel_layout` (Megatron-LM's
  `--pipeline-model-parallel-layout`), a string of stages separated by `|`, each a run of
  `E` (embedding), `t` (transformer layer) and `L` (output layer and loss), `t*4` for `tttt`;
  entry `c * p + r` is model chunk c of pipeline rank r (so pipeline order for the linear and
  interleaved placements). `megatron_layout`.
- DeepSpeed: `KoalaPipelineModule(..., parts=[...])`, the layer boundaries of the virtual stages
  in pipeline order (stage s holds profile layers parts[s] .. parts[s+1] - 1). `deepspeed_parts`.
"""
from __future__ import annotations

from typing import Sequence

from .ir import KoalaError, Placement

MEGATRON_CHARS = {"embedding": "E", "transformer": "t", "output": "L"}


def check_counts(partition: Sequence[int], num_layers: int) -> list[int]:
    """The partition as ints; every virtual stage >= 1 layer and the counts sum to `num_layers`."""
    counts = [int(c) for c in partition]
    if not counts or any(c < 1 for c in counts) or sum(counts) != num_layers:
        raise KoalaError(f"partition {counts}: every virtual stage needs >= 1 layer and the counts must sum to "
                         f"the {num_layers} layers of the profile")
    return counts


def deepspeed_parts(partition: Sequence[int]) -> list[int]:
    """Layer boundaries: [0, c0, c0 + c1, ..., number of layers]."""
    out = [0]
    for count in check_counts(partition, sum(int(c) for c in partition)):
        out.append(out[-1] + count)
    return out


def _stage_text(kinds: Sequence[str]) -> str:
    runs: list[list] = []
    for kind in kinds:
        ch = MEGATRON_CHARS[kind]
        if runs and runs[-1][0] == ch:
            runs[-1][1] += 1
        else:
            runs.append([ch, 1])
    return "".join(ch if n == 1 else f"{ch}*{n}" for ch, n in runs)


def megatron_layout(kinds: Sequence[str], partition: Sequence[int], p: int, placement: Placement | None = None) -> str:
    """The `--pipeline-model-parallel-layout` string of `partition` (counts per virtual stage in
    pipeline order) over layers of these kinds (`embedding`, `transformer`, `output`), on p
    ranks. Megatron's layout puts stage c * p + r in chunk c of rank r, so only the linear and
    interleaved placements have one; it also needs the embedding first and the output last."""
    S = len(partition)
    if S % p:
        raise KoalaError(f"a partition of {S} stages does not fill p={p} ranks evenly: give p x v counts")
    if placement is not None and placement.stage_ranks != tuple(s % p for s in range(S)):
        raise KoalaError(f"Megatron's --pipeline-model-parallel-layout puts stage c*p + r in chunk c of rank r; "
                         f"placement {placement.describe()} differs, so it has no layout string (the koala "
                         f"Megatron runtime builds such chunks itself: docs/megatron.md)")
    other = [i for i, k in enumerate(kinds) if k not in MEGATRON_CHARS]
    if other:
        raise KoalaError(f"layer {other[0]} is of kind {kinds[other[0]]!r}, which has no megatron-core layout letter "
                         f"(embedding E, transformer t and output L have)")
    if kinds.count("embedding") != 1 or kinds[0] != "embedding" or kinds.count("output") != 1 \
            or kinds[-1] != "output":
        raise KoalaError("a megatron-core layout needs exactly one embedding layer first and one output layer last")
    check_counts(partition, len(kinds))
    bounds = deepspeed_parts(partition)
    return "|".join(_stage_text(kinds[bounds[s]:bounds[s + 1]]) for s in range(S))


def run_lines(kinds: Sequence[str], partition: Sequence[int], p: int, placement: Placement | None = None) -> list[str]:
    """What to give the engines to run `partition`: Megatron's flag (when it has one) and DeepSpeed's parts."""
    lines = []
    try:
        layout = megatron_layout(kinds, partition, p, placement)
        lines.append(f"Megatron-LM: --pipeline-model-parallel-layout '{layout}'  (megatron-core: "
                     f"TransformerConfig(pipeline_model_parallel_layout='{layout}'))")
    except KoalaError as exc:
        lines.append(f"Megatron-LM: no layout string ({exc})")
    lines.append(f"DeepSpeed: KoalaPipelineModule(..., parts={deepspeed_parts(partition)})")
    return lines
