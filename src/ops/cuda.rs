//! CUDA forward kernels for our ops (the backward passes are tensor ops and run as they are).
//!
//! Compiled once per process with NVRTC for the device's architecture, so the build needs no
//! nvcc of its own. bf16 is handled as raw 16-bit storage with PTX conversions (sm_80+), so the
//! source needs no CUDA headers. Math is f32 throughout.

use candle_core::cuda::cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use candle_core::cuda::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use candle_core::cuda::WrapErr;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

const SRC: &str = r#"
typedef unsigned short bf16_t;
__device__ __forceinline__ float ld(const float* p, long i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16_t* p, long i) {
    return __uint_as_float(((unsigned int)p[i]) << 16);
}
__device__ __forceinline__ void st(float* p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16_t* p, long i, float v) {
    bf16_t h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v)); p[i] = h;
}
// Round to the storage type and back (what a cast to the activation dtype does).
__device__ __forceinline__ float rnd(const float*, float v) { return v; }
__device__ __forceinline__ float rnd(const bf16_t*, float v) {
    bf16_t h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return __uint_as_float(((unsigned int)h) << 16);
}

// Sum over the block; every thread gets the result. blockDim.x is a multiple of 32, <= 1024.
__device__ float block_sum(float v) {
    __shared__ float buf[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) buf[warp] = v;
    __syncthreads();
    int nw = blockDim.x >> 5;
    v = lane < nw ? buf[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}
__device__ float block_max(float v) {
    __shared__ float buf[32];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) buf[warp] = v;
    __syncthreads();
    int nw = blockDim.x >> 5;
    v = lane < nw ? buf[lane] : __int_as_float(0xff800000);
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// y = round(x · rsqrt(mean(x²) + eps)) · w ; one block per row of d.
template <typename T>
__device__ void rms_norm(const T* x, const T* w, T* y, int d, float eps) {
    long row = blockIdx.x;
    const T* xr = x + row * d;
    T* yr = y + row * d;
    float s = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) { float v = ld(xr, i); s += v * v; }
    s = block_sum(s);
    float r = rsqrtf(s / d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) st(yr, i, rnd(xr, ld(xr, i) * r) * ld(w, i));
}

// dx = r · (g·w − x·r · mean(g·w·x·r)), r = rsqrt(mean(x²) + eps); one block per row.
template <typename T>
__device__ void rms_norm_bwd(const T* x, const T* w, const T* g, const T* res, T* dx, int d,
                             float eps, int has_res) {
    long row = blockIdx.x;
    const T* xr = x + row * d;
    const T* gr = g + row * d;
    float s = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) { float v = ld(xr, i); s += v * v; }
    float r = rsqrtf(block_sum(s) / d + eps);
    float dot = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) dot += ld(gr, i) * ld(w, i) * ld(xr, i);
    dot = block_sum(dot) * r / d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = r * (ld(gr, i) * ld(w, i) - ld(xr, i) * r * dot);
        if (has_res) v += ld(res + row * d, i);  // dL/dx of a residual branch, summed in f32
        st(dx + row * d, i, v);
    }
}

// x, y: [B, H, T, D]; cos, sin: [B, T, D/2] f32. One thread per rotated pair.
template <typename T>
__device__ void rope(const T* x, const float* cos, const float* sin, T* y,
                     int h, int t, int half, long pairs) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= pairs) return;
    int i = k % half;
    long rest = k / half;
    int ti = rest % t;
    long bh = rest / t;
    long b = bh / h;
    long base = rest * 2 * half;
    long cs = (b * t + ti) * half + i;
    float x1 = ld(x, base + i), x2 = ld(x, base + i + half), c = cos[cs], s = sin[cs];
    st(y, base + i, x1 * c - x2 * s);
    st(y, base + i + half, x2 * c + x1 * s);
}

__device__ __forceinline__ bool allowed(const unsigned int* seg, long b, int t, int i, int j,
                                        int window) {
    return j <= i && (window <= 0 || i - j < window) && (!seg || seg[b * t + j] == seg[b * t + i]);
}

// Attention block rows: s [R, e] with R = B·H·bq; row r is query i = q_off + r % bq of batch
// b = r / (H·bq). One thread block per row.
template <typename T>
__device__ void masked_lse(const T* s, float* lse, const unsigned int* seg, int h, int bq, int e,
                           int t, int q_off, int window, float scale) {
    long row = blockIdx.x;
    int i = q_off + row % bq;
    long b = row / ((long)h * bq);
    const T* sr = s + row * e;
    float m = __int_as_float(0xff800000);
    for (int j = threadIdx.x; j < e; j += blockDim.x)
        if (allowed(seg, b, t, i, j, window)) m = fmaxf(m, ld(sr, j) * scale);
    m = block_max(m);
    float sum = 0.f;
    for (int j = threadIdx.x; j < e; j += blockDim.x)
        if (allowed(seg, b, t, i, j, window)) sum += __expf(ld(sr, j) * scale - m);
    sum = block_sum(sum);
    if (threadIdx.x == 0) lse[row] = m + logf(sum);
}

template <typename T>
__device__ void masked_exp(const T* s, const float* lse, T* p, const unsigned int* seg, int h,
                           int bq, int e, int t, int q_off, int window, float scale) {
    long row = blockIdx.x;
    int i = q_off + row % bq;
    long b = row / ((long)h * bq);
    float l = lse[row];
    for (int j = threadIdx.x; j < e; j += blockDim.x)
        st(p + row * e, j, allowed(seg, b, t, i, j, window) ? __expf(ld(s + row * e, j) * scale - l) : 0.f);
}

// ds = scale · p ⊙ (dp − δ[row]); elementwise over n = R·e.
template <typename T>
__device__ void softmax_bwd(const T* p, const T* dp, const float* delta, T* ds, int e, float scale, long n) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    st(ds, k, ld(p, k) * (ld(dp, k) - delta[k / e]) * scale);
}

// a = round(silu(g)) · u ; elementwise over n.
template <typename T>
__device__ void swiglu(const T* g, const T* u, T* a, long n) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    float gv = ld(g, k);
    st(a, k, rnd(g, gv / (1.f + __expf(-gv))) * ld(u, k));
}

// out[0:n] = dg = round(da·u) · σ(1 + g(1 − σ)), out[n:2n] = du = da · round(silu(g)).
template <typename T>
__device__ void swiglu_bwd(const T* g, const T* u, const T* da, T* out, long n) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    float gv = ld(g, k), d = ld(da, k);
    float s = 1.f / (1.f + __expf(-gv));
    st(out, k, rnd(g, d * ld(u, k)) * s * (1.f + gv * (1.f - s)));
    st(out, n + k, d * rnd(g, gv * s));
}

// Head-major row `rest` = (b·H + h)·T + t of d elements: its start in [B, H, T, D] and in
// token-major rows [B·T, H·D], as (src, dst) for the direction; and its token b·T + t.
__device__ __forceinline__ void relayout_row(long rest, int h, int t, long d, int to_heads,
                                             long* src, long* dst, long* token) {
    int ti = rest % t;
    long bh = rest / t;
    int hh = bh % h;
    long b = bh / h;
    long heads = rest * d;
    long rows = ((b * t + ti) * h + hh) * d;
    *src = to_heads ? rows : heads;
    *dst = to_heads ? heads : rows;
    *token = b * t + ti;
}

// Token-major rows [B·T, H·D] <-> head-major [B, H, T, D], rotating by sign·θ when cos is
// given. One thread per rotated pair, indexed in head-major order.
template <typename T>
__device__ void relayout(const T* x, const float* cos, const float* sin, T* y, int h, int t,
                         int half, long pairs, int to_heads, float sign) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= pairs) return;
    int i = k % half;
    long src, dst, token;
    relayout_row(k / half, h, t, 2 * half, to_heads, &src, &dst, &token);
    float x1 = ld(x, src + i), x2 = ld(x, src + i + half);
    if (cos) {
        long cs = token * half + i;
        float c = cos[cs], s = sign * sin[cs];
        st(y, dst + i, x1 * c - x2 * s);
        st(y, dst + i + half, x2 * c + x1 * s);
    } else {
        st(y, dst + i, x1);
        st(y, dst + i + half, x2);
    }
}

// out [R, bk, D] f32 = sum (or 0) + part[R, ks..ks+bk, D] of part [R, e, D]; n = R·bk·D.
template <typename T>
__device__ void acc_block(const float* sum, const T* part, float* out, long n, int e, int d,
                          int ks, int bk) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    long per = (long)bk * d;
    long r = k / per, rem = k % per;
    float v = ld(part, (r * e + ks) * d + rem);
    out[k] = sum ? sum[k] + v : v;
}

// out = a + b; each thread 8 elements of 16-bit (or 4 of f32) through 16-byte loads when
// `vec` (pointers 16-byte aligned, n a multiple), else one element.
__device__ __forceinline__ float bf_lo(unsigned int v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(unsigned int v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ unsigned int bf_pack(float lo, float hi) {
    bf16_t l, h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(l) : "f"(lo));
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(hi));
    return ((unsigned int)h << 16) | (unsigned int)l;
}
extern "C" __global__ void add_bf16(const bf16_t* a, const bf16_t* b, bf16_t* out, long n, int vec) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec) {
        if (k * 8 >= n) return;
        uint4 x = ((const uint4*)a)[k], y = ((const uint4*)b)[k], z;
        z.x = bf_pack(bf_lo(x.x) + bf_lo(y.x), bf_hi(x.x) + bf_hi(y.x));
        z.y = bf_pack(bf_lo(x.y) + bf_lo(y.y), bf_hi(x.y) + bf_hi(y.y));
        z.z = bf_pack(bf_lo(x.z) + bf_lo(y.z), bf_hi(x.z) + bf_hi(y.z));
        z.w = bf_pack(bf_lo(x.w) + bf_lo(y.w), bf_hi(x.w) + bf_hi(y.w));
        ((uint4*)out)[k] = z;
    } else if (k < n) {
        st(out, k, ld(a, k) + ld(b, k));
    }
}
extern "C" __global__ void add_f32(const float* a, const float* b, float* out, long n, int vec) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec) {
        if (k * 4 >= n) return;
        float4 x = ((const float4*)a)[k], y = ((const float4*)b)[k];
        ((float4*)out)[k] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
    } else if (k < n) {
        out[k] = a[k] + b[k];
    }
}

// δ[(b·H + h)·T + t] = Σ_d dO[m, h·D + d] · O[m, h·D + d], m = b·T + t: rows of [B·T, H·D],
// one warp per (m, h).
template <typename T>
__device__ void row_dot(const T* g, const T* o, float* delta, long mh, int h, int t, int d) {
    long w = ((long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (w >= mh) return;
    long m = w / h;
    int hh = w % h;
    const T* gr = g + m * (long)h * d + (long)hh * d;
    const T* orow = o + m * (long)h * d + (long)hh * d;
    float s = 0.f;
    for (int i = lane; i < d; i += 32) s += ld(gr, i) * ld(orow, i);
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffff, s, off);
    if (lane == 0) {
        long b = m / t;
        int ti = m % t;
        delta[(b * h + hh) * t + ti] = s;
    }
}

// `relayout` with 4 consecutive pairs a thread (half a multiple of 4, x and y aligned to 4
// elements): 8- or 16-byte loads and stores, the same rounding.
__device__ __forceinline__ void ld4(const bf16_t* p, long i, float* v) {
    uint2 u = *(const uint2*)(p + i);
    v[0] = bf_lo(u.x); v[1] = bf_hi(u.x); v[2] = bf_lo(u.y); v[3] = bf_hi(u.y);
}
__device__ __forceinline__ void st4(bf16_t* p, long i, const float* v) {
    uint2 u;
    u.x = bf_pack(v[0], v[1]);
    u.y = bf_pack(v[2], v[3]);
    *(uint2*)(p + i) = u;
}
__device__ __forceinline__ void ld4(const float* p, long i, float* v) {
    float4 u = *(const float4*)(p + i);
    v[0] = u.x; v[1] = u.y; v[2] = u.z; v[3] = u.w;
}
__device__ __forceinline__ void st4(float* p, long i, const float* v) {
    *(float4*)(p + i) = make_float4(v[0], v[1], v[2], v[3]);
}
template <typename T>
__device__ void relayout4(const T* x, const float* cos, const float* sin, T* y, int h, int t,
                          int half, long quads, int to_heads, float sign) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= quads) return;
    int q4 = half / 4;
    int i = (k % q4) * 4;
    long src, dst, token;
    relayout_row(k / q4, h, t, 2 * half, to_heads, &src, &dst, &token);
    float x1[4], x2[4], y1[4], y2[4];
    ld4(x, src + i, x1);
    ld4(x, src + i + half, x2);
    long cs = token * half + i;
    for (int j = 0; j < 4; j++) {
        if (cos) {
            float c = cos[cs + j], s = sign * sin[cs + j];
            y1[j] = x1[j] * c - x2[j] * s;
            y2[j] = x2[j] * c + x1[j] * s;
        } else {
            y1[j] = x1[j];
            y2[j] = x2[j];
        }
    }
    st4(y, dst + i, y1);
    st4(y, dst + i + half, y2);
}


// bf16 kernels over 8 values a thread (16-byte loads and stores) for when every pointer is
// 16-byte aligned and the length (or row) a multiple of 8: the scalar versions above move two
// bytes a load and ran at ~1 TB/s. Same math, same roundings.
__device__ __forceinline__ void ld8(const bf16_t* p, long i, float* v) {
    uint4 u = *(const uint4*)(p + i);
    v[0] = bf_lo(u.x); v[1] = bf_hi(u.x); v[2] = bf_lo(u.y); v[3] = bf_hi(u.y);
    v[4] = bf_lo(u.z); v[5] = bf_hi(u.z); v[6] = bf_lo(u.w); v[7] = bf_hi(u.w);
}
__device__ __forceinline__ void st8(bf16_t* p, long i, const float* v) {
    uint4 u;
    u.x = bf_pack(v[0], v[1]); u.y = bf_pack(v[2], v[3]);
    u.z = bf_pack(v[4], v[5]); u.w = bf_pack(v[6], v[7]);
    *(uint4*)(p + i) = u;
}
__device__ __forceinline__ float rbf(float v) { return rnd((const bf16_t*)0, v); }
extern "C" __global__ void swiglu_v8_bf16(const bf16_t* g, const bf16_t* u, bf16_t* a, long n) {
    long k = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (k >= n) return;
    float gv[8], uv[8], o[8];
    ld8(g, k, gv); ld8(u, k, uv);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = rbf(gv[i] / (1.f + __expf(-gv[i]))) * uv[i];
    st8(a, k, o);
}
extern "C" __global__ void swiglu_bwd_v8_bf16(const bf16_t* g, const bf16_t* u, const bf16_t* da,
                                              bf16_t* out, long n) {
    long k = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (k >= n) return;
    float gv[8], uv[8], dv[8], dg[8], du[8];
    ld8(g, k, gv); ld8(u, k, uv); ld8(da, k, dv);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float s = 1.f / (1.f + __expf(-gv[i]));
        dg[i] = rbf(dv[i] * uv[i]) * s * (1.f + gv[i] * (1.f - s));
        du[i] = dv[i] * rbf(gv[i] * s);
    }
    st8(out, k, dg);
    st8(out, n + k, du);
}
// swiglu_bwd and the forward's a = round(silu(g)) · u at once; a is written over da (read first,
// element by element), so that a backward that wants a after da needs no buffer for it.
extern "C" __global__ void swiglu_bwd_keep_v8_bf16(const bf16_t* g, const bf16_t* u, bf16_t* da_a,
                                                   bf16_t* out, long n) {
    long k = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (k >= n) return;
    float gv[8], uv[8], dv[8], dg[8], du[8], a[8];
    ld8(g, k, gv); ld8(u, k, uv); ld8(da_a, k, dv);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float s = 1.f / (1.f + __expf(-gv[i]));
        dg[i] = rbf(dv[i] * uv[i]) * s * (1.f + gv[i] * (1.f - s));
        du[i] = dv[i] * rbf(gv[i] * s);
        a[i] = rbf(gv[i] / (1.f + __expf(-gv[i]))) * uv[i];  // exactly as swiglu_v8_bf16
    }
    st8(out, k, dg);
    st8(out, n + k, du);
    st8(da_a, k, a);
}
// Row blockIdx.x of y, ldy elements apart (ldy = d, or wider: a padded row, see rms_norm_pad).
__device__ __forceinline__ void rms_norm_v8_row(const bf16_t* x, const bf16_t* w, bf16_t* y,
                                                int d, float eps, long ldy) {
    long row = blockIdx.x;
    const bf16_t* xr = x + row * d;
    float s = 0.f, v[8], wv[8];
    for (int i = threadIdx.x * 8; i < d; i += blockDim.x * 8) {
        ld8(xr, i, v);
#pragma unroll
        for (int j = 0; j < 8; ++j) s += v[j] * v[j];
    }
    float r = rsqrtf(block_sum(s) / d + eps);
    for (int i = threadIdx.x * 8; i < d; i += blockDim.x * 8) {
        ld8(xr, i, v); ld8(w, i, wv);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = rbf(v[j] * r) * wv[j];
        st8(y + row * ldy, i, v);
    }
}
extern "C" __global__ void rms_norm_v8_bf16(const bf16_t* x, const bf16_t* w, bf16_t* y, int d,
                                            float eps) {
    rms_norm_v8_row(x, w, y, d, eps, d);
}
// rms_norm_v8 into rows ldy apart: the first d columns of a [rows, ldy] buffer whose last
// ldy − d the caller fills (the adapters' x·Aᵀ next to x: ops::fold).
extern "C" __global__ void rms_norm_pad_v8_bf16(const bf16_t* x, const bf16_t* w, bf16_t* y,
                                                int d, float eps, long ldy) {
    rms_norm_v8_row(x, w, y, d, eps, ldy);
}
// swiglu_v8 into rows lda apart: a [n / d, lda] buffer's first d columns (d a multiple of 8).
extern "C" __global__ void swiglu_pad_v8_bf16(const bf16_t* g, const bf16_t* u, bf16_t* a, long n,
                                              long d, long lda) {
    long k = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (k >= n) return;
    float gv[8], uv[8], o[8];
    ld8(g, k, gv); ld8(u, k, uv);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = rbf(gv[i] / (1.f + __expf(-gv[i]))) * uv[i];
    st8(a, (k / d) * lda + k % d, o);
}
// h = round(x + a), y = rms_norm(h) · w: a residual add and the norm after it in one pass over
// the row (h is re-read by the thread that wrote it), the values of add_bf16 then rms_norm_v8.
// y's rows are ldy apart (ldy = d, or a padded row as in rms_norm_pad_v8).
extern "C" __global__ void add_rms_norm_v8_bf16(const bf16_t* x, const bf16_t* a, const bf16_t* w,
                                                bf16_t* h, bf16_t* y, int d, float eps, long ldy) {
    const long o = (long)blockIdx.x * d;
    float s = 0.f, v[8], u[8];
    for (int i = threadIdx.x * 8; i < d; i += blockDim.x * 8) {
        ld8(x + o, i, v); ld8(a + o, i, u);
#pragma unroll
        for (int j = 0; j < 8; ++j) { v[j] = rbf(v[j] + u[j]); s += v[j] * v[j]; }
        st8(h + o, i, v);
    }
    float r = rsqrtf(block_sum(s) / d + eps);
    for (int i = threadIdx.x * 8; i < d; i += blockDim.x * 8) {
        ld8(h + o, i, v); ld8(w, i, u);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = rbf(v[j] * r) * u[j];
        st8(y + (long)blockIdx.x * ldy, i, v);
    }
}
// g's rows are ldg apart (d, or a padded dL/dy's rows: ops::fold).
__device__ __forceinline__ void rms_norm_bwd_v8_row(const bf16_t* x, const bf16_t* w,
                                                    const bf16_t* g, const bf16_t* res, bf16_t* dx,
                                                    int d, float eps, int has_res, long ldg) {
    long row = blockIdx.x;
    const bf16_t* xr = x + row * d;
    const bf16_t* gr = g + row * ldg;
    float s = 0.f, dot = 0.f, v[8], wv[8], gv[8];
    for (int i = threadIdx.x * 8; i < d; i += blockDim.x * 8) {
        ld8(xr, i, v); ld8(w, i, wv); ld8(gr, i, gv);
#pragma unroll
        for (int j = 0; j < 8; ++j) { s += v[j] * v[j]; dot += gv[j] * wv[j] * v[j]; }
    }
    float r = rsqrtf(block_sum(s) / d + eps);
    dot = block_sum(dot) * r / d;
    for (int i = threadIdx.x * 8; i < d; i += blockDim.x * 8) {
        ld8(xr, i, v); ld8(w, i, wv); ld8(gr, i, gv);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = r * (gv[j] * wv[j] - v[j] * r * dot);
        if (has_res) {
            ld8(res + row * d, i, gv);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] += gv[j];
        }
        st8(dx + row * d, i, v);
    }
}
extern "C" __global__ void rms_norm_bwd_v8_bf16(const bf16_t* x, const bf16_t* w, const bf16_t* g,
                                                const bf16_t* res, bf16_t* dx, int d, float eps,
                                                int has_res) {
    rms_norm_bwd_v8_row(x, w, g, res, dx, d, eps, has_res, d);
}
extern "C" __global__ void rms_norm_bwd_ld_v8_bf16(const bf16_t* x, const bf16_t* w,
                                                   const bf16_t* g, const bf16_t* res, bf16_t* dx,
                                                   int d, float eps, int has_res, long ldg) {
    rms_norm_bwd_v8_row(x, w, g, res, dx, d, eps, has_res, ldg);
}

#define INST(NAME, T) \
extern "C" __global__ void rms_norm_##NAME(const T* x, const T* w, T* y, int d, float eps) \
    { rms_norm<T>(x, w, y, d, eps); } \
extern "C" __global__ void rms_norm_bwd_##NAME(const T* x, const T* w, const T* g, const T* res, \
    T* dx, int d, float eps, int has_res) { rms_norm_bwd<T>(x, w, g, res, dx, d, eps, has_res); } \
extern "C" __global__ void rope_##NAME(const T* x, const float* c, const float* s, T* y, \
    int h, int t, int half, long pairs) { rope<T>(x, c, s, y, h, t, half, pairs); } \
extern "C" __global__ void masked_lse_##NAME(const T* s, float* lse, const unsigned int* seg, \
    int h, int bq, int e, int t, int q_off, int window, float scale) \
    { masked_lse<T>(s, lse, seg, h, bq, e, t, q_off, window, scale); } \
extern "C" __global__ void masked_exp_##NAME(const T* s, const float* lse, T* p, \
    const unsigned int* seg, int h, int bq, int e, int t, int q_off, int window, float scale) \
    { masked_exp<T>(s, lse, p, seg, h, bq, e, t, q_off, window, scale); } \
extern "C" __global__ void softmax_bwd_##NAME(const T* p, const T* dp, const float* delta, T* ds, \
    int e, float scale, long n) { softmax_bwd<T>(p, dp, delta, ds, e, scale, n); } \
extern "C" __global__ void relayout_##NAME(const T* x, const float* c, const float* s, T* y, \
    int h, int t, int half, long pairs, int to_heads, float sign) \
    { relayout<T>(x, c, s, y, h, t, half, pairs, to_heads, sign); } \
extern "C" __global__ void acc_block_##NAME(const float* sum, const T* part, float* out, long n, \
    int e, int d, int ks, int bk) { acc_block<T>(sum, part, out, n, e, d, ks, bk); } \
extern "C" __global__ void row_dot_##NAME(const T* g, const T* o, float* delta, long mh, int h, \
    int t, int d) { row_dot<T>(g, o, delta, mh, h, t, d); } \
extern "C" __global__ void relayout4_##NAME(const T* x, const float* c, const float* s, T* y, \
    int h, int t, int half, long quads, int to_heads, float sign) \
    { relayout4<T>(x, c, s, y, h, t, half, quads, to_heads, sign); } \
extern "C" __global__ void swiglu_##NAME(const T* g, const T* u, T* a, long n) \
    { swiglu<T>(g, u, a, n); } \
extern "C" __global__ void swiglu_bwd_##NAME(const T* g, const T* u, const T* da, T* out, long n) \
    { swiglu_bwd<T>(g, u, da, out, n); }
INST(f32, float)
INST(bf16, bf16_t)
"#;

/// One NVRTC program: compiled once per process, loaded once per CUDA context.
struct Program {
    arch: &'static str,
    src: fn() -> String,
    ptx: OnceLock<std::result::Result<Ptx, String>>,
    modules: OnceLock<Mutex<HashMap<usize, Arc<CudaModule>>>>,
}

/// Every kernel of ours, for sm_80 and later (mma.sync, cp.async).
static PORTABLE: Program = Program {
    arch: "sm_80",
    src: || {
        format!(
            "{SRC}{}{}{}{}",
            include_str!("flash.cu"),
            include_str!("multi_tensor.cu"),
            include_str!("cross_entropy.cu"),
            include_str!("fold_bwd.cu")
        )
    },
    ptx: OnceLock::new(),
    modules: OnceLock::new(),
};

/// flash90.cu's wgmma kernels (over flash.cu's helpers, without its kernels), for compute
/// capability 9.0 only: sm_90a code runs on no other architecture.
static HOPPER: Program = Program {
    arch: "sm_90a",
    src: || {
        format!(
            "typedef unsigned short bf16_t;\n#define FLASH_HELPERS_ONLY\n{}{}",
            include_str!("flash.cu"),
            include_str!("flash90.cu")
        )
    },
    ptx: OnceLock::new(),
    modules: OnceLock::new(),
};

fn module(dev: &CudaDevice, prog: &'static Program) -> Result<Arc<CudaModule>> {
    let ptx = prog
        .ptx
        .get_or_init(|| {
            let opts = CompileOptions {
                arch: Some(prog.arch),
                ..Default::default()
            };
            compile_ptx_with_opts((prog.src)(), opts).map_err(|e| format!("{e:?}"))
        })
        .as_ref()
        .map_err(|e| {
            candle_core::Error::Msg(format!(
                "NVRTC failed to compile our kernels for {}: {e}",
                prog.arch
            ))
        })?;
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let key = Arc::as_ptr(ctx) as usize;
    let mut mods = prog
        .modules
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| candle_core::Error::Msg("kernel module cache poisoned".into()))?;
    if let Some(m) = mods.get(&key) {
        return Ok(m.clone());
    }
    let m = ctx.load_module(ptx.clone()).w()?;
    mods.insert(key, m.clone());
    Ok(m)
}

/// Whether `dev` is a Hopper GPU (compute capability 9.0), where flash90.cu's kernels run.
pub fn is_hopper(dev: &CudaDevice) -> Result<bool> {
    Ok(dev.cuda_stream().context().compute_capability().w()? == (9, 0))
}

/// The device address of `t`'s first element when `t` is a contiguous bf16, f16 or f32 CUDA
/// tensor; None otherwise.
pub fn addr(t: &candle_core::Tensor) -> Result<Option<u64>> {
    if !t.is_contiguous() {
        return Ok(None);
    }
    first(t)
}

/// The device address of `t`'s first element and its row stride in elements when `t` is a 2-D
/// bf16, f16 or f32 CUDA tensor whose rows are contiguous (stride [ld, 1], ld ≥ columns): a
/// column slice of a wider matrix, as cuBLAS takes it with its leading dimension. None otherwise.
pub fn addr_rows(t: &candle_core::Tensor) -> Result<Option<(u64, usize)>> {
    let (Ok((_, n)), &[ld, 1]) = (t.dims2(), t.stride()) else {
        return Ok(None);
    };
    if ld < n {
        return Ok(None);
    }
    Ok(first(t)?.map(|p| (p, ld)))
}

/// A fresh contiguous bf16, f16 or f32 tensor of `shape` on `dev` whose contents are not set,
/// for an output that a GEMM or a collective writes whole; None for other dtypes.
///
/// # Safety
/// Every element must be written before any is read.
pub unsafe fn uninit<S: Into<candle_core::Shape>>(
    dev: &CudaDevice,
    dtype: DType,
    shape: S,
) -> Result<Option<candle_core::Tensor>> {
    let shape = shape.into();
    let n = shape.elem_count();
    let s = match dtype {
        DType::BF16 => CudaStorage::wrap_cuda_slice(dev.alloc::<half::bf16>(n)?, dev.clone()),
        DType::F16 => CudaStorage::wrap_cuda_slice(dev.alloc::<half::f16>(n)?, dev.clone()),
        DType::F32 => CudaStorage::wrap_cuda_slice(dev.alloc::<f32>(n)?, dev.clone()),
        _ => return Ok(None),
    };
    Ok(Some(candle_core::Tensor::from_storage(
        candle_core::Storage::Cuda(s),
        shape,
        candle_core::op::BackpropOp::none(),
        false,
    )))
}

/// The device address of `t`'s first element (its layout's start), whatever its strides.
fn first(t: &candle_core::Tensor) -> Result<Option<u64>> {
    use candle_core::cuda::cudarc::driver::DevicePtr;
    let (s, l) = t.storage_and_layout();
    let candle_core::Storage::Cuda(cs) = &*s else {
        return Ok(None);
    };
    let stream = cs.device.cuda_stream();
    let off = l.start_offset() as u64 * t.dtype().size_in_bytes() as u64;
    let p = match t.dtype() {
        DType::BF16 => cs.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0,
        DType::F16 => cs.as_cuda_slice::<half::f16>()?.device_ptr(&stream).0,
        DType::F32 => cs.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
        _ => return Ok(None),
    };
    Ok(Some(p + off))
}

/// Our kernel `name` on `dev`.
pub(super) fn function(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    module(dev, &PORTABLE)?.load_function(name).w()
}

/// flash90.cu's kernel `name` on `dev`, a Hopper GPU.
pub(super) fn function90(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    module(dev, &HOPPER)?.load_function(name).w()
}

/// Our kernel `name_<dtype of s>` and the stream of `s`'s device.
fn kernel(s: &CudaStorage, name: &str) -> Result<(CudaFunction, Arc<CudaStream>)> {
    use candle_core::backend::BackendStorage;
    let func = module(s.device(), &PORTABLE)?
        .load_function(&format!("{name}_{}", suffix(s.dtype())?))
        .w()?;
    Ok((func, s.device().cuda_stream()))
}

fn suffix(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        d => candle_core::bail!("our CUDA kernels take f32 or bf16 activations, got {d:?}"),
    }
}

/// `$body` with `$v` bound to the f32 or bf16 device view of `$s[$range]`.
macro_rules! with_view {
    ($s:expr, $range:expr, |$v:ident| $body:block) => {{
        match $s.dtype() {
            DType::F32 => {
                let $v = $s.as_cuda_slice::<f32>()?.slice($range);
                $body
            }
            DType::BF16 => {
                let $v = $s.as_cuda_slice::<half::bf16>()?.slice($range);
                $body
            }
            d => candle_core::bail!("our CUDA kernels take f32 or bf16 activations, got {d:?}"),
        }
    }};
}

/// Runs `launch` with the kernel `name_<dtype>` and a fresh output of `n` elements.
macro_rules! with_dtype {
    ($s:expr, $l:expr, $n:expr, |$x:ident, $out:ident| $body:block) => {{
        let dev = $s.device.clone();
        match $s.dtype() {
            DType::F32 => {
                let (o1, o2) = contiguous($l)?;
                let $x = $s.as_cuda_slice::<f32>()?.slice(o1..o2);
                let $out: CudaSlice<f32> = unsafe { dev.alloc::<f32>($n)? };
                $body;
                CudaStorage::wrap_cuda_slice($out, dev)
            }
            DType::BF16 => {
                let (o1, o2) = contiguous($l)?;
                let $x = $s.as_cuda_slice::<half::bf16>()?.slice(o1..o2);
                let $out: CudaSlice<half::bf16> = unsafe { dev.alloc::<half::bf16>($n)? };
                $body;
                CudaStorage::wrap_cuda_slice($out, dev)
            }
            d => candle_core::bail!("our CUDA kernels take f32 or bf16 activations, got {d:?}"),
        }
    }};
}

fn contiguous(l: &Layout) -> Result<(usize, usize)> {
    l.contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("kernel input not contiguous".into()))
}

/// Whether rows of `d` bf16 values starting at these layouts' offsets can go 8 a thread
/// (allocations are 256-byte aligned, so an offset of 8 elements is 16 bytes).
fn v8_rows(x: &CudaStorage, layouts: &[&Layout], d: usize) -> bool {
    use candle_core::backend::BackendStorage;
    x.dtype() == DType::BF16 && d % 8 == 0 && layouts.iter().all(|l| l.start_offset() % 8 == 0)
}

fn threads_for(n: usize) -> u32 {
    (n.div_ceil(32) * 32).clamp(32, 1024) as u32
}

pub fn rms_norm(
    x: &CudaStorage,
    xl: &Layout,
    w: &CudaStorage,
    wl: &Layout,
    eps: f32,
) -> Result<CudaStorage> {
    use candle_core::backend::BackendStorage;
    let d = *xl.dims().last().unwrap_or(&1);
    let n = xl.shape().elem_count();
    let rows = n / d.max(1);
    if w.dtype() != x.dtype() {
        candle_core::bail!("rms_norm: weight {:?} vs input {:?}", w.dtype(), x.dtype());
    }
    let v8 = v8_rows(x, &[xl, wl], d);
    let (func, stream) = kernel(x, if v8 { "rms_norm_v8" } else { "rms_norm" })?;
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads_for((if v8 { d / 8 } else { d }).min(1024)), 1, 1),
        shared_mem_bytes: 0,
    };
    let (w1, w2) = contiguous(wl)?;
    Ok(with_dtype!(x, xl, n, |xs, out| {
        let mut b = stream.launch_builder(&func);
        let (di, e) = (d as i32, eps);
        with_view!(w, w1..w2, |ws| {
            b.arg(&xs).arg(&ws).arg(&out).arg(&di).arg(&e);
            unsafe { b.launch(cfg) }.w()?;
        })
    }))
}

/// dL/dx of rms_norm, plus `res` (another term of dL/dx, of x's shape) when given.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_bwd(
    x: &CudaStorage,
    xl: &Layout,
    w: &CudaStorage,
    wl: &Layout,
    g: &CudaStorage,
    gl: &Layout,
    res: Option<(&CudaStorage, &Layout)>,
    eps: f32,
) -> Result<CudaStorage> {
    use candle_core::backend::BackendStorage;
    let d = *xl.dims().last().unwrap_or(&1);
    let n = xl.shape().elem_count();
    let res_ok = res.is_none_or(|(r, rl)| r.dtype() == x.dtype() && rl.shape().elem_count() == n);
    if w.dtype() != x.dtype() || g.dtype() != x.dtype() || !res_ok {
        candle_core::bail!(
            "rms_norm_bwd: dtypes x {:?} w {:?} g {:?}, or a residual unlike x",
            x.dtype(),
            w.dtype(),
            g.dtype()
        );
    }
    // Without a residual g stands in for it (never read: has_res = 0).
    let (r, rl) = res.unwrap_or((g, gl));
    let v8 = v8_rows(x, &[xl, wl, gl, rl], d);
    let (func, stream) = kernel(
        x,
        if v8 {
            "rms_norm_bwd_v8"
        } else {
            "rms_norm_bwd"
        },
    )?;
    let cfg = LaunchConfig {
        grid_dim: ((n / d.max(1)) as u32, 1, 1),
        block_dim: (threads_for((if v8 { d / 8 } else { d }).min(1024)), 1, 1),
        shared_mem_bytes: 0,
    };
    let (w1, w2) = contiguous(wl)?;
    let (g1, g2) = contiguous(gl)?;
    let (r1, r2) = contiguous(rl)?;
    let (di, e, hr) = (d as i32, eps, res.is_some() as i32);
    Ok(with_dtype!(x, xl, n, |xs, out| {
        let mut b = stream.launch_builder(&func);
        with_view!(w, w1..w2, |ws| {
            with_view!(g, g1..g2, |gv| {
                with_view!(r, r1..r2, |rv| {
                    b.arg(&xs)
                        .arg(&ws)
                        .arg(&gv)
                        .arg(&rv)
                        .arg(&out)
                        .arg(&di)
                        .arg(&e)
                        .arg(&hr);
                    unsafe { b.launch(cfg) }.w()?;
                })
            })
        })
    }))
}

pub fn rope(
    x: &CudaStorage,
    xl: &Layout,
    cos: &CudaStorage,
    cl: &Layout,
    sin: &CudaStorage,
    sl: &Layout,
) -> Result<CudaStorage> {
    use candle_core::backend::BackendStorage;
    let (_b, h, t, d) = xl.shape().dims4()?;
    let n = xl.shape().elem_count();
    let pairs = (n / 2) as i64;
    let (func, stream) = kernel(x, "rope")?;
    let cfg = LaunchConfig::for_num_elems(pairs as u32);
    let (c1, c2) = contiguous(cl)?;
    let (s1, s2) = contiguous(sl)?;
    let cs = cos.as_cuda_slice::<f32>()?.slice(c1..c2);
    let ss = sin.as_cuda_slice::<f32>()?.slice(s1..s2);
    let (hi, ti, half) = (h as i32, t as i32, (d / 2) as i32);
    Ok(with_dtype!(x, xl, n, |xs, out| {
        let mut b = stream.launch_builder(&func);
        b.arg(&xs)
            .arg(&cs)
            .arg(&ss)
            .arg(&out)
            .arg(&hi)
            .arg(&ti)
            .arg(&half)
            .arg(&pairs);
        unsafe { b.launch(cfg) }.w()?;
    }))
}

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
    scale: f32,
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
    let (hi, bqi, ei, ti, qo, wi) = (
        h as i32,
        bq as i32,
        e as i32,
        t as i32,
        q_off as i32,
        window as i32,
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
                .arg(&scale);
        };
    }
    match (lse_in, s.dtype()) {
        (None, DType::F32) | (None, DType::BF16) => {
            let out: CudaSlice<f32> = unsafe { dev.alloc::<f32>(rows)? };
            let mut bld = stream.launch_builder(&func);
            if s.dtype() == DType::F32 {
                let x = s.as_cuda_slice::<f32>()?.slice(o1..o2);
                bld.arg(&x).arg(&out);
                args!(bld);
                unsafe { bld.launch(cfg) }.w()?;
            } else {
                let x = s.as_cuda_slice::<half::bf16>()?.slice(o1..o2);
                bld.arg(&x).arg(&out);
                args!(bld);
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
                unsafe { bld.launch(cfg) }.w()?;
            }))
        }
        (None, d) => candle_core::bail!("attention scores must be f32 or bf16, got {d:?}"),
    }
}

pub fn masked_lse(
    s: &CudaStorage,
    l: &Layout,
    seg: Option<&candle_core::Tensor>,
    t: usize,
    q_off: usize,
    window: usize,
    scale: f32,
) -> Result<CudaStorage> {
    block_rows("masked_lse", s, l, None, seg, t, q_off, window, scale)
}

#[allow(clippy::too_many_arguments)]
pub fn masked_exp(
    s: &CudaStorage,
    l: &Layout,
    lse: &CudaStorage,
    ll: &Layout,
    seg: Option<&candle_core::Tensor>,
    t: usize,
    q_off: usize,
    window: usize,
    scale: f32,
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
        scale,
    )
}

pub fn softmax_bwd(
    p: &CudaStorage,
    pl: &Layout,
    dp: &CudaStorage,
    dpl: &Layout,
    delta: &CudaStorage,
    dl: &Layout,
    scale: f32,
) -> Result<CudaStorage> {
    use candle_core::backend::BackendStorage;
    let e = *pl.dims().last().unwrap_or(&1);
    let n = pl.shape().elem_count();
    if dp.dtype() != p.dtype() {
        candle_core::bail!("softmax_bwd: dP {:?} vs P {:?}", dp.dtype(), p.dtype());
    }
    let (func, stream) = kernel(p, "softmax_bwd")?;
    let cfg = LaunchConfig::for_num_elems(n as u32);
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
            unsafe { bld.launch(cfg) }.w()?;
        })
    }))
}

/// a = silu(g) ⊙ u over contiguous g, u of one dtype.
pub fn swiglu(g: &CudaStorage, gl: &Layout, u: &CudaStorage, ul: &Layout) -> Result<CudaStorage> {
    elementwise("swiglu", g, gl, &[(u, ul)], 1)
}

/// (g, u, da) → [dg; du] (2n elements).
pub fn swiglu_bwd(
    g: &CudaStorage,
    gl: &Layout,
    u: &CudaStorage,
    ul: &Layout,
    da: &CudaStorage,
    dal: &Layout,
) -> Result<CudaStorage> {
    elementwise("swiglu_bwd", g, gl, &[(u, ul), (da, dal)], 2)
}

/// Runs `name_<dtype>(x, others..., out, n)` over n = |x| elements, one thread each, with a
/// fresh output of `outs`·n elements. Every input has x's dtype and is contiguous.
fn elementwise(
    name: &str,
    x: &CudaStorage,
    xl: &Layout,
    others: &[(&CudaStorage, &Layout)],
    outs: usize,
) -> Result<CudaStorage> {
    use candle_core::backend::BackendStorage;
    let n = xl.shape().elem_count();
    for (o, ol) in others {
        if o.dtype() != x.dtype() || ol.shape().elem_count() != n {
            candle_core::bail!(
                "{name}: inputs differ: {:?} {:?} vs {:?} {:?}",
                x.dtype(),
                xl.dims(),
                o.dtype(),
                ol.dims()
            );
        }
    }
    // bf16 with every start on 16 bytes and n a multiple of 8: the 8-a-thread kernel.
    let v8 = x.dtype() == DType::BF16
        && n % 8 == 0
        && std::iter::once(xl)
            .chain(others.iter().map(|(_, l)| *l))
            .all(|l| l.start_offset() % 8 == 0);
    let (func, stream) = kernel(
        x,
        &if v8 {
            format!("{name}_v8")
        } else {
            name.into()
        },
    )?;
    let cfg = LaunchConfig::for_num_elems((if v8 { n / 8 } else { n }).max(1) as u32);
    let nl = n as i64;
    let ranges = others
        .iter()
        .map(|(_, l)| contiguous(l))
        .collect::<Result<Vec<_>>>()?;
    Ok(with_dtype!(x, xl, outs * n, |xs, out| {
        let mut b = stream.launch_builder(&func);
        b.arg(&xs);
        match (others, ranges.as_slice()) {
            ([(o1, _)], [r1]) => with_view!(o1, r1.0..r1.1, |v1| {
                b.arg(&v1).arg(&out).arg(&nl);
                unsafe { b.launch(cfg) }.w()?;
            }),
            ([(o1, _), (o2, _)], [r1, r2]) => with_view!(o1, r1.0..r1.1, |v1| {
                with_view!(o2, r2.0..r2.1, |v2| {
                    b.arg(&v1).arg(&v2).arg(&out).arg(&nl);
                    unsafe { b.launch(cfg) }.w()?;
                })
            }),
            _ => candle_core::bail!("{name}: one or two extra inputs expected"),
        }
    }))
}

/// `ops::rms_norm::add_rms_norm` on the GPU: (h, y) for bf16 x and a of one shape and w of
/// their last dim d, all contiguous, on 16 bytes, d a multiple of 8; None otherwise.
pub fn add_rms_norm(
    x: &candle_core::Tensor,
    a: &candle_core::Tensor,
    w: &candle_core::Tensor,
    eps: f32,
) -> Result<Option<(candle_core::Tensor, candle_core::Tensor)>> {
    add_rms_norm_pad(x, a, w, eps, 0)
}

/// `add_rms_norm` with y's rows `pad` columns wider ([rows, d + pad], pad a multiple of 8; y as
/// x's shape when pad = 0): the pad columns are left unset for the caller (`ops::fold`).
pub fn add_rms_norm_pad(
    x: &candle_core::Tensor,
    a: &candle_core::Tensor,
    w: &candle_core::Tensor,
    eps: f32,
    pad: usize,
) -> Result<Option<(candle_core::Tensor, candle_core::Tensor)>> {
    use candle_core::{op::BackpropOp, Device, Storage, Tensor};
    let Device::Cuda(dev) = x.device() else {
        return Ok(None);
    };
    let (n, d) = (x.elem_count(), w.elem_count());
    let bf16 = [x, a, w].iter().all(|t| t.dtype() == DType::BF16);
    if !bf16 || a.shape() != x.shape() || x.dims().last() != Some(&d) || d % 8 != 0 || n == 0 {
        return Ok(None);
    }
    if pad % 8 != 0 {
        return Ok(None);
    }
    let (rows, ldy) = (n / d, d + pad);
    let (Some(xp), Some(ap), Some(wp)) = (addr(x)?, addr(a)?, addr(w)?) else {
        return Ok(None);
    };
    if [xp, ap, wp].iter().any(|p| p % 16 != 0) {
        return Ok(None);
    }
    let func = function(dev, "add_rms_norm_v8_bf16")?;
    let stream = dev.cuda_stream();
    // SAFETY (both): every element is written by the kernel.
    let h = unsafe { stream.alloc::<half::bf16>(n) }.w()?;
    // (y's pad columns are the caller's to write, see above.)
    let y = unsafe { stream.alloc::<half::bf16>(rows * ldy) }.w()?;
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads_for((d / 8).min(1024)), 1, 1),
        shared_mem_bytes: 0,
    };
    let (di, e, ldl) = (d as i32, eps, ldy as i64);
    let mut b = stream.launch_builder(&func);
    b.arg(&xp)
        .arg(&ap)
        .arg(&wp)
        .arg(&h)
        .arg(&y)
        .arg(&di)
        .arg(&e)
        .arg(&ldl);
    // SAFETY: x, a, w are live contiguous bf16 buffers of the sizes checked, on this stream; h
    // and y are fresh.
    unsafe { b.launch(cfg) }.w()?;
    let wrap = |buf, shape: candle_core::Shape| {
        Tensor::from_storage(
            Storage::Cuda(CudaStorage::wrap_cuda_slice(buf, dev.clone())),
            shape,
            BackpropOp::none(),
            false,
        )
    };
    let y_shape = match pad {
        0 => x.shape().clone(),
        _ => (rows, ldy).into(),
    };
    Ok(Some((wrap(h, x.shape().clone()), wrap(y, y_shape))))
}

/// `rms_norm` of bf16 x [.., d] into the first d columns of a fresh [rows, d + pad] (pad a
/// multiple of 8); the pad columns are left unset for the caller (`ops::fold`). None when the
/// operands do not suit the 8-a-thread kernel.
pub fn rms_norm_pad(
    x: &candle_core::Tensor,
    w: &candle_core::Tensor,
    eps: f32,
    pad: usize,
) -> Result<Option<candle_core::Tensor>> {
    use candle_core::Device;
    let Device::Cuda(dev) = x.device() else {
        return Ok(None);
    };
    let (n, d) = (x.elem_count(), w.elem_count());
    if x.dims().last() != Some(&d) || d % 8 != 0 || pad % 8 != 0 || n == 0 {
        return Ok(None);
    }
    let Some([xp, wp]) = v8_addrs([x, w])? else {
        return Ok(None);
    };
    let (rows, ldy) = (n / d, d + pad);
    // SAFETY: the kernel writes every row's first d columns; the pad is the caller's (above).
    let Some((y, yp)) = (unsafe { padded_rows(dev, rows, ldy)? }) else {
        return Ok(None);
    };
    let func = function(dev, "rms_norm_pad_v8_bf16")?;
    let stream = dev.cuda_stream();
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads_for((d / 8).min(1024)), 1, 1),
        shared_mem_bytes: 0,
    };
    let (di, e, ldl) = (d as i32, eps, ldy as i64);
    let mut b = stream.launch_builder(&func);
    b.arg(&xp).arg(&wp).arg(&yp).arg(&di).arg(&e).arg(&ldl);
    // SAFETY: x and w are live contiguous bf16 buffers of the sizes checked, on this stream; y
    // is fresh, [rows, ldy].
    unsafe { b.launch(cfg) }.w()?;
    Ok(Some(y))
}

/// `ops::rms_norm_bwd(_add)` for bf16 x [.., d] (contiguous), w [d], g a row-strided [rows, d]
/// (a padded dL/dy's first d columns, `ops::fold`) and `res` of x's shape or none: the v8
/// kernel reading g's rows ldg apart. None where it cannot take them (then g is copied).
pub fn rms_norm_bwd_rows(
    x: &candle_core::Tensor,
    w: &candle_core::Tensor,
    eps: f32,
    g: &candle_core::Tensor,
    res: Option<&candle_core::Tensor>,
) -> Result<Option<candle_core::Tensor>> {
    use candle_core::Device;
    let Device::Cuda(dev) = x.device() else {
        return Ok(None);
    };
    let (n, d) = (x.elem_count(), *x.dims().last().unwrap_or(&0));
    let (Ok((rows, gd)), Some((gp, ldg))) = (g.dims2(), addr_rows(g)?) else {
        return Ok(None);
    };
    let res_ok = res.is_none_or(|r| r.shape() == x.shape());
    if d == 0 || d % 8 != 0 || gd != d || rows * d != n || ldg % 8 != 0 || !res_ok {
        return Ok(None);
    }
    if g.dtype() != DType::BF16 || gp % 16 != 0 || w.elem_count() != d {
        return Ok(None);
    }
    let Some([xp, wp]) = v8_addrs([x, w])? else {
        return Ok(None);
    };
    // Without a residual g stands in for it (never read: has_res = 0).
    let rp = match res {
        Some(r) => match v8_addrs([r])? {
            Some([rp]) => rp,
            None => return Ok(None),
        },
        None => gp,
    };
    // SAFETY: the kernel writes every row's d values.
    let Some(dx) = (unsafe { uninit(dev, DType::BF16, x.shape().clone())? }) else {
        return Ok(None);
    };
    let Some(dp) = addr(&dx)? else {
        return Ok(None);
    };
    let func = function(dev, "rms_norm_bwd_ld_v8_bf16")?;
    let stream = dev.cuda_stream();
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads_for((d / 8).min(1024)), 1, 1),
        shared_mem_bytes: 0,
    };
    let (di, hr, ldl) = (d as i32, res.is_some() as i32, ldg as i64);
    let mut b = stream.launch_builder(&func);
    b.arg(&xp)
        .arg(&wp)
        .arg(&gp)
        .arg(&rp)
        .arg(&dp)
        .arg(&di)
        .arg(&eps)
        .arg(&hr)
        .arg(&ldl);
    // SAFETY: x, w and res are live contiguous bf16 buffers of the sizes checked, g rows of d
    // ldg apart; dx is fresh; all on this stream.
    unsafe { b.launch(cfg) }.w()?;
    Ok(Some(dx))
}

/// The addresses of bf16 CUDA tensors that are each contiguous and on 16 bytes (the loads of
/// the 8-a-thread kernels); None if any is not.
fn v8_addrs<const N: usize>(ts: [&candle_core::Tensor; N]) -> Result<Option<[u64; N]>> {
    let mut out = [0u64; N];
    for (o, t) in out.iter_mut().zip(ts) {
        match (t.dtype(), addr(t)?) {
            (DType::BF16, Some(p)) if p % 16 == 0 => *o = p,
            _ => return Ok(None),
        }
    }
    Ok(Some(out))
}

/// A fresh bf16 [rows, ld] and its address, for a kernel that writes the first columns of
/// each row (`ops::fold`'s padded rows).
///
/// # Safety
/// As `uninit`: every element must be written before it is read.
unsafe fn padded_rows(
    dev: &CudaDevice,
    rows: usize,
    ld: usize,
) -> Result<Option<(candle_core::Tensor, u64)>> {
    // SAFETY: the caller's contract.
    let Some(t) = (unsafe { uninit(dev, DType::BF16, (rows, ld))? }) else {
        return Ok(None);
    };
    Ok(addr(&t)?.map(|p| (t, p)))
}

/// `swiglu` of bf16 g, u [.., d] into the first d columns of a fresh [rows, d + pad] (d and
/// pad multiples of 8); the pad columns are left unset for the caller (`ops::fold`).
pub fn swiglu_pad(
    g: &candle_core::Tensor,
    u: &candle_core::Tensor,
    pad: usize,
) -> Result<Option<candle_core::Tensor>> {
    use candle_core::Device;
    let Device::Cuda(dev) = g.device() else {
        return Ok(None);
    };
    let n = g.elem_count();
    let d = *g.dims().last().unwrap_or(&0);
    if u.shape() != g.shape() || d % 8 != 0 || pad % 8 != 0 || n == 0 {
        return Ok(None);
    }
    let Some([gp, up]) = v8_addrs([g, u])? else {
        return Ok(None);
    };
    let (rows, lda) = (n / d, d + pad);
    // SAFETY: the kernel writes every row's first d columns; the pad is the caller's (above).
    let Some((a, ap)) = (unsafe { padded_rows(dev, rows, lda)? }) else {
        return Ok(None);
    };
    let func = function(dev, "swiglu_pad_v8_bf16")?;
    let stream = dev.cuda_stream();
    let cfg = LaunchConfig::for_num_elems((n / 8) as u32);
    let (nl, dl, ldl) = (n as i64, d as i64, lda as i64);
    let mut b = stream.launch_builder(&func);
    b.arg(&gp).arg(&up).arg(&ap).arg(&nl).arg(&dl).arg(&ldl);
    // SAFETY: g and u are live contiguous bf16 buffers of n elements on this stream; a is
    // fresh, [rows, lda].
    unsafe { b.launch(cfg) }.w()?;
    Ok(Some(a))
}

/// `ops::swiglu::swiglu_bwd_keep` on the GPU: (dg, du, a) with a written over `da`'s buffer,
/// for bf16 inputs of one shape, contiguous, on 16 bytes, of a multiple of 8 elements; None
/// otherwise. `da` must be a fresh result that nothing else reads (its values are replaced).
pub fn swiglu_bwd_keep(
    g: &candle_core::Tensor,
    u: &candle_core::Tensor,
    da: &candle_core::Tensor,
) -> Result<
    Option<(
        candle_core::Tensor,
        candle_core::Tensor,
        candle_core::Tensor,
    )>,
> {
    use candle_core::{op::BackpropOp, Device, Storage, Tensor};
    let Device::Cuda(dev) = g.device() else {
        return Ok(None);
    };
    let n = g.elem_count();
    let same = [u, da]
        .iter()
        .all(|t| t.dtype() == DType::BF16 && t.shape() == g.shape());
    if g.dtype() != DType::BF16 || !same || n % 8 != 0 || n == 0 {
        return Ok(None);
    }
    let (Some(gp), Some(up), Some(dp)) = (addr(g)?, addr(u)?, addr(da)?) else {
        return Ok(None);
    };
    if [gp, up, dp].iter().any(|p| p % 16 != 0) {
        return Ok(None);
    }
    let func = function(dev, "swiglu_bwd_keep_v8_bf16")?;
    let stream = dev.cuda_stream();
    // SAFETY: every element is written by the kernel (dg, then du).
    let out = unsafe { stream.alloc::<half::bf16>(2 * n) }.w()?;
    let cfg = LaunchConfig::for_num_elems((n / 8) as u32);
    let nl = n as i64;
    let mut b = stream.launch_builder(&func);
    b.arg(&gp).arg(&up).arg(&dp).arg(&out).arg(&nl);
    // SAFETY: g, u and da are live contiguous bf16 buffers of n elements on this stream, out is
    // fresh; da is the caller's to overwrite (see above).
    unsafe { b.launch(cfg) }.w()?;
    let mut dims = vec![2];
    dims.extend_from_slice(g.dims());
    let both = Tensor::from_storage(
        Storage::Cuda(CudaStorage::wrap_cuda_slice(out, dev.clone())),
        dims,
        BackpropOp::none(),
        false,
    );
    Ok(Some((both.get(0)?, both.get(1)?, da.clone())))
}

/// Rows [B·T, H·D] <-> [B, H, T, D] (`to_heads` picks the direction), rotated by sign·θ when
/// `rot` = (cos, sin) [B, T, D/2] f32 is given. `bth` = [B, T, H].
pub fn relayout(
    x: &CudaStorage,
    xl: &Layout,
    rot: Option<(&CudaStorage, &Layout, &CudaStorage, &Layout)>,
    sign: f32,
    to_heads: bool,
    bth: [usize; 3],
) -> Result<CudaStorage> {
    use candle_core::backend::BackendStorage;
    let [b, t, h] = bth;
    let n = xl.shape().elem_count();
    let pairs = (n / 2) as i64;
    let half = (n / (b * t * h) / 2) as i32;
    let (o1, _) = contiguous(xl)?;
    // 4 pairs a thread when every 4-element run is aligned: half % 4, the input's offset, and
    // the allocations (8 bytes for bf16, 16 for f32; candle allocates 256-aligned).
    let vec = half % 4 == 0 && o1 % 4 == 0;
    let (func, stream) = kernel(x, if vec { "relayout4" } else { "relayout" })?;
    let units = if vec { pairs / 4 } else { pairs };
    let cfg = LaunchConfig::for_num_elems(units as u32);
    let (hi, ti, th, sg) = (h as i32, t as i32, to_heads as i32, sign);
    let null: u64 = 0;
    Ok(with_dtype!(x, xl, n, |xs, out| {
        let mut bld = stream.launch_builder(&func);
        bld.arg(&xs);
        let views = match rot {
            Some((c, cl, s, sl)) => {
                let (c1, c2) = contiguous(cl)?;
                let (s1, s2) = contiguous(sl)?;
                Some((
                    c.as_cuda_slice::<f32>()?.slice(c1..c2),
                    s.as_cuda_slice::<f32>()?.slice(s1..s2),
                ))
            }
            None => None,
        };
        match &views {
            Some((cv, sv)) => bld.arg(cv).arg(sv),
            None => bld.arg(&null).arg(&null),
        };
        bld.arg(&out)
            .arg(&hi)
            .arg(&ti)
            .arg(&half)
            .arg(&units)
            .arg(&th)
            .arg(&sg);
        unsafe { bld.launch(cfg) }.w()?;
    }))
}

/// out f32 [R, bk, D] = sum (f32, or zeros) + part[:, ks..ks + bk, :] of part [R, e, D];
/// `red` = [R, e, D, ks, bk].
pub fn acc_block(
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
    let cfg = LaunchConfig::for_num_elems(n as u32);
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
        unsafe { bld.launch(cfg) }.w()?;
    });
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// a + b over contiguous a, b of one dtype (f32 or bf16).
pub fn add(a: &CudaStorage, al: &Layout, b: &CudaStorage, bl: &Layout) -> Result<CudaStorage> {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::DevicePtr;
    let n = al.shape().elem_count();
    if b.dtype() != a.dtype() || bl.shape().elem_count() != n {
        candle_core::bail!(
            "add: {:?} {:?} vs {:?} {:?}",
            a.dtype(),
            al.dims(),
            b.dtype(),
            bl.dims()
        );
    }
    let (func, stream) = kernel(a, "add")?;
    let (b1, b2) = contiguous(bl)?;
    let per = if a.dtype() == DType::BF16 { 8 } else { 4 }; // elements per 16 bytes
    let nl = n as i64;
    Ok(with_dtype!(a, al, n, |av, out| {
        with_view!(b, b1..b2, |bv| {
            // 16-byte vectors when every pointer is 16-byte aligned and n divides.
            let aligned = {
                let (pa, _g1) = av.device_ptr(&stream);
                let (pb, _g2) = bv.device_ptr(&stream);
                let (po, _g3) = out.device_ptr(&stream);
                (pa | pb | po) % 16 == 0
            };
            let vec = aligned && n % per == 0;
            let threads = if vec { n / per } else { n };
            let cfg = LaunchConfig::for_num_elems(threads.max(1) as u32);
            let vi = vec as i32;
            let mut bld = stream.launch_builder(&func);
            bld.arg(&av).arg(&bv).arg(&out).arg(&nl).arg(&vi);
            unsafe { bld.launch(cfg) }.w()?;
        })
    }))
}

/// δ [B, H, T] f32 = rowsum over each head of dO ⊙ O, both rows [B·T, H·D] (contiguous).
pub fn row_dot(
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
    let cfg = LaunchConfig::for_num_elems((mh * 32) as u32);
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
            unsafe { bld.launch(cfg) }.w()?;
        })
    });
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
