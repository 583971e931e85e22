//! The launchers of attention.cu (ops/attention.cu).
use crate::ops::cuda::{contiguous, kernel, threads_for, with_dtype, with_view};
use candle_core::cuda::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::cuda::WrapErr;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result};

fn contiguous_u32(t: &candle_core::Tensor) -> Result<(CudaSlice<u32>, CudaDevice)> {
    let (s, l) = t.storage_and_layout();
    let candle_core::Storage::Cuda(cs) = &*s else {
        candle_core::bail!("segment ids are not on the GPU")
    };
    let (o1, o2) = contiguous(l)?;
    let dev = cs.device.clone();
    // A small copy (B·T ids) so that no storage lock is held during the launch.
    let v = dev
        .cuda_stream()
        .clone_dtod(&cs.as_cuda_slice::<u32>()?.slice(o1..o2))
        .w()?;
    Ok((v, dev))
}

#[allow(clippy::too_many_arguments)]
fn block_rows(
    name: &str,
    s: &CudaStorage,
    l: &Layout,
    lse_in: Option<(&CudaStorage, &Layout)>,
    seg: Option<&candle_core::Tensor>,
    t: usize,
    q_off: usize,
    window: usize,
    tree: bool,
    [scale, cap]: [f32; 2],
) -> Result<CudaStorage> {
    use candle_core::backend::BackendStorage;
    let (b, h, bq, e) = l.shape().dims4()?;
    let rows = b * h * bq;
    let dev = s.device().clone();
    let (func, stream) = kernel(s, name)?;
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads_for(e.min(256)), 1, 1),
        shared_mem_bytes: 0,
    };
    let seg = seg.map(contiguous_u32).transpose()?;
    let null: u64 = 0;
    let (hi, bqi, ei, ti, qo, wi, tr) = (
        h as i32,
        bq as i32,
        e as i32,
        t as i32,
        q_off as i32,
        window as i32,
        i32::from(tree),
    );
    let (o1, o2) = contiguous(l)?;
    macro_rules! args {
        ($bld:ident) => {
            match &seg {
                Some((sv, _)) => $bld.arg(sv),
                None => $bld.arg(&null),
            };
            $bld.arg(&hi)
                .arg(&bqi)
                .arg(&ei)
                .arg(&ti)
                .arg(&qo)
                .arg(&wi)
                .arg(&tr)
                .arg(&scale)
                .arg(&cap);
        };
    }
    match (lse_in, s.dtype()) {
        (None, DType::F32) | (None, DType::BF16) => {
            // SAFETY: uninitialised f32s; masked_lse's thread 0 of block `row` writes lse[row]
            // for every one of the `rows` blocks of the launch, before anything reads it.
            let out: CudaSlice<f32> = unsafe { dev.alloc::<f32>(rows)? };
            let mut bld = stream.launch_builder(&func);
            if s.dtype() == DType::F32 {
                let x = s.as_cuda_slice::<f32>()?.slice(o1..o2);
                bld.arg(&x).arg(&out);
                args!(bld);
                // SAFETY: x is the contiguous [B, H, bq, e] block (`contiguous` above), so each
                // of the `rows` blocks reads e scores inside it; out holds `rows`; seg, when set,
                // is a private copy of the mask's u32 [B × T] ids (AttnMask's contract: not
                // checked here), read at b·T + i, j < T. Arguments in masked_lse's order and
                // C types; all on the stream of s's device, after the ops that made s.
                unsafe { bld.launch(cfg) }.w()?;
            } else {
                let x = s.as_cuda_slice::<half::bf16>()?.slice(o1..o2);
                bld.arg(&x).arg(&out);
                args!(bld);
                // SAFETY: as the f32 launch above, with x viewed as bf16 (s's dtype).
                unsafe { bld.launch(cfg) }.w()?;
            }
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        (Some((ls, ll)), _) => {
            let (l1, l2) = contiguous(ll)?;
            let lse = ls.as_cuda_slice::<f32>()?.slice(l1..l2);
            let n = rows * e;
            Ok(with_dtype!(s, l, n, |x, out| {
                let mut bld = stream.launch_builder(&func);
                bld.arg(&x).arg(&lse).arg(&out);
                args!(bld);
                // SAFETY: x is the contiguous [B, H, bq, e] block and out n = rows · e of its
                // dtype, every element written (allowed keys their exp, the rest 0); lse is the
                // block's contiguous L [B, H, bq] f32 that attention_fwd / attention_bwd narrow
                // to these queries (one value a row, by construction, not checked here); seg as
                // for masked_lse. One stream: s's device's.
                unsafe { bld.launch(cfg) }.w()?;
            }))
        }
        (None, d) => candle_core::bail!("attention scores must be f32 or bf16, got {d:?}"),
    }
}

/// `sc` = [scale, soft-cap (0: none)]; `tree`: the ids are prefix-tree ids
/// (`AttnMask::prefix_tree`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn masked_lse(
    s: &CudaStorage,
    l: &Layout,
    seg: Option<&candle_core::Tensor>,
    t: usize,
    q_off: usize,
    window: usize,
    tree: bool,
    sc: [f32; 2],
) -> Result<CudaStorage> {
    block_rows("masked_lse", s, l, None, seg, t, q_off, window, tree, sc)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn masked_exp(
    s: &CudaStorage,
    l: &Layout,
    lse: &CudaStorage,
    ll: &Layout,
    seg: Option<&candle_core::Tensor>,
    t: usize,
    q_off: usize,
    window: usize,
    tree: bool,
    sc: [f32; 2],
) -> Result<CudaStorage> {
    block_rows(
        "masked_exp",
        s,
        l,
        Some((lse, ll)),
        seg,
        t,
        q_off,
        window,
        tree,
        sc,
    )
}

/// `cap`: the soft-cap and the block's raw scores (P's dtype and shape), when capped.
#[allow(clippy::too_many_arguments)]
pub(crate) fn softmax_bwd(
    p: &CudaStorage,
    pl: &Layout,
    dp: &CudaStorage,
    dpl: &Layout,
    delta: &CudaStorage,
    dl: &Layout,
    scale: f32,
    cap: Option<(f32, &CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    use candle_core::backend::BackendStorage;
    let e = *pl.dims().last().unwrap_or(&1);
    let n = pl.shape().elem_count();
    if dp.dtype() != p.dtype() {
        candle_core::bail!("softmax_bwd: dP {:?} vs P {:?}", dp.dtype(), p.dtype());
    }
    if let Some((c, ss, sl)) = cap {
        return softmax_bwd_cap(p, pl, dp, dpl, delta, dl, [scale, c], ss, sl);
    }
    let (func, stream) = kernel(p, "softmax_bwd")?;
    let cfg = crate::ops::cuda::elems(n)?;
    let (d1, d2) = contiguous(dl)?;
    let delta = delta.as_cuda_slice::<f32>()?.slice(d1..d2);
    let (q1, q2) = contiguous(dpl)?;
    let (ei, sc, nl) = (e as i32, scale, n as i64);
    Ok(with_dtype!(p, pl, n, |x, out| {
        let mut bld = stream.launch_builder(&func);
        with_view!(dp, q1..q2, |dpv| {
            bld.arg(&x)
                .arg(&dpv)
                .arg(&delta)
                .arg(&out)
                .arg(&ei)
                .arg(&sc)
                .arg(&nl);
            // SAFETY: one thread an element of n = |P|, each bounded by n: P (x) and dP are
            // contiguous views of P's dtype (checked above); dP and δ are attention_bwd's
            // [B, H, bq, e] and [B, H, bq] f32 of the same block (sizes by construction, not
            // checked here), δ read at k / e < n / e; out is fresh, n elements, all written.
            unsafe { bld.launch(cfg) }.w()?;
        })
    }))
}

/// `softmax_bwd` with the cap's derivative, from the raw scores s.
#[allow(clippy::too_many_arguments)]
fn softmax_bwd_cap(
    p: &CudaStorage,
    pl: &Layout,
    dp: &CudaStorage,
    dpl: &Layout,
    delta: &CudaStorage,
    dl: &Layout,
    [scale, cap]: [f32; 2],
    ss: &CudaStorage,
    sl: &Layout,
) -> Result<CudaStorage> {
    use candle_core::backend::BackendStorage;
    let e = *pl.dims().last().unwrap_or(&1);
    let n = pl.shape().elem_count();
    if ss.dtype() != p.dtype() || sl.shape().elem_count() != n {
        candle_core::bail!("softmax_bwd: scores {:?} vs P {:?}", ss.dtype(), p.dtype());
    }
    let (func, stream) = kernel(p, "softmax_bwd_cap")?;
    let cfg = crate::ops::cuda::elems(n)?;
    let (d1, d2) = contiguous(dl)?;
    let delta = delta.as_cuda_slice::<f32>()?.slice(d1..d2);
    let (q1, q2) = contiguous(dpl)?;
    let (s1, s2) = contiguous(sl)?;
    let (ei, nl) = (e as i32, n as i64);
    Ok(with_dtype!(p, pl, n, |x, out| {
        let mut bld = stream.launch_builder(&func);
        with_view!(dp, q1..q2, |dpv| {
            with_view!(ss, s1..s2, |sv| {
                bld.arg(&x)
                    .arg(&dpv)
                    .arg(&delta)
                    .arg(&sv)
                    .arg(&out)
                    .arg(&ei)
                    .arg(&scale)
                    .arg(&cap)
                    .arg(&nl);
                // SAFETY: as softmax_bwd's launch; the raw scores have P's dtype and n
                // elements (checked above), contiguous.
                unsafe { bld.launch(cfg) }.w()?;
            })
        })
    }))
}

/// out f32 [R, bk, D] = sum (f32, or zeros) + part[:, ks..ks + bk, :] of part [R, e, D];
/// `red` = [R, e, D, ks, bk].
pub(crate) fn acc_block(
    sum: Option<(&CudaStorage, &Layout)>,
    part: &CudaStorage,
    pl: &Layout,
    red: [usize; 5],
) -> Result<CudaStorage> {
    use candle_core::backend::BackendStorage;
    let [r, e, d, ks, bk] = red;
    let n = r * bk * d;
    let dev = part.device().clone();
    let (func, stream) = kernel(part, "acc_block")?;
    let cfg = crate::ops::cuda::elems(n)?;
    // SAFETY: uninitialised f32s; acc_block writes out[k] for every k < n (one thread each).
    let out: CudaSlice<f32> = unsafe { dev.alloc::<f32>(n)? };
    let (p1, p2) = contiguous(pl)?;
    let null: u64 = 0;
    let (nl, ei, di, ki, bi) = (n as i64, e as i32, d as i32, ks as i32, bk as i32);
    let sum_view = match sum {
        Some((s, sl)) => {
            let (s1, s2) = contiguous(sl)?;
            Some(s.as_cuda_slice::<f32>()?.slice(s1..s2))
        }
        None => None,
    };
    let mut bld = stream.launch_builder(&func);
    match &sum_view {
        Some(v) => bld.arg(v),
        None => bld.arg(&null),
    };
    with_view!(part, p1..p2, |pv| {
        bld.arg(&pv)
            .arg(&out)
            .arg(&nl)
            .arg(&ei)
            .arg(&di)
            .arg(&ki)
            .arg(&bi);
        // SAFETY: thread k < n = R·bk·D reads part at (r·e + ks)·D + k mod bk·D, inside the
        // contiguous [R, e, D] part since ks + bk ≤ e (attention_bwd's key blocks, not checked
        // here), and sum[k] when set (f32 [R, bk, D], contiguous); writes out[k]. One stream.
        unsafe { bld.launch(cfg) }.w()?;
    });
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// δ [B, H, T] f32 = rowsum over each head of dO ⊙ O, both rows [B·T, H·D] (contiguous).
pub(crate) fn row_dot(
    g: &CudaStorage,
    gl: &Layout,
    o: &CudaStorage,
    ol: &Layout,
    bthd: [usize; 4],
) -> Result<CudaStorage> {
    use candle_core::backend::BackendStorage;
    let [b, t, h, d] = bthd;
    let mh = b * t * h;
    let dev = g.device().clone();
    if o.dtype() != g.dtype() {
        candle_core::bail!("row_dot: dO {:?} vs O {:?}", g.dtype(), o.dtype());
    }
    let (func, stream) = kernel(g, "row_dot")?;
    let cfg = crate::ops::cuda::elems(mh * 32)?;
    // SAFETY: uninitialised f32s; row_dot's warp w < mh writes δ[(b·H + h)·T + t], a
    // one-to-one map of the mh = B·T·H (m, h) pairs onto [0, mh).
    let out: CudaSlice<f32> = unsafe { dev.alloc::<f32>(mh)? };
    let (g1, g2) = contiguous(gl)?;
    let (o1, o2) = contiguous(ol)?;
    let (mhl, hi, ti, di) = (mh as i64, h as i32, t as i32, d as i32);
    let mut bld = stream.launch_builder(&func);
    with_view!(g, g1..g2, |gv| {
        with_view!(o, o1..o2, |ov| {
            bld.arg(&gv)
                .arg(&ov)
                .arg(&out)
                .arg(&mhl)
                .arg(&hi)
                .arg(&ti)
                .arg(&di);
            // SAFETY: warp w < mh reads D values of dO and O at row m = w / H, head w mod H:
            // both contiguous of one dtype (checked above) and [B·T, H·D] as `bthd` says (the
            // caller's RowDot, made from O's dims); out has mh. One stream: g's device's.
            unsafe { bld.launch(cfg) }.w()?;
        })
    });
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
