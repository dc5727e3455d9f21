"""A rerun that says why (segment.run.job.rerun): the changed output settings named before
segmenting, how many images are segmented again, and the level folders of ``levels`` the
change makes stale removed (a user's folder kept); whole runs with the tiny random ViT."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from test_pipeline import _img, compose_cfg

from segment.run.job import levels
from segment.run.job.lock import OutputLock
from segment.run.job.pipeline import run_segment
from segment.run.job.rerun import LEVEL_MARK, setting_changes

LEVELS = ["labels_t0.50", "masks_t0.50"]


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "segment.run.job.pipeline"]


def _said(caplog, start: str) -> list[str]:
    return [m for m in _lines(caplog) if m.startswith(start)]


@pytest.fixture
def done(tmp_path) -> tuple[Path, Path]:
    """A finished run (method=cuts) of three images, a level written by ``levels``, a
    user's folder named like a level folder and another folder of the user's."""
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    for i, (h, w) in enumerate(((40, 60), (50, 30), (42, 42))):
        _img(h, w, i).save(src / f"im{i}.png")
    assert run_segment(compose_cfg(src, out)) == 0
    assert levels.main([str(out), "--t", "0.5", "--no-progress"]) == 0
    for user in ("labels_t0.70", "notes"):
        (out / user).mkdir()
        (out / user / "mine.png").write_bytes(b"the user's")
    return src, out


def _run(caplog, src: Path, out: Path, *extra: str) -> int:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="segment.run.job.pipeline"):
        return run_segment(compose_cfg(src, out, *extra))


def test_levels_marks_the_folders_it_creates_only(done, tmp_path):
    _, out = done
    for name in LEVELS:
        mark = json.loads((out / name / LEVEL_MARK).read_text())
        assert mark["t"] == 0.5 and name.startswith(mark["kind"])
        assert mark["fingerprint"] == json.loads((out / "run.json").read_text())["fingerprint"]
    # a folder that was there before is written into, never marked
    assert levels.main([str(out), "--t", "0.7", "--no-progress"]) == 0
    assert not (out / "labels_t0.70" / LEVEL_MARK).exists()
    assert (out / "masks_t0.70" / LEVEL_MARK).is_file()


def test_a_rerun_with_the_same_settings_says_so_and_redoes_nothing(done, caplog):
    src, out = done
    # progress, num_workers, batch_size, limit, device and render.fsync decide no output
    assert _run(caplog, src, out, "progress=true", "num_workers=1", "batch_size=1",
                "limit=10", "device=cpu", "render.fsync=true") == 0
    assert _said(caplog, "settings unchanged since the last run") != []
    assert _said(caplog, "setting changed") == [] and _said(caplog, "removed") == []
    assert not any("segmented again" in m for m in _lines(caplog))
    man = json.loads((out / "run.json").read_text())
    assert man["counts"]["resumed"] == 3 and man["counts"]["segmented"] == 0
    assert "settings_changed" not in man and "stale_removed" not in man
    assert all((out / name / LEVEL_MARK).is_file() for name in LEVELS)


def test_a_rerun_names_the_changed_setting_and_removes_the_stale_levels(done, caplog):
    src, out = done
    assert _run(caplog, src, out, "method.escape=0.4", "progress=true") == 0
    lines = _lines(caplog)
    assert _said(caplog, "setting changed") == ["setting changed: method.escape 0.5 -> 0.4"]
    assert "3 images will be segmented again" in lines
    plan = next(i for i, m in enumerate(lines) if "to segment" in m)
    assert lines.index("setting changed: method.escape 0.5 -> 0.4") < plan
    assert "0 already done, 3 to segment" in lines[plan]
    assert _said(caplog, "removed stale level folder") == [
        f"removed stale level folder {n}/ (written by levels for other settings)" for n in LEVELS]
    assert not any((out / n).exists() for n in LEVELS)
    # the user's folders stay; the one named like a level folder is listed as kept
    assert (out / "labels_t0.70" / "mine.png").read_bytes() == b"the user's"
    assert (out / "notes" / "mine.png").is_file()
    assert any(m.startswith("kept level folder labels_t0.70/, possibly stale") for m in lines)
    man = json.loads((out / "run.json").read_text())
    assert man["counts"]["segmented"] == 3
    assert man["settings_changed"] == [{"key": "method.escape", "old": 0.5, "new": 0.4}]
    assert man["stale_removed"] == LEVELS
    assert [k["folder"] for k in man["stale_kept"]] == ["labels_t0.70"]
    # the next rerun with these settings: nothing changed, nothing removed
    assert _run(caplog, src, out, "method.escape=0.4") == 0
    assert _said(caplog, "settings unchanged") and not _said(caplog, "setting changed")


def test_overwrite_removes_the_level_folders_too(done, caplog):
    src, out = done
    assert _run(caplog, src, out, "overwrite=true") == 0
    assert _said(caplog, "setting changed") == []
    assert "3 images will be segmented again (overwrite=true)" in _lines(caplog)
    assert not any((out / n).exists() for n in LEVELS)
    assert json.loads((out / "run.json").read_text())["stale_removed"] == LEVELS


def test_a_level_with_images_this_run_keeps_is_kept(done, caplog):
    src, out = done
    assert _run(caplog, src, out, "method.escape=0.4", "limit=2") == 0
    assert "2 images will be segmented again" in _lines(caplog)
    assert all((out / n / "im2.png").is_file() for n in LEVELS)  # im2 keeps its outputs
    kept = json.loads((out / "run.json").read_text())["stale_kept"]
    assert {k["folder"] for k in kept} == {*LEVELS, "labels_t0.70"}


def test_nothing_is_removed_when_the_run_refuses(done, caplog, monkeypatch):
    src, out = done
    with OutputLock(out):  # another run holds the folder
        assert _run(caplog, src, out, "method.escape=0.4") == 3
    assert all((out / n / LEVEL_MARK).is_file() for n in LEVELS)

    def fail(*a, **k):
        raise RuntimeError("no model today")

    monkeypatch.setattr("segment.run.job.pipeline.Segmenter.from_config", fail)
    assert _run(caplog, src, out, "method.escape=0.4") == 2
    assert all((out / n / LEVEL_MARK).is_file() for n in LEVELS)


def test_setting_changes_names_dotted_keys_added_and_removed():
    old = OmegaConf.to_container(compose_cfg(None, Path("/tmp/x")), resolve=True)
    new = compose_cfg(None, Path("/tmp/y"), "method=regions", "render.colormap=jet",
                      "num_workers=1", "progress=true", "limit=3", "render.fsync=true")
    lines = [c.line() for c in setting_changes(old, new)]
    assert {"method.name cuts -> regions", "render.colormap inferno -> jet",
            "method.escape removed (was 0.5)", "method.seeds added (auto)",
            "method.score_layers added ([-1])"} <= set(lines)
    assert all(m.startswith(("method.", "render.colormap ")) for m in lines)  # nothing else
    # the settings that decide no output (run.json's config holds them too)
    assert setting_changes(old, compose_cfg(None, Path("/tmp/z"), "progress=true", "limit=1",
                                            "num_workers=1", "device=auto", "render.fsync=true")) == []
