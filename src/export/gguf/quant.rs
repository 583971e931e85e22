//! Which ggml type each GGUF tensor is written in, and the values quantized with candle's
//! quantizers (`candle_core::quantized`, ports of ggml's reference `quantize_row_*_ref`).
//!
//! f32 / f16 / bf16 / q8_0 follow convert_hf_to_gguf.py's `--outtype`: 1-D tensors, norms,
//! biases and the MoE router stay f32, every other weight takes the type (q8_0 falls back to
//! f16 where a row is not a multiple of 32). The k-quant mixes follow llama-quantize's
//! `llama_tensor_get_type` on the f16 file (what `convert … --outtype f16` then
//! `llama-quantize … Q4_K_M` gives, without an importance matrix): the values are rounded to
//! f16 first, as that file holds them; default type Q4_K / Q5_K / Q6_K, the output head (the
//! token embedding when tied) Q6_K (Q8_0 when its rows do not split into 256-blocks), and for
//! Q4_K_M / Q5_K_M attn_v (attn_qkv) and ffn_down of the "more bits" layers Q6_K (an 8-expert
//! MoE: attn_v and attn_k Q8_0, attn_output Q5_K under Q4_K_M); a row length the type's
//! block does not divide falls back (Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0, then f16).

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Tensor};

/// The `--quant` of a GGUF export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quant {
    /// Every weight f32.
    F32,
    /// Weights in f16 (1-D tensors, norms, biases and the router stay f32).
    F16,
    /// Weights in bf16 (as F16 for what stays f32).
    Bf16,
    /// Weights in Q8_0 (f16 where a row is not a multiple of 32).
    Q8_0,
    /// llama-quantize's Q4_K_M mix.
    Q4KM,
    /// llama-quantize's Q5_K_M mix.
    Q5KM,
    /// llama-quantize's Q6_K.
    Q6K,
}

impl Quant {
    /// llama.cpp's `general.file_type` (LlamaFileType).
    pub(crate) fn file_type(self) -> u32 {
        match self {
            Quant::F32 => 0,
            Quant::F16 => 1,
            Quant::Q8_0 => 7,
            Quant::Q4KM => 15,
            Quant::Q5KM => 17,
            Quant::Q6K => 18,
            Quant::Bf16 => 32,
        }
    }

    /// The name llama.cpp's tools print (F16, Q4_K_M, …).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Quant::F32 => "F32",
            Quant::F16 => "F16",
            Quant::Bf16 => "BF16",
            Quant::Q8_0 => "Q8_0",
            Quant::Q4KM => "Q4_K_M",
            Quant::Q5KM => "Q5_K_M",
            Quant::Q6K => "Q6_K",
        }
    }

    /// A k-quant mix (llama-quantize's rules on the f16 values).
    pub(crate) fn k_mix(self) -> bool {
        matches!(self, Quant::Q4KM | Quant::Q5KM | Quant::Q6K)
    }
}

/// What the type choice needs to know about the model.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mix {
    pub(crate) quant: Quant,
    pub(crate) layers: usize,
    /// attn_v (or attn_qkv) tensors in the file.
    pub(crate) n_attn_v: usize,
    /// Experts per MoE layer (0: dense).
    pub(crate) experts: usize,
    /// The file has no output.weight (the head is the token embedding).
    pub(crate) tied: bool,
}

/// llama-quantize's "more bits" layers: the first and last eighth, and every third between.
fn more_bits(i: usize, n: usize) -> bool {
    let (i, n) = (i as i64, n as i64);
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8).rem_euclid(3) == 2
}

/// Whether convert_hf_to_gguf.py keeps a tensor f32 whatever `--outtype` says.
pub(crate) fn forced_f32(name: &str, dims: usize) -> bool {
    dims <= 1
        || name.ends_with("_norm.weight")
        || name.contains("ffn_gate_inp.")
        || !(name.ends_with(".weight") || name.ends_with(".lora_a") || name.ends_with(".lora_b"))
}

fn block(t: GgmlDType) -> usize {
    t.block_size()
}

/// llama-quantize's `tensor_type_fallback`: a type whose block does not divide the row.
fn fallback(t: GgmlDType, ncols: usize) -> GgmlDType {
    if ncols % block(t) == 0 {
        return t;
    }
    let f = match t {
        GgmlDType::Q4K => GgmlDType::Q5_0,
        GgmlDType::Q5K => GgmlDType::Q5_1,
        GgmlDType::Q6K => GgmlDType::Q8_0,
        other => other,
    };
    match ncols % block(f) {
        0 => f,
        _ => GgmlDType::F16,
    }
}

/// The type of tensor `name` (`dims` as ggml counts them, `ncols` its row length) under the
/// mix; `layer`: its block, `v_index`: how many attn_v came before it (attn_v only).
pub(crate) fn tensor_type(
    mix: &Mix,
    name: &str,
    dims: usize,
    ncols: usize,
    layer: Option<usize>,
    v_index: usize,
) -> GgmlDType {
    if forced_f32(name, dims) {
        return GgmlDType::F32;
    }
    let t = match mix.quant {
        Quant::F32 => return GgmlDType::F32,
        Quant::F16 => return GgmlDType::F16,
        Quant::Bf16 => return GgmlDType::BF16,
        Quant::Q8_0 => {
            return match ncols % 32 {
                0 => GgmlDType::Q8_0,
                _ => GgmlDType::F16,
            }
        }
        Quant::Q4KM => GgmlDType::Q4K,
        Quant::Q5KM => GgmlDType::Q5K,
        Quant::Q6K => GgmlDType::Q6K,
    };
    let km = matches!(mix.quant, Quant::Q4KM | Quant::Q5KM);
    let base = name.rsplit_once('.').map_or(name, |(b, _)| b);
    let kind = base.rsplit('.').next().unwrap_or(base);
    let n = mix.layers;
    let t = if name == "output.weight" || (mix.tied && name == "token_embd.weight") {
        match ncols % 256 {
            0 if t == GgmlDType::Q8_0 => t,
            0 => GgmlDType::Q6K,
            _ => GgmlDType::Q8_0,
        }
    } else if kind == "attn_v" || kind == "attn_qkv" {
        if mix.experts == 8 {
            GgmlDType::Q8_0
        } else if km && more_bits(v_index, mix.n_attn_v) {
            GgmlDType::Q6K
        } else {
            t
        }
    } else if kind == "attn_k" && mix.experts == 8 {
        GgmlDType::Q8_0
    } else if kind == "ffn_down" || kind == "ffn_down_exps" {
        match layer {
            Some(i) if km && more_bits(i, n) => GgmlDType::Q6K,
            _ => t,
        }
    } else if kind == "attn_output" && mix.experts == 8 && mix.quant == Quant::Q4KM {
        GgmlDType::Q5K
    } else {
        t
    };
    fallback(t, ncols)
}

/// `t` (any float dtype, ggml's row order) in `dtype`; k-quant mixes quantize from the values
/// rounded to f16, as llama-quantize reads them from the f16 file.
pub(crate) fn quantize(t: &Tensor, dtype: GgmlDType, k_mix: bool) -> candle_core::Result<QTensor> {
    let src = match dtype {
        GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => t.clone(),
        _ if k_mix => t.to_dtype(DType::F16)?.to_dtype(DType::F32)?,
        _ => t.to_dtype(DType::F32)?,
    };
    QTensor::quantize(&src, dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mix(q: Quant) -> Mix {
        Mix {
            quant: q,
            layers: 32,
            n_attn_v: 32,
            experts: 0,
            tied: false,
        }
    }

    /// Q4_K_M on a 32-layer 4096-wide model: llama-quantize's table (Llama 2 7B's).
    #[test]
    fn q4_k_m_mix_matches_llama_quantize() {
        let m = mix(Quant::Q4KM);
        let ty = |name: &str, ncols, layer, v| tensor_type(&m, name, 2, ncols, layer, v);
        assert_eq!(ty("output.weight", 4096, None, 0), GgmlDType::Q6K);
        assert_eq!(ty("token_embd.weight", 4096, None, 0), GgmlDType::Q4K);
        // more bits: layers 0..4, 28..32, and 4 + 3k + 2
        assert_eq!(ty("blk.0.attn_v.weight", 4096, Some(0), 0), GgmlDType::Q6K);
        assert_eq!(ty("blk.4.attn_v.weight", 4096, Some(4), 4), GgmlDType::Q4K);
        assert_eq!(ty("blk.6.attn_v.weight", 4096, Some(6), 6), GgmlDType::Q6K);
        assert_eq!(
            ty("blk.6.ffn_down.weight", 11008, Some(6), 0),
            GgmlDType::Q6K
        );
        assert_eq!(
            ty("blk.7.ffn_down.weight", 11008, Some(7), 0),
            GgmlDType::Q4K
        );
        assert_eq!(ty("blk.7.attn_q.weight", 4096, Some(7), 0), GgmlDType::Q4K);
        assert_eq!(
            tensor_type(&m, "blk.7.attn_norm.weight", 1, 4096, Some(7), 0),
            GgmlDType::F32
        );
        // rows of 176: Q4_K → Q5_0 (176 % 32 ≠ 0) → f16; rows of 64: Q4_K → Q5_0
        assert_eq!(ty("blk.7.ffn_gate.weight", 176, Some(7), 0), GgmlDType::F16);
        assert_eq!(ty("blk.7.ffn_gate.weight", 64, Some(7), 0), GgmlDType::Q5_0);
        assert_eq!(ty("output.weight", 64, None, 0), GgmlDType::Q8_0);
    }

    #[test]
    fn outtype_rules_match_convert() {
        let m = mix(Quant::Q8_0);
        assert_eq!(
            tensor_type(&m, "blk.0.attn_q.bias", 1, 64, Some(0), 0),
            GgmlDType::F32
        );
        assert_eq!(
            tensor_type(&m, "blk.0.ffn_gate_inp.weight", 2, 64, Some(0), 0),
            GgmlDType::F32
        );
        assert_eq!(
            tensor_type(&m, "blk.0.ffn_down.weight", 2, 176, Some(0), 0),
            GgmlDType::F16
        );
        assert_eq!(
            tensor_type(&m, "blk.0.ffn_up.weight", 2, 64, Some(0), 0),
            GgmlDType::Q8_0
        );
    }
}
