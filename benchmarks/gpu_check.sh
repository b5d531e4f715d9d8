#!/usr/bin/env bash
# Issue 27 item 4: the GPU numbers in ONE call of the device tool (/work/.library/device/README.md:
# one H200, no network, 15 device minutes a session, 10 a command). Random-init models of
# Llama-3.2-1B's and Qwen3-8B's shapes (bf16 for traces, float32 for attribution):
#   1. trace    the public trace() end to end beside the plain batched floor, full residual
#               trace, 10 seeds, an 11-token known_1000 fact (benchmarks/gpu_trace.py), at both
#               shapes. Targets: trace() <= 1.0x the floor; Qwen3-8B's trace() <= 1.0 s.
#   2. fit      the chunk planner's CUDA constants (tracing/chunks.py: DEVICE_SPEEDS) fitted to
#               timed forwards of both shapes (benchmarks/gpu_fit_costs.py): prints the line to
#               paste in.
#   3. attribution  ms per row and peak GPU memory at 7,500 rows (64 tokens, ~50 features per
#               position), ours (batched seeds, B=512) beside circuit-tracer's replicated forward
#               (B copies of the prompt): Llama-3.2-1B's shape with a CLT of 16 x 32,768
#               (replicated B=8, 7,500 rows); then, if the time allows, Qwen3-8B's sizes as a
#               Llama with a CLT of 36 x 8,192 at ~25 features per position (ours: rows per
#               backward from a 60 GB memory cap; replicated B=4 on 1,500 rows: ms/row and its
#               peak, which the row count does not change; every copy holds every active
#               feature's decoder rows, ~16 GB) (benchmarks/gpu_attribution.py).
#   4. one short table of it all (benchmarks/gpu_summary.py).
#   5. distributed (issue 41): attribution with the transcoder sharded by feature and with the
#               rows split over one rank per GPU, against one process (benchmarks/
#               distributed_attribution.py, a random-init Llama-3.2-1B shape with a synthetic CLT
#               of 16 x 4,096): rows/s, transcoder bytes and peak memory per rank; skipped with
#               fewer than 2 GPUs. Its table lands in $OUT/distributed.json.
# Issue 54: two sections, two calls of the device tool in one session (15 device minutes: the
# first call ~1.5 min of machine start + BUDGET=440, the second on the warm machine, BUDGET=300):
#   issue54 (first: the scale results)
#   6. long     a 7,500-node graph of 2,048, 4,096 and 8,192 tokens on the 1B shape with the
#               synthetic 16 x 32,768 CLT at 10 features per position, a process per length:
#               time, peak GPU memory, closure (benchmarks/long_prompts.py). $OUT/long_*.json.
#   7. peer     circuit-tracer 0.5.0 (nnsight backend, wheels in .whl/peer installed into
#               /tmp/peer-site with pyvene: it pins transformers 4.57.3) beside ours on a
#               random-init Llama-3.2-1B with a synthetic CLT (16 x 2,048) and a per-layer set
#               (16 x 8,192) in circuit-tracer's layout, prompts of 64, 512 and 2,048 tokens:
#               seconds per graph with each library's default batch and with 64 and 128,
#               peak GPU memory, the graphs' edges compared (benchmarks/gpu_peer.py; a process
#               per length and library, 25/30/45 s each: an OOM or a timeout is a result).
#               $OUT/peer.json.
#   issue54b (second)
#   8. entry_points  every public function and CLI command with its defaults on a CUDA model
#               (benchmarks/gpu_entry_points.py; exits non-zero if one fails). $OUT/entry_points.json.
#   9. bf16     a bf16 graph against the float32 one, deterministic runs identical
#               (benchmarks/bf16_deviation.py). $OUT/bf16.json.
#  10. ranks    2 ranks on the one GPU (gloo, CUDA tensors) against one process, both splits
#               (benchmarks/distributed_attribution.py: exits non-zero unless equal).
#               $OUT/ranks.json.
#  11. launches the trace's time split (engine, our Python, plain forward) at both shapes
#               (benchmarks/trace_launches.py). $OUT/trace_launches.json.
#   Plan: install ~15 s, long 50 + 80 + 110 s, peer 170 s (it writes each cell as it ends) =
#   ~425 s; then entry_points 120, bf16 60, ranks 70, launches 60 = 310 s (what does not fit
#   BUDGET is skipped and named). Calls: run(command="BUDGET=440 bash benchmarks/gpu_check.sh
#   issue54", carry=[".whl", ".devdata"], timeout_s=540), then, on the warm machine,
#   run(command="BUDGET=300 bash benchmarks/gpu_check.sh issue54b", carry=[".whl", ".devdata"],
#   timeout_s=330): ~1.5 + 7.3 + 5 = ~14 of the session's 15 device minutes.
# Every step has its own time limit and the whole fits BUDGET seconds (default 560): a step that
# would not fit is skipped and shows as '-' in the table. $OUT gets three files (the tool returns
# at most 8): log.txt (every step's output), summary.txt and results.json (every step's numbers).
#
# Before the call, here (registries reachable): bash benchmarks/gpu_prepare.sh  (fills the
# git-ignored .whl with pyvene 0.1.8 and transformers 5.24.0, .devdata with known_1000.json).
# The tool sends the checkout the session was started in, so run it from there (merged):
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl", ".devdata"], timeout_s=600)
# Sections: bash benchmarks/gpu_check.sh [all|trace|fit|attribution|distributed|dataset|issue54|
# issue54b|long|peer|entry_points|bf16|ranks|launches]  (dataset: issue 5's throughput run;
# issue54 = long + peer, issue54b = entry_points + bf16 + ranks + launches; none of them in all).
# A CPU smoke of every step with tiny shapes (no GPU, no wheels; a few minutes on 2 cores):
#   SMOKE=1 PYTHON=.venv/bin/python OUT=/tmp/gpu_smoke bash benchmarks/gpu_check.sh
#   SMOKE=1 BUDGET=2400 PYTHON=.venv/bin/python PEER_PYTHON=/work/ciclone/.venv-peer/bin/python \
#       OUT=/tmp/gpu_smoke_peer bash benchmarks/gpu_check.sh issue54
set -u
SECTION=${1:-all}
OUT=${OUT:-/tmp/gpu_check}
BUDGET=${BUDGET:-560}
START=$SECONDS
WORK=$(mktemp -d)  # each step's JSON; gpu_summary.py gathers them into $OUT/results.json
mkdir -p "$OUT"
if [ "${SMOKE:-0}" = 1 ]; then
    PY=${PYTHON:-python3}
    DEV=cpu; SMALL=tiny; BIG=tiny; FIT=tiny,tiny_wide
    FIT_GRID=(--batches 1,16 --spans 1,8 --repeats 2)
    ATTR=(--synthetic tiny --features-per-position 5 --rows 200)
    ATTR_BIG=("${ATTR[@]}"); REP_SMALL=4; REP_BIG=2; REP_ROWS=100; BATCH=64; CAP_BIG=256
    export PYTHONPATH=$PWD PVCT_TORCH_THREADS=1
    echo "SMOKE: tiny shapes stand in for Llama-3.2-1B and Qwen3-8B, on the CPU"
else
    PY=python3
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
    DEV=cuda; SMALL=llama1b; BIG=qwen3_8b; FIT=llama1b,qwen3_8b
    FIT_GRID=()
    ATTR=(--synthetic llama1b --features-per-position 50 --rows 7500)
    ATTR_BIG=(--synthetic qwen3_8b --features-per-position 25 --rows 7500)
    REP_SMALL=8; REP_BIG=4; REP_ROWS=1500; BATCH=512; CAP_BIG=60000
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
"$PY" -c "import torch, transformers, pyvene; from importlib.metadata import version as v; \
print('torch', torch.__version__, 'transformers', transformers.__version__, 'pyvene', v('pyvene'))" \
    || exit 1

# step NAME LIMIT COMMAND...: runs COMMAND under min(LIMIT, what is left of BUDGET), or skips it
step() {
    local name=$1 limit=$2 left
    shift 2
    left=$((BUDGET - (SECONDS - START)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 30 ]; then
        echo "== $name: skipped ($((SECONDS - START)) s of the ${BUDGET} s budget spent)"
        return
    fi
    echo "== $name (limit ${limit} s; $((SECONDS - START)) s in)"
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT/log.txt"
    echo "   ($name: exit ${PIPESTATUS[0]}, $((SECONDS - START)) s in)"
}
want() { [ "$SECTION" = all ] || [ "$SECTION" = "$1" ]; }
want54() { [ "$SECTION" = issue54 ] || [ "$SECTION" = "$1" ]; }
want54b() { [ "$SECTION" = issue54b ] || [ "$SECTION" = "$1" ]; }

if want trace; then
    step trace_llama1b 120 "$PY" benchmarks/gpu_trace.py --device $DEV --shape $SMALL \
        --seeds 10 --json "$WORK/trace_llama1b.json"
    step trace_qwen3_8b 150 "$PY" benchmarks/gpu_trace.py --device $DEV --shape $BIG \
        --seeds 10 --json "$WORK/trace_qwen3_8b.json"
fi
if want fit; then
    step fit_costs 100 "$PY" benchmarks/gpu_fit_costs.py --device $DEV --shapes $FIT \
        ${FIT_GRID[@]+"${FIT_GRID[@]}"} --json "$WORK/fit_costs.json"
fi
if want attribution; then
    # ours and the replicated forward in separate runs: an out-of-memory in one keeps the other
    common=(--device $DEV --prompts p64 --skip-loop)
    step attribution_llama1b 110 "$PY" benchmarks/gpu_attribution.py "${ATTR[@]}" \
        "${common[@]}" --batches $BATCH --memory-caps "" --replicated "" \
        --out "$WORK/attribution_llama1b.json"
    step attribution_llama1b_replicated 130 "$PY" benchmarks/gpu_attribution.py "${ATTR[@]}" \
        "${common[@]}" --batches "" --memory-caps "" --replicated $REP_SMALL \
        --out "$WORK/attribution_llama1b_replicated.json"
    # (its rows per backward from the library's memory cap: B = 512 might not fit 36 x 4096)
    step attribution_qwen3_8b 120 "$PY" benchmarks/gpu_attribution.py "${ATTR_BIG[@]}" \
        "${common[@]}" --batches "" --memory-caps $CAP_BIG --replicated "" \
        --out "$WORK/attribution_qwen3_8b.json"
    step attribution_qwen3_8b_replicated 120 "$PY" benchmarks/gpu_attribution.py \
        "${ATTR_BIG[@]}" "${common[@]}" --rows $REP_ROWS --batches "" --memory-caps "" \
        --replicated $REP_BIG \
        --out "$WORK/attribution_qwen3_8b_replicated.json"
fi
if want distributed; then
    # issue 41: attribution across ranks, the transcoder sharded by feature and the rows split,
    # one rank per GPU (NCCL needs a device per rank: skipped on a one-GPU machine); the CPU
    # smoke runs 2 gloo ranks
    n_gpu=$(nvidia-smi -L 2>/dev/null | wc -l)
    if [ "${SMOKE:-0}" = 1 ]; then WORLDS=(1 2); DIST_F=256
    elif [ "$n_gpu" -ge 2 ]; then WORLDS=(1 $((n_gpu < 8 ? n_gpu : 8))); DIST_F=4096
    else WORLDS=(); echo "== distributed: skipped ($n_gpu GPU: NCCL needs one device per rank)"
    fi
    if [ ${#WORLDS[@]} -gt 0 ]; then
        step distributed 240 "$PY" benchmarks/distributed_attribution.py --model random:$SMALL \
            --features $DIST_F --rows 2000 --resident --worlds "${WORLDS[@]}" \
            --json "$OUT/distributed.json"
    fi
fi
if want54 long; then
    # issue 54 item 3: one process per length, so a length that runs out of memory or time
    # loses only itself
    if [ "${SMOKE:-0}" = 1 ]; then LONG=(64 128); LONG_LIMITS=(300 300)
    else LONG=(2048 4096 8192); LONG_LIMITS=(50 80 110)
    fi
    for i in "${!LONG[@]}"; do
        step "long_${LONG[$i]}" "${LONG_LIMITS[$i]}" "$PY" benchmarks/long_prompts.py \
            --device $DEV --tokens "${LONG[$i]}" --out "$OUT/long_${LONG[$i]}.json"
    done
fi
if want54 peer; then
    # circuit-tracer's stack apart from /tmp/site (it pins transformers 4.57.3); ours runs there
    # too (the oldest transformers we support), each (length, library) in a process of its own
    if [ "${SMOKE:-0}" = 1 ]; then  # a busy 2-core machine takes minutes per process
        PEER=(env "PYTHONPATH=$PWD" "${PEER_PYTHON:-$PY}")
        PEER_LIMIT=1500; PEER_ARGS=(--lengths 16 --limits 600 --build-limit 400)
    else
        PEER_LIMIT=170; PEER_ARGS=()
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/peer-site .whl/peer/*.whl .whl/pyvene-*.whl || exit 1
        PEER=(env "PYTHONPATH=/tmp/peer-site:$PWD" python3)
    fi
    step peer $PEER_LIMIT "${PEER[@]}" benchmarks/gpu_peer.py --device $DEV \
        ${PEER_ARGS[@]+"${PEER_ARGS[@]}"} --json "$OUT/peer.json"
fi
if want54b ranks; then
    # issue 54 item 6: 2 ranks sharing the one GPU (gloo, CUDA tensors; NCCL refuses two ranks
    # on a device) against one process, the transcoder sharded by feature and the rows split
    if [ "${SMOKE:-0}" = 1 ]; then RANKS_F=256; RANKS_LIMIT=900
    else RANKS_F=1024; RANKS_LIMIT=70
    fi
    step ranks $RANKS_LIMIT "$PY" benchmarks/distributed_attribution.py --model random:$SMALL \
        --features $RANKS_F --rows 1000 --resident --worlds 1 2 --json "$OUT/ranks.json"
fi
if want54b entry_points; then
    step entry_points $([ "${SMOKE:-0}" = 1 ] && echo 600 || echo 120) "$PY" \
        benchmarks/gpu_entry_points.py --device $DEV --out "$OUT/entry_points.json"
fi
if want54b bf16; then
    step bf16 $([ "${SMOKE:-0}" = 1 ] && echo 300 || echo 60) "$PY" benchmarks/bf16_deviation.py \
        --device $DEV --out "$OUT/bf16.json"
fi
if want54b launches; then
    step launches $([ "${SMOKE:-0}" = 1 ] && echo 300 || echo 60) "$PY" \
        benchmarks/trace_launches.py --device $DEV --times-only --time-models $SMALL \
        --repeats 3 --json "$OUT/trace_launches.json"
fi
if [ "$SECTION" = dataset ]; then
    echo "== dataset throughput, residual, 3 seeds (issue 5)"
    timeout 240 "$PY" benchmarks/dataset_speed.py --synthetic llama1b --device $DEV --facts 20 \
        --compare-facts 3 --skip-loop --skip-memory --budgets 1024,4096,16384 \
        --out "$WORK/dataset_gpu.json" 2>&1 | tee -a "$OUT/log.txt"
fi
echo "== summary ($((SECONDS - START)) s in)"
"$PY" benchmarks/gpu_summary.py "$WORK" --combine "$OUT/results.json" | tee "$OUT/summary.txt"
