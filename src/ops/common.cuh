// Helpers every kernel of ours shares (the first part of the one NVRTC program, ops::cuda):
// bf16 as raw 16-bit storage with PTX conversions (sm_80+), so no CUDA header is needed;
// loads widen to f32, stores round from f32.
typedef unsigned short bf16_t;
__device__ __forceinline__ float ld(const float* p, long i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16_t* p, long i) {
    return __uint_as_float(((unsigned int)p[i]) << 16);
}
__device__ __forceinline__ void st(float* p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16_t* p, long i, float v) {
    bf16_t h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v)); p[i] = h;
}
// Round to the storage type and back (what a cast to the activation dtype does).
__device__ __forceinline__ float rnd(const float*, float v) { return v; }
__device__ __forceinline__ float rnd(const bf16_t*, float v) {
    bf16_t h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return __uint_as_float(((unsigned int)h) << 16);
}

// Sum over the block; every thread gets the result. blockDim.x is a multiple of 32, <= 1024.
__device__ float block_sum(float v) {
    __shared__ float buf[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) buf[warp] = v;
    __syncthreads();
    int nw = blockDim.x >> 5;
    v = lane < nw ? buf[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}
__device__ float block_max(float v) {
    __shared__ float buf[32];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) buf[warp] = v;
    __syncthreads();
    int nw = blockDim.x >> 5;
    v = lane < nw ? buf[lane] : __int_as_float(0xff800000);
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

__device__ __forceinline__ float bf_lo(unsigned int v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(unsigned int v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ unsigned int bf_pack(float lo, float hi) {
    bf16_t l, h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(l) : "f"(lo));
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(hi));
    return ((unsigned int)h << 16) | (unsigned int)l;
}
// 4 elements a load or store (8 bytes of bf16, 16 of f32): pointers aligned to 4 elements.
__device__ __forceinline__ void ld4(const bf16_t* p, long i, float* v) {
    uint2 u = *(const uint2*)(p + i);
    v[0] = bf_lo(u.x); v[1] = bf_hi(u.x); v[2] = bf_lo(u.y); v[3] = bf_hi(u.y);
}
__device__ __forceinline__ void st4(bf16_t* p, long i, const float* v) {
    uint2 u;
    u.x = bf_pack(v[0], v[1]);
    u.y = bf_pack(v[2], v[3]);
    *(uint2*)(p + i) = u;
}
__device__ __forceinline__ void ld4(const float* p, long i, float* v) {
    float4 u = *(const float4*)(p + i);
    v[0] = u.x; v[1] = u.y; v[2] = u.z; v[3] = u.w;
}
__device__ __forceinline__ void st4(float* p, long i, const float* v) {
    *(float4*)(p + i) = make_float4(v[0], v[1], v[2], v[3]);
}
// 8 bf16 values a load or store (16 bytes), for kernels over rows of a multiple of 8 elements
// whose pointers are 16-byte aligned: the scalar loads move two bytes each.
__device__ __forceinline__ void ld8(const bf16_t* p, long i, float* v) {
    uint4 u = *(const uint4*)(p + i);
    v[0] = bf_lo(u.x); v[1] = bf_hi(u.x); v[2] = bf_lo(u.y); v[3] = bf_hi(u.y);
    v[4] = bf_lo(u.z); v[5] = bf_hi(u.z); v[6] = bf_lo(u.w); v[7] = bf_hi(u.w);
}
__device__ __forceinline__ void st8(bf16_t* p, long i, const float* v) {
    uint4 u;
    u.x = bf_pack(v[0], v[1]); u.y = bf_pack(v[2], v[3]);
    u.z = bf_pack(v[4], v[5]); u.w = bf_pack(v[6], v[7]);
    *(uint4*)(p + i) = u;
}
__device__ __forceinline__ float rbf(float v) { return rnd((const bf16_t*)0, v); }
