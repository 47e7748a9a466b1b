//! `kvcredit check RUN_DIR`: the CI gate on a campaign's invariants (design invariants 1, 3
//! and 4, plus the structure the analysis relies on).
//!
//! Rules, each reported with the offending rows named by
//! `(problem, pivot_pos, alt_rank, pass)`:
//! - `snapshot-hit-rate`: the manifest's snapshot counters: hit rate 100%, `snapshot_checks`
//!   equal to the number of exact/replica continuations and `snapshot_checks_pivots` to the
//!   number of distinct (pivot, pass) among them, every check a hit;
//! - `snapshot-verified`: an exact or replica estimate or continuation row has
//!   `snapshot_verified = false` (or the continuations do not record it);
//! - `complete`: every estimate key has exactly one row per pass run, every continuation key
//!   one row per pass run;
//! - `counts`: the tables agree with each other and with the manifest: `problems_done ==
//!   problems_total`, one rollout row per finished problem, each rollout's `n_pivots` equal to
//!   its distinct pivots, the same (problem, pivot, alternative) keys in pivots and estimates,
//!   `(1 + alternatives) × k` continuations per pivot and pass (samples `0..k`), and the
//!   manifest's `cost.<pass>.continuations` equal to that pass's continuation rows;
//! - `placement`: every continuation records `chunk`, `row` and `batch_rows`, and each batch of
//!   a pass holds rows `0..batch_rows` once each, batches numbered `0..` per problem; in a
//!   refill run (`refill` in the manifest) each pass of a group is one queue: chunk 0 and one
//!   `batch_rows` throughout, rows `0..batch_rows` each used, and each row's `fill`s `0..n`
//!   once each;
//! - `consistent`: `estimate` equals `(orig_successes − alt_successes)/k` (to 1e-12),
//!   `informative` equals "the 2K outcomes are not all equal", `k` equals the manifest's, and
//!   the successes equal the count of correct continuations of each branch (K of each);
//! - `replica-same` (only when `replica_schedule == "same"`): every replica estimate and
//!   continuation equals the exact one, and ran in the same batch and row (invariant 3);
//! - `replica-grouping` (only when `replica_schedule == "shuffled"`): in no problem did the
//!   replica group the continuations into exact's batches (the same set of batch
//!   memberships, whatever the order), which would make the floor 0 by construction; in a
//!   refill run a pass's grouping is its set of row sequences (each row's continuations in
//!   `fill` order, whatever the row), and the replica's must differ from exact's;
//! - `replica-floor` (stock policy, `replica_schedule == "shuffled"`): not every replica
//!   continuation is token-identical to exact's. When all are, the replica exercised no
//!   numerical difference: its floor is a structural zero and every excess above it measures
//!   nothing (use `replica_schedule = "same"` for a bitwise control instead);
//! - `replica-path` (`replica_schedule == "shuffled"`, runs that record paths): not every
//!   replica continuation attended over exact's key axis at each of its steps (the engine did
//!   not equalize the two passes' numerical paths);
//! - `batch-invariant` (only when `policy == "batch_invariant"`): every replica and refeed (not
//!   spectrum: its resume is lossy by design)
//!   estimate and continuation equals the exact one (invariant 4).
//!
//! A file that cannot be read is an error; violations are data ([`CheckReport`]).
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use crate::Result;
use crate::analysis::identity::{FloorStatus, TokenIdentity};
use crate::analysis::read::{
    self, ContinuationRow, EstimateRow, Key, Manifest, Pass, PivotRow, RolloutRow,
    read_continuations, read_estimates, read_manifest, read_pivots, read_rollouts,
};
use crate::credit::schema::ReplicaSchedule;
use crate::exec::PolicyKind;

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
    /// Row counts agree across tables and with the manifest.
    Counts,
    /// Every continuation's batch placement is recorded and well-formed.
    Placement,
    /// Same-schedule replica is identical to exact.
    ReplicaSame,
    /// A shuffled replica did not run exact's grouping of continuations into batches.
    ReplicaGrouping,
    /// Batch-invariant policy: every pass is identical to exact.
    BatchInvariant,
    /// Stock policy, shuffled replica: not every replica continuation equals exact's.
    ReplicaFloor,
    /// Shuffled replica: its recorded numerical path is not exact's throughout.
    ReplicaPath,
}

impl Rule {
    /// The rule's name in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Rule::SnapshotHitRate => "snapshot-hit-rate",
            Rule::SnapshotVerified => "snapshot-verified",
            Rule::Complete => "complete",
            Rule::Consistent => "consistent",
            Rule::Counts => "counts",
            Rule::Placement => "placement",
            Rule::ReplicaSame => "replica-same",
            Rule::ReplicaGrouping => "replica-grouping",
            Rule::BatchInvariant => "batch-invariant",
            Rule::ReplicaFloor => "replica-floor",
            Rule::ReplicaPath => "replica-path",
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

/// A continuation's identity: (problem, pivot_pos, alt_rank, sample).
type Member = (u32, u32, u32, u32);

/// How each (problem or group, pass) grouped its continuations, sorted: per batch its members
/// in ascending order; in a refill run per row the continuations it ran, in `fill` order.
type Groupings = BTreeMap<(u32, Pass), Vec<Vec<Member>>>;

fn member(c: &ContinuationRow) -> Member {
    (c.problem, c.pivot_pos, c.alt_rank, c.sample)
}

fn cont_key(c: &ContinuationRow) -> ContKey {
    (
        c.problem,
        c.pivot_pos,
        c.alt_rank,
        c.branch.clone(),
        c.sample,
    )
}

fn pivot_row(p: &PivotRow) -> String {
    format!(
        "pivot problem={} pivot_pos={} alt_rank={}",
        p.problem, p.pivot_pos, p.alt_rank
    )
}

fn cont_row(k: &ContKey, pass: Pass) -> String {
    format!(
        "continuation problem={} pivot_pos={} alt_rank={} pass={pass} branch={} sample={}",
        k.0, k.1, k.2, k.3, k.4
    )
}

struct Checker<'a> {
    manifest: &'a Manifest,
    passes: Vec<Pass>,
    est: BTreeMap<Key, [Vec<&'a EstimateRow>; Pass::ALL.len()]>,
    cont: BTreeMap<ContKey, [Vec<&'a ContinuationRow>; Pass::ALL.len()]>,
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

    fn snapshot(&mut self, rows: &[EstimateRow], conts: &[ContinuationRow]) {
        let m = self.manifest;
        let resumed: Vec<&ContinuationRow> =
            conts.iter().filter(|c| c.pass.resumes_snapshot()).collect();
        let manifest = || "manifest".to_string();
        if m.snapshot_hits > m.snapshot_checks {
            self.push(
                Rule::SnapshotHitRate,
                manifest(),
                format!(
                    "snapshot_hits {} > snapshot_checks {}",
                    m.snapshot_hits, m.snapshot_checks
                ),
            );
        } else if m.snapshot_hits < m.snapshot_checks || m.snapshot_hit_rate < 1.0 {
            self.push(
                Rule::SnapshotHitRate,
                manifest(),
                format!(
                    "snapshot hit rate {:.4}% ({}/{}), must be 100%",
                    100.0 * m.snapshot_hit_rate,
                    m.snapshot_hits,
                    m.snapshot_checks
                ),
            );
        } else if m.snapshot_checks == 0 && !resumed.is_empty() {
            self.push(
                Rule::SnapshotHitRate,
                manifest(),
                "no snapshot fingerprint was checked but there are exact/replica rows",
            );
        }
        if m.snapshot_checks != resumed.len() as u64 {
            self.push(
                Rule::SnapshotHitRate,
                manifest(),
                format!(
                    "snapshot_checks {} but there are {} exact/replica continuations",
                    m.snapshot_checks,
                    resumed.len()
                ),
            );
        }
        let snapshots: BTreeSet<(u32, u32, Pass)> = resumed
            .iter()
            .map(|c| (c.problem, c.pivot_pos, c.pass))
            .collect();
        match (m.snapshot_checks_pivots, m.snapshot_hits_pivots) {
            (Some(checks), Some(hits)) => {
                if checks != snapshots.len() as u64 {
                    self.push(
                        Rule::SnapshotHitRate,
                        manifest(),
                        format!(
                            "snapshot_checks_pivots {checks} but the exact/replica continuations start from {} (pivot, pass) snapshots",
                            snapshots.len()
                        ),
                    );
                }
                if hits != checks {
                    self.push(
                        Rule::SnapshotHitRate,
                        manifest(),
                        format!("snapshot_hits_pivots {hits} ≠ snapshot_checks_pivots {checks}"),
                    );
                }
            }
            _ => self.push(
                Rule::SnapshotHitRate,
                manifest(),
                "no snapshot_checks_pivots / snapshot_hits_pivots (written before per-pivot counts)",
            ),
        }
        for r in rows {
            if r.pass.resumes_snapshot() && !r.snapshot_verified {
                self.push(
                    Rule::SnapshotVerified,
                    est_row(&r.key(), r.pass),
                    "snapshot_verified = false",
                );
            }
        }
        if resumed.iter().any(|c| c.snapshot_verified.is_none()) {
            self.push(
                Rule::SnapshotVerified,
                read::CONTINUATIONS.into(),
                "no snapshot_verified column (written before continuations recorded it)",
            );
            return;
        }
        for c in resumed {
            if c.snapshot_verified == Some(false) {
                self.push(
                    Rule::SnapshotVerified,
                    cont_row(&cont_key(c), c.pass),
                    "snapshot_verified = false",
                );
            }
        }
    }

    fn counts(
        &mut self,
        rollouts: &[RolloutRow],
        pivots: &[PivotRow],
        rows: &[EstimateRow],
        conts: &[ContinuationRow],
    ) {
        let m = self.manifest;
        let mut found: Vec<(String, String)> = Vec::new();
        let manifest = || "manifest".to_string();
        let (done, total) = (m.problems_done, m.problems_total);
        if done != total {
            found.push((
                manifest(),
                format!("problems_done {done} ≠ problems_total {total}"),
            ));
        }
        if rollouts.len() != done {
            found.push((
                read::ROLLOUTS.into(),
                format!("{} rows but problems_done = {done}", rollouts.len()),
            ));
        }
        let mut n_pivots: BTreeMap<u32, u32> = BTreeMap::new();
        for r in rollouts {
            if n_pivots.insert(r.problem, r.n_pivots).is_some() {
                found.push((
                    format!("rollout problem={}", r.problem),
                    "more than one row".into(),
                ));
            }
        }
        // (problem, pivot_pos) -> alternative ranks, from the pivots table.
        let mut alts: BTreeMap<(u32, u32), BTreeSet<u32>> = BTreeMap::new();
        for p in pivots {
            if !alts
                .entry((p.problem, p.pivot_pos))
                .or_default()
                .insert(p.alt_rank)
            {
                found.push((pivot_row(p), "more than one row".into()));
            }
        }
        for (&problem, &n) in &n_pivots {
            let have = alts.keys().filter(|(p, _)| *p == problem).count();
            if have != n as usize {
                found.push((
                    format!("rollout problem={problem}"),
                    format!("n_pivots = {n} but pivots.parquet has {have}"),
                ));
            }
        }
        for &(problem, pos) in alts.keys() {
            if !n_pivots.contains_key(&problem) {
                found.push((
                    format!("pivot problem={problem} pivot_pos={pos}"),
                    "no rollout row for its problem".into(),
                ));
            }
        }
        let est_keys: BTreeSet<Key> = rows.iter().map(EstimateRow::key).collect();
        for p in pivots {
            let k = Key {
                problem: p.problem,
                pivot_pos: p.pivot_pos,
                alt_rank: p.alt_rank,
            };
            if !est_keys.contains(&k) {
                found.push((pivot_row(p), "no estimate rows".into()));
            }
        }
        for k in &est_keys {
            if !alts
                .get(&(k.problem, k.pivot_pos))
                .is_some_and(|a| a.contains(&k.alt_rank))
            {
                found.push((format!("estimate {k}"), "no pivots row".into()));
            }
        }
        let k = m.k;
        let mut per: BTreeMap<(u32, u32, Pass), u64> = BTreeMap::new();
        let mut per_pass: BTreeMap<Pass, u64> = BTreeMap::new();
        for c in conts {
            *per_pass.entry(c.pass).or_default() += 1;
            let known = alts
                .get(&(c.problem, c.pivot_pos))
                .is_some_and(|a| c.alt_rank == 0 || a.contains(&c.alt_rank));
            if !known || c.sample >= k || !self.passes.contains(&c.pass) {
                found.push((
                    cont_row(&cont_key(c), c.pass),
                    format!("no such pivot, alternative, sample (k = {k}) or pass in this run"),
                ));
                continue;
            }
            *per.entry((c.problem, c.pivot_pos, c.pass)).or_default() += 1;
        }
        for (&(problem, pos), ranks) in &alts {
            let want = (1 + ranks.len() as u64) * u64::from(k);
            for &pass in &self.passes {
                let have = per.get(&(problem, pos, pass)).copied().unwrap_or(0);
                if have != want {
                    found.push((
                        format!("continuations problem={problem} pivot_pos={pos} pass={pass}"),
                        format!(
                            "{have} rows, expected (1 + {} alternatives) × k {k} = {want}",
                            ranks.len()
                        ),
                    ));
                }
            }
        }
        for &pass in &self.passes {
            let rows = per_pass.get(&pass).copied().unwrap_or(0);
            match m.cost.get(pass.as_str()) {
                Some(c) if c.continuations == rows => {}
                Some(c) => found.push((
                    manifest(),
                    format!(
                        "cost.{pass}.continuations = {} but continuations.parquet has {rows} {pass} rows",
                        c.continuations
                    ),
                )),
                None => found.push((manifest(), format!("no cost.{pass}"))),
            }
        }
        for (row, d) in found {
            self.push(Rule::Counts, row, d);
        }
    }

    /// Batches of each (problem, pass) as sets of continuation identities; reports malformed
    /// placements. `None` when the continuations do not record placements. A run whose
    /// problems were pooled (`pool_problems` in the manifest) batches per group of problems,
    /// keyed by the group's first problem.
    fn placement(
        &mut self,
        conts: &[ContinuationRow],
        rollouts: &[RolloutRow],
    ) -> Option<Groupings> {
        if conts.iter().any(|c| c.placement.is_none()) {
            self.push(
                Rule::Placement,
                read::CONTINUATIONS.into(),
                "no chunk / row / batch_rows columns (written before placements were recorded)",
            );
            return None;
        }
        let pool = self.manifest.pool_problems.unwrap_or(1).max(1);
        let mut problems: Vec<u32> = rollouts.iter().map(|r| r.problem).collect();
        problems.sort_unstable();
        problems.dedup();
        let group: BTreeMap<u32, u32> = problems
            .iter()
            .enumerate()
            .map(|(j, &p)| (p, problems[j / pool * pool]))
            .collect();
        // (problem, pass) -> chunk -> rows
        let mut batches: BTreeMap<(u32, Pass), BTreeMap<u32, Vec<&ContinuationRow>>> =
            BTreeMap::new();
        for c in conts {
            let at = c.placement.expect("checked above");
            batches
                .entry((group.get(&c.problem).copied().unwrap_or(c.problem), c.pass))
                .or_default()
                .entry(at.chunk)
                .or_default()
                .push(c);
        }
        if self.manifest.refill == Some(true) {
            return Some(self.queue_placement(&batches));
        }
        let mut found = Vec::new();
        let mut groupings: Groupings = BTreeMap::new();
        for (&(problem, pass), chunks) in &batches {
            let numbered = chunks.keys().copied().eq(0..chunks.len() as u32);
            if !numbered {
                found.push((
                    format!("continuations problem={problem} pass={pass}"),
                    format!(
                        "batches numbered {:?}, expected 0..{}",
                        chunks.keys().collect::<Vec<_>>(),
                        chunks.len()
                    ),
                ));
            }
            let mut sets = Vec::with_capacity(chunks.len());
            for (&chunk, rows) in chunks {
                let n = rows[0].placement.expect("checked above").batch_rows;
                let mut seen: Vec<u32> = rows
                    .iter()
                    .map(|c| c.placement.expect("checked above").row)
                    .collect();
                seen.sort_unstable();
                let sizes_agree = rows
                    .iter()
                    .all(|c| c.placement.expect("checked above").batch_rows == n);
                if !sizes_agree || !seen.iter().copied().eq(0..n) {
                    found.push((
                        format!("batch problem={problem} pass={pass} chunk={chunk}"),
                        format!("rows {seen:?} but batch_rows = {n}"),
                    ));
                }
                let mut members: Vec<Member> = rows.iter().map(|c| member(c)).collect();
                members.sort_unstable();
                sets.push(members);
            }
            sets.sort();
            groupings.insert((problem, pass), sets);
        }
        for (row, d) in found {
            self.push(Rule::Placement, row, d);
        }
        Some(groupings)
    }

    /// [`Self::placement`] of a refill run, given its rows per (group, pass) and chunk: one
    /// queue per (group, pass), its row sequences as the grouping.
    fn queue_placement(
        &mut self,
        batches: &BTreeMap<(u32, Pass), BTreeMap<u32, Vec<&ContinuationRow>>>,
    ) -> Groupings {
        let mut found = Vec::new();
        let mut groupings: Groupings = BTreeMap::new();
        for (&(problem, pass), chunks) in batches {
            let what = format!("queue problem={problem} pass={pass}");
            if !chunks.keys().copied().eq([0]) {
                found.push((
                    what.clone(),
                    format!(
                        "chunks {:?}, expected only 0 in a refill run",
                        chunks.keys().collect::<Vec<_>>()
                    ),
                ));
            }
            let all: Vec<&ContinuationRow> = chunks.values().flatten().copied().collect();
            let at = |c: &ContinuationRow| c.placement.expect("checked by the caller");
            let n = at(all[0]).batch_rows;
            if all.iter().any(|&c| at(c).batch_rows != n) {
                found.push((what.clone(), "batch_rows differ within the queue".into()));
            }
            let mut rows: BTreeMap<u32, Vec<(u32, Member)>> = BTreeMap::new();
            for &c in &all {
                rows.entry(at(c).row)
                    .or_default()
                    .push((at(c).fill, member(c)));
            }
            if !rows.keys().copied().eq(0..n) {
                found.push((
                    what.clone(),
                    format!(
                        "rows {:?} but batch_rows = {n}",
                        rows.keys().collect::<Vec<_>>()
                    ),
                ));
            }
            let mut sequences = Vec::with_capacity(rows.len());
            for (row, mut fills) in rows {
                fills.sort_unstable();
                let seen: Vec<u32> = fills.iter().map(|f| f.0).collect();
                if !seen.iter().copied().eq(0..seen.len() as u32) {
                    found.push((
                        format!("{what} row={row}"),
                        format!("fills {seen:?}, expected 0..{} once each", seen.len()),
                    ));
                }
                sequences.push(fills.into_iter().map(|f| f.1).collect::<Vec<_>>());
            }
            sequences.sort();
            groupings.insert((problem, pass), sequences);
        }
        for (row, d) in found {
            self.push(Rule::Placement, row, d);
        }
        groupings
    }

    /// A shuffled replica must not have run exact's batches in any problem.
    fn replica_grouping(&mut self, groupings: &Groupings) {
        let mut found = Vec::new();
        for (&(problem, pass), exact) in groupings {
            if pass != Pass::Exact {
                continue;
            }
            if let Some(replica) = groupings.get(&(problem, Pass::Replica))
                && replica == exact
            {
                let sizes: Vec<usize> = exact.iter().map(Vec::len).collect();
                let what = if self.manifest.refill == Some(true) {
                    "row sequences"
                } else {
                    "batches"
                };
                found.push((
                    format!("problem={problem} pass=replica"),
                    format!("the shuffled replica ran exact's {what} (sizes {sizes:?})"),
                ));
            }
        }
        for (row, d) in found {
            self.push(Rule::ReplicaGrouping, row, d);
        }
    }

    fn complete(&mut self) {
        let mut found = Vec::new();
        for (k, by_pass) in &self.est {
            for &p in &self.passes {
                match by_pass[p as usize].len() {
                    1 => {}
                    0 => found.push((est_row(k, p), "missing".to_string())),
                    n => found.push((est_row(k, p), format!("{n} rows"))),
                }
            }
        }
        for (k, by_pass) in &self.cont {
            for &p in &self.passes {
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

    /// Replica continuations paired with exact's: their token identity, and of those with a
    /// recorded path and at least one step, `(on exact's key axis at every step, total)`.
    fn replica_identity(&self) -> (TokenIdentity, (usize, usize)) {
        let mut tokens = TokenIdentity::default();
        let (mut on_axis, mut pathed) = (0, 0);
        for by_pass in self.cont.values() {
            let (Some(e), Some(r)) = (
                by_pass[Pass::Exact as usize].first(),
                by_pass[Pass::Replica as usize].first(),
            ) else {
                continue;
            };
            tokens.total += 1;
            tokens.identical += u64::from(e.tokens == r.tokens);
            if let Some(p) = r.path.filter(|p| p.steps > 0) {
                pathed += 1;
                on_axis += usize::from(p.keys_as_exact == Some(i64::from(p.steps)));
            }
        }
        (tokens, (on_axis, pathed))
    }

    /// `replica-floor` (judged as the report judges the floor, [`FloorStatus::of`]) and
    /// `replica-path` (see the module docs).
    fn replica_floor(&mut self) {
        let (tokens, (on_axis, pathed)) = self.replica_identity();
        let status = FloorStatus::of(
            Some(tokens),
            self.manifest.replica_schedule.as_str(),
            &self.manifest.run.exec.policy.to_string(),
        );
        if status == FloorStatus::StructuralZero {
            let n = tokens.total;
            self.push(
                Rule::ReplicaFloor,
                "manifest".into(),
                format!(
                    "structural zero: all {n} replica continuations are token-identical to exact's, so the replica exercised no numerical difference and the floor and every excess above it measure nothing; change passes.replica_key_pad or passes.replica_batch_size, run another --engine, or set replica_schedule = \"same\" for a bitwise control"
                ),
            );
        }
        if pathed > 0 && on_axis == pathed {
            self.push(
                Rule::ReplicaPath,
                "manifest".into(),
                format!(
                    "all {pathed} replica continuations attended over exact's key axis at every step: the engine equalized the two passes' numerical paths; set passes.replica_key_pad to a value that is not a multiple of 8"
                ),
            );
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
            if rule == Rule::ReplicaSame && e.placement != o.placement {
                let show = |p: &Option<read::Placement>| {
                    p.map_or("none".into(), |p| {
                        format!("chunk {} row {} of {}", p.chunk, p.row, p.batch_rows)
                    })
                };
                diff.push(format!(
                    "ran in {} vs exact's {}",
                    show(&o.placement),
                    show(&e.placement)
                ));
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
    let rollouts = read_rollouts(dir)?;
    let pivots = read_pivots(dir)?;
    let mut ck = Checker {
        manifest: &manifest,
        passes: manifest.passes(),
        est: BTreeMap::new(),
        cont: BTreeMap::new(),
        out: Vec::new(),
    };
    for r in &estimates {
        ck.est.entry(r.key()).or_default()[r.pass as usize].push(r);
    }
    for c in &conts {
        ck.cont.entry(cont_key(c)).or_default()[c.pass as usize].push(c);
    }
    let mut rules = vec![
        Rule::SnapshotHitRate,
        Rule::SnapshotVerified,
        Rule::Complete,
        Rule::Consistent,
        Rule::Counts,
        Rule::Placement,
    ];
    ck.snapshot(&estimates, &conts);
    ck.complete();
    ck.consistent(&estimates, &conts);
    ck.counts(&rollouts, &pivots, &estimates, &conts);
    let groupings = ck.placement(&conts, &rollouts);
    if manifest.replica_schedule == ReplicaSchedule::Same {
        rules.push(Rule::ReplicaSame);
        ck.identical(Rule::ReplicaSame, Pass::Replica);
    }
    if manifest.replica_schedule == ReplicaSchedule::Shuffled && ck.passes.contains(&Pass::Replica)
    {
        rules.push(Rule::ReplicaGrouping);
        if let Some(g) = &groupings {
            ck.replica_grouping(g);
        }
        let stock = manifest.run.exec.policy == PolicyKind::Stock;
        if stock {
            rules.push(Rule::ReplicaFloor);
        }
        rules.push(Rule::ReplicaPath);
        ck.replica_floor();
    }
    if manifest.run.exec.policy == PolicyKind::BatchInvariant {
        rules.push(Rule::BatchInvariant);
        for pass in [Pass::Replica, Pass::Refeed, Pass::RefeedReplica] {
            ck.identical(Rule::BatchInvariant, pass);
        }
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
