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
use crate::kv_cache::{self, HashPool, KvCache, Snapshot};
use crate::model::{Decoder, LogitsAt};
use crate::sampling::{self, NoiseKey, Sampler, Sampling};
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
        let idx = Tensor::f_from_slice(excluded)?.f_to_device(row.device())?;
        row = row.f_index_fill(-1, &idx, f64::NEG_INFINITY)?;
    }
    let k = (n as i64 + 1).min(row.size().last().copied().unwrap_or(0));
    let (_, idx) = row.f_topk(k, -1, true, true)?;
    Ok(
        Vec::<i64>::try_from(idx.f_to_device(Device::Cpu)?.f_reshape([-1])?)?
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
            let scaled = logits.f_to_kind(Kind::Float)?.f_div_scalar(temperature)?;
            Some(sampling::step_info(&scaled, &[token])?[0].margin)
        }
    })
}

/// Generate one rollout.
pub fn rollout(model: &Decoder, prompt: &[i64], p: &RolloutParams) -> Result<Rollout> {
    rollouts(model, &[prompt], &[p.key], p)?
        .pop()
        .ok_or_else(|| crate::Error::Invariant("a rollout of one prompt returned none".into()))
}

/// What one step's distribution gave a row, read back from the device in one copy.
struct RowFacts {
    token: i64,
    logprob: f64,
    margin: f64,
    alternatives: Vec<i64>,
}

/// Per row of `logits` (`[B, V]`): the selected token ([`sampling::select`]), its
/// [`sampling::step_info`] log-probability and margin and its [`alternatives`], computed on
/// the device and read back with a single copy (the same ops, so the same values, as those
/// functions), the token drawn by `sampler`. `None` when a logit is not finite.
fn step_facts(
    logits: &Tensor,
    sampler: Sampler,
    p: &RolloutParams,
    keys: &[NoiseKey],
    excluded: &[i64],
    excluded_idx: Option<&Tensor>,
) -> Result<Option<Vec<RowFacts>>> {
    let b = keys.len();
    let words = Tensor::f_from_slice(&sampling::noise_words(keys))?
        .f_to_device(logits.device())?
        .f_view([2, b as i64, 1])?;
    let chosen = sampling::select_on_device(logits, p.sampling, &words, sampler)?;
    let finite = logits
        .f_isfinite()?
        .f_all()?
        .f_to_kind(Kind::Double)?
        .f_view([1])?;
    let float = logits.f_to_kind(Kind::Float)?;
    let logp = float.f_log_softmax(-1, Kind::Float)?;
    let (top, _) = logp.f_topk(2, -1, true, true)?;
    let lp = logp.f_gather(1, &chosen.f_view([-1, 1])?, false)?;
    let row = match excluded_idx {
        Some(idx) => float.f_index_fill(-1, idx, f64::NEG_INFINITY)?,
        None => float,
    };
    let k = (p.alternatives as i64 + 1).min(row.size().last().copied().unwrap_or(0));
    let (_, alt) = row.f_topk(k, -1, true, true)?;
    // f32 values and token ids are exact in f64.
    let packed = Tensor::f_cat(
        &[
            finite,
            chosen.f_to_kind(Kind::Double)?,
            top.f_to_kind(Kind::Double)?.f_reshape([-1])?,
            lp.f_to_kind(Kind::Double)?.f_reshape([-1])?,
            alt.f_to_kind(Kind::Double)?.f_reshape([-1])?,
        ],
        0,
    )?;
    let v = Vec::<f64>::try_from(packed.f_to_device(Device::Cpu)?)?;
    if v[0] == 0.0 {
        return Ok(None);
    }
    let (tokens, rest) = v[1..].split_at(b);
    let (top, rest) = rest.split_at(2 * b);
    let (lp, alt) = rest.split_at(b);
    let k = k as usize;
    Ok(Some(
        (0..b)
            .map(|r| {
                let token = tokens[r] as i64;
                RowFacts {
                    token,
                    logprob: lp[r],
                    margin: top[2 * r].exp() - top[2 * r + 1].exp(),
                    alternatives: alt[r * k..(r + 1) * k]
                        .iter()
                        .map(|&t| t as i64)
                        .filter(|t| *t != token && !excluded.contains(t))
                        .take(p.alternatives)
                        .collect(),
                }
            })
            .collect(),
    ))
}

/// Generate the rollouts of several prompts decoded together, row `i` from `prompts[i]` with
/// noise key `keys[i]` (`p.key` is not used). Prompts of different lengths are prefilled one
/// at a time, then their caches are gathered into one batch whose rows keep their own lengths
/// (the forward attends over each row's valid keys); finished rows leave the batch, each
/// taking a one-row copy of its cache. Each step's fingerprints are those of the row's own
/// decode-time state. One prompt runs exactly as it always has (no gather, no copy); under a
/// batch-invariant policy each rollout of a batch is bitwise the one generated alone.
///
/// A candidate step's K/V is gathered on the device at decode time, then copied to the host
/// and hashed on background threads ([`HashPool`]) while decoding goes on; the fingerprints
/// are filled in at the end.
pub fn rollouts(
    model: &Decoder,
    prompts: &[&[i64]],
    keys: &[NoiseKey],
    p: &RolloutParams,
) -> Result<Vec<Rollout>> {
    std::thread::scope(|scope| {
        let hashes = HashPool::start(scope, kv_cache::hash_threads(), 16);
        let mut out = decode_rollouts(model, prompts, keys, p, &hashes)?;
        for ((i, t), fingerprint) in hashes.finish()? {
            out[i].steps[t].fingerprint = Some(fingerprint);
        }
        Ok(out)
    })
}

/// The special tokens that are not stop tokens (never candidates nor alternatives), and the
/// same as an index tensor on `device` (`None` when there are none).
fn excluded_tokens(p: &RolloutParams, device: Device) -> Result<(Vec<i64>, Option<Tensor>)> {
    let excluded: Vec<i64> = p
        .special_tokens
        .iter()
        .copied()
        .filter(|t| !p.stop_tokens.contains(t))
        .collect();
    let idx = match excluded.is_empty() {
        true => None,
        false => Some(Tensor::f_from_slice(&excluded)?.f_to_device(device)?),
    };
    Ok((excluded, idx))
}

/// [`rollouts`]' decoding; candidate steps' K/V go to `hashes`, tagged (rollout, step).
fn decode_rollouts(
    model: &Decoder,
    prompts: &[&[i64]],
    keys: &[NoiseKey],
    p: &RolloutParams,
    hashes: &HashPool<'_, (usize, usize)>,
) -> Result<Vec<Rollout>> {
    let n = prompts.len();
    if keys.len() != n {
        return Err(crate::Error::Spec(format!(
            "{n} rollout prompts but {} noise keys",
            keys.len()
        )));
    }
    if n == 0 {
        return Ok(vec![]);
    }
    let (excluded, excluded_idx) = excluded_tokens(p, model.device())?;
    let mut caches = Vec::with_capacity(n);
    let mut first = Vec::with_capacity(n);
    for prompt in prompts {
        let mut cache = model.new_cache(1, (prompt.len() + p.max_new_tokens + 1) as i64)?;
        let ids = Tensor::f_from_slice(prompt)?.f_view([1, -1])?;
        first.push(
            model
                .forward(&ids, &mut cache, &p.policy, &LogitsAt::Last)?
                .f_view([1, -1])?,
        );
        caches.push(cache);
    }
    let (mut cache, mut logits) = if n == 1 {
        (caches.remove(0), first.remove(0))
    } else {
        let parts: Vec<(&KvCache, Snapshot)> = caches.iter().map(|c| (c, c.snapshot(0))).collect();
        let batch = KvCache::gather(&parts, (p.max_new_tokens + 1) as i64)?;
        (batch, Tensor::f_cat(&first, 0)?)
    };
    drop(caches);
    // Batch row r generates rollout `live[r]`; all live rows are at the same step.
    let mut live: Vec<usize> = (0..n).collect();
    let mut steps: Vec<Vec<Step>> = vec![Vec::new(); n];
    let mut finished: Vec<Option<(Stop, KvCache)>> = (0..n).map(|_| None).collect();
    let mut t = 0usize;
    loop {
        let row_keys: Vec<NoiseKey> = live
            .iter()
            .map(|&i| NoiseKey {
                step: t as u64,
                ..keys[i]
            })
            .collect();
        let Some(facts) = step_facts(
            &logits,
            model.sampler(),
            p,
            &row_keys,
            &excluded,
            excluded_idx.as_ref(),
        )?
        else {
            check_finite(&logits, &format!("rollout step {t}"))?;
            return Err(crate::Error::Invariant(format!(
                "rollout step {t}: logits were flagged non-finite"
            )));
        };
        let mut stops: Vec<Option<Stop>> = Vec::with_capacity(live.len());
        for (r, (&i, f)) in live.iter().zip(&facts).enumerate() {
            let is_stop = p.stop_tokens.contains(&f.token);
            let candidate = f.margin <= p.max_margin && !is_stop && !excluded.contains(&f.token);
            let margin_at_temperature = if candidate {
                hashes.send((i, steps[i].len()), cache.copy_out(cache.snapshot(r))?)?;
                margin_at(
                    &logits.f_narrow(0, r as i64, 1)?,
                    p.sampling,
                    f.token,
                    f.margin,
                )?
            } else {
                None
            };
            let seq = &mut steps[i];
            seq.push(Step {
                token: f.token,
                logprob: f.logprob,
                margin: f.margin,
                margin_at_temperature,
                alternatives: f.alternatives.clone(),
                // Filled in by `rollouts` from the background hashes.
                fingerprint: None,
            });
            stops.push(if is_stop {
                Some(Stop::Eos)
            } else if seq.len() >= p.max_new_tokens {
                Some(Stop::Length)
            } else if p
                .text_stop
                .is_some_and(|stop_at| stop_at(&seq.iter().map(|s| s.token).collect::<Vec<_>>()))
            {
                Some(Stop::Text)
            } else {
                None
            });
        }
        t += 1;
        let keep: Vec<usize> = (0..live.len()).filter(|&r| stops[r].is_none()).collect();
        if keep.is_empty() && n == 1 {
            finished[0] = stops[0].map(|s| (s, cache));
            break;
        }
        for (r, stop) in stops.iter().enumerate() {
            if let Some(stop) = *stop {
                let own = KvCache::gather(&[(&cache, cache.snapshot(r))], 0)?;
                finished[live[r]] = Some((stop, own));
            }
        }
        if keep.is_empty() {
            break;
        }
        if keep.len() < live.len() {
            cache.select_rows(&keep)?;
            live = keep.iter().map(|&r| live[r]).collect();
        }
        let feed: Vec<i64> = keep.iter().map(|&r| facts[r].token).collect();
        let ids = Tensor::f_from_slice(&feed)?.f_view([feed.len() as i64, 1])?;
        logits = model
            .forward(&ids, &mut cache, &p.policy, &LogitsAt::Last)?
            .f_view([feed.len() as i64, -1])?;
    }
    prompts
        .iter()
        .zip(steps)
        .zip(finished)
        .map(|((prompt, steps), done)| {
            let (stop, cache) = done.ok_or_else(|| {
                crate::Error::Invariant("a rollout of the batch did not finish".into())
            })?;
            Ok(Rollout {
                prompt: prompt.to_vec(),
                steps,
                stop,
                cache,
            })
        })
        .collect()
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
