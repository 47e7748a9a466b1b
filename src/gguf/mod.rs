//! Real models shipped as GGUF files: container parsing ([`reader`]), de-quantization to
//! `f32` ([`dequant`]), and the mapping onto the generic decoder's inputs: an [`ArchConfig`]
//! from the metadata and float32 tensors under Hugging Face checkpoint names (the decoder is
//! built from them by [`crate::model::gguf`]), with llama.cpp's
//! conversion quirks undone so they equal what transformers' GGUF loader produces:
//!
//! - `llama`-architecture q/k projections were row-permuted by llama.cpp's converter for its
//!   interleaved RoPE; the inverse permutation is applied (transformers'
//!   `LlamaTensorProcessor._reverse_permute_weights`).
//! - Gemma norm weights (every `*norm.weight`) were stored as `1 + w`; `1` is subtracted
//!   (transformers' `Gemma2TensorProcessor`), since [`ArchConfig::norm_weight_offset`] makes
//!   the decoder compute `x * (1 + w)` itself.
//! - Dimensions are stored innermost-first; shapes are reversed (a Linear weight is
//!   `[out, in]`).
//! - Phi-3's fused `attn_qkv` and `ffn_up` (gate rows, then up) are Hugging Face's `qkv_proj`
//!   and `gate_up_proj`; the decoder splits them as it loads.
pub mod dequant;
pub mod reader;

pub use dequant::GgmlType;
pub use reader::{GgufFile, TensorInfo, Value};

use crate::config::{Activation, Arch, ArchConfig, LayerKind, Rope, RopeScaling};
use crate::{Error, Result};
use tch::Tensor;

/// The GGUF architecture name of a family, and the family of a GGUF architecture name.
fn arch_of(name: &str) -> Result<Arch> {
    Ok(match name {
        "llama" | "mistral" => Arch::Llama,
        "qwen2" => Arch::Qwen2,
        "qwen3" => Arch::Qwen3,
        "gemma2" => Arch::Gemma2,
        "gemma3" => Arch::Gemma3,
        "olmo2" => Arch::Olmo2,
        "phi3" => Arch::Phi3,
        other => return Err(Error::UnknownArch(format!("{other} (GGUF)"))),
    })
}

/// Build the decoder configuration from `general.architecture` and `<arch>.*` metadata.
/// BOS/EOS ids are filled from `tokenizer.ggml.*` (see [`crate::tokenizer::from_gguf`] for the
/// full end-of-generation set).
pub fn config_from_gguf(g: &GgufFile) -> Result<ArchConfig> {
    config_inner(g).map_err(|e| match e {
        Error::Gguf(m) | Error::Config(m) => Error::Config(format!("{}: {m}", g.path().display())),
        other => other,
    })
}

fn config_inner(g: &GgufFile) -> Result<ArchConfig> {
    let name = g
        .opt_str("general.architecture")?
        .ok_or_else(|| Error::Gguf("missing metadata `general.architecture`".into()))?
        .to_string();
    let arch = arch_of(&name)?;
    let key = |k: &str| format!("{name}.{k}");
    let usize_key = |k: &str| -> Result<usize> { Ok(g.u64(&key(k))? as usize) };
    let gemma = matches!(arch, Arch::Gemma2 | Arch::Gemma3);
    let olmo2 = arch == Arch::Olmo2;

    let hidden_size = usize_key("embedding_length")?;
    let num_layers = usize_key("block_count")?;
    // Every layer has tensors: a count past the directory is corrupt (and must not size an
    // allocation).
    if num_layers > g.tensors.len() {
        return Err(Error::Config(format!(
            "`{}` is {num_layers} but the file has only {} tensors",
            key("block_count"),
            g.tensors.len()
        )));
    }
    let intermediate_size = match g.get(&key("feed_forward_length")) {
        Some(Value::Array(_)) => {
            return Err(Error::Config(
                "per-layer `feed_forward_length` is not supported".into(),
            ));
        }
        _ => usize_key("feed_forward_length")?,
    };
    let num_attention_heads = usize_key("attention.head_count")?;
    let num_key_value_heads = match g.get(&key("attention.head_count_kv")) {
        Some(Value::Array(_)) => {
            return Err(Error::Config(
                "per-layer `attention.head_count_kv` is not supported".into(),
            ));
        }
        Some(_) => usize_key("attention.head_count_kv")?,
        None => num_attention_heads,
    };
    if num_attention_heads == 0 || num_key_value_heads == 0 {
        return Err(Error::Config("head counts must be positive".into()));
    }
    let head_dim = match g.opt_u64(&key("attention.key_length"))? {
        Some(d) => d as usize,
        None => hidden_size / num_attention_heads,
    };
    if let Some(v) = g.opt_u64(&key("attention.value_length"))?
        && v as usize != head_dim
    {
        return Err(Error::Config(format!(
            "value head size {v} differs from key head size {head_dim}: not supported"
        )));
    }
    if let Some(r) = g.opt_u64(&key("rope.dimension_count"))?
        && r as usize != head_dim
    {
        return Err(Error::Config(format!(
            "partial rotary embedding (rope.dimension_count {r} < head size {head_dim}) is not supported"
        )));
    }
    let rms_norm_eps = g
        .opt_f64(&key("attention.layer_norm_rms_epsilon"))?
        .ok_or_else(|| {
            Error::Config(format!(
                "missing `{}`",
                key("attention.layer_norm_rms_epsilon")
            ))
        })?;

    let (rope, rope_local) = ropes(g, arch, &key)?;

    let layer_types = layer_types(g, arch, &key, num_layers)?;

    // Attention scale: explicit key, else Gemma's query_pre_attn_scalar rule as llama.cpp
    // applies it (27B models scale by hidden/heads, the others by the head size).
    let softmax_scale = match g.opt_f64(&key("attention.scale"))? {
        Some(s) => s,
        None => {
            let gemma_27b = (arch == Arch::Gemma2 && num_layers == 46)
                || (arch == Arch::Gemma3 && num_layers == 62);
            if gemma_27b {
                1.0 / ((hidden_size / num_attention_heads) as f64).sqrt()
            } else {
                1.0 / (head_dim as f64).sqrt()
            }
        }
    };
    let embd = g
        .tensor_info("token_embd.weight")
        .ok_or_else(|| Error::Gguf("missing tensor `token_embd.weight`".into()))?;
    if embd.dims.len() != 2 || embd.dims[0] as usize != hidden_size {
        return Err(Error::Gguf(format!(
            "`token_embd.weight` has dims {:?}, expected [{hidden_size}, vocab]",
            embd.dims
        )));
    }
    let vocab_size = embd.dims[1] as usize;
    let cap = |k: &str| -> Result<Option<f64>> { Ok(g.opt_f64(&key(k))?.filter(|&c| c > 0.0)) };
    let id = |k: &str| -> Result<Option<u32>> { Ok(g.opt_u64(k)?.map(|x| x as u32)) };

    let cfg = ArchConfig {
        arch,
        vocab_size,
        hidden_size,
        intermediate_size,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rms_norm_eps,
        activation: if gemma {
            Activation::GeluTanh
        } else {
            Activation::Silu
        },
        rope,
        rope_local,
        layer_types,
        attention_bias: g.tensor_info("blk.0.attn_q.bias").is_some(),
        qk_norm: g.tensor_info("blk.0.attn_q_norm.weight").is_some(),
        qk_norm_across_heads: olmo2,
        norm_weight_offset: gemma,
        norm_weight_fp32: gemma || olmo2,
        scale_embeddings: gemma,
        pre_norms: !olmo2,
        sandwich_norms: gemma || olmo2,
        softmax_scale,
        attn_logit_softcapping: cap("attn_logit_softcapping")?,
        final_logit_softcapping: cap("final_logit_softcapping")?,
        tie_word_embeddings: g.tensor_info("output.weight").is_none(),
        max_position_embeddings: g.opt_u64(&key("context_length"))?.unwrap_or(4096) as usize,
        bos_token_id: id("tokenizer.ggml.bos_token_id")?,
        eos_token_ids: id("tokenizer.ggml.eos_token_id")?.into_iter().collect(),
    };
    cfg.validate()?;
    Ok(cfg)
}

/// The RoPE of global layers and, for Gemma-3, of sliding-window layers; per-frequency and
/// LongRoPE factors are refused.
fn ropes(g: &GgufFile, arch: Arch, key: &dyn Fn(&str) -> String) -> Result<(Rope, Option<Rope>)> {
    let scaling = rope_scaling(g, key)?;
    if g.tensor_info("rope_freqs.weight").is_some() {
        return Err(Error::Config(
            "per-frequency RoPE factors (`rope_freqs.weight`, llama-3.1 style scaling) are not supported".into(),
        ));
    }
    if g.tensor_info("rope_factors_long.weight").is_some()
        || g.tensor_info("rope_factors_short.weight").is_some()
    {
        return Err(Error::Config(
            "LongRoPE factors (`rope_factors_long/short.weight`) are not supported from GGUF; load the Hugging Face folder instead".into(),
        ));
    }
    let rope = Rope {
        theta: g.opt_f64(&key("rope.freq_base"))?.unwrap_or(10_000.0),
        scaling,
    };
    // llama.cpp: sliding-window layers of Gemma-3 use `rope.freq_base_swa` (default 10000) and
    // no frequency scaling.
    let rope_local = (arch == Arch::Gemma3).then(|| -> Result<Rope> {
        Ok(Rope {
            theta: g.opt_f64(&key("rope.freq_base_swa"))?.unwrap_or(10_000.0),
            scaling: RopeScaling::None,
        })
    });
    let rope_local = rope_local.transpose()?;
    Ok((rope, rope_local))
}

/// Each layer's attention span: full, or sliding over `<arch>.attention.sliding_window`
/// (Gemma's by its pattern key, else llama.cpp's default pattern).
fn layer_types(
    g: &GgufFile,
    arch: Arch,
    key: &dyn Fn(&str) -> String,
    num_layers: usize,
) -> Result<Vec<LayerKind>> {
    let window = g
        .opt_u64(&key("attention.sliding_window"))?
        .filter(|&w| w > 0);
    Ok(match (arch, window) {
        (_, None) | (Arch::Qwen2 | Arch::Qwen3 | Arch::Olmo2, _) => {
            vec![LayerKind::Full; num_layers]
        }
        (Arch::Llama | Arch::Phi3, Some(w)) => {
            vec![LayerKind::Sliding { window: w as usize }; num_layers]
        }
        (Arch::Gemma2 | Arch::Gemma3, Some(w)) => {
            let sliding = LayerKind::Sliding { window: w as usize };
            let pattern_key = key("attention.sliding_window_pattern");
            match g.get(&pattern_key) {
                Some(Value::Array(a)) => {
                    if a.len() != num_layers {
                        return Err(Error::Config(format!(
                            "`{pattern_key}` has {} entries for {num_layers} layers",
                            a.len()
                        )));
                    }
                    a.iter()
                        .map(|v| match v.as_bool() {
                            Some(true) => Ok(sliding),
                            Some(false) => Ok(LayerKind::Full),
                            None => Err(Error::Config(format!("`{pattern_key}` must hold bools"))),
                        })
                        .collect::<Result<_>>()?
                }
                _ => {
                    // llama.cpp `set_swa_pattern(n)`: layer i slides iff i % n < n - 1
                    // (Gemma-2: n = 2, Gemma-3: n = 6; n = 0 means every layer).
                    let default = if arch == Arch::Gemma2 { 2 } else { 6 };
                    let n = g.opt_u64(&pattern_key)?.unwrap_or(default) as usize;
                    (0..num_layers)
                        .map(|i| {
                            if n == 0 || i % n < n - 1 {
                                sliding
                            } else {
                                LayerKind::Full
                            }
                        })
                        .collect()
                }
            }
        }
    })
}

/// RoPE scaling from `<arch>.rope.scaling.*` (llama.cpp's keys): linear, or YaRN with
/// llama.cpp's defaults (`beta_fast` 32, `beta_slow` 1, ramp ends rounded outwards, cos/sin
/// scaled by `attn_factor · (1 + 0.1 ln factor)`), which are transformers' too.
fn rope_scaling(g: &GgufFile, key: &dyn Fn(&str) -> String) -> Result<RopeScaling> {
    Ok(match g.opt_str(&key("rope.scaling.type"))? {
        None | Some("none") => match g.opt_f64(&key("rope.scale_linear"))? {
            Some(f) if f != 1.0 => RopeScaling::Linear { factor: f },
            _ => RopeScaling::None,
        },
        Some("linear") => {
            let f = g
                .opt_f64(&key("rope.scaling.factor"))?
                .or(g.opt_f64(&key("rope.scale_linear"))?)
                .unwrap_or(1.0);
            if f == 1.0 || f == 0.0 {
                RopeScaling::None
            } else {
                RopeScaling::Linear { factor: f }
            }
        }
        Some("yarn") => {
            let factor = g
                .opt_f64(&key("rope.scaling.factor"))?
                .filter(|&f| f > 0.0)
                .ok_or_else(|| {
                    Error::Config(format!(
                        "YaRN needs a positive `{}`",
                        key("rope.scaling.factor")
                    ))
                })?;
            let original = g
                .opt_u64(&key("rope.scaling.original_context_length"))?
                .or(g.opt_u64(&key("context_length"))?)
                .ok_or_else(|| {
                    Error::Config(format!(
                        "YaRN needs `{}`",
                        key("rope.scaling.original_context_length")
                    ))
                })? as f64;
            if let Some(m) = g.opt_f64(&key("rope.scaling.yarn_log_multiplier"))?
                && m != 0.0
            {
                return Err(Error::Config(format!(
                    "YaRN with a log multiplier (`{}` {m}, DeepSeek's mscale) is not supported",
                    key("rope.scaling.yarn_log_multiplier")
                )));
            }
            if let Some(e) = g.opt_f64(&key("rope.scaling.yarn_ext_factor"))?
                && e != 1.0
                && e >= 0.0
            {
                return Err(Error::Config(format!(
                    "YaRN with extrapolation mix `{}` {e} (not 1) is not supported",
                    key("rope.scaling.yarn_ext_factor")
                )));
            }
            let positive = |k: &str, d: f64| -> Result<f64> {
                Ok(g.opt_f64(&key(k))?.filter(|&x| x > 0.0).unwrap_or(d))
            };
            let mscale = if factor <= 1.0 {
                1.0
            } else {
                0.1 * factor.ln() + 1.0
            };
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast: positive("rope.scaling.yarn_beta_fast", 32.0)?,
                beta_slow: positive("rope.scaling.yarn_beta_slow", 1.0)?,
                truncate: true,
                attention_factor: positive("rope.scaling.attn_factor", 1.0)? * mscale,
            }
        }
        Some(other) => {
            return Err(Error::Config(format!("unsupported rope scaling `{other}`")));
        }
    })
}

/// The Hugging Face checkpoint key of a GGUF tensor name.
pub fn hf_tensor_name(arch: Arch, gguf_name: &str) -> Result<String> {
    let gemma = matches!(arch, Arch::Gemma2 | Arch::Gemma3);
    let post_norms = gemma || arch == Arch::Olmo2;
    let fixed = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Ok(f.to_string());
    }
    let unknown = || {
        Error::Gguf(format!(
            "unexpected tensor `{gguf_name}` for a {arch:?} model"
        ))
    };
    let rest = gguf_name.strip_prefix("blk.").ok_or_else(unknown)?;
    let (layer, part) = rest.split_once('.').ok_or_else(unknown)?;
    let layer: usize = layer.parse().map_err(|_| unknown())?;
    let (module, suffix) = part.rsplit_once('.').ok_or_else(unknown)?;
    if suffix != "weight" && suffix != "bias" {
        return Err(unknown());
    }
    let hf = match module {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_qkv" => "self_attn.qkv_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_norm" if gemma => "pre_feedforward_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "post_attention_norm" if post_norms => "post_attention_layernorm",
        "post_ffw_norm" if post_norms => "post_feedforward_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" if arch == Arch::Phi3 => "mlp.gate_up_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return Err(unknown()),
    };
    Ok(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// Undo llama.cpp's q/k row permutation (`LlamaModel.permute`): within each head, GGUF row
/// `2*i + t` is Hugging Face row `t*half + i`.
pub fn unpermute_qk(w: &Tensor, n_head: usize) -> Result<Tensor> {
    let shape = w.size();
    let rows = shape[0];
    let n_head = n_head as i64;
    if n_head == 0 || rows % (2 * n_head) != 0 {
        return Err(Error::Gguf(format!(
            "cannot un-permute a q/k tensor of {rows} rows over {n_head} heads"
        )));
    }
    let half = rows / n_head / 2;
    let mut split = vec![n_head, half, 2];
    split.extend_from_slice(&shape[1..]);
    Ok(w.f_reshape(&split)?
        .f_transpose(1, 2)?
        .f_contiguous()?
        .f_reshape(&shape)?)
}

/// De-quantize every tensor to float32 and name it as in a Hugging Face checkpoint.
pub fn load_tensors(g: &GgufFile, cfg: &ArchConfig) -> Result<Vec<(String, Tensor)>> {
    let _guard = tch::no_grad_guard();
    let permute_qk = g.opt_str("general.architecture")? == Some("llama");
    let gemma = matches!(cfg.arch, Arch::Gemma2 | Arch::Gemma3);
    let mut out = Vec::with_capacity(g.tensors.len());
    for info in &g.tensors {
        let name = hf_tensor_name(cfg.arch, &info.name)?;
        let mut t = g.read_tensor(info)?;
        if permute_qk {
            if info.name.contains(".attn_q.") {
                t = unpermute_qk(&t, cfg.num_attention_heads)?;
            } else if info.name.contains(".attn_k.") {
                t = unpermute_qk(&t, cfg.num_key_value_heads)?;
            }
        }
        if gemma && info.name.ends_with("norm.weight") {
            let _ = t.f_sub_scalar_(1.0)?;
        }
        out.push((name, t));
    }
    Ok(out)
}
