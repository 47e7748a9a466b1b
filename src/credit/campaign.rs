//! Running a campaign: per problem a rollout, pivots, the passes of continuations, grading
//! and estimates, written as one atomic shard; a rerun skips finished shards, and the merged
//! tables are rebuilt from the shards at the end.
use super::estimate::{Estimate, estimate};
use super::records::{self, JobId, PassAudit};
use super::rollout::{self, Pivot, Rollout, RolloutParams};
use super::spec::{CampaignSpec, Pass, ReplicaSchedule, SpectrumPass};
use crate::decode::engine::{self, Decoding, EngineMode, EngineOptions, Job, Outcome, Start, Stop};
use crate::decode::schedule;
use crate::exec::{ExecPolicy, ExecSettings, PolicyKind};
use crate::io::parquet::Table;
use crate::io::schema::{ExecRecord, RecordedSpec, RunHeader, RunOrigin};
use crate::kv_cache::{KvCache, Snapshot};
use crate::model::LogitsAt;
use crate::runtime::LoadedModel;
use crate::sampling::NoiseKey;
use crate::spectrum::eval;
use crate::study::{
    commit_shard, lock_run, merge_table, prepare_shards, read_json, sync, table_hashes, write_json,
};
use crate::tasks::{Grade, Problem, SpecTask, Task};
use crate::{Error, Result};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tch::Tensor;

pub use crate::io::schema::{
    Manifest, PassCost, PassNumerics, PassSchedule, PassState, ShardSpec, SpectrumStats, TABLES,
};

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
    /// The spectrum pass's frames, when it ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spectrum: Option<SpectrumStats>,
    /// The numerical path of each pass over this problem's continuations.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub numerics: BTreeMap<String, PassNumerics>,
}

/// Where a campaign writes and how it reports.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Output folder.
    pub out_dir: PathBuf,
    /// Hide progress bars.
    pub quiet: bool,
    /// Run only this shard of the spec's problems (recorded in the manifest); `None` runs
    /// them all.
    pub shard: Option<ShardSpec>,
    /// Tiles and engine as resolved from the command's arguments (`None`: the model device's
    /// defaults).
    pub exec: Option<ExecSettings>,
}

pub use crate::study::now_rfc3339;

fn shard_dir(out: &Path, problem: usize) -> PathBuf {
    out.join("shards").join(format!("problem-{problem:05}"))
}

/// Whether the run in `out` is finished: its manifest has `finished_at` and its four tables
/// are there. A finished run is final; its `shards/` may have been deleted.
fn is_finished(manifest: &Manifest, out: &Path) -> bool {
    manifest.run.finished_at.is_some()
        && TABLES
            .iter()
            .all(|t| out.join(format!("{t}.parquet")).exists())
}

/// The finished run of this spec, shard, `passes.pool_problems` and `passes.refill` in `out`,
/// if there is one
/// (see [`run_campaign`], which returns it untouched); `None` for a missing, unfinished or
/// other run, which [`run_campaign`] resumes or refuses.
pub fn finished_run(
    spec: &CampaignSpec,
    spec_sha256: &str,
    out: &Path,
    shard: Option<ShardSpec>,
) -> Result<Option<Manifest>> {
    let path = out.join("manifest.json");
    if !path.exists() {
        return Ok(None);
    }
    let m: Manifest = read_json(&path)?;
    let same = m.run.spec_sha256 == spec_sha256
        && m.shard == shard
        && m.pool_problems.unwrap_or(1) == spec.passes.pool_problems
        && m.refill.unwrap_or(false) == spec.passes.refill;
    // Same spec, other data: not this run (and `run_campaign` refuses to resume it).
    let same_task = match &m.task {
        Some(was) => *was == spec.task()?.0.record(),
        None => true,
    };
    Ok((same && same_task && is_finished(&m, out)).then_some(m))
}

/// Run (or resume) a campaign; returns the final manifest. A finished run of this spec in
/// the output folder is returned as it is once the spec's checks pass, without running or
/// writing anything, even when its shards were deleted.
pub fn run_campaign(
    spec: &CampaignSpec,
    spec_sha256: &str,
    model: &LoadedModel,
    opts: &RunOptions,
) -> Result<Manifest> {
    spec.validate()?;
    // Everything a spec can get wrong is found before the first write to the run folder.
    let (task, all) = spec.task()?;
    let problems = match opts.shard {
        Some(shard) => shard_problems(shard, &all, spec.passes.pool_problems)?,
        None => all,
    };
    check_positions(spec, model, &task)?;
    check_spectrum_budget(spec, model, &task)?;
    let out = &opts.out_dir;
    // One process per run folder; held until this returns.
    let _lock = lock_run(out)?;
    let manifest_path = out.join("manifest.json");
    let settings = opts
        .exec
        .unwrap_or_else(|| ExecSettings::defaults(model.decoder.device()));
    let record = settings.record(spec.policy, Some(settings.engine));
    let mut manifest = if manifest_path.exists() {
        let mut m: Manifest = read_json(&manifest_path)?;
        check_resume(&mut m, spec, spec_sha256, opts, &record, &task)?;
        if is_finished(&m, out) {
            return Ok(m);
        }
        m.run.resumed_at.push(now_rfc3339());
        m.failure = None;
        m
    } else {
        new_manifest(
            spec,
            spec_sha256,
            model,
            record,
            &task,
            problems.len(),
            opts.shard,
        )?
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

    // Shards select whole groups, and only the spec's last group is short, so the selected
    // problems chunk into the spec's groups.
    for group in problems.chunks(spec.passes.pool_problems) {
        // A group with any shard missing runs again whole (same pools, same numerics); only
        // the missing shards are written.
        if group.iter().any(|p| !shard_dir(out, p.index).exists()) {
            let what = match group {
                [one] => format!("problem {}", one.index),
                [a, .., b] => format!("problems {}-{}", a.index, b.index),
                [] => String::new(),
            };
            pb_problems.set_message(what.clone());
            let shards = match run_group(spec, &settings, model, &task, group, &pb_work) {
                Ok(shards) => shards,
                Err(e) => {
                    // The finished shards stay; the manifest says why this invocation stopped.
                    let e = e.context(&what);
                    manifest.failure = e.to_string().lines().next().map(str::to_string);
                    refresh_manifest(&mut manifest, out, &problems)?;
                    write_json(&manifest_path, &manifest)?;
                    return Err(e);
                }
            };
            for (problem, shard) in group.iter().zip(shards) {
                let dir = shard_dir(out, problem.index);
                if !dir.exists() {
                    let named: Vec<(&str, &Table)> =
                        TABLES.iter().copied().zip(&shard.tables).collect();
                    commit_shard(&dir, &named, &shard.info)?;
                }
            }
        }
        pb_problems.inc(group.len() as u64);
        refresh_manifest(&mut manifest, out, &problems)?;
        write_json(&manifest_path, &manifest)?;
    }
    pb_work.finish_and_clear();
    pb_problems.finish();
    finish(&mut manifest, out, &problems)?;
    Ok(manifest)
}

/// Refuse to resume the run `m` in `opts.out_dir` with another spec, shard, pooling, refill,
/// numerical path or task; fill in what an older run did not record.
fn check_resume(
    m: &mut Manifest,
    spec: &CampaignSpec,
    spec_sha256: &str,
    opts: &RunOptions,
    record: &ExecRecord,
    task: &SpecTask,
) -> Result<()> {
    let out = &opts.out_dir;
    m.run.check_spec(spec_sha256, out)?;
    if m.shard != opts.shard {
        let was = |s: Option<ShardSpec>| match s {
            Some(s) => format!("shard {s}"),
            None => "the whole campaign".into(),
        };
        return Err(Error::Spec(format!(
            "{} holds {} and this run asks for {}; use another --out",
            out.display(),
            was(m.shard),
            was(opts.shard)
        )));
    }
    let pool = |p: Option<usize>| p.unwrap_or(1);
    let asked = spec.passes.pool_problems;
    if pool(m.pool_problems) != asked {
        return Err(Error::Spec(format!(
            "{} holds a run with passes.pool_problems = {} and this run asks for {asked} (other pools, other batches); use another --out",
            out.display(),
            pool(m.pool_problems)
        )));
    }
    let refill = m.refill.unwrap_or(false);
    if refill != spec.passes.refill {
        return Err(Error::Spec(format!(
            "{} holds a run with passes.refill = {refill} and this run asks for {} (other schedules, other batches); use another --out",
            out.display(),
            spec.passes.refill
        )));
    }
    m.run.exec.resume_with(record, &out.display().to_string())?;
    if let Some(was) = &m.task {
        was.resume_with(&task.record(), &out.display().to_string())?;
    }
    Ok(())
}

/// The manifest of a campaign starting now.
fn new_manifest(
    spec: &CampaignSpec,
    spec_sha256: &str,
    model: &LoadedModel,
    record: ExecRecord,
    task: &SpecTask,
    problems_total: usize,
    shard: Option<ShardSpec>,
) -> Result<Manifest> {
    Ok(Manifest {
        run: RunHeader::start(
            RunOrigin {
                study: "credit",
                name: &spec.name,
                spec_sha256,
                model: &model.name,
                model_sha256: model.sha256.as_deref(),
                device: &spec.device,
            },
            record,
        ),
        spec: RecordedSpec::Full(Box::new(spec.clone())),
        task: Some(task.record()),
        dtype: spec.dtype,
        replica_schedule: spec.passes.replica_schedule,
        pool_problems: (spec.passes.pool_problems > 1).then_some(spec.passes.pool_problems),
        refill: spec.passes.refill.then_some(true),
        k: u32::try_from(spec.continuations.k)
            .map_err(|_| Error::Spec("continuations.k does not fit in 32 bits".into()))?,
        seed: spec.seed,
        failure: None,
        problems_total,
        problems_done: 0,
        snapshot_checks: 0,
        snapshot_hits: 0,
        snapshot_hit_rate: 1.0,
        snapshot_checks_pivots: Some(0),
        snapshot_hits_pivots: Some(0),
        cost: BTreeMap::new(),
        numerics: BTreeMap::new(),
        spectrum: None,
        shard,
        merged_from: vec![],
        files_sha256: BTreeMap::new(),
    })
}

/// The end of a run, shared by `campaign run` and `campaign merge`: the manifest's counts and
/// cost from the problems' shards under `out/shards/`, the tables (the shards' tables
/// concatenated in problem order) and the finished manifest.
fn finish(manifest: &mut Manifest, out: &Path, problems: &[Problem]) -> Result<()> {
    refresh_manifest(manifest, out, problems)?;
    let dirs: Vec<PathBuf> = problems.iter().map(|p| shard_dir(out, p.index)).collect();
    for name in TABLES {
        merge_table(&dirs, name, out)?;
    }
    manifest.files_sha256 = table_hashes(out, &TABLES)?;
    manifest.run.finished_at = Some(now_rfc3339());
    write_json(&out.join("manifest.json"), manifest)
}

/// The problems of `shard`: the spec's problems in groups of `pool` consecutive ones
/// (`passes.pool_problems`), the groups dealt round-robin to the shards; refused when it would
/// hold none.
fn shard_problems(shard: ShardSpec, all: &[Problem], pool: usize) -> Result<Vec<Problem>> {
    let shard = ShardSpec::new(shard.index, shard.count).map_err(Error::Spec)?;
    let groups: Vec<&[Problem]> = all.chunks(pool.max(1)).collect();
    if shard.count > groups.len() {
        return Err(Error::Spec(if pool > 1 {
            format!(
                "shard {shard}: the spec has {} problems in {} groups of passes.pool_problems = {pool}, so at most {} shards",
                all.len(),
                groups.len(),
                groups.len()
            )
        } else {
            format!(
                "shard {shard}: the spec has {} problems, so at most {} shards",
                all.len(),
                all.len()
            )
        }));
    }
    Ok(shard.select(&groups).concat())
}

/// Refuse to merge run folders of other specs, refill schedules or (under stock) engines.
fn check_mergeable(dirs: &[PathBuf], manifests: &[Manifest]) -> Result<()> {
    let (first, first_dir) = (&manifests[0], &dirs[0]);
    for (d, m) in dirs.iter().zip(manifests).skip(1) {
        if m.run.spec_sha256 != first.run.spec_sha256 {
            return Err(Error::Spec(format!(
                "{} ran a different spec (sha256 {}…) from {} (sha256 {}…); merge shards of one spec",
                d.display(),
                &m.run.spec_sha256[..m.run.spec_sha256.len().min(12)],
                first_dir.display(),
                &first.run.spec_sha256[..first.run.spec_sha256.len().min(12)]
            )));
        }
        if m.refill != first.refill {
            let on = |m: &Manifest| m.refill.unwrap_or(false);
            return Err(Error::Spec(format!(
                "{} ran with passes.refill = {} and {} with {}; merge shards of one schedule",
                d.display(),
                on(m),
                first_dir.display(),
                on(first)
            )));
        }
        if m.run.exec.policy == PolicyKind::Stock && m.run.exec.engine != first.run.exec.engine {
            let name = |e: Option<EngineMode>| e.map_or("an unrecorded".into(), |e| e.to_string());
            return Err(Error::Spec(format!(
                "{} ran the {} engine and {} the {} one (stock numerics differ between them); rerun one with --engine set",
                d.display(),
                name(m.run.exec.engine),
                first_dir.display(),
                name(first.run.exec.engine)
            )));
        }
    }
    Ok(())
}

/// Merge the run folders of one spec's shards (`campaign run --shard i/N`, or unsharded runs)
/// into `out`: their per-problem shards are copied to `out/shards/` and the tables are written
/// by the same code that ends an unsharded run, so they are byte-identical to one. Refused,
/// before anything is written, when the folders ran different specs (`spec_sha256`), hold a
/// problem twice, or together miss a problem (one not in any folder's shard, or not finished
/// there).
pub fn merge_campaign(dirs: &[PathBuf], out: &Path) -> Result<Manifest> {
    let Some(first_dir) = dirs.first() else {
        return Err(Error::Spec("merge: no run folders given".into()));
    };
    let manifests: Vec<Manifest> = dirs
        .iter()
        .map(|d| {
            let path = d.join("manifest.json");
            if !path.is_file() {
                return Err(Error::Spec(format!(
                    "{} has no manifest.json (not a campaign run folder)",
                    d.display()
                )));
            }
            read_json(&path)
        })
        .collect::<Result<_>>()?;
    check_mergeable(dirs, &manifests)?;
    let first = &manifests[0];
    let crate::io::schema::RecordedSpec::Full(spec) = &first.spec else {
        return Err(Error::Spec(format!(
            "{}: the manifest does not record the full spec (an older run); it cannot be merged",
            first_dir.display()
        )));
    };
    let (_, problems) = spec.task()?;
    let label = |m: &Manifest| m.shard.unwrap_or(ShardSpec::WHOLE);
    // Which folder holds each problem, refusing overlaps and unfinished problems.
    let mut holder: BTreeMap<usize, usize> = BTreeMap::new();
    for (k, (d, m)) in dirs.iter().zip(&manifests).enumerate() {
        let held = match m.shard {
            Some(s) => shard_problems(s, &problems, spec.passes.pool_problems)?,
            None => problems.clone(),
        };
        for p in &held {
            if let Some(&other) = holder.get(&p.index) {
                return Err(Error::Spec(format!(
                    "problem {} is in both {} (shard {}) and {} (shard {}); merge each problem once",
                    p.index,
                    dirs[other].display(),
                    label(&manifests[other]),
                    d.display(),
                    label(m)
                )));
            }
            if !shard_dir(d, p.index).join("shard.json").is_file() {
                return Err(Error::Spec(format!(
                    "problem {} of {} (shard {}) has not finished; rerun that shard to complete it",
                    p.index,
                    d.display(),
                    label(m)
                )));
            }
            holder.insert(p.index, k);
        }
    }
    let missing: Vec<usize> = problems
        .iter()
        .map(|p| p.index)
        .filter(|i| !holder.contains_key(i))
        .collect();
    if let Some(&one) = missing.first() {
        let shown: Vec<String> = missing.iter().take(8).map(|i| i.to_string()).collect();
        return Err(Error::Spec(format!(
            "{} of the spec's {} problems are in none of the given runs (problem{} {}{}); the first missing, {one}, belongs to shard {}",
            missing.len(),
            problems.len(),
            if missing.len() == 1 { "" } else { "s" },
            shown.join(", "),
            if missing.len() > shown.len() {
                ", …"
            } else {
                ""
            },
            {
                let n = first.shard.map_or(1, |s| s.count);
                let j = problems.iter().position(|p| p.index == one).unwrap_or(0);
                format!("{}/{n}", (j / spec.passes.pool_problems.max(1)) % n)
            }
        )));
    }
    // The output folder: new, or an earlier merge of the same spec.
    let out_manifest = out.join("manifest.json");
    let _lock = lock_run(out)?;
    let canon = |p: &Path| std::fs::canonicalize(p).ok();
    if canon(out).is_some() && dirs.iter().any(|d| canon(d) == canon(out)) {
        return Err(Error::Spec(format!(
            "--out {} is one of the folders being merged; use another",
            out.display()
        )));
    }
    if out_manifest.exists() {
        let m: Manifest = read_json(&out_manifest)?;
        if m.run.spec_sha256 != first.run.spec_sha256 || m.merged_from.is_empty() {
            return Err(Error::Spec(format!(
                "{} already holds a run; merge into another --out",
                out.display()
            )));
        }
    }

    let mut manifest = first.clone();
    manifest.shard = None;
    manifest.merged_from = manifests.iter().map(label).collect();
    manifest.problems_total = problems.len();
    manifest.run.started_at = manifests
        .iter()
        .map(|m| m.run.started_at.clone())
        .min()
        .unwrap_or_default();
    let mut resumed: Vec<String> = manifests
        .iter()
        .flat_map(|m| m.run.resumed_at.iter().cloned())
        .collect();
    resumed.sort();
    manifest.run.resumed_at = resumed;
    manifest.run.finished_at = None;
    let shards = prepare_shards(out)?;
    for p in &problems {
        copy_shard(
            &shard_dir(&dirs[holder[&p.index]], p.index),
            &shards,
            p.index,
        )?;
    }
    finish(&mut manifest, out, &problems)?;
    Ok(manifest)
}

/// Copy a finished per-problem shard folder into `shards` (through a temporary sibling and
/// one rename, like [`commit_shard`]), replacing an earlier copy.
fn copy_shard(src: &Path, shards: &Path, problem: usize) -> Result<()> {
    let dst = shard_dir(shards.parent().unwrap_or(Path::new(".")), problem);
    let tmp = shards.join(format!(".tmp-problem-{problem:05}-{}", std::process::id()));
    let copied = std::fs::create_dir_all(&tmp)
        .map_err(|e| Error::io(&tmp, e))
        .and_then(|()| {
            for entry in std::fs::read_dir(src).map_err(|e| Error::io(src, e))? {
                let entry = entry.map_err(|e| Error::io(src, e))?;
                let to = tmp.join(entry.file_name());
                std::fs::copy(entry.path(), &to).map_err(|e| Error::io(&to, e))?;
            }
            if dst.exists() {
                std::fs::remove_dir_all(&dst).map_err(|e| Error::io(&dst, e))?;
            }
            std::fs::rename(&tmp, &dst).map_err(|e| Error::io(&dst, e))
        });
    if copied.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    copied
}

/// Refuse, before anything is written, a campaign whose longest prompt plus the rollout and
/// continuation token caps exceeds the model's positions.
fn check_positions(spec: &CampaignSpec, model: &LoadedModel, task: &SpecTask) -> Result<()> {
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

/// Refuse, before anything is written, a spectrum budget too small for the protected tokens
/// at FP16 on the shortest context a pivot can have (the shortest prompt): the allocator
/// would otherwise fail mid-run.
fn check_spectrum_budget(spec: &CampaignSpec, model: &LoadedModel, task: &SpecTask) -> Result<()> {
    let Some(sp) = spec.spectrum_pass() else {
        return Ok(());
    };
    let v = sp.variant()?;
    let Some(b) = v.b else {
        return Ok(());
    };
    let mut shortest = usize::MAX;
    for p in task.problems() {
        shortest = shortest.min(model.encode_prompt(&task.prompt(p))?.len());
    }
    if shortest == usize::MAX {
        return Ok(());
    }
    let scores = vec![0.0; shortest];
    eval::plan_for(&scores, model.decoder.kv_shape(), &v, sp.protect)
        .map(drop)
        .map_err(|e| {
            Error::Spec(format!(
                "campaign `{}`: passes.spectrum.b = {b} cannot hold the {} protected tokens of a {shortest}-token context: {}",
                spec.name,
                (sp.protect.sinks + sp.protect.recent).min(shortest),
                e.to_string().lines().next().unwrap_or_default()
            ))
        })
}

fn refresh_manifest(m: &mut Manifest, out: &Path, problems: &[Problem]) -> Result<()> {
    let (mut done, mut checks, mut hits, mut pivot_checks, mut pivot_hits) = (0, 0, 0, 0, 0);
    let mut cost: BTreeMap<String, PassCost> = BTreeMap::new();
    let mut numerics: BTreeMap<String, PassNumerics> = BTreeMap::new();
    let mut spectrum: Option<SpectrumStats> = None;
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
        for (pass, n) in info.numerics {
            numerics.entry(pass).or_default().add(&n);
        }
        if let Some(sp) = &info.spectrum {
            spectrum.get_or_insert_with(SpectrumStats::default).add(sp);
        }
    }
    m.spectrum = spectrum;
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
    m.numerics = numerics;
    Ok(())
}

/// One problem's tables and bookkeeping.
struct Shard {
    tables: [Table; 4],
    info: ShardInfo,
}

/// One problem of a group up to its passes: its rollout, pivots and continuation jobs.
struct Prepared {
    roll: Rollout,
    pivots: Vec<Pivot>,
    /// Jobs in natural order: pivot, branch, sample.
    ids: Vec<JobId>,
}

impl Prepared {
    fn branch_token(&self, id: &JobId) -> i64 {
        let p = &self.pivots[id.pivot];
        if id.branch == 0 {
            p.token
        } else {
            p.alternatives[id.branch - 1]
        }
    }
}

/// `seconds` shared among a group's problems in proportion to their `counts` (all of it to
/// a problem alone).
fn share(seconds: f64, counts: &[u64], i: usize) -> f64 {
    let total: u64 = counts.iter().sum();
    if counts.len() == 1 {
        seconds
    } else if total == 0 {
        seconds / counts.len() as f64
    } else {
        seconds * counts[i] as f64 / total as f64
    }
}

/// Run one group of consecutive problems (`passes.pool_problems` of them, one for the
/// per-problem schedule): their rollouts decoded together, then per pass the continuations of
/// all of them pooled, problem after problem in natural order, into the pass's batches. Returns
/// each problem's shard, in the group's order.
fn run_group(
    spec: &CampaignSpec,
    settings: &ExecSettings,
    model: &LoadedModel,
    task: &SpecTask,
    group: &[Problem],
    pb: &ProgressBar,
) -> Result<Vec<Shard>> {
    let dec = &model.decoder;
    let device = dec.device();
    let policy = settings.policy(spec.policy);
    let stops = task.stop_sequences();
    let text_stop = |ids: &[i64]| -> bool {
        model
            .decode(ids)
            .map(|t| stops.iter().any(|s| t.contains(s)))
            .unwrap_or(false)
    };
    let text_stop_ref: &dyn Fn(&[i64]) -> bool = &text_stop;
    let what = match group {
        [one] => format!("problem {}", one.index),
        [a, .., b] => format!("problems {}-{}", a.index, b.index),
        [] => return Ok(vec![]),
    };
    let n = group.len();
    let mut infos: Vec<ShardInfo> = vec![ShardInfo::default(); n];

    let prompts = group
        .iter()
        .map(|p| model.encode_prompt(&task.prompt(p)))
        .collect::<Result<Vec<_>>>()?;
    let keys: Vec<NoiseKey> = group
        .iter()
        .map(|p| NoiseKey::rollout(spec.seed, p.index as u64))
        .collect();
    let t0 = Instant::now();
    let rolls = rollout::rollouts(
        dec,
        &prompts.iter().map(Vec::as_slice).collect::<Vec<_>>(),
        &keys,
        &RolloutParams {
            sampling: spec.rollout_sampling(),
            max_new_tokens: spec.rollout.max_new_tokens,
            key: keys[0],
            stop_tokens: &model.stop_tokens,
            special_tokens: &model.special_tokens,
            text_stop: Some(text_stop_ref),
            policy,
            max_margin: spec.pivots.max_margin,
            alternatives: spec.pivots.alternatives,
        },
    )?;
    sync(device);
    let seconds = t0.elapsed().as_secs_f64();
    let roll_tokens: Vec<u64> = rolls
        .iter()
        .map(|r| (r.prompt.len() + r.steps.len()) as u64)
        .collect();
    let branches = 1 + spec.pivots.alternatives;
    let mut preps = Vec::with_capacity(n);
    for (q, roll) in rolls.into_iter().enumerate() {
        infos[q].cost.insert(
            "rollout".into(),
            PassCost {
                device_seconds: share(seconds, &roll_tokens, q),
                tokens: roll_tokens[q],
                continuations: 0,
            },
        );
        let pivots = rollout::select_pivots(&roll.steps, &spec.pivots);
        infos[q].pivots = pivots.len() as u64;
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
        preps.push(Prepared { roll, pivots, ids });
    }
    // The pool: (problem in the group, job of that problem), problem-major; each problem's
    // jobs are one contiguous range of it.
    let pooled: Vec<(usize, usize)> = preps
        .iter()
        .enumerate()
        .flat_map(|(q, pr)| (0..pr.ids.len()).map(move |j| (q, j)))
        .collect();
    let mut ranges = Vec::with_capacity(n);
    let mut at = 0;
    for pr in &preps {
        ranges.push(at..at + pr.ids.len());
        at += pr.ids.len();
    }
    let key = |q: usize, id: &JobId| NoiseKey {
        seed: spec.seed,
        problem: group[q].index as u64,
        pivot: preps[q].pivots[id.pivot].pos as u64,
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
    let exact_batches = schedule::exact(pooled.len(), spec.passes.batch_size);

    let mut outcomes: Vec<BTreeMap<Pass, Vec<Outcome>>> = vec![BTreeMap::new(); n];
    let mut audits: Vec<BTreeMap<Pass, PassAudit>> = (0..n).map(|_| BTreeMap::new()).collect();
    for &pass in &spec.passes.run {
        pb.set_prefix(pass.as_str());
        pb.set_length(pooled.len() as u64);
        pb.set_position(0);
        let started = Instant::now();
        let mut prefix_tokens = vec![0u64; n];
        // Refeed: one fresh prefill of prompt ⊕ y_<t per pivot, as token ids.
        // Spectrum: per pivot the decode-time snapshot compressed into a restored cache.
        let mut refeed_caches: Vec<Vec<KvCache>> = Vec::with_capacity(n);
        for (q, pr) in preps.iter().enumerate() {
            let caches: Vec<KvCache> = match (pass.state(), spec.spectrum_pass()) {
                (PassState::Refeed, _) => pr
                    .pivots
                    .iter()
                    .map(|p| refeed_prefix(model, &pr.roll, p, &mut prefix_tokens[q], &policy))
                    .collect::<Result<_>>()?,
                (PassState::Spectrum, Some(sp)) => {
                    let mut stats = SpectrumStats::default();
                    let caches = pr
                        .pivots
                        .iter()
                        .map(|p| {
                            spectrum_prefix(
                                model,
                                &pr.roll,
                                p,
                                sp,
                                &policy,
                                &mut prefix_tokens[q],
                                &mut stats,
                            )
                        })
                        .collect::<Result<_>>()?;
                    infos[q].spectrum = Some(stats);
                    caches
                }
                _ => vec![],
            };
            refeed_caches.push(caches);
        }
        let jobs: Vec<Job> = pooled
            .iter()
            .map(|&(q, j)| {
                let pr = &preps[q];
                let id = &pr.ids[j];
                let pivot = &pr.pivots[id.pivot];
                let start = match pass.state() {
                    PassState::Decode => Start {
                        cache: &pr.roll.cache,
                        snap: pr.roll.snapshot(pivot.pos),
                        expect: Some(pivot.fingerprint),
                    },
                    PassState::Refeed | PassState::Spectrum => Start {
                        cache: &refeed_caches[q][id.pivot],
                        snap: Snapshot {
                            row: 0,
                            len: pr.roll.snapshot(pivot.pos).len,
                        },
                        expect: None,
                    },
                };
                Job {
                    start,
                    first_token: pr.branch_token(id),
                    key: key(q, id),
                }
            })
            .collect();
        let replica_schedule = pass.schedule() == PassSchedule::Replica;
        let shuffled =
            replica_schedule && spec.passes.replica_schedule == ReplicaSchedule::Shuffled;
        let batches = if spec.passes.refill {
            vec![]
        } else if shuffled {
            replica_batches(spec, &what, &exact_batches)?
        } else {
            exact_batches.clone()
        };
        let queue = if !spec.passes.refill {
            None
        } else if shuffled {
            Some(replica_queue(spec, &what, pooled.len())?)
        } else {
            Some(((0..pooled.len()).collect(), spec.passes.batch_size))
        };
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
            mode: settings.engine,
            key_pad: if replica_schedule {
                spec.passes.effective_replica_key_pad()
            } else {
                0
            },
        };
        let run = match &queue {
            Some((order, width)) => {
                engine::run_queue(&decoding, &jobs, order, *width, &opts, &mut on_tokens)
            }
            None => engine::run_batches(&decoding, &jobs, &batches, &opts, &mut on_tokens),
        }
        .map_err(|e| {
            let rows = match &queue {
                Some((_, width)) => *width,
                None => batches.iter().map(Vec::len).max().unwrap_or(0),
            };
            let what = format!("{} pass, batch size {rows}", pass.as_str());
            match e {
                Error::OutOfMemory(m) => Error::OutOfMemory(format!(
                    "{what}: {m}; try a smaller {}",
                    if shuffled && spec.passes.replica_batch_size.is_some() {
                        "passes.replica_batch_size"
                    } else {
                        "passes.batch_size"
                    }
                )),
                other => other.context(&what),
            }
        })?;
        pb.set_position(pooled.len() as u64);
        sync(device);
        let seconds = started.elapsed().as_secs_f64();
        let schedule_summary = PassNumerics {
            engine: run.stats.mode.clone(),
            schedule: if replica_schedule {
                spec.passes.replica_schedule.to_string()
            } else {
                "exact".into()
            },
            batch_rows: match &queue {
                Some((_, width)) => *width,
                None => batches.iter().map(Vec::len).max().unwrap_or(0),
            },
            key_pad: opts.key_pad,
            sampler: settings.sampler_name(device),
            glue: settings.glue_name(device),
            ..PassNumerics::default()
        };
        // Every sampled token of a continuation was one live row of one step.
        let tokens: Vec<u64> = (0..n)
            .map(|q| {
                prefix_tokens[q]
                    + run.outcomes[ranges[q].clone()]
                        .iter()
                        .map(|o| o.tokens.len() as u64)
                        .sum::<u64>()
            })
            .collect();
        for (q, r) in ranges.iter().enumerate() {
            let checks = engine::count_checks(&jobs[r.clone()], &run.verified[r.clone()]);
            let info = &mut infos[q];
            info.snapshot_checks += checks.checks;
            info.snapshot_hits += checks.hits;
            info.snapshot_checks_pivots += checks.snapshots;
            info.snapshot_hits_pivots += checks.snapshot_hits;
            info.cost.insert(
                pass.as_str().into(),
                PassCost {
                    device_seconds: share(seconds, &tokens, q),
                    tokens: tokens[q],
                    continuations: r.len() as u64,
                },
            );
            info.numerics.insert(
                pass.as_str().into(),
                pass_numerics(&run.paths[r.clone()], &schedule_summary),
            );
            outcomes[q].insert(pass, run.outcomes[r.clone()].to_vec());
            audits[q].insert(
                pass,
                PassAudit {
                    placements: run.placements[r.clone()].to_vec(),
                    verified: run.verified[r.clone()].to_vec(),
                    paths: run.paths[r.clone()].to_vec(),
                },
            );
        }
    }
    preps
        .iter()
        .zip(group)
        .zip(infos.into_iter().zip(outcomes).zip(audits))
        .map(|((pr, problem), ((info, outcomes), audits))| {
            finish_problem(spec, model, task, problem, pr, info, outcomes, audits)
        })
        .collect()
}

/// A pass's numerical path over some of its continuations: `base` (engine, schedule, kernels)
/// with the rows, key axes and steps of `paths`.
fn pass_numerics(
    paths: &[crate::decode::engine::NumericalPath],
    base: &PassNumerics,
) -> PassNumerics {
    let mut n = base.clone();
    for p in paths {
        n.widen(p.rows_range(), p.keys_range(), p.steps.len() as u64);
    }
    n
}

/// Grade a problem's rollout and continuations (outputs that hit the token cap are graded
/// per `continuations.truncated`), estimate each pivot and alternative, and build its tables.
#[allow(clippy::too_many_arguments)]
fn finish_problem(
    spec: &CampaignSpec,
    model: &LoadedModel,
    task: &SpecTask,
    problem: &Problem,
    pr: &Prepared,
    info: ShardInfo,
    outcomes: BTreeMap<Pass, Vec<Outcome>>,
    audits: BTreeMap<Pass, PassAudit>,
) -> Result<Shard> {
    let (roll, pivots, ids) = (&pr.roll, &pr.pivots, &pr.ids);
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
                seq.push(pr.branch_token(id));
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
            roll,
            &rollout_text,
            &rollout_grade,
            pivots.len(),
            model,
        )?,
        records::pivots(&ctx, roll, pivots, model)?,
        records::continuations(
            &ctx,
            pivots,
            ids,
            &outcomes,
            &audits,
            &graded,
            spec.passes.refill,
        ),
        records::estimates(&ctx, roll, pivots, &estimates, model)?,
    ];
    Ok(Shard { tables, info })
}

/// A group's shuffled replica batches ([`schedule::shuffled`]); refuses a grouping equal to
/// exact's (which the schedule avoids for every problem with two or more continuations unless
/// both batch sizes are 1, a spec `validate` rejects).
fn replica_batches(
    spec: &CampaignSpec,
    what: &str,
    exact: &[Vec<usize>],
) -> Result<schedule::Batches> {
    let n = exact.iter().map(Vec::len).sum();
    let r = spec.passes.effective_replica_batch_size();
    let replica = schedule::shuffled(n, spec.passes.batch_size, r);
    if n > 0 && schedule::same_grouping(&replica, exact) {
        return Err(Error::Spec(format!(
            "{what}: the shuffled replica would run exact's batches ({n} continuations, passes.batch_size = {}, passes.replica_batch_size = {r}); change passes.replica_batch_size",
            spec.passes.batch_size
        )));
    }
    Ok(replica)
}

/// A group's shuffled replica queue with `passes.refill`: its `n` jobs in reverse order on
/// `passes.replica_batch_size` rows; refused when that is exact's queue (the same order on
/// as many rows, which happens only for a single job).
fn replica_queue(spec: &CampaignSpec, what: &str, n: usize) -> Result<(Vec<usize>, usize)> {
    let r = spec.passes.effective_replica_batch_size();
    let order: Vec<usize> = (0..n).rev().collect();
    let exact: Vec<usize> = (0..n).collect();
    if n > 0 && order == exact && r.min(n) == spec.passes.batch_size.min(n) {
        return Err(Error::Spec(format!(
            "{what}: the shuffled replica would run exact's queue ({n} continuations, passes.batch_size = {}, passes.replica_batch_size = {r})",
            spec.passes.batch_size
        )));
    }
    Ok((order, r))
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
    let t = Tensor::f_from_slice(&ids)?.f_view([1, -1])?;
    let _ = model
        .decoder
        .forward(&t, &mut cache, policy, &LogitsAt::Last)?;
    Ok(cache)
}

/// The spectrum pass's start at `pivot`: importance from a traced prefill of `prompt ⊕ y_<t`
/// (the last prompt queries' attention, as `spectrum ppl` scores a context), the rollout's
/// decode-time snapshot at the pivot allocated into tiers at the budget, quantized and packed
/// into a wire frame, then decoded, verified and dequantized into an ordinary one-row cache
/// (dropped tokens masked at their original positions).
fn spectrum_prefix(
    model: &LoadedModel,
    roll: &Rollout,
    pivot: &Pivot,
    sp: &SpectrumPass,
    policy: &ExecPolicy,
    tokens: &mut u64,
    stats: &mut SpectrumStats,
) -> Result<KvCache> {
    let mut ids = roll.prompt.clone();
    ids.extend(roll.steps[..pivot.pos].iter().map(|s| s.token));
    *tokens += ids.len() as u64;
    let snap = roll.snapshot(pivot.pos);
    let pre = eval::prefill_and_score(&model.decoder, &ids, policy, &sp.importance)?;
    drop(pre.cache);
    let variant = sp.variant()?;
    let c = eval::compress_snapshot(&roll.cache, snap.row, &pre.scores, &variant, sp.protect)
        .map_err(|e| e.context(&format!("spectrum pass at pivot {}", pivot.pos)))?;
    let [fp16, int8, int4] = c.plan.counts();
    let real_b = c.real_b();
    stats.add(&SpectrumStats {
        snapshots: 1,
        tokens: c.plan.len() as u64,
        tokens_fp16: fp16 as u64,
        tokens_int8: int8 as u64,
        tokens_int4: int4 as u64,
        tokens_drop: c.plan.dropped() as u64,
        frame_bytes: c.frame.len() as u64,
        fp16_bytes: c.fp16_bytes as u64,
        real_b_min: real_b,
        real_b_max: real_b,
    });
    eval::receive(&model.decoder, &c.frame, 0)
}
