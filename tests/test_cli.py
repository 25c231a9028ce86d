import subprocess
import sys

import pytest

from koala_ds.cli import main
from koala_ds.core.ir import Schedule
from koala_ds.library import get


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_list_names_every_schedule(capsys):
    code, out, _ = run(capsys, "list")
    assert code == 0
    for name in ("1f1b", "zb-v", "interleaved-1f1b"):
        assert any(line.startswith(name + " ") for line in out.splitlines())
    assert "v == 2, m >= 2 * p - 1" in out


def test_show_prints_a_time_grid(capsys):
    code, out, _ = run(capsys, "show", "1f1b", "-p", "2", "-m", "2")
    assert code == 0
    lines = out.splitlines()
    assert "peak in-flight activations per rank [2, 1]" in lines[0]
    assert lines[2].split() == ["rank", "0", "0F0", "0F1", ".", "0B0", ".", "0B1"]
    assert lines[3].split() == ["rank", "1", ".", "1F0", "1B0", "1F1", "1B1", "."]


def test_export_formats_round_trip(capsys, tmp_path):
    for fmt, suffix in (("json", ".json"), ("torch-csv", ".csv"), ("koala", ".koala")):
        out = tmp_path / f"s{suffix}"
        code, _, _ = run(capsys, "export", "zb-v", "-p", "2", "-m", "4", "-v", "2", "--format", fmt, "-o", str(out))
        assert code == 0
        code, text, _ = run(capsys, "validate", str(out), "-p", "2", "-m", "4", "-v", "2")
        assert code == 0 and text.startswith("ok: ")
    assert Schedule.from_json((tmp_path / "s.json").read_text()).same_order(get("zb-v").compile(2, 4, 2))
    code, text, _ = run(capsys, "export", "1f1b", "-p", "2", "-m", "2", "--format", "torch-csv")
    assert text == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"


@pytest.mark.parametrize("argv,message", [
    (["show", "zb-v", "-p", "4", "-m", "4", "-v", "2"], "needs m >= 2 * p - 1"),
    (["show", "nosuch", "-p", "2", "-m", "2"], "unknown schedule 'nosuch'"),
    (["show", "1f1b", "-m", "2"], "-p needed"),
    (["validate", "missing.koala", "-p", "2", "-m", "2"], "missing.koala: no such file"),
])
def test_errors_are_messages_not_tracebacks(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err and "Traceback" not in err


def test_syntax_error_from_console_script(tmp_path):
    bad = tmp_path / "bad.koala"
    bad.write_text("schedule bad\nrank:\n  F * (m +)\n")
    proc = subprocess.run([sys.executable, "-m", "koala_ds.cli", "validate", str(bad), "-p", "2", "-m", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"{bad}:3:11:" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("suffix", [".json", ".csv", ".koala"])
def test_export_writes_what_the_suffix_of_o_is_read_back_as(tmp_path, capsys, suffix):
    """`koala export 1f1b -o best.json` wrote .koala text into best.json, which then did not load."""
    out = tmp_path / f"best{suffix}"
    assert main(["export", "zb-h1", "-p", "2", "-m", "4", "-o", str(out)]) == 0
    assert main(["validate", str(out), "-p", "2", "-m", "4"]) == 0
    if suffix == ".json":
        assert get("zb-h1").compile(2, 4, 1).same_order(Schedule.from_json(out.read_text()))


def test_export_refuses_a_format_the_suffix_would_not_read_back(tmp_path, capsys):
    assert main(["export", "1f1b", "-p", "2", "-m", "2", "--format", "koala", "-o", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "a .json file is read back as json, not koala" in err, err
    assert not (tmp_path / "b.json").exists()
    assert main(["export", "1f1b", "-p", "2", "-m", "2", "--format", "json", "-o", str(tmp_path / "b.txt")]) == 0


def test_a_two_pipeline_schedule_is_not_exported_as_torch_csv(tmp_path, capsys):
    """Chimera's CSV said 'wrote' and read back as one pipeline with v=2 ('missing forward 0F1')."""
    assert main(["export", "chimera", "-p", "4", "-m", "4", "-o", str(tmp_path / "c.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert "chimera runs 2 pipelines" in err and "write it as koala or json" in err, err
    assert not (tmp_path / "c.csv").exists()


def test_a_profile_whose_stages_v_does_not_divide_asks_for_another_v(capsys):
    """It said 'give -p', which cannot help: the profile's stages are p x v."""
    assert main(["compare", "--profile", "uniform-4", "-m", "4", "-v", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("uniform-4 has 4 stages, not a multiple of v=3 (the stages are p x v): change -v to one of "
                        "1, 2, 4"), err


def test_one_rank_is_never_idle_and_its_bubble_is_not_negative(capsys):
    """p = 1 printed 'bubble -0.00%' and idle -5.45697e-12 (float noise)."""
    from koala_ds.resolve import load_schedule
    from koala_ds.sim import simulate
    from koala_ds.sim.layers import load_layer_profile

    lp = load_layer_profile("gpt-largevocab-32L")
    result = simulate(load_schedule("1f1b", 1, 32, 1), lp.stage_profile([lp.num_layers], 1))
    assert result.idle == (0.0,) and result.bubble_ratio == 0.0


def test_a_fixed_schedule_file_and_a_profile_of_other_stages_ask_for_another_profile(tmp_path, capsys):
    """It advised '-p 4 for v=2', which a .json schedule (p and v its own) cannot take."""
    path = tmp_path / "il.json"
    assert main(["export", "interleaved-1f1b", "-p", "2", "-m", "4", "-v", "2", "-o", str(path)]) == 0
    capsys.readouterr()
    for command in ("simulate", "show"):
        assert main([command, str(path), "--profile", "gpt-lmhead-8"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.endswith(f"gpt-lmhead-8 has 8 stages but {path} is a schedule of p x v = 2 x 2 = 4 stages: give "
                            f"--profile a profile of 4 stages"), err
