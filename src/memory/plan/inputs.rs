//! What a plan is for: the shape, the batch, the adapters, the kernels and the world
//! (`PlanInput`), from a run (train::RunConfig::plan_input) or a named shape.

use super::{adapted, is_mlp};
use crate::model::ModelConfig;
use crate::ops::kernels::Kernels;

/// What the plan is for: the shape, the batch, the adapters and the world.
#[derive(Debug, Clone)]
pub struct PlanInput {
    pub(crate) cfg: ModelConfig,
    /// lm_head is the embedding (counted once).
    pub(crate) tied: bool,
    /// Bytes per base element: 2 (bf16/f16) or 4 (f32).
    pub(crate) dtype_bytes: u64,
    pub(crate) micro_batch: usize,
    pub(crate) seq_len: usize,
    pub(crate) rank: usize,
    /// LoRA target modules (names from `ALL_LINEAR`).
    pub(crate) targets: Vec<String>,
    /// DoRA (`lora.use_dora`): a magnitude [out] per adapter, and its f32 temporaries.
    pub(crate) dora: bool,
    /// Ranks for ddp / fsdp (1: single only).
    pub(crate) gpus: usize,
    /// On CUDA: count the context and the allocator slack (0 on the CPU).
    pub(crate) cuda: bool,
    /// The run's kernels (`Kernels::resolve`, or `Kernels::forecast` without a device): on
    /// the tensor-core attention no score blocks; on the fused cross-entropy the logits in the
    /// activation dtype, no f32 copies; folded, the padded weights' extra columns join the base
    /// (under FSDP, its shards and gathered layers).
    pub(crate) kernels: Kernels,
    /// Activations wait in host memory (`train.offload_activations`): without checkpointing
    /// each layer's residual (`Keep::Offload`), with the MLP half checkpointed gate
    /// and up (`Keep::ParkMlp`), with the whole layer its input.
    pub(crate) offload: bool,
    /// How the base is stored (`[model] quantize`): NF4 linears at `nf4::bytes_for` each,
    /// dequantized for the current and the next layer.
    pub(crate) quant: crate::quant::Quant,
    /// Tokens per MLP chunk of a checkpointed layer (`train.mlp_chunk`; None: whole).
    pub(crate) mlp_chunk: Option<usize>,
    /// Host memory free to this host's `gpus` ranks (`memory::host`): a row whose pinned
    /// `host` bytes, times the ranks, pass three quarters of it does not fit (`host_fits`);
    /// None: not counted.
    pub(crate) host: Option<u64>,
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
    let cfg = crate::model::shapes::shape(shape)?;
    Ok(PlanInput {
        tied: cfg.tie_word_embeddings.unwrap_or(false),
        kernels: Kernels::forecast(true, candle_core::DType::BF16, cfg.attn_shape()),
        cfg,
        dtype_bytes: 2,
        micro_batch,
        seq_len,
        rank,
        targets,
        dora: false,
        gpus: gpus.max(1),
        cuda: true,
        offload: true,
        quant: crate::quant::Quant::NONE,
        mlp_chunk: Some(crate::model::layer_mlp::MLP_CHUNK),
        host: None,
    })
}

impl PlanInput {
    /// Whether breakdown `b` of this input fits `capacity` on the device and its pinned
    /// memory the host (`host`).
    pub(crate) fn fits(&self, b: &super::Breakdown, capacity: u64) -> bool {
        b.total <= capacity && self.host_fits(b)
    }

    /// Whether this host can pin what `b` parks, for each of its `gpus` ranks (true where
    /// the host is not counted).
    pub(crate) fn host_fits(&self, b: &super::Breakdown) -> bool {
        self.host
            .is_none_or(|h| crate::memory::host::host_fits(b.host, self.gpus, h))
    }

    /// The same run on an NF4 base (double quant; no fold).
    pub fn nf4(self) -> PlanInput {
        self.with_quant(crate::quant::Quant::nf4(true))
    }

    /// The same plan on a host with `host` bytes free for pinned activations (None: the host
    /// not counted).
    pub fn with_host(self, host: Option<u64>) -> PlanInput {
        PlanInput { host, ..self }
    }

    /// The same run with its base stored as `quant` says (e.g. `Quant::for_checkpoint`: a
    /// bitsandbytes 4-bit checkpoint is NF4 whatever the recipe says).
    pub(crate) fn with_quant(self, quant: crate::quant::Quant) -> PlanInput {
        PlanInput {
            kernels: self.kernels.for_base(quant.nf4),
            quant,
            ..self
        }
    }
}

/// Tokens per MLP chunk as the layers run it (`Layer::mlp_chunk`): `chunk` (`train.mlp_chunk`),
/// unless LoRA dropout is on: an adapted MLP linear then keeps the MLP whole (its mask is drawn
/// over the whole input).
pub(crate) fn mlp_chunk_as_run(
    cfg: &ModelConfig,
    chunk: Option<usize>,
    dropout: f64,
    targets: &[String],
) -> Option<usize> {
    let whole = dropout > 0.0 && adapted(cfg, targets).any(is_mlp);
    chunk.filter(|&k| k > 0 && !whole)
}
