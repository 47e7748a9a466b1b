//! The timed measurements of [`super::run`]: prefill, decode steps and batched continuations.
//! `kvcredit invariance --bench` times its prefill and decode steps with the same functions.
use super::{
    BenchConfig, ContinuationResult, MemoryResult, PrefillResult, ProfileResult,
    kv_bytes_per_token, median, random_ids,
};
use crate::credit::rollout::{self, RolloutParams};
use crate::decode::engine::{self, Decoding, EngineMode, EngineOptions, Job, Start};
use crate::exec::ExecPolicy;
use crate::kv_cache::{KvCache, Snapshot};
use crate::model::{Decoder, LogitsAt};
use crate::profile;
use crate::runtime::sync;
use crate::sampling::{self, NoiseKey, Sampling};
use crate::{Error, Result};
use std::time::Instant;
use tch::Tensor;

/// Median seconds of `reps` batch-1 prefills of `prompt` (after one warm-up), each with the
/// greedy choice of the next token and its readback.
pub fn prefill(
    model: &Decoder,
    policy: ExecPolicy,
    prompt: &[i64],
    reps: usize,
) -> Result<PrefillResult> {
    let ids = Tensor::f_from_slice(prompt)?.f_view([1, -1])?;
    let once = || -> Result<f64> {
        let mut cache = model.new_cache(1, prompt.len() as i64)?;
        sync(model.device());
        let t = Instant::now();
        let logits = model.forward(&ids, &mut cache, &policy, &LogitsAt::Last)?;
        let _ = sampling::select(
            &logits.f_view([1, -1])?,
            Sampling::Greedy,
            &[],
            model.sampler(),
        )?;
        Ok(t.elapsed().as_secs_f64())
    };
    once()?; // warm-up
    let secs = median((0..reps.max(1)).map(|_| once()).collect::<Result<_>>()?);
    Ok(PrefillResult {
        policy: policy.kind(),
        tokens: prompt.len(),
        seconds: secs,
        tokens_per_s: prompt.len() as f64 / secs,
    })
}

/// A batch-1 cache holding `prompt`: the context decode steps resume from.
pub fn prefilled(model: &Decoder, policy: ExecPolicy, prompt: &[i64]) -> Result<KvCache> {
    let mut base = model.new_cache(1, prompt.len() as i64)?;
    let ids = Tensor::f_from_slice(prompt)?.f_view([1, -1])?;
    let _ = model.forward(&ids, &mut base, &policy, &LogitsAt::Last)?;
    Ok(base)
}

/// What [`decode_steps`] measured.
pub struct DecodeTiming {
    /// The engine that ran (a graph request may fall back).
    pub mode: EngineMode,
    /// Mean seconds per timed step.
    pub seconds: f64,
    /// Kernel launches (or ATen ops) of one step, when counted.
    pub launches: Option<u64>,
    /// What `launches` counts.
    pub launches_source: &'static str,
    /// Why CUDA graphs were not used, if they fell back.
    pub fallback: Option<String>,
}

/// Seconds per decode step of `b` rows resumed from `base`'s row 0: `cfg.warmup_steps`
/// untimed steps, one counted step, then `cfg.steps` timed ones (greedy, tokens read back).
pub fn decode_steps(
    model: &Decoder,
    policy: ExecPolicy,
    mode: EngineMode,
    base: &KvCache,
    b: usize,
    cfg: &BenchConfig,
) -> Result<DecodeTiming> {
    // Warm-up, one counted step, timed steps.
    let total = cfg.warmup_steps + 1 + cfg.steps;
    let (mut stepper, mut feed, keys) = resumed(model, policy, mode, base, b, total, cfg)?;
    for _ in 0..cfg.warmup_steps {
        feed = stepper.step(&feed, &keys)?;
    }
    let (next, ops) = crate::cuda_graph::count_ops(|| stepper.step(&feed, &keys))?;
    feed = next;
    sync(model.device());
    let start = Instant::now();
    for _ in 0..cfg.steps {
        feed = stepper.step(&feed, &keys)?;
    }
    sync(model.device());
    let seconds = start.elapsed().as_secs_f64() / cfg.steps as f64;
    let mut stats = engine::EngineStats::default();
    stepper.report(&mut stats);
    let (launches, launches_source) = match (stepper.mode(), stats.graph_nodes) {
        (EngineMode::Graph, Some(n)) if stats.graph_fallback.is_none() => (Some(n), "graph nodes"),
        _ => (ops, "aten ops"),
    };
    Ok(DecodeTiming {
        mode: stepper.mode(),
        seconds,
        launches,
        launches_source,
        fallback: stats.graph_fallback,
    })
}

/// A greedy stepper over `b` copies of `base`'s row 0 with room for `steps` steps, the first
/// tokens to feed and the rows' noise keys.
fn resumed<'m>(
    model: &'m Decoder,
    policy: ExecPolicy,
    mode: EngineMode,
    base: &KvCache,
    b: usize,
    steps: usize,
    cfg: &BenchConfig,
) -> Result<(engine::Stepper<'m>, Vec<i64>, Vec<NoiseKey>)> {
    let parts = vec![(base, base.snapshot(0)); b];
    let vocab = model.config().vocab_size as i64;
    let feed = random_ids(b, vocab, cfg.seed ^ 0xdec0de);
    let cap = base.lens()[0] + steps as i64 + 1;
    let stepper = engine::Stepper::new(
        model,
        policy,
        Sampling::Greedy,
        mode,
        &parts,
        steps + 1,
        cap,
        0,
    )?;
    let key = NoiseKey {
        seed: cfg.seed,
        problem: 0,
        pivot: 0,
        branch: 0,
        sample: 0,
        step: 0,
    };
    Ok((stepper, feed, vec![key; b]))
}

/// GPU time per kernel of `cfg.steps` eager decode steps of `b` rows resumed from `base`'s row
/// 0 (after `cfg.warmup_steps` unprofiled ones), per step; `trace`: also save the Chrome trace.
pub fn profile_steps(
    model: &Decoder,
    policy: ExecPolicy,
    base: &KvCache,
    b: usize,
    cfg: &BenchConfig,
    trace: Option<&std::path::Path>,
) -> Result<ProfileResult> {
    let total = cfg.warmup_steps + cfg.steps;
    let (mut stepper, mut feed, keys) =
        resumed(model, policy, EngineMode::Eager, base, b, total, cfg)?;
    for _ in 0..cfg.warmup_steps {
        feed = stepper.step(&feed, &keys)?;
    }
    sync(model.device());
    let ((), kernels) = profile::device_profile(trace, || {
        for _ in 0..cfg.steps {
            feed = stepper.step(&feed, &keys)?;
        }
        sync(model.device());
        Ok(())
    })?;
    let per_step = |ns: u64| ns as f64 / 1e6 / cfg.steps as f64;
    Ok(ProfileResult {
        policy: policy.kind(),
        batch: b,
        context: base.lens()[0] as usize,
        steps: cfg.steps,
        gpu_ms_per_step: per_step(kernels.iter().map(|k| k.ns).sum()),
        families: profile::by_family(&kernels)
            .into_iter()
            .map(|(f, ns)| (f, per_step(ns)))
            .collect(),
        kernels: kernels.into_iter().take(PROFILE_TOP).collect(),
        trace: trace.map(|p| p.display().to_string()),
    })
}

/// Kernels kept per profile (longest first).
const PROFILE_TOP: usize = 24;

/// A rollout and the jobs of its pivots.
pub(super) struct ContinuationSetup {
    rollout: rollout::Rollout,
    /// Pivot positions (indices of generated steps).
    pivots: Vec<usize>,
    fingerprints: Vec<[u8; 32]>,
}

impl ContinuationSetup {
    pub(super) fn new(
        model: &Decoder,
        policy: ExecPolicy,
        prompt: &[i64],
        cfg: &BenchConfig,
    ) -> Result<Self> {
        if cfg.rollout_tokens < 2 || cfg.pivots == 0 {
            return Err(Error::Spec(
                "bench: continuations need --rollout-tokens ≥ 2 and --pivots ≥ 1".into(),
            ));
        }
        let params = RolloutParams {
            sampling: Sampling::Temperature {
                temperature: cfg.temperature,
            },
            max_new_tokens: cfg.rollout_tokens,
            key: NoiseKey::rollout(cfg.seed, 0),
            stop_tokens: &[],
            special_tokens: &[],
            text_stop: None,
            policy,
            // Pivot fingerprints are taken below from the finished cache: it is append-only,
            // so they equal the decode-time ones.
            max_margin: -1.0,
            alternatives: 1,
        };
        let roll = rollout::rollout(model, prompt, &params)?;
        let n = roll.steps.len();
        let p = cfg.pivots.min(n);
        let pivots: Vec<usize> = (0..p).map(|i| i * n / p).collect();
        let fingerprints = pivots
            .iter()
            .map(|&t| roll.cache.fingerprint(roll.snapshot(t)))
            .collect::<Result<Vec<_>>>()?;
        Ok(ContinuationSetup {
            rollout: roll,
            pivots,
            fingerprints,
        })
    }

    pub(super) fn memory(&self, model: &Decoder) -> MemoryResult {
        let per = kv_bytes_per_token(model);
        let rollout_kv = self.rollout.cache.allocated_bytes();
        let refs = (std::mem::size_of::<Snapshot>() + 32) as i64 * self.pivots.len() as i64;
        let copies: i64 = self
            .pivots
            .iter()
            .map(|&t| self.rollout.snapshot(t).len * per)
            .sum();
        MemoryResult {
            pivots: self.pivots.len(),
            rollout_len: self.rollout.cache.lens()[0],
            kv_bytes_per_token: per,
            rollout_kv_bytes: rollout_kv,
            snapshot_ref_bytes: rollout_kv + refs,
            snapshot_ref_ratio: (rollout_kv + refs) as f64 / rollout_kv as f64,
            prefix_copy_bytes: copies,
            prefix_copy_ratio: copies as f64 / rollout_kv as f64,
        }
    }

    pub(super) fn run(
        &self,
        model: &Decoder,
        policy: ExecPolicy,
        mode: EngineMode,
        batch: usize,
        cfg: &BenchConfig,
    ) -> Result<ContinuationResult> {
        let mut jobs = Vec::new();
        for (&t, fp) in self.pivots.iter().zip(&self.fingerprints) {
            let step = &self.rollout.steps[t];
            let branches = [Some(step.token), step.alternatives.first().copied()];
            for (branch, token) in branches.iter().enumerate() {
                let Some(token) = *token else { continue };
                for sample in 0..cfg.k {
                    jobs.push(Job {
                        start: Start {
                            cache: &self.rollout.cache,
                            snap: self.rollout.snapshot(t),
                            expect: Some(*fp),
                        },
                        first_token: token,
                        key: NoiseKey {
                            seed: cfg.seed,
                            problem: 0,
                            pivot: t as u64,
                            branch: branch as u64,
                            sample: sample as u64,
                            step: 0,
                        },
                    });
                }
            }
        }
        let decoding = Decoding {
            model,
            policy,
            sampling: Sampling::Temperature {
                temperature: cfg.temperature,
            },
            max_new_tokens: cfg.new_tokens,
            stop_tokens: &[],
            text_stop: None,
        };
        let order: Vec<usize> = (0..jobs.len()).collect();
        let mut tokens = 0u64;
        let opts = EngineOptions::mode(mode);
        sync(model.device());
        let t = Instant::now();
        let (outs, checks, stats) =
            engine::run_with(&decoding, &jobs, &order, batch, &opts, &mut |n| tokens += n)?;
        sync(model.device());
        let seconds = t.elapsed().as_secs_f64();
        debug_assert_eq!(outs.len(), jobs.len());
        let tokens_sha256 = tokens_digest(outs.iter().map(|o| o.tokens.as_slice()));
        let longest = self
            .pivots
            .iter()
            .map(|&t| self.rollout.snapshot(t).len)
            .max();
        let cap = longest.unwrap_or(0) + cfg.new_tokens as i64 + 1;
        Ok(ContinuationResult {
            policy: policy.kind(),
            engine: mode.resolve(model.device()),
            sampler: None,
            batch,
            jobs: jobs.len(),
            tokens,
            seconds,
            tokens_per_s: tokens as f64 / seconds,
            snapshot_checks: checks.checks,
            batch_cache_bytes: batch.min(jobs.len()) as i64 * cap * kv_bytes_per_token(model),
            stats: Some(stats),
            tokens_sha256,
        })
    }
}

/// Hex SHA-256 over token sequences, each prefixed by its length (so boundaries count).
fn tokens_digest<'a>(seqs: impl Iterator<Item = &'a [i64]>) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for seq in seqs {
        h.update((seq.len() as u64).to_le_bytes());
        for t in seq {
            h.update(t.to_le_bytes());
        }
    }
    crate::io::hex(&h.finalize())
}
