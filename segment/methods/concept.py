"""ConceptAttention (Helbling et al. 2025): the method; the math is segment.core.concept."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from segment.core.concept import concept_heatmaps, gaussian_blur
from segment.core.masks import MethodOutput
from segment.core.record import AttentionRecord, Capture
from segment.methods.base import Method, knob


@dataclass(frozen=True)
class ConceptAttention(Method):
    """ConceptAttention's heatmap of the class concept (concept 0): the concept scores of
    ``layers`` (double-stream layers of a DiT, with ``model.concepts``), softmax over
    concepts, averaged over layers and seeds (heads by their mean)."""

    name: str = knob("concept_attention", "the method's name in tables, manifests and file"
                     " records")
    layers: Sequence[int] | int | None = knob(
        (14, 15, 16, 17), "double-stream layers whose concept scores are averaged (protocol"
        " §3: 14-17 of FLUX's 19)")
    softmax: bool = knob(True, "softmax over the concepts per layer and seed before averaging")
    concept: int = knob(0, "the concept whose map is returned (0 = the class)")
    normalize_concepts: bool = knob(False, "score with the normalised concept vectors"
                                    " (min-shifted, divided by their sum over the concepts, per"
                                    " dimension)")
    blur: Sequence[float] | None = knob(None, "null or [kernel, sigma]: a Gaussian blur of the"
                                        " averaged map ([3, 1.0] = the reference script's"
                                        " --apply_blur)")
    backbones: ClassVar[frozenset[str]] = frozenset({"dit"})  # concept words: text tokens

    def __post_init__(self) -> None:
        super().__post_init__()
        if int(self.concept) < 0:
            raise ValueError(f"{self.name}: concept must be >= 0, got {self.concept}")
        object.__setattr__(self, "concept", int(self.concept))
        object.__setattr__(self, "normalize_concepts", bool(self.normalize_concepts))
        if self.blur is not None:
            vals = list(self.blur) if not isinstance(self.blur, (int, float, str)) else [self.blur]
            if len(vals) != 2:
                raise ValueError(
                    f"{self.name}: blur must be null or [kernel, sigma] (e.g. [3, 1.0]), got {self.blur!r}"
                )
            k, sd = vals
            if float(k) != int(float(k)) or int(float(k)) < 3 or int(float(k)) % 2 == 0 or not float(sd) > 0:
                raise ValueError(
                    f"{self.name}: blur needs an odd kernel >= 3 and sigma > 0, got {self.blur!r}"
                )
            object.__setattr__(self, "blur", (int(float(k)), float(sd)))

    def capture(self, num_layers: int) -> Capture:
        """The scored layers, attention fused and averaged on the fly (not read here)."""
        try:
            layers = Capture(layers=self.layers).resolve(num_layers)
        except ValueError as e:  # e.g. the protocol's layers 14-17 asked of a 12-block ViT
            raise ValueError(
                f"{self.name}: {e}; it scores concept words in a DiT's double-stream layers"
                " (model=flux_schnell or flux_dev: layers 14-17 of 19); set method.layers to"
                " double-stream layers this model has"
            ) from e
        return Capture(layers=layers, heads="mean", average_layers=len(layers) > 1)

    def __call__(self, record: AttentionRecord) -> MethodOutput:
        key = "concept_scores_normalized" if self.normalize_concepts else "concept_scores"
        scores = record.extras.get(key)
        tags = record.extras.get("concept_layers")
        if scores is None or tags is None:
            raise ValueError(
                f"{self.name}: the record has no concept scores; use a DiT backbone with concept"
                " words (model=flux_schnell, model.concepts=[...]) and capture its double-stream"
                " layers"
            )
        layers = self._resolve(record)
        tags = tags.to(scores.device)
        missing = [i for i in layers if not bool((tags == i).any())]
        if missing:
            have = sorted({int(t) for t in tags.tolist()})
            raise ValueError(
                f"{self.name}: no concept scores for layers {missing} (have {have}; concepts"
                " are scored on double-stream layers only)"
            )
        keep = torch.isin(tags, torch.as_tensor(layers, device=tags.device))
        maps = concept_heatmaps(scores[:, keep], softmax=self.softmax)  # (B, C, P)
        if self.concept >= maps.shape[1]:
            raise ValueError(f"{self.name}: concept {self.concept} of {maps.shape[1]} concepts")
        h, w = record.layout.grid
        if maps.shape[-1] != h * w:
            raise ValueError(f"{self.name}: {maps.shape[-1]} image tokens for a {h}x{w} grid")
        heat = maps[:, self.concept].reshape(maps.shape[0], h, w)
        if self.blur is not None:
            heat = gaussian_blur(heat, *self.blur)
        return MethodOutput(heatmap=heat)
