"""User errors in the engines: one line on rank 0, exit code 2 on every rank, in the engine's
own words (DeepSpeed's config keys and module arguments, Megatron's flags), with the valid
values and the closest match for unknown ones."""
from __future__ import annotations

import argparse
import json
import re
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from koala_ds.core.errors import USER_ERROR_EXIT, run_main
from koala_ds.core.ir import KoalaError
from koala_ds.runtime.spawn import free_port
from rank_processes import environment, held_port
from script_modules import load_script

ROOT = Path(__file__).resolve().parents[1]
P4_ONLY = """schedule p4only
supports p == 4
placement linear
backward full
rank:
  F? * m
  B? * m
"""


def _fails(message: str):
    def main():
        raise KoalaError(message)
    return main


def test_run_main_prints_one_line_on_rank_zero_and_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as info:
        run_main(_fails("the schedule is for p=4\nsecond line"), "train.py")
    assert info.value.code == USER_ERROR_EXIT == 2
    err = capsys.readouterr().err
    assert err == "train.py: error: the schedule is for p=4 | second line\n"


def test_run_main_other_ranks_exit_2_quietly_after_rank_zero(monkeypatch, capsys):
    # quietly, and late enough that a launcher which stops all ranks when one exits lets rank 0 print
    import time

    monkeypatch.setenv("RANK", "1")
    start = time.monotonic()
    with pytest.raises(SystemExit) as info:
        run_main(_fails("bad"), grace_s=0.3)
    assert time.monotonic() - start >= 0.3
    assert info.value.code == 2
    assert capsys.readouterr() == ("", "")


def test_a_pipeline_timeout_is_printed_by_the_rank_that_gave_up(monkeypatch, capsys):
    """Rank 1 timing out (rank 0 hung) exited 2 without a word: only rank 0 printed user errors."""
    from koala_ds.megatron.p2p import P2PTimeoutError

    def main():
        raise P2PTimeoutError("koala p2p: pipeline rank 1 failed to receive the activation of stage 1 from "
                              "pipeline rank 0 within 3 s")

    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as info:
        run_main(main, "pretrain_gpt", grace_s=0.0)
    assert info.value.code == 2
    assert capsys.readouterr().err == ("pretrain_gpt: error: koala p2p: pipeline rank 1 failed to receive the "
                                       "activation of stage 1 from pipeline rank 0 within 3 s\n")


def test_run_main_keeps_other_exceptions_and_return_codes(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    # Python's own hook (torch.distributed installs one that prefixes each line with the rank
    # once a process group is up, as an earlier test in this process may have done)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)

    def crash():
        raise RuntimeError("a bug, not a user error")
    with pytest.raises(SystemExit) as info:
        run_main(crash)
    assert info.value.code == 1  # Python's own code for an uncaught exception
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):\n") and "in crash\n" in err
    assert err.endswith("RuntimeError: a bug, not a user error\n")
    # a hook of the user's (or torch's) says what is printed
    monkeypatch.setattr(sys, "excepthook", lambda kind, exc, tb: print(f"[rank0]: {kind.__name__}: {exc}",
                                                                       file=sys.stderr))
    with pytest.raises(SystemExit) as info:
        run_main(crash)
    assert info.value.code == 1
    assert capsys.readouterr().err == "[rank0]: RuntimeError: a bug, not a user error\n"
    with pytest.raises(SystemExit) as info:
        run_main(lambda: 3)
    assert info.value.code == 3


CRASH_TOGETHER = """import os, sys, time
from koala_ds.core.errors import run_main

def deep(n):
    if n == 0:
        raise RuntimeError("a bug")
    deep(n - 1)

def main():
    folder, ranks = sys.argv[1], int(sys.argv[2])
    open(os.path.join(folder, f"ready-{os.getpid()}"), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(folder)) < ranks and time.monotonic() < deadline:  # all fail at once
        time.sleep(0.001)
    deep(20)

run_main(main, "t.py")
"""


def test_ranks_that_crash_together_print_whole_tracebacks(tmp_path):
    """Ranks share their launcher's stderr; Python prints a traceback in many small writes, so
    ranks that met the same bug at the same moment printed them mixed: `RuntimeErrorRuntimeError:
    : a buga bug` (the crash test through koala-run below, in CI and again here; 3 of 3 runs of
    this test failed before the fix)."""
    script, ready = tmp_path / "crash.py", tmp_path / "ready"
    script.write_text(CRASH_TOGETHER)
    ready.mkdir()
    ranks = 4
    env = environment(ROOT, PYTHONUNBUFFERED="1")
    read_end, write_end = os.pipe()
    procs = [subprocess.Popen([sys.executable, str(script), str(ready), str(ranks)], stderr=write_end,
                              stdout=subprocess.DEVNULL, env=env) for _ in range(ranks)]
    os.close(write_end)
    with os.fdopen(read_end) as stderr:
        text = stderr.read()  # to the end: every process has exited or closed its stderr
    assert [proc.wait(timeout=60) for proc in procs] == [1] * ranks
    tracebacks = text.split("Traceback (most recent call last):\n")
    assert tracebacks[0] == "" and len(tracebacks) == ranks + 1, text
    assert len(set(tracebacks[1:])) == 1 and tracebacks[1].endswith("RuntimeError: a bug\n"), text


# -- DeepSpeed ---------------------------------------------------------------------------------
def _deepspeed():
    pytest.importorskip("deepspeed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import importlib

    return (importlib.import_module("koala_ds.deepspeed.config"), importlib.import_module("koala_ds.deepspeed.install"))


def test_unknown_pipeline_schedule_value_is_an_error_with_the_valid_values():
    config, install = _deepspeed()
    with pytest.raises(KoalaError) as info:
        install.select_engine_class(object(), {"schedule": "koalaa"})
    text = str(info.value)
    assert "\"pipeline.schedule\" is 'koalaa' (did you mean 'koala'?)" in text
    assert "valid values: 'default', 'koala'" in text
    with pytest.raises(KoalaError, match="DS_PIPELINE_SCHEDULE"):
        config.koala_requested({}, env={"DS_PIPELINE_SCHEDULE": "kaola"})
    assert config.koala_requested({"schedule": "Koala"}, env={})
    assert not config.koala_requested({"schedule": "default"}, env={})
    assert not config.koala_requested({}, env={})


def test_deepspeed_schedule_errors_name_deepspeeds_settings(tmp_path):
    config, _ = _deepspeed()
    with pytest.raises(KoalaError) as info:
        config.resolve_schedule("zb-v", 2, 8, 1)
    assert "change the KoalaPipelineModule's chunks" in str(info.value) and "change -v" not in str(info.value)
    (tmp_path / "p4.koala").write_text(P4_ONLY)
    with pytest.raises(KoalaError) as info:
        config.resolve_schedule(str(tmp_path / "p4.koala"), 2, 8, 1)
    assert "change the PipelineModule's num_stages" in str(info.value) and "change -p" not in str(info.value)
    with pytest.raises(KoalaError, match='change "gradient_accumulation_steps"'):
        config.resolve_schedule("1f1b", 2, 0, 1)


# -- Megatron ----------------------------------------------------------------------------------
def _install(extra: list[str], p: int = 2, v=None, gbs: int = 8, mbs: int = 1, dp: int = 1, layout=None):
    pytest.importorskip("megatron.core")
    from koala_ds.megatron import add_arguments, install

    args = add_arguments(argparse.ArgumentParser()).parse_args(["--pipeline-schedule", "koala", *extra])
    args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size = p, v
    if layout is not None:  # Megatron-LM's flag (and the example's)
        args.pipeline_model_parallel_layout, args.num_layers = layout, 4
    args.global_batch_size, args.micro_batch_size, args.data_parallel_size = gbs, mbs, dp
    return install(args)


def test_megatron_install_checks_a_koala_file_against_the_flags_before_the_model(tmp_path):
    from koala_ds.megatron import MegatronScheduleError

    path = tmp_path / "p4.koala"
    path.write_text(P4_ONLY)
    with pytest.raises(MegatronScheduleError) as info:
        _install(["--koala-schedule", str(path)], p=2)
    assert "needs p == 4" in str(info.value) and "change --pipeline-model-parallel-size" in str(info.value)


def test_megatron_v_given_by_the_layout_is_named_as_the_layout_and_one_rank_takes_one_chunk():
    """v from --pipeline-model-parallel-layout was blamed on --virtual-pipeline-model-parallel-size
    (which the user never set); v > 1 at p = 1 got past install and died in megatron-core's
    initialize_model_parallel (a traceback)."""
    from koala_ds.megatron import MegatronScheduleError

    with pytest.raises(MegatronScheduleError, match=r"needs v == 1 .*got p=2, m=8, v=2: change "
                                                    r"--pipeline-model-parallel-layout$"):
        _install(["--koala-schedule", "zb-h1"], v=2, layout="E|tt|t|tL")  # Megatron-LM sets v from the layout
    for layout, given in (("Et*2|t*2L", "--pipeline-model-parallel-layout gives 2 stage(s) per pipeline rank"),
                          (None, "--virtual-pipeline-model-parallel-size gives 2 model chunk(s) per rank")):
        with pytest.raises(MegatronScheduleError, match=rf"^{re.escape(given)} with --pipeline-model-parallel-size "
                                                        r"1, which megatron-core refuses"):
            _install(["--koala-schedule", "interleaved-1f1b"], p=1, v=2, layout=layout)


def test_megatron_profile_with_another_number_of_stages_is_refused_at_install(tmp_path):
    """--koala-profile was read, any number of stages passed."""
    from koala_ds.megatron import MegatronScheduleError

    with pytest.raises(MegatronScheduleError, match=r"^--koala-profile gpt-lmhead-8: 8 stage entries, but "
                                                    r"--koala-schedule zb-h1 has 2 stages \(p x v = 2 x 1\)"):
        _install(["--koala-schedule", "zb-h1", "--koala-profile", "gpt-lmhead-8"])
    two = tmp_path / "two.json"
    stage = {"forward": 1, "backward_input": 1, "backward_weight": 1, "activation_mb": 1, "w_hold_mb": 0}
    two.write_text(json.dumps({"version": 1, "p2p_latency": 0.01, "stages": [stage, stage]}))
    assert _install(["--koala-schedule", "zb-h1", "--koala-profile", str(two)]) is not None


def test_megatron_errors_name_megatrons_flags_and_the_closest_name():
    from koala_ds.megatron import MegatronScheduleError

    with pytest.raises(MegatronScheduleError) as info:
        _install(["--koala-schedule", "zb-v"], v=None)
    assert "change --virtual-pipeline-model-parallel-size" in str(info.value)
    assert "change -v" not in str(info.value)
    with pytest.raises(MegatronScheduleError) as info:
        _install(["--koala-schedule", "zb-h3"])
    assert "(did you mean 'zb-h2'?)" in str(info.value) and "zb-h1" in str(info.value)
    with pytest.raises(MegatronScheduleError) as info:
        _install(["--koala-schedule", "1f1b"], gbs=1, mbs=2)  # 0 microbatches
    assert "--global-batch-size / --micro-batch-size" in str(info.value)


def test_megatron_install_says_nothing_alarming_when_megatron_training_is_absent(caplog):
    pytest.importorskip("megatron.core")
    try:
        import megatron.training.training  # noqa: F401
        pytest.skip("Megatron-LM is installed: megatron.training is patched")
    except ImportError:
        pass
    import megatron.core.pipeline_parallel as mpp
    from megatron.core.pipeline_parallel import schedules as mcs

    saved = (mpp.get_forward_backward_func, mcs.get_forward_backward_func)
    try:
        with caplog.at_level(logging.INFO, logger="koala_ds"):
            report = _install(["--koala-schedule", "1f1b"])
    finally:
        mpp.get_forward_backward_func, mcs.get_forward_backward_func = saved
    shown = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert shown and all("ModuleNotFoundError" not in s and "not present" not in s for s in shown), shown
    assert "not present" not in str(report) and "megatron.training" in report.details()


# -- one multi-process run: the DeepSpeed example with a schedule made for other microbatches ----
@pytest.mark.slow
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(300)
def test_deepspeed_example_user_error_is_one_line_on_one_rank(tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed_jobs import extensions_dir
    from koala_ds.resolve import load_schedule

    path = tmp_path / "m4.json"
    path.write_text(load_schedule("1f1b", 2, 4).to_json())
    from rank_processes import run_ranks

    env = environment(ROOT, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(extensions_dir()))
    cmd = [sys.executable, str(ROOT / "examples/deepspeed_pipe/train.py"), "--schedule", str(path),
           "--microbatches", "8", "--steps", "1"]
    results = run_ranks(cmd, 2, env, 240, ROOT)
    err = "".join(r.stderr for r in results)
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert [r.returncode for r in results] == [2, 2], err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert len(errors) == 1, errors
    assert errors[0].startswith("train.py: error: --schedule ") and "set --microbatches 4" in errors[0]
    assert results[1].stderr.strip() == "" or "error" not in results[1].stderr.lower()


def ds_example():
    """examples/deepspeed_pipe/train.py as a module (it imports DeepSpeed: skipped without it)."""
    pytest.importorskip("deepspeed")
    return load_script("examples/deepspeed_pipe/train.py", "ds_example_train")


def test_deepspeed_example_alternates_run_on_the_model_copy_of_their_placement(tmp_path):
    """--alternate-schedules: a schedule placed as --schedule shares its engine; another
    placement (a library name compiled for --chunks, or a fixed file of any --chunks) names the
    (chunks, placement) of the engine and model copy it gets."""
    import argparse

    from koala_ds.resolve import load_schedule

    example = ds_example()
    zbv = tmp_path / "zbv.json"
    zbv.write_text(load_schedule("zb-v", 2, 8, 2).to_json())

    def shapes(schedule, alternates, chunks=1, placement="interleaved"):
        return example.shapes(argparse.Namespace(schedule=schedule, alternate_schedules=alternates, chunks=chunks,
                                                 placement=placement, microbatches=8, trace=None), 2)

    assert shapes("1f1b", None) == {"1f1b": (1, "linear")}
    assert shapes("1f1b", f"zb-h1,{zbv}") == {"1f1b": (1, "linear"), "zb-h1": (1, "linear"), str(zbv): (2, "vshape")}
    assert shapes("zb-v", "interleaved-1f1b,dualpipe-v", 2, "vshape") == {
        "zb-v": (2, "vshape"), "interleaved-1f1b": (2, "interleaved"), "dualpipe-v": (2, "vshape")}


@pytest.mark.parametrize("flags, says", [
    (["--microbatches", "0"], "argument --microbatches: must be >= 1, got '0'"),
    (["--schedule", "zb-h3"], "--schedule: unknown schedule 'zb-h3' (did you mean 'zb-h2'?)"),
    (["--schedule", "zb-v", "--chunks", "2"], "use --chunks 2 --placement vshape."),
    (["--schedule", "zb-h2", "--microbatches", "2"], "m >= 2 * p - 1"),
    (["--pp", "3"], "--pp 3 does not divide the 2 processes"),
    (["--chunks", "2", "--placement", "vshape"], "--chunks 2 needs --schedule: a schedule of 2 chunks per rank "
                                                 "(e.g. --schedule zb-v for --placement vshape)"),
    (["--schedule", "P4"], "was made for p=4 but --pp is 2 (default: every process): set --pp 4 (and start a "
                           "multiple of 4 processes)"),
    # --alternate-schedules (benchmarks/fidelity.py's paired rounds): what cannot take turns with --schedule
    (["--alternate-schedules", "zb-h1"], "--alternate-schedules needs --schedule"),
    (["--schedule", "1f1b", "--alternate-schedules", "zb-h1,zb-v"], "--alternate-schedules zb-v: schedule 'zb-v' "
                                                                    "needs v == 2"),
    (["--schedule", "1f1b", "--alternate-schedules", "zb-h1", "--alternate-block", "0"],
     "argument --alternate-block: must be >= 1"),
    (["--schedule", "1f1b", "--alternate-schedules", "zb-h1", "--alternate-block", "4", "--alternate-settle", "4"],
     "--alternate-settle 4 must be at least 1 and below --alternate-block 4: a turn keeps its iterations after the "
     "first 4"),
])
def test_deepspeed_example_flags_are_checked_in_its_own_words_before_deepspeed_starts(monkeypatch, capsys,
                                                                                       tmp_path, flags, says):
    """The example's flags used to reach DeepSpeed unchecked: --microbatches 0 was an
    AssertionError traceback, a schedule that did not fit named the KoalaPipelineModule's chunks
    and "pipeline.koala.schedule" (settings the script's user never wrote)."""
    example = ds_example()
    if "P4" in flags:  # a schedule file made for 4 pipeline ranks
        from koala_ds.resolve import load_schedule

        path = tmp_path / "p4.json"
        path.write_text(load_schedule("zb-h1", 4, 8).to_json())
        flags = [str(path) if f == "P4" else f for f in flags]
    monkeypatch.delenv("KOALA_SCHEDULE", raising=False)
    monkeypatch.setattr(example.deepspeed, "init_distributed", lambda **_: pytest.fail("DeepSpeed was started"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["train.py", *flags])
    with pytest.raises(SystemExit) as info:
        run_main(example.main, "train.py")
    assert info.value.code == USER_ERROR_EXIT
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error: ") and says in lines[0], lines


# -- argument errors and the launcher ------------------------------------------------------------
@pytest.mark.parametrize("rank", ["0", "1"])
def test_argument_errors_are_one_line_on_rank_zero_and_exit_2_everywhere(monkeypatch, capsys, rank):
    from koala_ds.core.errors import rank_zero_argument_errors

    monkeypatch.setenv("RANK", rank)
    parser = rank_zero_argument_errors(argparse.ArgumentParser(prog="train.py"), grace_s=0.0)
    parser.add_argument("--steps", type=int)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--steps", "many"])
    assert info.value.code == USER_ERROR_EXIT
    err = capsys.readouterr().err
    if rank == "0":
        assert err == "train.py: error: argument --steps: invalid int value: 'many' (see train.py -h)\n"
    else:
        assert err == ""


@pytest.mark.parametrize("rank", ["0", "1"])
def test_help_is_printed_by_rank_zero_only(monkeypatch, capsys, rank):
    """`koala-run --nproc-per-node 2 train.py --help` printed the usage once per rank."""
    from koala_ds.core.errors import rank_zero_argument_errors

    monkeypatch.setenv("RANK", rank)
    parser = rank_zero_argument_errors(argparse.ArgumentParser(prog="train.py"), grace_s=0.0)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: train.py") if rank == "0" else out == ""


def test_megatron_koala_flags_make_the_parser_one_line(monkeypatch, capsys):
    pytest.importorskip("megatron.core")
    from koala_ds.megatron import add_arguments

    monkeypatch.setenv("RANK", "0")
    parser = add_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    with pytest.raises(SystemExit):
        parser.parse_args(["--pipeline-schedule", "koalaa"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pretrain_gpt.py: error: argument --pipeline-schedule")


SCRIPT = """import sys
from koala_ds.core.errors import run_main
from koala_ds.core.ir import KoalaError

def main():
    if sys.argv[1] == "user":
        raise KoalaError("set --pipeline-model-parallel-size 4")
    raise RuntimeError("a bug")

run_main(main, "t.py", grace_s=2.0)
"""


def _koala_run(tmp_path, kind: str, omp: str | None = "1") -> subprocess.CompletedProcess:
    script = tmp_path / "t.py"
    script.write_text(SCRIPT)
    env = environment(ROOT)
    env.pop("OMP_NUM_THREADS", None)
    env.update({"OMP_NUM_THREADS": omp} if omp is not None else {})
    # --standalone: the launcher binds a port the system picks (a port from free_port() can be
    # taken before torchrun binds it).
    cmd = [sys.executable, "-m", "koala_ds.runtime.torchrun", "--nproc-per-node", "2", "--standalone", str(script), kind]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("omp", ["1", None], ids=["OMP_NUM_THREADS=1", "unset"])
def test_koala_run_leaves_a_user_error_at_one_line(tmp_path, omp):
    """torchrun printed about 40 lines after the user's one (SIGTERM notices, its traceback, a
    table), and with OMP_NUM_THREADS unset its 4-line notice that it sets it, before."""
    done = _koala_run(tmp_path, "user", omp)
    assert done.returncode == USER_ERROR_EXIT, done.stderr
    assert done.stderr == "t.py: error: set --pipeline-model-parallel-size 4\n"
    assert done.stdout == ""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_koala_run_keeps_torchruns_report_for_a_crash(tmp_path):
    done = _koala_run(tmp_path, "crash")
    assert done.returncode == 1, done.stderr
    # both ranks' tracebacks and torchrun's table, whole (failed in CI and here with the two
    # tracebacks mixed: test_ranks_that_crash_together_print_whole_tracebacks)
    assert "RuntimeError: a bug" in done.stderr and "Root Cause" in done.stderr, done.stderr
    assert "ChildFailedError" not in done.stderr  # the launcher's own traceback is not a finding


@pytest.fixture
def koala_run_here(tmp_path, monkeypatch):
    """koala_ds.runtime.torchrun, to call in this process as rank 0, in `tmp_path`, which holds a script
    never_started.py (OMP_NUM_THREADS set: torchrun warns when it is not, and sets it)."""
    from koala_ds.runtime import torchrun

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "")  # torchrun's launcher sets it
    monkeypatch.chdir(tmp_path)
    (tmp_path / "never_started.py").write_text("raise SystemExit('never started')\n")
    yield torchrun
    for thread in threading.enumerate():  # a store probe left waiting ends once its port closes or its retries end;
        if thread.name == torchrun.PROBE_THREAD:  # one still in torch's C++ client as pytest exits aborts it
            thread.join(30)


@pytest.mark.parametrize("option", ["--master-port", "--rdzv-endpoint"])
def test_koala_run_says_in_one_line_that_its_port_is_taken(koala_run_here, capsys, option):
    """torchrun ended in its own 39-line traceback (DistNetworkError, EADDRINUSE) when the port
    of its static rendezvous was in use, e.g. by another run."""
    with held_port() as port:
        rendezvous = (["--master-port", str(port)] if option == "--master-port" else
                      ["--rdzv-backend", "static", "--rdzv-endpoint", f"127.0.0.1:{port}"])
        code = koala_run_here.main(["--nproc-per-node", "2", *rendezvous, "never_started.py"])
    assert code == USER_ERROR_EXIT
    assert capsys.readouterr().err == (
        f"koala-run: error: port {port} of {option} is already in use on this machine (another run, or one "
        f"that has not ended, holds it): pass a free port with {option}, or --standalone to have one picked\n")


def test_koala_run_bad_options_and_a_missing_script_are_one_line(koala_run_here, tmp_path, capfd):
    """torchrun printed its 40-line usage for a bad option, and started every rank, each failing
    on the missing file, for a training script that does not exist."""
    with pytest.raises(SystemExit) as info:
        koala_run_here.main(["--nproc-per-node", "2", "--bogus-flag", "t.py"])
    assert info.value.code == USER_ERROR_EXIT
    assert capfd.readouterr().err == "koala-run: error: unrecognized arguments: --bogus-flag (see koala-run -h)\n"
    assert koala_run_here.main(["--nproc-per-node", "2", "t.py", "--steps", "1"]) == USER_ERROR_EXIT
    assert capfd.readouterr().err == f"koala-run: error: training script 't.py' does not exist (from {tmp_path})\n"


@pytest.mark.parametrize("sizes, says", [
    (["--nproc-per-node", "x"], "--nproc-per-node x: Unsupported nproc_per_node value: x (use an integer >= 1, "),
    (["--nproc-per-node", "0"], "--nproc-per-node 0: at least 1 process per node"),
    (["--nnodes", "2:1"], "--nnodes 2:1: a number of nodes N or a range MIN:MAX, with 0 < MIN <= MAX"),
    (["--nnodes", "a"], "--nnodes a: a number of nodes N"),
])
def test_koala_run_bad_sizes_are_one_line(koala_run_here, capfd, sizes, says):
    """torchrun ended these in its traceback (ValueError, or an AssertionError with no message)."""
    assert koala_run_here.main([*sizes, "never_started.py"]) == USER_ERROR_EXIT
    err = capfd.readouterr().err
    assert err.startswith(f"koala-run: error: {says}") and err.count("\n") == 1, err


@pytest.mark.parametrize("options, says", [
    (["--max-restarts", "-1"], "--max-restarts -1: max_restarts must be >= 0"),
    (["--monitor-interval", "0"], "--monitor-interval 0.0: seconds between checks of the ranks, > 0"),
    (["--local-ranks-filter", "x"], "--local-ranks-filter x: --local_ranks_filter must be a comma-separated list"),
    (["--rdzv-conf", "abc"], "--rdzv-conf abc: The rendezvous configuration option 'abc' must have a value"),
    (["--rdzv-conf", "join_timeout=x"], "--rdzv-conf join_timeout=x: The rendezvous configuration option"),
    (["--redirects", "9"], "--redirects 9: 0 (none), 1 (stdout), 2 (stderr) or 3 (both), or per local rank"),
    (["--redirects", "1", "--tee", "7"], "--tee 7: 0 (none)"),
    (["--logs-specs", "nope"], "--logs-specs nope: Could not find entrypoint"),
    (["--no-python", "-m"], "--no-python and -m (--module) cannot be used together"),
    (["--rdzv-backend", "nope", "--rdzv-endpoint", "localhost:0"], "--rdzv-backend nope: The rendezvous backend 'nope' is not registered"),
    (["--rdzv-endpoint", "localhost:99999"], "--rdzv-endpoint localhost:99999: The port number of the rendezvous"),
    (["--master-port", "99999"], "--master-addr 127.0.0.1 / --master-port 99999: The port number of the rendezvous"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout -1: shutdown_timeout must be non-negative"),
])
def test_koala_run_option_values_torchrun_refuses_are_one_line(koala_run_here, capfd, options, says):
    """torchrun ended each of these in its traceback (a ValueError, or an AssertionError, some
    with no message) before it started a rank."""
    assert koala_run_here.main(["--nproc-per-node", "2", *options, "never_started.py"]) == USER_ERROR_EXIT
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"koala-run: error: {says}"), err


def test_koala_run_leaves_a_value_error_from_the_running_agent_alone(koala_run_here, monkeypatch):
    """Only a refusal before the agent's loop is an option's: the same error type raised once
    ranks start keeps torchrun's traceback."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    def start_workers(self, worker_group):
        raise ValueError("not about an option")

    monkeypatch.setattr(LocalElasticAgent, "_start_workers", start_workers)
    with pytest.raises(ValueError, match="not about an option"):
        koala_run_here.main(["--nproc-per-node", "1", "--standalone", "never_started.py"])


def _koala_run_at_a_port(koala_run, monkeypatch, listener: str, argv) -> tuple[int, int]:
    """koala-run's exit code for `argv(port)` and the script never_started.py, and the port: one
    held by a socket that listens and never answers ("not a store"), or a free one ("nothing").
    The store probe gets 0.1 s more than its timeout."""
    monkeypatch.setattr(koala_run, "PROBE_GRACE_S", 0.1)
    with held_port() as port:
        if listener == "nothing":
            port = free_port()
        return koala_run.main([*argv(port), "never_started.py"]), port


@pytest.mark.timeout(60, method="thread")  # the old hang was in C++, out of reach of a signal
def test_koala_run_says_in_one_line_that_no_rendezvous_store_answers(koala_run_here, capsys, monkeypatch):
    """torchrun waited with no deadline (more than 20 minutes, its read timeout not kept) when a
    c10d --rdzv-endpoint on this machine named a port held by a process that never answers."""
    code, port = _koala_run_at_a_port(koala_run_here, monkeypatch, "not a store", lambda port: [
        "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
        "--rdzv-conf", "read_timeout=1"])
    assert code == USER_ERROR_EXIT
    assert capsys.readouterr().err == (
        f"koala-run: error: --rdzv-endpoint localhost:{port}: port {port} is in use on this machine, but no "
        f"rendezvous store answered there within 1 s (--rdzv-conf read_timeout): pass a free port, or "
        f"--standalone to have one picked\n")


@pytest.fixture
def endpoints_elsewhere(monkeypatch):
    """torch (its rendezvous utilities and its c10d backend) takes every endpoint for one on
    another machine: the agent never hosts the store there and only connects as a client."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, utils

    for module in (utils, c10d_rendezvous_backend):
        monkeypatch.setattr(module, "_matches_machine_hostname", lambda host: False)


@pytest.mark.timeout(60, method="thread")  # the old hang was in C++, out of reach of a signal
@pytest.mark.parametrize("listener", ["not a store", "nothing"])
def test_koala_run_says_in_one_line_that_no_store_answers_on_another_machine(koala_run_here, endpoints_elsewhere,
                                                                             capfd, monkeypatch, listener):
    """An endpoint on another machine: a process there that never answers held torchrun with no
    end (read_timeout not kept); with nothing listening it waited read_timeout, then ended in its
    traceback, after torch's C++ store client logged each try with a stack of 30 frames."""
    code, port = _koala_run_at_a_port(koala_run_here, monkeypatch, listener, lambda port: [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-conf", "read_timeout=1"])
    assert code == USER_ERROR_EXIT
    assert capfd.readouterr().err == (
        f"koala-run: error: --rdzv-endpoint 127.0.0.1:{port}: no rendezvous store answered at 127.0.0.1:{port} "
        f"within 1 s (--rdzv-conf read_timeout): start the agent that hosts it (on that machine, the same "
        f"koala-run), or check the address and port\n")


@pytest.fixture
def store_port():
    """The port of a rendezvous store (a TCPStore server on 127.0.0.1) that answers."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size=2, is_master=True, timeout=timedelta(seconds=10),
                     wait_for_workers=False)
    yield store.port
    del store


def _torchrun_args(*argv: str):
    """torchrun's parsed arguments for `argv` and a script never_started.py."""
    from torch.distributed import run as torchrun

    return torchrun.get_args_parser().parse_args([*argv, "never_started.py"])


def test_the_store_probe_lets_a_store_that_answers_and_a_free_port_through(koala_run_here, store_port):
    """Two agents of one job on one machine: the second finds the first's store at the endpoint."""
    for port in (store_port, free_port()):
        args = _torchrun_args("--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
                              "--rdzv-conf", "read_timeout=5")
        assert koala_run_here.store_not_answering(args) is None


def test_the_store_probe_lets_a_store_on_another_machine_through(koala_run_here, endpoints_elsewhere, store_port):
    args = _torchrun_args("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store_port}")
    assert koala_run_here.store_not_answering(args) is None


def test_the_store_probe_lets_through_an_agent_that_hosts_the_store(koala_run_here, endpoints_elsewhere):
    """`--rdzv-conf is_host=true` (for an address of this machine that torch takes for another's)
    and a one-node static run with no --master-port (torchrun gives it a c10d store of its own)
    host their store: nothing to wait for."""
    for argv in (["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                  "--rdzv-conf", "is_host=true,read_timeout=1"],
                 ["--nnodes", "1", "--node-rank", "1"]):
        assert koala_run_here.store_not_answering(_torchrun_args(*argv)) is None


@pytest.mark.timeout(60, method="thread")  # the old hang was in C++, out of reach of a signal
@pytest.mark.parametrize("listener", ["not a store", "nothing"])
def test_koala_run_says_in_one_line_that_node_0s_store_does_not_answer(koala_run_here, capfd, monkeypatch, listener):
    """A static rendezvous's node 1 (--node-rank 1) connects to node 0's store at --master-addr /
    --master-port: held by a process that never answers, torchrun waited with no end; with
    nothing listening it waited `timeout`, then ended in its traceback. A wait longer than
    WAIT_NOTICE_S is announced in one line first."""
    monkeypatch.setattr(koala_run_here, "WAIT_NOTICE_S", 0.3)
    code, port = _koala_run_at_a_port(koala_run_here, monkeypatch, listener, lambda port: [
        "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
        "--master-port", str(port), "--rdzv-conf", "timeout=1"])
    assert code == USER_ERROR_EXIT
    where, fix = ((f"port {port} is in use on this machine, but no rendezvous store answered there",
                   "pass the port node 0 listens on") if listener == "not a store" else
                  (f"no rendezvous store answered at 127.0.0.1:{port}",
                   "start node 0 (--node-rank 0) at this address and port, or check them"))
    assert capfd.readouterr().err == (
        f"koala-run: waiting for the rendezvous store at 127.0.0.1:{port} (--master-addr / --master-port), up to 1 s "
        f"(--rdzv-conf timeout)\n"
        f"koala-run: error: --master-addr / --master-port 127.0.0.1:{port}: {where} within 1 s (--rdzv-conf timeout): "
        f"{fix}\n")


def test_the_store_probe_lets_node_1_through_to_node_0s_store(koala_run_here, store_port):
    for node_rank, endpoint in ((1, ["--master-addr", "127.0.0.1", "--master-port", str(store_port)]),
                                (1, ["--rdzv-endpoint", f"127.0.0.1:{store_port}"]),
                                (0, ["--master-addr", "127.0.0.1", "--master-port", str(free_port())])):
        args = _torchrun_args("--nnodes", "2", "--node-rank", str(node_rank), *endpoint)
        assert koala_run_here.store_not_answering(args) is None


@pytest.mark.parametrize("probing", [True, False])
def test_koala_run_ends_without_the_interpreters_teardown_while_a_store_probe_waits(koala_run_here, monkeypatch,
                                                                                    probing):
    """A store probe that ends in torch's C++ client while the interpreter tears down aborts the
    process (std::terminate; exit code 134 instead of 2, in 1 of 2 runs with a 0.1 s grace)."""
    monkeypatch.setattr(koala_run_here, "main", lambda: 2)

    def os_exit(code: int):
        raise SystemExit(f"os._exit({code})")
    monkeypatch.setattr(koala_run_here.os, "_exit", os_exit)
    done = threading.Event()
    waiting = threading.Thread(target=done.wait, name=koala_run_here.PROBE_THREAD if probing else "other", daemon=True)
    waiting.start()
    try:
        with pytest.raises(SystemExit) as info:
            koala_run_here.cli()
    finally:
        done.set()
        waiting.join()
    assert info.value.code == ("os._exit(2)" if probing else 2)


def test_one_line_user_errors_around_a_call(monkeypatch, capsys):
    from koala_ds.core.errors import one_line_user_errors

    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as info:
        with one_line_user_errors("pretrain_gpt.py"):
            raise KoalaError("--koala-schedule p4.koala needs p == 4")
    assert info.value.code == USER_ERROR_EXIT
    assert capsys.readouterr().err == "pretrain_gpt.py: error: --koala-schedule p4.koala needs p == 4\n"
    with one_line_user_errors():
        pass  # nothing raised: nothing happens


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("example", ["examples/deepspeed_pipe/train.py", "examples/megatron_gpt/pretrain_gpt.py"])
def test_examples_bad_flag_through_koala_run_is_one_line(tmp_path, example):
    """An argparse error printed a usage block on every rank, then torchrun's summary."""
    env = environment(ROOT, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    flag = "--train-iters" if "megatron" in example else "--steps"
    cmd = [sys.executable, "-m", "koala_ds.runtime.torchrun", "--nproc-per-node", "2", "--standalone",
           str(ROOT / example), flag, "x"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180, cwd=tmp_path)
    assert done.returncode == USER_ERROR_EXIT, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"{Path(example).name}: error: argument {flag}: ") and "'x'" in lines[0]
