// out = residual + dropout(x): the mask is a hash of (sample seed, element index within the
// sample, site salt), so backward and recompute regenerate it instead of storing it, and a
// sample's mask does not depend on which micro-batch or replica carries it. `first`: the
// index within the whole sample of each row's first element (a tensor-parallel rank's slice
// of the sequence starts there; even on the vector path).
// kernels/residual_dropout.py holds the same hash in torch (the CPU path and the reference).
//
// One 32-bit hash gives two 16-bit uniforms, for elements 2q and 2q+1: the hash is the
// kernel's arithmetic cost, and a 1/65536 resolution of p is plenty for dropout.
#include "common.cuh"

__device__ __forceinline__ unsigned mix32(unsigned x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The per-(sample, site) key the element hashes start from.
__device__ __forceinline__ unsigned sample_key(unsigned long long seed, unsigned salt) {
  return mix32(mix32((unsigned)seed ^ salt) + (unsigned)(seed >> 32));
}

// Keep flags of elements e0 .. e0 + W - 1 (e0 even when W > 1): one hash per pair.
template <int W>
__device__ __forceinline__ void keep_flags(unsigned key, unsigned e0, unsigned threshold, bool (&keep)[W]) {
  if (W == 1) {
    const unsigned h = mix32((e0 >> 1) ^ key);
    keep[0] = ((e0 & 1u) ? (h >> 16) : (h & 0xffffu)) >= threshold;
  } else {
#pragma unroll
    for (int j = 0; j < W; j += 2) {
      const unsigned h = mix32(((e0 >> 1) + (j >> 1)) ^ key);
      keep[j] = (h & 0xffffu) >= threshold;
      keep[j + 1] = (h >> 16) >= threshold;
    }
  }
}

// Sample b is blockIdx.y; its per_sample elements are split into packs of W (W divides
// per_sample on the vector path). Each thread takes U packs per iteration, loads first.
#define U 2

template <class D, int W>
__device__ void dropout_add(const typename D::T* x, const typename D::T* residual, const i64* seeds,
                            typename D::T* out, i64 per_sample, i64 first, unsigned salt, unsigned threshold,
                            float scale) {
  typedef typename D::T T;
  const i64 base = (i64)blockIdx.y * (per_sample / W);
  const unsigned key = sample_key((unsigned long long)seeds[blockIdx.y], salt);
  const unsigned chunks = (unsigned)(per_sample / W);
  const unsigned stride = gridDim.x * blockDim.x;
  for (unsigned c0 = blockIdx.x * blockDim.x + threadIdx.x; c0 < chunks; c0 += U * stride) {
    Pack<T, W> xv[U], rv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const unsigned c = c0 + u * stride;
      if (c < chunks) {
        xv[u] = load_pack<T, W>(x, base + c);
        rv[u] = load_pack<T, W>(residual, base + c);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const unsigned c = c0 + u * stride;
      if (c >= chunks) continue;
      bool keep[W];
      keep_flags<W>(key, (unsigned)first + c * W, threshold, keep);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const float kept = keep[j] ? D::to(xv[u].v[j]) * scale : 0.f;
        rv[u].v[j] = D::from(D::to(rv[u].v[j]) + kept);
      }
      store_pack<T, W>(out, base + c, rv[u]);
    }
  }
}

// grad_x = grad * mask * scale (the residual's gradient is grad itself).
template <class D, int W>
__device__ void dropout_grad(const typename D::T* grad, const i64* seeds, typename D::T* grad_x,
                             i64 per_sample, i64 first, unsigned salt, unsigned threshold, float scale) {
  typedef typename D::T T;
  const i64 base = (i64)blockIdx.y * (per_sample / W);
  const unsigned key = sample_key((unsigned long long)seeds[blockIdx.y], salt);
  const unsigned chunks = (unsigned)(per_sample / W);
  const unsigned stride = gridDim.x * blockDim.x;
  for (unsigned c0 = blockIdx.x * blockDim.x + threadIdx.x; c0 < chunks; c0 += U * stride) {
    Pack<T, W> g[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (c0 + u * stride < chunks) g[u] = load_pack<T, W>(grad, base + c0 + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const unsigned c = c0 + u * stride;
      if (c >= chunks) continue;
      bool keep[W];
      keep_flags<W>(key, (unsigned)first + c * W, threshold, keep);
#pragma unroll
      for (int j = 0; j < W; ++j) g[u].v[j] = keep[j] ? D::from(D::to(g[u].v[j]) * scale) : (T)0;
      store_pack<T, W>(grad_x, base + c, g[u]);
    }
  }
}

#define DROPOUT(NAME, D, W)                                                                          \
  extern "C" __global__ void dropout_add_##NAME(const D::T* x, const D::T* residual, const i64* seeds, \
                                                D::T* out, i64 per_sample, i64 first, unsigned salt,   \
                                                unsigned threshold, float scale) {                     \
    dropout_add<D, W>(x, residual, seeds, out, per_sample, first, salt, threshold, scale);             \
  }                                                                                                    \
  extern "C" __global__ void dropout_grad_##NAME(const D::T* grad, const i64* seeds, D::T* grad_x,     \
                                                 i64 per_sample, i64 first, unsigned salt,             \
                                                 unsigned threshold, float scale) {                    \
    dropout_grad<D, W>(grad, seeds, grad_x, per_sample, first, salt, threshold, scale);                \
  }

DROPOUT(f32_v, F32, 4)
DROPOUT(f32_s, F32, 1)
DROPOUT(bf16_v, BF16, 8)
DROPOUT(bf16_s, BF16, 1)
DROPOUT(f16_v, F16, 8)
DROPOUT(f16_s, F16, 1)
