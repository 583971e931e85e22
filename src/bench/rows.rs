//! The random rows a bench trains on: token ids like the baseline's (labels = ids shifted),
//! spread over the ranks as one global batch.

use super::{workload, BenchArgs};
use crate::data::Batch;

/// Random token ids (labels = ids shifted), like the baseline: [b, t], every position but
/// each row's last counted.
pub(crate) fn random_batch(b: usize, t: usize, vocab: usize, seed: u64) -> Batch {
    let mut rng = crate::rng::Rng::new(seed);
    let ids: Vec<u32> = (0..b * t).map(|_| rng.below(vocab) as u32).collect();
    workload::batch(&ids, b, t, 1)
}

/// This rank's micro-batches of a step and its eval batches: random token ids (labels = ids),
/// like the baseline's. Global row g is seeded by g, and micro-batch m holds rows
/// (m·b + j)·world + rank, j < b; the eval rows follow the step's.
pub(super) fn micro_batches(
    a: &BenchArgs,
    vocab: usize,
    rank: usize,
    world: usize,
) -> (Vec<Batch>, Vec<Batch>) {
    let (b, t, accum) = (a.micro_batch, a.seq, a.grad_accum.max(1));
    let row = |g: usize| -> Vec<u32> {
        let mut rng = crate::rng::Rng::new(1234 + g as u64);
        (0..t).map(|_| rng.below(vocab) as u32).collect()
    };
    if a.objective.data_format().is_some() {
        return pref_batches(a, vocab, rank, world);
    }
    let micro = |m: usize| {
        let ids: Vec<u32> = (0..b)
            .flat_map(|j| row((m * b + j) * world + rank))
            .collect();
        workload::batch(&ids, b, t, a.pack)
    };
    let batches = (0..accum).map(micro).collect();
    let evals = match a.eval_every {
        0 => Vec::new(),
        _ => (accum..accum + a.eval_batches.max(1)).map(micro).collect(),
    };
    (batches, evals)
}

/// A pair's prompt tokens: `prompt_len`, at least 1 and leaving a completion token.
fn prompt_tokens(a: &BenchArgs) -> usize {
    a.prompt_len.clamp(1, a.seq.saturating_sub(1).max(1))
}

/// Tokens of one unit of the bench's rows: a pair's prefix tree (its prompt once and its two
/// completions: 2 · seq − prompt), or a sequence (SFT; KTO's example).
pub(crate) fn unit_tokens(a: &BenchArgs) -> usize {
    use crate::recipe::TrainObjective::{Kto, Sft};
    match a.objective {
        Sft | Kto => a.seq,
        _ => 2 * a.seq - prompt_tokens(a).min(a.seq),
    }
}

/// Random preference micro-batches: pair g's prompt (`prompt_len` tokens) and its chosen and
/// rejected completions (`seq - prompt_len` tokens each) seeded by g, laid out as `train` lays
/// pairs out (a pair one row, its prompt once; KTO: one example a row, its mismatched pairs).
fn pref_batches(
    a: &BenchArgs,
    vocab: usize,
    rank: usize,
    world: usize,
) -> (Vec<Batch>, Vec<Batch>) {
    use crate::data::pref_batch::PrefBatch;
    use crate::data::preference::{PairExample, UnpairedExample};
    let (b, t, accum) = (a.micro_batch, a.seq, a.grad_accum.max(1));
    let p = prompt_tokens(a);
    let ids = |rng: &mut crate::rng::Rng, n: usize| -> Vec<u32> {
        (0..n).map(|_| rng.below(vocab) as u32).collect()
    };
    let pair = |g: usize| {
        let mut rng = crate::rng::Rng::new(4321 + g as u64);
        PairExample {
            prompt: ids(&mut rng, p),
            chosen: ids(&mut rng, t - p),
            rejected: ids(&mut rng, t - p),
        }
    };
    let orpo = a.objective == crate::recipe::TrainObjective::Orpo;
    let micro = |m: usize| {
        let pairs: Vec<PairExample> = (0..b).map(|j| pair((m * b + j) * world + rank)).collect();
        match a.objective {
            crate::recipe::TrainObjective::Kto => {
                let ex: Vec<UnpairedExample> = pairs
                    .into_iter()
                    .enumerate()
                    .map(|(j, x)| UnpairedExample {
                        prompt: x.prompt,
                        completion: x.chosen,
                        desirable: j % 2 == 0,
                    })
                    .collect();
                PrefBatch::kto(&ex.iter().collect::<Vec<_>>(), 0, t)
            }
            _ => PrefBatch::pairs(&pairs.iter().collect::<Vec<_>>(), 0, t, 1, orpo).into_batch(),
        }
    };
    ((0..accum).map(micro).collect(), Vec::new())
}
