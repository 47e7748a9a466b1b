//! Upper bounds on the counts and lengths a spec or flag may ask for, checked when the spec is
//! validated (before anything is allocated or written), so that a typo such as
//! `continuations.k = 1000000000` is a one-line error naming the setting instead of an
//! allocation failure or an integer overflow deep inside a run. The model-dependent limit
//! (positions) is checked once the model is loaded, by [`check_positions`].
use crate::model::Decoder;
use crate::{Error, Result};

/// Most continuations per branch (`continuations.k`).
pub const MAX_K: usize = 1 << 16;
/// Most alternatives per pivot (`pivots.alternatives`).
pub const MAX_ALTERNATIVES: usize = 1 << 10;
/// Most pivots per rollout (`pivots.max_per_rollout`).
pub const MAX_PIVOTS: usize = 1 << 12;
/// Most continuations one group of problems may queue:
/// `pool_problems × max_per_rollout × (1 + alternatives) × k`.
pub const MAX_GROUP_CONTINUATIONS: usize = 1 << 24;
/// Most tokens any sequence of a study may hold (prompt, context or generated): the wire
/// format's limit, far beyond any supported model's positions.
pub const MAX_TOKENS: usize = 1 << 24;
/// Most sequences in one batch (`batch_size`, `replica_batch_size`).
pub const MAX_BATCH: usize = 1 << 16;

/// Refuse `value` of `setting` above `max`.
pub fn at_most(setting: &str, value: usize, max: usize) -> Result<()> {
    if value > max {
        return Err(Error::Spec(format!(
            "{setting} = {value} exceeds the limit of {max}"
        )));
    }
    Ok(())
}

/// The product of `factors`, refused (naming `what`) above `max` or on overflow.
pub fn product_at_most(what: &str, factors: &[usize], max: usize) -> Result<usize> {
    let p = factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .filter(|&p| p <= max);
    p.ok_or_else(|| {
        let shown: Vec<String> = factors.iter().map(ToString::to_string).collect();
        Error::Spec(format!(
            "{what} = {} exceeds the limit of {max}",
            shown.join(" × ")
        ))
    })
}

/// The sum of `terms`, refused (naming `what`) above [`MAX_TOKENS`] or on overflow.
pub fn tokens_at_most(what: &str, terms: &[usize]) -> Result<usize> {
    let s = terms
        .iter()
        .try_fold(0usize, |acc, &t| acc.checked_add(t))
        .filter(|&s| s <= MAX_TOKENS);
    s.ok_or_else(|| {
        let shown: Vec<String> = terms.iter().map(ToString::to_string).collect();
        Error::Spec(format!(
            "{what} = {} exceeds the limit of {MAX_TOKENS} tokens",
            shown.join(" + ")
        ))
    })
}

/// Refuse `what`, which needs `positions` positions, when the model has fewer
/// (`max_position_embeddings` / GGUF `context_length`), whether or not the decoder enforces
/// its limit itself.
pub fn check_positions(model: &Decoder, positions: usize, what: &str) -> Result<()> {
    let limit = model.config().max_position_embeddings;
    if positions > limit {
        return Err(Error::ContextLimit(format!(
            "{what} needs {positions} positions but the model has {limit} (max_position_embeddings / context_length)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_name_the_setting_and_catch_overflow() {
        assert!(at_most("continuations.k", MAX_K, MAX_K).is_ok());
        let e = at_most("continuations.k", 1_000_000_000, MAX_K)
            .unwrap_err()
            .to_string();
        assert!(e.contains("continuations.k = 1000000000"), "{e}");
        assert_eq!(product_at_most("n", &[2, 3, 4], 24).unwrap(), 24);
        assert!(product_at_most("n", &[2, 3, 4], 23).is_err());
        assert!(product_at_most("n", &[usize::MAX, 2], usize::MAX).is_err());
        assert_eq!(tokens_at_most("t", &[1, 2]).unwrap(), 3);
        let e = tokens_at_most("[ppl] context + continuation", &[usize::MAX, 1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("[ppl] context + continuation"), "{e}");
    }
}
