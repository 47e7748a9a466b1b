//! Tier plans under a byte budget `b` = frame bytes ÷ full-FP16 KV bytes, where the frame
//! counts everything on the wire (header, index lists, payload, scales, zeros, fingerprint).
//!
//! - [`Policy::Spectrum`]: sinks and the recent window pinned to FP16; every other token starts
//!   at the lowest allowed tier (INT4, or INT8 when INT4 is not allowed); the most important
//!   are promoted INT4→INT8, then INT8→FP16, while the frame fits; when even the lowest tier
//!   does not fit, the least important are dropped until it does.
//! - [`Policy::SpectrumPosition`]: the same tiers with recency in place of importance (later
//!   tokens rank higher), so the difference to `spectrum` is what the importance scores add.
//! - [`Policy::SnapKv`]: binary keep/drop at FP16 with importance — the most important
//!   unprotected tokens kept, as many as fit, the rest dropped. Against `spectrum` it isolates
//!   precision tiering, importance held fixed; against `pdtrim` it isolates importance.
//! - [`Policy::PdTrim`]: binary keep/drop at FP16 — the sinks and the most recent tokens, as
//!   many as fit. [`Policy::PdTrimFirst`] keeps the first `⌊b·n·f⌋` and the most recent.
//! - [`Policy::Uniform`]: every unprotected token at one tier, whatever it costs.
use super::tiers::TierPlan;
use super::wire::{fp16_bytes, frame_len};
use super::{Quantizer, Tier};
use crate::kv_cache::KvShape;
use crate::{Error, Result};

/// Tokens pinned to FP16 by every policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Protect {
    /// Attention sinks: the first tokens.
    pub sinks: usize,
    /// The most recent tokens (KIVI's residual).
    pub recent: usize,
}

impl Default for Protect {
    fn default() -> Self {
        Protect {
            sinks: 4,
            recent: 32,
        }
    }
}

/// A tier-allocation policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Policy {
    /// Greedy importance-driven tiers under the budget; `int4` allows the INT4 tier.
    Spectrum {
        /// Whether INT4 may be used (the probe's verdict).
        int4: bool,
    },
    /// [`Policy::Spectrum`]'s tiers ranked by position (most recent first), not importance.
    SpectrumPosition,
    /// The most important unprotected tokens at FP16, the rest dropped, at the budget.
    SnapKv,
    /// Sinks + most recent at FP16, the rest dropped, at the budget.
    PdTrim,
    /// The first `⌊b·n·first⌋` + most recent at FP16, the rest dropped, at the budget.
    PdTrimFirst {
        /// Fraction `f` of the budget's tokens taken from the start.
        first: f64,
    },
    /// Unprotected tokens all at one stored tier (the budget is not used).
    Uniform(Tier),
}

impl Policy {
    /// Parse `spectrum`, `spectrum-2tier`, `spectrum-position`, `snapkv`, `pdtrim`,
    /// `pdtrim-first`, `uniform-int8`, `uniform-int4`, `uniform-fp16`.
    pub fn parse(s: &str) -> Result<Policy> {
        Ok(match s {
            "spectrum" => Policy::Spectrum { int4: true },
            "spectrum-2tier" => Policy::Spectrum { int4: false },
            "spectrum-position" => Policy::SpectrumPosition,
            "snapkv" => Policy::SnapKv,
            "pdtrim" => Policy::PdTrim,
            "pdtrim-first" => Policy::PdTrimFirst { first: 0.5 },
            "uniform-fp16" => Policy::Uniform(Tier::Fp16),
            "uniform-int8" => Policy::Uniform(Tier::Int8),
            "uniform-int4" => Policy::Uniform(Tier::Int4),
            _ => {
                return Err(Error::Spectrum(format!(
                    "unknown policy `{s}` (spectrum, spectrum-2tier, spectrum-position, snapkv, \
                     pdtrim, pdtrim-first, uniform-fp16, uniform-int8, uniform-int4)"
                )));
            }
        })
    }

    /// The name [`Self::parse`] reads.
    pub fn name(&self) -> &'static str {
        match self {
            Policy::Spectrum { int4: true } => "spectrum",
            Policy::Spectrum { int4: false } => "spectrum-2tier",
            Policy::SpectrumPosition => "spectrum-position",
            Policy::SnapKv => "snapkv",
            Policy::PdTrim => "pdtrim",
            Policy::PdTrimFirst { .. } => "pdtrim-first",
            Policy::Uniform(Tier::Fp16) => "uniform-fp16",
            Policy::Uniform(Tier::Int8) => "uniform-int8",
            Policy::Uniform(_) => "uniform-int4",
        }
    }

    /// Whether the policy reads the budget.
    pub fn uses_budget(&self) -> bool {
        !matches!(self, Policy::Uniform(_))
    }

    /// Whether the plan depends on the importance scores.
    pub fn uses_importance(&self) -> bool {
        matches!(self, Policy::Spectrum { .. } | Policy::SnapKv)
    }
}

/// What an allocation needs besides the policy.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    /// Nominal budget `b` (0 < b ≤ 1 or more).
    pub b: f64,
    /// Shape of the cache.
    pub shape: KvShape,
    /// Quantizer of the INT tiers (its scales count).
    pub quantizer: Quantizer,
    /// Pinned tokens.
    pub protect: Protect,
}

impl Budget {
    /// Frame bytes of `plan`.
    pub fn bytes(&self, plan: &TierPlan) -> usize {
        frame_len(self.shape, plan.len() as i64, plan.counts(), self.quantizer)
    }

    /// The real budget of `plan`: frame bytes ÷ full-FP16 bytes.
    pub fn real_b(&self, plan: &TierPlan) -> f64 {
        self.bytes(plan) as f64 / fp16_bytes(self.shape, plan.len() as i64) as f64
    }
}

/// The tier plan of `policy` for `scores.len()` tokens (scores: higher = more important).
pub fn allocate(policy: Policy, scores: &[f64], budget: &Budget) -> Result<TierPlan> {
    let n = scores.len();
    if !(budget.b > 0.0 && budget.b.is_finite()) {
        return Err(Error::Spectrum(format!(
            "budget {} is not positive",
            budget.b
        )));
    }
    let limit = (budget.b * fp16_bytes(budget.shape, n as i64) as f64).floor() as usize;
    let cost = |counts: [usize; 3]| frame_len(budget.shape, n as i64, counts, budget.quantizer);
    let Protect { sinks, recent } = budget.protect;
    let protected = |i: usize| i < sinks || i + recent >= n;
    let n_protected = (0..n).filter(|&i| protected(i)).count();
    let mut tiers = vec![Tier::Drop; n];
    for (i, t) in tiers.iter_mut().enumerate() {
        if protected(i) {
            *t = Tier::Fp16;
        }
    }
    // Unprotected tokens, most important first (ties: later position first); by position
    // alone for the policies that ignore importance.
    let mut order: Vec<usize> = (0..n).filter(|&i| !protected(i)).collect();
    if policy.uses_importance() {
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(b.cmp(&a)));
    } else {
        order.reverse();
    }
    let floor_cost = cost([n_protected, 0, 0]);
    let too_small = || {
        Error::Spectrum(format!(
            "budget b = {} ({limit} bytes) is below the {floor_cost} bytes of the {n_protected} \
             protected tokens at FP16",
            budget.b
        ))
    };
    match policy {
        Policy::Uniform(tier) => {
            for &i in &order {
                tiers[i] = tier;
            }
        }
        Policy::Spectrum { .. } | Policy::SpectrumPosition => {
            if floor_cost > limit {
                return Err(too_small());
            }
            let int4 = !matches!(policy, Policy::Spectrum { int4: false });
            let low = if int4 { Tier::Int4 } else { Tier::Int8 };
            let slot = |t: Tier| Tier::STORED.iter().position(|&s| s == t).expect("stored");
            let mut counts = [n_protected, 0, 0];
            // As many as fit at the lowest tier, most important first; the rest stay dropped.
            for &i in &order {
                let mut c = counts;
                c[slot(low)] += 1;
                if cost(c) > limit {
                    break;
                }
                counts = c;
                tiers[i] = low;
            }
            let steps: &[(Tier, Tier)] = if int4 {
                &[(Tier::Int4, Tier::Int8), (Tier::Int8, Tier::Fp16)]
            } else {
                &[(Tier::Int8, Tier::Fp16)]
            };
            for &(from, to) in steps {
                for &i in &order {
                    if tiers[i] != from {
                        continue;
                    }
                    let mut c = counts;
                    c[slot(from)] -= 1;
                    c[slot(to)] += 1;
                    if cost(c) > limit {
                        break;
                    }
                    counts = c;
                    tiers[i] = to;
                }
            }
        }
        Policy::SnapKv => {
            if floor_cost > limit {
                return Err(too_small());
            }
            for &i in order.iter().take(fp16_fit(n, n_protected, limit, cost)) {
                tiers[i] = Tier::Fp16;
            }
        }
        Policy::PdTrim | Policy::PdTrimFirst { .. } => {
            if floor_cost > limit {
                return Err(too_small());
            }
            let extra = fp16_fit(n, n_protected, limit, cost);
            let first = match policy {
                Policy::PdTrimFirst { first } => {
                    ((budget.b * n as f64 * first).floor() as usize).min(extra)
                }
                _ => 0,
            };
            let unprotected: Vec<usize> = (0..n).filter(|&i| !protected(i)).collect();
            for &i in unprotected.iter().take(first) {
                tiers[i] = Tier::Fp16;
            }
            for &i in unprotected.iter().rev().take(extra - first) {
                tiers[i] = Tier::Fp16;
            }
        }
    }
    Ok(TierPlan::new(tiers))
}

/// How many tokens beyond the `n_protected` fit at FP16 within `limit` bytes.
fn fp16_fit(
    n: usize,
    n_protected: usize,
    limit: usize,
    cost: impl Fn([usize; 3]) -> usize,
) -> usize {
    let mut extra = 0;
    while n_protected + extra < n && cost([n_protected + extra + 1, 0, 0]) <= limit {
        extra += 1;
    }
    extra
}
