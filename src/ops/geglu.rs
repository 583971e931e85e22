//! GeGLU, Gemma's MLP gate: a = gelu_tanh(g) ⊙ u (`gelu_pytorch_tanh`), with its backward in
//! one pass. The twin of ops::swiglu: the same rounding (in 16-bit dtypes gelu(g) is rounded
//! to the activation dtype before the product, as transformers' `act_fn(gate) * up`), the same
//! [2, ...] output of the backward, dg then du.
//!
//! With t = tanh(k0 (g + k1 g³)), k0 = √(2/π), k1 = 0.044715 (PyTorch's tanh approximation):
//!   gelu(g) = ½ g (1 + t)
//!   gelu'(g) = ½ (1 + t) + ½ g (1 − t²) k0 (1 + 3 k1 g²)
//!   du = da ⊙ gelu(g),   dg = (da ⊙ u) ⊙ gelu'(g)

use super::{cpu_as_f32, cpu_from_f32, round_to};
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

const K0: f32 = 0.797_884_6; // √(2/π)
const K1: f32 = 0.044_715;

struct GeGlu;
struct GeGluBwd;

/// gelu_pytorch_tanh(g).
pub fn gelu_tanh(g: f32) -> f32 {
    0.5 * g * (1.0 + (K0 * (g + K1 * g * g * g)).tanh())
}

/// Its derivative.
pub fn gelu_tanh_grad(g: f32) -> f32 {
    let t = (K0 * (g + K1 * g * g * g)).tanh();
    0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * K0 * (1.0 + 3.0 * K1 * g * g)
}

/// g, u: [..., I] (same shape and dtype) → gelu_tanh(g) ⊙ u. Differentiable in g and u.
pub fn geglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    if g.shape() != u.shape() {
        candle_core::bail!("geglu: gate {:?} vs up {:?}", g.dims(), u.dims());
    }
    g.contiguous()?.apply_op2(&u.contiguous()?, GeGlu)
}

/// (g, u, da) → (dg, du), each shaped like g.
pub fn geglu_bwd(g: &Tensor, u: &Tensor, da: &Tensor) -> Result<(Tensor, Tensor)> {
    let both = g.contiguous()?.apply_op3_no_bwd(
        &u.contiguous()?,
        &da.to_dtype(g.dtype())?.contiguous()?,
        &GeGluBwd,
    )?; // [2, ...]
    Ok((both.get(0)?, both.get(1)?))
}

/// `geglu_bwd` and the forward's a = gelu(g) ⊙ u together: (g, u, da) → (dg, du, a), as
/// `swiglu_bwd_keep` (da consumed: a is written over it on CUDA in bf16).
pub fn geglu_bwd_keep(g: &Tensor, u: &Tensor, da: Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if let Some(r) = super::swiglu::cuda::bwd_keep("geglu_bwd_keep_v8_bf16", g, u, &da)? {
        return Ok(r);
    }
    let (dg, du) = geglu_bwd(g, u, &da)?;
    drop(da);
    Ok((dg, du, geglu(g, u)?))
}

impl CustomOp2 for GeGlu {
    fn name(&self) -> &'static str {
        "geglu"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (g, u) = (cpu_as_f32(gs, gl)?, cpu_as_f32(us, ul)?);
        let a = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| round_to(gelu_tanh(g), gs) * u)
            .collect();
        Ok((cpu_from_f32(a, gs)?, gl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        us: &candle_core::CudaStorage,
        ul: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::swiglu::cuda::elementwise("geglu", gs, gl, &[(us, ul)], 1)?;
        Ok((out, gl.shape().clone()))
    }

    fn bwd(
        &self,
        g: &Tensor,
        u: &Tensor,
        _res: &Tensor,
        da: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dg, du) = geglu_bwd(g, u, da)?;
        Ok((Some(dg), Some(du)))
    }
}

impl CustomOp3 for GeGluBwd {
    fn name(&self) -> &'static str {
        "geglu-bwd"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
        das: &CpuStorage,
        dal: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (g, u, da) = (
            cpu_as_f32(gs, gl)?,
            cpu_as_f32(us, ul)?,
            cpu_as_f32(das, dal)?,
        );
        let n = g.len();
        let mut out = vec![0f32; 2 * n];
        let (dg, du) = out.split_at_mut(n);
        for k in 0..n {
            dg[k] = round_to(da[k] * u[k], gs) * gelu_tanh_grad(g[k]);
            du[k] = da[k] * round_to(gelu_tanh(g[k]), gs);
        }
        let mut dims = vec![2];
        dims.extend_from_slice(gl.dims());
        Ok((cpu_from_f32(out, gs)?, Shape::from(dims)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        us: &candle_core::CudaStorage,
        ul: &Layout,
        das: &candle_core::CudaStorage,
        dal: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let mut dims = vec![2];
        dims.extend_from_slice(gl.dims());
        let out =
            super::swiglu::cuda::elementwise("geglu_bwd", gs, gl, &[(us, ul), (das, dal)], 2)?;
        Ok((out, Shape::from(dims)))
    }
}
