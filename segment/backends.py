"""Library back-ends of the math core: connected components, the cuts' eigenvector, k-means,
the CPU thread pool.

``segment/core`` is torch, numpy and the standard library only (``tests/test_layout.py``
checks it). The steps that run faster through another library live here, each chosen
explicitly (by the tensor's device unless the caller names a back-end) and tested for
equality against the other (``tests/test_regions.py``, ``tests/test_clusters.py``):

- **connected components** (:func:`components`, :func:`connected_regions`,
  :func:`component_regions`, :func:`argmax_regions`): ``"skimage"`` (scikit-image's ``label``, image by image in numpy,
  specks absorbed by hole growth; the CPU default) or ``"kornia"`` (kornia's exact
  union-find, batched in torch, specks absorbed by max-pool growth:
  :func:`segment.core.regions.absorb_small`; the CUDA default). Both number the components
  alike: by label value, then first pixel in raster order.
- **the second eigenvector of a cut** (:func:`second_eigenvectors`, for
  :func:`segment.core.cuts.recursive_ncut`): ``"scipy"`` (LAPACK's ``ssyevr`` asked for
  that one eigenvector, matrix by matrix, with the BLAS thread pool held to one thread
  during the call: idle OpenBLAS threads otherwise spin and starve torch's kernels after
  it; the CPU's dense solver), ``"torch"`` (one batched ``torch.linalg.eigh`` of the whole
  spectrum on the device; the default elsewhere) or ``"krylov"`` (a batched thick-restarted
  Lanczos iteration in torch, :func:`segment.core.lanczos.second_eigenvectors`, stopping on
  a residual tolerance; matrices of at most :data:`KRYLOV_DENSE_UP_TO` tokens go to the
  device's dense solver; the CPU default). ``python -m segment.eval.bench regions --eigen
  torch scipy krylov`` measures them in the same run.
- **k-means** (:func:`kmeans_labels`): scikit-learn's ``KMeans``, on the CPU in float64.
- **the thread pool** (:func:`map_images`): the images of a batch side by side on torch's
  intra-op thread count (one pool per process and thread count: none crosses a fork).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from segment.core import cuts, lanczos
from segment.core.regions import absorb_small, number_components, relabel
from segment.core.stages import Components
from segment.utils import set_thread_torch_threads

__all__ = [
    "ComponentsBackend",
    "EigenBackend",
    "argmax_regions",
    "component_regions",
    "components",
    "components_backend",
    "connected_regions",
    "eigen_backend",
    "kmeans_labels",
    "map_images",
    "memory_budget",
    "second_eigenvectors",
]

ComponentsBackend = Literal["skimage", "kornia"]
_BACKENDS = ("skimage", "kornia")


EigenBackend = Literal["scipy", "torch", "krylov"]
EIGEN_BACKENDS = ("krylov", "torch", "scipy")
_EIGEN = EIGEN_BACKENDS
# "krylov": matrices of at most this many rows go to the device's dense solver, which is
# faster there (eval/bench/regions.py --eigen scipy krylov; docs/benchmarks.md)
KRYLOV_DENSE_UP_TO = 128


@functools.cache
def _blas_threads():
    """threadpoolctl's controller of the loaded BLAS libraries (made once, after SciPy's
    BLAS is loaded, so that it sees it)."""
    import scipy.linalg  # noqa: F401
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def eigen_backend(device: torch.device | str) -> EigenBackend:
    """The eigensolver of a device: ``"krylov"`` on the CPU (the region stage 0.79-0.85 of
    SciPy's at 224-448 px in the same rounds, and ``O(n^2)`` per cut instead of ``O(n^3)``:
    ``python -m segment.eval.bench regions``), torch's dense ``eigh`` elsewhere (the Krylov
    solver on CUDA is checked by ``python -m segment.eval.bench gpu`` but not yet timed)."""
    return "krylov" if torch.device(device).type == "cpu" else "torch"


def second_eigenvectors(sym: Tensor, backend: EigenBackend | None = None,
                        size: Tensor | None = None) -> Tensor:
    """The eigenvector of the second largest eigenvalue of each symmetric matrix.

    Args:
        sym: ``(R, m, m)`` symmetric float32 or float64, ``m >= 2``.
        backend: ``"scipy"`` (only that eigenvector, by LAPACK's MRRR ``syevr``, one matrix
            after another on one BLAS thread), ``"torch"`` (the whole spectrum, batched) or
            ``"krylov"`` (batched Lanczos to the residual tolerance
            :data:`segment.core.lanczos.TOL`, for matrices of more than
            :data:`KRYLOV_DENSE_UP_TO` rows; smaller ones by the device's dense solver);
            ``None`` = :func:`eigen_backend` of ``sym.device``. The dense ones agree up to
            the sign and rounding, the Krylov one up to its tolerance
            (``tests/test_cuts.py``).
        size: ``(R,)`` the real rows of each matrix, the rest padding that is decoupled
            from them with a lower eigenvalue (:func:`segment.core.cuts.best_cuts`); SciPy
            and the Krylov solver then work on the real rows only, so a matrix gets the
            same vector whatever batch it shares (the vector is zero on the padding);
            ``None``: every row is real.

    Returns:
        ``(R, m)`` unit vectors (sign arbitrary) on ``sym.device``, ``sym``'s dtype.
    """
    backend = eigen_backend(sym.device) if backend is None else backend
    if backend not in _EIGEN:
        raise ValueError(f"unknown eigensolver backend {backend!r}; one of {_EIGEN}")
    if sym.dim() != 3 or sym.shape[-1] != sym.shape[-2] or sym.shape[-1] < 2:
        raise ValueError(f"sym must be (R, m, m) with m >= 2, got {tuple(sym.shape)}")
    if backend == "krylov":
        if sym.shape[-1] > KRYLOV_DENSE_UP_TO:
            return lanczos.second_eigenvectors(sym, size=size)
        backend = "scipy" if sym.device.type == "cpu" else "torch"
    if backend == "torch":
        return cuts.second_eigenvectors(sym)
    import scipy.linalg

    r, m, _ = sym.shape
    mats = sym.detach().cpu().numpy()
    sizes = [m] * r if size is None else [int(k) for k in size.tolist()]
    vecs = np.zeros((r, m), dtype=mats.dtype)
    with _blas_threads().limit(limits=1, user_api="blas"):
        for i, k in enumerate(sizes):
            vecs[i, :k] = scipy.linalg.eigh(mats[i, :k, :k], subset_by_index=[k - 2, k - 2],
                                            driver="evr", check_finite=False)[1][:, 0]
    return torch.from_numpy(vecs).to(device=sym.device, dtype=sym.dtype)


def memory_budget(device: torch.device | str) -> int:
    """Bytes a stage may still allocate on ``device``: CUDA's free memory
    (``torch.cuda.mem_get_info``), or on the CPU the kernel's ``MemAvailable``
    (``/proc/meminfo``; where there is none, the free physical pages)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))


def components_backend(device: torch.device | str) -> ComponentsBackend:
    """The connected-components back-end of a device: kornia on CUDA, scikit-image elsewhere."""
    return "kornia" if torch.device(device).type == "cuda" else "skimage"


def _backend(labels: Tensor, backend: ComponentsBackend | None) -> ComponentsBackend:
    if backend is None:
        return components_backend(labels.device)
    if backend not in _BACKENDS:
        raise ValueError(f"unknown connected-components backend {backend!r}; one of {_BACKENDS}")
    return backend


def components(labels: Tensor, backend: ComponentsBackend | None = None) -> Tensor:
    """8-connected components of equal labels, numbered ``0 .. n_b - 1`` per image by (label
    value, raster position of the first pixel): :func:`connected_regions` without absorption.

    Args:
        labels: ``(B, H, W)`` integer labels.
        backend: ``"skimage"`` or ``"kornia"``; ``None`` = :func:`components_backend` of
            ``labels.device``. Both give the same ids on any device.

    Returns:
        ``(B, H, W)`` long component ids on ``labels.device``.
    """
    if _backend(labels, backend) == "skimage":
        return connected_regions(labels.cpu(), 0, backend="skimage").to(labels.device)
    return _components_kornia(labels)


def connected_regions(labels: Tensor, min_area: int = 0,
                      backend: ComponentsBackend | None = None) -> Tensor:
    """Split every region into its connected components and absorb tiny ones.

    Components are 8-connected (:func:`components`: the same components and ids on both
    back-ends). Components smaller than ``min_area`` pixels are filled by the kept regions
    around them (:func:`segment.core.regions.absorb_small`; the scikit-image path grows the
    hole pixels only, to the same labels).

    Args:
        labels: ``(B, H, W)`` integer region labels.
        min_area: components with fewer pixels are absorbed (0 = keep all).
        backend: ``"skimage"`` (numpy, image by image on :func:`map_images`) or ``"kornia"``
            (batched in torch); ``None`` = :func:`components_backend` of ``labels.device``.

    Returns:
        ``(B, H, W)`` long labels ``0 .. K_b - 1`` per image, one per component, on
        ``labels.device``.
    """
    if labels.dim() != 3:
        raise ValueError(f"labels must be (B, H, W), got {tuple(labels.shape)}")
    if _backend(labels, backend) == "skimage":
        lab = labels.detach().cpu().numpy()
        out = map_images(lambda i: _regions_skimage(lab[i], int(min_area)), lab.shape[0])
        return torch.from_numpy(np.stack(out)).to(labels.device)
    comp = _components_kornia(labels)
    if min_area > 0:
        comp = absorb_small(comp, int(min_area))
    return relabel(comp)


def component_regions(hard: Tensor, settings: Components) -> Tensor:
    """The connected-components stage of the region methods (:class:`Components`).

    Args:
        hard: ``(B, H, W)`` integer regions (every pixel's most likely one).
        settings: ``connectivity`` false: ``hard`` renumbered ``0 .. K_b - 1`` per image
            (:func:`segment.core.regions.relabel`); true: its :func:`connected_regions`, with
            components under ``min_area`` of the image absorbed (back-end by the device).

    Returns:
        ``(B, H, W)`` long labels on ``hard.device``.
    """
    area = settings.min_pixels(tuple(hard.shape[-2:]))
    if area is None:
        return relabel(hard)
    return connected_regions(hard, min_area=area)


def argmax_regions(maps: Tensor, counts: Sequence[int], size: tuple[int, int],
                   min_area: int | None = 0) -> Tensor:
    """Every pixel's most likely map, upsampled bilinearly, as regions.

    Args:
        maps: ``(B, K, h, w)`` soft maps on the grid; image ``b`` uses its first
            ``counts[b]`` (the slots after them pad the batch: zero maps, never the first
            maximum).
        counts: maps per image.
        size: ``(H, W)`` the output size.
        min_area: ``None`` = the argmax ids themselves; else their
            :func:`connected_regions` with specks under ``min_area`` pixels absorbed.

    Returns:
        ``(B, H, W)`` long labels. On the CPU image by image, each on one thread, the images
        side by side (:func:`map_images`: 1.3x faster on two threads than the batch's
        operations split over both; scikit-image); on CUDA the whole batch at once (kornia).
    """
    if maps.is_cuda:
        hard = F.interpolate(maps, size=size, mode="bilinear", align_corners=False).max(1).indices
        return hard if min_area is None else connected_regions(hard, min_area=min_area)
    # the maps innermost (channels last: a contiguous max, 3x faster than over planes)
    maps = maps.contiguous(memory_format=torch.channels_last)

    def one(i: int) -> np.ndarray:
        part = maps[i: i + 1, : max(1, int(counts[i]))]
        hard = F.interpolate(part, size=size, mode="bilinear", align_corners=False).max(1).indices
        return hard[0].numpy() if min_area is None else _regions_skimage(hard[0].numpy(),
                                                                         int(min_area))

    return torch.from_numpy(np.stack(map_images(one, maps.shape[0])))


def kmeans_labels(
    features: Tensor,
    k: int,
    max_iter: int = 20,
    n_init: int = 1,
    seed: int = 0,
) -> Tensor:
    """k-means cluster of every point, per batch element (scikit-learn's ``KMeans``: greedy
    k-means++ seeding, Lloyd iterations, a fixed ``random_state``; on the CPU in float64).

    Args:
        features: ``(B, n, D)`` points.
        k: number of clusters, ``1 <= k <= n``.
        max_iter: Lloyd iterations at most (scikit-learn's ``max_iter``).
        n_init: k-means++ restarts; the lowest inertia wins.
        seed: ``random_state`` (the same for every image: deterministic).

    Returns:
        ``(B, n)`` int64 cluster ids in ``[0, k)`` (on ``features.device``).
    """
    from sklearn.cluster import KMeans

    if features.dim() != 3:
        raise ValueError(f"features must be (B, n, D), got {tuple(features.shape)}")
    b, n, _ = features.shape
    k = int(k)
    if not 1 <= k <= n:
        raise ValueError(f"k must lie in 1..{n} (the number of tokens), got {k}")
    if int(max_iter) < 1 or int(n_init) < 1:
        raise ValueError(f"max_iter and n_init must be >= 1, got {max_iter}, {n_init}")
    x = features.detach().to("cpu", torch.float64).numpy()
    out = np.empty((b, n), dtype=np.int64)
    for i in range(b):
        km = KMeans(n_clusters=k, init="k-means++", n_init=int(n_init), max_iter=int(max_iter),
                    random_state=int(seed))
        out[i] = km.fit_predict(x[i])
    return torch.from_numpy(out).to(features.device)


_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}  # (pid, threads): none across a fork


def map_images(fn: Callable[[int], np.ndarray], n: int) -> list[np.ndarray]:
    """``[fn(0), ..., fn(n - 1)]`` on torch's intra-op thread count (numpy, scikit-image and
    torch release the GIL, so the images of a batch run side by side as torch's own ops do;
    torch operations in ``fn`` run on one thread each)."""
    threads = min(n, torch.get_num_threads())
    if threads <= 1:
        return [fn(i) for i in range(n)]
    key = (os.getpid(), threads)
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = ThreadPoolExecutor(threads, thread_name_prefix="segment-regions",
                                                initializer=set_thread_torch_threads, initargs=(1,))
    return list(pool.map(fn, range(n)))


def _components_kornia(labels: Tensor) -> Tensor:
    """:func:`components` through kornia's union-find, batched (one binary map per label)."""
    from kornia.contrib import connected_components_union_find

    b, h, w = labels.shape
    lab = relabel(labels)
    k = int(lab.max()) + 1
    onehot = F.one_hot(lab, k).permute(0, 3, 1, 2).reshape(b * k, 1, h, w)
    cc = connected_components_union_find(onehot).view(b, k, h, w).sum(1)  # ids are unique
    return number_components(cc, lab)


def _regions_skimage(lab: np.ndarray, min_area: int) -> np.ndarray:
    """:func:`connected_regions` of one ``(H, W)`` label map in numpy.

    scikit-image numbers the components ``1 .. m`` in the raster order of their first pixel,
    so a stable sort by label value gives :func:`segment.core.regions.number_components`'
    order. Specks are absorbed as :func:`segment.core.regions.absorb_small` does: the kept
    components, ranked by (area, id), grow into them (:func:`_grow_holes`); the ids left are
    renumbered ``0 .. K - 1`` in order. Past the scikit-image pass everything is a table per
    component, gathered by the pixels in contiguous passes (label values, areas, the kept
    ids, the result); only the hole pixels are visited one by one.
    """
    from skimage.measure import label as skimage_label

    h, w = lab.shape
    cc, m = skimage_label(lab, background=int(lab.min()) - 1, connectivity=2, return_num=True)
    flat = cc.ravel()
    value = np.empty(m + 1, dtype=lab.dtype)
    value[flat] = lab.ravel()
    rank = np.zeros(m + 1, dtype=np.int64)  # scikit-image id -> id by (value, first pixel)
    rank[1 + np.argsort(value[1:], kind="stable")] = np.arange(m)
    if min_area <= 0:
        return rank[cc]
    area = np.empty(m, dtype=np.int64)
    area[rank[1:]] = np.bincount(flat, minlength=m + 1)[1:]
    small = area < min_area
    if not small.any() or small.all():  # nothing to absorb / only specks: all kept
        return rank[cc]
    order = np.lexsort((np.arange(m), area))  # by area, then id: a tie joins the largest
    by_area = np.empty(m, dtype=np.int64)
    by_area[order] = np.arange(m)
    # the growth runs on the area ranks + 1 of the kept pixels (0 in holes), with one more
    # slot, always 0, that stands for every neighbour outside the image
    grow = np.zeros(m + 1, dtype=np.int64)
    grow[1:] = np.where(small, 0, by_area + 1)[rank[1:]]
    cur = np.zeros(h * w + 1, dtype=np.int64)
    np.take(grow, flat, out=cur[:-1])
    holes = np.flatnonzero(cur[:-1] == 0)
    y, x = np.divmod(holes[:, None], w)
    y, x = y + _DY, x + _DX  # (holes, 8) the neighbours
    inside = (y >= 0) & (y < h) & (x >= 0) & (x < w)
    _grow_holes(cur, holes, np.where(inside, y * w + x, h * w))
    kept = np.zeros(m, dtype=np.int64)
    kept[~small] = 1
    final = np.zeros(m + 1, dtype=np.int64)  # area rank + 1 -> kept id, renumbered in order
    final[1:] = (np.cumsum(kept) - 1)[order]
    return final[cur[:-1]].reshape(h, w)


_DY = np.array([-1, -1, -1, 0, 0, 1, 1, 1])  # the 8 neighbours of a pixel
_DX = np.array([-1, 0, 1, -1, 1, -1, 0, 1])


def _grow_holes(flat: np.ndarray, holes: np.ndarray, around: np.ndarray) -> None:
    """Fill the ``holes`` of flat ids + 1 (0 = none) in place, ``around`` ``(len(holes),
    8)`` the indices of each hole's 8 neighbours (an index that holds 0 for a neighbour
    outside the image).

    Every step, each unfilled pixel takes the largest id among its 8 neighbours (as
    :func:`segment.core.regions.absorb_small`'s max-pool does), all at once; only the hole
    pixels are gathered, so a step costs ``O(hole pixels)`` instead of ``O(image)``.
    """
    while holes.size:
        grown = flat[around].max(1)
        fill = grown > 0
        if not fill.any():  # a hole with no labelled rim (never, with kept regions)
            break
        flat[holes[fill]] = grown[fill]
        holes, around = holes[~fill], around[~fill]
