//! GGUF files of the architectures and RoPE scalings llama.cpp writes for OLMo-2 (`olmo2`),
//! Phi-3 (`phi3`, fused `attn_qkv` and `ffn_up`) and YaRN (`rope.scaling.type = yarn`): each is
//! written here from a Hugging Face parity fixture, with llama.cpp's tensor names and metadata
//! keys (f32 tensors), and must decode to the fixture's logits. Unsupported metadata is refused
//! in one line.
mod common;

use common::*;
use kvcredit::config::{ArchConfig, RopeScaling};
use kvcredit::gguf::{self, GgufFile};
use kvcredit::model::Weights;
use kvcredit::{Decoder, ExecPolicy, Result};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use tch::{Device, Kind, Tensor};

/// Distinguishes the files the tests (running in parallel) write.
static FILES: AtomicUsize = AtomicUsize::new(0);

/// A metadata value as written to the file.
enum Meta {
    U32(u32),
    F32(f32),
    Str(&'static str),
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// A GGUF v3 file with `meta` and f32 `tensors` (PyTorch shapes; GGUF stores them reversed).
fn write_gguf(path: &Path, meta: &[(String, Meta)], tensors: &[(String, Tensor)]) {
    let mut b = Vec::new();
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        string(&mut b, k);
        match v {
            Meta::U32(x) => {
                b.extend(4u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            Meta::F32(x) => {
                b.extend(6u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            Meta::Str(s) => {
                b.extend(8u32.to_le_bytes());
                string(&mut b, s);
            }
        }
    }
    let mut data = Vec::new();
    for (name, t) in tensors {
        string(&mut b, name);
        let shape = t.size();
        b.extend((shape.len() as u32).to_le_bytes());
        for d in shape.iter().rev() {
            b.extend((*d as u64).to_le_bytes());
        }
        b.extend(0u32.to_le_bytes()); // F32
        b.extend((data.len() as u64).to_le_bytes());
        let v = Vec::<f32>::try_from(t.to_kind(Kind::Float).reshape([-1])).unwrap();
        data.extend(v.iter().flat_map(|x| x.to_le_bytes()));
        while data.len() % 32 != 0 {
            data.push(0);
        }
    }
    while b.len() % 32 != 0 {
        b.push(0);
    }
    b.extend(data);
    std::fs::write(path, b).unwrap();
}

/// llama.cpp's name for a Hugging Face checkpoint key of `arch`.
fn gguf_name(arch: &str, hf: &str) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (layer, part) = rest.split_once('.').unwrap();
    let (module, suffix) = part.rsplit_once('.').unwrap();
    let g = match module {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.qkv_proj" => "attn_qkv",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "post_attention_layernorm" if arch == "olmo2" => "post_attention_norm",
        "post_attention_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" | "mlp.gate_up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        other => panic!("no GGUF name for {other}"),
    };
    format!("blk.{layer}.{g}.{suffix}")
}

/// The fixture `name` as llama.cpp would write it for `arch`, plus `extra` metadata and tensors.
fn fixture_gguf(
    name: &str,
    arch: &'static str,
    extra: Vec<(String, Meta)>,
    extra_tensors: Vec<(String, Tensor)>,
) -> (PathBuf, ArchConfig) {
    let dir = hf_fixtures().join(name);
    let cfg = ArchConfig::from_hf_file(&dir.join("config.json")).unwrap();
    let k = |s: &str| format!("{arch}.{s}");
    let mut meta = vec![
        ("general.architecture".to_string(), Meta::Str(arch)),
        (k("embedding_length"), Meta::U32(cfg.hidden_size as u32)),
        (k("block_count"), Meta::U32(cfg.num_layers() as u32)),
        (
            k("feed_forward_length"),
            Meta::U32(cfg.intermediate_size as u32),
        ),
        (
            k("attention.head_count"),
            Meta::U32(cfg.num_attention_heads as u32),
        ),
        (
            k("attention.head_count_kv"),
            Meta::U32(cfg.num_key_value_heads as u32),
        ),
        (
            k("attention.layer_norm_rms_epsilon"),
            Meta::F32(cfg.rms_norm_eps as f32),
        ),
        (
            k("context_length"),
            Meta::U32(cfg.max_position_embeddings as u32),
        ),
        (k("rope.freq_base"), Meta::F32(cfg.rope.theta as f32)),
        (k("rope.dimension_count"), Meta::U32(cfg.head_dim as u32)),
    ];
    meta.extend(extra);
    let mut tensors: Vec<(String, Tensor)> =
        Tensor::read_safetensors(dir.join("model.safetensors"))
            .unwrap()
            .into_iter()
            .map(|(n, t)| (gguf_name(arch, &n), t))
            .collect();
    tensors.extend(extra_tensors);
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let tmp = std::env::temp_dir().join(format!("kvcredit-gguf-arch-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let path = tmp.join(format!(
        "{name}-{}.gguf",
        FILES.fetch_add(1, Ordering::Relaxed)
    ));
    write_gguf(&path, &meta, &tensors);
    (path, cfg)
}

/// Teacher-forced logits of the GGUF decoder and of the fixture's folder on its input ids.
fn logits_of(path: &Path, fixture: &str) -> Result<(ArchConfig, Tensor, Tensor)> {
    let g = GgufFile::open(path)?;
    let cfg = gguf::config_from_gguf(&g)?;
    let tensors = gguf::load_tensors(&g, &cfg)?;
    let model = Decoder::from_weights(
        cfg.clone(),
        Weights::from_named(tensors, Kind::Float, Device::Cpu),
    )?;
    let dir = hf_fixtures().join(fixture);
    let r = reference(&dir);
    let from_gguf = model.forward_full(&r["input_ids"], &ExecPolicy::Stock)?;
    let from_hf = load(&dir, Kind::Float)?.forward_full(&r["input_ids"], &ExecPolicy::Stock)?;
    Ok((cfg, from_gguf, from_hf))
}

#[test]
fn olmo2_phi3_and_yarn_ggufs_decode_like_their_hugging_face_folders() -> Result<()> {
    let yarn = || {
        vec![
            ("qwen2.rope.scaling.type".to_string(), Meta::Str("yarn")),
            ("qwen2.rope.scaling.factor".to_string(), Meta::F32(4.0)),
            (
                "qwen2.rope.scaling.original_context_length".to_string(),
                Meta::U32(2048),
            ),
        ]
    };
    let window = vec![("phi3.attention.sliding_window".to_string(), Meta::U32(8))];
    for (fixture, arch, extra) in [
        ("olmo2", "olmo2", vec![]),
        ("phi3", "phi3", window),
        ("qwen2_yarn", "qwen2", yarn()),
    ] {
        let (path, hf_cfg) = fixture_gguf(fixture, arch, extra, vec![]);
        let (cfg, from_gguf, from_hf) = logits_of(&path, fixture)?;
        assert_eq!(cfg.arch, hf_cfg.arch, "{fixture}");
        assert_eq!(cfg.rope.scaling, hf_cfg.rope.scaling, "{fixture}");
        assert_eq!(cfg.layer_types, hf_cfg.layer_types, "{fixture}");
        assert_eq!(
            (
                cfg.qk_norm,
                cfg.qk_norm_across_heads,
                cfg.pre_norms,
                cfg.sandwich_norms
            ),
            (
                hf_cfg.qk_norm,
                hf_cfg.qk_norm_across_heads,
                hf_cfg.pre_norms,
                hf_cfg.sandwich_norms
            ),
            "{fixture}"
        );
        assert_eq!(cfg.norm_weight_fp32, hf_cfg.norm_weight_fp32, "{fixture}");
        let diff = max_abs(&from_gguf, &from_hf);
        let vs_hf = max_abs(
            &from_gguf,
            &reference(&hf_fixtures().join(fixture))["logits"],
        );
        println!(
            "{fixture} GGUF: max |Δlogit| vs HF folder {diff:.2e}, vs transformers {vs_hf:.2e}"
        );
        // GGUF stores the rms epsilon as f32; the logits came out bitwise equal all the same.
        assert!(diff <= 1e-5 && vs_hf <= 1e-4, "{fixture}: {diff} / {vs_hf}");
    }
    Ok(())
}

#[test]
fn a_wrong_yarn_factor_in_gguf_changes_the_logits() -> Result<()> {
    // Negative control for the comparison above: the factor must reach the decoder.
    let extra = vec![
        ("qwen2.rope.scaling.type".to_string(), Meta::Str("yarn")),
        ("qwen2.rope.scaling.factor".to_string(), Meta::F32(2.0)),
        (
            "qwen2.rope.scaling.original_context_length".to_string(),
            Meta::U32(2048),
        ),
    ];
    let (path, _) = fixture_gguf("qwen2_yarn", "qwen2", extra, vec![]);
    let (cfg, from_gguf, from_hf) = logits_of(&path, "qwen2_yarn")?;
    assert!(matches!(cfg.rope.scaling, RopeScaling::Yarn { factor, .. } if factor == 2.0));
    assert!(max_abs(&from_gguf, &from_hf) > 1e-2);
    Ok(())
}

#[test]
fn refuses_longrope_factor_tensors_and_yarn_log_multipliers_in_one_line() {
    let factors = Tensor::ones([8], (Kind::Float, Device::Cpu));
    let (path, _) = fixture_gguf(
        "phi3",
        "phi3",
        vec![],
        vec![("rope_factors_long.weight".to_string(), factors)],
    );
    let err = gguf::config_from_gguf(&GgufFile::open(&path).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("LongRoPE factors") && !err.contains('\n'),
        "{err}"
    );
    let extra = vec![
        ("qwen2.rope.scaling.type".to_string(), Meta::Str("yarn")),
        ("qwen2.rope.scaling.factor".to_string(), Meta::F32(4.0)),
        (
            "qwen2.rope.scaling.yarn_log_multiplier".to_string(),
            Meta::F32(0.1),
        ),
    ];
    let (path, _) = fixture_gguf("qwen2_yarn", "qwen2", extra, vec![]);
    let err = gguf::config_from_gguf(&GgufFile::open(&path).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("log multiplier") && !err.contains('\n'),
        "{err}"
    );
    let extra = vec![("qwen2.rope.scaling.type".to_string(), Meta::Str("longrope"))];
    let (path, _) = fixture_gguf("qwen2", "qwen2", extra, vec![]);
    let err = gguf::config_from_gguf(&GgufFile::open(&path).unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("unsupported rope scaling `longrope`"), "{err}");
}
