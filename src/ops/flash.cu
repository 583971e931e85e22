// Causal flash attention on tensor cores: bf16 operands, f32 accumulation, mma.sync.m16n8k16
// (sm_80+). After common.cuh (bf16_t) in the one program that NVRTC compiles (ops::cuda).
//
// Three kernels, each one thread block of 4 warps (flash_dkdv at D = 256: 8) per (tile,
// batch·head); tiles stream through shared memory double-buffered (cp.async), fragments come
// out of it by ldmatrix:
//   flash_fwd   64 queries a block, keys in tiles of 64 (32 at D = 256): O and L = log-sum-exp
//               (natural log).
//   flash_dq    64 queries a block, keys in tiles of 32 (16 at D = 256): recomputes P and dP,
//               dQ = scale·dS·K.
//   flash_dkdv  64 keys a block (16 a warp), queries in tiles of 32, over every query head of
//               the kv head (GQA sums inside): dV = Pᵀ·dO, dK = scale·dSᵀ·Q. At D = 256 two
//               warps share 16 keys: one makes P and dV, the other dS and dK.
// Nine T×T×D products in all (FA2 does seven with atomics on dQ; this way has none).
// Up to D = 128 the rows a warp multiplies by every tile (Q, dO) stay in registers as A
// fragments; at D = 256 the D-wide accumulator takes those registers and the rows are read
// from shared memory at each tile instead (FlCfg).
//
// Gemma 2's soft-cap (p.softcap > 0): the softmax takes z = cap·tanh(scale·s / cap) for the raw
// score s = q·k, before the mask; the backward's dS takes the cap's derivative 1 − tanh².
//
// Layout: element (b, h, t, d) of q / k / v / o is at b·s[0] + h·s[1] + t·s[2] + d: heads-major
// [B, H, T, D] and token-major rows [B·T, H·D] are both views. Every stride and base is a
// multiple of 8 elements (16-byte copies into shared memory); D is 64, 96, 128 or 256.
//
// mma fragments (PTX ISA, m16n8k16): lane = 4·g + c. A (16×16, row): a0 = (g, 2c..2c+1),
// a1 = (g+8, 2c..), a2 = (g, 2c+8..), a3 = (g+8, 2c+8..). B (16×8, col): b0 = (k 2c..2c+1, n g),
// b1 = (k 2c+8.., n g). C (16×8): c0,c1 = (g, 2c..2c+1), c2,c3 = (g+8, 2c..). Two C tiles side
// by side are exactly one A tile, so P stays in registers between its two products.

struct FlashP {
    const bf16_t* q; const bf16_t* k; const bf16_t* v;
    bf16_t* o;                 // forward: O out; backward: dO in
    bf16_t* dq; bf16_t* dk; bf16_t* dv;  // backward outputs, in q's / k's / v's strides
    float* lse;                // [B, H, T]: forward out, backward in
    const float* delta;        // [B, H, T] = rowsum(dO ⊙ O), backward in
    const unsigned* seg;       // [B, T] example ids, or null
    const float* rc; const float* rs;  // backward: RoPE's cos, sin [B, T, D/2] f32, or null
    float* dqacc;              // fused backward (flash90.cu): dL/dq's f32 sums, zeroed: [B, H, ⌈T/64⌉]
                               // tiles of 64 × 128 in flash_bwd90's fragment order
    long sq[3]; long sk[3]; long sv[3]; long so[3];
    long sdq[3]; long sdk[3];  // backward: dq's and dk's strides (their layout is the caller's)
    int B, H, KH, T, window;
    float scale;
    float softcap;             // 0: none (of flash90.cu's kernels, the d256 ones take it)
    int tree;                  // seg holds prefix-tree ids, example << 2 | branch (ops::AttnMask)
};

// The mma.sync kernels' tiles at head dim D (flash.rs's launches size shared memory from the
// same numbers).
template<int D>
struct FlCfg {
    static constexpr bool ROWS_IN_REGS = D <= 128;    // Q (and dO) as register fragments
    static constexpr int FWD_BK = D <= 128 ? 64 : 32;  // flash_fwd's key tile
    static constexpr int DQ_BK = D <= 128 ? 32 : 16;   // flash_dq's key tile
};

extern __shared__ __align__(16) unsigned char flash_smem[];

#define FLASH_NEG_INF __int_as_float(0xff800000)
#define FLASH_LOG2E 1.4426950408889634f
#define FLASH_LN2 0.6931471805599453f

__device__ __forceinline__ unsigned fl_pack(float lo, float hi) {
    unsigned r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
__device__ __forceinline__ float fl_exp2(float x) {
    float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
}
__device__ __forceinline__ void fl_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned fl_smem(const void* p) {
    unsigned r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}
// Shared memory is addressed by 32-bit shared-window byte addresses (`unsigned`) throughout:
// tile bases are computed once, per-lane offsets are loop invariants and the unrolled loops'
// offsets are immediates, so a fragment load costs one instruction.
//
// Four 8×8 b16 matrices; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void fl_ldsm(unsigned* r, unsigned a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}
__device__ __forceinline__ void fl_ldsm_t(unsigned* r, unsigned a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}
// The A fragment of rows r..r+15, columns k..k+15 of a shared tile with row stride DP.
__device__ __forceinline__ void fl_afrag(unsigned* a, unsigned s, int DP, int r, int k, int l) {
    fl_ldsm(a, s + 2 * ((r + (l & 7) + ((l >> 3) & 1) * 8) * DP + k + (l >> 4) * 8));
}
// B fragments of rows n..n+7 as the n side (col-major B = this tile's rows), for the two k
// steps k..k+15 and k+16..k+31: b[0], b[1] and b[2], b[3].
__device__ __forceinline__ void fl_bfrag2k(unsigned* b, unsigned s, int DP, int n, int k, int l) {
    fl_ldsm(b, s + 2 * ((n + (l & 7)) * DP + k + (l >> 3) * 8));
}
// B fragments with the tile's rows k..k+15 as the k side and its columns n..n+7, n+8..n+15 as
// the n side: b[0], b[1] for n, b[2], b[3] for n + 8.
__device__ __forceinline__ void fl_bfrag2n(unsigned* b, unsigned s, int DP, int k, int n, int l) {
    fl_ldsm_t(b, s + 2 * ((k + (l & 7) + ((l >> 3) & 1) * 8) * DP + n + (l >> 4) * 8));
}
__device__ __forceinline__ void fl_cp16(unsigned s, const bf16_t* g, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
        :: "r"(s), "l"(g), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void fl_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void fl_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
__device__ __forceinline__ void fl_wait_but1() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
__device__ __forceinline__ float fl_quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float fl_quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1);
    return x + __shfl_xor_sync(0xffffffff, x, 2);
}
__device__ __forceinline__ void fl_a_from_c(unsigned* a, const float* c0, const float* c1) {
    a[0] = fl_pack(c0[0], c0[1]); a[1] = fl_pack(c0[2], c0[3]);
    a[2] = fl_pack(c1[0], c1[1]); a[3] = fl_pack(c1[2], c1[3]);
}

// Starts copying rows [r0, r0 + R) of a [T, D] slab (row stride st) into shared [R][D + 8]
// at s; rows past T are zero-filled. NT threads, each a 16-byte chunk per pass of NT / (D/8)
// rows: the trip count is a constant and the addresses step by constants.
// When D / 8 does not divide NT (D = 96) a pass spans parts of rows: chunk x of the tile is
// row x / C, column x % C, x = thread + NT·pass.
template<int D, int R, int NT = 128>
__device__ __forceinline__ void fl_load(unsigned s, const bf16_t* g, long st, int r0, int T) {
    constexpr int C = D / 8;
    if constexpr (NT % C == 0) {
        constexpr int RS = NT / C;
        static_assert(R % RS == 0, "a tile is whole passes");
        const int r = threadIdx.x / C, c = threadIdx.x % C;
        const bf16_t* src = g + (long)(r0 + r) * st + c * 8;
        const unsigned dst = s + 2 * (r * (D + 8) + c * 8);
#pragma unroll
        for (int i = 0; i < R / RS; ++i) {
            const bool ok = r0 + r + i * RS < T;
            fl_cp16(dst + 2 * i * RS * (D + 8), ok ? src + (long)i * RS * st : g, ok);
        }
    } else {
        static_assert(R * C % NT == 0, "a tile is whole passes");
#pragma unroll
        for (int i = 0; i < R * C / NT; ++i) {
            const int x = threadIdx.x + i * NT, r = x / C, c = x % C;
            const bool ok = r0 + r < T;
            fl_cp16(s + 2 * (r * (D + 8) + c * 8), ok ? g + (long)(r0 + r) * st + c * 8 : g, ok);
        }
    }
}

// Whether query i may see key j: causal, the sliding window (0: none), the same example
// (ids are 0 when there are no segments), or with prefix-tree ids (tree) the key in the
// prefix (branch 0) of the query's example. Branch-free: evaluated for every element of a
// tile on the diagonal.
__device__ __forceinline__ bool fl_ok(int i, int j, int T, int window, int tree, unsigned si,
                                      unsigned sj) {
    return (j <= i) & (i < T) & ((window == 0) | (i - j < window)) &
           ((si == sj) | ((tree != 0) & ((si >> 2) == (sj >> 2)) & ((sj & 3u) == 0u)));
}

// acc [16 × D] += P · tile: P the 16 × R product held as C fragments c[R / 8] (two side by
// side are one A fragment), tile [R][D + 8] in shared memory (rows on P's k side).
template<int D, int R>
__device__ __forceinline__ void fl_acc_ptile(float (*acc)[4], float (*c)[4], unsigned tile, int l) {
#pragma unroll
    for (int j = 0; j < R / 16; ++j) {
        unsigned a[4];
        fl_a_from_c(a, c[2 * j], c[2 * j + 1]);
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            unsigned bb[4];
            fl_bfrag2n(bb, tile, D + 8, j * 16, n * 8, l);
            fl_mma(acc[n], a, bb[0], bb[1]);
            fl_mma(acc[n + 1], a, bb[2], bb[3]);
        }
    }
}

// Stores this warp's 16 × D accumulator tile (rows i0 and i0 + 8 of a [T, D] slab at out, row
// stride st) times `scale`, rotated back by RoPE's angle (−θ, its backward) when rc is given
// (cos and sin rows [T, D/2] of this batch row): column col and its partner col + D/2 are
// acc[n] and acc[n + D/16] of the same thread, so the rotation needs no exchange.
template<int D>
__device__ __forceinline__ void fl_store_rows(bf16_t* out, long st, const float (*acc)[4], int i0,
                                              int T, float scale, const float* rc, const float* rs,
                                              int c) {
    constexpr int DN = D / 8, H2 = D / 2;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = i0 + 8 * r;
        if (i >= T) continue;
        bf16_t* row = out + (long)i * st;
        if (rc) {
            const float* cr = rc + (long)i * H2;
            const float* sr = rs + (long)i * H2;
#pragma unroll
            for (int n = 0; n < DN / 2; ++n) {
                const int col = n * 8 + 2 * c;
                const float2 cv = *(const float2*)(cr + col), sv = *(const float2*)(sr + col);
                const float a0 = acc[n][2 * r] * scale, a1 = acc[n][2 * r + 1] * scale;
                const float b0 = acc[n + DN / 2][2 * r] * scale, b1 = acc[n + DN / 2][2 * r + 1] * scale;
                *(unsigned*)(row + col) = fl_pack(a0 * cv.x + b0 * sv.x, a1 * cv.y + b1 * sv.y);
                *(unsigned*)(row + col + H2) = fl_pack(b0 * cv.x - a0 * sv.x, b1 * cv.y - a1 * sv.y);
            }
        } else {
#pragma unroll
            for (int n = 0; n < DN; ++n) {
                const int col = n * 8 + 2 * c;
                *(unsigned*)(row + col) = fl_pack(acc[n][2 * r] * scale, acc[n][2 * r + 1] * scale);
            }
        }
    }
}

// The example id of token i of row b, 0 without segments (ids past T read the last one; those
// rows are never stored).
__device__ __forceinline__ unsigned fl_seg(const FlashP& p, int b, int i) {
    return p.seg ? p.seg[(long)b * p.T + min(i, p.T - 1)] : 0u;
}

// Starts copying one 4-byte word into shared memory; zero-filled when !ok.
__device__ __forceinline__ void fl_cp4(void* s, const void* g, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
        :: "r"(fl_smem(s)), "l"(g), "r"(ok ? 4 : 0) : "memory");
}

// Starts copying the example ids of key rows [k0, k0 + R) into ids (ids past T read the last
// one, as fl_seg; those keys are masked anyway), or writes zeros without segments.
template<int R>
__device__ __forceinline__ void fl_seg_load(const FlashP& p, unsigned* ids, int b, int k0) {
    if (threadIdx.x < R) {
        if (p.seg) fl_cp4(ids + threadIdx.x, p.seg + (long)b * p.T + min(k0 + (int)threadIdx.x, p.T - 1), true);
        else ids[threadIdx.x] = 0u;
    }
}

// Starts copying key rows [k0, k0 + BK) of this (batch, kv head)'s k and v, and their example
// ids, into buffer `buf` of sK / sV / sSeg (fwd and dQ stream keys the same way).
template<int D, int BK>
__device__ __forceinline__ void fl_prefetch_kv(const FlashP& p, unsigned sK, unsigned sV, unsigned* sSeg,
                                               int b, int kh, int k0, int buf) {
    constexpr int DP = D + 8;
    fl_load<D, BK>(sK + 2 * buf * BK * DP, p.k + b * p.sk[0] + kh * p.sk[1], p.sk[2], k0, p.T);
    fl_load<D, BK>(sV + 2 * buf * BK * DP, p.v + b * p.sv[0] + kh * p.sv[1], p.sv[2], k0, p.T);
    fl_seg_load<BK>(p, sSeg + buf * BK, b, k0);
    fl_commit();
}

// Example ids are non-decreasing along a row (data::batch numbers a row's examples in order,
// padding last), so an example's tokens are one run, bounded by binary search: packed rows of
// short examples visit only the tiles of the examples they hold.
// The first token of the example of token i of row b (prefix trees: of its tree, the first id
// at least example << 2).
__device__ __forceinline__ int fl_doc_start(const FlashP& p, int b, int i) {
    const unsigned* s = p.seg + (long)b * p.T;
    const unsigned v = p.tree ? s[i] & ~3u : s[i];
    int lo = 0, hi = i;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (s[mid] < v) lo = mid + 1; else hi = mid;
    }
    return lo;
}
// One past the last token of the example of token i of row b.
__device__ __forceinline__ int fl_doc_end(const FlashP& p, int b, int i) {
    const unsigned* s = p.seg + (long)b * p.T;
    const unsigned v = s[i];
    int lo = i + 1, hi = p.T;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (s[mid] <= v) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// Prefix trees: one past the last query of row b that can see a key of [k0, kl]: the end of
// kl's example where the tile holds a key of its prefix (branch 0, which every branch of the
// example sees), else the end of kl's branch (the keys of earlier examples end before either).
__device__ __forceinline__ int fl_tree_end(const FlashP& p, int b, int k0, int kl) {
    const unsigned* s = p.seg + (long)b * p.T;
    const unsigned v = s[kl], w = v & ~3u;
    int lo = k0, hi = kl;
    while (lo < hi) {  // the tile's first id of at least w (s[kl] = v >= w)
        const int mid = (lo + hi) >> 1;
        if (s[mid] < w) lo = mid + 1; else hi = mid;
    }
    const unsigned last = s[lo] == w ? (w | 3u) : v;
    lo = kl + 1, hi = p.T;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (s[mid] <= last) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// The first key tile a query tile of row b starting at q0 (< T) can see: the sliding window
// and the first query's example cut the front.
template<int BK>
__device__ __forceinline__ int fl_first_key(const FlashP& p, int b, int q0) {
    int k = p.window > 0 ? max(0, q0 - p.window + 1) : 0;
    if (p.seg) k = max(k, fl_doc_start(p, b, q0));
    return k / BK * BK;
}

// One past the last query of row b that can see a key of the tile [k0, k0 + BK) (k0 < T):
// the window and the last key's example cut the end.
template<int BK>
__device__ __forceinline__ int fl_query_end(const FlashP& p, int b, int k0) {
    int q = p.window > 0 ? min(p.T, k0 + BK - 1 + p.window) : p.T;
    const int kl = min(k0 + BK, p.T) - 1;
    if (p.seg) q = min(q, p.tree ? fl_tree_end(p, b, k0, kl) : fl_doc_end(p, b, kl));
    return q;
}

// Masks this warp's 16 × N tile of scores s (rows i0, i0 + 8 of ids si0, si1; columns j0 +
// col, ids tS[col]) to −∞ where the key is not allowed.
template<int N>
__device__ __forceinline__ void fl_mask(const FlashP& p, float (*s)[4], int i0, unsigned si0, unsigned si1,
                                        int j0, const unsigned* tS, int c) {
#pragma unroll
    for (int n = 0; n < N / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = n * 8 + 2 * c + (e & 1);
            const bool ok = e < 2 ? fl_ok(i0, j0 + col, p.T, p.window, p.tree, si0, tS[col])
                                  : fl_ok(i0 + 8, j0 + col, p.T, p.window, p.tree, si1, tS[col]);
            if (!ok) s[n][e] = FLASH_NEG_INF;
        }
    }
}

// The transposed mask: this warp's 16 × N tile st holds (key, query) elements, rows keys kj0
// and kj0 + 8 (ids sg0, sg1), columns queries q0 + col (ids tS[col]).
template<int N>
__device__ __forceinline__ void fl_mask_t(const FlashP& p, float (*st)[4], int q0, int kj0,
                                          unsigned sg0, unsigned sg1, const unsigned* tS, int c) {
#pragma unroll
    for (int n = 0; n < N / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = n * 8 + 2 * c + (e & 1);
            const bool ok = e < 2 ? fl_ok(q0 + col, kj0, p.T, p.window, p.tree, tS[col], sg0)
                                  : fl_ok(q0 + col, kj0 + 8, p.T, p.window, p.tree, tS[col], sg1);
            if (!ok) st[n][e] = FLASH_NEG_INF;
        }
    }
}

// tanh(x) = 1 − 2 / (e^2x + 1): ±1 where e^2x over- or underflows.
__device__ __forceinline__ float fl_tanh(float x) {
    return 1.f - 2.f / (fl_exp2(x * (2.f * FLASH_LOG2E)) + 1.f);
}

// Soft-caps this warp's 16 × N raw scores s in place, before the mask: s ← (cap / scale)·t,
// t = tanh(scale·s / cap), so that the softmax's scale·s is cap·t.
template<int N>
__device__ __forceinline__ void fl_softcap(float (*s)[4], float scale, float cap) {
    const float in = scale / cap, out = cap / scale;
#pragma unroll
    for (int n = 0; n < N / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = out * fl_tanh(s[n][e] * in);
}

// The cap's derivative 1 − t² from a capped score s = (cap / scale)·t (kt = scale / cap); 0
// where masked (s = −∞).
__device__ __forceinline__ float fl_softcap_d(float s, float kt) {
    const float t = s * kt;
    return 1.f - fminf(t * t, 1.f);
}

// The A fragments of this warp's 16 rows for k steps kk and kk + 1: from registers f when the
// rows stay there (FlCfg::ROWS_IN_REGS), else from the shared tile [16·4][D + 8].
template<int D, bool IN_REGS>
__device__ __forceinline__ void fl_rows2(unsigned* a0, unsigned* a1, const unsigned (*f)[4], unsigned tile,
                                         int warp, int kk, int l) {
    if constexpr (IN_REGS) {
#pragma unroll
        for (int e = 0; e < 4; ++e) { a0[e] = f[kk][e]; a1[e] = f[kk + 1][e]; }
    } else {
        fl_afrag(a0, tile, D + 8, warp * 16, kk * 16, l);
        fl_afrag(a1, tile, D + 8, warp * 16, kk * 16 + 16, l);
    }
}

// The forward's end: this warp's rows qi0 and qi0 + 8 of O = acc / l (the row sums l still
// per thread, summed over the quad here) and L = (m + log2 l)·ln 2.
template<int D>
__device__ __forceinline__ void fl_store_o(const FlashP& p, const float (*acc)[4], int b, int h,
                                           int qi0, float m0, float m1, float l0, float l1, int c) {
    const int T = p.T, qi1 = qi0 + 8;
    const long bh = (long)b * p.H + h;
    l0 = fl_quad_sum(l0);
    l1 = fl_quad_sum(l1);
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    bf16_t* og = p.o + b * p.so[0] + h * p.so[1];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        const int col = n * 8 + 2 * c;
        if (qi0 < T) *(unsigned*)(og + (long)qi0 * p.so[2] + col) = fl_pack(acc[n][0] * inv0, acc[n][1] * inv0);
        if (qi1 < T) *(unsigned*)(og + (long)qi1 * p.so[2] + col) = fl_pack(acc[n][2] * inv1, acc[n][3] * inv1);
    }
    if (c == 0) {
        if (qi0 < T) p.lse[bh * T + qi0] = (m0 + __log2f(l0)) * FLASH_LN2;
        if (qi1 < T) p.lse[bh * T + qi1] = (m1 + __log2f(l1)) * FLASH_LN2;
    }
}

// One tile of the online softmax over this warp's 16 × N scores s (masked: −∞), scale·S in
// log2 units: the running row maxima m move to include the tile, cr = 2^(m_old − m_new)
// rescales what was summed before, the row sums l (per thread, over its columns) take it and
// the tile, and s becomes P = 2^(scale·S − m).
template<int N>
__device__ __forceinline__ void fl_online_softmax(float (*s)[4], float sc, float& m0, float& m1,
                                                  float& l0, float& l1, float& cr0, float& cr1) {
    float mx0 = FLASH_NEG_INF, mx1 = FLASH_NEG_INF;
#pragma unroll
    for (int n = 0; n < N / 8; ++n) {
        mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
        mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
    }
    // scale > 0, so the max of S scales to the max of scale·S.
    const float mn0 = fmaxf(m0, fl_quad_max(mx0) * sc), mn1 = fmaxf(m1, fl_quad_max(mx1) * sc);
    // A row that has seen no key yet keeps m = −∞; 0 stands in so that no −∞ − −∞ appears.
    const float mu0 = mn0 == FLASH_NEG_INF ? 0.f : mn0, mu1 = mn1 == FLASH_NEG_INF ? 0.f : mn1;
    cr0 = fl_exp2(m0 - mu0);
    cr1 = fl_exp2(m1 - mu1);
    m0 = mn0; m1 = mn1;
    float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
    for (int n = 0; n < N / 8; ++n) {
        s[n][0] = fl_exp2(fmaf(s[n][0], sc, -mu0)); s[n][1] = fl_exp2(fmaf(s[n][1], sc, -mu0));
        s[n][2] = fl_exp2(fmaf(s[n][2], sc, -mu1)); s[n][3] = fl_exp2(fmaf(s[n][3], sc, -mu1));
        rs0 += s[n][0] + s[n][1];
        rs1 += s[n][2] + s[n][3];
    }
    l0 = l0 * cr0 + rs0;
    l1 = l1 * cr1 + rs1;
}

template<int D>
__device__ __forceinline__ void flash_fwd(const FlashP& p) {
    constexpr bool QR = FlCfg<D>::ROWS_IN_REGS;
    constexpr int DP = D + 8, BQ = 64, BK = FlCfg<D>::FWD_BK, KS = D / 16, DN = D / 8;
    static_assert(!QR || BK >= BQ, "Q passes through a key buffer");
    const unsigned sK = fl_smem(flash_smem);          // [2][BK][DP], double-buffered
    const unsigned sV = sK + 2 * 2 * BK * DP;         // [2][BK][DP]
    const unsigned sQ = sV + 2 * 2 * BK * DP;         // [BQ][DP] unless QR
    unsigned* sSeg = (unsigned*)(flash_smem + 8 * BK * DP + (QR ? 0 : 2 * BQ * DP));  // [2][BK]
    const int T = p.T, bh = blockIdx.y, b = bh / p.H, h = bh % p.H, kh = h / (p.H / p.KH);
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;  // the longest rows first
    const int warp = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2, c = l & 3;
    const float sc = p.scale * FLASH_LOG2E;
    const int kend = min(T, q0 + BQ), kbeg = fl_first_key<BK>(p, b, q0);
    auto prefetch = [&](int k0, int buf) { fl_prefetch_kv<D, BK>(p, sK, sV, sSeg, b, kh, k0, buf); };

    // Q passes through the second buffer while the first key tile arrives (QR), or stays in
    // its own.
    const unsigned tQ = QR ? sK + 2 * BK * DP : sQ;
    fl_load<D, BQ>(tQ, p.q + b * p.sq[0] + h * p.sq[1], p.sq[2], q0, T);
    fl_commit();
    prefetch(kbeg, 0);
    fl_wait_but1();
    __syncthreads();
    unsigned qf[KS][4];  // this warp's 16 query rows, all of D (QR)
    if constexpr (QR) {
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) fl_afrag(qf[kk], tQ, DP, warp * 16, kk * 16, l);
        __syncthreads();
    }
    const int qi0 = q0 + warp * 16 + g, qi1 = qi0 + 8;
    const unsigned sg0 = fl_seg(p, b, qi0), sg1 = fl_seg(p, b, qi1);
    float acc[DN][4];
#pragma unroll
    for (int n = 0; n < DN; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    // m: the running row max of scale·S in log2 units; l: the running row sum of 2^(… − m).
    float m0 = FLASH_NEG_INF, m1 = FLASH_NEG_INF, l0 = 0.f, l1 = 0.f;
    for (int k0 = kbeg, it = 0; k0 < kend; k0 += BK, ++it) {
        const int buf = it & 1;
        if (k0 + BK < kend) { prefetch(k0 + BK, buf ^ 1); fl_wait_but1(); } else fl_wait_all();
        __syncthreads();
        const unsigned tK = sK + 2 * buf * BK * DP, tV = sV + 2 * buf * BK * DP;
        float s[BK / 8][4];
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KS; kk += 2) {
            unsigned a0[4], a1[4];
            fl_rows2<D, QR>(a0, a1, qf, tQ, warp, kk, l);
#pragma unroll
            for (int n = 0; n < BK / 8; ++n) {
                unsigned bb[4];
                fl_bfrag2k(bb, tK, DP, n * 8, kk * 16, l);
                fl_mma(s[n], a0, bb[0], bb[1]);
                fl_mma(s[n], a1, bb[2], bb[3]);
            }
        }
        if (p.softcap != 0.f) fl_softcap<BK>(s, p.scale, p.softcap);
        // Below the diagonal with no window or segments every key of the tile is allowed.
        if (p.seg || p.window != 0 || k0 + BK - 1 > q0 + warp * 16)
            fl_mask<BK>(p, s, qi0, sg0, sg1, k0, sSeg + buf * BK, c);
        float cr0, cr1;
        fl_online_softmax<BK>(s, sc, m0, m1, l0, l1, cr0, cr1);
#pragma unroll
        for (int n = 0; n < DN; ++n) {
            acc[n][0] *= cr0; acc[n][1] *= cr0; acc[n][2] *= cr1; acc[n][3] *= cr1;
        }
        fl_acc_ptile<D, BK>(acc, s, tV, l);  // O += P V
        __syncthreads();  // this buffer is refilled two tiles on
    }
    fl_store_o<D>(p, acc, b, h, qi0, m0, m1, l0, l1, c);
}

template<int D>
__device__ __forceinline__ void flash_dq(const FlashP& p) {
    constexpr bool QR = FlCfg<D>::ROWS_IN_REGS;
    constexpr int DP = D + 8, BQ = 64, BK = FlCfg<D>::DQ_BK, KS = D / 16, DN = D / 8;
    static_assert(!QR || 2 * BK >= BQ, "Q and dO pass through the key buffers");
    // Unless QR, Q [BQ][DP] and dO [BQ][DP] first, in their own buffers.
    const unsigned sQ = fl_smem(flash_smem), sO = sQ + 2 * BQ * DP;
    const unsigned sK = QR ? sQ : sO + 2 * BQ * DP;   // [2][BK][DP]; Q passes through it first (QR)
    const unsigned sV = sK + 2 * 2 * BK * DP;         // [2][BK][DP]; dO passes through it first (QR)
    unsigned* sSeg = (unsigned*)(flash_smem + 8 * BK * DP + (QR ? 0 : 4 * BQ * DP));  // [2][BK]
    const int T = p.T, bh = blockIdx.y, b = bh / p.H, h = bh % p.H, kh = h / (p.H / p.KH);
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
    const int warp = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2, c = l & 3;
    const float sc = p.scale * FLASH_LOG2E;
    const int kend = min(T, q0 + BQ), kbeg = fl_first_key<BK>(p, b, q0);
    auto prefetch = [&](int k0, int buf) { fl_prefetch_kv<D, BK>(p, sK, sV, sSeg, b, kh, k0, buf); };

    unsigned qf[KS][4], df[KS][4];  // (QR)
    const unsigned tQ = QR ? sK : sQ, tO = QR ? sV : sO;
    fl_load<D, BQ>(tQ, p.q + b * p.sq[0] + h * p.sq[1], p.sq[2], q0, T);
    fl_load<D, BQ>(tO, p.o + b * p.so[0] + h * p.so[1], p.so[2], q0, T);
    fl_commit();
    if constexpr (QR) {
        fl_wait_all();
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            fl_afrag(qf[kk], tQ, DP, warp * 16, kk * 16, l);
            fl_afrag(df[kk], tO, DP, warp * 16, kk * 16, l);
        }
        __syncthreads();
    }
    prefetch(kbeg, 0);
    const int qi0 = q0 + warp * 16 + g, qi1 = qi0 + 8;
    const unsigned sg0 = fl_seg(p, b, qi0), sg1 = fl_seg(p, b, qi1);
    const float L0 = qi0 < T ? p.lse[(long)bh * T + qi0] * FLASH_LOG2E : 0.f;
    const float L1 = qi1 < T ? p.lse[(long)bh * T + qi1] * FLASH_LOG2E : 0.f;
    const float d0 = qi0 < T ? p.delta[(long)bh * T + qi0] : 0.f;
    const float d1 = qi1 < T ? p.delta[(long)bh * T + qi1] : 0.f;
    float acc[DN][4];
#pragma unroll
    for (int n = 0; n < DN; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    for (int k0 = kbeg, it = 0; k0 < kend; k0 += BK, ++it) {
        const int buf = it & 1;
        if (k0 + BK < kend) { prefetch(k0 + BK, buf ^ 1); fl_wait_but1(); } else fl_wait_all();
        __syncthreads();
        const unsigned tK = sK + 2 * buf * BK * DP, tV = sV + 2 * buf * BK * DP;
        float s[BK / 8][4], dp[BK / 8][4];
#pragma unroll
        for (int n = 0; n < BK / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KS; kk += 2) {
            unsigned q0f[4], q1f[4], d0f[4], d1f[4];
            fl_rows2<D, QR>(q0f, q1f, qf, tQ, warp, kk, l);
            fl_rows2<D, QR>(d0f, d1f, df, tO, warp, kk, l);
#pragma unroll
            for (int n = 0; n < BK / 8; ++n) {
                unsigned bk[4], bv[4];
                fl_bfrag2k(bk, tK, DP, n * 8, kk * 16, l);
                fl_bfrag2k(bv, tV, DP, n * 8, kk * 16, l);
                fl_mma(s[n], q0f, bk[0], bk[1]);       // S = Q Kᵀ
                fl_mma(s[n], q1f, bk[2], bk[3]);
                fl_mma(dp[n], d0f, bv[0], bv[1]);      // dP = dO Vᵀ
                fl_mma(dp[n], d1f, bv[2], bv[3]);
            }
        }
        if (p.softcap != 0.f) fl_softcap<BK>(s, p.scale, p.softcap);
        if (p.seg || p.window != 0 || k0 + BK - 1 > q0 + warp * 16)
            fl_mask<BK>(p, s, qi0, sg0, sg1, k0, sSeg + buf * BK, c);
        // dS = P ⊙ (dP − δ), P = exp(scale·S − L): 0 where masked (S = −∞); with the cap,
        // times its derivative.
        if (p.softcap != 0.f) {
            const float kt = p.scale / p.softcap;
#pragma unroll
            for (int n = 0; n < BK / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float L = e < 2 ? L0 : L1, dl = e < 2 ? d0 : d1;
                    s[n][e] = fl_exp2(fmaf(s[n][e], sc, -L)) * (dp[n][e] - dl) * fl_softcap_d(s[n][e], kt);
                }
        } else {
#pragma unroll
            for (int n = 0; n < BK / 8; ++n) {
                s[n][0] = fl_exp2(fmaf(s[n][0], sc, -L0)) * (dp[n][0] - d0);
                s[n][1] = fl_exp2(fmaf(s[n][1], sc, -L0)) * (dp[n][1] - d0);
                s[n][2] = fl_exp2(fmaf(s[n][2], sc, -L1)) * (dp[n][2] - d1);
                s[n][3] = fl_exp2(fmaf(s[n][3], sc, -L1)) * (dp[n][3] - d1);
            }
        }
        fl_acc_ptile<D, BK>(acc, s, tK, l);  // dQ += dS K
        __syncthreads();
    }
    const long rope = (long)b * T * (D / 2);
    fl_store_rows<D>(p.dq + b * p.sdq[0] + h * p.sdq[1], p.sdq[2], acc, qi0, T, p.scale,
                     p.rc ? p.rc + rope : nullptr, p.rs ? p.rs + rope : nullptr, c);
}

// The pair exchange of flash_dkdv at D = 256: 16 floats a lane ([NF][32 lanes], conflict-free),
// written by one warp of a pair and read by the same lane of the other, whose fragments have
// the same layout (fl_got).
template<int N>
__device__ __forceinline__ void fl_put(float* x, const float (*v)[4], int l) {
#pragma unroll
    for (int n = 0; n < N / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) x[(n * 4 + e) * 32 + l] = v[n][e];
}
__device__ __forceinline__ float fl_got(const float* x, int n, int e, int l) {
    return x[(n * 4 + e) * 32 + l];
}
// Named barrier `id` (1..4) of the two warps of a pair.
__device__ __forceinline__ void fl_pair_sync(int id) {
    asm volatile("bar.sync %0, 64;" :: "r"(id) : "memory");
}

// dK and dV of 64 keys a block, queries streamed in tiles of 32 over every query head of the
// kv head (GQA sums inside): dV = Pᵀ·dO, dK = scale·dSᵀ·Q.
// Up to D = 128 (4 warps): warp w owns keys k0 + 16w.. and both gradients.
// At D = 256 (PAIR, 8 warps): the 16 keys' full dK and dV rows would take 256 accumulator
// registers a thread, so warps w and w + 4 share keys k0 + 16w..: w makes Sᵀ = K·Qᵀ and P and
// accumulates dV, w + 4 makes dPᵀ = V·dOᵀ, takes P through shared memory, makes dS and
// accumulates dK. Every product is made once, and the first warp goes on to dV while the
// second makes dS.
template<int D>
__device__ __forceinline__ void flash_dkdv(const FlashP& p) {
    constexpr bool PAIR = D > 128;
    constexpr int NT = PAIR ? 256 : 128;
    constexpr int DP = D + 8, BK = 64, BQ = 32, KS = D / 16, DN = D / 8, NF = BQ / 8 * 4;
    const unsigned sK = fl_smem(flash_smem);  // [BK][DP]
    const unsigned sV = sK + 2 * BK * DP;     // [BK][DP]
    const unsigned sQ = sV + 2 * BK * DP;     // [2][BQ][DP]
    const unsigned sO = sQ + 2 * 2 * BQ * DP; // [2][BQ][DP] (dO)
    float* sL = (float*)(flash_smem + 2 * (2 * BK + 4 * BQ) * DP);  // [2][BQ] L
    float* sD = sL + 2 * BQ;                    // [2][BQ] δ
    unsigned* sSeg = (unsigned*)(sD + 2 * BQ);  // [2][BQ]
    // PAIR: a pair's P and P times the cap's derivative (soft-capped only), [4][NF][32].
    float* xP = (float*)(sSeg + 2 * BQ);
    float* xF = xP + 4 * NF * 32;
    const int T = p.T, b = blockIdx.y / p.KH, kh = blockIdx.y % p.KH, grp = p.H / p.KH;
    const int k0 = blockIdx.x * BK;
    const int warp = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2, c = l & 3;
    const int kw = warp & 3;                  // this warp's 16 keys: k0 + 16·kw..
    const bool first = !PAIR || warp < 4;     // makes Sᵀ (and, alone, dPᵀ too)
    const int xo = kw * NF * 32;              // this pair's exchange slots
    const float sc = p.scale * FLASH_LOG2E, kt = p.softcap != 0.f ? p.scale / p.softcap : 0.f;
    const int qend = fl_query_end<BK>(p, b, k0);
    const int nq = (qend - k0 + BQ - 1) / BQ, iters = grp * nq;  // (query head, query tile) pairs
    auto prefetch = [&](int it, int buf) {
        const int h = kh * grp + it / nq, q0 = k0 + (it % nq) * BQ;
        fl_load<D, BQ, NT>(sQ + 2 * buf * BQ * DP, p.q + b * p.sq[0] + h * p.sq[1], p.sq[2], q0, T);
        fl_load<D, BQ, NT>(sO + 2 * buf * BQ * DP, p.o + b * p.so[0] + h * p.so[1], p.so[2], q0, T);
        // L, δ and the example ids travel with the tiles (a plain load here would hold these
        // threads, and at the next barrier every warp, for a memory round trip a tile): 0
        // past T, where the mask rules every query out.
        if (threadIdx.x < BQ) {
            const long row = ((long)b * p.H + h) * T;
            const int i = q0 + threadIdx.x;
            const bool ok = i < T;
            fl_cp4(sL + buf * BQ + threadIdx.x, ok ? p.lse + row + i : p.lse, ok);
            fl_cp4(sD + buf * BQ + threadIdx.x, ok ? p.delta + row + i : p.delta, ok);
        }
        fl_seg_load<BQ>(p, sSeg + buf * BQ, b, q0);
        fl_commit();
    };
    fl_load<D, BK, NT>(sK, p.k + b * p.sk[0] + kh * p.sk[1], p.sk[2], k0, T);
    fl_load<D, BK, NT>(sV, p.v + b * p.sv[0] + kh * p.sv[1], p.sv[2], k0, T);
    fl_commit();
    if (iters > 0) prefetch(0, 0);
    const int kj0 = k0 + kw * 16 + g;
    const unsigned sg0 = fl_seg(p, b, kj0), sg1 = fl_seg(p, b, kj0 + 8);
    // PAIR: `acc` is this warp's one gradient (dV for the first warp, dK for the second);
    // else acc is dV and dk dK.
    float acc[DN][4], dk[PAIR ? 1 : DN][4];
#pragma unroll
    for (int n = 0; n < DN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
#pragma unroll
    for (int n = 0; n < (PAIR ? 1 : DN); ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[n][e] = 0.f;
    for (int it = 0; it < iters; ++it) {
        const int buf = it & 1, q0 = k0 + (it % nq) * BQ;
        if (it + 1 < iters) { prefetch(it + 1, buf ^ 1); fl_wait_but1(); } else fl_wait_all();
        __syncthreads();
        const unsigned tQ = sQ + 2 * buf * BQ * DP, tO = sO + 2 * buf * BQ * DP;
        const float* tL = sL + buf * BQ;
        const float* tD = sD + buf * BQ;
        const unsigned* tS = sSeg + buf * BQ;
        // Sᵀ = K Qᵀ (st) and dPᵀ = V dOᵀ (dpt): rows this warp's 16 keys, columns BQ queries.
        // PAIR: the first warp makes st from (K, Q), the second dpt, as its st, from (V, dO).
        float st[BQ / 8][4], dpt[BQ / 8][4];
#pragma unroll
        for (int n = 0; n < BQ / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.f;
        const unsigned tA = first ? sK : sV, tB = first ? tQ : tO;
#pragma unroll
        for (int kk = 0; kk < KS; kk += 2) {
            unsigned ak0[4], ak1[4], av0[4], av1[4];
            fl_afrag(ak0, tA, DP, kw * 16, kk * 16, l);
            fl_afrag(ak1, tA, DP, kw * 16, kk * 16 + 16, l);
            if constexpr (!PAIR) {
                fl_afrag(av0, sV, DP, kw * 16, kk * 16, l);
                fl_afrag(av1, sV, DP, kw * 16, kk * 16 + 16, l);
            }
#pragma unroll
            for (int n = 0; n < BQ / 8; ++n) {
                unsigned bq[4], bo[4];
                fl_bfrag2k(bq, tB, DP, n * 8, kk * 16, l);
                fl_mma(st[n], ak0, bq[0], bq[1]);
                fl_mma(st[n], ak1, bq[2], bq[3]);
                if constexpr (!PAIR) {
                    fl_bfrag2k(bo, tO, DP, n * 8, kk * 16, l);
                    fl_mma(dpt[n], av0, bo[0], bo[1]);
                    fl_mma(dpt[n], av1, bo[2], bo[3]);
                }
            }
        }
        if (first) {
            // Every query of the tile at or past this warp's last key, all inside T, and no
            // window or segments: nothing is masked.
            if (p.softcap != 0.f) fl_softcap<BQ>(st, p.scale, p.softcap);
            if (p.seg || p.window != 0 || q0 < k0 + kw * 16 + 15 || q0 + BQ > T)
                fl_mask_t<BQ>(p, st, q0, kj0, sg0, sg1, tS, c);
            // P = exp(scale·S − L) (0 where masked), dS = P ⊙ (dP − δ), with the cap times its
            // derivative (PAIR: the second warp makes dS from P and that factor).
#pragma unroll
            for (int n = 0; n < BQ / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = n * 8 + 2 * c + (e & 1);
                    const float pr = fl_exp2(fmaf(st[n][e], sc, -tL[col] * FLASH_LOG2E));
                    const float f = p.softcap != 0.f ? pr * fl_softcap_d(st[n][e], kt) : pr;
                    st[n][e] = pr;
                    if constexpr (PAIR) {
                        if (p.softcap != 0.f) xF[xo + (n * 4 + e) * 32 + l] = f;
                    } else {
                        dpt[n][e] = f * (dpt[n][e] - tD[col]);
                    }
                }
            }
            if constexpr (PAIR) {
                fl_put<BQ>(xP + xo, st, l);
                fl_pair_sync(1 + kw);
            }
        } else {
            // The second warp's product is dPᵀ: P comes from the first, dS is made here.
#pragma unroll
            for (int n = 0; n < BQ / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) dpt[n][e] = st[n][e];
            fl_pair_sync(1 + kw);
#pragma unroll
            for (int n = 0; n < BQ / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = n * 8 + 2 * c + (e & 1);
                    const float f = fl_got(p.softcap != 0.f ? xF + xo : xP + xo, n, e, l);
                    dpt[n][e] = f * (dpt[n][e] - tD[col]);
                }
            }
        }
        if constexpr (PAIR) {
            // dV += Pᵀ dO (first) or dK += dSᵀ Q (second)
            float pa[BQ / 8][4];
#pragma unroll
            for (int n = 0; n < BQ / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) pa[n][e] = first ? st[n][e] : dpt[n][e];
            fl_acc_ptile<D, BQ>(acc, pa, first ? tO : tQ, l);
        } else {
            fl_acc_ptile<D, BQ>(acc, st, tO, l);  // dV += Pᵀ dO
            fl_acc_ptile<D, BQ>(dk, dpt, tQ, l);  // dK += dSᵀ Q
        }
        __syncthreads();
    }
    fl_wait_all();
    const long rope = (long)b * T * (D / 2);
    const float* rc = p.rc ? p.rc + rope : nullptr;
    const float* rs = p.rs ? p.rs + rope : nullptr;
    bf16_t* dko = p.dk + b * p.sdk[0] + kh * p.sdk[1];
    bf16_t* dvo = p.dv + b * p.sv[0] + kh * p.sv[1];
    if constexpr (PAIR) {
        if (first) fl_store_rows<D>(dvo, p.sv[2], acc, kj0, T, 1.f, nullptr, nullptr, c);
        else fl_store_rows<D>(dko, p.sdk[2], acc, kj0, T, p.scale, rc, rs, c);
    } else {
        fl_store_rows<D>(dko, p.sdk[2], dk, kj0, T, p.scale, rc, rs, c);
        fl_store_rows<D>(dvo, p.sv[2], acc, kj0, T, 1.f, nullptr, nullptr, c);
    }
}

#define FLASH_INST(D) \
extern "C" __global__ void __launch_bounds__(128) flash_fwd_d##D(const FlashP p) { flash_fwd<D>(p); } \
extern "C" __global__ void __launch_bounds__(128) flash_dq_d##D(const FlashP p) { flash_dq<D>(p); } \
extern "C" __global__ void __launch_bounds__(D > 128 ? 256 : 128) flash_dkdv_d##D(const FlashP p) { \
    flash_dkdv<D>(p); \
}
// flash90.cu's program takes this file for its helpers only (FLASH_HELPERS_ONLY): these
// kernels come from the portable program, so sm_90a need not compile and load them again.
#ifndef FLASH_HELPERS_ONLY
FLASH_INST(64)
FLASH_INST(96)
FLASH_INST(128)
FLASH_INST(256)
#endif
