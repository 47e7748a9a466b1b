//! The continuation engine: many continuations, each resumed from its own KV snapshot with a
//! forced first (branch) token, decoded together in batches of a given schedule.
//!
//! A schedule is the order in which jobs are taken and the batch size. Rows that finish are
//! dropped from the batch once at least half of it has finished; that compaction is part of
//! the schedule, so the same schedule always runs the same batches. A job whose branch token
//! is a stop token ends with no tokens; it keeps its row (and its snapshot check) all the same.
pub use super::stepper::Stepper;
use crate::exec::ExecPolicy;
use crate::kv_cache::{HostKv, KvCache, Snapshot};
use crate::model::Decoder;
use crate::sampling::{NoiseKey, Sampling};
use crate::{Error, Result};
use std::time::Instant;

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
    /// Sampled tokens after the branch token (none when the branch token is a stop token).
    pub tokens: Vec<i64>,
    /// Why it stopped.
    pub stop: Stop,
}

/// A text stop test on the tokens so far.
pub type TextStop<'a> = &'a dyn Fn(&[i64]) -> bool;

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
    pub text_stop: Option<TextStop<'a>>,
}

/// Fingerprint checks made while starting continuations, counted once each comparison was
/// made: a continuation is a hit when its starting K/V hashed to (or, sharing a snapshot with
/// a hashed row, compared bitwise equal to) the decode-time fingerprint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SnapshotChecks {
    /// Continuations with a decode-time fingerprint to verify.
    pub checks: u64,
    /// Of those, how many were verified (a mismatch is an error, so this equals `checks`
    /// unless a row was left unverified).
    pub hits: u64,
    /// Distinct snapshots (cache, row, length) among the continuations with a fingerprint.
    pub snapshots: u64,
    /// Distinct snapshots every continuation of which was verified.
    pub snapshot_hits: u64,
}

/// Where a job ran in its pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Placement {
    /// Index of its batch in the pass's schedule.
    pub chunk: u32,
    /// Its row in that batch.
    pub row: u32,
    /// Rows the batch started with.
    pub batch_rows: u32,
}

/// Everything one engine run produced, indexed like its jobs.
#[derive(Debug, Clone, Default)]
pub struct PassRun {
    /// The tokens each job produced.
    pub outcomes: Vec<Outcome>,
    /// Where each job ran.
    pub placements: Vec<Placement>,
    /// Whether each job's starting K/V was verified against its decode-time fingerprint.
    pub verified: Vec<bool>,
    /// The verification counts.
    pub checks: SnapshotChecks,
    /// What the engine did besides decoding.
    pub stats: EngineStats,
}

const TEXT_STOP_EVERY: usize = 8;

/// How the decode steps of continuations are executed.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
pub enum EngineMode {
    /// `graph` on a CUDA device when this binary can capture graphs, `eager` otherwise.
    // Commands take `--engine`, else `KVCREDIT_ENGINE`, resolved once with their other
    // arguments (`crate::exec::ExecSettings::resolve`); nothing here reads the environment.
    #[default]
    Auto,
    /// One [`Decoder::forward`] per step, attending over each row's valid keys.
    Eager,
    /// [`Decoder::forward_static`] per step: device-resident inputs, attention over the batch
    /// cache's fixed capacity, K/V written by scatter; no host syncs but the token readback.
    Static,
    /// The static step captured once per batch size as a CUDA graph and replayed (falls back
    /// to `static`, with a warning, if a capture fails).
    Graph,
}

impl std::fmt::Display for EngineMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EngineMode::Auto => "auto",
            EngineMode::Eager => "eager",
            EngineMode::Static => "static",
            EngineMode::Graph => "graph",
        })
    }
}

impl EngineMode {
    /// The concrete mode `Auto` stands for on `device` (other modes are returned as they are).
    pub fn resolve(self, device: tch::Device) -> EngineMode {
        if self != EngineMode::Auto {
            return self;
        }
        if device.is_cuda() && crate::cuda_graph::compiled() {
            EngineMode::Graph
        } else {
            EngineMode::Eager
        }
    }
}

/// Engine settings beyond the decoding itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineOptions {
    /// How steps are executed.
    pub mode: EngineMode,
}

/// What an engine run did besides decoding.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EngineStats {
    /// The mode that ran.
    pub mode: String,
    /// Decode steps (batched forwards).
    pub steps: u64,
    /// Rows decoded over all steps, finished rows awaiting compaction included.
    pub row_steps: u64,
    /// Tokens kept.
    pub tokens: u64,
    /// Seconds spent copying snapshots into batches.
    pub gather_seconds: f64,
    /// Seconds spent verifying fingerprints.
    pub verify_seconds: f64,
    /// Distinct snapshots hashed (other rows were compared with them on the device).
    pub hashed_snapshots: u64,
    /// CUDA graphs captured (one per batch size met).
    pub graph_captures: u64,
    /// Seconds spent capturing them (warm-up run included).
    pub capture_seconds: f64,
    /// Nodes (kernels, copies) of the last captured graph: the launches of one step.
    pub graph_nodes: Option<u64>,
    /// Why graphs were abandoned for the static step, if they were.
    pub graph_fallback: Option<String>,
}

impl EngineStats {
    /// One line for tables.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "[{}: {} steps, {:.0}% rows live, gather {:.3} s, verify {:.3} s ({} hashed)",
            self.mode,
            self.steps,
            100.0 * self.tokens as f64 / self.row_steps.max(1) as f64,
            self.gather_seconds,
            self.verify_seconds,
            self.hashed_snapshots
        );
        if self.graph_captures > 0 {
            s += &format!(
                ", {} graph captures in {:.3} s",
                self.graph_captures, self.capture_seconds
            );
            if let Some(n) = self.graph_nodes {
                s += &format!(", {n} nodes/step");
            }
        }
        if let Some(why) = &self.graph_fallback {
            s += &format!(", graphs abandoned: {why}");
        }
        s + "]"
    }
}

/// Run `jobs` in the order `order`, `batch` at a time. Returns outcomes indexed like `jobs`.
/// `on_tokens` is told how many tokens each step produced.
pub fn run(
    dec: &Decoding,
    jobs: &[Job],
    order: &[usize],
    batch: usize,
    on_tokens: &mut dyn FnMut(u64),
) -> Result<(Vec<Outcome>, SnapshotChecks)> {
    let (outcomes, checks, _) = run_with(
        dec,
        jobs,
        order,
        batch,
        &EngineOptions::default(),
        on_tokens,
    )?;
    Ok((outcomes, checks))
}

/// [`run`] with explicit engine options, also returning what the engine did.
pub fn run_with(
    dec: &Decoding,
    jobs: &[Job],
    order: &[usize],
    batch: usize,
    opts: &EngineOptions,
    on_tokens: &mut dyn FnMut(u64),
) -> Result<(Vec<Outcome>, SnapshotChecks, EngineStats)> {
    let batches = super::schedule::chunked(order, batch);
    let r = run_batches(dec, jobs, &batches, opts, on_tokens)?;
    Ok((r.outcomes, r.checks, r.stats))
}

/// Run `jobs` in the given batches (each job in exactly one), in order.
pub fn run_batches(
    dec: &Decoding,
    jobs: &[Job],
    batches: &[Vec<usize>],
    opts: &EngineOptions,
    on_tokens: &mut dyn FnMut(u64),
) -> Result<PassRun> {
    let mode = opts.mode.resolve(dec.model.device());
    let mut stats = EngineStats {
        mode: mode.to_string(),
        ..EngineStats::default()
    };
    let mut out: Vec<Option<Outcome>> = vec![None; jobs.len()];
    let mut placed: Vec<Option<Placement>> = vec![None; jobs.len()];
    let mut verified = vec![false; jobs.len()];
    let extra = dec.max_new_tokens + 1;
    for (c, chunk) in batches.iter().enumerate() {
        if chunk.is_empty() {
            return Err(Error::Spec(format!("batch {c} of the schedule is empty")));
        }
        for (row, &j) in chunk.iter().enumerate() {
            let slot = placed.get_mut(j).ok_or_else(|| {
                Error::Spec(format!(
                    "job {j} scheduled but only {} jobs given",
                    jobs.len()
                ))
            })?;
            if slot.is_some() {
                return Err(Error::Spec(format!("job {j} scheduled twice")));
            }
            *slot = Some(Placement {
                chunk: c as u32,
                row: row as u32,
                batch_rows: chunk.len() as u32,
            });
        }
    }
    // Static batches keep one capacity for the whole run (graphs hold on to the buffers).
    let longest = batches
        .iter()
        .flatten()
        .map(|&j| jobs[j].start.snap.len)
        .max()
        .unwrap_or(0);
    dec.model.check_context(
        (longest + extra as i64) as usize,
        &format!(
            "continuing a {longest}-token state by {} tokens",
            dec.max_new_tokens
        ),
    )?;
    let mut stepper: Option<Stepper> = None;
    for chunk in batches {
        let parts: Vec<(&KvCache, Snapshot)> = chunk
            .iter()
            .map(|&j| (jobs[j].start.cache, jobs[j].start.snap))
            .collect();
        let t = Instant::now();
        match stepper.as_mut() {
            Some(s) => s.load(&parts, extra)?,
            None => {
                stepper = Some(Stepper::new(
                    dec.model,
                    dec.policy,
                    dec.sampling,
                    mode,
                    &parts,
                    extra,
                    longest + extra as i64,
                )?)
            }
        }
        let stepper = stepper.as_mut().expect("loaded above");
        stats.gather_seconds += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let pending = verify(jobs, chunk, stepper.cache(), &mut stats)?;
        stats.verify_seconds += t.elapsed().as_secs_f64();
        // The copied snapshots are hashed on another thread while the device decodes; the
        // chunk's outcomes count, and its rows are verified, only once every hash matched.
        let (decoded, rows) = std::thread::scope(|scope| {
            let hashing = scope.spawn(move || pending.hash());
            let decoded = decode_chunk(dec, jobs, chunk, stepper, &mut stats, on_tokens);
            let rows = hashing
                .join()
                .map_err(|_| Error::Invariant("fingerprint hashing panicked".into()))??;
            Ok::<_, Error>((decoded?, rows))
        })?;
        for (j, o) in decoded {
            out[j] = Some(o);
        }
        for row in rows {
            verified[chunk[row]] = true;
        }
    }
    if let Some(s) = &stepper {
        s.report(&mut stats);
    }
    let outcomes = out
        .into_iter()
        .map(|o| o.ok_or_else(|| Error::Spec("a job was not scheduled".into())))
        .collect::<Result<Vec<_>>>()?;
    let placements = placed.into_iter().map(|p| p.unwrap_or_default()).collect();
    let checks = count_checks(jobs, &verified);
    Ok(PassRun {
        outcomes,
        placements,
        verified,
        checks,
        stats,
    })
}

/// Per continuation and per distinct snapshot: how many had a fingerprint, how many were
/// verified.
pub fn count_checks(jobs: &[Job], verified: &[bool]) -> SnapshotChecks {
    let mut snaps: std::collections::BTreeMap<(usize, usize, i64), bool> = Default::default();
    let mut c = SnapshotChecks::default();
    for (job, &ok) in jobs.iter().zip(verified) {
        if job.start.expect.is_none() {
            continue;
        }
        c.checks += 1;
        c.hits += u64::from(ok);
        let key = (
            std::ptr::from_ref(job.start.cache) as usize,
            job.start.snap.row,
            job.start.snap.len,
        );
        *snaps.entry(key).or_insert(true) &= ok;
    }
    c.snapshots = snaps.len() as u64;
    c.snapshot_hits = snaps.values().filter(|&&ok| ok).count() as u64;
    c
}

/// Snapshot K/V copied to the host, with the fingerprints they must hash to.
struct PendingHashes {
    /// (batch row, its K/V, the fingerprint it must hash to).
    copies: Vec<(usize, HostKv, [u8; 32])>,
    /// Rows that hold their representative's K/V bitwise (compared on the device) and are
    /// verified once it hashes to the fingerprint: (row, representative row).
    followers: Vec<(usize, usize)>,
}

impl PendingHashes {
    /// Hash every copy; a mismatch is an invariant violation. Returns the verified rows.
    fn hash(self) -> Result<Vec<usize>> {
        let mut rows = Vec::with_capacity(self.copies.len() + self.followers.len());
        for (row, kv, expect) in &self.copies {
            if kv.fingerprint() != *expect {
                return Err(Error::Invariant(format!(
                    "KV fingerprint mismatch resuming snapshot of length {}: the decode-time state was not reproduced",
                    kv.positions()
                )));
            }
            rows.push(*row);
        }
        for &(row, rep) in &self.followers {
            if rows.contains(&rep) {
                rows.push(row);
            }
        }
        Ok(rows)
    }
}

/// Check the rows of a freshly loaded chunk against their decode-time fingerprints. Rows that
/// start from the same snapshot are compared bitwise on the device with the first of them,
/// whose K/V alone is copied to the host; the copies are returned for hashing.
fn verify(
    jobs: &[Job],
    chunk: &[usize],
    cache: &KvCache,
    stats: &mut EngineStats,
) -> Result<PendingHashes> {
    // Representative row of each row, and the rows to hash.
    let mut rep: Vec<usize> = Vec::with_capacity(chunk.len());
    let mut hashed: Vec<(usize, [u8; 32])> = Vec::new();
    for (row, &j) in chunk.iter().enumerate() {
        let s = &jobs[j].start;
        let first = chunk[..row].iter().position(|&i| {
            let o = &jobs[i].start;
            std::ptr::eq(o.cache, s.cache) && o.snap == s.snap && o.expect == s.expect
        });
        match first {
            Some(r) => rep.push(r),
            None => {
                rep.push(row);
                if let Some(expect) = s.expect {
                    hashed.push((row, expect));
                }
            }
        }
    }
    let followers: Vec<(usize, usize)> = (0..chunk.len())
        .filter(|&r| rep[r] != r && jobs[chunk[r]].start.expect.is_some())
        .map(|r| (r, rep[r]))
        .collect();
    if !followers.is_empty() {
        let rows: Vec<usize> = (0..chunk.len()).collect();
        let upto = cache.lens().iter().copied().max().unwrap_or(0);
        if !cache.rows_equal(&rows, &rep, upto)? {
            return Err(Error::Invariant(
                "KV rows resumed from the same snapshot differ: the decode-time state was not reproduced"
                    .into(),
            ));
        }
    }
    let mut copies = Vec::with_capacity(hashed.len());
    for (row, expect) in hashed {
        stats.hashed_snapshots += 1;
        let kv = cache.to_host(Snapshot {
            row,
            len: jobs[chunk[row]].start.snap.len,
        })?;
        copies.push((row, kv, expect));
    }
    Ok(PendingHashes { copies, followers })
}

fn decode_chunk(
    dec: &Decoding,
    jobs: &[Job],
    chunk: &[usize],
    stepper: &mut Stepper,
    stats: &mut EngineStats,
    on_tokens: &mut dyn FnMut(u64),
) -> Result<Vec<(usize, Outcome)>> {
    // Batch row r runs job `rows[r]`; `None` marks a finished row awaiting compaction.
    let mut rows: Vec<Option<usize>> = chunk.iter().map(|&j| Some(j)).collect();
    let mut tokens: Vec<Vec<i64>> = vec![Vec::new(); jobs.len()];
    let mut done: Vec<(usize, Outcome)> = Vec::new();
    let mut feed: Vec<i64> = chunk.iter().map(|&j| jobs[j].first_token).collect();
    // A branch token that is a stop token ends its continuation before anything is decoded.
    for slot in rows.iter_mut() {
        if let Some(j) = *slot
            && dec.stop_tokens.contains(&jobs[j].first_token)
        {
            done.push((
                j,
                Outcome {
                    tokens: vec![],
                    stop: Stop::Eos,
                },
            ));
            *slot = None;
        }
    }
    for step in 0..dec.max_new_tokens {
        if rows.iter().all(Option::is_none) {
            break;
        }
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
        let next = stepper
            .step(&feed, &keys)
            .map_err(|e| e.context(&format!("continuation step {step}")))?;
        let live = rows.iter().filter(|r| r.is_some()).count();
        stats.steps += 1;
        stats.row_steps += rows.len() as u64;
        stats.tokens += live as u64;
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
            stepper.compact(&keep)?;
            rows = keep.iter().map(|&r| rows[r]).collect();
            feed = keep.iter().map(|&r| next[r]).collect();
        } else {
            feed = next;
        }
    }
    Ok(done)
}
