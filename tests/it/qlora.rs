//! QLoRA against transformers + PEFT + bitsandbytes: `scripts/reference_qlora.py` quantized each
//! case's f32 base to NF4 (double quant) with bitsandbytes 0.50.2 on the CPU, saved it as a
//! 4-bit checkpoint (model_bnb4/, as the Hub's `*-bnb-4bit` repositories hold them), and ran
//! PEFT on it in f32: the forward, the gradients and 4 AdamW steps (golden.safetensors), with
//! the weights it computed with (`dequant.*`).

use super::common::*;
use super::golden::{check_case_on, Tol};
use candle_core::{DType, Device};
use lora_train::hub::ModelFiles;
use lora_train::lora::LoraSpec;
use lora_train::model::Model;

const CASES: [&str; 2] = ["qlora_llama_gqa", "qlora_qwen2_bias"];

/// A case's base loaded on the CPU in f32 from `dir` (its own, or model_bnb4/), NF4 where
/// `nf4` asks (quantized as it loads); no adapters.
fn load(case: &str, dir: &str, nf4: bool) -> Model {
    let files = ModelFiles::local(&golden_dir(case).join(dir)).unwrap();
    let spec = LoraSpec {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        rslora: false,
        targets: Vec::new(),
    };
    let quant = lora_train::quant::Quant {
        kind: match nf4 {
            true => lora_train::quant::Quantize::Nf4,
            false => lora_train::quant::Quantize::None,
        },
        double_quant: true,
    };
    let quant = quant.for_checkpoint(&files.config).unwrap();
    let kernels = lora_train::ops::Kernels::resolve(&Device::Cpu, DType::F32, 16, false).unwrap();
    let solo = lora_train::parallel::Solo;
    let (m, _) =
        lora_train::train::session::sharded_model(false, quant, &solo, &kernels, &mut |l| {
            Model::load_with(&files, DType::F32, &Device::Cpu, &spec, 0, &kernels, l)
        })
        .unwrap();
    m
}

/// Each linear of the model as it computes (dequantized), against bitsandbytes' `dequant.*`:
/// (elements that differ, elements, relative L2 error over all of them).
fn differ_from_bitsandbytes(case: &str, m: &Model) -> (usize, usize, f64) {
    let want = load_st(&golden_dir(case).join("golden.safetensors"));
    let (mut bad, mut all, mut err, mut norm) = (0, 0, 0f64, 0f64);
    for layer in &m.layers {
        let layer = layer.resident().unwrap();
        for lin in layer.linears() {
            let w = &want[&format!("dequant.{}.weight", lin.name)];
            assert_eq!(lin.w.dims(), w.dims(), "{}", lin.name);
            for (a, b) in host_f32(&lin.w).into_iter().zip(host_f32(w)) {
                bad += (a.to_bits() != b.to_bits()) as usize;
                err += (a as f64 - b as f64).powi(2);
                norm += (b as f64).powi(2);
                all += 1;
            }
        }
    }
    (bad, all, (err / norm.max(f64::MIN_POSITIVE)).sqrt())
}

/// A bitsandbytes 4-bit checkpoint loads as it is: every linear in NF4 (none in full
/// precision), dequantized to bitsandbytes' own weights bit for bit.
#[test]
fn a_bnb_4bit_checkpoint_dequantizes_to_bitsandbytes_weights() {
    for case in CASES {
        let m = load(case, "model_bnb4", false);
        let lins: Vec<_> = m.layers.iter().flat_map(|l| l.linears()).collect();
        assert!(
            lins.iter().all(|l| l.q.is_some() && l.w.elem_count() == 1),
            "{case}"
        );
        let (bad, all, _) = differ_from_bitsandbytes(case, &m);
        assert!(all > 0);
        assert_eq!(bad, 0, "{case}: {bad} of {all} weights differ");
    }
}

/// On the 4-bit checkpoint, the forward, the loss, every adapter gradient and the adapter after
/// 4 AdamW steps equal PEFT + bitsandbytes' at the f32 golden tolerance (rtol 1e-4).
#[test]
fn qlora_on_a_bnb_4bit_checkpoint_equals_peft_bitsandbytes() {
    for case in CASES {
        let dir = golden_dir(case).join("model_bnb4");
        let set = format!("model.path={}", dir.display());
        check_case_on(case, &[&set], Tol::F32);
    }
}

/// Quantized as it loads (`model.quantize = "nf4"`) from the f32 base. Our codes are
/// bitsandbytes' CUDA ones; its CPU backend's (the fixture's) part from them where
/// src/quant/nf4.rs says: the double-quant offset is a mean whose last bit depends on the sum's
/// order (a one-ulp shift of a whole weight's absmax), and its 8-bit step is a lookup table (a
/// block's absmax one code off). So the weights agree to about 1e-3 (relative L2), and the run
/// to PEFT + bitsandbytes' within 1e-2.
#[test]
fn qlora_quantized_at_load_is_peft_bitsandbytes_within_its_backends() {
    for case in CASES {
        let m = load(case, "model", true);
        let (bad, all, rel) = differ_from_bitsandbytes(case, &m);
        eprintln!("{case}: {bad} of {all} weights differ from bitsandbytes' CPU backend, relative L2 {rel:.2e}");
        assert!(
            rel <= 1e-3,
            "{case}: relative L2 {rel:.2e} from bitsandbytes' weights"
        );
        check_case_on(case, &["model.quantize=nf4"], Tol::Bf16(1e-2));
    }
}
