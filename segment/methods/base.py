"""The method interface and the helpers shared by the methods (see segment/methods/__init__.py)."""

from __future__ import annotations

import abc
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from torch import Tensor

from segment.core import markov
from segment.core.masks import MethodOutput
from segment.core.record import AttentionRecord, Capture, TokenLayout
from segment.core.reduce import fuse_layer

HEADS = ("mean", "lambda2")
FUSE = ("attention", "chain", "output")


# --------------------------------------------------------------------------------------
# helpers shared by the methods
# --------------------------------------------------------------------------------------


def start_distribution(record: AttentionRecord, num_tokens: int, dtype: torch.dtype,
                       device: torch.device) -> Tensor:
    """``(B, N)`` start mass: uniform over each image's query tokens (ViT: one-hot CLS)."""
    queries = record.queries()
    b = record.batch_size
    if len(queries) != b:
        raise ValueError(f"record has {len(queries)} query lists for a batch of {b}")
    s = torch.zeros(b, num_tokens, dtype=dtype, device=device)
    for i, q in enumerate(queries):
        idx = torch.as_tensor(list(q), dtype=torch.long, device=device)
        if idx.numel() == 0 or bool(((idx < 0) | (idx >= num_tokens)).any()):
            raise ValueError(
                f"query tokens of image {i} must lie in [0, {num_tokens}), got {list(q)}"
            )
        s[i, idx] = 1.0 / idx.numel()
    return s


class PerTensor:
    """Results memoised per tensor *object* (identity, never contents) while it lives.

    Several methods scored on one attention record (``segment-eval`` runs them all on the
    same capture) build the same patch chains and the same ``|lambda_2|``; the record's
    tensors are not modified in place, so a result computed from a tensor object is
    reused for as long as that object exists (entries go with it: weak references).
    """

    def __init__(self) -> None:
        self._d: dict[tuple[int, Any], tuple[weakref.ref, Any]] = {}

    def get(self, t: Tensor, key: Any, make: Callable[[], Any]) -> Any:
        k = (id(t), key)
        hit = self._d.get(k)
        if hit is not None and hit[0]() is t:
            return hit[1]
        value = make()
        d = self._d
        try:
            d[k] = (weakref.ref(t, lambda _, k=k: d.pop(k, None)), value)
        except TypeError:  # not weak-referenceable: no memo
            pass
        return value


CHAINS_OF = PerTensor()
LAMBDA2_OF = PerTensor()


def patch_chain(attn: Tensor, layout: TokenLayout) -> Tensor:
    """The chain over grid tokens: ``attn[..., grid, grid]`` with rows renormalised.

    Memoised per ``attn`` object (methods sharing a record share the chain; do not modify
    the result in place).

    Args:
        attn: ``(..., N, N)`` attention over ``[prefix][grid][suffix]``.
        layout: where the grid tokens are.

    Returns:
        ``(..., h*w, h*w)`` row-stochastic; rows that attended only to non-grid tokens
        become uniform.
    """
    g = layout.patches
    return CHAINS_OF.get(attn, (g.start, g.stop, g.step),
                          lambda: markov.strip_prefix(attn[..., g, g], 0, zero_rows="uniform"))


def mean_patch_chain(attn: Tensor, layout: TokenLayout) -> Tensor:
    """``(B, n, n)`` the mean over heads of :func:`patch_chain` of ``(B, H, N, N)``.

    Each head's grid block is renormalised and averaged in one pass over the attention
    (its row sums scale the block as it is added), never building the ``(B, H, n, n)``
    per-head chains; rows with no grid mass are uniform, as in :func:`patch_chain`.
    """
    g = layout.patches
    a = as_compute(attn[..., g, g])  # (B, H, n, n), a view when already float32
    b, h, n, _ = a.shape
    sums = a.sum(-1)  # (B, H, n)
    zero = sums <= 0
    tiny = ~zero & (sums < 1e-30)  # 1 / (H sum) would overflow: divided row by row below
    coef = torch.where(zero | tiny, torch.zeros_like(sums), 1.0 / (h * sums.clamp_min(1e-30)))
    out = torch.zeros(b, n, n, dtype=a.dtype, device=a.device)
    for k in range(h):
        out.addcmul_(a[:, k], coef[:, k].unsqueeze(-1))
    if bool(zero.any()):  # the uniform rows of heads that put no mass on the grid
        out += (zero.to(a.dtype).sum(1) / (h * n)).unsqueeze(-1)
    for bi, k, i in tiny.nonzero().tolist():
        out[bi, i] += a[bi, k, i] / sums[bi, k, i] / h
    return out


def grid_weights(chain: Tensor, heads: str) -> Tensor:
    """Head weights ``(B, H)`` from patch chains ``(B, H, n, n)``.

    ``"mean"``: ``1 / H``; ``"lambda2"``: ``|lambda_2,h| / sum_g |lambda_2,g|`` (protocol §1;
    ``|lambda_2|`` memoised per ``chain`` object).
    """
    b, h = chain.shape[:2]
    if heads == "mean":
        return torch.full((b, h), 1.0 / h, dtype=chain.dtype, device=chain.device)
    if heads == "lambda2":
        lam = LAMBDA2_OF.get(chain, None, lambda: markov.lambda2(chain)).to(chain.dtype)  # (B, H)
        return markov.head_weights(lam, "lambda2")
    raise ValueError(f"heads must be one of {HEADS}, got {heads!r}")


def grid_part(v: Tensor, layout: TokenLayout) -> Tensor:
    """``(..., N)`` token scores -> ``(..., h*w)`` grid part."""
    return v[..., layout.patches]


def renorm(v: Tensor) -> Tensor:
    """Normalise ``(..., n)`` to sum 1; an all-zero vector becomes uniform."""
    s = v.sum(-1, keepdim=True)
    uniform = torch.full_like(v, 1.0 / v.shape[-1])
    return torch.where(s > 0, v / s.clamp_min(torch.finfo(v.dtype).tiny), uniform)


def as_compute(x: Tensor) -> Tensor:
    return x.to(markov.compute_dtype(x.dtype))


def layer_tuple(layers: Sequence[int] | int | None, name: str, knob: str = "layers"
                ) -> tuple[int, ...] | None:
    """A layer selection as a tuple of ints (``None`` = all layers); an empty one is refused."""
    if layers is None:
        return None
    out = (layers,) if isinstance(layers, int) else tuple(layers)
    if not out:
        raise ValueError(f"{name}: {knob} must be a non-empty list or null (= all)")
    return tuple(int(i) for i in out)


def resolve_layers(record: AttentionRecord, layers: Sequence[int] | None, name: str
                   ) -> tuple[int, ...]:
    """The ascending layer indices ``layers`` (negative from the end, ``None`` = all) select
    in ``record``; ``name`` names the caller in the error."""
    n = record.num_layers
    if n is None:
        if layers is None or any(i < 0 for i in layers):
            raise ValueError(
                f"{name}: layers {layers} need the backbone's depth, but the"
                " record has no num_layers; build it with AttentionReducer"
            )
        return tuple(sorted(set(layers)))
    return Capture(layers=layers).resolve(n)


def check_fused_heads(record: AttentionRecord, layer: int, attn: Tensor, *, heads: str,
                      fuse_first: bool, name: str, fuse: str | None = None) -> None:
    """Refuse heads fused while capturing when the caller cannot use them.

    Args:
        record, layer, attn: the record and one of its layers' attention ``(B, H', N, N)``.
        heads: the head fusion the caller needs (``"mean"`` or ``"lambda2"``).
        fuse_first: whether the caller fuses the heads into the chain first (else it needs
            every head).
        name: the caller, for the error; fuse: its ``fuse`` setting, for the error.
    """
    w = record.head_weights.get(layer)
    if attn.shape[1] != 1 or w is None or w.shape[-1] < 2:
        return
    scheme = record.head_fusion
    if scheme is None:  # a hand-built record: uniform weights are the mean
        uniform = bool(torch.allclose(w, torch.full_like(w, 1.0 / w.shape[-1])))
        scheme = "mean" if uniform else "lambda2"
    if not fuse_first:
        raise ValueError(
            f"{name}: fuse={fuse} needs every head, but the"
            f" heads of layer {layer} were fused while capturing ({scheme}); capture with"
            " Capture(heads='keep'), e.g. method.capture(num_layers) or Capture.union"
        )
    if scheme != heads:
        raise ValueError(
            f"{name}: needs heads={heads}, but layer {layer} was captured with"
            f" heads fused by {scheme}; capture with method.capture(num_layers)"
        )


def fused_patch_chain(attn: Tensor, layout: TokenLayout, heads: str) -> Tensor:
    """``(B, n, n)`` the patch chain of ``(B, H, N, N)`` attention with its heads fused by
    ``heads`` (``"mean"``: :func:`mean_patch_chain`; ``"lambda2"``: each head's
    :func:`patch_chain` weighted by :func:`grid_weights`); one head: its patch chain."""
    if heads == "mean" and attn.shape[1] > 1:
        return mean_patch_chain(attn, layout)
    chain = patch_chain(as_compute(attn), layout)  # (B, H, n, n)
    if chain.shape[1] == 1:
        return chain[:, 0]
    return markov.fuse_heads(chain, grid_weights(chain, heads))


def refuse_inactive(method: Any, rules: Iterable[tuple[str, bool, str]]) -> None:
    """Refuse a knob set off its default where the method's other settings give it nothing
    to do (every knob changes the output or is refused: ``seed_stride=4`` with ``seeds:
    auto`` would silently change nothing).

    Args:
        method: a dataclass method; a knob's default is its dataclass field default (the
            method configs keep these knobs at the same values, ``tests/test_knobs.py``).
        rules: ``(knob, acts, where)``: whether the knob acts with the current settings, and
            the settings with which it does, for the error.

    Raises:
        ValueError: naming the method, the knob, its value, the settings it needs and its
            default.
    """
    defaults = {f.name: f.default for f in fields(method)}
    for knob, acts, where in rules:
        value = getattr(method, knob)
        if not acts and value != defaults[knob]:
            raise ValueError(
                f"{method.name}: {knob}={value!r} has no effect with these settings: it acts"
                f" only with {where}; set that as well, or leave {knob} at its default"
                f" {defaults[knob]!r}"
            )


# --------------------------------------------------------------------------------------
# the interface
# --------------------------------------------------------------------------------------


def knob(default: Any, help: str) -> Any:
    """A method setting: its default and its help text, the one description of the setting
    (docs/methods.md's tables are generated from it: :mod:`segment.methods.settings`)."""
    return field(default=default, metadata={"help": " ".join(help.split())})


@dataclass(frozen=True)
class Method(abc.ABC):
    """A heatmap method over attention records: what every method has.

    Knobs only some methods have live in them: ``heads`` (:class:`FusesHeads`) and
    ``average_layers`` (:class:`AveragesLayers`); a method without them reduces heads by
    their mean and runs on each layer. Methods are frozen dataclasses (a subclass is declared
    ``@dataclass(frozen=True)``, each field with :func:`knob`; ``__post_init__`` normalises a
    field with ``object.__setattr__``): ``dataclasses.replace(method, knob=value)`` gives a
    changed copy, validated again, so no field set after construction can be ignored.
    """

    name: str = knob("method", "the method's name in tables, manifests and file records")
    layers: Sequence[int] | int | None = knob(
        (-1,), "the layers it reads, negative from the end; null = all layers")
    # whether the output holds region labels (``MethodOutput.labels``), not only a heatmap
    gives_labels: ClassVar[bool] = False
    gives_hierarchy: ClassVar[bool] = False  # MethodOutput.hierarchy and .leaves (cuts)
    # whether ``__call__`` takes ``eigen=`` (the eigensolver of its cuts,
    # :func:`segment.backends.second_eigenvectors`; ``segment-eval eigen=...``)
    takes_eigen: ClassVar[bool] = False
    # the backbone kinds (``Backbone.kind``) this method runs on; the others are refused
    # before the first batch (``segment.run.api.segmenter.check_method``)
    backbones: ClassVar[frozenset[str]] = frozenset({"vit", "dit"})

    @property
    def default_level(self) -> float | None:
        """For a method that gives a hierarchy, the threshold of the level its labels are
        (``Hierarchy.labels_at``); ``None`` for the others."""
        return None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", layer_tuple(self.layers, self.name))

    # how heads and layers are reduced (the knobs of the methods that have them) -----------

    @property
    def head_fusion(self) -> str:
        """How the heads are fused: ``"mean"``, or the ``heads`` knob of :class:`FusesHeads`."""
        return "mean"

    @property
    def layer_average(self) -> bool:
        """Whether the layers are averaged before the method (:class:`AveragesLayers`)."""
        return False

    @property
    def fuse_point(self) -> str | None:
        """Where the heads are combined (the ``fuse`` knob of bounce and tokenrank), for
        errors; ``None``: before the method."""
        return None

    # what the backbone must capture -----------------------------------------------------

    @property
    def _fuse_first(self) -> bool:
        """Whether heads are fused into the chain before the method (a capture may fuse)."""
        return True

    def capture(self, num_layers: int) -> Capture:
        """The smallest :class:`Capture` this method needs on a ``num_layers`` backbone."""
        layers = Capture(layers=self.layers).resolve(num_layers)
        return Capture(
            layers=layers,
            heads=self.head_fusion if self._fuse_first else "keep",
            average_layers=self.layer_average and len(layers) > 1,
        )

    def pixel_knobs(self) -> tuple[str, ...]:
        """This method's settings, as ``knob=value``, that read the input image
        (``AttentionRecord.pixels``) with the current settings; a backbone whose records carry
        none (``Backbone.provides_pixels`` false; every bundled backbone provides them) refuses them before the first batch
        (``segment.run.api.check_method``). Default: none."""
        return ()

    # the heatmap --------------------------------------------------------------------------

    def __call__(self, record: AttentionRecord) -> MethodOutput:
        """Heatmap ``(B, h, w)`` on the record's patch grid."""
        chains = self._inputs(record)
        heat = torch.stack([self._heat(a, record) for a in chains]).mean(0)  # (B, h*w)
        h, w = record.layout.grid
        return MethodOutput(heatmap=heat.reshape(heat.shape[0], h, w))

    def _heat(self, attn: Tensor, record: AttentionRecord) -> Tensor:
        """``(B, H', N, N)`` chain(s) of one (averaged) layer -> ``(B, h*w)`` heatmap.

        Per-layer methods implement this; methods that combine layers or build their own
        chains (rollout, regions, concept attention) override :meth:`__call__` instead.
        """
        raise NotImplementedError(f"{type(self).__name__} implements neither _heat nor __call__")

    # reading the record -------------------------------------------------------------------

    def _resolve(self, record: AttentionRecord) -> tuple[int, ...]:
        return resolve_layers(record, self.layers, self.name)

    def _check_heads(self, record: AttentionRecord, layer: int, attn: Tensor) -> None:
        """Refuse heads fused while capturing when this method cannot use them."""
        check_fused_heads(record, layer, attn, heads=self.head_fusion,
                          fuse_first=self._fuse_first, name=self.name, fuse=self.fuse_point)

    def _fused(self, attn: Tensor, layout: TokenLayout) -> Tensor:
        """``(B, H, N, N)`` -> ``(B, 1, N, N)`` when this method fuses the chain first."""
        attn = as_compute(attn)
        if not self._fuse_first or attn.shape[1] == 1:
            return attn
        if self.head_fusion == "lambda2":  # as fuse_layer, |lambda_2| shared by the record's methods
            w = grid_weights(patch_chain(attn, layout), "lambda2")
            return markov.fuse_heads(attn, w).unsqueeze(1)
        return fuse_layer(attn, self.head_fusion, layout)[0]

    def _inputs(self, record: AttentionRecord) -> list[Tensor]:
        """The chains to run on: one per selected layer, or one averaged."""
        layers = self._resolve(record)
        layout = record.layout
        if record.averaged_layers is not None:
            got = tuple(record.averaged_layers)
            if got != layers or (len(got) > 1 and not self.layer_average):
                raise ValueError(
                    f"{self.name}: the record holds layers {got} averaged into one; this method"
                    f" needs layers {layers} {'averaged' if self.layer_average else 'separately'}"
                )
            a = record.attn[got[0]]
            self._check_heads(record, got[0], a)
            return [self._fused(a, layout)]
        missing = [i for i in layers if i not in record.attn]
        if missing:
            raise ValueError(
                f"{self.name}: layers {missing} were not captured (record has {record.layers});"
                " capture with method.capture(num_layers)"
            )
        mats = []
        for i in layers:
            self._check_heads(record, i, record.attn[i])
            mats.append(self._fused(record.attn[i], layout))
        if self.layer_average and len(mats) > 1:
            heads = {m.shape[1] for m in mats}
            if len(heads) > 1:
                raise ValueError(f"{self.name}: layers {layers} have different head counts {heads}")
            return [torch.stack(mats).mean(0)]
        return mats


@dataclass(frozen=True)
class FusesHeads(Method):
    """A method with the ``heads`` knob: how the heads of a layer are fused."""

    heads: str = knob("mean", "head fusion: mean (uniform weights) or lambda2 (weights"
                      " proportional to |lambda_2| of each head's patch chain, protocol §1)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.heads not in HEADS:
            raise ValueError(f"{self.name}: heads must be one of {HEADS}, got {self.heads!r}")

    @property
    def head_fusion(self) -> str:
        return self.heads


@dataclass(frozen=True)
class AveragesLayers(FusesHeads):
    """A per-layer method with the ``average_layers`` knob."""

    average_layers: bool = knob(False, "with several layers: average their attention (or"
                                " chains) before the method (true) or the per-layer heatmaps"
                                " after it (false)")

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "average_layers", bool(self.average_layers))
        if self.average_layers and self.layers is not None and len(set(self.layers)) == 1:
            raise ValueError(
                f"{self.name}: average_layers=true has no effect with one layer (layers="
                f"{list(self.layers)}): it averages several layers' attention before the"
                " method; select several layers (e.g. layers=[-2,-1]) or leave it false"
            )

    @property
    def layer_average(self) -> bool:
        return self.average_layers
