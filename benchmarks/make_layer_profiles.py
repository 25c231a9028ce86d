"""Write the bundled per-layer example profiles koala_ds/profiles/gpt1.3b-24L.json and
gpt-largevocab-32L.json from the measured stage profile ../shared/profiles/h200-gpt1.3b-p8.json
(24 layers, hidden 2048, vocab 50304, p=8: 3 layers per stage; the embedding on stage 0, the
output layer and loss on stage 7). Each file's description says how every number was derived.

    python benchmarks/make_layer_profiles.py [--source ../shared/profiles/h200-gpt1.3b-p8.json]
"""
import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMES = ("forward", "backward_input", "backward_weight")
SIZES = ("activation_mb", "w_hold_mb")
HIDDEN, SEQ, PER_STAGE = 2048, 2048, 3
MIB = 2 ** 20
LAYER_PARAMS = 12 * HIDDEN ** 2 + 13 * HIDDEN          # attention + MLP + two layernorms
BOUNDARY_MB = SEQ * HIDDEN * 4 / MIB                   # [seq, 1, hidden] float32 (the profile's output_shape)


def layer(name, kind, costs, output_mb, param_mb):
    out = {"name": name, "kind": kind, **{k: round(max(0.0, costs[k]), 6) for k in TIMES + SIZES}}
    out.update(output_mb=output_mb, param_mb=round(param_mb, 3))
    return out


def derive(stages):
    """Per-layer costs: a middle stage's layer = the stage / 3; the average of stages 1-6 for the
    layers of stages 0 and 7; the output entry = stage 7 minus 3 average layers."""
    per_stage = [{k: s[k] / PER_STAGE for k in TIMES + SIZES} for s in stages]
    avg = {k: sum(ps[k] for ps in per_stage[1:-1]) / (len(stages) - 2) for k in TIMES + SIZES}
    output = {k: stages[-1][k] - PER_STAGE * avg[k] for k in TIMES + SIZES}
    return per_stage, avg, output


def profile(name, description, layers, limit):
    return {"version": 1, "name": name, "description": description, "layers": layers, "p2p_latency": 0.02,
            "memory_limit_mb": limit, "optimizer_bytes_per_param_byte": 3.0}


def gpt13b(stages):
    per_stage, avg, output = derive(stages)
    layers = [layer("embedding", "embedding", {k: 0.0 for k in TIMES + SIZES}, BOUNDARY_MB,
                    (50304 + SEQ) * HIDDEN * 4 / MIB)]
    for i in range(24):
        costs = per_stage[i // PER_STAGE] if 0 < i // PER_STAGE < len(stages) - 1 else avg
        layers.append(layer(f"layer.{i}", "transformer", costs, BOUNDARY_MB, LAYER_PARAMS * 4 / MIB))
    layers.append(layer("output", "output", output, 0.0, 50304 * HIDDEN * 4 / MIB))
    desc = ("Per-layer form of h200-gpt1.3b-p8 (megatron-core GPT, 24 layers, hidden 2048, seq 2048, micro-batch 1, "
            "vocab 50304, fp32; measured per stage on one H200 with 3 layers per stage), made by "
            "benchmarks/make_layer_profiles.py. layer.i of stages 1-6 = that stage's forward, backward_input, "
            "backward_weight, activation_mb, w_hold_mb / 3; the layers of stages 0 and 7 = the average of stages "
            "1-6 / 3. output (final layernorm, LM head, loss) = stage 7 minus 3 average layers. embedding: all 0 "
            "(stage 0 minus 3 average layers is -0.002 ms forward, and its backward, 12.05 ms, is below 3 layers' "
            "I + W, 21.0 ms: the per-layer form charges stage 0 more backward than measured). No 'backward' "
            "(B = I + W, as in the stage profile's entries). output_mb: the [2048, 1, 2048] float32 boundary. "
            "param_mb: fp32 parameters, 12h^2 + 13h per layer, (vocab + seq) x h for the embedding, vocab x h for "
            "the output layer (its copy of the tied embedding); optimizer_bytes_per_param_byte 3 (fp32 gradients "
            "and Adam's two moments). memory_limit_mb: an H200's 140000 MB.")
    return profile("gpt1.3b-24L", desc, layers, 140000)


def largevocab(stages, vocab=200064):
    _, avg, output = derive(stages)
    scale = vocab / 50304
    head = {k: output[k] * scale for k in TIMES + SIZES}
    layers = [layer("embedding", "embedding", {k: 0.0 for k in TIMES + SIZES}, BOUNDARY_MB,
                    (vocab + SEQ) * HIDDEN * 4 / MIB)]
    layers += [layer(f"layer.{i}", "transformer", avg, BOUNDARY_MB, LAYER_PARAMS * 4 / MIB) for i in range(32)]
    layers.append(layer("output", "output", head, 0.0, vocab * HIDDEN * 4 / MIB))
    work = sum(head[k] for k in TIMES) / sum(avg[k] for k in TIMES)
    desc = (f"A GPT with a large vocabulary ({vocab}) and 32 layers of the h200-gpt1.3b-p8 model (hidden 2048, seq "
            f"2048, micro-batch 1, fp32), made by benchmarks/make_layer_profiles.py. Every transformer layer = the "
            f"average of that profile's stages 1-6 / 3 (3 layers per stage). output (final layernorm, LM head, loss) "
            f"= its stage 7 minus 3 average layers (the vocab-50304 head), times {scale:.4f} = {vocab} / 50304 (the "
            f"logits, softmax and their gradients scale with the vocabulary): worth {work:.2f} layers of F + I + W, "
            f"{head['forward'] / avg['forward']:.2f} of forward. embedding: 0 ms (as measured on stage 0 at vocab "
            f"50304). No 'backward' (B = I + W). param_mb: fp32 parameters (12h^2 + 13h per layer, (vocab + seq) x "
            f"h for the embedding, vocab x h for the output layer's copy of the tied embedding); "
            f"optimizer_bytes_per_param_byte 3 (fp32 gradients, Adam's two moments). memory_limit_mb: an H200's "
            f"140000 MB.")
    return profile("gpt-largevocab-32L", desc, layers, 140000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default=str(ROOT.parent / "shared" / "profiles" / "h200-gpt1.3b-p8.json"))
    ap.add_argument("--out", default=str(ROOT / "koala_ds" / "profiles"))
    args = ap.parse_args()
    stages = json.loads(Path(args.source).read_text())["stages"]
    for data in (gpt13b(stages), largevocab(stages)):
        path = Path(args.out) / f"{data['name']}.json"
        path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
