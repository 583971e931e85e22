//! The Llama-family decoder, trainable: frozen base through `ops`, LoRA on chosen linears.
//!
//! Shapes: B batch, T tokens, C hidden, H heads, K kv heads, D head dim, V vocab, I mlp.

use super::config::ModelConfig;
use super::rope;
use crate::hub::ModelFiles;
use crate::lora::{Lora, LoraSpec, ALL_LINEAR};
use crate::ops::{self, AttnMask};
use anyhow::{bail, Context};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Result, Tensor, TensorId, D};
use std::collections::HashMap;

/// Per-batch inputs every layer needs besides the hidden states.
pub struct Ctx {
    pub cos: Tensor, // [B, T, D/2] f32
    pub sin: Tensor, // [B, T, D/2] f32
    pub mask: AttnMask,
    /// Queries per attention block (None: sized to the batch).
    pub attn_block: Option<usize>,
    /// Dropout stream key (seed, [step, micro-batch]); None = eval (no dropout).
    pub dropout: Option<(u64, [u64; 2])>,
    /// Each adapter's A and B in the activation dtype, by Var id, cast once for the batch
    /// (one launch for all on CUDA with bf16 activations; empty elsewhere, where the hand-written
    /// forward and backward cast at each use: every layer's linears did, twice a step).
    pub adapters: HashMap<TensorId, Tensor>,
    /// The one buffer `adapters` are views of (each layer's A's side by side, then its B's).
    pub adapter_buf: Option<Tensor>,
    /// Whether the padded weights' B columns hold this batch's B's (`ops::fold`).
    pub folded: bool,
}

impl Ctx {
    /// `v` (an adapter's A or B) in the activation dtype when `adapters` has it, else as is.
    fn adapter<'a>(&'a self, v: &'a candle_core::Var) -> &'a Tensor {
        self.adapters.get(&v.id()).unwrap_or(v.as_tensor())
    }

    /// The A's [r_i, in] of `vs` stacked [Σ r_i, in] in `dt`: a view when their copies lie one
    /// after the other in `adapter_buf` (the layout `adapters_cast` makes), else a new tensor.
    fn a_stack(&self, vs: &[&candle_core::Var], dt: DType) -> Result<Tensor> {
        let copies: Option<Vec<&Tensor>> = vs.iter().map(|v| self.adapters.get(&v.id())).collect();
        if let (Some(buf), Some(copies)) = (&self.adapter_buf, &copies) {
            let start = |t: &Tensor| t.storage_and_layout().1.start_offset();
            let adjacent = copies.windows(2).all(|w| {
                w[1].dim(1).ok() == w[0].dim(1).ok()
                    && start(w[1]) == start(w[0]) + w[0].elem_count()
            });
            if let (true, Some(first)) = (adjacent, copies.first()) {
                let rows: usize = copies.iter().map(|t| t.dim(0).unwrap_or(0)).sum();
                let n: usize = copies.iter().map(|t| t.elem_count()).sum();
                return buf
                    .narrow(0, start(first), n)?
                    .reshape((rows, first.dim(1)?));
            }
        }
        let parts: Vec<Tensor> = vs
            .iter()
            .map(|v| self.adapter(v).to_dtype(dt))
            .collect::<Result<_>>()?;
        Tensor::cat(&parts, 0)
    }
}

/// An adapter's (dL/dA, dL/dB) in f32, None for a linear without one.
pub type AdapterGrad = Option<(Tensor, Tensor)>;

/// What `Linear::bwd_dx` leaves for `Linear::bwd_grads`: s · g B [m, r] and the dropout mask
/// (drawn once for both halves).
pub struct AdapterHalf {
    gbs: Tensor,
    mask: Option<Tensor>,
}

/// `Ctx::adapters` and `Ctx::adapter_buf`.
type AdapterCopies = (HashMap<TensorId, Tensor>, Option<Tensor>);

/// A frozen linear (W [out, in], optional bias) with an optional LoRA adapter.
#[derive(Clone)]
pub struct Linear {
    /// Module name in the checkpoint, e.g. `model.layers.3.self_attn.q_proj`.
    pub name: String,
    /// [out, in]; a view of `pad`'s first `in` columns when folded.
    pub w: Tensor,
    pub b: Option<Tensor>,
    pub lora: Option<Lora>,
    /// W's wider buffer, when the adapter's forward is folded into the base GEMM.
    pub pad: Option<Pad>,
    /// (layer, module) index: keys the dropout stream.
    key: [u64; 2],
}

/// A folded linear's W* = [W | pad] [out, in + pad] (`ops::fold`): its B's r columns start at
/// in + `col`; the rest of the pad is zero (the other linears' B columns, and the columns
/// that round its rows up). Under FSDP the skeleton layer's `full` is a placeholder and a
/// gathered layer's a view of the gathered buffer (`Layer::frozen_mut`).
#[derive(Clone)]
pub struct Pad {
    pub full: Tensor,
    pub col: usize,
    /// W's columns (`in`): `w` is `full`'s first `in_f` columns.
    pub in_f: usize,
}

impl Linear {
    /// x: [B, T, in] → [B, T, out]
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let Some(lora) = &self.lora else {
            return ops::frozen_linear(x, &self.w, self.b.as_ref());
        };
        ops::lora_linear(
            x,
            &self.w,
            self.b.as_ref(),
            lora.a.as_tensor(),
            lora.b.as_tensor(),
            lora.scale,
            self.dropout_mask(x.dims(), ctx)?,
        )
    }

    /// Dropout on the adapter input, keyed by (step, micro-batch, layer, module) so that a
    /// recomputed layer, and the backward, draw the same mask. None without dropout.
    fn dropout_mask(&self, dims: &[usize], ctx: &Ctx) -> Result<Option<Tensor>> {
        match (ctx.dropout, &self.lora) {
            (Some((seed, [step, micro])), Some(lora)) if lora.dropout > 0.0 => {
                Ok(Some(crate::lora::dropout_mask(
                    dims,
                    lora.dropout,
                    seed,
                    &[step, micro, self.key[0], self.key[1]],
                    ctx.cos.device(),
                )?))
            }
            _ => Ok(None),
        }
    }

    /// The forward without a graph, for the hand-written layer backward.
    /// x: [m, in] → (y [m, out], the adapter's s · (m ⊙ x) Aᵀ [m, r] if it has one).
    pub fn fwd(&self, x: &Tensor, ctx: &Ctx) -> Result<(Tensor, Option<Tensor>)> {
        let Some(lora) = &self.lora else {
            return Ok((ops::frozen_linear(x, &self.w, self.b.as_ref())?, None));
        };
        let mask = self.dropout_mask(x.dims(), ctx)?;
        let (y, xas) = ops::lora_linear::lora_fwd(
            x,
            &self.w,
            self.b.as_ref(),
            ctx.adapter(&lora.a),
            ctx.adapter(&lora.b),
            lora.scale,
            mask.as_ref(),
        )?;
        Ok((y, Some(xas)))
    }

    /// `fwd`'s output again, from x and the adapter state `fwd` returned (no x Aᵀ product).
    pub fn fwd_again(&self, x: &Tensor, xas: Option<&Tensor>, ctx: &Ctx) -> Result<Tensor> {
        match (&self.lora, xas) {
            (Some(lora), Some(xas)) => {
                let b = ctx.adapter(&lora.b);
                ops::lora_linear::with_base(x, &self.w, self.b.as_ref(), xas, b)
            }
            (None, _) => ops::frozen_linear(x, &self.w, self.b.as_ref()),
            (Some(_), None) => {
                candle_core::bail!(
                    "{}: recompute without the forward's adapter state",
                    self.name
                )
            }
        }
    }

    /// `fwd`'s adapter state alone, without the output (None without an adapter).
    pub fn adapter_fwd(&self, x: &Tensor, ctx: &Ctx) -> Result<Option<Tensor>> {
        let Some(lora) = &self.lora else {
            return Ok(None);
        };
        let mask = self.dropout_mask(x.dims(), ctx)?;
        ops::lora_linear::lora_xas(x, ctx.adapter(&lora.a), lora.scale, mask.as_ref()).map(Some)
    }

    /// The backward of `fwd`: x [m, in] its input, g = dL/dy [m, out], `xas` what `fwd`
    /// returned, `acc` a term of dL/dx to add in (consumed; on CUDA the GEMMs accumulate onto
    /// it) → dL/dx [m, in], and (dA, dB) in f32 for an adapter. W gets nothing.
    pub fn bwd(
        &self,
        x: &Tensor,
        g: &Tensor,
        xas: Option<&Tensor>,
        ctx: &Ctx,
        acc: Option<Tensor>,
    ) -> Result<(Tensor, AdapterGrad)> {
        if self.lora.is_some() && xas.is_none() {
            candle_core::bail!(
                "{}: backward without the forward's adapter state",
                self.name
            )
        }
        let (dx, half) = self.bwd_dx(g, ctx, acc)?;
        Ok((dx, self.bwd_grads(x, g, half, xas)?))
    }

    /// `bwd` in two halves, for a linear whose input x is only wanted for the adapter's
    /// gradients: dL/dx [m, in] from g [m, out] alone (plus `acc`, as `bwd`), and what
    /// `bwd_grads` takes with x.
    pub fn bwd_dx(
        &self,
        g: &Tensor,
        ctx: &Ctx,
        acc: Option<Tensor>,
    ) -> Result<(Tensor, Option<AdapterHalf>)> {
        let Some(lora) = &self.lora else {
            let dx = match acc {
                Some(acc) => ops::linear_acc::linear_bwd_acc(g, &self.w, acc)?,
                None => g.contiguous()?.matmul(&self.w)?, // dx = g W
            };
            return Ok((dx, None));
        };
        let g = g.contiguous()?;
        let mut dims = g.dims().to_vec(); // the input's: [m, in]
        if let Some(d) = dims.last_mut() {
            *d = self.w.dim(1)?;
        }
        let mask = self.dropout_mask(&dims, ctx)?;
        let (dx, gbs) = ops::lora_linear::lora_bwd_dx(
            &g,
            &self.w,
            ctx.adapter(&lora.a),
            ctx.adapter(&lora.b),
            lora.scale,
            mask.as_ref(),
            acc,
        )?;
        Ok((dx, Some(AdapterHalf { gbs, mask })))
    }

    /// `bwd`'s adapter gradients alone, without dL/dx (none of its GEMMs run): x [m, in],
    /// g [m, out], `xas` what `fwd` kept. None without an adapter.
    pub fn bwd_grads_alone(
        &self,
        x: &Tensor,
        g: &Tensor,
        xas: Option<&Tensor>,
        ctx: &Ctx,
    ) -> Result<AdapterGrad> {
        let Some(lora) = &self.lora else {
            return Ok(None);
        };
        let g = g.contiguous()?;
        let gbs = ops::lora_linear::lora_gbs(&g, ctx.adapter(&lora.b), lora.scale)?;
        let mask = self.dropout_mask(x.dims(), ctx)?; // the forward's (keyed)
        self.bwd_grads(x, &g, Some(AdapterHalf { gbs, mask }), xas)
    }

    /// The second half of `bwd_dx`: (dA, dB) from x [m, in], the same g, what `bwd_dx`
    /// returned and what `fwd` kept. None without an adapter.
    pub fn bwd_grads(
        &self,
        x: &Tensor,
        g: &Tensor,
        half: Option<AdapterHalf>,
        xas: Option<&Tensor>,
    ) -> Result<AdapterGrad> {
        match (half, xas) {
            (Some(h), Some(xas)) => {
                let g = g.contiguous()?;
                let (da, db) = ops::lora_linear::lora_grads(x, &g, &h.gbs, h.mask.as_ref(), xas)?;
                Ok(Some((da, db)))
            }
            (None, _) => Ok(None),
            (Some(_), None) => {
                candle_core::bail!(
                    "{}: backward without the forward's adapter state",
                    self.name
                )
            }
        }
    }

    /// down_proj's backward with SwiGLU's, folded (`ops::fold::swiglu_down_bwd`): from dy
    /// [m, out], SwiGLU's inputs gate and up [m, I] and `xas` what `fwd_folded` kept →
    /// (dL/dgate, dL/dup, (dA, dB)). None (nothing run) when this linear's forward is not
    /// folded for this batch, LORA_TRAIN_FOLD_BWD=0, or the kernel cannot take the operands.
    pub fn bwd_swiglu_folded(
        &self,
        dy: &Tensor,
        gate: &Tensor,
        up: &Tensor,
        xas: Option<&Tensor>,
        ctx: &Ctx,
    ) -> Result<Option<(Tensor, Tensor, AdapterGrad)>> {
        let (Some(lora), Some(pad), Some(xas)) = (&self.lora, &self.pad, xas) else {
            return Ok(None);
        };
        if !ops::fold::takes_bwd() || Linear::fold_width(&[self], ctx).is_none() {
            return Ok(None);
        }
        let a = ctx.adapter(&lora.a).to_dtype(DType::BF16)?;
        let dy = dy.contiguous()?;
        let (w, s) = (&pad.full, lora.scale);
        let Some(r) = ops::fold::swiglu_down_bwd(&dy, w, pad.col, gate, up, &a, s)? else {
            return Ok(None);
        };
        let db = ops::linear_acc::matmul_tn_f32(&dy, xas)?; // dB = dyᵀ xas [out, r]
        Ok(Some((r.dg, r.du, Some((r.da, db)))))
    }

    pub fn out_features(&self) -> usize {
        self.w.dims()[0]
    }

    /// The adapters of `lins` (linears that share their input) that can run as one: those
    /// without dropout, when there are two or more and they share a scale. Indices into `lins`.
    fn shared(lins: &[&Linear], ctx: &Ctx) -> Vec<usize> {
        let scale = |i: usize| lins[i].lora.as_ref().map(|l| l.scale);
        let idx: Vec<usize> = (0..lins.len())
            .filter(|&i| match &lins[i].lora {
                Some(l) => l.dropout <= 0.0 || ctx.dropout.is_none(),
                None => false,
            })
            .collect();
        match idx.len() >= 2 && idx.windows(2).all(|w| scale(w[0]) == scale(w[1])) {
            true => idx,
            false => Vec::new(),
        }
    }

    /// The shared adapters `idx` of `lins`: their A's stacked [Σ r, in] in `dt`, and each one's
    /// operands.
    fn shared_ops<'a>(
        lins: &[&'a Linear],
        idx: &[usize],
        ctx: &'a Ctx,
        dt: DType,
    ) -> Result<(Tensor, Vec<ops::lora_linear::Adapter<'a>>)> {
        let (a, ads) = Self::shared_adapters(lins, idx, ctx)?;
        Ok((ctx.a_stack(&a, dt)?, ads))
    }

    /// The shared adapters `idx` of `lins`: their A's (as `Var`s) and each one's operands.
    fn shared_adapters<'a>(
        lins: &[&'a Linear],
        idx: &[usize],
        ctx: &'a Ctx,
    ) -> Result<(
        Vec<&'a candle_core::Var>,
        Vec<ops::lora_linear::Adapter<'a>>,
    )> {
        let mut a = Vec::with_capacity(idx.len());
        let mut ads = Vec::with_capacity(idx.len());
        for &i in idx {
            let (lin, lora) = match &lins[i].lora {
                Some(lora) => (lins[i], lora),
                None => candle_core::bail!("{}: shared without an adapter", lins[i].name),
            };
            a.push(&lora.a);
            ads.push(ops::lora_linear::Adapter {
                w: &lin.w,
                bias: lin.b.as_ref(),
                a: ctx.adapter(&lora.a),
                b: ctx.adapter(&lora.b),
                scale: lora.scale,
            });
        }
        Ok((a, ads))
    }

    /// `fwd` of linears that share their input x [m, in]: (y, adapter state) each, in order.
    /// Their adapters' x Aᵀ products are one GEMM over their A's side by side (x is read once,
    /// one launch for two or three).
    pub fn fwd_shared(
        lins: &[&Linear],
        x: &Tensor,
        ctx: &Ctx,
    ) -> Result<Vec<(Tensor, Option<Tensor>)>> {
        let idx = Self::shared(lins, ctx);
        let mut out: Vec<Option<(Tensor, Option<Tensor>)>> = vec![None; lins.len()];
        if !idx.is_empty() {
            let (a, ads) = Self::shared_ops(lins, &idx, ctx, x.dtype())?;
            let ys = ops::lora_linear::lora_fwd_shared(x, &ads, &a)?;
            for (&i, (y, xas)) in idx.iter().zip(ys) {
                out[i] = Some((y, Some(xas)));
            }
        }
        lins.iter()
            .zip(out)
            .map(|(lin, o)| match o {
                Some(o) => Ok(o),
                None => lin.fwd(x, ctx),
            })
            .collect()
    }

    /// The pad width when `lins` (linears that share their input) run folded (`ops::fold`) for
    /// this batch: each padded alike, with an adapter, their B's columns in order, one scale,
    /// no dropout, and the pads' B columns written for this batch. None otherwise.
    pub fn fold_width(lins: &[&Linear], ctx: &Ctx) -> Option<usize> {
        let first = lins.first()?;
        let in_f = first.w.dim(1).ok()?;
        let p = first.pad.as_ref()?.full.dim(1).ok()?.checked_sub(in_f)?;
        let scale = first.lora.as_ref()?.scale;
        let mut ranks = Vec::with_capacity(lins.len());
        for lin in lins {
            let (pad, lora) = (lin.pad.as_ref()?, lin.lora.as_ref()?);
            let dropout = lora.dropout > 0.0 && ctx.dropout.is_some();
            let col: usize = ranks.iter().sum();
            if dropout || pad.col != col || lora.scale != scale || pad.full.dim(1).ok()? != in_f + p
            {
                return None;
            }
            ranks.push(lora.a.dim(0).ok()?);
        }
        (ctx.folded && ops::fold::pad_width(&ranks, in_f) == Some(p)).then_some(p)
    }

    /// `fwd_shared` folded (`ops::fold`), for `lins` whose `fold_width` is p: xp [m, in + p]
    /// holds their input x in its first `in` columns (its next Σ r are written here).
    pub fn fwd_folded(
        lins: &[&Linear],
        xp: &Tensor,
        ctx: &Ctx,
    ) -> Result<Vec<(Tensor, Option<Tensor>)>> {
        let mut a = Vec::with_capacity(lins.len());
        let mut ws = Vec::with_capacity(lins.len());
        let mut ranks = Vec::with_capacity(lins.len());
        let mut scale = 1.0;
        for lin in lins {
            let (Some(lora), Some(pad)) = (&lin.lora, &lin.pad) else {
                candle_core::bail!("{}: folded without an adapter and a pad", lin.name);
            };
            a.push(&lora.a);
            ws.push(&pad.full);
            ranks.push(lora.a.dim(0)?);
            scale = lora.scale;
        }
        let in_f = match lins.first() {
            Some(lin) => lin.w.dim(1)?,
            None => candle_core::bail!("fwd_folded: no linears"),
        };
        let a = ctx.a_stack(&a, xp.dtype())?; // [Σ r, in]
        let (ys, xas) = ops::fold::fwd(xp, in_f, &a, scale, &ws)?;
        let mut off = 0;
        let mut out = Vec::with_capacity(lins.len());
        for (y, r) in ys.into_iter().zip(ranks) {
            out.push((y, Some(xas.narrow(1, off, r)?))); // [m, r], row stride Σ r
            off += r;
        }
        Ok(out)
    }

    /// `bwd` of linears that shared their input x [m, in]: g[i] = dL/dy_i (consumed), xas[i]
    /// what `fwd_shared` kept → dL/dx (the sum over all) and each one's (dA, dB). The shared
    /// adapters' (g B)·A products are one GEMM, their dA one GEMM (x is read once); the base
    /// GEMMs accumulate onto it.
    pub fn bwd_shared(
        lins: &[&Linear],
        x: &Tensor,
        g: Vec<Tensor>,
        xas: &[Option<&Tensor>],
        ctx: &Ctx,
    ) -> Result<(Tensor, Vec<AdapterGrad>)> {
        if let (Some(p), true) = (Self::fold_width(lins, ctx), ops::fold::takes_bwd()) {
            return Self::bwd_folded(lins, x, g, xas, ctx, p);
        }
        let idx = Self::shared(lins, ctx);
        let mut g: Vec<Option<Tensor>> = g.into_iter().map(Some).collect();
        let mut grads: Vec<AdapterGrad> = vec![None; lins.len()];
        let mut dx: Option<Tensor> = None;
        if !idx.is_empty() {
            let (a, ads) = Self::shared_ops(lins, &idx, ctx, x.dtype())?;
            let (gs, xs) = Self::take_shared(lins, &idx, &mut g, xas)?;
            let (d, gr) = ops::lora_linear::lora_bwd_shared(x, gs, &ads, &xs, &a)?;
            dx = Some(d);
            for (&i, gr) in idx.iter().zip(gr) {
                grads[i] = Some(gr);
            }
        }
        for (i, lin) in lins.iter().enumerate() {
            // The shared ones' gradients were taken (and their base GEMMs run) above.
            let Some(gi) = g.get_mut(i).and_then(Option::take) else {
                continue;
            };
            let (d, gr) = lin.bwd(x, &gi, xas.get(i).copied().flatten(), ctx, dx.take())?;
            dx = Some(d);
            grads[i] = gr;
        }
        match dx {
            Some(dx) => Ok((dx, grads)),
            None => candle_core::bail!("bwd_shared: no linears"),
        }
    }

    /// `bwd_shared` for `lins` whose forward ran folded (`fold_width` p): the base GEMMs run
    /// against the padded weights, g_i · W*_i, accumulating one dL/dx [m, in + p] whose pad
    /// columns are then each adapter's g_i B_i (the other linears' columns of W*_i are zero):
    /// no skinny GEMM per adapter for them (each was a read of g_i). s · (g B)·A joins dL/dx
    /// in its first `in` columns, which are returned (rows in + p apart); dA = s · (g B)ᵀ x.
    fn bwd_folded(
        lins: &[&Linear],
        x: &Tensor,
        g: Vec<Tensor>,
        xas: &[Option<&Tensor>],
        ctx: &Ctx,
        p: usize,
    ) -> Result<(Tensor, Vec<AdapterGrad>)> {
        let in_f = x.dim(1)?;
        let mut a = Vec::with_capacity(lins.len());
        let mut grads: Vec<AdapterGrad> = Vec::with_capacity(lins.len());
        let mut dxp: Option<Tensor> = None; // [m, in + p]
        let (mut scale, mut ranks) = (1.0, 0);
        for ((lin, gi), xas) in lins.iter().zip(g).zip(xas) {
            let (Some(lora), Some(pad), Some(xas)) = (&lin.lora, &lin.pad, xas) else {
                candle_core::bail!("{}: folded backward without its adapter state", lin.name);
            };
            let gi = gi.contiguous()?;
            dxp = Some(match dxp {
                None => ops::linear_acc::matmul_scaled(&gi, &pad.full, false, 1.0)?,
                Some(acc) => ops::linear_acc::linear_bwd_acc(&gi, &pad.full, acc)?,
            });
            let db = ops::linear_acc::matmul_tn_f32(&gi, xas)?; // dB = g_iᵀ xas_i [out, r]
            grads.push(Some((db.clone(), db))); // dA set below
            a.push(&lora.a);
            (scale, ranks) = (lora.scale, ranks + lora.a.dim(0)?);
        }
        let Some(dxp) = dxp else {
            candle_core::bail!("bwd_folded: no linears");
        };
        if ranks > p {
            candle_core::bail!("bwd_folded: ranks {ranks} past the pad {p}");
        }
        let gb = dxp.narrow(1, in_f, ranks)?; // [m, Σ r] = g_i B_i side by side, unscaled
        let a = ctx.a_stack(&a, x.dtype())?; // [Σ r, in]
        let dx = ops::linear_acc::linear_bwd_acc_scaled(&gb, &a, dxp.narrow(1, 0, in_f)?, scale)?;
        let da = (ops::linear_acc::matmul_tn_f32(&gb, x)? * scale)?; // [Σ r, in] f32
        let mut off = 0;
        for (gr, lin) in grads.iter_mut().zip(lins) {
            let r = lin.lora.as_ref().map_or(0, |l| l.a.dims()[0]);
            if let Some((da_i, _)) = gr {
                *da_i = da.narrow(0, off, r)?;
            }
            off += r;
        }
        Ok((dx, grads))
    }

    /// `bwd_shared`'s adapter gradients alone, without dL/dx: for an input that needs no
    /// gradient (the first layer's, the frozen embedding's output), so that the base GEMMs'
    /// dL/dx (three of the layer's eleven backward GEMMs at q, k, v) and the adapters' are not
    /// run. Linears without an adapter are skipped; an adapter outside the shared group (its
    /// own dropout) takes `bwd_grads_alone`.
    pub fn grads_shared(
        lins: &[&Linear],
        x: &Tensor,
        g: Vec<Tensor>,
        xas: &[Option<&Tensor>],
        ctx: &Ctx,
    ) -> Result<Vec<AdapterGrad>> {
        let idx = Self::shared(lins, ctx);
        let mut g: Vec<Option<Tensor>> = g.into_iter().map(Some).collect();
        let mut grads: Vec<AdapterGrad> = vec![None; lins.len()];
        if !idx.is_empty() {
            // No stacked A's: without dL/dx nothing multiplies by them.
            let (_, ads) = Self::shared_adapters(lins, &idx, ctx)?;
            let (gs, xs) = Self::take_shared(lins, &idx, &mut g, xas)?;
            let gr = ops::lora_linear::lora_grads_shared(x, gs, &ads, &xs)?;
            for (&i, gr) in idx.iter().zip(gr) {
                grads[i] = Some(gr);
            }
        }
        for (i, lin) in lins.iter().enumerate() {
            let Some(gi) = g.get_mut(i).and_then(Option::take) else {
                continue;
            };
            grads[i] = lin.bwd_grads_alone(x, &gi, xas.get(i).copied().flatten(), ctx)?;
        }
        Ok(grads)
    }

    /// The gradients g[i] (taken) and kept adapter states of the shared linears `idx`.
    fn take_shared<'x>(
        lins: &[&Linear],
        idx: &[usize],
        g: &mut [Option<Tensor>],
        xas: &[Option<&'x Tensor>],
    ) -> Result<(Vec<Tensor>, Vec<&'x Tensor>)> {
        let mut gs = Vec::with_capacity(idx.len());
        let mut xs = Vec::with_capacity(idx.len());
        for &i in idx {
            match (
                g.get_mut(i).and_then(Option::take),
                xas.get(i).copied().flatten(),
            ) {
                (Some(gi), Some(xi)) => {
                    gs.push(gi);
                    xs.push(xi);
                }
                _ => candle_core::bail!(
                    "{}: backward without its gradient or the forward's adapter state",
                    lins[i].name
                ),
            }
        }
        Ok((gs, xs))
    }
}

#[derive(Clone)]
pub struct Layer {
    pub input_norm: Tensor,
    pub post_norm: Tensor,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    pub(crate) eps: f64,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) window: usize,
}

impl Layer {
    /// x: [B, T, C] → [B, T, C]
    pub fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let (b, t, _c) = x.dims3()?;
        let (h, k, d) = (self.heads, self.kv_heads, self.head_dim);
        let hn = ops::rms_norm(x, &self.input_norm, self.eps)?;
        let q = self
            .q
            .forward(&hn, ctx)?
            .reshape((b, t, h, d))?
            .transpose(1, 2)?; // [B, H, T, D]
        let kk = self
            .k
            .forward(&hn, ctx)?
            .reshape((b, t, k, d))?
            .transpose(1, 2)?; // [B, K, T, D]
        let v = self
            .v
            .forward(&hn, ctx)?
            .reshape((b, t, k, d))?
            .transpose(1, 2)?; // [B, K, T, D]
        let q = ops::rope(&q, &ctx.cos, &ctx.sin)?;
        let kk = ops::rope(&kk, &ctx.cos, &ctx.sin)?;
        let (kk, v) = (repeat_kv(&kk, h / k)?, repeat_kv(&v.contiguous()?, h / k)?); // [B, H, T, D]
        let mask = AttnMask {
            window: self.window,
            ..ctx.mask.clone()
        };
        let o = ops::attention(&q, &kk, &v, &mask, 1.0 / (d as f64).sqrt(), ctx.attn_block)?;
        let attn = o.transpose(1, 2)?.reshape((b, t, h * d))?; // [B, T, H·D]
        let x = (x + self.o.forward(&attn, ctx)?)?;
        let hn = ops::rms_norm(&x, &self.post_norm, self.eps)?;
        let a = ops::swiglu(&self.gate.forward(&hn, ctx)?, &self.up.forward(&hn, ctx)?)?; // [B, T, I]
        let m = self.down.forward(&a, ctx)?;
        x + m
    }

    /// The layer's frozen tensors, in a fixed order (norms, then each linear's W, or its
    /// padded W* when folded, and bias): FSDP flattens them into one buffer and puts views of
    /// the gathered buffer back. After changing them, `sync_views` makes each folded W a view
    /// of its W* again.
    pub fn frozen_mut(&mut self) -> Vec<&mut Tensor> {
        let (norms, lins) = self.parts_mut();
        let mut v = Vec::from(norms);
        for lin in lins {
            match &mut lin.pad {
                Some(pad) => v.push(&mut pad.full),
                None => v.push(&mut lin.w),
            }
            v.extend(lin.b.as_mut());
        }
        v
    }

    /// For each tensor of `frozen_mut`, in its order, the linear whose W (or W*) it is; None for
    /// the norms and the biases.
    pub fn frozen_linears(&self) -> Vec<Option<&Linear>> {
        let mut v = vec![None, None];
        for lin in self.linears() {
            v.push(Some(lin));
            if lin.b.is_some() {
                v.push(None);
            }
        }
        v
    }

    /// Each folded linear's W as the first `in` columns of its W* (which `frozen_mut` may have
    /// replaced: FSDP's placeholder, or a gathered view). A placeholder W* (not [out, in + p])
    /// leaves W that placeholder too, so the skeleton holds no weights.
    pub fn sync_views(&mut self) -> Result<()> {
        for lin in self.linears_mut() {
            if let Some(pad) = &lin.pad {
                lin.w = match pad.full.rank() {
                    2 => pad.full.narrow(1, 0, pad.in_f)?,
                    _ => pad.full.clone(),
                };
            }
        }
        Ok(())
    }

    /// Pads this layer's foldable groups (`Model::fold`); their bytes.
    pub fn fold(&mut self) -> Result<usize> {
        let mut bytes = 0;
        for mut group in self.fold_groups() {
            bytes += pad_group(&mut group)?;
        }
        Ok(bytes)
    }

    fn linears_mut(&mut self) -> [&mut Linear; 7] {
        self.parts_mut().1
    }

    /// The two norms and the seven linears, each borrowed apart.
    fn parts_mut(&mut self) -> ([&mut Tensor; 2], [&mut Linear; 7]) {
        (
            [&mut self.input_norm, &mut self.post_norm],
            [
                &mut self.q,
                &mut self.k,
                &mut self.v,
                &mut self.o,
                &mut self.gate,
                &mut self.up,
                &mut self.down,
            ],
        )
    }

    /// The linears whose forward can fold (`ops::fold`), by groups that share their input:
    /// q, k, v; gate, up; down. (o_proj's input is the flash kernel's output.)
    fn fold_groups(&mut self) -> [Vec<&mut Linear>; 3] {
        [
            vec![&mut self.q, &mut self.k, &mut self.v],
            vec![&mut self.gate, &mut self.up],
            vec![&mut self.down],
        ]
    }

    pub fn linears(&self) -> [&Linear; 7] {
        [
            &self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down,
        ]
    }
}

/// `Model::fold` for one group of linears that share their input: each one's W copied into
/// the first `in` columns of a zeroed [out, in + pad] (`ops::fold::pad_width`), its B's
/// columns after those of the linears before it. Returns the pads' bytes; 0 (nothing done)
/// when the group cannot fold, or is folded already.
fn pad_group(lins: &mut [&mut Linear]) -> Result<usize> {
    let mut ranks = Vec::with_capacity(lins.len());
    let mut scale = None;
    for lin in lins.iter() {
        let Some(lora) = &lin.lora else {
            return Ok(0);
        };
        if lin.b.is_some() || lin.pad.is_some() || *scale.get_or_insert(lora.scale) != lora.scale {
            return Ok(0);
        }
        ranks.push(lora.a.dim(0)?);
    }
    let in_f = match lins.first() {
        Some(lin) => lin.w.dim(1)?,
        None => return Ok(0),
    };
    let Some(p) = ops::fold::pad_width(&ranks, in_f) else {
        return Ok(0);
    };
    let (mut col, mut bytes) = (0, 0);
    for lin in lins.iter_mut() {
        let (out, in_f) = lin.w.dims2()?;
        let full = Tensor::zeros((out, in_f + p), lin.w.dtype(), lin.w.device())?;
        full.slice_set(&lin.w.contiguous()?, 1, 0)?;
        lin.w = full.narrow(1, 0, in_f)?;
        bytes += out * p * lin.w.dtype().size_in_bytes();
        lin.pad = Some(Pad { full, col, in_f });
        col += lin.lora.as_ref().map_or(0, |l| l.a.dims()[0]);
    }
    Ok(bytes)
}

/// [B, K, T, D] → [B, K·n, T, D], each kv head repeated n times (GQA).
pub(crate) fn repeat_kv(x: &Tensor, n: usize) -> Result<Tensor> {
    if n == 1 {
        return Ok(x.clone());
    }
    let (b, k, t, d) = x.dims4()?;
    x.unsqueeze(2)?
        .broadcast_as((b, k, n, t, d))?
        .reshape((b, k * n, t, d))
}

/// Called with each group of frozen tensors as it is loaded (see `Model::load_with`).
pub type Loaded<'a> = &'a mut dyn FnMut(Vec<&mut Tensor>) -> anyhow::Result<()>;

pub struct Model {
    pub cfg: ModelConfig,
    pub embed: Tensor, // [V, C]
    pub layers: Vec<Layer>,
    pub norm: Tensor,    // [C]
    pub lm_head: Tensor, // [V, C]; the embedding itself when tied
    pub tied: bool,
    pub dtype: DType,
    pub device: Device,
    inv_freq: Vec<f32>,
}

impl Model {
    /// Memory-maps the checkpoint, casts the base to `dtype` on `device`, and injects fresh
    /// LoRA adapters (A random from `seed`, B zero) on the `spec.targets` modules.
    pub fn load(
        files: &ModelFiles,
        dtype: DType,
        device: &Device,
        spec: &LoraSpec,
        seed: u64,
    ) -> anyhow::Result<Model> {
        Self::load_with(files, dtype, device, spec, seed, false, &mut |_| Ok(()))
    }

    /// `load`, handing each group of frozen tensors to `loaded` as soon as it is on the device:
    /// each decoder layer's (`Layer::frozen_mut` order), then the embedding, final norm and
    /// untied head (`Model::io_mut` order). FSDP keeps a shard and replaces them with
    /// placeholders there, so only one full layer is ever resident. With `fold` each layer is
    /// padded (`Model::fold`, where `ops::fold::takes` the device and dtype) before `loaded`
    /// sees it, so FSDP's shards hold the padded weights.
    #[allow(clippy::too_many_arguments)]
    pub fn load_with(
        files: &ModelFiles,
        dtype: DType,
        device: &Device,
        spec: &LoraSpec,
        seed: u64,
        fold: bool,
        loaded: Loaded,
    ) -> anyhow::Result<Model> {
        let cfg = ModelConfig::from_file(&files.config)?;
        super::check::weights(&cfg, &files.config, &files.weights)?;
        // SAFETY: the files are memory-mapped read-only; like every safetensors reader we
        // assume they are not modified while training runs.
        let st = unsafe { MmapedSafetensors::multi(&files.weights) }
            .with_context(|| format!("cannot read safetensors in {}", files.dir.display()))?;
        let names: std::collections::HashSet<String> =
            st.tensors().into_iter().map(|(n, _)| n).collect();
        let finite = super::check::Finite::default();
        let get = |name: &str, shape: &[usize]| -> anyhow::Result<Tensor> {
            if !names.contains(name) {
                bail!(
                    "tensor `{name}` is missing from the weights in {}",
                    files.dir.display()
                );
            }
            let t = st.load(name, &Device::Cpu)?;
            if t.dims() != shape {
                bail!(
                    "tensor `{name}` in {} has shape {:?}, config.json implies {:?}",
                    files.dir.display(),
                    t.dims(),
                    shape
                );
            }
            finite.watch(name, t.to_dtype(dtype)?.to_device(device)?)
        };
        let has_head = names.contains("lm_head.weight");
        let tied = cfg.tie_word_embeddings.unwrap_or(!has_head);
        if !tied && !has_head {
            bail!(
                "config.json in {} says tie_word_embeddings = false but the weights have no lm_head.weight",
                files.dir.display()
            );
        }
        let m = Self::build(cfg, &get, tied, dtype, device, spec, seed, fold, loaded)?;
        finite.verify(&files.dir, dtype)?;
        Ok(m)
    }

    /// Random weights of a given shape made on the device (benchmarks; no download): linear
    /// and embedding weights N(0, 0.02), norms 1, as transformers initialises a fresh model.
    pub fn random(
        cfg: ModelConfig,
        dtype: DType,
        device: &Device,
        spec: &LoraSpec,
        seed: u64,
    ) -> anyhow::Result<Model> {
        Self::random_with(cfg, dtype, device, spec, seed, false, &mut |_| Ok(()))
    }

    /// `random`, with `fold` and `loaded` as in `load_with`.
    #[allow(clippy::too_many_arguments)]
    pub fn random_with(
        cfg: ModelConfig,
        dtype: DType,
        device: &Device,
        spec: &LoraSpec,
        seed: u64,
        fold: bool,
        loaded: Loaded,
    ) -> anyhow::Result<Model> {
        if !device.is_cpu() {
            device.set_seed(seed)?;
        }
        let get = |name: &str, shape: &[usize]| -> anyhow::Result<Tensor> {
            let t = if name.ends_with("norm.weight") {
                Tensor::ones(shape, DType::F32, device)?
            } else if name.ends_with(".bias") {
                Tensor::zeros(shape, DType::F32, device)?
            } else {
                Tensor::randn(0f32, 0.02, shape, device)?
            };
            Ok(t.to_dtype(dtype)?)
        };
        let tied = cfg.tie_word_embeddings.unwrap_or(false);
        Self::build(cfg, &get, tied, dtype, device, spec, seed, fold, loaded)
    }

    /// Assembles the model from a source of named base tensors (HF names and shapes).
    #[allow(clippy::too_many_arguments)]
    fn build(
        cfg: ModelConfig,
        get: &dyn Fn(&str, &[usize]) -> anyhow::Result<Tensor>,
        tied: bool,
        dtype: DType,
        device: &Device,
        spec: &LoraSpec,
        seed: u64,
        fold: bool,
        loaded: Loaded,
    ) -> anyhow::Result<Model> {
        let fold = fold && ops::fold::takes(device.is_cuda(), dtype);
        let (c, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let (h, k, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let linear =
            |layer: usize, group: &str, module: &str, in_f: usize, out_f: usize, bias: bool| {
                let name = format!("model.layers.{layer}.{group}.{module}");
                let w = get(&format!("{name}.weight"), &[out_f, in_f])?;
                let b = if bias {
                    Some(get(&format!("{name}.bias"), &[out_f])?)
                } else {
                    None
                };
                let m = ALL_LINEAR.iter().position(|x| *x == module).unwrap_or(0) as u64;
                let key = [layer as u64, m];
                let lora = if spec.targets(module) {
                    Some(Lora::init(spec, in_f, out_f, seed, &key, device)?)
                } else {
                    None
                };
                anyhow::Ok(Linear {
                    name,
                    w,
                    b,
                    lora,
                    pad: None,
                    key,
                })
            };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            let mut layer = Layer {
                input_norm: get(&format!("{p}.input_layernorm.weight"), &[c])?,
                post_norm: get(&format!("{p}.post_attention_layernorm.weight"), &[c])?,
                q: linear(l, "self_attn", "q_proj", c, h * d, cfg.qkv_bias)?,
                k: linear(l, "self_attn", "k_proj", c, k * d, cfg.qkv_bias)?,
                v: linear(l, "self_attn", "v_proj", c, k * d, cfg.qkv_bias)?,
                o: linear(l, "self_attn", "o_proj", h * d, c, cfg.o_bias)?,
                gate: linear(l, "mlp", "gate_proj", c, i, cfg.mlp_bias)?,
                up: linear(l, "mlp", "up_proj", c, i, cfg.mlp_bias)?,
                down: linear(l, "mlp", "down_proj", i, c, cfg.mlp_bias)?,
                eps: cfg.rms_norm_eps,
                heads: h,
                kv_heads: k,
                head_dim: d,
                window: cfg.sliding_window.unwrap_or(0),
            };
            if fold {
                layer.fold()?;
            }
            loaded(layer.frozen_mut())?;
            layer.sync_views()?;
            layers.push(layer);
        }
        let embed = get("model.embed_tokens.weight", &[v, c])?;
        let norm = get("model.norm.weight", &[c])?;
        let lm_head = if tied {
            embed.clone()
        } else {
            get("lm_head.weight", &[v, c])?
        };
        let inv_freq = rope::inv_freq(&cfg);
        let mut m = Model {
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            tied,
            dtype,
            device: device.clone(),
            inv_freq,
        };
        loaded(m.io_mut())?;
        if m.tied {
            m.lm_head = m.embed.clone();
        }
        Ok(m)
    }

    /// The frozen tensors outside the decoder layers: embedding, final norm, and the head
    /// unless it is the embedding (tied).
    pub fn io_mut(&mut self) -> Vec<&mut Tensor> {
        let mut v = vec![&mut self.embed, &mut self.norm];
        if !self.tied {
            v.push(&mut self.lm_head);
        }
        v
    }

    /// A model with no decoder layers whose embedding, final norm and head are the given
    /// tensors (`io_mut` order; FSDP's gathered views), for `embed` and `head`.
    pub fn io_view(&self, io: Vec<Tensor>) -> Result<Model> {
        let [embed, norm, rest @ ..] = io.as_slice() else {
            candle_core::bail!("io_view: {} tensors, want embed and norm", io.len());
        };
        let lm_head = match (self.tied, rest) {
            (true, []) => embed.clone(),
            (false, [h]) => h.clone(),
            _ => candle_core::bail!("io_view: a head tensor where tied = {}", self.tied),
        };
        Ok(Model {
            cfg: self.cfg.clone(),
            embed: embed.clone(),
            layers: Vec::new(),
            norm: norm.clone(),
            lm_head,
            tied: self.tied,
            dtype: self.dtype,
            device: self.device.clone(),
            inv_freq: self.inv_freq.clone(),
        })
    }

    /// Moves the base weights of the linears whose adapters' forward can fold into the base
    /// GEMM into padded buffers (`ops::fold`): on CUDA with bf16 weights, unless
    /// LORA_TRAIN_FOLD=0. A group folds when each of its linears has an adapter and no bias,
    /// they share a scale, and their input width is a multiple of 8. `load_with(.., fold =
    /// true, ..)` does the same one layer at a time, before FSDP shards it. Returns the pads'
    /// bytes (the memory plan's `fold` term).
    pub fn fold(&mut self) -> Result<usize> {
        if !ops::fold::takes(self.device.is_cuda(), self.dtype) {
            return Ok(0);
        }
        let mut bytes = 0;
        for layer in &mut self.layers {
            bytes += layer.fold()?;
        }
        Ok(bytes)
    }

    /// Every LoRA adapter with its module name, in layer then module order.
    pub fn adapters(&self) -> impl Iterator<Item = (&str, &Lora)> {
        self.layers
            .iter()
            .flat_map(|l| l.linears())
            .filter_map(|lin| lin.lora.as_ref().map(|a| (lin.name.as_str(), a)))
    }

    /// Every frozen base tensor (the test that no gradient reaches them walks these).
    pub fn base_tensors(&self) -> Vec<&Tensor> {
        let mut v = vec![&self.embed, &self.norm, &self.lm_head];
        for l in &self.layers {
            v.push(&l.input_norm);
            v.push(&l.post_norm);
            for lin in l.linears() {
                v.push(&lin.w);
                v.extend(lin.b.as_ref());
            }
        }
        v
    }

    /// Per-batch context: positions [B×T] (restarting per packed example), segment ids for the
    /// block-diagonal mask (None = one sequence per row), and the dropout key.
    pub fn ctx(
        &self,
        positions: &[u32],
        b: usize,
        t: usize,
        segments: Option<Vec<u32>>,
        dropout: Option<(u64, [u64; 2])>,
    ) -> Result<Ctx> {
        let (cos, sin) = rope::cos_sin(&self.inv_freq, positions, b, t, &self.device)?;
        let segments = segments
            .map(|s| Tensor::from_vec(s, b * t, &self.device))
            .transpose()?;
        let mask = AttnMask {
            segments,
            window: 0,
        };
        let (adapters, adapter_buf) = self.adapters_cast()?;
        let folded = self.write_pads()?;
        Ok(Ctx {
            cos,
            sin,
            mask,
            attn_block: None,
            dropout,
            adapters,
            adapter_buf,
            folded,
        })
    }

    /// Every adapter's A and B in the activation dtype, cast in one launch and viewed out of
    /// one buffer (`Ctx::adapters`, `Ctx::adapter_buf`): on CUDA with bf16 activations only;
    /// empty elsewhere. Per layer the A's come first, side by side in module order, then the
    /// B's: the A's of linears that share an input are then one [Σ r, in] matrix as they lie.
    fn adapters_cast(&self) -> Result<AdapterCopies> {
        #[cfg(feature = "cuda")]
        if let (Device::Cuda(dev), DType::BF16) = (&self.device, self.dtype) {
            use candle_core::{op::BackpropOp, CudaStorage, Storage};
            use ops::multi_tensor::{cast_bf16, f32_addr, MultiT};
            let vars: Vec<&candle_core::Var> = self
                .layers
                .iter()
                .flat_map(|l| {
                    let loras: Vec<&Lora> = l
                        .linears()
                        .into_iter()
                        .filter_map(|x| x.lora.as_ref())
                        .collect();
                    let a = loras.iter().map(|l| &l.a).collect::<Vec<_>>();
                    a.into_iter().chain(loras.into_iter().map(|l| &l.b))
                })
                .collect();
            let mut table = Vec::with_capacity(vars.len());
            for v in &vars {
                let Some(g) = f32_addr(v)? else {
                    return Ok((HashMap::new(), None)); // not f32 and contiguous: cast at each use
                };
                table.push(MultiT {
                    g,
                    n: v.elem_count() as i64,
                    ..Default::default()
                });
            }
            if table.is_empty() {
                return Ok((HashMap::new(), None));
            }
            let buf = cast_bf16(dev, &table)?;
            let n = buf.len();
            let flat = Tensor::from_storage(
                Storage::Cuda(CudaStorage::wrap_cuda_slice(buf, dev.clone())),
                n,
                BackpropOp::none(),
                false,
            );
            let mut out = HashMap::with_capacity(vars.len());
            let mut off = 0;
            for v in vars {
                let k = v.elem_count();
                out.insert(v.id(), flat.narrow(0, off, k)?.reshape(v.dims())?);
                off += k;
            }
            return Ok((out, Some(flat)));
        }
        Ok((HashMap::new(), None))
    }

    /// Every folded linear's B rounded to bf16 into its pad columns (`ops::fold`), in one
    /// launch. Whether they were: false when nothing is folded, or a B is not an f32 CUDA
    /// tensor as stored (then nothing runs folded).
    fn write_pads(&self) -> Result<bool> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = &self.device {
            use ops::multi_tensor::{cast_rows_bf16, f32_addr, MultiT};
            let mut table = Vec::new();
            for lin in self.layers.iter().flat_map(|l| l.linears()) {
                let (Some(pad), Some(lora)) = (&lin.pad, &lin.lora) else {
                    continue;
                };
                if pad.full.rank() != 2 {
                    continue; // FSDP's placeholder: the shards carry the B's (Shards::write_pads)
                }
                let (out, ld) = pad.full.dims2()?;
                let (in_f, r) = (lin.w.dim(1)?, lora.b.dim(1)?);
                let (Some(g), Some(p)) = (f32_addr(&lora.b)?, ops::cuda::addr(&pad.full)?) else {
                    return Ok(false);
                };
                if pad.full.dtype() != DType::BF16
                    || lora.b.dim(0)? != out
                    || in_f + pad.col + r > ld
                {
                    return Ok(false);
                }
                table.push(MultiT {
                    p: p + 2 * (in_f + pad.col) as u64,
                    g,
                    m: r as u64,
                    v: ld as u64,
                    n: (out * r) as i64,
                });
            }
            if table.is_empty() {
                return Ok(false);
            }
            // SAFETY: each destination is its own linear's r pad columns of out rows ld apart
            // (checked above) in a live bf16 buffer on this device; the B's are live f32.
            unsafe { cast_rows_bf16(dev, &table)? };
            return Ok(true);
        }
        Ok(false)
    }

    /// ids: [B, T] u32 → hidden [B, T, C]. The embedding is frozen: no graph is built.
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        self.embed
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, t, self.cfg.hidden_size))
    }

    /// hidden [..., C] → logits [..., V] in f32 (final norm, then the frozen head).
    pub fn head(&self, h: &Tensor) -> Result<Tensor> {
        let hn = ops::rms_norm(h, &self.norm, self.cfg.rms_norm_eps)?;
        ops::frozen_linear(&hn, &self.lm_head, None)?.to_dtype(DType::F32)
    }

    /// The head's loss and its backward without autograd, for training. x: hidden rows
    /// [n, C], targets [n] u32 → (Σ token CE, dL/dx [n, C]) for L = Σ CE / `denom`.
    /// The logits [n, V] stay in the activation dtype; `ops::cross_entropy` does the CE and
    /// its gradient in one kernel on CUDA (on the CPU, the former f32 tensor ops, bit for bit).
    pub fn head_loss_bwd(&self, x: &Tensor, targets: &Tensor, denom: f64) -> Result<(f64, Tensor)> {
        let (ce, dx) = self.head_loss_bwd_dev(x, targets, denom)?;
        Ok((ce.to_scalar::<f32>()? as f64, dx))
    }

    /// `head_loss_bwd` with Σ CE left on the device (a scalar f32 tensor): reading it is a
    /// synchronisation, which the driver does once a micro-batch, after backward is queued.
    pub fn head_loss_bwd_dev(
        &self,
        x: &Tensor,
        targets: &Tensor,
        denom: f64,
    ) -> Result<(Tensor, Tensor)> {
        let eps = self.cfg.rms_norm_eps;
        let hn = ops::rms_norm(x, &self.norm, eps)?; // [n, C]
        let logits = ops::frozen_linear(&hn, &self.lm_head, None)?; // [n, V]
        let (ce_rows, dl) = ops::cross_entropy::cross_entropy_fwd_bwd(&logits, targets, denom)?;
        drop(logits);
        let dhn = dl.matmul(&self.lm_head)?; // [n, C]
        Ok((
            ce_rows.sum_all()?,
            ops::rms_norm_bwd(x, &self.norm, eps, &dhn)?,
        ))
    }

    /// Logits at every position: ids [B, T] → [B, T, V] f32 (whole graph kept: tests, eval).
    pub fn forward(&self, ids: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let mut x = self.embed(ids)?;
        for layer in &self.layers {
            x = layer.forward(&x, ctx)?;
        }
        self.head(&x)
    }
}

/// Sum of token cross-entropies: logits [N, V] f32, targets [N] u32 → scalar f32.
pub fn cross_entropy_sum(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logp = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    logp.gather(&targets.unsqueeze(1)?, 1)?.sum_all()?.neg()
}
