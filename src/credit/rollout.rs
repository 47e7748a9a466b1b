//! Rollouts: generate from the prompt, keeping per step the token, its log-probability, the
//! top-2 margin, the runner-up tokens and — for pivot candidates — the fingerprint of the
//! decode-time KV state the token was sampled from.
//!
//! Special tokens that are not stop tokens (`<|im_start|>`, `<start_of_turn>`, `<pad>`, ...)
//! are never pivots nor alternatives: a step that sampled one is no candidate, and the
//! alternatives are the most probable tokens outside that set. Stop tokens may be
//! alternatives (ending the answer there is a real counterfactual); a branch that feeds one
//! ends at once (see `decode::engine`).
use super::spec::{PivotRule, PivotSpec};
use crate::Result;
use crate::decode::engine::{Stop, TextStop};
use crate::exec::ExecPolicy;
use crate::generate::check_finite;
use crate::kv_cache::{KvCache, Snapshot};
use crate::model::{Decoder, LogitsAt};
use crate::sampling::{self, NoiseKey, Sampling};
use tch::{Device, Kind, Tensor};

/// One generated token and what the model thought of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// The token.
    pub token: i64,
    /// Its log-probability (temperature 1).
    pub logprob: f64,
    /// `p(top1) − p(top2)` (temperature 1).
    pub margin: f64,
    /// The same margin under the rollout's sampling temperature `T` (softmax of logits / T),
    /// for pivot candidates of a sampled rollout; `None` for other steps and greedy rollouts.
    pub margin_at_temperature: Option<f64>,
    /// The most probable tokens other than `token` and the non-stop special tokens, best first.
    pub alternatives: Vec<i64>,
    /// Fingerprint of the KV state this token was sampled from (pivot candidates only).
    pub fingerprint: Option<[u8; 32]>,
}

/// A finished rollout with its cache (the snapshots of its pivots refer into it).
pub struct Rollout {
    /// Prompt token ids.
    pub prompt: Vec<i64>,
    /// Generated steps.
    pub steps: Vec<Step>,
    /// Why generation stopped.
    pub stop: Stop,
    /// The rollout's KV cache (one row).
    pub cache: KvCache,
}

impl Rollout {
    /// Generated token ids.
    pub fn tokens(&self) -> Vec<i64> {
        self.steps.iter().map(|s| s.token).collect()
    }

    /// The decode-time state from which step `t` was sampled.
    pub fn snapshot(&self, t: usize) -> Snapshot {
        Snapshot {
            row: 0,
            len: (self.prompt.len() + t) as i64,
        }
    }
}

/// Settings of one rollout.
pub struct RolloutParams<'a> {
    /// Token selection.
    pub sampling: Sampling,
    /// Token cap.
    pub max_new_tokens: usize,
    /// Noise key (its `step` is replaced per step).
    pub key: NoiseKey,
    /// End-of-sequence tokens.
    pub stop_tokens: &'a [i64],
    /// Special tokens; those not in `stop_tokens` are never candidates nor alternatives.
    pub special_tokens: &'a [i64],
    /// Text stop test, if any.
    pub text_stop: Option<TextStop<'a>>,
    /// Execution policy.
    pub policy: ExecPolicy,
    /// Steps with margin at most this are pivot candidates (fingerprinted at decode time).
    pub max_margin: f64,
    /// Alternatives to record per step.
    pub alternatives: usize,
}

/// The `n` most probable tokens of a `[1, V]` row other than `token` and the `excluded` ones,
/// best first (fewer when the vocabulary runs out).
pub fn alternatives(logits: &Tensor, token: i64, n: usize, excluded: &[i64]) -> Result<Vec<i64>> {
    let mut row = logits.f_to_kind(Kind::Float)?;
    if !excluded.is_empty() {
        let idx = Tensor::from_slice(excluded).to_device(row.device());
        row = row.f_index_fill(-1, &idx, f64::NEG_INFINITY)?;
    }
    let k = (n as i64 + 1).min(row.size().last().copied().unwrap_or(0));
    let (_, idx) = row.f_topk(k, -1, true, true)?;
    Ok(
        Vec::<i64>::try_from(idx.to_device(Device::Cpu).reshape([-1]))?
            .into_iter()
            .filter(|t| *t != token && !excluded.contains(t))
            .take(n)
            .collect(),
    )
}

/// `p(top1) − p(top2)` of `token`'s row under the sampling temperature (`None` when greedy);
/// at temperature 1 it is `margin` itself.
fn margin_at(logits: &Tensor, sampling: Sampling, token: i64, margin: f64) -> Result<Option<f64>> {
    Ok(match sampling {
        Sampling::Greedy => None,
        Sampling::Temperature { temperature: 1.0 } => Some(margin),
        // Under top-p, the margin of the tempered softmax before the nucleus cut.
        Sampling::Temperature { temperature } | Sampling::TopP { temperature, .. } => {
            let scaled = logits.f_to_kind(Kind::Float)? / temperature;
            Some(sampling::step_info(&scaled, &[token])?[0].margin)
        }
    })
}

/// Generate one rollout.
pub fn rollout(model: &Decoder, prompt: &[i64], p: &RolloutParams) -> Result<Rollout> {
    let mut cache = model.new_cache(1, (prompt.len() + p.max_new_tokens + 1) as i64)?;
    let ids = Tensor::from_slice(prompt).view([1, -1]);
    let mut logits = model
        .forward(&ids, &mut cache, &p.policy, &LogitsAt::Last)?
        .view([1, -1]);
    let excluded: Vec<i64> = p
        .special_tokens
        .iter()
        .copied()
        .filter(|t| !p.stop_tokens.contains(t))
        .collect();
    let mut steps: Vec<Step> = Vec::new();
    let stop = loop {
        check_finite(&logits, &format!("rollout step {}", steps.len()))?;
        let key = NoiseKey {
            step: steps.len() as u64,
            ..p.key
        };
        let token = sampling::select(&logits, p.sampling, &[key])?[0];
        let info = sampling::step_info(&logits, &[token])?[0];
        let alternatives = alternatives(&logits, token, p.alternatives, &excluded)?;
        let is_stop = p.stop_tokens.contains(&token);
        let candidate = info.margin <= p.max_margin && !is_stop && !excluded.contains(&token);
        let (fingerprint, margin_at_temperature) = if candidate {
            (
                Some(cache.fingerprint(cache.snapshot(0))?),
                margin_at(&logits, p.sampling, token, info.margin)?,
            )
        } else {
            (None, None)
        };
        steps.push(Step {
            token,
            logprob: info.logprob,
            margin: info.margin,
            margin_at_temperature,
            alternatives,
            fingerprint,
        });
        if is_stop {
            break Stop::Eos;
        }
        if steps.len() >= p.max_new_tokens {
            break Stop::Length;
        }
        if p.text_stop
            .is_some_and(|f| f(&steps.iter().map(|s| s.token).collect::<Vec<_>>()))
        {
            break Stop::Text;
        }
        let ids = Tensor::from_slice(&[token]).view([1, 1]);
        logits = model
            .forward(&ids, &mut cache, &p.policy, &LogitsAt::Last)?
            .view([1, -1]);
    };
    Ok(Rollout {
        prompt: prompt.to_vec(),
        steps,
        stop,
        cache,
    })
}

/// A chosen pivot: a low-margin step and its alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct Pivot {
    /// Index `t` of the step among generated tokens.
    pub pos: usize,
    /// The rollout's token at `t`.
    pub token: i64,
    /// Alternatives (rank 1 = runner-up).
    pub alternatives: Vec<i64>,
    /// Top-2 margin at `t`.
    pub margin: f64,
    /// Top-2 margin at `t` under the rollout's sampling temperature (`None` when greedy).
    pub margin_at_temperature: Option<f64>,
    /// Log-probability of the rollout's token.
    pub logprob: f64,
    /// Decode-time fingerprint of the state at `t`.
    pub fingerprint: [u8; 32],
}

/// Choose pivots among the candidate steps (those fingerprinted at decode time), in position
/// order.
pub fn select_pivots(steps: &[Step], spec: &PivotSpec) -> Vec<Pivot> {
    let candidates: Vec<(usize, &Step, [u8; 32])> = steps
        .iter()
        .enumerate()
        .filter(|(_, s)| s.margin <= spec.max_margin && !s.alternatives.is_empty())
        .filter_map(|(t, s)| s.fingerprint.map(|f| (t, s, f)))
        .collect();
    let cap = spec.max_per_rollout;
    let mut chosen: Vec<&(usize, &Step, [u8; 32])> = match spec.rule {
        PivotRule::LowestMargin => {
            let mut c: Vec<_> = candidates.iter().collect();
            c.sort_by(|a, b| a.1.margin.total_cmp(&b.1.margin).then(a.0.cmp(&b.0)));
            c.truncate(cap);
            c
        }
        PivotRule::Spread => {
            let n = candidates.len();
            if n <= cap {
                candidates.iter().collect()
            } else {
                (0..cap).map(|i| &candidates[i * n / cap]).collect()
            }
        }
    };
    chosen.sort_by_key(|c| c.0);
    chosen
        .into_iter()
        .map(|&(pos, s, fingerprint)| Pivot {
            pos,
            token: s.token,
            alternatives: s.alternatives.clone(),
            margin: s.margin,
            margin_at_temperature: s.margin_at_temperature,
            logprob: s.logprob,
            fingerprint,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(margin: f64, fp: bool) -> Step {
        Step {
            token: 1,
            logprob: -0.5,
            margin,
            margin_at_temperature: None,
            alternatives: vec![2],
            fingerprint: fp.then_some([0; 32]),
        }
    }

    fn row(logits: &[f32]) -> Tensor {
        Tensor::from_slice(logits).view([1, -1])
    }

    #[test]
    fn alternatives_skip_excluded_tokens_for_the_next_most_probable() {
        // Ranking 0 > 2 > 4 > 1 > 3.
        let logits = row(&[5.0, 1.0, 4.0, 0.5, 3.0]);
        assert_eq!(alternatives(&logits, 0, 2, &[]).unwrap(), vec![2, 4]);
        assert_eq!(alternatives(&logits, 0, 2, &[2]).unwrap(), vec![4, 1]);
        assert_eq!(alternatives(&logits, 4, 1, &[0, 2]).unwrap(), vec![1]);
        // The vocabulary runs out: fewer alternatives, never an excluded one.
        assert_eq!(alternatives(&logits, 0, 9, &[1, 3]).unwrap(), vec![2, 4]);
    }

    #[test]
    fn margin_at_temperature_sharpens_and_is_absent_when_greedy() {
        let logits = row(&[2.0, 1.0, 0.0]);
        let m1 = sampling::step_info(&logits, &[0]).unwrap()[0].margin;
        let t = |temperature| Sampling::Temperature { temperature };
        assert_eq!(margin_at(&logits, t(1.0), 0, m1).unwrap(), Some(m1));
        let half = margin_at(&logits, t(0.5), 0, m1).unwrap().unwrap();
        let e = |x: f64| x.exp();
        let want = (e(4.0) - e(2.0)) / (e(4.0) + e(2.0) + 1.0);
        assert!((half - want).abs() < 1e-6, "{half} vs {want}");
        assert!(half > m1);
        let hot = margin_at(&logits, t(2.0), 0, m1).unwrap().unwrap();
        assert!(hot < m1);
        assert_eq!(margin_at(&logits, Sampling::Greedy, 0, m1).unwrap(), None);
    }

    #[test]
    fn lowest_margin_rule_keeps_the_smallest_margins_in_position_order() {
        let steps = vec![
            step(0.9, false),
            step(0.3, true),
            step(0.1, true),
            step(0.2, true),
            step(0.05, true),
        ];
        let spec = PivotSpec {
            max_margin: 0.5,
            max_per_rollout: 2,
            rule: PivotRule::LowestMargin,
            alternatives: 1,
        };
        let pos: Vec<usize> = select_pivots(&steps, &spec).iter().map(|p| p.pos).collect();
        assert_eq!(pos, vec![2, 4]);
    }

    #[test]
    fn spread_rule_spaces_pivots_over_candidates() {
        let steps: Vec<Step> = (0..10).map(|_| step(0.1, true)).collect();
        let spec = PivotSpec {
            max_margin: 0.5,
            max_per_rollout: 3,
            rule: PivotRule::Spread,
            alternatives: 1,
        };
        let pos: Vec<usize> = select_pivots(&steps, &spec).iter().map(|p| p.pos).collect();
        assert_eq!(pos, vec![0, 3, 6]);
    }
}
