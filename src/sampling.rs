//! Token selection with counter-based noise.
//!
//! Sampling is Gumbel-max: `argmax(logits / T + g)`, where the Gumbel noise `g` for vocabulary
//! entry `v` is a hash of a per-row [`NoiseKey`] and `v`, computed on the device with integer
//! ops. The noise is therefore a function of the key only, never of a row's position in the
//! batch or of the batch size, and the choice is exact given bitwise-equal logits.
//!
//! Two [`Sampler`]s draw the token: the ATen reference (the noise as `[B, V]` tensors, about
//! thirty passes over int64/fp64 data) and, on CUDA, the fused kernels of
//! `kernels/sampling.cu` (two launches), which choose bitwise the same token;
//! [`check_fused`] verifies that on the device, with a negative control. The choice travels
//! as a value: the run's [`crate::ExecSettings::sampler`], resolved by [`Sampler::resolve`],
//! is held by the decoder ([`crate::Decoder::sampler`]) and handed to each selection.
use crate::nvrtc::{Arg, Kernel};
use crate::{Error, Result};
use tch::{Device, Kind, Tensor};

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Sampling {
    /// Highest logit (lowest index on ties).
    Greedy,
    /// Sample from `softmax(logits / temperature)`.
    Temperature {
        /// Softmax temperature (> 0).
        temperature: f64,
    },
    /// Nucleus sampling: sample from `softmax(logits / temperature)` restricted to the
    /// smallest set of most probable tokens whose probability reaches `top_p`.
    TopP {
        /// Cumulative probability kept, in (0, 1].
        top_p: f64,
        /// Softmax temperature (> 0).
        temperature: f64,
    },
}

impl Sampling {
    /// The rule for a spec's or flag's temperature: 0 means greedy, anything above samples.
    pub fn from_temperature(temperature: f64) -> Sampling {
        if temperature > 0.0 {
            Sampling::Temperature { temperature }
        } else {
            Sampling::Greedy
        }
    }
}

/// Identifies one draw: a campaign seed and the coordinates of the token being drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NoiseKey {
    /// Campaign (or run) seed.
    pub seed: u64,
    /// Problem index.
    pub problem: u64,
    /// Pivot position (0 for rollouts).
    pub pivot: u64,
    /// Branch (0 = original token, 1.. = alternatives; rollouts use `u64::MAX`).
    pub branch: u64,
    /// Continuation sample index.
    pub sample: u64,
    /// Step within the continuation.
    pub step: u64,
}

impl NoiseKey {
    /// The key of step 0 of a rollout (or plain generation) of `problem` under `seed`:
    /// pivot 0, branch `u64::MAX`, sample 0.
    pub fn rollout(seed: u64, problem: u64) -> NoiseKey {
        NoiseKey {
            seed,
            problem,
            pivot: 0,
            branch: u64::MAX,
            sample: 0,
            step: 0,
        }
    }
}

impl NoiseKey {
    /// The key of step 0 of a divergence-study generation of `problem` under `seed` with the
    /// spec's strategy number `strategy` (pivot `u64::MAX − 1` keeps it apart from system A's
    /// keys). Cache-ON and cache-OFF draw with the same key: identical logits, identical token.
    pub fn divergence(seed: u64, problem: u64, strategy: u64) -> NoiseKey {
        NoiseKey {
            seed,
            problem,
            pivot: u64::MAX - 1,
            branch: strategy,
            sample: 0,
            step: 0,
        }
    }
}

/// SplitMix64's output function: a 64-bit bijective mixer (Steele, Lea & Flood 2014).
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl NoiseKey {
    /// 64-bit digest of the key.
    pub fn digest(&self) -> u64 {
        [
            self.problem,
            self.pivot,
            self.branch,
            self.sample,
            self.step,
        ]
        .iter()
        .fold(splitmix64(self.seed), |acc, &x| {
            splitmix64(acc ^ splitmix64(x))
        })
    }
}

const MASK32: i64 = 0xFFFF_FFFF;

/// `lowbias32` integer hash on int64 tensors holding 32-bit values.
fn hash32(x: &Tensor) -> Result<Tensor> {
    let x = x.f_bitwise_xor_tensor(&x.f_bitwise_right_shift_tensor_scalar(16)?)?;
    let x = x.f_mul_scalar(0x7feb_352d_i64)?.f_bitwise_and(MASK32)?;
    let x = x.f_bitwise_xor_tensor(&x.f_bitwise_right_shift_tensor_scalar(15)?)?;
    let x = x.f_mul_scalar(0x846c_a68b_i64)?.f_bitwise_and(MASK32)?;
    Ok(x.f_bitwise_xor_tensor(&x.f_bitwise_right_shift_tensor_scalar(16)?)?)
}

/// The key digests as `[hi₀ … hi_{B−1}, lo₀ … lo_{B−1}]`: the two 32-bit halves of each
/// row's [`NoiseKey::digest`], the host-side input of [`gumbel_noise_from`].
pub fn noise_words(keys: &[NoiseKey]) -> Vec<i64> {
    let digests: Vec<u64> = keys.iter().map(NoiseKey::digest).collect();
    digests
        .iter()
        .map(|d| (d >> 32) as i64)
        .chain(digests.iter().map(|d| (d & 0xFFFF_FFFF) as i64))
        .collect()
}

/// Gumbel noise `[B, V]` (fp32) for the given keys.
pub fn gumbel_noise(keys: &[NoiseKey], vocab: i64, device: Device) -> Result<Tensor> {
    gumbel_noise_from(&key_words(keys, device)?, vocab)
}

/// The key words `[2, B, 1]` ([`noise_words`]) of `keys` on `device`.
fn key_words(keys: &[NoiseKey], device: Device) -> Result<Tensor> {
    let b = keys.len() as i64;
    Ok(Tensor::f_from_slice(&noise_words(keys))?
        .f_to_device(device)?
        .f_view([2, b, 1])?)
}

/// Gumbel noise `[B, V]` (fp32) from device-resident key words `[2, B, 1]` (see
/// [`noise_words`]): device ops only, so it can be captured in a CUDA graph.
pub fn gumbel_noise_from(words: &Tensor, vocab: i64) -> Result<Tensor> {
    let (hi, lo) = (words.f_get(0)?, words.f_get(1)?);
    let v = Tensor::f_arange(vocab, (Kind::Int64, words.device()))?.f_view([1, vocab])?;
    let h = hash32(&hash32(&v.f_bitwise_xor_tensor(&lo)?)?.f_bitwise_xor_tensor(&hi)?)?;
    let u = h
        .f_to_kind(Kind::Double)?
        .f_add_scalar(0.5)?
        .f_div_scalar(4_294_967_296.0)?;
    Ok(u.f_log()?
        .f_neg()?
        .f_log()?
        .f_neg()?
        .f_to_kind(Kind::Float)?)
}

/// The vocabulary size `V` of `[B, V]` logits (an error, not a panic, for a 1-D tensor).
fn vocab_of(logits: &Tensor) -> Result<i64> {
    let shape = logits.size();
    shape.get(1).copied().ok_or_else(|| {
        Error::Invariant(format!("sampling needs [B, V] logits, got shape {shape:?}"))
    })
}

/// Which implementation adds the Gumbel noise and takes the argmax of a sampled step. Both
/// choose bitwise the same token given the same logits and keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Sampler {
    /// ATen ops: the noise as `[B, V]` tensors, then add and argmax (any device; the reference).
    Aten,
    /// `kernels/sampling.cu` compiled with NVRTC: noise, add and argmax fused (CUDA only).
    Fused,
}

impl Sampler {
    /// Parse `aten` or `fused`.
    pub fn parse(s: &str) -> Result<Sampler> {
        match s {
            "aten" => Ok(Sampler::Aten),
            "fused" => Ok(Sampler::Fused),
            _ => Err(Error::Spec(format!("`{s}` is not a sampler (aten, fused)"))),
        }
    }

    /// The name [`Sampler::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            Sampler::Aten => "aten",
            Sampler::Fused => "fused",
        }
    }

    /// Whether this sampler can run on `device`.
    pub fn check_device(self, device: Device) -> Result<()> {
        if self == Sampler::Fused && !crate::nvrtc::available(device) {
            return Err(Error::Spec(format!(
                "the fused sampler needs a CUDA device and a binary built with the C++ shim (device {device:?})"
            )));
        }
        Ok(())
    }

    /// The sampler that runs on `device` when `asked` (`None`: the device's default): the one
    /// asked for, else fused where it can run, else ATen.
    pub fn resolve(asked: Option<Sampler>, device: Device) -> Sampler {
        match asked {
            Some(s) => s,
            None if crate::nvrtc::available(device) => Sampler::Fused,
            None => Sampler::Aten,
        }
    }
}

const SAMPLING_SOURCE: &str = include_str!("../kernels/sampling.cu");
/// Vocabulary entries per block of `kvc_gumbel_partial` (`KVC_SLICE`).
const FUSED_SLICE: i64 = 256 * 16;

/// The fused kernels' (scaled logits `[B, V]` fp32, key words) sizes, checked.
fn fused_dims(x: &Tensor, words: &Tensor) -> Result<(i64, i64)> {
    let v = vocab_of(x)?;
    let b = x.size()[0];
    if x.dim() != 2 || words.numel() != 2 * b as usize || words.kind() != Kind::Int64 {
        return Err(Error::Invariant(format!(
            "fused sampler: logits {:?} and key words {:?} ({:?}) do not match",
            x.size(),
            words.size(),
            words.kind()
        )));
    }
    if v > i64::from(i32::MAX) || b > i64::from(i32::MAX) {
        return Err(Error::Invariant(format!(
            "fused sampler: [{b}, {v}] is too large"
        )));
    }
    Ok((b, v))
}

/// Gumbel-max with the fused kernels: the token of each row of `scaled` (`[B, V]`, fp32).
fn fused_argmax(scaled: &Tensor, words: &Tensor) -> Result<Tensor> {
    let x = scaled.f_to_kind(Kind::Float)?.f_contiguous()?;
    let w = words.f_contiguous()?;
    let (b, v) = fused_dims(&x, &w)?;
    let dev = x.device();
    let slices = (v + FUSED_SLICE - 1) / FUSED_SLICE;
    let best_v = Tensor::f_empty([b, slices], (Kind::Float, dev))?;
    let best_i = Tensor::f_empty([b, slices], (Kind::Int64, dev))?;
    let out = Tensor::f_empty([b], (Kind::Int64, dev))?;
    let grid = |n: i64| {
        u32::try_from(n).map_err(|_| Error::Invariant(format!("fused sampler: {n} blocks")))
    };
    Kernel::get(dev, SAMPLING_SOURCE, &[], "kvc_gumbel_partial")?.launch(
        grid(b * slices)?,
        256,
        &[
            Arg::Ptr(x.data_ptr()),
            Arg::Ptr(w.data_ptr()),
            Arg::I32(b as i32),
            Arg::I32(v as i32),
            Arg::I32(slices as i32),
            Arg::Ptr(best_v.data_ptr()),
            Arg::Ptr(best_i.data_ptr()),
        ],
    )?;
    Kernel::get(dev, SAMPLING_SOURCE, &[], "kvc_gumbel_fold")?.launch(
        grid((b + 127) / 128)?,
        128,
        &[
            Arg::Ptr(best_v.data_ptr()),
            Arg::Ptr(best_i.data_ptr()),
            Arg::I32(b as i32),
            Arg::I32(slices as i32),
            Arg::Ptr(out.data_ptr()),
        ],
    )?;
    Ok(out)
}

/// The noise `[B, V]` (fp32) as the fused kernels compute it, for key words on a CUDA device;
/// `control` takes the logs in fp32 instead (a negative control that must differ).
pub fn gumbel_noise_fused(words: &Tensor, vocab: i64, control: bool) -> Result<Tensor> {
    let w = words.f_contiguous()?;
    let b = w.numel() as i64 / 2;
    let out = Tensor::f_empty([b, vocab], (Kind::Float, w.device()))?;
    fused_dims(&out, &w)?;
    let options = if control {
        vec!["-DKVC_NOISE_F32=1".to_string()]
    } else {
        vec![]
    };
    let blocks = u32::try_from(((b * vocab + 255) / 256).min(65_536)).unwrap_or(65_536);
    Kernel::get(w.device(), SAMPLING_SOURCE, &options, "kvc_gumbel_noise")?.launch(
        blocks,
        256,
        &[
            Arg::Ptr(w.data_ptr()),
            Arg::I32(b as i32),
            Arg::I32(vocab as i32),
            Arg::Ptr(out.data_ptr()),
        ],
    )?;
    Ok(out)
}

/// Gumbel-max of `scaled` logits (`[B, V]`, fp32) by `sampler`.
fn gumbel_argmax(scaled: &Tensor, words: &Tensor, sampler: Sampler) -> Result<Tensor> {
    match sampler {
        Sampler::Aten => {
            let noise = gumbel_noise_from(words, vocab_of(scaled)?)?;
            Ok(scaled.f_add(&noise)?.f_argmax(-1, false)?)
        }
        Sampler::Fused => {
            Sampler::Fused.check_device(scaled.device())?;
            fused_argmax(scaled, words)
        }
    }
}

/// What [`check_fused`] compared, bitwise.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplerCheck {
    /// Noise elements compared (`rows × vocab`).
    pub noise_elements: i64,
    /// Fused noise elements whose bits differ from the reference's.
    pub noise_mismatches: i64,
    /// Rows whose token was drawn by both samplers (over every sampling rule checked).
    pub token_rows: i64,
    /// Rows where the two samplers chose different tokens.
    pub token_mismatches: i64,
    /// Noise elements of the negative control (logs in fp32) that differ from the reference:
    /// must be above zero, or the comparison could not see a change of rounding.
    pub control_mismatches: i64,
}

impl SamplerCheck {
    /// Bitwise agreement, and a negative control that the comparison caught.
    pub fn passed(&self) -> bool {
        self.noise_mismatches == 0 && self.token_mismatches == 0 && self.control_mismatches > 0
    }
}

/// Compare the fused sampler with the ATen reference on `device` (CUDA), bitwise: the noise of
/// `rows` keys over `vocab` entries, and the tokens both choose from random `[rows, vocab]`
/// logits (with ties, `-inf`, a NaN row) under temperature 1, 0.7 and top-p 0.9.
pub fn check_fused(device: Device, rows: i64, vocab: i64, seed: u64) -> Result<SamplerCheck> {
    Sampler::Fused.check_device(device)?;
    let _guard = tch::no_grad_guard();
    let keys: Vec<NoiseKey> = (0..rows as u64)
        .map(|r| NoiseKey {
            seed,
            problem: r % 7,
            pivot: r,
            branch: r % 3,
            sample: r % 5,
            step: r * 31,
        })
        .collect();
    let words = key_words(&keys, device)?;
    let bits = |t: &Tensor| t.f_view_dtype(Kind::Int);
    let reference = bits(&gumbel_noise_from(&words, vocab)?)?;
    let count_ne = |a: &Tensor, b: &Tensor| -> Result<i64> {
        Ok(a.f_ne_tensor(b)?.f_sum(Kind::Int64)?.f_int64_value(&[])?)
    };
    let noise_mismatches = count_ne(
        &bits(&gumbel_noise_fused(&words, vocab, false)?)?,
        &reference,
    )?;
    let control_mismatches = count_ne(
        &bits(&gumbel_noise_fused(&words, vocab, true)?)?,
        &reference,
    )?;

    tch::manual_seed(seed as i64);
    let logits = Tensor::f_randn([rows, vocab], (Kind::Float, device))?.f_mul_scalar(3.0)?;
    if rows >= 4 && vocab >= 8 {
        let _ = logits.f_get(1)?.f_fill_(0.0)?;
        let _ = logits.f_get(2)?.f_fill_(f64::NEG_INFINITY)?;
        let _ = logits
            .f_get(3)?
            .f_narrow(0, 0, vocab / 2)?
            .f_fill_(f64::NEG_INFINITY)?;
        let _ = logits.f_get(0)?.f_narrow(0, 5, 1)?.f_fill_(f64::NAN)?;
    }
    let rules = [
        Sampling::Temperature { temperature: 1.0 },
        Sampling::Temperature { temperature: 0.7 },
        Sampling::TopP {
            top_p: 0.9,
            temperature: 1.0,
        },
    ];
    let mut token_mismatches = 0;
    for rule in rules {
        let a = select_on_device(&logits, rule, &words, Sampler::Aten)?;
        let f = select_on_device(&logits, rule, &words, Sampler::Fused)?;
        token_mismatches += count_ne(&a, &f)?;
    }
    Ok(SamplerCheck {
        noise_elements: rows * vocab,
        noise_mismatches,
        token_rows: rows * rules.len() as i64,
        token_mismatches,
        control_mismatches,
    })
}

/// Choose one token per row of `logits` (`[B, V]`, any float dtype), drawing with `sampler`
/// (unused when greedy).
pub fn select(
    logits: &Tensor,
    sampling: Sampling,
    keys: &[NoiseKey],
    sampler: Sampler,
) -> Result<Vec<i64>> {
    let chosen = match sampling {
        Sampling::Greedy => logits.f_to_kind(Kind::Float)?.f_argmax(-1, false)?,
        Sampling::Temperature { .. } | Sampling::TopP { .. } => select_on_device(
            logits,
            sampling,
            &key_words(keys, logits.device())?,
            sampler,
        )?,
    };
    Ok(Vec::<i64>::try_from(chosen.f_to_device(Device::Cpu)?)?)
}

/// The chosen token of each row as a device tensor `[B]`, from device-resident key words
/// `[2, B, 1]` ([`noise_words`]; unused when greedy). Same choice as [`select`]; no host sync.
/// The noise and argmax run by `sampler`.
pub fn select_on_device(
    logits: &Tensor,
    sampling: Sampling,
    words: &Tensor,
    sampler: Sampler,
) -> Result<Tensor> {
    let logits = logits.f_to_kind(Kind::Float)?;
    Ok(match sampling {
        Sampling::Greedy => logits.f_argmax(-1, false)?,
        Sampling::Temperature { temperature } => {
            // x / 1 is x exactly: skip the pass over [B, V].
            let scaled = if temperature == 1.0 {
                logits
            } else {
                logits.f_div_scalar(temperature)?
            };
            gumbel_argmax(&scaled, words, sampler)?
        }
        Sampling::TopP { top_p, temperature } => {
            let scaled = logits.f_div_scalar(temperature)?;
            // Keep a token if the probability of the tokens sorted before it is below top_p
            // (the most probable token is always kept); the rest get -inf before Gumbel-max.
            let (sorted, order) = scaled.f_sort(-1, true)?;
            let p = sorted.f_softmax(-1, Kind::Double)?;
            let before = p.f_cumsum(-1, Kind::Double)?.f_sub(&p)?;
            let drop_sorted = before.f_ge(top_p)?;
            let drop = drop_sorted.f_scatter(-1, &order, &drop_sorted)?;
            gumbel_argmax(
                &scaled.f_masked_fill(&drop, f64::NEG_INFINITY)?,
                words,
                sampler,
            )?
        }
    })
}

/// `[B + 1]` int64 on the device: the chosen tokens ([`select_on_device`]) followed by 1 if
/// every logit is finite, else 0. One readback gives both.
pub fn select_and_check_on_device(
    logits: &Tensor,
    sampling: Sampling,
    words: &Tensor,
    sampler: Sampler,
) -> Result<Tensor> {
    let chosen = select_on_device(logits, sampling, words, sampler)?;
    let finite = logits
        .f_isfinite()?
        .f_all()?
        .f_to_kind(Kind::Int64)?
        .f_view([1])?;
    Ok(Tensor::f_cat(&[chosen, finite], 0)?)
}

/// [`select_and_check_on_device`] read back: the chosen tokens and whether every logit was
/// finite, with a single device→host copy.
pub fn select_checked(
    logits: &Tensor,
    sampling: Sampling,
    words: &Tensor,
    sampler: Sampler,
) -> Result<(Vec<i64>, bool)> {
    let both = select_and_check_on_device(logits, sampling, words, sampler)?;
    split_checked(&both)
}

/// Split the output of [`select_and_check_on_device`] after copying it to the host.
pub fn split_checked(both: &Tensor) -> Result<(Vec<i64>, bool)> {
    let mut v = Vec::<i64>::try_from(both.f_to_device(Device::Cpu)?)?;
    let finite = v.pop() == Some(1);
    Ok((v, finite))
}

/// Per-row facts about a step's distribution (temperature 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepInfo {
    /// Log-probability of the chosen token.
    pub logprob: f64,
    /// `p(top1) − p(top2)`.
    pub margin: f64,
    /// Most probable token.
    pub top1: i64,
    /// Second most probable token.
    pub top2: i64,
    /// Log-probability of the most probable token that is not the chosen one.
    pub runner_up_logprob: f64,
}

/// Log-probability, top-2 margin and runner-up of each row for the chosen tokens.
pub fn step_info(logits: &Tensor, chosen: &[i64]) -> Result<Vec<StepInfo>> {
    let logp = logits
        .f_to_kind(Kind::Float)?
        .f_log_softmax(-1, Kind::Float)?;
    let (top, idx) = logp.f_topk(2, -1, true, true)?;
    let top: Vec<f32> = Vec::try_from(top.f_to_device(Device::Cpu)?.f_reshape([-1])?)?;
    let idx: Vec<i64> = Vec::try_from(idx.f_to_device(Device::Cpu)?.f_reshape([-1])?)?;
    let ch = Tensor::f_from_slice(chosen)?
        .f_to_device(logp.device())?
        .f_view([-1, 1])?;
    let lp: Vec<f32> = Vec::try_from(
        logp.f_gather(1, &ch, false)?
            .f_to_device(Device::Cpu)?
            .f_reshape([-1])?,
    )?;
    Ok(chosen
        .iter()
        .enumerate()
        .map(|(r, &c)| {
            let (l1, l2) = (top[2 * r] as f64, top[2 * r + 1] as f64);
            let (t1, t2) = (idx[2 * r], idx[2 * r + 1]);
            StepInfo {
                logprob: lp[r] as f64,
                margin: l1.exp() - l2.exp(),
                top1: t1,
                top2: t2,
                runner_up_logprob: if c == t1 { l2 } else { l1 },
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(step: u64) -> NoiseKey {
        NoiseKey {
            seed: 7,
            problem: 3,
            pivot: 11,
            branch: 1,
            sample: 2,
            step,
        }
    }

    #[test]
    fn noise_depends_on_key_not_batch_position() -> Result<()> {
        let a = gumbel_noise(&[key(0), key(1), key(2)], 50, Device::Cpu)?;
        let b = gumbel_noise(&[key(2), key(0)], 50, Device::Cpu)?;
        assert!(a.get(0).equal(&b.get(1)));
        assert!(a.get(2).equal(&b.get(0)));
        assert!(!a.get(0).equal(&a.get(1)));
        Ok(())
    }

    #[test]
    fn malformed_inputs_are_errors_not_panics() -> Result<()> {
        let keys = [key(0), key(1)];
        let words = key_words(&keys, Device::Cpu)?;
        // Positive control: well-formed words give the noise of the keys.
        assert!(gumbel_noise_from(&words, 5)?.equal(&gumbel_noise(&keys, 5, Device::Cpu)?));
        // Words without the lo half: indexing them fails inside libtorch.
        let bad = words.narrow(0, 0, 1);
        assert!(gumbel_noise_from(&bad, 5).is_err());
        let logits = Tensor::from_slice(&[0.0f32, 1.0, 2.0, 0.5, 0.0, 1.0]).view([2, 3]);
        let t = Sampling::Temperature { temperature: 0.5 };
        let aten = Sampler::Aten;
        assert_eq!(select_on_device(&logits, t, &words, aten)?.size(), [2]);
        assert!(select_on_device(&logits, t, &bad, aten).is_err());
        // 1-D logits have no vocabulary axis.
        let err = select(&logits.get(0), t, &keys[..1], aten)
            .unwrap_err()
            .to_string();
        assert!(err.contains("[B, V]") && !err.contains('\n'), "{err}");
        // A chosen token outside the vocabulary.
        assert!(step_info(&logits, &[1, 2]).is_ok());
        assert!(step_info(&logits, &[1, 3]).is_err());
        Ok(())
    }

    #[test]
    fn samplers_parse_and_resolve_per_device() -> Result<()> {
        assert_eq!(Sampler::parse("aten")?, Sampler::Aten);
        assert_eq!(Sampler::parse("fused")?, Sampler::Fused);
        for s in [Sampler::Aten, Sampler::Fused] {
            assert_eq!(Sampler::parse(s.name())?, s);
        }
        let err = Sampler::parse("gumbel").unwrap_err().to_string();
        assert!(err.contains("aten, fused") && !err.contains('\n'), "{err}");
        // The fused kernels need CUDA: refused on the CPU, in one line.
        let err = Sampler::Fused
            .check_device(Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(err.contains("CUDA") && !err.contains('\n'), "{err}");
        assert!(Sampler::Aten.check_device(Device::Cpu).is_ok());
        assert!(check_fused(Device::Cpu, 4, 16, 0).is_err());
        // The device's default is ATen on the CPU; a sampler asked for is kept.
        assert_eq!(Sampler::resolve(None, Device::Cpu), Sampler::Aten);
        for s in [Sampler::Aten, Sampler::Fused] {
            assert_eq!(Sampler::resolve(Some(s), Device::Cpu), s);
            assert_eq!(Sampler::resolve(Some(s), Device::Cuda(0)), s);
        }
        assert_eq!(
            Sampler::resolve(None, Device::Cuda(0)),
            if crate::cuda_graph::compiled() {
                Sampler::Fused
            } else {
                Sampler::Aten
            }
        );
        // The fused sampler on the CPU fails cleanly (no kernel to run), and greedy selection
        // does not need a sampler at all.
        let logits = Tensor::from_slice(&[0.0f32, 1.0, 2.0]).view([1, 3]);
        let t = Sampling::Temperature { temperature: 1.0 };
        let err = select(&logits, t, &[key(0)], Sampler::Fused)
            .unwrap_err()
            .to_string();
        assert!(err.contains("CUDA") && !err.contains('\n'), "{err}");
        assert_eq!(
            select(&logits, Sampling::Greedy, &[key(0)], Sampler::Fused)?,
            [2]
        );
        assert!(select(&logits, t, &[key(0)], Sampler::Aten).is_ok());
        Ok(())
    }

    #[test]
    fn gumbel_sampling_follows_the_distribution() -> Result<()> {
        let logits = Tensor::from_slice(&[0.0f32, 1.0, 2.0]).view([1, 3]);
        let mut counts = [0usize; 3];
        for s in 0..3000 {
            let k = NoiseKey {
                sample: s,
                ..key(0)
            };
            counts[select(
                &logits,
                Sampling::Temperature { temperature: 1.0 },
                &[k],
                Sampler::Aten,
            )?[0] as usize] += 1;
        }
        let p2 = counts[2] as f64 / 3000.0;
        // softmax([0,1,2])[2] = 0.665; 3000 draws give sd 0.009.
        assert!((p2 - 0.665).abs() < 0.04, "{counts:?}");
        Ok(())
    }

    #[test]
    fn top_p_samples_only_inside_the_nucleus() -> Result<()> {
        // softmax([0, 1, 2]) = [0.090, 0.245, 0.665].
        let logits = Tensor::from_slice(&[0.0f32, 1.0, 2.0]).view([1, 3]);
        let mut counts = [[0usize; 3]; 2];
        for s in 0..500 {
            let k = [NoiseKey {
                sample: s,
                ..key(0)
            }];
            for (i, top_p) in [0.5, 0.8].into_iter().enumerate() {
                let t = select(
                    &logits,
                    Sampling::TopP {
                        top_p,
                        temperature: 1.0,
                    },
                    &k,
                    Sampler::Aten,
                )?[0];
                counts[i][t as usize] += 1;
            }
        }
        assert_eq!(counts[0], [0, 0, 500], "top_p 0.5 keeps only the top token");
        assert_eq!(counts[1][0], 0, "{counts:?}");
        assert!(counts[1][1] > 100 && counts[1][2] > 250, "{counts:?}");
        Ok(())
    }

    #[test]
    fn step_info_reports_margin_and_runner_up() -> Result<()> {
        let logits = Tensor::from_slice(&[0.0f32, 2.0, 1.0]).view([1, 3]);
        let info = step_info(&logits, &[1])?[0];
        assert_eq!((info.top1, info.top2), (1, 2));
        let z = 1.0 + 2f64.exp() + 1f64.exp();
        assert!((info.margin - (2f64.exp() - 1f64.exp()) / z).abs() < 1e-6);
        let info = step_info(&logits, &[2])?[0];
        assert!((info.runner_up_logprob - (2.0 - z.ln())).abs() < 1e-6);
        Ok(())
    }
}
