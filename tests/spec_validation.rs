//! A campaign spec is validated completely before anything is written: every bad value gets a
//! one-line error naming the setting, exit code 2, and no run folder, so the corrected spec can
//! run into the same `--out`.
mod common;

use std::path::Path;

/// A valid spec (the ci-smoke settings on SmolLM2) with one `from` → `to` substitution.
fn spec_with(from: &str, to: &str) -> String {
    let base = r#"name = "bad"
model = "smollm2-135m-instruct"
dtype = "fp32"
seed = 7

[problems]
start = 0
count = 2
format = "zero-shot-chat"

[rollout]
max_new_tokens = 16

[pivots]
max_margin = 0.5
max_per_rollout = 2

[continuations]
k = 2
max_new_tokens = 8
temperature = 1.0

[passes]
run = ["exact", "replica", "refeed"]
replica_schedule = "shuffled"
batch_size = 8
replica_batch_size = 3
"#;
    assert!(base.contains(from), "`{from}` not in the base spec");
    base.replacen(from, to, 1)
}

fn assert_refused(dir: &Path, case: &str, text: &str, needle: &str) {
    let spec = dir.join(format!("{case}.toml"));
    std::fs::write(&spec, text).unwrap();
    let out = dir.join(format!("run-{case}"));
    let (code, _, err) = common::kvcredit(&[
        "campaign",
        "run",
        spec.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code, 2, "{case}: expected exit 2: {err}");
    assert_eq!(
        err.trim().lines().count(),
        1,
        "{case}: one line expected: {err}"
    );
    assert!(!err.contains("panicked"), "{case}: {err}");
    assert!(err.contains(needle), "{case}: `{needle}` not in: {err}");
    assert!(
        !out.exists(),
        "{case}: the run folder was written before the spec failed"
    );
}

#[test]
fn bad_specs_are_refused_before_anything_is_written() {
    let dir = common::scratch("spec", "refused");
    let cases = [
        (
            "format",
            spec_with("zero-shot-chat", "five-shot"),
            "problems.format",
        ),
        (
            "count",
            spec_with("count = 2", "count = 5000"),
            "1319 GSM8K test problems",
        ),
        ("start", spec_with("start = 0", "start = 1318"), "exceeds"),
        (
            "p0",
            spec_with("max_per_rollout = 2", "max_per_rollout = 0"),
            "max_per_rollout",
        ),
        (
            "dup",
            spec_with(
                r#""exact", "replica", "refeed""#,
                r#""exact", "refeed", "refeed""#,
            ),
            "twice",
        ),
        (
            "schedule-no-replica",
            spec_with(r#""exact", "replica", "refeed""#, r#""exact", "refeed""#),
            "passes.replica_schedule",
        ),
        ("k0", spec_with("k = 2", "k = 0"), "continuations.k"),
        (
            "tokens0",
            spec_with("max_new_tokens = 16", "max_new_tokens = 0"),
            "max_new_tokens",
        ),
        (
            "unknown-key",
            spec_with("seed = 7", "seed = 7\nsed = 8"),
            "sed",
        ),
    ];
    for (case, text, needle) in &cases {
        assert_refused(&dir, case, text, needle);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_spec_without_replica_needs_no_replica_keys() {
    let text = spec_with(r#""exact", "replica", "refeed""#, r#""exact", "refeed""#)
        .replace("replica_schedule = \"shuffled\"\n", "")
        .replace("replica_batch_size = 3\n", "");
    let dir = common::scratch("spec", "no-replica");
    let path = dir.join("spec.toml");
    std::fs::write(&path, text).unwrap();
    kvcredit::credit::CampaignSpec::load(&path).expect("a two-pass spec is valid");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_missing_spec_file_is_an_error_not_a_violation() {
    let (code, _, err) = common::kvcredit(&["campaign", "run", "/nonexistent/spec.toml"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.starts_with("error: io: /nonexistent/spec.toml"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// The replica's key padding: a multiple of 8 (0 included) keeps exact's aligned key axis and is
/// refused under the shuffled schedule; under `same` only 0 is allowed, and the
/// replica-schedule treatments need the shuffled schedule.
#[test]
fn replica_key_padding_that_cannot_move_the_numerics_is_refused() {
    let dir = common::scratch("spec", "key-pad");
    let shuffled = "replica_batch_size = 3\n";
    for pad in [0, 8, 64] {
        assert_refused(
            &dir,
            &format!("pad{pad}"),
            &spec_with(
                shuffled,
                &format!("replica_batch_size = 3\nreplica_key_pad = {pad}\n"),
            ),
            "not a multiple of 8",
        );
    }
    assert_refused(
        &dir,
        "same-pad",
        &spec_with(
            "replica_schedule = \"shuffled\"\nbatch_size = 8\nreplica_batch_size = 3\n",
            "replica_schedule = \"same\"\nbatch_size = 8\nreplica_key_pad = 3\n",
        ),
        "must be 0 with replica_schedule",
    );
    assert_refused(
        &dir,
        "same-twin",
        &spec_with(
            "run = [\"exact\", \"replica\", \"refeed\"]\nreplica_schedule = \"shuffled\"\nbatch_size = 8\nreplica_batch_size = 3\n",
            "run = [\"exact\", \"replica\", \"refeed\", \"refeed_replica\"]\nreplica_schedule = \"same\"\nbatch_size = 8\n",
        ),
        "need replica_schedule = \"shuffled\"",
    );
    // the accepted settings validate
    for ok in [
        spec_with(shuffled, "replica_batch_size = 3\nreplica_key_pad = 3\n"),
        spec_with(
            "run = [\"exact\", \"replica\", \"refeed\"]",
            "run = [\"exact\", \"replica\", \"refeed\", \"refeed_replica\"]",
        ),
    ] {
        let p = dir.join("ok.toml");
        std::fs::write(&p, ok).unwrap();
        let (code, out, err) = common::kvcredit(&["campaign", "validate", p.to_str().unwrap()]);
        assert_eq!(code, 0, "{out}{err}");
    }
}
