#!/usr/bin/env bash
# The one device run (see ../.library/device): GPU timings on random-init models of
# Llama-3.2-1B's shape. Installs only the carried wheels in .whl (pyvene 0.1.8, transformers
# 5.24.0); writes logs under $OUT. Run with carry: [".whl", ".devdata"].
#   bash benchmarks/gpu_check.sh [all|trace|dataset|attribution|scale]
set -u
SECTION=${1:-all}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, pyvene; print(torch.__version__, transformers.__version__)"
if [ "$SECTION" = all ] || [ "$SECTION" = trace ]; then
echo "== causal trace, residual, 10 seeds, beside the plain batched floor (issues 3, 16)"
timeout 180 python3 benchmarks/gpu_trace.py --seeds 10 2>&1 | tee "$OUT/gpu_trace.txt"
timeout 240 python3 benchmarks/gpu_trace.py --shape qwen3_8b --skip-seed-style --seeds 10 2>&1 \
    | tee -a "$OUT/gpu_trace.txt"
fi
if [ "$SECTION" = all ] || [ "$SECTION" = dataset ]; then
echo "== dataset throughput, residual, 3 seeds (issue 5)"
timeout 240 python3 benchmarks/dataset_speed.py --synthetic llama1b --device cuda --facts 20 \
    --compare-facts 3 --skip-loop --skip-memory --budgets 1024,4096,16384 \
    --out "$OUT/dataset_gpu.json" 2>&1 | tee "$OUT/dataset_gpu.txt"
fi
if [ "$SECTION" = all ] || [ "$SECTION" = attribution ]; then
echo "== attribution adjacency rows, random Llama-3.2-1B + CLT 16 x 32768, ~12 features/pos (issue 6)"
timeout 400 python3 benchmarks/attribution_speed.py --synthetic llama1b --device cuda \
    --batches 32,128,512 --memory-caps 8192 --out "$OUT/attribution_gpu.json" 2>&1 \
    | tee "$OUT/attribution_gpu.txt"
fi
if [ "$SECTION" = all ] || [ "$SECTION" = scale ]; then
echo "== attribution at published density: random Llama-3.2-1B + CLT 16 x 32768, ~50 features/pos,"
echo "   64 and 256 tokens, budget 7500, beside circuit-tracer's replicated forward (issue 11)"
# the replicated forward copies every active feature's decoder rows per copy: B = 8 at 64 tokens
# (~31 GB); at 256 tokens (~16 GB per copy) only ours runs
timeout 200 python3 benchmarks/attribution_speed.py --synthetic llama1b --device cuda \
    --features-per-position 50 --prompts p64 --batches 512 --memory-caps "" --skip-loop \
    --replicated 8 --rows 7500 --out "$OUT/attribution_scale_gpu_64.json" 2>&1 \
    | tee "$OUT/attribution_scale_gpu.txt"
timeout 200 python3 benchmarks/attribution_speed.py --synthetic llama1b --device cuda \
    --features-per-position 50 --prompts p256 --batches 128,512 --memory-caps "" --skip-loop \
    --replicated "" --rows 7500 --out "$OUT/attribution_scale_gpu_256.json" 2>&1 \
    | tee -a "$OUT/attribution_scale_gpu.txt"
fi
