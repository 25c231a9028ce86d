"""koala_ds.torch: Koala schedules on torch.distributed.pipelining's own runtime.

The multi-process tests (marked slow) run each schedule and torch's own schedule class on the
same stages (gloo, CPU) and compare every microbatch's loss and every parameter's gradient;
one launch per pipeline size runs all its schedules, the refusals included."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from koala_ds import library
from koala_ds.resolve import load_schedule
from koala_ds.core.ir import KoalaError
from koala_ds.resolve import TORCH, ScheduleFitError, resolve
from script_modules import load_script

ROOT = Path(__file__).resolve().parents[1]
DIM, MB_SIZE = 8, 2

#: Koala schedule -> torch's own class of the same order (and its chunks per rank).
TORCH_CLASSES = {"1f1b": ("Schedule1F1B", 1), "gpipe": ("ScheduleGPipe", 1),
                 "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
                 "looped-bfs": ("ScheduleLoopedBFS", 2), "zb-h1": ("ScheduleInterleavedZeroBubble", 1),
                 "zb-v": ("ScheduleZBVZeroBubble", 2), "dualpipe-v": ("ScheduleDualPipeV", 2)}
V_CLASSES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


# -- the ranks' side (koala_ds.runtime.spawn imports this module in each rank) -----------------------
def _stage_module(index: int):
    import torch

    torch.manual_seed(1000 + index)  # the same weights for a stage whichever rank builds it
    return torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh())


def _torch_stage_indices(class_name: str, rank: int, p: int, v: int) -> tuple[int, ...]:
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    mapping = generate_stage_to_rank_mapping(p, p * v, "v" if class_name in V_CLASSES else "loop")
    return tuple(sorted(s for s, r in mapping.items() if r == rank))


def _one_step(rank: int, p: int, m: int, indices, build) -> dict:
    """Build this rank's stages, run one step of the schedule `build(stages)` makes; the last
    stage's microbatch losses and every local parameter's gradient, by stage."""
    import torch
    from torch.distributed.pipelining import PipelineStage

    n = p * max(1, len(indices))
    modules = {i: _stage_module(i) for i in indices}
    stages = [PipelineStage(modules[i], i, n, torch.device("cpu")) for i in indices]
    pipe = build(stages)
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(m * MB_SIZE, DIM, generator=gen), torch.randn(m * MB_SIZE, DIM, generator=gen)
    losses: list = []
    pipe.step(*((x,) if 0 in indices else ()), target=y if n - 1 in indices else None, losses=losses)
    return {"losses": [float(v.detach()) for v in losses] if n - 1 in indices else None,
            "grads": {i: [q.grad.clone() for q in modules[i].parameters()] for i in indices},
            "class": type(pipe).__name__}


def _koala_run(rank: int, p: int, m: int, spec, v: int, own_loop: bool = True) -> dict:
    import torch

    from koala_ds.torch import schedule, stage_indices

    indices = stage_indices(spec, rank, p, m, v)
    return _one_step(rank, p, m, indices, lambda stages: schedule(stages, m, torch.nn.functional.mse_loss, spec,
                                                                  own_loop=own_loop))


def _torch_run(rank: int, p: int, m: int, class_name: str, v: int) -> dict:
    import torch
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, class_name)
    single = issubclass(cls, schedules.PipelineScheduleSingle)
    return _one_step(rank, p, m, _torch_stage_indices(class_name, rank, p, v),
                     lambda stages: cls(stages[0] if single else stages, m, loss_fn=torch.nn.functional.mse_loss))


def _csv_run(rank: int, p: int, m: int, path: str, v: int) -> dict:
    """The exported CSV as torch reads it: `_PipelineScheduleRuntime._load_csv` (what torchtitan
    does with --parallelism.pipeline_parallel_schedule_csv)."""
    import torch
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from koala_ds.core.ir import Schedule

    placement = Schedule.from_torch_csv(Path(path).read_text()).placement

    def build(stages):
        pipe = _PipelineScheduleRuntime(stages, m, loss_fn=torch.nn.functional.mse_loss)
        pipe._load_csv(path)
        return pipe

    return _one_step(rank, p, m, placement.stages_of(rank), build)


def _refusal(rank: int, p: int, m: int, case: dict) -> str:
    """The one-line message `schedule()` refuses `case` with (stages built at `case['indices']`)."""
    import torch
    from torch.distributed.pipelining import PipelineStage

    from koala_ds.torch import schedule

    indices = case["indices"][rank]
    wrap = torch.compile if case.get("compile") else (lambda module: module)
    stages = [PipelineStage(wrap(_stage_module(i)), i, p * len(indices), torch.device("cpu")) for i in indices]
    try:
        schedule(stages, m, torch.nn.functional.mse_loss, case["spec"])
    except KoalaError as exc:
        return str(exc)
    return "not refused"


RUNS = {"torch": _torch_run, "csv": _csv_run}


def compare_worker(rank: int, world: int, spec: dict) -> dict:
    """Each case's runs ({"koala": spec, "torch": class name, "csv": path}, one step each on
    fresh stages) and each refusal's message, on this rank."""
    m = spec["m"]
    runs = {}
    for label, case in spec["cases"].items():
        runs[label] = {kind: RUNS[kind](rank, world, m, case[kind], case["v"]) for kind in ("torch", "csv")
                       if kind in case}
        runs[label]["koala"] = _koala_run(rank, world, m, case["koala"], case["v"], case.get("own_loop", True))
    return {"runs": runs, "refusals": {label: _refusal(rank, world, m, case)
                                       for label, case in spec.get("refusals", {}).items()}}


def torchtitan_worker(rank: int, world: int, spec: dict) -> dict:
    """Each exported CSV as torchtitan 0.3.0 runs it: the stages its schedule flag places on
    this rank, and the schedule its `_build_pipeline_schedule` makes from
    --parallelism.pipeline_parallel_schedule(_csv); one step, next to the adapter's."""
    import torch
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import pipeline_parallel as titan

    m, out = spec["m"], {}
    for name, case in spec["cases"].items():
        n = world * case["v"]
        indices = titan._get_pp_rank_to_stage_indices_mapping(rank, world, case["flag"], n)
        config = ParallelismConfig(pipeline_parallel_degree=world, pipeline_parallel_schedule=case["flag"],
                                   pipeline_parallel_schedule_csv=case["csv"],
                                   pipeline_parallel_microbatch_size=MB_SIZE)

        def build(stages):
            return titan._build_pipeline_schedule(
                parallelism=config, local_batch_size=m * MB_SIZE, stages=stages,
                loss_fn=lambda output, target: (torch.nn.functional.mse_loss(output, target), None))

        out[name] = {"indices": tuple(indices), "titan": _one_step(rank, world, m, tuple(indices), build),
                     "koala": _koala_run(rank, world, m, name, case["v"])}
    return out


# -- the tests' side ------------------------------------------------------------------------
def _searched(tmp_path: Path, profile: str, p: int, m: int, extra=()) -> str:
    """A schedule `koala search` finds (2 chunks per rank), saved as a .koala file (--min-gain 0:
    the search's own order, not a predefined schedule kept by the default)."""
    from koala_ds.cli import main

    out = tmp_path / f"searched-{profile}-p{p}.koala"
    code = main(["search", "--profile", profile, "-p", str(p), "-v", "2", "-m", str(m), "--time-budget", "2",
                 "--seed", "0", "--min-gain", "0", "--quiet", "-o", str(out), *extra])  # the search's own order
    assert code in (0, None) and out.exists()
    return str(out)


def _torch_class_for(schedule) -> str:
    """torch's own schedule class with `schedule`'s placement (its order may differ)."""
    if schedule.placement.style == "vshape":
        return "ScheduleZBVZeroBubble"
    return "Schedule1F1B" if schedule.v == 1 else "ScheduleInterleaved1F1B"


def _cases(tmp_path: Path, p: int, m: int, searched: str, others: bool = False) -> dict:
    """Every schedule torch ships, run by the adapter, by torch's class and from the exported
    CSV; the searched file (and, with `others`, every other library schedule of one pipeline)
    against torch's class of its placement."""
    names = {name: TORCH_CLASSES.get(name, (None, None)) for name in
             (library.names() if others else TORCH_CLASSES)}
    cases = {}
    for name, (class_name, v) in names.items():
        schedule = resolve(name, p, m, v, TORCH) if v else _fitting(name, p, m)
        if schedule is None or schedule.placement.pipelines != 1:
            continue
        csv = tmp_path / f"{name}-p{p}.csv"
        csv.write_text(schedule.to_torch_csv())
        cases[name] = {"koala": name, "torch": class_name or _torch_class_for(schedule), "csv": str(csv),
                       "v": schedule.v}
    cases["searched"] = {"koala": searched, "v": 2, "torch": _torch_class_for(resolve(searched, p, m, 2, TORCH))}
    for name in ("1f1b", "gpipe"):  # the orders torch has its own loops for, on the general runtime too
        cases[f"{name}-runtime"] = {"koala": name, "v": 1, "torch": TORCH_CLASSES[name][0], "own_loop": False}
    return cases


def _fitting(name: str, p: int, m: int):
    """The library schedule `name` at (p, m) with the fewest chunks per rank it supports (None: none)."""
    for v in (1, 2):
        try:
            return resolve(name, p, m, v, TORCH)
        except KoalaError:
            continue
    return None


def _launch(world: int, spec: dict) -> list[dict]:
    from koala_ds.runtime.spawn import launch

    from rank_processes import PRELOAD

    return [r["value"] for r in launch(compare_worker, world, spec, timeout_s=400, preload=PRELOAD)]


def _merged(results: list[dict], label: str, kind: str) -> tuple[list[float], dict]:
    """One run's losses (from the rank with the last stage) and gradients of every stage."""
    losses = [r["runs"][label][kind]["losses"] for r in results if r["runs"][label][kind]["losses"] is not None]
    assert len(losses) == 1, (label, kind)
    return losses[0], {s: g for r in results for s, g in r["runs"][label][kind]["grads"].items()}


def _assert_same_run(results: list[dict], label: str, kind: str, exact: bool) -> None:
    ours, ours_grads = _merged(results, label, "koala")
    theirs, their_grads = _merged(results, label, kind)
    assert len(ours) == len(theirs) and ours == pytest.approx(theirs, rel=0 if exact else 1e-6, abs=0), (label, kind)
    assert sorted(ours_grads) == sorted(their_grads) == list(range(len(their_grads))), (label, kind)
    for stage, grads in ours_grads.items():
        for a, b in zip(grads, their_grads[stage], strict=True):
            diff = (a - b).abs().max().item()
            assert diff <= (0 if exact else 1e-6 * max(1.0, b.abs().max().item())), (label, kind, stage, diff)


def _assert_every_schedule_equals_torch(results: list[dict], cases: dict) -> None:
    for label, case in cases.items():
        # a schedule torch ships runs torch's own order: the same arithmetic, bit for bit; the
        # others run another order, so their gradients add up in another order
        _assert_same_run(results, label, "torch", exact=label.removesuffix("-runtime") in TORCH_CLASSES)
        if "csv" in case:
            _assert_same_run(results, label, "csv", exact=True)
        # GPipe's and 1F1B's orders run on torch's own loops for them, the rest on its runtime
        own = label in ("1f1b", "gpipe")
        assert {r["runs"][label]["koala"]["class"] for r in results} == \
            {TORCH_CLASSES[label][0] if own else "KoalaPipelineSchedule"}, label


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_two_ranks_every_schedule_equals_torch_and_refusals(tmp_path):
    p, m = 2, 4
    searched = _searched(tmp_path, "uniform-4", p, m, ["--memory-limit", "300"])  # split, not a library order
    fixed = tmp_path / "zb-h1-m8.json"
    fixed.write_text(resolve("zb-h1", p, 8, 1, TORCH).to_json())
    refusals = {
        "placement": {"spec": "zb-v", "indices": [(0, 2), (1, 3)]},  # built interleaved, zb-v is a V
        "chimera": {"spec": "chimera", "indices": [(0,), (1,)]},
        "chunks": {"spec": "zb-v", "indices": [(0,), (1,)]},
        "microbatches": {"spec": str(fixed), "indices": [(0,), (1,)]},
        "compiled": {"spec": "zb-h1", "indices": [(0,), (1,)], "compile": True},  # torch's I / W split cannot
    }
    cases = _cases(tmp_path, p, m, searched, others=True)
    assert len(cases) == len(library.names()) - 1 + 3  # all but chimera (refused below), searched, 2 on the runtime
    results = _launch(p, {"m": m, "cases": cases, "refusals": refusals})
    _assert_every_schedule_equals_torch(results, cases)
    said = {label: {r["refusals"][label] for r in results} for label in refusals}
    assert all("\n" not in text for texts in said.values() for text in texts)
    assert said["placement"] == {
        f"koala_ds.torch.schedule's spec zb-v places stage(s) {want} on rank {r} (vshape placement), but this rank's "
        f"PipelineStage objects have stage_index {have}: build rank {r}'s PipelineStage(s) with stage_index {want}"
        for r, want, have in ((0, "0, 3", "0, 2"), (1, "1, 2", "1, 3"))}
    assert said["chimera"] == {"koala_ds.torch.schedule's spec chimera runs 2 pipelines (placement bidirectional): "
                               "each rank would hold a second, separately updated model replica, which "
                               "torch.distributed.pipelining cannot host. Use a single-pipeline schedule (e.g. zb-v "
                               "or dualpipe-v)."}
    (chunks,) = said["chunks"]
    assert "change the number of PipelineStage objects per rank" in chunks and "v == 2" in chunks
    assert said["compiled"] == {"koala_ds.torch.schedule's spec zb-h1: The split-backward zb-h1 schedule is not "
                                "supported with stage modules that have used torch.compile. Found OptimizedModule in "
                                "OptimizedModule (torch's I / W split); use a full-backward schedule (e.g. 1f1b or "
                                "interleaved-1f1b) or stages without torch.compile"}
    (microbatches,) = said["microbatches"]
    assert microbatches.endswith("was made for m=8 but n_microbatches is 4: pass n_microbatches=8, or use a "
                                 "schedule made for m=4")


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_four_ranks_equal_torchs_own_schedules(tmp_path):
    p, m = 4, 8
    cases = _cases(tmp_path, p, m, _searched(tmp_path, "gpt-chunks-8", p, m))
    _assert_every_schedule_equals_torch(_launch(p, {"m": m, "cases": cases}), cases)


# -- in one process: the CSV torch reads, the checks ----------------------------------------
@pytest.fixture(scope="module")
def torch_schedules():
    """torch.distributed.pipelining.schedules, imported (~1.4 s) when a test here runs, not at collection."""
    return pytest.importorskip("torch.distributed.pipelining.schedules")


ADAPTER_RUNS = [(name, p, m) for name in library.names() for p, m in ((1, 4), (2, 4), (3, 7), (4, 8))]


def test_exported_csv_is_what_torch_loads_and_lowers_for_every_schedule_the_adapter_runs(tmp_path, torch_schedules):
    """`koala export --format torch-csv` read as torch's `_load_csv` reads it (csv.reader +
    _Action.from_str) gives the adapter's actions; torch's validator infers the schedule's
    placement, and torch's lowering passes add one receive per send, on the right rank."""
    import csv

    from koala_ds.torch import torch_actions

    S = torch_schedules
    ran = set()
    for name, p, m in ADAPTER_RUNS:
        schedule = _fitting(name, p, m)
        if schedule is None or schedule.placement.pipelines != 1:
            continue
        ran.add(name)
        path = tmp_path / "s.csv"
        path.write_text(schedule.to_torch_csv())
        with open(path, newline="") as fh:
            order = {rank: [S._Action.from_str(c) for c in row] for rank, row in enumerate(csv.reader(fh))}
        assert order == torch_actions(schedule), (name, p, m)
        mapping = S._validate_schedule(order, p, schedule.num_stages, m)
        assert mapping == {s: schedule.placement.rank_of(s) for s in range(schedule.num_stages)}
        lowered = S._add_send_recv({r: S._add_reduce_grad(S._add_unshard_reshard(a), m) for r, a in order.items()},
                                   lambda s: mapping[s], schedule.num_stages)
        assert _comms(lowered) == _expected_comms(order, mapping, schedule.num_stages), (name, p, m)
    assert ran == set(library.names()) - {"chimera"}


def _comms(lowered) -> set:
    """(rank, type, stage, microbatch) of every send and receive torch's lowering added."""
    return {(r, a.computation_type.name, a.stage_index, a.microbatch_index) for r, actions in lowered.items()
            for a in actions if a.computation_type.name.startswith(("SEND", "RECV"))}


def _expected_comms(order, mapping, num_stages) -> set:
    """A forward's output goes to the next stage's rank, an input gradient (I or B) to the
    previous stage's, where that is another rank."""
    out = set()
    for r, actions in order.items():
        for a in actions:
            kind = a.computation_type.name
            to = a.stage_index + 1 if kind == "FORWARD" else a.stage_index - 1
            if kind in ("FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT") and 0 <= to < num_stages and mapping[to] != r:
                way = "F" if kind == "FORWARD" else "B"
                out |= {(r, f"SEND_{way}", a.stage_index, a.microbatch_index),
                        (mapping[to], f"RECV_{way}", to, a.microbatch_index)}
    return out


def test_two_pipelines_cannot_be_exported_for_torch():
    with pytest.raises(KoalaError, match="runs 2 pipelines .*torch.distributed.pipelining's CSV holds one"):
        load_schedule("chimera", 2, 4).to_torch_csv()


@pytest.mark.parametrize("spec, p, m, v, message", [
    ("chimera", 2, 4, 1, "koala_ds.torch.schedule's spec chimera runs 2 pipelines (placement bidirectional): each "
                         "rank would hold a second, separately updated model replica, which "
                         "torch.distributed.pipelining cannot host. Use a single-pipeline schedule"),
    ("zb-v", 2, 4, 1, "koala_ds.torch.schedule's spec zb-v: schedule 'zb-v' needs v == 2 "
                      "(koala_ds/library/zb-v.koala:10:10); got p=2, m=4, v=1: change the number of PipelineStage "
                      "objects per rank"),
    ("dualpipe-v", 2, 2, 2, "needs m >= 2 * p (koala_ds/library/dualpipe-v.koala:11:10); got p=2, m=2, v=2: change "
                            "the PipelineStage's group size or n_microbatches"),
    ("zb-vv", 2, 4, 1, "koala_ds.torch.schedule's spec: unknown schedule 'zb-vv' (did you mean 'zb-v'?)"),
])
def test_what_does_not_fit_names_torchs_own_settings(spec, p, m, v, message):
    with pytest.raises(ScheduleFitError) as info:
        resolve(spec, p, m, v, TORCH)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_fixed_file_for_other_microbatches_or_chunks(tmp_path):
    path = tmp_path / "zb-v.json"
    path.write_text(resolve("zb-v", 2, 8, 2, TORCH).to_json())
    with pytest.raises(ScheduleFitError, match=r"zb-v.json was made for m=8 but n_microbatches is 4: pass "
                                               r"n_microbatches=8, or use a schedule made for m=4"):
        resolve(str(path), 2, 4, 2, TORCH)
    with pytest.raises(ScheduleFitError, match=r"was made for v=2 but each rank holds 1 PipelineStage\(s\) "
                                               r"\(num_stages / group size\): build 2 PipelineStage\(s\) per rank"):
        resolve(str(path), 2, 8, 1, TORCH)


def test_stage_checks_say_which_stage_indices_to_build(torch_schedules):
    from koala_ds.torch.adapter import check_stages, chunks_per_rank

    zbv = resolve("zb-v", 4, 8, 2, TORCH)
    check_stages(zbv, 1, (1, 6), "zb-v")  # rank 1 of a V over 8 stages
    with pytest.raises(ScheduleFitError) as info:
        check_stages(zbv, 1, (1, 5), "zb-v")
    assert str(info.value) == ("zb-v places stage(s) 1, 6 on rank 1 (vshape placement), but this rank's "
                               "PipelineStage objects have stage_index 1, 5: build rank 1's PipelineStage(s) with "
                               "stage_index 1, 6")
    assert chunks_per_rank(4, 8, 2, 0) == 2
    with pytest.raises(ScheduleFitError, match="rank 3 holds 1 PipelineStage.* num_stages / group size = 8 / 4 = 2: "
                                               "build 2 stage"):
        chunks_per_rank(4, 8, 1, 3)
    with pytest.raises(ScheduleFitError, match="num_stages=6 is not a multiple of its process group's 4 ranks"):
        chunks_per_rank(4, 6, 1, 0)


@pytest.mark.parametrize("stages, message", [
    ([], "stages: expected this rank's PipelineStage objects (one, or a non-empty list), got []"),
    ("zb-v", "stages: expected this rank's PipelineStage objects (one, or a non-empty list), got 'zb-v'"),
    ([object()], "stages: expected torch.distributed.pipelining PipelineStage objects, got object"),
])
def test_what_is_not_a_stage_is_refused_in_one_line(torch_schedules, stages, message):
    from koala_ds.torch import schedule

    with pytest.raises(ScheduleFitError) as info:
        schedule(stages, 4, None, "1f1b")
    assert str(info.value) == message


def test_own_loops_only_for_the_orders_they_execute(torch_schedules):
    """GPipe's and 1F1B's orders (one stage per rank, full backward) go to torch's own loops for
    them; any other order, a split backward, 1F1B below its m >= p, or an option only the runtime
    takes stays on the runtime."""
    from koala_ds.torch.adapter import own_loop_class

    S = torch_schedules
    assert own_loop_class(resolve("1f1b", 4, 8, 1, TORCH), {}) is S.Schedule1F1B
    assert own_loop_class(resolve("1f1b", 4, 8, 1, TORCH), {"scale_grads": False}) is S.Schedule1F1B
    assert own_loop_class(resolve("gpipe", 3, 5, 1, TORCH), {}) is S.ScheduleGPipe
    assert own_loop_class(resolve("1f1b", 4, 3, 1, TORCH), {}) is None  # Schedule1F1B refuses m < p
    assert own_loop_class(resolve("1f1b", 4, 8, 1, TORCH), {"defer_pp_recv": True}) is None
    for name, v in (("eager-1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 1), ("interleaved-1f1b", 2)):
        assert own_loop_class(resolve(name, 4, 8, v, TORCH), {}) is None, name


def test_torchtitan_flag_for_each_placement(torch_schedules):
    """The --parallelism.pipeline_parallel_schedule whose stage placement is the schedule's (the
    multi-process test checks it against torchtitan's own mapping, where torchtitan is installed)."""
    from koala_ds.torch import torchtitan_schedule_name

    assert torchtitan_schedule_name(resolve("zb-h1", 4, 8, 1, TORCH)) == "1F1B"
    assert torchtitan_schedule_name(resolve("interleaved-1f1b", 4, 8, 2, TORCH)) == "PipelineScheduleMulti"
    assert torchtitan_schedule_name(resolve("looped-bfs", 4, 8, 3, TORCH)) == "PipelineScheduleMulti"
    assert torchtitan_schedule_name(resolve("dualpipe-v", 4, 8, 2, TORCH)) == "ZBVZeroBubble"
    with pytest.raises(ScheduleFitError, match=r"schedule 'hanayo' places its stages vshape with v=4: torchtitan "
                                               r"builds one stage per rank, stage s on rank s % p, or a V of 2"):
        torchtitan_schedule_name(resolve("hanayo", 2, 4, 4, TORCH))


# -- the example ----------------------------------------------------------------------------
EXAMPLE = ROOT / "examples" / "torch_pipelining" / "train.py"


def _example(tmp_path: Path, *flags: str) -> dict[int, float]:
    """examples/torch_pipelining/train.py on 2 processes (started as a launcher starts them, with
    no launcher process: one torch import less per run): every rank exits 0; the loss of each
    step, which the rank of the last stage prints."""
    import re

    from rank_processes import environment, run_ranks

    cmd = [sys.executable, str(EXAMPLE), "--steps", "3", "--microbatches", "8", *flags]
    ranks = run_ranks(cmd, 2, environment(ROOT, OMP_NUM_THREADS="1"), 240, tmp_path)
    assert [r.returncode for r in ranks] == [0, 0], (flags, [r.stderr[-2000:] for r in ranks])
    printed = "".join(r.stdout for r in ranks)
    losses = {int(step): float(loss) for step, loss in re.findall(r"^step (\d+): loss (\S+)", printed, re.M)}
    assert sorted(losses) == [0, 1, 2], (flags, printed)
    return losses


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_example_koala_schedules_train_as_torchs_1f1b(tmp_path):
    searched = _searched(tmp_path, "uniform-4", 2, 8, ["--memory-limit", "300"])
    reference = _example(tmp_path, "--schedule", "torch:Schedule1F1B")
    assert reference[2] < reference[0]  # it trains
    for flags in (["--schedule", "1f1b"], ["--schedule", "zb-h1"], ["--schedule", "zb-v", "--chunks", "2"],
                  ["--schedule", searched, "--chunks", "2"]):
        losses = _example(tmp_path, *flags)
        for step, loss in reference.items():
            assert losses[step] == pytest.approx(loss, rel=1e-5), (flags, step)
    # under koala-run (torchrun's launcher), a flag that does not fit is rank 0's one line, exit code 2
    bad = subprocess.run([sys.executable, "-m", "koala_ds.runtime.torchrun", "--nproc-per-node", "2", "--standalone",
                          str(EXAMPLE), "--schedule", "zb-v"], capture_output=True, text=True, timeout=240,
                         cwd=tmp_path)
    assert bad.returncode == 2, bad.stderr[-2000:]
    errors = [line for line in bad.stderr.splitlines() if "error" in line]
    assert errors == ["train.py: error: --schedule zb-v: schedule 'zb-v' needs v == 2 "
                      "(koala_ds/library/zb-v.koala:10:10); got p=2, m=8, v=1: change --chunks"]
    assert bad.stderr.splitlines()[-1] == errors[0] and bad.stdout == ""


@pytest.fixture(scope="module")
def example():
    """The example script as a module (registered: its dataclass needs its module)."""
    try:
        yield load_script(EXAMPLE, "torch_pipelining_train")
    finally:
        sys.modules.pop("torch_pipelining_train", None)


@pytest.mark.parametrize("flags, world, message", [
    (["--schedule", "zb-v"], 2, "--schedule zb-v: schedule 'zb-v' needs v == 2"),
    (["--schedule", "zb-v", "--chunks", "2", "--microbatches", "2"], 2, "needs m >= 2 * p"),
    (["--schedule", "chimera"], 2, "runs 2 pipelines (placement bidirectional)"),
    (["--schedule", "torch:ScheduleZBVZeroBubble"], 2, "runs 2 stage(s) per rank: use --chunks 2"),
    (["--schedule", "torch:Nope"], 2, "torch:Nope: not one of torch's schedule classes; use one of torch:Schedule"),
    (["--pp", "3"], 4, "--pp 3 does not divide the 4 processes"),
    (["--chunks", "2", "--schedule", "zb-v", "--layers", "3"], 2, "--layers 3 is fewer than the 4 stages"),
])
def test_example_flags_checked_before_any_process_group(example, flags, world, message):
    with pytest.raises(KoalaError) as info:
        example.plan(example.parse_args(flags), world)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchtitan_builds_and_runs_an_exported_schedule(tmp_path):
    """torchtitan 0.3.0 installs beside torch 2.13 (its own venv here: it brings ~50 packages);
    where it is importable, its pipeline builder runs the exported CSVs as the adapter does
    (torchtitan does not scale gradients by the microbatches: scale_grads=False)."""
    pytest.importorskip("torchtitan.distributed.pipeline_parallel",
                        reason="torchtitan is not installed (pip install torchtitan==0.3.0)")
    from koala_ds.runtime.spawn import launch
    from koala_ds.torch import torchtitan_schedule_name

    from rank_processes import PRELOAD

    p, m, cases = 2, 4, {}
    for name, v in (("zb-h1", 1), ("interleaved-1f1b", 2), ("zb-v", 2), ("dualpipe-v", 2), ("v-half", 2)):
        schedule = resolve(name, p, m, v, TORCH)
        csv = tmp_path / f"{name}.csv"
        csv.write_text(schedule.to_torch_csv())
        cases[name] = {"v": v, "csv": str(csv), "flag": torchtitan_schedule_name(schedule),
                       "placement": [schedule.placement.stages_of(r) for r in range(p)]}
    results = [r["value"] for r in launch(torchtitan_worker, p, {"m": m, "cases": cases}, timeout_s=240,
                                          preload=PRELOAD)]
    for name, case in cases.items():
        assert [r[name]["indices"] for r in results] == case["placement"], name
        (ours,) = [r[name]["koala"]["losses"] for r in results if r[name]["koala"]["losses"] is not None]
        (theirs,) = [r[name]["titan"]["losses"] for r in results if r[name]["titan"]["losses"] is not None]
        assert ours == theirs, name
        for r in results:
            for stage, grads in r[name]["koala"]["grads"].items():
                for a, b in zip(grads, r[name]["titan"]["grads"][stage], strict=True):
                    assert (a * m - b).abs().max().item() <= 1e-6 * max(1.0, b.abs().max().item()), (name, stage)

