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

pub mod chat;

use crate::recipe::{DataFormat, DataSection, OnBadRow, TrainFile, TrainOn};
use crate::rng::Rng;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};

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

/// How text becomes tokens: the model's tokenizer.json plus its tokenizer_config.json flags,
/// special tokens and chat template.
pub struct TextTokenizer {
    tok: tokenizers::Tokenizer,
    bos: Option<u32>,
    eos: Option<u32>,
    /// tokenizer_config.json's eos_token (whatever add_eos_token says): ends every completion.
    pub eos_token: Option<(String, u32)>,
    /// Tokens at which generation stops: eos_token, and eos_token_id of generation_config.json
    /// and config.json. A chat turn's targets end with one.
    pub stop_ids: Vec<u32>,
    /// eos_token_id of generation_config.json / config.json (what `generate` stops at).
    pub generate_stop_ids: Vec<u32>,
    /// bos_token, eos_token, unk_token, ... (those set in tokenizer_config.json): the
    /// variables transformers passes to chat templates.
    pub specials: Vec<(String, String)>,
    /// The chat template, for format "chat".
    pub chat: Option<chat::ChatTemplate>,
}

impl TextTokenizer {
    /// `add_bos_token` / `add_eos_token` (tokenizer_config.json) make sure the sequence starts
    /// with BOS / ends with EOS; otherwise the tokenizer's own post-processor decides.
    pub fn load(tokenizer: &Path, tokenizer_config: Option<&Path>) -> Result<Self> {
        let tok = tokenizers::Tokenizer::from_file(tokenizer)
            .map_err(|e| anyhow::anyhow!("cannot load tokenizer {}: {e}", tokenizer.display()))?;
        let mut bos = None;
        let mut eos = None;
        let mut eos_token = None;
        let mut specials = Vec::new();
        if let Some(p) = tokenizer_config {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read {}", p.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", p.display()))?;
            // A special token is a string or an AddedToken object {"content": ...}.
            let text_of = |k: &str| -> Option<String> {
                let t = v.get(k)?;
                t.as_str()
                    .or_else(|| t.get("content").and_then(|c| c.as_str()))
                    .map(String::from)
            };
            let token = |k: &str| -> Option<u32> { tok.token_to_id(&text_of(k)?) };
            let flag = |k: &str| v.get(k).and_then(|b| b.as_bool()).unwrap_or(false);
            if flag("add_bos_token") {
                bos = token("bos_token");
            }
            if flag("add_eos_token") {
                eos = token("eos_token");
            }
            eos_token = text_of("eos_token").and_then(|s| Some((s.clone(), tok.token_to_id(&s)?)));
            for k in [
                "bos_token",
                "eos_token",
                "unk_token",
                "sep_token",
                "pad_token",
                "cls_token",
                "mask_token",
            ] {
                if let Some(s) = text_of(k) {
                    specials.push((k.to_string(), s));
                }
            }
        }
        // What `generate` stops at, from the checkpoint's configs beside tokenizer.json.
        let dir = tokenizer.parent().unwrap_or(Path::new("."));
        let mut generate_stop_ids = Vec::new();
        for name in ["generation_config.json", "config.json"] {
            let Ok(text) = std::fs::read_to_string(dir.join(name)) else {
                continue;
            };
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
                continue;
            };
            match v.get("eos_token_id") {
                Some(serde_json::Value::Number(n)) => generate_stop_ids.extend(n.as_u64()),
                Some(serde_json::Value::Array(a)) => {
                    generate_stop_ids.extend(a.iter().filter_map(|x| x.as_u64()))
                }
                _ => {}
            }
        }
        let mut generate_stop_ids: Vec<u32> = generate_stop_ids
            .into_iter()
            .filter_map(|x| u32::try_from(x).ok())
            .collect();
        generate_stop_ids.sort_unstable();
        generate_stop_ids.dedup();
        if eos_token.is_none() {
            // No eos_token in tokenizer_config.json: the configs' first EOS id.
            eos_token = generate_stop_ids
                .first()
                .and_then(|&id| Some((tok.id_to_token(id)?, id)));
        }
        let mut stop_ids = generate_stop_ids.clone();
        stop_ids.extend(eos_token.as_ref().map(|e| e.1));
        stop_ids.sort_unstable();
        stop_ids.dedup();
        Ok(TextTokenizer {
            tok,
            bos,
            eos,
            eos_token,
            stop_ids,
            generate_stop_ids,
            specials,
            chat: None,
        })
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tok
            .encode(text, true)
            .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
        let mut ids = enc.get_ids().to_vec();
        if let Some(b) = self.bos {
            if ids.first() != Some(&b) {
                ids.insert(0, b);
            }
        }
        if let Some(e) = self.eos {
            if ids.last() != Some(&e) {
                ids.push(e);
            }
        }
        Ok(ids)
    }

    /// A prompt to generate from: as `encode`, with BOS as configured, but never the EOS that
    /// add_eos_token appends to training text (a prompt that ends in EOS asks for nothing).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.encode(text)?;
        if self.eos.is_some() && ids.len() > 1 && ids.last() == self.eos.as_ref() {
            ids.pop();
        }
        Ok(ids)
    }

    /// The text of `ids`, special tokens (BOS, EOS, chat markers) left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tok
            .decode(ids, true)
            .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))
    }

    /// A token's text, e.g. "<|im_end|>".
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.tok.id_to_token(id)
    }

    /// Token ids and their byte spans in `text`, with no special tokens added (as
    /// transformers tokenizes a rendered chat).
    pub fn encode_offsets(&self, text: &str) -> Result<(Vec<u32>, Vec<Span>)> {
        let enc = self
            .tok
            .encode(text, false)
            .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    /// prompt + completion as one text (BOS as `encode` adds it), then the EOS token.
    /// Labels: every token, or (`completions_only`) the tokens overlapping the completion and
    /// the EOS; -100 elsewhere.
    pub fn encode_pair(
        &self,
        prompt: &str,
        completion: &str,
        completions_only: bool,
    ) -> Result<(Vec<u32>, Vec<i64>)> {
        let (_, eos) = self
            .eos_token
            .clone()
            .context("tokenizer_config.json names no eos_token to end completions with")?;
        let text = format!("{prompt}{completion}");
        let enc = self
            .tok
            .encode(text.as_str(), true)
            .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
        let mut ids = enc.get_ids().to_vec();
        let mut offsets = enc.get_offsets().to_vec();
        if let Some(b) = self.bos {
            if ids.first() != Some(&b) {
                ids.insert(0, b);
                offsets.insert(0, (0, 0));
            }
        }
        if ids.last() != Some(&eos) {
            ids.push(eos);
            offsets.push((text.len(), text.len()));
        }
        let p = prompt.len();
        let last = ids.len() - 1;
        let labels = ids
            .iter()
            .zip(&offsets)
            .enumerate()
            .map(|(j, (&id, &(a, b)))| {
                let target = !completions_only || j == last || (a < b && b > p);
                if target {
                    id as i64
                } else {
                    IGNORE
                }
            })
            .collect();
        Ok((ids, labels))
    }
}

/// The Alpaca prompt (alpaca-lora's variant of Stanford Alpaca's, ending in a newline).
pub fn alpaca_prompt(instruction: &str, input: &str) -> String {
    if input.is_empty() {
        format!(
            "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
        )
    } else {
        format!(
            "Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
        )
    }
}

/// One row as parsed: ids, labels, and how its completions ended.
struct Row {
    ids: Vec<u32>,
    labels: Vec<i64>,
    eos_added: usize,
    turn_ends: Vec<u32>,
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

/// The format's name as a recipe writes it.
pub fn format_name(f: DataFormat) -> &'static str {
    match f {
        DataFormat::Tokens => "tokens",
        DataFormat::Text => "text",
        DataFormat::Alpaca => "alpaca",
        DataFormat::Chat => "chat",
        DataFormat::Completion => "completion",
    }
}

/// One jsonl line → tokens and labels, in `format`.
fn parse_row(
    line: &str,
    format: DataFormat,
    completions_only: bool,
    cfg: &DataSection,
    tok: Option<&TextTokenizer>,
    chat: Option<&chat::ChatTemplate>,
) -> Result<Row> {
    let plain = |ids: Vec<u32>, labels: Vec<i64>| Row {
        ids,
        labels,
        eos_added: 0,
        turn_ends: Vec::new(),
    };
    if let (DataFormat::Chat, Some(tok), Some(chat)) = (format, tok, chat) {
        // Parsed into template values directly, keeping each object's key order.
        let row: minijinja::Value = serde_json::from_str(line).context("not valid JSON")?;
        if row.kind() != minijinja::value::ValueKind::Map {
            bail!("expected a JSON object with \"messages\"");
        }
        let messages = row
            .get_attr("messages")
            .ok()
            .filter(|m| !m.is_undefined())
            .context("expected \"messages\": a list of {\"role\", \"content\"} objects")?;
        if chat.generation_blocks && line.contains(['\u{F8F0}', '\u{F8F1}']) {
            bail!("the row contains U+F8F0 / U+F8F1, which mark generation blocks");
        }
        let ex = chat.encode(tok, &messages, completions_only)?;
        return Ok(Row {
            ids: ex.ids,
            labels: ex.labels,
            eos_added: ex.eos_added,
            turn_ends: ex.turn_ends,
        });
    }
    let row: serde_json::Value = serde_json::from_str(line).context("not valid JSON")?;
    let field = |k: &str, required: bool| -> Result<String> {
        match row.get(k) {
            Some(serde_json::Value::String(s)) => Ok(s.clone()),
            None | Some(serde_json::Value::Null) if !required => Ok(String::new()),
            _ => bail!("expected a string field \"{k}\""),
        }
    };
    let (ids, labels) = match (format, tok) {
        (DataFormat::Tokens, _) => parse_tokens_row(&row)?,
        (DataFormat::Text, Some(tok)) => {
            let ids = tok.encode(&field("text", true)?)?;
            let labels = ids.iter().map(|&t| t as i64).collect();
            (ids, labels)
        }
        (DataFormat::Alpaca, Some(tok)) => {
            let prompt = alpaca_prompt(&field("instruction", true)?, &field("input", false)?);
            tok.encode_pair(&prompt, &field("output", true)?, completions_only)?
        }
        (DataFormat::Completion, Some(tok)) => tok.encode_pair(
            &field(&cfg.prompt_field, true)?,
            &field(&cfg.completion_field, true)?,
            completions_only,
        )?,
        _ => bail!(
            "format \"{}\" needs the model's tokenizer",
            format_name(format)
        ),
    };
    Ok(plain(ids, labels))
}

/// Ids inside the vocabulary, labels -100 or inside it, at least one token.
fn check_ids(row: &Row, vocab_size: usize) -> Result<()> {
    if row.ids.is_empty() {
        bail!("the row has no tokens");
    }
    if let Some(&bad) = row.ids.iter().find(|&&t| t as usize >= vocab_size) {
        bail!("token id {bad} is outside the model's vocabulary of {vocab_size}");
    }
    if let Some(&bad) = row
        .labels
        .iter()
        .find(|&&l| l != IGNORE && (l < 0 || l as usize >= vocab_size))
    {
        bail!("label {bad} is neither -100 nor a token id below {vocab_size}");
    }
    Ok(())
}

fn parse_tokens_row(row: &serde_json::Value) -> Result<(Vec<u32>, Vec<i64>)> {
    let ids: Vec<u32> = row
        .get("input_ids")
        .and_then(|v| v.as_array())
        .context("expected \"input_ids\": a list of token ids")?
        .iter()
        .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
        .collect::<Option<_>>()
        .context("\"input_ids\" must hold non-negative integers")?;
    let labels: Vec<i64> = match row.get("labels") {
        None | Some(serde_json::Value::Null) => ids.iter().map(|&t| t as i64).collect(),
        Some(v) => v
            .as_array()
            .context("\"labels\" must be a list")?
            .iter()
            .map(|v| v.as_i64())
            .collect::<Option<_>>()
            .context("\"labels\" must hold integers")?,
    };
    if labels.len() != ids.len() {
        bail!(
            "\"labels\" has {} entries but \"input_ids\" has {}",
            labels.len(),
            ids.len()
        );
    }
    Ok((ids, labels))
}

/// One micro-batch, host side: B rows of T tokens.
#[derive(Debug, Clone)]
pub struct Batch {
    pub b: usize,
    pub t: usize,
    pub ids: Vec<u32>,       // [B×T]
    pub positions: Vec<u32>, // [B×T], restarting at each packed example
    /// [B×T] example index within its row (packed rows only).
    pub segments: Option<Vec<u32>>,
    /// (flat index b·T + t of the predicting position, target token) for every counted token.
    pub targets: Vec<(usize, u32)>,
    /// Real (non-padding) tokens.
    pub tokens: usize,
}

impl Batch {
    /// Rows of examples → one batch, padded to its longest row.
    pub fn from_rows(rows: &[Vec<&Example>], pad_id: u32, packed: bool) -> Batch {
        let t = rows
            .iter()
            .map(|r| r.iter().map(|e| e.ids.len()).sum::<usize>())
            .max()
            .unwrap_or(1)
            .max(1);
        let b = rows.len();
        let mut ids = vec![pad_id; b * t];
        let mut positions = vec![0u32; b * t];
        let mut segments = vec![u32::MAX; b * t];
        let mut labels = vec![IGNORE; b * t];
        for (r, row) in rows.iter().enumerate() {
            let mut at = r * t;
            for (k, ex) in row.iter().enumerate() {
                for (p, (&id, &l)) in ex.ids.iter().zip(&ex.labels).enumerate() {
                    ids[at] = id;
                    positions[at] = p as u32;
                    segments[at] = k as u32;
                    // An example's first token is never a target: in a packed row it would be
                    // predicted from the previous example.
                    labels[at] = if p == 0 { IGNORE } else { l };
                    at += 1;
                }
            }
            // Padding continues the positions (its outputs are never used).
            for (p, pos) in positions[at..(r + 1) * t].iter_mut().enumerate() {
                *pos = (at - r * t + p) as u32;
            }
        }
        let mut targets = Vec::new();
        for r in 0..b {
            for i in 0..t - 1 {
                let l = labels[r * t + i + 1];
                if l != IGNORE {
                    targets.push((r * t + i, l as u32));
                }
            }
        }
        let tokens = rows.iter().flatten().map(|e| e.ids.len()).sum();
        Batch {
            b,
            t,
            ids,
            positions,
            segments: packed.then_some(segments),
            targets,
            tokens,
        }
    }

    pub fn n_targets(&self) -> usize {
        self.targets.len()
    }
}

/// Where a run is in its data: `index` rows of epoch `epoch`'s global row list (all ranks
/// together) are done. A checkpoint saves it; [`Sampler::rows_from`] resumes from it, on any
/// number of ranks. After s steps of an epoch, index = s · micro_batch · grad_accum · world.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataCursor {
    pub epoch: usize,
    pub index: usize,
    /// [`Sampler::fingerprint`] of the data it was taken on: resuming on other data (or other
    /// seed, seq_len, packing, shuffling or weights) is refused.
    pub fingerprint: u64,
}

/// Deterministic order of rows for each epoch; rows are lists of example indices.
pub struct Sampler {
    pub n_examples: usize,
    lens: Vec<usize>,
    /// Per file of the mix: its examples (ascending) and weight.
    groups: Vec<(Vec<usize>, f64)>,
    seq_len: usize,
    pack: bool,
    shuffle: bool,
    seed: u64,
    fingerprint: u64,
}

impl Sampler {
    pub fn new(ds: &Dataset, cfg: &DataSection, seed: u64) -> Self {
        let n = ds.examples.len();
        let mut groups: Vec<(Vec<usize>, f64)> =
            ds.files.iter().map(|(_, w)| (Vec::new(), *w)).collect();
        for i in 0..n {
            let k = ds.file_of.get(i).copied().unwrap_or(0);
            if groups.len() <= k {
                groups.resize(k + 1, (Vec::new(), 1.0));
            }
            groups[k].0.push(i);
        }
        let mut h = Fnv::new();
        h.word(n as u64);
        for e in &ds.examples {
            h.word(e.ids.len() as u64);
            e.ids.iter().for_each(|&t| h.word(t as u64));
            e.labels.iter().for_each(|&l| h.word(l as u64));
        }
        for (members, w) in &groups {
            h.word(members.len() as u64);
            members.iter().for_each(|&i| h.word(i as u64));
            h.word(w.to_bits());
        }
        for x in [
            cfg.seq_len as u64,
            cfg.pack as u64,
            cfg.shuffle as u64,
            seed,
        ] {
            h.word(x);
        }
        Sampler {
            n_examples: n,
            lens: ds.examples.iter().map(|e| e.ids.len()).collect(),
            groups,
            seq_len: cfg.seq_len,
            pack: cfg.pack,
            shuffle: cfg.shuffle,
            seed,
            fingerprint: h.0,
        }
    }

    /// A hash of everything that decides the rows: the examples, the weights, the settings.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The examples of epoch `epoch`, in order: each file's examples `weight` times (the
    /// whole part as repeats, the fraction as a seeded subset, new each epoch), then a seeded
    /// permutation of it all (or file order without shuffle).
    fn order(&self, epoch: usize) -> Vec<usize> {
        let mut order = Vec::with_capacity(self.n_examples);
        for (g, (members, w)) in self.groups.iter().enumerate() {
            let whole = w.floor() as usize;
            for _ in 0..whole {
                order.extend_from_slice(members);
            }
            let part = ((w - whole as f64) * members.len() as f64).round() as usize;
            if part > 0 {
                let mut m = members.clone();
                Rng::keyed(self.seed, &[0x5745_4947, epoch as u64, g as u64]).shuffle(&mut m);
                m.truncate(part);
                m.sort_unstable();
                order.extend(m);
            }
        }
        if self.shuffle {
            Rng::keyed(self.seed, &[0x5348_5546, epoch as u64]).shuffle(&mut order);
        }
        order
    }

    /// Rows of epoch `epoch`: the epoch's order, then, when packing, greedy filling of rows up
    /// to seq_len tokens in that order.
    pub fn rows(&self, epoch: usize) -> Vec<Vec<usize>> {
        let order = self.order(epoch);
        if !self.pack {
            return order.into_iter().map(|i| vec![i]).collect();
        }
        let mut rows = Vec::new();
        let mut cur: Vec<usize> = Vec::new();
        let mut used = 0;
        for i in order {
            if used + self.lens[i] > self.seq_len && !cur.is_empty() {
                rows.push(std::mem::take(&mut cur));
                used = 0;
            }
            cur.push(i);
            used += self.lens[i];
        }
        if !cur.is_empty() {
            rows.push(cur);
        }
        rows
    }

    /// Rank `rank`'s rows of epoch `epoch` out of `world` (DDP / FSDP): rows rank, rank+world,
    /// ... of [`Sampler::rows`], the same number on every rank (the last rows.len() % world
    /// rows of the epoch are left out), so no row is seen twice in an epoch.
    pub fn rows_for(&self, epoch: usize, rank: usize, world: usize) -> Vec<Vec<usize>> {
        shard(self.rows(epoch), rank, world)
    }

    /// The cursor after `index` global rows of `epoch`.
    pub fn cursor(&self, epoch: usize, index: usize) -> DataCursor {
        DataCursor {
            epoch,
            index,
            fingerprint: self.fingerprint,
        }
    }

    /// Rank `rank`'s remaining rows of the cursor's epoch: the global rows from `c.index` on,
    /// sharded as [`Sampler::rows_for`] does. Refuses a cursor taken on other data.
    pub fn rows_from(&self, c: &DataCursor, rank: usize, world: usize) -> Result<Vec<Vec<usize>>> {
        if c.fingerprint != self.fingerprint {
            bail!(
                "the data cursor was saved on other data or data settings (fingerprint {:016x}, now {:016x}): resume with the same files, weights, seq_len, pack, shuffle and seed",
                c.fingerprint,
                self.fingerprint
            );
        }
        let mut rows = self.rows(c.epoch);
        if c.index > rows.len() {
            bail!(
                "the data cursor is at row {} of epoch {}, which has only {} rows",
                c.index,
                c.epoch,
                rows.len()
            );
        }
        let rest = rows.split_off(c.index);
        Ok(shard(rest, rank, world))
    }
}

/// Rows rank, rank+world, ... with the tail that does not fill a round dropped.
fn shard(rows: Vec<Vec<usize>>, rank: usize, world: usize) -> Vec<Vec<usize>> {
    let world = world.max(1);
    let per = rows.len() / world;
    rows.into_iter()
        .skip(rank)
        .step_by(world)
        .take(per)
        .collect()
}

/// FNV-1a over 64-bit words: a stable hash (the same on every machine and release).
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn word(&mut self, x: u64) {
        for b in x.to_le_bytes() {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `[data]` section from TOML lines (train = "x.jsonl" added).
    fn section(lines: &str) -> DataSection {
        toml::from_str(&format!("train = \"x.jsonl\"\n{lines}")).unwrap()
    }

    fn ex(ids: &[u32]) -> Example {
        Example {
            ids: ids.to_vec(),
            labels: ids.iter().map(|&t| t as i64).collect(),
        }
    }

    #[test]
    fn targets_are_shifted_and_padding_is_ignored() {
        let (a, b) = (ex(&[5, 6, 7]), ex(&[8, 9]));
        let batch = Batch::from_rows(&[vec![&a], vec![&b]], 0, false);
        assert_eq!((batch.b, batch.t), (2, 3));
        assert_eq!(batch.ids, vec![5, 6, 7, 8, 9, 0]);
        // position 0 predicts 6, 1 predicts 7; row 2: position 3 predicts 9; pad is ignored.
        assert_eq!(batch.targets, vec![(0, 6), (1, 7), (3, 9)]);
        assert!(batch.segments.is_none());
    }

    #[test]
    fn packed_rows_restart_positions_and_never_predict_across_examples() {
        let (a, b) = (ex(&[5, 6, 7]), ex(&[8, 9]));
        let batch = Batch::from_rows(&[vec![&a, &b]], 0, true);
        assert_eq!(batch.positions, vec![0, 1, 2, 0, 1]);
        assert_eq!(batch.segments, Some(vec![0, 0, 0, 1, 1]));
        // 7 → 8 crosses examples: not a target.
        assert_eq!(batch.targets, vec![(0, 6), (1, 7), (3, 9)]);
    }

    #[test]
    fn sampler_packs_greedily_and_shuffles_reproducibly() {
        let ds = Dataset {
            examples: vec![ex(&[1, 2, 3]), ex(&[1, 2]), ex(&[1, 2, 3, 4]), ex(&[1])],
            ..Dataset::default()
        };
        let mut cfg = section("format = \"tokens\"\nseq_len = 5\nshuffle = false\npack = true");
        let s = Sampler::new(&ds, &cfg, 1);
        assert_eq!(s.rows(0), vec![vec![0, 1], vec![2, 3]]);
        cfg.shuffle = true;
        cfg.pack = false;
        let s = Sampler::new(&ds, &cfg, 1);
        assert_eq!(s.rows(3), s.rows(3));
        let mut all: Vec<usize> = s.rows(0).concat();
        all.sort();
        assert_eq!(all, vec![0, 1, 2, 3]);
    }

    /// n examples of distinct lengths 1..=n, in files of `sizes` with `weights`.
    fn mix(sizes: &[usize], weights: &[f64]) -> Dataset {
        let mut ds = Dataset::default();
        for (k, (&n, &w)) in sizes.iter().zip(weights).enumerate() {
            ds.files.push((PathBuf::from(format!("f{k}.jsonl")), w));
            for _ in 0..n {
                let len = ds.examples.len() + 1;
                ds.examples.push(ex(&vec![7; len]));
                ds.file_of.push(k);
            }
        }
        ds
    }

    #[test]
    fn weights_repeat_and_subsample_files_each_epoch() {
        // File 0: 4 examples × 2; file 1: 10 examples × 0.5 (a new seeded half each epoch).
        let ds = mix(&[4, 10], &[2.0, 0.5]);
        let s = Sampler::new(&ds, &section("shuffle = true"), 3);
        let count = |epoch| {
            let mut c = vec![0; 14];
            s.rows(epoch).concat().iter().for_each(|&i| c[i] += 1);
            c
        };
        for epoch in 0..3 {
            let c = count(epoch);
            assert_eq!(&c[..4], &[2, 2, 2, 2], "epoch {epoch}");
            assert_eq!(c[4..].iter().sum::<usize>(), 5, "epoch {epoch}");
            assert!(c[4..].iter().all(|&x| x <= 1), "epoch {epoch}: {c:?}");
        }
        assert_ne!(count(0)[4..], count(1)[4..], "another half each epoch");
        assert_eq!(s.rows(1), s.rows(1));
        // Weight 1 everywhere: every example once, in the foundation's order.
        let one = Sampler::new(&mix(&[4, 10], &[1.0, 1.0]), &section("shuffle = false"), 3);
        assert_eq!(one.rows(0).concat(), (0..14).collect::<Vec<_>>());
    }

    #[test]
    fn ranks_share_an_epoch_without_overlap_and_a_cursor_resumes_it() {
        let ds = mix(&[23], &[1.0]);
        let s = Sampler::new(&ds, &section("seq_len = 512"), 9);
        let all = s.rows(2);
        assert_eq!(all.len(), 23);
        let world = 3;
        let shards: Vec<Vec<Vec<usize>>> = (0..world).map(|r| s.rows_for(2, r, world)).collect();
        // 7 rows each; the 2 rows that do not fill a round are left out of this epoch.
        assert!(shards.iter().all(|sh| sh.len() == 7));
        let mut seen: Vec<usize> = shards.concat().concat();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 21, "no example twice in an epoch");
        // Rank r's k-th row is global row k·world + r.
        assert_eq!(shards[1][4], all[4 * world + 1]);

        // 5 steps done on 3 ranks (15 global rows): resume on 2 ranks, the rest exactly once.
        let c = s.cursor(2, 15);
        let json = serde_json::to_string(&c).unwrap();
        let c: DataCursor = serde_json::from_str(&json).unwrap();
        let rest: Vec<Vec<usize>> = (0..2)
            .flat_map(|r| s.rows_from(&c, r, 2).unwrap())
            .collect();
        let mut got: Vec<usize> = rest.concat();
        got.sort();
        let mut want: Vec<usize> = all[15..].concat();
        want.sort();
        assert_eq!(got, want);
        assert_eq!(s.rows_from(&s.cursor(2, 0), 0, 1).unwrap(), all);

        // Another seed (or other data) gives another fingerprint: the cursor is refused.
        let other = Sampler::new(&ds, &section("seq_len = 512"), 10);
        let e = other.rows_from(&c, 0, 1).unwrap_err().to_string();
        assert!(e.contains("saved on other data"), "{e}");
        assert!(s.rows_from(&s.cursor(2, 24), 0, 1).is_err());
    }
}
