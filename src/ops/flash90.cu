// Causal flash attention on Hopper's warpgroup MMA (wgmma, sm_90a), head dim 128, and head dim
// 256 (Gemma's, soft-capped or not: the kernels named _d256; the forward and dQ share their
// templates with head dim 128, dK/dV has its own, flash_dkdv90_256). Compiled by
// NVRTC after flash.cu (its FlashP, masks and fragment helpers) for sm_90a, and taken on
// compute capability 9.0 only; flash.cu's mma.sync kernels stay the path everywhere else.
//
// A thread block is two warpgroups (256 threads); each warpgroup owns 64 query rows (or keys)
// and issues m64nNk16 wgmmas whose B (and A, where not from registers) come from shared tiles
// in the 128-byte swizzle: a [R rows × 128] tile is two column halves of R rows × 128 bytes,
// the 16-byte chunk j of row r stored at r·128 + (j ^ r % 8)·16 (PTX ISA, "Shared Memory
// Matrix Layout", 128B swizzling). One layout serves both majors: a row-major [rows × d]
// tile is K-major when d is the product's k (S = Q·Kᵀ) and MN-major when rows are k (O = P·V).
// Accumulators are laid out per warp as mma.sync's C (rows 16·warp + g, g + 8), so two n8
// blocks of a C are one A fragment and flash.cu's masks and softmax apply as they are.

extern __shared__ __align__(1024) unsigned char flash90_smem[];

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template<int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }
// Shared memory written through the generic proxy (cp.async, stores) and read next by wgmma.
__device__ __forceinline__ void wg_smem_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Ties accumulator registers to this point, so no use of them moves above a wait (or a
// write below a fence): the compiler cannot see wgmma's asynchrony.
template<int N>
__device__ __forceinline__ void wg_hold(float (*d)[4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
        asm volatile("" : "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3]) :: "memory");
}
// The descriptor of a 128-byte-swizzled shared matrix (PTX ISA, "Matrix Descriptor"): start
// address, leading and stride byte offsets (each in 16-byte units), swizzle mode 1 in bits
// 62–63. Tiles start 1024-byte aligned, so the base offset is 0.
__device__ __forceinline__ unsigned long long wg_desc(unsigned a, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((a & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32) | (1ull << 62);
}
// K-major (rows are M or N, 128-byte rows along k): k step s of 16 starts 32·(s % 4) bytes into
// column half s / 4; 8-row groups are 1024 bytes apart.
__device__ __forceinline__ unsigned long long wg_kdesc(unsigned tile, int rows, int s) {
    return wg_desc(tile + (s >> 2) * rows * 128 + (s & 3) * 32, 16, 1024);
}
// MN-major (rows are k, d along N): k step s starts at row 16·s; N's two 64-column halves are
// rows·128 bytes apart, k's 8-row groups 1024.
__device__ __forceinline__ unsigned long long wg_ndesc(unsigned tile, int rows, int s) {
    return wg_desc(tile + s * 2048, rows * 128, 1024);
}

// The wgmma wrappers spell out every accumulator operand (m64nN: N / 2 floats a thread), as
// d[N / 8][4] in mma.sync's C order.
//
// D[64 × 64] (+)= A · B, A and B from shared memory (descriptors); TB: B is MN-major, TA: A is.
template<int TB, int TA = 0>
__device__ __forceinline__ void wg_ss64(float (*d)[4], unsigned long long da, unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %36, %35;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(da), "l"(db), "r"(acc), "n"(TB), "n"(TA));
}
// D[64 × 128] (+)= A · B, A and B from shared memory (descriptors); TB: B is MN-major.
template<int TB>
__device__ __forceinline__ void wg_ss128(float (*d)[4], unsigned long long da, unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, %67;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "l"(da), "l"(db), "r"(acc), "n"(TB));
}
// D[64 × 128] (+)= A · B, A from registers (an m64k16 fragment), B from shared memory.
template<int TB>
__device__ __forceinline__ void wg_rs128(float (*d)[4], const unsigned* a, unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc), "n"(TB));
}

// D[64 × 64] = A · B (D's old values unread: the first k step of a product).
template<int TB, int TA = 0>
__device__ __forceinline__ void wg_ss64z(float (*d)[4], unsigned long long da, unsigned long long db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %34;\n}\n"
        : "=f"(d[0][0]), "=f"(d[0][1]), "=f"(d[0][2]), "=f"(d[0][3]), "=f"(d[1][0]), "=f"(d[1][1]), "=f"(d[1][2]), "=f"(d[1][3]), "=f"(d[2][0]), "=f"(d[2][1]), "=f"(d[2][2]), "=f"(d[2][3]), "=f"(d[3][0]), "=f"(d[3][1]), "=f"(d[3][2]), "=f"(d[3][3]), "=f"(d[4][0]), "=f"(d[4][1]), "=f"(d[4][2]), "=f"(d[4][3]), "=f"(d[5][0]), "=f"(d[5][1]), "=f"(d[5][2]), "=f"(d[5][3]), "=f"(d[6][0]), "=f"(d[6][1]), "=f"(d[6][2]), "=f"(d[6][3]), "=f"(d[7][0]), "=f"(d[7][1]), "=f"(d[7][2]), "=f"(d[7][3])
        : "l"(da), "l"(db), "n"(TB), "n"(TA));
}

// D[64 × 128] = A · B (D's old values unread: the first k step of a product).
template<int TB>
__device__ __forceinline__ void wg_ss128z(float (*d)[4], unsigned long long da, unsigned long long db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, %66;\n}\n"
        : "=f"(d[0][0]), "=f"(d[0][1]), "=f"(d[0][2]), "=f"(d[0][3]), "=f"(d[1][0]), "=f"(d[1][1]), "=f"(d[1][2]), "=f"(d[1][3]), "=f"(d[2][0]), "=f"(d[2][1]), "=f"(d[2][2]), "=f"(d[2][3]), "=f"(d[3][0]), "=f"(d[3][1]), "=f"(d[3][2]), "=f"(d[3][3]), "=f"(d[4][0]), "=f"(d[4][1]), "=f"(d[4][2]), "=f"(d[4][3]), "=f"(d[5][0]), "=f"(d[5][1]), "=f"(d[5][2]), "=f"(d[5][3]), "=f"(d[6][0]), "=f"(d[6][1]), "=f"(d[6][2]), "=f"(d[6][3]), "=f"(d[7][0]), "=f"(d[7][1]), "=f"(d[7][2]), "=f"(d[7][3]), "=f"(d[8][0]), "=f"(d[8][1]), "=f"(d[8][2]), "=f"(d[8][3]), "=f"(d[9][0]), "=f"(d[9][1]), "=f"(d[9][2]), "=f"(d[9][3]), "=f"(d[10][0]), "=f"(d[10][1]), "=f"(d[10][2]), "=f"(d[10][3]), "=f"(d[11][0]), "=f"(d[11][1]), "=f"(d[11][2]), "=f"(d[11][3]), "=f"(d[12][0]), "=f"(d[12][1]), "=f"(d[12][2]), "=f"(d[12][3]), "=f"(d[13][0]), "=f"(d[13][1]), "=f"(d[13][2]), "=f"(d[13][3]), "=f"(d[14][0]), "=f"(d[14][1]), "=f"(d[14][2]), "=f"(d[14][3]), "=f"(d[15][0]), "=f"(d[15][1]), "=f"(d[15][2]), "=f"(d[15][3])
        : "l"(da), "l"(db), "n"(TB));
}

// D[64 × 32] (+)= A · B, A and B K-major from shared memory (descriptors).
__device__ __forceinline__ void wg_ss32(float (*d)[4], unsigned long long da, unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
        : "l"(da), "l"(db), "r"(acc));
}

// D[64 × 32] = A · B (D's old values unread: the first k step of a product).
__device__ __forceinline__ void wg_ss32z(float (*d)[4], unsigned long long da, unsigned long long db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "=f"(d[0][0]), "=f"(d[0][1]), "=f"(d[0][2]), "=f"(d[0][3]), "=f"(d[1][0]), "=f"(d[1][1]), "=f"(d[1][2]), "=f"(d[1][3]), "=f"(d[2][0]), "=f"(d[2][1]), "=f"(d[2][2]), "=f"(d[2][3]), "=f"(d[3][0]), "=f"(d[3][1]), "=f"(d[3][2]), "=f"(d[3][3])
        : "l"(da), "l"(db));
}

// D[64 × N] = A·Bᵀ over k = 16·KS as one wgmma group (KS k steps: 8 at head dim 128, 16 at
// 256; the first writes D): A the 64 rows at a of a K-major tile of ar rows, B the N rows at bt
// of a K-major tile of br rows (a tile's 128-byte column blocks are rows·128 bytes apart; a and
// bt at multiples of 8 rows, the swizzle's period).
template<int N, int KS = 8>
__device__ __forceinline__ void wg_product(float (*d)[4], unsigned a, int ar, unsigned bt, int br = N) {
    static_assert(N == 32 || N == 64 || N == 128, "m64n32, m64n64 or m64n128");
    if constexpr (N == 32) {
        wg_ss32z(d, wg_kdesc(a, ar, 0), wg_kdesc(bt, br, 0));
#pragma unroll
        for (int kk = 1; kk < KS; ++kk) wg_ss32(d, wg_kdesc(a, ar, kk), wg_kdesc(bt, br, kk), 1);
    } else if constexpr (N == 64) {
        wg_ss64z<0>(d, wg_kdesc(a, ar, 0), wg_kdesc(bt, br, 0));
#pragma unroll
        for (int kk = 1; kk < KS; ++kk) wg_ss64<0>(d, wg_kdesc(a, ar, kk), wg_kdesc(bt, br, kk), 1);
    } else {
        wg_ss128z<0>(d, wg_kdesc(a, ar, 0), wg_kdesc(bt, br, 0));
#pragma unroll
        for (int kk = 1; kk < KS; ++kk) wg_ss128<0>(d, wg_kdesc(a, ar, kk), wg_kdesc(bt, br, kk), 1);
    }
    wg_commit();
}

// Starts copying rows [r0, r0 + R) of a [T, 128] slab (row stride st) into the swizzled tile
// at s (256 threads, a row's 16 chunks over 16 threads); rows past T are zero-filled.
template<int R>
__device__ __forceinline__ void sw_load(unsigned s, const bf16_t* g, long st, int r0, int T) {
    constexpr int RS = 16;  // rows a pass
    static_assert(R % RS == 0, "a tile is whole passes");
    const int r = threadIdx.x >> 4, cc = threadIdx.x & 15;
    const unsigned dst = s + (cc >> 3) * R * 128 + r * 128 + (((cc & 7) ^ (r & 7)) << 4);
    const bf16_t* src = g + (long)(r0 + r) * st + cc * 8;
#pragma unroll
    for (int i = 0; i < R / RS; ++i) {
        const bool ok = r0 + r + RS * i < T;
        fl_cp16(dst + i * RS * 128, ok ? src + (long)RS * i * st : g, ok);
    }
}

// sw_load of a [T, D] slab (D = 128 or 256): at D = 256 the tile [R × 256] is four column
// quarters of R rows × 128 bytes, so that K-major k steps 4-15 fall in quarters 1-3 (wg_kdesc)
// and a 128-column half of the tile is two adjacent quarters (one MN-major operand of n128).
template<int D, int R>
__device__ __forceinline__ void sw_load_d(unsigned s, const bf16_t* g, long st, int r0, int T) {
    static_assert(D == 128 || D == 256, "head dim 128 or 256");
    sw_load<R>(s, g, st, r0, T);
    if constexpr (D == 256) sw_load<R>(s + 2 * R * 128, g + 128, st, r0, T);
}

// The forward: 128 queries a block (64 a warpgroup), keys in tiles of 128 (64 at head dim
// 256). S = Q·Kᵀ with Q and K from shared memory; O += P·V with P from registers (at D = 256
// as two 128-column halves: O's 64 × 256 sums take 128 registers a thread). Software-pipelined
// as FA3: tile j's S is issued, then the previous tile's P·V; S is waited for and tile j's
// softmax runs while P·V is still on the tensor cores. K is double-buffered, V triple-buffered
// (a V tile is read one tile later than its K). At D = 256 Gemma 2's soft-cap applies to S
// before the mask (flash.rs gives the head-dim-128 kernels no cap).
template<int D>
__device__ __forceinline__ void flash_fwd90(const FlashP& p) {
    constexpr int BQ = 128, BK = D == 128 ? 128 : 64, QT = BQ * D * 2, KT = BK * D * 2, DN = D / 8;
    const unsigned raw = fl_smem(flash90_smem), base = (raw + 1023) & ~1023u;
    const unsigned sQ = base, sK = sQ + QT, sV = sK + 2 * KT;  // sK [2], sV [3]
    unsigned* sSeg = (unsigned*)(flash90_smem + (sV + 3 * KT - raw));  // [2][BK]
    const int T = p.T, bh = blockIdx.y, b = bh / p.H, h = bh % p.H, kh = h / (p.H / p.KH);
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;  // the longest rows first
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, l = tid & 31;
    const int g = l >> 2, c = l & 3;
    const float sc = p.scale * FLASH_LOG2E;
    const int kend = min(T, q0 + BQ), kbeg = fl_first_key<BK>(p, b, q0);
    const int ntiles = (kend - kbeg + BK - 1) / BK;
    const int w0 = q0 + 64 * wg;  // this warpgroup's first query
    auto prefetch = [&](int j) {  // key tile j
        const int k0 = kbeg + j * BK;
        sw_load_d<D, BK>(sK + (j & 1) * KT, p.k + b * p.sk[0] + kh * p.sk[1], p.sk[2], k0, T);
        sw_load_d<D, BK>(sV + (j % 3) * KT, p.v + b * p.sv[0] + kh * p.sv[1], p.sv[2], k0, T);
        fl_seg_load<BK>(p, sSeg + (j & 1) * BK, b, k0);
        fl_commit();
    };
    sw_load_d<D, BQ>(sQ, p.q + b * p.sq[0] + h * p.sq[1], p.sq[2], q0, T);  // one group with tile 0
    prefetch(0);
    const int qi0 = w0 + warp * 16 + g, qi1 = qi0 + 8;
    const unsigned sg0 = fl_seg(p, b, qi0), sg1 = fl_seg(p, b, qi1);
    float o[DN][4], s[BK / 8][4];
#pragma unroll
    for (int n = 0; n < DN; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    unsigned pf[BK / 16][4];  // P of the tile whose P·V is next
    float m0 = FLASH_NEG_INF, m1 = FLASH_NEG_INF, l0 = 0.f, l1 = 0.f, cr0 = 1.f, cr1 = 1.f;
    // Waits for key tile j, starts loading tile j + 1 and issues S = Q·K_jᵀ.
    auto start = [&](int j) {
        fl_wait_all();
        wg_smem_fence();
        __syncthreads();  // every warpgroup is done with S of tile j − 1 and P·V of j − 2
        if (j + 1 < ntiles) prefetch(j + 1);
        const unsigned tK = sK + (j & 1) * KT;
        wg_fence();
        wg_product<BK, D / 16>(s, sQ + wg * 64 * 128, BQ, tK);
    };
    // Tile j's softmax over s (waited for): the new running max m, the factor cr that rescales
    // what was summed before, the row sums l; s becomes P.
    auto softmax = [&](int j) {
        const int k0 = kbeg + j * BK;
        if (D == 256 && p.softcap != 0.f) fl_softcap<BK>(s, p.scale, p.softcap);
        if (p.seg || p.window != 0 || k0 + BK - 1 > w0 + warp * 16)
            fl_mask<BK>(p, s, qi0, sg0, sg1, k0, sSeg + (j & 1) * BK, c);
        fl_online_softmax<BK>(s, sc, m0, m1, l0, l1, cr0, cr1);
    };
    // O += P·V of tile j (P in pf), a 128-column half of V at a time.
    auto pv = [&](int j) {
        const unsigned tV = sV + (j % 3) * KT;
        wg_fence();
#pragma unroll
        for (int hf = 0; hf < D / 128; ++hf)
#pragma unroll
            for (int jj = 0; jj < BK / 16; ++jj)
                wg_rs128<1>(o + 16 * hf, pf[jj], wg_ndesc(tV + hf * 2 * BK * 128, BK, jj), 1);
        wg_commit();
    };
    auto keep_p = [&]() {
#pragma unroll
        for (int jj = 0; jj < BK / 16; ++jj) fl_a_from_c(pf[jj], s[2 * jj], s[2 * jj + 1]);
    };
    start(0);
    wg_wait<0>();
    wg_hold<BK / 8>(s);
    softmax(0);
    keep_p();
    for (int j = 1; j < ntiles; ++j) {
        start(j);
        pv(j - 1);
        wg_wait<1>();  // S of tile j; P·V of tile j − 1 runs on through the softmax
        wg_hold<BK / 8>(s);
        softmax(j);
        wg_wait<0>();
        wg_hold<DN>(o);
#pragma unroll
        for (int n = 0; n < DN; ++n) {
            o[n][0] *= cr0; o[n][1] *= cr0; o[n][2] *= cr1; o[n][3] *= cr1;
        }
        keep_p();
    }
    pv(ntiles - 1);
    wg_wait<0>();
    wg_hold<DN>(o);
    fl_store_o<D>(p, o, b, h, qi0, m0, m1, l0, l1, c);
}

extern "C" __global__ void __launch_bounds__(256, 1) flash_fwd90_d128(const FlashP p) { flash_fwd90<128>(p); }
extern "C" __global__ void __launch_bounds__(256, 1) flash_fwd90_d256(const FlashP p) { flash_fwd90<256>(p); }

// Runs steps 0 … n − 1 software-pipelined: step i + 1's first products are issued right after
// step i's last ones, so the tensor cores have queued work through the barrier and the loads'
// bookkeeping. issue(i) issues step i's first products (their buffers loaded); process(i)
// waits for them and issues its last ones, not waited for; prefetch(i) starts loading step i
// into the buffer of step i − 3 (buffers three deep). The loop always issues (the last step is
// peeled), so that ptxas sees one fixed order of wgmma groups and waits. The steps come by
// reference: taken by value, they change how ptxas allocates dK/dV's registers.
template<class Issue, class Process, class Prefetch>
__device__ __forceinline__ void wg_pipeline(int n, const Issue& issue, const Process& process, const Prefetch& prefetch) {
    issue(0);
    for (int i = 0; i + 1 < n; ++i) {
        process(i);
        fl_wait_all();  // step i + 1's loads
        wg_smem_fence();
        // Every warpgroup is past step i − 1's last products (process waited for them), so
        // their buffer takes step i + 2.
        __syncthreads();
        if (i + 2 < n) prefetch(i + 2);
        issue(i + 1);
    }
    process(n - 1);
}

// dQ: 128 queries a block (64 a warpgroup), keys in tiles of 64 (32 at head dim 256), three
// buffers deep. S = Q·Kᵀ and dP = dO·Vᵀ with Q and dO from shared memory, then dQ += dS·K
// with dS from registers (at D = 256 as two 128-column halves of K). Pipelined by
// wg_pipeline: a step is a key tile, S and dP first, dQ's product last.
template<int D>
__device__ __forceinline__ void flash_dq90(const FlashP& p) {
    constexpr int BQ = 128, BK = D == 128 ? 64 : 32, DN = D / 8, QT = BQ * D * 2, KT = BK * D * 2;
    const unsigned raw = fl_smem(flash90_smem), base = (raw + 1023) & ~1023u;
    const unsigned sQ = base, sO = sQ + QT, sK = sO + QT, sV = sK + 3 * KT;  // sK, sV: [3]
    unsigned* sSeg = (unsigned*)(flash90_smem + (sV + 3 * KT - raw));  // [3][BK]
    const int T = p.T, bh = blockIdx.y, b = bh / p.H, h = bh % p.H, kh = h / (p.H / p.KH);
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, l = tid & 31;
    const int g = l >> 2, c = l & 3;
    const float sc = p.scale * FLASH_LOG2E, kt = p.softcap != 0.f ? p.scale / p.softcap : 0.f;
    const int kend = min(T, q0 + BQ), kbeg = fl_first_key<BK>(p, b, q0);
    const int ntiles = (kend - kbeg + BK - 1) / BK;
    const int w0 = q0 + 64 * wg;
    auto prefetch = [&](int j) {  // key tile j into buffer j % 3
        const int k0 = kbeg + j * BK, buf = j % 3;
        sw_load_d<D, BK>(sK + buf * KT, p.k + b * p.sk[0] + kh * p.sk[1], p.sk[2], k0, T);
        sw_load_d<D, BK>(sV + buf * KT, p.v + b * p.sv[0] + kh * p.sv[1], p.sv[2], k0, T);
        fl_seg_load<BK>(p, sSeg + buf * BK, b, k0);
        fl_commit();
    };
    sw_load_d<D, BQ>(sQ, p.q + b * p.sq[0] + h * p.sq[1], p.sq[2], q0, T);
    sw_load_d<D, BQ>(sO, p.o + b * p.so[0] + h * p.so[1], p.so[2], q0, T);
    prefetch(0);  // one group with Q and dO
    if (ntiles > 1) { prefetch(1); fl_wait_but1(); } else fl_wait_all();
    const int qi0 = w0 + warp * 16 + g, qi1 = qi0 + 8;
    const unsigned sg0 = fl_seg(p, b, qi0), sg1 = fl_seg(p, b, qi1);
    const float L0 = qi0 < T ? p.lse[(long)bh * T + qi0] * FLASH_LOG2E : 0.f;
    const float L1 = qi1 < T ? p.lse[(long)bh * T + qi1] * FLASH_LOG2E : 0.f;
    const float d0 = qi0 < T ? p.delta[(long)bh * T + qi0] : 0.f;
    const float d1 = qi1 < T ? p.delta[(long)bh * T + qi1] : 0.f;
    float acc[DN][4], s[BK / 8][4], dp[BK / 8][4];
#pragma unroll
    for (int n = 0; n < DN; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    wg_hold<DN>(acc);  // the zeros are written here, before any wgmma is in flight
    unsigned da[BK / 16][4];
    auto issue_sdp = [&](int j) {  // S and dP of tile j, as two groups
        const unsigned tK = sK + (j % 3) * KT, tV = sV + (j % 3) * KT;
        wg_fence();
        wg_product<BK, D / 16>(s, sQ + wg * 64 * 128, BQ, tK);
        wg_product<BK, D / 16>(dp, sO + wg * 64 * 128, BQ, tV);
    };
    wg_smem_fence();
    __syncthreads();
    // Tile j: P, dS, then dQ += dS·K issued (not waited for).
    auto process = [&](int j) {
        const int k0 = kbeg + j * BK;
        // S and dP of tile j (and tile j − 1's dQ product). Waiting for S alone, with dP
        // running on through P, makes ptxas serialize every wgmma (C7514).
        wg_wait<0>();
        wg_hold<BK / 8>(s);
        wg_hold<BK / 8>(dp);
        const bool capped = D == 256 && p.softcap != 0.f;  // flash.rs caps only at 256
        if (capped) fl_softcap<BK>(s, p.scale, p.softcap);
        if (p.seg || p.window != 0 || k0 + BK - 1 > w0 + warp * 16)
            fl_mask<BK>(p, s, qi0, sg0, sg1, k0, sSeg + (j % 3) * BK, c);
        // dS = P ⊙ (dP − δ), P = exp(scale·S − L): 0 where masked (S = −∞); with the cap,
        // times its derivative 1 − t² (flash.cu's order of rounding).
#pragma unroll
        for (int n = 0; n < BK / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float L = e < 2 ? L0 : L1, dl = e < 2 ? d0 : d1;
                const float ds = fl_exp2(fmaf(s[n][e], sc, -L)) * (dp[n][e] - dl);
                s[n][e] = capped ? ds * fl_softcap_d(s[n][e], kt) : ds;
            }
#pragma unroll
        for (int jj = 0; jj < BK / 16; ++jj) fl_a_from_c(da[jj], s[2 * jj], s[2 * jj + 1]);
        const unsigned tK = sK + (j % 3) * KT;
        wg_fence();
#pragma unroll
        for (int hf = 0; hf < D / 128; ++hf)
#pragma unroll
            for (int jj = 0; jj < BK / 16; ++jj)
                wg_rs128<1>(acc + 16 * hf, da[jj], wg_ndesc(tK + hf * 2 * BK * 128, BK, jj), 1);
        wg_commit();
    };
    wg_pipeline(ntiles, issue_sdp, process, prefetch);
    wg_wait<0>();
    wg_hold<DN>(acc);
    const long rope = (long)b * T * (D / 2);
    fl_store_rows<D>(p.dq + b * p.sdq[0] + h * p.sdq[1], p.sdq[2], acc, qi0, T, p.scale,
                     p.rc ? p.rc + rope : nullptr, p.rs ? p.rs + rope : nullptr, c);
}

// dK, dV: 128 keys a block (64 a warpgroup), over every query head of the kv head in tiles of
// 64 queries, three buffers deep. Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ with K and V from shared memory;
// dV += Pᵀ·dO and dK += dSᵀ·Q with Pᵀ and dSᵀ from registers, dO and Q read MN-major from the
// same tiles. Pipelined by wg_pipeline: a step is a pair, Sᵀ and dPᵀ first, dV and dK last.
//
// DQ (the fused backward): dQ's terms too, so that S and dP are computed once, not again in
// flash_dq90 (whose three products a key tile become one here). dSᵀ of both warpgroups goes to
// a shared tile [128 keys × 64 queries] (one swizzled 128-byte row a key); dK's product reads it
// K-major, and dQ[64 queries × 128] += dS·K reads it MN-major (transposed) against K's tile,
// each warpgroup one 64-column half of dQ. That product is issued before dK's and waited for
// within the pair while dK's runs on (its 32 accumulators a thread fit only while S and dP are
// dead; read under the next pair's S and dP, ptxas serializes every wgmma), staged in shared
// memory and added into p.dqacc (f32) by the copy engine (cp.reduce.async.bulk: thread-issued
// reductions of these 550 MB a layer held the warps); flash_dq_rows90 scales, rotates and
// rounds the sums after the kernel.
template<bool DQ>
__device__ __forceinline__ void flash_dkdv90(const FlashP& p) {
    constexpr int D = 128, BK = 128, BQ = 64, DN = D / 8, KT = BK * D * 2, QT = BQ * D * 2;
    const unsigned raw = fl_smem(flash90_smem), base = (raw + 1023) & ~1023u;
    const unsigned sK = base, sV = sK + KT, sQ = sV + KT, sO = sQ + 3 * QT;  // sQ, sO: [3]
    float* sL = (float*)(flash90_smem + (sO + 3 * QT - raw));  // [3][BQ] L
    float* sD = sL + 3 * BQ;                                    // [3][BQ] δ
    unsigned* sSeg = (unsigned*)(sD + 3 * BQ);                  // [3][BQ]
    const unsigned sDS = (sO + 3 * QT + 9 * BQ * 4 + 1023) & ~1023u;  // DQ: dSᵀ [BK][BQ] bf16
    const unsigned sAcc = sDS + BK * BQ * 2;  // DQ: dQ's terms of a pair, f32 [2][4096]
    const int T = p.T, b = blockIdx.y / p.KH, kh = blockIdx.y % p.KH, grp = p.H / p.KH;
    const int k0 = blockIdx.x * BK;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, l = tid & 31;
    const int g = l >> 2, c = l & 3;
    const float sc = p.scale * FLASH_LOG2E;
    const int qend = fl_query_end<BK>(p, b, k0);
    const int nq = (qend - k0 + BQ - 1) / BQ, iters = grp * nq;  // (query head, query tile) pairs
    auto q0_of = [&](int it) { return k0 + (it % nq) * BQ; };
    auto prefetch = [&](int it) {  // pair it into buffer it % 3
        const int h = kh * grp + it / nq, q0 = q0_of(it), buf = it % 3;
        sw_load<BQ>(sQ + buf * QT, p.q + b * p.sq[0] + h * p.sq[1], p.sq[2], q0, T);
        sw_load<BQ>(sO + buf * QT, p.o + b * p.so[0] + h * p.so[1], p.so[2], q0, T);
        // L, δ and the example ids travel with the tiles (a plain load here would hold these
        // threads, and at the barrier everyone, for a memory round trip a tile): 0 past T,
        // where the mask rules every query out.
        if (tid < BQ) {
            const long row = ((long)b * p.H + h) * T;
            const int i = q0 + tid;
            const bool ok = i < T;
            fl_cp4(sL + buf * BQ + tid, ok ? p.lse + row + i : p.lse, ok);
            fl_cp4(sD + buf * BQ + tid, ok ? p.delta + row + i : p.delta, ok);
            if (p.seg) fl_cp4(sSeg + buf * BQ + tid, p.seg + (long)b * T + i, ok);
            else sSeg[buf * BQ + tid] = 0u;
        }
        fl_commit();
    };
    sw_load<BK>(sK, p.k + b * p.sk[0] + kh * p.sk[1], p.sk[2], k0, T);
    sw_load<BK>(sV, p.v + b * p.sv[0] + kh * p.sv[1], p.sv[2], k0, T);
    fl_commit();
    if (iters > 0) prefetch(0);
    if (iters > 1) { prefetch(1); fl_wait_but1(); } else fl_wait_all();
    const int w0 = k0 + 64 * wg;  // this warpgroup's first key
    const int kj0 = w0 + warp * 16 + g;
    const unsigned sg0 = fl_seg(p, b, kj0), sg1 = fl_seg(p, b, kj0 + 8);
    float dk[DN][4], dv[DN][4], st[BQ / 8][4], dpt[BQ / 8][4];
#pragma unroll
    for (int n = 0; n < DN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;
    wg_hold<DN>(dk);  // the zeros are written here, before any wgmma is in flight
    wg_hold<DN>(dv);
    unsigned pa[BQ / 16][4], da[BQ / 16][4];
    auto issue_sdp = [&](int it) {  // Sᵀ and dPᵀ of pair it, as two groups
        const unsigned tQ = sQ + (it % 3) * QT, tO = sO + (it % 3) * QT;
        wg_fence();
        wg_product<BQ>(st, sK + wg * 64 * 128, BK, tQ);
        wg_product<BQ>(dpt, sV + wg * 64 * 128, BK, tO);
    };
    wg_smem_fence();
    __syncthreads();
    // Pair it: P, dV += Pᵀ·dO issued, dS while it runs, dK += dSᵀ·Q issued (neither waited
    // for).
    auto process = [&](int it) {
        const int buf = it % 3, q0 = q0_of(it);
        const unsigned tQ = sQ + buf * QT, tO = sO + buf * QT;
        const float* tL = sL + buf * BQ;
        const float* tD = sD + buf * BQ;
        const unsigned* tS = sSeg + buf * BQ;
        // Sᵀ and dPᵀ (and the last pair's dV and dK). Waiting for Sᵀ alone, with dPᵀ
        // running on through P, makes ptxas serialize every wgmma (C7514).
        wg_wait<0>();
        wg_hold<BQ / 8>(st);
        wg_hold<BQ / 8>(dpt);
        if (p.seg || p.window != 0 || q0 < w0 + warp * 16 + 15 || q0 + BQ > T)
            fl_mask_t<BQ>(p, st, q0, kj0, sg0, sg1, tS, c);
        // P = exp(scale·S − L), 0 where masked.
#pragma unroll
        for (int n = 0; n < BQ / 8; ++n) {
            const float2 L = *(const float2*)(tL + n * 8 + 2 * c);
            const float l0 = L.x * FLASH_LOG2E, l1 = L.y * FLASH_LOG2E;
            st[n][0] = fl_exp2(fmaf(st[n][0], sc, -l0));
            st[n][1] = fl_exp2(fmaf(st[n][1], sc, -l1));
            st[n][2] = fl_exp2(fmaf(st[n][2], sc, -l0));
            st[n][3] = fl_exp2(fmaf(st[n][3], sc, -l1));
        }
#pragma unroll
        for (int j = 0; j < BQ / 16; ++j) fl_a_from_c(pa[j], st[2 * j], st[2 * j + 1]);
        wg_fence();
#pragma unroll
        for (int j = 0; j < BQ / 16; ++j) wg_rs128<1>(dv, pa[j], wg_ndesc(tO, BQ, j), 1);
        wg_commit();
        // dS = P ⊙ (dP − δ), while dV's product runs
#pragma unroll
        for (int n = 0; n < BQ / 8; ++n) {
            const float2 dl = *(const float2*)(tD + n * 8 + 2 * c);
            dpt[n][0] = st[n][0] * (dpt[n][0] - dl.x);
            dpt[n][1] = st[n][1] * (dpt[n][1] - dl.y);
            dpt[n][2] = st[n][2] * (dpt[n][2] - dl.x);
            dpt[n][3] = st[n][3] * (dpt[n][3] - dl.y);
        }
        if constexpr (DQ) {
            // dSᵀ rows (keys) to the shared tile: chunk n of row r at r·128 + (n ^ r % 8)·16,
            // a warp's 32 stores of a chunk column on 32 banks.
#pragma unroll
            for (int n = 0; n < BQ / 8; ++n) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const unsigned row = wg * 64 + warp * 16 + g + 8 * r;
                    const unsigned at = sDS + row * 128 + ((n ^ (row & 7)) << 4) + 4 * c;
                    asm volatile("st.shared.b32 [%0], %1;" :: "r"(at),
                                 "r"(fl_pack(dpt[n][2 * r], dpt[n][2 * r + 1])) : "memory");
                }
            }
            wg_smem_fence();
            // This warpgroup's last reduction has read its staging half (long since, as a
            // rule): the half is written again below, after the barrier.
            if ((tid & 127) == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            __syncthreads();  // both warpgroups' rows: dQ's product reads all 128 keys
            wg_fence();
            // dQ[:, 64·wg …] = dS · K[:, 64·wg …]: dS MN-major (transposed) from the tile, K's
            // column half wg MN-major. First, so that dK's product runs on while dQ's terms
            // go out.
            float dq[8][4];
            const unsigned tK = sK + wg * BK * 128;
            wg_ss64z<1, 1>(dq, wg_ndesc(sDS, BK, 0), wg_ndesc(tK, BK, 0));
#pragma unroll
            for (int j = 1; j < BK / 16; ++j)
                wg_ss64<1, 1>(dq, wg_ndesc(sDS, BK, j), wg_ndesc(tK, BK, j), 1);
            wg_commit();
            const unsigned tDS = sDS + wg * 64 * 128;  // this warpgroup's keys, K-major for dK
#pragma unroll
            for (int j = 0; j < BQ / 16; ++j)
                wg_ss128<1>(dk, wg_kdesc(tDS, 64, j), wg_ndesc(tQ, BQ, j), 1);
            wg_commit();
            wg_wait<1>();
            wg_hold<8>(dq);
            // Staged in fragment order, [warp][n][r][g][c] float2s (a warp's stores of one
            // (n, r) are 256 contiguous bytes: no bank conflicts), which is also the order of
            // the tile in p.dqacc (flash_dq_rows90 reads it so); then reduced into p.dqacc by
            // the copy engine, 16 KB a warpgroup, while the next pair runs.
            const unsigned half = sAcc + wg * 16384;
#pragma unroll
            for (int n = 0; n < 8; ++n)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const unsigned at = half + ((((warp * 8 + n) * 2 + r) * 8 + g) * 4 + c) * 8;
                    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" :: "r"(at),
                                 "f"(dq[n][2 * r]), "f"(dq[n][2 * r + 1]) : "memory");
                }
            wg_smem_fence();
            asm volatile("bar.sync %0, 128;" :: "r"(1 + wg) : "memory");
            if ((tid & 127) == 0) {
                const int h = kh * grp + it / nq, tiles = (T + BQ - 1) / BQ;
                const float* dst = p.dqacc + (((long)(b * p.H + h) * tiles + q0 / BQ) * 2 + wg) * 4096;
                asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], 16384;\n"
                             "cp.async.bulk.commit_group;" :: "l"(dst), "r"(half) : "memory");
            }
        } else {
#pragma unroll
            for (int j = 0; j < BQ / 16; ++j) fl_a_from_c(da[j], dpt[2 * j], dpt[2 * j + 1]);
            wg_fence();
#pragma unroll
            for (int j = 0; j < BQ / 16; ++j) wg_rs128<1>(dk, da[j], wg_ndesc(tQ, BQ, j), 1);
            wg_commit();
        }
    };
    wg_pipeline(iters, issue_sdp, process, prefetch);
    wg_wait<0>();
    wg_hold<DN>(dv);
    wg_hold<DN>(dk);
    // The reductions are done (their reads of shared memory, and their writes) before exit.
    if (DQ && (tid & 127) == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    const long rope = (long)b * T * (D / 2);
    fl_store_rows<D>(p.dk + b * p.sdk[0] + kh * p.sdk[1], p.sdk[2], dk, kj0, T, p.scale,
                     p.rc ? p.rc + rope : nullptr, p.rs ? p.rs + rope : nullptr, c);
    fl_store_rows<D>(p.dv + b * p.sv[0] + kh * p.sv[1], p.sv[2], dv, kj0, T, 1.f, nullptr, nullptr, c);
}

extern "C" __global__ void __launch_bounds__(256, 1) flash_dq90_d128(const FlashP p) { flash_dq90<128>(p); }
extern "C" __global__ void __launch_bounds__(256, 1) flash_dq90_d256(const FlashP p) { flash_dq90<256>(p); }
extern "C" __global__ void __launch_bounds__(256, 1) flash_dkdv90_d128(const FlashP p) { flash_dkdv90<false>(p); }
extern "C" __global__ void __launch_bounds__(256, 1) flash_bwd90_d128(const FlashP p) { flash_dkdv90<true>(p); }

// This warp's rows of a [64 × 32] accumulator (C order) into columns 32·w … of a swizzled bf16
// tile [64 × 64], a row of 128 bytes each: chunk n of row r at r·128 + (n ^ r % 8)·16.
__device__ __forceinline__ void sw_put32(unsigned tile, const float (*v)[4], int w, int warp, int g, int c) {
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const unsigned row = warp * 16 + g + 8 * r;
            const unsigned at = tile + row * 128 + (((4 * w + n) ^ (row & 7)) << 4) + 4 * c;
            asm volatile("st.shared.b32 [%0], %1;" :: "r"(at), "r"(fl_pack(v[n][2 * r], v[n][2 * r + 1])) : "memory");
        }
}

__device__ __forceinline__ void wg_bar(int id) { asm volatile("bar.sync %0, 256;" :: "r"(id) : "memory"); }

// Head dim 256 (Gemma 2 and 3): dK and dV of 64 keys a block, over every query head of the kv
// head in tiles of 64 queries, Q and dO twice buffered (tiles as sw_load_d lays them out).
//
// The 64 keys' full dK and dV rows would take 256 accumulator registers a thread, so each
// warpgroup accumulates one 128-column half of both, for all 64 keys, and the two split the
// scores by queries: warpgroup w makes Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ of the tile's queries
// 32w … 32w + 31, and their P and dS (soft-capped, masked). Pᵀ and dSᵀ go to shared tiles
// [64 keys × 64 queries] (a swizzled 128-byte row a key) that both read K-major:
// dV[:, half] += Pᵀ·dO[:, half] (issued once P is out, running while dS goes out) and
// dK[:, half] += dSᵀ·Q[:, half]. Every product is made once. At the end warpgroup 1 hands its
// dK half to warpgroup 0, which stores whole rows (RoPE's backward pairs column j with
// j + 128). Sums run in a fixed order: deterministic.
__device__ __forceinline__ void flash_dkdv90_256(const FlashP& p) {
    constexpr int D = 256, BK = 64, BQ = 64, KT = BK * D * 2, QT = BQ * D * 2, PT = BK * BQ * 2;
    const unsigned raw = fl_smem(flash90_smem), base = (raw + 1023) & ~1023u;
    const unsigned sK = base, sV = sK + KT, sQ = sV + KT, sO = sQ + 2 * QT;  // sQ, sO: [2]
    const unsigned sP = sO + 2 * QT, sDS = sP + PT;  // Pᵀ, dSᵀ [BK][BQ] bf16
    float* sL = (float*)(flash90_smem + (sDS + PT - raw));  // [2][BQ] L
    float* sD = sL + 2 * BQ;                                 // [2][BQ] δ
    unsigned* sSeg = (unsigned*)(sD + 2 * BQ);               // [2][BQ]
    const int T = p.T, b = blockIdx.y / p.KH, kh = blockIdx.y % p.KH, grp = p.H / p.KH;
    const int k0 = blockIdx.x * BK;
    const int tid = threadIdx.x, wg = tid >> 7, t = tid & 127, warp = t >> 5, l = tid & 31;
    const int g = l >> 2, c = l & 3;
    const float sc = p.scale * FLASH_LOG2E, kt = p.softcap != 0.f ? p.scale / p.softcap : 0.f;
    const int qend = fl_query_end<BK>(p, b, k0);
    const int nq = (qend - k0 + BQ - 1) / BQ, iters = grp * nq;  // (query head, query tile) pairs
    auto q0_of = [&](int it) { return k0 + (it % nq) * BQ; };
    auto prefetch = [&](int it) {  // pair it into buffer it % 2
        const int h = kh * grp + it / nq, q0 = q0_of(it), buf = it & 1;
        sw_load_d<256, BQ>(sQ + buf * QT, p.q + b * p.sq[0] + h * p.sq[1], p.sq[2], q0, T);
        sw_load_d<256, BQ>(sO + buf * QT, p.o + b * p.so[0] + h * p.so[1], p.so[2], q0, T);
        if (tid < BQ) {  // as flash_dkdv90's
            const long row = ((long)b * p.H + h) * T;
            const int i = q0 + tid;
            const bool ok = i < T;
            fl_cp4(sL + buf * BQ + tid, ok ? p.lse + row + i : p.lse, ok);
            fl_cp4(sD + buf * BQ + tid, ok ? p.delta + row + i : p.delta, ok);
            if (p.seg) fl_cp4(sSeg + buf * BQ + tid, p.seg + (long)b * T + i, ok);
            else sSeg[buf * BQ + tid] = 0u;
        }
        fl_commit();
    };
    sw_load_d<256, BK>(sK, p.k + b * p.sk[0] + kh * p.sk[1], p.sk[2], k0, T);
    sw_load_d<256, BK>(sV, p.v + b * p.sv[0] + kh * p.sv[1], p.sv[2], k0, T);
    fl_commit();
    if (iters > 0) prefetch(0);
    const int kj0 = k0 + warp * 16 + g;  // this thread's keys kj0 and kj0 + 8 (either warpgroup)
    const unsigned sg0 = fl_seg(p, b, kj0), sg1 = fl_seg(p, b, kj0 + 8);
    const unsigned half = 2 * wg * BQ * 128;  // this warpgroup's columns in a Q or dO tile
    const int qw = 32 * wg;                   // this warpgroup's queries in a tile
    float dk[16][4], dv[16][4], s[4][4], dp[4][4];
#pragma unroll
    for (int n = 0; n < 16; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;
    wg_hold<16>(dk);  // the zeros are written here, before any wgmma is in flight
    wg_hold<16>(dv);
    for (int it = 0; it < iters; ++it) {
        const int buf = it & 1, q0 = q0_of(it) + qw;
        const unsigned tQ = sQ + buf * QT, tO = sO + buf * QT;
        const float* tL = sL + buf * BQ + qw;
        const float* tD = sD + buf * BQ + qw;
        // Pair it's tiles are in, and both warpgroups are past pair it − 1's products: its
        // buffer takes pair it + 1.
        fl_wait_all();
        wg_smem_fence();
        __syncthreads();
        if (it + 1 < iters) prefetch(it + 1);
        // Sᵀ and dPᵀ: rows this block's 64 keys, columns this warpgroup's 32 queries
        wg_fence();
        wg_product<32, 16>(s, sK, BK, tQ + qw * 128, BQ);
        wg_product<32, 16>(dp, sV, BK, tO + qw * 128, BQ);
        wg_wait<0>();
        wg_hold<4>(s);
        wg_hold<4>(dp);
        if (p.softcap != 0.f) fl_softcap<32>(s, p.scale, p.softcap);
        if (p.seg || p.window != 0 || q0 < k0 + warp * 16 + 15 || q0 + 32 > T)
            fl_mask_t<32>(p, s, q0, kj0, sg0, sg1, sSeg + buf * BQ + qw, c);
        // P = exp(scale·S − L), 0 where masked; dS = P ⊙ (dP − δ), with the cap's derivative
        // 1 − t² (in flash.cu's order of rounding)
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = n * 8 + 2 * c + (e & 1);
                const float pr = fl_exp2(fmaf(s[n][e], sc, -tL[col] * FLASH_LOG2E));
                const float f = p.softcap != 0.f ? pr * fl_softcap_d(s[n][e], kt) : pr;
                dp[n][e] = f * (dp[n][e] - tD[col]);
                s[n][e] = pr;
            }
        sw_put32(sP, s, wg, warp, g, c);
        wg_smem_fence();
        wg_bar(1);  // both warpgroups' Pᵀ columns are out
        wg_fence();
#pragma unroll
        for (int j = 0; j < BQ / 16; ++j) wg_ss128<1>(dv, wg_kdesc(sP, BK, j), wg_ndesc(tO + half, BQ, j), 1);
        wg_commit();
        sw_put32(sDS, dp, wg, warp, g, c);  // while dV's product runs
        wg_smem_fence();
        wg_bar(2);  // both warpgroups' dSᵀ columns are out
        wg_fence();
#pragma unroll
        for (int j = 0; j < BQ / 16; ++j) wg_ss128<1>(dk, wg_kdesc(sDS, BK, j), wg_ndesc(tQ + half, BQ, j), 1);
        wg_commit();
        wg_wait<0>();
        wg_hold<16>(dv);
        wg_hold<16>(dk);
    }
    fl_wait_all();
    fl_store_rows<128>(p.dv + b * p.sv[0] + kh * p.sv[1] + wg * 128, p.sv[2], dv, kj0, T, 1.f, nullptr, nullptr, c);
    // warpgroup 1's dK half, in fragment order, over the Q tiles (read by no one now)
    float* xK = (float*)(flash90_smem + (sQ - raw));
    __syncthreads();
    if (wg == 1) {
#pragma unroll
        for (int n = 0; n < 16; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) xK[(n * 4 + e) * 128 + t] = dk[n][e];
    }
    __syncthreads();
    if (wg == 0) {
        float full[32][4];
#pragma unroll
        for (int n = 0; n < 16; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                full[n][e] = dk[n][e];
                full[16 + n][e] = xK[(n * 4 + e) * 128 + t];
            }
        const long rope = (long)b * T * (D / 2);
        fl_store_rows<D>(p.dk + b * p.sdk[0] + kh * p.sdk[1], p.sdk[2], full, kj0, T, p.scale,
                         p.rc ? p.rc + rope : nullptr, p.rs ? p.rs + rope : nullptr, c);
    }
}

extern "C" __global__ void __launch_bounds__(256, 1) flash_dkdv90_d256(const FlashP p) { flash_dkdv90_256(p); }

// After flash_bwd90: dq = scale · p.dqacc as rows of dq's layout (p.sdq), rotated back by
// RoPE's angle when p.rc is given (as fl_store_rows does). p.dqacc holds [B, H, ⌈T/64⌉] tiles
// of 64 rows × 128, each two column halves of 4096 floats in flash_bwd90's fragment order
// [warp][n][r][g][c] float2s. A block takes a tile: read in that order into a row-major
// shared copy, then written a row a warp (columns 2j, 2j + 1 and their RoPE partners 64 on).
extern "C" __global__ void __launch_bounds__(256) flash_dq_rows90(const FlashP p) {
    constexpr int H2 = 64, RS = 128 + 4;  // row stride of the shared copy, in floats
    __shared__ float rows[64 * RS];
    const long tile = blockIdx.x;  // (b·H + h)·⌈T/64⌉ + q0 / 64
    const float2* acc = (const float2*)(p.dqacc + tile * 8192);
#pragma unroll 4
    for (int k = 0; k < 16; ++k) {
        const int j = k * 256 + threadIdx.x, half = j >> 11, f = j & 2047;
        const int c = f & 3, g = (f >> 2) & 7, r = (f >> 5) & 1, n = (f >> 6) & 7, warp = f >> 9;
        *(float2*)(rows + (warp * 16 + g + 8 * r) * RS + half * H2 + n * 8 + 2 * c) = acc[j];
    }
    __syncthreads();
    const int tiles = (p.T + 63) / 64, bh = (int)(tile / tiles), h = bh % p.H, b = bh / p.H;
    const int col = 2 * (threadIdx.x & 31);
#pragma unroll 2
    for (int k = 0; k < 8; ++k) {
        const int row = k * 8 + (threadIdx.x >> 5), t = (int)(tile % tiles) * 64 + row;
        if (t >= p.T) break;
        const float2 a = *(const float2*)(rows + row * RS + col);
        const float2 e = *(const float2*)(rows + row * RS + H2 + col);
        const float a0 = a.x * p.scale, a1 = a.y * p.scale, b0 = e.x * p.scale, b1 = e.y * p.scale;
        bf16_t* out = p.dq + b * p.sdq[0] + h * p.sdq[1] + t * p.sdq[2];
        if (p.rc) {
            const long rr = ((long)b * p.T + t) * H2 + col;
            const float2 cv = *(const float2*)(p.rc + rr), sv = *(const float2*)(p.rs + rr);
            *(unsigned*)(out + col) = fl_pack(a0 * cv.x + b0 * sv.x, a1 * cv.y + b1 * sv.y);
            *(unsigned*)(out + col + H2) = fl_pack(b0 * cv.x - a0 * sv.x, b1 * cv.y - a1 * sv.y);
        } else {
            *(unsigned*)(out + col) = fl_pack(a0, a1);
            *(unsigned*)(out + col + H2) = fl_pack(b0, b1);
        }
    }
}

// ---- The forward, warp-specialized (FA3's structure), for plain causal attention ----
//
// A block is two consumer warpgroups (64 query rows each, as flash_fwd90) and a producer
// warpgroup, which gives its registers to the consumers (setmaxnreg: 24 against 240 a thread;
// the block is compiled to 168). One producer thread loads Q once and K, V tiles two stages
// deep with the tensor memory
// accelerator (cp.async.bulk.tensor, 128-byte swizzle: the layout the wgmma descriptors read),
// each stage's arrival counted by an mbarrier ("full"); the consumers free a stage through
// another ("empty"). No block barrier after the start: the two warpgroups run apart, so one's
// softmax overlaps the other's products.

// A CUtensorMap (the driver's 128-byte opaque descriptor), passed by value.
struct __align__(64) Tmap { unsigned long long v[16]; };
// The three maps and, for each, the slots of t, h and b among its three outer dims (the host
// orders a map's dims by stride).
struct __align__(64) Tmaps { Tmap q, k, v; int ord[3][3]; };

__device__ __forceinline__ void mb_init(unsigned a, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(a), "r"(count) : "memory");
}
__device__ __forceinline__ void mb_expect(unsigned a, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(a), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mb_arrive(unsigned a) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(a) : "memory");
}
// Waits until the phase of parity `par` of the barrier at a has completed.
__device__ __forceinline__ void mb_wait(unsigned a, unsigned par) {
    asm volatile("{\n.reg .pred P;\nWAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n"
                 "@P bra DONE;\nbra WAIT;\nDONE:\n}" :: "r"(a), "r"(par) : "memory");
}
// Starts the tensor copy of the box at (d0, the three outer coordinates) into shared dst,
// its bytes counted on the barrier mb.
__device__ __forceinline__ void tma_load(unsigned dst, const Tmap* m, int d0, int c1, int c2, int c3,
                                         unsigned mb) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];"
                 :: "r"(dst), "l"(m), "r"(d0), "r"(c1), "r"(c2), "r"(c3), "r"(mb) : "memory");
}
// Rows [t0, t0 + 128) of head h of batch row b as a swizzled tile at dst: two boxes of 64
// columns (the 128-byte swizzle's widest), rows past T zero-filled by the copy engine.
__device__ __forceinline__ void tma_tile(unsigned dst, const Tmap* m, const int* ord, int t0, int h,
                                         int b, unsigned mb) {
    int c[3];
#pragma unroll
    for (int i = 0; i < 3; ++i) c[i] = (ord[0] == i ? t0 : 0) + (ord[1] == i ? h : 0) + (ord[2] == i ? b : 0);
    tma_load(dst, m, 0, c[0], c[1], c[2], mb);
    tma_load(dst + 128 * 128, m, 64, c[0], c[1], c[2], mb);
}

// Masks keys past each query and queries past T (the causal mask alone).
template<int N>
__device__ __forceinline__ void fl_mask_causal(float (*s)[4], int i0, int j0, int T, int c) {
#pragma unroll
    for (int n = 0; n < N / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = i0 + (e < 2 ? 0 : 8), j = j0 + n * 8 + 2 * c + (e & 1);
            if (!((j <= i) & (i < T))) s[n][e] = FLASH_NEG_INF;
        }
    }
}

__device__ __forceinline__ void flash_fwd90ws_consumer(const FlashP& p, const Tmaps& tm, unsigned base,
                                                       int q0, int ntiles);

__device__ __forceinline__ void flash_fwd90ws(const FlashP& p, const Tmaps& tm) {
    constexpr int D = 128, BQ = 128, BK = 128, TILE = BK * D * 2;
    const unsigned raw = fl_smem(flash90_smem), base = (raw + 1023) & ~1023u;
    const unsigned sQ = base, sK = sQ + TILE, sV = sK + 2 * TILE;  // sK [2], sV [2]
    // mbarriers: Q full; K full, V full, K empty, V empty, two stages each.
    const unsigned mQ = sV + 2 * TILE, mKf = mQ + 8, mVf = mKf + 16, mKe = mVf + 16, mVe = mKe + 16;
    const int T = p.T, bh = blockIdx.y, b = bh / p.H, h = bh % p.H, kh = h / (p.H / p.KH);
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;  // the longest rows first
    const int tid = threadIdx.x, warp = tid >> 5, l = tid & 31;
    const int ntiles = (min(T, q0 + BQ) + BK - 1) / BK;
    if (tid == 0) {
        mb_init(mQ, 1);
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            mb_init(mKf + 8 * s, 1);
            mb_init(mVf + 8 * s, 1);
            mb_init(mKe + 8 * s, 256);  // every consumer thread
            mb_init(mVe + 8 * s, 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp >= 8) {  // the producer warpgroup: one thread issues every copy
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;" ::: "memory");
        if (warp == 8 && l == 0) {
            mb_expect(mQ, TILE);
            tma_tile(sQ, &tm.q, tm.ord[0], q0, h, b, mQ);
            for (int j = 0; j < ntiles; ++j) {
                const int s = j & 1;
                const unsigned par = ((j >> 1) - 1) & 1;  // the stage's last release
                if (j >= 2) mb_wait(mKe + 8 * s, par);
                mb_expect(mKf + 8 * s, TILE);
                tma_tile(sK + s * TILE, &tm.k, tm.ord[1], j * BK, kh, b, mKf + 8 * s);
                if (j >= 2) mb_wait(mVe + 8 * s, par);
                mb_expect(mVf + 8 * s, TILE);
                tma_tile(sV + s * TILE, &tm.v, tm.ord[2], j * BK, kh, b, mVf + 8 * s);
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 240;" ::: "memory");
        flash_fwd90ws_consumer(p, tm, base, q0, ntiles);
    }
}

// The consumers' side of flash_fwd90ws: S = Q·Kᵀ and O += P·V as flash_fwd90, each stage
// waited for on its full barrier and released on its empty one.
__device__ __forceinline__ void flash_fwd90ws_consumer(const FlashP& p, const Tmaps& tm, unsigned base,
                                                       int q0, int ntiles) {
    constexpr int D = 128, BQ = 128, BK = 128, TILE = BK * D * 2, DN = D / 8;
    const unsigned sQ = base, sK = sQ + TILE, sV = sK + 2 * TILE;
    const unsigned mQ = sV + 2 * TILE, mKf = mQ + 8, mVf = mKf + 16, mKe = mVf + 16, mVe = mKe + 16;
    const int T = p.T, bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
    const int tid = threadIdx.x, warp = tid >> 5, l = tid & 31;
    const int wg = tid >> 7, g = l >> 2, c = l & 3, wq = warp & 3;
    const float sc = p.scale * FLASH_LOG2E;
    const int w0 = q0 + 64 * wg;  // this warpgroup's first query
    const int qi0 = w0 + wq * 16 + g;
    float o[DN][4], s[BK / 8][4];
#pragma unroll
    for (int n = 0; n < DN; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    wg_hold<DN>(o);
    unsigned pf[BK / 16][4];  // P of the tile whose P·V is next
    float m0 = FLASH_NEG_INF, m1 = FLASH_NEG_INF, l0 = 0.f, l1 = 0.f, cr0 = 1.f, cr1 = 1.f;
    auto issue_s = [&](int j) {
        mb_wait(mKf + 8 * (j & 1), (j >> 1) & 1);
        wg_fence();
        wg_product<BK>(s, sQ + wg * 64 * 128, BQ, sK + (j & 1) * TILE);
    };
    auto softmax = [&](int j) {
        const int k0 = j * BK;
        if (k0 + BK - 1 > w0 + wq * 16) fl_mask_causal<BK>(s, qi0, k0, T, c);
        fl_online_softmax<BK>(s, sc, m0, m1, l0, l1, cr0, cr1);
    };
    auto pv = [&](int j) {  // O += P·V of tile j (P in pf)
        mb_wait(mVf + 8 * (j & 1), (j >> 1) & 1);
        wg_fence();
#pragma unroll
        for (int jj = 0; jj < BK / 16; ++jj)
            wg_rs128<1>(o, pf[jj], wg_ndesc(sV + (j & 1) * TILE, BK, jj), 1);
        wg_commit();
    };
    auto keep_p = [&]() {
#pragma unroll
        for (int jj = 0; jj < BK / 16; ++jj) fl_a_from_c(pf[jj], s[2 * jj], s[2 * jj + 1]);
    };
    mb_wait(mQ, 0);
    issue_s(0);
    wg_wait<0>();
    wg_hold<BK / 8>(s);
    mb_arrive(mKe);  // K of tile 0 is read
    softmax(0);
    keep_p();
    for (int j = 1; j < ntiles; ++j) {
        issue_s(j);
        pv(j - 1);
        wg_wait<1>();  // S of tile j; P·V of tile j − 1 runs on through the softmax
        wg_hold<BK / 8>(s);
        mb_arrive(mKe + 8 * (j & 1));
        softmax(j);
        wg_wait<0>();
        wg_hold<DN>(o);
        mb_arrive(mVe + 8 * ((j - 1) & 1));
#pragma unroll
        for (int n = 0; n < DN; ++n) {
            o[n][0] *= cr0; o[n][1] *= cr0; o[n][2] *= cr1; o[n][3] *= cr1;
        }
        keep_p();
    }
    pv(ntiles - 1);
    wg_wait<0>();
    wg_hold<DN>(o);
    fl_store_o<D>(p, o, b, h, qi0, m0, m1, l0, l1, c);
}

extern "C" __global__ void __launch_bounds__(384, 1)
flash_fwd90ws_d128(const FlashP p, const __grid_constant__ Tmaps tm) { flash_fwd90ws(p, tm); }
