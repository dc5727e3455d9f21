"""What the README promises about installing agrees with pyproject.toml."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def test_install_lines_and_torch_constraint_agree():
    readme = (REPO / "README.md").read_text()
    block = re.search(r"## Install and run\n+```bash\n(.*?)```", readme, re.S).group(1).splitlines()
    cpu = [i for i, ln in enumerate(block) if "--index-url https://download.pytorch.org/whl/cpu" in ln]
    default = [i for i, ln in enumerate(block) if re.search(r"pip install torch torchvision\s*(#|$)", ln)]
    assert cpu and default and abs(cpu[0] - default[0]) == 1  # side by side
    assert "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu" in block[cpu[0]]
    claimed = re.search(r"Any torch >= ([0-9.]+) works", readme).group(1)
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    assert str(req.specifier) == f">={claimed}"  # no cap the README does not mention
    assert Version(torch.__version__.split("+")[0]) in req.specifier


def test_readme_is_a_manual_and_its_links_resolve():
    """The README stays a manual (at most 300 lines) and every relative link of it and of
    docs/ names a file of the checkout (a renamed doc or picture fails here)."""
    readme = REPO / "README.md"
    assert len(readme.read_text().splitlines()) <= 300
    docs = sorted((REPO / "docs").glob("*.md"))
    assert docs, "docs/ holds the manual's chapters"
    missing = []
    for page in [readme, *docs]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(REPO)} -> {target}")
    assert not missing, missing
