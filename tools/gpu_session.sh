#!/usr/bin/env bash
# One short run on a lent GPU, end to end: probe, compile for the device, correctness (difftest on nvrtc in
# shards, pytest -m gpu), then timings beside the peers and a few Nsight Compute profiles.
#
#   OUT=/tmp/gpu-out BUDGET=540 bash tools/gpu_session.sh
#
# Every stage is time-boxed against one deadline (BUDGET seconds from the start), so a slow stage
# costs only itself. Logs go to $WORK (default /tmp/gpu-logs) and are packed into $OUT/logs.tgz at
# the end; measure_gpu.py's rows go to $OUT/measure.json. Wheels in .whl/ (libclang, liger-kernel)
# are installed into /tmp/site first when present.
#
# A follow-up run re-checks only what changed since the last one:
#   KERNELS='decode_tc*,sampling*' SKIP='attention mma_sync ncu_mma_sync' OUT=... BUDGET=... bash tools/gpu_session.sh
# KERNELS (comma-separated globs) limits the precompile and the difftest shards to matching kernels; SKIP
# names stages not to run; NCU_SM90_K and NCU_DECODE_SHAPE replace the ncu_sm90 stage's kernel filter and
# decode shape (BATCH GQA KV_HEADS HEAD_DIM PAGE CTX), NCU_SM90_SECTIONS its ncu sections; NCU_ARGS adds
# profile-target options (--decode-only); DIFFTEST_S, PYTEST_S, MODEL_S and MODEL_PROFILE_S those stages' limits;
# DECODE_ARGS limits the decode stage's shapes (--batches 1 8 --lengths 1024 --kv bf16); NCU_SMALL_SHAPES (';'
# between shapes) the decode shapes profiled kernel by kernel, NCU_SMALL_SECTIONS their sections;
# SANITIZER_KERNELS the memcheck stage's kernels; PYTEST_ARGS narrows pytest -m gpu (-k EXPR, test files);
# ATTN_ARGS replaces the attention stage's options (--dtypes, --dims, --extra-dims, --seqs, --fwd-only), ATTN_S its limit;
# MEMBOUND_ARGS adds pykern.bench options (--compile: torch.compile rows), MEMBOUND_S its limit; DECODE_GRAPH_S the
# limit of the decode_graph stage (a 32-layer decode step captured in one CUDA graph, measure_gpu.py decode-graph).
# Peers that torch does not carry are timed when tools/peers.py has unpacked them into .peers/site (two calls:
# docs/gpu-ci.md, "Peers that torch does not carry").
set -u
T0=$(date +%s)
BUDGET=${BUDGET:-540}
OUT=${OUT:-/tmp/gpu-out}
WORK=${WORK:-/tmp/gpu-logs}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/pk-cache}
PY=${PY:-python3}

pack() { tar -C "$WORK" -czf "$OUT/logs.tgz" . 2>/dev/null; }
trap pack EXIT

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
# stage NAME SECONDS CMD...: run CMD with a limit of min(SECONDS, time left - 5), log to $WORK/NAME.log
stage() {
  local name=$1 want=$2; shift 2
  case " ${SKIP:-} " in *" $name "*) echo "=== $name skipped (SKIP)"; return 0;; esac
  local l; l=$(left); l=$(( l - 5 )); [ "$want" -lt "$l" ] && l=$want
  if [ "$l" -lt 5 ]; then echo "=== $name skipped: out of time"; return 0; fi
  local s; s=$(date +%s)
  timeout "$l" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - s ))s (limit ${l}s) at +$(( $(date +%s) - T0 ))s"
  tail -n "${TAILN:-6}" "$WORK/$name.log"
}

if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$WORK/wheels.log" 2>&1 && export PYTHONPATH=$PWD:/tmp/site || export PYTHONPATH=$PWD
else
  export PYTHONPATH=$PWD
fi
# peers carried by tools/peers.py (FA4, QuACK, FlashInfer, Liger), unpacked into .peers/site by its install step
[ -d .peers/site ] && export PYTHONPATH=$PYTHONPATH:$PWD/.peers/site

{ nvidia-smi; nvidia-smi -q -d CLOCK,POWER | head -60; uname -a
  $PY -c "import sys, torch, numpy; print(sys.version); print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
  $PY -m pip list 2>/dev/null | grep -i -E "cuda|nvrtc|numba|numpy|triton|ml.dtypes|pytest|hypothesis|transformers|liger|libclang"
  command -v ncu compute-sanitizer nvcc; ls /usr/local/cuda/bin 2>/dev/null | head -40
} > "$WORK/env.log" 2>&1
head -n 30 "$WORK/env.log"

KGLOBS=()
IFS=, read -ra KG <<< "${KERNELS:-}"
for g in ${KG[@]+"${KG[@]}"}; do KGLOBS+=(--kernels "$g"); done  # (set -u: an empty array is unset in bash < 4.4)
# sm_90 (every portable source) and, beside it, sm_90a (the sources with a `// pykern: arch sm_90a` line, which
# --arch sm_90 skips: without this their first use, attention_fwd_sm90.cu's minutes of NVRTC, falls in a timed stage)
A90=("${KGLOBS[@]+"${KGLOBS[@]}"}")
[ ${#A90[@]} -gt 0 ] || A90=(--kernels '*sm90*')
(TAILN=4 stage precompile_sm90a 240 $PY -m pykern.precompile --arch sm_90a --jobs 6 "${A90[@]}") &
TAILN=4 stage precompile 150 $PY -m pykern.precompile --arch sm_90 --jobs 10 ${KGLOBS[@]+"${KGLOBS[@]}"}
wait
TAILN=30 stage gpucheck_probe 30 $PY -m pykern.gpucheck --out "$WORK/gpucheck" --skip limits --skip difftest \
  --skip pytest --skip sanitizer --skip bench
TAILN=8 stage ceilings 40 $PY tools/measure_gpu.py ceilings --json "$WORK/ceilings.json"
# FlashInfer's JIT modules, built before any timed stage (minutes each): PEERS_BUILD names the groups
[ -d .peers/site ] && TAILN=6 stage peers_build "${PEERS_BUILD_S:-240}" $PY tools/peers.py build \
  --groups "${PEERS_BUILD:-decode,sampling}"

# correctness: difftest on nvrtc in 12 shards of kernels, and pytest -m gpu, side by side
$PY -c "
import fnmatch, sys
from pykern import registry
globs = [g for g in sys.argv[1].split(',') if g] or ['*']
print('\n'.join(sorted(k.name for k in registry.kernels() if any(fnmatch.fnmatch(k.name, g) for g in globs))))
" "${KERNELS:-}" > "$WORK/kernels.txt"
split -n r/12 -d "$WORK/kernels.txt" "$WORK/shard."
for f in "$WORK"/shard.*; do
  [ -s "$f" ] || continue
  (stage "difftest_$(basename "$f")" "${DIFFTEST_S:-120}" $PY -m pykern.difftest --backends nvrtc \
     --kernels "$(paste -sd, "$f")" > "$WORK/$(basename "$f").status") &
done
(stage mma_sync "${DIFFTEST_S:-120}" $PY -m pykern.difftest --backends nvrtc --extra tools/gpu_no_sm90.py \
   --kernels 'attention_fwd*,attention_bwd*' > "$WORK/mma_sync.status") &
(TAILN=25 stage pytest_gpu "${PYTEST_S:-120}" $PY -m pytest -m gpu tests --ignore=tests/test_difftest.py -q -n 4 \
   -p no:cacheprovider -rfE ${PYTEST_ARGS:-} > "$WORK/pytest.status") &
wait
cat "$WORK"/*.status
echo "--- difftest cases not ok:"
grep -h -E " (FAIL|ERROR|fail|error)" "$WORK"/difftest_*.log | head -40
grep -h -E "cases passed" "$WORK"/difftest_*.log

# attention: every shape the Hopper work needs, most wanted rows first and each written to attention.json as it is
# measured (measure_gpu.py attention --list prints the plan and its modelled seconds: 136 s without FA4, about 870 s
# with FA4's CuTe DSL compiles, 40 s a (dtype, d, dv, causal)); the limit keeps the bf16 4k / 16k rows of d128, d64
# and d256 with FA4 (289 s modelled), every row without it. ATTN_ARGS replaces the plan's options, ATTN_S the limit.
TAILN=3 stage attention "${ATTN_S:-300}" $PY tools/measure_gpu.py attention \
  ${ATTN_ARGS:---dtypes bf16 f16 --dims 128 64 256 192/128 --extra-dims 96} --json "$OUT/attention.json"
TAILN=3 stage decode 100 $PY tools/measure_gpu.py decode ${DECODE_ARGS:-} --json "$OUT/decode.json"
TAILN=3 stage decode_graph "${DECODE_GRAPH_S:-45}" $PY tools/measure_gpu.py decode-graph --json "$OUT/decode_graph.json"
TAILN=3 stage sampling 30 $PY tools/measure_gpu.py sampling --json "$OUT/sampling.json"
TAILN=3 stage mla "${MLA_S:-40}" $PY tools/measure_gpu.py mla --json "$OUT/mla.json"
TAILN=3 stage moe "${MOE_S:-90}" $PY tools/bench_moe.py --time --tokens 4096 --tokens 16384 --rows "$OUT/moe.json"
TAILN=6 stage model "${MODEL_S:-60}" $PY tools/measure_gpu.py model --json "$OUT/model.json"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ]; then
  # tensor-pipe utilisation metrics this ncu knows (names differ between versions): asked for only if listed
  M=$("$NCU" --query-metrics --chip gh100 2>/dev/null | grep -o '^sm__pipe_tensor_op_[a-z_]*_cycles_active' | sort -u \
      | sed 's/$/.avg.pct_of_peak_sustained_active/' | paste -sd, -)
  echo "tensor metrics: $M" > "$WORK/ncu_metrics.txt"
  TAILN=10 stage ncu_mma_sync 60 "$NCU" --clock-control none --target-processes all \
    -k 'regex:attention_fwd_tc|attention_bwd_tc|attention_bwd|decode_tc|paged_attn' -c 8 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats ${M:+--metrics "$M"} \
    $PY tools/measure_gpu.py profile-target --mma-sync --decode-shape 1 4 8 128 16 1024
  TAILN=10 stage ncu_sm90 50 "$NCU" --clock-control none --target-processes all \
    -k "${NCU_SM90_K:-regex:attention_fwd_sm90|attention_bwd_sm90|decode_tc|paged_attn}" -c 10 \
    ${NCU_SM90_SECTIONS:---section SpeedOfLight} ${M:+--metrics "$M"} \
    $PY tools/measure_gpu.py profile-target --decode-shape ${NCU_DECODE_SHAPE:-8 1 8 128 16 8192} ${NCU_ARGS:-}
  # small decode steps kernel by kernel (their time is mostly fixed), and the sampling ops at batch 1
  IFS=';' read -ra SMALL <<< "${NCU_SMALL_SHAPES:-1 8 8 128 16 1024;8 8 8 128 16 1024}"
  i=0
  for sh in ${SMALL[@]+"${SMALL[@]}"}; do
    TAILN=12 stage "ncu_decode_small$i" 45 "$NCU" --clock-control none --target-processes all -k regex:decode_tc -c 2 \
      ${NCU_SMALL_SECTIONS:---section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats} \
      $PY tools/measure_gpu.py profile-target --decode-only --decode-shape $sh
    i=$((i + 1))
  done
  TAILN=12 stage ncu_sampling 60 "$NCU" --clock-control none --target-processes all -k regex:sampling -c 12 \
    --section SpeedOfLight --section LaunchStats --section WarpStateStats \
    $PY tools/measure_gpu.py profile-target --sampling
fi
TAILN=40 stage model_profile "${MODEL_PROFILE_S:-150}" $PY tools/measure_gpu.py model-profile --json "$OUT/model_profile.json"
TAILN=70 stage membound "${MEMBOUND_S:-60}" $PY -m pykern.bench --dtype bf16 --repeats 10 ${MEMBOUND_ARGS:-}
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$CS" ]; then
  TAILN=8 stage sanitizer_memcheck 40 "$CS" --tool memcheck --error-exitcode 99 --print-limit 20 \
    $PY -m pykern.difftest --backends nvrtc --case-limit 2 \
    --kernels "${SANITIZER_KERNELS:-paged_append_kv,paged_append_kv_bf16_e4m3,attention_fwd_tc_d128_bf16,decode_tc_paged_d64_bf16,decode_tc_paged_d128_e4m3kv_bf16,paged_attn_bf16}"
fi
$PY tools/measure_gpu.py summary "$WORK/ceilings.json" "$OUT/attention.json" "$OUT/decode.json" "$OUT/decode_graph.json" \
  "$OUT/model.json" 2>&1 | tail -120
echo "total $(( $(date +%s) - T0 ))s"
