//! The counterfactual credit estimator: `Â = mean_k R(orig) − mean_k R(alt)`.
use super::spec::Pass;

/// One estimate at a pivot for one alternative in one pass.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    /// Pass.
    pub pass: Pass,
    /// Index into the problem's pivots.
    pub pivot: usize,
    /// Alternative rank (1 = runner-up).
    pub alt_rank: usize,
    /// Correct continuations of the original branch.
    pub orig_successes: u32,
    /// Correct continuations of the alternative branch.
    pub alt_successes: u32,
    /// Continuations per branch.
    pub k: u32,
    /// `Â`, a multiple of `1/k` in `[−1, 1]`.
    pub value: f64,
    /// The pass's 2K outcomes are not all equal.
    pub informative: bool,
    /// Every continuation behind it started from K/V verified against the decode-time
    /// fingerprint (false until the campaign sets it from the engine's checks).
    pub snapshot_verified: bool,
}

/// Build the estimate from success counts. `value` is computed as an integer difference over
/// `k`, so equal counts give bitwise-equal estimates.
pub fn estimate(
    pass: Pass,
    pivot: usize,
    alt_rank: usize,
    orig: u32,
    alt: u32,
    k: u32,
) -> Estimate {
    let all_same = (orig == 0 || orig == k) && alt == orig;
    Estimate {
        pass,
        pivot,
        alt_rank,
        orig_successes: orig,
        alt_successes: alt,
        k,
        value: (orig as f64 - alt as f64) / k as f64,
        informative: !all_same,
        snapshot_verified: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimate_is_difference_of_success_rates() {
        let e = estimate(Pass::Exact, 0, 1, 3, 1, 4);
        assert_eq!(e.value, 0.5);
        assert!(e.informative);
    }

    #[test]
    fn all_equal_outcomes_are_uninformative() {
        assert!(!estimate(Pass::Refeed, 0, 1, 0, 0, 4).informative);
        assert!(!estimate(Pass::Refeed, 0, 1, 4, 4, 4).informative);
        // Equal rates but mixed outcomes carry information (Â = 0 is a measured value).
        assert!(estimate(Pass::Refeed, 0, 1, 2, 2, 4).informative);
    }
}
