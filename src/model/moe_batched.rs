//! A MoE layer's experts as batched GEMMs (the `moe_batched` experiment, `Moe::batched`): the
//! grouped rows of `router::Routing` laid out as [E, cap, ·], cap the most tokens any expert
//! got, each expert's run padded with zero rows, so that every projection of every expert is
//! one strided-batched GEMM ([E, cap, in] × [E, in, out]) instead of one GEMM per expert.
//! Padded rows hold zeros in and get zero gradients, so they add nothing to any sum: the
//! results are the grouped path's up to the order of the GEMMs' sums. The padded layout holds
//! E·cap rows where the grouped one holds m·k (about 1.2× under even routing): the memory plan
//! counts the grouped path's.
//!
//! Shapes as layer_moe.rs: m tokens, C hidden, E experts, k per token, I an expert's width,
//! r the adapters' rank; P = m·k grouped rows, cap ≤ P.

use super::layer_moe::{ExpertActs, PerExpert};
use super::layer_moe::{Grad, Moe};
use crate::ops::glu::Act;
use candle_core::{DType, Result, Tensor};

/// The map between the grouped rows and the padded [E, cap] layout.
pub struct Padded {
    /// [E·cap] u32: the grouped row of each padded slot, or P (the appended zero row).
    pad: Tensor,
    /// [P] u32: the padded slot of each grouped row.
    unpad: Tensor,
    experts: usize,
    cap: usize,
}

impl Padded {
    /// For the experts' token counts (the runs of the grouped order).
    pub fn new(counts: &[usize], dev: &candle_core::Device) -> Result<Padded> {
        let (experts, cap) = (
            counts.len(),
            counts.iter().copied().max().unwrap_or(0).max(1),
        );
        let rows: usize = counts.iter().sum();
        let mut pad = vec![rows as u32; experts * cap];
        let mut unpad = Vec::with_capacity(rows);
        let mut off = 0;
        for (e, &n) in counts.iter().enumerate() {
            for i in 0..n {
                pad[e * cap + i] = (off + i) as u32;
                unpad.push((e * cap + i) as u32);
            }
            off += n;
        }
        Ok(Padded {
            pad: Tensor::from_vec(pad, experts * cap, dev)?,
            unpad: Tensor::from_vec(unpad, rows, dev)?,
            experts,
            cap,
        })
    }

    /// Grouped rows x [P, d] → [E, cap, d].
    pub fn pad(&self, x: &Tensor) -> Result<Tensor> {
        let d = x.dim(1)?;
        let zero = Tensor::zeros((1, d), x.dtype(), x.device())?;
        Tensor::cat(&[x, &zero], 0)?
            .index_select(&self.pad, 0)?
            .reshape((self.experts, self.cap, d))
    }

    /// [E, cap, d] → the grouped rows [P, d].
    pub fn unpad(&self, y: &Tensor) -> Result<Tensor> {
        let d = y.dim(2)?;
        y.reshape((self.experts * self.cap, d))?
            .index_select(&self.unpad, 0)
    }
}

impl PerExpert {
    /// Every expert's y = x Wᵀ + s·(x A_eᵀ) B_eᵀ at once, x [E, cap, in], from the base
    /// product; (y, s·x A_eᵀ [E, cap, r]).
    fn add_all(&self, x: &Tensor, base: Tensor) -> Result<(Tensor, Tensor)> {
        let xa = (x.matmul(&self.a.t()?)? * self.scale)?;
        let y = (base + xa.matmul(&self.b.t()?)?)?;
        Ok((y, xa))
    }

    /// The backward of `add_all` for g [E, cap, out]: the adapter's term of dL/dx [E, cap, in]
    /// and (dA [E, r, in], dB [E, out, r]) in f32.
    fn bwd_all(&self, x: &Tensor, xa: &Tensor, g: &Tensor) -> Result<(Tensor, Grad)> {
        let gb = g.matmul(&self.b)?; // [E, cap, r]
        let dx = (gb.matmul(&self.a)? * self.scale)?;
        let da = (gb.t()?.matmul(x)? * self.scale)?.to_dtype(DType::F32)?;
        let db = g.t()?.matmul(xa)?.to_dtype(DType::F32)?;
        Ok((dx, (da, db)))
    }
}

impl Moe {
    /// Every expert's forward over its padded run x [E, cap, C]: `ExpertActs` of [E, cap, ·].
    pub(super) fn experts_fwd_all(
        &self,
        x: &Tensor,
        (gu_ad, down_ad): (Option<&PerExpert>, Option<&PerExpert>),
    ) -> Result<ExpertActs> {
        let i = self.spec.inter;
        let gu = x.matmul(&self.gate_up.t()?)?; // [E, cap, 2I]
        let (gu, xa_gu) = match gu_ad {
            Some(p) => {
                let (y, xa) = p.add_all(x, gu)?;
                (y, Some(xa))
            }
            None => (gu, None),
        };
        let gate = gu.narrow(2, 0, i)?.contiguous()?;
        let up = gu.narrow(2, i, i)?.contiguous()?;
        let a = Act::Silu.glu(&gate, &up)?;
        let y = a.matmul(&self.down.t()?)?; // [E, cap, C]
        let (y, xa_down) = match down_ad {
            Some(p) => {
                let (y, xa) = p.add_all(&a, y)?;
                (y, Some(xa))
            }
            None => (y, None),
        };
        Ok(ExpertActs {
            gate,
            up,
            a,
            xa_gu,
            xa_down,
            y,
        })
    }

    /// The experts' backward for gy = dL/dy [E, cap, C] (the routing weights applied) from
    /// their forward `acts` over x [E, cap, C]: dL/dx [E, cap, C], and the adapters' gradients
    /// as PEFT lays them out (dA [E·r, in], dB [out, r·E] f32), gate_up's then down's.
    #[allow(clippy::type_complexity)]
    pub(super) fn experts_bwd_all(
        &self,
        x: &Tensor,
        acts: &ExpertActs,
        gy: &Tensor,
        (gu_ad, down_ad): (Option<&PerExpert>, Option<&PerExpert>),
    ) -> Result<(Tensor, Option<Grad>, Option<Grad>)> {
        let mut da = gy.matmul(&self.down)?; // [E, cap, I]
        let mut down_grads = None;
        if let (Some(p), Some(xa)) = (down_ad, &acts.xa_down) {
            let (dx, gr) = p.bwd_all(&acts.a, xa, gy)?;
            da = (da + dx)?;
            down_grads = Some(peft_layout(gr)?);
        }
        let (dgate, dup) = Act::Silu.glu_bwd(&acts.gate, &acts.up, &da)?;
        let dgu = Tensor::cat(&[&dgate, &dup], 2)?; // [E, cap, 2I]
        let mut dx = dgu.matmul(&self.gate_up)?; // [E, cap, C]
        let mut gu_grads = None;
        if let (Some(p), Some(xa)) = (gu_ad, &acts.xa_gu) {
            let (dxa, gr) = p.bwd_all(x, xa, &dgu)?;
            dx = (dx + dxa)?;
            gu_grads = Some(peft_layout(gr)?);
        }
        Ok((dx, gu_grads, down_grads))
    }
}

/// (dA [E, r, in], dB [E, out, r]) → PEFT's dA [E·r, in] and dB [out, r·E] (column j·E + e).
fn peft_layout((da, db): Grad) -> Result<Grad> {
    let (e, r, in_f) = da.dims3()?;
    let out = db.dim(1)?;
    let da = da.reshape((e * r, in_f))?;
    let db = db.permute((1, 2, 0))?.contiguous()?.reshape((out, r * e))?;
    Ok((da, db))
}

#[cfg(test)]
mod tests {
    use super::Padded;
    use candle_core::{Device, Tensor};

    #[test]
    fn padding_round_trips_the_grouped_rows() {
        let dev = Device::Cpu;
        let counts = [2usize, 0, 3, 1];
        let x = Tensor::arange(1f32, 13.0, &dev)
            .unwrap()
            .reshape((6, 2))
            .unwrap();
        let p = Padded::new(&counts, &dev).unwrap();
        let padded = p.pad(&x).unwrap();
        assert_eq!(padded.dims(), [4, 3, 2]);
        let rows: Vec<Vec<Vec<f32>>> = padded.to_vec3().unwrap();
        assert_eq!(rows[0], [[1., 2.], [3., 4.], [0., 0.]]);
        assert_eq!(rows[1], [[0., 0.]; 3]);
        assert_eq!(rows[2], [[5., 6.], [7., 8.], [9., 10.]]);
        assert_eq!(rows[3], [[11., 12.], [0., 0.], [0., 0.]]);
        let back: Vec<Vec<f32>> = p.unpad(&padded).unwrap().to_vec2().unwrap();
        assert_eq!(back, x.to_vec2::<f32>().unwrap());
    }
}
