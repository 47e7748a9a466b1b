// kvcredit's fused glue kernels, compiled at run time with NVRTC (src/exec/glue.rs). Each one
// replaces a chain of ATen elementwise ops, copies and scatters between the GEMMs with one
// launch, and computes bitwise what the chain computes: every ATen op of the chain rounds its
// fp32 result to the element type once, and so does the kernel, at the same places, with the
// same correctly rounded fp32 operations (`__fmul_rn` and friends keep the compiler from
// contracting a product and a sum into one fma). The one transcendental, SiLU's `expf`, is
// libdevice's, as in ATen's kernel. A bitwise check against the ATen chain, with a negative
// control, is `glue::check_fused`.
//
// The element type comes from kernels/dtype.cuh, which the host prepends (KVC_DTYPE).

#define KVC_GLUE_THREADS 256

// Rotary embedding of the query and key heads of a fused q/k/v projection, and the new key
// and value rows written into the cache (src/model/rope.rs `apply`, then `KvCache::write`):
//   out = rt(rt(x · cos) + rt(roll(x) · sin))   (sin's first half already negated)
// qkv: [B, TQ, (HQ + 2 HKV) · D], contiguous; cos, sin: [B, TQ, D], contiguous; pos: int64 with
// strides (pb, pt) over (B, TQ). q: [B, HQ, TQ, D], contiguous; kc, vc: cache buffers with
// strides (cb, ch, cp) over (row, head, position) and unit stride over D. One thread per
// element of qkv.
extern "C" __global__ void __launch_bounds__(KVC_GLUE_THREADS)
kvc_rope_qkv(const T* __restrict__ qkv, const T* __restrict__ cos, const T* __restrict__ sin,
             const long long* __restrict__ pos, long long pb, long long pt, T* __restrict__ q,
             T* __restrict__ kc, T* __restrict__ vc, long long cb, long long ch, long long cp,
             int b, int tq, int hq, int hkv, int d) {
  const int heads = hq + 2 * hkv;
  const long long n = (long long)b * tq * heads * d;
  const long long i = (long long)blockIdx.x * KVC_GLUE_THREADS + threadIdx.x;
  if (i >= n) return;
  const int e = (int)(i % d);
  const long long r = i / d;
  const int h = (int)(r % heads);
  const long long bt = r / heads;
  const int t = (int)(bt % tq);
  const int bi = (int)(bt / tq);
  const T* row = qkv + bt * heads * d + (long long)h * d;
  if (h < hq + hkv) {
    const int half = d / 2;
    const int src = e < half ? e + half : e - half;
    const float a = rt(__fmul_rn(ld(row, e), ld(cos, bt * d + e)));
    const float c = rt(__fmul_rn(ld(row, src), ld(sin, bt * d + e)));
    const float y = __fadd_rn(a, c);
    if (h < hq) {
      st(q, (((long long)bi * hq + h) * tq + t) * d + e, y);
    } else {
      const long long p = pos[bi * pb + t * pt];
      st(kc, bi * cb + (long long)(h - hq) * ch + p * cp + e, y);
    }
  } else {
    const long long p = pos[bi * pb + t * pt];
    vc[bi * cb + (long long)(h - hq - hkv) * ch + p * cp + e] = row[e];
  }
}

// Attention scores into softmax's fp32 input (src/exec/stock.rs `attention`):
//   out = (fp32) rt(rt(s · scale) + mask)
// s: [B, HKV, G · TQ, L], contiguous; mask: [B, 1, 1, TQ, L], contiguous; out: fp32 of s's shape.
extern "C" __global__ void __launch_bounds__(KVC_GLUE_THREADS)
kvc_scores(const T* __restrict__ s, const T* __restrict__ mask, float* __restrict__ out,
           long long n, int hkv, int g, int tq, int l, float scale) {
  const long long i = (long long)blockIdx.x * KVC_GLUE_THREADS + threadIdx.x;
  if (i >= n) return;
  const int k = (int)(i % l);
  const long long r = i / l;
  const int t = (int)(r % tq);
  const long long bi = r / tq / g / hkv;
  const float scaled = rt(__fmul_rn(ld(s, i), scale));
  out[i] = rt(__fadd_rn(scaled, ld(mask, (bi * tq + t) * l + k)));
}

// The gated MLP's SiLU and product (src/model/mlp.rs): out = rt(rt(g / (1 + exp(−g))) · u).
// gu: [R, 2 · I], contiguous (gate columns, then up columns); out: [R, I], contiguous.
// `control` (the negative control of the check) skips the rounding of the activation.
extern "C" __global__ void __launch_bounds__(KVC_GLUE_THREADS)
kvc_silu_mul(const T* __restrict__ gu, T* __restrict__ out, long long rows, int inter,
             int control) {
  const long long i = (long long)blockIdx.x * KVC_GLUE_THREADS + threadIdx.x;
  if (i >= rows * inter) return;
  const long long r = i / inter;
  const int c = (int)(i % inter);
  const float g = ld(gu, r * 2 * inter + c);
  const float u = ld(gu, r * 2 * inter + inter + c);
  const float act = __fdiv_rn(g, __fadd_rn(1.f, expf(-g)));
  st(out, i, __fmul_rn(control ? act : rt(act), u));
}
