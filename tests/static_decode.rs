//! The graph-compatible decode step ([`Decoder::forward_static`]: device-resident inputs,
//! attention over the cache's whole capacity under a device-built mask, K/V written by
//! scatter) against the eager [`Decoder::forward`], on the CPU:
//!
//! * batch-invariant policy: logits and the K/V rows written are **bitwise** equal, over the
//!   fixture architectures (Qwen2 biases, Gemma-2 soft-capping with sliding windows, Mistral
//!   windows, Qwen3/Gemma-3 q/k norms) in fp32 and bf16, for a ragged batch over several steps;
//! * stock policy: close (the longer key axis may round differently);
//! * the continuation engine gives the same tokens in `eager` and `static` mode (with
//!   compaction of finished rows), and `graph` mode is refused on the CPU with a clear error.
mod common;

use common::*;
use kvcredit::decode::engine::{self, Decoding, EngineMode, EngineOptions, Job, Start};
use kvcredit::decode::schedule;
use kvcredit::sampling::{NoiseKey, Sampling};
use kvcredit::{Decoder, ExecPolicy, KvCache, LogitsAt, Result, Snapshot};
use std::path::PathBuf;
use tch::{Device, Kind, Tensor};

const FIXTURES: &[&str] = &["llama", "qwen2", "gemma2", "mistral_sw", "qwen3", "gemma3"];

fn fixture(name: &str) -> PathBuf {
    hf_fixtures().join(name)
}

/// Bitwise equality of two tensors of one dtype.
fn bits_equal(a: &Tensor, b: &Tensor) -> bool {
    let k = match a.kind() {
        Kind::BFloat16 | Kind::Half => Kind::Int16,
        Kind::Double => Kind::Int64,
        _ => Kind::Int,
    };
    a.size() == b.size() && a.view_dtype(k).equal(&b.view_dtype(k))
}

fn lcg(seed: &mut u64, vocab: i64) -> i64 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 33) % vocab as u64) as i64
}

/// One row per length, each prefilled alone (batch 1), as sources to resume from.
fn sources(model: &Decoder, lens: &[usize], seed: &mut u64) -> Result<Vec<KvCache>> {
    let vocab = model.config().vocab_size as i64;
    lens.iter()
        .map(|&n| {
            let ids: Vec<i64> = (0..n).map(|_| lcg(seed, vocab)).collect();
            let mut c = model.new_cache(1, n as i64)?;
            let _ = model.forward(
                &Tensor::from_slice(&ids).view([1, -1]),
                &mut c,
                &ExecPolicy::Stock,
                &LogitsAt::Last,
            )?;
            Ok(c)
        })
        .collect()
}

/// Run `steps` decode steps of a ragged batch both ways; returns the largest |Δlogit| and
/// whether logits and K/V were bitwise equal throughout.
fn compare(model: &Decoder, policy: ExecPolicy, steps: usize, seed: u64) -> Result<(f64, bool)> {
    let mut seed = seed;
    let vocab = model.config().vocab_size as i64;
    let srcs = sources(model, &[7, 19, 12], &mut seed)?;
    let parts: Vec<(&KvCache, Snapshot)> = srcs.iter().map(|c| (c, c.snapshot(0))).collect();
    let mut eager = KvCache::gather(&parts, steps as i64 + 1)?;
    // A different (larger) capacity: the static step attends over all of it.
    let mut stat = KvCache::gather(&parts, steps as i64 + 45)?;
    let b = parts.len() as i64;
    let (mut worst, mut bitwise) = (0f64, true);
    for _ in 0..steps {
        let ids: Vec<i64> = (0..b).map(|_| lcg(&mut seed, vocab)).collect();
        let tokens = Tensor::from_slice(&ids).view([b, 1]);
        let a = model
            .forward(&tokens, &mut eager, &policy, &LogitsAt::Last)?
            .view([b, -1]);
        let positions = Tensor::from_slice(stat.lens()).view([b, 1]);
        let s = model.forward_static(&tokens, &positions, &mut stat, &policy)?;
        worst = worst.max(max_abs(&a, &s));
        bitwise &= bits_equal(&a, &s);
    }
    assert_eq!(eager.lens(), stat.lens());
    for row in 0..b as usize {
        let fa = eager.fingerprint(eager.snapshot(row))?;
        let fs = stat.fingerprint(stat.snapshot(row))?;
        bitwise &= fa == fs;
    }
    Ok((worst, bitwise))
}

#[test]
fn static_forward_is_bitwise_the_eager_forward_batch_invariant() -> Result<()> {
    let mut failures = Vec::new();
    for name in FIXTURES {
        for kind in [Kind::Float, Kind::BFloat16] {
            let model = load(&fixture(name), kind)?;
            let (worst, bitwise) = compare(
                &model,
                ExecPolicy::BatchInvariant(kvcredit::exec::BiTiles::CPU),
                6,
                5,
            )?;
            println!("{name} {kind:?} batch_invariant: bitwise {bitwise}, max |Δ| {worst:.3e}");
            if !bitwise {
                failures.push(format!("{name} {kind:?}"));
            }
        }
    }
    assert!(failures.is_empty(), "static ≠ eager: {failures:?}");
    Ok(())
}

#[test]
fn static_forward_is_close_to_the_eager_forward_stock() -> Result<()> {
    for name in FIXTURES {
        let model = load(&fixture(name), Kind::Float)?;
        let (worst, bitwise) = compare(&model, ExecPolicy::Stock, 6, 9)?;
        println!("{name} fp32 stock: bitwise {bitwise}, max |Δ| {worst:.3e}");
        assert!(worst <= 1e-4, "{name}: max |Δlogit| {worst}");
    }
    Ok(())
}

/// Pivots at three lengths of `src` row 0, two branch tokens each, two samples.
fn pivot_jobs(src: &KvCache) -> Vec<Job<'_>> {
    let mut jobs = Vec::new();
    for (p, len) in [5i64, 11, 16].into_iter().enumerate() {
        for branch in 0..2u64 {
            for sample in 0..2u64 {
                jobs.push(Job {
                    start: Start {
                        cache: src,
                        snap: Snapshot { row: 0, len },
                        expect: None,
                    },
                    first_token: 3 + branch as i64 + p as i64,
                    key: NoiseKey {
                        seed: 1,
                        problem: 0,
                        pivot: p as u64,
                        branch,
                        sample,
                        step: 0,
                    },
                });
            }
        }
    }
    jobs
}

fn run_engine(
    model: &Decoder,
    src: &KvCache,
    mode: EngineMode,
    policy: ExecPolicy,
) -> Result<Vec<engine::Outcome>> {
    let order: Vec<usize> = (0..pivot_jobs(src).len()).rev().collect();
    let run = run_pass(
        model,
        src,
        mode,
        policy,
        &schedule::chunked(&order, 5),
        0,
        20,
    )?;
    println!("{mode}: {}", run.stats.describe());
    Ok(run.outcomes)
}

#[test]
fn engine_static_mode_gives_the_eager_tokens_batch_invariant() -> Result<()> {
    for kind in [Kind::Float, Kind::BFloat16] {
        let model = load(&fixture("qwen2"), kind)?;
        let mut seed = 3;
        let src = sources(&model, &[16], &mut seed)?.remove(0);
        let eager = run_engine(
            &model,
            &src,
            EngineMode::Eager,
            ExecPolicy::BatchInvariant(kvcredit::exec::BiTiles::CPU),
        )?;
        let stat = run_engine(
            &model,
            &src,
            EngineMode::Static,
            ExecPolicy::BatchInvariant(kvcredit::exec::BiTiles::CPU),
        )?;
        assert!(
            eager.iter().any(|o| o.tokens.len() < 20),
            "no row stopped early: compaction not exercised"
        );
        assert_eq!(eager, stat, "{kind:?}");
    }
    Ok(())
}

#[test]
fn graph_mode_needs_cuda() -> Result<()> {
    let model = load(&fixture("llama"), Kind::Float)?;
    let mut seed = 4;
    let src = sources(&model, &[16], &mut seed)?.remove(0);
    let err = run_engine(&model, &src, EngineMode::Graph, ExecPolicy::Stock).unwrap_err();
    assert!(err.to_string().contains("needs a CUDA device"), "{err}");
    // Auto is eager on the CPU.
    assert_eq!(EngineMode::Auto.resolve(Device::Cpu), EngineMode::Eager);
    Ok(())
}

/// A static batch rounds its capacity up to a multiple of `CAPACITY_ALIGN` (on a GPU, stock
/// attention matmuls over an unaligned key axis are several times slower), and still decodes
/// the eager tokens under the batch-invariant policy; an eager batch keeps exactly the room
/// it was asked for.
#[test]
fn static_capacity_is_aligned_and_eager_capacity_is_exact() -> Result<()> {
    use kvcredit::decode::stepper::{CAPACITY_ALIGN, Stepper};
    let model = load(&fixture("qwen2"), Kind::Float)?;
    let mut seed = 5;
    let src = sources(&model, &[13], &mut seed)?.remove(0);
    let parts = [
        (&src, Snapshot { row: 0, len: 13 }),
        (&src, Snapshot { row: 0, len: 9 }),
    ];
    let policy = ExecPolicy::BatchInvariant(kvcredit::exec::BiTiles::CPU);
    let key = NoiseKey {
        seed: 1,
        problem: 0,
        pivot: 0,
        branch: 0,
        sample: 0,
        step: 0,
    };
    let aligned = (13 + 6 + CAPACITY_ALIGN - 1) / CAPACITY_ALIGN * CAPACITY_ALIGN;
    assert_ne!(aligned, 13 + 6, "the shape must exercise the rounding");
    let mut tokens = Vec::new();
    for (mode, capacity) in [(EngineMode::Eager, 13 + 6), (EngineMode::Static, aligned)] {
        let mut s = Stepper::new(&model, policy, Sampling::Greedy, mode, &parts, 6, 0, 0)?;
        assert_eq!(s.cache().capacity(), capacity, "{mode}");
        let mut feed = vec![3, 4];
        let mut seen = Vec::new();
        for _ in 0..5 {
            feed = s.step(&feed, &[key, key])?;
            seen.push(feed.clone());
        }
        tokens.push(seen);
    }
    assert_eq!(tokens[0], tokens[1]);
    Ok(())
}

/// The pivot jobs under `batches` with `key_pad`, up to `max_new_tokens` each, as a pass of
/// the campaign runs them; rows stop on a text rule that fires for some of them, so batches
/// get compacted.
fn run_pass(
    model: &Decoder,
    src: &KvCache,
    mode: EngineMode,
    policy: ExecPolicy,
    batches: &[Vec<usize>],
    key_pad: i64,
    max_new_tokens: usize,
) -> Result<engine::PassRun> {
    let jobs = pivot_jobs(src);
    let stop = |seq: &[i64]| seq.iter().sum::<i64>() % 3 == 0;
    let dec = Decoding {
        model,
        policy,
        sampling: Sampling::Temperature { temperature: 1.0 },
        max_new_tokens,
        stop_tokens: &[],
        text_stop: Some(&stop),
    };
    let opts = EngineOptions { mode, key_pad };
    engine::run_batches(&dec, &jobs, batches, &opts, &mut |_| {})
}

/// Steps, over all jobs, at which `replica` attended over exact's key axis, and all steps.
fn steps_on_exacts_axis(exact: &engine::PassRun, replica: &engine::PassRun) -> (usize, usize) {
    let same = exact
        .paths
        .iter()
        .zip(&replica.paths)
        .map(|(e, r)| r.same_key_steps(e))
        .sum();
    (same, replica.paths.iter().map(|p| p.steps.len()).sum())
}

/// The replica's key padding takes every one of its steps off exact's key axis, in both modes;
/// without it the static replica runs on exact's key axis at every step (the equalization a
/// spec refuses), so a change that dropped the padding fails here. The recorded paths are
/// complete (one entry per sampled token), and under batch_invariant the padding changes no
/// token.
#[test]
fn key_padding_moves_every_replica_step_off_exacts_key_axis() -> Result<()> {
    let model = load(&fixture("qwen2"), Kind::Float)?;
    let mut seed = 5;
    let src = sources(&model, &[16], &mut seed)?.remove(0);
    let n = pivot_jobs(&src).len();
    let exact_batches = schedule::exact(n, 5);
    let replica_batches = schedule::shuffled(n, 5, 3);
    let bi = ExecPolicy::BatchInvariant(kvcredit::exec::BiTiles::CPU);
    for mode in [EngineMode::Eager, EngineMode::Static] {
        let exact = run_pass(&model, &src, mode, ExecPolicy::Stock, &exact_batches, 0, 12)?;
        for (o, p) in exact.outcomes.iter().zip(&exact.paths) {
            assert_eq!(
                o.tokens.len(),
                p.steps.len(),
                "{mode}: one path step per token"
            );
        }
        let padded = run_pass(
            &model,
            &src,
            mode,
            ExecPolicy::Stock,
            &replica_batches,
            3,
            12,
        )?;
        let (same, steps) = steps_on_exacts_axis(&exact, &padded);
        assert!(steps > 0);
        assert_eq!(
            same, 0,
            "{mode}: {same} of {steps} padded steps on exact's key axis"
        );
        let bare = run_pass(
            &model,
            &src,
            mode,
            ExecPolicy::Stock,
            &replica_batches,
            0,
            12,
        )?;
        let (same, steps) = steps_on_exacts_axis(&exact, &bare);
        if mode == EngineMode::Static {
            assert_eq!(
                same, steps,
                "static: an unpadded replica runs exact's capacity"
            );
        }
        let bi_exact = run_pass(&model, &src, mode, bi, &exact_batches, 0, 12)?;
        let bi_padded = run_pass(&model, &src, mode, bi, &replica_batches, 3, 12)?;
        assert_eq!(bi_exact.outcomes, bi_padded.outcomes, "{mode}");
    }
    Ok(())
}

/// Masked rows refilled into a static batch whose first steps ran unmasked decode bitwise as
/// eager does, on every fixture architecture; the control (the same rows refilled without
/// their masks) decodes differently on every row, so an ignored mask would fail the check.
#[test]
fn masked_rows_refilled_into_a_static_batch_decode_as_eager() -> Result<()> {
    use kvcredit::decode::mask_check::{self, MaskCheckOptions};
    let policy = ExecPolicy::BatchInvariant(kvcredit::exec::BiTiles::CPU);
    for name in FIXTURES {
        let model = load(&fixture(name), Kind::Float)?;
        let c = mask_check::run(
            &model,
            policy,
            EngineMode::Static,
            &MaskCheckOptions::default(),
        )?;
        assert_eq!(c.rows_equal, c.rows, "{name}: {c:?}");
        assert_eq!(c.control_rows_differ, c.rows, "{name}: {c:?}");
        assert!(c.passed());
    }
    let model = load(&fixture("llama"), Kind::Float)?;
    assert!(
        mask_check::run(
            &model,
            policy,
            EngineMode::Eager,
            &MaskCheckOptions::default()
        )
        .is_err()
    );
    Ok(())
}
