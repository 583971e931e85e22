//! SwiGLU, the Llama MLP's gate: a = silu(g) ⊙ u, with its backward in one pass.
//!
//! Rounding follows transformers in 16-bit dtypes: `act_fn(gate)` is rounded to the activation
//! dtype before the product, and the product is rounded again.
//!
//! Backward, with σ = sigmoid(g):
//!   du = da ⊙ silu(g),   dg = (da ⊙ u) ⊙ σ (1 + g (1 − σ))
//! both from one read of (g, u, da): the output is [2, ...], dg then du.

use super::{cpu_as_f32, cpu_from_f32, round_to};
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

struct SwiGlu;
struct SwiGluBwd;

/// g, u: [..., I] (same shape and dtype) → silu(g) ⊙ u. Differentiable in g and u.
pub fn swiglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    if g.shape() != u.shape() {
        candle_core::bail!("swiglu: gate {:?} vs up {:?}", g.dims(), u.dims());
    }
    g.contiguous()?.apply_op2(&u.contiguous()?, SwiGlu)
}

/// (g, u, da) → (dg, du), each shaped like g.
pub fn swiglu_bwd(g: &Tensor, u: &Tensor, da: &Tensor) -> Result<(Tensor, Tensor)> {
    let both = g.contiguous()?.apply_op3_no_bwd(
        &u.contiguous()?,
        &da.to_dtype(g.dtype())?.contiguous()?,
        &SwiGluBwd,
    )?; // [2, ...]
    Ok((both.get(0)?, both.get(1)?))
}

/// `swiglu_bwd` and the forward's a = silu(g) ⊙ u together: (g, u, da) → (dg, du, a). `da` is
/// consumed: on CUDA (bf16) a is written over it in the same pass, so that a backward that
/// needs a only after da (down_proj's adapter gradient) pays neither a pass nor a buffer for
/// it; da must be a fresh result that nothing else holds. Elsewhere the two ops.
pub fn swiglu_bwd_keep(g: &Tensor, u: &Tensor, da: Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if let Some(r) = super::cuda::swiglu_bwd_keep(g, u, &da)? {
        return Ok(r);
    }
    let (dg, du) = swiglu_bwd(g, u, &da)?;
    drop(da);
    Ok((dg, du, swiglu(g, u)?))
}

fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
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
            .map(|(&g, &u)| round_to(silu(g), gs) * u)
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
        Ok((super::cuda::swiglu(gs, gl, us, ul)?, gl.shape().clone()))
    }

    fn bwd(
        &self,
        g: &Tensor,
        u: &Tensor,
        _res: &Tensor,
        da: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dg, du) = swiglu_bwd(g, u, da)?;
        Ok((Some(dg), Some(du)))
    }
}

impl CustomOp3 for SwiGluBwd {
    fn name(&self) -> &'static str {
        "swiglu-bwd"
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
            let s = 1.0 / (1.0 + (-g[k]).exp());
            dg[k] = round_to(da[k] * u[k], gs) * s * (1.0 + g[k] * (1.0 - s));
            du[k] = da[k] * round_to(g[k] * s, gs);
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
        Ok((
            super::cuda::swiglu_bwd(gs, gl, us, ul, das, dal)?,
            Shape::from(dims),
        ))
    }
}
