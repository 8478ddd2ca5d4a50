// MoE token permute / un-permute. A "slot" is one kept (token, expert) assignment; slots
// are sorted by expert. Rows are d elements; the host picks W = 16 / sizeof(T) when every
// row starts on a 16-byte boundary, else W = 1. Each block takes R rows and each thread
// issues the loads of all R rows before any store, so enough bytes are in flight to keep
// the memory system busy (a gather is latency-bound otherwise).
#include "common.cuh"

#define R 4

// y[i] = x[src[i]] * (scale ? scale[i] : 1). Without a scale the rows are copied bit for bit.
template <class D, int W>
__device__ void gather_rows(const typename D::T* x, const i64* src, const float* scale,
                            typename D::T* y, i64 m, i64 d) {
  typedef typename D::T T;
  const i64 chunks = d / W;
  const i64 row0 = (i64)blockIdx.x * R;
  const T* in[R];
  T* out[R];
  float s[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const bool ok = row0 + r < m;
    in[r] = ok ? x + src[row0 + r] * d : nullptr;
    out[r] = ok ? y + (row0 + r) * d : nullptr;
    s[r] = ok && scale != nullptr ? scale[row0 + r] : 1.f;
  }
  for (i64 c = threadIdx.x; c < chunks; c += blockDim.x) {
    Pack<T, W> p[R];
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (in[r]) p[r] = load_pack<T, W>(in[r], c);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (!in[r]) continue;
      if (scale != nullptr) {
#pragma unroll
        for (int j = 0; j < W; ++j) p[r].v[j] = D::from(D::to(p[r].v[j]) * s[r]);
      }
      store_pack<T, W>(out[r], c, p[r]);
    }
  }
}

// out[n] = sum_j w[s] * y[s] over s = slots[n, j] >= 0 (w = 1 without weights), in fp32 and
// in the order j = 0..k-1, so the result is deterministic. A token with no kept slot is 0.
template <class D, int W>
__device__ void combine_rows(const typename D::T* y, const i64* slots, const float* w,
                             typename D::T* out, i64 n, int k, i64 d) {
  typedef typename D::T T;
  const i64 chunks = d / W;
  const i64 row0 = (i64)blockIdx.x * R;
  for (i64 c = threadIdx.x; c < chunks; c += blockDim.x) {
    float acc[R][W];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int e = 0; e < W; ++e) acc[r][e] = 0.f;
    for (int j = 0; j < k; ++j) {
      Pack<T, W> p[R];
      float ws[R];
      bool has[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {  // R independent loads in flight
        const i64 s = row0 + r < n ? slots[(row0 + r) * k + j] : -1;
        has[r] = s >= 0;
        ws[r] = has[r] && w != nullptr ? w[s] : 1.f;
        if (has[r]) p[r] = load_pack<T, W>(y + s * d, c);
      }
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (has[r])
#pragma unroll
          for (int e = 0; e < W; ++e) acc[r][e] += ws[r] * D::to(p[r].v[e]);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (row0 + r >= n) continue;
      Pack<T, W> q;
#pragma unroll
      for (int e = 0; e < W; ++e) q.v[e] = D::from(acc[r][e]);
      store_pack<T, W>(out + (row0 + r) * d, c, q);
    }
  }
}

// out[i] = <a[src[i]], b[i]> in fp32: the router-weight gradient of un-permute.
template <class D>
__device__ void row_dot(const typename D::T* a, const i64* src, const typename D::T* b,
                        float* out, i64 m, i64 d) {
  __shared__ float partial[32];
  for (i64 row = blockIdx.x; row < m; row += gridDim.x) {
    const typename D::T* ar = a + src[row] * d;
    const typename D::T* br = b + row * d;
    float acc = 0.f;
    for (i64 c = threadIdx.x; c < d; c += blockDim.x) acc += D::to(ar[c]) * D::to(br[c]);
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = acc;
    __syncthreads();
    if (warp == 0) {
      acc = lane < (blockDim.x >> 5) ? partial[lane] : 0.f;
      for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
      if (lane == 0) out[row] = acc;
    }
    __syncthreads();
  }
}

#define ROWS(NAME, D, W)                                                                      \
  extern "C" __global__ void gather_rows_##NAME(const D::T* x, const i64* src, const float* scale, \
                                                D::T* y, i64 m, i64 d) {                      \
    gather_rows<D, W>(x, src, scale, y, m, d);                                                \
  }                                                                                           \
  extern "C" __global__ void combine_rows_##NAME(const D::T* y, const i64* slots, const float* w, \
                                                 D::T* out, i64 n, int k, i64 d) {            \
    combine_rows<D, W>(y, slots, w, out, n, k, d);                                            \
  }

ROWS(f32_v, F32, 4)
ROWS(f32_s, F32, 1)
ROWS(bf16_v, BF16, 8)
ROWS(bf16_s, BF16, 1)
ROWS(f16_v, F16, 8)
ROWS(f16_s, F16, 1)

extern "C" __global__ void row_dot_f32(const float* a, const i64* src, const float* b, float* out, i64 m, i64 d) {
  row_dot<F32>(a, src, b, out, m, d);
}
extern "C" __global__ void row_dot_bf16(const unsigned short* a, const i64* src, const unsigned short* b,
                                        float* out, i64 m, i64 d) {
  row_dot<BF16>(a, src, b, out, m, d);
}
extern "C" __global__ void row_dot_f16(const unsigned short* a, const i64* src, const unsigned short* b,
                                       float* out, i64 m, i64 d) {
  row_dot<F16>(a, src, b, out, m, d);
}
