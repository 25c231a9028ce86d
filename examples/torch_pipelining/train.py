"""Train a small model split into torch.distributed.pipelining PipelineStages with a Koala schedule.

On CPU (gloo), two pipeline ranks:

    torchrun --nproc-per-node 2 examples/torch_pipelining/train.py --schedule zb-h1
    torchrun --nproc-per-node 2 examples/torch_pipelining/train.py --schedule zb-v --chunks 2
    torchrun --nproc-per-node 2 examples/torch_pipelining/train.py --schedule best.koala --chunks 2
    torchrun --nproc-per-node 2 examples/torch_pipelining/train.py --schedule torch:Schedule1F1B  # torch's own

`--schedule` takes a library name (koala list), a .koala program, a .json or torch .csv schedule
file, or `torch:ClassName`, one of torch's own schedule classes (the reference). With
`--chunks N` each rank holds N stages, placed as the schedule places them (V-shape for zb-v,
dualpipe-v, a searched V; else interleaved). `--pp` below the number of processes adds data
parallelism (gradients averaged over the replicas). The rank holding the last stage of
replica 0 prints `step N: loss X` (the mean of the step's microbatch losses). Each step ends
as torchtitan's do: the gradients are clipped by their global L2 norm, reduced over the
pipeline ranks (`--clip-grad`, default 1.0; 0: no clipping), so every rank ends a step before
any starts the next (koala_ds/runtime/grad_norm.py). Every wait is bounded by the process
group's timeout: KOALA_TIMEOUT_S seconds (default 600).
"""
from __future__ import annotations

import argparse
import datetime
import os
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, schedules

from koala_ds.commands import positive_int
from koala_ds.core.errors import rank_zero_argument_errors, run_main
from koala_ds.core.ir import KoalaError, Schedule
from koala_ds.resolve import TORCH, Setting, resolve
from koala_ds.runtime.grad_norm import clip_grad_norm
from koala_ds.runtime.timeout import resolve_timeout

#: How the schedule's messages name this script's flags.
FLAGS = replace(TORCH, schedule="--schedule",
                p=Setting("--pp", "--pp is {value} (default: every process)",
                          "set --pp {value} (and start a multiple of {value} processes)"),
                m=Setting("--microbatches"), v=Setting("--chunks"))
TORCH_PREFIX = "torch:"
#: torch's own schedule classes that --schedule torch:NAME takes, and those placed as a V.
TORCH_CLASSES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
                 "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
TORCH_V_CLASSES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


@dataclass(frozen=True)
class Plan:
    """What the flags ask for: the pipeline's size and which stages each pipeline rank builds."""

    pp: int
    stages: int  # in all: pp x chunks
    rank_stages: tuple[tuple[int, ...], ...]  # per pipeline rank, in stage order
    koala: Schedule | None  # None: torch's own class `torch_class`
    torch_class: str | None


def torch_plan(name: str, pp: int, chunks: int) -> tuple[tuple[int, ...], ...]:
    """The stages of each rank for torch's own class `name` (as torch's classes place them)."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    if name not in TORCH_CLASSES:
        raise KoalaError(f"--schedule {TORCH_PREFIX}{name}: not one of torch's schedule classes; use one of "
                         f"{', '.join(TORCH_PREFIX + c for c in TORCH_CLASSES)}")
    single = issubclass(getattr(schedules, name), schedules.PipelineScheduleSingle)
    need = 1 if single else 2 if name in TORCH_V_CLASSES else None
    if need is not None and chunks != need:
        raise KoalaError(f"--schedule {TORCH_PREFIX}{name} runs {need} stage(s) per rank: use --chunks {need}")
    mapping = generate_stage_to_rank_mapping(pp, pp * chunks, "v" if name in TORCH_V_CLASSES else "loop")
    return tuple(tuple(s for s in range(pp * chunks) if mapping[s] == r) for r in range(pp))


def plan(args, world: int) -> Plan:
    """Check the flags against each other and the schedule (one line naming the flag) before any
    process group exists."""
    pp = args.pp or world
    if world % pp:
        raise KoalaError(f"--pp {pp} does not divide the {world} processes (pipeline x data parallel)")
    stages = pp * args.chunks
    if args.layers < stages:
        raise KoalaError(f"--layers {args.layers} is fewer than the {stages} stages (--pp x --chunks = {pp} x "
                         f"{args.chunks}): use --layers {stages} or more")
    if args.schedule.startswith(TORCH_PREFIX):
        name = args.schedule[len(TORCH_PREFIX):]
        return Plan(pp, stages, torch_plan(name, pp, args.chunks), None, name)
    koala = resolve(args.schedule, pp, args.microbatches, args.chunks, FLAGS)
    return Plan(pp, stages, tuple(koala.placement.stages_of(r) for r in range(pp)), koala, None)


def build_model(layers: int, dim: int) -> list[torch.nn.Module]:
    """The whole model as a list of layers, the same on every rank: blocks, then a head."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.Tanh()) for _ in range(layers)]
    return blocks + [torch.nn.Linear(dim, 1)]


def stage_module(model: list[torch.nn.Module], stage: int, stages: int) -> torch.nn.Module:
    """Stage `stage` of `stages`: its share of the blocks (the head goes with the last)."""
    blocks = len(model) - 1
    lo, hi = stage * blocks // stages, (stage + 1) * blocks // stages
    return torch.nn.Sequential(*model[lo:hi], *(model[-1:] if stage == stages - 1 else []))


def init_process_group() -> None:
    timeout = datetime.timedelta(seconds=resolve_timeout())
    if "MASTER_ADDR" in os.environ:  # torchrun, koala-run
        dist.init_process_group("gloo", timeout=timeout)
    else:  # a plain `python train.py`: one process
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def groups(pp: int, world: int, rank: int):
    """(this rank's pipeline group, its data-parallel group): pipelines are runs of pp ranks; None:
    the default group (one pipeline), no data parallelism."""
    if world == pp:
        return None, None
    pipe = dp = None
    for start in range(0, world, pp):  # every rank takes part in creating every group
        group = dist.new_group(list(range(start, start + pp)))
        pipe = group if start <= rank < start + pp else pipe
    for r in range(pp):
        group = dist.new_group(list(range(r, world, pp)))
        dp = group if rank % pp == r else dp
    return pipe, dp


def make_schedule(args, plan_: Plan, stages: list[PipelineStage]):
    loss_fn = torch.nn.functional.mse_loss
    if plan_.koala is not None:
        from koala_ds.torch import schedule

        return schedule(stages, args.microbatches, loss_fn, plan_.koala, settings=FLAGS,
                        source=f"--schedule {args.schedule}")
    cls = getattr(schedules, plan_.torch_class)
    single = issubclass(cls, schedules.PipelineScheduleSingle)
    try:
        return cls(stages[0] if single else stages, args.microbatches, loss_fn=loss_fn)
    except ValueError as exc:  # torch's own limits (e.g. microbatches per round), the same on every rank
        raise KoalaError(f"--schedule {args.schedule}: torch refuses --microbatches {args.microbatches}: {exc}") \
            from None


def train(args, plan_: Plan) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    pipe_group, dp_group = groups(plan_.pp, world, rank)
    pp_rank, replica = rank % plan_.pp, rank // plan_.pp
    indices = plan_.rank_stages[pp_rank]
    model = build_model(args.layers, args.dim)
    modules = [stage_module(model, i, plan_.stages) for i in indices]
    stages = [PipelineStage(mod, i, plan_.stages, torch.device("cpu"), group=pipe_group)
              for mod, i in zip(modules, indices)]
    pipe = make_schedule(args, plan_, stages)
    params = [p for mod in modules for p in mod.parameters()]
    optimizer = torch.optim.SGD(params, lr=args.lr)
    first, last = 0 in indices, plan_.stages - 1 in indices
    name = args.schedule if plan_.koala is None else plan_.koala.name
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(1000 * replica + step)
        x = torch.randn(args.microbatches * args.batch_size, args.dim, generator=gen)
        y = torch.randn(args.microbatches * args.batch_size, 1, generator=gen)
        losses: list = []
        t0 = time.perf_counter()
        pipe.step(*((x,) if first else ()), target=y if last else None, losses=losses)
        if dp_group is not None:
            for p in params:
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= world // plan_.pp
        clip_grad_norm(params, args.clip_grad, pipe_group)  # the ranks meet here, as in torchtitan
        optimizer.step()
        optimizer.zero_grad()
        ms = (time.perf_counter() - t0) * 1000
        if last and replica == 0:
            loss = torch.stack([v.detach() for v in losses]).mean().item()
            print(f"step {step}: loss {loss:.9g} ({ms:.1f} ms, schedule {name})", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b",
                        help="Koala schedule: name, .koala, .json or .csv; or torch:ClassName (torch's own)")
    parser.add_argument("--chunks", type=positive_int, default=1, help="stages per rank (2 for zb-v, dualpipe-v, ...)")
    parser.add_argument("--microbatches", type=positive_int, default=8)
    parser.add_argument("--steps", type=positive_int, default=5)
    parser.add_argument("--pp", type=positive_int, default=None, help="pipeline ranks (default: all processes)")
    parser.add_argument("--layers", type=positive_int, default=8, help="blocks in the model (>= --pp x --chunks)")
    parser.add_argument("--dim", type=positive_int, default=32)
    parser.add_argument("--batch-size", type=positive_int, default=4, help="samples per microbatch")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--clip-grad", type=float, default=1.0,
                        help="clip the gradients to this global L2 norm, reduced over the pipeline ranks every step "
                             "as torchtitan does (so the ranks meet at each step's end); 0: no clipping")
    return rank_zero_argument_errors(parser).parse_args(argv)  # a bad flag: one line on rank 0


def main() -> None:
    args = parse_args()
    plan_ = plan(args, int(os.environ.get("WORLD_SIZE", "1")))
    init_process_group()
    train(args, plan_)
    # Tear the process group down before the interpreter does (gloo's threads may still hold
    # work objects); only on success: after an error the other ranks may be inside a collective.
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main, "train.py")  # a KoalaError: one line on rank 0, exit code 2 on every rank
