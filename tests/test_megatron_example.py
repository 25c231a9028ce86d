"""examples/megatron_gpt/pretrain_gpt.py end to end: torchrun, real megatron-core GPT, gloo.
The loss of every iteration is the same whichever schedule runs it, and it goes down. Also its
--distributed-backend flag: backend and device choice (single process, no CUDA needed)."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from script_modules import load_script

from koala_ds.runtime.trace_record import TraceRecorder

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
         "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", "6", "--lr", "3e-3", "--seed", "1234",
         "--pipeline-schedule", "koala"]


@pytest.fixture()
def _megatron_core():
    """Imported when a test here runs, not at collection, which every xdist worker pays (~3 s)."""
    pytest.importorskip("megatron.core")


def example_module():
    return load_script("examples/megatron_gpt/pretrain_gpt.py", "pretrain_gpt")


def test_distributed_backend_flag_parses_megatron_lms_choices():
    ex = example_module()
    assert ex.parse_args([]).distributed_backend is None
    assert ex.parse_args(["--distributed-backend", "gloo"]).distributed_backend == "gloo"
    assert ex.parse_args(["--distributed-backend", "nccl"]).distributed_backend == "nccl"
    with pytest.raises(SystemExit):
        ex.parse_args(["--distributed-backend", "mpi"])


def test_the_corpus_draws_each_sequence_from_its_index_alone():
    """The data-parallel split moves sequences between ranks, it does not change them; a
    microbatch's labels are its tokens one position on."""
    corpus = example_module().MarkovCorpus(vocab=64, seed=7)
    whole = corpus.microbatches(3, dp_rank=0, dp=1, m=8, mbs=2, length=12)
    split = corpus.microbatches(3, 0, 2, 4, 2, 12) + corpus.microbatches(3, 1, 2, 4, 2, 12)
    assert all(a.equal(c) and b.equal(d) for (a, b), (c, d) in zip(whole, split))
    assert corpus.sequences(5, 3, 12).equal(corpus.sequences(0, 8, 12)[5:8])
    tokens, labels = whole[0]
    assert tokens.shape == (2, 12) and tokens[:, 1:].equal(labels[:, :-1])
    assert not whole[0][0].equal(whole[1][0])


def test_the_corpus_follows_its_chain():
    """Transitions drawn as often as the chain's probabilities say: within 4 binomial standard
    deviations (4000 sequences, fixed seed)."""
    import torch

    corpus = example_module().MarkovCorpus(vocab=16, seed=3)
    seqs = corpus.sequences(0, 4000, 16)
    counts = torch.zeros(16, 16)
    counts.index_put_((seqs[:, :-1].reshape(-1), seqs[:, 1:].reshape(-1)), torch.ones(4000 * 16), accumulate=True)
    assert int(seqs.min()) >= 0 and int(seqs.max()) < 16
    visits = counts.sum(dim=1, keepdim=True)
    sd = (corpus.probs * (1 - corpus.probs) / visits).sqrt()
    assert visits.min() > 100 and ((counts / visits - corpus.probs).abs() <= 4 * sd + 1e-3).all()


def test_backend_defaults_and_every_rank_on_one_gpu_over_gloo():
    from koala_ds.core.ir import KoalaError

    ex = example_module()
    # no CUDA: gloo on the CPU, whatever the rank; nccl is refused in one line naming the flag
    assert ex.distributed_setup(None, False, 1, 2, 0) == ("gloo", ex.torch.device("cpu"))
    assert ex.distributed_setup("gloo", False, 0, 2, 0) == ("gloo", ex.torch.device("cpu"))
    with pytest.raises(KoalaError, match="nccl needs CUDA.*use --distributed-backend gloo"):
        ex.distributed_setup("nccl", False, 0, 2, 0)
    # CUDA: nccl by default, one GPU per rank; gloo puts both ranks of a one-GPU machine on cuda:0
    assert ex.distributed_setup(None, True, 1, 2, 2) == ("nccl", ex.torch.device("cuda", 1))
    assert ex.distributed_setup("gloo", True, 1, 2, 1) == ("gloo", ex.torch.device("cuda", 0))
    assert ex.distributed_setup("gloo", True, 3, 4, 2) == ("gloo", ex.torch.device("cuda", 1))
    with pytest.raises(KoalaError, match="one GPU per rank: 2 ranks on this node, 1 GPU"):
        ex.distributed_setup(None, True, 1, 2, 1)


def test_megatron_core_schedules_refuse_gloo_with_cuda_tensors():
    from koala_ds.core.ir import KoalaError

    ex = example_module()
    cuda, cpu = ex.torch.device("cuda", 0), ex.torch.device("cpu")
    ex.check_pipeline_backend(True, 2, cuda, "gloo")  # the Koala runtime stages through the CPU
    ex.check_pipeline_backend(False, 2, cuda, "nccl")
    ex.check_pipeline_backend(False, 1, cuda, "gloo")  # no pipeline, nothing sent
    with pytest.raises(KoalaError, match="--distributed-backend gloo use --pipeline-schedule koala"):
        ex.check_pipeline_backend(False, 2, cuda, "gloo")
    with pytest.raises(KoalaError, match="on CPU use --pipeline-schedule koala"):
        ex.check_pipeline_backend(False, 2, cpu, "gloo")
    ex.check_pipeline_backend(True, 1, cpu, "gloo")
    # forward_backward_no_pipelining makes its token count on CUDA: a traceback on CPU at p = 1
    with pytest.raises(KoalaError, match=r"at --pipeline-model-parallel-size 1 forward_backward_no_pipelining\); "
                                         r"on CPU use --pipeline-schedule koala"):
        ex.check_pipeline_backend(False, 1, cpu, "gloo")


def run(tmp_path: Path, schedule: str, extra: list[str]) -> dict:
    log = tmp_path / f"losses_{Path(schedule).name}"
    # --standalone: the launcher binds a port the system picks
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(ROOT / "examples/megatron_gpt/pretrain_gpt.py"), *FLAGS, *extra, "--koala-schedule", schedule,
           "--loss-log", str(log)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "iteration        6/       6 |" in proc.stdout + proc.stderr
    data = json.loads(log.read_text())
    assert data["schedule"] == schedule
    data["stdout"] = proc.stdout
    return data


def step_spans(files) -> dict[int, list[tuple[float, float]]]:
    """Per step number, each rank's (start, end) of its runtime's `step` event (µs, one clock)."""
    spans: dict[int, list[tuple[float, float]]] = {}
    for path in files:
        for ev in json.loads(Path(path).read_text()):
            if ev.get("name") == "step" and ev.get("ph") == "X":
                spans.setdefault(ev["args"]["step"], []).append((ev["ts"], ev["ts"] + ev["dur"]))
    return spans


@pytest.mark.slow  # multi-process
@pytest.mark.timeout(900)
def test_same_loss_whichever_schedule_and_it_goes_down(tmp_path, _megatron_core):
    # the README's model size: with these the hold policy keeps output_layer on the last stage
    size = ["--hidden-size", "64", "--seq-length", "32", "--global-batch-size", "16"]
    base = run(tmp_path, "1f1b", size)
    assert len(base["losses"]) == 6 and base["losses"][-1] < base["losses"][0]
    assert base["backend"] == "gloo" and base["device"] == "cpu"  # the default without CUDA
    assert len(base["iteration_ms"]) == 6 and all(t > 0 for t in base["iteration_ms"])
    gloo = ["--distributed-backend", "gloo"]
    # split schedules too: their deferred weight gradients equal a full backward's (a weight
    # gradient lost in W once moved these losses by 4e-5 relative after one step)
    for schedule, extra in (("zb-h1", gloo), ("zb-v", ["--virtual-pipeline-model-parallel-size", "2", *gloo])):
        other = run(tmp_path, schedule, [*size, *extra])
        assert other["backend"] == "gloo"
        assert other["losses"] == pytest.approx(base["losses"], rel=1e-6), schedule
    # two schedules taking turns on one model (--alternate-schedules): the same losses, each
    # iteration logged with the schedule that ran it
    # (traced: a trace per schedule, t.json and t.zb-h1.json, their steps numbered together)
    trace = tmp_path / "traces" / "t.json"
    trace.parent.mkdir()
    turns = run(tmp_path, "1f1b", [*size, *gloo, "--alternate-schedules", "zb-h1", "--koala-trace", str(trace)])
    assert turns["iteration_schedules"] == ["1f1b", "1f1b", "zb-h1", "zb-h1", "1f1b", "1f1b"]
    assert turns["losses"] == pytest.approx(base["losses"], rel=1e-6)
    assert sorted(p.name for p in trace.parent.iterdir()) == ["t.rank0.json", "t.rank1.json", "t.zb-h1.rank0.json",
                                                              "t.zb-h1.rank1.json"]
    from koala_ds.sim.measured import load_runs

    mine, theirs = load_runs([str(trace), str(trace.parent / "t.zb-h1.json")])
    assert (mine.schedule.name, theirs.schedule.name) == ("1f1b", "zb-h1")
    # a turn's first step (2, 4) follows the other schedule's: left out; 1's period ends at 2's start
    assert [s.number for s in mine.steps] == [1, 5] and [s.number for s in theirs.steps] == [3]
    assert mine.steps[0].period is not None and theirs.steps[0].period is not None
    # the run's end: each schedule's median step period over its counted iterations (here only
    # the sixth, 1f1b's: the first turn of each schedule is its warm-up, and a turn's first
    # iteration follows the other schedule)
    last = turns["stdout"].splitlines()[-1]
    assert last.startswith("schedules taking turns, median step period (iterations counted): 1f1b ")
    assert last.endswith(" ms (1, 1.000x of 1f1b's speed)") and "zb-h1" not in last
    assert "taking turns" not in base["stdout"]
    # another placement takes turns on a model copy of its own, built as the same model: 1f1b
    # and a V-shape v=2 schedule (fixed files keep their own v) alternating every iteration give
    # the same losses whichever of the two is --koala-schedule, and the copies' first iterations
    # start from the model 1f1b alone starts from
    from koala_ds.resolve import load_schedule

    files = tmp_path / "schedules"  # beside, not among, run()'s loss logs
    files.mkdir()
    for name, v in (("1f1b", 1), ("zb-v", 2)):
        (files / f"{name}.json").write_text(load_schedule(name, 2, 8, v).to_json())
    one = ["--alternate-block", "1", *size, *gloo]
    ab = run(tmp_path, "1f1b", [*one, "--alternate-schedules", str(files / "zb-v.json")])
    ba = run(tmp_path, str(files / "zb-v.json"), [*one, "--virtual-pipeline-model-parallel-size", "2",
                                                  "--alternate-schedules", str(files / "1f1b.json")])
    assert ab["iteration_schedules"] == ["1f1b", str(files / "zb-v.json")] * 3
    assert ab["losses"] == pytest.approx(ba["losses"], rel=1e-6)
    assert ab["losses"][0] == pytest.approx(base["losses"][0], rel=1e-6)
    assert ab["losses"][1] != pytest.approx(base["losses"][1], rel=1e-6)  # a fresh copy, not 1f1b's second step


@pytest.mark.slow  # multi-process
@pytest.mark.timeout(600)
def test_the_pipeline_ranks_meet_at_each_steps_end(tmp_path, _megatron_core):
    """As in Megatron-LM, whose optimizer step reduces the gradients' norm over the model-parallel
    group: no rank starts step n + 1 before every rank has ended step n. Here rank 0 defers all
    its weight gradients to the end of the step, well after rank 1's last action: without the
    reduction rank 1 started its next step while rank 0 was still running this one, so steps
    overlapped by an amount that depends on the schedule, which a model of one step at a time
    does not predict."""
    from koala_ds.core.ir import Action, Op, Placement, schedule_from_ranks

    m = 8
    late_w = [[Action(Op.F, 0, i) for i in range(m)] + [Action(Op.I, 0, i) for i in range(m)]
              + [Action(Op.W, 0, i) for i in range(m)],
              [a for i in range(m) for a in (Action(Op.F, 1, i), Action(Op.I, 1, i), Action(Op.W, 1, i))]]
    path = tmp_path / "late_w.json"
    path.write_text(schedule_from_ranks("late-w", Placement.named("linear", 2), m, late_w).to_json())
    trace = tmp_path / "traces" / "t.json"
    trace.parent.mkdir()
    run(tmp_path, str(path), ["--hidden-size", "256", "--seq-length", "64", "--global-batch-size", str(2 * m),
                              "--koala-trace", str(trace)])
    spans = step_spans(trace.parent.iterdir())
    assert sorted(spans) == list(range(6)) and all(len(s) == 2 for s in spans.values())
    for n in range(5):
        assert min(start for start, _ in spans[n + 1]) >= max(end for _, end in spans[n]), n


@pytest.mark.parametrize("flags, world, message", [
    (["--micro-batch-size", "0"], 2, "--micro-batch-size must be >= 1, got 0"),  # was a ZeroDivisionError
    (["--pipeline-model-parallel-size", "0"], 2, "--pipeline-model-parallel-size must be >= 1, got 0"),
    (["--virtual-pipeline-model-parallel-size", "-2"], 2, "--virtual-pipeline-model-parallel-size must be >= 1, got -2"),
    (["--pipeline-model-parallel-size", "3"], 2, "world size 2 is not a multiple of --tensor-model-parallel-size x "
                                                 "--pipeline-model-parallel-size = 3"),
    (["--global-batch-size", "3"], 1, "--global-batch-size 3 must be a multiple of --micro-batch-size x "
                                      "data-parallel size = 2 x 1"),
    (["--alternate-block", "2", "--alternate-settle", "2"], 2,
     "--alternate-settle 2 must be at least 1 and below --alternate-block 2: a turn keeps its iterations after the "
     "first 2"),
    (["--max-position-embeddings", "8", "--seq-length", "16"], 1,  # was an IndexError in the first forward
     "--max-position-embeddings 8 is below --seq-length 16: raise it, or drop it (it defaults to --seq-length)"),
])
def test_sizes_that_do_not_divide_are_one_user_error_naming_the_flag(flags, world, message):
    """They were SystemExit(text) (exit code 1: torchrun's failure table after it) or a
    ZeroDivisionError; a KoalaError is one line on rank 0 and exit code 2 on every rank (run_main)."""
    from koala_ds.core.ir import KoalaError

    ex = example_module()
    with pytest.raises(KoalaError) as info:
        ex.batch_split(ex.parse_args(flags), world)
    assert str(info.value) == message
    assert ex.batch_split(ex.parse_args([]), 2) == (2, 4)  # the defaults: 16 = 2 x 2 x 4


def test_alternate_schedules_take_turns_each_on_the_model_copy_of_its_placement(_megatron_core, tmp_path):
    """--alternate-schedules (benchmarks/fidelity.py's paired rounds): the schedules take turns
    every --alternate-block iterations; alternates placed alike share one model copy, another
    placement or v (a fixed schedule file keeps its own) gets its own. An unknown schedule, a
    trace, no Koala schedule, an explicit layout or a layer count another v cannot split: one
    line naming the flag."""
    from koala_ds.core.ir import KoalaError
    from koala_ds.resolve import load_schedule
    from koala_ds.megatron.launch import InstallReport

    ex = example_module()

    def turns(schedule, flags, v=1, recorder=None):
        args = ex.parse_args(flags)
        return ex.alternation(args, InstallReport(schedule, func=SimpleNamespace(recorder=recorder)), 2, 4, v), args

    assert [(t.name, t.func, t.v) for t in turns("1f1b", [])[0]] == [("1f1b", None, 1)]
    assert [(t.name, t.placement, t.stages(2, 1)) for t in turns(None, [], 2)[0]] == [("default", None, (1, 3))]
    got, args = turns("1f1b", ["--alternate-schedules", "zb-h1,gpipe", "--alternate-block", "3"])
    assert [t.name for t in got] == ["1f1b", "zb-h1", "gpipe"] and callable(got[1].func)
    assert [ex.turn_of(args, got, it).name for it in range(10)] == ["1f1b"] * 3 + ["zb-h1"] * 3 + \
        ["gpipe"] * 3 + ["1f1b"]
    assert {t.stages(2, 0) for t in got} == {(0,)}  # one placement: one model copy
    # --koala-trace: every alternate records into the installed function's recorder
    recorder = TraceRecorder(str(tmp_path / "t.json"), "megatron", "--koala-trace")
    got, _ = turns("1f1b", ["--alternate-schedules", "zb-h1,gpipe", "--koala-trace", "t.json"], recorder=recorder)
    assert [t.func.recorder for t in got[1:]] == [recorder, recorder]
    # another placement of the run's v: its own copy
    got, _ = turns("zb-v", ["--alternate-schedules", "interleaved-1f1b"], 2)
    assert [(t.v, t.stages(2, 0)) for t in got] == [(2, (0, 3)), (2, (0, 2))]
    # a fixed schedule file keeps its own v: a V-shape v=2 schedule beside 1f1b
    fixed = tmp_path / "zbv.json"
    fixed.write_text(load_schedule("zb-v", 2, 4, 2).to_json())
    got, _ = turns("1f1b", ["--alternate-schedules", str(fixed)])
    assert [(t.v, t.stages(2, 0), t.stages(2, 1)) for t in got] == [(1, (0,), (1,)), (2, (0, 3), (1, 2))]
    cases = [
        (None, ["--alternate-schedules", "zb-h1"], 1, "--alternate-schedules needs --pipeline-schedule koala"),
        ("1f1b", ["--alternate-schedules", "no-such-schedule"], 1, "--alternate-schedules: unknown schedule "
                                                                   "'no-such-schedule'"),
        ("1f1b", ["--alternate-schedules", "zb-v"], 1, "--alternate-schedules zb-v: schedule 'zb-v' needs v == 2"),
        ("1f1b", ["--alternate-schedules", str(fixed), "--pipeline-model-parallel-layout", "Et|tL"], 1,
         f"--alternate-schedules {fixed} has 2 model chunks per rank, --pipeline-model-parallel-layout 1: an "
         "alternate of another v needs the default layout (drop --pipeline-model-parallel-layout)"),
        ("1f1b", ["--alternate-schedules", str(fixed), "--num-layers", "6"], 1,
         f"--alternate-schedules {fixed} has 2 model chunks per rank: --num-layers 6 must be a multiple of PP x 2 = 4"),
    ]
    for schedule, flags, v, message in cases:
        with pytest.raises(KoalaError) as info:
            turns(schedule, flags, v)
        assert str(info.value).startswith(message) and "\n" not in str(info.value)
    with pytest.raises(KoalaError, match="--alternate-block must be >= 1, got 0"):
        ex.batch_split(ex.parse_args(["--alternate-block", "0"]), 2)
