//! What `train` trains on: the data set, the eval set, the sampler that orders them into
//! steps for every rank, and the tokenizer they (or `train.sample_every`) need, loaded as the
//! run's data plan (`RunConfig::data`) says. `Steps` is the loop's batch source for `train`
//! (bench's is random rows: bench::rows).

use super::checkpoint::Cursor;
use super::eval;
use super::pref_precompute::RefStore;
use super::run_loop::PlannedStep;
use super::session::Session;
use crate::data::pref_set::PrefSet;
use crate::data::preference::PrefSpec;
use crate::data::{Batch, DataPlan, Dataset, ExampleRef, RecipeData, Sampler, TextTokenizer};
use crate::hub::ModelFiles;
use crate::recipe::DataSection;
use anyhow::{Context, Result};

/// The data of one rank's run.
pub struct TrainData {
    /// The training set.
    pub data: Dataset,
    /// The eval set (data.eval, or held out by data.eval_fraction).
    pub eval: Option<Dataset>,
    /// The epochs' order of the training rows.
    pub(crate) sampler: Sampler,
    /// What loading the data found worth telling: skipped rows, dropped examples, how
    /// chat turns end.
    pub(crate) notes: Vec<String>,
    /// The model's tokenizer, when the data or `train.sample_every` needs it.
    pub(crate) tokenizer: Option<TextTokenizer>,
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
    /// tokenizer, checked to have something to train on.
    pub fn load(s: &Session) -> Result<TrainData> {
        let run = &s.run;
        let cfg = run
            .data
            .clone()
            .context("this run has no data plan (bench and probe run on random rows)")?;
        let files = match &s.base_dir {
            Some(dir) => ModelFiles::local(dir)?,
            None => anyhow::bail!("a run on random weights has no tokenizer to read its data with"),
        };
        let t0 = std::time::Instant::now();
        let plan = DataPlan {
            recipe: &run.recipe,
            data: &cfg,
            sample_every: run.hooks.sample_every,
            seed: run.seed,
        };
        let (data, eval, notes, tokenizer, pref) = match run.objective.is_pref() {
            true => {
                let tokenizer = crate::data::recipe_tokenizer(&plan, &files)?;
                let spec = PrefSpec {
                    tok: tokenizer.as_ref(),
                    max_len: cfg.seq_len,
                    max_prompt_len: cfg.max_prompt_len,
                    vocab_size: run.cfg.vocab_size,
                };
                let (data, set) = PrefSet::load(&cfg, &spec, run.objective.is_kto())?;
                let notes = set.notes.clone();
                (data, None, notes, tokenizer, Some(set))
            }
            false => {
                let opts = crate::data::Options::from_env()?;
                let RecipeData {
                    data,
                    eval,
                    notes,
                    tokenizer,
                } = crate::data::recipe_data(&plan, &files, run.cfg.vocab_size, &opts)?;
                super::run_check::something_to_train(&cfg, &data)?;
                (data, eval, notes, tokenizer, None)
            }
        };
        let sampler = Sampler::new(&data, &cfg, run.seed);
        Ok(TrainData {
            data,
            eval,
            sampler,
            notes,
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
    pub(crate) fn epoch_plan(&self, epoch: usize) -> Vec<Vec<Vec<Vec<usize>>>> {
        self.epoch_plan_of(epoch, self.rank)
    }

    /// Rank `rank`'s steps of one epoch (rows rank, rank + world, ... of the epoch's order).
    pub(crate) fn epoch_plan_of(&self, epoch: usize, rank: usize) -> Vec<Vec<Vec<Vec<usize>>>> {
        let rows = self.sampler.rows_for(epoch, rank, self.world);
        let micro: Vec<Vec<Vec<usize>>> =
            rows.chunks(self.micro_batch).map(|c| c.to_vec()).collect();
        micro.chunks(self.grad_accum).map(|c| c.to_vec()).collect()
    }

    /// The run's steps: train.max_steps, else the epochs' steps.
    pub(crate) fn total_steps(&self) -> usize {
        self.max_steps
            .unwrap_or_else(|| self.epoch_plan(0).len() * self.epochs.unwrap_or(1))
    }

    /// Counted tokens of each step of an epoch over all ranks: the loss denominator, which
    /// every rank computes alone since every rank sees the whole order.
    pub(crate) fn step_denoms(&self, epoch: usize) -> Vec<usize> {
        let mut d: Vec<usize> = Vec::new();
        for rank in 0..self.world {
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

    /// The micro-batch of `rows` (each a row's example indices).
    pub fn batch(&self, rows: &[Vec<usize>]) -> Batch {
        if let Some(p) = &self.pref {
            return p.batch(
                rows,
                self.pad_id,
                self.cfg.seq_len,
                self.score_chosen_prompt,
            );
        }
        let rows: Vec<Vec<ExampleRef>> = rows
            .iter()
            .map(|r| r.iter().map(|&i| self.data.examples.get(i)).collect())
            .collect();
        Batch::from_rows(&rows, self.pad_id, self.cfg.pack)
    }

    /// This rank's steps from `cursor` on, epoch after epoch, as batches with the step's loss
    /// denominator (its counted tokens over every rank).
    pub fn steps_from(&self, cursor: Cursor) -> Result<Steps<'_>> {
        Ok(Steps {
            s: self,
            epoch: cursor.epoch,
            first: cursor.step_in_epoch,
            plan: Vec::new().into_iter(),
            denoms: Vec::new(),
            started: false,
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
}

impl Iterator for Steps<'_> {
    type Item = Result<PlannedStep>;

    fn next(&mut self) -> Option<Result<PlannedStep>> {
        let s = self.s;
        let (index, rows) = loop {
            if let Some(x) = self.plan.next() {
                break x;
            }
            if self.started {
                self.epoch += 1;
                self.first = 0;
            }
            self.started = true;
            let plan = s.epoch_plan(self.epoch);
            if plan.is_empty() {
                return Some(Err(empty_epoch(s, self.epoch)));
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
                _ => s.step_denoms(self.epoch),
            };
        };
        let batches: Vec<Batch> = rows
            .iter()
            .enumerate()
            .map(|(k, m)| match &s.reference {
                Some(r) => r.attach(s.batch(m), (self.epoch, index, s.rank, k)),
                None => s.batch(m),
            })
            .collect();
        let denom = match s.world {
            1 => batches.iter().map(Batch::n_targets).sum(),
            _ => self.denoms.get(index).copied().unwrap_or(0),
        };
        Some(Ok(PlannedStep {
            epoch: self.epoch,
            index,
            batches,
            denom,
        }))
    }
}

/// An epoch with no step for this rank: too few rows for the ranks and batch.
fn empty_epoch(s: &TrainData, epoch: usize) -> anyhow::Error {
    let world = s.world;
    let rows = s.sampler.rows(epoch).len();
    anyhow::anyhow!(
        "epoch {epoch} has no step: the data gives {rows} rows and a step takes {} per rank × {world} rank(s) (micro_batch {} × grad_accum {}); add data, or lower train.micro_batch, train.grad_accum or the number of ranks",
        s.micro_batch * s.grad_accum,
        s.micro_batch,
        s.grad_accum
    )
}
