//! Summary numbers for a small literal table, checked against values worked out by hand.
//!
//! K = 2, so `Â ∈ {−1, −½, 0, ½, 1}` and τ ∈ {½, 1}. Rows are `(orig, alt)` success counts
//! per pass; `I` = informative (the 2K outcomes are not all equal), `N` = not.
//!
//! | key (problem, pivot, alt) | exact     | replica   | refeed     |
//! |---------------------------|-----------|-----------|------------|
//! | A (0, 1, 1)               | 2,0 → 1 I | 2,0 → 1 I | 1,0 → ½ I  |
//! | B (0, 2, 1)               | 0,0 → 0 N | 0,0 → 0 N | 1,0 → ½ I  |
//! | C (1, 1, 1)               | 1,1 → 0 I | 2,1 → ½ I | 1,1 → 0 I  |
//! | D (1, 3, 1)               | 2,2 → 0 N | 2,2 → 0 N | 2,2 → 0 N  |
//! | E (2, 1, 1)               | 2,0 → 1 I | 2,0 → 1 I | 1,2 → −½ I |
//! | F (2, 1, 2)               | 2,1 → ½ I | 2,2 → 0 N | 1,0 → ½ I  |
//! | G (3, 5, 1)               | 2,0 → 1 I | 1,0 → ½ I | 2,1 → ½ I  |
//! | H (3, 6, 1)               | 2,0 (exact only: incomplete)         |
mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use arrow_array::cast::AsArray;
use arrow_array::types::{Float64Type, UInt64Type};
use arrow_array::{Array, RecordBatch};
use kvcredit::analysis::summary::{Conditioning, ConditioningSummary};
use kvcredit::analysis::{
    AnalyzeOptions, ConfigMeta, ConfigSummary, EstimateRow, Pass, PassCost, summarize, table,
    write_outputs,
};

const K: u32 = 2;

/// `(orig, alt)` successes of exact, replica, refeed.
type Counts = [(u32, u32); 3];

fn row(problem: u32, pivot_pos: u32, alt_rank: u32, pass: Pass, o: u32, a: u32) -> EstimateRow {
    EstimateRow {
        config: "hand".into(),
        model: "m".into(),
        dtype: "fp16".into(),
        policy: "stock".into(),
        problem,
        pivot_pos,
        alt_rank,
        pass,
        estimate: (f64::from(o) - f64::from(a)) / f64::from(K),
        orig_successes: o,
        alt_successes: a,
        k: K,
        informative: !(o == a && (o == 0 || o == K)),
        snapshot_verified: pass != Pass::Refeed,
    }
}

fn table_rows() -> Vec<EstimateRow> {
    use Pass::{Exact, Refeed, Replica};
    let keys: [((u32, u32, u32), Counts); 7] = [
        ((0, 1, 1), [(2, 0), (2, 0), (1, 0)]),
        ((0, 2, 1), [(0, 0), (0, 0), (1, 0)]),
        ((1, 1, 1), [(1, 1), (2, 1), (1, 1)]),
        ((1, 3, 1), [(2, 2), (2, 2), (2, 2)]),
        ((2, 1, 1), [(2, 0), (2, 0), (1, 2)]),
        ((2, 1, 2), [(2, 1), (2, 2), (1, 0)]),
        ((3, 5, 1), [(2, 0), (1, 0), (2, 1)]),
    ];
    let mut rows = Vec::new();
    for ((p, t, a), counts) in keys {
        for (pass, (o, al)) in [Exact, Replica, Refeed].into_iter().zip(counts) {
            rows.push(row(p, t, a, pass, o, al));
        }
    }
    rows.push(row(3, 6, 1, Exact, 2, 0));
    rows
}

fn meta() -> ConfigMeta {
    let mut cost = BTreeMap::new();
    for (pass, s) in [
        ("exact", 10.0),
        ("replica", 11.0),
        ("refeed", 17.5),
        ("rollout", 4.0),
    ] {
        cost.insert(
            pass.to_string(),
            PassCost {
                device_seconds: s,
                tokens: 100,
                continuations: 28,
            },
        );
    }
    ConfigMeta {
        config: "hand".into(),
        model: "m".into(),
        dtype: "fp16".into(),
        policy: "stock".into(),
        replica_schedule: "shuffled".into(),
        task: None,
        k: 0,
        run_dirs: vec![PathBuf::from("hand")],
        n_problems: 0,
        n_keys: 0,
        n_incomplete: 0,
        snapshot_checks: 15,
        snapshot_hits: 15,
        cost,
        outputs: BTreeMap::new(),
        token_identity: BTreeMap::new(),
        spectrum_setting: None,
        spectrum: None,
        partial: None,
    }
}

fn opts() -> AnalyzeOptions {
    AnalyzeOptions {
        reps: 500,
        seed: 7,
        level: 0.95,
        ..AnalyzeOptions::default()
    }
}

fn summary() -> ConfigSummary {
    summarize(&table_rows(), meta(), Pass::Refeed, &opts()).expect("summarize")
}

fn cond(s: &ConfigSummary, c: Conditioning) -> &ConditioningSummary {
    s.rows.iter().find(|r| r.conditioning == c).expect("row")
}

fn close(a: f64, b: f64) {
    assert!((a - b).abs() < 1e-12, "{a} vs {b}");
}

#[test]
fn counts_keys_problems_and_incomplete() {
    let s = summary();
    assert_eq!(s.meta.k, 2);
    assert_eq!(s.meta.n_keys, 7);
    assert_eq!(s.meta.n_incomplete, 1);
    assert_eq!(s.meta.n_problems, 4);
    assert_eq!(s.taus, vec![0.5, 1.0]);
}

#[test]
fn any_informative_rates_excess_and_classes() {
    let s = summary();
    let r = cond(&s, Conditioning::AnyInformative);
    // replica set: exact or replica informative = A C E F G; disagree C (zero), F (zero), G (mag)
    assert_eq!(
        (
            r.replica.n_eligible,
            r.replica.n_problems,
            r.replica.n_disagree
        ),
        (5, 4, 3)
    );
    close(r.replica.rate.unwrap(), 0.6);
    let c = r.replica.classes;
    assert_eq!(
        (c.zero_boundary, c.polarity_reversal, c.magnitude),
        (2, 0, 1)
    );
    // refeed set: A B C E F G; disagree A (mag), B (zero), E (polarity), G (mag)
    assert_eq!(
        (
            r.treatment.n_eligible,
            r.treatment.n_problems,
            r.treatment.n_disagree
        ),
        (6, 4, 4)
    );
    close(r.treatment.rate.unwrap(), 4.0 / 6.0);
    let c = r.treatment.classes;
    assert_eq!(
        (c.zero_boundary, c.polarity_reversal, c.magnitude),
        (1, 1, 2)
    );
    close(r.excess.unwrap().estimate, 4.0 / 6.0 - 0.6);
}

#[test]
fn any_informative_paired_contrast_over_the_union() {
    let s = summary();
    let p = cond(&s, Conditioning::AnyInformative).paired.unwrap();
    // union = A B C E F G; D = [1, 1, −1, 1, −1, 0]
    assert_eq!((p.n, p.n_problems), (6, 4));
    close(p.mean, 1.0 / 6.0);
    // cluster means d = [1, −1, 0, 0]: mean 0, sd² = 2/3, se = √(2/3 / 4)
    close(p.cluster_mean.estimate, 0.0);
    close(p.cluster_mean.se.unwrap(), (2.0_f64 / 3.0 / 4.0).sqrt());
    close(p.cluster_mean.t.unwrap(), 0.0);
    close(p.cluster_mean.p_value.unwrap(), 1.0);
    assert_eq!(p.cluster_mean.df, 3);
    // CR1: residual sums per problem 5/3, −7/6, −1/3, −1/6 → Σ² = 77/18;
    // V = 4/3 · 77/18 / 36
    let v: f64 = 4.0 / 3.0 * (77.0 / 18.0) / 36.0;
    close(p.cr1.estimate, 1.0 / 6.0);
    close(p.cr1.se.unwrap(), v.sqrt());
    close(p.cr1.t.unwrap(), (1.0 / 6.0) / v.sqrt());
    assert_eq!(p.cr1.df, 3);
    // sensitivity: intersection = A C E F G, D = [1, −1, 1, −1, 0]
    let b = cond(&s, Conditioning::AnyInformative).intersection.unwrap();
    assert_eq!(b.n, 5);
    close(b.mean, 0.0);
}

#[test]
fn treatment_independent_uses_exact_informative_for_both() {
    let s = summary();
    let r = cond(&s, Conditioning::TreatmentIndependent);
    // exact informative = A C E F G
    assert_eq!((r.replica.n_eligible, r.treatment.n_eligible), (5, 5));
    assert_eq!((r.replica.n_disagree, r.treatment.n_disagree), (3, 3));
    let c = r.treatment.classes;
    assert_eq!(
        (c.zero_boundary, c.polarity_reversal, c.magnitude),
        (0, 1, 2)
    );
    let e = r.excess.unwrap();
    close(e.estimate, 0.0);
    let p = r.paired.unwrap();
    assert_eq!(p.n, 5);
    close(p.mean, 0.0);
    assert!(r.intersection.is_none());
    // One set for both rates: the excess and its tests coincide with D̄ and its CR1 test.
    assert_eq!((e.n, e.n_problems), (p.n, p.n_problems));
    close(e.t_test.se.unwrap(), p.cr1.se.unwrap());
    assert_eq!(e.t_test.df, p.cr1.df);
    let (eb, pb) = (e.bootstrap.unwrap().ci, p.bootstrap_ci.unwrap());
    close(eb.lo, pb.lo);
    close(eb.hi, pb.hi);
}

#[test]
fn mean_zero_check_is_the_mean_of_problem_means() {
    let s = summary();
    let r = cond(&s, Conditioning::AnyInformative);
    // refeed − exact over A B C E F G: problem means 0, 0, −0.75, −0.5
    let m = r.treatment.mean_diff.unwrap();
    close(m.t_test.estimate, -0.3125);
    // replica − exact over A C E F G: problem means 0, 0.5, −0.25, −0.5
    close(r.replica.mean_diff.unwrap().t_test.estimate, -0.0625);
}

#[test]
fn jaccard_of_critical_sets_by_hand() {
    let s = summary();
    let r = cond(&s, Conditioning::AnyInformative);
    let j = |c: &kvcredit::analysis::summary::Comparison, i: usize| {
        let x = c.jaccard[i].result;
        (x.size_a, x.size_b, x.intersection, x.union, x.value)
    };
    // τ = ½: exact {A E F G}, refeed {A B E F G}, replica {A C E G}
    assert_eq!(j(&r.treatment, 0), (4, 5, 4, 5, Some(0.8)));
    assert_eq!(j(&r.replica, 0), (4, 4, 3, 5, Some(0.6)));
    // τ = 1: exact {A E G}, refeed {}, replica {A E}
    assert_eq!(j(&r.treatment, 1), (3, 0, 0, 3, Some(0.0)));
    assert_eq!(j(&r.replica, 1), (3, 2, 2, 3, Some(2.0 / 3.0)));
    // Treatment-independent: B (exact uninformative, Â_exact = 0, Â_refeed = ½) is not
    // eligible but stays in C_refeed(½) per design.md, so the sets are the same as above.
    let t = cond(&s, Conditioning::TreatmentIndependent);
    assert_eq!(j(&t.treatment, 0), (4, 5, 4, 5, Some(0.8)));
    assert_eq!(j(&t.treatment, 1), j(&r.treatment, 1));
    assert_eq!(j(&t.replica, 0), j(&r.replica, 0));
    let inel = |c: &kvcredit::analysis::summary::Comparison| -> Vec<usize> {
        c.jaccard.iter().map(|p| p.n_ineligible).collect()
    };
    assert_eq!(inel(&t.treatment), vec![1, 0]);
    assert_eq!(inel(&t.replica), vec![0, 0]);
    assert_eq!(inel(&r.treatment), vec![0, 0]);
    for (x, y) in t.treatment.jaccard.iter().zip(&r.treatment.jaccard) {
        assert_eq!(x.ci, y.ci);
    }
    for c in [&r.treatment, &r.replica] {
        for p in &c.jaccard {
            let ci = p.ci.expect("bootstrap CI");
            assert!(ci.lo <= ci.hi && ci.lo >= 0.0 && ci.hi <= 1.0, "{ci:?}");
        }
    }
}

#[test]
fn empty_union_has_no_jaccard() {
    // every |Â| ≤ ½, so at τ = 1 neither pass has a critical estimate
    let rows: Vec<EstimateRow> = [Pass::Exact, Pass::Replica, Pass::Refeed]
        .into_iter()
        .flat_map(|p| [row(0, 1, 1, p, 1, 0), row(1, 1, 1, p, 1, 1)])
        .collect();
    let s = summarize(&rows, meta(), Pass::Refeed, &opts()).unwrap();
    let r = cond(&s, Conditioning::AnyInformative);
    let last = r.treatment.jaccard[1];
    assert_eq!((last.result.union, last.result.value), (0, None));
    assert!(last.ci.is_none());
    assert_eq!(r.treatment.rate, Some(0.0));
    let p = r.paired.unwrap();
    assert_eq!((p.cr1.se, p.cr1.t), (Some(0.0), None));
}

#[test]
fn bootstrap_is_deterministic_and_brackets_rates() {
    let (a, b) = (summary(), summary());
    assert_eq!(a, b);
    let r = cond(&a, Conditioning::AnyInformative);
    for c in [&r.replica, &r.treatment] {
        let ci = c.rate_ci.unwrap();
        assert_eq!(ci.reps, 500);
        assert!(ci.lo <= c.rate.unwrap() && c.rate.unwrap() <= ci.hi);
    }
}

#[test]
fn duplicate_rows_are_an_error() {
    let mut rows = table_rows();
    rows.push(rows[0].clone());
    let e = summarize(&rows, meta(), Pass::Refeed, &opts())
        .unwrap_err()
        .to_string();
    assert!(e.contains("duplicate estimate row"), "{e}");
    assert!(e.contains("problem=0 pivot_pos=1 alt_rank=1"), "{e}");
}

fn f64_at(b: &RecordBatch, col: &str, row: usize) -> Option<f64> {
    let a = b.column_by_name(col).unwrap_or_else(|| panic!("{col}"));
    let a = a.as_primitive::<Float64Type>();
    a.is_valid(row).then(|| a.value(row))
}

fn u64_at(b: &RecordBatch, col: &str, row: usize) -> u64 {
    b.column_by_name(col)
        .unwrap_or_else(|| panic!("{col}"))
        .as_primitive::<UInt64Type>()
        .value(row)
}

#[test]
fn summary_parquet_holds_the_hand_numbers() {
    let dir = std::env::temp_dir().join(format!("kvcredit-analysis-hand-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = write_outputs(vec![summary()], &[], &dir, &opts()).unwrap();
    let b = common::read_batch(&out.summary);
    assert_eq!(b.num_rows(), 2);
    let conds = b.column_by_name("conditioning").unwrap().as_string::<i32>();
    assert_eq!(conds.value(0), "any_informative");
    assert_eq!(conds.value(1), "treatment_independent");
    assert_eq!(u64_at(&b, "replica_n_eligible", 0), 5);
    assert_eq!(u64_at(&b, "refeed_n_eligible", 0), 6);
    assert_eq!(u64_at(&b, "refeed_n_eligible", 1), 5);
    assert_eq!(u64_at(&b, "n_incomplete", 0), 1);
    close(f64_at(&b, "replica_rate", 0).unwrap(), 0.6);
    close(f64_at(&b, "refeed_rate", 0).unwrap(), 4.0 / 6.0);
    close(f64_at(&b, "excess", 0).unwrap(), 4.0 / 6.0 - 0.6);
    close(f64_at(&b, "paired_mean", 0).unwrap(), 1.0 / 6.0);
    close(f64_at(&b, "excess", 1).unwrap(), 0.0);
    close(
        f64_at(&b, "excess_se", 1).unwrap(),
        f64_at(&b, "paired_cr1_se", 1).unwrap(),
    );
    assert!(f64_at(&b, "excess_boot_lo", 0).unwrap() <= f64_at(&b, "excess", 0).unwrap());
    let inel = b
        .column_by_name("refeed_crit_ineligible")
        .unwrap()
        .as_list::<i32>();
    let v = inel.value(1);
    assert_eq!(v.as_primitive::<UInt64Type>().values().to_vec(), vec![1, 0]);
    assert_eq!(f64_at(&b, "both_mean", 1), None);
    close(f64_at(&b, "cost_refeed_device_seconds", 0).unwrap(), 17.5);
    close(f64_at(&b, "cost_total_device_seconds", 0).unwrap(), 42.5);
    close(f64_at(&b, "snapshot_hit_rate", 0).unwrap(), 1.0);
    let jac = b.column_by_name("refeed_jaccard").unwrap().as_list::<i32>();
    let v = jac.value(0);
    let v = v.as_primitive::<Float64Type>();
    assert_eq!((v.value(0), v.value(1)), (0.8, 0.0));
    assert!(out.report.exists());
    assert_eq!(out.plots.len(), 4);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn schema_doc_matches_the_writer() {
    let want = table::schema_markdown(&[summary()], &opts());
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/analysis/SCHEMA.md");
    if std::env::var_os("KVCREDIT_BLESS").is_some() {
        std::fs::write(&path, &want).unwrap();
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        have == want,
        "src/analysis/SCHEMA.md is stale: rerun this test with KVCREDIT_BLESS=1"
    );
}

/// The example: three keys, K = 2, one problem each, where the excess and the paired
/// mean have opposite signs under any-informative.
///
/// | key | exact     | replica   | refeed    |
/// |-----|-----------|-----------|-----------|
/// | X   | 0,0 → 0 N | 0,0 → 0 N | 1,0 → ½ I |
/// | Y   | 0,0 → 0 N | 0,0 → 0 N | 1,0 → ½ I |
/// | Z   | 2,0 → 1 I | 1,0 → ½ I | 2,0 → 1 I |
///
/// Refeed set X Y Z, 2 disagree: 2/3. Replica set Z, 1 disagrees: 1. Excess −1/3 (linearized
/// t = −1 with 2 df), but D = [1, 1, −1] over the union: D̄ = +1/3.
fn three_keys() -> Vec<EstimateRow> {
    use Pass::{Exact, Refeed, Replica};
    let keys: [(u32, Counts); 3] = [
        (0, [(0, 0), (0, 0), (1, 0)]),
        (1, [(0, 0), (0, 0), (1, 0)]),
        (2, [(2, 0), (1, 0), (2, 0)]),
    ];
    let mut rows = Vec::new();
    for (p, counts) in keys {
        for (pass, (o, a)) in [Exact, Replica, Refeed].into_iter().zip(counts) {
            rows.push(row(p, 1, 1, pass, o, a));
        }
    }
    rows
}

#[test]
fn excess_is_tested_as_itself_not_through_the_paired_mean() {
    let s = summarize(&three_keys(), meta(), Pass::Refeed, &opts()).unwrap();
    let r = cond(&s, Conditioning::AnyInformative);
    let e = r.excess.unwrap();
    close(e.estimate, 2.0 / 3.0 - 1.0);
    assert_eq!((e.n, e.n_problems, e.t_test.df), (3, 3, 2));
    close(e.t_test.t.unwrap(), -1.0);
    let ci = e.bootstrap.unwrap().ci;
    assert!(
        ci.lo <= e.estimate && e.estimate <= ci.hi && ci.hi < 0.0,
        "{ci:?}"
    );
    let p = r.paired.unwrap();
    close(p.mean, 1.0 / 3.0);
    assert!(p.cr1.t.unwrap() > 0.0);

    // The report pairs the excess only with its own t and CI.
    let report = kvcredit::analysis::report::render(std::slice::from_ref(&s), &[], &opts());
    let line = |needle: &str| -> String {
        report
            .lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no `{needle}` line in:\n{report}"))
            .to_string()
    };
    let head = line("| hand | stock | any-informative | 1 / 3 |");
    assert!(head.contains("| -33.3 ["), "{head}");
    assert!(head.contains("| -1.00 (2) |"), "{head}");
    let paper = line("| problem-clustered t of the excess |");
    assert!(paper.contains("| -1.00 |"), "{paper}");
    let d = line("| hand | any-informative | 3 | 3 |");
    assert!(d.contains("| +33.3 ["), "{d}");
    assert!(report.contains("coincides with the paired D̄"), "{report}");
}

#[test]
fn output_counts_reach_summary_and_report() {
    use kvcredit::analysis::OutputCounts;
    let mut m = meta();
    let rules = |v: &[(&str, u64)]| v.iter().map(|&(r, n)| (r.to_string(), n)).collect();
    m.outputs.insert(
        "exact".into(),
        OutputCounts {
            rows: 12,
            truncated: 3,
            rules: Some(rules(&[("hashes", 9), ("last_number", 3)])),
        },
    );
    m.outputs.insert(
        "rollout".into(),
        OutputCounts {
            rows: 4,
            truncated: 1,
            rules: None,
        },
    );
    let s = summarize(&table_rows(), m, Pass::Refeed, &opts()).unwrap();
    let dir = std::env::temp_dir().join(format!("kvcredit-analysis-out-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = write_outputs(vec![s], &[], &dir, &opts()).unwrap();
    let b = common::read_batch(&out.summary);
    let opt_u64 = |col: &str| {
        let a = b.column_by_name(col).unwrap().as_primitive::<UInt64Type>();
        a.is_valid(0).then(|| a.value(0))
    };
    assert_eq!(opt_u64("n_texts_exact"), Some(12));
    assert_eq!(opt_u64("n_truncated_exact"), Some(3));
    assert_eq!(opt_u64("n_truncated_rollout"), Some(1));
    assert_eq!(opt_u64("n_truncated_refeed"), None);
    let names = b
        .column_by_name("extraction_rules")
        .unwrap()
        .as_list::<i32>();
    let names = names.value(0);
    let names: Vec<&str> = names.as_string::<i32>().iter().flatten().collect();
    assert_eq!(names, ["hashes", "last_number"]);
    let counts = b
        .column_by_name("rule_counts_exact")
        .unwrap()
        .as_list::<i32>();
    assert_eq!(
        counts
            .value(0)
            .as_primitive::<UInt64Type>()
            .values()
            .to_vec(),
        vec![9, 3]
    );
    let report = std::fs::read_to_string(&out.report).unwrap();
    assert!(
        report.contains("| hand | exact | 12 | 3 | 25.0% | hashes 9, last_number 3 |"),
        "{report}"
    );
    assert!(report.contains("| hand | rollout | 4 | 1 | 25.0% | not recorded |"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn output_counts_read_extraction_rule_only_when_present() {
    use std::sync::Arc;

    use arrow_array::{ArrayRef, StringArray};
    use kvcredit::analysis::read::read_output_counts;
    let dir = std::env::temp_dir().join(format!("kvcredit-analysis-rules-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, cols: Vec<(&str, Vec<Option<&str>>)>| {
        let cols: Vec<(&str, ArrayRef)> = cols
            .into_iter()
            .map(|(n, v)| (n, Arc::new(StringArray::from(v)) as ArrayRef))
            .collect();
        let batch = RecordBatch::try_from_iter(cols).unwrap();
        let f = std::fs::File::create(dir.join(name)).unwrap();
        let mut w = parquet::arrow::ArrowWriter::try_new(f, batch.schema(), None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
    };
    write(
        "continuations.parquet",
        vec![
            ("pass", vec![Some("exact"), Some("exact"), Some("refeed")]),
            ("stop", vec![Some("length"), Some("eos"), Some("length")]),
            (
                "extraction_rule",
                vec![Some("hashes"), None, Some("last_number")],
            ),
        ],
    );
    let c = read_output_counts(&dir).unwrap();
    assert_eq!(c.len(), 2, "{c:?}");
    assert_eq!((c["exact"].rows, c["exact"].truncated), (2, 1));
    let exact = c["exact"].rules.as_ref().unwrap();
    assert_eq!((exact["hashes"], exact["none"]), (1, 1));
    assert_eq!(c["refeed"].rules.as_ref().unwrap()["last_number"], 1);
    // Without the column (files written before it existed): no rule counts, and a rollouts
    // file is counted under `rollout`.
    write(
        "continuations.parquet",
        vec![
            ("pass", vec![Some("replica")]),
            ("stop", vec![Some("length")]),
        ],
    );
    write(
        "rollouts.parquet",
        vec![("stop", vec![Some("eos"), Some("length")])],
    );
    let c = read_output_counts(&dir).unwrap();
    assert_eq!(
        (c["replica"].truncated, c["replica"].rules.clone()),
        (1, None)
    );
    assert_eq!((c["rollout"].rows, c["rollout"].truncated), (2, 1));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The hand table plus `refeed_replica` (the re-fed state under the replica's schedule):
///
/// | key | exact | replica | refeed | refeed_replica |
/// |-----|-------|---------|--------|----------------|
/// | A   | 1 I   | 1 I     | ½ I    | 1,0 → ½ I      |
/// | B   | 0 N   | 0 N     | ½ I    | 0,0 → 0 N      |
/// | C   | 0 I   | ½ I     | 0 I    | 2,1 → ½ I      |
/// | D   | 0 N   | 0 N     | 0 N    | 2,2 → 0 N      |
/// | E   | 1 I   | 1 I     | −½ I   | 1,2 → −½ I     |
/// | F   | ½ I   | 0 N     | ½ I    | 1,0 → ½ I      |
/// | G   | 1 I   | ½ I     | ½ I    | 1,0 → ½ I      |
///
/// Treatment-independent (A C E F G): replica 3/5, refeed 3/5, refeed_replica 4/5 (A C E G);
/// excess 1/5, interaction 4/5 − 3/5 − 3/5 = −2/5. Any-informative: replica 3/5 (A C E F G),
/// refeed 4/6 (A B C E F G), refeed_replica 4/5 (A C E F G); excess 1/5, interaction −7/15.
fn factorial_rows() -> Vec<EstimateRow> {
    let mut rows = table_rows();
    for ((p, t, a), (o, al)) in [
        ((0, 1, 1), (1, 0)),
        ((0, 2, 1), (0, 0)),
        ((1, 1, 1), (2, 1)),
        ((1, 3, 1), (2, 2)),
        ((2, 1, 1), (1, 2)),
        ((2, 1, 2), (1, 0)),
        ((3, 5, 1), (1, 0)),
    ] {
        rows.push(row(p, t, a, Pass::RefeedReplica, o, al));
    }
    rows
}

#[test]
fn state_by_schedule_cells_and_decomposition_by_hand() {
    use kvcredit::analysis::summary::Factorial;
    let rows = factorial_rows();
    let s = summarize(&rows, meta(), Pass::Refeed, &opts()).unwrap();
    let f: &Factorial = s.factorial.as_ref().expect("refeed_replica present");
    assert_eq!(
        (f.state, f.twin, f.n_keys, f.n_problems),
        (Pass::Refeed, Pass::RefeedReplica, 7, 4)
    );
    let by = |c: Conditioning| f.rows.iter().find(|r| r.conditioning == c).unwrap();
    for (c, rates, excess, interaction) in [
        (
            Conditioning::TreatmentIndependent,
            [(3, 5), (3, 5), (4, 5)],
            0.2,
            -0.4,
        ),
        (
            Conditioning::AnyInformative,
            [(3, 5), (4, 6), (4, 5)],
            0.2,
            -7.0 / 15.0,
        ),
    ] {
        let r = by(c);
        for (cell, (k, n)) in r.cells.iter().zip(rates) {
            assert_eq!((cell.n_disagree, cell.n_eligible), (k, n), "{c:?} {cell:?}");
            let b = cell.rate.unwrap();
            close(b.estimate, k as f64 / n as f64);
            assert!(b.ci.lo <= b.estimate && b.estimate <= b.ci.hi, "{b:?}");
        }
        assert_eq!(
            r.cells.map(|c| c.pass),
            [Pass::Replica, Pass::Refeed, Pass::RefeedReplica]
        );
        close(r.excess.estimate.unwrap(), excess);
        close(r.interaction.estimate.unwrap(), interaction);
        // The excess is the state effect plus the interaction.
        close(
            r.excess.estimate.unwrap(),
            r.cells[1].rate.unwrap().estimate + r.interaction.estimate.unwrap(),
        );
        let ci = r.interaction.ci.unwrap();
        assert!(ci.lo <= interaction && interaction <= ci.hi, "{ci:?}");
    }
    // The excess of refeed_replica over the floor, as a treatment of its own, is the same
    // number as the design's excess.
    let twin = summarize(&rows, meta(), Pass::RefeedReplica, &opts()).unwrap();
    assert!(twin.factorial.is_none());
    close(
        cond(&twin, Conditioning::TreatmentIndependent)
            .excess
            .unwrap()
            .estimate,
        0.2,
    );
    // Negative control: without refeed_replica there is no design.
    let plain = summarize(&table_rows(), meta(), Pass::Refeed, &opts()).unwrap();
    assert!(plain.factorial.is_none());
    // The report's section, and not measurable above a structural-zero floor.
    let render = |s: &ConfigSummary| {
        kvcredit::analysis::report::render(&[s.clone(), twin.clone()], &[], &opts())
    };
    let report = render(&s);
    let sec = &report[report.find("## State × schedule").expect("2×2 section")..];
    let line = sec
        .lines()
        .find(|l| l.starts_with("| hand | treatment-independent |"))
        .unwrap();
    assert!(line.contains("| 80.0% ["), "{line}");
    assert!(line.contains("| +20.0 ["), "{line}");
    assert!(line.contains("| -40.0 ["), "{line}");
    assert!(!plain_report_has_section(&plain));
    let mut zero = s.clone();
    zero.meta.token_identity.insert(
        Pass::Replica,
        kvcredit::analysis::TokenIdentity {
            identical: 40,
            total: 40,
        },
    );
    let report = render(&zero);
    let sec = &report[report.find("## State × schedule").unwrap()..];
    let line = sec
        .lines()
        .find(|l| l.starts_with("| hand | treatment-independent |"))
        .unwrap();
    assert!(
        line.starts_with("| hand | treatment-independent | 7 | 4 | structural zero"),
        "{line}"
    );
    assert!(
        line.ends_with("| not measurable | not measurable |"),
        "{line}"
    );
}

fn plain_report_has_section(s: &ConfigSummary) -> bool {
    kvcredit::analysis::report::render(std::slice::from_ref(s), &[], &opts())
        .contains("State × schedule")
}

#[test]
fn ceiling_gap_is_the_paired_difference_of_the_two_jaccards() {
    // τ = ½: J(exact, replica) = |{A,E,G}|/|{A,C,E,F,G}| = 3/5 and J(exact, refeed) =
    // |{A,E,F,G}|/|{A,B,E,F,G}| = 4/5: the ceiling lies 1/5 below the refeed Jaccard.
    let s = summary();
    assert_eq!(s.ceiling_gap.len(), s.taus.len());
    let g = s.ceiling_gap[0].unwrap();
    close(g.estimate.unwrap(), -0.2);
    assert!(g.ci.lo <= -0.2 && -0.2 <= g.ci.hi, "{g:?}");
    let r = cond(&s, Conditioning::AnyInformative);
    close(
        g.estimate.unwrap(),
        r.replica.jaccard[0].result.value.unwrap() - r.treatment.jaccard[0].result.value.unwrap(),
    );
}
