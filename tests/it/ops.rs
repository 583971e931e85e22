//! Each custom op against a composite reference built from candle's differentiable primitives:
//! forward values and the gradient of a random projection of the output. On the CPU here, and
//! on CUDA too in a `--features cuda` build (the same checks, f32 and bf16).

use crate::common::{assert_close, host_f32};
use candle_core::{DType, Device, Tensor, Var, D};
use lora_train::ops::{self, AttnMask};

mod tree;

pub fn devices() -> Vec<Device> {
    let mut v = vec![Device::Cpu];
    if cfg!(feature = "cuda") {
        v.push(Device::new_cuda(0).expect("a CUDA device"));
    }
    v
}

/// Forward and dL/dx of `f` vs `reference`, L = Σ out ⊙ g for a fixed random g.
fn check(
    what: &str,
    dev: &Device,
    dtype: DType,
    shape: &[usize],
    f: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>,
    reference: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>,
) {
    // bf16: 8 significant bits (ε = 2⁻⁷ ≈ 7.8e-3); a backward sums many rounded products, and
    // the inputs are random each run, so the bound leaves ~2ε of the largest value.
    let (rtol, atol) = if dtype == DType::F32 {
        (1e-5, 1e-6)
    } else {
        (2e-2, 1.5e-2)
    };
    let x0 = Tensor::randn(0f32, 1.0, shape, &Device::Cpu)
        .unwrap()
        .to_device(dev)
        .unwrap();
    let x = Var::from_tensor(&x0.to_dtype(dtype).unwrap()).unwrap();
    let y = f(x.as_tensor()).unwrap();
    let g = Tensor::randn(0f32, 1.0, y.shape(), &Device::Cpu)
        .unwrap()
        .to_device(dev)
        .unwrap();
    let gx = (y.to_dtype(DType::F32).unwrap() * &g)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    // The reference runs in f32 from the same (rounded) input.
    let xr = Var::from_tensor(&x.as_tensor().to_dtype(DType::F32).unwrap()).unwrap();
    let yr = reference(xr.as_tensor()).unwrap();
    let gr = (&yr * &g).unwrap().sum_all().unwrap().backward().unwrap();
    let tag = format!("{what} {dtype:?} {:?}", dev.location());
    assert_close(&format!("{tag} forward"), &y, &yr, rtol, atol);
    assert_close(
        &format!("{tag} dx"),
        gx.get(x.as_tensor()).unwrap(),
        gr.get(xr.as_tensor()).unwrap(),
        rtol * 2.0,
        atol,
    );
}

fn dtypes(dev: &Device) -> Vec<DType> {
    if dev.is_cpu() {
        vec![DType::F32]
    } else {
        vec![DType::F32, DType::BF16]
    }
}

#[test]
fn rms_norm_matches_composite() {
    for dev in devices() {
        // bf16 takes the fused backward on every device: check it on the CPU too. Rows of 48
        // take CUDA's 8-a-thread bf16 kernels, as do a 7B's rows of 4096 (a block of 512
        // threads) and rows of 3080 (the last warp partly idle); rows of 44 the scalar ones.
        let dims = [(DType::F32, 48), (DType::BF16, 48), (DType::BF16, 44)];
        for (dt, d) in dims
            .into_iter()
            .chain([(DType::BF16, 4096), (DType::BF16, 3080)])
        {
            let w = (Tensor::randn(0f32, 0.2, d, &dev).unwrap() + 1.0).unwrap();
            let wd = w.to_dtype(dt).unwrap();
            check(
                &format!("rms_norm d={d}"),
                &dev,
                dt,
                &[2, 5, d],
                &|x| ops::rms_norm(x, &wd, 1e-5),
                &|x| {
                    let r = (x.sqr()?.mean_keepdim(D::Minus1)? + 1e-5)?
                        .sqrt()?
                        .recip()?;
                    x.broadcast_mul(&r)?
                        .broadcast_mul(&wd.to_dtype(DType::F32)?)
                },
            );
        }
    }
}

/// Each gated activation against its composite (candle's silu; gelu, candle's tanh form).
#[test]
fn glu_matches_composite_in_gate_and_up() {
    use lora_train::ops::glu::Act;
    for dev in devices() {
        // bf16 rounds act(g) before the product, as transformers does: check it on the CPU too.
        // 2·3·40 values take CUDA's 8-a-thread bf16 kernels, 2·3·37 the scalar ones.
        let cases = [(DType::F32, 37), (DType::BF16, 37), (DType::BF16, 40)];
        for ((dt, i), act) in cases
            .into_iter()
            .flat_map(|c| [Act::Silu, Act::GeluTanh].map(|a| (c, a)))
        {
            // x = [gate | up] along the last dimension, so dx holds both dg and du.
            check(
                &format!("{act:?} i={i}"),
                &dev,
                dt,
                &[2, 3, 2 * i],
                &|x| {
                    let (g, u) = (x.narrow(D::Minus1, 0, i)?, x.narrow(D::Minus1, i, i)?);
                    act.glu(&(g * 3.0)?, &u)
                },
                &|x| {
                    let (g, u) = (x.narrow(D::Minus1, 0, i)?, x.narrow(D::Minus1, i, i)?);
                    let g = (g * 3.0)?;
                    match act {
                        Act::Silu => candle_nn::ops::silu(&g)? * u,
                        Act::GeluTanh => g.gelu()? * u,
                    }
                },
            );
        }
    }
}

/// The residual add fused with the norm after it gives exactly the two ops' values, on the
/// 8-a-thread bf16 path (48, 3080, 4096) and off it (44: the two ops).
#[test]
fn add_rms_norm_is_add_then_rms_norm_to_the_bit() {
    for dev in devices() {
        let dims = [(DType::F32, 48), (DType::BF16, 48), (DType::BF16, 44)];
        for (dt, d) in dims
            .into_iter()
            .chain([(DType::BF16, 3080), (DType::BF16, 4096)])
        {
            let r = |s: f64, dims: &[usize]| {
                (Tensor::randn(0f32, 1.0, dims, &Device::Cpu).unwrap() * s)
                    .unwrap()
                    .to_dtype(dt)
                    .unwrap()
                    .to_device(&dev)
                    .unwrap()
            };
            let (x, a) = (r(3.0, &[5, d]), r(0.5, &[5, d]));
            let w = (r(0.2, &[d]) + 1.0).unwrap();
            let h = ops::add(&x, &a).unwrap();
            let y = ops::rms_norm(&h, &w, 1e-5).unwrap();
            let (h2, y2) = ops::add_rms_norm(&x, &a, &w, 1e-5).unwrap();
            let tag = format!("{dt:?} d={d} {:?}", dev.location());
            assert_eq!(host_f32(&h2), host_f32(&h), "h {tag}");
            assert_eq!(host_f32(&y2), host_f32(&y), "y {tag}");
        }
    }
}

/// The backward that also hands back the forward's a (written over da on CUDA) gives exactly
/// what the two ops give, for each activation, on the 8-a-thread bf16 path (40) and off it (37).
#[test]
fn glu_bwd_keep_is_glu_bwd_and_glu_to_the_bit() {
    use lora_train::ops::glu::Act;
    for dev in devices() {
        let cases = [(DType::F32, 37), (DType::BF16, 37), (DType::BF16, 40)];
        for ((dt, i), act) in cases
            .into_iter()
            .flat_map(|c| [Act::Silu, Act::GeluTanh].map(|a| (c, a)))
        {
            let r = |s: f64| {
                (Tensor::randn(0f32, 1.0, (2, 3, i), &Device::Cpu).unwrap() * s)
                    .unwrap()
                    .to_dtype(dt)
                    .unwrap()
                    .to_device(&dev)
                    .unwrap()
            };
            let (g, u, da) = (r(3.0), r(1.0), r(1.0));
            let (dg, du) = act.glu_bwd(&g, &u, &da).unwrap();
            let a = act.glu(&g, &u).unwrap();
            let (dg2, du2, a2) = act.glu_bwd_keep(&g, &u, da.copy().unwrap()).unwrap();
            for (what, want, got) in [("dg", &dg, &dg2), ("du", &du, &du2), ("a", &a, &a2)] {
                assert_eq!(
                    host_f32(got),
                    host_f32(want),
                    "{what} {act:?} {dt:?} i={i} {:?}",
                    dev.location()
                );
            }
        }
    }
}

#[test]
fn rope_matches_composite() {
    for dev in devices() {
        for dt in dtypes(&dev) {
            let (b, h, t, d) = (2, 3, 7, 16);
            let cos = Tensor::randn(0f32, 1.0, (b, t, d / 2), &dev).unwrap();
            let sin = Tensor::randn(0f32, 1.0, (b, t, d / 2), &dev).unwrap();
            check(
                "rope",
                &dev,
                dt,
                &[b, h, t, d],
                &|x| ops::rope(x, &cos, &sin),
                &|x| {
                    // x·cos' + rotate_half(x)·sin' with cos' = [cos, cos] per head
                    let c = Tensor::cat(&[&cos, &cos], D::Minus1)?.unsqueeze(1)?;
                    let s = Tensor::cat(&[&sin, &sin], D::Minus1)?.unsqueeze(1)?;
                    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
                    let x2 = x.narrow(D::Minus1, d / 2, d / 2)?;
                    let rot = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
                    x.broadcast_mul(&c)? + rot.broadcast_mul(&s)?
                },
            );
        }
    }
}

/// The fused layout changes (token-major rows ↔ [B, H, T, D]) with and without RoPE, against
/// transpose + `rope` (exact: the same arithmetic per element).
#[test]
fn relayout_and_fused_rope_match_transpose_and_rope() {
    // D 8: four pairs a thread on CUDA; D 6 (half 3): one pair a thread.
    for (dev, d) in devices().into_iter().flat_map(|x| [(x.clone(), 8), (x, 6)]) {
        for dt in dtypes(&dev) {
            let (b, h, t) = (2, 3, 5);
            let cos = Tensor::randn(0f32, 1.0, (b, t, d / 2), &dev).unwrap();
            let sin = Tensor::randn(0f32, 1.0, (b, t, d / 2), &dev).unwrap();
            let rows = Tensor::randn(0f32, 1.0, (b * t, h * d), &dev)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let heads = rows
                .reshape((b, t, h, d))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap();
            let tag = format!("{dt:?} {:?}", dev.location());
            let f32 = |x: &Tensor| x.to_dtype(DType::F32).unwrap();
            assert_close(
                &format!("to_heads {tag}"),
                &f32(&ops::to_heads(&rows, b, t, h).unwrap()),
                &f32(&heads),
                0.0,
                0.0,
            );
            assert_close(
                &format!("to_rows {tag}"),
                &f32(&ops::to_rows(&heads).unwrap()),
                &f32(&rows),
                0.0,
                0.0,
            );
            let want = ops::rope(&heads, &cos, &sin).unwrap();
            let got = ops::rope_heads(&rows, &cos, &sin, h).unwrap();
            assert_eq!(got.dims(), &[b, h, t, d]);
            assert_close(
                &format!("rope_heads {tag}"),
                &f32(&got),
                &f32(&want),
                1e-6,
                1e-6,
            );
            // The inverse: rotating back by −θ into rows recovers the input.
            let back = ops::rope_rows_inv(&want, &cos, &sin).unwrap();
            let inv = ops::rope(&want, &cos, &sin.neg().unwrap())
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .reshape((b * t, h * d))
                .unwrap();
            assert_close(
                &format!("rope_rows_inv {tag}"),
                &f32(&back),
                &f32(&inv),
                1e-6,
                1e-6,
            );
        }
    }
}

/// The fast add (16-byte vectors on CUDA, a scalar tail for odd sizes) is candle's add to
/// the bit; δ from token-major rows equals the [B, H, T, D] composite.
#[test]
fn fast_add_and_row_dot_match_the_composites() {
    for dev in devices() {
        for dt in dtypes(&dev) {
            for n in [4096 * 3, 1001] {
                let a = Tensor::randn(0f32, 1.0, n, &dev)
                    .unwrap()
                    .to_dtype(dt)
                    .unwrap();
                let b = Tensor::randn(0f32, 1.0, n, &dev)
                    .unwrap()
                    .to_dtype(dt)
                    .unwrap();
                let f32 = |x: &Tensor| x.to_dtype(DType::F32).unwrap();
                let tag = format!("add {n} {dt:?} {:?}", dev.location());
                let want = (&a + &b).unwrap();
                assert_close(
                    &tag,
                    &f32(&ops::add(&a, &b).unwrap()),
                    &f32(&want),
                    0.0,
                    0.0,
                );
            }
            let (b, t, h, d) = (2, 5, 3, 40);
            let g = Tensor::randn(0f32, 1.0, (b * t, h * d), &dev)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let o = Tensor::randn(0f32, 1.0, (b * t, h * d), &dev)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let heads = |x: &Tensor| x.reshape((b, t, h, d)).unwrap().transpose(1, 2).unwrap();
            let want = ops::attention::attention_delta(&heads(&g), &heads(&o)).unwrap();
            let got = ops::attention::attention_delta_rows(&g, &o, b, t, h).unwrap();
            assert_eq!(got.dims(), &[b, h, t]);
            let tag = format!("row_dot {dt:?} {:?}", dev.location());
            assert_close(&tag, &got, &want, 1e-5, 1e-5);
        }
    }
}

/// The additive mask of the composite reference: 0 where query i may see key j, else −∞.
fn additive_mask(b: usize, t: usize, seg: Option<&[u32]>, window: usize, dev: &Device) -> Tensor {
    let mut add = vec![0f32; b * t * t];
    for bi in 0..b {
        for i in 0..t {
            for j in 0..t {
                let same = seg.is_none_or(|s| s[bi * t + i] == s[bi * t + j]);
                let ok = j <= i && same && (window == 0 || i - j < window);
                add[(bi * t + i) * t + j] = if ok { 0.0 } else { f32::NEG_INFINITY };
            }
        }
    }
    Tensor::from_vec(add, (b, 1, t, t), dev).unwrap()
}

#[test]
fn blockwise_attention_matches_composite_with_segments_and_window() {
    for dev in devices() {
        for dt in dtypes(&dev) {
            let (b, h, t, d) = (2, 2, 9, 8);
            let seg: Vec<u32> = vec![0, 0, 0, 1, 1, 1, 1, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, u32::MAX];
            for (use_seg, window, block) in [
                (false, 0, None),
                (true, 0, Some(4)),
                (false, 3, Some(2)),
                (true, 0, Some(9)),
            ] {
                let segments = use_seg.then(|| Tensor::from_vec(seg.clone(), b * t, &dev).unwrap());
                let mask = AttnMask {
                    segments,
                    prefix_tree: false,
                    window,
                    softcap: 0.0,
                    sinks: None,
                };
                let add = additive_mask(b, t, use_seg.then_some(&seg[..]), window, &dev);
                let k0 = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
                let v0 = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
                let (k, v) = (k0.to_dtype(dt).unwrap(), v0.to_dtype(dt).unwrap());
                let what = format!("attention seg={use_seg} window={window} block={block:?}");
                // Gradients w.r.t. q here; k and v are checked in the next test via symmetry of use.
                check(
                    &what,
                    &dev,
                    dt,
                    &[b, h, t, d],
                    &|q| ops::attention(q, &k, &v, &mask, 0.35, block),
                    &|q| {
                        let s = (q.matmul(&k0.t()?)? * 0.35)?.broadcast_add(&add)?;
                        candle_nn::ops::softmax(&s, D::Minus1)?.matmul(&v0)
                    },
                );
            }
        }
    }
}

#[test]
fn blockwise_attention_gradients_for_k_and_v() {
    for dev in devices() {
        let (b, h, t, d) = (1, 3, 11, 4);
        let q = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
        let add = additive_mask(b, t, None, 0, &dev);
        let mask = AttnMask::default();
        let k = Var::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
        let v = Var::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
        let g = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
        let ours = ops::attention(&q, k.as_tensor(), v.as_tensor(), &mask, 0.5, Some(3)).unwrap();
        let go = (ours * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let s = (q.matmul(&k.as_tensor().t().unwrap()).unwrap() * 0.5)
            .unwrap()
            .broadcast_add(&add)
            .unwrap();
        let refr = candle_nn::ops::softmax(&s, D::Minus1)
            .unwrap()
            .matmul(v.as_tensor())
            .unwrap();
        let gr = (refr * &g).unwrap().sum_all().unwrap().backward().unwrap();
        for (name, var) in [("dk", &k), ("dv", &v)] {
            assert_close(
                name,
                go.get(var.as_tensor()).unwrap(),
                gr.get(var.as_tensor()).unwrap(),
                1e-5,
                1e-6,
            );
        }
    }
}

#[test]
fn lora_linear_matches_composite_in_x_a_and_b_with_dropout_mask() {
    for dev in devices() {
        let (m, i, o, r) = (7, 12, 10, 3);
        let w = Tensor::randn(0f32, 0.3, (o, i), &dev).unwrap();
        let bias = Tensor::randn(0f32, 0.3, o, &dev).unwrap();
        let x = Var::randn(0f32, 1.0, (1, m, i), &dev).unwrap();
        let a = Var::randn(0f32, 0.3, (r, i), &dev).unwrap();
        let bb = Var::randn(0f32, 0.3, (o, r), &dev).unwrap();
        let drop = lora_train::ops::dropout::Dropout::new(0.25, 3, [1, 2], [0, 0]).unwrap();
        let mask = lora_train::ops::dropout::mask_tensor(&[1, m, i], &drop, &dev).unwrap();
        let g = Tensor::randn(0f32, 1.0, (1, m, o), &dev).unwrap();
        let ours = ops::lora_linear(
            x.as_tensor(),
            &w,
            Some(&bias),
            a.as_tensor(),
            bb.as_tensor(),
            1.7,
            Some(drop),
            lora_train::ops::kernels::Gemm::Tuned, // (the CPU runs candle's matmul)
        )
        .unwrap();
        let go = (&ours * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let xt = x.as_tensor();
        let base = xt
            .broadcast_matmul(&w.t().unwrap())
            .unwrap()
            .broadcast_add(&bias)
            .unwrap();
        let l = (xt * &mask)
            .unwrap()
            .broadcast_matmul(&a.as_tensor().t().unwrap())
            .unwrap();
        let refr = (base
            + (l.broadcast_matmul(&bb.as_tensor().t().unwrap()).unwrap() * 1.7).unwrap())
        .unwrap();
        assert_close("lora_linear forward", &ours, &refr, 1e-5, 1e-6);
        let gr = (&refr * &g).unwrap().sum_all().unwrap().backward().unwrap();
        for (name, var) in [("dx", &x), ("dA", &a), ("dB", &bb)] {
            assert_close(
                name,
                go.get(var.as_tensor()).unwrap(),
                gr.get(var.as_tensor()).unwrap(),
                1e-5,
                1e-6,
            );
        }
    }
}

#[test]
fn frozen_linear_matches_matmul_and_bias() {
    for dev in devices() {
        for dt in dtypes(&dev) {
            let w = Tensor::randn(0f32, 0.3, (24, 40), &dev)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let bias = Tensor::randn(0f32, 0.3, 24, &dev)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            check(
                "frozen_linear",
                &dev,
                dt,
                &[3, 5, 40],
                &|x| ops::frozen_linear(x, &w, Some(&bias)),
                &|x| {
                    x.broadcast_matmul(&w.to_dtype(DType::F32)?.t()?)?
                        .broadcast_add(&bias.to_dtype(DType::F32)?)
                },
            );
        }
    }
}

/// The tensor-core kernels against the blockwise path (itself pinned to the composite above):
/// O, L, dq, dk, dv in bf16 for head dims 64, 96 (Phi-3), 128 and 256 (Gemma), GQA (dk, dv
/// summed over each group), packed segments, a sliding window, Gemma 2's soft-cap (at 50 as
/// configured, and low enough to bend most scores), gpt-oss's sinks (applied to the pass's O and L),
/// and T off the 64- and 128-row tiles; on a
/// Hopper GPU both kernel families, wgmma's backward fused and split, and at head dim 256
/// wgmma's d256 kernels beside mma.sync's. v and dO go in as views of token-major rows, as the
/// training layer passes them.
#[cfg(feature = "cuda")]
#[test]
fn flash_attention_matches_blockwise_on_the_gpu() {
    use lora_train::ops::attention::{attention_bwd, attention_delta, attention_fwd};
    use lora_train::ops::flash;
    use lora_train::ops::kernels::{Attention, AttnShape, Kernels};
    let dev = Device::new_cuda(0).unwrap();
    let rand = |dims: &[usize]| crate::common::randn_bf16(dims, &dev);
    let f32 = |x: &Tensor| x.to_dtype(DType::F32).unwrap();
    for (b, h, kh, t, d, use_seg, window, softcap) in [
        (2, 4, 2, 200, 128, false, 0, 0.0),
        (1, 2, 2, 130, 64, true, 0, 0.0),
        (2, 4, 1, 97, 128, false, 33, 0.0),
        (1, 8, 8, 256, 128, true, 100, 0.0),
        (1, 3, 3, 5, 64, false, 0, 0.0),
        (1, 2, 1, 600, 128, false, 0, 0.0),
        (2, 4, 2, 200, 96, false, 0, 0.0),
        (1, 6, 3, 130, 96, true, 40, 0.0),
        (1, 4, 1, 333, 96, false, 0, 1.5),
        (2, 4, 2, 200, 256, false, 0, 0.0),
        (1, 4, 2, 97, 256, true, 33, 0.0),
        (1, 8, 4, 300, 256, false, 0, 50.0),
        (2, 4, 2, 150, 256, false, 64, 1.0),
        (1, 4, 2, 130, 128, true, 0, 2.0),
        (1, 2, 1, 70, 64, false, 20, 1.0),
        // gpt-oss's layer: window 128, head dim 64, sinks (every row with window 128 has them)
        (2, 8, 2, 260, 64, false, 128, 0.0),
    ] {
        let tag =
            format!("b{b} h{h} k{kh} t{t} d{d} seg={use_seg} window={window} softcap={softcap}");
        let n = h / kh;
        let seg: Vec<u32> = (0..b * t).map(|i| ((i % t) / 37) as u32).collect();
        let mask = AttnMask {
            segments: use_seg.then(|| Tensor::from_vec(seg, b * t, &dev).unwrap()),
            prefix_tree: false,
            window,
            softcap,
            sinks: (window == 128).then(|| Tensor::randn(0f32, 1.0, h, &dev).unwrap()),
        };
        let scale = 1.0 / (d as f64).sqrt();
        let q = rand(&[b, h, t, d]);
        let k = rand(&[b, kh, t, d]);
        let v_rows = rand(&[b * t, kh * d]);
        let do_rows = rand(&[b * t, h * d]);
        let v = v_rows
            .reshape((b, t, kh, d))
            .unwrap()
            .transpose(1, 2)
            .unwrap();
        let d_o = do_rows
            .reshape((b, t, h, d))
            .unwrap()
            .transpose(1, 2)
            .unwrap();
        let shape = AttnShape {
            head_dim: d,
            softcap: softcap > 0.0,
            // the kernels are chosen as without sinks: the window-128 row runs flash with them
            sinks: false,
        };
        let kernels = Kernels::resolve(&dev, DType::BF16, shape, false).unwrap();
        assert!(
            kernels.attention.tensor_cores(),
            "{tag}: bf16 on CUDA must take the kernels"
        );

        // The reference in f32 from the same bf16 values, k and v repeated per query head.
        let rep = |x: &Tensor| {
            f32(x)
                .unsqueeze(2)
                .unwrap()
                .broadcast_as((b, kh, n, t, d))
                .unwrap()
                .reshape((b, h, t, d))
                .unwrap()
        };
        let (qr, kr, vr, dor) = (f32(&q), rep(&k), rep(&v), f32(&d_o));
        let (o_ref, lse_ref) = attention_fwd(&qr, &kr, &vr, &mask, scale, Some(48)).unwrap();
        // Every family the device runs (wgmma on a Hopper GPU for d = 128), the default last:
        // its O and L feed the backward below.
        let families = match kernels.attention {
            Attention::Wgmma | Attention::WgmmaSplitDq => vec![
                Attention::MmaSync,
                Attention::WgmmaSplitDq,
                Attention::Wgmma,
            ],
            Attention::Wgmma256 => vec![Attention::MmaSync, Attention::Wgmma256],
            other => vec![other],
        };
        let mut out = None;
        for &fam in &families {
            let (o, lse) = flash::flash_fwd(&q, &k, &v, &mask, scale, fam).unwrap();
            let o_heads = o.reshape((b, t, h, d)).unwrap().transpose(1, 2).unwrap();
            assert_close(&format!("{tag} {fam:?} O"), &o_heads, &o_ref, 2e-2, 1e-2);
            assert_close(&format!("{tag} {fam:?} L"), &lse, &lse_ref, 1e-3, 1e-3);
            out = Some((o_heads, lse));
        }
        let (o_heads, lse) = out.unwrap();

        let delta = attention_delta(&d_o, &o_heads).unwrap();
        let delta_ref = attention_delta(&dor, &o_ref).unwrap();
        let (dq_r, dk_r, dv_r) = attention_bwd(
            &qr,
            &kr,
            &vr,
            &dor,
            &delta_ref,
            &lse_ref,
            &mask,
            scale,
            Some(48),
        )
        .unwrap();
        let group = |x: &Tensor| x.reshape((b, kh, n, t, d)).unwrap().sum(2).unwrap();
        for &fam in &families {
            let (dq, dk, dv) =
                flash::flash_bwd(&q, &k, &v, &d_o, &delta, &lse, &mask, scale, None, fam).unwrap();
            // RoPE's backward in the stores: dq and dk as rows rotated back, against the separate
            // pass over the kernels' heads (that one rounds twice: the bound is bf16's, of the scale).
            let cos = Tensor::randn(0f32, 1.0, (b, t, d / 2), &dev).unwrap();
            let sin = Tensor::randn(0f32, 1.0, (b, t, d / 2), &dev).unwrap();
            let (dqr, dkr, dvr) = flash::flash_bwd(
                &q,
                &k,
                &v,
                &d_o,
                &delta,
                &lse,
                &mask,
                scale,
                Some((&cos, &sin)),
                fam,
            )
            .unwrap();
            let rows_of =
                |x: &Tensor, n: usize| x.transpose(1, 2).unwrap().reshape((b * t, n * d)).unwrap();
            for (what, got, want) in [
                (
                    "dq",
                    rows_of(&dqr, h),
                    ops::rope_rows_inv(&dq, &cos, &sin).unwrap(),
                ),
                (
                    "dk",
                    rows_of(&dkr, kh),
                    ops::rope_rows_inv(&dk, &cos, &sin).unwrap(),
                ),
            ] {
                assert_close(
                    &format!("{tag} {fam:?} {what} with RoPE's backward"),
                    &got,
                    &want,
                    1e-2,
                    1e-2,
                );
            }
            assert_close(
                &format!("{tag} {fam:?} dv beside RoPE"),
                &dvr,
                &dv,
                0.0,
                0.0,
            );
            assert_eq!(dv.dims(), v.dims(), "{tag} {fam:?}: dv is shaped like v");
            assert_eq!(
                dv.layout().stride(),
                v.layout().stride(),
                "{tag} {fam:?}: and laid out like v"
            );
            assert_close(&format!("{tag} {fam:?} dq"), &dq, &dq_r, 2e-2, 1e-2);
            assert_close(&format!("{tag} {fam:?} dk"), &dk, &group(&dk_r), 2e-2, 1e-2);
            assert_close(&format!("{tag} {fam:?} dv"), &dv, &group(&dv_r), 2e-2, 1e-2);
        }
    }
}

/// Random logits [n, v] on the CPU at scale 30 (softmax far from uniform), row 0 constant
/// (uniform), and targets hitting each row's argmax, the first and last column, and others.
fn ce_inputs(n: usize, v: usize) -> (Tensor, Tensor) {
    let mut x: Vec<f32> = (Tensor::randn(0f32, 1.0, (n, v), &Device::Cpu).unwrap() * 30.0)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    x[..v].fill(5.0);
    let logits = Tensor::from_vec(x, (n, v), &Device::Cpu).unwrap();
    let argmax: Vec<u32> = logits.argmax(1).unwrap().to_vec1().unwrap();
    let tgt: Vec<u32> = (0..n)
        .map(|i| match i % 4 {
            0 => argmax[i],
            1 => 0,
            2 => v as u32 - 1,
            _ => ((i * 7919) % v) as u32,
        })
        .collect();
    (logits, Tensor::from_vec(tgt, n, &Device::Cpu).unwrap())
}

/// The tensor-op path (the CPU's) against log_softmax + gather and (softmax − onehot) / denom.
#[test]
fn cross_entropy_matches_log_softmax_composite() {
    use lora_train::ops::cross_entropy::cross_entropy_fwd_bwd;
    use lora_train::ops::kernels::CrossEntropy;
    let denom = 123.0;
    for v in [1000, 1003] {
        let n = 37;
        let (logits, tgt) = ce_inputs(n, v);
        let (ce, dl) =
            cross_entropy_fwd_bwd(&logits, &tgt, denom, None, CrossEntropy::Ops).unwrap();
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1).unwrap();
        let tgt2 = tgt.unsqueeze(1).unwrap();
        let ce_ref = logp
            .gather(&tgt2, 1)
            .unwrap()
            .squeeze(1)
            .unwrap()
            .neg()
            .unwrap();
        let onehot = Tensor::zeros((n, v), DType::F32, &Device::Cpu)
            .unwrap()
            .scatter_add(
                &tgt2,
                &Tensor::ones((n, 1), DType::F32, &Device::Cpu).unwrap(),
                1,
            )
            .unwrap();
        let dl_ref = ((candle_nn::ops::softmax(&logits, D::Minus1).unwrap() - onehot).unwrap()
            / denom)
            .unwrap();
        assert_eq!(dl.dtype(), DType::F32);
        // ce is lse − logit[t]: at a row's argmax a small difference of large terms, hence
        // the absolute part (relative to the largest ce).
        assert_close(&format!("v{v} ce"), &ce, &ce_ref, 1e-5, 1e-6);
        assert_close(&format!("v{v} dlogits"), &dl, &dl_ref, 1e-5, 1e-6);
        // bf16 logits: the same math on their f32 values, the gradient rounded once to bf16.
        let lb = logits.to_dtype(DType::BF16).unwrap();
        let ops = CrossEntropy::Ops;
        let (ce_b, dl_b) = cross_entropy_fwd_bwd(&lb, &tgt, denom, None, ops).unwrap();
        let (ce_f, dl_f) =
            cross_entropy_fwd_bwd(&lb.to_dtype(DType::F32).unwrap(), &tgt, denom, None, ops)
                .unwrap();
        assert_eq!(dl_b.dtype(), DType::BF16);
        assert_close(&format!("v{v} bf16 ce"), &ce_b, &ce_f, 0.0, 0.0);
        assert_close(
            &format!("v{v} bf16 dlogits"),
            &dl_b,
            &dl_f.to_dtype(DType::BF16).unwrap(),
            0.0,
            0.0,
        );
    }
}

/// The fused kernel (f32 and bf16, V off and on multiples of 4) against the tensor ops on the
/// CPU over the same (bf16-rounded) logits; with Gemma 2's final soft-cap inside (a cap small
/// enough to bind on these logits) against the CPU's soft-cap, tensor-op CE and soft-cap
/// backward (the capped logits unrounded, f32, as the kernel makes them).
#[cfg(feature = "cuda")]
#[test]
fn cross_entropy_kernel_matches_the_ops_on_the_gpu() {
    use lora_train::ops::cross_entropy::{cross_entropy_fwd_bwd, kernel_takes};
    use lora_train::ops::kernels::CrossEntropy;
    let dev = Device::new_cuda(0).unwrap();
    let (denom, n) = (517.0, 37);
    for (cap, v, dtype) in [None, Some(3.0)]
        .into_iter()
        .flat_map(|c| [32003, 1000].map(|v| (c, v)))
        .flat_map(|(c, v)| [DType::F32, DType::BF16].map(|d| (c, v, d)))
    {
        let tag = format!("v{v} {dtype:?} cap {cap:?}");
        let (logits, tgt) = ce_inputs(n, v);
        let x = logits.to_device(&dev).unwrap().to_dtype(dtype).unwrap();
        let t = tgt.to_device(&dev).unwrap();
        assert!(kernel_takes(&x, &t), "{tag}: must take the kernel");
        let fused = CrossEntropy::Fused;
        let (ce, dl) = cross_entropy_fwd_bwd(&x, &t, denom, cap, fused).unwrap();
        assert_eq!(
            dl.dtype(),
            dtype,
            "{tag}: the gradient in the logits' dtype"
        );
        if cap.is_some() {
            let (ce0, _) = cross_entropy_fwd_bwd(&x, &t, denom, None, fused).unwrap();
            let bites = crate::common::max_abs_diff(&ce, &ce0) > 0.1;
            assert!(bites, "{tag}: the cap does not bind on these logits");
        }
        let x_cpu = x
            .to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let ops = CrossEntropy::Ops;
        let (ce_ref, dl_ref) = cross_entropy_fwd_bwd(&x_cpu, &tgt, denom, cap, ops).unwrap();
        // the capped loss sums tanh's f32 rounding over the vocabulary: a wider floor
        let floor = if cap.is_some() { 1e-5 } else { 1e-6 };
        let (ce_tol, dl_tol) = if dtype == DType::F32 {
            ((1e-5, floor), (1e-5, 1e-6))
        } else {
            ((1e-4, floor), (0.0, 1e-2))
        };
        assert_close(&format!("{tag} ce"), &ce, &ce_ref, ce_tol.0, ce_tol.1);
        assert_close(&format!("{tag} dlogits"), &dl, &dl_ref, dl_tol.0, dl_tol.1);
    }
}

/// RoPE's angles made on the GPU (from the positions there) are the host's to f32 accuracy:
/// positions up to 4999 in rows of 8192 (restarting, as packed rows do), Llama-2 frequencies.
#[cfg(feature = "cuda")]
#[test]
fn rope_cos_sin_on_the_gpu_match_the_host() {
    use lora_train::model::rope::cos_sin;
    let dev = Device::new_cuda(0).unwrap();
    let inv: Vec<f32> = (0..64)
        .map(|i| 1.0 / 10000f32.powf(i as f32 / 64.0))
        .collect();
    let (b, t) = (2, 8192);
    let pos: Vec<u32> = (0..b * t).map(|i| (i % t) as u32 % 5000).collect();
    let (c_gpu, s_gpu) = cos_sin(&inv, &pos, b, t, &dev).unwrap();
    let (c_cpu, s_cpu) = cos_sin(&inv, &pos, b, t, &Device::Cpu).unwrap();
    assert_eq!(c_gpu.dims(), [b, t, 64]);
    assert_close(
        "cos",
        &c_gpu.to_device(&Device::Cpu).unwrap(),
        &c_cpu,
        0.0,
        1e-6,
    );
    assert_close(
        "sin",
        &s_gpu.to_device(&Device::Cpu).unwrap(),
        &s_cpu,
        0.0,
        1e-6,
    );
}

/// The large GEMMs' tuned algorithms (`gemm_tune`) give the very bits that cublasGemmEx
/// gives, forward (acc + x Wᵀ), backward (acc + g W) and an adapter's term (s · xas Bᵀ over
/// k = 16, xas a column slice), at the 7B MLP's shapes for 1024 tokens: the choice depends
/// on timing, so it must not depend on anything else. And the result is the product (against
/// the same product in f32 on the CPU, at a bf16 tolerance).
#[cfg(feature = "cuda")]
#[test]
fn tuned_gemms_give_gemmex_bits_on_the_gpu() {
    use lora_train::ops::kernels::Gemm;
    use lora_train::ops::linear_acc::{linear_acc, linear_bwd_acc, matmul_scaled};
    let dev = Device::new_cuda(0).unwrap();
    let rand = |dims: &[usize]| crate::common::randn_bf16(dims, &Device::Cpu);
    let (m, c, i) = (1024, 4096, 11008);
    let (x, w, acc) = (rand(&[m, c]), rand(&[i, c]), rand(&[m, i]));
    let g = rand(&[m, i]);
    let acc_b = rand(&[m, c]);
    let gpu = |t: &Tensor| t.to_device(&dev).unwrap();
    let (xas, b) = (rand(&[m, 48]).narrow(1, 16, 16).unwrap(), rand(&[i, 16]));
    let run = |tuned: bool| {
        let k = if tuned { Gemm::Tuned } else { Gemm::Heuristic };
        let y = linear_acc(&gpu(&x), &gpu(&w), gpu(&acc), k).unwrap();
        let dx = linear_bwd_acc(&gpu(&g), &gpu(&w), gpu(&acc_b), k).unwrap();
        // an adapter's term back to full width: xas Bᵀ, k = r, xas a column slice
        let lora = matmul_scaled(&gpu(&xas), &gpu(&b), true, 0.5, k).unwrap();
        (host_f32(&y), host_f32(&dx), host_f32(&lora))
    };
    let plain = run(false);
    let first = run(true); // times the candidates
    let again = run(true); // the chosen one
    for (name, a, b) in [
        ("forward, tuning", &plain.0, &first.0),
        ("forward, tuned", &plain.0, &again.0),
        ("backward, tuning", &plain.1, &first.1),
        ("backward, tuned", &plain.1, &again.1),
        ("adapter term, tuning", &plain.2, &first.2),
        ("adapter term, tuned", &plain.2, &again.2),
    ] {
        let diff = a
            .iter()
            .zip(b)
            .filter(|(p, q)| p.to_bits() != q.to_bits())
            .count();
        assert_eq!(
            diff,
            0,
            "{name}: {diff} of {} values differ from gemmEx's",
            a.len()
        );
    }
    // The product itself, on a sample of rows (f32 on the CPU).
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let rows = 8;
    let want = (f(&acc.narrow(0, 0, rows).unwrap())
        + f(&x.narrow(0, 0, rows).unwrap())
            .matmul(&f(&w).t().unwrap())
            .unwrap())
    .unwrap()
    .flatten_all()
    .unwrap()
    .to_vec1::<f32>()
    .unwrap();
    for (k, (p, q)) in want.iter().zip(&again.0[..rows * i]).enumerate() {
        assert!(
            (p - q).abs() <= 0.02 * p.abs().max(8.0),
            "y[{k}]: {q} vs {p}"
        );
    }
}

/// down_proj's backward folded with the gated activation's (`ops::fold::glu_down_bwd`: one
/// GEMM against the padded weight, one kernel), SwiGLU's and GeGLU's, against the same math in
/// f32 from the same bf16 operands: dL/da = dy·W (the GEMM's bf16 output) + s·(dy·B)·A, the
/// activation's backward at it, and dA = s·(dy·B)ᵀ·a with a the forward's bf16 act(g)·u
/// (silu, or gelu's tanh form). Ranks in each of the kernel's forms
/// (8 and 16: one k step; 24: two; 64: four), tokens that are not whole tiles (300), a width
/// whose last strip is partial (688), B in pad columns after another adapter's (col 8). With
/// down's dropout (the mask drawn in the kernel), the adapter's term of dL/da is masked and
/// dA takes m ⊙ a, the CPU's mask M as a tensor.
#[cfg(feature = "cuda")]
#[test]
fn folded_down_backward_matches_f32_math_on_the_gpu() {
    use lora_train::ops::dropout::{mask_tensor, Dropout};
    use lora_train::ops::glu::Act;
    let dev = Device::new_cuda(0).unwrap();
    let (m, out, i, s) = (300, 256, 688, 2.0);
    let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let bf = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
    let round = |t: &Tensor| f32(&bf(t)); // to bf16 and back
    let rn = |shape: (usize, usize), std: f32| bf(&Tensor::randn(0f32, std, shape, &dev).unwrap());
    let drop = Dropout::new(0.1, 3, [1, 0], [2, 6]).unwrap().fused(true);
    let cases = [(8, 0), (16, 0), (24, 8), (64, 0)]
        .into_iter()
        .flat_map(|rc| [(rc, None), (rc, Some(drop))]);
    let acts = [Act::Silu, Act::GeluTanh];
    for (((r, col), dropout), act) in cases.flat_map(|c| acts.map(|a| (c, a))) {
        let tag = format!("{act:?} r{r} col{col} dropout {}", dropout.is_some());
        let pad = lora_train::ops::fold::pad_width(&[col + r], i).unwrap();
        let (w, b, a) = (rn((out, i), 0.05), rn((out, r), 0.5), rn((r, i), 0.5));
        let (g, u, dy) = (rn((m, i), 2.0), rn((m, i), 1.0), rn((m, out), 1.0));
        let z = |n: usize| Tensor::zeros((out, n), DType::BF16, &dev).unwrap();
        let full = Tensor::cat(&[&w, &z(col), &b, &z(pad - col - r)], 1).unwrap(); // [out, i+pad]
        let tuned = lora_train::ops::kernels::Gemm::Tuned;
        let d = dropout.as_ref();
        let got = ops::fold::glu_down_bwd(act, &dy, &full, col, &g, &u, &a, s, d, tuned)
            .unwrap()
            .unwrap_or_else(|| panic!("{tag}: the kernel must take these"));
        let (dg, du, da_grad) = (&got.dg, &got.du, &got.da);

        // M: 1 / (1 − p) where kept, else 0; all ones without dropout
        let mask = match d {
            Some(d) => mask_tensor(&[m, i], d, &dev).unwrap(),
            None => Tensor::ones((m, i), DType::F32, &dev).unwrap(),
        };
        let (dyf, gf, uf) = (f32(&dy), f32(&g), f32(&u));
        let gb = round(&dyf.matmul(&f32(&b)).unwrap()); // [m, r], the GEMM's bf16 output
        let base = round(&dyf.matmul(&f32(&w)).unwrap());
        let lora = (gb.matmul(&f32(&a)).unwrap() * s).unwrap();
        let da = (base + (lora * &mask).unwrap()).unwrap();
        let (act_g, dact) = glu_f32(act, &gf); // act(g), act'(g)
        let dg_ref = (round(&(&da * &uf).unwrap()) * &dact).unwrap();
        let du_ref = (&da * round(&act_g)).unwrap();
        let a_ref = round(&(round(&act_g) * &uf).unwrap());
        let xd = round(&(a_ref * &mask).unwrap()); // down's input under dropout, as the forward's
        let da_ref = (gb.t().unwrap().matmul(&xd).unwrap() * s).unwrap(); // [r, i]
        assert_close(&format!("{tag} dgate"), dg, &dg_ref, 1e-2, 2e-3);
        assert_close(&format!("{tag} dup"), du, &du_ref, 1e-2, 2e-3);
        assert_eq!(da_grad.dtype(), DType::F32, "{tag}: dA in f32");
        // (a g_B entry the GEMM rounded the other way moves dA by s·ulp·|a|: atol)
        assert_close(&format!("{tag} dA"), da_grad, &da_ref, 1e-2, 1e-3);
    }
}

/// act(g) and its derivative in f32: silu(g) = g·σ(g), σ(1 + g(1 − σ)); gelu's tanh form
/// 0.5·g·(1 + t), t = tanh(c·(g + 0.044715·g³)), c = √(2/π), and PyTorch's derivative of it.
#[cfg(feature = "cuda")]
fn glu_f32(act: lora_train::ops::glu::Act, g: &Tensor) -> (Tensor, Tensor) {
    use lora_train::ops::glu::Act;
    let one_plus = |t: &Tensor| (t + 1.0).unwrap();
    match act {
        Act::Silu => {
            let sg = one_plus(&g.neg().unwrap().exp().unwrap()).recip().unwrap();
            let one_minus = (sg.neg().unwrap() + 1.0).unwrap();
            let d = (one_plus(&(g * &one_minus).unwrap()) * &sg).unwrap();
            ((g * &sg).unwrap(), d)
        }
        Act::GeluTanh => {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let g2 = g.sqr().unwrap();
            let inner = ((g * one_plus(&(&g2 * 0.044715).unwrap())).unwrap() * c).unwrap();
            let t = inner.tanh().unwrap();
            let gelu = ((g * one_plus(&t)).unwrap() * 0.5).unwrap();
            let sech2 = (t.sqr().unwrap().neg().unwrap() + 1.0).unwrap();
            let dinner = (one_plus(&(&g2 * 0.134145).unwrap()) * c).unwrap();
            let tail = ((g * sech2).unwrap() * dinner).unwrap();
            let d = ((one_plus(&t) + tail).unwrap() * 0.5).unwrap();
            (gelu, d)
        }
    }
}

/// RMSNorm's backward reading dL/dy in place from padded rows (`ops::fold`'s dL/dx: the first
/// d columns of [m, d + pad]) gives the contiguous input's values to the bit, with and without
/// the residual term.
#[cfg(feature = "cuda")]
#[test]
fn rms_norm_bwd_reads_padded_rows_on_the_gpu() {
    let dev = Device::new_cuda(0).unwrap();
    let (m, d, pad) = (37, 256, 64);
    let bf = |t: Tensor| t.to_dtype(DType::BF16).unwrap();
    let rn = |shape: (usize, usize)| bf(Tensor::randn(0f32, 1.0, shape, &dev).unwrap());
    let (x, res, gp) = (rn((m, d)), rn((m, d)), rn((m, d + pad)));
    let w = bf(Tensor::randn(1f32, 0.1, d, &dev).unwrap());
    let g = gp.narrow(1, 0, d).unwrap();
    assert!(!g.is_contiguous());
    let gc = g.contiguous().unwrap();
    let strided = ops::rms_norm_bwd(&x, &w, 1e-5, &g).unwrap();
    let plain = ops::rms_norm_bwd(&x, &w, 1e-5, &gc).unwrap();
    assert_eq!(host_f32(&strided), host_f32(&plain), "rms_norm_bwd");
    let strided = ops::rms_norm_bwd_add(&x, &w, 1e-5, &g, &res).unwrap();
    let plain = ops::rms_norm_bwd_add(&x, &w, 1e-5, &gc, &res).unwrap();
    assert_eq!(host_f32(&strided), host_f32(&plain), "rms_norm_bwd_add");
}

/// A readback waits for its own copy even on a context with one stream (no parked
/// activations), where cudarc records no event for a pinned slice: each value is made after
/// tens of milliseconds of queued GEMMs and read at once, in reused buffers, so a read that
/// did not wait would see the previous value.
#[cfg(feature = "cuda")]
#[test]
fn a_readback_waits_for_its_copy_with_one_stream() {
    use lora_train::train::readback::Readbacks;
    let dev = Device::new_cuda(0).unwrap();
    let a = Tensor::randn(0f32, 1.0, (4096, 4096), &dev).unwrap();
    let mut r = Readbacks::new();
    for i in 1..=4 {
        let mut y = a.clone();
        for _ in 0..8 {
            y = (y.matmul(&a).unwrap() * 1e-2).unwrap();
        }
        // i, made after the GEMMs: 0 · y's first element + i.
        let v = ((y.get(0).unwrap().get(0).unwrap() * 0.0).unwrap() + i as f64).unwrap();
        let t = r.start(&[&v]).unwrap();
        assert_eq!(r.read(t).unwrap(), vec![i as f64], "read {i}");
    }
}

/// A checkpoint's host stage on CUDA: tensors made after tens of milliseconds of queued GEMMs,
/// staged and at once overwritten in place (as the next update does), come back with the
/// values they had when staged, as f32 of their shapes; the buffers are reused.
#[cfg(feature = "cuda")]
#[test]
fn the_host_stage_copies_what_the_tensors_held_when_staged() {
    use lora_train::run::host_stage::Stage;
    let dev = Device::new_cuda(0).unwrap();
    let a = Tensor::randn(0f32, 1.0, (4096, 4096), &dev).unwrap();
    let stage = Stage::new();
    for i in 1..=3 {
        let mut y = a.clone();
        for _ in 0..8 {
            y = (y.matmul(&a).unwrap() * 1e-2).unwrap();
        }
        let zero = (y.narrow(0, 0, 2).unwrap().narrow(1, 0, 3).unwrap() * 0.0).unwrap();
        let v = Var::from_tensor(&(zero + i as f64).unwrap()).unwrap(); // [2, 3] of i
        let w = Tensor::new(&[i as f32; 5], &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let staged = stage
            .copy(vec![("v".into(), v.as_tensor().clone()), ("w".into(), w)])
            .unwrap();
        v.set(&v.zeros_like().unwrap()).unwrap();
        let got = staged.tensors().unwrap();
        assert_eq!(
            got[0].1.to_vec2::<f32>().unwrap(),
            vec![vec![i as f32; 3]; 2]
        );
        assert_eq!(got[1].1.to_vec1::<f32>().unwrap(), vec![i as f32; 5]);
        assert_eq!((got[0].0.as_str(), got[1].0.as_str()), ("v", "w"));
        // The file written from the pinned buffer is the one written from those tensors.
        let dir = std::env::temp_dir().join(format!("lt-stage-{}-{i}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (p1, p2) = (
            dir.join("staged.safetensors"),
            dir.join("tensors.safetensors"),
        );
        staged.write(&p1).unwrap();
        lora_train::export::write_tensors(&p2, &got).unwrap();
        assert_eq!(std::fs::read(&p1).unwrap(), std::fs::read(&p2).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// The experts' grouped GEMMs on CUDA (one cublasGemmGroupedBatchedEx call) against the same
/// products on the CPU in f32 (one GEMM per expert), f32 and bf16: uneven groups, empty
/// experts, both orientations of W, α and an accumulated result, W's matrices apart (the
/// second half of a stack, as gate_up's up half); pᵀq per expert (zero where an expert has no
/// rows).
#[cfg(feature = "cuda")]
#[test]
fn grouped_gemms_match_per_expert_gemms_on_the_gpu() {
    use lora_train::ops::grouped_mm::{grouped_linear, grouped_tn};
    let gpu = Device::new_cuda(0).unwrap();
    let counts = [37usize, 0, 128, 5, 0, 300];
    let (p, e) = (counts.iter().sum::<usize>(), counts.len());
    for (dt, rtol, atol) in [(DType::F32, 1e-4, 1e-5), (DType::BF16, 2e-2, 1e-2)] {
        for (k, n) in [(96, 200), (256, 16), (16, 768)] {
            let rn = |shape: &[usize]| {
                let t = Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap();
                t.to_dtype(dt).unwrap().to_dtype(DType::F32).unwrap() // representable in dt
            };
            let (x, wt, wn, acc) = (rn(&[p, k]), rn(&[e, n, k]), rn(&[e, k, n]), rn(&[p, n]));
            let q = rn(&[p, n]);
            let on = |t: &Tensor| t.to_device(&gpu).unwrap().to_dtype(dt).unwrap();
            let tag = format!("{dt:?} k{k} n{n}");
            let want = grouped_linear(&x, &wt, &counts, true, 0.25, Some(acc.clone())).unwrap();
            let got =
                grouped_linear(&on(&x), &on(&wt), &counts, true, 0.25, Some(on(&acc))).unwrap();
            assert_close(&format!("{tag} x Wᵀ"), &got, &want, rtol, atol);
            let want = grouped_linear(&x, &wn, &counts, false, 1.0, None).unwrap();
            let got = grouped_linear(&on(&x), &on(&wn), &counts, false, 1.0, None).unwrap();
            assert_close(&format!("{tag} x W"), &got, &want, rtol, atol);
            // the second halves of [E, 2n, k] and [E, 2k, n]: matrices 2·n·k apart
            let (wide_t, wide_n) = (rn(&[e, 2 * n, k]), rn(&[e, 2 * k, n]));
            for (wide, trans) in [(&wide_t, true), (&wide_n, false)] {
                let rows = wide.dim(1).unwrap() / 2;
                let want = grouped_linear(
                    &x,
                    &wide.narrow(1, rows, rows).unwrap(),
                    &counts,
                    trans,
                    1.0,
                    None,
                )
                .unwrap();
                let half = on(wide).narrow(1, rows, rows).unwrap();
                let got = grouped_linear(&on(&x), &half, &counts, trans, 1.0, None).unwrap();
                assert_close(
                    &format!("{tag} half, trans {trans}"),
                    &got,
                    &want,
                    rtol,
                    atol,
                );
            }
            let want = grouped_tn(&x, &q, &counts, 0.5).unwrap();
            let got = grouped_tn(&on(&x), &on(&q), &counts, 0.5).unwrap();
            assert_close(&format!("{tag} pᵀq"), &got, &want, rtol, atol);
        }
    }
}

/// The MoE row kernels (moe_rows.cu, bf16) against the same sums in f32 on the CPU: the
/// gather of the tokens' rows, each token's k rows weighted and summed (and unweighted, as
/// the backward sums dL/dx), and the backward's gather with the weights' gradient.
#[cfg(feature = "cuda")]
#[test]
fn moe_row_kernels_match_f32_math_on_the_gpu() {
    use lora_train::ops::moe_rows::{combine, gather, scatter_grad};
    let gpu = Device::new_cuda(0).unwrap();
    for (m, k, c) in [(300usize, 8usize, 2048usize), (17, 2, 64), (5, 3, 8)] {
        let p = m * k;
        // a permutation of the grouped rows as the routing makes: token n's slot j at j·m + n
        let slots: Vec<u32> = (0..p as u32).map(|i| (i * 7919 + 13) % p as u32).collect();
        let mut tokens = vec![0u32; p];
        for (i, &q) in slots.iter().enumerate() {
            tokens[q as usize] = (i % m) as u32;
        }
        let cpu = |v: &Vec<u32>| Tensor::from_vec(v.clone(), p, &Device::Cpu).unwrap();
        let (slots, tokens) = (cpu(&slots), cpu(&tokens));
        let rn = |shape: &[usize]| {
            let t = Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap();
            t.to_dtype(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
        };
        let (x, y, g) = (rn(&[m, c]), rn(&[p, c]), rn(&[m, c]));
        let w = Tensor::rand(0f32, 1.0, p, &Device::Cpu).unwrap();
        let bf = |t: &Tensor| t.to_device(&gpu).unwrap().to_dtype(DType::BF16).unwrap();
        let on = |t: &Tensor| t.to_device(&gpu).unwrap();
        let tag = format!("m{m} k{k} C{c}");
        let got = gather(&bf(&x), &on(&tokens)).unwrap();
        assert_close(
            &format!("{tag} gather"),
            &got,
            &gather(&x, &tokens).unwrap(),
            0.0,
            0.0,
        );
        for wt in [Some(&w), None] {
            let want = combine(&y, &slots, wt, k).unwrap();
            let got = combine(&bf(&y), &on(&slots), wt.map(on).as_ref(), k).unwrap();
            assert_close(
                &format!("{tag} combine {}", wt.is_some()),
                &got,
                &want,
                1e-2,
                1e-3,
            );
        }
        let (gy, dw) = scatter_grad(&g, &tokens, &w, &y).unwrap();
        let (gy_got, dw_got) = scatter_grad(&bf(&g), &on(&tokens), &on(&w), &bf(&y)).unwrap();
        assert_eq!(dw_got.dtype(), DType::F32, "{tag}: dw in f32");
        assert_close(&format!("{tag} gy"), &gy_got, &gy, 1e-2, 1e-3);
        assert_close(&format!("{tag} dw"), &dw_got, &dw, 1e-4, 1e-5);
    }
}
