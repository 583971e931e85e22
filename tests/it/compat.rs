//! tests/fixtures/compat: an adapter we trained on the tiny model, our merged checkpoint of
//! it, token ids and our CPU logits, for scripts/check_peft_compat.py to compare against PEFT
//! and transformers on a machine with torch. This test checks that the fixture still is what
//! our code produces; `LORA_TRAIN_REGEN_COMPAT=1 cargo test --test it compat` rewrites it.

use crate::common::*;
use assert_cmd::Command;
use candle_core::{DType, Device, Tensor};
use lora_train::export::{load_adapter_weights, read_adapter_config};
use lora_train::hub::ModelFiles;
use lora_train::lora::LoraSpec;
use lora_train::model::Model;
use std::collections::HashMap;
use std::path::Path;

const BASE: &str = "recipes/assets/tiny-llama";
const ROWS: usize = 2;
const COLS: usize = 16;

fn fixture() -> std::path::PathBuf {
    root().join("tests/fixtures/compat")
}

/// Logits [B, T, V] of `ids` [B, T] (no padding): the base with `adapter`, or a plain model.
fn logits(model_dir: &Path, adapter: Option<&Path>, ids: &Tensor) -> Tensor {
    let spec = match adapter {
        Some(a) => read_adapter_config(a).unwrap().spec,
        None => LoraSpec {
            rank: 1,
            alpha: 1.0,
            dropout: 0.0,
            rslora: false,
            dora: false,
            targets: vec![],
        },
    };
    let files = ModelFiles::local(model_dir).unwrap();
    let m = Model::load(&files, DType::F32, &Device::Cpu, &spec, 0).unwrap();
    if let Some(a) = adapter {
        load_adapter_weights(a, &m).unwrap();
    }
    let (b, t) = ids.dims2().unwrap();
    let positions: Vec<u32> = (0..b).flat_map(|_| 0..t as u32).collect();
    let ctx = m.ctx(&positions, b, t, None, None).unwrap();
    m.forward(&ids.to_dtype(DType::U32).unwrap(), &ctx).unwrap()
}

fn run(args: &[&str]) {
    let o = Command::cargo_bin("lora-train")
        .unwrap()
        .current_dir(root())
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Trains the adapter with the CLI, merges it with `export`, and stores ids and logits.
fn regenerate(dir: &Path) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    run(&[
        "--recipe",
        "recipes/tiny-cpu.toml",
        "--set",
        &format!("output.dir={}", out.display()),
        "--set",
        "train.max_steps=60",
        "--set",
        "output.save_every=0",
    ]);
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir.join("adapter")).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(out.join(f), dir.join("adapter").join(f)).unwrap();
    }
    let adapter = dir.join("adapter");
    run(&[
        "export",
        "--adapter",
        &adapter.to_string_lossy(),
        "--out",
        &dir.join("merged").to_string_lossy(),
        "--max-shard-size",
        "300KB",
    ]);
    let mut rng = lora_train::rng::Rng::new(7);
    let ids: Vec<i64> = (0..ROWS * COLS)
        .map(|_| 3 + rng.below(509) as i64)
        .collect();
    let ids = Tensor::from_vec(ids, (ROWS, COLS), &Device::Cpu).unwrap();
    let base = root().join(BASE);
    let tensors = HashMap::from([
        ("logits".to_string(), logits(&base, Some(&adapter), &ids)),
        (
            "logits_merged".to_string(),
            logits(&dir.join("merged"), None, &ids),
        ),
        ("input_ids".to_string(), ids),
    ]);
    candle_core::safetensors::save(&tensors, dir.join("logits.safetensors")).unwrap();
}

#[test]
fn compat_fixture_is_our_adapter_our_merge_and_our_logits() {
    let dir = fixture();
    if std::env::var("LORA_TRAIN_REGEN_COMPAT").is_ok_and(|v| v == "1") {
        regenerate(&dir);
    }
    assert!(
        dir.join("logits.safetensors").is_file(),
        "{} is missing: LORA_TRAIN_REGEN_COMPAT=1 cargo test --test it compat",
        dir.display()
    );
    let want = load_st(&dir.join("logits.safetensors"));
    let ids = &want["input_ids"];
    assert_eq!(ids.dims(), [ROWS, COLS]);
    assert_eq!(ids.dtype(), DType::I64);
    let adapter = dir.join("adapter");
    let base = root().join(BASE);
    let info = read_adapter_config(&adapter).unwrap();
    assert_eq!(info.base_model.as_deref(), Some(BASE));
    assert_eq!(info.spec.targets.len(), 7);

    // Our forward today gives the stored logits, with the adapter and through the merge.
    let lora = logits(&base, Some(&adapter), ids);
    assert_close("base + adapter", &lora, &want["logits"], 1e-5, 1e-6);
    let merged = logits(&dir.join("merged"), None, ids);
    assert_close("merged", &merged, &want["logits_merged"], 1e-5, 1e-6);
    assert_close("merged vs adapter", &merged, &want["logits"], 1e-5, 1e-6);
    // ... and the adapter matters: the base alone is off by more than the tolerances.
    let plain = logits(&base, None, ids);
    let d = max_abs_diff(&plain, &want["logits"]);
    assert!(d > 1e-2, "the adapter moves the logits by only {d}");

    // The stored merged checkpoint is what `export` writes for this adapter today.
    let tmp = tempfile::tempdir().unwrap();
    let again = tmp.path().join("merged");
    run(&[
        "export",
        "--adapter",
        &adapter.to_string_lossy(),
        "--out",
        &again.to_string_lossy(),
        "--max-shard-size",
        "300KB",
    ]);
    let mut names: Vec<String> = std::fs::read_dir(dir.join("merged"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(names.len() > 5, "{names:?}");
    for n in &names {
        let (a, b) = (dir.join("merged").join(n), again.join(n));
        if n.ends_with(".safetensors") {
            let (x, y) = (load_st(&a), load_st(&b));
            assert_eq!(x.len(), y.len(), "{n}");
            for (k, t) in &x {
                assert_close(&format!("{n} {k}"), &y[k], t, 1e-6, 1e-7);
            }
        } else {
            assert_eq!(
                std::fs::read(&a).unwrap(),
                std::fs::read(&b).unwrap(),
                "{n}"
            );
        }
    }
    // Small enough to keep in git.
    let size: u64 = walk(&dir).iter().map(|p| p.metadata().unwrap().len()).sum();
    assert!(size < 2_000_000, "{size} bytes");
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}
