// RoPE and the layout changes between token-major rows and heads (ops::rope).

// x, y: [B, H, T, D]; cos, sin: [B, T, D/2] f32. One thread per rotated pair.
template <typename T>
__device__ void rope(const T* x, const float* cos, const float* sin, T* y,
                     int h, int t, int half, long pairs) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= pairs) return;
    int i = k % half;
    long rest = k / half;
    int ti = rest % t;
    long bh = rest / t;
    long b = bh / h;
    long base = rest * 2 * half;
    long cs = (b * t + ti) * half + i;
    float x1 = ld(x, base + i), x2 = ld(x, base + i + half), c = cos[cs], s = sin[cs];
    st(y, base + i, x1 * c - x2 * s);
    st(y, base + i + half, x2 * c + x1 * s);
}

// Head-major row `rest` = (b·H + h)·T + t of d elements: its start in [B, H, T, D] and in
// token-major rows [B·T, H·D], as (src, dst) for the direction; and its token b·T + t.
__device__ __forceinline__ void relayout_row(long rest, int h, int t, long d, int to_heads,
                                             long* src, long* dst, long* token) {
    int ti = rest % t;
    long bh = rest / t;
    int hh = bh % h;
    long b = bh / h;
    long heads = rest * d;
    long rows = ((b * t + ti) * h + hh) * d;
    *src = to_heads ? rows : heads;
    *dst = to_heads ? heads : rows;
    *token = b * t + ti;
}

// Token-major rows [B·T, H·D] <-> head-major [B, H, T, D], rotating by sign·θ when cos is
// given. One thread per rotated pair, indexed in head-major order.
template <typename T>
__device__ void relayout(const T* x, const float* cos, const float* sin, T* y, int h, int t,
                         int half, long pairs, int to_heads, float sign) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= pairs) return;
    int i = k % half;
    long src, dst, token;
    relayout_row(k / half, h, t, 2 * half, to_heads, &src, &dst, &token);
    float x1 = ld(x, src + i), x2 = ld(x, src + i + half);
    if (cos) {
        long cs = token * half + i;
        float c = cos[cs], s = sign * sin[cs];
        st(y, dst + i, x1 * c - x2 * s);
        st(y, dst + i + half, x2 * c + x1 * s);
    } else {
        st(y, dst + i, x1);
        st(y, dst + i + half, x2);
    }
}

// `relayout` with 4 consecutive pairs a thread (half a multiple of 4, x and y aligned to 4
// elements): 8- or 16-byte loads and stores, the same rounding.
template <typename T>
__device__ void relayout4(const T* x, const float* cos, const float* sin, T* y, int h, int t,
                          int half, long quads, int to_heads, float sign) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= quads) return;
    int q4 = half / 4;
    int i = (k % q4) * 4;
    long src, dst, token;
    relayout_row(k / q4, h, t, 2 * half, to_heads, &src, &dst, &token);
    float x1[4], x2[4], y1[4], y2[4];
    ld4(x, src + i, x1);
    ld4(x, src + i + half, x2);
    long cs = token * half + i;
    for (int j = 0; j < 4; j++) {
        if (cos) {
            float c = cos[cs + j], s = sign * sin[cs + j];
            y1[j] = x1[j] * c - x2[j] * s;
            y2[j] = x2[j] * c + x1[j] * s;
        } else {
            y1[j] = x1[j];
            y2[j] = x2[j];
        }
    }
    st4(y, dst + i, y1);
    st4(y, dst + i + half, y2);
}

#define ROPE_INST(NAME, T) \
extern "C" __global__ void rope_##NAME(const T* x, const float* c, const float* s, T* y, \
    int h, int t, int half, long pairs) { rope<T>(x, c, s, y, h, t, half, pairs); } \
extern "C" __global__ void relayout_##NAME(const T* x, const float* c, const float* s, T* y, \
    int h, int t, int half, long pairs, int to_heads, float sign) \
    { relayout<T>(x, c, s, y, h, t, half, pairs, to_heads, sign); } \
extern "C" __global__ void relayout4_##NAME(const T* x, const float* c, const float* s, T* y, \
    int h, int t, int half, long quads, int to_heads, float sign) \
    { relayout4<T>(x, c, s, y, h, t, half, quads, to_heads, sign); }
ROPE_INST(f32, float)
ROPE_INST(bf16, bf16_t)
#undef ROPE_INST
