"""Single-process checks of the Megatron adapter: flags, install, signature, split backward,
the communication plan. Fast; no process group."""
from __future__ import annotations

import argparse
import inspect
import json

import pytest

from koala_ds.ir import Action, Op, Placement, schedule_from_ranks

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
