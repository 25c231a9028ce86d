"""Every `koala ...` command in the code blocks of README.md and docs/*.md runs as written
(exit code 0), in order, one temporary folder per document (so a later line may read what an
earlier one wrote). Searches get a small budget; the few lines that cannot run here are listed
in SKIP with the reason."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from koala_ds.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))

#: Command lines (as written, comment stripped) that are not run, and why.
SKIP = {
    "koala search --profile P.json -p 8 -m 32 [-v 2] [--backward auto|split|full] [--memory-limit MB]":
        "docs/search.md: the first line of a synopsis of the options, not a command",
    "koala calibrate trace.json --profile prof.json -o calibrated.json":
        "README.md: needs the trace of a training run (--koala-trace), which this test does not launch; "
        "tests/test_calibrate.py runs koala calibrate on traces",
    "koala calibrate runs/1f1b.json runs/zb-h1.json --profile prof.json -o calibrated.json --timeline merged.json "
    "--gantt steps.png":
        "docs/profiling.md: needs the traces of training runs (the torchrun lines before it)",
    "koala search --profile calibrated.json -m 8 --min-gain 3 -o best.koala":
        "docs/profiling.md: needs the calibrated profile of the line before",
    "koala profile megatron-gpt --num-layers 8 --hidden-size 256 --num-attention-heads 4 --seq-length 64 "
    "--micro-batch-size 2 -p 2 -o prof.json":
        "README.md, 'From profile to a faster run': its path is benchmarks/fidelity.py's (a real profile of "
        "a model that takes a minute here; the koala profile line above runs)",
    "koala calibrate runs/t.json runs/t.zb-h1.json --profile prof.json --skip-steps 8 -o calibrated.json "
    "--gantt steps.png":
        "README.md: needs the traces of the torchrun line before it",
    "koala calibrate runs/t.json runs/t.zb-h1.json --profile prof.json --skip-steps 8 -o calibrated.json":
        "docs/profiling.md: needs the traces of the torchrun line before it (schedules taking turns); "
        "tests/test_calibrate.py calibrates such traces",
    "koala calibrate t.json t.zb-v.json --skip-steps 8 --profile prof_v1.json -o cal_v1.json --profile prof_v2.json "
    "-o cal_v2.json":
        "docs/profiling.md: needs the traces of the torchrun line before it (1f1b and zb-v taking turns); "
        "tests/test_calibrate.py calibrates such traces with a --profile per v",
    "koala search --profile calibrated.json -m 8 -o best.koala":
        "README.md: needs the calibrated profile of the line before",
    "koala calibrate t0.json t0.zb-h1.json t1.json t1.1f1b.json t2.json t2.zb-h1.json --profile prof.json "
    "--skip-steps 16 -o calibrated.json":
        "README.md, 'What the calibration's own runs say': needs the traces of the three torchruns before it",
}

#: Added to every `koala search` that gives no budget of its own, and to --exact.
SEARCH_BUDGET = ["--time-budget", "2", "--quiet"]
EXACT_BUDGET = ["--exact-time-limit", "5"]


def commands(doc: str) -> list[str]:
    """The `koala ...` lines of the fenced code blocks, continuations joined, comments dropped."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    found = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line.startswith("koala "):
                found.append(re.sub(r"\s+", " ", line))
    return found


def _argv(line: str) -> list[str]:
    argv = shlex.split(line)[1:]
    if argv[0] == "search":
        if not {"--time-budget", "--generations"} & set(argv):
            argv += SEARCH_BUDGET
        if "--exact" in argv:
            pytest.importorskip("ortools")
            argv += EXACT_BUDGET
    return argv


def _run(argv: list[str], cwd: Path, capsys) -> tuple[int, str]:
    if argv[0] == "profile":  # torch and megatron-core: in a process of its own
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.run([sys.executable, "-m", "koala_ds.cli", *argv], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=600)
        return proc.returncode, proc.stderr[-2000:]
    try:
        code = main(argv)
    except SystemExit as exc:  # --version, --help
        code = exc.code or 0
    return code, capsys.readouterr().err


def test_the_documents_have_commands():
    assert len(commands("README.md")) >= 10
    assert any(line.startswith("koala profile ") for line in commands("README.md"))
    assert commands("docs/profiling.md") and commands("docs/search.md")
    every = {line for doc in DOCS for line in commands(doc)}
    assert set(SKIP) <= every, "a SKIP entry no longer matches any document line"


@pytest.mark.slow  # runs every documented command, koala profile and the search with workers included
@pytest.mark.parametrize("doc", [d for d in DOCS if commands(d)])
def test_every_command_in_the_docs_runs_as_written(doc, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for line in commands(doc):
        if line in SKIP:
            continue
        code, err = _run(_argv(line), tmp_path, capsys)
        assert code == 0, f"{doc}: `{line}` exited {code}: {err}"
