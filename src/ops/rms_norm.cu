// RMSNorm forward and backward (ops::rms_norm): the generic kernels over f32 or bf16, and
// the bf16 ones over 8 values a thread; the padded-row forms write or read rows wider than d
// (ops::fold). `off` is added to the gain: 0, or 1 for Gemma's 1 + w, whose product takes the
// unrounded x̂ (Gemma2RMSNorm works in f32 until its one cast).

// The normalised value as the gain meets it: rounded to T (Llama), or not (Gemma, off ≠ 0).
template <typename T>
__device__ __forceinline__ float rms_n(const T* like, float n, float off) {
    return off != 0.f ? n : rnd(like, n);
}

// y = round(x · rsqrt(mean(x²) + eps)) · (w + off) ; one block per row of d.
template <typename T>
__device__ void rms_norm(const T* x, const T* w, T* y, int d, float eps, float off) {
    long row = blockIdx.x;
    const T* xr = x + row * d;
    T* yr = y + row * d;
    float s = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) { float v = ld(xr, i); s += v * v; }
    s = block_sum(s);
    float r = rsqrtf(s / d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x)
        st(yr, i, rms_n(xr, ld(xr, i) * r, off) * (ld(w, i) + off));
}

// dx = r · (g·w − x·r · mean(g·w·x·r)), r = rsqrt(mean(x²) + eps), w the gain + off; one
// block per row.
template <typename T>
__device__ void rms_norm_bwd(const T* x, const T* w, const T* g, const T* res, T* dx, int d,
                             float eps, int has_res, float off) {
    long row = blockIdx.x;
    const T* xr = x + row * d;
    const T* gr = g + row * d;
    float s = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) { float v = ld(xr, i); s += v * v; }
    float r = rsqrtf(block_sum(s) / d + eps);
    float dot = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) dot += ld(gr, i) * (ld(w, i) + off) * ld(xr, i);
    dot = block_sum(dot) * r / d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = r * (ld(gr, i) * (ld(w, i) + off) - ld(xr, i) * r * dot);
        if (has_res) v += ld(res + row * d, i);  // dL/dx of a residual branch, summed in f32
        st(dx + row * d, i, v);
    }
}
// Row blockIdx.x of y, ldy elements apart (ldy = d, or wider: a padded row, see rms_norm_pad).
__device__ __forceinline__ void rms_norm_v8_row(const bf16_t* x, const bf16_t* w, bf16_t* y,
                                                int d, float eps, long ldy, float off) {
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
        for (int j = 0; j < 8; ++j) v[j] = rms_n(xr, v[j] * r, off) * (wv[j] + off);
        st8(y + row * ldy, i, v);
    }
}
extern "C" __global__ void rms_norm_v8_bf16(const bf16_t* x, const bf16_t* w, bf16_t* y, int d,
                                            float eps, float off) {
    rms_norm_v8_row(x, w, y, d, eps, d, off);
}
// rms_norm_v8 into rows ldy apart: the first d columns of a [rows, ldy] buffer whose last
// ldy − d the caller fills (the adapters' x·Aᵀ next to x: ops::fold).
extern "C" __global__ void rms_norm_pad_v8_bf16(const bf16_t* x, const bf16_t* w, bf16_t* y,
                                                int d, float eps, long ldy, float off) {
    rms_norm_v8_row(x, w, y, d, eps, ldy, off);
}
// h = round(x + a), y = rms_norm(h) · w: a residual add and the norm after it in one pass over
// the row (h is re-read by the thread that wrote it), the values of add_bf16 then rms_norm_v8.
// y's rows are ldy apart (ldy = d, or a padded row as in rms_norm_pad_v8).
extern "C" __global__ void add_rms_norm_v8_bf16(const bf16_t* x, const bf16_t* a, const bf16_t* w,
                                                bf16_t* h, bf16_t* y, int d, float eps, long ldy,
                                                float off) {
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
        for (int j = 0; j < 8; ++j) v[j] = rms_n(h, v[j] * r, off) * (u[j] + off);
        st8(y + (long)blockIdx.x * ldy, i, v);
    }
}
// g's rows are ldg apart (d, or a padded dL/dy's rows: ops::fold).
__device__ __forceinline__ void rms_norm_bwd_v8_row(const bf16_t* x, const bf16_t* w,
                                                    const bf16_t* g, const bf16_t* res, bf16_t* dx,
                                                    int d, float eps, int has_res, long ldg,
                                                    float off) {
    long row = blockIdx.x;
    const bf16_t* xr = x + row * d;
    const bf16_t* gr = g + row * ldg;
    float s = 0.f, dot = 0.f, v[8], wv[8], gv[8];
    for (int i = threadIdx.x * 8; i < d; i += blockDim.x * 8) {
        ld8(xr, i, v); ld8(w, i, wv); ld8(gr, i, gv);
#pragma unroll
        for (int j = 0; j < 8; ++j) { s += v[j] * v[j]; dot += gv[j] * (wv[j] + off) * v[j]; }
    }
    float r = rsqrtf(block_sum(s) / d + eps);
    dot = block_sum(dot) * r / d;
    for (int i = threadIdx.x * 8; i < d; i += blockDim.x * 8) {
        ld8(xr, i, v); ld8(w, i, wv); ld8(gr, i, gv);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = r * (gv[j] * (wv[j] + off) - v[j] * r * dot);
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
                                                int has_res, float off) {
    rms_norm_bwd_v8_row(x, w, g, res, dx, d, eps, has_res, d, off);
}
extern "C" __global__ void rms_norm_bwd_ld_v8_bf16(const bf16_t* x, const bf16_t* w,
                                                   const bf16_t* g, const bf16_t* res, bf16_t* dx,
                                                   int d, float eps, int has_res, long ldg,
                                                   float off) {
    rms_norm_bwd_v8_row(x, w, g, res, dx, d, eps, has_res, ldg, off);
}

#define RMS_NORM_INST(NAME, T) \
extern "C" __global__ void rms_norm_##NAME(const T* x, const T* w, T* y, int d, float eps, \
    float off) { rms_norm<T>(x, w, y, d, eps, off); } \
extern "C" __global__ void rms_norm_bwd_##NAME(const T* x, const T* w, const T* g, const T* res, \
    T* dx, int d, float eps, int has_res, float off) \
    { rms_norm_bwd<T>(x, w, g, res, dx, d, eps, has_res, off); }
RMS_NORM_INST(f32, float)
RMS_NORM_INST(bf16, bf16_t)
#undef RMS_NORM_INST
