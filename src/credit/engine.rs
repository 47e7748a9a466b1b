//! The continuation engine: many continuations, each resumed from its own KV snapshot with a
//! forced first (branch) token, decoded together in batches of a given schedule.
//!
//! A schedule is the order in which jobs are taken and the batch size. Rows that finish are
//! dropped from the batch once at least half of it has finished; that compaction is part of
//! the schedule, so the same schedule always runs the same batches.
use crate::exec::ExecPolicy;
use crate::generate::check_finite;
use crate::kv_cache::{KvCache, Snapshot};
use crate::model::{Decoder, LogitsAt};
use crate::sampling::{self, NoiseKey, Sampling};
use crate::{Error, Result};
use tch::Tensor;

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// An end-of-sequence token was generated (it is the last token).
    Eos,
    /// The token cap was reached.
    Length,
    /// A text stop sequence appeared.
    Text,
}

impl Stop {
    /// The reason's name in records.
    pub fn as_str(self) -> &'static str {
        match self {
            Stop::Eos => "eos",
            Stop::Length => "length",
            Stop::Text => "text",
        }
    }
}

/// Where a continuation starts: a snapshot of some cache, with the fingerprint that snapshot
/// had at decode time when it must be verified.
pub struct Start<'a> {
    /// Cache holding the prefix.
    pub cache: &'a KvCache,
    /// Row and length of the prefix.
    pub snap: Snapshot,
    /// Decode-time fingerprint to verify against, if any.
    pub expect: Option<[u8; 32]>,
}

/// One continuation to run.
pub struct Job<'a> {
    /// Its starting state.
    pub start: Start<'a>,
    /// Token fed first (the branch token).
    pub first_token: i64,
    /// Noise key of its first sampled token; `step` counts up from there.
    pub key: NoiseKey,
}

/// The tokens a continuation produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Sampled tokens after the branch token.
    pub tokens: Vec<i64>,
    /// Why it stopped.
    pub stop: Stop,
}

/// Fixed settings of a pass's decoding.
pub struct Decoding<'a> {
    /// The model.
    pub model: &'a Decoder,
    /// Execution policy.
    pub policy: ExecPolicy,
    /// Token selection rule.
    pub sampling: Sampling,
    /// Tokens to sample at most per continuation.
    pub max_new_tokens: usize,
    /// End-of-sequence tokens.
    pub stop_tokens: &'a [i64],
    /// Text stop test on the tokens so far (checked every few steps), if any.
    pub text_stop: Option<&'a dyn Fn(&[i64]) -> bool>,
}

/// Fingerprint checks made while starting continuations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SnapshotChecks {
    /// Snapshots verified.
    pub checks: u64,
    /// Of those, how many matched (a mismatch is an error, so this equals `checks`).
    pub hits: u64,
}

const TEXT_STOP_EVERY: usize = 8;

/// Run `jobs` in the order `order`, `batch` at a time. Returns outcomes indexed like `jobs`.
/// `on_tokens` is told how many tokens each step produced.
pub fn run(
    dec: &Decoding,
    jobs: &[Job],
    order: &[usize],
    batch: usize,
    on_tokens: &mut dyn FnMut(u64),
) -> Result<(Vec<Outcome>, SnapshotChecks)> {
    let mut out: Vec<Option<Outcome>> = vec![None; jobs.len()];
    let mut checks = SnapshotChecks::default();
    for chunk in order.chunks(batch.max(1)) {
        let parts: Vec<(&KvCache, Snapshot)> = chunk
            .iter()
            .map(|&j| (jobs[j].start.cache, jobs[j].start.snap))
            .collect();
        let mut cache = KvCache::gather(&parts, dec.max_new_tokens as i64 + 1)?;
        for (row, &j) in chunk.iter().enumerate() {
            if let Some(expect) = jobs[j].start.expect {
                checks.checks += 1;
                let got = cache.fingerprint(Snapshot {
                    row,
                    len: jobs[j].start.snap.len,
                })?;
                if got != expect {
                    return Err(Error::Invariant(format!(
                        "KV fingerprint mismatch resuming snapshot of length {}: the decode-time state was not reproduced",
                        jobs[j].start.snap.len
                    )));
                }
                checks.hits += 1;
            }
        }
        for (j, o) in decode_chunk(dec, jobs, chunk, &mut cache, on_tokens)? {
            out[j] = Some(o);
        }
    }
    let outcomes = out
        .into_iter()
        .map(|o| o.ok_or_else(|| Error::Spec("a job was not scheduled".into())))
        .collect::<Result<Vec<_>>>()?;
    Ok((outcomes, checks))
}

fn decode_chunk(
    dec: &Decoding,
    jobs: &[Job],
    chunk: &[usize],
    cache: &mut KvCache,
    on_tokens: &mut dyn FnMut(u64),
) -> Result<Vec<(usize, Outcome)>> {
    // Cache row r runs job `rows[r]`; `None` marks a finished row awaiting compaction.
    let mut rows: Vec<Option<usize>> = chunk.iter().map(|&j| Some(j)).collect();
    let mut tokens: Vec<Vec<i64>> = vec![Vec::new(); jobs.len()];
    let mut done: Vec<(usize, Outcome)> = Vec::new();
    let mut feed: Vec<i64> = chunk.iter().map(|&j| jobs[j].first_token).collect();
    for step in 0..dec.max_new_tokens {
        let b = feed.len() as i64;
        let ids = Tensor::from_slice(&feed).view([b, 1]);
        let logits = dec
            .model
            .forward(&ids, cache, &dec.policy, &LogitsAt::Last)?
            .view([b, -1]);
        check_finite(&logits, "continuation decoding")?;
        // Finished rows draw with their old key; their tokens are discarded.
        let keys: Vec<NoiseKey> = rows
            .iter()
            .map(|r| {
                let key = jobs[r.unwrap_or(chunk[0])].key;
                NoiseKey {
                    step: key.step + step as u64,
                    ..key
                }
            })
            .collect();
        let next = sampling::select(&logits, dec.sampling, &keys)?;
        let live = rows.iter().filter(|r| r.is_some()).count();
        on_tokens(live as u64);
        for (slot, &tok) in rows.iter_mut().zip(&next) {
            let Some(j) = *slot else { continue };
            let seq = &mut tokens[j];
            seq.push(tok);
            let stop = if dec.stop_tokens.contains(&tok) {
                Some(Stop::Eos)
            } else if seq.len() >= dec.max_new_tokens {
                Some(Stop::Length)
            } else if (step + 1) % TEXT_STOP_EVERY == 0 && dec.text_stop.is_some_and(|f| f(seq)) {
                Some(Stop::Text)
            } else {
                None
            };
            if let Some(stop) = stop {
                done.push((
                    j,
                    Outcome {
                        tokens: std::mem::take(seq),
                        stop,
                    },
                ));
                *slot = None;
            }
        }
        let keep: Vec<usize> = (0..rows.len()).filter(|&r| rows[r].is_some()).collect();
        if keep.is_empty() {
            break;
        }
        if keep.len() * 2 <= rows.len() {
            cache.select_rows(&keep)?;
            rows = keep.iter().map(|&r| rows[r]).collect();
            feed = keep.iter().map(|&r| next[r]).collect();
        } else {
            feed = next;
        }
    }
    Ok(done)
}
