// The blockwise attention's kernels (ops::attention): the masked softmax of a score block in
// two passes (log-sum-exp, then the probabilities), its backward, the running sums of the
// blocks' products, and δ = rowsum(dO ⊙ O).

// tree: the ids are prefix-tree ids (example << 2 | branch; ops::attention::AttnMask): a query
// also sees its example's branch-0 keys (the shared prefix).
__device__ __forceinline__ bool allowed(const unsigned int* seg, long b, int t, int i, int j,
                                        int window, int tree) {
    if (j > i || (window > 0 && i - j >= window)) return false;
    if (!seg) return true;
    const unsigned si = seg[b * t + i], sj = seg[b * t + j];
    return si == sj || (tree && (si >> 2) == (sj >> 2) && (sj & 3u) == 0u);
}

// A raw score as the softmax takes it: scaled, and soft-capped where cap > 0 (Gemma 2).
__device__ __forceinline__ float score(float s, float scale, float cap) {
    return cap > 0.f ? cap * tanhf(s * scale / cap) : s * scale;
}

// Attention block rows: s [R, e] with R = B·H·bq; row r is query i = q_off + r % bq of batch
// b = r / (H·bq). One thread block per row.
template <typename T>
__device__ void masked_lse(const T* s, float* lse, const unsigned int* seg, int h, int bq, int e,
                           int t, int q_off, int window, int tree, float scale, float cap) {
    long row = blockIdx.x;
    int i = q_off + row % bq;
    long b = row / ((long)h * bq);
    const T* sr = s + row * e;
    float m = __int_as_float(0xff800000);
    for (int j = threadIdx.x; j < e; j += blockDim.x)
        if (allowed(seg, b, t, i, j, window, tree)) m = fmaxf(m, score(ld(sr, j), scale, cap));
    m = block_max(m);
    float sum = 0.f;
    for (int j = threadIdx.x; j < e; j += blockDim.x)
        if (allowed(seg, b, t, i, j, window, tree)) sum += __expf(score(ld(sr, j), scale, cap) - m);
    sum = block_sum(sum);
    if (threadIdx.x == 0) lse[row] = m + logf(sum);
}

template <typename T>
__device__ void masked_exp(const T* s, const float* lse, T* p, const unsigned int* seg, int h,
                           int bq, int e, int t, int q_off, int window, int tree, float scale,
                           float cap) {
    long row = blockIdx.x;
    int i = q_off + row % bq;
    long b = row / ((long)h * bq);
    float l = lse[row];
    for (int j = threadIdx.x; j < e; j += blockDim.x)
        st(p + row * e, j,
           allowed(seg, b, t, i, j, window, tree) ? __expf(score(ld(s + row * e, j), scale, cap) - l) : 0.f);
}

// ds = scale · p ⊙ (dp − δ[row]); elementwise over n = R·e.
template <typename T>
__device__ void softmax_bwd(const T* p, const T* dp, const float* delta, T* ds, int e, float scale, long n) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    st(ds, k, ld(p, k) * (ld(dp, k) - delta[k / e]) * scale);
}
// softmax_bwd through the soft-cap: × (1 − tanh²(scale · s / cap)), s the raw scores.
template <typename T>
__device__ void softmax_bwd_cap(const T* p, const T* dp, const float* delta, const T* s, T* ds,
                                int e, float scale, float cap, long n) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    float th = tanhf(ld(s, k) * scale / cap);
    st(ds, k, ld(p, k) * (ld(dp, k) - delta[k / e]) * scale * (1.f - th * th));
}

// out [R, bk, D] f32 = sum (or 0) + part[R, ks..ks+bk, D] of part [R, e, D]; n = R·bk·D.
template <typename T>
__device__ void acc_block(const float* sum, const T* part, float* out, long n, int e, int d,
                          int ks, int bk) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    long per = (long)bk * d;
    long r = k / per, rem = k % per;
    float v = ld(part, (r * e + ks) * d + rem);
    out[k] = sum ? sum[k] + v : v;
}

// δ[(b·H + h)·T + t] = Σ_d dO[m, h·D + d] · O[m, h·D + d], m = b·T + t: rows of [B·T, H·D],
// one warp per (m, h).
template <typename T>
__device__ void row_dot(const T* g, const T* o, float* delta, long mh, int h, int t, int d) {
    long w = ((long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (w >= mh) return;
    long m = w / h;
    int hh = w % h;
    const T* gr = g + m * (long)h * d + (long)hh * d;
    const T* orow = o + m * (long)h * d + (long)hh * d;
    float s = 0.f;
    for (int i = lane; i < d; i += 32) s += ld(gr, i) * ld(orow, i);
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffff, s, off);
    if (lane == 0) {
        long b = m / t;
        int ti = m % t;
        delta[(b * h + hh) * t + ti] = s;
    }
}

#define ATTENTION_INST(NAME, T) \
extern "C" __global__ void masked_lse_##NAME(const T* s, float* lse, const unsigned int* seg, \
    int h, int bq, int e, int t, int q_off, int window, int tree, float scale, float cap) \
    { masked_lse<T>(s, lse, seg, h, bq, e, t, q_off, window, tree, scale, cap); } \
extern "C" __global__ void masked_exp_##NAME(const T* s, const float* lse, T* p, \
    const unsigned int* seg, int h, int bq, int e, int t, int q_off, int window, int tree, \
    float scale, float cap) \
    { masked_exp<T>(s, lse, p, seg, h, bq, e, t, q_off, window, tree, scale, cap); } \
extern "C" __global__ void softmax_bwd_##NAME(const T* p, const T* dp, const float* delta, T* ds, \
    int e, float scale, long n) { softmax_bwd<T>(p, dp, delta, ds, e, scale, n); } \
extern "C" __global__ void softmax_bwd_cap_##NAME(const T* p, const T* dp, const float* delta, \
    const T* s, T* ds, int e, float scale, float cap, long n) \
    { softmax_bwd_cap<T>(p, dp, delta, s, ds, e, scale, cap, n); } \
extern "C" __global__ void acc_block_##NAME(const float* sum, const T* part, float* out, long n, \
    int e, int d, int ks, int bk) { acc_block<T>(sum, part, out, n, e, d, ks, bk); } \
extern "C" __global__ void row_dot_##NAME(const T* g, const T* o, float* delta, long mh, int h, \
    int t, int d) { row_dot<T>(g, o, delta, mh, h, t, d); }
ATTENTION_INST(f32, float)
ATTENTION_INST(bf16, bf16_t)
#undef ATTENTION_INST
