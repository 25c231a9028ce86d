"""Train a small GPT (megatron-core GPTModel, local layer spec) with a Koala pipeline schedule.

    torchrun --nproc-per-node 2 examples/megatron_gpt/pretrain_gpt.py \
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 \
        --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \
        --micro-batch-size 2 --global-batch-size 16 --train-iters 50 --lr 1e-3 --seed 1234 \
        --pipeline-schedule koala --koala-schedule zb-h1

Megatron's flag names; data parallel size = world size / (TP x PP). CPU + gloo by default,
NCCL when CUDA is present; `--distributed-backend gloo` with CUDA puts rank r on GPU
LOCAL_RANK % device count, so every rank can share one GPU (NCCL refuses two ranks on one GPU;
the Koala runtime stages the pipeline's CUDA tensors through the CPU for gloo). The corpus is
synthetic: sequences drawn from a fixed random Markov chain (a learnable next-token
distribution), the same for every layout and schedule.
Weights are initialised per parameter from its global name, so every schedule, chunking and
pipeline size starts from the same model: with the same seed, the loss of every iteration is
the same whichever schedule runs it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import zlib
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from koala_ds.megatron import add_arguments, install  # noqa: E402
from koala_ds.megatron.cpu import data_parallel_finalize  # noqa: E402
from koala_ds.megatron.resolve import MEGATRON, resolve  # noqa: E402
from koala_ds.runtime.grad_norm import clip_grad_norm  # noqa: E402
from koala_ds.runtime.turns import check_settle, keeps_own_shape, summary, turn_index  # noqa: E402

log = logging.getLogger("pretrain_gpt")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    g = ap.add_argument_group("megatron")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    g.add_argument("--pipeline-model-parallel-layout", default=None, metavar="LAYOUT",
                   help='megatron-core\'s layout of the p*v virtual stages, e.g. "Et*3|t*2|t*2|tL" (E embedding, '
                        't transformer layer, L output + loss; | between stages, pipeline order); sets the '
                        'virtual pipeline size. Default: num-layers / (p*v) per stage')
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=32)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=128, help="synthetic corpus vocabulary")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=16)
    g.add_argument("--train-iters", type=int, default=50)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="gradient clipping on the global L2 norm, reduced over the model-parallel group every "
                        "step as Megatron-LM does (so the pipeline ranks meet at each step's end); 0: no "
                        "clipping (default 1.0, Megatron-LM's)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="the process group's backend (Megatron-LM's flag; default: nccl when CUDA is present, "
                        "else gloo). gloo with CUDA: rank r runs on GPU LOCAL_RANK %% device count, so every "
                        "rank can share one GPU; needs --pipeline-schedule koala when PP > 1")
    g.add_argument("--loss-log", default=None, metavar="FILE",
                   help="write the loss and the time (ms) of every iteration as JSON")
    add_arguments(ap)
    b = ap.add_argument_group("benchmarking")
    b.add_argument("--alternate-schedules", default=None, metavar="NAME|FILE[,...]",
                   help="also run these Koala schedules, taking turns with --koala-schedule every --alternate-block "
                        "iterations in this one run, so that the machine's drift hits them alike (another "
                        "placement or v, as a schedule file keeps its own, on a model copy of its own; the loss "
                        "log names each iteration's schedule; at the end "
                        "each schedule's median step period, its first turn and the first --alternate-settle "
                        "iterations of every turn left out; with --koala-trace each schedule writes its own trace, "
                        "FILE.<its name>.rank<g>.json beside --koala-schedule's)")
    b.add_argument("--alternate-block", type=int, default=2, metavar="N",
                   help="iterations of a schedule before the next takes its turn (default 2)")
    b.add_argument("--alternate-settle", type=int, default=1, metavar="N",
                   help="iterations at the start of every turn left out of the end's medians (default 1; 2 with "
                        "--alternate-block 4 where schedules run on model copies of their own, whose second "
                        "iteration still runs slow)")
    args = ap.parse_args(argv)
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    return args


# -- data ---------------------------------------------------------------------------------------
class MarkovCorpus:
    """Sequences from a fixed random Markov chain over the vocabulary (peaked transitions).
    Sequence i of the corpus depends on i alone (its own generator), so the data-parallel split
    changes which rank draws it, not what it is."""

    def __init__(self, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(vocab, vocab, generator=g) * 3.0
        self.probs = torch.softmax(logits, dim=-1)
        self.cdf = self.probs.cumsum(dim=-1)
        self.vocab, self.seed = vocab, seed

    def sequences(self, first: int, count: int, length: int) -> torch.Tensor:
        """Sequences first .. first+count-1, each of length+1 tokens: one uniform draw per token
        from the sequence's own generator, walked through the chain's inverse CDFs for all the
        sequences at once (a loop over positions, not over sequences and positions)."""
        u = torch.stack([torch.rand(length + 1, generator=torch.Generator().manual_seed(self.seed * 7919 + i))
                         for i in range(first, first + count)]).t().contiguous()  # [position, sequence]
        seq = torch.empty(count, length + 1, dtype=torch.long)
        seq[:, 0] = (u[0] * self.vocab).long().clamp(max=self.vocab - 1)
        for t in range(length):
            nxt = torch.searchsorted(self.cdf[seq[:, t]], u[t + 1].unsqueeze(1)).squeeze(1)
            seq[:, t + 1] = nxt.clamp(max=self.vocab - 1)  # a u above the rounded last CDF entry
        return seq

    def microbatches(self, iteration: int, dp_rank: int, dp: int, m: int, mbs: int, length: int):
        first = (iteration * dp + dp_rank) * m * mbs
        seqs = self.sequences(first, m * mbs, length)
        return [(seqs[k * mbs:(k + 1) * mbs, :-1].contiguous(), seqs[k * mbs:(k + 1) * mbs, 1:].contiguous())
                for k in range(m)]


# -- model --------------------------------------------------------------------------------------
def build_model(args, config, schedule_stages, layout, device):
    """The model chunks of this rank: chunk c holds virtual stage schedule_stages[c], with the
    layers the layout gives that stage (koala_ds.megatron.layout.stage_layers: pipeline order,
    whichever rank the schedule's placement puts the stage on)."""

    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from koala_ds.megatron.layout import stage_layers

    tp_rank, tp = ps.get_tensor_model_parallel_rank(), args.tensor_model_parallel_size
    chunks = []
    for stage in schedule_stages:
        mine = stage_layers(layout, stage)
        # the chunk's own config: its transformer layers, no pipeline split left to make
        chunk_config = dataclasses.replace(config, num_layers=mine.num_layers, pipeline_model_parallel_layout=None,
                                           pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None)
        chunk = GPTModel(chunk_config, get_gpt_layer_local_spec(), vocab_size=args.vocab_size,
                         max_sequence_length=args.max_position_embeddings, pre_process=mine.pre_process,
                         post_process=mine.post_process, share_embeddings_and_output_weights=False)
        with torch.no_grad():
            for name, prm in chunk.named_parameters():
                prm.copy_(init_value(name, mine.offset, prm, args.seed, tp_rank, tp))
        chunks.append(chunk.to(device))
    return chunks


def init_value(local_name: str, offset: int, prm, seed: int, tp_rank: int, tp: int) -> torch.Tensor:
    """The initial value of a parameter, from its global name (layout-independent); `offset` is
    the global index of the chunk's first transformer layer."""
    name = local_name
    if name.startswith("decoder.layers."):
        idx, tail = name[len("decoder.layers."):].split(".", 1)
        name = f"decoder.layers.{offset + int(idx)}.{tail}"
    sharded = tp > 1 and getattr(prm, "tensor_model_parallel", False)
    shape = list(prm.shape)
    if sharded:
        shape[prm.partition_dim] *= tp
    if "norm" in name:
        full = torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    elif name.endswith("bias"):
        full = torch.zeros(shape)
    else:
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        full = torch.randn(shape, generator=g) * 0.02
    if sharded:
        full = full.chunk(tp, dim=prm.partition_dim)[tp_rank]
    return full.to(prm.dtype)


def forward_step_func(seq_length, data_iterator, model):
    tokens, labels = next(data_iterator) if data_iterator is not None else (None, None)
    device = next(model.parameters()).device
    mbs = (tokens if tokens is not None else labels).shape[0] if (tokens is not None or labels is not None) else 1
    pos = torch.arange(seq_length, device=device).unsqueeze(0).expand(mbs, seq_length)
    mask = torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool, device=device).tril().logical_not()
    out = model(tokens.to(device) if model.pre_process else None, pos, mask,
                labels=labels.to(device) if model.post_process else None)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return out, loss_func


def pipeline_layout(args, pp: int):
    """megatron-core's layout of the virtual stages, checked by megatron-core: the one
    --pipeline-model-parallel-layout gives (it sets the virtual pipeline size, as in Megatron-LM),
    else num-layers / (PP x VP) transformer layers per stage."""
    from koala_ds.core.ir import KoalaError
    from koala_ds.megatron.layout import check_layout, uniform_layout

    v = args.virtual_pipeline_model_parallel_size or 1
    if args.pipeline_model_parallel_layout is None:
        if args.num_layers % (pp * v):
            raise KoalaError(f"--num-layers {args.num_layers} must be a multiple of PP x VP = {pp * v}")
        return check_layout(uniform_layout(args.num_layers, pp * v), pp, args.num_layers)
    layout = check_layout(args.pipeline_model_parallel_layout, pp, args.num_layers)
    lv = layout.virtual_pipeline_model_parallel_size
    if args.virtual_pipeline_model_parallel_size is not None and args.virtual_pipeline_model_parallel_size != lv:
        raise KoalaError(f"--virtual-pipeline-model-parallel-size {args.virtual_pipeline_model_parallel_size} but "
                         f"--pipeline-model-parallel-layout has {pp * lv} stages = {lv} per rank: drop one of them")
    args.virtual_pipeline_model_parallel_size = lv if lv > 1 else None
    return layout


# -- main ---------------------------------------------------------------------------------------
def distributed_setup(backend_flag, cuda: bool, local_rank: int, local_world: int, device_count: int):
    """The process group's backend and this rank's device. --distributed-backend (Megatron-LM's
    flag), by default nccl when CUDA is present and gloo otherwise; on CUDA rank r uses GPU
    LOCAL_RANK % device count, so with gloo every rank can share one GPU."""
    from koala_ds.core.ir import KoalaError

    backend = backend_flag or ("nccl" if cuda else "gloo")
    if not cuda:
        if backend == "nccl":
            raise KoalaError("--distributed-backend nccl needs CUDA, which this machine lacks: "
                             "use --distributed-backend gloo")
        return backend, torch.device("cpu")
    if backend == "nccl" and local_world > device_count:
        raise KoalaError(f"--distributed-backend nccl needs one GPU per rank: {local_world} ranks on this node, "
                         f"{device_count} GPU(s); use --distributed-backend gloo to share GPUs")
    return backend, torch.device("cuda", local_rank % device_count)


def check_pipeline_backend(koala: bool, pp: int, device: torch.device, backend: str) -> None:
    """megatron-core's own schedules need CUDA (forward_backward_no_pipelining too, at
    --pipeline-model-parallel-size 1: it makes its token count on CUDA); its pipeline schedules
    send the model's tensors with torch.distributed, so NCCL on it. The Koala runtime runs on CPU
    and stages CUDA tensors through the CPU for gloo."""
    from koala_ds.core.ir import KoalaError

    if koala:
        return
    if device.type != "cuda":
        raise KoalaError("megatron-core's own schedules need CUDA (its pipeline schedules, and at "
                         "--pipeline-model-parallel-size 1 forward_backward_no_pipelining); on CPU use "
                         "--pipeline-schedule koala")
    if backend == "gloo" and pp > 1:
        raise KoalaError("megatron-core's own pipeline schedules cannot send CUDA tensors over gloo: with "
                         "--distributed-backend gloo use --pipeline-schedule koala, or --distributed-backend nccl "
                         "(one GPU per rank)")


def make_config(args, tp: int, pp: int, v: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        use_cpu_initialization=True, pipeline_dtype=torch.float32, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=v if v > 1 else None, bias_dropout_fusion=False,
        cuda_graph_scope=[],  # megatron-core's default ("full") is deprecated and warns on every rank
        gradient_accumulation_fusion=False, deallocate_pipeline_outputs=True)


#: Flags that count something: each must be >= 1.
COUNTS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers", "hidden_size",
          "num_attention_heads", "seq_length", "vocab_size", "micro_batch_size", "global_batch_size", "train_iters",
          "log_interval", "alternate_block")


def batch_split(args, world: int) -> tuple[int, int]:
    """(data-parallel size, microbatches per step) of `world` ranks, after the sizes' own checks
    (every count >= 1, --max-position-embeddings >= --seq-length); a KoalaError (one line on rank
    0, exit code 2 on every rank) naming the flag when one fails or the sizes do not divide."""
    from koala_ds.core.ir import KoalaError

    for name in (*COUNTS, "virtual_pipeline_model_parallel_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise KoalaError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    check_settle(args.alternate_block, args.alternate_settle)
    if args.max_position_embeddings < args.seq_length:  # the position embedding would index past its table
        raise KoalaError(f"--max-position-embeddings {args.max_position_embeddings} is below --seq-length "
                         f"{args.seq_length}: raise it, or drop it (it defaults to --seq-length)")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world % (tp * pp):
        raise KoalaError(f"world size {world} is not a multiple of --tensor-model-parallel-size x "
                         f"--pipeline-model-parallel-size = {tp * pp}")
    dp = world // (tp * pp)
    m = args.global_batch_size // (args.micro_batch_size * dp)
    if m < 1 or m * args.micro_batch_size * dp != args.global_batch_size:
        raise KoalaError(f"--global-batch-size {args.global_batch_size} must be a multiple of --micro-batch-size x "
                         f"data-parallel size = {args.micro_batch_size} x {dp}")
    return dp, m


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    backend, device = distributed_setup(args.distributed_backend, cuda, int(os.environ.get("LOCAL_RANK", 0)),
                                        int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                                        torch.cuda.device_count() if cuda else 0)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    dp, m = batch_split(args, world)
    args.data_parallel_size = dp
    layout = pipeline_layout(args, pp)
    v = layout.virtual_pipeline_model_parallel_size
    # routes megatron's get_forward_backward_func to the Koala runtime; build_model makes each chunk
    # the schedule's stage (stage_layers), so any placement (V-shape too) fits
    report = install(args, chunks="schedule")
    check_pipeline_backend(report.schedule is not None, pp, device, backend)
    turns = alternation(args, report, pp, m, v)
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(world, 1)))
    dist.init_process_group(backend, timeout=timedelta(seconds=300))
    if rank == 0:
        print(f"{report}; process group: {backend} on {device.type}", flush=True)
    from megatron.core import parallel_state as ps

    from koala_ds.megatron.cpu import prepare_cpu

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=v if v > 1 else None)
    prepare_cpu(seed=args.seed)
    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(args.seed)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    build_models(args, turns, tp, pp, pp_rank, layout, device)
    losses, times, periods = train(args, m, turns)
    if report.func is not None:  # --koala-trace: end the trace file (else done at exit)
        report.func.close_trace()
    is_logger = pp_rank == pp - 1 and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    schedules = [turn_of(args, turns, it).name for it in range(args.train_iters)]
    if is_logger and len(turns) > 1:  # the first turn of each schedule is its warm-up
        print(summary(periods, schedules, len(turns) * args.alternate_block, args.alternate_block,
                      args.alternate_settle), flush=True)
    if is_logger and args.loss_log:
        with open(args.loss_log, "w") as fh:
            json.dump({"schedule": report.schedule or "default", "tp": tp, "pp": pp, "dp": dp, "v": v,
                       "backend": dist.get_backend(), "device": device.type, "losses": losses,
                       "iteration_ms": times, "period_ms": periods,
                       "iteration_schedules": schedules}, fh)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


@dataclasses.dataclass
class Turn:
    """A schedule taking turns: its forward_backward_func (None: megatron's own), the placement
    of its virtual stages (None: megatron's own, chunk c of rank r = stage c x p + r), and the
    model copy it runs on (this rank's chunks and their optimizer; build_models)."""

    name: str
    func: object
    placement: object
    v: int
    chunks: list = dataclasses.field(default_factory=list)
    optimizer: object = None

    def stages(self, pp: int, pp_rank: int) -> tuple[int, ...]:
        if self.placement is None:
            return tuple(c * pp + pp_rank for c in range(self.v))
        return tuple(self.placement.stages_of(pp_rank))


def alternation(args, report, pp: int, m: int, v: int) -> list[Turn]:
    """The schedules taking turns (--alternate-schedules), the installed --koala-schedule first;
    one without the flag. A library schedule or program is compiled for the run's v; a fixed
    schedule file (.json, .csv) keeps its own v and placement. Alternates placed as
    --koala-schedule share its model; any other placement gets a model copy of its own
    (build_models), so the rounds can pair a v=2 schedule with 1f1b."""
    from koala_ds.core.ir import KoalaError
    from koala_ds.megatron import get_forward_backward_func as koala_func

    if not args.alternate_schedules:
        placement = resolve(report.schedule, pp, m, v).placement if report.schedule is not None else None
        return [Turn(report.schedule or "default", None, placement, v)]  # None: get_forward_backward_func()
    if report.schedule is None:
        raise KoalaError("--alternate-schedules needs --pipeline-schedule koala (with --koala-schedule)")
    turns = [Turn(report.schedule, report.func, resolve(report.schedule, pp, m, v).placement, v)]
    words = dataclasses.replace(MEGATRON, schedule="--alternate-schedules")  # how a misfit names the flag
    for spec in args.alternate_schedules.split(","):
        placement = resolve(spec, pp, m, None if keeps_own_shape(spec) else v, words).placement
        if placement.v != v and args.pipeline_model_parallel_layout is not None:
            raise KoalaError(f"--alternate-schedules {spec} has {placement.v} model chunks per rank, "
                             f"--pipeline-model-parallel-layout {v}: an alternate of another v needs the default "
                             f"layout (drop --pipeline-model-parallel-layout)")
        if args.num_layers % (pp * placement.v):
            raise KoalaError(f"--alternate-schedules {spec} has {placement.v} model chunks per rank: --num-layers "
                             f"{args.num_layers} must be a multiple of PP x {placement.v} = {pp * placement.v}")
        # with --koala-trace, the installed function's recorder: FILE.<schedule name> per alternate
        turns.append(Turn(spec, koala_func(spec, args.koala_profile, timeout_s=args.koala_p2p_timeout,
                                           timeout_name="--koala-p2p-timeout", trace=report.func.recorder),
                          placement, placement.v))
    return turns


def build_models(args, turns: list, tp: int, pp: int, pp_rank: int, layout, device) -> None:
    """Each turn's chunks and optimizer: one model copy per (stages of this rank, v), each built
    from the same seed (init_value), so every copy starts as the same model."""
    from koala_ds.megatron.layout import check_layout, uniform_layout

    copies: dict = {}
    for turn in turns:
        key = (turn.stages(pp, pp_rank), turn.v)
        if key not in copies:
            own = layout if turn.v == layout.virtual_pipeline_model_parallel_size else \
                check_layout(uniform_layout(args.num_layers, pp * turn.v), pp, args.num_layers)
            chunks = build_model(args, make_config(args, tp, pp, turn.v), list(key[0]), own, device)
            copies[key] = (chunks, torch.optim.Adam([q for c in chunks for q in c.parameters()], lr=args.lr))
        turn.chunks, turn.optimizer = copies[key]


def turn_of(args, turns: list, it: int) -> Turn:
    """The turn of iteration `it`: --alternate-block iterations each."""
    return turns[turn_index(it, len(turns), args.alternate_block)]


def train(args, m: int, turns: list) -> tuple[list, list, list]:
    """The training loop; the last pipeline rank's per-iteration losses and times. A time is the
    ms of forward_backward_func and the optimizer step on this rank (the synthetic data is drawn
    before the clock starts; CUDA is synchronised before it stops); a period, the ms from one
    iteration's start to the next's (the whole loop: data, logging; what `koala calibrate` calls
    a step). Each iteration runs its turn's schedule on that turn's model copy. As in Megatron-LM,
    the optimizer step reduces the gradients' norm over the model-parallel group (--clip-grad), so
    every pipeline rank ends a step before any starts the next."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func  # patched by install()
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    pp, dp = args.pipeline_model_parallel_size, args.data_parallel_size
    pp_rank, dp_rank, dp_group = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank(), \
        ps.get_data_parallel_group()
    mp_group = ps.get_model_parallel_group()
    # data-parallel gradient reduction with plain all-reduce (Megatron's DDP needs CUDA)
    for chunk in (c for turn in turns for c in turn.chunks):  # the runtime reads the first chunk's config
        chunk.config.finalize_model_grads_func = data_parallel_finalize(dp_group, dp)
    corpus = MarkovCorpus(args.vocab_size, args.seed)
    for turn in turns:
        turn.func = turn.func or get_forward_backward_func()
    is_logger = pp_rank == pp - 1 and ps.get_tensor_model_parallel_rank() == 0 and dp_rank == 0
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    losses_log, times, starts = [], [], []
    for it in range(args.train_iters):
        t0 = time.time()
        starts.append(time.perf_counter())
        turn = turn_of(args, turns, it)
        chunks, optimizer = turn.chunks, turn.optimizer
        data = corpus.microbatches(it, dp_rank, dp, m, args.micro_batch_size, args.seq_length)
        iters = [iter(data) for _ in chunks]
        optimizer.zero_grad(set_to_none=True)
        sync()
        t1 = time.perf_counter()
        losses = turn.func(
            forward_step_func=partial(forward_step_func, args.seq_length),
            data_iterator=iters if turn.v > 1 else iters[0], model=chunks if turn.v > 1 else chunks[0],
            num_microbatches=m, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size)
        clip_grad_norm((q for c in chunks for q in c.parameters()), args.clip_grad, mp_group,
                       counted=param_is_not_tensor_parallel_duplicate)
        optimizer.step()
        sync()
        times.append((time.perf_counter() - t1) * 1000)
        if pp_rank == pp - 1:
            loss = torch.stack([d["lm loss"] for d in losses]).mean()
            if dp > 1:
                dist.all_reduce(loss, group=dp_group)
                loss /= dp
            losses_log.append(loss.item())
            if is_logger and (it + 1) % args.log_interval == 0:
                ms = (time.time() - t0) * 1000
                print(f" iteration {it + 1:8d}/{args.train_iters:8d} | consumed samples: "
                      f"{(it + 1) * args.global_batch_size:10d} | elapsed time per iteration (ms): {ms:.1f} | "
                      f"learning rate: {args.lr:.6E} | global batch size: {args.global_batch_size:5d} | "
                      f"lm loss: {loss.item():.6E} | tokens per second: "
                      f"{args.global_batch_size * args.seq_length / ms * 1000:.1f} |", flush=True)
    starts.append(time.perf_counter())
    return losses_log, times, [(b - a) * 1000 for a, b in zip(starts, starts[1:])]


if __name__ == "__main__":
    from koala_ds.core.errors import run_main

    run_main(main, "pretrain_gpt")  # a KoalaError: one line on rank 0, exit code 2 on every rank
