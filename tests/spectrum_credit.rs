//! The spectrum credit pass (system A × system C) on a real model (SmolLM2-135M-Instruct in
//! bf16, CPU): continuations resumed from the decode-time snapshot after SpectrumKV
//! compression.
//!
//! - Positive control: with every token in the FP16 tier (`uniform-fp16`; a bf16 cache's FP16
//!   tier is the cache itself, bitwise) the pass equals exact, token for token.
//! - At b = 1.0 under the greedy policy the frame's header, index lists and trailer do not fit
//!   beside every token at FP16, so a few tokens per snapshot go to INT8 (b is bytes on the
//!   wire ÷ the full-FP16 KV, design.md): the manifest records it and the real b stays within
//!   the budget. So b = 1.0 is not the all-FP16 control; `uniform-fp16` is.
//! - Negative control: at b = 0.3 the continuations differ from exact somewhere, and `kvcredit
//!   analyze` reports the pass against the replica floor like refeed (`summary-spectrum.parquet`,
//!   report sections), `kvcredit check` passes.
//! - Bad settings are refused with one line before anything is written.
mod common;

use kvcredit::analysis::read::{ContinuationRow, Pass, read_continuations, read_manifest};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const MODEL: &str = "smollm2-135m-instruct";

fn spec_text(name: &str, passes: &str, spectrum: &str) -> String {
    spec_n(name, 1, passes, spectrum)
}

fn spec_n(name: &str, problems: usize, passes: &str, spectrum: &str) -> String {
    format!(
        r#"
name = "{name}"
model = "{MODEL}"
dtype = "bf16"
device = "cpu"
policy = "stock"
seed = 11

[problems]
start = 0
count = {problems}
format = "zero-shot-chat"

[rollout]
max_new_tokens = 32
temperature = 0.0

[pivots]
max_margin = 0.6
max_per_rollout = 2
alternatives = 1

[continuations]
k = 2
max_new_tokens = 12
temperature = 1.0

[passes]
run = [{passes}]
batch_size = 4
{spectrum}
"#
    )
}

fn run(dir: &Path, name: &str, text: &str) -> PathBuf {
    let spec = dir.join(format!("{name}.toml"));
    std::fs::write(&spec, text).unwrap();
    let out = dir.join(name);
    let (code, _, err) = common::kvcredit(&[
        "campaign",
        "run",
        spec.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code, 0, "{name}: {err}");
    out
}

type ContKey = (u32, u32, u32, String, u32);

fn by_pass(dir: &Path) -> BTreeMap<Pass, BTreeMap<ContKey, ContinuationRow>> {
    let mut m: BTreeMap<Pass, BTreeMap<ContKey, ContinuationRow>> = BTreeMap::new();
    for c in read_continuations(dir).unwrap() {
        let k = (
            c.problem,
            c.pivot_pos,
            c.alt_rank,
            c.branch.clone(),
            c.sample,
        );
        m.entry(c.pass).or_default().insert(k, c);
    }
    m
}

fn check_ok(dir: &Path) {
    let (code, out, err) = common::kvcredit(&["check", dir.to_str().unwrap()]);
    assert_eq!(code, 0, "check: {out}{err}");
}

#[test]
fn all_fp16_tiers_resume_exactly_and_a_low_budget_does_not() {
    let dir = common::scratch("spectrum-credit", "controls");

    // Positive control: every token FP16 → bitwise the exact pass.
    let fp16 = run(
        &dir,
        "fp16",
        &spec_n(
            "sc-fp16",
            1,
            r#""exact", "spectrum""#,
            "[passes.spectrum]\npolicy = \"uniform-fp16\"",
        ),
    );
    check_ok(&fp16);
    let m = by_pass(&fp16);
    let (exact, spectrum) = (&m[&Pass::Exact], &m[&Pass::Spectrum]);
    assert!(!exact.is_empty(), "no continuations: no pivots?");
    assert_eq!(exact.len(), spectrum.len());
    for (k, e) in exact {
        let s = &spectrum[k];
        assert_eq!(
            e.tokens, s.tokens,
            "{k:?}: all-FP16 resume differs from exact"
        );
        assert_eq!(s.snapshot_verified, Some(false), "{k:?}");
    }
    let man = read_manifest(&fp16).unwrap();
    let st = man.spectrum.expect("manifest records the spectrum frames");
    assert!(st.snapshots > 0 && st.tokens_fp16 == st.tokens, "{st:?}");
    assert!(st.real_b().unwrap() > 1.0, "{st:?}");

    // (b = 1.0 under the greedy policy is not all-FP16: every byte of the frame counts, so a few
    // tokens per snapshot go to INT8; tests/spectrum.rs checks that accounting without a model.)

    // Negative control: b = 0.3 changes continuations; analyzed like refeed. (16 recent tokens
    // protected, not 32: 36 FP16 tokens do not fit 0.3 of a pivot right after the 74-token
    // prompt, which the spec check refuses.)
    let low = run(
        &dir,
        "low",
        &spec_n(
            "sc-low",
            1,
            r#""exact", "replica", "spectrum""#,
            "replica_schedule = \"same\"\n[passes.spectrum]\nb = 0.3\npolicy = \"spectrum\"\n\
             [passes.spectrum.protect]\nrecent = 16",
        ),
    );
    check_ok(&low);
    let st = read_manifest(&low).unwrap().spectrum.unwrap();
    assert!(st.real_b_max <= 0.3 && st.tokens_fp16 < st.tokens, "{st:?}");
    let m = by_pass(&low);
    let differ = m[&Pass::Exact]
        .iter()
        .filter(|(k, e)| m[&Pass::Spectrum][*k].tokens != e.tokens)
        .count();
    assert!(
        differ > 0,
        "b = 0.3: every continuation equals exact's; the compression did nothing"
    );
    let (code, out, err) = common::kvcredit(&["analyze", low.to_str().unwrap(), "--reps", "50"]);
    assert_eq!(code, 0, "analyze: {out}{err}");
    assert!(low.join("summary-spectrum.parquet").is_file());
    assert!(
        !low.join("summary.parquet").exists(),
        "no refeed, no refeed table"
    );
    let report = std::fs::read_to_string(low.join("report.md")).unwrap();
    for needle in [
        "SpectrumKV-resume disagreement above the replica floor",
        "exact≠spectrum",
        "Jaccard(exact, spectrum)",
        "Spectrum pass: what was sent",
        "spectrum/kivi/0.3",
        "disagreement-spectrum.png",
    ] {
        assert!(report.contains(needle), "`{needle}` not in report.md");
    }
    assert!(low.join("disagreement-spectrum.png").is_file());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_spectrum_settings_are_refused_before_anything_is_written() {
    let dir = common::scratch("spectrum-credit", "refused");
    let passes = r#""exact", "replica", "spectrum""#;
    let cases = [
        (
            "b-zero",
            spec_text("bad", passes, "[passes.spectrum]\nb = 0.0"),
            "outside (0, 1]",
        ),
        (
            "b-above-one",
            spec_text("bad", passes, "[passes.spectrum]\nb = 1.5"),
            "outside (0, 1]",
        ),
        (
            "policy",
            spec_text(
                "bad",
                passes,
                "[passes.spectrum]\nb = 0.5\npolicy = \"tiered\"",
            ),
            "unknown policy `tiered`",
        ),
        (
            "no-b",
            spec_text("bad", passes, "[passes.spectrum]\npolicy = \"pdtrim\""),
            "passes.spectrum.b is required",
        ),
        (
            "b-unused",
            spec_text(
                "bad",
                passes,
                "[passes.spectrum]\nb = 0.5\npolicy = \"uniform-int8\"",
            ),
            "ignores the budget",
        ),
        (
            "no-section",
            spec_text("bad", passes, ""),
            "no [passes.spectrum] section",
        ),
        (
            "no-pass",
            spec_text("bad", r#""exact", "replica""#, "[passes.spectrum]\nb = 0.5"),
            "no spectrum pass",
        ),
        (
            "quantizer",
            spec_text(
                "bad",
                passes,
                "[passes.spectrum]\nb = 0.5\nquantizer = \"gptq\"",
            ),
            "gptq",
        ),
        (
            "kernel",
            spec_text(
                "bad",
                passes,
                "[passes.spectrum]\nb = 0.5\n[passes.spectrum.importance]\nkernel = 4",
            ),
            "kernel 4 odd",
        ),
        (
            "budget-below-protected",
            spec_text("bad", passes, "[passes.spectrum]\nb = 0.05"),
            "cannot hold the 36 protected tokens",
        ),
        (
            "unknown-key",
            spec_text("bad", passes, "[passes.spectrum]\nb = 0.5\nbudget = 0.5"),
            "budget",
        ),
    ];
    for (case, text, needle) in &cases {
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
        assert_eq!(err.trim().lines().count(), 1, "{case}: one line: {err}");
        assert!(err.contains(needle), "{case}: `{needle}` not in: {err}");
        assert!(!out.exists(), "{case}: the run folder was written");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
