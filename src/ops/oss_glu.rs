//! gpt-oss's clamped SwiGLU (`GptOssExperts._apply_gate`), elementwise over gate and up
//! [P, I] with α (swiglu_alpha, 1.702) and the limit L (swiglu_limit, 7.0):
//!
//!   g = min(gate, L),  u = clamp(up, −L, L),  a = (u + 1) · g · σ(α·g)
//!
//! Its backward, as torch's clamp passes a gradient (where the input lies within the bounds,
//! ends included):
//!
//!   dgate = da · (u + 1) · (σ + α·g·σ·(1 − σ)) · [gate ≤ L],  dup = da · g·σ · [|up| ≤ L]
//!
//! Tensor ops (any device and dtype; the backward in f32). The experts read gate and up as the
//! even and odd columns of gate_up_proj's output (`deinterleave`, `interleave`).

use candle_core::{DType, Result, Tensor};

/// a = (clamp(up) + 1) · g · σ(α·g), g = min(gate, limit). Differentiable (candle's graph:
/// the reference forward).
pub fn oss_glu(gate: &Tensor, up: &Tensor, alpha: f64, limit: f64) -> Result<Tensor> {
    let g = gate.minimum(limit)?;
    let u = up.clamp(-limit, limit)?;
    let sig = ((&g * -alpha)?.exp()? + 1.0)?.recip()?;
    (u + 1.0)? * (g * sig)?
}

/// `oss_glu`'s backward for da = dL/da: (dL/dgate, dL/dup) in gate's dtype.
pub fn oss_glu_bwd(
    gate: &Tensor,
    up: &Tensor,
    da: &Tensor,
    alpha: f64,
    limit: f64,
) -> Result<(Tensor, Tensor)> {
    let dt = gate.dtype();
    let f = |t: &Tensor| t.to_dtype(DType::F32);
    let (gate, up, da) = (f(gate)?, f(up)?, f(da)?);
    let g = gate.minimum(limit)?;
    let u = up.clamp(-limit, limit)?;
    let in_gate = gate.le(limit)?.to_dtype(DType::F32)?;
    let in_up = (up.ge(-limit)?.to_dtype(DType::F32)? * up.le(limit)?.to_dtype(DType::F32)?)?;
    let sig = ((&g * -alpha)?.exp()? + 1.0)?.recip()?;
    let glu = (&g * &sig)?;
    // d(g·σ(αg))/dg = σ + α·g·σ·(1 − σ)
    let dsig = ((&sig * (1.0 - &sig)?)? * &g)?.affine(alpha, 0.0)?;
    let dg = ((&da * (u + 1.0)?)? * (sig + dsig)?)?;
    let dgate = (dg * in_gate)?.to_dtype(dt)?;
    let dup = ((da * glu)? * in_up)?.to_dtype(dt)?;
    Ok((dgate, dup))
}

/// gate_up's output [P, 2I] with gate and up interleaved (gate = even columns, up = odd) →
/// (gate, up) [P, I] each, contiguous. Differentiable.
pub fn deinterleave(gu: &Tensor) -> Result<(Tensor, Tensor)> {
    let (p, two_i) = gu.dims2()?;
    let pairs = gu.reshape((p, two_i / 2, 2))?;
    let part = |j: usize| pairs.narrow(2, j, 1)?.squeeze(2)?.contiguous();
    Ok((part(0)?, part(1)?))
}

/// `deinterleave`'s inverse: (dgate, dup) [P, I] → [P, 2I] (gate in the even columns).
pub fn interleave(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let (p, i) = gate.dims2()?;
    Tensor::stack(&[gate, up], 2)?.reshape((p, 2 * i))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The hand-written backward equals autograd's through the clamps, on both sides of them.
    #[test]
    fn backward_matches_autograd_across_the_clamps() {
        let dev = Device::Cpu;
        let gate = Var::new(&[[-9.0f32, -0.5, 0.3, 6.9, 7.5, 12.0]], &dev).unwrap();
        let up = Var::new(&[[-8.0f32, -6.5, 0.0, 2.0, 7.2, -0.1]], &dev).unwrap();
        let da = Tensor::new(&[[0.3f32, -1.0, 0.7, 1.1, -0.4, 2.0]], &dev).unwrap();
        let a = oss_glu(gate.as_tensor(), up.as_tensor(), 1.702, 7.0).unwrap();
        let g = (a * &da).unwrap().sum_all().unwrap().backward().unwrap();
        let (dgate, dup) = oss_glu_bwd(gate.as_tensor(), up.as_tensor(), &da, 1.702, 7.0).unwrap();
        for (got, want) in [(dgate, g.get(&gate).unwrap()), (dup, g.get(&up).unwrap())] {
            let (got, want): (Vec<f32>, Vec<f32>) = (
                got.flatten_all().unwrap().to_vec1().unwrap(),
                want.flatten_all().unwrap().to_vec1().unwrap(),
            );
            for (x, y) in got.iter().zip(&want) {
                assert!(
                    (x - y).abs() <= 1e-6 * y.abs().max(1.0),
                    "{got:?} vs {want:?}"
                );
            }
        }
        // the clamped entries pass no gradient
        let (dgate, dup) = oss_glu_bwd(gate.as_tensor(), up.as_tensor(), &da, 1.702, 7.0).unwrap();
        let dgate: Vec<f32> = dgate.flatten_all().unwrap().to_vec1().unwrap();
        let dup: Vec<f32> = dup.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!((dgate[4], dgate[5], dup[0], dup[4]), (0.0, 0.0, 0.0, 0.0));
        // a = (u + 1)·g·σ(αg) at gate 0.3, up 0
        let a: Vec<f32> = oss_glu(gate.as_tensor(), up.as_tensor(), 1.702, 7.0)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let want = 0.3 / (1.0 + (-1.702f32 * 0.3).exp());
        assert!((a[2] - want).abs() < 1e-7);
        let gu = Tensor::new(&[[1f32, 2., 3., 4.]], &dev).unwrap();
        let (g2, u2) = deinterleave(&gu).unwrap();
        assert_eq!(g2.to_vec2::<f32>().unwrap(), [[1., 3.]]);
        assert_eq!(
            interleave(&g2, &u2).unwrap().to_vec2::<f32>().unwrap(),
            [[1., 2., 3., 4.]]
        );
    }
}
