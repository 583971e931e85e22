//! A frozen linear's adapter slot: the type of what sits there (`Lora`: A, B, scale, dropout,
//! DoRA's m) and who fills the slots (`Inject`, which lora::LoraSpec implements). The model
//! builds each layer with empty slots and hands it to `Inject` before folding, sharding or
//! handing it on, so the model knows no targets; `module_index` keys a module's random
//! streams (its adapter's init, its dropout masks).

use super::config::ModelConfig;
use super::layer::Layer;
use candle_core::Var;
use std::sync::Arc;

/// The adapter in a frozen linear's slot (clones share the `Var`s): made and injected by
/// `lora` (`lora::LoraSpec`'s `Inject`).
#[derive(Clone)]
pub struct Lora {
    /// A [r, in] f32 (random at init).
    pub a: Var,
    /// B [out, r] f32 (zero at init).
    pub b: Var,
    /// s, the factor on x Aᵀ Bᵀ (α / r, or α / √r).
    pub scale: f64,
    /// Probability that an element of the adapter's input is zeroed (0: none).
    pub dropout: f32,
    /// DoRA's magnitude [out] f32 (None for plain LoRA).
    pub m: Option<Var>,
}

impl Lora {
    /// The trainable tensors: A, B, then DoRA's m (the optimiser's order, and the
    /// checkpoint's).
    pub fn vars(&self) -> Vec<&Var> {
        let mut v = vec![&self.a, &self.b];
        v.extend(self.m.as_ref());
        v
    }
}

/// A module's index in `recipe::KNOWN_LINEAR`: with the layer, the key of its adapter's random
/// streams (init, dropout), so Llama's seven keep the keys they always had.
pub fn module_index(module: &str) -> u64 {
    crate::recipe::KNOWN_LINEAR
        .iter()
        .position(|m| *m == module)
        .unwrap_or(0) as u64
}

/// Who gives a built layer its adapters (lora::LoraSpec): called once per decoder layer, right
/// after the layer's base is built (so DoRA reads the W the forward uses, before a fold or an
/// FSDP shard replaces it).
pub trait Inject: std::fmt::Debug + Send + Sync {
    /// Fills layer `l`'s adapter slots (its linears', a MoE's experts'); `seed` keys their
    /// init streams.
    fn inject(
        &self,
        layer: &mut Layer,
        cfg: &ModelConfig,
        l: usize,
        seed: u64,
    ) -> anyhow::Result<()>;

    /// A copy to keep (a `Build` holds it).
    fn shared(&self) -> Arc<dyn Inject>;
}
