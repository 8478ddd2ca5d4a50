// SwiGLU of a grouped GEMM's output: out = silu(gate) * up, where each row of `gu` holds
// the row's gate (first h columns) then its up (last h), and the gradient of both halves
// back. Unfused, torch runs silu and the product on strided halves (not vectorised), keeps
// silu's output for backward, and backward adds three more elementwise kernels and a
// concatenation of the halves' gradients; here each direction is one pass over the rows.
// Packs of W elements never cross a row (h is a multiple of W on the vector path).
#include "common.cuh"

template <class D, int W>
__device__ void swiglu_forward(const typename D::T* gu, typename D::T* out, i64 rows, i64 h) {
  typedef typename D::T T;
  const i64 per_row = h / W, packs = rows * per_row;
  for (i64 p = blockIdx.x * (i64)blockDim.x + threadIdx.x; p < packs; p += (i64)gridDim.x * blockDim.x) {
    const i64 row = p / per_row, col = p - row * per_row;
    const T* in = gu + row * 2 * h;
    const Pack<T, W> g = load_pack<T, W>(in, col), u = load_pack<T, W>(in + h, col);
    Pack<T, W> o;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const float x = D::to(g.v[j]);
      o.v[j] = D::from(x / (1.f + expf(-x)) * D::to(u.v[j]));
    }
    store_pack<T, W>(out + row * h, col, o);
  }
}

template <class D, int W>
__device__ void swiglu_backward(const typename D::T* gu, const typename D::T* grad, typename D::T* grad_gu,
                                i64 rows, i64 h) {
  typedef typename D::T T;
  const i64 per_row = h / W, packs = rows * per_row;
  for (i64 p = blockIdx.x * (i64)blockDim.x + threadIdx.x; p < packs; p += (i64)gridDim.x * blockDim.x) {
    const i64 row = p / per_row, col = p - row * per_row;
    const T* in = gu + row * 2 * h;
    const Pack<T, W> g = load_pack<T, W>(in, col), u = load_pack<T, W>(in + h, col);
    const Pack<T, W> dy = load_pack<T, W>(grad + row * h, col);
    Pack<T, W> dg, du;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const float x = D::to(g.v[j]), s = 1.f / (1.f + expf(-x)), d = D::to(dy.v[j]);
      du.v[j] = D::from(d * x * s);
      // d silu(x) / dx = s * (1 + x * (1 - s))
      dg.v[j] = D::from(d * D::to(u.v[j]) * s * (1.f + x * (1.f - s)));
    }
    T* out = grad_gu + row * 2 * h;
    store_pack<T, W>(out, col, dg);
    store_pack<T, W>(out + h, col, du);
  }
}

#define SWIGLU(NAME, D, W)                                                                                  \
  extern "C" __global__ void swiglu_forward_##NAME(const D::T* gu, D::T* out, i64 rows, i64 h) {            \
    swiglu_forward<D, W>(gu, out, rows, h);                                                                 \
  }                                                                                                         \
  extern "C" __global__ void swiglu_backward_##NAME(const D::T* gu, const D::T* grad, D::T* grad_gu,        \
                                                    i64 rows, i64 h) {                                      \
    swiglu_backward<D, W>(gu, grad, grad_gu, rows, h);                                                      \
  }

SWIGLU(f32_v, F32, 4)
SWIGLU(f32_s, F32, 1)
SWIGLU(bf16_v, BF16, 8)
SWIGLU(bf16_s, BF16, 1)
SWIGLU(f16_v, F16, 8)
SWIGLU(f16_s, F16, 1)
