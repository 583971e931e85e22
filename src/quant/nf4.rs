//! NF4, bitsandbytes' 4-bit NormalFloat, bit for bit as its CUDA kernels make and read it
//! (`kQuantizeBlockwise` / `kDequantizeBlockwise` with `NF4`, csrc/kernels.cu).
//!
//! A weight [out, in] is read row-major in blocks of 64 values. Each block keeps its absmax
//! (max |w|, f32) and each value the index of the nearest of 16 levels (the quantiles of a
//! normal, scaled to [-1, 1]) to w · (1 / absmax): a decision tree over the midpoints, a
//! value on one going to the lower level. Two codes a byte, the first value in the high nibble.
//! Dequantized, w = level[code] · absmax, in f32, then rounded to the weight dtype.
//!
//! Double quant (`compress_statistics=True`): the absmax values, less their mean (an f32
//! offset), are quantized again to 8 bits with the dynamic map in blocks of 256
//! (`super::dynamic`); absmax = code2[q] · absmax2 + offset.
//!
//! Bytes per weight: 0.5 + 4 / 64 (absmax), or 0.5 + 1 / 64 + 4 / (64 · 256) nested.
//!
//! Where bitsandbytes' own CPU path differs from its CUDA one (we follow CUDA): an all-zero
//! block (CUDA: 0 · (1 / 0) is NaN, code 0, dequantized -0.0; CPU: code 7, +0.0), and the
//! 8-bit step of double quant (CPU: a 65536-bin lookup table, not the nearest code for values
//! near a midpoint), and a value between a midpoint and a threshold that is its neighbour
//! (`THRESHOLDS`: CUDA's tree and the CPU's `bucketize` on the exact midpoints part there). CUDA's reciprocal is fast-math's approximate one, ours the exact one;
//! the offset is the mean in f64 (torch's in f32): our own quantization can differ from
//! bitsandbytes' by a level where w / absmax lies within an ulp of a midpoint. Dequantizing
//! its codes is exact.

use super::dynamic::{self, ftz};

/// Weights per NF4 block.
pub const BLOCK: usize = 64;
/// Absmax values per block of double quant.
pub const NESTED_BLOCK: usize = 256;

/// The 16 NF4 levels (bitsandbytes' `nf4_dequantization_lut`, its literals verbatim), code
/// order.
#[allow(clippy::excessive_precision)]
pub const LEVELS: [f32; 16] = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
];

/// `dQuantizeNF4`'s thresholds, ascending: its tree's C++ float literals, verbatim. Each is the
/// f32 midpoint of two adjacent levels, rounded from a decimal: four of them (levels 0|1,
/// 12|13, 14|15 one f32 below, 8|9 one above) are not the midpoint itself but its neighbour.
#[allow(clippy::excessive_precision)]
pub const THRESHOLDS: [f32; 15] = [
    -0.8480964004993439,
    -0.6106329262256622,
    -0.4599952697753906,
    -0.33967943489551544,
    -0.23460740596055984,
    -0.13791173323988914,
    -0.045525018125772476,
    0.03979014977812767,
    0.1202552504837513,
    0.2035212516784668,
    0.2920137718319893,
    0.3893125355243683,
    0.5016634166240692,
    0.6427869200706482,
    0.8614784181118011,
];

/// The code of x = w / absmax, as `dQuantizeNF4`'s tree finds it: the thresholds x lies above
/// (so a value on a threshold takes the lower level, and NaN code 0).
pub(crate) fn code(x: f32) -> u8 {
    THRESHOLDS.iter().filter(|&&t| x > t).count() as u8
}

/// Double quant's state: the absmax values as 8-bit codes of the dynamic map in blocks of 256.
#[derive(Clone, Debug, PartialEq)]
pub struct Nested {
    /// [blocks] one code per NF4 block (`weight.absmax` in a checkpoint).
    pub codes: Vec<u8>,
    /// [⌈blocks / 256⌉] (`weight.nested_absmax`).
    pub absmax: Vec<f32>,
    /// [256] the dynamic map (`weight.nested_quant_map`).
    pub map: Vec<f32>,
    /// The absmax values' mean, taken off before quantizing (the quant state's `offset`).
    pub offset: f32,
}

/// Each NF4 block's absmax: plain f32, or double-quantized.
#[derive(Clone, Debug, PartialEq)]
pub enum Absmax {
    /// One f32 a block.
    Plain(Vec<f32>),
    /// Double-quantized: 8-bit codes in blocks of 256.
    Nested(Nested),
}

/// A weight in NF4.
#[derive(Clone, Debug, PartialEq)]
pub struct Nf4 {
    /// The weight's shape ([out, in] for a linear).
    pub shape: Vec<usize>,
    /// [⌈n / 2⌉] two codes a byte, the first value in the high nibble (`weight`).
    pub codes: Vec<u8>,
    /// Each block's absmax, the scale of its codes.
    pub absmax: Absmax,
}

impl Nf4 {
    /// `quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=double_quant)`
    /// of w (its values in f32: a bf16 or f16 weight's are exact), `shape` its shape.
    pub fn quantize(w: &[f32], shape: &[usize], double_quant: bool) -> Nf4 {
        let blocks = w.len().div_ceil(BLOCK);
        let mut codes = vec![0u8; w.len().div_ceil(2)];
        let mut absmax = vec![0f32; blocks];
        // Whole blocks per thread (a block is 32 bytes of codes).
        let per = blocks.div_ceil(threads(w.len())).max(1);
        std::thread::scope(|s| {
            let parts = codes
                .chunks_mut(per * BLOCK / 2)
                .zip(absmax.chunks_mut(per));
            for (i, (c, a)) in parts.enumerate() {
                let x = &w[(i * per * BLOCK).min(w.len())..w.len().min((i + 1) * per * BLOCK)];
                s.spawn(move || quantize_blocks(x, c, a));
            }
        });
        let absmax = match double_quant {
            false => Absmax::Plain(absmax),
            true => Absmax::Nested(nest(&absmax)),
        };
        Nf4 {
            shape: shape.to_vec(),
            codes,
            absmax,
        }
    }

    /// Elements of the weight.
    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Each block's absmax in f32 (double quant undone as `dequantize_4bit` does).
    pub fn absmax_f32(&self) -> Vec<f32> {
        match &self.absmax {
            Absmax::Plain(a) => a.clone(),
            Absmax::Nested(n) => {
                let a = dynamic::dequantize_blockwise(&n.map, &n.codes, &n.absmax, NESTED_BLOCK);
                a.into_iter().map(|x| x + n.offset).collect()
            }
        }
    }

    /// The weight's values, level · absmax in f32 (round these to bf16 for a bf16 weight).
    pub fn dequantize(&self) -> Vec<f32> {
        let n = self.numel();
        let absmax = self.absmax_f32();
        let mut out = vec![0f32; n];
        let per = n.div_ceil(BLOCK).div_ceil(threads(n)).max(1) * BLOCK;
        std::thread::scope(|s| {
            for (i, o) in out.chunks_mut(per).enumerate() {
                let (codes, absmax) = (&self.codes, &absmax);
                s.spawn(move || {
                    for (j, v) in o.iter_mut().enumerate() {
                        let k = i * per + j;
                        let byte = codes.get(k / 2).copied().unwrap_or(0);
                        let c = if k % 2 == 0 { byte >> 4 } else { byte & 15 };
                        let a = absmax.get(k / BLOCK).copied().unwrap_or(0.0);
                        *v = ftz(LEVELS[c as usize] * a);
                    }
                });
            }
        });
        out
    }

    /// Bytes this format keeps: the codes, and the absmax (nested: its codes, absmax and map).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn bytes(&self) -> usize {
        self.codes.len()
            + match &self.absmax {
                Absmax::Plain(a) => 4 * a.len(),
                Absmax::Nested(n) => n.codes.len() + 4 * (n.absmax.len() + n.map.len()) + 4,
            }
    }
}

/// Bytes of an NF4 weight of n elements: codes and absmax (`double_quant`: nested codes,
/// their absmax and the 256-entry map, and the offset). The memory plan counts these.
pub(crate) fn bytes_for(n: usize, double_quant: bool) -> usize {
    let blocks = n.div_ceil(BLOCK);
    n.div_ceil(2)
        + match double_quant {
            false => 4 * blocks,
            true => blocks + 4 * blocks.div_ceil(NESTED_BLOCK) + 4 * 256 + 4,
        }
}

/// Threads for n elements: one per million, up to the machine's.
fn threads(n: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    (n >> 20).clamp(1, cores)
}

/// NF4 codes and absmax of whole blocks x (the last may be partial) into `codes` and `absmax`.
fn quantize_blocks(x: &[f32], codes: &mut [u8], absmax: &mut [f32]) {
    for (b, chunk) in x.chunks(BLOCK).enumerate() {
        // CUDA starts from -FLT_MAX and pads a partial block with zeros: the same max.
        let m = chunk.iter().fold(0f32, |m, v| m.max(ftz(*v).abs()));
        absmax[b] = m;
        let r = 1.0 / m;
        // An odd tail's last byte takes a zero's code in its low nibble, as the kernel's load
        // pads it.
        for j in 0..chunk.len().next_multiple_of(2) {
            let v = chunk.get(j).copied().unwrap_or(0.0);
            let c = code(ftz(ftz(v) * r));
            let k = b * BLOCK + j; // index within x; x starts on a block, so on a byte
            let byte = &mut codes[k / 2];
            *byte = match k % 2 {
                0 => c << 4,
                _ => *byte | c,
            };
        }
    }
}

/// Double quant of the absmax values: their mean taken off, then 8 bits in blocks of 256.
pub(crate) fn nest(absmax: &[f32]) -> Nested {
    let n = absmax.len().max(1) as f64;
    let offset = (absmax.iter().map(|&a| a as f64).sum::<f64>() / n) as f32;
    nest_about(absmax, offset)
}

/// Double quant of the absmax values about a given offset (bitsandbytes' is torch's f32 mean,
/// whose last bit depends on its reduction order): absmax - offset, 8 bits in blocks of 256.
pub fn nest_about(absmax: &[f32], offset: f32) -> Nested {
    let centred: Vec<f32> = absmax.iter().map(|&a| a - offset).collect();
    let map = dynamic::map();
    let (codes, absmax2) = dynamic::quantize_blockwise(&map, &centred, NESTED_BLOCK);
    Nested {
        codes,
        absmax: absmax2,
        map: map.to_vec(),
        offset,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each threshold is the f32 midpoint of its levels or a neighbour of it (four of them); a
    /// level maps to itself, a threshold to the level below, the next f32 to the one above.
    #[test]
    fn the_tree_is_the_nearest_level() {
        for (i, &l) in LEVELS.iter().enumerate() {
            assert_eq!(code(l) as usize, i);
        }
        let step = |x: f32, up: bool| match (x > 0.0) == up {
            true => f32::from_bits(x.to_bits() + 1),
            false => f32::from_bits(x.to_bits() - 1),
        };
        let (mut below, mut above) = (Vec::new(), Vec::new());
        for (i, &t) in THRESHOLDS.iter().enumerate() {
            let mid = (LEVELS[i] + LEVELS[i + 1]) / 2.0;
            if t < mid {
                assert_eq!(t, step(mid, false), "threshold {i}");
                below.push(i);
            } else if t > mid {
                assert_eq!(t, step(mid, true), "threshold {i}");
                above.push(i);
            }
            assert_eq!((code(t) as usize, code(step(t, true)) as usize), (i, i + 1));
        }
        assert_eq!((below, above), (vec![0, 12, 14], vec![8]));
        assert_eq!((code(2.0), code(-2.0), code(f32::NAN)), (15, 0, 0));
    }

    /// Sizes: a 4096 × 4096 weight is 8 MiB of codes plus its absmax.
    #[test]
    fn bytes_count_codes_and_absmax() {
        let n = 4096 * 4096;
        assert_eq!(bytes_for(n, false), n / 2 + 4 * n / 64);
        assert_eq!(bytes_for(n, true), n / 2 + n / 64 + 4 * n / 64 / 256 + 1028);
        let w: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
        for dq in [false, true] {
            assert_eq!(Nf4::quantize(&w, &[1000], dq).bytes(), bytes_for(1000, dq));
        }
    }
}
