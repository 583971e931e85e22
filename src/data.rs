//! Training data: jsonl → examples (token ids + labels) → rows → micro-batches.
//!
//! Labels follow transformers: `labels[t]` is the token at position t, and the loss at
//! position t predicts `labels[t + 1]`; -100 is ignored. Rows shorter than the batch are
//! padded with label -100; rows longer than seq_len are truncated and counted.

use crate::recipe::{DataFormat, DataSection};
use crate::rng::Rng;
use anyhow::{bail, Context, Result};
use std::io::BufRead;
use std::path::{Path, PathBuf};

pub const IGNORE: i64 = -100;

/// One training example, already truncated to seq_len.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub ids: Vec<u32>,
    pub labels: Vec<i64>,
}

#[derive(Debug)]
pub struct Dataset {
    pub examples: Vec<Example>,
    /// Examples cut to seq_len.
    pub truncated: usize,
    pub source: PathBuf,
}

/// How text becomes tokens: the model's tokenizer.json plus its tokenizer_config.json flags.
pub struct TextTokenizer {
    tok: tokenizers::Tokenizer,
    bos: Option<u32>,
    eos: Option<u32>,
}

impl TextTokenizer {
    /// `add_bos_token` / `add_eos_token` (tokenizer_config.json) make sure the sequence starts
    /// with BOS / ends with EOS; otherwise the tokenizer's own post-processor decides.
    pub fn load(tokenizer: &Path, tokenizer_config: Option<&Path>) -> Result<Self> {
        let tok = tokenizers::Tokenizer::from_file(tokenizer)
            .map_err(|e| anyhow::anyhow!("cannot load tokenizer {}: {e}", tokenizer.display()))?;
        let mut bos = None;
        let mut eos = None;
        if let Some(p) = tokenizer_config {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read {}", p.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", p.display()))?;
            let token = |k: &str| -> Option<u32> {
                let t = v.get(k)?;
                let s = t
                    .as_str()
                    .or_else(|| t.get("content").and_then(|c| c.as_str()))?;
                tok.token_to_id(s)
            };
            let flag = |k: &str| v.get(k).and_then(|b| b.as_bool()).unwrap_or(false);
            if flag("add_bos_token") {
                bos = token("bos_token");
            }
            if flag("add_eos_token") {
                eos = token("eos_token");
            }
        }
        Ok(TextTokenizer { tok, bos, eos })
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
}

impl Dataset {
    /// Reads `cfg.train`. Token ids must be below `vocab_size`. Errors name file and line.
    pub fn load(
        cfg: &DataSection,
        tok: Option<&TextTokenizer>,
        vocab_size: usize,
    ) -> Result<Dataset> {
        let path = &cfg.train;
        let file =
            std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        let mut examples = Vec::new();
        let mut truncated = 0;
        for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
            let line =
                line.with_context(|| format!("{}:{}: cannot read line", path.display(), i + 1))?;
            if line.trim().is_empty() {
                continue;
            }
            let at = || format!("{}:{}", path.display(), i + 1);
            let row: serde_json::Value =
                serde_json::from_str(&line).with_context(|| format!("{}: not valid JSON", at()))?;
            let (mut ids, mut labels) = match cfg.format {
                DataFormat::Tokens => parse_tokens_row(&row).with_context(at)?,
                DataFormat::Text => {
                    let text = row
                        .get("text")
                        .and_then(|t| t.as_str())
                        .with_context(|| format!("{}: expected a string field \"text\"", at()))?;
                    let tok = tok.context("format \"text\" needs the model's tokenizer.json")?;
                    let ids = tok.encode(text).with_context(at)?;
                    let labels = ids.iter().map(|&t| t as i64).collect();
                    (ids, labels)
                }
            };
            if ids.is_empty() {
                bail!("{}: the row has no tokens", at());
            }
            if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab_size) {
                bail!(
                    "{}: token id {bad} is outside the model's vocabulary of {vocab_size}",
                    at()
                );
            }
            if let Some(&bad) = labels
                .iter()
                .find(|&&l| l != IGNORE && (l < 0 || l as usize >= vocab_size))
            {
                bail!(
                    "{}: label {bad} is neither -100 nor a token id below {vocab_size}",
                    at()
                );
            }
            if ids.len() > cfg.seq_len {
                ids.truncate(cfg.seq_len);
                labels.truncate(cfg.seq_len);
                truncated += 1;
            }
            examples.push(Example { ids, labels });
        }
        if examples.is_empty() {
            bail!("{} has no examples", path.display());
        }
        Ok(Dataset {
            examples,
            truncated,
            source: path.clone(),
        })
    }
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

/// Deterministic order of rows for each epoch; rows are lists of example indices.
pub struct Sampler {
    pub n_examples: usize,
    lens: Vec<usize>,
    seq_len: usize,
    pack: bool,
    shuffle: bool,
    seed: u64,
}

impl Sampler {
    pub fn new(ds: &Dataset, cfg: &DataSection, seed: u64) -> Self {
        Sampler {
            n_examples: ds.examples.len(),
            lens: ds.examples.iter().map(|e| e.ids.len()).collect(),
            seq_len: cfg.seq_len,
            pack: cfg.pack,
            shuffle: cfg.shuffle,
            seed,
        }
    }

    /// Rows of epoch `epoch`: a seeded permutation (or file order), then, when packing,
    /// greedy filling of rows up to seq_len tokens in that order.
    pub fn rows(&self, epoch: usize) -> Vec<Vec<usize>> {
        let mut order: Vec<usize> = (0..self.n_examples).collect();
        if self.shuffle {
            Rng::keyed(self.seed, &[0x5348_5546, epoch as u64]).shuffle(&mut order);
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
            truncated: 0,
            source: PathBuf::new(),
        };
        let mut cfg = DataSection {
            train: PathBuf::new(),
            format: DataFormat::Tokens,
            seq_len: 5,
            shuffle: false,
            pack: true,
        };
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
}
