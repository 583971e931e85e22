//! An adapter for another base (issue 63, class 6): one with a layer more than the base has
//! (tensors of layer 2 beside the tiny Llama's layers 0 and 1) is refused by every consumer —
//! `generate --adapter`, `lora.init_adapter`, a resume from a checkpoint, `export` (merged and
//! GGUF LoRA) — with the one message of `export::adapter_check::against_base`, and nothing
//! written.

use crate::common::{copy_dir, root};
use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BASE: &str = "recipes/assets/tiny-llama";
const ADAPTER: &str = "tests/fixtures/golden/tiny_shipped/init_adapter";

fn bin() -> Command {
    let mut c = Command::new(assert_cmd::cargo::cargo_bin("lora-train"));
    c.current_dir(root());
    c
}

/// The key the check names: the first of the extra layer's, in key order.
const EXTRA: &str = "base_model.model.model.layers.2.mlp.down_proj.lora_A.weight";

/// The message every consumer gives for the adapter file `file`.
fn message(file: &Path) -> String {
    format!(
        "{}: `{EXTRA}` adapts layer 2, but the base (llama, 2 layers, hidden size 64) has \
         layers 0 to 1: the adapter was trained on another model; use the base it was trained \
         on (its adapter_config.json's base_model_name_or_path)",
        file.display()
    )
}

/// Adds to the safetensors file `file` a copy of every layer-1 tensor as layer 2's (an
/// adapter's, or an optimizer state's `.exp_avg` and `.exp_avg_sq`).
fn add_layer(file: &Path) {
    let mut t: HashMap<String, Tensor> =
        candle_core::safetensors::load(file, &Device::Cpu).unwrap();
    let extra: Vec<(String, Tensor)> = t
        .iter()
        .filter(|(k, _)| k.contains(".layers.1."))
        .map(|(k, v)| (k.replace(".layers.1.", ".layers.2."), v.clone()))
        .collect();
    assert!(!extra.is_empty());
    t.extend(extra);
    candle_core::safetensors::save(&t, file).unwrap();
}

/// A copy of the shipped adapter with a layer 2.
fn extra_layer_adapter(tmp: &Path) -> PathBuf {
    let dir = tmp.join("adapter");
    copy_dir(&root().join(ADAPTER), &dir);
    add_layer(&dir.join("adapter_model.safetensors"));
    dir
}

fn refused(o: &Output, file: &Path) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains(&message(file)), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn generate_refuses_an_adapter_with_an_extra_layer() {
    let tmp = tempfile::tempdir().unwrap();
    let a = extra_layer_adapter(tmp.path());
    let o = bin()
        .args(["generate", "--model", BASE, "--adapter"])
        .arg(&a)
        .args(["--prompt", "Once", "--max-new-tokens", "2"])
        .output()
        .unwrap();
    refused(&o, &a.join("adapter_model.safetensors"));
    assert!(o.stdout.is_empty());
}

#[test]
fn init_adapter_refuses_an_adapter_with_an_extra_layer() {
    let tmp = tempfile::tempdir().unwrap();
    let a = extra_layer_adapter(tmp.path());
    let out = tmp.path().join("run");
    let o = bin()
        .args(["train", "--recipe", "recipes/tiny-cpu.toml", "--set"])
        .arg(format!("output.dir={}", out.display()))
        .arg("--set")
        .arg(format!("lora.init_adapter={}", a.display()))
        .args(["--set", "train.max_steps=1"])
        .output()
        .unwrap();
    refused(&o, &a.join("adapter_model.safetensors"));
    assert!(!out.join("adapter_model.safetensors").exists());
}

#[test]
fn export_refuses_an_adapter_with_an_extra_layer_merged_and_as_gguf_lora() {
    let tmp = tempfile::tempdir().unwrap();
    let a = extra_layer_adapter(tmp.path());
    let file = a.join("adapter_model.safetensors");
    for (format, out) in [("safetensors", "merged"), ("gguf-lora", "lora.gguf")] {
        let out = tmp.path().join(out);
        let o = bin()
            .args(["export", "--adapter"])
            .arg(&a)
            .args(["--base", BASE, "--format", format, "--out"])
            .arg(&out)
            .output()
            .unwrap();
        refused(&o, &file);
        assert!(!out.exists(), "{format}");
    }
}

#[test]
fn resume_refuses_a_checkpoint_whose_adapter_has_an_extra_layer() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let ck = out.join("checkpoint-2");
    let train = |resume: String| {
        bin()
            .args(["train", "--recipe", "recipes/tiny-cpu.toml", "--set"])
            .arg(format!("output.dir={}", out.display()))
            .args(["--set", "train.max_steps=4", "--set", "output.save_every=2"])
            .args([
                "--set",
                "train.micro_batch=1",
                "--set",
                "train.grad_accum=1",
            ])
            .arg("--set")
            .arg(format!("train.resume={resume}"))
            .output()
            .unwrap()
    };
    let o = train("false".into());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // A checkpoint of a model with a layer more: its adapter and its optimizer state both.
    add_layer(&ck.join("adapter_model.safetensors"));
    add_layer(&ck.join("optimizer.safetensors"));
    let before = std::fs::read(ck.join("adapter_model.safetensors")).unwrap();
    let final_adapter = std::fs::read(out.join("adapter_model.safetensors")).unwrap();
    let o = train(ck.display().to_string());
    refused(&o, &ck.join("adapter_model.safetensors"));
    assert_eq!(
        std::fs::read(ck.join("adapter_model.safetensors")).unwrap(),
        before
    );
    assert_eq!(
        std::fs::read(out.join("adapter_model.safetensors")).unwrap(),
        final_adapter
    );
}
