//! `report.md`: the summary as Markdown tables, with the seed paper's numbers side by side.
use std::fmt::Write as _;
use std::path::Path;

use crate::stats::{BootstrapCi, RateDifferenceBootstrap};

use super::UnfinishedRun;
use super::plot::{DISAGREEMENT_STEM, JACCARD_STEM, stem};
use super::read::{Pass, is_batch_invariant};
use super::summary::{
    AnalyzeOptions, Comparison, Conditioning, ConditioningSummary, ConfigSummary,
};

/// File name of the report.
pub const REPORT: &str = "report.md";

/// The seed paper's ranges over its six stock configurations (the abstract's numbers).
pub mod seed_paper {
    /// Excess over the replica floor, any-informative, percentage points.
    pub const EXCESS_PP: (f64, f64) = (14.0, 28.0);
    /// Excess, treatment-independent conditioning, percentage points.
    pub const EXCESS_TI_PP: (f64, f64) = (7.0, 21.0);
    /// Problem-clustered t (the abstract does not say which conditioning).
    pub const CLUSTERED_T: (f64, f64) = (2.9, 6.4);
    /// Jaccard(exact, refeed) of the critical sets (threshold not stated).
    pub const JACCARD: (f64, f64) = (0.34, 0.90);
    /// Jaccard(exact, replica), the replica ceiling.
    pub const CEILING: (f64, f64) = (0.63, 0.96);
    /// Replica floor, fraction of eligible estimates.
    pub const FLOOR: (f64, f64) = (0.09, 0.23);
}

fn dash() -> String {
    "—".into()
}

fn pct(x: Option<f64>) -> String {
    x.map_or_else(dash, |x| format!("{:.1}%", 100.0 * x))
}

fn pp(x: Option<f64>) -> String {
    x.map_or_else(dash, |x| format!("{:+.1}", 100.0 * x))
}

fn num(x: Option<f64>, digits: usize) -> String {
    x.map_or_else(dash, |x| format!("{x:.digits$}"))
}

fn pval(p: Option<f64>) -> String {
    match p {
        None => dash(),
        Some(p) if p < 1e-4 => format!("{p:.1e}"),
        Some(p) => format!("{p:.4}"),
    }
}

/// A percentile-bootstrap p-value; 0 (no replicate on the far side of 0) is shown as below
/// the bootstrap's resolution, `2/valid`.
fn boot_pval(b: Option<RateDifferenceBootstrap>) -> String {
    match b {
        Some(b) if b.p_value == 0.0 => format!("< {:.4}", 2.0 / b.ci.valid_reps as f64),
        b => pval(b.map(|b| b.p_value)),
    }
}

fn ci_pct(ci: Option<BootstrapCi>) -> String {
    ci.map_or_else(dash, |c| {
        format!("[{:.1}, {:.1}]", 100.0 * c.lo, 100.0 * c.hi)
    })
}

fn ci_pp(ci: Option<BootstrapCi>) -> String {
    ci.map_or_else(dash, |c| {
        format!("[{:+.1}, {:+.1}]", 100.0 * c.lo, 100.0 * c.hi)
    })
}

fn ci_num(ci: Option<(f64, f64)>, digits: usize) -> String {
    ci.map_or_else(dash, |(lo, hi)| format!("[{lo:.digits$}, {hi:.digits$}]"))
}

fn cond_label(c: Conditioning) -> &'static str {
    match c {
        Conditioning::AnyInformative => "any-informative",
        Conditioning::TreatmentIndependent => "treatment-independent",
    }
}

fn range(xs: impl IntoIterator<Item = f64>, scale: f64, digits: usize) -> String {
    let v: Vec<f64> = xs.into_iter().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return dash();
    }
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min) * scale;
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max) * scale;
    if (hi - lo).abs() < 0.5 * 10f64.powi(-(digits as i32)) {
        format!("{lo:.digits$}")
    } else {
        format!("{lo:.digits$}–{hi:.digits$}")
    }
}

fn row_of(s: &ConfigSummary, c: Conditioning) -> Option<&ConditioningSummary> {
    s.rows.iter().find(|r| r.conditioning == c)
}

/// The section title prefix of a treatment: none for refeed, `Spectrum pass: ` for spectrum.
fn title(t: Pass) -> &'static str {
    match t {
        Pass::Spectrum => "Spectrum pass: ",
        _ => "",
    }
}

fn headline(out: &mut String, summaries: &[ConfigSummary], t: Pass) {
    let what = match t {
        Pass::Spectrum => "SpectrumKV-resume disagreement above the replica floor",
        _ => "Re-feed disagreement above the replica floor",
    };
    let _ = write!(
        out,
        "## {what}\n\n\
         Rates are over eligible estimates; CIs are 95% cluster-bootstrap (problems resampled). \
         The **excess** is `rate(exact≠{t}) − rate(exact≠replica)`, each rate over its own \
         eligible set, and every test in this table is of that same difference: its CI is a \
         cluster bootstrap that recomputes both eligible sets in every replicate, `t` is its \
         linearized (delta-method) CR1 t with G − 1 df (G = problems with an estimate eligible \
         for either comparison), `p` its Student-t p-value and `boot p` the percentile-bootstrap \
         p-value of the same replicates (\"< 2/n\" when none of the n valid replicates is on the \
         far side of 0). Under treatment-independent conditioning both rates \
         are over one set, so the excess coincides with the paired D̄ below and its t with D̄'s \
         CR1 t.\n\n\
         | config | policy | conditioning | N replica / {t} | G | replica floor [CI] | \
         exact≠{t} [CI] | excess (pp) [CI] | t of the excess (df) | p | boot p |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for s in summaries {
        for r in &s.rows {
            let e = r.excess.as_ref();
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} / {} | {} | {} {} | {} {} | {} {} | {} ({}) | {} | {} |",
                s.meta.config,
                s.meta.policy,
                cond_label(r.conditioning),
                r.replica.n_eligible,
                r.treatment.n_eligible,
                e.map_or(0, |e| e.n_problems),
                pct(r.replica.rate),
                ci_pct(r.replica.rate_ci),
                pct(r.treatment.rate),
                ci_pct(r.treatment.rate_ci),
                pp(e.map(|e| e.estimate)),
                ci_pp(e.and_then(|e| e.bootstrap.map(|b| b.ci))),
                num(e.and_then(|e| e.t_test.t), 2),
                e.map_or_else(dash, |e| e.t_test.df.to_string()),
                pval(e.and_then(|e| e.t_test.p_value)),
                boot_pval(e.and_then(|e| e.bootstrap)),
            );
        }
    }
    out.push('\n');
}

fn paired_contrast(out: &mut String, summaries: &[ConfigSummary], t: Pass) {
    let _ = write!(
        out,
        "## {}Paired contrast D̄ (not the excess under any-informative)\n\n\
         `D_j = 1[exact≠{t}] − 1[exact≠replica]` over the paired set: the union of the two \
         eligible sets under any-informative, the exact-informative estimates under \
         treatment-independent. **D̄** is the pooled mean of `D_j`, shown with its own \
         cluster-bootstrap CI and its CR1 t; **d̄** is the mean over problems of the per-problem \
         means of `D_j`, shown with the cluster-mean t that tests it. Under any-informative D̄ \
         divides by the union, the excess by each comparison's own set: they differ and can \
         have opposite signs, so neither t here is a test of the excess.\n\n\
         | config | conditioning | N | G | D̄ (pp) [CI] | CR1 t of D̄ (df) | p | \
         d̄ (pp) | cluster-mean t of d̄ (df) | p |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        title(t)
    );
    for s in summaries {
        for r in &s.rows {
            let p = r.paired.as_ref();
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} {} | {} ({}) | {} | {} | {} ({}) | {} |",
                s.meta.config,
                cond_label(r.conditioning),
                p.map_or(0, |p| p.n),
                p.map_or(0, |p| p.n_problems),
                pp(p.map(|p| p.mean)),
                ci_pp(p.and_then(|p| p.bootstrap_ci)),
                num(p.and_then(|p| p.cr1.t), 2),
                p.map_or_else(dash, |p| p.cr1.df.to_string()),
                pval(p.and_then(|p| p.cr1.p_value)),
                pp(p.map(|p| p.cluster_mean.estimate)),
                num(p.and_then(|p| p.cluster_mean.t), 2),
                p.map_or_else(dash, |p| p.cluster_mean.df.to_string()),
                pval(p.and_then(|p| p.cluster_mean.p_value)),
            );
        }
    }
    out.push('\n');
}

fn versus_paper(out: &mut String, summaries: &[ConfigSummary]) {
    use seed_paper as sp;
    // The paper's replica runs under another batch schedule; a same-schedule replica has a
    // floor of 0 by construction, so those configurations are left out of the ranges.
    let stock: Vec<&ConfigSummary> = summaries
        .iter()
        .filter(|s| {
            !is_batch_invariant(&s.meta.policy)
                && s.meta.replica_schedule != "same"
                && s.meta.partial.is_none()
        })
        .collect();
    let same: Vec<&str> = summaries
        .iter()
        .filter(|s| !is_batch_invariant(&s.meta.policy) && s.meta.replica_schedule == "same")
        .map(|s| s.meta.config.as_str())
        .collect();
    let rows = |c: Conditioning| stock.iter().filter_map(move |s| row_of(s, c));
    let ai = Conditioning::AnyInformative;
    let ti = Conditioning::TreatmentIndependent;
    let jac = |pass: Pass| {
        rows(ai)
            .flat_map(move |r| {
                let c = if pass == Pass::Refeed {
                    &r.treatment
                } else {
                    &r.replica
                };
                c.jaccard.iter().filter_map(|j| j.result.value)
            })
            .collect::<Vec<_>>()
    };
    let ts: Vec<f64> = rows(ai)
        .chain(rows(ti))
        .filter_map(|r| r.excess.as_ref().and_then(|e| e.t_test.t))
        .collect();
    let _ = write!(
        out,
        "## Side by side with the seed paper\n\n\
         Ranges over this analysis's {} stock-policy configuration(s) with a re-scheduled \
         replica{} next to the seed abstract's ranges over its six configurations \
         (batch-invariant configurations are listed last). The abstract states neither the \
         threshold of its critical sets (ours: every τ = m/K) nor which conditioning its \
         clustered t belongs to (ours: the linearized CR1 t of the excess under both).\n\n\
         | quantity | this analysis | seed paper |\n| --- | --- | --- |\n\
         | excess above the replica floor, any-informative (pp) | {} | {:.0}–{:.0} |\n\
         | excess above the replica floor, treatment-independent (pp) | {} | {:.0}–{:.0} |\n\
         | problem-clustered t of the excess | {} | {:.1}–{:.1} |\n\
         | Jaccard(exact, refeed) of critical sets | {} | {:.2}–{:.2} |\n\
         | replica ceiling Jaccard(exact, replica) | {} | {:.2}–{:.2} |\n\
         | replica floor (exact≠replica), any-informative | {} | {:.0}–{:.0}% |\n",
        stock.len(),
        if same.is_empty() {
            String::new()
        } else {
            format!(
                " (left out, same-schedule replica whose floor is 0 by construction: {})",
                same.join(", ")
            )
        },
        range(
            rows(ai).filter_map(|r| r.excess.map(|e| e.estimate)),
            100.0,
            1
        ),
        sp::EXCESS_PP.0,
        sp::EXCESS_PP.1,
        range(
            rows(ti).filter_map(|r| r.excess.map(|e| e.estimate)),
            100.0,
            1
        ),
        sp::EXCESS_TI_PP.0,
        sp::EXCESS_TI_PP.1,
        range(ts, 1.0, 2),
        sp::CLUSTERED_T.0,
        sp::CLUSTERED_T.1,
        range(jac(Pass::Refeed), 1.0, 2),
        sp::JACCARD.0,
        sp::JACCARD.1,
        range(jac(Pass::Replica), 1.0, 2),
        sp::CEILING.0,
        sp::CEILING.1,
        {
            let r = range(rows(ai).filter_map(|r| r.replica.rate), 100.0, 1);
            if r == "—" { r } else { format!("{r}%") }
        },
        100.0 * sp::FLOOR.0,
        100.0 * sp::FLOOR.1,
    );
    let bi: Vec<&ConfigSummary> = summaries
        .iter()
        .filter(|s| is_batch_invariant(&s.meta.policy))
        .collect();
    for s in &bi {
        let Some(r) = row_of(s, ai) else { continue };
        let frac = |c: &Comparison| format!("{}/{} ({})", c.n_disagree, c.n_eligible, pct(c.rate));
        let _ = writeln!(
            out,
            "| `{}` (batch-invariant): exact≠replica; exact≠refeed | {}; {} | exactly 0; 0 |",
            s.meta.config,
            frac(&r.replica),
            frac(&r.treatment),
        );
    }
    out.push('\n');
}

fn usd(device_seconds: f64, opts: &AnalyzeOptions) -> f64 {
    device_seconds / 3600.0 * opts.usd_per_gpu_hour
}

fn total_seconds(m: &super::summary::ConfigMeta) -> f64 {
    m.cost.values().map(|c| c.device_seconds).sum()
}

/// `k/n` as a Wilson-interval rate at `level` ([`crate::stats::wilson_rate`]).
fn wilson(k: usize, n: usize, level: f64) -> String {
    crate::stats::wilson_rate(k as u64, n as u64, level).unwrap_or_else(|_| dash())
}

/// Index of the τ used in the side-by-side table: the first τ = m/K ≥ 1/2.
fn side_tau(s: &ConfigSummary) -> Option<usize> {
    s.taus.iter().position(|&t| t >= 0.5 - 1e-12)
}

/// What a confidence interval says about a positive claim: above 0, below 0, or neither.
fn sign_verdict(ci: Option<(f64, f64)>) -> &'static str {
    match ci {
        Some((lo, _)) if lo > 0.0 => "yes",
        Some((_, hi)) if hi < 0.0 => "no (opposite sign)",
        Some(_) => "not shown (CI covers 0)",
        None => "no interval",
    }
}

/// Whether the interval `ci` (scaled) overlaps the seed's range.
fn overlaps(ci: Option<(f64, f64)>, range: (f64, f64), scale: f64) -> &'static str {
    match ci {
        Some((lo, hi)) if lo * scale <= range.1 && hi * scale >= range.0 => "overlaps",
        Some(_) => "outside",
        None => "—",
    }
}

fn excess_ci(r: &ConditioningSummary) -> Option<(f64, f64)> {
    r.excess
        .as_ref()
        .and_then(|e| e.bootstrap.map(|b| (b.ci.lo, b.ci.hi)))
}

fn jaccard_ci(c: &Comparison, i: usize) -> Option<(f64, f64)> {
    c.jaccard.get(i).and_then(|j| j.ci.map(|ci| (ci.lo, ci.hi)))
}

/// The side-by-side reproduction table: one row per configuration (any-informative unless
/// the column says otherwise), the seed's ranges in the last row, then one line per seed claim
/// with its verdict in each configuration, read off the interval or test in that row.
fn reproduction(out: &mut String, summaries: &[ConfigSummary], opts: &AnalyzeOptions) {
    use seed_paper as sp;
    let ai = Conditioning::AnyInformative;
    let ti = Conditioning::TreatmentIndependent;
    let lvl = 100.0 * opts.level;
    let _ = write!(
        out,
        "## Reproduction table\n\n\
         One row per configuration (run dir), any-informative conditioning unless a column \
         says otherwise; every rate has its {lvl:.0}% interval (cluster bootstrap, or Wilson \
         for counts of disagreements and snapshot checks) and every difference its test, as in \
         the sections below. *Crossing classes* are the exact≠refeed disagreements that are a \
         zero-boundary crossing or a polarity reversal (shares of the disagreements, Wilson). \
         *Mean-zero* is the cluster-mean t test of mean(Â_refeed − Â_exact) = 0. Jaccard is at \
         the first τ = m/K ≥ 1/2. Cost is the device-seconds of all passes in the manifests, \
         in dollars at ${:.2} per GPU-hour (`--usd-per-gpu-hour`).\n\n\
         | config | policy | G | N replica / refeed | replica floor [CI] | excess (pp) [CI] | \
         clustered t (df), p | excess TI (pp) [CI], t | zero-boundary | polarity reversal | \
         mean-zero: mean [CI], p | τ | Jaccard(exact, refeed) [CI] | ceiling [CI] | \
         snapshot hit rate | device-s | USD |\n\
         | --- | --- | ---: | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | ---: | ---: |\n",
        opts.usd_per_gpu_hour
    );
    for s in summaries {
        let Some(r) = row_of(s, ai) else { continue };
        let e = r.excess.as_ref();
        let rt = row_of(s, ti);
        let et = rt.and_then(|r| r.excess.as_ref());
        let c = &r.treatment;
        let m = c.mean_diff.as_ref();
        let tau = side_tau(s);
        let secs = total_seconds(&s.meta);
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} / {} | {} {} | {} {} | {} ({}), p {} | {} {}, t {} | {} | {} | {} {}, p {} | {} | {} | {} | {} | {:.1} | {:.2} |",
            s.meta.config,
            s.meta.policy,
            e.map_or(0, |e| e.n_problems),
            r.replica.n_eligible,
            c.n_eligible,
            pct(r.replica.rate),
            ci_pct(r.replica.rate_ci),
            pp(e.map(|e| e.estimate)),
            ci_pp(e.and_then(|e| e.bootstrap.map(|b| b.ci))),
            num(e.and_then(|e| e.t_test.t), 2),
            e.map_or_else(dash, |e| e.t_test.df.to_string()),
            pval(e.and_then(|e| e.t_test.p_value)),
            pp(et.map(|e| e.estimate)),
            ci_pp(et.and_then(|e| e.bootstrap.map(|b| b.ci))),
            num(et.and_then(|e| e.t_test.t), 2),
            wilson(c.classes.zero_boundary, c.n_disagree, opts.level),
            wilson(c.classes.polarity_reversal, c.n_disagree, opts.level),
            num(m.map(|m| m.t_test.estimate), 4),
            ci_num(m.and_then(|m| m.t_ci), 4),
            pval(m.and_then(|m| m.t_test.p_value)),
            tau.map_or_else(dash, |i| tau_label(s.taus[i], s.meta.k)),
            tau.map_or_else(dash, |i| jaccard_cell(c, i)),
            tau.map_or_else(dash, |i| jaccard_cell(&r.replica, i)),
            wilson(
                s.meta.snapshot_hits as usize,
                s.meta.snapshot_checks as usize,
                opts.level
            ),
            secs,
            usd(secs, opts),
        );
    }
    let _ = write!(
        out,
        "| seed paper (6 stock configs) | stock | | | {:.0}–{:.0}% | {:.0}–{:.0} | {:.1}–{:.1} | {:.0}–{:.0} | | | | not stated | {:.2}–{:.2} | {:.2}–{:.2} | | | |\n\n",
        100.0 * sp::FLOOR.0,
        100.0 * sp::FLOOR.1,
        sp::EXCESS_PP.0,
        sp::EXCESS_PP.1,
        sp::CLUSTERED_T.0,
        sp::CLUSTERED_T.1,
        sp::EXCESS_TI_PP.0,
        sp::EXCESS_TI_PP.1,
        sp::JACCARD.0,
        sp::JACCARD.1,
        sp::CEILING.0,
        sp::CEILING.1,
    );
    let stock: Vec<&ConfigSummary> = summaries
        .iter()
        .filter(|s| !is_batch_invariant(&s.meta.policy) && s.meta.partial.is_none())
        .collect();
    if !stock.is_empty() {
        let alpha = 1.0 - opts.level;
        let _ = write!(
            out,
            "### Seed claims, configuration by configuration\n\n\
             Each verdict is read off the interval or test in the row above: *yes* when the \
             {lvl:.0}% interval (or the test at α = {alpha:.2}) supports the claim, *not shown* \
             when it covers the null; in brackets whether the interval overlaps the seed's \
             range.\n\n| claim | {} |\n| --- |{}\n",
            stock
                .iter()
                .map(|s| format!("`{}`", s.meta.config))
                .collect::<Vec<_>>()
                .join(" | "),
            " --- |".repeat(stock.len()),
        );
        type Claim<'a> = (&'a str, Box<dyn Fn(&ConfigSummary) -> String + 'a>);
        let claims: Vec<Claim> = vec![
            (
                "re-feed excess above the replica floor > 0, any-informative (seed: +14 to +28 pp)",
                Box::new(|s| {
                    row_of(s, ai).map_or_else(dash, |r| {
                        let ci = excess_ci(r);
                        format!(
                            "{} ({})",
                            sign_verdict(ci),
                            overlaps(ci, sp::EXCESS_PP, 100.0)
                        )
                    })
                }),
            ),
            (
                "re-feed excess > 0, treatment-independent (seed: +7 to +21 pp)",
                Box::new(|s| {
                    row_of(s, ti).map_or_else(dash, |r| {
                        let ci = excess_ci(r);
                        format!(
                            "{} ({})",
                            sign_verdict(ci),
                            overlaps(ci, sp::EXCESS_TI_PP, 100.0)
                        )
                    })
                }),
            ),
            (
                "problem-clustered t of the excess significant, any-informative (seed: t = 2.9 to 6.4)",
                Box::new(move |s| {
                    let t = row_of(s, ai)
                        .and_then(|r| r.excess.as_ref())
                        .map(|e| e.t_test);
                    match t.and_then(|t| t.p_value.zip(t.t)) {
                        Some((p, t)) if p < alpha && t > 0.0 => {
                            format!("yes (p {})", pval(Some(p)))
                        }
                        Some((p, _)) => format!("not shown (p {})", pval(Some(p))),
                        None => "no test".into(),
                    }
                }),
            ),
            (
                "replica floor > 0 (seed: 9 to 23%)",
                Box::new(|s| {
                    row_of(s, ai).map_or_else(dash, |r| {
                        let ci = r.replica.rate_ci.map(|c| (c.lo, c.hi));
                        format!("{} ({})", sign_verdict(ci), overlaps(ci, sp::FLOOR, 1.0))
                    })
                }),
            ),
            (
                "Jaccard(exact, refeed) below the replica ceiling (seed: 0.34–0.90 vs 0.63–0.96; intervals disjoint)",
                Box::new(|s| {
                    let (Some(r), Some(i)) = (row_of(s, ai), side_tau(s)) else {
                        return dash();
                    };
                    match (jaccard_ci(&r.treatment, i), jaccard_ci(&r.replica, i)) {
                        (Some(j), Some(c)) if j.1 < c.0 => {
                            format!("yes ({})", overlaps(Some(j), sp::JACCARD, 1.0))
                        }
                        (Some(j), Some(_)) => {
                            format!(
                                "not shown (CIs overlap; {})",
                                overlaps(Some(j), sp::JACCARD, 1.0)
                            )
                        }
                        _ => "no interval".into(),
                    }
                }),
            ),
        ];
        for (claim, verdict) in &claims {
            let cells: Vec<String> = stock.iter().map(|s| verdict(s)).collect();
            let _ = writeln!(out, "| {claim} | {} |", cells.join(" | "));
        }
        out.push('\n');
    }
    let bi: Vec<&ConfigSummary> = summaries
        .iter()
        .filter(|s| is_batch_invariant(&s.meta.policy))
        .collect();
    if !bi.is_empty() {
        out.push_str(
            "### Batch-invariant twins\n\n\
             Under the batch-invariant policy every pass must agree bitwise: both disagreement \
             rates must be exactly 0 (Wilson interval of the observed 0).\n\n\
             | config | exact≠replica | exact≠refeed | exactly 0 |\n| --- | --- | --- | --- |\n",
        );
        for s in bi {
            let Some(r) = row_of(s, ai) else { continue };
            let ok = r.replica.n_disagree == 0 && r.treatment.n_disagree == 0;
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} |",
                s.meta.config,
                wilson(r.replica.n_disagree, r.replica.n_eligible, opts.level),
                wilson(r.treatment.n_disagree, r.treatment.n_eligible, opts.level),
                if ok { "yes" } else { "**no**" },
            );
        }
        out.push('\n');
    }
}

fn classes(out: &mut String, summaries: &[ConfigSummary], t: Pass) {
    let _ = write!(
        out,
        "## {}How estimates disagree\n\n\
         Zero-boundary: exactly one estimate is 0. Polarity reversal: opposite non-zero signs. \
         Magnitude: same non-zero sign, different value.\n\n\
         | config | conditioning | comparison | N | disagree | zero-boundary | polarity reversal | magnitude |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        title(t)
    );
    for s in summaries {
        for r in &s.rows {
            for c in [&r.replica, &r.treatment] {
                let share = |n: usize| {
                    if c.n_disagree == 0 {
                        n.to_string()
                    } else {
                        format!("{n} ({:.0}%)", 100.0 * n as f64 / c.n_disagree as f64)
                    }
                };
                let _ = writeln!(
                    out,
                    "| {} | {} | exact vs {} | {} | {} | {} | {} | {} |",
                    s.meta.config,
                    cond_label(r.conditioning),
                    c.pass,
                    c.n_eligible,
                    c.n_disagree,
                    share(c.classes.zero_boundary),
                    share(c.classes.polarity_reversal),
                    share(c.classes.magnitude),
                );
            }
        }
    }
    out.push('\n');
}

fn mean_zero(out: &mut String, summaries: &[ConfigSummary], t: Pass) {
    let _ = write!(
        out,
        "## {}Mean-zero check\n\n\
         Mean over problems of the per-problem mean of `Â_X − Â_exact` over the comparison's \
         eligible estimates, with the cluster-mean t CI and the cluster-bootstrap CI.\n\n\
         | config | conditioning | X | mean | t CI | bootstrap CI | p |\n\
         | --- | --- | --- | --- | --- | --- | --- |\n",
        title(t)
    );
    for s in summaries {
        for r in &s.rows {
            for c in [&r.replica, &r.treatment] {
                let m = c.mean_diff.as_ref();
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {} | {} | {} |",
                    s.meta.config,
                    cond_label(r.conditioning),
                    c.pass,
                    num(m.map(|m| m.t_test.estimate), 4),
                    ci_num(m.and_then(|m| m.t_ci), 4),
                    ci_num(m.and_then(|m| m.bootstrap_ci.map(|b| (b.lo, b.hi))), 4),
                    pval(m.and_then(|m| m.t_test.p_value)),
                );
            }
        }
    }
    out.push('\n');
}

fn jaccard_cell(c: &Comparison, i: usize) -> String {
    let j = &c.jaccard[i];
    match j.result.value {
        None => "empty union".into(),
        Some(v) => format!("{v:.3} {}", ci_num(j.ci.map(|ci| (ci.lo, ci.hi)), 2)),
    }
}

fn critical_sets(out: &mut String, summaries: &[ConfigSummary], t: Pass) {
    let _ = write!(
        out,
        "## {}Critical-token sets\n\n\
         `C^π(τ) = {{(i, t, a) : |Â^π| ≥ τ}}` as design.md defines it: over **every** complete \
         estimate, whatever the conditioning, for every τ = m/K. Under any-informative every \
         critical key is eligible for its comparison (an ineligible key has Â = 0 in both \
         passes). Under treatment-independent only exact-informative keys are eligible, but a \
         key with exact uninformative (Â_exact = 0) and |Â_{t}| ≥ τ (or |Â_replica| ≥ τ) \
         stays in C_{t} (C_replica); the column *exact uninformative* counts those keys of \
         each union, which a conditioned critical set would drop. So the sets, the Jaccard and \
         the ceiling are the same under both conditionings. Jaccard = |C_exact ∩ C_π| / \
         |C_exact ∪ C_π| with a cluster-bootstrap CI over every problem; an empty union has no \
         Jaccard (\"empty union\", null in `summary.parquet`), and bootstrap replicates with an \
         empty union are dropped. The replica ceiling is Jaccard(exact, replica) at the same \
         τ.\n\n",
        title(t)
    );
    for s in summaries {
        let (Some(a), Some(ti)) = (
            row_of(s, Conditioning::AnyInformative),
            row_of(s, Conditioning::TreatmentIndependent),
        ) else {
            continue;
        };
        let _ = write!(
            out,
            "### `{}` (both conditionings)\n\n\
             | τ | \\|C_exact\\| | \\|C_{t}\\| | \\|C_replica\\| | exact uninformative ({t} / replica) | Jaccard(exact, {t}) [CI] | replica ceiling [CI] |\n\
             | --- | --- | --- | --- | --- | --- | --- |\n",
            s.meta.config,
        );
        for (i, &tau) in s.taus.iter().enumerate() {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} / {} | {} | {} |",
                tau_label(tau, s.meta.k),
                a.treatment.jaccard[i].result.size_a,
                a.treatment.jaccard[i].result.size_b,
                a.replica.jaccard[i].result.size_b,
                ti.treatment.jaccard[i].n_ineligible,
                ti.replica.jaccard[i].n_ineligible,
                jaccard_cell(&a.treatment, i),
                jaccard_cell(&a.replica, i),
            );
        }
        out.push('\n');
    }
}

fn tau_label(tau: f64, k: u32) -> String {
    let m = (tau * f64::from(k)).round() as u32;
    format!("{m}/{k} = {tau:.3}")
}

fn sensitivity(out: &mut String, summaries: &[ConfigSummary], t: Pass) {
    let _ = write!(
        out,
        "## {}Paired set under any-informative: union vs intersection\n\n\
         The paired contrast uses the union of the two comparisons' eligible sets (any pass \
         informative): outside a comparison's set both estimates are 0, so every disagreement \
         of either comparison is counted. The intersection (eligible for both comparisons) drops \
         the estimates where only the {t} or only the replica pass is informative; it is \
         shown as a sensitivity check.\n\n\
         | config | union N | union D̄ (pp) | CR1 t of D̄ | p | intersection N | intersection D̄ (pp) | CR1 t of D̄ | p |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        title(t)
    );
    for s in summaries {
        let Some(r) = row_of(s, Conditioning::AnyInformative) else {
            continue;
        };
        let (u, b) = (r.paired.as_ref(), r.intersection.as_ref());
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            s.meta.config,
            u.map_or(0, |p| p.n),
            pp(u.map(|p| p.mean)),
            num(u.and_then(|p| p.cr1.t), 2),
            pval(u.and_then(|p| p.cr1.p_value)),
            b.map_or(0, |p| p.n),
            pp(b.map(|p| p.mean)),
            num(b.and_then(|p| p.cr1.t), 2),
            pval(b.and_then(|p| p.cr1.p_value)),
        );
    }
    out.push('\n');
}

fn outputs(out: &mut String, summaries: &[ConfigSummary]) {
    out.push_str(
        "## Generated texts: truncations and extraction rules\n\n\
         Per pass, the continuations in `continuations.parquet` (and the rollouts in \
         `rollouts.parquet`, when the run dir has one) that stopped at the token cap \
         (`stop = length`), and how their answers were extracted (`extraction_rule`; \
         \"not recorded\" for files written without that column).\n\n\
         | config | pass | texts | truncated | share | extraction rules |\n\
         | --- | --- | ---: | ---: | ---: | --- |\n",
    );
    for s in summaries {
        if s.meta.outputs.is_empty() {
            let _ = writeln!(out, "| {} | (none read) | | | | |", s.meta.config);
        }
        for (pass, o) in &s.meta.outputs {
            let share = if o.rows > 0 {
                format!("{:.1}%", 100.0 * o.truncated as f64 / o.rows as f64)
            } else {
                dash()
            };
            let rules = o.rules.as_ref().map_or_else(
                || "not recorded".to_string(),
                |m| {
                    let v: Vec<String> = m.iter().map(|(r, n)| format!("{r} {n}")).collect();
                    v.join(", ")
                },
            );
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} |",
                s.meta.config, pass, o.rows, o.truncated, share, rules
            );
        }
    }
    out.push('\n');
}

fn cost(out: &mut String, summaries: &[ConfigSummary], opts: &AnalyzeOptions) {
    let _ = write!(
        out,
        "## Cost\n\nFrom each run's `manifest.json` (summed when several run dirs share a \
         configuration); dollars at ${:.2} per GPU-hour (`--usd-per-gpu-hour`).\n\n\
         | config | pass | device-seconds | USD | share | tokens | continuations |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: |\n",
        opts.usd_per_gpu_hour
    );
    for s in summaries {
        let total: f64 = s.meta.cost.values().map(|c| c.device_seconds).sum();
        if s.meta.cost.is_empty() {
            let _ = writeln!(
                out,
                "| {} | (no cost in manifest) | | | | | |",
                s.meta.config
            );
        }
        for (pass, c) in &s.meta.cost {
            let share = if total > 0.0 {
                format!("{:.1}%", 100.0 * c.device_seconds / total)
            } else {
                dash()
            };
            let _ = writeln!(
                out,
                "| {} | {} | {:.1} | {:.2} | {} | {} | {} |",
                s.meta.config,
                pass,
                c.device_seconds,
                usd(c.device_seconds, opts),
                share,
                c.tokens,
                c.continuations
            );
        }
        if s.meta.cost.len() > 1 {
            let _ = writeln!(
                out,
                "| {} | **total** | {total:.1} | {:.2} | 100% | | |",
                s.meta.config,
                usd(total, opts)
            );
        }
    }
    out.push('\n');
}

fn inputs(out: &mut String, summaries: &[ConfigSummary], opts: &AnalyzeOptions) {
    out.push_str(
        "## Configurations\n\n\
         | config | model | dtype | policy | replica schedule | K | problems | estimates | incomplete | snapshot hits | run dirs |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for s in summaries {
        let m = &s.meta;
        let dirs: Vec<String> = m.run_dirs.iter().map(|d| display(d)).collect();
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {}/{} ({}) | {} |",
            m.config,
            m.model,
            m.dtype,
            m.policy,
            m.replica_schedule,
            m.k,
            m.n_problems,
            m.n_keys,
            m.n_incomplete,
            m.snapshot_hits,
            m.snapshot_checks,
            pct(m.snapshot_hit_rate()),
            dirs.join(", "),
        );
    }
    let tasks: Vec<String> = summaries
        .iter()
        .filter_map(|s| {
            Some(format!(
                "- `{}`: task {}",
                s.meta.config,
                s.meta.task.as_ref()?
            ))
        })
        .collect();
    if !tasks.is_empty() {
        let _ = write!(
            out,
            "\nTasks (from the manifests):\n\n{}\n",
            tasks.join("\n")
        );
    }
    let _ = write!(
        out,
        "\nBootstrap: {} replicates per statistic, seed {}, {:.0}% intervals.\n\n",
        opts.reps,
        opts.seed,
        100.0 * opts.level
    );
}

fn display(p: &Path) -> String {
    format!("`{}`", p.display())
}

fn definitions(out: &mut String) {
    out.push_str(
        "## Definitions and choices\n\n\
         - `Â = (orig_successes − alt_successes)/K` is recomputed from the counts; a pass is \
         informative when its 2K outcomes are not all equal. Disagreement is inequality of the \
         quantized estimates.\n\
         - Only estimates `(problem, pivot_pos, alt_rank)` with exact, replica and the \
         treatment enter (`incomplete` counts the others); each treatment (refeed, spectrum) \
         is analysed by the same code, its name in place of refeed below.\n\
         - *any-informative*: exact vs X is eligible when exact or X is informative, so the two \
         comparisons have their own sets; the excess is the difference of the two rates, the \
         paired `D_j` uses the union of the two sets, and the two are different numbers.\n\
         - *treatment-independent*: eligible iff exact is informative, one set for both \
         comparisons; the excess equals D̄ and its linearized t equals D̄'s CR1 t.\n\
         - Tests of the excess: linearized CR1 t, `z_g = Σ_{j∈g∩refeed}(y_j − r_refeed)/N_refeed \
         − Σ_{j∈g∩replica}(y_j − r_replica)/N_replica`, `V = G/(G−1)·Σ_g z_g²`, `t = excess/√V`, \
         G − 1 df; cluster bootstrap recomputing both eligible sets per replicate (replicates \
         with an empty set dropped), percentile CI and p = min(1, 2·min(#≤0, #≥0)/valid).\n\
         - Tests of D̄ and d̄: cluster-mean t, per-problem means of `D_j`, \
         `t = mean/(sd/√G)`, G − 1 df; CR1, intercept-only OLS with problem-clustered variance \
         `G/(G−1)·Σ_g(Σ e_j)²/N²`, G − 1 df. Cluster bootstrap: problems drawn with \
         replacement, percentile interval.\n\
         - Critical sets are over every complete estimate under both conditionings \
         (design.md's `C^π(τ)`), see *Critical-token sets*.\n",
    );
}

/// Summaries of `t`, in input order.
fn of_treatment(summaries: &[ConfigSummary], t: Pass) -> Vec<ConfigSummary> {
    summaries
        .iter()
        .filter(|s| s.treatment == t)
        .cloned()
        .collect()
}

/// One summary per configuration (its first treatment's), for the sections that do not
/// depend on the treatment.
fn per_config(summaries: &[ConfigSummary]) -> Vec<ConfigSummary> {
    let mut seen = std::collections::BTreeSet::new();
    summaries
        .iter()
        .filter(|s| seen.insert(s.meta.config.clone()))
        .cloned()
        .collect()
}

fn spectrum_frames(out: &mut String, summaries: &[ConfigSummary]) {
    out.push_str(
        "## Spectrum pass: what was sent\n\n\
         The spectrum pass resumes each pivot's continuations from the rollout's decode-time KV \
         snapshot after SpectrumKV compression: importance from a traced prefill of the same \
         prefix, tiers allocated at the budget, quantized and packed into a wire frame, then \
         decoded and dequantized into an ordinary cache (dropped tokens masked). Real b = frame \
         bytes ÷ full-FP16 KV bytes, summed over the snapshots (per-snapshot range after it); \
         token shares are of all snapshot positions (from each run's `manifest.json`).\n\n\
         | config | setting | snapshots | real b (range) | FP16 | INT8 | INT4 | dropped |\n\
         | --- | --- | ---: | --- | ---: | ---: | ---: | ---: |\n",
    );
    for s in summaries {
        let m = &s.meta;
        let setting = m.spectrum_setting.as_deref().unwrap_or("—");
        let Some(st) = m.spectrum else {
            let _ = writeln!(
                out,
                "| {} | {setting} | (not recorded) | | | | | |",
                m.config
            );
            continue;
        };
        let share = |n: u64| {
            if st.tokens == 0 {
                dash()
            } else {
                format!("{:.1}%", 100.0 * n as f64 / st.tokens as f64)
            }
        };
        let _ = writeln!(
            out,
            "| {} | {setting} | {} | {} ({:.3}–{:.3}) | {} | {} | {} | {} |",
            m.config,
            st.snapshots,
            num(st.real_b(), 3),
            st.real_b_min,
            st.real_b_max,
            share(st.tokens_fp16),
            share(st.tokens_int8),
            share(st.tokens_int4),
            share(st.tokens_drop),
        );
    }
    out.push('\n');
}

/// The run dirs whose campaign has not finished, with why (the manifest's `failure`) and
/// whether their finished shards were read.
fn not_finished(out: &mut String, unfinished: &[UnfinishedRun]) {
    if unfinished.is_empty() {
        return;
    }
    out.push_str(
        "## Configurations not finished\n\n\
         Run dirs whose campaign has not finished. A rerun of `kvcredit campaign run SPEC --out \
         DIR` resumes each (finished problems are kept). With `--partial` the rows above hold \
         their finished shards, labelled `(partial k/N)`; the side-by-side ranges and the seed \
         claims leave those out.\n\n\
         | config | model | dtype | policy | problems done | status | read | run dir |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for u in unfinished {
        let m = &u.manifest;
        let status = match (&m.failure, m.problems_done) {
            (Some(f), _) => format!("stopped: {}", f.replace('|', "\\|")),
            (None, 0) => "no problem finished".to_string(),
            (None, _) => "interrupted (resumable)".to_string(),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {}/{} | {} | {} | {} |",
            m.name,
            m.model,
            m.dtype,
            m.exec.policy,
            m.problems_done,
            m.problems_total,
            status,
            if u.read_partial { "partial" } else { "no" },
            display(&u.dir),
        );
    }
    out.push('\n');
}

/// Render the whole report: the refeed treatment's sections (with the seed paper's numbers),
/// then the same sections for the spectrum pass when a configuration ran it.
pub fn render(
    summaries: &[ConfigSummary],
    unfinished: &[UnfinishedRun],
    opts: &AnalyzeOptions,
) -> String {
    let mut out = format!(
        "# kvcredit campaign analysis\n\n\
         Counterfactual credit: exact resume, replica (noise floor) and the treatment passes \
         (refeed; spectrum, a resume from the SpectrumKV-compressed snapshot, when run), each \
         compared with exact against the replica floor. Written by kvcredit {}.\n\n",
        env!("CARGO_PKG_VERSION")
    );
    let configs = per_config(summaries);
    inputs(&mut out, &configs, opts);
    not_finished(&mut out, unfinished);
    let refeed = of_treatment(summaries, Pass::Refeed);
    if !refeed.is_empty() {
        reproduction(&mut out, &refeed, opts);
    }
    for t in Pass::TREATMENTS {
        let group = of_treatment(summaries, t);
        if group.is_empty() {
            continue;
        }
        if t == Pass::Spectrum {
            spectrum_frames(&mut out, &group);
        }
        headline(&mut out, &group, t);
        paired_contrast(&mut out, &group, t);
        let (dis, jac) = (stem(DISAGREEMENT_STEM, t), stem(JACCARD_STEM, t));
        let _ = write!(
            out,
            "![Disagreement rates vs replica floor ({t})]({dis}.png)\n\n\
             (also [`{dis}.svg`]({dis}.svg))\n\n"
        );
        if t == Pass::Refeed {
            versus_paper(&mut out, &group);
        }
        classes(&mut out, &group, t);
        mean_zero(&mut out, &group, t);
        critical_sets(&mut out, &group, t);
        let _ = write!(
            out,
            "![Jaccard vs tau with replica ceiling ({t})]({jac}.png)\n\n\
             (also [`{jac}.svg`]({jac}.svg))\n\n"
        );
        sensitivity(&mut out, &group, t);
    }
    outputs(&mut out, &configs);
    cost(&mut out, &configs, opts);
    definitions(&mut out);
    out
}
