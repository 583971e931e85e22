//! The model's weights as decoding reads them: one GEMM per group of linears that share an
//! input where they can be stacked, adapters unmerged.
//!
//! A `Proj` stands for one or more linears side by side: W [N, in] with N = Σ out_i, their
//! biases [N], and their adapters as one: the A's stacked [Σ r, in] and the B's block-diagonal
//! [N, Σ r], each B pre-multiplied by its scale, so that y = x Wᵀ + b + (x Aᵀ) B_bdᵀ is every
//! linear's W x + b + s·B·A·x (no dropout) at once: three GEMMs for the group however many
//! linears it has, instead of three per linear. The zero blocks add exact zeros.
//!
//! `Weights::new` borrows the model as it is (the training model: no copy of a base weight; a
//! folded linear's W is the view of its padded buffer's first `in` columns, which the GEMMs
//! read through its row stride). `Weights::stacked` first moves q/k/v and gate/up of a model
//! it owns into one buffer each, the model's own W's becoming row views of it (no weight is
//! held twice), so that decoding runs 4 base GEMMs a layer instead of 7.

use crate::model::layer_moe::Moe;
use crate::model::rope::Freqs;
use crate::model::{Layer, LayerSpec, Linear, Model, ModelConfig};
use crate::ops;
use crate::ops::glu::Act;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};

/// The adapters of a `Proj`, in the activation dtype.
#[derive(Clone)]
pub(crate) struct Adapter {
    /// The A's stacked: [Σ r, in].
    pub(crate) a: Tensor,
    /// The B's block-diagonal, each times its scale: [N, Σ r].
    pub(crate) b: Tensor,
}

/// One GEMM's worth of linears that share an input.
#[derive(Clone)]
pub struct Proj {
    /// [N, in]: rows may be a view (a stacked buffer's, or a padded one's first columns).
    pub(crate) w: Tensor,
    pub(crate) b: Option<Tensor>,
    pub(crate) ad: Option<Adapter>,
    /// out_i of each linear, in order (Σ = N).
    pub(crate) outs: Vec<usize>,
}

/// A one-token product the device runs faster than a GEMM: y = x Wᵀ (+ acc) (+ b) for x
/// [1, in], W [out, in] (rows may be a view's), acc [1, out], b [out]; None when it cannot
/// take the operands (the GEMM then runs).
pub(crate) trait Matvec {
    fn matvec(
        &self,
        x: &Tensor,
        w: &Tensor,
        acc: Option<&Tensor>,
        b: Option<&Tensor>,
    ) -> Result<Option<Tensor>>;

    /// For W the stacked [gate; up] [2I, in]: SwiGLU of the two products, silu(x W_gᵀ + acc_g)
    /// ⊙ (x W_uᵀ + acc_u) [1, I], rounded as the separate ops; None when it cannot.
    fn matvec_swiglu(
        &self,
        x: &Tensor,
        w: &Tensor,
        acc: Option<&Tensor>,
    ) -> Result<Option<Tensor>> {
        let _ = (x, w, acc);
        Ok(None)
    }
}

/// y = x Wᵀ (+ acc) (+ b): `mv`'s product for one row when it takes it, else the GEMM (on
/// CUDA accumulating onto acc, β = 1) and an add.
pub(crate) fn linear(
    x: &Tensor,
    w: &Tensor,
    acc: Option<&Tensor>,
    b: Option<&Tensor>,
    mv: Option<&dyn Matvec>,
) -> Result<Tensor> {
    if let (Some(mv), Ok(1)) = (mv, x.dim(0)) {
        if let Some(y) = mv.matvec(x, w, acc, b)? {
            return Ok(y);
        }
    }
    // cuBLAS's own pick: these are the prompt's GEMMs, not the one-token steps that decoding
    // spends its time in (`mv`).
    let gemm = ops::kernels::Gemm::Heuristic;
    let y = match acc {
        // acc is the adapter term just computed, held by nobody else: written in place.
        Some(acc) => ops::linear_acc::linear_acc(&x.contiguous()?, w, acc.clone(), gemm)?,
        None => ops::linear_acc::matmul_scaled(x, w, true, 1.0, gemm)?,
    };
    Ok(match b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    })
}

impl Proj {
    /// x [m, in] → [m, N].
    pub(crate) fn forward(&self, x: &Tensor, mv: Option<&dyn Matvec>) -> Result<Tensor> {
        let acc = match &self.ad {
            None => None,
            Some(ad) => {
                let xa = linear(x, &ad.a, None, None, mv)?; // [m, Σ r]
                Some(linear(&xa, &ad.b, None, None, mv)?) // [m, N]
            }
        };
        linear(x, &self.w, acc.as_ref(), self.b.as_ref(), mv)
    }

    /// x [m, in] → one [m, out_i] per linear (column views of the one product).
    pub(crate) fn forward_split(&self, x: &Tensor, mv: Option<&dyn Matvec>) -> Result<Vec<Tensor>> {
        let y = self.forward(x, mv)?;
        if self.outs.len() == 1 {
            return Ok(vec![y]);
        }
        let mut off = 0;
        let mut out = Vec::with_capacity(self.outs.len());
        for &n in &self.outs {
            out.push(y.narrow(1, off, n)?);
            off += n;
        }
        Ok(out)
    }

    /// Bytes of the base weights and biases a product reads (the view's elements only).
    pub(crate) fn weight_bytes(&self) -> usize {
        let n = self.w.elem_count() + self.b.as_ref().map_or(0, |b| b.elem_count());
        n * self.w.dtype().size_in_bytes()
    }

    /// A group of `lins` as one product: their W's given stacked in `w` (or the one linear's
    /// own), their biases and adapters joined as the module doc says.
    fn of(lins: &[&Linear], w: Tensor, dtype: DType) -> Result<Proj> {
        let outs: Vec<usize> = lins.iter().map(|l| l.out_features()).collect();
        let dev = w.device().clone();
        let b = match lins.iter().any(|l| l.b.is_some()) {
            false => None,
            true => {
                let parts: Vec<Tensor> = lins
                    .iter()
                    .zip(&outs)
                    .map(|(l, &n)| match &l.b {
                        Some(b) => b.to_dtype(dtype),
                        None => Tensor::zeros(n, dtype, &dev),
                    })
                    .collect::<candle_core::Result<_>>()?;
                Some(Tensor::cat(&parts, 0)?)
            }
        };
        Ok(Proj {
            w,
            b,
            ad: adapter(lins, &outs, dtype, &dev)?,
            outs,
        })
    }
}

/// The adapters of `lins` joined (None when none has one): A's stacked, B's block-diagonal
/// times their scales, built in f32 and cast once to `dtype`.
fn adapter(
    lins: &[&Linear],
    outs: &[usize],
    dtype: DType,
    dev: &Device,
) -> Result<Option<Adapter>> {
    let ranks: Vec<usize> = lins
        .iter()
        .map(|l| l.lora.as_ref().map_or(0, |a| a.a.dims()[0]))
        .collect();
    let total: usize = ranks.iter().sum();
    if total == 0 {
        return Ok(None);
    }
    let mut a_parts = Vec::new();
    let mut rows = Vec::with_capacity(lins.len());
    let mut col = 0;
    for ((lin, &r), &n) in lins.iter().zip(&ranks).zip(outs) {
        let Some(lora) = &lin.lora else {
            rows.push(Tensor::zeros((n, total), DType::F32, dev)?);
            continue;
        };
        a_parts.push(lora.a.as_tensor().to_dtype(DType::F32)?);
        let b = (lora.b.as_tensor().to_dtype(DType::F32)? * lora.scale)?; // [n, r]
        let mut cols = Vec::with_capacity(3);
        if col > 0 {
            cols.push(Tensor::zeros((n, col), DType::F32, dev)?);
        }
        cols.push(b);
        if col + r < total {
            cols.push(Tensor::zeros((n, total - col - r), DType::F32, dev)?);
        }
        rows.push(Tensor::cat(&cols, 1)?);
        col += r;
    }
    Ok(Some(Adapter {
        a: Tensor::cat(&a_parts, 0)?.to_dtype(dtype)?,
        b: Tensor::cat(&rows, 0)?.to_dtype(dtype)?,
    }))
}

/// A layer's MLP half as decoding runs it.
pub(crate) enum Mlp {
    /// gate, up (one product when stacked or fused in the checkpoint, else two), the
    /// family's GLU, then down.
    Dense { gate_up: Vec<Proj>, down: Proj },
    /// Qwen3-MoE's router and experts (adapters included), run as training's forward runs
    /// them: the tokens grouped by expert, one grouped product per projection.
    Moe(Box<Moe>),
}

/// One decoder layer's weights, and its shape and family settings (`LayerSpec`: norms,
/// window, score scale and soft-cap, activation, which RoPE).
pub struct LayerWeights {
    pub spec: LayerSpec,
    pub(crate) input_norm: Tensor,
    /// Before the MLP (post_attention_layernorm; Gemma's pre_feedforward_layernorm).
    pub(crate) post_norm: Tensor,
    /// QK-norm's gains [D] (Qwen3, Gemma 3): RMSNorm over each head of q and k before RoPE.
    pub(crate) q_norm: Option<Tensor>,
    pub(crate) k_norm: Option<Tensor>,
    /// Gemma's norms of the attention's and the MLP's outputs, before their residual adds.
    pub(crate) attn_out_norm: Option<Tensor>,
    pub(crate) mlp_out_norm: Option<Tensor>,
    /// gpt-oss's attention sinks [H]: a logit per head joining each softmax's denominator.
    pub(crate) sinks: Option<Tensor>,
    /// q, k, v: one product when stacked (or fused in the checkpoint), else three.
    pub qkv: Vec<Proj>,
    pub(crate) o: Proj,
    pub(crate) mlp: Mlp,
}

impl LayerWeights {
    /// x [m, C] → q [m, H·D], k, v [m, K·D].
    pub(crate) fn qkv(&self, x: &Tensor, mv: Option<&dyn Matvec>) -> Result<[Tensor; 3]> {
        split_all(&self.qkv, x, mv, "q/k/v")
    }

    /// The MLP half: x [m, C] (its input norm applied) → [m, C], before any output norm.
    pub(crate) fn mlp(&self, x: &Tensor, mv: Option<&dyn Matvec>) -> Result<Tensor> {
        match &self.mlp {
            Mlp::Dense { gate_up, down } => down.forward(&self.glu(gate_up, x, mv)?, mv),
            Mlp::Moe(moe) => Ok(moe.forward_routed(x, false)?.0),
        }
    }

    /// x [m, C] → act(gate) ⊙ up [m, I]: for SwiGLU one product and the activation in one
    /// pass where `mv` takes the stacked weight, else the products and `ops::glu`.
    fn glu(&self, gate_up: &[Proj], x: &Tensor, mv: Option<&dyn Matvec>) -> Result<Tensor> {
        if let (Some(mv), [p], Ok(1), Act::Silu) = (mv, gate_up, x.dim(0), self.spec.act) {
            if p.b.is_none() {
                let acc = match &p.ad {
                    None => None,
                    Some(ad) => {
                        let xa = linear(x, &ad.a, None, None, Some(mv))?;
                        Some(linear(&xa, &ad.b, None, None, Some(mv))?)
                    }
                };
                if let Some(a) = mv.matvec_swiglu(x, &p.w, acc.as_ref())? {
                    return Ok(a);
                }
            }
        }
        let [g, u] = split_all(gate_up, x, mv, "gate/up")?;
        Ok(self.spec.act.glu(&g, &u)?)
    }

    /// The dense products (a MoE layer's experts are not among them).
    fn projs(&self) -> impl Iterator<Item = &Proj> {
        let mlp: Vec<&Proj> = match &self.mlp {
            Mlp::Dense { gate_up, down } => gate_up.iter().chain([down]).collect(),
            Mlp::Moe(_) => Vec::new(),
        };
        self.qkv.iter().chain([&self.o]).chain(mlp)
    }

    /// The norms' gains.
    fn norms(&self) -> impl Iterator<Item = &Tensor> {
        [&self.input_norm, &self.post_norm]
            .into_iter()
            .chain(self.q_norm.iter())
            .chain(self.k_norm.iter())
            .chain(self.attn_out_norm.iter())
            .chain(self.mlp_out_norm.iter())
    }

    /// Bytes of a MoE layer's router and of the k experts one token reads.
    fn moe_bytes(&self) -> usize {
        let Mlp::Moe(m) = &self.mlp else { return 0 };
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let experts = (bytes(&m.gate_up) + bytes(&m.down)) / m.spec.experts.max(1);
        bytes(&m.router) + m.spec.top_k * experts
    }
}

/// The N outputs of the products `ps` of x, each linear's apart (`what` names them in the
/// error should the products give another count).
fn split_all<const N: usize>(
    ps: &[Proj],
    x: &Tensor,
    mv: Option<&dyn Matvec>,
    what: &str,
) -> Result<[Tensor; N]> {
    let mut out = Vec::new();
    for p in ps {
        out.extend(p.forward_split(x, mv)?);
    }
    match <[Tensor; N]>::try_from(out) {
        Ok(a) => Ok(a),
        Err(v) => bail!("{what} products gave {} outputs", v.len()),
    }
}

/// Everything decoding reads: the layers, the embedding, final norm and head, and the shape.
pub struct Weights {
    pub(crate) cfg: ModelConfig,
    /// Per decoder layer, bottom first: what decoding reads of it.
    pub layers: Vec<LayerWeights>,
    pub(crate) embed: Tensor,
    pub(crate) norm: Tensor,
    pub(crate) lm_head: Tensor,
    /// The head is the embedding.
    pub tied: bool,
    pub(crate) dtype: DType,
    pub(crate) device: Device,
    /// The global RoPE's frequencies, and the sliding layers' where they differ (Gemma 3).
    pub(crate) rope: Freqs,
    pub(crate) rope_local: Option<Freqs>,
}

impl Weights {
    /// The model's weights as they are (views; only the adapters are joined and cast).
    pub fn new(model: &Model) -> Result<Weights> {
        let layers = model
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                check_resident(l, i)?;
                let one = |lin: &Linear| Proj::of(&[lin], lin.w.clone(), model.dtype);
                let group =
                    |lins: &[Linear]| -> Result<Vec<Proj>> { lins.iter().map(one).collect() };
                layer_weights(l, group(&l.attn_in)?, group(&l.mlp_in)?, model.dtype)
            })
            .collect::<Result<_>>()?;
        Ok(Self::with_layers(model, layers))
    }

    /// `new`, with each layer's q/k/v and gate/up first moved into one buffer each (the
    /// model's linears become row views of it; folded linears are left as they are). A fused
    /// checkpoint's (Phi-3's) qkv_proj and gate_up_proj are one buffer already.
    pub fn stacked(model: &mut Model) -> Result<Weights> {
        let dtype = model.dtype;
        let mut layers = Vec::with_capacity(model.layers.len());
        for (i, l) in model.layers.iter_mut().enumerate() {
            check_resident(l, i)?;
            let group = |lins: &mut [Linear]| -> Result<Vec<Proj>> {
                let mut refs: Vec<&mut Linear> = lins.iter_mut().collect();
                let w = match refs.len() {
                    1 => None,
                    _ => stack(&mut refs)?,
                };
                let lins: Vec<&Linear> = lins.iter().collect();
                match w {
                    Some(w) => Ok(vec![Proj::of(&lins, w, dtype)?]),
                    None => lins
                        .iter()
                        .map(|lin| Proj::of(&[lin], lin.w.clone(), dtype))
                        .collect(),
                }
            };
            let qkv = group(&mut l.attn_in)?;
            let gate_up = group(&mut l.mlp_in)?;
            layers.push(layer_weights(l, qkv, gate_up, dtype)?);
        }
        Ok(Self::with_layers(model, layers))
    }

    fn with_layers(model: &Model, layers: Vec<LayerWeights>) -> Weights {
        let (rope, rope_local) = model.rope_freqs();
        Weights {
            rope: rope.clone(),
            rope_local: rope_local.cloned(),
            cfg: model.cfg.clone(),
            layers,
            embed: model.embed.clone(),
            norm: model.norm.clone(),
            lm_head: model.lm_head.clone(),
            tied: model.tied,
            dtype: model.dtype,
            device: model.device.clone(),
        }
    }

    /// Bytes of weights one decoding step reads: every linear's W (and bias), the norms and
    /// the head; of the embedding only a row (not counted), unless it is the tied head.
    pub(crate) fn bytes_per_token(&self) -> usize {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.norms().map(bytes).sum::<usize>()
                    + l.projs().map(Proj::weight_bytes).sum::<usize>()
                    + l.moe_bytes()
            })
            .sum();
        layers + bytes(&self.norm) + bytes(&self.lm_head)
    }

    /// Bytes of the adapters one step reads (A's and B's as joined).
    pub(crate) fn adapter_bytes(&self) -> usize {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        self.layers
            .iter()
            .flat_map(|l| l.projs())
            .filter_map(|p| p.ad.as_ref())
            .map(|a| bytes(&a.a) + bytes(&a.b))
            .sum()
    }
}

/// A layer's decode weights from its q/k/v and gate/up products: a fused checkpoint's one
/// qkv_proj (gate_up_proj) product is cut into its H·D, K·D, K·D (I, I) columns.
fn layer_weights(
    l: &Layer,
    mut qkv: Vec<Proj>,
    mut gate_up: Vec<Proj>,
    dtype: DType,
) -> Result<LayerWeights> {
    let s = &l.spec;
    if let [p] = qkv.as_mut_slice() {
        let (q, kv) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
        p.outs = vec![q, kv, kv];
    }
    if let [p] = gate_up.as_mut_slice() {
        let i = p.outs.iter().sum::<usize>() / 2;
        p.outs = vec![i, i];
    }
    let one = |lin: &Linear| Proj::of(&[lin], lin.w.clone(), dtype);
    let mlp = match &l.moe {
        Some(moe) => Mlp::Moe(moe.clone()),
        None => Mlp::Dense {
            gate_up,
            down: one(l.down()?)?,
        },
    };
    Ok(LayerWeights {
        spec: l.spec,
        input_norm: l.input_norm.clone(),
        post_norm: l.post_norm.clone(),
        q_norm: l.extra.q_norm.clone(),
        k_norm: l.extra.k_norm.clone(),
        attn_out_norm: l.extra.attn_out_norm.clone(),
        mlp_out_norm: l.extra.mlp_out_norm.clone(),
        sinks: l.extra.sinks.clone(),
        qkv,
        o: one(&l.o)?,
        mlp,
    })
}

/// An FSDP skeleton layer holds placeholders, not weights: decoding needs them resident.
fn check_resident(l: &Layer, i: usize) -> Result<()> {
    for lin in l.linears() {
        if lin.q.is_some() {
            bail!(
                "layer {i}: {} is in NF4 (model.quantize = \"nf4\"): generating from an NF4 base is not implemented yet; generate from the full-precision base with the adapter (`lora-train generate --adapter DIR`)",
                lin.name
            );
        }
        if lin.w.rank() != 2 || lin.w.elem_count() == 0 {
            bail!(
                "layer {i}: {} holds no resident weight (an FSDP shard's placeholder): generate on a model whose layers are whole (single or DDP), or gather them first",
                lin.name
            );
        }
    }
    Ok(())
}

/// Moves the W's of `lins` into one [Σ out, in] buffer, each W becoming its row view, and
/// returns the buffer; None (nothing moved) when one is folded or they differ in width,
/// dtype or device.
fn stack(lins: &mut [&mut Linear]) -> Result<Option<Tensor>> {
    let Some(first) = lins.first() else {
        return Ok(None);
    };
    let (in_f, dt, dev) = (first.w.dim(1)?, first.w.dtype(), first.w.device().clone());
    for l in lins.iter() {
        if l.pad.is_some()
            || l.w.dim(1)? != in_f
            || l.w.dtype() != dt
            || !l.w.device().same_device(&dev)
        {
            return Ok(None);
        }
    }
    let parts: Vec<Tensor> = lins.iter().map(|l| l.w.clone()).collect();
    let full = Tensor::cat(&parts, 0).context("stacking the weights of one layer")?;
    drop(parts);
    let mut off = 0;
    for l in lins.iter_mut() {
        let n = l.w.dim(0)?;
        l.w = full.narrow(0, off, n)?;
        off += n;
    }
    Ok(Some(full))
}
