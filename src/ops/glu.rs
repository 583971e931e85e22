//! The MLP's gated activation, one of two: SwiGLU (Llama, Mistral, Qwen, Phi-3: ops::swiglu)
//! or GeGLU (Gemma: ops::geglu). The model's config picks it (model/family.rs); the layer calls
//! through here.

use candle_core::{Result, Tensor};

/// The gate's activation: a = act(g) ⊙ u.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// silu(g) ⊙ u.
    Silu,
    /// gelu_pytorch_tanh(g) ⊙ u.
    GeluTanh,
}

impl Act {
    /// g, u: [..., I] → act(g) ⊙ u, differentiable in g and u.
    pub fn glu(self, g: &Tensor, u: &Tensor) -> Result<Tensor> {
        match self {
            Act::Silu => super::swiglu(g, u),
            Act::GeluTanh => super::geglu::geglu(g, u),
        }
    }

    /// (g, u, da) → (dg, du).
    pub fn glu_bwd(self, g: &Tensor, u: &Tensor, da: &Tensor) -> Result<(Tensor, Tensor)> {
        match self {
            Act::Silu => super::swiglu_bwd(g, u, da),
            Act::GeluTanh => super::geglu::geglu_bwd(g, u, da),
        }
    }

    /// (g, u, da) → (dg, du, a), da consumed (`swiglu_bwd_keep`).
    pub fn glu_bwd_keep(
        self,
        g: &Tensor,
        u: &Tensor,
        da: Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        match self {
            Act::Silu => super::swiglu_bwd_keep(g, u, da),
            Act::GeluTanh => super::geglu::geglu_bwd_keep(g, u, da),
        }
    }
}
