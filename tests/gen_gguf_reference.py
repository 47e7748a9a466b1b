#!/usr/bin/env python3
"""Reference fixtures for kvcredit's GGUF loader, tokenizer and chat templates.

Parts (run all by default, or name some: `python tests/gen_gguf_reference.py dequant chat`):

  dequant   tests/fixtures/gguf/dequant.gguf: for every supported ggml type a [4, 512] tensor
            (random blocks with finite scales; quantized from random floats where gguf-py can
            quantize) next to `<type>.expected`, its F32 de-quantization by gguf-py
            (`gguf.quants.dequantize`, what transformers uses). No model needed.
  tensors   tests/fixtures/gguf/<model>.tensors.json: for a sample of tensors of every quant
            type, transformers' de-quantized, renamed and quirk-corrected state dict entry
            (`load_gguf_checkpoint`): shape, float64 sum and sum of squares, and 64 values at
            fixed flat indices.
  logits    tests/fixtures/gguf/<model>.logits.json: token ids of a fixed prompt and, at every
            position, transformers' float32 logits for the top-50 ids and 50 fixed random ids
            (`AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)`).
  chat      tests/fixtures/tokenizer/chat_expected.json: transformers' `apply_chat_template`
            output for the GGUF chat templates.
  llamacpp  tests/fixtures/tokenizer/llamacpp_ids.json: llama.cpp's own tokenization of
            tests/fixtures/tokenizer/sample_texts.json for each model (parse_special false and
            true, and with BOS), by the llama.cpp of the PyPI sdist llama-cpp-python==0.3.36.
            Needs LLAMACPP_TOKENIZE: the binary built from
            tests/fixtures/tokenizer/llamacpp_tokenize.cpp (build steps in that file).

Models are read from $KVCREDIT_HOME/models/<name>/<name>.gguf (default ~/.cache/kvcredit);
`kvcredit models pull` puts them there. Needs: torch, transformers, gguf, numpy.
"""
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
FIX_GGUF = ROOT / "fixtures" / "gguf"
FIX_TOK = ROOT / "fixtures" / "tokenizer"
HOME = Path(os.environ.get("KVCREDIT_HOME", Path.home() / ".cache" / "kvcredit"))
MODELS = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m"]


def model_path(name):
    p = HOME / "models" / name / f"{name}.gguf"
    if not p.exists():
        sys.exit(f"missing {p}: run `kvcredit models pull {name}` first")
    return p


# ---------------------------------------------------------------------------------------------
def gen_dequant():
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(20240607)
    shape = (4, 512)
    # byte offsets of the f16 scale fields inside each block
    half_fields = {
        T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
        T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    }
    types = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
             T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
    FIX_GGUF.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(FIX_GGUF / "dequant.gguf", arch="dequant-test")
    w.add_string("general.description", "random blocks and gguf-py's de-quantization of them")
    for t in types:
        x = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if t in (T.F32, T.F16, T.BF16):
            raw = quantize(x, t)
        else:
            block, nbytes = gguf.GGML_QUANT_SIZES[t]
            n_blocks = x.size // block
            raw = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
            for off in half_fields[t]:
                scale = (rng.uniform(-0.02, 0.02, size=n_blocks)).astype(np.float16)
                raw[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
            raw = raw.reshape(shape[0], -1)
        expected = dequantize(raw, t).astype(np.float32).reshape(shape)
        name = t.name.lower()
        w.add_tensor(name, raw, raw_dtype=t)
        w.add_tensor(f"{name}.expected", expected)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("wrote", FIX_GGUF / "dequant.gguf")


# ---------------------------------------------------------------------------------------------
def flat_indices(n, k, seed):
    return sorted(np.random.default_rng(seed).choice(n, size=min(k, n), replace=False).tolist())


def gen_tensors():
    import gguf
    import torch
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers import AutoModelForCausalLM

    for name in MODELS:
        path = model_path(name)
        reader = gguf.GGUFReader(path)
        qtype = {t.name: t.tensor_type.name for t in reader.tensors}
        # a sample: per quant type, the first two and the last tensor of that type
        by_type = {}
        for t in reader.tensors:
            by_type.setdefault(t.tensor_type.name, []).append(t.name)
        sample = set()
        for names in by_type.values():
            sample.update(names[:2] + names[-1:])
        # always include q/k of a layer (permutation) and the norms (gemma offset)
        sample.update({"blk.1.attn_q.weight", "blk.1.attn_k.weight", "blk.1.attn_norm.weight",
                       "blk.1.ffn_norm.weight", "output_norm.weight", "token_embd.weight"})
        sample.update(n for n in qtype if n.startswith("blk.1.") and "norm" in n)
        sample = sorted(s for s in sample if s in qtype)

        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
        tensors = parsed["tensors"]
        from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map, TENSOR_PROCESSORS, TensorProcessor
        arch = reader.fields["general.architecture"].contents()
        proc = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed["config"])
        mapping = get_gguf_hf_weights_map(model, proc)
        out = []
        for g in sample:
            hf = mapping.get(g)
            if hf is None or hf not in tensors:
                continue
            t = tensors[hf].to(torch.float32).contiguous()
            flat = t.reshape(-1).numpy()
            idx = flat_indices(flat.size, 64, seed=len(out) + 1)
            out.append({
                "gguf": g, "hf": hf, "type": qtype[g], "shape": list(t.shape),
                "sum": float(flat.astype(np.float64).sum()),
                "sumsq": float((flat.astype(np.float64) ** 2).sum()),
                "indices": idx, "values": [float(flat[i]) for i in idx],
            })
        (FIX_GGUF / f"{name}.tensors.json").write_text(json.dumps({"model": name, "tensors": out}, indent=1))
        print("wrote", name, len(out), "tensors")


# ---------------------------------------------------------------------------------------------
PROMPTS = {
    "smollm2-135m-instruct": "The capital of France is Paris. In 2023, about 2.1 million people",
    "qwen2.5-coder-0.5b-instruct": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "gemma-3-270m": "The quick brown fox jumps over the lazy dog. Then it",
}


def gen_logits():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    for name in MODELS:
        path = model_path(name)
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        ids = tok(PROMPTS[name], add_special_tokens=True)["input_ids"]
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        model.eval()
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        vocab = logits.shape[-1]
        fixed = flat_indices(vocab, 50, seed=7)
        rows = []
        for p in range(len(ids)):
            top = torch.topk(logits[p], 50).indices.tolist()
            sel = sorted(set(top) | set(fixed))
            rows.append({"argmax": int(logits[p].argmax()), "ids": sel,
                         "logits": [float(logits[p, i]) for i in sel]})
        out = {"model": name, "prompt": PROMPTS[name], "token_ids": ids, "vocab_size": vocab,
               "transformers": __import__("transformers").__version__, "positions": rows}
        (FIX_GGUF / f"{name}.logits.json").write_text(json.dumps(out))
        print("wrote", name, "logits for", len(ids), "tokens")


# ---------------------------------------------------------------------------------------------
def gen_chat():
    from transformers import AutoTokenizer

    cases = []
    convs = {
        "system_user": [{"role": "system", "content": "You are a careful math tutor."},
                        {"role": "user", "content": "What is 17 * 23? Answer with #### N."}],
        "user_only": [{"role": "user", "content": "  Write hello world in Rust.\n"}],
        "multi_turn": [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "Hi!"},
                       {"role": "assistant", "content": "Hello. How can I help?"},
                       {"role": "user", "content": "Count to 3 — in Français, s'il te plaît."}],
    }
    for name in ["qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"]:
        path = model_path(name)
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        for conv_name, msgs in convs.items():
            for gen in (True, False):
                text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
                cases.append({"model": name, "conversation": conv_name, "messages": msgs,
                              "add_generation_prompt": gen, "bos_token": tok.bos_token,
                              "eos_token": tok.eos_token, "expected": text})
    FIX_TOK.mkdir(parents=True, exist_ok=True)
    out = {"transformers": __import__("transformers").__version__, "cases": cases}
    (FIX_TOK / "chat_expected.json").write_text(json.dumps(out, indent=1, ensure_ascii=False))
    print("wrote", len(cases), "chat cases")


# ---------------------------------------------------------------------------------------------
def gen_llamacpp():
    """Needs LLAMACPP_TOKENIZE: the binary built from tests/fixtures/tokenizer/llamacpp_tokenize.cpp."""
    import subprocess

    tool = os.environ.get("LLAMACPP_TOKENIZE")
    if not tool:
        sys.exit("set LLAMACPP_TOKENIZE to the llamacpp_tokenize binary (see its source for how to build)")
    texts = json.loads((FIX_TOK / "sample_texts.json").read_text())["texts"]
    stdin = b"".join(b"%d\n" % len(t.encode()) + t.encode() for t in texts)
    out = {"source": "llama.cpp from the sdist llama-cpp-python==0.3.36 (vendor/llama.cpp), "
                     "via tests/fixtures/tokenizer/llamacpp_tokenize.cpp",
           "models": {}}
    for name in MODELS:
        res = subprocess.run([tool, str(model_path(name))], input=stdin, capture_output=True, check=True)
        lines = res.stdout.decode().split("\n")
        ids = [[int(x) for x in l.split()] for l in lines[: 3 * len(texts)]]
        out["models"][name] = [{"plain": ids[3 * i], "special": ids[3 * i + 1], "with_bos": ids[3 * i + 2]}
                               for i in range(len(texts))]
    (FIX_TOK / "llamacpp_ids.json").write_text(json.dumps(out))
    print("wrote llama.cpp ids for", len(texts), "texts")


PARTS = {"dequant": gen_dequant, "tensors": gen_tensors, "logits": gen_logits, "chat": gen_chat,
         "llamacpp": gen_llamacpp}

if __name__ == "__main__":
    wanted = sys.argv[1:] or list(PARTS)
    for part in wanted:
        if part not in PARTS:
            sys.exit(f"unknown part {part!r}; choose from {sorted(PARTS)}")
        PARTS[part]()
