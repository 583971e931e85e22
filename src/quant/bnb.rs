//! Checkpoints saved by transformers with bitsandbytes 4-bit (`quantization_config.quant_method
//! = "bitsandbytes"`, `load_in_4bit`, the Hub's `*-bnb-4bit` repositories): each quantized
//! linear `P.weight` is stored as
//!
//!   P.weight                                 u8 [n/2, 1]  the NF4 codes, two a byte
//!   P.weight.absmax                          u8 [nb]      (f32 without double quant)
//!   P.weight.nested_absmax                   f32 [⌈nb / 256⌉]
//!   P.weight.nested_quant_map                f32 [256]    the 8-bit dynamic map
//!   P.weight.quant_map                       f32 [16]     the NF4 levels
//!   P.weight.quant_state.bitsandbytes__nf4   u8 [..]      JSON: quant_type, blocksize, shape,
//!                                                         nested_blocksize, nested_offset
//!
//! which `read` turns into our `Nf4` (the same format: src/quant/nf4.rs). The other tensors
//! (embedding, norms, head, biases) are plain floats.

use super::nf4::{Absmax, Nested, Nf4, BLOCK, LEVELS, NESTED_BLOCK};
use anyhow::{bail, Context, Result};
use candle_core::safetensors::MmapedSafetensors;
use std::path::Path;

/// The suffix of the tensor that carries a 4-bit weight's quant state.
pub(crate) const STATE: &str = ".quant_state.bitsandbytes__nf4";

/// What a checkpoint's config.json says of its quantization: None for a full-precision one,
/// true / false for a bitsandbytes NF4 one with / without double quant; None too for gpt-oss's
/// MXFP4 experts (read as full precision: quant::mxfp4). Any other quantization is an error
/// that says what to use instead.
pub fn nf4_config(config: &Path) -> Result<Option<bool>> {
    let text = std::fs::read_to_string(config)
        .with_context(|| format!("cannot read {}", config.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", config.display()))?;
    nf4_of(&v).map_err(|m| anyhow::anyhow!("{}: {m}", config.display()))
}

/// `nf4_config` of a config.json already parsed: the one reading of a run's config.json
/// (`ModelConfig::from_json`) takes its quantization here. The error names the field.
pub(crate) fn nf4_of(v: &serde_json::Value) -> std::result::Result<Option<bool>, String> {
    let Some(q) = v.get("quantization_config") else {
        return Ok(None);
    };
    let method = q.get("quant_method").and_then(|m| m.as_str()).unwrap_or("");
    let flag = |k: &str| q.get(k).and_then(|b| b.as_bool()).unwrap_or(false);
    if method == "mxfp4" {
        // gpt-oss's experts as the Hub stores them, dequantized as they load (quant::mxfp4)
        return Ok(None);
    }
    if method != "bitsandbytes" {
        return Err(format!(
            "quantization_config.quant_method = \"{method}\": lora-train trains full-precision bases and bitsandbytes NF4 ones only; use the full-precision original (and model.quantize = \"nf4\" for QLoRA)"
        ));
    }
    if flag("load_in_8bit") || !flag("load_in_4bit") {
        return Err("a bitsandbytes 8-bit checkpoint (load_in_8bit): lora-train reads 4-bit NF4 ones only; use the full-precision original with model.quantize = \"nf4\"".to_string());
    }
    let kind = q
        .get("bnb_4bit_quant_type")
        .and_then(|t| t.as_str())
        .unwrap_or("fp4");
    if kind != "nf4" {
        return Err(format!(
            "quantization_config.bnb_4bit_quant_type = \"{kind}\": lora-train reads NF4 only; use the full-precision original with model.quantize = \"nf4\""
        ));
    }
    Ok(Some(flag("bnb_4bit_use_double_quant")))
}

/// The NF4 weight `name` (e.g. `model.layers.0.mlp.down_proj.weight`) of shape `shape`, when
/// the checkpoint stores it 4-bit; None when it is a plain tensor.
pub(crate) fn read(st: &MmapedSafetensors, name: &str, shape: &[usize]) -> Result<Option<Nf4>> {
    let Ok(state) = st.get(&format!("{name}{STATE}")) else {
        return Ok(None);
    };
    let state: serde_json::Value = serde_json::from_slice(state.data())
        .with_context(|| format!("`{name}{STATE}` is not the JSON bitsandbytes writes"))?;
    let field = |k: &str| state.get(k).cloned().unwrap_or(serde_json::Value::Null);
    let kind = field("quant_type");
    if kind.as_str() != Some("nf4") {
        bail!("`{name}`: quant_type {kind}, lora-train reads nf4 only");
    }
    let block = field("blocksize").as_u64();
    if block != Some(BLOCK as u64) {
        bail!("`{name}`: blocksize {block:?}, lora-train reads NF4 in blocks of {BLOCK} (bitsandbytes' default)");
    }
    let stored: Option<Vec<usize>> = serde_json::from_value(field("shape")).ok();
    if stored.as_deref() != Some(shape) {
        bail!("`{name}`: its quant state's shape {stored:?}, config.json implies {shape:?}");
    }
    let n: usize = shape.iter().product();
    let blocks = n.div_ceil(BLOCK);
    let codes = bytes(st, name, "U8", n.div_ceil(2))?;
    let levels = floats(st, &format!("{name}.quant_map"), 16)?;
    if levels
        .iter()
        .zip(LEVELS)
        .any(|(a, b)| a.to_bits() != b.to_bits())
    {
        bail!("`{name}.quant_map` is not bitsandbytes' NF4 levels");
    }
    let absmax_name = format!("{name}.absmax");
    let absmax = match st.get(&format!("{name}.nested_absmax")) {
        Err(_) => Absmax::Plain(floats(st, &absmax_name, blocks)?),
        Ok(_) => {
            let nb = field("nested_blocksize").as_u64();
            if nb != Some(NESTED_BLOCK as u64) {
                bail!("`{name}`: nested_blocksize {nb:?}, lora-train reads {NESTED_BLOCK}");
            }
            let Some(offset) = field("nested_offset").as_f64() else {
                bail!("`{name}{STATE}` has no nested_offset");
            };
            Absmax::Nested(Nested {
                codes: bytes(st, &absmax_name, "U8", blocks)?,
                absmax: floats(
                    st,
                    &format!("{name}.nested_absmax"),
                    blocks.div_ceil(NESTED_BLOCK),
                )?,
                map: floats(st, &format!("{name}.nested_quant_map"), 256)?,
                offset: offset as f32,
            })
        }
    };
    Ok(Some(Nf4 {
        shape: shape.to_vec(),
        codes,
        absmax,
    }))
}

/// The raw bytes of tensor `name`, which must be `dtype` and hold `len` elements of a byte.
fn bytes(st: &MmapedSafetensors, name: &str, dtype: &str, len: usize) -> Result<Vec<u8>> {
    let t = st
        .get(name)
        .map_err(|_| anyhow::anyhow!("`{name}` is missing from the 4-bit checkpoint"))?;
    let got = format!("{:?}", t.dtype());
    if got != dtype || t.data().len() != len {
        bail!(
            "`{name}` is {got} with {} bytes, want {dtype} with {len}",
            t.data().len()
        );
    }
    Ok(t.data().to_vec())
}

/// The f32 values of tensor `name`, which must hold `len` of them.
fn floats(st: &MmapedSafetensors, name: &str, len: usize) -> Result<Vec<f32>> {
    let t = st
        .get(name)
        .map_err(|_| anyhow::anyhow!("`{name}` is missing from the 4-bit checkpoint"))?;
    if format!("{:?}", t.dtype()) != "F32" || t.data().len() != 4 * len {
        bail!(
            "`{name}` is {:?} with {} bytes, want F32 with {len} values",
            t.dtype(),
            t.data().len()
        );
    }
    let le = |c: &[u8]| f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    Ok(t.data().chunks_exact(4).map(le).collect())
}
