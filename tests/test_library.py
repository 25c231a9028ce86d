import pytest

from koala_ds.dsl import KoalaCompileError
from koala_ds.core.ir import KoalaError
from koala_ds.library import get, load_program, names
from koala_ds.resolve import load_schedule
from koala_ds.core.validate import validate

REQUIRED = ["gpipe", "1f1b", "eager-1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1", "zb-h2", "zb-v", "v-half",
            "v-min", "dualpipe-v", "chimera", "hanayo"]


def test_library_has_every_known_schedule():
    missing = [n for n in REQUIRED if n not in names()]
    assert not missing, f"library lacks {missing}"
    for name in names():
        prog = get(name)
        assert prog.description and prog.source, f"{name} needs a description and a source"
        assert len(prog.text.splitlines()) <= 45, f"{name}.koala should stay short"


@pytest.mark.parametrize("name", names())
def test_grid_every_supported_configuration_is_valid(name):
    """Every (p, m, v) with p in 1..8, m in 1..4p, v in 1..3 compiles to a valid, deadlock-free
    schedule when supported, and is refused with a message naming what to change otherwise."""
    prog = get(name)
    supported = 0
    for p in range(1, 9):
        for m in range(1, 4 * p + 1):
            for v in (1, 2, 3):
                reason = prog.supports(p, m, v)
                if reason is None:
                    s = prog.compile(p, m, v)  # compile() runs the validator, which raises on any fault
                    assert (s.p, s.m, s.v) == (p, m, v)
                    # every stage does one forward and one input gradient per microbatch it sees
                    per_mb = sum(1 for r in s.ranks for a in r if a.op.value in "FBI")
                    assert per_mb == 2 * s.num_stages * m // s.placement.pipelines
                    supported += 1
                else:
                    assert "change -" in reason, reason
                    with pytest.raises(KoalaCompileError, match="change -"):
                        prog.compile(p, m, v)
    assert supported > 0


def test_1f1b_peak_in_flight_is_p_minus_r():
    for p, m in [(4, 8), (8, 16), (3, 2)]:
        assert validate(get("1f1b").compile(p, m)).peak_in_flight == [min(p - r, m) for r in range(p)]


def test_gpipe_holds_every_microbatch():
    assert validate(get("gpipe").compile(4, 6)).peak_in_flight == [6] * 4


def test_zb_h1_has_1f1b_memory_and_zb_v_1f1b_memory_in_half_chunks():
    for p, m in [(4, 8), (6, 12)]:
        one = validate(get("1f1b").compile(p, m)).peak_in_flight
        assert validate(get("zb-h1").compile(p, m)).peak_in_flight == one
        # ZB-V's chunks are half a 1F1B stage: 2p half-chunks = p stages, on every rank
        assert validate(get("zb-v").compile(p, m, 2)).peak_in_flight == [2 * p] * p


def test_unknown_name_and_missing_file_errors():
    with pytest.raises(KoalaError, match="unknown schedule 'zb-h9'.*library schedules: .*1f1b"):
        load_program("zb-h9")
    with pytest.raises(FileNotFoundError, match="nope.koala does not exist"):
        load_program("nope.koala")
    with pytest.raises(KoalaError, match="x.json: no such file"):  # one line in run_main, not a traceback
        load_schedule("x.json", 2, 2)


def test_user_files_load_by_path(tmp_path):
    path = tmp_path / "mine.koala"
    path.write_text(get("1f1b").text.replace("schedule 1f1b", "schedule mine"))
    s = load_schedule(str(path), 4, 8)
    assert s.name == "mine" and s.same_order(get("1f1b").compile(4, 8))
    fixed = tmp_path / "fixed.json"
    fixed.write_text(s.to_json())
    assert load_schedule(str(fixed), 4, 8).same_order(s)
    with pytest.raises(KoalaError, match="made for m=8 but m=6 was asked for: change -m"):
        load_schedule(str(fixed), 4, 6)
    csv = tmp_path / "fixed.csv"
    csv.write_text(get("zb-h1").compile(2, 4).to_torch_csv())
    assert load_schedule(str(csv), 2, 4).backward == "split"
