"""Data set loaders on small fixtures written by the tests (same layouts as the real sets)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from segment.datasets.base import center_crop_box, resize_nearest
from segment.datasets.coco import CocoSegmentation
from segment.datasets.folder import FolderPairs
from segment.datasets.imagenet_seg import ImageNetSegmentation, synset_to_name
from segment.datasets.multiclass import (
    COCOSTUFF_FINE_TO_COARSE,
    Cityscapes27,
    CocoStuff27,
    LabelFolder,
)

# ---------------------------------------------------------------- ImageNet-segmentation


def write_gtsegs(path: Path, images: list[np.ndarray], masks: list[np.ndarray], synsets: list[str]) -> None:
    """A file with gtsegs_ijcv.mat's MATLAB v7.3 layout: /value/{img,gt,id} are (N, 1) object
    references into '#refs#'; gt goes through a (1, 1) cell of references; images are stored
    (3, W, H), masks (W, H), ids as UTF-16 code units (L, 1)."""
    import h5py

    n = len(images)
    with h5py.File(path, "w") as f:
        refs = f.create_group("#refs#")
        value = f.create_group("value")
        img = value.create_dataset("img", (n, 1), dtype=h5py.ref_dtype)
        gt = value.create_dataset("gt", (n, 1), dtype=h5py.ref_dtype)
        ids = value.create_dataset("id", (n, 1), dtype=h5py.ref_dtype)
        for i, (im, m, s) in enumerate(zip(images, masks, synsets)):
            d_img = refs.create_dataset(f"img{i}", data=im.transpose(2, 1, 0))
            d_gt = refs.create_dataset(f"gt{i}", data=m.T.astype(np.uint8))
            cell = refs.create_dataset(f"cell{i}", (1, 1), dtype=h5py.ref_dtype)
            cell[0, 0] = d_gt.ref
            codes = np.frombuffer(s.encode("utf-16-le"), dtype=np.uint16).reshape(-1, 1)
            d_id = refs.create_dataset(f"id{i}", data=codes)
            img[i, 0] = d_img.ref
            gt[i, 0] = cell.ref
            ids[i, 0] = d_id.ref


@pytest.fixture
def gtsegs(tmp_path):
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(30, 40), (25, 20), (16, 16)]]
    masks = [rng.random(im.shape[:2]) > 0.5 for im in images]
    synsets = ["n02084071", "n01443537", "n07747607"]
    path = tmp_path / "gtsegs_ijcv.mat"
    write_gtsegs(path, images, masks, synsets)
    return path, images, masks


def test_imagenet_seg_reads_the_layout(gtsegs):
    path, images, masks = gtsegs
    ds = ImageNetSegmentation(path.parent, size=(8, 12))
    assert len(ds) == 3
    for i in range(3):
        s = ds[i]
        assert s.name == f"{i:05d}"
        np.testing.assert_array_equal(np.asarray(s.image), images[i])
        assert s.image.mode == "RGB"
        ref = np.asarray(Image.fromarray(masks[i].astype(np.uint8)).resize((12, 8), Image.NEAREST)) > 0
        np.testing.assert_array_equal(s.target, ref)
        assert s.target.dtype == bool and s.target.shape == (8, 12)
    assert [ds[i].class_name for i in range(3)] == ["dog", "goldfish", "orange"]
    assert ds.synset(0) == "n02084071"


def test_imagenet_seg_native_size_and_pickle(gtsegs):
    path, images, masks = gtsegs
    ds = ImageNetSegmentation(path, size=None, lookup_class_names=False)
    np.testing.assert_array_equal(ds[1].target, masks[1])
    assert ds[1].class_name is None
    ds2 = pickle.loads(pickle.dumps(ds))  # DataLoader workers: the h5py handle is reopened
    np.testing.assert_array_equal(np.asarray(ds2[2].image), images[2])


def test_imagenet_seg_errors(tmp_path, gtsegs):
    with pytest.raises(FileNotFoundError, match="gtsegs_ijcv.mat"):
        ImageNetSegmentation(tmp_path / "nowhere")
    bad = tmp_path / "bad.mat"
    bad.write_bytes(b"MATLAB 5.0 MAT-file, not HDF5")
    with pytest.raises(ValueError, match="HDF5"):
        ImageNetSegmentation(bad)
    import h5py

    other = tmp_path / "other.mat"
    with h5py.File(other, "w") as f:
        f.create_dataset("value/img", data=np.zeros((2, 1)))
    with pytest.raises(ValueError, match="/value/gt"):
        ImageNetSegmentation(other)


def test_imagenet_seg_bad_mask_values(tmp_path):
    path = tmp_path / "gtsegs_ijcv.mat"
    write_gtsegs(path, [np.zeros((4, 4, 3), np.uint8)], [np.full((4, 4), 3)], ["n02084071"])
    ds = ImageNetSegmentation(path, size=None)
    with pytest.raises(ValueError, match=r"item 0: expected mask values in \{0, 1\}"):
        ds[0]


def test_synset_names():
    assert synset_to_name("n02084071") == "dog"
    assert synset_to_name("n04254680") == "soccer ball"
    with pytest.raises(KeyError, match="n99999999"):
        synset_to_name("n99999999")


# ---------------------------------------------------------------- folder pairs


def _save(path: Path, arr: np.ndarray, mode: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    im = Image.fromarray(arr)
    if mode:
        im = im.convert(mode)
    im.save(path)


@pytest.fixture
def folder(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "set"
    graded = rng.integers(0, 256, (20, 30), dtype=np.uint8)
    _save(root / "images" / "a.jpg", rng.integers(0, 256, (20, 30, 3), dtype=np.uint8))
    _save(root / "masks" / "a.png", graded)
    _save(root / "images" / "b.png", rng.integers(0, 256, (10, 10, 3), dtype=np.uint8))
    _save(root / "masks" / "b.png", (rng.random((10, 10)) > 0.5).astype(np.uint8))  # 0/1
    _save(root / "images" / "c.png", rng.integers(0, 256, (12, 8), dtype=np.uint8))  # grey image
    rgb_mask = np.repeat((rng.random((12, 8, 1)) > 0.5).astype(np.uint8) * 255, 3, axis=2)
    _save(root / "masks" / "c.bmp", rgb_mask)
    return root, graded


def test_folder_matches_the_reference_recipe(folder):
    root, _ = folder
    ds = FolderPairs(root, size=(16, 16))
    assert [ds.name(i) for i in range(len(ds))] == ["a", "b", "c"]
    for i, (stem, mask_file) in enumerate([("a", "a.png"), ("b", "b.png"), ("c", "c.bmp")]):
        s = ds[i]
        assert s.image.mode == "RGB" and s.class_name is None
        m = Image.open(root / "masks" / mask_file).convert("L").resize((16, 16), Image.NEAREST)
        arr = np.asarray(m)
        ref = arr > 127 if arr.max() > 1 else arr > 0  # REFERENCE.md recipe; 0/1 masks as 0/1
        np.testing.assert_array_equal(s.target, ref)


def test_folder_threshold_knob(folder):
    root, graded = folder
    ds = FolderPairs(root, size=None, threshold=0.25)
    np.testing.assert_array_equal(ds[0].target, graded / 255.0 > 0.25)
    assert ds[0].target.shape == (20, 30)


def test_folder_16bit_masks(tmp_path):
    root = tmp_path / "s"
    _save(root / "images" / "x.png", np.zeros((4, 4, 3), np.uint8))
    m = np.array([[0, 40000], [20000, 65535]], dtype=np.uint16).repeat(2, 0).repeat(2, 1)
    root.joinpath("masks").mkdir()
    Image.fromarray(m).save(root / "masks" / "x.png")
    ds = FolderPairs(root, size=(2, 2))
    np.testing.assert_array_equal(ds[0].target, [[False, True], [False, True]])


def test_a_truncated_file_is_a_data_error_naming_it(folder):
    from segment.datasets.base import DataError

    root, _ = folder
    whole = (root / "masks" / "a.png").read_bytes()
    (root / "masks" / "a.png").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match=r"masks/a\.png: expected a mask image .* Pillow can decode"):
        FolderPairs(root, size=(16, 16))[0]
    whole = (root / "images" / "b.png").read_bytes()
    (root / "images" / "b.png").write_bytes(whole[:40])
    with pytest.raises(DataError, match=r"images/b\.png: expected an RGB image"):
        FolderPairs(root, size=(16, 16))[1]


def test_folder_errors(folder, tmp_path):
    root, _ = folder
    with pytest.raises(FileNotFoundError, match="masks"):
        FolderPairs(tmp_path / "nothing")
    _save(root / "images" / "lonely.png", np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(ValueError, match=r"images/lonely.png: an image with no mask .*missing=skip"):
        FolderPairs(root)
    assert len(FolderPairs(root, missing="skip")) == 3
    (root / "images" / "lonely.png").unlink()
    _save(root / "masks" / "orphan.png", np.zeros((4, 4), np.uint8))
    with pytest.raises(ValueError, match=r"masks/orphan.png: a mask with no image .*\(1 such masks\)"):
        FolderPairs(root)
    assert len(FolderPairs(root, missing="skip")) == 3
    (root / "masks" / "orphan.png").unlink()
    (root / "masks" / "a.png").write_bytes(b"not a png")
    ds = FolderPairs(root)
    with pytest.raises(ValueError, match=r"a\.png.*mask"):
        ds[0]


# ---------------------------------------------------------------- COCO format


def _rle(mask: np.ndarray) -> dict:
    from pycocotools import mask as mask_utils

    r = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
    r["counts"] = r["counts"].decode("ascii")
    return r


@pytest.fixture
def coco(tmp_path):
    h, w = 20, 24
    _save(tmp_path / "img" / "one.jpg", np.full((h, w, 3), 128, np.uint8))
    _save(tmp_path / "img" / "two.jpg", np.full((h, w, 3), 64, np.uint8))
    _save(tmp_path / "img" / "three.jpg", np.full((h, w, 3), 10, np.uint8))
    big = np.zeros((h, w), bool)
    big[2:18, 2:14] = True
    small = np.zeros((h, w), bool)
    small[5:9, 5:9] = True
    data = {
        "images": [
            {"id": 1, "file_name": "one.jpg", "height": h, "width": w},
            {"id": 2, "file_name": "two.jpg", "height": h, "width": w},
            {"id": 3, "file_name": "three.jpg", "height": h, "width": w},
        ],
        "categories": [{"id": 1, "name": "person"}, {"id": 18, "name": "dog"}, {"id": 157, "name": "sky-other"}],
        "annotations": [
            # image 1: a large dog (RLE) with a small person on it (polygon), a crowd of people
            {"id": 10, "image_id": 1, "category_id": 18, "segmentation": _rle(big), "area": float(big.sum()), "iscrowd": 0},
            {"id": 11, "image_id": 1, "category_id": 1, "segmentation": [[5, 5, 9, 5, 9, 9, 5, 9]], "area": 16.0, "iscrowd": 0},
            {"id": 12, "image_id": 1, "category_id": 1, "segmentation": _rle(np.pad(np.ones((2, 2), bool), ((18, 0), (22, 0)))), "area": 4.0, "iscrowd": 1},
            # image 2: sky only
            {"id": 20, "image_id": 2, "category_id": 157, "segmentation": _rle(~big), "area": float((~big).sum()), "iscrowd": 0},
        ],
    }
    ann = tmp_path / "ann.json"
    ann.write_text(json.dumps(data))
    return tmp_path / "img", ann, big, small


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # pycocotools + numpy 2
def test_coco_binary(coco):
    images, ann, big, small = coco
    from pycocotools import mask as mask_utils

    ds = CocoSegmentation(images, ann, size=None)
    assert len(ds) == 2  # image three has no annotation
    s = ds[0]
    assert s.name == "one" and s.class_name == "dog"  # largest annotation
    poly = mask_utils.decode(mask_utils.merge(mask_utils.frPyObjects([[5, 5, 9, 5, 9, 9, 5, 9]], 20, 24))).astype(bool)
    crowd = np.zeros((20, 24), bool)
    crowd[18:, 22:] = True
    np.testing.assert_array_equal(s.target, big | poly | crowd)
    no_crowd = CocoSegmentation(images, ann, size=None, crowd=False)
    np.testing.assert_array_equal(no_crowd[0].target, big | poly)
    only_person = CocoSegmentation(images, ann, size=(10, 12), categories=["person"])
    assert len(only_person) == 1 and only_person[0].class_name == "person"
    np.testing.assert_array_equal(only_person[0].target, resize_nearest(poly | crowd, (10, 12)))


def test_coco_multiclass_painting_and_cocostuff_map(coco):
    images, ann, big, _ = coco
    ds = CocoSegmentation(images, ann, task="multiclass", size=None, crowd=False)
    assert ds.num_classes == 3
    lab = ds[0].target
    assert lab.dtype == np.int64
    assert (lab[big] >= 0).all()
    assert lab[6, 6] == 0  # the small person is painted over the larger dog
    assert lab[3, 3] == 1  # dog (contiguous ids in category-id order: 1, 18, 157)
    assert lab[0, 0] == 255  # unannotated -> ignore
    assert (ds[1].target[~big] == 2).all()
    stuff = CocoSegmentation(images, ann, task="multiclass", size=None, label_map="cocostuff27", background=False)
    assert stuff.num_classes == 27
    lab = stuff[0].target
    assert lab[6, 6] == COCOSTUFF_FINE_TO_COARSE[0] == 9  # person
    assert lab[3, 3] == COCOSTUFF_FINE_TO_COARSE[17] == 7  # dog -> animal
    assert (stuff[1].target[~big] == 23).all()  # sky-other -> sky
    bg = CocoSegmentation(images, ann, task="multiclass", size=None, background=True)
    assert bg.num_classes == 4 and bg[0].target[0, 0] == 0 and bg[0].target[6, 6] == 1
    # the multiclass settings would change nothing in a binary set: refused
    with pytest.raises(ValueError, match=r"label_map='cocostuff27', background=True: multiclass"
                                         r" settings, no effect with task=binary"):
        CocoSegmentation(images, ann, size=None, label_map="cocostuff27", background=True)
    with pytest.raises(ValueError, match=r"num_classes=5: no effect with label_map=None"):
        CocoSegmentation(images, ann, task="multiclass", size=None, num_classes=5)
    assert CocoSegmentation(images, ann, task="multiclass", size=None, label_map={1: 0, 18: 1},
                            num_classes=5).num_classes == 5


def test_coco_errors(coco, tmp_path):
    images, ann, _, _ = coco
    with pytest.raises(FileNotFoundError, match="COCO-format annotation JSON"):
        CocoSegmentation(images, tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json.*JSON"):
        CocoSegmentation(images, broken)
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"images": [], "annotations": []}))
    with pytest.raises(ValueError, match="categories"):
        CocoSegmentation(images, partial)
    with pytest.raises(ValueError, match="unknown categories"):
        CocoSegmentation(images, ann, categories=["unicorn"])
    (images / "one.jpg").unlink()
    ds = CocoSegmentation(images, ann)
    with pytest.raises(FileNotFoundError, match="one.jpg"):
        ds[0]


# ---------------------------------------------------------------- COCO-Stuff-27, Cityscapes-27


def test_cocostuff27(tmp_path):
    root = tmp_path / "cocostuff"
    fine = np.array([[0, 17, 156, 255], [90, 91, 181, 170]], dtype=np.uint8).repeat(3, 0).repeat(2, 1)  # 6 x 8
    ids = ["000000000139", "000000000285"]
    for i in ids:
        _save(root / "images" / "val2017" / f"{i}.jpg", np.zeros((6, 8, 3), np.uint8))
        _save(root / "annotations" / "val2017" / f"{i}.png", fine)
    lst = root / "curated" / "val2017" / "Coco164kFull_Stuff_Coarse_7.txt"
    lst.parent.mkdir(parents=True)
    lst.write_text("\n".join(ids) + "\n")
    with pytest.warns(UserWarning, match="2175"):
        ds = CocoStuff27(root, size=None, crop="none")
    assert len(ds) == 2 and ds.name(0) == ids[0]
    lab = ds[0].target
    assert lab[0].tolist() == [9, 9, 7, 7, 23, 23, 255, 255]
    assert lab[3].tolist() == [4, 4, 17, 17, 24, 24, 18, 18]
    cropped = CocoStuff27(root, size=(3, 3), crop="center", expected=2)
    s = cropped[0]
    assert s.image.size == (6, 6)
    box = center_crop_box(8, 6)
    np.testing.assert_array_equal(s.target, cropped.lut[resize_nearest(fine[box[1]:box[3], box[0]:box[2]], (3, 3))])
    bad = fine.copy()
    bad[3, 4] = 200  # inside the centre crop
    _save(root / "annotations" / "val2017" / f"{ids[1]}.png", bad)
    with pytest.raises(ValueError, match=r"unexpected values \[200\]"):
        cropped[1]
    lst.write_text("000000999999\n")
    with pytest.raises(FileNotFoundError, match="000000999999"):
        CocoStuff27(root, expected=None)
    lst.unlink()
    with pytest.raises(FileNotFoundError, match="curated"):
        CocoStuff27(root)


def test_cityscapes27(tmp_path):
    root = tmp_path / "cityscapes"
    ids = np.array([[0, 6, 7, 8], [26, 33, 34, 255]], dtype=np.uint8).repeat(2, 0)  # 4 x 4 ... make 4 x 8
    ids = np.concatenate([ids, ids], 1)
    _save(root / "leftImg8bit" / "val" / "lindau" / "lindau_000000_000019_leftImg8bit.png", np.zeros((4, 8, 3), np.uint8))
    _save(root / "gtFine" / "val" / "lindau" / "lindau_000000_000019_gtFine_labelIds.png", ids)
    ds = Cityscapes27(root, size=None, crop="none")
    assert ds.name(0) == "lindau/lindau_000000_000019"
    assert ds[0].target[0].tolist() == [255, 255, 0, 1] * 2
    assert ds[0].target[2].tolist() == [19, 26, 255, 255] * 2
    assert Cityscapes27(root, size=None)[0].target.shape == (4, 4)  # centre square crop
    (root / "gtFine" / "val" / "lindau" / "lindau_000000_000019_gtFine_labelIds.png").unlink()
    with pytest.raises(FileNotFoundError, match="labelIds"):
        Cityscapes27(root)


# ---------------------------------------------------------------- label folders (CamVid layout)


def _label_folder(root: Path, n: int = 2, h: int = 6, w: int = 8) -> list[np.ndarray]:
    """``n`` images + class-id PNGs (K = 3, 11 = void) under root/images, root/labels."""
    rng = np.random.default_rng(0)
    labels = []
    for i in range(n):
        lab = rng.integers(0, 3, (h, w)).astype(np.uint8)
        lab[0, 0] = 11
        _save(root / "images" / f"f{i}.png", rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        _save(root / "labels" / f"f{i}.png", lab)
        labels.append(lab)
    return labels


def test_label_folder_reads_class_ids_at_the_label_resolution(tmp_path):
    labels = _label_folder(tmp_path)
    ds = LabelFolder(tmp_path, num_classes=3, ignore_index=11, class_names=["a", "b", "c"])
    assert ds.task == "multiclass" and ds.num_classes == 3 and ds.class_names == ("a", "b", "c")
    assert len(ds) == 2 and ds.names() == ["f0", "f1"]
    s = ds[1]
    assert s.image.size == (8, 6) and s.target.shape == (6, 8) and s.target.dtype == np.int64
    want = labels[1].astype(np.int64)
    want[want == 11] = 255  # the file's ignore value becomes the project's 255
    np.testing.assert_array_equal(s.target, want)
    # size and crop knobs
    sized = LabelFolder(tmp_path, num_classes=3, ignore_index=11, size=(3, 4))
    np.testing.assert_array_equal(sized[1].target, resize_nearest(want, (3, 4)))
    cropped = LabelFolder(tmp_path, num_classes=3, ignore_index=11, crop="center")
    assert cropped[1].image.size == (6, 6)
    box = center_crop_box(8, 6)
    np.testing.assert_array_equal(cropped[1].target, want[box[1]:box[3], box[0]:box[2]])
    pickle.loads(pickle.dumps(ds))


def test_label_folder_colour_table(tmp_path):
    colors = [(128, 128, 128), (128, 0, 0), (0, 0, 192)]
    ids = np.array([[0, 1, 2, 3], [2, 2, 1, 0]])
    table = np.array([*colors, (0, 0, 0)], dtype=np.uint8)
    _save(tmp_path / "images" / "a.jpg", np.zeros((2, 4, 3), np.uint8))
    _save(tmp_path / "labels" / "a.png", table[ids])
    ds = LabelFolder(tmp_path, num_classes=3, colors=colors, ignore_color=(0, 0, 0))
    assert ds[0].target.tolist() == [[0, 1, 2, 255], [2, 2, 1, 0]]
    with pytest.raises(ValueError, match=r"a.png: .*neither a class nor ignore_color: \[\(0, 0, 0\)\]"):
        LabelFolder(tmp_path, num_classes=3, colors=colors)[0]
    with pytest.raises(ValueError, match="3 RGB triples"):
        LabelFolder(tmp_path, num_classes=3, colors=colors[:2])
    with pytest.raises(ValueError, match="needs colors"):
        LabelFolder(tmp_path, num_classes=3, ignore_color=(0, 0, 0))


def test_label_folder_bad_input(tmp_path):
    root = tmp_path / "set"
    _label_folder(root)
    # a label with no image
    _save(root / "labels" / "orphan.png", np.zeros((6, 8), np.uint8))
    with pytest.raises(ValueError, match=r"labels/orphan.png: a label with no image"):
        LabelFolder(root, num_classes=3, ignore_index=11)
    (root / "labels" / "orphan.png").unlink()
    # an image with no label
    _save(root / "images" / "lonely.png", np.zeros((6, 8, 3), np.uint8))
    with pytest.raises(ValueError, match=r"images/lonely.png: an image with no label"):
        LabelFolder(root, num_classes=3, ignore_index=11)
    (root / "images" / "lonely.png").unlink()
    # a size mismatch
    _save(root / "labels" / "f1.png", np.zeros((5, 8), np.uint8))
    ds = LabelFolder(root, num_classes=3, ignore_index=11)
    ds[0]
    with pytest.raises(ValueError, match=r"f1.png: labels are 8x5, the image .*f1.png is 8x6"):
        ds[1]
    # a value that is neither a class nor the ignore index
    bad = np.zeros((6, 8), np.uint8)
    bad[2, 3] = 7
    _save(root / "labels" / "f1.png", bad)
    with pytest.raises(ValueError, match=r"f1.png: expected a label PNG with class ids 0..2 and 11 .*values \[7\]"):
        ds[1]
    # knobs
    with pytest.raises(ValueError, match="ignore_index"):
        LabelFolder(root, num_classes=3, ignore_index=2)
    with pytest.raises(ValueError, match="class_names has 2 names"):
        LabelFolder(root, num_classes=3, ignore_index=11, class_names=["a", "b"])
    with pytest.raises(ValueError, match="crop"):
        LabelFolder(root, num_classes=3, ignore_index=11, crop="left")
    with pytest.raises(FileNotFoundError, match="labels of a label-folder"):
        LabelFolder(root, num_classes=3, labels_dir="nope")


def test_camvid_dev(shared_dir):
    """The shared CamVid split through configs/dataset/camvid.yaml (reads 3 items)."""
    from hydra import compose, initialize_config_module
    from hydra.utils import instantiate

    root = shared_dir / "data" / "camvid-dev"
    if not (root / "images").is_dir():
        pytest.skip(f"{root} is missing")
    with initialize_config_module("segment.configs", version_base="1.3"):
        cfg = compose("eval", overrides=["dataset=camvid", f"dataset.root={root}"])
    ds = instantiate(cfg.dataset)
    assert len(ds) == 101 and ds.num_classes == 11 and ds.class_names[3] == "road"
    for i in (0, 50, 100):
        s = ds[i]
        assert s.image.size == (480, 360) and s.target.shape == (360, 480)
        vals = set(np.unique(s.target).tolist())
        assert vals <= set(range(11)) | {255} and len(vals & set(range(11))) >= 4


# ---------------------------------------------------------------- BSDS500


def write_bsds_mat(path: Path, segs: list[np.ndarray]) -> None:
    """A ground-truth file with BSDS500's layout: groundTruth = (1, K) cell of structs with
    Segmentation (uint16 ids from 1) and Boundaries."""
    import scipy.io

    cell = np.empty((1, len(segs)), dtype=object)
    for k, s in enumerate(segs):
        cell[0, k] = {"Segmentation": s.astype(np.uint16), "Boundaries": np.zeros(s.shape, bool)}
    path.parent.mkdir(parents=True, exist_ok=True)
    scipy.io.savemat(str(path), {"groundTruth": cell})


def make_bsds(root: Path, layout: dict[str, list[tuple[str, int, int, int]]], seed: int = 0) -> Path:
    """``layout``: split -> [(stem, H, W, annotators)]; random photos and segmentations."""
    rng = np.random.default_rng(seed)
    for split, items in layout.items():
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        for stem, h, w, k in items:
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / "images" / split / f"{stem}.jpg")
            write_bsds_mat(root / "groundTruth" / split / f"{stem}.mat",
                           [rng.integers(1, 2 + j, (h, w)) for j in range(k)])
    return root


def test_bsds_reads_splits_and_several_annotators(tmp_path):
    import scipy.io

    from segment.datasets.bsds import BSDS500

    root = make_bsds(tmp_path / "bsds", {"train": [("20", 6, 9, 3), ("10", 9, 6, 5)], "val": [("7", 6, 9, 4)]})
    val = BSDS500(root)  # default split: val
    assert len(val) == 1 and val.name(0) == "val/7" and val.task == "regions"
    s = val[0]
    assert s.image.size == (9, 6) and s.target.shape == (4, 6, 9) and s.target.dtype == np.int32
    gt = scipy.io.loadmat(str(root / "groundTruth" / "val" / "7.mat"))["groundTruth"]
    for k in range(4):  # the annotators in file order, values as stored
        assert np.array_equal(s.target[k], gt[0, k]["Segmentation"][0, 0])
    both = BSDS500(root, split="all")  # every split folder present (no test/ here)
    assert both.names() == ["train/10", "train/20", "val/7"] and both.splits == ["train", "val"]
    assert both[0].target.shape == (5, 9, 6)  # portrait, 5 annotators
    assert BSDS500(root, split=["val", "train"]).names() == ["val/7", "train/10", "train/20"]
    assert BSDS500(root, split="train,val").names() == both.names()
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        BSDS500(root, split="dev")
    with pytest.raises(FileNotFoundError, match=r"test photos"):
        BSDS500(root, split="test")


def test_bsds_errors_name_the_file(tmp_path):
    from segment.datasets.base import DataError
    from segment.datasets.bsds import BSDS500

    root = make_bsds(tmp_path / "bsds", {"val": [("1", 6, 9, 2), ("2", 6, 9, 2), ("3", 6, 9, 2), ("4", 6, 9, 2)]})
    gt = root / "groundTruth" / "val"
    (gt / "2.mat").write_bytes(b"MATLAB 5.0 MAT-file, truncated")  # corrupt
    write_bsds_mat(gt / "3.mat", [np.ones((9, 6), int), np.ones((9, 6), int)])  # transposed: size mismatch
    import scipy.io

    scipy.io.savemat(str(gt / "4.mat"), {"other": np.zeros(3)})  # no groundTruth cell
    ds = BSDS500(root)
    assert ds[0].target.shape == (2, 6, 9)
    for i, what in ((1, r"2\.mat: expected a BSDS500 ground-truth \.mat .* that scipy\.io\.loadmat can read"),
                    (2, r"3\.mat: the human segmentations are 6x9, the photo .*3\.jpg is 9x6"),
                    (3, r"4\.mat: expected a BSDS500 ground-truth \.mat .*no groundTruth cell \(variables: other\)")):
        with pytest.raises(DataError, match=what) as e:
            ds[i]
        assert "\n" not in str(e.value)
    (gt / "1.mat").unlink()
    with pytest.raises(FileNotFoundError, match=r"1\.mat: expected the ground truth of .*1\.jpg"):
        BSDS500(root)


def test_bsds_dev(shared_dir):
    """The shared BSDS500 train + val through configs/dataset/bsds.yaml (reads 2 items)."""
    from hydra import compose, initialize_config_module
    from hydra.utils import instantiate

    root = shared_dir / "data" / "bsds-dev"
    if not (root / "images").is_dir():
        pytest.skip(f"{root} is missing")
    with initialize_config_module("segment.configs", version_base="1.3"):
        cfg = compose("eval", overrides=["dataset=bsds", f"dataset.root={root}", "dataset.split=all"])
    ds = instantiate(cfg.dataset)
    assert len(ds) == 300 and ds.names()[:1] == ["train/100075"] and ds.names()[-1].startswith("val/")
    for i in (0, 299):
        s = ds[i]
        assert s.target.shape[1:] == (s.image.size[1], s.image.size[0]) and {s.image.size} <= {(481, 321), (321, 481)}
        assert 4 <= s.target.shape[0] <= 9 and s.target.min() >= 1
