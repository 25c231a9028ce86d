"""The patches in patches/ and the commands the docs give for applying them.

The Megatron-LM patch is checked against Megatron-LM's own pretrain_gpt.py at core_v0.16.1, a
third-party file kept outside the project in <repo>/../shared/fixtures/ (or $KOALA_FIXTURES_DIR):
it is copied into a scratch checkout, never into the repository.
"""
from __future__ import annotations

import importlib.util
import os
import py_compile
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("KOALA_FIXTURES_DIR") or REPO.parent / "shared" / "fixtures")
MEGATRON_LM = FIXTURES / "megatron-lm-core_v0.16.1"
MEGATRON_PATCH = REPO / "patches" / "megatron-lm" / "0001-koala-pipeline-schedule.patch"


def _git(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(120)
def test_megatron_lm_patch_applies_to_core_v0_16_1_and_compiles(tmp_path):
    source = MEGATRON_LM / "pretrain_gpt.py"
    if not source.is_file():
        pytest.skip(f"Megatron-LM core_v0.16.1 fixture absent: {source} (set KOALA_FIXTURES_DIR to the "
                    f"directory holding megatron-lm-core_v0.16.1/)")
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    checkout = tmp_path / "Megatron-LM"  # a scratch checkout, the patch's paths relative to its root
    checkout.mkdir()
    assert _git("init", "-q", cwd=checkout).returncode == 0
    shutil.copyfile(source, checkout / "pretrain_gpt.py")

    check = _git("apply", "--check", "-v", str(MEGATRON_PATCH), cwd=checkout)
    assert check.returncode == 0, check.stderr
    assert "offset" not in check.stdout + check.stderr, check.stdout + check.stderr  # written for this tag
    applied = _git("apply", str(MEGATRON_PATCH), cwd=checkout)
    assert applied.returncode == 0, applied.stderr

    patched = (checkout / "pretrain_gpt.py").read_text(encoding="utf-8")
    assert patched != source.read_text(encoding="utf-8")
    assert "import koala_ds.megatron as koala_megatron" in patched
    # a schedule that does not fit the flags: one line on rank 0, not a traceback per rank
    assert re.search(r"with one_line_user_errors\(.*\):\n\s+report = koala_megatron\.install\(", patched)
    launch = patched[patched.rindex("    pretrain(\n"):]
    assert "partial(koala_model_provider, gpt_builder)" in launch
    assert "extra_args_provider=extra_args_provider," in launch
    assert "get_embedding_ranks=get_embedding_ranks," in launch  # core_v0.16.1's own argument kept
    py_compile.compile(str(checkout / "pretrain_gpt.py"), cfile=str(tmp_path / "pretrain_gpt.pyc"), doraise=True)
    # and the patch comes off again cleanly
    assert _git("apply", "--reverse", "--check", str(MEGATRON_PATCH), cwd=checkout).returncode == 0


@pytest.mark.timeout(120)
def test_docs_command_finds_the_installed_deepspeed_even_when_it_prints_a_warning(tmp_path):
    """docs/deepspeed.md's launcher-patch commands, up to `patch`, run as written: the directory
    they pick is the one holding the installed deepspeed package. DeepSpeed's import prints an
    accelerator warning on stdout when DS_ACCELERATOR is unset (`cd $(...)` then got two words)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None:
        pytest.skip("deepspeed is not installed")
    text = (REPO / "docs" / "deepspeed.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "patches/deepspeed/" in b)
    lines = [line.strip() for line in block.splitlines() if line.strip()]
    before_patch = lines[:next(i for i, line in enumerate(lines) if line.startswith("patch "))]
    assert before_patch, block
    script = "set -e\n" + "\n".join(before_patch) + '\necho "DIR=${DS_SITE:-$PWD}"\n'
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `python` is this one
    run = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stdout + run.stderr
    chosen = Path(re.search(r"^DIR=(.*)$", run.stdout, re.M).group(1))
    assert (chosen / "deepspeed" / "__init__.py").resolve() == Path(spec.origin).resolve()
