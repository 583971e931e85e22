//! The dtypes of a merge: safetensors' and candle's, the checkpoint's own, a stored tensor's bytes
//! and views, and an NF4 weight dequantized as training held it.

use crate::quant::Nf4;
use crate::recipe::Dtype;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use safetensors::tensor::TensorView;
use safetensors::Dtype as StDtype;
use serde_json::Value;

pub(super) fn st_dtype(d: Dtype) -> StDtype {
    match d {
        Dtype::F32 => StDtype::F32,
        Dtype::Bf16 => StDtype::BF16,
        Dtype::F16 => StDtype::F16,
    }
}

pub(super) fn candle_dtype(d: StDtype) -> Option<DType> {
    match d {
        StDtype::F32 => Some(DType::F32),
        StDtype::BF16 => Some(DType::BF16),
        StDtype::F16 => Some(DType::F16),
        StDtype::F64 => Some(DType::F64),
        _ => None,
    }
}

/// A dtype as config.json names it (float32, bfloat16, float16; None for others).
pub(super) fn from_torch_name(name: &str) -> Option<StDtype> {
    match name.strip_prefix("torch.").unwrap_or(name) {
        "float32" => Some(StDtype::F32),
        "bfloat16" => Some(StDtype::BF16),
        "float16" => Some(StDtype::F16),
        _ => None,
    }
}

/// The dtype a bitsandbytes 4-bit checkpoint's linears are written in, without `--dtype`:
/// config.json's `torch_dtype` / `dtype` (that of its unquantized tensors), else
/// `quantization_config.bnb_4bit_compute_dtype`, else f32.
pub(super) fn checkpoint_dtype(cfg: &Value) -> StDtype {
    let named = |v: Option<&Value>| v.and_then(Value::as_str).and_then(from_torch_name);
    named(cfg.get("torch_dtype"))
        .or_else(|| named(cfg.get("dtype")))
        .or_else(|| {
            named(
                cfg.get("quantization_config")
                    .and_then(|q| q.get("bnb_4bit_compute_dtype")),
            )
        })
        .unwrap_or(StDtype::F32)
}

/// config.json's name for a dtype.
pub(super) fn torch_name(d: StDtype) -> &'static str {
    match d {
        StDtype::BF16 => "bfloat16",
        StDtype::F16 => "float16",
        StDtype::F64 => "float64",
        _ => "float32",
    }
}

pub(super) fn n_bytes(shape: &[usize], d: StDtype) -> u64 {
    shape.iter().product::<usize>() as u64 * (d.bitsize() / 8) as u64
}

/// A CPU tensor's elements as little-endian bytes (the in-memory bytes: the targets we build
/// for are little-endian: export.rs refuses to build for others).
pub(crate) fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => bytemuck::cast_slice(&t.to_vec1::<f32>()?).to_vec(),
        DType::BF16 => bytemuck::cast_slice(&t.to_vec1::<half::bf16>()?).to_vec(),
        DType::F16 => bytemuck::cast_slice(&t.to_vec1::<half::f16>()?).to_vec(),
        DType::F64 => bytemuck::cast_slice(&t.to_vec1::<f64>()?).to_vec(),
        other => bail!("cannot write a {other:?} tensor"),
    })
}

pub(super) fn view_tensor(v: &TensorView) -> Result<Tensor> {
    let d =
        candle_dtype(v.dtype()).with_context(|| format!("dtype {} is not a float", v.dtype()))?;
    Ok(Tensor::from_raw_buffer(
        v.data(),
        d,
        v.shape(),
        &Device::Cpu,
    )?)
}

pub(super) fn to_recipe_dtype(d: DType) -> Option<Dtype> {
    match d {
        DType::F32 => Some(Dtype::F32),
        DType::BF16 => Some(Dtype::Bf16),
        DType::F16 => Some(Dtype::F16),
        _ => None,
    }
}

/// An NF4 weight's values as an f32 CPU tensor of its shape: level · absmax in f32, rounded
/// to `held` first when given (the dtype training dequantized it to).
pub(super) fn dequantized_tensor(q: &Nf4, held: Option<Dtype>) -> Result<Tensor> {
    let w = Tensor::from_vec(q.dequantize(), q.shape.as_slice(), &Device::Cpu)?;
    rounded(w, held)
}

/// Dequantized f32 values `w` rounded to the dtype training held them in (`held`), in f32.
pub(super) fn rounded(w: Tensor, held: Option<Dtype>) -> Result<Tensor> {
    Ok(match held {
        Some(d) => w
            .to_dtype(candle_dtype(st_dtype(d)).unwrap_or(DType::F32))?
            .to_dtype(DType::F32)?,
        None => w,
    })
}
