//! Paired policy comparisons for `spectrum report`, one family per model and section.
//!
//! - Perplexity: for two variants measured on the same windows, the per-window difference
//!   `Δ%_a − Δ%_r` (points). The window is the cluster: its interval is a paired
//!   cluster-bootstrap percentile interval over windows (the same windows drawn for both
//!   variants), its p-value the paired t test of the per-window differences (`W − 1` df).
//! - NIAH: for two variants answering the same haystacks (depth × seed), the accuracy
//!   difference; the p-value is the exact McNemar test on the discordant haystacks, the
//!   interval a cluster bootstrap over seeds (haystacks of one seed share the needle).
//! - Holm's adjustment runs over each model's family (its perplexity pairs, its NIAH pairs).
//! - Power: the minimum detectable paired difference at 80% power, two-sided, from the
//!   observed SD of the paired differences and their count (paired t, noncentrality
//!   approximated by the t quantiles), at α = 0.05 and at Holm's first step α / m.
//!
//! The pairs: at each budget, every variant against PDTrim, against `snapkv`, and against
//! `uniform-int8`; `spectrum` against `spectrum-position` with the same quantizer.
use super::eval::{NiahRow, PplRow, window_delta};
use crate::Result;
use crate::stats::mcnemar_exact;
use crate::stats::{self, BootstrapCi};
use statrs::distribution::{ContinuousCDF, StudentsT};
use std::collections::BTreeMap;

/// Policy, quantizer and nominal budget of a variant, as its rows name them.
pub type Key = (String, String, Option<f64>);

/// Family-wise error rate of the verdicts and the power's test level.
pub const ALPHA: f64 = 0.05;
/// Power of the minimum detectable difference.
pub const POWER: f64 = 0.8;
/// Bootstrap replicates per interval.
pub const REPS: usize = 10_000;
/// Seed of every bootstrap (a report is reproducible).
pub const SEED: u64 = 0x5EC7_0036;

/// The reference a variant is compared against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Against {
    /// PDTrim at the same budget (sinks and recent tokens, binary).
    PdTrim,
    /// `snapkv` at the same budget (importance-ranked, binary).
    SnapKv,
    /// `spectrum-position` at the same budget and quantizer (tiers by position).
    Position,
    /// `uniform-int8` with the same quantizer (every unprotected token at INT8).
    UniformInt8,
}

impl Against {
    /// The reference policy's name.
    pub fn policy(self) -> &'static str {
        match self {
            Against::PdTrim => "pdtrim",
            Against::SnapKv => "snapkv",
            Against::Position => "spectrum-position",
            Against::UniformInt8 => "uniform-int8",
        }
    }
}

/// Whether two quantizer names can be compared: equal, or one of them `none` (no INT tier).
fn compatible(a: &str, r: &str) -> bool {
    a == r || a == "none" || r == "none"
}

/// The pairs `(variant, reference, against)` among `keys`, each unordered pair once, in the
/// order budget, reference kind, then the variants' order in `keys`.
pub fn pairs(keys: &[Key]) -> Vec<(Key, Key, Against)> {
    let mut budgets: Vec<f64> = keys.iter().filter_map(|k| k.2).collect();
    budgets.sort_by(f64::total_cmp);
    budgets.dedup();
    let mut out: Vec<(Key, Key, Against)> = Vec::new();
    for b in budgets {
        for against in [
            Against::PdTrim,
            Against::SnapKv,
            Against::Position,
            Against::UniformInt8,
        ] {
            for r in keys.iter().filter(|r| r.0 == against.policy()) {
                // uniform-int8 has no budget: it is the reference at every budget.
                if against != Against::UniformInt8 && r.2 != Some(b) {
                    continue;
                }
                for a in keys.iter().filter(|a| a.2 == Some(b) && a.0 != r.0) {
                    let wanted = match against {
                        Against::Position => a.0 == "spectrum" && a.1 == r.1,
                        _ => compatible(&a.1, &r.1),
                    };
                    let seen = out
                        .iter()
                        .any(|(x, y, _)| (x == a && y == r) || (x == r && y == a));
                    if wanted && !seen {
                        out.push((a.clone(), r.clone(), against));
                    }
                }
            }
        }
    }
    out
}

/// `(t_{1−α/2} + t_{power}) · sd / √n` with `n − 1` df: the paired difference a two-sided
/// level-α t test detects with probability `power`; `None` below 2 pairs or without spread.
pub fn min_detectable(sd: f64, n: usize, alpha: f64, power: f64) -> Option<f64> {
    if n < 2 || !(sd.is_finite() && sd > 0.0) {
        return None;
    }
    let t = StudentsT::new(0.0, 1.0, (n - 1) as f64).ok()?;
    Some((t.inverse_cdf(1.0 - alpha / 2.0) + t.inverse_cdf(power)) * sd / (n as f64).sqrt())
}

/// The fewest pairs whose [`min_detectable`] reaches `|effect|` (up to 100,000).
pub fn pairs_needed(effect: f64, sd: f64, alpha: f64, power: f64) -> Option<usize> {
    if effect == 0.0 || !effect.is_finite() {
        return None;
    }
    (2..=100_000).find(|&n| min_detectable(sd, n, alpha, power).is_some_and(|m| m <= effect.abs()))
}

/// The fewest discordant haystacks, all one way, with which the exact McNemar test reaches
/// `p < alpha` (`2 · 2^−k < alpha`).
pub fn mcnemar_min_discordant(alpha: f64) -> u64 {
    (1..=64)
        .find(|&k| mcnemar_exact(k, 0) < alpha)
        .unwrap_or(64)
}

/// Sample SD (`n − 1` denominator); `None` below 2 values.
fn sd(x: &[f64]) -> Option<f64> {
    let n = x.len();
    if n < 2 {
        return None;
    }
    let mean = x.iter().sum::<f64>() / n as f64;
    Some((x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt())
}

/// One perplexity comparison.
#[derive(Debug, Clone)]
pub struct PplDiff {
    /// The variant.
    pub a: Key,
    /// The reference.
    pub r: Key,
    /// What the reference is.
    pub against: Against,
    /// Windows both were measured on.
    pub windows: usize,
    /// Mean over those windows of `Δ%_a − Δ%_r` (points).
    pub mean: f64,
    /// SD of the per-window differences.
    pub sd: Option<f64>,
    /// Paired cluster-bootstrap percentile interval (95%).
    pub ci: Option<BootstrapCi>,
    /// Paired t test p-value.
    pub p: Option<f64>,
    /// Holm-adjusted over the model's perplexity family.
    pub p_holm: Option<f64>,
    /// Minimum detectable difference at 80% power, α = 0.05.
    pub mde: Option<f64>,
    /// The same at Holm's first step, α / m.
    pub mde_family: Option<f64>,
    /// Windows for 80% power (α = 0.05) at the observed mean and SD.
    pub windows_needed: Option<usize>,
    /// Every per-window difference is exactly 0.
    pub identical: bool,
}

impl PplDiff {
    /// The verdict, no stronger than its test.
    pub fn verdict(&self) -> String {
        if self.identical {
            return format!("identical on all {} windows", self.windows);
        }
        if self.sd == Some(0.0) {
            return format!(
                "the same difference on all {} windows (no spread, no test)",
                self.windows
            );
        }
        match self.p_holm {
            Some(p) if p < ALPHA && self.mean < 0.0 => {
                format!("{} lower Δ% (Holm p < {ALPHA})", self.a.0)
            }
            Some(p) if p < ALPHA => format!("{} lower Δ% (Holm p < {ALPHA})", self.r.0),
            _ if self.windows < 2 => "no test (1 window)".into(),
            _ => format!("not distinguishable at {} windows", self.windows),
        }
    }
}

/// Per-window Δ% of `key`'s rows, by window.
fn by_window(rows: &[PplRow], key: &Key) -> BTreeMap<u32, f64> {
    rows.iter()
        .filter(|r| r.policy == key.0 && r.quantizer == key.1 && r.b == key.2)
        .map(|r| (r.window, window_delta(r)))
        .collect()
}

/// Every pair of [`pairs`] over `keys` on the windows both variants have, Holm over the family.
pub fn ppl_diffs(rows: &[PplRow], keys: &[Key]) -> Result<Vec<PplDiff>> {
    let mut out = Vec::new();
    for (a, r, against) in pairs(keys) {
        let (da, dr) = (by_window(rows, &a), by_window(rows, &r));
        let (mut d, mut w) = (Vec::new(), Vec::new());
        for (window, x) in &da {
            if let Some(y) = dr.get(window) {
                d.push(x - y);
                w.push(u64::from(*window));
            }
        }
        if d.is_empty() {
            continue;
        }
        let t = stats::cluster_mean_t(&d, &w)?;
        let ci = if d.len() >= 2 {
            let reps = stats::cluster_bootstrap_replicates(
                &d,
                &w,
                stats::mean_of_cluster_means,
                REPS,
                SEED,
            )?;
            stats::percentile_interval(reps, 1.0 - ALPHA)?
        } else {
            None
        };
        let s = sd(&d);
        out.push(PplDiff {
            windows: d.len(),
            mean: t.estimate,
            sd: s,
            ci,
            p: t.p_value,
            p_holm: None,
            mde: s.and_then(|s| min_detectable(s, d.len(), ALPHA, POWER)),
            mde_family: None,
            windows_needed: s.and_then(|s| pairs_needed(t.estimate, s, ALPHA, POWER)),
            identical: d.iter().all(|&x| x == 0.0),
            a,
            r,
            against,
        });
    }
    let holm = stats::holm(&out.iter().map(|x| x.p).collect::<Vec<_>>())?;
    let m = holm.iter().flatten().count().max(1);
    for (x, p) in out.iter_mut().zip(holm) {
        x.p_holm = p;
        x.mde_family =
            x.sd.and_then(|s| min_detectable(s, x.windows, ALPHA / m as f64, POWER));
    }
    Ok(out)
}

/// One NIAH comparison over the haystacks both variants answered.
#[derive(Debug, Clone)]
pub struct NiahDiff {
    /// The variant.
    pub a: Key,
    /// The reference.
    pub r: Key,
    /// What the reference is.
    pub against: Against,
    /// Haystacks both answered.
    pub haystacks: usize,
    /// Seeds among them (the bootstrap's clusters).
    pub seeds: usize,
    /// Correct under the variant, under the reference.
    pub correct: (u64, u64),
    /// Haystacks correct under the variant only, under the reference only.
    pub discordant: (u64, u64),
    /// Accuracy difference `a − r`.
    pub diff: f64,
    /// Cluster-bootstrap (over seeds) percentile interval of the difference (95%).
    pub ci: Option<BootstrapCi>,
    /// Exact McNemar p-value.
    pub p: f64,
    /// Holm-adjusted over the model's NIAH family.
    pub p_holm: f64,
    /// Minimum detectable accuracy difference at 80% power, α = 0.05 (paired t on the
    /// per-haystack differences).
    pub mde: Option<f64>,
}

impl NiahDiff {
    /// The verdict, no stronger than its test.
    pub fn verdict(&self) -> String {
        if self.p_holm < ALPHA {
            let better = if self.diff > 0.0 {
                &self.a.0
            } else {
                &self.r.0
            };
            format!("{better} more accurate (Holm p < {ALPHA})")
        } else {
            format!("not distinguishable at {} haystacks", self.haystacks)
        }
    }
}

/// Correctness of `key`'s answers by haystack `(depth bits, seed)`.
fn by_haystack(rows: &[NiahRow], key: &Key) -> BTreeMap<(u64, u64), bool> {
    rows.iter()
        .filter(|r| r.policy == key.0 && r.quantizer == key.1 && r.b == key.2)
        .map(|r| ((r.depth.to_bits(), r.seed), r.correct))
        .collect()
}

/// Every pair of [`pairs`] over `keys` on the haystacks both answered, Holm over the family.
pub fn niah_diffs(rows: &[NiahRow], keys: &[Key]) -> Result<Vec<NiahDiff>> {
    let mut out = Vec::new();
    for (a, r, against) in pairs(keys) {
        let (ha, hr) = (by_haystack(rows, &a), by_haystack(rows, &r));
        let (mut d, mut seeds) = (Vec::new(), Vec::new());
        let (mut correct, mut discordant) = ((0u64, 0u64), (0u64, 0u64));
        for (h, &x) in &ha {
            let Some(&y) = hr.get(h) else { continue };
            correct.0 += u64::from(x);
            correct.1 += u64::from(y);
            discordant.0 += u64::from(x && !y);
            discordant.1 += u64::from(y && !x);
            d.push(f64::from(u8::from(x)) - f64::from(u8::from(y)));
            seeds.push(h.1);
        }
        if d.is_empty() {
            continue;
        }
        let mut distinct = seeds.clone();
        distinct.sort_unstable();
        distinct.dedup();
        let ci = if distinct.len() >= 2 {
            let reps =
                stats::cluster_bootstrap_replicates(&d, &seeds, stats::pooled_mean, REPS, SEED)?;
            stats::percentile_interval(reps, 1.0 - ALPHA)?
        } else {
            None
        };
        let n = d.len();
        out.push(NiahDiff {
            haystacks: n,
            seeds: distinct.len(),
            correct,
            discordant,
            diff: d.iter().sum::<f64>() / n as f64,
            ci,
            p: mcnemar_exact(discordant.0, discordant.1),
            p_holm: 1.0,
            mde: sd(&d).and_then(|s| min_detectable(s, n, ALPHA, POWER)),
            a,
            r,
            against,
        });
    }
    let holm = stats::holm(&out.iter().map(|x| Some(x.p)).collect::<Vec<_>>())?;
    for (x, p) in out.iter_mut().zip(holm) {
        x.p_holm = p.unwrap_or(1.0);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(p: &str, q: &str, b: Option<f64>) -> Key {
        (p.into(), q.into(), b)
    }

    #[test]
    fn pairs_cover_every_reference_once() {
        let keys = vec![
            key("spectrum", "kivi", Some(0.5)),
            key("spectrum-position", "kivi", Some(0.5)),
            key("snapkv", "none", Some(0.5)),
            key("pdtrim", "none", Some(0.5)),
            key("uniform-int8", "kivi", None),
            key("spectrum", "kivi", Some(0.3)),
            key("pdtrim", "none", Some(0.3)),
        ];
        let p = pairs(&keys);
        let has = |a: &str, b: Option<f64>, r: &str| {
            p.iter()
                .filter(|(x, y, _)| x.0 == a && x.2 == b && y.0 == r)
                .count()
        };
        assert_eq!(has("spectrum", Some(0.5), "pdtrim"), 1);
        assert_eq!(has("spectrum", Some(0.5), "snapkv"), 1);
        assert_eq!(has("snapkv", Some(0.5), "pdtrim"), 1);
        assert_eq!(has("pdtrim", Some(0.5), "snapkv"), 0, "pair twice");
        assert_eq!(has("spectrum", Some(0.5), "spectrum-position"), 1);
        assert_eq!(has("spectrum", Some(0.3), "uniform-int8"), 1);
        assert_eq!(has("pdtrim", Some(0.3), "uniform-int8"), 1);
        // Nothing across budgets.
        assert_eq!(has("spectrum", Some(0.3), "snapkv"), 0);
        assert!(p.iter().all(|(a, r, _)| a != r));
    }

    fn ppl_row(policy: &str, window: u32, nll: f64) -> PplRow {
        PplRow {
            policy: policy.into(),
            quantizer: "none".into(),
            b: Some(0.5),
            b_real: 0.5,
            bytes: 1,
            window,
            tiers: [1, 0, 0, 0],
            nll,
            nll_base: 10.0,
            tokens: 10,
            kl: 0.0,
            top1_agree: 1.0,
            shared_with: None,
        }
    }

    #[test]
    fn verdicts_claim_no_more_than_their_test() -> Result<()> {
        let keys = vec![
            key("snapkv", "none", Some(0.5)),
            key("pdtrim", "none", Some(0.5)),
        ];
        let verdict = |gap: &dyn Fn(u32) -> f64| -> Result<String> {
            let rows: Vec<PplRow> = (0..8)
                .flat_map(|w| {
                    let base = 11.0 + 0.1 * f64::from(w % 3);
                    [
                        ppl_row("snapkv", w, base + gap(w)),
                        ppl_row("pdtrim", w, base),
                    ]
                })
                .collect();
            let d = ppl_diffs(&rows, &keys)?;
            assert_eq!(d.len(), 1);
            Ok(d[0].verdict())
        };
        assert_eq!(verdict(&|_| 0.0)?, "identical on all 8 windows");
        // 1.0 to 1.2 nats lower on every window: snapkv better, decided.
        let v = verdict(&|w| -1.0 - 0.2 * f64::from(w % 2))?;
        assert_eq!(v, "snapkv lower Δ% (Holm p < 0.05)");
        // Negative control: a gap that flips sign is not a finding.
        let v = verdict(&|w| if w % 2 == 0 { 0.3 } else { -0.3 })?;
        assert_eq!(v, "not distinguishable at 8 windows");
        Ok(())
    }

    #[test]
    fn min_detectable_shrinks_with_root_n() {
        let (a, b) = (
            min_detectable(1.0, 16, 0.05, 0.8).unwrap(),
            min_detectable(1.0, 64, 0.05, 0.8).unwrap(),
        );
        // Large n: (1.96 + 0.84) / √n.
        assert!((b * 8.0 - 2.8).abs() < 0.1, "{b}");
        assert!(a > 2.0 * b);
        assert!(min_detectable(0.0, 10, 0.05, 0.8).is_none());
        assert!(min_detectable(1.0, 1, 0.05, 0.8).is_none());
        let n = pairs_needed(0.5, 1.0, 0.05, 0.8).unwrap();
        assert!(min_detectable(1.0, n, 0.05, 0.8).unwrap() <= 0.5);
        assert!(min_detectable(1.0, n - 1, 0.05, 0.8).unwrap() > 0.5);
        // 2 / 2^6 = 0.031 < 0.05 ≤ 2 / 2^5; at α / 10: 2 / 2^9 = 0.0039 < 0.005.
        assert_eq!(mcnemar_min_discordant(0.05), 6);
        assert_eq!(mcnemar_min_discordant(0.005), 9);
    }
}
