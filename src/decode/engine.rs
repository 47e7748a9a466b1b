//! The continuation engine: many continuations, each resumed from its own KV snapshot with a
//! forced first (branch) token, decoded together in batches of a given schedule.
//!
//! A schedule is the order in which jobs are taken and the batch size. Rows that finish are
//! dropped from the batch once at least half of it has finished; that compaction is part of
//! the schedule, so the same schedule always runs the same batches. A job whose branch token
//! is a stop token ends with no tokens; it keeps its row (and its snapshot check) all the same.
pub use super::stats::EngineStats;
pub use super::stepper::Stepper;
pub use crate::exec::EngineMode;
use crate::exec::ExecPolicy;
use crate::kv_cache::{KvCache, Snapshot, SnapshotKv};
use crate::model::Decoder;
use crate::sampling::{NoiseKey, Sampling};
use crate::{Error, Result};
use std::time::Instant;
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
    /// Index of the job among the jobs its row ran, 0 for the first ([`run_queue`] refills
    /// rows; [`run_batches`] runs one job per row, so 0 there).
    pub fill: u32,
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
    /// The numerical path of each job.
    pub paths: Vec<NumericalPath>,
}

const TEXT_STOP_EVERY: usize = 8;

/// Engine settings beyond the decoding itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineOptions {
    /// How steps are executed.
    pub mode: EngineMode,
    /// Masked key positions every step attends over beyond what its rows need (see
    /// [`Stepper::new`]): 0 for the natural key axis.
    pub key_pad: i64,
}

impl EngineOptions {
    /// Options for `mode` with the natural key axis.
    pub fn mode(mode: EngineMode) -> EngineOptions {
        EngineOptions { mode, key_pad: 0 }
    }
}

/// The numerical path one continuation took: the batch rows and the key axis of every step
/// it was decoded in (the two schedule dimensions that decide a stock step's rounding besides
/// the engine mode and the kernels, which are the same for a whole pass).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NumericalPath {
    /// `(rows, key axis)` of each step, in order.
    pub steps: Vec<(u32, u32)>,
}

impl NumericalPath {
    /// Fewest and most batch rows over the steps (`(0, 0)` without steps).
    pub fn rows_range(&self) -> (u32, u32) {
        range(self.steps.iter().map(|s| s.0))
    }

    /// Shortest and longest key axis over the steps (`(0, 0)` without steps).
    pub fn keys_range(&self) -> (u32, u32) {
        range(self.steps.iter().map(|s| s.1))
    }

    /// SHA-256 (hex, first 16 digits) of the rows of every step, in order.
    pub fn rows_digest(&self) -> String {
        digest(self.steps.iter().map(|s| s.0))
    }

    /// SHA-256 (hex, first 16 digits) of the key axis of every step, in order.
    pub fn keys_digest(&self) -> String {
        digest(self.steps.iter().map(|s| s.1))
    }

    /// Steps at which `self` and `other` attend over the same key axis (compared step by
    /// step over the shorter of the two).
    pub fn same_key_steps(&self, other: &NumericalPath) -> usize {
        self.steps
            .iter()
            .zip(&other.steps)
            .filter(|(a, b)| a.1 == b.1)
            .count()
    }
}

fn range(xs: impl Iterator<Item = u32>) -> (u32, u32) {
    xs.fold(None, |acc: Option<(u32, u32)>, x| {
        Some(acc.map_or((x, x), |(lo, hi)| (lo.min(x), hi.max(x))))
    })
    .unwrap_or((0, 0))
}

fn digest(xs: impl Iterator<Item = u32>) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    for x in xs {
        h.update(x.to_le_bytes());
    }
    h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
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
    let mut paths = vec![NumericalPath::default(); jobs.len()];
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
                fill: 0,
            });
        }
    }
    // Static batches keep one capacity for the whole run (graphs hold on to the buffers).
    let longest = longest_start(dec, jobs, batches.iter().flatten())?;
    let mut stepper: Option<Stepper> = None;
    for chunk in batches {
        let parts = starts(jobs, chunk);
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
                    opts.key_pad,
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
            let decoded =
                decode_chunk(dec, jobs, chunk, stepper, &mut stats, &mut paths, on_tokens);
            let rows = join_hashing(hashing, &mut stats)??;
            Ok::<_, Error>((decoded?, rows))
        })?;
        for (j, o) in decoded {
            out[j] = Some(o);
        }
        for j in rows {
            verified[j] = true;
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
        paths,
    })
}

/// A batch row of [`run_queue`]: the job it runs (or last ran) and that job's progress.
struct Slot {
    /// The row's index when the batch was filled (its `Placement::row`).
    row: u32,
    /// The job loaded into it.
    job: usize,
    /// Whether that job is still decoding.
    live: bool,
    /// Tokens the job has sampled so far: its own step index.
    step: usize,
    /// Jobs the row ran before this one.
    fill: u32,
}

/// The state of a [`run_queue`] besides the batch itself.
struct Queue<'r, 'a> {
    dec: &'r Decoding<'a>,
    jobs: &'r [Job<'a>],
    order: &'r [usize],
    /// Index in `order` of the next job to load.
    next: usize,
    /// Rows of the batch, in batch order.
    slots: Vec<Slot>,
    /// Token each row is fed next.
    feed: Vec<i64>,
    tokens: Vec<Vec<i64>>,
    out: Vec<Option<Outcome>>,
    placements: Vec<Placement>,
    width: u32,
    /// Where the checks of loaded rows go to be hashed (`None` once decoding is over).
    hashes: Option<std::sync::mpsc::Sender<PendingHashes>>,
    /// Whether any reloaded row differed from the resident row it was compared with: a
    /// one-element boolean on the device, folded over every comparison and read once decoding
    /// is over (no readback per reload).
    mismatch: Option<Tensor>,
    /// The numerical path of each job.
    paths: Vec<NumericalPath>,
}

impl Queue<'_, '_> {
    /// Jobs not loaded yet.
    fn waiting(&self) -> usize {
        self.order.len() - self.next
    }

    /// Settle row `r` after a step (or the first load): a job whose branch token is a stop
    /// token ends at once, and a finished row is reloaded with the next waiting job, until the
    /// row runs a live job or the queue is empty. A finished row left without a job is rewound
    /// to its last job's snapshot, so that, stepped on while the other rows finish (they may
    /// have started up to `max_new_tokens` steps later), it never outgrows the capacity.
    fn settle(&mut self, r: usize, stepper: &mut Stepper, stats: &mut EngineStats) -> Result<()> {
        loop {
            let s = &mut self.slots[r];
            if s.live {
                match stopped_at_branch(self.dec, &self.jobs[s.job]).filter(|_| s.step == 0) {
                    Some(o) => {
                        self.out[s.job] = Some(o);
                        s.live = false;
                    }
                    None => return Ok(()),
                }
            }
            let Some(&j) = self.order.get(self.next) else {
                return stepper.rewind_row(r, self.jobs[s.job].start.snap.len);
            };
            self.next += 1;
            let start = &self.jobs[j].start;
            let t = Instant::now();
            stepper.load_row(r, start.cache, start.snap)?;
            stats.gather_seconds += t.elapsed().as_secs_f64();
            let t = Instant::now();
            let pending = self.verify_row(r, j, stepper.cache(), stats)?;
            stats.verify_seconds += t.elapsed().as_secs_f64();
            // The hashing thread drops its receiver only after a mismatch, which the join
            // reports.
            if let Some(h) = &self.hashes {
                let _ = h.send(pending);
            }
            let s = &mut self.slots[r];
            *s = Slot {
                row: s.row,
                job: j,
                live: true,
                step: 0,
                fill: s.fill + 1,
            };
            self.placements[j] = Placement {
                chunk: 0,
                row: s.row,
                batch_rows: self.width,
                fill: s.fill,
            };
            self.feed[r] = self.jobs[j].first_token;
        }
    }

    /// The check of job `j` just loaded into row `r`: compared on the device with another
    /// row that started from the same snapshot (its positions below the snapshot's length are
    /// never written), else its K/V gathered for hashing.
    fn verify_row(
        &mut self,
        r: usize,
        j: usize,
        cache: &KvCache,
        stats: &mut EngineStats,
    ) -> Result<PendingHashes> {
        let start = &self.jobs[j].start;
        let Some(expect) = start.expect else {
            return Ok(PendingHashes::default());
        };
        let rep = self
            .slots
            .iter()
            .enumerate()
            .find(|&(q, o)| q != r && same_start(&self.jobs[o.job].start, start));
        if let Some((q, o)) = rep {
            let rep_job = o.job;
            let differs = cache.rows_differ(r, q, start.snap.len)?;
            self.mismatch = Some(match self.mismatch.take() {
                Some(m) => m.f_logical_or(&differs)?,
                None => differs,
            });
            return Ok(PendingHashes {
                copies: vec![],
                followers: vec![(j, rep_job)],
            });
        }
        stats.hashed_snapshots += 1;
        let kv = cache.copy_out(Snapshot {
            row: r,
            len: start.snap.len,
        })?;
        Ok(PendingHashes {
            copies: vec![(j, kv, expect)],
            followers: vec![],
        })
    }

    /// Decode until every job has finished.
    fn decode(
        &mut self,
        stepper: &mut Stepper,
        stats: &mut EngineStats,
        on_tokens: &mut dyn FnMut(u64),
    ) -> Result<()> {
        for r in 0..self.slots.len() {
            self.settle(r, stepper, stats)?;
        }
        for step in 0.. {
            if !self.slots.iter().any(|s| s.live) {
                break;
            }
            // Finished rows (only once the queue is empty) draw on with their last job's key;
            // their tokens are discarded.
            let keys: Vec<NoiseKey> = self
                .slots
                .iter()
                .map(|s| key_at(self.jobs[s.job].key, s.step))
                .collect();
            let shape = (self.slots.len() as u32, stepper.key_len() as u32);
            for s in self.slots.iter().filter(|s| s.live) {
                self.paths[s.job].steps.push(shape);
            }
            let next = timed_step(stepper, &self.feed, &keys, step, stats)?;
            let live = self.slots.iter().filter(|s| s.live).count();
            count_step(stats, self.slots.len(), live, on_tokens);
            for (s, &tok) in self.slots.iter_mut().zip(&next) {
                s.step += 1;
                if !s.live {
                    continue;
                }
                let seq = &mut self.tokens[s.job];
                seq.push(tok);
                if let Some(stop) = stop_after(self.dec, seq, s.step - 1) {
                    self.out[s.job] = Some(Outcome {
                        tokens: std::mem::take(seq),
                        stop,
                    });
                    s.live = false;
                }
            }
            self.feed = next;
            for r in 0..self.slots.len() {
                if !self.slots[r].live {
                    self.settle(r, stepper, stats)?;
                }
            }
            if self.waiting() > 0 {
                continue;
            }
            let keep: Vec<usize> = (0..self.slots.len())
                .filter(|&r| self.slots[r].live)
                .collect();
            if !keep.is_empty() && keep.len() * 2 <= self.slots.len() {
                stepper.compact(&keep)?;
                let mut slots: Vec<Option<Slot>> = std::mem::take(&mut self.slots)
                    .into_iter()
                    .map(Some)
                    .collect();
                self.slots = keep.iter().filter_map(|&r| slots[r].take()).collect();
                self.feed = keep.iter().map(|&r| self.feed[r]).collect();
            }
        }
        Ok(())
    }
}

/// Run `jobs` as one queue, taken in the order `order`, on a batch of `width` rows (fewer
/// when the queue is shorter): each row whose job finishes is reloaded at once with the next
/// job of the queue (its snapshot copied into that row), so the batch keeps its size (and its
/// CUDA graph) while the queue lasts; once it is empty, finished rows are dropped once at
/// least half the batch has finished, as in [`run_batches`]. Every job samples with its key's
/// step plus its own step index, as in [`run_batches`], so under the batch-invariant policy
/// its tokens are bitwise those of any batch schedule. Every row has room for the queue's
/// longest snapshot plus `max_new_tokens + 1` positions, in every mode, so any job fits any
/// row; positions beyond a reloaded row's length are never attended ([`KvCache::load_row`]).
///
/// Every job's starting K/V is verified against its fingerprint: the first rows as in
/// [`run_batches`], a reloaded row on the device against a resident row that started from the
/// same snapshot, else by hashing a host copy on another thread while the device decodes.
/// Outcomes are returned only once every check matched; a mismatch is [`Error::Invariant`].
/// Placements: chunk 0, the row, `batch_rows` the batch's size, `fill` the job's index among
/// its row's jobs.
pub fn run_queue(
    dec: &Decoding,
    jobs: &[Job],
    order: &[usize],
    width: usize,
    opts: &EngineOptions,
    on_tokens: &mut dyn FnMut(u64),
) -> Result<PassRun> {
    let mode = opts.mode.resolve(dec.model.device());
    let mut stats = EngineStats {
        mode: mode.to_string(),
        ..EngineStats::default()
    };
    if width == 0 {
        return Err(Error::Spec(
            "a queue needs a batch of at least one row".into(),
        ));
    }
    let mut seen = vec![false; jobs.len()];
    for &j in order {
        match seen.get_mut(j) {
            None => {
                return Err(Error::Spec(format!(
                    "job {j} scheduled but only {} jobs given",
                    jobs.len()
                )));
            }
            Some(true) => return Err(Error::Spec(format!("job {j} scheduled twice"))),
            Some(s) => *s = true,
        }
    }
    if seen.contains(&false) {
        return Err(Error::Spec("a job was not scheduled".into()));
    }
    if order.is_empty() {
        return Ok(PassRun {
            stats,
            ..PassRun::default()
        });
    }
    let width = width.min(order.len());
    let extra = dec.max_new_tokens + 1;
    let longest = longest_start(dec, jobs, order)?;
    let first = &order[..width];
    let parts = starts(jobs, first);
    let t = Instant::now();
    let mut stepper = Stepper::with_capacity(
        dec.model,
        dec.policy,
        dec.sampling,
        mode,
        &parts,
        extra,
        longest + extra as i64,
        opts.key_pad,
    )?;
    stats.gather_seconds += t.elapsed().as_secs_f64();
    let t = Instant::now();
    let initial = verify(jobs, first, stepper.cache(), &mut stats)?;
    stats.verify_seconds += t.elapsed().as_secs_f64();
    let (tx, rx) = std::sync::mpsc::channel::<PendingHashes>();
    let _ = tx.send(initial);
    let mut q = Queue {
        dec,
        jobs,
        order,
        next: width,
        slots: first
            .iter()
            .enumerate()
            .map(|(r, &j)| Slot {
                row: r as u32,
                job: j,
                live: true,
                step: 0,
                fill: 0,
            })
            .collect(),
        feed: first.iter().map(|&j| jobs[j].first_token).collect(),
        tokens: vec![Vec::new(); jobs.len()],
        out: vec![None; jobs.len()],
        placements: vec![Placement::default(); jobs.len()],
        width: width as u32,
        hashes: Some(tx),
        mismatch: None,
        paths: vec![NumericalPath::default(); jobs.len()],
    };
    for (r, &j) in first.iter().enumerate() {
        q.placements[j] = Placement {
            chunk: 0,
            row: r as u32,
            batch_rows: width as u32,
            fill: 0,
        };
    }
    // Copies are hashed as they come while the device decodes; followers are resolved once
    // every representative has been hashed.
    let hashed = std::thread::scope(|scope| {
        let hashing = scope.spawn(move || -> Result<Vec<usize>> {
            let (mut ok, mut followers) = (Vec::new(), Vec::new());
            for p in rx {
                let (hashed, f) = p.hash_copies()?;
                ok.extend(hashed);
                followers.extend(f);
            }
            Ok(resolve_followers(ok, &followers))
        });
        let decoded = q.decode(&mut stepper, &mut stats, on_tokens);
        // Closing the channel ends the hashing.
        q.hashes = None;
        let hashed = join_hashing(hashing, &mut stats)?;
        decoded?;
        if let Some(m) = &q.mismatch
            && bool::try_from(m.f_to_device(tch::Device::Cpu)?)?
        {
            return Err(same_snapshot_differs());
        }
        hashed
    })?;
    stepper.report(&mut stats);
    let mut verified = vec![false; jobs.len()];
    for j in hashed {
        verified[j] = true;
    }
    let outcomes = q
        .out
        .into_iter()
        .map(|o| o.ok_or_else(|| Error::Invariant("a queued job did not finish".into())))
        .collect::<Result<Vec<_>>>()?;
    let checks = count_checks(jobs, &verified);
    Ok(PassRun {
        outcomes,
        placements: q.placements,
        verified,
        checks,
        stats,
        paths: q.paths,
    })
}

/// The longest starting state among the jobs `ids`, refused when continuing it by
/// `max_new_tokens` would exceed the model's context.
fn longest_start<'i>(
    dec: &Decoding,
    jobs: &[Job],
    ids: impl IntoIterator<Item = &'i usize>,
) -> Result<i64> {
    let longest = ids
        .into_iter()
        .map(|&j| jobs[j].start.snap.len)
        .max()
        .unwrap_or(0);
    dec.model.check_context(
        (longest + dec.max_new_tokens as i64 + 1) as usize,
        &format!(
            "continuing a {longest}-token state by {} tokens",
            dec.max_new_tokens
        ),
    )?;
    Ok(longest)
}

/// The starting snapshots of the jobs `ids`, in order.
fn starts<'a>(jobs: &[Job<'a>], ids: &[usize]) -> Vec<(&'a KvCache, Snapshot)> {
    ids.iter()
        .map(|&j| (jobs[j].start.cache, jobs[j].start.snap))
        .collect()
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

/// Snapshot K/V gathered on the device, to copy to the host and hash on another thread, with
/// the fingerprints they must hash to.
#[derive(Default)]
struct PendingHashes {
    /// (job, its K/V as loaded into the batch, the fingerprint it must hash to).
    copies: Vec<(usize, SnapshotKv, [u8; 32])>,
    /// Jobs whose batch row held their representative job's K/V bitwise (compared on the
    /// device) and are verified once it is: (job, representative job). A representative is
    /// always registered (hashed or itself a follower) before its followers.
    followers: Followers,
}

/// (job, representative job) pairs: see [`PendingHashes::followers`].
type Followers = Vec<(usize, usize)>;

impl PendingHashes {
    /// Hash every copy; a mismatch is an invariant violation. Returns the verified jobs.
    fn hash(self) -> Result<Vec<usize>> {
        let (hashed, followers) = self.hash_copies()?;
        Ok(resolve_followers(hashed, &followers))
    }

    /// Copy each snapshot to the host and hash it, in parallel (rayon); returns their jobs in
    /// the copies' order, and the followers (left to [`resolve_followers`]).
    fn hash_copies(self) -> Result<(Vec<usize>, Followers)> {
        use rayon::prelude::*;
        let hashed = self
            .copies
            .into_par_iter()
            .map(|(j, kv, expect)| {
                let len = kv.positions();
                if kv.to_host()?.fingerprint() == expect {
                    Ok(j)
                } else {
                    Err(Error::Invariant(format!(
                        "KV fingerprint mismatch resuming snapshot of length {len}: the decode-time state was not reproduced"
                    )))
                }
            })
            .collect::<Result<_>>()?;
        Ok((hashed, self.followers))
    }
}

/// `hashed` plus the followers whose representative is verified, in registration order.
fn resolve_followers(mut hashed: Vec<usize>, followers: &[(usize, usize)]) -> Vec<usize> {
    let mut ok: std::collections::BTreeSet<usize> = hashed.iter().copied().collect();
    for &(j, rep) in followers {
        if ok.contains(&rep) {
            ok.insert(j);
            hashed.push(j);
        }
    }
    hashed
}

/// Whether two jobs start from the same snapshot with the same fingerprint to verify.
fn same_start(a: &Start, b: &Start) -> bool {
    std::ptr::eq(a.cache, b.cache) && a.snap == b.snap && a.expect == b.expect
}

/// Check the rows of a freshly loaded chunk against their decode-time fingerprints. Rows that
/// start from the same snapshot are compared bitwise on the device with the first of them,
/// whose K/V alone is gathered on the device; the copies are returned for hashing (copied to
/// the host on the hashing thread).
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
        let first = chunk[..row]
            .iter()
            .position(|&i| same_start(&jobs[i].start, s));
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
        .map(|r| (chunk[r], chunk[rep[r]]))
        .collect();
    if !followers.is_empty() {
        let rows: Vec<usize> = (0..chunk.len()).collect();
        let upto = cache.lens().iter().copied().max().unwrap_or(0);
        if !cache.rows_equal(&rows, &rep, upto)? {
            return Err(same_snapshot_differs());
        }
    }
    let mut copies = Vec::with_capacity(hashed.len());
    for (row, expect) in hashed {
        stats.hashed_snapshots += 1;
        let kv = cache.copy_out(Snapshot {
            row,
            len: jobs[chunk[row]].start.snap.len,
        })?;
        copies.push((chunk[row], kv, expect));
    }
    Ok(PendingHashes { copies, followers })
}

fn same_snapshot_differs() -> Error {
    Error::Invariant(
        "KV rows resumed from the same snapshot differ: the decode-time state was not reproduced"
            .into(),
    )
}

/// The outcome of a job whose branch token is a stop token: it ends before anything is
/// decoded.
fn stopped_at_branch(dec: &Decoding, job: &Job) -> Option<Outcome> {
    dec.stop_tokens.contains(&job.first_token).then(|| Outcome {
        tokens: vec![],
        stop: Stop::Eos,
    })
}

/// Why a job whose tokens are now `seq` (the last one sampled at its own step `step`) stops,
/// if it does.
fn stop_after(dec: &Decoding, seq: &[i64], step: usize) -> Option<Stop> {
    let tok = *seq.last()?;
    if dec.stop_tokens.contains(&tok) {
        Some(Stop::Eos)
    } else if seq.len() >= dec.max_new_tokens {
        Some(Stop::Length)
    } else if (step + 1).is_multiple_of(TEXT_STOP_EVERY) && dec.text_stop.is_some_and(|f| f(seq)) {
        Some(Stop::Text)
    } else {
        None
    }
}

/// `key` advanced to the job's own step `step`.
fn key_at(key: NoiseKey, step: usize) -> NoiseKey {
    NoiseKey {
        step: key.step + step as u64,
        ..key
    }
}

/// The hashing thread's result, the wait for it added to `stats.hash_wait_seconds`.
fn join_hashing<T>(
    hashing: std::thread::ScopedJoinHandle<'_, T>,
    stats: &mut EngineStats,
) -> Result<T> {
    let t = Instant::now();
    let out = hashing
        .join()
        .map_err(|_| Error::Invariant("fingerprint hashing panicked".into()));
    stats.hash_wait_seconds += t.elapsed().as_secs_f64();
    out
}

/// [`Stepper::step`] `step` of a run, its time (waiting for the device included) added to
/// `stats.step_seconds`; an error names the step.
fn timed_step(
    stepper: &mut Stepper,
    feed: &[i64],
    keys: &[NoiseKey],
    step: usize,
    stats: &mut EngineStats,
) -> Result<Vec<i64>> {
    let t = Instant::now();
    let next = stepper
        .step(feed, keys)
        .map_err(|e| e.context(&format!("continuation step {step}")))?;
    stats.step_seconds += t.elapsed().as_secs_f64();
    Ok(next)
}

/// Count one step of `rows` rows of which `live` produced a kept token.
fn count_step(stats: &mut EngineStats, rows: usize, live: usize, on_tokens: &mut dyn FnMut(u64)) {
    stats.steps += 1;
    stats.row_steps += rows as u64;
    stats.tokens += live as u64;
    on_tokens(live as u64);
}

#[allow(clippy::too_many_arguments)]
fn decode_chunk(
    dec: &Decoding,
    jobs: &[Job],
    chunk: &[usize],
    stepper: &mut Stepper,
    stats: &mut EngineStats,
    paths: &mut [NumericalPath],
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
            && let Some(o) = stopped_at_branch(dec, &jobs[j])
        {
            done.push((j, o));
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
            .map(|r| key_at(jobs[r.unwrap_or(chunk[0])].key, step))
            .collect();
        let shape = (rows.len() as u32, stepper.key_len() as u32);
        for &j in rows.iter().flatten() {
            paths[j].steps.push(shape);
        }
        let next = timed_step(stepper, &feed, &keys, step, stats)?;
        let live = rows.iter().filter(|r| r.is_some()).count();
        count_step(stats, rows.len(), live, on_tokens);
        for (slot, &tok) in rows.iter_mut().zip(&next) {
            let Some(j) = *slot else { continue };
            let seq = &mut tokens[j];
            seq.push(tok);
            if let Some(stop) = stop_after(dec, seq, step) {
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
