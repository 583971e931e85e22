//! GGUF export against llama.cpp's own tools (references made by
//! scripts/make_gguf_fixtures.py with convert_hf_to_gguf.py, convert_lora_to_gguf.py and
//! llama-quantize, read back with gguf-py): every metadata key and value, every tensor's name,
//! ggml type, shape and bytes, for the tiny Llama merged with a trained adapter (f16, bf16,
//! q8_0, f32), its adapter as a LoRA GGUF, and the base of every family we train; the LoRA
//! file rebuilds the merged weights; k-quant mixes take llama-quantize's types with errors
//! within 5% of its blocks'; the Modelfile; refusals that write nothing.
//! `general.name` is left out: convert_hf_to_gguf.py guesses it from the directory's name.

use crate::common::*;
use assert_cmd::Command;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device, Tensor};
use lora_train::export::gguf::type_name;
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn bin() -> Command {
    Command::cargo_bin("lora-train").unwrap()
}

fn fixture(name: &str) -> PathBuf {
    root().join("tests/fixtures/gguf").join(name)
}

fn tiny() -> PathBuf {
    root().join("recipes/assets/tiny-llama")
}

/// A GGUF file as read back: metadata, and each tensor's (type, ggml shape, bytes).
struct Gguf {
    meta: BTreeMap<String, Value>,
    tensors: BTreeMap<String, (String, Vec<usize>, Vec<u8>)>,
    content: Content,
    path: PathBuf,
}

fn read(path: &Path) -> Gguf {
    let mut f = std::fs::File::open(path).unwrap();
    let content = Content::read(&mut f).unwrap();
    let mut tensors = BTreeMap::new();
    for (name, info) in &content.tensor_infos {
        let q = content.tensor(&mut f, name, &Device::Cpu).unwrap();
        let mut shape = info.shape.dims().to_vec();
        shape.reverse();
        tensors.insert(
            name.clone(),
            (
                type_name(info.ggml_dtype).to_string(),
                shape,
                q.data().unwrap().to_vec(),
            ),
        );
    }
    let meta = content.metadata.clone().into_iter().collect();
    Gguf {
        meta,
        tensors,
        content,
        path: path.to_path_buf(),
    }
}

impl Gguf {
    /// A tensor dequantized to f32, in candle's (row-major) shape.
    fn f32(&self, name: &str) -> Tensor {
        let mut f = std::fs::File::open(&self.path).unwrap();
        let q = self.content.tensor(&mut f, name, &Device::Cpu).unwrap();
        q.dequantize(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    }
}

/// GGUF's value-type numbers (gguf-py's GGUFValueType).
fn type_id(v: &Value) -> u64 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

/// A value as the digest writes it (floats widened from f32 exactly).
fn json(v: &Value) -> Json {
    match v {
        Value::U8(x) => (*x).into(),
        Value::I8(x) => (*x).into(),
        Value::U16(x) => (*x).into(),
        Value::I16(x) => (*x).into(),
        Value::U32(x) => (*x).into(),
        Value::I32(x) => (*x).into(),
        Value::U64(x) => (*x).into(),
        Value::I64(x) => (*x).into(),
        Value::F32(x) => (*x as f64).into(),
        Value::F64(x) => (*x).into(),
        Value::Bool(x) => (*x).into(),
        Value::String(s) => s.clone().into(),
        Value::Array(a) => Json::Array(a.iter().map(json).collect()),
    }
}

fn sha256(b: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, b)
        .as_ref()
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

fn digest(name: &str) -> Json {
    serde_json::from_str(&std::fs::read_to_string(fixture(name)).unwrap()).unwrap()
}

/// `got` holds exactly the digest's keys (but general.name) and tensors; with `bytes`, every
/// tensor's bytes are the reference's.
fn assert_equals_digest(got: &Gguf, want: &Json, bytes: bool, what: &str) {
    let wm = want["metadata"].as_object().unwrap();
    let wkeys: Vec<&String> = wm.keys().filter(|k| *k != "general.name").collect();
    let gkeys: Vec<&String> = got.meta.keys().filter(|k| *k != "general.name").collect();
    assert_eq!(gkeys, wkeys, "{what}: metadata keys");
    for k in wkeys {
        let (w, g) = (&wm[k], &got.meta[k]);
        assert_eq!(
            type_id(g),
            w["type"].as_u64().unwrap(),
            "{what}: type of {k}"
        );
        if let (Value::Array(a), Some(sub)) = (g, w["sub"].as_u64()) {
            assert!(
                a.iter().all(|x| type_id(x) == sub),
                "{what}: element type of {k}"
            );
        }
        assert_eq!(json(g), w["value"], "{what}: value of {k}");
    }
    let wt = want["tensors"].as_object().unwrap();
    assert_eq!(
        got.tensors.keys().collect::<Vec<_>>(),
        wt.keys().collect::<Vec<_>>(),
        "{what}: tensor names"
    );
    for (name, (ty, shape, data)) in &got.tensors {
        let w = &wt[name];
        assert_eq!(ty, w["type"].as_str().unwrap(), "{what}: type of {name}");
        let ws: Vec<usize> = w["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(shape, &ws, "{what}: shape of {name}");
        if bytes {
            assert_eq!(
                sha256(data),
                w["sha256"].as_str().unwrap(),
                "{what}: bytes of {name}"
            );
        }
    }
}

fn export(args: &[&str], out: &Path) -> Gguf {
    let mut c = bin();
    c.arg("export").args(args).arg("--out").arg(out);
    c.assert().success();
    read(out)
}

fn tiny_adapter_args() -> Vec<String> {
    vec![
        "--adapter".into(),
        fixture("tiny_adapter").display().to_string(),
        "--base".into(),
        tiny().display().to_string(),
    ]
}

#[test]
fn tiny_merged_gguf_equals_convert_hf_to_gguf() {
    let dir = tempfile::tempdir().unwrap();
    for q in [None, Some("bf16"), Some("q8_0"), Some("f32")] {
        let mut args = tiny_adapter_args();
        args.extend(["--format".into(), "gguf".into()]);
        if let Some(q) = q {
            args.extend(["--quant".into(), q.into()]);
        }
        let name = q.unwrap_or("f16");
        let out = dir.path().join(format!("{name}.gguf"));
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let got = export(&a, &out);
        assert_equals_digest(&got, &digest(&format!("tiny_{name}.json")), true, name);
    }
}

#[test]
fn tiny_lora_gguf_equals_convert_lora_to_gguf() {
    let dir = tempfile::tempdir().unwrap();
    for q in ["f32", "f16"] {
        let mut args = tiny_adapter_args();
        args.extend([
            "--format".into(),
            "gguf-lora".into(),
            "--quant".into(),
            q.into(),
        ]);
        let out = dir.path().join(format!("{q}.gguf"));
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let got = export(&a, &out);
        assert_equals_digest(&got, &digest(&format!("tiny_lora_{q}.json")), true, q);
    }
}

/// Each golden family's base with a tokenizer (byte-level BPE or SentencePiece), converted
/// without an adapter.
#[test]
fn every_family_equals_convert_hf_to_gguf() {
    let dir = tempfile::tempdir().unwrap();
    for (case, tok) in [
        ("llama_gqa", "tok128"),
        ("llama32_tied_long", "tok128"),
        ("mistral_head_dim", "spm128"),
        ("qwen2_bias", "tok128"),
        ("qwen3_qk_norm", "tok128"),
        ("qwen3_moe", "tok128"),
        ("gemma2_softcap", "spm128"),
        ("gemma3_local_global", "spm128"),
        ("phi3_fused_longrope", "spm128"),
    ] {
        let d = dir.path().join(case);
        copy_dir(&golden_dir(case).join("model"), &d);
        copy_dir(&fixture(tok), &d);
        let out = dir.path().join(format!("{case}.gguf"));
        let got = export(&["--base", d.to_str().unwrap(), "--format", "gguf"], &out);
        assert_equals_digest(&got, &digest(&format!("family_{case}.json")), true, case);
    }
}

/// base + (alpha / r)·B·A, with the LoRA file's tensors, is the merged file's weight (f32).
#[test]
fn lora_gguf_rebuilds_the_merged_weights() {
    let dir = tempfile::tempdir().unwrap();
    let t = tiny().display().to_string();
    let base = export(
        &["--base", &t, "--format", "gguf", "--quant", "f32"],
        &dir.path().join("base.gguf"),
    );
    let mut args = tiny_adapter_args();
    args.extend([
        "--format".into(),
        "gguf".into(),
        "--quant".into(),
        "f32".into(),
    ]);
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let merged = export(&a, &dir.path().join("merged.gguf"));
    let mut args = tiny_adapter_args();
    args.extend(["--format".into(), "gguf-lora".into()]);
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let lora = export(&a, &dir.path().join("lora.gguf"));
    let alpha = match &lora.meta["adapter.lora.alpha"] {
        Value::F32(x) => *x as f64,
        v => panic!("{v:?}"),
    };
    let mut n = 0;
    for name in lora.tensors.keys().filter(|k| k.ends_with(".lora_a")) {
        let w = name.trim_end_matches(".lora_a");
        let a = lora.f32(name);
        let b = lora.f32(&format!("{w}.lora_b"));
        let r = a.dim(0).unwrap() as f64;
        let rebuilt = (base.f32(w) + (b.matmul(&a).unwrap() * (alpha / r)).unwrap()).unwrap();
        assert_close(w, &rebuilt, &merged.f32(w), 1e-5, 1e-6);
        n += 1;
    }
    assert_eq!(n, 14, "every linear of both layers");
}

/// The k256 checkpoint (scripts/make_gguf_fixtures.py's `k256_checkpoint`): element i of
/// tensor t is ((i·7919 + t·104729) mod 2001 − 1000) / 8000, plus 1 for the norms.
fn k256_checkpoint(d: &Path) {
    let (h, i, kv, vocab) = (256usize, 512usize, 128usize, 128usize);
    let mut names: Vec<(String, Vec<usize>)> =
        vec![("model.embed_tokens.weight".into(), vec![vocab, h])];
    for l in 0..2 {
        let p = format!("model.layers.{l}.");
        for (n, s) in [
            ("input_layernorm.weight", vec![h]),
            ("self_attn.q_proj.weight", vec![h, h]),
            ("self_attn.k_proj.weight", vec![kv, h]),
            ("self_attn.v_proj.weight", vec![kv, h]),
            ("self_attn.o_proj.weight", vec![h, h]),
            ("post_attention_layernorm.weight", vec![h]),
            ("mlp.gate_proj.weight", vec![i, h]),
            ("mlp.up_proj.weight", vec![i, h]),
            ("mlp.down_proj.weight", vec![h, i]),
        ] {
            names.push((format!("{p}{n}"), s));
        }
    }
    names.push(("model.norm.weight".into(), vec![h]));
    names.push(("lm_head.weight".into(), vec![vocab, h]));
    std::fs::create_dir_all(d).unwrap();
    let values: Vec<Vec<f32>> = names
        .iter()
        .enumerate()
        .map(|(t, (_, s))| {
            let n: usize = s.iter().product();
            (0..n as i64)
                .map(|e| {
                    let v = ((e * 7919 + t as i64 * 104729) % 2001 - 1000) as f32 / 8000.0;
                    if s.len() == 1 {
                        v + 1.0
                    } else {
                        v
                    }
                })
                .collect()
        })
        .collect();
    let parts: Vec<lora_train::export::F32Part> = names
        .iter()
        .zip(&values)
        .map(|((n, s), v)| (n.as_str(), s.as_slice(), v.as_slice()))
        .collect();
    lora_train::export::write_f32(&d.join("model.safetensors"), &parts).unwrap();
    let cfg = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": i, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": vocab, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"
    });
    std::fs::write(
        d.join("config.json"),
        serde_json::to_string_pretty(&cfg).unwrap(),
    )
    .unwrap();
    copy_dir(&fixture("tok128"), d);
}

/// Q4_K_M, Q5_K_M, Q6_K: llama-quantize's type for every tensor, and each quantized tensor's
/// relative L2 error (against the f16 values it quantizes) within 5% of llama.cpp's blocks'
/// (candle's k-quant search is not ggml's current one: its blocks differ, its error is
/// 0.3-3% higher on these weights).
#[test]
fn k_quant_mixes_follow_llama_quantize() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("k256");
    k256_checkpoint(&d);
    let ds = d.to_str().unwrap();
    let f16 = export(
        &["--base", ds, "--format", "gguf"],
        &dir.path().join("f16.gguf"),
    );
    for q in ["q4_k_m", "q5_k_m", "q6_k"] {
        let got = export(
            &["--base", ds, "--format", "gguf", "--quant", q],
            &dir.path().join(format!("{q}.gguf")),
        );
        let want = digest(&format!("k256_{q}.json"));
        assert_equals_digest(&got, &want, false, q);
        for (name, w) in want["tensors"].as_object().unwrap() {
            let Some(ref_err) = w["rel_err"].as_f64() else {
                continue;
            };
            let src = f16.f32(name);
            let diff = (got.f32(name) - &src).unwrap();
            let norm = |t: &Tensor| {
                t.sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
                    .sqrt() as f64
            };
            let err = norm(&diff) / norm(&src);
            assert!(
                err <= ref_err * 1.05,
                "{q} {name}: error {err:.5}, llama.cpp's {ref_err:.5}"
            );
            assert!(
                err >= ref_err * 0.8,
                "{q} {name}: error {err:.5} far below llama.cpp's {ref_err:.5}?"
            );
        }
    }
}

/// Every quantized export of the tiny model reads back within its type's error of the f32
/// file (tiny rows of 64 and 176 columns take llama.cpp's fallbacks: Q5_0, Q5_1, Q8_0, f16).
#[test]
fn quantized_tiny_exports_read_back_within_their_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = tiny_adapter_args();
    args.extend([
        "--format".into(),
        "gguf".into(),
        "--quant".into(),
        "f32".into(),
    ]);
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let f32f = export(&a, &dir.path().join("f32.gguf"));
    for (q, tol) in [
        ("f16", 1e-3),
        ("bf16", 8e-3),
        ("q8_0", 8e-3),
        ("q6_k", 8e-3),
        ("q5_k_m", 0.05),
        ("q4_k_m", 0.05),
    ] {
        let mut args = tiny_adapter_args();
        args.extend(["--format".into(), "gguf".into(), "--quant".into(), q.into()]);
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let got = export(&a, &dir.path().join(format!("{q}.gguf")));
        for name in f32f.tensors.keys() {
            let (w, g) = (f32f.f32(name), got.f32(name));
            assert_rel_l2(&format!("{q} {name}"), &g, &w, tol);
        }
    }
}

#[test]
fn ollama_modelfile_translates_the_chat_template() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = tiny_adapter_args();
    args.extend(["--format".into(), "gguf".into(), "--ollama".into()]);
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    export(&a, &dir.path().join("tiny.gguf"));
    let m = std::fs::read_to_string(dir.path().join("Modelfile")).unwrap();
    let want = "FROM ./tiny.gguf\nTEMPLATE \"\"\"{{ range $i, $_ := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}\
{{ if eq .Role \"system\" }}<|im_start|>system\n{{ .Content }}</s>\n\
{{ else if eq .Role \"user\" }}<|im_start|>user\n{{ .Content }}</s>\n{{ if $last }}<|im_start|>assistant\n{{ end }}\
{{ else if eq .Role \"assistant\" }}<|im_start|>assistant\n{{ .Content }}{{ if not $last }}</s>\n{{ end }}{{ end }}{{ end }}\"\"\"\n\
PARAMETER stop \"</s>\"\n";
    assert_eq!(m, want);
    // gguf-lora: FROM the base named, ADAPTER the file
    let mut args = tiny_adapter_args();
    let base = dir.path().join("base.gguf");
    args.extend([
        "--format".into(),
        "gguf-lora".into(),
        "--ollama".into(),
        "--ollama-from".into(),
        base.display().to_string(),
    ]);
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let sub = dir.path().join("lora");
    std::fs::create_dir_all(&sub).unwrap();
    export(&a, &sub.join("a.gguf"));
    let m = std::fs::read_to_string(sub.join("Modelfile")).unwrap();
    assert!(
        m.starts_with(&format!(
            "FROM {}\nADAPTER ./a.gguf\nTEMPLATE",
            base.display()
        )),
        "{m}"
    );
}

#[test]
fn refusals_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.gguf");
    std::fs::write(&out, b"mine").unwrap();
    let mut args = tiny_adapter_args();
    args.extend([
        "--format".into(),
        "gguf".into(),
        "--out".into(),
        out.display().to_string(),
    ]);
    bin().arg("export").args(&args).assert().failure();
    assert_eq!(std::fs::read(&out).unwrap(), b"mine");
    // --quant with safetensors: a usage error (exit 2)
    let mut args = tiny_adapter_args();
    args.extend([
        "--quant".into(),
        "q8_0".into(),
        "--out".into(),
        dir.path().join("m").display().to_string(),
    ]);
    bin().arg("export").args(&args).assert().code(2);
    // a k-quant LoRA, gguf-lora --ollama without --ollama-from
    for extra in [vec!["--quant", "q4_k_m"], vec!["--ollama"]] {
        let mut args = tiny_adapter_args();
        args.extend([
            "--format".into(),
            "gguf-lora".into(),
            "--out".into(),
            dir.path().join("l.gguf").display().to_string(),
        ]);
        args.extend(extra.iter().map(|s| s.to_string()));
        bin().arg("export").args(&args).assert().failure();
    }
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["x.gguf"]);
}
