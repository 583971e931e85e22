// A LoRA adapter's two products over g = dL/dy [m, out] in one pass over g (rank 16, bf16,
// Hopper):
//   gbs = s · g B   [m, 16]   (B [out, 16]: dL/d(xas), for dA and dL/dx)
//   dB  = gᵀ xas    [out, 16] f32 (xas [m, 16] = s · (m ⊙ x) Aᵀ, kept by forward)
// cuBLAS runs these as two split-K GEMMs that each read all of g, the largest operand by far.
// lora_gbdb90 takes a 128 × 256 block of g in 64 × 64 tiles (cp.async, three stages); each
// tile adds to the block's gbs rows (over its columns) and dB rows (over its rows) on tensor
// cores (mma.sync m16n8k16, f32 accumulation). Each block adds its sums into f32 accumulators
// (zeroed by the caller) with 16-byte reductions in L2 (red.global.add.v4.f32), so the order of
// the additions varies from run to run, as with the fused flash backward's dQ;
// lora_gbdb90_round scales gbs by s and rounds it to bf16 (into a column slice: a group's gbs
// sit side by side). `LORA_TRAIN_GBDB=0` (or `LORA_TRAIN_DETERMINISTIC=1`) keeps the GEMMs,
// whose sums repeat bit for bit. +0.5% a 7B step on an H200 (BENCHMARKS.md (p)).
//
// Warp w of 8: m16 tile w & 3 of a tile's 64 rows (gbs) or 64 columns (dB), n8 tile w >> 2 of
// the 16 adapter columns.

#define GB90_TS 64
#define GB90_DG (GB90_TS + 8)
#define GB90_DR (16 + 8)
#define GB90_BR 128 // rows of g a block
#define GB90_BC 256 // columns of g a block
#define GB90_NT ((GB90_BR / GB90_TS) * (GB90_BC / GB90_TS)) // tiles a block
#define GB90_STAGE (GB90_TS * GB90_DG)                      // bf16 elements a stage

// Starts copying tile t of the block (band t / 4 of 64 rows, chunk t % 4 of 64 columns) into
// shared; past m or out zero-filled. out % 8 == 0: 16-byte chunks never straddle it.
__device__ __forceinline__ void gb90_load(unsigned s, const bf16_t* g, int m, int out, int r0,
                                          int c0, int t) {
    const int rb = r0 + (t >> 2) * GB90_TS, cb = c0 + (t & 3) * GB90_TS;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int i = threadIdx.x + k * 256, r = i >> 3, c = (i & 7) * 8;
        const bool ok = rb + r < m && cb + c < out;
        fl_cp16(s + 2 * (r * GB90_DG + c), ok ? g + (long)(rb + r) * out + cb + c : g, ok);
    }
}

// Adds a warp's m16 × n8 accumulator tile (rows r0 + lane / 4 and + 8, columns n0 + 2 (lane %
// 4) and + 1) into acc [rows, 16] f32: lane pairs swap halves so that each lane adds four
// consecutive columns of one row in one 16-byte reduction.
__device__ __forceinline__ void gb90_red(float* acc, int rows, const float* c, int r0, int n0) {
    const int l = threadIdx.x & 31, odd = l & 1;
    const float x0 = __shfl_xor_sync(0xffffffff, odd ? c[0] : c[2], 1);
    const float x1 = __shfl_xor_sync(0xffffffff, odd ? c[1] : c[3], 1);
    // even lanes: row r0 + l/4, columns q..q+3 (theirs, then the odd neighbour's); odd lanes:
    // row r0 + l/4 + 8, columns q-2..q+1 (the even neighbour's, then theirs)
    const int row = r0 + (l >> 2) + odd * 8, col = n0 + (l & 3) * 2 - odd * 2;
    if (row >= rows) return;
    const float a = odd ? x0 : c[0], b = odd ? x1 : c[1];
    const float d0 = odd ? c[2] : x0, d1 = odd ? c[3] : x1;
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};"
        :: "l"(acc + (long)row * 16 + col), "f"(a), "f"(b), "f"(d0), "f"(d1) : "memory");
}

extern "C" __global__ void __launch_bounds__(256) lora_gbdb90(const bf16_t* g, const bf16_t* bm,
    const bf16_t* xas, long ldx, float* gacc, float* dacc, int m, int out) {
    __shared__ __align__(16) bf16_t sB[GB90_BC * GB90_DR];
    __shared__ __align__(16) bf16_t sX[GB90_BR * GB90_DR];
    __shared__ __align__(16) bf16_t sG[3 * GB90_STAGE];
    const int tid = threadIdx.x, w = tid >> 5, l = tid & 31, mt = (w & 3) * 16, nh = w >> 2;
    const int c0 = blockIdx.x * GB90_BC, r0 = blockIdx.y * GB90_BR;
    const unsigned uB = fl_smem(sB), uX = fl_smem(sX), uG = fl_smem(sG);
    // B's rows c0.. (256) and xas's rows r0.. (128), two 16-byte chunks a row.
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int i = tid + k * 256, r = i >> 1, c = (i & 1) * 8;
        const bool okb = c0 + r < out;
        fl_cp16(uB + 2 * (r * GB90_DR + c), okb ? bm + (long)(c0 + r) * 16 + c : bm, okb);
    }
    {
        const int r = tid >> 1, c = (tid & 1) * 8;
        const bool okx = r0 + r < m;
        fl_cp16(uX + 2 * (r * GB90_DR + c), okx ? xas + (long)(r0 + r) * ldx + c : xas, okx);
    }
    gb90_load(uG, g, m, out, r0, c0, 0);
    fl_commit();
    gb90_load(uG + 2 * GB90_STAGE, g, m, out, r0, c0, 1);
    fl_commit();
    float ad[4][4]; // dB: per column chunk, columns mt.., adapter columns nh·8..
#pragma unroll
    for (int ch = 0; ch < 4; ++ch)
#pragma unroll
        for (int j = 0; j < 4; ++j) ad[ch][j] = 0.f;
#pragma unroll 1
    for (int band = 0; band < GB90_BR / GB90_TS; ++band) {
        float ag[4] = {0.f, 0.f, 0.f, 0.f}; // gbs: rows mt.. of the band, columns nh·8..
#pragma unroll
        for (int ch = 0; ch < 4; ++ch) {
            const int t = band * 4 + ch;
            if (t + 2 < GB90_NT) gb90_load(uG + 2 * ((t + 2) % 3) * GB90_STAGE, g, m, out, r0, c0, t + 2);
            fl_commit(); // (empty at the end: the wait below counts groups)
            asm volatile("cp.async.wait_group 2;" ::: "memory");
            __syncthreads();
            const unsigned s = uG + 2 * (t % 3) * GB90_STAGE;
#pragma unroll
            for (int k = 0; k < GB90_TS; k += 16) {
                unsigned a[4], b[4];
                // gbs += g[rows mt.., cols k..] · B[cols k.., :]
                fl_afrag(a, s, GB90_DG, mt, k, l);
                fl_bfrag2n(b, uB, GB90_DR, ch * GB90_TS + k, 0, l);
                fl_mma(ag, a, nh ? b[2] : b[0], nh ? b[3] : b[1]);
                // dB += g[rows k.., cols mt..]ᵀ · xas[rows k.., :]
                fl_ldsm_t(a, s + 2 * ((k + (l & 7) + (l >> 4) * 8) * GB90_DG + mt
                                      + ((l >> 3) & 1) * 8));
                fl_bfrag2n(b, uX, GB90_DR, band * GB90_TS + k, 0, l);
                fl_mma(ad[ch], a, nh ? b[2] : b[0], nh ? b[3] : b[1]);
            }
            __syncthreads(); // this stage is refilled two tiles on
        }
        // The band's gbs rows are complete over this block's columns.
        gb90_red(gacc, m, ag, r0 + band * GB90_TS + mt, nh * 8);
    }
#pragma unroll
    for (int ch = 0; ch < 4; ++ch) gb90_red(dacc, out, ad[ch], c0 + ch * GB90_TS + mt, nh * 8);
}

// gbs [m, 16] bf16 (row stride ldo) = s · gacc; four elements a thread.
extern "C" __global__ void lora_gbdb90_round(const float* gacc, int m, float s, bf16_t* gbs,
                                             long ldo) {
    const long i = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i >= (long)m * 16) return;
    const float4 a = *(const float4*)(gacc + i);
    uint2 o;
    o.x = fl_pack(s * a.x, s * a.y);
    o.y = fl_pack(s * a.z, s * a.w);
    *(uint2*)(gbs + (i >> 4) * ldo + (i & 15)) = o;
}
