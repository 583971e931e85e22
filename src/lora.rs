//! LoRA adapters: y = base(x) + scale · B(A(dropout(x))); dropout's masks are `ops::dropout`'s
//! (drawn where they are used, keyed by seed, step, micro-batch, layer and module).
//!
//! A: [r, in], B: [out, r], both f32 `Var`s whatever the base dtype; they are cast to the
//! activation dtype inside the forward (the cast's backward returns f32 gradients).
//! scale = alpha / r, or alpha / √r with rsLoRA. Init as PEFT: A kaiming-uniform(a=√5), i.e.
//! U(−1/√in, 1/√in); B zeros, so training starts from the base model exactly.
//!
//! DoRA (`lora.use_dora`) adds a trainable magnitude m [out] f32, initialised to the row norms
//! of W: y = (m / ‖W + s·B A‖_row) ⊙ (x Wᵀ + s·x Aᵀ Bᵀ) + bias (`ops::dora`).

use crate::rng::Rng;
use candle_core::{DType, Device, Result, Tensor, Var};

/// The seven linear modules of a Llama-family decoder layer, in checkpoint order.
pub const ALL_LINEAR: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// Every module name lora.targets may hold (the recipe defines them: `recipe::KNOWN_LINEAR`).
pub(crate) use crate::recipe::KNOWN_LINEAR;

/// A MoE's fused expert parameters LoRA can adapt, as PEFT's `target_parameters` names them:
/// gate_up_proj [E, 2I, C] and down_proj [E, C, I] of `model.layers.N.mlp.experts`. PEFT gives
/// each one adapter over all experts, A [E·r, in] (expert e's rows e·r..) and B [out, r·E]
/// (expert e's columns e, E + e, ..); model/layer_moe.rs.
pub(crate) const EXPERT_PARAMS: [&str; 2] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"];

/// A module's index in `KNOWN_LINEAR`: with the layer, the key of its adapter's random streams
/// (init, dropout), so Llama's seven keep the keys they always had.
pub(crate) fn module_index(module: &str) -> u64 {
    KNOWN_LINEAR.iter().position(|m| *m == module).unwrap_or(0) as u64
}

/// What to inject, resolved from the recipe (or an init adapter's config).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    /// r: the adapters' inner dimension (A [r, in], B [out, r]).
    pub rank: usize,
    /// α: the adapters' scale is α / r (α / √r with `rslora`).
    pub alpha: f64,
    /// Probability that an element of an adapter's input is zeroed (0: none).
    pub dropout: f32,
    /// rsLoRA: scale α / √r instead of α / r.
    pub rslora: bool,
    /// DoRA: each adapter has a magnitude vector (PEFT's `use_dora`).
    pub dora: bool,
    /// Module names (subset of `KNOWN_LINEAR`), in `KNOWN_LINEAR` order; once resolved against
    /// a model's config, its own linears'.
    pub targets: Vec<String>,
}

impl LoraSpec {
    pub(crate) fn scale(&self) -> f64 {
        if self.rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    pub(crate) fn targets(&self, module: &str) -> bool {
        self.targets.iter().any(|t| t == module)
    }
}

/// One adapter pair attached to a frozen linear (clones share the `Var`s).
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
    /// Fresh adapter: A ~ U(−1/√in, 1/√in) from a stream keyed by (seed, layer, module); B = 0.
    pub(crate) fn init(
        spec: &LoraSpec,
        in_f: usize,
        out_f: usize,
        seed: u64,
        key: &[u64],
        dev: &Device,
    ) -> Result<Self> {
        let bound = 1.0 / (in_f as f32).sqrt();
        let mut rng = Rng::keyed(seed, key);
        let a: Vec<f32> = (0..spec.rank * in_f)
            .map(|_| (rng.next_f32() * 2.0 - 1.0) * bound)
            .collect();
        let a = Var::from_tensor(&Tensor::from_vec(a, (spec.rank, in_f), dev)?)?;
        let b = Var::zeros((out_f, spec.rank), DType::F32, dev)?;
        Ok(Lora {
            a,
            b,
            scale: spec.scale(),
            dropout: spec.dropout,
            m: None,
        })
    }

    /// `init` with DoRA's magnitude where `spec.dora`: m = ‖W‖_row of the weight the forward
    /// uses (`w` [out, in], dequantized for an NF4 base), so that m / ‖W + s·B A‖ starts at 1.
    pub(crate) fn init_for(
        spec: &LoraSpec,
        w: &Tensor,
        seed: u64,
        key: &[u64],
        dev: &Device,
    ) -> Result<Self> {
        let (out_f, in_f) = w.dims2()?;
        let mut lora = Self::init(spec, in_f, out_f, seed, key, dev)?;
        if spec.dora {
            let m = crate::ops::dora::row_norms(w)?.to_device(dev)?;
            lora.m = Some(Var::from_tensor(&m)?);
        }
        Ok(lora)
    }

    /// The trainable tensors: A, B, then DoRA's m (the optimiser's order, and the
    /// checkpoint's).
    pub fn vars(&self) -> Vec<&Var> {
        let mut v = vec![&self.a, &self.b];
        v.extend(self.m.as_ref());
        v
    }
}
