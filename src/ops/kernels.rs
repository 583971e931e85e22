//! Every kernel choice of a run, in one value resolved once at start-up.
//!
//! `Kernels::resolve` reads the device (CUDA or not, Hopper or not), the activation dtype, the
//! model's attention shape (`AttnShape`: head dim, and whether the scores are soft-capped) and
//! the one user-facing choice, `train.deterministic` (`bench --deterministic`).
//! The model holds the result (`Model::kernels`) and each batch's `Ctx` carries a copy, so that
//! every op takes its choice from there. `Kernels::forecast` makes the same choices without a
//! device, for `lora-train plan` in any build.
//!
//! A fallback exists only where the hardware, the dtype or the model needs it: the blockwise
//! attention (CPU, f32 and f16, head dims other than 64, 96, 128 and 256), the unfolded
//! adapters (CPU, f32 and f16; per linear also biases), dropout's masked copies (CPU, f32 and f16), the
//! cross-entropy as tensor ops (CPU, f16), and cuBLAS's own GEMM choice (CPU).
//!
//! Experiments not yet measured stay off unless named in `LORA_TRAIN_EXPERIMENTS`, a comma-
//! separated list (`EXPERIMENTS`), read by `resolve`:
//! - `reduce_ahead`: DDP's per-layer gradient sums run on the comm's second stream under the
//!   backward of the layers below, and the compute stream waits for them once, after the
//!   backward (`Comm::reduced`), instead of for each as it is issued.
//! - `peer_copy`: FSDP's ranks of one process copy each other's frozen shards with copy engines
//!   (`Comm::share_static`) instead of gathering them with NCCL; it needs
//!   CUDA_MODULE_LOADING=EAGER, which `parallel::prepare_process` sets before CUDA starts.
//! - `decode_graph`: `generate` replays a base model's one-token step as a CUDA graph
//!   (`generate::graph`).

use candle_core::{DType, Device};

/// The variable that names the experiments to turn on.
pub(crate) const EXPERIMENTS_VAR: &str = "LORA_TRAIN_EXPERIMENTS";
/// The experiments `LORA_TRAIN_EXPERIMENTS` may name.
pub(crate) const EXPERIMENTS: [&str; 3] = ["reduce_ahead", "peer_copy", "decode_graph"];

/// What the attention kernels' choice depends on in the model (`ModelConfig::attn_shape`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// D: the width of each attention head.
    pub head_dim: usize,
    /// The scores are soft-capped (Gemma 2's attn_logit_softcapping).
    pub softcap: bool,
    /// Attention sinks (gpt-oss): the blockwise pass runs. (`ops::flash` takes them too, the
    /// sinks rescaling its O and L as `attention::apply_sinks` does, but that path has not yet
    /// run on a GPU: `flash_attention_matches_blockwise_on_the_gpu`'s window-128 row.)
    pub sinks: bool,
}

impl From<usize> for AttnShape {
    /// A head dim, no soft-cap.
    fn from(head_dim: usize) -> Self {
        AttnShape {
            head_dim,
            softcap: false,
            sinks: false,
        }
    }
}

/// The kernels of a causal attention pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attention {
    /// `ops::attention`: cuBLAS GEMMs per block of queries and the masked softmax between
    /// them; any device, dtype and head dim. The reference the others are tested against.
    Blockwise,
    /// flash.cu: mma.sync from ldmatrix fragments; sm_80 and later, bf16, head dims 64, 96, 128
    /// and 256, soft-capped scores (Gemma 2) or not.
    MmaSync,
    /// Head dim 256 (Gemma 2 and 3) on compute capability 9.0, soft-capped or not: flash90.cu's
    /// `flash_fwd90_d256`, `flash_dq90_d256` and `flash_dkdv90_d256` (every sum in a fixed
    /// order).
    Wgmma256,
    /// flash90.cu: warpgroup MMA (wgmma) from swizzled shared tiles; compute capability 9.0
    /// (H100, H200), bf16, head dim 128, no soft-cap. The backward is one kernel (`flash_bwd90`: dK, dV and
    /// dQ's terms from one S and dP per tile) and a pass that rounds dQ's f32 sums. Those sums
    /// add the key tiles' terms in the order they land: dq is not bit-reproducible from run
    /// to run (f32 rounding; PyTorch's flash backward is alike).
    Wgmma,
    /// `Wgmma` with the backward in two kernels, dQ apart (`flash_dq90` computes S and dP
    /// again): no f32 dQ buffer, and every sum in a fixed order, so runs repeat bit for bit
    /// (`train.deterministic`).
    WgmmaSplitDq,
}

impl Attention {
    /// Whether the pass runs on the tensor-core kernels (ops::flash): no score blocks in memory.
    pub fn tensor_cores(self) -> bool {
        self != Attention::Blockwise
    }

    /// The choice for attention shape `a` over `dtype` activations on CUDA (`cuda`) or not, on
    /// a Hopper GPU (`hopper`) or not.
    fn choose(cuda: bool, hopper: bool, dtype: DType, a: AttnShape, deterministic: bool) -> Self {
        let wgmma = hopper && !a.softcap;
        match (cuda && dtype == DType::BF16 && !a.sinks, a.head_dim) {
            (true, 128) if wgmma && deterministic => Attention::WgmmaSplitDq,
            (true, 128) if wgmma => Attention::Wgmma,
            (true, 256) if hopper => Attention::Wgmma256,
            (true, 64 | 96 | 128 | 256) => Attention::MmaSync,
            _ => Attention::Blockwise,
        }
    }
}

/// How the head's token cross-entropy and its gradient are made (ops::cross_entropy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrossEntropy {
    /// cross_entropy.cu: one kernel, the logits in their own dtype (CUDA, f32 or bf16).
    Fused,
    /// Tensor ops over f32 logits in chunks (the reference; CPU, f16).
    Ops,
}

/// Which algorithm runs the large cuBLAS GEMMs (ops::gemm_tune).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gemm {
    /// cuBLASLt's heuristic candidates timed on the first GEMM of each shape, the fastest kept
    /// (CUDA). Bit for bit the same results as `Heuristic`.
    Tuned,
    /// cublasGemmEx's own pick (and candle's matmul off CUDA).
    Heuristic,
}

/// Experiments turned on by `LORA_TRAIN_EXPERIMENTS` (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Experiments {
    pub(crate) reduce_ahead: bool,
    pub(crate) peer_copy: bool,
    /// `generate` replays a base model's one-token step as a CUDA graph.
    pub(crate) decode_graph: bool,
}

/// `LORA_TRAIN_EXPERIMENTS` named something that is not an experiment.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "{EXPERIMENTS_VAR}: unknown experiment `{name}` (known: {}); unset the variable or name \
     only those",
    EXPERIMENTS.join(", ")
)]
pub struct UnknownExperiment {
    pub(crate) name: String,
}

impl Experiments {
    /// The experiments `LORA_TRAIN_EXPERIMENTS` names (none when it is unset).
    pub(crate) fn from_env() -> Result<Experiments, UnknownExperiment> {
        Self::parse(std::env::var(EXPERIMENTS_VAR).ok().as_deref())
    }

    /// The experiments of a comma-separated list (blanks around names and empty items are
    /// ignored).
    pub(crate) fn parse(list: Option<&str>) -> Result<Experiments, UnknownExperiment> {
        let mut e = Experiments::default();
        for name in list.unwrap_or("").split(',').map(str::trim) {
            match name {
                "" => {}
                "reduce_ahead" => e.reduce_ahead = true,
                "peer_copy" => e.peer_copy = true,
                "decode_graph" => e.decode_graph = true,
                other => {
                    return Err(UnknownExperiment {
                        name: other.to_string(),
                    })
                }
            }
        }
        Ok(e)
    }
}

/// Every kernel choice of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernels {
    /// Causal attention, forward and backward (model/layer_train.rs).
    pub attention: Attention,
    /// The adapters' forward and backward folded into the frozen GEMMs by concatenating k
    /// (ops::fold: CUDA, bf16): `Model::fold` pads the weights of the groups that can.
    pub fold: bool,
    /// LoRA dropout's masks drawn inside the adapters' kernels (ops::fold_drop: CUDA, bf16),
    /// where they take the operands; else a masked copy of the input per use
    /// (`ops::dropout::apply`). The same masks either way.
    pub dropout_fused: bool,
    /// The head's cross-entropy (`Model::head_loss_bwd`).
    pub cross_entropy: CrossEntropy,
    /// The large GEMMs' algorithm (ops::linear_acc).
    pub gemm: Gemm,
    /// Experiments turned on by `LORA_TRAIN_EXPERIMENTS`.
    pub experiments: Experiments,
}

impl Kernels {
    /// The choices for a base stored in NF4 (`nf4`) or not: an NF4 base is dequantized into plain
    /// [out, in] weights for each use, so its linears do not fold (`ops::fold` wants padded
    /// buffers made at load).
    pub(crate) fn for_base(self, nf4: bool) -> Kernels {
        Kernels {
            fold: self.fold && !nf4,
            ..self
        }
    }

    /// The choices for adapters with DoRA's magnitudes (`dora`) or without: DoRA rescales each
    /// linear's output rows after its GEMMs, which the fold (`ops::fold`) does not, so its
    /// linears run unfolded (`Linear::shared`).
    pub(crate) fn for_adapters(self, dora: bool) -> Kernels {
        Kernels {
            fold: self.fold && !dora,
            ..self
        }
    }

    /// The choices for a model of `dtype` activations and attention shape `attn` (a head dim,
    /// or `ModelConfig::attn_shape`) on `device`;
    /// `deterministic`: no kernel whose f32 sums land in a varying order (today wgmma's fused
    /// dQ), so that a run repeats bit for bit on the same GPU. Fails only on a bad
    /// `LORA_TRAIN_EXPERIMENTS`.
    pub fn resolve(
        device: &Device,
        dtype: DType,
        attn: impl Into<AttnShape>,
        deterministic: bool,
    ) -> Result<Kernels, UnknownExperiment> {
        let cuda = cfg!(feature = "cuda") && device.is_cuda();
        Ok(Self::choose(
            cuda,
            hopper(device),
            dtype,
            attn.into(),
            deterministic,
            Experiments::from_env()?,
        ))
    }

    /// What `resolve` would choose in a CUDA build, without a device (`lora-train plan`, from
    /// any build): on a GPU (`cuda`) taken to be a Hopper one; no experiments.
    pub(crate) fn forecast(cuda: bool, dtype: DType, attn: impl Into<AttnShape>) -> Kernels {
        Self::choose(
            cuda,
            cuda,
            dtype,
            attn.into(),
            false,
            Experiments::default(),
        )
    }

    /// Every fallback: what the CPU runs.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn fallback() -> Kernels {
        Self::forecast(false, DType::F32, 0)
    }

    fn choose(
        cuda: bool,
        hopper: bool,
        dtype: DType,
        attn: AttnShape,
        deterministic: bool,
        experiments: Experiments,
    ) -> Kernels {
        Kernels {
            attention: Attention::choose(cuda, hopper, dtype, attn, deterministic),
            fold: cuda && dtype == DType::BF16,
            dropout_fused: cuda && dtype == DType::BF16,
            cross_entropy: match cuda && matches!(dtype, DType::F32 | DType::BF16) {
                true => CrossEntropy::Fused,
                false => CrossEntropy::Ops,
            },
            gemm: match cuda {
                true => Gemm::Tuned,
                false => Gemm::Heuristic,
            },
            experiments,
        }
    }
}

/// Whether `dev` is a Hopper GPU (compute capability 9.0), where flash90.cu's kernels run.
fn hopper(dev: &Device) -> bool {
    match dev {
        #[cfg(feature = "cuda")]
        Device::Cuda(c) => super::cuda::is_hopper(c).unwrap_or(false),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn experiments_parse_and_unknown_names_are_errors_naming_the_variable() {
        assert_eq!(Experiments::parse(None), Ok(Experiments::default()));
        assert_eq!(Experiments::parse(Some("")), Ok(Experiments::default()));
        let both = Experiments::parse(Some(" reduce_ahead, peer_copy,")).unwrap();
        assert!(both.reduce_ahead && both.peer_copy);
        let one = Experiments::parse(Some("peer_copy")).unwrap();
        assert!(one.peer_copy && !one.reduce_ahead && !one.decode_graph);
        assert!(
            Experiments::parse(Some("decode_graph"))
                .unwrap()
                .decode_graph
        );
        let e = Experiments::parse(Some("reduce_ahead,fast")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "LORA_TRAIN_EXPERIMENTS: unknown experiment `fast` (known: reduce_ahead, \
             peer_copy, decode_graph); unset the variable or name only those"
        );
    }

    #[test]
    fn choices_follow_the_device_dtype_and_head_dim() {
        let bf16 = DType::BF16;
        let k = Kernels::forecast(true, bf16, 128);
        assert_eq!(k.attention, Attention::Wgmma);
        assert!(k.fold && k.dropout_fused && k.attention.tensor_cores());
        assert_eq!(
            (k.cross_entropy, k.gemm),
            (CrossEntropy::Fused, Gemm::Tuned)
        );
        assert_eq!(
            Kernels::forecast(true, bf16, 64).attention,
            Attention::MmaSync
        );
        let d128 = AttnShape::from(128);
        let split = Kernels::choose(true, true, bf16, d128, true, Experiments::default());
        assert_eq!(split.attention, Attention::WgmmaSplitDq);
        let ampere = Kernels::choose(true, false, bf16, d128, true, Experiments::default());
        assert_eq!(ampere.attention, Attention::MmaSync);
        // Soft-capped scores (Gemma 2), head dims 96 (Phi-3) and 256 (Gemma): mma.sync on
        // any GPU, Hopper's d128 wgmma kernels having neither; at head dim 256 on Hopper
        // wgmma's d256 kernels, capped or not.
        let shapes = [64, 96, 128, 256]
            .map(|head_dim| AttnShape {
                head_dim,
                softcap: true,
                sinks: false,
            })
            .into_iter()
            .chain([AttnShape::from(96), AttnShape::from(256)]);
        for a in shapes {
            for (hopper, det) in [(true, false), (true, true), (false, false)] {
                let k = Kernels::choose(true, hopper, bf16, a, det, Experiments::default());
                let want = match hopper && a.head_dim == 256 {
                    true => Attention::Wgmma256,
                    false => Attention::MmaSync,
                };
                assert_eq!(k.attention, want, "{a:?} hopper={hopper}");
                assert!(k.fold && k.cross_entropy == CrossEntropy::Fused);
            }
        }
        // The family shapes of `bench` (Phi-3, Gemma 2 with its cap, Gemma 3) on Hopper.
        for (shape, want) in [
            ("phi3-mini", Attention::MmaSync),
            ("gemma2-9b", Attention::Wgmma256),
            ("gemma3-12b", Attention::Wgmma256),
        ] {
            let cfg = crate::model::shapes::shape(shape).unwrap();
            let k = Kernels::forecast(true, bf16, cfg.attn_shape());
            assert_eq!(k.attention, want, "{shape}");
        }
        // gpt-oss's sinks: the blockwise pass, on any GPU, until flash's sinks have run on one
        let sinks = AttnShape {
            head_dim: 64,
            softcap: false,
            sinks: true,
        };
        for hopper in [true, false] {
            let k = Kernels::choose(true, hopper, bf16, sinks, false, Experiments::default());
            assert_eq!(k.attention, Attention::Blockwise, "sinks hopper={hopper}");
        }
        for head_dim in [32, 80, 160] {
            let k = Kernels::forecast(true, bf16, head_dim);
            assert_eq!(k.attention, Attention::Blockwise, "head dim {head_dim}");
        }
        let capped_cpu = AttnShape {
            head_dim: 256,
            softcap: true,
            sinks: false,
        };
        assert_eq!(
            Kernels::forecast(false, bf16, capped_cpu).attention,
            Attention::Blockwise
        );
        // f32 on a GPU: the fused cross-entropy and tuned GEMMs, nothing else.
        let f32 = Kernels::forecast(true, DType::F32, 128);
        assert_eq!(f32.attention, Attention::Blockwise);
        assert!(!f32.fold && !f32.dropout_fused);
        assert_eq!(
            (f32.cross_entropy, f32.gemm),
            (CrossEntropy::Fused, Gemm::Tuned)
        );
        let f16 = Kernels::forecast(true, DType::F16, 128);
        assert_eq!(f16.cross_entropy, CrossEntropy::Ops);
        // The CPU: every fallback.
        let cpu = Kernels::resolve(&Device::Cpu, bf16, 128, true).unwrap();
        assert_eq!(
            cpu,
            Kernels {
                experiments: cpu.experiments,
                ..Kernels::fallback()
            }
        );
        assert_eq!(cpu.attention, Attention::Blockwise);
        assert!(!cpu.fold && !cpu.dropout_fused);
        assert_eq!(
            (cpu.cross_entropy, cpu.gemm),
            (CrossEntropy::Ops, Gemm::Heuristic)
        );
    }
}
