//! One decoder layer's training forward and its hand-written backward.
//!
//! Autograd keeps every intermediate of a layer alive until its backward (0.88 GiB per layer at
//! the Llama-2-7B shape, micro-batch 2 × 2048 tokens) and sums gradients with extra passes.
//! Here forward keeps what backward cannot cheaply recompute, and backward recomputes the rest
//! with elementwise passes:
//!
//!   kept: x, q, k, v (after RoPE), attn (o_proj's input), lse, gate, up, and each adapter's
//!         s·(m⊙x)Aᵀ [m, r]; with QK-norm q and k as projected instead (backward normalises
//!         and rotates them again: two elementwise passes, no more memory); with Gemma's
//!         output norms their inputs, o_proj's and down_proj's outputs [m, C] each
//!   recomputed: rms_norm(x), the MLP's activation, dropout masks (keyed)
//!   the residual h = x + o_proj(attn) [m, C]: `LayerActs::h`. The driver takes it out and
//!         either parks it in host memory until the layer's backward (train/offload.rs; kept
//!         on the device it would cost 1 GiB over 32 layers at 7B, micro-batch 2 × 2048) or
//!         drops it; without it backward recomputes it from o_proj's kept adapter state, one
//!         GEMM of the layer's seven (or, with Gemma's output norm, from o_proj's kept output)
//!   gate and up [m, I] each: with the MLP half checkpointed the driver may take them out
//!         (`LayerActs::take_gate_up`) and park them in host memory instead of recomputing them
//!
//! The adapters' forward of q, k, v, gate, up and down runs inside their frozen GEMMs where
//! the model is folded (ops::fold): RMSNorm and SwiGLU then write padded rows.
//!
//! That is 5 + 2·I/C tensors of [B, T, C] (k, v smaller under GQA): 0.33 GiB per layer at 7B.
//! `Layer::forward` (autograd) stays the reference; tests pin this pair to it.
//!
//! Shapes: B batch, T tokens, m = B·T, C hidden, H heads, K kv heads, D head dim, I mlp.

use super::decoder::Ctx;
use super::layer::{repeat_kv, Layer};
use super::layer_mlp::{MlpActs, MlpIn};
use super::linear::{AdapterGrad, Linear};
use crate::ops;
use candle_core::{DType, Result, Tensor, TensorId};

/// q and k as the forward keeps them.
enum Qk {
    /// After RoPE: [B, H, T, D], [B, K, T, D].
    Roped(Tensor, Tensor),
    /// QK-norm: as projected, [m, H·D] and [m, K·D] (normalised and rotated again in backward).
    Rows(Tensor, Tensor),
}

/// What a layer's training forward keeps for its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retain {
    /// Nothing: backward recomputes the layer from its input (activation checkpointing).
    Nothing,
    /// The attention half's activations and the residual h: backward recomputes the MLP half
    /// from h (`train.activation_checkpointing = "mlp"`; model/layer_mlp.rs).
    Attention,
    /// Everything backward needs.
    All,
}

/// What a layer's forward leaves for its backward.
pub struct LayerActs {
    /// [m, C] the layer input
    x: Tensor,
    qk: Qk,
    /// [m, K·D] token-major rows, as v_proj made it
    v: Tensor,
    /// [m, H·D] attention output, o_proj's input
    attn: Tensor,
    /// [B, H, T] f32
    lse: Tensor,
    /// [m, C] o_proj's output, before Gemma's norm on it
    ao: Option<Tensor>,
    /// The MLP half's; None where backward recomputes it chunk by chunk from h
    /// (model/layer_mlp.rs).
    mlp: Option<MlpActs>,
    /// [m, C] the residual h; recomputed when None
    h: Option<Tensor>,
    /// Per attention linear (q, k, v or qkv, then o): the adapter's s·(m⊙x)Aᵀ [m, r].
    xas: Vec<Option<Tensor>>,
}

/// What the attention half's forward makes: `LayerActs`' attention fields, o_proj's output
/// as the residual adds it (`ao`, [m, C]) and, under Gemma's norm on it, as projected
/// (`ao_kept`).
struct AttnHalf {
    qk: Qk,
    v: Tensor,
    attn: Tensor,
    lse: Tensor,
    ao_kept: Option<Tensor>,
    ao: Tensor,
    xas: Vec<Option<Tensor>>,
}

impl LayerActs {
    /// Bytes held (what the memory plan counts per layer).
    pub fn bytes(&self) -> usize {
        let (q, k) = match &self.qk {
            Qk::Roped(q, k) | Qk::Rows(q, k) => (q, k),
        };
        let t = [&self.x, q, k, &self.v, &self.attn, &self.lse];
        t.into_iter()
            .chain(self.xas.iter().flatten())
            .chain(&self.h)
            .chain(&self.ao)
            .chain(self.mlp.iter().flat_map(MlpActs::tensors))
            .map(|t| crate::ops::tensor_bytes(t) as usize)
            .sum()
    }

    /// The residual h [m, C] out of the activations (backward then recomputes it, or it is
    /// put back with `put_h`). A layer whose MLP backward runs in chunks keeps its h.
    pub(crate) fn take_h(&mut self) -> Option<Tensor> {
        match self.parks_h() {
            true => self.h.take(),
            false => None,
        }
    }

    /// Whether `take_h` gives the residual up: not a layer whose MLP backward runs in chunks
    /// or a MoE layer's, which read it (model/layer_mlp.rs, model/layer_moe.rs).
    pub(crate) fn parks_h(&self) -> bool {
        self.mlp.is_some()
    }

    /// Puts back what `take_h` took (the same values).
    pub(crate) fn put_h(&mut self, h: Tensor) {
        self.h = Some(h);
    }

    /// The MLP's gate and up [m, I] each out of the activations, to be parked until the
    /// layer's backward (`put_gate_up` puts them back). None where the MLP half was not kept.
    pub(crate) fn take_gate_up(&mut self) -> Option<Vec<Tensor>> {
        let pair = self.mlp.as_mut()?.take_gate_up()?;
        Some(pair.into())
    }

    /// Puts back what `take_gate_up` took (the same values).
    pub(crate) fn put_gate_up(&mut self, gate_up: Vec<Tensor>) -> Result<()> {
        let (Some(mlp), Ok(pair)) = (self.mlp.as_mut(), <[Tensor; 2]>::try_from(gate_up)) else {
            candle_core::bail!("backward: gate and up put back into a layer without them");
        };
        mlp.put_gate_up(pair);
        Ok(())
    }
}

/// A layer's adapter gradients: (var, dL/dvar f32).
pub type LayerGrads = Vec<(TensorId, Tensor)>;

impl Layer {
    /// x: [B, T, C] → y [B, T, C], and with `keep` what `backward` needs. No graph is built.
    /// Same values as `forward`.
    pub fn forward_train(
        &self,
        x: &Tensor,
        ctx: &Ctx,
        keep: bool,
    ) -> Result<(Tensor, Option<LayerActs>)> {
        let keep = match keep {
            true => Retain::All,
            false => Retain::Nothing,
        };
        self.forward_retain(x, ctx, keep)
    }

    /// `forward_train` keeping what `keep` says (the activations: None for `Nothing`).
    pub fn forward_retain(
        &self,
        x: &Tensor,
        ctx: &Ctx,
        keep: Retain,
    ) -> Result<(Tensor, Option<LayerActs>)> {
        match self.run(x, ctx, true, keep)? {
            (Some(y), acts) => Ok((y, acts)),
            (None, _) => candle_core::bail!("forward_train: no output"),
        }
    }

    /// Whether the MLP half over `m` tokens runs whole (dense, not in chunks): what
    /// `Retain::All` keeps of it is then gate and up over all m tokens, which the driver may
    /// park in host memory.
    pub(crate) fn mlp_runs_whole(&self, ctx: &Ctx, m: usize) -> bool {
        self.moe.is_none() && self.mlp_chunk(ctx, m).is_none()
    }

    /// What `backward` needs of a checkpointed layer, recomputed from its input x [B, T, C]:
    /// `forward_train`'s activations without its output, so down_proj's GEMM and the last
    /// residual are skipped (down's adapter state is all backward uses of them; not with
    /// Gemma's norm on down's output, whose backward takes that output).
    pub(crate) fn recompute(&self, x: &Tensor, ctx: &Ctx) -> Result<LayerActs> {
        match self.run(x, ctx, false, Retain::All)? {
            (_, Some(acts)) => Ok(acts),
            (_, None) => candle_core::bail!("recompute: no activations"),
        }
    }

    /// rows [m, n·D] normalised over each head's D with gain `w` [D].
    fn norm_heads(&self, rows: &Tensor, w: &Tensor) -> Result<Tensor> {
        let (m, nd) = rows.dims2()?;
        let d = self.spec.head_dim;
        ops::rms_norm(&rows.reshape((m * nd / d, d))?, w, self.spec.norm)?.reshape((m, nd))
    }

    /// `norm_heads`'s backward: dL/d(rows) from the rows and g = dL/d(its output), [m, n·D].
    fn norm_heads_bwd(&self, rows: &Tensor, w: &Tensor, g: &Tensor) -> Result<Tensor> {
        let (m, nd) = rows.dims2()?;
        let d = self.spec.head_dim;
        let r = (m * nd / d, d);
        ops::rms_norm_bwd(&rows.reshape(r)?, w, self.spec.norm, &g.reshape(r)?)?.reshape((m, nd))
    }

    /// q and k as attention takes them ([B, n, T, D] after QK-norm and RoPE) from the rows the
    /// projections made ([m, n·D]).
    fn qk_heads(&self, q: &Tensor, k: &Tensor, ctx: &Ctx) -> Result<(Tensor, Tensor)> {
        let s = &self.spec;
        let (cos, sin) = ctx.rope(s.local_rope);
        let rope = |rows: &Tensor, norm: &Option<Tensor>, n: usize| match norm {
            Some(w) => ops::rope_heads(&self.norm_heads(rows, w)?, cos, sin, n),
            None => ops::rope_heads(rows, cos, sin, n),
        };
        Ok((
            rope(q, &self.extra.q_norm, s.heads)?,
            rope(k, &self.extra.k_norm, s.kv_heads)?,
        ))
    }

    /// The forward: y when `output`, the activations `retain` says.
    fn run(
        &self,
        x: &Tensor,
        ctx: &Ctx,
        output: bool,
        retain: Retain,
    ) -> Result<(Option<Tensor>, Option<LayerActs>)> {
        let keep = retain != Retain::Nothing;
        let (b, t, c) = x.dims3()?;
        let x = x.reshape((b * t, c))?; // [m, C]
        let a = self.attention_fwd(&x, b, t, ctx)?;
        // The MLP half, whole; or, in a checkpointed layer over many tokens, in chunks
        // (model/layer_mlp.rs): the forward's over chunks, a recompute's not at all (backward
        // runs it chunk by chunk). Keeping the attention half only, its activations are not
        // kept (backward recomputes them from h, whole or by chunks).
        let m = b * t;
        let chunk = match output && retain == Retain::All {
            true => None,
            false => self.mlp_chunk(ctx, m),
        };
        let keep_mlp = keep && retain != Retain::Attention;
        let (hres, y, mlp) = match (&self.moe, chunk) {
            // a MoE layer's backward recomputes its MLP half from h (model/layer_moe.rs)
            (Some(moe), _) => {
                let (hres, y) = self.moe_fwd(moe, &x, a.ao, ctx, output)?;
                (hres, y, None)
            }
            (None, None) => self.mlp_fwd(MlpIn::Sum(&x, a.ao), ctx, output, keep_mlp)?,
            (None, Some(n)) => {
                let hres = ops::add(&x, &a.ao)?;
                drop(a.ao);
                let y = match output {
                    true => Some(self.mlp_fwd_chunked(&hres, ctx, n)?),
                    false => None,
                };
                (hres, y, None)
            }
        };
        let y = y.map(|y| y.reshape((b, t, c))).transpose()?;
        let acts = keep.then_some(LayerActs {
            x,
            qk: a.qk,
            v: a.v,
            attn: a.attn,
            lse: a.lse,
            ao: a.ao_kept,
            mlp,
            h: Some(hres),
            xas: a.xas,
        });
        Ok((y, acts))
    }

    /// The attention half over x [m, C] (m = B·T): the q, k, v projections (their adapters'
    /// x Aᵀ as one GEMM, their forward folded into the base GEMMs (ops::fold) when the norm
    /// writes padded rows), attention, o_proj and Gemma's norm on its output.
    fn attention_fwd(&self, x: &Tensor, b: usize, t: usize, ctx: &Ctx) -> Result<AttnHalf> {
        let s = self.spec;
        let qkv: Vec<&Linear> = self.attn_in.iter().collect();
        let folded = match Linear::fold_width(&qkv, ctx) {
            Some(p) => ops::fold::rms_norm_pad(x, &self.input_norm, s.norm, p)?,
            None => None,
        }; // [m, C + pad]
        let (ys, mut xas): (Vec<Tensor>, Vec<Option<Tensor>>) = match folded {
            // Phi-3's fused qkv_proj made as three parts: no copies out of one output
            Some(xp) => Linear::fwd_folded_parts(&qkv, &xp, &self.qkv_cuts(), ctx)?,
            None => {
                let hn = ops::rms_norm(x, &self.input_norm, s.norm)?;
                Linear::fwd_shared(&qkv, &hn, ctx)?.into_iter().unzip()
            }
        };
        let [q_rows, k_rows, v] = self.split_qkv(ys, 1)?;
        // (A shadowed binding would live to the end of the function: every dead tensor here is
        // dropped by name, so that the layer's peak is what the memory plan counts.)
        let (q, kk) = self.qk_heads(&q_rows, &k_rows, ctx)?; // [B, H, T, D], [B, K, T, D]
        let qk = match self.extra.q_norm.is_some() || self.extra.k_norm.is_some() {
            true => Qk::Rows(q_rows, k_rows),
            false => {
                drop((q_rows, k_rows));
                Qk::Roped(q.clone(), kk.clone())
            }
        };
        let (attn, lse) = self.attend(q, kk, &v, b, t, ctx)?;
        let (ao, xo) = self.o.fwd(&attn, ctx)?;
        xas.push(xo);
        // Gemma: h = x + norm(o's output), the norm's input kept for its backward
        let (ao_kept, ao) = match &self.extra.attn_out_norm {
            Some(w) => {
                let n = ops::rms_norm(&ao, w, s.norm)?;
                (Some(ao), n)
            }
            None => (None, ao),
        };
        Ok(AttnHalf {
            qk,
            v,
            attn,
            lse,
            ao_kept,
            ao,
            xas,
        })
    }

    /// Attention of q [B, H, T, D] over k [B, K, T, D] and v's rows [m, K·D]: the output as
    /// rows [m, H·D] and the log-sum-exp [B, H, T] f32. q and k are consumed (freed here).
    fn attend(
        &self,
        q: Tensor,
        kk: Tensor,
        v: &Tensor,
        b: usize,
        t: usize,
        ctx: &Ctx,
    ) -> Result<(Tensor, Tensor)> {
        let s = self.spec;
        let (h, k) = (s.heads, s.kv_heads);
        let (mask, scale) = (self.mask(ctx), s.scale);
        if ctx.kernels.attention.tensor_cores() {
            // Tensor cores; v is read in place from its rows and O written as rows.
            let kernels = ctx.kernels.attention;
            return ops::flash::flash_fwd(&q, &kk, &heads(v, b, t, k)?, &mask, scale, kernels);
        }
        let vh = ops::to_heads(v, b, t, k)?; // [B, K, T, D]
        let (o, lse) = ops::attention::attention_fwd(
            &q,
            &repeat_kv(&kk, h / k)?,
            &repeat_kv(&vh, h / k)?,
            &mask,
            scale,
            ctx.attn_block,
        )?; // [B, H, T, D], [B, H, T]
        Ok((ops::to_rows(&o)?, lse)) // [m, H·D]
    }

    /// Given dL/dy [B, T, C] and the forward's `acts`: dL/dx [B, T, C] and the adapters'
    /// gradients. Each kept tensor is dropped as soon as its last use is done.
    pub fn backward(
        &self,
        acts: LayerActs,
        dy: &Tensor,
        ctx: &Ctx,
    ) -> Result<(Tensor, LayerGrads)> {
        match self.backward_to(acts, dy, ctx, true)? {
            (Some(dx), grads) => Ok((dx, grads)),
            (None, _) => candle_core::bail!("backward: no dL/dx"),
        }
    }

    /// `backward`'s adapter gradients alone, for the first layer: its input, the frozen
    /// embedding's output, needs no gradient, so q's, k's and v's dL/dx GEMMs and the input
    /// norm's backward are not run. Same gradients.
    pub fn backward_grads(&self, acts: LayerActs, dy: &Tensor, ctx: &Ctx) -> Result<LayerGrads> {
        Ok(self.backward_to(acts, dy, ctx, false)?.1)
    }

    /// The backward, with dL/dx when `input_grad`: the MLP half, then attention, then the
    /// input projections and their norm.
    fn backward_to(
        &self,
        mut acts: LayerActs,
        dy: &Tensor,
        ctx: &Ctx,
        input_grad: bool,
    ) -> Result<(Option<Tensor>, LayerGrads)> {
        let (b, t, c) = dy.dims3()?;
        let na = self.attn_in.len();
        if acts.xas.len() != na + 1 {
            candle_core::bail!(
                "backward: {} adapter states for {} attention linears",
                acts.xas.len(),
                na + 1
            );
        }
        let dy = dy.to_dtype(acts.x.dtype())?.reshape((b * t, c))?; // [m, C]
        let mut grads = LayerGrads::new();
        // ---- MLP: y = h + N_mo(down(act(gate(hn), up(hn)))), hn = rms_norm(h)
        let dh = self.mlp_half_bwd(&mut acts, &dy, ctx, &mut grads)?; // [m, C]
        drop(dy);
        // ---- attention: h = x + N_ao(o(attn)), attn = softmax(q kᵀ) v
        let (x, xa, dqkv) = self.attention_bwd(acts, &dh, ctx, &mut grads)?;
        // ---- q, k, v = proj(rms_norm(x)); dL/dx = the norm's backward + dL/dh
        let dh = input_grad.then_some(&dh);
        let dx = self.input_bwd(&x, &xa, dqkv, dh, ctx, &mut grads)?;
        Ok((dx.map(|dx| dx.reshape((b, t, c))).transpose()?, grads))
    }

    /// The MLP half's backward: dL/dh [m, C] from dy [m, C], the MLP's kept activations (and
    /// the residual) taken out of `acts`; the rest of `acts` stays for attention's backward.
    fn mlp_half_bwd(
        &self,
        acts: &mut LayerActs,
        dy: &Tensor,
        ctx: &Ctx,
        grads: &mut LayerGrads,
    ) -> Result<Tensor> {
        let s = self.spec;
        let (mlp, residual) = (acts.mlp.take(), acts.h.take());
        let (x, attn, ao) = (&acts.x, &acts.attn, &acts.ao);
        let xo = acts.xas.last().and_then(Option::as_ref); // o's adapter state
        match mlp {
            // rows r..r+n [n, C] of the residual as forward made it, kept or recomputed from
            // o's kept adapter state (or, with Gemma's norm on o's output, that output), and
            // of its norm (add_rms_norm's values are those of add, then rms_norm)
            Some(mlp) => self.mlp_bwd(mlp, dy, ctx, grads, |r, n| match &residual {
                Some(h) => {
                    let h = h.narrow(0, r, n)?;
                    let hn = ops::rms_norm(&h, &self.post_norm, s.norm)?;
                    Ok((h, hn))
                }
                None => {
                    let rows = |t: &Tensor| t.narrow(0, r, n);
                    let a = match (&self.extra.attn_out_norm, ao) {
                        (Some(w), Some(ao)) => ops::rms_norm(&rows(ao)?, w, s.norm)?,
                        _ => {
                            let xo = xo.map(rows).transpose()?;
                            self.o.fwd_again(&rows(attn)?, xo.as_ref(), ctx)?
                        }
                    };
                    ops::add_rms_norm(&rows(x)?, &a, &self.post_norm, s.norm)
                }
            }),
            None if self.moe.is_some() => {
                let (Some(moe), Some(h)) = (&self.moe, residual) else {
                    candle_core::bail!("backward: a MoE layer without its residual");
                };
                self.moe_bwd(moe, &h, dy, ctx, grads)
            }
            None => {
                let Some(h) = residual else {
                    candle_core::bail!("backward: a recomputed MLP half without its residual");
                };
                let m = dy.dim(0)?;
                let n = self.mlp_chunk(ctx, m).unwrap_or(m);
                self.mlp_bwd_chunked(&h, dy, ctx, n, grads)
            }
        }
    }

    /// Attention's backward from dL/dh [m, C]: o_proj's, the attention's and QK-norm's, o's
    /// adapter gradients into `grads`. Gives back what the input projections' backward reads:
    /// x [m, C], q's, k's and v's adapter states, and dL/dq, dL/dk, dL/dv as projected
    /// ([m, H·D], [m, K·D], [m, K·D]). Each of `acts`' tensors is dropped after its last use.
    fn attention_bwd(
        &self,
        acts: LayerActs,
        dh: &Tensor,
        ctx: &Ctx,
        grads: &mut LayerGrads,
    ) -> Result<(Tensor, Vec<Option<Tensor>>, [Tensor; 3])> {
        let s = self.spec;
        let (h, k, d) = (s.heads, s.kv_heads, s.head_dim);
        let LayerActs {
            x,
            qk,
            v,
            attn,
            lse,
            ao,
            mut xas,
            ..
        } = acts;
        let (b, _, t) = lse.dims3()?;
        let xo = xas.pop().flatten(); // o's; the rest are q's, k's and v's (or qkv's)
        let dao = match (&self.extra.attn_out_norm, ao) {
            (Some(w), Some(ao)) => ops::rms_norm_bwd(&ao, w, s.norm, dh)?,
            (None, _) => dh.clone(),
            (Some(_), None) => candle_core::bail!("backward: o's output was not kept"),
        };
        let (dattn, g) = self.o.bwd(&attn, &dao, xo.as_ref(), ctx, None)?; // [m, H·D]
        add_grad(grads, &self.o, g)?;
        drop((dao, xo));
        // δ = rowsum(dO ⊙ O), from the token-major rows both come in.
        let delta = ops::attention::attention_delta_rows(&dattn, &attn, b, t, h)?; // [B, H, T]
        drop(attn);
        let (q, kk, pre) = match qk {
            Qk::Roped(q, k) => (q, k, None),
            Qk::Rows(qr, kr) => {
                let (q, k) = self.qk_heads(&qr, &kr, ctx)?;
                (q, k, Some((qr, kr)))
            }
        };
        let (mask, scale) = (self.mask(ctx), s.scale);
        let (cos, sin) = ctx.rope(s.local_rope);
        let (dq, dk, dv) = if ctx.kernels.attention.tensor_cores() {
            // dO and v read in place from their rows; dq, dk and dv come back as rows, dq and
            // dk rotated back by RoPE's angle in the kernels' stores (RoPE's backward).
            let (dq, dk, dv) = ops::flash::flash_bwd(
                &q,
                &kk,
                &heads(&v, b, t, k)?,
                &heads(&dattn, b, t, h)?,
                &delta,
                &lse,
                &mask,
                scale,
                Some((cos, sin)),
                ctx.kernels.attention,
            )?;
            let rows = |x: Tensor, n: usize| x.transpose(1, 2)?.reshape((b * t, n * d));
            (rows(dq, h)?, rows(dk, k)?, rows(dv, k)?) // [m, H·D], [m, K·D], [m, K·D]
        } else {
            let d_o = ops::to_heads(&dattn, b, t, h)?; // [B, H, T, D]
            let vh = ops::to_heads(&v, b, t, k)?; // [B, K, T, D]
            let (dq, dk, dv) = ops::attention::attention_bwd(
                &q,
                &repeat_kv(&kk, h / k)?,
                &repeat_kv(&vh, h / k)?,
                &d_o,
                &delta,
                &lse,
                &mask,
                scale,
                ctx.attn_block,
            )?;
            // GQA: each kv head's gradient is the sum over the query heads that shared it.
            let (dk, dv) = (unrepeat_kv(&dk, k)?, unrepeat_kv(&dv, k)?);
            // RoPE's backward is the inverse rotation; back to token-major rows in one pass.
            let dq = ops::rope_rows_inv(&dq, cos, sin)?; // [m, H·D]
            let dk = ops::rope_rows_inv(&dk, cos, sin)?; // [m, K·D]
            (dq, dk, ops::to_rows(&dv)?) // dv [m, K·D]
        };
        drop((q, kk, v, dattn, delta, lse));
        // QK-norm's backward, from the rows as projected
        let (dq, dk) = match (pre, &self.extra.q_norm, &self.extra.k_norm) {
            (Some((qr, kr)), qn, kn) => (
                match qn {
                    Some(w) => self.norm_heads_bwd(&qr, w, &dq)?,
                    None => dq,
                },
                match kn {
                    Some(w) => self.norm_heads_bwd(&kr, w, &dk)?,
                    None => dk,
                },
            ),
            (None, _, _) => (dq, dk),
        };
        Ok((x, xas, [dq, dk, dv]))
    }

    /// The input projections' backward: q's, k's and v's adapter gradients into `grads` from
    /// their inputs' norm (recomputed from x [m, C]), their adapter states `xa` and `dqkv`;
    /// with `dh` (dL/dh [m, C]), dL/dx [m, C] = the norm's backward + dh. Without, the first
    /// layer's case, neither the dL/dx GEMMs nor the norm's backward run.
    fn input_bwd(
        &self,
        x: &Tensor,
        xa: &[Option<Tensor>],
        dqkv: [Tensor; 3],
        dh: Option<&Tensor>,
        ctx: &Ctx,
        grads: &mut LayerGrads,
    ) -> Result<Option<Tensor>> {
        let s = self.spec;
        let hn = ops::rms_norm(x, &self.input_norm, s.norm)?; // recomputed
        let lins: Vec<&Linear> = self.attn_in.iter().collect();
        let xa: Vec<Option<&Tensor>> = xa.iter().map(Option::as_ref).collect();
        // qkv_proj's gradient in its three parts (joined where its GEMMs are not folded)
        let (g, cuts) = (dqkv.into(), self.qkv_cuts());
        let (dhn, g) = match dh {
            Some(_) => {
                let (dhn, g) = Linear::bwd_shared_parts(&lins, &hn, g, &cuts, &xa, ctx)?;
                (Some(dhn), g)
            }
            None => {
                let g = super::parts::join_parts(g, &cuts)?;
                (None, Linear::grads_shared(&lins, &hn, g, &xa, ctx)?)
            }
        };
        for (lin, g) in lins.iter().zip(g) {
            add_grad(grads, lin, g)?;
        }
        drop(hn);
        match (dhn, dh) {
            (Some(dhn), Some(dh)) => Ok(Some(ops::rms_norm_bwd_add(
                x,
                &self.input_norm,
                s.norm,
                &dhn,
                dh,
            )?)),
            _ => Ok(None),
        }
    }
}

/// Adds a linear's adapter gradients (dL/dA, dL/dB, DoRA's dL/dm) into `grads`: summed onto what an
/// earlier chunk of tokens left there.
pub(super) fn add_grad(grads: &mut LayerGrads, lin: &Linear, g: AdapterGrad) -> Result<()> {
    let (Some(lora), Some(g)) = (&lin.lora, g) else {
        return Ok(());
    };
    let m = match (&lora.m, g.m) {
        (Some(m), Some(dm)) => Some((m.id(), dm)),
        _ => None,
    };
    for (id, d) in [(lora.a.id(), g.a), (lora.b.id(), g.b)]
        .into_iter()
        .chain(m)
    {
        match grads.iter_mut().find(|(i, _)| *i == id) {
            Some((_, sum)) => *sum = (&*sum + d)?,
            None => grads.push((id, d)),
        }
    }
    Ok(())
}

/// A Vec of known length as an array.
pub(crate) fn array<T, const N: usize>(v: Vec<T>) -> Result<[T; N]> {
    let n = v.len();
    v.try_into()
        .map_err(|_| candle_core::Error::msg(format!("expected {N} results, got {n}")))
}

/// Token-major rows [B·T, n·D] viewed as heads [B, n, T, D] (no copy).
fn heads(x: &Tensor, b: usize, t: usize, n: usize) -> Result<Tensor> {
    let d = x.dim(1)? / n.max(1);
    x.reshape((b, t, n, d))?.transpose(1, 2)
}

/// [B, K·n, T, D] → [B, K, T, D], summing each group of n heads (repeat_kv's backward).
fn unrepeat_kv(x: &Tensor, k: usize) -> Result<Tensor> {
    let (b, hk, t, d) = x.dims4()?;
    if hk == k {
        return Ok(x.clone());
    }
    let dt = x.dtype();
    x.reshape((b, k, hk / k, t, d))?
        .to_dtype(DType::F32)?
        .sum(2)?
        .to_dtype(dt)
}
