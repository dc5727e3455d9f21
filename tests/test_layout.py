"""The layout rule of docs/architecture.md: ``segment/core`` imports torch, numpy, the
standard library and itself (plus ``segment.utils``) only; the library back-ends
(scikit-image, kornia, scikit-learn, the thread pool) live in ``segment/backends.py``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import segment

PACKAGE = Path(segment.__file__).parent
CORE = PACKAGE / "core"
ALLOWED_THIRD_PARTY = {"torch", "numpy"}
ALLOWED_OWN = ("segment.core", "segment.utils")
LIBRARIES = ("sklearn", "skimage", "kornia", "scipy", "timm", "diffusers", "transformers",
             "hydra", "omegaconf", "PIL", "cv2")


def imports_of(source: str, module: str) -> list[tuple[int, str]]:
    """Every module a source imports, at any depth (inside functions, classes, ``if``
    blocks), relative imports resolved against ``module``'s package: ``(line, name)``."""
    package = module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            if name == "segment" or name.startswith("segment."):  # `from segment import x`: x too
                found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
    return sorted(found)


def allowed(name: str) -> bool:
    top = name.split(".")[0]
    if top == "__future__" or top in sys.stdlib_module_names or top in ALLOWED_THIRD_PARTY:
        return True
    return any(name == own or name.startswith(own + ".") for own in ALLOWED_OWN)


def violations(source: str, module: str) -> list[str]:
    bad = []
    for line, name in imports_of(source, module):
        if name == "segment":  # `from segment import x`: judged by the names it brings
            continue
        if not allowed(name):
            bad.append(f"{module}:{line} imports {name}")
    return bad


def core_modules() -> dict[str, Path]:
    mods = {"segment.utils": PACKAGE / "utils.py"}  # core may import it: it obeys the rule too
    for path in sorted(CORE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def test_the_checker_sees_imports_at_any_depth():
    src = (
        "from __future__ import annotations\nimport math\nimport numpy as np\n"
        "from torch import Tensor\nfrom segment.core import markov\nfrom . import record\n"
        "def f():\n    from sklearn.cluster import KMeans\n"
        "class C:\n    def g(self):\n        import kornia.contrib\n"
        "if True:\n    from segment import backends\n    from ..run import api\n"
    )
    assert violations(src, "segment.core.x") == [
        "segment.core.x:8 imports sklearn.cluster",
        "segment.core.x:11 imports kornia.contrib",
        "segment.core.x:13 imports segment.backends",
        "segment.core.x:14 imports segment.run",
        "segment.core.x:14 imports segment.run.api",
    ]


def test_segment_core_imports_only_torch_numpy_and_the_standard_library():
    mods = core_modules()
    assert {"segment.core.markov", "segment.core.regions", "segment.core.clusters"} <= set(mods)
    bad = [v for name, path in mods.items() for v in violations(path.read_text(), name)]
    assert not bad, "segment/core must import torch, numpy and the standard library only:\n" + "\n".join(bad)


def test_importing_segment_core_loads_no_other_library():
    names = sorted(n for n in core_modules() if n.startswith("segment.core."))
    code = (
        "import sys\n"
        + "".join(f"import {n}\n" for n in names)
        + f"print(sorted(m for m in {LIBRARIES!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_backends_module_holds_the_libraries():
    src = (PACKAGE / "backends.py").read_text()
    names = {name.split(".")[0] for _, name in imports_of(src, "segment.backends")}
    assert {"skimage", "kornia", "sklearn"} <= names
