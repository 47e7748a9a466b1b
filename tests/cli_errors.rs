//! Bad input gets one clear line on stderr and a non-zero exit, never a panic trace.
mod common;

use std::path::{Path, PathBuf};

/// Copy a fixture model into a scratch dir so it can be damaged.
fn copy_fixture(fixture: &str, name: &str) -> PathBuf {
    let src = common::hf_fixtures().join(fixture);
    let dst = common::scratch("cli", name);
    for entry in std::fs::read_dir(&src).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
    }
    dst
}

fn assert_clean_error(args: &[&str], needle: &str) {
    let (code, _, err) = common::kvcredit(args);
    assert_eq!(code, 2, "expected an error (exit 2) for {args:?}: {err}");
    assert!(!err.contains("panicked"), "panic for {args:?}: {err}");
    assert_eq!(err.trim().lines().count(), 1, "one line expected: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(err.contains(needle), "`{needle}` not in: {err}");
}

fn gen_args(dir: &Path) -> Vec<String> {
    vec![
        "generate".into(),
        "--model".into(),
        dir.display().to_string(),
        "--ids".into(),
        "1,2,3".into(),
    ]
}

fn run_gen(dir: &Path, needle: &str) {
    let args = gen_args(dir);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_clean_error(&args, needle);
}

#[test]
fn missing_model_directory_is_a_clear_error() {
    assert_clean_error(
        &["generate", "--model", "/nonexistent/model", "--ids", "1"],
        "/nonexistent/model",
    );
}

#[test]
fn unknown_architecture_is_a_clear_error() {
    let dir = copy_fixture("llama", "unknown-arch");
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        cfg.replace("LlamaForCausalLM", "GPTNeoXForCausalLM"),
    )
    .unwrap();
    run_gen(&dir, "unknown architecture `GPTNeoXForCausalLM`");
}

#[test]
fn bad_config_value_is_a_clear_error() {
    let dir = copy_fixture("llama", "bad-config");
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    v["hidden_size"] = serde_json::json!("wide");
    std::fs::write(dir.join("config.json"), v.to_string()).unwrap();
    run_gen(&dir, "hidden_size");
}

#[test]
fn truncated_safetensors_is_a_clear_error() {
    let dir = copy_fixture("llama", "truncated");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    run_gen(&dir, "truncated or corrupt");
}

#[test]
fn shape_mismatch_is_a_clear_error() {
    let dir = copy_fixture("llama", "shape");
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    let inter = v["intermediate_size"].as_u64().unwrap();
    v["intermediate_size"] = serde_json::json!(inter * 2);
    std::fs::write(dir.join("config.json"), v.to_string()).unwrap();
    run_gen(&dir, "has shape");
}

#[test]
fn missing_shard_is_a_clear_error() {
    let dir = copy_fixture("qwen2_sharded", "shard");
    let shard = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.to_string_lossy().contains("-of-0000"))
        .expect("a shard");
    std::fs::remove_file(&shard).unwrap();
    run_gen(&dir, "missing shard");
}

#[test]
fn out_of_vocabulary_ids_are_a_clear_error() {
    let dir = common::hf_fixtures().join("llama");
    assert_clean_error(
        &[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--ids",
            "1,999999",
        ],
        "token ids must lie in",
    );
}

#[test]
fn generate_runs_on_a_fixture_model() {
    let dir = common::hf_fixtures().join("llama");
    let (code, out, err) = common::kvcredit(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--ids",
        "1,2,3",
        "--max-new-tokens",
        "5",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("5 new tokens"), "{out}");
}
