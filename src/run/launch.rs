//! Starting a run's ranks, for `train` and `bench` alike: world 1 on this thread, one thread
//! per device (CPU "devices" are virtual ranks; GPUs talk through NCCL, a communicator each),
//! or this process as one rank of a job that torchrun / mpirun / Slurm started (RANK,
//! WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: `train::EnvRank`; GPU ranks
//! talk NCCL, CPU ranks TCP through rank 0). docs/multi-node.md shows the launches.

use super::preflight::preflight;
use super::resolve::Machine;
use super::{checkpoint, RunOptions, RunSummary};
use crate::export;
use crate::parallel::backend::{cuda_ordinals, env_comm, nccl_group, tcp_group};
use crate::parallel::{CommError, Group};
use crate::recipe::{DeviceKind, Recipe, Resume, Strategy};
use crate::train::run_config::{MergePlan, RunConfig};
use crate::train::stop;
use crate::train::{Comm, EnvRank, Ranks, Session, Solo, TrainData};
use anyhow::{Context, Result};
use std::sync::Arc;
use std::time::Duration;

/// One rank's work: (its communicator, its CUDA ordinal) → its result.
pub(crate) type RankBody<T> = dyn Fn(Box<dyn Comm>, usize) -> Result<T> + Send + Sync;

/// Runs `body` on every rank; rank 0's result is the run's. A failing rank brings the others
/// down (their collectives abort) and the run reports the first failure with its rank.
/// `timeout`: how long a rank waits in a collective, and for a stuck rank after a failure.
pub(crate) fn launch<T: Send + 'static>(
    ranks: Ranks,
    timeout: Duration,
    body: Arc<RankBody<T>>,
) -> Result<T> {
    match ranks {
        Ranks::Solo(ordinal) => body(Box::new(Solo), ordinal),
        Ranks::Process { cuda: true, env: e } => {
            let comm = env_comm(&e, timeout)?;
            body(comm, e.local).with_context(|| format!("rank {} of {} failed", e.rank, e.world))
        }
        Ranks::Process {
            cuda: false,
            env: e,
        } => {
            let group = tcp_group(&e, timeout)?;
            crate::parallel::launch::process(group, e.rank, |comm| body(comm, e.local))
        }
        Ranks::Threads { cuda, devices } => {
            let group: Arc<dyn Group> = match cuda {
                false => crate::parallel::cpu::CpuGroup::new(devices.len(), timeout),
                true => nccl_group(devices.clone(), timeout)?,
            };
            let per_rank = move |rank: usize, comm: Box<dyn Comm>| body(comm, devices[rank]);
            // After a failure the others' collectives fail at once; a rank stuck outside them
            // is not waited for long (the process ends with the run).
            let grace = timeout.min(crate::util::signal::STOP_GRACE);
            crate::parallel::launch::threads(group, Arc::new(per_rank), grace)
        }
    }
}

impl Ranks {
    /// The ranks a recipe asks for, or the launcher's when RANK / WORLD_SIZE are set. Checks
    /// that this binary can run them (CUDA, NCCL): `check` and `plan` need no such build.
    pub(crate) fn for_recipe(recipe: &Recipe) -> Result<Ranks> {
        let p = &recipe.parallel;
        let cuda = recipe.model.device == DeviceKind::Cuda;
        recipe.check_build()?;
        if let Some(e) = EnvRank::from_env(&|k| std::env::var(k).ok())? {
            if p.strategy == Strategy::Single {
                return Err(recipe.invalid("parallel.strategy", format!("= \"single\", but the launcher started {} ranks (WORLD_SIZE): use \"ddp\" or \"fsdp\"", e.world)).into());
            }
            return Ok(Ranks::Process { cuda, env: e });
        }
        if p.strategy == Strategy::Single {
            return Ok(Ranks::Solo(p.devices.first().copied().unwrap_or(0)));
        }
        let devices = match cuda {
            true => cuda_ordinals(&p.devices)
                .map_err(|e| recipe.invalid("parallel.devices", format!("{e:#}")))?,
            false => p.devices.clone(),
        };
        Ok(Ranks::Threads { cuda, devices })
    }
}

/// `lora-train train`: the whole run from a recipe, on the ranks it asks for.
pub fn run_with(recipe: Recipe, opts: &RunOptions) -> Result<RunSummary> {
    let _owner = super::owner::own_output_dir(&recipe)?;
    let recipe = checkpoint::with_checkpoint_sets(recipe)?;
    let run = Arc::new(RunConfig::resolve(recipe, Machine::Open)?);
    let signal = stop::install_signal_handlers()?;
    let out_dir = run.output.dir.clone();
    let stopped = signal.clone();
    // A stop by signal is every rank's orderly end, not a failure that aborts the others:
    // it travels as a value, and rank 0's (which names its checkpoint) is the run's.
    let opts = opts.clone();
    let (ranks, timeout) = (run.ranks.clone(), run.timeout);
    let lead_of_many = match &ranks {
        Ranks::Solo(_) => false,
        Ranks::Threads { devices, .. } => devices.len() > 1,
        Ranks::Process { env, .. } => env.rank == 0,
    };
    let body = move |comm: Box<dyn Comm>, ordinal: usize| match run_rank(
        run.clone(),
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
        Err(e) if stopped.received() && crate::util::signal::gave_up_after_signal() => {
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
        // A rank failed or went missing: rank 0 names the checkpoint to resume from.
        Err(e) if lead_of_many && e.chain().any(|c| c.is::<CommError>()) => {
            match super::checkpoint_check::scan(&out_dir)
                .into_iter()
                .rev()
                .find(|f| f.state.is_ok())
            {
                Some(f) => Err(RankLost {
                    cause: e,
                    last: f.dir,
                }
                .into()),
                None => Err(e),
            }
        }
        res => res?,
    }
}

/// A run of several ranks that a rank's failure ended, and its last complete checkpoint.
#[derive(Debug, thiserror::Error)]
#[error("{cause:#}\nthe last complete checkpoint is {}: once every rank can run, resume from it with --set train.resume=true", .last.display())]
pub struct RankLost {
    /// The run's failure, naming the rank.
    pub cause: anyhow::Error,
    /// The checkpoint directory.
    pub last: std::path::PathBuf,
}

/// Every rank continues from the same step: a rank that sees no checkpoint, or another one,
/// in output.dir (a node without the filesystem rank 0 writes to) would silently train other
/// weights than rank 0.
fn agree_on_resume(s: &Session, resume: Option<&checkpoint::Checkpoint>) -> Result<()> {
    let comm = &*s.comm;
    if comm.world() == 1 {
        return Ok(());
    }
    let mine = resume.map_or(-1.0, |c| c.state.step as f64);
    let t = candle_core::Tensor::new(&[mine], &s.model.device)?;
    let steps = comm.all_gather(&t)?.to_vec1::<f64>()?;
    let what = |x: f64| match x < 0.0 {
        true => "starts fresh".to_string(),
        false => format!("resumes from step {x}"),
    };
    if let Some(r) = steps.iter().position(|&x| x != steps[0]) {
        anyhow::bail!(
            "rank {r} {} but rank 0 {} (output.dir {}): every rank reads the checkpoint that rank 0 wrote, so output.dir must be on a filesystem every node shares, at the same path",
            what(steps[r]),
            what(steps[0]),
            s.run.output.dir.display()
        );
    }
    Ok(())
}

/// One rank's run (the whole run when it is the only one); rank 0 prints and writes.
fn run_rank(
    run: Arc<RunConfig>,
    comm: Box<dyn Comm>,
    ordinal: usize,
    signal: &stop::StopSignal,
    opts: &RunOptions,
) -> Result<RunSummary> {
    let lead = comm.rank() == 0;
    let out_dir = run.output.dir.clone();
    // Which checkpoint to continue from, checked before the model loads.
    let resume = checkpoint::resume_point(&run.recipe, &out_dir)?;
    match (&resume, &run.output.resume) {
        _ if !lead => {}
        (Some(ck), _) => crate::errln!(
            "resuming from {} (step {} of {})",
            ck.dir.display(),
            ck.state.step,
            ck.state.total_steps
        ),
        (None, Resume::Flag(true)) => crate::errln!(
            "train.resume = true, but {} holds no checkpoint: starting fresh",
            out_dir.display()
        ),
        _ => {}
    }
    // Memory: the plan, the capacity, the preflight check, then the ballast that makes a
    // card behave as one of train.max_memory.
    let (mut watch, ballast) = preflight(&run, opts, ordinal)?;
    watch.rank = comm.rank();
    let t_load = std::time::Instant::now();
    let mut session = match Session::load(run.clone(), comm, ordinal) {
        Ok(s) => s,
        // Loading the weights did not fit: the same diagnosis as mid-run, phase "load".
        Err(e) if crate::ops::pool::is_oom(&e) => {
            return Err(stop::OutOfMemory {
                rank: watch.rank,
                phase: "load",
                step: None,
                total: 0,
                peak: None,
                capacity: watch.capacity.or(run.max_memory),
                forecast: watch.forecast.clone(),
                remedies: watch.remedies.clone(),
                last_checkpoint: None,
                cause: format!("{e:#}"),
            }
            .into())
        }
        Err(e) => return Err(e),
    };
    let mut data = TrainData::load_run(&session, resume.is_some())?;
    if let Some(s) = crate::ops::pool::stats(&session.model.device)? {
        watch.load_peak = Some(s.used_high);
    }
    session.model.device.synchronize()?;
    watch.load_s = t_load.elapsed().as_secs_f64();
    session.memory = watch;
    agree_on_resume(&session, resume.as_ref())?;
    if lead {
        announce(&session, &data);
    }
    if run.precompute_ref {
        let store =
            crate::train::pref_precompute::RefStore::load_or_compute(&session, &data, &out_dir)?;
        data.reference = Some(store);
    }
    signal.training();
    let res = session.train_from(&data, &out_dir, resume.as_ref(), &|_| signal.received());
    if res.is_err() && signal.received() {
        signal.wait_announced();
    }
    let summary = res?;
    drop(ballast);
    if let (true, Some(m)) = (lead, run.output.merge) {
        export_merged(&session, &out_dir, m)?;
    }
    Ok(summary)
}

/// Rank 0's lines about what the run trains: the ranks, the model and adapters, the data.
fn announce(session: &Session, data: &TrainData) {
    let (m, run) = (&session.model, &session.run);
    let nf4: usize = match &session.shards {
        Some(s) => s.nf4_bytes, // the skeleton's are placeholders
        None => m.layers.iter().map(|l| l.nf4_bytes()).sum(),
    };
    let t = &session.load_times;
    let adapters = match (&run.init_adapter, session.comm.world()) {
        (None, 1) => String::new(),
        (Some(_), 1) => format!(", adapters {:.1}s (lora.init_adapter read)", t.adapters),
        (_, w) => format!(
            ", adapters {:.1}s (read or made, broadcast to {w} ranks)",
            t.adapters
        ),
    };
    crate::errln!(
        "loaded in {:.1}s: data {:.1}s ({}), weights {:.1}s (read, cast and uploaded, fresh adapters made{}){adapters}",
        session.memory.load_s,
        data.load_s,
        match data.streaming() {
            true => "streaming: tokenizing behind the first steps".to_string(),
            false => data.data().map_or_else(|e| format!("{e:#}"), |d| d.prep.describe()),
        },
        t.weights,
        match (m.kernels.fold, nf4) {
            (true, _) => "; linears padded for the fold".to_string(),
            (false, 0) => String::new(),
            (false, b) => format!(
                "; decoder linears in NF4: {}",
                crate::util::fmt_bytes(b as u64)
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
        let resident = crate::train::shards::resident_base_bytes(m, session.shards.as_ref());
        let whose = match &run.ranks {
            Ranks::Process { env, .. } => {
                format!(
                    "processes of a launcher's job, meeting at port {}",
                    env.port
                )
            }
            _ => format!("devices {:?}", run.devices),
        };
        crate::errln!(
            "{} over {world} ranks ({whose}); frozen base resident per rank: {:.1} MB",
            run.strategy.name(),
            resident as f64 / 1e6
        );
    }
    let spec = &run.spec;
    crate::errln!(
        "model {} ({:?}, {} layers, {:.1}M params, {:?} on {:?}); LoRA r={} alpha={} on {}: {} trainable params",
        run.base_name,
        m.cfg.family,
        m.cfg.num_layers,
        m.cfg.num_params(m.tied) as f64 / 1e6,
        m.dtype,
        m.device.location(),
        spec.rank,
        spec.alpha,
        spec.targets.join(","),
        trainable
    );
    match data.streaming() {
        true => crate::errln!(
            "data {}: streams: the first epoch reads the examples in file order, so each step starts once its rows are tokenized, and the rest tokenize on the other cores into the cache behind it; {} steps (train.max_steps); the counts follow when it is prepared",
            data.cfg.train.describe(),
            data.max_steps.unwrap_or(0)
        ),
        false => {
            if let Ok(r) = data.ready() {
                crate::errln!(
                    "data {}: {} examples ({} truncated to seq_len {}), {} steps",
                    r.data.source.display(),
                    r.data.examples.len(),
                    r.data.truncated,
                    data.cfg.seq_len,
                    data.total_steps().unwrap_or(0)
                );
                for note in &r.notes {
                    crate::errln!("{note}");
                }
            }
        }
    }
}

/// `[output] merge = true`: the adapter merged into the base, in `out_dir/merged`.
fn export_merged(session: &Session, out_dir: &std::path::Path, m: MergePlan) -> Result<()> {
    let base_dir = session
        .base_dir
        .as_ref()
        .context("output.merge needs a base checkpoint to merge into")?;
    let opts = export::merge::MergeOptions {
        dtype: None,
        max_shard_size: m.max_shard_size,
        replace: true,
        merge_into: m.merge_into,
        double_quant: session.run.quant.double_quant,
        // NF4 weights as training made them: quantized from, and dequantized to, the run's
        // dtype.
        quantize_dtype: crate::model::device::recipe_dtype(session.model.dtype),
    };
    let rep = export::merge::merge(out_dir, base_dir, &out_dir.join("merged"), &opts)
        .context("cannot write the merged model (output.merge = true)")?;
    crate::errln!(
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
