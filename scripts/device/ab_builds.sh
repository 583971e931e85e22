#!/usr/bin/env bash
# Two builds of lora-train timed in one device call, run after run on one GPU: the steps that a
# restructuring must not slow (the hallway issue's acceptance), each a build's `bench` and the
# `train` command on a saved random checkpoint:
#
#   A: .devbuild/before/lora-train   B: .devbuild/lora-train   (plain, .xz or .gz)
#   run(command="bash scripts/device/ab_builds.sh", carry=[".devbuild"])
#
# Rows (AB_ROWS, default all): 7b (Llama-2-7B shape, seq 2048, mb2, r16 all linear: bench, then
# `train` on a random checkpoint of the shape made by scripts/make_random_checkpoint.py),
# 8b (Llama-3-8B shape, seq 4096, mb2, `--ckpt mlp`), moe (qwen3-30b-a3b, seq 2048, mb2,
# `--ckpt`). Each bench runs A, B, A, B (ROUNDS, default 2); the lines land in
# $OUT/ab.jsonl, the train command's metrics in $OUT/train-{a,b}.jsonl, and a table of the
# medians last (scripts/device/ab_table.py).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
ROWS=" ${AB_ROWS:-7b 8b moe} "
ROUNDS=${ROUNDS:-2}
for f in .devbuild/lora-train .devbuild/before/lora-train; do
  if [ -f $f.xz ]; then xz -dkf $f.xz; elif [ -f $f.gz ]; then gunzip -kf $f.gz; fi
  chmod +x $f
done
E="bash scripts/device-env.sh"
declare -A BIN=([a]=.devbuild/before/lora-train [b]=.devbuild/lora-train)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

bench() { # build tag bench-flags...
  local b=$1 tag=$2; shift 2
  timeout 200 $E ${BIN[$b]} bench --steps 20 --warmup 3 --tag "$b:$tag" --json "$OUT/ab.jsonl" "$@" \
    2>"$OUT/err-$b-$tag.txt" | cut -c1-160
}

for r in $(seq "$ROUNDS"); do
  for b in a b; do
    [[ $ROWS == *" 7b "* ]] && bench $b 7b --shape llama2-7b --seq 2048 --micro-batch 2 --rank 16 --targets all
    [[ $ROWS == *" 8b "* ]] && bench $b 8b --shape llama3-8b --seq 4096 --micro-batch 2 --rank 16 --targets all --ckpt mlp
    [[ $ROWS == *" moe "* ]] && bench $b moe --shape qwen3-30b-a3b --seq 2048 --micro-batch 2 --rank 16 --targets all --ckpt
  done
done

if [[ $ROWS == *" 7b "* ]]; then
  C=/tmp/llama2-7b
  timeout 120 python3 scripts/make_random_checkpoint.py $C llama2-7b --seq 2048 --rows 400 2>&1 | tail -1
  for b in a b; do
    rm -rf /tmp/out-7b
    t0=$(date +%s%N)
    timeout 200 $E ${BIN[$b]} --recipe scripts/device/random-checkpoint.toml 2>"$OUT/err-$b-train.txt" | tail -1
    echo "$b: train command wall $(( ($(date +%s%N) - t0) / 1000000 )) ms"
    cp /tmp/out-7b/metrics.jsonl "$OUT/train-$b.jsonl" 2>/dev/null
  done
fi
python3 scripts/device/ab_table.py "$OUT" | tee "$OUT/ab.txt"
