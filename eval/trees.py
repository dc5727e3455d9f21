"""``segment-eval`` and the hierarchical methods: every level of a method's tree scored from the
same backbone pass (protocol §4d; the scoring itself: :mod:`segment.eval.hierarchy`).

A method whose output carries a hierarchy (``MethodOutput.hierarchy`` and ``.leaves``: the
escape cuts, ``gives_hierarchy``) is scored on region sets (BSDS500, CamVid, label folders) at
:data:`~segment.eval.hierarchy.TREE_THRESHOLDS` besides its usual row:

- per image, the leaf map (every pixel's leaf at the backbone input) is brought to the ground
  truth's size as ``segment`` brings its labels there (``smooth``: the argmax of the leaves'
  bilinearly upsampled one-hot maps), and each level is a union of leaves on that map
  (:class:`~segment.eval.hierarchy.OnLeafMap`), so the levels nest at that size;
  :func:`~segment.eval.hierarchy.score_image` gives its state at every threshold (on BSDS also
  the best over its exact heights), cached per image beside the method's other states
  (key :func:`tree_key`);
- over the set, :func:`~segment.eval.hierarchy.hierarchy_table`: the level at the method's
  ``escape`` (``default``; a level is the token regions' pixels, before the connected
  components the written labels split them into), the ODS per metric with its threshold, and
  on BSDS the OIS (also over exact heights), with bootstrap intervals whose draws pick the
  ODS threshold again; written to ``OUTPUT/hierarchy/`` (``hierarchy.{json,csv,md}``,
  ``curves.csv``, ``curves.png``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from segment.eval.hierarchy import (
    TREE_THRESHOLDS,
    HierarchyResults,
    ImageScores,
    OnLeafMap,
    hierarchy_table,
    score_image,
)
from torch import Tensor

from segment.core.masks import MethodOutput, label_upsampling_setting, labels_at
from segment.methods.base import Method

TASKS = ("regions", "multiclass")


def tree_key(key: str) -> str:
    """The cache key of a method's per-image hierarchy scores (beside its state, ``key``)."""
    return f"{key}#tree"


def scores_tree(method: Method, task: str) -> bool:
    """Whether ``segment-eval`` scores ``method``'s hierarchy on a set of ``task``."""
    return method.gives_hierarchy and task in TASKS


def tree_states(out: MethodOutput, targets: Sequence[Tensor], task: str, num_classes: int = 0
                ) -> list[ImageScores]:
    """Per image the scores of every level of the method's hierarchy (module docstring)."""
    if out.hierarchy is None or out.leaves is None:
        raise ValueError("the method gave no hierarchy (MethodOutput.hierarchy, .leaves)")
    res = []
    mode = label_upsampling_setting(None)
    for i, t in enumerate(targets):
        size = tuple(t.shape[-2:])
        leaves = labels_at(out.leaves[i: i + 1], size, mode)[0].cpu().numpy()
        res.append(score_image(OnLeafMap(out.hierarchy[i], leaves), t.cpu().numpy(), TREE_THRESHOLDS,
                               task, num_classes, exact=task == "regions"))
    return res


def default_threshold(method: Method) -> float | None:
    """The threshold of the method's own level (:attr:`Method.default_level`, ``escape``)
    when it is one of those scored."""
    t = method.default_level
    if t is None or not np.any(np.isclose(TREE_THRESHOLDS, float(t), rtol=0, atol=1e-9)):
        return None
    return float(TREE_THRESHOLDS[np.isclose(TREE_THRESHOLDS, float(t), rtol=0, atol=1e-9)][0])


def tree_table(per_method: Mapping[str, Sequence[ImageScores]],
               default: float | Mapping[str, float | None] | None, reps: int,
               seed: int, out_dir: Path, title: str) -> HierarchyResults:
    """The hierarchy table of the methods' per-image scores, written to ``out_dir/hierarchy``."""
    res = hierarchy_table(per_method, default=default, reps=reps, seed=seed)
    res.write(out_dir / "hierarchy", title=title)
    return res
