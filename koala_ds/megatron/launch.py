"""Launch flags for Megatron-style scripts: `--pipeline-schedule koala --koala-schedule NAME|FILE`.

    from koala_ds.megatron import add_arguments, install
    pretrain(..., extra_args_provider=add_arguments)      # Megatron-LM
    install(get_args())                                    # route training to the Koala runtime

`install` checks the schedule against the flags before any process group or model exists and
raises MegatronScheduleError naming the flag to change; run the script's main through
`koala_ds.core.errors.run_main(main)` so that is one line on rank 0 and exit code 2 on every rank.

`install` replaces `get_forward_backward_func` where Megatron looks it up: in
megatron.core.pipeline_parallel (and its schedules module) and, when Megatron-LM is
importable, in megatron.training.training, which imported the name at module level.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import dataclasses
from dataclasses import dataclass, field

from ..core.errors import rank_zero_argument_errors
from ..runtime.lowering import LookaheadSettingError, recv_lookahead
from ..runtime.timeout import TimeoutSettingError, check_timeout
from ..runtime.trace_record import check_trace_path
from .. import library
from ..core.ir import KoalaError, Placement
from ..resolve import (FIXED_SUFFIXES, MEGATRON, MEGATRON_LM, Setting, check_fit, check_profile_stages, load,
                       load_profile)
from .layout import tied_embeddings_conflict
from .resolve import MegatronScheduleError, check_spec, resolve

log = logging.getLogger(__name__)

#: where Megatron looks the function up (module, attribute)
PATCH_TARGETS = (
    ("megatron.core.pipeline_parallel", "get_forward_backward_func"),
    ("megatron.core.pipeline_parallel.schedules", "get_forward_backward_func"),
    ("megatron.training.training", "get_forward_backward_func"),
)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron extra_args_provider: adds the koala flags (and returns the parser), and makes
    the parser's argument errors one line on rank 0 (exit code 2 on every rank)."""
    rank_zero_argument_errors(parser)
    group = parser.add_argument_group(title="koala pipeline schedule")
    group.add_argument("--pipeline-schedule", choices=("default", "koala"), default="default",
                       help="'koala' runs the pipeline with a Koala schedule (default: megatron-core's own)")
    group.add_argument("--koala-schedule", default=None, metavar="NAME|FILE",
                       help="library schedule name (1f1b, zb-h1, interleaved-1f1b, zb-v, ...) or a "
                            ".koala / .json / .csv schedule file")
    group.add_argument("--koala-profile", default=None, metavar="FILE", help="cost profile JSON (version 1)")
    group.add_argument("--koala-p2p-timeout", type=float, default=None, metavar="SECONDS",
                       help="deadline of every pipeline send/receive (default $KOALA_TIMEOUT_S, or its older "
                            "name $KOALA_P2P_TIMEOUT, or 600)")
    group.add_argument("--koala-trace", default=None, metavar="FILE",
                       help="record the measured timeline of every training step: each process writes "
                            "FILE.rank<global rank>.json (a Chrome trace; docs/megatron.md)")
    return parser


#: `install(args, chunks=...)`: who decides which virtual stage each model chunk holds
CHUNKS = ("megatron", "schedule")


def schedule_from_args(args, chunks: str = "megatron") -> str | None:
    """The schedule the flags ask for, checked; None for the default (megatron-core) schedule.
    `chunks`: see `install`."""
    if chunks not in CHUNKS:
        raise ValueError(f"chunks must be one of {CHUNKS}, got {chunks!r}")
    if getattr(args, "pipeline_schedule", "default") != "koala":
        for attr, flag in (("koala_schedule", "--koala-schedule"), ("koala_trace", "--koala-trace")):
            if getattr(args, attr, None):
                raise MegatronScheduleError(f"{flag} is set but --pipeline-schedule is not 'koala'")
        return None
    spec = getattr(args, "koala_schedule", None)
    if not spec:
        raise MegatronScheduleError("--pipeline-schedule koala needs --koala-schedule NAME|FILE")
    check_spec(spec)
    placement = _check_sizes(spec, args, MEGATRON_LM if chunks == "megatron" else MEGATRON)
    if chunks == "megatron" and placement is not None:
        _check_megatron_chunks(spec, placement)
    if chunks == "schedule" and placement is not None:
        _check_tied_embeddings(spec, placement, args)
        _check_no_checkpoints(placement, args)
    profile = getattr(args, "koala_profile", None)
    if profile is not None and placement is not None:  # its stages: the schedule's (as koala simulate checks)
        check_profile_stages(load_profile(profile, MEGATRON), placement, f"--koala-schedule {spec}", MEGATRON,
                             profile)
    timeout = getattr(args, "koala_p2p_timeout", None)
    if timeout is not None:
        try:
            check_timeout(timeout, "--koala-p2p-timeout")
        except TimeoutSettingError as exc:
            raise MegatronScheduleError(str(exc)) from None
    try:  # read by the runtime (koala_ds.runtime.lowering.recv_lookahead); checked before training
        recv_lookahead(True)
    except LookaheadSettingError as exc:
        raise MegatronScheduleError(str(exc)) from None
    trace = getattr(args, "koala_trace", None)
    if trace is not None:  # checked now: an unwritable FILE is found before training, not at its first step
        try:
            check_trace_path(trace, "--koala-trace")
        except KoalaError as exc:
            raise MegatronScheduleError(str(exc)) from None
    return spec


def microbatches_from_args(args) -> int | None:
    """--global-batch-size // (--micro-batch-size x data-parallel size), when the args give all three."""
    gbs, mbs = getattr(args, "global_batch_size", None), getattr(args, "micro_batch_size", None)
    dp = getattr(args, "data_parallel_size", None)
    if gbs and mbs and dp:
        return gbs // (mbs * dp)
    return None


def _layout_chunks(args) -> int | None:
    from ..core.ir import KoalaError
    from .layout import layout_chunks  # --pipeline-model-parallel-layout sets v (megatron-core counts it)

    try:
        return layout_chunks(args)
    except KoalaError as exc:
        raise MegatronScheduleError(str(exc)) from None


#: v as --pipeline-model-parallel-layout gives it (stages per pipeline rank) when the virtual size is unset.
LAYOUT_V = Setting("--pipeline-model-parallel-layout",
                   "--pipeline-model-parallel-layout gives {value} stage(s) per pipeline rank",
                   "give --pipeline-model-parallel-layout {value} stage(s) per pipeline rank (separated by |)")


def _check_sizes(spec: str, args, settings=MEGATRON) -> Placement | None:
    """Check the schedule against the flags now, before any process group or model exists: the
    whole schedule when the flags give p, v and the number of microbatches; else p and v (a
    fixed file's, or whether a program supports them). Its placement (None without p).
    `settings`: MEGATRON, or MEGATRON_LM (what its messages suggest instead)."""
    p = getattr(args, "pipeline_model_parallel_size", None)
    if p is None:
        return None
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    for flag, value in (("--pipeline-model-parallel-size", p), ("--virtual-pipeline-model-parallel-size", vp)):
        if value is not None and value < 1:  # 0 read as 1, -2 blamed on --num-layers
            raise MegatronScheduleError(f"{flag} {value}: must be >= 1")
    v = vp or _layout_chunks(args) or 1
    if getattr(args, "pipeline_model_parallel_layout", None):  # v is the layout's (Megatron-LM sets the
        settings = dataclasses.replace(settings, v=LAYOUT_V)     # virtual size from it): messages name it
    if p == 1 and v > 1:  # megatron-core's initialize_model_parallel refuses it (a traceback)
        raise MegatronScheduleError(f"{settings.v.given.format(name=settings.v.name, value=v)} with "
                                    f"--pipeline-model-parallel-size 1, which megatron-core refuses (model chunks "
                                    f"need two pipeline ranks or more): use one chunk per rank, or a larger "
                                    f"--pipeline-model-parallel-size")
    m = microbatches_from_args(args)
    if m is not None:
        return resolve(spec, p, m, v, settings).placement  # cached: the runtime finds it resolved
    if spec.endswith(FIXED_SUFFIXES) and spec not in library.names():
        schedule = load(spec, p, None, v, settings)
        check_fit(schedule, p, None, v, settings)  # m: the file's, checked per step
        return schedule.placement
    program = library.load_program(spec)  # supports (p, v) with some m (the step's m is checked when known)
    reason = program.supports(p, max(p * v, 1) * 2, v, settings.names)
    if reason is not None:
        raise MegatronScheduleError(f"--koala-schedule {spec} with --pipeline-model-parallel-size {p} and "
                                    f"--virtual-pipeline-model-parallel-size {v}: {reason}")
    return program.make_placement(p, v)


def _check_megatron_chunks(spec: str, placement: Placement) -> None:
    """megatron-core's model builder (megatron.training's get_model, by `vp_stage`) gives chunk c
    of pipeline rank r virtual stage c x p + r, and Megatron-LM's forward_step and data loading
    assume it: the schedule's placement must be that one, the interleaved placement (linear with
    one chunk)."""
    megatron = Placement.named("interleaved", placement.p, placement.chunks_per_rank)
    for r in range(placement.p):
        for c, (stage, built) in enumerate(zip(placement.stages_of(r), megatron.stages_of(r))):
            if stage != built:
                raise MegatronScheduleError(
                    f"--koala-schedule {spec}: its {placement.style} placement runs stage {stage} in model chunk "
                    f"{c} of pipeline rank {r}, where megatron-core's model builder puts stage {built} "
                    f"(chunk c of rank r = stage c x p + r): choose a schedule with the interleaved placement "
                    f"(e.g. interleaved-1f1b, or zb-h1 with one chunk), or build each chunk from "
                    f"koala_ds.megatron.stage_layers and call install(args, chunks='schedule') as "
                    f"examples/megatron_gpt does")


def _check_tied_embeddings(spec: str, placement: Placement, args) -> None:
    """Megatron-LM ties the input and output embeddings unless --untie-embeddings-and-output-weights,
    and megatron-core can tie them only where its embedding group is (`tied_embeddings_conflict`).
    Checked before the model is built: building tied chunks under another placement fails or
    waits inside megatron-core. Args without that flag (a script of its own) are not checked
    here; the runtime checks the chunks themselves."""
    if getattr(args, "untie_embeddings_and_output_weights", True):
        return
    conflict = tied_embeddings_conflict(placement)
    if conflict is not None:
        raise MegatronScheduleError(f"--koala-schedule {spec}: its {placement.style} placement {conflict}: add "
                                    f"--untie-embeddings-and-output-weights, or choose a schedule with the "
                                    f"interleaved placement")


#: Megatron-LM's flags that save or load model weights, as (attribute, flag).
CHECKPOINT_FLAGS = (("save", "--save"), ("load", "--load"), ("pretrained_checkpoint", "--pretrained-checkpoint"))


def _check_no_checkpoints(placement: Placement, args) -> None:
    """Chunks built per the schedule's placement number their layers from 0 in megatron-core's
    checkpoints (docs/megatron.md, Limits), so on more than one stage every chunk would save
    to, and load from, the same checkpoint slots: refused before anything is built or loaded."""
    if placement.num_stages == 1:
        return
    for attr, flag in CHECKPOINT_FLAGS:
        if getattr(args, attr, None):
            raise MegatronScheduleError(
                f"{flag}: checkpoints of model chunks built per the schedule's placement are not supported yet "
                f"(docs/megatron.md, Limits): megatron-core numbers each such chunk's layers from 0, so every chunk "
                f"would save to and load from the same checkpoint slots; drop {flag}, or build the chunks with "
                f"megatron-core's own builder (koala_ds.megatron.install(args)) and a schedule with its placement")


@dataclass
class InstallReport:
    """What `install` did, for the log and for tests."""

    schedule: str | None
    patched: list = field(default_factory=list)  # "module.attribute"
    skipped: list = field(default_factory=list)  # "module (why)"
    func: object = None

    def __str__(self) -> str:
        if self.schedule is None:
            return "koala: --pipeline-schedule default: megatron-core's own schedule runs (nothing patched)"
        return f"koala: schedule {self.schedule!r} routed through {', '.join(self.patched)}"

    def details(self) -> str:
        """str(self) and the modules not patched, with why (megatron-core alone has no megatron.training)."""
        return str(self) + (f"; not present: {', '.join(self.skipped)}" if self.skipped else "")


def install(args, chunks: str = "megatron") -> InstallReport:
    """Route Megatron's training loop to the Koala runtime when `--pipeline-schedule koala`.

    `chunks`: "megatron" (the default) when megatron-core's model builder makes the model
    chunks (Megatron-LM's get_model: chunk c of pipeline rank r holds virtual stage c x p + r):
    then only schedules with that placement (linear, interleaved) are accepted; "schedule" when
    the script builds chunk c of rank r as the schedule's stage `chunk_stages(schedule, r)[c]`
    (`stage_layers`; examples/megatron_gpt), which any placement (V-shape too) needs.

    Patches `get_forward_backward_func` in every module of PATCH_TARGETS that is importable
    (megatron-core from PyPI has no megatron.training: then only megatron-core is patched and
    the report says so). Safe to call twice."""
    spec = schedule_from_args(args, chunks)
    report = InstallReport(spec)
    if spec is None:
        log.info("%s", report)
        return report
    from .runtime import get_forward_backward_func

    func = get_forward_backward_func(spec, getattr(args, "koala_profile", None),
                                     timeout_s=getattr(args, "koala_p2p_timeout", None),
                                     timeout_name="--koala-p2p-timeout", trace=getattr(args, "koala_trace", None),
                                     trace_name="--koala-trace")

    def koala_get_forward_backward_func(pp_size=None, vp_size=None):
        del pp_size, vp_size  # megatron-core's signature; the schedule was fitted by install()
        return func

    koala_get_forward_backward_func.koala_func = func
    for module_name, attr in PATCH_TARGETS:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            report.skipped.append(f"{module_name} ({exc.__class__.__name__}: {exc})")
            _log_skipped(module_name, exc)
            continue
        setattr(module, attr, koala_get_forward_backward_func)
        report.patched.append(f"{module_name}.{attr}")
    report.func = func
    log.info("%s", report)
    return report


def _log_skipped(module_name: str, exc: ImportError) -> None:
    """Debug when the module is simply absent (megatron-core has no megatron.training); a warning
    when it is there but failed to import, since then its training loop is not routed to Koala."""
    absent = isinstance(exc, ModuleNotFoundError) and exc.name and (module_name + ".").startswith(exc.name + ".")
    (log.debug if absent else log.warning)("koala: %s not patched: %s: %s", module_name,
                                           exc.__class__.__name__, exc)
