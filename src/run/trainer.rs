//! `train`'s side of the loop (train::run_loop): the data's steps, and between them the log,
//! eval, samples, checkpoints and stops; at the end the adapter.

use super::checkpoint::{self, Checkpoint, Progress, TrainerState};
use super::checkpoint_write;
use super::log::{Log, Row};
use super::RunSummary;
use crate::export;
use crate::train::meter::PhaseMeter;
use crate::train::optim::AdamW;
use crate::train::run_loop::{self, Hooks, StepMeta};
use crate::train::session::Session;
use crate::train::step::{adapter_params, Done, Engine};
use crate::train::train_data::Cursor;
use crate::train::train_data::TrainData;
use crate::train::{schedule, stop};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

impl Session {
    /// Trains on `data` to the end, saving into `out_dir` at `save_every` and at the end;
    /// continues from the checkpoint that `train.resume` names, if any.
    pub fn train(&self, data: &TrainData, out_dir: &Path) -> Result<RunSummary> {
        let resume = checkpoint::resume_point(&self.run.recipe, out_dir)?;
        self.train_from(data, out_dir, resume.as_ref(), &|_| false)
    }

    /// `train`, from `resume` (else from the start, removing the checkpoints in `out_dir`:
    /// `checkpoint::resume_point` is what refuses to start over an unfinished run). After each
    /// step but the last, `stop(step)` is asked whether to save a checkpoint and return
    /// `stop::Interrupted`.
    pub fn train_from(
        &self,
        data: &TrainData,
        out_dir: &Path,
        resume: Option<&Checkpoint>,
        stop: &dyn Fn(usize) -> bool,
    ) -> Result<RunSummary> {
        let mut t = Trainer::start(self, data, out_dir, resume, stop)?;
        // pairs of parked gate and up in flight (ckpt mlp) as the preflight's plan fits them
        let park = self.memory.forecast.as_ref().map(|b| b.park_pending);
        let mut engine = Engine::for_session(self, self.run.keep.with_park(park));
        let mut steps = data.steps_from(t.at.cursor)?;
        let mut opt = t.opt.take().context("the trainer's optimiser")?;
        let span = (t.at.step, t.total);
        let res = run_loop::run(&mut engine, &mut opt, &mut steps, span, &mut t);
        t.opt = Some(opt);
        res?;
        t.end()
    }
}

/// The train hooks' state: the optimiser, where the run stands, the log, the checkpoints.
struct Trainer<'s> {
    s: &'s Session,
    data: &'s TrainData,
    out_dir: &'s Path,
    stop: &'s dyn Fn(usize) -> bool,
    total: usize,
    /// The optimiser (lent to the loop while it runs).
    opt: Option<AdamW>,
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

impl<'s> Trainer<'s> {
    fn start(
        s: &'s Session,
        data: &'s TrainData,
        out_dir: &'s Path,
        resume: Option<&Checkpoint>,
        stop: &'s dyn Fn(usize) -> bool,
    ) -> Result<Trainer<'s>> {
        let o = &s.run.optim;
        let total = data.total_steps()?;
        // A streaming run checks its steps when its data is ready (TrainData::ready).
        if !data.streaming() {
            let epoch = resume.map_or(0, |c| c.state.cursor.epoch);
            crate::train::run_check::steps(&s.run, data, total, epoch)?;
        }
        let keys: Vec<String> = s
            .model
            .adapters()
            .flat_map(|(module, l)| export::adapter_keys(module, l))
            .map(|(key, _)| key)
            .collect();
        let mut opt = AdamW::new(adapter_params(&s.model), o.betas, o.eps, o.weight_decay)?;
        set_cpu_budget(s);
        let mut at = Progress::default();
        if let Some(ck) = resume {
            super::checkpoint_check::state(s, data, ck, total)?;
            checkpoint::restore(ck, s, &mut opt, &keys)
                .with_context(|| format!("cannot resume from {}", ck.dir.display()))?;
            at = Progress::of(&ck.state);
        }
        let log = Log::open(s, out_dir, resume, total, at.step)?;
        let lead = s.comm.rank() == 0;
        Ok(Trainer {
            s,
            data,
            out_dir,
            stop,
            total,
            opt: Some(opt),
            keys,
            log,
            saved: resume.map(|c| (c.state.step, c.dir.clone())),
            // The lead writes the checkpoints: its host buffers are pinned before the loop.
            writer: match s.run.output.save_every > 0 && lead {
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
        let every = self.s.run.output.save_every;
        every > 0 && step % every == 0
    }

    /// A non-finite step: the run's error, unless such steps are skipped (then counted).
    fn non_finite(&mut self, d: &Done) -> Result<()> {
        let run = &self.s.run;
        if run.hooks.skip_nonfinite {
            self.at.skipped += 1;
            return Ok(());
        }
        Err(stop::NonFinite {
            step: self.at.step + 1,
            total: self.total,
            what: format!(
                "the loss is {} and the gradient norm {}",
                d.loss, d.grad_norm
            ),
            last_checkpoint: self.saved.as_ref().map(|(_, p)| p.clone()),
            lr: run.optim.lr,
            dtype: format!("{:?}", self.s.model.dtype).to_lowercase(),
            max_grad_norm: run.optim.max_grad_norm,
        }
        .into())
    }

    /// `train.sample_every`: the greedy completions of `sample_prompts` by the model as it
    /// stands after `step` (adapters unmerged), printed and appended to samples.jsonl.
    fn sample(&self, step: usize) -> Result<()> {
        let s = self.s;
        let tok = self
            .data
            .tokenizer
            .as_ref()
            .context("train.sample_every needs the model's tokenizer")?;
        let prompts = &s.run.hooks.sample_prompts;
        let rows = crate::generate::sample_rows(&s.model, tok, step, prompts)
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
    fn save(&mut self, opt: &AdamW) -> Result<PathBuf> {
        let (s, d) = (self.s, self.data);
        let state = TrainerState::new(s, d, &self.at, self.total, opt)?;
        let snap = checkpoint::snapshot(s, &state, opt, &self.keys, self.writer.stage()?)?;
        let (out, step) = (self.out_dir.to_owned(), self.at.step);
        let dir = checkpoint::dir_of(&out, step);
        let tmp = crate::util::tmp_path(&dir);
        let keep_last = s.run.output.keep_last;
        let prune = move || checkpoint::prune(&out, keep_last, step);
        self.writer.start(snap, tmp, dir.clone(), prune)?;
        self.saved = Some((step, dir.clone()));
        Ok(dir)
    }

    /// After the last step: the adapter (and a final checkpoint when the run saves them).
    fn end(mut self) -> Result<RunSummary> {
        let s = self.s;
        // A streaming run ends once its data is prepared (and cached), or with its error.
        let whole: &TrainData = self.data;
        let data = whole.data()?;
        let lead = s.comm.rank() == 0;
        if lead {
            let run = &s.run;
            let rev = s.base_revision.as_deref();
            let base = run.base_name_in(self.out_dir);
            export::save_adapter(self.out_dir, &s.model, &run.spec, &base, rev)?;
            let last = self
                .saved
                .as_ref()
                .is_none_or(|(st, _)| *st != self.at.step);
            if run.output.save_every > 0 && last {
                let opt = self.opt.take().context("the trainer's optimiser")?;
                self.save(&opt)?;
            }
        }
        self.writer.wait()?;
        self.log.finish();
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
            truncated: data.truncated,
            eval_loss: self.last_eval,
            skipped: data.skipped,
        })
    }
}

impl Hooks for Trainer<'_> {
    fn lr(&self, step: usize) -> f64 {
        let o = &self.s.run.optim;
        o.lr * schedule::lr_factor(o.schedule, step, self.total, o.warmup_steps)
    }

    /// A step that saves a checkpoint is finished first: an out-of-memory in the next step
    /// must not lose it.
    fn finish_first(&self, n: usize) -> bool {
        self.saves_at(n)
    }

    /// Step `m.n` is done: its loss checked, logged, evaluated, saved, and the run stopped
    /// there when `stop` says so.
    fn after(&mut self, d: Done, m: &StepMeta, opt: &AdamW) -> Result<()> {
        let hooks = &self.s.run.hooks;
        if !d.finite {
            self.non_finite(&d)?;
        }
        let at = &mut self.at;
        at.step += 1;
        at.tokens += d.tokens;
        at.cursor = Cursor {
            epoch: m.epoch,
            step_in_epoch: m.index + 1,
        };
        at.history.push((at.step, d.finite.then_some(d.loss)));
        self.losses.push(d.loss);
        self.log.count(&d);
        let step = at.step;
        let last = step == self.total;
        // Eval every eval_every steps and at the end.
        let eval = match last || (hooks.eval_every > 0 && step % hooks.eval_every == 0) {
            true => self.data.eval_loss(self.s)?,
            false => None,
        };
        if let Some((l, _)) = eval {
            self.last_eval = Some(l);
        }
        if step % hooks.log_every == 0 || last || eval.is_some() || !d.finite {
            let row = Row {
                step,
                epoch: m.epoch,
                lr: m.lr,
                tokens: self.at.tokens,
                eval,
                skipped: self.at.skipped,
            };
            let (truncated, skipped) = self.data.counts();
            self.log.row(&d, &row, truncated, skipped)?;
        }
        let lead = self.s.comm.rank() == 0;
        if lead && hooks.sample_every > 0 && (step % hooks.sample_every == 0 || last) {
            self.sample(step)?;
        }
        self.log.inc();
        if lead && self.saves_at(step) && !last {
            self.save(opt)?;
        }
        // Rank 0 decides (signals); every rank stops at the same step (`stop::Vote`).
        let dev = &self.s.model.device;
        if !last
            && self
                .vote
                .stop(lead && (self.stop)(step), &*self.s.comm, dev)?
        {
            let dir = match (&self.saved, lead) {
                (Some((s, dir)), _) if *s == step => dir.clone(),
                (_, true) => self.save(opt)?,
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

    /// An allocation failure of step `step` (0-based) as the run's diagnosis.
    fn fail(&self, e: anyhow::Error, meter: &PhaseMeter, step: usize) -> anyhow::Error {
        match crate::ops::pool::is_oom(&e) {
            true => self.s.out_of_memory(
                &e,
                meter,
                Some((step + 1, self.total)),
                self.saved.as_ref().map(|(_, p)| p.clone()),
            ),
            false => e,
        }
    }
}

/// train.max_memory on the CPU caps an accounting of tensor bytes: the model and the f32
/// adapter state (weights, AdamW m and v, gradients) plus what the driver holds.
fn set_cpu_budget(s: &Session) {
    let cap = s.run.max_memory.filter(|_| s.model.device.is_cpu());
    crate::ops::pool::set_cpu_budget(cap, crate::train::meter::cpu_fixed_bytes(&s.model));
}
