//! A MoE layer's MLP half (Qwen3-MoE's `Qwen3MoeSparseMoeBlock`), y = h + Σ_j w_j · E_j(hn),
//! hn = rms_norm(h), over the k experts the router (model/router.rs) picks for each token:
//!
//!   E_e(x) = down_e(silu(gate_e(x)) ⊙ up_e(x)),  [gate_e; up_e] = gate_up_proj[e] [2I, C]
//!
//! The experts are frozen; LoRA may adapt their fused parameters as PEFT does
//! (`lora::EXPERT_PARAMS`): one adapter per parameter, A [E·r, in] and B [out, r·E], expert e's
//! A_e = A[e·r .. e·r + r] and B_e[:, j] = B[:, j·E + e], so W_e + s·B_e A_e.
//!
//! Tokens are grouped by expert (`router::Routing`): the rows routed to an expert are gathered
//! into one run, each expert is one GEMM per projection over its run, and the outputs, scaled
//! by their weights, are summed back onto their tokens (index_select, matmul, then a gather
//! and k adds: `router::sum_slots`; no per-token loop, the same ops on the CPU and CUDA). An
//! expert no token chose is skipped.
//!
//! Training keeps only h (`LayerActs::h`): the backward recomputes the routing and each
//! expert's forward from it just before that expert's backward, so no [m·k, I] activation
//! lives across layers (the FLOPs of one more MLP forward).
//!
//! Shapes: m tokens, C hidden, E experts, k experts per token, I an expert's width, n the
//! tokens of one expert, r the adapters' rank.

use super::family::MoeSpec;
use super::layer::Layer;
use super::layer_train::LayerGrads;
use super::llama::Ctx;
use super::moe_batched::Padded;
use super::router::{route, route_bwd, sum_slots, Routing};
use crate::lora::Lora;
use crate::ops::{self, glu::Act};
use candle_core::{DType, Result, Tensor, D};

/// A LoRA adapter on one fused expert parameter, with the module path PEFT keys it by
/// (`model.layers.N.mlp.experts`, or `...experts.base_layer` for the inner of two).
#[derive(Clone)]
pub struct ExpertLora {
    pub name: String,
    /// A [E·r, in], B [out, r·E] (PEFT's layout), scale s.
    pub lora: Lora,
}

/// A MoE layer's frozen router and experts, and the experts' adapters.
#[derive(Clone)]
pub struct Moe {
    /// The router's W [E, C] (`mlp.gate.weight`).
    pub router: Tensor,
    /// [E, 2I, C]: each expert's gate rows, then its up rows.
    pub gate_up: Tensor,
    /// [E, C, I].
    pub down: Tensor,
    pub spec: MoeSpec,
    pub gate_up_lora: Option<ExpertLora>,
    pub down_lora: Option<ExpertLora>,
    /// The experts as batched GEMMs over a padded layout (model/moe_batched.rs; the
    /// `moe_batched` experiment, set at load from `Kernels::experiments`), else one GEMM per
    /// expert.
    pub batched: bool,
}

/// One parameter's adapter split per expert, in the activation dtype.
pub(super) struct PerExpert {
    pub(super) a: Tensor, // [E, r, in]
    pub(super) b: Tensor, // [E, out, r]
    pub(super) scale: f64,
}

impl PerExpert {
    /// `graph`: the adapter as its `Var`, so autograd's graph reaches it (the reference
    /// forward); else detached, for the hand-written passes: a product of a `Var` records its
    /// inputs, so each expert's gradients would hold that expert's rows and their gradients (a
    /// layer's routed activations) until the optimiser step, for every layer of the step.
    fn of(
        l: &Option<ExpertLora>,
        experts: usize,
        dt: DType,
        graph: bool,
    ) -> Result<Option<PerExpert>> {
        let Some(l) = l else { return Ok(None) };
        let (a, b) = (l.lora.a.as_tensor(), l.lora.b.as_tensor());
        let (a, b) = match graph {
            true => (a.clone(), b.clone()),
            false => (a.detach(), b.detach()),
        };
        let (er, in_f) = a.dims2()?;
        let (out, r) = (b.dim(0)?, er / experts.max(1));
        Ok(Some(PerExpert {
            a: a.to_dtype(dt)?.reshape((experts, r, in_f))?,
            b: b.to_dtype(dt)?
                .reshape((out, r, experts))?
                .permute((2, 0, 1))?
                .contiguous()?,
            scale: l.lora.scale,
        }))
    }

    /// Expert e's adapter alone: a [r, in], b [out, r] (views).
    fn at(&self, e: usize) -> Result<PerExpert> {
        Ok(PerExpert {
            a: self.a.get(e)?,
            b: self.b.get(e)?,
            scale: self.scale,
        })
    }

    /// y = base + s·(x Aᵀ) Bᵀ from the frozen product `base`, for one expert (x [n, in],
    /// `at`) or all at once (x [E, cap, in]); (y, s·x Aᵀ [.., r]).
    fn add(&self, x: &Tensor, base: Tensor) -> Result<(Tensor, Tensor)> {
        let xa = (x.matmul(&self.a.t()?)? * self.scale)?;
        let y = (base + xa.matmul(&self.b.t()?)?)?;
        Ok((y, xa))
    }

    /// The backward of `add` for g = dL/dy [.., out]: the adapter's term of dL/dx [.., in],
    /// and (dA, dB) f32, shaped as a and b.
    fn bwd(&self, x: &Tensor, xa: &Tensor, g: &Tensor) -> Result<(Tensor, Grad)> {
        let gb = g.matmul(&self.b)?; // [.., r]
        let dx = (gb.matmul(&self.a)? * self.scale)?;
        let da = (gb.t()?.matmul(x)? * self.scale)?.to_dtype(DType::F32)?;
        let db = g.t()?.matmul(xa)?.to_dtype(DType::F32)?;
        Ok((dx, (da, db)))
    }
}

/// One expert's adapter gradients (dA_e [r, in], dB_e [out, r]) f32.
pub(super) type Grad = (Tensor, Tensor);

/// One expert's gate_up [2I, C] and down [C, I] (views).
type ExpertWeights = (Tensor, Tensor);

/// One expert's gate_up and down adapters (`PerExpert::at`).
type ExpertAdapters = (Option<PerExpert>, Option<PerExpert>);

/// Expert e's forward over its n tokens, what its backward takes.
/// (Batched, model/moe_batched.rs: every expert's at once, [E, cap, ·].)
pub(super) struct ExpertActs {
    pub(super) gate: Tensor,            // [n, I]
    pub(super) up: Tensor,              // [n, I]
    pub(super) a: Tensor,               // [n, I] silu(gate) ⊙ up, down's input
    pub(super) xa_gu: Option<Tensor>,   // [n, r] gate_up's adapter state
    pub(super) xa_down: Option<Tensor>, // [n, r] down's
    pub(super) y: Tensor,               // [n, C] before the routing weight
}

impl Moe {
    /// The frozen tensors: router, gate_up, down.
    pub fn frozen(&self) -> Vec<&Tensor> {
        vec![&self.router, &self.gate_up, &self.down]
    }

    pub fn frozen_mut(&mut self) -> Vec<&mut Tensor> {
        vec![&mut self.router, &mut self.gate_up, &mut self.down]
    }

    /// The experts' adapters with their PEFT module paths (gate_up's, then down's).
    pub fn adapters(&self) -> impl Iterator<Item = (&str, &Lora)> {
        [&self.gate_up_lora, &self.down_lora]
            .into_iter()
            .flatten()
            .map(|l| (l.name.as_str(), &l.lora))
    }

    /// The experts' forward: one expert's x [n, C] with its gate_up [2I, C], down [C, I] and
    /// adapters (`PerExpert::at`), or every expert's padded run x [E, cap, C] with all of them
    /// (model/moe_batched.rs).
    pub(super) fn experts_fwd(
        &self,
        x: &Tensor,
        (gate_up, down): (&Tensor, &Tensor),
        (gu_ad, down_ad): (Option<&PerExpert>, Option<&PerExpert>),
    ) -> Result<ExpertActs> {
        let i = self.spec.inter;
        let gu = x.matmul(&gate_up.t()?)?; // [.., 2I]
        let (gu, xa_gu) = match gu_ad {
            Some(p) => {
                let (y, xa) = p.add(x, gu)?;
                (y, Some(xa))
            }
            None => (gu, None),
        };
        let gate = gu.narrow(D::Minus1, 0, i)?.contiguous()?;
        let up = gu.narrow(D::Minus1, i, i)?.contiguous()?;
        let a = Act::Silu.glu(&gate, &up)?;
        let y = a.matmul(&down.t()?)?; // [.., C]
        let (y, xa_down) = match down_ad {
            Some(p) => {
                let (y, xa) = p.add(&a, y)?;
                (y, Some(xa))
            }
            None => (y, None),
        };
        Ok(ExpertActs {
            gate,
            up,
            a,
            xa_gu,
            xa_down,
            y,
        })
    }

    /// The backward of `experts_fwd` (the same weights and adapters) for gy = dL/dy [.., C]
    /// (the routing weights applied): dL/dx [.., C], and the adapters' (dA, dB) f32 shaped as
    /// theirs, gate_up's then down's.
    #[allow(clippy::type_complexity)]
    pub(super) fn experts_bwd(
        &self,
        x: &Tensor,
        acts: &ExpertActs,
        gy: &Tensor,
        (gate_up, down): (&Tensor, &Tensor),
        (gu_ad, down_ad): (Option<&PerExpert>, Option<&PerExpert>),
    ) -> Result<(Tensor, Option<Grad>, Option<Grad>)> {
        let mut da = gy.matmul(down)?; // [.., I]
        let mut down_grads = None;
        if let (Some(p), Some(xa)) = (down_ad, &acts.xa_down) {
            let (dx, gr) = p.bwd(&acts.a, xa, gy)?;
            da = (da + dx)?;
            down_grads = Some(gr);
        }
        let (dgate, dup) = Act::Silu.glu_bwd(&acts.gate, &acts.up, &da)?;
        let dgu = Tensor::cat(&[&dgate, &dup], D::Minus1)?; // [.., 2I]
        let mut dx = dgu.matmul(gate_up)?; // [.., C]
        let mut gu_grads = None;
        if let (Some(p), Some(xa)) = (gu_ad, &acts.xa_gu) {
            let (dxa, gr) = p.bwd(x, xa, &dgu)?;
            dx = (dx + dxa)?;
            gu_grads = Some(gr);
        }
        Ok((dx, gu_grads, down_grads))
    }

    /// Expert e's weights and adapters (views).
    fn expert(
        &self,
        e: usize,
        (gu_ad, down_ad): (Option<&PerExpert>, Option<&PerExpert>),
    ) -> Result<(ExpertWeights, ExpertAdapters)> {
        let ws = (self.gate_up.get(e)?, self.down.get(e)?);
        let at = |p: Option<&PerExpert>| p.map(|p| p.at(e)).transpose();
        Ok((ws, (at(gu_ad)?, at(down_ad)?)))
    }

    /// hn [m, C] → Σ_j w_j · E_j(hn) [m, C]. Differentiable (the reference forward's graph).
    pub fn forward(&self, hn: &Tensor) -> Result<Tensor> {
        Ok(self.forward_routed(hn, true)?.0)
    }

    /// `forward`, with its routing; with `graph` autograd's graph reaches the adapters, else
    /// (training's forward, whose backward is `backward`) nothing is recorded.
    pub fn forward_routed(&self, hn: &Tensor, graph: bool) -> Result<(Tensor, Routing)> {
        let (dt, experts) = (hn.dtype(), self.spec.experts);
        let r = route(hn, &self.router, self.spec)?;
        let gu_ad = PerExpert::of(&self.gate_up_lora, experts, dt, graph)?;
        let down_ad = PerExpert::of(&self.down_lora, experts, dt, graph)?;
        let ads = (gu_ad.as_ref(), down_ad.as_ref());
        let xs = hn.index_select(&r.tokens, 0)?; // [m·k, C] grouped by expert
        let w = r
            .weights
            .to_dtype(dt)?
            .flatten_all()?
            .index_select(&r.order, 0)?; // [m·k]
        let y = match self.batched {
            true => {
                let pad = Padded::new(&r.counts, hn.device())?;
                let ws = (&self.gate_up, &self.down);
                let y = self.experts_fwd(&pad.pad(&xs)?, ws, ads)?.y;
                drop(xs);
                pad.unpad(&y)?
            }
            false => {
                let mut ys = Vec::with_capacity(experts);
                let mut off = 0;
                for (e, &n) in r.counts.iter().enumerate() {
                    if n > 0 {
                        let ((gu, down), (ga, da)) = self.expert(e, ads)?;
                        let x = xs.narrow(0, off, n)?;
                        let acts =
                            self.experts_fwd(&x, (&gu, &down), (ga.as_ref(), da.as_ref()))?;
                        ys.push(acts.y);
                        off += n;
                    }
                }
                // two [m·k, C] alive at a time from here (the memory plan's `moe_ws`)
                drop(xs);
                Tensor::cat(&ys, 0)?
            }
        };
        let y = y.broadcast_mul(&w.unsqueeze(1)?)?;
        Ok((sum_slots(&r, &y)?, r))
    }

    /// The backward of `forward` for g = dL/d(its output) [m, C]: dL/dhn [m, C], through the
    /// experts and the router; the experts' adapter gradients into `grads`. `aux` is the
    /// load-balancing loss's gradient on the router's probabilities ([m, E] or [1, E] f32).
    pub fn backward(
        &self,
        hn: &Tensor,
        g: &Tensor,
        aux: Option<&Tensor>,
        grads: &mut LayerGrads,
    ) -> Result<Tensor> {
        let (dt, experts) = (hn.dtype(), self.spec.experts);
        let (m, k) = (hn.dim(0)?, self.spec.top_k);
        let r = route(hn, &self.router, self.spec)?;
        let gu_ad = PerExpert::of(&self.gate_up_lora, experts, dt, false)?;
        let down_ad = PerExpert::of(&self.down_lora, experts, dt, false)?;
        let ads = (gu_ad.as_ref(), down_ad.as_ref());
        let xs = hn.index_select(&r.tokens, 0)?; // [m·k, C]
        let gs = g.contiguous()?.index_select(&r.tokens, 0)?; // [m·k, C]
        let w = r
            .weights
            .to_dtype(dt)?
            .flatten_all()?
            .index_select(&r.order, 0)?;
        let (dx, dw) = match self.batched {
            true => self.experts_bwd_batched(&r, &xs, &gs, &w, ads, grads)?,
            false => self.experts_bwd_grouped(&r, &xs, &gs, &w, ads, grads)?,
        };
        drop((xs, gs));
        let dhn = sum_slots(&r, &dx)?;
        drop(dx);
        // dL/dw in the grouped order [m·k] → slot-major [k, m] → [m, k]
        let dw = dw.to_dtype(DType::F32)?;
        let dw = dw
            .index_select(&r.slots, 0)?
            .reshape((k, m))?
            .t()?
            .contiguous()?;
        let dlogits = route_bwd(&r, &dw, self.spec.norm_topk, aux)?; // [m, E]
        dhn + dlogits.to_dtype(dt)?.matmul(&self.router)?
    }

    /// The experts' backward one GEMM per expert over the grouped rows xs, gs [m·k, C]
    /// (weights w [m·k]): (dL/dxs [m·k, C], dL/dw [m·k]); the adapters' gradients into `grads`.
    fn experts_bwd_grouped(
        &self,
        r: &Routing,
        xs: &Tensor,
        gs: &Tensor,
        w: &Tensor,
        ads: (Option<&PerExpert>, Option<&PerExpert>),
        grads: &mut LayerGrads,
    ) -> Result<(Tensor, Tensor)> {
        let experts = self.spec.experts;
        let (mut dxs, mut dws) = (Vec::new(), Vec::new());
        let mut gu_grads: Vec<Option<Grad>> = vec![None; experts];
        let mut down_grads: Vec<Option<Grad>> = vec![None; experts];
        let mut off = 0;
        for (e, &n) in r.counts.iter().enumerate() {
            if n == 0 {
                continue;
            }
            let (x, ge) = (xs.narrow(0, off, n)?, gs.narrow(0, off, n)?);
            let we = w.narrow(0, off, n)?.unsqueeze(1)?; // [n, 1]
            off += n;
            let ((gu, down), (ga, da)) = self.expert(e, ads)?;
            let (ws, ads_e) = ((&gu, &down), (ga.as_ref(), da.as_ref()));
            let acts = self.experts_fwd(&x, ws, ads_e)?;
            dws.push((&ge * &acts.y)?.sum(1)?); // dL/dw [n]
            let gy = ge.broadcast_mul(&we)?; // dL/dy_e [n, C]
            let (dx, gu_g, down_g) = self.experts_bwd(&x, &acts, &gy, ws, ads_e)?;
            (gu_grads[e], down_grads[e]) = (gu_g, down_g);
            dxs.push(dx);
        }
        for (l, per) in [
            (&self.gate_up_lora, gu_grads),
            (&self.down_lora, down_grads),
        ] {
            if let Some(l) = l {
                push_grads(grads, &l.lora, stack_grads(&l.lora, per)?)?;
            }
        }
        Ok((Tensor::cat(&dxs, 0)?, Tensor::cat(&dws, 0)?))
    }

    /// `experts_bwd_grouped` as batched GEMMs over the padded layout (model/moe_batched.rs).
    fn experts_bwd_batched(
        &self,
        r: &Routing,
        xs: &Tensor,
        gs: &Tensor,
        w: &Tensor,
        ads: (Option<&PerExpert>, Option<&PerExpert>),
        grads: &mut LayerGrads,
    ) -> Result<(Tensor, Tensor)> {
        let pad = Padded::new(&r.counts, xs.device())?;
        let x = pad.pad(xs)?;
        let ws = (&self.gate_up, &self.down);
        let acts = self.experts_fwd(&x, ws, ads)?;
        let y = pad.unpad(&acts.y)?; // [m·k, C]
        let dw = (gs * &y)?.sum(1)?; // dL/dw [m·k]
        drop(y);
        let gy = pad.pad(&gs.broadcast_mul(&w.unsqueeze(1)?)?)?; // [E, cap, C]
        let (dx, gu, down) = self.experts_bwd(&x, &acts, &gy, ws, ads)?;
        for (l, g) in [(&self.gate_up_lora, gu), (&self.down_lora, down)] {
            if let (Some(l), Some(g)) = (l, g) {
                push_grads(grads, &l.lora, g)?;
            }
        }
        Ok((pad.unpad(&dx)?, dw))
    }
}

/// Per-expert adapter gradients (None: the expert got no token, zero) stacked as one
/// parameter's (dA [E, r, in], dB [E, out, r]).
fn stack_grads(lora: &Lora, per: Vec<Option<Grad>>) -> Result<Grad> {
    let experts = per.len();
    let (er, in_f) = lora.a.dims2()?;
    let (out, r) = (lora.b.dim(0)?, er / experts.max(1));
    let dev = lora.a.device();
    let mut das = Vec::with_capacity(experts);
    let mut dbs = Vec::with_capacity(experts);
    for g in per {
        let (da, db) = match g {
            Some(g) => g,
            None => (
                Tensor::zeros((r, in_f), DType::F32, dev)?,
                Tensor::zeros((out, r), DType::F32, dev)?,
            ),
        };
        das.push(da);
        dbs.push(db);
    }
    Ok((Tensor::stack(&das, 0)?, Tensor::stack(&dbs, 0)?))
}

/// An expert adapter's gradients (dA [E, r, in], dB [E, out, r]) as PEFT lays the parameter
/// out, dA [E·r, in] and dB [out, r·E] (column j·E + e), into `grads`.
fn push_grads(grads: &mut LayerGrads, lora: &Lora, (da, db): Grad) -> Result<()> {
    let (e, r, in_f) = da.dims3()?;
    let out = db.dim(1)?;
    let da = da.reshape((e * r, in_f))?;
    let db = db.permute((1, 2, 0))?.contiguous()?.reshape((out, r * e))?;
    grads.push((lora.a.id(), da));
    grads.push((lora.b.id(), db));
    Ok(())
}

impl Layer {
    /// A MoE layer's MLP half in training: h = x + a [m, C] and, with `output`, y [m, C]
    /// (its routing counted for the load-balancing loss, where it is on).
    pub(super) fn moe_fwd(
        &self,
        moe: &Moe,
        x: &Tensor,
        a: Tensor,
        ctx: &Ctx,
        output: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let h = ops::add(x, &a)?;
        drop(a);
        let y = match output {
            true => {
                let hn = ops::rms_norm(&h, &self.post_norm, self.spec.norm)?;
                let (m, routing) = moe.forward_routed(&hn, false)?;
                if let Some(aux) = &ctx.moe_aux {
                    aux.record(&routing)?;
                }
                Some(ops::add(&h, &m)?)
            }
            false => None,
        };
        Ok((h, y))
    }

    /// Its backward from h and dL/dy [m, C]: dL/dh [m, C] (dy, the residual's share,
    /// included; the load-balancing loss's, where it is on); the experts' adapter gradients
    /// into `grads`.
    pub(super) fn moe_bwd(
        &self,
        moe: &Moe,
        h: &Tensor,
        dy: &Tensor,
        ctx: &Ctx,
        grads: &mut LayerGrads,
    ) -> Result<Tensor> {
        let s = self.spec;
        let hn = ops::rms_norm(h, &self.post_norm, s.norm)?;
        let aux = match &ctx.moe_aux {
            Some(a) => a.grad()?,
            None => None,
        };
        let dhn = moe.backward(&hn, dy, aux.as_ref(), grads)?;
        drop(hn);
        ops::rms_norm_bwd_add(h, &self.post_norm, s.norm, &dhn, dy)
    }
}
