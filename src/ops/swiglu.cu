// SwiGLU forward and backward (ops::glu, Act::Silu): the generic kernels over f32 or bf16, and the
// bf16 ones over 8 values a thread (one with the forward's output written over dL/da; the one
// into padded rows, ops::fold's, is geglu.cu's glu_pad_v8, shared with GeGLU).

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
#define SWIGLU_INST(NAME, T) \
extern "C" __global__ void swiglu_##NAME(const T* g, const T* u, T* a, long n) \
    { swiglu<T>(g, u, a, n); } \
extern "C" __global__ void swiglu_bwd_##NAME(const T* g, const T* u, const T* da, T* out, long n) \
    { swiglu_bwd<T>(g, u, da, out, n); }
SWIGLU_INST(f32, float)
SWIGLU_INST(bf16, bf16_t)
#undef SWIGLU_INST
