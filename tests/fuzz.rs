//! Fuzzing every parser of files users download from strangers, on stable Rust: a seeded
//! mutation loop over the real fixtures (and the cached real models when present) — bit
//! flips, truncations, splices, length and count fields overwritten with huge values, and
//! semantic edits of GGUF metadata, JSON, TOML and templates. Every input must load or fail
//! with one line: no panic (caught and reported with its location), no single allocation past
//! a budget derived from the input's size (a header's claimed sizes are checked first).
//!
//! The short run is part of the test suite (fixed seeds, a few seconds per target). The long
//! run: `make fuzz` (`KVCREDIT_FUZZ_ITERS` mutants per target, `KVCREDIT_FUZZ_SEED`,
//! `KVCREDIT_FUZZ_REPORT` appends per-target counts as JSON lines). Failing inputs are saved
//! under the target dir (`fuzz-failures/<target>/`); fixed ones are kept as regression cases
//! in `tests/fixtures/fuzz/<target>/` and replayed by every run.
mod common;
mod fuzz {
    pub mod gguf_bytes;
    pub mod harness;
    pub mod mutate;
}

use fuzz::gguf_bytes::{self, Parts};
use fuzz::harness::{self, Target, default_budget};
use fuzz::mutate;
use kvcredit::chat::{ChatMessage, ChatTemplate};
use kvcredit::config::ArchConfig;
use kvcredit::gguf::{GgmlType, GgufFile, Value, dequant};
use kvcredit::model::Weights;
use kvcredit::{Decoder, ExecPolicy, LogitsAt};
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

#[global_allocator]
static ALLOC: harness::Tracking = harness::Tracking;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn err_line(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Cached real models (`$KVCREDIT_HOME/models/*/*.gguf`), when any were pulled.
fn cached_models() -> Vec<PathBuf> {
    let home = std::env::var_os("KVCREDIT_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/kvcredit")
        });
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(home.join("models")) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let p = e.path().join(format!("{name}.gguf"));
            if p.is_file() {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Metadata only (no tensors) of a real model: its tokenizer and chat template.
fn metadata_only(path: &Path) -> Parts {
    let g = GgufFile::open(path).expect("cached model opens");
    Parts {
        metadata: g
            .metadata
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        tensors: vec![],
    }
}

/// Two tokens of a forward pass through a built decoder, both policies.
fn forward_smoke(d: &Decoder, policy: ExecPolicy) -> Result<(), String> {
    let vocab = d.config().vocab_size as i64;
    let ids = Tensor::from_slice(&[0i64, 1 % vocab, 2 % vocab]).view([1, 3]);
    let mut cache = d.new_cache(1, 4).map_err(err_line)?;
    let _ = d
        .forward(&ids, &mut cache, &policy, &LogitsAt::Last)
        .map_err(err_line)?;
    let next = Tensor::from_slice(&[3 % vocab]).view([1, 1]);
    let _ = d
        .forward(&next, &mut cache, &policy, &LogitsAt::Last)
        .map_err(err_line)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// GGUF container + de-quantization

#[test]
fn fuzz_gguf_reader() {
    let dir = harness::scratch("gguf_reader");
    let spm = gguf_bytes::read(
        &root().join("tests/fixtures/tokenizer/llama.cpp/ggml-vocab-llama-spm.gguf"),
    );
    let mut seeds = vec![
        std::fs::read(root().join("tests/fixtures/gguf/dequant.gguf")).unwrap(),
        gguf_bytes::write(&gguf_bytes::shrink_vocab(&spm, 300)),
        tiny_model_gguf("llama"),
        tiny_model_gguf("qwen2"),
    ];
    for m in cached_models() {
        // Real metadata, shrunk vocabulary (keeps an iteration fast).
        seeds.push(gguf_bytes::write(&gguf_bytes::shrink_vocab(
            &metadata_only(&m),
            2000,
        )));
    }
    let parts: Vec<Parts> = seeds
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let p = dir.join(format!("seed{i}.gguf"));
            std::fs::write(&p, s).unwrap();
            gguf_bytes::read(&p)
        })
        .collect();
    let file = dir.join("case.gguf");
    let target = Target {
        name: "gguf_reader",
        seeds,
        default_iters: 1500,
        seed: 1,
        alloc_budget: default_budget,
    };
    harness::fuzz(
        &target,
        &mut |rng, seeds| {
            let i = rng.below(seeds.len());
            match rng.below(3) {
                0 => gguf_bytes::field_mutation(rng, &seeds[i]),
                1 => {
                    let mut p = parts[i].clone();
                    for _ in 0..1 + rng.below(2) {
                        gguf_bytes::semantic(rng, &mut p);
                    }
                    gguf_bytes::write(&p)
                }
                _ => {
                    let header = gguf_bytes::fields(&seeds[i])
                        .0
                        .last()
                        .map_or(64, |f| f.0 + 8);
                    mutate::bytes(rng, &seeds[i], seeds, Some(0..header))
                }
            }
        },
        &|input| {
            std::fs::write(&file, input).unwrap();
            let g = GgufFile::open(&file).map_err(err_line)?;
            for t in &g.tensors {
                g.read_f32(t).map_err(err_line)?;
                let _ = g.read_tensor(t).map_err(err_line)?;
            }
            if g.get("general.architecture").and_then(Value::as_str) != Some("kvcredit-dequant") {
                kvcredit::gguf::config_from_gguf(&g).map_err(err_line)?;
            }
            Ok(())
        },
    );
}

#[test]
fn fuzz_dequant() {
    // Input: [type id, n elements (u32 LE), data...]. Seeds: every block type of dequant.gguf.
    let g = GgufFile::open(&root().join("tests/fixtures/gguf/dequant.gguf")).unwrap();
    let seeds: Vec<Vec<u8>> = g
        .tensors
        .iter()
        .filter(|t| !t.name.ends_with(".expected"))
        .map(|t| {
            let raw = g.read_raw(t).unwrap();
            let mut b = vec![t.ggml_type.id() as u8];
            b.extend((t.n_elements() as u32).to_le_bytes());
            b.extend(raw);
            b
        })
        .collect();
    assert!(seeds.len() >= 13, "one seed per ggml type");
    let target = Target {
        name: "dequant",
        seeds,
        default_iters: 3000,
        seed: 2,
        alloc_budget: default_budget,
    };
    harness::fuzz(
        &target,
        &mut |rng, seeds| {
            let s = rng.pick(seeds);
            let mut b = if rng.below(2) == 0 {
                mutate::field(rng, s, &[(0, 1), (1, 4)])
            } else {
                mutate::bytes(rng, s, seeds, Some(0..5))
            };
            if rng.one_in(3) {
                // Random payload: every bit pattern of scales, NaN/inf halves included.
                for x in b.iter_mut().skip(5) {
                    *x = rng.u64() as u8;
                }
            }
            b
        },
        &|input| {
            if input.len() < 5 {
                return Err("short input".into());
            }
            let ty = GgmlType::from_u32(input[0] as u32).ok_or("unknown type")?;
            let n = u32::from_le_bytes(input[1..5].try_into().unwrap()) as usize;
            let data = &input[5..];
            let a = dequant::dequantize(ty, data, n).map_err(err_line)?;
            let mut b = vec![0f32; a.len()];
            dequant::dequantize_into(ty, data, &mut b).map_err(err_line)?;
            // Both entry points decode the same bits.
            if a.iter().zip(&b).any(|(x, y)| x.to_bits() != y.to_bits()) {
                panic!("dequantize and dequantize_into disagree for {ty:?}");
            }
            Ok(())
        },
    );
}

// ---------------------------------------------------------------------------------------
// A tiny real-format model GGUF built from an HF fixture (for the whole `model::gguf::load` path).

/// GGUF name of a Hugging Face tensor key (inverse of `gguf::hf_tensor_name`).
fn gguf_name(hf: &str) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").expect("layer tensor");
    let (layer, part) = rest.split_once('.').unwrap();
    let (module, suffix) = part.rsplit_once('.').unwrap();
    let m = match module {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "post_attention_layernorm" => "ffn_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        other => panic!("unmapped {other}"),
    };
    format!("blk.{layer}.{m}.{suffix}")
}

/// `tests/fixtures/hf/<fixture>` as a GGUF file: architecture metadata from its config, F32
/// tensors under GGUF names, and a byte-level BPE vocabulary (the first `vocab_size` tokens of
/// llama.cpp's starcoder vocabulary).
fn tiny_model_gguf(fixture: &str) -> Vec<u8> {
    let dir = common::hf_fixtures().join(fixture);
    let cfg = ArchConfig::from_hf_file(&dir.join("config.json")).unwrap();
    let arch = match cfg.arch {
        kvcredit::Arch::Llama => "llama",
        kvcredit::Arch::Qwen2 => "qwen2",
        other => panic!("no GGUF seed for {other:?}"),
    };
    let vocab = gguf_bytes::read(
        &root().join("tests/fixtures/tokenizer/llama.cpp/ggml-vocab-starcoder.gguf"),
    );
    let vocab = gguf_bytes::shrink_vocab(&vocab, cfg.vocab_size);
    let k = |s: &str| format!("{arch}.{s}");
    let mut metadata = vec![
        (
            "general.architecture".to_string(),
            Value::String(arch.into()),
        ),
        (k("embedding_length"), Value::U32(cfg.hidden_size as u32)),
        (k("block_count"), Value::U32(cfg.num_layers() as u32)),
        (
            k("feed_forward_length"),
            Value::U32(cfg.intermediate_size as u32),
        ),
        (
            k("attention.head_count"),
            Value::U32(cfg.num_attention_heads as u32),
        ),
        (
            k("attention.head_count_kv"),
            Value::U32(cfg.num_key_value_heads as u32),
        ),
        (k("attention.key_length"), Value::U32(cfg.head_dim as u32)),
        (
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(cfg.rms_norm_eps as f32),
        ),
        (k("rope.freq_base"), Value::F32(cfg.rope.theta as f32)),
        (
            k("context_length"),
            Value::U32(cfg.max_position_embeddings as u32),
        ),
    ];
    metadata.extend(
        vocab
            .metadata
            .into_iter()
            .filter(|(key, _)| key.starts_with("tokenizer.")),
    );
    let mut tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)> =
        Tensor::read_safetensors(dir.join("model.safetensors"))
            .unwrap()
            .into_iter()
            .map(|(name, t)| {
                let t = t.to_kind(Kind::Float).contiguous();
                let dims: Vec<u64> = t.size().iter().rev().map(|&d| d as u64).collect();
                let n = t.numel();
                let mut raw = vec![0u8; n * 4];
                t.copy_data_u8(&mut raw, n);
                (gguf_name(&name), dims, 0, raw)
            })
            .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    gguf_bytes::write(&Parts { metadata, tensors })
}

#[test]
fn fuzz_gguf_model() {
    let dir = harness::scratch("gguf_model");
    let seeds = vec![tiny_model_gguf("llama"), tiny_model_gguf("qwen2")];
    let parts: Vec<Parts> = seeds
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let p = dir.join(format!("seed{i}.gguf"));
            std::fs::write(&p, s).unwrap();
            gguf_bytes::read(&p)
        })
        .collect();
    let file = dir.join("case.gguf");
    let target = Target {
        name: "gguf_model",
        seeds,
        default_iters: 300,
        seed: 3,
        alloc_budget: default_budget,
    };
    harness::fuzz(
        &target,
        &mut |rng, seeds| {
            let i = rng.below(seeds.len());
            if rng.below(3) > 0 {
                let mut p = parts[i].clone();
                gguf_bytes::semantic(rng, &mut p);
                gguf_bytes::write(&p)
            } else {
                gguf_bytes::field_mutation(rng, &seeds[i])
            }
        },
        &|input| {
            std::fs::write(&file, input).unwrap();
            let mut m = kvcredit::model::gguf::load(&file).map_err(err_line)?;
            let d = m.take_decoder(Kind::Float, Device::Cpu).map_err(err_line)?;
            forward_smoke(&d, ExecPolicy::Stock)
        },
    );
}

// ---------------------------------------------------------------------------------------
// Tokenizer rebuilt from GGUF metadata

fn exercise_tokenizer(info: &kvcredit::tokenizer::TokenizerInfo) -> Result<(), String> {
    let t = &info.tokenizer;
    for text in [
        "Hello world",
        " 12 + 3 = 15\n",
        "<|im_end|><s>\u{2581}x",
        "é\u{0}\u{fffd}🙂",
    ] {
        for special in [false, true] {
            let enc = t.encode(text, special).map_err(err_line)?;
            t.decode(enc.get_ids(), false).map_err(err_line)?;
        }
    }
    let n = t.get_vocab_size(true) as u32;
    let ids: Vec<u32> = (0..8)
        .chain([n.saturating_sub(1), n, n + 7, u32::MAX])
        .collect();
    let _ = t.decode(&ids, false);
    if let Some(src) = &info.chat_template
        && let Ok(c) = ChatTemplate::new(src, info.bos_token.as_deref(), info.eos_token.as_deref())
    {
        let _ = c.render(&[ChatMessage::user("hi")], true);
    }
    Ok(())
}

#[test]
fn fuzz_tokenizer_gguf() {
    let dir = harness::scratch("tokenizer_gguf");
    let vocab_dir = root().join("tests/fixtures/tokenizer/llama.cpp");
    let mut parts = vec![
        gguf_bytes::shrink_vocab(
            &gguf_bytes::read(&vocab_dir.join("ggml-vocab-llama-spm.gguf")),
            600,
        ),
        gguf_bytes::shrink_vocab(
            &gguf_bytes::read(&vocab_dir.join("ggml-vocab-starcoder.gguf")),
            600,
        ),
    ];
    for m in cached_models() {
        parts.push(gguf_bytes::shrink_vocab(&metadata_only(&m), 1500));
    }
    let seeds: Vec<Vec<u8>> = parts.iter().map(gguf_bytes::write).collect();
    let file = dir.join("case.gguf");
    let target = Target {
        name: "tokenizer_gguf",
        seeds,
        default_iters: 400,
        seed: 4,
        alloc_budget: default_budget,
    };
    harness::fuzz(
        &target,
        &mut |rng, seeds| {
            let i = rng.below(seeds.len());
            match rng.below(5) {
                0 => gguf_bytes::field_mutation(rng, &seeds[i]),
                1 => mutate::bytes(rng, &seeds[i], seeds, None),
                _ => {
                    let mut p = parts[i].clone();
                    for _ in 0..1 + rng.below(3) {
                        gguf_bytes::semantic(rng, &mut p);
                    }
                    gguf_bytes::write(&p)
                }
            }
        },
        &|input| {
            std::fs::write(&file, input).unwrap();
            let info = kvcredit::tokenizer::from_gguf_path(&file).map_err(err_line)?;
            exercise_tokenizer(&info)
        },
    );
}

// ---------------------------------------------------------------------------------------
// Hugging Face checkpoints: config.json (both dialects) and safetensors

fn fixture_weights(dir: &Path) -> Vec<(String, Tensor)> {
    Tensor::read_safetensors(dir.join("model.safetensors")).unwrap()
}

fn shallow(w: &[(String, Tensor)]) -> Weights {
    Weights::from_named(
        w.iter()
            .map(|(k, t)| (k.clone(), t.shallow_clone()))
            .collect(),
        Kind::Float,
        Device::Cpu,
    )
}

#[test]
fn fuzz_config_json() {
    // Input: [fixture index, config.json bytes...]; the fixture's weights build the decoder.
    let dirs: Vec<PathBuf> = common::fixture_dirs()
        .into_iter()
        .filter(|d| d.join("model.safetensors").exists())
        .collect();
    let weights: Vec<Vec<(String, Tensor)>> = dirs.iter().map(|d| fixture_weights(d)).collect();
    let seeds: Vec<Vec<u8>> = dirs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let mut b = vec![i as u8];
            b.extend(std::fs::read(d.join("config.json")).unwrap());
            b
        })
        .collect();
    let scratch = harness::scratch("config_json");
    let file = scratch.join("config.json");
    let target = Target {
        name: "config_json",
        seeds,
        default_iters: 600,
        seed: 5,
        alloc_budget: default_budget,
    };
    const DICT: &[&str] = &[
        "null",
        "-1",
        "0",
        "1e400",
        "18446744073709551616",
        "\"sliding_attention\"",
        "[]",
        "{}",
        "\"rope_parameters\": {\"full_attention\": {}}, ",
        "\"layer_types\": [\"sliding_attention\"], ",
        "\"sliding_window\": 0, ",
        "\"head_dim\": 0, ",
        "\"num_attention_heads\": 0, ",
        "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 0}, ",
        "\"query_pre_attn_scalar\": 0, ",
        "\"num_hidden_layers\": 1000000000000, ",
        "\"final_logit_softcapping\": 0.0, ",
    ];
    harness::fuzz(
        &target,
        &mut |rng, seeds| {
            let s = rng.pick(seeds);
            let (idx, body) = (s[0], &s[1..]);
            let text = String::from_utf8_lossy(body).into_owned();
            let out = match rng.below(3) {
                0 => mutate::text(rng, &text, seeds, DICT),
                _ => {
                    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
                    for _ in 0..1 + rng.below(3) {
                        mutate::json(rng, &mut v);
                    }
                    v.to_string()
                }
            };
            let mut b = vec![idx];
            b.extend(out.into_bytes());
            b
        },
        &|input| {
            let Some((&idx, body)) = input.split_first() else {
                return Err("empty".into());
            };
            let w = weights.get(idx as usize).ok_or("no such fixture")?;
            std::fs::write(&file, body).unwrap();
            let cfg = ArchConfig::from_hf_file(&file).map_err(err_line)?;
            let d = Decoder::from_weights(cfg, shallow(w)).map_err(err_line)?;
            forward_smoke(&d, ExecPolicy::Stock)?;
            forward_smoke(&d, ExecPolicy::BatchInvariant(kvcredit::exec::BiTiles::CPU))
        },
    );
}

/// Byte range of a safetensors JSON header (after its 8-byte length).
fn st_header(b: &[u8]) -> Option<std::ops::Range<usize>> {
    let n = u64::from_le_bytes(b.get(..8)?.try_into().ok()?) as usize;
    (8 + n <= b.len()).then_some(8..8 + n)
}

#[test]
fn fuzz_safetensors() {
    // Input: [fixture index, model.safetensors bytes...], loaded next to the fixture's config.
    let dirs: Vec<PathBuf> = ["llama", "qwen2", "gemma2", "qwen3"]
        .iter()
        .map(|n| common::hf_fixtures().join(n))
        .collect();
    let seeds: Vec<Vec<u8>> = dirs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let mut b = vec![i as u8];
            b.extend(std::fs::read(d.join("model.safetensors")).unwrap());
            b
        })
        .collect();
    let scratch = harness::scratch("safetensors");
    for (i, d) in dirs.iter().enumerate() {
        let sub = scratch.join(i.to_string());
        std::fs::create_dir_all(&sub).unwrap();
        std::fs::copy(d.join("config.json"), sub.join("config.json")).unwrap();
    }
    let target = Target {
        name: "safetensors",
        seeds,
        default_iters: 400,
        seed: 6,
        alloc_budget: default_budget,
    };
    harness::fuzz(
        &target,
        &mut |rng, seeds| {
            let s = rng.pick(seeds);
            let (idx, body) = (s[0], &s[1..]);
            let head = st_header(body).unwrap();
            let out = match rng.below(4) {
                0 => mutate::field(rng, body, &[(0, 8)]),
                1 => mutate::bytes(rng, body, seeds, Some(head)),
                _ => {
                    // Edit the header JSON (shapes, offsets, dtypes) and re-frame it; the
                    // length prefix is kept honest half of the time.
                    let mut v: serde_json::Value =
                        serde_json::from_slice(&body[head.clone()]).unwrap();
                    let names: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
                    let name = rng.pick(&names).clone();
                    let entry = v.get_mut(&name).unwrap();
                    match rng.below(4) {
                        0 if entry.is_object() => {
                            entry["dtype"] =
                                serde_json::json!(rng.pick(&[
                                    "F16", "BF16", "I64", "U8", "BOOL", "F64", "F8_E4M3", "X"
                                ]))
                        }
                        1 => {
                            if let Some(s) = entry.get_mut("shape").and_then(|s| s.as_array_mut())
                                && !s.is_empty()
                            {
                                let j = rng.below(s.len());
                                s[j] = serde_json::json!(mutate::interesting(rng, 64));
                            }
                        }
                        2 => {
                            if let Some(o) =
                                entry.get_mut("data_offsets").and_then(|o| o.as_array_mut())
                                && !o.is_empty()
                            {
                                let j = rng.below(o.len());
                                o[j] =
                                    serde_json::json!(mutate::interesting(rng, body.len() as u64));
                            }
                        }
                        _ => mutate::json(rng, &mut v),
                    }
                    let h = v.to_string().into_bytes();
                    let claimed = if rng.below(2) == 0 {
                        h.len() as u64
                    } else {
                        head.len() as u64
                    };
                    let mut out = claimed.to_le_bytes().to_vec();
                    out.extend(&h);
                    out.extend(&body[head.end..]);
                    out
                }
            };
            let mut b = vec![idx];
            b.extend(out);
            b
        },
        &|input| {
            let Some((&idx, body)) = input.split_first() else {
                return Err("empty".into());
            };
            let sub = scratch.join(idx.to_string());
            if !sub.exists() {
                return Err("no such fixture".into());
            }
            std::fs::write(sub.join("model.safetensors"), body).unwrap();
            let d = Decoder::load_hf_dir(&sub, Kind::Float, Device::Cpu).map_err(err_line)?;
            forward_smoke(&d, ExecPolicy::Stock)
        },
    );
}

// ---------------------------------------------------------------------------------------
// Chat templates

/// Hand-written templates in the styles real checkpoints use (ChatML, Llama-2, Gemma, a tool
/// template with `tojson`, namespaces and loop controls).
const TEMPLATES: &[&str] = &[
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate') }}{% endif %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'].strip() + ' [/INST]' }}{% else %}{{ ' ' + m['content'].strip() + ' ' + eos_token }}{% endif %}{% endfor %}",
    "{% set ns = namespace(first=true) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content | trim }}<end_of_turn>\n{% set ns.first = false %}{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
    "{%- if tools %}{{ tools | tojson(indent=2) }}\n{%- for t in tools %}{{ t.name | upper }}: {{ t | tojson(sort_keys=true, separators=[',', ':']) }}{% endfor %}{%- endif %}{{ strftime_now('%Y-%m-%d %A %B %e %H:%M:%S %%') }}{% for m in messages[-2:] | reverse %}{{ m.content[::-1] | replace('a', 'b') }}{{ loop.length }}{% break %}{% endfor %}",
];

#[test]
fn fuzz_chat_template() {
    let mut seeds: Vec<Vec<u8>> = TEMPLATES.iter().map(|t| t.as_bytes().to_vec()).collect();
    for m in cached_models() {
        if let Some((_, Value::String(t))) = metadata_only(&m)
            .metadata
            .into_iter()
            .find(|(k, _)| k == "tokenizer.chat_template")
        {
            seeds.push(t.into_bytes());
        }
    }
    let target = Target {
        name: "chat_template",
        seeds,
        default_iters: 3000,
        seed: 7,
        alloc_budget: default_budget,
    };
    const DICT: &[&str] = &[
        "{%",
        "%}",
        "{{",
        "}}",
        "{#",
        "#}",
        "{%-",
        "-%}",
        "{% endfor %}",
        "{% endif %}",
        "{% for x in range(100000000) %}",
        "{% for x in messages %}",
        "loop.index",
        "loop.cycle(1,2)",
        "| tojson(indent=1000000000000)",
        "| tojson(indent=-1)",
        "| tojson(separators=[1])",
        "raise_exception(1)",
        "strftime_now('%Q%')",
        "strftime_now(1)",
        "namespace(",
        "[::-1]",
        "[1:-1:0]",
        "* 100000000",
        "'x' * 99999999",
        "~",
        "| join(9)",
        ".items()",
        ".split(',')",
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
        "{% set x = x %}",
        "messages[0]['content']",
        "| length",
        "tools",
        "| map(attribute='role')",
        "1/0",
        "(",
        ")",
        "\u{0}",
        "é",
    ];
    let tools = serde_json::json!({"tools": [{"name": "calc", "parameters": {"type": "object", "x": [1, 2.5, null]}}]});
    harness::fuzz(
        &target,
        &mut |rng, seeds| {
            let s = String::from_utf8_lossy(rng.pick::<Vec<u8>>(seeds)).into_owned();
            mutate::text(rng, &s, seeds, DICT).into_bytes()
        },
        &|input| {
            let src = std::str::from_utf8(input).map_err(err_line)?;
            let t = ChatTemplate::new(src, Some("<s>"), Some("</s>")).map_err(err_line)?;
            let msgs = [
                ChatMessage::system("Be brief."),
                ChatMessage::user("What is 2+2?"),
                ChatMessage::assistant("4"),
                ChatMessage::user("And 3+3?"),
            ];
            let a = t.render(&msgs, true);
            let b = t.render_with(&msgs[1..2], false, tools.clone());
            a.map_err(err_line)?;
            b.map_err(err_line)?;
            Ok(())
        },
    );
}

// ---------------------------------------------------------------------------------------
// Campaign specs (TOML)

#[test]
fn fuzz_campaign_spec() {
    let mut seeds: Vec<Vec<u8>> = std::fs::read_dir(root().join("experiments"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .map(|p| std::fs::read(p).unwrap())
        .collect();
    seeds.sort();
    assert!(!seeds.is_empty());
    let scratch = harness::scratch("campaign_spec");
    let file = scratch.join("spec.toml");
    let target = Target {
        name: "campaign_spec",
        seeds,
        default_iters: 3000,
        seed: 8,
        alloc_budget: default_budget,
    };
    const DICT: &[&str] = &[
        "nan",
        "inf",
        "-inf",
        "9223372036854775807",
        "-9223372036854775808",
        "18446744073709551616",
        "[passes]",
        "[[passes]]",
        "run = []",
        "batch_size = 0",
        "\"\"",
        "'''",
        "\"\\u0000\"",
        "k = 18446744073709551615",
        "max_new_tokens = 9223372036854775807",
        "1979-05-27T07:32:00Z",
        "{}",
        "[",
        "]",
        "=",
        "\n",
        "#",
        "device = \"cuda:99\"",
        "policy = \"x\"",
    ];
    harness::fuzz(
        &target,
        &mut |rng, seeds| {
            let s = String::from_utf8_lossy(rng.pick::<Vec<u8>>(seeds)).into_owned();
            if rng.below(2) == 0 {
                mutate::text(rng, &s, seeds, DICT).into_bytes()
            } else {
                let mut v: toml::Value = toml::from_str(&s).unwrap();
                for _ in 0..1 + rng.below(3) {
                    mutate::toml(rng, &mut v);
                }
                toml::to_string(&v).unwrap_or(s).into_bytes()
            }
        },
        &|input| {
            std::fs::write(&file, input).unwrap();
            kvcredit::credit::CampaignSpec::load(&file).map_err(err_line)?;
            Ok(())
        },
    );
}

// ---------------------------------------------------------------------------------------
// Parquet run dirs

const RUN_FILES: [&str; 3] = [
    "estimates.parquet",
    "continuations.parquet",
    "manifest.json",
];

#[test]
fn fuzz_run_dir() {
    // Input: [run index, file index, bytes...]: one file of a fixture run dir replaced.
    let runs_root = root().join("tests/fixtures/analysis/runs");
    let mut runs: Vec<PathBuf> = std::fs::read_dir(&runs_root)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("manifest.json").exists())
        .collect();
    runs.sort();
    let mut seeds = Vec::new();
    for (r, run) in runs.iter().enumerate() {
        for (f, name) in RUN_FILES.iter().enumerate() {
            let mut b = vec![r as u8, f as u8];
            b.extend(std::fs::read(run.join(name)).unwrap());
            seeds.push(b);
        }
    }
    let scratch = harness::scratch("run_dir");
    let target = Target {
        name: "run_dir",
        seeds,
        default_iters: 1200,
        seed: 9,
        alloc_budget: default_budget,
    };
    let opts = kvcredit::analysis::AnalyzeOptions {
        reps: 20,
        ..Default::default()
    };
    harness::fuzz(
        &target,
        &mut |rng, seeds| {
            let s = rng.pick(seeds);
            let (head, body) = (&s[..2], &s[2..]);
            let out = if head[1] == 2 {
                let text = String::from_utf8_lossy(body).into_owned();
                if rng.below(2) == 0 {
                    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
                    mutate::json(rng, &mut v);
                    v.to_string().into_bytes()
                } else {
                    mutate::text(rng, &text, seeds, &["null", "-1", "1e999", "\"\"", "{}"])
                        .into_bytes()
                }
            } else {
                // Parquet keeps its metadata in the footer: aim there half of the time.
                let n = body.len();
                mutate::bytes(rng, body, seeds, Some(n.saturating_sub(2048)..n))
            };
            let mut b = head.to_vec();
            b.extend(out);
            b
        },
        &|input| {
            if input.len() < 2 {
                return Err("short".into());
            }
            let (r, f) = (input[0] as usize, input[1] as usize);
            let (Some(run), Some(name)) = (runs.get(r), RUN_FILES.get(f)) else {
                return Err("no such file".into());
            };
            let dir = scratch.join("run");
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            for other in RUN_FILES {
                std::fs::copy(run.join(other), dir.join(other)).unwrap();
            }
            std::fs::write(dir.join(name), &input[2..]).unwrap();
            let data = kvcredit::analysis::load_run(&dir).map_err(err_line)?;
            kvcredit::analysis::read::read_continuations(&dir).map_err(err_line)?;
            kvcredit::analysis::summarize_runs(&[data], &opts).map_err(err_line)?;
            Ok(())
        },
    );
}

// ---------------------------------------------------------------------------------------
// SpectrumKV wire frames and the decode worker

/// Frames of a real prefilled cache (the qwen2 fixture, GQA): mixed tiers with dropped
/// tokens, all-FP16 and all-INT4, under both quantizers and both 16-bit wire types; each with
/// the token its decode request feeds (the context's next id).
fn wire_seeds() -> Vec<(Vec<u8>, i64)> {
    use kvcredit::spectrum::tiers::{TierPlan, TieredKv};
    use kvcredit::spectrum::{Quantizer, Tier, wire};
    let mut requests = Vec::new();
    for kind in [Kind::Half, Kind::BFloat16] {
        let m = common::load(&common::hf_fixtures().join("qwen2"), kind).unwrap();
        let ids: Vec<i64> = (0..41i64).map(|i| (i * 37 + 5) % 127).collect();
        let (ctx, last) = ids.split_at(40);
        let mut cache = m.new_cache(1, 44).unwrap();
        let t = Tensor::from_slice(ctx).view([1, -1]);
        let _ = m
            .forward(&t, &mut cache, &ExecPolicy::Stock, &LogitsAt::Last)
            .unwrap();
        let mixed = TierPlan::new(
            (0..40)
                .map(|i| [Tier::Fp16, Tier::Int8, Tier::Int4, Tier::Drop][i % 4])
                .collect(),
        );
        for plan in [
            mixed,
            TierPlan::uniform(40, Tier::Fp16),
            TierPlan::uniform(40, Tier::Int4),
        ] {
            for q in [Quantizer::Kivi, Quantizer::LabCompat] {
                let t = TieredKv::build(&cache, 0, &plan, q).unwrap();
                requests.push((wire::encode(&t).unwrap(), last[0]));
            }
        }
    }
    requests
}

fn wire_frames() -> Vec<Vec<u8>> {
    wire_seeds().into_iter().map(|(f, _)| f).collect()
}

fn wire_model() -> Decoder {
    common::load(&common::hf_fixtures().join("qwen2"), Kind::Half).unwrap()
}

/// Re-sign a frame: its trailer becomes the SHA-256 of the bytes before it, so a mutation
/// reaches the header checks, the index lists and the blocks instead of the fingerprint.
fn resign(b: &mut [u8]) {
    use sha2::{Digest, Sha256};
    let t = kvcredit::spectrum::wire::TRAILER;
    if b.len() >= t {
        let body = b.len() - t;
        let d = Sha256::digest(&b[..body]);
        b[body..].copy_from_slice(&d);
    }
}

/// Header fields of a version-1 frame: `(offset, width)`.
const FRAME_FIELDS: &[(usize, usize)] = &[
    (4, 2),
    (6, 1),
    (7, 1),
    (8, 2),
    (10, 1),
    (11, 1),
    (12, 4),
    (16, 4),
    (20, 4),
    (24, 4),
    (28, 4),
    (32, 4),
    (36, 4),
];

fn mutate_frame(rng: &mut harness::Rng, seeds: &[Vec<u8>]) -> Vec<u8> {
    let s = rng.pick(seeds);
    let mut b = match rng.below(3) {
        0 => mutate::field(rng, s, FRAME_FIELDS),
        1 => mutate::bytes(
            rng,
            s,
            seeds,
            Some(0..kvcredit::spectrum::wire::HEADER + 200),
        ),
        _ => mutate::bytes(rng, s, seeds, None),
    };
    if rng.below(4) != 0 {
        resign(&mut b);
    }
    b
}

#[test]
fn fuzz_wire_frame() {
    // Every frame either is refused with one line, or decodes, re-encodes to exactly the bytes
    // received (the format has one spelling of each frame) and, if it fits the receiving
    // model, restores to a cache.
    use kvcredit::spectrum::wire;
    let seeds = wire_frames();
    let m = wire_model();
    let (shape, limit) = (m.kv_shape(), m.config().max_position_embeddings);
    let target = Target {
        name: "wire_frame",
        seeds,
        default_iters: 3000,
        seed: 10,
        alloc_budget: default_budget,
    };
    harness::fuzz(&target, &mut mutate_frame, &|input| {
        let t = wire::decode(input).map_err(err_line)?;
        let again = wire::encode(&t).map_err(err_line)?;
        assert!(again == input, "an accepted frame re-encodes differently");
        // What the decode worker checks before it restores (its model's shape and positions).
        t.check_fits(shape, limit, 1).map_err(err_line)?;
        t.restore(Kind::Float, Device::Cpu, 1).map_err(err_line)?;
        Ok(())
    });
}

#[test]
fn fuzz_wire_server() {
    // A live decode worker on loopback gets mutated requests (envelope and frame); each gets a
    // reply or a closed connection, and after each one the worker still answers a good
    // request with the in-process tokens.
    use kvcredit::spectrum::transport::{self, ServeOptions};
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::time::Duration;
    let requests = wire_seeds();
    let frames: Vec<Vec<u8>> = requests.iter().map(|(f, _)| f.clone()).collect();
    let m = wire_model();
    let (good_frame, good_first) = requests[0].clone();
    let tiered = kvcredit::spectrum::wire::decode(&good_frame).unwrap();
    let (want, ..) =
        transport::decode_greedy(&m, &tiered, good_first, 2, &ExecPolicy::Stock).unwrap();
    let envelope = |first: i64, steps: u32, len: u64| {
        let mut e = Vec::with_capacity(24);
        e.extend_from_slice(b"SPRQ");
        e.extend_from_slice(&1u16.to_le_bytes());
        e.extend_from_slice(&[0, 0]);
        e.extend_from_slice(&(first as u32).to_le_bytes());
        e.extend_from_slice(&steps.to_le_bytes());
        e.extend_from_slice(&len.to_le_bytes());
        e
    };
    let seeds: Vec<Vec<u8>> = requests
        .iter()
        .map(|(f, first)| {
            let mut r = envelope(*first, 2, f.len() as u64);
            r.extend_from_slice(f);
            r
        })
        .collect();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let m = wire_model();
        let opts = ServeOptions {
            max_frame: 1 << 20,
            max_requests: None,
            read_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
            max_connections: 8,
            policy: ExecPolicy::Stock,
        };
        transport::serve(&m, &listener, &opts, &mut |_| {})
    });
    let target = Target {
        name: "wire_server",
        seeds,
        default_iters: 300,
        seed: 11,
        alloc_budget: default_budget,
    };
    const ENVELOPE_FIELDS: &[(usize, usize)] = &[(4, 2), (6, 2), (8, 4), (12, 4), (16, 8)];
    harness::fuzz(
        &target,
        &mut |rng, seeds| {
            let s = rng.pick(seeds);
            match rng.below(3) {
                0 => mutate::field(rng, s, ENVELOPE_FIELDS),
                1 => {
                    // Keep the envelope, damage the frame (re-signed most of the time).
                    let mut r = s[..24].to_vec();
                    let f = mutate_frame(rng, &frames);
                    r[16..24].copy_from_slice(&(f.len() as u64).to_le_bytes());
                    r.extend(f);
                    r
                }
                _ => mutate::bytes(rng, s, seeds, Some(0..64)),
            }
        },
        &|input| {
            let connect = || {
                let s = TcpStream::connect(addr).expect("the worker is listening");
                s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
                s
            };
            let mut s = connect();
            // The worker may hang up before reading everything: a failed write is its answer.
            let _ = s.write_all(input);
            let _ = s.shutdown(Shutdown::Write);
            let mut reply = Vec::new();
            let _ = s.read_to_end(&mut reply);
            let outcome = if reply.len() >= 9 && &reply[..4] == b"SPRS" && reply[4] == 1 {
                let text = String::from_utf8_lossy(&reply[9..]).into_owned();
                Err(text)
            } else {
                Ok(())
            };
            let mut s = connect();
            let r = transport::request(&mut s, &good_frame, good_first, 2, None)
                .expect("the worker still serves after a bad request");
            assert_eq!(r.tokens, want, "the worker's answer changed");
            outcome
        },
    );
}
