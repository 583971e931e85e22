// down_proj's folded backward (ops::fold): SwiGLU's (or GeGLU's: GELU) backward with down's
// adapter terms in one pass. After flash.cu (its fl_mma and fl_pack), glu.cu (gelu_t) and
// common.cuh (bf_lo, bf_pack, rbf) in the one program (ops::cuda).
//
// Folded, down's dL/da GEMM runs against W* = [W | B-slots]: dap = dy · W* [m, ld] holds the
// base term dy·W in its first I columns and gB = dy·B [m, r] at column gb_off. This kernel
// takes them with gate g, up u [m, I] and down's A [r, I] (bf16), and writes
//   da  = dy·W + s·gB·A                 (f32, never stored: the adapter's term of dL/da)
//   dg, du = SwiGLU's backward at da    (out [2, m, I]: dg then du, swiglu_bwd_keep_v8's math)
//   dA_part[y] = s·gBᵀ·a over its tokens (part [P, r, I] f32; sum_parts adds the P up)
// where a = round(round(silu(g))·u) is down's input, recomputed and never stored. σ(g) is one
// MUFU reciprocal (~1 ulp of f32, where the forward divides): silu(g) rounded to bf16 may then
// differ from the forward's by a bf16 step in the rare value at a rounding tie. Two f32
// divisions an element would make this pass issue-bound.
// Unfused, the same took a skinny GEMM for s·gB, one for s·gB·A [m, I] (written, then read
// back by the base GEMM's β = 1 epilogue), SwiGLU's pass writing a [m, I] and a GEMM reading
// a for dA: four [m, I] passes gone.
//
// No shared memory and no barrier but one at the end: a warp takes 16 columns and 128 tokens,
// 16 tokens a step, two steps' loads issued together. Both adapter products run on tensor
// cores with the columns as the mma's m side, the warp's m-rows g and g + 8 being the adjacent
// columns 2g, 2g + 1: a thread's points (column pair, token) are then 32-bit pairs, which it
// loads and stores itself (a warp's access: 4 rows of 32 whole bytes).
//   1. loraᵀ [16 cols × 16 tokens] = Aᵀ [cols × r] · gBᵀ [r × tokens]   (A fragments held; gB's
//      B fragments loaded from dap as they lie)
//   2. SwiGLU's backward at each C point; dg, du stored, a kept in registers
//   3. dAᵀ [16 cols × r] += aᵀ [cols × tokens] · gB [tokens × r]       (a's C tiles are A tiles;
//      gB's B fragments are step 1's, transposed by movmatrix)
// A block is 8 warps: 64 columns × 256 tokens; its two token halves add their dAᵀ at the end.

struct GluLoraP {
    const bf16_t* g; const bf16_t* u;  // [m, I]
    const bf16_t* dap;                 // [m, ld]: dy·W in columns [0, I), gB at gb_off
    const bf16_t* a;                   // down's A [r, I]
    bf16_t* out;                       // [2, m, I]: dg, du
    float* part;                       // [⌈m / 256⌉, r, I]: s·gBᵀ·a over each block's tokens
    long ld;
    int m, I, gb_off, gb_n, r;         // gb_n: pad columns readable from gb_off (zeros past r)
    float s;
    DropKey d;                         // down's dropout (the DROP kernels; dropout.cu)
};

__device__ __forceinline__ unsigned sl_ld(const bf16_t* p, long i, bool ok) {
    return ok ? *(const unsigned*)(p + i) : 0u;
}
// The 8×8 b16 matrix of a fragment (lane l: row l / 4, columns 2(l % 4), + 1) transposed.
__device__ __forceinline__ unsigned sl_trans(unsigned a) {
    unsigned d; asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a)); return d;
}

// 1 / x to ~1 ulp (MUFU.RCP): x = 1 + e^−g ≥ 1, and every use is rounded to bf16 after.
__device__ __forceinline__ float sl_rcp(float x) {
    float y; asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
}

// DROP: down's adapter input is m ⊙ a (LoRA dropout): its term of da is s·(gB·A)⊙m and dA sums
// s·gBᵀ·(m ⊙ a); the mask words are drawn as drop_bwd draws them (fold_drop.cu).
// GELU: the gate is GeGLU's (Gemma), a = round(gelu_tanh(g))·u with geglu_bwd_keep's math.
template<int RK, int ST, bool DROP, bool GELU>  // r ≤ 16·RK: ranks padded to whole k steps with zeros; ST steps a loop
__device__ __forceinline__ void glu_lora(const GluLoraP& p) {
    __shared__ float red[4 * 2 * RK * 4 * 32];   // the second token half's dAᵀ
    const int tid = threadIdx.x, w = tid >> 5, l = tid & 31, g8 = l >> 2, c4 = l & 3;
    const int wc = w & 3, half = w >> 2;
    const int cw = blockIdx.x * 64 + 16 * wc + 2 * g8;  // this thread's columns cw, cw + 1
    const bool colok = cw < p.I;
    const int tb = blockIdx.y * 256 + half * 128;       // the warp's tokens tb .. tb + 127
    const long mI = (long)p.m * p.I;
    const unsigned long long cpr = (unsigned)p.I / 8;   // mask groups a row (DROP)
    const unsigned blk = (unsigned)(blockIdx.x * 64 + 16 * wc + 8 * (g8 >> 2)) / 8;
    const int di = g8 & 3;
    const float f = DROP ? p.s * p.d.scale : p.s;

    // Aᵀ's fragments (m = columns as above, k = ranks): A[rank][cw..cw+1] is one 32-bit load;
    // its low half is column cw's (m-row g), its high half cw + 1's (m-row g + 8).
    unsigned af[RK][4];
#pragma unroll
    for (int kk = 0; kk < RK; ++kk) {
        unsigned L[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int rk = 16 * kk + 2 * c4 + (e & 1) + (e >> 1) * 8;
            L[e] = sl_ld(p.a, (long)rk * p.I + cw, rk < p.r && colok);
        }
        af[kk][0] = __byte_perm(L[0], L[1], 0x5410); af[kk][1] = __byte_perm(L[0], L[1], 0x7632);
        af[kk][2] = __byte_perm(L[2], L[3], 0x5410); af[kk][3] = __byte_perm(L[2], L[3], 0x7632);
    }
    float acc[2 * RK][4];  // dAᵀ: n-tile q is ranks 8q .. 8q + 7
#pragma unroll
    for (int q = 0; q < 2 * RK; ++q) acc[q][0] = acc[q][1] = acc[q][2] = acc[q][3] = 0.f;

    for (int s0 = 0; s0 < 128 && tb + s0 < p.m; s0 += 16 * ST) {
        // The steps' loads first. gB: rows t + g, t + 8 + g, ranks 16kk + 2c.. and + 8 + 2c..
        // (step 1's B fragments); g, u, dy·W at tokens t + 2c + h + 8n, columns cw, cw + 1.
        unsigned gb[ST][RK][4], gv[ST][4], uv[ST][4], dv[ST][4];
#pragma unroll
        for (int st = 0; st < ST; ++st) {
            const int t = tb + s0 + 16 * st;
#pragma unroll
            for (int kk = 0; kk < RK; ++kk) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = t + g8 + (e >> 1) * 8, rk = 16 * kk + 2 * c4 + (e & 1) * 8;
                    gb[st][kk][e] = sl_ld(p.dap, (long)row * p.ld + p.gb_off + rk,
                                          row < p.m && rk + 2 <= p.gb_n);
                }
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int tok = t + 2 * c4 + (e & 1) + (e >> 1) * 8;
                const bool ok = tok < p.m && colok;
                gv[st][e] = sl_ld(p.g, (long)tok * p.I + cw, ok);
                uv[st][e] = sl_ld(p.u, (long)tok * p.I + cw, ok);
                dv[st][e] = sl_ld(p.dap, (long)tok * p.ld + cw, ok);
            }
        }
#pragma unroll
        for (int st = 0; st < ST; ++st) {
            const int t = tb + s0 + 16 * st;
            unsigned wd[4] = {0u, 0u, 0u, 0u};  // DROP: word di of the four points' groups
            if (DROP) {
                const unsigned tok = t + 8 * (di >> 1) + 2 * c4 + (di & 1);
                dr_group(p.d, (unsigned long long)tok * cpr + blk, wd);
                dr_tr4(wd, di, 4);
            }
            // 1. lo[n]: (column cw / cw + 1, token t + 8n + 2c / + 1) of (gB·A)ᵀ
            float lo[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
            for (int kk = 0; kk < RK; ++kk) {
                fl_mma(lo[0], af[kk], gb[st][kk][0], gb[st][kk][1]);
                fl_mma(lo[1], af[kk], gb[st][kk][2], gb[st][kk][3]);
            }
            // 2. SwiGLU's backward (swiglu_bwd_keep_v8's math, da in f32 with its adapter term)
            float av[2][4];
#pragma unroll
            for (int n = 0; n < 2; ++n) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {  // token t + 8n + 2c + h: C points h, 2 + h
                    const int e = h + 2 * n, tok = t + 8 * n + 2 * c4 + h;
                    const float gx[2] = {bf_lo(gv[st][e]), bf_hi(gv[st][e])};
                    const float ux[2] = {bf_lo(uv[st][e]), bf_hi(uv[st][e])};
                    const bool kp[2] = {!DROP || dr_keep_lo(p.d, wd[e]), !DROP || dr_keep_hi(p.d, wd[e])};
                    const float dx[2] = {bf_lo(dv[st][e]) + (kp[0] ? f * lo[n][h] : 0.f),
                                         bf_hi(dv[st][e]) + (kp[1] ? f * lo[n][2 + h] : 0.f)};
                    float dg[2], du[2];
#pragma unroll
                    for (int k = 0; k < 2; ++k) {
                        float si;  // the activation, rounded as the forward rounds it
                        if (GELU) {
                            si = rbf(gelu_t(gx[k]));
                            dg[k] = rbf(dx[k] * ux[k]) * gelu_t_grad(gx[k]);
                        } else {
                            const float sg = sl_rcp(1.f + __expf(-gx[k]));
                            si = rbf(gx[k] * sg);
                            dg[k] = rbf(dx[k] * ux[k]) * sg * (1.f + gx[k] * (1.f - sg));
                        }
                        du[k] = dx[k] * si;
                        // a, or m ⊙ a = round(a) · 1/(1 − p) where kept (the forward's input)
                        av[n][2 * k + h] = !DROP ? si * ux[k] : kp[k] ? rbf(si * ux[k]) * p.d.scale : 0.f;
                    }
                    if (tok < p.m && colok) {  // a warp's store: 4 rows of 32 whole bytes
                        const long o = (long)tok * p.I + cw;
                        *(unsigned*)(p.out + o) = bf_pack(dg[0], dg[1]);
                        *(unsigned*)(p.out + mI + o) = bf_pack(du[0], du[1]);
                    }
                }
            }
            // 3. dAᵀ += aᵀ · gB over the step's 16 tokens: a rounded to bf16 (the forward's a)
            const unsigned at[4] = {fl_pack(av[0][0], av[0][1]), fl_pack(av[0][2], av[0][3]),
                                    fl_pack(av[1][0], av[1][1]), fl_pack(av[1][2], av[1][3])};
#pragma unroll
            for (int q2 = 0; q2 < RK; ++q2) {
                fl_mma(acc[2 * q2], at, sl_trans(gb[st][q2][0]), sl_trans(gb[st][q2][2]));
                fl_mma(acc[2 * q2 + 1], at, sl_trans(gb[st][q2][1]), sl_trans(gb[st][q2][3]));
            }
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
    if (half) return;
    // dAᵀ's C points: (column cw, rank 8q + 2c + h) = acc[q][h], (cw + 1, same) = acc[q][2 + h]
    float* dst = p.part + (long)blockIdx.y * p.r * p.I;
#pragma unroll
    for (int q = 0; q < 2 * RK; ++q) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int rk = 8 * q + 2 * c4 + h;
            const float v0 = acc[q][h] + red[((wc * 2 * RK + q) * 4 + h) * 32 + l];
            const float v1 = acc[q][2 + h] + red[((wc * 2 * RK + q) * 4 + 2 + h) * 32 + l];
            if (rk < p.r && colok)
                *(float2*)(dst + (long)rk * p.I + cw) = make_float2(p.s * v0, p.s * v1);
        }
    }
}
// r16 loads two steps ahead; the wider ranks one step, for their registers; with dropout one
// step (the mask's words take the registers). swiglu_* after SwiGLU, geglu_* after GeGLU.
#define GLU_LORA_INST(ACT, GELU) \
extern "C" __global__ void __launch_bounds__(256, 3) ACT##_lora_r16(const GluLoraP p) { glu_lora<1, 2, false, GELU>(p); } \
extern "C" __global__ void __launch_bounds__(256, 3) ACT##_lora_r32(const GluLoraP p) { glu_lora<2, 1, false, GELU>(p); } \
extern "C" __global__ void __launch_bounds__(256, 2) ACT##_lora_r64(const GluLoraP p) { glu_lora<4, 1, false, GELU>(p); } \
extern "C" __global__ void __launch_bounds__(256, 3) ACT##_lora_drop_r16(const GluLoraP p) { glu_lora<1, 1, true, GELU>(p); } \
extern "C" __global__ void __launch_bounds__(256, 3) ACT##_lora_drop_r32(const GluLoraP p) { glu_lora<2, 1, true, GELU>(p); } \
extern "C" __global__ void __launch_bounds__(256, 2) ACT##_lora_drop_r64(const GluLoraP p) { glu_lora<4, 1, true, GELU>(p); }
GLU_LORA_INST(swiglu, false)
GLU_LORA_INST(geglu, true)
#undef GLU_LORA_INST

// out[i] = Σ_k part[k·n + i] in order (the P partial sums of glu_lora, deterministic).
extern "C" __global__ void sum_parts_f32(const float* part, float* out, int P, long n) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float s = 0.f;
    for (int k = 0; k < P; ++k) s += part[(long)k * n + i];
    out[i] = s;
}
