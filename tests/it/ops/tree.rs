//! The prefix-tree mask (`AttnMask::prefix_tree`: a preference pair's prompt shared by its two
//! completions) against a dense masked composite: the blockwise pass forward and backward in
//! q, k and v (CPU, and CUDA's kernels in a `--features cuda` build), and the tensor-core
//! kernels of every family the GPU runs (`--features cuda`).

use crate::common::{assert_close, max_abs_diff};
use candle_core::{DType, Device, Tensor, Var, D};
use lora_train::ops::{self, AttnMask};

/// Tree ids of rows of trees (prompt, chosen, rejected lengths), `example << 2 | branch`, each
/// row padded to `t` with u32::MAX.
fn tree_ids(rows: &[&[(usize, usize, usize)]], t: usize) -> Vec<u32> {
    let mut ids = Vec::new();
    for row in rows {
        let start = ids.len();
        for (k, &(p, c, r)) in row.iter().enumerate() {
            for (branch, n) in [(0u32, p), (1, c), (2, r)] {
                ids.extend(std::iter::repeat_n(((k as u32) << 2) | branch, n));
            }
        }
        assert!(ids.len() - start <= t);
        ids.resize(start + t, u32::MAX);
    }
    ids
}

/// The composite's additive mask [B, 1, T, T]: query i sees key j iff j ≤ i, within the window,
/// and j is in i's branch or in its tree's prompt (branch 0).
fn tree_mask(b: usize, t: usize, ids: &[u32], window: usize, dev: &Device) -> Tensor {
    let mut add = vec![f32::NEG_INFINITY; b * t * t];
    for bi in 0..b {
        for i in 0..t {
            for j in 0..=i {
                let (si, sj) = (ids[bi * t + i], ids[bi * t + j]);
                let tree = si >> 2 == sj >> 2 && sj & 3 == 0;
                if (si == sj || tree) && (window == 0 || i - j < window) {
                    add[(bi * t + i) * t + j] = 0.0;
                }
            }
        }
    }
    Tensor::from_vec(add, (b, 1, t, t), dev).unwrap()
}

/// softmax(scale · q kᵀ + add) v in f32, k and v [B, K, T, D] repeated for the H / K query
/// heads of each.
fn composite(q: &Tensor, k: &Tensor, v: &Tensor, add: &Tensor, scale: f64) -> Tensor {
    let (b, h, t, d) = q.dims4().unwrap();
    let kh = k.dim(1).unwrap();
    let rep = |x: &Tensor| {
        x.unsqueeze(2)
            .unwrap()
            .broadcast_as((b, kh, h / kh, t, d))
            .unwrap()
            .reshape((b, h, t, d))
            .unwrap()
    };
    let s = (q.matmul(&rep(k).t().unwrap()).unwrap() * scale)
        .unwrap()
        .broadcast_add(add)
        .unwrap();
    candle_nn::ops::softmax(&s, D::Minus1)
        .unwrap()
        .matmul(&rep(v))
        .unwrap()
}

/// (O, dq, dk, dv) of the composite in f32 for L = Σ O ⊙ g, from q, k, v's values.
fn composite_grads(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    add: &Tensor,
    scale: f64,
) -> [Tensor; 4] {
    let f32v = |x: &Tensor| Var::from_tensor(&x.to_dtype(DType::F32).unwrap()).unwrap();
    let (q, k, v) = (f32v(q), f32v(k), f32v(v));
    let o = composite(q.as_tensor(), k.as_tensor(), v.as_tensor(), add, scale);
    let gs = (&o * g).unwrap().sum_all().unwrap().backward().unwrap();
    let get = |x: &Var| gs.get(x.as_tensor()).unwrap().clone();
    [o.clone(), get(&q), get(&k), get(&v)]
}

fn devices() -> Vec<Device> {
    super::devices()
}

#[test]
fn blockwise_attention_matches_the_composite_on_prefix_trees() {
    // two rows: three trees and padding; a tree with a one-token prompt and branches
    let (b, h, t, d) = (2, 2, 24, 8);
    let ids = tree_ids(
        &[&[(3, 4, 2), (1, 2, 3), (4, 1, 3)], &[(5, 6, 7), (1, 1, 1)]],
        t,
    );
    for dev in devices() {
        let dts = match dev.is_cpu() {
            true => vec![DType::F32],
            false => vec![DType::F32, DType::BF16],
        };
        for dt in dts {
            for (window, block) in [(0, None), (0, Some(5)), (0, Some(1)), (6, Some(7))] {
                let mask = AttnMask {
                    segments: Some(Tensor::from_vec(ids.clone(), b * t, &dev).unwrap()),
                    prefix_tree: true,
                    window,
                    ..Default::default()
                };
                let add = tree_mask(b, t, &ids, window, &dev);
                let rnd =
                    |s: (usize, usize, usize, usize)| Tensor::randn(0f32, 1.0, s, &dev).unwrap();
                let g = rnd((b, h, t, d));
                let [q, k, v] = [0; 3]
                    .map(|_| Var::from_tensor(&rnd((b, h, t, d)).to_dtype(dt).unwrap()).unwrap());
                let o = ops::attention(
                    q.as_tensor(),
                    k.as_tensor(),
                    v.as_tensor(),
                    &mask,
                    0.4,
                    block,
                )
                .unwrap();
                let gs = (o.to_dtype(DType::F32).unwrap() * &g)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                let want =
                    composite_grads(q.as_tensor(), k.as_tensor(), v.as_tensor(), &g, &add, 0.4);
                let (rtol, atol) = match dt {
                    DType::F32 => (1e-5, 1e-6),
                    _ => (2e-2, 1.5e-2),
                };
                let tag = format!(
                    "tree {dt:?} {:?} window={window} block={block:?}",
                    dev.location()
                );
                assert_close(&format!("{tag} O"), &o, &want[0], rtol, atol);
                for (what, x, w) in [
                    ("dq", &q, &want[1]),
                    ("dk", &k, &want[2]),
                    ("dv", &v, &want[3]),
                ] {
                    let got = gs.get(x.as_tensor()).unwrap();
                    assert_close(&format!("{tag} {what}"), got, w, 2.0 * rtol, atol);
                }
            }
        }
    }
}

/// The mask differs from the block-diagonal one on the same ids exactly where a branch sees its
/// prompt: without the flag, the tree ids are plain segments.
#[test]
fn without_the_flag_tree_ids_are_plain_segments() {
    let (b, h, t, d) = (1, 1, 9, 4);
    let ids = tree_ids(&[&[(2, 3, 2)]], t);
    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
    let k = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
    let v = Tensor::randn(0f32, 1.0, (b, h, t, d), &dev).unwrap();
    let seg = Tensor::from_vec(ids.clone(), b * t, &dev).unwrap();
    let plain = AttnMask {
        segments: Some(seg.clone()),
        ..Default::default()
    };
    let tree = AttnMask {
        prefix_tree: true,
        ..plain.clone()
    };
    let (o_plain, _) = ops::attention::attention_fwd(&q, &k, &v, &plain, 0.5, Some(4)).unwrap();
    let (o_tree, _) = ops::attention::attention_fwd(&q, &k, &v, &tree, 0.5, Some(4)).unwrap();
    let blockdiag: Vec<u32> = ids.clone();
    let mut add = vec![f32::NEG_INFINITY; t * t];
    for i in 0..t {
        for j in 0..=i {
            if blockdiag[i] == blockdiag[j] {
                add[i * t + j] = 0.0;
            }
        }
    }
    let add = Tensor::from_vec(add, (1, 1, t, t), &dev).unwrap();
    assert_close(
        "plain",
        &o_plain,
        &composite(&q, &k, &v, &add, 0.5),
        1e-5,
        1e-6,
    );
    let o_ref = composite(&q, &k, &v, &tree_mask(b, t, &ids, 0, &dev), 0.5);
    assert_close("tree", &o_tree, &o_ref, 1e-5, 1e-6);
    // the prompt's rows (0, 1) are the same either way; the branches' differ
    let rows = |o: &Tensor, s: usize, n: usize| o.narrow(2, s, n).unwrap();
    assert_close(
        "prompt",
        &rows(&o_tree, 0, 2),
        &rows(&o_plain, 0, 2),
        0.0,
        0.0,
    );
    let diff = max_abs_diff(&rows(&o_tree, 2, 5), &rows(&o_plain, 2, 5));
    assert!(diff > 1e-3, "a branch must see its prompt: {diff}");
}

/// The tensor-core kernels (every family the GPU runs, `Kernels::resolve`'s last) on prefix
/// trees against the composite in f32 from the same bf16 values: trees across tile bounds (64,
/// 128), a prompt of many tiles, one-token trees, padding, GQA, a window.
#[test]
#[cfg(feature = "cuda")]
fn flash_attention_on_prefix_trees_matches_the_composite_on_the_gpu() {
    use lora_train::ops::attention::attention_delta;
    use lora_train::ops::flash;
    use lora_train::ops::kernels::{Attention, AttnShape, Kernels};
    let dev = Device::new_cuda(0).unwrap();
    let rand = |dims: &[usize]| crate::common::randn_bf16(dims, &dev);
    let rows: [&[(usize, usize, usize)]; 2] = [
        &[(70, 60, 90), (1, 1, 1), (40, 100, 20)],
        &[(150, 10, 30), (5, 64, 64), (2, 1, 3)],
    ];
    let t = 389;
    let ids = tree_ids(&rows, t);
    for (h, kh, d, window) in [
        (4, 2, 128, 0),
        (2, 1, 64, 0),
        (2, 2, 96, 0),
        (4, 2, 256, 0),
        (2, 1, 128, 50),
    ] {
        let b = 2;
        let tag = format!("tree h{h} k{kh} d{d} window={window}");
        let mask = AttnMask {
            segments: Some(Tensor::from_vec(ids.clone(), b * t, &dev).unwrap()),
            prefix_tree: true,
            window,
            ..Default::default()
        };
        let scale = 1.0 / (d as f64).sqrt();
        let (q, k, v, d_o) = (
            rand(&[b, h, t, d]),
            rand(&[b, kh, t, d]),
            rand(&[b, kh, t, d]),
            rand(&[b, h, t, d]),
        );
        let add = tree_mask(b, t, &ids, window, &dev);
        let want = composite_grads(&q, &k, &v, &d_o.to_dtype(DType::F32).unwrap(), &add, scale);
        let shape = AttnShape {
            head_dim: d,
            softcap: false,
            sinks: false,
        };
        let kernels = Kernels::resolve(&dev, DType::BF16, shape, false).unwrap();
        let families = match kernels.attention {
            Attention::Wgmma | Attention::WgmmaSplitDq => {
                vec![
                    Attention::MmaSync,
                    Attention::WgmmaSplitDq,
                    Attention::Wgmma,
                ]
            }
            Attention::Wgmma256 => vec![Attention::MmaSync, Attention::Wgmma256],
            other => vec![other],
        };
        for &fam in &families {
            let (o, lse) = flash::flash_fwd(&q, &k, &v, &mask, scale, fam).unwrap();
            let o = o.reshape((b, t, h, d)).unwrap().transpose(1, 2).unwrap();
            assert_close(&format!("{tag} {fam:?} O"), &o, &want[0], 2e-2, 1e-2);
            let delta = attention_delta(&d_o, &o).unwrap();
            let (dq, dk, dv) =
                flash::flash_bwd(&q, &k, &v, &d_o, &delta, &lse, &mask, scale, None, fam).unwrap();
            assert_close(&format!("{tag} {fam:?} dq"), &dq, &want[1], 2e-2, 1e-2);
            assert_close(&format!("{tag} {fam:?} dk"), &dk, &want[2], 2e-2, 1e-2);
            assert_close(&format!("{tag} {fam:?} dv"), &dv, &want[3], 2e-2, 1e-2);
        }
    }
}
