"""A searched split on megatron-core: `--pipeline-model-parallel-layout` (megatron-core 0.16.1's own
setting) under Koala schedules. Layouts from a partition (koala_ds.core.layout), the layers
each virtual stage builds whatever the placement (koala_ds.megatron.layout), one-line errors, and
examples/megatron_gpt end to end on CPU: uneven layouts give the losses of one process."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

from koala_ds.core.ir import KoalaError
from koala_ds.core.layout import deepspeed_parts, megatron_layout

ROOT = Path(__file__).resolve().parents[1]
KINDS = ["embedding"] + ["transformer"] * 4 + ["output"]


def test_partition_to_engine_settings():
    assert megatron_layout(KINDS, [2, 4], 2) == "Et|t*3L"
    assert megatron_layout(KINDS, [1, 2, 1, 2], 2) == "E|t*2|t|tL"
    assert megatron_layout(KINDS, [3, 3], 2) == "Et*2|t*2L"
    assert deepspeed_parts([2, 1, 5]) == [0, 2, 3, 8]
    for counts in ([3, 2], [0, 6], [6, -1, 1]):
        with pytest.raises(KoalaError, match=r"every virtual stage needs >= 1 layer and the counts must sum to the 6"):
            megatron_layout(KINDS, counts, len(counts))
    with pytest.raises(KoalaError, match="'other', which has no megatron-core layout letter"):
        megatron_layout(["embedding", "other", "output"], [1, 2], 2)
    with pytest.raises(KoalaError, match="exactly one embedding layer first"):
        megatron_layout(["transformer", "embedding", "output"], [1, 2], 2)


def test_stage_layers_follow_the_pipeline_order_of_the_layout():
    pytest.importorskip("megatron.core")
    from koala_ds.core.ir import Placement
    from koala_ds.megatron.layout import check_layout, stage_layers, uniform_layout

    layout = check_layout(megatron_layout(KINDS, [1, 2, 1, 2], 2), 2, 4)
    assert layout.virtual_pipeline_model_parallel_size == 2
    got = [stage_layers(layout, s) for s in range(4)]
    assert [(g.num_layers, g.offset, g.pre_process, g.post_process) for g in got] == [
        (0, 0, True, False), (2, 0, False, False), (1, 2, False, False), (1, 3, False, True)]
    # V-shape: rank 0 holds stages 0 and 3 (embedding and loss), rank 1 stages 1 and 2
    vshape = Placement.named("vshape", 2, 2)
    assert [[stage_layers(layout, s).num_layers for s in vshape.stages_of(r)] for r in range(2)] == [[0, 1], [2, 1]]
    assert uniform_layout(4, 2) == "Ett|ttL"
    with pytest.raises(KoalaError, match=r"not a multiple of the 3 virtual stages"):
        uniform_layout(4, 3)


@pytest.mark.parametrize("layout,match", [
    ("Ett|tt", r"The last layer must be loss"),
    ("Et|ttL", r"Number of decoder layers 3.*must match num_layers 4.*\(--num-layers 4\)"),
    ("Ett|tXL", r"Invalid layer character: X"),
    ("Ett|tt|L", r"divisible by pipeline_model_parallel_size.*--pipeline-model-parallel-size 2"),
])
def test_bad_layouts_are_one_line_naming_the_flag(layout, match):
    pytest.importorskip("megatron.core")
    from koala_ds.megatron.layout import check_layout

    with pytest.raises(KoalaError, match=match) as info:
        check_layout(layout, 2, 4)
    assert str(info.value).startswith(f"--pipeline-model-parallel-layout {layout!r}: ")
    assert "\n" not in str(info.value)


def megatron_args(schedule: str, layout: str | None = None, p: int = 2, v: int | None = None,
                  **extra) -> argparse.Namespace:
    """Megatron-LM's parsed flags as `schedule_from_args` reads them: --pipeline-schedule koala,
    a global batch of 8 in microbatches of 2, no data parallelism."""
    return argparse.Namespace(pipeline_schedule="koala", koala_schedule=schedule, pipeline_model_parallel_size=p,
                              virtual_pipeline_model_parallel_size=v, pipeline_model_parallel_layout=layout,
                              global_batch_size=8, micro_batch_size=2, data_parallel_size=1, **extra)


def test_install_takes_the_chunks_per_rank_from_the_layout():
    pytest.importorskip("megatron.core")
    from koala_ds.megatron import MegatronScheduleError, schedule_from_args

    def args(layout, schedule):
        return megatron_args(schedule, layout)

    # v = 2 from the layout's 4 stages (a V-shape: with chunks built per the schedule's placement)
    assert schedule_from_args(args("E|tt|t|tL", "zb-v"), chunks="schedule") == "zb-v"
    assert schedule_from_args(args("Et|t*3L", "zb-h1")) == "zb-h1"
    with pytest.raises(MegatronScheduleError, match=r"--pipeline-model-parallel-layout 'E\|tt\|tL' has 3 stages, "
                                                    r"not a multiple of --pipeline-model-parallel-size 2"):
        schedule_from_args(args("E|tt|tL", "zb-h1"))


def test_install_refuses_tied_embeddings_under_a_placement_megatron_core_cannot_tie():
    """Megatron-LM ties the embeddings unless --untie-embeddings-and-output-weights; megatron-core
    ties them between rank 0 and rank p-1 only, so a V-shape schedule (both ends on rank 0) is
    refused before the model is built, naming the flag. With the flag, with megatron-core's own
    placement, or with args that do not carry the flag (a script of its own), it is accepted."""
    pytest.importorskip("megatron.core")
    from koala_ds.megatron import MegatronScheduleError, schedule_from_args

    with pytest.raises(MegatronScheduleError, match=r"^--koala-schedule zb-v: its vshape placement runs the embedding "
                                                    r"\(stage 0\) on pipeline rank 0 and the output layer \(stage 3\) "
                                                    r"on rank 0.*: add --untie-embeddings-and-output-weights") as info:
        schedule_from_args(megatron_args("zb-v", "E|tt|t|tL", untie_embeddings_and_output_weights=False),
                           chunks="schedule")
    assert "\n" not in str(info.value)
    assert schedule_from_args(megatron_args("zb-v", "E|tt|t|tL", untie_embeddings_and_output_weights=True),
                              chunks="schedule") == "zb-v"
    assert schedule_from_args(megatron_args("interleaved-1f1b", "Et|t|tt|L", untie_embeddings_and_output_weights=False),
                              chunks="schedule") == "interleaved-1f1b"
    assert schedule_from_args(megatron_args("zb-h1", "Et|t*3L", untie_embeddings_and_output_weights=False)) == "zb-h1"


def test_install_refuses_checkpoints_of_chunks_built_per_the_schedule():
    """Chunks built per the schedule's placement (chunks="schedule") number their layers from 0
    in megatron-core's checkpoints, so every chunk would save to and load from the same slots:
    --save, --load and --pretrained-checkpoint are refused in one line naming the flag. Chunks
    from megatron-core's own builder (the default) and a single stage keep them."""
    pytest.importorskip("megatron.core")
    from koala_ds.megatron import MegatronScheduleError, schedule_from_args

    def args(schedule, p=2, **extra):
        return megatron_args(schedule, p=p, v=2 if schedule == "zb-v" else None,
                             untie_embeddings_and_output_weights=True, **extra)

    for schedule in ("zb-v", "1f1b"):
        for attr, flag in (("save", "--save"), ("load", "--load"), ("pretrained_checkpoint", "--pretrained-checkpoint")):
            with pytest.raises(MegatronScheduleError, match=rf"^{flag}: checkpoints of model chunks built per the "
                                                            rf"schedule's placement are not supported yet") as info:
                schedule_from_args(args(schedule, **{attr: "/ckpt"}), chunks="schedule")
            assert "\n" not in str(info.value) and f"drop {flag}" in str(info.value)
    assert schedule_from_args(args("zb-v", save=None, load=None), chunks="schedule") == "zb-v"
    assert schedule_from_args(args("1f1b", save="/ckpt", load="/ckpt")) == "1f1b"  # megatron-core's builder
    assert schedule_from_args(args("1f1b", p=1, save="/ckpt"), chunks="schedule") == "1f1b"  # one stage


# -- end to end: examples/megatron_gpt ---------------------------------------------------------
FLAGS = ["--tensor-model-parallel-size", "1", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads",
         "4", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
         "--lr", "3e-3", "--seed", "1234", "--pipeline-schedule", "koala"]


def example_rank(rank: int, world: int, argv: list[str]) -> int:
    """examples/megatron_gpt/pretrain_gpt.py's main, in a rank that koala_ds.runtime.spawn forked from a
    fork server that has imported torch and megatron-core (a rank of its own under torchrun
    spends 8-10 s of CPU importing them). It reads RANK, WORLD_SIZE and MASTER_ADDR / PORT as
    under torchrun; test_megatron_example runs it under torchrun, as the README does."""
    from test_megatron_example import example_module

    return example_module().main(argv)


def _losses(tmp_path: Path, nproc: int, extra: list[str]) -> list[float]:
    from koala_ds.runtime.spawn import spawn
    from rank_processes import PRELOAD

    log = tmp_path / f"loss-{len(list(tmp_path.iterdir()))}.json"
    spawn("test_megatron_layout:example_rank", nproc, [*FLAGS, *extra, "--loss-log", str(log)], timeout_s=300,
          init=None, preload=PRELOAD, env={"LOCAL_WORLD_SIZE": str(nproc), "PYTHONWARNINGS": "ignore"})
    return json.loads(log.read_text())["losses"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_example_runs_uneven_layouts_with_the_losses_of_one_process(tmp_path):
    pytest.importorskip("megatron.core")
    reference = _losses(tmp_path, 1, ["--pipeline-model-parallel-size", "1", "--koala-schedule", "1f1b"])
    assert len(reference) == 3 and reference[-1] < reference[0]
    runs = [("zb-h1", "Et|t*3L"),  # 1 + 3 transformer layers
            ("zb-v", "E|tt|t|tL"),  # v = 2, V-shape: rank 0 holds the embedding and the loss stage
            ("interleaved-1f1b", "Et|t|tt|L")]  # v = 2, interleaved, a loss-only stage
    for schedule, layout in runs:
        losses = _losses(tmp_path, 2, ["--pipeline-model-parallel-size", "2", "--koala-schedule", schedule,
                                       "--pipeline-model-parallel-layout", layout])
        assert losses == pytest.approx(reference, rel=1e-6), (schedule, layout)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_refuses_a_bad_layout_in_one_line():
    """Both ranks exit with code 2; rank 0 says why in one line naming the flag (no traceback)."""
    pytest.importorskip("megatron.core")
    from rank_processes import run_ranks

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(ROOT / "examples/megatron_gpt/pretrain_gpt.py"), *FLAGS,
           "--pipeline-model-parallel-size", "2", "--koala-schedule", "zb-h1",
           "--pipeline-model-parallel-layout", "Et|ttL"]
    results = run_ranks(cmd, 2, env, 240, ROOT)
    err = "".join(r.stderr for r in results)
    assert [r.returncode for r in results] == [2, 2], err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, errors
    assert errors[0].startswith("pretrain_gpt: error: --pipeline-model-parallel-layout 'Et|ttL': Number of decoder "
                                "layers 3") and errors[0].endswith("(--num-layers 4)"), errors
