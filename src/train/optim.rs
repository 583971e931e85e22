//! AdamW over the adapters (f32 state), as torch.optim.AdamW, and global-norm clipping as
//! torch.nn.utils.clip_grad_norm_.

use candle_core::{Result, Tensor, TensorId, Var};
use std::collections::HashMap;

/// Accumulated gradients, keyed by the parameter's tensor id.
pub type Grads = HashMap<TensorId, Tensor>;

pub struct AdamW {
    pub params: Vec<Var>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    pub t: usize,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
}

impl AdamW {
    pub fn new(params: Vec<Var>, betas: [f64; 2], eps: f64, weight_decay: f64) -> Result<Self> {
        let m = params
            .iter()
            .map(|p| p.zeros_like())
            .collect::<Result<Vec<_>>>()?;
        let v = params
            .iter()
            .map(|p| p.zeros_like())
            .collect::<Result<Vec<_>>>()?;
        Ok(AdamW {
            params,
            m,
            v,
            t: 0,
            betas: (betas[0], betas[1]),
            eps,
            weight_decay,
        })
    }

    /// One step at learning rate `lr`. Parameters without a gradient (none reached them this
    /// step) are left alone, as torch does for `grad is None`.
    pub fn step(&mut self, grads: &Grads, lr: f64) -> Result<()> {
        self.t += 1;
        let (b1, b2) = self.betas;
        let bc1 = 1.0 - b1.powi(self.t as i32);
        let bc2_sqrt = (1.0 - b2.powi(self.t as i32)).sqrt();
        for ((p, m), v) in self.params.iter().zip(&mut self.m).zip(&mut self.v) {
            let Some(g) = grads.get(&p.id()) else {
                continue;
            };
            // p ← p·(1 − lr·wd); m ← β1·m + (1−β1)·g; v ← β2·v + (1−β2)·g²
            // Everything detached: the state must not hold on to any graph.
            let (pt, g) = (p.as_tensor().detach(), g.detach());
            let decayed = (pt * (1.0 - lr * self.weight_decay))?;
            *m = ((&*m * b1)? + (&g * (1.0 - b1))?)?.detach();
            *v = ((&*v * b2)? + (g.sqr()? * (1.0 - b2))?)?.detach();
            // p ← p − lr/bc1 · m / (√v/√bc2 + ε)
            let denom = ((v.sqrt()? / bc2_sqrt)? + self.eps)?;
            p.set(&(decayed - ((&*m / denom)? * (lr / bc1))?)?)?;
        }
        Ok(())
    }

    /// Optimiser state for checkpoints: (m, v) per parameter.
    pub fn state(&self) -> (&[Tensor], &[Tensor]) {
        (&self.m, &self.v)
    }

    /// Puts back state saved from `state()` after `t` updates (resuming a checkpoint); one
    /// (m, v) per parameter, in `params` order, each of its parameter's shape.
    pub fn load_state(&mut self, m: Vec<Tensor>, v: Vec<Tensor>, t: usize) -> Result<()> {
        if m.len() != self.params.len() || v.len() != self.params.len() {
            candle_core::bail!(
                "optimiser state for {}/{} tensors, but there are {} parameters",
                m.len(),
                v.len(),
                self.params.len()
            );
        }
        for ((p, m), v) in self.params.iter().zip(&m).zip(&v) {
            if m.dims() != p.dims() || v.dims() != p.dims() {
                candle_core::bail!(
                    "optimiser state of shape {:?}/{:?} for a parameter of shape {:?}",
                    m.dims(),
                    v.dims(),
                    p.dims()
                );
            }
        }
        self.m = m;
        self.v = v;
        self.t = t;
        Ok(())
    }
}

/// Scales all gradients so their global L2 norm is at most `max_norm` (0 = no clipping).
/// Returns the norm before clipping.
pub fn clip_grad_norm(grads: &mut Grads, max_norm: f64) -> Result<f64> {
    let mut sq = 0f64;
    for g in grads.values() {
        sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
    }
    let norm = sq.sqrt();
    if max_norm > 0.0 {
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            for g in grads.values_mut() {
                *g = (&*g * coef)?;
            }
        }
    }
    Ok(norm)
}
