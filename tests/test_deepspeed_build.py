"""DeepSpeed's CPU communication extension (deepspeed_shm_comm): built once, with a deadline, and
a lock left by a killed build does not make later DeepSpeed processes wait forever.

torch's JIT build takes `<extensions dir>/<name>/lock` for the build (or the check that the
extension is built). In torch 2.13 the file's existence is the lock: the build creates it, holds
it open and removes it after; a process killed in between leaves it, and every later process
waits on it with no timeout. torch 2.15 flocks the file instead and leaves it in place after: an
unheld file no longer makes anyone wait. These tests build in temporary extensions dirs.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
if not os.path.isdir("/proc"):
    pytest.skip("lock owners are found through /proc (Linux)", allow_module_level=True)

from deepspeed_jobs import _BUILD_CODE, DEFAULT_EXTENSIONS_DIR, launch  # noqa: E402

SHM = "deepspeed_shm_comm"


def _hold_lock(path) -> subprocess.Popen:
    """A process that holds the build lock `path` the way torch does: it creates the file and keeps
    it open (torch 2.13's FileBaton), and flocks it (torch 2.15's FileLock, for which a file that
    is only open is free)."""
    code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); "
            "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('held', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _running_in(directory) -> list[int]:
    """Processes whose working directory is `directory` or below it."""
    root, found = os.path.realpath(directory), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cwd = os.readlink(f"/proc/{entry}/cwd")
            except OSError:
                continue
            if cwd == root or cwd.startswith(root + os.sep):
                found.append(int(entry))
    return found


def _loads_without_waiting(ext) -> None:
    """A later DeepSpeed process loads the built extension from `ext` without waiting on the lock
    the run left, if any. It is started without this harness, which would clear a stale lock first:
    whether what is left makes a process wait is torch's to say (torch 2.13: the file exists;
    torch 2.15: someone holds its flock), so the test asks torch rather than looking at the file."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(ext)}
    try:
        done = subprocess.run([sys.executable, "-c", _BUILD_CODE], env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a later DeepSpeed process waited 90 s on {ext / SHM / 'lock'} (left behind) and was killed",
                    pytrace=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]


def test_a_lock_whose_owner_is_gone_is_removed_and_a_held_one_is_kept(tmp_path):
    from deepspeed_jobs import clear_stale_locks, lock_holders

    stale = tmp_path / SHM / "lock"
    stale.parent.mkdir()
    stale.touch()  # its creator was killed: nobody holds it
    held = tmp_path / "other_ext" / "lock"
    held.parent.mkdir()
    holder = _hold_lock(held)
    try:
        assert lock_holders(held) == [holder.pid]
        assert clear_stale_locks(tmp_path, grace_s=0.05) == [stale]
        assert not stale.exists()
        assert held.exists()  # its owner is alive: still building
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert clear_stale_locks(tmp_path, grace_s=0.05) == [held]  # now its owner is gone


@pytest.mark.slow
@pytest.mark.deepspeed_ext
@pytest.mark.timeout(600)
def test_jobs_and_the_build_go_past_a_lock_left_by_a_killed_build(tmp_path, monkeypatch):
    """The failure of issue 14: a stale lock made every later DeepSpeed job wait until killed.
    After the jobs and after the build, nothing they left makes a later process wait: with torch
    2.13 no lock is left; torch 2.15 leaves its (unheld) lock file in place by design."""
    built = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or DEFAULT_EXTENSIONS_DIR) / SHM
    if not (built / f"{SHM}.so").exists():
        pytest.fail(f"tests/conftest.py should have built {built} before this test")
    ext = tmp_path / "torch_extensions"
    shutil.copytree(built, ext / SHM)  # built (keeps the mtimes: nothing to recompile) ...
    lock = ext / SHM / "lock"
    lock.touch()  # ... but with the lock of a build that was killed
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    start = time.monotonic()
    values = [r["value"] for r in launch("deepspeed_jobs:allreduce_worker", 2, {"size": 4},
                                         timeout_s=120)]
    assert values == [2.0, 2.0]
    assert time.monotonic() - start < 120
    _loads_without_waiting(ext)

    from deepspeed_jobs import build_cpu_extension

    lock.touch()
    build_cpu_extension(ext, timeout_s=200)
    _loads_without_waiting(ext)


def _stalling_compiler(tmp_path, marker) -> Path:
    """A C++ compiler that answers torch's version checks but, asked to compile (`-c`), marks
    `marker` and stalls: the build is deterministically still compiling at any deadline (a real
    compile can take 20 s on a fast day or 3 minutes on a loaded one)."""
    real = shutil.which(os.environ.get("CXX", "c++"))
    if real is None:
        pytest.skip("no C++ compiler (CXX or c++) on PATH")
    script = tmp_path / "stalling-c++"
    script.write_text("#!/bin/sh\n"
                      'for arg in "$@"; do [ "$arg" = "-c" ] && { touch "%s"; exec sleep 600; }; done\n'
                      'exec "%s" "$@"\n' % (marker, real))
    script.chmod(0o755)
    return script


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_build_past_its_deadline_is_killed_and_leaves_no_lock(tmp_path, monkeypatch):
    from deepspeed_jobs import ExtensionBuildError, build_cpu_extension

    ext = tmp_path / "torch_extensions"
    compiling = tmp_path / "compiling"
    monkeypatch.setenv("CXX", str(_stalling_compiler(tmp_path, compiling)))
    with pytest.raises(ExtensionBuildError) as info:
        build_cpu_extension(ext, timeout_s=45)
    message = str(info.value)
    assert "\n" not in message and "deadline of 45 s" in message and SHM in message, message
    assert compiling.exists()  # the deadline fell while compiling, after the build took its lock
    assert not (ext / SHM / "lock").exists()
    # nothing of the killed build is still running (ninja and the compilers ran in its build dir)
    assert _running_in(ext) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_build_that_waits_on_a_live_lock_ends_at_its_deadline_with_one_line(tmp_path):
    from deepspeed_jobs import ExtensionBuildError, build_cpu_extension

    ext = tmp_path / "torch_extensions"
    (ext / SHM).mkdir(parents=True)
    holder = _hold_lock(ext / SHM / "lock")  # another build in progress, which never finishes
    try:
        start = time.monotonic()
        with pytest.raises(ExtensionBuildError, match=r"ran past its deadline of 20 s; log: ") as info:
            build_cpu_extension(ext, timeout_s=20)
        assert time.monotonic() - start < 60
        assert "\n" not in str(info.value)
        assert not (ext / SHM / "build.ninja").exists()  # it waited: it did not build beside the owner
        assert (ext / SHM / "lock").exists()  # not ours to remove: its owner is alive
    finally:
        holder.kill()
        holder.wait(timeout=10)
