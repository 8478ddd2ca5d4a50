// main += grad for an fp32 gradient `main` (a master weight's) and a gradient stored as D.
// torch's add of a 16-bit tensor into an fp32 one takes its unvectorised path (mixed
// dtypes): with every micro-batch adding every weight's gradient into its master, that
// add was ~13% of an MoE step's device time on H200 (BENCHMARKS.md).
#include "common.cuh"

template <class D, int W>
__device__ void accumulate(float* main, const typename D::T* grad, i64 n) {
  typedef typename D::T T;
  const i64 stride = (i64)gridDim.x * blockDim.x, first = blockIdx.x * (i64)blockDim.x + threadIdx.x;
  const i64 vec_n = W >= 4 ? n / W * W : 0;
  if (W >= 4) {
    for (i64 p = first; p < vec_n / W; p += stride) {
      const Pack<T, W> g = load_pack<T, W>(grad, p);
#pragma unroll
      for (int k = 0; k < W / 4; ++k) {
        Pack<float, 4> m = load_pack<float, 4>(main, p * (W / 4) + k);
#pragma unroll
        for (int j = 0; j < 4; ++j) m.v[j] += D::to(g.v[k * 4 + j]);
        store_pack<float, 4>(main, p * (W / 4) + k, m);
      }
    }
  }
  for (i64 i = vec_n + first; i < n; i += stride) main[i] += D::to(grad[i]);
}

#define ACCUMULATE(NAME, D, W)                                                                 \
  extern "C" __global__ void accumulate_##NAME(float* main, const D::T* grad, i64 n) {         \
    accumulate<D, W>(main, grad, n);                                                           \
  }

ACCUMULATE(f32_v, F32, 4)
ACCUMULATE(f32_s, F32, 1)
ACCUMULATE(bf16_v, BF16, 8)
ACCUMULATE(bf16_s, BF16, 1)
ACCUMULATE(f16_v, F16, 8)
ACCUMULATE(f16_s, F16, 1)
