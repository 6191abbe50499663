#!/usr/bin/env bash
# Prepare a GPU run: the GPU machine's image (Python 3.12, torch with CUDA, pytest, pytest-xdist,
# pyyaml, safetensors, lightning) has no pydantic and no hjson, and it reaches no package index.
# Run this from the project's root on your own machine (python3 and pip reach the index there); it
# downloads the wheels the package needs into ./.whl (kept out of git) for the run to carry, and
# scripts/gpu_check.sh installs them there with --no-deps.
#
# Every wheel is pinned (the versions CI resolves from setup.cfg on 2026-11-26; peft and accelerate
# on 2026-11-27, for the LoRA paths: the image has transformers but neither of them), so two
# preparations carry the same files; typing-extensions too, which pydantic-core 2.46 needs at
# >= 4.14.1 and the image may hold older. Pass NAME==VERSION pairs to add or override one
# (e.g. transformers==5.23.0 for the Trainer tests).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
pinned=(
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  typing-extensions==4.15.0 hjson==3.1.0
  peft==0.21.2 accelerate==1.15.0  # pure Python: the LoRA tests and scripts/bench_lora.py (GPU review K8)
)
declare -A wanted
for spec in "${pinned[@]}" "$@"; do wanted[${spec%%==*}]=$spec; done
for spec in "${wanted[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$spec"
done
ls -la .whl
du -sh .whl
