//! A decoder layer's MLP half, y = h + N_mo(down(act(gate(hn), up(hn)))), hn = rms_norm(h):
//! its training forward and hand-written backward, over all tokens at once or over chunks.
//!
//! Every op of the MLP half works on each token alone, so it can run over chunks of rows. At
//! long T a checkpointed layer then holds one chunk's [n, I] gate, up and their gradients
//! instead of [m, I] (Llama-3-8B at 384k tokens: 22 GB of bf16 gate and up alone). The forward
//! of a checkpointed layer runs in chunks, and its backward recomputes each chunk's MLP from
//! the residual h just before that chunk's backward (the FLOPs of recomputing it whole). The
//! backward of a layer that kept its activations runs over the same chunks of them, so the
//! adapters' gradients, sums over the tokens, are added chunk by chunk in one order on every
//! path: on the CPU, checkpointing, chunking and parking change no bit of them (f32).
//!
//! Shapes: m = B·T tokens, n tokens of a chunk, C hidden, I mlp.

use super::decoder::Ctx;
use super::layer::Layer;
use super::layer_train::{add_grad, array, LayerGrads};
use super::linear::Linear;
use crate::ops;
use candle_core::{Result, Tensor};

/// Tokens per MLP chunk of a checkpointed layer (`train.mlp_chunk`'s default): gate and up of
/// a chunk are 0.9 GiB in bf16 at Llama-3-8B (I = 14336); runs of up to this many tokens per
/// micro-batch are not chunked.
pub(crate) const MLP_CHUNK: usize = 16384;

/// The fewest rows a chunk has: a GEMM of fewer rows takes the CPU GEMM's small-matrix path,
/// whose sums run in another order than those of the same rows inside a taller GEMM.
const MIN_ROWS: usize = 8;

/// The (first row, rows) of m rows in chunks of n: the last chunk takes a remainder of fewer
/// than `MIN_ROWS` rows too, so that every chunk's rows are those of the unchunked GEMMs.
pub(super) fn row_chunks(m: usize, n: usize) -> Vec<(usize, usize)> {
    let n = n.max(MIN_ROWS);
    let mut out: Vec<(usize, usize)> = (0..m).step_by(n).map(|r| (r, n.min(m - r))).collect();
    if let [.., (_, a), (_, b)] = out.as_mut_slice() {
        if *b < MIN_ROWS {
            *a += *b;
            out.pop();
        }
    }
    out
}

/// What the MLP half's forward keeps for its backward.
pub(super) struct MlpActs {
    /// gate [m, I] before the activation, and up [m, I]; None while parked in host memory
    /// (train/offload.rs).
    gate_up: Option<[Tensor; 2]>,
    /// [m, C] down_proj's output, before Gemma's norm on it
    mo: Option<Tensor>,
    /// gate's and up's (or gate_up's) adapter states s·(m⊙x)Aᵀ [m, r], then down's.
    xas: Vec<Option<Tensor>>,
    xd: Option<Tensor>,
}

impl MlpActs {
    pub(super) fn tensors(&self) -> impl Iterator<Item = &Tensor> {
        self.gate_up
            .iter()
            .flatten()
            .chain(&self.mo)
            .chain(self.xas.iter().flatten())
            .chain(&self.xd)
    }

    /// gate and up out of the activations, to be parked (`put_gate_up` puts them back).
    pub(super) fn take_gate_up(&mut self) -> Option<[Tensor; 2]> {
        self.gate_up.take()
    }

    /// Puts back what `take_gate_up` took (the same values).
    pub(super) fn put_gate_up(&mut self, gate_up: [Tensor; 2]) {
        self.gate_up = Some(gate_up);
    }

    /// Rows r..r+n of every tensor (views).
    fn rows(&self, r: usize, n: usize) -> Result<MlpActs> {
        let rows = |t: &Tensor| t.narrow(0, r, n);
        let opt = |t: &Option<Tensor>| t.as_ref().map(rows).transpose();
        let gate_up = match &self.gate_up {
            Some([g, u]) => Some([rows(g)?, rows(u)?]),
            None => None,
        };
        Ok(MlpActs {
            gate_up,
            mo: opt(&self.mo)?,
            xas: self.xas.iter().map(opt).collect::<Result<_>>()?,
            xd: opt(&self.xd)?,
        })
    }
}

/// The MLP half's input.
pub(super) enum MlpIn<'a> {
    /// x and the attention half's output [m, C]: h = x + a is made in the norm's pass (a is
    /// freed once the MLP's inputs are made).
    Sum(&'a Tensor, Tensor),
    /// h itself [m, C].
    H(&'a Tensor),
}

impl Layer {
    /// Tokens per chunk for the MLP half of a layer over `m` tokens (the forward and recompute
    /// of a checkpointed layer, the backward of every layer), None when it runs whole: m within
    /// one chunk, a MoE layer, or dropout on an MLP adapter (its masks are drawn over the whole
    /// [m, in]).
    pub(super) fn mlp_chunk(&self, ctx: &Ctx, m: usize) -> Option<usize> {
        let n = ctx.mlp_chunk.filter(|&n| n > 0)?;
        let mut linears = self.mlp_in.iter().chain(&self.down);
        let dense = self.moe.is_none();
        (dense && m > n && linears.all(|l| l.dropout(ctx).is_none())).then_some(n)
    }

    /// The MLP half's forward: (h [m, C], y [m, C] when `output`, the activations when `keep`).
    /// Without `output` down_proj's GEMM is skipped (down's adapter state is all backward
    /// uses; not with Gemma's norm on down's output, whose backward takes that output).
    pub(super) fn mlp_fwd(
        &self,
        input: MlpIn,
        ctx: &Ctx,
        output: bool,
        keep: bool,
    ) -> Result<(Tensor, Option<Tensor>, Option<MlpActs>)> {
        let s = self.spec;
        // gate and up [m, I] each: their adapters' x Aᵀ as one GEMM; folded into the base
        // GEMMs (ops::fold) when the norm writes padded rows
        let gu: Vec<&Linear> = self.mlp_in.iter().collect();
        let width = Linear::fold_width(&gu, ctx);
        // Phi-3's fused gate_up_proj: folded, made as its two parts (no copies out of one
        // output)
        let cuts = self.gate_up_cuts();
        let unfolded = |hn: &Tensor| -> Result<(Vec<Tensor>, Vec<Option<Tensor>>)> {
            Ok(Linear::fwd_shared(&gu, hn, ctx)?.into_iter().unzip())
        };
        let (hres, (ys, xas)) = match input {
            MlpIn::Sum(x, a) => {
                let folded = match width {
                    Some(p) => ops::fold::add_rms_norm_pad(x, &a, &self.post_norm, s.norm, p)?,
                    None => None,
                }; // h [m, C], hn [m, C + pad]
                match folded {
                    Some((hres, xp)) => (hres, Linear::fwd_folded_parts(&gu, &xp, &cuts, ctx)?),
                    None => {
                        let (hres, hn) = ops::add_rms_norm(x, &a, &self.post_norm, s.norm)?;
                        (hres, unfolded(&hn)?)
                    }
                }
            }
            MlpIn::H(h) => {
                let folded = match width {
                    Some(p) => ops::fold::rms_norm_pad(h, &self.post_norm, s.norm, p)?,
                    None => None,
                };
                let outs = match folded {
                    Some(xp) => Linear::fwd_folded_parts(&gu, &xp, &cuts, ctx)?,
                    None => unfolded(&ops::rms_norm(h, &self.post_norm, s.norm)?)?,
                };
                (h.clone(), outs)
            }
        };
        let [gate, up] = self.split_gate_up(ys, 1)?;
        let out_norm = self.extra.mlp_out_norm.as_ref();
        let (y, xd, mo) = if output || out_norm.is_some() {
            // Not accumulated onto h in the GEMM: h is kept for backward (and, unfolded, the
            // adapter's small term would be rounded to bf16 against |h| before the base
            // product joins it, and mostly lost).
            let down = [self.down()?];
            let folded = match Linear::fold_width(&down, ctx) {
                Some(p) => ops::fold::glu_pad(s.act, &gate, &up, p)?,
                None => None,
            }; // [m, I + pad]
            let (mo, xd) = match folded {
                Some(ap) => {
                    let [o] = array(Linear::fwd_folded(&down, &ap, ctx)?)?;
                    o
                }
                None => self.down()?.fwd(&s.act.glu(&gate, &up)?, ctx)?,
            };
            let (mo_kept, mo) = match out_norm {
                Some(w) => {
                    let n = ops::rms_norm(&mo, w, s.norm)?;
                    (Some(mo), n)
                }
                None => (None, mo),
            };
            let y = output.then(|| ops::add(&hres, &mo)).transpose()?;
            (y, xd, mo_kept)
        } else {
            let a = s.act.glu(&gate, &up)?; // [m, I]
            (None, self.down()?.adapter_fwd(&a, ctx)?, None)
        };
        let acts = keep.then_some(MlpActs {
            gate_up: Some([gate, up]),
            mo,
            xas,
            xd,
        });
        Ok((hres, y, acts))
    }

    /// y [m, C] from h [m, C], the MLP half run over chunks of `n` rows.
    pub(super) fn mlp_fwd_chunked(&self, h: &Tensor, ctx: &Ctx, n: usize) -> Result<Tensor> {
        let chunks = row_chunks(h.dim(0)?, n);
        let mut ys = Vec::with_capacity(chunks.len());
        for (r, len) in chunks {
            let hc = h.narrow(0, r, len)?; // [n, C]
            match self.mlp_fwd(MlpIn::H(&hc), ctx, true, false)? {
                (_, Some(y), _) => ys.push(y),
                _ => candle_core::bail!("mlp_fwd_chunked: no output"),
            }
        }
        Tensor::cat(&ys, 0)
    }

    /// The MLP half's backward from dL/dy [m, C] to dL/dgate and dL/dup [m, I] each (down's
    /// and the activation's); down's gradients into `grads`.
    fn mlp_bwd_down(
        &self,
        acts: &mut MlpActs,
        dy: &Tensor,
        ctx: &Ctx,
        grads: &mut LayerGrads,
    ) -> Result<(Tensor, Tensor)> {
        let s = self.spec;
        // dL/d(down's output): through Gemma's norm on it, else dy itself
        let dmo = match (&self.extra.mlp_out_norm, acts.mo.take()) {
            (Some(w), Some(mo)) => ops::rms_norm_bwd(&mo, w, s.norm, dy)?,
            (None, _) => dy.clone(),
            (Some(_), None) => candle_core::bail!("backward: down's output was not kept"),
        };
        let xd = acts.xd.take();
        let Some([gate, up]) = &acts.gate_up else {
            candle_core::bail!("backward: the MLP's gate and up were parked and not put back");
        };
        let down_l = self.down()?;
        // Folded, down's backward and the activation's are one GEMM and one pass (ops::fold).
        // Else down's dL/da needs no a; a is recomputed in the activation's backward pass
        // (over da's buffer) for down's adapter gradient alone.
        let down = down_l.bwd_glu_folded(s.act, &dmo, gate, up, xd.as_ref(), ctx)?;
        match down {
            Some((dgate, dup, g)) => {
                add_grad(grads, down_l, g)?;
                Ok((dgate, dup)) // [m, I] each
            }
            None => {
                let (da, half) = down_l.bwd_dx(&dmo, ctx, None)?; // [m, I]
                let (dgate, dup, a) = s.act.glu_bwd_keep(gate, up, da)?;
                let g = down_l.bwd_grads(&a, &dmo, half, xd.as_ref(), ctx)?;
                add_grad(grads, down_l, g)?;
                Ok((dgate, dup))
            }
        }
    }

    /// gate's and up's backward, given h and hn = rms_norm(h) [m, C]: dL/dh [m, C] (dy, the
    /// residual's share, included); their gradients into `grads`.
    #[allow(clippy::too_many_arguments)]
    fn mlp_bwd_in(
        &self,
        hres: &Tensor,
        hn: Tensor,
        (dgate, dup): (Tensor, Tensor),
        xas: &[Option<Tensor>],
        dy: &Tensor,
        ctx: &Ctx,
        grads: &mut LayerGrads,
    ) -> Result<Tensor> {
        // gate's and up's GEMMs accumulate onto one dL/dhn: the sum needs no pass of its own
        // (gate_up_proj's gradient in its two parts, joined where its GEMMs are not folded)
        let gu: Vec<&Linear> = self.mlp_in.iter().collect();
        let xa: Vec<Option<&Tensor>> = xas.iter().map(Option::as_ref).collect();
        let cuts = self.gate_up_cuts();
        let (dhn, g) = Linear::bwd_shared_parts(&gu, &hn, vec![dgate, dup], &cuts, &xa, ctx)?;
        for (lin, g) in gu.iter().zip(g) {
            add_grad(grads, lin, g)?;
        }
        drop(hn);
        ops::rms_norm_bwd_add(hres, &self.post_norm, self.spec.norm, &dhn, dy) // [m, C]
    }

    /// The MLP half's backward from its activations over all m tokens (kept by the forward, or
    /// recomputed whole): dL/dh [m, C]. `h_of(r, n)` gives rows r..r+n of h and of
    /// hn = rms_norm(h) (recomputed there when the driver did not keep h). Over more tokens
    /// than a chunk it runs chunk by chunk, as `mlp_bwd_chunked` does, so that the adapters'
    /// sums over the tokens are added in the same blocks and order on every path.
    pub(super) fn mlp_bwd(
        &self,
        acts: MlpActs,
        dy: &Tensor,
        ctx: &Ctx,
        grads: &mut LayerGrads,
        h_of: impl Fn(usize, usize) -> Result<(Tensor, Tensor)>,
    ) -> Result<Tensor> {
        let m = dy.dim(0)?;
        let Some(n) = self.mlp_chunk(ctx, m) else {
            return self.mlp_bwd_rows(acts, dy, ctx, grads, || h_of(0, m));
        };
        let chunks = row_chunks(m, n);
        let mut dh = Vec::with_capacity(chunks.len());
        for (r, len) in chunks {
            let dyc = dy.narrow(0, r, len)?; // [n, C]
            dh.push(self.mlp_bwd_rows(acts.rows(r, len)?, &dyc, ctx, grads, || h_of(r, len))?);
        }
        Tensor::cat(&dh, 0)
    }

    /// `mlp_bwd` over its rows at once. `h_of` gives (h, hn), called after down's backward,
    /// when gate and up are freed.
    fn mlp_bwd_rows(
        &self,
        mut acts: MlpActs,
        dy: &Tensor,
        ctx: &Ctx,
        grads: &mut LayerGrads,
        h_of: impl FnOnce() -> Result<(Tensor, Tensor)>,
    ) -> Result<Tensor> {
        let dgu = self.mlp_bwd_down(&mut acts, dy, ctx, grads)?;
        let MlpActs { gate_up, xas, .. } = acts;
        drop(gate_up);
        let (hres, hn) = h_of()?;
        self.mlp_bwd_in(&hres, hn, dgu, &xas, dy, ctx, grads)
    }

    /// The MLP half's backward over chunks of `n` rows of h and dL/dy [m, C]: each chunk's
    /// MLP recomputed from its h, then its backward. dL/dh [m, C].
    pub(super) fn mlp_bwd_chunked(
        &self,
        h: &Tensor,
        dy: &Tensor,
        ctx: &Ctx,
        n: usize,
        grads: &mut LayerGrads,
    ) -> Result<Tensor> {
        let chunks = row_chunks(h.dim(0)?, n);
        let mut dh = Vec::with_capacity(chunks.len());
        for (r, len) in chunks {
            let (hc, dyc) = (h.narrow(0, r, len)?, dy.narrow(0, r, len)?); // [n, C]
            let Some(acts) = self.mlp_fwd(MlpIn::H(&hc), ctx, false, true)?.2 else {
                candle_core::bail!("mlp_bwd_chunked: no activations");
            };
            let hn = || {
                Ok((
                    hc.clone(),
                    ops::rms_norm(&hc, &self.post_norm, self.spec.norm)?,
                ))
            };
            dh.push(self.mlp_bwd_rows(acts, &dyc, ctx, grads, hn)?);
        }
        Tensor::cat(&dh, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::row_chunks;

    #[test]
    fn chunks_cover_the_rows_and_none_is_under_eight() {
        assert_eq!(row_chunks(0, 16), vec![]);
        assert_eq!(row_chunks(5, 16), vec![(0, 5)]);
        assert_eq!(row_chunks(32, 16), vec![(0, 16), (16, 16)]);
        assert_eq!(row_chunks(40, 16), vec![(0, 16), (16, 16), (32, 8)]);
        assert_eq!(row_chunks(39, 16), vec![(0, 16), (16, 23)]);
        assert_eq!(row_chunks(20, 2), vec![(0, 8), (8, 12)]);
    }
}
