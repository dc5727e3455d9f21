"""The configs folder as a registry (segment.run.api.registry): list_models / list_methods /
list_datasets read the folder, create_method composes a method file as the commands do,
load takes a built method, and the package shows its lazy API to dir() and type checkers."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf
from PIL import Image

import segment
from segment.run.front.compose import compose
from segment.run.api.registry import method_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def _stems(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def _yaml_method(name: str, **overrides) -> object:
    """The method file read straight from the checkout, overrides merged, instantiated."""
    node = OmegaConf.merge(OmegaConf.load(CONFIGS / "method" / f"{name}.yaml"), overrides)
    return instantiate(node)


# ----------------------------------------------------------------------------- listing


def test_lists_are_the_config_folders_and_filter_like_timm():
    assert segment.list_models() == _stems("model") and "vit_tiny_random" in segment.list_models()
    assert segment.list_methods() == _stems("method") and "cuts" in segment.list_methods()
    assert segment.list_datasets() == _stems("dataset") and "folder" in segment.list_datasets()
    dinov2 = segment.list_models("dinov2*")
    assert dinov2 == [n for n in _stems("model") if n.startswith("dinov2")] and len(dinov2) >= 8
    assert segment.list_models(["*_reg4", "vit_*"]) == sorted(
        n for n in _stems("model") if n.endswith("_reg4") or n.startswith("vit_"))
    assert segment.list_models("dinov2_vit?14") == ["dinov2_vitb14", "dinov2_vitg14", "dinov2_vitl14",
                                                    "dinov2_vits14"]
    assert segment.list_methods("c*") == ["cls_attention", "cls_keychain", "concept_attention", "cuts"]
    assert segment.list_models("DINOV2*") == []  # case-sensitive, as the names the commands take
    assert segment.list_models("no_such_model*") == [] and segment.list_models([]) == segment.list_models()
    with pytest.raises(TypeError, match="pattern must be a string or a list of strings, got 3"):
        segment.list_models(3)


def test_listing_imports_neither_torch_nor_the_methods():
    code = ("import sys, segment; segment.list_models(); segment.list_methods('c*');"
            " segment.list_datasets(); print(sorted(m for m in ('torch', 'timm', 'segment.methods')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ----------------------------------------------------------------------------- create_method


def test_create_method_equals_the_yaml_with_the_override():
    m = segment.create_method("cuts", escape=0.4)
    assert type(m).__name__ == "EscapeCuts" and m.escape == 0.4
    assert m == _yaml_method("cuts", escape=0.4)
    assert m != segment.create_method("cuts")  # the override took effect
    # the method the command builds for `segment method=cuts method.escape=0.4`
    assert m == instantiate(compose("segment", ["method=cuts", "method.escape=0.4"]).method)
    # a list key, a tuple for it, and a key of another method
    two = segment.create_method("cuts", layers=(-2, -1), refine_steps=0)
    assert two == _yaml_method("cuts", layers=[-2, -1], refine_steps=0) and two.layers == (-2, -1)
    assert segment.create_method("regions", steps=3) == _yaml_method("regions", steps=3)


@pytest.mark.parametrize("name", _stems("method"))
def test_every_method_file_is_created_and_written_back(name):
    """``create_method(NAME)`` is the file as it stands, and :func:`method_config` writes any
    method as the node that builds it again (what ``load(method=m)`` records)."""
    m = segment.create_method(name)
    assert m == _yaml_method(name)
    node = method_config(m)
    assert instantiate(node) == m and node.name == m.name
    # every key of the file is a field of the class it builds, with the file's value
    yaml = OmegaConf.to_container(OmegaConf.load(CONFIGS / "method" / f"{name}.yaml"))
    for key in (k for k in yaml if k != "_target_"):
        assert key in node, (name, key)


def test_create_method_refusals_name_the_problem_and_suggest():
    with pytest.raises(ValueError, match=r"unknown method 'cutz' \(did you mean 'cuts'\?\); choose one of"):
        segment.create_method("cutz")
    with pytest.raises(ValueError, match=r"unknown setting 'escpae' of method 'cuts' \(did you mean"
                                         r" 'escape'\?\); it takes: name, layers, heads, escape"):
        segment.create_method("cuts", escpae=0.3)
    with pytest.raises(ValueError, match=r"unknown setting 'average_layers' of method 'cuts'"):
        segment.create_method("cuts", average_layers=True)  # a field, but not a key of the file
    with pytest.raises(ValueError, match=r"cuts: escape='high': expected a number \(the default is 0.5\)"):
        segment.create_method("cuts", escape="high")
    with pytest.raises(ValueError, match=r"regions: steps=2.5: expected a whole number"):
        segment.create_method("regions", steps=2.5)
    # the constructor's own refusal comes through as it is (not Hydra's wrapper)
    with pytest.raises(ValueError, match=r"^cannot build method 'cuts': cuts: escape must lie in \(0, 2\]"):
        segment.create_method("cuts", escape=3.0)


# ----------------------------------------------------------------------------- load(method=...)


def test_load_takes_a_built_method():
    m = segment.create_method("cuts", escape=0.4, refine_steps=0)
    seg = segment.load("vit_tiny_random", method=m, device="cpu", image_size=56)
    assert seg.method is m and seg.backbone.image_size == (56, 56)
    assert instantiate(seg.config.method) == m  # the config says what runs
    by_name = segment.load("vit_tiny_random", "cuts", device="cpu", image_size=56, escape=0.4, refine_steps=0)
    assert by_name.method == m
    rng = np.random.default_rng(0)
    im = Image.fromarray(rng.integers(0, 255, (70, 84, 3), dtype=np.uint8))
    a, b = seg(im), segment.Segmenter(seg.backbone, by_name.method)(im)  # same weights
    np.testing.assert_array_equal(a.labels, b.labels)
    np.testing.assert_array_equal(a.heatmap, b.heatmap)
    # a method built differently gives another result on the same backbone
    other = segment.Segmenter(seg.backbone, dataclasses.replace(m, key_temperature=1.0))(im)
    assert not np.array_equal(other.heatmap, a.heatmap)


def test_load_refuses_settings_of_a_built_method_and_other_objects():
    m = segment.create_method("cuts")
    for key in ("escape", "method.escape"):
        with pytest.raises(ValueError, match=rf"^'{key}' is a setting of the method 'cuts', which was"
                                             r" passed built: set it on the method \(dataclasses.replace"
                                             r"\(method, escape=...\) or segment.create_method\('cuts'"):
            segment.load("vit_tiny_random", method=m, device="cpu", **{key: 0.3})
    with pytest.raises(ValueError, match=r"unknown setting 'imagesize' \(did you mean 'image_size'\?\)"):
        segment.load("vit_tiny_random", method=m, device="cpu", imagesize=56)
    with pytest.raises(TypeError, match="method must be a configs/method name .* or a segment.methods.Method"
                                        r" \(segment.create_method\), got dict"):
        segment.load("vit_tiny_random", method={"escape": 0.3}, device="cpu")
    # a built method is checked against the model as a named one is (its layers)
    deep = segment.create_method("cuts", layers=[5])
    with pytest.raises(ValueError, match="layer"):
        segment.load("vit_tiny_random", method=deep, device="cpu")


# ----------------------------------------------------------------------------- discovery


def test_dir_lists_the_lazy_api_and_every_name_resolves():
    public = set(segment.__all__) - {"__version__"}
    assert {"load", "show", "Segmenter", "Result", "diagnose", "list_models", "list_methods",
            "list_datasets", "create_method"} == public
    assert public <= set(dir(segment)) and "__version__" in dir(segment)
    assert not [n for n in dir(segment) if not n.startswith("__") and n not in public]
    for name in public:
        assert callable(getattr(segment, name)), name
    with pytest.raises(AttributeError, match="module 'segment' has no attribute 'lod'"):
        segment.lod  # noqa: B018


def test_type_checkers_see_what_runs():
    """The ``TYPE_CHECKING`` imports of segment/__init__.py name each public name from the
    module its lazy look-up imports it from, and nothing else."""
    tree = ast.parse((REPO / "segment" / "__init__.py").read_text())
    seen = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom), ast.dump(imp)
                seen.update({a.name: imp.module for a in imp.names})
    assert seen == segment._LAZY
    for name, module in seen.items():
        assert getattr(segment, name) is getattr(__import__(module, fromlist=[name]), name)
