#!/usr/bin/env bash
# The attention rows beside the peers on a lent GPU, in two calls on one warm machine (docs/gpu-ci.md, "The
# attention rows"); the second call must follow the first within the 30 s the machine stays warm.
#
#   here, once:  python tools/peers.py fetch && python tools/peers.py pack
#   call 1:      bash tools/gpu_attention.sh 1            # carry [".carry/peers1"]
#   call 2:      bash tools/gpu_attention.sh 2            # carry [".carry/peers2"]; rows in $OUT/attention.json
#
# Call 1 unpacks the first peers part and compiles pykern's attention sources for the device: the sm_90a kernels
# (attention_fwd_sm90.cu alone is minutes of NVRTC on one core) and the sm_90 mma.sync ones, into
# .cache/pykern-gpu, an ignored folder that stays while the machine is warm, so that no timed row of call 2 pays a
# first-use compile. Call 2 unpacks the rest and runs tools/measure_gpu.py attention under `timeout` (ATTN_TIMEOUT,
# default 540 s, inside the 10 minutes a call may run); its rows come most wanted first and each is written as soon
# as it is measured. Options after the part number replace the plan's (default: the forward's questions, every
# dtype and head dim, --fwd-only); ATTN_TIMEOUT and PY (python3) may be set. $OUT must be set in call 2.
set -euo pipefail
part=${1:-}
case $part in 1|2) shift ;; *) echo "usage: tools/gpu_attention.sh 1|2 [measure_gpu.py attention options]" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYKERN_CACHE_DIR=${PYKERN_CACHE_DIR:-$PWD/.cache/pykern-gpu} PYTHONUNBUFFERED=1
if [ "$part" = 1 ]; then
  t0=$(date +%s)
  $PY tools/peers.py install --part 1
  echo "gpu_attention: peers part 1 in $(( $(date +%s) - t0 )) s"
  # Both at once: the sm_90a sources (the fast path, its FP8 forward and the backward) and the portable
  # attention sources for sm_90 (the mma.sync rows, PYKERN_SM90=0). Each source is one NVRTC compile; the longest
  # (attention_fwd_sm90.cu) sets the wall time.
  t0=$(date +%s)
  $PY -m pykern.precompile --arch sm_90a --kernels 'attention_*sm90*' --jobs 3 > /tmp/gpu_attention_sm90a.log 2>&1 &
  a=$!
  $PY -m pykern.precompile --arch sm_90 --kernels 'attention_*' --jobs 8 > /tmp/gpu_attention_sm90.log 2>&1 &
  b=$!
  rc=0
  wait $a || rc=$?
  wait $b || rc=$?
  tail -n 25 /tmp/gpu_attention_sm90a.log /tmp/gpu_attention_sm90.log
  echo "gpu_attention: pykern's attention sources compiled in $(( $(date +%s) - t0 )) s (rc $rc)"
  exit $rc
fi
: "${OUT:?set OUT, the folder the rows go to}"
$PY tools/peers.py install --part 2
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--fwd-only --dtypes bf16 f16 --dims 128 64 256 192/128 --extra-dims 96)
PYTHONPATH=$PWD/.peers/site:$PWD timeout "${ATTN_TIMEOUT:-540}" $PY tools/measure_gpu.py attention "${args[@]}" \
  --json "$OUT/attention.json"
