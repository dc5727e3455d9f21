"""``python -m segment.eval.paired``: one method of two ``segment-eval`` runs, paired over
their images, against what the runs report themselves."""

from __future__ import annotations

import json

import pytest
from segment.eval.paired import PairError, compare, main
from segment.eval.runner import EXIT_OK, run_eval
from test_eval import TINY, cfg_for, make_folder

SCORES = ("pixAcc", "mIoU", "mAP")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs of the same 6 photos at two input sizes, two methods each."""
    root = tmp_path_factory.mktemp("paired")
    data = make_folder(root / "set", n=6, seed=3)
    out = {}
    for size in (56, 84):
        out[size] = root / f"run{size}"
        cfg = cfg_for(*TINY, "method=cls_attention", "methods=[rollout]", f"dataset.root={data}",
                      f"model.image_size={size}", f"output={out[size]}", "bootstrap=300")
        assert run_eval(cfg) == EXIT_OK
    return out


def _rows(run):
    return {r["method"]: r for r in json.loads((run / "results.json").read_text())}


def test_each_side_is_its_run_and_the_difference_is_paired(runs):
    a, b = runs[56], runs[84]
    res = compare(a, b, reps=300)
    row_a, row_b = res.rows
    for row, run in ((row_a, a), (row_b, b)):
        own = _rows(run)["cls_attention"]
        for s in SCORES:
            assert row[s] == pytest.approx(own[s], abs=1e-9)
        assert row["images"] == 6
    # A's interval is the one its own run reports (same images in the same order, same draws)
    assert row_a["ci95"] == _rows(a)["cls_attention"]["ci95"]
    for s in SCORES:
        assert row_b["delta"][s][0] == pytest.approx(row_b[s] - row_a[s], abs=1e-4)
    # against itself: no difference in any draw
    same = compare(a, a, reps=300).rows[1]["delta"]
    assert all(same[s] == [0.0, 0.0, 0.0] for s in SCORES)
    # two methods of one run, paired here, give that run's own paired delta
    within = compare(a, a, "cls_attention", "rollout", reps=300).rows[1]["delta"]
    own = _rows(a)["rollout"]["delta"]
    assert {s: within[s] for s in SCORES} == {s: own[s] for s in SCORES}


def test_refusals_are_one_line_with_exit_2(runs, tmp_path, capsys):
    a = runs[56]
    with pytest.raises(PairError, match="no method 'nope'"):
        compare(a, runs[84], "nope")
    other = make_folder(tmp_path / "other", n=3, seed=5)
    c = tmp_path / "runc"
    assert run_eval(cfg_for(*TINY, "method=cls_attention", f"dataset.root={other}", f"output={c}")) == EXIT_OK
    with pytest.raises(PairError, match="scored different images"):
        compare(a, c)
    capsys.readouterr()
    assert main([str(tmp_path), str(a)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"segment.eval.paired: {tmp_path}: no config.yaml (not the output folder of a"
                   " finished segment-eval run)"]


def test_writes_the_tables(runs, tmp_path, capsys):
    out = tmp_path / "cmp"
    args = [str(runs[56]), str(runs[84]), "--method", "rollout", "--reps", "200", "--out", str(out)]
    assert main(args) == 0
    md = (out / "results.md").read_text()
    assert "A: rollout (run56)" in md and "B: rollout (run84)" in md and "ΔmIoU vs A: rollout" in md
    assert capsys.readouterr().out == md
    rows = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in rows] == ["A: rollout (run56)", "B: rollout (run84)"]


def test_any_code_pairs_what_a_run_recorded_under_older_code(runs, tmp_path):
    # a run whose cache was written by other code (its method keys' source half changed):
    # refused as stale by default, paired with --any-code; two records of one config: refused
    import shutil

    old = tmp_path / "old"
    shutil.copytree(runs[56], old)
    for path in old.glob("cache/*/*.json"):
        data = json.loads(path.read_text())
        data["methods"] = {k.rsplit("-", 1)[0] + "-0123456789ab": v for k, v in data["methods"].items()}
        path.write_text(json.dumps(data))
    with pytest.raises(PairError, match="under this code"):
        compare(old, runs[84], reps=300)
    got = compare(old, runs[84], reps=300, any_code=True).rows
    want = compare(runs[56], runs[84], reps=300).rows
    drop = lambda d: {k: v for k, v in d.items() if k != "vs"}  # noqa: E731 (vs names the folder)
    assert drop(got[1]["delta"]) == drop(want[1]["delta"]) and got[0]["mIoU"] == want[0]["mIoU"]
    for path in old.glob("cache/*/*.json"):  # a second record of the same config: ambiguous
        data = json.loads(path.read_text())
        data["methods"].update({k[:-12] + "ba9876543210": v for k, v in data["methods"].items()})
        path.write_text(json.dumps(data))
    with pytest.raises(PairError, match="under this code"):
        compare(old, runs[84], reps=300, any_code=True)
