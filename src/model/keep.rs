//! What forward keeps of each decoder layer for its backward (activation checkpointing,
//! offload), resolved once from the run's settings (`Keep::new`) and read by the driver, the
//! memory plan and the FLOP counts alike.

use super::Retain;
use crate::recipe::Checkpointing;

/// What forward keeps of each layer for its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// The layer's input only: backward recomputes the layer (activation checkpointing).
    Input,
    /// As `Input`, the inputs parked in host memory (train::offload) until their layer's
    /// recompute, so that device memory does not grow with layers × tokens.
    InputParked,
    /// The activations; the residual h = x + o_proj(attn) is recomputed in backward (o_proj's
    /// GEMM again).
    Acts,
    /// The activations, the residual h parked in host memory (train::offload).
    Offload,
    /// The attention half's activations and the residual h; backward recomputes the MLP half
    /// from h (`activation_checkpointing = "mlp"`).
    Attention,
    /// As `Attention`, but the MLP half's activations are kept too, its gate and up [m, I]
    /// parked in host memory (train::offload) until the layer's backward, which then skips
    /// the MLP's recompute; the last `tail` layers (and any whose MLP runs in chunks, or a
    /// MoE's) recompute theirs, as under `Attention`, while the copies out of the layers
    /// below drain (`activation_checkpointing = "mlp"` on CUDA). Up to `pending` pairs wait on
    /// the device for their copies out.
    ParkMlp {
        /// Top layers that recompute their MLP rather than park it.
        tail: usize,
        /// Parked pairs that may wait on the device for their copies out.
        pending: usize,
    },
}

/// Layers at the top whose MLP half is recomputed under `Keep::ParkMlp`: their backward comes
/// first, and the copies of the layers below are still going out then (a PCIe 5 link moves a
/// Llama-3-8B layer's gate and up in ~8.5 ms, its forward takes ~7 ms: the copies fall behind
/// by ~5 layers over a forward; the recompute of 3 layers' MLP and the head make up for it).
pub(crate) const PARK_TAIL: usize = 3;

/// Bundles of gate and up on the device at once while their copies out run
/// (`Keep::ParkMlp`): parking another first waits for the oldest copy.
pub(crate) const PARK_PENDING: usize = 6;

impl Keep {
    /// From the recipe's `train.activation_checkpointing` and `train.offload_activations`
    /// (None: on), on CUDA (`cuda`) or not. Parking applies on CUDA only: elsewhere host memory is the device's. With
    /// the MLP half recomputed, its residual h stays on the device (its backward starts there).
    pub fn new(checkpointing: Checkpointing, offload: Option<bool>, cuda: bool) -> Keep {
        let offload = offload.unwrap_or(crate::recipe::OFFLOAD_ACTIVATIONS_DEFAULT);
        match (checkpointing, offload && cuda) {
            (Checkpointing::Full, true) => Keep::InputParked,
            (Checkpointing::Full, false) => Keep::Input,
            (Checkpointing::Mlp, true) => Keep::ParkMlp {
                tail: PARK_TAIL,
                pending: PARK_PENDING,
            },
            (Checkpointing::Mlp, false) => Keep::Attention,
            (Checkpointing::Off, true) => Keep::Offload,
            (Checkpointing::Off, false) => Keep::Acts,
        }
    }

    /// With the plan's pairs of parked gate and up in flight (`plan::Breakdown::
    /// park_pending`, fitted to the run's memory): 0 recomputes the MLP half instead
    /// (`Attention`); None keeps `self`.
    pub(crate) fn with_park(self, pending: Option<usize>) -> Keep {
        match (self, pending) {
            (Keep::ParkMlp { .. }, Some(0)) => Keep::Attention,
            (Keep::ParkMlp { tail, .. }, Some(pending)) => Keep::ParkMlp { tail, pending },
            (keep, _) => keep,
        }
    }

    /// Whether forward keeps the layers' input only (activation checkpointing).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn checkpointed(self) -> bool {
        matches!(self, Keep::Input | Keep::InputParked)
    }

    /// What a layer's forward keeps (under `ParkMlp`, where its MLP half is not parked).
    pub(crate) fn retain(self) -> Retain {
        match self {
            Keep::Input | Keep::InputParked => Retain::Nothing,
            Keep::Attention | Keep::ParkMlp { .. } => Retain::Attention,
            Keep::Acts | Keep::Offload => Retain::All,
        }
    }

    /// Whether layer `l` of `n_layers` parks its MLP's gate and up (its MLP half running
    /// whole: `Layer::mlp_runs_whole`).
    pub(crate) fn parks_mlp(self, l: usize, n_layers: usize) -> bool {
        match self {
            Keep::ParkMlp { tail, .. } => l + tail.max(1) < n_layers,
            _ => false,
        }
    }

    /// How many of `n_layers` layers park their MLP's gate and up (`parks_mlp`).
    pub(crate) fn mlp_parked_layers(self, n_layers: usize) -> usize {
        (0..n_layers)
            .filter(|&l| self.parks_mlp(l, n_layers))
            .count()
    }

    /// Whether something waits for backward in host memory.
    pub(crate) fn parks(self) -> bool {
        matches!(
            self,
            Keep::Offload | Keep::InputParked | Keep::ParkMlp { .. }
        )
    }

    /// Bundles on the device at once while their copies out run (train::offload).
    pub(crate) fn pending(self) -> usize {
        match self {
            Keep::ParkMlp { pending, .. } => pending,
            _ => 1,
        }
    }
}

/// Weights of a dense layer's MLP input projections (gate and up, or gate_up) over the layers
/// that recompute them under `activation_checkpointing = "mlp"`: what it multiplies once more
/// a token (a MoE's experts are recomputed in every setting). With gate and up parked
/// (`Keep::ParkMlp`, over `m` tokens a micro-batch that the MLP runs whole: none, or at most
/// `mlp_chunk`) only the top layers recompute.
pub(crate) fn mlp_in_weights(
    cfg: &super::ModelConfig,
    keep: Keep,
    m: usize,
    mlp_chunk: Option<usize>,
) -> usize {
    if cfg.arch.moe.is_some() {
        return 0;
    }
    let per_layer: usize = ["gate_proj", "up_proj", "gate_up_proj"]
        .iter()
        .filter_map(|m| cfg.linear_shape(m))
        .map(|(i, o)| i * o)
        .sum();
    let parked = match mlp_chunk.is_none_or(|k| m <= k) {
        true => keep.mlp_parked_layers(cfg.num_layers),
        false => 0,
    };
    per_layer * (cfg.num_layers - parked)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Off CUDA nothing is parked: checkpointing keeps the inputs on the device.
    #[test]
    fn what_forward_keeps_follows_the_recipe() {
        for offload in [None, Some(true), Some(false)] {
            assert_eq!(Keep::new(true.into(), offload, false), Keep::Input);
            assert_eq!(Keep::new(false.into(), offload, false), Keep::Acts);
            assert_eq!(
                Keep::new(Checkpointing::Mlp, offload, false),
                Keep::Attention
            );
        }
    }

    /// Under `ParkMlp` the layers but the top `tail` (and always the last) park gate and up;
    /// the others keep the attention half, as under `Attention`.
    #[test]
    fn park_mlp_parks_all_but_the_top_layers() {
        let k = Keep::ParkMlp {
            tail: 3,
            pending: 2,
        };
        let parked: Vec<usize> = (0..8).filter(|&l| k.parks_mlp(l, 8)).collect();
        assert_eq!(parked, [0, 1, 2, 3, 4]);
        let k0 = Keep::ParkMlp {
            tail: 0,
            pending: 1,
        };
        assert!(k0.parks_mlp(6, 8));
        assert!(!k0.parks_mlp(7, 8), "the last layer's backward comes first");
        assert!(!Keep::Attention.parks_mlp(0, 8));
        assert!(!Keep::Offload.parks_mlp(0, 8));
        assert_eq!(k.retain(), Retain::Attention);
        assert!(k.parks() && !k.checkpointed());
        assert_eq!((k.pending(), Keep::Offload.pending()), (2, 1));
    }
}
