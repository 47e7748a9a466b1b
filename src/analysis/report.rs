//! `report.md`: the summary as Markdown tables, with the seed paper's numbers side by side.
use std::fmt::Write as _;
use std::path::Path;

use crate::stats::BootstrapCi;

use super::plot::{DISAGREEMENT_STEM, JACCARD_STEM};
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

fn headline(out: &mut String, summaries: &[ConfigSummary]) {
    out.push_str(
        "## Re-feed disagreement above the replica floor\n\n\
         Rates are over eligible estimates; CIs are 95% cluster-bootstrap (problems resampled). \
         The excess is `rate(exact≠refeed) − rate(exact≠replica)`; its tests use \
         `D_j = 1[exact≠refeed] − 1[exact≠replica]` over the paired set, clustered by problem \
         (G − 1 df).\n\n\
         | config | policy | conditioning | N replica / refeed | G | replica floor [CI] | \
         exact≠refeed [CI] | excess (pp) | paired D̄ (pp) [CI] | cluster-mean t (df) | p | CR1 t | p |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for s in summaries {
        for r in &s.rows {
            let p = r.paired.as_ref();
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} / {} | {} | {} {} | {} {} | {} | {} {} | {} ({}) | {} | {} | {} |",
                s.meta.config,
                s.meta.policy,
                cond_label(r.conditioning),
                r.replica.n_eligible,
                r.refeed.n_eligible,
                p.map_or(0, |p| p.n_problems),
                pct(r.replica.rate),
                ci_pct(r.replica.rate_ci),
                pct(r.refeed.rate),
                ci_pct(r.refeed.rate_ci),
                pp(r.excess),
                pp(p.map(|p| p.mean)),
                ci_pp(p.and_then(|p| p.bootstrap_ci)),
                num(p.and_then(|p| p.cluster_mean.t), 2),
                p.map_or_else(dash, |p| p.cluster_mean.df.to_string()),
                pval(p.and_then(|p| p.cluster_mean.p_value)),
                num(p.and_then(|p| p.cr1.t), 2),
                pval(p.and_then(|p| p.cr1.p_value)),
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
        .filter(|s| !is_batch_invariant(&s.meta.policy) && s.meta.replica_schedule != "same")
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
                    &r.refeed
                } else {
                    &r.replica
                };
                c.jaccard.iter().filter_map(|j| j.result.value)
            })
            .collect::<Vec<_>>()
    };
    let ts: Vec<f64> = rows(ai)
        .chain(rows(ti))
        .filter_map(|r| r.paired.as_ref())
        .flat_map(|p| [p.cluster_mean.t, p.cr1.t])
        .flatten()
        .collect();
    let _ = write!(
        out,
        "## Side by side with the seed paper\n\n\
         Ranges over this analysis's {} stock-policy configuration(s) with a re-scheduled \
         replica{} next to the seed abstract's ranges over its six configurations \
         (batch-invariant configurations are listed last). The abstract states neither the \
         threshold of its critical sets (ours: every τ = m/K) nor which conditioning its \
         clustered t belongs to (ours: both, cluster-mean and CR1).\n\n\
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
        range(rows(ai).filter_map(|r| r.excess), 100.0, 1),
        sp::EXCESS_PP.0,
        sp::EXCESS_PP.1,
        range(rows(ti).filter_map(|r| r.excess), 100.0, 1),
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
            frac(&r.refeed),
        );
    }
    out.push('\n');
}

fn classes(out: &mut String, summaries: &[ConfigSummary]) {
    out.push_str(
        "## How estimates disagree\n\n\
         Zero-boundary: exactly one estimate is 0. Polarity reversal: opposite non-zero signs. \
         Magnitude: same non-zero sign, different value.\n\n\
         | config | conditioning | comparison | N | disagree | zero-boundary | polarity reversal | magnitude |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for s in summaries {
        for r in &s.rows {
            for c in [&r.replica, &r.refeed] {
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

fn mean_zero(out: &mut String, summaries: &[ConfigSummary]) {
    out.push_str(
        "## Mean-zero check\n\n\
         Mean over problems of the per-problem mean of `Â_X − Â_exact` over the comparison's \
         eligible estimates, with the cluster-mean t CI and the cluster-bootstrap CI.\n\n\
         | config | conditioning | X | mean | t CI | bootstrap CI | p |\n\
         | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for s in summaries {
        for r in &s.rows {
            for c in [&r.replica, &r.refeed] {
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

fn critical_sets(out: &mut String, summaries: &[ConfigSummary]) {
    out.push_str(
        "## Critical-token sets\n\n\
         `C^π(τ) = {(i, t, a) : |Â^π| ≥ τ}` over the comparison's eligible estimates, for \
         every τ = m/K. Jaccard = |C_exact ∩ C_π| / |C_exact ∪ C_π| with a cluster-bootstrap CI; \
         an empty union has no Jaccard (\"empty union\", null in `summary.parquet`), and \
         bootstrap replicates with an empty union are dropped. The replica ceiling is \
         Jaccard(exact, replica) at the same τ.\n\n",
    );
    for s in summaries {
        for r in &s.rows {
            let _ = write!(
                out,
                "### `{}`, {}\n\n\
                 | τ | \\|C_exact\\| | \\|C_refeed\\| | \\|C_replica\\| | Jaccard(exact, refeed) [CI] | replica ceiling [CI] |\n\
                 | --- | --- | --- | --- | --- | --- |\n",
                s.meta.config,
                cond_label(r.conditioning)
            );
            for (i, &tau) in s.taus.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {} | {} |",
                    tau_label(tau, s.meta.k),
                    r.refeed.jaccard[i].result.size_a,
                    r.refeed.jaccard[i].result.size_b,
                    r.replica.jaccard[i].result.size_b,
                    jaccard_cell(&r.refeed, i),
                    jaccard_cell(&r.replica, i),
                );
            }
            out.push('\n');
        }
    }
}

fn tau_label(tau: f64, k: u32) -> String {
    let m = (tau * f64::from(k)).round() as u32;
    format!("{m}/{k} = {tau:.3}")
}

fn sensitivity(out: &mut String, summaries: &[ConfigSummary]) {
    out.push_str(
        "## Paired set under any-informative: union vs intersection\n\n\
         The paired contrast uses the union of the two comparisons' eligible sets (any pass \
         informative): outside a comparison's set both estimates are 0, so every disagreement \
         of either comparison is counted. The intersection (eligible for both comparisons) drops \
         the estimates where only the refeed or only the replica pass is informative; it is \
         shown as a sensitivity check.\n\n\
         | config | union N | union D̄ (pp) | CR1 t | p | intersection N | intersection D̄ (pp) | CR1 t | p |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
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

fn cost(out: &mut String, summaries: &[ConfigSummary]) {
    out.push_str(
        "## Cost\n\nFrom each run's `manifest.json` (summed when several run dirs share a \
         configuration).\n\n\
         | config | pass | device-seconds | share | tokens | continuations |\n\
         | --- | --- | ---: | ---: | ---: | ---: |\n",
    );
    for s in summaries {
        let total: f64 = s.meta.cost.values().map(|c| c.device_seconds).sum();
        if s.meta.cost.is_empty() {
            let _ = writeln!(out, "| {} | (no cost in manifest) | | | | |", s.meta.config);
        }
        for (pass, c) in &s.meta.cost {
            let share = if total > 0.0 {
                format!("{:.1}%", 100.0 * c.device_seconds / total)
            } else {
                dash()
            };
            let _ = writeln!(
                out,
                "| {} | {} | {:.1} | {} | {} | {} |",
                s.meta.config, pass, c.device_seconds, share, c.tokens, c.continuations
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
         - Only estimates `(problem, pivot_pos, alt_rank)` with all three passes enter \
         (`incomplete` counts the others).\n\
         - *any-informative*: exact vs X is eligible when exact or X is informative, so the two \
         comparisons have their own sets; the excess is the difference of the two rates, and \
         the paired `D_j` uses the union of the two sets.\n\
         - *treatment-independent*: eligible iff exact is informative, one set for both \
         comparisons; the excess equals the mean of `D_j`.\n\
         - Cluster-mean t: per-problem means of `D_j`, `t = mean/(sd/√G)`, G − 1 df. CR1: \
         intercept-only OLS with problem-clustered variance `G/(G−1)·Σ_g(Σ e_j)²/N²`, G − 1 df. \
         Cluster bootstrap: problems drawn with replacement, percentile interval.\n\
         - Critical sets use the comparison's eligible estimates (for any-informative the same \
         as all estimates when τ > 0).\n",
    );
}

/// Render the whole report.
pub fn render(summaries: &[ConfigSummary], opts: &AnalyzeOptions) -> String {
    let mut out = format!(
        "# kvcredit campaign analysis\n\n\
         Three-pass counterfactual credit: exact resume, replica (noise floor) and refeed. \
         Written by kvcredit {}.\n\n",
        env!("CARGO_PKG_VERSION")
    );
    inputs(&mut out, summaries, opts);
    headline(&mut out, summaries);
    let _ = write!(
        out,
        "![Disagreement rates vs replica floor]({DISAGREEMENT_STEM}.png)\n\n\
         (also [`{DISAGREEMENT_STEM}.svg`]({DISAGREEMENT_STEM}.svg))\n\n"
    );
    versus_paper(&mut out, summaries);
    classes(&mut out, summaries);
    mean_zero(&mut out, summaries);
    critical_sets(&mut out, summaries);
    let _ = write!(
        out,
        "![Jaccard vs tau with replica ceiling]({JACCARD_STEM}.png)\n\n\
         (also [`{JACCARD_STEM}.svg`]({JACCARD_STEM}.svg))\n\n"
    );
    sensitivity(&mut out, summaries);
    cost(&mut out, summaries);
    definitions(&mut out);
    out
}
