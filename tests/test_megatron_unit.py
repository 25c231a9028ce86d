"""Single-process checks of the Megatron adapter: flags, install, signature, split backward,
the communication plan. Fast; no process group."""
from __future__ import annotations

import argparse
import inspect
import json

import pytest

from koala_ds import library
from koala_ds.core.ir import Action, Op, Placement, schedule_from_ranks

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True, scope="module")
def _megatron_core():
    """Imported when a test here runs, not at collection, which every xdist worker pays (~3 s)."""
    pytest.importorskip("megatron.core")


def test_flags_parse_and_install_selects_our_function(tmp_path):
    import megatron.core.pipeline_parallel as mpp
    from megatron.core.pipeline_parallel import schedules as mcs

    from koala_ds.megatron import add_arguments, install
    from koala_ds.megatron.runtime import KoalaForwardBackward

    sched = schedule_from_ranks("mine", Placement.named("linear", 2), 1,
                                [[Action(Op.F, 0, 0), Action(Op.B, 0, 0)], [Action(Op.F, 1, 0), Action(Op.B, 1, 0)]])
    path = tmp_path / "mine.json"
    path.write_text(sched.to_json())
    parser = add_arguments(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(["--pipeline-schedule", "koala", "--koala-schedule", str(path)])
    args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size = 2, None
    saved = (mpp.get_forward_backward_func, mcs.get_forward_backward_func)
    try:
        report = install(args)
        func = mpp.get_forward_backward_func()
        assert isinstance(func, KoalaForwardBackward) and mcs.get_forward_backward_func() is func
        assert "megatron.core.pipeline_parallel.get_forward_backward_func" in report.patched
        # megatron-core from PyPI has no megatron.training: install says so instead of failing
        assert any(s.startswith("megatron.training.training") for s in report.skipped + report.patched)
        assert "mine.json" in str(report)
    finally:
        mpp.get_forward_backward_func, mcs.get_forward_backward_func = saved
    default = install(parser.parse_args([]))
    assert default.patched == [] and "nothing patched" in str(default)


def test_flag_errors_are_clear(tmp_path):
    from koala_ds.megatron import MegatronScheduleError, add_arguments, install

    parser = add_arguments(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--pipeline-schedule", "fancy"])
    with pytest.raises(MegatronScheduleError, match="needs --koala-schedule"):
        install(parser.parse_args(["--pipeline-schedule", "koala"]))
    with pytest.raises(MegatronScheduleError, match="no such file"):
        install(parser.parse_args(["--pipeline-schedule", "koala", "--koala-schedule", str(tmp_path / "x.json")]))
    bad = tmp_path / "p4.json"
    bad.write_text(schedule_from_ranks("p4", Placement.named("linear", 4), 1,
                                       [[Action(Op.F, r, 0), Action(Op.B, r, 0)] for r in range(4)]).to_json())
    args = parser.parse_args(["--pipeline-schedule", "koala", "--koala-schedule", str(bad)])
    args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size = 2, None
    with pytest.raises(MegatronScheduleError, match="p=4 .* --pipeline-model-parallel-size is 2"):
        install(args)
    # a file that is not a schedule is named once, after the flag
    bad.write_text(json.dumps({"p": 4, "v": 1}))
    with pytest.raises(MegatronScheduleError, match=f"^--koala-schedule {bad}: missing field 'placement'"):
        install(args)


def test_signature_is_megatron_cores():
    from megatron.core.pipeline_parallel import schedules as mcs

    from koala_ds.megatron import get_forward_backward_func

    ours = inspect.signature(get_forward_backward_func("1f1b" if _has_library() else _tiny_json()))
    for theirs in (mcs.forward_backward_pipelining_without_interleaving, mcs.forward_backward_pipelining_with_interleaving):
        ref = inspect.signature(theirs)
        assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == \
               [(p.name, p.kind, p.default) for p in ref.parameters.values()]


def _has_library():
    try:
        import koala_ds.library  # noqa: F401
        return True
    except ImportError:
        return False


def _tiny_json(tmp=[]):  # noqa: B006 - cached path
    import tempfile

    if not tmp:
        sched = schedule_from_ranks("t", Placement.named("linear", 1), 1, [[Action(Op.F, 0, 0), Action(Op.B, 0, 0)]])
        fh = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        fh.write(sched.to_json())
        fh.close()
        tmp.append(fh.name)
    return tmp[0]


def test_megatron_lm_patch_is_a_well_formed_unified_diff():
    """Megatron-LM is not on PyPI: check the patch's structure (hunk sizes, targets, wiring)."""
    import os
    import re

    path = os.path.join(os.path.dirname(__file__), "..", "patches", "megatron-lm", "0001-koala-pipeline-schedule.patch")
    text = open(path, encoding="utf-8").read()
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("diff --git"))
    files, i, hunks = [], start, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("+++ b/"):
            files.append(line[6:])
        m = re.match(r"^@@ -(\d+),(\d+) \+(\d+),(\d+) @@", line)
        if m:
            hunks += 1
            old, new = int(m.group(2)), int(m.group(4))
            i += 1
            while i < len(lines) and (old or new):
                tag = lines[i][:1] if lines[i] else " "
                assert tag in " +-", f"line {i + 1}: {lines[i]!r}"
                old -= tag in " -"
                new -= tag in " +"
                i += 1
            assert old == 0 and new == 0, f"hunk {hunks} sizes do not match its header"
            continue
        i += 1
    assert files == ["pretrain_gpt.py"] and hunks == 3
    added = "\n".join(l[1:] for l in lines if l.startswith("+") and not l.startswith("+++"))
    assert "koala_megatron.add_arguments(parser)" in added and "koala_megatron.install(get_args())" in added


# -- which stage each model chunk holds ---------------------------------------------------------------
def _lm_args(schedule: str, p: int, v=None, gbs=None) -> argparse.Namespace:
    return argparse.Namespace(pipeline_schedule="koala", koala_schedule=schedule, pipeline_model_parallel_size=p,
                              virtual_pipeline_model_parallel_size=v, global_batch_size=gbs, micro_batch_size=1,
                              data_parallel_size=1)


def test_install_refuses_placements_megatron_cores_model_builder_cannot_build(tmp_path):
    """megatron-core's get_model (Megatron-LM's pretrain_gpt.py) builds chunk c of rank r as stage
    c x p + r, and Megatron-LM's forward_step and data loading assume it: a V-shape schedule there
    ran the loss on a chunk without the output layer (a traceback from the loss function)."""
    from koala_ds.resolve import load_schedule
    from koala_ds.megatron import MegatronScheduleError, install, schedule_from_args

    vshape_file = tmp_path / "zbv.json"
    vshape_file.write_text(load_schedule("zb-v", 2, 8, 2).to_json())
    for args in (_lm_args("zb-v", 2, 2, 8), _lm_args("zb-v", 2, 2), _lm_args("v-half", 4, 2, 16),
                 _lm_args(str(vshape_file), 2, 2)):
        with pytest.raises(MegatronScheduleError) as info:
            install(args)  # the default: chunks="megatron"
        text = str(info.value)
        assert text.startswith(f"--koala-schedule {args.koala_schedule}: its vshape placement runs stage ")
        assert "chunk c of rank r = stage c x p + r" in text and "interleaved" in text and "\n" not in text
        assert schedule_from_args(args, chunks="schedule") == args.koala_schedule  # chunks built per placement
    for args in (_lm_args("interleaved-1f1b", 2, 2, 8), _lm_args("zb-h1", 4, None, 8), _lm_args("1f1b", 2)):
        assert schedule_from_args(args) == args.koala_schedule  # megatron-core's own placements
    with pytest.raises(ValueError, match="chunks must be one of"):
        schedule_from_args(_lm_args("1f1b", 2), chunks="mine")


def test_a_two_pipeline_schedule_is_refused_with_schedules_the_same_launch_accepts():
    """chimera (two pipelines) on Megatron-LM's model builder: the refusal used to suggest zb-v or
    dualpipe-v, which that same launch then refuses (their vshape placement). Each schedule the
    message names must pass the same checks, with the chunks it needs."""
    import re

    from koala_ds.megatron import MegatronScheduleError, schedule_from_args

    for chunks, gbs in (("megatron", 8), ("megatron", None), ("schedule", 8)):
        with pytest.raises(MegatronScheduleError) as info:
            schedule_from_args(_lm_args("chimera", 4, None, gbs), chunks=chunks)
        text = str(info.value)
        assert text.startswith("--koala-schedule chimera") and "\n" not in text
        named = [n for n in re.findall(r"[a-z0-9]+(?:-[a-z0-9]+)+", text) if n in library.names() and n != "chimera"]
        assert named, text
        for name in named:
            program = library.load_program(name)
            v = next(v for v in (1, 2) if program.supports(4, 8, v) is None)
            assert schedule_from_args(_lm_args(name, 4, v if v > 1 else None, 8), chunks=chunks) == name, text


@pytest.mark.parametrize("p, v, flag", [(2, 0, "--virtual-pipeline-model-parallel-size 0"),
                                          (2, -2, "--virtual-pipeline-model-parallel-size -2"),
                                          (0, None, "--pipeline-model-parallel-size 0")])
def test_sizes_below_one_are_refused_naming_their_flag(p, v, flag):
    """v = 0 was read as 1; v = -2 was blamed on --num-layers ("not a multiple of the -4 virtual stages")."""
    from koala_ds.megatron import MegatronScheduleError, schedule_from_args

    with pytest.raises(MegatronScheduleError) as info:
        schedule_from_args(_lm_args("1f1b", p, v, 8))
    assert str(info.value) == f"{flag}: must be >= 1"


class _Chunk(torch.nn.Module):
    def __init__(self, pre_process: bool, post_process: bool):
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process


class _Wrapper(torch.nn.Module):  # as DDP and Float16Module wrap a chunk
    def __init__(self, module):
        super().__init__()
        self.module = module


def test_runtime_refuses_chunks_built_for_another_stage():
    """Chunks from megatron-core's builder under a V-shape schedule (p = 2: rank 0's chunk 1 runs
    the last stage but has no output layer, rank 1's chunk 1 has it): both ranks refuse before
    any communication. Chunks built per the placement, or that do not say, pass."""
    from koala_ds.resolve import load_schedule
    from koala_ds.megatron import MegatronScheduleError
    from koala_ds.megatron.runtime import _check_chunk_roles

    zbv = load_schedule("zb-v", 2, 4, 2)
    megatron_built = {0: [_Chunk(True, False), _Chunk(False, False)], 1: [_Chunk(False, False), _Chunk(False, True)]}
    wants = {0: "runs stage 3 of 4 in model chunk 1 of pipeline rank 0, which was built with post_process=False",
             1: "runs stage 2 of 4 in model chunk 1 of pipeline rank 1, which was built with post_process=True"}
    for rank, chunks in megatron_built.items():
        with pytest.raises(MegatronScheduleError, match=wants[rank]):
            _check_chunk_roles([_Wrapper(c) for c in chunks], zbv, rank)
    placed = {0: [_Chunk(True, False), _Chunk(False, True)], 1: [_Chunk(False, False), _Chunk(False, False)]}
    for rank, chunks in placed.items():
        _check_chunk_roles([_Wrapper(c) for c in chunks], zbv, rank)
        _check_chunk_roles([torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)], zbv, rank)  # no flags: nothing to check


def test_runtime_refuses_tied_embeddings_where_megatron_core_cannot_tie_them():
    """megatron-core keeps the tied embedding's two copies in chunk 0 of rank 0 and the last chunk
    of rank p-1 and all-reduces their gradients there. A V-shape runs both ends on rank 0, so
    finalize_model_grads would all-reduce with rank p-1, which holds neither, and wait: every
    rank refuses chunks built tied, naming Megatron-LM's flag. Untied chunks pass, and tied ones
    pass under the interleaved placement (megatron-core's own)."""
    from koala_ds.resolve import load_schedule
    from koala_ds.megatron import MegatronScheduleError
    from koala_ds.megatron.runtime import _check_tied_embeddings

    def chunks(stages, tied):
        built = [_Chunk(s == 0, s == 3) for s in stages]
        for chunk in built:
            chunk.share_embeddings_and_output_weights = tied
        return [_Wrapper(c) for c in built]

    zbv, interleaved = load_schedule("zb-v", 2, 4, 2), load_schedule("interleaved-1f1b", 2, 4, 2)
    for rank in range(2):
        with pytest.raises(MegatronScheduleError, match=r"chunk 0 of pipeline rank %d was built with "
                           r"share_embeddings_and_output_weights=True, but schedule 'zb-v' \(vshape placement\) "
                           r"runs the embedding \(stage 0\) on pipeline rank 0 and the output layer \(stage 3\) "
                           r"on rank 0.*--untie-embeddings-and-output-weights" % rank) as info:
            _check_tied_embeddings(chunks(zbv.placement.stages_of(rank), True), zbv, rank)
        assert "\n" not in str(info.value)
        _check_tied_embeddings(chunks(zbv.placement.stages_of(rank), False), zbv, rank)
        _check_tied_embeddings(chunks(interleaved.placement.stages_of(rank), True), interleaved, rank)


def test_the_runtime_checks_the_chunks_before_it_runs_a_step(single_process_megatron):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from engine_runs import _forward_step, _MegatronChunk
    from koala_ds.resolve import load_schedule
    from koala_ds.megatron import MegatronScheduleError, get_forward_backward_func
    from koala_ds.profiler.models import _init_single_process_megatron

    _init_single_process_megatron(1)
    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True,
                               pipeline_dtype=torch.float32, params_dtype=torch.float32,
                               gradient_accumulation_fusion=False)
    func = get_forward_backward_func(load_schedule("interleaved-1f1b", 1, 2, 2), timeout_s=30)

    def step(stages):
        chunks = [_MegatronChunk(config, s, 2, (0.0, 0.0, 0.0), 8) for s in stages]
        data = [torch.randn(2, 1, 8) for _ in range(2)]
        return func(forward_step_func=_forward_step, data_iterator=[iter(data), iter(data)], model=chunks,
                    num_microbatches=2, seq_length=2, micro_batch_size=1)

    with pytest.raises(MegatronScheduleError, match="runs stage 0 of 2 in model chunk 0 of pipeline rank 0, which "
                                                    "was built with pre_process=False"):
        step([1, 0])  # the chunks in the wrong order
    assert len(step([0, 1])) == 2  # the losses of both microbatches


@pytest.mark.parametrize("per_token", [True, False])
def test_finalize_gets_the_steps_token_count_with_per_token_loss(single_process_megatron, per_token):
    """megatron-core hands finalize_model_grads_func the step's token count under
    calculate_per_token_loss, None otherwise; the runtime counts only when it is read."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from engine_runs import _MegatronChunk
    from koala_ds.resolve import load_schedule
    from koala_ds.megatron import get_forward_backward_func
    from koala_ds.profiler.models import _init_single_process_megatron

    _init_single_process_megatron(1)
    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True,
                               pipeline_dtype=torch.float32, params_dtype=torch.float32,
                               gradient_accumulation_fusion=False, calculate_per_token_loss=per_token)
    seen = []
    config.finalize_model_grads_func = lambda models, num_tokens, **_: seen.append(num_tokens)
    chunks = [_MegatronChunk(config, s, 2, (0.0, 0.0, 0.0), 8) for s in (0, 1)]
    data = [torch.randn(2, 1, 8) for _ in range(3)]

    def forward_step(data_iterator, model):
        out = model(next(data_iterator) if model.pre_process else None)

        def loss_func(output):  # microbatch k counts k + 2 tokens
            tokens = torch.tensor(2 + len(seen_batches), dtype=torch.int)
            seen_batches.append(tokens)
            return output.float().sum(), tokens, {"loss": output.detach().sum()}
        return out, loss_func

    seen_batches: list = []
    func = get_forward_backward_func(load_schedule("interleaved-1f1b", 1, 3, 2), timeout_s=30)
    func(forward_step_func=forward_step, data_iterator=[iter(data), iter(data)], model=chunks, num_microbatches=3,
         seq_length=2, micro_batch_size=1)
    assert len(seen) == 1 and len(seen_batches) == 3
    assert (int(seen[0]) == 2 + 3 + 4) if per_token else seen[0] is None


def test_a_full_backward_schedule_runs_plain_forwards_on_chunks_a_split_one_prepared(single_process_megatron):
    """One model, two schedules (examples/megatron_gpt --alternate-schedules): after zb-h1 has
    prepared the chunks for deferred weight gradients, 1f1b's forwards run as an unprepared
    model's (torch's own linear), not through the deferrable Function it never uses."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from engine_runs import _forward_step, _MegatronChunk
    from koala_ds.megatron import get_forward_backward_func
    from koala_ds.profiler.models import _init_single_process_megatron
    from koala_ds.resolve import load_schedule
    from koala_ds.runtime import wgrad

    _init_single_process_megatron(1)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True,
                               pipeline_dtype=torch.float32, params_dtype=torch.float32,
                               gradient_accumulation_fusion=False)
    chunk = _MegatronChunk(config, 0, 1, (0.0, 0.0, 0.0), 8)
    plain: list[bool] = []
    chunk.register_forward_pre_hook(lambda *_: plain.append(wgrad._PLAIN_FORWARD))
    data = [torch.randn(2, 1, 8) for _ in range(2)]

    def step(name):
        func = get_forward_backward_func(load_schedule(name, 1, 2, 1), timeout_s=30)
        plain.clear()
        func(forward_step_func=_forward_step, data_iterator=iter(data), model=chunk, num_microbatches=2,
             seq_length=2, micro_batch_size=1)
        return list(plain)

    assert step("1f1b") == [False, False]  # an unprepared model: nothing to switch off
    assert step("zb-h1") == [False, False]  # split: the forwards record what W will compute
    assert hasattr(chunk, "_koala_wgrad")
    assert step("1f1b") == [True, True]

