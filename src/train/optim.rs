//! AdamW over the adapters (f32 state), as torch.optim.AdamW, and global-norm clipping as
//! torch.nn.utils.clip_grad_norm_.

use candle_core::{Result, Tensor, TensorId, Var};
use std::collections::HashMap;

/// Accumulated gradients, keyed by the parameter's tensor id.
pub type Grads = HashMap<TensorId, Tensor>;

/// Parameters are updated in groups of consecutive tensors of at most this many elements
/// (a larger tensor is a group alone): a few kernels per group instead of a dozen per tensor,
/// and a transient of about 8 f32 copies of one group (256 MiB), not of every parameter.
pub const GROUP: usize = 1 << 23;

/// A run of consecutive parameters and their AdamW moments, flat.
struct Group {
    /// Index of the group's first parameter in `AdamW::params`.
    first: usize,
    /// params[first + j] is flat[offsets[j]..offsets[j + 1]] of m and v.
    offsets: Vec<usize>,
    m: Tensor, // [n] f32
    v: Tensor, // [n] f32
}

impl Group {
    fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    /// The j-th parameter's (offset, size) in the flat state.
    fn span(&self, j: usize) -> (usize, usize) {
        (self.offsets[j], self.offsets[j + 1] - self.offsets[j])
    }
}

pub struct AdamW {
    pub params: Vec<Var>,
    groups: Vec<Group>,
    pub t: usize,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
}

/// Every tensor detached and flattened, concatenated.
fn flat(ts: &[Tensor]) -> Result<Tensor> {
    let parts = ts
        .iter()
        .map(|t| t.detach().flatten_all())
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&parts, 0)
}

impl AdamW {
    pub fn new(params: Vec<Var>, betas: [f64; 2], eps: f64, weight_decay: f64) -> Result<Self> {
        Self::with_group(params, betas, eps, weight_decay, GROUP)
    }

    /// `new` with groups of at most `group` elements (tests use small ones).
    pub fn with_group(
        params: Vec<Var>,
        betas: [f64; 2],
        eps: f64,
        weight_decay: f64,
        group: usize,
    ) -> Result<Self> {
        let mut groups: Vec<Group> = Vec::new();
        for (i, p) in params.iter().enumerate() {
            let n = p.elem_count();
            match groups.last_mut() {
                Some(g) if g.offsets[g.len()] + n <= group => {
                    let end = g.offsets[g.len()];
                    g.offsets.push(end + n);
                }
                _ => groups.push(Group {
                    first: i,
                    offsets: vec![0, n],
                    m: Tensor::zeros(n, p.dtype(), p.device())?,
                    v: Tensor::zeros(n, p.dtype(), p.device())?,
                }),
            }
        }
        for g in &mut groups {
            let p = &params[g.first];
            g.m = Tensor::zeros(g.offsets[g.len()], p.dtype(), p.device())?;
            g.v = g.m.clone();
        }
        Ok(AdamW {
            params,
            groups,
            t: 0,
            betas: (betas[0], betas[1]),
            eps,
            weight_decay,
        })
    }

    /// One step at learning rate `lr`. Parameters without a gradient (none reached them this
    /// step) are left alone, as torch does for `grad is None`.
    ///
    /// Each group of parameters is updated as one flat vector: a LoRA model has hundreds of
    /// small adapters, and a dozen kernel launches each made the step launch-bound on GPUs.
    /// Each element sees the same f32 operations as a per-tensor update would.
    pub fn step(&mut self, grads: &Grads, lr: f64) -> Result<()> {
        if self.params.is_empty() {
            return Ok(());
        }
        self.t += 1;
        let (b1, b2) = self.betas;
        let bc1 = 1.0 - b1.powi(self.t as i32);
        let bc2_sqrt = (1.0 - b2.powi(self.t as i32)).sqrt();
        let (eps, wd) = (self.eps, self.weight_decay);
        for g in &mut self.groups {
            let params = &self.params[g.first..g.first + g.len()];
            let has: Vec<bool> = params.iter().map(|p| grads.contains_key(&p.id())).collect();
            if !has.iter().any(|&h| h) {
                continue;
            }
            // Everything detached: the state must not hold on to any graph.
            let grad = flat(
                &params
                    .iter()
                    .map(|p| match grads.get(&p.id()) {
                        Some(g) => Ok(g.clone()),
                        None => p.zeros_like(),
                    })
                    .collect::<Result<Vec<_>>>()?,
            )?;
            let p_old = flat(
                &params
                    .iter()
                    .map(|p| p.as_tensor().clone())
                    .collect::<Vec<_>>(),
            )?;
            // p ← p·(1 − lr·wd); m ← β1·m + (1−β1)·g; v ← β2·v + (1−β2)·g²
            let decayed = (&p_old * (1.0 - lr * wd))?;
            drop(p_old);
            let m = ((&g.m * b1)? + (&grad * (1.0 - b1))?)?;
            let v = ((&g.v * b2)? + (grad.sqr()? * (1.0 - b2))?)?;
            drop(grad);
            // p ← p − lr/bc1 · m / (√v/√bc2 + ε)
            let denom = ((v.sqrt()? / bc2_sqrt)? + eps)?;
            let p_new = (decayed - ((&m / denom)? * (lr / bc1))?)?;
            if has.iter().all(|&h| h) {
                (g.m, g.v) = (m, v);
            } else {
                // Untouched parameters keep their moments.
                let pick = |new: &Tensor, old: &Tensor| -> Result<Tensor> {
                    let parts = (0..g.len())
                        .map(|j| {
                            let (o, n) = g.span(j);
                            if has[j] { new } else { old }.narrow(0, o, n)
                        })
                        .collect::<Result<Vec<_>>>()?;
                    Tensor::cat(&parts, 0)
                };
                (g.m, g.v) = (pick(&m, &g.m)?, pick(&v, &g.v)?);
            }
            for (j, p) in params.iter().enumerate() {
                if has[j] {
                    let (o, n) = g.span(j);
                    p.set(&p_new.narrow(0, o, n)?.reshape(p.shape())?)?;
                }
            }
        }
        Ok(())
    }

    /// Optimiser state for checkpoints: (m, v) per parameter, in `params` order.
    pub fn state(&self) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        let (mut ms, mut vs) = (Vec::new(), Vec::new());
        for g in &self.groups {
            for j in 0..g.len() {
                let (o, n) = g.span(j);
                let shape = self.params[g.first + j].shape();
                ms.push(g.m.narrow(0, o, n)?.reshape(shape)?);
                vs.push(g.v.narrow(0, o, n)?.reshape(shape)?);
            }
        }
        Ok((ms, vs))
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
        for g in &mut self.groups {
            let r = g.first..g.first + g.len();
            (g.m, g.v) = (flat(&m[r.clone()])?, flat(&v[r])?);
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Groups change how many kernels run, not one number: one group, groups of a few
    /// tensors and a tensor per group give identical parameters and moments, also when a
    /// parameter misses its gradient in a step.
    #[test]
    fn grouping_changes_nothing_but_the_kernel_count() {
        let dev = Device::Cpu;
        let shapes: [&[usize]; 5] = [&[3, 4], &[5], &[2, 2, 2], &[7, 1], &[6]];
        let run = |group: usize| -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
            let params: Vec<Var> = shapes
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let n: usize = s.iter().product();
                    let v: Vec<f32> = (0..n)
                        .map(|k| ((i * 31 + k * 7) % 13) as f32 / 5.0 - 1.0)
                        .collect();
                    Var::from_tensor(&Tensor::from_vec(v, *s, &dev).unwrap()).unwrap()
                })
                .collect();
            let mut opt = AdamW::with_group(params.clone(), [0.9, 0.99], 1e-8, 0.1, group).unwrap();
            for step in 0..3 {
                let mut grads = Grads::new();
                for (i, p) in params.iter().enumerate() {
                    // Parameter 2 gets no gradient in step 1.
                    if step == 1 && i == 2 {
                        continue;
                    }
                    let g = ((p.as_tensor() * (0.3 + i as f64)).unwrap() + step as f64).unwrap();
                    grads.insert(p.id(), g);
                }
                opt.step(&grads, 1e-2).unwrap();
            }
            let vals = params
                .iter()
                .map(|p| {
                    p.as_tensor()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                })
                .collect();
            let (m, _) = opt.state().unwrap();
            let ms = m
                .iter()
                .map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
                .collect();
            (vals, ms)
        };
        let one = run(GROUP);
        assert_eq!(run(1), one, "a tensor per group");
        assert_eq!(run(13), one, "groups of a few tensors");
        // And the step did move the parameters.
        assert!(one.0[0].iter().zip([-1.0f32, 0.4]).any(|(a, b)| a != &b));
    }
}
