//! LoRA dropout's masks, from a counter-based generator: each element's keep bit is a pure
//! function of (seed, step, micro-batch, layer, module, element index), computed where it is
//! used (the CUDA kernels draw it in registers, the CPU here), so that nothing is drawn on the
//! host, uploaded or stored, and the CPU and CUDA paths draw the same masks bit for bit.
//!
//! The generator is Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
//! 3", SC'11; the Random123 library's known answers are pinned in the tests):
//!   key     = the SplitMix64 stream of (seed, step, micro-batch) (`rng::Rng::keyed`), 2 × 32 bits
//!   counter = (g mod 2³², g div 2³², layer, module), g = e div 8 for element e
//! One call gives 128 bits: the 16-bit lane e mod 8 of them (word (e mod 8) div 2, the low half
//! for an even e) is element e's. Layer and module are the global ones (`Linear::key`: the
//! model's layer index, the module's place in `model::ALL_LINEAR`), so a mask is the same with
//! or without checkpointing, under FSDP and on any number of ranks.
//!
//! Element e is dropped when its 16 bits are below t = round(p · 2¹⁶): it is kept with
//! probability exactly 1 − t / 2¹⁶ (p to within 2⁻¹⁷), and a kept value is scaled by
//! 1 / (1 − p) (f32), as PyTorch's dropout: dropout(x)[e] = round(x[e] · 1/(1 − p)) in x's
//! dtype, or 0. The index e is over the row-major [m, in] (any leading dims flattened) of the
//! adapter's input, whatever its row stride in memory (the fold's padded rows).

use candle_core::{DType, Device, Result, Tensor};

/// Philox4x32's multipliers and Weyl key increments (Random123).
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox4x32 with 10 rounds: the counter `c` under `key` → 4 words.
pub(crate) fn philox4x32_10(mut c: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut k = key;
    for r in 0..10 {
        if r > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = M0 as u64 * c[0] as u64;
        let p1 = M1 as u64 * c[2] as u64;
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// One adapter's dropout on one micro-batch: everything a kernel needs to draw its mask.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dropout {
    /// Philox's key: (seed, step, micro-batch).
    pub(crate) key: [u32; 2],
    /// The counter's high words: (layer, module).
    pub(crate) stream: [u32; 2],
    /// An element whose 16 bits are below this is dropped: round(p · 2¹⁶).
    pub(crate) threshold: u32,
    /// 1 / (1 − p) in f32: a kept value's factor.
    pub scale: f32,
    /// Drawn inside the adapters' kernels where they take the operands (`ops::fold_drop`;
    /// `Kernels::dropout_fused`), else applied as a masked copy per use. Same masks either way.
    pub(crate) fused: bool,
}

/// Keeps (seed, step, micro-batch) keys apart from every other stream of `Rng::keyed`.
const DOMAIN: u64 = 0x6472_6f70_6f75_7431;

impl Dropout {
    /// Dropout at rate `p` (in [0, 1)) for `batch` = [step, micro-batch] and the linear `at` =
    /// [layer, module]; None at p = 0.
    pub fn new(p: f32, seed: u64, batch: [u64; 2], at: [u64; 2]) -> Option<Dropout> {
        if p <= 0.0 || p >= 1.0 {
            return None;
        }
        let k = crate::rng::Rng::keyed(seed, &[DOMAIN, batch[0], batch[1]]).next_u64();
        Some(Dropout {
            key: [k as u32, (k >> 32) as u32],
            stream: [at[0] as u32, at[1] as u32],
            threshold: (p as f64 * 65536.0).round().min(65535.0) as u32,
            scale: (1.0 / (1.0 - p as f64)) as f32,
            fused: false,
        })
    }

    /// This dropout, drawn inside the fused kernels (`on`) or not.
    pub fn fused(self, on: bool) -> Dropout {
        Dropout { fused: on, ..self }
    }

    /// The probability that an element is kept: 1 − threshold / 2¹⁶.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn keep_probability(&self) -> f64 {
        1.0 - self.threshold as f64 / 65536.0
    }

    /// The 4 words of element group g (elements 8g .. 8g + 7).
    pub(crate) fn group(&self, g: u64) -> [u32; 4] {
        let c = [g as u32, (g >> 32) as u32, self.stream[0], self.stream[1]];
        philox4x32_10(c, self.key)
    }

    /// Element e's 16 bits.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn bits(&self, e: u64) -> u32 {
        let w = self.group(e / 8)[(e % 8) as usize / 2];
        (w >> (16 * (e % 2))) & 0xffff
    }

    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn keeps(&self, e: u64) -> bool {
        self.bits(e) >= self.threshold
    }

    /// The mask of elements 0 .. n: 1 / (1 − p) where kept, else 0 (the reference).
    pub fn mask(&self, n: usize) -> Vec<f32> {
        let mut out = vec![0f32; n];
        self.for_each_keep(n, |e, keep| {
            if keep {
                out[e] = self.scale;
            }
        });
        out
    }

    /// `f(e, kept)` for e in 0 .. n, in order, one generator call per 8 elements.
    fn for_each_keep(&self, n: usize, mut f: impl FnMut(usize, bool)) {
        for g in 0..n.div_ceil(8) {
            let w = self.group(g as u64);
            for j in 0..8.min(n - 8 * g) {
                let bits = (w[j / 2] >> (16 * (j % 2))) & 0xffff;
                f(8 * g + j, bits >= self.threshold);
            }
        }
    }
}

/// dropout(x): each element of x (any shape; the mask over its row-major index) kept and
/// multiplied by 1 / (1 − p) in f32, then rounded to x's dtype, or set to 0. No graph. On the
/// device it is drawn by a kernel (dropout.cu), on the CPU here.
pub fn apply(x: &Tensor, d: &Dropout) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(y) = cuda::apply(x, d)? {
        return Ok(y);
    }
    let v = x.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let mut out = vec![0f32; v.len()];
    d.for_each_keep(v.len(), |e, keep| {
        if keep {
            out[e] = v[e] * d.scale;
        }
    });
    Tensor::from_vec(out, x.shape(), x.device())?.to_dtype(x.dtype())
}

/// The mask as a tensor of `dims` on `dev` (f32): 1 / (1 − p) where kept, else 0. For tests and
/// references: training never makes it.
pub fn mask_tensor(dims: &[usize], d: &Dropout, dev: &Device) -> Result<Tensor> {
    let n = dims.iter().product();
    Tensor::from_vec(d.mask(n), dims, &Device::Cpu)?.to_device(dev)
}

/// The kernels' view of a `Dropout` (dropout.cu's DropKey); thr 0 and scale 1 for none.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct DropKey {
    pub(crate) k0: u32,
    pub(crate) k1: u32,
    pub(crate) layer: u32,
    pub(crate) module: u32,
    pub(crate) thr: u32,
    pub(crate) scale: f32,
}

impl DropKey {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn of(d: Option<&Dropout>) -> DropKey {
        match d {
            Some(d) => DropKey {
                k0: d.key[0],
                k1: d.key[1],
                layer: d.stream[0],
                module: d.stream[1],
                thr: d.threshold,
                scale: d.scale,
            },
            None => DropKey {
                scale: 1.0,
                ..Default::default()
            },
        }
    }
}

#[cfg(feature = "cuda")]
// SAFETY: plain old data laid out as the C struct the kernels take by value.
unsafe impl candle_core::cuda::cudarc::driver::DeviceRepr for DropKey {}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{DropKey, Dropout};
    use crate::ops::cuda::{addr, function, uninit};
    use candle_core::cuda::cudarc::driver::PushKernelArg;
    use candle_core::cuda::WrapErr;
    use candle_core::{DType, Device, Result, Tensor};

    /// `apply` on the device: dropout.cu's dropout_apply, one thread per 8 elements. None off
    /// CUDA or for dtypes other than bf16 and f32.
    pub(crate) fn apply(x: &Tensor, d: &Dropout) -> Result<Option<Tensor>> {
        let Device::Cuda(dev) = x.device() else {
            return Ok(None);
        };
        let name = match x.dtype() {
            DType::BF16 => "dropout_apply_bf16",
            DType::F32 => "dropout_apply_f32",
            _ => return Ok(None),
        };
        let x = x.contiguous()?;
        let n = x.elem_count();
        // SAFETY: the kernel writes every element (kept or 0).
        let Some(y) = (unsafe { uninit(dev, x.dtype(), x.shape().clone())? }) else {
            return Ok(None);
        };
        if n == 0 {
            return Ok(Some(y));
        }
        let (Some(xp), Some(yp)) = (addr(&x)?, addr(&y)?) else {
            return Ok(None);
        };
        let (key, n64) = (DropKey::of(Some(d)), n as i64);
        let func = function(dev, name)?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&xp).arg(&yp).arg(&n64).arg(&key);
        let groups = n.div_ceil(8);
        // SAFETY: x and y are live contiguous buffers of n elements of this dtype, on this
        // stream; a thread touches elements 8g .. 8g + 7 below n.
        unsafe { b.launch(crate::ops::cuda::elems(groups)?) }.w()?;
        Ok(Some(y))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's known answers for Philox4x32-10 (its kat_vectors file).
    #[test]
    fn philox_matches_random123s_known_answers() {
        let kat: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
            (
                [0; 4],
                [0; 2],
                [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8],
            ),
            (
                [u32::MAX; 4],
                [u32::MAX; 2],
                [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd],
            ),
            (
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0],
                [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
            ),
        ];
        for (c, k, want) in kat {
            assert_eq!(philox4x32_10(c, k), want, "counter {c:x?} key {k:x?}");
        }
    }

    #[test]
    fn masks_repeat_and_differ_by_step_micro_batch_layer_and_module() {
        let n = 4096;
        let d = |batch, at| Dropout::new(0.1, 42, batch, at).unwrap();
        let base = d([3, 1], [5, 2]).mask(n);
        assert_eq!(
            base,
            d([3, 1], [5, 2]).mask(n),
            "the same key, the same mask"
        );
        for (what, other) in [
            ("step", d([4, 1], [5, 2])),
            ("micro-batch", d([3, 0], [5, 2])),
            ("layer", d([3, 1], [6, 2])),
            ("module", d([3, 1], [5, 3])),
            ("seed", Dropout::new(0.1, 43, [3, 1], [5, 2]).unwrap()),
        ] {
            let m = other.mask(n);
            let same = m.iter().zip(&base).filter(|(a, b)| a == b).count();
            // Two independent masks at p = 0.1 agree on 0.9² + 0.1² = 82% of elements.
            assert!(
                (same as f64 / n as f64 - 0.82).abs() < 0.03,
                "{what}: {same} of {n} alike"
            );
        }
        // Swapped keys are other masks too (the key is no symmetric function of its parts).
        assert_ne!(base, d([1, 3], [5, 2]).mask(n));
        assert_ne!(base, d([3, 1], [2, 5]).mask(n));
        assert!(Dropout::new(0.0, 42, [3, 1], [5, 2]).is_none());
    }

    #[test]
    fn keep_fraction_is_one_minus_p_and_kept_values_are_scaled() {
        let n = 1 << 22;
        for p in [0.05f32, 0.1, 0.5] {
            let d = Dropout::new(p, 7, [11, 0], [3, 6]).unwrap();
            assert_eq!(d.threshold, (p as f64 * 65536.0).round() as u32);
            assert!((d.keep_probability() - (1.0 - p as f64)).abs() < 1e-5);
            let m = d.mask(n);
            let scale = (1.0 / (1.0 - p as f64)) as f32;
            assert!(m.iter().all(|&v| v == 0.0 || v == scale), "p {p}");
            let kept = m.iter().filter(|&&v| v != 0.0).count() as f64 / n as f64;
            let want = 1.0 - p as f64;
            assert!(
                (kept - want).abs() < 0.01 * want,
                "p {p}: kept {kept}, want {want}"
            );
            // A 4-sigma band of the binomial: the bits are uniform, not merely close.
            let sigma = (want * (1.0 - want) / n as f64).sqrt();
            assert!((kept - d.keep_probability()).abs() < 4.0 * sigma, "p {p}");
            for e in [0usize, 1, 7, 8, 12345, n - 1] {
                assert_eq!(m[e] != 0.0, d.keeps(e as u64), "element {e}");
            }
        }
    }

    #[test]
    fn apply_scales_kept_values_in_f32_and_rounds_once() {
        let d = Dropout::new(0.05, 1, [0, 0], [0, 0]).unwrap();
        let n = 1000;
        let xs: Vec<f32> = (0..n).map(|i| (i as f32 - 500.0) / 37.0).collect();
        let x = Tensor::from_vec(xs.clone(), (10, 100), &Device::Cpu).unwrap();
        let y = apply(&x, &d).unwrap().flatten_all().unwrap();
        let m = d.mask(n);
        let got = y.to_vec1::<f32>().unwrap();
        for e in 0..n {
            assert_eq!(got[e], xs[e] * m[e], "element {e}");
        }
        // bf16: the product in f32, one rounding (not the factor rounded to bf16 first).
        let xb = x.to_dtype(DType::BF16).unwrap();
        let yb = apply(&xb, &d).unwrap().flatten_all().unwrap();
        let xv = xb.flatten_all().unwrap().to_dtype(DType::F32).unwrap();
        let xv = xv.to_vec1::<f32>().unwrap();
        let got = yb.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        for e in 0..n {
            let want = half::bf16::from_f32(xv[e] * m[e]).to_f32();
            assert_eq!(got[e], want, "bf16 element {e}");
        }
    }
}
