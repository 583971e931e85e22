//! A frozen linear's GEMM accumulated onto a tensor: acc + x Wᵀ (forward) and acc + g W (dL/dx).
//!
//! A LoRA linear's output is base + adapter: as two results and an add that is three passes over
//! [m, out] (two reads, one write). On CUDA the GEMM adds into the adapter's term instead (cuBLAS
//! with β = 1: one read of it, in the GEMM's epilogue). Elsewhere, or for inputs cuBLAS cannot
//! take in place, it is the GEMM and an add.
//!
//! `acc` is consumed: on CUDA its buffer is written in place, so it must be a fresh result that
//! nothing else holds (the callers pass a product they have just computed).
//!
//! Also here, on the same cuBLAS call: `matmul_tn_f32`, the adapters' gradient products Pᵀ Q
//! written in f32 straight from bf16 operands (a bf16 product and a cast were a rounding, a
//! launch and a pass more).

//!
//! Every function takes the run's `Gemm` (`Kernels::gemm`): which algorithm cuBLAS runs.

use super::kernels::Gemm;
use candle_core::{Result, Tensor};

/// acc + x Wᵀ: x [m, in], W [out, in], acc [m, out] → [m, out]. No graph.
pub fn linear_acc(x: &Tensor, w: &Tensor, acc: Tensor, gemm: Gemm) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(y) = cuda::gemm_acc(x, w, &acc, true, 1.0, gemm)? {
        return Ok(y);
    }
    let _ = gemm;
    super::add(&acc, &super::frozen_linear(x, w, None)?)
}

/// acc + g W: g [m, out], W [out, in], acc [m, in] → [m, in] (a frozen linear's dL/dx plus
/// another term of it). No graph.
pub fn linear_bwd_acc(g: &Tensor, w: &Tensor, acc: Tensor, gemm: Gemm) -> Result<Tensor> {
    linear_bwd_acc_scaled(g, w, acc, 1.0, gemm)
}

/// acc + α · g W, as `linear_bwd_acc`; on CUDA g and acc may also be column slices of wider
/// matrices (rows contiguous): acc is then written in place through its row stride, so that a
/// GEMM adds into the first columns of a padded buffer (`ops::fold`'s dL/dx).
pub(crate) fn linear_bwd_acc_scaled(
    g: &Tensor,
    w: &Tensor,
    acc: Tensor,
    alpha: f64,
    gemm: Gemm,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(y) = cuda::gemm_acc(g, w, &acc, false, alpha, gemm)? {
        return Ok(y);
    }
    let _ = gemm;
    let gw = g.contiguous()?.matmul(&w.contiguous()?)?;
    match alpha == 1.0 {
        true => super::add(&acc.contiguous()?, &gw),
        false => super::add(&acc.contiguous()?, &(gw * alpha)?),
    }
}

/// Pᵀ Q in f32: P [k, m], Q [k, n] → [m, n] f32. No graph. (dA = (g B)ᵀ x and dB = gᵀ xas
/// of a LoRA linear: k is the tokens, m or n the rank.) P and Q may be column slices of wider
/// matrices (rows contiguous, as the adapters' side-by-side products are).
pub(crate) fn matmul_tn_f32(p: &Tensor, q: &Tensor, gemm: Gemm) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(y) = cuda::gemm_tn_f32(p, q, gemm)? {
        return Ok(y);
    }
    let _ = gemm;
    p.contiguous()?
        .t()?
        .matmul(&q.contiguous()?)?
        .to_dtype(candle_core::DType::F32)
}

/// α · x Wᵀ (`trans_w`: W [n, k]) or α · x W (W [k, n]): x [m, k] → [m, n], fresh, in x's
/// dtype. No graph. x may be a column slice of a wider matrix (rows contiguous). On CUDA α is
/// the GEMM's own (the f32 sum is scaled before its one rounding, and no pass of its own), so
/// the adapters' s · (x Aᵀ) and s · (g B) cost their GEMM only.
pub fn matmul_scaled(
    x: &Tensor,
    w: &Tensor,
    trans_w: bool,
    alpha: f64,
    gemm: Gemm,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(y) = cuda::gemm_scaled(x, w, trans_w, alpha, gemm)? {
        return Ok(y);
    }
    let _ = gemm;
    let x = x.contiguous()?;
    // Wᵀ made contiguous: with a transposed view on its right and few columns (an adapter's
    // rank) the CPU GEMM's rows depend on how many rows it has, so a chunk of tokens would
    // not give the whole run's rows (model/layer_mlp.rs). W is an adapter's A: small.
    let y = match trans_w {
        true => x.matmul(&w.t()?.contiguous()?)?,
        false => x.matmul(w)?,
    };
    match alpha == 1.0 {
        true => Ok(y),
        false => y * alpha,
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use crate::ops::kernels::Gemm;
    use candle_core::cuda::cudarc::cublas::sys;
    use candle_core::{DType, Device, Result, Tensor};

    /// acc += α · x Wᵀ (`fwd`) or acc += α · x W, in place; None when cuBLAS cannot take these
    /// operands so (not CUDA, rows not contiguous, mixed or unsupported dtypes, shapes that do
    /// not chain). Any of the three may be a column slice of a wider matrix.
    pub(crate) fn gemm_acc(
        x: &Tensor,
        w: &Tensor,
        acc: &Tensor,
        fwd: bool,
        alpha: f64,
        kind: Gemm,
    ) -> Result<Option<Tensor>> {
        let Device::Cuda(dev) = x.device() else {
            return Ok(None);
        };
        let dt = x.dtype();
        if w.dtype() != dt || acc.dtype() != dt || !w.device().same_device(x.device()) {
            return Ok(None);
        }
        let (Ok((m, kx)), Ok((wo, wi)), Ok((am, an))) = (x.dims2(), w.dims2(), acc.dims2()) else {
            return Ok(None);
        };
        // Row-major C [m, n] = A·B is column-major Cᵀ = Bᵀ·Aᵀ: cuBLAS computes, column-major,
        // C' [n × m] += op(W) [n × k] · x' [k × m], with x' = x as stored and C' = acc as stored.
        //   forward:  n = out, k = in, op(W) = (W as stored, [in × out])ᵀ: transa = T, lda = in
        //   backward: n = in,  k = out, op(W) = W as stored [in × out]:    transa = N, lda = in
        let (n, k, transa) = if fwd {
            (wo, wi, sys::cublasOperation_t::CUBLAS_OP_T)
        } else {
            (wi, wo, sys::cublasOperation_t::CUBLAS_OP_N)
        };
        if kx != k || am != m || an != n || m == 0 {
            return Ok(None);
        }
        let Some((data_type, compute)) = types(dt) else {
            return Ok(None);
        };
        let rows = crate::ops::cuda::addr_rows;
        // Rows may lie further apart than their columns (a column slice: W's first `in`
        // columns of a padded weight, or a padded dL/dx and its pad, `ops::fold`); each
        // leading dimension is that stride.
        let (Some((xp, ldx)), Some((wp, ldw)), Some((cp, ldc))) = (rows(x)?, rows(w)?, rows(acc)?)
        else {
            return Ok(None);
        };
        let ints = [m, n, k, ldw, ldx, ldc].map(int);
        let [Some(mi), Some(ni), Some(ki), Some(ldwi), Some(ldxi), Some(ldci)] = ints else {
            return Ok(None);
        };
        // SAFETY: the three pointers are live buffers of the sizes checked above (rows their
        // leading dimensions apart), on the stream cuBLAS runs on (candle's, set on its
        // handle); acc is the callers' fresh result (module docs), so writing it in place is
        // seen by no one else (x may lie in the same buffer, in other columns).
        unsafe {
            gemm(
                dev,
                (transa, sys::cublasOperation_t::CUBLAS_OP_N),
                (ni, mi, ki),
                (wp, ldwi),
                (xp, ldxi),
                (cp, ldci),
                (alpha as f32, 1.0),
                (data_type, data_type, compute),
                kind,
            )?
        };
        Ok(Some(acc.clone()))
    }

    /// Column-major C [m × n] (ld ldc) = α·op(A) · op(B) + β·C, A and B of type `types.0`, C
    /// of `types.1`, computed as `types.2`: cublasGemmEx, or with `Gemm::Tuned` the cuBLASLt
    /// algorithm timed fastest for its shape (`gemm_tune`).
    ///
    /// # Safety
    /// The addresses are live device buffers of the sizes the shapes and leading dimensions
    /// imply, on the stream of `dev`'s cuBLAS handle.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(
        dev: &candle_core::CudaDevice,
        (transa, transb): (sys::cublasOperation_t, sys::cublasOperation_t),
        (m, n, k): (i32, i32, i32),
        (a, lda): (u64, i32),
        (b, ldb): (u64, i32),
        (c, ldc): (u64, i32),
        (alpha, beta): (f32, f32),
        (ab_type, c_type, compute): (
            sys::cudaDataType_t,
            sys::cudaDataType_t,
            sys::cublasComputeType_t,
        ),
        kind: Gemm,
    ) -> Result<()> {
        let g = crate::ops::gemm_tune::Gemm {
            trans: (transa, transb),
            mnk: (m, n, k),
            a: (a, lda),
            b: (b, ldb),
            c: (c, ldc),
            alpha_beta: (alpha, beta),
            types: (ab_type, c_type, compute),
        };
        // SAFETY: the caller's contract, which is `run`'s.
        crate::ops::gemm_tune::run(dev, &g, kind)
    }

    /// cuBLAS's data type for `dt` and the compute type candle would use with it (f32
    /// accumulation; the reduced-precision switches as candle's own GEMMs honour them).
    fn types(dt: DType) -> Option<(sys::cudaDataType_t, sys::cublasComputeType_t)> {
        let t = match dt {
            DType::BF16 if candle_core::cuda::gemm_reduced_precision_bf16() => (
                sys::cudaDataType_t::CUDA_R_16BF,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF,
            ),
            DType::BF16 => (
                sys::cudaDataType_t::CUDA_R_16BF,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            DType::F16 if candle_core::cuda::gemm_reduced_precision_f16() => (
                sys::cudaDataType_t::CUDA_R_16F,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16F,
            ),
            DType::F16 => (
                sys::cudaDataType_t::CUDA_R_16F,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            DType::F32 if candle_core::cuda::gemm_reduced_precision_f32() => (
                sys::cudaDataType_t::CUDA_R_32F,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            ),
            DType::F32 => (
                sys::cudaDataType_t::CUDA_R_32F,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            _ => return None,
        };
        Some(t)
    }

    /// Pᵀ Q into a fresh f32 [m, n]: P [k, m], Q [k, n] of one dtype, rows contiguous (column
    /// slices allowed); None when cuBLAS cannot take them so.
    pub(crate) fn gemm_tn_f32(p: &Tensor, q: &Tensor, kind: Gemm) -> Result<Option<Tensor>> {
        let Device::Cuda(dev) = p.device() else {
            return Ok(None);
        };
        let dt = p.dtype();
        let Some((data_type, compute)) = types(dt) else {
            return Ok(None);
        };
        let (Ok((k, m)), Ok((kq, n))) = (p.dims2(), q.dims2()) else {
            return Ok(None);
        };
        if q.dtype() != dt || !q.device().same_device(p.device()) || kq != k || m * n * k == 0 {
            return Ok(None);
        }
        let rows = crate::ops::cuda::addr_rows;
        let (Some((pp, ldp)), Some((qp, ldq))) = (rows(p)?, rows(q)?) else {
            return Ok(None);
        };
        let (Some(mi), Some(ni), Some(ki), Some(ldp), Some(ldq)) =
            (int(m), int(n), int(k), int(ldp), int(ldq))
        else {
            return Ok(None);
        };
        // SAFETY: every element is written by the GEMM (β = 0).
        let Some(out) = (unsafe { crate::ops::cuda::uninit(dev, DType::F32, (m, n))? }) else {
            return Ok(None);
        };
        let Some(op) = crate::ops::cuda::addr(&out)? else {
            return Ok(None);
        };
        // Column-major, C' = out as stored is [n × m] = Q'·P'ᵀ, with Q' = Q as stored [n × k]
        // (ld ldq) and P' = P as stored [m × k] (ld ldp): transa = N, transb = T.
        // SAFETY: p and q are live buffers of k rows of their leading dimensions, out is
        // fresh and ours, all on cuBLAS's stream (candle's).
        unsafe {
            gemm(
                dev,
                (
                    sys::cublasOperation_t::CUBLAS_OP_N,
                    sys::cublasOperation_t::CUBLAS_OP_T,
                ),
                (ni, mi, ki),
                (qp, ldq),
                (pp, ldp),
                (op, ni),
                (1.0, 0.0),
                (data_type, sys::cudaDataType_t::CUDA_R_32F, compute),
                kind,
            )?
        };
        Ok(Some(out))
    }

    /// α · x op(W) into a fresh [m, n] of x's dtype (`matmul_scaled`); None when cuBLAS
    /// cannot take the operands so.
    pub(crate) fn gemm_scaled(
        x: &Tensor,
        w: &Tensor,
        trans_w: bool,
        alpha: f64,
        kind: Gemm,
    ) -> Result<Option<Tensor>> {
        let Device::Cuda(dev) = x.device() else {
            return Ok(None);
        };
        let dt = x.dtype();
        let Some((data_type, compute)) = types(dt) else {
            return Ok(None);
        };
        let (Ok((m, k)), Ok((w0, w1))) = (x.dims2(), w.dims2()) else {
            return Ok(None);
        };
        // W as stored, column-major: [k × n] (ld k) taken transposed, or [n × k] (ld n) as is.
        let (n, kw, transa) = match trans_w {
            true => (w0, w1, sys::cublasOperation_t::CUBLAS_OP_T),
            false => (w1, w0, sys::cublasOperation_t::CUBLAS_OP_N),
        };
        if w.dtype() != dt || !w.device().same_device(x.device()) || kw != k || m * n * k == 0 {
            return Ok(None);
        }
        // Either operand may be a column slice of a wider matrix (rows contiguous).
        let (Some((xp, ldx)), Some((wp, ldw))) = (
            crate::ops::cuda::addr_rows(x)?,
            crate::ops::cuda::addr_rows(w)?,
        ) else {
            return Ok(None);
        };
        let (Some(mi), Some(ni), Some(ki), Some(ldx), Some(ldw)) =
            (int(m), int(n), int(k), int(ldx), int(ldw))
        else {
            return Ok(None);
        };
        // SAFETY: every element is written by the GEMM (β = 0).
        let Some(out) = (unsafe { crate::ops::cuda::uninit(dev, dt, (m, n))? }) else {
            return Ok(None);
        };
        let Some(op) = crate::ops::cuda::addr(&out)? else {
            return Ok(None);
        };
        // Column-major C' = out as stored [n × m] = op(W') · x', x' = x as stored [k × m].
        // SAFETY: x and W are rows of their leading dimensions ([m, k], [w0, w1]), out is
        // fresh and ours; all on cuBLAS's stream (candle's).
        unsafe {
            gemm(
                dev,
                (transa, sys::cublasOperation_t::CUBLAS_OP_N),
                (ni, mi, ki),
                (wp, ldw),
                (xp, ldx),
                (op, ni),
                (alpha as f32, 0.0),
                (data_type, data_type, compute),
                kind,
            )?
        };
        Ok(Some(out))
    }

    fn int(v: usize) -> Option<i32> {
        i32::try_from(v).ok()
    }
}
