//! Rollouts decoded together across prompts of different lengths (SmolLM2-135M-Instruct from
//! the model cache): under the batch-invariant policy each row is bitwise the rollout generated
//! alone (steps, log-probabilities, margins, alternatives and decode-time fingerprints), and
//! each row's cache holds its own decode-time states; a negative control swaps two rows' noise
//! keys and the comparison catches it.
mod common;

use kvcredit::ExecPolicy;
use kvcredit::credit::rollout::{self, Rollout, RolloutParams};
use kvcredit::exec::BiTiles;
use kvcredit::runtime::{self, Dtype, LoadedModel, ModelSource};
use kvcredit::sampling::{NoiseKey, Sampling};
use kvcredit::tasks::Prompt;

fn model() -> LoadedModel {
    let src = ModelSource::resolve("smollm2-135m-instruct", &common::registry_paths())
        .expect("model pulled (make models)");
    runtime::load(&src, Dtype::Fp32, tch::Device::Cpu).expect("model loads")
}

fn params(model: &LoadedModel) -> RolloutParams<'_> {
    RolloutParams {
        sampling: Sampling::Temperature { temperature: 1.0 },
        max_new_tokens: 24,
        key: NoiseKey::rollout(7, 0),
        stop_tokens: &model.stop_tokens,
        special_tokens: &model.special_tokens,
        text_stop: None,
        policy: ExecPolicy::BatchInvariant(BiTiles::CPU),
        // Every step a candidate: every step fingerprinted.
        max_margin: 1.0,
        alternatives: 2,
    }
}

fn same(a: &Rollout, b: &Rollout) -> bool {
    a.prompt == b.prompt && a.steps == b.steps && a.stop == b.stop
}

#[test]
fn batched_rollouts_are_bitwise_the_rollouts_generated_alone() {
    let m = model();
    let texts = [
        "Count from one to ten.",
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell?",
        "Hi",
    ];
    let prompts: Vec<Vec<i64>> = texts
        .iter()
        .map(|t| {
            m.encode_prompt(&Prompt::Text {
                text: t.to_string(),
            })
            .unwrap()
        })
        .collect();
    assert!(prompts[0].len() != prompts[1].len() && prompts[1].len() != prompts[2].len());
    let refs: Vec<&[i64]> = prompts.iter().map(Vec::as_slice).collect();
    let keys: Vec<NoiseKey> = (0..3).map(|i| NoiseKey::rollout(7, i)).collect();
    let p = params(&m);
    let alone: Vec<Rollout> = refs
        .iter()
        .zip(&keys)
        .map(|(pr, &key)| {
            rollout::rollout(&m.decoder, pr, &RolloutParams { key, ..params(&m) }).unwrap()
        })
        .collect();
    let batched = rollout::rollouts(&m.decoder, &refs, &keys, &p).unwrap();
    assert_eq!(batched.len(), 3);
    for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
        assert!(a.steps.len() > 1, "row {i} generated too little");
        assert!(
            same(a, b),
            "row {i}: the batched rollout differs from the one alone"
        );
        // The row's own cache holds every decode-time state it fingerprinted.
        for (t, s) in b.steps.iter().enumerate() {
            if let Some(fp) = s.fingerprint {
                assert_eq!(
                    b.cache.fingerprint(b.snapshot(t)).unwrap(),
                    fp,
                    "row {i} step {t}"
                );
            }
        }
        assert_eq!(b.cache.lens(), a.cache.lens(), "row {i} cache length");
    }
    // Rows finish at different steps (a row leaving the batch mid-way is exercised).
    let lens: Vec<usize> = batched.iter().map(|r| r.steps.len()).collect();
    assert!(
        lens.iter().any(|&l| l != lens[0]) || lens[0] == 24,
        "{lens:?}"
    );

    // Negative control: two rows' noise keys swapped; the check must catch the difference.
    let swapped = [keys[1], keys[0], keys[2]];
    let wrong = rollout::rollouts(&m.decoder, &refs, &swapped, &p).unwrap();
    assert!(
        !same(&alone[0], &wrong[0]) || !same(&alone[1], &wrong[1]),
        "swapping the rows' keys went unnoticed"
    );
    assert!(same(&alone[2], &wrong[2]), "an untouched row changed");
}
