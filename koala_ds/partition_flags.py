"""The engine settings that run a layer partition (a list of layer counts per virtual stage, in
pipeline order, over the layers of a per-layer profile; /work/notes/layer_profile.md):

- megatron-core: `--pipeline-model-parallel-layout` (`megatron_layout`), e.g. "Et*3|t*4|t*4|t*3L";
- DeepSpeed: `KoalaPipelineModule(..., parts=[0, a, ..., n])` or "pipeline.koala.parts"
  (`deepspeed_parts`).

Pure functions; no torch.
"""
from __future__ import annotations

from typing import Sequence

from .ir import KoalaError

#: megatron-core's layout letters for the per-layer profile's kinds.
LAYOUT_LETTERS = {"embedding": "E", "transformer": "t", "output": "L"}


def _check_counts(counts: Sequence[int], num_layers: int) -> list[int]:
    counts = [int(c) for c in counts]
    if not counts or any(c < 1 for c in counts) or sum(counts) != num_layers:
        raise KoalaError(f"partition {counts}: every virtual stage needs >= 1 layer and the counts must sum to "
                         f"the {num_layers} layers of the profile")
    return counts


def deepspeed_parts(counts: Sequence[int]) -> list[int]:
    """DeepSpeed's boundary list [0, a, ..., n] for layer counts per virtual stage."""
    counts = _check_counts(counts, sum(int(c) for c in counts))
    parts = [0]
    for c in counts:
        parts.append(parts[-1] + c)
    return parts


def _stage_text(letters: str) -> str:
    """"Ettt" -> "Et*3" (megatron's `x*n` shorthand for runs longer than 2)."""
    out, i = [], 0
    while i < len(letters):
        j = i
        while j < len(letters) and letters[j] == letters[i]:
            j += 1
        n = j - i
        out.append(f"{letters[i]}*{n}" if n > 2 else letters[i] * n)
        i = j
    return "".join(out)


def megatron_layout(kinds: Sequence[str], counts: Sequence[int]) -> str:
    """`--pipeline-model-parallel-layout` for layer counts per virtual stage over layers of the
    given kinds (embedding -> E, transformer -> t, output -> L); stages in pipeline order, which
    is megatron-core's order of the layout's stages (stage vpp * p + pp_rank)."""
    bad = [k for k in kinds if k not in LAYOUT_LETTERS]
    if bad:
        raise KoalaError(f"layer kind {bad[0]!r} has no megatron-core layout letter (embedding, transformer, "
                         f"output have)")
    counts = _check_counts(counts, len(kinds))
    letters = "".join(LAYOUT_LETTERS[k] for k in kinds)
    if letters.count("E") != 1 or letters.count("L") != 1 or letters[0] != "E" or letters[-1] != "L":
        raise KoalaError("a megatron-core layout needs exactly one embedding layer first and one output layer last")
    stages, start = [], 0
    for c in counts:
        stages.append(_stage_text(letters[start:start + c]))
        start += c
    return "|".join(stages)
