#!/usr/bin/env bash
# The GPU checks, run ON a GPU machine from the repo root, with .devbuild/ holding lora-train and
# it, each plain or as .xz / .gz (the CUDA builds of the binary and of the integration-test
# binary: scripts/build-cuda.sh --tests --bins; xz -6 keeps both under the 64 MiB a call carries).
# Results go to $OUT (default /tmp/out). With the device tool of our workplace:
#
#   run(command="bash scripts/device_gpu_check.sh [compat] [chat] [tests] [tiny] [bench]", carry=[".devbuild"])
#   run(command="bash scripts/device_gpu_check.sh families famb", carry=[".devbuild"])
#   run(command="bash scripts/device_gpu_check.sh dist", kind="nvidia-h200-x2", carry=[".devbuild"])
#   run(command="bash scripts/device_gpu_check.sh dist2", kind="nvidia-h200-x2", carry=[".devbuild"])
#   run(command="bash scripts/device_gpu_check.sh torchrun", kind="nvidia-h200-x2", carry=[".devbuild"])
#   run(command="bash scripts/device_gpu_check.sh peercopy", kind="nvidia-h200-x2", carry=[".devbuild"])
#   run(command="bash scripts/device_gpu_check.sh trlcheck dpo", carry=[".devbuild"])
#
# compat: scripts/check_peft_compat.py (PEFT / transformers load our adapter and merged model);
# chat:  scripts/reference_chat.py with this machine's transformers, diffed against the fixtures;
# tests: the GPU tests (ops against composites, golden fixtures in f32 and bf16);
# tiny:  recipes/tiny-cpu.toml for 200 steps on the GPU and on the CPU, final losses side by side,
#         and the last checkpoint's adapter compared with the exported one (byte for byte);
# bench: Llama-2-7B shape, seq 2048: ours and transformers+PEFT in the same call.
# families: for each family fixture (tests/fixtures/golden: qwen3_qk_norm gemma2_softcap
#         gemma3_local_global phi3_fused_longrope llama32_tied_long qwen3_moe; or FAMILY_CASES)
#         our binary trains 4 steps on CUDA in f32 from init_adapter (eval set = train.jsonl),
#         exports the merge and decodes 8 greedy ids; scripts/check_family_compat.py loads the
#         adapter with PeftModel and checks our eval loss, greedy ids and merged checkpoint
#         against it -> $OUT/families_compat.log.
# famb:   qwen3-8b gemma2-9b gemma3-12b phi3-mini shapes, seq 2048, mb2 (FAMB_MB), r16 all linear:
#         `bench` beside scripts/bench_peft.py (each 240 s at most) -> $OUT/famb.jsonl. FAMB_CKPT=1:
#         both checkpointed; FAMB_SHAPES picks shapes; FAMB_EXP=name also runs ours with
#         LORA_TRAIN_EXPERIMENTS=name (tagged with it); FAMB_DEFAULT=0 skips ours without it.
#         Not in the default set.
# ckpt8b: Llama-3-8B shape, seq 4096, mb2, r16 all linear: `bench --ckpt mlp` (gate and up
#         parked in host memory), the same recomputing them (--offload false), `--ckpt` and
#         neither, beside scripts/bench_peft.py --ckpt (and --liger) -> $OUT/ckpt8b.jsonl.
#         Not in the default set.
# bf16err: scripts/peft_bf16_error.py (PEFT's own bf16 error on the golden cases, BF16ERR_CASES
#         or all) into tests/fixtures/golden/peft_bf16_error.json, copied to $OUT; before tests.
# train7b: the `train` command on a saved random Llama-2-7B checkpoint (scripts/
#         make_random_checkpoint.py; tokens data, seq 2048, mb2, r16 all linear) beside `bench` at
#         the same shape and scripts/bench_peft.py (and --liger when liger_kernel imports); the
#         time to read the checkpoint's bytes from disk (cold cache) beside our load time.
#         TRAIN7B_PEERS picks the peers ("plain liger", the default; "" for ours alone).
# dropout: the `train` command on that saved checkpoint with lora.dropout = 0.0 and 0.05, one
#         after the other (acceptance: 0.05 at >= 95% of 0.0's tok/s), and scripts/bench_peft.py
#         with PEFT's lora_dropout = 0.05 (and --liger) -> $OUT/dropout.jsonl, $OUT/dropout.txt.
# decode: `generate --bench` (7B shape, bf16, prompt 128, 256 new tokens): base and r16 adapters,
#         each without and with the decode_graph experiment, beside scripts/bench_generate_hf.py
#         (transformers, static cache) -> $OUT/decode.jsonl.
# sweep:  scripts/sweep.sh (every knob against the plain configuration; PEERS=0 for ours only,
#         ROWS to pick rows) -> $OUT/sweep.jsonl, $OUT/sweep.md.
# dist (2 GPUs, a lora-train built with --features cuda,nccl): the tiny recipe trained with ddp and
#   fsdp on GPUs 0,1 (complete adapter, loss), then the 7B-shape bench with one global batch of
#   4 rows of 2048: single micro-batch 4 (and 2: the scaling reference), ddp and fsdp 2 GPUs x 2
#   (each also with the reduce_ahead experiment; fsdp checkpointed); per-rank tok/s and peaks, losses ->
#   $OUT/dist.jsonl. dist2: single 2 x accumulation 2, single and ddp checkpointed.
# torchrun (2 GPUs): peft_baseline.py --mode ddp / fsdp, same shape -> $OUT/dist.jsonl.
#   (dist, dist2 and torchrun are separate calls: each takes several minutes.)
# memory: `lora-train plan` forecasts vs `bench` measured pool peaks (single: mb2, mb2 + ckpt,
#         mb8 + ckpt; per phase), ratios printed (target: within ±10%); then the OOM case
#         (bench --max-memory 24GiB, mb2, no ckpt: expect exit 4 and the diagnosis).
# peercopy (2 GPUs): the parallel::nccl GPU test under CUDA_MODULE_LOADING=EAGER (peer copies) and
#         the other test that needs 2 GPUs (they fail on fewer; `tests` skips them), then FSDP
#         with peer copies (LORA_TRAIN_EXPERIMENTS=peer_copy) RUNS times, exit statuses.
# qlora:  NF4 base (double quant), Llama-2-7B shape, seq 2048, mb2, r16 all linear: `bench
#         --quantize nf4` beside scripts/bench_peft.py --load-in-4bit (bitsandbytes from the wheel
#         in .devbuild when it does not import); `plan --shape llama2-7b --nf4 --gpu-mem 24GiB`
#         and `bench --max-memory 24GiB` at the largest micro-batch it names (no ckpt, else
#         ckpt); the Llama-2-70B shape NF4 at mb1, checkpointed -> $OUT/qlora.jsonl,
#         $OUT/qlora-plan*.json. Carry .devbuild/lora-train.gz and the bitsandbytes wheel
#         (scripts/fetch-wheels.sh), without it.gz (64 MiB). Not in the default set.
# unsloth: Unsloth 2026.10.9 beside ours (issue 67): the 7B headline (Llama-2-7B shape, bf16,
#         seq 2048, mb2, r16 all linear, no checkpointing) and Llama-3-8B QLoRA (NF4, seq 2048,
#         mb2, r16 all linear), each row ours (`bench`, as the `bench` and `qlora` modes run it)
#         and scripts/bench_unsloth.py (FastLanguageModel on a saved random checkpoint of the
#         shape, made first: make_random_checkpoint.py --tokenizer), 10 timed steps after 3 ->
#         $OUT/unsloth.jsonl, $OUT/unsloth.txt (ours, Unsloth, ratio, peaks), $OUT/unsloth-*.log.
#         Unsloth and the dependencies the image lacks are installed from .devbuild/unsloth
#         (scripts/fetch-wheels.sh unsloth) into /tmp/unsloth-site, on PYTHONPATH for its runs
#         only; if it fails to import, its traceback's tail is printed and ours still run.
#         UNSLOTH_ROWS picks rows (default "7b 8b-nf4"; also "7b-ckpt": both checkpointed;
#         "qwen3-8b", "gemma2-9b" (mb1), "phi3-mini", "moe" (qwen3-30b-a3b, checkpointed)); the
#         issue wants one call a row. Each row runs ours, then scripts/bench_peft.py plain and
#         --liger (UNSLOTH_PEERS: "plain liger", one, or none; liger from its wheel), then
#         Unsloth's, within UNSLOTH_BUDGET s (450) of the start; the table gives every peer's
#         ratio. Carry .devbuild/lora-train.xz, .devbuild/bitsandbytes-*.whl, the liger wheel
#         and .devbuild/unsloth (~25 MB). Not in the default set.
# ulong:  issue 67's longest-context row: Llama-3-8B shape, micro-batch 1, checkpointed (Unsloth:
#         "unsloth"), r16 all linear, under an 80 GiB cap (ULONG_CAP), NF4 base (ULONG_Q: "nf4",
#         "bf16" or both), one step at each of ULONG_T (65536 131072): ours and Unsloth (on a
#         saved random checkpoint, as the unsloth mode) -> $OUT/ulong.jsonl, $OUT/ulong.txt (each
#         system's peaks, its GiB per 1M tokens and the T at which it meets the cap), within
#         ULONG_BUDGET s (540). Carry .devbuild/lora-train.xz, the bitsandbytes wheel and
#         .devbuild/unsloth. Not in the default set.
# ab:     ours alone, the mb2 all-linear 7B bench in each of AB's ";"-separated variants (each:
#         VAR=value assignments and bench flags, e.g. "LORA_TRAIN_EXPERIMENTS=reduce_ahead" or
#         "--deterministic"; "default": neither), ROUNDS rounds (default 2) alternated (default
#         AB: "default;--deterministic") -> $OUT/ab.jsonl. Not in the default set.
# energy: a step's GPU energy (NVML's counter) at the 7B headline shape (seq 2048, mb2, r16 all
#         linear), ours beside PEFT and PEFT + Liger (ENERGY_PEERS: "plain liger", one, or none):
#         joules and tokens per kJ, the ratios -> $OUT/energy.jsonl, $OUT/energy.txt. ENERGY_SHAPE
#         replaces the shape ("--shape llama3-8b --seq 4096"); ENERGY_OURS adds flags to ours
#         ("--ckpt mlp"), ENERGY_PEER to the peers' ("--ckpt"). Not in the default set.
# floor:  scripts/energy_floor.py at the energy mode's shape (FLOOR_SHAPE, default llama2-7b;
#         seq 2048, mb2): the energy of a step's frozen GEMMs alone, causal attention's (torch's
#         flash kernels), a GB moved and the idle watts -> $OUT/floor.jsonl; after `energy` in the
#         same call, each trainer's step split into its frozen GEMMs and the rest, and the rest's
#         budget for 2.0x the peer's tokens per joule -> $OUT/floor.txt. Not in the default set.
# data:   issue 69's device row: scripts/data_at_scale.sh --mb DATA_MB (1000) on the saved random
#         Llama-2-7B checkpoint at /tmp/llama2-7b (made if absent; the tiny BPE tokenizer of
#         recipes/assets/tiny-llama copied in when it has none), seq 2048, with HF
#         datasets.map(num_proc=16) as the peer (datasets, dill and multiprocess installed from
#         the wheels in .devbuild/unsloth or .devbuild/) -> $OUT/data.txt. Not in the default set.
# profile: where a step's GPU time goes, for each of PROFILE_SHAPES (default gemma2-9b phi3-mini
#         llama2-7b; seq PROFILE_SEQ (2048), mb2, r16 all linear; PROFILE_EXTRA adds bench
#         flags): ncu times
#         PROFILE_COUNT launches (default 12000) after PROFILE_SKIP (3000) of `bench --steps 4
#         --warmup 1`, scripts/kernel_table.py sums them a step, by kind and by kernel ->
#         $OUT/profile-<shape>.csv, .md; PROFILE_LIMIT: seconds per shape (420). Not in the
#         default set.
# dpo:    issue 65's speed row, one call: Llama-2-7B shape, bf16, pairs of a 512-token prompt and
#         two 512-token completions (--seq 1024 --prompt-len 512), 4 pairs a micro-batch, r16 all
#         linear, 10 timed steps after 3: ours (`bench --objective dpo`, no checkpointing; its
#         reference_fwd_s / reference_share: the step's reference forwards timed alone after the
#         window), then scripts/bench_peft.py --objective dpo (TRL 1.16 DPOTrainer + PEFT) in each of
#         DPO_PEERS (default "plain ckpt liger"; also "liger-ckpt": ckpt = TRL's default
#         gradient_checkpointing, liger = + Liger's fused linear DPO loss and layer kernels), each
#         within 200 s -> $OUT/dpo.jsonl, $OUT/dpo.txt (pairs/s, peak GiB, ours / peer). DPO_OURS
#         adds flags to ours. TRL and datasets from .devbuild/trl (scripts/fetch-wheels.sh trl),
#         Liger from .devbuild/liger_kernel-*.whl. Not in the default set.
# trlcheck: scripts/check_trl_pref.py on CUDA in f32: TRL's own DPOTrainer and ORPOTrainer (TRL_CASES
#         picks fixture cases; default "dpo_sigmoid orpo") against our binary from the same init
#         adapter, 6 steps; PASS when every adapter entry is within 1e-4 -> $OUT/trlcheck.log,
#         $OUT/trlcheck.jsonl. Not in the default set.
# moeq:   issue 68's MoE rows on a small card: Qwen3-30B-A3B QLoRA (NF4 base, routed experts
#         included), seq 2048, mb1, checkpointed, r16 LoRA on the attention, under --max-memory
#         24GiB (`bench --quantize nf4`), beside `plan` of the same run at 24 GiB
#         -> $OUT/moeq.jsonl, $OUT/moeq-plan-<shape>.json; then the NF4-expert and gpt-oss GPU tests
#         (nf4_experts_on_cuda, golden_on_cuda_f32_and_bf16 with gpt_oss; run `bf16err` with
#         BF16ERR_CASES=gpt_oss before it). MOEQ_SHAPES ("shape:targets" words, default
#         "qwen3-30b-a3b:attn"; gpt-oss-20b:all is its recipe's) picks the rows; MOEQ_TESTS=0 skips
#         the tests. Not in the default set.
# moeprof: where a MoE step's time goes (issue 68's MFU): ours' bench of MOEPROF_SHAPE
#         (qwen3-30b-a3b), seq 2048, mb2, r16 all linear + experts, checkpointed, with each
#         binary of MOEPROF_BINS in turn (default "lora-train"; .devbuild/<name>[.xz]): its
#         host_queue_s, route_reads and route_wait_s (the seconds a step the host waited on the
#         routing's reads: near host_queue_s the device sets the pace) -> $OUT/moeprof.jsonl;
#         then, where nsys is installed, 3 steps under `nsys profile --trace cuda` and its CUDA
#         API, kernel and memcpy sums -> $OUT/moeprof_*.csv. Not in the default set.
# hallab: one build against another at the 7B headline (llama2-7b, seq 2048, mb2, r16 all linear,
#         10 timed steps after 3): .devbuild/lora-train-before(.xz) and .devbuild/lora-train
#         alternating, ROUNDS (2) rounds -> $OUT/hallab.jsonl (tag: which binary). Issue 62's
#         "behaviour unchanged" on the device. Not in the default set.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what=" ${*:-compat chat tests tiny bench memory} "
# .devbuild/<name> from its .xz or .gz where there is one, executable
devbin() {
  ( cd .devbuild && if [ -f $1.xz ]; then xz -dkf $1.xz; elif [ -f $1.gz ]; then gunzip -kf $1.gz; fi
    [ -f $1 ] && chmod +x $1 )
}
for f in lora-train it; do devbin $f; done
E="bash scripts/device-env.sh"
# Liger-Kernel for the peers' --liger runs, from its wheel carried in .devbuild/ (fetch-wheels.sh)
lwhl=$(ls .devbuild/liger_kernel-*.whl 2>/dev/null | head -1)
if [ -n "$lwhl" ] && ! python3 -c "import liger_kernel" 2>/dev/null; then
  pip install --no-deps --no-index --target /tmp/liger "$lwhl" >/dev/null 2>&1
  export PYTHONPATH=/tmp/liger:${PYTHONPATH:-}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

# TRL 1.16 and datasets (dill, multiprocess) for the preference peers, from .devbuild/trl
# (scripts/fetch-wheels.sh trl), when the image's Python lacks them.
trl_site() {
  python3 -c "import trl, datasets" 2>/dev/null && return 0
  if ! ls .devbuild/trl/*.whl > /dev/null 2>&1; then
    echo "trl: not installed and no wheels in .devbuild/trl (scripts/fetch-wheels.sh trl)"; return 1
  fi
  python3 -m pip install --no-deps --no-index --target /tmp/trl-site .devbuild/trl/*.whl \
    > "$OUT/trl-install.log" 2>&1 || { echo "trl wheels: install failed"; tail -5 "$OUT/trl-install.log"; return 1; }
  export PYTHONPATH=/tmp/trl-site:${PYTHONPATH:-}
  python3 -c "import trl, datasets; print('trl', trl.__version__, 'datasets', datasets.__version__)" 2>&1 | tail -3
}

if [[ $what == *" trlcheck "* ]]; then
  if trl_site; then
    timeout 400 python3 scripts/check_trl_pref.py .devbuild/lora-train --device cuda \
      --runner "bash scripts/device-env.sh" $(printf -- '--case %s ' ${TRL_CASES:-dpo_sigmoid orpo}) \
      --json "$OUT/trlcheck.jsonl" > "$OUT/trlcheck.log" 2>&1
    echo "check_trl_pref exit $?"
    grep -E "^== |^   (losses|[a-z_]+:)" "$OUT/trlcheck.log" | tail -20
    grep -E "Error|error:" "$OUT/trlcheck.log" | tail -5
  fi
fi

if [[ $what == *" dpo "* ]]; then
  D="--shape llama2-7b --seq 1024 --prompt-len 512 --rank 16 --targets all --steps 10 --warmup 3"
  echo "== lora-train bench --objective dpo, 4 pairs ${DPO_OURS:-}"
  timeout 200 $E .devbuild/lora-train bench $D --objective dpo --micro-batch 4 ${DPO_OURS:-} \
    --json "$OUT/dpo.jsonl" 2>&1 | tail -1 | cut -c1-300
  if trl_site; then
    for peer in ${DPO_PEERS:-plain ckpt liger}; do
      fl=""
      [[ $peer == *ckpt* ]] && fl="$fl --ckpt"
      [[ $peer == liger* ]] && fl="$fl --liger"
      echo "== TRL DPOTrainer + PEFT: $peer"
      timeout 200 python3 scripts/bench_peft.py $D --objective dpo --batch 4 $fl --tag "dpo-$peer" \
        --json "$OUT/dpo.jsonl" > "$OUT/dpo-$peer.log" 2>&1
      echo "exit $?"; tail -1 "$OUT/dpo-$peer.log" | cut -c1-300
      grep -E "Error|error" "$OUT/dpo-$peer.log" | tail -3
    done
  fi
  # plan's forecast of our row: the shape at the run's rows, and a recipe of the same run
  # (train.objective = "dpo", 4 pairs, seq_len 1024) on the shape's config.json alone
  PD=/tmp/dpo-plan; mkdir -p $PD
  (cd scripts && python3 -c "
from bench_peft import SHAPES, family_classes
f, s = SHAPES['llama2-7b']; C, _, _ = family_classes(f); C(**s).save_pretrained('$PD')")
  echo '{"prompt_input_ids": [1], "chosen_input_ids": [2], "rejected_input_ids": [3]}' > $PD/pairs.jsonl
  printf '[model]\npath = "%s"\ndevice = "cuda"\n[lora]\nrank = 16\nalpha = 32\ntargets = "all-linear"\n[data]\ntrain = "%s"\nformat = "preference"\nseq_len = 1024\n[train]\nobjective = "dpo"\nmicro_batch = 4\n' \
    $PD $PD/pairs.jsonl > $PD/recipe.toml
  $E .devbuild/lora-train plan --recipe $PD/recipe.toml --json > "$OUT/dpo-plan-recipe.json" 2>"$OUT/dpo-plan.err" \
    || tail -3 "$OUT/dpo-plan.err"
  # a recipe knows no prompt lengths: its rows are the worst pair's (2 x seq_len - 1 tokens, a
  # one-token prompt); the run's own rows are 2 x 1024 - 512 = 1536 tokens (bench plans those)
  $E .devbuild/lora-train plan --shape llama2-7b --seq 1536 --micro-batch 4 --rank 16 --targets all \
    --json > "$OUT/dpo-plan.json" 2>>"$OUT/dpo-plan.err" || tail -3 "$OUT/dpo-plan.err"
  python3 - "$OUT" <<'PY' | tee "$OUT/dpo.txt"
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/dpo.jsonl")]
try:
    plan = json.load(open(f"{sys.argv[1]}/dpo-plan.json"))["selected"]
except (OSError, ValueError, KeyError):
    plan = None
ours = next((r for r in rows if r["system"] == "lora-train"), None)
print(f"{'system':22s} {'ckpt':5s} {'pairs/s':>8s} {'peak GiB':>9s} {'ours/peer pairs/s':>18s} {'peer/ours peak':>15s}")
for r in rows:
    pp, pk = r.get("pairs_per_s"), r.get("peak_alloc_gib")
    if r.get("oom") or pp is None:
        print(f"{r['system']:22s} {str(r.get('ckpt')):5s} OOM / no figure: {r.get('error', '')[:80]}"); continue
    ratio = ours["pairs_per_s"] / pp if ours and r is not ours else 1.0
    mem = pk / ours["peak_alloc_gib"] if ours and pk and ours.get("peak_alloc_gib") else float("nan")
    print(f"{r['system']:22s} {str(r.get('ckpt')):5s} {pp:8.3f} {pk or float('nan'):9.2f} {ratio:17.2f}x {mem:14.2f}x")
if ours:
    print(f"ours: reference forwards {ours.get('reference_fwd_s')} s of a {ours['step_s']} s step: "
          f"share {ours.get('reference_share')} (target <= 0.333); acceptance: >= 2.0x TRL + PEFT's "
          f"pairs/s, its peak >= 2.0x ours, ahead of + Liger")
    if plan and ours.get("peak_alloc_gib"):
        print(f"plan at the run's rows (1536 tokens a pair): peak {plan['peak_alloc_gib']} GiB ({plan['peak_phase']}) "
              f"against {ours['peak_alloc_gib']} measured: {plan['peak_alloc_gib'] / ours['peak_alloc_gib']:.3f} (target within 10%)")
    try:
        bound = json.load(open(f"{sys.argv[1]}/dpo-plan-recipe.json"))["selected"]
        print(f"plan of a recipe (seq_len 1024, rows of the worst pair, 2047 tokens): {bound['peak_alloc_gib']} GiB, "
              f"{bound['peak_alloc_gib'] / ours['peak_alloc_gib']:.3f} of measured (a bound)")
    except (OSError, ValueError, KeyError):
        pass
PY
fi

if [[ $what == *" compat "* ]]; then
  timeout 120 python3 scripts/check_peft_compat.py 2>&1 | tee "$OUT/compat.log" | tail -12
fi

if [[ $what == *" chat "* ]]; then
  rm -rf /tmp/chat-committed && cp -r tests/fixtures/chat /tmp/chat-committed
  timeout 120 python3 scripts/reference_chat.py 2>&1 | tail -8
  python3 -c 'import transformers; print("transformers", transformers.__version__)'
  diff -r /tmp/chat-committed tests/fixtures/chat > "$OUT/chat.diff" && echo "chat fixtures: identical" \
    || { echo "chat fixtures differ:"; head -20 "$OUT/chat.diff"; }
fi

if [[ $what == *" bf16err "* ]]; then
  # before `tests`: the CUDA bf16 goldens read these bounds
  timeout 300 python3 scripts/peft_bf16_error.py --device cuda ${BF16ERR_CASES:+$(printf -- '--case %s ' $BF16ERR_CASES)} \
    --json tests/fixtures/golden/peft_bf16_error.json 2>&1 | tail -12
  cp tests/fixtures/golden/peft_bf16_error.json "$OUT/"
fi

if [[ $what == *" moeq "* ]]; then
  for row in ${MOEQ_SHAPES:-qwen3-30b-a3b:attn}; do
    shape=${row%%:*}; targets=${row#*:}
    M="--shape $shape --seq 2048 --micro-batch 1 --rank 16 --targets $targets --ckpt"
    .devbuild/lora-train plan $M --nf4 --gpu-mem 24GiB --json > "$OUT/moeq-plan-$shape.json" 2>&1
    python3 -c "import json,sys; p=json.load(open(sys.argv[1])); print('plan:', json.dumps(p.get('selected'))[:600])" "$OUT/moeq-plan-$shape.json" 2>&1 | tail -2
    echo "== lora-train $shape nf4 targets $targets under 24GiB"
    timeout 300 $E .devbuild/lora-train bench $M --quantize nf4 --max-memory 24GiB --steps 6 --warmup 2 \
      --tag "$shape-nf4-24gib" --json "$OUT/moeq.jsonl" 2>&1 | tail -4 | cut -c1-900
  done
  [ "${MOEQ_TESTS:-1}" = 1 ] && env LORA_TRAIN_ROOT=$PWD "CARGO_BIN_EXE_lora-train=$PWD/.devbuild/lora-train" timeout 300 $E .devbuild/it \
    nf4_experts_on_cuda golden_on_cuda_f32_and_bf16 --test-threads 1 2>&1 | tee "$OUT/moeq-tests.log" \
    | grep -E "^test |test result|panicked|failed:|off by|gpt_oss" | head -30
fi

if [[ $what == *" hallab "* ]]; then
  devbin lora-train-before
  H="--shape llama2-7b --seq 2048 --micro-batch 2 --rank 16 --targets all --steps 10 --warmup 3"
  for round in $(seq "${ROUNDS:-2}"); do
    for bin in lora-train-before lora-train; do
      [ -x .devbuild/$bin ] || { echo "hallab: no .devbuild/$bin"; continue; }
      timeout 150 $E .devbuild/$bin bench $H --tag $bin --json "$OUT/hallab.jsonl" > "$OUT/hallab-$bin.log" 2>&1 \
        || { echo "hallab: $bin exit $?"; tail -3 "$OUT/hallab-$bin.log"; continue; }
      tail -1 "$OUT/hallab.jsonl" | python3 -c "import json, sys; d = json.load(sys.stdin); \
print('round $round, $bin:', d['tokens_per_s'], 'tok/s,', d['peak_alloc_gib'], 'GiB, loss', d['final_loss'], 'host_queue_s', d.get('host_queue_s'))"
    done
  done
fi

# moeprof: see the header.
if [[ $what == *" moeprof "* ]]; then
  MP="--shape ${MOEPROF_SHAPE:-qwen3-30b-a3b} --seq 2048 --micro-batch 2 --rank 16 --targets all --ckpt"
  for bin in ${MOEPROF_BINS:-lora-train}; do
    devbin $bin
    [ -x .devbuild/$bin ] || { echo "moeprof: no .devbuild/$bin"; continue; }
    echo "== $bin bench $MP"
    timeout 200 $E .devbuild/$bin bench $MP --steps 6 --warmup 2 --tag $bin --json "$OUT/moeprof.jsonl" \
      > "$OUT/moeprof-$bin.log" 2>&1 || { echo "exit $?"; tail -3 "$OUT/moeprof-$bin.log"; continue; }
    tail -1 "$OUT/moeprof.jsonl" | python3 -c "import json, sys; d = json.load(sys.stdin); \
print({k: d.get(k) for k in ['tag', 'tokens_per_s', 'step_s', 'host_queue_s', 'route_reads', 'route_wait_s', 'mfu', 'peak_alloc_gib', 'final_loss']})"
  done
  NSYS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
  if [ -n "$NSYS" ]; then
    timeout 300 $E "$NSYS" profile --trace cuda --sample none --cpuctxsw none --force-overwrite true -o /tmp/moeprof \
      .devbuild/lora-train bench $MP --steps 3 --warmup 1 > "$OUT/moeprof-nsys.log" 2>&1
    echo "nsys exit $?"
    "$NSYS" stats --force-export true --report cuda_api_sum --report cuda_gpu_kern_sum --report cuda_gpu_mem_time_sum \
      --format csv --output "$OUT/moeprof" /tmp/moeprof.nsys-rep > /dev/null 2>&1
    ls "$OUT"/moeprof_* 2>/dev/null
    for f in "$OUT"/moeprof_*.csv; do echo "-- $f"; head -16 "$f" | cut -c1-220; done
  else
    echo "moeprof: no nsys on this machine"
  fi
fi

if [[ $what == *" tests "* ]]; then
  env LORA_TRAIN_ROOT=$PWD "CARGO_BIN_EXE_lora-train=$PWD/.devbuild/lora-train" timeout 420 $E .devbuild/it \
    ops:: golden:: invariants:: plan::cuda_ generate:: dropout:: qlora:: moe_nf4:: --skip plan::cuda_bench_single_runs_on_the_gpu_it_names \
    --test-threads 1 2>&1 | tee "$OUT/gpu-tests.log" \
    | grep -E "^test .*(FAILED|ok)$|test result|panicked" | grep -v " ok$" | head -40
  grep -c " ok$" "$OUT/gpu-tests.log" | sed 's/^/tests ok: /'
fi

if [[ $what == *" train7b "* ]]; then
  C=/tmp/llama2-7b
  python3 scripts/make_random_checkpoint.py $C llama2-7b --seq 2048 --rows 400 2>&1 | tail -1
  sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null && echo "page cache dropped" || echo "page cache NOT dropped"
  t0=$(date +%s%N); cat $C/*.safetensors > /dev/null; t1=$(date +%s%N)
  echo "read $(du -cb $C/*.safetensors | tail -1 | cut -f1) bytes of safetensors in $(( (t1 - t0) / 1000000 )) ms" | tee "$OUT/read.txt"
  sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null
  rm -rf /tmp/out-7b
  # SM clock and power through the runs below (does one run the GPU at lower clocks?)
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 250 \
    > "$OUT/train7b-clocks.csv" 2>/dev/null & SMI=$!
  mark() { echo "mark,$1,$(date +%s.%N)" >> "$OUT/train7b-marks.csv"; }
  mark train
  t0=$(date +%s%N)
  timeout 240 $E .devbuild/lora-train --recipe scripts/device/random-checkpoint.toml 2>&1 | tail -4
  t1=$(date +%s%N); echo "train command wall $(( (t1 - t0) / 1000000 )) ms"
  mark train-end
  cp /tmp/out-7b/metrics.jsonl "$OUT/train7b-metrics.jsonl"
  python3 - <<'PY' | tee "$OUT/train7b.txt"
import json
rows = [json.loads(l) for l in open("/tmp/out-7b/metrics.jsonl")]
print("load_s", rows[0].get("load_s"), "first step after", rows[0]["elapsed_s"], "s")
# Steps 7 .. the last but one. A row is stamped when its step's scalars are read, which is once
# the next step's forward and backward are queued, and queueing waits on the full launch queue:
# every row but the last is stamped about a step late, the last (nothing left to queue) at once,
# a few ms after the one before. A window ending at the last row counts a step's tokens with
# none of its time: 24 steps in the time of 23, +4.3% (BENCHMARKS (as)).
a, b = rows[5], rows[-2]
tps = (b["tokens"] - a["tokens"]) / (b["elapsed_s"] - a["elapsed_s"])
print(f"train steps {a['step']+1}-{b['step']}: {tps:.0f} tok/s; peak GiB", b.get("mem"))
PY
  mark bench
  timeout 150 $E .devbuild/lora-train bench --shape llama2-7b --seq 2048 --micro-batch 2 --rank 16 \
    --targets all --steps 20 --warmup 3 --json "$OUT/train7b.jsonl" | cut -c1-400
  # the same bench on the checkpoint train loaded (its weights, bench's rows and loop)
  mark bench-model
  timeout 150 $E .devbuild/lora-train bench --model $C --seq 2048 --micro-batch 2 --rank 16 \
    --targets all --steps 20 --warmup 3 --tag model --json "$OUT/train7b.jsonl" | cut -c1-400
  mark peft
  [[ " ${TRAIN7B_PEERS-plain liger} " == *" plain "* ]] && \
  timeout 200 python3 scripts/bench_peft.py --shape llama2-7b --seq 2048 --batch 2 --rank 16 \
    --targets all --steps 10 --warmup 3 --json "$OUT/train7b.jsonl" 2>&1 | tail -1
  if [[ " ${TRAIN7B_PEERS-plain liger} " == *" liger "* ]] && python3 -c "import liger_kernel" 2>/dev/null; then
    timeout 200 python3 scripts/bench_peft.py --shape llama2-7b --seq 2048 --batch 2 --rank 16 \
      --targets all --steps 10 --warmup 3 --liger --json "$OUT/train7b.jsonl" 2>&1 | tail -1
  fi
  mark end; kill $SMI 2>/dev/null
  python3 - "$OUT" <<'PY' | tee -a "$OUT/train7b.txt"
import csv, sys
out = sys.argv[1]
marks = [(r[1], float(r[2])) for r in csv.reader(open(f"{out}/train7b-marks.csv"))]
rows = []
for r in csv.reader(open(f"{out}/train7b-clocks.csv")):
    try:
        import datetime
        t = datetime.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
        rows.append((t, float(r[1].split()[0]), float(r[2].split()[0])))
    except (ValueError, IndexError):
        pass
for (name, a), (_, b) in zip(marks, marks[1:]):
    busy = [x for x in rows if a <= x[0] < b and x[2] > 200]
    if busy:
        n = len(busy)
        print(f"{name:12s} SM MHz {sum(x[1] for x in busy)/n:6.0f}  W {sum(x[2] for x in busy)/n:5.0f}  (samples over 200 W: {n})")
PY
fi

if [[ $what == *" decode "* ]]; then
  for r in 0 16; do
    for g in "" decode_graph; do
      LORA_TRAIN_EXPERIMENTS=$g timeout 120 $E .devbuild/lora-train generate --bench --shape llama2-7b \
        --device cuda --prompt-len 128 --max-new-tokens 256 --rank $r --json "$OUT/decode.jsonl" 2>&1 \
        | tail -4 | cut -c1-600; echo "  (rank $r, experiments '$g', exit $?)"
    done
  done
  timeout 200 python3 scripts/bench_generate_hf.py --shape llama2-7b --prompt-len 128 --new-tokens 256 \
    --json "$OUT/decode.jsonl" 2>&1 | tail -1 | cut -c1-300
fi

if [[ $what == *" dropout "* ]]; then
  C=/tmp/llama2-7b
  [ -f $C/data.jsonl ] || python3 scripts/make_random_checkpoint.py $C llama2-7b --seq 2048 --rows 400 2>&1 | tail -1
  for p in 0.0 0.05; do
    rm -rf /tmp/out-7b-$p
    timeout 240 $E .devbuild/lora-train --recipe scripts/device/random-checkpoint.toml \
      --set lora.dropout=$p --set output.dir=/tmp/out-7b-$p 2>&1 | tail -2
  done
  python3 - <<'PY' | tee "$OUT/dropout.txt"
import json
tps = {}
for p in ["0.0", "0.05"]:
    rows = [json.loads(l) for l in open(f"/tmp/out-7b-{p}/metrics.jsonl")]
    a, b = rows[5], rows[-2]  # steps 7 .. last but one (see train7b)
    tps[p] = (b["tokens"] - a["tokens"]) / (b["elapsed_s"] - a["elapsed_s"])
    print(f"train, lora.dropout = {p}: {tps[p]:.0f} tok/s (steps {a['step']+1}-{b['step']}), first step after {rows[0]['elapsed_s']} s, peak GiB {b.get('mem')}")
print(f"dropout 0.05 / 0.0: {tps['0.05'] / tps['0.0']:.3f} (acceptance: >= 0.95)")
PY
  for extra in "" "--liger"; do
    [ -n "$extra" ] && { [ "${DROPOUT_LIGER:-1}" = 0 ] || ! python3 -c "import liger_kernel" 2>/dev/null; } && continue
    timeout 200 python3 scripts/bench_peft.py --shape llama2-7b --seq 2048 --batch 2 --rank 16 \
      --targets all --steps 10 --warmup 3 --dropout 0.05 $extra --json "$OUT/dropout.jsonl" 2>&1 | tail -1
  done
  python3 - "$OUT" <<'PY' | tee -a "$OUT/dropout.txt"
import json, sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"/tmp/out-7b-0.05/metrics.jsonl")]
a, b = rows[5], rows[-2]
ours = (b["tokens"] - a["tokens"]) / (b["elapsed_s"] - a["elapsed_s"])
for l in open(f"{out}/dropout.jsonl"):
    d = json.loads(l)
    print(f"train dropout 0.05 / {d['system']} lora_dropout 0.05: {ours:.0f} / {d.get('tokens_per_s')} ="
          f" {ours / d['tokens_per_s']:.2f}x (acceptance vs PEFT: >= 2.0)" if d.get("tokens_per_s") else d)
PY
fi

if [[ $what == *" sweep "* ]]; then
  OUT=$OUT bash scripts/sweep.sh 2>&1 | tail -40
fi

if [[ $what == *" tiny "* ]]; then
  for run in "cpu f32" "cuda f32" "cuda bf16"; do
    set -- $run
    timeout 120 $E .devbuild/lora-train --recipe recipes/tiny-cpu.toml --set model.device=$1 \
      --set model.dtype=$2 --set output.dir=/tmp/tiny-$1-$2 2>&1 | tail -2
    tail -1 /tmp/tiny-$1-$2/metrics.jsonl | sed "s/^/$1 $2: /" | tee -a "$OUT/tiny.txt"
    # The last checkpoint's adapter (staged to pinned memory behind the step) is the exported one.
    d=/tmp/tiny-$1-$2; last=$(ls -d $d/checkpoint-* | sort -t- -k2 -n | tail -1)
    cmp -s $d/adapter_model.safetensors $last/adapter_model.safetensors \
      && echo "$1 $2: $last/adapter_model.safetensors = the exported adapter" \
      || echo "$1 $2: $last/adapter_model.safetensors DIFFERS from the exported adapter"
  done
fi

if [[ $what == *" ab "* ]]; then
  IFS=';' read -ra variants <<< "${AB:-default;--deterministic}"
  for round in $(seq "${ROUNDS:-2}"); do
    for e in "${variants[@]}"; do
      vars=(); flags=()
      for w in $e; do
        case $w in default) ;; *=*) vars+=("$w") ;; *) flags+=("$w") ;; esac
      done
      env "${vars[@]}" timeout 120 $E .devbuild/lora-train bench --shape llama2-7b --seq 2048 --rank 16 \
        --steps 12 --warmup 3 --micro-batch 2 --targets all "${flags[@]}" --json "$OUT/ab.jsonl" > /dev/null 2>&1
      tail -1 "$OUT/ab.jsonl" | python3 -c "import json, sys; d = json.load(sys.stdin); \
print('round $round, $e:', d['tokens_per_s'], 'tok/s,', d['peak_alloc_gib'], 'GiB, loss', d['final_loss'])"
    done
  done
fi

# peercopy (2 GPUs): the parallel::nccl GPU test under eager kernel loading (its peer copies) and
# plan::cuda_bench_single_runs_on_the_gpu_it_names (both need 2 GPUs), then
# FSDP with LORA_TRAIN_EXPERIMENTS=peer_copy, after a DDP run and again, RUNS times (default 6),
# each run's exit status (124: hung, killed by timeout), JSON line count and speed: the check of
# the lazy-loading deadlock that peer copies can meet (lora-train sets CUDA_MODULE_LOADING=EAGER
# itself when the experiment is named).
if [[ $what == *" peercopy "* ]]; then
  CUDA_MODULE_LOADING=EAGER LORA_TRAIN_ROOT=$PWD "CARGO_BIN_EXE_lora-train=$PWD/.devbuild/lora-train" timeout 180 $E .devbuild/it \
    parallel::nccl plan::cuda_bench_single_runs_on_the_gpu_it_names --test-threads 1 2>&1 \
    | grep -E "^test |test result|panicked|rank" | head -10
  P="--shape llama2-7b --seq 2048 --rank 16 --targets all --steps 6 --warmup 2 --micro-batch 2 --devices 0,1"
  for i in $(seq "${RUNS:-6}"); do
    [ $((i % 2)) = 1 ] && timeout 100 $E .devbuild/lora-train bench $P --strategy ddp > /dev/null 2>&1
    LORA_TRAIN_EXPERIMENTS=peer_copy timeout 100 $E .devbuild/lora-train bench $P --strategy fsdp \
      --json "$OUT/peercopy.jsonl" > "$OUT/peercopy-$i.log" 2>&1
    echo "fsdp with peer copies, run $i: exit $?, $(wc -l < "$OUT/peercopy.jsonl") JSON lines," \
      "log $(wc -c < "$OUT/peercopy-$i.log") bytes, $(tail -1 "$OUT/peercopy.jsonl" | \
      python3 -c 'import json, sys; d = json.load(sys.stdin); print(d["tokens_per_s_per_gpu"], "tok/s/GPU, gathers:", d["fsdp_gathers"])')"
  done
fi

if [[ $what == *" families "* ]]; then
  : > "$OUT/families_compat.log"
  for case in ${FAMILY_CASES:-qwen3_qk_norm gemma2_softcap gemma3_local_global phi3_fused_longrope llama32_tied_long qwen3_moe}; do
    fx=$PWD/tests/fixtures/golden/$case; d=/tmp/fam/$case
    rm -rf $d && mkdir -p $d
    # The Rust golden test's recipe (tests/it/common.rs golden_recipe) on CUDA, with an eval set.
    python3 - "$fx" "$d" > $d/recipe.toml <<'PY'
import json, sys
fx, d = sys.argv[1:]
m = json.load(open(f"{fx}/meta.json")); o = m["opt"]
print(f"""[model]
path = "{fx}/{m['model_dir']}"
device = "cuda"
dtype = "f32"
[lora]
init_adapter = "{fx}/init_adapter"
[data]
train = "{fx}/train.jsonl"
eval = "{fx}/train.jsonl"
format = "tokens"
seq_len = 64
shuffle = false
[train]
micro_batch = {o['micro_batch']}
max_steps = {o['steps']}
lr = {o['lr']}
betas = [{o['betas'][0]}, {o['betas'][1]}]
eps = {o['eps']}
weight_decay = {o['weight_decay']}
max_grad_norm = {o['max_grad_norm']}
schedule = "{o['schedule']}"
warmup_steps = {o['warmup_steps']}
[output]
dir = "{d}/out"
""")
PY
    {
      echo "==== $case"
      timeout 120 $E .devbuild/lora-train --recipe $d/recipe.toml 2>&1 | tail -2
      timeout 60 $E .devbuild/lora-train export --adapter $d/out --base $fx/model --out $d/merged 2>&1 | tail -1
      prompt=$(head -1 $fx/train.jsonl | python3 -c 'import json, sys; print(",".join(map(str, json.load(sys.stdin)["input_ids"][:6])))')
      timeout 60 $E .devbuild/lora-train generate --model $fx/model --adapter $d/out --prompt-ids $prompt \
        --max-new-tokens 8 --ignore-eos --device cuda --dtype f32 > $d/generated.txt 2> $d/generate.err \
        || { echo "generate failed (exit $?):"; tail -3 $d/generate.err; }
      args=(--fixture $fx --adapter $d/out --metrics $d/out/metrics.jsonl)
      [ -s $d/generated.txt ] && args+=(--generated $d/generated.txt --prompt-len 6)
      [ -f $d/merged/config.json ] && args+=(--merged $d/merged)
      timeout 120 python3 scripts/check_family_compat.py "${args[@]}" 2>&1 | grep -vi "warn\|loading weights"
      echo "check exit ${PIPESTATUS[0]}"
    } 2>&1 | tee -a "$OUT/families_compat.log" | grep -E "^====|^FAIL|passed|FAILED|failed|exit [1-9]"
  done
fi

# energy: see the header. Each side's timed steps under scripts/energy.py, which reads the GPU's
# energy counter within the window the bench reports (timed_unix_s).
if [[ $what == *" energy "* ]]; then
  B="${ENERGY_SHAPE:---shape llama2-7b --seq 2048} --rank 16 --targets all --warmup 3"
  echo "== lora-train bench ${ENERGY_OURS:-}"
  timeout 240 python3 scripts/energy.py --tag ours --json "$OUT/energy.jsonl" --runs "$OUT/energy-runs.jsonl" -- \
    $E .devbuild/lora-train bench $B --steps 20 --micro-batch 2 ${ENERGY_OURS:-} \
    --json "$OUT/energy-runs.jsonl" 2>&1 | tail -1 | cut -c1-400
  for peer in ${ENERGY_PEERS:-plain liger}; do
    case $peer in plain) extra= ;; liger) extra=--liger ;; *) continue ;; esac
    [ -n "$extra" ] && ! python3 -c "import liger_kernel" 2>/dev/null && continue
    echo "== bench_peft.py ${ENERGY_PEER:-} $extra"
    timeout 300 python3 scripts/energy.py --tag "peft${extra:+ liger}" --json "$OUT/energy.jsonl" \
      --runs "$OUT/energy-runs.jsonl" -- python3 scripts/bench_peft.py $B --steps 10 --batch 2 \
      ${ENERGY_PEER:-} $extra --json "$OUT/energy-runs.jsonl" 2>&1 | tail -1 | cut -c1-400
  done
  [ -s "$OUT/energy.jsonl" ] && python3 - "$OUT/energy.jsonl" <<'PY' | tee "$OUT/energy.txt"
import json, sys
e = {r["tag"]: r for r in map(json.loads, open(sys.argv[1]))}
for r in e.values():
    print(f"{r['tag']:10s} {r['tokens_per_s']:9.1f} tok/s  {r['step_j']:7.1f} J a step  "
          f"{r['step_ms']:6.1f} ms  {r['mean_w']:5.0f} W  {r['tokens_per_kj']:6d} tokens/kJ")
for peer in ("peft", "peft liger"):
    if "ours" in e and peer in e:
        o, p = e["ours"], e[peer]
        print(f"ours / {peer}: tok/s {o['tokens_per_s'] / p['tokens_per_s']:.3f}, "
              f"tokens/kJ {o['tokens_per_kj'] / p['tokens_per_kj']:.3f}")
PY
fi

# floor: see the header. The frozen GEMMs' joules are the same for every trainer; what a step
# spends above them is its other passes' (and 2.0x the peer is a step of half the peer's joules).
if [[ $what == *" floor "* ]]; then
  timeout 300 python3 scripts/energy_floor.py --shape ${FLOOR_SHAPE:-llama2-7b} --seq 2048 --batch 2 \
    --json "$OUT/floor.jsonl" 2>&1 | tail -6 | cut -c1-400
  [ -s "$OUT/floor.jsonl" ] && [ -s "$OUT/energy.jsonl" ] && python3 - "$OUT" <<'PY' | tee "$OUT/floor.txt"
import json, sys
out = sys.argv[1]
parts = {r["part"]: r for r in map(json.loads, open(f"{out}/floor.jsonl"))}
runs = {r["tag"]: r for r in map(json.loads, open(f"{out}/energy.jsonl"))}
g = parts.get("gemms")
if g:
    print(f"frozen GEMMs alone: {g['step_j']:.1f} J, {g['step_ms']:.1f} ms, {g['mean_w']:.0f} W, "
          f"{g['tflops']:.0f} TFLOP/s, {g['pj_per_flop']:.3f} pJ a FLOP")
    for tag, r in runs.items():
        print(f"{tag:10s} {r['step_j']:7.1f} J a step: frozen GEMMs {g['step_j']:.1f}, "
              f"the rest {r['step_j'] - g['step_j']:.1f} J")
    for peer in ("peft", "peft liger"):
        if "ours" in runs and peer in runs:
            half = runs[peer]["step_j"] / 2
            print(f"2.0x {peer}'s tokens/J: a step of <= {half:.1f} J, the rest <= "
                  f"{half - g['step_j']:.1f} J (ours {runs['ours']['step_j'] - g['step_j']:.1f})")
for name in ("attention", "memory", "idle"):
    if name in parts:
        print(name, {k: v for k, v in parts[name].items() if k not in ("shape", "seq", "batch", "gpu")})
PY
fi

# ckpt8b: #24's checkpointed point, Llama-3-8B shape, seq 4096, mb2, r16 all linear: ours with
# the MLP half checkpointed (--ckpt mlp: gate and up parked; with --offload false recomputed),
# the whole layer (--ckpt) and nothing, beside scripts/bench_peft.py --ckpt and --ckpt --liger
# -> $OUT/ckpt8b.jsonl.
if [[ $what == *" ckpt8b "* ]]; then
  B="--shape llama3-8b --seq 4096 --rank 16 --targets all --steps ${STEPS:-10} --warmup 3"
  for ck in "--ckpt mlp" "--ckpt mlp --offload false" "--ckpt" ""; do
    echo "== lora-train $ck"
    timeout 200 $E .devbuild/lora-train bench $B --micro-batch 2 $ck --json "$OUT/ckpt8b.jsonl" 2>&1 \
      | tail -1 | cut -c1-400
  done
  for extra in "" "--liger"; do
    [ -n "$extra" ] && ! python3 -c "import liger_kernel" 2>/dev/null && continue
    echo "== bench_peft.py --ckpt $extra"
    timeout 240 python3 scripts/bench_peft.py $B --batch 2 --ckpt $extra --json "$OUT/ckpt8b.jsonl" 2>&1 \
      | tail -1 | cut -c1-400
  done
  python3 - "$OUT/ckpt8b.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
peers = {r["system"]: r for r in rows if r.get("system", "").startswith("transformers")}
for r in rows:
    if r.get("system", "").startswith("transformers"):
        continue
    line = f"ours ckpt={r.get('ckpt')} offload={r.get('offload')}: {r['tokens_per_s']:.0f} tok/s, {r.get('peak_alloc_gib')} GiB, loss {r.get('final_loss')}"
    for name, p in peers.items():
        line += f"; / {name} {p['tokens_per_s']:.0f} ({p.get('peak_alloc_gib')} GiB) = {r['tokens_per_s'] / p['tokens_per_s']:.3f}x"
    print(line)
PY
fi

# famb: the family shapes, ours beside PEFT (seq 2048, mb2, r16 all linear, the bench section's
# flags); a failure or a 240 s timeout of one run does not stop the others.
if [[ $what == *" famb "* ]]; then
  ck=""; [ "${FAMB_CKPT:-0}" = 1 ] && ck="--ckpt"
  mb=${FAMB_MB:-2}
  for shape in ${FAMB_SHAPES:-qwen3-8b gemma2-9b gemma3-12b phi3-mini}; do
    B="--shape $shape --seq 2048 --rank 16 --steps 10 --warmup 3 --targets all $ck"
    if [ "${FAMB_DEFAULT:-1}" = 1 ]; then
      echo "== lora-train $shape mb$mb $ck"
      timeout 240 $E .devbuild/lora-train bench $B --micro-batch $mb --json "$OUT/famb.jsonl" 2>&1 | tail -2 | cut -c1-600
      echo "   (exit ${PIPESTATUS[0]})"
    fi
    if [ -n "${FAMB_EXP:-}" ]; then
      echo "== lora-train $shape mb$mb $ck LORA_TRAIN_EXPERIMENTS=$FAMB_EXP"
      LORA_TRAIN_EXPERIMENTS=$FAMB_EXP timeout 240 $E .devbuild/lora-train bench $B --micro-batch $mb \
        --tag "$FAMB_EXP" --json "$OUT/famb.jsonl" 2>&1 | tail -2 | cut -c1-600
      echo "   (exit ${PIPESTATUS[0]})"
    fi
    echo "== peft $shape mb$mb $ck"
    timeout 240 python3 scripts/bench_peft.py $B --batch $mb --json "$OUT/famb.jsonl" 2>&1 | tail -2 | cut -c1-600
    echo "   (exit ${PIPESTATUS[0]})"
  done
fi

# BENCH: ";"-separated configs "micro-batch targets [ckpt]"; a trailing "-" skips PEFT for it.
if [[ $what == *" qlora "* ]]; then
  whl=$(ls .devbuild/bitsandbytes-*.whl 2>/dev/null | head -1)
  if ! python3 -c "import bitsandbytes" 2>/dev/null && [ -n "$whl" ]; then
    pip install --no-deps --no-index --target /tmp/bnb "$whl" >/dev/null 2>&1
    export PYTHONPATH=/tmp/bnb:${PYTHONPATH:-}
  fi
  python3 -c "import bitsandbytes as b; print('bitsandbytes', b.__version__)"
  Q="--seq 2048 --rank 16 --targets all --steps 10 --warmup 3"
  echo "== lora-train qlora 7b mb2"
  timeout 150 $E .devbuild/lora-train bench --shape llama2-7b $Q --micro-batch 2 --quantize nf4 \
    --tag qlora-7b-mb2 --json "$OUT/qlora.jsonl" 2>&1 | tail -3
  echo "== peft+bnb qlora 7b mb2"
  timeout 240 python3 scripts/bench_peft.py --shape llama2-7b $Q --batch 2 --load-in-4bit \
    --tag qlora-7b-mb2 --json "$OUT/qlora.jsonl" 2>&1 | tail -3
  for ck in "" "--ckpt"; do
    .devbuild/lora-train plan --shape llama2-7b --nf4 --gpu-mem 24GiB $ck --json \
      > "$OUT/qlora-plan$ck.json" 2>&1
  done
  read -r mb ck <<< "$(python3 - "$OUT" <<'PY'
import json, sys
for ck in ["", "--ckpt"]:
    p = json.load(open(f"{sys.argv[1]}/qlora-plan{ck}.json"))
    row = p.get("selected") or {}
    m = row.get("max_micro_batch")
    if m:
        print(m, ck or "-"); break
else:
    print(1, "--ckpt")
PY
)"
  [ "$ck" = "-" ] && ck=""
  echo "== lora-train qlora 70b mb1 ckpt"
  timeout 240 $E .devbuild/lora-train bench --shape llama2-70b --seq 2048 --rank 16 --targets all \
    --steps 3 --warmup 1 --micro-batch 1 --ckpt --quantize nf4 --tag qlora-70b-mb1-ckpt \
    --json "$OUT/qlora.jsonl" 2>&1 | tail -3
  echo "== lora-train qlora 7b under 24GiB at the plan's mb $mb $ck"
  timeout 150 $E .devbuild/lora-train bench --shape llama2-7b $Q --micro-batch "$mb" $ck --quantize nf4 \
    --max-memory 24GiB --tag "qlora-7b-24gib-mb$mb$ck" --json "$OUT/qlora.jsonl" 2>&1 | tail -3
fi

# unsloth: see the header. Ours first, every row (about a minute each), then Unsloth's rows, each
# after its checkpoint is made (nothing else on the GPU meanwhile), within UNSLOTH_BUDGET seconds
# of the mode's start (default 450) so that the call ends inside its 10 minutes whatever Unsloth
# does; bench_unsloth.py exits 3 when `import unsloth` fails, and later rows skip it.
# Unsloth and bitsandbytes from .devbuild into $U (unsloth and ulong); uok=0 when they are not
U=/tmp/unsloth-site
unsloth_site() {
  uok=1
  local bwhl; bwhl=$(ls .devbuild/bitsandbytes-*.whl 2>/dev/null | head -1)
  if ls .devbuild/unsloth/*.whl > /dev/null 2>&1; then
    python3 -m pip install --no-deps --no-index --target $U .devbuild/unsloth/*.whl $bwhl \
      > "$OUT/unsloth-install.log" 2>&1 || { echo "unsloth wheels: install failed"; tail -5 "$OUT/unsloth-install.log"; uok=0; }
  else
    echo "unsloth: no wheels in .devbuild/unsloth (scripts/fetch-wheels.sh unsloth)"; uok=0
  fi
}

if [[ $what == *" unsloth "* ]]; then
  deadline=$(( $(date +%s) + ${UNSLOTH_BUDGET:-450} ))
  unsloth_site
  P="--seq 2048 --rank 16 --targets all --steps 10 --warmup 3"
  # row -> shape, ours' flags, the peers' flags (bench_peft.py and bench_unsloth.py take the same)
  urow() {
    case $1 in
      7b) echo "llama2-7b|--micro-batch 2|--batch 2" ;;
      7b-ckpt) echo "llama2-7b|--micro-batch 2 --ckpt|--batch 2 --ckpt" ;;
      8b-nf4) echo "llama3-8b|--micro-batch 2 --quantize nf4|--batch 2 --load-in-4bit" ;;
      qwen3-8b) echo "qwen3-8b|--micro-batch 2|--batch 2" ;;
      gemma2-9b) echo "gemma2-9b|--micro-batch 1|--batch 1" ;;
      phi3-mini) echo "phi3-mini|--micro-batch 2|--batch 2" ;;
      moe) echo "qwen3-30b-a3b|--micro-batch 2 --ckpt|--batch 2 --ckpt" ;;
    esac
  }
  rows=""
  for row in ${UNSLOTH_ROWS:-7b 8b-nf4}; do
    [ -n "$(urow $row)" ] && rows="$rows $row" || echo "unsloth: unknown row $row"
  done
  for row in $rows; do
    IFS='|' read -r shape ours theirs <<< "$(urow $row)"
    echo "== $row: lora-train bench --shape $shape $P $ours"
    timeout 150 $E .devbuild/lora-train bench --shape $shape $P $ours --tag "$row" \
      --json "$OUT/unsloth.jsonl" 2>&1 | tail -2 | cut -c1-400
    # PEFT and PEFT + Liger (UNSLOTH_PEERS: "plain liger", one, or none), with bitsandbytes from
    # the Unsloth site for --load-in-4bit
    for peer in ${UNSLOTH_PEERS-plain liger}; do
      lf=""; [ $peer = liger ] && lf=--liger
      [ $peer = liger ] && ! python3 -c "import liger_kernel" 2>/dev/null && { echo "no liger_kernel"; continue; }
      left=$(( deadline - $(date +%s) )); [ $left -gt 200 ] && left=200
      [ $left -lt 40 ] && { echo "unsloth: out of budget before PEFT $peer $row"; break; }
      echo "== $row: bench_peft.py --shape $shape $P $theirs $lf (at most $left s)"
      PYTHONPATH=$U:${PYTHONPATH:-} timeout $left python3 scripts/bench_peft.py --shape $shape $P $theirs $lf \
        --tag "$row" --json "$OUT/unsloth.jsonl" 2>&1 | tail -1 | cut -c1-400
    done
  done
  for row in $rows; do
    [ $uok = 1 ] || break
    IFS='|' read -r shape ours theirs <<< "$(urow $row)"
    t0=$(date +%s)
    C=/tmp/unsloth-ckpt/$shape
    if [ ! -f $C/tokenizer_config.json ]; then
      rm -rf /tmp/unsloth-ckpt  # one checkpoint at a time on the 64 GiB disk
      left=$(( deadline - $(date +%s) )); [ $left -gt 150 ] && left=150
      [ $left -lt 30 ] && { echo "unsloth: out of budget before $row"; break; }
      timeout $left python3 scripts/make_random_checkpoint.py $C $shape --seq 2048 --rows 0 --tokenizer \
        2>&1 | tail -1
      [ -f $C/tokenizer_config.json ] || { echo "unsloth: no checkpoint at $C, $row skipped"; continue; }
    fi
    left=$(( deadline - $(date +%s) )); [ $left -gt 300 ] && left=300
    [ $left -lt 30 ] && { echo "unsloth: out of budget before $row"; break; }
    echo "== $row: bench_unsloth.py --shape $shape $P $theirs (at most $left s)"
    PYTHONPATH=$U:${PYTHONPATH:-} timeout $left python3 scripts/bench_unsloth.py --shape $shape --model $C \
      $P $theirs --tag "$row" --json "$OUT/unsloth.jsonl" > "$OUT/unsloth-$row.log" 2>&1
    rc=$?
    if [ $rc = 0 ]; then
      grep -i "unsloth" "$OUT/unsloth-$row.log" | grep -v "^{" | head -6 | cut -c1-200
      tail -1 "$OUT/unsloth-$row.log" | cut -c1-400
    else
      echo "bench_unsloth.py exit $rc; its log's tail:"; tail -15 "$OUT/unsloth-$row.log" | cut -c1-300
      [ $rc = 3 ] && uok=0
    fi
    echo "   (Unsloth $row: $(( $(date +%s) - t0 )) s with its checkpoint)"
  done
  rm -rf /tmp/unsloth-ckpt
  [ -s "$OUT/unsloth.jsonl" ] && python3 - "$OUT/unsloth.jsonl" <<'PY' | tee "$OUT/unsloth.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for tag in dict.fromkeys(r.get("tag") for r in rows):
    o = next((r for r in rows if r.get("tag") == tag and r.get("system") == "lora-train"), None)
    u = next((r for r in rows if r.get("tag") == tag and str(r.get("system", "")).startswith("unsloth")), None)
    peers = [r for r in rows if r.get("tag") == tag and r not in (o, u)]
    f = lambda r, k: r.get(k) if r else None
    line = (f"{tag:8s} ours {f(o, 'tokens_per_s')} tok/s, peak {f(o, 'peak_alloc_gib')} GiB"
            f" ({f(o, 'peak_reserved_gib')} reserved) | Unsloth {f(u, 'tokens_per_s')} tok/s, peak"
            f" {f(u, 'peak_alloc_gib')} GiB ({f(u, 'peak_reserved_gib')} reserved)")
    if o and u and o.get("tokens_per_s") and u.get("tokens_per_s"):
        line += f" | ours/Unsloth tok/s {o['tokens_per_s'] / u['tokens_per_s']:.3f}"
        if o.get("peak_alloc_gib") and u.get("peak_alloc_gib"):
            line += f", peak {o['peak_alloc_gib'] / u['peak_alloc_gib']:.3f}"
    if u:
        line += f" [unsloth {u.get('unsloth')}, attention {u.get('attn_backend')}, loss {u.get('final_loss')}]"
    for r in peers:
        line += f" | {r.get('system')} {r.get('tokens_per_s')} tok/s, peak {r.get('peak_alloc_gib')} GiB"
        if o and o.get("tokens_per_s") and r.get("tokens_per_s"):
            line += f" (ours {o['tokens_per_s'] / r['tokens_per_s']:.3f}x)"
    print(line)
PY
fi

# longctx: Llama-3-8B shape, micro-batch 1, checkpointed, bf16, under an 80 GiB cap: ours at
#         LONG_T (default "32768 131072 262144") tokens, one step each after WARMUP (default 0)
#         warmup steps, and transformers + PEFT (gradient checkpointing, sdpa) at PEFT_T (default
#         "16384 32768 65536") under the same cap (set_per_process_memory_fraction)
#         -> $OUT/longctx.jsonl. LONG_EXTRA adds bench flags (e.g. "--quantize nf4"),
#         PEFT_EXTRA the peer's (e.g. "--load-in-4bit"). Not in the default set.
# ulong: see the header. Each T: ours, then Unsloth, one step each (no warm-up), so that a row
# is a peak at one length; the summary fits each system's peaks to a + b·T and gives the T at
# which the line meets the cap (ULONG_CAP GiB, default 80): the longest context its memory
# allows, where the one-step runs cannot reach it in a call.
if [[ $what == *" ulong "* ]]; then
  deadline=$(( $(date +%s) + ${ULONG_BUDGET:-540} ))
  unsloth_site
  C=/tmp/unsloth-ckpt/llama3-8b
  if [ $uok = 1 ] && [ ! -f $C/tokenizer_config.json ]; then
    timeout 150 python3 scripts/make_random_checkpoint.py $C llama3-8b --seq 2048 --rows 0 --tokenizer 2>&1 | tail -1
  fi
  cap=${ULONG_CAP:-80}
  for q in ${ULONG_Q:-nf4}; do
    of=""; tf=""; [ $q = nf4 ] && of="--quantize nf4" && tf="--load-in-4bit"
    for t in ${ULONG_T:-65536 131072}; do
      left=$(( deadline - $(date +%s) )); [ $left -gt 240 ] && left=240
      [ $left -lt 30 ] && { echo "ulong: out of budget before ours $q T=$t"; break; }
      echo "== lora-train llama3-8b $q T=$t (at most $left s)"
      timeout $left $E .devbuild/lora-train bench --shape llama3-8b --micro-batch 1 --rank 16 --targets all \
        --ckpt --max-memory ${cap}GiB --seq $t --steps 1 --warmup 0 $of --tag "ulong-$q-$t" \
        --json "$OUT/ulong.jsonl" 2>&1 | tail -1 | cut -c1-300
      [ $uok = 1 ] || continue
      left=$(( deadline - $(date +%s) )); [ $left -gt 300 ] && left=300
      [ $left -lt 30 ] && { echo "ulong: out of budget before Unsloth $q T=$t"; break; }
      echo "== unsloth llama3-8b $q T=$t (at most $left s)"
      PYTHONPATH=$U:${PYTHONPATH:-} timeout $left python3 scripts/bench_unsloth.py --shape llama3-8b --model $C \
        --seq $t --batch 1 --rank 16 --targets all --ckpt --max-memory ${cap}GiB --steps 1 --warmup 0 $tf \
        --tag "ulong-$q-$t" --json "$OUT/ulong.jsonl" > "$OUT/ulong-$q-$t.log" 2>&1
      rc=$?; echo "   (exit $rc)"; [ $rc = 0 ] || tail -4 "$OUT/ulong-$q-$t.log" | cut -c1-300
      [ $rc = 3 ] && uok=0
    done
  done
  rm -rf /tmp/unsloth-ckpt
  [ -s "$OUT/ulong.jsonl" ] && python3 - "$OUT/ulong.jsonl" "$cap" <<'PY' | tee "$OUT/ulong.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
cap = float(sys.argv[2])
groups = {}
for r in rows:
    if r.get("peak_alloc_gib"):
        q = r["tag"].split("-")[1]
        sysname = "ours" if r.get("system") == "lora-train" else "unsloth"
        groups.setdefault((q, sysname), []).append((r["seq"], r["peak_alloc_gib"], r.get("step_s")))
for (q, name), pts in sorted(groups.items()):
    pts.sort()
    line = f"{q} {name}: " + ", ".join(f"T={t}: {g} GiB, {s} s" for t, g, s in pts)
    if len(pts) >= 2:
        (t0, g0, _), (t1, g1, _) = pts[0], pts[-1]
        b = (g1 - g0) / (t1 - t0)
        line += f" | {b * 1024 * 1024:.2f} GiB per 1M tokens, at {cap:.0f} GiB: T = {(cap - g0) / b + t0:,.0f}"
    print(line)
PY
fi

if [[ $what == *" longctx "* ]]; then
  L="--shape llama3-8b --micro-batch 1 --rank 16 --targets all --ckpt --max-memory 80GiB"
  for t in ${LONG_T-32768 131072 262144}; do
    echo "== lora-train long context T=$t"
    timeout 560 $E .devbuild/lora-train bench $L ${LONG_EXTRA:-} --seq "$t" --steps 1 \
      --warmup "${WARMUP:-0}" --tag "long-$t${LONG_EXTRA:+ $LONG_EXTRA}" \
      --json "$OUT/longctx.jsonl" 2>&1 | tail -4
  done
  for t in ${PEFT_T-16384 32768 65536}; do
    echo "== transformers + PEFT long context T=$t"
    timeout 300 python3 scripts/bench_peft.py --shape llama3-8b --seq "$t" --batch 1 --rank 16 \
      --targets all --ckpt --max-memory 80GiB --steps 1 --warmup 1 ${PEFT_EXTRA:-} \
      --tag "peft-long-$t${PEFT_EXTRA:+ $PEFT_EXTRA}" \
      --json "$OUT/longctx.jsonl" 2>&1 | tail -3
  done
fi

if [[ $what == *" bench "* ]]; then
  B="--shape llama2-7b --seq 2048 --rank 16 --steps 10 --warmup 3"
  IFS=';' read -ra cfgs <<< "${BENCH:-2 all;2 qv;8 all ckpt}"
  for cfg in "${cfgs[@]}"; do
    set -- $cfg
    ck=""; [[ " $* " == *" ckpt "* ]] && ck="--ckpt"
    echo "== lora-train micro-batch $1 targets $2 $ck"
    timeout 150 $E .devbuild/lora-train bench $B --micro-batch $1 --targets $2 $ck --json "$OUT/bench.jsonl" 2>&1 | tail -2
    [[ " $* " == *" - "* ]] && continue
    echo "== peft micro-batch $1 targets $2 $ck"
    timeout 150 python3 scripts/bench_peft.py $B --batch $1 --targets $2 $ck --json "$OUT/bench.jsonl" 2>&1 | tail -2
  done
fi

if [[ $what == *" dist "* ]]; then
  for strategy in ddp fsdp; do
    rm -rf /tmp/tiny-$strategy
    timeout 120 $E .devbuild/lora-train --recipe recipes/tiny-cpu.toml --set model.device=cuda \
      --set model.dtype=f32 --set parallel.strategy=$strategy --set "parallel.devices=[0, 1]" \
      --set output.dir=/tmp/tiny-$strategy 2>&1 | tail -3
    python3 - "$strategy" <<'PY' | tee -a "$OUT/dist-tiny.txt"
import json, sys
from safetensors import safe_open
s = sys.argv[1]
last = open(f"/tmp/tiny-{s}/metrics.jsonl").read().splitlines()[-1]
with safe_open(f"/tmp/tiny-{s}/adapter_model.safetensors", "pt") as f:
    keys = list(f.keys())
print(s, "adapter tensors:", len(keys), "last:", last)
PY
  done
fi

# The 7B-shape runs, "strategy:micro-batch:accum:[ckpt]:[ahead]" each ("ahead": the gradient
# sums on the second stream, LORA_TRAIN_EXPERIMENTS=reduce_ahead). About 45 s each.
dist_cfgs=""
[[ $what == *" dist "* ]] && dist_cfgs="single:4:1 single:2:1 ddp:2:1 ddp:2:1::ahead fsdp:2:1 fsdp:2:1::ahead fsdp:2:1:ckpt"
[[ $what == *" dist2 "* ]] && dist_cfgs="$dist_cfgs single:2:2 single:4:1:ckpt ddp:2:1:ckpt"
if [ -n "$dist_cfgs" ]; then
  B="--shape llama2-7b --seq 2048 --rank 16 --targets all --steps 10 --warmup 3 --json $OUT/dist.jsonl"
  for cfg in $dist_cfgs; do
    IFS=: read -r -a f <<< "$cfg"; set -- "${f[@]}"
    ck=""; [ "${4:-}" = ckpt ] && ck="--ckpt"
    ex=""; [ "${5:-}" = ahead ] && ex=reduce_ahead
    dev="--devices 0"; [ "$1" != single ] && dev="--devices 0,1"
    echo "== lora-train $1 micro-batch $2 accum $3 $ck ${5:-}"
    LORA_TRAIN_EXPERIMENTS=$ex timeout 170 $E .devbuild/lora-train bench $B --strategy $1 $dev \
      --micro-batch $2 --grad-accum $3 $ck 2>&1 \
      | tail -1 | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print({k: d.get(k) for k in ["strategy","world","global_batch","tokens_per_s_per_gpu","peak_alloc_gib","mfu","losses"]}); print(d.get("per_rank"))' 2>&1
  done
fi

if [[ $what == *" torchrun "* ]]; then
  for mode in ddp fsdp; do
    echo "== peft torchrun 2 GPUs --mode $mode micro-batch 2"
    timeout 280 torchrun --nproc_per_node 2 scripts/bench_peft.py --shape llama2-7b --seq 2048 \
      --batch 2 --rank 16 --targets all --steps 10 --warmup 3 --mode $mode --json "$OUT/dist.jsonl" 2>&1 | tail -3
  done
fi

if [[ $what == *" memory "* ]]; then
  L=.devbuild/lora-train
  S="--shape llama2-7b --seq 2048"
  mkdir -p "$OUT/memory"
  for cfg in "2" "2 ckpt" "8 ckpt"; do
    set -- $cfg
    ck=""; name="mb$1"; [ "${2:-}" = ckpt ] && { ck="--ckpt"; name="$name-ckpt"; }
    echo "== plan + bench single $name"
    $E $L plan $S --micro-batch $1 $ck --json > "$OUT/memory/plan-$name.json"
    rm -f "$OUT/memory/bench-$name.json"
    timeout 150 $E $L bench $S --rank 16 --targets all --steps 3 --warmup 1 --micro-batch $1 $ck \
      --json "$OUT/memory/bench-$name.json" 2>&1 | tail -1
  done
  # DDP / FSDP on 2 GPUs, when this bench has --strategy (src/parallel) and the machine 2 GPUs.
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && $E $L bench --help 2>/dev/null | grep -q -- --strategy; then
    for st in ddp fsdp; do
      for cfg in "2" "2 ckpt"; do
        set -- $cfg
        ck=""; name="$st-mb$1"; [ "${2:-}" = ckpt ] && { ck="--ckpt"; name="$name-ckpt"; }
        echo "== plan + bench $name on 2 GPUs"
        $E $L plan $S --micro-batch $1 $ck --gpus 2 --json > "$OUT/memory/plan-$name.json"
        rm -f "$OUT/memory/bench-$name.json"
        timeout 200 $E $L bench $S --rank 16 --targets all --steps 3 --warmup 1 --micro-batch $1 $ck \
          --strategy $st --devices 0,1 --json "$OUT/memory/bench-$name.json" 2>&1 | tail -1
      done
    done
  fi
  # Forecast / measured, whole step and per phase. A bench line matches the plan row of its
  # mode (single / ddp / fsdp), world and ckpt, so ddp / fsdp bench lines compare the same way
  # (run plan with --gpus <world> for them).
  python3 - "$OUT/memory" <<'PY'
import json, sys, glob, os
d = sys.argv[1]
worst = 0.0
for bf in sorted(glob.glob(os.path.join(d, "bench-*.json"))):
    name = os.path.basename(bf)[6:-5]
    pf = os.path.join(d, f"plan-{name}.json")
    if not os.path.exists(pf):
        continue
    plan = json.load(open(pf))
    for line in open(bf):
        b = json.loads(line)
        row = next((r for r in plan["rows"] if r["strategy"] == b.get("mode", "single")
                    and r["ckpt"] == b["ckpt"] and r["world"] == b.get("world", 1)), None)
        if row is None or b.get("peak_alloc_gib") is None:
            print(f"{name}: no matching plan row / no measurement"); continue
        r = row["peak_alloc_gib"] / b["peak_alloc_gib"]
        worst = max(worst, abs(r - 1))
        ph = " ".join(f"{p} {row['phases'][p + '_peak_gib']:.2f}/{b.get('phases', {}).get(p + '_peak_gib', float('nan')):.2f}"
                      for p in ("forward", "head", "backward"))
        print(f"{name:12s} {b.get('mode','single')} x{b.get('world',1)}: forecast {row['peak_alloc_gib']:.2f} GiB"
              f" / measured {b['peak_alloc_gib']:.2f} GiB = {r:.3f}  [{ph}]")
print(f"worst |forecast/measured - 1| = {worst:.3f} ({'PASS' if worst <= 0.10 else 'FAIL'} at 10%)")
PY
  echo "== plan at 24 GiB per GPU, 2 GPUs (mb2)"
  $E $L plan $S --micro-batch 2 --gpus 2 --gpu-mem 24GiB | tee "$OUT/memory/plan-24gib.txt"
  echo "== OOM case: bench --max-memory 24GiB, mb2, no ckpt (expect exit 4 and the diagnosis)"
  timeout 150 $E $L bench $S --rank 16 --targets all --steps 2 --warmup 1 --micro-batch 2 \
    --max-memory 24GiB > "$OUT/memory/oom.out" 2> "$OUT/memory/oom.err"
  echo "exit code $? (expected 4)" | tee -a "$OUT/memory/oom.err"
  tail -12 "$OUT/memory/oom.err"
  echo "== fits at 24 GiB: bench --max-memory 24GiB, mb2 + ckpt (expect exit 0)"
  timeout 150 $E $L bench $S --rank 16 --targets all --steps 2 --warmup 1 --micro-batch 2 --ckpt \
    --max-memory 24GiB --json "$OUT/memory/bench-24gib-ckpt.json" 2>&1 | tail -1
  echo "exit code ${PIPESTATUS[0]}"
fi

# profile: ncu's kernel times of a few steps per shape, summed a step by scripts/kernel_table.py.
if [[ $what == *" profile "* ]]; then
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [ -z "$NCU" ]; then
    echo "profile: no ncu on this machine"
  else
    for shape in ${PROFILE_SHAPES:-gemma2-9b phi3-mini llama2-7b}; do
      echo "== profile $shape"
      timeout ${PROFILE_LIMIT:-420} $E "$NCU" --csv --clock-control none --metrics gpu__time_duration.sum \
        --launch-skip ${PROFILE_SKIP:-3000} --launch-count ${PROFILE_COUNT:-12000} \
        .devbuild/lora-train bench --shape $shape --seq ${PROFILE_SEQ:-2048} --rank 16 --targets all \
        --micro-batch 2 --steps 4 --warmup 1 ${PROFILE_EXTRA:-} > "$OUT/profile-$shape.csv" 2> "$OUT/profile-$shape.err"
      echo "exit code $?"; tail -2 "$OUT/profile-$shape.err"
      python3 scripts/kernel_table.py "$OUT/profile-$shape.csv" --top 25 | tee "$OUT/profile-$shape.md" | head -20
    done
  fi
fi

if [[ $what == *" data "* ]]; then
  D=/tmp/ds-site
  dw=$(ls .devbuild/unsloth/{datasets,dill,multiprocess}-*.whl .devbuild/{datasets,dill,multiprocess}-*.whl 2>/dev/null)
  if [ -n "$dw" ] && ! python3 -c "import datasets" 2>/dev/null; then
    python3 -m pip install --no-deps --no-index --target $D $dw > "$OUT/data-install.log" 2>&1 \
      || tail -3 "$OUT/data-install.log"
  fi
  C=/tmp/llama2-7b
  [ -f $C/config.json ] || python3 scripts/make_random_checkpoint.py $C llama2-7b --seq 2048 --rows 0 2>&1 | tail -1
  [ -f $C/tokenizer.json ] || cp recipes/assets/tiny-llama/tokenizer.json recipes/assets/tiny-llama/tokenizer_config.json $C/
  (
    source scripts/device-env.sh
    PYTHONPATH=$D:${PYTHONPATH:-} LORA_TRAIN=$PWD/.devbuild/lora-train timeout 540 bash scripts/data_at_scale.sh \
      --mb "${DATA_MB:-1000}" --model $C --device cuda --peer 16 --seq-len 2048 --out /tmp/data-at-scale 2>&1
  ) | tee "$OUT/data.txt"
fi
