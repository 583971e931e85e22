//! Rotary frequencies (with Llama-3 / linear scaling) and per-token cos/sin tables.

use super::config::{ModelConfig, RopeScaling};
use candle_core::{DType, Device, Result, Tensor};

/// inv_freq[i] = 1 / θ^(2i/D), i < D/2, rescaled as the config says. f32, as transformers.
pub fn inv_freq(cfg: &ModelConfig) -> Vec<f32> {
    let d = cfg.head_dim;
    let base = cfg.rope_theta as f32;
    let raw: Vec<f32> = (0..d / 2)
        .map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32))
        .collect();
    match cfg.rope_scaling {
        RopeScaling::None => raw,
        RopeScaling::Linear { factor } => raw.iter().map(|f| f / factor as f32).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => {
            let (factor, lo, hi) = (
                factor as f32,
                low_freq_factor as f32,
                high_freq_factor as f32,
            );
            let old = original_max_position as f32;
            let (low_wavelen, high_wavelen) = (old / lo, old / hi);
            raw.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - lo) / (hi - lo);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

/// cos and sin of position·inv_freq for each token: positions [B×T] → two [B, T, D/2] f32.
pub fn cos_sin(
    inv_freq: &[f32],
    positions: &[u32],
    b: usize,
    t: usize,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let half = inv_freq.len();
    if dev.is_cuda() {
        // The angles on the GPU, from the positions: a host loop over B·T·D/2 angles would
        // hold the GPU idle every micro-batch (4096 tokens × 64 at 7B). The products are the
        // host's (p < 2^24 is exact in f32); cos and sin are the device's.
        let p = Tensor::from_slice(positions, (positions.len(), 1), dev)?.to_dtype(DType::F32)?;
        let a = p.broadcast_mul(&Tensor::from_slice(inv_freq, (1, half), dev)?)?; // [B·T, D/2]
        return Ok((
            a.cos()?.reshape((b, t, half))?,
            a.sin()?.reshape((b, t, half))?,
        ));
    }
    let mut cos = Vec::with_capacity(positions.len() * half);
    let mut sin = Vec::with_capacity(positions.len() * half);
    for &p in positions {
        for &f in inv_freq {
            let a = p as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    Ok((
        Tensor::from_vec(cos, (b, t, half), dev)?,
        Tensor::from_vec(sin, (b, t, half), dev)?,
    ))
}
