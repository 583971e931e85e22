//! Training data: jsonl → examples (token ids + labels) → rows → micro-batches.
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
//! - "chat": {"messages": [...]}: rendered with the chat template (see [`chat`]).
//!
//! Prompt and completion are tokenized together, as one text; with train_on = "completions"
//! the tokens that overlap the completion (and the EOS after it) are targets, the rest -100.

mod batch;
pub mod chat;
mod rows;
mod sampler;
mod tokenizer;

pub use batch::Batch;
pub use rows::format_name;
pub use sampler::{DataCursor, Sampler};
pub use tokenizer::{alpaca_prompt, TextTokenizer};

use crate::recipe::{DataFormat, DataSection, OnBadRow, TrainFile, TrainOn};
use crate::rng::Rng;
use anyhow::{bail, Context, Result};
use rows::{check_ids, parse_row};
use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::PathBuf;

pub const IGNORE: i64 = -100;

/// A byte range [start, end) of a text.
pub type Span = (usize, usize);

/// Bad rows quoted in the report when on_bad_row = "skip".
const SKIP_QUOTED: usize = 3;

/// One training example, already truncated to seq_len.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub ids: Vec<u32>,
    pub labels: Vec<i64>,
}

#[derive(Debug, Default)]
pub struct Dataset {
    pub examples: Vec<Example>,
    /// Examples cut to seq_len.
    pub truncated: usize,
    /// The (first) file read.
    pub source: PathBuf,
    /// Per example: its file, an index into `files`.
    pub file_of: Vec<usize>,
    /// The files read, with their mixing weights.
    pub files: Vec<(PathBuf, f64)>,
    /// Malformed rows skipped (on_bad_row = "skip"), and the first few, with file:line.
    pub skipped: usize,
    pub skipped_first: Vec<String>,
    /// Examples dropped because truncation left them no target token (train_on completions).
    pub no_targets: usize,
    /// Completions (chat turns) that had no stop token and got the EOS appended.
    pub eos_added: usize,
    /// How the assistant turns of the files read end: stop token id → turns (counted before
    /// an eval split).
    pub turn_ends: BTreeMap<u32, usize>,
}

impl Dataset {
    /// Reads `cfg.train` (every file of a mix). Token ids must be below `vocab_size`. Errors
    /// name file and line.
    pub fn load(
        cfg: &DataSection,
        tok: Option<&TextTokenizer>,
        vocab_size: usize,
    ) -> Result<Dataset> {
        Self::load_files(&cfg.train.files(cfg.format), cfg, tok, vocab_size)
    }

    /// Reads `cfg.eval`, in `cfg.format`, when set.
    pub fn load_eval(
        cfg: &DataSection,
        tok: Option<&TextTokenizer>,
        vocab_size: usize,
    ) -> Result<Option<Dataset>> {
        let Some(path) = &cfg.eval else {
            return Ok(None);
        };
        let file = TrainFile {
            path: path.clone(),
            weight: 1.0,
            format: Some(cfg.format),
        };
        Self::load_files(&[file], cfg, tok, vocab_size).map(Some)
    }

    pub fn load_files(
        files: &[TrainFile],
        cfg: &DataSection,
        tok: Option<&TextTokenizer>,
        vocab_size: usize,
    ) -> Result<Dataset> {
        let mut ds = Dataset {
            source: files.first().map(|f| f.path.clone()).unwrap_or_default(),
            ..Dataset::default()
        };
        for (k, f) in files.iter().enumerate() {
            ds.files.push((f.path.clone(), f.weight));
            let before = ds.examples.len();
            ds.read_file(k, f, cfg, tok, vocab_size)?;
            if ds.examples.len() == before {
                let mut why = Vec::new();
                if ds.skipped > 0 {
                    why.push(format!(
                        "{} bad rows skipped; first: {}",
                        ds.skipped,
                        ds.skipped_first.first().map_or("", |s| s.as_str())
                    ));
                }
                if ds.no_targets > 0 {
                    why.push(format!(
                        "{} examples had no completion token left within seq_len {}",
                        ds.no_targets, cfg.seq_len
                    ));
                }
                let why = if why.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", why.join("; "))
                };
                bail!("{} has no examples{why}", f.path.display());
            }
        }
        Ok(ds)
    }

    fn read_file(
        &mut self,
        k: usize,
        f: &TrainFile,
        cfg: &DataSection,
        tok: Option<&TextTokenizer>,
        vocab_size: usize,
    ) -> Result<()> {
        let path = &f.path;
        let format = f.format.unwrap_or(cfg.format);
        let completions_only = cfg.train_on_for(format) == TrainOn::Completions;
        let name = format_name(format);
        let tok = match format {
            DataFormat::Tokens => None,
            _ => Some(tok.with_context(|| {
                format!(
                    "format \"{name}\" ({}) needs the model's tokenizer.json",
                    path.display()
                )
            })?),
        };
        if matches!(format, DataFormat::Alpaca | DataFormat::Completion)
            && tok.is_some_and(|t| t.eos_token.is_none())
        {
            bail!(
                "format \"{name}\" ({}) ends every completion with the EOS token, but tokenizer_config.json names no eos_token",
                path.display()
            );
        }
        let chat = match (format, tok) {
            (DataFormat::Chat, Some(t)) => Some(t.chat.as_ref().with_context(|| {
                format!("format \"chat\" ({}) needs a chat template", path.display())
            })?),
            _ => None,
        };
        let file =
            std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
            let line =
                line.with_context(|| format!("{}:{}: cannot read line", path.display(), i + 1))?;
            if line.trim().is_empty() {
                continue;
            }
            let parsed = parse_row(&line, format, completions_only, cfg, tok, chat)
                .and_then(|r| check_ids(&r, vocab_size).map(|_| r));
            let mut row = match parsed {
                Ok(r) => r,
                Err(e) => {
                    let msg = format!("{}:{}: {e:#}", path.display(), i + 1);
                    if cfg.on_bad_row == OnBadRow::Error {
                        bail!("{msg}");
                    }
                    self.skipped += 1;
                    if self.skipped_first.len() < SKIP_QUOTED {
                        self.skipped_first.push(msg);
                    }
                    continue;
                }
            };
            if row.ids.len() > cfg.seq_len {
                row.ids.truncate(cfg.seq_len);
                row.labels.truncate(cfg.seq_len);
                self.truncated += 1;
            }
            // Position 0 is never a target (nothing predicts it).
            if completions_only && row.labels.iter().skip(1).all(|&l| l == IGNORE) {
                self.no_targets += 1;
                continue;
            }
            self.eos_added += row.eos_added;
            for t in row.turn_ends {
                *self.turn_ends.entry(t).or_default() += 1;
            }
            self.examples.push(Example {
                ids: row.ids,
                labels: row.labels,
            });
            self.file_of.push(k);
        }
        Ok(())
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
        // Every eval example counts once: no mixing weights.
        let mut eval = Dataset {
            source: self.source.clone(),
            files: self.files.iter().map(|(p, _)| (p.clone(), 1.0)).collect(),
            ..Dataset::default()
        };
        let examples = std::mem::take(&mut self.examples);
        let file_of = std::mem::take(&mut self.file_of);
        for ((e, f), h) in examples.into_iter().zip(file_of).zip(held) {
            let to = if h { &mut eval } else { &mut *self };
            to.examples.push(e);
            to.file_of.push(f);
        }
        eval
    }
}
