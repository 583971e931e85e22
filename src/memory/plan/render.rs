//! The plan for people (`render`: the table and the advice) and for machines (`to_json`).

use super::{row, strategy_name, Breakdown, Plan, Row, GIB, MB_LIMIT, SEQ_LIMIT, SEQ_STEP};
use crate::recipe::{Checkpointing, Strategy};

/// e.g. "fsdp ×2 + ckpt".
pub(crate) fn label(b: &Breakdown) -> String {
    let mut s = strategy_name(b.strategy).to_string();
    if b.strategy != Strategy::Single {
        s.push_str(&format!(" ×{}", b.world));
    }
    match b.ckpt {
        Checkpointing::Full => s.push_str(" + ckpt"),
        Checkpointing::Mlp => s.push_str(" + ckpt mlp"),
        Checkpointing::Off => {}
    }
    s
}

pub(crate) use crate::util::fmt_bytes;

/// The table for people; `selected` (the run's own strategy and checkpointing) is marked and
/// answered first: whether it fits as written, and at which micro-batch. Then the legend, the
/// notes on the strategies and the host, and the advice.
pub fn render(p: &Plan, selected: (Strategy, Checkpointing)) -> String {
    let mut out = header(p);
    let mut table: Vec<Vec<String>> = vec![HEAD.iter().map(|s| s.to_string()).collect()];
    table.extend(
        p.rows
            .iter()
            .map(|r| cells(r, (r.b.strategy, r.b.ckpt) == selected)),
    );
    out.push_str(&aligned(&table));
    let mine = row(p, selected.0, selected.1);
    let fits = mine.is_some_and(|r| r.fits == Some(true));
    if let Some(r) = mine {
        let (head, verdict) = match fits {
            true => ("fits as written", verdict(r, p).replacen("fits: ", "", 1)),
            false => ("as written", verdict(r, p)),
        };
        out.push_str(&format!("{head} ({}, marked *): {verdict}\n", label(&r.b)));
    }
    out.push_str(&legend(p));
    out.push_str(&notes(p));
    if let Some(h) = host_line(p) {
        out.push_str(&h);
    }
    // Where the recipe fits, a recommended setting is an alternative, not a correction.
    let same = (p.advice.strategy, p.advice.ckpt) == (Some(selected.0), Some(selected.1));
    for (i, l) in p.advice.lines.iter().enumerate() {
        let use_line = i == 0 && p.advice.micro_batch == Some(p.micro_batch);
        match (fits && use_line, l.strip_prefix("use ")) {
            (true, Some(_)) if same => {}
            (true, Some(rest)) => out.push_str(&format!("advice: this also fits: {rest}\n")),
            _ => out.push_str(&format!("advice: {l}\n")),
        }
    }
    out
}

/// The table's column heads.
const HEAD: [&str; 13] = [
    "strategy",
    "base",
    "lora+grad+adamw",
    "activations",
    "transient",
    "fsdp gather",
    "ctx+slack",
    "total",
    "peak in",
    "fits",
    "max mb",
    "max seq",
    "",
];

/// The plan's first lines: the shape per rank, and the capacity.
fn header(p: &Plan) -> String {
    let mut out = format!(
        "memory plan per rank: micro-batch {} × seq {} ({} tokens), grad_accum {}, base {} params at {} B, LoRA {} params, kept activations {} B/token/layer\n",
        p.micro_batch,
        p.seq_len,
        p.micro_batch * p.seq_len,
        p.grad_accum,
        p.base_params,
        p.dtype_bytes,
        p.lora_params,
        p.kept_bytes_per_token_layer
    );
    match p.capacity {
        Some(c) => out.push_str(&format!("capacity per rank: {}\n", fmt_bytes(c))),
        None => out.push_str("capacity per rank: unknown (pass --gpu-mem): no fit column\n"),
    }
    out
}

/// A row's cells under `HEAD`; `mine` marks the run's own row.
fn cells(r: &Row, mine: bool) -> Vec<String> {
    let b = &r.b;
    vec![
        label(b),
        fmt_bytes(b.base),
        fmt_bytes(b.lora_state()),
        fmt_bytes(b.activations),
        fmt_bytes(b.transient),
        fmt_bytes(b.gather),
        fmt_bytes(b.outside_pool()),
        fmt_bytes(b.total),
        b.peak_phase.to_string(),
        match r.fits {
            Some(true) => "yes".into(),
            Some(false) => "NO".into(),
            None => "-".into(),
        },
        match (r.fits, r.max_micro_batch) {
            (None, _) => "-".into(),
            (_, None) => "none".into(),
            (_, Some(m)) if m >= MB_LIMIT => format!("≥{m}"),
            (_, Some(m)) => m.to_string(),
        },
        match (r.fits, r.max_seq_len) {
            (None, _) => "-".into(),
            (_, None) => "none".into(),
            (_, Some(t)) if t >= SEQ_LIMIT => format!("≥{t}"),
            (_, Some(t)) => t.to_string(),
        },
        match mine {
            true => "*".into(),
            false => String::new(),
        },
    ]
}

/// The table's lines: each column as wide as its widest cell, the first left-aligned and the
/// others right-aligned, two spaces between, no trailing blanks.
fn aligned(table: &[Vec<String>]) -> String {
    let widths: Vec<usize> = (0..HEAD.len())
        .map(|k| {
            table
                .iter()
                .map(|r| r[k].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in table {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(k, (c, w))| {
                let pad = " ".repeat(w - c.chars().count());
                if k == 0 {
                    format!("{c}{pad}")
                } else {
                    format!("{pad}{c}")
                }
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// What ddp and fsdp hold (or how to plan them), NF4's storage, and the context and slack.
fn notes(p: &Plan) -> String {
    let mut out = String::new();
    if p.gpus > 1 {
        out.push_str("ddp: every rank holds a full replica of the base (as single) plus one layer's f32 gradient bucket\n");
        out.push_str(&format!(
            "fsdp: every rank holds 1/{} of the base plus the gathered weights of the current and the next layer (and embedding + head for the head), with or without checkpointing\n",
            p.gpus
        ));
    } else {
        out.push_str("ddp / fsdp: pass --gpus N (N ≥ 2) to plan them\n");
    }
    if p.nf4 {
        out.push_str("nf4: the decoder linears (and a MoE's experts) at 0.5 B a weight plus their absmax (bitsandbytes' NF4); gather: single / ddp, the current and the next layer dequantized (a MoE's experts a tile of ~256 MiB at a time); fsdp, the current and the next layer gathered in NF4 and the current one dequantized\n");
    }
    out.push_str("ctx+slack: CUDA context 512 MiB + what the pool reserves beyond its peak (14%, NF4 23%); \"peak in\" names the phase with the pool's high-water mark\n");
    out
}

/// The line on the pinned host memory the rows park, by checkpointing (the most over the
/// strategies); None where no row parks any.
fn host_line(p: &Plan) -> Option<String> {
    let host = |c: Checkpointing, what: &str| {
        let h = p.rows.iter().filter(|r| r.b.ckpt == c).map(|r| r.b.host);
        h.max()
            .filter(|&h| h > 0)
            .map(|h| format!("{} {what}", fmt_bytes(h)))
    };
    let parked: Vec<String> = [
        host(
            Checkpointing::Off,
            "without checkpointing (each layer's residual)",
        ),
        host(
            Checkpointing::Mlp,
            "with ckpt mlp (each layer's gate and up)",
        ),
        host(Checkpointing::Full, "with ckpt (each layer's input)"),
    ]
    .into_iter()
    .flatten()
    .collect();
    let free = match p.host {
        Some(h) => format!(
            "; the host has {} free, of which three quarters may be pinned by its {} ranks \
             (LORA_TRAIN_HOST_MEMORY or --host-mem to plan for another host)",
            fmt_bytes(h),
            p.gpus
        ),
        None => String::new(),
    };
    (!parked.is_empty()).then(|| {
        format!(
            "host: pinned per rank, parked until the layer's backward (train.offload_activations): {}{free}\n",
            parked.join("; ")
        )
    })
}

/// Whether a row fits the capacity, and at which micro-batch it would.
fn verdict(r: &Row, p: &Plan) -> String {
    let b = &r.b;
    let need = fmt_bytes(b.total);
    match (r.fits, p.capacity, r.max_micro_batch) {
        (Some(false), Some(c), _) if b.total <= c => format!(
            "does NOT fit the host: {need} of {} per rank, but {} of pinned host memory per rank \
             ({} ranks) is more than three quarters of the host's {} (train.offload_activations = \
             false recomputes instead)",
            fmt_bytes(c),
            fmt_bytes(b.host),
            p.gpus,
            fmt_bytes(p.host.unwrap_or(0))
        ),
        (None, _, _) => format!("needs {need} per rank (no capacity known: pass --gpu-mem)"),
        (Some(true), Some(c), m) => format!(
            "fits: {need} of {} per rank at micro-batch {}{}",
            fmt_bytes(c),
            b.micro_batch,
            match m {
                Some(m) if m > b.micro_batch => format!(" (up to micro-batch {m})"),
                _ => String::new(),
            }
        ),
        (Some(false), Some(c), Some(m)) => format!(
            "does NOT fit: {need} of {} per rank at micro-batch {}; micro-batch {m} fits (raise train.grad_accum to keep the batch)",
            fmt_bytes(c),
            b.micro_batch
        ),
        (Some(false), Some(c), None) => format!(
            "does NOT fit: {need} of {} per rank, not even at micro-batch 1",
            fmt_bytes(c)
        ),
        (Some(_), None, _) => format!("needs {need} per rank"),
    }
}

/// What each column means.
fn legend(p: &Plan) -> String {
    let mut s = String::from(
        "* marks the run's own row (its parallel.strategy and train.activation_checkpointing)\n\
         base: the frozen weights; lora+grad+adamw: the adapters, their gradients and AdamW's m and v (f32); \
         activations: what forward keeps for the backward; transient: the peak phase's workspace; \
         fsdp gather: the gathered layers; total: what must fit per rank; fits: total ≤ capacity; \
         max mb: the largest micro-batch that fits at this seq_len",
    );
    s.push_str(&format!(
        " (≥{MB_LIMIT}: at least the search limit); max seq: the longest seq_len (a multiple of {SEQ_STEP}) that fits at micro-batch 1\n"
    ));
    if p.capacity.is_none() {
        s.push_str("(no capacity: fits and max mb need --gpu-mem or train.max_memory)\n");
    }
    s
}

fn gib(x: u64) -> f64 {
    (x as f64 / GIB as f64 * 1e4).round() / 1e4
}

fn row_json(r: &Row) -> serde_json::Value {
    let b = &r.b;
    let phases: serde_json::Map<String, serde_json::Value> = b
        .phases
        .iter()
        .map(|(k, v)| (format!("{k}_peak_gib"), gib(*v).into()))
        .collect();
    serde_json::json!({
        "strategy": strategy_name(b.strategy), "ckpt": b.ckpt, "world": b.world,
        "micro_batch": b.micro_batch,
        "base_bytes": b.base, "adapters_bytes": b.adapters, "grads_bytes": b.grads,
        "optimizer_bytes": b.optimizer, "activations_bytes": b.activations,
        "transient_bytes": b.transient, "gather_bytes": b.gather, "host_bytes": b.host,
        "context_bytes": b.context, "slack_bytes": b.slack,
        "pool_peak_bytes": b.pool_peak, "total_bytes": b.total,
        // Comparable with `lora-train bench`'s peak_alloc_gib and phases.*_peak_gib.
        "peak_alloc_gib": gib(b.pool_peak), "total_gib": gib(b.total),
        "peak_phase": b.peak_phase, "phases": phases,
        "fits": r.fits, "max_micro_batch": r.max_micro_batch, "max_seq_len": r.max_seq_len,
    })
}

/// The plan for machines; `selected` is the row of the run's own strategy and checkpointing.
pub fn to_json(p: &Plan, selected: (Strategy, Checkpointing)) -> serde_json::Value {
    serde_json::json!({
        "micro_batch": p.micro_batch, "grad_accum": p.grad_accum, "seq_len": p.seq_len,
        "gpus": p.gpus, "dtype_bytes": p.dtype_bytes, "lora_params": p.lora_params,
        "base_params": p.base_params,
        "kept_bytes_per_token_layer": p.kept_bytes_per_token_layer,
        "capacity_bytes": p.capacity, "capacity_gib": p.capacity.map(gib), "nf4": p.nf4,
        "host_available_bytes": p.host,
        "rows": p.rows.iter().map(row_json).collect::<Vec<_>>(),
        "selected": row(p, selected.0, selected.1).map(row_json),
        "advice": {
            "strategy": p.advice.strategy.map(strategy_name), "ckpt": p.advice.ckpt,
            "micro_batch": p.advice.micro_batch, "grad_accum": p.advice.grad_accum,
            "max_seq_len": p.advice.max_seq_len, "lines": p.advice.lines,
        },
    })
}
