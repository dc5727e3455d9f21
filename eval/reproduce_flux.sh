#!/usr/bin/env bash
# Reproduce every FLUX table of the README in one command, on a GPU machine with hub access
# (FLUX.1-schnell downloads on first use; offline: add model.path=DIR):
#
#   bash eval/reproduce_flux.sh /data/gtsegs_ijcv.mat [HYDRA_OVERRIDES...]
#
# Runs experiment=flux_imagenet_seg (the paper's row and the chain / direction / bounces /
# blocks grid), flux_concept_attention (ConceptAttention's published settings) and
# flux_concept_attention_defaults (its script's defaults) in one process
# (eval/reproduce_flux.py). Tables: eval/results/flux/<experiment>/results.{md,csv,json} +
# config.yaml, and eval/results/flux/manifest.json (device, library versions, git commit,
# seeds, noise level, command). Working folders (cache: rerun to resume, panels):
# outputs/reproduce_flux/. Options before DATA_ROOT's overrides: --out DIR --work DIR
# --device cuda:N --experiments a,b. Extra key=value arguments are Hydra overrides for every
# run, e.g. model.path=/data/FLUX.1-schnell batch_size=1 limit=100.
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: bash eval/reproduce_flux.sh DATA_ROOT [--out DIR] [--device cuda] [HYDRA_OVERRIDES...]" >&2
    exit 2
fi
case "$1" in
    -*) ;;
    *) if [ ! -e "$1" ]; then
           echo "reproduce_flux.sh: $1: no such file or folder (expected gtsegs_ijcv.mat)" >&2
           exit 2
       fi ;;
esac
exec "${PYTHON:-python}" -m segment.eval.reproduce_flux "$@"
