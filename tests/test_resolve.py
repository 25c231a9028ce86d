"""The one resolver (koala_ds.resolve): a schedule name or file and a run's (p, m, v) -> the
schedule that fits, with every error in the front end's own terms. No torch needed."""
from __future__ import annotations

import json
import os

import pytest

from koala_ds.dsl import KoalaCompileError
from koala_ds.core.ir import KoalaError, Placement
from koala_ds.resolve import load_schedule
from koala_ds.resolve import (CLI, DEEPSPEED, MEGATRON, ScheduleFitError, check_fit, check_launch, check_spec, load,
                              load_profile, resolve)

P4_ONLY = "schedule p4only\nsupports p == 4\nplacement linear\nbackward full\nrank:\n  F? * m\n  B? * m\n"


@pytest.fixture
def m4_json(tmp_path):
    path = tmp_path / "m4.json"
    path.write_text(load_schedule("1f1b", 2, 4).to_json())
    return str(path)


def test_a_fixed_file_is_taken_as_written_by_load_and_checked_by_resolve(m4_json):
    assert load(m4_json, 2, 8, 1, MEGATRON).m == 4  # as written
    assert resolve(m4_json, 2, 4, 1, MEGATRON).same_order(load_schedule("1f1b", 2, 4))
    assert resolve(m4_json, None, None, None).m == 4  # the CLI: -p, -m, -v default to the file's


def test_cli_names_its_options(m4_json):
    with pytest.raises(ScheduleFitError, match=r"m4.json was made for m=4 but m=8 was asked for: change -m to 4, "
                                               r"or use a schedule made for m=8$"):
        resolve(m4_json, 2, 8, 1)
    with pytest.raises(ScheduleFitError, match=r"^-p and -m needed to compile '1f1b' \(e.g. -p 4 -m 8\)$"):
        resolve("1f1b", None, None, None)


def test_deepspeed_names_its_config_keys_and_module_arguments(m4_json):
    with pytest.raises(ScheduleFitError, match=r"but the DeepSpeed config gives gradient_accumulation_steps=8: "
                                               r"set gradient_accumulation_steps=4 \(train_batch_size"):
        resolve(m4_json, 2, 8, 1, DEEPSPEED)
    with pytest.raises(ScheduleFitError, match=r"was made for p=2 but the PipelineModule has 4 stages .*: "
                                               r"set the PipelineModule's num_stages=2"):
        resolve(m4_json, 4, 4, 1, DEEPSPEED)
    with pytest.raises(ScheduleFitError, match=r"^\"pipeline.koala.schedule\": unknown schedule 'zb-h3' "
                                               r"\(did you mean 'zb-h2'\?\)"):
        resolve("zb-h3", 2, 4, 1, DEEPSPEED)


def test_megatron_names_its_flags(m4_json):
    with pytest.raises(ScheduleFitError, match=r"^--koala-schedule .*m4.json was made for v=1 but "
                                               r"--virtual-pipeline-model-parallel-size gives 2 .*: "
                                               r"set --virtual-pipeline-model-parallel-size 1"):
        resolve(m4_json, 2, 4, 2, MEGATRON)
    with pytest.raises(ScheduleFitError, match=r"this step has num_microbatches=8: set --global-batch-size / "
                                               r"--micro-batch-size so that there are 4 microbatches"):
        resolve(m4_json, 2, 8, 1, MEGATRON)
    with pytest.raises(ScheduleFitError, match="change --virtual-pipeline-model-parallel-size"):
        resolve("zb-v", 2, 8, 1, MEGATRON)  # the DSL's own message, in the engine's words


def test_compile_errors_name_the_engines_setting_and_keep_the_dsls_class_on_the_cli(tmp_path):
    path = tmp_path / "p4.koala"
    path.write_text(P4_ONLY)
    with pytest.raises(ScheduleFitError, match=rf"^--koala-schedule {path}: .*needs p == 4.*"
                                               rf"change --pipeline-model-parallel-size"):
        resolve(str(path), 2, 4, 1, MEGATRON)
    with pytest.raises(KoalaCompileError, match="change -p"):
        resolve(str(path), 2, 4, 1)


def test_missing_files_and_non_names_are_one_error_class_in_every_front_end(tmp_path):
    missing = str(tmp_path / "nope.json")
    for settings, start in ((CLI, ""), (DEEPSPEED, '"pipeline.koala.schedule" '), (MEGATRON, "--koala-schedule ")):
        with pytest.raises(ScheduleFitError, match=f"^{start}{missing}: no such file$"):
            resolve(missing, 2, 4, 1, settings)
        with pytest.raises(ScheduleFitError, match="is a directory, not a file"):
            check_spec(str(tmp_path) + "/", settings)
        with pytest.raises(ScheduleFitError, match="expected a schedule name or a file path, got 5"):
            check_spec(5, settings)
    assert issubclass(ScheduleFitError, KoalaError)


def test_the_cli_names_the_file_of_a_schedule_that_does_not_validate(tmp_path):
    """Validation errors name the schedule ('1f1b'); from a file the CLI did not say which file."""
    data = json.loads(load_schedule("1f1b", 2, 2).to_json())
    data["ranks"][1][1] = "1B9"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(KoalaError) as info:
        resolve(str(path), None, None, None, CLI)
    assert str(info.value).startswith(f"{path}: schedule '1f1b' (p=2, m=2, v=1): 1B9: ")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
def test_a_pipe_given_as_a_schedule_or_profile_is_not_called_missing(tmp_path):
    """A named pipe (or a device) exists: it was reported as 'no such file'."""
    from koala_ds.sim import load_profile
    from koala_ds.sim.profile import ProfileError

    fifo = tmp_path / "s.json"
    os.mkfifo(fifo)
    with pytest.raises(ScheduleFitError, match=r"s\.json: not a regular file \(a device, a pipe or a socket\)$"):
        check_spec(str(fifo), CLI)
    with pytest.raises(ProfileError, match=r"s\.json is not a regular file"):
        load_profile(fifo)


def test_engines_refuse_two_pipelines_the_cli_shows_them():
    chimera = load_schedule("chimera", 2, 4)
    assert resolve(chimera, 2, 4, 1) is chimera
    for settings, engine in ((DEEPSPEED, "DeepSpeed's PipelineEngine"), (MEGATRON, "the Megatron runtime")):
        with pytest.raises(ScheduleFitError, match=f"runs 2 pipelines .*which {engine} cannot host"):
            resolve(chimera, 2, 4, 1, settings)


def test_a_models_placement_is_checked_with_the_engines_fix():
    zbv = load_schedule("zb-v", 2, 4, 2)
    with pytest.raises(ScheduleFitError, match=r"but the model holds 2 chunk\(s\) per rank placed interleaved.*: "
                                               r"build the model as koala_ds.deepspeed.KoalaPipelineModule\(layers, "
                                               r"num_stages=2, chunks=2, placement='vshape'\)\.$"):
        check_fit(zbv, 2, 4, 2, DEEPSPEED, placement=Placement.named("interleaved", 2, 2))
    check_fit(zbv, 2, 4, 2, DEEPSPEED, placement=Placement.named("vshape", 2, 2))


def test_profiles_are_read_by_the_simulators_loader_and_named_after_the_setting(tmp_path):
    assert load_profile("uniform-4", MEGATRON).num_stages == 4  # a bundled name works for the engines too
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ScheduleFitError, match=rf"^--koala-profile {bad}:1:2: not a JSON file"):
        load_profile(str(bad), MEGATRON)
    with pytest.raises(ScheduleFitError, match=r'^"pipeline.koala.profile": .*stages'):
        load_profile({"version": 1, "p2p_latency": 0}, DEEPSPEED)
    with pytest.raises(ScheduleFitError, match=r"^--koala-profile .*nope.json.*no such file"):
        load_profile(str(tmp_path / "nope.json"), MEGATRON)


def test_a_profile_file_is_named_once_in_its_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "p2p_latency": 0}')
    with pytest.raises(ScheduleFitError) as err:
        load_profile(str(bad), MEGATRON)
    assert str(err.value) == f"--koala-profile {bad}: missing field 'stages'"


def test_the_launcher_check_says_what_is_wrong_with_its_flags_on_one_line(tmp_path, m4_json):
    """patches/deepspeed's launcher calls check_launch before it starts any rank: the schedule's
    name or file and the profile, named by the launcher's flags; p, m and v are not known yet."""
    assert check_launch("zb-h1", "uniform-4") is None and check_launch(m4_json, None) is None
    assert check_launch(None, None) is None  # the schedule then comes from the DeepSpeed config
    assert check_launch("zb-h3", None).startswith("--koala_schedule: unknown schedule 'zb-h3' (did you mean 'zb-h2'?)")
    program = tmp_path / "mine.koala"
    program.write_text("schedule mine\nplacement linear\nrank:\n  F F *\n")
    problem = check_launch(str(program), None)
    assert problem.startswith(f"--koala_schedule {program}:4:") and "\n" not in problem
    broken = tmp_path / "broken.json"
    broken.write_text('{"version": 1}')
    assert check_launch(str(broken), None).startswith(f"--koala_schedule {broken}: missing field")
    assert check_launch(str(tmp_path), None) == f"--koala_schedule {tmp_path} is a directory, not a file"
    assert check_launch("zb-h1", "nope.json").startswith("--koala_profile nope.json: ")
    program.write_text(P4_ONLY)  # valid: that it supports only p = 4 is checked when p is known
    assert check_launch(str(program), None) is None


def test_megatron_reads_an_edited_schedule_file_again(tmp_path):
    from koala_ds.megatron.resolve import resolve as megatron_resolve

    path = tmp_path / "s.json"
    path.write_text(load_schedule("1f1b", 2, 4).to_json())
    assert megatron_resolve(str(path), 2, 4, 1).name == "1f1b"
    assert megatron_resolve(str(path), 2, 4, 1) is megatron_resolve(str(path), 2, 4, 1)  # cached per step
    data = json.loads(load_schedule("zb-h1", 2, 4).to_json())
    path.write_text(json.dumps(data) + "\n" * 7)  # another size, so the stamp changes even within a tick
    assert megatron_resolve(str(path), 2, 4, 1).name == "zb-h1"


def test_megatron_launch_checks_a_koala_program_against_p_before_m_is_known(tmp_path):
    # without --global-batch-size the number of microbatches is not known at install time; a
    # .koala program that cannot run on p ranks is still refused then, naming the flag
    import argparse

    from koala_ds.megatron.launch import add_arguments, schedule_from_args

    path = tmp_path / "p4.koala"
    path.write_text(P4_ONLY)
    args = add_arguments(argparse.ArgumentParser()).parse_args(
        ["--pipeline-schedule", "koala", "--koala-schedule", str(path)])
    args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size = 2, None
    with pytest.raises(ScheduleFitError, match="needs p == 4.*change --pipeline-model-parallel-size"):
        schedule_from_args(args)
    args.pipeline_model_parallel_size = 4
    assert schedule_from_args(args) == str(path)


def test_a_given_source_names_the_schedule_in_every_message(tmp_path):
    # the DeepSpeed engine says where the schedule came from (koala_schedule=, the config, KOALA_SCHEDULE)
    source = "koala_schedule='x'"
    for spec, message in ((str(tmp_path / "x.json"), f"^{source}: no such file$"),
                          ("zb-h3", f"^{source}: unknown schedule 'zb-h3'"),
                          ("zb-v", f"^{source}: .*change the KoalaPipelineModule's chunks")):
        with pytest.raises(ScheduleFitError, match=message):
            resolve(spec, 2, 8, 1, DEEPSPEED, source)


@pytest.mark.parametrize("profile", [5, ["a"], ""])
def test_a_profile_setting_that_is_not_a_path_is_one_line_naming_the_setting(profile):
    """It was a TypeError (expected str, bytes or os.PathLike object, not int) from deep inside."""
    for settings in (DEEPSPEED, MEGATRON):
        with pytest.raises(ScheduleFitError) as info:
            load_profile(profile, settings)
        assert str(info.value) == (f"{settings.profile}: expected a profile file, a bundled profile name or a parsed "
                                   f"profile (dict), got {profile!r}")


def test_a_parsed_profile_names_the_setting_once():
    with pytest.raises(ScheduleFitError) as info:
        load_profile({"version": 1}, DEEPSPEED)
    assert str(info.value).count("pipeline.koala.profile") == 1, str(info.value)
