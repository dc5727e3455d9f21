"""The tree of the escape cuts: every level of the recursive normalized cuts of one image.

:func:`segment.core.cuts.cut_tree` cuts each region of an image's chain along its best split
past any threshold, down to a floor of ``min_tokens``, and records each split with its
normalized cut ``NCut = esc(A) + esc(B)`` (the probability, summed over the two halves, that
the stationary walk started in one half crosses into the other in one step). A split's
*height* is the largest NCut on its path from the root, so heights never decrease from a
split to the splits below it. The partition at a threshold ``t`` keeps exactly the splits of
height below ``t``: a rooted subtree, so

- ``labels_at(t)`` is the partition ``recursive_ncut(W, t)`` finds (it keeps a split when it
  and every split above it have NCut below ``t``) wherever the floor does not bind;
- the levels nest: for ``s < t`` every region at ``s`` is a union of regions at ``t``;
- ``t`` runs from coarse to fine: ``t <= heights[0]`` gives one region, ``t > heights[-1]``
  the leaves.

**Nodes and the merge table.** The ``L`` leaves (regions no split cuts) are the nodes
``0 .. L-1``, numbered in the reading order of their first token (the token grid's raster
order). The ``L - 1`` splits are the internal nodes ``L .. 2L-2``: row ``r`` of ``children``
holds the two nodes that node ``L + r`` splits into (the one holding the earlier first token
first) and ``height[r]`` its height. Rows run bottom-up, as a linkage table's merges do when
``t`` falls from fine to coarse: heights never increase down the rows, every node appears
before the node it belongs to, and the last row is the root (node ``2L - 2``; with no split
the root is leaf 0).

**Numbering of a level.** The regions at ``t`` are numbered ``0 .. K-1`` in the reading
order of their first token, as :func:`segment.core.cuts.recursive_ncut` numbers them; a
region is a node, so its escape probability and the heights it lives between are the
node's. At the pixel level (:meth:`Hierarchy.pixel_labels_at`) the regions keep these ids.

Pure functions over tensors (torch and numpy only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Hierarchy", "Level", "descend", "majority_region"]


@dataclass(frozen=True, eq=False)
class Level:
    """The partition of one image at one threshold of its :class:`Hierarchy`.

    Attributes:
        labels: ``(n,)`` int64 region id of each token, ``0 .. K-1`` in the reading order of
            the regions' first tokens.
        nodes: ``(K,)`` int64 the tree node of each region.
        escape: ``(K,)`` float64 each region's escape probability on the whole chain
            (``W(A, A^c) / vol(A)``: the probability that the stationary walk leaves it in
            one step).
        height: ``(K,)`` float64 the height of the split that made each region (``0`` for the
            root): the region exists for the thresholds ``t`` with ``height < t <= until``.
        until: ``(K,)`` float64 the height of the region's own split (``inf`` for a leaf).
    """

    labels: Tensor
    nodes: Tensor
    escape: Tensor
    height: Tensor
    until: Tensor


@dataclass(frozen=True, eq=False)
class Hierarchy:
    """The escape cuts of one image at every threshold (the module docstring gives the
    layout); built by :func:`segment.core.cuts.cut_tree` or rebuilt from its tables.

    Attributes:
        leaves: ``(n,)`` int64 the leaf of each token, ``0 .. L-1`` in the reading order of
            the leaves' first tokens (the finest level).
        children: ``(L-1, 2)`` int64 the two nodes each split ``L + r`` makes.
        height: ``(L-1,)`` float64 each split's height (the largest NCut on its path from the
            root), in ``[0, 2]``, non-increasing down the rows.
        ncut: ``(L-1,)`` float64 each split's own NCut (``<= height``).
        escape: ``(2L-1,)`` float64 the escape probability of every node (leaves, then splits)
            on the image's whole chain, in ``[0, 1]``.
    """

    leaves: Tensor
    children: Tensor
    height: Tensor
    ncut: Tensor
    escape: Tensor
    # per leaf, its nodes from the root down (padded with the leaf) and their split heights
    # (inf at the leaf); per node, its first leaf, the height it appears at and its own
    _path: Tensor = field(init=False, repr=False, compare=False)
    _path_height: Tensor = field(init=False, repr=False, compare=False)
    _first: Tensor = field(init=False, repr=False, compare=False)
    _born: Tensor = field(init=False, repr=False, compare=False)
    _until: Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        leaves, children, height = self.leaves, self.children, self.height
        if leaves.dim() != 1 or leaves.numel() == 0 or leaves.dtype != torch.long:
            raise ValueError(f"leaves must be a non-empty (n,) int64 tensor, got "
                             f"{tuple(leaves.shape)} {leaves.dtype}")
        num = int(leaves.max()) + 1
        if int(leaves.min()) < 0 or torch.bincount(leaves.cpu(), minlength=num).min() == 0:
            raise ValueError(f"leaves must use every id 0 .. {num - 1} (got ids "
                             f"{sorted(set(leaves.tolist()))[:8]}...)")
        for name, t, shape in (("children", children, (num - 1, 2)),
                               ("height", height, (num - 1,)), ("ncut", self.ncut, (num - 1,)),
                               ("escape", self.escape, (2 * num - 1,))):
            if tuple(t.shape) != shape or t.device.type != "cpu":
                raise ValueError(f"{name} must be a CPU tensor of shape {shape} for {num} "
                                 f"leaves, got {tuple(t.shape)} on {t.device}")
        if children.dtype != torch.long or any(
                t.dtype != torch.float64 for t in (height, self.ncut, self.escape)):
            raise ValueError("children must be int64 and height, ncut, escape float64")
        if not bool(((height >= 0) & (height <= 2)).all()) or bool((self.ncut > height).any()):
            raise ValueError("heights must lie in [0, 2] and be at least each split's ncut")
        if not bool(((self.escape >= 0) & (self.escape <= 1)).all()):
            raise ValueError("escape probabilities must lie in [0, 1]")
        nodes = 2 * num - 1
        parent = [-1] * nodes
        first = list(range(nodes))
        for r, (x, y) in enumerate(children.tolist()):
            if not (0 <= x < num + r and 0 <= y < num + r) or x == y \
                    or parent[x] >= 0 or parent[y] >= 0:
                raise ValueError(f"children row {r} ({x}, {y}): each node must belong to one "
                                 f"later split (node {num + r})")
            parent[x] = parent[y] = num + r
            first[num + r] = min(first[x], first[y])
        own = [float("inf")] * num + height.tolist()
        born = [own[p] if p >= 0 else 0.0 for p in parent]
        if any(x > y for x, y in zip(born, own)):
            raise ValueError("heights must not decrease from a split to the splits below it")
        # the path of each leaf from the root (a leaf's ancestors, bottom-up, reversed)
        up = [[leaf] for leaf in range(num)]
        for path in up:
            while parent[path[-1]] >= 0:
                path.append(parent[path[-1]])
        depth = max(len(p) for p in up)
        path = torch.tensor([p[::-1] + [p[0]] * (depth - len(p)) for p in up], dtype=torch.long)
        own_t = torch.tensor(own, dtype=torch.float64)
        for name, value in (("_path", path), ("_path_height", own_t[path]),
                            ("_first", torch.tensor(first)),
                            ("_born", torch.tensor(born, dtype=torch.float64)),
                            ("_until", own_t)):
            object.__setattr__(self, name, value)

    @classmethod
    def from_splits(cls, tokens: Sequence[Tensor], parent: Sequence[int],
                    ncut: Sequence[float | None], affinity: Tensor) -> Hierarchy:
        """The hierarchy of one image from its splits in the order they were made.

        Args:
            tokens: per node, its token indices; node 0 is every token, and a node's two
                halves come after it.
            parent: per node, the node it is a half of (``-1`` for node 0).
            ncut: per node, the NCut of its split (``None`` for a node not cut: a leaf).
            affinity: ``(n, n)`` the image's symmetric ``W`` (for the escape probabilities:
                the ``(L, L)`` flows between the leaves are summed in float64 on its device,
                every node's escape follows from them on the CPU).
        """
        count = len(tokens)
        if not (len(parent) == len(ncut) == count) or parent[0] != -1:
            raise ValueError("tokens, parent and ncut must describe the same nodes, node 0 "
                             "the root")
        n = affinity.shape[-1]
        own = [float("inf") if c is None else float(c) for c in ncut]
        high, depth = [own[0]], [0]
        for k in range(1, count):
            if not 0 <= parent[k] < k or ncut[parent[k]] is None:
                raise ValueError(f"node {k}: its parent {parent[k]} must be an earlier split")
            high.append(max(own[k], high[parent[k]]))
            depth.append(depth[parent[k]] + 1)
        # every node's tokens in one flat CPU tensor: its first token, the leaves' labels
        flat = torch.cat([t.reshape(-1) for t in tokens]).cpu().long()
        owner = torch.repeat_interleave(torch.arange(count),
                                        torch.tensor([t.numel() for t in tokens]))
        start = torch.full((count,), n, dtype=torch.long).scatter_reduce(
            0, owner, flat, "amin").tolist()
        leaf = sorted((k for k in range(count) if ncut[k] is None), key=lambda k: start[k])
        split = sorted((k for k in range(count) if ncut[k] is not None),
                       key=lambda k: (-high[k], -depth[k], start[k]))
        num = len(leaf)
        ids = {k: i for i, k in enumerate(leaf)} | {k: num + r for r, k in enumerate(split)}
        halves: dict[int, list[int]] = {}
        for k in range(1, count):
            halves.setdefault(parent[k], []).append(k)
        if any(len(halves.get(k, ())) != 2 for k in split):
            raise ValueError("every split must have exactly two halves")
        children = torch.tensor(
            [[ids[h] for h in sorted(halves[k], key=lambda h: start[h])] for k in split],
            dtype=torch.long).reshape(-1, 2)
        leaf_id = torch.full((count,), -1, dtype=torch.long)
        leaf_id[torch.tensor(leaf, dtype=torch.long)] = torch.arange(num)
        of = leaf_id[owner]
        mine = of >= 0
        once = torch.ones(n, dtype=torch.long)
        if not torch.equal(torch.bincount(flat[mine], minlength=n), once):
            raise ValueError("the leaves must partition the tokens")
        labels = torch.empty(n, dtype=torch.long)
        labels[flat[mine]] = of[mine]
        # every node's flow W(A, B) from the leaves' flows: escape = W(A, A^c) / vol(A). The
        # leaf-by-leaf block sums in float64 on W's device; only the (L, L) result moves
        one = F.one_hot(labels.to(affinity.device), num).to(torch.float64)  # (n, L)
        w = affinity.detach().to(torch.float64)
        flow = (one.T @ w @ one).cpu().numpy()  # (L, L)
        member = np.zeros((2 * num - 1, num))
        member[:num] = np.eye(num)
        for r, (a, b) in enumerate(children.tolist()):
            member[num + r] = member[a] + member[b]
        vol = member @ flow.sum(1)
        stay = ((member @ flow) * member).sum(1)
        escape = torch.from_numpy(((vol - stay) / vol).clip(0.0, 1.0))
        return cls(leaves=labels.to(affinity.device), children=children,
                   height=torch.tensor([high[k] for k in split], dtype=torch.float64),
                   ncut=torch.tensor([own[k] for k in split], dtype=torch.float64),
                   escape=escape)

    @property
    def num_leaves(self) -> int:
        """``L``, the number of regions of the finest level."""
        return self.children.shape[0] + 1

    @property
    def depth(self) -> int:
        """The most splits on a path from the root to a leaf."""
        return self._path.shape[1] - 1

    @property
    def heights(self) -> Tensor:
        """``(S,)`` float64 the distinct split heights, ascending: the thresholds where the
        partition changes (``labels_at`` is constant on ``(heights[j], heights[j+1]]``)."""
        return torch.unique(self.height)

    def _regions(self, t: float) -> tuple[Tensor, Tensor]:
        """``(nodes (K,), label of each leaf (L,))`` at threshold ``t``."""
        # the region of a leaf is the first node on its path whose split is not kept
        at = (self._path_height >= float(t)).to(torch.uint8).argmax(1)
        node = self._path.gather(1, at[:, None])[:, 0]  # (L,)
        first, label = torch.unique(self._first[node], return_inverse=True)
        nodes = torch.empty(len(first), dtype=torch.long)
        nodes[label] = node
        return nodes, label

    def leaf_labels_at(self, t: float) -> Tensor:
        """``(L,)`` int64 the region of each leaf at threshold ``t`` (CPU)."""
        return self._regions(t)[1]

    def labels_at(self, t: float) -> Tensor:
        """``(n,)`` int64 the token partition keeping the splits of height below ``t``
        (regions ``0 .. K-1`` in the reading order of their first token; on ``leaves``'
        device)."""
        return self.leaf_labels_at(t).to(self.leaves.device)[self.leaves]

    def count_at(self, t: float) -> int:
        """``K``, the number of regions at threshold ``t``."""
        return int(self._regions(t)[0].numel())

    def escape_at(self, t: float) -> Tensor:
        """``(K,)`` float64 each region's escape probability on the whole chain at ``t``
        (:func:`segment.core.cuts.escape_probabilities` of ``labels_at(t)``, in float64)."""
        return self.escape[self._regions(t)[0]]

    def level(self, t: float) -> Level:
        """Everything about the partition at threshold ``t`` (:class:`Level`)."""
        nodes, label = self._regions(t)
        return Level(labels=label.to(self.leaves.device)[self.leaves], nodes=nodes,
                     escape=self.escape[nodes], height=self._born[nodes],
                     until=self._until[nodes])

    def pixel_labels_at(self, leaf_pixels: Tensor, t: float) -> Tensor:
        """The pixel partition at threshold ``t``: each region is the union of its leaves'
        pixels, so the pixel levels nest as the token levels do.

        Args:
            leaf_pixels: ``(..., H, W)`` integer the leaf of each pixel (the finest level at
                the pixels: e.g. the leaves refined by the pixel chain, or the connected
                components of that refinement mapped to the leaf each came from).
            t: the threshold.

        Returns:
            ``(..., H, W)`` int64 on ``leaf_pixels``' device: the region ids of
            :meth:`labels_at` ``(t)`` (a region none of whose leaves kept a pixel leaves its
            id unused).
        """
        if leaf_pixels.is_floating_point() or leaf_pixels.is_complex() or leaf_pixels.numel() == 0:
            raise ValueError(f"leaf_pixels must be a non-empty integer tensor, got "
                             f"{leaf_pixels.dtype}")
        if int(leaf_pixels.min()) < 0 or int(leaf_pixels.max()) >= self.num_leaves:
            raise ValueError(f"leaf_pixels must hold leaf ids in [0, {self.num_leaves}), got "
                             f"[{int(leaf_pixels.min())}, {int(leaf_pixels.max())}]")
        return self.leaf_labels_at(t).to(leaf_pixels.device)[leaf_pixels.long()]

    def label_values(self, labels: Tensor, leaf_pixels: Tensor, t: float,
                     num_labels: int | None = None) -> tuple[Tensor, Tensor]:
        """The height and escape each label inherits from its region at threshold ``t``.

        A label map drawn from the level at ``t`` (e.g. its regions split into connected
        components, specks absorbed by their neighbours) has each label inside one region
        of the level, up to the specks: label ``k`` takes the values of the region holding
        most of its pixels (:func:`majority_region`).

        Args:
            labels: ``(..., H, W)`` integer label ids.
            leaf_pixels: every pixel's leaf, of the same shape (:meth:`pixel_labels_at`).
            t: the threshold of the level.
            num_labels: the length of the answer (``labels.max() + 1`` when ``None``).

        Returns:
            ``(height, escape)``, each ``(num_labels,)`` float64 (CPU): the region's
            :class:`Level` ``height`` (it exists for ``height < t' <= until``) and ``escape``
            (the probability that the stationary walk leaves it in one step); NaN for an id
            with no pixel.
        """
        lev = self.level(t)
        source = majority_region(labels, self.pixel_labels_at(leaf_pixels, t), num_labels)
        at = source.clamp_min(0)
        nan = torch.tensor(float("nan"), dtype=torch.float64)
        return (torch.where(source >= 0, lev.height[at], nan),
                torch.where(source >= 0, lev.escape[at], nan))

    def ancestors(self, leaf: int) -> tuple[Tensor, Tensor, Tensor]:
        """The nodes from the root down to ``leaf`` (every region containing the leaf at some
        threshold, coarse to fine) with the heights each lives between.

        Returns:
            ``(nodes (D,) int64, height (D,) float64, until (D,) float64)`` (CPU): node
            ``nodes[j]`` is a region at the thresholds ``height[j] < t <= until[j]``
            (``height`` 0 for the root, ``until`` inf for the leaf).
        """
        if not 0 <= int(leaf) < self.num_leaves:
            raise ValueError(f"leaf must lie in [0, {self.num_leaves}), got {leaf}")
        path = self._path[int(leaf)]
        nodes = path[: int((path != int(leaf)).sum()) + 1]
        return nodes, self._born[nodes], self._until[nodes]

    def members(self) -> Tensor:
        """``(2L-1, L)`` bool: the leaves under every node (leaves, then splits; CPU)."""
        num = self.num_leaves
        member = torch.zeros(2 * num - 1, num, dtype=torch.bool)
        member[:num] = torch.eye(num, dtype=torch.bool)
        for r, (a, b) in enumerate(self.children.tolist()):
            member[num + r] = member[a] | member[b]
        return member

    def splits_below(self, t: float) -> Tensor:
        """``(S,)`` int64 the rows of ``children`` whose split is not kept at ``t`` (height
        ``>= t``): the splits below the level ``labels_at(t)``, ``S = L - K``, in row order."""
        return torch.nonzero(self.height >= float(t))[:, 0]


def descend(tree: Hierarchy, t: float, region: Tensor, mass: Tensor, first_mass: Tensor
            ) -> Tensor:
    """Every pixel's leaf, from its region at threshold ``t`` down the tree by the larger mass.

    A pixel of region ``k`` of ``tree.level(t)`` starts at that region's node with the
    region's mass there; at each split below (:meth:`Hierarchy.splits_below`) it goes to the
    child of larger mass (ties: the first child), the second child's mass being the node's
    minus the first's, until it reaches a leaf. With linear maps (e.g. refined one-hot maps
    of the token regions: each node's map is the sum of its leaves' maps) a pixel thus ends at
    a leaf under its own region, every level stays a union of the finest one's pixels, and
    the region at ``t`` is never changed.

    Args:
        tree: the image's hierarchy.
        t: the threshold of the level the pixels start from.
        region: ``(P,)`` int64 each pixel's region at ``t`` (ids of ``tree.level(t)``).
        mass: ``(P,)`` each pixel's mass of its own region.
        first_mass: ``(S, P)`` the mass of the first child of every split below the level,
            in the order of :meth:`Hierarchy.splits_below` ``(t)``.

    Returns:
        ``(P,)`` int64 each pixel's leaf (``0 .. L-1``), on ``region``'s device.
    """
    num = tree.num_leaves
    rows = tree.splits_below(t)
    if first_mass.dim() != 2 or first_mass.shape != (len(rows), region.numel()) \
            or mass.shape != region.shape:
        raise ValueError(f"first_mass must be ({len(rows)}, {region.numel()}) and mass "
                         f"({region.numel()},), got {tuple(first_mass.shape)} and "
                         f"{tuple(mass.shape)}")
    dev = region.device
    nodes = tree.level(t).nodes
    if region.numel() and (int(region.min()) < 0 or int(region.max()) >= len(nodes)):
        raise ValueError(f"region must hold the {len(nodes)} region ids of the level at {t}")
    node = nodes.to(dev)[region]  # (P,): final for the pixels of a region that is a leaf
    if not len(rows) or not region.numel():
        return node
    # each split's pixels as an index set, handed down to its two children: every pixel
    # takes part only in the splits on its own path (no pass over all pixels per depth)
    chan = {num + r: c for c, r in enumerate(rows.tolist())}
    children = tree.children.tolist()
    order = torch.argsort(region, stable=True)
    sets = torch.split(order, torch.bincount(region, minlength=len(nodes)).tolist())
    todo = [(x, pix, mass.index_select(0, pix)) for x, pix in zip(nodes.tolist(), sets)
            if x >= num and pix.numel()]
    while todo:
        x, pix, m = todo.pop()
        m0 = first_mass[chan[x]].index_select(0, pix)
        m1 = m - m0
        first = m0 >= m1
        for child, keep, cm in ((children[x - num][0], first, m0),
                                (children[x - num][1], ~first, m1)):
            sub = pix[keep]
            if not sub.numel():
                continue
            if child >= num:
                todo.append((child, sub, cm[keep]))
            else:
                node.index_fill_(0, sub, child)
    return node


def majority_region(labels: Tensor, region: Tensor, num_labels: int | None = None) -> Tensor:
    """Per label id, the region that holds most of its pixels: how a connected component (or
    any label map drawn from a partition) inherits the values of the region it came from.

    Args:
        labels: ``(...)`` non-negative integer label ids (e.g. the connected components of
            the default level, ``MethodOutput.labels``).
        region: integer region ids of the same shape (e.g. ``Hierarchy.pixel_labels_at``).
        num_labels: the length of the answer (``labels.max() + 1`` when ``None``).

    Returns:
        ``(num_labels,)`` int64 (CPU): the region most of label ``k``'s pixels lie in (ties:
        the smaller region id), ``-1`` for an id with no pixel.
    """
    if labels.shape != region.shape or labels.numel() == 0:
        raise ValueError(f"labels and region must be non-empty and of one shape, got "
                         f"{tuple(labels.shape)} and {tuple(region.shape)}")
    lab = labels.reshape(-1).long().cpu()
    reg = region.reshape(-1).long().cpu()
    if int(lab.min()) < 0 or int(reg.min()) < 0:
        raise ValueError("labels and region must hold non-negative ids")
    k = int(lab.max()) + 1 if num_labels is None else int(num_labels)
    keep = lab < k
    lab, reg = lab[keep], reg[keep]
    r = int(reg.max()) + 1 if reg.numel() else 1
    votes = torch.bincount(lab * r + reg, minlength=k * r).reshape(k, r)
    best = votes.argmax(1)  # the first maximum: ties to the smaller region id
    return torch.where(votes.sum(1) > 0, best, torch.full_like(best, -1))
