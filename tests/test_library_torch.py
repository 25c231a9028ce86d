"""The library reproduces torch.distributed.pipelining's orders for the schedules torch ships."""
import pytest

torch = pytest.importorskip("torch")

from torch.distributed.pipelining.schedules import Schedule1F1B  # noqa: E402

from koala_ds.core.ir import Schedule  # noqa: E402
from koala_ds.library import get  # noqa: E402
from koala_ds.torch.adapter import single_stage_orders  # noqa: E402  (what torch's own loops execute)

CASES = {
    "zb-h1": [(p, m, 1) for p in (1, 2, 3, 4, 6) for m in (1, 2, 3, 5, 8, 12)],
    "interleaved-1f1b": [(p, m, v) for p in (2, 3, 4) for m in (2, 4, 6, 8, 12) for v in (1, 2, 3)],
    "looped-bfs": [(p, m, v) for p in (2, 3, 4) for m in (1, 3, 8) for v in (1, 2, 3)],
    "zb-v": [(p, m, 2) for p in (1, 2, 3, 4) for m in range(2 * p - 1, 4 * p + 1)],
    "dualpipe-v": [(p, m, 2) for p in (1, 2, 3, 4) for m in range(2 * p, 4 * p + 1)],
}


@pytest.fixture(scope="module")
def torch_order():
    """torch.distributed.pipelining's orders, imported (~1.3 s) when a test here runs, not at collection."""
    from torch_orders import torch_order

    return torch_order


@pytest.mark.parametrize("name", sorted(CASES))
def test_orders_equal_torch(name, torch_order):
    for p, m, v in CASES[name]:
        if get(name).supports(p, m, v):
            continue
        ours = get(name).compile(p, m, v)
        assert [list(r) for r in ours.ranks] == torch_order(name, p, m, v), (name, p, m, v)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (4, 4), (4, 8), (3, 7), (8, 16)])
def test_1f1b_and_zb_h1_csv_equal_torch(p, m, torch_order):
    ours = get("1f1b").compile(p, m)
    assert ours.to_torch_csv() == Schedule.from_torch_csv(
        "".join(",".join(map(str, r)) + "\n" for r in single_stage_orders(p, m)[Schedule1F1B])).to_torch_csv()
    # Schedule1F1B's own pipeline_order (used for its visualisation) agrees on every rank but
    # the last, where it starts the steady state at microbatch 1 instead of 0 (torch 2.13).
    listed = torch_order("1f1b", p, m, 1)
    assert [list(r) for r in ours.ranks[:-1]] == listed[:-1]
    zb = get("zb-h1").compile(p, m)
    assert zb.to_torch_csv() == "".join(",".join(map(str, r)) + "\n" for r in torch_order("zb-h1", p, m, 1))


@pytest.mark.parametrize("name,p,m,v", [("zb-h1", 4, 8, 1), ("interleaved-1f1b", 4, 8, 2), ("zb-v", 4, 8, 2),
                                         ("dualpipe-v", 2, 6, 2), ("1f1b", 3, 5, 1)])
def test_torch_reads_and_validates_our_csv(name, p, m, v, tmp_path):
    """Parse our CSV the way torch's _load_csv does (csv.reader + _Action.from_str) and run
    torch's own schedule validator on it; it returns the stage -> rank map it inferred."""
    import csv

    from torch.distributed.pipelining import schedules as S

    s = get(name).compile(p, m, v)
    path = tmp_path / "s.csv"
    path.write_text(s.to_torch_csv())
    with open(path, newline="") as f:
        order = {rank: [S._Action.from_str(c) for c in row] for rank, row in enumerate(csv.reader(f))}
    stage_to_rank = S._validate_schedule(order, p, s.num_stages, m)
    assert stage_to_rank == {st: s.placement.rank_of(st) for st in range(s.num_stages)}
    assert [[str(a) for a in order[r]] for r in range(p)] == [[str(a) for a in r] for r in s.ranks]
