"""koala-run's refusals of a `--nproc-per-node` too large for any real run (torchrun started
processes until killed) and of a `--log-dir` it cannot use (torchrun ended in its traceback):
one line naming the option, exit code 2, and no rank started."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from koala_ds.core.errors import USER_ERROR_EXIT
from rank_processes import environment

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def koala_run_here(tmp_path, monkeypatch):
    """koala_ds.runtime.torchrun, to call in this process as rank 0 in `tmp_path` (which holds a script
    never_started.py), with torchrun's launcher replaced: a call to it, which would start the
    ranks, fails the test."""
    from torch.distributed import run as torch_run

    from koala_ds.runtime import torchrun

    def started(args) -> None:
        pytest.fail(f"koala-run started torchrun's launcher (--nproc-per-node {args.nproc_per_node})")

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(torch_run, "run", started)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "never_started.py").write_text("raise SystemExit('never started')\n")
    return torchrun


def _one_line(err: str, option: str) -> str:
    """The one line in `err`, checked to name `option` and to hold no traceback."""
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert "Traceback" not in err and lines[0].startswith(f"koala-run: error: {option} "), err
    return lines[0]


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.mark.parametrize("too_many", ["100000", "above the bound"])
def test_koala_run_refuses_an_absurd_nproc_per_node_at_once(koala_run_here, capfd, too_many):
    """torchrun started processes until killed (69 lines of stderr, with its traceback); the
    fixture fails the test if koala-run gets as far as torchrun's launcher."""
    bound = max(64, 4 * _cores())
    value = str(bound + 1) if too_many == "above the bound" else too_many
    start = time.monotonic()
    code = koala_run_here.main(["--nproc-per-node", value, "never_started.py"])
    assert time.monotonic() - start < 10
    assert code == USER_ERROR_EXIT
    line = _one_line(capfd.readouterr().err, "--nproc-per-node")
    assert line.startswith(f"koala-run: error: --nproc-per-node {value}: at most {bound} processes per node ")
    assert f"4 per CPU core this process may use, {_cores()}" in line, line


def test_the_nproc_per_node_bound_never_falls_below_64_and_grows_with_the_cores(koala_run_here, monkeypatch):
    """This project's tests run 8 ranks on 2 cores: the bound is 64 however few cores there are."""
    for cores, bound in [(1, 64), (2, 64), (16, 64), (100, 400)]:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cores=cores: set(range(cores)), raising=False)
        assert koala_run_here.max_processes_per_node() == bound


def test_koala_run_starts_the_most_processes_per_node_it_allows(koala_run_here, monkeypatch):
    """The bound itself, and a name torchrun counts devices for, go on to torchrun's launcher."""
    from torch.distributed import run as torch_run

    asked: list[str] = []
    monkeypatch.setattr(torch_run, "run", lambda args: asked.append(args.nproc_per_node))
    bound = str(koala_run_here.max_processes_per_node())
    for value in (bound, "cpu"):
        assert koala_run_here.main(["--nproc-per-node", value, "never_started.py"]) == 0
    assert asked == [bound, "cpu"]


@pytest.mark.parametrize("log_dir, says", [
    ("a_file", "--log-dir a_file: is a file, not a directory"),
    ("a_file/logs", "--log-dir a_file/logs: a_file is a file, not a directory"),
    ("a_file/x/logs", "--log-dir a_file/x/logs: a_file is a file, not a directory"),
    ("n" * 300, f"--log-dir {'n' * 300}: cannot create it (File name too long)"),
])
def test_koala_run_says_in_one_line_that_it_cannot_use_the_log_dir(koala_run_here, tmp_path, capfd, log_dir, says):
    """torchrun ended in its traceback (NotADirectoryError: log_dir: ... is a file, or one from
    os.makedirs)."""
    (tmp_path / "a_file").write_text("not a directory\n")
    assert koala_run_here.main(["--log-dir", log_dir, "--nproc-per-node", "1", "never_started.py"]) == USER_ERROR_EXIT
    line = _one_line(capfd.readouterr().err, "--log-dir")
    assert line.startswith(f"koala-run: error: {says}: pass a directory koala-run can create or write to"), line


def test_koala_run_says_in_one_line_that_it_cannot_write_to_the_log_dir(koala_run_here, tmp_path, capfd,
                                                                        monkeypatch):
    """A directory it may not write to (torchrun failed as its agent made the run's folder in it,
    with its traceback); os.access is replaced, as root may write anywhere."""
    (tmp_path / "logs").mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if str(path) == "logs"
                        else real_access(path, mode, **kw))
    assert koala_run_here.main(["--log-dir", "logs", "--nproc-per-node", "1", "never_started.py"]) == USER_ERROR_EXIT
    line = _one_line(capfd.readouterr().err, "--log-dir")
    assert line == ("koala-run: error: --log-dir logs: cannot write to it (permission denied): pass a directory "
                    "koala-run can create or write to")


def test_koala_run_creates_a_missing_log_dir_and_goes_on(koala_run_here, tmp_path, monkeypatch):
    from torch.distributed import run as torch_run

    asked: list[str] = []
    monkeypatch.setattr(torch_run, "run", lambda args: asked.append(args.log_dir))
    assert koala_run_here.main(["--log-dir", "new/logs", "--nproc-per-node", "1", "never_started.py"]) == 0
    assert asked == ["new/logs"] and (tmp_path / "new" / "logs").is_dir()


@pytest.mark.timeout(60)
def test_the_koala_run_command_says_in_one_line_that_its_log_dir_is_a_file(tmp_path):
    """The command itself (torchrun's launcher not replaced): exit code 2 and one line, where
    torchrun ended in `NotADirectoryError: log_dir: ok.py is a file` after its traceback."""
    (tmp_path / "ok.py").write_text("print('hi')\n")
    cmd = [sys.executable, "-m", "koala_ds.runtime.torchrun", "--log-dir", "ok.py", "--nproc-per-node", "1", "ok.py"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=50, cwd=tmp_path,
                          env=environment(ROOT, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu"))
    assert done.returncode == USER_ERROR_EXIT, done.stderr
    assert _one_line(done.stderr, "--log-dir") == ("koala-run: error: --log-dir ok.py: is a file, not a directory: "
                                                   "pass a directory koala-run can create or write to")
    assert done.stdout == ""
