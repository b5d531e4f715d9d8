#!/usr/bin/env bash
# Fills what benchmarks/gpu_check.sh carries to the GPU machine, here (registries reachable):
#   .whl/      the wheels the machine lacks: pyvene 0.1.8 and transformers 5.24.0, pure Python
#              (it has torch 2.11+cu130, transformers 5.17, tokenizers, safetensors,
#              huggingface_hub 1.x, scipy; see /work/.library/device/KINDS.md)
#   .devdata/  known_1000.json (the BPE tokenizer of the random models is trained on its facts)
# Both are git-ignored (.gitignore). Then, from the checkout the session was started in:
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl", ".devdata"], timeout_s=600)
#   bash benchmarks/gpu_prepare.sh        # PYTHON=... to use another interpreter's pip
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .whl .devdata
rm -f .whl/*.whl  # one version of each: two stop the install there
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl pyvene==0.1.8 transformers==5.24.0
KNOWN=../shared/data/known_1000.json
if [ -f "$KNOWN" ]; then
    cp "$KNOWN" .devdata/known_1000.json
elif [ ! -f .devdata/known_1000.json ]; then
    echo "no $KNOWN: put known_1000.json into .devdata/ by hand" >&2
    exit 1
fi
{ git check-ignore -q .whl && git check-ignore -q .devdata; } || { echo ".whl or .devdata is not git-ignored" >&2; exit 1; }
du -sh .whl .devdata
total=$(du -sm .whl .devdata | awk '{s += $1} END {print s}')
[ "$total" -lt 48 ] || { echo "carried files are ${total} MB: over the tool's 64 MiB with the tree" >&2; exit 1; }
ls .whl
