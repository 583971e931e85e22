//! The routers' load-balancing loss (`train.router_aux_loss_coef`; off at 0, the default), as
//! transformers' `load_balancing_loss_func` computes it over all MoE layers of a forward:
//!
//!   aux = E · Σ_e f_e · P_e,  f_e = Σ_l Σ_n mask_n · [e ∈ topk_l(n)] / (L·N),
//!                             P_e = Σ_l Σ_n mask_n · p_l(n, e) / (L·N),  N = Σ_n mask_n
//!
//! mask: 1 on a real token, 0 on padding (the attention mask the HF Trainer passes). f carries
//! no gradient (top-k counts), so dL/dp_l(n, e) = scale · E · f_e · mask_n / (L·N) for every
//! layer l alike: known once the whole forward has counted f, before any layer's backward.
//! Each layer's forward adds its counts and probability sums (`record`); the driver then makes
//! the loss and that gradient (`finish`), which each layer's router backward adds
//! (`router::route_bwd`).
//!
//! Shapes: m tokens of the micro-batch, E experts, k experts per token.

use super::router::Routing;
use candle_core::{DType, Result, Tensor};
use std::sync::Mutex;

/// One micro-batch's load-balancing loss, accumulated over the layers.
pub(crate) struct MoeAux {
    /// [m, 1] f32: 1 real token, 0 padding.
    mask: Tensor,
    /// The loss's weight in this micro-batch's share of the step's loss: coef · (its counted
    /// tokens / the step's), so that one micro-batch gives transformers' loss + coef · aux.
    scale: f64,
    sums: Mutex<Option<Sums>>,
    /// dL/dp [m, E] f32, made by `finish`.
    grad: Mutex<Option<Tensor>>,
}

struct Sums {
    /// [E] f32 Σ_l Σ_n mask_n · [e chosen]
    counts: Tensor,
    /// [E] f32 Σ_l Σ_n mask_n · p
    probs: Tensor,
    layers: usize,
}

impl MoeAux {
    /// `real` [m]: whether each token is real (not padding), on the device of the batch.
    pub(crate) fn new(real: &[bool], scale: f64, dev: &candle_core::Device) -> Result<MoeAux> {
        let m: Vec<f32> = real.iter().map(|&r| r as u8 as f32).collect();
        Ok(MoeAux {
            mask: Tensor::from_vec(m, (real.len(), 1), dev)?,
            scale,
            sums: Mutex::new(None),
            grad: Mutex::new(None),
        })
    }

    /// Adds one layer's routing (its forward, once per layer).
    pub(crate) fn record(&self, r: &Routing) -> Result<()> {
        let k = r.idx.dim(1)?;
        let chosen = self
            .mask
            .broadcast_as((self.mask.dim(0)?, k))?
            .contiguous()?;
        let counts = r
            .probs
            .zeros_like()?
            .scatter_add(&r.idx, &chosen, 1)?
            .sum(0)?;
        let probs = r.probs.detach().broadcast_mul(&self.mask)?.sum(0)?;
        let mut sums = lock(&self.sums)?;
        *sums = Some(match sums.take() {
            None => Sums {
                counts,
                probs,
                layers: 1,
            },
            Some(s) => Sums {
                counts: (s.counts + counts)?,
                probs: (s.probs + probs)?,
                layers: s.layers + 1,
            },
        });
        Ok(())
    }

    /// After the forward: scale · aux (a scalar f32 tensor; None when no layer routed), and
    /// the gradient every router's backward takes (`grad`).
    pub(crate) fn finish(&self) -> Result<Option<Tensor>> {
        let sums = lock(&self.sums)?;
        let Some(s) = sums.as_ref() else {
            return Ok(None);
        };
        let experts = s.counts.dim(0)? as f64;
        let rows = (self.mask.sum_all()? * s.layers as f64)?; // L·N
        let f = s.counts.broadcast_div(&rows)?; // [E]
        let p = s.probs.broadcast_div(&rows)?;
        let loss = ((&f * &p)?.sum_all()? * (self.scale * experts))?;
        // dL/dp(n, e) = scale · E · f_e · mask_n / (L·N)
        let g = (f.broadcast_div(&rows)? * (self.scale * experts))?.unsqueeze(0)?; // [1, E]
        *lock(&self.grad)? = Some(self.mask.broadcast_mul(&g)?);
        Ok(Some(loss.to_dtype(DType::F32)?))
    }

    /// dL/dp [m, E] f32 for the routers' backward (None before `finish`).
    pub(crate) fn grad(&self) -> Result<Option<Tensor>> {
        Ok(lock(&self.grad)?.clone())
    }
}

fn lock<T>(m: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| candle_core::Error::msg("moe_aux: a rank panicked holding the sums"))
}
