//! `lora-train bench`: training-step throughput and peak memory on random weights of a named
//! shape, measured like scripts/bench_peft.py (same shapes, same FLOP count, same JSON fields)
//! so the two can run in one device call and be compared as ratios. The steps are the
//! training loop's own (train::step's engine, launched by train::launch), on random weights
//! (train::session::sharded_model) and random token rows.
//!
//! With `--strategy ddp|fsdp --devices 0,1` one thread per GPU trains the same model (the
//! same seeded random weights on every rank) on a fixed set of world × micro_batch ×
//! grad_accum random rows, rank r taking rows r, r + world, ...: the per-step losses are then
//! comparable with a single-GPU run of the same global batch.

use crate::data::Batch;
use crate::lora::LoraSpec;
use crate::memory::{self, GIB};
use crate::model::{Model, ModelConfig};
use crate::parallel::fsdp::Shards;
use crate::parallel::Comm;
use crate::recipe::{Checkpointing, Strategy};
use crate::train::driver::Keep;
use crate::train::launch::{launch, Ranks};
use crate::train::optim::AdamW;
use crate::train::session::sharded_model;
use crate::train::step::{adapter_params, Engine};
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub mod workload;

#[derive(Debug, Clone)]
pub struct BenchArgs {
    pub shape: String,
    pub seq: usize,
    pub micro_batch: usize,
    pub rank: usize,
    pub alpha: Option<f64>,
    pub targets: String,
    /// train.activation_checkpointing.
    pub ckpt: Checkpointing,
    /// train.offload_activations (None: on; CUDA only).
    pub offload: Option<bool>,
    pub steps: usize,
    pub warmup: usize,
    pub device: Device,
    pub peak_tflops: f64,
    pub strategy: Strategy,
    /// CUDA ordinals, one rank each (CPU: virtual ranks); one entry for "single".
    pub devices: Vec<usize>,
    pub grad_accum: usize,
    /// Behave as a card of this many bytes (a ballast outside the pool; CUDA only).
    pub max_memory: Option<u64>,
    /// A checkpoint directory to time instead of random weights of `shape` (its config.json
    /// gives the shape): the weights `train` would load, on bench's random rows.
    pub model: Option<std::path::PathBuf>,
    /// train.deterministic: no kernel whose sums land in a varying order.
    pub deterministic: bool,
    /// lora.dropout (0: none).
    pub dropout: f32,
    /// lora.use_rslora: the adapters' scale α / √r.
    pub rslora: bool,
    /// Short examples packed into each row (block-diagonal attention: `workload::batch`); 1:
    /// one sequence a row.
    pub pack: usize,
    /// An eval forward over `eval_batches` micro-batches every this many steps (0: none), as
    /// train.eval_every.
    pub eval_every: usize,
    pub eval_batches: usize,
    /// A checkpoint (adapter and optimiser state) every this many steps (0: none), as
    /// output.save_every; rank 0 writes it.
    pub save_every: usize,
    /// A label for the JSON line (a sweep's row).
    pub tag: Option<String>,
    /// How the frozen base is stored (`--quantize nf4`: QLoRA, double quant).
    pub quant: crate::quant::Quant,
}

/// The shapes `bench` and `plan --shape` know, as scripts/bench_peft.py's SHAPES.
pub const SHAPES: [&str; 10] = [
    "tiny",
    "llama2-7b",
    "llama2-13b",
    "llama2-70b",
    "llama3-8b",
    "qwen3-8b",
    "gemma2-9b",
    "gemma3-12b",
    "phi3-mini",
    "qwen3-30b-a3b",
];

/// A named shape's config.json (the released model's, as scripts/bench_peft.py builds it),
/// read by the config layer every checkpoint goes through: the family's data comes with it.
pub fn shape(name: &str) -> Result<ModelConfig> {
    use serde_json::json;
    let llama = |h: usize, i: usize, l: usize, nh: usize, kv: usize, v: usize, theta: f64| {
        json!({"model_type": "llama", "hidden_size": h, "intermediate_size": i,
               "num_hidden_layers": l, "num_attention_heads": nh, "num_key_value_heads": kv,
               "vocab_size": v, "rope_theta": theta, "rms_norm_eps": 1e-6,
               "max_position_embeddings": 4096, "tie_word_embeddings": false,
               "bos_token_id": 1, "eos_token_id": 2})
    };
    let cfg = match name {
        "tiny" => llama(256, 688, 4, 8, 8, 32000, 1e4),
        "llama2-7b" => llama(4096, 11008, 32, 32, 32, 32000, 1e4),
        "llama2-13b" => llama(5120, 13824, 40, 40, 40, 32000, 1e4),
        "llama2-70b" => llama(8192, 28672, 80, 64, 8, 32000, 1e4),
        // meta-llama/Llama-3.1-8B: llama3 rope scaling to 131072 positions
        "llama3-8b" => {
            let mut c = llama(4096, 14336, 32, 32, 8, 128256, 5e5);
            c["max_position_embeddings"] = json!(131072);
            c["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192});
            c
        }
        // Qwen/Qwen3-8B
        "qwen3-8b" => json!({"model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "rope_theta": 1e6, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
            "tie_word_embeddings": false}),
        // google/gemma-2-9b
        "gemma2-9b" => json!({"model_type": "gemma2", "hidden_size": 3584,
            "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
            "query_pre_attn_scalar": 256, "sliding_window": 4096,
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
            "rope_theta": 1e4, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
            "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": true}),
        // google/gemma-3-12b's text model
        "gemma3-12b" => json!({"model_type": "gemma3_text", "hidden_size": 3840,
            "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 262208,
            "query_pre_attn_scalar": 256, "sliding_window": 1024, "sliding_window_pattern": 6,
            "rope_theta": 1e6, "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
            "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": true}),
        // microsoft/Phi-3.5-mini-instruct without its LongRoPE (which acts past 4096 tokens)
        "phi3-mini" => json!({"model_type": "phi3", "hidden_size": 3072,
            "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "vocab_size": 32064, "rope_theta": 1e4,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": false,
            "hidden_act": "silu"}),
        // Qwen/Qwen3-30B-A3B: 128 experts of width 768, 8 a token, in every layer
        "qwen3-30b-a3b" => json!({"model_type": "qwen3_moe", "hidden_size": 2048,
            "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": true,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
            "rope_theta": 1e6, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": false, "attention_bias": false}),
        other => bail!("unknown shape `{other}`; known: {}", SHAPES.join(", ")),
    };
    let path = std::path::PathBuf::from(format!("<bench shape {name}>"));
    Ok(ModelConfig::from_json(&cfg.to_string(), &path)?)
}

/// The shape a bench runs: `--model`'s config.json, else the named shape.
fn config_of(a: &BenchArgs) -> Result<ModelConfig> {
    match &a.model {
        Some(dir) => Ok(ModelConfig::from_file(&dir.join("config.json"))?),
        None => shape(&a.shape),
    }
}

/// `--targets` for a model: "all" its every linear and a MoE's fused experts (gate_up_proj
/// and down_proj, PEFT's `target_parameters`; the router not), "attn" its attention's, "qv" q
/// and v (Phi-3: its fused qkv_proj, as PEFT's default for it).
pub fn targets(name: &str, cfg: &ModelConfig) -> Result<Vec<String>> {
    let own = cfg.linears();
    let experts: &[&str] = match cfg.arch.moe {
        Some(_) => &crate::lora::EXPERT_PARAMS,
        None => &[],
    };
    let t: Vec<&str> = match name {
        "all" => own.iter().chain(experts).copied().collect(),
        "attn" => own
            .iter()
            .copied()
            .filter(|m| matches!(*m, "q_proj" | "k_proj" | "v_proj" | "qkv_proj" | "o_proj"))
            .collect(),
        "qv" if cfg.arch.fused => vec!["qkv_proj"],
        "qv" => vec!["q_proj", "v_proj"],
        other => bail!("unknown targets `{other}`; known: qv, attn, all"),
    };
    Ok(t.iter().map(|s| s.to_string()).collect())
}

/// Frozen linear weights a token multiplies (the head included), from its config: what the
/// FLOP count takes (scripts/bench_peft.py counts alike). A MoE layer counts its router and
/// the k experts a token is routed to, not all E.
pub fn base_linear_params(cfg: &ModelConfig) -> usize {
    let per_layer: usize = cfg
        .linears()
        .iter()
        .filter_map(|m| cfg.linear_shape(m))
        .map(|(i, o)| i * o)
        .sum();
    // a MoE token's: its k experts' gate_up and down, and the router
    let moe = cfg.arch.moe.map_or(0, |m| {
        let c = cfg.hidden_size;
        m.top_k * 3 * m.inter * c + m.experts * c
    });
    cfg.num_layers * (per_layer + moe) + cfg.vocab_size * cfg.hidden_size
}

/// Weights of a dense layer's MLP input projections (gate and up, or gate_up) over the layers
/// that recompute them under `activation_checkpointing = "mlp"`: what it multiplies once more
/// a token (a MoE's experts are recomputed in every setting). With gate and up parked
/// (`Keep::ParkMlp`, over `m` tokens a micro-batch that the MLP runs whole: none, or at most
/// `mlp_chunk`) only the top layers recompute.
pub fn mlp_in_weights(cfg: &ModelConfig, keep: Keep, m: usize, mlp_chunk: Option<usize>) -> usize {
    if cfg.arch.moe.is_some() {
        return 0;
    }
    let per_layer: usize = ["gate_proj", "up_proj", "gate_up_proj"]
        .iter()
        .filter_map(|m| cfg.linear_shape(m))
        .map(|(i, o)| i * o)
        .sum();
    let parked = match mlp_chunk.is_none_or(|k| m <= k) {
        true => keep.mlp_parked_layers(cfg.num_layers),
        false => 0,
    };
    per_layer * (cfg.num_layers - parked)
}

/// scripts/bench_peft.py's model FLOPs per trained token: frozen base, so backward computes
/// activation gradients (2N) but no weight gradients. Attention is counted causally: a token
/// attends to T/2 keys on average, so QKᵀ and PV cost 2·T·C a layer forward (4·T·C backward).
pub fn flops_per_token(
    n_linear: usize,
    layers: usize,
    hidden: usize,
    seq: usize,
    ckpt: bool,
) -> f64 {
    let attn = (layers * seq * hidden) as f64;
    let fwd = 2.0 * n_linear as f64 + 2.0 * attn;
    let bwd = 2.0 * n_linear as f64 + 4.0 * attn;
    fwd + bwd + if ckpt { fwd } else { 0.0 }
}

/// Random token ids (labels = ids shifted), like the baseline: [b, t], every position but
/// each row's last counted.
pub fn random_batch(b: usize, t: usize, vocab: usize, seed: u64) -> Batch {
    let mut rng = crate::rng::Rng::new(seed);
    let ids: Vec<u32> = (0..b * t).map(|_| rng.below(vocab) as u32).collect();
    workload::batch(&ids, b, t, 1)
}

/// The bench on `a.devices`: one rank for "single", one thread per rank for ddp / fsdp. An
/// allocation failure on any rank ends with that rank's diagnosis.
pub fn run(a: &BenchArgs) -> Result<serde_json::Value> {
    let world = a.devices.len().max(1);
    let ranks = match (a.strategy, world) {
        (Strategy::Single, 1) => Ranks::Solo(a.devices.first().copied().unwrap_or(0)),
        (Strategy::Single, _) => {
            bail!("--strategy single takes one device; use ddp or fsdp for {world}")
        }
        _ => Ranks::Threads {
            cuda: !a.device.is_cpu(),
            devices: a.devices.clone(),
        },
    };
    let args = Arc::new(a.clone());
    let body = move |comm: Box<dyn Comm>, ordinal: usize| {
        let device = match (args.device.location(), args.device.is_cpu()) {
            (_, true) => Device::Cpu,
            (candle_core::DeviceLocation::Cuda { gpu_id }, _) if gpu_id == ordinal => {
                args.device.clone()
            }
            _ => Device::new_cuda(ordinal)?,
        };
        run_rank(&args, device, &*comm)
    };
    launch(ranks, Duration::from_secs(1800), Arc::new(body))
}

/// One rank's bench (the whole bench for one device), with an allocation failure turned into
/// the diagnosis (`stop::OutOfMemory`: rank, phase, peak vs capacity, the memory plan's
/// forecast and remedies).
fn run_rank(a: &BenchArgs, device: Device, comm: &dyn Comm) -> Result<serde_json::Value> {
    let a = &BenchArgs {
        device,
        ..a.clone()
    };
    use crate::memory::plan;
    let cfg = config_of(a)?;
    let act = if a.device.is_cpu() {
        DType::F32
    } else {
        DType::BF16
    };
    let kernels = crate::ops::Kernels::resolve(&a.device, act, cfg.attn_shape(), a.deterministic)?
        .for_base(a.quant);
    let targets = targets(&a.targets, &cfg)?;
    let mlp_chunk = Some(crate::model::layer_mlp::MLP_CHUNK);
    let mlp_chunk = plan::mlp_chunk_as_run(&cfg, mlp_chunk, a.dropout.into(), &targets);
    let input = plan::PlanInput {
        tied: cfg.tie_word_embeddings.unwrap_or(false),
        cfg,
        dtype_bytes: if a.device.is_cpu() { 4 } else { 2 },
        micro_batch: a.micro_batch,
        seq_len: a.seq,
        rank: a.rank,
        targets,
        dora: false,
        gpus: comm.world(),
        cuda: !a.device.is_cpu(),
        kernels: kernels.for_base(a.quant),
        offload: Keep::new(Checkpointing::Off, a.offload, &a.device) == Keep::Offload,
        quant: a.quant,
        mlp_chunk,
    };
    let p = plan::plan(&input, 1, a.max_memory);
    let sel = (a.strategy, a.ckpt);
    let ballast = match a.max_memory {
        Some(m) => memory::hold_ballast(&a.device, m)?,
        None => None,
    };
    let capacity = a.max_memory.or(ballast.as_ref().map(|b| b.total));
    let mut meter = memory::PhaseMeter::default();
    // Pairs of parked gate and up in flight (ckpt mlp) as the plan fits them in max_memory.
    let park = plan::row(&p, sel.0, sel.1).map(|r| r.b.park_pending);
    let res = measure(a, &kernels, comm, &mut meter, park);
    drop(ballast);
    match res {
        Err(e) if memory::is_oom(&e) => {
            let peak = memory::stats(&a.device)?.map(|s| s.used_high.max(meter.run_peak));
            Err(crate::train::stop::OutOfMemory {
                rank: comm.rank(),
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

/// The bench proper; rank 0's JSON is the result, with every rank's throughput and peak
/// memory under "per_rank". `meter` ends as the engine's (the phase an OOM happened in).
fn measure(
    a: &BenchArgs,
    kernels: &crate::ops::Kernels,
    comm: &dyn Comm,
    meter: &mut memory::PhaseMeter,
    park: Option<usize>,
) -> Result<serde_json::Value> {
    let (rank, world) = (comm.rank(), comm.world());
    let cfg = config_of(a)?;
    let spec = LoraSpec {
        rank: a.rank,
        alpha: a.alpha.unwrap_or(2.0 * a.rank as f64),
        dropout: a.dropout,
        rslora: a.rslora,
        dora: false,
        targets: targets(&a.targets, &cfg)?,
    };
    let loaded = load(a, kernels, comm, &cfg, &spec)?;
    let (model, shards) = (&loaded.model, loaded.shards.as_ref());
    let mut opt = AdamW::new(adapter_params(model), [0.9, 0.999], 1e-8, 0.0)?;

    let (b, t, accum) = (a.micro_batch, a.seq, a.grad_accum.max(1));
    let (batches, evals) = micro_batches(a, cfg.vocab_size, rank, world);
    // Every row counts t − pack targets: the step's denominator over all ranks.
    let denom = world * accum * b * workload::targets_per_row(t, a.pack);
    let keep = Keep::new(a.ckpt, a.offload, &a.device).with_park(park);
    let dropout_seed = (a.dropout > 0.0).then_some(0);
    let mut engine = Engine::new(model, comm, shards, keep, 1.0, dropout_seed);
    let par = crate::train::driver::Par {
        comm,
        shards,
        reduce: false,
    };
    let saver = match (a.save_every, rank) {
        (0, _) => None,
        (_, r) => Some((workload::Saver::new(model)?, r == 0)),
    };
    let run = Run {
        model,
        spec: &spec,
        par: &par,
        batches: &batches,
        evals: &evals,
        denom,
        saver: saver.as_ref(),
    };
    let steps = match run_steps(a, &run, &mut engine, &mut opt) {
        Ok(s) => s,
        Err(e) => {
            *meter = engine.meter.clone();
            return Err(e);
        }
    };
    a.device.synchronize()?;
    Report {
        a,
        cfg: &cfg,
        spec: &spec,
        kernels,
        loaded: &loaded,
        keep,
        steps,
        meter: &engine.meter,
        evals: evals.len(),
        saver: saver.as_ref().map(|(s, _)| s),
    }
    .json(comm)
}

/// The model a bench times, as loaded.
struct Loaded {
    model: Model,
    /// This rank's shards of the base (fsdp).
    shards: Option<Shards>,
    /// Seconds the load took, and the pool's use after it (GiB; CUDA).
    load_s: f64,
    after_load: Option<f64>,
}

/// The model on `a.device` (`--model`'s weights, else random ones of `cfg`; sharded under
/// fsdp), with the seconds its load took and the pool's use after it.
fn load(
    a: &BenchArgs,
    kernels: &crate::ops::Kernels,
    comm: &dyn Comm,
    cfg: &ModelConfig,
    spec: &LoraSpec,
) -> Result<Loaded> {
    let dtype = if a.device.is_cpu() {
        DType::F32
    } else {
        DType::BF16
    };
    memory::keep_pool_memory(&a.device)?;
    let t0 = Instant::now();
    let fsdp = a.strategy == Strategy::Fsdp;
    let (model, shards) =
        sharded_model(fsdp, a.quant, comm, kernels, &mut |loaded| match &a.model {
            Some(dir) => {
                let files = crate::hub::ModelFiles::local(dir)?;
                Model::load_with(&files, dtype, &a.device, spec, 0, kernels, loaded)
            }
            None => Model::random_with(cfg.clone(), dtype, &a.device, spec, 0, kernels, loaded),
        })?;
    a.device.synchronize()?;
    let load_s = t0.elapsed().as_secs_f64();
    let after_load = memory::stats(&a.device)?.map(|s| s.used as f64 / GIB);
    Ok(Loaded {
        model,
        shards,
        load_s,
        after_load,
    })
}

/// What a rank's JSON line is made of: the bench's setup and what its timed steps measured.
struct Report<'a> {
    a: &'a BenchArgs,
    cfg: &'a ModelConfig,
    spec: &'a LoraSpec,
    kernels: &'a crate::ops::Kernels,
    loaded: &'a Loaded,
    keep: Keep,
    steps: Steps,
    /// The engine's meter after the timed steps (its run peaks and phase ends).
    meter: &'a memory::PhaseMeter,
    /// Eval micro-batches a rank runs.
    evals: usize,
    /// The checkpoint writer (save_every > 0).
    saver: Option<&'a workload::Saver>,
}

impl Report<'_> {
    /// The JSON line: this rank's figures, and every rank's gathered over `comm` (a
    /// collective: every rank calls it).
    fn json(self, comm: &dyn Comm) -> Result<serde_json::Value> {
        let (a, cfg, world) = (self.a, self.cfg, comm.world());
        let (model, shards) = (&self.loaded.model, self.loaded.shards.as_ref());
        let trainable: usize = model
            .adapters()
            .map(|(_, l)| l.a.elem_count() + l.b.elem_count())
            .sum();
        // From the config: under FSDP the model's own tensors are placeholders.
        let n_linear = base_linear_params(cfg);
        let (b, t, accum) = (a.micro_batch, a.seq, a.grad_accum.max(1));
        let clock = &self.steps.clock;
        let dt = clock.seconds(self.steps.t1);
        let losses = &clock.losses;
        let mut timed = clock.timed.clone();
        (timed.run_peak, timed.run_reserved) = (self.meter.run_peak, self.meter.run_reserved);
        timed.ends = self.meter.ends.clone();
        let loss = losses.last().copied().unwrap_or(0.0);
        let cuda = !a.device.is_cpu();
        // This rank's tokens per second; every rank's figures gathered for rank 0's report.
        let tokens = (accum * b * t * a.steps) as f64;
        let tps = tokens / dt;
        let (fpt, work_fpt) = step_flops(a, cfg, self.spec, model.mlp_chunk, self.keep, self.evals);
        let r2 = |x: f64| (x * 100.0).round() / 100.0;
        let peak = cuda.then_some((timed.run_peak, timed.run_reserved));
        let ranks = RankFigures::gather(a, comm, tps, peak, dt / a.steps as f64)?;
        let (total_tps, peak_alloc, peak_reserved) =
            (ranks.tps, ranks.peak_alloc, ranks.peak_reserved);
        let per_rank = ranks.rows;
        let per_gpu = total_tps / world as f64;
        let strategy = a.strategy.name();
        let attn = if self.kernels.attention.tensor_cores() {
            "flash-tensor-core"
        } else {
            "blockwise-lse"
        };
        let keep = self.keep;
        let mut out = serde_json::json!({
            "system": "lora-train", "mode": strategy, "strategy": strategy, "world": world,
            "grad_accum": accum, "global_batch": world * accum * b,
            "losses": losses.iter().map(|l| (l * 1e4).round() / 1e4).collect::<Vec<_>>(),
            "per_rank": per_rank,
            "fsdp_gathers": shards.map(|s| if s.peer_copies { "peer copies" } else { "collective" }),
            "resident_base_gib": r2(crate::parallel::fsdp::resident_base_bytes(model, shards) as f64 / GIB),
            "device": format!("{:?}", a.device.location()),
            "shape": a.shape, "seq": t, "micro_batch": b, "lora_rank": a.rank,
            "targets": a.targets, "ckpt": a.ckpt, "offload": keep.parks(), "attn": attn,
            "trainable_params": trainable, "base_linear_params": n_linear,
            "load_s": r2(self.loaded.load_s), "after_load_gib": self.loaded.after_load.map(r2),
            "peak_alloc_gib": peak.map(|_| r2(peak_alloc)),
            "peak_reserved_gib": peak.map(|_| r2(peak_reserved)),
            "step_s": (dt / a.steps as f64 * 1e4).round() / 1e4,
            "tokens_per_s": (total_tps * 10.0).round() / 10.0,
            "tokens_per_s_per_gpu": (per_gpu * 10.0).round() / 10.0,
            "mfu": (per_gpu * fpt / (a.peak_tflops * 1e12) * 1e4).round() / 1e4,
            "final_loss": (loss * 1e4).round() / 1e4,
            "phases": phases(&timed),
            "max_memory_gib": a.max_memory.map(|m| r2(m as f64 / GIB)),
            "tag": a.tag, "dropout": a.dropout, "rslora": a.rslora, "pack": a.pack,
            "eval_every": a.eval_every, "eval_batches": self.evals, "save_every": a.save_every,
            "flops_per_token": fpt, "work_flops_per_token": work_fpt,
        });
        // The timed window by wall time, for scripts/energy.py (one json! call would pass the
        // macro's recursion limit).
        out["timed_unix_s"] = serde_json::json!(clock.window_unix(self.steps.t1));
        self.host_figures(&mut out);
        Ok(out)
    }

    /// `out` with the host's side of the timed steps: the parked pairs in flight, the seconds
    /// spent queueing work and starting and writing checkpoints.
    fn host_figures(&self, out: &mut serde_json::Value) {
        let (a, steps) = (self.a, &self.steps);
        let r3 = |x: f64| (x * 1e3).round() / 1e3;
        // pairs of parked gate and up in flight (ckpt mlp; 0: none parked)
        let park_pending = match self.keep {
            Keep::ParkMlp { pending, .. } => pending,
            _ => 0,
        };
        out["park_pending"] = park_pending.into();
        out["host_queue_s"] = ((steps.queue_s / a.steps as f64 * 1e4).round() / 1e4).into();
        out["save_start_s"] = r3(steps.save_s).into();
        out["save_final_wait_s"] = r3(steps.save_wait_s).into();
        // Each checkpoint's time on the writer thread: a write longer than save_every steps makes
        // the next save wait (in save_start_s).
        if let Some(s) = self.saver {
            out["save_write_s"] = s
                .write_seconds()
                .into_iter()
                .map(r3)
                .collect::<Vec<_>>()
                .into();
        }
    }
}

/// The device pool's peak within each phase of the timed steps, and what stayed allocated at
/// the phase's end (GiB, as `{phase}_peak_gib` and `{phase}_end_gib`).
fn phases(timed: &memory::PhaseMeter) -> serde_json::Map<String, serde_json::Value> {
    let gib = |x: u64| (x as f64 / GIB * 100.0).round() / 100.0;
    let mut phases = serde_json::Map::new();
    for (phase, v) in &timed.peaks {
        phases.insert(format!("{phase}_peak_gib"), gib(*v).into());
    }
    for (phase, v) in &timed.ends {
        phases.insert(format!("{phase}_end_gib"), gib(*v).into());
    }
    phases
}

/// The model FLOPs a trained token costs: the plain step's (`flops_per_token`, with the MLP
/// half's recompute under `ckpt mlp`) and the workload's (eval and the knobs counted too).
fn step_flops(
    a: &BenchArgs,
    cfg: &ModelConfig,
    spec: &LoraSpec,
    mlp_chunk: Option<usize>,
    keep: Keep,
    eval_batches: usize,
) -> (f64, f64) {
    let (b, t, accum) = (a.micro_batch, a.seq, a.grad_accum.max(1));
    let n_linear = base_linear_params(cfg);
    let full = a.ckpt == Checkpointing::Full;
    let mlp_chunk =
        crate::memory::plan::mlp_chunk_as_run(cfg, mlp_chunk, a.dropout.into(), &spec.targets);
    let mlp_recompute = match a.ckpt {
        Checkpointing::Mlp => mlp_in_weights(cfg, keep, b * t, mlp_chunk),
        _ => 0,
    };
    let fpt = flops_per_token(n_linear, cfg.num_layers, cfg.hidden_size, t, full)
        + 2.0 * mlp_recompute as f64;
    let work = workload::Work {
        n_linear,
        adapter: workload::adapter_weights(cfg, spec),
        layers: cfg.num_layers,
        hidden: cfg.hidden_size,
        seq: t / a.pack.clamp(1, (t / 2).max(1)),
        ckpt: full,
        mlp_recompute,
        eval_tokens: eval_batches * b * t,
        step_tokens: accum * b * t,
        eval_every: a.eval_every,
    };
    (fpt, work.flops_per_token())
}

/// This rank's micro-batches of a step and its eval batches: random token ids (labels = ids),
/// like the baseline's. Global row g is seeded by g, and micro-batch m holds rows
/// (m·b + j)·world + rank, j < b; the eval rows follow the step's.
fn micro_batches(
    a: &BenchArgs,
    vocab: usize,
    rank: usize,
    world: usize,
) -> (Vec<Batch>, Vec<Batch>) {
    let (b, t, accum) = (a.micro_batch, a.seq, a.grad_accum.max(1));
    let row = |g: usize| -> Vec<u32> {
        let mut rng = crate::rng::Rng::new(1234 + g as u64);
        (0..t).map(|_| rng.below(vocab) as u32).collect()
    };
    let micro = |m: usize| {
        let ids: Vec<u32> = (0..b)
            .flat_map(|j| row((m * b + j) * world + rank))
            .collect();
        workload::batch(&ids, b, t, a.pack)
    };
    let batches = (0..accum).map(micro).collect();
    let evals = match a.eval_every {
        0 => Vec::new(),
        _ => (accum..accum + a.eval_batches.max(1)).map(micro).collect(),
    };
    (batches, evals)
}

/// What the timed steps run on.
struct Run<'a> {
    model: &'a Model,
    spec: &'a LoraSpec,
    par: &'a crate::train::driver::Par<'a>,
    batches: &'a [Batch],
    evals: &'a [Batch],
    /// The step's loss denominator over all ranks.
    denom: usize,
    /// The checkpoint writer, and whether this rank writes.
    saver: Option<&'a (workload::Saver, bool)>,
}

/// What the timed steps measured.
struct Steps {
    clock: workload::Clock,
    /// When the first step was queued.
    t1: Instant,
    /// Seconds the host spent queueing the timed steps' work.
    queue_s: f64,
    /// Seconds starting checkpoints (their host copies), and waiting for the last one's write.
    save_s: f64,
    save_wait_s: f64,
}

/// The warm-up and timed steps in the trainer's order and clock (train::trainer).
fn run_steps(a: &BenchArgs, run: &Run, engine: &mut Engine, opt: &mut AdamW) -> Result<Steps> {
    // Seconds the loop spent starting checkpoints (their host copies) and waiting for the last
    // one's write.
    let (save_s, save_wait_s) = (std::cell::Cell::new(0.0), std::cell::Cell::new(0.0));
    // What the trainer does after step `n` (1-based) is done: eval, then the checkpoint.
    let after = |n: usize, opt: &AdamW| -> Result<()> {
        if a.eval_every > 0 && n % a.eval_every == 0 {
            workload::eval(run.model, run.par, run.evals)?;
        }
        match run.saver {
            Some((s, true)) if n % a.save_every == 0 => {
                let t0 = Instant::now();
                s.save(n, run.model, run.spec, opt)?;
                save_s.set(save_s.get() + t0.elapsed().as_secs_f64());
                Ok(())
            }
            _ => Ok(()),
        }
    };
    let saves = |n: usize| a.save_every > 0 && n % a.save_every == 0;
    // The training loop's order and clock (train::trainer): step k+1's forward and backward
    // queued before step k's loss is read (and its eval and checkpoint run), then step k+1's
    // update; a step that saves is finished before the next is queued. A step counts as done
    // once its loss is read and its eval run and checkpoint started, and the timed steps run
    // on from the warm-up ones without a pause.
    let total = a.warmup + a.steps;
    let mut clock = workload::Clock::new(a.warmup);
    // The last step also waits for the checkpoint write in flight: the clock counts them all.
    let finish = |engine: &mut Engine, opt: &mut AdamW, clock: &mut workload::Clock, p, n| {
        let done = engine.finish(p, opt)?;
        after(n, opt)?;
        if let (Some((s, _)), true) = (run.saver, n == total) {
            let t0 = Instant::now();
            s.wait()?;
            save_wait_s.set(t0.elapsed().as_secs_f64());
        }
        clock.record(done);
        anyhow::Ok(())
    };
    let mut pending = None;
    // Seconds the host spent queueing the timed steps' work (forward, backward, update): near
    // step_s, the host sets the pace (launches, allocations, routing reads), not the device.
    let mut queue_s = 0.0;
    let t1 = Instant::now();
    for step in 0..=total {
        if step == a.warmup {
            engine.meter = memory::PhaseMeter::default();
        }
        // The timed window opens when the last warm-up step is read: it is read before
        // the first timed step is queued, or a host that blocks while it queues (e.g. on
        // parked inputs at long T) would open the window late.
        if step < total && (saves(step) || (step == a.warmup && step > 0)) {
            if let Some(p) = pending.take() {
                finish(engine, opt, &mut clock, p, step)?;
            }
        }
        let t0 = Instant::now();
        let q = match step < total {
            true => Some(engine.backward(run.batches, run.denom, step)?),
            false => None,
        };
        let queued = t0.elapsed().as_secs_f64();
        if let Some(p) = pending.take() {
            finish(engine, opt, &mut clock, p, step)?;
        }
        let t0 = Instant::now();
        if let Some(q) = q {
            pending = Some(engine.update(q, opt, 1e-4)?);
        }
        if step >= a.warmup {
            queue_s += queued + t0.elapsed().as_secs_f64();
        }
    }
    Ok(Steps {
        clock,
        t1,
        queue_s,
        save_s: save_s.get(),
        save_wait_s: save_wait_s.get(),
    })
}

/// Every rank's figures, gathered for rank 0's report.
struct RankFigures {
    rows: Vec<serde_json::Value>,
    /// Σ tokens/s over the ranks.
    tps: f64,
    peak_alloc: f64,
    peak_reserved: f64,
}

impl RankFigures {
    /// This rank's tokens/s, pool peaks (used, reserved: CUDA) and step time, with every
    /// other rank's.
    fn gather(
        a: &BenchArgs,
        comm: &dyn Comm,
        tps: f64,
        peak: Option<(u64, u64)>,
        step_s: f64,
    ) -> Result<RankFigures> {
        let r2 = |x: f64| (x * 100.0).round() / 100.0;
        let gib_of = |x: Option<u64>| x.map_or(-1.0, |v| v as f64 / GIB);
        let mine = [
            tps,
            gib_of(peak.map(|p| p.0)),
            gib_of(peak.map(|p| p.1)),
            step_s,
        ];
        let all = comm
            .all_gather(&Tensor::new(&mine, &a.device)?)?
            .to_vec1::<f64>()?;
        let rows = all
            .chunks(4)
            .enumerate()
            .map(|(r, x)| {
                serde_json::json!({
                    "rank": r, "device": a.devices.get(r), "tokens_per_s": (x[0] * 10.0).round() / 10.0,
                    "peak_alloc_gib": (x[1] >= 0.0).then(|| r2(x[1])),
                    "peak_reserved_gib": (x[2] >= 0.0).then(|| r2(x[2])),
                    "step_s": (x[3] * 1e4).round() / 1e4,
                })
            })
            .collect();
        Ok(RankFigures {
            rows,
            tps: all.chunks(4).map(|x| x[0]).sum(),
            peak_alloc: all.chunks(4).map(|x| x[1]).fold(f64::MIN, f64::max),
            peak_reserved: all.chunks(4).map(|x| x[2]).fold(f64::MIN, f64::max),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shape_reads_as_a_config() {
        for name in SHAPES {
            let cfg = shape(name).unwrap();
            assert!(cfg.num_params(false) > 0, "{name}");
        }
        assert!(shape("qwen3-31b").is_err());
    }

    #[test]
    fn qwen3_30b_a3b_counts_the_active_experts_only() {
        let cfg = shape("qwen3-30b-a3b").unwrap();
        let m = cfg.arch.moe.unwrap();
        assert_eq!(
            (m.experts, m.top_k, m.inter, m.norm_topk),
            (128, 8, 768, true)
        );
        // all 128 experts: 30,532,122,624 parameters, the released model's
        assert_eq!(cfg.num_params(false), 30_532_122_624);
        // a token's: attention 18,874,368 a layer, its 8 experts' gate_up and down
        // 8 · 3 · 768 · 2048, the router 128 · 2048, and the head 151936 · 2048
        let attn = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048;
        assert_eq!(attn, 18_874_368);
        let active = 48 * (attn + 8 * 3 * 768 * 2048 + 128 * 2048) + 151_936 * 2048;
        assert_eq!(base_linear_params(&cfg), active);
        assert_eq!(active, 3_041_656_832);
        // 4 FLOPs an active weight (frozen base: forward 2, dL/dx 2, no dL/dW, as the dense
        // shapes) and the causal attention 6 · L · T · C; checkpointing adds a forward
        let (l, c, t) = (48.0, 2048.0, 2048.0);
        let fpt = flops_per_token(active, 48, 2048, 2048, false);
        assert_eq!(fpt, 4.0 * active as f64 + 6.0 * l * t * c);
        let ck = flops_per_token(active, 48, 2048, 2048, true);
        assert_eq!(ck, fpt + 2.0 * active as f64 + 2.0 * l * t * c);
    }

    #[test]
    fn all_targets_a_moe_s_experts_and_the_work_counts_the_routed_ones() {
        let cfg = shape("qwen3-30b-a3b").unwrap();
        let all = targets("all", &cfg).unwrap();
        let want = ["q_proj", "k_proj", "v_proj", "o_proj"]
            .into_iter()
            .chain(crate::lora::EXPERT_PARAMS);
        assert!(all.iter().map(String::as_str).eq(want), "{all:?}");
        assert_eq!(targets("attn", &cfg).unwrap().len(), 4);
        // the model resolves them as bench names them (no "all-linear" collapse)
        assert_eq!(cfg.resolve_targets(&all).unwrap(), all);
        // adapters: 48 · 16 · (attention 17,408 + 128 · ((2048 + 1536) + (768 + 2048)))
        let lora = crate::memory::plan::lora_params(&cfg, 16, &all);
        assert_eq!(lora, 48 * 16 * (17_408 + 128 * (3584 + 2816)));
        assert_eq!(lora, 642_514_944);
        // a token multiplies the adapters of its 8 experts, not all 128
        let spec = LoraSpec {
            rank: 16,
            alpha: 32.0,
            dropout: 0.0,
            rslora: false,
            dora: false,
            targets: all,
        };
        let w = workload::adapter_weights(&cfg, &spec);
        assert_eq!(w, 48 * 16 * (17_408 + 8 * (3584 + 2816)));
        // a dense model's "all" is its linears alone
        let llama = shape("llama2-7b").unwrap();
        assert_eq!(targets("all", &llama).unwrap().len(), 7);
    }
}
