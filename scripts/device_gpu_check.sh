#!/usr/bin/env bash
# The GPU session's checks, run ON the device machine from the repo root (device tool), with
# .devbuild/ carried: lora-train.gz and it.gz (CUDA builds: the binary and the integration-test
# binary), device-env.sh and peft_baseline.py (copied from ../shared). Results go to $OUT.
#
#   run(command="bash scripts/device_gpu_check.sh [compat] [chat] [tests] [tiny] [bench]", carry=[".devbuild"])
#
# compat: scripts/check_peft_compat.py (PEFT / transformers load our adapter and merged model);
# chat:  scripts/reference_chat.py with this machine's transformers, diffed against the fixtures;
# tests: the GPU tests (ops against composites, golden fixtures in f32 and bf16);
# tiny:  recipes/tiny-cpu.toml for 200 steps on the GPU and on the CPU, final losses side by side;
# bench: Llama-2-7B shape, seq 2048: ours and transformers+PEFT in the same call.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what=${*:-compat chat tests tiny bench}
( cd .devbuild && for f in lora-train it; do [ -f $f.gz ] && gunzip -kf $f.gz && chmod +x $f; done )
E="bash .devbuild/device-env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

if [[ $what == *compat* ]]; then
  timeout 120 python3 scripts/check_peft_compat.py 2>&1 | tee "$OUT/compat.log" | tail -12
fi

if [[ $what == *chat* ]]; then
  rm -rf /tmp/chat-committed && cp -r tests/fixtures/chat /tmp/chat-committed
  timeout 120 python3 scripts/reference_chat.py 2>&1 | tail -8
  python3 -c 'import transformers; print("transformers", transformers.__version__)'
  diff -r /tmp/chat-committed tests/fixtures/chat > "$OUT/chat.diff" && echo "chat fixtures: identical" \
    || { echo "chat fixtures differ:"; head -20 "$OUT/chat.diff"; }
fi

if [[ $what == *tests* ]]; then
  LORA_TRAIN_ROOT=$PWD timeout 240 $E .devbuild/it ops:: golden:: --test-threads 1 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "^test |test result|panicked|error" | head -40
fi

if [[ $what == *tiny* ]]; then
  for run in "cpu f32" "cuda f32" "cuda bf16"; do
    set -- $run
    timeout 120 $E .devbuild/lora-train --recipe recipes/tiny-cpu.toml --set model.device=$1 \
      --set model.dtype=$2 --set output.dir=/tmp/tiny-$1-$2 2>&1 | tail -2
    tail -1 /tmp/tiny-$1-$2/metrics.jsonl | sed "s/^/$1 $2: /" | tee -a "$OUT/tiny.txt"
  done
fi

# BENCH: ";"-separated configs "micro-batch targets [ckpt]"; a trailing "-" skips PEFT for it.
if [[ $what == *bench* ]]; then
  B="--shape llama2-7b --seq 2048 --rank 16 --steps 10 --warmup 3"
  IFS=';' read -ra cfgs <<< "${BENCH:-2 all;2 qv;8 all ckpt}"
  for cfg in "${cfgs[@]}"; do
    set -- $cfg
    ck=""; [[ " $* " == *" ckpt "* ]] && ck="--ckpt"
    echo "== lora-train micro-batch $1 targets $2 $ck"
    timeout 150 $E .devbuild/lora-train bench $B --micro-batch $1 --targets $2 $ck --json "$OUT/bench.jsonl" 2>&1 | tail -2
    [[ " $* " == *" - "* ]] && continue
    echo "== peft micro-batch $1 targets $2 $ck"
    timeout 150 python3 .devbuild/peft_baseline.py $B --batch $1 --targets $2 $ck --json "$OUT/bench.jsonl" 2>&1 | tail -2
  done
fi
