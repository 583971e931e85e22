//! A preference data set: every file of `data.train` (local or a Hub data set's) read as pairs
//! or as KTO's unpaired examples ([`super::preference`]), and beside them a stand-in
//! [`Dataset`] of one example per pair for the sampler: its order, mixing weights, sharding
//! over the ranks, cursor and fingerprint are those of any data set. A stand-in example's ids
//! are the pair's tokens (prompt, chosen, rejected; KTO: prompt, completion), its labels the
//! part each token belongs to (KTO: with the label), so the fingerprint covers the pairs.

use super::pref_batch::PrefBatch;
use super::preference::UnpairedExample;
use super::preference::{load_pairs, load_unpaired, PairExample, PrefData, PrefSpec};
use super::{source, Batch, Dataset};
use crate::recipe::DataSection;
use anyhow::{Context, Result};

/// The examples of a preference data set, in file order.
#[derive(Debug)]
pub enum PrefExamples {
    /// Pairs (dpo, orpo, simpo).
    Pairs(Vec<PairExample>),
    /// KTO's unpaired examples.
    Unpaired(Vec<UnpairedExample>),
}

/// A preference data set and what reading it found worth telling.
#[derive(Debug)]
pub struct PrefSet {
    /// Its examples; the stand-in data set's example i is example i here.
    pub examples: PrefExamples,
    /// Rows dropped or cut, as notes for the run's start.
    pub notes: Vec<String>,
}

impl PrefSet {
    /// Reads `cfg.train` (KTO's unpaired rows when `kto`), each file as `spec` says.
    pub fn load(cfg: &DataSection, spec: &PrefSpec, kto: bool) -> Result<(Dataset, PrefSet)> {
        let mut ds = Dataset::default();
        let (mut pairs, mut unpaired, mut notes) = (Vec::new(), Vec::new(), Vec::new());
        for (k, f) in cfg.train.files(cfg.format).iter().enumerate() {
            for sf in source::files_of(f, cfg, false)? {
                let what = || format!("cannot read the preference rows of {}", sf.name);
                let n = match kto {
                    true => {
                        let d = load_unpaired(&sf.path, spec).with_context(what)?;
                        note(&mut notes, &sf.name, &d);
                        for e in &d.examples {
                            let flag = 3 + i64::from(e.desirable);
                            stand_in(&mut ds, &[(&e.prompt, 0), (&e.completion, flag)]);
                        }
                        let n = d.examples.len();
                        unpaired.extend(d.examples);
                        n
                    }
                    false => {
                        let d = load_pairs(&sf.path, spec).with_context(what)?;
                        note(&mut notes, &sf.name, &d);
                        for e in &d.examples {
                            stand_in(&mut ds, &[(&e.prompt, 0), (&e.chosen, 1), (&e.rejected, 2)]);
                        }
                        let n = d.examples.len();
                        pairs.extend(d.examples);
                        n
                    }
                };
                ds.file_of.extend(std::iter::repeat_n(k, n));
            }
            if ds.files.is_empty() {
                ds.source = f.path.clone();
            }
            ds.files.push((f.path.clone(), f.weight));
        }
        let examples = match kto {
            true => PrefExamples::Unpaired(unpaired),
            false => PrefExamples::Pairs(pairs),
        };
        Ok((ds, PrefSet { examples, notes }))
    }

    /// The micro-batch of the examples `rows` (one example index a row, as the sampler gives
    /// them without packing), a pair one prefix tree a row (its prompt once); `max_len` is
    /// data.seq_len, `score_chosen_prompt` ORPO's.
    pub fn batch(
        &self,
        rows: &[Vec<usize>],
        pad_id: u32,
        max_len: usize,
        score_chosen_prompt: bool,
    ) -> Batch {
        let idx = rows.iter().flatten().copied();
        match &self.examples {
            PrefExamples::Pairs(v) => {
                let picked: Vec<&PairExample> = idx.filter_map(|i| v.get(i)).collect();
                PrefBatch::pairs(&picked, pad_id, max_len, 1, score_chosen_prompt).into_batch()
            }
            PrefExamples::Unpaired(v) => {
                let picked: Vec<&UnpairedExample> = idx.filter_map(|i| v.get(i)).collect();
                PrefBatch::kto(&picked, pad_id, max_len)
            }
        }
    }
}

/// One stand-in example: the parts' tokens, each labelled with its tag.
fn stand_in(ds: &mut Dataset, parts: &[(&Vec<u32>, i64)]) {
    let ids: Vec<u32> = parts.iter().flat_map(|(p, _)| p.iter().copied()).collect();
    let labels: Vec<i64> = parts
        .iter()
        .flat_map(|(p, tag)| std::iter::repeat_n(*tag, p.len()))
        .collect();
    ds.examples.push(&ids, &labels);
}

fn note<E>(notes: &mut Vec<String>, name: &str, d: &PrefData<E>) {
    if d.long_prompts > 0 {
        notes.push(format!(
            "{name}: {} rows dropped, their prompt alone filling data.seq_len (first: {})",
            d.long_prompts,
            d.long_prompts_first.as_deref().unwrap_or("?")
        ));
    }
    if d.prompts_cut > 0 {
        notes.push(format!(
            "{name}: {} prompts cut to their last data.max_prompt_len tokens",
            d.prompts_cut
        ));
    }
}
