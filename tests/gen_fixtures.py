#!/usr/bin/env python3
"""Generate tiny random-weight Hugging Face decoder fixtures + reference outputs.

Run from the repository root:

    /work/main/.venv/bin/python tests/gen_fixtures.py

Needs `torch`, `transformers` (5.x) and `safetensors` (CPU is enough, no hub access).
Everything is written under tests/fixtures/hf/ (the directory is wiped first).
The script is deterministic: fixed seeds, one CPU thread, so re-running it
reproduces the same bytes with the same torch/transformers versions.

Per fixture directory:
  config.json                      HF config as written by save_pretrained
  model.safetensors                weights (or model-0000X-of-0000N.safetensors + model.safetensors.index.json)
  reference.safetensors            input_ids [1,T] i64, logits [1,T,V] f32,
                                   prompt_ids [1,P] i64, generated_ids [1,P+20] i64,
                                   generated_logits [1,20,V] f32 (raw logits of each greedy step)
  expected.json                    derived values the Rust config parser must reproduce

`<name>_v4/` directories hold the same weights/reference with config.json rewritten
in the transformers 4.x dialect (top-level rope_theta / rope_scaling, no
rope_parameters, no layer_types); they are verified by re-loading them with the
installed transformers and comparing logits bitwise.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch

import safetensors
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

ROOT = Path(__file__).resolve().parent / "fixtures" / "hf"

T = 24  # teacher-forced sequence length
P = 6  # prompt length for generate (prompt_ids == input_ids[:, :P])
NEW = 20  # greedy new tokens
MIN_GAP = 1e-2  # required top1-top2 logit gap at every greedy step (brief asks > 1e-3)
MIN_ABLATION = 1e-2  # every ablation must move some logit by at least this much
MAX_FP32_NOISE = 5e-5  # max |fp32 logits - fp64 logits| of the HF model itself (else re-seed)
MIN_DISTINCT = 8  # greedy continuation must not degenerate into repeating one token
MAX_TRIES = 20

# Tiny shapes shared by all fixtures. intermediate_size is 80 (not 128) to keep
# the whole fixture tree small (under 9 MB with the _v4 copies, which git stores once); 80 != hidden (64) and != 2*hidden so
# transposed/mixed-up MLP shapes are still caught.
VOCAB = 128
HIDDEN = 64
INTER = 80
HEADS = 4
KV_HEADS = 2

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=INTER,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,  # so generate always runs all NEW steps
    pad_token_id=None,
    use_cache=True,
)

# ---------------------------------------------------------------------------
# Fixture specs
# ---------------------------------------------------------------------------
# init: default std per parameter kind; "overrides": list of (substring, mean, std)
# matched against parameter names (first match wins).
# gemma-style norms are (1 + w): their "norm" mean is 0 instead of 1.

LLAMA_INIT = dict(emb=1.0, head=0.3, proj=0.15, bias=0.2, norm_mean=1.0, norm_std=0.2, overrides=[])
# Tied embeddings: the residual stream must not be dominated by the input token's own embedding,
# otherwise logits = norm(h) @ E^T just repeat the current token and greedy decoding degenerates.
# Hence small embeddings for tied models (Gemma additionally multiplies them by sqrt(hidden)=8),
# and a large final-norm weight to bring the logits back to a useful range.
LLAMA_TIED_INIT = dict(LLAMA_INIT, emb=0.3)
GEMMA_INIT = dict(emb=0.02, head=None, proj=0.15, bias=0.2, norm_mean=0.0, norm_std=0.2, overrides=[])


def cfg_drop_sliding(d):
    d = copy.deepcopy(d)
    d["sliding_window"] = None
    return d


def cfg_all_full(d):
    d = copy.deepcopy(d)
    d["layer_types"] = ["full_attention"] * len(d["layer_types"])
    return d


def cfg_rope_default(d):
    d = copy.deepcopy(d)
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": d["rope_parameters"]["rope_theta"]}
    return d


def cfg_set(key, value):
    def f(d):
        d = copy.deepcopy(d)
        d[key] = value
        return d

    return f


def sd_scale(pattern, fn):
    def f(sd):
        sd = dict(sd)
        for k in list(sd):
            if pattern in k:
                sd[k] = fn(sd[k])
        return sd

    return f


def gemma3_local_theta_global(d):
    d = copy.deepcopy(d)
    d["rope_parameters"]["sliding_attention"]["rope_theta"] = d["rope_parameters"]["full_attention"]["rope_theta"]
    return d


def gemma3_no_global_scaling(d):
    d = copy.deepcopy(d)
    fa = d["rope_parameters"]["full_attention"]
    d["rope_parameters"]["full_attention"] = {"rope_type": "default", "rope_theta": fa["rope_theta"]}
    return d


def gemma3_global_rope_everywhere(d):
    d = copy.deepcopy(d)
    d["rope_parameters"]["sliding_attention"] = copy.deepcopy(d["rope_parameters"]["full_attention"])
    return d


def rope_set(**kw):
    """Set (or, with None, delete) keys of a flat `rope_parameters`."""

    def f(d):
        d = copy.deepcopy(d)
        for k, v in kw.items():
            if v is None:
                d["rope_parameters"].pop(k, None)
            else:
                d["rope_parameters"][k] = v
        return d

    return f


def v4_type_key(name):
    """4.x `rope_scaling` spelled with `type` (as hub Qwen2.5/Phi-3 configs are), renamed to `name`."""

    def f(rs, d):
        rs = dict(rs)
        rs.pop("rope_type")
        rs["type"] = name
        return rs

    return f


def v4_phi3_su(rs, d):
    """Early hub Phi-3-128k style: `type: su`, no partial factor. (The original length stays in
    the object too: transformers 5.x standardizes `su` before renaming it and would miss it.)"""
    rs = v4_type_key("su")(rs, d)
    rs.pop("partial_rotary_factor", None)
    return rs


SPECS = [
    dict(
        name="llama",
        model_type="llama",
        seed=1000,
        config=dict(
            num_hidden_layers=2,
            head_dim=16,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        init=LLAMA_INIT,
        ablations=[
            ("rope_theta 10000 -> 500000", cfg_set("rope_parameters", {"rope_type": "default", "rope_theta": 500000.0}), None),
        ],
        exercises="Plain Llama: untied lm_head, GQA 4q/2kv, head_dim 16, default RoPE theta 1e4, SiLU MLP, RMSNorm w*x.",
    ),
    dict(
        name="llama3_rope_tied",
        model_type="llama",
        seed=2000,
        v4=True,
        config=dict(
            num_hidden_layers=2,
            head_dim=16,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            # original_max_position_embeddings=32 (not 16) so that with head_dim 16 / theta 1e4 all three
            # llama3 branches occur: wavelen(k=0)=6.28 < 32/4 (kept), wavelen(k=1)=19.9 in [8,32]
            # (smoothed), wavelen(k>=2) > 32 (divided by factor).
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        init=LLAMA_TIED_INIT,
        ablations=[("llama3 rope scaling removed", cfg_rope_default, None)],
        exercises="Llama with tie_word_embeddings=True (no lm_head.weight in the checkpoint) and llama3 RoPE scaling "
        "(factor 8, low 1, high 4, original_max 32: inv_freq has an unscaled, a smoothed and scaled components).",
    ),
    dict(
        name="llama_linear_rope",
        model_type="llama",
        seed=3000,
        config=dict(
            num_hidden_layers=2,
            head_dim=16,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        ),
        init=LLAMA_INIT,
        ablations=[("linear rope scaling removed", cfg_rope_default, None)],
        exercises="Llama with linear RoPE scaling (positions divided by factor 2.0, i.e. inv_freq / 2).",
    ),
    dict(
        name="mistral_sw",
        model_type="mistral",
        seed=4000,
        v4=True,
        config=dict(
            num_hidden_layers=3,
            head_dim=16,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            sliding_window=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        init=LLAMA_INIT,
        ablations=[("sliding_window 8 -> None", cfg_drop_sliding, None)],
        exercises="Mistral: every layer uses sliding_window=8 < T=24 (query i sees keys i-7..i); 3 layers; "
        "generate runs past the window so the cache must drop/mask old keys.",
    ),
    dict(
        name="qwen2",
        model_type="qwen2",
        seed=5000,
        config=dict(
            num_hidden_layers=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        init=LLAMA_INIT,
        ablations=[("q/k/v biases zeroed", None, sd_scale("_proj.bias", torch.zeros_like))],
        exercises="Qwen2: non-zero q/k/v biases (o_proj has none), no head_dim key in config (derived 64/4=16), "
        "rope_theta 1e6, use_sliding_window=false (sliding_window written as null).",
    ),
    dict(
        name="qwen3",
        model_type="qwen3",
        seed=6000,
        config=dict(
            num_hidden_layers=2,
            head_dim=16,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        init=dict(LLAMA_INIT, overrides=[("q_norm", 1.0, 0.4), ("k_norm", 1.0, 0.4)]),
        ablations=[("q_norm/k_norm weights -> 1", None, sd_scale("_norm.weight", lambda t: torch.ones_like(t)))],
        exercises="Qwen3: per-head RMSNorm on q and k (weights 1+0.4*randn, applied before RoPE), no biases, "
        "explicit head_dim 16, rope_theta 1e6.",
    ),
    dict(
        name="gemma2",
        model_type="gemma2",
        seed=7000,
        v4=True,
        config=dict(
            num_hidden_layers=4,
            head_dim=32,
            max_position_embeddings=64,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            sliding_window=8,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        # final norm (1+w) ~ 62.5 so that logits = norm(h) @ (small E)^T have std ~9 and some raw logits
        # exceed the cap of 30. q/k stay at the default 0.15: larger q/k make the attention soft-cap bite
        # harder but blow up the fp32 rounding noise (q/k 0.45: ~6e-4 vs fp64), see MAX_FP32_NOISE.
        init=dict(GEMMA_INIT, overrides=[("model.norm.weight", 61.5, 6.0)]),
        ablations=[
            ("attn_logit_softcapping 50 -> None", cfg_set("attn_logit_softcapping", None), None),
            ("final_logit_softcapping 30 -> None", cfg_set("final_logit_softcapping", None), None),
            ("query_pre_attn_scalar 24 -> head_dim 32", cfg_set("query_pre_attn_scalar", 32), None),
            ("all layers full attention", cfg_all_full, None),
        ],
        exercises="Gemma2: head_dim 32 != hidden/heads, scale 1/sqrt(query_pre_attn_scalar=24), attention "
        "soft-cap 50 and final logit soft-cap 30 (both active), alternating sliding(8)/full layers "
        "(even layers sliding), (1+w) RMSNorms incl. pre/post feed-forward norms, sqrt(hidden) embedding "
        "scale, gelu_pytorch_tanh, tied embeddings.",
    ),
    dict(
        name="gemma3",
        model_type="gemma3_text",
        seed=8000,
        config=dict(
            num_hidden_layers=6,
            head_dim=16,
            max_position_embeddings=64,
            query_pre_attn_scalar=24,
            sliding_window=8,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            # like the real 4B+ checkpoints: linear scaling only on the global (full) layers
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
        # final norm (1+w) ~ 18.75: logits std ~3 despite the small embeddings
        init=dict(GEMMA_INIT, overrides=[("q_norm", 0.0, 0.4), ("k_norm", 0.0, 0.4), ("model.norm.weight", 17.75, 1.8)]),
        ablations=[
            ("all layers full attention", cfg_all_full, None),
            ("local rope_theta 1e4 -> 1e6", gemma3_local_theta_global, None),
            ("global linear scaling removed", gemma3_no_global_scaling, None),
            ("global rope params on all layers", gemma3_global_rope_everywhere, None),
            ("query_pre_attn_scalar 24 -> head_dim 16", cfg_set("query_pre_attn_scalar", 16), None),
            ("q_norm/k_norm weights -> 0 (i.e. 1+0)", None, sd_scale("_norm.weight", torch.zeros_like)),
        ],
        exercises="Gemma3 text (model_type gemma3_text): q/k (1+w) RMSNorm, 6 layers with the default 5:1 "
        "pattern (layers 0-4 sliding(8), layer 5 full), per-layer-type RoPE (sliding: theta 1e4 default; "
        "full: theta 1e6 + linear factor 8), scale 1/sqrt(24), no soft-capping, tied embeddings.",
    ),
    dict(
        name="qwen2_yarn",
        model_type="qwen2",
        seed=11000,
        v4=True,
        v4_scaling=v4_type_key("yarn"),
        config=dict(
            num_hidden_layers=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            # Qwen2.5 long-context style (factor 4 over an original length); with head_dim 16 and
            # theta 1e6 the ramp runs from dimension 1 to 4 of 8, so kept, blended and divided
            # frequencies all occur; attention factor 0.1 ln 4 + 1.
            rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 2048},
        ),
        init=LLAMA_INIT,
        ablations=[
            ("yarn removed", cfg_rope_default, None),
            ("yarn attention_factor -> 1", rope_set(attention_factor=1.0), None),
        ],
        exercises="Qwen2 with YaRN RoPE scaling (factor 4, original_max_position_embeddings 2048, beta_fast/slow "
        "defaults 32/1, truncated ramp over dimensions 1..4, cos/sin scaled by 0.1 ln 4 + 1).",
    ),
    dict(
        name="llama_yarn_mscale",
        model_type="llama",
        seed=12000,
        config=dict(
            num_hidden_layers=2,
            head_dim=16,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            # No original_max_position_embeddings: it defaults to max_position_embeddings (64).
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
                "mscale": 0.8,
                "mscale_all_dim": 0.5,
                "truncate": False,
            },
        ),
        init=LLAMA_INIT,
        ablations=[
            ("yarn removed", cfg_rope_default, None),
            ("truncate False -> True", rope_set(truncate=True), None),
            ("mscale/mscale_all_dim removed", rope_set(mscale=None, mscale_all_dim=None), None),
        ],
        exercises="Llama with YaRN's optional keys: beta_fast 16, beta_slow 2, truncate false (fractional ramp ends), "
        "attention factor from mscale 0.8 / mscale_all_dim 0.5, original length defaulting to max_position_embeddings.",
    ),
    dict(
        name="llama_dynamic",
        model_type="llama",
        seed=13000,
        v4=True,
        v4_scaling=v4_type_key("dynamic"),
        per_position=True,
        config=dict(
            num_hidden_layers=2,
            head_dim=16,
            # Short trained length: positions 16.. (past the prompt) are rotated with a grown base.
            max_position_embeddings=16,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        ),
        init=LLAMA_INIT,
        ablations=[("dynamic scaling removed", cfg_rope_default, None)],
        exercises="Llama with dynamic-NTK RoPE scaling (factor 2, max_position_embeddings 16 < T): reference logits "
        "from the cached path (see below).",
    ),
    dict(
        name="olmo2",
        model_type="olmo2",
        seed=14000,
        config=dict(
            num_hidden_layers=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        ),
        init=dict(LLAMA_INIT, overrides=[("q_norm", 1.0, 0.4), ("k_norm", 1.0, 0.4)]),
        ablations=[
            ("q_norm/k_norm weights -> 1", None, sd_scale("_norm.weight", torch.ones_like)),
            ("post-norm weights -> 1", None, sd_scale("layernorm.weight", torch.ones_like)),
        ],
        exercises="OLMo-2: post-norm blocks (post_attention_layernorm / post_feedforward_layernorm on the sublayer "
        "outputs, no input norms), q/k RMSNorm over the whole projection (64 and 32 wide, not per head), "
        "weights 1+0.4*randn, rope_theta 5e5.",
    ),
    dict(
        name="phi3",
        model_type="phi3",
        seed=15000,
        config=dict(
            num_hidden_layers=2,
            max_position_embeddings=64,
            original_max_position_embeddings=64,
            tie_word_embeddings=False,
            sliding_window=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        init=LLAMA_INIT,
        ablations=[("sliding_window 8 -> None", cfg_drop_sliding, None)],
        exercises="Phi-3: fused qkv_proj [(4+2+2)*16, 64] and gate_up_proj [2*80, 64] (gate rows first), "
        "sliding_window 8 on every layer, default RoPE.",
    ),
    dict(
        name="phi3_longrope",
        model_type="phi3",
        seed=16000,
        v4=True,
        v4_scaling=v4_phi3_su,
        config=dict(
            num_hidden_layers=2,
            max_position_embeddings=128,
            # factor = 128 / 32 = 4: attention factor sqrt(1 + ln 4 / ln 32). Sequences stay within the
            # original length 32, where transformers uses short_factor (see README).
            original_max_position_embeddings=32,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.05, 1.1, 1.2, 1.4, 1.7, 2.0, 2.5],
                "long_factor": [1.0, 1.3, 1.9, 2.8, 4.0, 5.5, 7.0, 8.0],
            },
        ),
        init=LLAMA_INIT,
        ablations=[
            ("longrope removed", cfg_rope_default, None),
            ("longrope attention_factor -> 1", rope_set(attention_factor=1.0), None),
        ],
        exercises="Phi-3 with LongRoPE (`su` in the 4.x dialect) within original_max_position_embeddings 32: "
        "frequencies divided by short_factor, cos/sin scaled by sqrt(1 + ln 4 / ln 32).",
    ),
]


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def build_config(spec):
    kw = dict(COMMON)
    kw.update(copy.deepcopy(spec["config"]))
    cfg = AutoConfig.for_model(spec["model_type"], **kw)
    cfg.dtype = torch.float32
    return cfg


def new_model(cfg):
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    m.eval()
    return m


def init_weights(model, init, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied params appear once
            mean, std = None, None
            for pat, m_, s_ in init["overrides"]:
                if pat in name:
                    mean, std = m_, s_
                    break
            if mean is None:
                if "embed_tokens" in name:
                    mean, std = 0.0, init["emb"]
                elif name.startswith("lm_head"):
                    mean, std = 0.0, init["head"]
                elif name.endswith(".bias"):
                    mean, std = 0.0, init["bias"]
                elif p.dim() == 1:  # every 1-D weight in these models is an RMSNorm weight
                    mean, std = init["norm_mean"], init["norm_std"]
                else:
                    mean, std = 0.0, init["proj"]
            p.copy_(mean + std * torch.randn(p.shape, generator=g, dtype=torch.float32))


@torch.no_grad()
def teacher_forced(model, ids):
    return model(input_ids=ids, use_cache=False).logits.float()


@torch.no_grad()
def cached_forward(model, ids):
    """Logits of every position fed through the KV cache as `generate` feeds it: a prefill of
    the first P tokens, then one token per step."""
    out = model(input_ids=ids[:, :P], use_cache=True)
    logits, past = [out.logits], out.past_key_values
    for t in range(P, ids.shape[1]):
        out = model(input_ids=ids[:, t : t + 1], past_key_values=past, use_cache=True)
        logits.append(out.logits)
        past = out.past_key_values
    return torch.cat(logits, dim=1).float()


def ref_forward(spec):
    """How a fixture's reference logits are computed: uncached, or (RoPE whose frequencies follow
    the sequence length: dynamic NTK, LongRoPE) through the cache, the one path on which
    transformers rotates each position independently of the tokens after it."""
    return cached_forward if spec.get("per_position") else teacher_forced


@torch.no_grad()
def greedy(model, prompt):
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=NEW,
        do_sample=False,
        use_cache=True,
        eos_token_id=None,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    seq = out.sequences
    logits = torch.stack(out.logits, dim=1).float()  # [1, NEW, V]
    return seq, logits


def top2_gap(x):
    v = torch.topk(x, 2, dim=-1).values
    return (v[..., 0] - v[..., 1]).min().item()


def layer_types_of(cfg):
    lt = getattr(cfg, "layer_types", None)
    return list(lt) if lt is not None else None


def rope_params_for_layer(cfg, i):
    rp = cfg.rope_parameters
    lt = layer_types_of(cfg)
    if lt is not None and lt[i] in rp:
        return rp[lt[i]]
    return rp


def derive_expected(model, cfg, spec):
    n = cfg.num_hidden_layers
    layers = model.model.layers
    attn0 = layers[0].self_attn
    scales = [float(l.self_attn.scaling) for l in layers]
    assert len(set(scales)) == 1, scales
    head_dims = {int(l.self_attn.head_dim) for l in layers}
    assert len(head_dims) == 1
    lt = layer_types_of(cfg)

    # sliding windows per layer
    windows = []
    for i, l in enumerate(layers):
        if cfg.model_type in ("mistral", "phi3"):
            w = cfg.sliding_window  # mistral, phi3: every layer, no layer_types
        elif lt is not None and lt[i] == "sliding_attention":
            w = cfg.sliding_window
        else:
            w = None
        attr = getattr(l.self_attn, "sliding_window", "absent")
        if attr != "absent":
            assert attr == w, (i, attr, w)
        windows.append(w)

    rot = model.model.rotary_emb
    layer_rope = []
    for i in range(n):
        # (a 4.x `type` spelling stays next to the `rope_type` derived from it)
        rp = {k: v for k, v in rope_params_for_layer(cfg, i).items() if k != "type"}
        key = lt[i] if (lt is not None and lt[i] in cfg.rope_parameters) else None
        if key is not None:
            inv = getattr(rot, f"{key}_inv_freq")
            att = getattr(rot, f"{key}_attention_scaling")
        else:
            # dynamic NTK replaces `inv_freq` as sequences grow; the trained-length one is kept
            inv = getattr(rot, "original_inv_freq", rot.inv_freq)
            att = rot.attention_scaling
        rp["inv_freq"] = [float(x) for x in inv.tolist()]
        rp["attention_scaling"] = float(att)
        layer_rope.append(rp)

    flat = "rope_theta" in cfg.rope_parameters
    rope_theta = cfg.rope_parameters["rope_theta"] if flat else cfg.rope_parameters["full_attention"]["rope_theta"]

    emb = model.model.embed_tokens
    embed_scale = float(emb.embed_scale.item()) if hasattr(emb, "embed_scale") else 1.0
    gemma_norm = cfg.model_type.startswith("gemma")
    return {
        "arch": type(model).__name__,
        "model_type": cfg.model_type,
        "num_layers": n,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": head_dims.pop(),
        "softmax_scale": scales[0],
        "layer_windows": windows,
        "layer_types": lt,
        "rope_theta": float(rope_theta),
        "layer_rope": layer_rope,
        "tie_word_embeddings": bool(cfg.tie_word_embeddings),
        "attn_logit_softcapping": getattr(cfg, "attn_logit_softcapping", None),
        "final_logit_softcapping": getattr(cfg, "final_logit_softcapping", None),
        "embed_scale": embed_scale,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rms_norm_weight_offset": 1.0 if gemma_norm else 0.0,
        "qkv_bias": getattr(attn0, "q_proj", getattr(attn0, "qkv_proj", None)).bias is not None,
        "o_proj_bias": attn0.o_proj.bias is not None,
        "qk_norm": cfg.model_type in ("qwen3", "gemma3_text", "olmo2"),
        "qk_norm_across_heads": cfg.model_type == "olmo2",
        "post_norm_blocks": cfg.model_type == "olmo2",
        "fused_qkv_gate_up": cfg.model_type == "phi3",
        "hidden_act": getattr(cfg, "hidden_activation", None) or cfg.hidden_act,
        "gemma_pre_post_ffn_norms": cfg.model_type in ("gemma2", "gemma3_text"),
    }


def to_v4_config(d5: dict, model_type: str, scaling=None) -> dict:
    """Rewrite a 5.x config.json dict into the transformers 4.x dialect (`scaling` rewrites the
    `rope_scaling` object further, e.g. to hub spellings)."""
    d = copy.deepcopy(d5)
    rp = d.pop("rope_parameters")
    d.pop("layer_types", None)
    assert "rope_theta" in rp, "only flat rope_parameters are rewritten"
    rp = dict(rp)
    d["rope_theta"] = rp.pop("rope_theta")
    d["rope_scaling"] = None if rp.get("rope_type", "default") == "default" else rp
    if scaling is not None and d["rope_scaling"] is not None:
        d["rope_scaling"] = scaling(d["rope_scaling"], d)
    if "dtype" in d:
        d["torch_dtype"] = d.pop("dtype")
    if model_type == "gemma2":
        d["hidden_act"] = d["hidden_activation"]  # 4.x hub gemma2 configs carry both keys
        d.pop("use_bidirectional_attention", None)  # added late in 4.x; absent from older configs
    d["transformers_version"] = "4.46.3"
    return dict(sorted(d.items()))


def dir_size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def write_json(path: Path, obj):
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def tidy_saved(d: Path):
    gc = d / "generation_config.json"
    if gc.exists():
        gc.unlink()


def load_dir(d: Path):
    m = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32)
    m.eval()
    return m


def check_against_reference(model, ref, what, fwd=teacher_forced):
    lg = fwd(model, ref["input_ids"])
    assert torch.equal(lg, ref["logits"]), f"{what}: logits differ (max {(lg - ref['logits']).abs().max()})"
    seq, _ = greedy(model, ref["prompt_ids"])
    assert torch.equal(seq, ref["generated_ids"]), f"{what}: generate differs"


# ---------------------------------------------------------------------------
# main per-fixture work
# ---------------------------------------------------------------------------


def make_fixture(spec):
    name = spec["name"]
    cfg = build_config(spec)
    fwd = ref_forward(spec)
    for attempt in range(MAX_TRIES):
        seed = spec["seed"] + attempt
        torch.manual_seed(seed)
        model = new_model(cfg)
        init_weights(model, spec["init"], seed)
        g = torch.Generator().manual_seed(seed + 1)
        input_ids = torch.randint(0, VOCAB, (1, T), generator=g, dtype=torch.int64)
        prompt = input_ids[:, :P].clone()
        logits = fwd(model, input_ids)
        seq, gen_logits = greedy(model, prompt)
        assert seq.shape == (1, P + NEW), seq.shape
        gap = top2_gap(gen_logits)
        distinct = len(set(seq[0, P:].tolist()))
        noise = (fwd(copy.deepcopy(model).double(), input_ids).double() - logits.double()).abs().max().item()
        if gap > MIN_GAP and distinct >= MIN_DISTINCT and noise <= MAX_FP32_NOISE and torch.isfinite(logits).all():
            break
        print(f"  {name}: seed {seed} min gap {gap:.2e}, {distinct} distinct new tokens, fp32 noise {noise:.1e}: re-seeding")
    else:
        raise SystemExit(f"{name}: no seed with a robust greedy path")

    stats = {"seed": seed, "min_greedy_gap": gap, "distinct_new": distinct, "fp32_noise": noise, "logit_std": logits.std().item(), "logit_absmax": logits.abs().max().item()}

    if spec.get("per_position"):
        # transformers' own uncached forward scales every position by the longest one: it
        # differs from its cached path (reported, not used)
        stats["hf_uncached_vs_cached"] = (teacher_forced(model, input_ids) - logits).abs().max().item()
    # cache path == no-cache path: greedy tokens recomputed without cache must match
    full = fwd(model, seq[:, :-1])
    steps = full[:, P - 1 :, :]
    assert torch.equal(steps.argmax(-1), seq[:, P:]), f"{name}: cached generate != no-cache greedy"
    stats["gen_vs_nocache_maxdiff"] = (steps - gen_logits).abs().max().item()
    assert stats["gen_vs_nocache_maxdiff"] < 1e-3
    # prompt prefix consistency (prompt == input_ids[:, :P])
    assert torch.allclose(full[:, :P], logits[:, :P], atol=1e-4)

    if getattr(cfg, "final_logit_softcapping", None):
        with torch.no_grad():
            h = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
            raw = model.lm_head(h)
        cap = cfg.final_logit_softcapping
        stats["raw_logits_over_cap"] = int((raw.abs() > cap).sum().item())
        stats["raw_logit_absmax"] = raw.abs().max().item()
        assert stats["raw_logits_over_cap"] > 0, f"{name}: final soft-capping does not bite"

    ref = {
        "input_ids": input_ids.contiguous(),
        "logits": logits.contiguous(),
        "prompt_ids": prompt.contiguous(),
        "generated_ids": seq.contiguous(),
        "generated_logits": gen_logits.contiguous(),
    }

    # ablations: each feature the fixture is meant to exercise must visibly change the logits
    base_dict = cfg.to_dict()
    sd = model.state_dict()
    stats["ablations"] = []
    for desc, cfg_fn, sd_fn in spec.get("ablations", []):
        d = cfg_fn(base_dict) if cfg_fn else copy.deepcopy(base_dict)
        c2 = type(cfg).from_dict(d)
        m2 = new_model(c2)
        m2.load_state_dict(sd_fn(sd) if sd_fn else sd)
        diff = (fwd(m2, input_ids) - logits).abs().max().item()
        stats["ablations"].append((desc, diff))
        assert diff > MIN_ABLATION, f"{name}: ablation '{desc}' changes logits by only {diff}"

    expected = derive_expected(model, cfg, spec)

    out_dirs = []
    d = ROOT / name
    model.save_pretrained(d)
    tidy_saved(d)
    save_file(ref, str(d / "reference.safetensors"), metadata=ref_metadata(name))
    write_json(d / "expected.json", expected)
    out_dirs.append(d)

    # reload round-trip (bitwise)
    ref_loaded = load_file(str(d / "reference.safetensors"))
    check_against_reference(load_dir(d), ref_loaded, name, fwd)

    if spec.get("v4"):
        d4 = ROOT / f"{name}_v4"
        d4.mkdir(parents=True)
        cfg5 = json.loads((d / "config.json").read_text())
        write_json(d4 / "config.json", to_v4_config(cfg5, cfg.model_type, spec.get("v4_scaling")))
        for f in ("model.safetensors", "reference.safetensors", "expected.json"):
            shutil.copyfile(d / f, d4 / f)
        m4 = load_dir(d4)
        # the 4.x form must be parsed into exactly the same model description
        # (a `type` spelling stays next to the `rope_type` transformers derives from it)
        rp4 = {k: v for k, v in m4.config.rope_parameters.items() if k != "type"}
        assert rp4 == cfg.rope_parameters, (rp4, cfg.rope_parameters)
        assert layer_types_of(m4.config) == layer_types_of(cfg)
        assert derive_expected(m4, m4.config, spec) == expected
        check_against_reference(m4, ref_loaded, f"{name}_v4", fwd)
        stats["v4_verified"] = True
        out_dirs.append(d4)

    if name == "qwen2":
        ds = ROOT / "qwen2_sharded"
        model.save_pretrained(ds, max_shard_size="100KB")
        tidy_saved(ds)
        shards = sorted(p.name for p in ds.glob("model-*.safetensors"))
        assert len(shards) >= 2 and (ds / "model.safetensors.index.json").exists(), shards
        assert not (ds / "model.safetensors").exists()
        shutil.copyfile(d / "reference.safetensors", ds / "reference.safetensors")
        shutil.copyfile(d / "expected.json", ds / "expected.json")
        check_against_reference(load_dir(ds), ref_loaded, "qwen2_sharded")
        stats["shards"] = shards
        out_dirs.append(ds)

    return stats, out_dirs


def ref_metadata(name):
    # one key only: safetensors serialises the metadata map in hash order, several keys would make
    # the file bytes differ between runs
    info = {
        "fixture": name,
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
        "T": T,
        "P": P,
        "new_tokens": NEW,
    }
    return {"generator": json.dumps(info, sort_keys=True)}


def gemma3_legacy_check():
    """How a 4.x-style gemma3_text config maps onto 5.x (not written to disk, reported in README)."""
    spec = next(s for s in SPECS if s["name"] == "gemma3")
    cfg = build_config(spec)
    d = cfg.to_dict()
    d.pop("rope_parameters")
    d.pop("layer_types")
    d.update(rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=6)
    c4 = type(cfg).from_dict(d)
    return c4.rope_parameters == cfg.rope_parameters and list(c4.layer_types) == list(cfg.layer_types)


# ---------------------------------------------------------------------------
# README
# ---------------------------------------------------------------------------


def fmt_size(n):
    return f"{n / 1024:.0f} KiB"


def write_readme(results, sizes, total, g3_legacy_ok):
    lines = []
    a = lines.append
    a("# HF reference fixtures (tiny random-weight decoders)")
    a("")
    a("Generated by `tests/gen_fixtures.py`; do not edit by hand. Regenerate (wipes this directory) with:")
    a("")
    a("```")
    a("/work/main/.venv/bin/python tests/gen_fixtures.py   # needs: pip install torch transformers safetensors")
    a("```")
    a("")
    a(f"Generated with transformers {transformers.__version__}, torch {torch.__version__.split('+')[0]}, "
      f"safetensors {safetensors.__version__}, CPU, 1 thread (bitwise reproducible with the same versions).")
    a("No hub access is needed: models are built from configs and initialised with seeded normal weights.")
    a("")
    a("## Files per fixture")
    a("")
    a("- `config.json`: written by `save_pretrained` of the installed transformers (5.x dialect: `rope_parameters`, `layer_types`, `dtype`).")
    a("- `model.safetensors` (or `model-0000X-of-0000N.safetensors` + `model.safetensors.index.json`): float32 weights. "
      "Tied models store only `model.embed_tokens.weight` (no `lm_head.weight`).")
    a("- `reference.safetensors`:")
    a(f"  - `input_ids` int64 [1, {T}] (seeded random ids),")
    a(f"  - `logits` float32 [1, {T}, vocab]: teacher-forced logits, fp32, `attn_implementation=\"eager\"`, eval, `use_cache=False`,")
    a(f"  - `prompt_ids` int64 [1, {P}] == `input_ids[:, :{P}]` (so prefill logits must equal `logits[:, :{P}]`),")
    a(f"  - `generated_ids` int64 [1, {P + NEW}]: `generate(prompt, max_new_tokens={NEW}, do_sample=False, use_cache=True)` "
      "(configs have `eos_token_id: null`, so all steps run),")
    a(f"  - `generated_logits` float32 [1, {NEW}, vocab]: raw logits of each greedy step (step k predicts `generated_ids[:, {P}+k]`).")
    a("- `expected.json`: values the Rust config parser must derive: `arch`, `num_layers`, `head_dim`, "
      "`softmax_scale` (factor multiplying q.k), `layer_windows` (null = full causal, else the sliding window), "
      "`rope_theta` (for gemma3: the global/full-attention theta), `tie_word_embeddings`; plus extras: "
      "`layer_types`, `layer_rope` (per layer: rope params incl. the exact `inv_freq` HF computes), soft-caps, "
      "`embed_scale`, `rms_norm_weight_offset` (1.0 = Gemma's `x*(1+w)`), `qk_norm`, `attention_bias`, `hidden_act`.")
    a("")
    a("Common shapes: vocab 128, hidden 64, intermediate 80 (kept below the 128 first planned so that everything fits in "
      "~5 MB; 80 differs from hidden and 2*hidden so shape mix-ups still show), 4 query heads / 2 kv heads (GQA), "
      "head_dim 16 unless noted. Weights (seeded normal): embeddings N(0,1) (untied llama-family), "
      "N(0,0.3) for `llama3_rope_tied`, N(0,0.02) for Gemma; projections N(0,0.15); untied lm_head N(0,0.3); biases N(0,0.2); RMSNorm weights 1+0.2*N "
      "(Gemma stores w and computes x*(1+w): w = 0.2*N). Tied models need small embeddings, otherwise the input "
      "token's own embedding dominates the residual stream and greedy decoding just repeats the last token; to bring "
      "their logits back to a useful range the Gemma final norm weights are large (gemma2 w ~ 61.5, gemma3 w ~ 17.75). "
      "Qwen3/Gemma3 q/k norm weights use std 0.4. The generator also requires >= " + str(MIN_DISTINCT) +
      " distinct tokens among the generated ones (re-seeding otherwise).")
    a("")
    a("## Checks done by the generator")
    a("")
    a(f"- every greedy step has a top-1/top-2 logit gap > {MIN_GAP}, the {NEW} new tokens contain >= {MIN_DISTINCT} "
      f"distinct ids, and the model's fp32-vs-fp64 logit difference is <= {MAX_FP32_NOISE:g} (else re-seed);")
    a("- greedy tokens from the cached `generate` equal the argmax of an uncached forward over the generated sequence;")
    a("- each saved directory is re-loaded with `from_pretrained` and reproduces logits and generated ids bitwise;")
    a(f"- ablations: switching off each feature a fixture exercises changes some logit by > {MIN_ABLATION} (values below);")
    a("- gemma2: some raw (pre-cap) logits exceed 30, so the final soft-cap is active.")
    a("")
    a("## Fixtures")
    a("")
    a("| fixture | size | exercises |")
    a("| --- | --- | --- |")
    for spec in SPECS:
        a(f"| `{spec['name']}` | {fmt_size(sizes[spec['name']])} | {spec['exercises']} |")
        if spec.get("v4"):
            n4 = spec["name"] + "_v4"
            a(f"| `{n4}` | {fmt_size(sizes[n4])} | Same weights/reference/expected.json as `{spec['name']}`; config.json in the "
              "transformers 4.x dialect (top-level `rope_theta`/`rope_scaling`, no `rope_parameters`/`layer_types`, "
              "`torch_dtype`). Verified: transformers " + transformers.__version__ + " loads it to the same rope/layer types "
              "and bitwise-identical logits and generation. |")
        if spec["name"] == "qwen2":
            sh = results["qwen2"]["shards"]
            a(f"| `qwen2_sharded` | {fmt_size(sizes['qwen2_sharded'])} | `qwen2` (same weights and reference) saved with "
              f"`max_shard_size=\"100KB\"`: {len(sh)} shards + `model.safetensors.index.json`. |")
    a("")
    a(f"Total of the fixture directories: {fmt_size(total)} (the `_v4` and `qwen2_sharded` weight files are byte-identical "
      "copies / re-packings, so git stores most of them once).")
    a("")
    a("### Per-fixture numbers")
    a("")
    for spec in SPECS:
        r = results[spec["name"]]
        a(f"- `{spec['name']}`: seed {r['seed']}, min greedy gap {r['min_greedy_gap']:.3f}, "
          f"{r['distinct_new']} distinct tokens among the {NEW} generated, logits std "
          f"{r['logit_std']:.2f} / absmax {r['logit_absmax']:.2f}, "
          + ("generate-vs-cached_forward" if "hf_uncached_vs_cached" in r else "cached-vs-uncached")
          + f" step logits max diff {r['gen_vs_nocache_maxdiff']:.1e}, fp32-vs-fp64 logits max diff {r['fp32_noise']:.1e}"
          + (f", raw logits over cap: {r['raw_logits_over_cap']} (raw absmax {r['raw_logit_absmax']:.1f})" if "raw_logits_over_cap" in r else "")
          + (f", transformers' own uncached-vs-cached logits max diff {r['hf_uncached_vs_cached']:.2e}" if "hf_uncached_vs_cached" in r else ""))
        for desc, diff in r["ablations"]:
            a(f"  - ablation `{desc}`: max |dlogit| = {diff:.3g}")
    a("")
    a("## Semantics worth knowing (as implemented by this transformers version)")
    a("")
    a("- **Sliding window**: `masking_utils.sliding_window_overlay` keeps key `j` for query `i` iff `j > i - sliding_window` "
      "(and causal `j <= i`). With `sliding_window: 8` a query sees 8 keys: positions `i-7 ..= i` (itself included; "
      "confirmed on a 1-layer model: changing token 5 changes the outputs at positions 5..12 only). "
      "The same rule holds during cached decoding (checked: cached greedy == uncached argmax).")
    a("- **Which layers slide**: 5.x configs carry an explicit `layer_types` list for gemma2/gemma3/qwen2/qwen3. "
      "Without it (4.x configs): gemma2 layer `i` slides iff `i % 2 == 0`; gemma3 slides iff `(i+1) % sliding_window_pattern != 0` "
      "(pattern default 6, i.e. every 6th layer is full); qwen2/qwen3 slide only with `use_sliding_window: true` and `i >= max_window_layers`. "
      "Mistral has no `layer_types` even in 5.x: `sliding_window` (if not null) applies to every layer.")
    a("- **Qwen2** writes `sliding_window: null` when `use_sliding_window` is false (its config has no `head_dim` and "
      "no `attention_bias` key: q/k/v always have biases, o_proj never).")
    a("- **Gemma3 config.json** also contains a private `_sliding_window_pattern: 6` key (serialised by 5.x); "
      "`layer_types` is authoritative. With fewer than 6 layers the default pattern would make every layer sliding.")
    a("- **`_v4` configs** are labelled `transformers_version: 4.46.3`, use `torch_dtype`, and gemma2_v4 carries both "
      "`hidden_act` and `hidden_activation` as hub Gemma2 configs do (`hidden_activation` is the one used).")
    a("- **RoPE dialects**: 5.x writes `rope_parameters` = `{rope_type, rope_theta, ...scaling keys}`; 4.x had top-level "
      "`rope_theta` + `rope_scaling` (`null` or `{rope_type, factor, ...}`). 5.x still reads the 4.x form.")
    a("- **Gemma3 RoPE per layer type**: `rope_parameters` is nested: `{\"full_attention\": {...}, \"sliding_attention\": {...}}`, "
      "each with its own `rope_theta`/`rope_type`; the rotary module keeps one `inv_freq` per layer type and each layer uses the "
      "one of its `layer_types` entry. The 4.x form (`rope_theta` = global theta, `rope_local_base_freq` = local theta, "
      "`rope_scaling` applied to full-attention layers only, `sliding_window_pattern`) is converted by 5.x into exactly this "
      f"nested form (checked in-memory for this fixture: {'identical' if g3_legacy_ok else 'MISMATCH'}).")
    a("- **Scale**: llama/mistral/qwen use `head_dim**-0.5`; gemma2/gemma3 use `query_pre_attn_scalar**-0.5`. "
      "Gemma2 attention soft-cap is applied to `scores*scale` before the mask: `cap*tanh(x/cap)`; final logits likewise.")
    a("- **Tolerances**: the HF model's own fp32 rounding noise (`fp32-vs-fp64` above: its fp32 logits against the same "
      "model run in float64) is the floor for any fp32 comparison; an independent fp32 implementation can differ from "
      "HF by up to about twice that. Likewise HF's own cached vs. uncached logits differ by the `cached-vs-uncached` "
      "numbers. Most fixtures are ~5e-6; gemma2 is the worst (~4e-5: its logits are ~3x larger and its attention "
      "peakier). The generator rejects seeds whose noise exceeds " + f"{MAX_FP32_NOISE:g}" + ". Greedy gaps are >= "
      + f"{MIN_GAP:g}" + ", far above all of this.")
    a("- **Gemma embeddings** are multiplied by `sqrt(hidden_size)` computed in fp32 (`embed_scale` in expected.json); "
      "Gemma RMSNorm computes `x * (1 + w)` in fp32.")
    a("- **YaRN** (`_compute_yarn_parameters`): `original_max_position_embeddings` comes from a top-level key if the "
      "config has one (Phi-3 always does), else from the scaling object, else `max_position_embeddings`; "
      "`attention_factor` defaults to `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both are given, else "
      "`0.1 ln(factor) + 1`; cos and sin are multiplied by it in fp32. `truncate` (default true) floors/ceils the ramp ends.")
    a("- **Dynamic NTK** changes the frequencies with the sequence length: transformers takes it as "
      "`max(position_ids) + 1` of each forward call, so its uncached forward over T tokens rotates every position with "
      "the length-T frequencies, while its cached generation rotates each new token with the frequencies of a sequence "
      "ending at it (keys already cached keep theirs). Only the latter gives a token a rotation independent of the "
      "tokens after it, which cache reuse needs; the Rust decoder rotates each position `p` with length `p + 1` in every "
      "path, and `llama_dynamic` (`per_position`) takes its `logits` from transformers' cached path "
      "(`cached_forward`: a prefill of the first " + str(P) + " tokens, then one token per step). The per-fixture "
      "numbers above give how far transformers' own uncached logits are from that.")
    a("- **LongRoPE** uses `short_factor` while the sequence is within `original_max_position_embeddings` and "
      "`long_factor` for every position once it is longer: Phi-3's `prepare_inputs_for_generation` drops the cache at "
      "the crossing and re-encodes the whole sequence. An append-only cache cannot do that, so the Rust decoder's "
      "context limit for LongRoPE is the original length and `phi3_longrope` stays within it.")
    a("- **OLMo-2**: `q_norm`/`k_norm` weights are `[heads * head_dim]` and normalize the whole projection before the "
      "per-head view; the block is `h + post_attention_layernorm(attn(h))`, then `h + post_feedforward_layernorm(mlp(h))`.")
    a("- **Phi-3**: `qkv_proj` rows are q, then k, then v; `gate_up_proj` rows are gate, then up (`chunk(2)`). "
      "A 4.x `rope_scaling` of type `su` or `yarn` is read as `longrope` for Phi-3.")
    a("")
    (ROOT / "README.md").write_text("\n".join(lines))


def main():
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    if ROOT.exists():
        shutil.rmtree(ROOT)
    ROOT.mkdir(parents=True)
    results, all_dirs = {}, []
    for spec in SPECS:
        print(f"[{spec['name']}]")
        stats, dirs = make_fixture(spec)
        results[spec["name"]] = stats
        all_dirs += dirs
        print(f"  seed {stats['seed']} gap {stats['min_greedy_gap']:.3f} ablations "
              + ", ".join(f"{d}: {x:.3g}" for d, x in stats["ablations"]))
    g3 = gemma3_legacy_check()
    sizes = {d.name: dir_size(d) for d in all_dirs}
    total = sum(sizes.values())
    write_readme(results, sizes, total, g3)
    total = dir_size(ROOT)
    for k, v in sizes.items():
        print(f"  {k:22s} {fmt_size(v)}")
    print(f"total {fmt_size(total)}")
    assert total <= 9 * 1024 * 1024, total


if __name__ == "__main__":
    main()
