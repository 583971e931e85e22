//! LoRA dropout (ops::dropout, ops::fold_drop): the hand-written forward and backward under
//! dropout against autograd through plain tensor ops with the masks as tensors; masks keyed
//! by the global (layer, module), so that several ranks train what one does; on the GPU, the
//! device draws the CPU's masks bit for bit, in the masked copies and inside the fused kernels.

use crate::common::Session;
use crate::common::*;
use candle_core::{Tensor, Var};
use lora_train::model::Linear;
use lora_train::ops::dropout::mask_tensor;

fn session(sets: &[&str]) -> (tempfile::TempDir, Session) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let r = recipe(tmp.path(), &golden_recipe("llama_gqa", &out), sets);
    (tmp, Session::new(r).unwrap())
}

/// One linear in plain tensor ops from leaves x, A, B: y = x Wᵀ + s · ((x ⊙ M) Aᵀ) Bᵀ, with M
/// the linear's mask for `ctx` as a tensor.
fn reference(
    lin: &Linear,
    x: &Var,
    ab: &(Var, Var),
    ctx: &lora_train::model::decoder::Ctx,
) -> Tensor {
    let lora = lin.lora.as_ref().unwrap();
    let d = lin
        .dropout(ctx)
        .expect("the linear has dropout for this batch");
    let mask = mask_tensor(x.dims(), &d, x.device()).unwrap();
    let base = x.as_tensor().matmul(&lin.w.t().unwrap()).unwrap();
    let xd = (x.as_tensor() * &mask).unwrap();
    let xa = xd.matmul(&ab.0.as_tensor().t().unwrap()).unwrap();
    let ad = (xa.matmul(&ab.1.as_tensor().t().unwrap()).unwrap() * lora.scale).unwrap();
    (base + ad).unwrap()
}

/// Leaves holding a linear's A and B.
fn leaves(lin: &Linear) -> (Var, Var) {
    let lora = lin.lora.as_ref().unwrap();
    (
        Var::from_tensor(lora.a.as_tensor()).unwrap(),
        Var::from_tensor(lora.b.as_tensor()).unwrap(),
    )
}

/// Training's three ways through an adapted linear under dropout, each against autograd with
/// the masks as tensors: q, k, v as one group (`fwd_shared` / `bwd_shared`: each its own mask),
/// o alone (`fwd` / `bwd`), and down in halves (`bwd_dx`, then `bwd_grads` with its input, as
/// the layer's backward runs it). Outputs, dL/dx and every dA, dB.
#[test]
fn hand_written_backward_under_dropout_equals_autograd_with_the_masks_as_tensors() {
    let (_t, s) = session(&["lora.dropout = 0.25"]);
    let m = &s.model;
    for (_, lora) in m.adapters() {
        let b = Tensor::randn(0f32, 0.1, lora.b.shape(), lora.b.device()).unwrap();
        lora.b.set(&b).unwrap();
    }
    let (b, t) = (2, 9);
    let positions: Vec<u32> = (0..b).flat_map(|_| 0..t as u32).collect();
    let ctx = m.ctx(&positions, b, t, None, Some((11, [5, 2]))).unwrap();
    let layer = &m.layers[1];
    let randn = |cols: usize| Tensor::randn(0f32, 1.0, (b * t, cols), &m.device).unwrap();
    let close = |what: &str, got: &Tensor, want: &Tensor| assert_close(what, got, want, 1e-5, 1e-6);

    // q, k, v share x: one call each way, three masks.
    let qkv: Vec<&Linear> = layer.attn_in.iter().collect();
    assert_eq!(qkv.len(), 3, "the fixture's q, k, v are separate");
    let x = randn(qkv[0].w.dim(1).unwrap());
    let fwd = Linear::fwd_shared(&qkv, &x, &ctx).unwrap();
    let g: Vec<Tensor> = qkv.iter().map(|l| randn(l.out_features())).collect();
    let xas: Vec<Option<&Tensor>> = fwd.iter().map(|(_, s)| s.as_ref()).collect();
    let (dx, grads) = Linear::bwd_shared(&qkv, &x, g.clone(), &xas, &ctx).unwrap();
    let xv = Var::from_tensor(&x).unwrap();
    let abs: Vec<(Var, Var)> = qkv.iter().map(|l| leaves(l)).collect();
    let mut loss = Tensor::zeros((), candle_core::DType::F32, &m.device).unwrap();
    for (((lin, ab), gi), (y, _)) in qkv.iter().zip(&abs).zip(&g).zip(&fwd) {
        let want = reference(lin, &xv, ab, &ctx);
        close(&format!("{} y", lin.name), y, &want);
        loss = (loss + (want * gi).unwrap().sum_all().unwrap()).unwrap();
    }
    let gs = loss.backward().unwrap();
    close("q, k, v dx", &dx, gs.get(xv.as_tensor()).unwrap());
    for ((lin, ab), gr) in qkv.iter().zip(&abs).zip(&grads) {
        let gr = gr.as_ref().unwrap();
        let (da, db) = (&gr.a, &gr.b);
        close(
            &format!("{} dA", lin.name),
            da,
            gs.get(ab.0.as_tensor()).unwrap(),
        );
        close(
            &format!("{} dB", lin.name),
            db,
            gs.get(ab.1.as_tensor()).unwrap(),
        );
    }

    // o alone, and down's backward in halves.
    for (lin, halves) in [(&layer.o, false), (layer.down.as_ref().unwrap(), true)] {
        let x = randn(lin.w.dim(1).unwrap());
        let g = randn(lin.out_features());
        let (y, xas) = lin.fwd(&x, &ctx).unwrap();
        let (dx, gr) = match halves {
            false => lin.bwd(&x, &g, xas.as_ref(), &ctx, None).unwrap(),
            true => {
                let (dx, half) = lin.bwd_dx(&g, &ctx, None).unwrap();
                (dx, lin.bwd_grads(&x, &g, half, xas.as_ref(), &ctx).unwrap())
            }
        };
        let (xv, ab) = (Var::from_tensor(&x).unwrap(), leaves(lin));
        let want = reference(lin, &xv, &ab, &ctx);
        close(&format!("{} y", lin.name), &y, &want);
        let gs = (want * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let gr = gr.unwrap();
        let (da, db) = (gr.a, gr.b);
        close(
            &format!("{} dx", lin.name),
            &dx,
            gs.get(xv.as_tensor()).unwrap(),
        );
        close(
            &format!("{} dA", lin.name),
            &da,
            gs.get(ab.0.as_tensor()).unwrap(),
        );
        close(
            &format!("{} dB", lin.name),
            &db,
            gs.get(ab.1.as_tensor()).unwrap(),
        );
    }
}

/// Every linear's mask is keyed by the model's layer index and the module's place in
/// `ALL_LINEAR` (what a gathered or recomputed layer carries along), and by (seed, step,
/// micro-batch); eval draws none.
#[test]
fn masks_are_keyed_by_the_global_layer_and_module_and_the_batch() {
    use lora_train::model::ALL_LINEAR;
    use lora_train::ops::dropout::Dropout;
    let (_t, s) = session(&["lora.dropout = 0.1"]);
    let m = &s.model;
    let ctx = m.ctx(&[0, 1, 2], 1, 3, None, Some((42, [7, 3]))).unwrap();
    let eval = m.ctx(&[0, 1, 2], 1, 3, None, None).unwrap();
    let mut n = 0;
    for (l, layer) in m.layers.iter().enumerate() {
        for (k, lin) in layer.linears().into_iter().enumerate() {
            let want = Dropout::new(0.1, 42, [7, 3], [l as u64, k as u64]);
            assert_eq!(ALL_LINEAR[k], lin.name.rsplit('.').next().unwrap());
            assert_eq!(
                lin.dropout(&ctx).map(|d| d.fused(false)),
                want,
                "{}",
                lin.name
            );
            assert_eq!(lin.dropout(&eval), None, "{}: eval draws no mask", lin.name);
            n += 1;
        }
    }
    assert_eq!(n, 7 * m.layers.len());
}

/// Three steps of training with dropout, on two ranks (DDP; FSDP with and without
/// checkpointing: gathered and recomputed layers) and on one rank with the same micro-batches
/// (micro-batch k of rank r is the global micro-batch 2k + r): the same masks, so the same
/// adapter; and another seed's masks give another one.
#[test]
fn ranks_and_checkpointing_draw_the_masks_one_rank_draws() {
    let train = |sets: &[&str], parallel: &str| {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let text = format!("{}\n{parallel}\n", golden_recipe("llama_gqa", &out));
        let mut all = vec![
            "lora.dropout=0.3",
            "train.max_steps=3",
            "train.micro_batch=1",
        ];
        all.extend_from_slice(sets);
        let r = recipe(tmp.path(), &text, &all);
        assert_eq!(lora_train::run::run(r).unwrap().steps, 3);
        load_st(&out.join("adapter_model.safetensors"))
    };
    let par = |strategy: &str| {
        format!("[parallel]\nstrategy = \"{strategy}\"\ndevices = [0, 1]\ntimeout_s = 60\n")
    };
    let one = train(&["train.grad_accum=2"], "");
    let runs = [
        ("ddp", train(&["train.grad_accum=1"], &par("ddp"))),
        ("fsdp", train(&["train.grad_accum=1"], &par("fsdp"))),
        (
            "fsdp, checkpointed",
            train(
                &["train.grad_accum=1", "train.activation_checkpointing=true"],
                &par("fsdp"),
            ),
        ),
    ];
    for (what, got) in &runs {
        assert_eq!(got.len(), one.len());
        for (k, t) in &one {
            assert_close(&format!("{what} {k}"), &got[k], t, 1e-5, 1e-6);
        }
    }
    let other = train(&["train.grad_accum=2", "train.seed=7"], "");
    let moved = one
        .iter()
        .map(|(k, t)| max_abs_diff(t, &other[k]))
        .fold(0f32, f32::max);
    assert!(
        moved > 1e-4,
        "another seed's masks must train another adapter"
    );
}

/// The device's masked copies (dropout.cu's dropout_apply) are the CPU's, bit for bit, in bf16
/// and f32, at several rates and keys, over a length that is no multiple of 8.
#[cfg(feature = "cuda")]
#[test]
fn device_masks_equal_the_cpu_masks_bit_for_bit_on_the_gpu() {
    use candle_core::{DType, Device};
    use lora_train::ops::dropout::{apply, Dropout};
    let gpu = Device::new_cuda(0).unwrap();
    let x = Tensor::randn(0f32, 1.0, (1001, 77), &Device::Cpu).unwrap();
    for (p, seed, batch, at) in [
        (0.05f32, 42u64, [0u64, 0u64], [0u64, 0u64]),
        (0.1, 42, [1000, 3], [31, 6]),
        (0.5, 7, [123_456, 1], [2, 4]),
    ] {
        let d = Dropout::new(p, seed, batch, at).unwrap();
        for dt in [DType::BF16, DType::F32] {
            let xc = x.to_dtype(dt).unwrap();
            let want = host_f32(&apply(&xc, &d).unwrap());
            let got = host_f32(&apply(&xc.to_device(&gpu).unwrap(), &d).unwrap());
            let same = want
                .iter()
                .zip(&got)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "p {p} {dt:?}: the device's mask differs");
        }
    }
}

/// Inside the fused kernels (ops::fold_drop, CUDA bf16): with x = 1 and each A_j the identity,
/// xas_j = s · m_j ⊙ x is linear j's mask itself, so the three masks the forward kernel draws
/// are compared with the CPU's bit for bit; the backward's likewise (dL/dx += m_j with
/// gB_j A_j = 1; dA_j = column sums of m_j, exact at p = 0.5). Random operands then match the
/// masked copies' path (`fused: false`) to bf16 rounding, for one, two and three linears.
#[cfg(feature = "cuda")]
#[test]
fn fused_dropout_kernels_draw_the_cpu_masks_on_the_gpu() {
    use candle_core::{DType, Device};
    use lora_train::ops::dropout::Dropout;
    use lora_train::ops::fold_drop::{bwd, xas};
    use lora_train::ops::kernels::Gemm;
    let dev = Device::new_cuda(0).unwrap();
    let gemm = Gemm::Tuned;
    let bf = |t: Tensor| t.to_dtype(DType::BF16).unwrap().to_device(&dev).unwrap();
    let (m, in_f, r) = (300, 64, 64);
    for p in [0.1f32, 0.5] {
        let drops: Vec<Dropout> = (0..3)
            .map(|j| Dropout::new(p, 5, [9, 1], [3, j]).unwrap().fused(true))
            .collect();
        let masks: Vec<Vec<f32>> = drops.iter().map(|d| d.mask(m * in_f)).collect();
        let kept = |j: usize| -> Vec<f32> {
            let s = half::bf16::from_f32(drops[j].scale).to_f32();
            masks[j]
                .iter()
                .map(|&v| if v != 0.0 { s } else { 0.0 })
                .collect()
        };
        // forward: x = 1, A_j = I [64, 64]
        let x = bf(Tensor::ones((m, in_f), DType::F32, &candle_core::Device::Cpu).unwrap());
        let eye = Tensor::eye(r, DType::F32, &candle_core::Device::Cpu).unwrap();
        let a = bf(Tensor::cat(&[&eye, &eye, &eye], 0).unwrap());
        let y = xas(&x, &a, &drops, 1.0, gemm).unwrap(); // [m, 3·64]
        for j in 0..3 {
            let got = host_f32(&y.narrow(1, j * r, r).unwrap());
            assert_eq!(got, kept(j), "p {p}: linear {j}'s forward mask");
        }
        // backward, one linear at a time: gB = e_0 rows, A row 0 = 1 → gB·A = 1
        for j in 0..3 {
            let mut g = vec![0f32; m * 8];
            for t in 0..m {
                g[t * 8] = 1.0;
            }
            let gb = bf(Tensor::from_vec(g, (m, 8), &candle_core::Device::Cpu).unwrap());
            let mut av = vec![0f32; 8 * in_f];
            av[..in_f].fill(1.0);
            let a1 = bf(Tensor::from_vec(av, (8, in_f), &candle_core::Device::Cpu).unwrap());
            let dx0 = bf(Tensor::zeros((m, in_f), DType::F32, &candle_core::Device::Cpu).unwrap());
            let (dx, da) = bwd(&x, dx0, &gb, &a1, &drops[j..j + 1], 1.0, gemm).unwrap();
            assert_eq!(host_f32(&dx), kept(j), "p {p}: linear {j}'s backward mask");
            if p == 0.5 {
                let sums: Vec<f32> = (0..in_f)
                    .map(|c| (0..m).map(|t| masks[j][t * in_f + c]).sum())
                    .collect();
                let da = host_f32(&da);
                assert_eq!(&da[..in_f], &sums[..], "linear {j}'s dA row 0");
                assert!(da[in_f..].iter().all(|&v| v == 0.0), "ranks past gB's");
            }
        }
    }
    // Random operands, padded rows (the fold's), against the masked copies' path.
    let cpu = candle_core::Device::Cpu;
    for (n, in_f, r, m) in [(3, 72, 16, 257), (2, 256, 8, 64), (1, 688, 64, 300)] {
        let drops: Vec<Dropout> = (0..n)
            .map(|j| Dropout::new(0.1, 3, [2, 0], [1, j as u64]).unwrap())
            .collect();
        let fused: Vec<Dropout> = drops.iter().map(|d| d.fused(true)).collect();
        let xp = bf(Tensor::randn(0f32, 1.0, (m, in_f + 64), &cpu).unwrap());
        let x = xp.narrow(1, 0, in_f).unwrap();
        let a = bf((Tensor::randn(0f32, 1.0, (n * r, in_f), &cpu).unwrap() * 0.1).unwrap());
        let tag = format!("{n} linears, in {in_f}, r {r}, m {m}");
        let (yf, yr) = (
            xas(&x, &a, &fused, 0.5, gemm).unwrap(),
            xas(&x, &a, &drops, 0.5, gemm).unwrap(),
        );
        assert_close(&format!("{tag}: xas"), &yf, &yr, 1e-2, 1e-2);
        let gp = bf(Tensor::randn(0f32, 1.0, (m, in_f + n * r + 8), &cpu).unwrap());
        let gb = gp.narrow(1, in_f, n * r).unwrap();
        let dx0 = || bf(Tensor::randn(0f32, 1.0, (m, in_f), &candle_core::Device::Cpu).unwrap());
        let d0 = dx0();
        let (dxf, daf) = bwd(&x, d0.copy().unwrap(), &gb, &a, &fused, 0.5, gemm).unwrap();
        let (dxr, dar) = bwd(&x, d0, &gb, &a, &drops, 0.5, gemm).unwrap();
        assert_close(&format!("{tag}: dx"), &dxf, &dxr, 2e-2, 1e-2);
        assert_close(&format!("{tag}: dA"), &daf, &dar, 1e-2, 1e-3);
    }
}
