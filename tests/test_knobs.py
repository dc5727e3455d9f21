"""Every knob of every method config (``configs/method/*.yaml``, plus the dataclass fields a
user can add with ``+method.KNOB=``) changes what the method computes or is refused with a
clear error. A knob that silently does nothing is a bug.

The test is generic: it reads the knobs from the configs and the method classes, so knobs
and methods added later are covered without editing it. For each knob it tries values
around the default (string knobs: every value the error for a bad value lists) on a real
record: a seeded tiny ViT whose attention is sharpened so that seed-and-grow finds regions
in a blocky image (and the tiny FLUX for methods that need a DiT). A knob passes when some
value changes the output (heatmap, labels or foreground) or what the method asks the backbone
to capture (``Capture``: e.g. ``average_layers`` of CLS attention only saves memory), or
when every value is refused; a value tried must either run or be refused with a
``ValueError`` (any other exception fails), and a bad string must be refused at
construction with an error that names the knob and lists the accepted values.

Knobs that matter only together with another one (``seed_stride`` needs ``seeds: grid``)
are retried with each other knob moved off its default. Where such a knob cannot act it must
be refused, not ignored: with the real DINOv2 weights (whose attention, unlike the tiny
models', leaves no knob idle by accident), every knob must change the output or be refused
with the other knobs at their defaults and with each switch (a string or boolean knob) moved
off its default, one at a time (``num_seeds`` with ``seeds: grid`` is refused).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hydra.utils import get_class
from omegaconf import OmegaConf
from PIL import Image
from segment.eval.specs import compose_method

from segment.core.record import Capture

REPO = Path(__file__).resolve().parents[1]
METHODS = sorted(p.stem for p in (REPO / "configs" / "method").glob("*.yaml"))
BOGUS = "no_such_value"
# the protocol's ConceptAttention layers (14-17) do not exist in the 4-block tiny FLUX
FIT = {"concept_attention": {"layers": [0, 1]}}
PROMPTS = ["dog"]


def blocky_images() -> list[Image.Image]:
    """A 112 x 112 photo (8 x 8 tokens of 14 px) of flat colour blocks with mild noise: a red
    left half holding a one-token green speck, a yellow right half holding two separate
    blue squares (one colour, two connected components)."""
    t = 14
    a = np.zeros((112, 112, 3))
    a[:, : 4 * t] = (0.9, 0.1, 0.1)
    a[3 * t: 4 * t, t: 2 * t] = (0.1, 0.8, 0.1)
    a[:, 4 * t:] = (0.9, 0.9, 0.1)
    a[t: 3 * t, 5 * t: 7 * t] = (0.1, 0.2, 0.9)
    a[5 * t: 7 * t, 5 * t: 7 * t] = (0.1, 0.2, 0.9)
    a = a + 0.05 * np.random.default_rng(0).random(a.shape)
    return [Image.fromarray((255 * a.clip(0, 1)).astype(np.uint8))]


class Backbones:
    """The tiny backbones, built on first use; one record per distinct capture."""

    def __init__(self) -> None:
        self.weights: Path | None = None  # the real DINOv2 checkpoint (kind "real")
        self.models: dict[str, Any] = {}
        self.pixels: dict[str, torch.Tensor] = {}
        self.records: dict[tuple[str, Capture], Any] = {}
        self.outcomes: dict[tuple, Outcome | str] = {}

    def model(self, kind: str) -> Any:
        if kind not in self.models:
            from hydra import compose, initialize_config_module
            from hydra.utils import instantiate

            over = {"vit": ["model=vit_tiny_random", "model.image_size=112"],
                    "flux": ["model=flux_tiny"],
                    "real": ["model=dinov2_vits14", f"model.checkpoint='{self.weights}'"]}[kind]
            with initialize_config_module("segment.configs", version_base="1.3"):
                cfg = compose("segment", overrides=[*over, "device=cpu"])
            torch.manual_seed(0)
            model = instantiate(cfg.model)
            if kind == "vit":  # random init attends almost uniformly: sharpen it
                with torch.no_grad():
                    for blk in model.model.blocks:
                        blk.attn.qkv.weight.mul_(8.0)
            self.models[kind] = model
            self.pixels[kind] = model.collate(
                [Image.open(REPO / "datasets" / "examples" / "chelsea.png").convert("RGB")]
                if kind == "real" else blocky_images())
        return self.models[kind]

    def record(self, kind: str, capture: Capture) -> Any:
        key = (kind, capture)
        if key not in self.records:
            model = self.model(kind)
            with torch.inference_mode():
                self.records[key] = model.extract(self.pixels[kind], capture, prompts=PROMPTS)
        return self.records[key]


@pytest.fixture(scope="module")
def backbones() -> Backbones:
    return Backbones()


@dataclass
class Outcome:
    """What a method configuration did: its capture and its output."""

    capture: Capture
    tensors: tuple[torch.Tensor | None, ...]

    def same(self, other: Outcome) -> bool:
        if self.capture != other.capture:
            return False
        for a, b in zip(self.tensors, other.tensors):
            if (a is None) != (b is None):
                return False
            if a is not None and (a.shape != b.shape or not torch.equal(a, b)):
                return False
        return True


def attempt(cls: type, values: dict[str, Any], bb: Backbones, kind: str) -> Outcome | str:
    """Build and run one configuration; a ``ValueError`` is a refusal (returned as text),
    any other exception fails the test. Memoised per backbone and configuration."""
    key = (cls, kind, repr(sorted(values.items())))
    if key not in bb.outcomes:
        bb.outcomes[key] = _attempt(cls, values, bb, kind)
    return bb.outcomes[key]


def _attempt(cls: type, values: dict[str, Any], bb: Backbones, kind: str) -> Outcome | str:
    try:
        method = cls(**values)
    except ValueError as e:
        return f"refused: {e}"
    try:
        model = bb.model(kind)
        cap = method.capture(model.num_layers)
        with torch.inference_mode():
            out = method(bb.record(kind, cap))
    except ValueError as e:
        return f"refused when run: {e}"
    return Outcome(cap, (out.heatmap, out.labels, out.foreground, out.leaves))


def method_knobs(name: str) -> tuple[type, dict[str, Any], list[str]]:
    """The method class, every knob's value (config over dataclass default), the knobs."""
    node = OmegaConf.to_container(compose_method(name), resolve=True)
    cls = get_class(node.pop("_target_"))
    values: dict[str, Any] = {}
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            if f.default is not dataclasses.MISSING:
                values[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                values[f.name] = f.default_factory()
    values.update(node)
    values.update(FIT.get(name, {}))
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
    return cls, values, [k for k in values if k != "name"]


def _unique(xs: list[Any], default: Any) -> list[Any]:
    out = []
    for x in xs:
        if x != default and x not in out:
            out.append(x)
    return out


def candidates(cls: type, values: dict[str, Any], knob: str) -> list[Any]:
    """Values to try for ``knob`` (string knobs: asserts a bad value is refused clearly and
    returns the accepted values its error lists)."""
    v = values[knob]
    if isinstance(v, str):
        try:
            cls(**{**values, knob: BOGUS})
        except ValueError as e:
            msg = str(e)
        else:
            pytest.fail(f"{cls.__name__}({knob}={BOGUS!r}) was accepted: validate {knob}")
        assert knob in msg, f"the error for a bad {knob} does not name it: {msg}"
        alts = [a for a in re.findall(r"'([^']+)'", msg) if a != BOGUS]
        if not alts:  # "must be a/b/c"
            m = re.search(r"must be ((?:\w+/)+\w+)", msg)
            alts = m.group(1).split("/") if m else []
        assert alts, f"the error for a bad {knob} should list the accepted values: {msg}"
        return _unique(alts, v)
    if isinstance(v, bool):
        return [not v]
    if isinstance(v, int):
        return _unique([v - 1, v + 1, v // 2, 2 * v, 10 * v, 0, 1, -1], v)
    if isinstance(v, float):
        return _unique([v / 2, 2 * v, v / 10, 10 * v, 0.0, 0.5, 1.0, -1.0], v)
    if v is None:  # layer selections: null = all
        return [[-1], [0], [0, -1], 0]
    if isinstance(v, list) and all(isinstance(i, int) for i in v):
        return _unique([[i - 1 for i in v], [0], [*v, min(v) - 1], None, []], v)
    pytest.fail(f"{cls.__name__}.{knob}: no test values for a knob of type {type(v).__name__}")


def _changes(cls, values, knob, cands, bb, kind, base: Outcome) -> tuple[bool, list[str]]:
    notes = []
    alive = False
    for c in cands:
        got = attempt(cls, {**values, knob: c}, bb, kind)
        if isinstance(got, str):
            notes.append(f"{c!r}: {got}")
        elif got.same(base):
            notes.append(f"{c!r}: same output and capture")
        else:
            alive = True
            break
    return alive, notes


def _stems(knob: str) -> set[str]:
    return {part[:4] for part in knob.split("_") if len(part) >= 3}


def _dead_knobs(cls, values, knobs, cands, bb, kind, base: Outcome, skip: str | None = None
                ) -> dict[str, list[str]]:
    """Knobs some of whose values run but change neither the output nor the capture, while
    none changes them: with ``values`` as the other settings, they are silently ignored."""
    dead: dict[str, list[str]] = {}
    for knob in knobs:
        if knob == skip:
            continue
        alive, notes = _changes(cls, values, knob, cands[knob], bb, kind, base)
        if not alive and not all("refused" in n for n in notes):  # refused outright: fine
            dead[knob] = notes
    return dead


def _switch_contexts(values: dict[str, Any], knobs: list[str], cands: dict[str, list[Any]]
                     ) -> list[tuple[str, Any]]:
    """``(knob, value)`` moves off the defaults: switches (string, boolean) first."""
    out = [(k, c) for k in knobs for c in cands[k] if isinstance(values[k], (str, bool))]
    return out + [(k, c) for k in knobs for c in cands[k] if not isinstance(values[k], (str, bool))]


@pytest.mark.slow
@pytest.mark.parametrize("name", METHODS)
def test_every_knob_changes_the_output_or_is_refused(name, backbones):
    cls, values, knobs = method_knobs(name)
    errors = {}
    kind = base = None
    for k in ("vit", "flux"):  # the first backbone the default runs on (ConceptAttention: a DiT)
        got = attempt(cls, values, backbones, k)
        if isinstance(got, Outcome):
            kind, base = k, got
            break
        errors[k] = got
    assert base is not None, f"{name}: the default config runs on no tiny backbone: {errors}"

    cands = {k: candidates(cls, values, k) for k in knobs}
    dead = _dead_knobs(cls, values, knobs, cands, backbones, kind, base)
    contexts = _switch_contexts(values, knobs, cands)
    for knob in list(dead):
        # related knobs first (seed_stride, num_seeds -> seeds): a cheap, generic ordering
        ordered = sorted(contexts, key=lambda kv: not _stems(kv[0]) & _stems(knob))
        for other, val in ordered:
            if other == knob:
                continue
            ctx = {**values, other: val}
            ctx_base = attempt(cls, ctx, backbones, kind)
            if isinstance(ctx_base, str):
                continue
            if _changes(cls, ctx, knob, cands[knob], backbones, kind, ctx_base)[0]:
                del dead[knob]
                break
    assert not dead, f"{name}: knobs that change neither the output nor the capture: {dead}"


VIT_METHODS = [m for m in METHODS if m != "concept_attention"]  # (a DiT's: text prompts)


@pytest.mark.slow
@pytest.mark.parametrize("name", VIT_METHODS)
def test_no_knob_is_ignored_where_it_cannot_act(name, backbones, dinov2_weights):
    """Real attention (DINOv2 ViT-S/14, a bundled photo, 224 px): with the other knobs at their
    defaults, and with each switch moved off its default, every knob changes the output or
    the capture with some value, or every value is refused (``seed_stride=4`` without
    ``seeds: grid`` is refused, not ignored)."""
    backbones.weights = dinov2_weights
    cls, values, knobs = method_knobs(name)
    base = attempt(cls, values, backbones, "real")
    assert isinstance(base, Outcome), base
    cands = {k: candidates(cls, values, k) for k in knobs}
    dead = {"defaults": _dead_knobs(cls, values, knobs, cands, backbones, "real", base)}
    for switch in knobs:
        if not isinstance(values[switch], (str, bool)):
            continue
        for val in cands[switch]:
            ctx = {**values, switch: val}
            ctx_base = attempt(cls, ctx, backbones, "real")
            if isinstance(ctx_base, str):
                continue
            ctx_cands = {k: [c for c in cands[k] if c != ctx[k]] for k in knobs}
            dead[f"{switch}={val!r}"] = _dead_knobs(cls, ctx, knobs, ctx_cands, backbones, "real",
                                                    ctx_base, skip=switch)
    dead = {ctx: d for ctx, d in dead.items() if d}
    assert not dead, (
        f"{name}: knobs ignored (neither output nor capture changes, not refused) with the"
        f" other knobs at their defaults or one switch moved; refuse them there: {dead}"
    )


def test_conditional_knobs_keep_their_config_defaults():
    """A knob that acts only with another setting is refused when it is off its dataclass
    default without that setting; the config must keep it at that default, or the shipped
    config itself would be refused."""
    from segment.methods import RegionGrow

    cls, values, _ = method_knobs("regions")
    assert cls is RegionGrow
    defaults = {f.name: f.default for f in dataclasses.fields(RegionGrow)}
    conditional = [knob for knob, _, _ in RegionGrow()._conditional_knobs()]
    assert {"seed_stride", "num_seeds", "min_area", "sigma_color"} <= set(conditional)
    for knob in conditional:
        assert values[knob] == defaults[knob], knob


def test_a_knob_without_its_setting_is_refused_by_name():
    """The user's view: ``seed_stride`` with ``seeds: auto`` is refused with a message that
    names the knob, the setting it needs and its default; with that setting it runs."""
    from segment.methods import Bounce, ClsAttention, RegionGrow

    with pytest.raises(ValueError, match=r"seed_stride=4 .* only with seeds=grid.* default 2"):
        RegionGrow(seed_stride=4)
    RegionGrow(seeds="grid", seed_stride=4)
    with pytest.raises(ValueError, match=r"num_seeds=32 .* only with seeds=tokenrank"):
        RegionGrow(seeds="grid", num_seeds=32)
    with pytest.raises(ValueError, match=r"sigma_color=0.2 .* refine_steps >= 1"):
        RegionGrow(refine_steps=0, sigma_color=0.2)
    with pytest.raises(ValueError, match=r"min_area=0.01 .* connectivity=true"):
        RegionGrow(connectivity=False, min_area=0.01)
    with pytest.raises(ValueError, match=r"key_weight=0.3 .* chain=mix"):
        RegionGrow(chain="keys", key_weight=0.3)
    RegionGrow(chain="attention", score="keychain", key_temperature=0.1)  # the score's chain
    with pytest.raises(ValueError, match=r"key_temperature=0.1 .* score=keychain"):
        RegionGrow(chain="attention", score="cls", key_temperature=0.1)
    with pytest.raises(ValueError, match=r"heads='lambda2' .* concatenated keys of all heads"):
        RegionGrow(chain="keys", key_fuse="concat", heads="lambda2")
    RegionGrow(chain="mix", key_fuse="concat", heads="lambda2")  # weighs the attention part
    for cls in (ClsAttention, Bounce):
        with pytest.raises(ValueError, match=r"average_layers=true has no effect with one layer"):
            cls(layers=[-1], average_layers=True)
        cls(layers=[-2, -1], average_layers=True)


def test_the_knob_test_catches_a_dead_knob(backbones):
    """The machinery itself: a knob the method ignores is reported."""
    from segment.methods import ClsAttention

    @dataclass(frozen=True)
    class Ignores(ClsAttention):
        gain: float = 1.0  # never read

    values = {"layers": [-1], "heads": "mean", "average_layers": False, "gain": 1.0}
    base = attempt(Ignores, values, backbones, "vit")
    assert isinstance(base, Outcome)
    alive, notes = _changes(Ignores, values, "gain", candidates(Ignores, values, "gain"),
                            backbones, "vit", base)
    assert not alive and all("same output" in n for n in notes)
    alive, _ = _changes(Ignores, values, "heads", candidates(Ignores, values, "heads"),
                        backbones, "vit", base)
    assert alive


def test_the_default_method_shows_at_most_eight_knobs_and_its_dataclass_is_the_recipe():
    """Issue 46: the default method (``cuts``) shows at most 8 knobs, and its dataclass
    defaults are the recipe: ``EscapeCuts()`` computes what ``method=cuts`` does."""
    from segment.methods import EscapeCuts
    from segment.run.front.compose import compose

    assert compose("segment", []).method._target_ == "segment.methods.EscapeCuts"
    node = OmegaConf.to_container(compose_method("cuts"), resolve=True)
    node.pop("_target_")
    shown = [k for k in node if k != "name"]
    assert len(shown) <= 8, shown
    defaults = {f.name: f.default for f in dataclasses.fields(EscapeCuts)}
    for knob, value in node.items():
        want = list(defaults[knob]) if isinstance(defaults[knob], tuple) else defaults[knob]
        assert value == want, knob
    # every dataclass knob is shown (average_layers is not one: the layers are averaged)
    assert set(defaults) == set(node)
