// Many tensors in one launch. The host passes a table of (source, destination, size) and a
// table of work item -> (tensor, offset); blocks stride over the items, so the grid can be
// smaller than the work (a copy to host memory needs few SMs to fill the bus, and leaves
// the rest to the training step it overlaps).
#include "common.cuh"

// Byte copy; destinations may be pinned host memory, which the GPU writes directly
// (zero-copy through unified addressing).
extern "C" __global__ void multi_copy(const i64* src, const i64* dst, const i64* nbytes, const int* item_tensor,
                                      const i64* item_offset, int items, i64 chunk) {
  for (int it = blockIdx.x; it < items; it += gridDim.x) {
    const int t = item_tensor[it];
    const i64 begin = item_offset[it];
    const i64 end = min(begin + chunk, nbytes[t]);
    const char* s = reinterpret_cast<const char*>(src[t]);
    char* d = reinterpret_cast<char*>(dst[t]);
    if (((src[t] | dst[t] | begin) & 15) == 0) {
      const i64 vec_end = begin + ((end - begin) & ~(i64)15);
      // Two 16-byte loads in flight per thread before their stores.
      i64 i = begin + threadIdx.x * 16;
      for (; i + (i64)blockDim.x * 16 < vec_end; i += (i64)blockDim.x * 32) {
        const uint4 a = *reinterpret_cast<const uint4*>(s + i);
        const uint4 b = *reinterpret_cast<const uint4*>(s + i + blockDim.x * 16);
        *reinterpret_cast<uint4*>(d + i) = a;
        *reinterpret_cast<uint4*>(d + i + blockDim.x * 16) = b;
      }
      if (i < vec_end) *reinterpret_cast<uint4*>(d + i) = *reinterpret_cast<const uint4*>(s + i);
      for (i64 j = vec_end + threadIdx.x; j < end; j += blockDim.x) d[j] = s[j];
    } else {
      for (i64 j = begin + threadIdx.x; j < end; j += blockDim.x) d[j] = s[j];
    }
  }
}

// ema = decay * ema + (1 - decay) * w for fp32 EMAs of weights stored as D; sizes and
// offsets in elements. Packs of 4 where both tensors are 16-byte aligned (offsets are
// multiples of 4), else one element at a time.
template <class D>
__device__ void multi_ema(const i64* weights, const i64* emas, const i64* numel, const int* item_tensor,
                          const i64* item_offset, int items, i64 chunk, float decay) {
  typedef typename D::T T;
  const float take = 1.f - decay;
  for (int it = blockIdx.x; it < items; it += gridDim.x) {
    const int t = item_tensor[it];
    const i64 begin = item_offset[it];
    const i64 end = min(begin + chunk, numel[t]);
    const T* w = reinterpret_cast<const T*>(weights[t]);
    float* e = reinterpret_cast<float*>(emas[t]);
    i64 vec_end = begin;
    if ((weights[t] & (4 * sizeof(T) - 1)) == 0 && (emas[t] & 15) == 0) {
      vec_end = begin + ((end - begin) & ~(i64)3);
      for (i64 i = begin + threadIdx.x * 4; i < vec_end; i += (i64)blockDim.x * 4) {
        const Pack<T, 4> wv = load_pack<T, 4>(w + i, 0);
        float4 ev = *reinterpret_cast<const float4*>(e + i);
        ev.x = decay * ev.x + take * D::to(wv.v[0]);
        ev.y = decay * ev.y + take * D::to(wv.v[1]);
        ev.z = decay * ev.z + take * D::to(wv.v[2]);
        ev.w = decay * ev.w + take * D::to(wv.v[3]);
        *reinterpret_cast<float4*>(e + i) = ev;
      }
    }
    for (i64 i = vec_end + threadIdx.x; i < end; i += blockDim.x) e[i] = decay * e[i] + take * D::to(w[i]);
  }
}

#define EMA(NAME, D)                                                                                     \
  extern "C" __global__ void multi_ema_##NAME(const i64* w, const i64* e, const i64* n, const int* it_t, \
                                              const i64* it_o, int items, i64 chunk, float decay) {      \
    multi_ema<D>(w, e, n, it_t, it_o, items, chunk, decay);                                              \
  }

EMA(f32, F32)
EMA(bf16, BF16)
EMA(f16, F16)
