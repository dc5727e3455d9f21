"""segment.eval.bench.gpu: the GPU self-check's comparisons, and its CPU half end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from segment.eval.bench.gpu import (
    SelfCheck,
    main,
    mask_disagreement,
    method_names,
    partition_agreement,
)

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


def test_partition_agreement_hand_cases():
    a = np.array([[0, 0, 1, 1], [2, 2, 1, 1]])
    assert partition_agreement(a, a + 7) == 1.0  # other ids, same partition
    assert partition_agreement(a, np.array([[5, 5, 3, 3], [9, 9, 3, 3]])) == 1.0
    merged = np.array([[0, 0, 1, 1], [0, 0, 1, 1]])  # regions 0 and 2 merged
    # purity a->merged = 1; merged->a: region 0 of merged (4 px) is best matched by 2 px
    assert partition_agreement(a, merged) == pytest.approx(6 / 8)
    assert partition_agreement(np.zeros(8), np.arange(8)) == pytest.approx(1 / 8)


def test_mask_disagreement_ignores_the_threshold_band():
    r = torch.tensor([[[0.0, 0.5, 0.5, 1.0]]])  # mean 0.5: the two middle pixels sit on it
    near = torch.tensor([[[0.0, 0.501, 0.499, 1.0]]])
    assert mask_disagreement(r, near, band=0.01) == 0.0
    flipped = torch.tensor([[[1.0, 0.5, 0.5, 0.0]]])
    assert mask_disagreement(r, flipped, band=0.01) == pytest.approx(0.5)


def test_check_verdicts(tmp_path):
    sc = SelfCheck(torch.device("cpu"), True, None, tmp_path, log=lambda s: None)
    assert sc.add("g", "lower", "max_abs", 1e-3, 2e-3).passed
    assert not sc.add("g", "lower", "max_abs", 3e-3, 2e-3).passed
    assert sc.add("g", "higher", "agreement", 0.99, 0.97, higher_is_better=True).passed
    assert not sc.add("g", "higher", "agreement", 0.9, 0.97, higher_is_better=True).passed
    assert not sc.add("g", "nan", "max_abs", float("nan"), 1.0).passed
    assert set(method_names()) >= {"bounce", "cls_attention", "concept_attention", "regions", "rollout", "tokenrank"}


@pytest.mark.slow
def test_cpu_half_runs_and_writes_its_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = tmp_path / "gpu.json"
    assert main(["--quick", "--device", "cpu", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "running the CPU half only" in printed and "tolerance" in printed
    res = json.loads(path.read_text())
    assert res["cpu_half_only"] is True and res["cuda"] is False and res["device"] == "cpu"
    assert res["passed"] is True and res["failed"] == []
    checks = res["checks"]
    assert {c["group"] for c in checks} == {"capture", "method", "regions", "markov", "cuts", "flux",
                                               "e2e"}
    for c in checks:
        assert set(c) >= {"group", "name", "metric", "value", "tolerance", "passed"} and c["passed"], c
    names = " | ".join(c["name"] for c in checks)
    for what in ("float32", "bfloat16", "kornia vs scikit-image", "tokenrank", "lambda_2", "offload",
                 "no offload", "concept_attention", "segment vit_tiny_random", "segment-eval",
                 "stationary, power iteration vs exact", "cuts, Krylov on cpu vs dense"):
        assert what in names, what
    for m in ("bounce", "cls_attention", "regions", "rollout", "tokenrank"):
        assert f"vit_tiny_random {m} heatmap" in names, m
    # real comparisons even on the CPU: bf16 against fp32 differs, lambda_2 against dense f64
    bf16 = next(c for c in checks if c["name"].endswith("bfloat16"))
    assert 0 < bf16["value"] <= bf16["tolerance"]
    ratios = res["ratios"]
    assert ratios["pipeline"][0]["ratio"] > 0 and ratios["pipeline"][0]["bare_forward_img_s"] > 0
    assert ratios["region_stage"][0]["regions_over_forward"] > 0
    assert 0 < ratios["lambda2_vs_dense"][0]["ratio"]
