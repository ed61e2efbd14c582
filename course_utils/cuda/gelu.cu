// tanh-GELU in CUDA C++ (chapter 4 compares the three ways to fuse): built by course_utils/cuda/gelu.py
// with torch.utils.cpp_extension where nvcc exists.
// The headers this file uses and no more: <torch/extension.h> (all of torch's C++ API and pybind11) took the
// build from 29.6 s to 64.7 s on an H200 host, nvcc compiling its host code twice (results/h200/cuda_ext_build_s16.log).
// load_inline's generated binding file includes it anyway, and compiles beside this one.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cstdint>

__device__ __forceinline__ float gelu_tanh(float x) {
    const float a = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.0f + tanhf(a));   // CUDA's tanhf is accurate for any input
}

template <typename T, int V> struct alignas(sizeof(T) * V) Pack { T v[V]; };

// Grid-stride loop; each thread moves 16 bytes per load and store (V elements) where aligned.
template <typename T>
__global__ void gelu_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n, bool vectorize) {
    constexpr int V = 16 / sizeof(T);
    using P = Pack<T, V>;
    const int64_t n_vec = vectorize ? n / V : 0;
    const int64_t start = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t k = start; k < n_vec; k += stride) {
        P p = reinterpret_cast<const P*>(x)[k];
        #pragma unroll
        for (int j = 0; j < V; ++j) p.v[j] = static_cast<T>(gelu_tanh(static_cast<float>(p.v[j])));
        reinterpret_cast<P*>(y)[k] = p;
    }
    for (int64_t k = n_vec * V + start; k < n; k += stride)
        y[k] = static_cast<T>(gelu_tanh(static_cast<float>(x[k])));
}

at::Tensor gelu_cuda(at::Tensor x) {
    TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
    TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
    auto y = at::empty_like(x);
    const int64_t n = x.numel();
    if (n == 0) return y;
    const int threads = 256;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "gelu_cuda", [&] {
        constexpr int V = 16 / sizeof(scalar_t);
        const bool vectorize = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0
                               && reinterpret_cast<uintptr_t>(y.data_ptr()) % 16 == 0;
        const int64_t work = vectorize ? (n + V - 1) / V : n;
        const int64_t blocks =
            std::max<int64_t>(1, std::min<int64_t>((work + threads - 1) / threads, 1 << 20));
        gelu_kernel<scalar_t><<<blocks, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
            x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), n, vectorize);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    return y;
}
