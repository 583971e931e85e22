#!/usr/bin/env bash
# The GPU session's checks, run ON the device machine from the repo root (device tool), with
# .devbuild/ carried: lora-train.gz and it.gz (CUDA builds: the binary and the integration-test
# binary), device-env.sh and peft_baseline.py (copied from ../shared). Results go to $OUT.
#
#   run(command="bash scripts/device_gpu_check.sh [tests] [tiny] [bench]", carry=[".devbuild"])
#
# tests: the GPU tests (ops against composites, golden fixtures in f32 and bf16);
# tiny:  recipes/tiny-cpu.toml for 200 steps on the GPU and on the CPU, final losses side by side;
# bench: Llama-2-7B shape, seq 2048: ours and transformers+PEFT in the same call.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what=${*:-tests tiny bench}
( cd .devbuild && for f in lora-train it; do [ -f $f.gz ] && gunzip -kf $f.gz && chmod +x $f; done )
E="bash .devbuild/device-env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

if [[ $what == *tests* ]]; then
  LORA_TRAIN_ROOT=$PWD $E .devbuild/it ops:: golden:: --test-threads 1 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
fi

if [[ $what == *tiny* ]]; then
  for d in cuda cpu; do
    $E .devbuild/lora-train --recipe recipes/tiny-cpu.toml --set model.device=$d \
      --set output.dir=/tmp/tiny-$d 2>&1 | tail -3
    tail -1 /tmp/tiny-$d/metrics.jsonl | sed "s/^/$d: /" | tee -a "$OUT/tiny.txt"
  done
fi

if [[ $what == *bench* ]]; then
  B="--shape llama2-7b --seq 2048 --rank 16 --steps 10 --warmup 3"
  for cfg in "2 all" "2 qv" "8 all ckpt"; do
    set -- $cfg
    ck=""; [ "${3:-}" = ckpt ] && ck="--ckpt"
    echo "== lora-train micro-batch $1 targets $2 $ck"
    $E .devbuild/lora-train bench $B --micro-batch $1 --targets $2 $ck --json "$OUT/bench.jsonl" 2>&1 | tail -2
    echo "== peft micro-batch $1 targets $2 $ck"
    python3 .devbuild/peft_baseline.py $B --batch $1 --targets $2 $ck --json "$OUT/bench.jsonl" 2>&1 | tail -2
  done
fi
