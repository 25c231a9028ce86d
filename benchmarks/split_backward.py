"""What a split backward costs on real layers: F, I, W, B, (I + W) / B, activation and W-hold per stage.

    python benchmarks/split_backward.py                       # the three models at hidden 512, CPU
    python benchmarks/split_backward.py --device cuda --hidden-size 2048 --num-layers 24 --seq-length 2048 -p 8

Models (each split into -p stages, profiled by koala_ds.profiler exactly as the runtimes run
F, I (backward with weight-gradient GEMMs queued, koala_ds.runtime.wgrad), W (the queue) and B; F is the
forward a full-backward schedule runs and I carries what the split's deferrable forward costs
over it, shown apart as "split F extra"):
- megatron: the megatron-core GPT of examples/megatron_gpt (local spec, fp32);
- torch: a plain-torch GPT block stack (nn.Linear, LayerNorm, scaled_dot_product_attention);
- deepspeed: the same blocks as a DeepSpeed layer list (LayerSpec), partitioned by DeepSpeed,
  with W as the DeepSpeed runtime runs it (weight gradients added into .grad by their GEMMs);
- deepspeed-autograd (opt-in): the same, with W accumulated through autograd as the Megatron
  runtime does (`--models deepspeed,deepspeed-autograd` compares the two in one run).
The target of issue 13: (I + W) / B <= 1.15 on CPU at hidden 512 on every stage with an input
gradient, <= 1.10 on CUDA at hidden 2048; W-hold <= 0.75 x activation (the hold policy,
`--max-w-hold`, koala_ds.runtime.wgrad.prepare(max_hold=...); "W FLOPs" is the share of the covered
layers' weight-gradient FLOPs W still runs).
"""
from __future__ import annotations

import argparse
import sys

import torch

from koala_ds.commands.profile import max_w_hold
from koala_ds.profiler.models import gpt_layer_specs, gpt_layers
from koala_ds.runtime.wgrad_policy import DEFAULT_MAX_HOLD


def torch_stages(a) -> list:
    """Embedding with the first stage, head with the last, the blocks spread evenly."""
    layers = gpt_layers(a.num_layers, a.hidden_size, a.num_attention_heads, a.seq_length, a.vocab_size)
    per = a.num_layers // a.p
    groups = [layers[1 + s * per: 1 + (s + 1) * per] for s in range(a.p)]
    groups[0].insert(0, layers[0])
    groups[-1].append(layers[-1])
    return [torch.nn.Sequential(*g) for g in groups]


def profile(a, model: str):
    from koala_ds.profiler.core import profile_stages
    from koala_ds.profiler.models import profile_megatron_gpt, profile_pipeline_module

    common = dict(device=a.device, warmup=a.warmup, iters=a.iters, p2p=False, max_hold=a.max_w_hold)
    if model == "megatron":
        return profile_megatron_gpt(num_layers=a.num_layers, hidden_size=a.hidden_size,
                                    num_attention_heads=a.num_attention_heads, seq_length=a.seq_length,
                                    micro_batch_size=1, vocab_size=a.vocab_size, p=a.p, **common)
    torch.manual_seed(0)
    ids = torch.randint(0, a.vocab_size, (1, a.seq_length))
    loss = lambda out: out.float().mean()  # noqa: E731
    if model == "torch":
        stages = [s.to(a.device) for s in torch_stages(a)]
        return profile_stages(stages, ids.to(a.device), loss_fn=loss, **common)
    specs = gpt_layer_specs(a.num_layers, a.hidden_size, a.num_attention_heads, a.seq_length, a.vocab_size)
    return profile_pipeline_module(specs, ids, a.p, partition_method="parameters", loss_fn=loss,
                                   direct_wgrad=model != "deepspeed-autograd", **common)


def rows(model: str, result) -> list:
    out = []
    for s, m in enumerate(result.stages):
        f, i, w, b = m.costs()  # as in the profile: a deferrable forward's extra cost is charged to I
        act, hold = m.activation_bytes / 2 ** 20, m.w_hold_bytes / 2 ** 20
        share = "-" if m.w_flops_deferred is None else f"{100 * m.w_flops_deferred:.0f}%"
        out.append((model, s, "yes" if m.input_grad else "no", f, i, w, b, (i + w) / b, act, hold, hold / act, share,
                    m.forward_extra()))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="megatron,torch,deepspeed")
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--num-attention-heads", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("-p", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--max-w-hold", type=max_w_hold, default=DEFAULT_MAX_HOLD,
                    help="W-hold bound, a fraction of the activation, or none (default: the runtimes' default)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.device == "cuda" and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    table = []
    for model in a.models.split(","):
        table += rows(model, profile(a, model))
    print(f"split backward on {a.device}: {a.num_layers} layers, hidden {a.hidden_size}, {a.num_attention_heads} heads, "
          f"seq {a.seq_length}, micro-batch 1, vocab {a.vocab_size}, p={a.p}, fp32, {a.threads} thread(s), "
          f"max W-hold {a.max_w_hold}; "
          f"median of {a.iters} microbatches (ms, MiB)")
    head = ("model", "stage", "input grad", "F", "I", "W", "B", "(I+W)/B", "act MiB", "W-hold MiB", "hold/act",
            "W FLOPs", "split F extra (in I)")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in table:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.2f} | {r[4]:.2f} | {r[5]:.2f} | {r[6]:.2f} | {r[7]:.3f} | "
              f"{r[8]:.1f} | {r[9]:.1f} | {r[10]:.2f} | {r[11]} | {r[12]:+.2f} |")
    split = [r[7] for r in table if r[2] == "yes"]
    print(f"worst (I+W)/B over stages with an input gradient: {max(split):.3f}; "
          f"worst W-hold / activation: {max(r[10] for r in table):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
