//! `summary.parquet`: one row per configuration × conditioning with every number of the
//! analysis. Column names, types and descriptions are declared once, here, row by row; the
//! schema documentation (`SCHEMA.md`) is generated from the same declarations
//! ([`schema_markdown`]) and a test keeps the checked-in copy equal to it.
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use arrow_array::builder::{Float64Builder, ListBuilder, StringBuilder, UInt64Builder};
use arrow_array::{ArrayRef, Float64Array, RecordBatch, StringArray, UInt64Array};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;

use crate::stats::{BootstrapCi, TTest};
use crate::{Error, Result};

use super::read::{Pass, ROLLOUT};
use super::summary::{AnalyzeOptions, Comparison, ConditioningSummary, ConfigSummary};

/// File name of the summary table (the refeed treatment's).
pub const SUMMARY: &str = "summary.parquet";

/// File name of the summary table of `treatment`: [`SUMMARY`] for refeed,
/// `summary-<pass>.parquet` for the others (their columns carry the pass's name as prefix).
pub fn summary_file(treatment: Pass) -> String {
    if treatment == Pass::Refeed {
        SUMMARY.to_string()
    } else {
        format!("summary-{treatment}.parquet")
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Value {
    Str(String),
    U64(u64),
    OptU64(Option<u64>),
    F64(Option<f64>),
    ListF64(Vec<Option<f64>>),
    ListU64(Vec<u64>),
    ListStr(Vec<String>),
}

impl Value {
    fn type_name(&self) -> &'static str {
        match self {
            Value::Str(_) => "utf8",
            Value::U64(_) => "u64",
            Value::OptU64(_) => "u64?",
            Value::F64(_) => "f64?",
            Value::ListF64(_) => "list<f64?>",
            Value::ListU64(_) => "list<u64>",
            Value::ListStr(_) => "list<utf8>",
        }
    }
}

struct Cell {
    name: String,
    doc: String,
    value: Value,
}

#[derive(Default)]
struct Row(Vec<Cell>);

impl Row {
    fn put(&mut self, name: impl Into<String>, doc: impl Into<String>, value: Value) {
        self.0.push(Cell {
            name: name.into(),
            doc: doc.into(),
            value,
        });
    }
    fn s(&mut self, n: &str, d: &str, v: &str) {
        self.put(n, d, Value::Str(v.to_string()));
    }
    fn u(&mut self, n: impl Into<String>, d: impl Into<String>, v: usize) {
        self.put(n, d, Value::U64(v as u64));
    }
    fn f(&mut self, n: impl Into<String>, d: impl Into<String>, v: Option<f64>) {
        self.put(n, d, Value::F64(v));
    }
}

fn boot(ci: Option<BootstrapCi>) -> (Option<f64>, Option<f64>) {
    ci.map_or((None, None), |c| (Some(c.lo), Some(c.hi)))
}

fn comparison(row: &mut Row, c: &Comparison) {
    let p = c.pass.as_str();
    let vs = format!("exact vs {p}");
    row.u(
        format!("{p}_n_eligible"),
        format!("{vs}: eligible estimates under this conditioning"),
        c.n_eligible,
    );
    row.u(
        format!("{p}_n_problems"),
        format!("{vs}: problems with an eligible estimate"),
        c.n_problems,
    );
    row.u(
        format!("{p}_n_disagree"),
        format!("{vs}: eligible estimates with Â_exact ≠ Â_{p}"),
        c.n_disagree,
    );
    let rate_doc = if c.pass == Pass::Replica {
        "the replica floor: n_disagree / n_eligible (null if nothing is eligible)".to_string()
    } else {
        format!("{vs}: n_disagree / n_eligible (null if nothing is eligible)")
    };
    row.f(format!("{p}_rate"), rate_doc, c.rate);
    let (lo, hi) = boot(c.rate_ci);
    row.f(
        format!("{p}_rate_lo"),
        format!("{vs}: cluster-bootstrap percentile CI of the rate, lower"),
        lo,
    );
    row.f(format!("{p}_rate_hi"), "… upper", hi);
    row.f(
        format!("{p}_rate_p"),
        format!("{vs}: percentile-bootstrap p-value of rate = 0 from the same replicates"),
        c.rate_p,
    );
    row.u(
        format!("{p}_zero_boundary"),
        format!("{vs}: disagreements where exactly one estimate is 0"),
        c.classes.zero_boundary,
    );
    row.u(
        format!("{p}_polarity_reversal"),
        format!("{vs}: disagreements of opposite non-zero sign"),
        c.classes.polarity_reversal,
    );
    row.u(
        format!("{p}_magnitude"),
        format!("{vs}: disagreements of equal non-zero sign"),
        c.classes.magnitude,
    );
    for (i, class) in ["zero_boundary", "polarity_reversal", "magnitude"]
        .iter()
        .enumerate()
    {
        let b = c.class_shares[i];
        row.f(
            format!("{p}_{class}_share"),
            format!("{vs}: {p}_{class} / n_disagree (null without disagreements)"),
            b.map(|b| b.estimate),
        );
        row.f(
            format!("{p}_{class}_share_lo"),
            format!("{vs}: cluster-bootstrap percentile CI of {p}_{class}_share (problems resampled, numerator and denominator recomputed), lower"),
            b.map(|b| b.ci.lo),
        );
        row.f(
            format!("{p}_{class}_share_hi"),
            "… upper",
            b.map(|b| b.ci.hi),
        );
    }
    row.f(
        format!("{p}_zero_boundary_share_p"),
        format!("{vs}: percentile-bootstrap p-value of {p}_zero_boundary_share = 1/2 (\"mostly zero-boundary\")"),
        c.class_shares[0].map(|b| b.p_value),
    );
    mean_diff_columns(row, c, &vs);
    jaccard_columns(row, c, &vs);
}

/// The mean-zero check of one comparison: mean difference, its intervals, t and TOST p.
fn mean_diff_columns(row: &mut Row, c: &Comparison, vs: &str) {
    let p = c.pass.as_str();
    let md = c.mean_diff.as_ref();
    row.f(
        format!("{p}_mean_diff"),
        format!(
            "{vs}: mean over problems of the per-problem mean of Â_{p} − Â_exact (mean-zero check)"
        ),
        md.map(|m| m.t_test.estimate),
    );
    let t_ci = md.and_then(|m| m.t_ci);
    row.f(
        format!("{p}_mean_diff_t_lo"),
        format!("{vs}: cluster-mean t CI of mean_diff, lower"),
        t_ci.map(|c| c.0),
    );
    row.f(format!("{p}_mean_diff_t_hi"), "… upper", t_ci.map(|c| c.1));
    let (lo, hi) = boot(md.and_then(|m| m.bootstrap_ci));
    row.f(
        format!("{p}_mean_diff_boot_lo"),
        format!("{vs}: cluster-bootstrap CI of mean_diff, lower"),
        lo,
    );
    row.f(format!("{p}_mean_diff_boot_hi"), "… upper", hi);
    row.f(
        format!("{p}_mean_diff_p"),
        format!(
            "{vs}: two-sided cluster-mean t p-value of mean_diff = 0 (null if se is 0 or G < 2)"
        ),
        md.and_then(|m| m.t_test.p_value),
    );
    row.f(
        format!("{p}_mean_diff_tost_p"),
        format!("{vs}: TOST p-value of |mean_diff| < equivalence_margin (max of the two one-sided t p-values; equivalence shown when below 1 − level; null if G < 2)"),
        c.equivalence.map(|e| e.p_value),
    );
}

/// The critical-set Jaccard of one comparison per τ, its interval and the set sizes.
fn jaccard_columns(row: &mut Row, c: &Comparison, vs: &str) {
    let p = c.pass.as_str();
    let j = &c.jaccard;
    row.put(
        format!("{p}_jaccard"),
        format!("{vs}: Jaccard of the critical sets C(tau) = {{|Â| ≥ tau}} over every complete key, the same under both conditionings (null for an empty union)"),
        Value::ListF64(j.iter().map(|x| x.result.value).collect()),
    );
    row.put(
        format!("{p}_jaccard_lo"),
        format!("{vs}: cluster-bootstrap CI of the Jaccard over every problem, lower (null if no replicate had a non-empty union)"),
        Value::ListF64(j.iter().map(|x| x.ci.map(|c| c.lo)).collect()),
    );
    row.put(
        format!("{p}_jaccard_hi"),
        "… upper",
        Value::ListF64(j.iter().map(|x| x.ci.map(|c| c.hi)).collect()),
    );
    let sizes = |f: &dyn Fn(&crate::stats::JaccardResult) -> usize| {
        Value::ListU64(j.iter().map(|x| f(&x.result) as u64).collect())
    };
    row.put(
        format!("{p}_crit_exact"),
        format!("{vs}: |C_exact(tau)| over every complete key"),
        sizes(&|r| r.size_a),
    );
    row.put(
        format!("{p}_crit_{p}"),
        format!("{vs}: |C_{p}(tau)| over every complete key"),
        sizes(&|r| r.size_b),
    );
    row.put(
        format!("{p}_crit_intersection"),
        format!("{vs}: |C_exact ∩ C_{p}|"),
        sizes(&|r| r.intersection),
    );
    row.put(
        format!("{p}_crit_union"),
        format!("{vs}: |C_exact ∪ C_{p}|"),
        sizes(&|r| r.union),
    );
    row.put(
        format!("{p}_crit_ineligible"),
        format!("{vs}: keys of C_exact ∪ C_{p} outside this conditioning's eligible set (0 under any_informative; under treatment_independent the critical keys with exact uninformative, kept in the sets)"),
        Value::ListU64(j.iter().map(|x| x.n_ineligible as u64).collect()),
    );
}

fn t_test(row: &mut Row, prefix: &str, what: &str, t: Option<&TTest>) {
    row.f(
        format!("{prefix}_se"),
        format!("{what}: standard error (0 when the problems show no spread; null if G < 2)"),
        t.and_then(|t| t.se),
    );
    row.f(
        format!("{prefix}_t"),
        format!("{what}: t statistic (null if se is 0 or null)"),
        t.and_then(|t| t.t),
    );
    row.put(
        format!("{prefix}_df"),
        format!("{what}: degrees of freedom, G − 1"),
        Value::OptU64(t.map(|t| t.df as u64)),
    );
    row.f(
        format!("{prefix}_p"),
        format!("{what}: two-sided p-value, Student t with G − 1 df"),
        t.and_then(|t| t.p_value),
    );
}

fn summary_row(s: &ConfigSummary, r: &ConditioningSummary, opts: &AnalyzeOptions) -> Row {
    let mut row = Row::default();
    config_columns(&mut row, s, r);
    comparison(&mut row, &r.replica);
    comparison(&mut row, &r.treatment);
    ceiling_gap_and_token_columns(&mut row, s);
    factorial_columns(&mut row, s, r);
    excess_columns(&mut row, s, r);
    paired_columns(&mut row, s, r);
    cost_and_output_columns(&mut row, s);
    settings_columns(&mut row, opts);
    row
}

/// The configuration, its conditioning and its counts of problems, keys and snapshot checks.
fn config_columns(row: &mut Row, s: &ConfigSummary, r: &ConditioningSummary) {
    let m = &s.meta;
    row.s("config", "configuration label (campaign name)", &m.config);
    row.s("model", "model label", &m.model);
    row.s("dtype", "dtype label", &m.dtype);
    row.s(
        "policy",
        "execution policy: stock | batch_invariant",
        &m.policy,
    );
    row.s(
        "replica_schedule",
        "replica batch schedule from the manifest: same | shuffled",
        &m.replica_schedule,
    );
    row.s(
        "treatment",
        "the pass compared with exact against the replica floor: refeed (summary.parquet) | spectrum (summary-spectrum.parquet); its columns carry its name as prefix",
        s.treatment.as_str(),
    );
    row.s(
        "conditioning",
        "any_informative (eligible if either compared pass is informative) | treatment_independent (eligible iff exact is informative)",
        r.conditioning.as_str(),
    );
    row.u("k", "continuations per branch and pass (K)", m.k as usize);
    row.u(
        "n_runs",
        "run dirs merged into this configuration",
        m.run_dirs.len(),
    );
    row.u(
        "n_problems",
        "problems with a complete estimate",
        m.n_problems,
    );
    row.u(
        "n_keys",
        "complete estimates: (problem, pivot_pos, alt_rank) with exact, replica and the treatment",
        m.n_keys,
    );
    row.u(
        "n_incomplete",
        "estimate keys lacking a pass (left out of every number)",
        m.n_incomplete,
    );
    row.put(
        "snapshot_checks",
        "exact/replica resumes whose KV fingerprint was checked (manifest, summed)",
        Value::U64(m.snapshot_checks),
    );
    row.put(
        "snapshot_hits",
        "checks that matched (manifest, summed)",
        Value::U64(m.snapshot_hits),
    );
    row.f(
        "snapshot_hit_rate",
        "snapshot_hits / snapshot_checks (null without checks)",
        m.snapshot_hit_rate(),
    );
}

/// The ceiling gap (replica − treatment Jaccard) per τ, the floor's status, and each pass's
/// token identity with exact.
fn ceiling_gap_and_token_columns(row: &mut Row, s: &ConfigSummary) {
    let (m, t) = (&s.meta, s.treatment.as_str());
    let gap = &s.ceiling_gap;
    row.put(
        "ceiling_gap",
        format!("replica_jaccard − {t}_jaccard per tau (null for an empty union)"),
        Value::ListF64(gap.iter().map(|g| g.and_then(|g| g.estimate)).collect()),
    );
    row.put(
        "ceiling_gap_lo",
        "paired cluster-bootstrap percentile CI of ceiling_gap (both Jaccards recomputed on each resample), lower",
        Value::ListF64(gap.iter().map(|g| g.map(|g| g.ci.lo)).collect()),
    );
    row.put(
        "ceiling_gap_hi",
        "… upper",
        Value::ListF64(gap.iter().map(|g| g.map(|g| g.ci.hi)).collect()),
    );
    row.put(
        "ceiling_gap_p",
        "two-sided percentile-bootstrap p-value of ceiling_gap = 0 from the same replicates",
        Value::ListF64(gap.iter().map(|g| g.map(|g| g.p_value)).collect()),
    );
    row.s(
        "replica_floor_status",
        "what the replica floor measured, from token identity: measured | structural_zero (every replica continuation token-identical to exact's without asking for it: excess not measurable) | same_schedule_control | batch_invariant_control | not_recorded",
        m.floor_status().as_str(),
    );
    for pass in Pass::ALL.into_iter().filter(|&p| p != Pass::Exact) {
        let p = pass.as_str();
        let n = m.token_identity.get(&pass);
        row.put(
            format!("token_identical_{p}"),
            format!("{p}: continuations whose token ids equal exact's at the same (problem, pivot_pos, alt_rank, branch, sample) (null if none joined)"),
            Value::OptU64(n.map(|n| n.identical)),
        );
        row.put(
            format!("token_compared_{p}"),
            format!("{p}: continuations joined to an exact continuation"),
            Value::OptU64(n.map(|n| n.total)),
        );
        row.f(
            format!("token_identical_share_{p}"),
            format!("{p}: token_identical_{p} / token_compared_{p}"),
            n.and_then(|n| n.share()),
        );
    }
}

/// The state × schedule factorial (refeed/spectrum treatments with a `_replica` twin).
fn factorial_columns(row: &mut Row, s: &ConfigSummary, r: &ConditioningSummary) {
    let t = s.treatment.as_str();
    let fr = s.factorial.as_ref().and_then(|f| {
        f.rows
            .iter()
            .find(|x| x.conditioning == r.conditioning)
            .map(|x| (f, x))
    });
    row.put(
        "factorial_n_keys",
        format!("state × schedule (refeed/spectrum treatments with a _replica twin, else null): keys with exact, replica, {t} and its twin"),
        Value::OptU64(fr.map(|(f, _)| f.n_keys as u64)),
    );
    for (i, cell) in ["replica", "state", "twin"].iter().enumerate() {
        let b = fr.and_then(|(_, x)| x.cells[i].rate);
        row.f(
            format!("factorial_{cell}_rate"),
            format!("state × schedule: exact≠{cell} rate over the four-pass keys (replica: schedule effect; state: {t}, the state effect; twin: {t} under the replica's schedule)"),
            b.map(|b| b.estimate),
        );
        row.f(
            format!("factorial_{cell}_rate_lo"),
            "… its cluster-bootstrap percentile CI, lower",
            b.map(|b| b.ci.lo),
        );
        row.f(
            format!("factorial_{cell}_rate_hi"),
            "… upper",
            b.map(|b| b.ci.hi),
        );
    }
    for (name, doc, pick) in [
        (
            "factorial_excess",
            "state × schedule: twin rate − replica rate (the state effect plus the interaction)",
            0usize,
        ),
        (
            "factorial_interaction",
            "state × schedule: twin rate − state rate − replica rate",
            1,
        ),
    ] {
        let e = fr.map(|(_, x)| if pick == 0 { x.excess } else { x.interaction });
        row.f(name, doc, e.and_then(|e| e.estimate));
        row.f(
            format!("{name}_lo"),
            "… cluster-bootstrap percentile CI (every rate recomputed per resample), lower",
            e.and_then(|e| e.ci.map(|c| c.lo)),
        );
        row.f(
            format!("{name}_hi"),
            "… upper",
            e.and_then(|e| e.ci.map(|c| c.hi)),
        );
    }
}

/// The excess over the replica floor with its t test and bootstrap.
fn excess_columns(row: &mut Row, s: &ConfigSummary, r: &ConditioningSummary) {
    let t = s.treatment.as_str();
    let e = r.excess.as_ref();
    row.f(
        "excess",
        format!("{t}_rate − replica_rate, each over its own eligible set (the two sets coincide under treatment_independent)"),
        e.map(|e| e.estimate),
    );
    row.u(
        "excess_n",
        "estimates eligible for either comparison (the rows the excess's inference resamples)",
        e.map_or(0, |e| e.n),
    );
    row.u(
        "excess_n_problems",
        "problems of excess_n (G of the excess's t)",
        e.map_or(0, |e| e.n_problems),
    );
    t_test(
        row,
        "excess",
        "linearized CR1 t test of the excess (delta method of the two ratio estimators; equals paired_cr1 under treatment_independent)",
        e.map(|e| &e.t_test),
    );
    let eb = e.and_then(|e| e.bootstrap);
    row.f(
        "excess_boot_lo",
        "cluster-bootstrap percentile CI of the excess, both eligible sets recomputed per replicate, lower",
        eb.map(|b| b.ci.lo),
    );
    row.f("excess_boot_hi", "… upper", eb.map(|b| b.ci.hi));
    row.f(
        "excess_boot_p",
        "two-sided percentile-bootstrap p-value of excess = 0 from the same replicates: min(1, 2·min(#≤0, #≥0)/valid)",
        eb.map(|b| b.p_value),
    );
    row.put(
        "excess_boot_valid",
        "replicates of that bootstrap with both eligible sets non-empty (the others are dropped)",
        Value::OptU64(eb.map(|b| b.ci.valid_reps as u64)),
    );
}

/// The paired differences D_j (cluster-mean and CR1 t tests) and the both-eligible
/// sensitivity.
fn paired_columns(row: &mut Row, s: &ConfigSummary, r: &ConditioningSummary) {
    let t = s.treatment.as_str();
    let p = r.paired.as_ref();
    row.u(
        "paired_n",
        format!("estimates in the paired set of D_j = 1[exact≠{t}] − 1[exact≠replica]: union of the two eligible sets (any_informative) or exact informative (treatment_independent)"),
        p.map_or(0, |p| p.n),
    );
    row.u(
        "paired_n_problems",
        "problems in the paired set (G)",
        p.map_or(0, |p| p.n_problems),
    );
    row.f(
        "paired_mean",
        "D̄: pooled mean of D_j over the paired set (the CR1 estimate; not the excess under any_informative)",
        p.map(|p| p.mean),
    );
    let (lo, hi) = boot(p.and_then(|p| p.bootstrap_ci));
    row.f(
        "paired_boot_lo",
        "cluster-bootstrap percentile CI of paired_mean, lower",
        lo,
    );
    row.f("paired_boot_hi", "… upper", hi);
    row.f(
        "paired_cm_estimate",
        "cluster-mean t test of D_j: its estimate, the mean over problems of the per-problem mean of D_j",
        p.map(|p| p.cluster_mean.estimate),
    );
    t_test(
        row,
        "paired_cm",
        "cluster-mean t test of paired_cm_estimate",
        p.map(|p| &p.cluster_mean),
    );
    t_test(
        row,
        "paired_cr1",
        "CR1 t test of paired_mean",
        p.map(|p| &p.cr1),
    );
    let b = r.intersection.as_ref();
    row.put(
        "both_n",
        "any_informative only (else null): estimates eligible for both comparisons (sensitivity)",
        Value::OptU64(b.map(|b| b.n as u64)),
    );
    row.f(
        "both_mean",
        "pooled mean of D_j over both_n (sensitivity)",
        b.map(|b| b.mean),
    );
    row.f(
        "both_cr1_t",
        "CR1 t of D_j over both_n (sensitivity)",
        b.and_then(|b| b.cr1.t),
    );
    row.f(
        "both_cr1_p",
        "CR1 p-value of D_j over both_n (sensitivity)",
        b.and_then(|b| b.cr1.p_value),
    );
}

/// The τ grid, the manifests' costs per pass and in total, and the output counts per pass.
fn cost_and_output_columns(row: &mut Row, s: &ConfigSummary) {
    let m = &s.meta;
    row.put(
        "tau",
        "critical-set thresholds m/K, m = 1..K (the index of every list column)",
        Value::ListF64(s.taus.iter().map(|&t| Some(t)).collect()),
    );
    let mut total = (0.0, 0u64, 0u64);
    for c in m.cost.values() {
        total.0 += c.device_seconds;
        total.1 += c.tokens;
        total.2 += c.continuations;
    }
    for pass in Pass::ALL {
        let c = m.cost.get(pass.as_str());
        let p = pass.as_str();
        row.f(
            format!("cost_{p}_device_seconds"),
            format!("manifest cost.{p}.device_seconds (null if absent)"),
            c.map(|c| c.device_seconds),
        );
        row.put(
            format!("cost_{p}_tokens"),
            format!("manifest cost.{p}.tokens"),
            Value::OptU64(c.map(|c| c.tokens)),
        );
        row.put(
            format!("cost_{p}_continuations"),
            format!("manifest cost.{p}.continuations"),
            Value::OptU64(c.map(|c| c.continuations)),
        );
    }
    let rules: std::collections::BTreeSet<&String> = m
        .outputs
        .values()
        .filter_map(|o| o.rules.as_ref())
        .flat_map(|r| r.keys())
        .collect();
    row.put(
        "extraction_rules",
        "extraction_rule values seen in continuations/rollouts, sorted (the index of every rule_counts_* column; empty if no file has the column)",
        Value::ListStr(rules.iter().map(|r| r.to_string()).collect()),
    );
    for label in Pass::ALL.iter().map(|p| p.as_str()).chain([ROLLOUT]) {
        let o = m.outputs.get(label);
        let what = if label == ROLLOUT {
            "rollouts"
        } else {
            "continuations"
        };
        row.put(
            format!("n_texts_{label}"),
            format!("{label}: {what} read (null if none)"),
            Value::OptU64(o.map(|o| o.rows)),
        );
        row.put(
            format!("n_truncated_{label}"),
            format!("{label}: {what} with stop = length (hit the token cap)"),
            Value::OptU64(o.map(|o| o.truncated)),
        );
        row.put(
            format!("rule_counts_{label}"),
            format!("{label}: {what} per extraction rule, indexed like extraction_rules"),
            Value::ListU64(
                rules
                    .iter()
                    .map(|r| {
                        o.and_then(|o| o.rules.as_ref())
                            .and_then(|m| m.get(*r))
                            .copied()
                            .unwrap_or(0)
                    })
                    .collect(),
            ),
        );
    }
    row.f(
        "cost_total_device_seconds",
        "sum over every pass in the manifest's cost map (including e.g. rollout)",
        Some(total.0),
    );
    row.put("cost_total_tokens", "… tokens", Value::U64(total.1));
    row.put(
        "cost_total_continuations",
        "… continuations",
        Value::U64(total.2),
    );
}

/// The analysis settings: bootstrap replicates and seed, level, equivalence margin.
fn settings_columns(row: &mut Row, opts: &AnalyzeOptions) {
    row.put(
        "boot_reps",
        "cluster-bootstrap replicates per statistic",
        Value::U64(opts.reps as u64),
    );
    row.put(
        "boot_seed",
        "seed of every bootstrap",
        Value::U64(opts.seed),
    );
    row.f(
        "level",
        "confidence level of every interval",
        Some(opts.level),
    );
    row.f(
        "equivalence_margin",
        "margin of the mean-zero equivalence test (TOST), on the Â scale",
        Some(opts.equivalence_margin),
    );
}

fn rows(summaries: &[ConfigSummary], opts: &AnalyzeOptions) -> Vec<Row> {
    summaries
        .iter()
        .flat_map(|s| s.rows.iter().map(move |r| summary_row(s, r, opts)))
        .collect()
}

fn arrow_type(v: &Value) -> (DataType, bool) {
    let item = |t| DataType::List(Arc::new(Field::new("item", t, true)));
    match v {
        Value::Str(_) => (DataType::Utf8, false),
        Value::U64(_) => (DataType::UInt64, false),
        Value::OptU64(_) => (DataType::UInt64, true),
        Value::F64(_) => (DataType::Float64, true),
        Value::ListF64(_) => (item(DataType::Float64), false),
        Value::ListU64(_) => (item(DataType::UInt64), false),
        Value::ListStr(_) => (item(DataType::Utf8), false),
    }
}

fn column(rows: &[Row], j: usize) -> ArrayRef {
    let vals = rows.iter().map(|r| &r.0[j].value);
    match &rows[0].0[j].value {
        Value::Str(_) => Arc::new(StringArray::from_iter_values(vals.map(|v| match v {
            Value::Str(s) => s.as_str(),
            _ => unreachable!("column types are fixed by summary_row"),
        }))),
        Value::U64(_) | Value::OptU64(_) => {
            Arc::new(UInt64Array::from_iter(vals.map(|v| match v {
                Value::U64(x) => Some(*x),
                Value::OptU64(x) => *x,
                _ => unreachable!("column types are fixed by summary_row"),
            })))
        }
        Value::F64(_) => Arc::new(Float64Array::from_iter(vals.map(|v| match v {
            Value::F64(x) => *x,
            _ => unreachable!("column types are fixed by summary_row"),
        }))),
        Value::ListF64(_) => {
            let mut b = ListBuilder::new(Float64Builder::new());
            for v in vals {
                if let Value::ListF64(xs) = v {
                    b.values().extend(xs.iter().copied());
                }
                b.append(true);
            }
            Arc::new(b.finish())
        }
        Value::ListU64(_) => {
            let mut b = ListBuilder::new(UInt64Builder::new());
            for v in vals {
                if let Value::ListU64(xs) = v {
                    b.values().extend(xs.iter().map(|&x| Some(x)));
                }
                b.append(true);
            }
            Arc::new(b.finish())
        }
        Value::ListStr(_) => {
            let mut b = ListBuilder::new(StringBuilder::new());
            for v in vals {
                if let Value::ListStr(xs) = v {
                    for x in xs {
                        b.values().append_value(x);
                    }
                }
                b.append(true);
            }
            Arc::new(b.finish())
        }
    }
}

/// The summary as one Arrow record batch.
pub fn summary_batch(summaries: &[ConfigSummary], opts: &AnalyzeOptions) -> Result<RecordBatch> {
    let rows = rows(summaries, opts);
    let first = rows
        .first()
        .ok_or_else(|| Error::Output("summary: no configuration to write".into()))?;
    let fields: Vec<Field> = first
        .0
        .iter()
        .map(|c| {
            let (t, nullable) = arrow_type(&c.value);
            Field::new(c.name.clone(), t, nullable)
        })
        .collect();
    let columns: Vec<ArrayRef> = (0..first.0.len()).map(|j| column(&rows, j)).collect();
    RecordBatch::try_new(Arc::new(Schema::new(fields)), columns)
        .map_err(|e| Error::Output(format!("summary: {e}")))
}

/// Write a summary table (Snappy-compressed); all `summaries` must share one treatment.
pub fn write_summary(
    summaries: &[ConfigSummary],
    opts: &AnalyzeOptions,
    path: &Path,
) -> Result<()> {
    if let Some(s) = summaries
        .iter()
        .find(|s| s.treatment != summaries[0].treatment)
    {
        return Err(Error::Output(format!(
            "summary: one table holds one treatment ({} and {})",
            summaries[0].treatment, s.treatment
        )));
    }
    let batch = summary_batch(summaries, opts)?;
    let file = File::create(path).map_err(|e| Error::io(path, e))?;
    let props = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .build();
    let err = |e: parquet::errors::ParquetError| Error::Output(format!("{}: {e}", path.display()));
    let mut w = ArrowWriter::try_new(file, batch.schema(), Some(props)).map_err(err)?;
    w.write(&batch).map_err(err)?;
    w.close().map_err(err)?;
    Ok(())
}

/// The schema of `summary.parquet` as a Markdown section (name, type, meaning), generated
/// from the same declarations that write it. `?` marks a nullable column.
pub fn schema_markdown(summaries: &[ConfigSummary], opts: &AnalyzeOptions) -> String {
    let mut out = String::from(
        "### `summary.parquet`\n\n\
         Written by `kvcredit analyze` next to `report.md`: one row per configuration \
         (`config` label) × conditioning (`any_informative`, `treatment_independent`) for the \
         refeed treatment. Configurations that ran the spectrum pass get \
         `summary-spectrum.parquet` as well: the same columns with `treatment = spectrum` and \
         the `refeed_*` columns named `spectrum_*` (exact vs the spectrum pass, against the same \
         replica floor). \
         Rates and means are fractions (not percent). List columns are indexed like `tau`. \
         Estimates are recomputed from the counts, `Â = (orig_successes − alt_successes)/k`. \
         `?` marks a nullable column.\n\n\
         | column | type | meaning |\n| --- | --- | --- |\n",
    );
    if let Some(row) = rows(summaries, opts).first() {
        for c in &row.0 {
            out.push_str(&format!(
                "| `{}` | {} | {} |\n",
                c.name,
                c.value.type_name(),
                c.doc.replace('|', "\\|")
            ));
        }
    }
    out
}
