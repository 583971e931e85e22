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
