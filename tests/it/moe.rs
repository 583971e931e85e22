//! The MoE family (Qwen3-MoE) beyond its goldens (tests/it/golden.rs): checkpointing and
//! parking change memory, not numbers; the activations a layer keeps are what the memory plan
//! counts; a 4.x checkpoint with its experts one by one reads as the fused one; what we save
//! is PEFT's target_parameters adapter; `bench` adapts the experts and counts the routed ones.

use crate::common::*;
use candle_core::Tensor;
use lora_train::memory::plan::{kept_per_token_layer, lora_params};
use lora_train::model::Keep;
use lora_train::train::driver;
use lora_train::train::optim::Grads;

use crate::common::golden_session as session;

/// Rows 0, 2 and 4 (of unequal lengths: padding) through every way the driver keeps
/// activations (with the residuals parked, a MoE layer keeps its own on the device): the loss
/// and every gradient (experts' and router aux's included) agree.
#[test]
fn checkpointed_and_parked_moe_layers_give_the_kept_gradients() {
    for (case, sets) in [
        ("qwen3_moe", vec![]),
        ("qwen3_moe_aux", vec!["train.router_aux_loss_coef=0.05"]),
    ] {
        let (_t, s) = session(case, &sets);
        let batch = s.batch(&[vec![0], vec![2], vec![4]]);
        assert!(
            batch.real.iter().any(|r| !r),
            "{case}: the batch must be padded"
        );
        let run = |keep| {
            let mut g = Grads::new();
            let ce = driver::forward_backward(&s.model, &batch, 10.0, keep, None, &mut g).unwrap();
            (ce, g)
        };
        let (ce, want) = run(Keep::Acts);
        for keep in [Keep::Input, Keep::InputParked, Keep::Offload] {
            let (ce_k, got) = run(keep);
            assert!(
                (ce_k - ce).abs() <= 1e-6 * ce.abs(),
                "{case}: {ce_k} vs {ce}"
            );
            assert_eq!(got.len(), want.len(), "{case}: gradient count");
            for (id, w) in &want {
                assert_close(&format!("{case}: grad"), &got[id], w, 1e-5, 1e-6);
            }
        }
    }
}

/// A step's gradients record no graph: a product of an adapter's `Var` records its inputs,
/// so each gradient would hold its layer's activations (a MoE layer's routed rows and their
/// gradients, 0.9 GiB a layer at qwen3-30b-a3b) alive until the optimiser step. The
/// hand-written passes take detached adapters (the experts' and, off CUDA bf16, every
/// linear's; DoRA's weight norm), checkpointed or not, dense, DoRA or MoE.
#[test]
fn a_step_s_gradients_hold_no_graph() {
    for case in ["qwen3_moe", "llama_gqa", "dora_llama_gqa"] {
        let (_t, s) = session(case, &[]);
        let batch = s.batch(&[vec![0], vec![2]]);
        for keep in [Keep::Input, Keep::Acts] {
            let mut g = Grads::new();
            driver::forward_backward(&s.model, &batch, 10.0, keep, None, &mut g).unwrap();
            assert!(!g.is_empty(), "{case}: no gradients");
            let tracked = g.values().filter(|t| t.track_op()).count();
            assert_eq!(tracked, 0, "{case} {keep:?}: gradients with a graph");
        }
    }
}

/// The reference forward (autograd through `Layer::forward`, the experts' grouped products
/// on candle's path because their inputs record the graph) against the hand-written MoE
/// layer: the output, dL/dx, and every adapter's gradients, the attention's and the
/// experts'.
#[test]
fn hand_written_moe_layer_backward_equals_autograd() {
    let (_t, s) = session("qwen3_moe", &[]);
    let m = &s.model;
    let batch = s.batch(&[vec![0], vec![2]]);
    let ctx = m
        .ctx(&batch.positions, batch.b, batch.t, None, None)
        .unwrap();
    let ids = Tensor::from_slice(&batch.ids, (batch.b, batch.t), &m.device).unwrap();
    // the second layer, so that its input is not an embedding
    let x = m.layers[0]
        .forward(&m.embed(&ids).unwrap(), &ctx)
        .unwrap()
        .detach();
    let layer = &m.layers[1];
    let g = Tensor::randn(0f32, 1.0, x.shape(), &m.device).unwrap();
    let (xv, y_ref, gs) = crate::invariants::autograd_reference(layer, &x, &g, &ctx);
    let (y, acts) = layer.forward_train(&x, &ctx, true).unwrap();
    assert_close("moe y", &y, &y_ref, 1e-5, 1e-6);
    let (dx, grads) = layer.backward(acts.unwrap(), &g, &ctx).unwrap();
    assert_close("moe dx", &dx, gs.get(xv.as_tensor()).unwrap(), 1e-5, 1e-6);
    let adapters = layer.adapters();
    assert!(
        adapters.iter().any(|(name, _)| name.contains("experts")),
        "the experts must carry adapters"
    );
    assert_eq!(grads.len(), 2 * adapters.len(), "one dA and one dB each");
    for (name, lora) in adapters {
        for (w, var) in [("A", &lora.a), ("B", &lora.b)] {
            let ours = &grads.iter().find(|(id, _)| *id == var.id()).unwrap().1;
            let want = gs.get(var.as_tensor()).unwrap();
            assert_close(&format!("moe {name} d{w}"), ours, want, 1e-5, 1e-6);
        }
    }
}

/// A MoE layer keeps x, q, k, v, attention output, lse, its residual h and the attention
/// adapters' states (no expert activation): `kept_per_token_layer`'s bytes exactly; the
/// plan's adapter parameters are the model's, experts' included.
#[test]
fn a_moe_layer_keeps_what_the_plan_counts() {
    let (_t, s) = session("qwen3_moe", &[]);
    let batch = s.batch(&[vec![0], vec![1]]);
    let m = &s.model;
    let ctx = m
        .ctx(&batch.positions, batch.b, batch.t, None, None)
        .unwrap();
    let ids = Tensor::from_slice(&batch.ids, (batch.b, batch.t), &m.device).unwrap();
    let x = m.embed(&ids).unwrap();
    let (_, acts) = m.layers[0].forward_train(&x, &ctx, true).unwrap();
    let rank = s.run.spec.rank;
    let per_token = kept_per_token_layer(&m.cfg, 4, rank, &s.run.spec.targets);
    assert_eq!(
        acts.unwrap().bytes() as u64,
        per_token * (batch.b * batch.t) as u64
    );
    let params: usize = m
        .adapters()
        .flat_map(|(_, l)| l.vars())
        .map(|v| v.elem_count())
        .sum();
    let planned = lora_params(&m.cfg, rank, &s.run.spec.targets);
    assert_eq!(params as u64, planned);
}

/// The fixture's checkpoint rewritten as 4.x checkpoints on the Hub store experts
/// (`mlp.experts.{e}.{gate,up,down}_proj.weight`) gives the fused checkpoint's logits.
#[test]
fn per_expert_checkpoint_reads_as_the_fused_one() {
    let src = golden_dir("qwen3_moe").join("model");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let mut out: Vec<(String, Tensor)> = Vec::new();
    for (name, t) in load_st(&src.join("model.safetensors")) {
        if let Some(p) = name.strip_suffix(".experts.gate_up_proj") {
            let i = t.dim(1).unwrap() / 2;
            for e in 0..t.dim(0).unwrap() {
                let w = t.get(e).unwrap();
                for (k, part) in [("gate_proj", 0), ("up_proj", i)] {
                    let key = format!("{p}.experts.{e}.{k}.weight");
                    out.push((key, w.narrow(0, part, i).unwrap().contiguous().unwrap()));
                }
            }
        } else if let Some(p) = name.strip_suffix(".experts.down_proj") {
            for e in 0..t.dim(0).unwrap() {
                out.push((
                    format!("{p}.experts.{e}.down_proj.weight"),
                    t.get(e).unwrap(),
                ));
            }
        } else {
            out.push((name, t));
        }
    }
    let map: std::collections::HashMap<String, Tensor> = out.into_iter().collect();
    candle_core::safetensors::save(&map, dir.join("model.safetensors")).unwrap();

    let path = format!("model.path={}", dir.display());
    let (_t, s) = session("qwen3_moe", &[path.as_str()]);
    let batch = s.batch(&[vec![0], vec![1]]);
    let logits = driver::logits(&s.model, &batch).unwrap();
    let want = load_st(&golden_dir("qwen3_moe").join("golden.safetensors"));
    assert_close("per-expert logits", &logits, &want["logits"], 1e-4, 1e-6);
}

/// What training saves is PEFT's adapter for the experts: target_parameters beside
/// target_modules, the expert adapters keyed mlp.experts (down) and
/// mlp.experts.base_layer (gate_up, the inner of PEFT's two wrappers), in PEFT's shapes.
#[test]
fn saved_adapter_names_the_experts_as_peft() {
    let (t, s) = session("qwen3_moe", &["train.max_steps=1"]);
    let out = t.path().join("out");
    s.train(&out).unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(
        cfg["target_modules"],
        serde_json::json!(["q_proj", "k_proj", "v_proj", "o_proj"])
    );
    assert_eq!(
        cfg["target_parameters"],
        serde_json::json!(["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    );
    let saved = load_st(&out.join("adapter_model.safetensors"));
    let init = load_st(
        &golden_dir("qwen3_moe")
            .join("init_adapter")
            .join("adapter_model.safetensors"),
    );
    assert_eq!(saved.len(), init.len());
    for (k, v) in &init {
        assert_eq!(saved[k].dims(), v.dims(), "{k}");
    }
    let k = "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight";
    assert_eq!(saved[k].dims(), &[8 * 4, 32]); // A [E·r, C] of gate_up_proj
}

/// `bench --model` on the MoE fixture (C 32, 2 layers, 8 experts of width 24, top 2, r 4):
/// `--targets all` adapts the attention and both expert parameters, and the FLOP counts take
/// the 2 experts a token is routed to, not all 8; the routing's reads are counted a step.
#[test]
fn bench_of_a_moe_checkpoint_adapts_the_experts_and_counts_the_routed_ones() {
    let bench = |targets: &str| -> serde_json::Value {
        let o = assert_cmd::Command::cargo_bin("lora-train")
            .unwrap()
            .arg("bench")
            .arg("--model")
            .arg(golden_dir("qwen3_moe").join("model"))
            .args(["--device", "cpu", "--seq", "32", "--micro-batch", "2"])
            .args(["--steps", "2", "--warmup", "1", "--rank", "4"])
            .args(["--targets", targets])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let all = bench("all");
    // per layer: attention 4 · (64 + 2 · 48 + 64) = 896, experts 8 · 4 · ((32 + 48) + (24 + 32))
    assert_eq!(all["trainable_params"], 2 * (896 + 8 * 4 * (80 + 56)));
    // per layer: attention 3072, 2 experts' gate_up and down 2 · 3 · 24 · 32, the router 8 · 32;
    // the head 128 · 32
    assert_eq!(
        all["base_linear_params"],
        2 * (3072 + 2 * 3 * 24 * 32 + 8 * 32) + 128 * 32
    );
    // the adapters' 6 FLOPs a weight a token multiplies: 2 experts' of each parameter
    let adapter = 2 * (896 + 2 * 4 * (80 + 56));
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap();
    let extra = f(&all, "work_flops_per_token") - f(&all, "flops_per_token");
    assert_eq!(extra, 6.0 * adapter as f64);
    let losses = all["losses"].as_array().unwrap();
    assert!(
        losses.iter().all(|l| l.as_f64().unwrap().is_finite()),
        "{all}"
    );
    // the routing is read once a layer, in its forward (2 layers): the backward takes the
    // forward's grouping (model/router.rs `RouteStore`) and reads nothing
    assert_eq!(f(&all, "route_reads"), 2.0, "{all}");
    // its waits are a part of the step's time
    let wait = f(&all, "route_wait_s");
    assert!((0.0..=f(&all, "step_s")).contains(&wait), "{all}");
    let attn = bench("attn");
    assert_eq!(attn["trainable_params"], 2 * 896);
}
