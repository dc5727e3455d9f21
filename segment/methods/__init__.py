"""Heatmap segmentation methods: attention chains read from an :class:`AttentionRecord`.

A method says what it needs from the backbone (:meth:`Method.capture`) and turns the
record into a foreground heatmap on the patch grid (:meth:`Method.__call__`,
``MethodOutput.heatmap`` of shape ``(B, h, w)``); masks follow protocol §3 in
:mod:`segment.core.masks`. Methods read only the record: the start tokens come from
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
  ``alpha P + (1 - alpha) 11^T / n`` (:func:`segment.core.markov.tokenrank`).

``bounce`` and ``tokenrank`` take ``chain: grid`` (the definitions above) or ``chain: joint``:
the full chain over all ``N`` captured tokens, ``T = alpha A + (1 - alpha) 11^T / N``
(damping applied implicitly, so nothing larger than ``A`` is formed), ``bounce`` giving
``[s^T T^n]_grid`` and ``tokenrank`` the grid slice of ``T``'s stationary vector (neither
renormalised over the grid). ``direction: source`` runs either on the reverse chain
(:func:`segment.core.markov.reverse_chain`; of ``T`` for the joint chain and TokenRank, of ``A``
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
heatmaps. ``rollout`` instead multiplies the selected layers and ``regions`` and ``cuts``
always average their chains: ``average_layers`` is a setting of ``cls_attention``, ``bounce``
and ``tokenrank`` only (:class:`AveragesLayers`), ``heads`` of the methods that fuse heads
(:class:`FusesHeads`); ``kmeans`` and ``concept_attention`` have neither. Each setting's help
text is its dataclass field's (:func:`knob`); docs/methods.md's tables are generated from them
(:mod:`segment.methods.settings`).

The same record can serve several methods: the evaluator captures
``Capture.union`` of their captures once. A method then fuses heads and averages layers
itself when the record holds them separately, and refuses (clear error) a record whose
reduction cannot give its answer (heads fused when it needs them kept, or layers averaged
differently).
"""

from segment.methods.attention import ClsAttention, ClsKeyChain, Rollout, keychain_step
from segment.methods.base import (
    AveragesLayers,
    FusesHeads,
    Method,
    grid_weights,
    knob,
    patch_chain,
    refuse_inactive,
    start_distribution,
)
from segment.methods.chains import Bounce, TokenRank
from segment.methods.concept import ConceptAttention
from segment.methods.cuts import EscapeCuts
from segment.methods.kmeans import KMeansKeys
from segment.methods.regions import RegionGrow

__all__ = [
    "AveragesLayers",
    "Bounce",
    "ClsAttention",
    "ClsKeyChain",
    "ConceptAttention",
    "EscapeCuts",
    "FusesHeads",
    "KMeansKeys",
    "Method",
    "RegionGrow",
    "Rollout",
    "TokenRank",
    "grid_weights",
    "keychain_step",
    "knob",
    "patch_chain",
    "refuse_inactive",
    "start_distribution",
]
