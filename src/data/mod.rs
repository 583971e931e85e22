//! Training data: files (jsonl, json, parquet; local or a Hub data set's) → records →
//! examples (token ids + labels) → rows → micro-batches.
//!
//! Labels follow transformers: `labels[t]` is the token at position t, and the loss at
//! position t predicts `labels[t + 1]`; -100 is ignored. Rows shorter than the batch are
//! padded with label -100; rows longer than seq_len are truncated and counted.
//!
//! Formats (`[data] format`, or per file of a mix):
//! - "tokens": {"input_ids": [...], "labels": [...]?}, labels default to input_ids.
//! - "text": {"text": "..."}, tokenized with BOS / EOS as tokenizer_config.json says.
//! - "alpaca": {"instruction", "input"?, "output"}: the prompt is [`alpaca_prompt`], the
//!   completion is the output followed by the EOS token.
//! - "completion": {prompt_field, completion_field}: prompt + completion + EOS.
//! - "chat": {"messages": [...]}: rendered with the chat template (see [`chat`]); ShareGPT
//!   rows {"conversations": [{"from", "value"}]} become messages (see [`columns`]).
//!
//! `[data] columns` names the data set's column for each of these fields.
//!
//! Prompt and completion are tokenized together, as one text; with train_on = "completions"
//! the tokens that overlap the completion (and the EOS after it) are targets, the rest -100.
//!
//! Tokenizing runs on every core ([`build`]) into the tokenized cache ([`cache`]), a file that
//! later runs map instead of tokenizing again; a data set's examples are read from it where a
//! batch needs them ([`store`]). A run whose first epoch reads the rows in file order starts
//! on the examples as they land while the rest are tokenized ([`stream`]).

mod batch;
mod build;
pub mod cache;
mod cache_file;
pub mod chat;
mod columns;
mod fnv;
pub mod load;
mod parquet;
pub mod pref_batch;
pub mod pref_set;
pub mod preference;
mod progress;
pub mod reader;
pub mod record;
mod rows;
mod sampler;
pub mod source;
mod store;
pub mod stream;
mod tokenizer;

pub use batch::{Batch, Tokens};
pub use cache::{Options, Prep, Store};
pub use load::{recipe_data, recipe_data_streaming, recipe_tokenizer, DataPlan, RecipeData};
pub use sampler::{Packer, Sampler};
pub use store::{ExampleRef, Examples};
pub use tokenizer::{alpaca_prompt, TextTokenizer};

use crate::recipe::{DataSection, TrainFile};
use crate::rng::Rng;
use anyhow::Result;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// The label of a position that is not a target (PyTorch's cross-entropy `ignore_index`).
pub const IGNORE: i64 = -100;

/// A byte range [start, end) of a text.
pub(crate) type Span = (usize, usize);

/// One training example, already truncated to seq_len.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Aligned with `ids`: the token where it is a target, else `IGNORE` (the batch predicts
    /// each target from the position before it).
    pub labels: Vec<i64>,
}

/// A loaded data set: its examples and what loading found.
#[derive(Debug, Default)]
pub struct Dataset {
    /// The examples, in file order (in memory, or mapped from the tokenized cache).
    pub examples: Examples,
    /// Examples cut to seq_len.
    pub truncated: usize,
    /// The (first) file read.
    pub source: PathBuf,
    /// Per example: its file, an index into `files`.
    pub file_of: Vec<usize>,
    /// The files read, with their mixing weights.
    pub(crate) files: Vec<(PathBuf, f64)>,
    /// Malformed rows skipped (on_bad_row = "skip"), and the first few, with file:line.
    pub skipped: usize,
    /// The first few skipped rows, with file:line.
    pub skipped_first: Vec<String>,
    /// Examples dropped because truncation left them no target token (train_on completions).
    pub no_targets: usize,
    /// Examples dropped because they had no target even before truncation (a chat row with no
    /// assistant turn, an empty completion), and the first of them: `file:line: what`.
    pub no_answer: usize,
    pub(crate) no_answer_first: Option<String>,
    /// Completions (chat turns) that had no stop token and got the EOS appended.
    pub eos_added: usize,
    /// How the assistant turns of the files read end: stop token id → turns (counted before
    /// an eval split).
    pub turn_ends: BTreeMap<u32, usize>,
    /// How the examples were made (from the cache, or tokenized now) and what it took.
    pub prep: Prep,
}

impl Dataset {
    /// Reads `cfg.train` (every file of a mix; a Hub data set's files of its split) on every
    /// core, into an unlinked temporary file ([`Options::uncached`]; [`recipe_data`] and
    /// [`Dataset::load_files_with`] use the tokenized cache). Token ids must be below
    /// `vocab_size`. Errors name file and line (or row) and column.
    pub fn load(
        cfg: &DataSection,
        tok: Option<&TextTokenizer>,
        vocab_size: usize,
    ) -> Result<Dataset> {
        let opts = Options::uncached()?;
        load::load_entries(
            &cfg.train.files(cfg.format),
            cfg,
            tok,
            vocab_size,
            false,
            &opts,
        )
    }

    /// Reads `cfg.eval`, in `cfg.format`, when set (a Hub data set: its data.eval_split).
    pub fn load_eval(
        cfg: &DataSection,
        tok: Option<&TextTokenizer>,
        vocab_size: usize,
    ) -> Result<Option<Dataset>> {
        let Some(entry) = source::eval_entry(cfg) else {
            return Ok(None);
        };
        let opts = Options::uncached()?;
        load::load_entries(&[entry], cfg, tok, vocab_size, true, &opts).map(Some)
    }

    /// Reads the entries of a mix, as [`Dataset::load`] does.
    pub fn load_files(
        files: &[TrainFile],
        cfg: &DataSection,
        tok: Option<&TextTokenizer>,
        vocab_size: usize,
    ) -> Result<Dataset> {
        Self::load_files_with(files, cfg, tok, vocab_size, &Options::uncached()?)
    }

    /// Reads the entries of a mix, keeping the examples where `opts` says.
    pub fn load_files_with(
        files: &[TrainFile],
        cfg: &DataSection,
        tok: Option<&TextTokenizer>,
        vocab_size: usize,
        opts: &Options,
    ) -> Result<Dataset> {
        load::load_entries(files, cfg, tok, vocab_size, false, opts)
    }

    /// Moves a seeded `fraction` of the examples (at least one, at most all but one) into a
    /// new dataset, the eval set; the same seed always holds out the same examples.
    pub fn split_eval(&mut self, fraction: f64, seed: u64) -> Dataset {
        let n = self.examples.len();
        let k = ((fraction * n as f64).round() as usize).clamp(1, n.saturating_sub(1));
        let mut order: Vec<usize> = (0..n).collect();
        Rng::keyed(seed, &[0x4556_414c]).shuffle(&mut order);
        let mut held = vec![false; n];
        order[..k].iter().for_each(|&i| held[i] = true);
        let (keep, take) = std::mem::take(&mut self.examples).split(&held);
        let file_of = std::mem::take(&mut self.file_of);
        let (mut keep_of, mut take_of) = (Vec::new(), Vec::new());
        for (f, h) in file_of.into_iter().zip(&held) {
            match h {
                true => take_of.push(f),
                false => keep_of.push(f),
            }
        }
        self.examples = keep;
        self.file_of = keep_of;
        // Every eval example counts once: no mixing weights.
        Dataset {
            source: self.source.clone(),
            files: self.files.iter().map(|(p, _)| (p.clone(), 1.0)).collect(),
            examples: take,
            file_of: take_of,
            prep: self.prep.clone(),
            ..Dataset::default()
        }
    }
}

/// Whether a row has a target token. Position 0 is never one (nothing predicts it).
fn has_target(labels: &[i64]) -> bool {
    labels.iter().skip(1).any(|&l| l != IGNORE)
}
