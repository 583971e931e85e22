//! A micro-batch of preference sequences packed into rows with no padding between them: a
//! pair's chosen and rejected sequences side by side in one row, each its own segment
//! (block-diagonal attention, positions restarting), so the forward computes each token once
//! and the two sequences of a pair never see each other.
//!
//! Sequence k of a pair batch: pair k / 2, chosen when k is even, rejected when odd. Every
//! sequence is prompt + completion cut to `max_len` tokens (TRL's keep_start collator); its
//! completion tokens are targets, and the prompt's too where asked (ORPO scores the chosen
//! prompts). [`PrefLayout::seq_sums`] folds the head's per-target log-probabilities into
//! per-sequence sums; [`PrefLayout::target_weights`] spreads dL/d(sum) back over the targets.
//! The layout rides with the rows in `Batch::pref`.

use super::preference::{PairExample, UnpairedExample};
use super::{Batch, Example, IGNORE};
use candle_core::{Device, Result, Tensor};
use std::sync::Arc;

/// A packed micro-batch of preference sequences and which target belongs to which sequence.
#[derive(Debug, Clone)]
pub struct PrefBatch {
    /// The rows as the step engine takes them (always packed: `segments` is set), with
    /// `pref` set to `layout`.
    pub batch: Batch,
    /// Which target belongs to which sequence.
    pub layout: Arc<PrefLayout>,
}

/// What a preference objective needs of a micro-batch beyond its rows: each target's
/// sequence, each sequence's lengths; KTO's labels and mismatched pairs.
#[derive(Debug, Clone, Default)]
pub struct PrefLayout {
    /// Per sequence: its prompt tokens (after truncation).
    pub prompt_len: Vec<usize>,
    /// Per sequence: its completion tokens left after truncation (at least one).
    pub completion_len: Vec<usize>,
    /// Aligned with `batch.targets`: the sequence each target belongs to.
    pub target_seq: Vec<u32>,
    /// Aligned with `batch.targets`: whether the target is a completion token (else a prompt
    /// token scored for ORPO's NLL).
    pub target_completion: Vec<bool>,
    /// KTO: per sequence, desirable or not (empty for pairs).
    pub desirable: Vec<bool>,
    /// KTO: the batch of the micro-batch's mismatched pairs (its KL estimate), with its own
    /// layout.
    pub kl: Option<Box<Batch>>,
    /// The reference's per-sequence log-probabilities [n_seqs], when they were computed
    /// before the run (`train.precompute_ref`); the objective reads them instead of running
    /// the reference's forward.
    pub reference: Option<Vec<f32>>,
}

/// One sequence to lay out: prompt, completion, and whether its prompt tokens are targets.
struct Seq<'a> {
    prompt: &'a [u32],
    completion: &'a [u32],
    score_prompt: bool,
}

impl PrefBatch {
    /// Pairs, `pairs_per_row` to a row (1: a row per pair, padded to the longest pair; the
    /// micro-batch: one row, no padding). `score_chosen_prompt`: the chosen prompts' tokens
    /// are targets too (ORPO). The caller drops pairs whose prompt reaches `max_len` (see
    /// [`super::preference`]), so every sequence keeps a completion token.
    pub fn pairs(
        pairs: &[&PairExample],
        pad_id: u32,
        max_len: usize,
        pairs_per_row: usize,
        score_chosen_prompt: bool,
    ) -> PrefBatch {
        let seqs: Vec<Seq> = pairs
            .iter()
            .flat_map(|p| {
                [
                    Seq {
                        prompt: &p.prompt,
                        completion: &p.chosen,
                        score_prompt: score_chosen_prompt,
                    },
                    Seq {
                        prompt: &p.prompt,
                        completion: &p.rejected,
                        score_prompt: false,
                    },
                ]
            })
            .collect();
        Self::layout(&seqs, pad_id, max_len, 2 * pairs_per_row.max(1))
    }

    /// KTO examples (or their [`super::preference::kl_pairs`]), `per_row` to a row.
    pub fn unpaired(
        examples: &[&UnpairedExample],
        pad_id: u32,
        max_len: usize,
        per_row: usize,
    ) -> PrefBatch {
        let seqs: Vec<Seq> = examples
            .iter()
            .map(|e| Seq {
                prompt: &e.prompt,
                completion: &e.completion,
                score_prompt: false,
            })
            .collect();
        Self::layout(&seqs, pad_id, max_len, per_row.max(1))
    }

    fn layout(seqs: &[Seq], pad_id: u32, max_len: usize, per_row: usize) -> PrefBatch {
        let mut examples = Vec::with_capacity(seqs.len());
        let (mut prompt_len, mut completion_len) = (Vec::new(), Vec::new());
        for s in seqs {
            let p = s.prompt.len().min(max_len);
            let c = s.completion.len().min(max_len - p);
            let ids: Vec<u32> = s.prompt[..p]
                .iter()
                .chain(&s.completion[..c])
                .copied()
                .collect();
            let labels = ids
                .iter()
                .enumerate()
                .map(|(j, &t)| match j >= p || s.score_prompt {
                    true => t as i64,
                    false => IGNORE,
                })
                .collect();
            examples.push(Example { ids, labels });
            prompt_len.push(p);
            completion_len.push(c);
        }
        let rows: Vec<Vec<&Example>> = examples
            .chunks(per_row)
            .map(|c| c.iter().collect())
            .collect();
        let batch = Batch::from_rows(&rows, pad_id, true);
        Self::with_layout(batch, per_row, prompt_len, completion_len)
    }

    fn with_layout(
        batch: Batch,
        per_row: usize,
        prompt_len: Vec<usize>,
        completion_len: Vec<usize>,
    ) -> PrefBatch {
        // Row r's segment k is sequence r·per_row + k.
        let segments = batch.segments.as_deref().unwrap_or_default();
        let (mut target_seq, mut target_completion) = (Vec::new(), Vec::new());
        for &(at, _) in &batch.targets {
            let seq = (at / batch.t) * per_row + segments[at] as usize;
            // The target is the token after position `at`, within the same sequence.
            let pos = batch.positions[at] as usize + 1;
            target_seq.push(seq as u32);
            target_completion.push(pos >= prompt_len[seq]);
        }
        let layout = Arc::new(PrefLayout {
            prompt_len,
            completion_len,
            target_seq,
            target_completion,
            desirable: Vec::new(),
            kl: None,
            reference: None,
        });
        let batch = Batch {
            pref: Some(layout.clone()),
            ..batch
        };
        PrefBatch { batch, layout }
    }

    /// KTO's micro-batch: the examples with their labels, and their mismatched pairs
    /// ([`super::preference::kl_pairs`]) as the layout's `kl` batch.
    pub fn kto(examples: &[&UnpairedExample], pad_id: u32, max_len: usize) -> Batch {
        let kl = super::preference::kl_pairs(examples);
        let kl: Vec<&UnpairedExample> = kl.iter().collect();
        let kl = Self::unpaired(&kl, pad_id, max_len, 1).batch;
        let main = Self::unpaired(examples, pad_id, max_len, 1);
        let layout = PrefLayout {
            desirable: examples.iter().map(|e| e.desirable).collect(),
            kl: Some(Box::new(kl)),
            ..(*main.layout).clone()
        };
        Batch {
            pref: Some(Arc::new(layout)),
            ..main.batch
        }
    }

    /// The batch, its layout inside.
    pub fn into_batch(self) -> Batch {
        self.batch
    }
}

impl PrefLayout {
    /// Sequences in the batch.
    pub fn n_seqs(&self) -> usize {
        self.completion_len.len()
    }

    /// Per-target log-probabilities [n_targets] → per-sequence sums over the completion
    /// targets and over the prompt targets, each [n_seqs], on `logps`' device and dtype.
    pub fn seq_sums(&self, logps: &Tensor) -> Result<(Tensor, Tensor)> {
        let dev = logps.device();
        let n = self.n_seqs();
        let mask = |completion: bool| -> Result<Tensor> {
            let m: Vec<f32> = self
                .target_completion
                .iter()
                .map(|&c| f32::from(u8::from(c == completion)))
                .collect();
            Tensor::from_vec(m, self.target_completion.len(), &Device::Cpu)?
                .to_dtype(logps.dtype())?
                .to_device(dev)
        };
        let idx = Tensor::from_vec(self.target_seq.clone(), self.target_seq.len(), &Device::Cpu)?
            .to_device(dev)?;
        let zeros = Tensor::zeros(n, logps.dtype(), dev)?;
        let sum = |completion: bool| -> Result<Tensor> {
            zeros.index_add(&idx, &(logps * mask(completion)?)?, 0)
        };
        Ok((sum(true)?, sum(false)?))
    }

    /// dL/d(each target's log-probability) [n_targets]: `d_completion[seq]` [n_seqs] on the
    /// completion targets, `d_prompt` on the prompt targets (ORPO's NLL).
    pub fn target_weights(&self, d_completion: &Tensor, d_prompt: f64) -> Result<Tensor> {
        let dev = d_completion.device();
        let idx = Tensor::from_vec(self.target_seq.clone(), self.target_seq.len(), &Device::Cpu)?
            .to_device(dev)?;
        let per = d_completion.index_select(&idx, 0)?;
        let keep: Vec<f32> = self
            .target_completion
            .iter()
            .map(|&c| f32::from(u8::from(c)))
            .collect();
        let keep = Tensor::from_vec(keep, self.target_completion.len(), &Device::Cpu)?
            .to_dtype(per.dtype())?
            .to_device(dev)?;
        // completion: per; prompt: d_prompt
        (per * &keep)? + ((keep.affine(-1.0, 1.0)? * d_prompt)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(p: &[u32], c: &[u32], r: &[u32]) -> PairExample {
        PairExample {
            prompt: p.to_vec(),
            chosen: c.to_vec(),
            rejected: r.to_vec(),
        }
    }

    #[test]
    fn a_pair_shares_a_row_block_diagonally_without_padding() {
        let (a, b) = (pair(&[1, 2], &[3, 4, 5], &[6]), pair(&[7], &[8], &[9, 10]));
        let pb = PrefBatch::pairs(&[&a, &b], 0, 100, 1, false);
        let batch = &pb.batch;
        assert_eq!((batch.b, batch.t), (2, 8));
        assert_eq!(&batch.ids[..8], &[1, 2, 3, 4, 5, 1, 2, 6]);
        assert_eq!(&batch.ids[8..13], &[7, 8, 7, 9, 10]);
        assert_eq!(batch.positions[..8], [0, 1, 2, 3, 4, 0, 1, 2]);
        let seg = batch.segments.as_ref().unwrap();
        assert_eq!(seg[..8], [0, 0, 0, 0, 0, 1, 1, 1]);
        // completion tokens only: 3 4 5 | 6 | 8 | 9 10
        let tokens: Vec<u32> = batch.targets.iter().map(|t| t.1).collect();
        assert_eq!(tokens, vec![3, 4, 5, 6, 8, 9, 10]);
        assert_eq!(pb.layout.target_seq, vec![0, 0, 0, 1, 2, 3, 3]);
        assert!(pb.layout.target_completion.iter().all(|&c| c));
        assert_eq!(pb.layout.completion_len, vec![3, 1, 1, 2]);
        assert!(batch.pref.is_some());
        // one row for both pairs: no padding at all
        let one = PrefBatch::pairs(&[&a, &b], 0, 100, 2, false);
        assert_eq!((one.batch.b, one.batch.t), (1, 13));
        assert_eq!(one.layout.target_seq, pb.layout.target_seq);
    }

    #[test]
    fn truncation_keeps_the_start_and_orpo_scores_chosen_prompts() {
        let a = pair(&[1, 2, 3], &[4, 5, 6, 7], &[8, 9]);
        let pb = PrefBatch::pairs(&[&a], 0, 5, 1, true);
        assert_eq!(pb.batch.ids, vec![1, 2, 3, 4, 5, 1, 2, 3, 8, 9]);
        let pl = &pb.layout;
        assert_eq!(pl.completion_len, vec![2, 2]);
        let tokens: Vec<u32> = pb.batch.targets.iter().map(|t| t.1).collect();
        // chosen: prompt tokens 2 3 (1 is never predicted), completion 4 5; rejected: 8 9
        assert_eq!(tokens, vec![2, 3, 4, 5, 8, 9]);
        assert_eq!(
            pl.target_completion,
            vec![false, false, true, true, true, true]
        );
        let logps = Tensor::new(&[-1.0f64, -2.0, -3.0, -4.0, -5.0, -6.0], &Device::Cpu).unwrap();
        let (comp, prompt) = pl.seq_sums(&logps).unwrap();
        assert_eq!(comp.to_vec1::<f64>().unwrap(), vec![-7.0, -11.0]);
        assert_eq!(prompt.to_vec1::<f64>().unwrap(), vec![-3.0, 0.0]);
        let d = Tensor::new(&[0.5f64, -0.25], &Device::Cpu).unwrap();
        let w = pl
            .target_weights(&d, -0.1)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        assert_eq!(w, vec![-0.1, -0.1, 0.5, 0.5, -0.25, -0.25]);
    }
}
