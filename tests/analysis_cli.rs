//! `kvcredit analyze` and `kvcredit check` on the synthetic run dirs of
//! `tests/fixtures/analysis/runs/` (written by `gen_runs.py`; `planted.json` names the rows
//! each `bad_*` run breaks).
mod common;

use std::path::{Path, PathBuf};

fn runs() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/analysis/runs")
}

/// Copy fixture run dirs into a scratch dir (analyze writes into the run dir).
fn copy_runs(names: &[&str], scratch_name: &str) -> PathBuf {
    let dst = common::scratch("analysis", scratch_name);
    for n in names {
        let d = dst.join(n);
        std::fs::create_dir_all(&d).unwrap();
        for e in std::fs::read_dir(runs().join(n)).unwrap() {
            let p = e.unwrap().path();
            std::fs::copy(&p, d.join(p.file_name().unwrap())).unwrap();
        }
    }
    dst
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

fn assert_outputs(dir: &Path) {
    for f in ["summary.parquet", "report.md"] {
        assert!(dir.join(f).is_file(), "{f} missing in {}", dir.display());
    }
    for stem in ["disagreement", "jaccard"] {
        let png = std::fs::read(dir.join(format!("{stem}.png"))).unwrap();
        assert!(
            png.starts_with(b"\x89PNG\r\n\x1a\n"),
            "{stem}.png is not a PNG"
        );
        assert!(
            png.len() > 10_000,
            "{stem}.png looks empty ({} bytes)",
            png.len()
        );
        let svg = std::fs::read_to_string(dir.join(format!("{stem}.svg"))).unwrap();
        assert!(svg.contains("<svg") && svg.contains("</svg>"), "{stem}.svg");
        assert!(svg.contains("<text"), "{stem}.svg has no text");
    }
}

#[test]
fn analyze_one_run_writes_outputs_into_the_run_dir() {
    let root = copy_runs(&["stock_shuffled"], "one");
    let run = root.join("stock_shuffled");
    let (code, out, err) = common::kvcredit(&["analyze", &s(&run), "--reps", "200"]);
    assert_eq!(code, 0, "{out}{err}");
    assert_outputs(&run);
    let report = std::fs::read_to_string(run.join("report.md")).unwrap();
    for needle in [
        "qwen-stock-fp16",
        "any-informative",
        "treatment-independent",
        "seed paper",
        "14–28",
        "0.63–0.96",
        "replica ceiling",
        "zero-boundary",
        "Mean-zero",
        "disagreement.png",
        "jaccard.png",
        "device-seconds",
        "t of the excess",
        "Paired contrast D̄",
        // 41 of the fixture's 288 exact continuations stopped at the token cap; the fixture
        // predates the `extraction_rule` column.
        "| qwen-stock-fp16 | exact | 288 | 41 | 14.2% | not recorded |",
    ] {
        assert!(report.contains(needle), "`{needle}` not in report.md");
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn analyze_several_runs_needs_out_and_writes_one_row_pair_per_config() {
    let names = [
        "stock_shuffled",
        "stock_k5",
        "same_schedule",
        "batch_invariant",
    ];
    let root = copy_runs(&names, "many");
    let dirs: Vec<String> = names.iter().map(|n| s(&root.join(n))).collect();
    let mut args: Vec<&str> = vec!["analyze"];
    args.extend(dirs.iter().map(String::as_str));
    let (code, _, err) = common::kvcredit(&args);
    assert_eq!(code, 2);
    assert!(err.starts_with("error: ") && err.contains("--out"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");

    let out = root.join("combined");
    let out_s = s(&out);
    args.extend(["--out", &out_s, "--reps", "200"]);
    let (code, o, err) = common::kvcredit(&args);
    assert_eq!(code, 0, "{o}{err}");
    assert_outputs(&out);
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(
        report.contains("(batch-invariant)"),
        "batch-invariant row missing"
    );
    assert!(report.contains("5/5 = 1.000"), "K = 5 grid missing");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn analyze_bad_input_is_one_line() {
    let root = common::scratch("analysis", "bad");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec![s(&root.join("nope"))], "manifest.json"),
        (
            {
                std::fs::write(root.join("manifest.json"), "{ not json").unwrap();
                vec![s(&root)]
            },
            "manifest.json",
        ),
    ];
    for (dirs, needle) in cases {
        let mut args = vec!["analyze"];
        args.extend(dirs.iter().map(String::as_str));
        let (code, _, err) = common::kvcredit(&args);
        assert_eq!(code, 2, "{err}");
        assert!(!err.contains("panicked"), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.starts_with("error: ") && err.contains(needle), "{err}");
    }
    // a manifest but estimates that are not Parquet
    let run = copy_runs(&["stock_shuffled"], "bad-parquet").join("stock_shuffled");
    std::fs::write(run.join("estimates.parquet"), b"not parquet").unwrap();
    let (code, _, err) = common::kvcredit(&["analyze", &s(&run)]);
    assert_eq!(code, 2);
    assert!(
        err.contains("estimates.parquet") && err.trim().lines().count() == 1,
        "{err}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn check_passes_clean_runs() {
    for name in [
        "stock_shuffled",
        "stock_k5",
        "same_schedule",
        "batch_invariant",
    ] {
        let (code, out, err) = common::kvcredit(&["check", &s(&runs().join(name))]);
        assert_eq!(code, 0, "{name}: {out}{err}");
        assert_eq!(out.trim().lines().count(), 1, "{out}");
        assert!(out.starts_with("check passed: "), "{out}");
    }
    let (_, out, _) = common::kvcredit(&["check", &s(&runs().join("same_schedule"))]);
    assert!(out.contains("replica-same"), "{out}");
    let (_, out, _) = common::kvcredit(&["check", &s(&runs().join("batch_invariant"))]);
    assert!(out.contains("batch-invariant"), "{out}");
}

fn planted() -> serde_json::Value {
    let text = std::fs::read_to_string(runs().join("planted.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn est(v: &serde_json::Value, pass: &str) -> String {
    format!(
        "estimate problem={} pivot_pos={} alt_rank={} pass={pass}",
        v[0], v[1], v[2]
    )
}

fn cont(v: &serde_json::Value, pass: &str) -> String {
    format!(
        "continuation problem={} pivot_pos={} alt_rank={} pass={pass} branch={} sample={}",
        v[0],
        v[1],
        v[2],
        v[3].as_str().unwrap(),
        v[4]
    )
}

/// Run `check` on a bad run: exit 1, exactly `rule` violated, every needle on stdout.
fn assert_fails(name: &str, rule: &str, needles: &[String]) {
    let (code, out, err) = common::kvcredit(&["check", &s(&runs().join(name))]);
    assert_eq!(code, 1, "{name} should fail: {out}{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.starts_with("error: invariant: check failed"), "{err}");
    assert!(err.contains(rule), "{err}");
    for line in out.lines() {
        assert!(
            line.starts_with(&format!("{rule}: ")),
            "{name}: unexpected `{line}`"
        );
    }
    for n in needles {
        assert!(out.contains(n.as_str()), "{name}: `{n}` not in:\n{out}");
    }
}

#[test]
fn check_fails_on_a_snapshot_hit_rate_below_one() {
    assert_fails(
        "bad_hit_rate",
        "snapshot-hit-rate",
        &["manifest: snapshot hit rate".into()],
    );
}

#[test]
fn check_names_unverified_snapshot_rows() {
    let p = &planted()["bad_unverified"];
    assert_fails(
        "bad_unverified",
        "snapshot-verified",
        &[est(&p["exact"], "exact"), est(&p["replica"], "replica")],
    );
}

#[test]
fn check_names_missing_and_inconsistent_rows() {
    let p = &planted()["bad_structure"];
    let (code, out, _) = common::kvcredit(&["check", &s(&runs().join("bad_structure"))]);
    assert_eq!(code, 1);
    assert!(
        out.contains(&format!(
            "complete: {}: missing",
            est(&p["missing_refeed"], "refeed")
        )),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "consistent: {}",
            est(&p["inconsistent_exact"], "exact")
        )),
        "{out}"
    );
    assert_eq!(out.lines().count(), 2, "{out}");
}

#[test]
fn check_names_replica_rows_that_differ_under_the_same_schedule() {
    let p = &planted()["bad_replica_same"];
    assert_fails(
        "bad_replica_same",
        "replica-same",
        &[
            est(&p["estimate"], "replica"),
            cont(&p["continuation"], "replica"),
        ],
    );
}

#[test]
fn check_names_rows_that_differ_under_batch_invariance() {
    let p = &planted()["bad_batch_inv"];
    assert_fails(
        "bad_batch_inv",
        "batch-invariant",
        &[
            est(&p["estimate"], "refeed"),
            cont(&p["continuation"], "replica"),
        ],
    );
}

#[test]
fn check_fails_several_dirs_if_any_fails() {
    let (code, out, err) = common::kvcredit(&[
        "check",
        &s(&runs().join("stock_shuffled")),
        &s(&runs().join("bad_hit_rate")),
    ]);
    assert_eq!(code, 1);
    assert!(out.contains("check passed: "), "{out}");
    assert!(err.contains("bad_hit_rate"), "{err}");
}

/// The `## Reproduction table` section of a report, up to the next `## ` section.
fn reproduction_section(report: &str) -> &str {
    let start = report
        .find("## Reproduction table")
        .expect("reproduction table");
    let rest = &report[start + 3..];
    &report[start..start + 3 + rest.find("\n## ").unwrap_or(rest.len())]
}

/// The table row of `config` in `section` (the first line starting `| config |`).
fn row<'a>(section: &'a str, config: &str) -> &'a str {
    section
        .lines()
        .find(|l| l.starts_with(&format!("| {config} |")))
        .unwrap_or_else(|| panic!("no row for {config} in\n{section}"))
}

#[test]
fn analyze_several_runs_writes_one_side_by_side_table_with_claims_and_dollars() {
    let names = ["stock_shuffled", "stock_k5", "batch_invariant"];
    let root = copy_runs(&names, "repro");
    let dirs: Vec<String> = names.iter().map(|n| s(&root.join(n))).collect();
    let report_at = |usd: &str, out: &str| {
        let out = root.join(out);
        let out_s = s(&out);
        let mut args: Vec<&str> = vec!["analyze", "--out", &out_s, "--reps", "200"];
        args.extend(dirs.iter().map(String::as_str));
        if !usd.is_empty() {
            args.extend(["--usd-per-gpu-hour", usd]);
        }
        let (code, o, err) = common::kvcredit(&args);
        assert_eq!(code, 0, "{o}{err}");
        std::fs::read_to_string(out.join("report.md")).unwrap()
    };
    let report = report_at("", "default");
    let sec = reproduction_section(&report);
    let configs: Vec<String> = {
        let configs_sec = &report[report.find("## Configurations").unwrap()..];
        configs_sec
            .lines()
            .skip(4)
            .take_while(|l| l.starts_with("| "))
            .map(|l| l.split(" | ").next().unwrap()[2..].to_string())
            .collect()
    };
    assert_eq!(configs.len(), 3, "{configs:?}");
    for c in &configs {
        let r = row(sec, c);
        assert_eq!(r.matches(" | ").count() + 1, 17, "17 columns: {r}");
    }
    assert!(
        sec.contains("| seed paper (6 stock configs) | stock |"),
        "{sec}"
    );
    assert!(sec.contains("14–28") && sec.contains("2.9–6.4"), "{sec}");
    // stock_shuffled's manifest records 78.374 device-seconds in all: $0.08 at the default
    // $3.50/GPU-hour, $0.78 at $36.
    let stock = "qwen-stock-fp16";
    assert!(
        row(sec, stock).ends_with("| 78.4 | 0.08 |"),
        "{}",
        row(sec, stock)
    );
    let pricey = report_at("36", "pricey");
    let r36 = row(reproduction_section(&pricey), stock).to_string();
    assert!(r36.ends_with("| 78.4 | 0.78 |"), "{r36}");
    assert!(
        pricey.contains("| **total** | 78.4 | 0.78 |"),
        "cost section total"
    );
    // One claim line per seed claim, one verdict cell per stock configuration.
    let claims = &sec[sec.find("### Seed claims").expect("claims")..];
    let claim_lines: Vec<&str> = claims
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| claim") && !l.starts_with("| ---"))
        .take_while(|l| !l.contains("exact≠replica"))
        .collect();
    assert_eq!(claim_lines.len(), 5, "{claims}");
    for l in &claim_lines {
        let cells = l.matches(" | ").count();
        assert_eq!(cells, 2, "a verdict per stock config: {l}");
        assert!(
            ["yes", "not shown", "no (opposite", "no interval"]
                .iter()
                .any(|v| l.contains(v)),
            "{l}"
        );
    }
    // The batch-invariant twin: both rates exactly 0, with their Wilson intervals.
    let twins = &sec[sec.find("### Batch-invariant twins").expect("twins")..];
    let bi: Vec<&str> = twins
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| config") && !l.starts_with("| ---"))
        .take_while(|l| l.starts_with("| "))
        .collect();
    assert_eq!(bi.len(), 1, "{twins}");
    let r = bi[0];
    assert!(r.contains("0.0% [0.0, ") && r.ends_with("| yes |"), "{r}");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn reproduction_table_flags_a_twin_that_disagrees_and_refuses_a_bad_price() {
    // Negative control: bad_batch_inv plants disagreements under the batch-invariant policy.
    let root = copy_runs(&["bad_batch_inv"], "repro-bad");
    let run = root.join("bad_batch_inv");
    let (code, o, err) = common::kvcredit(&["analyze", &s(&run), "--reps", "100"]);
    assert_eq!(code, 0, "{o}{err}");
    let report = std::fs::read_to_string(run.join("report.md")).unwrap();
    let sec = reproduction_section(&report);
    let twins = &sec[sec.find("### Batch-invariant twins").expect("twins")..];
    assert!(twins.contains("| **no** |"), "{twins}");
    for bad in ["-1", "nan"] {
        let (code, _, err) =
            common::kvcredit(&["analyze", &s(&run), &format!("--usd-per-gpu-hour={bad}")]);
        assert_eq!(code, 2, "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains("--usd-per-gpu-hour"), "{err}");
    }
    std::fs::remove_dir_all(&root).unwrap();
}
