//! QLoRA against transformers + PEFT + bitsandbytes: `scripts/reference_qlora.py` quantized each
//! case's f32 base to NF4 (double quant) with bitsandbytes 0.50.2 on the CPU, saved it as a
//! 4-bit checkpoint (model_bnb4/, as the Hub's `*-bnb-4bit` repositories hold them), and ran
//! PEFT on it in f32: the forward, the gradients and 4 AdamW steps (golden.safetensors), with
//! the weights it computed with (`dequant.*`).

use super::common::*;
use super::golden::{check_case_on, Tol};
#[cfg(feature = "cuda")]
use candle_core::Tensor;
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
        dora: false,
        targets: Vec::new(),
    };
    let quant = lora_train::quant::Quant {
        nf4,
        double_quant: true,
    };
    let quant = quant.for_checkpoint(&files.config).unwrap();
    let cfg = lora_train::model::ModelConfig::from_file(&files.config).unwrap();
    let mut b = lora_train::model::Build::new(cfg, DType::F32, &Device::Cpu, &spec, 0).unwrap();
    b.kernels = lora_train::ops::Kernels::resolve(&Device::Cpu, DType::F32, 16, false).unwrap();
    let solo = lora_train::train::Solo;
    let (m, _) =
        lora_train::train::session::sharded_model(false, quant, &solo, &b.kernels, &mut |l| {
            Model::load_with(&files, &b, l)
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

/// On CUDA the kernels quantize and dequantize as the host format does, to the bit (bf16 and f32,
/// both absmax forms, a partial last block, codes 0x00 and 0xff), and QLoRA on the 4-bit
/// checkpoint equals PEFT + bitsandbytes' in f32 at rtol 1e-4 and in bf16 within 5e-2.
#[cfg(feature = "cuda")]
#[test]
fn qlora_on_cuda_quantizes_to_the_bit_and_trains_as_peft() {
    use lora_train::quant::{Nf4, QWeight};
    let gpu = Device::new_cuda(0).unwrap();
    let n = 5 * 64 * 256 + 50;
    let mut w: Vec<f32> = (0..n)
        .map(|i| ((i as f32 * 0.377).cos() * (1.0 + (i % 89) as f32)).powi(3) * 1e-3)
        .collect();
    w[..64]
        .iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v = [1.0, -1.0][i / 2 % 2]);
    for dq in [false, true] {
        let q = Nf4::quantize(&w, &[n], dq);
        let host = Tensor::new(q.dequantize().as_slice(), &Device::Cpu).unwrap();
        let d = QWeight::from_nf4(&q, &gpu).unwrap();
        for dt in [DType::F32, DType::BF16] {
            let want = host_f32(&host.to_dtype(dt).unwrap());
            let got = host_f32(&d.dequantize(dt).unwrap());
            let bad = got
                .iter()
                .zip(&want)
                .filter(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(bad.count(), 0, "double_quant {dq} {dt:?}");
        }
    }
    // Quantized on the GPU (from f32 and from bf16): the host's codes and absmax, so the same
    // values once dequantized.
    for dt in [DType::F32, DType::BF16] {
        let wd = Tensor::new(w.as_slice(), &gpu)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        let exact = host_f32(&wd);
        for dq in [false, true] {
            let want = Nf4::quantize(&exact, &[n], dq).dequantize();
            let q = QWeight::quantize(&wd, dq).unwrap();
            let got = host_f32(&q.dequantize(DType::F32).unwrap());
            let bad = got
                .iter()
                .zip(&want)
                .filter(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(
                bad.count(),
                0,
                "quantized on the GPU from {dt:?}, double_quant {dq}"
            );
        }
    }
    for case in CASES {
        let dir = golden_dir(case).join("model_bnb4");
        let path = format!("model.path={}", dir.display());
        check_case_on(case, &[&path, "model.device=cuda"], Tol::F32);
        check_case_on(
            case,
            &[&path, "model.device=cuda", "model.dtype=bf16"],
            Tol::Bf16(5e-2),
        );
    }
}

/// `plan` on a bitsandbytes 4-bit checkpoint counts its base in NF4 though the recipe leaves
/// model.quantize unset. By hand (qlora_llama_gqa, f32, one layer): the seven linears' NF4
/// bytes (n/2 codes + n/64 absmax codes + 4 · ⌈n/16384⌉ + 1028, with n = 4096, 2048, 2048,
/// 4096, 8192 × 3) 26232, plus embedding, head and norms (16576 parameters) at 4 B: 92536 B;
/// in full precision (16576 + 36864) · 4 = 213760 B.
#[test]
fn plan_counts_a_bnb_4bit_checkpoint_in_nf4() {
    let tmp = tempfile::tempdir().unwrap();
    let case = "qlora_llama_gqa";
    let r = tmp.path().join("r.toml");
    std::fs::write(&r, golden_recipe(case, &tmp.path().join("out"))).unwrap();
    let plan = |dir: &str| -> serde_json::Value {
        let o = assert_cmd::Command::cargo_bin("lora-train")
            .unwrap()
            .arg("plan")
            .arg("--recipe")
            .arg(&r)
            .arg("--set")
            .arg(format!(
                "model.path={}",
                golden_dir(case).join(dir).display()
            ))
            .arg("--json")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let (q, full) = (plan("model_bnb4"), plan("model"));
    assert_eq!(
        (q["nf4"].as_bool(), full["nf4"].as_bool()),
        (Some(true), Some(false))
    );
    assert_eq!(q["selected"]["base_bytes"], 92_536);
    assert_eq!(full["selected"]["base_bytes"], 213_760);
}
