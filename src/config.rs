//! Architecture configuration: one [`ArchConfig`] describes every supported decoder family as
//! data (norm style, biases, q/k-norm, soft-capping, per-layer sliding windows, RoPE), so the
//! model code in [`crate::model`] never branches on the family name.
//!
//! Hugging Face `config.json` comes in two dialects, both read here: transformers 4.x
//! (`rope_theta`/`rope_scaling` at the top level, no `layer_types`) and 5.x (`rope_parameters`,
//! `layer_types`, possibly keyed per layer type).
use crate::{Error, Result};
use serde_json::Value;
use std::path::Path;

/// Most decoder layers a configuration may declare (real checkpoints have at most a few
/// hundred); a larger count is corrupt and must not size an allocation.
pub const MAX_LAYERS: usize = 1 << 12;

/// Decoder family. Differences between families are expressed by the fields of
/// [`ArchConfig`]; this enum only records provenance and selects defaults when parsing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// LLaMA, Mistral, SmolLM2 (optionally with a sliding window).
    Llama,
    /// Qwen2 / Qwen2.5: q/k/v biases.
    Qwen2,
    /// Qwen3: q/k RMSNorm, no biases.
    Qwen3,
    /// Gemma-2: embedding scaling, sandwich norms, soft-capping, alternating windows.
    Gemma2,
    /// Gemma-3 (text): Gemma-2 layout with q/k norms, local/global RoPE, 5:1 window pattern.
    Gemma3,
    /// OLMo-2: norms on the attention and MLP outputs only, q/k RMSNorm over all heads at once.
    Olmo2,
    /// Phi-3: LLaMA layout with fused `qkv_proj` and `gate_up_proj` weights, LongRoPE scaling.
    Phi3,
}

impl Arch {
    /// Map a Hugging Face `architectures[0]` or `model_type` string to a family.
    pub fn from_hf_name(name: &str) -> Result<Arch> {
        let n = name.to_ascii_lowercase();
        let arch = match n.as_str() {
            "llamaforcausallm" | "llama" | "mistralforcausallm" | "mistral" => Arch::Llama,
            "qwen2forcausallm" | "qwen2" => Arch::Qwen2,
            "qwen3forcausallm" | "qwen3" => Arch::Qwen3,
            "gemma2forcausallm" | "gemma2" => Arch::Gemma2,
            "gemma3forcausallm" | "gemma3_text" | "gemma3" => Arch::Gemma3,
            "olmo2forcausallm" | "olmo2" => Arch::Olmo2,
            "phi3forcausallm" | "phi3" => Arch::Phi3,
            _ => return Err(Error::UnknownArch(name.to_string())),
        };
        Ok(arch)
    }
}

/// Gated-MLP activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Activation {
    /// `x * sigmoid(x)`.
    Silu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
    /// Exact GELU (erf).
    Gelu,
}

impl Activation {
    fn parse(s: &str) -> Result<Activation> {
        match s {
            "silu" | "swish" => Ok(Activation::Silu),
            "gelu_pytorch_tanh" | "gelu_tanh" | "gelu_new" => Ok(Activation::GeluTanh),
            "gelu" => Ok(Activation::Gelu),
            other => Err(Error::Config(format!("unsupported activation `{other}`"))),
        }
    }
}

/// How RoPE frequencies are scaled.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor`.
    Linear { factor: f64 },
    /// Llama-3 frequency-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN (Peng et al. 2023): frequencies below the `beta_slow` rotation count interpolated by
    /// `factor`, those above `beta_fast` kept, a linear ramp between, cos/sin scaled by
    /// `attention_factor` (transformers' `_compute_yarn_parameters`).
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        /// Round the ramp's ends outwards to whole dimensions.
        truncate: bool,
        /// Multiplier of cos and sin (resolved from `mscale`/`mscale_all_dim` or `factor`).
        attention_factor: f64,
    },
    /// Dynamic NTK: past `max_position_embeddings` the base grows with the sequence length
    /// (transformers' `_compute_dynamic_ntk_parameters`). Each position is rotated with the
    /// base for a sequence ending at it (`seq_len = position + 1`), as transformers' cached
    /// generation does token by token, so a token's rotation never depends on the other
    /// tokens of its forward pass.
    DynamicNtk {
        factor: f64,
        max_position_embeddings: f64,
    },
    /// LongRoPE (Phi-3): per-frequency divisors `short_factor` within
    /// `original_max_position_embeddings`, cos/sin scaled by `attention_factor`. transformers
    /// switches every position of a longer sequence to `long_factor` (its generation re-encodes
    /// the sequence at the crossing), which an append-only cache cannot follow; the context
    /// limit is therefore the original length, and past it (`--allow-extrapolation`) a position
    /// uses `long_factor` from the original length on.
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: f64,
        attention_factor: f64,
    },
}

/// RoPE parameters for one kind of layer.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Rope {
    /// Base frequency θ.
    pub theta: f64,
    /// Frequency scaling.
    pub scaling: RopeScaling,
}

/// Attention span of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum LayerKind {
    /// Causal attention over the whole history.
    Full,
    /// Causal attention over the last `window` positions (applied as a mask; the cache keeps
    /// the full history so snapshots stay valid).
    Sliding { window: usize },
}

/// Everything the generic decoder needs to know about a checkpoint.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ArchConfig {
    /// Family the checkpoint came from.
    pub arch: Arch,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Residual-stream width.
    pub hidden_size: usize,
    /// Gated-MLP inner width.
    pub intermediate_size: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA when fewer than query heads).
    pub num_key_value_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// MLP activation.
    pub activation: Activation,
    /// RoPE used by full-attention layers.
    pub rope: Rope,
    /// RoPE used by sliding-window layers when it differs (Gemma-3's local base frequency).
    pub rope_local: Option<Rope>,
    /// Span of each layer; its length is the number of layers.
    pub layer_types: Vec<LayerKind>,
    /// q/k/v projections carry biases (Qwen2).
    pub attention_bias: bool,
    /// q/k RMSNorm before RoPE (Qwen3, Gemma-3, OLMo-2).
    pub qk_norm: bool,
    /// The q/k norms span the whole projection (all heads at once, OLMo-2) instead of each
    /// head.
    pub qk_norm_across_heads: bool,
    /// Norm weights are stored as offsets from one: `x * (1 + w)` (Gemma).
    pub norm_weight_offset: bool,
    /// Norms multiply by their weight in fp32 and then cast (Gemma, OLMo-2); otherwise the
    /// normalized values are cast first (LLaMA). The same in fp32 runs.
    pub norm_weight_fp32: bool,
    /// Multiply embeddings by `sqrt(hidden_size)` (Gemma).
    pub scale_embeddings: bool,
    /// Norms on the attention and MLP inputs: `input_layernorm`, and the MLP's
    /// (`post_attention_layernorm`, or `pre_feedforward_layernorm` with sandwich norms). Every
    /// family but OLMo-2.
    pub pre_norms: bool,
    /// Norms on the attention and MLP outputs before the residual add:
    /// `post_attention_layernorm` and `post_feedforward_layernorm` (Gemma-2/3 sandwich layout,
    /// OLMo-2's post-norm blocks).
    pub sandwich_norms: bool,
    /// Attention scores are scaled by this (default `1/sqrt(head_dim)`).
    pub softmax_scale: f64,
    /// `tanh` soft-capping of attention scores.
    pub attn_logit_softcapping: Option<f64>,
    /// `tanh` soft-capping of output logits.
    pub final_logit_softcapping: Option<f64>,
    /// The LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Longest position the checkpoint was trained for (informational).
    pub max_position_embeddings: usize,
    /// Beginning-of-sequence token id, if any.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token ids.
    pub eos_token_ids: Vec<u32>,
}

/// A configuration's tensor dimensions as `i64`, the type tensor shapes take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// Hidden size.
    pub hidden: i64,
    /// MLP intermediate size.
    pub intermediate: i64,
    /// Vocabulary size.
    pub vocab: i64,
    /// Query heads.
    pub heads: i64,
    /// Key/value heads.
    pub kv_heads: i64,
    /// Head dimension.
    pub head_dim: i64,
}

impl ArchConfig {
    /// The tensor dimensions, as `i64`.
    pub fn dims(&self) -> Dims {
        Dims {
            hidden: self.hidden_size as i64,
            intermediate: self.intermediate_size as i64,
            vocab: self.vocab_size as i64,
            heads: self.num_attention_heads as i64,
            kv_heads: self.num_key_value_heads as i64,
            head_dim: self.head_dim as i64,
        }
    }

    /// Longest sequence the decoder runs as the checkpoint is meant to be run:
    /// `max_position_embeddings`, stretched by YaRN (`original_max_position_embeddings ×
    /// factor` when larger) and dynamic NTK (`× factor`), whose configurations keep the
    /// pre-training length there, and cut to the original length for LongRoPE (see
    /// [`RopeScaling::LongRope`]).
    pub fn context_length(&self) -> usize {
        let n = self.max_position_embeddings;
        match self.rope.scaling {
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                ..
            } => n.max((original_max_position_embeddings * factor) as usize),
            RopeScaling::DynamicNtk { factor, .. } if factor > 1.0 => (n as f64 * factor) as usize,
            RopeScaling::LongRope {
                original_max_position_embeddings,
                ..
            } => n.min(original_max_position_embeddings as usize),
            _ => n,
        }
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layer_types.len()
    }

    /// Read a Hugging Face `config.json`.
    pub fn from_hf_file(path: &Path) -> Result<ArchConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| Error::Config(format!("{}: invalid JSON: {e}", path.display())))?;
        Self::from_hf_json(&value)
            .map_err(|e| Error::Config(format!("{}: {}", path.display(), strip_prefix(&e))))
    }

    /// Parse a Hugging Face config object (either dialect).
    pub fn from_hf_json(v: &Value) -> Result<ArchConfig> {
        let name = v
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .or_else(|| v.get("model_type").and_then(Value::as_str))
            .ok_or_else(|| {
                Error::Config("neither `architectures` nor `model_type` given".into())
            })?;
        let arch = Arch::from_hf_name(name)?;
        let c = Fields(v);
        let hidden_size = c.usize("hidden_size")?;
        let num_attention_heads = c.usize("num_attention_heads")?;
        let num_key_value_heads = c
            .opt_usize("num_key_value_heads")?
            .unwrap_or(num_attention_heads);
        let head_dim = c
            .opt_usize("head_dim")?
            .unwrap_or(hidden_size.checked_div(num_attention_heads).unwrap_or(0));
        let num_layers = c.usize("num_hidden_layers")?;
        if num_layers > MAX_LAYERS {
            return Err(Error::Config(format!(
                "num_hidden_layers {num_layers} is more than {MAX_LAYERS}"
            )));
        }
        if num_attention_heads == 0
            || num_key_value_heads == 0
            || !num_attention_heads.is_multiple_of(num_key_value_heads)
        {
            return Err(Error::Config(format!(
                "num_attention_heads ({num_attention_heads}) must be a positive multiple of num_key_value_heads ({num_key_value_heads})"
            )));
        }
        let gemma = matches!(arch, Arch::Gemma2 | Arch::Gemma3);
        let act_name = v
            .get("hidden_activation")
            .and_then(Value::as_str)
            .or_else(|| v.get("hidden_act").and_then(Value::as_str))
            .unwrap_or(if gemma { "gelu_pytorch_tanh" } else { "silu" });
        let max_position_embeddings = c.opt_usize("max_position_embeddings")?.unwrap_or(4096);
        let rope_ctx = RopeContext {
            arch,
            max_positions: max_position_embeddings as f64,
            original_max: c
                .opt_f64("original_max_position_embeddings")?
                .or((arch == Arch::Phi3).then_some(4096.0)),
            rotary_dim: head_dim,
        };
        let (rope, rope_local) = parse_rope(v, &rope_ctx)?;
        let attention_bias = c.opt_bool("attention_bias")?.unwrap_or(arch == Arch::Qwen2);
        if attention_bias && matches!(arch, Arch::Olmo2 | Arch::Phi3) {
            return Err(Error::Config(format!(
                "attention biases are not supported for {arch:?}"
            )));
        }
        let olmo2 = arch == Arch::Olmo2;
        let layer_types = parse_layer_types(v, arch, num_layers)?;
        let softmax_scale = match c.opt_f64("query_pre_attn_scalar")? {
            Some(s) if gemma => 1.0 / s.sqrt(),
            _ => 1.0 / (head_dim as f64).sqrt(),
        };
        let eos_token_ids = match v.get("eos_token_id") {
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(Value::as_u64)
                .map(|x| x as u32)
                .collect(),
            Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            _ => vec![],
        };
        let cfg = ArchConfig {
            arch,
            vocab_size: c.usize("vocab_size")?,
            hidden_size,
            intermediate_size: c.usize("intermediate_size")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: c.opt_f64("rms_norm_eps")?.unwrap_or(
                if matches!(arch, Arch::Olmo2 | Arch::Phi3) {
                    1e-5
                } else {
                    1e-6
                },
            ),
            activation: Activation::parse(act_name)?,
            rope,
            rope_local,
            layer_types,
            attention_bias,
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Gemma3 | Arch::Olmo2),
            qk_norm_across_heads: olmo2,
            norm_weight_offset: gemma,
            norm_weight_fp32: gemma || olmo2,
            scale_embeddings: gemma,
            pre_norms: !olmo2,
            sandwich_norms: gemma || olmo2,
            softmax_scale,
            attn_logit_softcapping: c.opt_f64("attn_logit_softcapping")?,
            final_logit_softcapping: c.opt_f64("final_logit_softcapping")?,
            tie_word_embeddings: c.opt_bool("tie_word_embeddings")?.unwrap_or(gemma),
            max_position_embeddings,
            bos_token_id: c.opt_usize("bos_token_id")?.map(|x| x as u32),
            eos_token_ids,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reject internally inconsistent configurations.
    pub fn validate(&self) -> Result<()> {
        if self.vocab_size == 0
            || self.hidden_size == 0
            || self.head_dim == 0
            || self.layer_types.is_empty()
        {
            return Err(Error::Config(
                "vocab_size, hidden_size, head_dim and the layer count must be positive".into(),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(Error::Config(format!(
                "head_dim {} must be even for RoPE",
                self.head_dim
            )));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(Error::Config(
                "num_attention_heads must be a multiple of num_key_value_heads".into(),
            ));
        }
        if !self.pre_norms && !self.sandwich_norms {
            return Err(Error::Config(
                "a block needs norms on its inputs, its outputs or both".into(),
            ));
        }
        for rope in std::iter::once(&self.rope).chain(&self.rope_local) {
            let positive = |x: f64| x.is_finite() && x > 0.0;
            let ok = match &rope.scaling {
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings,
                    beta_fast,
                    beta_slow,
                    attention_factor,
                    ..
                } => {
                    rope.theta > 1.0
                        && [
                            *factor,
                            *original_max_position_embeddings,
                            *beta_fast,
                            *beta_slow,
                            *attention_factor,
                        ]
                        .into_iter()
                        .all(positive)
                }
                RopeScaling::DynamicNtk {
                    factor,
                    max_position_embeddings,
                } => self.head_dim > 2 && positive(*factor) && positive(*max_position_embeddings),
                RopeScaling::LongRope {
                    short_factor,
                    long_factor,
                    original_max_position_embeddings,
                    attention_factor,
                } => {
                    if short_factor.len() != self.head_dim / 2
                        || long_factor.len() != self.head_dim / 2
                    {
                        return Err(Error::Config(format!(
                            "LongRoPE factors must hold {} numbers (half the head size)",
                            self.head_dim / 2
                        )));
                    }
                    short_factor
                        .iter()
                        .chain(long_factor)
                        .chain([original_max_position_embeddings, attention_factor])
                        .all(|&x| positive(x))
                }
                _ => true,
            };
            if !ok {
                return Err(Error::Config(format!(
                    "invalid RoPE scaling (rope_theta {}): factors and lengths must be positive, the base above 1 for YaRN and the head size above 2 for dynamic NTK",
                    rope.theta
                )));
            }
        }
        Ok(())
    }
}

fn strip_prefix(e: &Error) -> String {
    let s = e.to_string();
    s.strip_prefix("config: ").map(str::to_string).unwrap_or(s)
}

/// Typed accessors over a JSON object that report the offending key.
struct Fields<'a>(&'a Value);

impl Fields<'_> {
    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                Error::Config(format!("`{key}` must be a non-negative integer, got {x}"))
            }),
        }
    }
    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| Error::Config(format!("missing `{key}`")))
    }
    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_f64()
                .map(Some)
                .ok_or_else(|| Error::Config(format!("`{key}` must be a number, got {x}"))),
        }
    }
    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_bool()
                .map(Some)
                .ok_or_else(|| Error::Config(format!("`{key}` must be a boolean, got {x}"))),
        }
    }
}

/// What a RoPE scaling needs from the rest of the configuration.
struct RopeContext {
    arch: Arch,
    /// `max_position_embeddings`.
    max_positions: f64,
    /// A top-level `original_max_position_embeddings`; transformers prefers it to the one in
    /// the scaling object (Phi-3 has one by default: 4096).
    original_max: Option<f64>,
    /// Rotated dimensions (the head size).
    rotary_dim: usize,
}

fn parse_scaling(obj: Option<&Value>, ctx: &RopeContext) -> Result<RopeScaling> {
    let Some(obj) = obj.filter(|o| !o.is_null()) else {
        return Ok(RopeScaling::None);
    };
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    // Phi-3 configs from before LongRoPE had its name call it `su` or `yarn`.
    let kind = match (ctx.arch, kind) {
        (Arch::Phi3, "su" | "yarn") => "longrope",
        (_, k) => k,
    };
    let f = Fields(obj);
    let need = |k: &str| {
        f.opt_f64(k)?
            .ok_or_else(|| Error::Config(format!("rope scaling `{kind}` needs `{k}`")))
    };
    if let Some(p) = f.opt_f64("partial_rotary_factor")?
        && p != 1.0
    {
        return Err(Error::Config(format!(
            "partial rotary embeddings (partial_rotary_factor {p}) are not supported"
        )));
    }
    let original_max = || -> Result<f64> {
        Ok(ctx
            .original_max
            .or(f.opt_f64("original_max_position_embeddings")?)
            .unwrap_or(ctx.max_positions))
    };
    Ok(match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: need("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: need("original_max_position_embeddings")?,
        },
        "yarn" => {
            let original = original_max()?;
            let factor = match f.opt_f64("factor")? {
                Some(x) => x,
                None => ctx.max_positions / original,
            };
            let mscale = |scale: f64, m: f64| {
                if scale <= 1.0 {
                    1.0
                } else {
                    0.1 * m * scale.ln() + 1.0
                }
            };
            let attention_factor = match f.opt_f64("attention_factor")? {
                Some(a) => a,
                None => match (f.opt_f64("mscale")?, f.opt_f64("mscale_all_dim")?) {
                    (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                        mscale(factor, m) / mscale(factor, all)
                    }
                    _ => mscale(factor, 1.0),
                },
            };
            // transformers: `get("beta_fast") or 32`, so 0 also means the default.
            let nonzero = |k: &str, d: f64| -> Result<f64> {
                Ok(f.opt_f64(k)?.filter(|&x| x != 0.0).unwrap_or(d))
            };
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast: nonzero("beta_fast", 32.0)?,
                beta_slow: nonzero("beta_slow", 1.0)?,
                truncate: f.opt_bool("truncate")?.unwrap_or(true),
                attention_factor,
            }
        }
        "dynamic" => RopeScaling::DynamicNtk {
            factor: need("factor")?,
            max_position_embeddings: ctx.max_positions,
        },
        "longrope" => {
            let list = |k: &str| -> Result<Vec<f64>> {
                let v = obj
                    .get(k)
                    .and_then(Value::as_array)
                    .ok_or_else(|| Error::Config(format!("rope scaling `longrope` needs `{k}`")))?;
                let xs: Vec<f64> = v.iter().filter_map(Value::as_f64).collect();
                if xs.len() != v.len() || xs.len() != ctx.rotary_dim / 2 {
                    return Err(Error::Config(format!(
                        "`{k}` must hold {} numbers (half the head size), got {}",
                        ctx.rotary_dim / 2,
                        v.len()
                    )));
                }
                Ok(xs)
            };
            let original = original_max()?;
            let factor = match f.opt_f64("factor")? {
                Some(x) => x,
                None => ctx.max_positions / original,
            };
            let attention_factor = match f.opt_f64("attention_factor")? {
                Some(a) => a,
                None if factor <= 1.0 => 1.0,
                None => (1.0 + factor.ln() / original.ln()).sqrt(),
            };
            RopeScaling::LongRope {
                short_factor: list("short_factor")?,
                long_factor: list("long_factor")?,
                original_max_position_embeddings: original,
                attention_factor,
            }
        }
        other => return Err(Error::Config(format!("unsupported rope scaling `{other}`"))),
    })
}

/// RoPE for full layers, and for sliding layers where it differs (Gemma-3).
fn parse_rope(v: &Value, ctx: &RopeContext) -> Result<(Rope, Option<Rope>)> {
    let default_theta = 10_000.0;
    let f = Fields(v);
    if let Some(p) = f.opt_f64("partial_rotary_factor")?
        && p != 1.0
    {
        return Err(Error::Config(format!(
            "partial rotary embeddings (partial_rotary_factor {p}) are not supported"
        )));
    }
    // transformers 5.x: `rope_parameters`, either flat or keyed by layer type.
    if let Some(params) = v.get("rope_parameters").filter(|p| p.is_object()) {
        let one = |p: &Value| -> Result<Rope> {
            Ok(Rope {
                theta: Fields(p).opt_f64("rope_theta")?.unwrap_or(default_theta),
                scaling: parse_scaling(Some(p), ctx)?,
            })
        };
        if let Some(full) = params.get("full_attention") {
            let local = params.get("sliding_attention").map(one).transpose()?;
            return Ok((one(full)?, local));
        }
        return Ok((one(params)?, None));
    }
    // transformers 4.x: top-level keys.
    let rope = Rope {
        theta: f.opt_f64("rope_theta")?.unwrap_or(default_theta),
        scaling: parse_scaling(v.get("rope_scaling"), ctx)?,
    };
    let local = match ctx.arch {
        Arch::Gemma3 => Some(Rope {
            theta: f.opt_f64("rope_local_base_freq")?.unwrap_or(10_000.0),
            scaling: RopeScaling::None,
        }),
        _ => None,
    };
    Ok((rope, local))
}

fn parse_layer_types(v: &Value, arch: Arch, n: usize) -> Result<Vec<LayerKind>> {
    let f = Fields(v);
    let window = f.opt_usize("sliding_window")?;
    let use_sw = f.opt_bool("use_sliding_window")?;
    if let Some(Value::Array(types)) = v.get("layer_types") {
        if types.len() != n {
            return Err(Error::Config(format!(
                "`layer_types` has {} entries for {n} layers",
                types.len()
            )));
        }
        return types
            .iter()
            .map(|t| match t.as_str() {
                Some("full_attention") => Ok(LayerKind::Full),
                Some("sliding_attention") => match window {
                    Some(w) if use_sw != Some(false) => Ok(LayerKind::Sliding { window: w }),
                    Some(_) => Ok(LayerKind::Full),
                    None => Err(Error::Config(
                        "`sliding_attention` layer without `sliding_window`".into(),
                    )),
                },
                _ => Err(Error::Config(format!("unsupported layer type {t}"))),
            })
            .collect();
    }
    Ok((0..n)
        .map(|i| match (arch, window) {
            (Arch::Gemma2, Some(w)) if i % 2 == 0 => LayerKind::Sliding { window: w },
            (Arch::Gemma3, Some(w)) => {
                let pattern = f
                    .opt_usize("sliding_window_pattern")
                    .ok()
                    .flatten()
                    .unwrap_or(6);
                if (i + 1) % pattern != 0 {
                    LayerKind::Sliding { window: w }
                } else {
                    LayerKind::Full
                }
            }
            (Arch::Llama | Arch::Phi3, Some(w)) => LayerKind::Sliding { window: w },
            (Arch::Qwen2 | Arch::Qwen3, Some(w)) if use_sw == Some(true) => {
                let max_window_layers =
                    f.opt_usize("max_window_layers").ok().flatten().unwrap_or(n);
                if i >= max_window_layers {
                    LayerKind::Sliding { window: w }
                } else {
                    LayerKind::Full
                }
            }
            _ => LayerKind::Full,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_both_rope_dialects_identically() -> Result<()> {
        let v4 = json!({"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}});
        let mut v5 = v4.clone();
        let obj = v5.as_object_mut().unwrap();
        obj.remove("rope_theta");
        obj.remove("rope_scaling");
        obj.insert(
            "rope_parameters".into(),
            json!({"rope_type": "llama3", "rope_theta": 500000.0,
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}),
        );
        obj.insert(
            "layer_types".into(),
            json!(["full_attention", "full_attention"]),
        );
        assert_eq!(
            ArchConfig::from_hf_json(&v4)?,
            ArchConfig::from_hf_json(&v5)?
        );
        Ok(())
    }

    #[test]
    fn gemma2_uses_query_pre_attn_scalar_and_alternates_windows() -> Result<()> {
        let v = json!({"architectures": ["Gemma2ForCausalLM"], "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "num_hidden_layers": 4, "query_pre_attn_scalar": 24, "sliding_window": 6,
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0});
        let c = ArchConfig::from_hf_json(&v)?;
        assert_eq!(c.softmax_scale, 1.0 / 24f64.sqrt());
        assert_eq!(c.layer_types[0], LayerKind::Sliding { window: 6 });
        assert_eq!(c.layer_types[1], LayerKind::Full);
        assert!(
            c.norm_weight_offset && c.scale_embeddings && c.sandwich_norms && c.tie_word_embeddings
        );
        Ok(())
    }

    #[test]
    fn rejects_unknown_architecture_and_bad_fields() {
        let v = json!({"architectures": ["GPT2LMHeadModel"]});
        assert!(matches!(
            ArchConfig::from_hf_json(&v),
            Err(Error::UnknownArch(_))
        ));
        let v = json!({"architectures": ["LlamaForCausalLM"], "vocab_size": "many", "hidden_size": 16,
            "intermediate_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2});
        let err = ArchConfig::from_hf_json(&v).unwrap_err().to_string();
        assert!(err.contains("vocab_size"), "{err}");
    }

    /// A small config of `arch` with a long trained length, for the scaling tests.
    fn small(arch: &str) -> Value {
        json!({"architectures": [arch], "vocab_size": 32, "hidden_size": 64,
            "intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "max_position_embeddings": 32768})
    }

    fn with(mut v: Value, key: &str, x: Value) -> Value {
        v.as_object_mut().unwrap().insert(key.into(), x);
        v
    }

    #[test]
    fn reads_qwen25_yarn_in_both_dialects() -> Result<()> {
        // Qwen2.5's documented long-context setting, 4.x spelling with `type`.
        let v4 = with(
            with(small("Qwen2ForCausalLM"), "rope_theta", json!(1e6)),
            "rope_scaling",
            json!({"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}),
        );
        let v5 = with(
            small("Qwen2ForCausalLM"),
            "rope_parameters",
            json!({"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                "original_max_position_embeddings": 32768}),
        );
        let c = ArchConfig::from_hf_json(&v4)?;
        assert_eq!(c, ArchConfig::from_hf_json(&v5)?);
        assert_eq!(
            c.rope.scaling,
            RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 32768.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                truncate: true,
                attention_factor: 0.1 * 4f64.ln() + 1.0,
            }
        );
        assert_eq!(c.context_length(), 131_072);
        Ok(())
    }

    #[test]
    fn yarn_attention_factor_follows_mscale_keys_and_explicit_values() -> Result<()> {
        let yarn = |extra: Value| -> Result<RopeScaling> {
            let mut p = json!({"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0});
            p.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            Ok(
                ArchConfig::from_hf_json(&with(small("LlamaForCausalLM"), "rope_parameters", p))?
                    .rope
                    .scaling,
            )
        };
        let factor_of = |s: RopeScaling| match s {
            RopeScaling::Yarn {
                attention_factor,
                original_max_position_embeddings,
                ..
            } => (attention_factor, original_max_position_embeddings),
            other => panic!("not YaRN: {other:?}"),
        };
        let m = |s: f64| 0.1 * s * 8f64.ln() + 1.0;
        let (a, original) = factor_of(yarn(json!({"mscale": 0.8, "mscale_all_dim": 0.5}))?);
        assert_eq!(a, m(0.8) / m(0.5));
        // No original length anywhere: max_position_embeddings.
        assert_eq!(original, 32768.0);
        let (a, _) = factor_of(yarn(json!({"attention_factor": 1.25, "mscale": 0.8}))?);
        assert_eq!(a, 1.25);
        let (a, _) = factor_of(yarn(json!({"mscale": 0.8}))?);
        assert_eq!(a, m(1.0), "mscale alone is ignored, as in transformers");
        Ok(())
    }

    #[test]
    fn reads_dynamic_ntk_and_phi3_longrope() -> Result<()> {
        let v = with(
            small("LlamaForCausalLM"),
            "rope_scaling",
            json!({"type": "dynamic", "factor": 2.0}),
        );
        let c = ArchConfig::from_hf_json(&v)?;
        assert_eq!(
            c.rope.scaling,
            RopeScaling::DynamicNtk {
                factor: 2.0,
                max_position_embeddings: 32768.0
            }
        );
        assert_eq!(c.context_length(), 65_536);
        // Phi-3-128k as first published: `su`, the original length top-level.
        let short: Vec<f64> = (0..8).map(|i| 1.0 + i as f64 / 10.0).collect();
        let long: Vec<f64> = (0..8).map(|i| 1.0 + i as f64).collect();
        let v = with(
            with(
                with(
                    small("Phi3ForCausalLM"),
                    "max_position_embeddings",
                    json!(131072),
                ),
                "original_max_position_embeddings",
                json!(4096),
            ),
            "rope_scaling",
            json!({"type": "su", "short_factor": short, "long_factor": long}),
        );
        let c = ArchConfig::from_hf_json(&v)?;
        assert_eq!(
            c.rope.scaling,
            RopeScaling::LongRope {
                short_factor: short.clone(),
                long_factor: long.clone(),
                original_max_position_embeddings: 4096.0,
                attention_factor: (1.0 + 32f64.ln() / 4096f64.ln()).sqrt(),
            }
        );
        assert_eq!(c.context_length(), 4096);
        // A factor list of the wrong length is refused.
        let bad = with(
            small("Phi3ForCausalLM"),
            "rope_scaling",
            json!({"type": "longrope", "short_factor": [1.0], "long_factor": long}),
        );
        let err = ArchConfig::from_hf_json(&bad).unwrap_err().to_string();
        assert!(err.contains("short_factor") && err.contains('8'), "{err}");
        Ok(())
    }

    #[test]
    fn olmo2_is_post_norm_with_whole_projection_qk_norms_and_phi3_is_pre_norm() -> Result<()> {
        let o = ArchConfig::from_hf_json(&small("Olmo2ForCausalLM"))?;
        assert_eq!(o.arch, Arch::Olmo2);
        assert!(o.qk_norm && o.qk_norm_across_heads && o.norm_weight_fp32);
        assert!(!o.pre_norms && o.sandwich_norms && !o.norm_weight_offset);
        assert_eq!(o.rms_norm_eps, 1e-5);
        let p = ArchConfig::from_hf_json(&with(
            small("Phi3ForCausalLM"),
            "sliding_window",
            json!(2047),
        ))?;
        assert_eq!(p.arch, Arch::Phi3);
        assert!(p.pre_norms && !p.sandwich_norms && !p.qk_norm && !p.norm_weight_fp32);
        assert_eq!(p.layer_types, vec![LayerKind::Sliding { window: 2047 }; 2]);
        // Phi-3 without scaling keeps its trained length as the context.
        assert_eq!(p.context_length(), 32768);
        // The existing families are unchanged: pre-norm, per-head q/k norms.
        let q = ArchConfig::from_hf_json(&small("Qwen3ForCausalLM"))?;
        assert!(q.pre_norms && !q.sandwich_norms && q.qk_norm && !q.qk_norm_across_heads);
        Ok(())
    }

    #[test]
    fn refuses_what_it_does_not_implement_in_one_line() {
        let cases = [
            (
                with(
                    small("Phi3ForCausalLM"),
                    "partial_rotary_factor",
                    json!(0.75),
                ),
                "partial rotary",
            ),
            (
                with(
                    small("Qwen2ForCausalLM"),
                    "rope_parameters",
                    json!({"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                        "partial_rotary_factor": 0.5}),
                ),
                "partial rotary",
            ),
            (
                with(
                    small("Qwen2ForCausalLM"),
                    "rope_scaling",
                    json!({"type": "mrope", "mrope_section": [1, 1, 2]}),
                ),
                "unsupported rope scaling `mrope`",
            ),
            (
                with(small("Olmo2ForCausalLM"), "attention_bias", json!(true)),
                "attention biases",
            ),
            (
                with(
                    small("Phi3ForCausalLM"),
                    "rope_scaling",
                    json!({"type": "longrope", "short_factor": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]}),
                ),
                "long_factor",
            ),
            (
                with(
                    small("LlamaForCausalLM"),
                    "rope_scaling",
                    json!({"type": "dynamic"}),
                ),
                "needs `factor`",
            ),
            (
                with(
                    small("Qwen2ForCausalLM"),
                    "rope_scaling",
                    json!({"type": "yarn", "factor": -4.0}),
                ),
                "must be positive",
            ),
            (
                with(
                    with(small("LlamaForCausalLM"), "head_dim", json!(2)),
                    "rope_scaling",
                    json!({"type": "dynamic", "factor": 2.0}),
                ),
                "head size above 2",
            ),
        ];
        for (v, want) in cases {
            let err = ArchConfig::from_hf_json(&v).unwrap_err().to_string();
            assert!(err.contains(want) && !err.contains('\n'), "{want}: {err}");
        }
    }
}
