//! Grouped GEMMs for a MoE layer's experts: the rows of a [P, ·] matrix grouped by expert
//! (`counts[e]` rows of expert e, in expert order, as `model::router::Routing` lays them out),
//! each group multiplied by its own expert's matrix. On CUDA every expert is one problem of a
//! single cublasGemmGroupedBatchedEx call: one launch for all experts, no padding to the
//! busiest one. Elsewhere (and for operands cuBLAS cannot take, or that record autograd's
//! graph: the reference forward) it is one GEMM per expert, in candle's differentiable ops.
//!
//! Shapes: E experts, P = Σ counts rows.

use candle_core::{bail, Result, Tensor};

/// For each expert's rows x_e of x [P, k]: α · x_e W_eᵀ (`trans_w`, W [E, n, k]) or α · x_e W_e
/// (W [E, k, n]), plus the same rows of `acc` [P, n] where given (on CUDA written in place:
/// a fresh result nothing else holds). → [P, n]. W's matrices may lie apart (a narrow of a
/// stack along its rows: gate_up's gate half).
pub fn grouped_linear(
    x: &Tensor,
    w: &Tensor,
    counts: &[usize],
    trans_w: bool,
    alpha: f64,
    acc: Option<Tensor>,
) -> Result<Tensor> {
    let (p, k) = x.dims2()?;
    let (e, w1, w2) = w.dims3()?;
    let (wk, n) = if trans_w { (w2, w1) } else { (w1, w2) };
    check(counts, e, p)?;
    if wk != k {
        bail!(
            "grouped_linear: x [{p}, {k}] against expert matrices {:?}",
            w.dims()
        );
    }
    if let Some(a) = &acc {
        if a.dims() != [p, n] {
            bail!("grouped_linear: acc {:?}, want [{p}, {n}]", a.dims());
        }
    }
    #[cfg(feature = "cuda")]
    if !records(&[Some(x), Some(w), acc.as_ref()]) {
        if let Some(y) = cuda::linear(x, w, counts, trans_w, alpha, acc.as_ref())? {
            return Ok(y);
        }
    }
    let mut ys = Vec::with_capacity(e);
    let mut off = 0;
    for (ex, &rows) in counts.iter().enumerate().filter(|(_, &r)| r > 0) {
        let (xe, we) = (x.narrow(0, off, rows)?, w.get(ex)?);
        let y = match trans_w {
            true => xe.matmul(&we.t()?)?,
            false => xe.matmul(&we)?,
        };
        ys.push(if alpha == 1.0 { y } else { (y * alpha)? });
        off += rows;
    }
    let y = match ys.is_empty() {
        true => Tensor::zeros((0, n), x.dtype(), x.device())?,
        false => Tensor::cat(&ys, 0)?,
    };
    match acc {
        Some(a) => a + y,
        None => Ok(y),
    }
}

/// For each expert's rows p_e of p [P, m] and q_e of q [P, n]: α · p_eᵀ q_e → [E, m, n] in p's
/// dtype, zeros for an expert with no rows (the experts' adapter gradients).
pub fn grouped_tn(p: &Tensor, q: &Tensor, counts: &[usize], alpha: f64) -> Result<Tensor> {
    let ((rows, m), (qrows, n)) = (p.dims2()?, q.dims2()?);
    check(counts, counts.len(), rows)?;
    if qrows != rows {
        bail!(
            "grouped_tn: p {:?} and q {:?} differ in rows",
            p.dims(),
            q.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if !records(&[Some(p), Some(q)]) {
        if let Some(y) = cuda::tn(p, q, counts, alpha)? {
            return Ok(y);
        }
    }
    let mut outs = Vec::with_capacity(counts.len());
    let mut off = 0;
    for &r in counts {
        let o = match r {
            0 => Tensor::zeros((m, n), p.dtype(), p.device())?,
            _ => {
                let pe = p.narrow(0, off, r)?.t()?;
                let o = pe.matmul(&q.narrow(0, off, r)?)?;
                if alpha == 1.0 {
                    o
                } else {
                    (o * alpha)?
                }
            }
        };
        outs.push(o);
        off += r;
    }
    Tensor::stack(&outs, 0)
}

/// Whether any of these records autograd's graph (cuBLAS's products would drop it).
#[cfg(feature = "cuda")]
fn records(ts: &[Option<&Tensor>]) -> bool {
    ts.iter().flatten().any(|t| t.track_op())
}

/// The counts must name every expert and cover every row.
fn check(counts: &[usize], experts: usize, rows: usize) -> Result<()> {
    let sum: usize = counts.iter().sum();
    if counts.len() != experts || sum != rows {
        bail!(
            "grouped GEMM: {} expert counts summing to {sum}, for {experts} experts and {rows} rows",
            counts.len()
        );
    }
    Ok(())
}

#[cfg(feature = "cuda")]
mod cuda {
    use crate::ops::cuda::{addr, addr_batched, uninit};
    use candle_core::cuda::cudarc::cublas::sys;
    use candle_core::cuda::cudarc::driver::DevicePtr;
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaDevice, DType, Device, Result, Tensor};
    use std::ffi::c_void;

    type Op = sys::cublasOperation_t;

    /// One problem: column-major C [m × n] = α·op(A)·op(B) + β·C at these addresses.
    struct Problem {
        mnk: (i32, i32, i32),
        abc: (u64, u64, u64),
    }

    /// `grouped_linear` in one cuBLAS call; None when cuBLAS cannot take the operands so.
    pub(crate) fn linear(
        x: &Tensor,
        w: &Tensor,
        counts: &[usize],
        trans_w: bool,
        alpha: f64,
        acc: Option<&Tensor>,
    ) -> Result<Option<Tensor>> {
        let Device::Cuda(dev) = x.device() else {
            return Ok(None);
        };
        let dt = x.dtype();
        if w.dtype() != dt || acc.is_some_and(|a| a.dtype() != dt) || data_type(dt).is_none() {
            return Ok(None);
        }
        let ((p, k), (_, w1, w2)) = (x.dims2()?, w.dims3()?);
        let n = if trans_w { w1 } else { w2 };
        let out = match acc {
            Some(a) => a.clone(),
            // SAFETY: every row belongs to one expert's problem, which writes it whole (β = 0).
            None => match unsafe { uninit(dev, dt, (p, n))? } {
                Some(o) => o,
                None => return Ok(None),
            },
        };
        let (Some(xp), Some((wp, ws)), Some(op)) = (addr(x)?, addr_batched(w)?, addr(&out)?) else {
            return Ok(None);
        };
        let Some([ki, ni]) = ints([k, n]) else {
            return Ok(None);
        };
        // Row-major y_e [r, n] = x_e W_eᵀ is column-major y' [n × r] = op(W') · x' [k × r],
        // with W' = W_e as stored: [k × n] (ld k) transposed (`trans_w`), or [n × k] (ld n).
        let (transa, lda) = if trans_w {
            (Op::CUBLAS_OP_T, ki)
        } else {
            (Op::CUBLAS_OP_N, ni)
        };
        let (size, (k, n, ws)) = (dt.size_in_bytes() as u64, (k as u64, n as u64, ws as u64));
        let problems = per_expert(counts, |e, off, ri| Problem {
            mnk: (ni, ri, ki),
            abc: (wp + e * ws * size, xp + off * k * size, op + off * n * size),
        });
        let Some(problems) = problems else {
            return Ok(None);
        };
        let beta = if acc.is_some() { 1.0 } else { 0.0 };
        let ops = (transa, Op::CUBLAS_OP_N);
        // SAFETY: the addresses lie inside x, W and out (rows and experts counted above; x and
        // out contiguous, W's matrices each contiguous, `ws` apart), live on candle's stream,
        // which cuBLAS's handle runs on; out is fresh or the caller's fresh acc.
        unsafe { grouped(dev, ops, (lda, ki, ni), &problems, (alpha as f32, beta), dt)? };
        Ok(Some(out))
    }

    /// `grouped_tn` in one cuBLAS call; None when cuBLAS cannot take the operands so.
    pub(crate) fn tn(
        p: &Tensor,
        q: &Tensor,
        counts: &[usize],
        alpha: f64,
    ) -> Result<Option<Tensor>> {
        let Device::Cuda(dev) = p.device() else {
            return Ok(None);
        };
        let dt = p.dtype();
        if q.dtype() != dt || data_type(dt).is_none() {
            return Ok(None);
        }
        let ((_, m), (_, n)) = (p.dims2()?, q.dims2()?);
        // experts without rows keep these zeros
        let out = Tensor::zeros((counts.len(), m, n), dt, p.device())?;
        let (Some(pp), Some(qp), Some(op)) = (addr(p)?, addr(q)?, addr(&out)?) else {
            return Ok(None);
        };
        let Some([mi, ni]) = ints([m, n]) else {
            return Ok(None);
        };
        // Row-major o_e [m, n] = p_eᵀ q_e is column-major o' [n × m] = q' [n × r] · p'ᵀ,
        // q' and p' the rows as stored ([n × r] ld n, [m × r] ld m).
        let (size, (m, n)) = (dt.size_in_bytes() as u64, (m as u64, n as u64));
        let problems = per_expert(counts, |e, off, ri| Problem {
            mnk: (ni, mi, ri),
            abc: (
                qp + off * n * size,
                pp + off * m * size,
                op + e * m * n * size,
            ),
        });
        let Some(problems) = problems else {
            return Ok(None);
        };
        let ops = (Op::CUBLAS_OP_N, Op::CUBLAS_OP_T);
        // SAFETY: as `linear`'s; out is fresh and ours.
        unsafe { grouped(dev, ops, (ni, mi, ni), &problems, (alpha as f32, 0.0), dt)? };
        Ok(Some(out))
    }

    /// One problem per expert with rows, made from the expert's index, its first row and its
    /// row count; None past cuBLAS's ints.
    fn per_expert(counts: &[usize], f: impl Fn(u64, u64, i32) -> Problem) -> Option<Vec<Problem>> {
        let mut problems = Vec::with_capacity(counts.len());
        let mut off = 0u64;
        for (e, &r) in counts.iter().enumerate() {
            let [ri] = ints([r])?;
            if r > 0 {
                problems.push(f(e as u64, off, ri));
            }
            off += r as u64;
        }
        Some(problems)
    }

    /// The problems (one group each, the same ops and leading dimensions) in one
    /// cublasGemmGroupedBatchedEx call, f32 accumulation.
    ///
    /// # Safety
    /// Every problem's addresses are live device buffers of the sizes its shape and the
    /// leading dimensions imply, on the stream of `dev`'s cuBLAS handle.
    unsafe fn grouped(
        dev: &CudaDevice,
        (transa, transb): (Op, Op),
        (lda, ldb, ldc): (i32, i32, i32),
        problems: &[Problem],
        (alpha, beta): (f32, f32),
        dt: DType,
    ) -> Result<()> {
        let g = problems.len();
        let Some(data) = data_type(dt) else {
            candle_core::bail!("grouped GEMM: no cuBLAS type for {dt:?}");
        };
        if g == 0 {
            return Ok(());
        }
        // cuBLAS reads the pointer arrays from device memory: A's, B's, C's, one upload
        let ptrs: Vec<u64> = [0, 1, 2]
            .iter()
            .flat_map(|&i| problems.iter().map(move |p| [p.abc.0, p.abc.1, p.abc.2][i]))
            .collect();
        let stream = dev.cuda_stream();
        let arrays = stream.clone_htod(&ptrs).w()?;
        let (base, _guard) = arrays.device_ptr(&stream);
        let dims = |f: fn(&Problem) -> i32| problems.iter().map(f).collect::<Vec<i32>>();
        let (ms, ns, ks) = (dims(|p| p.mnk.0), dims(|p| p.mnk.1), dims(|p| p.mnk.2));
        let blas = dev.cublas_handle();
        sys::cublasGemmGroupedBatchedEx(
            *blas.handle(),
            vec![transa; g].as_ptr(),
            vec![transb; g].as_ptr(),
            ms.as_ptr(),
            ns.as_ptr(),
            ks.as_ptr(),
            vec![alpha; g].as_ptr() as *const c_void,
            base as *const *const c_void,
            data,
            vec![lda; g].as_ptr(),
            (base + 8 * g as u64) as *const *const c_void,
            data,
            vec![ldb; g].as_ptr(),
            vec![beta; g].as_ptr() as *const c_void,
            (base + 16 * g as u64) as *const *mut c_void,
            data,
            vec![ldc; g].as_ptr(),
            g as i32,
            vec![1i32; g].as_ptr(),
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        )
        .result()
        .w()
    }

    fn data_type(dt: DType) -> Option<sys::cudaDataType_t> {
        match dt {
            DType::BF16 => Some(sys::cudaDataType_t::CUDA_R_16BF),
            DType::F16 => Some(sys::cudaDataType_t::CUDA_R_16F),
            DType::F32 => Some(sys::cudaDataType_t::CUDA_R_32F),
            _ => None,
        }
    }

    /// Sizes as cuBLAS's ints; None past i32.
    fn ints<const N: usize>(v: [usize; N]) -> Option<[i32; N]> {
        let mut out = [0i32; N];
        for (o, x) in out.iter_mut().zip(v) {
            *o = i32::try_from(x).ok()?;
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::{grouped_linear, grouped_tn};
    use candle_core::{Device, Tensor};

    /// Row-major [r, c] from a flat Vec.
    fn mat(v: &[f32], c: usize) -> Vec<Vec<f32>> {
        v.chunks(c).map(|r| r.to_vec()).collect()
    }

    /// Σ_j a[i][j] · b[j][k] over plain Vecs.
    fn mm(a: &[Vec<f32>], b: &[Vec<f32>]) -> Vec<Vec<f32>> {
        let n = b[0].len();
        a.iter()
            .map(|row| {
                (0..n)
                    .map(|k| row.iter().zip(b).map(|(x, br)| x * br[k]).sum())
                    .collect()
            })
            .collect()
    }

    fn tr(a: &[Vec<f32>]) -> Vec<Vec<f32>> {
        (0..a[0].len())
            .map(|j| a.iter().map(|r| r[j]).collect())
            .collect()
    }

    /// Experts with 2, 0, 3 and 1 rows: each group is multiplied by its own expert's matrix
    /// (both orientations, scaled, onto an acc), and pᵀq per expert is zero for the empty one.
    #[test]
    fn each_group_meets_its_own_expert() {
        let dev = Device::Cpu;
        let counts = [2usize, 0, 3, 1];
        let (p, k, n, e) = (6, 3, 2, 4);
        let xs: Vec<f32> = (0..p * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let ws: Vec<f32> = (0..e * n * k).map(|i| (i as f32 * 0.91).cos()).collect();
        let acc: Vec<f32> = (0..p * n).map(|i| i as f32).collect();
        let x = Tensor::from_vec(xs.clone(), (p, k), &dev).unwrap();
        let w = Tensor::from_vec(ws.clone(), (e, n, k), &dev).unwrap(); // W_e [n, k]
        let a = Tensor::from_vec(acc.clone(), (p, n), &dev).unwrap();
        let y: Vec<Vec<f32>> = grouped_linear(&x, &w, &counts, true, 0.5, Some(a))
            .unwrap()
            .to_vec2()
            .unwrap();
        // the same W read as [E, k', n'] = [E, n, k] without the transpose: x needs n columns
        let x2 = Tensor::from_vec(xs[..p * n].to_vec(), (p, n), &dev).unwrap();
        let y2: Vec<Vec<f32>> = grouped_linear(&x2, &w, &counts, false, 1.0, None)
            .unwrap()
            .to_vec2()
            .unwrap();
        let (xm, x2m, am) = (mat(&xs, k), mat(&xs[..p * n], n), mat(&acc, n));
        let mut off = 0;
        for (ex, &r) in counts.iter().enumerate() {
            let we = mat(&ws[ex * n * k..(ex + 1) * n * k], k); // [n, k]
            let want = mm(&xm[off..off + r], &tr(&we));
            let want2 = mm(&x2m[off..off + r], &we);
            for i in 0..r {
                for j in 0..n {
                    let w1 = am[off + i][j] + 0.5 * want[i][j];
                    assert!((y[off + i][j] - w1).abs() < 1e-5, "expert {ex} row {i}");
                }
                for j in 0..k {
                    assert!((y2[off + i][j] - want2[i][j]).abs() < 1e-5, "expert {ex}");
                }
            }
            off += r;
        }
        // pᵀ q per expert: p = x [P, k], q = acc [P, n] → [E, k, n]
        let q = Tensor::from_vec(acc.clone(), (p, n), &dev).unwrap();
        let t: Vec<Vec<Vec<f32>>> = grouped_tn(&x, &q, &counts, 2.0).unwrap().to_vec3().unwrap();
        let mut off = 0;
        for (ex, &r) in counts.iter().enumerate() {
            for (i, row) in t[ex].iter().enumerate() {
                for (j, v) in row.iter().enumerate() {
                    let want: f32 = (off..off + r).map(|t| 2.0 * xm[t][i] * am[t][j]).sum();
                    assert!(
                        (v - want).abs() < 1e-4,
                        "expert {ex} ({i}, {j}): {v} vs {want}"
                    );
                }
            }
            off += r;
        }
        let bad = grouped_linear(&x, &w, &[2, 0, 3], true, 1.0, None).unwrap_err();
        assert!(
            bad.to_string().contains("3 expert counts summing to 5"),
            "{bad}"
        );
    }
}
