"""Recursive normalized cuts (segment.core.cuts): planted metastable blocks with a known
escape probability, the reversible part of a chain against float64 references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from segment.core import cuts, markov


def planted_affinity(k: int, m: int, eps: float, noise: float = 0.0, seed: int = 0) -> torch.Tensor:
    """``(1, k m, k m)`` symmetric W whose chain leaves each of the k blocks of m tokens with
    probability exactly ``eps`` per step (uniform within and across blocks)."""
    n = k * m
    block = torch.arange(n) // m
    same = (block[:, None] == block[None, :]).double()
    w = (1 - eps) * same / m + eps * (1 - same) / (n - m)
    if noise:
        g = torch.Generator().manual_seed(seed)
        e = noise * torch.rand(n, n, generator=g, dtype=torch.float64) / n
        w = w + (e + e.T) / 2
    return w.unsqueeze(0)


def padded_batch(ws: list[torch.Tensor], fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Chains of different sizes padded into one ``(R, m, m)`` float64 batch, as the
    recursive cuts batch a level's regions (the padding rows hold ``fill``), and their sizes."""
    m = max(w.shape[0] for w in ws)
    pad = torch.zeros(len(ws), m, m, dtype=torch.float64)
    for r, w in enumerate(ws):
        pad[r, : w.shape[0], : w.shape[0]] = w
        pad[r, w.shape[0]:, :] = fill
    return pad, torch.tensor([w.shape[0] for w in ws])


def same_partition(a: torch.Tensor, b: torch.Tensor) -> bool:
    fwd, back = {}, {}
    for x, y in zip(a.flatten().tolist(), b.flatten().tolist()):
        if fwd.setdefault(x, y) != y or back.setdefault(y, x) != x:
            return False
    return True


@pytest.mark.parametrize("k", [2, 3, 5])
def test_planted_blocks_below_tau_are_all_found(k):
    m, eps, tau = 6, 0.05, 0.3
    w = planted_affinity(k, m, eps, noise=0.01)
    part = cuts.recursive_ncut(w, tau)
    assert int(part.counts[0]) == k
    assert same_partition(part.labels[0], torch.arange(k * m) // m)
    # each block is left with probability eps (up to the jitter)
    assert torch.allclose(part.escape[0].double(), torch.full((k,), eps, dtype=torch.float64),
                          atol=5e-3)


def test_exact_escape_probability_of_planted_blocks():
    w = planted_affinity(4, 5, 0.12)
    lab = (torch.arange(20) // 5).unsqueeze(0)
    esc = cuts.escape_probabilities(w, lab)
    assert torch.allclose(esc.double(), torch.full((1, 4), 0.12, dtype=torch.float64), atol=1e-6)


def test_blocks_crossed_more_often_than_tau_stay_together():
    # splitting k equal blocks in two is crossed with probability eps k / (k - 1): with
    # eps = 0.4 and k = 4 that is 0.533 > tau, so the image stays one region
    k, m = 4, 6
    part = cuts.recursive_ncut(planted_affinity(k, m, 0.4, noise=0.01), tau=0.3)
    assert int(part.counts[0]) == 1
    # and with tau above 0.533 the blocks are found again
    part = cuts.recursive_ncut(planted_affinity(k, m, 0.4, noise=0.01), tau=0.6)
    assert int(part.counts[0]) == k


def test_best_cut_ncut_is_the_sum_of_the_two_escape_probabilities():
    w = planted_affinity(2, 7, 0.1, noise=0.05, seed=3)[0]
    ncut, side = cuts.best_cut(w)
    lab = side.long().unsqueeze(0)
    esc = cuts.escape_probabilities(w.unsqueeze(0), lab)
    assert ncut == pytest.approx(float(esc.double().sum()), abs=1e-6)
    # brute force over every split of 14 tokens: the sweep finds the optimum here
    n = w.shape[0]
    best = 10.0
    for mask in range(1, 2 ** (n - 1)):
        s = torch.tensor([(mask >> i) & 1 for i in range(n)], dtype=torch.bool)
        cut = float(w[s][:, ~s].sum())
        best = min(best, cut / float(w[s].sum()) + cut / float(w[~s].sum()))
    assert ncut == pytest.approx(best, abs=1e-9)


def test_batch_partitions_each_image_on_its_own():
    w = torch.cat([planted_affinity(3, 4, 0.05, noise=0.01), planted_affinity(2, 6, 0.05,
                                                                              noise=0.01)])
    part = cuts.recursive_ncut(w, 0.3)
    assert part.counts.tolist() == [3, 2]
    assert [len(e) for e in part.escape] == [3, 2]
    assert int(part.labels[1].max()) == 1


def test_max_regions_stops_splitting():
    part = cuts.recursive_ncut(planted_affinity(5, 4, 0.02, noise=0.01), 0.3, max_regions=3)
    assert int(part.counts[0]) == 3


def test_bad_arguments_are_refused():
    w = planted_affinity(2, 3, 0.1)
    with pytest.raises(ValueError, match="tau"):
        cuts.recursive_ncut(w, 0.0)
    with pytest.raises(ValueError, match="non-negative"):
        cuts.recursive_ncut(-w, 0.3)
    with pytest.raises(ValueError, match=r"\(B, n, n\)"):
        cuts.recursive_ncut(w[0], 0.3)
    with pytest.raises(ValueError, match="temperature"):
        cuts.key_affinity(torch.randn(1, 2, 4, 3), 0.0)


def _reference_stationary(p: np.ndarray) -> np.ndarray:
    vals, vecs = np.linalg.eig(p.T)
    v = np.real(vecs[:, np.argmin(np.abs(vals - 1))])
    return v / v.sum()


def test_stationary_and_reversible_part_against_float64_references():
    g = torch.Generator().manual_seed(1)
    p = torch.rand(3, 9, 9, generator=g, dtype=torch.float64) ** 3
    p = p / p.sum(-1, keepdim=True)  # not reversible
    pi = markov.exact_stationary(p)
    for i in range(3):
        np.testing.assert_allclose(pi[i].numpy(), _reference_stationary(p[i].numpy()), atol=1e-12)
    w = cuts.reversibilise(p)
    assert w.dtype == torch.float64
    torch.testing.assert_close(w, w.transpose(-1, -2))
    torch.testing.assert_close(w.sum(-1), pi)  # D = Pi
    prev = w / w.sum(-1, keepdim=True)
    # the reversible chain keeps pi and satisfies detailed balance
    torch.testing.assert_close((pi.unsqueeze(1) @ prev)[:, 0], pi)
    flow = pi.unsqueeze(-1) * prev
    torch.testing.assert_close(flow, flow.transpose(-1, -2))
    # by hand for one entry: W_ij = (pi_i P_ij + pi_j P_ji) / 2
    assert float(w[0, 2, 5]) == pytest.approx(
        float(pi[0, 2] * p[0, 2, 5] + pi[0, 5] * p[0, 5, 2]) / 2, rel=1e-12)


def test_a_reversible_chain_is_its_own_reversible_part():
    w0 = planted_affinity(3, 3, 0.2, noise=0.3)[0]
    p = w0 / w0.sum(1, keepdim=True)
    w = cuts.reversibilise(p)
    torch.testing.assert_close(w / w.sum(1, keepdim=True), p)
    torch.testing.assert_close(w, w0 / w0.sum())


def test_key_affinity_centres_the_keys():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64)
    shared = 50 * torch.randn(1, 2, 1, 4, generator=g, dtype=torch.float64)
    w = cuts.key_affinity(base + shared, 0.2)  # a common component shared by every token
    torch.testing.assert_close(w, cuts.key_affinity(base, 0.2))
    raw = cuts.key_affinity(base + shared, 0.2, center=False)
    assert float(raw.min()) > 0.99  # without centring every pair looks alike
    # by hand: exp((cos - 1) / T) of the centred, concatenated keys
    k = (base - base.mean(2, keepdim=True))[0].transpose(0, 1).reshape(6, 8)
    k = k / k.norm(dim=1, keepdim=True)
    assert float(w[0, 1, 4]) == pytest.approx(float(torch.exp((k[1] @ k[4] - 1) / 0.2)), rel=1e-12)
    torch.testing.assert_close(w, w.transpose(1, 2))


# ------------------------------------------------------------------- the method (EscapeCuts)


def _planted():
    from test_regions import planted_labels, planted_record_with_keys, same_partition

    rec = planted_record_with_keys()
    up = planted_labels(8, 8).repeat_interleave(4, 0).repeat_interleave(4, 1)
    return rec, up, same_partition


def test_escape_cuts_find_the_planted_blocks_and_decide_the_foreground_on_them():
    """The three planted blocks of the attention chain are the regions; block 1 (where the
    CLS attention goes, spread over the block by the key chain) is the one foreground
    region, so the mask is exactly the union of the foreground regions."""
    from segment.core.masks import to_masks
    from segment.methods import EscapeCuts

    rec, up, same = _planted()
    method = EscapeCuts(escape=0.3, layers=[0], refine_steps=0)
    out = method(rec)
    assert same(out.labels[0], up)
    assert len(out.escape) == 1 and len(out.escape[0]) == 3  # the three blocks' escape
    assert all(0 <= float(e) < 0.3 for e in out.escape[0])
    mask = to_masks(out, (32, 32))[1][0]
    assert torch.equal(mask, up == 1)
    fg = out.foreground[0][out.labels[0]]
    assert torch.equal(fg, mask)  # the mask is the union of the foreground regions
    # the heatmap ranks the mask first: every foreground pixel above every background one
    assert float(out.heatmap[0][mask].min()) > float(out.heatmap[0][~mask].max())


def test_escape_cuts_without_a_cut_fall_back_to_the_score_split():
    """A threshold no cut clears leaves one region, with no foreground/background split:
    labels and mask are then the protocol's pixel rule on the score map."""
    from segment.core.masks import to_masks
    from segment.methods import EscapeCuts

    rec, up, same = _planted()
    method = EscapeCuts(escape=1e-4, layers=[0], refine_steps=0)
    out = method(rec)
    assert [len(e) for e in out.escape] == [1]
    score = F.interpolate(method.score_map(rec).unsqueeze(1), size=(32, 32),
                          mode="bilinear", align_corners=False)[0, 0]
    assert torch.equal(to_masks(out, (32, 32))[1][0], score > score.mean())
    assert same(out.labels[0], (score > score.mean()).long())


def test_escape_cuts_average_the_reversible_chains_of_several_layers():
    """layers=[0, 1]: the cut chain is the mean of the two layers' W (float64 reference)."""
    from segment.core import markov
    from segment.methods import EscapeCuts
    from segment.methods.base import mean_patch_chain

    rec, _, _ = _planted()
    rec.attn[1] = rec.attn[0].flip(-1).softmax(-1)
    rec.keys[1] = rec.keys[0]
    rec.num_layers = 2
    m = EscapeCuts(layers=[0, 1], refine_steps=0)
    got = m.cut_affinity(rec).double()
    want = []
    for i in (0, 1):
        p = mean_patch_chain(rec.attn[i].double(), rec.layout)
        pi = markov.exact_stationary(p)
        want.append((pi[..., None] * p + (pi[..., None] * p).transpose(-1, -2)) / 2)
    assert torch.allclose(got, (want[0] + want[1]) / 2, atol=1e-6)


def test_escape_cuts_refuse_bad_settings():
    from segment.methods import EscapeCuts

    with pytest.raises(ValueError, match="escape must lie in"):
        EscapeCuts(escape=0)
    with pytest.raises(TypeError, match="average_layers"):  # the chains are always averaged
        EscapeCuts(layers=[-2, -1], average_layers=True)
    with pytest.raises(ValueError, match="refine_scale"):
        EscapeCuts(refine_scale=0.3)  # the 8-px window would be 2.4 px
    for gone in ("tau", "label_tau", "seeds", "cut_chain", "score", "heat", "connectivity"):
        with pytest.raises(TypeError):  # removed, not hidden (docs/methods.md)
            EscapeCuts(**{gone: None})
    rec, _, _ = _planted()
    rec.keys = {}
    with pytest.raises(ValueError, match="needs the keys of layer 0"):
        EscapeCuts(layers=[0], refine_steps=0)(rec)


def test_cuts_end_to_end_write_the_escape_of_every_region(tmp_path):
    """method=cuts through the command (records/<name>.json, run.json) and the API
    (Result.region_escape), on the tiny random ViT: one escape probability in [0, 1] per
    label id, the same in each."""
    import json

    import timm
    from PIL import Image
    from safetensors.torch import save_file
    from test_pipeline import _img, compose_cfg

    import segment
    from segment.run.job.pipeline import run_segment

    torch.manual_seed(0)
    m = timm.create_model("vit_small_patch14_dinov2", pretrained=False, num_classes=0,
                          embed_dim=64, depth=2, num_heads=2)
    ckpt = tmp_path / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(ckpt))
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    _img(56, 84, 0).save(src / "x.png")
    cfg = compose_cfg(src, out, "method=cuts", "model.image_size=[56,84]",
                      f"model.checkpoint='{ckpt}'")
    assert run_segment(cfg) == 0
    rec = json.loads((out / "records" / "x.json").read_text())
    labels = np.asarray(Image.open(out / "labels" / "x.png"))
    # one height and one escape per label id, aligned with the ids, escapes in [0, 1]
    assert len(rec["region_escape"]) == len(rec["region_height"]) == int(labels.max()) + 1
    assert all(0.0 <= e <= 1.0 for e in rec["region_escape"] if e is not None)
    # run.json: per image, the regions of its label map and each region's values
    [img] = json.loads((out / "run.json").read_text())["images"]
    assert img["status"] == "done" and img["region_escape"] == rec["region_escape"]
    assert img["regions"] == rec["num_regions"] >= 1
    assert run_segment(cfg) == 0  # resumed: the same, read back from the record
    [img] = json.loads((out / "run.json").read_text())["images"]
    assert img["status"] == "resumed" and img["region_escape"] == rec["region_escape"]
    assert img["regions"] == rec["num_regions"]
    res = segment.load("vit_tiny_random", "cuts", device="cpu", image_size=[56, 84],
                       checkpoint=str(ckpt))(Image.open(src / "x.png"))
    assert np.allclose(res.region_escape, np.array(rec["region_escape"], dtype=float),
                       atol=1e-6, equal_nan=True)
    assert res.labels is not None and res.labels.shape == (56, 84)
    # a heatmap method has none
    assert segment.load("vit_tiny_random", "cls_attention", device="cpu",
                        image_size=56)(Image.open(src / "x.png")).region_escape is None


@pytest.mark.shared
def test_cuts_on_real_attention_a_handful_of_regions_whose_union_is_the_mask(dinov2_weights):
    """On the real DINOv2 and a bundled photo (the cat): a handful of regions, each with its
    escape probability on the whole chain; the mask is the union of the foreground regions
    and finds the cat as seed and grow does (its mask, decided on other regions)."""
    from pathlib import Path

    from PIL import Image

    import segment
    from segment.core.masks import to_masks

    photo = Path(__file__).resolve().parents[1] / "datasets" / "examples" / "chelsea.png"
    img = Image.open(photo).convert("RGB")
    seg = segment.load("dinov2_vits14", "cuts", checkpoint=str(dinov2_weights), device="cpu")
    rec = seg.extract(seg.preprocess(img)[None])
    out = seg.method(rec)
    size = tuple(rec.image_size)
    mask = to_masks(out, size)[1][0]
    assert torch.equal(mask, out.foreground[0][out.labels[0]])
    regions = segment.load("dinov2_vits14", "regions", checkpoint=str(dinov2_weights),
                           device="cpu").method
    ref = to_masks(regions(rec), size)[1][0]
    iou = float((mask & ref).sum() / (mask | ref).sum())
    assert iou > 0.85, iou
    k = len(out.escape[0])
    assert 2 <= k <= 30
    assert all(0.0 <= float(e) < 1.0 for e in out.escape[0])


def test_padded_batched_cuts_equal_each_chain_cut_alone():
    # chains of different sizes padded into one batch: each cut is that of the chain alone
    ws = [planted_affinity(2, 5, 0.1, noise=0.05, seed=1)[0],
          planted_affinity(3, 4, 0.2, noise=0.05, seed=2)[0],
          planted_affinity(2, 9, 0.05, noise=0.05, seed=3)[0]]
    pad, size = padded_batch(ws, fill=7.0)  # whatever the padding holds is ignored
    ncut, side = cuts.best_cuts(pad, size)
    for r, w in enumerate(ws):
        alone, one = cuts.best_cut(w)
        assert float(ncut[r]) == pytest.approx(alone, abs=1e-9)
        k = w.shape[0]
        assert not bool(side[r, k:].any())
        got = side[r, :k]
        assert torch.equal(got, one) or torch.equal(got, ~one)


def test_level_batches_give_the_partition_of_one_region_at_a_time():
    # bucket=1: every region its own eigensolve; bucket=64: regions padded together
    w = torch.cat([planted_affinity(4, 5, 0.05, noise=0.02, seed=4),
                   planted_affinity(5, 4, 0.08, noise=0.02, seed=5)])
    a = cuts.recursive_ncut(w, 0.3, bucket=1)
    b = cuts.recursive_ncut(w, 0.3, bucket=64)
    assert a.counts.tolist() == b.counts.tolist() == [4, 5]
    assert torch.equal(a.labels, b.labels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scipy_second_eigenvector_equals_torch_eigh_and_float64(dtype):
    # segment.backends.second_eigenvectors: SciPy's partial syevr (the CPU default) against
    # torch's full eigh and the float64 reference, up to the sign; padded chains as
    # best_cuts builds them (eigenvalue -2 on the padding) included
    from segment import backends

    g = torch.Generator().manual_seed(7)
    a = torch.rand(3, 40, 40, generator=g, dtype=torch.float64)
    w = a @ a.transpose(1, 2)
    s = w.sum(-1).rsqrt()
    sym = s[:, :, None] * w * s[:, None, :]
    sym[2, 30:, :] = 0
    sym[2, :, 30:] = 0
    sym[2].diagonal()[30:] = -2.0
    ref = torch.linalg.eigh(sym)[1][..., -2]
    for backend in ("scipy", "torch"):
        got = backends.second_eigenvectors(sym.to(dtype), backend)
        assert got.dtype == dtype and got.shape == (3, 40)
        sign = torch.sign((got.double() * ref).sum(-1, keepdim=True))
        tol = 1e-4 if dtype == torch.float32 else 1e-10
        assert torch.allclose(got.double() * sign, ref, atol=tol), backend
        assert float(got[2, 30:].abs().max()) < tol  # the padding stays out
    assert backends.eigen_backend("cpu") == "krylov" and backends.eigen_backend("cuda") == "torch"
    with pytest.raises(ValueError, match="unknown eigensolver backend 'lapack'"):
        backends.second_eigenvectors(sym, "lapack")
    with pytest.raises(ValueError, match=r"\(R, m, m\)"):
        backends.second_eigenvectors(sym[0], "scipy")


def test_recursive_ncut_same_partition_with_either_eigensolver():
    from functools import partial

    from segment import backends

    w = torch.cat([planted_affinity(4, 5, 0.05, noise=0.02, seed=4),
                   planted_affinity(5, 4, 0.08, noise=0.02, seed=5)])
    parts = [cuts.recursive_ncut(w, 0.3, eigvec=partial(backends.second_eigenvectors, backend=b))
             for b in ("scipy", "torch")]
    assert parts[0].counts.tolist() == parts[1].counts.tolist() == [4, 5]
    assert torch.equal(parts[0].labels, parts[1].labels)
    assert torch.equal(parts[0].labels, cuts.recursive_ncut(w, 0.3).labels)


# --------------------------------------------------------------------------- the tree (cuts)


def _same_escape(out, part, tau):
    """The default level's escapes are the tree's (float64, rounded to float32) and equal
    ``recursive_ncut``'s (``escape_probabilities`` of its labels) up to the order of the
    float64 sums: the last float32 digit at most."""
    for e, f, tree in zip(out.escape, part.escape, out.hierarchy):
        assert e.dtype == torch.float32
        assert torch.equal(e, tree.escape_at(tau).float())
        torch.testing.assert_close(e, f, rtol=1e-6, atol=1e-7)


def _without_tree(method, rec):
    """``cuts`` as it was before it gave the tree (commit b70464e's code, inline):
    recursive_ncut at ``escape``, the one-hot regions upsampled, refined by the pixel chain
    and upsampled again, then the components and the decision: the default level's
    reference."""
    from segment import backends
    from segment.core.regions import pixel_chain_refine
    from segment.core.stages import decide_regions
    from segment.methods.cuts import HEAT
    from segment.methods.stages import foreground_score

    part = cuts.recursive_ncut(method.cut_affinity(rec), float(method.escape))
    b = part.labels.shape[0]
    h, w = rec.layout.grid
    grid_prob = F.one_hot(part.labels, int(part.counts.max())).to(torch.float32)
    grid_prob = grid_prob.transpose(1, 2).reshape(b, -1, h, w)
    size, ref = tuple(rec.image_size), method.refinement
    if ref.steps == 0 or rec.pixels is None:
        prob = F.interpolate(grid_prob, size=size, mode="bilinear", align_corners=False)
    else:
        radius, dilation, sigma_space = ref.window()
        small = size if ref.scale == 1.0 else (round(size[0] * ref.scale), round(size[1] * ref.scale))
        prob = F.interpolate(grid_prob, size=small, mode="bilinear", align_corners=False)
        image = rec.pixels if small == size else F.adaptive_avg_pool2d(rec.pixels, small)
        prob = pixel_chain_refine(prob, image, radius=radius, dilation=dilation,
                                  sigma_space=sigma_space, sigma_color=ref.sigma_color,
                                  steps=ref.steps, nonzero=grid_prob.flatten(2).any(2))
        if small != size:
            prob = F.interpolate(prob, size=size, mode="bilinear", align_corners=False)
    hard = prob.max(1).indices
    labels = backends.component_regions(hard, method.components)
    score = foreground_score(rec, method.scoring, method.name)
    return part, decide_regions(grid_prob, score, prob, hard, labels, heat=HEAT)


def _planted_with_pixels():
    rec, up, same = _planted()
    g = torch.Generator().manual_seed(5)
    img = torch.rand(1, 3, 32, 32, generator=g) * 0.2
    img[0, 0] += (up == 1).float() * 0.7  # colour edges near the blocks
    img[0, 1] += (up == 2).float() * 0.7
    rec.pixels = img
    return rec, up


def test_refinement_is_linear_per_map_and_extra_maps_leave_the_assignment_bit_identical():
    """What the tree's one refinement relies on: refine(a + b) = refine(a) + refine(b)
    (float64 reference of the sum), and maps refined alongside change no bit of the others."""
    from segment.core.stages import Refinement, refine_assignment, refine_assignments

    g = torch.Generator().manual_seed(0)
    a = (torch.rand(2, 3, 6, 8, generator=g) > 0.5).float()
    b = (torch.rand(2, 9, 6, 8, generator=g) > 0.5).float()  # 12 maps: bilinear rounds apart
    a[1, 2] = 0  # a zero map (skipped by the chain) stays linear
    pixels = torch.rand(2, 3, 24, 32, generator=g)
    for refine in (Refinement(), Refinement(steps=2, scale=1.0, radius=4, dilation=2)):
        ra, rb, rab = (refine_assignment(x, pixels, (24, 32), refine)
                       for x in (a, b[:, :3], a + b[:, :3]))
        assert torch.allclose(rab.double(), ra.double() + rb.double(), atol=1e-6)
        both = refine_assignments([a, b], pixels, (24, 32), refine)
        assert torch.equal(both[0], ra)
        assert torch.equal(both[1], refine_assignment(b, pixels, (24, 32), refine))


@pytest.mark.parametrize("steps", [0, 3])
def test_escape_cuts_default_level_is_bit_identical_with_the_tree(steps):
    """The tree rides along: labels, foreground, heatmap and escape of the default level
    are the very numbers cuts gave without it."""
    from segment.methods import EscapeCuts

    rec, _ = _planted_with_pixels()
    for name in ("attn", "keys"):  # a batch of two: the image and its mirror
        setattr(rec, name, {k: torch.cat([v, v]) for k, v in getattr(rec, name).items()})
    rec.attn[0][1, :, 1:, 1:] = rec.attn[0][1, :, 1:, 1:].flip(-1)
    rec.pixels = torch.cat([rec.pixels, rec.pixels.flip(-1)])
    method = EscapeCuts(escape=0.3, layers=[0], refine_steps=steps)
    out = method(rec)
    part, (heat, labels, fg) = _without_tree(method, rec)
    assert torch.equal(out.labels, labels) and torch.equal(out.foreground, fg)
    assert torch.equal(out.heatmap, heat)
    _same_escape(out, part, float(method.escape))


def test_escape_cuts_leaves_nest_under_the_default_regions_at_the_pixels():
    """Every pixel's leaf lies under its default region (the argmax of the refined default
    regions), so the level at escape at the pixels is that argmax, and each level is a
    union of the regions of every finer level."""
    from segment.methods import EscapeCuts
    from segment.methods.stages import pixel_regions_with

    rec, _ = _planted_with_pixels()
    method = EscapeCuts(escape=0.3, layers=[0], refine_steps=3)
    out = method(rec)
    tree, leaves = out.hierarchy[0], out.leaves[0]
    assert tree.num_leaves > 3 and len(torch.unique(leaves)) > 3
    assert method.min_tokens(64) == 6
    part, _ = _without_tree(method, rec)
    h, w = rec.layout.grid
    grid_prob = F.one_hot(part.labels, 3).float().transpose(1, 2).reshape(1, -1, h, w)
    from segment.methods.cuts import HEAT
    hard = pixel_regions_with(rec, grid_prob, None, score=method.scoring,
                              refine=method.refinement, components=method.components,
                              heat=HEAT, name="cuts").hard[0]
    assert torch.equal(tree.pixel_labels_at(leaves, 0.3), hard)
    ts = [0.0, *tree.heights.tolist(), 2.0]
    levels = [tree.pixel_labels_at(leaves, t + 1e-9) for t in ts]
    for coarse, fine in zip(levels, levels[1:]):  # every fine region inside one coarse one
        pairs = torch.unique(fine.flatten() * 1000 + coarse.flatten())
        assert len(pairs) == len(torch.unique(fine))


def test_descend_follows_the_larger_mass_down_a_hand_built_tree():
    """Leaves 0, 1, 2; split 3 = (0, 1) at 0.4, root 4 = (3, 2) at 0.2. From the root
    (t = 0.1), a pixel goes to 3 when mass(3) >= mass(2), then to 0 or 1 by their masses."""
    from segment.core.hierarchy import Hierarchy, descend

    tree = Hierarchy(leaves=torch.tensor([0, 0, 1, 2]), children=torch.tensor([[0, 1], [3, 2]]),
                     height=torch.tensor([0.4, 0.2], dtype=torch.float64),
                     ncut=torch.tensor([0.4, 0.2], dtype=torch.float64),
                     escape=torch.full((5,), 0.1, dtype=torch.float64))
    assert tree.splits_below(0.1).tolist() == [0, 1]
    # four pixels: masses of leaves 0, 1, 2 per pixel
    leaf_mass = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7], [0.2, 0.35, 0.45],
                              [0.25, 0.25, 0.5]])
    total = leaf_mass.sum(1)
    first = torch.stack([leaf_mass[:, 0], leaf_mass[:, 0] + leaf_mass[:, 1]])  # rows 0, 1
    got = descend(tree, 0.1, torch.zeros(4, dtype=torch.long), total, first)
    assert got.tolist() == [0, 2, 1, 0]  # 0.55 vs 0.45: split 3, then 0.2 < 0.35; ties first
    # from the level at 0.3 (regions {0, 1} and {2}): only split 3 lies below
    region = tree.leaf_labels_at(0.3)[torch.tensor([0, 2, 2, 0])]
    own = torch.tensor([0.8, 0.7, 0.45, 0.5])
    got = descend(tree, 0.3, region, own, leaf_mass[:, :1].T.contiguous())
    assert got.tolist() == [0, 2, 2, 0]
    with pytest.raises(ValueError, match="first_mass"):
        descend(tree, 0.3, region, own, leaf_mass.T)


def test_escape_cuts_refuse_a_bad_floor():
    from segment.methods import EscapeCuts

    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="min_leaf"):
            EscapeCuts(min_leaf=bad)


def test_escape_cuts_default_level_is_bit_identical_on_real_attention(dinov2_weights):
    """The bundled photos in one batch on the real DINOv2 (21, 2 and 16 default regions,
    a few dozen leaves: the bilinear kernel's rounding depends on the number of maps and
    their memory layout): labels, foreground, heatmap and escape bit for bit as before."""
    from pathlib import Path

    from PIL import Image

    import segment

    root = Path(__file__).resolve().parents[1] / "datasets" / "examples"
    seg = segment.load("dinov2_vits14", "cuts", checkpoint=str(dinov2_weights), device="cpu")
    x = torch.stack([seg.preprocess(Image.open(root / f"{n}.png").convert("RGB"))
                     for n in ("astronaut", "chelsea", "coffee")])
    with torch.no_grad():
        rec = seg.extract(x)
        out = seg.method(rec)
        part, (heat, labels, fg) = _without_tree(seg.method, rec)
    assert torch.equal(out.labels, labels) and torch.equal(out.foreground, fg)
    assert torch.equal(out.heatmap, heat)
    _same_escape(out, part, float(seg.method.escape))
    assert all(t.num_leaves > len(e) for t, e in zip(out.hierarchy, out.escape))
