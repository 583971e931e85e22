//! The memory plan: per-rank device bytes of a LoRA run, from config.json alone (no weights).
//!
//! Notation: L layers, C hidden, I intermediate, H heads, K kv heads, D head dim, V vocab,
//! s bytes per base element (2 bf16/f16, 4 f32), N = micro_batch × seq_len tokens per rank,
//! P trainable LoRA parameters, W world size.
//!
//! Terms (formulas of the shape; calibrated on the device: `BWD_WS`, `HEAD_CHUNKS` (see
//! BENCHMARKS.md: also `SLACK`, `SLACK_NF4`); assumed, not measured: `CONTEXT`):
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
//!   residual h (N·C·s) until the MLP's backward is done. With offload (CUDA) the inputs but
//!   the last layer's wait in pinned host memory ((L − 1)·N·C·s of `host`): 3 boundaries on the
//!   device. Over N > `train.mlp_chunk` tokens the MLP runs in chunks of that many
//!   (model/layer_mlp.rs): its gate and up (2·I) and backward workspace (3·I) count one chunk,
//!   and the attention's backward N·s·(4C + 2·K·D) (dL/dy, dL/dh, dL/d(attn), dq, dk, dv).
//! - `activation_checkpointing = "mlp"`: each layer keeps its attention half and the residual
//!   h, s · (2·C + 2·H·D + 2·K·D + r·A_attn) + 4H (Llama-2-7B: 49,408 B/token/layer), and the
//!   layer whose MLP half runs (forward) or is recomputed (backward) holds its gate, up and MLP
//!   adapter states, s · (2·I + r·A_mlp), for one chunk. With offload (CUDA, the MLP whole,
//!   dense) the layers but the top `PARK_TAIL` keep their MLP half too, its gate and
//!   up (2·I·N·s a layer) parked in host memory (`host`): on the device its adapter states,
//!   and up to `PARK_PENDING` pairs still going out (forward, head, the top layers'
//!   backward), or a pair on its way back.
//! - offload (`train.offload_activations`, on by default with CUDA; without checkpointing):
//!   each layer's residual h waits for its backward in pinned host memory, (L − 1)·N·C·s of it
//!   (`host`; the last layer's stays on the device). On the device one more N·C·s in forward
//!   (the previous layer's h, until its copy out is done) and two in backward (the layer's own
//!   through its MLP's backward, where a recomputed h does not exist yet, and the next
//!   layer's, on its way back).
//! - head (lm_head + CE in chunks of `driver::head_chunk_rows` positions, `Model::
//!   head_loss_bwd`): on the fused CE kernel (CUDA, bf16 or f32) the logits and dL/dlogits of
//!   one chunk, 2 × rows × V × s (rows: ~2^24 logits, at least 1024); else HEAD_CHUNKS ×
//!   2^24 × 4 B of f32 logits / exponentials / their gradient; plus dL/dh [N, C]·s twice (the
//!   running sum and its next value).
//! - forward workspace of one layer, the larger of: its MLP's end, N·s·(3C + I) (the
//!   residual h, down_proj's input, its output and the layer output alive together), and the
//!   blockwise attention's 3 score blocks of min(128 MiB, B·H·T²·2) (scores, P, P·V) — none on
//!   the tensor-core kernels (CUDA, bf16, D 64, 96, 128 or 256), whose O and L
//!   are kept activations.
//! - backward workspace of one layer: BWD_WS × N·s·(2C + 3I): dL/dy and dL/dh, and the MLP's
//!   dL/da, dL/dgate and dL/dup alive together, plus the gradients P × 4.
//! - DDP and FSDP sum each layer's adapter gradients over the ranks as one flat f32 bucket
//!   as its backward ends: the bucket and its sum, 2 × (P / L) × 4.
//! - DDP: full base per rank, as single.
//! - FSDP (src/train/flat.rs: flat shards, a layer gathered before its forward and again before
//!   its backward, the next one issued a layer early): base / W plus the current and the next
//!   layer's full weights (2 × a layer's parameters × s), with or without checkpointing (what
//!   forward keeps holds no weights); the embedding, final norm and head gathered for the head.
//! - NF4 (`[model] quantize = "nf4"`, src/quant): each decoder linear at 0.5 B a weight plus
//!   its absmax (`nf4::bytes_for`), the rest of the base at s; the current and the next layer
//!   dequantized (2 × a layer's parameters × s, in the `gather` column: on CUDA two reused
//!   slabs, quant::slabs; elsewhere also the tensor ops' f32 temporaries for the largest
//!   linear, 3 × 4 B a weight).
//! - FSDP over NF4: base / W of the NF4 base; the current and the next layer gathered in NF4
//!   (2 × a layer's NF4 bytes), and the current one dequantized once gathered (1 × a layer's
//!   parameters × s, plus the temporaries off CUDA).
//! - the optimizer step: on CUDA one kernel updating parameters and moments in place (the
//!   gradients only); elsewhere AdamW over flat groups of at most `optim::GROUP` = 2^23
//!   parameters: the gradients, and about 8 f32 temporaries of one group (gradient, old and
//!   decayed parameters, new m and v, √v̂ + ε, the step, the new parameters) while the old
//!   state is alive: 8 × 4 B × min(P, 2^23).
//! - CUDA context (CONTEXT bytes, outside the pool) and allocator slack (SLACK or SLACK_NF4 ×
//!   pool peak: what the pool reserves beyond its high-water mark, measured).
//!
//! The pool peak (`pool_peak`) is what `lora-train bench` reports as `peak_alloc_gib` (the
//! pool's high-water mark); `total` adds context and slack and is what must fit the card.

mod advice;
mod inputs;
mod offline;
mod render;
mod search;
mod terms;
#[cfg(test)]
mod tests;

pub(crate) use advice::{advise, remedies, Advice};
pub use inputs::input_from_shape;
pub(crate) use inputs::{mlp_chunk_as_run, PlanInput};
pub use offline::shape_command;
pub(crate) use render::{fmt_bytes, label};
pub use render::{render, to_json};
pub use search::plan;
pub(crate) use search::{row, strategy_name, Plan, Row, MB_LIMIT, SEQ_LIMIT, SEQ_STEP};
#[cfg(test)]
pub(crate) use terms::breakdown;
use terms::{adapted, is_mlp};
pub(crate) use terms::{breakdown_within, magnitude_params, Breakdown};
pub use terms::{kept_attention_per_token_layer, kept_per_token_layer, lora_params};

pub(crate) const GIB: u64 = 1 << 30;
pub(crate) const MIB: u64 = 1 << 20;
/// CUDA context, cuBLAS handles and module images: device memory outside the pool.
pub(crate) const CONTEXT: u64 = 512 * MIB;
/// What CUDA's pool reserves beyond its used high-water mark (fragmentation, rounding), as a
/// fraction of that mark, for a bf16 / f32 base: the largest reserved / allocated ratio
/// measured at 7B (1.08-1.13, BENCHMARKS.md), rounded up.
pub(crate) const SLACK: f64 = 0.14;
/// The same for an NF4 base (1.13-1.22 measured: the load-time quantizing leaves the pool
/// holes the activations fit less well).
pub(crate) const SLACK_NF4: f64 = 0.23;

/// The allocator slack fraction for a base stored as `quant`.
pub(crate) fn slack_for(quant: &crate::quant::Quant) -> f64 {
    if quant.is_nf4() {
        SLACK_NF4
    } else {
        SLACK
    }
}
/// Backward workspace of one layer, in units of N·s·(2C + 3I) (see the module docs): 1 is
/// the count of the tensors alive together in `Layer::backward`'s MLP part.
pub(crate) const BWD_WS: f64 = 1.0;
/// f32 logit-sized buffers alive at once in one head chunk of the op chain (CPU, f16): the
/// logits, x − max while its exponential is made, the exponential.
pub(crate) const HEAD_CHUNKS: f64 = 3.0;
/// Attention score block bound (ops::attention::default_block).
pub(crate) const ATTN_BLOCK: u64 = 128 * MIB;
