//! The numbers of one configuration and one treatment pass: disagreement rates, the excess
//! over the replica floor with problem-clustered inference, disagreement classes, the
//! mean-zero check and critical-set overlap, under both conditionings.
//!
//! The treatment is refeed or spectrum ([`Pass::TREATMENTS`]); one code path serves both, the
//! pass a parameter. Below, "refeed" stands for whichever treatment is summarized.
//!
//! All formulas are in `crate::stats`; this module only chooses the eligible sets and feeds
//! them in. The choices (see also `SCHEMA.md`):
//! - Estimates are recomputed from the integer counts, `Â = (orig_successes −
//!   alt_successes)/k`, and "informative" from the counts, so equal estimates compare equal
//!   and thresholds `m/k` land exactly (`kvcredit check` verifies the written columns agree).
//! - An estimate key `(problem, pivot_pos, alt_rank)` enters only with all three passes;
//!   keys missing a pass are counted (`n_incomplete`) and left out.
//! - *any-informative*: the comparison exact-vs-X uses the keys where exact or X is
//!   informative, so the two comparisons have their own sets. The headline **excess** is
//!   `rate(exact≠refeed) − rate(exact≠replica)`, each over its own set, and its inference is
//!   of that same quantity: a linearized CR1 t ([`stats::rate_difference_t`]) and a cluster
//!   bootstrap that recomputes both eligible sets in every replicate (CI and percentile p).
//! - The **paired contrast** `D_j = 1[exact≠refeed] − 1[exact≠replica]` is a different
//!   quantity under any-informative: its mean `D̄` is taken over the union of the two sets
//!   (a key outside a comparison's set has both estimates 0, so `Σ D_j` is exactly
//!   `#disagree(refeed) − #disagree(replica)`), and the cluster-mean t and CR1 t test `D̄`
//!   (the cluster-mean one its mean of problem means), never the excess. `D̄` and the excess
//!   can have opposite signs. The intersection of the two sets is a sensitivity row.
//! - *treatment-independent*: one set for both comparisons, exact informative; the excess and
//!   `D̄` coincide and so do their CR1 tests.
//! - Critical sets follow design.md, `C^π(τ) = {(i, t, a) : |Â^π| ≥ τ}` over **every**
//!   complete key, whatever the conditioning, over `τ = m/K`, `m = 1..K`. Under
//!   any-informative every critical key is eligible for its comparison (an ineligible key has
//!   `Â = 0` in both passes); under treatment-independent a key with exact uninformative
//!   (`Â_exact = 0`) still enters `C_refeed`/`C_replica` when `|Â| ≥ τ`: `n_ineligible`
//!   counts those keys. So the Jaccard values are the same under both conditionings.
//! - Every bootstrap uses the same seed and `reps`, resampling problems.
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use crate::stats::{
    self, BootstrapCi, ClusteredMeanCi, DisagreementCounts, JaccardResult, RateDifferenceBootstrap,
    TTest,
};
use crate::{Error, Result};

use super::read::{EstimateRow, Key, OutputCounts, Pass, PassCost};
use crate::io::schema::SpectrumStats;

/// Bootstrap and interval settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AnalyzeOptions {
    /// Cluster-bootstrap replicates per statistic.
    pub reps: usize,
    /// Seed of every bootstrap.
    pub seed: u64,
    /// Confidence level of every interval.
    pub level: f64,
    /// Price of one GPU-hour in US dollars, for the cost columns (device-seconds × price).
    pub usd_per_gpu_hour: f64,
    /// Read unfinished run dirs from their finished shards (labelled `NAME (partial k/N)`)
    /// instead of only listing them.
    pub partial: bool,
}

/// Default `usd_per_gpu_hour`: an assumption, the order of an on-demand single-H200 hour at
/// cloud providers in late 2026 (not a quote; pass your own price).
pub const DEFAULT_USD_PER_GPU_HOUR: f64 = 3.50;

impl Default for AnalyzeOptions {
    fn default() -> Self {
        AnalyzeOptions {
            reps: 2000,
            seed: 20_251_129,
            level: 0.95,
            usd_per_gpu_hour: DEFAULT_USD_PER_GPU_HOUR,
            partial: false,
        }
    }
}

/// Which estimates are eligible for a comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Conditioning {
    /// Eligible if either compared pass is informative (depends on the treatment pass).
    AnyInformative,
    /// Eligible iff the exact pass is informative (the same set for both comparisons).
    TreatmentIndependent,
}

impl Conditioning {
    /// Both conditionings, in output order.
    pub const ALL: [Conditioning; 2] = [
        Conditioning::AnyInformative,
        Conditioning::TreatmentIndependent,
    ];

    /// Label used in `summary.parquet`.
    pub fn as_str(self) -> &'static str {
        match self {
            Conditioning::AnyInformative => "any_informative",
            Conditioning::TreatmentIndependent => "treatment_independent",
        }
    }

    /// Whether a key is eligible for the comparison of exact with `other`.
    pub fn eligible(self, exact: Est, other: Est) -> bool {
        match self {
            Conditioning::AnyInformative => exact.informative || other.informative,
            Conditioning::TreatmentIndependent => exact.informative,
        }
    }
}

/// One pass's quantized estimate at a key.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Est {
    /// `Â = (orig_successes − alt_successes)/k`.
    pub a_hat: f64,
    /// The pass's 2K outcomes are not all equal.
    pub informative: bool,
}

/// Exact's, replica's and one treatment pass's estimates at one key.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Triple {
    /// `(problem, pivot_pos, alt_rank)`.
    pub key: Key,
    /// Exact resume.
    pub exact: Est,
    /// Replica.
    pub replica: Est,
    /// The treatment pass (refeed or spectrum, [`Pass::TREATMENTS`]).
    pub treatment: Est,
}

impl Triple {
    /// The estimate of `pass`: exact's, replica's, or (any other pass) the treatment's.
    pub fn get(&self, pass: Pass) -> Est {
        match pass {
            Pass::Exact => self.exact,
            Pass::Replica => self.replica,
            _ => self.treatment,
        }
    }
}

/// The treatment passes present in `rows`, in [`Pass::TREATMENTS`] order.
pub fn treatments(rows: &[EstimateRow]) -> Vec<Pass> {
    Pass::TREATMENTS
        .into_iter()
        .filter(|&t| rows.iter().any(|r| r.pass == t))
        .collect()
}

/// Join rows into complete triples of exact, replica and `treatment` (sorted by key); rows of
/// other passes are ignored. Returns the triples and the number of keys that lack one of the
/// three. A key with two rows for one pass is an error.
pub fn triples(rows: &[EstimateRow], treatment: Pass) -> Result<(Vec<Triple>, usize)> {
    let mut by_key: BTreeMap<Key, [Option<Est>; 3]> = BTreeMap::new();
    for r in rows {
        let i = match r.pass {
            Pass::Exact => 0,
            Pass::Replica => 1,
            p if p == treatment => 2,
            _ => continue,
        };
        let slot = &mut by_key.entry(r.key()).or_default()[i];
        if slot.is_some() {
            return Err(Error::Output(format!(
                "config `{}`: duplicate estimate row ({}, pass={})",
                r.config,
                r.key(),
                r.pass
            )));
        }
        *slot = Some(Est {
            a_hat: r.a_hat(),
            informative: r.is_informative(),
        });
    }
    let mut out = Vec::with_capacity(by_key.len());
    let mut incomplete = 0;
    for (key, e) in by_key {
        match e {
            [Some(exact), Some(replica), Some(treatment)] => out.push(Triple {
                key,
                exact,
                replica,
                treatment,
            }),
            _ => incomplete += 1,
        }
    }
    Ok((out, incomplete))
}

/// Critical-set overlap at one threshold (critical sets over every complete key).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JaccardPoint {
    /// Threshold `τ = m/K`.
    pub tau: f64,
    /// Sizes, intersection, union and value (`None` for an empty union).
    pub result: JaccardResult,
    /// Cluster-bootstrap CI over every problem (`None` if no replicate had a non-empty union).
    pub ci: Option<BootstrapCi>,
    /// Keys of `C_exact ∪ C_other` outside this conditioning's eligible set for the
    /// comparison: 0 under any-informative; under treatment-independent the critical keys
    /// whose exact pass is uninformative (a conditioned critical set would drop them).
    pub n_ineligible: usize,
}

/// Exact vs one other pass under one conditioning.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// The other pass (replica or the treatment).
    pub pass: Pass,
    /// Eligible estimates.
    pub n_eligible: usize,
    /// Problems with at least one eligible estimate.
    pub n_problems: usize,
    /// Eligible estimates with `Â_exact ≠ Â_other`.
    pub n_disagree: usize,
    /// `n_disagree / n_eligible`; `None` when nothing is eligible.
    pub rate: Option<f64>,
    /// Cluster-bootstrap percentile CI of the rate.
    pub rate_ci: Option<BootstrapCi>,
    /// Disagreements by class.
    pub classes: DisagreementCounts,
    /// Clustered mean of `Â_other − Â_exact` (the mean-zero check).
    pub mean_diff: Option<ClusteredMeanCi>,
    /// Critical-set overlap with exact, per `τ` (over every complete key; the same under
    /// both conditionings except `n_ineligible`).
    pub jaccard: Vec<JaccardPoint>,
}

/// Clustered inference for the paired contrast `D_j` (its mean `D̄`, not the excess).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairedContrast {
    /// Estimates in the paired set.
    pub n: usize,
    /// Problems in the paired set (`G`).
    pub n_problems: usize,
    /// Pooled mean `D̄` (the CR1 estimate).
    pub mean: f64,
    /// Cluster-mean t test (estimate = mean of per-problem means of `D_j`).
    pub cluster_mean: TTest,
    /// CR1 t test (estimate = pooled mean `D̄`).
    pub cr1: TTest,
    /// Cluster-bootstrap percentile CI of the pooled mean `D̄`.
    pub bootstrap_ci: Option<BootstrapCi>,
}

/// The excess `rate(exact≠T) − rate(exact≠replica)` of a treatment pass T (refeed or
/// spectrum), each rate over its own eligible set, with inference on that same quantity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Excess {
    /// The excess.
    pub estimate: f64,
    /// Estimates in either eligible set (the rows resampled).
    pub n: usize,
    /// Their problems (`G`).
    pub n_problems: usize,
    /// Linearized CR1 t test of the excess ([`stats::rate_difference_t`], `G − 1` df).
    pub t_test: TTest,
    /// Cluster bootstrap with both eligible sets recomputed per replicate: percentile CI and
    /// percentile p-value; `None` if every replicate had an empty set.
    pub bootstrap: Option<RateDifferenceBootstrap>,
}

/// All numbers of one configuration under one conditioning.
#[derive(Debug, Clone, PartialEq)]
pub struct ConditioningSummary {
    /// Which conditioning.
    pub conditioning: Conditioning,
    /// Exact vs replica (the floor).
    pub replica: Comparison,
    /// Exact vs the treatment pass (its `pass` says which).
    pub treatment: Comparison,
    /// `rate(treatment) − rate(replica)` and its tests; `None` if either rate is.
    pub excess: Option<Excess>,
    /// `D_j` over the paired set (union / exact-informative); `None` if the set is empty.
    pub paired: Option<PairedContrast>,
    /// Any-informative only: `D_j` over the intersection of the two eligible sets.
    pub intersection: Option<PairedContrast>,
}

/// What a configuration is and what it cost.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigMeta {
    /// Configuration label.
    pub config: String,
    /// Model label.
    pub model: String,
    /// Dtype label.
    pub dtype: String,
    /// Policy label.
    pub policy: String,
    /// Replica schedule from the manifest.
    pub replica_schedule: String,
    /// The task (name, grader, prompt, data hash) from the manifest, when it records one.
    pub task: Option<String>,
    /// Continuations per branch.
    pub k: u32,
    /// Run dirs the configuration was read from.
    pub run_dirs: Vec<PathBuf>,
    /// Problems with at least one complete estimate.
    pub n_problems: usize,
    /// Complete estimate keys (exact, replica and the treatment present).
    pub n_keys: usize,
    /// Keys lacking a pass (left out).
    pub n_incomplete: usize,
    /// Snapshot fingerprint checks (manifest, summed over run dirs).
    pub snapshot_checks: u64,
    /// Matching checks.
    pub snapshot_hits: u64,
    /// Cost per pass label (manifest, summed over run dirs).
    pub cost: BTreeMap<String, PassCost>,
    /// The spectrum pass's setting (`policy/quantizer/b`), when the manifest records one.
    pub spectrum_setting: Option<String>,
    /// The spectrum pass's frames (manifest, summed over run dirs).
    pub spectrum: Option<SpectrumStats>,
    /// Stop reasons and extraction rules per pass label (`exact`, `replica`, `refeed` from
    /// the continuations, `rollout` from the rollouts; summed over run dirs).
    pub outputs: BTreeMap<String, OutputCounts>,
    /// `(problems done, problems in the spec)` when read from an unfinished run's shards.
    pub partial: Option<(usize, usize)>,
}

impl ConfigMeta {
    /// `snapshot_hits / snapshot_checks`, `None` without checks.
    pub fn snapshot_hit_rate(&self) -> Option<f64> {
        (self.snapshot_checks > 0).then(|| self.snapshot_hits as f64 / self.snapshot_checks as f64)
    }
}

/// The full analysis of one configuration and one treatment pass.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigSummary {
    /// Labels, counts and cost.
    pub meta: ConfigMeta,
    /// The pass compared with exact against the replica floor (refeed or spectrum).
    pub treatment: Pass,
    /// `τ = m/K`, `m = 1..K`.
    pub taus: Vec<f64>,
    /// One entry per conditioning, in [`Conditioning::ALL`] order.
    pub rows: Vec<ConditioningSummary>,
}

/// The threshold grid `τ = m/K`, `m = 1..=K` (computed as `m as f64 / K as f64`, like `Â`).
pub fn tau_grid(k: u32) -> Vec<f64> {
    (1..=k).map(|m| f64::from(m) / f64::from(k)).collect()
}

fn ind(b: bool) -> f64 {
    f64::from(u8::from(b))
}

fn problems_of(ts: &[&Triple]) -> Vec<u64> {
    ts.iter().map(|t| u64::from(t.key.problem)).collect()
}

fn n_clusters(ts: &[&Triple]) -> usize {
    ts.iter()
        .map(|t| t.key.problem)
        .collect::<BTreeSet<_>>()
        .len()
}

/// Critical-set overlap of exact with `pass` per `τ`, over every complete key and every
/// problem (design.md's `C^π(τ)`; the same for every conditioning, `n_ineligible` left 0).
fn critical_overlap(
    triples: &[Triple],
    pass: Pass,
    taus: &[f64],
    opts: &AnalyzeOptions,
) -> Result<Vec<JaccardPoint>> {
    let ka: Vec<(Key, f64)> = triples.iter().map(|t| (t.key, t.exact.a_hat)).collect();
    let kb: Vec<(Key, f64)> = triples.iter().map(|t| (t.key, t.get(pass).a_hat)).collect();
    taus.iter()
        .map(|&tau| {
            Ok(JaccardPoint {
                tau,
                result: stats::jaccard(&ka, &kb, tau)?,
                ci: stats::jaccard_bootstrap_ci(
                    &ka,
                    &kb,
                    tau,
                    |k: &Key| u64::from(k.problem),
                    opts.reps,
                    opts.seed,
                    opts.level,
                )?,
                n_ineligible: 0,
            })
        })
        .collect()
}

fn compare(
    triples: &[Triple],
    cond: Conditioning,
    pass: Pass,
    overlap: &[JaccardPoint],
    opts: &AnalyzeOptions,
) -> Result<Comparison> {
    let elig: Vec<&Triple> = triples
        .iter()
        .filter(|t| cond.eligible(t.exact, t.get(pass)))
        .collect();
    let ex: Vec<f64> = elig.iter().map(|t| t.exact.a_hat).collect();
    let ot: Vec<f64> = elig.iter().map(|t| t.get(pass).a_hat).collect();
    let classes = stats::tally_disagreements(&ex, &ot)?;
    let n = elig.len();
    let n_disagree = n - classes.agree;
    let clusters = problems_of(&elig);
    let (rate, rate_ci, mean_diff) = if n == 0 {
        (None, None, None)
    } else {
        let flags: Vec<f64> = ex.iter().zip(&ot).map(|(a, b)| ind(a != b)).collect();
        let diffs: Vec<f64> = ex.iter().zip(&ot).map(|(a, b)| b - a).collect();
        (
            Some(n_disagree as f64 / n as f64),
            stats::cluster_bootstrap_ci(
                &flags,
                &clusters,
                stats::pooled_mean,
                opts.reps,
                opts.seed,
                opts.level,
            )?,
            Some(stats::clustered_mean_ci(
                &diffs, &clusters, opts.level, opts.reps, opts.seed,
            )?),
        )
    };
    let jaccard = overlap
        .iter()
        .map(|p| {
            let critical =
                |t: &&Triple| t.exact.a_hat.abs() >= p.tau || t.get(pass).a_hat.abs() >= p.tau;
            let n_ineligible = triples
                .iter()
                .filter(|t| critical(t) && !cond.eligible(t.exact, t.get(pass)))
                .count();
            JaccardPoint { n_ineligible, ..*p }
        })
        .collect();
    Ok(Comparison {
        pass,
        n_eligible: n,
        n_problems: n_clusters(&elig),
        n_disagree,
        rate,
        rate_ci,
        classes,
        mean_diff,
        jaccard,
    })
}

fn paired(set: &[&Triple], opts: &AnalyzeOptions) -> Result<Option<PairedContrast>> {
    if set.is_empty() {
        return Ok(None);
    }
    let d: Vec<f64> = set
        .iter()
        .map(|t| stats::flip_contrast(t.exact.a_hat, t.treatment.a_hat, t.replica.a_hat))
        .collect();
    let clusters = problems_of(set);
    Ok(Some(PairedContrast {
        n: set.len(),
        n_problems: n_clusters(set),
        mean: stats::pooled_mean(&d, &clusters),
        cluster_mean: stats::cluster_mean_t(&d, &clusters)?,
        cr1: stats::cr1_t(&d, &clusters)?,
        bootstrap_ci: stats::cluster_bootstrap_ci(
            &d,
            &clusters,
            stats::pooled_mean,
            opts.reps,
            opts.seed,
            opts.level,
        )?,
    }))
}

/// The excess over `union` (keys eligible for either comparison): each rate over its own
/// eligible subset of it. `None` if either subset is empty.
fn excess(
    union: &[&Triple],
    cond: Conditioning,
    treatment: Pass,
    opts: &AnalyzeOptions,
) -> Result<Option<Excess>> {
    let flags = |pass: Pass| -> Vec<Option<bool>> {
        union
            .iter()
            .map(|t| {
                let other = t.get(pass);
                cond.eligible(t.exact, other)
                    .then_some(t.exact.a_hat != other.a_hat)
            })
            .collect()
    };
    let (treated, replica) = (flags(treatment), flags(Pass::Replica));
    let Some(estimate) = stats::rate_difference(&treated, &replica) else {
        return Ok(None);
    };
    let clusters = problems_of(union);
    Ok(Some(Excess {
        estimate,
        n: union.len(),
        n_problems: n_clusters(union),
        t_test: stats::rate_difference_t(&treated, &replica, &clusters)?,
        bootstrap: stats::rate_difference_bootstrap(
            &treated, &replica, &clusters, opts.reps, opts.seed, opts.level,
        )?,
    }))
}

/// Summarize complete triples under one conditioning; `overlap` holds the critical-set
/// overlap of exact with replica and with the treatment ([`critical_overlap`]).
fn summarize_conditioning(
    triples: &[Triple],
    cond: Conditioning,
    treatment: Pass,
    overlap: [&[JaccardPoint]; 2],
    opts: &AnalyzeOptions,
) -> Result<ConditioningSummary> {
    let replica = compare(triples, cond, Pass::Replica, overlap[0], opts)?;
    let treated = compare(triples, cond, treatment, overlap[1], opts)?;
    let el = |t: &Triple, p: Pass| cond.eligible(t.exact, t.get(p));
    let union: Vec<&Triple> = triples
        .iter()
        .filter(|t| el(t, Pass::Replica) || el(t, treatment))
        .collect();
    let intersection = match cond {
        Conditioning::AnyInformative => {
            let both: Vec<&Triple> = triples
                .iter()
                .filter(|t| el(t, Pass::Replica) && el(t, treatment))
                .collect();
            paired(&both, opts)?
        }
        Conditioning::TreatmentIndependent => None,
    };
    Ok(ConditioningSummary {
        conditioning: cond,
        excess: excess(&union, cond, treatment, opts)?,
        paired: paired(&union, opts)?,
        replica,
        treatment: treated,
        intersection,
    })
}

/// Summarize one configuration's estimate rows (all rows must carry `meta.config`) for one
/// treatment pass (refeed or spectrum) against exact and the replica floor. `meta.n_*` and
/// `meta.k` are filled in here.
pub fn summarize(
    rows: &[EstimateRow],
    mut meta: ConfigMeta,
    treatment: Pass,
    opts: &AnalyzeOptions,
) -> Result<ConfigSummary> {
    let cfg = &meta.config;
    let first = rows
        .first()
        .ok_or_else(|| Error::Output(format!("config `{cfg}`: no estimate rows")))?;
    if let Some(r) = rows.iter().find(|r| r.k != first.k) {
        return Err(Error::Output(format!(
            "config `{cfg}`: mixed k ({} and {}) at ({}, pass={})",
            first.k,
            r.k,
            r.key(),
            r.pass
        )));
    }
    if !Pass::TREATMENTS.contains(&treatment) {
        return Err(Error::Output(format!(
            "config `{cfg}`: {treatment} is not a treatment pass (refeed, spectrum)"
        )));
    }
    let (triples, incomplete) = triples(rows, treatment)?;
    if triples.is_empty() {
        return Err(Error::Output(format!(
            "config `{cfg}`: no estimate has all three passes (exact, replica, {treatment})"
        )));
    }
    meta.k = first.k;
    meta.n_keys = triples.len();
    meta.n_incomplete = incomplete;
    meta.n_problems = triples
        .iter()
        .map(|t| t.key.problem)
        .collect::<BTreeSet<_>>()
        .len();
    let taus = tau_grid(first.k);
    let overlap = [
        critical_overlap(&triples, Pass::Replica, &taus, opts)?,
        critical_overlap(&triples, treatment, &taus, opts)?,
    ];
    let rows = Conditioning::ALL
        .iter()
        .map(|&c| summarize_conditioning(&triples, c, treatment, [&overlap[0], &overlap[1]], opts))
        .collect::<Result<Vec<_>>>()?;
    Ok(ConfigSummary {
        meta,
        treatment,
        taus,
        rows,
    })
}
