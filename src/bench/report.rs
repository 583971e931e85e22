//! A bench's JSON line: its setup, what its timed steps measured, and every rank's figures
//! gathered for rank 0's report.

use super::hooks::Steps;
use super::{workload, BenchArgs};
use crate::lora::LoraSpec;
use crate::model::{Keep, ModelConfig};
use crate::recipe::Checkpointing;
use crate::train::meter::{PhaseMeter, GIB};
use crate::train::Comm;
use crate::train::Session;
use anyhow::Result;
use candle_core::Tensor;

/// The seconds a bench's model took to load and the pool's use after it (GiB; CUDA).
pub(super) struct Loaded {
    pub(crate) load_s: f64,
    pub(crate) after_load: Option<f64>,
}

/// What a rank's JSON line is made of: the bench's setup and what its timed steps measured.
pub(super) struct Report<'a> {
    pub(crate) a: &'a BenchArgs,
    /// The rank's session (its run: the shape, adapters and kernels).
    pub(crate) s: &'a Session,
    pub(crate) loaded: &'a Loaded,
    pub(crate) keep: Keep,
    /// What the timed steps measured (with the engine's meter after them: its run peaks and
    /// phase ends).
    pub(crate) steps: Steps,
    /// Eval micro-batches a rank runs.
    pub(crate) evals: usize,
    /// The checkpoint writer (save_every > 0).
    pub(crate) saver: Option<&'a workload::Saver>,
    /// DPO and KTO: seconds of a step's reference forwards, timed alone (`reference_seconds`).
    pub(crate) reference_s: Option<f64>,
}

impl Report<'_> {
    /// The JSON line: this rank's figures, and every rank's gathered over the session's comm
    /// (a collective: every rank calls it).
    pub(super) fn json(self) -> Result<serde_json::Value> {
        let comm = &*self.s.comm;
        let (a, cfg, world) = (self.a, &self.s.run.cfg, comm.world());
        let (model, shards) = (&self.s.model, self.s.shards.as_ref());
        let (spec, kernels, meter) = (&self.s.run.spec, &self.s.run.kernels, &self.steps.meter);
        let trainable: usize = model
            .adapters()
            .map(|(_, l)| l.a.elem_count() + l.b.elem_count())
            .sum();
        // From the config: under FSDP the model's own tensors are placeholders.
        let n_linear = super::base_linear_params(cfg);
        let (b, t, accum) = (a.micro_batch, a.seq, a.grad_accum.max(1));
        let clock = &self.steps.clock;
        let dt = clock.seconds(self.steps.t1);
        let losses = &clock.losses;
        let mut timed = clock.timed.clone();
        (timed.run_peak, timed.run_reserved) = (meter.run_peak, meter.run_reserved);
        timed.ends = meter.ends.clone();
        let loss = losses.last().copied().unwrap_or(0.0);
        let cuda = self.s.run.cuda();
        // This rank's tokens per second; every rank's figures gathered for rank 0's report.
        // A pair trains its tree, its prompt once and its two completions (KTO: a sequence,
        // and its mismatched pair's forward).
        let unit = super::rows::unit_tokens(a);
        let tokens = (accum * b * unit * a.steps) as f64;
        let tps = tokens / dt;
        let (fpt, work_fpt) = step_flops(a, cfg, spec, model.mlp_chunk, self.keep, self.evals);
        let r2 = |x: f64| (x * 100.0).round() / 100.0;
        let peak = cuda.then_some((timed.run_peak, timed.run_reserved));
        let ranks = RankFigures::gather(a, &model.device, comm, tps, peak, dt / a.steps as f64)?;
        let (total_tps, peak_alloc, peak_reserved) =
            (ranks.tps, ranks.peak_alloc, ranks.peak_reserved);
        let per_rank = ranks.rows;
        let per_gpu = total_tps / world as f64;
        let strategy = a.strategy.name();
        let attn = if kernels.attention.tensor_cores() {
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
            "resident_base_gib": r2(crate::train::shards::resident_base_bytes(model, shards) as f64 / GIB),
            "device": format!("{:?}", model.device.location()),
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
        if a.objective.data_format().is_some() {
            out["objective"] = a.objective.name().into();
            out["prompt_len"] = a.prompt_len.into();
            // pairs (KTO: examples) a second over the ranks
            out["pairs_per_s"] = ((total_tps / unit as f64) * 100.0).round().into();
            out["pairs_per_s"] = (out["pairs_per_s"].as_f64().unwrap_or(0.0) / 100.0).into();
            // the reference's forwards alone, and their share of a step's time
            if let Some(r) = self.reference_s {
                out["reference_fwd_s"] = ((r * 1e4).round() / 1e4).into();
                let step = dt / a.steps as f64;
                out["reference_share"] = ((r / step * 1e3).round() / 1e3).into();
            }
        }
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
        // a MoE's routing reads a step, and the seconds they waited for the device: near
        // host_queue_s, the device sets the pace; near 0, the host does
        let (wait, reads) = steps.route_wait;
        out["route_reads"] = (reads as f64 / a.steps as f64).into();
        out["route_wait_s"] = ((wait / a.steps as f64 * 1e4).round() / 1e4).into();
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
fn phases(timed: &PhaseMeter) -> serde_json::Map<String, serde_json::Value> {
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
    let n_linear = super::base_linear_params(cfg);
    let full = a.ckpt == Checkpointing::Full;
    let mlp_chunk =
        crate::memory::plan::mlp_chunk_as_run(cfg, mlp_chunk, a.dropout.into(), &spec.targets);
    let mlp_recompute = match a.ckpt {
        Checkpointing::Mlp => crate::model::keep::mlp_in_weights(cfg, keep, b * t, mlp_chunk),
        _ => 0,
    };
    let fpt = super::flops_per_token(n_linear, cfg.num_layers, cfg.hidden_size, t, full)
        + 2.0 * mlp_recompute as f64;
    // DPO and KTO: the reference's forward on top (KTO: and two forwards of its mismatched
    // pairs, per trained token)
    let fwd = super::flops_per_token(n_linear, cfg.num_layers, cfg.hidden_size, t, true)
        - super::flops_per_token(n_linear, cfg.num_layers, cfg.hidden_size, t, false);
    let fpt = fpt
        + fwd
            * match a.objective {
                crate::recipe::TrainObjective::Dpo => 1.0,
                crate::recipe::TrainObjective::Kto => 3.0,
                _ => 0.0,
            };
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
        dev: &candle_core::Device,
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
            .all_gather(&Tensor::new(&mine, dev)?)?
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
