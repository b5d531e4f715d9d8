#!/usr/bin/env bash
# Fills what benchmarks/gpu_check.sh carries to the GPU machine, here (registries reachable):
#   .whl/      the wheels the machine lacks: pyvene 0.1.8 and transformers 5.24.0, pure Python
#              (it has torch 2.11+cu130, transformers 5.17, tokenizers, safetensors,
#              huggingface_hub 1.x, scipy; see /work/.library/device/KINDS.md)
#   .whl/peer/ circuit-tracer 0.5.0 and what its nnsight backend needs that the machine lacks or
#              has at a version it refuses (benchmarks/gpu_peer.py; gpu_check.sh installs them
#              with pyvene into /tmp/peer-site, apart from /tmp/site: they pin transformers
#              4.57.3, huggingface_hub < 1 and tokenizers <= 0.23.0). The set was found by
#              installing it --no-index into a scratch --target and importing circuit-tracer's
#              attribute, nnsight replacement model and transcoder loaders under a Python that
#              holds only the machine's packages (KINDS.md's list), adding what was missing
#              until it imported. Its TransformerLens backend needs more (datasets,
#              multiprocess, dill, better-abc, ...): not carried.
#   .devdata/  known_1000.json (the BPE tokenizer of the random models is trained on its facts)
# Both are git-ignored (.gitignore). Then, from the checkout the session was started in:
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl", ".devdata"], timeout_s=600)
#   bash benchmarks/gpu_prepare.sh        # PYTHON=... to use another interpreter's pip
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .whl/peer .devdata
rm -f .whl/*.whl .whl/peer/*.whl  # one version of each: two stop the install there
download() {  # download FOLDER NAME==VERSION...: CPython 3.12 x86-64 wheels, no dependencies
    local to=$1
    shift
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$to" "$@"
}
download .whl pyvene==0.1.8 transformers==5.24.0
# circuit-tracer 0.5.0 on its nnsight backend (benchmarks/gpu_peer.py), the versions of the
# peer venv (make test-peer): 16 wheels, ~25 MB, 3 of them compiled (tokenizers, pydantic-core,
# zstandard)
download .whl/peer circuit-tracer==0.5.0 transformers==4.57.3 huggingface_hub==0.36.2 \
    tokenizers==0.22.2 nnsight==0.6.3 pydantic==2.14.4 pydantic_core==2.50.5 \
    typing-inspection==0.4.5 annotated-types==0.8.0 ipython==9.18.1 traitlets==5.16.1 \
    astor==0.8.1 python-socketio==5.18.1 python-engineio==4.15.1 bidict==0.24.1 \
    zstandard==0.25.0
KNOWN=../shared/data/known_1000.json
if [ -f "$KNOWN" ]; then
    cp "$KNOWN" .devdata/known_1000.json
elif [ ! -f .devdata/known_1000.json ]; then
    echo "no $KNOWN: put known_1000.json into .devdata/ by hand" >&2
    exit 1
fi
{ git check-ignore -q .whl && git check-ignore -q .devdata; } || { echo ".whl or .devdata is not git-ignored" >&2; exit 1; }
du -sh .whl .whl/peer .devdata
total=$(du -sm .whl .devdata | awk '{s += $1} END {print s}')
tree=$(git ls-files -z | du -cm --files0-from=- | tail -1 | cut -f1)
echo "carried: ${total} MB beside the ${tree} MB tree (the tool's limit: 64 MiB in all)"
[ $((total + tree)) -lt 62 ] || { echo "carried files are ${total} MB: over the tool's 64 MiB with the tree" >&2; exit 1; }
ls .whl .whl/peer
