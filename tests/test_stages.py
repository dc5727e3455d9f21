"""The shared stages of the region methods as units (segment.core.stages, segment.methods.stages,
segment.backends.component_regions), the frozen method dataclasses, and the bench's variants."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from segment import backends
from segment.core import regions as rg
from segment.core.stages import Components, Refinement, decide_regions, refine_assignment
from segment.methods import ClsAttention, ClsKeyChain, EscapeCuts, KMeansKeys, Method, RegionGrow
from segment.methods.stages import ForegroundScore, foreground_score, pixel_regions

# ------------------------------------------------------------------------------ refinement


def test_refinement_validates_and_scales_its_window():
    assert Refinement().window() == (4, 2, 2.5)  # 8 px and 4 px at half the resolution
    assert Refinement(scale=1.0, radius=5, dilation=1, sigma_space=3.0).window() == (5, 1, 3.0)
    assert Refinement(scale=0.25).window() == (2, 1, 1.25)
    for bad, match in ((dict(steps=-1), "refine_steps must be an integer >= 0"),
                       (dict(steps=1.5), "refine_steps must be an integer"),
                       (dict(radius=0), "refine_radius must be an integer >= 1"),
                       (dict(sigma_color=0.0), "sigma_color must be > 0"),
                       (dict(scale=0.0), r"refine_scale must lie in \(0, 1\]"),
                       (dict(scale=True), r"refine_scale must lie in \(0, 1\]"),
                       (dict(radius=5), "refine_radius=5 px into 2.5 px")):
        with pytest.raises(ValueError, match=match):
            Refinement(**bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Refinement().steps = 0  # type: ignore[misc]


def test_refine_assignment_without_steps_is_bilinear_upsampling():
    g = torch.Generator().manual_seed(1)
    grid_prob = torch.softmax(torch.randn(2, 3, 4, 5, generator=g), 1)
    pixels = torch.rand(2, 3, 16, 20, generator=g)
    got = refine_assignment(grid_prob, pixels, (16, 20), Refinement(steps=0))
    want = F.interpolate(grid_prob, size=(16, 20), mode="bilinear", align_corners=False)
    assert torch.equal(got, want)


def test_refine_assignment_snaps_a_blurred_boundary_to_the_image_edge():
    """A two-region assignment blurred across an image edge (left half dark, right half
    bright): after the pixel chain each side of the edge holds its own region, the maps stay
    a distribution per pixel, and an all-zero map stays zero."""
    h, w = 16, 16
    pixels = torch.zeros(1, 3, h, w)
    pixels[..., w // 2:] = 1.0
    grid = torch.zeros(1, 3, 4, 4)
    grid[0, 0] = torch.tensor([1.0, 0.9, 0.1, 0.0]).expand(4, 4)  # soft ramp across the edge
    grid[0, 1] = 1 - grid[0, 0]
    refine = Refinement(steps=20, radius=4, dilation=1, scale=1.0, sigma_space=3.0,
                        sigma_color=0.05)
    out = refine_assignment(grid, pixels, (h, w), refine)
    plain = refine_assignment(grid, pixels, (h, w), dataclasses.replace(refine, steps=0))
    assert torch.equal(out[0, 2], torch.zeros(h, w))
    torch.testing.assert_close(out.sum(1), torch.ones(1, h, w), atol=1e-5, rtol=0)
    side = torch.zeros(h, w, dtype=torch.long)
    side[:, w // 2:] = 1
    assert torch.equal(out[0, :2].argmax(0), side)
    # the pixels next to the edge are sharper than bilinear upsampling left them
    col = w // 2 - 1
    assert float(out[0, 0, :, col].min()) > float(plain[0, 0, :, col].max())


# ------------------------------------------------------------------------------ components


def test_component_regions_split_regions_and_absorb_specks():
    """Label 1 in two separate blocks becomes two regions; a 1-pixel speck of label 2 inside
    the label-0 area is absorbed with min_area 2 px of 64 (not with 0, nor without
    connectivity, which only renumbers)."""
    hard = torch.zeros(1, 8, 8, dtype=torch.long)
    hard[0, :3, :3] = 1
    hard[0, 5:, 5:] = 1
    hard[0, 6, 1] = 2
    hard[0, 0, 7] = 5
    hard[0, 0, 6] = 5
    got = backends.component_regions(hard, Components(connectivity=True, min_area=0.0))
    want_split = torch.zeros_like(hard)  # ids by (label value, first pixel in raster order)
    want_split[0, :3, :3] = 1
    want_split[0, 5:, 5:] = 2
    want_split[0, 6, 1] = 3
    want_split[0, 0, 6:] = 4
    assert torch.equal(got, want_split)
    absorbed = backends.component_regions(hard, Components(connectivity=True, min_area=2 / 64))
    want_abs = want_split.clone()
    want_abs[0, 6, 1] = 0  # the speck joins the region around it
    want_abs[0, 0, 6:] = 3  # two pixels: kept, renumbered after the speck went
    assert torch.equal(absorbed, want_abs)
    plain = backends.component_regions(hard, Components(connectivity=False, min_area=0.5))
    assert torch.equal(plain, rg.relabel(hard))
    assert Components(min_area=0.002).min_pixels((224, 224)) == 100
    assert Components(connectivity=False).min_pixels((224, 224)) is None
    with pytest.raises(ValueError, match=r"min_area is a fraction of the image in \[0, 1\)"):
        Components(min_area=1.0)


# ------------------------------------------------------------------------------ decision


def _two_regions():
    """A 2 x 2 grid, region 0 the left column, region 1 the right; the score is high on the
    right. At 4 x 4 pixels, no refinement."""
    grid_prob = torch.zeros(1, 2, 2, 2)
    grid_prob[0, 0, :, 0] = 1
    grid_prob[0, 1, :, 1] = 1
    score = torch.tensor([[[0.1, 0.9], [0.3, 0.7]]])
    prob = F.interpolate(grid_prob, size=(4, 4), mode="bilinear", align_corners=False)
    hard = prob.max(1).indices
    return grid_prob, score, prob, hard


def test_decide_regions_by_the_mean_score_with_both_heatmaps():
    grid_prob, score, prob, hard = _two_regions()
    labels = rg.relabel(hard)
    heat, lab, fg = decide_regions(grid_prob, score, prob, hard, labels, heat="expected")
    assert torch.equal(lab, labels)
    assert fg.tolist() == [[False, True]]  # right column: mean 0.8 > image mean 0.5
    region = torch.tensor([0.2, 0.8], dtype=torch.float64)  # each region's mean score
    want = torch.einsum("k,khw->hw", region, prob[0].double())
    torch.testing.assert_close(heat[0].double(), want, atol=1e-6, rtol=0)
    blend, _, _ = decide_regions(grid_prob, score, prob, hard, labels, heat="blend")
    score_img = F.interpolate(score[:, None].double(), size=(4, 4), mode="bilinear",
                              align_corners=False)[0, 0]

    def mm(x):
        return (x - x.min()) / (x.max() - x.min())

    want_blend = (mm(want) + mm(score_img) + (labels[0] == 1).double()) / 3
    torch.testing.assert_close(blend[0].double(), want_blend, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="heat must be one of"):
        decide_regions(grid_prob, score, prob, hard, labels, heat="mean")


def test_decide_regions_without_a_split_falls_back_to_the_pixel_rule():
    """One region: no foreground/background split; heatmap = the upsampled score, labels =
    score above its mean (region 1 foreground)."""
    grid_prob, score, prob, hard = _two_regions()
    one = torch.ones(1, 1, 2, 2)
    prob1 = F.interpolate(one, size=(4, 4), mode="bilinear", align_corners=False)
    hard1 = torch.zeros(1, 4, 4, dtype=torch.long)
    heat, lab, fg = decide_regions(one, score, prob1, hard1, hard1.clone())
    score_img = F.interpolate(score[:, None], size=(4, 4), mode="bilinear", align_corners=False)[:, 0]
    assert torch.equal(heat, score_img)
    assert torch.equal(lab, (score_img > score_img.mean()).long())
    assert fg.tolist() == [[False, True]]


# ------------------------------------------------------------------------------ score


def test_foreground_score_is_the_cls_attention_or_its_keychain_step():
    from test_regions import planted_record_with_keys

    rec = planted_record_with_keys()
    cls = foreground_score(rec, ForegroundScore(layers=[0]), "test")
    assert torch.equal(cls, ClsAttention(layers=[0])(rec).heatmap.float())
    smooth = foreground_score(rec, ForegroundScore(layers=[0], keychain=True), "test")
    assert torch.equal(smooth, ClsKeyChain(layers=[0])(rec).heatmap)
    assert not torch.allclose(smooth, cls)
    assert ForegroundScore(layers=[-1]).capture(12).layers == (11,)
    assert ForegroundScore(layers=[-1], keychain=True).capture(12).keys
    assert ForegroundScore(layers=[-1]).capture(12).heads == "mean"
    rec.keys = {}
    with pytest.raises(ValueError, match="test: needs the keys of layer 0"):
        foreground_score(rec, ForegroundScore(layers=[0], keychain=True), "test")
    with pytest.raises(ValueError, match="key_temperature must be > 0"):
        ForegroundScore(key_temperature=0)


def test_pixel_regions_compose_the_stages():
    """pixel_regions = foreground_score, refine_assignment, argmax, component_regions,
    decide_regions, composed by hand."""
    from test_regions import planted_record_with_keys

    rec = planted_record_with_keys()
    g = torch.Generator().manual_seed(0)
    rec.pixels = torch.rand(1, 3, 32, 32, generator=g)
    grid_prob = torch.softmax(2 * torch.randn(1, 3, 8, 8, generator=g), 1)
    score = ForegroundScore(layers=[0], keychain=True)
    refine = Refinement(steps=2, radius=4, dilation=2, scale=0.5)
    comp = Components(min_area=0.01)
    got = pixel_regions(rec, grid_prob, score=score, refine=refine, components=comp,
                        heat="blend", name="test")
    prob = refine_assignment(grid_prob, rec.pixels, (32, 32), refine)
    hard = prob.argmax(1)
    labels = backends.component_regions(hard, comp)
    want = decide_regions(grid_prob, foreground_score(rec, score, "test"), prob, hard, labels,
                          heat="blend")
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------ the methods


def test_methods_are_frozen_and_replace_validates_again():
    m = EscapeCuts()
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.refine_steps = 0  # type: ignore[misc]
    assert dataclasses.replace(m, refine_steps=0).refinement.steps == 0
    with pytest.raises(ValueError, match="escape must lie in"):
        dataclasses.replace(m, escape=0)
    with pytest.raises(ValueError, match="cuts: refine_scale=0.3 turns refine_radius=8"):
        dataclasses.replace(m, refine_scale=0.3)
    with pytest.raises(ValueError, match="refine_scale=0.25 has no effect"):
        EscapeCuts(refine_steps=0, refine_scale=0.25)
    r = RegionGrow(score_layers=[-1])
    assert r.score_layers == (-1,) and r == RegionGrow()


@pytest.mark.parametrize("cls", [EscapeCuts, RegionGrow, KMeansKeys])
def test_no_method_holds_another_method(cls):
    m = cls()
    held = [k for k, v in vars(m).items() if isinstance(v, Method)]
    assert not held, f"{cls.__name__} holds methods: {held}"


def test_the_stages_follow_the_fields():
    """Every stage setting of cuts and regions is read from the method's fields at call time
    (a copy by replace changes the stage)."""
    m = dataclasses.replace(EscapeCuts(), refine_steps=1, refine_scale=1.0, min_area=0.01,
                            key_temperature=0.2, layers=[-2])
    assert m.refinement == Refinement(steps=1, scale=1.0)
    assert m.components == Components(min_area=0.01)
    assert m.scoring == ForegroundScore(layers=(-2,), keychain=True, key_temperature=0.2)
    r = dataclasses.replace(RegionGrow(), sigma_color=0.1, connectivity=False, min_area=0.002,
                            score="keychain", score_layers=[0, 1])
    assert r.refinement.sigma_color == 0.1 and not r.components.connectivity
    assert r.scoring == ForegroundScore(layers=(0, 1), keychain=True)


def test_cuts_eigensolver_is_a_call_argument():
    from test_cuts import _planted

    rec, up, same = _planted()
    m = EscapeCuts(escape=0.3, layers=[0], refine_steps=0)
    a, b = m(rec, eigen="scipy"), m(rec, eigen="torch")
    assert same(a.labels[0], up) and torch.equal(a.labels, b.labels)
    with pytest.raises(ValueError, match="unknown eigensolver backend 'lapack'"):
        m(rec, eigen="lapack")  # type: ignore[arg-type]


def test_bench_without_refinement_is_the_method_with_refine_steps_0():
    """The bench's "of which pixel refinement" column times this copy: the pixel chain off,
    everything else as set (cuts: the escape; regions: the other knobs)."""
    from segment.eval.bench.regions import without_refinement

    from test_cuts import _planted

    cuts = EscapeCuts(escape=0.3, layers=[0], refine_scale=1.0)
    bare = without_refinement(cuts)
    assert bare == EscapeCuts(escape=0.3, layers=[0], refine_steps=0)
    rec, _, _ = _planted()
    rec.pixels = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    got, want = bare(rec), EscapeCuts(escape=0.3, layers=[0], refine_steps=0)(rec)
    assert torch.equal(got.heatmap, want.heatmap) and torch.equal(got.labels, want.labels)
    assert not torch.equal(cuts(rec).heatmap, got.heatmap)  # the refinement did run before
    regions = RegionGrow(refine_radius=6, refine_scale=1.0, tau=0.3)
    assert without_refinement(regions) == RegionGrow(refine_steps=0, tau=0.3)
