#!/usr/bin/env bash
# llama.cpp against lora-train on the tiny Llama (docs/gguf.md, "Checked with llama.cpp"):
#   scripts/check_llama_cpp.sh LLAMA_CPP_BUILD_BIN [LORA_TRAIN_BIN]
# 1. greedy decoding: llama-completion on the merged f16 / f32 GGUF, and on the base GGUF with
#    --lora adapter.gguf, continues each prompt as `lora-train generate` does on the merged
#    safetensors (to EOS or 40 tokens);
# 2. llama-perplexity of the f16, q8_0 and q4_k_m files on held-out text (recipes/data/
#    tiny-chat.jsonl's messages, which the tiny adapter never saw).
# llama-completion is told add_eos_token=false: the tiny tokenizer_config.json says
# add_eos_token = true (so does the GGUF, as convert_hf_to_gguf.py writes it), which appends
# </s> to a prompt, while `generate` encodes a prompt without it. Its output is written by an
# asynchronous logger that can lose the tail at exit on a loaded machine: each run is retried
# until it ends with "[end of text]" or has all its tokens.
set -euo pipefail
L=$1
B=${2:-target/release/lora-train}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
AD=tests/fixtures/gguf/tiny_adapter
BASE=recipes/assets/tiny-llama
"$B" export --adapter $AD --base $BASE --out "$W/merged" > /dev/null
for q in f16 f32 q8_0 q4_k_m; do
  "$B" export --adapter $AD --base $BASE --format gguf --quant $q --out "$W/tiny-$q.gguf" > /dev/null
done
"$B" export --base $BASE --format gguf --out "$W/base.gguf" > /dev/null
"$B" export --adapter $AD --base $BASE --format gguf-lora --out "$W/lora.gguf" > /dev/null

complete() { # model prompt [extra args]: the continuation, retried until complete
  local m=$1 p=$2; shift 2
  local out=""
  for _ in $(seq 1 20); do
    out=$("$L/llama-completion" -m "$m" -p "$p" -n 40 --temp 0 -no-cnv --simple-io -t 2 --no-warmup \
      --override-kv tokenizer.ggml.add_eos_token=bool:false "$@" < /dev/null 2> /dev/null || true)
    if [[ $out == *"[end of text]"* ]]; then break; fi
  done
  out=${out%%" [end of text]"*}
  printf '%s' "${out#"$p"}"
}

ok=0; n=0
while IFS= read -r p; do
  ours=$("$B" generate --model "$W/merged" --prompt "$p" --max-new-tokens 40 2> /dev/null)
  for m in f16 f32 lora; do
    case $m in
      lora) got=$(complete "$W/base.gguf" "$p" --lora "$W/lora.gguf") ;;
      *) got=$(complete "$W/tiny-$m.gguf" "$p") ;;
    esac
    n=$((n + 1))
    if [[ "$got" == "$ours" ]]; then ok=$((ok + 1)); else echo "differs ($m) [$p]: lora-train '$ours' llama.cpp '$got'"; fi
  done
done < <(python3 -c '
import json
for l in open("recipes/data/tiny-text.jsonl").readlines()[:12]:
    print(" ".join(json.loads(l)["text"].split()[:4]))')
echo "greedy decoding: $ok of $n continuations equal"

python3 -c '
import json
for l in open("recipes/data/tiny-chat.jsonl"):
    for m in json.loads(l)["messages"]:
        print(m["content"])' > "$W/heldout.txt"
for q in f16 q8_0 q4_k_m; do
  ppl=$("$L/llama-perplexity" -m "$W/tiny-$q.gguf" -f "$W/heldout.txt" -c 64 -b 64 -t 2 \
    --override-kv tokenizer.ggml.add_eos_token=bool:false 2>&1 | grep -o 'Final estimate: PPL = [0-9.]*' | grep -o '[0-9.]*$')
  echo "perplexity $q: $ppl"
done
