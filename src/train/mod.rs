//! `lora-train train`: recipe → model + adapters → data → steps → PEFT adapter.
//!
//! One optimiser step = `grad_accum` micro-batches of `micro_batch` rows. The loss of a step is
//! the mean token cross-entropy over all its counted tokens (not a mean of micro-batch means).

pub mod checkpoint;
pub mod driver;
pub mod eval;
pub mod offload;
pub mod optim;
pub mod readback;
pub mod schedule;
pub mod stop;

use crate::data::chat::ChatTemplate;
use crate::data::{Batch, Dataset, Example, Sampler, TextTokenizer, IGNORE};
use crate::export;
use crate::hub;
use crate::lora::LoraSpec;
use crate::model::Model;
use crate::parallel::fsdp::{Flat, Shards};
use crate::parallel::{Comm, Solo};
use crate::recipe::{
    DataFormat, DataSection, DeviceKind, Dtype, Recipe, RecipeError, Resume, Strategy,
};
use crate::util::atomic_write;
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use checkpoint::{Checkpoint, Cursor, TrainerState};
use driver::Par;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use optim::{AdamW, Grads};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub steps: usize,
    pub losses: Vec<f64>,
    pub out_dir: PathBuf,
    pub tokens: usize,
    pub seconds: f64,
    pub truncated: usize,
    /// The last eval loss (at the end), when there is an eval set.
    pub eval_loss: Option<f64>,
    /// Bad rows skipped (data.on_bad_row = "skip").
    pub skipped: usize,
}

/// Everything a run needs, built from a recipe (model loaded, data read).
pub struct Session {
    pub recipe: Recipe,
    pub model: Model,
    pub spec: LoraSpec,
    pub data: Dataset,
    pub sampler: Sampler,
    pub pad_id: u32,
    pub base_name: String,
    /// The Hub commit the base was read at (None for a local directory).
    pub base_revision: Option<String>,
    /// The eval set (data.eval, or held out by data.eval_fraction).
    pub eval: Option<Dataset>,
    /// What loading the data found worth telling: skipped rows, dropped examples, how
    /// chat turns end.
    pub data_notes: Vec<String>,
    /// This rank's communicator (`Solo` for one device).
    pub comm: Box<dyn Comm>,
    /// FSDP: this rank's shards of the frozen base (the model holds placeholders).
    pub shards: Option<Shards>,
    /// The memory plan and what the run measured at load (for reports and OOM diagnoses).
    pub memory: MemoryWatch,
}

/// What a run knows about its memory: the plan's forecast, the capacity, the load peak.
#[derive(Debug, Clone, Default)]
pub struct MemoryWatch {
    /// This process's rank (0 until DDP / FSDP set it).
    pub rank: usize,
    /// The plan's row for this run's strategy and checkpointing.
    pub forecast: Option<crate::memory::plan::Breakdown>,
    /// Remedies for when it does not fit (from the plan).
    pub remedies: Vec<String>,
    /// Bytes the run may use per rank: train.max_memory, else the card's memory.
    pub capacity: Option<u64>,
    /// The device pool's peak while loading (CUDA).
    pub load_peak: Option<u64>,
}

pub fn device_and_dtype(recipe: &Recipe) -> Result<(Device, DType)> {
    device_and_dtype_on(
        recipe,
        recipe.parallel.devices.first().copied().unwrap_or(0),
    )
}

/// The device (CUDA ordinal `ordinal` when model.device = "cuda") and base dtype.
pub fn device_and_dtype_on(recipe: &Recipe, ordinal: usize) -> Result<(Device, DType)> {
    let dev = match recipe.model.device {
        DeviceKind::Cpu => Device::Cpu,
        DeviceKind::Cuda => {
            missing_ordinal(recipe, ordinal)?;
            Device::new_cuda(ordinal)
                .with_context(|| format!("cannot open CUDA device {ordinal}"))?
        }
    };
    let dtype = match (recipe.model.dtype, recipe.model.device) {
        (Some(Dtype::F32), _) | (None, DeviceKind::Cpu) => DType::F32,
        (Some(Dtype::Bf16), _) | (None, DeviceKind::Cuda) => DType::BF16,
        (Some(Dtype::F16), _) => DType::F16,
    };
    Ok((dev, dtype))
}

/// A CUDA ordinal this machine does not have is a recipe error (parallel.devices).
#[cfg(feature = "cuda")]
fn missing_ordinal(recipe: &Recipe, ordinal: usize) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    let Ok(count) = CudaContext::device_count() else {
        return Ok(()); // opening the device reports the driver's error
    };
    let count = count.max(0) as usize;
    if ordinal < count {
        return Ok(());
    }
    Err(RecipeError::Invalid {
        path: recipe.source.clone(),
        key: "parallel.devices".into(),
        msg: format!(
            "lists device {ordinal}, but this machine has {count} CUDA device(s): list existing ordinals{}",
            if count > 0 { format!(" (0..{})", count - 1) } else { String::new() }
        ),
    }
    .into())
}

#[cfg(not(feature = "cuda"))]
fn missing_ordinal(_: &Recipe, _: usize) -> Result<()> {
    Ok(())
}

impl Session {
    pub fn new(recipe: Recipe) -> Result<Session> {
        let ordinal = recipe.parallel.devices.first().copied().unwrap_or(0);
        Self::for_rank(recipe, Box::new(Solo), ordinal)
    }

    /// The session of rank `comm.rank()` on CUDA device `ordinal` (ignored on the CPU): under
    /// FSDP only this rank's shards of the base stay resident; the adapters are rank 0's.
    pub fn for_rank(recipe: Recipe, comm: Box<dyn Comm>, ordinal: usize) -> Result<Session> {
        let (dev, dtype) = device_and_dtype_on(&recipe, ordinal)?;
        let files = hub::model_files(&recipe.model)?;
        let dir = files.dir.clone();
        let init = match &recipe.lora.init_adapter {
            Some(p) => Some((p.clone(), export::read_adapter_config(p)?)),
            None => None,
        };
        let spec = match &init {
            // The adapter's shape (r, alpha, targets, rslora) comes from its config; dropout is a
            // training setting and comes from the recipe.
            Some((_, info)) => LoraSpec {
                dropout: recipe.lora.dropout as f32,
                ..info.spec.clone()
            },
            None => LoraSpec {
                rank: recipe.lora.rank,
                alpha: recipe.lora.alpha,
                dropout: recipe.lora.dropout as f32,
                rslora: recipe.lora.rslora,
                targets: recipe.target_modules()?,
            },
        };
        let fsdp = recipe.parallel.strategy == Strategy::Fsdp;
        let mut groups = Vec::new();
        // The run's kernels; with them the adapters' forward folded into the base GEMMs
        // (ops::fold), each layer padded before FSDP shards it.
        let head_dim = crate::model::ModelConfig::from_file(&files.config)?.head_dim;
        let det = recipe.train.deterministic;
        let kernels = crate::ops::Kernels::resolve(&dev, dtype, head_dim, det)?;
        let seed = recipe.train.seed;
        let model = Model::load_with(&files, dtype, &dev, &spec, seed, &kernels, &mut |t| {
            if fsdp {
                groups.push(Flat::take(t, &*comm)?);
            }
            Ok(())
        })
        .with_context(|| format!("cannot load the model in {}", dir.display()))?;
        let shards = match fsdp {
            true => Some(Shards::from_groups(
                groups,
                model.layers.len(),
                &kernels,
                &*comm,
            )?),
            false => None,
        };
        if let Some((p, _)) = &init {
            export::load_adapter_weights(p, &model)
                .with_context(|| format!("cannot load lora.init_adapter {}", p.display()))?;
        }
        // Every rank starts from rank 0's adapters.
        if comm.world() > 1 {
            for (_, l) in model.adapters() {
                for v in [&l.a, &l.b] {
                    v.set(&comm.broadcast(v.as_tensor(), 0)?)?;
                }
            }
        }
        let d = &recipe.data;
        let mut formats: Vec<DataFormat> = d
            .train
            .files(d.format)
            .iter()
            .filter_map(|f| f.format)
            .collect();
        if d.eval.is_some() {
            formats.push(d.format);
        }
        let tok = match formats.iter().find(|f| **f != DataFormat::Tokens) {
            Some(f) => {
                let t = files.tokenizer.as_ref().with_context(|| {
                    format!(
                        "data format \"{}\" needs {}/tokenizer.json, which is missing",
                        crate::data::format_name(*f),
                        dir.display()
                    )
                })?;
                let mut tok = TextTokenizer::load(t, files.tokenizer_config.as_deref())?;
                if formats.contains(&DataFormat::Chat) {
                    let choice = d.chat_template.as_deref();
                    let tpl = ChatTemplate::load(
                        &dir,
                        files.tokenizer_config.as_deref(),
                        choice,
                        tok.specials.clone(),
                    )
                    .map_err(|e| RecipeError::Invalid {
                        path: recipe.source.clone(),
                        key: "data.chat_template".into(),
                        msg: match choice {
                            None => format!("is unset, and {e:#}"),
                            Some(c) => format!("= \"{c}\": {e:#}"),
                        },
                    })?;
                    tok.chat = Some(tpl);
                }
                Some(tok)
            }
            None => None,
        };
        let vocab = model.cfg.vocab_size;
        let mut data = Dataset::load(d, tok.as_ref(), vocab)?;
        let eval = match Dataset::load_eval(d, tok.as_ref(), vocab)? {
            Some(e) => Some(e),
            None if d.eval_fraction > 0.0 => {
                if data.examples.len() < 2 {
                    anyhow::bail!(
                        "data.eval_fraction = {} needs at least 2 examples; the data has {}",
                        d.eval_fraction,
                        data.examples.len()
                    );
                }
                Some(data.split_eval(d.eval_fraction, recipe.train.seed))
            }
            None => None,
        };
        if let Some(e) = &eval {
            if e.examples
                .iter()
                .all(|x| x.labels.iter().skip(1).all(|&l| l == IGNORE))
            {
                anyhow::bail!("the eval set has no token to predict: every label is -100");
            }
        }
        let data_notes = data_notes(&data, eval.as_ref(), tok.as_ref(), d);
        let sampler = Sampler::new(&data, &recipe.data, recipe.train.seed);
        let pad_id = model.cfg.pad_token_id.unwrap_or(0);
        // What PEFT loads the base from: the Hub id, or the local directory.
        let base_name = recipe
            .model
            .id
            .clone()
            .unwrap_or_else(|| dir.to_string_lossy().into_owned());
        // A Hub model is read from the cache's snapshots/<commit>/: that commit.
        let base_revision = match (&recipe.model.id, dir.parent().and_then(|p| p.file_name())) {
            (Some(_), Some(p)) if p == "snapshots" => {
                dir.file_name().map(|c| c.to_string_lossy().into_owned())
            }
            _ => None,
        };
        Ok(Session {
            recipe,
            model,
            spec,
            data,
            sampler,
            pad_id,
            base_name,
            base_revision,
            eval,
            data_notes,
            comm,
            shards,
            memory: MemoryWatch::default(),
        })
    }

    /// How this rank's micro-batches run (`reduce`: sum gradients over ranks in this one).
    pub fn par(&self, reduce: bool) -> Par<'_> {
        Par {
            comm: &*self.comm,
            shards: self.shards.as_ref(),
            reduce,
        }
    }

    /// Mean token cross-entropy over the eval set (no dropout, no gradients) and its number
    /// of tokens; None without an eval set.
    pub fn eval_loss(&self) -> Result<Option<(f64, usize)>> {
        let Some(ev) = &self.eval else {
            return Ok(None);
        };
        let cfg = DataSection {
            shuffle: false,
            ..self.recipe.data.clone()
        };
        let rows = Sampler::new(ev, &cfg, 0).rows(0);
        let (mut sum, mut n) = (0.0, 0);
        for chunk in rows.chunks(self.recipe.train.micro_batch) {
            let rows: Vec<Vec<&Example>> = chunk
                .iter()
                .map(|r| r.iter().map(|&i| &ev.examples[i]).collect())
                .collect();
            let b = Batch::from_rows(&rows, self.pad_id, cfg.pack);
            sum += eval::ce_sum_par(&self.model, &self.par(false), &b)?;
            n += b.n_targets();
        }
        Ok(Some((sum / n.max(1) as f64, n)))
    }

    /// This rank's steps of one epoch: steps → micro-batches → rows → example indices.
    pub fn epoch_plan(&self, epoch: usize) -> Vec<Vec<Vec<Vec<usize>>>> {
        self.epoch_plan_of(epoch, self.comm.rank())
    }

    /// Rank `rank`'s steps of one epoch (rows rank, rank + world, ... of the epoch's order).
    pub fn epoch_plan_of(&self, epoch: usize, rank: usize) -> Vec<Vec<Vec<Vec<usize>>>> {
        let t = &self.recipe.train;
        let rows = self.sampler.rows_for(epoch, rank, self.comm.world());
        let micro: Vec<Vec<Vec<usize>>> = rows.chunks(t.micro_batch).map(|c| c.to_vec()).collect();
        micro.chunks(t.grad_accum).map(|c| c.to_vec()).collect()
    }

    pub fn total_steps(&self) -> usize {
        let t = &self.recipe.train;
        t.max_steps
            .unwrap_or_else(|| self.epoch_plan(0).len() * t.epochs.unwrap_or(1))
    }

    /// Counted tokens of each step of an epoch over all ranks: the loss denominator, which
    /// every rank computes alone since every rank sees the whole order.
    pub fn step_denoms(&self, epoch: usize) -> Vec<usize> {
        let mut d: Vec<usize> = Vec::new();
        for rank in 0..self.comm.world() {
            for (i, step) in self.epoch_plan_of(epoch, rank).iter().enumerate() {
                if d.len() <= i {
                    d.resize(i + 1, 0);
                }
                d[i] += step
                    .iter()
                    .map(|m| self.batch(m).n_targets())
                    .sum::<usize>();
            }
        }
        d
    }

    pub fn batch(&self, rows: &[Vec<usize>]) -> Batch {
        let rows: Vec<Vec<&crate::data::Example>> = rows
            .iter()
            .map(|r| r.iter().map(|&i| &self.data.examples[i]).collect())
            .collect();
        Batch::from_rows(&rows, self.pad_id, self.recipe.data.pack)
    }

    /// Rank 0 before the first step: creates `out_dir`, removes what an earlier run or an
    /// interrupted save left there, writes the resolved recipe, and opens metrics.jsonl (a
    /// resumed run keeps the rows up to its checkpoint and appends to them).
    fn open_outputs(&self, out_dir: &Path, resume: Option<&Checkpoint>) -> Result<std::fs::File> {
        std::fs::create_dir_all(out_dir)
            .with_context(|| format!("cannot create {}", out_dir.display()))?;
        let removed = checkpoint::clean(out_dir, resume.is_none())?;
        if !removed.is_empty() {
            eprintln!(
                "removed {} of an earlier run from {}",
                removed.join(", "),
                out_dir.display()
            );
        }
        atomic_write(
            &out_dir.join("recipe.toml"),
            self.recipe.to_toml().as_bytes(),
        )?;
        let metrics_path = out_dir.join("metrics.jsonl");
        match resume {
            Some(ck) => {
                let old = std::fs::read_to_string(&metrics_path).unwrap_or_default();
                let kept: String = old
                    .lines()
                    .filter(|l| {
                        serde_json::from_str::<serde_json::Value>(l)
                            .ok()
                            .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                            .is_some_and(|s| s as usize <= ck.state.step)
                    })
                    .map(|l| format!("{l}\n"))
                    .collect();
                atomic_write(&metrics_path, kept.as_bytes())?;
                std::fs::OpenOptions::new().append(true).open(&metrics_path)
            }
            None => std::fs::File::create(&metrics_path),
        }
        .with_context(|| format!("cannot open {}", metrics_path.display()))
    }

    /// Trains to the end, saving into `out_dir` at `save_every` and at the end; continues
    /// from the checkpoint that `train.resume` names, if any.
    pub fn train(&self, out_dir: &std::path::Path) -> Result<RunSummary> {
        let resume = checkpoint::resume_point(&self.recipe, out_dir)?;
        self.train_from(out_dir, resume.as_ref(), &|_| false)
    }

    /// `train`, from `resume` (else from the start, removing the checkpoints in `out_dir`:
    /// `checkpoint::resume_point` is what refuses to start over an unfinished run). After each
    /// step but the last, `stop(step)` is asked whether to save a checkpoint and return
    /// `stop::Interrupted`.
    pub fn train_from(
        &self,
        out_dir: &Path,
        resume: Option<&Checkpoint>,
        stop: &dyn Fn(usize) -> bool,
    ) -> Result<RunSummary> {
        let r = &self.recipe;
        let t = &r.train;
        // Rank 0 alone writes (adapter, checkpoints, metrics, progress); every rank computes.
        let (lead, world) = (self.comm.rank() == 0, self.comm.world());
        // The trainable parameters and their PEFT keys (which name them in checkpoints).
        let mut params = Vec::new();
        let mut keys = Vec::new();
        for (module, l) in self.model.adapters() {
            for (which, var) in [('A', &l.a), ('B', &l.b)] {
                params.push(var.clone());
                keys.push(export::peft_key(module, which));
            }
        }
        let mut opt = AdamW::new(params, t.betas, t.eps, t.weight_decay)?;
        let total = self.total_steps();
        let dev = self.model.device.clone();
        // train.max_memory on the CPU caps an accounting of tensor bytes: the model and the
        // f32 adapter state (weights, AdamW m and v, gradients) plus what the driver holds.
        let cpu_cap = r.max_memory().filter(|_| dev.is_cpu());
        let lora: u64 = self
            .model
            .adapters()
            .map(|(_, l)| {
                crate::memory::tensor_bytes(l.a.as_tensor())
                    + crate::memory::tensor_bytes(l.b.as_tensor())
            })
            .sum();
        crate::memory::set_cpu_budget(cpu_cap, model_bytes(&self.model) + 3 * lora);
        let mut meter = crate::memory::PhaseMeter::default();
        let mut cursor = Cursor {
            epoch: 0,
            step_in_epoch: 0,
        };
        let (mut step, mut tokens, mut skipped) = (0usize, 0usize, 0usize);
        let mut history: Vec<(usize, Option<f64>)> = Vec::new();
        if let Some(ck) = resume {
            let s = &ck.state;
            let data_tokens: usize = self.data.examples.iter().map(|e| e.ids.len()).sum();
            let now = (self.data.examples.len(), data_tokens, total);
            if (s.data_examples, s.data_tokens, s.total_steps) != now {
                return Err(RecipeError::Invalid {
                    path: r.source.clone(),
                    key: "data.train".into(),
                    msg: format!(
                        "{} changed since checkpoint {} was saved ({} examples, {} tokens, {} steps then; {} examples, {} tokens, {} steps now): resuming would not continue the same run",
                        r.data.train.describe(), ck.dir.display(), s.data_examples, s.data_tokens, s.total_steps, now.0, now.1, now.2
                    ),
                }
                .into());
            }
            checkpoint::restore(ck, self, &mut opt, &keys)
                .with_context(|| format!("cannot resume from {}", ck.dir.display()))?;
            (step, cursor, tokens, skipped) = (s.step, s.cursor, s.tokens, s.skipped_steps);
            history = s.loss_history.clone();
        }
        let mut metrics = match lead {
            true => Some(self.open_outputs(out_dir, resume)?),
            false => None,
        };

        // A checkpoint of the state after `step` steps, then the pruning of old ones.
        let save = |step: usize,
                    cursor: Cursor,
                    opt: &AdamW,
                    skipped: usize,
                    tokens: usize,
                    history: &[(usize, Option<f64>)]|
         -> Result<PathBuf> {
            let state = TrainerState::new(self, step, total, cursor, opt, skipped, tokens, history);
            let dir = checkpoint::save(self, out_dir, &state, opt, &keys)?;
            checkpoint::prune(out_dir, r.output.keep_last, step)?;
            Ok(dir)
        };
        let mut last_ckpt: Option<(usize, PathBuf)> = resume.map(|c| (c.state.step, c.dir.clone()));

        let bar = match lead {
            true => progress_bar(total as u64),
            false => ProgressBar::hidden(),
        };
        bar.set_position(step as u64);
        let start = Instant::now();
        let mut session_tokens = 0usize;
        let mut losses = Vec::with_capacity(total - step.min(total));
        let epoch = cursor.epoch;
        let skip = cursor.step_in_epoch;
        let mut last_eval = None;
        // Steps run one ahead of the host. Step k's update is queued right after its gradients,
        // its clipping and finite check made on the device (optim::clip_step); what the host
        // does with step k (reading its loss and ‖g‖, the log, eval, checkpoint, stop) waits
        // until step k+1's forward and backward are queued, so the device never idles while the
        // host reads. Step k+1's update is queued after that, so step k's eval and checkpoint
        // still see step k's adapter, and a step found not finite stops the run (or is counted
        // as skipped: the kernel skipped it) before another update follows it. The reads go
        // through pinned memory (train::readback): a plain read would wait for the whole queue.
        struct Pending {
            /// The step's scalars on their way to the host (`readback`): with several ranks
            /// [Σ CE, tokens] over every rank, else Σ CE when anything counted (`Counted`);
            /// then a device clip's [‖g‖, coef, skip].
            vals: Option<readback::Ticket>,
            counted_as: Counted,
            clip: optim::StepClip,
            /// The step counter advanced for it (`AdamW::step_clip`).
            counted: bool,
            denom: usize,
            tokens: usize,
            lr: f64,
            cursor: Cursor,
            epoch: usize,
            /// The pool's phase peaks over its forward, backward and update.
            peaks: std::collections::BTreeMap<&'static str, u64>,
        }
        /// What a step's readback opens with (`Pending::vals`).
        enum Counted {
            Sums,
            Ce,
            Nothing,
        }
        let mut pending: Option<Pending> = None;
        let mut rb = readback::Readbacks::new();
        // Phase peaks of the steps since the last log row.
        let mut peaks_since: std::collections::BTreeMap<&'static str, u64> = Default::default();
        // Several ranks: rank 0's stop decision, broadcast at one step's end, read at the next.
        let mut stop_flag: Option<readback::Ticket> = None;
        let mut queued = step;
        let mut plan: std::vec::IntoIter<(usize, Vec<Vec<Vec<usize>>>)> = Vec::new().into_iter();
        let mut denoms = Vec::new();
        let mut plan_epoch = None;
        loop {
            // ---- the next step's forward and backward, queued
            // A step that saves a checkpoint is finished before the next one is queued: an
            // out-of-memory in the next step's forward must not lose it.
            let eager = pending.is_some()
                && r.output.save_every > 0
                && (step + 1) % r.output.save_every == 0;
            let mut cur = None;
            loop {
                if eager || queued >= total {
                    break;
                }
                if let Some((i, micro_batches)) = plan.next() {
                    cur = Some((plan_epoch.unwrap_or(epoch), i, micro_batches));
                    break;
                }
                let e = match plan_epoch {
                    None => epoch,
                    Some(e) => e + 1,
                };
                let first = match plan_epoch {
                    None => skip,
                    Some(_) => 0,
                };
                plan_epoch = Some(e);
                plan = self
                    .epoch_plan(e)
                    .into_iter()
                    .enumerate()
                    .skip(first)
                    .collect::<Vec<_>>()
                    .into_iter();
                // One rank sees its whole step; several compute the others' counts too.
                denoms = match world {
                    1 => Vec::new(),
                    _ => self.step_denoms(e),
                };
            }
            let mut run = None;
            if let Some((e, i, micro_batches)) = cur {
                let batches: Vec<Batch> = micro_batches.iter().map(|m| self.batch(m)).collect();
                let denom = match world {
                    1 => batches.iter().map(Batch::n_targets).sum::<usize>(),
                    _ => denoms.get(i).copied().unwrap_or(0),
                };
                let mut grads = Grads::new();
                let mut ce: Option<Tensor> = None;
                let mut step_tokens = 0;
                let lr = t.lr * schedule::lr_factor(t.schedule, queued, total, t.warmup_steps);
                let oom = |e: anyhow::Error, meter: &crate::memory::PhaseMeter| -> anyhow::Error {
                    if !crate::memory::is_oom(&e) {
                        return e;
                    }
                    self.out_of_memory(
                        &e,
                        meter,
                        Some((queued + 1, total)),
                        last_ckpt.as_ref().map(|(_, p)| p.clone()),
                    )
                };
                meter.begin(&dev)?;
                for (k, b) in batches.iter().enumerate() {
                    // Dropout masks are keyed by the global micro-batch index, so that a row
                    // draws the same mask whatever the number of ranks.
                    let micro = k * world + self.comm.rank();
                    let key =
                        (r.lora.dropout > 0.0).then_some((t.seed, [queued as u64, micro as u64]));
                    let last = k + 1 == batches.len();
                    let res = driver::forward_backward_dev(
                        &self.model,
                        &self.par(last),
                        b,
                        denom.max(1) as f64,
                        driver::Keep::new(t.activation_checkpointing, t.offload_activations, &dev),
                        key,
                        &mut grads,
                        None,
                        &mut |phase| meter.end(&dev, phase),
                    );
                    match res {
                        Ok(c) => ce = driver::add_ce(ce, c)?,
                        Err(e) => {
                            bar.finish_and_clear();
                            return Err(oom(e.into(), &meter));
                        }
                    }
                    step_tokens += b.tokens;
                }
                meter.done = Some("backward");
                // The step's CE and tokens over every rank (for the loss, its finite check and
                // the log), summed on the device.
                let sums = match world {
                    1 => None,
                    _ => {
                        let d = &self.model.device;
                        let local = Tensor::cat(
                            &[
                                match &ce {
                                    Some(c) => c.to_dtype(DType::F64)?.reshape(1)?,
                                    None => Tensor::zeros(1, DType::F64, d)?,
                                },
                                Tensor::new(&[step_tokens as f64], d)?,
                            ],
                            0,
                        )?;
                        Some(self.comm.all_reduce_sum(&local)?)
                    }
                };
                let ce_all = match &sums {
                    Some(s) => Some(s.narrow(0, 0, 1)?.to_dtype(DType::F32)?.squeeze(0)?),
                    None => ce.clone(),
                };
                let clip =
                    match optim::clip_step(&grads, &opt.params, t.max_grad_norm, ce_all.as_ref()) {
                        Ok(c) => c,
                        Err(e) => {
                            bar.finish_and_clear();
                            return Err(oom(e.into(), &meter));
                        }
                    };
                // Queued now, read once the next step is queued: the read waits for nothing else.
                let (parts, counted_as) = match (&sums, &ce_all) {
                    (Some(s), _) => (vec![s], Counted::Sums),
                    (None, Some(c)) => (vec![c], Counted::Ce),
                    (None, None) => (vec![], Counted::Nothing),
                };
                let parts: Vec<&Tensor> = parts.into_iter().chain(clip.on_device()).collect();
                let vals = match parts.is_empty() {
                    true => None,
                    false => Some(rb.start(&parts)?),
                };
                run = Some((grads, clip, vals, counted_as, denom, step_tokens, lr, e, i));
            }

            // ---- what the host does with the step before (its device work is done or queued)
            if let Some(p) = pending.take() {
                let v = match p.vals {
                    Some(t) => rb.read(t)?,
                    None => Vec::new(),
                };
                // A value missing reads as NaN: the step then counts as not finite.
                let mut v = v.into_iter();
                let mut next = || v.next().unwrap_or(f64::NAN);
                let (ce, step_tokens) = match p.counted_as {
                    Counted::Sums => (next(), next() as usize),
                    Counted::Ce => (next(), p.tokens),
                    Counted::Nothing => (0.0, p.tokens),
                };
                let (grad_norm, finite) = p.clip.from_vals(&[next(), next(), next()]);
                let loss = ce / p.denom.max(1) as f64;
                // A NaN / Inf loss or gradient never reaches the adapter (the update skipped it).
                let finite = finite && loss.is_finite();
                if !finite {
                    if p.counted {
                        opt.untake();
                    }
                    if t.skip_nonfinite {
                        skipped += 1;
                    } else {
                        bar.finish_and_clear();
                        return Err(stop::NonFinite {
                            step: step + 1,
                            total,
                            what: format!("the loss is {loss} and the gradient norm {grad_norm}"),
                            last_checkpoint: last_ckpt.map(|(_, p)| p),
                            lr: t.lr,
                            dtype: format!("{:?}", self.model.dtype).to_lowercase(),
                            max_grad_norm: t.max_grad_norm,
                        }
                        .into());
                    }
                }
                tokens += step_tokens;
                session_tokens += step_tokens;
                for (k, v) in p.peaks {
                    let e = peaks_since.entry(k).or_insert(0);
                    *e = (*e).max(v);
                }
                step += 1;
                cursor = p.cursor;
                let (epoch, lr, denom) = (p.epoch, p.lr, p.denom);
                losses.push(loss);
                history.push((step, finite.then_some(loss)));
                let secs = start.elapsed().as_secs_f64();
                let tok_s = session_tokens as f64 / secs.max(1e-9);
                // Eval every eval_every steps and at the end.
                let eval = if step == total || (t.eval_every > 0 && step % t.eval_every == 0) {
                    self.eval_loss()?
                } else {
                    None
                };
                if step % t.log_every == 0 || step == total || eval.is_some() || !finite {
                    let mut row = serde_json::json!({
                        "step": step, "epoch": epoch, "loss": loss, "lr": lr,
                        "grad_norm": grad_norm, "tokens": tokens, "target_tokens": denom,
                        "tok_per_s": tok_s, "elapsed_s": secs, "skipped": !finite,
                        "truncated": self.data.truncated, "skipped_rows": self.data.skipped,
                    });
                    let mut msg = format!("loss {loss:.4}  ");
                    // Per-phase peaks of the device pool since the last row (CUDA only).
                    let peaks = std::mem::take(&mut peaks_since);
                    if !peaks.is_empty() {
                        // 1e-4 GiB (~0.1 MiB) resolution: small models are not rounded to 0.
                        let g = |x: u64| (x as f64 / crate::memory::GIB * 1e4).round() / 1e4;
                        let mut mem = serde_json::json!({ "rank": self.memory.rank });
                        if let Some(l) = self.memory.load_peak {
                            mem["load_gib"] = g(l).into();
                        }
                        let mut short = Vec::new();
                        for phase in crate::memory::PHASES {
                            if let Some(v) = peaks.get(phase) {
                                mem[format!("{phase}_gib")] = g(*v).into();
                                short.push(format!("{} {:.1}", &phase[..3], g(*v)));
                            }
                        }
                        row["mem"] = mem;
                        msg.push_str(&format!("peak GiB {}  ", short.join(" ")));
                    }
                    if let Some((l, n)) = eval {
                        row["eval_loss"] = l.into();
                        row["eval_tokens"] = n.into();
                        msg.push_str(&format!("eval {l:.4}  "));
                        last_eval = Some(l);
                    }
                    if let Some(m) = metrics.as_mut() {
                        writeln!(m, "{row}").context("cannot write metrics.jsonl")?;
                    }
                    let mut msg = format!("{msg}lr {lr:.2e}  {tok_s:.0} tok/s");
                    if !finite {
                        msg.push_str(&format!("  (non-finite: update skipped, {skipped} so far)"));
                    }
                    if lead && bar.is_hidden() {
                        eprintln!("step {step}/{total}  {msg}");
                    }
                    bar.set_message(msg);
                }
                bar.inc(1);
                if lead
                    && r.output.save_every > 0
                    && step % r.output.save_every == 0
                    && step < total
                {
                    let dir = save(step, cursor, &opt, skipped, tokens, &history)?;
                    last_ckpt = Some((step, dir));
                }
                // Rank 0 decides whether to stop (signals); every rank stops at the same step:
                // with several, one step after rank 0 decided (its decision is broadcast with
                // that step's work and read at the next one's end, so no rank waits for it).
                let stopping = step < total && {
                    let here = lead && stop(step);
                    match world {
                        1 => here,
                        _ => {
                            let before = match stop_flag.take() {
                                Some(f) => rb.read(f)?.first().is_some_and(|&x| x > 0.0),
                                None => false,
                            };
                            let flag = Tensor::new(&[here as u8 as f64], &self.model.device)?;
                            // read through pinned memory too: a plain read would wait for
                            // the next step's backward, queued before it
                            let flag = self.comm.broadcast(&flag, 0)?;
                            stop_flag = Some(rb.start(&[&flag])?);
                            before
                        }
                    }
                };
                if stopping {
                    let dir = match (&last_ckpt, lead) {
                        (Some((s, dir)), _) if *s == step => dir.clone(),
                        (_, true) => save(step, cursor, &opt, skipped, tokens, &history)?,
                        (_, false) => checkpoint::dir_of(out_dir, step),
                    };
                    bar.finish_and_clear();
                    return Err(stop::Interrupted {
                        step,
                        total,
                        checkpoint: dir,
                    }
                    .into());
                }
            }

            // ---- the queued step's update
            let Some((grads, clip, vals, counted_as, denom, step_tokens, lr, e, i)) = run else {
                if eager {
                    continue;
                }
                break;
            };
            let counted = match opt.step_clip(&grads, lr, &clip) {
                Ok(c) => c,
                Err(err) => {
                    bar.finish_and_clear();
                    let err: anyhow::Error = err.into();
                    if !crate::memory::is_oom(&err) {
                        return Err(err);
                    }
                    let last = last_ckpt.as_ref().map(|(_, p)| p.clone());
                    return Err(self.out_of_memory(&err, &meter, Some((queued + 1, total)), last));
                }
            };
            meter.end(&dev, "optimizer")?;
            drop(grads);
            queued += 1;
            pending = Some(Pending {
                vals,
                counted_as,
                clip,
                counted,
                denom,
                tokens: step_tokens,
                lr,
                cursor: Cursor {
                    epoch: e,
                    step_in_epoch: i + 1,
                },
                epoch: e,
                peaks: meter.take(),
            });
        }
        bar.finish_and_clear();
        if lead {
            export::save_adapter(
                out_dir,
                &self.model,
                &self.spec,
                &self.base_name,
                self.base_revision.as_deref(),
            )?;
            if r.output.save_every > 0 && last_ckpt.as_ref().is_none_or(|(s, _)| *s != step) {
                save(step, cursor, &opt, skipped, tokens, &history)?;
            }
        }
        if skipped > 0 && lead {
            eprintln!("skipped {skipped} of {total} steps with a non-finite loss or gradient");
        }
        Ok(RunSummary {
            steps: step,
            losses,
            out_dir: out_dir.to_owned(),
            tokens: session_tokens,
            seconds: start.elapsed().as_secs_f64(),
            truncated: self.data.truncated,
            eval_loss: last_eval,
            skipped: self.data.skipped,
        })
    }
}

fn progress_bar(total: u64) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::hidden());
    }
    let bar = ProgressBar::new(total);
    let style = ProgressStyle::with_template(
        "{spinner} step {pos}/{len} [{bar:30}] {msg}  ({elapsed} < {eta})",
    )
    .map(|s| s.progress_chars("=> "))
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}

/// `lora-train train`: the whole run from a recipe, on one device, on one thread per device
/// (`[parallel] strategy = "ddp" | "fsdp"`), or as one rank of a torchrun / Slurm job.
pub fn run(recipe: Recipe) -> Result<RunSummary> {
    run_with(recipe, &RunOptions::default())
}

/// How `run_with` may deviate from the recipe.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Start even when the memory plan says the run does not fit.
    pub force: bool,
}

/// `run`, with options (`--force`).
pub fn run_with(recipe: Recipe, opts: &RunOptions) -> Result<RunSummary> {
    let signal = stop::install_signal_handlers()?;
    let p = &recipe.parallel;
    let env = crate::parallel::launch::EnvRank::from_env(&|k| std::env::var(k).ok())?;
    if let Some(e) = env {
        return run_process(recipe, e, signal, opts);
    }
    if p.strategy == Strategy::Single {
        let ordinal = p.devices.first().copied().unwrap_or(0);
        return run_rank(recipe, Box::new(Solo), ordinal, &signal, opts);
    }
    let timeout = std::time::Duration::from_secs(p.timeout_s);
    let (group, ordinals): (std::sync::Arc<dyn crate::parallel::Group>, Vec<usize>) =
        match recipe.model.device {
            DeviceKind::Cpu => (
                crate::parallel::cpu::CpuGroup::new(p.devices.len(), timeout),
                p.devices.clone(),
            ),
            DeviceKind::Cuda => cuda_group(&recipe, timeout)?,
        };
    // A stop by signal is every rank's orderly end, not a failure that aborts the others:
    // it travels as a value, and rank 0's (which names its checkpoint) is the run's.
    let opts = opts.clone();
    let body = move |rank: usize, comm: Box<dyn Comm>| match run_rank(
        recipe.clone(),
        comm,
        ordinals[rank],
        &signal,
        &opts,
    ) {
        Err(e) if e.is::<stop::Interrupted>() => Ok(Err(e)),
        res => res.map(Ok),
    };
    crate::parallel::launch::threads(group, std::sync::Arc::new(body), timeout)?
}

#[cfg(feature = "nccl")]
fn cuda_group(
    recipe: &Recipe,
    timeout: std::time::Duration,
) -> Result<(std::sync::Arc<dyn crate::parallel::Group>, Vec<usize>)> {
    let ordinals = crate::parallel::nccl::ordinals(recipe)?;
    let group = crate::parallel::nccl::NcclGroup::new(ordinals.clone(), timeout)?;
    Ok((group, ordinals))
}

#[cfg(not(feature = "nccl"))]
fn cuda_group(
    recipe: &Recipe,
    _: std::time::Duration,
) -> Result<(std::sync::Arc<dyn crate::parallel::Group>, Vec<usize>)> {
    Err(RecipeError::Invalid {
        path: recipe.source.clone(),
        key: "parallel.strategy".into(),
        msg: "on CUDA needs NCCL, but this binary was built without it: rebuild with `cargo build --release --features cuda,nccl`".into(),
    }
    .into())
}

/// One rank of a job whose launcher started a process per rank (RANK / WORLD_SIZE / ...).
fn run_process(
    recipe: Recipe,
    e: crate::parallel::launch::EnvRank,
    signal: stop::StopSignal,
    opts: &RunOptions,
) -> Result<RunSummary> {
    if recipe.parallel.strategy == Strategy::Single {
        return Err(RecipeError::Invalid {
            path: recipe.source.clone(),
            key: "parallel.strategy".into(),
            msg: format!("= \"single\", but the launcher started {} ranks (WORLD_SIZE): use \"ddp\" or \"fsdp\"", e.world),
        }
        .into());
    }
    if recipe.model.device == DeviceKind::Cpu {
        anyhow::bail!(
            "RANK / WORLD_SIZE are set (world {}), but model.device = \"cpu\": CPU ranks are threads of one process; run `lora-train` once with parallel.devices listing {} ranks",
            e.world,
            e.world
        );
    }
    process_rank(recipe, e, signal, opts)
}

#[cfg(feature = "nccl")]
fn process_rank(
    recipe: Recipe,
    e: crate::parallel::launch::EnvRank,
    signal: stop::StopSignal,
    opts: &RunOptions,
) -> Result<RunSummary> {
    let timeout = std::time::Duration::from_secs(recipe.parallel.timeout_s);
    let comm = crate::parallel::nccl::from_env(&e, timeout)?;
    run_rank(recipe, comm, e.local, &signal, opts)
        .with_context(|| format!("rank {} of {} failed", e.rank, e.world))
}

#[cfg(not(feature = "nccl"))]
fn process_rank(
    _: Recipe,
    e: crate::parallel::launch::EnvRank,
    _: stop::StopSignal,
    _: &RunOptions,
) -> Result<RunSummary> {
    anyhow::bail!(
        "RANK / WORLD_SIZE are set (world {}), but this binary was built without NCCL: rebuild with `cargo build --release --features cuda,nccl`",
        e.world
    )
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
    session.memory = watch;
    let m = &session.model;
    let trainable: usize = m
        .adapters()
        .map(|(_, l)| l.a.elem_count() + l.b.elem_count())
        .sum();
    let world = session.comm.world();
    if lead && world > 1 {
        let p = &session.recipe.parallel;
        let resident = crate::parallel::fsdp::resident_base_bytes(m, session.shards.as_ref());
        eprintln!(
            "{} over {world} ranks (devices {:?}); frozen base resident per rank: {:.1} MB",
            p.strategy.name(),
            p.devices,
            resident as f64 / 1e6
        );
    }
    if lead {
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
    let res = session.train_from(&out_dir, resume.as_ref(), &|_| signal.received());
    if res.is_err() && signal.received() {
        signal.wait_announced();
    }
    let summary = res?;
    drop(ballast);
    if lead && session.recipe.output.merge {
        let size = session.recipe.output.max_shard_size.as_deref();
        let opts = export::merge::MergeOptions {
            dtype: None,
            max_shard_size: export::merge::parse_size(
                size.unwrap_or(export::merge::DEFAULT_MAX_SHARD_SIZE),
            )
            .map_err(|m| anyhow::anyhow!("output.max_shard_size {m}"))?,
            replace: true,
        };
        let base = PathBuf::from(&session.base_name);
        let rep = export::merge::merge(&out_dir, &base, &out_dir.join("merged"), &opts)
            .context("cannot write the merged model (output.merge = true)")?;
        eprintln!(
            "merged model written to {} ({} tensors, {} with the adapter merged in, {} shard(s))",
            rep.out.display(),
            rep.tensors,
            rep.merged,
            rep.shards
        );
    }
    Ok(summary)
}

/// The memory plan for a recipe, checked against what the run has: on CUDA train.max_memory
/// or the card's free memory, on the CPU train.max_memory (the accounting's cap). Returns
/// the run's memory watch and, on CUDA with max_memory, the ballast to hold while training.
pub fn preflight(
    recipe: &Recipe,
    opts: &RunOptions,
    ordinal: usize,
) -> Result<(MemoryWatch, Option<crate::memory::Ballast>)> {
    use crate::memory::plan;
    let cuda = recipe.model.device == DeviceKind::Cuda;
    let cfg_path = hub::config_file(&recipe.model)?;
    let cfg = crate::model::ModelConfig::from_file(&cfg_path)?;
    let input = plan::input_from_recipe(recipe, cfg, recipe.parallel.devices.len(), cuda)?;
    let max_memory = recipe.max_memory();
    let mut ballast = None;
    let (capacity, source) = if cuda {
        let (dev, _) = device_and_dtype_on(recipe, ordinal)?;
        crate::memory::keep_pool_memory(&dev)?;
        let info = crate::memory::mem_info(&dev)?;
        match (max_memory, info) {
            (Some(m), _) => (Some(m), "train.max_memory".to_string()),
            // The context the plan counts is already out of `free`: add it back.
            (None, Some((free, _))) => (
                Some(free + plan::CONTEXT),
                format!("cuda:{ordinal} (free memory + this process's context)"),
            ),
            (None, None) => (None, String::new()),
        }
    } else {
        (max_memory, "train.max_memory (CPU accounting)".to_string())
    };
    let p = plan::plan(&input, recipe.train.grad_accum, capacity);
    let selected = (
        recipe.parallel.strategy,
        recipe.train.activation_checkpointing,
    );
    let forecast = plan::row(&p, selected.0, selected.1).map(|r| r.b.clone());
    if let Some(b) = forecast.as_ref().filter(|b| b.host > 0) {
        eprintln!(
            "activation offload: each layer's residual waits in pinned host memory, {} per rank \
             (train.offload_activations = false recomputes it instead)",
            plan::fmt_bytes(b.host)
        );
    }
    let remedies = plan::remedies(&p, selected);
    if let (Some(cap), Some(b)) = (capacity, &forecast) {
        if b.total > cap {
            let e = stop::DoesNotFit {
                forecast: b.clone(),
                capacity: cap,
                capacity_source: source,
                table: plan::render(&p),
                remedies: remedies.clone(),
            };
            if !opts.force {
                return Err(e.into());
            }
            eprintln!(
                "warning (--force): {}",
                e.to_string().lines().next().unwrap_or("")
            );
        }
    }
    if let (true, Some(m)) = (cuda, max_memory) {
        let (dev, _) = device_and_dtype_on(recipe, ordinal)?;
        ballast = crate::memory::hold_ballast(&dev, m)?;
        match &ballast {
            Some(b) if b.bytes > 0 => eprintln!(
                "train.max_memory = {}: holding {} of the card's {} outside the pool",
                plan::fmt_bytes(m),
                plan::fmt_bytes(b.bytes),
                plan::fmt_bytes(b.total)
            ),
            Some(b) => eprintln!(
                "warning: train.max_memory = {}, but less than that is free on the card ({} in all): nothing held back",
                plan::fmt_bytes(m),
                plan::fmt_bytes(b.total)
            ),
            None => {}
        }
    }
    let capacity = capacity.or_else(|| ballast.as_ref().map(|b| b.total));
    Ok((
        MemoryWatch {
            rank: 0,
            forecast,
            remedies,
            capacity,
            load_peak: None,
        },
        ballast,
    ))
}

/// Bytes of the model's tensors (base, norms, head, adapters).
fn model_bytes(m: &Model) -> u64 {
    use crate::memory::tensor_bytes as b;
    let mut sum = b(&m.embed) + b(&m.norm) + if m.tied { 0 } else { b(&m.lm_head) };
    for l in &m.layers {
        sum += b(&l.input_norm) + b(&l.post_norm);
        for lin in l.linears() {
            // W's whole buffer: folded, its pad columns too (ops::fold)
            sum += crate::parallel::fsdp::storage_bytes(&lin.w) as u64;
            sum += lin.b.as_ref().map(b).unwrap_or(0);
            if let Some(lora) = &lin.lora {
                sum += b(lora.a.as_tensor()) + b(lora.b.as_tensor());
            }
        }
    }
    sum
}

impl Session {
    /// The diagnosis of an allocation failure: rank, phase, step, peak vs capacity, the
    /// forecast and remedies.
    pub fn out_of_memory(
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
            self.recipe.max_memory()
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

/// Lines about the data beyond counts: the mix, skipped rows, dropped examples, how chat turns
/// end (and a warning when `generate` would not stop there), the eval set.
fn data_notes(
    data: &Dataset,
    eval: Option<&Dataset>,
    tok: Option<&TextTokenizer>,
    d: &DataSection,
) -> Vec<String> {
    let mut notes = Vec::new();
    if data.files.len() > 1 {
        let mix: Vec<String> = data
            .files
            .iter()
            .enumerate()
            .map(|(k, (p, w))| {
                let n = data.file_of.iter().filter(|&&f| f == k).count();
                format!("{} ({n} examples, weight {w})", p.display())
            })
            .collect();
        notes.push(format!("data mix: {}", mix.join(", ")));
    }
    if data.skipped > 0 {
        notes.push(format!(
            "skipped {} bad rows (data.on_bad_row = \"skip\"); first: {}",
            data.skipped,
            data.skipped_first.join("; ")
        ));
    }
    if data.no_targets > 0 {
        notes.push(format!(
            "dropped {} examples with no completion token left after truncation to seq_len {}",
            data.no_targets, d.seq_len
        ));
    }
    if data.eos_added > 0 {
        notes.push(format!(
            "appended the EOS token to {} assistant turns that the chat template ends with no stop token",
            data.eos_added
        ));
    }
    if let Some(tok) = tok {
        for (&id, &n) in &data.turn_ends {
            let name = tok.token_text(id).unwrap_or_default();
            notes.push(format!("{n} completions end with {name} (id {id})"));
            if !tok.generate_stop_ids.is_empty() && !tok.generate_stop_ids.contains(&id) {
                notes.push(format!(
                    "warning: {name} (id {id}) ends the assistant turns, but generation_config.json / config.json eos_token_id {:?} does not list it: generation will not stop there unless you add it",
                    tok.generate_stop_ids
                ));
            }
        }
    }
    if let Some(e) = eval {
        let from = match &d.eval {
            Some(p) => p.display().to_string(),
            None => format!(
                "data.eval_fraction {} of the training data",
                d.eval_fraction
            ),
        };
        notes.push(format!(
            "eval: {} examples from {from} ({} truncated, {} bad rows skipped)",
            e.examples.len(),
            e.truncated,
            e.skipped
        ));
    }
    notes
}
