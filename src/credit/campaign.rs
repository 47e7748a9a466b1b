//! Running a campaign: per problem a rollout, pivots, the three passes of continuations, grading
//! and estimates, written as one atomic shard; a rerun skips finished shards, and the merged
//! tables are rebuilt from the shards at the end.
use super::estimate::{Estimate, estimate};
use super::records;
use super::rollout::{self, Pivot, Rollout, RolloutParams};
use super::spec::{CampaignSpec, Pass, ReplicaSchedule};
use crate::decode::engine::{self, Decoding, EngineOptions, Job, Outcome, Placement, Start, Stop};
use crate::decode::schedule;
use crate::exec::{ExecPolicy, ExecSettings};
use crate::io::parquet::Table;
use crate::io::schema::RecordedSpec;
use crate::kv_cache::{KvCache, Snapshot};
use crate::model::LogitsAt;
use crate::runtime::LoadedModel;
use crate::sampling::NoiseKey;
use crate::study::{commit_shard, merge_table, prepare_shards, read_json, sync, write_json};
use crate::tasks::gsm8k::Gsm8k;
use crate::tasks::{Grade, Problem, Task};
use crate::{Error, Result};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tch::Tensor;

pub use crate::io::schema::{Manifest, PassCost, TABLES};

/// Per-shard bookkeeping, stored next to the shard's tables.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ShardInfo {
    /// Cost per pass name (plus `rollout`).
    pub cost: BTreeMap<String, PassCost>,
    /// Exact/replica continuations whose starting K/V had a fingerprint to verify.
    pub snapshot_checks: u64,
    /// Of those, the verified ones (counted after the comparison matched).
    pub snapshot_hits: u64,
    /// Distinct snapshots (pivots) verified, summed over the exact and replica passes.
    #[serde(default)]
    pub snapshot_checks_pivots: u64,
    /// Of those, the snapshots every continuation of which was verified.
    #[serde(default)]
    pub snapshot_hits_pivots: u64,
    /// Pivots in this problem.
    pub pivots: u64,
}

/// Where a campaign writes and how it reports.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Output folder.
    pub out_dir: PathBuf,
    /// Hide progress bars.
    pub quiet: bool,
    /// Tiles and engine as resolved from the command's arguments (`None`: the model device's
    /// defaults).
    pub exec: Option<ExecSettings>,
}

pub use crate::study::now_rfc3339;

fn shard_dir(out: &Path, problem: usize) -> PathBuf {
    out.join("shards").join(format!("problem-{problem:05}"))
}

/// Run (or resume) a campaign; returns the final manifest.
pub fn run_campaign(
    spec: &CampaignSpec,
    spec_sha256: &str,
    model: &LoadedModel,
    opts: &RunOptions,
) -> Result<Manifest> {
    spec.validate()?;
    // Everything a spec can get wrong is found before the first write to the run folder.
    let (task, problems) = spec.problems.task()?;
    check_positions(spec, model, &task)?;
    let out = &opts.out_dir;
    let manifest_path = out.join("manifest.json");
    let settings = opts
        .exec
        .unwrap_or_else(|| ExecSettings::defaults(model.decoder.device()));
    let record = settings.record(spec.policy, Some(settings.engine));
    let mut manifest = if manifest_path.exists() {
        let mut m: Manifest = read_json(&manifest_path)?;
        if m.spec_sha256 != spec_sha256 {
            return Err(Error::Spec(format!(
                "{} holds a run of a different spec (sha256 {}…); use another --out",
                out.display(),
                &m.spec_sha256[..12]
            )));
        }
        m.exec.resume_with(&record, &out.display().to_string())?;
        m.resumed_at.push(now_rfc3339());
        m
    } else {
        Manifest {
            name: spec.name.clone(),
            spec_sha256: spec_sha256.to_string(),
            spec: RecordedSpec::Full(Box::new(spec.clone())),
            model: model.name.clone(),
            model_sha256: model.sha256.clone(),
            dtype: spec.dtype,
            device: spec.device.clone(),
            exec: record,
            replica_schedule: spec.passes.replica_schedule,
            k: u32::try_from(spec.continuations.k)
                .map_err(|_| Error::Spec("continuations.k does not fit in 32 bits".into()))?,
            seed: spec.seed,
            kvcredit_version: env!("CARGO_PKG_VERSION").to_string(),
            libtorch_version: env!("KVCREDIT_LIBTORCH_VERSION").to_string(),
            started_at: now_rfc3339(),
            resumed_at: vec![],
            finished_at: None,
            problems_total: spec.problems.count,
            problems_done: 0,
            snapshot_checks: 0,
            snapshot_hits: 0,
            snapshot_hit_rate: 1.0,
            snapshot_checks_pivots: Some(0),
            snapshot_hits_pivots: Some(0),
            cost: BTreeMap::new(),
        }
    };
    write_json(&manifest_path, &manifest)?;
    prepare_shards(out)?;

    let bars = MultiProgress::with_draw_target(if opts.quiet {
        ProgressDrawTarget::hidden()
    } else {
        ProgressDrawTarget::stderr()
    });
    let pb_problems = bars.add(ProgressBar::new(problems.len() as u64));
    pb_problems.set_style(
        ProgressStyle::with_template(
            "problems  {bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .map_err(|e| Error::Output(e.to_string()))?,
    );
    let pb_work = bars.add(ProgressBar::new(0));
    pb_work.set_style(
        ProgressStyle::with_template("{prefix:8} {bar:30} {pos}/{len} continuations, {msg}")
            .map_err(|e| Error::Output(e.to_string()))?,
    );

    for problem in &problems {
        let dir = shard_dir(out, problem.index);
        if !dir.exists() {
            pb_problems.set_message(format!("problem {}", problem.index));
            let shard = run_problem(spec, &settings, model, &task, problem, &pb_work)
                .map_err(|e| e.context(&format!("problem {}", problem.index)))?;
            let named: Vec<(&str, &Table)> = TABLES.iter().copied().zip(&shard.tables).collect();
            commit_shard(&dir, &named, &shard.info)?;
        }
        pb_problems.inc(1);
        refresh_manifest(&mut manifest, out, &problems)?;
        write_json(&manifest_path, &manifest)?;
    }
    pb_work.finish_and_clear();
    pb_problems.finish();

    let dirs: Vec<PathBuf> = problems.iter().map(|p| shard_dir(out, p.index)).collect();
    for name in TABLES {
        merge_table(&dirs, name, out)?;
    }
    manifest.finished_at = Some(now_rfc3339());
    write_json(&manifest_path, &manifest)?;
    Ok(manifest)
}

/// Refuse, before anything is written, a campaign whose longest prompt plus the rollout and
/// continuation token caps exceeds the model's positions.
fn check_positions(spec: &CampaignSpec, model: &LoadedModel, task: &Gsm8k) -> Result<()> {
    if model.decoder.context_limit().is_none() {
        return Ok(());
    }
    let (mut longest, mut which) = (0, 0);
    for p in task.problems() {
        let n = model.encode_prompt(&task.prompt(p))?.len();
        if n > longest {
            (longest, which) = (n, p.index);
        }
    }
    let (r, c) = (
        spec.rollout.max_new_tokens,
        spec.continuations.max_new_tokens,
    );
    model.decoder.check_context(
        longest.saturating_add(r).saturating_add(c),
        &format!(
            "campaign `{}` (problem {which}: {longest} prompt + {r} rollout.max_new_tokens + {c} continuations.max_new_tokens)",
            spec.name
        ),
    )
}

fn refresh_manifest(m: &mut Manifest, out: &Path, problems: &[Problem]) -> Result<()> {
    let (mut done, mut checks, mut hits, mut pivot_checks, mut pivot_hits) = (0, 0, 0, 0, 0);
    let mut cost: BTreeMap<String, PassCost> = BTreeMap::new();
    for p in problems {
        let path = shard_dir(out, p.index).join("shard.json");
        if !path.exists() {
            continue;
        }
        let info: ShardInfo = read_json(&path)?;
        done += 1;
        checks += info.snapshot_checks;
        hits += info.snapshot_hits;
        pivot_checks += info.snapshot_checks_pivots;
        pivot_hits += info.snapshot_hits_pivots;
        for (pass, c) in info.cost {
            cost.entry(pass).or_default().add(&c);
        }
    }
    m.problems_done = done;
    m.snapshot_checks = checks;
    m.snapshot_hits = hits;
    m.snapshot_checks_pivots = Some(pivot_checks);
    m.snapshot_hits_pivots = Some(pivot_hits);
    m.snapshot_hit_rate = if checks == 0 {
        1.0
    } else {
        hits as f64 / checks as f64
    };
    m.cost = cost;
    Ok(())
}

/// One problem's tables and bookkeeping.
struct Shard {
    tables: [Table; 4],
    info: ShardInfo,
}

/// Where a pass ran each continuation and whether its start was verified, indexed like the
/// jobs.
pub(crate) struct PassAudit {
    /// Batch and row of each job.
    pub placements: Vec<Placement>,
    /// The job's starting K/V matched its decode-time fingerprint.
    pub verified: Vec<bool>,
}

/// One continuation job's coordinates.
#[derive(Debug, Clone, Copy)]
pub(crate) struct JobId {
    /// Index into the pivots.
    pub pivot: usize,
    /// 0 = original token, r = alternative of rank r.
    pub branch: usize,
    /// Sample index k.
    pub sample: usize,
}

fn run_problem(
    spec: &CampaignSpec,
    settings: &ExecSettings,
    model: &LoadedModel,
    task: &Gsm8k,
    problem: &Problem,
    pb: &ProgressBar,
) -> Result<Shard> {
    let dec = &model.decoder;
    let device = dec.device();
    let policy = settings.policy(spec.policy);
    let prompt = model.encode_prompt(&task.prompt(problem))?;
    let stops = task.stop_sequences();
    let text_stop = |ids: &[i64]| -> bool {
        model
            .decode(ids)
            .map(|t| stops.iter().any(|s| t.contains(s)))
            .unwrap_or(false)
    };
    let text_stop_ref: &dyn Fn(&[i64]) -> bool = &text_stop;
    let mut info = ShardInfo::default();

    let t0 = Instant::now();
    let roll = rollout::rollout(
        dec,
        &prompt,
        &RolloutParams {
            sampling: spec.rollout_sampling(),
            max_new_tokens: spec.rollout.max_new_tokens,
            key: NoiseKey::rollout(spec.seed, problem.index as u64),
            stop_tokens: &model.stop_tokens,
            special_tokens: &model.special_tokens,
            text_stop: Some(text_stop_ref),
            policy,
            max_margin: spec.pivots.max_margin,
            alternatives: spec.pivots.alternatives,
        },
    )?;
    sync(device);
    info.cost.insert(
        "rollout".into(),
        PassCost {
            device_seconds: t0.elapsed().as_secs_f64(),
            tokens: (prompt.len() + roll.steps.len()) as u64,
            continuations: 0,
        },
    );
    let pivots = rollout::select_pivots(&roll.steps, &spec.pivots);
    info.pivots = pivots.len() as u64;

    // Jobs in natural order: pivot, branch, sample.
    let branches = 1 + spec.pivots.alternatives;
    let mut ids = Vec::new();
    for (p, pivot) in pivots.iter().enumerate() {
        for branch in 0..branches.min(1 + pivot.alternatives.len()) {
            for sample in 0..spec.continuations.k {
                ids.push(JobId {
                    pivot: p,
                    branch,
                    sample,
                });
            }
        }
    }
    let branch_token = |id: &JobId| {
        let p = &pivots[id.pivot];
        if id.branch == 0 {
            p.token
        } else {
            p.alternatives[id.branch - 1]
        }
    };
    let key = |id: &JobId| NoiseKey {
        seed: spec.seed,
        problem: problem.index as u64,
        pivot: pivots[id.pivot].pos as u64,
        branch: id.branch as u64,
        sample: id.sample as u64,
        step: 0,
    };
    let decoding = Decoding {
        model: dec,
        policy,
        sampling: spec.continuation_sampling(),
        max_new_tokens: spec.continuations.max_new_tokens,
        stop_tokens: &model.stop_tokens,
        text_stop: Some(text_stop_ref),
    };
    let exact_batches = schedule::exact(ids.len(), spec.passes.batch_size);

    let mut outcomes: BTreeMap<Pass, Vec<Outcome>> = BTreeMap::new();
    let mut audits: BTreeMap<Pass, PassAudit> = BTreeMap::new();
    for &pass in &spec.passes.run {
        pb.set_prefix(pass.as_str());
        pb.set_length(ids.len() as u64);
        pb.set_position(0);
        let started = Instant::now();
        let mut tokens = 0u64;
        // Refeed: one fresh prefill of prompt ⊕ y_<t per pivot, as token ids.
        let refeed_caches: Vec<KvCache> = if pass == Pass::Refeed {
            pivots
                .iter()
                .map(|p| refeed_prefix(model, &roll, p, &mut tokens, &policy))
                .collect::<Result<_>>()?
        } else {
            vec![]
        };
        let jobs: Vec<Job> = ids
            .iter()
            .map(|id| {
                let pivot = &pivots[id.pivot];
                let start = match pass {
                    Pass::Exact | Pass::Replica => Start {
                        cache: &roll.cache,
                        snap: roll.snapshot(pivot.pos),
                        expect: Some(pivot.fingerprint),
                    },
                    Pass::Refeed => Start {
                        cache: &refeed_caches[id.pivot],
                        snap: Snapshot {
                            row: 0,
                            len: roll.snapshot(pivot.pos).len,
                        },
                        expect: None,
                    },
                };
                Job {
                    start,
                    first_token: branch_token(id),
                    key: key(id),
                }
            })
            .collect();
        let batches = match (pass, spec.passes.replica_schedule) {
            (Pass::Replica, ReplicaSchedule::Shuffled) => {
                replica_batches(spec, problem.index, &exact_batches)?
            }
            _ => exact_batches.clone(),
        };
        let mut since = Instant::now();
        let mut recent = 0u64;
        let mut on_tokens = |n: u64| {
            tokens += n;
            recent += n;
            let dt = since.elapsed().as_secs_f64();
            if dt > 1.0 {
                pb.set_message(format!("{:.1} tok/s", recent as f64 / dt));
                since = Instant::now();
                recent = 0;
            }
        };
        let run = engine::run_batches(
            &decoding,
            &jobs,
            &batches,
            &EngineOptions {
                mode: settings.engine,
            },
            &mut on_tokens,
        )
        .map_err(|e| {
            let rows = batches.iter().map(Vec::len).max().unwrap_or(0);
            let what = format!("{} pass, batch size {rows}", pass.as_str());
            match e {
                Error::OutOfMemory(m) => Error::OutOfMemory(format!(
                    "{what}: {m}; try a smaller {}",
                    if pass == Pass::Replica
                        && spec.passes.replica_schedule == ReplicaSchedule::Shuffled
                        && spec.passes.replica_batch_size.is_some()
                    {
                        "passes.replica_batch_size"
                    } else {
                        "passes.batch_size"
                    }
                )),
                other => other.context(&what),
            }
        })?;
        pb.set_position(ids.len() as u64);
        sync(device);
        info.snapshot_checks += run.checks.checks;
        info.snapshot_hits += run.checks.hits;
        info.snapshot_checks_pivots += run.checks.snapshots;
        info.snapshot_hits_pivots += run.checks.snapshot_hits;
        info.cost.insert(
            pass.as_str().into(),
            PassCost {
                device_seconds: started.elapsed().as_secs_f64(),
                tokens,
                continuations: ids.len() as u64,
            },
        );
        outcomes.insert(pass, run.outcomes);
        audits.insert(
            pass,
            PassAudit {
                placements: run.placements,
                verified: run.verified,
            },
        );
    }

    // Grading; outputs that hit the token cap are graded per `continuations.truncated`.
    let grade = |text: &str, stop: Stop| -> Grade {
        let mut g = task.grade(problem, text);
        g.correct = spec.continuations.truncated.correct(&g, stop);
        g
    };
    let generated = roll.tokens();
    let rollout_text = model.decode(&generated)?;
    let rollout_grade = grade(&rollout_text, roll.stop);
    let mut graded: BTreeMap<Pass, Vec<Grade>> = BTreeMap::new();
    for (&pass, outs) in &outcomes {
        let g = ids
            .iter()
            .zip(outs)
            .map(|(id, o)| {
                let pos = pivots[id.pivot].pos;
                let mut seq = generated[..pos].to_vec();
                seq.push(branch_token(id));
                seq.extend_from_slice(&o.tokens);
                Ok(grade(&model.decode(&seq)?, o.stop))
            })
            .collect::<Result<Vec<_>>>()?;
        graded.insert(pass, g);
    }
    let mut estimates: Vec<Estimate> = Vec::new();
    for (&pass, g) in &graded {
        for (p, pivot) in pivots.iter().enumerate() {
            let wins = |branch: usize| -> u32 {
                ids.iter()
                    .zip(g)
                    .filter(|(id, _)| id.pivot == p && id.branch == branch)
                    .filter(|(_, g)| g.correct)
                    .count() as u32
            };
            let verified = |rank: usize| {
                ids.iter()
                    .zip(&audits[&pass].verified)
                    .filter(|(id, _)| id.pivot == p && (id.branch == 0 || id.branch == rank))
                    .all(|(_, &ok)| ok)
            };
            for rank in 1..=pivot.alternatives.len().min(spec.pivots.alternatives) {
                let mut e = estimate(
                    pass,
                    p,
                    rank,
                    wins(0),
                    wins(rank),
                    spec.continuations.k as u32,
                );
                e.snapshot_verified = verified(rank);
                estimates.push(e);
            }
        }
    }
    let ctx = records::Context {
        config: &spec.name,
        model: &model.name,
        dtype: &spec.dtype.to_string(),
        policy: &spec.policy.to_string(),
        problem: problem.index as u32,
    };
    let tables = [
        records::rollouts(
            &ctx,
            &roll,
            &rollout_text,
            &rollout_grade,
            pivots.len(),
            model,
        )?,
        records::pivots(&ctx, &roll, &pivots, model)?,
        records::continuations(&ctx, &pivots, &ids, &outcomes, &audits, &graded),
        records::estimates(&ctx, &roll, &pivots, &estimates, model)?,
    ];
    Ok(Shard { tables, info })
}

/// A problem's shuffled replica batches ([`schedule::shuffled`]); refuses a grouping equal to
/// exact's (which the schedule avoids for every problem with two or more continuations unless
/// both batch sizes are 1, a spec `validate` rejects).
fn replica_batches(
    spec: &CampaignSpec,
    problem: usize,
    exact: &[Vec<usize>],
) -> Result<schedule::Batches> {
    let n = exact.iter().map(Vec::len).sum();
    let r = spec.passes.effective_replica_batch_size();
    let replica = schedule::shuffled(n, spec.passes.batch_size, r);
    if n > 0 && schedule::same_grouping(&replica, exact) {
        return Err(Error::Spec(format!(
            "problem {problem}: the shuffled replica would run exact's batches ({n} continuations, passes.batch_size = {}, passes.replica_batch_size = {r}); change passes.replica_batch_size",
            spec.passes.batch_size
        )));
    }
    Ok(replica)
}

/// Prefill `prompt ⊕ y_<t` afresh into a cache with room for the continuation.
fn refeed_prefix(
    model: &LoadedModel,
    roll: &Rollout,
    pivot: &Pivot,
    tokens: &mut u64,
    policy: &ExecPolicy,
) -> Result<KvCache> {
    let mut ids = roll.prompt.clone();
    ids.extend(roll.steps[..pivot.pos].iter().map(|s| s.token));
    *tokens += ids.len() as u64;
    let mut cache = model.decoder.new_cache(1, ids.len() as i64)?;
    let t = Tensor::from_slice(&ids).view([1, -1]);
    let _ = model
        .decoder
        .forward(&t, &mut cache, policy, &LogitsAt::Last)?;
    Ok(cache)
}
