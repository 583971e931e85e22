//! AdamW over the adapters (f32 state), as torch.optim.AdamW, and global-norm clipping as
//! torch.nn.utils.clip_grad_norm_.

use crate::ops::multi_tensor;
use candle_core::{Device, Result, Tensor, TensorId, Var};
use std::collections::HashMap;

/// Accumulated gradients, keyed by the parameter's tensor id.
pub type Grads = HashMap<TensorId, Tensor>;

/// Parameters are updated in groups of at most this many elements (train::sizes).
pub(crate) use super::sizes::OPTIM_GROUP as GROUP;

/// A run of consecutive parameters and their AdamW moments, flat.
struct Group {
    /// Index of the group's first parameter in `AdamW::params`.
    first: usize,
    /// params[first + j] is flat[offsets[j]..offsets[j + 1]] of m and v.
    offsets: Vec<usize>,
    /// [n] f32
    m: Tensor,
    /// [n] f32
    v: Tensor,
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

/// AdamW (torch.optim.AdamW's update and bias correction) over the trainable `Var`s.
pub struct AdamW {
    pub(crate) params: Vec<Var>,
    groups: Vec<Group>,
    /// Updates applied: the bias-correction counter.
    pub t: usize,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
    /// Whether the last step ran as the fused CUDA kernel.
    fused: bool,
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
    /// AdamW over `params` with (β₁, β₂) `betas`, `eps` and decoupled `weight_decay`; the
    /// moments start at zero.
    pub fn new(params: Vec<Var>, betas: [f64; 2], eps: f64, weight_decay: f64) -> Result<Self> {
        Self::with_group(params, betas, eps, weight_decay, GROUP)
    }

    /// `new` with groups of at most `group` elements (tests use small ones).
    pub(crate) fn with_group(
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
            // Two buffers: the fused step writes them in place.
            g.m = Tensor::zeros(g.offsets[g.len()], p.dtype(), p.device())?;
            g.v = Tensor::zeros(g.offsets[g.len()], p.dtype(), p.device())?;
        }
        Ok(AdamW {
            params,
            groups,
            t: 0,
            betas: (betas[0], betas[1]),
            eps,
            weight_decay,
            fused: false,
        })
    }

    /// One step at learning rate `lr`, the gradients scaled by `grad_scale` first (the clip
    /// factor of `grad_norm`; 1 leaves them as they are). Parameters without a gradient (none
    /// reached them this step) are left alone, as torch does for `grad is None`.
    ///
    /// Each group of parameters is updated as one flat vector: a LoRA model has hundreds of
    /// small adapters, and a dozen kernel launches each made the step launch-bound on GPUs.
    /// Each element sees the same f32 operations as a per-tensor update would. On CUDA, with
    /// contiguous f32 parameters and gradients, the whole step is one kernel
    /// (`ops::multi_tensor`) with those same roundings, in place.
    pub fn step(&mut self, grads: &Grads, lr: f64, grad_scale: f64) -> Result<()> {
        if self.params.is_empty() {
            return Ok(());
        }
        self.t += 1;
        let scalars = self.scalars(lr, grad_scale);
        let (b1, b2) = self.betas;
        let (eps, wd) = (self.eps, self.weight_decay);
        let (bc1, bc2_sqrt) = self.bias_corrections();
        self.fused = self.step_fused(grads, &scalars, None)?;
        if self.fused {
            return Ok(());
        }
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
            // The same rounding as scaling each tensor: one f32 product per element.
            let grad = if grad_scale < 1.0 {
                (grad * grad_scale)?
            } else {
                grad
            };
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

    /// Whether the last step ran as one CUDA kernel (else as tensor ops).
    pub fn last_step_fused(&self) -> bool {
        self.fused
    }

    /// Step t's bias corrections: (1 − β1ᵗ, √(1 − β2ᵗ)).
    fn bias_corrections(&self) -> (f64, f64) {
        let (b1, b2) = self.betas;
        let t = self.t as i32;
        (1.0 - b1.powi(t), (1.0 - b2.powi(t)).sqrt())
    }

    /// Step `self.t`'s f32 factors, each rounded from f64 as the tensor ops round theirs.
    fn scalars(&self, lr: f64, grad_scale: f64) -> multi_tensor::AdamScalars {
        let (b1, b2) = self.betas;
        let (bc1, bc2_sqrt) = self.bias_corrections();
        multi_tensor::AdamScalars {
            coef: if grad_scale < 1.0 {
                grad_scale as f32
            } else {
                1.0
            },
            decay: (1.0 - lr * self.weight_decay) as f32,
            b1: b1 as f32,
            nb1: (1.0 - b1) as f32,
            b2: b2 as f32,
            nb2: (1.0 - b2) as f32,
            inv_bc2: (1.0 / bc2_sqrt) as f32,
            eps: self.eps as f32,
            step: (lr / bc1) as f32,
        }
    }

    /// One step under `clip` (`clip_step`). A device clip goes to the fused kernel as it lies,
    /// which leaves everything as it is when the step is not finite, so nothing waits for the
    /// gradients: the step counter advances as if it were, and `untake` takes that back when
    /// the step's readback (`StepClip::from_vals`) later says it was not. A host clip steps
    /// only when finite. Whether the counter advanced.
    pub(crate) fn step_clip(&mut self, grads: &Grads, lr: f64, clip: &StepClip) -> Result<bool> {
        let (coef, finite) = match clip {
            StepClip::Host(c, finite) => (c.coef, *finite),
            StepClip::Device(dc) => {
                if self.params.is_empty() {
                    return Ok(false);
                }
                self.t += 1;
                let scalars = self.scalars(lr, 1.0);
                if self.step_fused(grads, &scalars, Some(dc))? {
                    self.fused = true;
                    return Ok(true);
                }
                self.t -= 1;
                let v = dc.to_vec1::<f32>()?; // [‖g‖, coef, skip]
                (v[1] as f64, v[2] == 0.0)
            }
        };
        if finite {
            self.step(grads, lr, coef)?;
        }
        Ok(finite)
    }

    /// Takes back a step `step_clip` counted that the step's readback found not finite (the
    /// kernel skipped it).
    pub(crate) fn untake(&mut self) {
        self.t = self.t.saturating_sub(1);
    }

    /// The step as one CUDA kernel over every parameter that has a gradient; false (nothing
    /// done) when any of them, its gradient or its moments is not a contiguous f32 CUDA buffer.
    /// With `clip` ([‖g‖, coef, skip] on the device) its coef and skip instead of `s.coef`.
    fn step_fused(
        &mut self,
        grads: &Grads,
        s: &multi_tensor::AdamScalars,
        clip: Option<&Tensor>,
    ) -> Result<bool> {
        let Some(Device::Cuda(dev)) = self.params.first().map(|p| p.device().clone()) else {
            return Ok(false);
        };
        let addr = multi_tensor::f32_addr;
        let mut table = Vec::with_capacity(self.params.len());
        for g in &self.groups {
            for j in 0..g.len() {
                let p = &self.params[g.first + j];
                let Some(grad) = grads.get(&p.id()) else {
                    continue;
                };
                let (o, n) = g.span(j);
                let (m, v) = (g.m.narrow(0, o, n)?, g.v.narrow(0, o, n)?);
                let (Some(pa), Some(ga), Some(ma), Some(va)) =
                    (addr(p)?, addr(grad)?, addr(&m)?, addr(&v)?)
                else {
                    return Ok(false);
                };
                if grad.elem_count() != n || !grad.device().same_device(p.device()) {
                    return Ok(false);
                }
                table.push(multi_tensor::MultiT {
                    p: pa,
                    g: ga,
                    m: ma,
                    v: va,
                    n: n as i64,
                });
            }
        }
        #[cfg(feature = "cuda")]
        {
            if table.is_empty() {
                return Ok(true);
            }
            match clip {
                None => multi_tensor::adamw(&dev, &table, s)?,
                Some(c) => {
                    use candle_core::Storage;
                    let (st, l) = c.storage_and_layout();
                    let (Storage::Cuda(cs), (0, 3)) =
                        (&*st, l.contiguous_offsets().unwrap_or((1, 0)))
                    else {
                        return Ok(false);
                    };
                    multi_tensor::adamw_clip(&dev, &table, s, cs.as_cuda_slice::<f32>()?)?;
                }
            }
            Ok(true)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (dev, table, s, clip);
            Ok(false)
        }
    }

    /// Optimiser state for checkpoints: (m, v) per parameter, in `params` order (views of
    /// the device's group buffers).
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
    pub(crate) fn load_state(&mut self, m: Vec<Tensor>, v: Vec<Tensor>, t: usize) -> Result<()> {
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

/// The gradients' global L2 norm, and the factor that clips it to `max_norm` as
/// torch.nn.utils.clip_grad_norm_ does (max_norm / (norm + 1e-6) when that is below 1; else
/// 1, and always 1 for max_norm = 0): `AdamW::step` applies it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Clip {
    /// ‖g‖₂ over every gradient.
    pub norm: f64,
    /// The factor the gradients are multiplied by (1: unclipped).
    pub coef: f64,
}

/// A step's clipping and finite check (`clip_step`): on CUDA computed on the device right after
/// the gradients, so that the update is queued without the host waiting for them and read
/// later; elsewhere computed at once.
pub(crate) enum StepClip {
    /// [‖g‖, coef, skip] f32 on the device (`multi_tensor::clip_step`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Device(Tensor),
    /// The clipping, and whether the loss and ‖g‖ are finite.
    Host(Clip, bool),
}

impl StepClip {
    /// A device clip's [‖g‖, coef, skip], to read on the host with the step's other scalars
    /// (`train::readback`); None for a host clip.
    pub(crate) fn on_device(&self) -> Option<&Tensor> {
        match self {
            StepClip::Device(t) => Some(t),
            StepClip::Host(..) => None,
        }
    }

    /// (‖g‖, whether the step's loss and gradients are finite): a host clip's own, a device
    /// clip's from `vals`, what was read of `on_device()`.
    #[allow(clippy::wrong_self_convention)] // `from` the values read: the name is its call sites'
    pub(crate) fn from_vals(&self, vals: &[f64; 3]) -> (f64, bool) {
        match self {
            StepClip::Host(c, finite) => (c.norm, *finite),
            StepClip::Device(_) => (vals[0], vals[2] == 0.0),
        }
    }
}

/// The step's `StepClip` for `max_norm` (≤ 0: no clipping); `ce`, the step's Σ CE as an f32
/// scalar on the device (None: nothing counted), joins the finite check.
pub(crate) fn clip_step(
    grads: &Grads,
    order: &[Var],
    max_norm: f64,
    ce: Option<&Tensor>,
) -> Result<StepClip> {
    #[cfg(feature = "cuda")]
    {
        let ce_addr = match ce {
            Some(c) if c.dtype() == candle_core::DType::F32 => crate::ops::cuda::addr(c)?,
            Some(_) => None,
            None => Some(0),
        };
        if let (Some((d, table)), Some(ce_addr)) = (grad_table(grads, order)?, ce_addr) {
            use candle_core::{op::BackpropOp, CudaStorage, Storage};
            let out = multi_tensor::clip_step(&d, &table, ce_addr, max_norm)?;
            let t = Tensor::from_storage(
                Storage::Cuda(CudaStorage::wrap_cuda_slice(out, d)),
                3,
                BackpropOp::none(),
                false,
            );
            // ce stays alive until the kernel ran: its free is queued after it.
            return Ok(StepClip::Device(t));
        }
    }
    let c = grad_norm(grads, order, max_norm)?;
    let loss_ok = match ce {
        Some(ce) => ce
            .to_dtype(candle_core::DType::F64)?
            .to_scalar::<f64>()?
            .is_finite(),
        None => true,
    };
    let finite = loss_ok && c.norm.is_finite();
    Ok(StepClip::Host(c, finite))
}

/// `Clip` of `grads`. `order` (the optimiser's parameters) fixes the summation order, so the
/// norm is the same from run to run.
pub fn grad_norm(grads: &Grads, order: &[Var], max_norm: f64) -> Result<Clip> {
    let sq = match sumsq_fused(grads, order)? {
        Some(sq) => sq,
        None => sumsq(grads, order)?,
    };
    let norm = sq.sqrt();
    let coef = if max_norm > 0.0 {
        (max_norm / (norm + 1e-6)).min(1.0)
    } else {
        1.0
    };
    Ok(Clip { norm, coef })
}

/// Σ g² as tensor ops: one flat vector in rows of ROW, one f32 partial sum per row on the
/// device, then the rows in f64 on the host (few kernels, one sync, f32 sums of ROW values).
fn sumsq(grads: &Grads, order: &[Var]) -> Result<f64> {
    let parts = order
        .iter()
        .filter_map(|p| grads.get(&p.id()))
        .map(|g| g.detach().flatten_all())
        .collect::<Result<Vec<_>>>()?;
    if parts.is_empty() {
        return Ok(0.0);
    }
    const ROW: usize = 1 << 14;
    let g = Tensor::cat(&parts, 0)?;
    let n = g.elem_count();
    let g = g.pad_with_zeros(0, 0, n.div_ceil(ROW) * ROW - n)?;
    let rows = g.reshape(((), ROW))?.sqr()?.sum(1)?; // [rows] f32
    Ok(rows.to_vec1::<f32>()?.iter().map(|&x| x as f64).sum())
}

/// The multi-tensor table of the gradients (their g and length), in `order`, and their
/// device; None where there is none or a gradient is not a contiguous f32 CUDA buffer.
#[cfg(feature = "cuda")]
fn grad_table(
    grads: &Grads,
    order: &[Var],
) -> Result<Option<(candle_core::CudaDevice, Vec<multi_tensor::MultiT>)>> {
    let mut table = Vec::new();
    let mut dev = None;
    for g in order.iter().filter_map(|p| grads.get(&p.id())) {
        let (Some(ga), Device::Cuda(d)) = (multi_tensor::f32_addr(g)?, g.device()) else {
            return Ok(None);
        };
        dev.get_or_insert_with(|| d.clone());
        table.push(multi_tensor::MultiT {
            g: ga,
            n: g.elem_count() as i64,
            ..Default::default()
        });
    }
    Ok(dev.map(|d| (d, table)))
}

/// Σ g² as one CUDA kernel; None where a gradient is not a contiguous f32 CUDA buffer.
fn sumsq_fused(grads: &Grads, order: &[Var]) -> Result<Option<f64>> {
    #[cfg(feature = "cuda")]
    if let Some((dev, table)) = grad_table(grads, order)? {
        return multi_tensor::sumsq(&dev, &table).map(Some);
    }
    let _ = (grads, order);
    Ok(None)
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
                opt.step(&grads, 1e-2, 1.0).unwrap();
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

    /// Clipping is a factor handed to the step: stepping with it equals stepping with the
    /// gradients scaled first (torch's clip_grad_norm_ then step), to the bit; and the factor
    /// is torch's max_norm / (norm + 1e-6), or 1 when the norm is within.
    #[test]
    fn the_clip_factor_equals_scaling_the_gradients_first() {
        let dev = Device::Cpu;
        let mk = || -> Vec<Var> {
            [[0.5f32, -1.0, 2.0], [3.0, 0.25, -0.75]]
                .iter()
                .map(|v| Var::from_tensor(&Tensor::new(v, &dev).unwrap()).unwrap())
                .collect()
        };
        let grads_of = |ps: &[Var], k: f64| -> Grads {
            ps.iter()
                .map(|p| (p.id(), ((p.as_tensor() * 3.0).unwrap() * k).unwrap()))
                .collect()
        };
        let (pa, pb) = (mk(), mk());
        let ga = grads_of(&pa, 1.0);
        let clip = grad_norm(&ga, &pa, 1.0).unwrap();
        let sq: f64 = [0.5f64, -1.0, 2.0, 3.0, 0.25, -0.75]
            .iter()
            .map(|&x| (3.0 * x) * (3.0 * x))
            .sum();
        assert!(
            (clip.norm - sq.sqrt()).abs() < 1e-5,
            "{} vs {}",
            clip.norm,
            sq.sqrt()
        );
        assert!((clip.coef - 1.0 / (clip.norm + 1e-6)).abs() < 1e-12);
        assert_eq!(grad_norm(&ga, &pa, 100.0).unwrap().coef, 1.0);
        assert_eq!(grad_norm(&ga, &pa, 0.0).unwrap().coef, 1.0);
        let mut oa = AdamW::new(pa.clone(), [0.9, 0.99], 1e-8, 0.1).unwrap();
        let mut ob = AdamW::new(pb.clone(), [0.9, 0.99], 1e-8, 0.1).unwrap();
        oa.step(&ga, 1e-2, clip.coef).unwrap();
        ob.step(&grads_of(&pb, clip.coef), 1e-2, 1.0).unwrap();
        for (a, b) in pa.iter().zip(&pb) {
            let (a, b) = (
                a.as_tensor().to_vec1::<f32>().unwrap(),
                b.as_tensor().to_vec1::<f32>().unwrap(),
            );
            assert_eq!(a, b);
        }
    }
}
