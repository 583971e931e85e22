//! The plan's search: every strategy and checkpointing setting, each one's largest micro-batch
//! and longest context within a card, and the rows they make.

use super::*;
use crate::recipe::{Checkpointing, Strategy};

/// The strategies a plan covers: single, and ddp and fsdp when there are several GPUs.
pub(crate) fn strategies(gpus: usize) -> Vec<Strategy> {
    if gpus > 1 {
        vec![Strategy::Single, Strategy::Ddp, Strategy::Fsdp]
    } else {
        vec![Strategy::Single]
    }
}

/// The largest micro-batch (up to `limit`) whose total fits `capacity`; None if 1 does not.
pub(crate) fn max_micro_batch(
    p: &PlanInput,
    strategy: Strategy,
    ckpt: Checkpointing,
    capacity: u64,
    limit: usize,
) -> Option<usize> {
    largest(limit, |mb| {
        p.fits(
            &breakdown_within(p, strategy, ckpt, mb, Some(capacity)),
            capacity,
        )
    })
}

/// seq_len is searched in steps of this many tokens.
pub(crate) const SEQ_STEP: usize = 1024;

/// The longest seq_len (a multiple of `SEQ_STEP`, up to `limit`) whose total at micro-batch 1
/// fits `capacity`; None if `SEQ_STEP` tokens do not.
pub(crate) fn max_seq_len(
    p: &PlanInput,
    strategy: Strategy,
    ckpt: Checkpointing,
    capacity: u64,
    limit: usize,
) -> Option<usize> {
    let fits = |k: usize| {
        let at = PlanInput {
            seq_len: k * SEQ_STEP,
            ..p.clone()
        };
        p.fits(
            &breakdown_within(&at, strategy, ckpt, 1, Some(capacity)),
            capacity,
        )
    };
    largest(limit / SEQ_STEP, fits).map(|k| k * SEQ_STEP)
}

/// The largest n in 1..=limit with `fits(n)`, for a `fits` that holds up to some n and
/// not above it (totals grow with micro-batch and seq_len): double, then bisect. None if
/// `fits(1)` does not hold.
pub(super) fn largest(limit: usize, fits: impl Fn(usize) -> bool) -> Option<usize> {
    if limit == 0 || !fits(1) {
        return None;
    }
    let mut lo = 1;
    while lo < limit && fits((lo * 2).min(limit)) {
        lo = (lo * 2).min(limit);
    }
    let mut hi = (lo * 2).min(limit);
    if lo == hi {
        return Some(lo);
    }
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if fits(mid) {
            lo = mid
        } else {
            hi = mid
        }
    }
    Some(lo)
}

/// One row of the plan: a breakdown and, against a capacity, whether it fits.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Row {
    #[serde(flatten)]
    pub(crate) b: Breakdown,
    pub(crate) fits: Option<bool>,
    /// The largest micro-batch that fits (None: no capacity, or not even 1).
    pub(crate) max_micro_batch: Option<usize>,
    /// The longest seq_len that fits at micro-batch 1 (None: no capacity, or not even
    /// `SEQ_STEP` tokens).
    pub(crate) max_seq_len: Option<usize>,
}

/// The whole plan: rows for every strategy × checkpointing, and advice.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Plan {
    pub(crate) micro_batch: usize,
    pub(crate) grad_accum: usize,
    pub(crate) seq_len: usize,
    pub(crate) gpus: usize,
    pub(crate) dtype_bytes: u64,
    pub(crate) lora_params: u64,
    pub(crate) base_params: u64,
    pub(crate) kept_bytes_per_token_layer: u64,
    pub(crate) capacity: Option<u64>,
    /// Host memory free to pin activations in (`PlanInput::host`).
    pub(crate) host: Option<u64>,
    /// The base's decoder linears in NF4 (`PlanInput::quant`).
    pub(crate) nf4: bool,
    pub(crate) rows: Vec<Row>,
    pub(crate) advice: Advice,
}

/// Largest micro-batch searched.
pub(crate) const MB_LIMIT: usize = 4096;

/// Longest seq_len searched: the recipe's bound.
pub(crate) const SEQ_LIMIT: usize = crate::recipe::bounds::MAX_SEQ_LEN;

/// Every strategy × checkpointing at `p`: each row's breakdown, whether it fits `capacity`,
/// the largest micro-batch and longest seq_len that do; and the advice.
pub fn plan(p: &PlanInput, grad_accum: usize, capacity: Option<u64>) -> Plan {
    let mut rows = Vec::new();
    for st in strategies(p.gpus) {
        for ckpt in [Checkpointing::Off, Checkpointing::Mlp, Checkpointing::Full] {
            let b = breakdown_within(p, st, ckpt, p.micro_batch, capacity);
            rows.push(Row {
                fits: capacity.map(|c| p.fits(&b, c)),
                max_micro_batch: capacity.and_then(|c| max_micro_batch(p, st, ckpt, c, MB_LIMIT)),
                max_seq_len: capacity.and_then(|c| max_seq_len(p, st, ckpt, c, SEQ_LIMIT)),
                b,
            });
        }
    }
    let mut advice = advise(&rows, p.micro_batch, grad_accum, capacity);
    if let Some((r, t)) = advice::longest(&rows) {
        let at = PlanInput {
            seq_len: t,
            ..p.clone()
        };
        let b = breakdown_within(&at, r.b.strategy, r.b.ckpt, 1, capacity);
        let max_pos = p.cfg.max_position_embeddings;
        advice.max_seq_len = Some(t);
        advice.lines.push(advice::longest_line(r, t, &b, max_pos));
    }
    Plan {
        micro_batch: p.micro_batch,
        grad_accum,
        seq_len: p.seq_len,
        gpus: p.gpus,
        dtype_bytes: p.dtype_bytes,
        lora_params: lora_params(&p.cfg, p.rank, &p.targets)
            + if p.dora {
                magnitude_params(&p.cfg, &p.targets)
            } else {
                0
            },
        base_params: p.cfg.num_params(p.tied) as u64,
        kept_bytes_per_token_layer: kept_per_token_layer(&p.cfg, p.dtype_bytes, p.rank, &p.targets),
        capacity,
        host: p.host,
        nf4: p.quant.is_nf4(),
        rows,
        advice,
    }
}

pub(crate) fn strategy_name(s: Strategy) -> &'static str {
    match s {
        Strategy::Single => "single",
        Strategy::Ddp => "ddp",
        Strategy::Fsdp => "fsdp",
    }
}

/// The row of a strategy and checkpointing setting.
pub(crate) fn row(p: &Plan, strategy: Strategy, ckpt: Checkpointing) -> Option<&Row> {
    p.rows
        .iter()
        .find(|r| r.b.strategy == strategy && r.b.ckpt == ckpt)
}
