//! A MoE layer's MLP half (Qwen3-MoE's `Qwen3MoeSparseMoeBlock`), y = h + Σ_j w_j · E_j(hn),
//! hn = rms_norm(h), over the k experts the router (model/router.rs) picks for each token:
//!
//!   E_e(x) = down_e(silu(gate_e(x)) ⊙ up_e(x)),  [gate_e; up_e] = gate_up_proj[e] [2I, C]
//!
//! The experts are frozen, in the model's dtype or in NF4 (`[model] quantize = "nf4"`:
//! `quant::ExpertsNf4`, dequantized a tile of experts at a time: model/moe_tiles.rs); LoRA may
//! adapt their fused parameters as PEFT does
//! (`family::EXPERT_PARAMS`): one adapter per parameter, A [E·r, in] and B [out, r·E], expert e's
//! A_e = A[e·r .. e·r + r] and B_e[:, j] = B[:, j·E + e], so W_e + s·B_e A_e.
//!
//! Tokens are grouped by expert (`router::Routing`): the rows routed to an expert are gathered
//! into one run, and each projection is one grouped GEMM over all the runs (ops/grouped_mm.rs:
//! on CUDA one cuBLAS call for every expert, elsewhere one GEMM per expert); the outputs,
//! scaled by their weights, are summed back onto their tokens (ops/moe_rows.rs: a gather and
//! a weighted sum over each token's k rows; no per-token loop).
//!
//! Training keeps only h (`LayerActs::h`) and the forward's grouping of the routed rows
//! (`Ctx::moe_routes`): the backward recomputes the router's probabilities and the experts'
//! forward from h just before their backward, so no [m·k, I] activation lives across layers
//! (the FLOPs of one more MLP forward), and reads no routing from the device.
//!
//! gpt-oss's experts (`spec.oss`) differ in three ways: gate and up interleave in gate_up's
//! rows (gate = the even ones, so it is one GEMM, split after), each projection adds its
//! expert's bias, and the activation is the clamped SwiGLU (ops/oss_glu.rs); its router has a
//! bias and a softmax over the top-k logits (model/router.rs).
//!
//! Shapes: m tokens, C hidden, E experts, k experts per token, P = m·k grouped rows, I an
//! expert's width, r the adapters' rank.

use super::adapter::Lora;
use super::decoder::Ctx;
use super::family::MoeSpec;
use super::layer::Layer;
use super::layer_train::LayerGrads;
use super::router::{route, route_bwd, Grouping, Routing};
use crate::ops::grouped_mm::{grouped_linear, grouped_tn};
use crate::ops::oss_glu::{deinterleave, interleave, oss_glu, oss_glu_bwd};
use crate::ops::{self, glu::Act, moe_rows};
use crate::quant::ExpertsNf4;
use candle_core::{DType, Result, Tensor};
use std::sync::Arc;

/// A LoRA adapter on one fused expert parameter, with the module path PEFT keys it by
/// (`model.layers.N.mlp.experts`, or `...experts.base_layer` for the inner of two).
#[derive(Clone)]
pub(crate) struct ExpertLora {
    pub(crate) name: String,
    /// A [E·r, in], B [out, r·E] (PEFT's layout), scale s.
    pub(crate) lora: Lora,
}

/// A MoE layer's frozen router and experts, and the experts' adapters.
#[derive(Clone)]
pub(crate) struct Moe {
    /// The router's W [E, C] (`mlp.gate.weight`).
    pub(crate) router: Tensor,
    /// [E, 2I, C]: each expert's gate rows, then its up rows (a 1-element placeholder of the
    /// dtype `nf4` dequantizes to, when quantized).
    pub(crate) gate_up: Tensor,
    /// [E, C, I] (a placeholder when quantized).
    pub(crate) down: Tensor,
    /// gpt-oss's biases: the router's [E] (`mlp.router.bias`), gate_up's [E, 2I] (its rows'
    /// order) and down's [E, C].
    pub(crate) biases: Option<OssBiases>,
    pub(crate) spec: MoeSpec,
    pub(crate) gate_up_lora: Option<ExpertLora>,
    pub(crate) down_lora: Option<ExpertLora>,
    /// The experts in NF4 (`Moe::quantize`); None: `gate_up` and `down` hold them.
    pub(crate) nf4: Option<Arc<ExpertsNf4>>,
    /// Its decoder layer's index: the key of its routing kept from forward to backward
    /// (`Ctx::moe_routes`).
    pub(crate) layer: usize,
}

/// gpt-oss's router and expert biases (frozen).
#[derive(Clone)]
pub(crate) struct OssBiases {
    /// [E]
    pub(crate) router: Tensor,
    /// [E, 2I], gate and up interleaved as gate_up's rows
    pub(crate) gate_up: Tensor,
    /// [E, C]
    pub(crate) down: Tensor,
}

/// y [P, n] + each grouped row's expert's bias (`bias` [E, n]; `counts[e]` rows of expert
/// e0 + e).
fn add_bias(y: Tensor, bias: &Tensor, (e0, counts): (usize, &[usize])) -> Result<Tensor> {
    let ids: Vec<u32> = counts
        .iter()
        .enumerate()
        .flat_map(|(e, &c)| std::iter::repeat_n(e as u32, c))
        .collect();
    let n = ids.len();
    let ids = Tensor::from_vec(ids, n, y.device())?;
    let bias = bias.narrow(0, e0, counts.len())?;
    let b = bias.to_dtype(y.dtype())?.index_select(&ids, 0)?;
    y + b
}

/// One parameter's adapter split per expert, in the activation dtype.
pub(super) struct PerExpert {
    /// [E, r, in]
    pub(super) a: Tensor,
    /// [E, out, r]
    pub(super) b: Tensor,
    pub(super) scale: f64,
}

impl PerExpert {
    /// `graph`: the adapter as its `Var`, so autograd's graph reaches it (the reference
    /// forward); else detached, for the hand-written passes: a product of a `Var` records its
    /// inputs, so the gradients would hold the routed rows and their gradients (a layer's
    /// routed activations) until the optimiser step, for every layer of the step.
    pub(super) fn of(
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
            a: a.to_dtype(dt)?.reshape((experts, r, in_f))?.contiguous()?,
            b: b.to_dtype(dt)?
                .reshape((out, r, experts))?
                .permute((2, 0, 1))?
                .contiguous()?,
            scale: l.lora.scale,
        }))
    }

    /// Experts [e0, e0 + n)'s share (views).
    pub(super) fn tile(&self, e0: usize, n: usize) -> Result<PerExpert> {
        Ok(PerExpert {
            a: self.a.narrow(0, e0, n)?,
            b: self.b.narrow(0, e0, n)?,
            scale: self.scale,
        })
    }

    /// Zero gradients (dA [n, r, in], dB [n, out, r] f32) for n experts without rows.
    pub(super) fn zero_grad(&self, n: usize) -> Result<Grad> {
        let ((_, r, in_f), (_, out, _)) = (self.a.dims3()?, self.b.dims3()?);
        let dev = self.a.device();
        Ok((
            Tensor::zeros((n, r, in_f), DType::F32, dev)?,
            Tensor::zeros((n, out, r), DType::F32, dev)?,
        ))
    }

    /// y = base + s·(x_e A_eᵀ) B_eᵀ for each expert's rows of x [P, in], from the frozen
    /// product in parts along its columns (`bases`: [P, out] whole, or gate_up's gate and up
    /// halves): (the parts of y, s·x_e A_eᵀ [P, r]).
    fn add(
        &self,
        x: &Tensor,
        bases: Vec<Tensor>,
        counts: &[usize],
    ) -> Result<(Vec<Tensor>, Tensor)> {
        let xa = grouped_linear(x, &self.a, counts, true, self.scale, None)?;
        let mut start = 0;
        let mut ys = Vec::with_capacity(bases.len());
        for base in bases {
            let len = base.dim(1)?;
            let b = self.b.narrow(1, start, len)?; // [E, len, r]
            ys.push(grouped_linear(&xa, &b, counts, true, 1.0, Some(base))?);
            start += len;
        }
        Ok((ys, xa))
    }

    /// The backward of `add` for g = dL/dy in the same parts (`gs`): acc [P, in] plus the
    /// adapter's term of dL/dx, and (dA [E, r, in], dB [E, out, r]) f32.
    fn bwd(
        &self,
        (x, xa): (&Tensor, &Tensor),
        gs: &[&Tensor],
        counts: &[usize],
        acc: Tensor,
    ) -> Result<(Tensor, Grad)> {
        let (mut gb, mut dbs, mut start) = (None, Vec::with_capacity(gs.len()), 0);
        for g in gs {
            let len = g.dim(1)?;
            let b = self.b.narrow(1, start, len)?; // [E, len, r]
            gb = Some(grouped_linear(g, &b, counts, false, 1.0, gb)?); // Σ g·B [P, r]
            dbs.push(grouped_tn(g, xa, counts, 1.0)?); // [E, len, r]
            start += len;
        }
        let Some(gb) = gb else {
            candle_core::bail!("an expert adapter's backward without a gradient");
        };
        let dx = grouped_linear(&gb, &self.a, counts, false, self.scale, Some(acc))?;
        let da = grouped_tn(&gb, x, counts, self.scale)?.to_dtype(DType::F32)?;
        let db = Tensor::cat(&dbs, 1)?.to_dtype(DType::F32)?;
        Ok((dx, (da, db)))
    }
}

/// One adapter's gradients over all experts (dA [E, r, in], dB [E, out, r]) f32.
pub(super) type Grad = (Tensor, Tensor);

/// The experts' forward over the grouped rows, what their backward takes ([P, ·]).
pub(super) struct ExpertActs {
    /// [P, I]
    pub(super) gate: Tensor,
    /// [P, I]
    pub(super) up: Tensor,
    /// [P, I] silu(gate) ⊙ up, down's input
    pub(super) a: Tensor,
    /// [P, r] gate_up's adapter state
    pub(super) xa_gu: Option<Tensor>,
    /// [P, r] down's
    pub(super) xa_down: Option<Tensor>,
}

/// The experts' adapters (`PerExpert`), gate_up's and down's.
pub(super) type Adapters<'a> = (Option<&'a PerExpert>, Option<&'a PerExpert>);

/// The experts' weights a pass reads: gate_up [t, 2I, C] and down [t, C, I] of t experts, and
/// the first of them (e0: the tile's share of gpt-oss's biases is [e0, e0 + t)).
pub(super) type Weights<'a> = (&'a Tensor, &'a Tensor, usize);

impl Moe {
    /// The frozen tensors: router, then gate_up and down, or their NF4 arrays
    /// (`ExpertsNf4::arrays`) when quantized (their placeholders are not among them), then
    /// gpt-oss's biases (router's, gate_up's, down's).
    pub(crate) fn frozen(&self) -> Vec<&Tensor> {
        let mut v = vec![&self.router];
        match &self.nf4 {
            Some(q) => v.extend(q.arrays()),
            None => v.extend([&self.gate_up, &self.down]),
        }
        if let Some(b) = &self.biases {
            v.extend([&b.router, &b.gate_up, &b.down]);
        }
        v
    }

    /// `frozen`, mutable (the same order); the NF4 experts are unshared first (a clone of
    /// handles), so that a gathered layer's views do not reach the skeleton's.
    pub(crate) fn frozen_mut(&mut self) -> Vec<&mut Tensor> {
        let mut v = vec![&mut self.router];
        match &mut self.nf4 {
            Some(q) => v.extend(Arc::make_mut(q).arrays_mut()),
            None => v.extend([&mut self.gate_up, &mut self.down]),
        }
        if let Some(b) = &mut self.biases {
            v.extend([&mut b.router, &mut b.gate_up, &mut b.down]);
        }
        v
    }

    /// The router, gate_up and down as held (placeholders when the experts are NF4).
    pub(crate) fn stored(&self) -> [&Tensor; 3] {
        [&self.router, &self.gate_up, &self.down]
    }

    /// Quantizes the experts to NF4 (`ExpertsNf4::quantize`), leaving 1-element placeholders
    /// of their dtype, so the full copies are freed as the layer loads.
    pub(crate) fn quantize(&mut self, double_quant: bool) -> Result<()> {
        if self.nf4.is_some() {
            return Ok(());
        }
        let q = ExpertsNf4::quantize(&self.gate_up, &self.down, double_quant)?;
        let (dt, dev) = (self.gate_up.dtype(), self.gate_up.device().clone());
        self.gate_up = Tensor::zeros(1, dt, &dev)?;
        self.down = Tensor::zeros(1, dt, &dev)?;
        self.nf4 = Some(Arc::new(q));
        Ok(())
    }

    /// Bytes of the NF4 experts (0 when not quantized).
    pub(crate) fn nf4_bytes(&self) -> usize {
        self.nf4.as_ref().map_or(0, |q| q.bytes())
    }

    /// The router's bias (gpt-oss).
    fn router_bias(&self) -> Option<&Tensor> {
        self.biases.as_ref().map(|b| &b.router)
    }

    /// gate and up [P, I] each from the grouped rows x [P, C] and gate_up's weights [t, 2I, C]
    /// of experts [e0, e0 + t) (gate_up's adapter applied, its state returned): Qwen3-MoE's
    /// halves as two GEMMs, or gpt-oss's interleaved rows as one with its bias, split after.
    fn gate_up_fwd(
        &self,
        (gate_up, e0): (&Tensor, usize),
        x: &Tensor,
        counts: &[usize],
        gu_ad: Option<&PerExpert>,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let parts = match &self.biases {
            Some(b) => {
                let gu = grouped_linear(x, gate_up, counts, true, 1.0, None)?; // [P, 2I]
                vec![add_bias(gu, &b.gate_up, (e0, counts))?]
            }
            None => {
                let mut parts = Vec::with_capacity(2); // gate, up [P, I]
                for w in &self.gate_up_halves(gate_up)? {
                    parts.push(grouped_linear(x, w, counts, true, 1.0, None)?);
                }
                parts
            }
        };
        let (parts, xa) = match gu_ad {
            Some(p) => {
                let (ys, xa) = p.add(x, parts, counts)?;
                (ys, Some(xa))
            }
            None => (parts, None),
        };
        match self.biases {
            Some(_) => {
                let [gu] = parts_of::<1>(parts)?;
                let (gate, up) = deinterleave(&gu)?;
                Ok((gate, up, xa))
            }
            None => {
                let [gate, up] = parts_of::<2>(parts)?;
                Ok((gate, up, xa))
            }
        }
    }

    /// The experts' activation of gate and up [P, I]: SiLU's GLU, or gpt-oss's clamped one.
    fn act(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        match self.spec.oss {
            Some(o) => oss_glu(gate, up, o.alpha, o.limit),
            None => Act::Silu.glu(gate, up),
        }
    }

    /// The experts' adapters with their PEFT module paths (gate_up's, then down's).
    pub(crate) fn adapters(&self) -> impl Iterator<Item = (&str, &Lora)> {
        [&self.gate_up_lora, &self.down_lora]
            .into_iter()
            .flatten()
            .map(|l| (l.name.as_str(), &l.lora))
    }

    /// gate_up's gate and up halves [t, I, C] (views: each expert's rows lie contiguous).
    fn gate_up_halves(&self, gate_up: &Tensor) -> Result<[Tensor; 2]> {
        let i = self.spec.inter;
        Ok([gate_up.narrow(1, 0, i)?, gate_up.narrow(1, i, i)?])
    }

    /// The experts' forward over the grouped rows x [P, C] (`counts[e]` rows of expert e of
    /// the experts `w` holds): y [P, C] before the routing weights, and what the backward
    /// takes.
    pub(super) fn experts_fwd(
        &self,
        (gate_up, down, e0): Weights,
        x: &Tensor,
        counts: &[usize],
        (gu_ad, down_ad): Adapters,
    ) -> Result<(Tensor, ExpertActs)> {
        let (gate, up, xa_gu) = self.gate_up_fwd((gate_up, e0), x, counts, gu_ad)?;
        let a = self.act(&gate, &up)?;
        let y = grouped_linear(&a, down, counts, true, 1.0, None)?; // [P, C]
        let y = match &self.biases {
            Some(b) => add_bias(y, &b.down, (e0, counts))?,
            None => y,
        };
        let (y, xa_down) = match down_ad {
            Some(p) => {
                let (ys, xa) = p.add(&a, vec![y], counts)?;
                let [y] = parts_of::<1>(ys)?;
                (y, Some(xa))
            }
            None => (y, None),
        };
        let acts = ExpertActs {
            gate,
            up,
            a,
            xa_gu,
            xa_down,
        };
        Ok((y, acts))
    }

    /// The backward of `experts_fwd` (the same adapters) for gy = dL/dy [P, C] (the routing
    /// weights applied): dL/dx [P, C], and the adapters' (dA, dB) f32, gate_up's then down's.
    #[allow(clippy::type_complexity)]
    pub(super) fn experts_bwd(
        &self,
        (gate_up, down, _): Weights,
        (x, acts): (&Tensor, ExpertActs),
        gy: &Tensor,
        counts: &[usize],
        (gu_ad, down_ad): Adapters,
    ) -> Result<(Tensor, Option<Grad>, Option<Grad>)> {
        let da = grouped_linear(gy, down, counts, false, 1.0, None)?; // [P, I]
        let (da, down_grads) = match (down_ad, &acts.xa_down) {
            (Some(p), Some(xa)) => {
                let (da, gr) = p.bwd((&acts.a, xa), &[gy], counts, da)?;
                (da, Some(gr))
            }
            _ => (da, None),
        };
        let (dgate, dup) = match self.spec.oss {
            Some(o) => oss_glu_bwd(&acts.gate, &acts.up, &da, o.alpha, o.limit)?,
            None => Act::Silu.glu_bwd(&acts.gate, &acts.up, &da)?, // [P, I] each
        };
        drop((da, acts.gate, acts.up, acts.a));
        // gate_up's gradient in the parts its forward made: the halves, or interleaved rows
        let gs = match self.biases {
            Some(_) => vec![interleave(&dgate, &dup)?], // [P, 2I]
            None => vec![dgate, dup],
        };
        let dx = match gs.as_slice() {
            [dgu] => grouped_linear(dgu, gate_up, counts, false, 1.0, None)?,
            [dg, du] => {
                let [wg, wu] = self.gate_up_halves(gate_up)?;
                let dx = grouped_linear(dg, &wg, counts, false, 1.0, None)?; // [P, C]
                grouped_linear(du, &wu, counts, false, 1.0, Some(dx))?
            }
            _ => candle_core::bail!("gate_up's gradient in {} parts", gs.len()),
        };
        let (dx, gu_grads) = match (gu_ad, &acts.xa_gu) {
            (Some(p), Some(xa)) => {
                let gs: Vec<&Tensor> = gs.iter().collect();
                let (dx, gr) = p.bwd((x, xa), &gs, counts, dx)?;
                (dx, Some(gr))
            }
            _ => (dx, None),
        };
        Ok((dx, gu_grads, down_grads))
    }

    /// hn [m, C] → Σ_j w_j · E_j(hn) [m, C]. Differentiable (the reference forward's graph).
    pub(crate) fn forward(&self, hn: &Tensor) -> Result<Tensor> {
        Ok(self.forward_routed(hn, true)?.0)
    }

    /// `forward`, with its routing; with `graph` autograd's graph reaches the adapters, else
    /// (training's forward, whose backward is `backward`) nothing is recorded.
    pub(crate) fn forward_routed(&self, hn: &Tensor, graph: bool) -> Result<(Tensor, Routing)> {
        let (dt, experts) = (hn.dtype(), self.spec.experts);
        let r = route(hn, &self.router, self.router_bias(), self.spec, None)?;
        let gu_ad = PerExpert::of(&self.gate_up_lora, experts, dt, graph)?;
        let down_ad = PerExpert::of(&self.down_lora, experts, dt, graph)?;
        let ads = (gu_ad.as_ref(), down_ad.as_ref());
        // The routed rows [P, C] grouped by expert, and their weights [P] f32. With `graph`
        // the adapters' Vars reach y through the grouped ops' candle path.
        let xs = moe_rows::gather(hn, &r.tokens)?;
        let w = r.weights.flatten_all()?.index_select(&r.order, 0)?;
        let y = self.experts_y(&xs, &r.counts, ads, graph)?;
        drop(xs);
        Ok((
            moe_rows::combine(&y, &r.slots, Some(&w), self.spec.top_k)?,
            r,
        ))
    }

    /// The backward of `forward` for g = dL/d(its output) [m, C]: dL/dhn [m, C], through the
    /// experts and the router; the experts' adapter gradients into `grads`. `aux` is the
    /// load-balancing loss's gradient on the router's probabilities ([m, E] or [1, E] f32);
    /// `kept`, the forward's grouping of the same hn (None: routed again, a read of the
    /// device).
    pub(crate) fn backward(
        &self,
        hn: &Tensor,
        g: &Tensor,
        (aux, kept): (Option<&Tensor>, Option<Grouping>),
        grads: &mut LayerGrads,
    ) -> Result<Tensor> {
        let (dt, experts) = (hn.dtype(), self.spec.experts);
        let (m, k) = (hn.dim(0)?, self.spec.top_k);
        let r = route(hn, &self.router, self.router_bias(), self.spec, kept)?;
        let gu_ad = PerExpert::of(&self.gate_up_lora, experts, dt, false)?;
        let down_ad = PerExpert::of(&self.down_lora, experts, dt, false)?;
        let ads = (gu_ad.as_ref(), down_ad.as_ref());
        let xs = moe_rows::gather(hn, &r.tokens)?; // [P, C]
        let w = r.weights.flatten_all()?.index_select(&r.order, 0)?; // [P] f32
                                                                     // dL/dx [P, C] and dL/dw [P] f32 (model/moe_tiles.rs)
        let (dx, dw, gu, down) = self.experts_grad(&xs, (g, &r.tokens, &w), &r.counts, ads)?;
        drop(xs);
        for (l, g) in [(&self.gate_up_lora, gu), (&self.down_lora, down)] {
            if let (Some(l), Some(g)) = (l, g) {
                push_grads(grads, &l.lora, g)?;
            }
        }
        let dhn = moe_rows::combine(&dx, &r.slots, None, k)?;
        drop(dx);
        // dL/dw in the grouped order [P] → slot-major [k, m] → [m, k]
        let dw = dw
            .index_select(&r.slots, 0)?
            .reshape((k, m))?
            .t()?
            .contiguous()?;
        let dlogits = route_bwd(&r, &dw, self.spec.norm_topk, aux)?; // [m, E]
        dhn + dlogits.to_dtype(dt)?.matmul(&self.router)?
    }
}

/// `PerExpert::add`'s outputs, as many as the parts it was given.
fn parts_of<const N: usize>(parts: Vec<Tensor>) -> Result<[Tensor; N]> {
    let n = parts.len();
    parts
        .try_into()
        .map_err(|_| candle_core::Error::Msg(format!("{n} parts where {N} were made")))
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
                if let Some(store) = &ctx.moe_routes {
                    store.keep(moe.layer, routing.grouping());
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
        let kept = ctx.moe_routes.as_ref().and_then(|s| s.take(moe.layer));
        let dhn = moe.backward(&hn, dy, (aux.as_ref(), kept), grads)?;
        drop(hn);
        ops::rms_norm_bwd_add(h, &self.post_norm, s.norm, &dhn, dy)
    }
}
