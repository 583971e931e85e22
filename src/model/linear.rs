//! LoRA's linear: a frozen linear (W [out, in], optional bias) with an optional adapter, its
//! hand-written forward and backward, alone, for linears that share their input (one GEMM of
//! their adapters' products), and folded into the frozen GEMMs (`ops::fold`).
//!
//! A DoRA adapter (`Lora::m`, `ops::dora`) runs on the per-linear paths alone (`fwd`, `bwd`,
//! ...): its output is rescaled per row after the GEMMs, which the shared and folded paths do
//! not do, so they leave it out.
//!
//! Shapes: m tokens (B·T), in and out the linear's widths, r the adapter's rank.

use super::adapter::Lora;
use super::decoder::Ctx;
use super::parts::{cut, join_parts, row_blocks};
use crate::ops;
use crate::ops::dropout::Dropout;
use crate::ops::glu::Act;
use candle_core::{DType, Result, Tensor};

/// An adapter's gradients in f32: dL/dA [r, in], dL/dB [out, r], and DoRA's dL/dm [out].
#[derive(Clone)]
pub struct LoraGrad {
    pub a: Tensor,
    pub b: Tensor,
    pub(crate) m: Option<Tensor>,
}

impl LoraGrad {
    /// A plain LoRA adapter's (dA, dB).
    pub(crate) fn ab(a: Tensor, b: Tensor) -> Self {
        LoraGrad { a, b, m: None }
    }
}

/// An adapter's gradients, None for a linear without one.
pub(crate) type AdapterGrad = Option<LoraGrad>;

/// What `Linear::bwd_dx` leaves for `Linear::bwd_grads`: s · g B [m, r], the dropout, and for
/// DoRA (n [out] f32, dz = g ⊙ dy [m, out]).
pub struct AdapterHalf {
    gbs: Tensor,
    dropout: Option<Dropout>,
    dora: Option<(Tensor, Tensor)>,
}

/// A frozen linear (W [out, in], optional bias) with an optional LoRA adapter.
#[derive(Clone)]
pub struct Linear {
    /// Module name in the checkpoint, e.g. `model.layers.3.self_attn.q_proj`.
    pub name: String,
    /// [out, in]; a view of `pad`'s first `in` columns when folded.
    pub w: Tensor,
    pub(crate) b: Option<Tensor>,
    /// The adapter, when this linear is a target.
    pub lora: Option<Lora>,
    /// W's wider buffer, when the adapter's forward is folded into the base GEMM.
    pub pad: Option<Pad>,
    /// W in NF4 (`[model] quantize = "nf4"`): the model's `w` is then a placeholder, and
    /// `Layer::resident` puts the dequantized W there for each use.
    pub q: Option<std::sync::Arc<crate::quant::QWeight>>,
    /// (layer, module) index: keys the dropout masks (the model's layer index, so a gathered
    /// or recomputed layer draws the same ones).
    pub(crate) key: [u64; 2],
}

/// A folded linear's W* = [W | pad] [out, in + pad] (`ops::fold`): its B's r columns start at
/// in + `col`; the rest of the pad is zero (the other linears' B columns, and the columns
/// that round its rows up). Under FSDP the skeleton layer's `full` is a placeholder and a
/// gathered layer's a view of the gathered buffer (`Layer::frozen_mut`).
#[derive(Clone)]
pub struct Pad {
    pub(crate) full: Tensor,
    pub(crate) col: usize,
    /// W's columns (`in`): `w` is `full`'s first `in_f` columns.
    pub(crate) in_f: usize,
}

impl Linear {
    /// x: [B, T, in] → [B, T, out]
    pub(crate) fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let Some(lora) = &self.lora else {
            return ops::frozen_linear(x, &self.w, self.b.as_ref());
        };
        let (a, b) = (lora.a.as_tensor(), lora.b.as_tensor());
        let bias = self.b.as_ref().filter(|_| lora.m.is_none());
        let dropout = self.dropout(ctx);
        let z = ops::lora_linear(
            x,
            &self.w,
            bias,
            a,
            b,
            lora.scale,
            dropout,
            ctx.kernels.gemm,
        )?;
        let Some(m) = &lora.m else {
            return Ok(z);
        };
        self.no_dropout(ctx)?;
        // DoRA: m's gradient through g = m / n; n is detached.
        let n = ops::dora::weight_norm(&self.w, a, b, lora.scale)?;
        let g = ops::dora::magnitude_scale(m.as_tensor(), &n)?;
        ops::dora::apply(&z, &g, self.b.as_ref())
    }

    /// DoRA's (n = ‖W + s·B A‖_row, g = m / n), [out] f32 each, from the adapter as it is now
    /// (`ops::dora`); None for a plain adapter or none.
    fn dora(&self, ctx: &Ctx) -> Result<Option<(Tensor, Tensor)>> {
        let Some((lora, m)) = self.lora.as_ref().and_then(|l| Some((l, l.m.as_ref()?))) else {
            return Ok(None);
        };
        self.no_dropout(ctx)?;
        let (a, b) = (lora.a.as_tensor(), lora.b.as_tensor());
        let n = ops::dora::weight_norm(&self.w, a, b, lora.scale)?;
        let g = ops::dora::magnitude_scale(&m.as_tensor().detach(), &n)?;
        Ok(Some((n, g)))
    }

    /// DoRA under dropout is refused where the recipe is read (PEFT's DoRA then recomputes the
    /// base output from the dropped input); this is the backstop.
    fn no_dropout(&self, ctx: &Ctx) -> Result<()> {
        match self.dropout(ctx) {
            Some(_) => candle_core::bail!(
                "{}: DoRA with lora.dropout > 0 is not supported: set lora.dropout = 0",
                self.name
            ),
            None => Ok(()),
        }
    }

    /// Dropout on the adapter input for this batch (`ops::dropout`), keyed by (seed, step,
    /// micro-batch, layer, module): a recomputed layer, and the backward, draw the same mask.
    /// None without dropout (or at eval).
    pub fn dropout(&self, ctx: &Ctx) -> Option<Dropout> {
        let (seed, batch) = ctx.dropout?;
        let d = Dropout::new(self.lora.as_ref()?.dropout, seed, batch, self.key)?;
        Some(d.fused(ctx.kernels.dropout_fused))
    }

    /// The forward without a graph, for the hand-written layer backward.
    /// x: [m, in] → (y [m, out], the adapter's s · (m ⊙ x) Aᵀ [m, r] if it has one).
    pub fn fwd(&self, x: &Tensor, ctx: &Ctx) -> Result<(Tensor, Option<Tensor>)> {
        let Some(lora) = &self.lora else {
            return Ok((ops::frozen_linear(x, &self.w, self.b.as_ref())?, None));
        };
        let dropout = self.dropout(ctx);
        let dora = self.dora(ctx)?;
        let (z, xas) = ops::lora_linear::lora_fwd(
            x,
            &self.w,
            self.b.as_ref().filter(|_| dora.is_none()),
            ctx.adapter(&lora.a),
            ctx.adapter(&lora.b),
            lora.scale,
            dropout.as_ref(),
            ctx.kernels.gemm,
        )?;
        let y = match &dora {
            Some((_, g)) => ops::dora::apply(&z, g, self.b.as_ref())?,
            None => z,
        };
        Ok((y, Some(xas)))
    }

    /// `fwd`'s output again, from x and the adapter state `fwd` returned (no x Aᵀ product).
    pub(crate) fn fwd_again(&self, x: &Tensor, xas: Option<&Tensor>, ctx: &Ctx) -> Result<Tensor> {
        match (&self.lora, xas) {
            (Some(lora), Some(xas)) => {
                let b = ctx.adapter(&lora.b);
                let dora = self.dora(ctx)?;
                let bias = self.b.as_ref().filter(|_| dora.is_none());
                let z = ops::lora_linear::with_base(x, &self.w, bias, xas, b, ctx.kernels.gemm)?;
                match &dora {
                    Some((_, g)) => ops::dora::apply(&z, g, self.b.as_ref()),
                    None => Ok(z),
                }
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
    pub(crate) fn adapter_fwd(&self, x: &Tensor, ctx: &Ctx) -> Result<Option<Tensor>> {
        let Some(lora) = &self.lora else {
            return Ok(None);
        };
        let (a, dropout) = (ctx.adapter(&lora.a), self.dropout(ctx));
        ops::lora_linear::lora_xas(x, a, lora.scale, dropout.as_ref(), ctx.kernels.gemm).map(Some)
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
        if let (Some(lora), Some(d), Some(xas)) = (&self.lora, self.dropout(ctx), xas) {
            // Under dropout the adapter's dL/dx term and dA are one pass (ops::fold_drop).
            let (a, b) = (ctx.adapter(&lora.a), ctx.adapter(&lora.b));
            let w = &self.w;
            let (dx, da, db) = ops::lora_linear::lora_bwd(
                x,
                g,
                w,
                a,
                b,
                lora.scale,
                Some(&d),
                xas,
                acc,
                ctx.kernels.gemm,
            )?;
            return Ok((dx, Some(LoraGrad::ab(da, db))));
        }
        let (dx, half) = self.bwd_dx(g, ctx, acc)?;
        Ok((dx, self.bwd_grads(x, g, half, xas, ctx)?))
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
                Some(acc) => ops::linear_acc::linear_bwd_acc(g, &self.w, acc, ctx.kernels.gemm)?,
                None => g.contiguous()?.matmul(&self.w)?, // dx = g W
            };
            return Ok((dx, None));
        };
        let g = g.contiguous()?;
        let dropout = self.dropout(ctx);
        let dora = self.dora(ctx)?;
        // DoRA: the LoRA backward takes dz = g ⊙ dy [m, out] for dy
        let g = match &dora {
            Some((_, gs)) => ops::dora::scale_grad(&g, gs)?,
            None => g,
        };
        let (dx, gbs) = ops::lora_linear::lora_bwd_dx(
            &g,
            &self.w,
            ctx.adapter(&lora.a),
            ctx.adapter(&lora.b),
            lora.scale,
            dropout.as_ref(),
            acc,
            ctx.kernels.gemm,
        )?;
        let dora = dora.map(|(n, _)| (n, g));
        Ok((dx, Some(AdapterHalf { gbs, dropout, dora })))
    }

    /// `bwd`'s adapter gradients alone, without dL/dx (none of its GEMMs run): x [m, in],
    /// g [m, out], `xas` what `fwd` kept. None without an adapter.
    pub(crate) fn bwd_grads_alone(
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
        let b = ctx.adapter(&lora.b);
        let dora = match self.dora(ctx)? {
            Some((n, gs)) => Some((n, ops::dora::scale_grad(&g, &gs)?)), // dz = g ⊙ dy
            None => None,
        };
        let dz = dora.as_ref().map_or(&g, |(_, dz)| dz);
        let gbs = ops::lora_linear::lora_gbs(dz, b, lora.scale, ctx.kernels.gemm)?;
        let dropout = self.dropout(ctx); // the forward's (keyed)
        let half = AdapterHalf { gbs, dropout, dora };
        self.bwd_grads(x, &g, Some(half), xas, ctx)
    }

    /// The second half of `bwd_dx`: (dA, dB) from x [m, in], the same g, what `bwd_dx`
    /// returned and what `fwd` kept. None without an adapter.
    pub fn bwd_grads(
        &self,
        x: &Tensor,
        g: &Tensor,
        half: Option<AdapterHalf>,
        xas: Option<&Tensor>,
        ctx: &Ctx,
    ) -> Result<AdapterGrad> {
        match (half, xas) {
            (Some(h), Some(xas)) => {
                let g = g.contiguous()?;
                let (d, gemm) = (h.dropout.as_ref(), ctx.kernels.gemm);
                let Some((n, dz)) = &h.dora else {
                    let (da, db) = ops::lora_linear::lora_grads(x, &g, &h.gbs, d, xas, gemm)?;
                    return Ok(Some(LoraGrad::ab(da, db)));
                };
                // DoRA: dm = Σ dy ⊙ z / n, z = x Wᵀ + xas Bᵀ [m, out] recomputed (one GEMM)
                let Some(lora) = &self.lora else {
                    candle_core::bail!("{}: DoRA backward without an adapter", self.name)
                };
                let b = ctx.adapter(&lora.b);
                let z = ops::lora_linear::with_base(x, &self.w, None, xas, b, gemm)?;
                let dm = ops::dora::grad_m(&g, &z, n)?;
                drop(z);
                let (da, db) = ops::lora_linear::lora_grads(x, dz, &h.gbs, d, xas, gemm)?;
                Ok(Some(LoraGrad {
                    a: da,
                    b: db,
                    m: Some(dm),
                }))
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

    /// down_proj's backward with the gated activation's (`act`), folded
    /// (`ops::fold::glu_down_bwd`): from dy [m, out], the activation's inputs gate and up
    /// [m, I] and `xas` what `fwd_folded` kept → (dL/dgate, dL/dup, (dA, dB)). None (nothing
    /// run) when this linear's forward is not folded for this batch, or the kernel cannot take
    /// the operands.
    pub(crate) fn bwd_glu_folded(
        &self,
        act: Act,
        dy: &Tensor,
        gate: &Tensor,
        up: &Tensor,
        xas: Option<&Tensor>,
        ctx: &Ctx,
    ) -> Result<Option<(Tensor, Tensor, AdapterGrad)>> {
        let (Some(lora), Some(pad), Some(xas)) = (&self.lora, &self.pad, xas) else {
            return Ok(None);
        };
        if Linear::fold_width(&[self], ctx).is_none() {
            return Ok(None);
        }
        let a = ctx.adapter(&lora.a).to_dtype(DType::BF16)?;
        let dy = dy.contiguous()?;
        let (w, s, gemm) = (&pad.full, lora.scale, ctx.kernels.gemm);
        let dropout = self.dropout(ctx);
        let Some(r) = ops::fold::glu_down_bwd(
            act,
            &dy,
            w,
            pad.col,
            gate,
            up,
            &a,
            s,
            dropout.as_ref(),
            gemm,
        )?
        else {
            return Ok(None);
        };
        let db = ops::linear_acc::matmul_tn_f32(&dy, xas, gemm)?; // dB = dyᵀ xas [out, r]
        Ok(Some((r.dg, r.du, Some(LoraGrad::ab(r.da, db)))))
    }

    /// Rows of W: the output width.
    pub fn out_features(&self) -> usize {
        self.w.dims()[0]
    }

    /// The adapters of `lins` (linears that share their input) that can run as one: those
    /// without dropout or DoRA, when there are two or more and they share a scale. Indices
    /// into `lins`.
    fn shared(lins: &[&Linear], ctx: &Ctx) -> Vec<usize> {
        let scale = |i: usize| lins[i].lora.as_ref().map(|l| l.scale);
        let idx: Vec<usize> = (0..lins.len())
            .filter(|&i| match &lins[i].lora {
                Some(l) if l.m.is_some() => false,
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
            let ys = ops::lora_linear::lora_fwd_shared(x, &ads, &a, ctx.kernels.gemm)?;
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
    /// this batch: each padded alike, with a plain (not DoRA) adapter, their B's columns in
    /// order, one scale, dropout on all or none, and the pads' B columns written for this
    /// batch. None otherwise.
    pub fn fold_width(lins: &[&Linear], ctx: &Ctx) -> Option<usize> {
        let first = lins.first()?;
        let in_f = first.w.dim(1).ok()?;
        let p = first.pad.as_ref()?.full.dim(1).ok()?.checked_sub(in_f)?;
        let scale = first.lora.as_ref()?.scale;
        let dropout = first.dropout(ctx).is_some();
        let mut ranks = Vec::with_capacity(lins.len());
        for lin in lins {
            let (pad, lora) = (lin.pad.as_ref()?, lin.lora.as_ref()?);
            if lora.m.is_some() {
                return None;
            }
            let col: usize = ranks.iter().sum();
            let alike = lin.dropout(ctx).is_some() == dropout && lora.scale == scale;
            if !alike || pad.col != col || pad.full.dim(1).ok()? != in_f + p {
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
        let (ys, xas) = Self::fwd_folded_parts(lins, xp, &[], ctx)?;
        Ok(ys.into_iter().zip(xas).collect())
    }

    /// `fwd_folded` with one fused linear's output made in parts: `cuts` are the widths of
    /// row blocks of its W (Phi-3's qkv_proj: H·D, K·D, K·D; gate_up_proj: I, I), each block
    /// one GEMM into a tensor of its own, so q, k, v (gate, up) come out contiguous with no
    /// copy out of one wide output. Without cuts each linear is one part. (The parts in
    /// order, [m, cut] each; each linear's adapter state [m, r].)
    pub(crate) fn fwd_folded_parts(
        lins: &[&Linear],
        xp: &Tensor,
        cuts: &[usize],
        ctx: &Ctx,
    ) -> Result<(Vec<Tensor>, Vec<Option<Tensor>>)> {
        let mut a = Vec::with_capacity(lins.len());
        let mut ws = Vec::with_capacity(lins.len());
        let mut ranks = Vec::with_capacity(lins.len());
        let mut scale = 1.0;
        for lin in lins {
            let (Some(lora), Some(pad)) = (&lin.lora, &lin.pad) else {
                candle_core::bail!("{}: folded without an adapter and a pad", lin.name);
            };
            a.push(&lora.a);
            ws.extend(row_blocks(&pad.full, cuts, lins.len())?);
            ranks.push(lora.a.dim(0)?);
            scale = lora.scale;
        }
        let in_f = match lins.first() {
            Some(lin) => lin.w.dim(1)?,
            None => candle_core::bail!("fwd_folded: no linears"),
        };
        let a = ctx.a_stack(&a, xp.dtype())?; // [Σ r, in]
        let drops: Vec<Dropout> = lins.iter().filter_map(|l| l.dropout(ctx)).collect();
        let ws: Vec<&Tensor> = ws.iter().collect();
        let (ys, xas) = ops::fold::fwd(xp, in_f, &a, scale, &drops, &ws, ctx.kernels.gemm)?;
        // each linear's [m, r], row stride Σ r
        let states = cut(&xas, 1, &ranks)?.into_iter().map(Some).collect();
        Ok((ys, states))
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
        Self::bwd_shared_parts(lins, x, g, &[], xas, ctx)
    }

    /// `bwd_shared` for outputs made in parts (`fwd_folded_parts`): g holds dL/d(part) for
    /// each part, in order (one fused linear's `cuts`, or one part per linear without). Folded,
    /// each part's GEMMs take its row block of W*; else the parts are joined first.
    pub(crate) fn bwd_shared_parts(
        lins: &[&Linear],
        x: &Tensor,
        g: Vec<Tensor>,
        cuts: &[usize],
        xas: &[Option<&Tensor>],
        ctx: &Ctx,
    ) -> Result<(Tensor, Vec<AdapterGrad>)> {
        if let Some(p) = Self::fold_width(lins, ctx) {
            return Self::bwd_folded(lins, x, g, cuts, xas, ctx, p);
        }
        let g = join_parts(g, cuts)?;
        let idx = Self::shared(lins, ctx);
        let mut g: Vec<Option<Tensor>> = g.into_iter().map(Some).collect();
        let mut grads: Vec<AdapterGrad> = vec![None; lins.len()];
        let mut dx: Option<Tensor> = None;
        if !idx.is_empty() {
            let (a, ads) = Self::shared_ops(lins, &idx, ctx, x.dtype())?;
            let (gs, xs) = Self::take_shared(lins, &idx, &mut g, xas)?;
            let (d, gr) =
                ops::lora_linear::lora_bwd_shared(x, gs, &ads, &xs, &a, ctx.kernels.gemm)?;
            dx = Some(d);
            for (&i, gr) in idx.iter().zip(gr) {
                grads[i] = Some(LoraGrad::ab(gr.0, gr.1));
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
    /// Under dropout each adapter's term is masked by its own mask and dA takes m_i ⊙ x, both
    /// in one pass (`ops::fold_drop::bwd`).
    fn bwd_folded(
        lins: &[&Linear],
        x: &Tensor,
        g: Vec<Tensor>,
        cuts: &[usize],
        xas: &[Option<&Tensor>],
        ctx: &Ctx,
        p: usize,
    ) -> Result<(Tensor, Vec<AdapterGrad>)> {
        use ops::linear_acc::{
            linear_bwd_acc, linear_bwd_acc_scaled, matmul_scaled, matmul_tn_f32,
        };
        let (in_f, gemm) = (x.dim(1)?, ctx.kernels.gemm);
        let mut a = Vec::with_capacity(lins.len());
        let mut grads: Vec<AdapterGrad> = Vec::with_capacity(lins.len());
        let mut dxp: Option<Tensor> = None; // [m, in + p]
        let (mut scale, mut ranks) = (1.0, Vec::with_capacity(lins.len()));
        let mut g = g.into_iter();
        for (lin, xas) in lins.iter().zip(xas) {
            let (Some(lora), Some(pad), Some(xas)) = (&lin.lora, &lin.pad, xas) else {
                candle_core::bail!("{}: folded backward without its adapter state", lin.name);
            };
            let mut dbs = Vec::with_capacity(cuts.len().max(1));
            for w in row_blocks(&pad.full, cuts, lins.len())? {
                let Some(gi) = g.next() else {
                    candle_core::bail!("{}: folded backward short of gradients", lin.name);
                };
                let gi = gi.contiguous()?;
                dxp = Some(match dxp {
                    None => matmul_scaled(&gi, &w, false, 1.0, gemm)?,
                    Some(acc) => linear_bwd_acc(&gi, &w, acc, gemm)?,
                });
                dbs.push(matmul_tn_f32(&gi, xas, gemm)?); // dB = g_iᵀ xas_i [out, r]
            }
            let db = match dbs.len() {
                1 => dbs.remove(0),
                _ => Tensor::cat(&dbs, 0)?, // the parts' rows of dB [out, r]
            };
            grads.push(Some(LoraGrad::ab(db.clone(), db))); // dA set below
            a.push(&lora.a);
            ranks.push(lora.a.dim(0)?);
            scale = lora.scale;
        }
        let Some(dxp) = dxp else {
            candle_core::bail!("bwd_folded: no linears");
        };
        let sum_r: usize = ranks.iter().sum();
        if sum_r > p {
            candle_core::bail!("bwd_folded: ranks {sum_r} past the pad {p}");
        }
        let gb = dxp.narrow(1, in_f, sum_r)?; // [m, Σ r] = g_i B_i side by side, unscaled
        let a = ctx.a_stack(&a, x.dtype())?; // [Σ r, in]
        let drops: Vec<Dropout> = lins.iter().filter_map(|l| l.dropout(ctx)).collect();
        let (dx, da) = match drops.is_empty() {
            true => (
                linear_bwd_acc_scaled(&gb, &a, dxp.narrow(1, 0, in_f)?, scale, gemm)?,
                (matmul_tn_f32(&gb, x, gemm)? * scale)?, // [Σ r, in] f32
            ),
            false => {
                let dx = dxp.narrow(1, 0, in_f)?;
                ops::fold_drop::bwd(x, dx, &gb, &a, &drops, scale, gemm)?
            }
        };
        for (gr, da_i) in grads.iter_mut().zip(cut(&da, 0, &ranks)?) {
            if let Some(gr) = gr {
                gr.a = da_i; // [r, in]
            }
        }
        Ok((dx, grads))
    }

    /// `bwd_shared`'s adapter gradients alone, without dL/dx: for an input that needs no
    /// gradient (the first layer's, the frozen embedding's output), so that the base GEMMs'
    /// dL/dx (three of the layer's eleven backward GEMMs at q, k, v) and the adapters' are not
    /// run. Linears without an adapter are skipped; an adapter outside the shared group (its
    /// own dropout) takes `bwd_grads_alone`.
    pub(crate) fn grads_shared(
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
            let gr = ops::lora_linear::lora_grads_shared(x, gs, &ads, &xs, ctx.kernels.gemm)?;
            for (&i, gr) in idx.iter().zip(gr) {
                grads[i] = Some(LoraGrad::ab(gr.0, gr.1));
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
