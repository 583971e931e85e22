//! `lora-train bench`: training-step throughput and peak memory on random weights of a named
//! shape, measured like ../shared/bench/peft_baseline.py (same shapes, same FLOP count, same
//! JSON fields) so the two can run in one device call and be compared as ratios.

use crate::data::Batch;
use crate::lora::{LoraSpec, ALL_LINEAR};
use crate::memory::{self, GIB};
use crate::model::{Family, Model, ModelConfig, RopeScaling};
use crate::train::{driver, optim};
use anyhow::{bail, Result};
use candle_core::{DType, Device};
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct BenchArgs {
    pub shape: String,
    pub seq: usize,
    pub micro_batch: usize,
    pub rank: usize,
    pub alpha: Option<f64>,
    pub targets: String,
    pub ckpt: bool,
    pub steps: usize,
    pub warmup: usize,
    pub device: Device,
    pub peak_tflops: f64,
    /// Behave as a card of this many bytes (a ballast outside the pool; CUDA only).
    pub max_memory: Option<u64>,
}

/// (hidden, intermediate, layers, heads, kv heads, vocab, rope theta), as peft_baseline.py.
pub fn shape(name: &str) -> Result<ModelConfig> {
    let (h, i, l, nh, kv, v, theta) = match name {
        "tiny" => (256, 688, 4, 8, 8, 32000, 10000.0),
        "llama2-7b" => (4096, 11008, 32, 32, 32, 32000, 10000.0),
        "llama2-13b" => (5120, 13824, 40, 40, 40, 32000, 10000.0),
        "llama3-8b" => (4096, 14336, 32, 32, 8, 128256, 500000.0),
        other => bail!("unknown shape `{other}`; known: tiny, llama2-7b, llama2-13b, llama3-8b"),
    };
    Ok(ModelConfig {
        family: Family::Llama,
        hidden_size: h,
        intermediate_size: i,
        num_layers: l,
        num_heads: nh,
        num_kv_heads: kv,
        head_dim: h / nh,
        vocab_size: v,
        rms_norm_eps: 1e-6,
        rope_theta: theta,
        rope_scaling: RopeScaling::None,
        max_position_embeddings: 4096,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        tie_word_embeddings: Some(false),
        sliding_window: None,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        pad_token_id: None,
        stored_dtype: None,
    })
}

pub fn targets(name: &str) -> Result<Vec<String>> {
    let t: &[&str] = match name {
        "qv" => &["q_proj", "v_proj"],
        "attn" => &["q_proj", "k_proj", "v_proj", "o_proj"],
        "all" => &ALL_LINEAR,
        other => bail!("unknown targets `{other}`; known: qv, attn, all"),
    };
    Ok(t.iter().map(|s| s.to_string()).collect())
}

/// peft_baseline.py's model FLOPs per trained token: frozen base, so backward computes
/// activation gradients (2N) but no weight gradients; attention counted in full.
pub fn flops_per_token(
    n_linear: usize,
    layers: usize,
    hidden: usize,
    seq: usize,
    ckpt: bool,
) -> f64 {
    let fwd = 2.0 * n_linear as f64 + 4.0 * (layers * seq * hidden) as f64;
    let bwd = 2.0 * n_linear as f64 + 8.0 * (layers * seq * hidden) as f64;
    fwd + bwd + if ckpt { fwd } else { 0.0 }
}

/// Random token ids (labels = ids shifted), like the baseline: [b, t], every position but
/// each row's last counted.
pub fn random_batch(b: usize, t: usize, vocab: usize, seed: u64) -> Batch {
    let mut rng = crate::rng::Rng::new(seed);
    let ids: Vec<u32> = (0..b * t).map(|_| rng.below(vocab) as u32).collect();
    let targets: Vec<(usize, u32)> = (0..b)
        .flat_map(|r| (0..t.saturating_sub(1)).map(move |i| r * t + i))
        .map(|k| (k, ids[k + 1]))
        .collect();
    Batch {
        b,
        t,
        positions: (0..b).flat_map(|_| 0..t as u32).collect(),
        segments: None,
        targets,
        tokens: b * t,
        ids,
    }
}

/// `run`, with an allocation failure turned into the diagnosis (`stop::OutOfMemory`: phase,
/// peak vs capacity, the memory plan's forecast and remedies).
pub fn run(a: &BenchArgs) -> Result<serde_json::Value> {
    use crate::memory::plan;
    let cfg = shape(&a.shape)?;
    let input = plan::PlanInput {
        tied: cfg.tie_word_embeddings.unwrap_or(false),
        cfg,
        dtype_bytes: if a.device.is_cpu() { 4 } else { 2 },
        micro_batch: a.micro_batch,
        seq_len: a.seq,
        rank: a.rank,
        targets: targets(&a.targets)?,
        gpus: 1,
        cuda: !a.device.is_cpu(),
    };
    let p = plan::plan(&input, 1, a.max_memory);
    let sel = (crate::recipe::Strategy::Single, a.ckpt);
    let ballast = match a.max_memory {
        Some(m) => memory::hold_ballast(&a.device, m)?,
        None => None,
    };
    let capacity = a.max_memory.or(ballast.as_ref().map(|b| b.total));
    let mut meter = memory::PhaseMeter::default();
    let res = measure(a, &mut meter);
    drop(ballast);
    match res {
        Err(e) if memory::is_oom(&e) => {
            let peak = memory::stats(&a.device)?.map(|s| s.used_high.max(meter.run_peak));
            Err(crate::train::stop::OutOfMemory {
                rank: 0,
                phase: meter.current(),
                step: None,
                total: 0,
                peak,
                capacity,
                forecast: plan::row(&p, sel.0, sel.1).map(|r| r.b.clone()),
                remedies: plan::remedies(&p, sel),
                last_checkpoint: None,
                cause: format!("{e:#}"),
            }
            .into())
        }
        other => other,
    }
}

fn measure(a: &BenchArgs, meter: &mut memory::PhaseMeter) -> Result<serde_json::Value> {
    let cfg = shape(&a.shape)?;
    let spec = LoraSpec {
        rank: a.rank,
        alpha: a.alpha.unwrap_or(2.0 * a.rank as f64),
        dropout: 0.0,
        rslora: false,
        targets: targets(&a.targets)?,
    };
    let dtype = if a.device.is_cpu() {
        DType::F32
    } else {
        DType::BF16
    };
    memory::keep_pool_memory(&a.device)?;
    let t0 = Instant::now();
    let model = Model::random(cfg.clone(), dtype, &a.device, &spec, 0)?;
    a.device.synchronize()?;
    let load_s = t0.elapsed().as_secs_f64();
    let after_load = memory::stats(&a.device)?.map(|s| s.used as f64 / GIB);
    let trainable: usize = model
        .adapters()
        .map(|(_, l)| l.a.elem_count() + l.b.elem_count())
        .sum();
    let n_linear: usize = model
        .layers
        .iter()
        .flat_map(|l| l.linears())
        .map(|l| l.w.elem_count())
        .sum::<usize>()
        + model.lm_head.elem_count();
    let params: Vec<_> = model
        .adapters()
        .flat_map(|(_, l)| [l.a.clone(), l.b.clone()])
        .collect();
    let mut opt = optim::AdamW::new(params, [0.9, 0.999], 1e-8, 0.0)?;

    let (b, t) = (a.micro_batch, a.seq);
    let batch = random_batch(b, t, cfg.vocab_size, 1234);
    let n = batch.n_targets() as f64;
    let mut loss = 0.0;
    // Only the phase is tracked here (no synchronisation): the timed steps stay untouched.
    let step = |opt: &mut optim::AdamW, meter: &mut memory::PhaseMeter| -> Result<f64> {
        let mut grads = optim::Grads::new();
        meter.done = None;
        let ce = driver::forward_backward_probed(
            &model,
            &batch,
            n,
            a.ckpt,
            None,
            &mut grads,
            None,
            &mut |phase| {
                meter.done = Some(phase);
                Ok(())
            },
        )?;
        optim::clip_grad_norm(&mut grads, 1.0)?;
        opt.step(&grads, 1e-4)?;
        Ok(ce / n)
    };
    for _ in 0..a.warmup {
        loss = step(&mut opt, meter)?;
    }
    a.device.synchronize()?;
    memory::reset_peak(&a.device)?;
    let t1 = Instant::now();
    for _ in 0..a.steps {
        loss = step(&mut opt, meter)?;
    }
    a.device.synchronize()?;
    let dt = t1.elapsed().as_secs_f64();
    let peak = memory::stats(&a.device)?;
    // One more step, instrumented: the device's peak within each phase and what stays
    // allocated at its end.
    let mut phases = serde_json::Map::new();
    let gib = |x: u64| (x as f64 / GIB * 100.0).round() / 100.0;
    memory::reset_peak(&a.device)?;
    let mut grads = optim::Grads::new();
    meter.done = None;
    driver::forward_backward_probed(
        &model,
        &batch,
        n,
        a.ckpt,
        None,
        &mut grads,
        None,
        &mut |phase| {
            meter.done = Some(phase);
            a.device.synchronize()?;
            if let Some(s) = memory::stats(&a.device)? {
                phases.insert(format!("{phase}_peak_gib"), gib(s.used_high).into());
                phases.insert(format!("{phase}_end_gib"), gib(s.used).into());
            }
            memory::reset_peak(&a.device)
        },
    )?;
    drop(grads);
    let tokens = (b * t * a.steps) as f64;
    let tps = tokens / dt;
    let fpt = flops_per_token(n_linear, cfg.num_layers, cfg.hidden_size, t, a.ckpt);
    let r2 = |x: f64| (x * 100.0).round() / 100.0;
    Ok(serde_json::json!({
        "system": "lora-train", "mode": "single", "world": 1,
        "device": format!("{:?}", a.device.location()),
        "shape": a.shape, "seq": t, "micro_batch": b, "lora_rank": a.rank,
        "targets": a.targets, "ckpt": a.ckpt, "attn": "blockwise-lse",
        "trainable_params": trainable, "base_linear_params": n_linear,
        "load_s": r2(load_s), "after_load_gib": after_load.map(r2),
        "peak_alloc_gib": peak.map(|p| r2(p.used_high as f64 / GIB)),
        "peak_reserved_gib": peak.map(|p| r2(p.reserved_high as f64 / GIB)),
        "step_s": (dt / a.steps as f64 * 1e4).round() / 1e4,
        "tokens_per_s": (tps * 10.0).round() / 10.0,
        "tokens_per_s_per_gpu": (tps * 10.0).round() / 10.0,
        "mfu": (tps * fpt / (a.peak_tflops * 1e12) * 1e4).round() / 1e4,
        "final_loss": (loss * 1e4).round() / 1e4,
        "phases": phases,
        "max_memory_gib": a.max_memory.map(|m| r2(m as f64 / GIB)),
    }))
}
