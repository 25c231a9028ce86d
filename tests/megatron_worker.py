"""Multi-process worker for tests/test_megatron_runtime.py (not collected by pytest).

    python tests/megatron_worker.py --world 2 --out result.json --suite pp2

Spawns `--world` gloo processes. Each builds a tiny megatron-core GPTModel (local layer spec,
fp32, CPU), computes a single-process (no pipeline, no TP) reference by itself, then re-creates
the parallel groups for each topology of the suite, loads the reference weights into its
model chunks (by stage and TP shard), runs one step with every schedule, and records the
largest gradient / loss differences. Rank 0 writes the JSON the test asserts on.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

SEQ, MBS, VOCAB, HIDDEN, HEADS, LAYERS, M = 8, 2, 64, 16, 4, 4, 4


# -- schedules ------------------------------------------------------------------------------
def greedy_schedule(name, placement, m, split, cap=None):
    """A valid, deadlock-free schedule for any placement by unit-time list scheduling
    (stand-in for the library until it is available): backward first, then forward under an
    in-flight cap, and W (split) to fill idle steps."""
    from koala_ds.core.ir import Action, Op, schedule_from_ranks
    from koala_ds.core.validate import validate

    p, S = placement.p, placement.num_stages
    done = {}
    orders = [[] for _ in range(p)]
    pending_w = [[] for _ in range(p)]
    inflight = [0] * p
    caps = [cap if cap is not None else (p - r) * (S // p) for r in range(p)]
    total = S * m * (3 if split else 2)
    t = 0
    while sum(len(o) for o in orders) < total:
        chosen = []
        for r in range(p):
            ready_b = []
            ready_f = []
            for s in placement.stages_of(r):
                for mb in range(m):
                    if ("F", s, mb) not in done:
                        prev = placement.prev_stage(s)
                        if (prev is None or done.get(("F", prev, mb), t + 1) <= t - 0):
                            if not any(("F", s, k) not in done for k in range(mb)):
                                ready_f.append((mb, s))
                    elif ("B", s, mb) not in done:
                        nxt = placement.next_stage(s)
                        if done[("F", s, mb)] <= t and (nxt is None or done.get(("B", nxt, mb), t + 1) <= t):
                            ready_b.append((mb, -s))
            if ready_b:
                mb, ns = min(ready_b)
                a = Action(Op.I if split else Op.B, -ns, mb)
                chosen.append((r, a, ("B", -ns, mb)))
                inflight[r] -= 1
                if split:
                    pending_w[r].append((-ns, mb))
            elif ready_f and inflight[r] < caps[r]:
                mb, s = min(ready_f)
                chosen.append((r, Action(Op.F, s, mb), ("F", s, mb)))
                inflight[r] += 1
            elif pending_w[r]:
                s, mb = pending_w[r].pop(0)
                chosen.append((r, Action(Op.W, s, mb), None))
        if not chosen and not any(pending_w):
            raise RuntimeError(f"greedy schedule {name} stuck at t={t}")
        for r, a, key in chosen:
            orders[r].append(a)
            if key is not None:
                done[key] = t + 1
        t += 1
    sched = schedule_from_ranks(name, placement, m, orders)
    validate(sched)
    return sched


def make_schedule(name, p, m, v):
    """Library schedule when koala_ds.library is there, else the greedy stand-in."""
    try:
        from koala_ds.resolve import load_schedule

        return load_schedule(name, p, m, v)
    except ImportError:
        pass
    from koala_ds.core.ir import Placement

    if name == "1f1b":
        return greedy_schedule(name, Placement.named("linear", p, 1), m, False)
    if name == "zb-h1":
        return greedy_schedule(name, Placement.named("linear", p, 1), m, True)
    if name == "interleaved-1f1b":
        return greedy_schedule(name, Placement.named("interleaved", p, v), m, False)
    if name == "zb-v":
        return greedy_schedule(name, Placement.named("vshape", p, v), m, True)
    raise KeyError(name)


# -- model ----------------------------------------------------------------------------------
def make_config(tp, pp, v, dealloc=False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
        pipeline_dtype=torch.float32, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=v if v > 1 else None, deallocate_pipeline_outputs=dealloc,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False)


def cpu_attention_buffer():
    """megatron-core's DotProductAttention takes its score buffer from a global buffer that it
    allocates on CUDA; give it a CPU one (big enough for this model) after each initialize."""
    from koala_ds.megatron.cpu import prepare_cpu

    prepare_cpu(seed=7)


def build_chunk(config, stage, S, vp_stage):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=stage == 0, post_process=stage == S - 1,
                    share_embeddings_and_output_weights=False, vp_stage=vp_stage)


def batches(n):
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        out.append((tokens, labels))
    return out


def forward_step_func(data_iterator, model):
    from functools import partial

    tokens, labels = next(data_iterator) if data_iterator is not None else (None, None)
    pos = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).tril().logical_not()
    out = model(tokens if model.pre_process else None, pos, mask, labels=labels if model.post_process else None)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return out, partial(loss_func)


def full_name(local, stage, lps):
    """Name in the full (reference) model of parameter `local` of the chunk that runs `stage`."""
    if local.startswith("decoder.layers."):
        rest = local[len("decoder.layers."):]
        idx, tail = rest.split(".", 1)
        return f"decoder.layers.{stage * lps + int(idx)}.{tail}"
    return local


def shard(full, param, tp_rank, tp):
    if tp > 1 and getattr(param, "tensor_model_parallel", False):
        return full.chunk(tp, dim=param.partition_dim)[tp_rank].clone()
    return full.clone()


# -- reference --------------------------------------------------------------------------------
def reference(nmb):
    """Full model, no pipeline, no TP: weights, grads of the mean loss over `nmb` microbatches."""
    from megatron.core import parallel_state as ps
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1)
    cpu_attention_buffer()
    torch.manual_seed(7)
    model = build_chunk(make_config(1, 1, 1), 0, 1, None)
    weights = {k: p.detach().clone() for k, p in model.named_parameters()}
    losses = []
    it = iter(batches(nmb))
    for _ in range(nmb):
        out, loss_func = forward_step_func(it, model)
        loss, info = loss_func(out)
        (loss / nmb).backward()
        losses.append(info["lm loss"].item())
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    ps.destroy_model_parallel()
    return weights, grads, losses


# -- one topology -------------------------------------------------------------------------------
class Cpu1F1B:
    """Run megatron-core's own stock schedules on CPU: its p2p module asks for CUDA devices."""

    def __enter__(self):
        self.saved = (torch.cuda.current_device, torch.cuda.synchronize, torch.zeros)
        zeros = torch.zeros
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda *a, **k: None
        torch.zeros = lambda *a, device=None, **k: zeros(*a, device="cpu" if device == "cuda" else device, **k)
        return self

    def __exit__(self, *exc):
        torch.cuda.current_device, torch.cuda.synchronize, torch.zeros = self.saved


def run_topology(topo, ref, ref_dp, tmp):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules as mcs

    import koala_ds.megatron as km

    tp, pp, dp, v = topo["tp"], topo["pp"], topo["dp"], topo["v"]
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=v if v > 1 else None)
    cpu_attention_buffer()
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    dp_rank, dp_group = ps.get_data_parallel_rank(), ps.get_data_parallel_group()
    weights, grads_ref, losses_ref = ref_dp if dp > 1 else ref
    S = pp * v
    lps = LAYERS // S
    results = []
    megatron_grads = {}
    data = batches(M * dp)[dp_rank * M:(dp_rank + 1) * M]
    for sched_name in topo["schedules"]:
        entry = {"topology": topo["name"], "schedule": sched_name, "rank": dist.get_rank()}
        try:
            dealloc = topo.get("dealloc", False)
            config = make_config(tp, pp, v, dealloc)
            scale = topo.get("grad_scale", 1.0)
            if scale != 1.0:  # the loss-scaling path: megatron-core's backward_step scales the last stage's loss
                config.grad_scale_func = lambda loss, scale=scale: loss * scale
            if sched_name == "megatron-1f1b":
                placement_stages = [pp_rank]
                func_factory = None
            else:
                base = sched_name[len("file:"):] if sched_name.startswith("file:") else sched_name
                schedule = make_schedule(base, pp, M, v)
                placement_stages = list(schedule.placement.stages_of(pp_rank))
                spec = schedule
                if sched_name.startswith("file:"):
                    spec = os.path.join(tmp, f"{topo['name']}-{base}.json")
                    if dist.get_rank() == 0:
                        with open(spec, "w") as fh:
                            fh.write(schedule.to_json())
                    dist.barrier()
                func_factory = lambda spec=spec: km.get_forward_backward_func(  # noqa: E731
                    spec, timeout_s=60, per_direction_groups=topo.get("per_direction"))
            chunks = []
            for c, stage in enumerate(placement_stages):
                chunk = build_chunk(config, stage, S, c if v > 1 else None)
                with torch.no_grad():
                    for name, prm in chunk.named_parameters():
                        prm.copy_(shard(weights[full_name(name, stage, lps)], prm, tp_rank, tp))
                chunks.append(chunk)

            from koala_ds.megatron.cpu import data_parallel_finalize

            config.finalize_model_grads_func = data_parallel_finalize(dp_group, dp)
            iters = [iter(data) for _ in chunks]
            kwargs = dict(forward_step_func=forward_step_func, data_iterator=iters if v > 1 else iters[0],
                          model=chunks if v > 1 else chunks[0], num_microbatches=M, seq_length=SEQ,
                          micro_batch_size=MBS)
            t0 = time.time()
            if func_factory is None:
                with Cpu1F1B():
                    losses = mcs.forward_backward_pipelining_without_interleaving(**kwargs)
            else:
                func = func_factory()
                losses = func(**kwargs)
            entry["seconds"] = time.time() - t0
            diff = 0.0
            missing = []
            for chunk, stage in zip(chunks, placement_stages):
                for name, prm in chunk.named_parameters():
                    ref_g = shard(grads_ref[full_name(name, stage, lps)], prm, tp_rank, tp) * scale
                    if prm.grad is None:
                        missing.append(name)
                        continue
                    diff = max(diff, (prm.grad - ref_g).abs().max().item() / scale)  # in unscaled units
            entry["max_grad_diff"] = diff
            entry["grad_abs_sum"] = sum(prm.grad.abs().sum().item() for c in chunks for prm in c.parameters()
                                        if prm.grad is not None)
            named = {(stage, n): prm.grad for c, stage in zip(chunks, placement_stages)
                     for n, prm in c.named_parameters() if prm.grad is not None}
            if sched_name == "megatron-1f1b":
                megatron_grads.update(named)
            elif megatron_grads and v == 1:
                entry["max_diff_vs_megatron"] = max((g - megatron_grads[k]).abs().max().item() / scale
                                                    for k, g in named.items())
            entry["missing_grads"] = missing
            entry["is_last_pp_rank"] = pp_rank == pp - 1
            entry["num_losses"] = len(losses)
            entry["loss_keys"] = sorted({k for d in losses for k in d})
            ref_losses = losses_ref[dp_rank * M:(dp_rank + 1) * M] if dp > 1 else losses_ref
            entry["max_loss_diff"] = max((abs(d["lm loss"].item() - r) for d, r in zip(losses, ref_losses)), default=0.0)
            if func_factory is not None and topo.get("forward_only"):
                for chunk in chunks:
                    chunk.zero_grad(set_to_none=True)
                kwargs["data_iterator"] = [iter(data) for _ in chunks] if v > 1 else iter(data)
                fl = func(forward_only=True, **kwargs)
                entry["fo_num_losses"] = len(fl)
                entry["fo_max_loss_diff"] = max((abs(d["lm loss"].item() - r) for d, r in zip(fl, ref_losses)),
                                                default=0.0)
                entry["fo_grads"] = sum(prm.grad is not None for c in chunks for prm in c.parameters())
        except Exception as exc:  # reported to the test, which fails with the message
            entry["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
        results.append(entry)
    return results


def bad_inputs(tmp):
    """Errors that must come before any communication (pp=2, run on every rank)."""
    from megatron.core import parallel_state as ps

    import koala_ds.megatron as km

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 2)
    cpu_attention_buffer()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    out = {}
    config = make_config(1, 2, 1)
    chunk = build_chunk(config, pp_rank, 2, None)
    kwargs = dict(forward_step_func=forward_step_func, data_iterator=iter(batches(M)), model=chunk,
                  num_microbatches=M, seq_length=SEQ, micro_batch_size=MBS)
    cases = {
        "pp_mismatch": lambda: km.get_forward_backward_func(make_schedule("1f1b", 4, M, 1))(**kwargs),
        "v_mismatch": lambda: km.get_forward_backward_func(make_schedule("zb-v", 2, M, 2))(**kwargs),
        "m_mismatch": lambda: km.get_forward_backward_func(make_schedule("1f1b", 2, M + 1, 1))(**kwargs),
        "missing_file": lambda: km.get_forward_backward_func(os.path.join(tmp, "nope.json")),
    }
    for name, fn in cases.items():
        t0 = time.time()
        try:
            fn()
            out[name] = {"raised": None}
        except Exception as exc:
            out[name] = {"raised": type(exc).__name__, "message": str(exc), "koala": isinstance(exc, km.MegatronScheduleError),
                         "seconds": time.time() - t0}
    return out


SUITES = {
    "pp2": [
        {"name": "pp2", "tp": 1, "pp": 2, "dp": 1, "v": 1, "dealloc": True, "forward_only": True,
         "schedules": ["megatron-1f1b", "1f1b", "zb-h1", "file:zb-h1"]},
        {"name": "pp2-v2", "tp": 1, "pp": 2, "dp": 1, "v": 2, "forward_only": True,
         "schedules": ["interleaved-1f1b", "zb-v", "file:zb-v"]},
        {"name": "pp2-scaled", "tp": 1, "pp": 2, "dp": 1, "v": 1, "grad_scale": 1024.0,
         "schedules": ["megatron-1f1b", "1f1b", "zb-h1"]},
    ],
    "pp4": [
        {"name": "pp4", "tp": 1, "pp": 4, "dp": 1, "v": 1, "per_direction": True,
         "schedules": ["megatron-1f1b", "1f1b", "zb-h1", "file:zb-h1"]},
        {"name": "pp2-tp2", "tp": 2, "pp": 2, "dp": 1, "v": 1, "dealloc": True,
         "schedules": ["megatron-1f1b", "1f1b", "zb-h1"]},
        {"name": "pp2-dp2", "tp": 1, "pp": 2, "dp": 2, "v": 1, "schedules": ["1f1b", "zb-h1"]},
    ],
}


def worker(rank, world, port, suite, out, tmp):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from datetime import timedelta

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    ref = reference(M)
    ref_dp = reference(2 * M)
    results = []
    for topo in SUITES[suite]:
        results += run_topology(topo, ref, ref_dp, tmp)
    bad = bad_inputs(tmp) if suite == "pp2" else {}
    gathered = [None] * world
    dist.all_gather_object(gathered, {"results": results, "bad": bad})
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"ranks": gathered}, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--suite", required=True, choices=sorted(SUITES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=29511)
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp
    from rank_processes import PRELOAD

    mp.set_forkserver_preload(list(PRELOAD))  # the ranks import torch and megatron-core once, not each
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args.world, args.port, args.suite, args.out, tmp), nprocs=args.world,
                           join=True, start_method="forkserver")


if __name__ == "__main__":
    sys.exit(main())
