"""One resolver for every front end: what the user named (a Schedule, a library name, a `.koala`
program, a `.json` / `.csv` schedule file) and the (p, m, v) a run has -> the schedule that fits.

The CLI (`koala show|validate|export|simulate`), `load_schedule` (below), the DeepSpeed
engine and the Megatron launcher and runtime all call `resolve`. What differs between them is
how the user *spells* p, m and v (and the schedule and profile settings): `Settings` holds
that, and every message this module raises names the user's own setting and the value to set
it to. `CLI`, `DEEPSPEED`, `MEGATRON` and `TORCH` are the vocabularies (`MEGATRON_LM`: Megatron's,
where Megatron-LM builds the model chunks; `DEEPSPEED_LAUNCHER`: the patched `deepspeed` launcher's
flags, which `check_launch` checks before any rank starts).

One error class: `ScheduleFitError` (a KoalaError). The engines' older names for it,
`koala_ds.deepspeed.KoalaConfigError` and `koala_ds.megatron.MegatronScheduleError`, are
aliases of it. No torch here: the launchers resolve before any process group exists.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from . import library
from .core.errors import one_line
from .core.ir import CLI_NAMES, KoalaError, Placement, Schedule, ScheduleError
from .core.validate import validate

#: A schedule file's suffixes: a program to compile, or a fixed schedule taken as written.
PROGRAM_SUFFIX = ".koala"
FIXED_SUFFIXES = library.FIXED_SUFFIXES


class ScheduleFitError(KoalaError):
    """What the user set up (a schedule and the engine's settings) does not fit together; the
    message names the setting to change, in the user's terms."""


@dataclass(frozen=True)
class Setting:
    """How a front end spells one of p, m, v. Templates take {name}, {key} (p, m or v), {value}."""

    name: str  # '-m', '"gradient_accumulation_steps"', '--pipeline-model-parallel-size'
    given: str = "{name} is {value}"  # what the run has: "... but <given>"
    fix: str = "set {name} {value}"  # how to make the run match the schedule: "...: <fix>"


@dataclass(frozen=True)
class Settings:
    """A front end's vocabulary for the schedule, p, m, v and the profile."""

    schedule: str | None  # the schedule setting ('--koala-schedule'); None: the CLI's argument
    p: Setting
    m: Setting
    v: Setting
    engine: str | None = None  # who cannot host two pipelines per rank; None: any placement is fine
    profile: str = "the profile"
    example: str = ""  # " (e.g. -p 4 -m 8)" after "... needed to compile"
    placement_fix: str = ""  # for a placement other than the model's: {p}, {v}, {style}
    one_pipeline: str = "a single-pipeline schedule (e.g. zb-v or dualpipe-v)"  # what `engine` can host

    @property
    def names(self) -> dict:
        """{"p": ..., "m": ..., "v": ...}: the setting names, as the DSL's messages take them."""
        return {"p": self.p.name, "m": self.m.name, "v": self.v.name}


CLI = Settings(None, *(Setting(CLI_NAMES[key], "{key}={value} was asked for", "change {name} to {value}")
                       for key in ("p", "m", "v")), profile="--profile", example=" (e.g. -p 4 -m 8)")

DEEPSPEED = Settings(
    '"pipeline.koala.schedule"',
    Setting("the PipelineModule's num_stages",
            "the PipelineModule has {value} stages (num_stages / topology pipe dimension)",
            "set the PipelineModule's num_stages={value}"),
    Setting('"gradient_accumulation_steps"', "the DeepSpeed config gives gradient_accumulation_steps={value}",
            "set gradient_accumulation_steps={value} (train_batch_size = micro batch x {value} x data parallel)"),
    Setting("the KoalaPipelineModule's chunks", "the model holds {value} chunk(s) per rank",
            "build the model with KoalaPipelineModule(..., chunks={value})"),
    engine="DeepSpeed's PipelineEngine", profile='"pipeline.koala.profile"',
    placement_fix="build the model as koala_ds.deepspeed.KoalaPipelineModule(layers, num_stages={p}, chunks={v}, "
                  "placement={style!r})")

MEGATRON = Settings(
    "--koala-schedule",
    Setting("--pipeline-model-parallel-size"),
    Setting("--global-batch-size / --micro-batch-size (the number of microbatches)",
            "this step has num_microbatches={value}",
            "set --global-batch-size / --micro-batch-size so that there are {value} microbatches"),
    Setting("--virtual-pipeline-model-parallel-size",
            "--virtual-pipeline-model-parallel-size gives {value} model chunk(s) per rank",
            "set --virtual-pipeline-model-parallel-size {value} (unset means 1; the model is a list of that many "
            "chunks)"),
    engine="the Megatron runtime", profile="--koala-profile")

#: DeepSpeed's launcher, patched (patches/deepspeed): `deepspeed --koala_schedule ... --koala_profile ...`
DEEPSPEED_LAUNCHER = replace(DEEPSPEED, schedule="--koala_schedule", profile="--koala_profile")

#: torch.distributed.pipelining (`koala_ds.torch.schedule(stages, n_microbatches, loss_fn, spec)`): p and v
#: come from the user's PipelineStage objects (group size; num_stages / group size), m is n_microbatches.
TORCH = Settings(
    "koala_ds.torch.schedule's spec",
    Setting("the PipelineStage's group size", "the PipelineStage's process group has {value} ranks",
            "run the pipeline on {value} ranks (the PipelineStage's group)"),
    Setting("n_microbatches", "n_microbatches is {value}", "pass n_microbatches={value}"),
    Setting("the number of PipelineStage objects per rank",
            "each rank holds {value} PipelineStage(s) (num_stages / group size)",
            "build {value} PipelineStage(s) per rank (num_stages = {value} x the group size)"),
    engine="torch.distributed.pipelining")

#: Megatron-LM's own model builder (`install(args)`, chunks="megatron"): chunk c of rank r holds
#: stage c x p + r, so only the interleaved placement fits.
MEGATRON_LM = replace(MEGATRON, one_pipeline="a schedule with the interleaved placement (e.g. interleaved-1f1b, "
                                              "or zb-h1 with one chunk)")


def looks_like_path(spec: str) -> bool:
    """A file rather than a library name: it has a schedule suffix or a path separator."""
    return spec.endswith((PROGRAM_SUFFIX, *FIXED_SUFFIXES)) or os.sep in spec or "/" in spec


def _where(spec, settings: Settings) -> str:
    """How messages name the schedule: '--koala-schedule x.json', 'x.json', "schedule 'mine'"."""
    if isinstance(spec, Schedule):
        return f"schedule {spec.name!r}"
    return f"{settings.schedule} {spec}" if settings.schedule else str(spec)


def check_spec(spec, settings: Settings, source: str | None = None) -> None:
    """Fail early on what cannot be a schedule: not a name or path, a missing file, an unknown
    name (the closest library name is suggested). Nothing is compiled. `source`: how messages
    name the schedule (default: the schedule setting and `spec`)."""
    if isinstance(spec, Schedule):
        return
    label = source or settings.schedule
    if not isinstance(spec, (str, os.PathLike)) or not str(spec):
        raise ScheduleFitError(f"{label or 'the schedule'}: expected a schedule name or a file path, got {spec!r}")
    text = str(spec)
    if text in library.names():
        return
    if looks_like_path(text) or os.path.exists(text):
        if not os.path.isfile(text):
            what = (" is a directory, not a file" if os.path.isdir(text) else
                    ": not a regular file (a device, a pipe or a socket)" if os.path.exists(text) else ": no such file")
            raise ScheduleFitError(f"{source or _where(text, settings)}{what}")
        return
    known = library.names()
    raise ScheduleFitError(f"{label + ': ' if label else ''}unknown schedule {text!r}"
                           f"{library.did_you_mean(text, known)}; library schedules: {', '.join(known)} "
                           f"(or give a path to a .koala, .json or .csv file)")


def check_source(spec, settings: Settings) -> None:
    """What can be checked of `spec` before p, m and v are known: `check_spec`, then a file's own
    content (a .koala program parsed; a .json / .csv schedule read and validated)."""
    check_spec(spec, settings)
    text = str(spec)
    if isinstance(spec, Schedule) or text in library.names():
        return
    try:
        if text.endswith(FIXED_SUFFIXES):
            validate(library.read_schedule_file(text))
        else:
            library.load_program(text)
    except KoalaError as exc:
        raise _user_error(exc, text, settings, None) from None


def check_launch(schedule: str | None, profile: str | None, settings: Settings = DEEPSPEED_LAUNCHER) -> str | None:
    """A launcher's check of its koala flags before any rank starts (patches/deepspeed): the
    first problem with the schedule or the profile as one line, or None."""
    try:
        if schedule is not None:
            check_source(schedule, settings)
        if profile is not None:
            load_profile(profile, settings)
    except KoalaError as exc:
        return one_line(exc)
    return None


def _user_error(exc: Exception, spec, settings: Settings, source: str | None) -> Exception:
    """An error from compiling or reading the schedule, named after the engine's setting (the CLI
    keeps the library's own error: its message already starts with the file or the name)."""
    if settings.schedule is None and source is None:
        return exc
    if source is None and str(exc).startswith(f"{spec}:"):  # "x.json:3: ..." names the file already
        return ScheduleFitError(f"{settings.schedule} {exc}")
    return ScheduleFitError(f"{source or _where(spec, settings)}: {exc}")


def load(spec, p: int | None, m: int | None, v: int | None, settings: Settings = CLI,
         source: str | None = None) -> Schedule:
    """The schedule `spec` names: a Schedule as given, a fixed .json / .csv file as written (see
    `check_fit`), a library name or .koala program compiled for (p, m, v) with errors in the
    words of `settings`. p, m or v None: a fixed file's own; a program needs p and m (v: 1)."""
    check_spec(spec, settings, source)
    if isinstance(spec, Schedule):
        return spec
    text = str(spec)
    try:
        if text.endswith(FIXED_SUFFIXES) and text not in library.names():
            return library.read_schedule_file(text)
        missing = [getattr(settings, k).name for k, val in (("p", p), ("m", m)) if val is None]
        if missing:
            raise ScheduleFitError(f"{' and '.join(missing)} needed to compile {text!r}{settings.example}")
        return library.compile_program(library.load_program(text), p, m, 1 if v is None else v, settings.names)
    except ScheduleFitError:
        raise
    except KoalaError as exc:
        raise _user_error(exc, text, settings, source) from None


def check_fit(schedule: Schedule, p: int | None, m: int | None, v: int | None, settings: Settings = CLI,
              source: str | None = None, placement: Placement | None = None) -> None:
    """Refuse a schedule made for another (p, m, v) than the run has (None: not known, not
    checked), or one the engine cannot host; the message says which setting to set to what.
    `placement`: the model's (DeepSpeed's module); its p and chunk placement must match."""
    where = source or _where(schedule, settings)
    pipelines = schedule.placement.pipelines
    if settings.engine and pipelines != 1:
        raise ScheduleFitError(f"{where} runs {pipelines} pipelines (placement {schedule.placement.describe()}): "
                               f"each rank would hold a second, separately updated model replica, which "
                               f"{settings.engine} cannot host. Use {settings.one_pipeline}.")
    if placement is not None:
        p, v = placement.p, None  # v: the placement check below says more
    for key, want in (("p", p), ("v", v), ("m", m)):
        have = getattr(schedule, key)
        if want is not None and have != want:
            setting = getattr(settings, key)
            given = setting.given.format(name=setting.name, key=key, value=want)
            fix = setting.fix.format(name=setting.name, key=key, value=have)
            raise ScheduleFitError(f"{where} was made for {key}={have} but {given}: {fix}, or use a schedule "
                                   f"made for {key}={want}")
    if placement is not None and schedule.placement.stage_ranks != placement.stage_ranks:
        ours = schedule.placement
        fix = settings.placement_fix.format(p=schedule.p, v=ours.chunks_per_rank, style=ours.style)
        raise ScheduleFitError(f"{where} places its {schedule.num_stages} virtual stages as {ours.describe()} "
                               f"(stage ranks {list(ours.stage_ranks)}) but the model holds "
                               f"{placement.chunks_per_rank} chunk(s) per rank placed {placement.describe()} "
                               f"(stage ranks {list(placement.stage_ranks)}): {fix}.")


def resolve(spec, p: int | None, m: int | None, v: int | None = 1, settings: Settings = CLI,
            source: str | None = None, placement: Placement | None = None) -> Schedule:
    """`spec` as a validated schedule that fits (p, m, v) and the engine: `load`, then `check_fit`
    and validation for what was not compiled here. `source` names the schedule in messages
    (default: the schedule setting and `spec`)."""
    schedule = load(spec, p, m, v, settings, source)
    compiled = schedule is not spec and not str(spec).endswith(FIXED_SUFFIXES)
    check_fit(schedule, p, m, v, settings, source or _where(spec, settings), placement)
    if not compiled:
        try:
            validate(schedule)
        except ScheduleError as exc:  # it names the schedule ('1f1b'): say which file held it
            named = exc if str(exc).startswith(str(spec)) else ScheduleError(f"{spec}: {exc}")
            raise _user_error(named, spec, settings, source) from None
    return schedule


def check_profile_stages(cost, placement: Placement, what: str, settings: Settings, shown) -> None:
    """A profile must give one entry per stage of the schedule (as `koala simulate` checks);
    `what` names the schedule, `shown` the profile."""
    stages, p, v = placement.num_stages, placement.p, placement.v
    if cost.num_stages not in (stages, stages // placement.pipelines):
        raise ScheduleFitError(f"{settings.profile} {shown}: {cost.num_stages} stage entries, but {what} has "
                               f"{stages} stages (p x v = {p} x {v}): give the profile of this model's stages "
                               f"(koala profile ... -p {p} -v {v})")


def load_profile(profile, settings: Settings):
    """A cost profile (`koala_ds.sim.CostProfile`) from a file, a bundled name or a parsed dict;
    its errors name the setting it came from."""
    from .sim.profile import CostProfile, ProfileError, load_profile as _load

    given = isinstance(profile, dict)
    if not given and (not isinstance(profile, (str, os.PathLike)) or not str(profile)):
        raise ScheduleFitError(f"{settings.profile}: expected a profile file, a bundled profile name or a parsed "
                               f"profile (dict), got {profile!r}")
    try:
        return CostProfile.from_dict(profile, settings.profile) if given else _load(profile)
    except ProfileError as exc:
        if given:  # its errors name the source given, the setting: once
            text = str(exc)
            raise ScheduleFitError(text if text.startswith(settings.profile) else f"{settings.profile}: {text}") \
                from None
        named = str(exc).startswith(f"{profile}:")  # "x.json: ..." names the file already
        where = settings.profile if named else f"{settings.profile} {profile}:"
        raise ScheduleFitError(f"{where} {exc}") from None


def load_schedule(name_or_path: str, p: int, m: int, v: int = 1) -> Schedule:
    """Compile a library schedule or a `.koala` file for (p, m, v), or load a fixed `.json` /
    `.csv` schedule and check that it was made for (p, m, v): `resolve` with
    koala's own -p, -m, -v in its messages (an engine passes its settings to `resolve`)."""
    return resolve(name_or_path, p, m, v)
