// Many tensors in one launch (the optimiser's step over hundreds of small adapters would
// otherwise be a dozen launches per tensor, and the GPU would wait on the host for each).
// After common.cuh in the one program (ops::cuda; block_sum is from there). Block (x, y) works on tensor y, its
// elements x·blockDim + i strided by gridDim.x·blockDim.

struct MultiT { float* p; const float* g; float* m; float* v; long n; };

// AdamW as torch.optim.AdamW, with every rounding of the tensor-op version (AdamW::step on
// other devices): g ← g·coef (clipping; coef = 1: none); m ← β1·m + (1−β1)·g;
// v ← β2·v + (1−β2)·g²; p ← p·(1 − lr·wd) − (m / (√v·(1/√bc2) + ε))·(lr/bc1).
__device__ __forceinline__ void adamw_one(const MultiT& t, float coef, float decay, float b1,
                                          float nb1, float b2, float nb2, float inv_bc2,
                                          float eps, float step) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < t.n; i += (long)gridDim.x * blockDim.x) {
        float g = t.g[i];
        if (coef != 1.f) g = __fmul_rn(g, coef);
        const float m = __fadd_rn(__fmul_rn(t.m[i], b1), __fmul_rn(g, nb1));
        const float v = __fadd_rn(__fmul_rn(t.v[i], b2), __fmul_rn(__fmul_rn(g, g), nb2));
        const float den = __fadd_rn(__fmul_rn(__fsqrt_rn(v), inv_bc2), eps);
        t.p[i] = __fsub_rn(__fmul_rn(t.p[i], decay), __fmul_rn(__fdiv_rn(m, den), step));
        t.m[i] = m;
        t.v[i] = v;
    }
}
extern "C" __global__ void adamw_multi(const MultiT* ts, float coef, float decay, float b1,
                                       float nb1, float b2, float nb2, float inv_bc2, float eps,
                                       float step) {
    adamw_one(ts[blockIdx.y], coef, decay, b1, nb1, b2, nb2, inv_bc2, eps, step);
}
// The same with the clipping read from the device (`clip_step`'s [‖g‖, coef, skip]): no host
// round trip between the gradients and the update; skip ≠ 0 leaves every tensor as it is.
extern "C" __global__ void adamw_multi_clip(const MultiT* ts, const float* clip, float decay,
                                            float b1, float nb1, float b2, float nb2,
                                            float inv_bc2, float eps, float step) {
    if (clip[2] != 0.f) return;
    adamw_one(ts[blockIdx.y], clip[1], decay, b1, nb1, b2, nb2, inv_bc2, eps, step);
}

// From sumsq_multi's n partial sums: out = [‖g‖, coef, skip] with ‖g‖ = √(Σ partials in f64),
// coef = min(1, max_norm / (‖g‖ + 1e-6)) (1 when max_norm ≤ 0), skip = 1 when ‖g‖ or the
// step's Σ CE (`ce`, may be null) is not finite, coef then 0. One block of 256: thread i sums
// partials i, i + 256, ... in order, then a fixed tree: the same bits from run to run.
extern "C" __global__ void clip_step(const float* part, long n, const float* ce,
                                     double max_norm, float* out) {
    __shared__ double s[256];
    double a = 0.0;
    for (long i = threadIdx.x; i < n; i += 256) a += (double)part[i];
    s[threadIdx.x] = a;
    __syncthreads();
    for (int w = 128; w > 0; w >>= 1) {
        if (threadIdx.x < w) s[threadIdx.x] += s[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x != 0) return;
    const double norm = sqrt(s[0]);
    const bool finite = isfinite(norm) && (ce == nullptr || isfinite(*ce));
    const double coef = max_norm > 0.0 ? fmin(max_norm / (norm + 1e-6), 1.0) : 1.0;
    out[0] = (float)norm;
    out[1] = finite ? (float)coef : 0.f;
    out[2] = finite ? 0.f : 1.f;
}

// Σ g² of tensor y's share of block x → out[y·gridDim.x + x] (summed in f64 on the host, in
// this fixed order: the norm is the same from run to run).
extern "C" __global__ void sumsq_multi(const MultiT* ts, float* out) {
    const MultiT t = ts[blockIdx.y];
    float s = 0.f;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < t.n; i += (long)gridDim.x * blockDim.x)
        s += t.g[i] * t.g[i];
    s = block_sum(s);
    if (threadIdx.x == 0) out[blockIdx.y * gridDim.x + blockIdx.x] = s;
}

// bf16 copies of f32 tensors: tensor y's g (f32, read) rounded to nearest even into its p
// (bf16 storage, written), as a cast would.
extern "C" __global__ void cast_multi_bf16(const MultiT* ts) {
    const MultiT t = ts[blockIdx.y];
    bf16_t* dst = (bf16_t*)t.p;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < t.n; i += (long)gridDim.x * blockDim.x)
        st(dst, i, t.g[i]);
}

// Tensor y's n f32 values (rows of t.m elements, as stored) rounded to bf16 into rows t.v
// elements apart from its p: the adapters' B's into their columns of the padded frozen weights
// (ops::fold). m and v carry counts here, not addresses.
extern "C" __global__ void cast_rows_multi_bf16(const MultiT* ts) {
    const MultiT t = ts[blockIdx.y];
    bf16_t* dst = (bf16_t*)t.p;
    const long w = (long)t.m, ld = (long)t.v;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < t.n; i += (long)gridDim.x * blockDim.x)
        st(dst, (i / w) * ld + i % w, t.g[i]);
}
