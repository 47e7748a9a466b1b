//! Real GGUF checkpoints against Hugging Face transformers' GGUF loader:
//! - the configuration read from the metadata;
//! - de-quantized, renamed, quirk-corrected tensors (q/k un-permutation for `llama`, Gemma's
//!   `1 + w` norms) against transformers' state dict (`<model>.tensors.json`);
//! - the decoder's float32 logits against transformers' float32 forward (`<model>.logits.json`),
//!   within 1e-3 max-abs.
//!
//! Fixtures come from `tests/gen_gguf_reference.py tensors logits`. Models are read from
//! `$KVCREDIT_HOME/models/<name>/<name>.gguf` (default `~/.cache/kvcredit`).
mod common;

use kvcredit::config::{Activation, Arch, LayerKind, RopeScaling};
use kvcredit::exec::ExecPolicy;
use kvcredit::gguf::{self, GgufFile};
use std::collections::HashMap;
use std::path::Path;
use tch::{Device, Kind, Tensor};

fn fixture(name: &str) -> serde_json::Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf")
        .join(name);
    serde_json::from_str(
        &std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
    )
    .expect("json")
}

const MODELS: [&str; 3] = [
    "smollm2-135m-instruct",
    "qwen2.5-coder-0.5b-instruct",
    "gemma-3-270m",
];

#[test]
fn configs_from_metadata() {
    let cfg = |n: &str| {
        gguf::config_from_gguf(&GgufFile::open(&common::model_path(n)).expect("open"))
            .expect("config")
    };

    let s = cfg("smollm2-135m-instruct");
    assert_eq!(s.arch, Arch::Llama);
    assert_eq!(
        (s.vocab_size, s.hidden_size, s.intermediate_size),
        (49_152, 576, 1536)
    );
    assert_eq!(
        (s.num_attention_heads, s.num_key_value_heads, s.head_dim),
        (9, 3, 64)
    );
    assert_eq!(s.num_layers(), 30);
    assert_eq!(s.rope.theta, 100_000.0);
    assert_eq!(s.rope.scaling, RopeScaling::None);
    assert_eq!(s.rms_norm_eps, 1e-5f32 as f64);
    assert!(s.tie_word_embeddings && !s.attention_bias && !s.qk_norm && !s.norm_weight_offset);
    assert_eq!(s.activation, Activation::Silu);
    assert_eq!(s.max_position_embeddings, 8192);
    assert!(s.layer_types.iter().all(|&k| k == LayerKind::Full));
    assert_eq!(s.softmax_scale, 1.0 / 8.0);

    let q = cfg("qwen2.5-coder-0.5b-instruct");
    assert_eq!(q.arch, Arch::Qwen2);
    assert_eq!(
        (q.vocab_size, q.hidden_size, q.intermediate_size),
        (151_936, 896, 4864)
    );
    assert_eq!(
        (q.num_attention_heads, q.num_key_value_heads, q.head_dim),
        (14, 2, 64)
    );
    assert_eq!(q.num_layers(), 24);
    assert_eq!(q.rope.theta, 1_000_000.0);
    assert!(q.attention_bias && !q.tie_word_embeddings && !q.qk_norm);
    assert_eq!(q.bos_token_id, Some(151_643));

    let g = cfg("gemma-3-270m");
    assert_eq!(g.arch, Arch::Gemma3);
    assert_eq!(
        (g.vocab_size, g.hidden_size, g.intermediate_size),
        (262_144, 640, 2048)
    );
    assert_eq!(
        (g.num_attention_heads, g.num_key_value_heads, g.head_dim),
        (4, 1, 256)
    );
    assert_eq!(g.num_layers(), 18);
    assert_eq!(g.rope.theta, 1_000_000.0);
    assert_eq!(g.rope_local.as_ref().map(|r| r.theta), Some(10_000.0));
    assert!(g.qk_norm && g.norm_weight_offset && g.scale_embeddings && g.sandwich_norms);
    assert!(g.tie_word_embeddings && !g.attention_bias);
    assert_eq!(g.activation, Activation::GeluTanh);
    assert_eq!(g.softmax_scale, 1.0 / 16.0); // query_pre_attn_scalar = head_dim = 256
    assert_eq!(g.final_logit_softcapping, None);
    for (i, k) in g.layer_types.iter().enumerate() {
        let want = if (i + 1) % 6 == 0 {
            LayerKind::Full
        } else {
            LayerKind::Sliding { window: 512 }
        };
        assert_eq!(*k, want, "layer {i}");
    }
    assert_eq!(g.eos_token_ids, vec![1]);
}

/// Compare one model's de-quantized tensors with transformers'.
fn check_tensors(name: &str) -> usize {
    let fx = fixture(&format!("{name}.tensors.json"));
    let model = kvcredit::model::gguf::load(&common::model_path(name)).expect("load");
    let by_name: HashMap<&str, &Tensor> =
        model.tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    if model.config.tie_word_embeddings {
        assert!(!by_name.contains_key("lm_head.weight"));
    }
    let mut checked = 0;
    for e in fx["tensors"].as_array().expect("tensors") {
        let hf = e["hf"].as_str().expect("hf");
        let t = by_name
            .get(hf)
            .unwrap_or_else(|| panic!("{name}: no tensor `{hf}`"));
        let shape: Vec<i64> = e["shape"]
            .as_array()
            .expect("shape")
            .iter()
            .map(|x| x.as_i64().expect("dim"))
            .collect();
        assert_eq!(t.size(), shape, "{name} {hf}");
        assert_eq!(t.kind(), Kind::Float);
        let flat = t.reshape([-1]);
        let want_vals: Vec<f64> = e["values"]
            .as_array()
            .expect("values")
            .iter()
            .map(|x| x.as_f64().expect("v"))
            .collect();
        for (i, (idx, want)) in e["indices"]
            .as_array()
            .expect("idx")
            .iter()
            .zip(&want_vals)
            .enumerate()
        {
            let got = flat.double_value(&[idx.as_i64().expect("i")]);
            assert_eq!(
                got as f32, *want as f32,
                "{name} {hf} ({}) value #{i} at {idx}",
                e["type"]
            );
        }
        let f64t = flat.to_kind(Kind::Double);
        let sum = f64t.sum(Kind::Double).double_value(&[]);
        let sumsq = (&f64t * &f64t).sum(Kind::Double).double_value(&[]);
        let (ws, wq) = (
            e["sum"].as_f64().expect("sum"),
            e["sumsq"].as_f64().expect("sumsq"),
        );
        assert!(
            (sum - ws).abs() <= 1e-9 * (1.0 + wq),
            "{name} {hf}: sum {sum} vs {ws}"
        );
        assert!(
            (sumsq - wq).abs() <= 1e-9 * wq.max(1.0),
            "{name} {hf}: sumsq {sumsq} vs {wq}"
        );
        checked += 1;
    }
    checked
}

#[test]
fn tensors_match_transformers_smollm2() {
    assert!(check_tensors("smollm2-135m-instruct") >= 8);
}

#[test]
fn tensors_match_transformers_qwen25() {
    assert!(check_tensors("qwen2.5-coder-0.5b-instruct") >= 8);
}

#[test]
fn tensors_match_transformers_gemma3() {
    assert!(check_tensors("gemma-3-270m") >= 8);
}

/// Max-abs difference of our float32 logits from transformers' on the fixture's ids.
fn logits_max_abs(name: &str) -> f64 {
    let fx = fixture(&format!("{name}.logits.json"));
    let t0 = std::time::Instant::now();
    let mut model = kvcredit::model::gguf::load(&common::model_path(name)).expect("load");
    println!("{name}: model::gguf::load took {:.2?}", t0.elapsed());
    let ids: Vec<i64> = fx["token_ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_i64().expect("id"))
        .collect();
    // our tokenizer produces the same prompt ids
    let prompt = fx["prompt"].as_str().expect("prompt");
    let ours: Vec<i64> = model
        .tokenizer
        .encode(prompt, true)
        .expect("encode")
        .get_ids()
        .iter()
        .map(|&x| x as i64)
        .collect();
    assert_eq!(ours, ids, "{name}: prompt ids");
    let decoder = model
        .take_decoder(Kind::Float, Device::Cpu)
        .expect("decoder");
    let _g = tch::no_grad_guard();
    let logits = decoder
        .forward_full(&Tensor::from_slice(&ids).view([1, -1]), &ExecPolicy::Stock)
        .expect("forward");
    assert_eq!(
        logits.size(),
        vec![1, ids.len() as i64, fx["vocab_size"].as_i64().expect("v")]
    );
    let mut worst = 0f64;
    for (p, row) in fx["positions"]
        .as_array()
        .expect("positions")
        .iter()
        .enumerate()
    {
        let lp = logits.get(0).get(p as i64);
        assert_eq!(
            lp.argmax(0, false).int64_value(&[]),
            row["argmax"].as_i64().expect("argmax"),
            "{name} pos {p}"
        );
        for (id, want) in row["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .zip(row["logits"].as_array().expect("logits"))
        {
            let got = lp.double_value(&[id.as_i64().expect("id")]);
            worst = worst.max((got - want.as_f64().expect("logit")).abs());
        }
    }
    println!(
        "{name}: max |logit - transformers| = {worst:.3e} over {} positions",
        ids.len()
    );
    worst
}

#[test]
fn logits_match_transformers_smollm2() {
    let d = logits_max_abs(MODELS[0]);
    assert!(d < 1e-3, "max abs {d}");
}

#[test]
fn logits_match_transformers_qwen25() {
    let d = logits_max_abs(MODELS[1]);
    assert!(d < 1e-3, "max abs {d}");
}

#[test]
fn logits_match_transformers_gemma3() {
    let d = logits_max_abs(MODELS[2]);
    assert!(d < 1e-3, "max abs {d}");
}
