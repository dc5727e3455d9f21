"""timm Vision Transformers as :class:`~segment.models.base.Backbone` (DINOv2, DINO, CLIP, ViT).

One class, :class:`TimmViT`, serves every timm ``VisionTransformer``: the architecture is a
timm model name, the weights come from the hub (``pretrained=true``) or from a local file
(``checkpoint=PATH``), and attention is captured with forward hooks on each selected block's
``attn.q_norm`` and ``attn.k_norm``: the probabilities are computed beside the block from its
own ``q`` and ``k`` while the block runs timm's fused attention, so capture never changes
the forward (:meth:`TimmViT.extract`).

Positional embeddings are kept at the grid they were trained for (e.g. 37 x 37 for DINOv2)
and resampled once per input grid with ``F.interpolate(mode='bicubic',
align_corners=False, antialias=False)`` (protocol §5; timm's own dynamic resampling uses
antialias and differs by a few percent). Any input size that is a multiple of the patch
size works, non-square included; the resampled tables are cached per grid.

Adding a backbone
-----------------
Any timm ``VisionTransformer`` needs one file ``configs/model/<name>.yaml`` and no code::

    _target_: segment.models.vit.TimmViT
    name: dino_vitb16
    arch: vit_base_patch16_224.dino     # any timm VisionTransformer name (with its tag)
    pretrained: true                    # hub download unless `checkpoint` is set
    checkpoint: null                    # local safetensors / torch state dict
    image_size: 224                     # int or [H, W], a multiple of the patch size
    mean: null                          # null = timm's pretrained config
    std: null
    model_kwargs: {}                    # extra timm.create_model arguments
    device: ${device}
    dtype: float32

Then ``segment model=dino_vitb16``. A model family timm does not implement as a
``VisionTransformer`` (e.g. a diffusion transformer) gets one file in ``models/``
implementing :class:`~segment.models.base.Backbone` (``preprocess``, ``extract``,
``forward_plain``), returning the same :class:`~segment.core.record.AttentionRecord`.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from segment.models.base import Backbone, KeptForward
from segment.models.hub import hub_offline, hub_unavailable
from torch import Tensor

from segment.core.record import AttentionRecord, Capture, TokenLayout
from segment.core.reduce import AttentionReducer
from segment.utils import resolve_device

__all__ = ["TimmViT", "check_pretrained_reachable", "load_state_dict", "resample_pos_embed"]

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64,  # references in tests
}
_WRAPPERS = ("model", "state_dict", "model_state_dict", "module", "teacher", "student")


def _pair(size: int | Sequence[int], what: str) -> tuple[int, int]:
    if isinstance(size, int):
        return (size, size)
    vals = tuple(int(v) for v in size)
    if len(vals) != 2:
        raise ValueError(f"{what} must be an int or [H, W], got {size!r}")
    return vals  # type: ignore[return-value]


def resample_pos_embed(
    pos_embed: Tensor,
    src_grid: tuple[int, int],
    dst_grid: tuple[int, int],
    num_prefix: int,
) -> Tensor:
    """Resample an absolute position table to another patch grid (protocol §5).

    ``F.interpolate(mode='bicubic', align_corners=False, antialias=False)`` on the grid part,
    computed in fp32; the prefix entries (CLS, when the table has one) are kept as they are.

    Args:
        pos_embed: ``(1, num_prefix + h0 * w0, C)`` table for ``src_grid = (h0, w0)``.
        src_grid: grid the table was trained for.
        dst_grid: target grid ``(h, w)``.
        num_prefix: leading entries that are not grid positions.

    Returns:
        ``(1, num_prefix + h * w, C)`` in the dtype of ``pos_embed``.
    """
    h0, w0 = src_grid
    if pos_embed.shape[1] != num_prefix + h0 * w0:
        raise ValueError(
            f"pos_embed has {pos_embed.shape[1]} entries, expected {num_prefix} + {h0}x{w0}"
        )
    if tuple(dst_grid) == tuple(src_grid):
        return pos_embed
    prefix, grid = pos_embed[:, :num_prefix], pos_embed[:, num_prefix:]
    c = grid.shape[-1]
    g = grid.float().reshape(1, h0, w0, c).permute(0, 3, 1, 2)  # (1, C, h0, w0)
    g = F.interpolate(g, size=tuple(dst_grid), mode="bicubic", align_corners=False,
                      antialias=False)
    g = g.permute(0, 2, 3, 1).reshape(1, -1, c).to(pos_embed.dtype)
    return torch.cat([prefix, g], dim=1)


def load_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """Read a checkpoint: ``.safetensors`` or a torch file (``torch.load``, weights only).

    Common wrappers are unwrapped: ``{'model': ...}``, ``{'state_dict': ...}``,
    ``{'model_state_dict': ...}``, ``{'teacher': ...}`` and a ``module.`` key prefix (DDP).

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: when the file cannot be read as a state dict (names the file).
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"model.checkpoint: no such file: {p}")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd: Any = load_file(str(p), device="cpu")
        else:
            sd = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any reader failure is a bad file for the user
        raise ValueError(
            f"model.checkpoint: cannot read {p} as safetensors or a torch state dict:"
            f" {type(e).__name__}: {e}"
        ) from e
    for _ in range(3):  # nested wrappers, e.g. {'model': {'state_dict': ...}}
        if isinstance(sd, Mapping) and not any(isinstance(v, Tensor) for v in sd.values()):
            key = next((k for k in _WRAPPERS if isinstance(sd.get(k), Mapping)), None)
            if key is None:
                break
            sd = sd[key]
    if not isinstance(sd, Mapping) or not any(isinstance(v, Tensor) for v in sd.values()):
        raise ValueError(
            f"model.checkpoint: {p} holds no tensors at the top level or under"
            f" {list(_WRAPPERS)}; expected a state dict"
        )
    sd = {k: v for k, v in sd.items() if isinstance(v, Tensor)}
    if all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return sd


class _Captured(Exception):  # noqa: N818 - control flow, not an error
    """Raised by the hook of the last captured layer: the rest of the forward is not needed."""


def check_pretrained_reachable(arch: str, name: str | None = None) -> bool:
    """Fail within seconds when the pretrained weights of ``arch`` are neither cached nor
    downloadable, instead of letting the hub client retry for a minute.

    Cached = the Hugging Face cache holds a weights file of the model's hub repository, or
    timm's old torch-hub cache holds the file of its URL. Otherwise the hub must be
    reachable: ``HF_HUB_OFFLINE=1`` says it is not; else one TCP connection to
    ``HF_ENDPOINT`` (default https://huggingface.co) is tried with a 3 s timeout.

    Returns:
        ``True`` when the weights are cached and the hub is not reachable: load them with
        the hub client in offline mode (:class:`segment.models.hub.hub_offline`), which
        skips its retries.

    Raises:
        RuntimeError: one message naming ``model.checkpoint=PATH`` and the cache folder.
    """
    from timm.models import get_pretrained_cfg

    pcfg = get_pretrained_cfg(arch)
    repo = getattr(pcfg, "hf_hub_id", None) if pcfg is not None else None
    if not repo:
        return  # weights from a plain URL only: timm's own download and errors
    from huggingface_hub import constants, try_to_load_from_cache

    names = [getattr(pcfg, "hf_hub_filename", None), "model.safetensors", "pytorch_model.bin",
             "open_clip_model.safetensors", "open_clip_pytorch_model.bin"]
    cached = any(isinstance(try_to_load_from_cache(repo, fn, cache_dir=constants.HF_HUB_CACHE), str)
                 for fn in filter(None, names))
    if cached:  # offline too: the hub client's offline mode then only restates HF_HUB_OFFLINE
        return hub_unavailable() is not None
    url = getattr(pcfg, "url", None)
    if url:
        old = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url.split("?")[0])
        if old.is_file():
            return False
    why = hub_unavailable()
    if why is None:
        return False
    raise RuntimeError(
        f"{name or arch}: pretrained weights {repo} are not in the cache "
        f"{constants.HF_HUB_CACHE} and cannot be downloaded ({why}); pass a local file with "
        f"model.checkpoint=PATH (.safetensors or torch state dict; in Python "
        f"segment.load(checkpoint=PATH)), or download the weights "
        f"on a connected machine into that cache (HF_HOME)"
    )


class TimmViT(Backbone):
    """A timm ``VisionTransformer`` whose attention is read as Markov chains.

    Args:
        arch: timm model name, e.g. ``vit_small_patch14_dinov2.lvd142m``.
        name: short name for tables and manifests (default: ``arch``).
        pretrained: download the pretrained weights from the hub (timm) when no
            ``checkpoint`` is given; ``False`` with no checkpoint = random init (tests).
        checkpoint: local weights, safetensors or a torch state dict in timm format or any
            format timm's ViT checkpoint filter converts (original DINOv2, OpenAI CLIP).
        image_size: backbone input ``int`` or ``(H, W)``; multiples of the patch size.
        match_orientation: give a photo whose orientation differs from ``image_size``'s
            (portrait vs landscape) the transposed size ``(W, H)``, so that its long side is
            the input's long side (BSDS500's 481 x 321 and 321 x 481 photos at ``[294, 448]``:
            294 x 448 and 448 x 294); square sizes and square photos are unaffected.
        mean, std: normalisation (``None`` = the model's timm pretrained config).
        model_kwargs: extra ``timm.create_model`` arguments (e.g. ``embed_dim``, ``depth``
            for tiny random test models).
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ...
        dtype: ``"float32"``, ``"float16"``, ``"bfloat16"`` (or ``"float64"``) for the weights
            (attention is handed to the reducer in fp32 either way).

    Raises:
        RuntimeError: when ``pretrained`` weights cannot be downloaded (says how to pass
            ``model.checkpoint``).
        ValueError: for a checkpoint that does not fit ``arch`` or an image size that is not
            a multiple of the patch size.
    """

    text_conditioned = False  # prompts are ignored
    provides_pixels = True  # records carry the input as RGB in [0, 1] (AttentionRecord.pixels)
    kind = "vit"

    def __init__(
        self,
        arch: str,
        *,
        name: str | None = None,
        pretrained: bool = True,
        checkpoint: str | os.PathLike | None = None,
        image_size: int | Sequence[int] = 224,
        match_orientation: bool = False,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        model_kwargs: Mapping[str, Any] | None = None,
        device: str | torch.device | None = "auto",
        dtype: str | torch.dtype = "float32",
    ) -> None:
        import timm

        self.arch = arch
        self.name = name or arch
        self.device = resolve_device(device)
        self.dtype = dtype if isinstance(dtype, torch.dtype) else _DTYPES.get(str(dtype))
        if self.dtype is None:
            raise ValueError(f"model.dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        kwargs = dict(model_kwargs or {})
        kwargs.setdefault("num_classes", 0)  # the classifier is never used
        if checkpoint:
            model = self._from_checkpoint(arch, Path(checkpoint), kwargs)
        elif pretrained:
            cache_only = check_pretrained_reachable(arch, self.name)
            try:
                with hub_offline() if cache_only else contextlib.nullcontext():
                    model = timm.create_model(arch, pretrained=True, **kwargs)
            except Exception as e:  # noqa: BLE001 - hub / network / cache errors vary
                raise RuntimeError(
                    f"could not load pretrained weights for {arch!r} from the hub"
                    f" ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})."
                    " On an offline machine pass a local file: model.checkpoint=PATH"
                    " (a .safetensors or torch state dict of this architecture), or put the"
                    " weights in the Hugging Face cache (HF_HOME)."
                ) from e
        else:
            model = timm.create_model(arch, pretrained=False, **kwargs)
        if not hasattr(model, "blocks") or not hasattr(model, "forward_intermediates"):
            raise ValueError(f"{arch!r} is not a timm VisionTransformer (no .blocks)")
        # the position table as trained (fp32); resampled per input grid on demand
        no_embed_class = getattr(model, "no_embed_class", False)
        self._pos_prefix = 0 if no_embed_class else int(model.num_prefix_tokens)
        self._pos_src = (
            None if model.pos_embed is None
            else model.pos_embed.detach().float().clone().to(self.device)
        )
        self._src_grid = tuple(model.patch_embed.grid_size)
        self._pos_cache: dict[tuple[int, int], Tensor] = {}
        self._grid: tuple[int, int] | None = None
        self.model = model.eval().to(device=self.device, dtype=self.dtype)
        self.model.requires_grad_(False)

        self.patch_size = _pair(model.patch_embed.patch_size, "patch_size")
        self.image_size = _pair(image_size, "model.image_size")
        self._check_size(self.image_size, "model.image_size")
        if not isinstance(match_orientation, bool):
            raise ValueError(f"model.match_orientation must be true or false, got {match_orientation!r}")
        self.match_orientation = match_orientation
        cfg = getattr(model, "pretrained_cfg", None) or {}
        mean = mean if mean is not None else cfg.get("mean", (0.5,) * 3)
        std = std if std is not None else cfg.get("std", (0.5,) * 3)
        self.mean = tuple(float(v) for v in mean)
        self.std = tuple(float(v) for v in std)
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise ValueError(f"model.mean/std need 3 values (std > 0), got {self.mean}, {self.std}")

        self.num_layers = len(model.blocks)
        self.num_heads = int(model.blocks[0].attn.num_heads)
        self.num_prefix = int(model.num_prefix_tokens)
        self.num_registers = int(getattr(model, "num_reg_tokens", 0))
        self.cls_index = 0 if getattr(model, "cls_token", None) is not None else None
        for blk in model.blocks:  # the only path: capture computes probabilities beside it
            blk.attn.fused_attn = True

    # ----------------------------------------------------------------------------------
    # weights
    # ----------------------------------------------------------------------------------

    def _from_checkpoint(self, arch: str, path: Path, kwargs: dict[str, Any]) -> nn.Module:
        import timm
        from timm.models.vision_transformer import checkpoint_filter_fn

        sd = load_state_dict(path)
        model = timm.create_model(arch, pretrained=False, **kwargs)
        # build the model at the grid of the checkpoint's position table, so that timm's
        # filter does not resample it (we resample per input size, without antialias)
        grid = self._checkpoint_grid(sd, model, path)
        if grid is not None and grid != tuple(model.patch_embed.grid_size):
            p = model.patch_embed.patch_size
            kwargs = {**kwargs, "img_size": (grid[0] * p[0], grid[1] * p[1])}
            model = timm.create_model(arch, pretrained=False, **kwargs)
        try:
            sd = checkpoint_filter_fn(sd, model)
        except Exception as e:  # noqa: BLE001
            raise ValueError(
                f"model.checkpoint: {path} could not be converted for {arch!r}:"
                f" {type(e).__name__}: {e}"
            ) from e
        if isinstance(model.head, nn.Identity):
            sd = {k: v for k, v in sd.items() if not k.startswith("head.")}
        own = model.state_dict()
        missing = sorted(set(own) - set(sd))
        unexpected = sorted(set(sd) - set(own))
        wrong = [
            f"{k}: {tuple(sd[k].shape)} vs {tuple(own[k].shape)}"
            for k in sorted(set(sd) & set(own)) if sd[k].shape != own[k].shape
        ]
        if missing or unexpected or wrong:
            raise ValueError(
                f"model.checkpoint: {path} does not fit {arch!r}"
                + (f"; missing {len(missing)} keys (e.g. {missing[:4]})" if missing else "")
                + (f"; unexpected {len(unexpected)} keys (e.g. {unexpected[:4]})"
                   if unexpected else "")
                + (f"; shape mismatch: {wrong[:4]}" if wrong else "")
            )
        model.load_state_dict(sd, strict=True)
        return model

    @staticmethod
    def _checkpoint_grid(
        sd: Mapping[str, Tensor], model: nn.Module, path: Path
    ) -> tuple[int, int] | None:
        """The (square) patch grid of the checkpoint's position table, if it has one."""
        keys = [k for k in sd if k.endswith("pos_embed") or k.endswith("positional_embedding")]
        if not keys or model.pos_embed is None:
            return None
        n = sd[min(keys, key=len)].shape[-2]
        prefix = 0 if getattr(model, "no_embed_class", False) else int(model.num_prefix_tokens)
        own = tuple(model.patch_embed.grid_size)
        if n - prefix == own[0] * own[1]:
            return own
        side = math.isqrt(max(n - prefix, 0))
        if side * side != n - prefix or side == 0:
            raise ValueError(
                f"model.checkpoint: {path} has a position table of {n} entries, which is not"
                f" {prefix} prefix + a square grid; it does not fit"
                f" {model.default_cfg.get('architecture')}"
            )
        return (side, side)

    # ----------------------------------------------------------------------------------
    # input
    # ----------------------------------------------------------------------------------

    def _check_size(self, size: tuple[int, int], what: str) -> None:
        ph, pw = self.patch_size
        h, w = size
        if h < ph or w < pw or h % ph or w % pw:
            hint = (max(ph, round(h / ph) * ph), max(pw, round(w / pw) * pw))
            raise ValueError(
                f"{what} {h}x{w} is not a multiple of the patch size {ph}x{pw} of {self.name};"
                f" use e.g. {hint[0]}x{hint[1]}"
            )

    def grid_size(self, image_size: tuple[int, int] | None = None) -> tuple[int, int]:
        """Patch grid ``(h, w)`` for an input of ``image_size`` pixels (default: configured)."""
        h, w = image_size or self.image_size
        return (h // self.patch_size[0], w // self.patch_size[1])

    def input_size(self, image: Image.Image) -> tuple[int, int] | None:
        """``(H, W)`` of the input for ``image``: ``image_size``, transposed for a photo of the
        other orientation when ``match_orientation``; ``None`` (every image the same) when not."""
        if not self.match_orientation:
            return None
        h, w = self.image_size
        pw, ph = image.size
        if h != w and pw != ph and (ph > pw) != (h > w):
            return (w, h)
        return (h, w)

    def preprocess(self, image: Image.Image) -> Tensor:
        """PIL image -> ``(3, H, W)``: RGB, Pillow bilinear resize to ``image_size`` (see
        :meth:`input_size` for ``match_orientation``), /255, normalised with ``mean``/``std``
        (ecssd-dev REFERENCE.md, exactly)."""
        if image.mode != "RGB":
            image = image.convert("RGB")
        h, w = self.input_size(image) or self.image_size
        if image.size != (w, h):
            image = image.resize((w, h), Image.BILINEAR)
        x = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        mean = torch.tensor(self.mean).view(3, 1, 1)
        std = torch.tensor(self.std).view(3, 1, 1)
        return (x - mean) / std

    def _set_grid(self, pixels: Tensor) -> tuple[int, int]:
        """Point the model at the grid of ``pixels`` (B, 3, H, W); returns ``(h, w)``."""
        if pixels.dim() != 4 or pixels.shape[1] != 3:
            raise ValueError(f"pixels must be (B, 3, H, W), got {tuple(pixels.shape)}")
        size = (int(pixels.shape[-2]), int(pixels.shape[-1]))
        self._check_size(size, "input")
        grid = self.grid_size(size)
        if grid == self._grid:
            return grid
        m = self.model
        m.patch_embed.set_input_size(img_size=size)
        if self._pos_src is not None:
            pos = self._pos_cache.get(grid)
            if pos is None:
                pos = resample_pos_embed(self._pos_src, self._src_grid, grid, self._pos_prefix)
                pos = pos.to(self.dtype)
                self._pos_cache[grid] = pos
            m.pos_embed = nn.Parameter(pos, requires_grad=False)
        self._grid = grid
        return grid

    def layout(self, grid: tuple[int, int]) -> TokenLayout:
        """Token layout ``[CLS][registers][h x w patches]`` for a patch grid."""
        return TokenLayout(
            num_tokens=self.num_prefix + grid[0] * grid[1],
            prefix=self.num_prefix,
            grid=grid,
            cls_index=self.cls_index,
            num_registers=self.num_registers,
            kind="vit",
        )

    # ----------------------------------------------------------------------------------
    # forward passes
    # ----------------------------------------------------------------------------------

    def extract(
        self,
        pixels: Tensor,
        capture: Capture,
        *,
        prompts: Sequence[str] | None = None,
    ) -> AttentionRecord:
        """Run the blocks up to the last captured one and capture their attention.

        Capture never changes the forward: every block runs timm's own fused attention
        (``F.scaled_dot_product_attention``), captured or not, and a captured block's
        probabilities ``(B, H, N, N)`` are computed beside it from its own ``q`` and ``k``
        (forward hooks on ``attn.q_norm`` and ``attn.k_norm``) with the very operations of
        timm's manual path (``softmax((q * scale) @ k^T)``), then handed to an
        :class:`~segment.core.reduce.AttentionReducer`; the keys ``(B, H, N, D)`` go with
        them when ``capture.keys``. So which layers are captured (one, or every layer for
        rollout) never moves a float of any block's output, and the probabilities are
        those the block's manual path would compute. Nothing after the last captured
        probabilities is run: neither the rest of that block (its attention, the
        projection, the MLP) nor the blocks after it (the hook ends the forward; a record
        holds attention and keys only).

        Args:
            pixels: ``(B, 3, H, W)`` preprocessed images (H, W multiples of the patch size).
            capture: layers and on-the-fly reduction.
            prompts: ignored (image-only model).

        Returns:
            The :class:`~segment.core.record.AttentionRecord` (attention in fp32, on the model's
            device).
        """
        grid = self._set_grid(pixels)
        reducer = AttentionReducer(capture, self.num_layers, self.layout(grid))
        queries: dict[int, Tensor] = {}
        handles = []
        blocks = self.model.blocks

        last = max(reducer.layers)

        def on_queries(layer: int):
            def hook(_mod: nn.Module, _inp: Any, q: Tensor) -> None:
                queries[layer] = q  # (B, H, N, D), after q_norm
            return hook

        def on_keys(layer: int):
            def hook(_mod: nn.Module, _inp: Any, k: Tensor) -> None:
                q = queries.pop(layer, None)
                if q is None:
                    raise RuntimeError(
                        f"block {layer}: attn.k_norm ran before attn.q_norm; this timm"
                        " version's Attention orders q and k differently from the one"
                        " segment captures from (timm >= 1.0.15)"
                    )
                attn = blocks[layer].attn
                probs = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)  # (B, H, N, N)
                reducer.update(layer, probs, k if capture.keys else None)
                if layer == last:
                    raise _Captured
            return hook

        try:
            for i in reducer.layers:
                attn = blocks[i].attn
                handles.append(attn.q_norm.register_forward_hook(on_queries(i)))
                handles.append(attn.k_norm.register_forward_hook(on_keys(i)))
            x = pixels.to(device=self.device, dtype=self.dtype)
            with torch.no_grad(), contextlib.suppress(_Captured):
                self.model.forward_intermediates(
                    x, indices=[last], stop_early=True, intermediates_only=True,
                    output_fmt="NLC",
                )
        finally:
            for h in handles:
                h.remove()
        mean = torch.tensor(self.mean, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(1, 3, 1, 1)
        rgb = (x.float() * std + mean).clamp_(0, 1)  # the input as RGB in [0, 1]
        return reducer.record(
            image_size=(int(pixels.shape[-2]), int(pixels.shape[-1])), pixels=rgb
        )

    def forward_plain(self, pixels: Tensor) -> Tensor:
        """The bare fused forward (``forward_features``): ``(B, N, C)`` final tokens."""
        self._set_grid(pixels)
        with torch.no_grad():
            return self.model.forward_features(pixels.to(device=self.device, dtype=self.dtype))

    can_drop_tokens = True

    @property
    def num_classes(self) -> int:
        """Classes of the model's classifier head; 0 when it has none (the default: build
        with ``model_kwargs.num_classes=1000`` and ImageNet weights to keep the head)."""
        return int(getattr(self.model, "num_classes", 0) or 0)

    def forward_kept(self, pixels: Tensor, keep: Tensor) -> KeptForward:
        """Run the model on the prefix tokens (CLS, registers) and the patch tokens ``keep``.

        The patches are embedded and given their own positional embeddings as in the full
        forward (``patch_embed``, then CLS/registers and the position table of the input's
        grid); then only the prefix and the kept patches enter the blocks, in the order of
        ``keep``. A ViT with absolute positions has no other dependence on the sequence, so
        this equals the model run on an image made only of the kept patches (token
        dropping, as in MAE / token-masking experiments). Nothing is padded: every row of
        ``keep`` has the same length ``K``.

        Args:
            pixels: ``(B, 3, H, W)`` preprocessed images (``(1, 3, H, W)`` is broadcast to
                the rows of ``keep``).
            keep: ``(B, K)`` int64 indices of the patches to keep, row-major in ``[0, h*w)``,
                ``K >= 1``.

        Returns:
            :class:`~segment.models.base.KeptForward`: the pooled final embedding (the final
            CLS token, normalised, for CLS-pooled models) and the logits when the model has a
            classifier head.

        Raises:
            ValueError: for indices outside the grid or shapes that do not fit.
        """
        grid = self._set_grid(pixels)
        n = grid[0] * grid[1]
        if keep.dim() != 2 or keep.shape[1] < 1:
            raise ValueError(f"keep must be (B, K) patch indices with K >= 1, got {tuple(keep.shape)}")
        if pixels.shape[0] not in (1, keep.shape[0]):
            raise ValueError(
                f"pixels hold {pixels.shape[0]} images for {keep.shape[0]} rows of keep;"
                " pass one image or one per row"
            )
        keep = keep.to(device=self.device, dtype=torch.long)
        if bool(((keep < 0) | (keep >= n)).any()):
            raise ValueError(f"keep indices must lie in [0, {n}) for a {grid[0]}x{grid[1]} grid")
        m = self.model
        with torch.no_grad():
            x = m.patch_embed(pixels.to(device=self.device, dtype=self.dtype))
            x = x.reshape(x.shape[0], n, x.shape[-1])  # (B', n, C)
            x = m._pos_embed(x)  # (B', P + n, C): prefix + patches, positions added
            x = x.expand(keep.shape[0], -1, -1)
            p = self.num_prefix
            idx = keep.unsqueeze(-1).expand(-1, -1, x.shape[-1])  # (B, K, C)
            x = torch.cat([x[:, :p], torch.gather(x[:, p:], 1, idx)], dim=1)  # (B, P + K, C)
            x = m.norm_pre(m.patch_drop(x))
            x = m.norm(m.blocks(x))
            emb = m.forward_head(x, pre_logits=True)  # (B, C)
            logits = m.head(emb).float() if self.num_classes else None
        return KeptForward(embedding=emb.float(), logits=logits, num_tokens=int(x.shape[1]))

    def __repr__(self) -> str:
        return (
            f"TimmViT(name={self.name!r}, arch={self.arch!r}, image_size={self.image_size},"
            f" layers={self.num_layers}, heads={self.num_heads}, prefix={self.num_prefix},"
            f" device={self.device}, dtype={self.dtype})"
        )
