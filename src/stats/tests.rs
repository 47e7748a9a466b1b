//! Tests for `stats`: hand-worked values, the numpy/scipy/statsmodels fixture written by
//! `tests/fixtures/stats/gen_stats_fixture.py`, degenerate inputs, determinism and coverage.
use serde_json::Value;
use statrs::distribution::{Binomial, Discrete};

use super::*;

const FIXTURE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/stats/stats_fixture.json"
));

fn fixture() -> Value {
    serde_json::from_str(FIXTURE).expect("fixture parses")
}

fn num(v: &Value) -> f64 {
    v.as_f64().expect("number")
}

fn nums(v: &Value) -> Vec<f64> {
    v.as_array().expect("array").iter().map(num).collect()
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("u64"))
        .collect()
}

#[track_caller]
fn close(got: f64, want: f64, tol: f64) {
    assert!(
        (got - want).abs() <= tol * want.abs().max(1.0),
        "got {got}, want {want} (tol {tol})"
    );
}

/// The D table, rows interleaved across problems on purpose:
///
/// | problem | D_j            | n_g | Σ D | d_g |
/// |---------|----------------|-----|-----|-----|
/// | 10      | 1, 0, 1, 0     | 4   | 2   | 1/2 |
/// | 20      | 1              | 1   | 1   | 1   |
/// | 30      | 0, −1, 1       | 3   | 0   | 0   |
/// | 40      | 1, 1           | 2   | 2   | 1   |
/// | 50      | 0, 0, 0, −1, 1, 1 | 6 | 1  | 1/6 |
///
/// G = 5, N = 16.
fn d_table() -> (Vec<f64>, Vec<u64>) {
    let rows: [(u64, f64); 16] = [
        (30, 0.0),
        (10, 1.0),
        (50, 0.0),
        (40, 1.0),
        (10, 0.0),
        (50, 0.0),
        (20, 1.0),
        (30, -1.0),
        (50, 0.0),
        (10, 1.0),
        (50, -1.0),
        (40, 1.0),
        (30, 1.0),
        (50, 1.0),
        (10, 0.0),
        (50, 1.0),
    ];
    (
        rows.iter().map(|r| r.1).collect(),
        rows.iter().map(|r| r.0).collect(),
    )
}

#[test]
fn d_table_literal_matches_fixture() {
    let fx = fixture();
    let (v, c) = d_table();
    assert_eq!(v, nums(&fx["d_table"]["values"]));
    assert_eq!(c, ids(&fx["d_table"]["clusters"]));
}

#[test]
fn cluster_mean_t_matches_hand_worked_table() {
    // mean(d) = (1/2 + 1 + 0 + 1 + 1/6)/5 = 8/15.
    // deviations ×30: −1, 14, −16, 14, −11 → Σ² = 770/900, var = 770/900/4 = 77/360,
    // se = √(77/360/5) = 0.2068278940998..., t = (8/15)/se = 2.578633484881..., df 4.
    let (v, c) = d_table();
    let r = cluster_mean_t(&v, &c).unwrap();
    close(r.estimate, 8.0 / 15.0, 1e-15);
    close(r.se.unwrap(), (77.0_f64 / 360.0 / 5.0).sqrt(), 1e-14);
    close(r.t.unwrap(), 2.578_633_484_881_216_5, 1e-13);
    assert_eq!((r.df, r.n_clusters, r.n_obs), (4, 5, 16));

    let fx = &fixture()["cluster_mean_t"];
    close(r.estimate, num(&fx["estimate"]), 1e-14);
    close(r.se.unwrap(), num(&fx["se"]), 1e-13);
    close(r.t.unwrap(), num(&fx["t"]), 1e-13);
    close(r.p_value.unwrap(), num(&fx["p_value"]), 1e-10); // scipy ttest_1samp: 0.061416
    let (lo, hi) = r.confidence_interval(0.95).unwrap().unwrap();
    let ci = nums(&fx["ci95"]);
    close(lo, ci[0], 1e-10);
    close(hi, ci[1], 1e-10);
}

#[test]
fn cr1_matches_design_doc_formula_and_statsmodels_use_t() {
    // β = 6/16 = 0.375. Residual cluster sums S_g − n_g β: 10: 2 − 1.5 = 0.5, 20: 0.625,
    // 30: −1.125, 40: 1.25, 50: −1.25; Σ² = 161/32.
    // V = 5/4 · (161/32) / 16² = 805/32768, t = 0.375/√V = 2.392534974140..., df 4.
    let (v, c) = d_table();
    let r = cr1_t(&v, &c).unwrap();
    close(r.estimate, 0.375, 0.0);
    close(r.se.unwrap(), (805.0_f64 / 32768.0).sqrt(), 1e-15);
    close(r.t.unwrap(), 2.392_534_974_140_289, 1e-13);
    assert_eq!(r.df, 4);

    let fx = &fixture()["cr1"];
    let doc = &fx["design_doc_numpy"];
    close(r.se.unwrap().powi(2), num(&doc["variance"]), 1e-14);
    close(r.p_value.unwrap(), num(&doc["p_value"]), 1e-10); // 0.074961
    // statsmodels default factor G/(G−1)·(N−1)/(N−K) = G/(G−1) for K = 1, so it agrees.
    let smt = &fx["statsmodels_use_t_default_correction"];
    close(r.se.unwrap(), num(&smt["se"]), 1e-12);
    close(r.t.unwrap(), num(&smt["t"]), 1e-12);
    close(r.p_value.unwrap(), num(&smt["p_value"]), 1e-10);
    let (lo, hi) = r.confidence_interval(0.95).unwrap().unwrap();
    let ci = nums(&smt["ci95"]);
    close(lo, ci[0], 1e-10);
    close(hi, ci[1], 1e-10);
    // statsmodels' default (use_t=False) p-value is normal-based, not ours.
    let smz = &fx["statsmodels_normal_default_correction"];
    assert!((r.p_value.unwrap() - num(&smz["p_value"])).abs() > 0.05);
}

#[test]
fn cr1_variance_is_g_over_g_minus_1_times_uncorrected_statsmodels() {
    let (v, c) = d_table();
    let r = cr1_t(&v, &c).unwrap();
    let raw = num(&fixture()["cr1"]["statsmodels_use_t_no_correction"]["se"]);
    close(r.se.unwrap().powi(2), raw * raw * 5.0 / 4.0, 1e-12);
}

#[test]
fn results_do_not_depend_on_row_order_or_cluster_labels() {
    let (v, c) = d_table();
    let mut rows: Vec<(u64, f64)> = c.iter().zip(&v).map(|(&g, &x)| (g * 7 + 3, x)).collect();
    rows.reverse();
    rows.sort_by_key(|r| r.0 % 4);
    let (v2, c2): (Vec<f64>, Vec<u64>) = rows.iter().map(|r| (r.1, r.0)).unzip();
    for f in [cluster_mean_t, cr1_t] {
        let (a, b) = (f(&v, &c).unwrap(), f(&v2, &c2).unwrap());
        close(a.estimate, b.estimate, 1e-15);
        close(a.t.unwrap(), b.t.unwrap(), 1e-13);
    }
}

#[test]
fn single_cluster_gives_estimate_but_no_se_t_or_p() {
    for f in [cluster_mean_t, cr1_t] {
        let r = f(&[1.0, 0.0, 1.0, 1.0], &[7, 7, 7, 7]).unwrap();
        close(r.estimate, 0.75, 0.0);
        assert_eq!(
            (r.se, r.t, r.p_value, r.df, r.n_clusters),
            (None, None, None, 0, 1)
        );
        assert_eq!(r.confidence_interval(0.95).unwrap(), None);
    }
}

#[test]
fn identical_cluster_means_give_zero_se_no_t_and_a_point_interval() {
    // No flips at all (the common case), balanced ±1 clusters, and a mean that is not a
    // binary fraction (0.1·3/3 ≠ 0.1 in floating point must not fake a tiny variance).
    let cases: [(&[f64], &[u64], f64); 3] = [
        (&[0.0; 6], &[1, 1, 2, 3, 3, 3], 0.0),
        (&[1.0, -1.0, 0.0, 0.0, 1.0, -1.0], &[1, 1, 2, 2, 3, 3], 0.0),
        (&[0.1, 0.1, 0.1, 0.1], &[1, 1, 1, 2], 0.1),
    ];
    for (v, c, want) in cases {
        for f in [cluster_mean_t, cr1_t] {
            let r = f(v, c).unwrap();
            assert!((r.estimate - want).abs() < 1e-15, "{r:?}");
            assert_eq!((r.se, r.t, r.p_value), (Some(0.0), None, None), "{v:?}");
            assert_eq!(
                r.confidence_interval(0.95).unwrap(),
                Some((r.estimate, r.estimate))
            );
        }
    }
}

#[test]
fn invalid_arguments_are_spec_errors() {
    assert!(matches!(
        cluster_mean_t(&[1.0], &[1, 2]),
        Err(Error::Spec(_))
    ));
    assert!(matches!(cr1_t(&[], &[]), Err(Error::Spec(_))));
    assert!(matches!(
        cr1_t(&[f64::NAN, 1.0], &[1, 2]),
        Err(Error::Spec(_))
    ));
    let r = cluster_mean_t(&[1.0, 0.0], &[1, 2]).unwrap();
    assert!(r.confidence_interval(1.0).is_err());
    assert!(r.confidence_interval(f64::NAN).is_err());
    assert!(cluster_bootstrap_ci(&[1.0], &[1], pooled_mean, 0, 1, 0.9).is_err());
    assert!(wilson(3, 2, 0.95).is_err());
    assert!(jaccard(&[(1u32, 0.5)], &[(1u32, 0.5)], f64::NAN).is_err());
    assert!(tally_disagreements(&[0.0], &[f64::INFINITY]).is_err());
}

#[test]
fn flip_contrast_is_refeed_flip_minus_replica_flip() {
    assert_eq!(flip_contrast(0.5, 0.5, 0.5), 0.0);
    assert_eq!(flip_contrast(0.5, 0.25, 0.5), 1.0);
    assert_eq!(flip_contrast(0.5, 0.5, -0.5), -1.0);
    assert_eq!(flip_contrast(0.5, 0.0, 0.75), 0.0);
    assert_eq!(flip_contrast(0.0, -0.0, 0.0), 0.0);
}

#[test]
fn classify_separates_zero_crossing_polarity_and_magnitude() {
    assert_eq!(classify(0.25, 0.25), None);
    assert_eq!(classify(0.0, -0.0), None);
    assert_eq!(classify(0.0, 0.5), Some(Disagreement::ZeroBoundary));
    assert_eq!(classify(-0.25, 0.0), Some(Disagreement::ZeroBoundary));
    assert_eq!(classify(-0.0, -0.75), Some(Disagreement::ZeroBoundary));
    assert_eq!(classify(0.25, -0.25), Some(Disagreement::PolarityReversal));
    assert_eq!(classify(-1.0, 1.0), Some(Disagreement::PolarityReversal));
    assert_eq!(classify(0.25, 1.0), Some(Disagreement::Magnitude));
    assert_eq!(classify(-0.5, -0.75), Some(Disagreement::Magnitude));
    assert_eq!(classify(f64::NAN, 0.5), None);
}

/// One keyed pass: `((problem, item), Â)`.
type Pass = Vec<((u64, u64), f64)>;

/// Keyed passes with K = 4, read from the fixture.
fn passes() -> (Pass, Pass) {
    let fx = fixture();
    let read = |v: &Value| {
        v.as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let p = r.as_array().unwrap();
                ((p[0].as_u64().unwrap(), p[1].as_u64().unwrap()), num(&p[2]))
            })
            .collect()
    };
    (read(&fx["jaccard"]["a"]), read(&fx["jaccard"]["b"]))
}

#[test]
fn disagreement_tally_on_common_keys_matches_fixture() {
    // Common keys: (10,1) 0.5→0.25 mag, (10,2) −0.5→0.5 pol, (20,0) 0→−0.5 zero,
    // (30,1) −0.25→−0.75 mag, (30,2) 0.5→0 zero, (40,0) 0.25→−0.25 pol,
    // (50,1) −0.75→−0.5 mag; (10,0), (20,1), (30,0), (50,0) agree.
    let (a, b) = passes();
    let mb: BTreeMap<_, _> = b.into_iter().collect();
    let (x, y): (Vec<f64>, Vec<f64>) = a
        .iter()
        .filter_map(|(k, v)| mb.get(k).map(|w| (*v, *w)))
        .unzip();
    let t = tally_disagreements(&x, &y).unwrap();
    assert_eq!(
        t,
        DisagreementCounts {
            agree: 4,
            zero_boundary: 2,
            polarity_reversal: 2,
            magnitude: 3
        }
    );
    let fx = &fixture()["jaccard"]["disagreements_on_common_keys"];
    assert_eq!(t.magnitude as u64, fx["magnitude"].as_u64().unwrap());
    assert_eq!(
        t.zero_boundary as u64,
        fx["zero_boundary"].as_u64().unwrap()
    );
}

#[test]
fn jaccard_of_critical_sets_matches_hand_count_and_fixture() {
    // τ = 1/2. C_a = {(10,0),(10,1),(10,2),(30,0),(30,2),(50,0),(50,1),(50,2)} (8; (50,2)
    // exists only in pass a), C_b = {(10,0),(10,2),(20,0),(30,0),(30,1),(50,0),(50,1)} (7),
    // ∩ = {(10,0),(10,2),(30,0),(50,0),(50,1)} (5), ∪ = 10, J = 1/2.
    let (a, b) = passes();
    let r = jaccard(&a, &b, 0.5).unwrap();
    let fx = &fixture()["jaccard"];
    assert_eq!((r.size_a, r.size_b, r.intersection, r.union), (8, 7, 5, 10));
    assert_eq!(r.union as u64, fx["union"].as_u64().unwrap());
    assert_eq!(r.intersection as u64, fx["intersection"].as_u64().unwrap());
    assert_eq!(r.value, Some(num(&fx["value"])));
    assert_eq!(critical_set(&a, 0.5).unwrap().len(), 8);
}

#[test]
fn jaccard_counts_estimate_exactly_at_tau_as_critical() {
    let k = 8.0;
    let a = [(1u32, 3.0 / k), (2, -3.0 / k), (3, 2.0 / k)];
    let b = [(1u32, 3.0 / k), (2, 0.0), (3, 4.0 / k)];
    let r = jaccard(&a, &b, 3.0 / k).unwrap();
    assert_eq!((r.size_a, r.size_b, r.intersection, r.union), (2, 2, 1, 3));
    assert_eq!(r.value, Some(1.0 / 3.0));
}

#[test]
fn jaccard_with_empty_union_has_no_value() {
    let a = [(1u32, 0.25), (2, -0.25)];
    let r = jaccard(&a, &a, 0.5).unwrap();
    assert_eq!((r.size_a, r.size_b, r.intersection, r.union), (0, 0, 0, 0));
    assert_eq!(r.value, None);
    let empty: [(u32, f64); 0] = [];
    assert_eq!(jaccard(&empty, &empty, 0.5).unwrap().value, None);
}

#[test]
fn jaccard_rejects_duplicate_keys() {
    let a = [(1u32, 0.5), (1, 0.75)];
    assert!(matches!(jaccard(&a, &a, 0.5), Err(Error::Spec(_))));
}

#[test]
fn splitmix64_matches_reference_stream() {
    let fx = &fixture()["splitmix64"];
    let mut r = SplitMix64::new(0);
    for want in fx["first"].as_array().unwrap() {
        let want = u64::from_str_radix(want.as_str().unwrap(), 16).unwrap();
        assert_eq!(r.next_u64(), want);
    }
    let mut r = SplitMix64::new(0xDEAD_BEEF);
    let got: Vec<u64> = (0..10).map(|_| r.below(7) as u64).collect();
    assert_eq!(got, ids(&fx["seed_deadbeef_below_7"]));
}

#[track_caller]
fn check_boot(got: Option<BootstrapCi>, want: &Value) {
    let got = got.expect("some finite replicate");
    close(got.lo, num(&want["lo"]), 1e-12);
    close(got.hi, num(&want["hi"]), 1e-12);
    assert_eq!(got.valid_reps as u64, want["valid_reps"].as_u64().unwrap());
}

#[test]
fn cluster_bootstrap_matches_python_replay_of_the_same_draws() {
    let fx = fixture();
    let bx = &fx["bootstrap"];
    let (seed, reps, level) = (
        bx["seed"].as_u64().unwrap(),
        bx["reps"].as_u64().unwrap() as usize,
        num(&bx["level"]),
    );
    let (v, c) = d_table();
    let first = cluster_bootstrap_replicates(&v, &c, pooled_mean, 5, seed).unwrap();
    assert_eq!(first, nums(&bx["d_pooled_mean"]["first_reps"]));
    let pooled = cluster_bootstrap_ci(&v, &c, pooled_mean, reps, seed, level).unwrap();
    check_boot(pooled, &bx["d_pooled_mean"]);
    let cm = cluster_bootstrap_ci(&v, &c, mean_of_cluster_means, reps, seed, level).unwrap();
    check_boot(cm, &bx["d_mean_of_cluster_means"]);

    let (a, b) = passes();
    let j = jaccard_bootstrap_ci(&a, &b, 0.5, |k| k.0, reps, seed, level).unwrap();
    check_boot(j, &bx["jaccard"]);
}

#[test]
fn clustered_mean_ci_of_refeed_minus_exact_matches_fixture() {
    // Â_b − Â_a on the 11 common keys; per-problem means 1/4, −1/4, −1/3, −1/2, 1/8:
    // mean −17/120, sd/√5 = 17/120 as well, so t = −1 exactly.
    let fx = fixture();
    let md = &fx["mean_diff"];
    let (v, c) = (nums(&md["values"]), ids(&md["clusters"]));
    let bx = &fx["bootstrap"];
    let r = clustered_mean_ci(
        &v,
        &c,
        0.95,
        bx["reps"].as_u64().unwrap() as usize,
        bx["seed"].as_u64().unwrap(),
    )
    .unwrap();
    close(r.t_test.estimate, -17.0 / 120.0, 1e-15);
    close(r.t_test.t.unwrap(), -1.0, 1e-14);
    close(
        r.t_test.p_value.unwrap(),
        num(&md["cluster_mean_t"]["p_value"]),
        1e-10,
    );
    let (lo, hi) = r.t_ci.unwrap();
    let ci = nums(&md["cluster_mean_t"]["ci95"]);
    close(lo, ci[0], 1e-10);
    close(hi, ci[1], 1e-10);
    check_boot(r.bootstrap_ci, &bx["mean_diff_mean_of_cluster_means"]);
}

#[test]
fn bootstrap_is_deterministic_per_seed() {
    let (v, c) = d_table();
    let run = |seed| cluster_bootstrap_ci(&v, &c, pooled_mean, 500, seed, 0.9).unwrap();
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));
    let (a, b) = passes();
    let jb = |seed| jaccard_bootstrap_ci(&a, &b, 0.5, |k| k.0, 300, seed, 0.9).unwrap();
    assert_eq!(jb(7), jb(7));
}

#[test]
fn bootstrap_drops_non_finite_replicates_and_reports_none_if_all_are() {
    // Problem 2 has no critical key: replicates drawing only problem 2 have an empty union.
    let a = [((1u64, 0u64), 0.5), ((2, 0), 0.0)];
    let b = [((1u64, 0u64), 0.5), ((2, 0), 0.25)];
    let ci = jaccard_bootstrap_ci(&a, &b, 0.5, |k| k.0, 400, 3, 0.95)
        .unwrap()
        .unwrap();
    // P(both draws hit problem 2) = 1/4.
    assert!(ci.valid_reps < 400 && ci.valid_reps > 250, "{ci:?}");
    assert_eq!((ci.lo, ci.hi), (1.0, 1.0));
    let none = jaccard_bootstrap_ci(&b, &b, 0.75, |k| k.0, 50, 3, 0.95).unwrap();
    assert_eq!(none, None);
}

#[test]
fn wilson_matches_statsmodels() {
    for w in fixture()["wilson"].as_array().unwrap() {
        let (s, n, level) = (
            w["successes"].as_u64().unwrap(),
            w["n"].as_u64().unwrap(),
            num(&w["level"]),
        );
        let (lo, hi) = wilson(s, n, level).unwrap().unwrap();
        assert!((lo - num(&w["lo"])).abs() < 1e-12, "{w}: lo {lo}");
        assert!((hi - num(&w["hi"])).abs() < 1e-12, "{w}: hi {hi}");
    }
    assert_eq!(wilson(0, 0, 0.95).unwrap(), None);
}

#[test]
fn wilson_exact_coverage_is_near_nominal() {
    // Exact binomial coverage (no simulation) over p = 0.05, 0.10, …, 0.95 at n = 40.
    let n = 40;
    let cis: Vec<(f64, f64)> = (0..=n)
        .map(|k| wilson(k, n, 0.95).unwrap().unwrap())
        .collect();
    let cov: Vec<f64> = (1..20)
        .map(|i| {
            let p = f64::from(i) * 0.05;
            let bin = Binomial::new(p, n).unwrap();
            (0..=n)
                .filter(|&k| cis[k as usize].0 <= p && p <= cis[k as usize].1)
                .map(|k| bin.pmf(k))
                .sum()
        })
        .collect();
    let mean = cov.iter().sum::<f64>() / cov.len() as f64;
    let min = cov.iter().copied().fold(1.0, f64::min);
    assert!(
        (0.94..0.96).contains(&mean) && min > 0.90,
        "mean {mean}, min {min}"
    );
}

fn normal(rng: &mut SplitMix64) -> f64 {
    let (u1, u2) = (1.0 - rng.next_f64(), rng.next_f64());
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

#[test]
fn clustered_intervals_cover_the_true_mean_near_nominal_rate() {
    // 400 simulated campaigns: G = 20 problems of 1–8 estimates, value = 0.3 + u_g + e_j
    // with u_g, e_j ~ N(0, 1); both estimands equal 0.3. Deterministic (seeded).
    let (mu, sims, g) = (0.3, 400_u32, 20);
    let mut rng = SplitMix64::new(2024);
    let (mut cmt, mut cr1, mut boot) = (0, 0, 0);
    for s in 0..sims {
        let (mut v, mut c) = (Vec::new(), Vec::new());
        for p in 0..g {
            let u = normal(&mut rng);
            for _ in 0..1 + rng.below(8) {
                v.push(mu + u + normal(&mut rng));
                c.push(p as u64);
            }
        }
        let hit = |ci: (f64, f64)| usize::from(ci.0 <= mu && mu <= ci.1);
        cmt += hit(cluster_mean_t(&v, &c)
            .unwrap()
            .confidence_interval(0.95)
            .unwrap()
            .unwrap());
        cr1 += hit(cr1_t(&v, &c)
            .unwrap()
            .confidence_interval(0.95)
            .unwrap()
            .unwrap());
        let b =
            cluster_bootstrap_ci(&v, &c, mean_of_cluster_means, 199, u64::from(s), 0.95).unwrap();
        boot += hit(b.map(|b| (b.lo, b.hi)).unwrap());
    }
    let rate = |k: usize| k as f64 / f64::from(sims);
    let (cmt, cr1, boot) = (rate(cmt), rate(cr1), rate(boot));
    // Binomial sd of a rate near 0.95 over 400 runs is ~0.011; percentile bootstrap and CR1
    // are known to under-cover slightly with G = 20.
    assert!(
        (0.92..=0.98).contains(&cmt),
        "cluster-mean t coverage {cmt}"
    );
    assert!((0.89..=0.98).contains(&cr1), "CR1 coverage {cr1}");
    assert!((0.87..=0.98).contains(&boot), "bootstrap coverage {boot}");
}

/// The three keys with K = 2, one problem each. Refeed set (exact or refeed
/// informative) = all three, disagreeing on the first two; replica set = the third only,
/// disagreeing. Rate difference 2/3 − 1 = −1/3, but `D = [1, 1, −1]` has mean +1/3.
fn three_keys() -> (Vec<Option<bool>>, Vec<Option<bool>>, Vec<u64>) {
    (
        vec![Some(true), Some(true), Some(false)],
        vec![None, None, Some(true)],
        vec![0, 1, 2],
    )
}

#[test]
fn rate_difference_t_tests_the_difference_not_the_paired_mean() {
    let (a, b, c) = three_keys();
    close(rate_difference(&a, &b).unwrap(), -1.0 / 3.0, 1e-15);
    // z = [(1 − 2/3)/3, (1 − 2/3)/3, (0 − 2/3)/3 − (1 − 1)/1] = [1/9, 1/9, −2/9];
    // V = 3/2 · 6/81 = 1/9, se = 1/3, t = −1, df = 2.
    let t = rate_difference_t(&a, &b, &c).unwrap();
    close(t.estimate, -1.0 / 3.0, 1e-15);
    close(t.se.unwrap(), 1.0 / 3.0, 1e-15);
    close(t.t.unwrap(), -1.0, 1e-14);
    assert_eq!((t.df, t.n_clusters, t.n_obs), (2, 3, 3));
    // Student t with 2 df: P(|T| ≥ 1) = 1 − 1/√3.
    close(t.p_value.unwrap(), 1.0 - 1.0 / 3f64.sqrt(), 1e-12);
    // The paired mean over the union has the opposite sign.
    let d = [1.0, 1.0, -1.0];
    let paired = cr1_t(&d, &c).unwrap();
    assert!(
        paired.estimate > 0.0 && paired.t.unwrap() > 0.0,
        "{paired:?}"
    );
}

#[test]
fn rate_difference_t_on_one_common_set_is_cr1_of_the_contrast() {
    // Two flags per row of the D table's clusters; both rates over every row.
    let (_, c) = d_table();
    let fa = [1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0, 1, 1, 1, 0, 1];
    let fb = [1, 0, 0, 0, 1, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0, 1];
    let a: Vec<Option<bool>> = fa.iter().map(|&x| Some(x == 1)).collect();
    let b: Vec<Option<bool>> = fb.iter().map(|&x| Some(x == 1)).collect();
    let d: Vec<f64> = fa
        .iter()
        .zip(&fb)
        .map(|(&x, &y)| f64::from(x - y))
        .collect();
    let (rd, cr) = (
        rate_difference_t(&a, &b, &c).unwrap(),
        cr1_t(&d, &c).unwrap(),
    );
    close(rd.estimate, cr.estimate, 1e-15);
    close(rd.se.unwrap(), cr.se.unwrap(), 1e-13);
    close(rd.t.unwrap(), cr.t.unwrap(), 1e-12);
    assert_eq!(rd.df, cr.df);
    // ... and the bootstrap draws the same problems as the pooled-mean bootstrap of D.
    let rb = rate_difference_bootstrap(&a, &b, &c, 400, 11, 0.9)
        .unwrap()
        .unwrap();
    let pb = cluster_bootstrap_ci(&d, &c, pooled_mean, 400, 11, 0.9)
        .unwrap()
        .unwrap();
    close(rb.ci.lo, pb.lo, 1e-12);
    close(rb.ci.hi, pb.hi, 1e-12);
    assert_eq!(rb.ci.valid_reps, 400);
}

#[test]
fn rate_difference_bootstrap_recomputes_both_sets_per_replicate() {
    let (a, b, c) = three_keys();
    let got = rate_difference_bootstrap(&a, &b, &c, 1000, 5, 0.95)
        .unwrap()
        .unwrap();
    // Replay with the values API: code each row, recompute both subsets from the codes.
    let code = |x: Option<bool>| x.map_or(0.0, |h| 1.0 + f64::from(u8::from(h)));
    let codes: Vec<f64> = a
        .iter()
        .zip(&b)
        .map(|(&x, &y)| code(x) + 3.0 * code(y))
        .collect();
    let stat = |v: &[f64], _: &[u64]| {
        let (mut ha, mut na, mut hb, mut nb) = (0.0, 0.0, 0.0, 0.0);
        for &x in v {
            let (ca, cb) = (x % 3.0, (x / 3.0).floor());
            na += f64::from(u8::from(ca > 0.0));
            ha += f64::from(u8::from(ca == 2.0));
            nb += f64::from(u8::from(cb > 0.0));
            hb += f64::from(u8::from(cb == 2.0));
        }
        ha / na - hb / nb
    };
    let r = cluster_bootstrap_replicates(&codes, &c, stat, 1000, 5).unwrap();
    let want = cluster_bootstrap_ci(&codes, &c, stat, 1000, 5, 0.95)
        .unwrap()
        .unwrap();
    assert_eq!(got.ci, want);
    assert_eq!(got.p_value, percentile_p_value(&r).unwrap());
    // Draws without the third problem have an empty replica set: P = (2/3)³ = 8/27.
    let dropped = 1000 - got.ci.valid_reps;
    assert!((230..370).contains(&dropped), "{dropped}");
    assert!(got.ci.lo < 0.0 && got.ci.hi <= 0.0, "{:?}", got.ci);
}

#[test]
fn rate_difference_without_spread_has_zero_se_and_errors_on_empty_sets() {
    // Every problem at the same rates: each z_g is exactly 0.
    let a = [Some(true), Some(false), Some(true), Some(false)];
    let b = [Some(false), None, Some(false), None];
    let t = rate_difference_t(&a, &b, &[1, 1, 2, 2]).unwrap();
    assert_eq!(
        (t.estimate, t.se, t.t, t.p_value),
        (0.5, Some(0.0), None, None)
    );
    let one = rate_difference_t(&a, &b, &[1, 1, 1, 1]).unwrap();
    assert_eq!((one.se, one.t), (None, None));
    let none = [None, None, None, None];
    for e in [
        rate_difference_t(&a, &none, &[1, 1, 2, 2]).unwrap_err(),
        rate_difference_t(&a, &b, &[1, 2]).unwrap_err(),
        rate_difference_bootstrap(&none, &b, &[1, 1, 2, 2], 10, 1, 0.9).unwrap_err(),
    ] {
        assert!(matches!(e, Error::Spec(_)), "{e}");
    }
    assert_eq!(rate_difference(&a, &none), None);
}

#[test]
fn percentile_p_value_counts_both_tails_with_ties() {
    assert_eq!(percentile_p_value(&[1.0, 2.0, 3.0, -1.0]), Some(0.5));
    assert_eq!(percentile_p_value(&[-1.0, 0.0, 1.0, 2.0]), Some(1.0));
    assert_eq!(percentile_p_value(&[1.0, 2.0, f64::NAN]), Some(0.0));
    assert_eq!(percentile_p_value(&[f64::NAN]), None);
}

/// Cluster means `means` (two rows per problem, `mean ± spread`), problems 0..G.
fn spread_clusters(means: &[f64], spread: f64) -> (Vec<f64>, Vec<u64>) {
    let mut v = Vec::new();
    let mut c = Vec::new();
    for (g, &m) in means.iter().enumerate() {
        v.extend([m - spread, m + spread]);
        c.extend([g as u64, g as u64]);
    }
    (v, c)
}

#[test]
fn tost_shows_equivalence_only_when_the_interval_lies_inside_the_margin() {
    // Twenty problems, cluster means ±0.01 around 0: se ≈ 0.0023, the t test cannot reject
    // μ = 0 and TOST at m = 0.05 shows equivalence.
    let means: Vec<f64> = (0..20)
        .map(|g| if g % 2 == 0 { 0.01 } else { -0.01 })
        .collect();
    let (v, c) = spread_clusters(&means, 0.3);
    let t = cluster_mean_t(&v, &c).unwrap();
    assert!(t.p_value.unwrap() > 0.05, "{t:?}");
    let e = tost(&t, 0.05).unwrap().unwrap();
    assert!(e.equivalent(0.05), "{e:?}");
    // By hand: both sides have p = P(T_19 ≥ 0.05/se).
    let want = students_t(19).sf(0.05 / t.se.unwrap());
    close(e.p_lower, want, 1e-12);
    close(e.p_upper, want, 1e-12);
    // Negative control: the same mean 0 with cluster means ±0.2 (se ≈ 0.046). The t test
    // still does not reject, and TOST must not call it equivalent either.
    let wide: Vec<f64> = means.iter().map(|m| m * 20.0).collect();
    let (v, c) = spread_clusters(&wide, 0.3);
    let t = cluster_mean_t(&v, &c).unwrap();
    assert!(t.p_value.unwrap() > 0.05, "{t:?}");
    let e = tost(&t, 0.05).unwrap().unwrap();
    assert!(!e.equivalent(0.05), "{e:?}");
    assert!(e.p_value > 0.1, "{e:?}");
    // An estimate outside the margin is never equivalent, however tight.
    let shifted: Vec<f64> = means.iter().map(|m| m + 0.06).collect();
    let (v, c) = spread_clusters(&shifted, 0.3);
    let t = cluster_mean_t(&v, &c).unwrap();
    assert!(!tost(&t, 0.05).unwrap().unwrap().equivalent(0.05));
    assert!(tost(&t, 0.1).unwrap().unwrap().equivalent(0.05));
}

#[test]
fn tost_degenerate_and_invalid_inputs() {
    // Zero spread: decided by the point estimate alone.
    let zero = TTest::new(0.01, Some(0.0), 5, 10);
    let e = tost(&zero, 0.05).unwrap().unwrap();
    assert_eq!((e.p_lower, e.p_upper, e.p_value), (0.0, 0.0, 0.0));
    let edge = TTest::new(0.05, Some(0.0), 5, 10);
    assert_eq!(tost(&edge, 0.05).unwrap().unwrap().p_value, 1.0);
    // One problem: no test.
    assert_eq!(tost(&TTest::new(0.0, None, 1, 3), 0.05).unwrap(), None);
    for m in [0.0, -0.1, f64::NAN, f64::INFINITY] {
        assert!(matches!(tost(&zero, m), Err(Error::Spec(_))), "{m}");
    }
}

#[test]
fn holm_adjusts_step_down_in_input_order() {
    // Sorted 0.005, 0.01, 0.03, 0.04 → ×4, ×3, ×2, ×1 = 0.02, 0.03, 0.06, 0.04 → running max.
    let p = [Some(0.01), Some(0.04), Some(0.03), Some(0.005)];
    let adj: Vec<f64> = holm(&p).unwrap().into_iter().map(Option::unwrap).collect();
    for (got, want) in adj.iter().zip([0.03, 0.06, 0.06, 0.02]) {
        close(*got, want, 1e-12);
    }
    // At α = 0.05 every raw p rejects, Holm keeps only two.
    assert!(p.iter().all(|p| p.unwrap() < 0.05));
    let rejected: Vec<bool> = adj.iter().map(|&a| a < 0.05).collect();
    assert_eq!(rejected, [true, false, false, true]);
    // A single test is not adjusted; absent tests do not count; the cap is 1.
    assert_eq!(holm(&[Some(0.04)]).unwrap(), [Some(0.04)]);
    let with_none = holm(&[None, Some(0.02), Some(0.6), None]).unwrap();
    assert_eq!(with_none, [None, Some(0.04), Some(0.6), None]);
    assert_eq!(
        holm(&[Some(0.9), Some(0.8)]).unwrap(),
        [Some(1.0), Some(1.0)]
    );
    assert!(matches!(holm(&[Some(1.5)]), Err(Error::Spec(_))));
    assert_eq!(holm(&[]).unwrap(), Vec::<Option<f64>>::new());
}

/// `n_true` problems whose `rows` members are all crossings, `n_false` whose members all are
/// not, and one problem with only non-members.
fn clustered_share(n_true: usize, n_false: usize, rows: usize) -> (Vec<Option<bool>>, Vec<u64>) {
    let mut s = Vec::new();
    let mut c = Vec::new();
    for g in 0..n_true + n_false {
        s.extend(std::iter::repeat_n(Some(g < n_true), rows));
        c.extend(std::iter::repeat_n(g as u64, rows));
    }
    s.extend([None, None]);
    c.extend([999, 999]);
    (s, c)
}

#[test]
fn share_bootstrap_respects_clustering_where_wilson_does_not() {
    // 7 of 10 problems all crossings, 3 none, 20 members each: share 0.7 of 200. Wilson
    // treats the 200 as independent and excludes 1/2; resampling the ten problems must not.
    let (s, c) = clustered_share(7, 3, 20);
    let (lo, _) = wilson(140, 200, 0.95).unwrap().unwrap();
    assert!(lo > 0.5, "Wilson lower bound {lo}");
    let b = share_bootstrap(&s, &c, 0.5, 2000, 7, 0.95)
        .unwrap()
        .unwrap();
    close(b.estimate, 0.7, 1e-15);
    assert!(b.ci.lo <= 0.5 && b.ci.hi > 0.7, "{b:?}");
    assert!(b.p_value > 0.05, "{b:?}");
    // Must reject: 19 of 20 problems all crossings.
    let (s, c) = clustered_share(19, 1, 5);
    let b = share_bootstrap(&s, &c, 0.5, 2000, 7, 0.95)
        .unwrap()
        .unwrap();
    close(b.estimate, 0.95, 1e-15);
    assert!(b.ci.lo > 0.5 && b.p_value < 0.05, "{b:?}");
    // Deterministic per seed; an empty subset has no share; a bad null is an error.
    assert_eq!(
        share_bootstrap(&s, &c, 0.5, 200, 3, 0.9).unwrap(),
        share_bootstrap(&s, &c, 0.5, 200, 3, 0.9).unwrap()
    );
    assert_eq!(
        share_bootstrap(&[None, None], &[1, 2], 0.5, 10, 1, 0.9).unwrap(),
        None
    );
    assert!(share_bootstrap(&s, &c, 1.5, 10, 1, 0.9).is_err());
    assert!(share_bootstrap(&s, &c[1..], 0.5, 10, 1, 0.9).is_err());
}

type Keyed = Vec<((u64, u64), f64)>;

/// Twenty problems, four keys each, with Â = 1 (critical at τ = 1/2) on the keys `crit`
/// picks, else 0.
fn keyed(crit: impl Fn(u64, u64) -> bool) -> Keyed {
    (0..20u64)
        .flat_map(|g| (0..4u64).map(move |i| (g, i)))
        .map(|(g, i)| ((g, i), f64::from(u8::from(crit(g, i)))))
        .collect()
}

#[test]
fn jaccard_gap_is_paired_and_rejects_only_a_real_gap() {
    let exact = keyed(|_, i| i < 2);
    let replica = exact.clone();
    // The treatment loses one of the two critical keys in every problem: J = 1/2, gap 1/2.
    let lossy = keyed(|_, i| i == 0);
    let g = jaccard_gap_bootstrap([&exact, &replica, &lossy], 0.5, |k| k.0, 1000, 5, 0.95)
        .unwrap()
        .unwrap();
    close(g.estimate.unwrap(), 0.5, 1e-15);
    // Every problem contributes the same gap, so every replicate is exactly 1/2.
    assert!(g.ci.lo > 0.0 && g.p_value < 0.05, "{g:?}");
    let direct = jaccard(&exact, &replica, 0.5).unwrap().value.unwrap()
        - jaccard(&exact, &lossy, 0.5).unwrap().value.unwrap();
    close(g.estimate.unwrap(), direct, 1e-15);
    // Must not reject: the treatment differs in one key of one problem only.
    let near = keyed(|g, i| i < 2 && !(g == 7 && i == 1));
    let g = jaccard_gap_bootstrap([&exact, &replica, &near], 0.5, |k| k.0, 1000, 5, 0.95)
        .unwrap()
        .unwrap();
    assert!(g.estimate.unwrap() > 0.0);
    assert!(g.ci.lo <= 0.0 && g.p_value > 0.05, "{g:?}");
    // Paired: the replica is as noisy as the treatment (the same keys lost): gap exactly 0
    // in every replicate, although each Jaccard on its own varies across replicates.
    let noisy = keyed(|g, i| i < 2 && !(g % 3 == 0 && i == 1));
    let g = jaccard_gap_bootstrap([&exact, &noisy, &noisy], 0.5, |k| k.0, 500, 5, 0.95)
        .unwrap()
        .unwrap();
    assert_eq!(
        (g.estimate, g.ci.lo, g.ci.hi, g.p_value),
        (Some(0.0), 0.0, 0.0, 1.0)
    );
    let marginal = jaccard_bootstrap_ci(&exact, &noisy, 0.5, |k| k.0, 500, 5, 0.95)
        .unwrap()
        .unwrap();
    assert!(marginal.hi > marginal.lo, "{marginal:?}");
    // No critical key anywhere: no gap.
    let none = keyed(|_, _| false);
    assert_eq!(
        jaccard_gap_bootstrap([&none, &none, &none], 0.5, |k| k.0, 50, 5, 0.95).unwrap(),
        None
    );
}

#[test]
fn mcnemar_exact_is_the_two_sided_binomial_tail_of_the_discordant_pairs() {
    assert_eq!(mcnemar_exact(0, 0), 1.0);
    // 2 · 0.5^6 = 0.03125: six discordant pairs all one way is the first to reach p < 0.05.
    assert!((mcnemar_exact(6, 0) - 0.03125).abs() < 1e-12);
    assert!((mcnemar_exact(5, 0) - 0.0625).abs() < 1e-12);
    assert_eq!(mcnemar_exact(3, 7), mcnemar_exact(7, 3));
    // Balanced discordance is no evidence: p is capped at 1.
    assert_eq!(mcnemar_exact(4, 4), 1.0);
}
