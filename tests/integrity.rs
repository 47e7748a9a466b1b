//! Integrity end to end: a run's tables and shards verified by their recorded sha256 before
//! they are read, cached models verified against the registry, and the decode worker's
//! concurrency and deadlines.
mod common;

use std::path::{Path, PathBuf};

/// A copy, in `dir/run`, of a finished tiny CPU campaign (one problem of the shared tiny
/// spec) that is run once per test binary.
fn tiny_run(dir: &Path) -> PathBuf {
    static RUN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let src = RUN.get_or_init(|| {
        let dir = common::scratch("integrity", "tiny");
        let spec = dir.join("spec.toml");
        std::fs::write(&spec, common::tiny_campaign_spec("integrity", 1)).unwrap();
        let out = dir.join("run");
        let (code, _, err) = common::kvcredit(&[
            "campaign",
            "run",
            spec.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--quiet",
        ]);
        assert_eq!(code, 0, "{err}");
        out
    });
    let out = dir.join("run");
    copy_dir(src, &out);
    out
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap().flatten() {
        let to = dst.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to);
        } else {
            std::fs::copy(e.path(), &to).unwrap();
        }
    }
}

fn manifest(out: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap()
}

/// `count` offsets spread over a file of `len` bytes, first and last byte included.
fn offsets(len: usize, count: usize) -> Vec<usize> {
    (0..count).map(|i| i * (len - 1) / (count - 1)).collect()
}

#[test]
fn a_flipped_byte_in_any_table_fails_check_and_analyze() {
    let dir = common::scratch("integrity", "flip");
    let out = tiny_run(&dir);
    let run = out.to_str().unwrap();
    // The manifest records each table's own sha256.
    let m = manifest(&out);
    for t in ["rollouts", "pivots", "continuations", "estimates"] {
        let file = format!("{t}.parquet");
        let want = kvcredit::io::integrity::sha256_file(&out.join(&file)).unwrap();
        assert_eq!(m["files_sha256"][&file], want.as_str(), "{file}");
    }
    // Negative control: the untouched run passes.
    let (code, stdout, err) = common::kvcredit(&["check", run]);
    assert_eq!(code, 0, "{stdout}{err}");
    // 12 offsets in each of two tables, header and footer included: none passes.
    let mut passed = Vec::new();
    let mut tried = 0;
    for file in ["estimates.parquet", "continuations.parquet"] {
        let path = out.join(file);
        let clean = std::fs::read(&path).unwrap();
        for at in offsets(clean.len(), 12) {
            let mut bytes = clean.clone();
            bytes[at] ^= 0x01;
            std::fs::write(&path, &bytes).unwrap();
            tried += 1;
            let (code, stdout, err) = common::kvcredit(&["check", run]);
            if code != 1 {
                passed.push(format!("{file}@{at}: exit {code}"));
            } else {
                let line = stdout.lines().next().unwrap_or("");
                assert!(
                    line.starts_with("integrity: ") && line.contains(file),
                    "{file}@{at}: {stdout}"
                );
                assert_eq!(err.lines().count(), 1, "{err}");
            }
        }
        std::fs::write(&path, &clean).unwrap();
    }
    assert_eq!(tried, 24);
    assert!(passed.is_empty(), "{} of 24 passed: {passed:?}", passed.len());
    // analyze refuses the same damage before reading, naming the file.
    let path = out.join("continuations.parquet");
    let clean = std::fs::read(&path).unwrap();
    let mut bytes = clean.clone();
    bytes[clean.len() / 2] ^= 0x80;
    std::fs::write(&path, &bytes).unwrap();
    let report = dir.join("report");
    let (code, _, err) = common::kvcredit(&[
        "analyze",
        run,
        "--out",
        report.to_str().unwrap(),
        "--reps",
        "10",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("integrity: ") && err.contains("continuations.parquet"),
        "{err}"
    );
    assert!(!report.join("summary.parquet").exists());
    std::fs::write(&path, &clean).unwrap();
    let (code, _, err) = common::kvcredit(&[
        "analyze",
        run,
        "--out",
        report.to_str().unwrap(),
        "--reps",
        "10",
    ]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn shards_carry_their_hashes_and_merge_verifies_them() {
    let dir = common::scratch("integrity", "shards");
    let out = tiny_run(&dir);
    let shard = out.join("shards").join("problem-00000");
    let hashes: std::collections::BTreeMap<String, String> = serde_json::from_str(
        &std::fs::read_to_string(shard.join(kvcredit::io::integrity::SHARD_HASHES)).unwrap(),
    )
    .unwrap();
    assert_eq!(hashes.len(), 4, "{hashes:?}");
    // Negative control: the clean run merges.
    let merged = dir.join("merged");
    let (code, _, err) = common::kvcredit(&[
        "campaign",
        "merge",
        out.to_str().unwrap(),
        "--out",
        merged.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    // One flipped byte in a shard's table: merge refuses before reading it, naming it.
    let table = shard.join("estimates.parquet");
    let mut bytes = std::fs::read(&table).unwrap();
    let at = bytes.len() / 3;
    bytes[at] ^= 0x10;
    std::fs::write(&table, &bytes).unwrap();
    let again = dir.join("merged-again");
    let (code, _, err) = common::kvcredit(&[
        "campaign",
        "merge",
        out.to_str().unwrap(),
        "--out",
        again.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("integrity: ") && err.contains("problem-00000/estimates.parquet"),
        "{err}"
    );
    assert!(!again.join("estimates.parquet").exists());
}

/// A temporary cache root holding a copy of the registry's smallest model, with one byte
/// flipped when `flip` (the shared cache is never touched).
fn model_home(name: &str, flip: bool) -> PathBuf {
    let src = common::model_path("smollm2-135m-instruct");
    let home = common::scratch("integrity", name);
    let dir = home.join("models").join("smollm2-135m-instruct");
    std::fs::create_dir_all(&dir).unwrap();
    let dst = dir.join("smollm2-135m-instruct.gguf");
    let mut bytes = std::fs::read(src).unwrap();
    if flip {
        // A byte of the last tensor's data: the file still parses and loads.
        let at = bytes.len() - 1000;
        bytes[at] ^= 0x01;
    }
    std::fs::write(&dst, bytes).unwrap();
    home
}

#[test]
fn a_corrupted_cached_model_is_refused_by_name() {
    let home = model_home("model-flip", true);
    let env = [("KVCREDIT_HOME", home.to_str().unwrap())];
    let (code, _, err) = common::kvcredit_env(
        &[
            "generate",
            "--model",
            "smollm2-135m-instruct",
            "--ids",
            "1,2,3",
            "--max-new-tokens",
            "2",
        ],
        &env,
    );
    assert_eq!(code, 2, "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("model `smollm2-135m-instruct`")
            && err.contains("kvcredit models pull smollm2-135m-instruct --force"),
        "{err}"
    );
    let (code, stdout, err) =
        common::kvcredit_env(&["models", "verify", "smollm2-135m-instruct"], &env);
    assert_eq!(code, 2, "{stdout}{err}");
    assert!(
        stdout.contains("sha256 mismatch") && stdout.contains("--force"),
        "{stdout}"
    );
    // Every pulled model when no name is given: the same verdict.
    let (code, stdout, _) = common::kvcredit_env(&["models", "verify"], &env);
    assert_eq!(code, 2);
    assert!(stdout.starts_with("smollm2-135m-instruct: "), "{stdout}");
}

#[test]
fn an_intact_cached_model_verifies_and_loads() {
    let home = model_home("model-ok", false);
    let env = [("KVCREDIT_HOME", home.to_str().unwrap())];
    let (code, stdout, err) =
        common::kvcredit_env(&["models", "verify", "smollm2-135m-instruct"], &env);
    assert_eq!(code, 0, "{err}");
    let want = kvcredit::registry::find("smollm2-135m-instruct")
        .unwrap()
        .sha256
        .clone();
    assert!(
        stdout.starts_with(&format!("smollm2-135m-instruct: ok sha256 {want}")),
        "{stdout}"
    );
    // The digest was cached beside the models (so a load does not hash again).
    let cached = std::fs::read_dir(home.join("models").join(".sha256"))
        .unwrap()
        .count();
    assert_eq!(cached, 1);
    let (code, _, err) = common::kvcredit_env(
        &[
            "generate",
            "--model",
            "smollm2-135m-instruct",
            "--ids",
            "1,2,3",
            "--max-new-tokens",
            "2",
        ],
        &env,
    );
    assert_eq!(code, 0, "{err}");
}

#[test]
fn the_recorded_model_hash_is_the_files_own() {
    // A GGUF given by path (no registry entry to compare with): the loaded model carries the
    // file's own digest, so a changed file records a changed hash.
    let home = model_home("model-path", true);
    let path = home
        .join("models")
        .join("smollm2-135m-instruct")
        .join("smollm2-135m-instruct.gguf");
    let m = kvcredit::runtime::load(
        &kvcredit::runtime::ModelSource::Gguf {
            path: path.clone(),
            name: None,
        },
        kvcredit::runtime::Dtype::Fp32,
        tch::Device::Cpu,
    )
    .unwrap();
    let own = kvcredit::io::integrity::sha256_file(&path).unwrap();
    assert_eq!(m.sha256.as_deref(), Some(own.as_str()));
    let registry = &kvcredit::registry::find("smollm2-135m-instruct")
        .unwrap()
        .sha256;
    assert_ne!(&own, registry);
}
