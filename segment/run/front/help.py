"""The ``--help`` text of the commands (``hydra.help.template`` in ``configs/segment.yaml``,
``configs/eval.yaml`` and ``configs/diagnose.yaml`` interpolates ``${segment_help:COMMAND}``)."""

from __future__ import annotations

import textwrap

from omegaconf import OmegaConf

from segment.run.front.compose import COMMAND_GROUPS, config_names


_HELP = {
    "segment": dict(
        what="segment every image of a folder: masks, heatmaps, overlays, region labels, COCO "
             "annotations and an index.html gallery (attention read as Markov chains)",
        usage="segment [PATH | input=DIR|FILE] [output=DIR] [model=NAME] [method=NAME] [KEY=VALUE ...]",
        examples=[
            ("segment output=results/ model.checkpoint=/path/dinov2_vits14.safetensors",
             "offline: local weights, the bundled example photos"),
            ("segment photos/ output=trial/ limit=10", "the hub's weights (cached); a bare path is input=;"
             " limit=10: the first 10"),
            ("segment input=photos/ output=results/ model=dinov2_vitb14_reg4 device=cuda batch_size=32", ""),
            ("torchrun --nproc_per_node=4 -m segment input=photos/ output=results/",
             "several processes (GPUs: device=cuda; CPUs: gloo), one node or many"),
        ],
        required=[
            ("input=DIR", "a folder (read recursively) or one image; default: the bundled examples"),
            ("output=DIR", "the results folder; default: outputs/segment (a rerun resumes)"),
            ("model.checkpoint=PATH", "offline machines: local weights (.safetensors / torch state dict)"),
        ],
        settings="device=auto|cpu|cuda  batch_size=8  overwrite=false  retry_skipped=false  limit=N\n"
                 "  num_workers  max_pixels  min_size  progress=true  label_upsampling=smooth|nearest\n"
                 "  render.{colormap,overlay_alpha,jpeg_quality,png_compression,thumb_size,fsync}",
    ),
    "segment-diagnose": dict(
        what="attention diagnostics: every layer and head read as a Markov chain (entropy, "
             "sinks, |lambda_2|, metastable states, exact TokenRank, stable rank), averaged "
             "over images, written as diagnostics.json/.csv and report.html",
        usage="segment-diagnose [input=DIR|FILE] [output=DIR] [model=NAME] [compare=NAME] "
              "[KEY=VALUE ...]",
        examples=[
            ("segment-diagnose output=diag/ model.checkpoint=/path/dinov2_vits14.safetensors",
             "offline: local weights, the bundled example photos"),
            ("segment-diagnose input=photos/ output=diag/ model=dinov2_vits14 compare=dinov2_vits14_reg4",
             "two models side by side (registers), with the per-measure difference"),
        ],
        required=[
            ("input=DIR", "a folder (read recursively) or one image; default: the bundled examples"),
            ("output=DIR", "the results folder; default: outputs/diagnose"),
            ("model.checkpoint=PATH", "offline machines: local weights (.safetensors / torch state dict)"),
            ("compare=NAME", "a second model (configs/model); compare_checkpoint=PATH its weights"),
        ],
        settings="device=auto|cpu|cuda  per_image=false  report=true  progress=true\n"
                 "  alpha=0.99 (TokenRank damping)  threshold=0.9 (metastable moduli)  top=0.01",
    ),
    "segment-eval": dict(
        what="score segmentation methods on a benchmark (pixAcc, mIoU, mIoU_CA, mAP) from one "
             "backbone pass per batch",
        usage="segment-eval dataset=NAME dataset.root=PATH [model=NAME] [method=NAME] "
              "[experiment=NAME] [KEY=VALUE ...]",
        examples=[
            ("segment-eval dataset=folder dataset.root=/data/ECSSD model.checkpoint=/path/dinov2_vits14.safetensors",
             "offline: local weights"),
            ("segment-eval experiment=vit_imagenet_seg dataset.root=/data/gtsegs_ijcv.mat", "the ViT rows of a table"),
            ("segment-eval dataset.root=/data/ECSSD 'methods=[rollout,tokenrank]' limit=50 output=eval_out/", ""),
        ],
        required=[
            ("dataset.root=PATH", "the data set (required)"),
            ("output=DIR", "results folder (default outputs/eval/DATE/TIME); the same output= resumes"),
            ("model.checkpoint=PATH", "offline machines: local weights"),
        ],
        settings="methods=[...]  include_default=true  device=auto  batch_size=8  num_workers=0  limit=N\n"
                 "  bootstrap=1000 (95% intervals; 0 = off)  mask_at=image|grid  cache=true  panels=4\n"
                 "  progress=true  seed=0  eigen=null (the cuts' eigensolver: krylov|torch|scipy)",
    ),
}


def help_text(command: str) -> str:
    """The ``--help`` text of a command (groups listed from the installed configs)."""
    h = _HELP[command]
    groups = COMMAND_GROUPS[command]
    lines = [textwrap.fill(f"{command}: {h['what']}.", width=96), "", "Usage:", f"  {h['usage']}", "", "Examples:"]
    for cmd, note in h["examples"]:
        lines.append(f"  {cmd}" + (f"\n      # {note}" if note else ""))
    lines += ["", "Required keys and the usual ones:"]
    lines += [f"  {k:<22} {v}" for k, v in h["required"]]
    lines += ["", "Config groups (GROUP=NAME):"]
    for g in groups:
        lines.append(textwrap.fill(", ".join(config_names(g)), width=96, initial_indent=f"  {g:<11} ",
                                   subsequent_indent=" " * 14, break_on_hyphens=False))
    lines += ["", "Settings (KEY=VALUE):", f"  {h['settings']}",
              "  model.KEY / method.KEY: the keys of the chosen configs; list them with",
              f"  `{command} [model=NAME] [method=NAME] --cfg job`",
              "", textwrap.fill("Exit codes: 0 done, 1 nothing could be processed" + (
                  " or the output folder could not be written (a full disk: a rerun resumes)"
                  if command == "segment" else "") + ", 2 unusable input or settings, " + (
                  "3 the output folder is in use by another run, " if command == "segment" else "")
                  + "130 interrupted.", width=96),
              "Python: import segment; seg = segment.load(model=..., method=...); seg(image)",
              "Hydra's own options: --hydra-help"]
    return "\n".join(lines).replace("$", "$$")


def register_help_resolver() -> None:
    """``${segment_help:COMMAND}`` for ``hydra.help.template``."""
    if not OmegaConf.has_resolver("segment_help"):
        OmegaConf.register_new_resolver("segment_help", help_text)
