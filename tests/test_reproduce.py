"""python -m segment.eval.reproduce: the README's headline table is made from the committed
tables, and the diff of a rerun against them says match or what moved (the real rerun of
the ecssd-dev row is in tests/test_golden.py)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

from segment.eval import reproduce


def test_the_readme_headline_table_is_the_committed_tables():
    text = reproduce.README.read_text().splitlines()
    i, j = text.index(reproduce.BEGIN), text.index(reproduce.END)
    assert text[i + 1:j] == reproduce.headline(reproduce.committed_tables())
    for row in reproduce.ROWS:  # every row's table is committed in its three forms
        assert all(row.table.with_suffix(ext).is_file() for ext in (".json", ".csv", ".md")), row


def test_a_rerun_matches_within_the_spread_and_names_what_moved():
    row = reproduce.ROWS[0]
    committed = json.loads(row.table.with_suffix(".json").read_text())
    fresh = copy.deepcopy(committed)
    fresh[0]["mIoU"] += 0.04  # within 0.05 points
    fresh[0]["images_per_s"] *= 3  # timings are not compared
    ok, text = reproduce.line(row, committed, fresh)
    assert ok and text.startswith("ecssd-dev: match (") and "numbers within the spread" in text
    fresh[0]["mIoU"] += 0.1
    fresh[1]["delta"]["mIoU"][1] -= 0.2
    ok, text = reproduce.line(row, committed, fresh)
    assert not ok and text.startswith("ecssd-dev: differs in 2 of ")
    assert "cuts/mIoU" in text and "(+0.14)" in text and "cls_keychain/delta/mIoU/1" in text
    del fresh[2]
    assert any(b.startswith("cls_attention/") and b.endswith("missing")
               for b in reproduce.compare(committed, fresh))


def test_spread_by_metric():
    assert reproduce.spread_of("cuts/Covering") == 5e-4 == reproduce.spread_of("k3/delta/PRI/2")
    assert reproduce.spread_of("cuts/VI") == 5e-3
    assert reproduce.spread_of("cuts/iou/sky") == reproduce.spread_of("cuts/mIoU") == 0.05


def test_write_readme_replaces_only_the_marked_lines(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{reproduce.BEGIN}\nold row\n{reproduce.END}\nafter\n")
    reproduce.write_readme(reproduce.committed_tables(), readme)
    lines = readme.read_text().splitlines()
    assert lines[:2] == ["intro", reproduce.BEGIN] and lines[-2:] == [reproduce.END, "after"]
    assert lines[2:-2] == reproduce.headline(reproduce.committed_tables())


def test_missing_data_is_one_line_and_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "segment.eval.reproduce", "--shared", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("segment.eval.reproduce: needs the shared data")
    assert str(tmp_path / "data" / "ecssd-dev") in err[0]
