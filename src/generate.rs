//! Single-sequence generation, with the KV cache (cache-ON) or by full recompute at every
//! step (cache-OFF). Both draw the same counter-based noise per step.
use crate::exec::ExecPolicy;
use crate::model::{Decoder, LogitsAt};
use crate::sampling::{self, NoiseKey, Sampling};
use crate::{Error, Result};
use std::time::Instant;
use tch::Tensor;

/// Options of one generation.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
    /// Token selection rule.
    pub sampling: Sampling,
    /// Seed of the counter-based noise.
    pub seed: u64,
    /// Stop after emitting any of these.
    pub stop_tokens: Vec<i64>,
    /// Execution policy.
    pub policy: ExecPolicy,
}

/// A finished generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Generated token ids (the prompt excluded).
    pub tokens: Vec<i64>,
    /// Seconds spent in the prompt forward.
    pub prefill_secs: f64,
    /// Seconds spent generating after the prompt.
    pub decode_secs: f64,
}

/// Fail on NaN/inf logits with a clear message.
pub fn check_finite(logits: &Tensor, what: &str) -> Result<()> {
    if logits.f_isfinite()?.f_all()?.f_int64_value(&[])? == 0 {
        return Err(Error::NonFinite(format!(
            "non-finite logits during {what} (dtype overflow? try --dtype fp32 or bf16)"
        )));
    }
    Ok(())
}

/// Prompt and new tokens must fit the model's positions (before anything is computed).
fn check_length(model: &Decoder, prompt: &[i64], opts: &GenerateOptions) -> Result<()> {
    model.check_context(
        prompt.len().saturating_add(opts.max_new_tokens),
        &format!(
            "generation ({} prompt + {} new tokens)",
            prompt.len(),
            opts.max_new_tokens
        ),
    )
}

fn key(opts: &GenerateOptions, step: usize) -> NoiseKey {
    NoiseKey {
        step: step as u64,
        ..NoiseKey::rollout(opts.seed, 0)
    }
}

/// Generate with the KV cache: one prefill, then one decode step per token.
pub fn generate(model: &Decoder, prompt: &[i64], opts: &GenerateOptions) -> Result<Generation> {
    if prompt.is_empty() {
        return Err(Error::Spec("empty prompt".into()));
    }
    check_length(model, prompt, opts)?;
    let start = Instant::now();
    let mut cache = model.new_cache(1, (prompt.len() + opts.max_new_tokens) as i64)?;
    let ids = Tensor::f_from_slice(prompt)?.f_view([1, -1])?;
    let mut logits = model.forward(&ids, &mut cache, &opts.policy, &LogitsAt::Last)?;
    let prefill_secs = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let mut tokens = Vec::new();
    for step in 0..opts.max_new_tokens {
        let row = logits.f_view([1, -1])?;
        check_finite(&row, "generation")?;
        let next = sampling::select(&row, opts.sampling, &[key(opts, step)], model.sampler())?[0];
        tokens.push(next);
        if opts.stop_tokens.contains(&next) || step + 1 == opts.max_new_tokens {
            break;
        }
        let ids = Tensor::f_from_slice(&[next])?.f_view([1, 1])?;
        logits = model.forward(&ids, &mut cache, &opts.policy, &LogitsAt::Last)?;
    }
    Ok(Generation {
        tokens,
        prefill_secs,
        decode_secs: start.elapsed().as_secs_f64(),
    })
}

/// Generate without a cache: every step is a full forward over prompt and generated tokens.
pub fn generate_nocache(
    model: &Decoder,
    prompt: &[i64],
    opts: &GenerateOptions,
) -> Result<Generation> {
    if prompt.is_empty() {
        return Err(Error::Spec("empty prompt".into()));
    }
    check_length(model, prompt, opts)?;
    let start = Instant::now();
    let mut seq = prompt.to_vec();
    let mut tokens = Vec::new();
    for step in 0..opts.max_new_tokens {
        let ids = Tensor::f_from_slice(&seq)?.f_view([1, -1])?;
        let mut cache = model.new_cache(1, seq.len() as i64)?;
        let logits = model
            .forward(&ids, &mut cache, &opts.policy, &LogitsAt::Last)?
            .f_view([1, -1])?;
        check_finite(&logits, "generation")?;
        let next =
            sampling::select(&logits, opts.sampling, &[key(opts, step)], model.sampler())?[0];
        tokens.push(next);
        seq.push(next);
        if opts.stop_tokens.contains(&next) {
            break;
        }
    }
    Ok(Generation {
        tokens,
        prefill_secs: 0.0,
        decode_secs: start.elapsed().as_secs_f64(),
    })
}
