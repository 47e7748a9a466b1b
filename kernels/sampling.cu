// kvcredit's fused Gumbel-max sampler, compiled at run time with NVRTC (src/sampling.rs).
//
// It computes exactly what the ATen reference in src/sampling.rs computes — the same integer
// hash of (key, vocabulary entry), the same fp64 transform u = (h + 0.5) / 2^32,
// g = (float)(-log(-log(u))), the same fp32 sum with the scaled logits and the same argmax
// rule (NaN first, then the largest value, then the lowest index) — in two launches instead
// of about thirty passes over [B, V] int64/fp64 tensors. Every step of the reference is exact
// or one correctly specified rounding (integer ops, an exact power-of-two scaling, libdevice's
// fp64 log, one fp64→fp32 rounding, one fp32 add), and an argmax over a total order does not
// depend on the order of its comparisons, so the chosen token is bitwise the reference's.
//
// Define set by the host: KVC_NOISE_F32 (negative control only) takes the logs in fp32, which
// a bitwise comparison with the reference must catch.

typedef unsigned int u32;
typedef long long i64;

#define KVC_SAMPLE_THREADS 256
#define KVC_SAMPLE_PER_THREAD 16
#define KVC_SLICE (KVC_SAMPLE_THREADS * KVC_SAMPLE_PER_THREAD)

// `lowbias32`: the reference's hash32 on values below 2^32 (its int64 products masked to 32
// bits are these u32 products).
__device__ __forceinline__ u32 lowbias32(u32 x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// Gumbel noise of vocabulary entry `v` for a row whose key digest has halves `hi`, `lo`.
__device__ __forceinline__ float gumbel(u32 hi, u32 lo, u32 v) {
  const u32 h = lowbias32(lowbias32(v ^ lo) ^ hi);
  const double u = ((double)h + 0.5) * (1.0 / 4294967296.0);
#ifdef KVC_NOISE_F32
  return -logf(-logf((float)u));
#else
  return (float)(-log(-log(u)));
#endif
}

// ATen's argmax order: does (a, ia) come before (b, ib)?
__device__ __forceinline__ bool before(float a, i64 ia, float b, i64 ib) {
  if (isnan(a)) {
    return isnan(b) ? ia < ib : true;
  }
  if (isnan(b)) {
    return false;
  }
  return a == b ? ia < ib : a > b;
}

// One block per (row, slice of KVC_SLICE entries), block r·slices + s: the best (x + g, index)
// of the slice. x: [B, V] fp32 (scaled logits), words: [2, B] (hi halves, then lo halves).
extern "C" __global__ void __launch_bounds__(KVC_SAMPLE_THREADS)
kvc_gumbel_partial(const float* __restrict__ x, const i64* __restrict__ words, int b, int vocab,
                   int slices, float* __restrict__ best_v, i64* __restrict__ best_i) {
  __shared__ float sv[KVC_SAMPLE_THREADS];
  __shared__ i64 si[KVC_SAMPLE_THREADS];
  const int row = blockIdx.x / slices;
  const int slice = blockIdx.x - row * slices;
  const int tid = threadIdx.x;
  const u32 hi = (u32)words[row];
  const u32 lo = (u32)words[b + row];
  const float* xr = x + (i64)row * vocab;
  float bv = __int_as_float(0xff800000);
  i64 bi = 0x7fffffffffffffffLL;
  const int start = slice * KVC_SLICE;
#pragma unroll 4
  for (int j = 0; j < KVC_SAMPLE_PER_THREAD; ++j) {
    const int v = start + j * KVC_SAMPLE_THREADS + tid;
    if (v < vocab) {
      const float s = xr[v] + gumbel(hi, lo, (u32)v);
      if (before(s, v, bv, bi)) {
        bv = s;
        bi = v;
      }
    }
  }
  sv[tid] = bv;
  si[tid] = bi;
  __syncthreads();
  for (int w = KVC_SAMPLE_THREADS / 2; w > 0; w >>= 1) {
    if (tid < w && before(sv[tid + w], si[tid + w], sv[tid], si[tid])) {
      sv[tid] = sv[tid + w];
      si[tid] = si[tid + w];
    }
    __syncthreads();
  }
  if (tid == 0) {
    best_v[blockIdx.x] = sv[0];
    best_i[blockIdx.x] = si[0];
  }
}

// One thread per row: fold the row's `slices` partial bests into its token.
extern "C" __global__ void kvc_gumbel_fold(const float* __restrict__ best_v,
                                           const i64* __restrict__ best_i, int b, int slices,
                                           i64* __restrict__ out) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= b) {
    return;
  }
  float bv = best_v[(i64)row * slices];
  i64 bi = best_i[(i64)row * slices];
  for (int s = 1; s < slices; ++s) {
    const float v = best_v[(i64)row * slices + s];
    const i64 i = best_i[(i64)row * slices + s];
    if (before(v, i, bv, bi)) {
      bv = v;
      bi = i;
    }
  }
  out[row] = bi;
}

// The noise alone, [B, V] fp32: what the reference's gumbel_noise_from returns.
extern "C" __global__ void kvc_gumbel_noise(const i64* __restrict__ words, int b, int vocab,
                                            float* __restrict__ out) {
  const i64 n = (i64)b * vocab;
  for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
       e += (i64)gridDim.x * blockDim.x) {
    const int row = (int)(e / vocab);
    const int v = (int)(e - (i64)row * vocab);
    out[e] = gumbel((u32)words[row], (u32)words[b + row], (u32)v);
  }
}
