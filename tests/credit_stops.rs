//! Stop and special tokens in credit rollouts and continuations, on a tiny fixture model:
//! special tokens that are not stops are never pivots nor alternatives (and excluding them does
//! not change what is sampled), stop tokens stay admissible alternatives, and a branch that
//! feeds a stop token ends with an empty continuation.
mod common;

use kvcredit::credit::rollout::{self, Rollout, RolloutParams};
use kvcredit::credit::spec::{PivotRule, PivotSpec};
use kvcredit::decode::engine::{
    self, Decoding, EngineMode, EngineOptions, Job, Outcome, Start, Stop,
};
use kvcredit::sampling::{NoiseKey, Sampling};
use kvcredit::{Decoder, ExecPolicy};
use tch::Kind;

fn model() -> Decoder {
    common::load(&common::hf_fixtures().join("qwen2"), Kind::Float).expect("fixture loads")
}

const PROMPT: [i64; 6] = [3, 17, 42, 99, 5, 64];

fn roll(m: &Decoder, stop: &[i64], special: &[i64], alternatives: usize) -> Rollout {
    rollout::rollout(
        m,
        &PROMPT,
        &RolloutParams {
            sampling: Sampling::Greedy,
            max_new_tokens: 16,
            key: NoiseKey::rollout(5, 0),
            stop_tokens: stop,
            special_tokens: special,
            text_stop: None,
            policy: ExecPolicy::Stock,
            max_margin: 1.0,
            alternatives,
        },
    )
    .expect("rollout")
}

fn all_pivots(r: &Rollout, alternatives: usize) -> Vec<rollout::Pivot> {
    rollout::select_pivots(
        &r.steps,
        &PivotSpec {
            max_margin: 1.0,
            max_per_rollout: usize::MAX,
            rule: PivotRule::LowestMargin,
            alternatives,
        },
    )
}

#[test]
fn special_tokens_are_never_pivots_nor_alternatives() {
    let m = model();
    let free = roll(&m, &[], &[], 2);
    // Special: the tokens of two steps and the runner-ups of two others.
    let mut special = vec![
        free.steps[0].token,
        free.steps[3].token,
        free.steps[1].alternatives[0],
        free.steps[2].alternatives[0],
    ];
    special.sort_unstable();
    special.dedup();
    // Negative control: without the exclusion they are pivots and alternatives.
    let uses = |pivots: &[rollout::Pivot]| {
        pivots.iter().any(|p| {
            special.contains(&p.token) || p.alternatives.iter().any(|a| special.contains(a))
        })
    };
    assert!(uses(&all_pivots(&free, 2)));

    let restricted = roll(&m, &[], &special, 2);
    // Excluding tokens from branching does not change what is sampled.
    assert_eq!(restricted.tokens(), free.tokens());
    let deep = roll(&m, &[], &[], 2 + special.len());
    for (t, s) in restricted.steps.iter().enumerate() {
        assert_eq!(
            s.fingerprint.is_some(),
            !special.contains(&s.token),
            "step {t}: candidate iff not special"
        );
        // The next most probable tokens outside the special set.
        let want: Vec<i64> = deep.steps[t]
            .alternatives
            .iter()
            .copied()
            .filter(|a| !special.contains(a))
            .take(2)
            .collect();
        assert_eq!(s.alternatives, want, "step {t}");
    }
    let pivots = all_pivots(&restricted, 2);
    assert!(!pivots.is_empty());
    assert!(!uses(&pivots));
}

#[test]
fn stop_tokens_remain_admissible_alternatives() {
    let m = model();
    let free = roll(&m, &[], &[], 1);
    let generated = free.tokens();
    let (t, stop) = free
        .steps
        .iter()
        .enumerate()
        .map(|(t, s)| (t, s.alternatives[0]))
        .find(|(_, a)| !generated.contains(a))
        .expect("a runner-up that is never generated");
    let r = roll(&m, &[stop], &[stop], 1);
    assert_eq!(r.tokens(), generated);
    assert_eq!(r.steps[t].alternatives, vec![stop]);
    assert!(r.steps[t].fingerprint.is_some());
}

#[test]
fn a_stop_token_branch_ends_with_an_empty_continuation() {
    let m = model();
    let r = roll(&m, &[], &[], 1);
    let pivot = all_pivots(&r, 1).remove(3);
    let stop = pivot.alternatives[0];
    let job = |first_token: i64, sample: u64| Job {
        start: Start {
            cache: &r.cache,
            snap: r.snapshot(pivot.pos),
            expect: Some(pivot.fingerprint),
        },
        first_token,
        key: NoiseKey {
            sample,
            ..NoiseKey::rollout(5, 0)
        },
    };
    let jobs = [job(stop, 0), job(pivot.token, 1), job(stop, 2)];
    let decode = |stops: &[i64], mode: EngineMode| {
        let dec = Decoding {
            model: &m,
            policy: ExecPolicy::Stock,
            sampling: Sampling::Temperature { temperature: 1.0 },
            max_new_tokens: 6,
            stop_tokens: stops,
            text_stop: None,
        };
        engine::run_with(
            &dec,
            &jobs,
            &[0, 1, 2],
            3,
            &EngineOptions::mode(mode),
            &mut |_| {},
        )
        .expect("decodes")
    };
    let empty = Outcome {
        tokens: vec![],
        stop: Stop::Eos,
    };
    for mode in [EngineMode::Eager, EngineMode::Static] {
        let (outs, checks, _) = decode(&[stop], mode);
        assert_eq!(outs[0], empty, "{mode}");
        assert_eq!(outs[2], empty, "{mode}");
        assert!(!outs[1].tokens.is_empty(), "{mode}");
        // The stop branches still had their snapshots verified.
        assert_eq!((checks.checks, checks.hits), (3, 3), "{mode}");
        // Only stop branches: nothing is decoded.
        let dec = Decoding {
            model: &m,
            policy: ExecPolicy::Stock,
            sampling: Sampling::Greedy,
            max_new_tokens: 6,
            stop_tokens: &[stop],
            text_stop: None,
        };
        let stops_only = [job(stop, 0), job(stop, 2)];
        let (only, _, stats) = engine::run_with(
            &dec,
            &stops_only,
            &[0, 1],
            2,
            &EngineOptions::mode(mode),
            &mut |_| {},
        )
        .expect("decodes");
        assert_eq!(only, vec![empty.clone(), empty.clone()]);
        assert_eq!(stats.steps, 0);
    }
    // Negative control: when the token is not a stop, the branch is decoded past it.
    let (outs, _, _) = decode(&[], EngineMode::Eager);
    assert_eq!(outs[0].tokens.len(), 6);
    assert_eq!(outs[0].stop, Stop::Length);
}
