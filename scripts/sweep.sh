#!/usr/bin/env bash
# The knobs users set, each timed beside the plain configuration (Llama-2-7B shape, seq 2048,
# micro-batch 2, r16 on all linears) in one device call: ours with `lora-train bench` and, where
# the peer has the knob, transformers + PEFT and PEFT + Liger-Kernel (scripts/bench_peft.py).
# Each run appends a JSON line tagged with its row to $OUT/sweep.jsonl; the table (tok/s against
# plain and against what the row's FLOPs predict: scripts/sweep_table.py) is printed at the end
# and written to $OUT/sweep.md. A row more than 10% below its FLOPs' prediction is a cliff.
#
#   bash scripts/sweep.sh                                  # every row, ours and the peers
#   PEERS=0 bash scripts/sweep.sh                          # ours only (about 20 s a row)
#   ROWS="plain dropout-0.05 dropout-0.1" bash scripts/sweep.sh
#   LT=target/release/lora-train SHAPE=tiny bash scripts/sweep.sh   # any build, any shape
#
# On the lead's device (the binary staged in .devbuild/, as scripts/device_gpu_check.sh):
#   run(command="PEERS=0 bash scripts/sweep.sh", carry=[".devbuild"])
#   run(command="ROWS='plain dropout-0.05 dropout-0.1 rslora rank-8 rank-64' bash scripts/sweep.sh", carry=[".devbuild"])
# (a 10-minute call holds ours for every row, or the peers for about six rows: split by ROWS;
# the lines accumulate in $OUT/sweep.jsonl across calls only when $OUT is kept, so keep each
# call's plain row: the ratios are within a call.)
#
# Rows: name | the plain shape's changes (seq=, mb=, rank=, targets=: ours and the peer's) | our
# further bench flags | the peer's further bench_peft.py flags ("-": the peer has no such knob).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
J=$OUT/sweep.jsonl
if [ -z "${LT:-}" ]; then
  [ -f .devbuild/lora-train.gz ] && ( cd .devbuild && gunzip -kf lora-train.gz && chmod +x lora-train )
  LT=.devbuild/lora-train
fi
E=""
[[ $LT == .devbuild/* ]] && [ -f scripts/device-env.sh ] && E="bash scripts/device-env.sh"
PY=${PY:-python3}
ALL_ROWS=(
  "plain|||"
  "dropout-0.05||--dropout 0.05|--dropout 0.05"
  "dropout-0.1||--dropout 0.1|--dropout 0.1"
  "rslora||--rslora|--rslora"
  "rank-8|rank=8||"
  "rank-64|rank=64||"
  "rank-256|rank=256||"
  "targets-qv|targets=qv||"
  "targets-attn|targets=attn||"
  "grad-accum-4||--grad-accum 4|-"
  "pack-16||--pack-short 16|-"
  "eval-every-4||--eval-every 4 --eval-batches 2|-"
  "save-every-4||--save-every 4|-"
  "mb-1|mb=1||"
  "mb-8|mb=8||"
  "seq-512|seq=512||"
  "seq-512-mb-8|seq=512 mb=8||"
  "seq-8192|seq=8192||"
  "ckpt||--ckpt|--ckpt"
  "ckpt-mlp||--ckpt mlp|--ckpt"
  "ckpt-mlp-recompute||--ckpt mlp --offload false|--ckpt"
)
want=" ${ROWS:-$(for r in "${ALL_ROWS[@]}"; do printf '%s ' "${r%%|*}"; done)} "
liger=0
if [ "${PEERS:-1}" = 1 ] && $PY -c "import liger_kernel" 2>/dev/null; then liger=1; fi
for row in "${ALL_ROWS[@]}"; do
  IFS='|' read -r name changes ours peer <<< "$row"
  [[ $want == *" $name "* ]] || continue
  seq=${SEQ:-2048} mb=${MB:-2} rank=${RANK:-16} targets=${TARGETS:-all}
  for c in $changes; do
    case $c in seq=*) seq=${c#*=} ;; mb=*) mb=${c#*=} ;; rank=*) rank=${c#*=} ;; targets=*) targets=${c#*=} ;; esac
  done
  common="--shape ${SHAPE:-llama2-7b} --seq $seq --rank $rank --targets $targets --steps ${STEPS:-8} --warmup ${WARMUP:-3}"
  echo "== $name: lora-train bench $common --micro-batch $mb $ours"
  # shellcheck disable=SC2086
  timeout "${LIMIT:-300}" $E "$LT" bench $common --micro-batch "$mb" $ours --tag "$name" --json "$J" 2>&1 \
    | tail -1 | cut -c1-240
  [ "${PEERS:-1}" = 1 ] && [ "$peer" != "-" ] || continue
  for extra in "" "--liger"; do
    [ -n "$extra" ] && [ $liger = 0 ] && continue
    echo "== $name: bench_peft.py $common --batch $mb $peer $extra"
    # shellcheck disable=SC2086
    timeout "${LIMIT:-300}" $PY scripts/bench_peft.py $common --batch "$mb" $peer $extra --tag "$name" \
      --json "$J" 2>&1 | tail -1 | cut -c1-240
  done
done
$PY scripts/sweep_table.py "$J" | tee "$OUT/sweep.md"
