//! Masked rows under every engine mode: a batch whose rows carry masked (dropped) positions,
//! as a compressed transfer leaves them, must decode bitwise the same in the eager mode and
//! in a static or graph mode whose step was captured on a batch with no masked row, the
//! masked rows refilled into it afterwards.
//!
//! The check compares the eager decode of the masked rows with the other mode's, tokens and
//! every KV position bitwise. Its control refills the same rows without their masks: those
//! rows must decode differently from the masked eager ones, or the check could not see a mode
//! that ignores masks.
use super::engine::{EngineMode, EngineStats};
use super::stepper::Stepper;
use crate::exec::ExecPolicy;
use crate::kv_cache::{KvCache, Snapshot};
use crate::model::{Decoder, LogitsAt};
use crate::sampling::{NoiseKey, Sampling};
use crate::{Error, Result};
use tch::Tensor;

/// Sizes of the masked-refill check.
#[derive(Debug, Clone, Copy)]
pub struct MaskCheckOptions {
    /// Rows in the batch.
    pub rows: usize,
    /// Prompt tokens per row (random ids, rows of different lengths).
    pub prompt: usize,
    /// Positions masked per row (spread over the prompt, the first kept as a sink).
    pub masked: usize,
    /// Steps decoded on the unmasked batch before the refill (the capture happens here).
    pub warm_steps: usize,
    /// Greedy steps decoded after the refill and compared.
    pub steps: usize,
    /// Seed of the prompt tokens.
    pub seed: u64,
}

impl Default for MaskCheckOptions {
    fn default() -> Self {
        MaskCheckOptions {
            rows: 4,
            prompt: 40,
            masked: 12,
            warm_steps: 2,
            steps: 12,
            seed: 7,
        }
    }
}

/// The outcome of [`run`].
#[derive(Debug, Clone)]
pub struct MaskCheck {
    /// The mode compared with eager (`Auto` resolved).
    pub mode: EngineMode,
    /// Rows whose tokens and KV agree bitwise between eager and `mode`, masks refilled.
    pub rows_equal: usize,
    /// Rows in the batch.
    pub rows: usize,
    /// Control: rows refilled without masks whose decode differs from the masked eager one.
    pub control_rows_differ: usize,
    /// CUDA graphs captured by the `mode` batch (0 outside the graph mode).
    pub captures: u64,
}

impl MaskCheck {
    /// Masks honoured (every row equal) and the control able to fail (every row differs).
    pub fn passed(&self) -> bool {
        self.rows_equal == self.rows && self.control_rows_differ == self.rows
    }
}

/// A batch's decode: per row, its tokens and the fingerprint of the KV it ends with.
struct Decoded {
    tokens: Vec<Vec<i64>>,
    kv: Vec<(i64, [u8; 32])>,
}

/// Prefill `rows` random prompts of different lengths into one source cache.
fn prompts(model: &Decoder, policy: &ExecPolicy, o: &MaskCheckOptions) -> Result<KvCache> {
    let vocab = model.config().vocab_size as u64;
    let mut state = o.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % vocab) as i64
    };
    let lens: Vec<usize> = (0..o.rows).map(|r| o.prompt - r % 3).collect();
    let mut src = model.new_cache(o.rows, o.prompt as i64)?;
    let mut one = model.new_cache(1, o.prompt as i64)?;
    for (r, &n) in lens.iter().enumerate() {
        let ids: Vec<i64> = (0..n).map(|_| next()).collect();
        one.truncate(&[0])?;
        let _ = model.forward(
            &Tensor::f_from_slice(&ids)?.f_view([1, -1])?,
            &mut one,
            policy,
            &LogitsAt::Last,
        )?;
        src.load_row(
            r,
            &one,
            Snapshot {
                row: 0,
                len: n as i64,
            },
        )?;
    }
    Ok(src)
}

/// Mask `o.masked` positions of every row of a copy of `src`, spread over `1..len − 1`.
fn masked_copy(src: &KvCache, o: &MaskCheckOptions) -> Result<KvCache> {
    let parts: Vec<(&KvCache, Snapshot)> = (0..src.batch())
        .map(|r| {
            (
                src,
                Snapshot {
                    row: r,
                    len: src.lens()[r],
                },
            )
        })
        .collect();
    let mut out = KvCache::gather(&parts, 0)?;
    for r in 0..out.batch() {
        let len = out.lens()[r];
        let stride = ((len - 2) / o.masked as i64).max(1);
        let positions: Vec<i64> = (0..o.masked as i64)
            .map(|i| 1 + i * stride + (r as i64 % stride))
            .filter(|&p| p < len - 1)
            .collect();
        out.mask_positions(r, &positions)?;
    }
    Ok(out)
}

/// Decode `steps` greedy tokens from every row of `start`, in `mode`. With `warm` set, the
/// batch is first built from `warm` (unmasked), stepped `warm_steps` times, and `start`'s rows
/// are then refilled into it; otherwise it is built from `start` directly.
fn decode(
    model: &Decoder,
    policy: ExecPolicy,
    mode: EngineMode,
    start: &KvCache,
    warm: Option<&KvCache>,
    o: &MaskCheckOptions,
) -> Result<(Decoded, u64)> {
    let snaps = |c: &KvCache| -> Vec<Snapshot> {
        (0..c.batch())
            .map(|r| Snapshot {
                row: r,
                len: c.lens()[r],
            })
            .collect()
    };
    let capacity = (o.prompt + o.warm_steps + o.steps + 8) as i64;
    let first = warm.unwrap_or(start);
    let parts: Vec<(&KvCache, Snapshot)> = snaps(first).into_iter().map(|s| (first, s)).collect();
    let mut stepper = Stepper::with_capacity(
        model,
        policy,
        Sampling::Greedy,
        mode,
        &parts,
        o.warm_steps + o.steps,
        capacity,
        0,
    )?;
    let keys: Vec<NoiseKey> = (0..o.rows)
        .map(|r| NoiseKey {
            seed: o.seed,
            problem: r as u64,
            pivot: 0,
            branch: 0,
            sample: 0,
            step: 0,
        })
        .collect();
    if warm.is_some() {
        let mut feed = vec![1i64; o.rows];
        for _ in 0..o.warm_steps {
            feed = stepper.step(&feed, &keys)?;
        }
        for (r, s) in snaps(start).into_iter().enumerate() {
            stepper.load_row(r, start, s)?;
        }
    }
    let mut feed = vec![1i64; o.rows];
    let mut tokens = vec![Vec::with_capacity(o.steps); o.rows];
    for _ in 0..o.steps {
        feed = stepper.step(&feed, &keys)?;
        for (r, &t) in feed.iter().enumerate() {
            tokens[r].push(t);
        }
    }
    let cache = stepper.cache();
    let kv = (0..o.rows)
        .map(|r| {
            let len = cache.lens()[r];
            Ok((len, cache.fingerprint(Snapshot { row: r, len })?))
        })
        .collect::<Result<_>>()?;
    let mut stats = EngineStats::default();
    stepper.report(&mut stats);
    Ok((Decoded { tokens, kv }, stats.graph_captures))
}

/// Whether row `r` decoded bitwise alike in `a` and `b`: tokens and every KV position.
fn same_row(a: &Decoded, b: &Decoded, r: usize) -> bool {
    a.tokens[r] == b.tokens[r] && a.kv[r] == b.kv[r]
}

/// Run the masked-refill check of `mode` against eager on `model` under `policy` (`Auto`:
/// graph where it can capture, static on the CPU).
pub fn run(
    model: &Decoder,
    policy: ExecPolicy,
    mode: EngineMode,
    o: &MaskCheckOptions,
) -> Result<MaskCheck> {
    if o.rows == 0 || o.prompt < 8 || o.masked == 0 || o.masked * 2 > o.prompt || o.steps == 0 {
        return Err(Error::Spec(
            "mask check needs rows >= 1, prompt >= 8, 1 <= masked <= prompt / 2, steps >= 1".into(),
        ));
    }
    let mode = match mode {
        EngineMode::Auto if !model.device().is_cuda() => EngineMode::Static,
        m => m.resolve(model.device()),
    };
    if mode == EngineMode::Eager {
        return Err(Error::Spec(
            "the mask check compares a static or graph mode with eager; pick one of those".into(),
        ));
    }
    let _guard = tch::no_grad_guard();
    let src = prompts(model, &policy, o)?;
    let masked = masked_copy(&src, o)?;
    let (eager, _) = decode(model, policy, EngineMode::Eager, &masked, None, o)?;
    let (other, captures) = decode(model, policy, mode, &masked, Some(&src), o)?;
    let (control, _) = decode(model, policy, mode, &src, Some(&src), o)?;
    let mut check = MaskCheck {
        mode,
        rows_equal: 0,
        rows: o.rows,
        control_rows_differ: 0,
        captures,
    };
    for r in 0..o.rows {
        check.rows_equal += usize::from(same_row(&eager, &other, r));
        check.control_rows_differ += usize::from(!same_row(&eager, &control, r));
    }
    Ok(check)
}
