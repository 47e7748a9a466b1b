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
//! - Critical sets are [`CRITICAL_SET_DEFINITION`] (the definition of `docs/guide/concepts.md`),
//!   over `τ = m/K`, `m = 1..K`. Under
//!   any-informative every critical key is eligible for its comparison (an ineligible key has
//!   `Â = 0` in both passes); under treatment-independent a key with exact uninformative
//!   (`Â_exact = 0`) still enters `C_refeed`/`C_replica` when `|Â| ≥ τ`: `n_ineligible`
//!   counts those keys. So the Jaccard values are the same under both conditionings.
//! - Mean-zero is tested twice: the cluster-mean t test of `mean = 0` and the equivalence test
//!   (TOST) of `|mean| < equivalence_margin`; only the latter can show equivalence.
//! - Shares of the disagreement classes and the replica ceiling minus Jaccard(exact,
//!   treatment) have cluster-bootstrap intervals and percentile p-values (the Jaccard gap
//!   paired: both indices recomputed on one resample).
//! - *State × schedule*: with `refeed_replica` (`spectrum_replica`) present, [`factorial`]
//!   crosses the decode or re-fed state with exact's or the replica's batch schedule.
//! - Every bootstrap uses the same seed and `reps`, resampling problems.
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use crate::stats::{
    self, BootstrapCi, ClusteredMeanCi, DisagreementCounts, JaccardGap, JaccardResult,
    RateDifferenceBootstrap, ShareBootstrap, TTest, Tost,
};
use crate::{Error, Result};

use super::identity::{FloorStatus, TokenIdentity};
use super::read::{EstimateRow, Key, OutputCounts, Pass, PassCost};
use crate::credit::schema::SpectrumStats;

/// The one definition of a critical set, as `docs/guide/concepts.md` and the report state it.
pub const CRITICAL_SET_DEFINITION: &str = "`C^π(τ) = {(i, t, a) : |Â^π| ≥ τ}` over every \
     complete key (an estimate key with exact, replica and the treatment all present), \
     whatever the conditioning";

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
    /// Margin `m` of the mean-zero equivalence test (TOST of `|mean(Â_X − Â_exact)| < m`, on
    /// the `Â` scale).
    pub equivalence_margin: f64,
}

/// Default [`AnalyzeOptions::equivalence_margin`]: 0.05 on the `Â` scale, a fifth of the
/// smallest non-zero `|Â|` at K = 4.
pub const DEFAULT_EQUIVALENCE_MARGIN: f64 = 0.05;

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
            equivalence_margin: DEFAULT_EQUIVALENCE_MARGIN,
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
    /// Percentile-bootstrap p-value of rate = 0 from the same replicates.
    pub rate_p: Option<f64>,
    /// Disagreements by class.
    pub classes: DisagreementCounts,
    /// Shares of the disagreements that are zero-boundary crossings, polarity reversals and
    /// magnitude changes, each with a cluster-bootstrap interval and its test of share = 1/2
    /// (`None` without disagreements).
    pub class_shares: [Option<ShareBootstrap>; 3],
    /// Clustered mean of `Â_other − Â_exact` (the mean-zero check).
    pub mean_diff: Option<ClusteredMeanCi>,
    /// Equivalence test (TOST) of that mean within `±equivalence_margin`, on the cluster-mean
    /// t test's estimate and standard error (`None` when it has none).
    pub equivalence: Option<Tost>,
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
    /// Per non-exact pass, its continuations' token identity with exact's (summed over run
    /// dirs; empty when no continuations were read).
    pub token_identity: BTreeMap<Pass, TokenIdentity>,
    /// `(problems done, problems in the spec)` when read from an unfinished run's shards.
    pub partial: Option<(usize, usize)>,
}

impl ConfigMeta {
    /// What the replica floor measured, from the replica's token identity, the replica
    /// schedule and the policy ([`FloorStatus::of`]).
    pub fn floor_status(&self) -> FloorStatus {
        FloorStatus::of(
            self.token_identity.get(&Pass::Replica).copied(),
            &self.replica_schedule,
            &self.policy,
        )
    }

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
    /// The pass compared with exact against the replica floor ([`Pass::TREATMENTS`]).
    pub treatment: Pass,
    /// `τ = m/K`, `m = 1..K`.
    pub taus: Vec<f64>,
    /// One entry per conditioning, in [`Conditioning::ALL`] order.
    pub rows: Vec<ConditioningSummary>,
    /// Per `τ`, the paired cluster-bootstrap test of the replica ceiling minus
    /// Jaccard(exact, treatment) (critical sets over every complete key, so the same under
    /// both conditionings); `None` where a union is empty in every replicate.
    pub ceiling_gap: Vec<Option<JaccardGap>>,
    /// The state × schedule design, for refeed (spectrum) when the configuration also ran
    /// `refeed_replica` (`spectrum_replica`).
    pub factorial: Option<Factorial>,
}

/// One cell of the state × schedule design: exact vs one pass.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FactorialCell {
    /// The pass (replica, the state treatment, or its replica-schedule twin).
    pub pass: Pass,
    /// Eligible estimates under the conditioning.
    pub n_eligible: usize,
    /// Eligible estimates with `Â_exact ≠ Â_pass`.
    pub n_disagree: usize,
    /// The disagreement rate with its cluster-bootstrap interval (`None` if nothing is
    /// eligible).
    pub rate: Option<ShareBootstrap>,
}

/// A difference of cell rates with a cluster-bootstrap interval (problems resampled, every
/// rate and eligible set recomputed per replicate, the same draws for every effect).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Effect {
    /// On the data; `None` if a rate is undefined.
    pub estimate: Option<f64>,
    /// Percentile interval; replicates with an empty eligible set are dropped.
    pub ci: Option<BootstrapCi>,
    /// Percentile-bootstrap p-value of effect = 0 from the same replicates.
    pub p_value: Option<f64>,
}

/// The state × schedule cells under one conditioning. Rates `d(X)` are of exact ≠ X:
/// `d(replica)` is the schedule effect (the floor), `d(state)` the state effect under exact's
/// schedule, `d(twin)` the re-fed state under the replica's schedule (what the seed measured).
/// `d(twin) = d(state) + d(replica) + interaction`, and the excess `d(twin) − d(replica)` is
/// the state effect plus the interaction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FactorialRow {
    /// Which conditioning.
    pub conditioning: Conditioning,
    /// `[replica, state, twin]`.
    pub cells: [FactorialCell; 3],
    /// `d(twin) − d(replica)`.
    pub excess: Effect,
    /// `d(twin) − d(state) − d(replica)`.
    pub interaction: Effect,
}

/// The state × schedule design of one state treatment (refeed or spectrum): decode state or
/// the treatment's state, crossed with exact's or the replica's batch schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct Factorial {
    /// The state treatment under exact's schedule (refeed or spectrum).
    pub state: Pass,
    /// The same state under the replica's schedule (refeed_replica or spectrum_replica).
    pub twin: Pass,
    /// Keys with exact, replica, state and twin estimates.
    pub n_keys: usize,
    /// Problems of those keys.
    pub n_problems: usize,
    /// One entry per conditioning, in [`Conditioning::ALL`] order.
    pub rows: Vec<FactorialRow>,
}

/// The pass that decodes `state`'s state under the replica's schedule, if there is one.
pub fn schedule_twin(state: Pass) -> Option<Pass> {
    match state {
        Pass::Refeed => Some(Pass::RefeedReplica),
        Pass::Spectrum => Some(Pass::SpectrumReplica),
        _ => None,
    }
}

/// The threshold grid `τ = m/K`, `m = 1..=K` (computed as `m as f64 / K as f64`, like `Â`).
pub fn tau_grid(k: u32) -> Vec<f64> {
    (1..=k).map(|m| f64::from(m) / f64::from(k)).collect()
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
/// problem ([`CRITICAL_SET_DEFINITION`]; the same for every conditioning, `n_ineligible`
/// left 0).
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
    let (rate, rate_boot, mean_diff) = if n == 0 {
        (None, None, None)
    } else {
        let flags: Vec<Option<bool>> = ex.iter().zip(&ot).map(|(a, b)| Some(a != b)).collect();
        let diffs: Vec<f64> = ex.iter().zip(&ot).map(|(a, b)| b - a).collect();
        (
            Some(n_disagree as f64 / n as f64),
            stats::share_bootstrap(&flags, &clusters, 0.0, opts.reps, opts.seed, opts.level)?,
            Some(stats::clustered_mean_ci(
                &diffs, &clusters, opts.level, opts.reps, opts.seed,
            )?),
        )
    };
    let equivalence = match &mean_diff {
        Some(m) => stats::tost(&m.t_test, opts.equivalence_margin)?,
        None => None,
    };
    let class_shares = if n_disagree == 0 {
        [None; 3]
    } else {
        let kinds = [
            stats::Disagreement::ZeroBoundary,
            stats::Disagreement::PolarityReversal,
            stats::Disagreement::Magnitude,
        ];
        let mut out = [None; 3];
        for (slot, kind) in out.iter_mut().zip(kinds) {
            let s: Vec<Option<bool>> = ex
                .iter()
                .zip(&ot)
                .map(|(&a, &b)| stats::classify(a, b).map(|c| c == kind))
                .collect();
            *slot = stats::share_bootstrap(&s, &clusters, 0.5, opts.reps, opts.seed, opts.level)?;
        }
        out
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
        rate_ci: rate_boot.map(|b| b.ci),
        rate_p: rate_boot.map(|b| b.p_value),
        classes,
        class_shares,
        mean_diff,
        equivalence,
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
            "config `{cfg}`: {treatment} is not a treatment pass ({})",
            Pass::TREATMENTS.map(Pass::as_str).join(", ")
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
    let summaries = Conditioning::ALL
        .iter()
        .map(|&c| summarize_conditioning(&triples, c, treatment, [&overlap[0], &overlap[1]], opts))
        .collect::<Result<Vec<_>>>()?;
    let ceiling_gap = ceiling_gap(&triples, treatment, &taus, opts)?;
    let factorial = match schedule_twin(treatment) {
        Some(twin) if rows.iter().any(|r| r.pass == twin) => {
            factorial(rows, treatment, twin, opts)?
        }
        _ => None,
    };
    Ok(ConfigSummary {
        meta,
        treatment,
        taus,
        rows: summaries,
        ceiling_gap,
        factorial,
    })
}

/// Per `τ`, the paired test of Jaccard(exact, replica) − Jaccard(exact, treatment) over
/// every complete key ([`stats::jaccard_gap_bootstrap`]).
fn ceiling_gap(
    triples: &[Triple],
    treatment: Pass,
    taus: &[f64],
    opts: &AnalyzeOptions,
) -> Result<Vec<Option<JaccardGap>>> {
    let keyed =
        |p: Pass| -> Vec<(Key, f64)> { triples.iter().map(|t| (t.key, t.get(p).a_hat)).collect() };
    let (ex, rep, tr) = (keyed(Pass::Exact), keyed(Pass::Replica), keyed(treatment));
    taus.iter()
        .map(|&tau| {
            stats::jaccard_gap_bootstrap(
                [&ex, &rep, &tr],
                tau,
                |k: &Key| u64::from(k.problem),
                opts.reps,
                opts.seed,
                opts.level,
            )
        })
        .collect()
}

/// The state × schedule design of `state` and its replica-schedule `twin` over the keys with
/// exact, replica, state and twin estimates; `None` when no key has all four.
pub fn factorial(
    rows: &[EstimateRow],
    state: Pass,
    twin: Pass,
    opts: &AnalyzeOptions,
) -> Result<Option<Factorial>> {
    let order = [Pass::Exact, Pass::Replica, state, twin];
    let mut by_key: BTreeMap<Key, [Option<Est>; 4]> = BTreeMap::new();
    for r in rows {
        let Some(i) = order.iter().position(|&p| p == r.pass) else {
            continue;
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
    let quads: Vec<(Key, [Est; 4])> = by_key
        .into_iter()
        .filter_map(|(k, e)| Some((k, [e[0]?, e[1]?, e[2]?, e[3]?])))
        .collect();
    if quads.is_empty() {
        return Ok(None);
    }
    let clusters: Vec<u64> = quads.iter().map(|(k, _)| u64::from(k.problem)).collect();
    let n_problems = clusters.iter().collect::<BTreeSet<_>>().len();
    let mut out = Vec::with_capacity(Conditioning::ALL.len());
    for cond in Conditioning::ALL {
        // flags[c][j]: Some(disagree) when key j is eligible for exact vs cell c's pass.
        let flags: Vec<Vec<Option<bool>>> = (1..4)
            .map(|i| {
                quads
                    .iter()
                    .map(|(_, e)| {
                        cond.eligible(e[0], e[i])
                            .then_some(e[0].a_hat != e[i].a_hat)
                    })
                    .collect()
            })
            .collect();
        let rate = |f: &[Option<bool>], rows: &mut dyn Iterator<Item = usize>| {
            let (mut h, mut n) = (0u64, 0u64);
            for j in rows {
                if let Some(d) = f[j] {
                    h += u64::from(d);
                    n += 1;
                }
            }
            (n > 0).then(|| h as f64 / n as f64)
        };
        let effect = |coef: [f64; 3]| -> Result<Effect> {
            let stat = |rows: &[usize]| -> f64 {
                let mut total = 0.0;
                for (c, f) in coef.iter().zip(&flags) {
                    if *c == 0.0 {
                        continue;
                    }
                    match rate(f, &mut rows.iter().copied()) {
                        Some(r) => total += c * r,
                        None => return f64::NAN,
                    }
                }
                total
            };
            let all: Vec<usize> = (0..quads.len()).collect();
            let estimate = Some(stat(&all)).filter(|x| x.is_finite());
            let r = stats::cluster_bootstrap_rows(&clusters, opts.reps, opts.seed, |rows, _| {
                stat(rows)
            })?;
            let p_value = stats::percentile_p_value(&r);
            Ok(Effect {
                estimate,
                ci: stats::percentile_interval(r, opts.level)?,
                p_value,
            })
        };
        let mut cells = Vec::with_capacity(3);
        for (i, f) in flags.iter().enumerate() {
            let n_eligible = f.iter().flatten().count();
            cells.push(FactorialCell {
                pass: order[i + 1],
                n_eligible,
                n_disagree: f.iter().flatten().filter(|&&d| d).count(),
                rate: if n_eligible == 0 {
                    None
                } else {
                    stats::share_bootstrap(f, &clusters, 0.0, opts.reps, opts.seed, opts.level)?
                },
            });
        }
        out.push(FactorialRow {
            conditioning: cond,
            cells: [cells[0], cells[1], cells[2]],
            excess: effect([-1.0, 0.0, 1.0])?,
            interaction: effect([-1.0, -1.0, 1.0])?,
        });
    }
    Ok(Some(Factorial {
        state,
        twin,
        n_keys: quads.len(),
        n_problems,
        rows: out,
    }))
}
