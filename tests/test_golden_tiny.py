"""The everyday golden test: the default recipe on a tiny ViT with committed weights.

``segment`` with its defaults (the default method on the bundled examples), but with
``model=vit_tiny_random`` and the fixed weights ``tests/golden/vit_tiny_fixed.safetensors``
(310 KB, written by ``tests/golden/make_vit_tiny_fixed.py``), so it runs on every machine
without the shared assets, in seconds, and belongs to the ``-m "not slow"`` loop. It checks
the summary ``tests/test_golden.py`` checks for the real model (its
:func:`~test_golden.examples_summary`: per image the regions, their escape probabilities and
areas, the mask's fraction and the heatmap's mean) against
``tests/golden/summary/segment_examples_tiny.json``, with the same tolerance and the same
update rule: after a change meant to change the outputs, ``SEGMENT_GOLDEN_UPDATE=1``
rewrites it (say why in the commit). The real model's byte identity stays with
``tests/test_golden.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import assert_results_equal_files, segment_in_process
from test_golden import EXAMPLES, GOLDEN, _mismatches, examples_summary

WEIGHTS = GOLDEN / "vit_tiny_fixed.safetensors"
SUMMARY = GOLDEN / "summary" / "segment_examples_tiny.json"
TOLERANCE = 2e-3  # test_golden's for the examples: far below a change of recipe, far above rounding
NAMES = ["astronaut", "chelsea", "coffee"]


def _run(out: Path, *args: str) -> dict:
    """``segment`` on the bundled examples with the fixed tiny model (on the CPU, where the
    summary was written); its summary."""
    code = segment_in_process(f"output={out}", "model=vit_tiny_random", f"model.checkpoint={WEIGHTS}",
                              "device=cpu", "progress=false", *args)
    assert code == 0
    return json.loads(json.dumps(examples_summary(out)))  # plain floats, as the file holds


def test_default_recipe_on_the_fixed_tiny_model(tmp_path):
    """The command's files summarise as recorded, and the Python API gives the same masks,
    heatmaps and labels."""
    import segment

    out = tmp_path / "seg"
    summary = _run(out)
    run = json.loads((out / "run.json").read_text())
    assert run["counts"]["segmented"] == 3 and Path(run["input"]).resolve() == EXAMPLES
    if os.environ.get("SEGMENT_GOLDEN_UPDATE", "") == "1":
        SUMMARY.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    want = json.loads(SUMMARY.read_text())
    # the fixture has teeth: several regions per image, cut at escapes spread below 0.5
    assert all(s["num_regions"] >= 5 and len(s["escape"]) >= 2 for s in want.values()), want
    bad = _mismatches(summary, want, TOLERANCE)
    assert not bad, f"{len(bad)} summary values moved: {bad[:8]}"
    seg = segment.load("vit_tiny_random", checkpoint=WEIGHTS, device="cpu")
    assert_results_equal_files(seg([EXAMPLES / f"{n}.png" for n in NAMES]), out, NAMES)


@pytest.mark.parametrize("change", [
    "method.escape=0.45",        # the cut threshold
    "method.refine_steps=2",     # the pixel refinement
    "method.min_area=0.004",     # the speck absorption
    "method.key_temperature=0.1",  # the foreground score and the heatmap
])
def test_the_summary_sees_a_change_of_recipe(tmp_path, change):
    """Each stage of the default moved a little moves the summary beyond the tolerance (a
    fixture on which the recipe's knobs changed nothing would pass any refactor)."""
    bad = _mismatches(_run(tmp_path / "seg", change), json.loads(SUMMARY.read_text()), TOLERANCE)
    assert bad, f"{change} left the summary within {TOLERANCE}"
