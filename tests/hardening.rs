//! Failing clearly where an overnight run would otherwise go wrong: requests past the model's
//! positions are refused up front (naming the limit), non-finite logits stop a campaign with
//! the problem, pass and step while finished shards stay, and a real allocation failure names
//! the batch size with a hint. Every failure is one line and a non-zero exit, never a panic.
mod common;

use kvcredit::credit::rollout::{self, RolloutParams};
use kvcredit::decode::engine::{self, Decoding, EngineMode, EngineOptions, Job, Start};
use kvcredit::runtime::{self, Dtype, ModelSource};
use kvcredit::sampling::{NoiseKey, Sampling};
use kvcredit::tasks::Task;
use kvcredit::tasks::gsm8k::{Gsm8k, PromptFormat};
use kvcredit::{Error, ExecPolicy, LogitsAt};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// The one stderr line of a failed command: non-zero exit, one line, no panic, every needle.
fn assert_clean_failure(code: i32, stderr: &str, needles: &[&str]) -> String {
    assert_ne!(code, 0, "expected a failure, stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one error line, got: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    for n in needles {
        assert!(stderr.contains(n), "`{n}` missing from: {stderr}");
    }
    lines[0].to_string()
}

fn fixture() -> String {
    common::hf_fixtures().join("llama").display().to_string()
}

// ---------------------------------------------------------------------------------------
// Context limits

#[test]
fn generate_past_the_context_is_refused_naming_the_limit() {
    let m = fixture();
    let (code, _, err) = common::kvcredit(&[
        "generate",
        "--model",
        &m,
        "--ids",
        "1,2,3",
        "--max-new-tokens",
        "100000",
    ]);
    assert_clean_failure(
        code,
        &err,
        &["context", "100003", "64", "--allow-extrapolation"],
    );
    // At the limit it runs; past it only when asked to.
    let (code, out, err) = common::kvcredit(&[
        "generate",
        "--model",
        &m,
        "--ids",
        "1,2,3",
        "--max-new-tokens",
        "61",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("61 new tokens"), "{out}");
    let (code, _, err) = common::kvcredit(&[
        "generate",
        "--model",
        &m,
        "--ids",
        "1,2,3",
        "--max-new-tokens",
        "62",
    ]);
    assert_clean_failure(code, &err, &["65 positions", "64"]);
    let (code, out, err) = common::kvcredit(&[
        "generate",
        "--model",
        &m,
        "--ids",
        "1,2,3",
        "--max-new-tokens",
        "70",
        "--no-cache",
        "--allow-extrapolation",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("70 new tokens"), "{out}");
}

#[test]
fn bench_and_invariance_past_the_context_are_refused() {
    let m = fixture();
    // invariance's default probes are 72 tokens long, past the fixture's 64 positions.
    let (code, _, err) = common::kvcredit(&["invariance", "--model", &m]);
    assert_clean_failure(code, &err, &["context", "invariance", "64"]);
    let (code, _, err) = common::kvcredit(&[
        "bench",
        "--model",
        &m,
        "--dtype",
        "fp32",
        "--prompt",
        "60",
        "--no-continuations",
    ]);
    assert_clean_failure(code, &err, &["context", "bench", "64"]);
}

#[test]
fn forwards_and_continuations_past_the_context_are_refused() {
    let mut d = common::load(&common::hf_fixtures().join("llama"), Kind::Float).unwrap();
    d.limit_context(true);
    let limit = d.config().max_position_embeddings;
    let mut cache = d.new_cache(1, 8).unwrap();
    let ids = Tensor::arange(limit as i64 - 4, (Kind::Int64, Device::Cpu)).view([1, -1]);
    let _ = d
        .forward(&ids, &mut cache, &ExecPolicy::Stock, &LogitsAt::Last)
        .unwrap();
    // Five more tokens would need limit + 1 positions.
    let five = Tensor::from_slice(&[1i64, 2, 3, 4, 5]).view([1, 5]);
    let e = d
        .forward(&five, &mut cache, &ExecPolicy::Stock, &LogitsAt::Last)
        .unwrap_err();
    assert!(matches!(e, Error::ContextLimit(_)), "{e}");
    assert!(e.to_string().contains(&format!("{}", limit + 1)), "{e}");
    // The continuation engine refuses before decoding, in every mode.
    let jobs = [Job {
        start: Start {
            cache: &cache,
            snap: cache.snapshot(0),
            expect: None,
        },
        first_token: 1,
        key: NoiseKey::rollout(0, 0),
    }];
    let decoding = Decoding {
        model: &d,
        policy: ExecPolicy::Stock,
        sampling: Sampling::Greedy,
        max_new_tokens: 10,
        stop_tokens: &[],
        text_stop: None,
    };
    for mode in [EngineMode::Eager, EngineMode::Static] {
        let e = engine::run_with(
            &decoding,
            &jobs,
            &[0],
            1,
            &EngineOptions::mode(mode),
            &mut |_| {},
        )
        .unwrap_err();
        assert!(matches!(e, Error::ContextLimit(_)), "{mode}: {e}");
    }
    // Allowed, the same forward runs.
    d.limit_context(false);
    let _ = d
        .forward(&five, &mut cache, &ExecPolicy::Stock, &LogitsAt::Last)
        .unwrap();
}

// ---------------------------------------------------------------------------------------
// A fixture model a campaign can run: char-level tokenizer and a chat template.

#[allow(clippy::too_many_arguments)]
fn write_spec(
    path: &Path,
    model: &Path,
    count: usize,
    rollout_tokens: usize,
    k: usize,
    cont_tokens: usize,
    batch: usize,
) -> PathBuf {
    std::fs::write(
        path,
        format!(
            r#"
name = "hardening"
model = "{}"
dtype = "fp32"
device = "cpu"
policy = "stock"
seed = 3

[problems]
start = 0
count = {count}
format = "zero-shot-chat"

[rollout]
max_new_tokens = {rollout_tokens}
temperature = 0.0

[pivots]
max_margin = 1.0
max_per_rollout = 2
alternatives = 1

[continuations]
k = {k}
max_new_tokens = {cont_tokens}
temperature = 0.0

[passes]
run = ["exact", "replica", "refeed"]
replica_schedule = "same"
batch_size = {batch}
"#,
            model.display()
        ),
    )
    .unwrap();
    path.to_path_buf()
}

fn campaign(spec: &Path, out: &Path, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec![
        "campaign",
        "run",
        spec.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--quiet",
    ];
    args.extend(extra);
    common::kvcredit(&args)
}

fn shards(out: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(out.join("shards"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn campaign_past_the_context_is_refused_before_anything_is_written() {
    let dir = common::scratch("hardening", "campaign-context");
    let model = common::chat_fixture(&dir.join("model"), 64);
    let spec = write_spec(&dir.join("spec.toml"), &model, 2, 16, 2, 8, 4);
    let out = dir.join("run");
    let (code, _, err) = campaign(&spec, &out, &[]);
    assert_clean_failure(
        code,
        &err,
        &[
            "context",
            "campaign `hardening`",
            "16 rollout.max_new_tokens",
            "64",
        ],
    );
    assert!(!out.exists(), "nothing may be written before the refusal");
}

// ---------------------------------------------------------------------------------------
// Non-finite logits

/// Token ids of problem `i`'s prompt and every id a finished run fed or produced for it.
fn used_ids(model: &runtime::LoadedModel, run: &Path, problem: u32) -> BTreeSet<i64> {
    use arrow_array::{Array, ListArray, UInt32Array};
    let task = Gsm8k::bundled(0..2, PromptFormat::ZeroShotChat).unwrap();
    let p = &task.problems()[problem as usize];
    let mut ids: BTreeSet<i64> = model
        .encode_prompt(&task.prompt(p))
        .unwrap()
        .into_iter()
        .collect();
    let shard = run.join("shards").join(format!("problem-{problem:05}"));
    for (table, cols) in [
        ("rollouts", &["tokens"][..]),
        ("pivots", &["token", "alt_token"][..]),
        ("continuations", &["tokens"][..]),
    ] {
        for b in
            kvcredit::io::parquet::read_batches(&shard.join(format!("{table}.parquet"))).unwrap()
        {
            let probs: UInt32Array = common::column(&b, "problem");
            assert!(probs.iter().all(|x| x == Some(problem)));
            for c in cols {
                let col = b.column(b.schema().index_of(c).unwrap());
                if let Some(l) = col.as_any().downcast_ref::<ListArray>() {
                    for row in l.iter().flatten() {
                        let v = row
                            .as_any()
                            .downcast_ref::<arrow_array::Int64Array>()
                            .unwrap();
                        ids.extend(v.values().iter());
                    }
                } else {
                    let v = col
                        .as_any()
                        .downcast_ref::<arrow_array::Int64Array>()
                        .unwrap();
                    ids.extend(v.values().iter());
                }
            }
        }
    }
    ids
}

/// Rewrite `dir/model.safetensors` with NaN in the embedding row of `token`.
fn plant_nan(dir: &Path, token: i64) {
    let path = dir.join("model.safetensors");
    let tensors: Vec<(String, Tensor)> = Tensor::read_safetensors(&path)
        .unwrap()
        .into_iter()
        .map(|(name, t)| {
            if name == "model.embed_tokens.weight" {
                let t = t.copy();
                let _ = t.get(token).fill_(f64::NAN);
                (name, t)
            } else {
                (name, t)
            }
        })
        .collect();
    Tensor::write_safetensors(&tensors, &path).unwrap();
}

#[test]
fn planted_nan_weights_stop_a_campaign_and_keep_finished_shards() {
    let dir = common::scratch("hardening", "nan");
    let model = common::chat_fixture(&dir.join("model"), 4096);
    let spec = write_spec(&dir.join("spec.toml"), &model, 2, 24, 2, 12, 4);
    let (code, _, err) = campaign(&spec, &dir.join("clean-run"), &[]);
    assert_eq!(code, 0, "clean campaign: {err}");
    let loaded =
        runtime::load(&ModelSource::HfDir(model.clone()), Dtype::Fp32, Device::Cpu).unwrap();
    let first = used_ids(&loaded, &dir.join("clean-run"), 0);
    let second = used_ids(&loaded, &dir.join("clean-run"), 1);
    // A token problem 0 never reads but problem 1 does: with its embedding NaN, problem 0
    // runs exactly as before and problem 1 meets non-finite logits.
    let token = *second
        .iter()
        .find(|t| !first.contains(t))
        .expect("a token only problem 1 uses");
    plant_nan(&model, token);
    let out = dir.join("nan-run");
    let (code, _, err) = campaign(&spec, &out, &[]);
    eprintln!("planted NaN in token {token}: {err}");
    let line = assert_clean_failure(code, &err, &["problem 1", "non-finite logits", "step"]);
    assert!(
        line.contains("rollout step") || line.contains("pass"),
        "names the rollout or the pass: {line}"
    );
    // Problem 0's shard is finished and byte-identical to the clean run's; nothing of
    // problem 1 is left behind.
    assert_eq!(shards(&out), vec!["problem-00000".to_string()]);
    for t in ["rollouts", "pivots", "continuations", "estimates"] {
        let f = format!("shards/problem-00000/{t}.parquet");
        assert!(
            std::fs::read(out.join(&f)).unwrap()
                == std::fs::read(dir.join("clean-run").join(&f)).unwrap(),
            "{f} differs from the clean run's"
        );
    }
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["problems_done"], 1);
    assert!(m["finished_at"].is_null());
}

/// Every engine of `modes` on `device` stops with [`Error::NonFinite`] naming the step when a
/// row's logits turn NaN; the same jobs on clean weights decode (the negative control).
fn non_finite_logits_are_caught(device: Device, modes: &[EngineMode], tag: &str) {
    let dir = common::scratch("hardening", tag);
    let clean = common::chat_fixture(&dir.join("clean"), 4096);
    let bad = common::chat_fixture(&dir.join("nan"), 4096);
    plant_nan(&bad, 7);
    let good = kvcredit::Decoder::load_hf_dir(&clean, Kind::Float, device).unwrap();
    let nan = kvcredit::Decoder::load_hf_dir(&bad, Kind::Float, device).unwrap();
    let roll = rollout::rollout(
        &good,
        &[1, 2, 3, 4, 5, 6],
        &RolloutParams {
            sampling: Sampling::Greedy,
            max_new_tokens: 6,
            key: NoiseKey::rollout(0, 0),
            stop_tokens: &[],
            special_tokens: &[],
            text_stop: None,
            policy: ExecPolicy::Stock,
            max_margin: 1.0,
            alternatives: 1,
        },
    )
    .unwrap();
    // Two rows: one feeds a clean token, one feeds the poisoned id 7.
    let jobs: Vec<Job> = [3i64, 7]
        .iter()
        .map(|&first_token| Job {
            start: Start {
                cache: &roll.cache,
                snap: roll.snapshot(3),
                expect: None,
            },
            first_token,
            key: NoiseKey::rollout(0, first_token as u64),
        })
        .collect();
    for &mode in modes {
        for dec in [&good, &nan] {
            let decoding = Decoding {
                model: dec,
                policy: ExecPolicy::Stock,
                sampling: Sampling::Greedy,
                max_new_tokens: 4,
                stop_tokens: &[],
                text_stop: None,
            };
            let r = engine::run_with(
                &decoding,
                &jobs,
                &[0, 1],
                2,
                &EngineOptions::mode(mode),
                &mut |_| {},
            );
            if std::ptr::eq(dec, &good) {
                // Negative control: the same jobs on clean weights decode.
                assert!(r.is_ok(), "{mode}: {:?}", r.err());
            } else {
                let e = r.expect_err("non-finite logits detected");
                assert!(matches!(e, Error::NonFinite(_)), "{mode}: {e}");
                assert!(e.to_string().contains("continuation step 0"), "{mode}: {e}");
            }
        }
    }
}

#[test]
fn non_finite_logits_are_caught_on_the_eager_and_static_engines() {
    non_finite_logits_are_caught(
        Device::Cpu,
        &[EngineMode::Eager, EngineMode::Static],
        "nan-engine",
    );
}

/// The CUDA engines, graph replay included. Runs where CUDA is present; elsewhere it says so
/// and passes.
#[test]
fn non_finite_logits_are_caught_on_every_cuda_engine() {
    if !tch::Cuda::is_available() {
        eprintln!("no CUDA device: the graph-engine NaN check runs on a GPU machine only");
        return;
    }
    non_finite_logits_are_caught(
        Device::Cuda(0),
        &[EngineMode::Eager, EngineMode::Static, EngineMode::Graph],
        "nan-engine-cuda",
    );
}

// ---------------------------------------------------------------------------------------
// Out of memory

#[test]
fn an_allocation_failure_names_the_batch_size_and_keeps_the_run_resumable() {
    // 1000 continuations of up to 100 000 tokens in one batch need a 13 GB KV buffer per
    // layer; under an 8 GiB address-space limit libtorch's CPU allocator really fails.
    let dir = common::scratch("hardening", "oom");
    let model = common::chat_fixture(&dir.join("model"), 200_000);
    let spec = write_spec(&dir.join("spec.toml"), &model, 1, 8, 250, 100_000, 1000);
    let out = dir.join("run");
    let cmd = format!(
        "ulimit -v {}; exec \"$0\" \"$@\"",
        8u64 << 20 // KiB
    );
    let o = std::process::Command::new("bash")
        .arg("-c")
        .arg(&cmd)
        .arg(env!("CARGO_BIN_EXE_kvcredit"))
        .args([
            "campaign",
            "run",
            spec.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--quiet",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    let line = assert_clean_failure(
        o.status.code().unwrap_or(-1),
        &err,
        &[
            "out of memory",
            "problem 0",
            "exact pass, batch size 1000",
            "passes.batch_size",
        ],
    );
    assert!(
        line.contains("allocate"),
        "the allocator's own message is kept: {line}"
    );
    // No partial shard; the manifest is intact for a resume with a smaller batch.
    assert!(shards(&out).is_empty(), "{:?}", shards(&out));
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["problems_done"], 0);
}
