"""examples/megatron_gpt/pretrain_gpt.py end to end: torchrun, real megatron-core GPT, gloo.
The loss of every iteration is the same whichever schedule runs it, and it goes down."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # multi-process
ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
         "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", "6", "--lr", "3e-3", "--seed", "1234",
         "--pipeline-schedule", "koala"]


@pytest.fixture(autouse=True, scope="module")
def _megatron_core():
    """Imported when a test here runs, not at collection, which every xdist worker pays (~3 s)."""
    pytest.importorskip("megatron.core")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tmp_path: Path, schedule: str, extra: list[str]) -> list[float]:
    log = tmp_path / f"{schedule}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(ROOT / "examples/megatron_gpt/pretrain_gpt.py"), *FLAGS, *extra, "--koala-schedule", schedule,
           "--loss-log", str(log)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "iteration        6/       6 |" in proc.stdout + proc.stderr
    data = json.loads(log.read_text())
    assert data["schedule"] == schedule
    return [float(x) for x in data["losses"]]


@pytest.mark.timeout(900)
def test_same_loss_whichever_schedule_and_it_goes_down(tmp_path):
    base = run(tmp_path, "1f1b", [])
    assert len(base) == 6 and base[-1] < base[0]
    for schedule, extra in (("zb-v", ["--virtual-pipeline-model-parallel-size", "2"]),):
        other = run(tmp_path, schedule, extra)
        assert other == pytest.approx(base, rel=1e-5), schedule
