// Storage types without CUDA headers (NVRTC may not find cuda_bf16.h / cuda_fp16.h):
// bf16 and fp16 travel as 16-bit integers and convert through bit operations or PTX.
// Arithmetic is fp32 throughout; results round once, to nearest even.

typedef long long i64;

struct F32 {
  typedef float T;
  static __device__ __forceinline__ float to(float v) { return v; }
  static __device__ __forceinline__ float from(float v) { return v; }
};

struct BF16 {
  typedef unsigned short T;
  static __device__ __forceinline__ float to(unsigned short v) { return __uint_as_float(((unsigned)v) << 16); }
  static __device__ __forceinline__ unsigned short from(float v) {
#if __CUDA_ARCH__ >= 800
    unsigned short h;  // one instruction on Ampere and later
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
#else
    unsigned u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
#endif
  }
};

struct F16 {
  typedef unsigned short T;
  static __device__ __forceinline__ float to(unsigned short v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
  }
  static __device__ __forceinline__ unsigned short from(float v) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
  }
};

// W consecutive elements moved as one load/store of W * sizeof(T) bytes (16 on the vector
// paths): memory is read and written through `raw`, a vector type, so the compiler emits
// one wide access; `v` is the same registers seen as elements.
template <int BYTES> struct RawOf;
template <> struct RawOf<16> { typedef uint4 type; };
template <> struct RawOf<8> { typedef uint2 type; };
template <> struct RawOf<4> { typedef unsigned type; };
template <> struct RawOf<2> { typedef unsigned short type; };

template <class T, int W>
union Pack {
  typedef typename RawOf<sizeof(T) * W>::type Raw;
  Raw raw;
  T v[W];
};

template <class T, int W>
__device__ __forceinline__ Pack<T, W> load_pack(const T* base, long long pack) {
  Pack<T, W> p;
  p.raw = reinterpret_cast<const typename Pack<T, W>::Raw*>(base)[pack];
  return p;
}

template <class T, int W>
__device__ __forceinline__ void store_pack(T* base, long long pack, const Pack<T, W>& p) {
  reinterpret_cast<typename Pack<T, W>::Raw*>(base)[pack] = p.raw;
}
