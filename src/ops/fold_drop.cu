// The adapters' products under LoRA dropout, the masks drawn in registers (ops::fold_drop).
// After dropout.cu (dr_group, dr_tr4, DropKey), flash.cu (fl_mma, fl_pack) and fold_bwd.cu
// (sl_ld, sl_trans) in the one program (ops::cuda).
//
// For the n (<= 3) linears j that share an input x [m, in], each of rank r (a multiple of 8)
// and its own mask m_j, with xd_j = m_j ⊙ x = round(x · 1/(1 − p)) where kept, else 0:
//   drop_xas  part[k] = xd_j A_jᵀ over column chunk k            (then drop_xas_sum: s · Σ_k)
//   drop_bwd  dx += s · (gB_j A_j) ⊙ m_j in place; part = s · gB_jᵀ xd_j over 256 tokens
//                                                               (then sum_parts_f32)
// Both read x once (and dx once, updated in place) as the GEMMs they stand for without dropout
// do; xd is never stored. Each warp's mask words come from one Philox call a lane: its four
// lanes that share 8 columns (one group) draw the four groups they need and swap words
// (dr_tr4), so every 16 bits drawn are used once.

struct DropXasP {
    const bf16_t* x;   // [m, in], rows ldx apart
    const bf16_t* a;   // [n·r, in]: the linears' A's stacked
    float* part;       // [KS, m, n·r]: xd_j A_jᵀ over each chunk of kc columns
    long ldx;
    int m, in, r, nr, kc;
    DropKey d[3];
};

// xd of a bf16 pair (a word of x, its low element first) under the mask word w.
__device__ __forceinline__ unsigned dr_pair(const DropKey& d, unsigned x, unsigned w) {
    return fl_pack(dr_keep_lo(d, w) ? bf_lo(x) * d.scale : 0.f,
                   dr_keep_hi(d, w) ? bf_hi(x) * d.scale : 0.f);
}

// Block: 4 warps, 16 tokens each (64 tokens), over the columns of chunk blockIdx.y for linear
// blockIdx.x (the linears of one chunk run side by side: x's tile is read from L2 by the
// later ones). A warp's k step is the mma m16n8k16 with M = tokens, K = 16 columns, N = 8
// ranks a tile: its A fragment (rows g, g + 8; columns 2c, 2c + 1 and 8 + 2c, 8 + 2c + 1) are
// four 32-bit loads of x; lane c of each quad draws group (row g + 8 (c & 1), column block
// 2k' + (c >> 1)) and after dr_tr4 holds word c of all four: its own columns' bits.
template<int NT>  // r <= 8 NT
__device__ __forceinline__ void drop_xas(const DropXasP& p) {
    const int j = blockIdx.x, ks = blockIdx.y;
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, g8 = l >> 2, c4 = l & 3;
    const int t0 = blockIdx.z * 64 + 16 * w;
    const DropKey d = j == 0 ? p.d[0] : j == 1 ? p.d[1] : p.d[2];  // (static indices: no local copy)
    const bf16_t* a = p.a + (long)j * p.r * p.in;
    const int k_beg = ks * p.kc, k_end = min(p.in, k_beg + p.kc);
    const int rA = t0 + g8, rB = rA + 8, rD = t0 + g8 + 8 * (c4 & 1);
    const unsigned long long cpr = (unsigned)p.in / 8;  // groups a row
    float acc[NT][4];
#pragma unroll
    for (int q = 0; q < NT; ++q) acc[q][0] = acc[q][1] = acc[q][2] = acc[q][3] = 0.f;
    for (int k = k_beg; k < k_end; k += 16) {
        const int c0 = k + 2 * c4, c1 = c0 + 8;
        const bool ok0 = c0 < p.in, ok1 = c1 < p.in;
        unsigned xa[4] = {sl_ld(p.x, (long)rA * p.ldx + c0, rA < p.m && ok0),
                          sl_ld(p.x, (long)rB * p.ldx + c0, rB < p.m && ok0),
                          sl_ld(p.x, (long)rA * p.ldx + c1, rA < p.m && ok1),
                          sl_ld(p.x, (long)rB * p.ldx + c1, rB < p.m && ok1)};
        unsigned wd[4];
        dr_group(d, (unsigned long long)rD * cpr + (unsigned)(k / 8 + (c4 >> 1)), wd);
        dr_tr4(wd, c4, 1);
        unsigned xd[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) xd[e] = dr_pair(d, xa[e], wd[e]);
#pragma unroll
        for (int q = 0; q < NT; ++q) {
            const int rk = 8 * q + g8;  // B = A_jᵀ: (k = column, n = rank)
            const unsigned b0 = sl_ld(a, (long)rk * p.in + c0, rk < p.r && ok0);
            const unsigned b1 = sl_ld(a, (long)rk * p.in + c1, rk < p.r && ok1);
            fl_mma(acc[q], xd, b0, b1);
        }
    }
    // C: (token rA, ranks 8q + 2c, + 1) = acc[q][0, 1]; (token rB, same) = acc[q][2, 3]
    float* out = p.part + (long)ks * p.m * p.nr + j * p.r;
#pragma unroll
    for (int q = 0; q < NT; ++q) {
        const int rk = 8 * q + 2 * c4;
        if (rk >= p.r) continue;
        if (rA < p.m) *(float2*)(out + (long)rA * p.nr + rk) = make_float2(acc[q][0], acc[q][1]);
        if (rB < p.m) *(float2*)(out + (long)rB * p.nr + rk) = make_float2(acc[q][2], acc[q][3]);
    }
}
extern "C" __global__ void __launch_bounds__(128) drop_xas_n1(const DropXasP p) { drop_xas<1>(p); }
extern "C" __global__ void __launch_bounds__(128) drop_xas_n2(const DropXasP p) { drop_xas<2>(p); }
extern "C" __global__ void __launch_bounds__(128) drop_xas_n4(const DropXasP p) { drop_xas<4>(p); }
extern "C" __global__ void __launch_bounds__(128) drop_xas_n8(const DropXasP p) { drop_xas<8>(p); }

// out[t, q] = s · Σ_k part[k][t][q] (k in order, rounded once to bf16; rows ldo apart).
extern "C" __global__ void drop_xas_sum(const float* part, bf16_t* out, int P, int m, int nr,
                                        long ldo, float s) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const long n = (long)m * nr;
    if (i >= n) return;
    float acc = 0.f;
    for (int k = 0; k < P; ++k) acc += part[(long)k * n + i];
    st(out, (i / nr) * ldo + i % nr, s * acc);
}

struct DropBwdP {
    const bf16_t* x;   // [m, in], rows ldx apart: the linears' input
    bf16_t* dx;        // [m, in], rows ldd apart: dL/dx, the adapters' terms added in place
    const bf16_t* gb;  // [m, n·r], rows ldg apart: g_j B_j at columns j·r .. j·r + r − 1
    const bf16_t* a;   // [n·r, in]
    float* part;       // [P, n·r, in]: s · gB_jᵀ xd_j over each block's 256 tokens
    long ldx, ldd, ldg;
    int m, in, r, n;
    float s;           // the scale (1 where gb carries it already)
    DropKey d[3];
};

// swiglu_lora's layout (fold_bwd.cu): a block is 8 warps over 64 columns × 256 tokens, a warp
// 16 columns (the mma's m side: rows g, g + 8 its columns 2g, 2g + 1) × 128 tokens, 16 a step.
// Per linear j, in turn (dx is read and written once per linear; its tile and x's stay in L2):
//   1. loᵀ [16 cols × 16 tokens] = A_jᵀ · gB_jᵀ          (A fragments held, gB's loaded)
//   2. at each point (column pair, token): dx += s · lo where kept; xd = x · scale where kept
//   3. dA_jᵀ [16 cols × r] += xdᵀ · gB_j                  (xd's C tiles as A tiles)
// Masks: a thread's points are columns cw, cw + 1 at tokens t + 2c + h + 8n; the four lanes
// whose columns share a group (g & 3 = 0 .. 3, same c and g >> 2) draw tokens
// t + 8 (i >> 1) + 2c + (i & 1), i = g & 3, and swap words (dr_tr4 over lane bits 4, 8):
// lane i then holds word i, columns cw, cw + 1, of the four points' groups.
template<int RK>  // r <= 16 RK
__device__ __forceinline__ void drop_bwd(const DropBwdP& p) {
    __shared__ float red[4 * 2 * RK * 4 * 32];   // the second token half's dAᵀ
    const int tid = threadIdx.x, w = tid >> 5, l = tid & 31, g8 = l >> 2, c4 = l & 3;
    const int wc = w & 3, half = w >> 2;
    const int cw = blockIdx.x * 64 + 16 * wc + 2 * g8;
    const bool colok = cw < p.in;
    const int tb = blockIdx.y * 256 + half * 128;
    const unsigned long long cpr = (unsigned)p.in / 8;
    const unsigned blk = (unsigned)(blockIdx.x * 64 + 16 * wc + 8 * (g8 >> 2)) / 8;
    const int di = g8 & 3;  // this lane's place among the four that share a group
    for (int j = 0; j < p.n; ++j) {
        const DropKey d = j == 0 ? p.d[0] : j == 1 ? p.d[1] : p.d[2];
        const bf16_t* a = p.a + (long)j * p.r * p.in;
        const bf16_t* gbj = p.gb + j * p.r;
        const float f = p.s * d.scale;
        unsigned af[RK][4];
#pragma unroll
        for (int kk = 0; kk < RK; ++kk) {
            unsigned L[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int rk = 16 * kk + 2 * c4 + (e & 1) + (e >> 1) * 8;
                L[e] = sl_ld(a, (long)rk * p.in + cw, rk < p.r && colok);
            }
            af[kk][0] = __byte_perm(L[0], L[1], 0x5410); af[kk][1] = __byte_perm(L[0], L[1], 0x7632);
            af[kk][2] = __byte_perm(L[2], L[3], 0x5410); af[kk][3] = __byte_perm(L[2], L[3], 0x7632);
        }
        float acc[2 * RK][4];
#pragma unroll
        for (int q = 0; q < 2 * RK; ++q) acc[q][0] = acc[q][1] = acc[q][2] = acc[q][3] = 0.f;

        for (int s0 = 0; s0 < 128 && tb + s0 < p.m; s0 += 16) {
            const int t = tb + s0;
            unsigned gb[RK][4], xv[4], dv[4];
#pragma unroll
            for (int kk = 0; kk < RK; ++kk) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = t + g8 + (e >> 1) * 8, rk = 16 * kk + 2 * c4 + (e & 1) * 8;
                    gb[kk][e] = sl_ld(gbj, (long)row * p.ldg + rk, row < p.m && rk < p.r);
                }
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int tok = t + 2 * c4 + (e & 1) + (e >> 1) * 8;
                const bool ok = tok < p.m && colok;
                xv[e] = sl_ld(p.x, (long)tok * p.ldx + cw, ok);
                dv[e] = sl_ld(p.dx, (long)tok * p.ldd + cw, ok);
            }
            unsigned wd[4];
            {
                const unsigned tok = t + 8 * (di >> 1) + 2 * c4 + (di & 1);
                dr_group(d, (unsigned long long)tok * cpr + blk, wd);
                dr_tr4(wd, di, 4);
            }
            // 1. lo[n]: (column cw / cw + 1, token t + 8n + 2c / + 1) of (gB·A)ᵀ
            float lo[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
            for (int kk = 0; kk < RK; ++kk) {
                fl_mma(lo[0], af[kk], gb[kk][0], gb[kk][1]);
                fl_mma(lo[1], af[kk], gb[kk][2], gb[kk][3]);
            }
            // 2. point e = h + 2n (token t + 8n + 2c + h): dx in place, xd for step 3
            float xd[2][4];  // [n][2k + h]: column cw + k
#pragma unroll
            for (int n = 0; n < 2; ++n) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int e = h + 2 * n, tok = t + 8 * n + 2 * c4 + h;
                    const bool k0 = dr_keep_lo(d, wd[e]), k1 = dr_keep_hi(d, wd[e]);
                    const float d0 = bf_lo(dv[e]) + (k0 ? f * lo[n][h] : 0.f);
                    const float d1 = bf_hi(dv[e]) + (k1 ? f * lo[n][2 + h] : 0.f);
                    xd[n][h] = k0 ? bf_lo(xv[e]) * d.scale : 0.f;
                    xd[n][2 + h] = k1 ? bf_hi(xv[e]) * d.scale : 0.f;
                    if (tok < p.m && colok) *(unsigned*)(p.dx + (long)tok * p.ldd + cw) = bf_pack(d0, d1);
                }
            }
            // 3. dAᵀ += xdᵀ · gB over the step's 16 tokens (xd rounded to bf16: the forward's)
            const unsigned at[4] = {fl_pack(xd[0][0], xd[0][1]), fl_pack(xd[0][2], xd[0][3]),
                                    fl_pack(xd[1][0], xd[1][1]), fl_pack(xd[1][2], xd[1][3])};
#pragma unroll
            for (int q2 = 0; q2 < RK; ++q2) {
                fl_mma(acc[2 * q2], at, sl_trans(gb[q2][0]), sl_trans(gb[q2][2]));
                fl_mma(acc[2 * q2 + 1], at, sl_trans(gb[q2][1]), sl_trans(gb[q2][3]));
            }
        }
        // The token halves' dAᵀ meet in shared memory.
        if (half) {
#pragma unroll
            for (int q = 0; q < 2 * RK; ++q)
#pragma unroll
                for (int e = 0; e < 4; ++e) red[((wc * 2 * RK + q) * 4 + e) * 32 + l] = acc[q][e];
        }
        __syncthreads();
        if (!half) {
            // dAᵀ's C points: (column cw, rank 8q + 2c + h) = acc[q][h], (cw + 1, same) = acc[q][2 + h]
            float* dst = p.part + ((long)blockIdx.y * p.n + j) * p.r * p.in;
#pragma unroll
            for (int q = 0; q < 2 * RK; ++q) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int rk = 8 * q + 2 * c4 + h;
                    const float v0 = acc[q][h] + red[((wc * 2 * RK + q) * 4 + h) * 32 + l];
                    const float v1 = acc[q][2 + h] + red[((wc * 2 * RK + q) * 4 + 2 + h) * 32 + l];
                    if (rk < p.r && colok)
                        *(float2*)(dst + (long)rk * p.in + cw) = make_float2(p.s * v0, p.s * v1);
                }
            }
        }
        __syncthreads();  // red is the next linear's
    }
}
extern "C" __global__ void __launch_bounds__(256, 3) drop_bwd_r16(const DropBwdP p) { drop_bwd<1>(p); }
extern "C" __global__ void __launch_bounds__(256, 3) drop_bwd_r32(const DropBwdP p) { drop_bwd<2>(p); }
extern "C" __global__ void __launch_bounds__(256, 2) drop_bwd_r64(const DropBwdP p) { drop_bwd<4>(p); }
