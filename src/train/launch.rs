//! Starting a run's ranks, for `train` and `bench` alike: world 1 on this thread, one thread
//! per device (CPU "devices" are virtual ranks; GPUs talk through NCCL, a communicator each),
//! or this process as one rank of a job that torchrun / mpirun / Slurm started (RANK,
//! WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: `parallel::launch::EnvRank`).

use super::preflight::preflight;
use super::session::Session;
use super::{checkpoint, stop, RunOptions, RunSummary};
use crate::export;
use crate::parallel::launch::EnvRank;
use crate::parallel::{Comm, Group, Solo};
use crate::recipe::{DeviceKind, Recipe, RecipeError, Resume, Strategy};
use anyhow::{Context, Result};
use std::sync::Arc;
use std::time::Duration;

/// Where a run's ranks are.
#[derive(Debug, Clone)]
pub enum Ranks {
    /// One rank, world 1, on this thread; the CUDA ordinal (ignored on the CPU).
    Solo(usize),
    /// One rank per listed device, a thread each: CUDA ordinals, or virtual CPU ranks.
    Threads { cuda: bool, devices: Vec<usize> },
    /// This process is one rank of a job its launcher started.
    Process(EnvRank),
}

/// One rank's work: (its communicator, its CUDA ordinal) → its result.
pub type RankBody<T> = dyn Fn(Box<dyn Comm>, usize) -> Result<T> + Send + Sync;

/// Runs `body` on every rank; rank 0's result is the run's. A failing rank brings the others
/// down (their collectives abort) and the run reports the first failure with its rank.
/// `timeout`: how long a rank waits in a collective, and for a stuck rank after a failure.
pub fn launch<T: Send + 'static>(
    ranks: Ranks,
    timeout: Duration,
    body: Arc<RankBody<T>>,
) -> Result<T> {
    match ranks {
        Ranks::Solo(ordinal) => body(Box::new(Solo), ordinal),
        Ranks::Process(e) => {
            let comm = env_comm(&e, timeout)?;
            body(comm, e.local).with_context(|| format!("rank {} of {} failed", e.rank, e.world))
        }
        Ranks::Threads { cuda, devices } => {
            let group: Arc<dyn Group> = match cuda {
                false => crate::parallel::cpu::CpuGroup::new(devices.len(), timeout),
                true => nccl_group(devices.clone(), timeout)?,
            };
            let per_rank = move |rank: usize, comm: Box<dyn Comm>| body(comm, devices[rank]);
            // After a failure the others' collectives fail at once; a rank stuck outside them
            // is not waited for long (the process ends with the run).
            let grace = timeout.min(crate::parallel::STOP_GRACE);
            crate::parallel::launch::threads(group, Arc::new(per_rank), grace)
        }
    }
}

impl Ranks {
    /// The ranks a recipe asks for, or the launcher's when RANK / WORLD_SIZE are set. Checks
    /// that this binary can run them (CUDA, NCCL): `check` and `plan` need no such build.
    pub fn for_recipe(recipe: &Recipe) -> Result<Ranks> {
        let p = &recipe.parallel;
        let cuda = recipe.model.device == DeviceKind::Cuda;
        recipe.check_build()?;
        if let Some(e) = EnvRank::from_env(&|k| std::env::var(k).ok())? {
            if p.strategy == Strategy::Single {
                return Err(invalid(recipe, "parallel.strategy", format!("= \"single\", but the launcher started {} ranks (WORLD_SIZE): use \"ddp\" or \"fsdp\"", e.world)));
            }
            if !cuda {
                anyhow::bail!(
                    "RANK / WORLD_SIZE are set (world {}), but model.device = \"cpu\": CPU ranks are threads of one process; run `lora-train` once with parallel.devices listing {} ranks",
                    e.world,
                    e.world
                );
            }
            return Ok(Ranks::Process(e));
        }
        if p.strategy == Strategy::Single {
            return Ok(Ranks::Solo(p.devices.first().copied().unwrap_or(0)));
        }
        let devices = match cuda {
            true => cuda_ordinals(recipe)?,
            false => p.devices.clone(),
        };
        Ok(Ranks::Threads { cuda, devices })
    }
}

fn invalid(recipe: &Recipe, key: &str, msg: impl Into<String>) -> anyhow::Error {
    RecipeError::Invalid {
        path: recipe.source.clone(),
        key: key.into(),
        msg: msg.into(),
    }
    .into()
}

#[cfg(feature = "nccl")]
fn cuda_ordinals(recipe: &Recipe) -> Result<Vec<usize>> {
    crate::parallel::nccl::ordinals(recipe)
}

#[cfg(not(feature = "nccl"))]
fn cuda_ordinals(recipe: &Recipe) -> Result<Vec<usize>> {
    Ok(recipe.parallel.devices.clone())
}

#[cfg(feature = "nccl")]
fn nccl_group(devices: Vec<usize>, timeout: Duration) -> Result<Arc<dyn Group>> {
    Ok(crate::parallel::nccl::NcclGroup::new(devices, timeout)?)
}

#[cfg(not(feature = "nccl"))]
fn nccl_group(_: Vec<usize>, _: Duration) -> Result<Arc<dyn Group>> {
    anyhow::bail!(
        "several GPUs need NCCL: rebuild with `cargo install --path . --features cuda,nccl`"
    )
}

#[cfg(feature = "nccl")]
fn env_comm(e: &EnvRank, timeout: Duration) -> Result<Box<dyn Comm>> {
    crate::parallel::nccl::from_env(e, timeout)
}

#[cfg(not(feature = "nccl"))]
fn env_comm(e: &EnvRank, _: Duration) -> Result<Box<dyn Comm>> {
    anyhow::bail!(
        "RANK / WORLD_SIZE are set (world {}), but this binary was built without NCCL: rebuild with `cargo install --path . --features cuda,nccl`",
        e.world
    )
}

/// `lora-train train`: the whole run from a recipe, on the ranks it asks for.
pub fn run_with(recipe: Recipe, opts: &RunOptions) -> Result<RunSummary> {
    let recipe = checkpoint::with_checkpoint_sets(recipe)?;
    let ranks = Ranks::for_recipe(&recipe)?;
    let signal = stop::install_signal_handlers()?;
    let timeout = Duration::from_secs(recipe.parallel.timeout_s);
    let out_dir = recipe.output_dir();
    let stopped = signal.clone();
    // A stop by signal is every rank's orderly end, not a failure that aborts the others:
    // it travels as a value, and rank 0's (which names its checkpoint) is the run's.
    let opts = opts.clone();
    let body = move |comm: Box<dyn Comm>, ordinal: usize| match run_rank(
        recipe.clone(),
        comm,
        ordinal,
        &signal,
        &opts,
    ) {
        Err(e) if e.is::<stop::Interrupted>() => Ok(Err(e)),
        res => res.map(Ok),
    };
    match launch(ranks, timeout, Arc::new(body)) {
        // A failure that a signal caused (ranks stuck in a collective) is the signal's stop.
        Err(e) if stopped.received() && crate::parallel::gave_up_after_signal() => {
            Err(stop::StoppedUnsaved {
                why: format!("{e:#}"),
                last_checkpoint: super::checkpoint_check::scan(&out_dir)
                    .into_iter()
                    .rev()
                    .find(|f| f.state.is_ok())
                    .map(|f| f.dir),
            }
            .into())
        }
        res => res?,
    }
}

/// One rank's run (the whole run when it is the only one); rank 0 prints and writes.
fn run_rank(
    recipe: Recipe,
    comm: Box<dyn Comm>,
    ordinal: usize,
    signal: &stop::StopSignal,
    opts: &RunOptions,
) -> Result<RunSummary> {
    let lead = comm.rank() == 0;
    let out_dir = recipe.output_dir();
    // Which checkpoint to continue from, checked before the model loads.
    let resume = checkpoint::resume_point(&recipe, &out_dir)?;
    match (&resume, &recipe.train.resume) {
        _ if !lead => {}
        (Some(ck), _) => eprintln!(
            "resuming from {} (step {} of {})",
            ck.dir.display(),
            ck.state.step,
            ck.state.total_steps
        ),
        (None, Resume::Flag(true)) => eprintln!(
            "train.resume = true, but {} holds no checkpoint: starting fresh",
            out_dir.display()
        ),
        _ => {}
    }
    // Memory: the plan (config.json only), the capacity, the preflight check, then the
    // ballast that makes a card behave as one of train.max_memory.
    let (mut watch, ballast) = preflight(&recipe, opts, ordinal)?;
    watch.rank = comm.rank();
    let max_memory = recipe.max_memory();
    let t_load = std::time::Instant::now();
    let mut session = match Session::for_rank(recipe, comm, ordinal) {
        Ok(s) => s,
        // Loading the weights did not fit: the same diagnosis as mid-run, phase "load".
        Err(e) if crate::memory::is_oom(&e) => {
            return Err(stop::OutOfMemory {
                rank: watch.rank,
                phase: "load",
                step: None,
                total: 0,
                peak: None,
                capacity: watch.capacity.or(max_memory),
                forecast: watch.forecast.clone(),
                remedies: watch.remedies.clone(),
                last_checkpoint: None,
                cause: format!("{e:#}"),
            }
            .into())
        }
        Err(e) => return Err(e),
    };
    if let Some(s) = crate::memory::stats(&session.model.device)? {
        watch.load_peak = Some(s.used_high);
    }
    session.model.device.synchronize()?;
    watch.load_s = t_load.elapsed().as_secs_f64();
    session.memory = watch;
    if lead {
        announce(&session);
    }
    signal.training();
    let res = session.train_from(&out_dir, resume.as_ref(), &|_| signal.received());
    if res.is_err() && signal.received() {
        signal.wait_announced();
    }
    let summary = res?;
    drop(ballast);
    if lead && session.recipe.output.merge {
        export_merged(&session, &out_dir)?;
    }
    Ok(summary)
}

/// Rank 0's lines about what the run trains: the ranks, the model and adapters, the data.
fn announce(session: &Session) {
    let m = &session.model;
    let nf4: usize = match &session.shards {
        Some(s) => s.nf4_bytes, // the skeleton's are placeholders
        None => m.layers.iter().map(|l| l.nf4_bytes()).sum(),
    };
    let t = &session.load_times;
    let adapters = match (&session.recipe.lora.init_adapter, session.comm.world()) {
        (None, 1) => String::new(),
        (Some(_), 1) => format!(", adapters {:.1}s (lora.init_adapter read)", t.adapters),
        (_, w) => format!(
            ", adapters {:.1}s (read or made, broadcast to {w} ranks)",
            t.adapters
        ),
    };
    eprintln!(
        "loaded in {:.1}s: data {:.1}s ({}), weights {:.1}s (read, cast and uploaded, fresh adapters made{}){adapters}",
        session.memory.load_s,
        t.data,
        session.data.prep.describe(),
        t.weights,
        match (m.kernels.fold, nf4) {
            (true, _) => ", linears padded for the fold".to_string(),
            (false, 0) => String::new(),
            (false, b) => format!(
                ", decoder linears in NF4: {}",
                crate::memory::plan::fmt_bytes(b as u64)
            ),
        }
    );
    let trainable: usize = m
        .adapters()
        .flat_map(|(_, l)| l.vars())
        .map(|v| v.elem_count())
        .sum();
    let world = session.comm.world();
    if world > 1 {
        let p = &session.recipe.parallel;
        let resident = crate::parallel::fsdp::resident_base_bytes(m, session.shards.as_ref());
        eprintln!(
            "{} over {world} ranks (devices {:?}); frozen base resident per rank: {:.1} MB",
            p.strategy.name(),
            p.devices,
            resident as f64 / 1e6
        );
    }
    {
        eprintln!(
        "model {} ({:?}, {} layers, {:.1}M params, {:?} on {:?}); LoRA r={} alpha={} on {}: {} trainable params",
        session.base_name,
        m.cfg.family,
        m.cfg.num_layers,
        m.cfg.num_params(m.tied) as f64 / 1e6,
        m.dtype,
        m.device.location(),
        session.spec.rank,
        session.spec.alpha,
        session.spec.targets.join(","),
        trainable
    );
        eprintln!(
            "data {}: {} examples ({} truncated to seq_len {}), {} steps",
            session.data.source.display(),
            session.data.examples.len(),
            session.data.truncated,
            session.recipe.data.seq_len,
            session.total_steps()
        );
        for note in &session.data_notes {
            eprintln!("{note}");
        }
    }
}

/// `[output] merge = true`: the adapter merged into the base, in `out_dir/merged`.
fn export_merged(session: &Session, out_dir: &std::path::Path) -> Result<()> {
    let size = session.recipe.output.max_shard_size.as_deref();
    let opts = export::merge::MergeOptions {
        dtype: None,
        max_shard_size: crate::util::parse_size(
            size.unwrap_or(export::merge::DEFAULT_MAX_SHARD_SIZE),
        )
        .map_err(|m| anyhow::anyhow!("output.max_shard_size {m}"))?,
        replace: true,
        merge_into: session.recipe.output.merge_into,
        double_quant: session.recipe.model.double_quant,
        // NF4 weights as training made them: quantized from, and dequantized to, the run's
        // dtype.
        quantize_dtype: match session.model.dtype {
            candle_core::DType::BF16 => Some(crate::recipe::Dtype::Bf16),
            candle_core::DType::F16 => Some(crate::recipe::Dtype::F16),
            _ => Some(crate::recipe::Dtype::F32),
        },
    };
    let rep = export::merge::merge(out_dir, &session.base_dir, &out_dir.join("merged"), &opts)
        .context("cannot write the merged model (output.merge = true)")?;
    eprintln!(
        "merged model written to {} ({} tensors, {} with the adapter merged in, {} shard(s){})",
        rep.out.display(),
        rep.tensors,
        rep.merged,
        rep.shards,
        match rep.merged_into {
            "base" => String::new(),
            _ => format!(
                "; into the NF4 base dequantized, {} linears",
                rep.dequantized
            ),
        }
    );
    Ok(())
}
