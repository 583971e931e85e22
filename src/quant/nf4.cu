// NF4 on the device (quant::weight), bit for bit as quant::nf4 on the host.
//
// Dequantize, to the compute dtype: w[k] = level[code k] · absmax[k / 64], in f32, rounded
// once. Each thread writes 16 weights (8 code bytes, inside one block of 64), so the absmax of a
// block is read by 4 threads, the codes in 8-byte loads and the weights in 4-wide stores.
// Nested absmax (double quant): absmax[b] = map2[acodes[b]] · absmax2[b / 256] + offset.
// Products that fall subnormal are flushed to a signed zero, as bitsandbytes' fast-math kernels
// (and quant::nf4 on the host) do.

__device__ const float NF4_LEVELS[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

__device__ __forceinline__ float nf4_ftz(float x) {
    return fabsf(x) < 1.17549435e-38f ? copysignf(0.0f, x) : x;
}

// absmax == nullptr: nested (acodes, absmax2, map2, offset).
__device__ __forceinline__ float nf4_absmax(long b, const float* absmax, const unsigned char* acodes,
                                            const float* absmax2, const float* map2, float offset) {
    if (absmax) return absmax[b];
    return nf4_ftz(map2[acodes[b]] * absmax2[b / 256]) + offset;
}

template <typename T>
__device__ __forceinline__ void nf4_dequant(const unsigned char* codes, const float* absmax,
                                            const unsigned char* acodes, const float* absmax2,
                                            const float* map2, float offset, T* out, long n) {
    long t = (long)blockIdx.x * blockDim.x + threadIdx.x;
    long k0 = t * 16;
    if (k0 >= n) return;
    float a = nf4_absmax(k0 / 64, absmax, acodes, absmax2, map2, offset);
    float v[16];
    if (k0 + 16 <= n) {
        uint2 c = *(const uint2*)(codes + k0 / 2); // k0 / 2 is a multiple of 8
        unsigned int w[2] = {c.x, c.y};
#pragma unroll
        for (int j = 0; j < 8; j++) {
            unsigned int byte = (w[j / 4] >> (8 * (j % 4))) & 255;
            v[2 * j] = nf4_ftz(NF4_LEVELS[byte >> 4] * a);
            v[2 * j + 1] = nf4_ftz(NF4_LEVELS[byte & 15] * a);
        }
#pragma unroll
        for (int j = 0; j < 16; j += 4) st4(out, k0 + j, v + j); // out is fresh: aligned
    } else {
        for (long k = k0; k < n; k++) {
            unsigned int byte = codes[k / 2];
            unsigned int c = (k % 2 == 0) ? (byte >> 4) : (byte & 15);
            st(out, k, nf4_ftz(NF4_LEVELS[c] * a));
        }
    }
}

extern "C" __global__ void nf4_dequant_bf16(const unsigned char* codes, const float* absmax,
                                            const unsigned char* acodes, const float* absmax2,
                                            const float* map2, float offset, bf16_t* out, long n) {
    nf4_dequant(codes, absmax, acodes, absmax2, map2, offset, out, n);
}

extern "C" __global__ void nf4_dequant_f32(const unsigned char* codes, const float* absmax,
                                           const unsigned char* acodes, const float* absmax2,
                                           const float* map2, float offset, float* out, long n) {
    nf4_dequant(codes, absmax, acodes, absmax2, map2, offset, out, n);
}

// Quantize (bitsandbytes' kQuantizeBlockwise with NF4, as quant::nf4 models it): one thread per
// block of 64 weights: absmax = max |w| (subnormals flushed), r = 1 / absmax (IEEE), each code
// the thresholds w · r lies above; a partial last block, and an odd tail's last nibble, take
// zeros. Two codes a byte, the first in the high nibble.
__device__ const float NF4_THRESHOLDS[15] = {
    -0.8480964004993439f, -0.6106329262256622f, -0.4599952697753906f, -0.33967943489551544f,
    -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,
    0.1202552504837513f, 0.2035212516784668f, 0.2920137718319893f, 0.3893125355243683f,
    0.5016634166240692f, 0.6427869200706482f, 0.8614784181118011f};

__device__ __forceinline__ unsigned int nf4_code(float x) {
    unsigned int c = 0;
#pragma unroll
    for (int i = 0; i < 15; i++) c += x > NF4_THRESHOLDS[i];
    return c;
}

template <typename T>
__device__ __forceinline__ void nf4_quantize(const T* w, long n, unsigned char* codes, float* absmax) {
    long b = (long)blockIdx.x * blockDim.x + threadIdx.x;
    long k0 = b * 64;
    if (k0 >= n) return;
    long k1 = k0 + 64 < n ? k0 + 64 : n;
    float m = 0.0f;
    for (long k = k0; k < k1; k++) m = fmaxf(m, fabsf(nf4_ftz(ld(w, k))));
    absmax[b] = m;
    float r = 1.0f / m;
    for (long k = k0; k < k1; k += 2) {
        float v0 = ld(w, k), v1 = k + 1 < k1 ? ld(w, k + 1) : 0.0f;
        unsigned int c0 = nf4_code(nf4_ftz(nf4_ftz(v0) * r));
        unsigned int c1 = nf4_code(nf4_ftz(nf4_ftz(v1) * r));
        codes[k / 2] = (unsigned char)((c0 << 4) | c1);
    }
}

extern "C" __global__ void nf4_quantize_bf16(const bf16_t* w, long n, unsigned char* codes, float* absmax) {
    nf4_quantize(w, n, codes, absmax);
}

extern "C" __global__ void nf4_quantize_f32(const float* w, long n, unsigned char* codes, float* absmax) {
    nf4_quantize(w, n, codes, absmax);
}
