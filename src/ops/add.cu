// out = a + b (ops::add); each thread 8 elements of 16-bit (or 4 of f32) through 16-byte loads
// when `vec` (pointers 16-byte aligned, n a multiple), else one element.
extern "C" __global__ void add_bf16(const bf16_t* a, const bf16_t* b, bf16_t* out, long n, int vec) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec) {
        if (k * 8 >= n) return;
        uint4 x = ((const uint4*)a)[k], y = ((const uint4*)b)[k], z;
        z.x = bf_pack(bf_lo(x.x) + bf_lo(y.x), bf_hi(x.x) + bf_hi(y.x));
        z.y = bf_pack(bf_lo(x.y) + bf_lo(y.y), bf_hi(x.y) + bf_hi(y.y));
        z.z = bf_pack(bf_lo(x.z) + bf_lo(y.z), bf_hi(x.z) + bf_hi(y.z));
        z.w = bf_pack(bf_lo(x.w) + bf_lo(y.w), bf_hi(x.w) + bf_hi(y.w));
        ((uint4*)out)[k] = z;
    } else if (k < n) {
        st(out, k, ld(a, k) + ld(b, k));
    }
}
extern "C" __global__ void add_f32(const float* a, const float* b, float* out, long n, int vec) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec) {
        if (k * 4 >= n) return;
        float4 x = ((const float4*)a)[k], y = ((const float4*)b)[k];
        ((float4*)out)[k] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
    } else if (k < n) {
        out[k] = a[k] + b[k];
    }
}
