//! Parity with Hugging Face transformers on tiny random-weight models of every supported
//! architecture and RoPE scaling (fixtures from `tests/gen_fixtures.py`), in fp32 on the CPU.
mod common;

use common::*;
use kvcredit::config::{ArchConfig, LayerKind};
use kvcredit::generate::{GenerateOptions, generate};
use kvcredit::sampling::Sampling;
use kvcredit::{ExecPolicy, LogitsAt, Result};
use tch::{Kind, Tensor};

#[test]
fn config_derived_values_match_transformers() -> Result<()> {
    for dir in fixture_dirs() {
        let cfg = ArchConfig::from_hf_file(&dir.join("config.json"))?;
        let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
        let exp: serde_json::Value = serde_json::from_str(&text).unwrap();
        let n = name(&dir);
        assert_eq!(
            cfg.num_layers() as u64,
            exp["num_layers"].as_u64().unwrap(),
            "{n}"
        );
        assert_eq!(
            cfg.head_dim as u64,
            exp["head_dim"].as_u64().unwrap(),
            "{n}"
        );
        let scale = exp["softmax_scale"].as_f64().unwrap();
        assert!(
            (cfg.softmax_scale - scale).abs() < 1e-12,
            "{n}: {} vs {scale}",
            cfg.softmax_scale
        );
        let windows: Vec<Option<u64>> = cfg
            .layer_types
            .iter()
            .map(|k| match k {
                LayerKind::Full => None,
                LayerKind::Sliding { window } => Some(*window as u64),
            })
            .collect();
        let exp_windows: Vec<Option<u64>> = exp["layer_windows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w.as_u64())
            .collect();
        assert_eq!(windows, exp_windows, "{n}");
        assert_eq!(
            cfg.tie_word_embeddings,
            exp["tie_word_embeddings"].as_bool().unwrap(),
            "{n}"
        );
        assert_eq!(cfg.rope.theta, exp["rope_theta"].as_f64().unwrap(), "{n}");
    }
    Ok(())
}

#[test]
fn teacher_forced_logits_match_transformers_fp32() -> Result<()> {
    for dir in fixture_dirs() {
        let model = load(&dir, Kind::Float)?;
        let r = reference(&dir);
        let logits = model.forward_full(&r["input_ids"], &ExecPolicy::Stock)?;
        let diff = max_abs(&logits, &r["logits"]);
        println!(
            "{:>22}: max |Δlogit| vs transformers = {diff:.3e}",
            name(&dir)
        );
        assert!(diff <= 1e-4, "{}: max abs diff {diff}", name(&dir));
    }
    Ok(())
}

#[test]
fn greedy_tokens_with_cache_match_transformers_generate() -> Result<()> {
    for dir in fixture_dirs() {
        let model = load(&dir, Kind::Float)?;
        let r = reference(&dir);
        let prompt = ids(&r["prompt_ids"]);
        let expected = ids(&r["generated_ids"]);
        let opts = GenerateOptions {
            max_new_tokens: expected.len() - prompt.len(),
            sampling: Sampling::Greedy,
            seed: 0,
            stop_tokens: vec![],
            policy: ExecPolicy::Stock,
        };
        let out = generate(&model, &prompt, &opts)?;
        assert_eq!(out.tokens, expected[prompt.len()..], "{}", name(&dir));
    }
    Ok(())
}

#[test]
fn greedy_tokens_without_cache_match_transformers_generate() -> Result<()> {
    // One uncached forward over the generated sequence: the argmax at each generated step is
    // the token transformers' cached `generate` chose, and the logits are its step logits.
    println!("| fixture | tokens with cache | tokens without cache | max |Δlogit| |");
    println!("| --- | --- | --- | --- |");
    for dir in fixture_dirs() {
        let model = load(&dir, Kind::Float)?;
        let r = reference(&dir);
        let (prompt, seq) = (ids(&r["prompt_ids"]), ids(&r["generated_ids"]));
        let p = prompt.len();
        let input = Tensor::from_slice(&seq[..seq.len() - 1]).view([1, -1]);
        let logits = model.forward_full(&input, &ExecPolicy::Stock)?;
        let steps = logits.narrow(1, p as i64 - 1, (seq.len() - p) as i64);
        let uncached = ids(&steps.argmax(-1, false));
        let opts = GenerateOptions {
            max_new_tokens: seq.len() - p,
            sampling: Sampling::Greedy,
            seed: 0,
            stop_tokens: vec![],
            policy: ExecPolicy::Stock,
        };
        let cached = generate(&model, &prompt, &opts)?.tokens;
        let tf = model.forward_full(&r["input_ids"], &ExecPolicy::Stock)?;
        let same = |t: &[i64]| {
            let n = t.iter().zip(&seq[p..]).filter(|(a, b)| a == b).count();
            format!("{n}/{}", seq.len() - p)
        };
        println!(
            "| `{}` | {} | {} | {:.1e} (teacher-forced), {:.1e} (generate steps) |",
            name(&dir),
            same(&cached),
            same(&uncached),
            max_abs(&tf, &r["logits"]),
            max_abs(&steps, &r["generated_logits"])
        );
        assert_eq!(uncached, seq[p..], "{}", name(&dir));
        let diff = max_abs(&steps, &r["generated_logits"]);
        assert!(diff <= 1e-4, "{}: step logits differ by {diff}", name(&dir));
    }
    Ok(())
}

#[test]
fn longrope_context_ends_at_the_original_length() -> Result<()> {
    // transformers re-encodes a LongRoPE sequence with the long factors once it is longer than
    // the original length; the decoder refuses to go there unless told to extrapolate.
    let mut model = load(&hf_fixtures().join("phi3_longrope"), Kind::Float)?;
    model.limit_context(true);
    assert_eq!(model.context_limit(), Some(32));
    let ids = |n: i64| Tensor::arange(n, (Kind::Int64, tch::Device::Cpu)).view([1, -1]);
    let _ = model.forward_full(&ids(32), &ExecPolicy::Stock)?;
    let err = model
        .forward_full(&ids(33), &ExecPolicy::Stock)
        .unwrap_err()
        .to_string();
    assert!(err.contains("33 positions") && err.contains("32"), "{err}");
    // YaRN and dynamic NTK stretch the context past max_position_embeddings.
    let yarn = load(&hf_fixtures().join("qwen2_yarn"), Kind::Float)?;
    assert_eq!(yarn.config().context_length(), 8192);
    let dynamic = load(&hf_fixtures().join("llama_dynamic"), Kind::Float)?;
    assert_eq!(dynamic.config().context_length(), 32);
    Ok(())
}

/// Logits of each position computed one decode step at a time against the cache.
fn decode_logits(model: &kvcredit::Decoder, seq: &[i64], prompt_len: usize) -> Result<Tensor> {
    let mut cache = model.new_cache(1, seq.len() as i64)?;
    let prompt = Tensor::from_slice(&seq[..prompt_len]).view([1, -1]);
    let mut rows = vec![model.forward(&prompt, &mut cache, &ExecPolicy::Stock, &LogitsAt::All)?];
    for &tok in &seq[prompt_len..] {
        let ids = Tensor::from_slice(&[tok]).view([1, 1]);
        rows.push(model.forward(&ids, &mut cache, &ExecPolicy::Stock, &LogitsAt::All)?);
    }
    Ok(Tensor::cat(&rows, 1))
}

#[test]
fn prefill_equals_decode_within_1e5_in_fp32_and_reports_fp16() -> Result<()> {
    let mut failures = Vec::new();
    for dir in fixture_dirs() {
        let r = reference(&dir);
        let seq = ids(&r["input_ids"]);
        // The Gemma fixtures scale their final norm by ~62× (gemma2) and ~19× (gemma3) to get
        // usable logits from tied 0.02-std embeddings; that amplifies ulp-level differences,
        // and transformers' own fp32 cached-vs-uncached logits differ by 3.0e-5 and 1.2e-5 on
        // them (tests/fixtures/hf/README.md). On a 2-core x86 machine (2026-12-01) gemma2 gave
        // 6.7e-5 at max |logit| 25.3, about 35 fp32 ulps there, at this commit and at the one
        // before, whatever the thread count: libtorch picks its CPU kernels per machine. 1e-4
        // bounds that; everything else is held to 1e-5.
        let fp32_tol = if name(&dir).starts_with("gemma") {
            1e-4
        } else {
            1e-5
        };
        for (kind, tol) in [(Kind::Float, Some(fp32_tol)), (Kind::Half, None)] {
            let model = load(&dir, kind)?;
            let prefill =
                model.forward_full(&Tensor::from_slice(&seq).view([1, -1]), &ExecPolicy::Stock)?;
            let decode = decode_logits(&model, &seq, 4)?;
            let diff = max_abs(&prefill, &decode);
            let scale = prefill.abs().max().double_value(&[]);
            println!(
                "{:>22} {kind:?}: max |prefill − decode| = {diff:.3e} (max |logit| {scale:.1})",
                name(&dir)
            );
            if tol.is_some_and(|tol| diff > tol) {
                failures.push(format!("{} {kind:?}: {diff:.3e}", name(&dir)));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "prefill and decode differ beyond tolerance: {failures:?}"
    );
    Ok(())
}

#[test]
fn prefill_equals_decode_to_1e12_in_fp64() -> Result<()> {
    // In double precision the cache path and the full forward agree to rounding, which shows
    // the fp32 differences above are accumulation order, not a bug in the cache path.
    for dir in fixture_dirs() {
        let seq = ids(&reference(&dir)["input_ids"]);
        let model = load(&dir, Kind::Double)?;
        let prefill =
            model.forward_full(&Tensor::from_slice(&seq).view([1, -1]), &ExecPolicy::Stock)?;
        let diff = max_abs(&prefill, &decode_logits(&model, &seq, 4)?);
        println!(
            "{:>22} f64: max |prefill − decode| = {diff:.3e}",
            name(&dir)
        );
        assert!(diff <= 1e-12, "{}: {diff}", name(&dir));
    }
    Ok(())
}

#[test]
fn ragged_batch_matches_single_sequences_fp32() -> Result<()> {
    // Rows of different lengths in one batch (right-padded prefill, then batched decode) give
    // the same logits as each row alone.
    let dir = fixture_dirs()
        .into_iter()
        .find(|d| name(d) == "qwen2")
        .unwrap_or_else(|| fixture_dirs()[0].clone());
    let model = load(&dir, Kind::Float)?;
    let seq = ids(&reference(&dir)["input_ids"]);
    let (a, b) = (&seq[..10], &seq[3..20]);
    let alone =
        |s: &[i64]| model.forward_full(&Tensor::from_slice(s).view([1, -1]), &ExecPolicy::Stock);
    let (la, lb) = (alone(a)?, alone(b)?);
    let mut padded = a.to_vec();
    padded.resize(b.len(), 0);
    let batch = Tensor::stack(&[Tensor::from_slice(&padded), Tensor::from_slice(b)], 0);
    let mut cache = model.new_cache(2, 32)?;
    let out = model.forward(&batch, &mut cache, &ExecPolicy::Stock, &LogitsAt::All)?;
    cache.truncate(&[a.len() as i64, b.len() as i64])?;
    assert!(max_abs(&out.get(0).narrow(0, 0, a.len() as i64), &la.get(0)) <= 1e-5);
    assert!(max_abs(&out.get(1), &lb.get(0)) <= 1e-5);
    // One decode step for both rows at different positions.
    let next = Tensor::from_slice(&[seq[10], seq[20]]).view([2, 1]);
    let step = model.forward(&next, &mut cache, &ExecPolicy::Stock, &LogitsAt::All)?;
    let la2 = alone(&seq[..11])?;
    let lb2 = alone(&seq[3..21])?;
    assert!(max_abs(&step.get(0).get(0), &la2.get(0).get(10)) <= 1e-5);
    assert!(max_abs(&step.get(1).get(0), &lb2.get(0).get(17)) <= 1e-5);
    Ok(())
}
