// Soft-capping (ops::softcap): y = cap · tanh(x / cap) and dx = dy · (1 − (y / cap)²),
// elementwise in f32 over f32 or bf16.

template <typename T>
__device__ void softcap(const T* x, T* y, long n, float cap) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    st(y, k, cap * tanhf(ld(x, k) / cap));
}

template <typename T>
__device__ void softcap_bwd(const T* y, const T* dy, T* dx, long n, float cap) {
    long k = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    float t = ld(y, k) / cap;
    st(dx, k, ld(dy, k) * (1.f - t * t));
}

#define SOFTCAP_INST(NAME, T) \
extern "C" __global__ void softcap_##NAME(const T* x, T* y, long n, float cap) \
    { softcap<T>(x, y, n, cap); } \
extern "C" __global__ void softcap_bwd_##NAME(const T* y, const T* dy, T* dx, long n, float cap) \
    { softcap_bwd<T>(y, dy, dx, n, cap); }
SOFTCAP_INST(f32, float)
SOFTCAP_INST(bf16, bf16_t)
#undef SOFTCAP_INST
