//! Causal attention that never keeps the [T × T] score matrix: forward runs over blocks of
//! queries and saves only the output O and the row log-sum-exp L; backward recomputes each
//! block's probabilities from L (the flash-attention recurrence, with cuBLAS GEMMs per block
//! and three fused kernels: masked log-sum-exp, masked exp, softmax backward).
//!
//! Masking is computed from indices, never materialised: causal, optionally block-diagonal
//! (packed examples: query i sees key j only within its segment), optionally a prefix tree
//! (`AttnMask::prefix_tree`: a preference pair's two completions share its prompt) and a
//! sliding window. Gemma 2's
//! soft-cap, z = cap · tanh(scale · s / cap), is applied to each score as the kernels read it;
//! its backward multiplies dS by scale · (1 − (z / cap)²), from the block's scores kept for it.
//!
//! Shapes: q, k, v, O: [B, H, T, D] (k, v already repeated for GQA); L: [B, H, T] f32;
//! a block of bq queries starting at s sees keys [0, e) with e = s + bq.

mod sinks;

use super::attach::attach3;
use super::{cpu_as_f32, cpu_from_f32};
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, D,
};
pub use sinks::{apply_sinks, apply_sinks_rows};

/// Which keys a query may see.
#[derive(Clone, Debug, Default)]
pub struct AttnMask {
    /// Per-token example ids, u32 [B × T] on the model's device: query i sees key j only if
    /// they match. `None`: every row is one sequence.
    pub segments: Option<Tensor>,
    /// The segment ids are prefix-tree ids `example << 2 | branch` (branch 0: the example's
    /// shared prefix; 1, 2: branches after it): query i sees key j where they match, or where
    /// j is the prefix of i's example. Ids stay non-decreasing along a row (the flash kernels
    /// bound each example by binary search); padding's u32::MAX is never a prefix.
    pub prefix_tree: bool,
    /// Keys this many or more positions back are masked (0 = unlimited).
    pub window: usize,
    /// Scores soft-capped at this before the mask (0 = none; Gemma 2's attn_logit_softcapping).
    pub softcap: f32,
    /// A logit per head [H] that joins each row's softmax denominator (gpt-oss's sinks:
    /// `sinks.rs`), applied to the plain pass's O and L (blockwise or tensor cores).
    pub sinks: Option<Tensor>,
}

/// Index arithmetic shared by the three block kernels.
#[derive(Clone)]
struct Block {
    q_off: usize, // first query of the block
    t: usize,     // full sequence length (segment ids are [B × T])
    window: usize,
    scale: f32,
    /// Soft-cap (0 = none).
    cap: f32,
    seg: Option<Tensor>,
    /// `AttnMask::prefix_tree`.
    tree: bool,
}

impl Block {
    /// A raw score as the softmax takes it: scaled, and capped where there is a cap.
    fn score(&self, s: f32) -> f32 {
        match self.cap {
            0.0 => s * self.scale,
            c => c * (s * self.scale / c).tanh(),
        }
    }

    fn seg_host(&self) -> Result<Option<Vec<u32>>> {
        self.seg
            .as_ref()
            .map(|s| s.flatten_all()?.to_vec1::<u32>())
            .transpose()
    }

    fn allowed(&self, seg: &Option<Vec<u32>>, b: usize, i: usize, j: usize) -> bool {
        j <= i
            && (self.window == 0 || i - j < self.window)
            && seg.as_ref().is_none_or(|s| {
                let (si, sj) = (s[b * self.t + i], s[b * self.t + j]);
                si == sj || (self.tree && tree_prefix(si, sj))
            })
    }
}

/// Prefix-tree ids (`AttnMask::prefix_tree`): whether key id `sj` is the shared prefix of
/// query id `si`'s example (the same example, branch 0).
pub(crate) fn tree_prefix(si: u32, sj: u32) -> bool {
    si >> 2 == sj >> 2 && sj & 3 == 0
}

/// scores [B, H, bq, e] → L [B, H, bq] f32 over the allowed keys, of scale · scores.
struct MaskedLse(Block);
/// (scores, L) → P = exp(scale · scores − L) on allowed keys, else 0; scores' dtype.
struct MaskedExp(Block);
/// (P, dP, δ) → dS = scale · P ⊙ (dP − δ), δ = rowsum(dO ⊙ O) [B, H, bq] f32; with a cap,
/// × (1 − tanh²(scale · s / cap)) from the block's raw scores s (P's dtype and shape).
struct SoftmaxBwd {
    scale: f32,
    cap: Option<(f32, Tensor)>,
}

impl CustomOp1 for MaskedLse {
    fn name(&self) -> &'static str {
        "masked-lse"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (b, h, bq, e) = l.shape().dims4()?;
        let x = cpu_as_f32(s, l)?;
        let seg = self.0.seg_host()?;
        let mut out = vec![0f32; b * h * bq];
        for (row, o) in out.iter_mut().enumerate() {
            let (bi, i) = (row / (h * bq), self.0.q_off + row % bq);
            let r = &x[row * e..(row + 1) * e];
            let ok = |j: usize| self.0.allowed(&seg, bi, i, j);
            let m = (0..e)
                .filter(|&j| ok(j))
                .map(|j| self.0.score(r[j]))
                .fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = (0..e)
                .filter(|&j| ok(j))
                .map(|j| (self.0.score(r[j]) - m).exp())
                .sum();
            *o = m + sum.ln();
        }
        Ok((CpuStorage::F32(out), (b, h, bq).into()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (b, h, bq, _) = l.shape().dims4()?;
        let out = cuda::masked_lse(
            s,
            l,
            self.0.seg.as_ref(),
            self.0.t,
            self.0.q_off,
            self.0.window,
            self.0.tree,
            [self.0.scale, self.0.cap],
        )?;
        Ok((out, (b, h, bq).into()))
    }
}

impl CustomOp2 for MaskedExp {
    fn name(&self) -> &'static str {
        "masked-exp"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        lse: &CpuStorage,
        ll: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, h, bq, e) = l.shape().dims4()?;
        let x = cpu_as_f32(s, l)?;
        let lse = cpu_as_f32(lse, ll)?;
        let seg = self.0.seg_host()?;
        let mut p = vec![0f32; x.len()];
        for row in 0..b * h * bq {
            let (bi, i) = (row / (h * bq), self.0.q_off + row % bq);
            for j in 0..e {
                if self.0.allowed(&seg, bi, i, j) {
                    p[row * e + j] = (self.0.score(x[row * e + j]) - lse[row]).exp();
                }
            }
        }
        Ok((cpu_from_f32(p, s)?, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
        lse: &candle_core::CudaStorage,
        ll: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::masked_exp(
            s,
            l,
            lse,
            ll,
            self.0.seg.as_ref(),
            self.0.t,
            self.0.q_off,
            self.0.window,
            self.0.tree,
            [self.0.scale, self.0.cap],
        )?;
        Ok((out, l.shape().clone()))
    }
}

impl CustomOp3 for SoftmaxBwd {
    fn name(&self) -> &'static str {
        "softmax-bwd"
    }

    fn cpu_fwd(
        &self,
        p: &CpuStorage,
        pl: &Layout,
        dp: &CpuStorage,
        dpl: &Layout,
        delta: &CpuStorage,
        dl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let e = *pl.dims().last().unwrap_or(&1);
        let (pv, dpv, dv) = (
            cpu_as_f32(p, pl)?,
            cpu_as_f32(dp, dpl)?,
            cpu_as_f32(delta, dl)?,
        );
        let sc = self.scale;
        let mut ds: Vec<f32> = pv
            .iter()
            .zip(&dpv)
            .enumerate()
            .map(|(k, (p, dp))| p * (dp - dv[k / e]) * sc)
            .collect();
        if let Some((c, s)) = &self.cap {
            let s = s.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            for (d, s) in ds.iter_mut().zip(s) {
                let t = (s * sc / c).tanh();
                *d *= 1.0 - t * t;
            }
        }
        Ok((cpu_from_f32(ds, p)?, pl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        p: &candle_core::CudaStorage,
        pl: &Layout,
        dp: &candle_core::CudaStorage,
        dpl: &Layout,
        delta: &candle_core::CudaStorage,
        dl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let cap = self.cap.as_ref().map(|(c, s)| (*c, s.storage_and_layout()));
        let cap = match &cap {
            Some((c, (s, l))) => match &**s {
                candle_core::Storage::Cuda(cs) => Some((*c, cs, *l)),
                _ => candle_core::bail!("softmax_bwd: scores are not on the GPU"),
            },
            None => None,
        };
        Ok((
            cuda::softmax_bwd(p, pl, dp, dpl, delta, dl, self.scale, cap)?,
            pl.shape().clone(),
        ))
    }
}

/// Queries per block: the [B, H, bq, T] score block stays within ~128 MiB of 16-bit values.
pub(crate) fn default_block(b: usize, h: usize, t: usize) -> usize {
    let per_query = (b * h * t * 2).max(1);
    ((128usize << 20) / per_query).clamp(16, t.max(16)).min(t)
}

/// softmax(scale · q kᵀ + mask) v, differentiable in q, k, v. `block`: queries per block
/// (None: `default_block`).
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttnMask,
    scale: f64,
    block: Option<usize>,
) -> Result<Tensor> {
    let (o, lse) = attention_fwd(&q.detach(), &k.detach(), &v.detach(), mask, scale, block)?;
    let mask = mask.clone();
    let backward = move |q: &Tensor, k: &Tensor, v: &Tensor, o: &Tensor, g: &Tensor| {
        let delta = attention_delta(g, o)?;
        let (dq, dk, dv) = attention_bwd(q, k, v, g, &delta, &lse, &mask, scale, block)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    };
    attach3(q, k, v, o, Box::new(backward))
}

/// δ of `attention_delta` from token-major rows: dO, O [B·T, H·D] → [B, H, T] f32, in one
/// pass on CUDA (the composite casts both to f32, multiplies, sums and transposes).
pub fn attention_delta_rows(
    d_o: &Tensor,
    o: &Tensor,
    b: usize,
    t: usize,
    h: usize,
) -> Result<Tensor> {
    let d = o.dim(1)? / h.max(1);
    if o.device().is_cuda() {
        let op = RowDot { bthd: [b, t, h, d] };
        return d_o.contiguous()?.apply_op2_no_bwd(&o.contiguous()?, &op);
    }
    attention_delta(&d_o.reshape((b, t, h, d))?, &o.reshape((b, t, h, d))?)?
        .transpose(1, 2)?
        .contiguous()
}

struct RowDot {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    bthd: [usize; 4],
}

impl CustomOp2 for RowDot {
    fn name(&self) -> &'static str {
        "row-dot"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("row-dot: the CPU takes the composite")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        o: &candle_core::CudaStorage,
        ol: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let [b, t, h, _] = self.bthd;
        Ok((cuda::row_dot(g, gl, o, ol, self.bthd)?, (b, h, t).into()))
    }
}

/// δ = rowsum(dO ⊙ O): dO, O [B, H, T, D] (any layout) → [B, H, T] f32.
pub fn attention_delta(d_o: &Tensor, o: &Tensor) -> Result<Tensor> {
    (d_o.to_dtype(DType::F32)? * o.to_dtype(DType::F32)?)?.sum(D::Minus1)
}

fn block_of(mask: &AttnMask, t: usize, scale: f64) -> Block {
    Block {
        q_off: 0,
        t,
        window: mask.window,
        scale: scale as f32,
        cap: mask.softcap,
        seg: mask.segments.clone(),
        tree: mask.prefix_tree && mask.segments.is_some(),
    }
}

/// The forward without a graph: (O [B, H, T, D], L [B, H, T] f32), query block by block;
/// with `mask.sinks`, O' and L' (`apply_sinks`), which `attention_bwd` takes as they are.
pub fn attention_fwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttnMask,
    scale: f64,
    block: Option<usize>,
) -> Result<(Tensor, Tensor)> {
    let (b, h, t, _d) = q.dims4()?;
    let bq = block.unwrap_or_else(|| default_block(b, h, t)).max(1);
    let tmpl = block_of(mask, t, scale);
    let blk = |s: usize| Block {
        q_off: s,
        ..tmpl.clone()
    };
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    for s in (0..t).step_by(bq) {
        let n = bq.min(t - s);
        let e = s + n;
        let qb = q.narrow(2, s, n)?; // views: cuBLAS takes the batch stride
        let kk = k.narrow(2, 0, e)?;
        let scores = qb.matmul(&kk.t()?)?; // [B, H, n, e]
        let lse = scores.apply_op1_no_bwd(&MaskedLse(blk(s)))?; // [B, H, n]
        let p = scores.apply_op2_no_bwd(&lse, &MaskedExp(blk(s)))?;
        drop(scores);
        outs.push(p.matmul(&v.narrow(2, 0, e)?)?); // [B, H, n, D]
        lses.push(lse);
    }
    let (o, lse) = (Tensor::cat(&outs, 2)?, Tensor::cat(&lses, 2)?);
    match &mask.sinks {
        Some(s) => apply_sinks(&o, &lse, s),
        None => Ok((o, lse)),
    }
}

/// The backward: given dO [B, H, T, D] (any layout), δ and L [B, H, T] f32, recomputes each
/// query block's probabilities and returns (dq, dk, dv) in q's dtype.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: &Tensor,
    delta: &Tensor,
    lse: &Tensor,
    mask: &AttnMask,
    scale: f64,
    block: Option<usize>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, h, t, _d) = q.dims4()?;
    let bq = block.unwrap_or_else(|| default_block(b, h, t)).max(1);
    let tmpl = block_of(mask, t, scale);
    let blk = |s: usize| Block {
        q_off: s,
        ..tmpl.clone()
    };
    let dt = q.dtype();
    let d_o = d_o.to_dtype(dt)?.contiguous()?; // one copy at most; blocks below are views

    // dK and dV are summed in f32 per key block of bq keys: query block i (keys [0, e)) adds
    // into key blocks 0..=i, so no partial is ever padded to the full sequence.
    let nb = t.div_ceil(bq);
    let mut dq = Vec::with_capacity(nb);
    let (mut dk, mut dv) = (vec![None::<Tensor>; nb], vec![None::<Tensor>; nb]);
    let acc = |sums: &mut [Option<Tensor>], part: &Tensor| -> Result<()> {
        for (j, sum) in sums.iter_mut().enumerate() {
            let ks = j * bq;
            if ks >= part.dim(2)? {
                break;
            }
            *sum = Some(acc_block(sum.take(), part, ks, bq.min(t - ks))?);
        }
        Ok(())
    };
    for s in (0..t).step_by(bq) {
        let n = bq.min(t - s);
        let e = s + n;
        let qb = q.narrow(2, s, n)?; // views: cuBLAS takes the batch stride
        let kk = k.narrow(2, 0, e)?;
        let vv = v.narrow(2, 0, e)?;
        let gb = d_o.narrow(2, s, n)?;
        let scores = qb.matmul(&kk.t()?)?;
        let p = scores.apply_op2_no_bwd(&lse.narrow(2, s, n)?.contiguous()?, &MaskedExp(blk(s)))?;
        // the cap's derivative needs the raw scores (in P's f32, below)
        let cap = match mask.softcap {
            0.0 => None,
            c => Some((c, scores.to_dtype(DType::F32)?)),
        };
        drop(scores);
        acc(&mut dv, &p.t()?.matmul(&gb)?)?; // [B, H, e, D]

        // dS = P ⊙ (dP − δ) in f32 (the casts are no-ops for f32): dP rounded to 16 bits
        // before the difference leaves up to ~1% of |dP| where the true dS is 0 (a row whose
        // only allowed key is its own), above the bf16 GPU test's tolerance.
        let dp = gb
            .to_dtype(DType::F32)?
            .matmul(&vv.to_dtype(DType::F32)?.t()?)?; // [B, H, n, e] f32
        let ds = p
            .to_dtype(DType::F32)?
            .apply_op3_no_bwd(
                &dp,
                &delta.narrow(2, s, n)?.contiguous()?,
                &SoftmaxBwd {
                    scale: scale as f32,
                    cap,
                },
            )?
            .to_dtype(dt)?;
        drop((p, dp));
        dq.push(ds.matmul(&kk)?); // [B, H, n, D]
        acc(&mut dk, &ds.t()?.matmul(&qb)?)?; // [B, H, e, D]
    }
    let done = |parts: Vec<Option<Tensor>>| -> Result<Tensor> {
        let parts = parts
            .into_iter()
            .map(|p| match p {
                Some(p) => p.to_dtype(dt),
                None => candle_core::bail!("attention_bwd: a key block got no gradient"),
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&parts, 2)
    };
    Ok((Tensor::cat(&dq, 2)?, done(dk)?, done(dv)?))
}

/// sum (f32 [B, H, bk, D], or zeros when None) + part[:, :, ks..ks + bk, :] (part [B, H, e, D]
/// contiguous, any float dtype) in one pass: the key block is read in place, not cast from a
/// strided view and then added.
fn acc_block(sum: Option<Tensor>, part: &Tensor, ks: usize, bk: usize) -> Result<Tensor> {
    let part = part.contiguous()?;
    let op = AccBlock { ks, bk };
    match sum {
        Some(s) => s.contiguous()?.apply_op2_no_bwd(&part, &op),
        None => part.apply_op1_no_bwd(&op),
    }
}

struct AccBlock {
    ks: usize,
    bk: usize,
}

impl AccBlock {
    fn run(&self, sum: Option<&[f32]>, part: &[f32], dims: &[usize]) -> Result<Vec<f32>> {
        let (r, e, d) = rows_e_d(dims)?;
        let mut out = vec![0f32; r * self.bk * d];
        for ri in 0..r {
            for j in 0..self.bk {
                let src = (ri * e + self.ks + j) * d;
                let dst = (ri * self.bk + j) * d;
                for c in 0..d {
                    out[dst + c] = sum.map_or(0.0, |s| s[dst + c]) + part[src + c];
                }
            }
        }
        Ok(out)
    }

    fn out_shape(&self, dims: &[usize]) -> Shape {
        let mut o = dims.to_vec();
        o[2] = self.bk;
        Shape::from(o)
    }
}

/// [B, H, e, D] → (B·H, e, D)
fn rows_e_d(dims: &[usize]) -> Result<(usize, usize, usize)> {
    match dims {
        [b, h, e, d] => Ok((b * h, *e, *d)),
        _ => candle_core::bail!("acc_block: expected [B, H, e, D], got {dims:?}"),
    }
}

impl CustomOp1 for AccBlock {
    fn name(&self) -> &'static str {
        "acc-block"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = self.run(None, &cpu_as_f32(s, l)?, l.dims())?;
        Ok((CpuStorage::F32(out), self.out_shape(l.dims())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (r, e, d) = rows_e_d(l.dims())?;
        let out = cuda::acc_block(None, s, l, [r, e, d, self.ks, self.bk])?;
        Ok((out, self.out_shape(l.dims())))
    }
}

impl CustomOp2 for AccBlock {
    fn name(&self) -> &'static str {
        "acc-block"
    }

    fn cpu_fwd(
        &self,
        ss: &CpuStorage,
        sl: &Layout,
        ps: &CpuStorage,
        pl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let sum = cpu_as_f32(ss, sl)?;
        let out = self.run(Some(&sum), &cpu_as_f32(ps, pl)?, pl.dims())?;
        Ok((CpuStorage::F32(out), self.out_shape(pl.dims())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
        ps: &candle_core::CudaStorage,
        pl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (r, e, d) = rows_e_d(pl.dims())?;
        let out = cuda::acc_block(Some((ss, sl)), ps, pl, [r, e, d, self.ks, self.bk])?;
        Ok((out, self.out_shape(pl.dims())))
    }
}

#[cfg(feature = "cuda")]
mod cuda;
