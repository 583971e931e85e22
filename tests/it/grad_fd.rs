//! The gradients that flow through attention, against a reference that shares no code with any
//! backward: central finite differences of the layer's forward. `invariants.rs` holds the
//! hand-written layer backward to autograd through `Layer::forward`, but that graph's attention
//! node is `ops::attention`, whose backward is the training's own `attention_bwd`; so there the
//! attention part checks itself. Here the loss L = Σ y ⊙ g is computed from `Layer::forward`
//! alone (summed in f64), and for random directions u the directional derivative
//! (L(θ + εu) − L(θ − εu)) / 2ε is held to ⟨∇L, u⟩ of the training backward: for dL/dx and for
//! the q, k and v adapters' A and B, whose gradients come only through attention's backward
//! (dQ, dK, dV), on GQA with packed segments, q/k/v biases, and an explicit head dim. (A dQ
//! scaled by 1.01 in `attention_bwd` fails here, and passes the autograd comparison.)

use crate::common::*;
use candle_core::{DType, Tensor, Var};
use lora_train::data::{Batch, ExampleRef};

/// Σ a ⊙ b over all entries, in f64.
fn dot(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (host_f32(a), host_f32(b));
    a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

/// Values in [-1, 1) of `shape` from a xorshift stream seeded with `seed`: the same directions
/// every run (candle's randn draws from an unseeded generator).
fn fixed_random(shape: &[usize], seed: u64, dev: &candle_core::Device) -> Tensor {
    let n: usize = shape.iter().product();
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let v: Vec<f32> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    Tensor::from_vec(v, shape, dev).unwrap()
}

/// ‖a‖₂ in f64.
fn norm(a: &Tensor) -> f64 {
    dot(a, a).sqrt()
}

#[test]
fn attention_gradients_equal_finite_differences_of_the_forward() {
    for case in ["llama_gqa", "qwen2_bias", "mistral_head_dim"] {
        let (_t, s) = golden_session(case, &[]);
        let ex: Vec<ExampleRef> = (0..4)
            .map(|i| s.d.data().unwrap().examples.get(i))
            .collect();
        let batch = Batch::from_rows(&[vec![ex[0], ex[1]], vec![ex[2], ex[3]]], 0, true);
        assert!(batch.segments.is_some(), "{case}: the rows must be packed");
        let m = &s.model;
        assert_eq!(m.dtype, DType::F32, "{case}");
        let ctx = m
            .ctx(
                &batch.positions,
                batch.b,
                batch.t,
                batch.segments.clone(),
                None,
            )
            .unwrap();
        let ids = Tensor::from_slice(&batch.ids, (batch.b, batch.t), &m.device).unwrap();
        let x = m.layers[0]
            .forward(&m.embed(&ids).unwrap(), &ctx)
            .unwrap()
            .detach();
        let layer = &m.layers[1];
        let g = fixed_random(x.dims(), 1, &m.device);
        let loss = |x: &Tensor| dot(&layer.forward(x, &ctx).unwrap(), &g);

        // The training backward.
        let (_, acts) = layer.forward_train(&x, &ctx, true).unwrap();
        let (dx, grads) = layer.backward(acts.unwrap(), &g, &ctx).unwrap();

        // Central differences of L at `p` (a parameter's current value) along the gradient's
        // own direction and two fixed random ones, each a step of 1% of ‖p‖ (smaller steps
        // drown in the f32 rounding of y, larger ones in the curvature; at 1% both stay near
        // 1e-4 of the derivative): each within 0.2% of the backward's ⟨∇L, u⟩, plus 5e-5 of
        // ‖∇L‖‖u‖ for directions nearly orthogonal to ∇L; the worst ratio to that bound is
        // printed (0.56 on these cases).
        let check = |what: &str, p: &Tensor, grad: &Tensor, set: &dyn Fn(&Tensor) -> f64| {
            let mut dirs = vec![(grad / norm(grad)).unwrap()];
            for seed in [2, 3] {
                dirs.push(fixed_random(p.dims(), seed, p.device()));
            }
            let mut worst = 0f64;
            for u in &dirs {
                let eps = 1e-2 * norm(p).max(1e-3) / norm(u);
                let step = (u * eps).unwrap();
                let plus = set(&(p + &step).unwrap());
                let minus = set(&(p - &step).unwrap());
                let fd = (plus - minus) / (2.0 * eps);
                let an = dot(grad, u);
                let bound = 2e-3 * an.abs() + 5e-5 * norm(grad) * norm(u);
                worst = worst.max((fd - an).abs() / bound);
                assert!(
                    (fd - an).abs() <= bound,
                    "{case} {what}: finite difference {fd:.6e}, backward {an:.6e}"
                );
            }
            set(p);
            eprintln!("{case} {what}: worst |fd - backward| / bound = {worst:.3}");
        };
        check("dL/dx", &x, &dx, &|v| loss(v));
        let mut seen = 0;
        for lin in layer.linears() {
            let attention_input = ["q_proj", "k_proj", "v_proj"]
                .iter()
                .any(|n| lin.name.ends_with(n));
            let (Some(lora), true) = (&lin.lora, attention_input) else {
                continue;
            };
            for (w, var) in [("A", &lora.a), ("B", &lora.b)] {
                let grad = &grads.iter().find(|(id, _)| *id == var.id()).unwrap().1;
                let p = var.as_tensor().copy().unwrap();
                let set = |v: &Tensor| {
                    set_var(var, v);
                    loss(&x)
                };
                check(&format!("{} d{w}", lin.name), &p, grad, &set);
                seen += 1;
            }
        }
        assert!(
            seen >= 4,
            "{case}: q and k at least are adapted ({seen} matrices)"
        );
    }
}

fn set_var(var: &Var, v: &Tensor) {
    var.set(v).unwrap();
}
