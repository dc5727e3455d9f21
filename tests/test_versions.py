"""The torch / torchvision pair: refused in one line when it cannot work, named alike in
pyproject.toml, the README and .ci/run."""

from __future__ import annotations

import importlib.abc
import re
import sys
from pathlib import Path

import pytest

from segment.run.front import versions
from segment.run.front.versions import FIX, TESTED, TorchPairError, check_torch_pair, pair_problem

ROOT = Path(__file__).resolve().parents[1]


def test_pairs_and_mismatches():
    assert pair_problem("2.14.1", "0.29.1") is None
    assert pair_problem("2.14.1+cpu", "0.29.1+cpu") is None
    assert pair_problem("2.1.0", "0.16.0") is None
    bad = pair_problem("2.14.1+cpu", "0.28.0")
    assert bad is not None and "torch 2.14.1+cpu" in bad and "torchvision 0.28.0" in bad
    assert "torchvision 0.29" in bad and bad.endswith(FIX) and "\n" not in bad
    missing = pair_problem("2.14.1", None)
    assert missing is not None and "not installed" in missing and FIX in missing


def test_the_installed_pair_passes():
    check_torch_pair()


class _BrokenOps(importlib.abc.MetaPathFinder):
    """``import torchvision`` failing as it does against another torch's build."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            raise RuntimeError("operator torchvision::nms does not exist")
        return None


def test_missing_compiled_ops_are_refused_in_one_line(monkeypatch):
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_BrokenOps(), *sys.meta_path])
    with pytest.raises(TorchPairError) as e:
        check_torch_pair()
    msg = str(e.value)
    assert "\n" not in msg and "torchvision::nms does not exist" in msg and msg.endswith(FIX)
    assert "torch " in msg and "torchvision " in msg


def test_the_commands_and_the_api_refuse_a_broken_pair(monkeypatch, capsys):
    import segment
    from segment.run.front import command

    def broken():
        raise TorchPairError(pair_problem("2.14.1", "0.28.0"))

    monkeypatch.setattr(command, "check_torch_pair", broken)
    ran = []
    code = command.run_command("segment", lambda: ran.append(1), argv=["output=/tmp/x"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not ran and err.count("\n") == 0
    assert err.startswith("segment: torch 2.14.1 and torchvision 0.28.0 are not a pair")
    monkeypatch.setattr(versions, "check_torch_pair", broken)
    with pytest.raises(TorchPairError, match="not a pair"):
        segment.load(model="vit_tiny_random")


def test_one_pair_named_everywhere():
    torch_v, vision_v = TESTED
    assert FIX == f"pip install torch=={torch_v} torchvision=={vision_v}"
    # the README's install lines: tests/test_readme.py::test_install_lines_and_torch_constraint_agree
    assert f"torch=={torch_v} torchvision=={vision_v}" in (ROOT / ".ci" / "run").read_text()
    deps = (ROOT / "pyproject.toml").read_text()
    for name, v in (("torch", torch_v), ("torchvision", vision_v)):
        m = re.search(rf'"{name}>=([\d.]+),<([\d.]+)"', deps)  # the tested release's series
        assert m and m.group(1) == v, name
        assert pair_problem(m.group(2) if name == "torch" else torch_v, vision_v if name == "torch"
                            else m.group(2)) is not None  # the upper bound is the next pair
