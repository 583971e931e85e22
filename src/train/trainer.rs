//! The training loop: steps (train::step's engine), the log, eval, checkpoints and stops.
//!
//! Steps run one ahead of the host: step k+1's forward and backward are queued before the host
//! reads step k's loss and does what step k asks (log, eval, checkpoint, stop), and step k+1's
//! update is queued only after that, so the device never idles while the host reads, step k's
//! eval and checkpoint see step k's adapters, and a step found not finite stops the run (or is
//! counted as skipped: the update kernel skipped it) before another update follows it.

use super::checkpoint::{self, Checkpoint, Cursor, Progress, TrainerState};
use super::checkpoint_write;
use super::driver::Keep;
use super::log::{Log, Row};
use super::optim::AdamW;
use super::session::Session;
use super::step::{adapter_params, Done, Engine};
use super::{schedule, stop, RunSummary};
use crate::export;
use crate::memory::PhaseMeter;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// A step the loop has queued: where it sits in the data.
struct Queued {
    cursor: Cursor,
    lr: f64,
}

/// The loop's state beyond the engine's: the optimiser, where the run stands, the log.
struct Run<'s> {
    s: &'s Session,
    out_dir: &'s Path,
    total: usize,
    opt: AdamW,
    /// The PEFT key of each of `opt.params` (they name them in checkpoints).
    keys: Vec<String>,
    at: Progress,
    log: Log,
    /// The newest checkpoint: (step, directory); its write may still be in flight.
    saved: Option<(usize, PathBuf)>,
    writer: checkpoint_write::Writer,
    losses: Vec<f64>,
    last_eval: Option<f64>,
    /// Several ranks: rank 0's stop decision, broadcast at one step's end, read at the next.
    vote: stop::Vote,
}

impl Session {
    /// Trains to the end, saving into `out_dir` at `save_every` and at the end; continues
    /// from the checkpoint that `train.resume` names, if any.
    pub fn train(&self, out_dir: &Path) -> Result<RunSummary> {
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
        let t = &self.recipe.train;
        let mut run = Run::start(self, out_dir, resume)?;
        let dev = &self.model.device;
        // pairs of parked gate and up in flight (ckpt mlp) as the preflight's plan fits them
        let park = self.memory.forecast.as_ref().map(|b| b.park_pending);
        let keep =
            Keep::new(t.activation_checkpointing, t.offload_activations, dev).with_park(park);
        let dropout = (self.recipe.lora.dropout > 0.0).then_some(t.seed);
        let mut engine = Engine::new(
            &self.model,
            &*self.comm,
            self.shards.as_ref(),
            keep,
            t.max_grad_norm,
            dropout,
        );
        let mut steps = self.steps_from(run.at.cursor)?;
        let mut queued = run.at.step;
        let mut pending = None;
        loop {
            // ---- the next step's forward and backward, queued. A step that saves a checkpoint
            // is finished first: an out-of-memory in the next step must not lose it.
            let eager = pending.is_some() && run.saves_at(run.at.step + 1);
            let next = match eager || queued >= run.total {
                true => None,
                false => steps.next().transpose()?,
            };
            let work = match next {
                Some(st) => {
                    let q = engine.backward(&st.batches, st.denom, queued);
                    let lr =
                        t.lr * schedule::lr_factor(t.schedule, queued, run.total, t.warmup_steps);
                    let cursor = Cursor {
                        epoch: st.epoch,
                        step_in_epoch: st.index + 1,
                    };
                    Some((run.oom(q, &engine.meter, queued)?, Queued { cursor, lr }))
                }
                None => None,
            };
            // ---- what the host does with the step before (its device work is done or queued)
            if let Some((p, info)) = pending.take() {
                let done = engine.finish(p, &mut run.opt)?;
                run.after_step(&done, &info, stop)?;
            }
            // ---- the queued step's update
            let Some((q, info)) = work else {
                if eager {
                    continue;
                }
                break;
            };
            let p = engine.update(q, &mut run.opt, info.lr);
            pending = Some((run.oom(p, &engine.meter, queued)?, info));
            queued += 1;
        }
        run.end()
    }
}

impl<'s> Run<'s> {
    fn start(s: &'s Session, out_dir: &'s Path, resume: Option<&Checkpoint>) -> Result<Run<'s>> {
        let t = &s.recipe.train;
        let total = s.total_steps();
        super::run_check::steps(s, total, resume.map_or(0, |c| c.state.cursor.epoch))?;
        let params = adapter_params(&s.model);
        let keys: Vec<String> = s
            .model
            .adapters()
            .flat_map(|(module, l)| export::adapter_keys(module, l))
            .map(|(key, _)| key)
            .collect();
        let mut opt = AdamW::new(params, t.betas, t.eps, t.weight_decay)?;
        s.set_cpu_budget();
        let mut at = Progress::default();
        if let Some(ck) = resume {
            super::checkpoint_check::state(s, ck, total)?;
            checkpoint::restore(ck, s, &mut opt, &keys)
                .with_context(|| format!("cannot resume from {}", ck.dir.display()))?;
            at = Progress::of(&ck.state);
        }
        let log = Log::open(s, out_dir, resume, total, at.step)?;
        Ok(Run {
            s,
            out_dir,
            total,
            opt,
            keys,
            log,
            saved: resume.map(|c| (c.state.step, c.dir.clone())),
            // The lead writes the checkpoints: its host buffers are pinned before the loop.
            writer: match s.recipe.output.save_every > 0 && s.comm.rank() == 0 {
                true => checkpoint_write::Writer::for_model(&s.model)?,
                false => checkpoint_write::Writer::default(),
            },
            losses: Vec::new(),
            last_eval: None,
            vote: stop::Vote::new(s.comm.world()),
            at,
        })
    }

    /// Whether step `step` saves a checkpoint (the last step's is the run's end).
    fn saves_at(&self, step: usize) -> bool {
        let every = self.s.recipe.output.save_every;
        every > 0 && step % every == 0
    }

    /// An allocation failure of step `queued` (0-based) as the run's diagnosis.
    fn oom<T>(&self, res: Result<T>, meter: &PhaseMeter, queued: usize) -> Result<T> {
        res.map_err(|e| match crate::memory::is_oom(&e) {
            true => self.s.out_of_memory(
                &e,
                meter,
                Some((queued + 1, self.total)),
                self.saved.as_ref().map(|(_, p)| p.clone()),
            ),
            false => e,
        })
    }

    /// Step `self.at.step + 1` is done: its loss checked, logged, evaluated, saved, and the
    /// run stopped there when `stop` says so.
    fn after_step(&mut self, d: &Done, q: &Queued, stop: &dyn Fn(usize) -> bool) -> Result<()> {
        let t = &self.s.recipe.train;
        if !d.finite {
            if !t.skip_nonfinite {
                return Err(stop::NonFinite {
                    step: self.at.step + 1,
                    total: self.total,
                    what: format!(
                        "the loss is {} and the gradient norm {}",
                        d.loss, d.grad_norm
                    ),
                    last_checkpoint: self.saved.as_ref().map(|(_, p)| p.clone()),
                    lr: t.lr,
                    dtype: format!("{:?}", self.s.model.dtype).to_lowercase(),
                    max_grad_norm: t.max_grad_norm,
                }
                .into());
            }
            self.at.skipped += 1;
        }
        let at = &mut self.at;
        at.step += 1;
        at.tokens += d.tokens;
        at.cursor = q.cursor;
        at.history.push((at.step, d.finite.then_some(d.loss)));
        self.losses.push(d.loss);
        self.log.count(d);
        let step = at.step;
        let last = step == self.total;
        // Eval every eval_every steps and at the end.
        let eval = match last || (t.eval_every > 0 && step % t.eval_every == 0) {
            true => self.s.eval_loss()?,
            false => None,
        };
        if let Some((l, _)) = eval {
            self.last_eval = Some(l);
        }
        if step % t.log_every == 0 || last || eval.is_some() || !d.finite {
            let row = Row {
                step,
                epoch: q.cursor.epoch,
                lr: q.lr,
                tokens: self.at.tokens,
                eval,
                skipped: self.at.skipped,
            };
            let data = &self.s.data;
            self.log.row(d, &row, data.truncated, data.skipped)?;
        }
        let lead = self.s.comm.rank() == 0;
        if lead && t.sample_every > 0 && (step % t.sample_every == 0 || last) {
            self.sample(step)?;
        }
        self.log.inc();
        if lead && self.saves_at(step) && !last {
            self.save()?;
        }
        // Rank 0 decides (signals); every rank stops at the same step (`stop::Vote`).
        let dev = &self.s.model.device;
        if !last && self.vote.stop(lead && stop(step), &*self.s.comm, dev)? {
            let dir = match (&self.saved, lead) {
                (Some((s, dir)), _) if *s == step => dir.clone(),
                (_, true) => self.save()?,
                (_, false) => checkpoint::dir_of(self.out_dir, step),
            };
            self.writer.wait()?;
            return Err(stop::Interrupted {
                step,
                total: self.total,
                checkpoint: dir,
            }
            .into());
        }
        Ok(())
    }

    /// `train.sample_every`: the greedy completions of `sample_prompts` by the model as it
    /// stands after `step` (adapters unmerged), printed and appended to samples.jsonl.
    fn sample(&self, step: usize) -> Result<()> {
        let s = self.s;
        let tok = s
            .tokenizer
            .as_ref()
            .context("train.sample_every needs the model's tokenizer")?;
        let rows =
            crate::generate::sample_rows(&s.model, tok, step, &s.recipe.train.sample_prompts)
                .with_context(|| format!("train.sample_every: cannot sample at step {step}"))?;
        for r in &rows {
            self.log.say(&format!(
                "sample @ step {step}: {:?} -> {:?}",
                r.prompt, r.completion
            ));
        }
        crate::generate::append_samples(&self.out_dir.join("samples.jsonl"), &rows)
    }

    /// A checkpoint of where the run stands, written (and old ones pruned) on the writer
    /// thread while the next steps run.
    fn save(&mut self) -> Result<PathBuf> {
        let state = TrainerState::new(self.s, &self.at, self.total, &self.opt);
        let snap =
            checkpoint::snapshot(self.s, &state, &self.opt, &self.keys, self.writer.stage()?)?;
        let (out, step) = (self.out_dir.to_owned(), self.at.step);
        let dir = checkpoint::dir_of(&out, step);
        let tmp = crate::util::tmp_path(&dir);
        let keep_last = self.s.recipe.output.keep_last;
        let prune = move || checkpoint::prune(&out, keep_last, step);
        self.writer.start(snap, tmp, dir.clone(), prune)?;
        self.saved = Some((step, dir.clone()));
        Ok(dir)
    }

    /// After the last step: the adapter (and a final checkpoint when the run saves them).
    fn end(mut self) -> Result<RunSummary> {
        let s = self.s;
        let lead = s.comm.rank() == 0;
        if lead {
            export::save_adapter(
                self.out_dir,
                &s.model,
                &s.spec,
                &s.base_name,
                s.base_revision.as_deref(),
            )?;
            let saves = s.recipe.output.save_every > 0;
            if saves
                && self
                    .saved
                    .as_ref()
                    .is_none_or(|(st, _)| *st != self.at.step)
            {
                self.save()?;
            }
        }
        self.writer.wait()?;
        if self.at.skipped > 0 && lead {
            crate::errln!(
                "skipped {} of {} steps with a non-finite loss or gradient",
                self.at.skipped,
                self.total
            );
        }
        let (_, seconds) = self.log.rate();
        Ok(RunSummary {
            steps: self.at.step,
            losses: self.losses,
            out_dir: self.out_dir.to_owned(),
            tokens: self.log.session_tokens(),
            seconds,
            truncated: s.data.truncated,
            eval_loss: self.last_eval,
            skipped: s.data.skipped,
        })
    }
}

impl Session {
    /// train.max_memory on the CPU caps an accounting of tensor bytes: the model and the f32
    /// adapter state (weights, AdamW m and v, gradients) plus what the driver holds.
    fn set_cpu_budget(&self) {
        let cap = self
            .recipe
            .max_memory()
            .filter(|_| self.model.device.is_cpu());
        crate::memory::set_cpu_budget(cap, super::preflight::cpu_fixed_bytes(&self.model));
    }
}
