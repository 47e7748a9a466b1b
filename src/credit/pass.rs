//! A credit pass as a plug-in ([`CreditPass`]): how each pivot's starting state is built and
//! which batches the continuations run in; [`run`] runs one pass over a group's pooled jobs and
//! returns, per problem, what the shard records of it (outcomes, audit, cost, numerical path,
//! snapshot checks). The plug-ins are in `credit::passes`.
use super::records::{JobId, PassAudit};
use super::rollout::{Pivot, Rollout};
use super::schema::{PassCost, PassNumerics, SpectrumStats};
use super::spec::{CampaignSpec, Pass, PassSpec};
use crate::decode::engine::{
    self, Decoding, EngineOptions, Job, NumericalPath, Outcome, SnapshotChecks, Start,
};
use crate::decode::schedule::Batches;
use crate::exec::ExecSettings;
use crate::kv_cache::{KvCache, Snapshot};
use crate::runtime::LoadedModel;
use crate::sampling::NoiseKey;
use crate::study::sync;
use crate::{Error, Result};
use indicatif::ProgressBar;
use std::ops::Range;
use std::time::Instant;

/// What a pass sees of the campaign and the group it runs.
pub(crate) struct PassContext<'a> {
    /// The campaign spec (`[passes]` and its sections).
    pub spec: &'a CampaignSpec,
    /// The model the rollouts ran on.
    pub model: &'a LoadedModel,
    /// Engine, tiles and kernels of the run.
    pub settings: &'a ExecSettings,
    /// How continuations are decoded (model, policy, sampling, stops).
    pub decoding: &'a Decoding<'a>,
    /// The group in words (`problem 3`, `problems 0-1`), for errors.
    pub what: &'a str,
}

/// One problem of a group up to its passes: its rollout, pivots and continuation jobs.
pub(crate) struct Prepared {
    /// The problem's index in the spec (its noise keys' `problem`).
    pub problem: usize,
    pub roll: Rollout,
    pub pivots: Vec<Pivot>,
    /// Jobs in natural order: pivot, branch, sample.
    pub ids: Vec<JobId>,
}

impl Prepared {
    /// The token a job feeds first: the rollout's at its pivot, or an alternative.
    pub fn branch_token(&self, id: &JobId) -> i64 {
        let p = &self.pivots[id.pivot];
        if id.branch == 0 {
            p.token
        } else {
            p.alternatives[id.branch - 1]
        }
    }
}

/// One problem's starting states for a pass, one per pivot.
pub(crate) struct Starts {
    /// Where the continuations resume.
    pub state: StartState,
    /// Prefix tokens prefilled to build the states (counted in the pass's cost).
    pub tokens: u64,
    /// The compressed frames' statistics, for a state built by SpectrumKV.
    pub spectrum: Option<SpectrumStats>,
}

/// Where a pass's continuations resume.
pub(crate) enum StartState {
    /// The rollout's decode-time snapshot at the pivot, verified against its fingerprint.
    Snapshots,
    /// A one-row cache per pivot holding the pivot's prefix.
    Caches(Vec<KvCache>),
}

impl Starts {
    /// The start of a continuation from `pivot` (the `index`-th of `roll`'s pivots).
    fn start<'a>(&'a self, roll: &'a Rollout, index: usize, pivot: &Pivot) -> Start<'a> {
        let snap = roll.snapshot(pivot.pos);
        match &self.state {
            StartState::Snapshots => Start {
                cache: &roll.cache,
                snap,
                expect: Some(pivot.fingerprint),
            },
            StartState::Caches(caches) => Start {
                cache: &caches[index],
                snap: Snapshot {
                    row: 0,
                    len: snap.len,
                },
                expect: None,
            },
        }
    }
}

/// The batches a pass's jobs run in.
pub(crate) struct Schedule {
    pub plan: Plan,
    /// Masked key positions every step attends over beyond its rows' needs.
    pub key_pad: i64,
    /// The schedule's name in the pass's numerical path (`exact`, `same`, `shuffled`).
    pub name: String,
    /// The spec key to lower when a batch runs out of memory.
    pub batch_key: &'static str,
}

/// Fixed batches, or with `passes.refill` one queue refilling `width` rows.
#[derive(Debug, PartialEq)]
pub(crate) enum Plan {
    /// Job indices per batch.
    Batches(Batches),
    /// Job indices in the order they enter the rows.
    Queue { order: Vec<usize>, width: usize },
}

impl Plan {
    /// The most rows a step runs.
    fn rows(&self) -> usize {
        match self {
            Plan::Batches(b) => b.iter().map(Vec::len).max().unwrap_or(0),
            Plan::Queue { width, .. } => *width,
        }
    }
}

/// A credit pass: its name, the starting state of a problem's continuations, and the schedule
/// they run under. One implementation per file in `credit::passes`, registered there by name.
pub(crate) trait CreditPass {
    /// The pass's name in specs and records.
    fn pass(&self) -> Pass;

    /// One problem's starting states: one per pivot of `pivots`, from its rollout `roll`.
    fn starts(&self, cx: &PassContext, roll: &Rollout, pivots: &[Pivot]) -> Result<Starts>;

    /// The batches a group's `jobs` pooled continuations run in under `passes` (`what`: the
    /// group in words, for errors).
    fn schedule(&self, passes: &PassSpec, what: &str, jobs: usize) -> Result<Schedule>;
}

/// What one pass recorded of one problem.
pub(crate) struct ProblemRun {
    pub outcomes: Vec<Outcome>,
    pub audit: PassAudit,
    /// Device time (the pass's, shared by tokens), tokens (prefilled and sampled), jobs.
    pub cost: PassCost,
    /// The numerical path its continuations took.
    pub numerics: PassNumerics,
    /// Fingerprint checks of its starts.
    pub checks: SnapshotChecks,
    /// The compressed frames' statistics, for a SpectrumKV start.
    pub spectrum: Option<SpectrumStats>,
}

/// `seconds` shared among a group's problems in proportion to their `counts` (all of it to
/// a problem alone).
pub(crate) fn share(seconds: f64, counts: &[u64], i: usize) -> f64 {
    let total: u64 = counts.iter().sum();
    if counts.len() == 1 {
        seconds
    } else if total == 0 {
        seconds / counts.len() as f64
    } else {
        seconds * counts[i] as f64 / total as f64
    }
}

/// Run `plugin` over the group `preps`: each problem's starting states, then the jobs of all
/// of them pooled, problem after problem in natural order, into the pass's schedule. Returns
/// each problem's record, in the group's order.
pub(crate) fn run(
    plugin: &dyn CreditPass,
    cx: &PassContext,
    preps: &[Prepared],
    pb: &ProgressBar,
) -> Result<Vec<ProblemRun>> {
    let pass = plugin.pass();
    // The pool: (problem in the group, job of that problem), problem-major; each problem's
    // jobs are one contiguous range of it.
    let pooled: Vec<(usize, usize)> = preps
        .iter()
        .enumerate()
        .flat_map(|(q, pr)| (0..pr.ids.len()).map(move |j| (q, j)))
        .collect();
    let mut ranges: Vec<Range<usize>> = Vec::with_capacity(preps.len());
    for pr in preps {
        let at = ranges.last().map_or(0, |r| r.end);
        ranges.push(at..at + pr.ids.len());
    }
    pb.set_prefix(pass.as_str());
    pb.set_length(pooled.len() as u64);
    pb.set_position(0);
    let started = Instant::now();
    let starts = preps
        .iter()
        .map(|pr| plugin.starts(cx, &pr.roll, &pr.pivots))
        .collect::<Result<Vec<_>>>()?;
    let seed = cx.spec.seed;
    let jobs: Vec<Job> = pooled
        .iter()
        .map(|&(q, j)| {
            let pr = &preps[q];
            let id = &pr.ids[j];
            let pivot = &pr.pivots[id.pivot];
            Job {
                start: starts[q].start(&pr.roll, id.pivot, pivot),
                first_token: pr.branch_token(id),
                key: NoiseKey {
                    seed,
                    problem: pr.problem as u64,
                    pivot: pivot.pos as u64,
                    branch: id.branch as u64,
                    sample: id.sample as u64,
                    step: 0,
                },
            }
        })
        .collect();
    let schedule = plugin.schedule(&cx.spec.passes, cx.what, pooled.len())?;
    let (run, rows) = run_jobs(cx, pass, &jobs, &schedule, pb)?;
    pb.set_position(pooled.len() as u64);
    let device = cx.model.decoder.device();
    sync(device);
    let seconds = started.elapsed().as_secs_f64();
    let base = PassNumerics {
        engine: run.stats.mode.clone(),
        schedule: schedule.name.clone(),
        batch_rows: rows,
        key_pad: schedule.key_pad,
        sampler: cx.settings.sampler_name(device),
        glue: cx.settings.glue_name(device),
        ..PassNumerics::default()
    };
    // Every sampled token of a continuation was one live row of one step.
    let tokens: Vec<u64> = ranges
        .iter()
        .zip(&starts)
        .map(|(r, s)| {
            s.tokens
                + run.outcomes[r.clone()]
                    .iter()
                    .map(|o| o.tokens.len() as u64)
                    .sum::<u64>()
        })
        .collect();
    Ok(ranges
        .iter()
        .zip(&starts)
        .enumerate()
        .map(|(q, (r, s))| ProblemRun {
            outcomes: run.outcomes[r.clone()].to_vec(),
            audit: PassAudit {
                placements: run.placements[r.clone()].to_vec(),
                verified: run.verified[r.clone()].to_vec(),
                paths: run.paths[r.clone()].to_vec(),
            },
            cost: PassCost {
                device_seconds: share(seconds, &tokens, q),
                tokens: tokens[q],
                continuations: r.len() as u64,
            },
            numerics: path_numerics(&run.paths[r.clone()], &base),
            checks: engine::count_checks(&jobs[r.clone()], &run.verified[r.clone()]),
            spectrum: s.spectrum,
        })
        .collect())
}

/// Run `jobs` under `schedule` with the engine of the run, reporting tokens per second on
/// `pb`; returns the run and its widest batch. An out-of-memory error names the batch key to
/// lower.
fn run_jobs(
    cx: &PassContext,
    pass: Pass,
    jobs: &[Job],
    schedule: &Schedule,
    pb: &ProgressBar,
) -> Result<(engine::PassRun, usize)> {
    let mut since = Instant::now();
    let mut recent = 0u64;
    let mut on_tokens = |k: u64| {
        recent += k;
        let dt = since.elapsed().as_secs_f64();
        if dt > 1.0 {
            pb.set_message(format!("{:.1} tok/s", recent as f64 / dt));
            since = Instant::now();
            recent = 0;
        }
    };
    let opts = EngineOptions {
        mode: cx.settings.engine,
        key_pad: schedule.key_pad,
    };
    let rows = schedule.plan.rows();
    let run = match &schedule.plan {
        Plan::Queue { order, width } => {
            engine::run_queue(cx.decoding, jobs, order, *width, &opts, &mut on_tokens)
        }
        Plan::Batches(batches) => {
            engine::run_batches(cx.decoding, jobs, batches, &opts, &mut on_tokens)
        }
    }
    .map_err(|e| {
        let what = format!("{} pass, batch size {rows}", pass.as_str());
        match e {
            Error::OutOfMemory(m) => {
                Error::OutOfMemory(format!("{what}: {m}; try a smaller {}", schedule.batch_key))
            }
            other => other.context(&what),
        }
    })?;
    Ok((run, rows))
}

/// A pass's numerical path over some of its continuations: `base` (engine, schedule, kernels)
/// with the rows, key axes and steps of `paths`.
fn path_numerics(paths: &[NumericalPath], base: &PassNumerics) -> PassNumerics {
    let mut n = base.clone();
    for p in paths {
        n.widen(p.rows_range(), p.keys_range(), p.steps.len() as u64);
    }
    n
}
