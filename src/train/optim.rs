//! AdamW over the adapters (f32 state), as torch.optim.AdamW, and global-norm clipping as
//! torch.nn.utils.clip_grad_norm_.

use candle_core::{Result, Tensor, TensorId, Var};
use std::collections::HashMap;

/// Accumulated gradients, keyed by the parameter's tensor id.
pub type Grads = HashMap<TensorId, Tensor>;

pub struct AdamW {
    pub params: Vec<Var>,
    /// params[i] is flat[offsets[i]..offsets[i + 1]] of the flat state below.
    offsets: Vec<usize>,
    m: Tensor, // [P] f32, P = Σ param sizes
    v: Tensor, // [P] f32
    pub t: usize,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
}

impl AdamW {
    pub fn new(params: Vec<Var>, betas: [f64; 2], eps: f64, weight_decay: f64) -> Result<Self> {
        let mut offsets = vec![0];
        for p in &params {
            offsets.push(offsets[offsets.len() - 1] + p.elem_count());
        }
        let total = offsets[offsets.len() - 1];
        let (dtype, dev) = match params.first() {
            Some(p) => (p.dtype(), p.device().clone()),
            None => (candle_core::DType::F32, candle_core::Device::Cpu),
        };
        let m = Tensor::zeros(total, dtype, &dev)?;
        Ok(AdamW {
            params,
            offsets,
            v: m.clone(),
            m,
            t: 0,
            betas: (betas[0], betas[1]),
            eps,
            weight_decay,
        })
    }

    /// One step at learning rate `lr`. Parameters without a gradient (none reached them this
    /// step) are left alone, as torch does for `grad is None`.
    ///
    /// All parameters are updated as one flat vector: a LoRA model has hundreds of small
    /// adapters, and a dozen kernel launches each made the step launch-bound on GPUs. Each
    /// element sees the same f32 operations as a per-tensor update would.
    pub fn step(&mut self, grads: &Grads, lr: f64) -> Result<()> {
        if self.params.is_empty() {
            return Ok(());
        }
        self.t += 1;
        let (b1, b2) = self.betas;
        let bc1 = 1.0 - b1.powi(self.t as i32);
        let bc2_sqrt = (1.0 - b2.powi(self.t as i32)).sqrt();
        // Everything detached: the state must not hold on to any graph.
        let flat = |ts: &[Tensor]| -> Result<Tensor> {
            let parts = ts
                .iter()
                .map(|t| t.detach().flatten_all())
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&parts, 0)
        };
        let has: Vec<bool> = self
            .params
            .iter()
            .map(|p| grads.contains_key(&p.id()))
            .collect();
        let g = flat(
            &self
                .params
                .iter()
                .map(|p| match grads.get(&p.id()) {
                    Some(g) => Ok(g.clone()),
                    None => p.zeros_like(),
                })
                .collect::<Result<Vec<_>>>()?,
        )?;
        let p_old = flat(
            &self
                .params
                .iter()
                .map(|p| p.as_tensor().clone())
                .collect::<Vec<_>>(),
        )?;
        // p ← p·(1 − lr·wd); m ← β1·m + (1−β1)·g; v ← β2·v + (1−β2)·g²
        let decayed = (&p_old * (1.0 - lr * self.weight_decay))?;
        let m = ((&self.m * b1)? + (&g * (1.0 - b1))?)?;
        let v = ((&self.v * b2)? + (g.sqr()? * (1.0 - b2))?)?;
        // p ← p − lr/bc1 · m / (√v/√bc2 + ε)
        let denom = ((v.sqrt()? / bc2_sqrt)? + self.eps)?;
        let p_new = (decayed - ((&m / denom)? * (lr / bc1))?)?;
        if has.iter().all(|&h| h) {
            (self.m, self.v) = (m, v);
        } else {
            // Untouched parameters keep their moments.
            let pick = |new: &Tensor, old: &Tensor| -> Result<Tensor> {
                let parts = (0..self.params.len())
                    .map(|i| {
                        let (o, n) = (self.offsets[i], self.offsets[i + 1] - self.offsets[i]);
                        if has[i] { new } else { old }.narrow(0, o, n)
                    })
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&parts, 0)
            };
            (self.m, self.v) = (pick(&m, &self.m)?, pick(&v, &self.v)?);
        }
        for (i, p) in self.params.iter().enumerate() {
            if has[i] {
                let (o, n) = (self.offsets[i], self.offsets[i + 1] - self.offsets[i]);
                p.set(&p_new.narrow(0, o, n)?.reshape(p.shape())?)?;
            }
        }
        Ok(())
    }

    /// Optimiser state for checkpoints: (m, v) per parameter, in `params` order.
    pub fn state(&self) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        let split = |flat: &Tensor| -> Result<Vec<Tensor>> {
            self.params
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let (o, n) = (self.offsets[i], self.offsets[i + 1] - self.offsets[i]);
                    flat.narrow(0, o, n)?.reshape(p.shape())
                })
                .collect()
        };
        Ok((split(&self.m)?, split(&self.v)?))
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
        let flat = |ts: Vec<Tensor>| -> Result<Tensor> {
            if ts.is_empty() {
                return Ok(self.m.clone());
            }
            let parts = ts
                .iter()
                .map(|t| t.detach().flatten_all())
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&parts, 0)
        };
        (self.m, self.v) = (flat(m)?, flat(v)?);
        self.t = t;
        Ok(())
    }
}

/// Scales all gradients so their global L2 norm is at most `max_norm` (0 = no clipping).
/// Returns the norm before clipping. `order` (the optimiser's parameters) fixes the summation
/// order, so the norm is the same from run to run.
pub fn clip_grad_norm(grads: &mut Grads, order: &[Var], max_norm: f64) -> Result<f64> {
    let parts = order
        .iter()
        .filter_map(|p| grads.get(&p.id()))
        .map(|g| g.detach().flatten_all())
        .collect::<Result<Vec<_>>>()?;
    if parts.is_empty() {
        return Ok(0.0);
    }
    // One flat vector in rows of ROW: one f32 partial sum per row on the device, then the
    // rows in f64 on the host: few kernels, one sync, and f32 sums of ROW values only.
    const ROW: usize = 1 << 14;
    let g = Tensor::cat(&parts, 0)?;
    let n = g.elem_count();
    let g = g.pad_with_zeros(0, 0, n.div_ceil(ROW) * ROW - n)?;
    let rows = g.reshape(((), ROW))?.sqr()?.sum(1)?; // [rows] f32
    let sq: f64 = rows.to_vec1::<f32>()?.iter().map(|&x| x as f64).sum();
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
