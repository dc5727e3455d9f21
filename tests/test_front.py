"""The front door of `segment` and `segment-eval` (segment.run.front), as subprocesses: exit
codes, unknown keys with a suggestion, unwritable outputs in one line, nothing left behind
when a run cannot start, the offline failure, --help."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import interrupt_when, popen_interruptible
from PIL import Image

from segment.run.front.compose import config_names, suggest
from segment.run.front.help import help_text

BIN = Path(sys.executable).parent
TINY = ["model=vit_tiny_random", "device=cpu", "progress=false"]


def run(cmd: str, *args: str, cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    e = dict(os.environ, OMP_NUM_THREADS="2")
    e.pop("HYDRA_FULL_ERROR", None)
    e.update(env or {})
    return subprocess.run([str(BIN / cmd), *args], capture_output=True, text=True, timeout=timeout, env=e, cwd=cwd)


def _one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    text = r.stdout + r.stderr
    assert "Traceback" not in text, text
    lines = [ln for ln in text.splitlines() if all(n in ln for n in needles)]
    assert len(lines) == 1, (needles, text)
    return lines[0]


def _nothing_created(cwd: Path) -> None:
    assert sorted(p.name for p in cwd.iterdir()) == [], sorted(cwd.rglob("*"))


def _folder(root: Path, n: int, masks: bool = False) -> Path:
    (root / "images").mkdir(parents=True)
    if masks:
        (root / "masks").mkdir()
    for i in range(n):
        a = np.full((48, 56, 3), 30, np.uint8)
        a[12:36, 14:42] = (200, 120 + i % 100, 60)
        Image.fromarray(a).save(root / "images" / f"{i:03d}.png")
        if masks:
            m = np.zeros((48, 56), np.uint8)
            m[12:36, 14:42] = 255
            Image.fromarray(m).save(root / "masks" / f"{i:03d}.png")
    return root


# ----------------------------------------------------------------------------- suggestions


def test_suggest():
    keys = ["batch_size", "model.checkpoint", "model.image_size", "method.steps"]
    assert suggest("batchsize", keys) == " (did you mean 'batch_size'?)"
    assert suggest("model.checkpont", keys) == " (did you mean 'model.checkpoint'?)"
    assert suggest("checkpont", keys) == " (did you mean 'model.checkpoint'?)"
    assert suggest("zzz", keys) == ""


@pytest.mark.parametrize("cmd", ["segment", "segment-eval"])
@pytest.mark.parametrize("arg,key,hint", [
    ("batchsize=4", "'batchsize'", "'batch_size'"),
    ("+batchsize=4", "'batchsize'", "'batch_size'"),  # Hydra would add it and ignore it
    ("++batchsize=4", "'batchsize'", "'batch_size'"),
    ("model.checkpont=/w.pt", "'model.checkpont'", "'model.checkpoint'"),
    ("+model.checkpont=/w.pt", "'model.checkpont'", "'model.checkpoint'"),
    ("model=dinov2_vits41", "'dinov2_vits41'", "'dinov2_vits14'"),
    ("method=regoins", "'regoins'", "'regions'"),
])
def test_unknown_keys_exit_2_with_a_suggestion(tmp_path, cmd, arg, key, hint):
    extra = ["dataset.root=/nowhere"] if cmd == "segment-eval" else []
    r = run(cmd, arg, *extra, cwd=tmp_path)
    line = _one_line_error(r, key)
    assert f"did you mean {hint}?" in line and line.startswith(f"{cmd}: ")
    _nothing_created(tmp_path)


_WRONG_TYPE = [  # either command
    ("method.escape=oops", "expected a number (the default is 0.5)"),
    ("batch_size=abc", "expected a number (the default is"),
    ("model.image_size=[33a,448]", "expected a number (the default is 224)"),
    ("method.refine_steps=2.5", "expected a whole number (the default is 3)"),
]


@pytest.mark.parametrize("cmd,arg,why", [
    *[(cmd, arg, why) for cmd in ("segment", "segment-eval") for arg, why in _WRONG_TYPE],
    # settings whose default is null (auto) are whole numbers with a lowest value
    ("segment", "max_pixels=abc", "expected a whole number >= 1 (the default is null)"),
    ("segment", "max_pixels=-5", "expected a whole number >= 1 (the default is null)"),
    ("segment", "num_workers=abc", "expected a whole number >= 0 (the default is null)"),
    ("segment", "min_size=2.5", "expected a whole number >= 0 (the default is null)"),
    ("segment", "batch_size=0", "expected a whole number >= 1 (the default is 8)"),
    ("segment-eval", "limit=abc", "expected a whole number >= 1 (the default is null)"),
    ("segment-eval", "limit=0", "expected a whole number >= 1 (the default is null)"),
    ("segment-eval", "panels=-1", "expected a whole number >= 0 (the default is 4)"),
    ("segment-eval", "bootstrap=-3", "expected a whole number >= 0 (the default is 1000)"),
    # a list of layer indices given a word or one number
    ("segment", "method.layers=abc", "expected a number or a list of numbers, e.g. [-1] (the default is [-1])"),
    ("segment-eval", "method.layers=[a]", "expected a number or a list of numbers, e.g. [-1]"),
    ("segment", "method.layers=[-1.5]", "expected whole numbers, e.g. [-1]"),
    ("segment", "batch_size=2.0", "expected a whole number >= 1 (the default is 8)"),
    ("segment", "min_size=-1", "expected a whole number >= 0 (the default is null)"),
    ("segment", "retry_skipped=maybe", "expected true or false (the default is false)"),
    # an empty input (an unset shell variable) is not "the bundled examples"
    ("segment", "input=", "empty; give a folder or an image, or leave out input= for the bundled examples"),
])
def test_a_value_of_the_wrong_type_or_range_is_named_in_one_line(tmp_path, cmd, arg, why):
    extra = ["dataset.root=/nowhere"] if cmd == "segment-eval" else []
    line = _one_line_error(run(cmd, arg, *extra, cwd=tmp_path), arg)
    assert line.startswith(f"{cmd}: {arg}: {why}"), line
    _nothing_created(tmp_path)


@pytest.mark.slow
def test_segment_eval_setup_errors_exit_2_in_one_line_and_leave_nothing(tmp_path):
    """Errors found when the run starts (no CUDA, a layer the model lacks) are settings
    errors: one line, exit 2, no output folder, as with `segment`."""
    import torch

    data = _folder(tmp_path / "data", 2, masks=True)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    common = [*TINY, f"dataset.root={data}", "dataset.size=[48,56]", "model.image_size=56", f"output={cwd / 'ev'}"]
    line = _one_line_error(run("segment-eval", *common, "method.layers=[20]", cwd=cwd), "layer 20")
    assert line.startswith("segment-eval: method 'cuts' cannot run on this model: layer 20 out of range"), line
    if not torch.cuda.is_available():
        line = _one_line_error(run("segment-eval", *[a for a in common if a != "device=cpu"], "device=cuda",
                                   cwd=cwd), "CUDA")
        assert line.startswith("segment-eval: bad settings: device='cuda'"), line
    _nothing_created(cwd)


def test_the_python_api_checks_values_like_the_command():
    from segment.run.api.segmenter import compose_config

    for kw, why in [(dict(escape="oops"), "escape='oops': expected a number (the default is 0.5)"),
                    (dict(method="regions", connectivity="no"), "connectivity='no': expected true or false"),
                    (dict(batch_size=0), "batch_size=0: expected a whole number >= 1 (the default is 8)"),
                    (dict(max_pixels=-5), "max_pixels=-5: expected a whole number >= 1 (the default is null)"),
                    (dict(layers="abc"), "layers='abc': expected a number or a list of numbers, e.g. [-1]")]:
        with pytest.raises(ValueError) as e:
            compose_config(**kw)
        assert str(e.value).startswith(why), (kw, str(e.value))
    cfg = compose_config(layers=(-2,), image_size=[336, 448], max_pixels=None, **{"method.escape": 0.1})
    assert list(cfg.method.layers) == [-2] and cfg.method.escape == 0.1
    assert compose_config(layers=-1).method.layers == -1  # one layer as a number, as before


def test_one_composition_for_the_commands_and_the_api():
    """front.compose is the one way to a config: Hydra's compose API on the installed configs,
    checked once. The API's config is its composition (a defaults list is followed, as
    the commands follow it), and an app's own Hydra (the @hydra.main job) is put back."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from segment.run.api.segmenter import compose_config
    from segment.run.front.compose import UsageError, compose

    cfg = compose("segment", ["model=flux_dev", "method=bounce", "batch_size=2"])
    api = compose_config("flux_dev", "bounce")
    assert "defaults" not in api.model and api.model.name == "flux_dev"
    for key in ("model", "method"):
        assert OmegaConf.to_container(api[key]) == OmegaConf.to_container(cfg[key])
    assert cfg.batch_size == 2 and api.batch_size == 8
    with pytest.raises(UsageError, match=r"unknown setting 'batchsize' \(did you mean 'batch_size'\?\)"):
        compose("segment", ["+batchsize=4"])
    with initialize_config_module("segment.configs", version_base="1.3"):  # as inside a job
        outer = GlobalHydra.instance().hydra
        assert compose("segment-eval", ["method=tokenrank"]).method.name == "tokenrank"
        assert GlobalHydra.instance().hydra is outer
        assert hydra_compose("diagnose").model.name == "dinov2_vits14"
    assert not GlobalHydra.instance().is_initialized()


def test_values_of_the_right_type_pass_the_check():
    from segment.run.front.compose import value_problem

    for default, value in [(0.2, 1), (0.2, 1e-1), (224, [336, 448]), (224, 448.0), (0.03, None),
                           (True, False), (True, 0), (8, "${oc.env:B}"), ("auto", "cpu"),
                           ([-1], [-2, -1]), ([-1], None), ([0], [3.0]), (None, "x")]:
        assert value_problem(default, value) is None, (default, value)
    assert value_problem(True, 2) == "expected true or false"
    assert value_problem(8, True) == "expected a number"
    assert value_problem([-1], "all") == "expected a number or a list of numbers, e.g. [-1]"
    assert value_problem([-1], -2) is None and value_problem([224, 224], 448) is None  # one number
    from segment.run.front.compose import run_value_problem

    assert run_value_problem("segment-eval", "panels", 4, None) is None  # null = 0 there
    assert run_value_problem("segment", "max_pixels", None, 2e8) is None  # a count written 2e8
    assert run_value_problem("segment", "min_size", None, 0) is None  # 0 = one patch
    assert run_value_problem("segment", "batch_size", 8, None) == "expected a whole number >= 1"


def test_a_sweep_without_multirun_is_hydras_one_line_error(tmp_path):
    line = _one_line_error(run("segment-eval", "batch_size=1,2", "dataset.root=/nowhere", cwd=tmp_path), "batch_size")
    assert "Ambiguous value" in line, line
    _nothing_created(tmp_path)


def test_groups_a_command_does_not_use(tmp_path):
    line = _one_line_error(run("segment", "dataset=folder", cwd=tmp_path), "dataset")
    assert "model, method" in line
    _one_line_error(run("segment", "experiment=vit_folder", cwd=tmp_path), "experiment")
    line = _one_line_error(run("segment-eval", "dataset=foldr", cwd=tmp_path), "foldr")
    assert "did you mean 'folder'" in line
    _nothing_created(tmp_path)


# ----------------------------------------------------------------------------- outputs


@pytest.mark.parametrize("cmd", ["segment", "segment-eval"])
def test_output_that_cannot_be_written(tmp_path, cmd):
    f = tmp_path / "file.txt"
    f.write_text("x")
    extra = ["dataset.root=/nowhere"] if cmd == "segment-eval" else []
    line = _one_line_error(run(cmd, f"output={f}", *extra, cwd=tmp_path), str(f))
    assert "is a file, not a folder" in line
    line = _one_line_error(run(cmd, f"output={f}/sub", *extra, cwd=tmp_path), str(f))
    assert "cannot be created" in line and "is a file" in line
    # a read-only place: a chmod 555 folder, or /sys for root (permissions do not stop root)
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        existing, new = ro, ro / "out"
    else:
        try:
            os.rmdir(tempfile.mkdtemp(dir="/sys/fs"))
            pytest.skip("/sys/fs is writable here: no read-only folder to test with as root")
        except OSError:
            existing, new = Path("/sys/fs"), Path("/sys/fs/segment-out")
    line = _one_line_error(run(cmd, f"output={existing}", *extra, cwd=tmp_path), str(existing))
    assert "is not writable" in line
    line = _one_line_error(run(cmd, f"output={new}", *extra, cwd=tmp_path), str(new))
    assert "cannot be created" in line and "not writable" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"] + (["ro"] if os.geteuid() else [])


@pytest.mark.slow
def test_segment_eval_exit_codes_and_no_stray_folders(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    r = run("segment-eval", *TINY, cwd=cwd)  # no dataset.root
    assert r.returncode == 2 and "dataset.root" in r.stderr, r.stderr
    r = run("segment-eval", *TINY, f"dataset.root={tmp_path / 'missing'}", cwd=cwd)
    assert r.returncode == 2 and "dataset.root: no such file or folder" in r.stderr, r.stderr
    _nothing_created(cwd)  # the default outputs/eval/DATE/TIME is gone again
    data = _folder(tmp_path / "data", 3, masks=True)
    r = run("segment-eval", *TINY, f"dataset.root={data}", "dataset.size=[48,56]", "model.image_size=56",
            "panels=1", cwd=cwd)
    assert r.returncode == 0, r.stderr
    (res,) = list((cwd / "outputs" / "eval").glob("*/*/results.json"))
    assert json.loads(res.read_text())[0]["images"] == 3


@pytest.mark.slow
def test_segment_eval_ctrl_c_exits_130(tmp_path):
    data = _folder(tmp_path / "data", 150, masks=True)
    out = tmp_path / "out"
    e = dict(os.environ, OMP_NUM_THREADS="2")
    proc = popen_interruptible([str(BIN / "segment-eval"), *TINY, f"dataset.root={data}", "dataset.size=[48,56]",
                             "model.image_size=56", "batch_size=2", "panels=0", f"output={out}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e, cwd=tmp_path)
    log = interrupt_when(proc, lambda: (out / "cache").is_dir() and any((out / "cache").glob("*/*.json")))
    assert proc.returncode == 130, log
    assert "interrupted" in log and "Traceback" not in log


@pytest.mark.slow
def test_segment_ends_by_printing_the_gallery(tmp_path):
    """Exit 0 and the gallery's path last; new keys under an open node (`+model.model_kwargs.X`,
    a timm argument) are allowed and reach the model; exit 1 when nothing could be segmented."""
    src = tmp_path / "in"
    src.mkdir()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(src / "a.png")
    r = run("segment", f"input={src}", f"output={tmp_path / 'o'}", *TINY, "+model.model_kwargs.qkv_bias=false",
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == f"gallery: {tmp_path / 'o' / 'index.html'}"
    cfg = json.loads((tmp_path / "o" / "run.json").read_text())["config"]
    assert cfg["model"]["model_kwargs"]["qkv_bias"] is False
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.png").write_text("no")
    r = run("segment", f"input={bad}", f"output={tmp_path / 'o2'}", *TINY, cwd=tmp_path)
    assert r.returncode == 1  # nothing could be segmented: the gallery lists why
    assert (tmp_path / "o2" / "index.html").is_file()


@pytest.mark.slow
def test_segment_failures_before_the_run_are_one_segment_line(tmp_path):
    """Missing input, no images, a checkpoint that does not exist: one ``segment: ...`` line
    each (not a logger line with a time stamp), exit 2, no traceback, nothing created (the
    first into the default output folder); the paths are checked before torch loads."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    empty = tmp_path / "empty"
    empty.mkdir()
    img = tmp_path / "one"
    img.mkdir()
    Image.fromarray(np.full((40, 40, 3), 90, np.uint8)).save(img / "a.png")
    for args, needle in (
        (["input=nope/"], "segment: input path 'nope' does not exist"),  # default output
        ([f"input={empty}", f"output={cwd / 'out'}"], "segment: no images found under"),
        ([f"input={img}", f"model.checkpoint={tmp_path / 'no.safetensors'}", f"output={cwd / 'out'}"],
         f"segment: model.checkpoint: no such file: {tmp_path / 'no.safetensors'}"),
    ):
        r = run("segment", *args, *TINY, cwd=cwd)
        line = _one_line_error(r, needle)
        assert line.startswith(needle) and "ERROR" not in r.stdout + r.stderr, (line, r.stdout, r.stderr)
        _nothing_created(cwd)


_CHECK_PATHS = """
import sys
from segment.run.front.command import check_paths
from segment.run.front.compose import UsageError, compose
for command, args, want in CASES:
    try:
        check_paths(command, compose(command, args))
    except UsageError as e:
        assert str(e) == want, (str(e), want)
    else:
        raise AssertionError(f"{command} {args}: no error")
check_paths("segment", compose("segment", []))  # the bundled examples, the hub weights
assert "torch" not in sys.modules, "the pre-check imported torch"
print("ok")
"""


def test_paths_are_checked_before_torch_loads(tmp_path):
    """The paths a command reads are checked on the composed config without importing torch
    (which with timm takes 4-8 s): a mistyped path fails at once."""
    nope, empty = tmp_path / "nope", tmp_path / "empty"
    (empty / ".hidden").mkdir(parents=True)
    (empty / ".hidden" / "a.png").write_bytes(b"")  # hidden folders are not read
    (empty / "notes.txt").write_text("x")
    cases = [
        ("segment", [f"input={empty}"],
         (f"no images found under '{empty}' (looked recursively for .jpg, .jpeg, .png, .webp,"
          " .bmp, .tif, .tiff; 1 other file ignored)")),
        ("segment", [f"input={nope}"], f"input path '{nope}' does not exist"),
        ("segment", [f"model.checkpoint={nope}.pt"], f"model.checkpoint: no such file: {nope}.pt"),
        ("segment", [f"model.checkpoint={tmp_path}"], f"model.checkpoint: no such file: {tmp_path}"),
        ("segment-eval", [], "dataset: set dataset.root (e.g. dataset.root=PATH)"),
        ("segment-eval", [f"dataset.root={nope}"], f"dataset.root: no such file or folder: {nope}"),
        ("segment-eval", ["experiment=token_masking", f"masking.input={nope}"],
         f"masking.input: input path '{nope}' does not exist"),
        ("segment-diagnose", [f"input={nope}"], f"input path '{nope}' does not exist"),
        ("segment-diagnose", ["compare=vit_tiny_random", f"compare_checkpoint={nope}"],
         f"compare_checkpoint: no such file: {nope}"),
        ("segment-diagnose", [f"compare_checkpoint={nope}"], f"compare_checkpoint={nope} needs compare=MODEL"),
    ]
    r = subprocess.run([sys.executable, "-c", f"CASES = {cases!r}\n" + _CHECK_PATHS],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_an_unexpected_error_in_a_job_is_one_line_unless_hydra_full_error(monkeypatch, capsys):
    import logging

    from segment.run.front import command as front

    def broken() -> int:
        return {}["model"]

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    assert front.job("segment-eval", broken) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == ["segment-eval: KeyError: 'model' (rerun with HYDRA_FULL_ERROR=1 for the traceback)"]
    def full() -> int:
        raise OSError(28, "No space left on device", "/out/results.json")

    assert front.job("segment-eval", full) == 1
    assert capsys.readouterr().err.splitlines() == [
        "segment-eval: cannot write: No space left on device (/out/results.json); rerun the same command "
        "to resume once it can be written"]
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(KeyError):
        front.job("segment-eval", broken)
    # the console formatter: errors as one command line, the rest as before
    fmt = front.OneLineErrors("segment", logging.Formatter("[%(levelname)s] %(message)s"))
    rec = lambda level, msg: logging.LogRecord("x", level, __file__, 1, msg, (), None)  # noqa: E731
    assert fmt.format(rec(logging.ERROR, "input path 'nope' does not exist")) == \
        "segment: input path 'nope' does not exist"
    assert fmt.format(rec(logging.INFO, "5 images")) == "[INFO] 5 images"


# ----------------------------------------------------------------------------- offline


@pytest.mark.parametrize("how", ["HF_HUB_OFFLINE", "unreachable"])
@pytest.mark.slow
def test_offline_fails_fast_with_one_message(tmp_path, how):
    """No cached weights, no hub: one line naming model.checkpoint=PATH and the cache,
    within seconds (the hub client alone retries for about a minute), nothing left."""
    env = {"HF_HOME": str(tmp_path / "hf"), "TORCH_HOME": str(tmp_path / "torch"), "HF_HUB_OFFLINE": "0",
           "HF_ENDPOINT": "https://huggingface.co"}
    if how == "HF_HUB_OFFLINE":
        env["HF_HUB_OFFLINE"] = "1"
    else:  # nothing listens on port 9 of this machine: connection refused at once
        env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    t0 = time.perf_counter()
    r = run("segment", "output=results/", "device=cpu", cwd=cwd, env=env)
    elapsed = time.perf_counter() - t0
    line = _one_line_error(r, "model.checkpoint=PATH")
    assert str(tmp_path / "hf" / "hub") in line
    assert ("HF_HUB_OFFLINE" in line) == (how == "HF_HUB_OFFLINE")
    assert elapsed < 45, elapsed  # includes importing torch on a loaded 2-core machine
    _nothing_created(cwd)
    if how == "HF_HUB_OFFLINE":
        return
    data = _folder(tmp_path / "data", 2, masks=True)  # segment-eval: the same message, exit 2, no folder
    r = run("segment-eval", f"dataset.root={data}", "device=cpu", cwd=cwd, env=env)
    line = _one_line_error(r, "model.checkpoint=PATH")
    assert line.startswith("segment-eval: cannot build the model") and str(tmp_path / "hf" / "hub") in line
    _nothing_created(cwd)


def test_cached_weights_need_no_network(tmp_path, monkeypatch):
    from huggingface_hub import constants
    from segment.models.vit import check_pretrained_reachable

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match="model.checkpoint=PATH") as e:
        check_pretrained_reachable("vit_small_patch14_dinov2.lvd142m", "dinov2_vits14")
    assert f"not in the cache {tmp_path} " in str(e.value) and "HF_HUB_OFFLINE" in str(e.value)
    repo = tmp_path / "models--timm--vit_small_patch14_dinov2.lvd142m"
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    (repo / "snapshots" / "abc" / "model.safetensors").write_bytes(b"x")
    check_pretrained_reachable("vit_small_patch14_dinov2.lvd142m", "dinov2_vits14")  # cached: no error


# ----------------------------------------------------------------------------- --help


@pytest.mark.parametrize("cmd,groups,absent", [
    ("segment", ("model", "method"), ("dataset", "experiment")),
    ("segment-eval", ("model", "method", "dataset", "experiment"), ()),
])
def test_help(tmp_path, cmd, groups, absent):
    r = run(cmd, "--help", cwd=tmp_path)
    assert r.returncode == 0 and "powered by Hydra" not in r.stdout
    text = r.stdout
    assert text == help_text(cmd).replace("$$", "$") + "\n"
    assert "Usage:" in text and f"  {cmd} " in text
    examples = text.split("Examples:")[1].split("\n\n")[0]
    assert sum(ln.startswith(f"  {cmd} ") for ln in examples.splitlines()) == 3
    assert "model.checkpoint=PATH" in text and "Exit codes: 0" in text
    if cmd == "segment":  # every run setting of configs/segment.yaml is listed
        assert "retry_skipped=false" in text and "3 the output folder is in use" in text
    if cmd == "segment-eval":
        assert "dataset.root=PATH" in text and "(required)" in text
    listed: dict[str, str] = {}
    for ln in text.split("Config groups (GROUP=NAME):")[1].split("\n\n")[0].splitlines():
        if not ln.strip():
            continue
        if ln.startswith("  ") and not ln.startswith("   "):
            listed[ln.split()[0]] = ln
        else:  # a wrapped continuation
            listed[list(listed)[-1]] += " " + ln.strip()
    assert all(len(ln) <= 100 for ln in text.splitlines() if not ln.startswith(f"  {cmd} ")), text
    assert set(listed) == set(groups)
    for g in groups:
        assert listed[g].split(None, 1)[1].replace(",", " ").split() == config_names(g)
    for g in absent:
        assert f"  {g} " not in text and f"{g}=" not in text
    _nothing_created(tmp_path)


def test_cached_weights_load_without_the_hub(tmp_path, monkeypatch, dinov2_weights):
    """Weights in the Hugging Face cache, hub unreachable: loaded from the cache in offline
    mode (no retries), the same weights as model.checkpoint=PATH."""
    import torch
    from huggingface_hub import constants
    from safetensors.torch import save_file
    from segment.models.vit import TimmViT

    ref = TimmViT("vit_small_patch14_dinov2.lvd142m", checkpoint=dinov2_weights, device="cpu")
    snap = tmp_path / "models--timm--vit_small_patch14_dinov2.lvd142m" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("abc")
    save_file({k: v.contiguous() for k, v in ref.model.state_dict().items()}, str(snap / "model.safetensors"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    t0 = time.perf_counter()
    got = TimmViT("vit_small_patch14_dinov2.lvd142m", device="cpu")
    assert time.perf_counter() - t0 < 30
    assert constants.HF_HUB_OFFLINE is False  # restored after loading
    sd, want = got.model.state_dict(), ref.model.state_dict()
    assert sd.keys() == want.keys() and all(torch.equal(sd[k], want[k]) for k in sd)


@pytest.mark.slow
def test_command_line_habits(tmp_path):
    """``segment PATH`` takes the one bare argument as ``input=``, a path with spaces
    included; ``limit=N`` segments the first N images and says so; a setting written as an
    option (``--input=...``, ``--batch_size 4``) or a second bare argument is one line naming
    the ``KEY=VALUE`` to write, not Hydra's usage text."""
    photos = _folder(tmp_path / "my photos", 3)
    r = run("segment", str(photos), f"output={tmp_path / 'out'}", "limit=2", *TINY, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    man = json.loads((tmp_path / "out" / "run.json").read_text())
    assert Path(man["input"]) == photos and man["counts"]["segmented"] == 2
    assert "limit=2: the first 2 of 3 images" in r.stdout + r.stderr
    assert sorted(p.name for p in (tmp_path / "out" / "masks" / "images").iterdir()) == ["000.png", "001.png"]
    line = _one_line_error(run("segment", f"--input={photos}", cwd=tmp_path), "settings are written")
    assert line == (f"segment: unknown option '--input={photos}': settings are written without"
                    f" dashes, as input={photos} (see segment --help)")
    assert "as batch_size=4 " in _one_line_error(run("segment", "--batch_size", "4", cwd=tmp_path),
                                                 "unknown option")
    assert "give a folder as input=PATH" in _one_line_error(run("segment", "a", "b", cwd=tmp_path), "one input")
    assert "input= both" in _one_line_error(run("segment", "a", "input=b", cwd=tmp_path), "both")
    assert "dataset.root=x" in _one_line_error(run("segment-eval", "x", cwd=tmp_path), "unexpected argument")
    assert "expected a whole number >= 1" in _one_line_error(run("segment", "limit=0", cwd=tmp_path), "limit=0")
    r = run("segment", "photos/", "--cfg", "job", cwd=tmp_path)  # Hydra's options keep their values
    assert r.returncode == 0 and "input: photos/" in r.stdout, r.stderr
