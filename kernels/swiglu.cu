// SwiGLU: out = silu(gate) * up, and the gradients of gate and up back. Gate, up and
// their gradients are rows of h elements `ld` apart, so one kernel body serves two layouts:
// - the experts' grouped GEMM writes each row as gate (first h columns) then up (last h):
//   gate = gu, up = gu + h, ld = 2h. Unfused, torch runs on the strided halves (not
//   vectorised) and backward concatenates the halves' gradients.
// - the dense MLP's w1 and w3 give two tensors: gate, up, ld = h.
// Unfused, torch also keeps silu's output for backward and runs five elementwise kernels
// for a forward and backward; here each direction is one pass over the rows, and backward
// needs only gate and up. `out` and the output's gradient are [rows, h], contiguous.
// Packs of W elements never cross a row (h and ld are multiples of W on the vector path).
#include "common.cuh"

template <class D, int W>
__device__ void swiglu_forward(const typename D::T* gate, const typename D::T* up, typename D::T* out,
                               i64 rows, i64 h, i64 ld) {
  typedef typename D::T T;
  const i64 per_row = h / W, packs = rows * per_row;
  for (i64 p = blockIdx.x * (i64)blockDim.x + threadIdx.x; p < packs; p += (i64)gridDim.x * blockDim.x) {
    const i64 row = p / per_row, col = p - row * per_row;
    const Pack<T, W> g = load_pack<T, W>(gate + row * ld, col), u = load_pack<T, W>(up + row * ld, col);
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
__device__ void swiglu_backward(const typename D::T* gate, const typename D::T* up, const typename D::T* grad,
                                typename D::T* grad_gate, typename D::T* grad_up, i64 rows, i64 h, i64 ld) {
  typedef typename D::T T;
  const i64 per_row = h / W, packs = rows * per_row;
  for (i64 p = blockIdx.x * (i64)blockDim.x + threadIdx.x; p < packs; p += (i64)gridDim.x * blockDim.x) {
    const i64 row = p / per_row, col = p - row * per_row;
    const i64 at = row * ld;
    const Pack<T, W> g = load_pack<T, W>(gate + at, col), u = load_pack<T, W>(up + at, col);
    const Pack<T, W> dy = load_pack<T, W>(grad + row * h, col);
    Pack<T, W> dg, du;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const float x = D::to(g.v[j]), s = 1.f / (1.f + expf(-x)), d = D::to(dy.v[j]);
      du.v[j] = D::from(d * x * s);
      // d silu(x) / dx = s * (1 + x * (1 - s))
      dg.v[j] = D::from(d * D::to(u.v[j]) * s * (1.f + x * (1.f - s)));
    }
    store_pack<T, W>(grad_gate + at, col, dg);
    store_pack<T, W>(grad_up + at, col, du);
  }
}

#define SWIGLU(NAME, D, W)                                                                                  \
  extern "C" __global__ void swiglu_forward_##NAME(const D::T* gate, const D::T* up, D::T* out, i64 rows,   \
                                                   i64 h, i64 ld) {                                         \
    swiglu_forward<D, W>(gate, up, out, rows, h, ld);                                                       \
  }                                                                                                         \
  extern "C" __global__ void swiglu_backward_##NAME(const D::T* gate, const D::T* up, const D::T* grad,     \
                                                    D::T* grad_gate, D::T* grad_up, i64 rows, i64 h,        \
                                                    i64 ld) {                                               \
    swiglu_backward<D, W>(gate, up, grad, grad_gate, grad_up, rows, h, ld);                                 \
  }

SWIGLU(f32_v, F32, 4)
SWIGLU(f32_s, F32, 1)
SWIGLU(bf16_v, BF16, 8)
SWIGLU(bf16_s, BF16, 1)
SWIGLU(f16_v, F16, 8)
SWIGLU(f16_s, F16, 1)
