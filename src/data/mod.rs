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

mod batch;
pub mod chat;
mod columns;
mod parquet;
pub mod pref_batch;
pub mod preference;
pub mod reader;
pub mod record;
mod rows;
mod sampler;
pub(crate) mod source;
mod tokenizer;

pub use batch::Batch;
pub(crate) use rows::format_name;
pub use sampler::{Sampler};
pub use tokenizer::{alpaca_prompt, TextTokenizer};

use crate::recipe::{DataFormat, DataSection, OnBadRow, TrainFile, TrainOn};
use crate::rng::Rng;
use anyhow::{bail, Context, Result};
use columns::Columns;
use parquet::Want;
use reader::{Kind, Loc};
use rows::{check_ids, parse_row, RowSpec};
use source::SourceFile;
use std::collections::BTreeMap;
use std::path::PathBuf;

pub const IGNORE: i64 = -100;

/// A byte range [start, end) of a text.
pub(crate) type Span = (usize, usize);

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
    pub(crate) source: PathBuf,
    /// Per example: its file, an index into `files`.
    pub(crate) file_of: Vec<usize>,
    /// The files read, with their mixing weights.
    pub(crate) files: Vec<(PathBuf, f64)>,
    /// Malformed rows skipped (on_bad_row = "skip"), and the first few, with file:line.
    pub skipped: usize,
    pub skipped_first: Vec<String>,
    /// Examples dropped because truncation left them no target token (train_on completions).
    pub no_targets: usize,
    /// Examples dropped because they had no target even before truncation (a chat row with no
    /// assistant turn, an empty completion), and the first of them: `file:line: what`.
    pub(crate) no_answer: usize,
    pub(crate) no_answer_first: Option<String>,
    /// Completions (chat turns) that had no stop token and got the EOS appended.
    pub(crate) eos_added: usize,
    /// How the assistant turns of the files read end: stop token id → turns (counted before
    /// an eval split).
    pub turn_ends: BTreeMap<u32, usize>,
}

impl Dataset {
    /// Reads `cfg.train` (every file of a mix; a Hub data set's files of its split). Token ids
    /// must be below `vocab_size`. Errors name file and line (or row) and column.
    pub(crate) fn load(
        cfg: &DataSection,
        tok: Option<&TextTokenizer>,
        vocab_size: usize,
    ) -> Result<Dataset> {
        Self::load_entries(&cfg.train.files(cfg.format), cfg, tok, vocab_size, false)
    }

    /// Reads `cfg.eval`, in `cfg.format`, when set (a Hub data set: its data.eval_split).
    pub(crate) fn load_eval(
        cfg: &DataSection,
        tok: Option<&TextTokenizer>,
        vocab_size: usize,
    ) -> Result<Option<Dataset>> {
        let Some(entry) = source::eval_entry(cfg) else {
            return Ok(None);
        };
        Self::load_entries(&[entry], cfg, tok, vocab_size, true).map(Some)
    }

    /// Reads the entries of a mix, as [`Dataset::load`] does.
    pub fn load_files(
        files: &[TrainFile],
        cfg: &DataSection,
        tok: Option<&TextTokenizer>,
        vocab_size: usize,
    ) -> Result<Dataset> {
        Self::load_entries(files, cfg, tok, vocab_size, false)
    }

    fn load_entries(
        files: &[TrainFile],
        cfg: &DataSection,
        tok: Option<&TextTokenizer>,
        vocab_size: usize,
        eval: bool,
    ) -> Result<Dataset> {
        let mut ds = Dataset {
            source: files.first().map(|f| f.path.clone()).unwrap_or_default(),
            ..Dataset::default()
        };
        for (k, f) in files.iter().enumerate() {
            ds.files.push((f.path.clone(), f.weight));
            let before = ds.examples.len();
            for file in source::files_of(f, cfg, eval)? {
                ds.read_file(k, f, &file, cfg, tok, vocab_size)?;
            }
            if ds.examples.len() == before {
                let mut why = Vec::new();
                if ds.skipped > 0 {
                    why.push(format!(
                        "{} bad rows skipped; first: {}",
                        ds.skipped,
                        ds.skipped_first.first().map_or("", |s| s.as_str())
                    ));
                }
                if let Some(first) = &ds.no_answer_first {
                    why.push(format!(
                        "{} examples have nothing to train on under train_on = \"completions\"; first: {first}; give each row its reply, or set data.train_on = \"all\"",
                        ds.no_answer
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

    /// Reads one file of entry `k` (`f`): every record parsed in the entry's format and
    /// columns, checked, truncated and counted.
    fn read_file(
        &mut self,
        k: usize,
        f: &TrainFile,
        file: &SourceFile,
        cfg: &DataSection,
        tok: Option<&TextTokenizer>,
        vocab_size: usize,
    ) -> Result<()> {
        let name = file.name.as_str();
        let format = f.format.unwrap_or(cfg.format);
        let fmt = format_name(format);
        let tok = match format {
            DataFormat::Tokens => None,
            _ => Some(tok.with_context(|| {
                format!("format \"{fmt}\" ({name}) needs the model's tokenizer.json")
            })?),
        };
        if matches!(format, DataFormat::Alpaca | DataFormat::Completion)
            && tok.is_some_and(|t| t.eos_token.is_none())
        {
            bail!(
                "format \"{fmt}\" ({name}) ends every completion with the EOS token, but tokenizer_config.json names no eos_token"
            );
        }
        let chat = match (format, tok) {
            (DataFormat::Chat, Some(t)) => Some(
                t.chat
                    .as_ref()
                    .with_context(|| format!("format \"chat\" ({name}) needs a chat template"))?,
            ),
            _ => None,
        };
        let columns = Columns::new(format, cfg, source::columns_of(f, cfg))
            .map_err(|m| anyhow::anyhow!("data.columns {m}"))?;
        let spec = RowSpec {
            format,
            completions_only: cfg.train_on_for(format) == TrainOn::Completions,
            columns: &columns,
            tok,
            chat,
        };
        let mut sink = |at: Loc, rec: Result<record::Field>| -> Result<()> {
            let parsed = rec
                .and_then(|r| parse_row(&r, &spec))
                .and_then(|r| check_ids(&r, vocab_size).map(|_| r));
            match parsed {
                Ok(row) if spec.completions_only && !has_target(&row.labels) => {
                    self.no_answer += 1;
                    if self.no_answer_first.is_none() {
                        let what = match format {
                            DataFormat::Chat => "no assistant turn",
                            _ => "an empty completion",
                        };
                        self.no_answer_first = Some(format!("{}: {what}", at.at(name)));
                    }
                }
                Ok(row) => self.push(k, row, cfg.seq_len, spec.completions_only),
                Err(e) => {
                    let msg = format!("{}: {e:#}", at.at(name));
                    if cfg.on_bad_row == OnBadRow::Error {
                        bail!("{msg}");
                    }
                    self.skipped += 1;
                    if self.skipped_first.len() < SKIP_QUOTED {
                        self.skipped_first.push(msg);
                    }
                }
            }
            Ok(())
        };
        match reader::kind_of(name) {
            Kind::Parquet => {
                let want: Vec<Want> = columns
                    .iter()
                    .map(|(ours, col, required)| Want {
                        names: match ours == "messages" && columns.sharegpt_fallback {
                            true => vec![col, columns::SHAREGPT],
                            false => vec![col],
                        },
                        required,
                    })
                    .collect();
                parquet::read(&file.path, name, &want, &mut sink)
            }
            Kind::Json => reader::read_json(&file.path, name, &mut sink),
            Kind::JsonLines => reader::read_jsonl(&file.path, name, &mut sink),
        }
    }

    /// Adds a parsed row of entry `k`: truncated to seq_len, dropped (and counted) when
    /// truncation left it no target.
    fn push(&mut self, k: usize, mut row: rows::Row, seq_len: usize, completions_only: bool) {
        if row.ids.len() > seq_len {
            row.ids.truncate(seq_len);
            row.labels.truncate(seq_len);
            self.truncated += 1;
        }
        if completions_only && !has_target(&row.labels) {
            self.no_targets += 1;
            return;
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

    /// Moves a seeded `fraction` of the examples (at least one, at most all but one) into a
    /// new dataset, the eval set; the same seed always holds out the same examples.
    pub(crate) fn split_eval(&mut self, fraction: f64, seed: u64) -> Dataset {
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

/// Whether a row has a target token. Position 0 is never one (nothing predicts it).
fn has_target(labels: &[i64]) -> bool {
    labels.iter().skip(1).any(|&l| l != IGNORE)
}
