// The gated activations a = round(act(g)) · u (ops::glu) and their backward: SwiGLU (Silu) and
// GeGLU (GeluTanh, PyTorch's gelu(approximate="tanh")), one struct each, the kernels written
// once over it: generic over f32 or bf16, and over 8 bf16 values a thread (one with the
// forward's output written over dL/da, one into padded rows for ops::fold). Math in f32, the
// products in the order glu.rs's CPU path multiplies them.

__device__ __forceinline__ float gelu_t(float g) {
    return 0.5f * g * (1.f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)));
}
__device__ __forceinline__ float gelu_t_grad(float g) {
    float t = tanhf(0.7978845608f * (g + 0.044715f * g * g * g));
    return 0.5f * (1.f + t) + 0.5f * g * (1.f - t * t) * 0.7978845608f * (1.f + 0.134145f * g * g);
}

// fwd(g): act(g) as the forward computes it. dg(x, g): x · act'(g) for x = round(da · u).
// bwd(g): act(g) as the backward computes it for du = da · round(act(g)); SAME when it is fwd's
// very expression (a kernel needing both then computes it once).
struct Silu {  // σ = sigmoid(g): act' = σ (1 + g (1 − σ))
    static constexpr bool SAME = false;
    static __device__ __forceinline__ float fwd(float g) { return g / (1.f + __expf(-g)); }
    static __device__ __forceinline__ float dg(float x, float g) {
        float s = 1.f / (1.f + __expf(-g));
        return x * s * (1.f + g * (1.f - s));
    }
    static __device__ __forceinline__ float bwd(float g) { return g * (1.f / (1.f + __expf(-g))); }
};
struct GeluTanh {
    static constexpr bool SAME = true;
    static __device__ __forceinline__ float fwd(float g) { return gelu_t(g); }
    static __device__ __forceinline__ float dg(float x, float g) { return x * gelu_t_grad(g); }
    static __device__ __forceinline__ float bwd(float g) { return gelu_t(g); }
};

// a = round(act(g)) · u ; elementwise over n.
template <class Act, typename T>
__device__ void glu(const T* g, const T* u, T* a, long n) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    st(a, k, rnd(g, Act::fwd(ld(g, k))) * ld(u, k));
}

// out[0:n] = dg = round(da·u) · act'(g), out[n:2n] = du = da · round(act(g)).
template <class Act, typename T>
__device__ void glu_bwd(const T* g, const T* u, const T* da, T* out, long n) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    float gv = ld(g, k), d = ld(da, k);
    st(out, k, Act::dg(rnd(g, d * ld(u, k)), gv));
    st(out, n + k, d * rnd(g, Act::bwd(gv)));
}

// o = round(act(g)) · u for the 8 values from k on.
template <class Act>
__device__ __forceinline__ void glu8(const bf16_t* g, const bf16_t* u, long k, float* o) {
    float gv[8], uv[8];
    ld8(g, k, gv); ld8(u, k, uv);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = rbf(Act::fwd(gv[i])) * uv[i];
}

template <class Act>
__device__ void glu_v8(const bf16_t* g, const bf16_t* u, bf16_t* a, long n) {
    long k = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (k >= n) return;
    float o[8];
    glu8<Act>(g, u, k, o);
    st8(a, k, o);
}

// glu_bwd over 8 values a thread; with KEEP also the forward's a, written over da (read first,
// element by element), so that a backward that wants a after da needs no buffer for it.
template <class Act, bool KEEP>
__device__ void glu_bwd_v8(const bf16_t* g, const bf16_t* u, bf16_t* da, bf16_t* out, long n) {
    long k = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (k >= n) return;
    float gv[8], uv[8], dv[8], dg[8], du[8], a[8];
    ld8(g, k, gv); ld8(u, k, uv); ld8(da, k, dv);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float ab = rbf(Act::bwd(gv[i]));
        dg[i] = Act::dg(rbf(dv[i] * uv[i]), gv[i]);
        du[i] = dv[i] * ab;
        if (KEEP) a[i] = (Act::SAME ? ab : rbf(Act::fwd(gv[i]))) * uv[i];  // exactly as glu_v8
    }
    st8(out, k, dg);
    st8(out, n + k, du);
    if (KEEP) st8(da, k, a);
}

// The gated activation into rows lda apart, for the fold's padded input of down_proj: a
// [n / d, lda] buffer's first d columns (d a multiple of 8), each value exactly as glu_v8's.
template <class Act>
__device__ void glu_pad_v8(const bf16_t* g, const bf16_t* u, bf16_t* a, long n, long d, long lda) {
    long k = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (k >= n) return;
    float o[8];
    glu8<Act>(g, u, k, o);
    st8(a, (k / d) * lda + k % d, o);
}

// Each activation's kernels, by the names glu.rs launches: NAME_{f32,bf16}, NAME_bwd_{f32,bf16},
// NAME_v8_bf16, NAME_bwd_v8_bf16, NAME_bwd_keep_v8_bf16, NAME_pad_v8_bf16.
#define GLU_TYPED(NAME, ACT, SUF, T) \
extern "C" __global__ void NAME##_##SUF(const T* g, const T* u, T* a, long n) \
    { glu<ACT, T>(g, u, a, n); } \
extern "C" __global__ void NAME##_bwd_##SUF(const T* g, const T* u, const T* da, T* out, long n) \
    { glu_bwd<ACT, T>(g, u, da, out, n); }
#define GLU_INST(NAME, ACT) \
GLU_TYPED(NAME, ACT, f32, float) \
GLU_TYPED(NAME, ACT, bf16, bf16_t) \
extern "C" __global__ void NAME##_v8_bf16(const bf16_t* g, const bf16_t* u, bf16_t* a, long n) \
    { glu_v8<ACT>(g, u, a, n); } \
extern "C" __global__ void NAME##_bwd_v8_bf16(const bf16_t* g, const bf16_t* u, \
                                              const bf16_t* da, bf16_t* out, long n) \
    { glu_bwd_v8<ACT, false>(g, u, const_cast<bf16_t*>(da), out, n); } \
extern "C" __global__ void NAME##_bwd_keep_v8_bf16(const bf16_t* g, const bf16_t* u, \
                                                   bf16_t* da_a, bf16_t* out, long n) \
    { glu_bwd_v8<ACT, true>(g, u, da_a, out, n); } \
extern "C" __global__ void NAME##_pad_v8_bf16(const bf16_t* g, const bf16_t* u, bf16_t* a, \
                                              long n, long d, long lda) \
    { glu_pad_v8<ACT>(g, u, a, n, d, lda); }
GLU_INST(swiglu, Silu)
GLU_INST(geglu, GeluTanh)
#undef GLU_INST
#undef GLU_TYPED
