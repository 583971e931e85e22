
// The training head's cross-entropy, forward and backward in one kernel (cross_entropy.rs says
// why). After common.cuh in the one program (ops::cuda): ld/st, ld4/st4 and block_max/block_sum
// are from there.
//
// x [n, v] logits (f32 or bf16, upcast to f32 when read), tgt [n] u32 → ce [n] f32 =
// lse − x[t], dx [n, v] = exp(x − lse) / denom − [j = t] / denom, rounded once to T.
// With cap > 0 (Gemma 2's final soft-cap) the CE is of z = cap·tanh(x / cap), made in f32 as
// each logit is read, and dx takes the cap's derivative: dz · (1 − (z / cap)²).
// One block per row (blockDim a multiple of 32, ≤ 1024); W = 4: four consecutive elements a
// thread (v a multiple of 4 and x 4-element aligned: 8- or 16-byte loads), else W = 1.
// The caller guarantees tgt[row] < v (the data pipeline validates token ids): nothing is
// clamped here.
__device__ __forceinline__ float ce_cap(float x, float cap) {
    return cap > 0.f ? cap * tanhf(x / cap) : x;
}

template <typename T, int W>
__device__ void cross_entropy(const T* x, const unsigned int* tgt, float* ce, T* dx, long v,
                              float denom, float minus, float cap) {
    long row = blockIdx.x;
    const T* xr = x + row * v;
    T* dr = dx + row * v;
    long t = tgt[row];
    float e[4];
    // Pass 1: each thread's running max m and Σ exp(x − m) over its share, the sum rescaled
    // when the max grows (one read of the row). −FLT_MAX, not −inf, so −inf logits add 0.
    float m = -3.402823466e38f, s = 0.f;
    for (long i = threadIdx.x * W; i < v; i += (long)blockDim.x * W) {
        if (W == 4) ld4(xr, i, e); else e[0] = ld(xr, i);
#pragma unroll
        for (int j = 0; j < W; ++j) {
            float z = ce_cap(e[j], cap);
            if (z > m) { s = s * expf(m - z) + 1.f; m = z; }
            else s += expf(z - m);
        }
    }
    float mx = block_max(m);
    float sum = block_sum(s * expf(m - mx));
    if (threadIdx.x == 0)
        ce[row] = (logf(sum) + mx) - ce_cap(ld(xr, t), cap);
    // Pass 2: the tensor ops' roundings: exp(x − max) · (1 / (Σ·denom)), then + (−1/denom) at
    // the target (no fused multiply-add), then one rounding to T.
    float scale = 1.f / (sum * denom);
    for (long i = threadIdx.x * W; i < v; i += (long)blockDim.x * W) {
        if (W == 4) ld4(xr, i, e); else e[0] = ld(xr, i);
#pragma unroll
        for (int j = 0; j < W; ++j) {
            float z = ce_cap(e[j], cap);
            e[j] = __fmul_rn(expf(z - mx), scale);
            if (i + j == t) e[j] = __fadd_rn(e[j], minus);
            if (cap > 0.f) { float u = z / cap; e[j] *= 1.f - u * u; }
        }
        if (W == 4) st4(dr, i, e); else st(dr, i, e[0]);
    }
}

#define CE_INST(NAME, T) \
extern "C" __global__ void cross_entropy_##NAME(const T* x, const unsigned int* tgt, float* ce, \
    T* dx, long v, float denom, float minus, float cap) \
    { cross_entropy<T, 1>(x, tgt, ce, dx, v, denom, minus, cap); } \
extern "C" __global__ void cross_entropy4_##NAME(const T* x, const unsigned int* tgt, float* ce, \
    T* dx, long v, float denom, float minus, float cap) \
    { cross_entropy<T, 4>(x, tgt, ce, dx, v, denom, minus, cap); }
CE_INST(f32, float)
CE_INST(bf16, bf16_t)
