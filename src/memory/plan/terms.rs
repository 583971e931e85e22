//! The terms of a plan, counted from the code: one rank's resident base and adapters, kept
//! activations, workspaces and what waits in host memory, per strategy and checkpointing.

use super::*;
use crate::model::{Keep, ModelConfig, PARK_PENDING, PARK_TAIL};
use crate::ops::kernels::CrossEntropy;
use crate::recipe::{Checkpointing, Strategy};

/// One strategy's per-rank bytes.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub(crate) struct Breakdown {
    pub(crate) strategy: Strategy,
    pub(crate) ckpt: Checkpointing,
    pub(crate) world: usize,
    pub(crate) micro_batch: usize,
    pub(crate) base: u64,
    /// LoRA A and B in f32 (and their bf16 copies, when the peak is inside a micro-batch).
    pub(crate) adapters: u64,
    /// Gradients (f32) and, for DDP, the all-reduce bucket.
    pub(crate) grads: u64,
    /// AdamW m and v (f32).
    pub(crate) optimizer: u64,
    /// Activations alive at the peak: kept by autograd, or checkpointed boundaries plus the
    /// recomputed layer.
    pub(crate) activations: u64,
    /// Workspace of the peak phase (backward / head / attention), FSDP gathers excluded.
    pub(crate) transient: u64,
    /// Pinned host memory (offloaded residuals).
    pub(crate) host: u64,
    /// With the MLP half checkpointed: the most pairs of parked gate and up on the device while
    /// their copies out run (`Keep::ParkMlp`); 0 where nothing is parked (the MLP
    /// half recomputed).
    pub(crate) park_pending: usize,
    /// FSDP: the gathered weights of the current and next layer; NF4: the dequantized
    /// layers (`breakdown` says which); 0 otherwise.
    pub(crate) gather: u64,
    pub(crate) context: u64,
    pub(crate) slack: u64,
    /// The pool's high-water mark: what `bench` measures as peak_alloc_gib.
    pub(crate) pool_peak: u64,
    /// pool_peak + context + slack: what must fit.
    pub(crate) total: u64,
    /// Which phase has the peak: load, forward, head, backward or optimizer.
    pub(crate) peak_phase: &'static str,
    /// The pool's peak in each phase, in order load, forward, head, backward, optimizer.
    pub(crate) phases: [(&'static str, u64); 5],
}

impl Breakdown {
    /// The LoRA state: the adapters, their gradients and AdamW's moments (the plan's
    /// "lora+grad+adamw" column).
    pub(crate) fn lora_state(&self) -> u64 {
        self.adapters + self.grads + self.optimizer
    }

    /// What the pool does not hold: the CUDA context and the slack (the "ctx+slack" column).
    pub(crate) fn outside_pool(&self) -> u64 {
        self.context + self.slack
    }

    /// The largest of the terms that a setting can shrink: "activations" (activations +
    /// transient), "optimizer" (adapters + grads + AdamW) or "base" (base + gathers).
    pub(crate) fn dominant(&self) -> &'static str {
        // At an optimizer-step peak the transient is the optimizer's own.
        let (act, opt) = if self.peak_phase == "optimizer" {
            (self.activations, self.lora_state() + self.transient)
        } else {
            (self.activations + self.transient, self.lora_state())
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
    let per_layer: usize = adapted(cfg, targets)
        .filter_map(|m| cfg.linear_shape(m))
        .map(|(i, o)| i + o)
        .sum();
    // a MoE's expert adapters: A [E·r, in] and B [out, r·E] per targeted parameter
    let experts: usize = cfg.arch.moe.map_or(0, |m| {
        let (c, i) = (cfg.hidden_size, m.inter);
        let [gate_up, down] = crate::model::EXPERT_PARAMS;
        [(gate_up, c + 2 * i), (down, i + c)]
            .iter()
            .filter(|(name, _)| targets.iter().any(|t| t == name))
            .map(|(_, w)| m.experts * w)
            .sum()
    });
    (cfg.num_layers * (per_layer + experts) * rank) as u64
}

/// DoRA's magnitudes: Σ over layers and targeted linears of out.
pub(crate) fn magnitude_params(cfg: &ModelConfig, targets: &[String]) -> u64 {
    let per_layer: usize = adapted(cfg, targets)
        .filter_map(|m| cfg.linear_shape(m))
        .map(|(_, o)| o)
        .sum();
    (cfg.num_layers * per_layer) as u64
}

/// DoRA's f32 temporaries at one linear of `n` tokens (`ops::dora`): the output and
/// dL/d(output) widened to f32 and a product of them ([n, out] each, the widest linear's),
/// and `weight_norm`'s chunks (three of `ops::dora::CHUNK` elements).
pub(super) fn dora_temps(cfg: &ModelConfig, targets: &[String], n: u64) -> u64 {
    let out = adapted(cfg, targets)
        .filter_map(|m| cfg.linear_shape(m))
        .map(|(_, o)| o as u64)
        .max()
        .unwrap_or(0);
    3 * 4 * n * out + 3 * 4 * crate::ops::dora::CHUNK as u64
}

/// The model's linears that `targets` names.
pub(super) fn adapted<'a>(
    cfg: &'a ModelConfig,
    targets: &'a [String],
) -> impl Iterator<Item = &'a str> {
    cfg.linears()
        .iter()
        .copied()
        .filter(move |m| targets.iter().any(|t| t == m))
}

/// Bytes `Layer::forward_train` keeps per token per layer (the formula in the module docs),
/// for adapters of rank `r` on `targets`; with Gemma's output norms also their inputs (2C).
pub fn kept_per_token_layer(cfg: &ModelConfig, s: u64, r: usize, targets: &[String]) -> u64 {
    let (c, i) = (cfg.hidden_size as u64, cfg.intermediate_size as u64);
    let (h, k, d) = (
        cfg.num_heads as u64,
        cfg.num_kv_heads as u64,
        cfg.head_dim as u64,
    );
    let n = adapted(cfg, targets).count() as u64;
    let out_norms = if cfg.arch.sandwich_norms { 2 * c } else { 0 };
    // gate and up; a MoE layer keeps its residual h instead (its backward recomputes the
    // experts from it: model/layer_moe.rs)
    let mlp = match cfg.arch.moe {
        Some(_) => c,
        None => 2 * i,
    };
    s * (c + 2 * h * d + 2 * k * d + mlp + r as u64 * n + out_norms) + 4 * h
}

/// Bytes a layer keeps per token when backward recomputes its MLP half
/// (`activation_checkpointing = "mlp"`, `Retain::Attention`): `kept_per_token_layer` without
/// the MLP half's (`mlp_kept_per_token`), with the residual h (C) instead. A MoE layer keeps
/// that already.
pub fn kept_attention_per_token_layer(
    cfg: &ModelConfig,
    s: u64,
    r: usize,
    targets: &[String],
) -> u64 {
    let all = kept_per_token_layer(cfg, s, r, targets);
    match cfg.arch.moe {
        Some(_) => all,
        None => all - mlp_kept_per_token(cfg, s, r, targets) + s * cfg.hidden_size as u64,
    }
}

/// Bytes per token of a dense MLP half's activations: gate and up (2I), the MLP adapters'
/// states (r each) and, with Gemma's norm on down's output, its input (C).
pub(super) fn mlp_kept_per_token(cfg: &ModelConfig, s: u64, r: usize, targets: &[String]) -> u64 {
    let (c, i) = (cfg.hidden_size as u64, cfg.intermediate_size as u64);
    let adapters = adapted(cfg, targets).filter(|m| is_mlp(m)).count() as u64;
    let mo = if cfg.arch.sandwich_norms { c } else { 0 };
    s * (2 * i + r as u64 * adapters + mo)
}

/// Whether a decoder linear belongs to the MLP half.
pub(super) fn is_mlp(module: &str) -> bool {
    matches!(
        module,
        "gate_proj" | "up_proj" | "down_proj" | "gate_up_proj"
    )
}

/// A MoE layer's MLP workspace over n tokens, (forward, backward) bytes, over its P = n·k
/// grouped rows (model/layer_moe.rs, every expert at once): forward, the gathered input and
/// the output [P, C] with gate_up [P, 2I] split into gate and up ([P, I] each), or gate, up,
/// the activation and the output (≤ 2C + 4I a row); backward, the input, dL/dy and the
/// recomputed output or dL/dx [P, C] beside the activations and their gradients (≤ 3C + 6I a
/// row); and the router's [n, E] f32 probabilities and gradients. NF4 experts run a tile at
/// a time (model/moe_tiles.rs): a tile's rows take no more than all of them, and the tiles'
/// outputs (forward) or dL/dx (backward) are joined into one more [P, C]. (0, 0) for a dense
/// model.
pub(crate) fn moe_ws(cfg: &ModelConfig, s: u64, n: u64, nf4: bool) -> (u64, u64) {
    let Some(m) = cfg.arch.moe else {
        return (0, 0);
    };
    let (c, k, i, e) = (
        cfg.hidden_size as u64,
        m.top_k as u64,
        m.inter as u64,
        m.experts as u64,
    );
    let joined = if nf4 { n * k * s * c } else { 0 };
    let fwd = n * k * s * (2 * c + 4 * i) + n * e * 4 * 2 + joined;
    let bwd = n * k * s * (3 * c + 6 * i) + n * e * 4 * 4 + joined;
    (fwd, bwd)
}

/// Bytes of the pad columns `Model::fold` adds to the base weights (`ops::fold`): per layer
/// q, k, v (or qkv) by their Σ r, gate and up (or gate_up) by theirs, down by r (after SwiGLU
/// only), each row rounded up to `ROW_ALIGN`, for each group whose linears are all adapted and
/// without a bias, at widths the kernels take.
pub(crate) fn fold_pad_bytes(cfg: &ModelConfig, s: u64, r: usize, targets: &[String]) -> u64 {
    use crate::ops::fold::pad_width;
    let all = |ms: &[&str]| ms.iter().all(|m| targets.iter().any(|t| t == m));
    let mut groups: Vec<(&[&str], bool)> = match cfg.arch.fused {
        true => vec![(&["qkv_proj"], false), (&["gate_up_proj"], false)],
        false => vec![
            (&["q_proj", "k_proj", "v_proj"], cfg.qkv_bias),
            (&["gate_proj", "up_proj"], cfg.mlp_bias),
        ],
    };
    groups.push((&["down_proj"], cfg.mlp_bias));
    let mut per_layer = 0;
    for (ms, bias) in groups {
        let shapes: Vec<(usize, usize)> = ms.iter().filter_map(|m| cfg.linear_shape(m)).collect();
        let (Some(&(in_f, _)), true) = (shapes.first(), shapes.len() == ms.len()) else {
            continue;
        };
        let outs: usize = shapes.iter().map(|(_, o)| o).sum();
        if let (true, false, Some(p)) = (all(ms), bias, pad_width(&vec![r; ms.len()], in_f)) {
            per_layer += outs * p;
        }
    }
    (cfg.num_layers * per_layer) as u64 * s
}

/// Parameters of one decoder layer (linears, biases, norms).
pub(super) fn layer_params(cfg: &ModelConfig) -> u64 {
    let all = cfg.num_params(true) as u64;
    let outside = (cfg.vocab_size * cfg.hidden_size + cfg.hidden_size) as u64;
    (all - outside) / cfg.num_layers.max(1) as u64
}

/// Bytes of the base with each decoder linear and each routed expert's gate, up and down in
/// NF4 (`nf4::bytes_for` each: `quant::ExpertsNf4` quantizes them apart) and everything else
/// (embedding, head, norms, biases, the routers) at `s` bytes an element.
pub(crate) fn nf4_base_bytes(cfg: &ModelConfig, tied: bool, s: u64, double_quant: bool) -> u64 {
    let mut shapes: Vec<(usize, usize)> = cfg
        .linears()
        .iter()
        .filter_map(|m| cfg.linear_shape(m))
        .collect();
    if let Some(m) = cfg.arch.moe {
        let one = [(cfg.hidden_size, m.inter); 3]; // gate_e, up_e, down_e
        shapes.extend((0..m.experts).flat_map(|_| one));
    }
    let dense: u64 = shapes.iter().map(|(i, o)| (i * o) as u64).sum();
    let packed: u64 = shapes
        .iter()
        .map(|(i, o)| crate::quant::nf4::bytes_for(i * o, double_quant) as u64)
        .sum();
    let l = cfg.num_layers as u64;
    let all = cfg.num_params(tied) as u64;
    (all - l * dense) * s + l * packed
}

/// Parameters of one MoE layer's routed experts (gate_up and down; 0 for a dense model).
pub(crate) fn expert_params(cfg: &ModelConfig) -> u64 {
    cfg.arch
        .moe
        .map_or(0, |m| (m.experts * 3 * m.inter * cfg.hidden_size) as u64)
}

/// Bytes of one NF4 layer as it runs (`Layer::resident_in`, model/moe_tiles.rs): (its
/// linears dequantized at `s` bytes, a MoE layer's experts not whole but one tile of them
/// (`quant::experts::tile_experts`) in the scratch the grouped GEMMs read, one layer's at a
/// time; off CUDA the tile is stacked from per-expert copies, twice its bytes).
pub(crate) fn nf4_layer_bytes(cfg: &ModelConfig, s: u64, cuda: bool) -> (u64, u64) {
    let dense = (layer_params(cfg) - expert_params(cfg)) * s;
    let tile = cfg.arch.moe.map_or(0, |m| {
        let (i, c) = (m.inter, cfg.hidden_size);
        let t = crate::quant::experts::tile_experts(m.experts, i, c, s as usize);
        (t * 3 * i * c) as u64 * s
    });
    (dense, if cuda { tile } else { 2 * tile })
}

/// Weights of the model's largest linear.
pub(super) fn largest_linear(cfg: &ModelConfig) -> u64 {
    let shapes = cfg.linears().iter().filter_map(|m| cfg.linear_shape(m));
    shapes.map(|(i, o)| (i * o) as u64).max().unwrap_or(0)
}

/// The per-rank breakdown of one strategy and checkpointing, at `micro_batch` (with the MLP
/// half checkpointed and offload on, gate and up parked with the most pairs in flight).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn breakdown(
    p: &PlanInput,
    strategy: Strategy,
    ckpt: Checkpointing,
    micro_batch: usize,
) -> Breakdown {
    breakdown_within(p, strategy, ckpt, micro_batch, None)
}

/// `breakdown` as the run sets itself up within `capacity` bytes: with the MLP half
/// checkpointed and offload on, the most pairs of parked gate and up in flight
/// (`PARK_PENDING`, fewer where those do not fit; none, the MLP half recomputed,
/// where one does not: `Breakdown::park_pending`).
pub(crate) fn breakdown_within(
    p: &PlanInput,
    strategy: Strategy,
    ckpt: Checkpointing,
    micro_batch: usize,
    capacity: Option<u64>,
) -> Breakdown {
    let most = breakdown_parking(p, strategy, ckpt, micro_batch, PARK_PENDING);
    let Some(cap) = capacity.filter(|_| most.park_pending > 0) else {
        return most;
    };
    let fewer = (1..PARK_PENDING).rev();
    std::iter::once(most)
        .chain(fewer.map(|k| breakdown_parking(p, strategy, ckpt, micro_batch, k)))
        .find(|b| b.total <= cap)
        .unwrap_or_else(|| breakdown_parking(p, strategy, ckpt, micro_batch, 0))
}

/// What every phase holds whatever the batch: the base (sharded, padded, NF4), the adapters,
/// their gradients and AdamW state; and the FSDP gathers or NF4 dequantized layers.
pub(super) struct Resident {
    world: usize,
    base: u64,
    /// LoRA parameters (DoRA's magnitudes included).
    lp: u64,
    adapters: u64,
    grad_sums: u64,
    /// DDP's all-reduce bucket.
    bucket: u64,
    optimizer: u64,
    /// In the forward and backward, and in the head.
    gather: u64,
    head_gather: u64,
    /// The adapters' bf16 copies through each micro-batch.
    casts: u64,
}

pub(super) fn resident(p: &PlanInput, strategy: Strategy) -> Resident {
    let cfg = &p.cfg;
    let s = p.dtype_bytes;
    let world = if strategy == Strategy::Single {
        1
    } else {
        p.gpus.max(1)
    };
    let l = cfg.num_layers as u64;
    let pads = match p.kernels.fold {
        true => fold_pad_bytes(cfg, s, p.rank, &p.targets),
        false => 0,
    };
    let full_base = match p.quant.is_nf4() {
        true => nf4_base_bytes(cfg, p.tied, s, p.quant.double_quant),
        false => cfg.num_params(p.tied) as u64 * s,
    };
    let base = if strategy == Strategy::Fsdp {
        (full_base + pads).div_ceil(world as u64)
    } else {
        full_base + pads
    };
    let lp = lora_params(cfg, p.rank, &p.targets)
        + if p.dora {
            magnitude_params(cfg, &p.targets)
        } else {
            0
        };
    // NF4's dequantized layers: on CUDA one kernel into reused slabs (quant::slabs);
    // elsewhere also the tensor ops' temporaries.
    let temps = if p.cuda { 0 } else { 12 * largest_linear(cfg) };
    let (dequantized, tile) = nf4_layer_bytes(cfg, s, p.cuda);
    let (gather, head_gather) = if strategy == Strategy::Fsdp {
        let io = (cfg.num_params(p.tied) as u64 - l * layer_params(cfg)) * s;
        // one layer as the shards store it (NF4: its linears packed, its norms at s)
        let stored = (full_base - io) / l.max(1) + pads / l.max(1);
        // the current and the next layer gathered; NF4: the current one dequantized after
        // its gather (train::driver), one at a time
        let dequant = match p.quant.is_nf4() {
            true => dequantized + tile + temps,
            false => 0,
        };
        (2 * stored + dequant, io)
    } else if p.quant.is_nf4() {
        (2 * dequantized + tile + temps, 0)
    } else {
        (0, 0)
    };
    Resident {
        world,
        base,
        lp,
        adapters: 4 * lp,
        grad_sums: 4 * lp,
        bucket: if world > 1 { 2 * 4 * lp / l.max(1) } else { 0 },
        optimizer: 8 * lp,
        gather,
        head_gather,
        // On CUDA with 2-byte activations the adapters' bf16 copies live through each
        // micro-batch (`Ctx::adapters`).
        casts: if p.cuda && s == 2 { 2 * lp } else { 0 },
    }
}

/// One micro-batch's activations and the copies in flight.
pub(super) struct Acts {
    /// Tokens a rank.
    n: u64,
    /// Tokens of the MLP's chunks in backward, and in a checkpointed forward.
    bwd_chunk: u64,
    chunk: u64,
    /// One [B, T, C] tensor.
    boundary: u64,
    /// Kept through the step, and the layer recomputed in backward.
    kept: u64,
    recomputed: u64,
    /// Residuals offloaded with nothing recomputed.
    offload: bool,
    /// Parked gate and up pairs on the device, and their bytes.
    park_pending: u64,
    mlp_pending: u64,
    /// The copies in flight through the backward, and the pinned host memory.
    in_flight: u64,
    host: u64,
}

pub(super) fn activations(
    p: &PlanInput,
    ckpt: Checkpointing,
    micro_batch: usize,
    park: usize,
) -> Acts {
    let cfg = &p.cfg;
    let s = p.dtype_bytes;
    let full = ckpt == Checkpointing::Full;
    let (b, t) = (micro_batch as u64, p.seq_len as u64);
    let n = b * t; // tokens per rank
    let (c, l, i) = (
        cfg.hidden_size as u64,
        cfg.num_layers as u64,
        cfg.intermediate_size as u64,
    );
    // The MLP's backward over chunks of `bwd_chunk` tokens (model/layer_mlp.rs), and a
    // checkpointed layer's forward and recompute too: its gate and up exist for one chunk.
    let bwd_chunk = match p.mlp_chunk {
        Some(k) if n > k as u64 && cfg.arch.moe.is_none() => k as u64,
        _ => n,
    };
    let chunk = if ckpt.on() { bwd_chunk } else { n };
    let layer_act = kept_per_token_layer(cfg, s, p.rank, &p.targets) * n - 2 * i * s * (n - chunk);
    // Keeping the attention half: the MLP half's gate, up and adapter states of one chunk
    // are recomputed in backward.
    let attn_act = kept_attention_per_token_layer(cfg, s, p.rank, &p.targets) * n;
    let mlp_act = match cfg.arch.moe {
        Some(_) => 0,
        None => mlp_kept_per_token(cfg, s, p.rank, &p.targets) * chunk,
    };
    // One [B, T, C] tensor.
    let boundary = n * c * s;
    // Checkpointed with offload: the inputs parked in host memory but the last layer's; on the
    // device that one, the last output and one on its way out (forward) or back.
    let parked = full && p.offload;
    // The MLP half checkpointed with offload (Keep::ParkMlp): the layers below the
    // top PARK_TAIL park gate and up in host memory and keep the rest of their MLP half's
    // activations; up to PARK_PENDING pairs wait on the device for their copies out.
    let pair = 2 * i * n * s;
    let parks_mlp =
        ckpt == Checkpointing::Mlp && p.offload && mlp_act > 0 && bwd_chunk == n && park > 0;
    let keep = Keep::ParkMlp {
        tail: PARK_TAIL,
        pending: park,
    };
    let mlp_parked = match parks_mlp {
        true => keep.mlp_parked_layers(cfg.num_layers) as u64,
        false => 0,
    };
    let park_pending = mlp_parked.min(park as u64);
    let mlp_pending = park_pending * pair;
    // each MoE layer's routing, kept from its forward to its backward, on the device
    let routes = cfg.arch.moe.map_or(0, |m| {
        l * n * crate::model::router::Grouping::bytes_per_token(m.top_k)
    });
    let kept = routes
        + match (ckpt, parked) {
            (Checkpointing::Full, true) => 3 * boundary,
            (Checkpointing::Full, false) => (l + 1) * boundary,
            (Checkpointing::Mlp, _) => l * attn_act + mlp_parked * (mlp_act - pair),
            (Checkpointing::Off, _) => l * layer_act,
        };
    // Backward's residuals: the recomputed layer's (checkpointing), or, offloaded, the
    // layer's own, back from the host, and the next one on its way back; both alive through
    // the MLP's backward, where a recomputed residual does not exist yet.
    let recomputed = match ckpt {
        Checkpointing::Full => layer_act,
        Checkpointing::Mlp => mlp_act,
        Checkpointing::Off => 0,
    };
    let offload = p.offload && ckpt == Checkpointing::Off;
    // Parked gate and up: the pairs still going out (through the top layers' backward), or
    // below them a layer's pair on its way back beside the one in use.
    let in_flight = match (ckpt, offload) {
        (Checkpointing::Full, _) => boundary,
        (_, true) => 2 * boundary,
        (Checkpointing::Mlp, _) if mlp_parked > 0 => mlp_pending.max(pair),
        (_, false) => 0,
    };
    let host = if offload || parked {
        l.saturating_sub(1) * boundary
    } else {
        mlp_parked * pair
    };
    Acts {
        n,
        bwd_chunk,
        chunk,
        boundary,
        kept,
        recomputed,
        offload,
        park_pending,
        mlp_pending,
        in_flight,
        host,
    }
}

/// The workspaces of the forward, the head and the backward beyond what `a` keeps.
pub(super) fn workspaces(p: &PlanInput, micro_batch: usize, a: &Acts) -> (u64, u64, u64) {
    let cfg = &p.cfg;
    let s = p.dtype_bytes;
    let (n, chunk, bwd_chunk) = (a.n, a.chunk, a.bwd_chunk);
    let (b, t) = (micro_batch as u64, p.seq_len as u64);
    let (c, i, v) = (
        cfg.hidden_size as u64,
        cfg.intermediate_size as u64,
        cfg.vocab_size as u64,
    );
    let scores = (b * cfg.num_heads as u64 * t * t * 2).min(ATTN_BLOCK);
    let attn_ws = if p.kernels.attention.tensor_cores() {
        0
    } else {
        3 * scores
    };
    let (moe_fwd, moe_bwd) = moe_ws(cfg, s, n, p.quant.is_nf4());
    let fwd_ws = attn_ws.max(n * s * 3 * c + chunk * s * i).max(moe_fwd);
    // Logit-sized buffers of one head chunk: the fused kernel's logits and dL/dlogits in the
    // activation dtype, or the op chain's HEAD_CHUNKS f32 ones.
    let per_logit = if p.kernels.cross_entropy == CrossEntropy::Fused {
        2.0 * s as f64
    } else {
        HEAD_CHUNKS * 4.0
    };
    let rows = crate::train::sizes::head_chunk_rows(v as usize, p.kernels.cross_entropy) as u64;
    let head_ws =
        (per_logit * (rows * v).min(n * v) as f64) as u64 + 2 * a.boundary + a.mlp_pending;
    // Chunked, the MLP's [chunk, I] gradients, and the attention's backward over all tokens:
    // dL/dy, dL/dh, dL/d(attn), dq ([N, C] each), dk and dv ([N, K·D]).
    let kd = (cfg.num_kv_heads * cfg.head_dim) as u64;
    let bwd_ws = match bwd_chunk < n {
        true => n * s * (4 * c + 2 * kd) + bwd_chunk * s * 3 * i,
        false => n * s * (2 * c + 3 * i),
    };
    let bwd_ws = (BWD_WS * bwd_ws.max(moe_bwd) as f64) as u64;
    // With checkpointing the running layer's activations exist until it ends.
    let fwd_ws = fwd_ws + if a.offload { a.boundary } else { a.mlp_pending };
    let bwd_ws = bwd_ws + a.in_flight;
    let d = match p.dora {
        true => dora_temps(cfg, &p.targets, n),
        false => 0,
    };
    (fwd_ws + d, head_ws, bwd_ws + d)
}

/// `breakdown` with up to `park` pairs of parked gate and up in flight (0: none parked).
pub(super) fn breakdown_parking(
    p: &PlanInput,
    strategy: Strategy,
    ckpt: Checkpointing,
    micro_batch: usize,
    park: usize,
) -> Breakdown {
    let r = resident(p, strategy);
    let a = activations(p, ckpt, micro_batch, park);
    let (fwd_ws, head_ws, bwd_ws) = workspaces(p, micro_batch, &a);
    let (kept, recomputed, casts, gather) = (a.kept, a.recomputed, r.casts, r.gather);
    let steady = r.base + r.adapters + r.optimizer;
    let load = r.base + r.adapters;
    let forward = steady + casts + kept + recomputed + fwd_ws + gather;
    let head = steady + casts + kept + head_ws + r.head_gather;
    let backward = steady + casts + kept + recomputed + r.grad_sums + r.bucket + bwd_ws + gather;
    // AdamW: in place on CUDA (ops::multi_tensor); elsewhere over flat groups of ≤
    // optim::GROUP elements, ~8 f32 temporaries of one group while the old state is alive.
    let optim_ws = if p.cuda {
        0
    } else {
        8 * 4 * r.lp.min(crate::train::sizes::OPTIM_GROUP as u64)
    };
    let optim = steady + r.grad_sums + optim_ws;
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
        "head" => (kept, head_ws, r.head_gather),
        "backward" => (kept + recomputed, bwd_ws, gather),
        _ => (0, 0, 0),
    };
    let grads = match peak_phase {
        "backward" => r.grad_sums + r.bucket,
        "optimizer" => r.grad_sums,
        _ => 0,
    };
    // The optimizer phase's second copy of state counts as transient.
    let transient = if peak_phase == "optimizer" {
        optim_ws
    } else {
        transient
    };
    let (context, slack) = if p.cuda {
        (CONTEXT, (slack_for(&p.quant) * pool_peak as f64) as u64)
    } else {
        (0, 0)
    };
    let adapters = match peak_phase {
        "forward" | "head" | "backward" => r.adapters + casts,
        _ => r.adapters,
    };
    Breakdown {
        strategy,
        ckpt,
        world: r.world,
        micro_batch,
        base: r.base,
        adapters,
        grads,
        optimizer: r.optimizer,
        activations,
        transient,
        host: a.host,
        park_pending: a.park_pending as usize,
        gather: gather_at_peak,
        context,
        slack,
        pool_peak,
        total: pool_peak + context + slack,
        peak_phase,
        phases,
    }
}
