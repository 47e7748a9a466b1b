// Element type of kvcredit's NVRTC kernels, prepended to each kernel source by the host
// (src/exec/fused.rs, src/exec/glue.rs). KVC_DTYPE: 0 fp32, 1 fp16, 2 bf16. `ld` reads an
// element as fp32 (exact); `st` rounds fp32 to the element type (to nearest, ties to even) and
// stores it; `rt` is that rounding as an fp32 value.

typedef unsigned short u16;

#if KVC_DTYPE == 0
typedef float T;
__device__ __forceinline__ float ld(const T* p, long long i) { return p[i]; }
__device__ __forceinline__ void st(T* p, long long i, float x) { p[i] = x; }
#elif KVC_DTYPE == 1
typedef u16 T;
__device__ __forceinline__ float h2f(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ float ld(const T* p, long long i) { return h2f(p[i]); }
// The lower- and higher-addressed element of two packed in a 32-bit word.
__device__ __forceinline__ float lo16(unsigned w) { return h2f((u16)(w & 0xffffu)); }
__device__ __forceinline__ float hi16(unsigned w) { return h2f((u16)(w >> 16)); }
__device__ __forceinline__ void st(T* p, long long i, float x) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  p[i] = h;
}
#else
typedef u16 T;
__device__ __forceinline__ float ld(const T* p, long long i) {
  return __uint_as_float(((unsigned)p[i]) << 16);
}
__device__ __forceinline__ float lo16(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi16(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ void st(T* p, long long i, float x) {
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
  p[i] = h;
}
#endif

// `x` rounded to the element type, as fp32 (exact both ways for fp32).
__device__ __forceinline__ float rt(float x) {
  T t;
  st(&t, 0, x);
  return ld(&t, 0);
}
