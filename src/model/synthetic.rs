//! Random-weight decoders with the exact shapes of real checkpoints, for numerics experiments
//! and benchmarks that must not depend on downloading weights.
//!
//! Weights are seeded normals (projections `N(0, 0.02)`, embeddings `N(0, 0.02)`, biases
//! `N(0, 0.02)`, norm weights `1 + N(0, 0.02)`), generated on the target device.
use super::{Decoder, Weights};
use crate::config::{Activation, Arch, ArchConfig, Dims, LayerKind, Rope, RopeScaling};
use crate::{Error, Result};
use tch::{Device, Kind, Tensor};

/// Shapes known to [`config`].
pub const NAMES: &[&str] = &["qwen2.5-0.5b", "qwen2.5-1.5b", "tiny-qwen2"];

/// The architecture of a named real checkpoint.
pub fn config(name: &str) -> Result<ArchConfig> {
    // (hidden, intermediate, layers, heads, kv heads, tied embeddings, vocabulary)
    let (hidden, inter, layers, heads, kv, tied, vocab) = match name {
        "qwen2.5-0.5b" => (896, 4864, 24, 14, 2, true, 151_936),
        "qwen2.5-1.5b" => (1536, 8960, 28, 12, 2, true, 151_936),
        // A tiny Qwen2 (4 layers, d 128, head 32) for quick device checks.
        "tiny-qwen2" => (128, 352, 4, 4, 2, true, 4096),
        other => {
            return Err(Error::Spec(format!(
                "unknown synthetic shape `{other}` (known: {})",
                NAMES.join(", ")
            )));
        }
    };
    let head_dim = hidden / heads;
    let cfg = ArchConfig {
        arch: Arch::Qwen2,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: inter,
        num_attention_heads: heads,
        num_key_value_heads: kv,
        head_dim,
        rms_norm_eps: 1e-6,
        activation: Activation::Silu,
        rope: Rope {
            theta: 1_000_000.0,
            scaling: RopeScaling::None,
        },
        rope_local: None,
        layer_types: vec![LayerKind::Full; layers],
        attention_bias: true,
        qk_norm: false,
        qk_norm_across_heads: false,
        norm_weight_offset: false,
        norm_weight_fp32: false,
        scale_embeddings: false,
        pre_norms: true,
        sandwich_norms: false,
        softmax_scale: 1.0 / (head_dim as f64).sqrt(),
        attn_logit_softcapping: None,
        final_logit_softcapping: None,
        tie_word_embeddings: tied,
        max_position_embeddings: 32_768,
        bos_token_id: None,
        eos_token_ids: vec![151_645, 151_643],
    };
    cfg.validate()?;
    Ok(cfg)
}

/// Seeded random checkpoint tensors, under Hugging Face names, for `cfg` (LLaMA/Qwen2/Qwen3
/// layouts: plain RMSNorm weights, optional q/k/v biases and q/k norms).
pub fn random_weights(cfg: &ArchConfig, kind: Kind, device: Device, seed: i64) -> Result<Weights> {
    let _guard = tch::no_grad_guard();
    tch::manual_seed(seed);
    let Dims {
        hidden: h,
        intermediate: inter,
        vocab: v,
        heads: hq,
        kv_heads: hkv,
        head_dim: d,
    } = cfg.dims();
    let std = 0.02;
    let normal = |shape: &[i64]| -> Result<Tensor> {
        Ok(Tensor::f_randn(shape, (Kind::Float, device))?
            .f_mul_scalar(std)?
            .f_to_kind(kind)?)
    };
    let norm_w = |n: i64| -> Result<Tensor> {
        let base = if cfg.norm_weight_offset { 0.0 } else { 1.0 };
        Ok(Tensor::f_randn([n], (Kind::Float, device))?
            .f_mul_scalar(std)?
            .f_add_scalar(base)?
            .f_to_kind(kind)?)
    };
    let mut named: Vec<(String, Tensor)> = vec![
        ("model.embed_tokens.weight".into(), normal(&[v, h])?),
        ("model.norm.weight".into(), norm_w(h)?),
    ];
    if !cfg.tie_word_embeddings {
        named.push(("lm_head.weight".into(), normal(&[v, h])?));
    }
    for i in 0..cfg.num_layers() {
        let p = format!("model.layers.{i}");
        let a = format!("{p}.self_attn");
        named.push((format!("{a}.q_proj.weight"), normal(&[hq * d, h])?));
        named.push((format!("{a}.k_proj.weight"), normal(&[hkv * d, h])?));
        named.push((format!("{a}.v_proj.weight"), normal(&[hkv * d, h])?));
        named.push((format!("{a}.o_proj.weight"), normal(&[h, hq * d])?));
        if cfg.attention_bias {
            named.push((format!("{a}.q_proj.bias"), normal(&[hq * d])?));
            named.push((format!("{a}.k_proj.bias"), normal(&[hkv * d])?));
            named.push((format!("{a}.v_proj.bias"), normal(&[hkv * d])?));
        }
        if cfg.qk_norm {
            named.push((format!("{a}.q_norm.weight"), norm_w(d)?));
            named.push((format!("{a}.k_norm.weight"), norm_w(d)?));
        }
        named.push((format!("{p}.mlp.gate_proj.weight"), normal(&[inter, h])?));
        named.push((format!("{p}.mlp.up_proj.weight"), normal(&[inter, h])?));
        named.push((format!("{p}.mlp.down_proj.weight"), normal(&[h, inter])?));
        named.push((format!("{p}.input_layernorm.weight"), norm_w(h)?));
        named.push((format!("{p}.post_attention_layernorm.weight"), norm_w(h)?));
        if cfg.sandwich_norms {
            named.push((format!("{p}.pre_feedforward_layernorm.weight"), norm_w(h)?));
            named.push((format!("{p}.post_feedforward_layernorm.weight"), norm_w(h)?));
        }
    }
    Ok(Weights::from_named(named, kind, device))
}

/// A decoder with the shape of `name` and seeded random weights.
pub fn decoder(name: &str, kind: Kind, device: Device, seed: i64) -> Result<Decoder> {
    let cfg = config(name)?;
    let w = random_weights(&cfg, kind, device, seed)?;
    Decoder::from_weights(cfg, w)
}
