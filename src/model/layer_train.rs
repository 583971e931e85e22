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
//!
//! The adapters' forward of q, k, v, gate, up and down runs inside their frozen GEMMs where
//! the model is folded (ops::fold): RMSNorm and SwiGLU then write padded rows.
//!
//! That is 5 + 2·I/C tensors of [B, T, C] (k, v smaller under GQA): 0.33 GiB per layer at 7B.
//! `Layer::forward` (autograd) stays the reference; tests pin this pair to it.
//!
//! Shapes: B batch, T tokens, m = B·T, C hidden, H heads, K kv heads, D head dim, I mlp.

use super::layer::{repeat_kv, Layer};
use super::linear::Linear;
use super::llama::Ctx;
use crate::ops::{self, glu::Act};
use candle_core::{DType, Result, Tensor, TensorId};

/// q and k as the forward keeps them.
enum Qk {
    /// After RoPE: [B, H, T, D], [B, K, T, D].
    Roped(Tensor, Tensor),
    /// QK-norm: as projected, [m, H·D] and [m, K·D] (normalised and rotated again in backward).
    Rows(Tensor, Tensor),
}

/// What a layer's forward leaves for its backward.
pub struct LayerActs {
    x: Tensor, // [m, C] the layer input
    qk: Qk,
    v: Tensor,          // [m, K·D] token-major rows, as v_proj made it
    attn: Tensor,       // [m, H·D] attention output, o_proj's input
    lse: Tensor,        // [B, H, T] f32
    ao: Option<Tensor>, // [m, C] o_proj's output, before Gemma's norm on it
    gate: Tensor,       // [m, I] before the activation
    up: Tensor,         // [m, I]
    mo: Option<Tensor>, // [m, C] down_proj's output, before Gemma's norm on it
    h: Option<Tensor>,  // [m, C] the residual h; recomputed when None
    /// Per linear, in `Layer::linears` order: the adapter's s·(m⊙x)Aᵀ [m, r].
    xas: Vec<Option<Tensor>>,
}

impl LayerActs {
    /// Bytes held (what the memory plan counts per layer).
    pub fn bytes(&self) -> usize {
        let (q, k) = match &self.qk {
            Qk::Roped(q, k) | Qk::Rows(q, k) => (q, k),
        };
        let t = [
            &self.x, q, k, &self.v, &self.attn, &self.lse, &self.gate, &self.up,
        ];
        t.into_iter()
            .chain(self.xas.iter().flatten())
            .chain(&self.h)
            .chain(&self.ao)
            .chain(&self.mo)
            .map(|t| crate::memory::tensor_bytes(t) as usize)
            .sum()
    }

    /// The residual h [m, C] out of the activations (backward then recomputes it, or it is
    /// put back with `put_h`).
    pub fn take_h(&mut self) -> Option<Tensor> {
        self.h.take()
    }

    /// Puts back what `take_h` took (the same values).
    pub fn put_h(&mut self, h: Tensor) {
        self.h = Some(h);
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
        match self.run(x, ctx, true, keep)? {
            (Some(y), acts) => Ok((y, acts)),
            (None, _) => candle_core::bail!("forward_train: no output"),
        }
    }

    /// What `backward` needs of a checkpointed layer, recomputed from its input x [B, T, C]:
    /// `forward_train`'s activations without its output, so down_proj's GEMM and the last
    /// residual are skipped (down's adapter state is all backward uses of them; not with
    /// Gemma's norm on down's output, whose backward takes that output).
    pub fn recompute(&self, x: &Tensor, ctx: &Ctx) -> Result<LayerActs> {
        match self.run(x, ctx, false, true)? {
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

    /// The forward: y when `output`, the activations when `keep`.
    fn run(
        &self,
        x: &Tensor,
        ctx: &Ctx,
        output: bool,
        keep: bool,
    ) -> Result<(Option<Tensor>, Option<LayerActs>)> {
        let (b, t, c) = x.dims3()?;
        let s = self.spec;
        let (h, k) = (s.heads, s.kv_heads);
        let x = x.reshape((b * t, c))?; // [m, C]

        // q [m, H·D], k and v [m, K·D]: their adapters' x Aᵀ as one GEMM; their forward folded
        // into the base GEMMs (ops::fold) when the norm writes padded rows
        let qkv: Vec<&Linear> = self.attn_in.iter().collect();
        let folded = match Linear::fold_width(&qkv, ctx) {
            Some(p) => ops::fold::rms_norm_pad(&x, &self.input_norm, s.norm, p)?,
            None => None,
        }; // [m, C + pad]
        let outs = match folded {
            Some(xp) => Linear::fwd_folded(&qkv, &xp, ctx)?,
            None => {
                let hn = ops::rms_norm(&x, &self.input_norm, s.norm)?;
                Linear::fwd_shared(&qkv, &hn, ctx)?
            }
        };
        let (ys, mut xas): (Vec<Tensor>, Vec<Option<Tensor>>) = outs.into_iter().unzip();
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
        let (mask, scale) = (self.mask(ctx), s.scale);
        let (attn, lse) = if ctx.kernels.attention.tensor_cores() {
            // Tensor cores; v is read in place from its rows and O written as rows.
            let kernels = ctx.kernels.attention;
            let (o, lse) =
                ops::flash::flash_fwd(&q, &kk, &heads(&v, b, t, k)?, &mask, scale, kernels)?;
            (o, lse) // [m, H·D], [B, H, T]
        } else {
            let vh = ops::to_heads(&v, b, t, k)?; // [B, K, T, D]
            let (o, lse) = ops::attention::attention_fwd(
                &q,
                &repeat_kv(&kk, h / k)?,
                &repeat_kv(&vh, h / k)?,
                &mask,
                scale,
                ctx.attn_block,
            )?; // [B, H, T, D], [B, H, T]
            (ops::to_rows(&o)?, lse) // [m, H·D]
        };
        drop((q, kk));
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
        // gate and up [m, I] each: their adapters' x Aᵀ as one GEMM, folded as q's, k's, v's
        let gu: Vec<&Linear> = self.mlp_in.iter().collect();
        let folded = match Linear::fold_width(&gu, ctx) {
            Some(p) => ops::fold::add_rms_norm_pad(&x, &ao, &self.post_norm, s.norm, p)?,
            None => None,
        }; // h [m, C], hn [m, C + pad]
        let (hres, outs) = match folded {
            Some((hres, xp)) => (hres, Linear::fwd_folded(&gu, &xp, ctx)?),
            None => {
                let (hres, hn) = ops::add_rms_norm(&x, &ao, &self.post_norm, s.norm)?;
                (hres, Linear::fwd_shared(&gu, &hn, ctx)?)
            }
        };
        drop(ao);
        let (ys, xas_gu): (Vec<Tensor>, Vec<Option<Tensor>>) = outs.into_iter().unzip();
        xas.extend(xas_gu);
        let [gate, up] = self.split_gate_up(ys, 1)?;
        let out_norm = self.extra.mlp_out_norm.as_ref();
        let (y, xd, mo_kept) = if output || out_norm.is_some() {
            // Not accumulated onto h in the GEMM: h is kept for backward (and, unfolded, the
            // adapter's small term would be rounded to bf16 against |h| before the base
            // product joins it, and mostly lost).
            let down = [&self.down];
            let folded = match (Linear::fold_width(&down, ctx), s.act) {
                (Some(p), Act::Silu) => ops::fold::swiglu_pad(&gate, &up, p)?,
                _ => None,
            }; // [m, I + pad]
            let (mo, xd) = match folded {
                Some(ap) => {
                    let [o] = array(Linear::fwd_folded(&down, &ap, ctx)?)?;
                    o
                }
                None => self.down.fwd(&s.act.glu(&gate, &up)?, ctx)?,
            };
            let (mo_kept, mo) = match out_norm {
                Some(w) => {
                    let n = ops::rms_norm(&mo, w, s.norm)?;
                    (Some(mo), n)
                }
                None => (None, mo),
            };
            let y = match output {
                true => Some(ops::add(&hres, &mo)?.reshape((b, t, c))?),
                false => None,
            };
            (y, xd, mo_kept)
        } else {
            let a = s.act.glu(&gate, &up)?; // [m, I]
            (None, self.down.adapter_fwd(&a, ctx)?, None)
        };
        xas.push(xd);
        let acts = keep.then_some(LayerActs {
            x,
            qk,
            v,
            attn,
            lse,
            ao: ao_kept,
            gate,
            up,
            mo: mo_kept,
            h: Some(hres),
            xas,
        });
        Ok((y, acts))
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

    /// The backward, with dL/dx when `input_grad`.
    fn backward_to(
        &self,
        acts: LayerActs,
        dy: &Tensor,
        ctx: &Ctx,
        input_grad: bool,
    ) -> Result<(Option<Tensor>, LayerGrads)> {
        let (b, t, c) = dy.dims3()?;
        let s = self.spec;
        let (h, k, d) = (s.heads, s.kv_heads, s.head_dim);
        let LayerActs {
            x,
            qk,
            v,
            attn,
            lse,
            ao,
            gate,
            up,
            mo,
            h: residual,
            xas,
        } = acts;
        let (na, nm) = (self.attn_in.len(), self.mlp_in.len());
        if xas.len() != na + nm + 2 {
            candle_core::bail!(
                "backward: {} adapter states for {} linears",
                xas.len(),
                na + nm + 2
            );
        }
        let mut xas = xas.into_iter();
        let xa_attn: Vec<Option<Tensor>> = xas.by_ref().take(na).collect();
        let xo = xas.next().flatten();
        let xa_mlp: Vec<Option<Tensor>> = xas.by_ref().take(nm).collect();
        let xd = xas.next().flatten();
        let dt = x.dtype();
        let dy = dy.to_dtype(dt)?.reshape((b * t, c))?; // [m, C]
        let mut grads = LayerGrads::new();
        let mut keep = |lin: &Linear, g: super::linear::AdapterGrad| {
            if let (Some(lora), Some(g)) = (&lin.lora, g) {
                grads.push((lora.a.id(), g.a));
                grads.push((lora.b.id(), g.b));
                if let (Some(m), Some(dm)) = (&lora.m, g.m) {
                    grads.push((m.id(), dm));
                }
            }
        };

        // ---- MLP: y = h + N_mo(down(act(gate(hn), up(hn)))), hn = rms_norm(h)
        // dL/d(down's output): through Gemma's norm on it, else dy itself
        let dmo = match (&self.extra.mlp_out_norm, mo) {
            (Some(w), Some(mo)) => ops::rms_norm_bwd(&mo, w, s.norm, &dy)?,
            (None, _) => dy.clone(),
            (Some(_), None) => candle_core::bail!("backward: down's output was not kept"),
        };
        // Folded, down's backward and SwiGLU's are one GEMM and one pass (ops::fold). Else
        // down's dL/da needs no a; a is recomputed in the activation's backward pass (over
        // da's buffer) for down's adapter gradient alone.
        let down = match s.act {
            Act::Silu => self
                .down
                .bwd_swiglu_folded(&dmo, &gate, &up, xd.as_ref(), ctx)?,
            Act::GeluTanh => None,
        };
        let (dgate, dup) = match down {
            Some((dgate, dup, g)) => {
                keep(&self.down, g);
                (dgate, dup) // [m, I] each
            }
            None => {
                let (da, half) = self.down.bwd_dx(&dmo, ctx, None)?; // [m, I]
                let (dgate, dup, a) = s.act.glu_bwd_keep(&gate, &up, da)?;
                keep(
                    &self.down,
                    self.down.bwd_grads(&a, &dmo, half, xd.as_ref(), ctx)?,
                );
                (dgate, dup)
            }
        };
        drop((gate, up, dmo));
        // [m, C] each: the residual as forward made it, kept or recomputed from o's kept
        // adapter state (or, with Gemma's norm on o's output, that output), and its norm
        // (add_rms_norm's values are those of add, then rms_norm)
        let (hres, hn) = match residual {
            Some(h) => {
                let hn = ops::rms_norm(&h, &self.post_norm, s.norm)?;
                (h, hn)
            }
            None => {
                let a = match (&self.extra.attn_out_norm, &ao) {
                    (Some(w), Some(ao)) => ops::rms_norm(ao, w, s.norm)?,
                    _ => self.o.fwd_again(&attn, xo.as_ref(), ctx)?,
                };
                ops::add_rms_norm(&x, &a, &self.post_norm, s.norm)?
            }
        };
        // gate's and up's GEMMs accumulate onto one dL/dhn: the sum needs no pass of its own
        let gu: Vec<&Linear> = self.mlp_in.iter().collect();
        let g = match nm {
            1 => vec![Tensor::cat(&[&dgate, &dup], 1)?], // gate_up_proj's [m, 2I]
            _ => vec![dgate, dup],
        };
        let xa: Vec<Option<&Tensor>> = xa_mlp.iter().map(Option::as_ref).collect();
        let (dhn, g) = Linear::bwd_shared(&gu, &hn, g, &xa, ctx)?;
        for (lin, g) in gu.iter().zip(g) {
            keep(lin, g);
        }
        drop((hn, xa_mlp));
        let dh = ops::rms_norm_bwd_add(&hres, &self.post_norm, s.norm, &dhn, &dy)?; // [m, C]
        drop((dhn, hres, dy));

        // ---- attention: h = x + N_ao(o(attn)), attn = softmax(q kᵀ) v
        let dao = match (&self.extra.attn_out_norm, ao) {
            (Some(w), Some(ao)) => ops::rms_norm_bwd(&ao, w, s.norm, &dh)?,
            (None, _) => dh.clone(),
            (Some(_), None) => candle_core::bail!("backward: o's output was not kept"),
        };
        let (dattn, g) = self.o.bwd(&attn, &dao, xo.as_ref(), ctx, None)?; // [m, H·D]
        keep(&self.o, g);
        drop(dao);
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

        let hn = ops::rms_norm(&x, &self.input_norm, s.norm)?; // recomputed
        let lins: Vec<&Linear> = self.attn_in.iter().collect();
        let xa: Vec<Option<&Tensor>> = xa_attn.iter().map(Option::as_ref).collect();
        let g = match na {
            1 => vec![Tensor::cat(&[&dq, &dk, &dv], 1)?], // qkv_proj's [m, (H + 2K)·D]
            _ => vec![dq, dk, dv],
        };
        let (dhn, g) = match input_grad {
            true => {
                let (dhn, g) = Linear::bwd_shared(&lins, &hn, g, &xa, ctx)?;
                (Some(dhn), g)
            }
            false => (None, Linear::grads_shared(&lins, &hn, g, &xa, ctx)?),
        };
        for (lin, g) in lins.iter().zip(g) {
            keep(lin, g);
        }
        drop(hn);
        let dx = match dhn {
            Some(dhn) => Some(
                ops::rms_norm_bwd_add(&x, &self.input_norm, s.norm, &dhn, &dh)?
                    .reshape((b, t, c))?,
            ),
            None => None,
        };
        Ok((dx, grads))
    }
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
