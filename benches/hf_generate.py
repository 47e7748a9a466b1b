#!/usr/bin/env python3
"""Time Hugging Face transformers on the shapes `kvcredit bench` measures.

Random-weight Qwen2 models with the exact shapes of Qwen2.5-0.5B / 1.5B are built in code (no
hub access). For each batch size:

* ``generate``: ``model.generate`` with sampling (temperature 1, no top-k/top-p by default),
  a random prompt of ``--prompt`` tokens per row and exactly ``--new-tokens`` new tokens (EOS
  disabled), timed end to end (prefill included, as a user of ``generate`` pays it);
* ``generate_static`` (with ``--static``): the same ``generate`` call with
  ``cache_implementation="static"``, for which transformers compiles the forward (CUDA graphs);
  two warm-up calls per batch size pay the compilation (~30–45 s each on an H200), then the best of
  ``--static-reps`` calls is kept. This is the fast path a user who cares about speed runs, about
  10× eager ``generate``; ``kvcredit bench --hf FILE`` reports ratios against both;
* ``loop`` (unless ``--no-loop``): a hand-written greedy loop of ``model(...)`` calls with a
  ``DynamicCache``: one prefill, then one forward per token; reports the prefill time and the
  mean decode step.

Prints a table and writes JSON (``--out``), which ``kvcredit bench --hf FILE`` reads to print
ratios. Exits 0 with a message when ``transformers`` (or ``torch``) is not installed, or when the
requested device is not available, so it can run inside a larger batch of commands.

    python benches/hf_generate.py --shape qwen2.5-0.5b --batches 1,64 --out $OUT/hf-0.5b.json
"""
import argparse
import json
import platform
import sys
import time
import warnings

# (hidden, intermediate, layers, heads, kv heads, tied embeddings) as in src/model/synthetic.rs.
SHAPES = {
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, True),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, True),
    # A tiny shape for smoke tests on the CPU.
    "tiny": (64, 128, 2, 4, 2, True),
}
VOCAB = {"qwen2.5-0.5b": 151_936, "qwen2.5-1.5b": 151_936, "tiny": 1024}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bf16", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="1,64", help="comma-separated batch sizes")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off (plain temperature sampling)")
    p.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, ...)")
    p.add_argument("--reps", type=int, default=1, help="timed generate calls per batch")
    p.add_argument("--no-loop", action="store_true", help="skip the model(...) loop timing")
    p.add_argument("--static", action="store_true",
                   help="also time generate with a static cache (compiled, CUDA graphs)")
    p.add_argument("--static-reps", type=int, default=3, help="timed static-cache calls per batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON output path")
    return p.parse_args()


def main():
    a = parse_args()
    try:
        import torch
    except ImportError:
        print("hf_generate: torch is not installed; skipping the Hugging Face baseline")
        return 0
    try:
        import transformers
        from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM
    except ImportError as e:
        print(f"hf_generate: transformers is not installed ({e}); skipping the Hugging Face "
              "baseline (pip install transformers to measure it)")
        return 0
    warnings.filterwarnings("ignore", category=FutureWarning)
    transformers.logging.set_verbosity_error()
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"hf_generate: device {a.device} requested but CUDA is not available; skipping")
        return 0
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    dev = torch.device(a.device)
    batches = [int(b) for b in a.batches.split(",") if b.strip()]

    hidden, inter, layers, heads, kv, tied = SHAPES[a.shape]
    vocab = VOCAB[a.shape]
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=tied,
        use_cache=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(a.seed)
    t = time.perf_counter()
    # Built on the device (initialization there is fast), then re-drawn with the same weight
    # distribution as kvcredit's synthetic models: N(0, 0.02), norms 1 + N(0, 0.02).
    with dev:
        try:
            model = Qwen2ForCausalLM._from_config(cfg, attn_implementation=a.attn, dtype=dtype)
        except TypeError:  # transformers 4.x spells it torch_dtype
            model = Qwen2ForCausalLM._from_config(cfg, attn_implementation=a.attn,
                                                  torch_dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.02 * torch.randn(p.shape, device=p.device, dtype=torch.float32)
            p.copy_(noise + 1 if name.endswith("norm.weight") else noise)
    model = model.to(dev).eval()
    build_s = time.perf_counter() - t

    gen_cfg = transformers.GenerationConfig(
        do_sample=True,
        temperature=a.temperature,
        top_k=a.top_k,  # 0 disables top-k (None could fall back to the default of 50)
        top_p=1.0,
        max_new_tokens=a.new_tokens,
        min_new_tokens=None,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
    )

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def prompt_ids(b):
        g = torch.Generator().manual_seed(a.seed + b)
        return torch.randint(0, vocab, (b, a.prompt), generator=g).to(dev)

    results = []
    print(f"hf_generate: {a.shape} {a.dtype} on {a.device}, transformers {transformers.__version__}, "
          f"torch {torch.__version__}, attn {a.attn}; prompt {a.prompt}, {a.new_tokens} new tokens")
    print(f"{'batch':>6} {'generate s':>11} {'tok/s':>10} {'ms/step':>9} | "
          f"{'loop prefill ms':>15} {'loop ms/step':>12} {'loop tok/s':>10}")
    for b in batches:
        ids = prompt_ids(b)
        mask = torch.ones_like(ids)
        row = {"shape": a.shape, "dtype": a.dtype, "batch": b, "prompt": a.prompt,
               "new_tokens": a.new_tokens}
        with torch.no_grad():
            # Warm-up (kernels, allocator, cuBLAS handles).
            warm = transformers.GenerationConfig(**{**gen_cfg.to_dict(), "max_new_tokens": 4})
            model.generate(input_ids=ids, attention_mask=mask, generation_config=warm)
            times = []
            for _ in range(max(1, a.reps)):
                sync()
                t = time.perf_counter()
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)
                sync()
                times.append(time.perf_counter() - t)
            secs = sorted(times)[len(times) // 2]
            new = out.shape[1] - a.prompt
            row["generate"] = {
                "seconds": secs,
                "new_tokens_per_row": int(new),
                "tokens_per_s": b * new / secs,
                "ms_per_step": secs / new * 1e3,
            }
            if a.static:
                row["generate_static"] = time_static(model, ids, mask, gen_cfg, warm, a, sync)
            loop = None
            if not a.no_loop:
                cache = DynamicCache()
                sync()
                t = time.perf_counter()
                o = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
                nxt = o.logits[:, -1].argmax(-1, keepdim=True)
                sync()
                prefill = time.perf_counter() - t
                cache = o.past_key_values
                full = mask
                t = time.perf_counter()
                for _ in range(a.new_tokens - 1):
                    full = torch.cat([full, torch.ones_like(nxt)], dim=1)
                    o = model(input_ids=nxt, attention_mask=full, past_key_values=cache,
                              use_cache=True)
                    cache = o.past_key_values
                    nxt = o.logits[:, -1].argmax(-1, keepdim=True)
                sync()
                steps = max(1, a.new_tokens - 1)
                step_s = (time.perf_counter() - t) / steps
                loop = {"prefill_seconds": prefill, "ms_per_step": step_s * 1e3,
                        "tokens_per_s": b / step_s}
                row["loop"] = loop
        results.append(row)
        g = row["generate"]
        if "generate_static" in row:
            st = row["generate_static"]
            print(f"{b:>6} static-cache generate: {st['tokens_per_s']:.0f} tok/s, "
                  f"{st['ms_per_step']:.2f} ms/step (warm-up {st['warmup_seconds']:.1f} s)", flush=True)
        lp = (f"{loop['prefill_seconds'] * 1e3:>15.1f} {loop['ms_per_step']:>12.2f} "
              f"{loop['tokens_per_s']:>10.0f}") if loop else f"{'-':>15} {'-':>12} {'-':>10}"
        print(f"{b:>6} {g['seconds']:>11.2f} {g['tokens_per_s']:>10.0f} {g['ms_per_step']:>9.2f} | {lp}",
              flush=True)
        del ids, mask
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    report = {
        "tool": "benches/hf_generate.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": a.device,
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor(),
        "attn_implementation": a.attn,
        "sampling": {"temperature": a.temperature, "top_k": a.top_k, "top_p": 1.0},
        "model_build_seconds": build_s,
        "results": results,
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {a.out}")
    return 0


def time_static(model, ids, mask, gen_cfg, warm, a, sync):
    """Best of ``a.static_reps`` static-cache ``generate`` calls after two compiling warm-ups."""
    import time as _t
    import transformers
    cfg = transformers.GenerationConfig(**{**gen_cfg.to_dict(), "cache_implementation": "static"})
    sync()
    t = _t.perf_counter()
    for _ in range(2):
        model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
    sync()
    warmup = _t.perf_counter() - t
    times = []
    for _ in range(max(1, a.static_reps)):
        sync()
        t = _t.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        sync()
        times.append(_t.perf_counter() - t)
    secs = min(times)
    new = out.shape[1] - ids.shape[1]
    return {"seconds": secs, "new_tokens_per_row": int(new),
            "tokens_per_s": ids.shape[0] * new / secs, "ms_per_step": secs / new * 1e3,
            "warmup_seconds": warmup, "reps": len(times)}


if __name__ == "__main__":
    sys.exit(main())
