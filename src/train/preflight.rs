//! Memory before and during a run: the plan's forecast checked against what the run has
//! before any weight is read (`preflight`), and an allocation failure turned into the
//! diagnosis (rank, phase, step, peak vs capacity, forecast, remedies).

use super::run_config::RunConfig;
use super::session::Session;
use super::{stop, RunOptions};
use crate::memory::plan::Breakdown;
use crate::model::{device, Model};
use crate::recipe::{Checkpointing, Strategy};
use anyhow::Result;
use std::path::PathBuf;

/// What a run knows about its memory: the plan's forecast, the capacity, the load peak.
#[derive(Debug, Clone, Default)]
pub(crate) struct MemoryWatch {
    /// This process's rank (0 until DDP / FSDP set it).
    pub(crate) rank: usize,
    /// The plan's row for this run's strategy and checkpointing.
    pub(crate) forecast: Option<crate::memory::plan::Breakdown>,
    /// Remedies for when it does not fit (from the plan).
    pub(crate) remedies: Vec<String>,
    /// Bytes the run may use per rank: train.max_memory, else the card's memory.
    pub(crate) capacity: Option<u64>,
    /// The device pool's peak while loading (CUDA).
    pub(crate) load_peak: Option<u64>,
    /// Seconds the model and data took to load (the run's start to its first step).
    pub(crate) load_s: f64,
}

/// The memory plan of a run, checked against what it has: on CUDA train.max_memory or the
/// card's free memory, on the CPU train.max_memory (the accounting's cap). Returns the run's
/// memory watch and, on CUDA with max_memory, the ballast to hold while training.
pub(crate) fn preflight(
    run: &RunConfig,
    opts: &RunOptions,
    ordinal: usize,
) -> Result<(MemoryWatch, Option<crate::memory::Ballast>)> {
    use crate::memory::plan;
    let input = plan::PlanInput {
        host: crate::memory::host_available(),
        ..run.plan_input(run.world())
    };
    let (capacity, source) = capacity_of(run, ordinal)?;
    let selected = (run.strategy, run.ckpt);
    let (p, forecast) = plan_within_host(run, &input, capacity, selected);
    note_offload(forecast.as_ref());
    let remedies = plan::remedies(&p, selected);
    let host = host_does_not_fit(&input, &p, selected, forecast.as_ref(), capacity, &remedies);
    if let Some(e) =
        does_not_fit(&p, selected, forecast.as_ref(), capacity, source, &remedies).or(host)
    {
        if !opts.force {
            return Err(e.into());
        }
        crate::errln!(
            "warning (--force): {}",
            e.to_string().lines().next().unwrap_or("")
        );
    }
    let ballast = match (run.cuda(), run.max_memory) {
        (true, Some(m)) => hold_max_memory(run, ordinal, m)?,
        _ => None,
    };
    let capacity = capacity.or_else(|| ballast.as_ref().map(|b| b.total));
    Ok((
        MemoryWatch {
            rank: 0,
            forecast,
            remedies,
            capacity,
            load_peak: None,
            load_s: 0.0,
        },
        ballast,
    ))
}

/// Bytes the run may use per rank, and where the figure comes from: train.max_memory, else
/// on CUDA the card's free memory (None where unknown); on the CPU the least of
/// train.max_memory and the host memory this process can get (`memory::host`), shared by
/// its ranks.
fn capacity_of(run: &RunConfig, ordinal: usize) -> Result<(Option<u64>, String)> {
    let max_memory = run.max_memory;
    if !run.cuda() {
        let host = crate::memory::host::probe().map_err(anyhow::Error::msg)?;
        return Ok(cpu_capacity(max_memory, host, run.world()));
    }
    let dev = device::open(run.device, ordinal)?;
    crate::memory::keep_pool_memory(&dev)?;
    let info = crate::memory::mem_info(&dev)?;
    Ok(match (max_memory, info) {
        (Some(m), _) => (Some(m), "train.max_memory".to_string()),
        // The context the plan counts is already out of `free`: add it back.
        (None, Some((free, _))) => (
            Some(free + crate::memory::plan::CONTEXT),
            format!("cuda:{ordinal} (free memory + this process's context)"),
        ),
        (None, None) => (None, String::new()),
    })
}

/// A CPU run's capacity per rank of `world` (threads of this process): train.max_memory
/// where it is set and within the host's share, else the host's share; None where neither
/// is known.
fn cpu_capacity(
    max_memory: Option<u64>,
    host: Option<crate::memory::host::HostMemory>,
    world: usize,
) -> (Option<u64>, String) {
    let accounting = "train.max_memory (CPU accounting)".to_string();
    let Some(h) = host else {
        return (max_memory, accounting);
    };
    let world = world.max(1);
    let share = h.limit / world as u64;
    match max_memory {
        Some(m) if m <= share => (Some(m), accounting),
        _ if world > 1 => (
            Some(share),
            format!(
                "the host memory of this process ({}), shared by {world} ranks,",
                h.source
            ),
        ),
        _ => (
            Some(share),
            format!("the host memory of this process ({})", h.source),
        ),
    }
}

/// The plan of `input` within `capacity` and its row for the run (`selected`); planned
/// without offload where the host cannot pin the row's parked gate and up.
fn plan_within_host(
    run: &RunConfig,
    input: &crate::memory::plan::PlanInput,
    capacity: Option<u64>,
    selected: (Strategy, Checkpointing),
) -> (crate::memory::plan::Plan, Option<Breakdown>) {
    use crate::memory::plan;
    let grad_accum = run.batch.grad_accum;
    let mut p = plan::plan(input, grad_accum, capacity);
    let mut forecast = plan::row(&p, selected.0, selected.1).map(|r| r.b.clone());
    // Parked gate and up must fit the host's memory beside the other ranks' (on this host):
    // else the MLP half is recomputed, as with train.offload_activations = false.
    let ranks = run.devices.len();
    if let (Some(b), Some(avail)) = (
        forecast.as_ref().filter(|b| b.park_pending > 0),
        crate::memory::host_available(),
    ) {
        if !crate::memory::host_fits(b.host, ranks, avail) {
            crate::errln!(
                "activation offload: gate and up would pin {} of host memory per rank ({ranks} \
                 on this host), {} is available: the MLP half is recomputed instead",
                plan::fmt_bytes(b.host),
                plan::fmt_bytes(avail)
            );
            let input = plan::PlanInput {
                offload: false,
                ..input.clone()
            };
            p = plan::plan(&input, grad_accum, capacity);
            forecast = plan::row(&p, selected.0, selected.1).map(|r| r.b.clone());
        }
    }
    (p, forecast)
}

/// Says on stderr what the run's row parks in pinned host memory, if anything.
fn note_offload(forecast: Option<&Breakdown>) {
    if let Some(b) = forecast.filter(|b| b.host > 0) {
        let what = match b.ckpt {
            Checkpointing::Off => "each layer's residual waits",
            Checkpointing::Mlp => "each layer's gate and up wait (but the top layers')",
            Checkpointing::Full => "each layer's input waits",
        };
        crate::errln!(
            "activation offload: {what} in pinned host memory, {} per rank \
             (train.offload_activations = false recomputes instead)",
            crate::memory::plan::fmt_bytes(b.host)
        );
    }
}

/// The diagnosis where the run's row (`forecast`) needs more than the capacity (`source`
/// says where it comes from); None where it fits or either is unknown.
fn does_not_fit(
    p: &crate::memory::plan::Plan,
    selected: (Strategy, Checkpointing),
    forecast: Option<&Breakdown>,
    capacity: Option<u64>,
    source: String,
    remedies: &[String],
) -> Option<stop::DoesNotFit> {
    let (cap, b) = (capacity?, forecast?);
    (b.total > cap).then(|| stop::DoesNotFit {
        forecast: b.clone(),
        capacity: cap,
        capacity_source: source,
        table: crate::memory::plan::render(p, selected),
        remedies: remedies.to_vec(),
        host: None,
    })
}

/// The diagnosis where the host cannot pin what the run's row (`forecast`) parks (residuals
/// or layer inputs, which the run parks as train.offload_activations says; a parked MLP half
/// is planned without parking instead, `plan_within_host`); None where it can or the host is
/// unknown.
fn host_does_not_fit(
    input: &crate::memory::plan::PlanInput,
    p: &crate::memory::plan::Plan,
    selected: (Strategy, Checkpointing),
    forecast: Option<&Breakdown>,
    capacity: Option<u64>,
    remedies: &[String],
) -> Option<stop::DoesNotFit> {
    let (b, free) = (forecast?, input.host?);
    (b.host > 0 && !input.host_fits(b)).then(|| {
        let mut remedies = remedies.to_vec();
        remedies.insert(
            0,
            "train.offload_activations = false (recomputes instead of parking)".into(),
        );
        stop::DoesNotFit {
            forecast: b.clone(),
            capacity: capacity.unwrap_or(0),
            capacity_source: "the host".into(),
            table: crate::memory::plan::render(p, selected),
            remedies,
            host: Some(free),
        }
    })
}

/// The ballast that leaves train.max_memory = `m` of the card to the pool (None where
/// nothing is held), said on stderr.
fn hold_max_memory(
    run: &RunConfig,
    ordinal: usize,
    m: u64,
) -> Result<Option<crate::memory::Ballast>> {
    use crate::memory::plan::fmt_bytes;
    let dev = device::open(run.device, ordinal)?;
    let ballast = crate::memory::hold_ballast(&dev, m)?;
    match &ballast {
        Some(b) if b.bytes > 0 => crate::errln!(
            "train.max_memory = {}: holding {} of the card's {} outside the pool",
            fmt_bytes(m),
            fmt_bytes(b.bytes),
            fmt_bytes(b.total)
        ),
        Some(b) => crate::errln!(
            "warning: train.max_memory = {}, but less than that is free on the card ({} in all): nothing held back",
            fmt_bytes(m),
            fmt_bytes(b.total)
        ),
        None => {}
    }
    Ok(ballast)
}

/// What the CPU accounting under `train.max_memory` holds outside the steps (train and probe
/// alike): the model's tensors (`model_bytes`) and three more times the adapters' f32 bytes
/// (their gradients, AdamW's m and v).
pub(crate) fn cpu_fixed_bytes(m: &Model) -> u64 {
    let lora: u64 = m
        .adapters()
        .flat_map(|(_, l)| l.vars())
        .map(|v| crate::memory::tensor_bytes(v.as_tensor()))
        .sum();
    model_bytes(m) + 3 * lora
}

/// Bytes of the model's tensors (base, norms, head once when tied, adapters).
pub(crate) fn model_bytes(m: &Model) -> u64 {
    use crate::memory::tensor_bytes as b;
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
        meter: &crate::memory::PhaseMeter,
        step: Option<(usize, usize)>,
        last_checkpoint: Option<PathBuf>,
    ) -> anyhow::Error {
        let dev = &self.model.device;
        let peak = match crate::memory::stats(dev).ok().flatten() {
            Some(s) => Some(s.used_high.max(meter.run_peak)),
            None => crate::memory::cpu_high(),
        };
        let capacity = self.memory.capacity.or(if dev.is_cpu() {
            self.run.max_memory
        } else {
            None
        });
        stop::OutOfMemory {
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
    use crate::memory::tensor_bytes;

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
