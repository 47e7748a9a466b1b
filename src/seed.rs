//! The seed papers' numbers that reports set beside ours: `data/seed/claims.toml`, embedded in
//! the binary and parsed once into [`SeedClaims`].
use serde::Deserialize;
use std::sync::LazyLock;

/// The claims file as shipped.
pub const CLAIMS_TOML: &str = include_str!("../data/seed/claims.toml");

/// Every report's seed numbers.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SeedClaims {
    /// The credit study's.
    pub credit: CreditClaims,
    /// The divergence study's.
    pub divergence: DivergenceClaims,
    /// SpectrumKV's.
    pub spectrum: SpectrumClaims,
}

/// The credit seed's ranges over its six stock configurations.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreditClaims {
    /// Excess over the replica floor, any-informative, percentage points.
    pub excess_pp: (f64, f64),
    /// Excess, treatment-independent conditioning, percentage points.
    pub excess_ti_pp: (f64, f64),
    /// Problem-clustered t.
    pub clustered_t: (f64, f64),
    /// Jaccard(exact, refeed) of the critical sets.
    pub jaccard: (f64, f64),
    /// Jaccard(exact, replica), the replica ceiling.
    pub ceiling: (f64, f64),
    /// Replica floor, fraction of eligible estimates.
    pub floor: (f64, f64),
}

/// The divergence seed's numbers.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DivergenceClaims {
    /// fp16 divergence rate under every strategy, percent.
    pub fp16_divergence_pct: f64,
    /// Conditions where cache-ON was more accurate, of all conditions.
    pub on_better: (u64, u64),
    /// fp32 teacher-forced flip rate, percent.
    pub fp32_flip_pct: f64,
    /// Orders of magnitude by which fp32 reduces divergence.
    pub fp32_orders: u32,
}

/// SpectrumKV's seed numbers.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpectrumClaims {
    /// PPL change (percent) at budget 0.5, tiered (KIVI), one per seed model.
    pub ppl_delta_pct_tiered: Vec<f64>,
    /// The same for PDTrim.
    pub ppl_delta_pct_pdtrim: Vec<f64>,
    /// NIAH accuracy (percent) at budget 0.3 on Qwen: (tiered, PDTrim).
    pub niah_pct: (f64, f64),
    /// TTFT cut (percent) at budget 0.5: (low, high).
    pub ttft_cut_pct: (f64, f64),
}

impl SpectrumClaims {
    /// The PPL row's seed numbers: `tiered +1.97 / −0.06 / −0.44 vs PDTrim +25.85 / ...`.
    pub fn ppl_text(&self) -> String {
        let list = |xs: &[f64]| {
            xs.iter()
                .map(|&x| {
                    if x < 0.0 {
                        format!("−{:.2}", -x)
                    } else {
                        format!("+{x:.2}")
                    }
                })
                .collect::<Vec<_>>()
                .join(" / ")
        };
        format!(
            "tiered {} vs PDTrim {}",
            list(&self.ppl_delta_pct_tiered),
            list(&self.ppl_delta_pct_pdtrim)
        )
    }
}

/// The shipped claims, parsed on first use (the file is checked by this module's tests).
pub fn claims() -> &'static SeedClaims {
    static CLAIMS: LazyLock<SeedClaims> = LazyLock::new(|| {
        toml::from_str(CLAIMS_TOML).expect("data/seed/claims.toml parses (tested)")
    });
    &CLAIMS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_claims_parse_with_the_abstracts_numbers() {
        let c = claims();
        assert_eq!(c.credit.excess_pp, (14.0, 28.0));
        assert_eq!(c.credit.floor, (0.09, 0.23));
        assert_eq!(c.divergence.on_better, (8, 9));
        assert_eq!(c.spectrum.niah_pct, (52.6, 26.3));
        assert_eq!(
            c.spectrum.ppl_text(),
            "tiered +1.97 / −0.06 / −0.44 vs PDTrim +25.85 / +22.07 / +35.63"
        );
    }

    #[test]
    fn a_misspelled_or_missing_claim_is_rejected() {
        let typo = CLAIMS_TOML.replace("excess_pp =", "excess_ppp =");
        assert!(toml::from_str::<SeedClaims>(&typo).is_err());
        let missing = CLAIMS_TOML.replace("floor = [0.09, 0.23]", "");
        assert!(toml::from_str::<SeedClaims>(&missing).is_err());
    }
}
