//! Our f32 CPU numbers against transformers + PEFT (float64 references written by
//! scripts/reference_peft.py into tests/fixtures/golden): logits, loss, every LoRA gradient,
//! and the adapter after 4 AdamW steps with clipping and a warmup-cosine schedule.

use crate::common::*;
use lora_train::export::peft_key;
use lora_train::train::{driver, optim::Grads, Session};

const RTOL: f64 = 1e-4;
/// Absolute slack for entries near zero, as a fraction of the tensor's largest entry.
const ATOL: f64 = 1e-6;

fn check_case(case: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let r = recipe(tmp.path(), &golden_recipe(case, &out), &[]);
    let s = Session::new(r).unwrap();
    let want = load_st(&golden_dir(case).join("golden.safetensors"));

    // Batch 0 = rows 0 and 1 of train.jsonl, as the reference's first forward.
    let batch = s.batch(&[vec![0], vec![1]]);
    let logits = driver::logits(&s.model, &batch).unwrap();
    assert_close(
        &format!("{case} logits"),
        &logits,
        &want["logits"],
        RTOL,
        ATOL,
    );

    let mut grads = Grads::new();
    let n = batch.n_targets() as f64;
    let ce = driver::forward_backward(&s.model, &batch, n, false, None, &mut grads).unwrap();
    let loss = want["loss"].to_vec1::<f32>().unwrap()[0] as f64;
    assert!(
        ((ce / n) - loss).abs() <= RTOL * loss.abs(),
        "{case} loss {} vs {loss}",
        ce / n
    );
    let mut checked = 0;
    for (module, lora) in s.model.adapters() {
        for (w, var) in [('A', &lora.a), ('B', &lora.b)] {
            let key = peft_key(module, w);
            let g = grads
                .get(&var.id())
                .unwrap_or_else(|| panic!("{case}: no grad for {key}"));
            assert_close(
                &format!("{case} grad {key}"),
                g,
                &want[&format!("grad.{key}")],
                RTOL,
                ATOL,
            );
            checked += 1;
        }
    }
    let expected = want.keys().filter(|k| k.starts_with("grad.")).count();
    assert_eq!(
        checked, expected,
        "{case}: every PEFT parameter has a gradient"
    );

    // 4 AdamW steps over train.jsonl in file order, then the saved adapter.
    let summary = s.train(&out).unwrap();
    let losses = want["train_losses"].to_vec1::<f32>().unwrap();
    assert_eq!(summary.losses.len(), losses.len());
    for (i, (a, b)) in summary.losses.iter().zip(&losses).enumerate() {
        assert!(
            (a - *b as f64).abs() <= RTOL * (*b as f64).abs(),
            "{case} step {i} loss {a} vs {b}"
        );
    }
    let saved = load_st(&out.join("adapter_model.safetensors"));
    assert_eq!(saved.len(), expected);
    for (key, t) in &saved {
        assert_close(
            &format!("{case} trained {key}"),
            t,
            &want[&format!("after.{key}")],
            RTOL,
            ATOL,
        );
    }
}

#[test]
fn golden_llama_gqa_untied_sharded() {
    check_case("llama_gqa");
}

#[test]
fn golden_llama_mha_tied_llama3_rope_rslora() {
    check_case("llama_mha_tied_rope3");
}

#[test]
fn golden_qwen2_qkv_bias_one_kv_head() {
    check_case("qwen2_bias");
}

#[test]
fn golden_mistral_explicit_head_dim() {
    check_case("mistral_head_dim");
}

#[test]
fn golden_shipped_tiny_model() {
    check_case("tiny_shipped");
}
