"""Finding and reading the images of a ``segment`` run.

:func:`find_images` lists every image under a folder (recursively) and gives each one a
unique output name that keeps its sub-folder; :func:`read_image` opens one file as an RGB
image with its EXIF orientation applied, or raises :class:`ImageReadError` with a message
that names the file and says what is wrong with it.

Mode handling (every mode ends as 8-bit RGB):

- ``RGB``: as is. ``L``, ``1``, ``P``, ``CMYK``, ``YCbCr``, ``LAB``, ``HSV``: Pillow's
  conversion (CMYK with an embedded ICC profile goes through that profile to sRGB).
- Transparency (``RGBA``, ``LA``, ``PA``, ``P``/``L``/``RGB`` with a transparent colour):
  **composited on white**, so transparent cut-outs become an object on a white background
  (dropping alpha would expose whatever colour the transparent pixels happen to hold).
- 16-bit grey (``I;16*``, e.g. 16-bit PNG/TIFF): divided by 257 (full range to 8 bit; Pillow's
  own ``convert`` would clip everything above 255 to white). 32-bit integer (``I``) and float
  (``F``) grey: floats in ``[0, 1]`` are multiplied by 255, values in ``[0, 255]`` stay, values
  in ``[0, 65535]`` are divided by 257, other ranges are min-max scaled. 16-bit RGB(A)
  PNG/TIFF are reduced to 8 bit per channel by Pillow itself.
- Multi-frame files (animated WebP, multi-page TIFF): the first frame.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")
"""File name endings read as images (case-insensitive)."""

_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_GREY_HIGH_DEPTH = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")


class InputError(ValueError):
    """The input of a run is unusable as a whole (missing path, nothing to read)."""


class ImageReadError(Exception):
    """One file cannot be used; ``reason`` says why in words.

    Attributes:
        path: the file.
        reason: what is wrong, e.g. ``"empty file (0 bytes)"``.
    """

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


@dataclass(frozen=True)
class ImageFile:
    """One image found under the input.

    Attributes:
        path: the file on disk.
        rel: its path relative to the input root, ``/``-separated, extension kept
            (``"sub/a.jpg"``); the file name alone when the input is one file.
        name: the unique output name, relative, without extension: ``"sub/a"``, or
            ``"sub/a.jpg"`` when another file of that folder shares the stem ``a``.
    """

    path: Path
    rel: str
    name: str


@dataclass
class Listing:
    """What :func:`find_images` found.

    Attributes:
        root: the input folder (the parent folder when the input is one file).
        files: the images, sorted by relative path.
        ignored: ``(relative path, reason)`` of files that are not read (other extensions,
            unreadable folders).
    """

    root: Path
    files: list[ImageFile]
    ignored: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class LoadedImage:
    """One image read from disk.

    Attributes:
        image: 8-bit RGB image, EXIF orientation applied (this is the "original
            resolution" every output has).
        source_mode: the Pillow mode of the file (``"RGBA"``, ``"I;16"``, ``"CMYK"``...).
        notes: things worth reporting that did not stop the read (first frame of many,
            unreadable EXIF...).
    """

    image: Image.Image
    source_mode: str
    notes: list[str] = field(default_factory=list)

    @property
    def size(self) -> tuple[int, int]:
        """``(H, W)`` in pixels."""
        return self.image.height, self.image.width


def is_image_name(path: str | os.PathLike) -> bool:
    """Whether the file name ends with one of :data:`IMAGE_EXTENSIONS` (any case)."""
    return Path(path).suffix.lower() in IMAGE_EXTENSIONS


@contextlib.contextmanager
def bundled_examples() -> Iterator[Path]:
    """The folder of example photos shipped in the package (``segment.datasets/examples``).

    A context manager because a zipped install needs the files extracted for the run.
    """
    ref = resources.files("segment.datasets").joinpath("examples")
    with resources.as_file(ref) as p:
        yield Path(p)


def output_names(rels: Sequence[str]) -> list[str]:
    """Unique output names for relative image paths.

    The name is the path without its extension (``"sub/a.jpg"`` -> ``"sub/a"``); files of
    one folder that share a stem (``a.jpg`` and ``a.png``) keep their extension instead
    (``"sub/a.jpg"``, ``"sub/a.png"``). Names are compared case-insensitively, so outputs
    never overwrite each other on case-insensitive file systems either; any name still taken
    gets a ``~2``, ``~3``... suffix. Deterministic for a given set of paths.

    Args:
        rels: distinct ``/``-separated relative paths.

    Returns:
        One name per path, in the same order.
    """
    stems = [r[: -len(Path(r).suffix)] if Path(r).suffix else r for r in rels]
    counts = Counter(s.casefold() for s in stems)
    names = [s if counts[s.casefold()] == 1 else r for s, r in zip(stems, rels)]
    taken: set[str] = set()
    out = []
    for n in names:  # a name could still clash (``a.jpg`` vs a file ``a.jpg.png``)
        cand, k = n, 1
        while cand.casefold() in taken:
            k += 1
            cand = f"{n}~{k}"
        taken.add(cand.casefold())
        out.append(cand)
    return out


def _within(path: Path, folder: Path) -> bool:
    try:
        path.relative_to(folder)
        return True
    except ValueError:
        return False


def check_input(input_path: str | os.PathLike) -> Path:
    """``input_path`` (``~`` expanded) when it exists and, a folder, holds an image somewhere
    (the search stops at the first); the commands call this before loading any model
    library, so a mistyped path or an empty folder fails at once.

    Raises:
        InputError: when it does not exist, or is a folder without any image.
    """
    root = _existing(input_path)
    if root.is_dir() and not _any_image(root):
        raise InputError(no_images_message(find_images(root)))
    return root


def no_images_message(listing: Listing) -> str:
    """What a run says when ``listing`` holds no image."""
    n = len(listing.ignored)
    return (f"no images found under {str(listing.root)!r} (looked recursively for "
            f"{', '.join(IMAGE_EXTENSIONS)}" + (f"; {n} other file{'' if n == 1 else 's'} ignored)" if n else ")"))


def _existing(input_path: str | os.PathLike) -> Path:
    root = Path(input_path).expanduser()
    if not root.exists():
        raise InputError(f"input path {str(root)!r} does not exist")
    return root


def _any_image(root: Path) -> bool:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        if any(not f.startswith(".") and is_image_name(f) for f in filenames):
            return True
    return False


def find_images(input_path: str | os.PathLike, exclude: Iterable[str | os.PathLike] = ()) -> Listing:
    """List every image under ``input_path`` (recursively), sorted, with output names.

    Hidden files and folders (names starting with ``.``) are skipped; files with other
    extensions are listed in :attr:`Listing.ignored`. Folders in ``exclude`` (e.g. the run's
    own output folder when it lies inside the input) are not entered.

    Args:
        input_path: a folder, or one image file (read whatever its extension).
        exclude: folders to leave out.

    Raises:
        InputError: when ``input_path`` does not exist or is neither file nor folder.
    """
    root = _existing(input_path).resolve()
    if root.is_file():
        f = ImageFile(path=root, rel=root.name, name=output_names([root.name])[0])
        return Listing(root=root.parent, files=[f])
    if not root.is_dir():
        raise InputError(f"input path {str(root)!r} is neither a file nor a folder")
    skip = [Path(e).expanduser().resolve() for e in exclude]
    found: list[tuple[str, Path]] = []
    ignored: list[tuple[str, str]] = []

    def onerror(err: OSError) -> None:
        where = Path(err.filename) if err.filename else root
        rel = where.relative_to(root).as_posix() if _within(where, root) else str(where)
        ignored.append((rel + "/", f"folder cannot be read: {err.strerror or err}"))

    for dirpath, dirnames, filenames in os.walk(root, onerror=onerror):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d for d in dirnames
            if not d.startswith(".") and not any(_within((here / d).resolve(), s) for s in skip)
        )
        for fn in sorted(filenames):
            if fn.startswith("."):
                continue
            p = here / fn
            rel = p.relative_to(root).as_posix()
            if not is_image_name(fn):
                ignored.append((rel, f"not an image extension ({', '.join(IMAGE_EXTENSIONS)})"))
            elif not p.is_file():
                ignored.append((rel, "not a regular file (broken link?)"))
            else:
                found.append((rel, p))
    found.sort(key=lambda t: t[0])
    names = output_names([r for r, _ in found])
    files = [ImageFile(path=p, rel=r, name=n) for (r, p), n in zip(found, names)]
    return Listing(root=root, files=files, ignored=sorted(ignored))


def _grey_to_uint8(a: np.ndarray) -> np.ndarray:
    """Scale a 16/32-bit integer or float grey array ``(H, W)`` to uint8 (see module doc)."""
    if a.dtype.kind == "u" and a.dtype.itemsize == 2:  # I;16 (any byte order): full range
        return np.rint(a.astype(np.float64) / 257.0).astype(np.uint8)
    is_float = a.dtype.kind == "f"
    a = np.nan_to_num(a.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    if not a.size:
        return a.astype(np.uint8)
    lo, hi = float(a.min()), float(a.max())
    if is_float and lo >= 0.0 and hi <= 1.0:
        return np.rint(a * 255.0).astype(np.uint8)
    if lo >= 0.0 and hi <= 255.0:
        return np.rint(a).astype(np.uint8)
    if lo >= 0.0 and hi <= 65535.0:
        return np.rint(a / 257.0).astype(np.uint8)
    return np.rint((a - lo) / max(hi - lo, 1e-12) * 255.0).astype(np.uint8)


def _cmyk_to_rgb(im: Image.Image, notes: list[str]) -> Image.Image:
    icc = im.info.get("icc_profile")
    if icc:
        try:
            from PIL import ImageCms

            src = ImageCms.ImageCmsProfile(io.BytesIO(icc))
            dst = ImageCms.createProfile("sRGB")
            return ImageCms.profileToProfile(im, src, dst, outputMode="RGB")
        except Exception as e:  # a broken profile: fall back to the plain conversion
            notes.append(f"CMYK ICC profile not usable ({e}); converted without it")
    return im.convert("RGB")


def to_rgb(im: Image.Image, notes: list[str] | None = None) -> Image.Image:
    """Any Pillow image -> 8-bit RGB, per the rules in the module docstring.

    Raises:
        ValueError: for a mode Pillow cannot convert to RGB.
    """
    notes = [] if notes is None else notes
    mode = im.mode
    if mode == "RGB" and "transparency" not in im.info:
        return im
    if mode in _GREY_HIGH_DEPTH:
        return Image.fromarray(_grey_to_uint8(np.asarray(im)), "L").convert("RGB")
    if mode == "CMYK":
        return _cmyk_to_rgb(im, notes)
    if mode in _ALPHA_MODES or "transparency" in im.info:
        rgba = im.convert("RGBA")
        out = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        out.alpha_composite(rgba)
        return out.convert("RGB")
    return im.convert("RGB")


def _over_limit(w: int, h: int, max_pixels: int | None) -> str | None:
    """Why a ``w x h`` image is refused for its pixel count (above ``max_pixels``, or
    Pillow's ``Image.MAX_IMAGE_PIXELS`` when ``None``), or ``None``."""
    limit = max_pixels if max_pixels is not None else Image.MAX_IMAGE_PIXELS
    if limit is None or w * h <= limit:
        return None
    return (f"image is {w}x{h} = {w * h:,} pixels, above the limit of {int(limit):,} "
            f"(decompression-bomb guard); if the file is trusted, raise the limit with max_pixels=N")


def _bomb_reason(e: Exception) -> str:
    """The reason for Pillow's own guard (more than twice ``Image.MAX_IMAGE_PIXELS``)."""
    return f"too large to decode safely ({e}); if the file is trusted, raise the limit with max_pixels=N"


def too_many_pixels(path: str | os.PathLike, *, max_pixels: int | None = None) -> str | None:
    """Why ``path`` is refused for its pixel count, from its header alone (Pillow's
    ``Image.open`` reads the size without decoding), with :func:`read_image`'s limit and
    words; ``None`` when it is within the limit or Pillow cannot read the header (then
    :func:`read_image` says what is wrong with the file). ``segment`` asks it of every
    image to segment before the model loads."""
    try:
        with Image.open(path) as im:
            w, h = im.size
    except Image.DecompressionBombError as e:
        return _bomb_reason(e)
    except Exception:  # not an image, unreadable: read_image's reason, later
        return None
    return _over_limit(w, h, max_pixels)


def read_image(path: str | os.PathLike, *, max_pixels: int | None = None) -> LoadedImage:
    """Read one image file as 8-bit RGB with its EXIF orientation applied.

    Args:
        path: the file.
        max_pixels: refuse images with more pixels than this before decoding them
            (decompression-bomb guard); ``None`` = Pillow's ``Image.MAX_IMAGE_PIXELS``.

    Raises:
        ImageReadError: naming the file and the problem (missing, empty, not an image,
            truncated/corrupt, too large, unsupported mode).
    """
    path = Path(path)
    try:
        nbytes = path.stat().st_size
    except OSError as e:
        raise ImageReadError(path, f"cannot be read: {e.strerror or e}") from None
    if nbytes == 0:
        raise ImageReadError(path, "empty file (0 bytes)")
    notes: list[str] = []
    try:
        with Image.open(path) as im:
            w, h = im.size
            too_many = _over_limit(w, h, max_pixels)
            if too_many is not None:
                raise ImageReadError(path, too_many)
            if getattr(im, "n_frames", 1) > 1:
                notes.append(f"{im.n_frames} frames; the first one is used")
            im.load()
            mode = im.mode
            try:
                im2 = ImageOps.exif_transpose(im)
            except Exception as e:  # corrupt EXIF must not cost the image
                notes.append(f"EXIF orientation unreadable ({e}); used as stored")
                im2 = im
            rgb = to_rgb(im2, notes)
            rgb.load()
            if rgb is im:  # detach from the file handle that the with-block closes
                rgb = rgb.copy()
    except ImageReadError:
        raise
    except UnidentifiedImageError:
        raise ImageReadError(path, "not a readable image (Pillow does not recognise the format)") from None
    except Image.DecompressionBombError as e:
        raise ImageReadError(path, _bomb_reason(e)) from None
    except MemoryError:
        raise ImageReadError(path, "out of memory while decoding") from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError) as e:
        msg = str(e) or type(e).__name__
        if "truncated" in msg.lower():
            raise ImageReadError(path, f"truncated image data ({msg})") from None
        raise ImageReadError(path, f"corrupt or unsupported image data ({type(e).__name__}: {msg})") from None
    if rgb.width < 1 or rgb.height < 1:
        raise ImageReadError(path, f"image has no pixels ({rgb.width}x{rgb.height})")
    return LoadedImage(image=rgb, source_mode=mode, notes=notes)
