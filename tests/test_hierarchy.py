"""The tree of the escape cuts (segment.core.cuts.cut_tree, segment.core.hierarchy): planted
blocks within blocks whose splits and escape probabilities are known in closed form, the
levels against recursive_ncut, exact nesting at the tokens and the pixels, monotone heights,
float64 references for every recorded NCut and escape probability."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from segment.core import cuts
from segment.core.hierarchy import Hierarchy, majority_region
from test_cuts import planted_affinity


def nested_affinity(m: int, a: float, b: float, c: float, e: float) -> torch.Tensor:
    """``(1, 8m, 8m)`` float64 W: 8 blocks of ``m`` tokens, in 4 pairs, in 2 groups of two
    pairs. ``W_ij`` is ``a`` within a block (``i = j`` included), ``b`` between the blocks of
    a pair, ``c`` between the pairs of a group and ``e`` between the groups."""
    block = torch.arange(8 * m) // m
    pair, group = block // 2, block // 4
    w = torch.full((8 * m, 8 * m), e, dtype=torch.float64)
    w[group[:, None] == group[None, :]] = c
    w[pair[:, None] == pair[None, :]] = b
    w[block[:, None] == block[None, :]] = a
    return w.unsqueeze(0)


def closed_form(a: float, b: float, c: float, e: float) -> dict[str, float]:
    """The NCut of each planted split and the escape probability of each planted set.

    Every token has the degree ``d = m (a + b + 2c + 4e)``. Groups: ``W(G, G^c) = 16 m^2 e``,
    ``vol(G) = 4 m d``, so ``esc = 4e / s`` (``s = d / m``) and the root split has
    ``NCut = 8e / s``. A group's chain (``W`` restricted to it) has degrees
    ``m (a + b + 2c)``: its pair split has ``NCut = 2 * 4m^2 c / (2m * m (a + b + 2c))
    = 4c / (a + b + 2c)``; a pair's chain: ``NCut = 2b / (a + b)``. A block's chain is
    uniform: any split ``(k, m - k)`` has ``esc = (m - k) / m`` and ``k / m``, ``NCut = 1``.
    On the whole chain a pair is left with probability ``(2c + 4e) / s`` and a block with
    ``(b + 2c + 4e) / s``.
    """
    s = a + b + 2 * c + 4 * e
    return dict(root=8 * e / s, group=4 * c / (a + b + 2 * c), pair=2 * b / (a + b), block=1.0,
                esc_group=4 * e / s, esc_pair=(2 * c + 4 * e) / s,
                esc_block=(b + 2 * c + 4 * e) / s)


def node_tokens(h: Hierarchy) -> list[set[int]]:
    """The tokens of every node (leaves, then the splits' nodes), from the tables."""
    leaves = h.leaves.tolist()
    sets = [set() for _ in range(2 * h.num_leaves - 1)]
    for i, leaf in enumerate(leaves):
        sets[leaf].add(i)
    for r, (x, y) in enumerate(h.children.tolist()):
        sets[h.num_leaves + r] = sets[x] | sets[y]
    return sets


def ncut64(w: np.ndarray, a: set[int], b: set[int]) -> float:
    """float64 reference: the NCut of ``(a, b)`` on the chain restricted to ``a | b``."""
    ia, ib = sorted(a), sorted(b)
    both = ia + ib
    cut = w[np.ix_(ia, ib)].sum()
    return float(cut / w[np.ix_(ia, both)].sum() + cut / w[np.ix_(ib, both)].sum())


def escape64(w: np.ndarray, a: set[int]) -> float:
    ia = sorted(a)
    rest = sorted(set(range(w.shape[0])) - a)
    return float(w[np.ix_(ia, rest)].sum() / w[ia].sum())


def thresholds(h: Hierarchy) -> list[float]:
    """A threshold in every interval where the partition is constant (and both ends)."""
    hs = h.heights.tolist()
    mids = [(x + y) / 2 for x, y in zip(hs, hs[1:])]
    return ([hs[0] / 2] if hs else []) + mids + [hs[-1] + 1e-9 if hs else 1.0, 2.5] + hs


def is_refinement(fine: torch.Tensor, coarse: torch.Tensor) -> bool:
    """Every region of ``fine`` lies inside one region of ``coarse``."""
    seen: dict[int, int] = {}
    return all(seen.setdefault(f, c) == c for f, c in zip(fine.flatten().tolist(),
                                                           coarse.flatten().tolist()))


def check_tree(h: Hierarchy, w: torch.Tensor) -> None:
    """The invariants of any tree: recorded NCuts and escapes against float64 references,
    heights = the largest NCut on the path, levels nest and count their splits."""
    w64 = w.double().cpu().numpy()
    sets = node_tokens(h)
    num = h.num_leaves
    parent = {}
    for r, (x, y) in enumerate(h.children.tolist()):
        parent[x] = parent[y] = num + r
        assert h.ncut[r] == pytest.approx(ncut64(w64, sets[x], sets[y]), rel=1e-9, abs=1e-12)
        assert min(sets[x]) < min(sets[y])  # the half with the earlier first token first
    # heights: the largest NCut on the path from the root, never below the parent's
    for r in range(num - 1):
        node, path = num + r, []
        while node in parent:
            node = parent[node]
            path.append(float(h.ncut[node - num]))
        assert float(h.height[r]) == max([float(h.ncut[r])] + path)
        for child in h.children[r].tolist():
            if child >= num:
                assert float(h.height[child - num]) >= float(h.height[r])
    assert bool((h.height[:-1] >= h.height[1:]).all())  # bottom-up rows
    for k, s in enumerate(sets):
        assert float(h.escape[k]) == pytest.approx(escape64(w64, s), rel=1e-9, abs=1e-12)
    # the levels: labels_at keeps the splits below t, in reading order, and they nest
    prev = None
    for t in sorted(thresholds(h)):
        lab = h.labels_at(t)
        level = h.level(t)
        assert torch.equal(level.labels, lab)
        k = int(lab.max()) + 1
        assert h.count_at(t) == k == 1 + int((h.height < t).sum())
        firsts = [int((lab == j).nonzero()[0]) for j in range(k)]
        assert firsts == sorted(firsts)  # reading order of the first token
        for j, node in enumerate(level.nodes.tolist()):
            assert set((lab == j).nonzero()[:, 0].tolist()) == sets[node]
            assert float(level.height[j]) < t <= float(level.until[j]) or (
                t <= 0 and node == 2 * num - 2)
        torch.testing.assert_close(h.escape_at(t), cuts.escape_probabilities(
            w.unsqueeze(0), lab.unsqueeze(0)).double()[0], rtol=1e-6, atol=1e-7)
        if prev is not None:
            assert is_refinement(lab, prev)
        prev = lab


# ------------------------------------------------------------------- planted trees


@pytest.mark.parametrize("weights", [(1.0, 0.2, 0.05, 0.005), (1.0, 0.5, 0.1, 0.02)])
def test_planted_blocks_within_blocks_give_the_nesting_and_the_heights(weights):
    m = 4
    w = nested_affinity(m, *weights)
    want = closed_form(*weights)
    assert want["root"] < want["group"] < want["pair"] < want["block"]
    [h] = cuts.cut_tree(w, min_tokens=m + 1)  # the blocks are not cut: 8 leaves
    assert h.num_leaves == 8 and h.depth == 3
    assert torch.equal(h.leaves, torch.arange(8 * m) // m)  # leaves in reading order
    heights = torch.tensor([want["root"], want["group"], want["pair"]], dtype=torch.float64)
    torch.testing.assert_close(h.heights, heights, rtol=1e-12, atol=1e-14)
    # the merge table: the 4 pairs (heights pair), then the 2 groups, then the root
    assert h.children.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13]]
    torch.testing.assert_close(h.height, heights[[2, 2, 2, 2, 1, 1, 0]], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(h.ncut, h.height, rtol=0, atol=0)  # no height was raised
    esc = [want["esc_block"]] * 8 + [want["esc_pair"]] * 4 + [want["esc_group"]] * 2 + [0.0]
    torch.testing.assert_close(h.escape, torch.tensor(esc, dtype=torch.float64),
                               rtol=1e-12, atol=1e-14)
    block = torch.arange(8 * m) // m
    root, group, pair = h.heights.tolist()
    for t, lab, above in [(root, 0 * block, block // 4), (group, block // 4, block // 2),
                          (pair, block // 2, block), (1.0, block, block), (2.0, block, block)]:
        assert torch.equal(h.labels_at(t), lab)  # t = a height: that split is not kept yet
        assert torch.equal(h.labels_at(float(np.nextafter(t, 3.0))), above)  # now it is
    level = h.level((pair + 1) / 2)  # the blocks
    torch.testing.assert_close(level.escape, torch.full((8,), want["esc_block"],
                                                        dtype=torch.float64))
    torch.testing.assert_close(level.height, torch.full((8,), want["pair"], dtype=torch.float64))
    assert torch.isinf(level.until).all()  # leaves
    check_tree(h, w[0])


def test_the_floor_of_two_tokens_cuts_the_uniform_blocks_at_height_one():
    w = nested_affinity(4, 1.0, 0.2, 0.05, 0.005)
    want = closed_form(1.0, 0.2, 0.05, 0.005)
    [h] = cuts.cut_tree(w, min_tokens=2)
    assert h.num_leaves == 32  # every token
    # a block's chain is uniform: every split of it has NCut exactly 1 (float64 rounding)
    inside = h.ncut[h.ncut > want["pair"] + 1e-9]
    assert len(inside) == 8 * 3
    torch.testing.assert_close(inside, torch.ones_like(inside), rtol=0, atol=1e-12)
    assert h.count_at(1.0) == 8 and h.count_at(1.0 + 1e-9) == 32
    single = (h.escape[:32] - (1 - 1 / (4 * (1.0 + 0.2 + 0.1 + 0.02)))).abs()
    assert float(single.max()) < 1e-12  # a token is left with probability 1 - a / d
    check_tree(h, w[0])


def test_a_split_below_its_parent_takes_the_parent_height():
    # three nodes by hand: the root's split (NCut 0.4) makes a half whose own split has
    # NCut 0.1: that split's height is 0.4, so the levels go from 1 to 3 regions at once
    w = planted_affinity(3, 2, 0.2, noise=0.3)[0]
    tokens = [torch.arange(6), torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5]),
              torch.tensor([0, 1]), torch.tensor([2, 3])]
    h = Hierarchy.from_splits(tokens, [-1, 0, 0, 1, 1], [0.4, 0.1, None, None, None], w)
    assert h.num_leaves == 3
    assert h.children.tolist() == [[0, 1], [3, 2]]  # rows bottom-up, the root last
    assert h.height.tolist() == [0.4, 0.4] and h.ncut.tolist() == [0.1, 0.4]
    assert h.heights.tolist() == [0.4]
    assert h.count_at(0.4) == 1 and h.count_at(0.41) == 3
    assert h.labels_at(0.41).tolist() == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("seed", [0, 1])
def test_every_level_is_the_partition_of_recursive_ncut(seed):
    # noisy planted blocks in two batches of different sizes: labels_at(t) is
    # recursive_ncut(t) at every threshold, region numbering included
    w = torch.cat([planted_affinity(4, 5, 0.08, noise=0.4, seed=seed),
                   planted_affinity(5, 4, 0.3, noise=0.4, seed=seed + 10)])
    trees = cuts.cut_tree(w, min_tokens=2)
    for i, h in enumerate(trees):
        check_tree(h, w[i])
    for t in np.linspace(0.02, 2.0, 100).tolist():
        part = cuts.recursive_ncut(w, t)
        for i, h in enumerate(trees):
            assert torch.equal(h.labels_at(t), part.labels[i]), (i, t)
            torch.testing.assert_close(h.escape_at(t).float(), part.escape[i])


def test_the_floor_stops_the_cuts_and_the_kept_level_ignores_it():
    w = torch.cat([planted_affinity(4, 6, 0.05, noise=0.3, seed=4),
                   planted_affinity(3, 8, 0.1, noise=0.3, seed=5)])
    for h in cuts.cut_tree(w, min_tokens=5):
        sets = node_tokens(h)
        assert all(len(s) < 5 for s in sets[: h.num_leaves])  # leaves: under the floor
        assert all(len(s) >= 5 for s in sets[h.num_leaves:])  # splits: at the floor or above
    # a floor above every region: with tau given, the regions recursive_ncut(tau) cuts are
    # cut all the same (the floor binds past tau only), and so are its regions, once (the
    # split recursive_ncut tried and refused), and nothing else
    part = cuts.recursive_ncut(w, 0.3)
    for i, h in enumerate(cuts.cut_tree(w, min_tokens=10**6, tau=0.3)):
        k = int(part.counts[i])
        assert torch.equal(h.labels_at(0.3), part.labels[i])
        assert h.num_leaves == 2 * k and is_refinement(h.leaves, part.labels[i])
        assert int((h.height >= 0.3).sum()) == k and int((h.ncut >= 0.3).sum()) == k
        check_tree(h, w[i])
    assert [h.num_leaves for h in cuts.cut_tree(w, min_tokens=10**6)] == [1, 1]


def test_pixel_levels_are_unions_of_leaves_and_nest():
    w = planted_affinity(4, 4, 0.1, noise=0.5, seed=7)
    [h] = cuts.cut_tree(w, min_tokens=2)
    grid = h.leaves.view(4, 4)
    # the leaves at pixels (4 x 4 tokens, 6 px each), moved around as a refinement would
    pix = grid.repeat_interleave(6, 0).repeat_interleave(6, 1)
    g = torch.Generator().manual_seed(0)
    moved = torch.rand(pix.shape, generator=g) < 0.2
    pix = torch.where(moved, torch.randint(0, h.num_leaves, pix.shape, generator=g), pix)
    token = (torch.arange(24)[:, None] // 6) * 4 + torch.arange(24)[None, :] // 6
    prev = None
    for t in sorted(thresholds(h)):
        lab = h.pixel_labels_at(pix, t)
        of_leaf = h.leaf_labels_at(t)
        for k in range(h.count_at(t)):  # region k: the union of its leaves' pixels
            leaves = (of_leaf == k).nonzero()[:, 0]
            assert torch.equal(lab == k, torch.isin(pix, leaves))
        # where no pixel moved, a pixel has its token's region
        assert torch.equal(lab[~moved], h.labels_at(t)[token][~moved])
        if prev is not None:
            assert is_refinement(lab, prev)
        prev = lab
    batch = torch.stack([pix, pix.flip(0)]).int()  # any leading dims, any integer dtype
    assert torch.equal(h.pixel_labels_at(batch, 0.5)[1], h.pixel_labels_at(pix.flip(0), 0.5))
    with pytest.raises(ValueError, match="leaf ids"):
        h.pixel_labels_at(pix + h.num_leaves, 0.5)
    with pytest.raises(ValueError, match="integer"):
        h.pixel_labels_at(pix.float(), 0.5)


def test_labels_inherit_the_values_of_the_region_they_were_split_from():
    # three leaves: node 3 = (0, 1) split at 0.4, the root (3, 2) at 0.2
    h = Hierarchy(leaves=torch.arange(3), children=torch.tensor([[0, 1], [3, 2]]),
                  height=torch.tensor([0.4, 0.2], dtype=torch.float64),
                  ncut=torch.tensor([0.4, 0.2], dtype=torch.float64),
                  escape=torch.tensor([0.3, 0.35, 0.1, 0.12, 0.0], dtype=torch.float64))
    leaf = torch.arange(12).div(4, rounding_mode="floor").expand(6, 12)  # 4 columns a leaf
    labels = leaf.clone()
    labels[3:, :4] = 3  # leaf 0 in two components, 0 and 3
    labels[0, 4] = 2  # a speck of leaf 1 absorbed by label 2 (leaf 2): outvoted
    nan = float("nan")
    for t, height, escape in [
            (0.5, [0.4, 0.4, 0.2, 0.4, nan], [0.3, 0.35, 0.1, 0.3, nan]),  # the leaves
            (0.3, [0.2, 0.2, 0.2, 0.2, nan], [0.12, 0.12, 0.1, 0.12, nan])]:  # {0, 1}, {2}
        got_h, got_e = h.label_values(labels, leaf, t, num_labels=5)  # id 4: no pixel
        want_h, want_e = (torch.tensor(v, dtype=torch.float64) for v in (height, escape))
        torch.testing.assert_close(got_h, want_h, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(got_e, want_e, rtol=0, atol=0, equal_nan=True)
        lev = h.level(t)  # the values are the level's: the region exists at t
        assert bool((lev.height < t).all() and (t <= lev.until).all())
    assert h.label_values(labels, leaf, 0.5)[0].shape == (4,)  # labels.max() + 1 by default
    # ties go to the smaller region id; ids past num_labels are left out
    assert majority_region(torch.tensor([0, 0, 1, 2]), torch.tensor([5, 2, 1, 1])).tolist() \
        == [2, 1, 1]
    assert majority_region(torch.tensor([0, 3]), torch.tensor([1, 0]), 2).tolist() == [1, -1]
    with pytest.raises(ValueError, match="one shape"):
        majority_region(torch.zeros(3, dtype=torch.long), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="non-negative"):
        majority_region(torch.tensor([-1, 0]), torch.tensor([0, 0]))


def test_bad_tables_and_arguments_are_refused():
    w = planted_affinity(2, 3, 0.1, noise=0.2)
    [h] = cuts.cut_tree(w, min_tokens=2)
    assert cuts.cut_tree(w)[0].num_leaves == 1  # 6 tokens: under the default floor
    kw = dict(leaves=h.leaves, children=h.children, height=h.height, ncut=h.ncut, escape=h.escape)
    Hierarchy(**kw)  # the tables rebuild the same tree
    with pytest.raises(ValueError, match="every id"):
        Hierarchy(**kw | dict(leaves=torch.where(h.leaves == 0, 1, h.leaves)))
    with pytest.raises(ValueError, match="one later split"):
        Hierarchy(**kw | dict(children=h.children.flip(0)))
    low = h.height.clone()
    low[0] = 0.0  # a split below its parent
    with pytest.raises(ValueError, match="must not decrease|at least"):
        Hierarchy(**kw | dict(height=low, ncut=torch.minimum(h.ncut, low)))
    with pytest.raises(ValueError, match=r"shape \(5,\)"):
        Hierarchy(**kw | dict(height=h.height[:-1]))
    with pytest.raises(ValueError, match="float64"):
        Hierarchy(**kw | dict(height=h.height.float()))
    with pytest.raises(ValueError, match="min_tokens"):
        cuts.cut_tree(w, min_tokens=1)
    with pytest.raises(ValueError, match="tau"):
        cuts.cut_tree(w, tau=0.0)
    with pytest.raises(ValueError, match="non-negative"):
        cuts.cut_tree(-w)


# ------------------------------------------------------------------- real attention chains


@pytest.fixture(scope="module")
def real_chains(dinov2_weights):
    """The default method's W on the three bundled photos (DINOv2 ViT-S/14, 224 px)."""
    from PIL import Image

    import segment

    seg = segment.load("dinov2_vits14", "cuts", checkpoint=str(dinov2_weights), device="cpu")
    root = Path(__file__).resolve().parents[1] / "datasets" / "examples"
    x = torch.stack([seg.preprocess(Image.open(root / f"{name}.png").convert("RGB"))
                     for name in ("astronaut", "chelsea", "coffee")])
    with torch.no_grad():
        return seg.method.cut_affinity(seg.extract(x)), seg.method


@pytest.mark.shared
def test_on_real_attention_the_kept_level_is_recursive_ncut_exactly(real_chains):
    from segment import backends

    w, method = real_chains
    eigvec = backends.second_eigenvectors  # the device's default, as the method calls it
    for tau in (0.3, float(method.escape), 0.8):
        part = cuts.recursive_ncut(w, tau, eigvec=eigvec)
        trees = cuts.cut_tree(w, tau=tau, eigvec=eigvec)  # the default floor
        for i, h in enumerate(trees):
            assert torch.equal(h.labels_at(tau), part.labels[i]), (tau, i)
            assert h.count_at(tau) == int(part.counts[i])
            torch.testing.assert_close(h.escape_at(tau).float(), part.escape[i])
            assert h.num_leaves > int(part.counts[i])  # the tree goes on past tau


@pytest.mark.shared
@pytest.mark.slow
def test_on_real_attention_the_tree_is_consistent(real_chains):
    w, _ = real_chains
    trees = cuts.cut_tree(w, min_tokens=8)
    raised = 0
    for i, h in enumerate(trees):
        check_tree(h, w[i])
        sets = node_tokens(h)
        assert all(len(s) >= 8 for s in sets[h.num_leaves:])
        raised += int((h.ncut < h.height).sum())
        # the pixels of the leaves (nearest upsampling of the 16 x 16 grid) nest too
        pix = h.leaves.view(16, 16).repeat_interleave(14, 0).repeat_interleave(14, 1)
        prev = None
        for t in np.linspace(0.02, 2.0, 100).tolist():
            lab = h.pixel_labels_at(pix, t)
            assert torch.equal(lab[::14, ::14].flatten(), h.labels_at(t))
            if prev is not None:
                assert is_refinement(lab, prev)
            prev = lab
    assert raised > 0  # real chains do have splits below their parents' NCut
