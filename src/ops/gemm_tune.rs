//! The algorithm of the large cuBLAS GEMMs, chosen by timing (cuBLASLt).
//!
//! `cublasGemmEx` runs cuBLAS's heuristic pick for a shape, and on an H200 under a training
//! step's power-bound clocks that pick is not always the fastest: another of cuBLASLt's
//! heuristic candidates can be, most of all for the 7B MLP's dL/dx GEMMs.
//!
//! So the first time a large GEMM of a given key runs on a device (shape, transposes, leading
//! dimensions, types, β ≠ 0, operand alignment), cuBLASLt's first `CANDIDATES` heuristic
//! results are timed on the real operands (one warm run each, then `ROUNDS` interleaved rounds
//! of `REPS` runs; the median decides), and the winner runs every later GEMM of that key. A
//! GEMM that accumulates onto its output (β ≠ 0) is timed into a scratch buffer, so that its
//! output is written once.
//!
//! Determinism: only algorithms without split-K are candidates (the heuristic is asked for
//! reduction scheme "none", and each result's split-K count is checked). Every output element
//! is then one f32 sum over k in the same order whichever tile shape computes it, so the
//! choice, which depends on timing, does not change a single bit of the results; gemmEx,
//! which may split K, is not in the race for a tuned key. GEMMs with a small output (under
//! `LARGE` elements: the adapters' x·Aᵀ, g·B and gradients, long sums into a few columns)
//! stay on gemmEx, whose split-K choices they need. The adapters' products back up to full
//! width (xas·Bᵀ [m, out] over k = r; the dL/dx term over k = Σ r) are tuned.
//!
//! `Gemm::Heuristic` (`Kernels::gemm`) runs gemmEx always.
//!
//! One workspace per device (cuMemAlloc, outside the pool, like cuBLAS's own): every GEMM of a
//! device runs on its compute stream (candle's), so they never use it at the same time.

use candle_core::cuda::cudarc::cublas::{result::gemm_ex, sys};
use candle_core::cuda::cudarc::cublaslt::sys as lt;
use candle_core::cuda::cudarc::driver::{result as drv, sys as dsys};
use candle_core::cuda::WrapErr;
use candle_core::{CudaDevice, Result};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

/// Heuristic candidates timed.
const CANDIDATES: usize = 8;
/// Output elements from which a GEMM is tuned.
const LARGE: i64 = 1 << 22;
const ROUNDS: usize = 3;
const REPS: usize = 2;
/// cuBLASLt workspace per device (NVIDIA's recommendation for Hopper).
const WORKSPACE: usize = 32 << 20;

/// One column-major GEMM, cuBLAS's notation: C [m × n] = α·op(A) [m × k] · op(B) [k × n] +
/// β·C, A and B of type `types.0`, C of `types.1`, computed as `types.2`, scaled in f32.
pub(crate) struct Gemm {
    pub(crate) trans: (sys::cublasOperation_t, sys::cublasOperation_t),
    pub(crate) mnk: (i32, i32, i32),
    pub(crate) a: (u64, i32),
    pub(crate) b: (u64, i32),
    pub(crate) c: (u64, i32),
    pub(crate) alpha_beta: (f32, f32),
    pub(crate) types: (
        sys::cudaDataType_t,
        sys::cudaDataType_t,
        sys::cublasComputeType_t,
    ),
}

/// What a key runs.
#[derive(Clone, Copy)]
enum Choice {
    GemmEx,
    Lt(Plan),
}

/// A cuBLASLt matmul ready to run: its descriptors (made once per key, kept for the process)
/// and algorithm.
#[derive(Clone, Copy)]
struct Plan {
    desc: lt::cublasLtMatmulDesc_t,
    layouts: [lt::cublasLtMatrixLayout_t; 3], // A, B, C (= D)
    algo: lt::cublasLtMatmulAlgo_t,
    workspace: usize,
}

/// One device's handle, workspace and choices.
struct DevState {
    handle: lt::cublasLtHandle_t,
    workspace: u64,
    choices: HashMap<Key, Choice>,
}

// SAFETY: the raw handles and descriptors are used only under `STATE`'s lock or copied out of
// it into a call on the device's one compute stream; cuBLASLt handles and descriptors may be
// used from any thread.
unsafe impl Send for DevState {}

/// Within one device's state: shape, transposes, leading dimensions, types, β ≠ 0, operand
/// alignments.
type Key = [i64; 15];

/// A cuBLASLt status as our error.
fn ck(s: lt::cublasStatus_t) -> Result<()> {
    match s {
        lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
        e => Err(candle_core::Error::msg(format!("cuBLASLt: {e:?}"))),
    }
}

/// cuBLAS's enums as cuBLASLt's bindings spell them (the same C enums, so the same values).
fn lt_type(t: sys::cudaDataType_t) -> lt::cudaDataType_t {
    // SAFETY: both are cudaDataType_t's #[repr(u32)] bindings with the same variants.
    unsafe { std::mem::transmute::<sys::cudaDataType_t, lt::cudaDataType_t>(t) }
}

fn lt_compute(t: sys::cublasComputeType_t) -> lt::cublasComputeType_t {
    // SAFETY: both are cublasComputeType_t's #[repr(u32)] bindings with the same variants.
    unsafe { std::mem::transmute::<sys::cublasComputeType_t, lt::cublasComputeType_t>(t) }
}

/// Per device (ordinal), each behind its own lock: a rank that times a new key synchronises
/// its stream, which may wait on a collective that another rank, on another device, must
/// reach first; so no rank ever waits on another device's lock.
static STATE: OnceLock<Mutex<HashMap<usize, Arc<Mutex<DevState>>>>> = OnceLock::new();

/// The largest power of two (≤ 256) that divides `p`: the alignment cuBLASLt is told.
fn align(p: u64) -> u32 {
    1 << p.trailing_zeros().min(8)
}

/// Runs `g` on `dev`'s compute stream: with `Tuned`, a large GEMM by its key's chosen
/// algorithm (the candidates timed first when the key is new); else by gemmEx.
///
/// # Safety
/// As `cublasGemmEx`: the addresses are live device buffers of the sizes the shapes and
/// leading dimensions imply, on `dev`'s compute stream (where cuBLAS runs).
pub(crate) unsafe fn run(
    dev: &CudaDevice,
    g: &Gemm,
    kind: crate::ops::kernels::Gemm,
) -> Result<()> {
    let large = g.mnk.0 as i64 * g.mnk.1 as i64 >= LARGE;
    if kind == crate::ops::kernels::Gemm::Heuristic || !large {
        return gemmex(dev, g, g.c.0);
    }
    let ordinal = dev.cuda_stream().context().ordinal();
    let (t, (m, n, k), (ab, ct, comp)) = (g.trans, g.mnk, g.types);
    let key: Key = [
        t.0 as i64,
        t.1 as i64,
        m as i64,
        n as i64,
        k as i64,
        g.a.1 as i64,
        g.b.1 as i64,
        g.c.1 as i64,
        ab as i64,
        ct as i64,
        comp as i64,
        (g.alpha_beta.1 != 0.0) as i64,
        align(g.a.0) as i64,
        align(g.b.0) as i64,
        align(g.c.0) as i64,
    ];
    let dev_state = {
        let mut all = STATE
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match all.get(&ordinal) {
            Some(d) => d.clone(),
            None => {
                let mut handle = std::ptr::null_mut();
                ck(lt::cublasLtCreate(&mut handle))?;
                dev.cuda_stream().context().bind_to_thread().w()?;
                let workspace = drv::malloc_sync(WORKSPACE).w()?;
                let d = Arc::new(Mutex::new(DevState {
                    handle,
                    workspace,
                    choices: HashMap::new(),
                }));
                all.insert(ordinal, d.clone());
                d
            }
        }
    };
    let mut st = dev_state.lock().unwrap_or_else(|p| p.into_inner());
    let choice = match st.choices.get(&key) {
        Some(c) => *c,
        None => {
            let c = tune(dev, &st, g)?;
            st.choices.insert(key, c);
            c
        }
    };
    let (handle, workspace) = (st.handle, st.workspace);
    drop(st);
    match choice {
        Choice::GemmEx => gemmex(dev, g, g.c.0),
        Choice::Lt(p) => match ltmatmul(dev, handle, workspace, &p, g, g.c.0) {
            Ok(()) => Ok(()),
            Err(_) => gemmex(dev, g, g.c.0), // (alignment or a driver refusal: never fails a run)
        },
    }
}

/// `g` by cublasGemmEx, writing C at `c` (g's own C or a scratch of its size).
unsafe fn gemmex(dev: &CudaDevice, g: &Gemm, c: u64) -> Result<()> {
    let blas = dev.cublas_handle();
    let (alpha, beta) = g.alpha_beta;
    gemm_ex(
        *blas.handle(),
        g.trans.0,
        g.trans.1,
        g.mnk.0,
        g.mnk.1,
        g.mnk.2,
        (&alpha) as *const f32 as *const c_void,
        g.a.0 as *const c_void,
        g.types.0,
        g.a.1,
        g.b.0 as *const c_void,
        g.types.0,
        g.b.1,
        (&beta) as *const f32 as *const c_void,
        c as *mut c_void,
        g.types.1,
        g.c.1,
        g.types.2,
        sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
    )
    .w()
}

/// `g` by plan `p`, writing C (and reading it when β ≠ 0) at `c`.
unsafe fn ltmatmul(
    dev: &CudaDevice,
    handle: lt::cublasLtHandle_t,
    workspace: u64,
    p: &Plan,
    g: &Gemm,
    c: u64,
) -> Result<()> {
    let (alpha, beta) = g.alpha_beta;
    let stream = dev.cuda_stream().cu_stream();
    ck(lt::cublasLtMatmul(
        handle,
        p.desc,
        (&alpha) as *const f32 as *const c_void,
        g.a.0 as *const c_void,
        p.layouts[0],
        g.b.0 as *const c_void,
        p.layouts[1],
        (&beta) as *const f32 as *const c_void,
        c as *const c_void,
        p.layouts[2],
        c as *mut c_void,
        p.layouts[2],
        &p.algo,
        workspace as *mut c_void,
        p.workspace,
        stream as _,
    ))
}

/// The cuBLASLt descriptors of `g` and up to `CANDIDATES` heuristic algorithms for them.
unsafe fn plans(st: &DevState, g: &Gemm) -> Result<Vec<Plan>> {
    use lt::cublasLtMatmulDescAttributes_t as D;
    use lt::cublasLtMatmulPreferenceAttributes_t as P;
    let (m, n, k) = (g.mnk.0 as u64, g.mnk.1 as u64, g.mnk.2 as u64);
    let n_op = sys::cublasOperation_t::CUBLAS_OP_N;
    let mut desc = std::ptr::null_mut();
    ck(lt::cublasLtMatmulDescCreate(
        &mut desc,
        lt_compute(g.types.2),
        lt::cudaDataType_t::CUDA_R_32F,
    ))?;
    for (attr, op) in [
        (D::CUBLASLT_MATMUL_DESC_TRANSA, g.trans.0),
        (D::CUBLASLT_MATMUL_DESC_TRANSB, g.trans.1),
    ] {
        let op = op as i32; // cublasOperation_t, an int32 attribute
        ck(lt::cublasLtMatmulDescSetAttribute(
            desc,
            attr,
            (&op) as *const i32 as *const c_void,
            std::mem::size_of::<i32>(),
        ))?;
    }
    // Stored shapes: op(A) [m × k] is A [m × k] or, transposed, [k × m]; likewise B.
    let (ar, ac) = if g.trans.0 == n_op { (m, k) } else { (k, m) };
    let (br, bc) = if g.trans.1 == n_op { (k, n) } else { (n, k) };
    let mut layouts = [std::ptr::null_mut(); 3];
    for (slot, (ty, r, c, ld)) in layouts.iter_mut().zip([
        (g.types.0, ar, ac, g.a.1),
        (g.types.0, br, bc, g.b.1),
        (g.types.1, m, n, g.c.1),
    ]) {
        ck(lt::cublasLtMatrixLayoutCreate(
            slot,
            lt_type(ty),
            r,
            c,
            ld as i64,
        ))?;
    }
    let mut pref = std::ptr::null_mut();
    ck(lt::cublasLtMatmulPreferenceCreate(&mut pref))?;
    let aligns = [align(g.a.0), align(g.b.0), align(g.c.0)];
    set_pref(
        pref,
        P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
        WORKSPACE as u64,
    )?;
    // allowed reduction schemes: none (no split-K)
    set_pref(pref, P::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, 0u32)?;
    set_pref(
        pref,
        P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
        aligns[0],
    )?;
    set_pref(
        pref,
        P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        aligns[1],
    )?;
    set_pref(
        pref,
        P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
        aligns[2],
    )?;
    set_pref(
        pref,
        P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
        aligns[2],
    )?;
    let mut res: [lt::cublasLtMatmulHeuristicResult_t; CANDIDATES] = std::mem::zeroed();
    let mut count = 0;
    let found = ck(lt::cublasLtMatmulAlgoGetHeuristic(
        st.handle,
        desc,
        layouts[0],
        layouts[1],
        layouts[2],
        layouts[2],
        pref,
        CANDIDATES as i32,
        res.as_mut_ptr(),
        &mut count,
    ));
    ck(lt::cublasLtMatmulPreferenceDestroy(pref))?;
    if found.is_err() {
        return Ok(Vec::new());
    }
    Ok(res
        .iter()
        .take(count.max(0) as usize)
        .filter(|r| {
            r.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                && r.workspaceSize <= WORKSPACE
                && split_k(&r.algo) == Some(1)
        })
        .map(|r| Plan {
            desc,
            layouts,
            algo: r.algo,
            workspace: r.workspaceSize,
        })
        .collect())
}

/// Sets preference attribute `attr` of `pref` to `v` (u32 or u64, as the attribute is).
///
/// # Safety
/// `pref` is a live preference descriptor.
unsafe fn set_pref<T>(
    pref: lt::cublasLtMatmulPreference_t,
    attr: lt::cublasLtMatmulPreferenceAttributes_t,
    v: T,
) -> Result<()> {
    ck(lt::cublasLtMatmulPreferenceSetAttribute(
        pref,
        attr,
        (&v) as *const T as *const c_void,
        std::mem::size_of::<T>(),
    ))
}

/// An algorithm's split-K count (None: unreadable).
fn split_k(algo: &lt::cublasLtMatmulAlgo_t) -> Option<i32> {
    let (mut v, mut written) = (0i32, 0usize);
    // SAFETY: FFI reading one int32 attribute of a heuristic's algorithm into `v`.
    let s = unsafe {
        lt::cublasLtMatmulAlgoConfigGetAttribute(
            algo,
            lt::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
            (&mut v) as *mut i32 as *mut c_void,
            std::mem::size_of::<i32>(),
            &mut written,
        )
    };
    (ck(s).is_ok() && written == std::mem::size_of::<i32>()).then_some(v)
}

/// Times the heuristic candidates on `g`'s operands; returns the fastest.
unsafe fn tune(dev: &CudaDevice, st: &DevState, g: &Gemm) -> Result<Choice> {
    let candidates: Vec<Choice> = plans(st, g)?.into_iter().map(Choice::Lt).collect();
    if candidates.is_empty() {
        return Ok(Choice::GemmEx);
    }
    // β ≠ 0 reads C: time into a scratch C of its size (contents irrelevant to the timing).
    let scratch = match g.alpha_beta.1 != 0.0 {
        true => {
            let elem = match g.types.1 {
                sys::cudaDataType_t::CUDA_R_32F => 4,
                _ => 2,
            };
            // No room for it (a run at the edge of its memory): gemmEx, untimed. The plan
            // does not count this buffer; it lives a moment, in the first step only.
            match dev.alloc::<u8>(g.c.1 as usize * g.mnk.1 as usize * elem) {
                Ok(s) => Some(s),
                Err(_) => return Ok(Choice::GemmEx),
            }
        }
        false => None,
    };
    let stream = dev.cuda_stream();
    let c = match &scratch {
        Some(s) => {
            use candle_core::cuda::cudarc::driver::DevicePtr;
            s.device_ptr(&stream).0
        }
        None => g.c.0,
    };
    let once = |ch: &Choice| -> Result<()> {
        match ch {
            Choice::GemmEx => gemmex(dev, g, c),
            Choice::Lt(p) => ltmatmul(dev, st.handle, st.workspace, p, g, c),
        }
    };
    let timing = Some(dsys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut times: Vec<Vec<f32>> = vec![Vec::new(); candidates.len()];
    let mut ok: Vec<bool> = candidates.iter().map(|ch| once(ch).is_ok()).collect();
    for _ in 0..ROUNDS {
        for (i, ch) in candidates.iter().enumerate() {
            if !ok[i] {
                continue;
            }
            let e0 = stream.record_event(timing).w()?;
            for _ in 0..REPS {
                if once(ch).is_err() {
                    ok[i] = false;
                }
            }
            let e1 = stream.record_event(timing).w()?;
            e1.synchronize().w()?;
            times[i].push(e0.elapsed_ms(&e1).w()?);
        }
    }
    drop(scratch);
    let median = |v: &mut Vec<f32>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(v.len() / 2).copied().unwrap_or(f32::INFINITY)
    };
    let best = times
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| ok[*i])
        .map(|(i, v)| (i, median(v)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(i, _)| i);
    let Some(best) = best else {
        return Ok(Choice::GemmEx); // none ran
    };
    Ok(candidates[best])
}
