//! DoRA (`lora.use_dora`) against PEFT (scripts/reference_dora.py): logits, loss, the gradients
//! of A, B and the magnitude, and the adapter after 4 AdamW steps, on an f32 base (float64
//! references) and on a bitsandbytes 4-bit one (f32 references); the adapter written with
//! PEFT's keys and `use_dora: true`; the merged export equal to PEFT's merge; exact resume;
//! and what DoRA refuses.

use super::golden::{check_case_on, Tol};
use crate::common::Session;
use crate::common::*;
use candle_core::Tensor;
use lora_train::export::merge::{merge, MergeOptions};
use lora_train::export::{adapter_keys, magnitude_key};
use lora_train::train::driver;
use lora_train::train::optim::Grads;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const F32: &str = "dora_llama_gqa";
const NF4: &str = "dora_qlora_llama_gqa";

/// A case's base directory (meta.json's model_dir, relative to the case).
fn base_dir(case: &str) -> PathBuf {
    let d = golden_dir(case);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("meta.json")).unwrap()).unwrap();
    d.join(meta["model_dir"].as_str().unwrap())
}

/// max |got − want| / max |want|.
fn rel_err(got: &Tensor, want: &Tensor) -> f64 {
    let scale = host_f32(want)
        .iter()
        .fold(0f64, |m, v| m.max(v.abs() as f64));
    max_abs_diff(got, want) as f64 / scale.max(1e-30)
}

/// The worst `rel_err` over the keys of `got` that `want` holds under `prefix` + key.
fn worst(got: &HashMap<String, Tensor>, want: &HashMap<String, Tensor>, prefix: &str) -> f64 {
    got.iter()
        .map(|(k, t)| rel_err(t, &want[&format!("{prefix}{k}")]))
        .fold(0f64, f64::max)
}

#[test]
fn dora_golden_f32_base_equals_peft() {
    check_case_on(F32, &[], Tol::F32);
    // the 4 steps with each layer recomputed in backward (`Layer::recompute`, `fwd_again`)
    check_case_on(F32, &["train.activation_checkpointing=true"], Tol::F32);
}

#[test]
fn dora_golden_bnb_4bit_base_equals_peft_bitsandbytes() {
    check_case_on(NF4, &[], Tol::F32);
}

/// The magnitude's gradient is not zero and the magnitude moves in training (so the golden
/// checks above hold something), and the errors, printed for the record.
#[test]
fn dora_magnitude_is_trained_and_errors_are_small() {
    for case in [F32, NF4] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let s = Session::new(recipe(tmp.path(), &golden_recipe(case, &out), &[])).unwrap();
        let want = load_st(&golden_dir(case).join("golden.safetensors"));
        let batch = s.batch(&[vec![0], vec![1]]);
        let logits = driver::logits(&s.model, &batch).unwrap();
        let mut grads = Grads::new();
        let keep = lora_train::model::Keep::new(false.into(), None, s.model.device.is_cuda());
        let n = batch.n_targets() as f64;
        driver::forward_backward(&s.model, &batch, n, keep, None, &mut grads).unwrap();
        let mut got = HashMap::new();
        for (module, lora) in s.model.adapters() {
            assert!(lora.m.is_some(), "{case}: {module} has no magnitude");
            for (key, var) in adapter_keys(module, lora) {
                got.insert(key, grads[&var.id()].clone());
            }
        }
        let mag = magnitude_key("model.layers.0.self_attn.q_proj");
        let dm = host_f32(&want[&format!("grad.{mag}")]);
        assert!(dm.iter().any(|v| v.abs() > 1e-4), "{case}: PEFT's dm is ~0");
        let g = worst(&got, &want, "grad.");
        s.train(&out).unwrap();
        let saved = load_st(&out.join("adapter_model.safetensors"));
        let init = load_st(&golden_dir(case).join("init_adapter/adapter_model.safetensors"));
        let moved = max_abs_diff(&saved[&mag], &init[&mag]);
        assert!(moved > 1e-3, "{case}: m moved by only {moved}");
        let t = worst(&saved, &want, "after.");
        let l = rel_err(&logits, &want["logits"]);
        eprintln!("{case}: max rel err logits {l:.2e}, gradients {g:.2e}, trained {t:.2e}");
        assert!(l < 1e-4 && g < 1e-4 && t < 1e-4, "{case}: {l} {g} {t}");
    }
}

/// Trains `case` for its 4 steps into `out`.
fn train(case: &str, dir: &Path, out: &Path, sets: &[&str]) -> Session {
    std::fs::create_dir_all(dir).unwrap();
    let s = Session::new(recipe(dir, &golden_recipe(case, out), sets)).unwrap();
    s.train(out).unwrap();
    s
}

/// Each adapted linear of `merged` (a merged export) against the golden's `merged.*`, at
/// `rtol` and `atol` (a fraction of the largest entry).
fn check_merged(case: &str, merged: &Path, rtol: f64, atol: f64) -> f64 {
    let want = load_st(&golden_dir(case).join("golden.safetensors"));
    let got = load_st(&merged.join("model.safetensors"));
    let mut worst = 0f64;
    let mut n = 0;
    for (k, w) in want.iter().filter(|(k, _)| k.starts_with("merged.")) {
        let name = &k["merged.".len()..];
        assert_close(&format!("{case} {name}"), &got[name], w, rtol, atol);
        worst = worst.max(rel_err(&got[name], w));
        n += 1;
    }
    assert_eq!(n, 14, "{case}: two layers × seven linears merged");
    worst
}

#[test]
fn dora_adapter_has_peft_keys_and_merges_as_peft() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    train(F32, tmp.path(), &out, &[]);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["use_dora"], serde_json::Value::Bool(true));
    let ours = load_st(&out.join("adapter_model.safetensors"));
    let peft = load_st(&golden_dir(F32).join("after_adapter/adapter_model.safetensors"));
    let mut keys: Vec<&String> = ours.keys().collect();
    let mut want: Vec<&String> = peft.keys().collect();
    keys.sort();
    want.sort();
    assert_eq!(keys, want, "PEFT's keys, m as `.lora_magnitude_vector`");
    assert_eq!(keys.len(), 2 * 7 * 3);

    let opts = MergeOptions::default();
    // PEFT's own trained adapter, merged by us: PEFT's merge_and_unload to f32 rounding
    let m1 = tmp.path().join("merged-peft");
    let rep = merge(
        &golden_dir(F32).join("after_adapter"),
        &base_dir(F32),
        &m1,
        &opts,
    )
    .unwrap();
    assert_eq!(rep.merged, 14);
    let e1 = check_merged(F32, &m1, 1e-5, 1e-7);
    // ours: trained to PEFT's adapter at rtol 1e-4 (plus Adam's slack near zero, as the
    // golden checks allow), so merged to the same
    let m2 = tmp.path().join("merged-ours");
    merge(&out, &base_dir(F32), &m2, &opts).unwrap();
    let e2 = check_merged(F32, &m2, 1e-4, 1e-6);
    eprintln!("{F32} merged: PEFT's adapter {e1:.2e}, ours {e2:.2e}");
}

#[test]
fn dora_merge_into_a_bnb_4bit_base_is_the_dequantized_merge() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("merged");
    let opts = MergeOptions::default();
    let rep = merge(
        &golden_dir(NF4).join("after_adapter"),
        &base_dir(NF4),
        &m,
        &opts,
    )
    .unwrap();
    assert_eq!(rep.merged, 7);
    let want = load_st(&golden_dir(NF4).join("golden.safetensors"));
    let got = load_st(&m.join("model.safetensors"));
    let mut n = 0;
    for (k, w) in want.iter().filter(|(k, _)| k.starts_with("merged.")) {
        let name = &k["merged.".len()..];
        assert_close(&format!("{NF4} {name}"), &got[name], w, 1e-5, 1e-7);
        n += 1;
    }
    assert_eq!(n, 7);
}

#[test]
fn a_dora_run_stopped_and_resumed_is_bit_identical() {
    use lora_train::run::checkpoint;
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let sets = ["output.save_every=2"];
    train(F32, &tmp.path().join("ra"), &a, &sets);
    // the optimiser file holds Adam's two moments of A, B and m of every adapter
    let opt = load_st(&a.join("checkpoint-4/optimizer.safetensors"));
    assert_eq!(opt.len(), 2 * 3 * 14);
    let mag = magnitude_key("model.layers.1.mlp.down_proj");
    assert!(opt.contains_key(&format!("{mag}.exp_avg_sq")));

    let dir = tmp.path().join("rb");
    std::fs::create_dir_all(&dir).unwrap();
    let s = Session::new(recipe(&dir, &golden_recipe(F32, &b), &sets)).unwrap();
    assert!(
        s.train_from(&b, None, &|s| s == 2).is_err(),
        "stopped at step 2"
    );
    let sets = ["output.save_every=2", "train.resume=true"];
    let r = recipe(&dir, &golden_recipe(F32, &b), &sets);
    let ck = checkpoint::resume_point(&r, &b).unwrap().unwrap();
    assert_eq!(ck.dir, b.join("checkpoint-2"));
    Session::new(r).unwrap().train(&b).unwrap();
    for f in [
        "adapter_model.safetensors",
        "checkpoint-4/optimizer.safetensors",
    ] {
        let (x, y) = (
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(b.join(f)).unwrap(),
        );
        assert!(x == y, "{f} differs after the resume");
    }
}

#[test]
fn dora_refuses_dropout_fsdp_sampling_a_plain_init_adapter_and_unmerged_generate() {
    use lora_train::recipe::{Recipe, RecipeError};
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("recipe.toml");
    let plain = golden_recipe("llama_gqa", &tmp.path().join("o"));
    std::fs::write(&p, &plain).unwrap();
    let load = |sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        Recipe::load(&p, &sets)
    };
    for (set, want) in [
        (
            "lora.dropout=0.1",
            "set lora.dropout = 0, or use_dora = false",
        ),
        (
            "parallel.strategy=fsdp",
            "use strategy = \"ddp\", or use_dora = false",
        ),
        (
            "train.sample_every=2",
            "set sample_every = 0 and generate from the merged export",
        ),
    ] {
        let e = load(&["lora.use_dora=true", set]).unwrap_err();
        let RecipeError::Invalid { key, msg, .. } = &e else {
            panic!("{set}: {e}")
        };
        assert_eq!(key, "lora.use_dora", "{set}");
        assert!(msg.contains(want), "{set}: {msg}");
    }
    // use_dora on llama_gqa's plain init adapter: its config decides, so this is an error
    let r = load(&["lora.use_dora=true"]).unwrap();
    let e = format!("{:#}", Session::new(r).err().unwrap());
    assert!(
        e.contains("says use_dora = false (a plain LoRA adapter)"),
        "{e}"
    );
    // a DoRA adapter under dropout, though the recipe does not say use_dora
    std::fs::write(&p, golden_recipe(F32, &tmp.path().join("o"))).unwrap();
    let e = format!(
        "{:#}",
        Session::new(load(&["lora.dropout=0.1"]).unwrap())
            .err()
            .unwrap()
    );
    assert!(e.contains("lora.init_adapter is a DoRA adapter"), "{e}");
    assert!(e.contains("set lora.dropout = 0"), "{e}");

    let ad = golden_dir(F32).join("after_adapter");
    let dev = candle_core::Device::Cpu;
    let base = base_dir(F32);
    let e = lora_train::generate::load::from_dirs(
        Some(&base),
        Some(&ad),
        &dev,
        candle_core::DType::F32,
    )
    .err()
    .unwrap();
    assert!(
        format!("{e:#}").contains("lora-train export --adapter"),
        "{e:#}"
    );
}
