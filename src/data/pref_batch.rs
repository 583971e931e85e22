//! A micro-batch of preference sequences packed into rows with no padding between them.
//!
//! A pair is one prefix tree (the shared prefix): [prompt | chosen | rejected] in one row, the
//! prompt computed once. Its tokens carry the tree ids `example << 2 | branch` (0 the prompt,
//! 1 chosen, 2 rejected; `ops::AttnMask::prefix_tree`): chosen sees the prompt and itself,
//! rejected the prompt and itself, never chosen; both continue the prompt's positions. Causal
//! attention makes the prompt's hidden states the same in either sequence, so the loss and every
//! gradient are those of the two sequences laid out apart (the prompt's activations take both
//! completions' gradients, summed), for p + c + r tokens instead of 2p + c + r. The first
//! token of each completion is predicted from the prompt's last position, which therefore
//! appears twice in `Batch::targets`. KTO's unpaired examples are each their own segment
//! (block-diagonal attention, positions restarting).
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

/// How a pair is laid out (the reference store's key names it: values computed in another
/// layout are recomputed).
pub const PAIR_LAYOUT: &str = "prefix tree: [prompt | chosen | rejected], the prompt once";

/// A packed micro-batch of preference sequences and which target belongs to which sequence.
#[derive(Debug, Clone)]
pub struct PrefBatch {
    /// The rows as the step engine takes them (always packed: `segments` is set; pairs as
    /// prefix trees, `prefix_tree` set), with `pref` set to `layout`.
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

/// One unpaired sequence to lay out: prompt and completion.
struct Seq<'a> {
    prompt: &'a [u32],
    completion: &'a [u32],
}

impl PrefBatch {
    /// Pairs, `pairs_per_row` to a row (1: a row per pair, padded to the longest pair; the
    /// micro-batch: one row, no padding), each a prefix tree [prompt | chosen | rejected].
    /// `score_chosen_prompt`: the chosen prompts' tokens are targets too (ORPO). The caller
    /// drops pairs whose prompt reaches `max_len` (see [`super::preference`]), so every
    /// sequence keeps a completion token.
    pub fn pairs(
        pairs: &[&PairExample],
        pad_id: u32,
        max_len: usize,
        pairs_per_row: usize,
        score_chosen_prompt: bool,
    ) -> PrefBatch {
        // keep_start per sequence: p = min(P, max_len), c and r cut to max_len - p each.
        let cuts: Vec<[usize; 3]> = pairs
            .iter()
            .map(|x| {
                let p = x.prompt.len().min(max_len);
                let room = max_len - p;
                [p, x.chosen.len().min(room), x.rejected.len().min(room)]
            })
            .collect();
        let per_row = pairs_per_row.max(1);
        let t = cuts
            .chunks(per_row)
            .map(|r| r.iter().map(|c| c.iter().sum::<usize>()).sum::<usize>())
            .max()
            .unwrap_or(1)
            .max(1);
        let b = pairs.len().div_ceil(per_row);
        let mut rows = Rows::new(b, t, pad_id);
        let mut l = PrefLayout::default();
        for (g, (x, &[p, c, r])) in pairs.iter().zip(&cuts).enumerate() {
            let (row, k) = (g / per_row, (g % per_row) as u32);
            let tree = k << 2;
            let base = rows.put(row, &x.prompt[..p], 0, tree);
            rows.put(row, &x.chosen[..c], p, tree | 1);
            rows.put(row, &x.rejected[..r], p, tree | 2);
            let seq = 2 * g as u32;
            // ORPO: the chosen prompt's tokens but its first.
            if score_chosen_prompt {
                for j in 1..p {
                    l.target(&mut rows.targets, (base + j - 1, x.prompt[j]), seq, false);
                }
            }
            // A completion's first token is predicted from the prompt's last position.
            for (side, (off, toks)) in [(0, &x.chosen[..c]), (c, &x.rejected[..r])]
                .into_iter()
                .enumerate()
            {
                for (j, &tok) in toks.iter().enumerate() {
                    let from = match j {
                        0 if p == 0 => continue,
                        0 => base + p - 1,
                        _ => base + p + off + j - 1,
                    };
                    l.target(&mut rows.targets, (from, tok), seq + side as u32, true);
                }
            }
            l.prompt_len.extend([p, p]);
            l.completion_len.extend([c, r]);
        }
        let mut batch = rows.finish();
        batch.prefix_tree = true;
        Self::with(batch, l)
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
                .map(|(j, &t)| match j >= p {
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
        let layout = PrefLayout {
            prompt_len,
            completion_len,
            target_seq,
            target_completion,
            ..PrefLayout::default()
        };
        Self::with(batch, layout)
    }

    /// The batch with its layout attached.
    fn with(batch: Batch, layout: PrefLayout) -> PrefBatch {
        let layout = Arc::new(layout);
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

/// Rows being filled with prefix trees: ids, positions, tree ids and targets, [B × T] each.
struct Rows {
    b: usize,
    t: usize,
    ids: Vec<u32>,
    positions: Vec<u32>,
    segments: Vec<u32>,
    real: Vec<bool>,
    /// Where each row's next token goes (within the row).
    fill: Vec<usize>,
    targets: Vec<(usize, u32)>,
}

impl Rows {
    fn new(b: usize, t: usize, pad_id: u32) -> Rows {
        Rows {
            b,
            t,
            ids: vec![pad_id; b * t],
            positions: vec![0; b * t],
            segments: vec![u32::MAX; b * t],
            real: vec![false; b * t],
            fill: vec![0; b],
            targets: Vec::new(),
        }
    }

    /// Appends `toks` to row `row` at positions from `pos`, tree id `id`; returns the flat
    /// index of the first.
    fn put(&mut self, row: usize, toks: &[u32], pos: usize, id: u32) -> usize {
        let at = row * self.t + self.fill[row];
        for (j, &tok) in toks.iter().enumerate() {
            self.ids[at + j] = tok;
            self.positions[at + j] = (pos + j) as u32;
            self.segments[at + j] = id;
            self.real[at + j] = true;
        }
        self.fill[row] += toks.len();
        at
    }

    fn finish(mut self) -> Batch {
        // Padding continues the positions (its outputs are never used), as `Batch::from_rows`.
        for (r, &f) in self.fill.iter().enumerate() {
            for p in f..self.t {
                self.positions[r * self.t + p] = p as u32;
            }
        }
        Batch {
            b: self.b,
            t: self.t,
            tokens: self.fill.iter().sum(),
            ids: self.ids,
            positions: self.positions,
            segments: Some(self.segments),
            prefix_tree: false,
            targets: self.targets,
            real: self.real,
            pref: None,
        }
    }
}

impl PrefLayout {
    /// Records a target of sequence `seq` (a completion token, or a scored prompt token).
    fn target(
        &mut self,
        targets: &mut Vec<(usize, u32)>,
        t: (usize, u32),
        seq: u32,
        completion: bool,
    ) {
        targets.push(t);
        self.target_seq.push(seq);
        self.target_completion.push(completion);
    }

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
    fn a_pair_is_one_prefix_tree_its_prompt_once() {
        let (a, b) = (pair(&[1, 2], &[3, 4, 5], &[6]), pair(&[7], &[8], &[9, 10]));
        let pb = PrefBatch::pairs(&[&a, &b], 0, 100, 1, false);
        let batch = &pb.batch;
        assert!(batch.prefix_tree);
        // [prompt | chosen | rejected]: 2 + 3 + 1 and 1 + 1 + 2 tokens
        assert_eq!((batch.b, batch.t), (2, 6));
        assert_eq!(batch.ids, vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 0]);
        assert_eq!(batch.tokens, 10);
        // rejected continues the prompt's positions as chosen does; padding continues the row
        assert_eq!(batch.positions, vec![0, 1, 2, 3, 4, 2, 0, 1, 1, 2, 4, 5]);
        let m = u32::MAX;
        let seg = batch.segments.as_ref().unwrap();
        assert_eq!(seg, &vec![0, 0, 1, 1, 1, 2, 0, 1, 2, 2, m, m]);
        // each completion's first token from the prompt's last position (1; row 1: 6)
        let want = vec![(1, 3), (2, 4), (3, 5), (1, 6), (6, 8), (6, 9), (8, 10)];
        assert_eq!(batch.targets, want);
        assert_eq!(pb.layout.target_seq, vec![0, 0, 0, 1, 2, 3, 3]);
        assert!(pb.layout.target_completion.iter().all(|&c| c));
        assert_eq!(pb.layout.prompt_len, vec![2, 2, 1, 1]);
        assert_eq!(pb.layout.completion_len, vec![3, 1, 1, 2]);
        assert!(batch.pref.is_some());
        // one row for both pairs: no padding at all, the second tree's ids 1 << 2 | branch
        let one = PrefBatch::pairs(&[&a, &b], 0, 100, 2, false);
        assert_eq!((one.batch.b, one.batch.t), (1, 10));
        assert_eq!(one.batch.ids, batch.ids[..10]);
        assert_eq!(
            one.batch.segments.as_deref().unwrap(),
            &[0, 0, 1, 1, 1, 2, 4, 5, 6, 6]
        );
        assert_eq!(one.batch.positions, batch.positions[..10]);
        assert_eq!(one.batch.targets, want);
        assert_eq!(one.layout.target_seq, pb.layout.target_seq);
        // KTO's unpaired rows are no trees
        let e = UnpairedExample {
            prompt: vec![1, 2],
            completion: vec![3],
            desirable: true,
        };
        let k = PrefBatch::kto(&[&e, &e], 0, 100);
        assert!(!k.prefix_tree);
        assert_eq!(k.segments.as_deref().unwrap(), &[0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn truncation_keeps_the_start_and_orpo_scores_chosen_prompts() {
        let a = pair(&[1, 2, 3], &[4, 5, 6, 7], &[8, 9]);
        let pb = PrefBatch::pairs(&[&a], 0, 5, 1, true);
        // each sequence cut to 5: the prompt's 3 and 2 of each completion
        assert_eq!(pb.batch.ids, vec![1, 2, 3, 4, 5, 8, 9]);
        let from: Vec<usize> = pb.batch.targets.iter().map(|t| t.0).collect();
        assert_eq!(from, vec![0, 1, 2, 3, 2, 5]);
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
