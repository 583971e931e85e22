//! A MoE layer's routed experts in NF4 (`[model] quantize = "nf4"`): each expert's gate, up and
//! down matrices quantized apart, as bitsandbytes quantizes transformers 4.x's per-expert
//! `Linear4bit`s (the same blocks of 64, double quant, `QWeight`), and dequantized a tile of
//! experts at a time into the fused layout the grouped GEMMs take (model/layer_moe.rs).
//!
//! Shapes: E experts, I an expert's width, C hidden; gate_up [E, 2I, C] (gate rows first;
//! gpt-oss's gate and up rows interleaved, its two row halves quantized apart all the same),
//! down [E, C, I]; a tile of t experts dequantizes to [t, 2I, C] and [t, C, I].

use super::weight::QWeight;
use candle_core::{DType, Result, Tensor};

/// Bytes of the compute-dtype weights one tile of experts dequantizes to (gate_up and down):
/// the scratch the grouped GEMMs read, reused tile after tile on CUDA.
pub const TILE_BYTES: usize = 256 << 20;

/// The experts a tile takes: as many as fit `TILE_BYTES` in `dtype_bytes` a weight, at least
/// one, at most all E.
pub fn tile_experts(experts: usize, inter: usize, hidden: usize, dtype_bytes: usize) -> usize {
    let per = (3 * inter * hidden * dtype_bytes).max(1);
    (TILE_BYTES / per).clamp(1, experts.max(1))
}

/// A MoE layer's experts in NF4, one `QWeight` per expert and matrix. A clone shares its
/// arrays.
#[derive(Debug, Clone)]
pub struct ExpertsNf4 {
    /// gate_e [I, C] for each expert.
    gate: Vec<QWeight>,
    /// up_e [I, C].
    up: Vec<QWeight>,
    /// down_e [C, I].
    down: Vec<QWeight>,
    /// I.
    inter: usize,
    /// C.
    hidden: usize,
}

impl ExpertsNf4 {
    /// gate_up [E, 2I, C] and down [E, C, I] (any dtype, any device) quantized expert by
    /// expert, each of gate_e, up_e and down_e alone (`QWeight::quantize`).
    pub fn quantize(gate_up: &Tensor, down: &Tensor, double_quant: bool) -> Result<ExpertsNf4> {
        let (e, two_i, c) = gate_up.dims3()?;
        let i = two_i / 2;
        if two_i % 2 != 0 || down.dims() != [e, c, i] {
            candle_core::bail!(
                "nf4: experts gate_up {:?} and down {:?} are not [E, 2I, C] and [E, C, I]",
                gate_up.dims(),
                down.dims()
            );
        }
        let (mut gate, mut up, mut dn) = (vec![], vec![], vec![]);
        for x in 0..e {
            let gu = gate_up.get(x)?;
            gate.push(QWeight::quantize(
                &gu.narrow(0, 0, i)?.contiguous()?,
                double_quant,
            )?);
            up.push(QWeight::quantize(
                &gu.narrow(0, i, i)?.contiguous()?,
                double_quant,
            )?);
            dn.push(QWeight::quantize(
                &down.get(x)?.contiguous()?,
                double_quant,
            )?);
        }
        Ok(ExpertsNf4 {
            gate,
            up,
            down: dn,
            inter: i,
            hidden: c,
        })
    }

    /// E.
    pub fn experts(&self) -> usize {
        self.gate.len()
    }

    /// (E, I, C).
    pub fn shape(&self) -> (usize, usize, usize) {
        (self.experts(), self.inter, self.hidden)
    }

    /// Experts [e0, e0 + n) dequantized to `dtype`: (gate_up [n, 2I, C], down [n, C, I]). On
    /// CUDA into `scratch` (made on first use, a tile of `cap` experts, reused by the next
    /// call) by nf4.cu's kernel where the views are aligned for it; elsewhere fresh tensors.
    /// A caller that keeps the returned tensors past its next call passes no scratch.
    pub fn tile(
        &self,
        (e0, n): (usize, usize),
        dtype: DType,
        scratch: Option<&mut Scratch>,
    ) -> Result<(Tensor, Tensor)> {
        if e0 + n > self.experts() || n == 0 {
            candle_core::bail!("nf4: experts {e0}..{} of {}", e0 + n, self.experts());
        }
        #[cfg(feature = "cuda")]
        if let Some(s) = scratch {
            if let Some(t) = self.tile_cuda((e0, n), dtype, s)? {
                return Ok(t);
            }
        }
        #[cfg(not(feature = "cuda"))]
        let _ = scratch;
        let mut gu = Vec::with_capacity(n);
        let mut dn = Vec::with_capacity(n);
        for x in e0..e0 + n {
            let (g, u) = (
                self.gate[x].dequantize(dtype)?,
                self.up[x].dequantize(dtype)?,
            );
            gu.push(Tensor::cat(&[g, u], 0)?);
            dn.push(self.down[x].dequantize(dtype)?);
        }
        Ok((Tensor::stack(&gu, 0)?, Tensor::stack(&dn, 0)?))
    }

    /// Every expert dequantized: (gate_up [E, 2I, C], down [E, C, I]) in `dtype`.
    pub fn dequantize(&self, dtype: DType) -> Result<(Tensor, Tensor)> {
        self.tile((0, self.experts()), dtype, None)
    }

    /// Bytes the format keeps (`QWeight::bytes` of every matrix).
    pub fn bytes(&self) -> usize {
        self.all().map(QWeight::bytes).sum()
    }

    /// Every matrix's arrays (`QWeight::arrays`): gate's, up's, then down's, expert by expert.
    pub fn arrays(&self) -> Vec<&Tensor> {
        self.all().flat_map(QWeight::arrays).collect()
    }

    /// `arrays`, mutable (FSDP shards them and puts views of a gather back).
    pub(crate) fn arrays_mut(&mut self) -> Vec<&mut Tensor> {
        let mats = self
            .gate
            .iter_mut()
            .chain(&mut self.up)
            .chain(&mut self.down);
        mats.flat_map(QWeight::arrays_mut).collect()
    }

    fn all(&self) -> impl Iterator<Item = &QWeight> {
        self.gate.iter().chain(&self.up).chain(&self.down)
    }
}

/// The reused CUDA buffers a tile of experts is dequantized into: gate_up [cap, 2I, C] and down
/// [cap, C, I]. Empty until the first tile.
#[derive(Default)]
pub struct Scratch {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    bufs: Option<(Tensor, Tensor)>,
    /// Experts a buffer holds.
    pub cap: usize,
}

impl Scratch {
    /// Buffers for tiles of up to `cap` experts.
    pub fn new(cap: usize) -> Scratch {
        Scratch { bufs: None, cap }
    }
}

#[cfg(feature = "cuda")]
impl ExpertsNf4 {
    /// `tile` by nf4.cu's kernel into the scratch; None off CUDA, for a dtype the kernel does
    /// not write, a tile over the scratch's size, or views the kernel cannot take aligned.
    fn tile_cuda(
        &self,
        (e0, n): (usize, usize),
        dtype: DType,
        s: &mut Scratch,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let Some(codes) = self.gate.first().and_then(|q| q.arrays().first().copied()) else {
            return Ok(None);
        };
        let candle_core::Device::Cuda(dev) = codes.device() else {
            return Ok(None);
        };
        let (i, c) = (self.inter, self.hidden);
        // every matrix's first element at a multiple of 16 bytes from the buffer's start
        let aligned = (i * c * dtype.size_in_bytes()) % 16 == 0;
        if n > s.cap || !matches!(dtype, DType::BF16 | DType::F32) || !aligned {
            return Ok(None);
        }
        let fits = |b: &(Tensor, Tensor)| b.0.dtype() == dtype && b.0.dim(0).ok() == Some(s.cap);
        if !s.bufs.as_ref().is_some_and(fits) {
            // SAFETY: the kernel writes every element of a tile's matrices before the GEMMs read
            // them; rows past a short tile are never read (the tile is a narrow of the buffer).
            let made = unsafe {
                (
                    crate::ops::cuda::uninit(dev, dtype, (s.cap, 2 * i, c))?,
                    crate::ops::cuda::uninit(dev, dtype, (s.cap, c, i))?,
                )
            };
            let (Some(gu), Some(dn)) = made else {
                return Ok(None);
            };
            s.bufs = Some((gu, dn));
        }
        let Some((gu, dn)) = &s.bufs else {
            return Ok(None);
        };
        for j in 0..n {
            let (x, g) = (e0 + j, gu.get(j)?);
            self.gate[x].dequantize_into(&g.narrow(0, 0, i)?)?;
            self.up[x].dequantize_into(&g.narrow(0, i, i)?)?;
            self.down[x].dequantize_into(&dn.get(j)?)?;
        }
        Ok(Some((gu.narrow(0, 0, n)?, dn.narrow(0, 0, n)?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::Nf4;
    use candle_core::Device;

    /// Each expert's gate, up and down dequantize to the host format of that matrix quantized
    /// alone, bit for bit, in any tile; a tile of the right experts; and the bytes are the
    /// matrices'.
    #[test]
    fn each_expert_matrix_is_quantized_alone() {
        let (e, i, c) = (3, 40, 48); // 1920 weights a matrix: 30 blocks
        let dev = Device::Cpu;
        let v = |n: usize, k: f32| -> Vec<f32> {
            (0..n)
                .map(|x| ((x as f32 * k).sin() * (1.0 + (x % 7) as f32)) * 0.01)
                .collect()
        };
        let gu = Tensor::from_vec(v(e * 2 * i * c, 0.37), (e, 2 * i, c), &dev).unwrap();
        let dn = Tensor::from_vec(v(e * c * i, 0.91), (e, c, i), &dev).unwrap();
        for dq in [false, true] {
            let q = ExpertsNf4::quantize(&gu, &dn, dq).unwrap();
            let (g2, d2) = q.tile((1, 2), DType::F32, None).unwrap();
            assert_eq!(g2.dims(), &[2, 2 * i, c]);
            assert_eq!(d2.dims(), &[2, c, i]);
            let host = |t: Tensor, shape: &[usize]| {
                let h = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                Nf4::quantize(&h, shape, dq).dequantize()
            };
            for j in 0..2 {
                let x = 1 + j;
                let src = gu.get(x).unwrap();
                let mut want = host(src.narrow(0, 0, i).unwrap(), &[i, c]);
                want.extend(host(src.narrow(0, i, i).unwrap(), &[i, c]));
                let got = g2.get(j).unwrap().flatten_all().unwrap();
                assert_eq!(got.to_vec1::<f32>().unwrap(), want, "gate_up {x} dq {dq}");
                let want = host(dn.get(x).unwrap(), &[c, i]);
                let got = d2.get(j).unwrap().flatten_all().unwrap();
                assert_eq!(got.to_vec1::<f32>().unwrap(), want, "down {x} dq {dq}");
            }
            let per = 2 * crate::quant::nf4::bytes_for(i * c, dq)
                + crate::quant::nf4::bytes_for(c * i, dq);
            assert_eq!(q.bytes(), e * per);
            assert!(q.tile((2, 2), DType::F32, None).is_err());
        }
        // a tile takes what fits 256 MiB: Qwen3-30B-A3B's experts (I 768, C 2048) in bf16
        assert_eq!(tile_experts(128, 768, 2048, 2), 28);
        assert_eq!(tile_experts(8, 24, 32, 4), 8);
    }
}
