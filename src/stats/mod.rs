//! Statistics for three-pass counterfactual credit campaigns (exact / refeed / replica).
//!
//! Small pure functions over slices. Observations are per-estimate values `values[j]` with a
//! parallel slice of problem ids `clusters[j]` (any `u64`; rows need not be sorted or
//! contiguous). Inference is clustered by problem with `G − 1` degrees of freedom.
//!
//! Conventions shared by every function:
//! - **Invalid arguments** (length mismatch, empty input, non-finite values, `level` outside
//!   `(0, 1)`, `reps == 0`, duplicate keys) return `Err(Error::Spec("stats: …"))`.
//! - **Degenerate data** never panics and never yields NaN: `G < 2` gives `se = None`,
//!   `t = None`, `p_value = None`; zero between-cluster variance (all cluster means equal
//!   up to summation rounding, e.g. no flips at all) gives `se = Some(0.0)`, `t = None`,
//!   `p_value = None` and a point CI.
//!   An empty Jaccard union gives `value = None`.
//! - **Bootstrap** is deterministic: [`SplitMix64`] seeded by the caller, problems drawn with
//!   replacement, percentile CI with linear interpolation (numpy's default `'linear'`).
//! - A difference of two rates over **different** subsets of the rows (the excess under
//!   any-informative conditioning) has its own tests, [`rate_difference_t`] and
//!   [`rate_difference_bootstrap`]; a mean of per-row contrasts is not a test of it.
//!
//! The fixture `tests/fixtures/stats/stats_fixture.json` (from `gen_stats_fixture.py`, using
//! numpy/scipy/statsmodels) pins every formula here.
use std::collections::{BTreeMap, BTreeSet};

use statrs::distribution::{ContinuousCDF, Normal, StudentsT};

use crate::{Error, Result};

#[cfg(test)]
mod tests;

fn spec(msg: impl std::fmt::Display) -> Error {
    Error::Spec(format!("stats: {msg}"))
}

fn check_level(level: f64) -> Result<()> {
    if level > 0.0 && level < 1.0 {
        Ok(())
    } else {
        Err(spec(format_args!(
            "confidence level {level} is not in (0, 1)"
        )))
    }
}

fn check_clustered(values: &[f64], clusters: &[u64]) -> Result<()> {
    if values.len() != clusters.len() {
        return Err(spec(format_args!(
            "{} values but {} cluster ids",
            values.len(),
            clusters.len()
        )));
    }
    if values.is_empty() {
        return Err(spec("no observations"));
    }
    if let Some(j) = values.iter().position(|v| !v.is_finite()) {
        return Err(spec(format_args!(
            "value {j} is not finite ({})",
            values[j]
        )));
    }
    Ok(())
}

/// Row indices grouped by cluster id, groups in ascending id order, rows in input order.
fn group_rows(clusters: &[u64]) -> Vec<Vec<usize>> {
    let mut map: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for (j, &g) in clusters.iter().enumerate() {
        map.entry(g).or_default().push(j);
    }
    map.into_values().collect()
}

/// Per-cluster `(sum, count)` in ascending cluster-id order.
fn cluster_sums(values: &[f64], clusters: &[u64]) -> Vec<(f64, usize)> {
    group_rows(clusters)
        .into_iter()
        .map(|rows| (rows.iter().map(|&j| values[j]).sum(), rows.len()))
        .collect()
}

/// Per-cluster means and whether they are all equal up to summation rounding:
/// `max − min ≤ 4·ε·n_max·max_j |values_j|` (so `{0.1, 0.1, 0.1}` vs `{0.1}` counts as equal,
/// while any real spread of quantized estimates is many orders of magnitude larger).
fn cluster_means(values: &[f64], clusters: &[u64]) -> (Vec<f64>, bool) {
    let sums = cluster_sums(values, clusters);
    let means: Vec<f64> = sums.iter().map(|&(s, n)| s / n as f64).collect();
    let n_max = sums.iter().map(|&(_, n)| n).max().unwrap_or(0) as f64;
    let v_max = values.iter().fold(0.0_f64, |m, v| m.max(v.abs()));
    let (lo, hi) = means
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &d| {
            (lo.min(d), hi.max(d))
        });
    (means, hi - lo <= 4.0 * f64::EPSILON * n_max * v_max)
}

/// Per-estimate contrast `D_j = 1[exact ≠ refeed] − 1[exact ≠ replica]`, compared exactly.
pub fn flip_contrast(exact: f64, refeed: f64, replica: f64) -> f64 {
    f64::from(u8::from(exact != refeed)) - f64::from(u8::from(exact != replica))
}

/// One-sample t test of a clustered mean against zero.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TTest {
    /// Point estimate (the mean the test is about).
    pub estimate: f64,
    /// Standard error; `None` when `G < 2`, `Some(0.0)` when all cluster means are equal
    /// (up to summation rounding).
    pub se: Option<f64>,
    /// `estimate / se`; `None` when `se` is `None` or zero.
    pub t: Option<f64>,
    /// Degrees of freedom, `G − 1` (0 when `G == 1`).
    pub df: usize,
    /// Two-sided p-value from Student t with `df` degrees of freedom; `None` when `t` is.
    pub p_value: Option<f64>,
    /// Number of clusters `G`.
    pub n_clusters: usize,
    /// Number of observations `N`.
    pub n_obs: usize,
}

fn students_t(df: usize) -> StudentsT {
    StudentsT::new(0.0, 1.0, df as f64).expect("df >= 1 is a valid Student t")
}

impl TTest {
    fn new(estimate: f64, se: Option<f64>, n_clusters: usize, n_obs: usize) -> TTest {
        let df = n_clusters.saturating_sub(1);
        let t = se.filter(|&s| s > 0.0).map(|s| estimate / s);
        let p_value = t.map(|t| (2.0 * students_t(df).sf(t.abs())).clamp(0.0, 1.0));
        TTest {
            estimate,
            se,
            t,
            df,
            p_value,
            n_clusters,
            n_obs,
        }
    }

    /// Two-sided t interval `estimate ± t_{df, 1−α/2} · se`. `Ok(None)` when `se` is `None`
    /// (`G < 2`); a zero `se` gives the point interval `(estimate, estimate)`.
    pub fn confidence_interval(&self, level: f64) -> Result<Option<(f64, f64)>> {
        check_level(level)?;
        let Some(se) = self.se else { return Ok(None) };
        if se == 0.0 {
            return Ok(Some((self.estimate, self.estimate)));
        }
        let q = students_t(self.df).inverse_cdf(1.0 - (1.0 - level) / 2.0);
        Ok(Some((self.estimate - q * se, self.estimate + q * se)))
    }
}

/// Cluster-mean t test: `d_g` = mean of `values` in cluster `g`; `estimate = mean(d)`,
/// `se = sd(d)/√G` (sd with `G − 1` denominator), `G − 1` df. Every problem weighs the same.
pub fn cluster_mean_t(values: &[f64], clusters: &[u64]) -> Result<TTest> {
    check_clustered(values, clusters)?;
    let (d, equal) = cluster_means(values, clusters);
    let g = d.len();
    let mean = d.iter().sum::<f64>() / g as f64;
    if equal {
        let se = (g >= 2).then_some(0.0);
        return Ok(TTest::new(mean, se, g, values.len()));
    }
    let var = d.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (g - 1) as f64;
    Ok(TTest::new(
        mean,
        Some((var / g as f64).sqrt()),
        g,
        values.len(),
    ))
}

/// CR1 cluster-robust t test of an intercept-only OLS: `β = mean_j values_j` (pooled, every
/// estimate weighs the same), `e_j = values_j − β`,
/// `V = G/(G−1) · Σ_g (Σ_{j∈g} e_j)² / N²`, `t = β/√V`, `G − 1` df.
///
/// statsmodels' `OLS(y, ones).fit(cov_type='cluster')` multiplies by
/// `G/(G−1) · (N−1)/(N−K)`; with `K = 1` the second factor is 1, so its default `se` equals
/// this one. Its default p-values use the normal distribution; `use_t=True` matches ours.
pub fn cr1_t(values: &[f64], clusters: &[u64]) -> Result<TTest> {
    check_clustered(values, clusters)?;
    let (means, equal) = cluster_means(values, clusters);
    let (g, n) = (means.len(), values.len());
    let beta = values.iter().sum::<f64>() / n as f64;
    let se = if g < 2 {
        None
    } else if equal {
        Some(0.0)
    } else {
        // Residual sums computed from the rows (not S_g − n_g·β) to keep cancellation small.
        let meat: f64 = group_rows(clusters)
            .iter()
            .map(|rows| rows.iter().map(|&j| values[j] - beta).sum::<f64>().powi(2))
            .sum();
        let v = g as f64 / (g - 1) as f64 * meat / (n as f64 * n as f64);
        Some(v.sqrt())
    };
    Ok(TTest::new(beta, se, g, n))
}

/// SplitMix64 (Steele, Lea & Flood 2014): the seeded PRNG behind every bootstrap here.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose whole future is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Index in `0..n` by multiply-shift `(x · n) >> 64` (bias ≤ n/2⁶⁴, negligible). `n > 0`.
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A percentile bootstrap confidence interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BootstrapCi {
    /// Lower bound: the `(1−level)/2` quantile of the finite replicates.
    pub lo: f64,
    /// Upper bound: the `(1+level)/2` quantile of the finite replicates.
    pub hi: f64,
    /// Nominal coverage.
    pub level: f64,
    /// Replicates drawn.
    pub reps: usize,
    /// Replicates whose statistic was finite (the others are dropped, e.g. empty Jaccard unions).
    pub valid_reps: usize,
}

/// Statistic for [`cluster_bootstrap_ci`]: the pooled mean of all values (NaN if empty).
pub fn pooled_mean(values: &[f64], _clusters: &[u64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

/// Statistic for [`cluster_bootstrap_ci`]: the mean over clusters of per-cluster means, the
/// estimand of [`cluster_mean_t`] (NaN if empty).
pub fn mean_of_cluster_means(values: &[f64], clusters: &[u64]) -> f64 {
    let sums = cluster_sums(values, clusters);
    sums.iter().map(|&(s, n)| s / n as f64).sum::<f64>() / sums.len() as f64
}

/// Draw `reps` cluster-bootstrap replicates of the rows grouped by `clusters` and call `stat`
/// on each: the drawn rows (indices into the input, in draw order) and, parallel to them, the
/// replicate's cluster ids (`k` for the `k`-th draw, so a problem drawn twice counts as two
/// clusters). Each replicate draws `G` problems uniformly with replacement, problems indexed in
/// ascending id order, from [`SplitMix64`] seeded with `seed`.
fn bootstrap_draws<F>(clusters: &[u64], reps: usize, seed: u64, mut stat: F) -> Result<Vec<f64>>
where
    F: FnMut(&[usize], &[u64]) -> f64,
{
    if reps == 0 {
        return Err(spec("bootstrap needs reps >= 1"));
    }
    let groups = group_rows(clusters);
    let g = groups.len();
    let mut rng = SplitMix64::new(seed);
    let (mut rows, mut ids) = (
        Vec::with_capacity(clusters.len()),
        Vec::with_capacity(clusters.len()),
    );
    let mut out = Vec::with_capacity(reps);
    for _ in 0..reps {
        rows.clear();
        ids.clear();
        for k in 0..g {
            for &j in &groups[rng.below(g)] {
                rows.push(j);
                ids.push(k as u64);
            }
        }
        out.push(stat(&rows, &ids));
    }
    Ok(out)
}

/// The statistic of each of `reps` cluster-bootstrap replicates of the rows grouped by
/// `clusters`: `stat` gets the drawn row indices (into the caller's slices, in draw order) and,
/// parallel to them, the replicate's cluster ids (`k` for the `k`-th draw). Drawn exactly as
/// [`cluster_bootstrap_replicates`], so the same seed and clusters resample the same problems
/// for every statistic: several statistics of one resample stay paired.
pub fn cluster_bootstrap_rows<F>(
    clusters: &[u64],
    reps: usize,
    seed: u64,
    stat: F,
) -> Result<Vec<f64>>
where
    F: FnMut(&[usize], &[u64]) -> f64,
{
    if clusters.is_empty() {
        return Err(spec("no observations"));
    }
    bootstrap_draws(clusters, reps, seed, stat)
}

/// The raw statistic of each of `reps` cluster-bootstrap replicates (in draw order).
///
/// Each replicate draws `G` problems uniformly with replacement (problems indexed in ascending
/// id order, draws from [`SplitMix64`] seeded with `seed`) and calls `stat` on the
/// concatenated rows. Rows of the `k`-th draw get cluster id `k`, so a problem drawn twice
/// counts as two clusters. Values may be non-finite if `stat` returns them.
pub fn cluster_bootstrap_replicates<F>(
    values: &[f64],
    clusters: &[u64],
    stat: F,
    reps: usize,
    seed: u64,
) -> Result<Vec<f64>>
where
    F: Fn(&[f64], &[u64]) -> f64,
{
    check_clustered(values, clusters)?;
    let mut rv = Vec::with_capacity(values.len());
    bootstrap_draws(clusters, reps, seed, |rows, ids| {
        rv.clear();
        rv.extend(rows.iter().map(|&j| values[j]));
        stat(&rv, ids)
    })
}

/// Linear-interpolation quantile (numpy `'linear'`, Hyndman–Fan type 7) of sorted data.
fn quantile_sorted(sorted: &[f64], q: f64) -> f64 {
    let h = (sorted.len() - 1) as f64 * q;
    let lo = h.floor() as usize;
    let hi = (lo + 1).min(sorted.len() - 1);
    sorted[lo] + (h - lo as f64) * (sorted[hi] - sorted[lo])
}

/// Percentile interval of the finite `replicates` (`None` if none is finite).
fn percentile_ci(mut replicates: Vec<f64>, level: f64) -> Option<BootstrapCi> {
    let reps = replicates.len();
    replicates.retain(|x| x.is_finite());
    if replicates.is_empty() {
        return None;
    }
    replicates.sort_by(f64::total_cmp);
    let a = (1.0 - level) / 2.0;
    Some(BootstrapCi {
        lo: quantile_sorted(&replicates, a),
        hi: quantile_sorted(&replicates, 1.0 - a),
        level,
        reps,
        valid_reps: replicates.len(),
    })
}

/// Percentile interval at `level` of the finite `replicates` (non-finite ones are dropped);
/// `Ok(None)` if none is finite.
pub fn percentile_interval(replicates: Vec<f64>, level: f64) -> Result<Option<BootstrapCi>> {
    check_level(level)?;
    Ok(percentile_ci(replicates, level))
}

/// Two-sided percentile-bootstrap p-value of `statistic = 0`:
/// `min(1, 2 · min(#{r ≤ 0}, #{r ≥ 0}) / n)` over the `n` finite replicates (`None` if none
/// is). It inverts the equal-tailed percentile interval: `p < 1 − level` exactly when 0 lies
/// outside the empirical `level` interval (up to interpolation). Replicates equal to 0 count
/// on both sides, so ties make it conservative.
pub fn percentile_p_value(replicates: &[f64]) -> Option<f64> {
    let finite = replicates.iter().filter(|x| x.is_finite());
    let (mut n, mut le, mut ge) = (0usize, 0usize, 0usize);
    for &x in finite {
        n += 1;
        le += usize::from(x <= 0.0);
        ge += usize::from(x >= 0.0);
    }
    (n > 0).then(|| (2.0 * le.min(ge) as f64 / n as f64).min(1.0))
}

/// Percentile cluster-bootstrap CI of `stat` (see [`cluster_bootstrap_replicates`]).
/// Non-finite replicates are dropped; `Ok(None)` if none is finite. Same seed → same CI.
pub fn cluster_bootstrap_ci<F>(
    values: &[f64],
    clusters: &[u64],
    stat: F,
    reps: usize,
    seed: u64,
    level: f64,
) -> Result<Option<BootstrapCi>>
where
    F: Fn(&[f64], &[u64]) -> f64,
{
    check_level(level)?;
    let r = cluster_bootstrap_replicates(values, clusters, stat, reps, seed)?;
    Ok(percentile_ci(r, level))
}

fn check_subsets(a: &[Option<bool>], b: &[Option<bool>], clusters: &[u64]) -> Result<()> {
    if a.len() != clusters.len() || b.len() != clusters.len() {
        return Err(spec(format_args!(
            "{} and {} subset flags but {} cluster ids",
            a.len(),
            b.len(),
            clusters.len()
        )));
    }
    if clusters.is_empty() {
        return Err(spec("no observations"));
    }
    for (which, s) in [("a", a), ("b", b)] {
        if s.iter().all(Option::is_none) {
            return Err(spec(format_args!("rate {which} has no member rows")));
        }
    }
    Ok(())
}

/// `(successes, members)` of a subset over the given rows.
fn subset_counts(s: &[Option<bool>], rows: impl Iterator<Item = usize>) -> (u64, u64) {
    rows.fold((0, 0), |(h, n), j| match s[j] {
        Some(hit) => (h + u64::from(hit), n + 1),
        None => (h, n),
    })
}

/// Difference of two proportions, each over its own subset of the rows: `r_a − r_b` with
/// `r_s = #{j : s_j = Some(true)} / #{j : s_j ≠ None}` (`None` marks a row outside the
/// subset). `None` when either subset is empty.
pub fn rate_difference(a: &[Option<bool>], b: &[Option<bool>]) -> Option<f64> {
    let rate = |s: &[Option<bool>]| {
        let (h, n) = subset_counts(s, 0..s.len());
        (n > 0).then(|| h as f64 / n as f64)
    };
    Some(rate(a)? - rate(b)?)
}

/// Cluster-robust (CR1) t test of a [`rate_difference`] by linearization (the delta method of
/// a difference of two ratio estimators, as in survey statistics).
///
/// With `N_s` members, `H_s` successes and `r_s = H_s/N_s`, cluster `g` contributes
/// `z_g = Σ_{j∈g∩a} (y_j − r_a)/N_a − Σ_{j∈g∩b} (y_j − r_b)/N_b`;
/// `V = G/(G−1) · Σ_g z_g²`, `t = (r_a − r_b)/√V`, `G − 1` df, where `G` counts every
/// cluster of the input (rows in neither subset keep their cluster in `G`). When both subsets
/// are the same rows this is exactly [`cr1_t`] of `D_j = 1[a_j] − 1[b_j]` over them. The
/// `z_g` are computed from integer counts, so "all `z_g` are 0" (`se = 0`, no `t`) is exact.
/// Errors on length mismatch, no rows, or an empty subset.
pub fn rate_difference_t(
    a: &[Option<bool>],
    b: &[Option<bool>],
    clusters: &[u64],
) -> Result<TTest> {
    check_subsets(a, b, clusters)?;
    let all = 0..clusters.len();
    let ((ha, na), (hb, nb)) = (subset_counts(a, all.clone()), subset_counts(b, all));
    let estimate = ha as f64 / na as f64 - hb as f64 / nb as f64;
    let groups = group_rows(clusters);
    let g = groups.len();
    if g < 2 {
        return Ok(TTest::new(estimate, None, g, clusters.len()));
    }
    // z_g = (H_ag·N_a − H_a·n_ag)/N_a² − (H_bg·N_b − H_b·n_bg)/N_b²: integer numerators.
    let (na_i, nb_i) = (i128::from(na), i128::from(nb));
    let (ha_i, hb_i) = (i128::from(ha), i128::from(hb));
    let mut all_zero = true;
    let mut meat = 0.0;
    for rows in &groups {
        let (hag, nag) = subset_counts(a, rows.iter().copied());
        let (hbg, nbg) = subset_counts(b, rows.iter().copied());
        let num_a = i128::from(hag) * na_i - ha_i * i128::from(nag);
        let num_b = i128::from(hbg) * nb_i - hb_i * i128::from(nbg);
        all_zero &= num_a * nb_i * nb_i == num_b * na_i * na_i;
        let z = num_a as f64 / (na as f64 * na as f64) - num_b as f64 / (nb as f64 * nb as f64);
        meat += z * z;
    }
    let se = if all_zero {
        0.0
    } else {
        (g as f64 / (g - 1) as f64 * meat).sqrt()
    };
    Ok(TTest::new(estimate, Some(se), g, clusters.len()))
}

/// Cluster bootstrap of a [`rate_difference`]: each replicate (drawn as in
/// [`cluster_bootstrap_replicates`], so the same seed draws the same problems) recomputes both
/// subsets' rates over its rows, i.e. both eligible sets are recomputed per replicate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateDifferenceBootstrap {
    /// Percentile interval; replicates where either subset is empty are dropped.
    pub ci: BootstrapCi,
    /// [`percentile_p_value`] of the same replicates.
    pub p_value: f64,
}

/// Percentile CI and percentile p-value of [`rate_difference`] by cluster bootstrap (see
/// [`RateDifferenceBootstrap`]). `Ok(None)` if every replicate had an empty subset.
pub fn rate_difference_bootstrap(
    a: &[Option<bool>],
    b: &[Option<bool>],
    clusters: &[u64],
    reps: usize,
    seed: u64,
    level: f64,
) -> Result<Option<RateDifferenceBootstrap>> {
    check_level(level)?;
    check_subsets(a, b, clusters)?;
    let r = bootstrap_draws(clusters, reps, seed, |rows, _| {
        let ((ha, na), (hb, nb)) = (
            subset_counts(a, rows.iter().copied()),
            subset_counts(b, rows.iter().copied()),
        );
        if na == 0 || nb == 0 {
            f64::NAN
        } else {
            ha as f64 / na as f64 - hb as f64 / nb as f64
        }
    })?;
    let p_value = percentile_p_value(&r);
    Ok(percentile_ci(r, level)
        .zip(p_value)
        .map(|(ci, p_value)| RateDifferenceBootstrap { ci, p_value }))
}

/// A proportion over a subset of the rows, `#{j : s_j = Some(true)} / #{j : s_j ≠ None}`, with
/// a cluster-bootstrap interval and a percentile test against a null value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShareBootstrap {
    /// The proportion over all rows.
    pub estimate: f64,
    /// Percentile interval; replicates with an empty subset are dropped.
    pub ci: BootstrapCi,
    /// The null value tested.
    pub null: f64,
    /// [`percentile_p_value`] of `replicate − null`: two-sided p of `share = null`.
    pub p_value: f64,
}

/// Cluster bootstrap of a proportion over a subset (`None` marks a row outside it), e.g. the
/// share of zero-boundary crossings among the disagreements: problems are resampled (every
/// problem of `clusters`, also those with no member row) and numerator and denominator are
/// recomputed per replicate, so the interval reflects that the members of one problem are
/// correlated. `Ok(None)` when the subset is empty or every replicate's subset is. Errors on
/// a length mismatch, no rows, or a `null` outside `[0, 1]`.
pub fn share_bootstrap(
    s: &[Option<bool>],
    clusters: &[u64],
    null: f64,
    reps: usize,
    seed: u64,
    level: f64,
) -> Result<Option<ShareBootstrap>> {
    check_level(level)?;
    if s.len() != clusters.len() {
        return Err(spec(format_args!(
            "{} subset flags but {} cluster ids",
            s.len(),
            clusters.len()
        )));
    }
    if clusters.is_empty() {
        return Err(spec("no observations"));
    }
    if !(0.0..=1.0).contains(&null) {
        return Err(spec(format_args!("null share {null} is not in [0, 1]")));
    }
    let (h, n) = subset_counts(s, 0..s.len());
    if n == 0 {
        return Ok(None);
    }
    let r = bootstrap_draws(clusters, reps, seed, |rows, _| {
        let (h, n) = subset_counts(s, rows.iter().copied());
        if n == 0 {
            f64::NAN
        } else {
            h as f64 / n as f64
        }
    })?;
    let centred: Vec<f64> = r.iter().map(|x| x - null).collect();
    Ok(percentile_p_value(&centred)
        .zip(percentile_ci(r, level))
        .map(|(p_value, ci)| ShareBootstrap {
            estimate: h as f64 / n as f64,
            ci,
            null,
            p_value,
        }))
}

/// Two one-sided tests (TOST) of equivalence, `−margin < μ < margin`, on the estimate and
/// standard error of a [`TTest`] (Student t, same df).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tost {
    /// The equivalence margin `m > 0`.
    pub margin: f64,
    /// p of `H0: μ ≤ −m` against `μ > −m`: `P(T ≥ (est + m)/se)`.
    pub p_lower: f64,
    /// p of `H0: μ ≥ m` against `μ < m`: `P(T ≤ (est − m)/se)`.
    pub p_upper: f64,
    /// `max(p_lower, p_upper)`: equivalence is shown at level α when it is below α (the same
    /// as the `1 − 2α` t interval lying inside `(−m, m)`).
    pub p_value: f64,
}

impl Tost {
    /// Whether equivalence within `±margin` is shown at level `alpha`.
    pub fn equivalent(&self, alpha: f64) -> bool {
        self.p_value < alpha
    }
}

/// TOST of `|μ| < margin` from a t test. `Ok(None)` when the test has no standard error
/// (`G < 2`); a zero standard error (no spread between problems) gives p = 0 on a side the
/// estimate is strictly inside and 1 otherwise. Non-rejection is not evidence of a
/// difference, and rejection by the t test of `μ = 0` is not evidence against equivalence:
/// the two answer different questions. Errors if `margin` is not finite and positive.
pub fn tost(t: &TTest, margin: f64) -> Result<Option<Tost>> {
    if !(margin.is_finite() && margin > 0.0) {
        return Err(spec(format_args!(
            "equivalence margin {margin} is not a positive number"
        )));
    }
    let Some(se) = t.se else { return Ok(None) };
    let (p_lower, p_upper) = if se == 0.0 {
        (
            f64::from(u8::from(t.estimate <= -margin)),
            f64::from(u8::from(t.estimate >= margin)),
        )
    } else {
        let dist = students_t(t.df);
        (
            dist.sf((t.estimate + margin) / se).clamp(0.0, 1.0),
            dist.cdf((t.estimate - margin) / se).clamp(0.0, 1.0),
        )
    };
    Ok(Some(Tost {
        margin,
        p_lower,
        p_upper,
        p_value: p_lower.max(p_upper),
    }))
}

/// Holm's step-down adjustment of a family of p-values (Holm 1979): with the `m` present
/// p-values sorted, `p̃_(i) = max_{j ≤ i} min(1, (m − j + 1) · p_(j))`, returned in input
/// order; `None` entries are not tests and stay `None` (they do not count in `m`). Rejecting
/// where `p̃ < α` controls the family-wise error rate at α. Errors on a p-value outside
/// `[0, 1]`.
pub fn holm(p: &[Option<f64>]) -> Result<Vec<Option<f64>>> {
    if let Some(bad) = p.iter().flatten().find(|x| !(0.0..=1.0).contains(*x)) {
        return Err(spec(format_args!("p-value {bad} is not in [0, 1]")));
    }
    let mut order: Vec<usize> = (0..p.len()).filter(|&i| p[i].is_some()).collect();
    order.sort_by(|&a, &b| p[a].unwrap_or(0.0).total_cmp(&p[b].unwrap_or(0.0)));
    let m = order.len();
    let mut out = vec![None; p.len()];
    let mut running = 0.0_f64;
    for (j, &i) in order.iter().enumerate() {
        let adj = ((m - j) as f64 * p[i].unwrap_or(0.0)).min(1.0);
        running = running.max(adj);
        out[i] = Some(running);
    }
    Ok(out)
}

/// Clustered CIs of a mean of per-estimate values (e.g. `Â_refeed − Â_exact`, whose mean
/// should be zero). Both CIs target the mean of per-problem means.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClusteredMeanCi {
    /// The cluster-mean t test ([`cluster_mean_t`]).
    pub t_test: TTest,
    /// Its t interval; `None` when `G < 2`.
    pub t_ci: Option<(f64, f64)>,
    /// Cluster-bootstrap percentile interval of [`mean_of_cluster_means`].
    pub bootstrap_ci: Option<BootstrapCi>,
}

/// Cluster-mean t CI and cluster-bootstrap CI of the mean of `values`.
pub fn clustered_mean_ci(
    values: &[f64],
    clusters: &[u64],
    level: f64,
    reps: usize,
    seed: u64,
) -> Result<ClusteredMeanCi> {
    let t_test = cluster_mean_t(values, clusters)?;
    Ok(ClusteredMeanCi {
        t_test,
        t_ci: t_test.confidence_interval(level)?,
        bootstrap_ci: cluster_bootstrap_ci(
            values,
            clusters,
            mean_of_cluster_means,
            reps,
            seed,
            level,
        )?,
    })
}

/// How two differing quantized estimates `a ≠ b` disagree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Disagreement {
    /// Exactly one of the two is zero.
    ZeroBoundary,
    /// One is positive, the other negative.
    PolarityReversal,
    /// Same non-zero sign, different value.
    Magnitude,
}

/// Classify a pair of quantized estimates, compared exactly (`-0.0 == 0.0`). `None` when they
/// are equal, or when either is non-finite.
pub fn classify(a: f64, b: f64) -> Option<Disagreement> {
    if a == b || !a.is_finite() || !b.is_finite() {
        None
    } else if (a == 0.0) != (b == 0.0) {
        Some(Disagreement::ZeroBoundary)
    } else if (a > 0.0) != (b > 0.0) {
        Some(Disagreement::PolarityReversal)
    } else {
        Some(Disagreement::Magnitude)
    }
}

/// Counts of [`classify`] outcomes over paired estimates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DisagreementCounts {
    /// Pairs with `a == b`.
    pub agree: usize,
    /// [`Disagreement::ZeroBoundary`] pairs.
    pub zero_boundary: usize,
    /// [`Disagreement::PolarityReversal`] pairs.
    pub polarity_reversal: usize,
    /// [`Disagreement::Magnitude`] pairs.
    pub magnitude: usize,
}

/// Tally [`classify`] over parallel slices; errors on length mismatch or non-finite values.
pub fn tally_disagreements(a: &[f64], b: &[f64]) -> Result<DisagreementCounts> {
    if a.len() != b.len() {
        return Err(spec(format_args!(
            "{} vs {} paired estimates",
            a.len(),
            b.len()
        )));
    }
    let mut c = DisagreementCounts::default();
    for (&x, &y) in a.iter().zip(b) {
        if !x.is_finite() || !y.is_finite() {
            return Err(spec(format_args!("non-finite estimate pair ({x}, {y})")));
        }
        match classify(x, y) {
            None => c.agree += 1,
            Some(Disagreement::ZeroBoundary) => c.zero_boundary += 1,
            Some(Disagreement::PolarityReversal) => c.polarity_reversal += 1,
            Some(Disagreement::Magnitude) => c.magnitude += 1,
        }
    }
    Ok(c)
}

fn keyed_map<K: Ord + Clone>(est: &[(K, f64)], which: &str) -> Result<BTreeMap<K, f64>> {
    let mut m = BTreeMap::new();
    for (j, (k, v)) in est.iter().enumerate() {
        if !v.is_finite() {
            return Err(spec(format_args!(
                "{which}: estimate {j} is not finite ({v})"
            )));
        }
        if m.insert(k.clone(), *v).is_some() {
            return Err(spec(format_args!("{which}: duplicate key at entry {j}")));
        }
    }
    Ok(m)
}

fn check_tau(tau: f64) -> Result<()> {
    if tau.is_finite() {
        Ok(())
    } else {
        Err(spec(format_args!("threshold tau {tau} is not finite")))
    }
}

/// Critical set `C(τ) = {key : |Â| ≥ τ}`, compared exactly (produce estimates as
/// `count as f64 / K as f64` and τ the same way so boundary values land exactly).
/// Errors on duplicate keys, non-finite estimates, or non-finite τ.
pub fn critical_set<K: Ord + Clone>(estimates: &[(K, f64)], tau: f64) -> Result<BTreeSet<K>> {
    check_tau(tau)?;
    Ok(keyed_map(estimates, "estimates")?
        .into_iter()
        .filter(|(_, v)| v.abs() >= tau)
        .map(|(k, _)| k)
        .collect())
}

/// Overlap of two critical sets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JaccardResult {
    /// `|C_a|`.
    pub size_a: usize,
    /// `|C_b|`.
    pub size_b: usize,
    /// `|C_a ∩ C_b|`.
    pub intersection: usize,
    /// `|C_a ∪ C_b|`.
    pub union: usize,
    /// `intersection / union`; `None` when the union is empty (neither pass has a critical
    /// key: the overlap is undefined, not 0 or 1).
    pub value: Option<f64>,
}

/// Jaccard index of the critical sets `C_a(τ)`, `C_b(τ)` of two keyed passes. A key missing
/// from one pass is simply not in that pass's critical set.
pub fn jaccard<K: Ord + Clone>(a: &[(K, f64)], b: &[(K, f64)], tau: f64) -> Result<JaccardResult> {
    let (ca, cb) = (critical_set(a, tau)?, critical_set(b, tau)?);
    let intersection = ca.intersection(&cb).count();
    let union = ca.len() + cb.len() - intersection;
    Ok(JaccardResult {
        size_a: ca.len(),
        size_b: cb.len(),
        intersection,
        union,
        value: (union > 0).then(|| intersection as f64 / union as f64),
    })
}

/// Cluster-bootstrap percentile CI of the Jaccard index, resampling problems
/// (`problem_of(key)`). Every problem with a key in either pass is a cluster, also those with
/// no critical key; a problem drawn `m` times counts `m` times in both intersection and union.
/// Replicates with an empty union are dropped; `Ok(None)` if all are.
pub fn jaccard_bootstrap_ci<K, P>(
    a: &[(K, f64)],
    b: &[(K, f64)],
    tau: f64,
    problem_of: P,
    reps: usize,
    seed: u64,
    level: f64,
) -> Result<Option<BootstrapCi>>
where
    K: Ord + Clone,
    P: Fn(&K) -> u64,
{
    check_tau(tau)?;
    let (ma, mb) = (keyed_map(a, "pass a")?, keyed_map(b, "pass b")?);
    let keys: BTreeSet<&K> = ma.keys().chain(mb.keys()).collect();
    // Code each key as the number of passes whose critical set holds it: 2 = intersection,
    // >= 1 = union; 0 keeps its problem in the resampling frame.
    let crit = |m: &BTreeMap<K, f64>, k: &K| m.get(k).is_some_and(|v| v.abs() >= tau);
    let codes: Vec<f64> = keys
        .iter()
        .map(|k| f64::from(u8::from(crit(&ma, k)) + u8::from(crit(&mb, k))))
        .collect();
    let problems: Vec<u64> = keys.iter().map(|k| problem_of(k)).collect();
    let stat = |v: &[f64], _: &[u64]| {
        let inter = v.iter().filter(|&&c| c == 2.0).count();
        let union = v.iter().filter(|&&c| c >= 1.0).count();
        if union == 0 {
            f64::NAN
        } else {
            inter as f64 / union as f64
        }
    };
    cluster_bootstrap_ci(&codes, &problems, stat, reps, seed, level)
}

/// Paired cluster-bootstrap test of the gap between two Jaccard indices against one reference
/// pass: `J(ref, ceiling) − J(ref, treatment)` of the critical sets at `τ` (e.g. the replica
/// ceiling minus Jaccard(exact, refeed)).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JaccardGap {
    /// The gap on the data; `None` when either union is empty.
    pub estimate: Option<f64>,
    /// Percentile interval of the gap; replicates with either union empty are dropped.
    pub ci: BootstrapCi,
    /// [`percentile_p_value`] of the same replicates (two-sided, gap = 0).
    pub p_value: f64,
}

/// [`JaccardGap`] by cluster bootstrap: each replicate draws problems (`problem_of(key)`) with
/// replacement and recomputes **both** Jaccard indices on the same drawn keys, so the test is
/// paired (the two indices share `C_ref` and their problems' noise). `passes` are the keyed
/// estimates `[reference, ceiling, treatment]`. Every problem with a key in any pass is a
/// cluster. `Ok(None)` if every replicate had an empty union.
pub fn jaccard_gap_bootstrap<K, P>(
    passes: [&[(K, f64)]; 3],
    tau: f64,
    problem_of: P,
    reps: usize,
    seed: u64,
    level: f64,
) -> Result<Option<JaccardGap>>
where
    K: Ord + Clone,
    P: Fn(&K) -> u64,
{
    check_tau(tau)?;
    check_level(level)?;
    let [reference, ceiling, treatment] = passes;
    let maps = [
        keyed_map(reference, "reference pass")?,
        keyed_map(ceiling, "ceiling pass")?,
        keyed_map(treatment, "treatment pass")?,
    ];
    let keys: BTreeSet<&K> = maps.iter().flat_map(|m| m.keys()).collect();
    if keys.is_empty() {
        return Err(spec("no observations"));
    }
    // Each key as three bits: critical in reference (1), ceiling (2), treatment (4).
    let crit = |m: &BTreeMap<K, f64>, k: &K| m.get(k).is_some_and(|v| v.abs() >= tau);
    let codes: Vec<u8> = keys
        .iter()
        .map(|k| {
            u8::from(crit(&maps[0], k))
                | u8::from(crit(&maps[1], k)) << 1
                | u8::from(crit(&maps[2], k)) << 2
        })
        .collect();
    let problems: Vec<u64> = keys.iter().map(|k| problem_of(k)).collect();
    let gap = |rows: &mut dyn Iterator<Item = u8>| {
        let (mut ic, mut uc, mut it, mut ut) = (0usize, 0usize, 0usize, 0usize);
        for c in rows {
            let (r, cl, t) = (c & 1 != 0, c & 2 != 0, c & 4 != 0);
            ic += usize::from(r && cl);
            uc += usize::from(r || cl);
            it += usize::from(r && t);
            ut += usize::from(r || t);
        }
        if uc == 0 || ut == 0 {
            f64::NAN
        } else {
            ic as f64 / uc as f64 - it as f64 / ut as f64
        }
    };
    let estimate = Some(gap(&mut codes.iter().copied())).filter(|g| g.is_finite());
    let r = bootstrap_draws(&problems, reps, seed, |rows, _| {
        gap(&mut rows.iter().map(|&j| codes[j]))
    })?;
    let p_value = percentile_p_value(&r);
    Ok(percentile_ci(r, level)
        .zip(p_value)
        .map(|(ci, p_value)| JaccardGap {
            estimate,
            ci,
            p_value,
        }))
}

/// `successes / n` as "p% [lo, hi] (k/n)" with its Wilson interval at `level`;
/// "n/a (0 rows)" when `n == 0`.
pub fn wilson_rate(successes: u64, n: u64, level: f64) -> Result<String> {
    Ok(match wilson(successes, n, level)? {
        Some((lo, hi)) => format!(
            "{:.1}% [{:.1}, {:.1}] ({successes}/{n})",
            100.0 * successes as f64 / n as f64,
            100.0 * lo,
            100.0 * hi
        ),
        None => "n/a (0 rows)".into(),
    })
}

/// Wilson score interval for a binomial proportion `successes / n`, clamped to `[0, 1]`.
/// `Ok(None)` when `n == 0`; errors if `successes > n` or `level` is not in `(0, 1)`.
pub fn wilson(successes: u64, n: u64, level: f64) -> Result<Option<(f64, f64)>> {
    check_level(level)?;
    if successes > n {
        return Err(spec(format_args!("{successes} successes out of {n}")));
    }
    if n == 0 {
        return Ok(None);
    }
    let z = Normal::standard().inverse_cdf(1.0 - (1.0 - level) / 2.0);
    let (n, p) = (n as f64, successes as f64 / n as f64);
    let z2n = z * z / n;
    let center = (p + z2n / 2.0) / (1.0 + z2n);
    let half = z / (1.0 + z2n) * (p * (1.0 - p) / n + z2n / (4.0 * n)).sqrt();
    Ok(Some((
        (center - half).clamp(0.0, 1.0),
        (center + half).clamp(0.0, 1.0),
    )))
}

/// Two-sided exact McNemar p-value from the discordant counts `b` and `c`.
pub fn mcnemar_exact(b: u64, c: u64) -> f64 {
    let n = b + c;
    if n == 0 {
        return 1.0;
    }
    let ln_choose = |n: u64, k: u64| -> f64 {
        (1..=k)
            .map(|i| ((n - k + i) as f64).ln() - (i as f64).ln())
            .sum()
    };
    let tail: f64 = (0..=b.min(c))
        .map(|k| (ln_choose(n, k) - n as f64 * std::f64::consts::LN_2).exp())
        .sum();
    (2.0 * tail).min(1.0)
}
