//! The memory plan: per-rank device bytes of a LoRA run, from config.json alone (no weights).
//!
//! Notation: L layers, C hidden, I intermediate, H heads, K kv heads, D head dim, V vocab,
//! s bytes per base element (2 bf16/f16, 4 f32), N = micro_batch × seq_len tokens per rank,
//! P trainable LoRA parameters, W world size.
//!
//! Terms (formulas of the shape; calibrated on the device: `BWD_WS`, `HEAD_CHUNKS` (see
//! BENCHMARKS.md); assumed, not measured: `CONTEXT`, `SLACK`):
//! - base: every frozen parameter × s (`ModelConfig::num_params`); FSDP: ⌈base / W⌉.
//! - adapters: P × 4 (f32), gradients P × 4 (f32 running sums), AdamW m and v P × 8; on CUDA
//!   with bf16 activations also their bf16 copies, P × 2, through each micro-batch.
//! - kept activations per token per layer: what `Layer::forward_train` (model/layer_train.rs)
//!   keeps for the hand-written backward, tensor by tensor:
//!   s · (C + 2·H·D + 2·K·D + 2·I + r·A) + 4H — the layer input (C), q after RoPE and the
//!   attention output (2·H·D), k after RoPE and v (2·K·D), gate and up (2·I), each adapter's
//!   s·(m⊙x)Aᵀ (r per adapted linear, A of them), the f32 row log-sum-exp (4H).
//!   Llama-2-7B bf16, r 16 on all 7 linears: 85,344 B/token/layer.
//! - checkpointing keeps (L + 1) layer boundaries of N·C·s (inputs + the last output), and one
//!   layer's activations while that layer runs (forward) or is recomputed (backward), with its
//!   residual h (N·C·s) until the MLP's backward is done.
//! - offload (`train.offload_activations`, on by default with CUDA; without checkpointing):
//!   each layer's residual h waits for its backward in pinned host memory, (L − 1)·N·C·s of it
//!   (`host`; the last layer's stays on the device). On the device one more N·C·s in forward
//!   (the previous layer's h, until its copy out is done) and two in backward (the layer's own
//!   through its MLP's backward, where a recomputed h does not exist yet, and the next
//!   layer's, on its way back).
//! - head (lm_head + CE in chunks of ~2^24 logits, `Model::head_loss_bwd`): on the fused CE
//!   kernel (CUDA, bf16 or f32) the logits and dL/dlogits, 2 × 2^24 × s; else HEAD_CHUNKS ×
//!   2^24 × 4 B of f32 logits / exponentials / their gradient; plus dL/dh [N, C]·s twice (the
//!   running sum and its next value).
//! - forward workspace of one layer, the larger of: its MLP's end, N·s·(3C + I) (the
//!   residual h, down_proj's input, its output and the layer output alive together), and the
//!   blockwise attention's 3 score blocks of min(128 MiB, B·H·T²·2) (scores, P, P·V) — none on
//!   the tensor-core kernels (CUDA, bf16, D 64 or 128), whose O and L are kept activations.
//! - backward workspace of one layer: BWD_WS × N·s·(2C + 3I): dL/dy and dL/dh, and the MLP's
//!   dL/da, dL/dgate and dL/dup alive together, plus the gradients P × 4.
//! - DDP and FSDP sum each layer's adapter gradients over the ranks as one flat f32 bucket
//!   as its backward ends: the bucket and its sum, 2 × (P / L) × 4.
//! - DDP: full base per rank, as single.
//! - FSDP (src/parallel/fsdp.rs: flat shards, a layer gathered before its forward and again before
//!   its backward, the next one issued a layer early): base / W plus the current and the next
//!   layer's full weights (2 × a layer's parameters × s), with or without checkpointing (what
//!   forward keeps holds no weights); the embedding, final norm and head gathered for the head.
//! - the optimizer step: on CUDA one kernel updating parameters and moments in place (the
//!   gradients only); elsewhere AdamW over flat groups of at most `optim::GROUP` = 2^23
//!   parameters: the gradients, and about 8 f32 temporaries of one group (gradient, old and
//!   decayed parameters, new m and v, √v̂ + ε, the step, the new parameters) while the old
//!   state is alive: 8 × 4 B × min(P, 2^23).
//! - CUDA context (CONTEXT bytes, outside the pool) and allocator slack (SLACK × pool peak).
//!
//! The pool peak (`pool_peak`) is what `lora-train bench` reports as `peak_alloc_gib` (the
//! pool's high-water mark); `total` adds context and slack and is what must fit the card.

use crate::lora::ALL_LINEAR;
use crate::model::ModelConfig;
use crate::ops::kernels::{CrossEntropy, Kernels};
use crate::recipe::Strategy;

pub const GIB: u64 = 1 << 30;
pub const MIB: u64 = 1 << 20;
/// CUDA context, cuBLAS handles and module images: device memory outside the pool.
pub const CONTEXT: u64 = 512 * MIB;
/// Allocator slack over the pool's used high-water mark (fragmentation, rounding).
pub const SLACK: f64 = 0.05;
/// Backward workspace of one layer, in units of N·s·(2C + 3I) (see the module docs): 1 is
/// the count of the tensors alive together in `Layer::backward`'s MLP part.
pub const BWD_WS: f64 = 1.0;
/// f32 logit-sized buffers alive at once in one head chunk of the op chain (CPU, f16): the
/// logits, x − max while its exponential is made, the exponential.
pub const HEAD_CHUNKS: f64 = 3.0;
/// Logits per head chunk (driver::forward_backward_probed).
pub const HEAD_CHUNK_LOGITS: u64 = 1 << 24;
/// Attention score block bound (ops::attention::default_block).
pub const ATTN_BLOCK: u64 = 128 * MIB;

/// What the plan is for: the shape, the batch, the adapters and the world.
#[derive(Debug, Clone)]
pub struct PlanInput {
    pub cfg: ModelConfig,
    /// lm_head is the embedding (counted once).
    pub tied: bool,
    /// Bytes per base element: 2 (bf16/f16) or 4 (f32).
    pub dtype_bytes: u64,
    pub micro_batch: usize,
    pub seq_len: usize,
    pub rank: usize,
    /// LoRA target modules (names from `ALL_LINEAR`).
    pub targets: Vec<String>,
    /// Ranks for ddp / fsdp (1: single only).
    pub gpus: usize,
    /// On CUDA: count the context and the allocator slack (0 on the CPU).
    pub cuda: bool,
    /// The run's kernels (`Kernels::resolve`, or `Kernels::forecast` without a device): on
    /// the tensor-core attention no score blocks; on the fused cross-entropy the logits in the
    /// activation dtype, no f32 copies; folded, the padded weights' extra columns join the base
    /// (under FSDP, its shards and gathered layers).
    pub kernels: Kernels,
    /// Without checkpointing, each layer's residual waits in host memory
    /// (`train.offload_activations`; `driver::Keep::Offload`).
    pub offload: bool,
}

/// One strategy's per-rank bytes.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Breakdown {
    pub strategy: Strategy,
    pub ckpt: bool,
    pub world: usize,
    pub micro_batch: usize,
    pub base: u64,
    /// LoRA A and B in f32 (and their bf16 copies, when the peak is inside a micro-batch).
    pub adapters: u64,
    /// Gradients (f32) and, for DDP, the all-reduce bucket.
    pub grads: u64,
    /// AdamW m and v (f32).
    pub optimizer: u64,
    /// Activations alive at the peak: kept by autograd, or checkpointed boundaries plus the
    /// recomputed layer.
    pub activations: u64,
    /// Workspace of the peak phase (backward / head / attention), FSDP gathers excluded.
    pub transient: u64,
    /// Pinned host memory (offloaded residuals).
    pub host: u64,
    /// FSDP: the gathered full weights of the current and next layer (0 otherwise).
    pub gather: u64,
    pub context: u64,
    pub slack: u64,
    /// The pool's high-water mark: what `bench` measures as peak_alloc_gib.
    pub pool_peak: u64,
    /// pool_peak + context + slack: what must fit.
    pub total: u64,
    /// Which phase has the peak: load, forward, head, backward or optimizer.
    pub peak_phase: &'static str,
    /// The pool's peak in each phase, in order load, forward, head, backward, optimizer.
    pub phases: [(&'static str, u64); 5],
}

impl Breakdown {
    /// The largest of the terms that a setting can shrink: "activations" (activations +
    /// transient), "optimizer" (adapters + grads + AdamW) or "base" (base + gathers).
    pub fn dominant(&self) -> &'static str {
        // At an optimizer-step peak the transient is the optimizer's own.
        let (act, opt) = if self.peak_phase == "optimizer" {
            (
                self.activations,
                self.adapters + self.grads + self.optimizer + self.transient,
            )
        } else {
            (
                self.activations + self.transient,
                self.adapters + self.grads + self.optimizer,
            )
        };
        let base = self.base + self.gather;
        if act >= opt && act >= base {
            "activations"
        } else if opt >= base {
            "optimizer"
        } else {
            "base"
        }
    }
}

/// Trainable LoRA parameters: Σ over layers and targeted linears of r · (in + out).
pub fn lora_params(cfg: &ModelConfig, rank: usize, targets: &[String]) -> u64 {
    let (c, i) = (cfg.hidden_size, cfg.intermediate_size);
    let (q, kv) = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
    );
    let per_layer: usize = ALL_LINEAR
        .iter()
        .filter(|m| targets.iter().any(|t| t == *m))
        .map(|m| match *m {
            "q_proj" => c + q,
            "k_proj" | "v_proj" => c + kv,
            "o_proj" => q + c,
            "gate_proj" | "up_proj" => c + i,
            _ => i + c, // down_proj
        })
        .sum();
    (cfg.num_layers * per_layer * rank) as u64
}

/// Bytes `Layer::forward_train` keeps per token per layer (the formula in the module docs),
/// for adapters of rank `r` on `targets`.
pub fn kept_per_token_layer(cfg: &ModelConfig, s: u64, r: usize, targets: &[String]) -> u64 {
    let (c, i) = (cfg.hidden_size as u64, cfg.intermediate_size as u64);
    let (h, k, d) = (
        cfg.num_heads as u64,
        cfg.num_kv_heads as u64,
        cfg.head_dim as u64,
    );
    let adapted = ALL_LINEAR
        .iter()
        .filter(|m| targets.iter().any(|t| t == *m))
        .count() as u64;
    s * (c + 2 * h * d + 2 * k * d + 2 * i + r as u64 * adapted) + 4 * h
}

/// Bytes of the pad columns `Model::fold` adds to the base weights (`ops::fold`): per layer
/// q, k, v by 3r, gate and up by 2r, down by r, each row rounded up to `ROW_ALIGN`, for each
/// group whose linears are all adapted and without a bias, at widths the kernels take.
pub fn fold_pad_bytes(cfg: &ModelConfig, s: u64, r: usize, targets: &[String]) -> u64 {
    use crate::ops::fold::pad_width;
    let (c, i) = (cfg.hidden_size, cfg.intermediate_size);
    let (h, k, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
    let all = |ms: &[&str]| ms.iter().all(|m| targets.iter().any(|t| t == m));
    let mut per_layer = 0;
    let groups = [
        (
            &["q_proj", "k_proj", "v_proj"][..],
            cfg.qkv_bias,
            c,
            h * d + 2 * k * d,
        ),
        (&["gate_proj", "up_proj"][..], cfg.mlp_bias, c, 2 * i),
        (&["down_proj"][..], cfg.mlp_bias, i, c),
    ];
    for (ms, bias, in_f, outs) in groups {
        if let (true, false, Some(p)) = (all(ms), bias, pad_width(&vec![r; ms.len()], in_f)) {
            per_layer += outs * p;
        }
    }
    (cfg.num_layers * per_layer) as u64 * s
}

/// Parameters of one decoder layer (linears, biases, two norms).
fn layer_params(cfg: &ModelConfig) -> u64 {
    let all = cfg.num_params(true) as u64;
    let outside = (cfg.vocab_size * cfg.hidden_size + cfg.hidden_size) as u64;
    (all - outside) / cfg.num_layers.max(1) as u64
}

/// The per-rank breakdown of one strategy, with or without checkpointing, at `micro_batch`.
pub fn breakdown(p: &PlanInput, strategy: Strategy, ckpt: bool, micro_batch: usize) -> Breakdown {
    let cfg = &p.cfg;
    let s = p.dtype_bytes;
    let world = if strategy == Strategy::Single {
        1
    } else {
        p.gpus.max(1)
    };
    let (b, t) = (micro_batch as u64, p.seq_len as u64);
    let n = b * t; // tokens per rank
    let (c, l, v) = (
        cfg.hidden_size as u64,
        cfg.num_layers as u64,
        cfg.vocab_size as u64,
    );
    let pads = match p.kernels.fold {
        true => fold_pad_bytes(cfg, s, p.rank, &p.targets),
        false => 0,
    };
    let full_base = cfg.num_params(p.tied) as u64 * s;
    let base = if strategy == Strategy::Fsdp {
        (full_base + pads).div_ceil(world as u64)
    } else {
        full_base + pads
    };
    let lp = lora_params(cfg, p.rank, &p.targets);
    let adapters = 4 * lp;
    let grad_sums = 4 * lp;
    let bucket = if world > 1 { 2 * 4 * lp / l.max(1) } else { 0 };
    let optimizer = 8 * lp;
    let (gather, head_gather) = if strategy == Strategy::Fsdp {
        let layers = 2;
        let io = (cfg.num_params(p.tied) as u64 - l * layer_params(cfg)) * s;
        (layers * (layer_params(cfg) * s + pads / l.max(1)), io)
    } else {
        (0, 0)
    };
    let layer_act = kept_per_token_layer(cfg, s, p.rank, &p.targets) * n;
    let boundary = n * c * s; // one [B, T, C] tensor
    let kept = if ckpt {
        (l + 1) * boundary
    } else {
        l * layer_act
    };
    let steady = base + adapters + optimizer;
    let scores = (b * cfg.num_heads as u64 * t * t * 2).min(ATTN_BLOCK);
    let attn_ws = if p.kernels.attention.tensor_cores() {
        0
    } else {
        3 * scores
    };
    let fwd_ws = attn_ws.max(n * s * (3 * c + cfg.intermediate_size as u64));
    // Logit-sized buffers of one head chunk: the fused kernel's logits and dL/dlogits in the
    // activation dtype, or the op chain's HEAD_CHUNKS f32 ones.
    let per_logit = if p.kernels.cross_entropy == CrossEntropy::Fused {
        2.0 * s as f64
    } else {
        HEAD_CHUNKS * 4.0
    };
    let head_ws = (per_logit * HEAD_CHUNK_LOGITS.min(n * v) as f64) as u64 + 2 * boundary;
    let i = cfg.intermediate_size as u64;
    let bwd_ws = (BWD_WS * (n * s * (2 * c + 3 * i)) as f64) as u64;
    // Backward's residuals: the recomputed layer's (checkpointing), or, offloaded, the
    // layer's own, back from the host, and the next one on its way back; both alive through
    // the MLP's backward, where a recomputed residual does not exist yet.
    let recomputed = if ckpt { layer_act } else { 0 };
    let offload = p.offload && !ckpt;
    let in_flight = match (ckpt, offload) {
        (true, _) => boundary,
        (false, true) => 2 * boundary,
        (false, false) => 0,
    };
    let host = if offload {
        l.saturating_sub(1) * boundary
    } else {
        0
    };
    let load = base + adapters;
    // On CUDA with 2-byte activations the adapters' bf16 copies live through each micro-batch
    // (`Ctx::adapters`).
    let casts = if p.cuda && s == 2 { 2 * lp } else { 0 };
    // With checkpointing the running layer's activations exist until it ends.
    let fwd_ws = fwd_ws + if offload { boundary } else { 0 };
    let bwd_ws = bwd_ws + in_flight;
    let forward = steady + casts + kept + recomputed + fwd_ws + gather;
    let head = steady + casts + kept + head_ws + head_gather;
    let backward = steady + casts + kept + recomputed + grad_sums + bucket + bwd_ws + gather;
    // AdamW: in place on CUDA (ops::multi_tensor); elsewhere over flat groups of ≤
    // optim::GROUP elements, ~8 f32 temporaries of one group while the old state is alive.
    let optim_ws = if p.cuda {
        0
    } else {
        8 * 4 * lp.min(crate::train::optim::GROUP as u64)
    };
    let optim = steady + grad_sums + optim_ws;
    let phases = [
        ("load", load),
        ("forward", forward),
        ("head", head),
        ("backward", backward),
        ("optimizer", optim),
    ];
    let (peak_phase, pool_peak) =
        phases
            .iter()
            .copied()
            .fold(("load", 0), |m, x| if x.1 > m.1 { x } else { m });
    let (activations, transient, gather_at_peak) = match peak_phase {
        "forward" => (kept + recomputed, fwd_ws, gather),
        "head" => (kept, head_ws, head_gather),
        "backward" => (kept + recomputed, bwd_ws, gather),
        _ => (0, 0, 0),
    };
    let grads = match peak_phase {
        "backward" => grad_sums + bucket,
        "optimizer" => grad_sums,
        _ => 0,
    };
    // The optimizer phase's second copy of state counts as transient.
    let transient = if peak_phase == "optimizer" {
        optim_ws
    } else {
        transient
    };
    let (context, slack) = if p.cuda {
        (CONTEXT, (SLACK * pool_peak as f64) as u64)
    } else {
        (0, 0)
    };
    let adapters = match peak_phase {
        "forward" | "head" | "backward" => adapters + casts,
        _ => adapters,
    };
    Breakdown {
        strategy,
        ckpt,
        world,
        micro_batch,
        base,
        adapters,
        grads,
        optimizer,
        activations,
        transient,
        host,
        gather: gather_at_peak,
        context,
        slack,
        pool_peak,
        total: pool_peak + context + slack,
        peak_phase,
        phases,
    }
}

/// The strategies a plan covers: single, and ddp and fsdp when there are several GPUs.
pub fn strategies(gpus: usize) -> Vec<Strategy> {
    if gpus > 1 {
        vec![Strategy::Single, Strategy::Ddp, Strategy::Fsdp]
    } else {
        vec![Strategy::Single]
    }
}

/// The largest micro-batch (up to `limit`) whose total fits `capacity`; None if 1 does not.
pub fn max_micro_batch(
    p: &PlanInput,
    strategy: Strategy,
    ckpt: bool,
    capacity: u64,
    limit: usize,
) -> Option<usize> {
    let fits = |mb: usize| breakdown(p, strategy, ckpt, mb).total <= capacity;
    if !fits(1) {
        return None;
    }
    // Totals grow with the micro-batch: double, then bisect.
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
pub struct Row {
    #[serde(flatten)]
    pub b: Breakdown,
    pub fits: Option<bool>,
    /// The largest micro-batch that fits (None: no capacity, or not even 1).
    pub max_micro_batch: Option<usize>,
}

/// What to do, in the order the checks run.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Advice {
    pub strategy: Option<Strategy>,
    pub ckpt: Option<bool>,
    pub micro_batch: Option<usize>,
    pub grad_accum: Option<usize>,
    pub lines: Vec<String>,
}

/// The whole plan: rows for every strategy × checkpointing, and advice.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Plan {
    pub micro_batch: usize,
    pub grad_accum: usize,
    pub seq_len: usize,
    pub gpus: usize,
    pub dtype_bytes: u64,
    pub lora_params: u64,
    pub base_params: u64,
    pub kept_bytes_per_token_layer: u64,
    pub capacity: Option<u64>,
    pub rows: Vec<Row>,
    pub advice: Advice,
}

/// Largest micro-batch searched.
pub const MB_LIMIT: usize = 4096;

pub fn plan(p: &PlanInput, grad_accum: usize, capacity: Option<u64>) -> Plan {
    let mut rows = Vec::new();
    for st in strategies(p.gpus) {
        for ckpt in [false, true] {
            let b = breakdown(p, st, ckpt, p.micro_batch);
            rows.push(Row {
                fits: capacity.map(|c| b.total <= c),
                max_micro_batch: capacity.and_then(|c| max_micro_batch(p, st, ckpt, c, MB_LIMIT)),
                b,
            });
        }
    }
    let advice = advise(&rows, p.micro_batch, grad_accum, capacity);
    Plan {
        micro_batch: p.micro_batch,
        grad_accum,
        seq_len: p.seq_len,
        gpus: p.gpus,
        dtype_bytes: p.dtype_bytes,
        lora_params: lora_params(&p.cfg, p.rank, &p.targets),
        base_params: p.cfg.num_params(p.tied) as u64,
        kept_bytes_per_token_layer: kept_per_token_layer(&p.cfg, p.dtype_bytes, p.rank, &p.targets),
        capacity,
        rows,
        advice,
    }
}

pub fn strategy_name(s: Strategy) -> &'static str {
    match s {
        Strategy::Single => "single",
        Strategy::Ddp => "ddp",
        Strategy::Fsdp => "fsdp",
    }
}

/// The recommendation: fits single → single (checkpointing only if needed); fits only
/// sharded → fsdp; nothing fits at this micro-batch → the largest micro-batch that fits with
/// more accumulation (same global batch), when activations dominate; lower LoRA rank /
/// fewer targets when the optimiser dominates; more GPUs when the base does.
pub fn advise(
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
        lines: Vec::new(),
    };
    let find = |st: Strategy, ck: bool| rows.iter().find(|r| r.b.strategy == st && r.b.ckpt == ck);
    let Some(cap) = capacity else {
        // No capacity: say only what dominates.
        if let Some(r) = find(Strategy::Single, false) {
            a.lines.push(format!(
                "no capacity given (--gpu-mem): single without checkpointing needs {}; {} dominate",
                fmt_bytes(r.b.total),
                r.b.dominant()
            ));
        }
        return a;
    };
    let order = [
        (Strategy::Single, false),
        (Strategy::Single, true),
        (Strategy::Fsdp, false),
        (Strategy::Fsdp, true),
    ];
    if let Some(r) = order
        .iter()
        .filter_map(|&(st, ck)| find(st, ck))
        .find(|r| r.b.total <= cap)
    {
        a.strategy = Some(r.b.strategy);
        a.ckpt = Some(r.b.ckpt);
        a.micro_batch = Some(micro_batch);
        a.grad_accum = Some(grad_accum);
        let st = strategy_name(r.b.strategy);
        a.lines.push(format!(
            "use {st}{}: {} of {} per rank",
            if r.b.ckpt {
                " with activation checkpointing"
            } else {
                ""
            },
            fmt_bytes(r.b.total),
            fmt_bytes(cap)
        ));
        if r.b.strategy == Strategy::Fsdp {
            if let Some(d) = find(Strategy::Ddp, r.b.ckpt) {
                a.lines.push(format!(
                    "ddp does not fit ({}): each rank holds a full replica of the base, as single does",
                    fmt_bytes(d.b.total)
                ));
            }
        }
        return a;
    }
    // Nothing fits at this micro-batch: the best setting at a smaller one.
    let best = order
        .iter()
        .rev()
        .filter_map(|&(st, ck)| find(st, ck))
        .next();
    let Some(best) = best else { return a };
    a.lines.push(format!(
        "nothing fits {} per rank at micro-batch {micro_batch}; {} (needs {}) is the smallest",
        fmt_bytes(cap),
        label(&best.b),
        fmt_bytes(best.b.total)
    ));
    match best.b.dominant() {
        "activations" => {
            let fit = order
                .iter()
                .filter_map(|&(st, ck)| find(st, ck))
                .filter_map(|r| r.max_micro_batch.map(|m| (r, m)))
                .next();
            match fit {
                Some((r, m)) => {
                    // Keep the global batch: micro × accum, rounded up.
                    let accum = (micro_batch * grad_accum).div_ceil(m);
                    a.strategy = Some(r.b.strategy);
                    a.ckpt = Some(r.b.ckpt);
                    a.micro_batch = Some(m);
                    a.grad_accum = Some(accum);
                    a.lines.push(format!(
                        "activations dominate: use {} at train.micro_batch = {m} with train.grad_accum = {accum} (the same {} rows per step)",
                        label(&r.b),
                        micro_batch * grad_accum
                    ));
                }
                None => a.lines.push(
                    "activations dominate and even micro-batch 1 does not fit: shorten data.seq_len"
                        .into(),
                ),
            }
            if !best.b.ckpt {
                a.lines
                    .push("turn on train.activation_checkpointing = true".into());
            }
        }
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

/// e.g. "fsdp ×2 + ckpt".
pub fn label(b: &Breakdown) -> String {
    let mut s = strategy_name(b.strategy).to_string();
    if b.strategy != Strategy::Single {
        s.push_str(&format!(" ×{}", b.world));
    }
    if b.ckpt {
        s.push_str(" + ckpt");
    }
    s
}

/// Bytes for people: B, KiB, MiB or GiB with two decimals.
pub fn fmt_bytes(x: u64) -> String {
    let f = x as f64;
    if x >= GIB {
        format!("{:.2} GiB", f / GIB as f64)
    } else if x >= MIB {
        format!("{:.2} MiB", f / MIB as f64)
    } else if x >= 1024 {
        format!("{:.2} KiB", f / 1024.0)
    } else {
        format!("{x} B")
    }
}

/// The human table and the advice.
pub fn render(p: &Plan) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "memory plan per rank: micro-batch {} × seq {} ({} tokens), grad_accum {}, base {} params at {} B, LoRA {} params, kept activations {} B/token/layer\n",
        p.micro_batch,
        p.seq_len,
        p.micro_batch * p.seq_len,
        p.grad_accum,
        p.base_params,
        p.dtype_bytes,
        p.lora_params,
        p.kept_bytes_per_token_layer
    ));
    match p.capacity {
        Some(c) => out.push_str(&format!("capacity per rank: {}\n", fmt_bytes(c))),
        None => out.push_str("capacity per rank: unknown (pass --gpu-mem): no fit column\n"),
    }
    let head = [
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
    ];
    let mut table: Vec<Vec<String>> = vec![head.iter().map(|s| s.to_string()).collect()];
    for r in &p.rows {
        let b = &r.b;
        table.push(vec![
            label(b),
            fmt_bytes(b.base),
            fmt_bytes(b.adapters + b.grads + b.optimizer),
            fmt_bytes(b.activations),
            fmt_bytes(b.transient),
            fmt_bytes(b.gather),
            fmt_bytes(b.context + b.slack),
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
        ]);
    }
    let widths: Vec<usize> = (0..head.len())
        .map(|k| {
            table
                .iter()
                .map(|r| r[k].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in &table {
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
    if p.gpus > 1 {
        out.push_str("ddp: every rank holds a full replica of the base (as single) plus one layer's f32 gradient bucket\n");
        out.push_str(&format!(
            "fsdp: every rank holds 1/{} of the base plus the gathered weights of the current and the next layer (and embedding + head for the head), with or without checkpointing\n",
            p.gpus
        ));
    } else {
        out.push_str("ddp / fsdp: pass --gpus N (N ≥ 2) to plan them\n");
    }
    out.push_str("ctx+slack: CUDA context 512 MiB + 5% allocator slack; \"peak in\" names the phase with the pool's high-water mark\n");
    if let Some(h) = p.rows.iter().map(|r| r.b.host).max().filter(|&h| h > 0) {
        out.push_str(&format!(
            "host: {} pinned per rank without checkpointing (the layers' residuals, parked until their backward: train.offload_activations)\n",
            fmt_bytes(h)
        ));
    }
    for l in &p.advice.lines {
        out.push_str(&format!("advice: {l}\n"));
    }
    out
}

/// The plan of a `bench` shape (bf16 on CUDA): `lora-train plan --shape`.
pub fn input_from_shape(
    shape: &str,
    seq_len: usize,
    micro_batch: usize,
    rank: usize,
    targets: Vec<String>,
    gpus: usize,
) -> anyhow::Result<PlanInput> {
    let cfg = crate::bench::shape(shape)?;
    Ok(PlanInput {
        tied: cfg.tie_word_embeddings.unwrap_or(false),
        kernels: Kernels::forecast(true, candle_core::DType::BF16, cfg.head_dim),
        cfg,
        dtype_bytes: 2,
        micro_batch,
        seq_len,
        rank,
        targets,
        gpus: gpus.max(1),
        cuda: true,
        offload: true,
    })
}

/// The plan's input for a recipe, given its config.json (`hub::config_file`): the recipe's
/// micro-batch, seq_len, LoRA rank and targets, and base dtype (model.dtype, else bf16 on
/// CUDA and f32 on the CPU). A config that does not say whether the head is tied counts it
/// untied (the larger).
pub fn input_from_recipe(
    r: &crate::recipe::Recipe,
    cfg: ModelConfig,
    gpus: usize,
    cuda: bool,
) -> Result<PlanInput, crate::recipe::RecipeError> {
    use crate::recipe::{DeviceKind, Dtype};
    let dtype_bytes = match (r.model.dtype, r.model.device) {
        (Some(Dtype::F32), _) | (None, DeviceKind::Cpu) => 4,
        _ => 2,
    };
    let dtype = match (r.model.dtype, r.model.device) {
        (Some(Dtype::F32), _) | (None, DeviceKind::Cpu) => candle_core::DType::F32,
        (Some(Dtype::F16), _) => candle_core::DType::F16,
        _ => candle_core::DType::BF16,
    };
    let kernels = Kernels::forecast(cuda, dtype, cfg.head_dim);
    Ok(PlanInput {
        tied: cfg.tie_word_embeddings.unwrap_or(false),
        cfg,
        dtype_bytes,
        micro_batch: r.train.micro_batch,
        seq_len: r.data.seq_len,
        rank: r.lora.rank,
        targets: r.target_modules()?,
        gpus: gpus.max(1),
        cuda,
        kernels,
        offload: cuda && r.train.offload_activations.unwrap_or(true),
    })
}

fn gib(x: u64) -> f64 {
    (x as f64 / GIB as f64 * 1e4).round() / 1e4
}

/// The row of a strategy and checkpointing setting.
pub fn row(p: &Plan, strategy: Strategy, ckpt: bool) -> Option<&Row> {
    p.rows
        .iter()
        .find(|r| r.b.strategy == strategy && r.b.ckpt == ckpt)
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
        "fits": r.fits, "max_micro_batch": r.max_micro_batch,
    })
}

/// The plan for machines; `selected` is the row of the run's own strategy and checkpointing.
pub fn to_json(p: &Plan, selected: (Strategy, bool)) -> serde_json::Value {
    serde_json::json!({
        "micro_batch": p.micro_batch, "grad_accum": p.grad_accum, "seq_len": p.seq_len,
        "gpus": p.gpus, "dtype_bytes": p.dtype_bytes, "lora_params": p.lora_params,
        "base_params": p.base_params,
        "kept_bytes_per_token_layer": p.kept_bytes_per_token_layer,
        "capacity_bytes": p.capacity, "capacity_gib": p.capacity.map(gib),
        "rows": p.rows.iter().map(row_json).collect::<Vec<_>>(),
        "selected": row(p, selected.0, selected.1).map(row_json),
        "advice": {
            "strategy": p.advice.strategy.map(strategy_name), "ckpt": p.advice.ckpt,
            "micro_batch": p.advice.micro_batch, "grad_accum": p.advice.grad_accum,
            "lines": p.advice.lines,
        },
    })
}

/// What to change when the run's row (`selected`) does not fit: concrete settings, each with
/// its forecast.
pub fn remedies(p: &Plan, selected: (Strategy, bool)) -> Vec<String> {
    let mut out = Vec::new();
    let (st, ck) = selected;
    if !ck {
        if let Some(r) = row(p, st, true) {
            out.push(format!(
                "train.activation_checkpointing = true (forecast {})",
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
        if let Some(r) = row(p, Strategy::Fsdp, true) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn llama2_7b() -> ModelConfig {
        crate::bench::shape("llama2-7b").unwrap()
    }

    fn input(mb: usize, gpus: usize) -> PlanInput {
        PlanInput {
            cfg: llama2_7b(),
            tied: false,
            dtype_bytes: 2,
            micro_batch: mb,
            seq_len: 2048,
            rank: 16,
            targets: ALL_LINEAR.iter().map(|s| s.to_string()).collect(),
            gpus,
            cuda: true,
            kernels: Kernels::fallback(),
            offload: false,
        }
    }

    const GI: f64 = GIB as f64;

    fn all() -> Vec<String> {
        ALL_LINEAR.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn kept_activations_per_token_layer_by_hand() {
        // Llama-2-7B, bf16: C = H·D = K·D = 4096, I = 11008, H = 32, r 16 on all 7 linears.
        // 2 · (4096 + 2·4096 + 2·4096 + 2·11008 + 16·7) + 4·32
        // = 2 · (4096 + 8192 + 8192 + 22016 + 112) + 128 = 2 · 42608 + 128 = 85344.
        assert_eq!(kept_per_token_layer(&llama2_7b(), 2, 16, &all()), 85_344);
        // q, v only: 2 · (42496 + 32) + 128 = 85184.
        let qv = ["q_proj".to_string(), "v_proj".to_string()];
        assert_eq!(kept_per_token_layer(&llama2_7b(), 2, 16, &qv), 85_184);
        // Llama-3-8B: K = 8 → 2·K·D = 2048; I = 14336.
        // 2 · (4096 + 8192 + 2048 + 28672 + 112) + 128 = 2 · 43120 + 128 = 86368.
        let l3 = crate::bench::shape("llama3-8b").unwrap();
        assert_eq!(kept_per_token_layer(&l3, 2, 16, &all()), 86_368);
    }

    #[test]
    fn lora_params_and_base_by_hand() {
        let c = llama2_7b();
        // per layer, r = 16: q, k, v, o: 4 · 16 · (4096 + 4096) = 524288;
        // gate, up, down: 3 · 16 · (4096 + 11008) = 724992; sum 1249280; × 32 = 39976960.
        let all: Vec<String> = ALL_LINEAR.iter().map(|s| s.to_string()).collect();
        assert_eq!(lora_params(&c, 16, &all), 39_976_960);
        // q and v only: 2 · 16 · 8192 · 32 = 8388608.
        assert_eq!(
            lora_params(&c, 16, &["q_proj".into(), "v_proj".into()]),
            8_388_608
        );
        // Base: 2 · 32000 · 4096 + 32 · (4 · 4096² + 3 · 4096 · 11008 + 2 · 4096) + 4096
        // = 262144000 + 32 · 202383360 + 4096 = 6738415616 parameters.
        assert_eq!(c.num_params(false), 6_738_415_616);
    }

    #[test]
    fn single_mb2_no_ckpt_matches_the_measured_peak() {
        let b = breakdown(&input(2, 1), Strategy::Single, false, 2);
        // base 6738415616 · 2 = 13476831232 B (12.55 GiB); adapters 39976960 · 4 = 159907840
        // and their bf16 copies 79953920; AdamW 319815680. kept: 32 · 85344 · 4096 =
        // 11186208768 (10.42 GiB).
        assert_eq!(b.base, 13_476_831_232);
        assert_eq!(b.adapters, 159_907_840 + 79_953_920);
        assert_eq!(b.optimizer, 319_815_680);
        assert_eq!(b.peak_phase, "backward");
        assert_eq!(b.activations, 11_186_208_768);
        // backward = 13956554752 (base, adapters, AdamW) + 79953920 (bf16 copies)
        // + 11186208768 + gradients 159907840 + workspace 4096 · 2 · (2·4096 + 3·11008) =
        // 337641472 → 25720266752 B = 23.95 GiB. Measured on an H200: 23.73 GiB.
        assert_eq!(b.pool_peak, 25_720_266_752);
        assert!((b.pool_peak as f64 / GI / 23.73 - 1.0).abs() < 0.02);
        // total = pool + 512 MiB + 5%: 25720266752 + 536870912 + 1286013337 = 27543151001.
        assert_eq!(b.total, 27_543_151_001);
    }

    #[test]
    fn folded_weights_add_their_pad_columns_to_the_base_and_fsdp_shards_them() {
        // Rows rounded up to 64 (ops::fold): q, k, v 4096 + 48 → 4160, gate and up 4096 + 32
        // → 4160, down 11008 + 16 → 11072: 64 columns each, 32 · (3 · 4096 + 2 · 11008 +
        // 4096) · 64 · 2 B = 157286400 B.
        let mut p = input(2, 2);
        let pads = fold_pad_bytes(&p.cfg, 2, 16, &p.targets);
        assert_eq!(pads, 157_286_400);
        p.kernels.fold = true;
        let plain = input(2, 2);
        for s in [Strategy::Single, Strategy::Ddp] {
            let (a, b) = (breakdown(&p, s, false, 2), breakdown(&plain, s, false, 2));
            assert_eq!(a.base, b.base + pads, "{s:?}");
            assert_eq!(a.pool_peak, b.pool_peak + pads, "{s:?}");
        }
        let (a, b) = (
            breakdown(&p, Strategy::Fsdp, false, 2),
            breakdown(&plain, Strategy::Fsdp, false, 2),
        );
        // FSDP: 1/N of the pads per rank, and each of the two gathered layers carries its own.
        assert_eq!(a.base, (13_476_831_232 + pads) / 2);
        assert_eq!(b.base, 13_476_831_232 / 2);
        assert_eq!(a.gather, b.gather + 2 * pads / 32);
        // q and v alone: their group lacks k's adapter, so it does not fold (and the MLP's
        // linears are not targets).
        let qv: Vec<String> = ["q_proj", "v_proj"].iter().map(|s| s.to_string()).collect();
        assert_eq!(fold_pad_bytes(&p.cfg, 2, 16, &qv), 0);
        // Rank 64: q, k, v 4096 + 192 → 4288 (192 columns), gate and up 4096 + 128 → 4224
        // (128), down 11008 + 64 → 11072 (64).
        assert_eq!(
            fold_pad_bytes(&p.cfg, 2, 64, &p.targets),
            32 * (3 * 4096 * 192 + 2 * 11008 * 128 + 4096 * 64) * 2
        );
    }

    #[test]
    fn tensor_core_attention_has_no_score_blocks() {
        // Blockwise: the forward phase's workspace is 3 score blocks of min(128 MiB,
        // 2·32·2048²·2 B) = 402653184 B, more than the MLP's end, 4096 · 2 · (3·4096 + 11008) =
        // 190840832 B, which is all the tensor-core kernels leave. Backward, the peak here, is
        // the same either way.
        let mut p = input(2, 1);
        let blockwise = breakdown(&p, Strategy::Single, false, 2);
        p.kernels.attention = crate::ops::kernels::Attention::MmaSync;
        let flash = breakdown(&p, Strategy::Single, false, 2);
        assert_eq!(
            blockwise.phases[1].1 - flash.phases[1].1,
            402_653_184 - 190_840_832
        );
        assert_eq!(blockwise.phases[3], flash.phases[3]);
        assert_eq!(flash.pool_peak, blockwise.pool_peak);
    }

    #[test]
    fn offloaded_residuals_cost_two_on_the_device_and_the_rest_on_the_host() {
        let mut p = input(2, 1);
        let kept = breakdown(&p, Strategy::Single, false, 2);
        p.offload = true;
        let off = breakdown(&p, Strategy::Single, false, 2);
        // A residual is N·C·s = 4096 · 4096 · 2 = 33554432 B: 31 wait on the host; on the
        // device one more in forward, two more in backward (the peak), as measured on an H200
        // (forward 23.70 vs 23.67 GiB, backward 23.87 vs 23.81).
        assert_eq!((kept.host, off.host), (0, 31 * 33_554_432));
        assert_eq!(off.phases[1].1 - kept.phases[1].1, 33_554_432);
        assert_eq!(off.pool_peak - kept.pool_peak, 2 * 33_554_432);
        assert_eq!(off.peak_phase, "backward");
        // Checkpointing parks nothing.
        assert_eq!(breakdown(&p, Strategy::Single, true, 2).host, 0);
    }

    #[test]
    fn single_ckpt_matches_the_measured_peaks() {
        let b = breakdown(&input(8, 1), Strategy::Single, true, 8);
        // N = 16384; boundaries (32 + 1) · 16384 · 4096 · 2 = 4429185024;
        // the recomputed layer 85344 · 16384 = 1398276096;
        // workspace 16384 · 2 · 41216 = 1350565888, and the recomputed residual
        // 16384 · 4096 · 2 = 134217728 (kept from the recompute to the MLP's backward);
        // backward = 13956554752 + 79953920 + 4429185024 + 1398276096 + 159907840
        //          + 1350565888 + 134217728 = 21508661248 B = 20.03 GiB (measured 19.65 on an
        //          H200: 1.9% under).
        assert_eq!(b.peak_phase, "backward");
        assert_eq!(b.pool_peak, 21_508_661_248);
        assert!((b.pool_peak as f64 / GI / 19.65 - 1.0).abs() < 0.025);
        // Micro-batch 2: boundaries 33 · 4096 · 8192 = 1107296256, the layer 349569024,
        // workspace 337641472 + the residual 33554432: 13956554752 + 79953920 + 1107296256
        // + 349569024 + 159907840 + 337641472 + 33554432 = 16024477696 B = 14.92 GiB
        // (measured on an H200 without the kept residual: 14.77 GiB).
        let c = breakdown(&input(2, 1), Strategy::Single, true, 2);
        assert_eq!(c.pool_peak, 16_024_477_696);
        assert!((c.pool_peak as f64 / GI / 14.80 - 1.0).abs() < 0.025);
    }

    #[test]
    fn fsdp_shards_the_base_and_ddp_does_not() {
        let p = input(2, 2);
        let single = breakdown(&p, Strategy::Single, true, 2);
        let ddp = breakdown(&p, Strategy::Ddp, true, 2);
        let fsdp = breakdown(&p, Strategy::Fsdp, true, 2);
        assert_eq!(ddp.base, single.base);
        // The per-layer bucket and its sum: 2 · 4 B · 39976960 / 32 = 9994240.
        assert_eq!(ddp.grads, single.grads + 9_994_240);
        assert_eq!(fsdp.base, 13_476_831_232 / 2);
        // Gather with checkpointing: 2 layers × 202383360 params × 2 B = 809533440.
        assert_eq!(fsdp.gather, 809_533_440);
        assert!(fsdp.total < single.total && ddp.total > single.total);
        // Without checkpointing too: what forward keeps holds no weights, so the same two
        // gathered layers, and FSDP saves base / 2 − 2 layers = 6738415616 − 809533440 B.
        let fsdp_kept = breakdown(&p, Strategy::Fsdp, false, 2);
        assert_eq!(fsdp_kept.gather, 809_533_440);
        let single_kept = breakdown(&p, Strategy::Single, false, 2);
        assert_eq!(
            single_kept.pool_peak - fsdp_kept.pool_peak,
            6_738_415_616 - 809_533_440 - 9_994_240
        );
    }

    #[test]
    fn max_micro_batch_is_the_knee() {
        let p = input(2, 1);
        let cap = 80 * GIB;
        let m = max_micro_batch(&p, Strategy::Single, false, cap, MB_LIMIT).unwrap();
        assert!(breakdown(&p, Strategy::Single, false, m).total <= cap);
        assert!(breakdown(&p, Strategy::Single, false, m + 1).total > cap);
        // No ckpt: total ≈ (13.96 GB + 0.16 GB of gradients + mb · (5.59 GB kept + 0.17 GB
        // workspace) + 0.40 GB attention) · 1.05 + 0.54 GB: mb 11 needs 76.28 GiB, mb 12 81.92.
        assert_eq!(m, 11);
        // 12 GiB cannot hold the 12.55 GiB base at all.
        assert_eq!(
            max_micro_batch(&p, Strategy::Single, true, 12 * GIB, MB_LIMIT),
            None
        );
    }

    fn rows_at(p: &PlanInput, cap: u64) -> Vec<Row> {
        plan(p, 4, Some(cap)).rows
    }

    #[test]
    fn advice_follows_the_rules() {
        // 80 GiB: single without checkpointing fits at mb 2 (25.57 GiB).
        let p = input(2, 2);
        let a = advise(&rows_at(&p, 80 * GIB), 2, 4, Some(80 * GIB));
        assert_eq!((a.strategy, a.ckpt), (Some(Strategy::Single), Some(false)));
        // 24 GiB on 2 GPUs: single without checkpointing needs 25.57 GiB; single + ckpt
        // needs 14.82 GiB in the pool + 5% + 512 MiB = 16.06 GiB: fits.
        let a = advise(&rows_at(&p, 24 * GIB), 2, 4, Some(24 * GIB));
        assert_eq!((a.strategy, a.ckpt), (Some(Strategy::Single), Some(true)));
        // 15 GiB: single and ddp + ckpt need 16.06 / 16.07 GiB; only fsdp (6.28 GiB of base
        // per rank) fits; ddp named as a full replica.
        let a = advise(&rows_at(&p, 15 * GIB), 2, 4, Some(15 * GIB));
        assert_eq!(a.strategy, Some(Strategy::Fsdp));
        assert!(a.lines.iter().any(|l| l.contains("full replica")), "{a:?}");
        // mb 16 on 16 GiB, one GPU: nothing fits (+ ckpt: 33 boundaries 8.25 GiB, one layer
        // 2.60 GiB, workspace 2.52 GiB: activations over the 12.55 GiB base); a smaller
        // micro-batch with more accumulation, the same 64 rows per step: mb 1 + ckpt peaks in
        // forward: 13956554752 + 33 boundaries 553648128 + one layer 174784512 + 3 attention
        // blocks 402653184 = 15087640576 B · 1.05 + 512 MiB = 15.25 GiB.
        let p1 = input(16, 1);
        let a = advise(&rows_at(&p1, 16 * GIB), 16, 4, Some(16 * GIB));
        assert_eq!(a.ckpt, Some(true));
        let (mb, acc) = (a.micro_batch.unwrap(), a.grad_accum.unwrap());
        assert_eq!((mb, acc), (1, 64), "{a:?}");
        assert!(a.lines.iter().any(|l| l.contains("activations dominate")));
        // 8 GiB, one GPU: the base (12.55 GiB) dominates whatever the batch.
        let p1 = input(1, 1);
        let a = advise(&rows_at(&p1, 8 * GIB), 1, 1, Some(8 * GIB));
        assert_eq!(a.strategy, None);
        assert!(a.lines.iter().any(|l| l.contains("base weights dominate")));
    }

    #[test]
    fn optimizer_dominance_names_rank_and_targets() {
        // A tiny base with a huge rank: the AdamW state dominates.
        let mut p = input(1, 1);
        p.cfg = crate::bench::shape("tiny").unwrap();
        p.seq_len = 8;
        p.rank = 4096;
        let b = breakdown(&p, Strategy::Single, true, 1);
        assert_eq!(b.dominant(), "optimizer");
        let cap = b.total - 1;
        let a = advise(&rows_at(&p, cap), 1, 1, Some(cap));
        assert!(
            a.lines.iter().any(|l| l.contains("lower lora.rank")),
            "{a:?}"
        );
    }
}
