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

use candle_core::{Result, Tensor};

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
