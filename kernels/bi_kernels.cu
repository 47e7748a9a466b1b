// kvcredit's fused batch-invariant kernels, compiled at run time with NVRTC (src/nvrtc.rs,
// src/exec/fused.rs). Each output element is computed by one fixed sequence of fp32
// operations that depends only on its own row's inputs — never on the batch size, the number
// of query positions in the call, the cache capacity, or the grid — so a token's result is
// bitwise the same however the work around it is batched.
//
// The element type comes from kernels/dtype.cuh, which the host prepends (KVC_DTYPE).
// Defines set by the host besides: HD (head dimension) and CH (keys per block, a multiple of
// 32) for attention, compiled only when HD is set.

#define KVC_THREADS 128
#define KVC_NEG_INF __int_as_float(0xff800000)

#ifdef HD
// Threads and warps per attention block, and output dimensions per lane.
#define KVC_ATT_THREADS 256
#define KVC_WARPS (KVC_ATT_THREADS / 32)
#define KVC_DPL ((HD + 31) / 32)
#define KVC_FULL 0xffffffffu

// Attention of one query head at one position: `q·k` scaled (and soft-capped), plus the
// additive mask, softmax, times `v`. One block per (sequence, query head, position).
//
// The keys are cut at fixed absolute offsets into blocks of CH keys (a multiple of 32), dealt
// round-robin to the block's KVC_WARPS warps (warp w takes key blocks w, w + W, w + 2W, …), so
// a key always lands in the same warp at the same place, whatever the cache's length. Each
// warp walks its keys 32 at a time (one per lane) with its own online softmax:
//   * lane j's score is a dot product over HD taken in dimension order (one fmaf chain);
//   * a key is live when it is inside the cache and its mask is above `drop`; dead keys get
//     p = 0 exactly and do not enter the max; a 32-key step with no live key is skipped;
//   * the step's max is exact (in any order); the running state is rescaled by
//     exp(m_old − m_new) (exactly 1 when the max did not move; when it is 0 the state restarts
//     from +0, so nothing of an earlier state survives a restart);
//   * every lane adds p·v over the step's keys in key order for its output dimensions, and the
//     normalizer Σp in the same order (so all lanes hold the same normalizer).
// The warps' states are then folded in warp order (a warp that saw no live key is skipped).
// Keys a query cannot see — masked, past its position, past the cache's length — never reach
// its result, and nothing depends on the batch, the number of positions, or the grid.
extern "C" __global__ void __launch_bounds__(KVC_ATT_THREADS)
kvc_bi_attention(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                 const T* __restrict__ mask, T* __restrict__ out, int hq, int group, int tq,
                 int len, long long qsb, long long qsh, long long qst, long long ksb,
                 long long ksh, long long ksl, long long vsb, long long vsh, long long vsl,
                 long long msb, long long mst, float scale, float softcap, float drop,
                 int vec) {
  __shared__ float qs[HD];
  __shared__ float wm[KVC_WARPS];
  __shared__ float wl[KVC_WARPS];
  __shared__ float wacc[KVC_WARPS * HD];

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int t = blockIdx.x % tq;
  const int h = (blockIdx.x / tq) % hq;
  const int b = blockIdx.x / (tq * hq);
  const int kh = h / group;

  for (int d = tid; d < HD; d += KVC_ATT_THREADS) qs[d] = ld(q, b * qsb + h * qsh + t * qst + d);
  __syncthreads();
  const T* kb = k + b * ksb + kh * ksh;
  const T* vb = v + b * vsb + kh * vsh;
  const T* mrow = mask + b * msb + t * mst;

  float m_run = KVC_NEG_INF;
  float l_run = 0.f;
  float acc[KVC_DPL];
#pragma unroll
  for (int r = 0; r < KVC_DPL; ++r) acc[r] = 0.f;

  for (int c0 = warp * CH; c0 < len; c0 += KVC_WARPS * CH) {
    const int c1 = min(c0 + CH, len);
    for (int s0 = c0; s0 < c1; s0 += 32) {
      const int key = s0 + lane;
      bool live = false;
      float sc = KVC_NEG_INF;
      if (key < c1) {
        // The mask and the key row are loaded together; a dead key's dot product (of whatever
        // its row holds) is never used.
        const float mv = ld(mrow, key);
        const T* kr = kb + key * ksl;
        float dot = 0.f;
#if KVC_DTYPE != 0 && HD % 8 == 0
        if (vec) {
          // The same fmaf chain, its operands read 8 at a time.
          const uint4* kr8 = reinterpret_cast<const uint4*>(kr);
#pragma unroll 4
          for (int c = 0; c < HD / 8; ++c) {
            const uint4 u = kr8[c];
            const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              dot = fmaf(qs[c * 8 + 2 * i], lo16(w[i]), dot);
              dot = fmaf(qs[c * 8 + 2 * i + 1], hi16(w[i]), dot);
            }
          }
        } else
#endif
        {
#pragma unroll 8
          for (int d = 0; d < HD; ++d) dot = fmaf(qs[d], ld(kr, d), dot);
        }
        live = mv > drop;
        if (live) {
          sc = dot * scale;
          if (softcap > 0.f) sc = tanhf(sc / softcap) * softcap;
          sc = sc + mv;
        }
      }
      if (!__any_sync(KVC_FULL, live)) continue;
      float mc = sc;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) mc = fmaxf(mc, __shfl_xor_sync(KVC_FULL, mc, off));
      const float mn = fmaxf(m_run, mc);
      const float f = expf(m_run - mn);
      m_run = mn;
      const float p = live ? expf(sc - mn) : 0.f;
      float l = (f == 0.f) ? 0.f : l_run * f;
#pragma unroll
      for (int r = 0; r < KVC_DPL; ++r) acc[r] = (f == 0.f) ? 0.f : acc[r] * f;
      // Keys in key order, their V values loaded 8 keys at a time ahead of use (a dead key's
      // value is loaded but never used).
      const int nk = min(32, c1 - s0);
      for (int j0 = 0; j0 < nk; j0 += 8) {
        float pv[8];
        float vv[8][KVC_DPL];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int j = j0 + u;
          pv[u] = __shfl_sync(KVC_FULL, p, j & 31);
          const T* vr = vb + (long long)(s0 + j) * vsl;
#pragma unroll
          for (int r = 0; r < KVC_DPL; ++r) {
            const int d = lane + 32 * r;
            vv[u][r] = (j < nk && d < HD) ? ld(vr, d) : 0.f;
          }
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          if (j0 + u < nk && pv[u] != 0.f) {  // the same for every lane
            l += pv[u];
#pragma unroll
            for (int r = 0; r < KVC_DPL; ++r) acc[r] = fmaf(pv[u], vv[u][r], acc[r]);
          }
        }
      }
      l_run = l;
    }
  }

  if (lane == 0) {
    wm[warp] = m_run;
    wl[warp] = l_run;
  }
#pragma unroll
  for (int r = 0; r < KVC_DPL; ++r) {
    const int d = lane + 32 * r;
    if (d < HD) wacc[warp * HD + d] = acc[r];
  }
  __syncthreads();
  T* o = out + (((long long)b * hq + h) * tq + t) * HD;
  for (int d = tid; d < HD; d += KVC_ATT_THREADS) {
    float m = KVC_NEG_INF, l = 0.f, a = 0.f;
    for (int w = 0; w < KVC_WARPS; ++w) {
      if (wl[w] == 0.f) continue;  // no live key
      const float mn = fmaxf(m, wm[w]);
      const float fo = expf(m - mn);
      const float fw = expf(wm[w] - mn);
      l = (fo == 0.f ? 0.f : l * fo) + wl[w] * fw;
      a = (fo == 0.f ? 0.f : a * fo) + wacc[w * HD + d] * fw;
      m = mn;
    }
    st(o, d, l > 0.f ? a / l : 0.f);
  }
}
#endif

// `x / sqrt(mean(x²) + eps)` per row of `cols`, in fp32. One block per row: thread i sums
// elements i, i + 128, … in order, then the 128 partial sums are added by a fixed tree.
// `out_f32`: write fp32 (else the input's type, rounded once, then — when `w` is given —
// times the weight `w` and rounded again: bitwise ATen's `w * normed` after the kernel).
extern "C" __global__ void __launch_bounds__(KVC_THREADS)
kvc_bi_rms(const T* __restrict__ x, void* __restrict__ out, const T* __restrict__ w, int cols,
           float eps, int out_f32) {
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
    } else if (w) {
      st((T*)out, base + i, __fmul_rn(ld(w, i), rt(y)));
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
