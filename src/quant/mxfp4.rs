//! gpt-oss's experts as the Hub stores them (`quantization_config.quant_method = "mxfp4"`):
//! each `model.layers.{l}.mlp.experts.{gate_up,down}_proj` is two uint8 tensors
//!
//!   P_blocks  u8 [E, R, G, 16]  FP4 (e2m1) values two a byte, the low nibble first
//!   P_scales  u8 [E, R, G]      one e8m0 exponent (2^(s − 127)) for each block of 32 values
//!
//! R the weight's output rows (2I for gate_up, its gate and up interleaved; C for down) and
//! G·32 its inputs. `read` dequantizes them exactly (every e2m1 value times a power of two is a
//! bf16 and an f32) to the x·W layout transformers' `convert_moe_packed_tensors` gives,
//! [E, G·32, R]; the biases (`P_bias`) are stored bf16 and read as every tensor.

use anyhow::{bail, Context, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

/// The e2m1 values of the 16 codes (sign bit 3, then two exponent bits and one mantissa bit).
const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Values a block of one scale holds (16 bytes).
pub const BLOCK: usize = 32;

/// The e8m0 code that means NaN (OCP MX: 0xFF), refused.
const NAN_SCALE: u8 = 0xFF;

/// The suffixes of the two tensors that hold an MXFP4 weight.
pub(crate) const SUFFIXES: [&str; 2] = ["_blocks", "_scales"];

/// Whether `name` is one of the tensors of an MXFP4 weight (`…_blocks`, `…_scales`).
pub(crate) fn is_packed(name: &str) -> bool {
    SUFFIXES.iter().any(|s| name.ends_with(s))
}

/// The expert weight `name` (e.g. `model.layers.0.mlp.experts.gate_up_proj`) of transformers'
/// shape `shape` = [E, in, out] dequantized from `{name}_blocks` and `{name}_scales` into
/// `dtype` on `device` (f32, or bf16 for any other dtype, then cast), as a [E, in, out] view;
/// None when the checkpoint has no `{name}_blocks`.
pub(crate) fn read(
    st: &MmapedSafetensors,
    name: &str,
    shape: &[usize],
    (dtype, device): (DType, &Device),
) -> Result<Option<Tensor>> {
    let Ok(blocks) = st.get(&format!("{name}_blocks")) else {
        return Ok(None);
    };
    let scales = st
        .get(&format!("{name}_scales"))
        .with_context(|| format!("`{name}_blocks` has no `{name}_scales` beside it"))?;
    let &[e, inputs, rows] = shape else {
        bail!("`{name}`: MXFP4 is read for the experts' [E, in, out] weights only");
    };
    if inputs % BLOCK != 0 {
        bail!("`{name}`: its {inputs} inputs are not whole blocks of {BLOCK}");
    }
    let g = inputs / BLOCK;
    let want_b = [e, rows, g, BLOCK / 2];
    for (t, what, want) in [
        (&blocks, "_blocks", &want_b[..]),
        (&scales, "_scales", &want_b[..3]),
    ] {
        if t.dtype() != safetensors::Dtype::U8 || t.shape() != want {
            bail!(
                "`{name}{what}` is {:?} {:?}; config.json implies U8 {want:?} (MXFP4 as transformers saves gpt-oss)",
                t.dtype(),
                t.shape()
            );
        }
    }
    let t = match dtype {
        DType::F32 => {
            let v = dequantize(blocks.data(), scales.data(), |x| x).context_of(name)?;
            Tensor::from_vec(v, (e, rows, inputs), &Device::Cpu)?
        }
        _ => {
            let v =
                dequantize(blocks.data(), scales.data(), half::bf16::from_f32).context_of(name)?;
            Tensor::from_vec(v, (e, rows, inputs), &Device::Cpu)?.to_dtype(dtype)?
        }
    };
    Ok(Some(t.to_device(device)?.transpose(1, 2)?))
}

/// Codes `blocks` (16 bytes a block) under their exponents `scales` (one a block), in the
/// order stored: value 2j of a block the low nibble of its byte j, value 2j + 1 the high one.
/// Each value is exact in `T` (`to` converts f32 exactly); Err names the first NaN exponent.
pub(crate) fn dequantize<T: Copy + Default + Send>(
    blocks: &[u8],
    scales: &[u8],
    to: impl Fn(f32) -> T + Sync,
) -> std::result::Result<Vec<T>, usize> {
    debug_assert_eq!(blocks.len(), scales.len() * BLOCK / 2);
    if let Some(at) = scales.iter().position(|&s| s == NAN_SCALE) {
        return Err(at);
    }
    let mut out = vec![T::default(); scales.len() * BLOCK];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = scales.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        let work = out
            .chunks_mut(per * BLOCK)
            .zip(blocks.chunks(per * BLOCK / 2).zip(scales.chunks(per)));
        for (o, (b, sc)) in work {
            let to = &to;
            s.spawn(move || {
                for ((o, b), &x) in o.chunks_mut(BLOCK).zip(b.chunks(BLOCK / 2)).zip(sc) {
                    // 2^(x − 127), exact in f64; each product is an e2m1 value's power-of-two
                    // multiple, exact in f32 (or ±inf past its range, as in torch)
                    let k = 2f64.powi(i32::from(x) - 127);
                    for (pair, &byte) in o.chunks_mut(2).zip(b) {
                        pair[0] = to((f64::from(E2M1[usize::from(byte & 0xF)]) * k) as f32);
                        pair[1] = to((f64::from(E2M1[usize::from(byte >> 4)]) * k) as f32);
                    }
                }
            });
        }
    });
    Ok(out)
}

/// The error of a NaN exponent at block `at` of `name`.
trait ContextOf<T> {
    fn context_of(self, name: &str) -> Result<T>;
}

impl<T> ContextOf<T> for std::result::Result<T, usize> {
    fn context_of(self, name: &str) -> Result<T> {
        self.map_err(|at| {
            anyhow::anyhow!(
                "`{name}_scales` holds the e8m0 NaN code 0xFF at block {at}: the checkpoint is damaged; download it again"
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nibbles_low_first_times_the_block_exponent() {
        // byte 0x2F: low nibble 0xF (−6), high 0x2 (1.0); scale 128: ×2
        let mut blocks = vec![0u8; 16];
        blocks[0] = 0x2F;
        blocks[15] = 0x97; // low 7 (6.0), high 9 (−0.5)
        let got = dequantize(&blocks, &[128], |x| x).unwrap();
        assert_eq!(&got[..2], &[-12.0, 2.0]);
        assert_eq!(&got[30..], &[12.0, -1.0]);
        assert!(got[2..30].iter().all(|&v| v == 0.0));
        // the extremes: 2^-127 (an f32 subnormal) and 2^127
        let tiny = dequantize(&[0x21; 16], &[0], |x| x).unwrap();
        assert_eq!(tiny[0], 0.5 * 2f32.powi(-126) / 2.0);
        assert_eq!(tiny[1], f32::from_bits(1 << 22));
        let big = dequantize(&[0x73; 16], &[254], half::bf16::from_f32).unwrap();
        assert_eq!(big[0].to_f32(), 1.5 * 2f32.powi(127));
        assert_eq!(big[1].to_f32(), f32::INFINITY); // 6 · 2^127, past bf16 as past f32
        assert_eq!(dequantize(&[0; 32], &[1, 255], |x| x), Err(1));
    }

    /// The gpt_oss_mxfp4 fixture (scripts/reference_gpt_oss_mxfp4.py): every expert weight as
    /// transformers 5.17 dequantizes it (`convert_moe_packed_tensors`, bf16), bit for bit, in
    /// f32 and in bf16.
    #[test]
    fn experts_equal_transformers_dequantized_bit_for_bit() {
        let d = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/golden/gpt_oss_mxfp4");
        // SAFETY: test fixtures, not modified while the test runs.
        let st = unsafe { MmapedSafetensors::new(d.join("model/model.safetensors")) }.unwrap();
        let want = candle_core::safetensors::load(d.join("dequantized.safetensors"), &Device::Cpu)
            .unwrap();
        assert_eq!(want.len(), 4);
        for (name, w) in &want {
            for dtype in [DType::F32, DType::BF16] {
                let got = read(&st, name, w.dims(), (dtype, &Device::Cpu))
                    .unwrap()
                    .unwrap();
                assert_eq!(got.dims(), w.dims(), "{name}");
                let bits = |t: &Tensor| -> Vec<u32> {
                    let v = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
                    v.to_vec1::<f32>()
                        .unwrap()
                        .iter()
                        .map(|x| x.to_bits())
                        .collect()
                };
                assert_eq!(bits(&got), bits(w), "{name} in {dtype:?}");
            }
        }
        // a weight the checkpoint holds plainly, and a shape the blocks do not hold
        let r = read(
            &st,
            "model.layers.0.mlp.router.weight",
            &[8, 32],
            (DType::F32, &Device::Cpu),
        );
        assert!(r.unwrap().is_none());
        let name = "model.layers.0.mlp.experts.down_proj";
        let e = read(&st, name, &[8, 64, 32], (DType::F32, &Device::Cpu)).unwrap_err();
        assert!(
            e.to_string()
                .contains("config.json implies U8 [8, 32, 2, 16]"),
            "{e}"
        );
    }
}
