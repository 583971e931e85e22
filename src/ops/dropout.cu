// LoRA dropout's masks (ops::dropout): Philox4x32-10 keyed by (seed, step, micro-batch), the
// counter (g mod 2^32, g div 2^32, layer, module) for element group g = e / 8; element e's 16
// bits are lane e % 8 of the 128 (word (e % 8) / 2, the low half for an even e). Kept when its
// bits are >= thr (round(p * 2^16)), then scaled by `scale` (1 / (1 - p)). After common.cuh in
// the one program (ops::cuda); fold_drop.cu and fold_bwd.cu's dropout kernels draw with these.

struct DropKey {
    unsigned k0, k1;        // Philox's key
    unsigned layer, module; // the counter's high words
    unsigned thr;           // dropped below this
    float scale;            // a kept value's factor
};

__device__ __forceinline__ void dr_philox(unsigned* c, unsigned k0, unsigned k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        const unsigned hi0 = __umulhi(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
        const unsigned n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0; c[1] = lo1; c[2] = n2; c[3] = lo0;
    }
}

// The 4 words of element group g (elements 8g .. 8g + 7): word w holds elements 8g + 2w (low
// 16 bits) and 8g + 2w + 1 (high).
__device__ __forceinline__ void dr_group(const DropKey& d, unsigned long long g, unsigned* w) {
    w[0] = (unsigned)g; w[1] = (unsigned)(g >> 32); w[2] = d.layer; w[3] = d.module;
    dr_philox(w, d.k0, d.k1);
}

// Whether the low / high element of a word is kept.
__device__ __forceinline__ bool dr_keep_lo(const DropKey& d, unsigned w) { return (w & 0xffffu) >= d.thr; }
__device__ __forceinline__ bool dr_keep_hi(const DropKey& d, unsigned w) { return (w >> 16) >= d.thr; }

// A 4 × 4 transpose of words among groups of four lanes: the lanes whose index differs only in
// bits b and 2b (b = 1: lanes 4q .. 4q + 3; b = 4: lanes q, q + 4, q + 8, q + 12 of each
// half-warp), i = (lane / b) % 4 a lane's place in its group. Lane i holds row i in w[0..3];
// after, w[q] is row q's word i (column i). Every lane of the warp must take part.
__device__ __forceinline__ void dr_tr4(unsigned* w, int i, int b) {
    const bool hi = i & 2, odd = i & 1;
    unsigned s0 = hi ? w[0] : w[2], s1 = hi ? w[1] : w[3];
    unsigned r0 = __shfl_xor_sync(0xffffffffu, s0, 2 * b);
    unsigned r1 = __shfl_xor_sync(0xffffffffu, s1, 2 * b);
    if (hi) { w[0] = r0; w[1] = r1; } else { w[2] = r0; w[3] = r1; }
    s0 = odd ? w[0] : w[1]; s1 = odd ? w[2] : w[3];
    r0 = __shfl_xor_sync(0xffffffffu, s0, b);
    r1 = __shfl_xor_sync(0xffffffffu, s1, b);
    if (odd) { w[0] = r0; w[2] = r1; } else { w[1] = r0; w[3] = r1; }
}

// y = dropout(x) over n contiguous elements (the mask over the flat index): one thread per
// group of 8, kept values multiplied by scale in f32 and rounded once, dropped ones 0. The
// fallback where no fused kernel takes the operands (ops::dropout::apply).
template<typename T>
__device__ __forceinline__ void dropout_apply(const T* x, T* y, long n, const DropKey& d) {
    const long g = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (8 * g >= n) return;
    unsigned w[4];
    dr_group(d, (unsigned long long)g, w);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const long e = 8 * g + j;
        if (e >= n) break;
        const unsigned bits = (w[j >> 1] >> (16 * (j & 1))) & 0xffffu;
        st(y, e, bits >= d.thr ? ld(x, e) * d.scale : 0.f);
    }
}
extern "C" __global__ void dropout_apply_bf16(const bf16_t* x, bf16_t* y, long n, const DropKey d) { dropout_apply(x, y, n, d); }
extern "C" __global__ void dropout_apply_f32(const float* x, float* y, long n, const DropKey d) { dropout_apply(x, y, n, d); }
