//! Attention sinks (gpt-oss's `self_attn.sinks`): a learned logit s_h per head joins each
//! row's softmax denominator and carries no value, so a row's probabilities over its keys sum
//! to less than 1:
//!
//!   P'_ij = exp(z_ij − L'_i),  L'_i = log(Σ_j exp z_ij + exp s_h) = logaddexp(L_i, s_h)
//!
//! From the plain pass's output O and log-sum-exp L: O' = O · exp(L − L'). The backward is the
//! plain one's given (O', L'): it recomputes P' = exp(z − L'), and δ = rowsum(dO ⊙ O') is
//! Σ_j P'_ij dP_ij, the sink adding no term (its value is 0), so dS = P' ⊙ (dP − δ) as
//! transformers' eager softmax over [z, s] then dropping the sink's column gives it. The sinks
//! are frozen base weights: no gradient.
//!
//! Shapes: O [B, H, T, D]; L [B, H, T] f32; sinks [H].

use candle_core::{DType, Result, Tensor};

/// (O', L') from the plain pass's (O [B, H, T, D], L [B, H, T] f32) and the sinks [H] (any
/// float dtype): O' in O's dtype, L' f32.
pub fn apply_sinks(o: &Tensor, lse: &Tensor, sinks: &Tensor) -> Result<(Tensor, Tensor)> {
    let h = lse.dim(1)?;
    if sinks.dims() != [h] {
        candle_core::bail!(
            "attention sinks of shape {:?} for {h} heads (one logit per head wanted)",
            sinks.dims()
        );
    }
    let s = sinks.to_dtype(DType::F32)?.reshape((1, h, 1))?;
    // logaddexp, shifted by the larger of the two so neither exp overflows
    let m = lse.broadcast_maximum(&s)?;
    let sum = (lse - &m)?.exp()? + s.broadcast_sub(&m)?.exp()?;
    let lse2 = (m + sum?.log()?)?;
    let f = (lse - &lse2)?.exp()?.unsqueeze(3)?; // [B, H, T, 1] ≤ 1
    let o2 = o
        .to_dtype(DType::F32)?
        .broadcast_mul(&f)?
        .to_dtype(o.dtype())?;
    Ok((o2, lse2))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Against the softmax over [scores, sink] with the sink's column dropped, as transformers'
    /// eager gpt-oss attention computes it.
    #[test]
    fn sinks_join_the_denominator_only() {
        let dev = Device::Cpu;
        let (b, h, t, d) = (1, 2, 3, 2);
        let q = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
        let sinks = Tensor::new(&[0.7f32, -1.3], &dev).unwrap();
        let mask = super::super::AttnMask {
            sinks: Some(sinks.clone()),
            ..Default::default()
        };
        let (o, lse) = super::super::attention_fwd(&q, &k, &v, &mask, 0.5, Some(2)).unwrap();
        let z = (q.matmul(&k.t().unwrap()).unwrap() * 0.5).unwrap();
        let z: Vec<Vec<Vec<f32>>> = z.squeeze(0).unwrap().to_vec3().unwrap();
        let vv: Vec<Vec<Vec<f32>>> = v.squeeze(0).unwrap().to_vec3().unwrap();
        let o: Vec<Vec<Vec<f32>>> = o.squeeze(0).unwrap().to_vec3().unwrap();
        let lse: Vec<Vec<f32>> = lse.squeeze(0).unwrap().to_vec2().unwrap();
        let s = [0.7f32, -1.3];
        for hh in 0..h {
            for i in 0..t {
                let den: f32 = (0..=i).map(|j| z[hh][i][j].exp()).sum::<f32>() + s[hh].exp();
                assert!((lse[hh][i] - den.ln()).abs() < 1e-5);
                for c in 0..d {
                    let want: f32 = (0..=i)
                        .map(|j| z[hh][i][j].exp() / den * vv[hh][j][c])
                        .sum();
                    assert!((o[hh][i][c] - want).abs() < 1e-5, "{hh} {i} {c}");
                }
            }
        }
    }
}
