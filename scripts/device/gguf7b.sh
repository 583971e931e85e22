#!/usr/bin/env bash
# The GGUF issue's 7B-shaped check (docs/gguf.md), on a GPU machine from the repo root:
#
#   run(command="bash scripts/device/gguf7b.sh", carry=[".devbuild"])
#
# .devbuild/ holds lora-train (the CUDA build, plain or .xz) and llama-completion (llama.cpp
# built for the CPU without -march=native: cmake -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON
# -DGGML_F16C=ON -DBUILD_SHARED_LIBS=OFF, target llama-completion). A random Llama-2-7B-shaped
# checkpoint (scripts/make_random_checkpoint.py, the tiny Llama's tokenizer: ids past its 512
# become [PAD<i>]) trains 20 steps on the GPU; the merged model is exported as safetensors, as
# an f16 GGUF, and the base as an f16 GGUF beside the adapter as a gguf-lora file. Greedy ids:
# `generate` on the merged safetensors (f32 on the GPU) against llama-completion on the merged
# GGUF and on the base GGUF with --lora (f16 weights, the CPU's 16 cores); scripts/check_gguf.py
# (gguf-py from .devbuild/gguf-0.19.0-py3-none-any.whl) on the merged file. About 53 GB of disk.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for f in .devbuild/lora-train .devbuild/llama-completion; do
  [ -f $f.xz ] && xz -dkf $f.xz
  chmod +x $f
done
B=".devbuild/lora-train"
E="bash scripts/device-env.sh"
C=/tmp/llama2-7b W=/tmp/g7
rm -rf $W && mkdir -p $W
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
[ -f $C/data.jsonl ] || python3 scripts/make_random_checkpoint.py $C llama2-7b --rows 8 2>&1 | tail -1
cp recipes/assets/tiny-llama/tokenizer*.json $C/
say "checkpoint made"
$E $B --recipe scripts/device/random-checkpoint.toml --set model.path=$C \
  --set data.train=$C/data.jsonl --set train.max_steps=20 --set output.dir=$W/run 2>&1 | tail -2
say "trained"
$E $B export --adapter $W/run --out $W/merged 2>&1 | tail -1
$E $B export --adapter $W/run --format gguf --out $W/merged.gguf 2>&1 | tail -1
pip install -q --no-deps --no-index --target /tmp/gguf-py .devbuild/gguf-*.whl 2>&1 | tail -1
PYTHONPATH=/tmp/gguf-py python3 scripts/check_gguf.py $W/merged.gguf $W/merged 2>&1 | tail -3
$E $B export --base $C --format gguf --out $W/base.gguf 2>&1 | tail -1
$E $B export --adapter $W/run --format gguf-lora --out $W/lora.gguf 2>&1 | tail -1
ls -la $W | tee "$OUT/gguf7b-files.txt"
say "exported"
{
ok=0; n=0
for p in "Once upon a time" "The capital of France is" "def fibonacci(n):"; do
  ours=$($E $B generate --model $W/merged --prompt "$p" --max-new-tokens 16 --device cuda \
    --dtype f32 2>/dev/null)
  for m in merged lora; do
    case $m in
      merged) args=(-m $W/merged.gguf) ;;
      lora) args=(-m $W/base.gguf --lora $W/lora.gguf) ;;
    esac
    got=$(.devbuild/llama-completion "${args[@]}" -p "$p" -n 16 --temp 0 -no-cnv --simple-io \
      -t 16 --no-warmup --override-kv tokenizer.ggml.add_eos_token=bool:false </dev/null 2>/dev/null)
    got=${got%%" [end of text]"*}; got=${got#"$p"}
    n=$((n + 1))
    if [[ "$got" == "$ours" ]]; then ok=$((ok + 1)); else
      echo "differs ($m) [$p]: lora-train '$ours' llama.cpp '$got'"; fi
  done
done
echo "greedy decoding: $ok of $n continuations equal"
} 2>&1 | tee "$OUT/gguf7b.txt"
say "decoded"
