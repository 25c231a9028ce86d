"""`koala profile`: measure a real model's per-stage costs and write a cost profile (v1) for
`koala simulate / compare / search --profile`. torch and the engines are imported only here,
when the command runs."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import re
import sys
import warnings
from typing import Any, Callable, Iterator

from ..core.ir import KoalaError
from ..core.outputs import atomic_write, check_output
from ..profiler.core import CLOCKS, DEFAULT_ITERS, DEFAULT_WARMUP, SPREAD_MIN_SAMPLES
from ..runtime.spawn import SpawnError, quiet_megatron_imports
from ..runtime.wgrad_policy import DEFAULT_MAX_HOLD, check_max_hold
from . import dumps_json, nonnegative_float, positive_float, positive_int

log = logging.getLogger(__name__)


def max_w_hold(text: str):
    """--max-w-hold: a fraction >= 0, or none."""
    if text.strip().lower() == "none":
        return None
    try:
        return check_max_hold(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0 or none, got {text!r}") from None


PARTITION_METHODS = "uniform, parameters or type:REGEX"


def partition_method(text: str) -> str:
    """--partition-method: uniform, parameters or type:REGEX (a valid regular expression), as
    DeepSpeed's PipelineModule takes it (case-insensitive)."""
    method = text.lower()  # as koala_ds.profiler.models.pipeline_module_stages (and DeepSpeed) reads it
    if method in ("uniform", "parameters"):
        return text
    if not method.startswith("type:"):
        raise argparse.ArgumentTypeError(f"{text!r}: use {PARTITION_METHODS}")
    try:
        re.compile(method.split(":", 1)[1], re.IGNORECASE)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: the REGEX of type:REGEX is not a regular expression ({exc})") \
            from None
    return text


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-p", type=int, required=True, help="pipeline ranks")
    p.add_argument("-v", type=int, default=1, help="model chunks per rank (the profile gets p * v stages; default 1)")
    p.add_argument("-o", "--output", required=True, metavar="prof.json", help="write the profile here")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                   help=f"rounds run before measuring (default {DEFAULT_WARMUP}); a round runs every stage in turn, "
                        f"each one microbatch split (F, I, W) and one whole (F, B)")
    p.add_argument("--iters", type=int, default=DEFAULT_ITERS,
                   help=f"rounds measured; the median counts, and how precisely it is known is the profile's "
                        f"spread (written from {SPREAD_MIN_SAMPLES} rounds on; default {DEFAULT_ITERS})")
    p.add_argument("--p2p-latency", type=nonnegative_float, default=None, metavar="MS",
                   help="write this p2p latency instead of measuring it (2-process gloo ping-pong)")
    p.add_argument("--action-overhead", type=nonnegative_float, default=None, metavar="MS",
                   help="write the runtime's cost per action on top of the measured compute (Python, launch, "
                        "messages' CPU): simulate and search add it to every F, I, W and B; matters when stage "
                        "times are a few ms or less (measure it: benchmarks/engine_speedup.py --overhead-only)")
    p.add_argument("--p2p-timeout", type=positive_float, default=120.0, metavar="S", help="deadline of the ping-pong (default 120 s)")
    p.add_argument("--memory-limit", type=positive_float, default=None, metavar="MB",
                   help="write this per-rank memory limit: for activations in a stage profile; with --per-layer "
                        "a rank's whole memory (parameters and optimizer state included)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch CPU threads, >= 1 (default 1: one pipeline rank per process and core)")
    p.add_argument("--clock", choices=CLOCKS, default="auto",
                   help="the CPU's timer: cpu = the thread's CPU time (time spent descheduled by a busy machine does "
                        "not count; one --threads only), wall = the wall clock; auto (default): cpu with one thread, "
                        "else wall. A GPU is timed with CUDA events")
    p.add_argument("--max-w-hold", type=max_w_hold, default=DEFAULT_MAX_HOLD, metavar="X",
                   help="what W may hold after I, as a fraction of a stage's activation; the layers beyond it "
                        f"compute their weight gradient in I (koala_ds.runtime.wgrad.prepare(max_hold=...); default "
                        f"{DEFAULT_MAX_HOLD}, as the runtimes; none: defer every covered layer)")
    p.add_argument("--per-layer", action="store_true",
                   help="measure every layer on its own and write a per-layer profile (for the partition "
                        "search); -p then only decides whether the p2p latency is measured (p > 1)")
    p.add_argument("--optimizer-bytes-per-param-byte", type=nonnegative_float, default=None, metavar="X",
                   help="per-layer profile: gradient + optimizer bytes per parameter byte (fp32 Adam with "
                        "fp32 gradients: 3). Default: 3 for megatron-gpt (the example's optimizer); for deepspeed "
                        "not written (the format's default, 0)")


def _check_args(args) -> None:
    """What can be checked before torch is imported: counts and the output path."""
    if args.p < 1 or args.v < 1:
        raise KoalaError(f"-p and -v must be >= 1 (got p={args.p}, v={args.v})")
    if args.warmup < 0 or args.iters < 1:
        raise KoalaError("--warmup must be >= 0 and --iters >= 1")
    if args.clock == "cpu" and args.threads > 1:
        raise KoalaError(f"--clock cpu counts the calling thread's CPU time only, and --threads {args.threads} runs "
                         f"more: use --clock wall (or auto), or --threads 1")
    if args.optimizer_bytes_per_param_byte is not None and not args.per_layer:
        raise KoalaError("--optimizer-bytes-per-param-byte goes into per-layer profiles only: add --per-layer, "
                         "or drop it")
    check_output(args.output, "-o", (".json",))


def _check_device(torch, device: str) -> None:
    """One line naming --device, before any process starts, for a device this torch cannot use."""
    try:
        kind = torch.device(device)
    except RuntimeError:
        raise KoalaError(f"--device {device}: not a torch device; use cpu or cuda (cuda:N for GPU N)") from None
    if kind.type not in ("cpu", "cuda"):
        raise KoalaError(f"--device {device}: the profiler runs on cpu or cuda")
    if kind.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise KoalaError(f"--device {device}: no CUDA GPU here (torch {torch.__version__}); use --device cpu")
        if kind.index is not None and kind.index >= count:
            raise KoalaError(f"--device {device}: this machine has {count} CUDA GPU(s) (cuda:0 to cuda:{count - 1})")


def _setup(args):
    _check_args(args)
    import torch

    torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    _check_device(torch, device)
    p2p = True if args.p2p_latency is None else args.p2p_latency
    if args.p * args.v == 1 and p2p is True:
        p2p = False
    return device, p2p


def _progress(device: str, args, what: str = "stage"):
    """Prints a line as each stage is set up and, after the last, what the timing runs."""
    def say(stage: int, stages: int) -> None:
        print(f"profiling {what} {stage + 1}/{stages} on {device} ...", file=sys.stderr, flush=True)
        if stage + 1 == stages:
            print(f"profiling the {stages} {what}s in turn: {args.warmup} warm-up + {args.iters} measured rounds ...",
                  file=sys.stderr, flush=True)

    return say


def _share(fraction) -> str:
    """The share of the weight-gradient FLOPs W runs (the rest runs in I under --max-w-hold)."""
    return f"{'-':>7}" if fraction is None else f"{100 * fraction:>6.0f}%"


#: A stage forward shorter than this (ms) makes the runtime's own cost per action (0.6-1.2 ms on a
#: 2-core CPU, docs/profiling.md) a share of each action that can decide which schedule wins.
SHORT_STAGE_MS = 5.0


def _with_overhead(args, data: dict, stage_forward_ms: list[float]) -> dict:
    """--action-overhead into the profile (a top-level field); without it, a warning when the
    stages are short enough for the runtime's cost per action to matter."""
    if args.action_overhead is not None:
        data["action_overhead"] = args.action_overhead
    elif stage_forward_ms and min(stage_forward_ms) < SHORT_STAGE_MS:
        log.warning("stage forwards of %.3g ms and the profile has no action_overhead: the runtime's own cost per "
                    "action (its Python, launches and messages' CPU; 0.6-1.2 ms per action on a 2-core CPU) is left "
                    "out, and at these times it can decide which schedule wins: measure it "
                    "(benchmarks/engine_speedup.py --overhead-only) and give --action-overhead MS "
                    "(docs/profiling.md)", min(stage_forward_ms))
    return data


#: A spread above this, in any stage time, means the machine was busy while it was measured (with
#: the default 40 rounds: the samples' interquartile range was above about 10% of the median):
#: `koala profile` says so.
BUSY_SPREAD = 0.02


def _warn_if_busy(stages: list[dict]) -> None:
    """One warning line when some stage time's spread (how precisely its value is known) is above
    BUSY_SPREAD."""
    spreads = [(value, s, name) for s, st in enumerate(stages) for name, value in st.get("spread", {}).items()]
    if spreads and max(spreads)[0] > BUSY_SPREAD:
        value, s, name = max(spreads)
        log.warning("the measured times are known to %.1f%% only (stage %d %s: the spread of its median): the "
                    "machine was busy, and koala search will take predicted gains below the spread they make as none; "
                    "profile on a quiet machine, or with more --iters, for a sharper profile (docs/profiling.md, "
                    "'Spread')", 100 * value, s, name)


def _spread(stage: dict) -> str:
    """The stage's largest spread (how precisely a time is known, over it) of its times, in %."""
    spread = stage.get("spread")
    return f"{'-':>6}" if not spread else f"{100 * max(spread.values()):>5.1f}%"


def _finish(args, result) -> int:
    from ..sim import CostProfile

    data = result.to_dict()
    data = _with_overhead(args, data, [st["forward"] for st in data["stages"]])
    CostProfile.from_dict(data, source=args.output)  # what we write must load
    atomic_write(args.output, dumps_json(data, indent=1) + "\n", "-o")
    _warn_if_busy(data["stages"])
    print(f"{'stage':>5}  {'F ms':>9}  {'I ms':>9}  {'W ms':>9}  {'B ms':>9}  {'(I+W)/B':>7}  {'act MiB':>9}  "
          f"{'W-hold MiB':>10}  {'W FLOPs':>7}  {'spread':>6}")
    for s, (st, meta) in enumerate(zip(data["stages"], data["meta"]["stages"])):
        b = st.get("backward")
        ratio = f"{(st['backward_input'] + st['backward_weight']) / b:>7.3f}" if b else f"{'-':>7}"
        print(f"{s:>5}  {st['forward']:>9.4g}  {st['backward_input']:>9.4g}  {st['backward_weight']:>9.4g}  "
              f"{b if b is not None else float('nan'):>9.4g}  {ratio}  {st['activation_mb']:>9.4g}  {st['w_hold_mb']:>10.4g}"
              f"  {_share(meta.get('w_flops_deferred'))}  {_spread(st)}")
    print("spread: how precisely the stage's times are known, the largest (the profile's 'spread': the "
          "interquartile range of a median over repeated measurements; koala search treats gains within it as none)")
    print(f"p2p latency {data['p2p_latency']:.4g} ms ({data['meta']['p2p_latency']}); timer: {data['meta']['timer']}"
          + (f"; action overhead {data['action_overhead']:g} ms (given)" if "action_overhead" in data else ""))
    print(f"wrote {args.output}; next: koala search --profile {args.output} -m <microbatches> -o best.koala"
          + (f" -v {args.v}" if args.v > 1 else ""))
    return 0


def _finish_layers(args, result) -> int:
    from ..profiler.layers import stage_shaped
    from ..sim import CostProfile

    data = result.to_dict()
    mean_stage = sum(layer["forward"] for layer in data["layers"]) / max(1, args.p)  # -p stages
    data = _with_overhead(args, data, [mean_stage])
    CostProfile.from_dict(stage_shaped(data), source=args.output)  # every entry carries valid stage fields
    atomic_write(args.output, dumps_json(data, indent=1) + "\n", "-o")
    print(f"{'layer':<14} {'kind':<11} {'F ms':>9}  {'I ms':>9}  {'W ms':>9}  {'B ms':>9}  {'act MiB':>9}  "
          f"{'out MiB':>9}  {'param MiB':>9}")
    for st in data["layers"]:
        b = st.get("backward", float("nan"))
        print(f"{st['name']:<14} {st['kind']:<11} {st['forward']:>9.4g}  {st['backward_input']:>9.4g}  "
              f"{st['backward_weight']:>9.4g}  {b:>9.4g}  {st['activation_mb']:>9.4g}  {st['output_mb']:>9.4g}  "
              f"{st['param_mb']:>9.4g}")
    print(f"p2p latency {data['p2p_latency']:.4g} ms ({data['meta']['p2p_latency']}); timer: {data['meta']['timer']}")
    print(f"wrote {args.output} ({len(data['layers'])} layers, per-layer profile)")
    return 0


def _check_gpt(args) -> None:
    stages = args.p * args.v
    for flag, value in (("--num-layers", args.num_layers), ("--hidden-size", args.hidden_size),
                        ("--num-attention-heads", args.num_attention_heads), ("--seq-length", args.seq_length),
                        ("--micro-batch-size", args.micro_batch_size), ("--vocab-size", args.vocab_size)):
        if value < 1:
            raise KoalaError(f"{flag} must be >= 1, got {value}")
    if stages >= 1 and args.num_layers % stages and not args.per_layer:
        raise KoalaError(f"--num-layers {args.num_layers} is not a multiple of the p x v = {args.p} x {args.v} = "
                         f"{stages} stages: change --num-layers, -p or -v")
    if args.hidden_size % args.num_attention_heads:
        raise KoalaError(f"--hidden-size {args.hidden_size} is not a multiple of --num-attention-heads "
                         f"{args.num_attention_heads}")


def _gpt_layers(args, device: str, p2p: bool | float) -> Any:
    from ..profiler.models import profile_megatron_gpt_layers

    opt = 3.0 if args.optimizer_bytes_per_param_byte is None else args.optimizer_bytes_per_param_byte
    return profile_megatron_gpt_layers(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, vocab_size=args.vocab_size, p=args.p,
        seed=args.seed, device=device, warmup=args.warmup, iters=args.iters, p2p=p2p,
        p2p_timeout_s=args.p2p_timeout, memory_limit_mb=args.memory_limit, optimizer_bytes_per_param_byte=opt,
        progress=_progress(device, args, "layer"), max_hold=args.max_w_hold, clock=args.clock)


def _gpt_stages(args, device: str, p2p: bool | float) -> Any:
    from ..profiler.models import profile_megatron_gpt

    return profile_megatron_gpt(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                                micro_batch_size=args.micro_batch_size, vocab_size=args.vocab_size, p=args.p,
                                v=args.v, seed=args.seed, device=device, warmup=args.warmup, iters=args.iters,
                                p2p=p2p, p2p_timeout_s=args.p2p_timeout, memory_limit_mb=args.memory_limit,
                                progress=_progress(device, args), max_hold=args.max_w_hold, clock=args.clock)


#: What to do, besides raising --p2p-timeout, when the profile's ping-pong ran past it.
P2P_LATENCY_HINT = ", or give the latency with --p2p-latency MS"


def cmd_megatron_gpt(args) -> int:
    _check_gpt(args)
    device, p2p = _setup(args)
    profile = _gpt_layers if args.per_layer else _gpt_stages
    with _p2p_deadline("--p2p-timeout", args.p2p_timeout, P2P_LATENCY_HINT), warnings.catch_warnings():
        quiet_megatron_imports()
        result = profile(args, device, p2p)
    return _finish_layers(args, result) if args.per_layer else _finish(args, result)


#: The longest message of a user's exception that an error line quotes (its first line only).
MAX_QUOTED_CHARS = 200


def _cut(text: str, limit: int) -> str:
    """`text`, or its first `limit` - 3 characters and "..." when it is longer than `limit`."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _describe(exc: BaseException) -> str:
    """`Type: first line of the message`, cut at MAX_QUOTED_CHARS characters."""
    lines = str(exc).strip().splitlines()
    return _cut(f"{type(exc).__name__}: {lines[0].strip()}" if lines else type(exc).__name__, MAX_QUOTED_CHARS)


def _user_error(message: str, exc: BaseException) -> KoalaError:
    """A one-line KoalaError quoting the user's exception; its traceback goes to the DEBUG log."""
    log.debug("%s", message, exc_info=exc)
    return KoalaError(f"{message}: {_describe(exc)} (koala --log-level DEBUG profile ... shows the traceback)")


def _load(ref: str, what: str) -> Callable[[], Any]:
    """The function MODULE:FUNCTION names; one line naming `what` (the option) when it cannot be had."""
    module_name, _, func_name = ref.partition(":")
    if not module_name.strip() or not func_name.strip():
        raise KoalaError(f"{what} {ref!r}: expected MODULE:FUNCTION (e.g. mymodel:build_layers)")
    sys.path.insert(0, ".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise KoalaError(f"{what} {ref!r}: cannot import {module_name} ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - any error of the user's module (SyntaxError, ...)
        raise _user_error(f"{what} {ref!r}: importing {module_name} failed", exc) from None
    func = getattr(module, func_name, None)
    if func is None:
        raise KoalaError(f"{what} {ref!r}: {module_name} has no {func_name}")
    if not callable(func):
        raise KoalaError(f"{what} {ref!r}: {module_name}.{func_name} is a {type(func).__name__}, not a function")
    return func


def _call(func: Callable[[], Any], ref: str, what: str) -> Any:
    """`func()`; an exception in the user's function is one line (its traceback at --log-level DEBUG)."""
    try:
        return func()
    except Exception as exc:  # noqa: BLE001 - any error of the user's code
        raise _user_error(f"{what} {ref!r} raised", exc) from None


def _shown(value: Any) -> str:
    """`value` for an error line: its repr (cut short) and its type."""
    return f"{_cut(repr(value), 40)} ({type(value).__name__})"


def _layer_list(returned: Any, args) -> Any:
    """What --layers returned, checked: a PipelineModule (its layer list), or a non-empty list of
    layers (modules, LayerSpecs, functions), at least one per stage."""
    ref = f"--layers {args.layers!r}"
    specs = getattr(returned, "_layer_specs", returned)
    if isinstance(specs, (str, bytes)) or not hasattr(specs, "__iter__"):
        raise KoalaError(f"{ref} returned {_shown(returned)}, not a PipelineModule or a list of layers")
    layers = list(specs)
    if not layers:
        raise KoalaError(f"{ref} returned no layers")
    for i, layer in enumerate(layers):
        if not callable(layer) and not hasattr(layer, "build"):
            raise KoalaError(f"{ref}: layer {i} is {_shown(layer)}, not a module, LayerSpec or function")
    needed, why = (2, "a per-layer profile (--per-layer) needs") if args.per_layer else \
        (args.p * args.v, f"the p x v = {args.p} x {args.v} stages need")
    if len(layers) < needed:
        raise KoalaError(f"{ref} returned {len(layers)} layer(s); {why} at least {needed}: give more layers"
                         + ("" if args.per_layer else ", or a smaller -p or -v"))
    return returned if hasattr(returned, "_layer_specs") else layers


def _method_for(layers: Any, args) -> str | None:
    """The partition method of the stages (None: per-layer, no partition): --partition-method,
    checked against what it would be ignored for or match nothing of; else the module's, else
    parameters (DeepSpeed's default)."""
    given, own = args.partition_method, getattr(layers, "partition_method", None)
    if args.per_layer:
        if given is not None:
            raise KoalaError("--partition-method: a per-layer profile measures every layer, the split is chosen "
                             "later (koala search --partition, or auto): drop it")
        return None
    if given is not None and own is not None and given.lower() != str(own).lower():
        raise KoalaError(f"--partition-method {given}: --layers {args.layers!r} returned a PipelineModule, which "
                         f"DeepSpeed partitions by its own partition_method {own!r}: drop --partition-method, or "
                         f"build the module with partition_method={given!r}")
    method = given or own or "parameters"
    if method.lower().startswith("type:"):
        from ..profiler.models import layer_type_names

        names = layer_type_names(getattr(layers, "_layer_specs", layers))
        rx = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        if not any(rx.search(n) for n in names):
            shown = ", ".join(sorted(set(n for n in names if n)))[:300]
            raise KoalaError(f"--partition-method {method}: the REGEX matches no layer of --layers "
                             f"{args.layers!r} (layer types: {shown or 'none named'})")
    return method


def _check_seed_layers(layers: Any, args) -> None:
    """--seed-layers with a PipelineModule built without seed_layers: one line (its own counts)."""
    if args.seed_layers and getattr(layers, "seed_layers", None) is False:
        raise KoalaError(f"--seed-layers: --layers {args.layers!r} returned a PipelineModule built with "
                         f"seed_layers=False, which DeepSpeed runs without reseeding: drop --seed-layers, or "
                         f"build the module with seed_layers=True")


def _sample(returned: Any, ref: str) -> Any:
    """What --input returned: one microbatch's input (None is refused)."""
    if returned is None:
        raise KoalaError(f"--input {ref!r} returned None: return one microbatch's input (a tensor, or a tuple "
                         f"of the first layer's arguments)")
    return returned


def _model_error(exc: Exception, args) -> KoalaError:
    """The user's model failed while profiled: one line naming --input (the first stage's forward)
    or --layers (anything else), with the stage (the layer, --per-layer) and the step where
    profile_stages knows them."""
    from ..profiler.core import failed_step

    where = failed_step(exc)
    if where is None:
        return _user_error(f"--layers {args.layers!r}: profiling failed", exc)
    stage, step = where
    unit = "layer" if args.per_layer else "stage"
    if (stage, step) == (0, "forward"):
        return _user_error(f"--input {args.input!r}: the {unit} 0 forward failed", exc)
    return _user_error(f"--layers {args.layers!r}: the {unit} {stage} {step} failed", exc)


@contextlib.contextmanager
def _model_errors(args) -> Iterator[None]:
    """Inside: an error of the user's model (--layers, --input) is one line naming the option."""
    try:
        yield
    except (KoalaError, SpawnError):
        raise
    except Exception as exc:  # noqa: BLE001 - the user's layers run inside
        raise _model_error(exc, args) from None


@contextlib.contextmanager
def _p2p_deadline(flag: str, timeout_s: float, other: str) -> Iterator[None]:
    """Inside: the ping-pong's processes stopped at their deadline is one line naming `flag`."""
    try:
        yield
    except SpawnError as exc:
        if not exc.timed_out:
            raise
        log.debug("the p2p ping-pong failed", exc_info=True)
        raise KoalaError(f"{flag} {timeout_s:g}: the p2p ping-pong (2 local processes) did not finish in "
                         f"{timeout_s:g} s; raise {flag}{other}") from None


def _deepspeed_layers(args, layers: Any, sample: Any, device: str, p2p: bool | float) -> Any:
    from ..profiler.models import profile_pipeline_module_layers

    result = profile_pipeline_module_layers(
        layers, sample, seed_layers=args.seed_layers, device=device, warmup=args.warmup, iters=args.iters,
        p2p=p2p,
        p2p_timeout_s=args.p2p_timeout, memory_limit_mb=args.memory_limit,
        optimizer_bytes_per_param_byte=args.optimizer_bytes_per_param_byte,
        progress=_progress(device, args, "layer"), max_hold=args.max_w_hold, clock=args.clock)
    result.extra_meta.update({"p": args.p})
    return result


def _deepspeed_stages(args, layers: Any, sample: Any, device: str, p2p: bool | float) -> Any:
    from ..profiler.models import profile_pipeline_module

    result = profile_pipeline_module(layers, sample, args.p * args.v, partition_method=args.partition_method,
                                     seed_layers=args.seed_layers, device=device, warmup=args.warmup,
                                     iters=args.iters, p2p=p2p,
                                     p2p_timeout_s=args.p2p_timeout, memory_limit_mb=args.memory_limit,
                                     progress=_progress(device, args), max_hold=args.max_w_hold, clock=args.clock)
    result.extra_meta.update({"p": args.p, "v": args.v})
    return result


def cmd_deepspeed(args) -> int:
    _check_args(args)
    layers_fn, input_fn = _load(args.layers, "--layers"), _load(args.input, "--input")
    device, p2p = _setup(args)
    layers = _layer_list(_call(layers_fn, args.layers, "--layers"), args)
    args.partition_method = _method_for(layers, args)
    _check_seed_layers(layers, args)
    sample = _sample(_call(input_fn, args.input, "--input"), args.input)
    profile = _deepspeed_layers if args.per_layer else _deepspeed_stages
    with _p2p_deadline("--p2p-timeout", args.p2p_timeout, P2P_LATENCY_HINT), _model_errors(args):
        result = profile(args, layers, sample, device, p2p)
    return _finish_layers(args, result) if args.per_layer else _finish(args, result)


def cmd_p2p(args) -> int:
    from ..profiler.p2p import check_message, measure_p2p_latency

    if args.iters < 1 or not args.timeout > 0:
        raise KoalaError("--iters must be >= 1 and --timeout > 0")
    check_message(args.numel, args.dtype)
    with _p2p_deadline("--timeout", args.timeout, f", or lower --iters ({args.iters} round trips)"):
        ms = measure_p2p_latency(args.numel, args.dtype, iters=args.iters, timeout_s=args.timeout)
    print(f"p2p latency (one way, median of {args.iters} round trips / 2, gloo, 2 local processes): {ms:.4g} ms "
          f"for {args.numel} x {args.dtype}")
    return 0


def _count(text: str) -> int:
    """An integer, also written as 1e6 (a whole number)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")) or value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return int(value)


def register(sub: argparse._SubParsersAction) -> None:
    top = sub.add_parser("profile", help="measure a real model's per-stage costs and write a cost profile",
                         description="Measure forward, backward-input and backward-weight time and activation memory "
                                     "of each pipeline stage, and the p2p latency; write a profile v1 JSON for "
                                     "`koala search --profile`. See docs/profiling.md.")
    kinds = top.add_subparsers(dest="model", required=True, metavar="MODEL")
    g = kinds.add_parser("megatron-gpt", help="the megatron-core GPT of examples/megatron_gpt")
    g.add_argument("--num-layers", type=int, default=8)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=32)
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--vocab-size", type=int, default=128)
    g.add_argument("--seed", type=int, default=1234)
    _common(g)
    g.set_defaults(func=cmd_megatron_gpt)
    d = kinds.add_parser("deepspeed", help="a DeepSpeed pipeline model (PipelineModule or its layer list)")
    d.add_argument("--layers", required=True, metavar="MODULE:FUNC",
                   help="function returning a PipelineModule or its list of layers / LayerSpecs")
    d.add_argument("--input", required=True, metavar="MODULE:FUNC", help="function returning one microbatch's input")
    d.add_argument("--partition-method", type=partition_method, default=None,
                   help="uniform, parameters or type:REGEX (default parameters; a PipelineModule's own otherwise)")
    _common(d)
    d.add_argument("--seed-layers", action="store_true",
                   help="the layers run in a PipelineModule(seed_layers=True): reseed before each layer of each "
                        "forward, as DeepSpeed does (host time in every F); a returned PipelineModule: its own")
    d.set_defaults(func=cmd_deepspeed)
    q = kinds.add_parser("p2p", help="only the p2p latency (2-process gloo ping-pong)")
    q.add_argument("--numel", type=_count, required=True,
                   help="elements per message (at most 1 GiB per message, and both processes' buffers must fit "
                        "the memory available)")
    q.add_argument("--dtype", default="float32")
    q.add_argument("--iters", type=int, default=50)
    q.add_argument("--timeout", type=positive_float, default=120.0, metavar="S")
    q.set_defaults(func=cmd_p2p)
