//! Properties of the training step that must hold exactly, whatever the model: the frozen base
//! never gets a gradient; accumulation equals a bigger batch; checkpointing changes memory,
//! not numbers; packing changes layout, not the loss.

use crate::common::Session;
use crate::common::*;
use candle_core::{Tensor, Var};
use lora_train::data::{Batch, ExampleRef};
use lora_train::memory::plan::{kept_attention_per_token_layer, kept_per_token_layer};
use lora_train::model::Keep;
use lora_train::model::Retain;
use lora_train::train::driver;
use lora_train::train::optim::Grads;

use crate::common::golden_session as session;

#[test]
fn frozen_base_gets_no_gradient_entry() {
    for case in ["llama_gqa", "qwen2_bias", "llama_mha_tied_rope3"] {
        let (_t, s) = session(case, &[]);
        let batch = s.batch(&[vec![0], vec![1]]);
        let ids = Tensor::from_slice(&batch.ids, (batch.b, batch.t), &s.model.device).unwrap();
        let ctx = s
            .model
            .ctx(&batch.positions, batch.b, batch.t, None, None)
            .unwrap();
        // The whole model in one graph, the embedding output made a leaf so that everything
        // downstream of it is differentiated.
        let x = Var::from_tensor(&s.model.embed(&ids).unwrap()).unwrap();
        let mut h = x.as_tensor().clone();
        for layer in &s.model.layers {
            h = layer.forward(&h, &ctx).unwrap();
        }
        let loss = s.model.head(&h).unwrap().sqr().unwrap().mean_all().unwrap();
        let grads = loss.backward().unwrap();
        let base = s.model.base_tensors();
        assert!(base.len() > 10);
        for t in base {
            assert!(
                grads.get(t).is_none(),
                "{case}: a frozen tensor {:?} got a gradient",
                t.dims()
            );
        }
        for (name, lora) in s.model.adapters() {
            assert!(
                grads.get(lora.a.as_tensor()).is_some(),
                "{case}: {name} lora_A has no gradient"
            );
            assert!(
                grads.get(lora.b.as_tensor()).is_some(),
                "{case}: {name} lora_B has no gradient"
            );
        }
        assert!(grads.get(x.as_tensor()).is_some());
    }
}

/// The hand-written layer backward (what training runs) against autograd through the
/// composite `Layer::forward`: output, dL/dx and every adapter gradient, on models with GQA,
/// q/k/v bias and tied heads, with dropout on and packed segments. That graph's attention node
/// (`ops::attention`) carries the training's own attention backward, so the attention part is
/// held to an independent reference elsewhere: finite differences of the forward (`grad_fd`),
/// and the op against a dense softmax composite (`ops`).
#[test]
fn hand_written_layer_backward_equals_autograd() {
    for case in [
        "llama_gqa",
        "qwen2_bias",
        "llama_mha_tied_rope3",
        "mistral_head_dim",
    ] {
        let (_t, s) = session(case, &["lora.dropout = 0.2"]);
        let ex: Vec<ExampleRef> = (0..4)
            .map(|i| s.d.data().unwrap().examples.get(i))
            .collect();
        let batch = Batch::from_rows(&[vec![ex[0], ex[1]], vec![ex[2], ex[3]]], 0, true);
        assert!(batch.segments.is_some(), "{case}: the rows must be packed");
        let m = &s.model;
        let ctx = m
            .ctx(
                &batch.positions,
                batch.b,
                batch.t,
                batch.segments.clone(),
                Some((7, [3, 1])),
            )
            .unwrap();
        let ids = Tensor::from_slice(&batch.ids, (batch.b, batch.t), &m.device).unwrap();
        let x0 = m.embed(&ids).unwrap();
        // Two layers deep, so the input of the second is not an embedding.
        let x = m.layers[0].forward(&x0, &ctx).unwrap().detach();
        let layer = &m.layers[1];
        let g = Tensor::randn(0f32, 1.0, x.shape(), &m.device).unwrap();

        let (xv, y_ref, gs) = autograd_reference(layer, &x, &g, &ctx);

        let (y, acts) = layer.forward_train(&x, &ctx, true).unwrap();
        assert_close(&format!("{case} y"), &y, &y_ref, 1e-6, 1e-6);
        let acts = acts.unwrap();
        assert!(acts.bytes() > 0);
        let (dx, grads) = layer.backward(acts, &g, &ctx).unwrap();
        let ours = (dx, grads);
        check_layer_grads(case, layer, &ours, &gs, xv.as_tensor(), (1e-5, 1e-6));
    }
}

/// The first layer's backward without dL/dx (`backward_grads`, what the driver runs there)
/// gives the full backward's adapter gradients bit for bit: with the q, k, v adapters run as
/// one group (no dropout) and apart (dropout on), and with q, v only (k has no adapter).
#[test]
fn first_layer_backward_without_input_grad_keeps_every_gradient() {
    for sets in [
        vec![],
        vec!["lora.dropout = 0.2"],
        vec!["lora.targets = [\"q_proj\", \"v_proj\"]"],
    ] {
        let (_t, s) = session("llama_gqa", &sets);
        let tag = format!("{sets:?}");
        let batch = s.batch(&[vec![0], vec![1]]);
        let m = &s.model;
        let ctx = m
            .ctx(&batch.positions, batch.b, batch.t, None, Some((7, [3, 1])))
            .unwrap();
        let ids = Tensor::from_slice(&batch.ids, (batch.b, batch.t), &m.device).unwrap();
        let x = m.embed(&ids).unwrap();
        let layer = &m.layers[0];
        let g = Tensor::randn(0f32, 1.0, x.shape(), &m.device).unwrap();
        let run = || layer.forward_train(&x, &ctx, true).unwrap().1.unwrap();
        let (_dx, full) = layer.backward(run(), &g, &ctx).unwrap();
        let only = layer.backward_grads(run(), &g, &ctx).unwrap();
        assert_eq!(
            full.len(),
            only.len(),
            "{tag}: one entry per adapter matrix"
        );
        assert!(!full.is_empty(), "{tag}: the layer has adapters");
        for ((id_a, a), (id_b, b)) in full.iter().zip(&only) {
            assert_eq!(id_a, id_b, "{tag}: same order");
            let (a, b) = (host_f32(a), host_f32(b));
            assert_eq!(a, b, "{tag}: same gradient");
            assert!(
                a.iter().any(|v| *v != 0.0),
                "{tag}: a gradient that is not zero"
            );
        }
    }
}

/// The reference of the hand-written pair: autograd through `Layer::forward` from x as a leaf,
/// L = Σ y ⊙ g in f32 → (the leaf, y, the gradients).
pub(crate) fn autograd_reference(
    layer: &lora_train::model::Layer,
    x: &Tensor,
    g: &Tensor,
    ctx: &lora_train::model::decoder::Ctx,
) -> (Var, Tensor, candle_core::backprop::GradStore) {
    let xv = Var::from_tensor(x).unwrap();
    let y = layer.forward(xv.as_tensor(), ctx).unwrap();
    let gs = (y.to_dtype(candle_core::DType::F32).unwrap() * g)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    (xv, y, gs)
}

/// A hand-written layer backward's (dL/dx, adapter gradients) against autograd's `gs`: dL/dx
/// of `x`, and one dA and one dB per adapter, each at (rtol, atol).
fn check_layer_grads(
    tag: &str,
    layer: &lora_train::model::Layer,
    (dx, grads): &(Tensor, lora_train::model::LayerGrads),
    gs: &candle_core::backprop::GradStore,
    x: &Tensor,
    (rtol, atol): (f64, f64),
) {
    assert_close(&format!("{tag} dx"), dx, gs.get(x).unwrap(), rtol, atol);
    let n_lora = layer.linears().iter().filter(|l| l.lora.is_some()).count();
    assert_eq!(
        grads.len(),
        2 * n_lora,
        "{tag}: one dA and one dB per adapter"
    );
    for lin in layer.linears() {
        let Some(lora) = &lin.lora else { continue };
        for (w, var) in [("A", &lora.a), ("B", &lora.b)] {
            let ours = &grads.iter().find(|(id, _)| *id == var.id()).unwrap().1;
            assert_close(
                &format!("{tag} {} d{w}", lin.name),
                ours,
                gs.get(var.as_tensor()).unwrap(),
                rtol,
                atol,
            );
        }
    }
}

/// The hand-written head + cross-entropy backward against autograd through
/// `Model::head` and `cross_entropy_sum`, tied and untied heads.
#[test]
fn hand_written_head_backward_equals_autograd() {
    for case in ["llama_gqa", "llama_mha_tied_rope3"] {
        let (_t, s) = session(case, &[]);
        let m = &s.model;
        let c = m.cfg.hidden_size;
        let x = (Tensor::randn(0f32, 1.0, (6, c), &m.device).unwrap() * 3.0).unwrap();
        let tgt = Tensor::new(&[3u32, 0, 17, 3, 120, 9], &m.device).unwrap();
        let denom = 11.0;
        let (ce, dx) = m.head_loss_bwd(&x, &tgt, denom).unwrap();
        let xv = Var::from_tensor(&x).unwrap();
        let ce_ref =
            lora_train::model::decoder::cross_entropy_sum(&m.head(xv.as_tensor()).unwrap(), &tgt)
                .unwrap();
        let want = ce_ref.to_scalar::<f32>().unwrap() as f64;
        assert!(
            (ce - want).abs() <= 1e-5 * want.abs(),
            "{case}: CE {ce} vs {want}"
        );
        let gs = (ce_ref / denom).unwrap().backward().unwrap();
        let dx_ref = gs.get(xv.as_tensor()).unwrap();
        assert_close(&format!("{case} head dx"), &dx, dx_ref, 1e-5, 1e-6);
    }
}

fn adapter_after(case: &str, sets: &[&str]) -> std::collections::HashMap<String, Tensor> {
    let (tmp, s) = session(case, sets);
    let out = tmp.path().join("out");
    s.train(&out).unwrap();
    load_st(&out.join("adapter_model.safetensors"))
}

#[test]
fn two_micro_batches_of_two_equal_one_batch_of_four() {
    let (_t, s) = session("llama_gqa", &[]);
    // Rows 0-3 of train.jsonl count 9, 11, 3 and 7 tokens: uneven on purpose.
    let n: Vec<usize> = (0..4).map(|i| s.batch(&[vec![i]]).n_targets()).collect();
    assert!(
        n[0] + n[1] != n[2] + n[3],
        "test data must be uneven: {n:?}"
    );
    let total = n.iter().sum::<usize>() as f64;
    let big = s.batch(&[vec![0], vec![1], vec![2], vec![3]]);
    let mut g_big = Grads::new();
    let ce_big =
        driver::forward_backward(&s.model, &big, total, Keep::Acts, None, &mut g_big).unwrap();
    let mut g_acc = Grads::new();
    let mut ce_acc = 0.0;
    for rows in [[0, 1], [2, 3]] {
        let b = s.batch(&[vec![rows[0]], vec![rows[1]]]);
        ce_acc +=
            driver::forward_backward(&s.model, &b, total, Keep::Acts, None, &mut g_acc).unwrap();
    }
    assert!(
        (ce_big - ce_acc).abs() <= 1e-5 * ce_big,
        "{ce_big} vs {ce_acc}"
    );
    assert_eq!(g_big.len(), g_acc.len());
    // atol 1e-6 of the largest entry is a few f32 ulps of it: the two runs' GEMMs sum their
    // tokens in different blockings, and entries far below the largest carry that noise.
    for (id, g) in &g_big {
        assert_close("accumulated grad", &g_acc[id], g, 1e-5, 1e-6);
    }

    // End to end through the recipe: the same two AdamW steps either way.
    let base = ["train.max_steps=2", "train.max_grad_norm=0"];
    let accum = adapter_after(
        "llama_gqa",
        &[
            base[0],
            base[1],
            "train.micro_batch=2",
            "train.grad_accum=2",
        ],
    );
    let big = adapter_after(
        "llama_gqa",
        &[
            base[0],
            base[1],
            "train.micro_batch=4",
            "train.grad_accum=1",
        ],
    );
    let ones = adapter_after(
        "llama_gqa",
        &[
            base[0],
            base[1],
            "train.micro_batch=1",
            "train.grad_accum=4",
        ],
    );
    assert_eq!(accum.len(), big.len());
    for (k, t) in &big {
        assert_close(&format!("2x2 vs 4x1 {k}"), &accum[k], t, 1e-4, 1e-6);
        assert_close(&format!("1x4 vs 4x1 {k}"), &ones[k], t, 1e-4, 1e-6);
    }
}

/// Every gradient in `got` is `want`'s, to the bit.
fn assert_same_grads(what: &str, got: &Grads, want: &Grads) {
    assert_eq!(got.len(), want.len(), "{what}: gradient count");
    for (id, w) in want {
        assert_eq!(host_f32(&got[id]), host_f32(w), "{what}: a gradient");
    }
}

fn grads_of(
    s: &Session,
    batch: &Batch,
    keep: Keep,
    dropout: Option<(u64, [u64; 2])>,
) -> (f64, Grads) {
    let mut g = Grads::new();
    let ce = driver::forward_backward(&s.model, batch, 10.0, keep, dropout, &mut g).unwrap();
    (ce, g)
}

/// Whatever forward keeps (everything, the residuals parked off the device, or the layer
/// inputs alone), backward gives the same gradients: with the residual h recomputed by
/// o_proj's GEMM or brought back, to the bit.
#[test]
fn activation_checkpointing_gives_identical_gradients_even_with_dropout() {
    let (_t, s) = session("llama_gqa", &["lora.dropout=0.3"]);
    assert_eq!(
        s.run.spec.dropout, 0.3,
        "the recipe's dropout applies to an init adapter"
    );
    let batch = s.batch(&[vec![0], vec![1]]);
    let key = Some((7, [3, 1]));
    let (ce_a, a) = grads_of(&s, &batch, Keep::Acts, key);
    let (ce_b, b) = grads_of(&s, &batch, Keep::Input, key);
    let (ce_o, o) = grads_of(&s, &batch, Keep::Offload, key);
    let (ce_p, p) = grads_of(&s, &batch, Keep::InputParked, key);
    assert_eq!(ce_a, ce_b);
    assert_eq!(ce_a, ce_o);
    assert_eq!(ce_b, ce_p);
    assert_same_grads("the residuals parked", &o, &a);
    assert_same_grads("the checkpointed inputs parked", &p, &b);
    let (_, c) = grads_of(&s, &batch, Keep::Acts, Some((7, [4, 1])));
    let mut differs = false;
    for (id, ga) in &a {
        assert_close("checkpointed grad", &b[id], ga, 1e-6, 1e-7);
        let d = max_abs_diff(ga, &c[id]);
        differs |= d > 1e-6;
    }
    assert!(differs, "another dropout key must give other gradients");
}

#[test]
fn packed_loss_and_gradients_equal_unpacked() {
    let (_t, s) = session("mistral_head_dim", &[]);
    let ex: Vec<ExampleRef> = (2..6)
        .map(|i| s.d.data().unwrap().examples.get(i))
        .collect();
    let unpacked = Batch::from_rows(
        &[vec![ex[0]], vec![ex[1]], vec![ex[2]], vec![ex[3]]],
        0,
        false,
    );
    let packed = Batch::from_rows(&[vec![ex[0], ex[1]], vec![ex[2], ex[3]]], 0, true);
    assert_eq!(unpacked.n_targets(), packed.n_targets());
    let (ce_u, gu) = grads_of(&s, &unpacked, Keep::Acts, None);
    let (ce_p, gp) = grads_of(&s, &packed, Keep::Acts, None);
    assert!(
        (ce_u - ce_p).abs() <= 1e-5 * ce_u.abs(),
        "packed {ce_p} vs unpacked {ce_u}"
    );
    for (id, g) in &gu {
        assert_close("packed grad", &gp[id], g, 1e-5, 1e-6);
    }
    // Without the block-diagonal mask the packed loss would differ.
    let leaky = Batch {
        segments: None,
        ..packed.clone()
    };
    let (ce_l, _) = grads_of(&s, &leaky, Keep::Acts, None);
    assert!(
        (ce_u - ce_l).abs() > 1e-4 * ce_u.abs(),
        "cross-example attention must change the loss"
    );
}

#[test]
fn init_adapter_round_trips_through_our_writer() {
    // Save the PEFT init adapter with our writer, read it back as init_adapter: same numbers.
    let (tmp, s) = session("qwen2_bias", &[]);
    let dir = tmp.path().join("copy");
    lora_train::export::save_adapter(&dir, &s.model, &s.run.spec, "base", None).unwrap();
    let ours = load_st(&dir.join("adapter_model.safetensors"));
    let theirs = load_st(&golden_dir("qwen2_bias").join("init_adapter/adapter_model.safetensors"));
    assert_eq!(ours.len(), theirs.len());
    for (k, t) in &theirs {
        assert_close(k, &ours[k], t, 0.0, 0.0);
    }
    let info = lora_train::export::read_adapter_config(&dir).unwrap();
    assert_eq!(info.spec, s.run.spec);
}

#[test]
fn eval_loss_is_the_mean_token_ce_of_a_plain_forward_packed_or_not() {
    let (_t, s) = session("llama_gqa", &["data.eval_fraction=0.5", "lora.dropout=0.2"]);
    let ev = s.d.eval.as_ref().unwrap();
    assert_eq!(ev.examples.len() + s.d.data().unwrap().examples.len(), 8);
    let (loss, n) = s.eval_loss().unwrap().unwrap();
    // Independently: the whole model's logits, log-softmax in f64, every example alone.
    let (mut sum, mut count) = (0.0, 0);
    for e in &ev.examples {
        let b = Batch::from_rows(&[vec![e]], 0, false);
        let logits: Vec<Vec<f32>> = driver::logits(&s.model, &b)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec2()
            .unwrap();
        for &(i, t) in &b.targets {
            let row = &logits[i];
            let max = row.iter().fold(f64::MIN, |m, &x| m.max(x as f64));
            let lse = max
                + row
                    .iter()
                    .map(|&x| (x as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            sum += lse - row[t as usize] as f64;
            count += 1;
        }
    }
    assert_eq!(n, count);
    assert!(
        (loss - sum / count as f64).abs() <= 1e-5 * loss,
        "{loss} vs {}",
        sum / count as f64
    );
    // The eval forward equals the training forward's loss (which, without dropout keys, has
    // none), and packing the eval set does not change it.
    let rows: Vec<Vec<ExampleRef>> = ev.examples.iter().map(|e| vec![e]).collect();
    let b = Batch::from_rows(&rows, 0, false);
    let ce = lora_train::train::eval::ce_sum(&s.model, &b).unwrap();
    let (ce_train, _) = grads_of(&s, &b, Keep::Acts, None);
    assert!((ce - ce_train).abs() <= 1e-6 * ce, "{ce} vs {ce_train}");
    let (_t, p) = session(
        "llama_gqa",
        &[
            "data.eval_fraction=0.5",
            "data.pack=true",
            "train.micro_batch=1",
        ],
    );
    let (packed, n_packed) = p.eval_loss().unwrap().unwrap();
    assert_eq!(n_packed, n);
    assert!((packed - loss).abs() <= 1e-5 * loss, "{packed} vs {loss}");
}

#[test]
fn gradients_and_optimiser_state_hold_no_graph() {
    // candle returns gradients with the graph that computed them attached; kept as they are,
    // they hold a step's activations alive (and AdamW's running sums chain them step after
    // step: a leak that grew by gigabytes per step on a 7B model).
    let (_t, s) = session("llama_gqa", &["lora.dropout=0.1"]);
    let batch = s.batch(&[vec![0], vec![1]]);
    let params: Vec<_> = s
        .model
        .adapters()
        .flat_map(|(_, l)| [l.a.clone(), l.b.clone()])
        .collect();
    let mut opt = lora_train::train::optim::AdamW::new(params, [0.9, 0.99], 1e-8, 0.1).unwrap();
    for keep in [Keep::Acts, Keep::Input] {
        let mut g = Grads::new();
        driver::forward_backward(&s.model, &batch, 10.0, keep, Some((1, [0, 0])), &mut g).unwrap();
        assert!(!g.is_empty());
        for t in g.values() {
            assert!(
                !t.track_op(),
                "a gradient still carries its graph ({keep:?})"
            );
        }
        opt.step(&g, 1e-3, 1.0).unwrap();
        let (m, v) = opt.state().unwrap();
        for t in m.iter().chain(&v) {
            assert!(!t.track_op(), "optimiser state carries a graph");
        }
    }
}

#[test]
fn the_head_in_chunks_gives_the_same_loss_and_gradients() {
    let (_t, s) = session("llama_gqa", &[]);
    let batch = s.batch(&[vec![0], vec![1], vec![2]]);
    let run = |chunk: Option<usize>| {
        let mut g = Grads::new();
        let ce = driver::forward_backward_dev(
            &s.model,
            &driver::Par::single(),
            &batch,
            10.0,
            Keep::Acts,
            None,
            &mut g,
            &lora_train::train::objective::Sft { head_chunk: chunk },
            &mut |_| Ok(()),
        )
        .unwrap()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap() as f64;
        (ce, g)
    };
    let (ce_one, g_one) = run(None);
    assert!(batch.n_targets() > 7, "several chunks of 3 below");
    let (ce_chunked, g_chunked) = run(Some(3));
    assert!(
        (ce_one - ce_chunked).abs() <= 1e-6 * ce_one,
        "{ce_one} vs {ce_chunked}"
    );
    for (id, g) in &g_one {
        assert_close("head in chunks", &g_chunked[id], g, 1e-5, 1e-6);
    }
}

/// The training layer on the tensor-core attention (bf16 on CUDA, head dim 64, GQA, packed
/// segments) against autograd through `Layer::forward`, whose attention is the blockwise path:
/// output, dL/dx and every adapter gradient, at a bf16 tolerance. The golden fixtures have head
/// dim 16, which the kernels do not take, so this is the kernels' end-to-end check in a layer:
/// v and dO read in place from token-major rows, dv written back as rows.
/// On the GPU the residuals go out to pinned host memory on a stream of their own and come
/// back a layer ahead: the gradients and loss are those of recomputing them, to the bit, on a
/// first micro-batch and on later ones that reuse the host buffers (a longer one grows them).
/// So with the first layer's gate and up parked instead (`Keep::ParkMlp`, one or two pairs in
/// flight) while the second recomputes its MLP half.
#[cfg(feature = "cuda")]
#[test]
fn offloaded_activations_give_the_kept_gradients_on_the_gpu() {
    let (_t, s) = session(
        "llama_gqa",
        &["model.device=cuda", "model.dtype=bf16", "lora.dropout=0.1"],
    );
    assert!(s.model.device.is_cuda());
    let short = s.batch(&[vec![0], vec![1]]);
    let long = s.batch(&[vec![2], vec![3], vec![4]]);
    for (k, batch) in [&short, &short, &long, &short].into_iter().enumerate() {
        let key = Some((3, [k as u64, 0]));
        let (ce_a, a) = grads_of(&s, batch, Keep::Acts, key);
        let parked = [1, 2].map(|pending| Keep::ParkMlp { tail: 1, pending });
        for keep in [Keep::Offload].into_iter().chain(parked) {
            let (ce_o, o) = grads_of(&s, batch, keep, key);
            assert_eq!(ce_a, ce_o, "micro-batch {k}, {keep:?}: loss");
            assert_same_grads(&format!("micro-batch {k}, {keep:?}"), &o, &a);
        }
    }
}

/// A two-layer model of the tiny shape with 64-wide heads (the flash kernels take it) on GPU 0,
/// bf16, rank-8 adapters on every linear with random B's (PEFT's zero B would leave every
/// adapter gradient but dB trivial).
#[cfg(feature = "cuda")]
fn gpu_layer_model() -> lora_train::model::decoder::Model {
    use candle_core::{DType, Device};
    let dev = Device::new_cuda(0).unwrap();
    let mut cfg = lora_train::model::shapes::shape("tiny").unwrap(); // hidden 256, mlp 688
    (
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
    ) = (2, 4, 2, 64);
    cfg.vocab_size = 512;
    let kernels =
        lora_train::ops::Kernels::resolve(&dev, DType::BF16, cfg.head_dim, false).unwrap();
    assert!(kernels.attention.tensor_cores());
    // Unfolded: the tests that fold it (`Model::fold`) turn `kernels.fold` back on first.
    let kernels = lora_train::ops::Kernels {
        fold: false,
        ..kernels
    };
    let spec = all_linear_r8();
    let m = random_model(cfg, DType::BF16, &dev, &spec, 7, &kernels, &mut |_| Ok(())).unwrap();
    randomize_b(&m, 0.05);
    m
}

/// Every adapter's B drawn afresh from N(0, std²).
#[cfg(feature = "cuda")]
fn randomize_b(m: &lora_train::model::decoder::Model, std: f32) {
    for (_, lora) in m.adapters() {
        let b = Tensor::randn(0f32, std, lora.b.shape(), lora.b.device()).unwrap();
        lora.b.set(&b).unwrap();
    }
}

/// A batch for `gpu_layer_model`'s layers: ctx of 2 rows × 150 tokens in three packed
/// segments each, x [2, 150, 256] bf16 and dL/dy g of its shape (f32).
#[cfg(feature = "cuda")]
fn gpu_layer_batch(
    m: &lora_train::model::decoder::Model,
) -> (lora_train::model::decoder::Ctx, Tensor, Tensor) {
    use candle_core::DType;
    let dev = &m.device;
    let (b, t, c) = (2, 150, 256);
    let positions: Vec<u32> = (0..b).flat_map(|_| 0..t as u32).collect();
    let segments: Vec<u32> = (0..b * t).map(|i| ((i % t) / 70) as u32).collect();
    let ctx = m.ctx(&positions, b, t, Some(segments), None).unwrap();
    let x = Tensor::randn(0f32, 1.0, (b, t, c), dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let g = Tensor::randn(0f32, 1.0, (b, t, c), dev).unwrap();
    (ctx, x, g)
}

#[cfg(feature = "cuda")]
#[test]
fn flash_layer_backward_matches_autograd_on_the_gpu() {
    let m = gpu_layer_model();
    let (ctx, x, g) = gpu_layer_batch(&m);
    let layer = &m.layers[1];
    let (xv, y_ref, gs) = autograd_reference(layer, &x, &g, &ctx);
    let (y, acts) = layer.forward_train(&x, &ctx, true).unwrap();
    assert_close("flash layer y", &y, &y_ref, 2e-2, 1e-2);
    let ours = layer.backward(acts.unwrap(), &g, &ctx).unwrap();
    assert_eq!(ours.1.len(), 14, "all seven linears are adapted");
    check_layer_grads(
        "flash layer",
        layer,
        &ours,
        &gs,
        xv.as_tensor(),
        (3e-2, 2e-2),
    );
}

/// The adapters' forward folded into the base GEMMs (ops::fold): q, k, v, gate, up and down
/// run folded, and the layer's output, activations' use (its backward) and gradients match
/// the same layer unfolded (the two GEMMs, W read through the pad's row stride) and autograd;
/// after the B's change (an optimiser step), a new batch's pads carry the new B's.
#[cfg(feature = "cuda")]
#[test]
fn folded_layer_matches_the_unfolded_and_autograd_on_the_gpu() {
    use lora_train::model::Linear;
    let mut m = gpu_layer_model();
    let (c, i, kv) = (256, 688, 128);
    m.kernels.fold = true;
    let bytes = m.fold().unwrap();
    // Rows rounded up to 64: q, k, v 256 + 24 → 320 and gate, up 256 + 16 → 320 (64 pad
    // columns); down 688 + 8 → 704 (16). Two layers, bf16; q [256], k and v [128] (GQA).
    let pads = [64, 64, 16];
    assert_eq!(bytes, 2 * 2 * ((c + 2 * kv) * 64 + 2 * i * 64 + c * 16));
    for round in 0..2 {
        if round == 1 {
            randomize_b(&m, 0.1); // as after an optimiser step
        }
        let (ctx, x, g) = gpu_layer_batch(&m);
        assert!(ctx.folded, "round {round}: the pads were not written");
        let layer = &m.layers[1];
        let groups: [&[&Linear]; 3] = [
            &[&layer.attn_in[0], &layer.attn_in[1], &layer.attn_in[2]],
            &[&layer.mlp_in[0], &layer.mlp_in[1]],
            &[layer.down.as_ref().unwrap()],
        ];
        for (lins, p) in groups.into_iter().zip(pads) {
            assert_eq!(Linear::fold_width(lins, &ctx), Some(p), "{}", lins[0].name);
        }
        assert_eq!(Linear::fold_width(&[&layer.o], &ctx), None);
        folded_matches_unfolded(&format!("round {round}"), &m, &ctx, &x, &g);
    }
}

/// Layer 1 of `m` run folded (`ctx`, pads written) and unfolded (the same batch with
/// `folded` off, where nothing folds): output, dL/dx and every adapter gradient agree, and
/// match autograd. Returns the number of adapter gradients (A and B of each adapter).
#[cfg(feature = "cuda")]
fn folded_matches_unfolded(
    tag: &str,
    m: &lora_train::model::decoder::Model,
    ctx: &lora_train::model::decoder::Ctx,
    x: &Tensor,
    g: &Tensor,
) -> usize {
    use lora_train::model::Linear;
    let layer = &m.layers[1];
    let mut plain = m.ctx(&[0; 300], 2, 150, None, None).unwrap();
    (plain.cos, plain.sin, plain.mask) = (ctx.cos.clone(), ctx.sin.clone(), ctx.mask.clone());
    plain.folded = false;
    let attn: Vec<&Linear> = layer.attn_in.iter().collect();
    assert_eq!(Linear::fold_width(&attn, &plain), None, "{tag}: unfolded");

    let (y, acts) = layer.forward_train(x, ctx, true).unwrap();
    let (y_plain, acts_plain) = layer.forward_train(x, &plain, true).unwrap();
    // One rounding of base + adapter against two: within a bf16 step of the output.
    assert_close(&format!("{tag}: y folded"), &y, &y_plain, 1e-2, 1e-2);
    let (xv, y_ref, gs) = autograd_reference(layer, x, g, ctx);
    assert_close(&format!("{tag}: y vs autograd"), &y, &y_ref, 2e-2, 1e-2);
    let ours = layer.backward(acts.unwrap(), g, ctx).unwrap();
    let theirs = layer.backward(acts_plain.unwrap(), g, &plain).unwrap();
    assert_close(&format!("{tag}: dx folded"), &ours.0, &theirs.0, 2e-2, 1e-2);
    for ((ia, ga), (ib, gb)) in ours.1.iter().zip(&theirs.1) {
        assert_eq!(ia, ib);
        assert_eq!(ga.dims(), gb.dims());
        assert_close(&format!("{tag}: adapter grad folded"), ga, gb, 3e-2, 2e-2);
    }
    check_layer_grads(tag, layer, &ours, &gs, xv.as_tensor(), (3e-2, 2e-2));
    ours.1.len()
}

/// Phi-3's fused projections folded: qkv_proj's and gate_up_proj's outputs come out in parts
/// (q, k, v and gate, up, each its own GEMM over a row block of W*: `fwd_folded_parts`), and
/// the layer's output, dL/dx and gradients (the parts' dB joined) match the same layer
/// unfolded (one GEMM, its output cut) and autograd. GQA, so the parts' widths differ.
#[cfg(feature = "cuda")]
#[test]
fn folded_fused_layer_makes_its_parts_and_matches_the_unfolded_on_the_gpu() {
    folded_family_layer_matches_the_unfolded("phi3-mini", (1, 1));
}

/// Gemma 2's layer folded: down_proj folds after GeGLU (its input made by geglu_pad, its
/// backward with GeGLU's in one kernel), beside the soft-cap, the window and the four norms;
/// output, dL/dx and gradients match the unfolded layer and autograd.
#[cfg(feature = "cuda")]
#[test]
fn folded_geglu_layer_matches_the_unfolded_on_the_gpu() {
    folded_family_layer_matches_the_unfolded("gemma2-9b", (3, 2));
}

/// `bench::shape(name)` cut to two small layers (GQA, head dim 64), built unfolded and then
/// folded: every group folds (`inputs`: the attention's and the MLP's input linears), and
/// the folded layer's output, dL/dx and gradients match the unfolded one's and autograd.
#[cfg(feature = "cuda")]
fn folded_family_layer_matches_the_unfolded(name: &str, inputs: (usize, usize)) {
    use candle_core::{DType, Device};
    use lora_train::model::Linear;
    let dev = Device::new_cuda(0).unwrap();
    let mut cfg = lora_train::model::shapes::shape(name).unwrap();
    (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) = (2, 256, 688);
    (
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.vocab_size,
    ) = (4, 2, 64, 512);
    let kernels = lora_train::ops::Kernels::resolve(&dev, DType::BF16, 64, false).unwrap();
    // Built unfolded, folded below (as `gpu_layer_model`'s tests do).
    let kernels = lora_train::ops::Kernels {
        fold: false,
        ..kernels
    };
    let spec = lora_train::lora::LoraSpec {
        targets: cfg.linears().iter().map(|s| s.to_string()).collect(),
        ..all_linear_r8()
    };
    let mut m = random_model(cfg, DType::BF16, &dev, &spec, 7, &kernels, &mut |_| Ok(())).unwrap();
    randomize_b(&m, 0.05);
    m.kernels.fold = true;
    assert!(m.fold().unwrap() > 0);
    let (ctx, x, g) = gpu_layer_batch(&m);
    assert!(ctx.folded);
    let layer = &m.layers[1];
    assert_eq!((layer.attn_in.len(), layer.mlp_in.len()), inputs, "{name}");
    let attn: Vec<&Linear> = layer.attn_in.iter().collect();
    let mlp: Vec<&Linear> = layer.mlp_in.iter().collect();
    let down = [layer.down.as_ref().unwrap()];
    for lins in [&attn[..], &mlp[..], &down[..]] {
        let tag = format!("{name} {}", lins[0].name);
        assert!(Linear::fold_width(lins, &ctx).is_some(), "{tag}");
    }
    let grads = folded_matches_unfolded(name, &m, &ctx, &x, &g);
    assert_eq!(
        grads,
        2 * layer.linears().len(),
        "{name}: A and B of each linear"
    );
}

/// Every adapter of `m` at dropout rate `p` (as the recipe's lora.dropout sets it).
#[cfg(feature = "cuda")]
fn with_dropout(m: &mut lora_train::model::decoder::Model, p: f32) {
    for l in &mut m.layers {
        let lins = l
            .attn_in
            .iter_mut()
            .chain([&mut l.o])
            .chain(l.mlp_in.iter_mut())
            .chain(l.down.as_mut());
        for lin in lins {
            if let Some(lora) = lin.lora.as_mut() {
                lora.dropout = p;
            }
        }
    }
}

/// Dropout keeps the fold (ops::fold_drop): with every adapter at p = 0.1, q, k, v, gate, up
/// and down still run folded, each mask drawn inside the kernels, and the layer's output,
/// dL/dx and gradients match the same layer unfolded with each mask applied as a masked copy
/// (`dropout_fused` off: the CPU's masks, bit for bit) and autograd; another step's masks give
/// other gradients.
#[cfg(feature = "cuda")]
#[test]
fn folded_layer_with_dropout_matches_the_unfolded_on_the_gpu() {
    use lora_train::model::Linear;
    let mut m = gpu_layer_model();
    m.kernels.fold = true;
    assert!(m.fold().unwrap() > 0);
    with_dropout(&mut m, 0.1);
    let key = Some((7, [3, 1]));
    let (mut ctx, x, g) = gpu_layer_batch(&m);
    ctx.dropout = key;
    assert!(ctx.folded && ctx.kernels.dropout_fused);
    let layer = &m.layers[1];
    let groups: [&[&Linear]; 3] = [
        &[&layer.attn_in[0], &layer.attn_in[1], &layer.attn_in[2]],
        &[&layer.mlp_in[0], &layer.mlp_in[1]],
        &[layer.down.as_ref().unwrap()],
    ];
    for lins in groups {
        assert!(lins[0].dropout(&ctx).is_some(), "{}", lins[0].name);
        assert!(
            Linear::fold_width(lins, &ctx).is_some(),
            "{}: unfolded",
            lins[0].name
        );
    }
    let mut plain = m.ctx(&[0; 300], 2, 150, None, key).unwrap();
    (plain.cos, plain.sin, plain.mask) = (ctx.cos.clone(), ctx.sin.clone(), ctx.mask.clone());
    plain.folded = false;
    plain.kernels.dropout_fused = false;

    let (y, acts) = layer.forward_train(&x, &ctx, true).unwrap();
    let (y_plain, acts_plain) = layer.forward_train(&x, &plain, true).unwrap();
    assert_close("dropout: y folded", &y, &y_plain, 1e-2, 1e-2);
    let (xv, y_ref, gs) = autograd_reference(layer, &x, &g, &ctx);
    assert_close("dropout: y vs autograd", &y, &y_ref, 2e-2, 1e-2);
    let ours = layer.backward(acts.unwrap(), &g, &ctx).unwrap();
    let theirs = layer.backward(acts_plain.unwrap(), &g, &plain).unwrap();
    assert_close("dropout: dx folded", &ours.0, &theirs.0, 2e-2, 1e-2);
    for ((ia, ga), (ib, gb)) in ours.1.iter().zip(&theirs.1) {
        assert_eq!(ia, ib);
        assert_close("dropout: adapter grad folded", ga, gb, 3e-2, 2e-2);
    }
    check_layer_grads("dropout", layer, &ours, &gs, xv.as_tensor(), (3e-2, 2e-2));
    // The masks are live: the next step's differ, and so do the gradients.
    let mut next = m.ctx(&[0; 300], 2, 150, None, Some((7, [4, 1]))).unwrap();
    (next.cos, next.sin, next.mask) = (ctx.cos.clone(), ctx.sin.clone(), ctx.mask.clone());
    let (_, acts_next) = layer.forward_train(&x, &next, true).unwrap();
    let other = layer.backward(acts_next.unwrap(), &g, &next).unwrap();
    let moved = ours
        .1
        .iter()
        .zip(&other.1)
        .map(|((_, a), (_, b))| {
            max_abs_diff(a, b) / host_f32(a).iter().fold(0f32, |m, v| m.max(v.abs()))
        })
        .fold(0f32, f32::max);
    assert!(
        moved > 0.05,
        "another step's masks moved the gradients by {moved} only"
    );
}

/// Rank `0` of `1` for `Flat::take` alone: its collectives are never called.
#[cfg(feature = "cuda")]
struct Cut(usize, usize);

#[cfg(feature = "cuda")]
impl lora_train::train::Comm for Cut {
    fn rank(&self) -> usize {
        self.0
    }
    fn world(&self) -> usize {
        self.1
    }
    fn all_reduce_sum(&self, _: &Tensor) -> candle_core::Result<Tensor> {
        candle_core::bail!("Cut has no collectives")
    }
    fn all_gather(&self, _: &Tensor) -> candle_core::Result<Tensor> {
        candle_core::bail!("Cut has no collectives")
    }
    fn broadcast(&self, _: &Tensor, _: usize) -> candle_core::Result<Tensor> {
        candle_core::bail!("Cut has no collectives")
    }
    fn barrier(&self) -> candle_core::Result<()> {
        candle_core::bail!("Cut has no collectives")
    }
}

/// FSDP over a folded model (ops::fold): each rank shards the padded weights and writes its
/// rows' B's into its own shards (`Shards::write_pads`). For 1, 2 and 3 ranks (cuts inside
/// rows and inside B's columns) the shards side by side are the unsharded model's padded
/// weights with this batch's B's, bit for bit; and a gathered layer runs folded, with the
/// unsharded layer's output (bit for bit) and gradients.
#[cfg(feature = "cuda")]
#[test]
fn fsdp_shards_carry_the_folded_b_columns_on_the_gpu() {
    use candle_core::DType;
    use lora_train::model::{Linear, Model};
    use lora_train::train::flat::Flat;
    use lora_train::train::shards::Shards;
    let reference = gpu_layer_model();
    let (cfg, dev) = (reference.cfg.clone(), reference.device.clone());
    let spec = all_linear_r8();
    // gpu_layer_model's weights (same seed), folded as they load; its random B's.
    let build = |comm: Option<&Cut>| {
        let mut groups = Vec::new();
        let kernels = lora_train::ops::Kernels {
            fold: true,
            ..reference.kernels
        };
        let m = random_model(
            cfg.clone(),
            DType::BF16,
            &dev,
            &spec,
            7,
            &kernels,
            &mut |t| {
                if let Some(c) = comm {
                    groups.push(Flat::take(t.tensors(), c)?);
                }
                Ok(())
            },
        )
        .unwrap();
        for ((_, a), (_, b)) in m.adapters().zip(reference.adapters()) {
            a.b.set(b.b.as_tensor()).unwrap();
        }
        let shards =
            comm.map(|c| Shards::from_groups(groups, m.layers.len(), &m.kernels, c).unwrap());
        (m, shards)
    };
    let (full, _) = build(None);
    let (ctx, x, g) = gpu_layer_batch(&full);
    assert!(ctx.folded);
    // Each layer's frozen tensors flattened in Flat's order, B columns written.
    let flat = |m: &Model, l: usize| {
        let parts: Vec<Tensor> = m.layers[l]
            .clone()
            .frozen_mut()
            .into_iter()
            .map(|t| t.flatten_all().unwrap())
            .collect();
        Tensor::cat(&parts, 0)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    };
    assert!(
        full.layers[1].attn_in[0].pad.is_some()
            && full.layers[1].down.as_ref().unwrap().pad.is_some()
    );
    let want: Vec<Tensor> = (0..2).map(|l| flat(&full, l)).collect();
    for world in [1, 2, 3] {
        let ranks: Vec<(Model, Shards)> = (0..world)
            .map(|r| {
                let (m, s) = build(Some(&Cut(r, world)));
                let s = s.unwrap();
                assert!(
                    s.write_pads(&m).unwrap(),
                    "rank {r} of {world}: no pads written"
                );
                (m, s)
            })
            .collect();
        for (l, want) in want.iter().enumerate() {
            let shards: Vec<Tensor> = ranks
                .iter()
                .map(|(_, s)| s.layers[l].shards().next().unwrap().clone())
                .collect();
            let got = Tensor::cat(&shards, 0)
                .unwrap()
                .narrow(0, 0, want.dim(0).unwrap())
                .unwrap();
            let diff = max_abs_diff(&got.to_dtype(DType::F32).unwrap(), want);
            assert_eq!(diff, 0.0, "world {world}, layer {l}: the shards differ");
        }
    }
    // World 1: the gathered layer runs folded, as the unsharded one.
    let (one, shards) = build(Some(&Cut(0, 1)));
    let shards = shards.unwrap();
    let mut ctx1 = one.ctx(&[0; 300], 2, 150, None, None).unwrap();
    (ctx1.cos, ctx1.sin, ctx1.mask) = (ctx.cos.clone(), ctx.sin.clone(), ctx.mask.clone());
    assert!(!ctx1.folded, "the skeleton holds no pads of its own");
    ctx1.folded = shards.write_pads(&one).unwrap();
    let layer = shards
        .layer(&one, 1, &lora_train::train::Solo, false)
        .unwrap();
    let want_layer = &full.layers[1];
    assert_eq!(
        Linear::fold_width(
            &[&layer.attn_in[0], &layer.attn_in[1], &layer.attn_in[2]],
            &ctx1
        ),
        Some(64)
    );
    assert_eq!(
        Linear::fold_width(&[layer.down.as_ref().unwrap()], &ctx1),
        Some(16)
    );
    let (y, acts) = layer.forward_train(&x, &ctx1, true).unwrap();
    let (y_want, acts_want) = want_layer.forward_train(&x, &ctx, true).unwrap();
    let f32_of = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    assert_eq!(
        max_abs_diff(&f32_of(&y), &f32_of(&y_want)),
        0.0,
        "gathered layer's output"
    );
    let ours = layer.backward(acts.unwrap(), &g, &ctx1).unwrap();
    let theirs = want_layer.backward(acts_want.unwrap(), &g, &ctx).unwrap();
    // The flash kernels' dQ sums land in any order: the gradients agree to that noise.
    assert_close("gathered layer dx", &ours.0, &theirs.0, 1e-2, 1e-3);
    for ((_, ga), (_, gb)) in ours.1.iter().zip(&theirs.1) {
        assert_close("gathered layer adapter grad", ga, gb, 1e-2, 1e-3);
    }
}

/// One decoder layer of the Llama-2-7B shape on GPU 0 in bf16, rank-16 adapters (α 32) on
/// every linear, folded (ops::fold): the bench's shapes, so its tuned GEMMs.
#[cfg(feature = "cuda")]
fn folded_7b_layer() -> lora_train::model::decoder::Model {
    use candle_core::{DType, Device};
    use lora_train::lora::LoraSpec;
    use lora_train::model::ALL_LINEAR;
    let dev = Device::new_cuda(0).unwrap();
    let mut cfg = lora_train::model::shapes::shape("llama2-7b").unwrap();
    (cfg.num_layers, cfg.vocab_size) = (1, 512);
    let spec = LoraSpec {
        rank: 16,
        alpha: 32.0,
        dropout: 0.0,
        rslora: false,
        dora: false,
        targets: ALL_LINEAR.iter().map(|s| s.to_string()).collect(),
    };
    let kernels =
        lora_train::ops::Kernels::resolve(&dev, DType::BF16, cfg.head_dim, false).unwrap();
    let unfolded = lora_train::ops::Kernels {
        fold: false,
        ..kernels
    };
    let mut m = random_model(cfg, DType::BF16, &dev, &spec, 7, &unfolded, &mut |_| Ok(())).unwrap();
    m.kernels.fold = true;
    assert!(m.fold().unwrap() > 0);
    m
}

/// The fold at the 7B layer shape (the bench's: rank 16, micro-batch 2 × 2048, the tuned
/// GEMMs), with B = 0 as at the first step and with small B's: the folded layer's output,
/// dL/dx and every adapter gradient match the unfolded layer's.
#[cfg(feature = "cuda")]
#[test]
fn folded_7b_layer_matches_the_unfolded_on_the_gpu() {
    use candle_core::DType;
    let m = folded_7b_layer();
    let dev = m.device.clone();
    let (b, t, c) = (2, 2048, 4096);
    let positions: Vec<u32> = (0..b).flat_map(|_| 0..t as u32).collect();
    for (round, std) in [0.0f32, 1e-3].into_iter().enumerate() {
        if std > 0.0 {
            randomize_b(&m, std);
        }
        let ctx = m.ctx(&positions, b, t, None, None).unwrap();
        assert!(ctx.folded);
        let mut plain = m.ctx(&positions, b, t, None, None).unwrap();
        plain.folded = false;
        let x = Tensor::randn(0f32, 1.0, (b, t, c), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let g = Tensor::randn(0f32, 1e-3, (b, t, c), &dev).unwrap();
        let layer = &m.layers[0];
        let tag = format!("round {round} (B ~ {std})");
        let (y, acts) = layer.forward_train(&x, &ctx, true).unwrap();
        let (y_plain, acts_plain) = layer.forward_train(&x, &plain, true).unwrap();
        // max |ours − theirs| / max |theirs|, printed for every tensor, then bounded
        let rel = |a: &Tensor, b: &Tensor| {
            let (a, b) = (host_f32(a), host_f32(b));
            let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = a
                .iter()
                .zip(&b)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            err / scale.max(f32::MIN_POSITIVE)
        };
        let mut worst = vec![("y".to_string(), rel(&y, &y_plain))];
        let ours = layer.backward(acts.unwrap(), &g, &ctx).unwrap();
        let theirs = layer.backward(acts_plain.unwrap(), &g, &plain).unwrap();
        worst.push(("dx".into(), rel(&ours.0, &theirs.0)));
        for (lin, k) in layer.linears().iter().zip(0..) {
            for (w, j) in [("A", 0), ("B", 1)] {
                let ((ia, ga), (ib, gb)) = (&ours.1[2 * k + j], &theirs.1[2 * k + j]);
                assert_eq!(ia, ib);
                worst.push((format!("{} d{w}", lin.name), rel(ga, gb)));
            }
        }
        println!("{tag}: {worst:?}");
        for (what, e) in worst {
            assert!(
                e < 2e-2,
                "{tag}: {what} differs by {e} of its largest value"
            );
        }
    }
}

/// `folded_7b_layer_matches_the_unfolded_on_the_gpu` under dropout 0.05 (the bench's shapes
/// and kernels: rank 16, 4096 tokens): folded with the masks drawn in the kernels against
/// unfolded with masked copies, every tensor within 2% of its largest value.
#[cfg(feature = "cuda")]
#[test]
fn folded_7b_layer_with_dropout_matches_the_unfolded_on_the_gpu() {
    use candle_core::DType;
    let mut m = folded_7b_layer();
    with_dropout(&mut m, 0.05);
    randomize_b(&m, 1e-3);
    let dev = m.device.clone();
    let (b, t, c) = (2, 2048, 4096);
    let positions: Vec<u32> = (0..b).flat_map(|_| 0..t as u32).collect();
    let key = Some((1234, [17, 0]));
    let ctx = m.ctx(&positions, b, t, None, key).unwrap();
    assert!(ctx.folded);
    let mut plain = m.ctx(&positions, b, t, None, key).unwrap();
    plain.folded = false;
    plain.kernels.dropout_fused = false;
    let x = Tensor::randn(0f32, 1.0, (b, t, c), &dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let g = Tensor::randn(0f32, 1e-3, (b, t, c), &dev).unwrap();
    let layer = &m.layers[0];
    let rel = |a: &Tensor, b: &Tensor| {
        let (a, b) = (host_f32(a), host_f32(b));
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        err / scale.max(f32::MIN_POSITIVE)
    };
    let (y, acts) = layer.forward_train(&x, &ctx, true).unwrap();
    let (y_plain, acts_plain) = layer.forward_train(&x, &plain, true).unwrap();
    let mut worst = vec![("y".to_string(), rel(&y, &y_plain))];
    let ours = layer.backward(acts.unwrap(), &g, &ctx).unwrap();
    let theirs = layer.backward(acts_plain.unwrap(), &g, &plain).unwrap();
    worst.push(("dx".into(), rel(&ours.0, &theirs.0)));
    for (lin, k) in layer.linears().iter().zip(0..) {
        for (w, j) in [("A", 0), ("B", 1)] {
            let ((ia, ga), (ib, gb)) = (&ours.1[2 * k + j], &theirs.1[2 * k + j]);
            assert_eq!(ia, ib);
            worst.push((format!("{} d{w}", lin.name), rel(ga, gb)));
        }
    }
    println!("dropout 0.05 at 7B: {worst:?}");
    for (what, e) in worst {
        assert!(e < 2e-2, "{what} differs by {e} of its largest value");
    }
}

/// q, k, v, gate, up and down of a 7B-shaped layer (rank 16, 4096 tokens) against the same
/// products in f32, y = x Wᵀ + (s · x Aᵀ) Bᵀ from the bf16 operands: folded, each output is
/// within half a bf16 step of it (one rounding), where the unfolded GEMMs may be a whole step
/// off (the base's rounding, then the sum's: what an adapter term under half a step lost).
/// The input kernels' padded rows (RMSNorm, the residual add's, SwiGLU) carry the unpadded
/// kernels' values.
#[cfg(feature = "cuda")]
#[test]
fn folded_linears_round_once_at_7b_on_the_gpu() {
    use candle_core::DType;
    use lora_train::model::Linear;
    use lora_train::ops;
    let m = folded_7b_layer();
    let dev = m.device.clone();
    randomize_b(&m, 1e-2);
    let ctx = m.ctx(&[0; 4096], 2, 2048, None, None).unwrap();
    let l = &m.layers[0];
    let eps = 1e-6;
    let bf = |t: Tensor| t.to_dtype(DType::BF16).unwrap();
    let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let max = |t: &Tensor| {
        t.abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    let randn = |cols: usize| bf(Tensor::randn(0f32, 1.0, (4096, cols), &dev).unwrap());
    let (x, ao, gate, up) = (randn(4096), randn(4096), randn(11008), randn(11008));
    let qkv = [&l.attn_in[0], &l.attn_in[1], &l.attn_in[2]];
    let gu = [&l.mlp_in[0], &l.mlp_in[1]];
    let down = [l.down.as_ref().unwrap()];
    // Each group's input, padded and not.
    let pad = |lins: &[&Linear]| Linear::fold_width(lins, &ctx).unwrap();
    let inputs: [(&[&Linear], Tensor, Tensor); 3] = [
        (
            &qkv,
            ops::fold::rms_norm_pad(&x, &l.input_norm, eps, pad(&qkv))
                .unwrap()
                .unwrap(),
            ops::rms_norm(&x, &l.input_norm, eps).unwrap(),
        ),
        (
            &gu,
            ops::fold::add_rms_norm_pad(&x, &ao, &l.post_norm, eps, pad(&gu))
                .unwrap()
                .unwrap()
                .1,
            ops::add_rms_norm(&x, &ao, &l.post_norm, eps).unwrap().1,
        ),
        (
            &down,
            ops::fold::glu_pad(ops::glu::Act::Silu, &gate, &up, pad(&down))
                .unwrap()
                .unwrap(),
            ops::swiglu(&gate, &up).unwrap(),
        ),
    ];
    for (lins, xp, xin) in inputs {
        let in_f = xin.dim(1).unwrap();
        let same = (f32(&xp.narrow(1, 0, in_f).unwrap()) - f32(&xin)).unwrap();
        assert_eq!(max(&same), 0.0, "{}: the padded input", lins[0].name);
        let folded = Linear::fwd_folded(lins, &xp, &ctx).unwrap();
        let plain = Linear::fwd_shared(lins, &xin, &ctx).unwrap();
        for ((lin, (yf, xf)), (yp, xpl)) in lins.iter().zip(&folded).zip(&plain) {
            let (xf, xpl) = (xf.as_ref().unwrap(), xpl.as_ref().unwrap());
            assert_eq!(
                max(&(f32(xf) - f32(xpl)).unwrap()),
                0.0,
                "{}: xas",
                lin.name
            );
            let b = f32(&bf(lin.lora.as_ref().unwrap().b.as_tensor().clone()));
            let lora = f32(&xpl.contiguous().unwrap())
                .matmul(&b.t().unwrap())
                .unwrap();
            let base = f32(&xin).matmul(&f32(&lin.w).t().unwrap()).unwrap();
            let want = (base + &lora).unwrap();
            // half a bf16 step at the largest |y|: 2^(⌊log2 max⌋ − 8)
            let half = 2f32.powi(max(&want).log2().floor() as i32 - 8);
            let ef = max(&(f32(yf) - &want).unwrap());
            let ep = max(&(f32(yp) - &want).unwrap());
            println!(
                "{}: |y| ≤ {}, |adapter| ≤ {}, off by {ef} folded, {ep} unfolded",
                lin.name,
                max(&want),
                max(&lora)
            );
            assert!(ef <= 1.01 * half, "{}: folded off by {ef}", lin.name);
            assert!(ep <= 2.02 * half, "{}: unfolded off by {ep}", lin.name);
        }
    }
}

/// The fused CUDA optimiser step (one kernel over every adapter, in place) against the
/// tensor-op step on the CPU, in lockstep from the same values: parameters and both moments
/// after each of three steps with weight decay, clipping and a parameter that misses its
/// gradient in one step; and the gradient norm of the fused sum of squares.
#[cfg(feature = "cuda")]
#[test]
fn fused_adamw_and_grad_norm_match_the_tensor_ops_on_the_gpu() {
    use candle_core::Device;
    use lora_train::train::optim::{grad_norm, AdamW};
    let gpu = Device::new_cuda(0).unwrap();
    let shapes: [&[usize]; 4] = [&[16, 96], &[96, 16], &[5], &[3, 7]];
    let make = |dev: &Device| -> Vec<Var> {
        shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let n: usize = s.iter().product();
                let v: Vec<f32> = (0..n)
                    .map(|k| ((i * 31 + k * 7) % 13) as f32 / 5.0 - 1.0)
                    .collect();
                Var::from_tensor(&Tensor::from_vec(v, *s, dev).unwrap()).unwrap()
            })
            .collect()
    };
    let (pc, pg) = (make(&Device::Cpu), make(&gpu));
    let mut oc = AdamW::new(pc.clone(), [0.9, 0.99], 1e-8, 0.1).unwrap();
    let mut og = AdamW::new(pg.clone(), [0.9, 0.99], 1e-8, 0.1).unwrap();
    let flat = |ts: &[Tensor]| -> Vec<f32> {
        ts.iter()
            .flat_map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .collect()
    };
    for step in 0..3 {
        let (mut gc, mut gg) = (Grads::new(), Grads::new());
        for (i, (c, g)) in pc.iter().zip(&pg).enumerate() {
            if step == 1 && i == 2 {
                continue;
            }
            let grad =
                ((c.as_tensor().sin().unwrap() * (0.3 + i as f64)).unwrap() + step as f64).unwrap();
            gg.insert(g.id(), grad.to_device(&gpu).unwrap());
            gc.insert(c.id(), grad);
        }
        // max_norm 2: the gradients' norm is above it, so every step clips.
        let (cc, cg) = (
            grad_norm(&gc, &pc, 2.0).unwrap(),
            grad_norm(&gg, &pg, 2.0).unwrap(),
        );
        assert!(cc.coef < 1.0, "the test means to clip: norm {}", cc.norm);
        assert!(
            (cg.norm - cc.norm).abs() <= 1e-6 * cc.norm,
            "step {step}: norm {} on the GPU vs {} on the CPU",
            cg.norm,
            cc.norm
        );
        // One coefficient for both: the sums of squares add in different orders.
        oc.step(&gc, 1e-2, cc.coef).unwrap();
        og.step(&gg, 1e-2, cc.coef).unwrap();
        assert!(og.last_step_fused(), "the GPU step ran as tensor ops");
        assert!(!oc.last_step_fused());
        let tensors = |ps: &[Var]| ps.iter().map(|p| p.as_tensor().clone()).collect::<Vec<_>>();
        let (sc, sg) = (oc.state().unwrap(), og.state().unwrap());
        for (what, a, b) in [
            ("parameters", flat(&tensors(&pc)), flat(&tensors(&pg))),
            ("m", flat(&sc.0), flat(&sg.0)),
            ("v", flat(&sc.1), flat(&sg.1)),
        ] {
            let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
            let worst = a
                .iter()
                .zip(&b)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                worst <= 1e-6 * scale,
                "step {step}: {what} differ by up to {worst} (of {scale})"
            );
        }
    }
}

/// Over more tokens than `mlp_chunk`, the MLP's backward runs chunk by chunk on every path
/// (model/layer_mlp.rs): a checkpointed layer recomputes each chunk's MLP just before that
/// chunk's backward, a layer that kept its activations reads the chunk's rows of them. So
/// the chunked recompute, with its inputs parked in host memory or not, gives the gradients
/// of the kept-activations path bit for bit: at some 200 to 260 tokens, 12 to 16 chunks of
/// 16 (the recipe asks for multiples of 64), the last one longer or shorter than the rest
/// (`row_chunks`). Against one sum over all the tokens (no chunks) the loss is the same to the bit
/// and the gradients up to the order of the adapters' sums. Gemma's output norms, Phi-3's
/// fused gate_up and Qwen2's biases go through it too. With dropout on the MLP's adapters the
/// MLP runs whole.
#[test]
fn a_chunked_mlp_gives_the_unchunked_loss_and_gradients() {
    for case in [
        "llama_gqa",
        "gemma2_softcap",
        "phi3_fused_longrope",
        "qwen2_bias",
    ] {
        let (_t, mut s) = session(case, &[]);
        let all: Vec<ExampleRef> = s.d.data().unwrap().examples.iter().collect();
        let batch = Batch::from_rows(&[all.clone(), all.clone(), all], 0, true);
        let (m, n) = (batch.b * batch.t, 16);
        assert!(m > 10 * n, "{case}: {m} tokens span many chunks");
        s.model.mlp_chunk = Some(n);
        let (ce, want) = grads_of(&s, &batch, Keep::Acts, None);
        for keep in [Keep::Input, Keep::InputParked, Keep::Offload] {
            let (ce_c, got) = grads_of(&s, &batch, keep, None);
            assert_eq!(ce_c, ce, "{case}: the loss with {keep:?}");
            assert_same_grads(&format!("{case}: chunks of {n}, {keep:?}"), &got, &want);
        }
        s.model.mlp_chunk = None;
        for keep in [Keep::Acts, Keep::Input] {
            let (ce_w, whole) = grads_of(&s, &batch, keep, None);
            assert_eq!(ce_w, ce, "{case}: the loss unchunked, {keep:?}");
            assert_eq!(whole.len(), want.len(), "{case}: gradient count");
            let mut differs = false;
            for (id, w) in &want {
                assert_close(
                    &format!("{case}: unchunked grad"),
                    &whole[id],
                    w,
                    1e-5,
                    1e-6,
                );
                differs |= host_f32(&whole[id]) != host_f32(w);
            }
            assert!(differs, "{case}: one sum over all tokens is another order");
        }
    }
    let (_t, mut s) = session("llama_gqa", &["lora.dropout=0.3"]);
    let batch = s.batch(&[vec![0], vec![1]]);
    let key = Some((7, [3, 1]));
    s.model.mlp_chunk = None;
    let (ce, want) = grads_of(&s, &batch, Keep::Input, key);
    s.model.mlp_chunk = Some(16);
    let (ce_c, got) = grads_of(&s, &batch, Keep::Input, key);
    assert_eq!(ce_c, ce);
    assert_same_grads("dropout: the MLP runs whole", &got, &want);
}

/// `train.activation_checkpointing = "mlp"` (`Keep::Attention`): forward keeps the attention
/// half's activations and the residual h, backward recomputes the MLP half from h. The loss and
/// every gradient are those of the kept activations to the bit: whole and in chunks, with
/// dropout on the MLP's adapters, through Gemma's output norms, Phi-3's fused gate_up, Qwen2's
/// biases, QK-norm and a MoE layer. So are they with gate and up parked in the first layer and
/// the MLP recomputed in the second (`Keep::ParkMlp`; a MoE layer and a chunked MLP park
/// nothing). A layer keeps the bytes the memory plan counts.
#[test]
fn recomputing_the_mlp_half_gives_the_kept_gradients() {
    for case in [
        "llama_gqa",
        "gemma2_softcap",
        "phi3_fused_longrope",
        "qwen2_bias",
        "qwen3_qk_norm",
        "qwen3_moe",
    ] {
        let (_t, mut s) = session(case, &[]);
        let all: Vec<ExampleRef> = s.d.data().unwrap().examples.iter().collect();
        let batch = Batch::from_rows(&[all.clone(), all.clone(), all], 0, true);
        for chunk in [None, Some(16)] {
            s.model.mlp_chunk = chunk;
            let (ce, want) = grads_of(&s, &batch, Keep::Acts, None);
            let (ce_m, got) = grads_of(&s, &batch, Keep::Attention, None);
            assert_eq!(ce_m, ce, "{case}: the loss, MLP chunk {chunk:?}");
            assert_same_grads(&format!("{case}: MLP chunk {chunk:?}"), &got, &want);
            let (ce_p, parked) = grads_of(&s, &batch, PARK_FIRST, None);
            assert_eq!(ce_p, ce, "{case}: the loss, parked, MLP chunk {chunk:?}");
            assert_same_grads(&format!("{case}: parked, chunk {chunk:?}"), &parked, &want);
        }
        let m = &s.model;
        let ctx = m
            .ctx(&batch.positions, batch.b, batch.t, None, None)
            .unwrap();
        let ids = Tensor::from_slice(&batch.ids, (batch.b, batch.t), &m.device).unwrap();
        let x = m.embed(&ids).unwrap();
        let layer = &m.layers[0];
        let kept = |r| {
            layer
                .forward_retain(&x, &ctx, r)
                .unwrap()
                .1
                .unwrap()
                .bytes() as u64
        };
        let per_token =
            kept_attention_per_token_layer(&m.cfg, 4, s.run.spec.rank, &s.run.spec.targets);
        let tokens = (batch.b * batch.t) as u64;
        assert_eq!(
            kept(Retain::Attention),
            per_token * tokens,
            "{case}: the plan's bytes"
        );
        let full = kept_per_token_layer(&m.cfg, 4, s.run.spec.rank, &s.run.spec.targets);
        match m.cfg.arch.moe {
            Some(_) => assert_eq!(per_token, full, "{case}: a MoE layer keeps h already"),
            None => assert!(per_token < full, "{case}: {per_token} B a token of {full}"),
        }
    }
    let (_t, s) = session("llama_gqa", &["lora.dropout=0.3"]);
    let batch = s.batch(&[vec![0], vec![1]]);
    let key = Some((7, [3, 1]));
    let (ce, want) = grads_of(&s, &batch, Keep::Acts, key);
    let (ce_m, got) = grads_of(&s, &batch, Keep::Attention, key);
    assert_eq!(ce_m, ce);
    assert_same_grads("dropout: the MLP recomputed with its masks", &got, &want);
    let (ce_p, parked) = grads_of(&s, &batch, PARK_FIRST, key);
    assert_eq!(ce_p, ce);
    assert_same_grads("dropout: gate and up parked", &parked, &want);
}

/// `Keep::ParkMlp` on a two-layer model: the first layer parks its gate and up, the second
/// recomputes its MLP half.
const PARK_FIRST: Keep = Keep::ParkMlp {
    tail: 1,
    pending: 1,
};
