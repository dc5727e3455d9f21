"""segment.run.io: finding images and reading every kind of file, good and bad."""

from __future__ import annotations

import io as _io
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from segment.run.io import (
    ImageReadError,
    InputError,
    bundled_examples,
    find_images,
    output_names,
    read_image,
    to_rgb,
)


def _rgb(h: int = 24, w: int = 32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _save(path: Path, arr: np.ndarray | Image.Image, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    im = arr if isinstance(arr, Image.Image) else Image.fromarray(arr)
    im.save(path, **kw)
    return path


# ----------------------------------------------------------------------------- names


def test_output_names_keep_folders_and_never_collide():
    rels = ["a.jpg", "a.png", "b.png", "sub/a.jpg", "sub/B.PNG", "sub/b.jpg", "c.jpg.png", "c.jpg"]
    names = output_names(rels)
    assert names[rels.index("b.png")] == "b"
    assert names[rels.index("sub/a.jpg")] == "sub/a"  # unique within its folder
    assert names[rels.index("a.jpg")] == "a.jpg" and names[rels.index("a.png")] == "a.png"
    # case-insensitive clash (B.PNG / b.jpg) keeps extensions
    assert names[rels.index("sub/B.PNG")] == "sub/B.PNG" and names[rels.index("sub/b.jpg")] == "sub/b.jpg"
    # "c.jpg" (kept extension would be "c.jpg") vs "c.jpg.png" (stem "c.jpg"): still unique
    assert len({n.casefold() for n in names}) == len(names)
    assert output_names(rels) == names  # deterministic


def test_find_images_recursive_sorted_filtered(tmp_path):
    root = tmp_path / "in"
    _save(root / "z.png", _rgb())
    _save(root / "a.JPG", _rgb(), format="JPEG")
    _save(root / "sub" / "deep" / "x.webp", _rgb(), format="WEBP")
    _save(root / "sub" / "y.tif", _rgb())
    _save(root / "sub" / "y.bmp", _rgb())
    (root / "notes.txt").write_text("hello")
    _save(root / ".hidden" / "h.png", _rgb())
    (root / ".DS_Store").write_bytes(b"junk")
    out = root / "results"  # output inside the input is not read back
    _save(out / "masks" / "z.png", _rgb())
    listing = find_images(root, exclude=[out])
    assert listing.root == root.resolve()
    assert [f.rel for f in listing.files] == ["a.JPG", "sub/deep/x.webp", "sub/y.bmp", "sub/y.tif", "z.png"]
    assert [f.name for f in listing.files] == ["a", "sub/deep/x", "sub/y.bmp", "sub/y.tif", "z"]
    assert listing.ignored == [("notes.txt", listing.ignored[0][1])]
    assert "not an image extension" in listing.ignored[0][1]


def test_find_images_single_file_and_missing(tmp_path):
    p = _save(tmp_path / "one.png", _rgb())
    listing = find_images(p)
    assert [(f.rel, f.name) for f in listing.files] == [("one.png", "one")]
    with pytest.raises(InputError, match="does not exist"):
        find_images(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert find_images(empty).files == []


def test_bundled_examples_are_found():
    with bundled_examples() as root:
        listing = find_images(root)
        assert [f.name for f in listing.files] == ["astronaut", "chelsea", "coffee"]
        for f in listing.files:
            assert read_image(f.path).image.mode == "RGB"


# ----------------------------------------------------------------------------- good files


@pytest.mark.parametrize("fmt,ext", [("PNG", ".png"), ("JPEG", ".jpg"), ("WEBP", ".webp"),
                                     ("BMP", ".bmp"), ("TIFF", ".tif")])
def test_read_formats(tmp_path, fmt, ext):
    yy, xx = np.mgrid[0:20, 0:30]
    a = np.stack([xx * 8, yy * 12, 255 - xx * 8], -1).astype(np.uint8)  # smooth: lossy-friendly
    lossy = fmt in ("JPEG", "WEBP")
    p = _save(tmp_path / f"x{ext}", a, format=fmt, **({"quality": 100} if lossy else {}))
    im = read_image(p).image
    assert im.mode == "RGB" and im.size == (30, 20)
    err = np.abs(np.asarray(im).astype(int) - a)
    if lossy:
        assert err.mean() < 4
    else:
        assert err.max() == 0


def test_16bit_grey_png_and_tiff_scale_not_clip(tmp_path):
    a16 = np.array([[0, 257, 32896, 65535]], dtype=np.uint16).repeat(3, 0)
    for ext in (".png", ".tif"):
        p = _save(tmp_path / f"g16{ext}", Image.fromarray(a16))
        r = read_image(p)
        assert r.source_mode.startswith("I;16")
        got = np.asarray(r.image)[0, :, 0]
        np.testing.assert_array_equal(got, [0, 1, 128, 255])  # Pillow's convert would give 0,255,255,255


def test_16bit_rgb_png_reduced_by_pillow(tmp_path):
    cv2 = pytest.importorskip("cv2")
    a = np.zeros((4, 4, 3), np.uint16)
    a[..., 0] = 65535  # BGR: blue full
    a[..., 2] = 32896  # red half
    p = tmp_path / "rgb16.png"
    assert cv2.imwrite(str(p), a)
    got = np.asarray(read_image(p).image)
    np.testing.assert_allclose(got[0, 0], [128, 0, 255], atol=1)


def test_int32_and_float_grey_modes():
    i = Image.fromarray(np.array([[0, 1000, 65535]], dtype=np.int32), "I")
    np.testing.assert_array_equal(np.asarray(to_rgb(i))[0, :, 0], [0, 4, 255])
    f = Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32), "F")
    np.testing.assert_array_equal(np.asarray(to_rgb(f))[0, :, 0], [0, 128, 255])
    neg = Image.fromarray(np.array([[-5.0, 0.0, 5.0]], dtype=np.float32), "F")  # other range: min-max
    np.testing.assert_array_equal(np.asarray(to_rgb(neg))[0, :, 0], [0, 128, 255])


def test_rgba_la_palette_composited_on_white(tmp_path):
    rgba = np.zeros((2, 3, 4), np.uint8)
    rgba[0, 0] = (255, 0, 0, 255)   # opaque red stays red
    rgba[0, 1] = (255, 0, 0, 0)     # transparent -> white (not red)
    rgba[0, 2] = (0, 0, 0, 128)     # half black -> grey
    got = np.asarray(read_image(_save(tmp_path / "a.png", Image.fromarray(rgba, "RGBA"))).image)
    np.testing.assert_array_equal(got[0, 0], [255, 0, 0])
    np.testing.assert_array_equal(got[0, 1], [255, 255, 255])
    assert abs(int(got[0, 2, 0]) - 127) <= 1
    la = Image.fromarray(np.array([[[10, 255], [10, 0]]], np.uint8), "LA")
    got = np.asarray(read_image(_save(tmp_path / "la.png", la)).image)
    np.testing.assert_array_equal(got[0], [[10, 10, 10], [255, 255, 255]])
    # palette with a transparent index
    p = Image.new("P", (2, 1))
    p.putpalette([0, 0, 255, 0, 255, 0] + [0] * 762)
    p.putpixel((0, 0), 0)
    p.putpixel((1, 0), 1)
    path = tmp_path / "p.png"
    p.save(path, transparency=1)
    r = read_image(path)
    assert r.source_mode == "P"
    np.testing.assert_array_equal(np.asarray(r.image)[0], [[0, 0, 255], [255, 255, 255]])


def test_palette_and_bilevel(tmp_path):
    p = Image.new("P", (3, 1))
    p.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * 759)
    for x in range(3):
        p.putpixel((x, 0), x)
    got = np.asarray(read_image(_save(tmp_path / "p.bmp", p)).image)
    np.testing.assert_array_equal(got[0], [[255, 0, 0], [0, 255, 0], [0, 0, 255]])
    b = Image.fromarray(np.array([[0, 255]], np.uint8)).convert("1")
    got = np.asarray(read_image(_save(tmp_path / "b.png", b)).image)
    np.testing.assert_array_equal(got[0], [[0, 0, 0], [255, 255, 255]])


def test_cmyk_jpeg_to_rgb(tmp_path):
    im = Image.new("CMYK", (16, 8), (0, 255, 255, 0))  # pure red in CMYK
    r = read_image(_save(tmp_path / "c.jpg", im, quality=100))
    assert r.source_mode == "CMYK" and r.image.mode == "RGB"
    np.testing.assert_allclose(np.asarray(r.image).reshape(-1, 3).mean(0), [255, 0, 0], atol=4)


def test_exif_orientation_applied(tmp_path):
    a = np.zeros((20, 40, 3), np.uint8)
    a[:, :20] = (255, 0, 0)  # left half red
    a[:, 20:] = (0, 0, 255)  # right half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    p = _save(tmp_path / "rot.jpg", a, exif=exif, quality=100)
    im = read_image(p).image
    assert im.size == (20, 40)  # (W, H): portrait after rotation
    got = np.asarray(im).astype(int)
    want = np.rot90(a, k=-1).astype(int)  # clockwise: the left half goes to the top
    assert np.abs(got - want).mean() < 6
    assert got[:15, :, 0].mean() > 200 and got[25:, :, 2].mean() > 200


def test_first_frame_of_multipage_tiff(tmp_path):
    frames = [Image.fromarray(np.full((4, 4, 3), v, np.uint8)) for v in (10, 200)]
    p = tmp_path / "multi.tif"
    frames[0].save(p, save_all=True, append_images=frames[1:])
    r = read_image(p)
    assert np.asarray(r.image).max() == 10 and any("2 frames" in n for n in r.notes)


# ----------------------------------------------------------------------------- bad files


def test_zero_byte_file(tmp_path):
    p = tmp_path / "empty.jpg"
    p.write_bytes(b"")
    with pytest.raises(ImageReadError, match=r"empty file \(0 bytes\)") as e:
        read_image(p)
    assert e.value.path == p and str(p) in str(e.value)


def test_text_file_named_png(tmp_path):
    p = tmp_path / "notes.png"
    p.write_text("this is not a picture\n" * 10)
    with pytest.raises(ImageReadError, match="not a readable image") as e:
        read_image(p)
    assert str(p) in str(e.value)


@pytest.mark.parametrize("fmt,ext", [("JPEG", ".jpg"), ("PNG", ".png")])
def test_truncated_file(tmp_path, fmt, ext):
    buf = _io.BytesIO()
    Image.fromarray(_rgb(64, 64)).save(buf, format=fmt)
    p = tmp_path / f"cut{ext}"
    p.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    with pytest.raises(ImageReadError, match="truncated|corrupt") as e:
        read_image(p)
    assert str(p) in str(e.value)


def test_corrupt_header(tmp_path):
    buf = _io.BytesIO()
    Image.fromarray(_rgb(16, 16)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    data[16:24] = b"\xff" * 8  # the IHDR width/height
    p = tmp_path / "bad.png"
    p.write_bytes(bytes(data))
    with pytest.raises(ImageReadError, match=str(p.name)):
        read_image(p)


def test_decompression_bomb_limits(tmp_path, monkeypatch):
    p = _save(tmp_path / "big.png", _rgb(40, 50))
    with pytest.raises(ImageReadError, match=r"50x40 = 2,000 pixels, above the limit of 1,000 .*max_pixels"):
        read_image(p, max_pixels=1000)
    assert read_image(p, max_pixels=2000).image.size == (50, 40)
    # Pillow's own guard (more than twice MAX_IMAGE_PIXELS) is reported clearly too
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)
    with pytest.raises(ImageReadError, match="max_pixels"):
        read_image(p)


def png_header_only(w: int, h: int) -> bytes:
    """A PNG that claims ``w x h`` pixels but holds almost no data (a decompression bomb's header)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize("side", [10_000, 30_000])  # above Pillow's limit, and above twice it
def test_huge_image_refused_before_decoding(tmp_path, side):
    p = tmp_path / "bomb.png"
    p.write_bytes(png_header_only(side, side))
    t0 = time.perf_counter()
    with pytest.raises(ImageReadError, match="max_pixels=N") as e:
        read_image(p)
    assert time.perf_counter() - t0 < 1.0  # nothing was decoded
    assert str(p) in str(e.value) and ("above the limit" in str(e.value) or "decompression bomb" in str(e.value))


def test_missing_file(tmp_path):
    with pytest.raises(ImageReadError, match="cannot be read"):
        read_image(tmp_path / "gone.png")
