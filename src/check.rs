//! `kvcredit check RUN_DIR`: the CI gate on a campaign's invariants (design invariants 1, 3
//! and 4, plus the structure the analysis relies on).
//!
//! Rules, each reported with the offending rows named by
//! `(problem, pivot_pos, alt_rank, pass)`:
//! - `snapshot-hit-rate`: the manifest's snapshot hit rate is below 100% (or no exact/replica
//!   resume was checked although there are exact/replica rows);
//! - `snapshot-verified`: an exact or replica estimate row has `snapshot_verified = false`;
//! - `complete`: every estimate key has exactly one row per pass, every continuation key one
//!   row per pass;
//! - `consistent`: `estimate` equals `(orig_successes − alt_successes)/k` (to 1e-12),
//!   `informative` equals "the 2K outcomes are not all equal", `k` equals the manifest's, and
//!   the successes equal the count of correct continuations of each branch (K of each);
//! - `replica-same` (only when `replica_schedule == "same"`): every replica estimate and
//!   continuation equals the exact one (invariant 3);
//! - `batch-invariant` (only when `policy == "batch_invariant"`): every replica and refeed
//!   estimate and continuation equals the exact one (invariant 4).
//!
//! A file that cannot be read is an error; violations are data ([`CheckReport`]).
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use crate::Result;
use crate::analysis::read::{
    self, ContinuationRow, EstimateRow, Key, Manifest, Pass, read_continuations, read_estimates,
    read_manifest,
};

/// A `kvcredit check` rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Rule {
    /// Manifest snapshot hit rate is 100%.
    SnapshotHitRate,
    /// Every exact/replica row was verified against its decode-time fingerprint.
    SnapshotVerified,
    /// One row per pass for every key.
    Complete,
    /// Written columns agree with the counts and the continuations.
    Consistent,
    /// Same-schedule replica is identical to exact.
    ReplicaSame,
    /// Batch-invariant policy: every pass is identical to exact.
    BatchInvariant,
}

impl Rule {
    /// The rule's name in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Rule::SnapshotHitRate => "snapshot-hit-rate",
            Rule::SnapshotVerified => "snapshot-verified",
            Rule::Complete => "complete",
            Rule::Consistent => "consistent",
            Rule::ReplicaSame => "replica-same",
            Rule::BatchInvariant => "batch-invariant",
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One offending row (or the manifest) and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The rule broken.
    pub rule: Rule,
    /// Where: `manifest`, `estimate problem=.. pivot_pos=.. alt_rank=.. pass=..` or
    /// `continuation problem=.. pivot_pos=.. alt_rank=.. pass=.. branch=.. sample=..`.
    pub row: String,
    /// What differs.
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.rule, self.row, self.detail)
    }
}

/// The outcome of checking one run dir.
#[derive(Debug, Clone)]
pub struct CheckReport {
    /// The run dir.
    pub dir: PathBuf,
    /// Estimate rows read.
    pub n_estimates: usize,
    /// Continuation rows read.
    pub n_continuations: usize,
    /// Rules that applied to this run (policy and schedule decide the last two).
    pub rules: Vec<Rule>,
    /// Every violation found, in rule order.
    pub violations: Vec<Violation>,
}

impl CheckReport {
    /// No rule was violated.
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }

    /// Rules with at least one violation, with counts.
    pub fn violated(&self) -> Vec<(Rule, usize)> {
        let mut m: BTreeMap<Rule, usize> = BTreeMap::new();
        for v in &self.violations {
            *m.entry(v.rule).or_default() += 1;
        }
        m.into_iter().collect()
    }

    /// One line: passed with counts, or failed with the violated rules.
    pub fn summary_line(&self) -> String {
        let rules: Vec<&str> = self.rules.iter().map(|r| r.as_str()).collect();
        if self.passed() {
            format!(
                "check passed: {}: {} estimates, {} continuations; rules: {}",
                self.dir.display(),
                self.n_estimates,
                self.n_continuations,
                rules.join(", ")
            )
        } else {
            let v: Vec<String> = self
                .violated()
                .iter()
                .map(|(r, n)| format!("{r} ×{n}"))
                .collect();
            format!(
                "check failed: {}: {} violation(s): {}",
                self.dir.display(),
                self.violations.len(),
                v.join(", ")
            )
        }
    }
}

fn est_row(k: &Key, pass: Pass) -> String {
    format!("estimate {k} pass={pass}")
}

type ContKey = (u32, u32, u32, String, u32);

fn cont_row(k: &ContKey, pass: Pass) -> String {
    format!(
        "continuation problem={} pivot_pos={} alt_rank={} pass={pass} branch={} sample={}",
        k.0, k.1, k.2, k.3, k.4
    )
}

struct Checker<'a> {
    manifest: &'a Manifest,
    est: BTreeMap<Key, [Vec<&'a EstimateRow>; 3]>,
    cont: BTreeMap<ContKey, [Vec<&'a ContinuationRow>; 3]>,
    out: Vec<Violation>,
}

impl Checker<'_> {
    fn push(&mut self, rule: Rule, row: String, detail: impl Into<String>) {
        self.out.push(Violation {
            rule,
            row,
            detail: detail.into(),
        });
    }

    fn snapshot(&mut self, rows: &[EstimateRow]) {
        let m = self.manifest;
        let resumed = rows.iter().any(|r| r.pass != Pass::Refeed);
        if m.snapshot_hits > m.snapshot_checks {
            self.push(
                Rule::SnapshotHitRate,
                "manifest".into(),
                format!(
                    "snapshot_hits {} > snapshot_checks {}",
                    m.snapshot_hits, m.snapshot_checks
                ),
            );
        } else if m.snapshot_hits < m.snapshot_checks
            || m.snapshot_hit_rate.is_some_and(|r| r < 1.0)
        {
            self.push(
                Rule::SnapshotHitRate,
                "manifest".into(),
                format!(
                    "snapshot hit rate {} ({}/{}), must be 100%",
                    m.snapshot_hit_rate
                        .map_or_else(|| "—".into(), |r| format!("{:.4}%", 100.0 * r)),
                    m.snapshot_hits,
                    m.snapshot_checks
                ),
            );
        } else if m.snapshot_checks == 0 && resumed {
            self.push(
                Rule::SnapshotHitRate,
                "manifest".into(),
                "no snapshot fingerprint was checked but there are exact/replica rows",
            );
        }
        for r in rows {
            if r.pass != Pass::Refeed && !r.snapshot_verified {
                self.push(
                    Rule::SnapshotVerified,
                    est_row(&r.key(), r.pass),
                    "snapshot_verified = false",
                );
            }
        }
    }

    fn complete(&mut self) {
        let mut found = Vec::new();
        for (k, by_pass) in &self.est {
            for p in Pass::ALL {
                match by_pass[p as usize].len() {
                    1 => {}
                    0 => found.push((est_row(k, p), "missing".to_string())),
                    n => found.push((est_row(k, p), format!("{n} rows"))),
                }
            }
        }
        for (k, by_pass) in &self.cont {
            for p in Pass::ALL {
                match by_pass[p as usize].len() {
                    1 => {}
                    0 => found.push((cont_row(k, p), "missing".to_string())),
                    n => found.push((cont_row(k, p), format!("{n} rows"))),
                }
            }
        }
        for (row, d) in found {
            self.push(Rule::Complete, row, d);
        }
    }

    fn consistent(&mut self, rows: &[EstimateRow], conts: &[ContinuationRow]) {
        let mk = self.manifest.k;
        // (problem, pivot_pos, alt_rank, pass) -> (samples, correct)
        let mut tally: BTreeMap<(u32, u32, u32, Pass), (u32, u32)> = BTreeMap::new();
        for c in conts {
            let t = tally
                .entry((c.problem, c.pivot_pos, c.alt_rank, c.pass))
                .or_default();
            t.0 += 1;
            t.1 += u32::from(c.correct);
        }
        for r in rows {
            let row = est_row(&r.key(), r.pass);
            let mut bad = Vec::new();
            if r.k != mk {
                bad.push(format!("k = {} but the manifest says {mk}", r.k));
            }
            if (r.estimate - r.a_hat()).abs() > 1e-12 || !r.estimate.is_finite() {
                bad.push(format!(
                    "estimate {} ≠ ({} − {})/{}",
                    r.estimate, r.orig_successes, r.alt_successes, r.k
                ));
            }
            if r.informative != r.is_informative() {
                bad.push(format!(
                    "informative = {} but successes are {}/{} of k = {}",
                    r.informative, r.orig_successes, r.alt_successes, r.k
                ));
            }
            for (branch, rank, succ) in [
                ("orig", 0, r.orig_successes),
                ("alt", r.alt_rank, r.alt_successes),
            ] {
                let (n, c) = tally
                    .get(&(r.problem, r.pivot_pos, rank, r.pass))
                    .copied()
                    .unwrap_or((0, 0));
                if n != r.k || c != succ {
                    bad.push(format!(
                        "{branch}_successes = {succ} of k = {} but continuations have {c} correct of {n}",
                        r.k
                    ));
                }
            }
            if !bad.is_empty() {
                self.push(Rule::Consistent, row, bad.join("; "));
            }
        }
    }

    /// Rows of `pass` that differ from exact, under `rule`.
    fn identical(&mut self, rule: Rule, pass: Pass) {
        let mut found = Vec::new();
        for (k, by_pass) in &self.est {
            let (Some(e), Some(o)) = (
                by_pass[Pass::Exact as usize].first(),
                by_pass[pass as usize].first(),
            ) else {
                continue; // reported by `complete`
            };
            if e.orig_successes != o.orig_successes
                || e.alt_successes != o.alt_successes
                || e.estimate != o.estimate
                || e.informative != o.informative
            {
                found.push((
                    est_row(k, pass),
                    format!(
                        "estimate {} (orig/alt successes {}/{}) vs exact {} ({}/{})",
                        o.estimate,
                        o.orig_successes,
                        o.alt_successes,
                        e.estimate,
                        e.orig_successes,
                        e.alt_successes
                    ),
                ));
            }
        }
        for (k, by_pass) in &self.cont {
            let (Some(e), Some(o)) = (
                by_pass[Pass::Exact as usize].first(),
                by_pass[pass as usize].first(),
            ) else {
                continue;
            };
            let mut diff = Vec::new();
            if e.tokens != o.tokens {
                let at = e
                    .tokens
                    .iter()
                    .zip(&o.tokens)
                    .position(|(a, b)| a != b)
                    .unwrap_or_else(|| e.tokens.len().min(o.tokens.len()));
                diff.push(format!(
                    "tokens differ from exact at index {at} (lengths {} vs {})",
                    o.tokens.len(),
                    e.tokens.len()
                ));
            }
            if e.n_tokens != o.n_tokens {
                diff.push(format!("n_tokens {} vs {}", o.n_tokens, e.n_tokens));
            }
            if e.stop != o.stop {
                diff.push(format!("stop {} vs {}", o.stop, e.stop));
            }
            if e.answer != o.answer {
                let show =
                    |a: &Option<String>| a.as_deref().map_or("null".into(), |s| format!("{s:?}"));
                diff.push(format!("answer {} vs {}", show(&o.answer), show(&e.answer)));
            }
            if e.correct != o.correct {
                diff.push(format!("correct {} vs {}", o.correct, e.correct));
            }
            if !diff.is_empty() {
                found.push((cont_row(k, pass), diff.join("; ")));
            }
        }
        for (row, d) in found {
            self.push(rule, row, d);
        }
    }
}

/// Check a run dir against every rule that applies to it.
pub fn check_run(dir: &Path) -> Result<CheckReport> {
    let manifest = read_manifest(dir)?;
    let estimates = read_estimates(dir)?;
    let conts = read_continuations(dir)?;
    let mut ck = Checker {
        manifest: &manifest,
        est: BTreeMap::new(),
        cont: BTreeMap::new(),
        out: Vec::new(),
    };
    for r in &estimates {
        ck.est.entry(r.key()).or_default()[r.pass as usize].push(r);
    }
    for c in &conts {
        let k = (
            c.problem,
            c.pivot_pos,
            c.alt_rank,
            c.branch.clone(),
            c.sample,
        );
        ck.cont.entry(k).or_default()[c.pass as usize].push(c);
    }
    let mut rules = vec![
        Rule::SnapshotHitRate,
        Rule::SnapshotVerified,
        Rule::Complete,
        Rule::Consistent,
    ];
    ck.snapshot(&estimates);
    ck.complete();
    ck.consistent(&estimates, &conts);
    if manifest.replica_schedule == "same" {
        rules.push(Rule::ReplicaSame);
        ck.identical(Rule::ReplicaSame, Pass::Replica);
    }
    if read::is_batch_invariant(&manifest.policy) {
        rules.push(Rule::BatchInvariant);
        ck.identical(Rule::BatchInvariant, Pass::Replica);
        ck.identical(Rule::BatchInvariant, Pass::Refeed);
    }
    let mut violations = ck.out;
    violations.sort_by_key(|v| v.rule);
    if estimates.is_empty() {
        violations.push(Violation {
            rule: Rule::Complete,
            row: read::ESTIMATES.into(),
            detail: "no estimate rows".into(),
        });
    }
    Ok(CheckReport {
        dir: dir.to_path_buf(),
        n_estimates: estimates.len(),
        n_continuations: conts.len(),
        rules,
        violations,
    })
}
