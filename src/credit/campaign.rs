//! Running a campaign: per problem a rollout, pivots, the passes of continuations, grading
//! and estimates, written as one atomic shard; a rerun skips finished shards, and the merged
//! tables are rebuilt from the shards at the end.
use super::estimate::{Estimate, estimate};
use super::pass::{self, PassContext, Prepared, share};
use super::passes;
use super::records::{self, JobId, PassAudit};
use super::rollout::{self, RolloutParams};
use super::schema::{ExecRecord, RecordedSpec};
use super::spec::{CampaignSpec, Pass};
use crate::decode::engine::{Decoding, EngineMode, Outcome, Stop};
use crate::exec::{ExecSettings, PolicyKind};
use crate::io::parquet::Table;
use crate::runtime::LoadedModel;
use crate::sampling::NoiseKey;
use crate::spectrum::eval;
use crate::study::header::{RunHeader, RunOrigin};
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

pub use super::schema::{Manifest, PassCost, PassNumerics, ShardSpec, SpectrumStats, TABLES};

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
    m.run.check_resume(spec_sha256, out)?;
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
    let RecordedSpec::Full(spec) = &first.spec else {
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

/// Run one group of consecutive problems (`passes.pool_problems` of them, one for the
/// per-problem schedule): their rollouts decoded together, then each pass of `passes.run`
/// ([`passes::plugin`]) over the continuations of all of them pooled. Returns each problem's
/// shard, in the group's order.
fn run_group(
    spec: &CampaignSpec,
    settings: &ExecSettings,
    model: &LoadedModel,
    task: &SpecTask,
    group: &[Problem],
    pb: &ProgressBar,
) -> Result<Vec<Shard>> {
    let what = match group {
        [one] => format!("problem {}", one.index),
        [a, .., b] => format!("problems {}-{}", a.index, b.index),
        [] => return Ok(vec![]),
    };
    let stops = task.stop_sequences();
    let text_stop = |ids: &[i64]| -> bool {
        model
            .decode(ids)
            .map(|t| stops.iter().any(|s| t.contains(s)))
            .unwrap_or(false)
    };
    let text_stop: &dyn Fn(&[i64]) -> bool = &text_stop;
    let decoding = Decoding {
        model: &model.decoder,
        policy: settings.policy(spec.policy),
        sampling: spec.continuation_sampling(),
        max_new_tokens: spec.continuations.max_new_tokens,
        stop_tokens: &model.stop_tokens,
        text_stop: Some(text_stop),
    };
    let (preps, mut infos) = prepare_group(spec, model, task, group, &decoding)?;
    let cx = PassContext {
        spec,
        model,
        settings,
        decoding: &decoding,
        what: &what,
    };
    let n = group.len();
    let mut outcomes: Vec<BTreeMap<Pass, Vec<Outcome>>> = vec![BTreeMap::new(); n];
    let mut audits: Vec<BTreeMap<Pass, PassAudit>> = (0..n).map(|_| BTreeMap::new()).collect();
    for &pass in &spec.passes.run {
        let runs = pass::run(passes::plugin(pass), &cx, &preps, pb)?;
        for (q, run) in runs.into_iter().enumerate() {
            let info = &mut infos[q];
            info.snapshot_checks += run.checks.checks;
            info.snapshot_hits += run.checks.hits;
            info.snapshot_checks_pivots += run.checks.snapshots;
            info.snapshot_hits_pivots += run.checks.snapshot_hits;
            info.cost.insert(pass.as_str().into(), run.cost);
            info.numerics.insert(pass.as_str().into(), run.numerics);
            if run.spectrum.is_some() {
                info.spectrum = run.spectrum;
            }
            outcomes[q].insert(pass, run.outcomes);
            audits[q].insert(pass, run.audit);
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

/// A group's rollouts, decoded together, with each problem's pivots and continuation jobs, and
/// its bookkeeping so far (the rollout's cost, the pivots).
fn prepare_group(
    spec: &CampaignSpec,
    model: &LoadedModel,
    task: &SpecTask,
    group: &[Problem],
    decoding: &Decoding,
) -> Result<(Vec<Prepared>, Vec<ShardInfo>)> {
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
        decoding.model,
        &prompts.iter().map(Vec::as_slice).collect::<Vec<_>>(),
        &keys,
        &RolloutParams {
            sampling: spec.rollout_sampling(),
            max_new_tokens: spec.rollout.max_new_tokens,
            key: keys[0],
            stop_tokens: &model.stop_tokens,
            special_tokens: &model.special_tokens,
            text_stop: decoding.text_stop,
            policy: decoding.policy,
            max_margin: spec.pivots.max_margin,
            alternatives: spec.pivots.alternatives,
        },
    )?;
    sync(decoding.model.device());
    let seconds = t0.elapsed().as_secs_f64();
    let roll_tokens: Vec<u64> = rolls
        .iter()
        .map(|r| (r.prompt.len() + r.steps.len()) as u64)
        .collect();
    let branches = 1 + spec.pivots.alternatives;
    let mut preps = Vec::with_capacity(group.len());
    let mut infos = vec![ShardInfo::default(); group.len()];
    for (q, (roll, problem)) in rolls.into_iter().zip(group).enumerate() {
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
        preps.push(Prepared {
            problem: problem.index,
            roll,
            pivots,
            ids,
        });
    }
    Ok((preps, infos))
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
