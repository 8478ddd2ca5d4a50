// Rotary position embedding of q or k in the projections' layout, rows = b * t * heads of
// head_dim (hd) elements, row r at position (r / heads) % t, with the cos table and the
// signed sin table (first half -sin) of rope_tables, [>= t, hd], in the rows' dtype:
//   forward   y[i] = x[i] * cos[i] + x[p(i)] * sin[i]
//   backward gx[j] = g[j] * cos[j] + g[p(j)] * sin[p(j)]      p(i) = (i + hd/2) mod hd
// Unfused, torch runs broadcast multiplies (not vectorised), a roll copy and adds, eight
// launches a call pair. Here each thread owns a pack and its partner pack in the other
// half of the row, so x (or the gradient) is read once and written once; backward is the
// forward with the two halves' sin packs swapped. Packs of W elements stay within a half
// row (hd/2 is a multiple of W on the vector path).
#include "common.cuh"

template <class D, int W, bool BACKWARD>
__device__ void rope(const typename D::T* in, const typename D::T* cos, const typename D::T* sin,
                     typename D::T* out, i64 rows, i64 heads, i64 t, i64 hd) {
  typedef typename D::T T;
  const i64 half = hd / 2, per_row = half / W, packs = rows * per_row;
  for (i64 p = blockIdx.x * (i64)blockDim.x + threadIdx.x; p < packs; p += (i64)gridDim.x * blockDim.x) {
    const i64 row = p / per_row, col = p - row * per_row;
    const i64 pos = (row / heads) % t;
    const T* x = in + row * hd;
    const T* c = cos + pos * hd;
    const T* s = sin + pos * hd;
    const Pack<T, W> x1 = load_pack<T, W>(x, col), x2 = load_pack<T, W>(x + half, col);
    const Pack<T, W> c1 = load_pack<T, W>(c, col), c2 = load_pack<T, W>(c + half, col);
    // The first half's element pairs with the second half's and back: forward multiplies
    // each partner by its own position's sin, backward by the partner's.
    const Pack<T, W> s1 = load_pack<T, W>(BACKWARD ? s + half : s, col);
    const Pack<T, W> s2 = load_pack<T, W>(BACKWARD ? s : s + half, col);
    Pack<T, W> y1, y2;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const float a = D::to(x1.v[j]), b = D::to(x2.v[j]);
      y1.v[j] = D::from(a * D::to(c1.v[j]) + b * D::to(s1.v[j]));
      y2.v[j] = D::from(b * D::to(c2.v[j]) + a * D::to(s2.v[j]));
    }
    T* y = out + row * hd;
    store_pack<T, W>(y, col, y1);
    store_pack<T, W>(y + half, col, y2);
  }
}

#define ROPE(NAME, D, W)                                                                                    \
  extern "C" __global__ void rope_forward_##NAME(const D::T* x, const D::T* cos, const D::T* sin, D::T* y,  \
                                                 i64 rows, i64 heads, i64 t, i64 hd) {                      \
    rope<D, W, false>(x, cos, sin, y, rows, heads, t, hd);                                                  \
  }                                                                                                         \
  extern "C" __global__ void rope_backward_##NAME(const D::T* grad, const D::T* cos, const D::T* sin,       \
                                                  D::T* grad_x, i64 rows, i64 heads, i64 t, i64 hd) {       \
    rope<D, W, true>(grad, cos, sin, grad_x, rows, heads, t, hd);                                           \
  }

ROPE(f32_v, F32, 4)
ROPE(f32_s, F32, 1)
ROPE(bf16_v, BF16, 8)
ROPE(bf16_s, BF16, 1)
ROPE(f16_v, F16, 8)
ROPE(f16_s, F16, 1)
