"""ImageNet-segmentation (Guillaumin et al. 2014): the original ``gtsegs_ijcv.mat``.

The file is MATLAB v7.3, i.e. HDF5, read lazily with h5py (never loaded whole). Item ``i``
(protocol §3):

- image: ``f[f['/value/img'][i, 0]]`` -> ``(3, W, H)`` uint8, transposed ``(2, 1, 0)`` to
  ``H x W x 3``;
- mask: ``f[f[f['/value/gt'][i, 0]][0, 0]]`` (a cell of one reference) -> ``(W, H)`` in
  ``{0, 1}``, transposed ``(1, 0)`` to ``H x W``;
- class: ``f[f['/value/id'][i, 0]]`` -> UTF-16 code units of a WordNet synset id
  (``n02084071``), named through timm's WordNet tables (first lemma: ``dog``).

The mask is resized to the evaluation size with Pillow ``NEAREST``; the image stays at its
original size (the backbone's ``preprocess`` resizes it).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from segment.datasets.base import (
    SegmentationDataset,
    Sample,
    describe,
    require_file,
    resize_nearest,
)

IMG_KEY, GT_KEY, ID_KEY = "/value/img", "/value/gt", "/value/id"


@functools.lru_cache(maxsize=1)
def _wordnet_info():
    from timm.data import ImageNetInfo

    # The 22k table's lemma file covers every ImageNet synset (1k, 21k and 22k).
    return ImageNetInfo("imagenet-22k")


def synset_lemmas(synset: str) -> str:
    """The WordNet lemmas of a synset id, from timm's tables (``"dog, domestic dog, ..."``).

    Raises:
        KeyError: when timm's tables do not know the synset.
    """
    info = _wordnet_info()
    try:
        return info.label_name_to_description(synset)
    except KeyError:
        raise KeyError(f"synset {synset!r} is not in timm's WordNet tables") from None


def synset_to_name(synset: str) -> str:
    """First, simplest lemma of a synset, underscores as spaces (``n02084071`` -> ``dog``)."""
    return synset_lemmas(synset).split(",")[0].strip().replace("_", " ")


class ImageNetSegmentation(SegmentationDataset):
    """The 4,276 images of ``gtsegs_ijcv.mat`` with binary masks and class names.

    Args:
        root: the ``.mat`` file, or a folder containing ``gtsegs_ijcv.mat``.
        size: evaluation size ``(H, W)`` of the masks (protocol: 224 x 224); ``None`` keeps
            the native size.
        lookup_class_names: look every image's class name up (``False`` skips timm's
            tables; :meth:`class_name` is then ``None``).
    """

    task = "binary"
    num_classes = 2
    FILENAME = "gtsegs_ijcv.mat"

    def __init__(
        self,
        root: str | os.PathLike,
        size: Sequence[int] | int | None = (224, 224),
        lookup_class_names: bool = True,
    ) -> None:
        super().__init__(size)
        path = Path(root)
        if path.is_dir():
            path = path / self.FILENAME
        self.path = require_file(path, f"ImageNet-segmentation's {self.FILENAME} (MATLAB v7.3)")
        self.lookup_class_names = bool(lookup_class_names)
        self._file = None
        self._pid: int | None = None
        f = self._h5()
        for key in (IMG_KEY, GT_KEY, ID_KEY):
            if key not in f:
                raise ValueError(
                    f"{self.path}: expected an HDF5 dataset {key!r} (object references, one "
                    f"row per image) as in gtsegs_ijcv.mat; found top-level keys {list(f.keys())}"
                )
        lengths = {key: f[key].shape for key in (IMG_KEY, GT_KEY, ID_KEY)}
        for key, shape in lengths.items():
            if len(shape) != 2 or shape[1] != 1 or f[key].dtype.kind != "O":
                raise ValueError(
                    f"{self.path}: expected {key} to be an (N, 1) array of object references, "
                    f"got shape {shape} dtype {f[key].dtype}"
                )
        if len({s[0] for s in lengths.values()}) != 1:
            raise ValueError(f"{self.path}: img/gt/id have different lengths {lengths}")
        self._len = lengths[IMG_KEY][0]

    # h5py handles do not survive fork/pickle: open lazily, once per process.
    def _h5(self):
        import h5py

        if self._file is None or self._pid != os.getpid():
            try:
                self._file = h5py.File(self.path, "r")
            except OSError as e:
                raise ValueError(
                    f"{self.path}: expected a MATLAB v7.3 (HDF5) file, h5py cannot open it ({e})"
                ) from e
            self._pid = os.getpid()
        return self._file

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_file"], state["_pid"] = None, None
        return state

    def __len__(self) -> int:
        return self._len

    def name(self, index: int) -> str:
        index = self._check_index(index)
        return f"{index:05d}"

    def _deref(self, ref, what: str, index: int):
        f = self._h5()
        try:
            return f[ref]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{self.path}: item {index}: {what} is not a valid object reference") from e

    def image(self, index: int) -> np.ndarray:
        """``(H, W, 3)`` uint8 image of item ``index``."""
        f = self._h5()
        arr = np.asarray(self._deref(f[IMG_KEY][index, 0], "/value/img", index))
        if arr.ndim != 3 or arr.shape[0] != 3:
            raise ValueError(
                f"{self.path}: item {index}: expected the image as (3, W, H) uint8, got {describe(arr)}"
            )
        return np.ascontiguousarray(arr.transpose(2, 1, 0)).astype(np.uint8, copy=False)

    def mask(self, index: int) -> np.ndarray:
        """``(H, W)`` bool ground truth of item ``index`` at its native size."""
        f = self._h5()
        cell = self._deref(f[GT_KEY][index, 0], "/value/gt", index)
        if cell.dtype.kind != "O":
            raise ValueError(
                f"{self.path}: item {index}: expected /value/gt to point at a cell of one object "
                f"reference, got dtype {cell.dtype}"
            )
        arr = np.asarray(self._deref(cell[0, 0], "the /value/gt cell", index))
        if arr.ndim != 2:
            raise ValueError(f"{self.path}: item {index}: expected a (W, H) mask, got {describe(arr)}")
        values = np.unique(arr)
        if not np.isin(values, (0, 1)).all():
            raise ValueError(
                f"{self.path}: item {index}: expected mask values in {{0, 1}}, got {values[:10].tolist()}"
            )
        return np.ascontiguousarray(arr.T) > 0

    def synset(self, index: int) -> str:
        """The WordNet synset id of item ``index`` (``"n02084071"``)."""
        f = self._h5()
        codes = np.asarray(self._deref(f[ID_KEY][index, 0], "/value/id", index)).ravel()
        if codes.dtype.kind not in "ui":
            raise ValueError(
                f"{self.path}: item {index}: expected the synset id as UTF-16 code units, got {describe(codes)}"
            )
        return codes.astype(np.uint16).tobytes().decode("utf-16-le")

    def class_name(self, index: int) -> str | None:
        if not self.lookup_class_names:
            return None
        synset = self.synset(index)
        try:
            return synset_to_name(synset)
        except KeyError:
            warnings.warn(f"{self.path}: item {index}: unknown synset {synset!r}; no class name", stacklevel=2)
            return None

    def __getitem__(self, index: int) -> Sample:
        index = self._check_index(index)
        img = self.image(index)
        gt = self.mask(index)
        if gt.shape != img.shape[:2]:
            raise ValueError(
                f"{self.path}: item {index}: mask {gt.shape} and image {img.shape[:2]} differ in size"
            )
        return Sample(
            name=self.name(index),
            image=Image.fromarray(img),
            target=resize_nearest(gt, self.size),
            class_name=self.class_name(index),
        )
