//! What to do about a plan: the recommended setting (`advise`) and, when the run's own row
//! does not fit, the settings that would (`remedies`).

use super::{fmt_bytes, label, row, strategy_name, Plan, Row};
use crate::recipe::{Checkpointing, Strategy};

/// What to do, in the order the checks run.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub(crate) struct Advice {
    pub(crate) strategy: Option<Strategy>,
    pub(crate) ckpt: Option<Checkpointing>,
    pub(crate) micro_batch: Option<usize>,
    pub(crate) grad_accum: Option<usize>,
    /// The longest seq_len any row holds at micro-batch 1 (`longest`).
    pub(crate) max_seq_len: Option<usize>,
    pub(crate) lines: Vec<String>,
}

/// The most of a card an advised setting takes: the rest is room for the allocator's
/// fragmentation and the forecast's error (it lands within 2% of measured peaks).
pub(crate) const ADVISED_SHARE: f64 = 0.9;

/// The recommendation (a row within `ADVISED_SHARE` of the card): fits single → single (checkpointing only if needed); fits only
/// sharded → fsdp; nothing fits at this micro-batch → the largest micro-batch that fits with
/// more accumulation (same global batch), when activations dominate; lower LoRA rank /
/// fewer targets when the optimiser dominates; more GPUs when the base does.
pub(crate) fn advise(
    rows: &[Row],
    micro_batch: usize,
    grad_accum: usize,
    capacity: Option<u64>,
) -> Advice {
    let mut a = Advice {
        strategy: None,
        ckpt: None,
        micro_batch: None,
        grad_accum: None,
        max_seq_len: None,
        lines: Vec::new(),
    };
    let Some(cap) = capacity else {
        // No capacity: say only what dominates.
        if let Some(r) = find(rows, Strategy::Single, Checkpointing::Off) {
            a.lines.push(format!(
                "no capacity given (--gpu-mem): single without checkpointing needs {}; {} dominate",
                fmt_bytes(r.b.total),
                r.b.dominant()
            ));
        }
        return a;
    };
    let budget = (cap as f64 * ADVISED_SHARE) as u64;
    if let Some(r) = ordered(rows).find(|r| r.fits == Some(true) && r.b.total <= budget) {
        a.use_row(r, micro_batch, grad_accum, cap, rows);
        return a;
    }
    if let Some(r) = ordered(rows).find(|r| r.fits == Some(true)) {
        // It fits, but with no room for the allocator's fragmentation: not advised.
        a.lines.push(format!(
            "{} fits at {} of {} per rank, above {:.0}% of the card (little room for fragmentation): for headroom, a smaller train.micro_batch with a larger train.grad_accum, or more train.activation_checkpointing",
            label(&r.b),
            fmt_bytes(r.b.total),
            fmt_bytes(cap),
            ADVISED_SHARE * 100.0
        ));
        return a;
    }
    // Nothing fits at this micro-batch: the best setting at a smaller one.
    let Some(best) = ordered(rows).next_back() else {
        return a;
    };
    a.lines.push(format!(
        "nothing fits {} per rank at micro-batch {micro_batch}; {} (needs {}) is the smallest",
        fmt_bytes(cap),
        label(&best.b),
        fmt_bytes(best.b.total)
    ));
    match best.b.dominant() {
        "activations" => a.shrink_micro_batch(rows, best, micro_batch, grad_accum),
        "optimizer" => a.lines.push(
            "the adapters and their AdamW state dominate: lower lora.rank or target fewer modules (lora.targets)"
                .into(),
        ),
        _ => a.lines.push(
            "the base weights dominate: shard them over more GPUs (parallel.strategy = \"fsdp\"), or use a card with more memory"
                .into(),
        ),
    }
    a
}

/// The settings `advise` tries, in the order it prefers them: single before fsdp, less
/// checkpointing before more.
const ORDER: [(Strategy, Checkpointing); 6] = [
    (Strategy::Single, Checkpointing::Off),
    (Strategy::Single, Checkpointing::Mlp),
    (Strategy::Single, Checkpointing::Full),
    (Strategy::Fsdp, Checkpointing::Off),
    (Strategy::Fsdp, Checkpointing::Mlp),
    (Strategy::Fsdp, Checkpointing::Full),
];

/// The row of strategy `st` and checkpointing `ck`, if planned.
fn find(rows: &[Row], st: Strategy, ck: Checkpointing) -> Option<&Row> {
    rows.iter().find(|r| r.b.strategy == st && r.b.ckpt == ck)
}

/// The planned rows of `ORDER`, in its order.
fn ordered(rows: &[Row]) -> impl DoubleEndedIterator<Item = &Row> {
    ORDER.iter().filter_map(|&(st, ck)| find(rows, st, ck))
}

impl Advice {
    /// The advice to run `r`, which fits `cap` at the plan's micro-batch (and why not ddp,
    /// where it is fsdp).
    fn use_row(&mut self, r: &Row, micro_batch: usize, grad_accum: usize, cap: u64, rows: &[Row]) {
        self.strategy = Some(r.b.strategy);
        self.ckpt = Some(r.b.ckpt);
        self.micro_batch = Some(micro_batch);
        self.grad_accum = Some(grad_accum);
        let st = strategy_name(r.b.strategy);
        self.lines.push(format!(
            "use {st}{}: {} of {} per rank",
            match r.b.ckpt {
                Checkpointing::Full => " with activation checkpointing",
                Checkpointing::Mlp => " with train.activation_checkpointing = \"mlp\"",
                Checkpointing::Off => "",
            },
            fmt_bytes(r.b.total),
            fmt_bytes(cap)
        ));
        if r.b.strategy == Strategy::Fsdp {
            if let Some(d) = find(rows, Strategy::Ddp, r.b.ckpt) {
                self.lines.push(format!(
                    "ddp does not fit ({}): each rank holds a full replica of the base, as single does",
                    fmt_bytes(d.b.total)
                ));
            }
        }
    }

    /// Where activations dominate `best` (the smallest row): the first setting of `ORDER` at
    /// the largest micro-batch that fits it, with the accumulation that keeps the rows per
    /// step; and checkpointing, where `best` has less than full.
    fn shrink_micro_batch(
        &mut self,
        rows: &[Row],
        best: &Row,
        micro_batch: usize,
        grad_accum: usize,
    ) {
        let fit = ordered(rows)
            .filter_map(|r| r.max_micro_batch.map(|m| (r, m)))
            .next();
        match fit {
            Some((r, m)) => {
                // Keep the global batch: micro × accum, rounded up.
                let accum = (micro_batch * grad_accum).div_ceil(m);
                self.strategy = Some(r.b.strategy);
                self.ckpt = Some(r.b.ckpt);
                self.micro_batch = Some(m);
                self.grad_accum = Some(accum);
                self.lines.push(format!(
                    "activations dominate: use {} at train.micro_batch = {m} with train.grad_accum = {accum} (the same {} rows per step)",
                    label(&r.b),
                    micro_batch * grad_accum
                ));
            }
            None => self.lines.push(
                "activations dominate and even micro-batch 1 does not fit: shorten data.seq_len"
                    .into(),
            ),
        }
        if best.b.ckpt != Checkpointing::Full {
            self.lines
                .push("turn on train.activation_checkpointing = true".into());
        }
    }
}

/// The row that holds the longest context: the largest `max_seq_len` (the first such in the
/// plan's order), with that seq_len.
pub(crate) fn longest(rows: &[Row]) -> Option<(&Row, usize)> {
    let mut best: Option<(&Row, usize)> = None;
    for r in rows {
        if let Some(t) = r.max_seq_len {
            if best.is_none_or(|(_, b)| t > b) {
                best = Some((r, t));
            }
        }
    }
    best
}

/// The advice line of the longest context: `t` tokens on row `r`, whose breakdown there is
/// `at`; past the model's `max_positions` it says so.
pub(crate) fn longest_line(
    r: &Row,
    t: usize,
    at: &super::Breakdown,
    max_positions: usize,
) -> String {
    let host = match at.host {
        0 => String::new(),
        h => format!(" and {} of pinned host memory", fmt_bytes(h)),
    };
    let mut line = format!(
        "longest context: data.seq_len = {t} at micro-batch 1 with {} ({} per rank{host})",
        label(&r.b),
        fmt_bytes(at.total)
    );
    if t > max_positions {
        line.push_str(&format!(
            "; past the model's max_position_embeddings ({max_positions}) positions are beyond its training"
        ));
    }
    line
}

/// What to change when the run's row (`selected`) does not fit: concrete settings, each with
/// its forecast.
pub(crate) fn remedies(p: &Plan, selected: (Strategy, Checkpointing)) -> Vec<String> {
    let mut out = Vec::new();
    let (st, ck) = selected;
    let more = match ck {
        Checkpointing::Off => &[Checkpointing::Mlp, Checkpointing::Full][..],
        Checkpointing::Mlp => &[Checkpointing::Full][..],
        Checkpointing::Full => &[][..],
    };
    for &c in more {
        if let Some(r) = row(p, st, c) {
            out.push(format!(
                "train.activation_checkpointing = {} (forecast {})",
                c.name(),
                fmt_bytes(r.b.total)
            ));
        }
    }
    let a = &p.advice;
    if let (Some(m), Some(acc)) = (a.micro_batch, a.grad_accum) {
        if m != p.micro_batch {
            out.push(format!(
                "train.micro_batch = {m} with train.grad_accum = {acc} (same rows per step)"
            ));
        }
    }
    if p.gpus > 1 && st != Strategy::Fsdp {
        if let Some(r) = row(p, Strategy::Fsdp, Checkpointing::Full) {
            out.push(format!(
                "parallel.strategy = \"fsdp\" with checkpointing (forecast {} per rank)",
                fmt_bytes(r.b.total)
            ));
        }
    }
    if out.is_empty() || p.micro_batch > 1 {
        out.push(format!(
            "a smaller train.micro_batch (now {}) with a larger train.grad_accum",
            p.micro_batch
        ));
    }
    out.push(format!(
        "a shorter data.seq_len (now {}), or a lower lora.rank / fewer lora.targets",
        p.seq_len
    ));
    out
}
