//! `lora-train bench`: training-step throughput and peak memory on random weights of a named
//! shape (or a checkpoint's weights), measured like scripts/bench_peft.py (same shapes, same
//! FLOP count, same JSON fields) so the two can run in one device call and be compared as
//! ratios.
//!
//! A bench is a training session built as `train` builds one: its flags become a recipe, which
//! resolves to a `RunConfig` (run::resolve) and loads one `Session` per rank; its steps run in
//! the training loop itself (train::run_loop) on random rows, with hooks that time them
//! (`hooks::BenchHooks`). So it measures what `train` runs, by construction.
//!
//! With `--strategy ddp|fsdp --devices 0,1` one thread per GPU trains the same model (the
//! same seeded random weights on every rank) on a fixed set of world × micro_batch ×
//! grad_accum random rows, rank r taking rows r, r + world, ...: the per-step losses are then
//! comparable with a single-GPU run of the same global batch.

mod hooks;
mod report;
mod rows;
pub(crate) mod workload;

use crate::data::Batch;
use crate::hub::Source;
use crate::memory::{self, plan};
use crate::model::{shapes, ModelConfig};
use crate::ops::pool;
use crate::recipe::{Checkpointing, DeviceKind, Quantize, Recipe, Strategy, TrainObjective};
use crate::run::launch::launch;
use crate::run::Machine;
use crate::train::meter::{PhaseMeter, GIB};
use crate::train::Comm;
use crate::train::{RunConfig, Session};
use anyhow::{bail, Result};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) use rows::random_batch;

/// `lora-train bench`'s settings.
#[derive(Debug, Clone)]
pub struct BenchArgs {
    /// A shape `model::shapes` knows (unused with `model`).
    pub shape: String,
    /// Tokens per row.
    pub seq: usize,
    /// Rows per micro-batch.
    pub micro_batch: usize,
    /// LoRA rank, and alpha (None: 2 × rank).
    pub rank: usize,
    /// LoRA alpha (None: 2 × rank).
    pub alpha: Option<f64>,
    /// "all", "attn" or "qv" (`shapes::targets`).
    pub targets: String,
    /// train.activation_checkpointing.
    pub ckpt: Checkpointing,
    /// train.offload_activations (None: on; CUDA only).
    pub offload: Option<bool>,
    /// Timed steps, after `warmup` untimed ones.
    pub steps: usize,
    /// Untimed steps before the timed ones.
    pub warmup: usize,
    /// CPU or CUDA.
    pub device: DeviceKind,
    /// The matrix units' rate the MFU is counted against (TFLOP/s).
    pub peak_tflops: f64,
    /// single, ddp or fsdp, as parallel.strategy.
    pub strategy: Strategy,
    /// CUDA ordinals, one rank each (CPU: virtual ranks); one entry for "single".
    pub devices: Vec<usize>,
    /// Micro-batches per optimiser step, as train.grad_accum.
    pub grad_accum: usize,
    /// Behave as a card of this many bytes (a ballast outside the pool; CUDA only).
    pub max_memory: Option<u64>,
    /// A checkpoint directory to time instead of random weights of `shape` (its config.json
    /// gives the shape): the weights `train` would load, on bench's random rows.
    pub model: Option<PathBuf>,
    /// train.deterministic: no kernel whose sums land in a varying order.
    pub deterministic: bool,
    /// lora.dropout (0: none).
    pub dropout: f32,
    /// lora.rslora: the adapters' scale α / √r.
    pub rslora: bool,
    /// Short examples packed into each row (block-diagonal attention: `workload::batch`); 1:
    /// one sequence a row.
    pub pack: usize,
    /// An eval forward over `eval_batches` micro-batches every this many steps (0: none), as
    /// train.eval_every.
    pub eval_every: usize,
    /// Micro-batches each eval forward runs over.
    pub eval_batches: usize,
    /// A checkpoint (adapter and optimiser state) every this many steps (0: none), as
    /// output.save_every; rank 0 writes it.
    pub save_every: usize,
    /// A label for the JSON line (a sweep's row).
    pub tag: Option<String>,
    /// How the frozen base is stored (`--quantize nf4`: QLoRA, double quant).
    pub quant: Quantize,
    /// train.objective: "sft", or a preference objective on random pairs (`seq` tokens a
    /// sequence, `prompt_len` of them the prompt shared by a pair's two completions).
    pub objective: TrainObjective,
    /// Prompt tokens of each pair (preference objectives).
    pub prompt_len: usize,
}

/// The learning rate of every bench step (constant).
const LR: f64 = 1e-4;

/// Frozen linear weights a token multiplies (the head included), from its config: what the
/// FLOP count takes (scripts/bench_peft.py counts alike). A MoE layer counts its router and
/// the k experts a token is routed to, not all E.
pub(crate) fn base_linear_params(cfg: &ModelConfig) -> usize {
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

/// scripts/bench_peft.py's model FLOPs per trained token: frozen base, so backward computes
/// activation gradients (2N) but no weight gradients. Attention is counted causally: a token
/// attends to T/2 keys on average, so QKᵀ and PV cost 2·T·C a layer forward (4·T·C backward).
pub(crate) fn flops_per_token(
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

/// The shape a bench runs: `--model`'s config.json, else the named shape.
fn config_of(a: &BenchArgs) -> Result<ModelConfig> {
    match &a.model {
        Some(dir) => Ok(ModelConfig::from_file(&dir.join("config.json"))?),
        None => shapes::shape(&a.shape),
    }
}

/// The recipe a bench's flags make: the run `train` would make of it, on random rows.
fn recipe(a: &BenchArgs, cfg: &ModelConfig, out_dir: PathBuf) -> Result<Recipe> {
    use crate::recipe::{Schedule, Targets, TrainFiles};
    let mut r: Recipe =
        toml::from_str("[model]\npath = \"unused\"\n[data]\ntrain = \"<random rows>\"\n")?;
    r.source = PathBuf::from(format!("<bench {}>", a.shape));
    r.model.path = a.model.clone();
    r.model.device = a.device;
    r.model.quantize = a.quant;
    r.lora.rank = a.rank;
    r.lora.alpha = a.alpha.unwrap_or(2.0 * a.rank as f64);
    r.lora.dropout = a.dropout as f64;
    r.lora.rslora = a.rslora;
    r.lora.targets = Targets::List(shapes::targets(&a.targets, cfg)?);
    r.data.train = TrainFiles::One(PathBuf::from("<random rows>"));
    r.data.seq_len = a.seq;
    r.data.pack = a.pack > 1;
    if let Some(f) = a.objective.data_format() {
        r.data.format = f;
        r.data.pack = false;
    }
    r.train.objective = a.objective;
    let t = &mut r.train;
    (t.micro_batch, t.grad_accum) = (a.micro_batch, a.grad_accum.max(1));
    (t.lr, t.schedule, t.seed) = (LR, Schedule::Constant, 0);
    t.activation_checkpointing = a.ckpt;
    t.offload_activations = a.offload;
    t.deterministic = a.deterministic;
    t.max_memory = a.max_memory.map(|m| m.to_string());
    t.eval_every = a.eval_every;
    r.parallel.strategy = a.strategy;
    r.parallel.devices = a.devices.clone();
    r.parallel.timeout_s = 1800;
    r.output.dir = Some(out_dir);
    r.output.save_every = a.save_every;
    Ok(r)
}

/// The bench on `a.devices`: one rank for "single", one thread per rank for ddp / fsdp. An
/// allocation failure on any rank ends with that rank's diagnosis.
pub fn run(a: &BenchArgs) -> Result<serde_json::Value> {
    let world = a.devices.len().max(1);
    if a.strategy == Strategy::Single && world > 1 {
        bail!("--strategy single takes one device; use ddp or fsdp for {world}");
    }
    let cfg = config_of(a)?;
    let saves = std::env::temp_dir().join(format!("lora-train-bench-{}", std::process::id()));
    let source = a.model.clone().map(Source::Local);
    let run = RunConfig::of(recipe(a, &cfg, saves)?, source, cfg, Machine::Open)?;
    let (ranks, timeout) = (run.ranks.clone(), Duration::from_secs(1800));
    let (run, args) = (Arc::new(run), Arc::new(a.clone()));
    let body =
        move |comm: Box<dyn Comm>, ordinal: usize| run_rank(&args, run.clone(), comm, ordinal);
    launch(ranks, timeout, Arc::new(body))
}

/// One rank's bench (the whole bench for one device), with an allocation failure turned into
/// the diagnosis (`stop::OutOfMemory`: rank, phase, peak vs capacity, the memory plan's
/// forecast and remedies).
fn run_rank(
    a: &BenchArgs,
    run: Arc<RunConfig>,
    comm: Box<dyn Comm>,
    ordinal: usize,
) -> Result<serde_json::Value> {
    // Rows as the bench lays them out (a pair's tree: 2 · seq − prompt_len tokens).
    let input = plan::PlanInput {
        seq_len: rows::unit_tokens(a),
        ..run.plan_input(comm.world())
    };
    let p = plan::plan(&input, 1, a.max_memory);
    let sel = (run.strategy, run.ckpt);
    let dev = crate::model::device::open(run.device, ordinal)?;
    let ballast = match a.max_memory {
        Some(m) => memory::hold_ballast(&dev, m)?,
        None => None,
    };
    let capacity = a.max_memory.or(ballast.as_ref().map(|b| b.total));
    let (rank, mut meter) = (comm.rank(), PhaseMeter::default());
    // Pairs of parked gate and up in flight (ckpt mlp) as the plan fits them in max_memory.
    let park = plan::row(&p, sel.0, sel.1).map(|r| r.b.park_pending);
    let res = measure(a, run, comm, ordinal, &mut meter, park);
    drop(ballast);
    match res {
        Err(e) if pool::is_oom(&e) => {
            let peak = pool::stats(&dev)?.map(|s| s.used_high.max(meter.run_peak));
            Err(crate::train::stop::OutOfMemory {
                rank,
                phase: meter.current(),
                step: None,
                total: 0,
                peak,
                capacity,
                forecast: plan::row(&p, sel.0, sel.1).map(|r| memory::forecast(&r.b)),
                remedies: plan::remedies(&p, sel),
                last_checkpoint: None,
                cause: format!("{e:#}"),
            }
            .into())
        }
        other => other,
    }
}

/// The bench proper: the session loaded, its warm-up and timed steps run by the training
/// loop; rank 0's JSON is the result, with every rank's throughput and peak memory under
/// "per_rank". `meter` ends as the engine's (the phase an OOM happened in).
fn measure(
    a: &BenchArgs,
    run: Arc<RunConfig>,
    comm: Box<dyn Comm>,
    ordinal: usize,
    meter: &mut PhaseMeter,
    park: Option<usize>,
) -> Result<serde_json::Value> {
    let t0 = Instant::now();
    let s = Session::load(run, comm, ordinal)?;
    s.model.device.synchronize()?;
    let loaded = report::Loaded {
        load_s: t0.elapsed().as_secs_f64(),
        after_load: pool::stats(&s.model.device)?.map(|m| m.used as f64 / GIB),
    };
    let keep = s.run.keep.with_park(park);
    let mut h = hooks::BenchHooks::new(a, &s)?;
    let steps = match h.run(&s, keep) {
        Ok(steps) => steps,
        Err((e, m)) => {
            *meter = m;
            return Err(e);
        }
    };
    s.model.device.synchronize()?;
    let reference_s = reference_seconds(a, &s, h.step_batches())?;
    report::Report {
        a,
        s: &s,
        loaded: &loaded,
        keep,
        steps,
        reference_s,
        evals: h.evals.len(),
        saver: h.saver.as_ref().map(|(s, _)| s),
    }
    .json()
}

/// DPO and KTO: the seconds a step's reference forwards take (this rank's micro-batches scored
/// by the reference, keeping nothing), timed alone after the timed window (min(steps, 5)
/// repetitions, synchronised) so that the window itself carries no extra synchronisation.
/// None without a reference.
fn reference_seconds(a: &BenchArgs, s: &Session, batches: &[Batch]) -> Result<Option<f64>> {
    if s.run.objective.reference().is_none() {
        return Ok(None);
    }
    let objective = s.run.objective.objective(s.reference.clone());
    let par = s.par(false);
    let reps = a.steps.clamp(1, 5);
    s.model.device.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..reps {
        for b in batches {
            objective.reference(&s.model, &par, b)?;
        }
    }
    s.model.device.synchronize()?;
    Ok(Some(t0.elapsed().as_secs_f64() / reps as f64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shape_reads_as_a_config() {
        for name in shapes::SHAPES {
            let cfg = shapes::shape(name).unwrap();
            assert!(cfg.num_params(false) > 0, "{name}");
        }
        assert!(shapes::shape("qwen3-31b").is_err());
    }

    #[test]
    fn qwen3_30b_a3b_counts_the_active_experts_only() {
        let cfg = shapes::shape("qwen3-30b-a3b").unwrap();
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
        let cfg = shapes::shape("qwen3-30b-a3b").unwrap();
        let all = shapes::targets("all", &cfg).unwrap();
        let want = ["q_proj", "k_proj", "v_proj", "o_proj"]
            .into_iter()
            .chain(crate::model::EXPERT_PARAMS);
        assert!(all.iter().map(String::as_str).eq(want), "{all:?}");
        assert_eq!(shapes::targets("attn", &cfg).unwrap().len(), 4);
        // the model resolves them as bench names them (no "all-linear" collapse)
        assert_eq!(cfg.resolve_targets(&all).unwrap(), all);
        // adapters: 48 · 16 · (attention 17,408 + 128 · ((2048 + 1536) + (768 + 2048)))
        let lora = crate::memory::plan::lora_params(&cfg, 16, &all);
        assert_eq!(lora, 48 * 16 * (17_408 + 128 * (3584 + 2816)));
        assert_eq!(lora, 642_514_944);
        // a token multiplies the adapters of its 8 experts, not all 128
        let spec = crate::lora::LoraSpec {
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
        let llama = shapes::shape("llama2-7b").unwrap();
        assert_eq!(shapes::targets("all", &llama).unwrap().len(), 7);
    }
}
