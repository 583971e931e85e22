//! What `train` trains on: the data set, the eval set, the sampler that orders them into
//! steps for every rank, and the tokenizer they (or `train.sample_every`) need, loaded as the
//! run's data plan (`RunConfig::data`) says. `Steps` is the loop's batch source for `train`
//! (bench's is random rows: bench::rows).
//!
//! Streaming start (`TrainData::load_run`): when the first epoch reads the examples in file
//! order (no shuffle, every mix weight 1, no eval split of the training set), `train.max_steps`
//! fixes the run's length, the run is one rank and starts fresh, and the cache does not hold the
//! data yet, the training set is tokenized on a thread of its own (`data::stream`) while the
//! first epoch's steps are made from the examples as they land (`first_epoch.rs`). What needs
//! every example (the sampler, the counts and notes, a checkpoint's data fingerprint, the
//! epochs after the first, the end of the run) waits for the preparation: `TrainData::ready`.

use super::eval;
use super::first_epoch::FirstEpoch;
use super::pref_precompute::RefStore;
use super::run_config::RunConfig;
use super::run_loop::PlannedStep;
use super::session::Session;
use crate::data::load::{data_notes, stream_blocker, Train};
use crate::data::pref_set::PrefSet;
use crate::data::preference::PrefSpec;
use crate::data::stream::{Stream, View};
use crate::data::{Batch, DataPlan, Dataset, ExampleRef, RecipeData, Sampler, TextTokenizer};
use crate::hub::ModelFiles;
use crate::recipe::DataSection;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Instant;

/// Where the data stream continues: the next step is step `step_in_epoch` (0-based) of the
/// plan of epoch `epoch` (TrainData::epoch_plan).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    /// The epoch, 0-based.
    pub epoch: usize,
    /// The next step within it, 0-based.
    pub step_in_epoch: usize,
}

/// The training set once it is prepared: its examples, their epochs' order, the notes.
pub struct Ready {
    /// The training set.
    pub data: Dataset,
    /// The epochs' order of the training rows.
    pub(crate) sampler: Sampler,
    /// What loading the data found worth telling: skipped rows, dropped examples, how
    /// chat turns end.
    pub(crate) notes: Vec<String>,
}

/// The data of one rank's run.
pub struct TrainData {
    /// The training set, once prepared (a streaming run's when its preparation ends: see
    /// [`TrainData::ready`]).
    ready: OnceLock<Ready>,
    /// A streaming run's preparation, until it is waited for.
    stream: Mutex<Option<Stream>>,
    /// A streaming run's examples as they land.
    pub(crate) view: Option<View>,
    /// When preparing the data began.
    pub(crate) t_prep: Instant,
    /// The run it was loaded for (a streaming run's checks made when the data is ready).
    run: Arc<RunConfig>,
    /// The eval set (data.eval, or held out by data.eval_fraction).
    pub eval: Option<Dataset>,
    /// The model's tokenizer, when the data or `train.sample_every` needs it.
    pub(crate) tokenizer: Option<Arc<TextTokenizer>>,
    /// The token padding rows end with.
    pub(crate) pad_id: u32,
    /// The data plan it was loaded by.
    pub(crate) cfg: DataSection,
    /// Rows per micro-batch, micro-batches per step, steps of the run, epochs.
    pub(crate) micro_batch: usize,
    pub(crate) grad_accum: usize,
    pub(crate) max_steps: Option<usize>,
    pub(crate) epochs: Option<usize>,
    /// This rank and the world (every rank sees the whole order; rank r takes rows r, r +
    /// world, ...).
    pub rank: usize,
    /// Ranks in the run.
    pub world: usize,
    /// Seconds loading took (the tokenizer, tokenizing or mapping the cache, the eval split).
    pub load_s: f64,
    /// A preference objective's pairs (or KTO's examples): `data` is then their stand-in for
    /// the sampler (`data::pref_set`), and `batch` lays them out.
    pub pref: Option<PrefSet>,
    /// ORPO: the chosen prompts are scored too.
    pub score_chosen_prompt: bool,
    /// `train.precompute_ref`: the reference's log-probabilities of every micro-batch the
    /// steps take (`pref_precompute`), laid into each batch as `Steps` makes it.
    pub(crate) reference: Option<RefStore>,
}

impl TrainData {
    /// Rank `s.comm.rank()`'s data: tokenized as the run's data plan says, with the base's
    /// tokenizer, checked to have something to train on (prepared whole: never streamed).
    pub fn load(s: &Session) -> Result<TrainData> {
        Self::load_with(s, &crate::data::Options::from_env()?, false)
    }

    /// [`TrainData::load`] for a run: its training set streams when the run can (see the
    /// module docs; `resuming`: the run continues from a checkpoint, and does not).
    pub fn load_run(s: &Session, resuming: bool) -> Result<TrainData> {
        Self::load_with(s, &crate::data::Options::from_env()?, !resuming)
    }

    /// [`TrainData::load`] through the cache `opts` names; `may_stream`: the training set
    /// streams when the run can (see the module docs).
    pub fn load_with(
        s: &Session,
        opts: &crate::data::Options,
        may_stream: bool,
    ) -> Result<TrainData> {
        let run = &s.run;
        let cfg = run
            .data
            .clone()
            .context("this run has no data plan (bench and probe run on random rows)")?;
        let files = match &s.base_dir {
            Some(dir) => ModelFiles::local(dir)?,
            None => anyhow::bail!("a run on random weights has no tokenizer to read its data with"),
        };
        let t0 = Instant::now();
        let plan = DataPlan {
            recipe: &run.recipe,
            data: &cfg,
            sample_every: run.hooks.sample_every,
            seed: run.seed,
        };
        let streams = may_stream
            && opts.stream
            && !run.objective.is_pref()
            && run.batch.max_steps.is_some()
            && s.comm.world() == 1
            && stream_blocker(&cfg).is_none();
        let mut stream = None;
        let (ready, eval, tokenizer, pref) = match (run.objective.is_pref(), streams) {
            (true, _) => {
                let tokenizer = crate::data::recipe_tokenizer(&plan, &files)?;
                let spec = PrefSpec {
                    tok: tokenizer.as_ref(),
                    max_len: cfg.seq_len,
                    max_prompt_len: cfg.max_prompt_len,
                    vocab_size: run.cfg.vocab_size,
                };
                let (data, set) = PrefSet::load(&cfg, &spec, run.objective.is_kto())?;
                let notes = set.notes.clone();
                let sampler = Sampler::new(&data, &cfg, run.seed);
                let ready = Ready {
                    data,
                    sampler,
                    notes,
                };
                (Some(ready), None, tokenizer.map(Arc::new), Some(set))
            }
            (false, false) => {
                let RecipeData {
                    data,
                    eval,
                    notes,
                    tokenizer,
                } = crate::data::recipe_data(&plan, &files, run.cfg.vocab_size, opts)?;
                super::run_check::something_to_train(&cfg, &data)?;
                let sampler = Sampler::new(&data, &cfg, run.seed);
                let ready = Ready {
                    data,
                    sampler,
                    notes,
                };
                (Some(ready), eval, tokenizer.map(Arc::new), None)
            }
            (false, true) => {
                let d =
                    crate::data::recipe_data_streaming(&plan, &files, run.cfg.vocab_size, opts)?;
                let ready = match d.train {
                    Train::Ready(data) => {
                        let data = *data;
                        super::run_check::something_to_train(&cfg, &data)?;
                        let notes =
                            data_notes(&data, d.eval.as_ref(), d.tokenizer.as_deref(), &cfg);
                        let sampler = Sampler::new(&data, &cfg, run.seed);
                        Some(Ready {
                            data,
                            sampler,
                            notes,
                        })
                    }
                    Train::Streaming(st) => {
                        stream = Some(st);
                        None
                    }
                };
                (ready, d.eval, d.tokenizer, None)
            }
        };
        let view = stream.as_ref().map(Stream::view);
        Ok(TrainData {
            ready: ready.map_or_else(OnceLock::new, OnceLock::from),
            stream: Mutex::new(stream),
            t_prep: view.as_ref().map_or(t0, |v| v.started),
            view,
            run: run.clone(),
            eval,
            tokenizer,
            pad_id: run.cfg.pad_token_id.unwrap_or(0),
            micro_batch: run.batch.micro_batch,
            grad_accum: run.batch.grad_accum,
            max_steps: run.batch.max_steps,
            epochs: run.batch.epochs,
            rank: s.comm.rank(),
            world: s.comm.world(),
            cfg,
            load_s: t0.elapsed().as_secs_f64(),
            pref,
            score_chosen_prompt: run.objective.scores_chosen_prompt(),
            reference: None,
        })
    }

    /// Whether the training set is still being prepared behind the steps.
    pub fn streaming(&self) -> bool {
        self.ready.get().is_none()
    }

    /// The training set prepared, its order and notes: a streaming run waits here for its
    /// preparation to end (then checks what a run that did not stream checks at load, and says
    /// what the preparation found).
    pub fn ready(&self) -> Result<&Ready> {
        if let Some(r) = self.ready.get() {
            return Ok(r);
        }
        let stream = self
            .stream
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .context("the data preparation failed earlier in this run")?;
        let data = stream.finish()?;
        let cfg = &self.cfg;
        super::run_check::something_to_train(cfg, &data)?;
        let notes = data_notes(&data, self.eval.as_ref(), self.tokenizer.as_deref(), cfg);
        let sampler = Sampler::new(&data, cfg, self.run.seed);
        let r = self.ready.get_or_init(|| Ready {
            data,
            sampler,
            notes,
        });
        if self.rank == 0 {
            crate::errln!(
                "data {}: {} examples ({} truncated to seq_len {}), {} steps an epoch",
                r.data.source.display(),
                r.data.examples.len(),
                r.data.truncated,
                cfg.seq_len,
                self.epoch_plan(0)?.len()
            );
            r.notes.iter().for_each(|n| crate::errln!("{n}"));
        }
        let total = self.total_steps()?;
        super::run_check::steps(&self.run, self, total, 0)?;
        Ok(r)
    }

    /// The training set (a streaming run's once prepared: see [`TrainData::ready`]).
    pub fn data(&self) -> Result<&Dataset> {
        Ok(&self.ready()?.data)
    }

    /// Examples cut to seq_len and bad rows skipped: of the whole set, or while it streams of
    /// the rows tokenized so far.
    pub(crate) fn counts(&self) -> (usize, usize) {
        match (self.ready.get(), &self.view) {
            (Some(r), _) => (r.data.truncated, r.data.skipped),
            (None, Some(v)) => v.counts(),
            (None, None) => (0, 0),
        }
    }

    /// Mean token cross-entropy over the eval set (no dropout, no gradients) and its number
    /// of tokens; None without an eval set.
    pub fn eval_loss(&self, s: &Session) -> Result<Option<(f64, usize)>> {
        let Some(ev) = &self.eval else {
            return Ok(None);
        };
        let cfg = DataSection {
            shuffle: false,
            ..self.cfg.clone()
        };
        let rows = Sampler::new(ev, &cfg, 0).rows(0);
        let (mut sum, mut n) = (0.0, 0);
        for chunk in rows.chunks(self.micro_batch) {
            let rows: Vec<Vec<ExampleRef>> = chunk
                .iter()
                .map(|r| r.iter().map(|&i| ev.examples.get(i)).collect())
                .collect();
            let b = Batch::from_rows(&rows, self.pad_id, cfg.pack);
            sum += eval::ce_sum_par(&s.model, &s.par(false), &b)?;
            n += b.n_targets();
        }
        Ok(Some((sum / n.max(1) as f64, n)))
    }

    /// This rank's steps of one epoch: steps → micro-batches → rows → example indices.
    pub(crate) fn epoch_plan(&self, epoch: usize) -> Result<Vec<Vec<Vec<Vec<usize>>>>> {
        self.epoch_plan_of(epoch, self.rank)
    }

    /// Rank `rank`'s steps of one epoch (rows rank, rank + world, ... of the epoch's order).
    pub(crate) fn epoch_plan_of(
        &self,
        epoch: usize,
        rank: usize,
    ) -> Result<Vec<Vec<Vec<Vec<usize>>>>> {
        let rows = self.ready()?.sampler.rows_for(epoch, rank, self.world);
        let micro: Vec<Vec<Vec<usize>>> =
            rows.chunks(self.micro_batch).map(|c| c.to_vec()).collect();
        Ok(micro.chunks(self.grad_accum).map(|c| c.to_vec()).collect())
    }

    /// The run's steps: train.max_steps, else the epochs' steps.
    pub(crate) fn total_steps(&self) -> Result<usize> {
        match self.max_steps {
            Some(n) => Ok(n),
            None => Ok(self.epoch_plan(0)?.len() * self.epochs.unwrap_or(1)),
        }
    }

    /// Counted tokens of each step of an epoch over all ranks: the loss denominator, which
    /// every rank computes alone since every rank sees the whole order.
    pub(crate) fn step_denoms(&self, epoch: usize) -> Result<Vec<usize>> {
        let mut d: Vec<usize> = Vec::new();
        for rank in 0..self.world {
            for (i, step) in self.epoch_plan_of(epoch, rank)?.iter().enumerate() {
                if d.len() <= i {
                    d.resize(i + 1, 0);
                }
                for m in step {
                    d[i] += self.batch(m)?.n_targets();
                }
            }
        }
        Ok(d)
    }

    /// The micro-batch of `rows` (each a row's example indices).
    pub fn batch(&self, rows: &[Vec<usize>]) -> Result<Batch> {
        if let Some(p) = &self.pref {
            return Ok(p.batch(
                rows,
                self.pad_id,
                self.cfg.seq_len,
                self.score_chosen_prompt,
            ));
        }
        let data = self.data()?;
        let rows: Vec<Vec<ExampleRef>> = rows
            .iter()
            .map(|r| r.iter().map(|&i| data.examples.get(i)).collect())
            .collect();
        Ok(Batch::from_rows(&rows, self.pad_id, self.cfg.pack))
    }

    /// This rank's steps from `cursor` on, epoch after epoch, as batches with the step's loss
    /// denominator (its counted tokens over every rank).
    pub fn steps_from(&self, cursor: Cursor) -> Result<Steps<'_>> {
        let fresh = cursor.epoch == 0 && cursor.step_in_epoch == 0;
        let first = match (&self.view, fresh && self.streaming()) {
            (Some(v), true) => Some(FirstEpoch::new(v.clone(), &self.cfg)),
            _ => None,
        };
        Ok(Steps {
            s: self,
            epoch: cursor.epoch,
            first: cursor.step_in_epoch,
            plan: Vec::new().into_iter(),
            denoms: Vec::new(),
            started: first.is_some(),
            streamed: first,
            told: false,
        })
    }
}

/// `TrainData::steps_from`'s iterator: the batch source of `train`'s loop.
pub struct Steps<'a> {
    s: &'a TrainData,
    epoch: usize,
    /// The step of `epoch` to start at (a resumed run's cursor).
    first: usize,
    plan: std::vec::IntoIter<(usize, Vec<Vec<Vec<usize>>>)>,
    /// Several ranks: every step's denominator of `epoch` (each rank computes them alone,
    /// since every rank sees the whole order).
    denoms: Vec<usize>,
    started: bool,
    /// A streaming run's first epoch, until it is over.
    streamed: Option<FirstEpoch>,
    /// The first step's start was told.
    told: bool,
}

impl Iterator for Steps<'_> {
    type Item = Result<PlannedStep>;

    fn next(&mut self) -> Option<Result<PlannedStep>> {
        let step = self.step();
        let s = self.s;
        if !self.told && step.is_ok() {
            self.told = true;
            if s.rank == 0 {
                crate::errln!(
                    "first step starts {:.1}s after data preparation began{}",
                    s.t_prep.elapsed().as_secs_f64(),
                    match self.streamed.is_some() && s.streaming() {
                        true => " (streaming: the rest tokenizes behind the steps)",
                        false => "",
                    }
                );
            }
        }
        Some(step)
    }
}

impl Steps<'_> {
    /// The next step: of a streaming run's first epoch while it lasts, else of the epochs'
    /// plans.
    fn step(&mut self) -> Result<PlannedStep> {
        let s = self.s;
        if let Some(f) = &mut self.streamed {
            if let Some((index, micro)) = f.next(s.micro_batch, s.grad_accum)? {
                let batches = micro
                    .iter()
                    .map(|m| f.batch(m, s.pad_id))
                    .collect::<Result<Vec<_>>>()?;
                let denom = batches.iter().map(Batch::n_targets).sum();
                if denom == 0 {
                    // Nothing to predict yet: a set with nothing at all fails as it does
                    // when it does not stream.
                    s.ready()?;
                }
                return Ok(PlannedStep {
                    epoch: 0,
                    index,
                    batches,
                    denom,
                });
            }
            // The first epoch is over: the next ones are planned from the prepared set.
            self.streamed = None;
        }
        let (index, rows) = loop {
            if let Some(x) = self.plan.next() {
                break x;
            }
            if self.started {
                self.epoch += 1;
                self.first = 0;
            }
            self.started = true;
            let plan = s.epoch_plan(self.epoch)?;
            if plan.is_empty() {
                return Err(empty_epoch(s, self.epoch));
            }
            // A resumed cursor at its epoch's end goes on with the next epoch.
            self.plan = plan
                .into_iter()
                .enumerate()
                .skip(self.first)
                .collect::<Vec<_>>()
                .into_iter();
            self.denoms = match s.world {
                1 => Vec::new(),
                _ => s.step_denoms(self.epoch)?,
            };
        };
        let batches = rows
            .iter()
            .enumerate()
            .map(|(k, m)| {
                let b = s.batch(m)?;
                Ok(match &s.reference {
                    Some(r) => r.attach(b, (self.epoch, index, s.rank, k)),
                    None => b,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let denom = match s.world {
            1 => batches.iter().map(Batch::n_targets).sum(),
            _ => self.denoms.get(index).copied().unwrap_or(0),
        };
        Ok(PlannedStep {
            epoch: self.epoch,
            index,
            batches,
            denom,
        })
    }
}

/// An epoch with no step for this rank: too few rows for the ranks and batch.
fn empty_epoch(s: &TrainData, epoch: usize) -> anyhow::Error {
    let world = s.world;
    let rows = s.ready().map_or(0, |r| r.sampler.rows(epoch).len());
    anyhow::anyhow!(
        "epoch {epoch} has no step: the data gives {rows} rows and a step takes {} per rank × {world} rank(s) (micro_batch {} × grad_accum {}); add data, or lower train.micro_batch, train.grad_accum or the number of ranks",
        s.micro_batch * s.grad_accum,
        s.micro_batch,
        s.grad_accum
    )
}
