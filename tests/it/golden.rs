//! Our f32 CPU numbers against transformers + PEFT (float64 references written by
//! scripts/reference_peft.py into tests/fixtures/golden): logits, loss, every LoRA gradient,
//! and the adapter after 4 AdamW steps with clipping and a warmup-cosine schedule.

use crate::common::Session;
use crate::common::*;
use lora_train::export::adapter_keys;
use lora_train::model::Keep;
use lora_train::train::driver;
use lora_train::train::optim::Grads;

const RTOL: f64 = 1e-4;
/// Absolute slack for entries near zero, as a fraction of the tensor's largest entry.
const ATOL: f64 = 1e-6;

/// How closely a run must match: elementwise for f32, relative L2 for bf16.
#[derive(Clone, Copy)]
pub enum Tol {
    F32,
    /// The largest relative L2 error a tensor may have (the CUDA bf16 goldens; QLoRA
    /// quantized by a different backend than the reference's).
    Bf16(f64),
    /// f32 at a relative L2 error per tensor, the loss at `RTOL`: a fixture whose entries sit
    /// near zero at f32's noise (gpt_oss on CUDA).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    F32L2(f64),
}

impl Tol {
    fn check(self, what: &str, got: &candle_core::Tensor, want: &candle_core::Tensor) {
        match self {
            Tol::F32 => assert_close(what, got, want, RTOL, ATOL),
            Tol::Bf16(bound) | Tol::F32L2(bound) => assert_rel_l2(what, got, want, bound),
        }
    }
    /// `check` with `slack` more absolute error allowed (f32 only).
    fn check_with(
        self,
        what: &str,
        got: &candle_core::Tensor,
        want: &candle_core::Tensor,
        slack: f64,
    ) {
        match self {
            Tol::F32 => {
                let scale = host_f32(want)
                    .iter()
                    .fold(0f64, |m, v| m.max(v.abs() as f64));
                assert_close(what, got, want, RTOL, ATOL + slack / scale.max(1e-30))
            }
            Tol::Bf16(_) | Tol::F32L2(_) => self.check(what, got, want),
        }
    }
    fn scalar(self) -> f64 {
        match self {
            Tol::F32 | Tol::F32L2(_) => RTOL,
            Tol::Bf16(_) => 2e-2,
        }
    }
}

fn check_case(case: &str) {
    check_case_on(case, &[], Tol::F32);
}

/// The largest absolute difference between two tensors of one shape.
fn max_abs(got: &candle_core::Tensor, want: &candle_core::Tensor) -> f64 {
    host_f32(got)
        .iter()
        .zip(host_f32(want))
        .fold(0f64, |m, (a, b)| m.max((*a as f64 - b as f64).abs()))
}

/// The golden checks with extra recipe settings (e.g. the device and dtype); the largest
/// absolute difference of the trained adapter's entries from the reference's.
pub fn check_case_on(case: &str, sets: &[&str], tol: Tol) -> f64 {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let r = recipe(tmp.path(), &golden_recipe(case, &out), sets);
    let s = Session::new(r).unwrap();
    let want = load_st(&golden_dir(case).join("golden.safetensors"));
    let expected = check_first_step(case, &s, &want, tol);
    trained_within(case, &s, &out, &want, (expected, tol))
}

/// Batch 0's logits, loss and every adapter gradient against the golden's; the number of
/// PEFT parameters.
fn check_first_step(
    case: &str,
    s: &Session,
    want: &std::collections::HashMap<String, candle_core::Tensor>,
    tol: Tol,
) -> usize {
    // Batch 0 = rows 0 and 1 of train.jsonl, as the reference's first forward.
    let batch = s.batch(&[vec![0], vec![1]]);
    let logits = driver::logits(&s.model, &batch).unwrap();
    tol.check(&format!("{case} logits"), &logits, &want["logits"]);

    let mut grads = Grads::new();
    let n = batch.n_targets() as f64;
    // the default: on CUDA each layer's residual goes through host memory
    let keep = Keep::new(false.into(), None, s.model.device.is_cuda());
    let ce = driver::forward_backward(&s.model, &batch, n, keep, None, &mut grads).unwrap();
    let loss = want["loss"].to_vec1::<f32>().unwrap()[0] as f64;
    assert!(
        ((ce / n) - loss).abs() <= tol.scalar() * loss.abs(),
        "{case} loss {} vs {loss}",
        ce / n
    );
    let mut checked = 0;
    for (module, lora) in s.model.adapters() {
        for (key, var) in adapter_keys(module, lora) {
            let g = grads
                .get(&var.id())
                .unwrap_or_else(|| panic!("{case}: no grad for {key}"));
            tol.check(
                &format!("{case} grad {key}"),
                g,
                &want[&format!("grad.{key}")],
            );
            checked += 1;
        }
    }
    let expected = want.keys().filter(|k| k.starts_with("grad.")).count();
    assert_eq!(
        checked, expected,
        "{case}: every PEFT parameter has a gradient"
    );
    expected
}

/// The golden's AdamW steps over train.jsonl in file order into `out`, then the saved adapter
/// against the golden's (`expected` tensors, at `tol`): the largest absolute difference.
fn trained_within(
    case: &str,
    s: &Session,
    out: &std::path::Path,
    want: &std::collections::HashMap<String, candle_core::Tensor>,
    (expected, tol): (usize, Tol),
) -> f64 {
    // 4 AdamW steps over train.jsonl in file order, then the saved adapter.
    let summary = s.train(out).unwrap();
    let losses = want["train_losses"].to_vec1::<f32>().unwrap();
    assert_eq!(summary.losses.len(), losses.len());
    for (i, (a, b)) in summary.losses.iter().zip(&losses).enumerate() {
        assert!(
            (a - *b as f64).abs() <= tol.scalar() * (*b as f64).abs(),
            "{case} step {i} loss {a} vs {b}"
        );
    }
    let saved = load_st(&out.join("adapter_model.safetensors"));
    assert_eq!(saved.len(), expected);
    // Adam's update m̂/(√v̂+ε) is scale-free: an entry whose gradient nearly cancels moves by up
    // to lr per step whatever its size, so f32 rounding in its gradient (~1e-5 relative after
    // the reductions) can shift it by ~1e-5·lr per step. That slack comes on top of the
    // elementwise tolerance: steps · lr · 1e-5 (2e-7 for the 4 steps at lr 5e-3 here).
    let adam_slack = summary.steps as f64 * s.run.optim.lr * 1e-5;
    let mut worst = 0f64;
    for (key, t) in &saved {
        let want = &want[&format!("after.{key}")];
        tol.check_with(&format!("{case} trained {key}"), t, want, adam_slack);
        worst = worst.max(max_abs(t, want));
    }
    worst
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

#[test]
fn golden_llama32_tied_llama3_rope_past_original_positions() {
    check_case("llama32_tied_long");
}

#[test]
fn golden_qwen3_qk_norm_explicit_head_dim_tied() {
    check_case("qwen3_qk_norm");
}

#[test]
fn golden_gemma2_softcaps_sandwich_norms_alternating_window() {
    check_case("gemma2_softcap");
}

#[test]
fn golden_gemma3_qk_norm_local_global_ropes() {
    check_case("gemma3_local_global");
}

#[test]
fn golden_phi3_fused_projections_longrope_window() {
    check_case("phi3_fused_longrope");
}

/// Qwen3-MoE: 8 experts, top-2 renormalised, routing that leaves an expert idle in each
/// layer; LoRA on the attention and on both fused expert parameters (PEFT's target_parameters).
#[test]
fn golden_qwen3_moe_experts_lora_top2() {
    check_case("qwen3_moe");
}

/// gpt-oss (scripts/reference_gpt_oss.py, transformers eager + PEFT): attention sinks, a
/// sliding (window 4) and a full layer, YaRN rope, q/k/v/o and expert biases, the clamped
/// SwiGLU with its clamps biting on gate and up, the biased top-2-softmax router leaving an
/// expert idle per layer; LoRA on the attention and both expert parameters; 6 AdamW steps.
#[test]
fn golden_gpt_oss_sinks_window_yarn_clamped_experts() {
    let worst = check_case_on("gpt_oss", &[], Tol::F32);
    assert!(worst <= 2e-5, "gpt_oss: trained adapter off by {worst:e}");
}

/// gpt-oss with its experts in MXFP4 as the Hub stores them (scripts/reference_gpt_oss_mxfp4.py:
/// u8 blocks and e8m0 scales, config.json's quant_method "mxfp4"), against PEFT over
/// transformers' dequantized model: batch 0's logits, loss and gradients at the golden
/// tolerance; and the same run from the unquantized copy (bf16/) ends with the very same
/// adapter, bit for bit. The 6 steps' adapter is held at PEFT's own f32 error on this fixture:
/// transformers 5.17 + PEFT in f32 ends 1.0e-4 from its float64 reference (layer 0's gate_up A,
/// an entry whose gradient nearly cancels: Adam's step is scale-free there), ours 3.4e-5.
#[test]
fn golden_gpt_oss_mxfp4_experts_read_as_the_hub_stores_them() {
    let case = "gpt_oss_mxfp4";
    let want = load_st(&golden_dir(case).join("golden.safetensors"));
    let trained = |sets: &[&str], first_step: bool| {
        let (tmp, s) = golden_session(case, sets);
        if first_step {
            check_first_step(case, &s, &want, Tol::F32);
        }
        let out = tmp.path().join("run");
        s.train(&out).unwrap();
        load_st(&out.join("adapter_model.safetensors"))
    };
    let from_mxfp4 = trained(&[], true);
    let mut worst = 0f64;
    for (key, t) in &from_mxfp4 {
        worst = worst.max(max_abs(t, &want[&format!("after.{key}")]));
    }
    assert!(worst <= 1e-4, "{case}: trained adapter off by {worst:e}");
    let plain = golden_dir(case).join("bf16");
    let from_plain = trained(&[&format!("model.path={}", plain.display())], false);
    assert_eq!(from_mxfp4.len(), from_plain.len());
    for (k, t) in &from_mxfp4 {
        assert_eq!(max_abs(t, &from_plain[k]), 0.0, "{k}");
    }
}

/// The same with the routers' load-balancing loss on (train.router_aux_loss_coef = 0.05, as
/// transformers with output_router_logits and the attention mask), top-k not renormalised,
/// LoRA on q, v and the experts' gate_up_proj alone.
#[test]
fn golden_qwen3_moe_router_aux_loss() {
    check_case_on(
        "qwen3_moe_aux",
        &["train.router_aux_loss_coef=0.05"],
        Tol::F32,
    );
}

/// The bf16 bound of a case: 5e-2 relative L2, or 1.5× the worst error transformers + PEFT
/// itself makes on that case in bf16 (gradients or trained adapter, measured on an H200 by
/// scripts/peft_bf16_error.py) where that is larger: a bf16 run cannot be held closer to the
/// float64 reference than the reference's own library gets in bf16, and which tensor rounds
/// worst differs between two bf16 runs (ours and PEFT's worst tensors are not the same one).
#[cfg(feature = "cuda")]
pub fn bf16_bound(case: &str) -> f64 {
    let path = root().join("tests/fixtures/golden/peft_bf16_error.json");
    let text = std::fs::read_to_string(&path).expect("peft_bf16_error.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("peft_bf16_error.json parses");
    let e = &v["cases"][case];
    let peft = ["grad", "trained"]
        .iter()
        .map(|k| {
            e[k].as_f64()
                .unwrap_or_else(|| panic!("{case}.{k} in {path:?}"))
        })
        .fold(0f64, f64::max);
    (1.5 * peft).max(5e-2)
}

/// The same golden checks on the GPU: f32 at rtol 1e-4, bf16 at `bf16_bound`. Every case
/// runs; the failures are listed together at the end.
#[cfg(feature = "cuda")]
#[test]
fn golden_on_cuda_f32_and_bf16() {
    let mut failed = Vec::new();
    for case in [
        "llama_gqa",
        "llama_mha_tied_rope3",
        "qwen2_bias",
        "mistral_head_dim",
        "tiny_shipped",
        "llama32_tied_long",
        "qwen3_qk_norm",
        "gemma2_softcap",
        "gemma3_local_global",
        "phi3_fused_longrope",
        "qwen3_moe",
        "qwen3_moe_aux",
        "gpt_oss",
    ] {
        for dtype in ["model.dtype=f32", "model.dtype=bf16"] {
            let mut sets = vec!["model.device=cuda", dtype];
            if case == "qwen3_moe_aux" {
                sets.push("train.router_aux_loss_coef=0.05");
            }
            // a case without PEFT's bf16 figure (scripts/device_gpu_check.sh bf16err) fails alone
            let run = std::panic::catch_unwind(|| {
                let tol = match dtype {
                    // the bound holds below (the trained adapter within 2e-5); this
                    // fixture's logits reach 2e-5 at scale 1.9, where the elementwise check's
                    // atol (1e-6 of the scale) is f32's noise: the CPU sits at 0.84 of it, the
                    // first CUDA run (2026-12-07) at 1.22 on one logit
                    "model.dtype=f32" if case == "gpt_oss" => Tol::F32L2(1e-5),
                    "model.dtype=f32" => Tol::F32,
                    _ => Tol::Bf16(bf16_bound(case)),
                };
                let worst = check_case_on(case, &sets, tol);
                if let Tol::F32L2(_) = tol {
                    assert!(worst <= 2e-5, "{case}: trained adapter off by {worst:e}");
                }
            });
            if let Err(e) = run {
                let msg = lora_train::util::panic_message(&*e);
                failed.push(format!("{case} {dtype}: {msg}"));
            }
        }
    }
    assert!(
        failed.is_empty(),
        "{} failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}
