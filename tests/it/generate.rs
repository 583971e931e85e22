//! `generate`: greedy decoding against transformers' `generate(do_sample=False)` (token ids in
//! tests/fixtures/generate/expected.json, written by scripts/reference_generate.py), KV-cached
//! decoding against full recompute (CPU here; CUDA bf16 and f32 on the device), and the real
//! binary's `generate`.

use crate::common::*;
use assert_cmd::Command;
use candle_core::{DType, Device, Tensor};
use lora_train::generate::{self, Decoder, Finish, Sampler, Sampling, Weights};
use lora_train::hub::ModelFiles;
#[cfg(feature = "cuda")]
use lora_train::lora::LoraSpec;
use lora_train::model::{Model, RopeScaling};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn expected() -> Value {
    let p = root().join("tests/fixtures/generate/expected.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// The case of expected.json named `name`.
fn case_named<'a>(exp: &'a Value, name: &str) -> &'a Value {
    let cases = exp["cases"].as_array().unwrap();
    cases.iter().find(|c| c["name"] == name).unwrap()
}

fn fixture(rel: &str) -> PathBuf {
    root().join("tests/fixtures").join(rel)
}

/// A case's checkpoint directory: as committed, or (config overrides) a copy of it in `tmp`
/// with config.json changed.
fn model_dir(case: &Value, tmp: &Path) -> PathBuf {
    let dir = fixture(case["model"].as_str().unwrap());
    let over = case["config_overrides"].as_object().unwrap();
    if over.is_empty() {
        return dir;
    }
    let out = tmp.join(case["name"].as_str().unwrap());
    std::fs::create_dir_all(&out).unwrap();
    for e in std::fs::read_dir(&dir).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), out.join(e.file_name())).unwrap();
    }
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    for (k, v) in over {
        cfg[k] = v.clone();
    }
    std::fs::write(out.join("config.json"), cfg.to_string()).unwrap();
    out
}

/// The case's model (its adapter loaded unmerged) in `dtype` on `dev`.
fn load(case: &Value, tmp: &Path, dtype: DType, dev: &Device) -> Model {
    let dir = model_dir(case, tmp);
    let adapter = case["adapter"].as_str().map(fixture);
    lora_train::generate::load::from_dirs(Some(&dir), adapter.as_deref(), dev, dtype)
        .unwrap()
        .model
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn greedy(w: Weights, prompt: &[u32], max_new: usize, stop: &[u32]) -> generate::Output {
    let mut dec = Decoder::new(w, prompt.len() + max_new).unwrap();
    let mut s = Sampler::new(Sampling::greedy()).unwrap();
    generate::generate(&mut dec, prompt, max_new, stop, &mut s, &mut |_| Ok(())).unwrap()
}

#[test]
fn greedy_equals_transformers_on_the_golden_fixtures() {
    let exp = expected();
    let max_new = exp["max_new_tokens"].as_u64().unwrap() as usize;
    let tmp = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for case in exp["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let mut model = load(case, tmp.path(), DType::F32, &Device::Cpu);
        // What transformers stopped at is what we read from the configs.
        assert_eq!(
            model.cfg.eos_token_ids,
            ids(&case["generation_eos_token_id"]),
            "{name}: eos ids"
        );
        let tok = case["prompts"][0]["text"].as_str().map(|_| {
            let dir = model_dir(case, tmp.path());
            let f = ModelFiles::local(&dir).unwrap();
            lora_train::data::TextTokenizer::load(
                f.tokenizer.as_deref().unwrap(),
                f.tokenizer_config.as_deref(),
            )
            .unwrap()
        });
        let split = Weights::new(&model).unwrap();
        let mut outs = Vec::new();
        for p in case["prompts"].as_array().unwrap() {
            let prompt = ids(&p["ids"]);
            if let (Some(text), Some(tok)) = (p["text"].as_str(), &tok) {
                assert_eq!(tok.encode_prompt(text).unwrap(), prompt, "{name}: {text:?}");
            }
            let stop = ids(&p["eos_token_id"]);
            let out = greedy(Weights::new(&model).unwrap(), &prompt, max_new, &stop);
            let want = ids(&p["expected"]);
            assert_eq!(out.tokens, want, "{name}: prompt {prompt:?}");
            match p["stopped"].as_str().unwrap() {
                "eos" => assert_eq!(out.finish, Finish::Stop(*want.last().unwrap()), "{name}"),
                _ => assert_eq!(out.finish, Finish::MaxNewTokens, "{name}"),
            }
            outs.push((prompt, stop, want));
            checked += 1;
        }
        drop(split);
        // The stacked q/k/v and gate/up weights (what the CLI runs) give the same tokens.
        let stacked = Weights::stacked(&mut model).unwrap();
        assert_eq!(stacked.layers[0].qkv.len(), 1, "{name}: q/k/v stacked");
        let mut dec = Decoder::new(stacked, 64).unwrap();
        let mut s = Sampler::new(Sampling::greedy()).unwrap();
        for (prompt, stop, want) in &outs {
            // One decoder for every prompt: the cache is reused from what agrees.
            let out = generate::generate(&mut dec, prompt, max_new, stop, &mut s, &mut |_| Ok(()))
                .unwrap();
            assert_eq!(&out.tokens, want, "{name} stacked: prompt {prompt:?}");
        }
    }
    assert!(checked >= 30, "{checked} prompts checked");
}

#[test]
fn the_window_case_depends_on_the_window() {
    // Without its sliding window the Mistral case writes other tokens: the fixture tests it.
    let exp = expected();
    let case = case_named(&exp, "mistral_window5+adapter");
    assert_eq!(case["config_overrides"]["sliding_window"], 5);
    let tmp = tempfile::tempdir().unwrap();
    let model = load(case, tmp.path(), DType::F32, &Device::Cpu);
    assert_eq!(model.cfg.sliding_window, Some(5));
    let mut differs = 0;
    for p in case["prompts"].as_array().unwrap() {
        let mut w = Weights::new(&model).unwrap();
        for l in &mut w.layers {
            l.spec.window = 0;
        }
        let out = greedy(w, &ids(&p["ids"]), 20, &ids(&p["eos_token_id"]));
        differs += usize::from(out.tokens != ids(&p["expected"]));
    }
    assert!(differs >= 2, "only {differs} prompts depend on the window");
}

/// Logits of every generated position two ways: with the KV cache (the prompt prefilled in
/// two chunks, so the second runs at p0 > 0 with a mask), and by the training forward over
/// the whole sequence. Returns (cached [n, V], full [n, V], tokens). `stacked`: q/k/v and
/// gate/up moved into one buffer each first (the CLI's weights); `graph`: one-token steps may
/// replay a CUDA graph (bf16 on CUDA).
pub fn cached_and_full(
    model: &mut Model,
    prompt: &[u32],
    steps: usize,
    (kernels, stacked, graph): (bool, bool, bool),
) -> (Tensor, Tensor, Vec<u32>) {
    let w = match stacked {
        true => Weights::stacked(model).unwrap(),
        false => Weights::new(model).unwrap(),
    };
    let mut dec = Decoder::new(w, 8).unwrap(); // grows
    if !kernels {
        dec = dec.without_kernels();
    }
    if !graph {
        dec = dec.without_graph();
    }
    // LongRoPE rotates a call's tokens by the call's reach (as transformers does): a prompt
    // prefilled in two calls is not the full forward's, so it is prefilled in one.
    let longrope = matches!(model.cfg.rope_scaling, RopeScaling::LongRope { .. });
    let cut = if longrope { 0 } else { prompt.len() / 2 };
    if cut > 0 {
        dec.extend(&prompt[..cut]).unwrap();
    }
    let mut logits = vec![dec.extend(&prompt[cut..]).unwrap()];
    let mut seq = prompt.to_vec();
    let mut toks = Vec::new();
    for i in 0..steps {
        let t = generate::decoder::argmax(&logits[i]).unwrap();
        toks.push(t);
        seq.push(t);
        if i + 1 < steps {
            logits.push(dec.extend(&[t]).unwrap());
        }
    }
    if graph && kernels {
        eprintln!("cached_and_full: graph captured = {}", dec.graph_captured());
    }
    let cached = Tensor::stack(&logits, 0)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap();
    let full = full_logits(model, &seq, prompt.len(), steps);
    (cached, full, toks)
}

/// The training forward's logits over `seq` [n] at the `steps` positions after the first
/// `prompt` tokens' last, on the host: [steps, V].
fn full_logits(model: &Model, seq: &[u32], prompt: usize, steps: usize) -> Tensor {
    let n = seq.len();
    let positions: Vec<u32> = (0..n as u32).collect();
    let ctx = model.ctx(&positions, 1, n, None, None).unwrap();
    let idt = Tensor::from_slice(seq, (1, n), &model.device).unwrap();
    let full = model.forward(&idt, &ctx).unwrap().squeeze(0).unwrap(); // [n, V]
    full.narrow(0, prompt - 1, steps)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap()
}

/// At most `want` steps after `prompt` within the model's max_position_embeddings.
fn steps_within(model: &Model, prompt: &[u32], want: usize) -> usize {
    want.min(model.cfg.max_position_embeddings - prompt.len())
}

/// Every case of expected.json (every family we train, with its adapter): cached decoding gives
/// the training forward's logits, which the golden tests pin to transformers'.
#[test]
fn kv_cached_decoding_equals_full_recompute_on_the_cpu() {
    let exp = expected();
    let tmp = tempfile::tempdir().unwrap();
    for case in exp["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let mut model = load(case, tmp.path(), DType::F32, &Device::Cpu);
        let prompt = ids(&case["prompts"][2]["ids"]);
        let steps = steps_within(&model, &prompt, 24);
        for stacked in [false, true] {
            let how = (false, stacked, false);
            let (cached, full, toks) = cached_and_full(&mut model, &prompt, steps, how);
            assert_close(&format!("{name} logits"), &cached, &full, 1e-4, 1e-5);
            let argmax: Vec<u32> = full.argmax(1).unwrap().to_vec1().unwrap();
            assert_eq!(toks, argmax, "{name}");
        }
    }
}

#[test]
fn greedy_text_on_the_training_model_matches_the_fixture() {
    // The library function the training loop calls for sample_every, on the tiny model.
    let exp = expected();
    let case = case_named(&exp, "tiny_shipped+adapter");
    let tmp = tempfile::tempdir().unwrap();
    let dir = model_dir(case, tmp.path());
    let l = lora_train::generate::load::from_dirs(
        Some(&dir),
        Some(&fixture(case["adapter"].as_str().unwrap())),
        &Device::Cpu,
        DType::F32,
    )
    .unwrap();
    let tok = l.tok.as_ref().unwrap();
    let p = &case["prompts"][0];
    let text = generate::greedy_text(&l.model, tok, p["text"].as_str().unwrap(), 20).unwrap();
    let want = ids(&p["expected"]);
    let cut = want
        .iter()
        .position(|t| tok.stop_ids.contains(t))
        .unwrap_or(want.len());
    assert_eq!(text, tok.decode(&want[..cut]).unwrap());
    let rows =
        generate::sample_rows(&l.model, tok, 7, &[p["text"].as_str().unwrap().into()]).unwrap();
    assert_eq!(
        (rows[0].step, rows[0].completion.starts_with(&text)),
        (7, true)
    );
    let path = tmp.path().join("samples.jsonl");
    generate::append_samples(&path, &rows).unwrap();
    generate::append_samples(&path, &rows).unwrap();
    let lines: Vec<generate::SampleRow> = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[1].completion, rows[0].completion);
}

#[test]
fn a_merged_checkpoint_generates_what_the_unmerged_adapter_does() {
    let exp = expected();
    let case = &exp["cases"][1];
    assert_eq!(case["name"], "llama_gqa+adapter");
    let tmp = tempfile::tempdir().unwrap();
    let merged = tmp.path().join("merged");
    lora_train::export::merge::merge(
        &fixture(case["adapter"].as_str().unwrap()),
        &fixture(case["model"].as_str().unwrap()),
        &merged,
        &lora_train::export::merge::MergeOptions::default(),
    )
    .unwrap();
    let m = lora_train::generate::load::from_dirs(Some(&merged), None, &Device::Cpu, DType::F32)
        .unwrap()
        .model;
    assert_eq!(m.adapters().count(), 0);
    for p in case["prompts"].as_array().unwrap() {
        let out = generate::greedy_ids(&m, &ids(&p["ids"]), 20, &ids(&p["eos_token_id"])).unwrap();
        assert_eq!(out.tokens, ids(&p["expected"]));
    }
}

#[test]
fn sampling_repeats_with_a_seed_and_the_cache_stops_at_the_model_limit() {
    let exp = expected();
    let tmp = tempfile::tempdir().unwrap();
    let model = load(&exp["cases"][0], tmp.path(), DType::F32, &Device::Cpu);
    let run = |seed| {
        let mut dec = Decoder::new(Weights::new(&model).unwrap(), 40).unwrap();
        let s = Sampling {
            temperature: 0.8,
            top_k: 20,
            top_p: 0.95,
            seed,
        };
        let mut s = Sampler::new(s).unwrap();
        generate::generate(&mut dec, &[5, 6, 7], 30, &[], &mut s, &mut |_| Ok(()))
            .unwrap()
            .tokens
    };
    let a = run(1);
    assert_eq!(a, run(1));
    assert_ne!(a, run(2));
    // max_position_embeddings is 64: a 60-token prompt gets 5 new tokens (the last from
    // position 63's logits; running it would need position 64).
    let prompt: Vec<u32> = (0..60).map(|i| 3 + i % 100).collect();
    let out = generate::greedy_ids(&model, &prompt, 20, &[]).unwrap();
    assert_eq!((out.tokens.len(), out.finish), (5, Finish::ContextFull));
    let long: Vec<u32> = vec![3; 64];
    let e = generate::greedy_ids(&model, &long, 5, &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("max_position_embeddings"), "{e}");
    let e = generate::greedy_ids(&model, &[500], 5, &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("outside the vocabulary"), "{e}");
}

/// KV-cached decoding equals full recompute on the GPU, bf16 and f32, with our decode kernels
/// and with candle's ops; on a shape whose caches need several key splits (300 positions),
/// with adapters whose B is non-zero, and on the golden checkpoints.
#[cfg(feature = "cuda")]
#[test]
fn kv_cached_decoding_equals_full_recompute_on_cuda() {
    let dev = Device::new_cuda(0).unwrap();
    let mut cfg = lora_train::model::shapes::shape("tiny").unwrap();
    (cfg.num_layers, cfg.num_kv_heads, cfg.vocab_size) = (2, 4, 512);
    cfg.max_position_embeddings = 512;
    let spec = all_linear_r8();
    for dtype in [DType::F32, DType::BF16] {
        let mut model = Model::random(cfg.clone(), dtype, &dev, &spec, 3).unwrap();
        // Sharper logits than N(0, 0.02) weights give, so that most greedy picks are clear.
        model.lm_head = (model.lm_head.to_dtype(DType::F32).unwrap() * 30.0)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        for (_, l) in model.adapters() {
            l.b.set(&(Tensor::randn(0f32, 0.02, l.b.dims(), &dev).unwrap()))
                .unwrap();
        }
        let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 500) as u32).collect();
        // (kernels, stacked, graph): the graph is captured for bf16 only
        let hows = [
            (true, true, true),
            (true, true, false),
            (true, false, true),
            (false, true, false),
        ];
        for how in hows {
            let (cached, full, toks) = cached_and_full(&mut model, &prompt, 260, how);
            let what = format!("{dtype:?} (kernels, stacked, graph) = {how:?}");
            check_cuda(&what, &cached, &full, &toks, (dtype, 2e-2), 3);
        }
    }
    // The base alone: one-token steps replay a captured graph in bf16.
    let base = LoraSpec {
        targets: Vec::new(),
        ..spec.clone()
    };
    let mut model = Model::random(cfg.clone(), DType::BF16, &dev, &base, 3).unwrap();
    model.lm_head = (model.lm_head.to_dtype(DType::F32).unwrap() * 30.0)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 500) as u32).collect();
    for how in [(true, true, true), (true, true, false)] {
        let (cached, full, toks) = cached_and_full(&mut model, &prompt, 260, how);
        let what = format!("base BF16 (kernels, stacked, graph) = {how:?}");
        check_cuda(&what, &cached, &full, &toks, (DType::BF16, 2e-2), 3);
    }
    let exp = expected();
    let tmp = tempfile::tempdir().unwrap();
    for case in exp["cases"].as_array().unwrap() {
        let prompt = ids(&case["prompts"][2]["ids"]);
        let f32_model = load(case, tmp.path(), DType::F32, &dev);
        for dtype in [DType::F32, DType::BF16] {
            let mut model = load(case, tmp.path(), dtype, &dev);
            let steps = steps_within(&model, &prompt, 24);
            let (cached, full, toks) =
                cached_and_full(&mut model, &prompt, steps, (true, true, true));
            let what = format!("{} {dtype:?}", case["name"]);
            // near-uniform tiny models: in bf16 few picks stand clear of rounding
            let need = if dtype == DType::F32 { 2 } else { 0 };
            // bf16: within 2e-2 of the full forward, or 1.5 × the full bf16 forward's own
            // distance from f32's over the same tokens where that is more (gpt_oss: 1.6e-1 on
            // the CPU, where the cached decode is 8.6e-2 from f32)
            let tol = match dtype {
                DType::F32 => 0.0,
                _ => {
                    let seq: Vec<u32> = prompt.iter().chain(&toks).copied().collect();
                    let truth = full_logits(&f32_model, &seq, prompt.len(), steps);
                    (1.5 * rel_l2(&what, &full, &truth)).max(2e-2)
                }
            };
            check_cuda(&what, &cached, &full, &toks, (dtype, tol), need);
        }
        // f32 on the GPU is transformers' greedy too, where no pick is closer than 1e-3 (the
        // GPU's sums round otherwise; the CPU test takes every prompt).
        let model = &f32_model;
        for p in case["prompts"].as_array().unwrap() {
            if p["min_margin"].as_f64().unwrap() < 1e-3 {
                continue;
            }
            let out =
                generate::greedy_ids(model, &ids(&p["ids"]), 20, &ids(&p["eos_token_id"])).unwrap();
            assert_eq!(out.tokens, ids(&p["expected"]), "{} on CUDA", case["name"]);
        }
    }
}

/// Logits close (f32 elementwise, bf16 within relative L2 `tol`), and the cached greedy token
/// equal to the full forward's argmax wherever its best two logits are apart by more than
/// rounding: at least 1 / `need` of the steps (0: no minimum).
#[cfg(feature = "cuda")]
fn check_cuda(
    what: &str,
    cached: &Tensor,
    full: &Tensor,
    toks: &[u32],
    (dtype, tol): (DType, f64),
    need: usize,
) {
    match dtype {
        DType::F32 => assert_close(what, cached, full, 1e-4, 1e-5),
        _ => assert_rel_l2(what, cached, full, tol),
    }
    let gap = if dtype == DType::F32 { 1e-3 } else { 0.25 };
    let rows: Vec<Vec<f32>> = full.to_vec2().unwrap();
    let mut checked = 0;
    for (i, (row, &t)) in rows.iter().zip(toks).enumerate() {
        let mut s = row.clone();
        s.sort_by(|a, b| b.total_cmp(a));
        if s[0] - s[1] > gap {
            let best = row
                .iter()
                .enumerate()
                .fold(0, |b, (j, v)| if *v > row[b] { j } else { b });
            assert_eq!(t as usize, best, "{what}: step {i}");
            checked += 1;
        }
    }
    assert!(
        need == 0 || checked * need >= toks.len(),
        "{what}: only {checked} of {} steps clear",
        toks.len()
    );
}

// ---- the real binary ----

fn bin() -> Command {
    Command::cargo_bin("lora-train").unwrap()
}

/// `lora-train generate` from the shipped tiny model on the CPU, run in the repository root.
fn tiny_generate() -> Command {
    let mut c = bin();
    c.current_dir(root())
        .args(["generate", "--model", "recipes/assets/tiny-llama"])
        .args(["--device", "cpu"]);
    c
}

#[test]
fn cli_generates_from_the_shipped_tiny_model_and_an_adapter() {
    let exp = expected();
    let case = case_named(&exp, "tiny_shipped+adapter");
    let p = &case["prompts"][1];
    let o = bin()
        .current_dir(root())
        .args([
            "generate",
            "--model",
            "recipes/assets/tiny-llama",
            "--adapter",
        ])
        .arg(fixture(case["adapter"].as_str().unwrap()))
        .args(["--device", "cpu", "--max-new-tokens", "20", "--prompt"])
        .arg(p["text"].as_str().unwrap())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(
        stderr.contains("20 tokens in") && stderr.contains("tok/s"),
        "{stderr}"
    );
    // The streamed text is the whole completion's text.
    let dir = root().join("recipes/assets/tiny-llama");
    let tok = lora_train::data::TextTokenizer::load(
        &dir.join("tokenizer.json"),
        Some(&dir.join("tokenizer_config.json")),
    )
    .unwrap();
    let want = ids(&p["expected"]);
    let cut = want
        .iter()
        .position(|t| tok.stop_ids.contains(t))
        .unwrap_or(want.len());
    let mut text = tok.decode(&want[..cut]).unwrap();
    text.push('\n');
    assert_eq!(String::from_utf8_lossy(&o.stdout), text);

    // The base alone, from a text prompt.
    let o = tiny_generate()
        .args(["--prompt", "Once upon a time", "--max-new-tokens", "5"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("5 tokens in"));
}

#[test]
fn cli_prompt_ids_print_transformers_tokens() {
    // Checkpoints without a tokenizer: ids in, ids out, equal to the reference; a Llama and
    // the families whose decoding differs most (soft-caps, local RoPE, LongRoPE, experts).
    let exp = expected();
    let names = [
        "llama_gqa+adapter",
        "gemma2_softcap+adapter",
        "gemma3_local_global+adapter",
        "phi3_fused_longrope+adapter",
        "qwen3_moe+adapter",
    ];
    for name in names {
        let case = case_named(&exp, name);
        let p = &case["prompts"][1];
        let prompt: Vec<String> = ids(&p["ids"]).iter().map(|x| x.to_string()).collect();
        let o = bin()
            .args([
                "generate",
                "--device",
                "cpu",
                "--max-new-tokens",
                "20",
                "--model",
            ])
            .arg(fixture(case["model"].as_str().unwrap()))
            .arg("--adapter")
            .arg(fixture(case["adapter"].as_str().unwrap()))
            .args(["--prompt-ids", &prompt.join(",")])
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let got: Vec<u32> = String::from_utf8_lossy(&o.stdout)
            .split_whitespace()
            .map(|s| s.parse().unwrap())
            .collect();
        assert_eq!(got, ids(&p["expected"]), "{name}");
    }
}

#[test]
fn cli_chat_answers_each_line_of_stdin() {
    let o = tiny_generate()
        .args(["--chat", "--system", "Be brief.", "--max-new-tokens", "6"])
        .write_stdin("What color is the dog?\n\nSpell the word \"bear\".\n")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    // Two turns, each with its speed line.
    let turns = stderr
        .lines()
        .filter(|l| l.starts_with("6 tokens in"))
        .count();
    assert_eq!(turns, 2, "{stderr}");
    assert!(!o.stdout.is_empty());
}

#[test]
fn cli_bad_flags_exit_2_and_a_missing_adapter_is_named() {
    let cases: [&[&str]; 6] = [
        &[
            "generate",
            "--model",
            "recipes/assets/tiny-llama",
            "--prompt",
            "x",
            "--temperature",
            "-1",
        ],
        &[
            "generate",
            "--model",
            "recipes/assets/tiny-llama",
            "--prompt",
            "x",
            "--chat",
        ],
        &[
            "generate",
            "--model",
            "recipes/assets/tiny-llama",
            "--prompt",
            "x",
            "--top-p",
            "0",
        ],
        &[
            "generate",
            "--model",
            "recipes/assets/tiny-llama",
            "--max-new-tokens",
            "0",
            "--prompt",
            "x",
        ],
        &["generate", "--model", "recipes/assets/tiny-llama"],
        &["generate", "--prompt", "x"],
    ];
    for args in cases {
        let o = bin().current_dir(root()).args(args).output().unwrap();
        assert_eq!(
            o.status.code(),
            Some(2),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let o = bin()
        .current_dir(root())
        .args(["generate", "--adapter", "no/such/adapter", "--prompt", "x"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("no/such/adapter"), "{stderr}");
    // A directory that is not an adapter names the file it lacks.
    let o = bin()
        .current_dir(root())
        .args(["generate", "--adapter", "recipes", "--prompt", "x"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("recipes/adapter_config.json"), "{stderr}");
}

#[test]
fn cli_recipe_without_a_trained_adapter_says_to_train_first() {
    let tmp = tempfile::tempdir().unwrap();
    let o = bin()
        .current_dir(root())
        .args(["generate", "--recipe", "recipes/tiny-cpu.toml", "--set"])
        .arg(format!("output.dir={}", tmp.path().join("none").display()))
        .args(["--prompt", "x"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("holds no adapter") && stderr.contains("lora-train --recipe"),
        "{stderr}"
    );
}

#[test]
fn cli_decode_bench_prints_the_fields() {
    let o = bin()
        .args(["generate", "--bench", "--shape", "tiny", "--device", "cpu"])
        .args([
            "--prompt-len",
            "8",
            "--max-new-tokens",
            "4",
            "--reps",
            "1",
            "--rank",
            "4",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    for k in [
        "tokens_per_s",
        "ms_per_token",
        "weight_bytes",
        "bandwidth_fraction",
        "prefill_ms",
        "host_ms_per_token",
    ] {
        assert!(v[k].as_f64().is_some_and(|x| x > 0.0), "{k}: {v}");
    }
    // on the CPU the steps run as they are issued: all of a step's time is the host's
    let host = v["host_ms_per_token"].as_f64().unwrap();
    let step = v["ms_per_token"].as_f64().unwrap();
    assert!(host <= step && host > 0.5 * step, "{v}");
    // tiny: 4 layers of 256 hidden, 688 mlp, 32000 vocab, untied head, f32
    let layer = 4 * 256 * 256 + 3 * 256 * 688 + 2 * 256;
    assert_eq!(v["weight_bytes"], 4 * (4 * layer + 256 + 32000 * 256));
    assert!(v["adapter_bytes"].as_u64().unwrap() > 0);
}

#[test]
fn streamed_text_is_the_decoded_text_with_multibyte_characters_whole() {
    let dir = root().join("recipes/assets/tiny-llama");
    let tok = lora_train::data::TextTokenizer::load(
        &dir.join("tokenizer.json"),
        Some(&dir.join("tokenizer_config.json")),
    )
    .unwrap();
    let text = "Déjà vu: 32 ✓ naïve — 日本\nsecond line ünïcode";
    let ids = tok.encode_prompt(text).unwrap();
    // byte-level BPE with a 512 vocabulary: some characters span several tokens
    assert!(ids.len() > text.chars().count() / 2);
    let mut s = generate::stream::TextStream::new(&tok);
    let mut out = String::new();
    let mut pieces = 0;
    for &id in &ids {
        if let Some(p) = s.push(id).unwrap() {
            assert!(!p.contains('\u{FFFD}'), "{p:?}");
            out.push_str(&p);
            pieces += 1;
        }
    }
    out.extend(s.finish().unwrap());
    assert_eq!(out, tok.decode(&ids).unwrap());
    assert_eq!(out, text);
    assert!(pieces > 10);
}

#[test]
fn sample_every_prints_and_records_what_generate_says_of_the_adapter() {
    let tmp = tempfile::tempdir().unwrap();
    let recipe = format!(
        "[model]\npath = \"{model}\"\n[lora]\nrank = 8\ndropout = 0.05\n[data]\ntrain = \"{data}\"\nseq_len = 32\n\
         [train]\nmax_steps = 4\nmicro_batch = 2\nlr = 0.01\nsample_every = 2\n\
         sample_prompts = [\"Once upon a time\", \"The cat\"]\n[output]\ndir = \"out\"\nsave_every = 0\n",
        model = root().join("recipes/assets/tiny-llama").display(),
        data = root().join("recipes/data/tiny-text.jsonl").display(),
    );
    std::fs::write(tmp.path().join("r.toml"), recipe).unwrap();
    let o = bin()
        .current_dir(tmp.path())
        .args(["--recipe", "r.toml"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(
        stderr.contains("sample @ step 2: \"Once upon a time\" -> "),
        "{stderr}"
    );
    let rows: Vec<Value> = std::fs::read_to_string(tmp.path().join("out/samples.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let at: Vec<(u64, &str)> = rows
        .iter()
        .map(|r| (r["step"].as_u64().unwrap(), r["prompt"].as_str().unwrap()))
        .collect();
    assert_eq!(
        at,
        [
            (2, "Once upon a time"),
            (2, "The cat"),
            (4, "Once upon a time"),
            (4, "The cat")
        ]
    );
    // The last step's samples are the saved adapter's greedy completions.
    for r in &rows[2..] {
        let g = bin()
            .current_dir(tmp.path())
            .args(["generate", "--adapter", "out", "--device", "cpu"])
            .args([
                "--max-new-tokens",
                &generate::SAMPLE_MAX_NEW_TOKENS.to_string(),
            ])
            .args(["--prompt", r["prompt"].as_str().unwrap()])
            .output()
            .unwrap();
        assert!(g.status.success(), "{}", String::from_utf8_lossy(&g.stderr));
        let text = String::from_utf8_lossy(&g.stdout);
        assert_eq!(
            text.trim_end_matches('\n'),
            r["completion"].as_str().unwrap()
        );
    }
    // The completions moved with training (step 2's adapters are not step 4's).
    assert_ne!(rows[0]["completion"], rows[2]["completion"], "{rows:?}");

    // Under FSDP there is no whole model to sample from: a recipe error.
    let o = bin()
        .current_dir(tmp.path())
        .args([
            "check",
            "--recipe",
            "r.toml",
            "--set",
            "parallel.strategy=fsdp",
        ])
        .args(["--set", "parallel.devices=[0,1]"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("train.sample_every") && err.contains("FSDP"),
        "{err}"
    );
}
