//! `lora-train train`: recipe → model + adapters → data → steps → PEFT adapter.
//!
//! One optimiser step = `grad_accum` micro-batches of `micro_batch` rows. The loss of a step is
//! the mean token cross-entropy over all its counted tokens (not a mean of micro-batch means).

pub mod checkpoint;
pub mod driver;
pub mod optim;
pub mod schedule;
pub mod stop;

use crate::data::{Batch, Dataset, Sampler, TextTokenizer};
use crate::export;
use crate::hub::ModelFiles;
use crate::lora::LoraSpec;
use crate::model::Model;
use crate::recipe::{DataFormat, DeviceKind, Dtype, Recipe, RecipeError, Resume};
use crate::util::atomic_write;
use anyhow::{Context, Result};
use candle_core::{DType, Device};
use checkpoint::{Checkpoint, Cursor, TrainerState};
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
}

pub fn device_and_dtype(recipe: &Recipe) -> Result<(Device, DType)> {
    let dev = match recipe.model.device {
        DeviceKind::Cpu => Device::Cpu,
        DeviceKind::Cuda => Device::new_cuda(recipe.parallel.devices[0])
            .with_context(|| format!("cannot open CUDA device {}", recipe.parallel.devices[0]))?,
    };
    let dtype = match (recipe.model.dtype, recipe.model.device) {
        (Some(Dtype::F32), _) | (None, DeviceKind::Cpu) => DType::F32,
        (Some(Dtype::Bf16), _) | (None, DeviceKind::Cuda) => DType::BF16,
        (Some(Dtype::F16), _) => DType::F16,
    };
    Ok((dev, dtype))
}

impl Session {
    pub fn new(recipe: Recipe) -> Result<Session> {
        let (dev, dtype) = device_and_dtype(&recipe)?;
        let dir = recipe.model.path.clone().context("model.path is not set")?;
        let files = ModelFiles::local(&dir)?;
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
        let model = Model::load(&files, dtype, &dev, &spec, recipe.train.seed)
            .with_context(|| format!("cannot load the model in {}", dir.display()))?;
        if let Some((p, _)) = &init {
            export::load_adapter_weights(p, &model)
                .with_context(|| format!("cannot load lora.init_adapter {}", p.display()))?;
        }
        let tok = match recipe.data.format {
            DataFormat::Text => {
                let t = files.tokenizer.as_ref().with_context(|| {
                    format!(
                        "data.format = \"text\" needs {}/tokenizer.json, which is missing",
                        dir.display()
                    )
                })?;
                Some(TextTokenizer::load(t, files.tokenizer_config.as_deref())?)
            }
            DataFormat::Tokens => None,
        };
        let data = Dataset::load(&recipe.data, tok.as_ref(), model.cfg.vocab_size)?;
        let sampler = Sampler::new(&data, &recipe.data, recipe.train.seed);
        let pad_id = model.cfg.pad_token_id.unwrap_or(0);
        let base_name = dir.to_string_lossy().into_owned();
        Ok(Session {
            recipe,
            model,
            spec,
            data,
            sampler,
            pad_id,
            base_name,
        })
    }

    /// The steps of one epoch: steps → micro-batches → rows → example indices.
    pub fn epoch_plan(&self, epoch: usize) -> Vec<Vec<Vec<Vec<usize>>>> {
        let t = &self.recipe.train;
        let rows = self.sampler.rows(epoch);
        let micro: Vec<Vec<Vec<usize>>> = rows.chunks(t.micro_batch).map(|c| c.to_vec()).collect();
        micro.chunks(t.grad_accum).map(|c| c.to_vec()).collect()
    }

    pub fn total_steps(&self) -> usize {
        let t = &self.recipe.train;
        t.max_steps
            .unwrap_or_else(|| self.epoch_plan(0).len() * t.epochs.unwrap_or(1))
    }

    pub fn batch(&self, rows: &[Vec<usize>]) -> Batch {
        let rows: Vec<Vec<&crate::data::Example>> = rows
            .iter()
            .map(|r| r.iter().map(|&i| &self.data.examples[i]).collect())
            .collect();
        Batch::from_rows(&rows, self.pad_id, self.recipe.data.pack)
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
                        r.data.train.display(), ck.dir.display(), s.data_examples, s.data_tokens, s.total_steps, now.0, now.1, now.2
                    ),
                }
                .into());
            }
            checkpoint::restore(ck, self, &mut opt, &keys)
                .with_context(|| format!("cannot resume from {}", ck.dir.display()))?;
            (step, cursor, tokens, skipped) = (s.step, s.cursor, s.tokens, s.skipped_steps);
            history = s.loss_history.clone();
        }
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
        atomic_write(&out_dir.join("recipe.toml"), r.to_toml().as_bytes())?;
        let metrics_path = out_dir.join("metrics.jsonl");
        let mut metrics = match resume {
            // A resumed run keeps the rows up to its checkpoint and appends to them.
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
        .with_context(|| format!("cannot open {}", metrics_path.display()))?;

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

        let bar = progress_bar(total as u64);
        bar.set_position(step as u64);
        let start = Instant::now();
        let mut session_tokens = 0usize;
        let mut losses = Vec::with_capacity(total - step.min(total));
        let mut epoch = cursor.epoch;
        let mut skip = cursor.step_in_epoch;
        'outer: while step < total {
            for (i, micro_batches) in self.epoch_plan(epoch).into_iter().enumerate().skip(skip) {
                if step >= total {
                    break 'outer;
                }
                let batches: Vec<Batch> = micro_batches.iter().map(|m| self.batch(m)).collect();
                let denom = batches.iter().map(Batch::n_targets).sum::<usize>();
                let mut grads = Grads::new();
                let mut ce = 0.0;
                for (k, b) in batches.iter().enumerate() {
                    let key = (r.lora.dropout > 0.0).then_some((t.seed, [step as u64, k as u64]));
                    ce += driver::forward_backward(
                        &self.model,
                        b,
                        denom.max(1) as f64,
                        t.activation_checkpointing,
                        key,
                        &mut grads,
                    )?;
                    tokens += b.tokens;
                    session_tokens += b.tokens;
                }
                let loss = ce / denom.max(1) as f64;
                let grad_norm = optim::clip_grad_norm(&mut grads, t.max_grad_norm)?;
                let lr = t.lr * schedule::lr_factor(t.schedule, step, total, t.warmup_steps);
                // A NaN / Inf loss or gradient never reaches the adapter.
                let finite = loss.is_finite() && grad_norm.is_finite();
                if finite {
                    opt.step(&grads, lr)?;
                } else if t.skip_nonfinite {
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
                drop(grads);
                step += 1;
                cursor = Cursor {
                    epoch,
                    step_in_epoch: i + 1,
                };
                losses.push(loss);
                history.push((step, finite.then_some(loss)));
                let secs = start.elapsed().as_secs_f64();
                let tok_s = session_tokens as f64 / secs.max(1e-9);
                if step % t.log_every == 0 || step == total || !finite {
                    let row = serde_json::json!({
                        "step": step, "epoch": epoch, "loss": loss, "lr": lr,
                        "grad_norm": grad_norm, "tokens": tokens, "target_tokens": denom,
                        "tok_per_s": tok_s, "elapsed_s": secs, "skipped": !finite,
                    });
                    writeln!(metrics, "{row}").context("cannot write metrics.jsonl")?;
                    let mut msg = format!("loss {loss:.4}  lr {lr:.2e}  {tok_s:.0} tok/s");
                    if !finite {
                        msg.push_str(&format!("  (non-finite: update skipped, {skipped} so far)"));
                    }
                    if bar.is_hidden() {
                        eprintln!("step {step}/{total}  {msg}");
                    }
                    bar.set_message(msg);
                }
                bar.inc(1);
                if r.output.save_every > 0 && step % r.output.save_every == 0 && step < total {
                    let dir = save(step, cursor, &opt, skipped, tokens, &history)?;
                    last_ckpt = Some((step, dir));
                }
                if step < total && stop(step) {
                    let dir = match &last_ckpt {
                        Some((s, dir)) if *s == step => dir.clone(),
                        _ => save(step, cursor, &opt, skipped, tokens, &history)?,
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
            skip = 0;
            epoch += 1;
        }
        bar.finish_and_clear();
        export::save_adapter(out_dir, &self.model, &self.spec, &self.base_name)?;
        if r.output.save_every > 0 && last_ckpt.as_ref().is_none_or(|(s, _)| *s != step) {
            save(step, cursor, &opt, skipped, tokens, &history)?;
        }
        if skipped > 0 {
            eprintln!("skipped {skipped} of {total} steps with a non-finite loss or gradient");
        }
        Ok(RunSummary {
            steps: step,
            losses,
            out_dir: out_dir.to_owned(),
            tokens: session_tokens,
            seconds: start.elapsed().as_secs_f64(),
            truncated: self.data.truncated,
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

/// `lora-train train`: the whole run from a recipe.
pub fn run(recipe: Recipe) -> Result<RunSummary> {
    let out_dir = recipe.output_dir();
    // Which checkpoint to continue from, checked before the model loads.
    let resume = checkpoint::resume_point(&recipe, &out_dir)?;
    match (&resume, &recipe.train.resume) {
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
    let session = Session::new(recipe)?;
    let m = &session.model;
    let trainable: usize = m
        .adapters()
        .map(|(_, l)| l.a.elem_count() + l.b.elem_count())
        .sum();
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
    let signal = stop::install_signal_handlers()?;
    let res = session.train_from(&out_dir, resume.as_ref(), &|_| signal.received());
    if res.is_err() && signal.received() {
        signal.wait_announced();
    }
    let summary = res?;
    if session.recipe.output.merge {
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
