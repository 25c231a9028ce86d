"""The model benchmarks/gpu_check.py profiles with `koala profile deepspeed`: a plain-torch GPT
(koala_ds.profiler.models: embedding, pre-norm blocks of nn.Linear / LayerNorm / SDPA, head) as
a DeepSpeed layer list.

    koala profile deepspeed --layers benchmarks.gpu_models:layers --input benchmarks.gpu_models:sample \\
        -p 2 --device cuda -o prof.json          # from the repository's root

Sizes from the environment (issue 13's 6-layer GPT by default), so that gpu_check.py --small can
shrink them: KOALA_GPT_LAYERS (6), KOALA_GPT_HIDDEN (2048), KOALA_GPT_HEADS (16),
KOALA_GPT_SEQ (1024), KOALA_GPT_VOCAB (1024). One microbatch is one sequence.
"""
from __future__ import annotations

import os

DEFAULTS = {"KOALA_GPT_LAYERS": 6, "KOALA_GPT_HIDDEN": 2048, "KOALA_GPT_HEADS": 16, "KOALA_GPT_SEQ": 1024,
            "KOALA_GPT_VOCAB": 1024}


def size(name: str) -> int:
    """The size `name` from the environment (a whole number >= 1), else its default."""
    text = os.environ.get(name, "")
    if not text:
        return DEFAULTS[name]
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"${name}={text!r}: expected a whole number >= 1")
    return int(text)


def layers() -> list:
    """The GPT as DeepSpeed LayerSpecs (built on the CPU; the profiler moves them to --device)."""
    from koala_ds.profiler.models import gpt_layer_specs

    return gpt_layer_specs(size("KOALA_GPT_LAYERS"), size("KOALA_GPT_HIDDEN"), size("KOALA_GPT_HEADS"),
                           size("KOALA_GPT_SEQ"), size("KOALA_GPT_VOCAB"))


def sample():
    """One microbatch: token ids [1, seq] (fixed seed)."""
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, size("KOALA_GPT_VOCAB"), (1, size("KOALA_GPT_SEQ")), generator=g)
