// One-token decoding kernels (generate::cuda): attention over the cache split along the keys,
// RoPE and the cache write in it, and the products of one token with a bf16 weight. T is float
// or bf16_t (raw 16-bit storage); math in f32. Compiled after ops/common.cuh (bf16_t, ld, st,
// rnd).
#define NEG_INF __int_as_float(0xff800000)

// Programmatic dependent launch (sm_90+, the program compiled with PDL defined; generate::cuda
// launches these kernels so): a kernel may start while the one ahead of it finishes. Before
// DEP_WAIT it reads only what no kernel writes (the weights; the kernel ahead, and the one
// ahead of that, may still run), after it everything; DEP_LAUNCH, once a block has waited,
// lets the next kernel start as the last blocks of this one run.
#ifdef PDL
#define DEP_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define DEP_LAUNCH() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define DEP_WAIT()
#define DEP_LAUNCH()
#endif

#define MAXC 8  // head dim up to 32 · MAXC = 256
#define KEYS 4  // keys a warp loads before it reduces any: their loads are in flight together

// One token's attention at position pos = *posp (device memory, so that a captured graph
// replays at every position), RoPE and the cache write included: q [H·D], k, v [K·D] are its
// projections before RoPE; cos, sin [cap, D/2] f32 tables; the caches kc, vc [K, cap, D]. Head
// `head` attends to the keys [start, pos] of its kv head kh = head / (H / K), start = pos + 1 −
// window (0: all; scores × scale, then soft-capped at softcap where it is > 0, as Gemma 2),
// split in chunks of `chunk` keys: block (head, split) takes one chunk (the
// grid covers the cache: splits past pos hold no key).
//
// Each block rotates q itself; the block whose chunk holds pos rotates the new k too and folds
// it in from shared memory (the cache row at pos is written by one block, head kh·(H/K) of that
// split, and read by no block of this launch). Each warp takes KEYS keys at a time (every nw-th
// group), loads their k and v rows at once, then folds them in (online softmax); one key after
// another, each a round trip to memory, made the kernel latency-bound. The warps are merged
// into the block's part[(head · S + split) · (D + 2)] = acc[D], max m, sum l; the last block of
// a head to finish (`done[head]` counts them, and is left 0 again) merges the S parts:
// o[head · D + i] = Σ acc · e^(m − M) / Σ l · e^(m − M). q and the new k are rounded to T as
// the cache stores them. pos ≥ cap (the caller reserves the cache first) gives zeros. Blocks of
// 128 threads.
// A score soft-capped as Gemma 2's attention does: cap · tanh(s / cap) (cap 0: s itself).
__device__ __forceinline__ float capped(float s, float cap) {
    return cap > 0.f ? cap * tanhf(s / cap) : s;
}

template <typename T>
__device__ void attn_step(const T* q, const T* k, const T* v, const float* cos, const float* sin,
                          T* kc, T* vc, float* part, unsigned int* done, T* o, int h, int kvh,
                          int d, long cap, const unsigned int* posp, int window, int chunk,
                          float scale, float softcap) {
    __shared__ float sq[32 * MAXC], sk[32 * MAXC], sv[32 * MAXC];
    __shared__ float sm[4][32 * MAXC + 2];
    __shared__ float smax[4];
    __shared__ bool last;
    const T* none = 0;
    DEP_WAIT();
    DEP_LAUNCH();
    long pos = *posp;
    bool live = pos < cap;
    int end = live ? (int)pos + 1 : 0;
    int start = window > 0 ? max(0, end - window) : 0;
    int head = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    int kh = head / (h / kvh), half = d / 2;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int j0 = start + split * chunk, j1 = min(end, j0 + chunk);
    bool mine = live && j0 <= (int)pos && (int)pos < j1;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float c = live ? cos[pos * half + i] : 1.f, s = live ? sin[pos * half + i] : 0.f;
        long b = (long)head * d;
        float x1 = ld(q, b + i), x2 = ld(q, b + i + half);
        sq[i] = rnd(none, x1 * c - x2 * s);
        sq[i + half] = rnd(none, x2 * c + x1 * s);
        if (mine) {
            long kb = (long)kh * d;
            float y1 = ld(k, kb + i), y2 = ld(k, kb + i + half);
            sk[i] = rnd(none, y1 * c - y2 * s);
            sk[i + half] = rnd(none, y2 * c + y1 * s);
            sv[i] = ld(v, kb + i);
            sv[i + half] = ld(v, kb + i + half);
        }
    }
    __syncthreads();
    if (mine && head == kh * (h / kvh)) {
        long dst = ((long)kh * cap + pos) * d;
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            st(kc, dst + i, sk[i]);
            st(vc, dst + i, sv[i]);
        }
    }
    int jc = mine ? (int)pos : j1;  // keys read from the cache: [j0, jc)
    float m = NEG_INF, l = 0.f, acc[MAXC];
    #pragma unroll
    for (int c = 0; c < MAXC; c++) acc[c] = 0.f;
    const T* kb = kc + (long)kh * cap * d;
    const T* vb = vc + (long)kh * cap * d;
    for (int j = j0 + warp * KEYS; j < jc; j += nw * KEYS) {
        float kv[KEYS][MAXC], vv[KEYS][MAXC], s[KEYS];
        #pragma unroll
        for (int u = 0; u < KEYS; u++) {
            bool in = j + u < jc;
            #pragma unroll
            for (int c = 0; c < MAXC; c++) {
                int i = lane + 32 * c;
                bool ok = in && i < d;
                kv[u][c] = ok ? ld(kb, (long)(j + u) * d + i) : 0.f;
                vv[u][c] = ok ? ld(vb, (long)(j + u) * d + i) : 0.f;
            }
        }
        #pragma unroll
        for (int u = 0; u < KEYS; u++) {
            s[u] = 0.f;
            #pragma unroll
            for (int c = 0; c < MAXC; c++) {
                int i = lane + 32 * c;
                if (i < d) s[u] += sq[i] * kv[u][c];
            }
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            #pragma unroll
            for (int u = 0; u < KEYS; u++) s[u] += __shfl_xor_sync(0xffffffff, s[u], o);
        }
        #pragma unroll
        for (int u = 0; u < KEYS; u++) {
            if (j + u >= jc) break;
            float su = capped(s[u] * scale, softcap);
            float mn = fmaxf(m, su);
            float corr = __expf(m - mn), p = __expf(su - mn);  // m = -inf at first: corr = 0
            l = l * corr + p;
            #pragma unroll
            for (int c = 0; c < MAXC; c++) acc[c] = acc[c] * corr + p * vv[u][c];
            m = mn;
        }
    }
    if (mine && warp == 0) {  // the new key, from shared memory
        float s = 0.f;
        #pragma unroll
        for (int c = 0; c < MAXC; c++) {
            int i = lane + 32 * c;
            if (i < d) s += sq[i] * sk[i];
        }
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        float su = capped(s * scale, softcap), mn = fmaxf(m, su);
        float corr = __expf(m - mn), p = __expf(su - mn);
        l = l * corr + p;
        #pragma unroll
        for (int c = 0; c < MAXC; c++) {
            int i = lane + 32 * c;
            acc[c] = acc[c] * corr + p * (i < d ? sv[i] : 0.f);
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
    // The parts written, made visible to the block that finishes last, which merges them.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&done[head], 1u) == (unsigned int)(splits - 1);
    __syncthreads();
    if (!last) return;
    const float* p = part + (long)head * splits * (d + 2);
    mm = NEG_INF;
    for (int s = threadIdx.x; s < splits; s += blockDim.x)
        mm = fmaxf(mm, __ldcg(p + (long)s * (d + 2) + d));
    for (int o = 16; o > 0; o >>= 1) mm = fmaxf(mm, __shfl_xor_sync(0xffffffff, mm, o));
    if (lane == 0) smax[warp] = mm;
    __syncthreads();
    mm = NEG_INF;
    for (int w = 0; w < nw; w++) mm = fmaxf(mm, smax[w]);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float a = 0.f, ll = 0.f;
        #pragma unroll 4
        for (int s = 0; s < splits; s++) {
            const float* ps = p + (long)s * (d + 2);
            float ms = __ldcg(ps + d);
            float f = ms == NEG_INF ? 0.f : __expf(ms - mm);
            a += __ldcg(ps + i) * f;
            ll += __ldcg(ps + d + 1) * f;
        }
        st(o, (long)head * d + i, ll > 0.f ? a / ll : 0.f);
    }
    if (threadIdx.x == 0) done[head] = 0;
}

// Σ of the 8 products of two rows of 8 bf16 (16 bytes each), in f32, in a fixed order.
__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
    unsigned int aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
    float s = 0.f;
    #pragma unroll
    for (int j = 0; j < 4; j++) {
        s += __uint_as_float(aw[j] << 16) * __uint_as_float(bw[j] << 16);
        s += __uint_as_float(aw[j] & 0xffff0000u) * __uint_as_float(bw[j] & 0xffff0000u);
    }
    return s;
}

// One token's product with a bf16 weight: y[n] = Σ_k x[k] · W[n, k] (+ acc[n]) (+ bias[n]), W
// rows `ldw` apart, k a multiple of 8 and rows 16-byte aligned. `parts` warps per row (1, 2, 4
// or 8: a weight of few rows still fills the multiprocessors), 8 warps a block; each lane reads
// 8 weights (16 bytes) at a time, 4 loads in flight, a warp every parts-th 16 bytes of its row;
// the first 4 are issued before DEP_WAIT, while the kernel ahead (x's writer) finishes. The sum
// is f32 (the parts added in a fixed order), rounded once (after the acc and bias are added, as
// cuBLAS's β = 1 epilogue and a bias add would round twice: within half a bf16 step of theirs).
extern "C" __global__ void gen_gemv_bf16(const bf16_t* x, const bf16_t* w, long ldw,
                                         const bf16_t* acc, const bf16_t* bias, bf16_t* y,
                                         int n, int k, int parts) {
    __shared__ float sp[8];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int row = blockIdx.x * ((blockDim.x >> 5) / parts) + warp / parts, part = warp % parts;
    const uint4* wr = (const uint4*)(w + (long)min(row, n - 1) * ldw);
    const uint4* xv = (const uint4*)x;
    int nv = k >> 3, v0 = lane + 32 * part, step = 32 * parts;
    uint4 pre[4];  // the first loads of W, issued before the kernel ahead has finished
    #pragma unroll
    for (int u = 0; u < 4; u++) {
        int v = v0 + u * step;
        pre[u] = v < nv ? wr[v] : make_uint4(0, 0, 0, 0);
    }
    DEP_WAIT();
    DEP_LAUNCH();
    float s = 0.f;
    if (row < n) {
        #pragma unroll
        for (int u = 0; u < 4; u++) {
            int v = v0 + u * step;
            if (v < nv) s += dot8(pre[u], xv[v]);
        }
        #pragma unroll 4
        for (int v = v0 + 4 * step; v < nv; v += step) s += dot8(wr[v], xv[v]);
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
    }
    if (parts > 1) {
        if (lane == 0) sp[warp] = s;
        __syncthreads();
        if (lane == 0 && part == 0)
            for (int p = 1; p < parts; p++) s += sp[warp + p];
    }
    if (row < n && lane == 0 && part == 0) {
        if (acc) s += ld(acc, row);
        if (bias) s += ld(bias, row);
        st(y, row, s);
    }
}

// gen_gemv_bf16 for a stacked [gate; up] weight W [2I, k], SwiGLU applied: a[r] =
// silu(g)·u with g = x·W[r] (+ acc[r]), u = x·W[I + r] (+ acc[I + r]), rounded as the separate
// ops round them (g, u, then silu(g), then the product). A warp per r, both rows read at once,
// their first 2 loads each before DEP_WAIT.
extern "C" __global__ void gen_gemv_swiglu_bf16(const bf16_t* x, const bf16_t* w, long ldw,
                                                const bf16_t* acc, bf16_t* y, int inter, int k) {
    int lane = threadIdx.x & 31, row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int r = min(row, inter - 1);
    const uint4* wg = (const uint4*)(w + (long)r * ldw);
    const uint4* wu = (const uint4*)(w + (long)(r + inter) * ldw);
    const uint4* xv = (const uint4*)x;
    int nv = k >> 3;
    uint4 pg[2], pu[2];  // the first loads of both rows, before the kernel ahead has finished
    #pragma unroll
    for (int u = 0; u < 2; u++) {
        int v = lane + 32 * u;
        pg[u] = v < nv ? wg[v] : make_uint4(0, 0, 0, 0);
        pu[u] = v < nv ? wu[v] : make_uint4(0, 0, 0, 0);
    }
    DEP_WAIT();
    DEP_LAUNCH();
    if (row >= inter) return;
    float g = 0.f, u = 0.f;
    #pragma unroll
    for (int i = 0; i < 2; i++) {
        int v = lane + 32 * i;
        if (v < nv) {
            uint4 b = xv[v];
            g += dot8(pg[i], b);
            u += dot8(pu[i], b);
        }
    }
    #pragma unroll 2
    for (int v = lane + 64; v < nv; v += 32) {
        uint4 b = xv[v];
        g += dot8(wg[v], b);
        u += dot8(wu[v], b);
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
extern "C" __global__ void gen_attn_step_##S(const T* q, const T* k, const T* v,                 \
        const float* cos, const float* sin, T* kc, T* vc, float* part, unsigned int* done, T* o, \
        int h, int kvh, int d, long cap, const unsigned int* posp, int window, int chunk,       \
        float scale, float softcap) {                                                            \
    attn_step<T>(q, k, v, cos, sin, kc, vc, part, done, o, h, kvh, d, cap, posp, window, chunk,  \
                 scale, softcap);                                                                \
}
DECODE_KERNELS(float, f32)
DECODE_KERNELS(bf16_t, bf16)
