#!/usr/bin/env python3
"""Cache-ON vs cache-OFF divergence with Hugging Face transformers, on kvcredit's own prompts.

The reference beside `kvcredit divergence run`: the same GGUF loaded by transformers
(``from_pretrained(dir, gguf_file=...)``, dequantized), the same prompt token ids (read from a
divergence run's ``pairs.parquet``, column ``prompt_ids``), the same token cap and strategies.
Per problem, dtype and strategy, two hand-written loops at batch 1:

* cache-ON: one prefill with ``use_cache=True``, then one forward per token on the cache;
* cache-OFF: one full forward over prompt + generated-so-far per step (``use_cache=False``);

both with the same per-step Gumbel noise (a ``torch.Generator`` seeded from
``(seed, problem, strategy, step)``), so identical logits give identical tokens. Top-p keeps the
smallest prefix of the sorted distribution whose mass reaches p (the top token always). Records
diverged, first divergence step tau, and while the prefixes agree the max |dlogit| and argmax
flips in fp64. Stops at the model's EOS tokens or the cap (kvcredit also stops at text stops,
so compare rates, not lengths). Writes JSON (``--out``, rewritten after each dtype × strategy, so a run cut short keeps what
finished) and prints a table of divergence rates.

    python benches/hf_divergence.py --gguf ~/.cache/kvcredit/models/smollm2-135m-instruct/smollm2-135m-instruct.gguf \\
        --pairs runs/divergence-gpu-smollm2/pairs.parquet --dtypes fp16,bf16,fp32 --out $OUT/hf-div.json

One model's problems can be split over processes (``--skip S --problems N``, one dtype each) and
the JSONs joined afterwards: ``python benches/hf_divergence.py --merge a.json b.json --out hf-div.json``
(refuses files that hold the same dtype × strategy × problem, or differ in settings).

Exits 0 with a message when transformers, gguf or pyarrow is missing, or CUDA is requested but
absent, so it can run inside a larger batch of commands.
"""
import argparse
import json
import os
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", help="GGUF file (the one kvcredit ran)")
    p.add_argument("--pairs", help="pairs.parquet of a kvcredit divergence run")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="combine the JSONs of runs over disjoint problem ranges into --out")
    p.add_argument("--dtypes", default="fp16,bf16,fp32")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the run's cap")
    p.add_argument("--problems", type=int, default=None, help="N problems only")
    p.add_argument("--skip", type=int, default=0,
                   help="skip the first S problems (with --problems: problems S..S+N, so one "
                        "model's problems can be split over processes and joined by --merge)")
    p.add_argument("--strategies", default="greedy,temperature=0.7,top_p=0.9:0.7",
                   help="greedy | temperature=T | top_p=P:T, comma-separated")
    p.add_argument("--attn", default="eager", help="attn_implementation (eager, sdpa)")
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--out", default=None)
    return p.parse_args()


def parse_strategy(s):
    if s == "greedy":
        return ("greedy", None, None)
    if s.startswith("temperature="):
        return ("temperature", float(s.split("=")[1]), None)
    if s.startswith("top_p="):
        p, t = s.split("=")[1].split(":")
        return ("top_p", float(t), float(p))
    raise SystemExit(f"hf_divergence: unknown strategy `{s}`")


def main():
    a = parse_args()
    if a.merge:
        return merge(a.merge, a.out)
    if not (a.gguf and a.pairs):
        raise SystemExit("hf_divergence: --gguf and --pairs are required (or --merge)")
    try:
        import pyarrow.parquet as pq
        import torch
        import transformers
    except ImportError as e:
        print(f"hf_divergence: {e.name} is not installed; skipping the Hugging Face reference")
        return 0
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"hf_divergence: device {a.device} requested but CUDA is not available; skipping")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device(a.device)
    table = pq.read_table(a.pairs).to_pydict()
    prompts = {}
    for prob, ids in zip(table["problem"], table["prompt_ids"]):
        prompts.setdefault(int(prob), list(ids))
    problems = sorted(prompts)[a.skip:]
    problems = problems[: a.problems] if a.problems else problems
    cap = a.max_new_tokens or max(len(t) for t in table["tokens_on"])
    strategies = [parse_strategy(s) for s in a.strategies.split(",")]
    kinds = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    folder, name = os.path.split(os.path.abspath(a.gguf))
    results = {"transformers": transformers.__version__, "torch": torch.__version__,
               "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               "attn": a.attn, "max_new_tokens": cap, "problems": problems, "runs": []}
    for dname in a.dtypes.split(","):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, torch_dtype=kinds[dname], attn_implementation=a.attn
        ).to(dev).eval()
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        vocab = model.config.vocab_size
        for si, (kind, temp, top_p) in enumerate(strategies):
            rows, started = [], time.time()
            for prob in problems:
                rows.append({"problem": prob, **pair(torch, model, prompts[prob], cap, eos, vocab,
                                                     dev, (kind, temp, top_p), (a.seed, prob, si))})
            div = sum(r["diverged"] for r in rows)
            label = kind if kind == "greedy" else f"{kind}={temp}" if top_p is None else f"top_p={top_p},t={temp}"
            summary = {"dtype": dname, "strategy": label, "problems": len(rows), "diverged": div,
                       "rate": div / max(len(rows), 1), "seconds": time.time() - started,
                       "flips": sum(r["flips"] for r in rows),
                       "non_finite": sum(r["non_finite"] is not None for r in rows),
                       "max_abs": max((r["max_abs"] for r in rows), default=0.0), "pairs": rows}
            results["runs"].append(summary)
            if summary["non_finite"]:
                print(f"{dname:5} {label:22} non-finite logits in {summary['non_finite']}/{len(rows)} pairs")
            print(f"{dname:5} {label:22} diverged {div:3}/{len(rows)}  flips {summary['flips']:4}  "
                  f"max|dlogit| {summary['max_abs']:.3e}  ({summary['seconds']:.1f} s)", flush=True)
            # Written after every (dtype, strategy): a run cut short keeps what finished.
            if a.out:
                write_atomic(a.out, results)
        del model
    return 0


def merge(paths, out):
    """Join runs of one model: per (dtype, strategy), counts add up and pairs concatenate; two
    files holding the same (dtype, strategy, problem), or files of different settings, are refused."""
    if not out:
        raise SystemExit("hf_divergence: --merge needs --out")
    parts = []
    for p in paths:
        with open(p) as f:
            parts.append(json.load(f))
    keys = ("transformers", "torch", "device", "attn", "max_new_tokens")
    for p, part in zip(paths[1:], parts[1:]):
        if any(part.get(k) != parts[0].get(k) for k in keys):
            raise SystemExit(f"hf_divergence: {p} has other settings than {paths[0]} ({keys})")
    problems = sorted({q for part in parts for q in part["problems"]})
    merged = {k: parts[0].get(k) for k in keys}
    merged.update({"problems": problems, "merged_from": [os.path.basename(p) for p in paths],
                   "runs": []})
    runs = {}
    for part in parts:
        for r in part["runs"]:
            key = (r["dtype"], r["strategy"])
            if key not in runs:
                runs[key] = {**r, "pairs": list(r["pairs"])}
                merged["runs"].append(runs[key])
                continue
            m = runs[key]
            seen = {q["problem"] for q in m["pairs"]}
            if any(q["problem"] in seen for q in r["pairs"]):
                raise SystemExit(f"hf_divergence: two files hold {key[0]} {key[1]} pairs of the same "
                                 "problem; merge disjoint ranges only")
            for k in ("problems", "diverged", "flips", "seconds", "non_finite"):
                m[k] = m.get(k, 0) + r.get(k, 0)
            m["max_abs"] = max(m["max_abs"], r["max_abs"])
            m["pairs"] += r["pairs"]
    for m in merged["runs"]:
        m["rate"] = m["diverged"] / max(m["problems"], 1)
        bad = f"  non-finite logits in {m['non_finite']}" if m.get("non_finite") else ""
        print(f"{m['dtype']:5} {m['strategy']:22} diverged {m['diverged']:3}/{m['problems']}{bad}")
    write_atomic(out, merged)
    return 0


def write_atomic(path, value):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def choose(torch, logits, strategy, gen):
    kind, temp, top_p = strategy
    if kind == "greedy":
        return int(torch.argmax(logits.float()))
    z = logits.float() / temp
    u = torch.rand(z.shape, generator=gen, device=z.device, dtype=torch.float64)
    g = (-(-(u.clamp_min(1e-300)).log()).log()).float()
    if kind == "top_p":
        srt, order = torch.sort(z, descending=True)
        p = torch.softmax(srt.double(), -1)
        drop_sorted = (torch.cumsum(p, -1) - p) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return int(torch.argmax(z + g))


def pair(torch, model, prompt, cap, eos, vocab, dev, strategy, key):
    def gen_for(step):
        g = torch.Generator(device=dev)
        g.manual_seed(hash((key, step)) & 0x7FFF_FFFF_FFFF_FFFF)
        return g

    on, off, max_abs, flips = [], [], 0.0, 0
    non_finite = None
    with torch.no_grad():
        ids = torch.tensor([prompt], device=dev)
        out = model(ids, use_cache=True)
        past, z_on = out.past_key_values, out.logits[0, -1]
        done_on = done_off = False
        for step in range(cap):
            seq = torch.tensor([prompt + off], device=dev)
            z_off = model(seq, use_cache=False).logits[0, -1]
            # Overflowed logits (NaN/inf) would make both paths pick the same token and look
            # like agreement: the pair is recorded as non-finite and stops there.
            bad = [n for n, z in (("cache-ON", z_on), ("cache-OFF", z_off))
                   if not bool(torch.isfinite(z).all())]
            if bad:
                non_finite = {"step": step, "paths": bad}
                break
            if on == off and not done_on:
                d = (z_on.double() - z_off.double()).abs().max().item()
                max_abs = max(max_abs, d)
                flips += int(torch.argmax(z_on) != torch.argmax(z_off))
            if not done_on:
                on.append(choose(torch, z_on, strategy, gen_for(step)))
                done_on = on[-1] in eos
            if not done_off:
                off.append(choose(torch, z_off, strategy, gen_for(step)))
                done_off = off[-1] in eos
            if done_on and done_off:
                break
            if not done_on:
                out = model(torch.tensor([[on[-1]]], device=dev), past_key_values=past, use_cache=True)
                past, z_on = out.past_key_values, out.logits[0, -1]
    tau = next((i for i, (x, y) in enumerate(zip(on, off)) if x != y),
               None if len(on) == len(off) else min(len(on), len(off)))
    if non_finite:
        tau = None
    return {"diverged": tau is not None, "tau": tau, "max_abs": max_abs, "flips": flips,
            "non_finite": non_finite,
            "tokens_on": len(on), "tokens_off": len(off)}


if __name__ == "__main__":
    sys.exit(main())
