//! Memory before a run: the plan's forecast checked against what the run has before any
//! weight is read (`preflight`; `DoesNotFit` where it does not fit), the ballast of
//! train.max_memory held, and the forecast handed to the run's memory watch as plain numbers
//! (train::meter turns an allocation failure into the diagnosis).

use super::RunOptions;
use crate::memory::plan::Breakdown;
use crate::model::device;
use crate::recipe::{Checkpointing, Strategy};
use crate::train::meter::MemoryWatch;
use crate::train::RunConfig;
use crate::util::fmt_bytes;
use anyhow::Result;

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
            forecast: forecast.as_ref().map(crate::memory::forecast),
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
    crate::ops::pool::keep_pool_memory(&dev)?;
    let info = crate::ops::pool::mem_info(&dev)?;
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
            crate::util::fmt_bytes(b.host)
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
) -> Option<DoesNotFit> {
    let (cap, b) = (capacity?, forecast?);
    (b.total > cap).then(|| DoesNotFit {
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
) -> Option<DoesNotFit> {
    let (b, free) = (forecast?, input.host?);
    (b.host > 0 && !input.host_fits(b)).then(|| {
        let mut remedies = remedies.to_vec();
        remedies.insert(
            0,
            "train.offload_activations = false (recomputes instead of parking)".into(),
        );
        DoesNotFit {
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
    use crate::util::fmt_bytes;
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

/// Preflight: the plan's forecast for this run exceeds the memory available. Nothing has
/// been loaded or written.
#[derive(Debug)]
pub struct DoesNotFit {
    /// The run's row of the plan.
    pub(crate) forecast: crate::memory::plan::Breakdown,
    pub(crate) capacity: u64,
    /// Where the capacity comes from, e.g. "train.max_memory" or "free memory of cuda:0".
    pub(crate) capacity_source: String,
    /// The whole plan, as `lora-train plan` prints it.
    pub(crate) table: String,
    pub(crate) remedies: Vec<String>,
    /// Where it is the host that cannot pin the row's parked activations: the host memory
    /// free (of which three quarters may be pinned).
    pub(crate) host: Option<u64>,
}

impl std::fmt::Display for DoesNotFit {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let b = &self.forecast;
        match self.host {
            Some(free) => writeln!(
                f,
                "the memory plan says this run does not fit the host: {} parks {} of pinned \
                 host memory per rank ({} ranks), the host has {} free, of which three \
                 quarters may be pinned",
                crate::memory::plan::label(b),
                fmt_bytes(b.host),
                b.world,
                fmt_bytes(free)
            )?,
            None => writeln!(
                f,
                "the memory plan says this run does not fit: {} needs {} per rank, {} has {}",
                crate::memory::plan::label(b),
                fmt_bytes(b.total),
                self.capacity_source,
                fmt_bytes(self.capacity)
            )?,
        }
        writeln!(
            f,
            "  forecast: base {}, adapters + grads + AdamW {}, activations {}, transient {}, fsdp gather {}, context + slack {} (peak in {})",
            fmt_bytes(b.base),
            fmt_bytes(b.lora_state()),
            fmt_bytes(b.activations),
            fmt_bytes(b.transient),
            fmt_bytes(b.gather),
            fmt_bytes(b.outside_pool()),
            b.peak_phase
        )?;
        for l in self.table.lines() {
            writeln!(f, "  | {l}")?;
        }
        writeln!(f, "  remedies: {}", self.remedies.join("; "))?;
        write!(f, "  (pass --force to start anyway)")
    }
}

impl std::error::Error for DoesNotFit {}
