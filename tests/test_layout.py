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


def _from_name(node: ast.ImportFrom, package: str) -> str:
    """The absolute module of ``from X import ...`` in ``package`` (relative ``X`` resolved)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(source: str, module: str) -> list[tuple[int, str]]:
    """Every module a source imports, at any depth (inside functions, classes, ``if``
    blocks), relative imports resolved against ``module``'s package: ``(line, name)``."""
    package = module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            name = _from_name(node, package)
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


# ----------------------------------------------------------------------------- the whole package

# The layers of the package, lowest first, as the code has them: a module imports modules of
# its own layer or lower ones only (at any depth: inside functions too; imports under
# ``if TYPE_CHECKING:`` are for type checkers and exempt). segment/run is four rooms over two
# shared modules: the front end (config composition, checks, build), the Python API (the
# Segmenter and how a result looks), then the `segment` job and `segment-diagnose`.
LAYERS = (
    ("segment.utils",),
    ("segment.core",),
    ("segment.backends",),
    ("segment.methods",),
    ("segment.models", "segment.datasets"),
    ("segment.run.io", "segment.run.dist"),
    ("segment.run.front",),
    ("segment.run.api",),
    ("segment.run.job", "segment.run.diagnose"),
    ("segment.eval",),
    ("segment", "segment.__main__", "segment.configs"),  # the lazy facade (segment.load ...)
)


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of the longest prefix naming ``module`` (or its package)."""
    best, rank = -1, -1
    for i, names in enumerate(LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and len(n) > best:
                best, rank = len(n), i
    if rank < 0:
        raise AssertionError(f"{module} is in no layer of tests/test_layout.py LAYERS")
    return rank


def package_sources() -> dict[str, Path]:
    """Every module of the installed package ``segment`` (and of the folders mapped into it:
    models/, datasets/, eval/, configs/): module name -> file."""
    import importlib.util

    roots = {"segment": PACKAGE}
    for sub in ("models", "datasets", "eval", "configs"):
        spec = importlib.util.find_spec(f"segment.{sub}")
        roots[f"segment.{sub}"] = Path(list(spec.submodule_search_locations)[0])
    mods = {}
    for prefix, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if prefix == "segment" and parts[0] in ("models", "datasets", "eval", "configs"):
                continue  # not installed from here (a checkout's stray folder)
            mods[".".join((prefix, *parts)).removesuffix(".__init__")] = path
    return mods


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def runtime_imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """What a module imports when it runs, at any depth (functions, classes, ``if``/``try``
    blocks), except under ``if TYPE_CHECKING:``: ``(line, dotted name)``; ``from X import y``
    gives ``X.y`` (a module or a name in ``X``), relative imports resolved."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for c in child.orelse:
                    visit_node(c)
                continue
            visit_node(child)

    def visit_node(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            name = _from_name(node, package)
            found.extend((node.lineno, f"{name}.{a.name}") for a in node.names)
        visit(node)

    visit(ast.parse(source))
    return found


def import_graph(sources: dict[str, str], packages: set[str] = frozenset()) -> dict[str, dict[str, int]]:
    """Module -> the package's modules it imports (-> the first line), from their sources:
    each import resolved to the longest name that is a module of ``sources`` (a package's
    ``__init__`` only when it is itself named, never as a mere parent)."""
    graph: dict[str, dict[str, int]] = {}
    for mod, src in sources.items():
        edges: dict[str, int] = {}
        for line, name in runtime_imports(src, mod, mod in packages):
            parts = name.split(".")
            for k in range(len(parts), 0, -1):
                target = ".".join(parts[:k])
                if target in sources:
                    if target != mod:
                        edges.setdefault(target, line)
                    break
        graph[mod] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(cycles)


def _package_graph() -> dict[str, dict[str, int]]:
    mods = package_sources()
    packages = {m for m, p in mods.items() if p.name == "__init__.py"}
    return import_graph({m: p.read_text() for m, p in mods.items()}, packages)


def test_the_cycle_finder_sees_function_level_imports_and_exempts_type_checking():
    srcs = {
        "pkg.a": "def f():\n    from pkg import b\n",
        "pkg.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n",
        "pkg.c": "from .d import x\n",
        "pkg.d": "class K:\n    def g(self):\n        import pkg.c\n",
    }
    graph = import_graph(srcs)
    assert graph["pkg.a"] == {"pkg.b": 2} and graph["pkg.b"] == {}
    assert find_cycles(graph) == [["pkg.c", "pkg.d"]]
    srcs["pkg.b"] = "def h():\n    from pkg.a import f\n"  # now at run time: a cycle
    assert find_cycles(import_graph(srcs)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


def test_no_import_cycles_in_the_package():
    graph = _package_graph()
    assert {"segment.run.diagnose.measure", "segment.run.job.pipeline", "segment.eval.runner"} <= set(graph)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (module-level and function-level imports):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_every_module_imports_its_own_layer_or_lower_ones():
    bad = []
    for mod, edges in _package_graph().items():
        for target, line in edges.items():
            if target == "segment":  # the root package (__version__): Python runs it first anyway
                continue
            if layer_of(target) > layer_of(mod):
                bad.append(f"{mod}:{line} imports {target} (layer {layer_of(target)} > {layer_of(mod)})")
    assert not bad, "imports against the layer order of tests/test_layout.py LAYERS:\n" + "\n".join(bad)
    assert layer_of("segment.run.job.records") > layer_of("segment.run.api.render") > layer_of("segment.core.masks")


# ----------------------------------------------------------------------------- sizes

LONGEST_FUNCTION = 80  # lines, in segment/run and eval/ (the benchmarks of eval/bench aside)


def _run_and_eval_files() -> list[Path]:
    mods = package_sources()
    return [p for m, p in sorted(mods.items())
            if (m.startswith("segment.run.") or m.startswith("segment.eval.")) and not m.startswith("segment.eval.bench")]


def test_no_function_over_80_lines_in_the_run_layer_and_the_evaluator():
    files = _run_and_eval_files()
    assert any(p.name == "masking.py" for p in files) and any(p.name == "records.py" for p in files)
    long = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > LONGEST_FUNCTION:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {n} lines")
    assert not long, f"functions over {LONGEST_FUNCTION} lines:\n" + "\n".join(long)


def test_the_evaluator_loop_stays_short():
    runner = package_sources()["segment.eval.runner"]
    assert len(runner.read_text().splitlines()) <= 450


def test_only_build_instantiates_configs():
    """Every config node of segment/ and eval/ is built by segment.run.front.build.build (one
    error policy); the benchmarks of eval/bench call Hydra as scripts do."""
    calls = []
    for mod, path in package_sources().items():
        if mod == "segment.run.front.build" or mod.startswith("segment.eval.bench"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "hydra.utils" and any(
                    a.name == "instantiate" for a in node.names):
                calls.append(f"{mod}:{node.lineno}")
    assert not calls, "Hydra's instantiate outside segment.run.front.build:\n" + "\n".join(calls)
