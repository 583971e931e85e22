//! A frozen weight kept in NF4 on the device (`super::nf4`'s format, its arrays as tensors),
//! and its dequantization to the compute dtype just in time, in tensor ops (so every device
//! candle runs on does it, the CPU included).
//!
//! Shapes: n weights, n/2 code bytes, nb = ⌈n / 64⌉ blocks, ⌈nb / 256⌉ nested blocks.

use super::nf4::{Absmax, Nested, Nf4, BLOCK, LEVELS, NESTED_BLOCK};
use candle_core::{DType, Device, Result, Tensor};

/// The absmax of each block on the device.
#[derive(Debug)]
enum DevAbsmax {
    /// [nb] f32.
    Plain(Tensor),
    /// Double quant: codes [nb] u8 of `map` [256] f32, scaled per 256 blocks by absmax
    /// [⌈nb / 256⌉] f32, plus `offset`.
    Nested {
        codes: Tensor,
        absmax: Tensor,
        map: Tensor,
        offset: f32,
    },
}

/// A frozen weight in NF4 on the device.
#[derive(Debug)]
pub struct QWeight {
    /// The weight's shape ([out, in] for a linear).
    pub shape: Vec<usize>,
    /// [n/2] u8, two codes a byte, the first value in the high nibble.
    codes: Tensor,
    absmax: DevAbsmax,
    /// [256, 2] f32: byte → (its high nibble's level, its low nibble's).
    pairs: Tensor,
}

impl QWeight {
    /// `w` (any dtype, any device) quantized as bitsandbytes' `quantize_4bit` would (its values
    /// are read to the host, quantized there and the NF4 arrays put back on w's device).
    pub fn quantize(w: &Tensor, double_quant: bool) -> Result<QWeight> {
        let host = w.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Self::from_nf4(&Nf4::quantize(&host, w.dims(), double_quant), w.device())
    }

    /// An NF4 weight's arrays on `device`.
    pub fn from_nf4(q: &Nf4, device: &Device) -> Result<QWeight> {
        let n = q.numel();
        if q.codes.len() != n.div_ceil(2) {
            candle_core::bail!(
                "nf4: {} code bytes for {n} weights (want {})",
                q.codes.len(),
                n.div_ceil(2)
            );
        }
        let blocks = n.div_ceil(BLOCK);
        let absmax = match &q.absmax {
            Absmax::Plain(a) => {
                check_len("absmax", a.len(), blocks)?;
                DevAbsmax::Plain(Tensor::from_slice(a, blocks, device)?)
            }
            Absmax::Nested(Nested {
                codes,
                absmax,
                map,
                offset,
            }) => {
                check_len("absmax codes", codes.len(), blocks)?;
                check_len("nested absmax", absmax.len(), blocks.div_ceil(NESTED_BLOCK))?;
                check_len("nested map", map.len(), 256)?;
                DevAbsmax::Nested {
                    codes: Tensor::from_slice(codes, blocks, device)?,
                    absmax: Tensor::from_slice(absmax, absmax.len(), device)?,
                    map: Tensor::from_slice(map, 256, device)?,
                    offset: *offset,
                }
            }
        };
        let pairs: Vec<f32> = (0..256usize)
            .flat_map(|b| [LEVELS[b >> 4], LEVELS[b & 15]])
            .collect();
        Ok(QWeight {
            shape: q.shape.clone(),
            codes: Tensor::from_slice(&q.codes, q.codes.len(), device)?,
            absmax,
            pairs: Tensor::from_vec(pairs, (256, 2), device)?,
        })
    }

    /// Elements of the weight.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Each block's absmax [nb] f32 (double quant undone: code2[q] · absmax2 + offset).
    fn absmax_f32(&self) -> Result<Tensor> {
        match &self.absmax {
            DevAbsmax::Plain(a) => Ok(a.clone()),
            DevAbsmax::Nested {
                codes,
                absmax,
                map,
                offset,
            } => {
                let nb = codes.dim(0)?;
                let scale = spread(absmax, NESTED_BLOCK, nb)?; // [nb]
                (map.index_select(&ids(codes)?, 0)? * scale)? + *offset as f64
            }
        }
    }

    /// The weight in `dtype`, `shape`d: level[code] · absmax in f32, then rounded.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        let n = self.numel();
        let levels = self
            .pairs
            .index_select(&ids(&self.codes)?, 0)?
            .flatten_all()?; // [2·⌈n/2⌉]
        let levels = levels.narrow(0, 0, n)?;
        let absmax = spread(&self.absmax_f32()?, BLOCK, n)?; // [n]
        (levels * absmax)?
            .to_dtype(dtype)?
            .reshape(self.shape.as_slice())
    }

    /// Bytes the format keeps on the device: codes and absmax (nested: its codes, absmax, map
    /// and offset), as `nf4::bytes_for` counts them.
    pub fn bytes(&self) -> usize {
        let t = crate::memory::tensor_bytes;
        let absmax = match &self.absmax {
            DevAbsmax::Plain(a) => t(a),
            DevAbsmax::Nested {
                codes, absmax, map, ..
            } => t(codes) + t(absmax) + t(map) + 4,
        };
        (t(&self.codes) + absmax) as usize
    }
}

/// u8 codes as u32 indices: candle's index_select reads an index of the type's maximum (255
/// for u8) as "no row" and gives zeros, where code 255 is a real one.
fn ids(codes: &Tensor) -> Result<Tensor> {
    codes.to_dtype(DType::U32)
}

/// x [k] with each value repeated `per` times, cut to n: [n].
fn spread(x: &Tensor, per: usize, n: usize) -> Result<Tensor> {
    let k = x.dim(0)?;
    x.unsqueeze(1)?
        .broadcast_as((k, per))?
        .flatten_all()?
        .narrow(0, 0, n)
}

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    match got == want {
        true => Ok(()),
        false => candle_core::bail!("nf4: {got} {what} values, the weight's shape implies {want}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tensor-op dequantization is the host one, bit for bit, both absmax forms, on a
    /// weight whose length is not a multiple of 64 nor of 2 · 64 · 256.
    #[test]
    fn dequantize_equals_the_host_format() {
        let n = 3 * 64 * 256 + 37;
        let mut w: Vec<f32> = (0..n)
            .map(|i| ((i as f32 * 0.731).sin() * (1.0 + (i % 97) as f32)).powi(3) * 1e-3)
            .collect();
        // A block of ±max pairs: bytes 0xff and 0x00 (code 255 is a real index).
        w[..64]
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = [1.0, -1.0][i / 2 % 2]);
        for dq in [false, true] {
            let q = Nf4::quantize(&w, &[n], dq);
            assert!(q.codes.contains(&255) && q.codes.contains(&0));
            if let Absmax::Nested(nest) = &q.absmax {
                assert!(
                    nest.codes.contains(&255),
                    "the largest absmax takes code 255"
                );
            }
            let d = QWeight::from_nf4(&q, &Device::Cpu).unwrap();
            let got = d.dequantize(DType::F32).unwrap().to_vec1::<f32>().unwrap();
            let want = q.dequantize();
            assert_eq!(got.len(), want.len());
            let bad = got
                .iter()
                .zip(&want)
                .filter(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(bad.count(), 0, "double_quant {dq}");
            assert_eq!(d.bytes(), q.bytes());
            let bf = d
                .dequantize(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let host = Tensor::new(want.as_slice(), &Device::Cpu).unwrap();
            let host = host
                .to_dtype(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            assert_eq!(bf.to_vec1::<f32>().unwrap(), host.to_vec1::<f32>().unwrap());
        }
    }

    /// A bad array length is an error, not a wrong-shaped weight.
    #[test]
    fn a_bad_length_is_refused() {
        let mut q = Nf4::quantize(&[0.5; 128], &[2, 64], false);
        q.codes.pop();
        let e = QWeight::from_nf4(&q, &Device::Cpu).unwrap_err().to_string();
        assert!(e.contains("63 code bytes for 128 weights"), "{e}");
    }
}
