//! Memory as the step and its loop see it: the phases of a step and the device pool's peak in
//! each (`PhaseMeter`), what the run knows of its memory (`MemoryWatch`: the preflight's
//! forecast as plain numbers, the capacity, the load peak), the bytes the CPU accounting
//! holds outside the steps, and an allocation failure turned into the diagnosis.

use super::session::Session;
use crate::model::Model;
use crate::ops::pool;
use candle_core::{Device, Result};
use std::path::PathBuf;

/// Bytes in a GiB, as a float (the log's and bench's figures).
pub(crate) const GIB: f64 = (1u64 << 30) as f64;

/// The phases of a training step, in order.
pub(crate) const PHASES: [&str; 4] = ["forward", "head", "backward", "optimizer"];

/// Per-phase peaks of the device pool over a run's steps (CUDA), and which phase a step is
/// in (everywhere, for OOM reports). On the CPU it only tracks the phase: no cost.
#[derive(Debug, Clone, Default)]
pub(crate) struct PhaseMeter {
    /// The pool's high-water mark in each phase (bytes), over the steps since `take`.
    pub(crate) peaks: std::collections::BTreeMap<&'static str, u64>,
    /// The last phase that ended in the current step (None: in the forward).
    pub(crate) done: Option<&'static str>,
    /// The peak of the whole run so far (bytes).
    pub(crate) run_peak: u64,
    /// The pool's reserved high-water mark over the run so far (bytes).
    pub(crate) run_reserved: u64,
    /// What was in use at each phase's last end (bytes).
    pub(crate) ends: std::collections::BTreeMap<&'static str, u64>,
}

impl PhaseMeter {
    /// A step begins: the peak counter restarts.
    pub(crate) fn begin(&mut self, dev: &Device) -> Result<()> {
        self.done = None;
        if dev.is_cpu() {
            return Ok(());
        }
        pool::reset_peak(dev)
    }

    /// `phase` ended: record its peak and restart the counter. Without waiting for the
    /// device: the pool's counters follow the host's stream-ordered allocations and frees as
    /// they are asked for, not as the device reaches them, so the peak read at once is the
    /// phase's own (and a wait would drain the device's queue at every phase of every step).
    pub(crate) fn end(&mut self, dev: &Device, phase: &'static str) -> Result<()> {
        self.done = Some(phase);
        if dev.is_cpu() {
            return Ok(());
        }
        if let Some(s) = pool::stats(dev)? {
            let p = self.peaks.entry(phase).or_default();
            *p = (*p).max(s.used_high);
            self.run_peak = self.run_peak.max(s.used_high);
            self.run_reserved = self.run_reserved.max(s.reserved_high);
            self.ends.insert(phase, s.used);
        }
        pool::reset_peak(dev)
    }

    /// The phase a failure happened in: the one after the last that ended.
    pub(crate) fn current(&self) -> &'static str {
        match self.done {
            None => PHASES[0],
            Some(p) => {
                let i = PHASES.iter().position(|x| *x == p).unwrap_or(0);
                PHASES.get(i + 1).copied().unwrap_or("optimizer")
            }
        }
    }

    /// The peaks recorded since the last call, emptied (empty on the CPU).
    pub(crate) fn take(&mut self) -> std::collections::BTreeMap<&'static str, u64> {
        std::mem::take(&mut self.peaks)
    }
}

/// What a run knows about its memory: the plan's forecast, the capacity, the load peak.
#[derive(Debug, Clone, Default)]
pub(crate) struct MemoryWatch {
    /// This process's rank (0 until DDP / FSDP set it).
    pub(crate) rank: usize,
    /// The plan's row for this run's strategy and checkpointing (`memory::forecast`).
    pub(crate) forecast: Option<Forecast>,
    /// Remedies for when it does not fit (from the plan).
    pub(crate) remedies: Vec<String>,
    /// Bytes the run may use per rank: train.max_memory, else the card's memory.
    pub(crate) capacity: Option<u64>,
    /// The device pool's peak while loading (CUDA).
    pub(crate) load_peak: Option<u64>,
    /// Seconds the model and data took to load (the run's start to its first step).
    pub(crate) load_s: f64,
}

/// The memory plan's row for a run, as the diagnosis and the loop read it (bytes; made from the
/// plan's `Breakdown` by `memory::forecast`).
#[derive(Debug, Clone, Default)]
pub(crate) struct Forecast {
    /// The row's name (strategy, ranks, checkpointing), as the plan prints it.
    pub(crate) label: String,
    /// The micro-batch the row is for.
    pub(crate) micro_batch: usize,
    /// Everything the run needs per rank.
    pub(crate) total: u64,
    /// The device pool's forecast peak.
    pub(crate) pool_peak: u64,
    /// The phase of that peak.
    pub(crate) peak_phase: &'static str,
    /// The frozen base.
    pub(crate) base: u64,
    /// The activations kept for the backward.
    pub(crate) activations: u64,
    /// The transient working set.
    pub(crate) transient: u64,
    /// Pairs of parked gate and up in flight (ckpt mlp) the plan fits.
    pub(crate) park_pending: usize,
}

/// What the CPU accounting under `train.max_memory` holds outside the steps (train and probe
/// alike): the model's tensors (`model_bytes`) and three more times the adapters' f32 bytes
/// (their gradients, AdamW's m and v).
pub(crate) fn cpu_fixed_bytes(m: &Model) -> u64 {
    let lora: u64 = m
        .adapters()
        .flat_map(|(_, l)| l.vars())
        .map(|v| crate::ops::tensor_bytes(v.as_tensor()))
        .sum();
    model_bytes(m) + 3 * lora
}

/// Bytes of the model's tensors (base, norms, head once when tied, adapters).
pub(crate) fn model_bytes(m: &Model) -> u64 {
    use crate::ops::tensor_bytes as b;
    let mut sum = b(&m.embed) + b(&m.norm) + if m.tied { 0 } else { b(&m.lm_head) };
    for l in &m.layers {
        sum += b(&l.input_norm) + b(&l.post_norm);
        sum += l.nf4_bytes() as u64;
        // a MoE layer's router and experts, and the experts' adapters
        if let Some(moe) = &l.moe {
            // (NF4 experts: placeholders here, their arrays in `nf4_bytes`)
            sum += moe.stored().into_iter().map(b).sum::<u64>();
            for (_, lora) in moe.adapters() {
                sum += lora.vars().iter().map(|v| b(v.as_tensor())).sum::<u64>();
            }
        }
        for lin in l.linears() {
            // W's whole buffer: folded, its pad columns too (ops::fold); NF4, a placeholder
            sum += super::flat::storage_bytes(&lin.w) as u64;
            sum += lin.b.as_ref().map(b).unwrap_or(0);
            if let Some(lora) = &lin.lora {
                sum += lora.vars().iter().map(|v| b(v.as_tensor())).sum::<u64>();
            }
        }
    }
    sum
}

impl Session {
    /// The diagnosis of an allocation failure: rank, phase, step, peak vs capacity, the
    /// forecast and remedies.
    pub(crate) fn out_of_memory(
        &self,
        e: &anyhow::Error,
        meter: &PhaseMeter,
        step: Option<(usize, usize)>,
        last_checkpoint: Option<PathBuf>,
    ) -> anyhow::Error {
        let dev = &self.model.device;
        let peak = match pool::stats(dev).ok().flatten() {
            Some(s) => Some(s.used_high.max(meter.run_peak)),
            None => pool::cpu_high(),
        };
        let capacity = self.memory.capacity.or(if dev.is_cpu() {
            self.run.max_memory
        } else {
            None
        });
        super::stop::OutOfMemory {
            rank: self.memory.rank,
            phase: meter.current(),
            step: step.map(|s| s.0),
            total: step.map(|s| s.1).unwrap_or(0),
            peak,
            capacity,
            forecast: self.memory.forecast.clone(),
            remedies: self.memory.remedies.clone(),
            last_checkpoint,
            cause: format!("{e:#}"),
        }
        .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::tensor_bytes;

    /// A random tiny model (f32, CPU), its head tied; adapters of rank 2 on `targets`.
    fn tiny(targets: &[&str]) -> Model {
        let mut cfg = crate::model::shapes::shape("tiny").unwrap();
        cfg.tie_word_embeddings = Some(true);
        let spec = crate::lora::LoraSpec {
            rank: 2,
            alpha: 4.0,
            dropout: 0.0,
            rslora: false,
            dora: false,
            targets: targets.iter().map(|t| t.to_string()).collect(),
        };
        let dev = candle_core::Device::Cpu;
        Model::random(cfg, candle_core::DType::F32, &dev, &spec, 1).unwrap()
    }

    /// The CPU budget's fixed bytes hold a tied head once (the embedding's tensor: untying the
    /// same model adds exactly the head's bytes) and the adapters four times (weights,
    /// gradients, AdamW's m and v).
    #[test]
    fn the_cpu_budget_counts_a_tied_head_once_and_the_adapters_four_times() {
        let mut m = tiny(&[]);
        assert!(m.tied);
        let tied = cpu_fixed_bytes(&m);
        (m.tied, m.lm_head) = (false, m.embed.copy().unwrap());
        assert_eq!(cpu_fixed_bytes(&m), tied + tensor_bytes(&m.lm_head));

        let a = tiny(&["q_proj", "v_proj"]);
        let adapters: u64 = a
            .adapters()
            .flat_map(|(_, l)| l.vars())
            .map(|v| tensor_bytes(v.as_tensor()))
            .sum();
        // tiny: 4 layers, q and v [256 → 256], A [2, 256] and B [256, 2] each, f32
        assert_eq!(adapters, 4 * 2 * (2 * 256 + 256 * 2) * 4);
        assert_eq!(cpu_fixed_bytes(&a), tied + 4 * adapters);
    }
}
