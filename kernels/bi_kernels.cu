// kvcredit's fused batch-invariant kernels, compiled at run time with NVRTC (src/nvrtc.rs,
// src/exec/fused.rs). Each output element is computed by one fixed sequence of fp32
// operations that depends only on its own row's inputs — never on the batch size, the number
// of query positions in the call, the cache capacity, or the grid — so a token's result is
// bitwise the same however the work around it is batched.
//
// Defines set by the host: KVC_DTYPE (0 fp32, 1 fp16, 2 bf16) for every kernel; HD (head
// dimension) and CH (keys per chunk, a multiple of 32) for attention, compiled only when HD
// is set.

typedef unsigned short u16;

#if KVC_DTYPE == 0
typedef float T;
__device__ __forceinline__ float ld(const T* p, long long i) { return p[i]; }
__device__ __forceinline__ void st(T* p, long long i, float x) { p[i] = x; }
#elif KVC_DTYPE == 1
typedef u16 T;
__device__ __forceinline__ float ld(const T* p, long long i) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(p[i]));
  return f;
}
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
__device__ __forceinline__ void st(T* p, long long i, float x) {
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
  p[i] = h;
}
#endif

#define KVC_THREADS 128
#define KVC_NEG_INF __int_as_float(0xff800000)

#ifdef HD
// Keys per staged tile: K and V rows are loaded into shared memory 32 keys at a time by the
// whole block (coalesced), then read from there.
#define KVC_TILE 32
// Threads per key in the score phase: thread `part` sums dimensions part, part + 4, … in
// order, and the four partial sums are added as (p0 + p1) + (p2 + p3).
#define KVC_PARTS 4

// Attention of one query head at one position, `q·k` scaled (and soft-capped), plus the
// additive mask, softmax, times `v`. One block per (sequence, query head, position), walking
// the keys in chunks of CH (a multiple of 32) at fixed absolute offsets — a key always lands
// in the same chunk at the same place — with an online softmax:
//   * a key's score is a fixed-order dot product over HD (above); a chunk's max is exact;
//   * the running state is rescaled by exp(m_old − m_new) (exactly 1 when the max did not
//     move; when it is 0 the state restarts from +0, so a state built only from dropped keys
//     leaves no trace);
//   * each output dimension sums p·v over the chunk's keys in key order, skipping p = 0, so a
//     dropped key (mask ≤ `drop`) or a key past the end contributes nothing at all;
//   * a chunk with no live key is skipped (exactly what processing it would do to the state).
// Hence keys a query cannot see — masked, past its position, past the cache's length — never
// reach its result, whatever their number, and nothing depends on the batch or the grid.
extern "C" __global__ void __launch_bounds__(KVC_THREADS)
kvc_bi_attention(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                 const T* __restrict__ mask, T* __restrict__ out, int hq, int group, int tq,
                 int len, long long qsb, long long qsh, long long qst, long long ksb,
                 long long ksh, long long ksl, long long vsb, long long vsh, long long vsl,
                 long long msb, long long mst, float scale, float softcap, float drop) {
  __shared__ float qs[HD];
  __shared__ float acc[HD];
  __shared__ float pr[CH];
  __shared__ float tile[KVC_TILE * HD];
  __shared__ float wmax[KVC_THREADS / 32];
  __shared__ float run_m, run_l, fac;
  __shared__ int live_any;

  const int tid = threadIdx.x;
  const int t = blockIdx.x % tq;
  const int h = (blockIdx.x / tq) % hq;
  const int b = blockIdx.x / (tq * hq);
  const int kh = h / group;

  for (int d = tid; d < HD; d += KVC_THREADS) {
    qs[d] = ld(q, b * qsb + h * qsh + t * qst + d);
    acc[d] = 0.f;
  }
  if (tid == 0) {
    run_m = KVC_NEG_INF;
    run_l = 0.f;
  }
  const T* kb = k + b * ksb + kh * ksh;
  const T* vb = v + b * vsb + kh * vsh;
  const T* mrow = mask + b * msb + t * mst;
  const int kl = tid / KVC_PARTS;   // key of the tile this thread scores
  const int part = tid % KVC_PARTS;
  __syncthreads();

  for (int c0 = 0; c0 < len; c0 += CH) {
    if (tid == 0) live_any = 0;
    for (int s0 = 0; s0 < CH; s0 += KVC_TILE) {
      // Stage the tile's keys (zeros past the end).
      for (int i = tid; i < KVC_TILE * HD; i += KVC_THREADS) {
        const int key = c0 + s0 + i / HD;
        tile[i] = key < len ? ld(kb, key * ksl + i % HD) : 0.f;
      }
      __syncthreads();
      float dot = 0.f;
      for (int d = part; d < HD; d += KVC_PARTS) dot = fmaf(qs[d], tile[kl * HD + d], dot);
      const float pair = dot + __shfl_xor_sync(0xffffffffu, dot, 1);
      const float all = pair + __shfl_xor_sync(0xffffffffu, pair, 2);
      if (part == 0) {
        const int key = c0 + s0 + kl;
        float sc = KVC_NEG_INF;
        if (key < len) {
          const float mv = ld(mrow, key);
          if (mv > drop) live_any = 1;
          sc = all * scale;
          if (softcap > 0.f) sc = tanhf(sc / softcap) * softcap;
          sc = sc + mv;
        }
        pr[s0 + kl] = sc;
      }
      __syncthreads();
    }
    const int live = live_any;
    __syncthreads();  // every thread has read live_any before the next chunk resets it
    if (!live) continue;

    // The chunk's max (exact in any order), then the rescale factor.
    float m = KVC_NEG_INF;
    for (int j = tid; j < CH; j += KVC_THREADS) m = fmaxf(m, pr[j]);
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if ((tid & 31) == 0) wmax[tid >> 5] = m;
    __syncthreads();
    if (tid == 0) {
      float mc = wmax[0];
      for (int w = 1; w < KVC_THREADS / 32; ++w) mc = fmaxf(mc, wmax[w]);
      const float mn = fmaxf(run_m, mc);
      fac = expf(run_m - mn);
      run_m = mn;
    }
    __syncthreads();
    const float mn = run_m;
    for (int j = tid; j < CH; j += KVC_THREADS) pr[j] = expf(pr[j] - mn);
    __syncthreads();

    const float f = fac;
    const int nj = min(CH, len - c0);
    float a[(HD + KVC_THREADS - 1) / KVC_THREADS];
    for (int r = 0; r * KVC_THREADS + tid < HD; ++r) {
      const int d = r * KVC_THREADS + tid;
      a[r] = (f == 0.f) ? 0.f : acc[d] * f;
    }
    for (int s0 = 0; s0 < nj; s0 += KVC_TILE) {
      for (int i = tid; i < KVC_TILE * HD; i += KVC_THREADS) {
        const int key = c0 + s0 + i / HD;
        tile[i] = key < len ? ld(vb, key * vsl + i % HD) : 0.f;
      }
      __syncthreads();
      const int n = min(KVC_TILE, nj - s0);
      for (int r = 0; r * KVC_THREADS + tid < HD; ++r) {
        const int d = r * KVC_THREADS + tid;
        float x = a[r];
        for (int j = 0; j < n; ++j) {
          const float p = pr[s0 + j];
          x = (p != 0.f) ? fmaf(p, tile[j * HD + d], x) : x;
        }
        a[r] = x;
      }
      __syncthreads();
    }
    for (int r = 0; r * KVC_THREADS + tid < HD; ++r) acc[r * KVC_THREADS + tid] = a[r];
    if (tid == 0) {
      float l = (f == 0.f) ? 0.f : run_l * f;
      for (int j = 0; j < nj; ++j) {
        const float p = pr[j];
        if (p != 0.f) l += p;
      }
      run_l = l;
    }
    __syncthreads();
  }

  const float l = run_l;
  T* o = out + (((long long)b * hq + h) * tq + t) * HD;
  for (int d = tid; d < HD; d += KVC_THREADS) st(o, d, l > 0.f ? acc[d] / l : 0.f);
}
#endif

// `x / sqrt(mean(x²) + eps)` per row of `cols`, in fp32. One block per row: thread i sums
// elements i, i + 128, … in order, then the 128 partial sums are added by a fixed tree.
// `out_f32`: write fp32 (else the input's type, rounded once).
extern "C" __global__ void __launch_bounds__(KVC_THREADS)
kvc_bi_rms(const T* __restrict__ x, void* __restrict__ out, int cols, float eps, int out_f32) {
  __shared__ float part[KVC_THREADS];
  const int tid = threadIdx.x;
  const T* row = x + (long long)blockIdx.x * cols;
  float s = 0.f;
  for (int i = tid; i < cols; i += KVC_THREADS) {
    const float e = ld(row, i);
    s = fmaf(e, e, s);
  }
  part[tid] = s;
  __syncthreads();
  for (int w = KVC_THREADS / 2; w > 0; w >>= 1) {
    if (tid < w) part[tid] = part[tid] + part[tid + w];
    __syncthreads();
  }
  const float r = rsqrtf(part[0] / (float)cols + eps);
  const long long base = (long long)blockIdx.x * cols;
  for (int i = tid; i < cols; i += KVC_THREADS) {
    const float y = ld(row, i) * r;
    if (out_f32) {
      ((float*)out)[base + i] = y;
    } else {
      st((T*)out, base + i, y);
    }
  }
}

// The MLP activation, elementwise in fp32: 0 SiLU, 1 GELU (tanh), 2 GELU (erf).
extern "C" __global__ void __launch_bounds__(KVC_THREADS)
kvc_bi_act(const T* __restrict__ x, T* __restrict__ out, long long n, int mode) {
  const long long i = (long long)blockIdx.x * KVC_THREADS + threadIdx.x;
  if (i >= n) return;
  const float e = ld(x, i);
  float y;
  if (mode == 0) {
    y = e / (1.f + expf(-e));
  } else if (mode == 1) {
    const float inner = 0.7978845608028654f * (e + 0.044715f * e * e * e);
    y = 0.5f * e * (1.f + tanhf(inner));
  } else {
    y = 0.5f * e * (1.f + erff(e * 0.7071067811865476f));
  }
  st(out, i, y);
}
