"""segment.run.front.build: every config node is built by one function with one error policy
(a one-line BuildError, a ValueError, naming the node and the problem)."""

from __future__ import annotations

import fractions
import pathlib

import pytest
from omegaconf import OmegaConf

from segment.run.front.build import BuildError, build, problem


def test_build_gives_the_object_with_the_callers_keywords():
    node = OmegaConf.create({"_target_": "fractions.Fraction", "numerator": 3})
    assert build(node, fractions.Fraction) == fractions.Fraction(3)
    assert build(node, fractions.Fraction, denominator=4) == fractions.Fraction(3, 4)


def test_a_refused_setting_is_one_line_naming_the_node_with_the_cause_chained():
    node = OmegaConf.create({"_target_": "fractions.Fraction", "numerator": "x"})
    with pytest.raises(BuildError) as e:
        build(node, fractions.Fraction, "method 'r2'")
    assert isinstance(e.value, ValueError)  # callers (and users) catch a ValueError
    assert str(e.value) == "cannot build method 'r2': Invalid literal for Fraction: 'x'"
    assert type(e.value.__cause__) is ValueError  # the constructor's own error, not Hydra's wrapper


def test_other_errors_are_named_by_their_type():
    node = OmegaConf.create({"_target_": "fractions.Fraction", "numerator": 1, "nope": 2})
    with pytest.raises(BuildError, match=r"^cannot build the dataset: TypeError: .*nope") as e:
        build(node, fractions.Fraction, "the dataset")
    assert "\n" not in str(e.value) and isinstance(e.value.__cause__, TypeError)
    assert problem(RuntimeError("no weights\nsecond line")) == "RuntimeError: no weights"
    assert problem(FileNotFoundError()) == "FileNotFoundError"


def test_an_object_of_another_kind_is_refused():
    node = OmegaConf.create({"_target_": "pathlib.PurePosixPath", "_args_": ["a"]})
    with pytest.raises(BuildError, match=r"^cannot build pathlib.PurePosixPath: pathlib.PurePosixPath is not a "
                                         r"fractions.Fraction \(got PurePosixPath\)$"):
        build(node, fractions.Fraction)
    assert build(node, pathlib.PurePath) == pathlib.PurePosixPath("a")
