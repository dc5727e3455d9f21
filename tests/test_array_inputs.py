"""Arrays and tensors as images (``segment.run.api.segmenter.to_image``): one rule for numpy
and torch: uint8 is 0..255, float is [0, 1]; a 3-D array whose first dim is 3 (or 1) and
whose last is not 3 is channels-first, else channels-last; 2-D is grey. Anything else is
refused in one line naming the shape and dtype (or the range found)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import segment
from segment.run.api.segmenter import to_image
from segment.run.io import read_image


def _photo(tmp_path, h: int = 20, w: int = 30) -> tuple[np.ndarray, Image.Image]:
    """A random RGB photo and the PIL image the command reads from its PNG."""
    a = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
    Image.fromarray(a).save(tmp_path / "photo.png")
    return a, read_image(tmp_path / "photo.png").image


@pytest.mark.parametrize("container", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["uint8", "float"])
@pytest.mark.parametrize("layout", ["HWC", "CHW"])
def test_every_container_dtype_and_layout_gives_the_pil_image(tmp_path, container, dtype, layout):
    hwc, pil = _photo(tmp_path)
    a = hwc if layout == "HWC" else hwc.transpose(2, 0, 1)
    x = np.ascontiguousarray(a) if container == "numpy" else torch.from_numpy(np.ascontiguousarray(a))
    if dtype == "float":
        x = x / 255  # float64 for numpy, float32 for torch
    got = to_image(x)
    assert got.mode == "RGB" and got.size == pil.size
    np.testing.assert_array_equal(np.asarray(got), np.asarray(pil))  # x / 255 gives the uint8 image back


@pytest.mark.parametrize("make", [np.asarray, torch.from_numpy])
def test_grey_and_the_layout_rule(tmp_path, make):
    grey = np.random.default_rng(1).integers(0, 256, (20, 30), dtype=np.uint8)
    ref = np.asarray(Image.fromarray(grey).convert("RGB"))
    for a in (grey, grey[None], grey[..., None], grey / 255, (grey / 255)[None].astype(np.float32)):
        np.testing.assert_array_equal(np.asarray(to_image(make(np.ascontiguousarray(a)))), ref)
    # (3, H, 3): the last dim is 3, so channels-last (3 rows of 3 columns); (3, 4, 5): channels-first
    assert to_image(make(np.zeros((3, 7, 3), np.uint8))).size == (7, 3)
    assert to_image(make(np.zeros((3, 4, 5), np.uint8))).size == (5, 4)
    rgba = np.zeros((6, 8, 4), np.uint8)  # transparent: composited on white, as a file is
    assert (np.asarray(to_image(make(rgba))) == 255).all()


@pytest.mark.parametrize("make", [np.asarray, torch.from_numpy])
def test_refusals_name_what_came(make):
    for bad, words in (
        (np.zeros((10, 10, 2), np.uint8), "of shape (10, 10, 2) "),
        (np.zeros((2, 10, 10, 3), np.uint8), "of shape (2, 10, 10, 3) "),
        (np.zeros((4, 10, 10), np.float32), "of shape (4, 10, 10) "),
        (np.zeros((0, 10, 3), np.uint8), "of shape (0, 10, 3) "),
        (np.zeros((10, 10, 3), np.int64), "uint8 (0..255) or float ([0, 1]) to be an image, got (10, 10, 3) "),
        (np.zeros((10, 10), bool), "got (10, 10) "),
        (np.full((3, 8, 8), 2.0, np.float32), "values in [0, 1] to be an image, got [2, 2]; 0..255 values"),
        (np.full((8, 8), -0.5), "got [-0.5, -0.5]"),
        (np.full((8, 8), np.nan), "got NaN or infinity"),
    ):
        with pytest.raises(ValueError) as e:
            to_image(make(bad))
        assert words in str(e.value), (str(e.value), words)
        if "shape" in words:  # the rule, in the words of the docstring
            assert "(3, H, W)" in str(e.value) and "uint8 in 0..255 or float in [0, 1]" in str(e.value)


def test_the_segmenter_reads_a_channels_first_uint8_tensor_like_the_array():
    a = np.full((40, 60, 3), 40, np.uint8)
    a[10:30, 15:45] = (200, 120, 30)
    seg = segment.load("vit_tiny_random", "cls_attention", device="cpu", image_size=56)
    ref = seg(a)
    for x in (torch.from_numpy(a).permute(2, 0, 1), a.transpose(2, 0, 1), torch.from_numpy(a) / 255):
        np.testing.assert_array_equal(seg(x).mask, ref.mask)
    with pytest.raises(ValueError, match=r"image 1: a float tensor must hold values in \[0, 1\]"):
        seg([a, torch.from_numpy(a).float()])
