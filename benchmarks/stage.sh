#!/usr/bin/env bash
# Stage what the benchmark suite needs on the GPU machine (no internet there) into the git-ignored .device/:
#   1. the wheel bundles, through the shared stage.sh (default: ds te = DeepSpeed + Transformer Engine), with
#      benchmarks/device_install.sh as .device/install.sh: it installs them once per machine
#   2. Megatron-LM's source, for the megatron-lm peer: megatron/core, megatron/training, pretrain_gpt.py with its
#      two builder modules, tools/preprocess_data.py, as one tarball (~2 MB; benchmarks/megatron.py unpacks it),
#      taken with `git archive` from MEGATRON_LM (a Megatron-LM clone, work tree or bare) at MEGATRON_REF (HEAD)
#   3. this checkout's commit, for the records (the GPU machine gets the tree without .git)
# From the project root:
#   MEGATRON_LM=/path/to/Megatron-LM benchmarks/stage.sh [ds te]
# then call the device tool with carry [".device"] and a command starting `source .device/install.sh &&`.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
bundles=("$@"); [ ${#bundles[@]} -eq 0 ] && bundles=(ds te)
"${HYBRIDLM_DEVICE_BUNDLES:-$root/../shared/device}/stage.sh" "${bundles[@]}"
# the shared installer runs once per machine behind benchmarks/device_install.sh (a warm machine keeps /tmp/site)
mv .device/install.sh .device/install_bundles.sh
cp benchmarks/device_install.sh .device/install.sh
if [ -n "${MEGATRON_LM:-}" ]; then
  mkdir -p .device/megatron
  git -C "$MEGATRON_LM" archive --format=tar "${MEGATRON_REF:-HEAD}" megatron/core megatron/training pretrain_gpt.py \
      gpt_builders.py model_provider.py tools/preprocess_data.py | xz -T0 -6 > .device/megatron/megatron-lm.tar.xz
  git -C "$MEGATRON_LM" rev-parse "${MEGATRON_REF:-HEAD}" > .device/megatron/COMMIT
  echo "Megatron-LM $(cut -c1-10 .device/megatron/COMMIT): $(du -h .device/megatron/megatron-lm.tar.xz | cut -f1)"
else
  echo "MEGATRON_LM not set: no Megatron-LM source staged; the megatron-lm peer will be reported as not run"
fi
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- || echo -dirty)" > .device/COMMIT
du -sh .device
