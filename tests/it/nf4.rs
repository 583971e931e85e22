//! NF4 against bitsandbytes: `scripts/make_nf4_fixture.py` ran `quantize_4bit` and
//! `dequantize_4bit` (with and without double quant) on weights holding zeros, ±max, tiny
//! values, exact midpoints and partial blocks; our codes, absmax, nested state and
//! dequantized values are held to its to the bit.
//!
//! Two fixtures are committed: bitsandbytes 0.50.2's CPU backend (`nf4_cpu.safetensors`) and
//! its CUDA kernels on an H200 (`--device cuda`, `nf4_cuda.safetensors`). Where the CPU path
//! differs from CUDA (src/quant/nf4.rs: an all-zero block's code, and a value exactly on a
//! midpoint whose CUDA threshold is the f32 below it), we follow CUDA and check the CPU values
//! for what they are; the CUDA fixture is held to the bit everywhere.

use candle_core::safetensors::load;
use candle_core::{DType, Device, Tensor};
use lora_train::quant::dynamic;
use lora_train::quant::nf4::{self, Absmax, Nested, Nf4};
use std::collections::HashMap;

/// A committed fixture; a missing one fails the test (never a pass that checked nothing).
fn fixture(device: &str) -> HashMap<String, Tensor> {
    let p = crate::common::root().join(format!("tests/fixtures/nf4/nf4_{device}.safetensors"));
    assert!(
        p.is_file(),
        "{} is missing: it is committed (scripts/make_nf4_fixture.py{} made it)",
        p.display(),
        if device == "cuda" {
            " --device cuda"
        } else {
            ""
        }
    );
    load(&p, &Device::Cpu).unwrap()
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn u8s(t: &Tensor) -> Vec<u8> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The values rounded to the fixture tensor's dtype, as bits of that dtype.
fn rounded_bits(v: &[f32], like: &Tensor) -> Vec<u32> {
    let t = Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap();
    match like.dtype() {
        DType::BF16 => {
            let b: Vec<half::bf16> = t.to_dtype(DType::BF16).unwrap().to_vec1().unwrap();
            b.iter().map(|x| x.to_bits() as u32).collect()
        }
        _ => bits(v),
    }
}

fn fixture_bits(t: &Tensor) -> Vec<u32> {
    match t.dtype() {
        DType::BF16 => {
            let b: Vec<half::bf16> = t.flatten_all().unwrap().to_vec1().unwrap();
            b.iter().map(|x| x.to_bits() as u32).collect()
        }
        _ => bits(&f32s(t)),
    }
}

/// The all-zero blocks of w (where bitsandbytes' CPU and CUDA paths part).
fn zero_blocks(w: &[f32]) -> Vec<usize> {
    w.chunks(nf4::BLOCK)
        .enumerate()
        .filter(|(_, c)| c.iter().all(|&x| x == 0.0))
        .map(|(b, _)| b)
        .collect()
}

const NAMES: [&str; 4] = ["mixed", "partial", "ties", "spread"];

/// Codes and absmax equal bitsandbytes' (CPU: but in all-zero blocks, whose codes are 0 here
/// and 7 there, and on three midpoints), and its codes, dequantized by us, give its values to the bit (CPU: those
/// blocks' -0.0 there +0.0).
#[test]
fn nf4_codes_absmax_and_values_equal_bitsandbytes() {
    for (device, f) in ["cpu", "cuda"].map(|d| (d, fixture(d))) {
        let levels = f32s(&f["nf4.code"]);
        assert_eq!(bits(&levels), bits(&nf4::LEVELS), "the 16 levels");
        let (mut zero_seen, mut ties_seen) = (0, 0);
        for name in NAMES {
            let input = &f[&format!("{name}.input")];
            let w = f32s(input);
            let ours = Nf4::quantize(&w, input.dims(), false);
            let mut want = u8s(&f[&format!("{name}.codes")]);
            let absmax = f32s(&f[&format!("{name}.absmax")]);
            let Absmax::Plain(our_absmax) = &ours.absmax else {
                panic!("plain absmax")
            };
            assert_eq!(bits(our_absmax), bits(&absmax), "{device} {name} absmax");
            for b in zero_blocks(&w) {
                let span = b * nf4::BLOCK / 2..((b + 1) * nf4::BLOCK / 2).min(want.len());
                if device == "cpu" {
                    assert!(
                        want[span.clone()].iter().all(|&c| c == 0x77),
                        "{name} block {b}"
                    );
                    want[span.clone()].fill(0);
                }
                assert!(ours.codes[span].iter().all(|&c| c == 0), "{name} block {b}");
                zero_seen += 1;
            }
            // CPU: a value exactly on a midpoint whose CUDA threshold is the f32 below it takes
            // the level below there (`nf4::THRESHOLDS`), the level above here.
            if device == "cpu" {
                for (k, v) in w.iter().enumerate() {
                    let x = v * (1.0 / absmax[k / nf4::BLOCK]);
                    let on = (0..15).find(|&i| {
                        x == (nf4::LEVELS[i] + nf4::LEVELS[i + 1]) / 2.0 && nf4::THRESHOLDS[i] < x
                    });
                    if let Some(i) = on {
                        let shift = if k % 2 == 0 { 4 } else { 0 };
                        assert_eq!((want[k / 2] >> shift) & 15, i as u8, "{name} {k}");
                        want[k / 2] += 1 << shift;
                        ties_seen += 1;
                    }
                }
            }
            assert_eq!(ours.codes, want, "{device} {name} codes");

            // bitsandbytes' own codes dequantized, to bf16 (or f32) and to f32.
            let theirs = Nf4 {
                shape: input.dims().to_vec(),
                codes: u8s(&f[&format!("{name}.codes")]),
                absmax: Absmax::Plain(absmax.clone()),
            };
            let deq = theirs.dequantize();
            let want = &f[&format!("{name}.dequant")];
            assert_eq!(
                rounded_bits(&deq, want),
                fixture_bits(want),
                "{name} dequant"
            );
            if let Some(want) = f.get(&format!("{name}.dequant_f32")) {
                assert_eq!(bits(&deq), bits(&f32s(want)), "{name} dequant f32");
            }
            // Ours dequantized: the same numbers where the codes agree (CPU: -0.0 for +0.0 in
            // all-zero blocks).
            let (mine, nib) = (ours.dequantize(), |c: &[u8], k: usize| {
                c[k / 2] >> (4 * (1 - k % 2)) & 15
            });
            for k in 0..mine.len() {
                if nib(&ours.codes, k) == nib(&theirs.codes, k)
                    || zero_blocks(&w).contains(&(k / 64))
                {
                    assert_eq!(mine[k], deq[k], "{name} ours {k}");
                }
            }
        }
        assert_eq!(zero_seen, 1, "the fixture's all-zero block");
        if device == "cpu" {
            assert_eq!(
                ties_seen, 3,
                "values on the three midpoints above their threshold"
            );
        }
    }
}

/// Double quant: bitsandbytes' nested state dequantized by us gives its absmax and weight
/// values to the bit; ours from the weights has its offset within an ulp; ours about its
/// offset is its nested state to the bit (codes, nested absmax, map), on 100+ distinct codes.
#[test]
fn double_quant_equals_bitsandbytes() {
    for (device, f) in ["cpu", "cuda"].map(|d| (d, fixture(d))) {
        let map = dynamic::map();
        let mut used = std::collections::BTreeSet::new();
        for name in NAMES {
            let g = |k: &str| &f[&format!("{name}.nested.{k}")];
            assert_eq!(bits(&f32s(g("code"))), bits(&map), "dynamic map");
            let input = &f[&format!("{name}.input")];
            let theirs = Nf4 {
                shape: input.dims().to_vec(),
                codes: u8s(&f[&format!("{name}.codes")]),
                absmax: Absmax::Nested(Nested {
                    codes: u8s(g("absmax")),
                    absmax: f32s(g("absmax2")),
                    map: map.to_vec(),
                    offset: f32s(g("offset"))[0],
                }),
            };
            let absmax = theirs.absmax_f32();
            assert_eq!(bits(&absmax), bits(&f32s(g("absmax_deq"))), "{name} absmax");
            let deq = theirs.dequantize();
            let want = g("dequant");
            assert_eq!(
                rounded_bits(&deq, want),
                fixture_bits(want),
                "{name} dequant"
            );

            // Ours from the weights: the same NF4 codes, and the offset within a few f32 ulps
            // (ours is the mean in f64, rounded once; torch's is an f32 reduction whose order
            // shows in the last bits: 1 ulp on its CPU, up to 3 on CUDA for the `mixed` weight,
            // whose absmax values span five decades).
            let w = f32s(input);
            let ours = Nf4::quantize(&w, input.dims(), true);
            let Absmax::Nested(n) = &ours.absmax else {
                panic!("nested absmax")
            };
            assert_eq!(ours.codes, Nf4::quantize(&w, input.dims(), false).codes);
            let offset = f32s(g("offset"))[0];
            let ulps = (n.offset.to_bits() as i64 - offset.to_bits() as i64).abs();
            assert!(ulps <= 4, "{device} {name} offset {} vs {offset}", n.offset);

            // Ours about bitsandbytes' offset, from its plain absmax: its nested state to the
            // bit, each 8-bit code the nearest of the map (CUDA's search).
            let plain = f32s(&f[&format!("{name}.absmax")]);
            let n = nf4::nest_about(&plain, offset);
            assert_eq!(n.offset.to_bits(), offset.to_bits(), "{name} offset");
            assert_eq!(bits(&n.map), bits(&map), "{name} map");
            let absmax2 = f32s(g("absmax2"));
            assert_eq!(bits(&n.absmax), bits(&absmax2), "{name} absmax2");
            let want_q = u8s(g("absmax"));
            assert_eq!(want_q, u8s(g("requant")), "{name}: bnb's 8-bit step alone");
            assert_eq!(n.codes, want_q, "{device} {name} nested codes");
            for (i, &a) in n.codes.iter().enumerate() {
                let x = (plain[i] - offset) * (1.0 / absmax2[i / nf4::NESTED_BLOCK]);
                if x.is_nan() {
                    // An all-zero nested block (one absmax, equal to its mean): 0 · (1 / 0).
                    assert_eq!(a, 0, "{name} {i}: NaN takes code 0");
                    continue;
                }
                let d = |j: usize| (map[j] - x).abs();
                assert!(
                    (0..256).all(|j| d(a as usize) <= d(j)),
                    "{name} {i}: {a} not nearest"
                );
            }
            used.extend(want_q);
        }
        assert!(
            used.len() >= 100,
            "the fixture meets {} 8-bit codes",
            used.len()
        );
    }
}
