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
    assert_eq!(claim_lines.len(), 8, "{claims}");
    for l in &claim_lines {
        let cells = l.matches(" | ").count();
        assert_eq!(cells, 2, "a verdict per stock config: {l}");
        for cell in l.trim_matches('|').split(" | ").skip(1) {
            assert!(
                [
                    "yes (p ",
                    "not shown",
                    "no (opposite",
                    "equivalent within",
                    "no test"
                ]
                .iter()
                .any(|v| cell.contains(v)),
                "{l}"
            );
            // Every tested verdict prints its raw and its Holm-adjusted p.
            assert!(!cell.contains("(p ") || cell.contains(", Holm "), "{cell}");
        }
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

/// The `## {title}` section of a report, up to the next `## ` section.
fn section<'a>(report: &'a str, title: &str) -> &'a str {
    let start = report
        .find(&format!("## {title}"))
        .unwrap_or_else(|| panic!("no section {title}"));
    let rest = &report[start + 3..];
    &report[start..start + 3 + rest.find("\n## ").unwrap_or(rest.len())]
}

/// The first row of the summary table whose `config` column is `config`.
fn summary_row(dir: &Path, config: &str) -> (arrow_array::RecordBatch, usize) {
    use arrow_array::cast::AsArray;
    let f = std::fs::File::open(dir.join("summary.parquet")).unwrap();
    let mut r = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(f)
        .unwrap()
        .build()
        .unwrap();
    let b = r.next().unwrap().unwrap();
    let names = b
        .column_by_name("config")
        .unwrap()
        .as_string::<i32>()
        .clone();
    let i = (0..b.num_rows())
        .find(|&i| names.value(i) == config)
        .unwrap_or_else(|| panic!("no summary row for {config}"));
    (b, i)
}

#[test]
fn a_replica_identical_to_exact_is_a_structural_zero_and_the_excess_not_measurable() {
    use arrow_array::cast::AsArray;
    use arrow_array::types::{Float64Type, UInt64Type};
    // structural_zero: a shuffled replica whose continuations all equal exact's. Controls:
    // stock_shuffled (a measured floor) and same_schedule (identity asked for).
    let names = ["structural_zero", "stock_shuffled", "same_schedule"];
    let root = copy_runs(&names, "structural-zero");
    let dirs: Vec<String> = names.iter().map(|n| s(&root.join(n))).collect();
    let out = root.join("out");
    let out_s = s(&out);
    let mut args = vec!["analyze", "--out", &out_s, "--reps", "100"];
    args.extend(dirs.iter().map(String::as_str));
    let (code, o, err) = common::kvcredit(&args);
    assert_eq!(code, 0, "{o}{err}");
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    let zero = "qwen-stock-structural-zero";
    let (stock, same) = ("qwen-stock-fp16", "qwen-stock-same");
    // Token identity, with counts, per comparison.
    let ident = section(&report, "Token identity with exact");
    let z = row(ident, zero);
    assert!(z.contains("| replica |") && z.contains("100.0%"), "{ident}");
    assert!(
        z.contains("structural zero: the replica exercised no numerical difference"),
        "{z}"
    );
    assert!(row(ident, stock).contains("| measured |"), "{ident}");
    assert!(
        row(ident, same).contains("bitwise-identity control"),
        "{ident}"
    );
    // The reproduction row: the floor in words, every excess cell not measurable.
    let rep = reproduction_section(&report);
    let r = row(rep, zero);
    assert!(r.contains("structural zero: the replica exercised no numerical difference"));
    let cells = |r: &str, v: &str| r.split(" | ").filter(|c| *c == v).count();
    assert_eq!(cells(r, "not measurable"), 3, "{r}");
    assert!(r.contains("(not measurable)"), "the ceiling: {r}");
    for control in [stock, same] {
        let r = row(rep, control);
        assert!(
            !r.contains("not measurable") && !r.contains("structural"),
            "{r}"
        );
    }
    // Every seed claim relative to the floor says so for that configuration only.
    let claims = &rep[rep.find("### Seed claims").expect("claims")..];
    let header = claims.lines().find(|l| l.starts_with("| claim")).unwrap();
    let col = header
        .split(" | ")
        .position(|c| c.contains(zero))
        .expect("a column for the structural zero");
    let floor_claims: Vec<&str> = claims
        .lines()
        .filter(|l| {
            l.starts_with("| re-feed excess")
                || l.starts_with("| problem-clustered t")
                || l.starts_with("| replica floor")
                || l.starts_with("| Jaccard(exact, refeed) below")
        })
        .collect();
    assert_eq!(floor_claims.len(), 5, "{claims}");
    for l in floor_claims {
        let cells: Vec<&str> = l.split(" | ").collect();
        assert!(cells[col].starts_with("not measurable"), "{l}");
        assert_eq!(l.matches("not measurable").count(), 1, "{l}");
    }
    // The headline table and the ranges beside the seed's leave it out too.
    let head = section(&report, "Re-feed disagreement above the replica floor");
    assert_eq!(
        head.lines()
            .filter(|l| l.starts_with(&format!("| {zero} |")))
            .filter(|l| l.matches("not measurable").count() == 4)
            .count(),
        2,
        "{head}"
    );
    let paper = section(&report, "Side by side with the seed paper");
    assert!(
        paper.contains(&format!(
            "structural-zero floor, the replica exercised no numerical difference: {zero}"
        )),
        "{paper}"
    );
    // summary.parquet carries the shares and the status.
    let (b, i) = summary_row(&out, zero);
    let status = b
        .column_by_name("replica_floor_status")
        .unwrap()
        .as_string::<i32>()
        .value(i)
        .to_string();
    assert_eq!(status, "structural_zero");
    let share = |c: &str, b: &arrow_array::RecordBatch, i: usize| {
        b.column_by_name(c)
            .unwrap()
            .as_primitive::<Float64Type>()
            .value(i)
    };
    let count = |c: &str, b: &arrow_array::RecordBatch, i: usize| {
        b.column_by_name(c)
            .unwrap()
            .as_primitive::<UInt64Type>()
            .value(i)
    };
    assert_eq!(share("token_identical_share_replica", &b, i), 1.0);
    assert_eq!(
        count("token_identical_replica", &b, i),
        count("token_compared_replica", &b, i)
    );
    assert!(share("token_identical_share_refeed", &b, i) < 1.0);
    let (b, i) = summary_row(&out, stock);
    assert_eq!(
        b.column_by_name("replica_floor_status")
            .unwrap()
            .as_string::<i32>()
            .value(i),
        "measured"
    );
    assert!(share("token_identical_share_replica", &b, i) < 1.0);
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn token_identical_counts_each_pass_against_exact() {
    use kvcredit::analysis::Pass;
    use kvcredit::analysis::identity::token_identical;
    let zero = token_identical(&runs().join("structural_zero")).unwrap();
    let rep = zero[&Pass::Replica];
    assert!(rep.total > 0 && rep.all_identical(), "{rep:?}");
    assert!(!zero[&Pass::Refeed].all_identical());
    assert!(!zero.contains_key(&Pass::Exact));
    // Negative control: a shuffled replica with real differences.
    let stock = token_identical(&runs().join("stock_shuffled")).unwrap();
    let rep = stock[&Pass::Replica];
    assert!(rep.total > 0 && rep.identical < rep.total, "{rep:?}");
    // bad_replica_same plants one replica continuation with other tokens.
    let bad = token_identical(&runs().join("bad_replica_same")).unwrap()[&Pass::Replica];
    assert_eq!(bad.total - bad.identical, 2, "{bad:?}");
}

#[test]
fn report_states_one_critical_set_definition_and_cites_only_files_it_has() {
    use kvcredit::analysis::summary::CRITICAL_SET_DEFINITION;
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let concepts = std::fs::read_to_string(repo.join("docs/guide/concepts.md")).unwrap();
    assert!(
        concepts.contains(CRITICAL_SET_DEFINITION),
        "docs/guide/concepts.md must state: {CRITICAL_SET_DEFINITION}"
    );
    let names = ["stock_shuffled", "stock_k5"];
    let root = copy_runs(&names, "citations");
    let out = root.join("out");
    let (out_s, a, b) = (s(&out), s(&root.join(names[0])), s(&root.join(names[1])));
    let (code, o, err) = common::kvcredit(&["analyze", "--out", &out_s, "--reps", "50", &a, &b]);
    assert_eq!(code, 0, "{o}{err}");
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(report.contains(CRITICAL_SET_DEFINITION));
    // Every `.md` file the report names exists in the repository or next to the report.
    let mut cited = 0;
    for word in report.split(|c: char| c.is_whitespace() || "`()[],;*".contains(c)) {
        let word = word.trim_end_matches(['.', ':']);
        if word.ends_with(".md") {
            cited += 1;
            assert!(
                repo.join(word).is_file() || out.join(word).is_file(),
                "the report cites `{word}`, which the repository does not have"
            );
        }
    }
    assert!(cited >= 1, "the report cites docs/guide/concepts.md");
    assert!(!report.contains("design.md"));
    // Jaccard ranges beside the seed's: one row per threshold, never pooled over τ. K = 4 and
    // K = 5 share only τ = 1: 4 + 5 − 1 thresholds, each with the refeed and the ceiling row.
    let paper = section(&report, "Side by side with the seed paper");
    let jac: Vec<&str> = paper
        .lines()
        .filter(|l| l.contains("Jaccard(exact, ") && l.contains("at τ = "))
        .collect();
    assert_eq!(jac.len(), 16, "{paper}");
    assert_eq!(jac.iter().filter(|l| l.contains("at τ = 1 ")).count(), 2);
    assert!(jac.iter().any(|l| l.contains("at τ = 1/4 ")));
    assert!(jac.iter().any(|l| l.contains("at τ = 2/5 ")));
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn mean_zero_is_an_equivalence_test_with_a_settable_margin() {
    let root = copy_runs(&["stock_shuffled"], "tost");
    let run = root.join("stock_shuffled");
    let mean_zero = |margin: &str| {
        let (code, o, err) = common::kvcredit(&[
            "analyze",
            &s(&run),
            "--reps",
            "50",
            "--equivalence-margin",
            margin,
        ]);
        assert_eq!(code, 0, "{o}{err}");
        let report = std::fs::read_to_string(run.join("report.md")).unwrap();
        section(&report, "Mean-zero check").to_string()
    };
    // At ±0.05 the refeed mean (≈ −0.03, t CI about ±0.13) is not shown equivalent, although
    // its t test does not reject mean = 0.
    let narrow = mean_zero("0.05");
    let line = narrow
        .lines()
        .find(|l| l.contains("| any-informative | refeed |"))
        .unwrap();
    assert!(line.ends_with("| not shown equivalent (±0.05) |"), "{line}");
    assert!(!narrow.contains("equivalent within"), "{narrow}");
    // A wide margin: TOST rejects both one-sided nulls.
    let wide = mean_zero("0.5");
    let line = wide
        .lines()
        .find(|l| l.contains("| any-informative | refeed |"))
        .unwrap();
    assert!(line.ends_with("| equivalent within ±0.5 |"), "{line}");
    for bad in ["0", "-0.1", "nan"] {
        let (code, _, err) =
            common::kvcredit(&["analyze", &s(&run), &format!("--equivalence-margin={bad}")]);
        assert_eq!(code, 2, "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains("--equivalence-margin"), "{err}");
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn crossing_shares_have_clustered_intervals_under_both_conditionings() {
    let root = copy_runs(&["stock_shuffled"], "shares");
    let run = root.join("stock_shuffled");
    let (code, o, err) = common::kvcredit(&["analyze", &s(&run), "--reps", "100"]);
    assert_eq!(code, 0, "{o}{err}");
    let report = std::fs::read_to_string(run.join("report.md")).unwrap();
    let classes = section(&report, "How estimates disagree");
    for cond in ["any-informative", "treatment-independent"] {
        let l = classes
            .lines()
            .find(|l| l.contains(&format!("| {cond} | exact vs refeed |")))
            .unwrap_or_else(|| panic!("{classes}"));
        // share [lo, hi] (k/n) for each class, and the verdict against 1/2.
        assert_eq!(l.matches("% [").count(), 3, "{l}");
        assert!(
            [
                "yes (CI above 1/2)",
                "no (CI below 1/2)",
                "not shown (CI covers 1/2)"
            ]
            .iter()
            .any(|v| l.ends_with(&format!("| {v} |"))),
            "{l}"
        );
    }
    // Crossing shares in the reproduction table use the same clustered intervals.
    let r = row(reproduction_section(&report), "qwen-stock-fp16");
    assert!(!r.contains("Wilson"), "{r}");
    std::fs::remove_dir_all(&root).unwrap();
}
