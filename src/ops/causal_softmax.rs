//! softmax(scale · S + mask) over the last dimension of attention scores, with the mask built
//! from token indices instead of a materialised tensor: causal, optionally block-diagonal
//! (packed examples never see each other) and optionally a sliding window (Mistral).
//!
//! Backward: dS = scale · P ⊙ (dP − Σⱼ dP·P). Masked entries have P = 0, so they get 0.

use super::{cpu_as_f32, cpu_from_f32};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, D};
use std::sync::Arc;

/// Which keys a query may see.
#[derive(Clone, Debug, Default)]
pub struct AttnMask {
    /// Per-token example ids, [B × T] row-major: query i sees key j only if they match.
    /// `None`: every row is one sequence.
    pub segments: Option<Arc<Vec<u32>>>,
    /// Keys further back than this many positions are masked (0 = unlimited).
    pub window: usize,
}

impl AttnMask {
    fn allowed(&self, b: usize, t: usize, i: usize, j: usize) -> bool {
        if j > i || (self.window > 0 && i - j >= self.window) {
            return false;
        }
        match &self.segments {
            Some(seg) => seg[b * t + i] == seg[b * t + j],
            None => true,
        }
    }
}

struct CausalSoftmax {
    scale: f32,
    mask: AttnMask,
}

/// scores: [B, H, T, T] → probabilities of the same shape and dtype.
pub fn causal_softmax(scores: &Tensor, scale: f64, mask: &AttnMask) -> Result<Tensor> {
    let op = CausalSoftmax {
        scale: scale as f32,
        mask: mask.clone(),
    };
    scores.contiguous()?.apply_op1_arc(Arc::new(Box::new(op)))
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (b, h, t, t2) = l.shape().dims4()?;
        if t != t2 {
            candle_core::bail!("causal_softmax: scores must be square, got {:?}", l.dims());
        }
        if let Some(seg) = &self.mask.segments {
            if seg.len() != b * t {
                candle_core::bail!(
                    "causal_softmax: {} segment ids for {b}×{t} tokens",
                    seg.len()
                );
            }
        }
        let x = cpu_as_f32(s, l)?;
        let mut y = vec![0f32; x.len()];
        for bi in 0..b {
            for hi in 0..h {
                for i in 0..t {
                    let row = ((bi * h + hi) * t + i) * t;
                    let mut max = f32::NEG_INFINITY;
                    for j in 0..=i {
                        if self.mask.allowed(bi, t, i, j) {
                            max = max.max(x[row + j] * self.scale);
                        }
                    }
                    let mut sum = 0f32;
                    for j in 0..=i {
                        if self.mask.allowed(bi, t, i, j) {
                            let e = (x[row + j] * self.scale - max).exp();
                            y[row + j] = e;
                            sum += e;
                        }
                    }
                    // Every query sees at least itself, so sum > 0.
                    for v in &mut y[row..row + i + 1] {
                        *v /= sum;
                    }
                }
            }
        }
        Ok((cpu_from_f32(y, s)?, l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let dtype = res.dtype();
        let p = res.to_dtype(DType::F32)?;
        let dp = grad_res.to_dtype(DType::F32)?;
        let dot = (&p * &dp)?.sum_keepdim(D::Minus1)?;
        let ds = ((p * dp.broadcast_sub(&dot)?)? * self.scale as f64)?;
        Ok(Some(ds.to_dtype(dtype)?))
    }
}
