"""The linters of issue 62 item 4 stay wired up: pyproject.toml configures ruff, mypy and
import-linter, `.ci/lint` exists and `.ci/run` calls it (report-only) before pytest; and the
import-linter contracts that hold today keep holding (the layering cannot regress), the
broken ones listed by id (docs/architecture.md, "Lint status (report-only)")."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# the contracts of [tool.importlinter] by id: those kept today must stay kept; a broken one is
# listed here with what breaks it, and moves to KEPT once it holds
KEPT = {"layers", "run-rooms", "core-libraries"}
EXPECTED_BROKEN: dict[str, str] = {}

# segment/ and the folders pyproject's package-dir maps into it
MAPPED = ("models", "datasets", "eval", "configs")


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


# ----------------------------------------------------------------------------- configuration

def test_pyproject_configures_ruff_mypy_and_import_linter():
    tool = _pyproject()["tool"]
    ruff = tool["ruff"]
    assert ruff["line-length"] == 120 and ruff["target-version"] == "py311"
    assert {"F", "B", "I", "C901", "PLR0915"} <= set(ruff["lint"]["select"])
    assert ruff["lint"]["isort"]["known-first-party"] == ["segment"]
    mypy = tool["mypy"]
    assert {"segment.core", "segment.methods"} <= set(mypy["packages"])
    assert any(o.get("ignore_missing_imports") for o in mypy["overrides"])
    il = tool["importlinter"]
    assert il["root_package"] == "segment" and il["exclude_type_checking_imports"] is True
    ids = {c["id"] for c in il["contracts"]}
    assert ids == KEPT | set(EXPECTED_BROKEN), "classify every contract as KEPT or EXPECTED_BROKEN"
    layers = next(c for c in il["contracts"] if c["id"] == "layers")["layers"]
    order = [next(i for i, layer in enumerate(layers) if name in layer.split(" : "))
             for name in ("segment.eval", "segment.run", "segment.models", "segment.methods", "segment.core")]
    assert order == sorted(order)  # highest first: eval > run > models > methods > core


def test_the_linters_are_in_the_test_and_lint_extras():
    extras = _pyproject()["project"]["optional-dependencies"]
    for extra in ("test", "lint"):
        names = {re.split(r"[<>=!~ \[]", req, maxsplit=1)[0] for req in extras[extra]}
        assert {"ruff", "mypy", "import-linter"} <= names, extra


def test_ci_lint_is_executable_and_ci_run_calls_it_report_only_before_pytest():
    lint = REPO / ".ci" / "lint"
    assert lint.is_file() and os.access(lint, os.X_OK)
    text = lint.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "--enforce" in text
    for tool in ("ruff check", "mypy -p segment.core -p segment.methods", "lint-imports"):
        assert tool in text, tool
    lines = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()]
    calls = [i for i, ln in enumerate(lines) if re.match(r"(\./)?\.ci/lint(\s|$)", ln)]
    pytest_at = [i for i, ln in enumerate(lines) if ln.startswith("python -m pytest")]
    assert len(calls) == 1 and pytest_at and calls[0] < pytest_at[0]
    assert "--enforce" not in lines[calls[0]].split("#")[0]  # report-only for now


# ----------------------------------------------------------------------------- the contracts

def _stage(dest: Path) -> Path:
    """The installed layout, as .ci/lint stages it: segment/ with the mapped folders copied in
    (``.py`` files only), an empty ``__init__.py`` in namespace folders, and pyproject.toml."""
    pkg = dest / "segment"
    for src, to in [(REPO / "segment", pkg), *((REPO / sub, pkg / sub) for sub in MAPPED)]:
        for path in src.rglob("*.py"):
            if "__pycache__" not in path.parts:
                target = to / path.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, target)
    for d in [p for p in pkg.rglob("*") if p.is_dir()]:
        (d / "__init__.py").touch(exist_ok=True)
    shutil.copy(REPO / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _lint_imports(stage: Path, contract: str) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    env = {**os.environ, "PYTHONPATH": str(stage)}
    return subprocess.run([exe, "--no-logo", "--no-cache", "--contract", contract],
                          cwd=stage, env=env, capture_output=True, text=True, timeout=120)


needs_import_linter = pytest.mark.skipif(
    shutil.which("lint-imports") is None and not Path(sys.executable).with_name("lint-imports").exists(),
    reason="import-linter is not installed (pip install -e '.[lint]'): the contracts are not checked")


@needs_import_linter
def test_the_contracts_kept_today_stay_kept(tmp_path):
    stage = _stage(tmp_path)
    assert (stage / "segment" / "models" / "vit.py").is_file()
    assert (stage / "segment" / "eval" / "bench").is_dir()
    for cid in sorted(KEPT):
        out = _lint_imports(stage, cid)
        assert out.returncode == 0 and "1 kept, 0 broken" in out.stdout, (
            f"import-linter contract {cid!r} is broken (it held when .ci/lint was added):\n{out.stdout}{out.stderr}")
    for cid, why in sorted(EXPECTED_BROKEN.items()):
        out = _lint_imports(stage, cid)
        assert out.returncode != 0, f"contract {cid!r} ({why}) holds now: move it to KEPT"


@needs_import_linter
def test_the_staged_check_sees_a_bad_import(tmp_path):
    """Not vacuous: a function-level import of the run layer from the core (a namespace
    package) and a library import in segment.utils break the contracts."""
    stage = _stage(tmp_path)
    (stage / "segment" / "core" / "zz_bad.py").write_text("def f():\n    from segment.run.api import segmenter\n")
    with open(stage / "segment" / "utils.py", "a") as fh:
        fh.write("\nimport scipy  # noqa\n")
    assert _lint_imports(stage, "layers").returncode != 0
    assert _lint_imports(stage, "core-libraries").returncode != 0
    assert _lint_imports(stage, "run-rooms").returncode == 0
