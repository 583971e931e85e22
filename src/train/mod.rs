//! `lora-train train`: recipe → model + adapters → data → steps → PEFT adapter.
//!
//! One optimiser step = `grad_accum` micro-batches of `micro_batch` rows. The loss of a step is
//! the mean token cross-entropy over all its counted tokens (not a mean of micro-batch means).

pub mod driver;
pub mod optim;
pub mod schedule;

use crate::data::{Batch, Dataset, Sampler, TextTokenizer};
use crate::export;
use crate::hub;
use crate::lora::LoraSpec;
use crate::model::Model;
use crate::recipe::{DataFormat, DeviceKind, Dtype, Recipe};
use crate::util::atomic_write;
use anyhow::{Context, Result};
use candle_core::{DType, Device};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use optim::{AdamW, Grads};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
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
        // What PEFT loads the base from: the Hub id, or the local directory.
        let base_name = recipe
            .model
            .id
            .clone()
            .unwrap_or_else(|| dir.to_string_lossy().into_owned());
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

    /// Trains to the end, saving into `out_dir` at `save_every` and at the end.
    pub fn train(&self, out_dir: &std::path::Path) -> Result<RunSummary> {
        let r = &self.recipe;
        let t = &r.train;
        let params: Vec<_> = self
            .model
            .adapters()
            .flat_map(|(_, l)| [l.a.clone(), l.b.clone()])
            .collect();
        let mut opt = AdamW::new(params, t.betas, t.eps, t.weight_decay)?;
        let total = self.total_steps();
        std::fs::create_dir_all(out_dir)
            .with_context(|| format!("cannot create {}", out_dir.display()))?;
        atomic_write(&out_dir.join("recipe.toml"), r.to_toml().as_bytes())?;
        let metrics_path = out_dir.join("metrics.jsonl");
        let mut metrics = std::fs::File::create(&metrics_path)
            .with_context(|| format!("cannot create {}", metrics_path.display()))?;

        let bar = progress_bar(total as u64);
        let start = Instant::now();
        let (mut step, mut epoch, mut tokens) = (0usize, 0usize, 0usize);
        let mut losses = Vec::with_capacity(total);
        'outer: loop {
            for micro_batches in self.epoch_plan(epoch) {
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
                }
                let loss = ce / denom.max(1) as f64;
                let grad_norm = optim::clip_grad_norm(&mut grads, t.max_grad_norm)?;
                let lr = t.lr * schedule::lr_factor(t.schedule, step, total, t.warmup_steps);
                opt.step(&grads, lr)?;
                drop(grads);
                step += 1;
                losses.push(loss);
                let secs = start.elapsed().as_secs_f64();
                let tok_s = tokens as f64 / secs.max(1e-9);
                if step % t.log_every == 0 || step == total {
                    let row = serde_json::json!({
                        "step": step, "epoch": epoch, "loss": loss, "lr": lr,
                        "grad_norm": grad_norm, "tokens": tokens, "target_tokens": denom,
                        "tok_per_s": tok_s, "elapsed_s": secs,
                    });
                    writeln!(metrics, "{row}").context("cannot write metrics.jsonl")?;
                    let msg = format!("loss {loss:.4}  lr {lr:.2e}  {tok_s:.0} tok/s");
                    if bar.is_hidden() {
                        eprintln!("step {step}/{total}  {msg}");
                    }
                    bar.set_message(msg);
                }
                bar.inc(1);
                if r.output.save_every > 0 && step % r.output.save_every == 0 && step < total {
                    let ckpt = out_dir.join(format!("checkpoint-{step}"));
                    export::save_adapter(&ckpt, &self.model, &self.spec, &self.base_name)?;
                }
            }
            epoch += 1;
        }
        bar.finish_and_clear();
        export::save_adapter(out_dir, &self.model, &self.spec, &self.base_name)?;
        Ok(RunSummary {
            steps: step,
            losses,
            out_dir: out_dir.to_owned(),
            tokens,
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
    session.train(&out_dir)
}
