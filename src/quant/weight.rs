//! A frozen weight kept in NF4 on the device (`super::nf4`'s format, its arrays as tensors),
//! and its dequantization to the compute dtype just in time, in tensor ops (so every device
//! candle runs on does it, the CPU included).
//!
//! Shapes: n weights, n/2 code bytes, nb = ⌈n / 64⌉ blocks, ⌈nb / 256⌉ nested blocks.

use super::nf4::{Absmax, Nested, Nf4, BLOCK, LEVELS, NESTED_BLOCK};
use candle_core::{DType, Device, Result, Tensor};

/// The absmax of each block on the device.
#[derive(Debug, Clone)]
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

/// A frozen weight in NF4 on the device. A clone shares its arrays (tensors are handles).
#[derive(Debug, Clone)]
pub struct QWeight {
    /// The weight's shape ([out, in] for a linear).
    pub(crate) shape: Vec<usize>,
    /// [n/2] u8, two codes a byte, the first value in the high nibble.
    codes: Tensor,
    absmax: DevAbsmax,
}

impl QWeight {
    /// `w` (any dtype, any device) quantized as bitsandbytes' `quantize_4bit` would: on CUDA
    /// by nf4.cu's kernel (the absmax values nested on the host), elsewhere on the host.
    pub fn quantize(w: &Tensor, double_quant: bool) -> Result<QWeight> {
        #[cfg(feature = "cuda")]
        if let Some(q) = Self::quantize_cuda(w, double_quant)? {
            return Ok(q);
        }
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
            Absmax::Nested(nest) => {
                check_len("absmax codes", nest.codes.len(), blocks)?;
                let groups = blocks.div_ceil(NESTED_BLOCK);
                check_len("nested absmax", nest.absmax.len(), groups)?;
                check_len("nested map", nest.map.len(), 256)?;
                nested_on(nest, device)?
            }
        };
        Ok(QWeight {
            shape: q.shape.clone(),
            codes: Tensor::from_slice(&q.codes, q.codes.len(), device)?,
            absmax,
        })
    }

    /// The format's arrays in a fixed order: codes [n/2] u8, then absmax [nb] f32, or double
    /// quant's codes [nb] u8, absmax [⌈nb / 256⌉] f32 and map [256] f32 (the offset is a host
    /// value). FSDP shards them (`Layer::frozen_mut`) and puts views of a gather back.
    pub(crate) fn arrays_mut(&mut self) -> Vec<&mut Tensor> {
        let mut v = vec![&mut self.codes];
        match &mut self.absmax {
            DevAbsmax::Plain(a) => v.push(a),
            DevAbsmax::Nested {
                codes, absmax, map, ..
            } => v.extend([codes, absmax, map]),
        }
        v
    }

    /// `arrays_mut`'s tensors, read only.
    pub fn arrays(&self) -> Vec<&Tensor> {
        let mut v = vec![&self.codes];
        match &self.absmax {
            DevAbsmax::Plain(a) => v.push(a),
            DevAbsmax::Nested {
                codes, absmax, map, ..
            } => v.extend([codes, absmax, map]),
        }
        v
    }

    /// Elements of the weight.
    pub(crate) fn numel(&self) -> usize {
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

    /// The weight in `dtype`, `shape`d: level[code] · absmax in f32, then rounded. On CUDA
    /// one kernel (nf4.cu) for bf16 and f32; elsewhere tensor ops.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(w) = self.dequantize_cuda(dtype)? {
            return Ok(w);
        }
        let n = self.numel();
        let levels = pairs(self.codes.device())?
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
    pub(crate) fn bytes(&self) -> usize {
        let t = crate::ops::tensor_bytes;
        let absmax = match &self.absmax {
            DevAbsmax::Plain(a) => t(a),
            DevAbsmax::Nested {
                codes, absmax, map, ..
            } => t(codes) + t(absmax) + t(map) + 4,
        };
        (t(&self.codes) + absmax) as usize
    }
}

#[cfg(feature = "cuda")]
impl QWeight {
    /// nf4.cu's kernel into a fresh `dtype` weight; None off CUDA or for another dtype.
    fn dequantize_cuda(&self, dtype: DType) -> Result<Option<Tensor>> {
        let (Device::Cuda(dev), true) = (
            self.codes.device(),
            matches!(dtype, DType::BF16 | DType::F32),
        ) else {
            return Ok(None);
        };
        // SAFETY: dequantize_into writes every one of the n elements.
        let Some(out) = (unsafe { crate::ops::cuda::uninit(dev, dtype, self.shape.as_slice())? })
        else {
            return Ok(None);
        };
        self.dequantize_into(&out)?;
        Ok(Some(out))
    }

    /// The weight dequantized into `out` (a contiguous bf16 or f32 CUDA tensor of its elements,
    /// 16-byte aligned, e.g. a view of a `Slabs` buffer).
    pub(crate) fn dequantize_into(&self, out: &Tensor) -> Result<()> {
        use candle_core::cuda::cudarc::driver::PushKernelArg;
        use candle_core::cuda::WrapErr;
        let Device::Cuda(dev) = self.codes.device() else {
            candle_core::bail!("nf4: dequantize_into on a weight off CUDA");
        };
        let name = match out.dtype() {
            DType::BF16 => "nf4_dequant_bf16",
            DType::F32 => "nf4_dequant_f32",
            d => candle_core::bail!("nf4: dequantize into {d:?}"),
        };
        let (Some(po), pc) = (crate::ops::cuda::addr(out)?, raw(&self.codes)?) else {
            candle_core::bail!("nf4: dequantize into a tensor that is not contiguous on CUDA");
        };
        if out.elem_count() != self.numel() || po % 16 != 0 {
            candle_core::bail!(
                "nf4: dequantize {} weights into {} at address {po:#x} (16-byte aligned wanted)",
                self.numel(),
                out.elem_count()
            );
        }
        let func = crate::ops::cuda::function(dev, name)?;
        let (pa, pac, pa2, pm2, offset) = match &self.absmax {
            DevAbsmax::Plain(a) => (raw(a)?, 0, 0, 0, 0f32),
            DevAbsmax::Nested {
                codes,
                absmax,
                map,
                offset,
            } => (0, raw(codes)?, raw(absmax)?, raw(map)?, *offset),
        };
        let n = self.numel() as i64;
        let cfg = crate::ops::cuda::elems(self.numel().div_ceil(16).max(1))?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&pc).arg(&pa).arg(&pac).arg(&pa2).arg(&pm2);
        b.arg(&offset).arg(&po).arg(&n);
        // SAFETY: the addresses are this weight's live contiguous arrays on this device (codes
        // ⌈n/2⌉ bytes from a fresh allocation, so 8-byte loads at even multiples of 8 are
        // aligned; absmax or the nested arrays of the lengths `from_nf4` checked; 0 for the
        // form not in use) and `out`, n elements checked above, 16-byte aligned; they outlive the
        // launch in stream order.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
}

#[cfg(feature = "cuda")]
impl QWeight {
    /// nf4.cu's quantizing kernel over a contiguous bf16 or f32 CUDA `w`; None otherwise.
    fn quantize_cuda(w: &Tensor, double_quant: bool) -> Result<Option<QWeight>> {
        use candle_core::cuda::cudarc::driver::PushKernelArg;
        use candle_core::cuda::WrapErr;
        let (Device::Cuda(dev), Some(pw)) = (w.device(), crate::ops::cuda::addr(w)?) else {
            return Ok(None);
        };
        let name = match w.dtype() {
            DType::BF16 => "nf4_quantize_bf16",
            DType::F32 => "nf4_quantize_f32",
            _ => return Ok(None),
        };
        let n = w.elem_count();
        let blocks = n.div_ceil(BLOCK);
        let func = crate::ops::cuda::function(dev, name)?;
        let wrap = |s| candle_core::Storage::Cuda(s);
        let codes = candle_core::CudaStorage::wrap_cuda_slice(
            dev.alloc_zeros::<u8>(n.div_ceil(2))?,
            dev.clone(),
        );
        let absmax =
            candle_core::CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<f32>(blocks)?, dev.clone());
        let none = candle_core::op::BackpropOp::none;
        let codes = Tensor::from_storage(wrap(codes), n.div_ceil(2), none(), false);
        let absmax = Tensor::from_storage(wrap(absmax), blocks, none(), false);
        let (pc, pa) = (raw(&codes)?, raw(&absmax)?);
        let nl = n as i64;
        let cfg = crate::ops::cuda::elems(blocks.max(1))?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&pw).arg(&nl).arg(&pc).arg(&pa);
        // SAFETY: w is a live contiguous CUDA tensor of n elements of the kernel's dtype; codes
        // and absmax are fresh ⌈n/2⌉ bytes and ⌈n/64⌉ floats, each written by one thread.
        unsafe { b.launch(cfg) }.w()?;
        let absmax = match double_quant {
            false => DevAbsmax::Plain(absmax),
            true => {
                let nested = super::nf4::nest(&absmax.to_vec1::<f32>()?);
                nested_on(&nested, w.device())?
            }
        };
        Ok(Some(QWeight {
            shape: w.dims().to_vec(),
            codes,
            absmax,
        }))
    }
}

#[cfg(not(feature = "cuda"))]
impl QWeight {
    /// The weight dequantized into `out`: CUDA builds only (`Slabs` hands out no buffer
    /// elsewhere).
    pub(crate) fn dequantize_into(&self, _out: &Tensor) -> Result<()> {
        candle_core::bail!("nf4: dequantizing into a buffer needs a CUDA build")
    }
}

/// The device address of a contiguous u8 or f32 CUDA tensor's first element.
#[cfg(feature = "cuda")]
fn raw(t: &Tensor) -> Result<u64> {
    use candle_core::cuda::cudarc::driver::DevicePtr;
    let (s, l) = t.storage_and_layout();
    let (candle_core::Storage::Cuda(cs), true) = (&*s, l.is_contiguous()) else {
        candle_core::bail!("nf4: an array is not a contiguous CUDA tensor");
    };
    let stream = cs.device.cuda_stream();
    let p = match t.dtype() {
        DType::U8 => cs.as_cuda_slice::<u8>()?.device_ptr(&stream).0,
        DType::F32 => cs.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
        d => candle_core::bail!("nf4: an array of {d:?}"),
    };
    Ok(p + (l.start_offset() * t.dtype().size_in_bytes()) as u64)
}

/// u8 codes as u32 indices: candle's index_select reads an index of the type's maximum (255
/// for u8) as "no row" and gives zeros, where code 255 is a real one.
fn ids(codes: &Tensor) -> Result<Tensor> {
    codes.to_dtype(DType::U32)
}

/// Double quant's arrays on `device`.
fn nested_on(n: &Nested, device: &Device) -> Result<DevAbsmax> {
    Ok(DevAbsmax::Nested {
        codes: Tensor::from_slice(&n.codes, n.codes.len(), device)?,
        absmax: Tensor::from_slice(&n.absmax, n.absmax.len(), device)?,
        map: Tensor::from_slice(&n.map, n.map.len(), device)?,
        offset: n.offset,
    })
}

/// [256, 2] f32: byte → (its high nibble's level, its low nibble's).
fn pairs(device: &Device) -> Result<Tensor> {
    let pairs: Vec<f32> = (0..256usize)
        .flat_map(|b| [LEVELS[b >> 4], LEVELS[b & 15]])
        .collect();
    Tensor::from_vec(pairs, (256, 2), device)
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
