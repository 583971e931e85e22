#!/usr/bin/env bash
# Issue 69's checks of the data path at scale, one script for the 2-core workstation and for the
# 16-core device:
#
#   bash scripts/data_at_scale.sh --mb 160 --model recipes/assets/tiny-llama --device cpu
#   bash scripts/data_at_scale.sh --mb 1000 --model /tmp/llama2-7b --device cuda --peer 16 \
#     --seq-len 2048
#
# 1. makes the Alpaca jsonl (scripts/make_big_alpaca.py, seeded);
# 2. with --peer N, times HF datasets.map(batched=True, num_proc=N) on it with the model's
#    tokenizer (scripts/hf_tokenize_baseline.py; needs datasets and transformers);
# 3. a first run of the recipe into a fresh cache and output directory (tokenizing, timed with
#    /usr/bin/time -v: wall, CPU%, peak RSS), then a second run of the same recipe into a new
#    output directory (the cache mapped);
# 4. a resume: a run that saves a checkpoint at step 1, resumed to step 2 (the "loaded in" line
#    times data, weights and adapters apart; the first step line follows it).
# 5. streaming start: the recipe with data.shuffle=false into a fresh cache, streamed (the first
#    step starts once its rows are tokenized, the rest tokenize behind it) and with
#    LORA_TRAIN_DATA_STREAM=off (the first step waits for the whole preparation).
# Every run logs "first step starts N s after data preparation began"; with the ts prefix below,
# the first step's time from the start of the process is read off that line.
# Every line a run prints is prefixed with the seconds since it started (ts), so "first step
# within N s" is read off the log. The model directory needs tokenizer.json and
# tokenizer_config.json (a random checkpoint from scripts/make_random_checkpoint.py gets the
# tokenizer copied in by hand).
set -euo pipefail
cd "$(dirname "$0")/.."
mb=160 model=recipes/assets/tiny-llama device=cpu peer=0 out=/tmp/data-at-scale seq=256
bin=${LORA_TRAIN:-target/release/lora-train}
while [ $# -gt 0 ]; do
  case $1 in
    --mb) mb=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    --peer) peer=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --seq-len) seq=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
model=$(realpath "$model")
mkdir -p "$out"
data=$out/alpaca-$mb.jsonl
[ -f "$data" ] || python3 scripts/make_big_alpaca.py --mb "$mb" --out "$data"
dtype=$([ "$device" = cpu ] && echo f32 || echo bf16)
cat > "$out/recipe.toml" <<EOF
[model]
path = "$model"
dtype = "$dtype"
device = "$device"

[lora]
rank = 8
alpha = 16
targets = "all-linear"

[data]
train = "$data"
format = "alpaca"
seq_len = $seq
pack = true

[train]
micro_batch = 4
grad_accum = 2
max_steps = 2
lr = 3e-3
seed = 42
log_every = 1
EOF

# Prefixes each line with the seconds since the command started.
ts() { awk -v t0="$(date +%s.%N)" '{ c = "date +%s.%N"; c | getline now; close(c); printf "[%7.1fs] %s\n", now - t0, $0; fflush() }'; }

if [ "$peer" -gt 0 ]; then
  echo "== HF datasets.map(batched=True, num_proc=$peer)"
  python3 scripts/hf_tokenize_baseline.py --model "$model" --data "$data" --num-proc "$peer" --seq-len "$seq" 2>/dev/null | tail -1
fi
cache=$out/cache
rm -rf "$cache" "$out"/run1 "$out"/run2 "$out"/resume
export LORA_TRAIN_CACHE=$cache
echo "== first run (tokenizes into $cache)"
/usr/bin/time -v "$bin" --recipe "$out/recipe.toml" --set output.dir="$out/run1" 2>&1 | ts \
  | grep -E "tokenizing|loaded in|^.{11}data |first step|step 1/|User time|Percent of CPU|Elapsed|Maximum resident"
echo "== second run, new output directory (maps the cache)"
/usr/bin/time -v "$bin" --recipe "$out/recipe.toml" --set output.dir="$out/run2" 2>&1 | ts \
  | grep -E "loaded in|first step|step 1/|Percent of CPU|Elapsed|Maximum resident"
echo "== resume: checkpoints at steps 1 and 2, the second removed, resumed from the first"
"$bin" --recipe "$out/recipe.toml" --set output.dir="$out/resume" --set output.save_every=1 \
  > /dev/null 2>&1
rm -rf "$out/resume/checkpoint-2"
"$bin" --recipe "$out/recipe.toml" --set output.dir="$out/resume" --set output.save_every=1 \
  --set train.resume=true 2>&1 | ts | grep -E "resuming|loaded in|step 2/"
for mode in on off; do
  echo "== first step with data.shuffle=false, LORA_TRAIN_DATA_STREAM=$mode (a fresh cache)"
  rm -rf "$cache-$mode" "$out/stream-$mode"
  LORA_TRAIN_CACHE=$cache-$mode LORA_TRAIN_DATA_STREAM=$mode /usr/bin/time -v "$bin" \
    --recipe "$out/recipe.toml" --set output.dir="$out/stream-$mode" --set data.shuffle=false 2>&1 \
    | ts | grep -E "streams|first step|step 1/|prepared behind|Elapsed|Maximum resident"
done
cmp "$out/stream-on/adapter_model.safetensors" "$out/stream-off/adapter_model.safetensors" \
  && echo "streamed and not: the same adapter"
