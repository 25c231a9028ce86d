"""The H200 profile of issue 13 with its measured full backward: the file keeps the full-backward
time in meta.stages[].backward_full_ms (it predates the `backward` field); these helpers copy it
into `backward`. Tests that use them skip when the file is not there."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from koala_ds.sim import CostProfile

H200 = Path(__file__).resolve().parents[2] / "shared" / "profiles" / "h200-gpt1.3b-p8.json"


def h200_profile(backward: str = "measured") -> CostProfile:
    """measured: `backward` = the measured B (less than I + W on every stage); sum: `backward` =
    I + W (the same numbers as without the field)."""
    if not H200.is_file():
        pytest.skip(f"{H200} is not here (the measured H200 profile of issue 13)")
    data = json.loads(H200.read_text(encoding="utf-8"))
    for st, meta in zip(data["stages"], data["meta"]["stages"]):
        st["backward"] = meta["backward_full_ms"] if backward == "measured" else \
            st["backward_input"] + st["backward_weight"]
    return CostProfile.from_dict(data, f"{H200} (backward: {backward})")
