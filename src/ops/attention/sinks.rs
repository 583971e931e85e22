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
    let (lse2, f) = sink_lse(lse, sinks)?;
    let o2 = o
        .to_dtype(DType::F32)?
        .broadcast_mul(&f.unsqueeze(3)?)?
        .to_dtype(o.dtype())?;
    Ok((o2, lse2))
}

/// `apply_sinks` for O as token-major rows [B·T, H·D] (the tensor-core kernels' output), O'
/// in the same layout.
pub fn apply_sinks_rows(o: &Tensor, lse: &Tensor, sinks: &Tensor) -> Result<(Tensor, Tensor)> {
    let (b, h, t) = lse.dims3()?;
    let (m, hd) = o.dims2()?;
    if m != b * t || hd % h.max(1) != 0 {
        candle_core::bail!(
            "attention sinks: rows {:?} for L {:?}",
            o.dims(),
            lse.dims()
        );
    }
    let (lse2, f) = sink_lse(lse, sinks)?;
    let f = f.transpose(1, 2)?.contiguous()?.reshape((m, h, 1))?; // [B·T, H, 1]
    let o2 = o
        .reshape((m, h, hd / h))?
        .to_dtype(DType::F32)?
        .broadcast_mul(&f)?
        .to_dtype(o.dtype())?
        .reshape((m, hd))?;
    Ok((o2, lse2))
}

/// (L' [B, H, T], O's factor exp(L − L') [B, H, T]) f32 from L [B, H, T] f32 and the sinks.
fn sink_lse(lse: &Tensor, sinks: &Tensor) -> Result<(Tensor, Tensor)> {
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
    let f = (lse - &lse2)?.exp()?; // ≤ 1
    Ok((lse2, f))
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

    /// The rows form (the tensor-core kernels' layout) is the heads form, laid out as rows,
    /// with the same L'.
    #[test]
    fn rows_form_equals_the_heads_form() {
        let dev = Device::Cpu;
        let (b, h, t, d) = (2, 3, 4, 5);
        let o = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
        let lse = Tensor::randn(0f32, 1.0, (b, h, t), &dev).unwrap();
        let sinks = Tensor::new(&[0.7f32, -1.3, 2.0], &dev).unwrap();
        let (o1, l1) = apply_sinks(&o, &lse, &sinks).unwrap();
        let rows = o.transpose(1, 2).unwrap().contiguous().unwrap();
        let rows = rows.reshape((b * t, h * d)).unwrap();
        let (o2, l2) = apply_sinks_rows(&rows, &lse, &sinks).unwrap();
        let o1 = o1.transpose(1, 2).unwrap().contiguous().unwrap();
        let o1: Vec<f32> = o1.flatten_all().unwrap().to_vec1().unwrap();
        let o2: Vec<f32> = o2.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(o1, o2);
        let l1: Vec<f32> = l1.flatten_all().unwrap().to_vec1().unwrap();
        let l2: Vec<f32> = l2.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(l1, l2);
        assert!(apply_sinks_rows(&rows.narrow(0, 0, 3).unwrap(), &lse, &sinks).is_err());
    }
}
