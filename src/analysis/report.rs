//! `report.md`: the summary as Markdown tables, with the seed paper's numbers side by side.
use std::fmt::Write as _;
use std::path::Path;

use crate::stats::{BootstrapCi, RateDifferenceBootstrap, ShareBootstrap};

use super::UnfinishedRun;
use super::identity::FloorStatus;
use super::plot::{DISAGREEMENT_STEM, JACCARD_STEM, stem};
use super::read::{Pass, is_batch_invariant};
use super::summary::{
    AnalyzeOptions, CRITICAL_SET_DEFINITION, Comparison, Conditioning, ConditioningSummary,
    ConfigSummary, Effect, Factorial,
};

/// File name of the report.
pub const REPORT: &str = "report.md";

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

/// The section title prefix of a treatment: none for refeed, else the pass in words.
fn title(t: Pass) -> &'static str {
    match t {
        Pass::Spectrum => "Spectrum pass: ",
        Pass::RefeedReplica => "Refeed under the replica's schedule: ",
        Pass::SpectrumReplica => "Spectrum under the replica's schedule: ",
        _ => "",
    }
}

/// What a cell that depends on the replica floor says when the floor is a structural zero.
const NOT_MEASURABLE: &str = "not measurable";

/// Whether quantities relative to the replica floor can be read for `s`.
fn floor_measurable(s: &ConfigSummary) -> bool {
    s.meta.floor_status().measurable()
}

/// The replica-floor cell: the rate with its interval, or the structural zero in words.
fn floor_cell(s: &ConfigSummary, c: &Comparison) -> String {
    match s.meta.floor_status() {
        FloorStatus::StructuralZero => FloorStatus::StructuralZero.describe().to_string(),
        FloorStatus::SameScheduleControl | FloorStatus::BatchInvariantControl => format!(
            "{} {} (bitwise-identity control)",
            pct(c.rate),
            ci_pct(c.rate_ci)
        ),
        _ => format!("{} {}", pct(c.rate), ci_pct(c.rate_ci)),
    }
}

/// `text`, or [`NOT_MEASURABLE`] when the floor of `s` is a structural zero.
fn if_measurable(s: &ConfigSummary, text: impl FnOnce() -> String) -> String {
    if floor_measurable(s) {
        text()
    } else {
        NOT_MEASURABLE.to_string()
    }
}

/// A share with its cluster-bootstrap interval, "p% [lo, hi] (k/n)".
fn share_cell(b: Option<ShareBootstrap>, k: usize, n: usize) -> String {
    match b {
        Some(b) => format!(
            "{:.1}% [{:.1}, {:.1}] ({k}/{n})",
            100.0 * b.estimate,
            100.0 * b.ci.lo,
            100.0 * b.ci.hi
        ),
        None => format!("n/a ({k}/{n})"),
    }
}

/// Whether the zero-boundary crossings are most of the disagreements, read off the
/// cluster-bootstrap interval of their share.
fn mostly_verdict(b: Option<ShareBootstrap>) -> &'static str {
    match b {
        Some(b) if b.ci.lo > 0.5 => "yes (CI above 1/2)",
        Some(b) if b.ci.hi < 0.5 => "no (CI below 1/2)",
        Some(_) => "not shown (CI covers 1/2)",
        None => "no disagreements",
    }
}

fn headline(out: &mut String, summaries: &[ConfigSummary], t: Pass) {
    let what = match t {
        Pass::Spectrum => "SpectrumKV-resume disagreement above the replica floor",
        Pass::RefeedReplica => {
            "Re-feed under the replica's schedule: disagreement above the replica floor"
        }
        Pass::SpectrumReplica => {
            "SpectrumKV resume under the replica's schedule: disagreement above the replica floor"
        }
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
                "| {} | {} | {} | {} / {} | {} | {} | {} {} | {} | {} | {} | {} |",
                s.meta.config,
                s.meta.policy,
                cond_label(r.conditioning),
                r.replica.n_eligible,
                r.treatment.n_eligible,
                e.map_or(0, |e| e.n_problems),
                floor_cell(s, &r.replica),
                pct(r.treatment.rate),
                ci_pct(r.treatment.rate_ci),
                if_measurable(s, || format!(
                    "{} {}",
                    pp(e.map(|e| e.estimate)),
                    ci_pp(e.and_then(|e| e.bootstrap.map(|b| b.ci)))
                )),
                if_measurable(s, || format!(
                    "{} ({})",
                    num(e.and_then(|e| e.t_test.t), 2),
                    e.map_or_else(dash, |e| e.t_test.df.to_string())
                )),
                if_measurable(s, || pval(e.and_then(|e| e.t_test.p_value))),
                if_measurable(s, || boot_pval(e.and_then(|e| e.bootstrap))),
            );
        }
    }
    out.push('\n');
}

/// Per configuration and non-exact pass, the share of its continuations token-identical to
/// exact's, and what that makes of the replica floor.
fn token_identity(out: &mut String, summaries: &[ConfigSummary]) {
    out.push_str(
        "## Token identity with exact\n\n\
         Per pass, its continuations joined to exact's on (problem, pivot, alternative, branch, \
         sample) and the share whose generated token ids equal exact's. A pass whose \
         continuations all equal exact's exercised no numerical difference: for the replica \
         that makes the floor a **structural zero** (0 by construction, not a measurement), \
         and the excess and every claim relative to the floor are not measurable, unless \
         identity was asked for (`replica_schedule = \"same\"`, or the batch-invariant \
         policy), where it is the expected control.\n\n\
         | config | pass | identical to exact | share | replica floor |\n\
         | --- | --- | ---: | ---: | --- |\n",
    );
    for s in summaries {
        let m = &s.meta;
        if m.token_identity.is_empty() {
            let _ = writeln!(
                out,
                "| {} | (no continuations read) | | | {} |",
                m.config,
                m.floor_status().describe()
            );
        }
        for (pass, n) in &m.token_identity {
            let floor = if *pass == Pass::Replica {
                m.floor_status().describe().to_string()
            } else {
                String::new()
            };
            let _ = writeln!(
                out,
                "| {} | {} | {}/{} | {} | {} |",
                m.config,
                pass,
                n.identical,
                n.total,
                pct(n.share()),
                floor
            );
        }
    }
    out.push('\n');
}

fn effect_cell(e: &Effect) -> String {
    format!("{} {}", pp(e.estimate), ci_pp(e.ci))
}

/// The state × schedule design: exact's disagreement with each cell and the excess
/// decomposed, per configuration that ran the treatment under both schedules.
fn factorial(out: &mut String, summaries: &[ConfigSummary], t: Pass) {
    let with: Vec<(&ConfigSummary, &Factorial)> = summaries
        .iter()
        .filter_map(|s| s.factorial.as_ref().map(|f| (s, f)))
        .collect();
    let Some((_, first)) = with.first() else {
        return;
    };
    let (state, twin) = (first.state, first.twin);
    let _ = write!(
        out,
        "## {}State × schedule\n\n\
         Each cell's disagreement rate with exact over the keys that have all four passes \
         (exact, replica, {state}, {twin}), with its cluster-bootstrap interval:\n\n\
         | state \\ schedule | exact's | the replica's |\n| --- | --- | --- |\n\
         | decode-time snapshot | exact (0 by definition) | replica: the **schedule effect** (the floor) |\n\
         | {state} | {state}: the **state effect** | {twin}: both changed (what the seed measured) |\n\n\
         `d({twin}) = d({state}) + d(replica) + interaction`; the excess \
         `d({twin}) − d(replica)` is the state effect plus the interaction. Excess and \
         interaction have cluster-bootstrap intervals that recompute every rate and eligible \
         set on each resample of problems (the same draws for every quantity).\n\n\
         | config | conditioning | keys | G | replica (schedule) [CI] | {state} (state) [CI] | \
         {twin} (both) [CI] | excess {twin} − replica (pp) [CI] | interaction (pp) [CI] |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        title(t)
    );
    for (s, f) in with {
        for r in &f.rows {
            let cell = |i: usize| {
                let c = &r.cells[i];
                share_cell(c.rate, c.n_disagree, c.n_eligible)
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                s.meta.config,
                cond_label(r.conditioning),
                f.n_keys,
                f.n_problems,
                if floor_measurable(s) {
                    cell(0)
                } else {
                    FloorStatus::StructuralZero.describe().to_string()
                },
                cell(1),
                cell(2),
                if_measurable(s, || effect_cell(&r.excess)),
                if_measurable(s, || effect_cell(&r.interaction)),
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
    let sp = &crate::seed::claims().credit;
    // The paper's replica runs under another batch schedule; a same-schedule replica has a
    // floor of 0 by construction, and so has one that exercised no numerical difference:
    // those configurations are left out of the ranges.
    let stock: Vec<&ConfigSummary> = summaries
        .iter()
        .filter(|s| {
            !is_batch_invariant(&s.meta.policy)
                && s.meta.replica_schedule != "same"
                && floor_measurable(s)
                && s.meta.partial.is_none()
        })
        .collect();
    let same: Vec<&str> = summaries
        .iter()
        .filter(|s| !is_batch_invariant(&s.meta.policy) && s.meta.replica_schedule == "same")
        .map(|s| s.meta.config.as_str())
        .collect();
    let zero: Vec<&str> = summaries
        .iter()
        .filter(|s| !floor_measurable(s))
        .map(|s| s.meta.config.as_str())
        .collect();
    let rows = |c: Conditioning| stock.iter().filter_map(move |s| row_of(s, c));
    let ai = Conditioning::AnyInformative;
    let ti = Conditioning::TreatmentIndependent;
    let ts: Vec<f64> = rows(ai)
        .chain(rows(ti))
        .filter_map(|r| r.excess.as_ref().and_then(|e| e.t_test.t))
        .collect();
    let mut left_out = Vec::new();
    if !same.is_empty() {
        left_out.push(format!(
            "same-schedule replica whose floor is 0 by construction: {}",
            same.join(", ")
        ));
    }
    if !zero.is_empty() {
        left_out.push(format!(
            "structural-zero floor, the replica exercised no numerical difference: {}",
            zero.join(", ")
        ));
    }
    let _ = write!(
        out,
        "## Side by side with the seed paper\n\n\
         Ranges over this analysis's {} stock-policy configuration(s) with a measured replica \
         floor{} next to the seed abstract's ranges over its six configurations \
         (batch-invariant configurations are listed last). The abstract states neither the \
         threshold of its critical sets (ours: one range per τ = m/K, never pooled over τ; \
         `min |∪|` is the smallest union behind a range) nor which conditioning its \
         clustered t belongs to (ours: the linearized CR1 t of the excess under both).\n\n\
         | quantity | this analysis | seed paper |\n| --- | --- | --- |\n\
         | excess above the replica floor, any-informative (pp) | {} | {:.0}–{:.0} |\n\
         | excess above the replica floor, treatment-independent (pp) | {} | {:.0}–{:.0} |\n\
         | problem-clustered t of the excess | {} | {:.1}–{:.1} |\n\
         | replica floor (exact≠replica), any-informative | {} | {:.0}–{:.0}% |\n",
        stock.len(),
        if left_out.is_empty() {
            String::new()
        } else {
            format!(" (left out: {})", left_out.join("; "))
        },
        range(
            rows(ai).filter_map(|r| r.excess.map(|e| e.estimate)),
            100.0,
            1
        ),
        sp.excess_pp.0,
        sp.excess_pp.1,
        range(
            rows(ti).filter_map(|r| r.excess.map(|e| e.estimate)),
            100.0,
            1
        ),
        sp.excess_ti_pp.0,
        sp.excess_ti_pp.1,
        range(ts, 1.0, 2),
        sp.clustered_t.0,
        sp.clustered_t.1,
        {
            let r = range(rows(ai).filter_map(|r| r.replica.rate), 100.0, 1);
            if r == "—" { r } else { format!("{r}%") }
        },
        100.0 * sp.floor.0,
        100.0 * sp.floor.1,
    );
    // One Jaccard range per threshold value τ (configurations with other K share only the
    // thresholds they have in common), never pooled over τ.
    let mut by_tau: Vec<(f64, String)> = Vec::new();
    for s in &stock {
        for &tau in &s.taus {
            if !by_tau.iter().any(|(t, _)| *t == tau) {
                by_tau.push((tau, tau_fraction(tau, s.meta.k)));
            }
        }
    }
    by_tau.sort_by(|a, b| a.0.total_cmp(&b.0));
    for (tau, label) in &by_tau {
        let at = |pass: Pass| -> (Vec<f64>, Option<usize>) {
            let mut vals = Vec::new();
            let mut min_union: Option<usize> = None;
            for r in rows(ai) {
                let c = if pass == Pass::Replica {
                    &r.replica
                } else {
                    &r.treatment
                };
                if let Some(j) = c.jaccard.iter().find(|j| j.tau == *tau) {
                    min_union = Some(min_union.map_or(j.result.union, |m| m.min(j.result.union)));
                    vals.extend(j.result.value);
                }
            }
            (vals, min_union)
        };
        let ((jv, ju), (cv, cu)) = (at(Pass::Refeed), at(Pass::Replica));
        let union = |u: Option<usize>| u.map_or_else(dash, |u| u.to_string());
        let _ = writeln!(
            out,
            "| Jaccard(exact, refeed) at τ = {label} (min \\|∪\\| {}) | {} | {:.2}–{:.2} (τ not stated) |\n\
             | replica ceiling Jaccard(exact, replica) at τ = {label} (min \\|∪\\| {}) | {} | {:.2}–{:.2} (τ not stated) |",
            union(ju),
            range(jv, 1.0, 2),
            sp.jaccard.0,
            sp.jaccard.1,
            union(cu),
            range(cv, 1.0, 2),
            sp.ceiling.0,
            sp.ceiling.1,
        );
    }
    let bi: Vec<&ConfigSummary> = summaries
        .iter()
        .filter(|s| is_batch_invariant(&s.meta.policy))
        .collect();
    for s in &bi {
        let Some(r) = row_of(s, ai) else { continue };
        let frac = |c: &Comparison| format!("{}/{} ({})", c.n_disagree, c.n_eligible, pct(c.rate));
        let _ = writeln!(
            out,
            "| `{}` (batch-invariant): exact≠replica; exact≠{} | {}; {} | exactly 0; 0 |",
            s.meta.config,
            s.treatment,
            frac(&r.replica),
            frac(&r.treatment),
        );
    }
    out.push('\n');
}

/// `τ` as the reduced fraction `m/K` (e.g. `1/2` for 2/4).
fn tau_fraction(tau: f64, k: u32) -> String {
    let m = (tau * f64::from(k)).round() as u32;
    let g = gcd(m, k).max(1);
    if m == k {
        "1".into()
    } else {
        format!("{}/{}", m / g, k / g)
    }
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 { a } else { gcd(b, a % b) }
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

/// One configuration's cell of a seed claim, before the Holm adjustment across
/// configurations.
enum ClaimCell {
    /// A test of the claim: its p-value, whether the estimate lies on the claimed side, and
    /// a note (e.g. whether the interval overlaps the seed's range).
    Test {
        p: Option<f64>,
        claimed_side: bool,
        note: String,
    },
    /// No test (the verdict in words, e.g. not measurable).
    Text(String),
}

/// Verdict words of a claim: `yes`/`no`, or those of the equivalence claim.
#[derive(Clone, Copy)]
enum ClaimKind {
    /// A signed claim: "yes" on the claimed side, "no (opposite sign)" on the other.
    Signed,
    /// Equivalence by TOST: "equivalent within ±m" or "not shown equivalent".
    Equivalence(f64),
}

/// A p-value from a bootstrap of `reps` (valid) replicates: 0 means below the resolution
/// `2/reps`.
fn claim_p(p: f64, reps: usize) -> String {
    if p == 0.0 {
        format!("< {:.4}", 2.0 / reps as f64)
    } else {
        pval(Some(p))
    }
}

/// The verdict cells of one claim across configurations: p-values Holm-adjusted over the
/// configurations that have a test, each verdict read at the adjusted level.
fn claim_verdicts(cells: Vec<ClaimCell>, kind: ClaimKind, opts: &AnalyzeOptions) -> Vec<String> {
    let alpha = 1.0 - opts.level;
    let raw: Vec<Option<f64>> = cells
        .iter()
        .map(|c| match c {
            ClaimCell::Test { p, .. } => *p,
            ClaimCell::Text(_) => None,
        })
        .collect();
    let adjusted = crate::stats::holm(&raw).unwrap_or_else(|_| vec![None; raw.len()]);
    cells
        .into_iter()
        .zip(adjusted)
        .map(|(c, adj)| match c {
            ClaimCell::Text(t) => t,
            ClaimCell::Test {
                p: Some(p),
                claimed_side,
                note,
            } => {
                let adj = adj.unwrap_or(1.0);
                let word = match (kind, adj < alpha, claimed_side) {
                    (ClaimKind::Signed, true, true) => "yes".to_string(),
                    (ClaimKind::Signed, true, false) => "no (opposite sign)".to_string(),
                    (ClaimKind::Signed, false, _) => "not shown".to_string(),
                    (ClaimKind::Equivalence(m), true, _) => format!("equivalent within ±{m}"),
                    (ClaimKind::Equivalence(m), false, _) => {
                        format!("not shown equivalent (±{m})")
                    }
                };
                let note = if note.is_empty() {
                    String::new()
                } else {
                    format!("; {note}")
                };
                format!(
                    "{word} (p {}, Holm {}{note})",
                    claim_p(p, opts.reps),
                    claim_p(adj, opts.reps)
                )
            }
            ClaimCell::Test { p: None, .. } => "no test".into(),
        })
        .collect()
}

/// The side-by-side reproduction table: one row per configuration (any-informative unless
/// the column says otherwise), the seed's ranges in the last row, then one line per seed claim
/// with its verdict in each configuration, read off the test in that row after a Holm
/// adjustment across the configurations.
fn reproduction(out: &mut String, summaries: &[ConfigSummary], opts: &AnalyzeOptions) {
    let sp = &crate::seed::claims().credit;
    let ai = Conditioning::AnyInformative;
    let ti = Conditioning::TreatmentIndependent;
    let lvl = 100.0 * opts.level;
    let twins: Vec<&str> = summaries
        .iter()
        .filter(|s| s.treatment == Pass::RefeedReplica)
        .map(|s| s.meta.config.as_str())
        .collect();
    let _ = write!(
        out,
        "## Reproduction table\n\n\
         One row per configuration (run dir), any-informative conditioning unless a column \
         says otherwise; every rate has its {lvl:.0}% interval (cluster bootstrap, or Wilson \
         for counts of snapshot checks) and every difference its test, as in the sections \
         below. The re-feed compared is `refeed`{}. *Crossing classes* are the \
         exact≠re-feed disagreements that are a zero-boundary crossing or a polarity reversal \
         (shares of the disagreements, cluster-bootstrap intervals). *Mean-zero* is the \
         cluster-mean t test of mean(Â_refeed − Â_exact) = 0 and the TOST p of \
         |mean| < {} (equivalence). Jaccard is at the first τ = m/K ≥ 1/2. A configuration \
         whose replica exercised no numerical difference (every replica continuation \
         token-identical to exact's, see *Token identity with exact*) has a structural-zero \
         floor, and its excess is not measurable. Cost is the device-seconds of all passes in \
         the manifests, in dollars at ${:.2} per GPU-hour (`--usd-per-gpu-hour`).\n\n\
         | config | policy | G | N replica / refeed | replica floor [CI] | excess (pp) [CI] | \
         clustered t (df), p | excess TI (pp) [CI], t | zero-boundary | polarity reversal | \
         mean-zero: mean [CI], p, TOST p | τ | Jaccard(exact, refeed) [CI] | ceiling [CI] | \
         snapshot hit rate | device-s | USD |\n\
         | --- | --- | ---: | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | ---: | ---: |\n",
        if twins.is_empty() {
            String::new()
        } else {
            format!(
                ", or `refeed_replica` (the re-fed state under the replica's schedule, as the \
                 seed measured) in {}",
                twins.join(", ")
            )
        },
        opts.equivalence_margin,
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
        let classes = [c.classes.zero_boundary, c.classes.polarity_reversal];
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} / {} | {} | {} | {} | {} | {} | {} | {} {}, p {}, TOST p {} | {} | {} | {} | {} | {:.1} | {:.2} |",
            s.meta.config,
            s.meta.policy,
            e.map_or(0, |e| e.n_problems),
            r.replica.n_eligible,
            c.n_eligible,
            floor_cell(s, &r.replica),
            if_measurable(s, || format!(
                "{} {}",
                pp(e.map(|e| e.estimate)),
                ci_pp(e.and_then(|e| e.bootstrap.map(|b| b.ci)))
            )),
            if_measurable(s, || format!(
                "{} ({}), p {}",
                num(e.and_then(|e| e.t_test.t), 2),
                e.map_or_else(dash, |e| e.t_test.df.to_string()),
                pval(e.and_then(|e| e.t_test.p_value))
            )),
            if_measurable(s, || format!(
                "{} {}, t {}",
                pp(et.map(|e| e.estimate)),
                ci_pp(et.and_then(|e| e.bootstrap.map(|b| b.ci))),
                num(et.and_then(|e| e.t_test.t), 2)
            )),
            share_cell(c.class_shares[0], classes[0], c.n_disagree),
            share_cell(c.class_shares[1], classes[1], c.n_disagree),
            num(m.map(|m| m.t_test.estimate), 4),
            ci_num(m.and_then(|m| m.t_ci), 4),
            pval(m.and_then(|m| m.t_test.p_value)),
            pval(c.equivalence.map(|e| e.p_value)),
            tau.map_or_else(dash, |i| tau_label(s.taus[i], s.meta.k)),
            tau.map_or_else(dash, |i| jaccard_cell(c, i)),
            tau.map_or_else(dash, |i| if floor_measurable(s) {
                jaccard_cell(&r.replica, i)
            } else {
                format!("{} ({NOT_MEASURABLE})", jaccard_cell(&r.replica, i))
            }),
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
        100.0 * sp.floor.0,
        100.0 * sp.floor.1,
        sp.excess_pp.0,
        sp.excess_pp.1,
        sp.clustered_t.0,
        sp.clustered_t.1,
        sp.excess_ti_pp.0,
        sp.excess_ti_pp.1,
        sp.jaccard.0,
        sp.jaccard.1,
        sp.ceiling.0,
        sp.ceiling.1,
    );
    let stock: Vec<&ConfigSummary> = summaries
        .iter()
        .filter(|s| !is_batch_invariant(&s.meta.policy) && s.meta.partial.is_none())
        .collect();
    if !stock.is_empty() {
        seed_claims(out, &stock, opts);
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

/// One seed claim: its line, how its verdict reads, and its cell for a configuration.
type Claim = (String, ClaimKind, Box<dyn Fn(&ConfigSummary) -> ClaimCell>);

/// The seed claims, one line each, one verdict per stock configuration.
fn seed_claims(out: &mut String, stock: &[&ConfigSummary], opts: &AnalyzeOptions) {
    let alpha = 1.0 - opts.level;
    let _ = write!(
        out,
        "### Seed claims, configuration by configuration\n\n\
         Each verdict is read off a test in the row above, its p-value Holm-adjusted across \
         the {} configuration(s) of the line (both shown, `Holm` the adjusted one): *yes* when \
         the adjusted p is below α = {alpha:.2} and the estimate lies on the claimed side, \
         *not shown* otherwise; in brackets whether the interval overlaps the seed's range. \
         Tests: the excess by its cluster-bootstrap percentile p (the interval above); the \
         clustered t by its t p; the floor by the bootstrap p of rate = 0; the Jaccard claim \
         by the paired bootstrap of ceiling − Jaccard; *mostly zero-boundary* by the \
         bootstrap p of share = 1/2; mean-zero by TOST (equivalence within the margin). \
         Claims relative to the replica floor are *{NOT_MEASURABLE}* where the floor is a \
         structural zero.\n\n| claim | {} |\n| --- |{}\n",
        stock.len(),
        stock
            .iter()
            .map(|s| format!("`{}`", s.meta.config))
            .collect::<Vec<_>>()
            .join(" | "),
        " --- |".repeat(stock.len()),
    );
    for (claim, kind, cell) in &credit_claims(opts) {
        let cells = claim_verdicts(stock.iter().map(|s| cell(s)).collect(), *kind, opts);
        let _ = writeln!(out, "| {claim} | {} |", cells.join(" | "));
    }
    out.push('\n');
}

/// The credit claims of the seed paper, its numbers from [`crate::seed::claims`].
fn credit_claims(opts: &AnalyzeOptions) -> Vec<Claim> {
    let sp = &crate::seed::claims().credit;
    vec![
        (
            format!(
                "re-feed excess above the replica floor > 0, any-informative (seed: {:+.0} to {:+.0} pp)",
                sp.excess_pp.0, sp.excess_pp.1
            ),
            ClaimKind::Signed,
            Box::new(move |s| {
                excess_claim(s, Conditioning::AnyInformative, sp.excess_pp)
            }),
        ),
        (
            format!(
                "re-feed excess > 0, treatment-independent (seed: {:+.0} to {:+.0} pp)",
                sp.excess_ti_pp.0, sp.excess_ti_pp.1
            ),
            ClaimKind::Signed,
            Box::new(move |s| {
                excess_claim(s, Conditioning::TreatmentIndependent, sp.excess_ti_pp)
            }),
        ),
        (
            format!(
                "problem-clustered t of the excess significant, any-informative (seed: t = {:.1} to {:.1})",
                sp.clustered_t.0, sp.clustered_t.1
            ),
            ClaimKind::Signed,
            Box::new(clustered_t_claim),
        ),
        (
            format!(
                "replica floor > 0 (seed: {:.0} to {:.0}%)",
                100.0 * sp.floor.0,
                100.0 * sp.floor.1
            ),
            ClaimKind::Signed,
            Box::new(move |s| floor_claim(s, sp.floor)),
        ),
        (
            format!(
                "Jaccard(exact, refeed) below the replica ceiling, paired test at the first τ ≥ 1/2 (seed: {:.2}–{:.2} vs {:.2}–{:.2})",
                sp.jaccard.0, sp.jaccard.1, sp.ceiling.0, sp.ceiling.1
            ),
            ClaimKind::Signed,
            Box::new(move |s| jaccard_claim(s, sp.jaccard)),
        ),
        (
            "exact≠re-feed disagreements mostly zero-boundary crossings (share > 1/2), any-informative".into(),
            ClaimKind::Signed,
            Box::new(|s| mostly(s, Conditioning::AnyInformative)),
        ),
        (
            "exact≠re-feed disagreements mostly zero-boundary crossings (share > 1/2), treatment-independent".into(),
            ClaimKind::Signed,
            Box::new(|s| mostly(s, Conditioning::TreatmentIndependent)),
        ),
        (
            "re-feed unbiased: mean(Â_refeed − Â_exact) equivalent to 0 (TOST), any-informative".into(),
            ClaimKind::Equivalence(opts.equivalence_margin),
            Box::new(unbiased_claim),
        ),
    ]
}

/// The cell of a claim relative to the replica floor where that floor is a structural zero.
fn floor_text() -> ClaimCell {
    ClaimCell::Text(format!("{NOT_MEASURABLE} (structural-zero floor)"))
}

/// Re-feed excess above the replica floor > 0 under `c`, its interval against the seed's.
fn excess_claim(s: &ConfigSummary, c: Conditioning, seed: (f64, f64)) -> ClaimCell {
    if !floor_measurable(s) {
        return floor_text();
    }
    match row_of(s, c).and_then(|r| r.excess.as_ref().map(|e| (r, e))) {
        Some((r, e)) => ClaimCell::Test {
            p: e.bootstrap.map(|b| b.p_value),
            claimed_side: e.estimate > 0.0,
            note: overlaps(excess_ci(r), seed, 100.0).to_string(),
        },
        None => ClaimCell::Text("no test".into()),
    }
}

/// Exact≠re-feed disagreements mostly zero-boundary crossings under `c`.
fn mostly(s: &ConfigSummary, c: Conditioning) -> ClaimCell {
    match row_of(s, c).and_then(|r| r.treatment.class_shares[0]) {
        Some(b) => ClaimCell::Test {
            p: Some(b.p_value),
            claimed_side: b.estimate > 0.5,
            note: format!(
                "{:.0}% [{:.0}, {:.0}]",
                100.0 * b.estimate,
                100.0 * b.ci.lo,
                100.0 * b.ci.hi
            ),
        },
        None => ClaimCell::Text("no disagreements".into()),
    }
}

/// The problem-clustered t of the excess significant, any-informative.
fn clustered_t_claim(s: &ConfigSummary) -> ClaimCell {
    if !floor_measurable(s) {
        return floor_text();
    }
    match row_of(s, Conditioning::AnyInformative)
        .and_then(|r| r.excess.as_ref())
        .map(|e| e.t_test)
    {
        Some(t) => ClaimCell::Test {
            p: t.p_value,
            claimed_side: t.estimate > 0.0,
            note: String::new(),
        },
        None => ClaimCell::Text("no test".into()),
    }
}

/// Replica floor > 0, its interval against the seed's range.
fn floor_claim(s: &ConfigSummary, seed: (f64, f64)) -> ClaimCell {
    if !floor_measurable(s) {
        return floor_text();
    }
    match row_of(s, Conditioning::AnyInformative) {
        Some(r) => ClaimCell::Test {
            p: r.replica.rate_p,
            claimed_side: r.replica.rate.is_some_and(|x| x > 0.0),
            note: overlaps(r.replica.rate_ci.map(|c| (c.lo, c.hi)), seed, 1.0).to_string(),
        },
        None => ClaimCell::Text("no test".into()),
    }
}

/// Jaccard(exact, refeed) below the replica ceiling at the first τ ≥ 1/2 (paired test), its
/// interval against the seed's Jaccard range.
fn jaccard_claim(s: &ConfigSummary, seed: (f64, f64)) -> ClaimCell {
    if !floor_measurable(s) {
        return floor_text();
    }
    let (Some(r), Some(i)) = (row_of(s, Conditioning::AnyInformative), side_tau(s)) else {
        return ClaimCell::Text("no test".into());
    };
    match s.ceiling_gap.get(i).copied().flatten() {
        Some(g) => ClaimCell::Test {
            p: Some(g.p_value),
            claimed_side: g.estimate.is_some_and(|x| x > 0.0),
            note: overlaps(jaccard_ci(&r.treatment, i), seed, 1.0).to_string(),
        },
        None => ClaimCell::Text("no test (empty unions)".into()),
    }
}

/// Re-feed unbiased: mean(Â_refeed − Â_exact) equivalent to 0 by TOST, any-informative.
fn unbiased_claim(s: &ConfigSummary) -> ClaimCell {
    match row_of(s, Conditioning::AnyInformative) {
        Some(r) => ClaimCell::Test {
            p: r.treatment.equivalence.map(|e| e.p_value),
            claimed_side: true,
            note: String::new(),
        },
        None => ClaimCell::Text("no test".into()),
    }
}

fn classes(out: &mut String, summaries: &[ConfigSummary], t: Pass) {
    let _ = write!(
        out,
        "## {}How estimates disagree\n\n\
         Zero-boundary: exactly one estimate is 0. Polarity reversal: opposite non-zero signs. \
         Magnitude: same non-zero sign, different value. Each class is a share of the \
         comparison's disagreements with a cluster-bootstrap interval (problems resampled, \
         numerator and denominator recomputed: the disagreements of one problem are not \
         independent). *Mostly zero-boundary* is read off that interval against 1/2, under \
         both conditionings (any-informative admits estimates where only one pass is \
         informative, which favours crossings by construction).\n\n\
         | config | conditioning | comparison | N | disagree | zero-boundary [CI] | polarity reversal [CI] | magnitude [CI] | mostly zero-boundary |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        title(t)
    );
    for s in summaries {
        for r in &s.rows {
            for c in [&r.replica, &r.treatment] {
                let counts = [
                    c.classes.zero_boundary,
                    c.classes.polarity_reversal,
                    c.classes.magnitude,
                ];
                let share = |i: usize| share_cell(c.class_shares[i], counts[i], c.n_disagree);
                let _ = writeln!(
                    out,
                    "| {} | {} | exact vs {} | {} | {} | {} | {} | {} | {} |",
                    s.meta.config,
                    cond_label(r.conditioning),
                    c.pass,
                    c.n_eligible,
                    c.n_disagree,
                    share(0),
                    share(1),
                    share(2),
                    mostly_verdict(c.class_shares[0]),
                );
            }
        }
    }
    out.push('\n');
}

/// The mean-zero verdict of a comparison: equivalence is claimed only when TOST rejects.
fn equivalence_verdict(c: &Comparison, opts: &AnalyzeOptions) -> String {
    let m = opts.equivalence_margin;
    match c.equivalence {
        Some(e) if e.equivalent(1.0 - opts.level) => format!("equivalent within ±{m}"),
        Some(_) => format!("not shown equivalent (±{m})"),
        None => "no test".into(),
    }
}

fn mean_zero(out: &mut String, summaries: &[ConfigSummary], t: Pass, opts: &AnalyzeOptions) {
    let alpha = 1.0 - opts.level;
    let _ = write!(
        out,
        "## {}Mean-zero check\n\n\
         Mean over problems of the per-problem mean of `Â_X − Â_exact` over the comparison's \
         eligible estimates, with the cluster-mean t CI and the cluster-bootstrap CI, the t \
         test's p of mean = 0, and the equivalence test (TOST, two one-sided t tests with the \
         same standard error) of |mean| < {m} (`--equivalence-margin`, on the Â scale). \
         *Equivalent within ±{m}* only when the TOST p is below α = {alpha:.2}; a t test that \
         does not reject mean = 0 is not evidence of equivalence.\n\n\
         | config | conditioning | X | mean | t CI | bootstrap CI | p (mean = 0) | TOST p | verdict |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        title(t),
        m = opts.equivalence_margin,
    );
    for s in summaries {
        for r in &s.rows {
            for c in [&r.replica, &r.treatment] {
                let m = c.mean_diff.as_ref();
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    s.meta.config,
                    cond_label(r.conditioning),
                    c.pass,
                    num(m.map(|m| m.t_test.estimate), 4),
                    ci_num(m.and_then(|m| m.t_ci), 4),
                    ci_num(m.and_then(|m| m.bootstrap_ci.map(|b| (b.lo, b.hi))), 4),
                    pval(m.and_then(|m| m.t_test.p_value)),
                    pval(c.equivalence.map(|e| e.p_value)),
                    equivalence_verdict(c, opts),
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
         {CRITICAL_SET_DEFINITION} (`docs/guide/concepts.md`), for every τ = m/K. Under any-informative every \
         critical key is eligible for its comparison (an ineligible key has Â = 0 in both \
         passes). Under treatment-independent only exact-informative keys are eligible, but a \
         key with exact uninformative (Â_exact = 0) and |Â_{t}| ≥ τ (or |Â_replica| ≥ τ) \
         stays in C_{t} (C_replica); the column *exact uninformative* counts those keys of \
         each union, which a conditioned critical set would drop. So the sets, the Jaccard and \
         the ceiling are the same under both conditionings. Jaccard = |C_exact ∩ C_π| / \
         |C_exact ∪ C_π| with a cluster-bootstrap CI over every problem; an empty union has no \
         Jaccard (\"empty union\", null in `summary.parquet`), and bootstrap replicates with an \
         empty union are dropped. The replica ceiling is Jaccard(exact, replica) at the same \
         τ; *ceiling − Jaccard* is tested paired: each bootstrap replicate recomputes both \
         indices on the same resampled problems (percentile CI and p).\n\n",
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
             | τ | \\|C_exact\\| | \\|C_{t}\\| | \\|C_replica\\| | exact uninformative ({t} / replica) | Jaccard(exact, {t}) [CI] | replica ceiling [CI] | ceiling − Jaccard [CI], p (paired) |\n\
             | --- | --- | --- | --- | --- | --- | --- | --- |\n",
            s.meta.config,
        );
        for (i, &tau) in s.taus.iter().enumerate() {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} / {} | {} | {} | {} |",
                tau_label(tau, s.meta.k),
                a.treatment.jaccard[i].result.size_a,
                a.treatment.jaccard[i].result.size_b,
                a.replica.jaccard[i].result.size_b,
                ti.treatment.jaccard[i].n_ineligible,
                ti.replica.jaccard[i].n_ineligible,
                jaccard_cell(&a.treatment, i),
                jaccard_cell(&a.replica, i),
                if_measurable(s, || gap_cell(s, i)),
            );
        }
        out.push('\n');
    }
}

/// The paired ceiling − Jaccard test at `τ` index `i`: "gap [lo, hi], p".
fn gap_cell(s: &ConfigSummary, i: usize) -> String {
    match s.ceiling_gap.get(i).copied().flatten() {
        Some(g) => format!(
            "{} [{:+.2}, {:+.2}], p {}",
            g.estimate.map_or_else(dash, |x| format!("{x:+.3}")),
            g.ci.lo,
            g.ci.hi,
            claim_p(g.p_value, g.ci.valid_reps)
        ),
        None => "empty union".into(),
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
    let _ = write!(
        out,
        "## Definitions and choices\n\n\
         - `Â = (orig_successes − alt_successes)/K` is recomputed from the counts; a pass is \
         informative when its 2K outcomes are not all equal. Disagreement is inequality of the \
         quantized estimates.\n\
         - Only estimates `(problem, pivot_pos, alt_rank)` with exact, replica and the \
         treatment enter (`incomplete` counts the others); each treatment (refeed, spectrum, \
         refeed_replica, spectrum_replica) is analysed by the same code, its name in place of \
         refeed below.\n\
         - *any-informative*: exact vs X is eligible when exact or X is informative, so the two \
         comparisons have their own sets; the excess is the difference of the two rates, the \
         paired `D_j` uses the union of the two sets, and the two are different numbers.\n\
         - *treatment-independent*: eligible iff exact is informative, one set for both \
         comparisons; the excess equals D̄ and its linearized t equals D̄'s CR1 t.\n\
         - Tests of the excess: linearized CR1 t, `z_g = Σ_{{j∈g∩refeed}}(y_j − r_refeed)/N_refeed \
         − Σ_{{j∈g∩replica}}(y_j − r_replica)/N_replica`, `V = G/(G−1)·Σ_g z_g²`, `t = excess/√V`, \
         G − 1 df; cluster bootstrap recomputing both eligible sets per replicate (replicates \
         with an empty set dropped), percentile CI and p = min(1, 2·min(#≤0, #≥0)/valid).\n\
         - Tests of D̄ and d̄: cluster-mean t, per-problem means of `D_j`, \
         `t = mean/(sd/√G)`, G − 1 df; CR1, intercept-only OLS with problem-clustered variance \
         `G/(G−1)·Σ_g(Σ e_j)²/N²`, G − 1 df. Cluster bootstrap: problems drawn with \
         replacement, percentile interval.\n\
         - Critical sets: {CRITICAL_SET_DEFINITION}; see *Critical-token sets* and \
         `docs/guide/concepts.md`.\n\
         - Mean-zero: t test of mean = 0 and TOST of |mean| < margin; only TOST can show \
         equivalence. Seed claims read in several configurations have their p-values \
         Holm-adjusted across those configurations.\n\
         - Token identity: a pass's continuations joined to exact's; a replica identical to \
         exact everywhere without asking for it is a structural-zero floor.\n"
    );
}

/// Per configuration, the summary comparable with the seed paper's re-feed: refeed under the
/// replica's schedule when the configuration ran it (state and schedule both changed, as in
/// the seed), else refeed; in input order.
fn seed_comparable(summaries: &[ConfigSummary]) -> Vec<ConfigSummary> {
    let has = |cfg: &str, t: Pass| {
        summaries
            .iter()
            .any(|s| s.meta.config == cfg && s.treatment == t)
    };
    summaries
        .iter()
        .filter(|s| match s.treatment {
            Pass::RefeedReplica => true,
            Pass::Refeed => !has(&s.meta.config, Pass::RefeedReplica),
            _ => false,
        })
        .cloned()
        .collect()
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
            m.run.name,
            m.run.model,
            m.dtype,
            m.run.exec.policy,
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
    token_identity(&mut out, &configs);
    let seed_like = seed_comparable(summaries);
    if !seed_like.is_empty() {
        reproduction(&mut out, &seed_like, opts);
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
        factorial(&mut out, &group, t);
        paired_contrast(&mut out, &group, t);
        let (dis, jac) = (stem(DISAGREEMENT_STEM, t), stem(JACCARD_STEM, t));
        let _ = write!(
            out,
            "![Disagreement rates vs replica floor ({t})]({dis}.png)\n\n\
             (also [`{dis}.svg`]({dis}.svg))\n\n"
        );
        if t == Pass::Refeed {
            versus_paper(&mut out, &seed_like);
        }
        classes(&mut out, &group, t);
        mean_zero(&mut out, &group, t, opts);
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
