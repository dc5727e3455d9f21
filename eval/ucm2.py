"""BSDS500's ``ucm2`` files as hierarchies, read as the official region bench reads them.

A ``ucm2`` (an ultrametric contour map at double size: gPb-owt-ucm and the other methods of
the BSDS500 bench) is a ``(2H + 1) x (2W + 1)`` float map whose odd pixels are the image's
(0) and whose others hold the height at which the boundary there disappears. The bench's
``evaluation_reg_image.m`` takes the regions at ``t`` as ``bwlabel(ucm2 <= t)`` (8-connected)
read at ``[1::2, 1::2]``. :class:`UCM` gives them for any ``t`` (a
:class:`segment.eval.hierarchy.HierarchyLike`); :func:`read_ucm2` reads a result file.
Scoring: :mod:`segment.eval.hierarchy` (``python -m segment.eval.hierarchy ucm2 ROOT``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np



class UCM:
    """A BSDS ``ucm2`` map as a :class:`~segment.eval.hierarchy.HierarchyLike`, thresholded as the official region bench
    does: the regions at ``t`` are the 8-connected components of ``ucm2 <= t`` (MATLAB
    ``bwlabel``) read at the odd pixels ``[1::2, 1::2]`` (coarser as ``t`` grows).

    Two pixels (odd rows and columns of the doubled grid) are in one component exactly when
    a chain of *links* of value ``<= t`` joins them: a boundary pixel between two
    horizontally or vertically adjacent pixels links them, a junction (even row and column)
    links the two to four pixels diagonal to it (every 8-connected step between boundary
    pixels passes a pixel both are next to). So the components at every ``t`` come from the
    minimum spanning tree of the links: :meth:`labels_at` contracts its links up to ``t``
    (one sparse connected-components call over the finest regions, not a labelling of the
    doubled grid); :meth:`labels_at_bwlabel` labels the doubled grid as the bench does
    (tested equal).

    Args:
        ucm2: ``(2H + 1, 2W + 1)`` float map on the doubled grid: the pixels at odd rows and
            columns are the image's pixels (0), the others the boundaries between them,
            holding the height at which the boundary disappears.
        name: for messages.

    Attributes:
        heights: every distinct value of ``ucm2`` (0 included), ascending.
    """

    def __init__(self, ucm2: np.ndarray, name: str = "ucm2") -> None:
        u = np.asarray(ucm2, dtype=np.float64)
        if u.ndim != 2 or u.shape[0] % 2 == 0 or u.shape[1] % 2 == 0 or min(u.shape) < 3:
            raise ValueError(f"{name}: a ucm2 must be a (2H+1) x (2W+1) map on the doubled grid, got shape {u.shape}")
        if not np.isfinite(u).all():
            raise ValueError(f"{name}: the ucm2 holds values that are not finite")
        if (u[1::2, 1::2] != 0).any():
            raise ValueError(f"{name}: the ucm2's pixels (odd rows and columns) must be 0, boundaries between"
                             " them hold the heights; this is not the bench's doubleSize format")
        self.ucm2 = u
        self.name = name
        self.heights = np.unique(u)
        self._tree()

    @property
    def shape(self) -> tuple[int, int]:
        """The image's ``(H, W)``."""
        return (self.ucm2.shape[0] - 1) // 2, (self.ucm2.shape[1] - 1) // 2

    def _links(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(a, b, value)``: every link between two pixels (flat ids ``i * W + j``)."""
        u = self.ucm2
        h, w = self.shape
        idx = np.arange(h * w).reshape(h, w)
        a, b, v = [], [], []

        def add(x: np.ndarray, y: np.ndarray, val: np.ndarray) -> None:
            a.append(x.ravel()), b.append(y.ravel()), v.append(val.ravel())

        add(idx[:, :-1], idx[:, 1:], u[1::2, 2:-1:2])  # boundary between left and right
        add(idx[:-1, :], idx[1:, :], u[2:-1:2, 1::2])  # boundary between up and down
        junction = u[2:-1:2, 2:-1:2]  # joins its four diagonal pixels
        for y in (idx[:-1, 1:], idx[1:, :-1], idx[1:, 1:]):
            add(idx[:-1, :-1], y, junction)
        add(idx[0, :-1], idx[0, 1:], u[0, 2:-1:2])  # junctions on the border join two pixels
        add(idx[-1, :-1], idx[-1, 1:], u[-1, 2:-1:2])
        add(idx[:-1, 0], idx[1:, 0], u[2:-1:2, 0])
        add(idx[:-1, -1], idx[1:, -1], u[2:-1:2, -1])
        return np.concatenate(a), np.concatenate(b), np.concatenate(v)

    def _tree(self) -> None:
        """The minimum spanning tree of the links, contracted at the smallest height: the
        finest regions (:attr:`_fine`) and the tree's other links between them, by value."""
        from scipy.sparse import coo_matrix
        from scipy.sparse.csgraph import connected_components, minimum_spanning_tree

        h, w = self.shape
        n = h * w
        a, b, v = self._links()
        rank = np.searchsorted(self.heights, v) + 1.0  # exact order, no zero weight (absent in sparse)
        key = a * n + b  # a pair linked twice (a boundary and a junction) keeps its lower link:
        order = np.lexsort((rank, key))  # a sparse matrix would add the two
        first = np.ones(order.size, dtype=bool)
        first[1:] = key[order][1:] != key[order][:-1]
        a, b, rank = a[order[first]], b[order[first]], rank[order[first]]
        mst = minimum_spanning_tree(coo_matrix((rank, (a, b)), shape=(n, n)).tocsr()).tocoo()
        value = self.heights[mst.data.astype(np.int64) - 1]
        low = value <= self.heights[0]
        _, fine = connected_components(coo_matrix((np.ones(int(low.sum())), (mst.row[low], mst.col[low])),
                                                  shape=(n, n)), directed=False)
        order = np.argsort(value[~low], kind="stable")
        self._fine = fine.astype(np.int64)  # (H * W,) finest region of every pixel
        self._nfine = int(fine.max()) + 1
        self._a = fine[mst.row[~low]][order]
        self._b = fine[mst.col[~low]][order]
        self._value = value[~low][order]  # ascending

    def labels_at(self, t: float) -> np.ndarray:
        """``(H, W)`` int64 ids of the 8-connected components of ``ucm2 <= t`` (all 0 below
        the smallest height, where no pixel is ``<= t``, as ``bwlabel`` labels them)."""
        from scipy.sparse import coo_matrix
        from scipy.sparse.csgraph import connected_components

        t = float(t)
        if t < self.heights[0]:
            return np.zeros(self.shape, dtype=np.int64)
        k = int(np.searchsorted(self._value, t, side="right"))
        g = coo_matrix((np.ones(k), (self._a[:k], self._b[:k])), shape=(self._nfine, self._nfine))
        _, comp = connected_components(g, directed=False)
        return comp[self._fine].reshape(self.shape)

    def labels_at_bwlabel(self, t: float) -> np.ndarray:
        """``(H, W)`` int32 ids (from 1) of ``bwlabel(ucm2 <= t, 8)`` on the doubled grid read at
        ``[1::2, 1::2]``: the bench's own reading (slower; :meth:`labels_at` equals it)."""
        from scipy import ndimage

        lab, _ = ndimage.label(self.ucm2 <= float(t), structure=np.ones((3, 3), dtype=bool))
        return lab[1::2, 1::2]


def read_ucm2(path: str | Path) -> UCM:
    """The ``ucm2`` of a BSDS result file (``scipy.io.loadmat``; MATLAB v7.3 files through
    h5py, transposed back to rows x columns).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a file without a ``ucm2`` variable, or one that is not a doubled-grid map.
    """
    import scipy.io

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such ucm2 file")
    try:
        mat = scipy.io.loadmat(str(path))
        u = mat.get("ucm2")
        keys = [k for k in mat if not k.startswith("__")]
    except NotImplementedError:  # MATLAB v7.3 (HDF5)
        import h5py

        with h5py.File(path, "r") as f:
            keys = list(f.keys())
            u = np.asarray(f["ucm2"]).T if "ucm2" in f else None
    if u is None:
        raise ValueError(f"{path}: expected a variable ucm2 (a BSDS ultrametric contour map); it holds"
                         f" {', '.join(keys) or 'no variable'}")
    return UCM(np.asarray(u), name=str(path))
