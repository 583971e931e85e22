//! An adapter alone as llama.cpp's LoRA GGUF (what convert_lora_to_gguf.py writes):
//! `general.type = "adapter"`, `adapter.type = "lora"`, `adapter.lora.alpha`, and for each
//! adapted linear `<gguf name>.lora_a` [r, in] and `.lora_b` [out, r], named and row-ordered as
//! the model file's weight (q and k's B rows in llama's rotary order). llama.cpp scales B·A by
//! alpha / r; an rsLoRA adapter (alpha / √r) is written with alpha·√r so that the product is
//! the same. DoRA magnitudes and MoE expert adapters have no llama.cpp LoRA form: merge those
//! (`--format gguf`).

use super::names::{self, Rotary, Target};
use super::quant::{self, Mix, Quant};
use super::{meta, permute_rows, GgufReport, Kv};
use crate::export::{read_adapter_config, CONFIG, WEIGHTS};
use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::Value;
use candle_core::{DType, Device, Tensor};
use std::path::Path;

/// The alpha llama.cpp is told: `alpha`, or alpha·√r for rsLoRA (llama.cpp divides by r).
pub(crate) fn gguf_alpha(alpha: f64, rank: usize, rslora: bool) -> f64 {
    match rslora {
        true => alpha * (rank as f64).sqrt(),
        false => alpha,
    }
}

/// The PEFT adapter in `adapter` (for the checkpoint in `base`) as a LoRA GGUF at `out`.
pub fn export(adapter: &Path, base: &Path, out: &Path, q: Quant) -> Result<GgufReport> {
    super::check_out(out)?;
    if q.k_mix() {
        bail!(
            "--quant {}: a LoRA GGUF is f32, f16, bf16 or q8_0",
            q.name()
        );
    }
    let info = read_adapter_config(adapter)?;
    let cfg_path = adapter.join(CONFIG);
    if info.spec.dora {
        bail!(
            "{}: a DoRA adapter has no llama.cpp LoRA form; export it merged (--format gguf)",
            cfg_path.display()
        );
    }
    let (cfg, _) = super::read_config(base)?;
    let arch = names::arch_name(cfg.family);
    let path = adapter.join(WEIGHTS);
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let shapes = tensors.iter().map(|(k, t)| (k.as_str(), t.dims()));
    crate::export::adapter_check::against_base(&path, shapes, &cfg)?;
    let mut modules: Vec<&str> = tensors
        .keys()
        .filter_map(|k| k.strip_suffix(".lora_A.weight"))
        .collect();
    modules.sort_by_key(|m| lora_order(m));
    if modules.is_empty() {
        bail!("{}: no lora_A tensors", path.display());
    }
    let mix = Mix {
        quant: q,
        layers: cfg.num_layers,
        n_attn_v: 0,
        experts: 0,
        tied: false,
    };
    let mut out_tensors = Vec::new();
    for m in modules {
        let hf = m.strip_prefix("base_model.model.").unwrap_or(m);
        let mapped = match names::target(cfg.family, &format!("{hf}.weight")) {
            Ok(Target::One(mp)) => mp,
            Ok(_) | Err(_) => bail!(
                "{}: `{m}` has no llama.cpp LoRA tensor (expert or unknown module); export it \
                 merged (--format gguf)",
                path.display()
            ),
        };
        let a = tensors.get(&format!("{m}.lora_A.weight"));
        let b = tensors.get(&format!("{m}.lora_B.weight"));
        let (Some(a), Some(b)) = (a, b) else {
            bail!("{}: `{m}` lacks lora_A or lora_B", path.display());
        };
        let f32_or_f16 = |t: &Tensor| match t.dtype() {
            DType::F16 | DType::F32 => Ok(t.clone()),
            _ => t.to_dtype(DType::F32),
        };
        let a = f32_or_f16(a)?;
        let b = match mapped.rotary {
            Rotary::None => f32_or_f16(b)?,
            Rotary::Q => permute_rows(&f32_or_f16(b)?, cfg.num_heads)?,
            Rotary::K => permute_rows(&f32_or_f16(b)?, cfg.num_kv_heads)?,
        };
        for (suffix, t) in [("lora_a", a), ("lora_b", b)] {
            let name = format!("{}.{suffix}", mapped.name);
            let ncols = t.dims().last().copied().unwrap_or(1);
            let ty = quant::tensor_type(&mix, &name, t.rank(), ncols, mapped.layer, 0);
            let qt = quant::quantize(&t, ty, false)
                .with_context(|| format!("cannot write `{name}` as {ty:?}"))?;
            out_tensors.push((name, qt));
        }
    }
    let alpha = gguf_alpha(info.spec.alpha, info.spec.rank, info.spec.rslora);
    let kv: Vec<Kv> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.type".into(), Value::String("adapter".into())),
        ("adapter.type".into(), Value::String("lora".into())),
        (
            "general.name".into(),
            Value::String(super::dir_name(adapter)),
        ),
        ("adapter.lora.alpha".into(), Value::F32(alpha as f32)),
        (
            "general.quantization_version".into(),
            Value::U32(meta::QUANT_VERSION),
        ),
    ];
    super::write(out, arch, &kv, &out_tensors)
}

/// Adapter modules in layer order, then by name.
fn lora_order(m: &str) -> (usize, String) {
    let layer = m
        .split('.')
        .skip_while(|p| *p != "layers")
        .nth(1)
        .and_then(|l| l.parse().ok())
        .unwrap_or(usize::MAX);
    (layer, m.to_string())
}
