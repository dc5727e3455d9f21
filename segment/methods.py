"""Heatmap segmentation methods: attention chains read from an :class:`AttentionRecord`.

A method says what it needs from the backbone (:meth:`Method.capture`) and turns the
record into a foreground heatmap on the patch grid (:meth:`Method.__call__`,
``MethodOutput.heatmap`` of shape ``(B, h, w)``); masks follow protocol §3 in
:mod:`segment.masks`. Methods read only the record: the start tokens come from
:meth:`AttentionRecord.queries` (the CLS token for a ViT, the class word's text tokens for
FLUX) and the grid from ``record.layout.patches``, so the same methods run on any backbone.

Definitions (``A`` one layer's ``(N, N)`` attention of one head, ``s`` the start
distribution: uniform over the query tokens, e.g. one-hot on CLS; ``P`` the *patch chain*:
``A`` restricted to grid tokens, rows renormalised (a row with no mass left becomes
uniform); ``pi`` restricted to the grid is written ``[.]_grid``):

* ``cls_attention``: ``[s^T A]_grid``, the CLS row over the patches (not renormalised).
* ``cls_keychain``: that map after one step of the key chain ``K_ij = softmax_j(cos(k_i,
  k_j) / T)`` over the grid tokens' keys (heads concatenated): ``K [s^T A]_grid``.
* ``rollout`` (Abnar & Zuidema 2020, the baseline): per layer ``Â_l = rownorm((1-r) A_l +
  r I)`` (``r = 0.5``), ``R = Â_{L-1} ... Â_1 Â_0`` (the product that maps input tokens to
  the last layer's tokens), heatmap ``[s^T R]_grid``.
* ``bounce`` with ``steps = n``: ``v_1 = [s^T A]_grid / sum([s^T A]_grid)`` (the first
  bounce, renormalised over the grid), ``v_{k+1}^T = v_k^T P``; heatmap ``v_n``. ``n = 1`` is
  the renormalised CLS row, ``n = 2`` adds indirect paths ``CLS -> k -> j`` inside the image.
* ``tokenrank``: the stationary distribution of the damped patch chain
  ``alpha P + (1 - alpha) 11^T / n`` (:func:`segment.markov.tokenrank`).

``bounce`` and ``tokenrank`` take ``chain: grid`` (the definitions above) or ``chain: joint``:
the full chain over all ``N`` captured tokens, ``T = alpha A + (1 - alpha) 11^T / N``
(damping applied implicitly, so nothing larger than ``A`` is formed), ``bounce`` giving
``[s^T T^n]_grid`` and ``tokenrank`` the grid slice of ``T``'s stationary vector (neither
renormalised over the grid). ``direction: source`` runs either on the reverse chain
(:func:`segment.markov.reverse_chain`; of ``T`` for the joint chain and TokenRank, of ``A``
and ``P`` for grid bounces) instead of ``forward``.

Heads (the ``heads`` knob: ``mean`` = uniform weights ``w_h = 1/H``, ``lambda2`` = weights
proportional to ``|lambda_2|`` of each head's patch chain ``P_h``, protocol §1) are combined
at one of three points, the ``fuse`` knob of ``bounce`` and ``tokenrank``:

* ``attention``: the raw attention ``sum_h w_h A_h`` (all tokens) is fused first and the
  method runs once on it. The backbone can fuse while it runs (``Capture.heads``), so a
  run holds ``H = 1``: the memory-light choice. ``cls_attention`` and ``rollout`` always
  fuse here (for ``cls_attention`` every order gives the same map, selection being linear).
* ``chain``: every head's patch chain ``P_h`` and first bounce ``v_1,h`` are built (prefix
  removed, renormalised per head), then ``P = sum_h w_h P_h``, ``v_1 = sum_h w_h v_1,h``,
  and the method runs once. The default of ``tokenrank`` (``tokenrank_last_*`` of
  ``ecssd-dev/REFERENCE.md``).
* ``output``: the method runs on every head and the heads' heatmaps are combined with
  ``w_h``. The default of ``bounce`` (``cls_2bounce_*`` of ``REFERENCE.md``).

``chain`` and ``output`` need every head captured (``Capture.heads = "keep"``).

Layers: ``layers`` selects layers (negative indices count from the end, ``null`` = all).
With several layers, ``average_layers: true`` averages the chosen layers' attention first
(head-fused for ``fuse: attention``, per head otherwise) and runs the method once (the
backbone can average on the fly); ``false`` runs the method on each layer and averages the
heatmaps. ``rollout`` instead multiplies the selected layers and ``regions`` always averages
their chains (``average_layers`` is refused by both).

The same record can serve several methods: the evaluator captures
``Capture.union`` of their captures once. A method then fuses heads and averages layers
itself when the record holds them separately, and refuses (clear error) a record whose
reduction cannot give its answer (heads fused when it needs them kept, or layers averaged
differently).
"""

from __future__ import annotations

import abc
import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from segment import markov
from segment.masks import MethodOutput, minmax
from segment.record import AttentionRecord, Capture, TokenLayout
from segment.reduce import fuse_layer

__all__ = [
    "Bounce",
    "ClsAttention",
    "ClsKeyChain",
    "Method",
    "RegionGrow",
    "Rollout",
    "TokenRank",
    "grid_weights",
    "keychain_step",
    "patch_chain",
    "start_distribution",
]

_HEADS = ("mean", "lambda2")
_FUSE = ("attention", "chain", "output")


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


class _PerTensor:
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


_CHAINS_OF = _PerTensor()
_LAMBDA2_OF = _PerTensor()


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
    return _CHAINS_OF.get(attn, (g.start, g.stop, g.step),
                          lambda: markov.strip_prefix(attn[..., g, g], 0, zero_rows="uniform"))


def _mean_patch_chain(attn: Tensor, layout: TokenLayout) -> Tensor:
    """``(B, n, n)`` the mean over heads of :func:`patch_chain` of ``(B, H, N, N)``.

    Each head's grid block is renormalised and averaged in one pass over the attention
    (its row sums scale the block as it is added), never building the ``(B, H, n, n)``
    per-head chains; rows with no grid mass are uniform, as in :func:`patch_chain`.
    """
    g = layout.patches
    a = _as_compute(attn[..., g, g])  # (B, H, n, n), a view when already float32
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
        lam = _LAMBDA2_OF.get(chain, None, lambda: markov.lambda2(chain)).to(chain.dtype)  # (B, H)
        return markov.head_weights(lam, "lambda2")
    raise ValueError(f"heads must be one of {_HEADS}, got {heads!r}")


def _grid_part(v: Tensor, layout: TokenLayout) -> Tensor:
    """``(..., N)`` token scores -> ``(..., h*w)`` grid part."""
    return v[..., layout.patches]


def _renorm(v: Tensor) -> Tensor:
    """Normalise ``(..., n)`` to sum 1; an all-zero vector becomes uniform."""
    s = v.sum(-1, keepdim=True)
    uniform = torch.full_like(v, 1.0 / v.shape[-1])
    return torch.where(s > 0, v / s.clamp_min(torch.finfo(v.dtype).tiny), uniform)


def _as_compute(x: Tensor) -> Tensor:
    return x.to(markov.compute_dtype(x.dtype))


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


@dataclass
class Method(abc.ABC):
    """A heatmap method over attention records.

    Attributes:
        name: name in tables and manifests.
        layers: layer indices (negative from the end); ``None`` = all layers.
        heads: head fusion, ``"mean"`` or ``"lambda2"``.
        average_layers: average the selected layers' chains before the method (``True``) or
            average the per-layer heatmaps (``False``).
    """

    name: str = "method"
    layers: Sequence[int] | int | None = (-1,)
    heads: str = "mean"
    average_layers: bool = False
    # False where a subclass refuses ``average_layers`` outright, with its own reason
    _averages_layers: ClassVar[bool] = True
    # whether the output holds region labels (``MethodOutput.labels``), not only a heatmap
    gives_labels: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.layers is not None:
            layers = (self.layers,) if isinstance(self.layers, int) else tuple(self.layers)
            if not layers:
                raise ValueError(f"{self.name}: layers must be a non-empty list or null (= all)")
            self.layers = tuple(int(i) for i in layers)
        if self.heads not in _HEADS:
            raise ValueError(f"{self.name}: heads must be one of {_HEADS}, got {self.heads!r}")
        self.average_layers = bool(self.average_layers)
        if self.average_layers and self._averages_layers and self.layers is not None \
                and len(set(self.layers)) == 1:
            raise ValueError(
                f"{self.name}: average_layers=true has no effect with one layer (layers="
                f"{list(self.layers)}): it averages several layers' attention before the"
                " method; select several layers (e.g. layers=[-2,-1]) or leave it false"
            )

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
            heads=self.heads if self._fuse_first else "keep",
            average_layers=self.average_layers and len(layers) > 1,
        )

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
        n = record.num_layers
        if n is None:
            if self.layers is None or any(i < 0 for i in self.layers):
                raise ValueError(
                    f"{self.name}: layers {self.layers} need the backbone's depth, but the"
                    " record has no num_layers; build it with AttentionReducer"
                )
            return tuple(sorted(set(self.layers)))
        return Capture(layers=self.layers).resolve(n)

    def _check_heads(self, record: AttentionRecord, layer: int, attn: Tensor) -> None:
        """Refuse heads fused while capturing when this method cannot use them."""
        w = record.head_weights.get(layer)
        if attn.shape[1] != 1 or w is None or w.shape[-1] < 2:
            return
        scheme = record.head_fusion
        if scheme is None:  # a hand-built record: uniform weights are the mean
            uniform = bool(torch.allclose(w, torch.full_like(w, 1.0 / w.shape[-1])))
            scheme = "mean" if uniform else "lambda2"
        if not self._fuse_first:
            raise ValueError(
                f"{self.name}: fuse={getattr(self, 'fuse', None)} needs every head, but the"
                f" heads of layer {layer} were fused while capturing ({scheme}); capture with"
                " Capture(heads='keep'), e.g. method.capture(num_layers) or Capture.union"
            )
        if scheme != self.heads:
            raise ValueError(
                f"{self.name}: needs heads={self.heads}, but layer {layer} was captured with"
                f" heads fused by {scheme}; capture with method.capture(num_layers)"
            )

    def _fused(self, attn: Tensor, layout: TokenLayout) -> Tensor:
        """``(B, H, N, N)`` -> ``(B, 1, N, N)`` when this method fuses the chain first."""
        attn = _as_compute(attn)
        if not self._fuse_first or attn.shape[1] == 1:
            return attn
        if self.heads == "lambda2":  # as fuse_layer, with |lambda_2| shared by the record's methods
            w = grid_weights(patch_chain(attn, layout), "lambda2")
            return markov.fuse_heads(attn, w).unsqueeze(1)
        return fuse_layer(attn, self.heads, layout)[0]

    def _inputs(self, record: AttentionRecord) -> list[Tensor]:
        """The chains to run on: one per selected layer, or one averaged."""
        layers = self._resolve(record)
        layout = record.layout
        if record.averaged_layers is not None:
            got = tuple(record.averaged_layers)
            if got != layers or (len(got) > 1 and not self.average_layers):
                raise ValueError(
                    f"{self.name}: the record holds layers {got} averaged into one; this method"
                    f" needs layers {layers} {'averaged' if self.average_layers else 'separately'}"
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
        if self.average_layers and len(mats) > 1:
            heads = {m.shape[1] for m in mats}
            if len(heads) > 1:
                raise ValueError(f"{self.name}: layers {layers} have different head counts {heads}")
            return [torch.stack(mats).mean(0)]
        return mats


# --------------------------------------------------------------------------------------
# the methods
# --------------------------------------------------------------------------------------


@dataclass
class ClsAttention(Method):
    """CLS attention: the query tokens' attention row over the patches (``[s^T A]_grid``).

    Heads are fused by ``heads`` (equal to fusing the rows, selection being linear).
    """

    name: str = "cls_attention"

    def _fused(self, attn: Tensor, layout: TokenLayout) -> Tensor:
        if self.heads == "mean":  # the mean of the heads' rows, not of their whole chains
            return _as_compute(attn)
        return super()._fused(attn, layout)

    def _heat(self, attn: Tensor, record: AttentionRecord) -> Tensor:
        s = start_distribution(record, attn.shape[-1], attn.dtype, attn.device)
        rows = (s[:, None, None, :] @ attn)[:, :, 0]  # (B, H', N), H' = 1 unless heads=mean
        return _grid_part(rows.mean(1), record.layout)


def keychain_step(record: AttentionRecord, heat: Tensor, layers: Sequence[int], temperature: float,
                  name: str = "cls_keychain") -> Tensor:
    """One step of the key chain over a grid map, averaged over ``layers``.

    ``s_i <- sum_j P_ij s_j`` with ``P = softmax_j(cos(k_i, k_j) / temperature)`` on each
    layer's grid-token keys, the heads' keys concatenated (:func:`segment.regions.key_chain`).

    Args:
        record: holds the keys of ``layers`` (``Capture.keys``).
        heat: ``(B, h, w)`` the map to smooth.
        layers: captured layer indices whose chains are averaged.
        temperature: the key chain's softmax temperature (> 0).
        name: the calling method, for the error.

    Returns:
        ``(B, h, w)`` float32.
    """
    from segment.regions import key_chain

    b, h, w = heat.shape
    out = []
    for i in layers:
        if i not in record.keys:
            raise ValueError(
                f"{name}: needs the keys of layer {i}; capture with method.capture(num_layers)"
                " (Capture.keys)"
            )
        k = _as_compute(record.keys[i][:, :, record.layout.patches])  # (B, H, n, D)
        chain = key_chain(k.transpose(1, 2).flatten(2), temperature)  # (B, n, n)
        out.append(torch.einsum("bij,bj->bi", chain.to(heat), heat.flatten(1)))
    return torch.stack(out).mean(0).view(b, h, w)


@dataclass
class ClsKeyChain(ClsAttention):
    """CLS attention smoothed by one step of the key chain (``cls_keychain`` of the dev
    sets' REFERENCE.md, the strongest simple peer there).

    The CLS map of the selected layers (heads fused by ``heads``, layers averaged) takes one
    step of each layer's key chain ``softmax_j(cos(k_i, k_j) / key_temperature)`` (heads'
    keys concatenated); the layers' results are averaged (:func:`keychain_step`). It is the
    foreground score of ``regions`` with ``score: keychain``.

    Attributes:
        key_temperature: the key chain's softmax temperature.
    """

    name: str = "cls_keychain"
    _averages_layers: ClassVar[bool] = False  # refused below
    key_temperature: float = 0.05

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.average_layers:
            raise ValueError(
                f"{self.name}: average_layers is not a knob here: the CLS maps of the layers are"
                " averaged, then smoothed by each layer's key chain (set layers instead)"
            )
        if not float(self.key_temperature) > 0:
            raise ValueError(f"{self.name}: key_temperature must be > 0, got {self.key_temperature!r}")

    def capture(self, num_layers: int) -> Capture:
        c = super().capture(num_layers)
        return Capture(layers=c.layers, heads=c.heads, keys=True)

    def __call__(self, record: AttentionRecord) -> MethodOutput:
        cls = super().__call__(record).heatmap.float()  # (B, h, w) mean over the layers
        heat = keychain_step(record, cls, self._resolve(record), float(self.key_temperature), self.name)
        return MethodOutput(heatmap=heat)


@dataclass
class Rollout(Method):
    """Attention rollout (baseline): ``[s^T Â_{L-1} ... Â_0]_grid``.

    Attributes:
        residual: weight ``r`` of the identity in ``Â = rownorm((1 - r) A + r I)``.
    """

    name: str = "rollout"
    _averages_layers: ClassVar[bool] = False  # refused below
    layers: Sequence[int] | int | None = None
    residual: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.average_layers:
            raise ValueError("rollout multiplies its layers; average_layers must be false")
        if not 0.0 <= float(self.residual) < 1.0:
            raise ValueError(f"rollout: residual must lie in [0, 1), got {self.residual}")

    def __call__(self, record: AttentionRecord) -> MethodOutput:
        mats = self._inputs(record)  # ascending layers, each (B, 1, N, N)
        layout = record.layout
        n = mats[0].shape[-1]
        v = start_distribution(record, n, mats[0].dtype, mats[0].device)  # (B, N)
        r = float(self.residual)
        for a in reversed(mats):  # s^T Â_{L-1} first, down to Â_0
            a = a[:, 0]
            hat = (1 - r) * a + r * torch.eye(n, dtype=a.dtype, device=a.device)
            hat = hat / hat.sum(-1, keepdim=True)
            v = torch.einsum("bn,bnm->bm", v, hat)
        h, w = layout.grid
        return MethodOutput(heatmap=_grid_part(v, layout).reshape(v.shape[0], h, w))


_CHAIN_KINDS = ("grid", "joint")
_DIRECTIONS = ("forward", "source")


@dataclass
class _ChainMethod(Method):
    """A method run on the grid chain or on the joint chain over every token (module doc).

    ``chain: grid`` (the patch chain ``P`` and the first bounce ``v_1``, text / CLS / register
    tokens dropped after the first step) or ``chain: joint`` (the full ``(N, N)`` chain over
    every captured token, damped by ``alpha``, walked from the query tokens; the grid slice
    of the result is read at the end, not renormalised). ``direction: source`` walks the
    reverse chain (:func:`segment.markov.reverse_chain`: where the attention a token receives
    comes from) instead of the attention itself (``forward``).

    Attributes:
        fuse: where heads are combined: ``"attention"`` (the raw ``(N, N)`` attention,
            before ``P`` and ``v_1`` are built; a capture may fuse on the fly),
            ``"chain"`` (``P = sum_h w_h P_h`` and ``v_1 = sum_h w_h v_1,h`` from each head's
            own patch chain and renormalised first bounce; grid chain only) or ``"output"``
            (the method runs on every head and the heads' heatmaps are combined).
        chain: ``"grid"`` or ``"joint"``.
        direction: ``"forward"`` or ``"source"``.
    """

    fuse: str = "output"
    chain: str = "grid"
    direction: str = "forward"
    _directions: ClassVar[tuple[str, ...]] = _DIRECTIONS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fuse not in _FUSE:
            raise ValueError(f"{self.name}: fuse must be one of {_FUSE}, got {self.fuse!r}")
        if self.chain not in _CHAIN_KINDS:
            raise ValueError(f"{self.name}: chain must be one of {_CHAIN_KINDS}, got {self.chain!r}")
        if self.direction not in self._directions:
            hint = {"incoming": " (was: incoming)", "outgoing": " (source was: outgoing)"}
            raise ValueError(
                f"{self.name}: direction must be one of {self._directions}, got {self.direction!r}"
                + hint.get(str(self.direction), "")
            )
        if self.chain == "joint" and self.fuse == "chain":
            raise ValueError(
                f"{self.name}: fuse=chain fuses the heads' grid chains; with chain=joint use"
                " fuse=attention (the fused joint chain) or fuse=output"
            )

    @property
    def _fuse_first(self) -> bool:
        return self.fuse == "attention"

    @abc.abstractmethod
    def _run(self, v1: Tensor, chain: Tensor) -> Tensor:
        """``v_1`` ``(B, H', n)`` and patch chains ``(B, H', n, n)`` -> ``(B, H', n)``."""

    @abc.abstractmethod
    def _run_joint(self, start: Tensor, attn: Tensor) -> Tensor:
        """Start masses ``(B, N)`` and joint chains ``(B, H', N, N)`` -> ``(B, H', N)``."""

    def _heat(self, attn: Tensor, record: AttentionRecord) -> Tensor:
        layout = record.layout
        s = start_distribution(record, attn.shape[-1], attn.dtype, attn.device)
        if self.chain == "joint":
            return self._heat_joint(s, attn, layout)
        if self.direction == "forward":  # the query tokens' rows
            first = torch.einsum("bn,bhnm->bhm", s, attn)
        else:  # the first step of the reverse chain: their columns, scaled by 1 / column sum
            inv_c = markov.inverse_column_sums(attn, 1.0)  # (B, H, N)
            first = torch.einsum("bhmn,bhn->bhm", attn, s.unsqueeze(1) * inv_c)
        v1 = _renorm(_grid_part(first, layout))  # (B, H, n)
        chain = patch_chain(attn, layout)  # (B, H, n, n)
        if chain.shape[1] == 1:
            return self._run(v1, chain)[:, 0]
        w = grid_weights(chain, self.heads)  # (B, H), from the forward patch chains
        if self.fuse == "chain":
            chain = markov.fuse_heads(chain, w).unsqueeze(1)
            v1 = (w.unsqueeze(-1) * v1).sum(1, keepdim=True)
            return self._run(v1, chain)[:, 0]
        return (w.unsqueeze(-1) * self._run(v1, chain)).sum(1)  # fuse == "output"

    def _heat_joint(self, s: Tensor, attn: Tensor, layout: TokenLayout) -> Tensor:
        heat = _grid_part(self._run_joint(s, attn), layout)  # (B, H', n)
        if heat.shape[1] == 1:
            return heat[:, 0]
        if self.heads == "mean":  # fuse == "output"
            w = torch.full(heat.shape[:2], 1.0 / heat.shape[1], dtype=heat.dtype, device=heat.device)
        else:
            w = grid_weights(patch_chain(attn, layout), self.heads)
        return (w.unsqueeze(-1) * heat).sum(1)


@dataclass
class Bounce(_ChainMethod):
    """``steps`` bounces from the query tokens.

    Grid chain: ``v_1 = rownorm([s^T A]_grid)``, ``v_{k+1}^T = v_k^T P``, heatmap ``v_steps``
    (module docstring). Joint chain: ``v_k^T = s^T T^k`` on the damped chain
    ``T = alpha A + (1 - alpha) 11^T / N`` over every token (damping applied implicitly),
    heatmap ``[v_steps]_grid``; the paths class word -> text token -> image token count.
    ``direction: source`` uses the reverse chain in both. The default ``fuse: output`` runs
    per head and fuses the heads' ``v_steps`` (``cls_2bounce_*`` of ecssd-dev/REFERENCE.md).

    Attributes:
        steps: number of bounces ``n >= 1``.
        alpha: damping of the joint chain in ``(0, 1]`` (reference 0.99; 1 = undamped); the
            grid chain is undamped, so ``chain: grid`` refuses ``alpha < 1``.
    """

    name: str = "bounce"
    steps: int = 2
    fuse: str = "output"
    alpha: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if int(self.steps) < 1:
            raise ValueError(f"{self.name}: steps must be >= 1, got {self.steps}")
        self.steps = int(self.steps)
        self.alpha = markov.validate_alpha(self.alpha)
        if self.chain == "grid" and self.alpha != 1.0:
            raise ValueError(
                f"{self.name}: alpha={self.alpha} damps the joint chain only; use chain=joint"
                " or alpha=1.0"
            )

    def _run(self, v1: Tensor, chain: Tensor) -> Tensor:
        if self.steps == 1:
            return v1
        # v_1 P^(steps-1): bounce() from the start masses v_1, (B, H', 1, n)
        return markov.bounce(
            chain, v1.unsqueeze(-2), steps=self.steps - 1, direction=self.direction
        ).last[..., 0, :]

    def _run_joint(self, start: Tensor, attn: Tensor) -> Tensor:
        v0 = start[:, None, None, :]  # (B, 1, 1, N), broadcast over the heads
        return markov.bounce(
            attn, v0, steps=self.steps, direction=self.direction, alpha=self.alpha
        ).last[..., 0, :]


@dataclass
class TokenRank(_ChainMethod):
    """TokenRank: stationary distribution of the damped chain.

    Grid chain: of the damped patch chain; the default ``fuse: chain`` takes the stationary
    vector of ``sum_h w_h P_h`` (``tokenrank_last_*`` of ecssd-dev/REFERENCE.md), ``output``
    averages the per-head stationary vectors, ``attention`` uses the patch chain of the fused
    attention. Joint chain: of ``alpha A + (1 - alpha) 11^T / N`` over every token, read on
    the grid (the reference code's ``tokenrank_sink``). ``direction: source``: of the reverse
    of the damped chain (the reference code's ``tokenrank_src``); ``direction: outgoing``:
    of the damped reverse chain, ``alpha S + (1 - alpha) 11^T / n`` with ``S`` the
    column-normalised transpose (protocol §1's outgoing view: the same power iteration on
    the column-normalised transpose); on either chain.

    Attributes:
        alpha: damping in ``(0, 1]`` (reference 0.99).
        tol: L1 stopping tolerance of the power iteration.
        max_iter: power steps at most.
    """

    name: str = "tokenrank"
    fuse: str = "chain"
    alpha: float = 0.99
    tol: float = 1e-6
    max_iter: int = 200
    _directions: ClassVar[tuple[str, ...]] = (*_DIRECTIONS, "outgoing")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.alpha = markov.validate_alpha(self.alpha)
        if int(self.max_iter) < 1 or not float(self.tol) > 0:
            raise ValueError(
                f"{self.name}: need max_iter >= 1 and tol > 0, got {self.max_iter}, {self.tol}"
            )

    def _pi(self, chain: Tensor) -> Tensor:
        return markov.tokenrank(
            chain, alpha=self.alpha, tol=float(self.tol), max_iter=int(self.max_iter),
            direction={"forward": "incoming"}.get(self.direction, self.direction),
        )

    def _run(self, v1: Tensor, chain: Tensor) -> Tensor:
        return self._pi(chain)

    def _run_joint(self, start: Tensor, attn: Tensor) -> Tensor:
        return self._pi(attn)


# --------------------------------------------------------------------------------------
# seed and grow (segment.regions)
# --------------------------------------------------------------------------------------

_CHAINS = ("attention", "keys", "mix")
_SEEDS = ("auto", "all", "grid", "tokenrank")
_KEY_FUSE = ("similarity", "chain", "concat")
_DECIDE = ("proposals", "regions")
_SCORES = ("cls", "keychain")
_HEATS = ("expected", "blend")


@dataclass
class RegionGrow(Method):
    """Seed and grow: regions as metastable states of a token chain (:mod:`segment.regions`).

    1. the chain ``P`` over grid tokens of the selected layer(s): the patch chain of the
       attention (``chain: attention``), the key-similarity chain
       ``softmax(cos(k_i, k_j) / key_temperature)`` (``keys``), or their mixture
       ``(1 - key_weight) P_attn + key_weight P_keys`` (``mix``); heads fused by ``heads``
       (``mean`` or ``lambda2``: weights from ``|lambda_2|`` of each head's chain); with
       several ``layers`` their chains are averaged (``average_layers`` is refused);
    2. seeds: every token (``all``), a grid every ``seed_stride`` tokens (``grid``, the
       DiffSeg baseline), the ``num_seeds`` top TokenRank tokens of ``P`` with a
       suppression window of ``seed_radius`` tokens (``tokenrank``), or ``auto``: every
       token up to ``max_seeds`` tokens, else the densest grid with at most that many;
    3. ``steps``-bounce propagation from every seed, merged while the symmetric KL is below
       ``tau`` (``iterations`` rounds);
    4. soft assignment of tokens to proposals, upsampled to the backbone input, refined by
       ``refine_steps`` bounces of the edge-aware pixel chain (needs ``record.pixels``;
       run at ``refine_scale`` of the input resolution, see :meth:`_refine`), argmax;
       regions split into connected components, components under
       ``min_area`` (fraction of the image) absorbed;
    5. foreground (binary tasks): a region whose mean score exceeds the score map's mean
       over the image; the score is the CLS attention of ``score_layers`` (mean of heads,
       ``score: cls``) or that map after one step of the layers' key chain (``score:
       keychain``, :meth:`score_map`). The heatmap (for AP) is every pixel's expected
       region score ``sum_k p_k score_k`` (``heat: expected``) or the mean of that map
       (min-maxed), the score map (min-maxed) and the mask (``heat: blend``): the mask
       ranks the foreground first, the maps rank the pixels inside each side;
    6. regions for scenes: with ``label_tau < tau`` the labels are the seeds merged at the
       finer ``label_tau``, cut along the mask of step 5 (:meth:`_finer_regions`), so the
       mask and heatmap stay those of ``tau`` while the regions are finer.

    Returns ``MethodOutput(heatmap, labels, foreground)`` at the backbone input resolution.
    """

    name: str = "regions"
    gives_labels: ClassVar[bool] = True
    _averages_layers: ClassVar[bool] = False  # refused below
    chain: str = "mix"
    key_temperature: float = 0.05
    key_fuse: str = "similarity"
    key_weight: float = 0.5
    seeds: str = "auto"
    max_seeds: int = 256
    seed_stride: int = 2
    num_seeds: int = 64
    seed_radius: int = 1
    steps: int = 2
    tau: float = 0.2
    iterations: int = 3
    score_layers: Sequence[int] | int | None = (-1,)
    refine_steps: int = 3
    refine_radius: int = 8
    refine_dilation: int = 4
    refine_scale: float = 0.5
    sigma_space: float = 5.0
    sigma_color: float = 0.08
    min_area: float = 0.002
    connectivity: bool = True
    decide: str = "proposals"
    score: str = "cls"
    heat: str = "expected"
    label_tau: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.average_layers:
            raise ValueError(
                f"{self.name}: average_layers is not a knob of regions: the chains of the"
                " selected layers are always averaged (set layers instead)"
            )
        for knob, allowed in (("chain", _CHAINS), ("key_fuse", _KEY_FUSE), ("seeds", _SEEDS),
                              ("decide", _DECIDE)):
            if getattr(self, knob) not in allowed:
                raise ValueError(
                    f"{self.name}: {knob} must be one of {allowed}, got {getattr(self, knob)!r}"
                )
        for knob, low in (("steps", 1), ("max_seeds", 1), ("seed_stride", 1), ("num_seeds", 1),
                          ("seed_radius", 0), ("iterations", 1), ("refine_steps", 0),
                          ("refine_radius", 1), ("refine_dilation", 1)):
            value = getattr(self, knob)
            if isinstance(value, bool) or int(value) != value or value < low:
                raise ValueError(f"{self.name}: {knob} must be an integer >= {low}, got {value!r}")
        for knob in ("tau", "key_temperature", "sigma_space", "sigma_color"):
            if not float(getattr(self, knob)) > 0:
                raise ValueError(f"{self.name}: {knob} must be > 0, got {getattr(self, knob)!r}")
        self._refine_px()  # refine_scale and the window it implies
        if not 0.0 <= float(self.key_weight) <= 1.0:
            raise ValueError(f"{self.name}: key_weight must lie in [0, 1], got {self.key_weight}")
        if not 0.0 <= float(self.min_area) < 1.0:
            raise ValueError(f"{self.name}: min_area is a fraction of the image in [0, 1)")
        if self.label_tau is not None and not 0 < float(self.label_tau) <= float(self.tau):
            raise ValueError(
                f"{self.name}: label_tau must lie in (0, tau = {self.tau}] or be null, got"
                f" {self.label_tau}"
            )
        if self.score not in _SCORES:
            raise ValueError(f"{self.name}: score must be one of {_SCORES}, got {self.score!r}")
        if self.heat not in _HEATS:
            raise ValueError(f"{self.name}: heat must be one of {_HEATS}, got {self.heat!r}")
        refuse_inactive(self, self._conditional_knobs())
        self._score = ClsAttention(name=f"{self.name}.score", layers=self.score_layers,
                                   heads="mean")

    def _conditional_knobs(self) -> list[tuple[str, bool, str]]:
        """The knobs that act only with other settings: ``(knob, acts now, with what)``
        (:func:`refuse_inactive`)."""
        return [
            # chain=keys with key_fuse=concat is one chain from all heads' keys: nothing to weigh
            ("heads", not (self.chain == "keys" and self.key_fuse == "concat"),
             "chain=attention or chain=mix, or key_fuse=similarity or key_fuse=chain (with"
             " chain=keys and key_fuse=concat one chain comes from the concatenated keys of all"
             " heads)"),
            ("key_weight", self.chain == "mix", "chain=mix"),
            ("key_fuse", self._needs_keys, "chain=keys or chain=mix"),
            ("key_temperature", self._needs_keys or self.score == "keychain",
             "chain=keys, chain=mix or score=keychain"),
            ("max_seeds", self.seeds == "auto", "seeds=auto"),
            ("seed_stride", self.seeds == "grid", "seeds=grid"),
            ("num_seeds", self.seeds == "tokenrank", "seeds=tokenrank"),
            ("seed_radius", self.seeds == "tokenrank", "seeds=tokenrank"),
            *((knob, int(self.refine_steps) > 0, "refine_steps >= 1 (the pixel chain)")
              for knob in ("refine_radius", "refine_dilation", "refine_scale", "sigma_space",
                           "sigma_color")),
            ("min_area", bool(self.connectivity), "connectivity=true"),
        ]

    @property
    def _needs_keys(self) -> bool:
        return self.chain in ("keys", "mix")

    def capture(self, num_layers: int) -> Capture:
        mine = Capture(
            layers=Capture(layers=self.layers).resolve(num_layers),
            heads="keep" if self._needs_keys or self.heads == "lambda2" else "mean",
            keys=self._needs_keys,
        )
        score = self._score.capture(num_layers)
        if self.score == "keychain":  # the smoothing chain needs the score layers' keys
            score = Capture(layers=score.layers, heads="keep", keys=True)
        return mine.union(score, num_layers)

    def score_map(self, record: AttentionRecord) -> Tensor:
        """``(B, h, w)`` the foreground score on the grid.

        ``score: cls``: the CLS attention of ``score_layers`` (mean of heads).
        ``score: keychain``: that map after one step of the key chain of the same layers
        (:func:`keychain_step`, ``cls_keychain`` of ecssd-dev/REFERENCE.md and the
        :class:`ClsKeyChain` method): every token takes the mean score of the tokens whose
        keys resemble its own, so a whole object lights up, not only its most attended parts.
        """
        cls = self._score(record).heatmap.float()
        if self.score == "cls":
            return cls
        return keychain_step(record, cls, self._score._resolve(record), float(self.key_temperature),
                             self.name)

    # the chain over grid tokens ----------------------------------------------------------

    def _attention_chain(self, attn: Tensor, layout: TokenLayout) -> Tensor:
        if self.heads == "mean" and attn.shape[1] > 1:
            return _mean_patch_chain(attn, layout)
        chain = patch_chain(_as_compute(attn), layout)  # (B, H, n, n)
        if chain.shape[1] == 1:
            return chain[:, 0]
        return markov.fuse_heads(chain, grid_weights(chain, self.heads))

    def _key_chain(self, keys: Tensor, layout: TokenLayout) -> Tensor:
        from segment.regions import key_chain

        k = _as_compute(keys[:, :, layout.patches])  # (B, H, n, D)
        t = float(self.key_temperature)
        if self.key_fuse == "concat":  # cosine of the whole key vectors (all heads)
            return key_chain(k.transpose(1, 2).flatten(2), t)
        b, h = k.shape[:2]
        if self.heads == "mean" and self.key_fuse == "similarity":
            w = torch.full((b, h), 1.0 / h, dtype=k.dtype, device=k.device)
        else:  # per-head chains: fused directly, or for their lambda_2
            per_head = key_chain(k, t)  # (B, H, n, n)
            w = grid_weights(per_head, self.heads)  # (B, H)
            if self.key_fuse == "chain":  # sum_h w_h softmax(cos_h / T)
                return markov.fuse_heads(per_head, w)
        # similarity: softmax_j(sum_h w_h cos_h(k_i, k_j) / T)
        kn = F.normalize(k, dim=-1)
        sim = torch.einsum("bh,bhid,bhjd->bij", w, kn, kn)
        return torch.softmax(sim.div_(t), dim=-1)

    def grid_chain(self, record: AttentionRecord) -> Tensor:
        """``(B, n, n)`` the chain the regions grow on (layers averaged)."""
        layers = self._resolve(record)
        layout = record.layout
        chains = []
        for i in layers:
            if self.chain in ("attention", "mix"):
                if i not in record.attn:
                    raise ValueError(f"{self.name}: layer {i} was not captured ({record.layers})")
                self._check_heads(record, i, record.attn[i])
                pa = self._attention_chain(record.attn[i], layout)
            if self.chain in ("keys", "mix"):
                if i not in record.keys:
                    raise ValueError(
                        f"{self.name}: chain={self.chain} needs the keys of layer {i}; capture"
                        " with method.capture(num_layers) (Capture.keys)"
                    )
                pk = self._key_chain(record.keys[i], layout)
            if self.chain == "attention":
                chains.append(pa)
            elif self.chain == "keys":
                chains.append(pk)
            else:  # (1 - w) P_attention + w P_keys; pk is this call's own tensor
                wk = float(self.key_weight)
                chains.append(pk.mul_(wk).add_(pa * (1 - wk)))
        return chains[0] if len(chains) == 1 else torch.stack(chains).mean(0)

    # the stage -----------------------------------------------------------------------------

    def __call__(self, record: AttentionRecord) -> MethodOutput:
        from segment import regions as rg

        layout = record.layout
        h, w = layout.grid
        chain = self.grid_chain(record)  # (B, n, n)
        b, n, _ = chain.shape
        if self.seeds == "all":
            seeds = torch.arange(n, device=chain.device)
        elif self.seeds == "auto":  # every token up to max_seeds, else the densest grid below
            stride = max(1, math.ceil(math.sqrt(n / max(1, int(self.max_seeds)))))
            seeds = rg.grid_seeds((h, w), stride, chain.device)
        elif self.seeds == "grid":
            seeds = rg.grid_seeds((h, w), int(self.seed_stride), chain.device)
        else:
            rank = markov.tokenrank(chain, alpha=0.99)
            seeds = rg.tokenrank_seeds(rank, (h, w), min(int(self.num_seeds), n),
                                       int(self.seed_radius))
        dist = rg.propagate(chain, seeds, int(self.steps))  # (B, S, n)
        kl = rg.symmetric_kl(dist, dist)  # the first round of both merges (tau, label_tau)
        props = rg.merge_proposals(dist, float(self.tau), int(self.iterations), kl=kl)
        grid_prob = rg.soft_assign(props).view(b, -1, h, w)  # (B, K, h, w)
        kp = grid_prob.shape[1]
        cls = self.score_map(record)  # (B, h, w) foreground score on the grid
        size = tuple(record.image_size)
        cls_img = F.interpolate(cls.unsqueeze(1), size=size, mode="bilinear",
                                align_corners=False)[:, 0]
        if self.decide == "proposals":  # mean score over each proposal's tokens, on the grid
            prop_score = rg.region_scores(grid_prob.max(1).indices, cls, kp)
            prop_fg = prop_score > cls.flatten(1).mean(1, keepdim=True)

        if int(self.refine_steps) > 0 and record.pixels is not None:
            prob = self._refine(grid_prob, record.pixels, size)
        else:
            prob = F.interpolate(grid_prob, size=size, mode="bilinear", align_corners=False)
        hard = prob.max(1).indices  # (B, H, W) proposal of every pixel (max: faster than argmax)
        if self.connectivity:
            area = int(round(float(self.min_area) * size[0] * size[1]))
            labels = rg.connected_regions(hard, min_area=area)
        else:
            labels = rg.relabel(hard)
        k = int(labels.max()) + 1
        cls_img = cls_img.to(labels.device)
        if self.decide == "proposals":
            # every region inherits the decision of the proposal most of its pixels took
            votes = torch.zeros(b, k, kp, device=labels.device)
            votes.view(b, -1).scatter_add_(
                1, (labels * kp + hard).flatten(1), torch.ones_like(hard.flatten(1), dtype=votes.dtype)
            )
            foreground = torch.gather(prop_fg.to(labels.device), 1, votes.argmax(-1))
        else:  # mean CLS inside each connected region, on the image
            prop_score = rg.region_scores(hard, cls_img, kp)
            reg = rg.region_scores(labels, cls_img, k)
            foreground = reg > cls_img.flatten(1).mean(1, keepdim=True)
        present = torch.zeros(b, k, dtype=torch.bool, device=labels.device)
        present.scatter_(1, labels.flatten(1), True)
        foreground &= present
        # heatmap (AP): every pixel's expected proposal score under the soft assignment
        heat = torch.bmm(prop_score.to(prob).unsqueeze(1), prob.flatten(2)).view_as(cls_img)
        fg_px = torch.gather(foreground, 1, labels.flatten(1))
        if self.heat == "blend":  # rank by the mask, then by the scores inside it
            heat = (minmax(heat) + minmax(cls_img.to(heat)) + fg_px.view_as(heat).to(heat)) / 3
        # an image whose regions all fell on one side (one region, or a uniform decision)
        # has no foreground/background split: fall back to the protocol's pixel rule on the
        # CLS attention (heatmap and mask), the method's floor
        flat = fg_px.all(1) | ~fg_px.any(1)
        if bool(flat.any()):
            r = cls_img.flatten(1)
            heat = torch.where(flat.view(b, 1, 1), cls_img.to(heat), heat)
            split = (r > r.mean(1, keepdim=True)).view_as(labels).long()
            labels = torch.where(flat.view(b, 1, 1), split, labels)
            if foreground.shape[1] < 2:
                foreground = F.pad(foreground, (0, 1))
            two = torch.zeros_like(foreground)
            two[:, 1] = True
            foreground = torch.where(flat.view(b, 1), two, foreground)
        if self.label_tau is not None and float(self.label_tau) < float(self.tau):
            labels, foreground = self._finer_regions(dist, kl, labels, foreground, (h, w))
        return MethodOutput(heatmap=heat, labels=labels, foreground=foreground)

    def _refine_px(self) -> tuple[int, int, float]:
        """The pixel chain's window at ``refine_scale``: ``(radius, dilation, sigma_space)``
        in pixels of the grid it runs on (the knobs are in pixels of the backbone input)."""
        s = self.refine_scale
        if isinstance(s, bool) or not 0.0 < float(s) <= 1.0:
            raise ValueError(f"{self.name}: refine_scale must lie in (0, 1], got {s!r}")
        s = float(s)
        px = []
        for knob in ("refine_radius", "refine_dilation"):
            v = int(getattr(self, knob)) * s
            if abs(v - round(v)) > 1e-6 or round(v) < 1:
                raise ValueError(
                    f"{self.name}: refine_scale={s} turns {knob}={getattr(self, knob)} px"
                    f" into {v:g} px on the refined grid; choose values whose product with"
                    " refine_scale is a whole number >= 1"
                )
            px.append(int(round(v)))
        return px[0], px[1], float(self.sigma_space) * s

    def _refine(self, grid_prob: Tensor, pixels: Tensor, size: tuple[int, int]) -> Tensor:
        """Soft assignment ``(B, K, h, w)`` on the grid -> refined ``(B, K, H, W)`` at the
        backbone input ``size``.

        ``refine_scale`` 1: bilinear upsampling to ``size``, then the pixel chain there.
        Below 1 the chain runs on ``round(s H) x round(s W)`` pixels: the assignment is
        upsampled bilinearly to that size, the image area-averaged to it, the window
        (``refine_radius``, ``refine_dilation``, ``sigma_space``, all in input pixels) scaled
        by ``s`` so it covers the same part of the image, and the refined maps upsampled
        bilinearly to ``size``. The pixel chain's cost falls with ``s^2`` (the joint
        bilateral upsampling idea: edges found at a lower resolution, then interpolated).
        """
        from segment import regions as rg

        radius, dilation, sigma_space = self._refine_px()
        s = float(self.refine_scale)
        small = size if s == 1.0 else (max(1, round(size[0] * s)), max(1, round(size[1] * s)))
        prob = F.interpolate(grid_prob, size=small, mode="bilinear", align_corners=False)
        image = pixels.to(prob.device)
        if small != size:
            image = F.adaptive_avg_pool2d(image, small)
        prob = rg.pixel_chain_refine(
            prob, image, radius=radius, dilation=dilation, sigma_space=sigma_space,
            sigma_color=float(self.sigma_color), steps=int(self.refine_steps),
            nonzero=grid_prob.flatten(2).any(2),  # bilinear upsampling keeps zero maps zero
        )
        if small != size:
            prob = F.interpolate(prob, size=size, mode="bilinear", align_corners=False)
        return prob

    def _finer_regions(self, dist: Tensor, kl: Tensor, labels: Tensor, foreground: Tensor,
                       grid: tuple[int, int]) -> tuple[Tensor, Tensor]:
        """The regions of ``label_tau`` (finer than ``tau``), split along the mask.

        The seeds' distributions merged at ``label_tau`` give finer proposals; every pixel
        takes its most likely one (bilinear on the image, no pixel refinement); with
        ``connectivity`` they are split into components and specks under ``min_area``
        absorbed; then each region is cut along the mask decided at ``tau``, so the mask
        is exactly the one of ``tau``. A region is foreground when its pixels are in the
        mask.

        Returns:
            ``(B, H, W)`` labels and ``(B, K')`` foreground.
        """
        from segment import regions as rg

        b, size = labels.shape[0], tuple(labels.shape[-2:])
        fine = rg.merge_proposals(dist, float(self.label_tau), int(self.iterations), kl=kl)
        grid_prob = rg.soft_assign(fine).view(b, -1, *grid)
        mask = torch.gather(foreground, 1, labels.flatten(1)).view_as(labels)
        # every pixel's most likely proposal, over the image's own proposals (they come
        # first); components and specks before the cut: the mask stays exact
        area = int(round(float(self.min_area) * size[0] * size[1])) if self.connectivity else None
        hard = rg.argmax_regions(grid_prob, fine.count.tolist(), size, area).to(labels.device)
        new = rg.relabel(hard * 2 + mask.long())  # each region cut along the mask
        # every region lies on one side of the mask: its pixels write that side (ids an
        # image does not use stay background)
        fg = torch.zeros(b, int(new.max()) + 1, dtype=torch.bool, device=new.device)
        return new, fg.scatter_(1, new.flatten(1), mask.flatten(1))


# --------------------------------------------------------------------------------------
# k-means of the keys (the unsupervised-segmentation baseline)
# --------------------------------------------------------------------------------------


@dataclass
class KMeansKeys(Method):
    """k-means of the patch keys: the baseline of unsupervised segmentation papers.

    1. features: per grid token, the keys of every head of a selected layer concatenated and
       L2-normalised (:func:`segment.clusters.token_features`); several ``layers`` are
       concatenated (each normalised);
    2. ``k`` clusters by scikit-learn's ``KMeans`` (k-means++ seeding, ``max_iter`` Lloyd
       steps, ``n_init`` restarts, ``random_state = seed``), per image;
    3. the one-hot cluster map on the grid is upsampled bilinearly to the backbone input and
       every pixel takes its argmax (region ids ``0 .. k-1``, as :class:`RegionGrow` gives);
    4. foreground (binary tasks): a cluster whose mean CLS attention (``score_layers``, mean
       of heads, on the grid) exceeds the grid mean; the heatmap is every pixel's cluster
       score under the bilinear soft assignment.

    Returns ``MethodOutput(heatmap, labels, foreground)`` at the backbone input resolution.
    """

    name: str = "kmeans"
    gives_labels: ClassVar[bool] = True
    _averages_layers: ClassVar[bool] = False  # refused below
    k: int = 8
    max_iter: int = 20
    n_init: int = 1
    seed: int = 0
    score_layers: Sequence[int] | int | None = (-1,)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.heads != "mean" or self.average_layers:
            raise ValueError(
                f"{self.name}: k-means clusters the keys of every head concatenated; heads"
                f" ({self.heads!r}) and average_layers ({self.average_layers}) do not apply"
            )
        if int(self.k) < 1 or int(self.max_iter) < 1 or int(self.n_init) < 1:
            raise ValueError(
                f"{self.name}: k, max_iter and n_init must be >= 1, got {self.k}, {self.max_iter},"
                f" {self.n_init}"
            )
        self._score = ClsAttention(name=f"{self.name}.score", layers=self.score_layers,
                                   heads="mean")

    def capture(self, num_layers: int) -> Capture:
        mine = Capture(layers=Capture(layers=self.layers).resolve(num_layers), heads="mean",
                       keys=True)
        return mine.union(self._score.capture(num_layers), num_layers)

    def features(self, record: AttentionRecord) -> Tensor:
        """``(B, n, F)`` the clustered token features."""
        from segment.clusters import token_features

        feats = []
        for i in self._resolve(record):
            if i not in record.keys:
                raise ValueError(
                    f"{self.name}: needs the keys of layer {i}; capture with"
                    " method.capture(num_layers) (Capture.keys)"
                )
            feats.append(token_features(record.keys[i][:, :, record.layout.patches]))
        return torch.cat(feats, -1)

    def __call__(self, record: AttentionRecord) -> MethodOutput:
        from segment import regions as rg
        from segment.clusters import kmeans_labels

        h, w = record.layout.grid
        feats = self.features(record)  # (B, n, F)
        b = feats.shape[0]
        k = int(self.k)
        grid = kmeans_labels(feats, k, int(self.max_iter), int(self.n_init), int(self.seed))
        onehot = F.one_hot(grid, k).to(torch.float32).transpose(1, 2).reshape(b, k, h, w)
        cls = self._score(record).heatmap.float().to(onehot.device)  # (B, h, w)
        score = rg.region_scores(grid.view(b, h, w), cls, k)  # (B, k) mean CLS per cluster
        prob = F.interpolate(onehot, size=tuple(record.image_size), mode="bilinear",
                             align_corners=False)
        labels = prob.argmax(1)  # (B, H, W)
        present = torch.zeros(b, k, dtype=torch.bool, device=labels.device)
        present.scatter_(1, labels.flatten(1), True)
        foreground = (score > cls.flatten(1).mean(1, keepdim=True)) & present
        heat = torch.einsum("bkhw,bk->bhw", prob, score.to(prob))
        return MethodOutput(heatmap=heat, labels=labels, foreground=foreground)


__all__ += ["KMeansKeys"]
