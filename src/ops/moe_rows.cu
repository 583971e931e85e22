// A MoE layer's row movement between tokens [m, C] and grouped rows [P, C] (P = m·k, ops::moe_rows),
// bf16, C a multiple of 8: one block per output row, 16 bytes a thread a step, f32 sums.

// out[q, :] = src[idx[q], :]
extern "C" __global__ void moe_gather_bf16(const bf16_t* src, const unsigned* idx, bf16_t* out, int cols) {
    long q = blockIdx.x;
    const uint4* s = (const uint4*)(src + (long)idx[q] * cols);
    uint4* o = (uint4*)(out + q * cols);
    for (int c = threadIdx.x; c < cols / 8; c += blockDim.x) o[c] = s[c];
}

__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    f[0] = bf_lo(v.x); f[1] = bf_hi(v.x); f[2] = bf_lo(v.y); f[3] = bf_hi(v.y);
    f[4] = bf_lo(v.z); f[5] = bf_hi(v.z); f[6] = bf_lo(v.w); f[7] = bf_hi(v.w);
}
__device__ __forceinline__ uint4 pack8(const float* f) {
    uint4 v;
    v.x = bf_pack(f[0], f[1]); v.y = bf_pack(f[2], f[3]);
    v.z = bf_pack(f[4], f[5]); v.w = bf_pack(f[6], f[7]);
    return v;
}

// out[n, :] = Σ_j w[q] · y[q, :] over the k slots of token n, q = slots[j·m + n]
// (w = 1 where null); one rounding.
extern "C" __global__ void moe_combine_bf16(const bf16_t* y, const unsigned* slots, const float* w,
                                            bf16_t* out, int m, int k, int cols) {
    long n = blockIdx.x;
    for (int c = threadIdx.x; c < cols / 8; c += blockDim.x) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, v[8];
        for (int j = 0; j < k; j++) {
            unsigned q = slots[(long)j * m + n];
            float s = w ? w[q] : 1.f;
            unpack8(((const uint4*)(y + (long)q * cols))[c], v);
            for (int e = 0; e < 8; e++) acc[e] += s * v[e];
        }
        ((uint4*)(out + n * cols))[c] = pack8(acc);
    }
}

// For grouped row q of token tok[q]: gy[q, :] = w[q] · g[tok[q], :] and
// dw[q] = Σ_c g[tok[q], c] · y[q, c] (the routing weight's gradient, f32).
extern "C" __global__ void moe_scatter_grad_bf16(const bf16_t* g, const unsigned* tok, const float* w,
                                                 const bf16_t* y, bf16_t* gy, float* dw, int cols) {
    long q = blockIdx.x;
    const uint4* gr = (const uint4*)(g + (long)tok[q] * cols);
    const uint4* yr = (const uint4*)(y + q * cols);
    float s = w[q], dot = 0.f, a[8], b[8];
    for (int c = threadIdx.x; c < cols / 8; c += blockDim.x) {
        unpack8(gr[c], a);
        unpack8(yr[c], b);
        for (int e = 0; e < 8; e++) {
            dot += a[e] * b[e];
            a[e] *= s;
        }
        ((uint4*)(gy + q * cols))[c] = pack8(a);
    }
    dot = block_sum(dot);
    if (threadIdx.x == 0) dw[q] = dot;
}
