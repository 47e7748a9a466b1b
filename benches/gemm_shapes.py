"""GPU time of the decode-step GEMM shapes of the Qwen2.5 0.5B/1.5B layers under stock cuBLAS
settings and under the M-invariant ones kvcredit's fused batch-invariant linear uses
(cuBLASLt preferred, reduced-precision reductions and split-K off), plus a fixed split-K
alternative (K cut into S equal slices at fixed offsets, each slice a GEMM into fp32, the
partials summed in slice order), with a bitwise check that each mode's row results do not
depend on M.

    python benches/gemm_shapes.py [--out gemm.json]

Each timing is the mean over 50 calls replayed from a CUDA graph (no launch gaps).
"""

import argparse
import json

import torch

SHAPES = {
    "qwen2.5-0.5b": dict(h=896, q=896, kv=128, inter=4864, vocab=151936),
    "qwen2.5-1.5b": dict(h=1536, q=1536, kv=256, inter=8960, vocab=151936),
}


def layer_gemms(s):
    """(name, N, K) of one layer's linear layers and the output head."""
    return [
        ("q", s["q"], s["h"]),
        ("k/v", s["kv"], s["h"]),
        ("o", s["h"], s["q"]),
        ("gate/up", s["inter"], s["h"]),
        ("down", s["h"], s["inter"]),
        ("lm_head", s["vocab"], s["h"]),
    ]


def invariant(on):
    m = torch.backends.cuda.matmul
    if on:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        m.allow_bf16_reduced_precision_reduction = (False, False)
    else:
        torch.backends.cuda.preferred_blas_library("default")
        m.allow_bf16_reduced_precision_reduction = (True, True)


def split_k(x, w, slices):
    """x @ w.T with K in `slices` fixed slices, each into fp32, summed in order."""
    k = x.shape[1]
    ks = k // slices
    xs = x.view(x.shape[0], slices, ks).transpose(0, 1)  # [S, M, ks]
    ws = w.view(w.shape[0], slices, ks).permute(1, 2, 0)  # [S, ks, N]
    parts = torch.bmm(xs, ws, out_dtype=torch.float32)  # [S, M, N]
    acc = parts[0]
    for i in range(1, slices):
        acc = acc + parts[i]
    return acc.to(x.dtype)


def timed(fn, calls=50):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / (5 * calls) * 1e3  # µs per call


def m_invariant(fn, x_full, ms):
    """Whether the first two rows of fn(x[:m]) are bitwise equal for every m in ms."""
    ref = fn(x_full[:2])[:2]
    return all(torch.equal(fn(x_full[:m])[:2], ref) for m in ms)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    ms_check = [2, 3, 7, 16, 33, 64, 128, 256]
    for shape, s in SHAPES.items():
        for name, n, k in layer_gemms(s):
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            x_full = torch.randn(256, k, device=dev, dtype=torch.bfloat16)
            modes = [("stock", False, lambda x: x @ w.T), ("invariant", True, lambda x: x @ w.T)]
            for sl in (2, 4, 8):
                if k % (sl * 64) == 0:
                    modes.append((f"splitk{sl}", True, lambda x, sl=sl: split_k(x, w, sl)))
            for mode, inv, fn in modes:
                invariant(inv)
                same = m_invariant(fn, x_full, ms_check)
                for m in (2, 64):
                    x = x_full[:m].contiguous()
                    us = timed(lambda: fn(x))
                    rows.append(dict(shape=shape, gemm=name, n=n, k=k, m=m, mode=mode,
                                     us=round(us, 2), m_invariant=same,
                                     gbs=round(n * k * 2 / us / 1e3, 1)))
                    print(f"{shape:13} {name:8} N={n:6} K={k:5} M={m:3} {mode:10} "
                          f"{us:8.2f} us {n * k * 2 / us / 1e3:7.0f} GB/s  M-invariant {same}",
                          flush=True)
    invariant(False)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
