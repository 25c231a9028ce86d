"""Train a small PipelineModule with a Koala schedule on DeepSpeed.

On CPU (gloo), two pipeline ranks:

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/deepspeed_pipe/train.py --schedule zb-h1
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/deepspeed_pipe/train.py --schedule zb-v \
        --chunks 2 --placement vshape
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 examples/deepspeed_pipe/train.py --pp 2 --schedule 1f1b  # x DP 2

With DeepSpeed's launcher patched (patches/deepspeed/), the schedule can come from the command
line instead, and the script needs no Koala import at all:

    deepspeed --num_gpus 2 --pipeline_schedule koala --koala_schedule zb-h1 examples/deepspeed_pipe/train.py

`--schedule` takes a library name (koala list), a .koala program or a schedule .json file.
`--loss-log FILE` writes rank 0's per-iteration losses and times (`iteration_ms`: train_batch,
which returns after the step's optimizer update; `period_ms`: from one step's start to the next's,
the loop's own work included, the step `koala calibrate` measures) as JSON, as
examples/megatron_gpt's flag does.
`--trace FILE` records the measured timeline of every training step (the DeepSpeed config's
"pipeline.koala.trace"): each process writes FILE.rank<global rank>.json (docs/deepspeed.md);
with --alternate-schedules each other schedule FILE.<its name>.rank<global rank>.json, every one a
run `koala calibrate` reads (it leaves out the first step of each turn).
`--alternate-schedules A[,B...]` (benchmarking) runs --schedule and these in turn, --alternate-block
steps each: on the one engine where placed as --schedule (KoalaPipelineEngine.set_koala_schedule;
docs/deepspeed.md), else on an engine and model copy of its own (a schedule file keeps its own
--chunks and --placement; a library name is compiled for --chunks).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule

from koala_ds.commands import positive_int
from koala_ds.core.errors import rank_zero_argument_errors, run_main
from koala_ds.core.ir import KoalaError, Placement
from koala_ds.core.outputs import atomic_write, check_output
from koala_ds.resolve import DEEPSPEED, Setting, check_fit, resolve
from koala_ds.runtime.trace_record import check_trace_path
from koala_ds.runtime.turns import check_settle, keeps_own_shape, summary, turn_index

#: How the schedule's messages name this script's flags (the engine's own messages name the
#: DeepSpeed config keys and the KoalaPipelineModule's arguments, which this script sets from them).
FLAGS = replace(DEEPSPEED, schedule="--schedule",
                p=Setting("--pp", "--pp is {value} (default: every process)",
                          "set --pp {value} (and start a multiple of {value} processes)"),
                m=Setting("--microbatches"),
                v=Setting("--chunks"),
                placement_fix="use --chunks {v} --placement {style}")


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return torch.relu(self.linear(x)) + x


#: Rows of one microbatch.
MICRO_BATCH = 4
#: PipelineModule(seed_layers=...): DeepSpeed reseeds Python's, numpy's and torch's generators
#: before every layer of every forward (on the CPU about 0.3-0.5 ms a layer here, more than the
#: layers' compute: torch records the Python stack for each device it defers the seed to), so
#: a profile of these layers needs `koala profile deepspeed --seed-layers` (docs/profiling.md).
SEED_LAYERS = True


def build_layers(dim: int = 64) -> list:
    """The model's layer list: 8 residual blocks and a linear head."""
    return [LayerSpec(Block, dim) for _ in range(8)] + [LayerSpec(torch.nn.Linear, dim, 1)]


def sample_input(dim: int = 64) -> torch.Tensor:
    """One microbatch's input, as the training loop feeds it."""
    return torch.randn(MICRO_BATCH, dim)


def layers() -> list:
    """The layer list at the default --dim: `koala profile deepspeed --layers train:layers --input
    train:sample --partition-method uniform --seed-layers -p 2 -o prof.json`, run with this folder
    on PYTHONPATH (docs/profiling.md; --seed-layers: main() builds the PipelineModule with
    seed_layers=SEED_LAYERS); another --dim: a module of your own returning build_layers(dim)."""
    return build_layers()


def sample() -> torch.Tensor:
    """One microbatch's input at the default --dim (for `koala profile deepspeed --input`)."""
    return sample_input()


def check_flags(args, world: int) -> int:
    """The pipeline size, after checking the flags against each other and the schedule (one line
    naming the flag, before DeepSpeed starts)."""
    pp = args.pp or world
    if world % pp:
        raise KoalaError(f"--pp {pp} does not divide the {world} processes (pipeline x data parallel)")
    if args.schedule is not None:
        placement = Placement.named("linear" if args.chunks == 1 else args.placement, pp, args.chunks)
        resolve(args.schedule, pp, args.microbatches, args.chunks, FLAGS, placement=placement)
    elif args.chunks > 1 and not os.environ.get("KOALA_SCHEDULE"):  # the engine's default, 1f1b, has one chunk
        example = "zb-v" if args.placement == "vshape" else "interleaved-1f1b"
        raise KoalaError(f"--chunks {args.chunks} needs --schedule: a schedule of {args.chunks} chunks per rank "
                         f"(e.g. --schedule {example} for --placement {args.placement})")
    if args.trace is not None:
        if args.schedule is None and os.environ.get("DS_PIPELINE_SCHEDULE") != "koala":
            raise KoalaError("--trace needs --schedule: only the Koala engine records a trace")
        check_trace_path(args.trace, "--trace")
    if args.loss_log is not None:
        check_output(args.loss_log, "--loss-log")
    check_settle(args.alternate_block, args.alternate_settle)
    return pp


def shapes(args, pp: int) -> dict[str, tuple[int, str]]:
    """Per schedule taking turns (--schedule first), the (chunks, placement) of the model it runs
    on: --chunks / --placement for --schedule; an alternate's own placement (a library schedule
    compiled for --chunks, a fixed schedule file as made: keeps_own_shape), on an engine and model
    copy of its own where it differs. One line for --alternate-schedules without --schedule or
    with a schedule that does not fit."""
    own = (args.chunks, "linear" if args.chunks == 1 else args.placement)
    out = {args.schedule: own}
    if args.alternate_schedules is None:
        return out
    if args.schedule is None:
        raise KoalaError("--alternate-schedules needs --schedule (the Koala engine's first schedule)")
    words = replace(FLAGS, schedule="--alternate-schedules")
    for spec in args.alternate_schedules.split(","):
        schedule = resolve(spec, pp, args.microbatches, None if keeps_own_shape(spec) else args.chunks, words)
        v, style = schedule.placement.v, schedule.placement.style
        out[spec] = (v, style)
        # the module build_engine makes for it must hold its stages as it places them
        check_fit(schedule, pp, args.microbatches, v, words, f"--alternate-schedules {spec}",
                  Placement.named(style, pp, v))
    return out


def turns(args) -> list:
    """The schedules taking turns, --schedule first (one without --alternate-schedules)."""
    return [args.schedule, *(args.alternate_schedules.split(",") if args.alternate_schedules else [])]


def build_engine(args, pp: int, world: int, chunks: int, placement: str, schedule, trace=None):
    """A DeepSpeed engine of `schedule` (None: the launcher's) over a model of `chunks` per rank
    placed as `placement`; every call builds the same layers (torch.manual_seed(0))."""
    torch.manual_seed(0)
    layers = build_layers(args.dim)
    common = dict(num_stages=pp, loss_fn=torch.nn.functional.mse_loss, partition_method="uniform",
                  seed_layers=SEED_LAYERS)
    if chunks > 1:
        from koala_ds.deepspeed import KoalaPipelineModule  # also registers the Koala engine

        model = KoalaPipelineModule(layers, chunks=chunks, placement=placement, **common)
    else:
        model = PipelineModule(layers, **common)
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": args.microbatches,
        "train_batch_size": MICRO_BATCH * args.microbatches * (world // pp),
        "steps_per_print": 10 ** 9,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "pipeline": {"pipe_partitioned": False, "grad_partitioned": False},
    }
    if schedule is not None:
        import koala_ds.deepspeed  # noqa: F401  (registers the engine with deepspeed.initialize)

        config["pipeline"].update({"schedule": "koala", "koala": {"schedule": schedule}})
    if trace is not None:
        config["pipeline"].setdefault("koala", {})["trace"] = trace
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()], config=config)
    return engine


def train(engines: dict, data: list, args, samples: int) -> tuple[list, list, list, list]:
    """The training loop: per step its loss, train_batch's ms, the ms from its start to the next
    step's, and the schedule that ran it (--alternate-schedules: every --alternate-block steps the
    next schedule's engine, `engines[schedule]`, set_koala_schedule to it)."""
    names = turns(args)
    times, losses, starts, ran = [], [], [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        starts.append(t0)
        turn = names[turn_index(step, len(names), args.alternate_block)]
        engine = engines[turn]
        if len(names) > 1 and step % args.alternate_block == 0:
            engine.set_koala_schedule(turn)
        ran.append(turn if len(names) > 1 else getattr(getattr(engine, "koala_schedule", None), "name", "stock"))
        loss = engine.train_batch(iter(data))  # returns after the step's optimizer update
        ms = (time.perf_counter() - t0) * 1000
        times.append(ms)
        losses.append(float(loss))
        if engine.global_rank == 0:
            print(f"step {step}: loss {float(loss):.5f}, {ms:.1f} ms per iteration, {samples / ms * 1000:.1f} "
                  f"samples/s ({type(engine).__name__}, schedule {ran[-1]})", flush=True)
    starts.append(time.perf_counter())
    periods = [(b - a) * 1000 for a, b in zip(starts, starts[1:])]
    if len(names) > 1 and engine.global_rank == 0:  # the first turn of each schedule is its warm-up
        print(summary(periods, ran, len(names) * args.alternate_block, args.alternate_block, args.alternate_settle),
              flush=True)
    return losses, times, periods, ran


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default=None, help="Koala schedule: name, .koala or .json (default: launcher's)")
    parser.add_argument("--pp", type=positive_int, default=None, help="pipeline ranks (default: all processes)")
    parser.add_argument("--chunks", type=positive_int, default=1, help="model chunks per rank (2 for zb-v, dualpipe-v, ...)")
    parser.add_argument("--placement", default="interleaved", choices=["interleaved", "vshape"])
    parser.add_argument("--steps", type=positive_int, default=5)
    parser.add_argument("--microbatches", type=positive_int, default=8)
    parser.add_argument("--dim", type=positive_int, default=64)
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help='record each training step\'s timeline: FILE.rank<global rank>.json per process '
                             '(sets "pipeline.koala.trace"; needs a Koala schedule)')
    parser.add_argument("--loss-log", default=None, metavar="FILE",
                        help="write rank 0's per-iteration losses and times (iteration_ms) as JSON")
    parser.add_argument("--alternate-schedules", default=None, metavar="NAME|FILE[,...]",
                        help="benchmarking: also run these Koala schedules, taking turns with --schedule every "
                             "--alternate-block steps in this one run, so that the machine's drift hits them alike "
                             "(another placement, as a schedule file keeps its own, on an engine and model copy of its "
                             "own; the loss log names each step's schedule; at the end each "
                             "schedule's median step period, its first turn and the first --alternate-settle steps of "
                             "every turn left out; with --trace each schedule writes its own trace, "
                             "FILE.<its name>.rank<g>.json beside --schedule's)")
    parser.add_argument("--alternate-block", type=positive_int, default=2, metavar="N",
                        help="steps of a schedule before the next takes its turn (default 2)")
    parser.add_argument("--alternate-settle", type=positive_int, default=1, metavar="N",
                        help="steps at the start of every turn left out of the end's medians (default 1; 2 with "
                             "--alternate-block 4 where schedules run on model copies of their own)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by `deepspeed`
    args = rank_zero_argument_errors(parser).parse_args()  # a bad flag: one line on rank 0

    world = int(os.environ.get("WORLD_SIZE", "1"))
    pp = check_flags(args, world)
    shape = shapes(args, pp)
    deepspeed.init_distributed(dist_backend="gloo" if os.environ.get("DS_ACCELERATOR") == "cpu" else None)
    engine = build_engine(args, pp, world, *shape[args.schedule], args.schedule, args.trace)
    copies = {shape[args.schedule]: engine}  # one engine and model copy per (chunks, placement)
    for spec in turns(args)[1:]:
        if shape[spec] not in copies:
            copies[shape[spec]] = build_engine(args, pp, world, *shape[spec], spec)
            if args.trace is not None:  # one recorder: a run per schedule (FILE.<name>), steps numbered together
                copies[shape[spec]].record_into(engine.koala_recorder)
    samples = MICRO_BATCH * args.microbatches * (world // pp)

    gen = torch.Generator().manual_seed(1 + engine.grid.data_parallel_id)
    data = [(torch.randn(MICRO_BATCH, args.dim, generator=gen), torch.randn(MICRO_BATCH, 1, generator=gen))
            for _ in range(args.microbatches)]
    name = getattr(getattr(engine, "koala_schedule", None), "name", "stock")  # --schedule's, or the stock one
    losses, times, periods, ran = train({spec: copies[shape[spec]] for spec in turns(args)}, data, args, samples)
    eval_loss = engine.eval_batch(iter(data))
    if engine.global_rank == 0:
        print(f"eval loss {float(eval_loss):.5f}", flush=True)
        if args.loss_log is not None:
            record = {"schedule": name, "pp": pp, "dp": world // pp, "chunks": args.chunks, "placement": args.placement,
                      "dim": args.dim, "microbatches": args.microbatches, "losses": losses, "iteration_ms": times,
                      "period_ms": periods, "iteration_schedules": ran}
            atomic_write(args.loss_log, json.dumps(record) + "\n", "--loss-log")
    if hasattr(engine, "close_trace"):  # --trace: end the trace file (else done at exit)
        engine.close_trace()
    # Only on success: after an error the other ranks may still be inside a collective.
    deepspeed.comm.destroy_process_group()
    # Let gloo's worker threads drop the last collectives' tensors (which takes the GIL) before
    # the interpreter finalizes, or a rank may abort at exit: "terminate called without an active
    # exception" (docs/deepspeed.md, "Ending a run"). Importing koala_ds.deepspeed also does it at
    # exit; DeepSpeed's own engine needs the call.
    from koala_ds.deepspeed import wait_for_gloo_workers

    wait_for_gloo_workers()


if __name__ == "__main__":
    run_main(main, "train.py")  # a KoalaError: one line on rank 0, exit code 2 on every rank
