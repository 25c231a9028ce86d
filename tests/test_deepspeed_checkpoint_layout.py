"""koala_ds.deepspeed.checkpoint: which layers each pipeline rank held when a checkpoint was saved,
and the refusal of optimizer states saved for another assignment (the engine's use of it runs in
tests/test_deepspeed_pipeline.py, through DeepSpeed's own save_checkpoint / load_checkpoint)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from koala_ds.core.ir import KoalaError, Placement

checkpoint = pytest.importorskip("koala_ds.deepspeed.checkpoint")


def _module(parts: list, placement: str | None = None, p: int = 2, stock_parts: list | None = None):
    """What the layout reads off a PipelineModule (parts) or a KoalaPipelineModule (parts, placement,
    koala_stock_parts)."""
    if placement is None:
        return SimpleNamespace(parts=parts)
    return SimpleNamespace(parts=parts, koala_placement=Placement.named(placement, p, (len(parts) - 1) // p),
                           koala_stock_parts=stock_parts)


def test_layouts_of_the_stock_cut_and_of_the_placements():
    assert checkpoint.module_layout(_module([0, 2, 4])) == [[[0, 2]], [[2, 4]]]
    vshape = _module([0, 1, 2, 3, 4], "vshape", stock_parts=[0, 2, 4])
    assert checkpoint.module_layout(vshape) == [[[0, 1], [3, 4]], [[1, 2], [2, 3]]]
    assert checkpoint.stock_layout(vshape) == [[[0, 2]], [[2, 4]]]
    interleaved = _module([0, 1, 2, 3, 4], "interleaved", stock_parts=[0, 2, 4])
    assert checkpoint.module_layout(interleaved) == [[[0, 1], [2, 3]], [[1, 2], [3, 4]]]


def test_a_checkpoint_without_a_layout_was_saved_by_the_stock_engine(tmp_path):
    linear = _module([0, 2, 4])
    checkpoint.check_optimizer_layout(str(tmp_path), linear)  # the stock cut itself: nothing to refuse
    vshape = _module([0, 1, 2, 3, 4], "vshape", stock_parts=[0, 2, 4])
    with pytest.raises(KoalaError) as info:
        checkpoint.check_optimizer_layout(str(tmp_path), vshape)
    text = str(info.value)
    assert text.startswith(f"checkpoint {tmp_path} was saved by the stock engine with pipeline rank 0 holding "
                           f"layers 0-1; this run's placement gives it layers 0 and 3")
    assert "load_module_only=True" in text and "\n" not in text


def test_the_saved_layout_round_trips_and_decides(tmp_path):
    vshape = _module([0, 1, 2, 3, 4], "vshape", stock_parts=[0, 2, 4])
    checkpoint.write_layout(str(tmp_path), checkpoint.module_layout(vshape))
    assert [f.name for f in tmp_path.iterdir()] == [checkpoint.LAYOUT_FILE]  # no temporary file left
    umask = os.umask(0)
    os.umask(umask)  # as DeepSpeed's own files of the checkpoint: readable by whoever may read them
    assert (tmp_path / checkpoint.LAYOUT_FILE).stat().st_mode & 0o777 == 0o666 & ~umask
    checkpoint.check_optimizer_layout(str(tmp_path), vshape)
    with pytest.raises(KoalaError, match="saved by the Koala engine with pipeline rank 0 holding layers 0 and 3; "
                                         "this run's placement gives it layers 0-1"):
        checkpoint.check_optimizer_layout(str(tmp_path), _module([0, 2, 4]))
    with pytest.raises(KoalaError, match="saved by the Koala engine with 2 pipeline ranks, this run has 4"):
        checkpoint.check_optimizer_layout(str(tmp_path), _module([0, 1, 2, 3, 4]))


def test_a_damaged_layout_file_is_one_line_naming_it(tmp_path):
    (tmp_path / checkpoint.LAYOUT_FILE).write_text("{not json")
    with pytest.raises(KoalaError) as info:
        checkpoint.check_optimizer_layout(str(tmp_path), _module([0, 2, 4]))
    assert str(info.value).startswith(f"{tmp_path / checkpoint.LAYOUT_FILE}: not a Koala checkpoint layout")
