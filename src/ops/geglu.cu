// GeGLU forward and backward (ops::glu, Act::GeluTanh): a = round(gelu_tanh(g)) · u, and its
// backward, generic over f32 or bf16 and over 8 bf16 values a thread. The math of PyTorch's
// gelu(approximate="tanh") and its backward, in f32.

__device__ __forceinline__ float gelu_t(float g) {
    return 0.5f * g * (1.f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)));
}
__device__ __forceinline__ float gelu_t_grad(float g) {
    float t = tanhf(0.7978845608f * (g + 0.044715f * g * g * g));
    return 0.5f * (1.f + t) + 0.5f * g * (1.f - t * t) * 0.7978845608f * (1.f + 0.134145f * g * g);
}

template <typename T>
__device__ void geglu(const T* g, const T* u, T* a, long n) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    st(a, k, rnd(g, gelu_t(ld(g, k))) * ld(u, k));
}

// out[0:n] = dg = round(da·u) · gelu'(g), out[n:2n] = du = da · round(gelu(g)).
template <typename T>
__device__ void geglu_bwd(const T* g, const T* u, const T* da, T* out, long n) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    float gv = ld(g, k), d = ld(da, k);
    st(out, k, rnd(g, d * ld(u, k)) * gelu_t_grad(gv));
    st(out, n + k, d * rnd(g, gelu_t(gv)));
}

extern "C" __global__ void geglu_v8_bf16(const bf16_t* g, const bf16_t* u, bf16_t* a, long n) {
    long k = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (k >= n) return;
    float gv[8], uv[8], o[8];
    ld8(g, k, gv); ld8(u, k, uv);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = rbf(gelu_t(gv[i])) * uv[i];
    st8(a, k, o);
}
extern "C" __global__ void geglu_bwd_v8_bf16(const bf16_t* g, const bf16_t* u, const bf16_t* da,
                                             bf16_t* out, long n) {
    long k = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (k >= n) return;
    float gv[8], uv[8], dv[8], dg[8], du[8];
    ld8(g, k, gv); ld8(u, k, uv); ld8(da, k, dv);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        dg[i] = rbf(dv[i] * uv[i]) * gelu_t_grad(gv[i]);
        du[i] = dv[i] * rbf(gelu_t(gv[i]));
    }
    st8(out, k, dg);
    st8(out, n + k, du);
}
// geglu_bwd and the forward's a at once, a written over da (read first, element by element).
extern "C" __global__ void geglu_bwd_keep_v8_bf16(const bf16_t* g, const bf16_t* u, bf16_t* da_a,
                                                  bf16_t* out, long n) {
    long k = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (k >= n) return;
    float gv[8], uv[8], dv[8], dg[8], du[8], a[8];
    ld8(g, k, gv); ld8(u, k, uv); ld8(da_a, k, dv);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float ge = rbf(gelu_t(gv[i]));
        dg[i] = rbf(dv[i] * uv[i]) * gelu_t_grad(gv[i]);
        du[i] = dv[i] * ge;
        a[i] = ge * uv[i];  // exactly as geglu_v8_bf16
    }
    st8(out, k, dg);
    st8(out, n + k, du);
    st8(da_a, k, a);
}

// The gated activation into rows lda apart, for the fold's padded input of down_proj: a
// [n / d, lda] buffer's first d columns (d a multiple of 8), each value exactly as
// swiglu_v8_bf16's (GELU false) or geglu_v8_bf16's.
template<bool GELU>
__device__ void glu_pad_v8(const bf16_t* g, const bf16_t* u, bf16_t* a, long n, long d, long lda) {
    long k = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (k >= n) return;
    float gv[8], uv[8], o[8];
    ld8(g, k, gv); ld8(u, k, uv);
#pragma unroll
    for (int i = 0; i < 8; ++i)
        o[i] = (GELU ? rbf(gelu_t(gv[i])) : rbf(gv[i] / (1.f + __expf(-gv[i])))) * uv[i];
    st8(a, (k / d) * lda + k % d, o);
}
extern "C" __global__ void swiglu_pad_v8_bf16(const bf16_t* g, const bf16_t* u, bf16_t* a, long n,
                                              long d, long lda) {
    glu_pad_v8<false>(g, u, a, n, d, lda);
}
extern "C" __global__ void geglu_pad_v8_bf16(const bf16_t* g, const bf16_t* u, bf16_t* a, long n,
                                             long d, long lda) {
    glu_pad_v8<true>(g, u, a, n, d, lda);
}

#define GEGLU_INST(NAME, T) \
extern "C" __global__ void geglu_##NAME(const T* g, const T* u, T* a, long n) \
    { geglu<T>(g, u, a, n); } \
extern "C" __global__ void geglu_bwd_##NAME(const T* g, const T* u, const T* da, T* out, long n) \
    { geglu_bwd<T>(g, u, da, out, n); }
GEGLU_INST(f32, float)
GEGLU_INST(bf16, bf16_t)
#undef GEGLU_INST
