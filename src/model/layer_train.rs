//! One decoder layer's training forward and its hand-written backward.
//!
//! Autograd keeps every intermediate of a layer alive until its backward (0.88 GiB per layer at
//! the Llama-2-7B shape, micro-batch 2 × 2048 tokens) and sums gradients with extra passes.
//! Here forward keeps what backward cannot cheaply recompute, and backward recomputes the rest
//! with elementwise passes:
//!
//!   kept: x, q, k, v (after RoPE), attn (o_proj's input), lse, gate, up, and each adapter's
//!         s·(m⊙x)Aᵀ [m, r]
//!   recomputed: rms_norm(x), swiglu(gate, up), dropout masks (keyed)
//!   the residual h = x + o_proj(attn) [m, C]: `LayerActs::h`. The driver takes it out and
//!         either parks it in host memory until the layer's backward (train/offload.rs; kept
//!         on the device it would cost 1 GiB over 32 layers at 7B, micro-batch 2 × 2048) or
//!         drops it; without it backward recomputes it from o_proj's kept adapter state, one
//!         GEMM of the layer's seven
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
use crate::ops::{self, AttnMask};
use candle_core::{DType, Result, Tensor, TensorId};

/// What a layer's forward leaves for its backward.
pub struct LayerActs {
    x: Tensor,         // [m, C] the layer input
    q: Tensor,         // [B, H, T, D] after RoPE
    k: Tensor,         // [B, K, T, D] after RoPE
    v: Tensor,         // [m, K·D] token-major rows, as v_proj made it
    attn: Tensor,      // [m, H·D] attention output, o_proj's input
    lse: Tensor,       // [B, H, T] f32
    gate: Tensor,      // [m, I] before the activation
    up: Tensor,        // [m, I]
    h: Option<Tensor>, // [m, C] the residual x + o_proj(attn); recomputed when None
    /// Per linear, in `Layer::linears` order: the adapter's s·(m⊙x)Aᵀ [m, r].
    xas: [Option<Tensor>; 7],
}

impl LayerActs {
    /// Bytes held (what the memory plan counts per layer).
    pub fn bytes(&self) -> usize {
        let t = [
            &self.x, &self.q, &self.k, &self.v, &self.attn, &self.lse, &self.gate, &self.up,
        ];
        t.into_iter()
            .chain(self.xas.iter().flatten())
            .chain(&self.h)
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
    fn attn_mask(&self, ctx: &Ctx) -> AttnMask {
        AttnMask {
            window: self.window,
            ..ctx.mask.clone()
        }
    }

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
    /// residual are skipped (down's adapter state is all backward uses of them).
    pub fn recompute(&self, x: &Tensor, ctx: &Ctx) -> Result<LayerActs> {
        match self.run(x, ctx, false, true)? {
            (_, Some(acts)) => Ok(acts),
            (_, None) => candle_core::bail!("recompute: no activations"),
        }
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
        let (h, k, d) = (self.heads, self.kv_heads, self.head_dim);
        let x = x.reshape((b * t, c))?; // [m, C]

        // q [m, H·D], k and v [m, K·D]: their adapters' x Aᵀ as one GEMM; their forward folded
        // into the base GEMMs (ops::fold) when the norm writes padded rows
        let qkv = [&self.q, &self.k, &self.v];
        let folded = match Linear::fold_width(&qkv, ctx) {
            Some(p) => ops::fold::rms_norm_pad(&x, &self.input_norm, self.eps, p)?,
            None => None,
        }; // [m, C + pad]
        let [(q_rows, xq), (k_rows, xk), (v, xv)] = array(match folded {
            Some(xp) => Linear::fwd_folded(&qkv, &xp, ctx)?,
            None => {
                let hn = ops::rms_norm(&x, &self.input_norm, self.eps)?;
                Linear::fwd_shared(&qkv, &hn, ctx)?
            }
        })?;
        // (A shadowed binding would live to the end of the function: every dead tensor here is
        // dropped by name, so that the layer's peak is what the memory plan counts.)
        let q = ops::rope_heads(&q_rows, &ctx.cos, &ctx.sin, h)?; // [B, H, T, D]
        let kk = ops::rope_heads(&k_rows, &ctx.cos, &ctx.sin, k)?; // [B, K, T, D]
        drop((q_rows, k_rows));
        let (mask, scale) = (self.attn_mask(ctx), 1.0 / (d as f64).sqrt());
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
        let (ao, xo) = self.o.fwd(&attn, ctx)?;
        // gate and up [m, I] each: their adapters' x Aᵀ as one GEMM, folded as q's, k's, v's
        let gu = [&self.gate, &self.up];
        let folded = match Linear::fold_width(&gu, ctx) {
            Some(p) => ops::fold::add_rms_norm_pad(&x, &ao, &self.post_norm, self.eps, p)?,
            None => None,
        }; // h [m, C], hn [m, C + pad]
        let (hres, [(gate, xg), (up, xu)]) = match folded {
            Some((hres, xp)) => (hres, array(Linear::fwd_folded(&gu, &xp, ctx)?)?),
            None => {
                let (hres, hn) = ops::add_rms_norm(&x, &ao, &self.post_norm, self.eps)?;
                (hres, array(Linear::fwd_shared(&gu, &hn, ctx)?)?)
            }
        };
        drop(ao);
        let (y, xd) = if output {
            // Not accumulated onto h in the GEMM: h is kept for backward (and, unfolded, the
            // adapter's small term would be rounded to bf16 against |h| before the base
            // product joins it, and mostly lost).
            let down = [&self.down];
            let folded = match Linear::fold_width(&down, ctx) {
                Some(p) => ops::fold::swiglu_pad(&gate, &up, p)?,
                None => None,
            }; // [m, I + pad]
            let (mo, xd) = match folded {
                Some(ap) => {
                    let [o] = array(Linear::fwd_folded(&down, &ap, ctx)?)?;
                    o
                }
                None => self.down.fwd(&ops::swiglu(&gate, &up)?, ctx)?,
            };
            (Some(ops::add(&hres, &mo)?.reshape((b, t, c))?), xd)
        } else {
            let a = ops::swiglu(&gate, &up)?; // [m, I]
            (None, self.down.adapter_fwd(&a, ctx)?)
        };
        let acts = keep.then_some(LayerActs {
            x,
            q,
            k: kk,
            v,
            attn,
            lse,
            gate,
            up,
            h: Some(hres),
            xas: [xq, xk, xv, xo, xg, xu, xd],
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
        let (h, k, d) = (self.heads, self.kv_heads, self.head_dim);
        let LayerActs {
            x,
            q,
            k: kk,
            v,
            attn,
            lse,
            gate,
            up,
            h: residual,
            xas,
        } = acts;
        let [xq, xk, xv, xo, xg, xu, xd] = xas;
        let dt = x.dtype();
        let dy = dy.to_dtype(dt)?.reshape((b * t, c))?; // [m, C]
        let mut grads = LayerGrads::new();
        let mut keep = |lin: &Linear, g: Option<(Tensor, Tensor)>| {
            if let (Some(lora), Some((da, db))) = (&lin.lora, g) {
                grads.push((lora.a.id(), da));
                grads.push((lora.b.id(), db));
            }
        };

        // ---- MLP: y = h + down(swiglu(gate(hn), up(hn))), hn = rms_norm(h)
        // Folded, down's backward and SwiGLU's are one GEMM and one pass (ops::fold). Else
        // down's dL/da needs no a; a is recomputed in SwiGLU's backward pass (over da's
        // buffer) for down's adapter gradient alone.
        let down = self
            .down
            .bwd_swiglu_folded(&dy, &gate, &up, xd.as_ref(), ctx)?;
        let (dgate, dup) = match down {
            Some((dgate, dup, g)) => {
                keep(&self.down, g);
                (dgate, dup) // [m, I] each
            }
            None => {
                let (da, half) = self.down.bwd_dx(&dy, ctx, None)?; // [m, I]
                let (dgate, dup, a) = ops::swiglu_bwd_keep(&gate, &up, da)?;
                keep(
                    &self.down,
                    self.down.bwd_grads(&a, &dy, half, xd.as_ref(), ctx)?,
                );
                (dgate, dup)
            }
        };
        drop((gate, up));
        // [m, C] each: the residual as forward made it, kept or recomputed from o's kept
        // adapter state, and its norm (add_rms_norm's values are those of add, then rms_norm)
        let (hres, hn) = match residual {
            Some(h) => {
                let hn = ops::rms_norm(&h, &self.post_norm, self.eps)?;
                (h, hn)
            }
            None => {
                let ao = self.o.fwd_again(&attn, xo.as_ref(), ctx)?;
                ops::add_rms_norm(&x, &ao, &self.post_norm, self.eps)?
            }
        };
        // gate's and up's GEMMs accumulate onto one dL/dhn: the sum needs no pass of its own
        let (dhn, g) = Linear::bwd_shared(
            &[&self.gate, &self.up],
            &hn,
            vec![dgate, dup],
            &[xg.as_ref(), xu.as_ref()],
            ctx,
        )?;
        let [gg, gu] = array(g)?;
        keep(&self.gate, gg);
        keep(&self.up, gu);
        drop(hn);
        let dh = ops::rms_norm_bwd_add(&hres, &self.post_norm, self.eps, &dhn, &dy)?; // [m, C]
        drop((dhn, hres, dy));

        // ---- attention: h = x + o(attn), attn = softmax(q kᵀ) v
        let (dattn, g) = self.o.bwd(&attn, &dh, xo.as_ref(), ctx, None)?; // [m, H·D]
        keep(&self.o, g);
        // δ = rowsum(dO ⊙ O), from the token-major rows both come in.
        let delta = ops::attention::attention_delta_rows(&dattn, &attn, b, t, h)?; // [B, H, T]
        drop(attn);
        let (mask, scale) = (self.attn_mask(ctx), 1.0 / (d as f64).sqrt());
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
                Some((&ctx.cos, &ctx.sin)),
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
            let dq = ops::rope_rows_inv(&dq, &ctx.cos, &ctx.sin)?; // [m, H·D]
            let dk = ops::rope_rows_inv(&dk, &ctx.cos, &ctx.sin)?; // [m, K·D]
            (dq, dk, ops::to_rows(&dv)?) // dv [m, K·D]
        };
        drop((q, kk, v, dattn, delta, lse));

        let hn = ops::rms_norm(&x, &self.input_norm, self.eps)?; // recomputed
        let lins = [&self.q, &self.k, &self.v];
        let xas = [xq.as_ref(), xk.as_ref(), xv.as_ref()];
        let g = vec![dq, dk, dv];
        let (dhn, g) = match input_grad {
            true => {
                let (dhn, g) = Linear::bwd_shared(&lins, &hn, g, &xas, ctx)?;
                (Some(dhn), g)
            }
            false => (None, Linear::grads_shared(&lins, &hn, g, &xas, ctx)?),
        };
        let [gq, gk, gv] = array(g)?;
        keep(&self.q, gq);
        keep(&self.k, gk);
        keep(&self.v, gv);
        drop(hn);
        let dx = match dhn {
            Some(dhn) => Some(
                ops::rms_norm_bwd_add(&x, &self.input_norm, self.eps, &dhn, &dh)?
                    .reshape((b, t, c))?,
            ),
            None => None,
        };
        Ok((dx, grads))
    }
}

/// A Vec of known length as an array.
fn array<T, const N: usize>(v: Vec<T>) -> Result<[T; N]> {
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
