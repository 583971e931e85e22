//! Rotary frequencies (linear, Llama-3, LongRoPE and YaRN scaling) and per-token cos/sin tables.

use super::config::RopeScaling;
use super::family::Rope;
use candle_core::{DType, Device, Result, Tensor};

/// One RoPE's frequencies: the table each batch takes, and the factor on cos and sin.
#[derive(Debug, Clone)]
pub(crate) struct Freqs {
    /// inv_freq [D/2]: the only table, or LongRoPE's short one.
    short: Vec<f32>,
    /// LongRoPE: the table of a batch whose positions reach `.1` (original_max_position) or
    /// further, as transformers switches on max(position_ids) + 1 > original.
    long: Option<(Vec<f32>, usize)>,
    /// cos and sin × this (LongRoPE's and YaRN's attention factor; 1 otherwise).
    mscale: f32,
}

impl Freqs {
    /// inv_freq[i] = 1 / θ^(2i/D), i < D/2, rescaled as `rope.scaling` says; f32, as
    /// transformers computes them.
    pub(crate) fn new(head_dim: usize, rope: &Rope) -> Freqs {
        let d = head_dim;
        let base = rope.theta as f32;
        let raw: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32))
            .collect();
        let plain = |short| Freqs {
            short,
            long: None,
            mscale: 1.0,
        };
        match &rope.scaling {
            RopeScaling::None => plain(raw),
            RopeScaling::Linear { factor } => {
                plain(raw.iter().map(|f| f / *factor as f32).collect())
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => plain(llama3(
                &raw,
                [*factor, *low_freq_factor, *high_freq_factor],
                *original_max_position,
            )),
            RopeScaling::Yarn {
                factor,
                beta_fast,
                beta_slow,
                original_max_position,
                truncate,
                attention_factor,
            } => Freqs {
                short: super::yarn::inv_freq(
                    rope.theta,
                    d,
                    [*factor, *beta_fast, *beta_slow],
                    *original_max_position,
                    *truncate,
                ),
                long: None,
                mscale: *attention_factor as f32,
            },
            RopeScaling::LongRope {
                short,
                long,
                original_max_position,
                attention_factor,
            } => {
                // transformers: 1 / (ext · base^(2i/D)), ext and the power in f32.
                let ext = |fs: &[f64]| -> Vec<f32> {
                    (0..d / 2)
                        .map(|i| {
                            let pw = base.powf((2 * i) as f32 / d as f32);
                            1.0 / (fs.get(i).copied().unwrap_or(1.0) as f32 * pw)
                        })
                        .collect()
                };
                Freqs {
                    short: ext(short),
                    long: Some((ext(long), *original_max_position)),
                    mscale: *attention_factor as f32,
                }
            }
        }
    }

    /// Whether a call whose positions reach `reach` (its largest + 1) takes LongRoPE's long
    /// table; false for every other RoPE.
    pub(crate) fn is_long(&self, reach: usize) -> bool {
        matches!(&self.long, Some((_, orig)) if reach > *orig)
    }

    /// LongRoPE's original_max_position (from which a one-token call takes the long table).
    pub(crate) fn long_from(&self) -> Option<usize> {
        self.long.as_ref().map(|(_, orig)| *orig)
    }

    /// LongRoPE's long table when `long`, else the short (only) one.
    fn table_of(&self, long: bool) -> &[f32] {
        match (&self.long, long) {
            (Some((table, _)), true) => table,
            _ => &self.short,
        }
    }

    /// cos and sin of each token's angles ([B, T, D/2] f32 each), × the attention factor.
    pub(crate) fn cos_sin(
        &self,
        positions: &[u32],
        b: usize,
        t: usize,
        dev: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let reach = positions.iter().max().map_or(0, |&p| p as usize + 1);
        self.cos_sin_of(self.is_long(reach), positions, b, t, dev)
    }

    /// `cos_sin` from the long table (`long`, LongRoPE only) or the short one, whatever the
    /// positions reach: generation's cache keeps both for every position.
    pub(crate) fn cos_sin_of(
        &self,
        long: bool,
        positions: &[u32],
        b: usize,
        t: usize,
        dev: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let (cos, sin) = cos_sin(self.table_of(long), positions, b, t, dev)?;
        match self.mscale {
            1.0 => Ok((cos, sin)),
            m => Ok(((cos * m as f64)?, (sin * m as f64)?)),
        }
    }
}

/// Llama 3.1's per-frequency rescale: high frequencies kept, low ones ÷ factor, a smooth blend
/// between (`[factor, low_freq_factor, high_freq_factor]`).
fn llama3(raw: &[f32], [factor, lo, hi]: [f64; 3], original_max_position: usize) -> Vec<f32> {
    let (factor, lo, hi) = (factor as f32, lo as f32, hi as f32);
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
