//! The sizes of the buffers the training step allocates besides its activations, defined once
//! here: the driver and the optimiser allocate by them and the memory plan counts them
//! (llm.c's `fill_in_activation_sizes`: one function sizes both the allocation and its count).

use crate::ops::kernels::CrossEntropy;

/// Logits a head chunk holds on the tensor-op cross-entropy (CPU, f16), which keeps several
/// f32 copies of them alive at once.
pub(crate) const HEAD_CHUNK_LOGITS: usize = 1 << 24;

/// The fewest rows of a head chunk on the fused cross-entropy kernel: over a few hundred rows
/// the head's GEMMs run far under the matrix units' rate at a large vocabulary (dL/dh's is
/// long and thin: k = V), and the kernel's one block a row leaves SMs idle. At Gemma's 256k
/// vocabulary 1024 rows hold 1 GiB of bf16 logits and their gradient.
pub(crate) const HEAD_MIN_ROWS: usize = 1024;

/// Counted positions per lm_head + loss chunk at vocabulary `v`: 2^24 logits, and at least
/// `HEAD_MIN_ROWS` on the fused kernel.
pub(crate) fn head_chunk_rows(v: usize, kind: CrossEntropy) -> usize {
    let rows = (HEAD_CHUNK_LOGITS / v.max(1)).max(1);
    match kind {
        CrossEntropy::Fused => rows.max(HEAD_MIN_ROWS),
        CrossEntropy::Ops => rows,
    }
}

/// AdamW updates its parameters in groups of consecutive tensors of at most this many elements
/// (a larger tensor is a group alone): a few kernels per group instead of a dozen per tensor,
/// and a transient of about 8 f32 copies of one group (256 MiB), not of every parameter.
pub(crate) const OPTIM_GROUP: usize = 1 << 23;
