// One-token decoding kernels (generate::cuda): RoPE with the cache write, and attention over the
// cache split along the keys. T is float or bf16_t (raw 16-bit storage); math in f32. Compiled
// after ops/common.cuh (bf16_t, ld, st, rnd).
#define NEG_INF __int_as_float(0xff800000)

// q [H·D], k, v [K·D]: one token's projections at position *posp (device memory, so that a
// captured graph replays for every position); cos, sin [cap, D/2] f32 tables. Writes q rotated
// into qo [H·D], k rotated and v as they are into the cache rows kc, vc [K, cap, D] at the
// position. One thread per (head, pair) over H + K heads (v copied by the k threads).
template <typename T>
__device__ void rope_kv(const T* q, const T* k, const T* v, const float* cos, const float* sin,
                        T* qo, T* kc, T* vc, int h, int kvh, int half, long cap,
                        const unsigned int* posp) {
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    long pairs = (long)(h + kvh) * half;
    if (idx >= pairs) return;
    long pos = *posp;
    if (pos >= cap) return;
    int head = idx / half, i = idx % half, d = 2 * half;
    float c = cos[pos * half + i], s = sin[pos * half + i];
    if (head < h) {
        long b = (long)head * d;
        float x1 = ld(q, b + i), x2 = ld(q, b + i + half);
        st(qo, b + i, x1 * c - x2 * s);
        st(qo, b + i + half, x2 * c + x1 * s);
    } else {
        int kh = head - h;
        long src = (long)kh * d, dst = ((long)kh * cap + pos) * d;
        float x1 = ld(k, src + i), x2 = ld(k, src + i + half);
        st(kc, dst + i, x1 * c - x2 * s);
        st(kc, dst + i + half, x2 * c + x1 * s);
        vc[dst + i] = v[src + i];
        vc[dst + i + half] = v[src + i + half];
    }
}

#define MAXC 8  // head dim up to 32 · MAXC = 256

// Attention of one query per head, at position *posp, against the keys [start, end) of its kv
// head (head / (H / K)): end = pos + 1, start = end − window (0: all). The keys are split in
// chunks of `chunk` (the grid covers the cache: splits past `end` write an empty part): block
// (head, split) writes its chunk's unnormalised output, running max and sum into
// part[(head · S + split) · (D + 2)]: acc[D], m, l. Each warp takes every nw-th key (online
// softmax), then the warps are merged. Blocks of 128 threads.
template <typename T>
__device__ void attn_part(const T* q, const T* kc, const T* vc, float* part, int h, int kvh,
                          int d, long cap, const unsigned int* posp, int window, int chunk,
                          float scale) {
    long e = (long)*posp + 1;
    int end = (int)(e < cap ? e : cap);
    int start = window > 0 ? max(0, end - window) : 0;
    __shared__ float sq[32 * MAXC];
    __shared__ float sm[4][32 * MAXC + 2];
    int head = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    int kh = head / (h / kvh);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int i = threadIdx.x; i < d; i += blockDim.x) sq[i] = ld(q, (long)head * d + i);
    __syncthreads();
    int j0 = start + split * chunk, j1 = min(end, j0 + chunk);
    float m = NEG_INF, l = 0.f, acc[MAXC];
    #pragma unroll
    for (int c = 0; c < MAXC; c++) acc[c] = 0.f;
    const T* kb = kc + (long)kh * cap * d;
    const T* vb = vc + (long)kh * cap * d;
    for (int j = j0 + warp; j < j1; j += nw) {
        float s = 0.f;
        #pragma unroll
        for (int c = 0; c < MAXC; c++) {
            int i = lane + 32 * c;
            if (i < d) s += sq[i] * ld(kb, (long)j * d + i);
        }
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        s *= scale;
        float mn = fmaxf(m, s);
        float corr = __expf(m - mn), p = __expf(s - mn);  // m = -inf at first: corr = 0
        l = l * corr + p;
        #pragma unroll
        for (int c = 0; c < MAXC; c++) {
            int i = lane + 32 * c;
            if (i < d) acc[c] = acc[c] * corr + p * ld(vb, (long)j * d + i);
        }
        m = mn;
    }
    #pragma unroll
    for (int c = 0; c < MAXC; c++) {
        int i = lane + 32 * c;
        if (i < d) sm[warp][i] = acc[c];
    }
    if (lane == 0) { sm[warp][d] = m; sm[warp][d + 1] = l; }
    __syncthreads();
    float* out = part + ((long)head * splits + split) * (d + 2);
    float mm = NEG_INF;
    for (int w = 0; w < nw; w++) mm = fmaxf(mm, sm[w][d]);
    for (int i = threadIdx.x; i < d + 2; i += blockDim.x) {
        float a = 0.f, ll = 0.f;
        for (int w = 0; w < nw; w++) {
            float mw = sm[w][d];
            if (mw == NEG_INF) continue;  // a warp that saw no key
            float f = __expf(mw - mm);
            if (i < d) a += sm[w][i] * f;
            ll += sm[w][d + 1] * f;
        }
        if (i < d) out[i] = a;
        else if (i == d) out[i] = mm;
        else out[i] = ll;
    }
}

// Merges the splits of each head: o[head · D + i] = Σ acc · e^(m − M) / Σ l · e^(m − M).
template <typename T>
__device__ void attn_merge(const float* part, T* o, int d, int splits) {
    int head = blockIdx.x;
    const float* p = part + (long)head * splits * (d + 2);
    float mm = NEG_INF;
    for (int s = 0; s < splits; s++) mm = fmaxf(mm, p[s * (d + 2) + d]);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float a = 0.f, ll = 0.f;
        for (int s = 0; s < splits; s++) {
            const float* ps = p + s * (d + 2);
            if (ps[d] == NEG_INF) continue;
            float f = __expf(ps[d] - mm);
            a += ps[i] * f;
            ll += ps[d + 1] * f;
        }
        st(o, (long)head * d + i, a / ll);
    }
}

// One token's product with a bf16 weight: y[n] = Σ_k x[k] · W[n, k] (+ acc[n]) (+ bias[n]), W
// rows `ldw` apart, k a multiple of 8 and rows 16-byte aligned. A warp per row, 8 rows a block;
// each lane reads 8 weights (16 bytes) at a time, 4 loads in flight; the sum is f32, rounded
// once (after the acc and bias are added, as cuBLAS's β = 1 epilogue and a bias add would
// round twice: within half a bf16 step of theirs).
extern "C" __global__ void gen_gemv_bf16(const bf16_t* x, const bf16_t* w, long ldw,
                                         const bf16_t* acc, const bf16_t* bias, bf16_t* y,
                                         int n, int k) {
    int lane = threadIdx.x & 31, row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= n) return;
    const uint4* wr = (const uint4*)(w + (long)row * ldw);
    const uint4* xv = (const uint4*)x;
    int nv = k >> 3;
    float s = 0.f;
    #pragma unroll 4
    for (int v = lane; v < nv; v += 32) {
        uint4 a = wr[v], b = xv[v];
        unsigned int aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            s += __uint_as_float(aw[j] << 16) * __uint_as_float(bw[j] << 16);
            s += __uint_as_float(aw[j] & 0xffff0000u) * __uint_as_float(bw[j] & 0xffff0000u);
        }
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
    if (lane == 0) {
        if (acc) s += ld(acc, row);
        if (bias) s += ld(bias, row);
        st(y, row, s);
    }
}

// gen_gemv_bf16 for a stacked [gate; up] weight W [2I, k], SwiGLU applied: a[r] =
// silu(g)·u with g = x·W[r] (+ acc[r]), u = x·W[I + r] (+ acc[I + r]), rounded as the separate
// ops round them (g, u, then silu(g), then the product). A warp per r, both rows read at once.
extern "C" __global__ void gen_gemv_swiglu_bf16(const bf16_t* x, const bf16_t* w, long ldw,
                                                const bf16_t* acc, bf16_t* y, int inter, int k) {
    int lane = threadIdx.x & 31, row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= inter) return;
    const uint4* wg = (const uint4*)(w + (long)row * ldw);
    const uint4* wu = (const uint4*)(w + (long)(row + inter) * ldw);
    const uint4* xv = (const uint4*)x;
    int nv = k >> 3;
    float g = 0.f, u = 0.f;
    #pragma unroll 2
    for (int v = lane; v < nv; v += 32) {
        uint4 a = wg[v], c = wu[v], b = xv[v];
        unsigned int aw[4] = {a.x, a.y, a.z, a.w}, cw[4] = {c.x, c.y, c.z, c.w};
        unsigned int bw[4] = {b.x, b.y, b.z, b.w};
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            float b0 = __uint_as_float(bw[j] << 16), b1 = __uint_as_float(bw[j] & 0xffff0000u);
            g += __uint_as_float(aw[j] << 16) * b0 + __uint_as_float(aw[j] & 0xffff0000u) * b1;
            u += __uint_as_float(cw[j] << 16) * b0 + __uint_as_float(cw[j] & 0xffff0000u) * b1;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        g += __shfl_xor_sync(0xffffffff, g, o);
        u += __shfl_xor_sync(0xffffffff, u, o);
    }
    if (lane == 0) {
        if (acc) { g += ld(acc, row); u += ld(acc, row + inter); }
        bf16_t* none = 0;
        g = rnd(none, g);
        u = rnd(none, u);
        st(y, row, rnd(none, g / (1.f + __expf(-g))) * u);
    }
}

#define DECODE_KERNELS(T, S)                                                                     \
extern "C" __global__ void gen_rope_kv_##S(const T* q, const T* k, const T* v, const float* cos, \
        const float* sin, T* qo, T* kc, T* vc, int h, int kvh, int half, long cap,              \
        const unsigned int* posp) {                                                              \
    rope_kv<T>(q, k, v, cos, sin, qo, kc, vc, h, kvh, half, cap, posp);                          \
}                                                                                                \
extern "C" __global__ void gen_attn_part_##S(const T* q, const T* kc, const T* vc, float* part,  \
        int h, int kvh, int d, long cap, const unsigned int* posp, int window, int chunk,       \
        float scale) {                                                                           \
    attn_part<T>(q, kc, vc, part, h, kvh, d, cap, posp, window, chunk, scale);                   \
}                                                                                                \
extern "C" __global__ void gen_attn_merge_##S(const float* part, T* o, int d, int splits) {      \
    attn_merge<T>(part, o, d, splits);                                                           \
}
DECODE_KERNELS(float, f32)
DECODE_KERNELS(bf16_t, bf16)
