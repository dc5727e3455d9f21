"""The method contract and the one source of settings (issue 55, item 3).

- segment/ and eval/ read methods, backbones and data sets through their typed interfaces:
  no ``hasattr(`` and no ``getattr(x, "literal")`` on them;
- the ``Method`` base holds what every method has; a knob lives in the methods that use it;
- every method config (``configs/method/*.yaml``) builds the class's defaults, every field
  has its help text, docs/methods.md's settings tables are generated from them, and the yaml
  files carry no per-field comments (one description per setting).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from hydra.utils import get_class, instantiate

REPO = Path(__file__).resolve().parents[1]
# getattr with a literal name is allowed on these (the standard library and Pillow objects)
NOT_OURS = {"os", "mod", "im"}
PROBE = re.compile(r"\bhasattr\(|\bgetattr\(\s*([\w.]+)\s*,\s*['\"]")


def _probes() -> list[str]:
    found = []
    for root in ("segment", "eval"):
        for p in sorted((REPO / root).rglob("*.py")):
            if "results" in p.relative_to(REPO).parts:
                continue
            for i, line in enumerate(p.read_text().splitlines(), 1):
                for m in PROBE.finditer(line):
                    if m.group(1) in NOT_OURS:
                        continue
                    found.append(f"{p.relative_to(REPO)}:{i}: {line.strip()}")
    return found


def test_no_attribute_probes_on_methods_backbones_or_data_sets():
    assert _probes() == []


def test_the_probe_finds_what_it_forbids():
    assert PROBE.search('getattr(method, "name", None)').group(1) == "method"
    assert PROBE.search("x = hasattr(dataset, 'class_names')")
    assert PROBE.search('getattr(os, "O_CLOEXEC", 0)').group(1) in NOT_OURS
    assert not PROBE.search("getattr(method, knob)")  # a method's own declared fields by name


def _configs() -> dict[str, Path]:
    return {p.stem: p for p in sorted((REPO / "configs" / "method").glob("*.yaml"))}


@pytest.mark.parametrize("name", sorted(_configs()))
def test_every_method_config_builds_its_dataclass_defaults(name):
    from segment.eval.specs import compose_method

    node = compose_method(name)
    cls = get_class(node._target_)
    assert instantiate(node) == cls(), f"configs/method/{name}.yaml differs from {cls.__name__}()"


def test_every_setting_has_help_and_the_docs_tables_are_generated():
    from segment.methods import settings

    for target in settings.method_configs().values():
        for f in dataclasses.fields(get_class(target)):
            assert settings.help_of(f)
    doc = REPO / "docs" / "methods.md"
    assert settings.main(["--check", str(doc)]) == 0, (
        "docs/methods.md's settings tables differ: python -m segment.methods.settings docs/methods.md")


def test_the_docs_check_fails_on_a_stale_table(tmp_path):
    from segment.methods import settings

    text = (REPO / "docs" / "methods.md").read_text()
    stale = tmp_path / "methods.md"
    stale.write_text(text.replace("| `escape` | `0.5` |", "| `escape` | `0.4` |"))
    assert settings.main(["--check", str(stale)]) == 1
    assert settings.main([str(stale)]) == 0 and stale.read_text() == text


@pytest.mark.parametrize("name", sorted(_configs()))
def test_method_configs_carry_no_per_field_comments(name):
    """The help text is in the dataclass; a yaml line holds a key and its value only (the
    header comment stays)."""
    for i, line in enumerate(_configs()[name].read_text().splitlines(), 1):
        if line.lstrip().startswith("#"):
            assert i == 1 or _configs()[name].read_text().splitlines()[i - 2].startswith("#"), (
                f"{name}.yaml:{i}: a comment below the header")
        else:
            assert "#" not in line, f"{name}.yaml:{i}: a per-field comment: {line!r}"


def test_the_method_base_holds_only_what_every_method_has():
    from segment.methods import (
        ClsAttention,
        ClsKeyChain,
        ConceptAttention,
        EscapeCuts,
        KMeansKeys,
        Method,
        RegionGrow,
        Rollout,
    )

    def names(cls):
        return {f.name for f in dataclasses.fields(cls)}

    assert names(Method) == {"name", "layers"}
    for cls in (ClsKeyChain, Rollout, RegionGrow, EscapeCuts, KMeansKeys, ConceptAttention):
        assert "average_layers" not in names(cls), cls.__name__
    for cls in (KMeansKeys, ConceptAttention):
        assert "heads" not in names(cls), cls.__name__
    assert {"heads", "average_layers"} <= names(ClsAttention)


def test_region_methods_declare_their_labels():
    """``gives_labels`` (label_upsampling acts only with region labels) on every method."""
    from segment.methods import __all__ as names
    import segment.methods as methods

    labelled = {n for n in names if isinstance(getattr(methods, n), type)
                and issubclass(getattr(methods, n), methods.Method)
                and getattr(methods, n).gives_labels}
    assert labelled == {"EscapeCuts", "KMeansKeys", "RegionGrow"}


def test_data_sets_declare_their_class_names():
    """``class_names`` is the classes' names (or ``None``) on every data set; ImageNet-seg's
    switch for looking up each image's class is ``lookup_class_names``, not a bool there."""
    import inspect
    import typing

    from segment.datasets.base import SegmentationDataset
    from segment.datasets.imagenet_seg import ImageNetSegmentation

    hints = typing.get_type_hints(SegmentationDataset)
    assert "class_names" in hints and SegmentationDataset.class_names is None
    assert "selection_keys" in hints and SegmentationDataset.selection_keys == ()
    params = inspect.signature(ImageNetSegmentation).parameters
    assert "lookup_class_names" in params and "class_names" not in params
    assert ImageNetSegmentation.class_names is None
