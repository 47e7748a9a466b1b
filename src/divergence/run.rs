//! Running a divergence study: per dtype, per batch of problems, the free-running pairs of
//! every strategy, the teacher-forced comparison with layer-wise drift, and residual patching
//! at τ; each problem's rows are written as one atomic shard (`shards/<dtype>/problem-NNNNN`),
//! a rerun skips batches whose shards all exist, and the merged tables are rebuilt at the end.
//!
//! Batches are fixed by the spec (consecutive chunks of `batch_size` problems), so a resumed
//! run decodes every problem in the same batch as an uninterrupted one.
use super::lockstep::{self, Mode, PairOutcome, Settings};
use super::patch::{self, PatchOutcome};
use super::replay;
use super::spec::{DivergenceSpec, LayerSet, PatchSpec, ReplaySpec, strategy_label};
use crate::decode::engine::{EngineMode, Stop};
use crate::exec::ExecRecord;
use crate::exec::{ExecPolicy, ExecSettings};
use crate::io::parquet::{Column, Table};
use crate::model::Decoder;
use crate::runtime::{self, Dtype, LoadedModel, ModelSource};
use crate::sampling::{NoiseKey, Sampling};
use crate::study::header::{RunHeader, RunOrigin};
use crate::study::{
    commit_shard, lock_run, merge_table, now_rfc3339, prepare_shards, read_json, sync,
    table_hashes, write_json,
};
use crate::tasks::{Problem, SpecTask, Task};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Table names, in write order (`patches` only when the spec patches).
pub const TABLES: [&str; 5] = ["pairs", "forced", "drift", "patches", "replay"];

/// What a run records about itself: the numerical path of every comparison.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Study, spec, model, execution, build and times; the engine is always `eager` (the
    /// study steps the decoder itself).
    #[serde(flatten)]
    pub run: RunHeader,
    /// The spec as parsed.
    pub spec: DivergenceSpec,
    /// The task: name, grader, prompt and data hash (absent in runs written before it was
    /// recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<crate::tasks::spec::TaskRecord>,
    /// TF32 for fp32 matmuls: libtorch's default (`allow_tf32` for cuBLAS off) is never
    /// changed by kvcredit.
    pub tf32: bool,
    /// Attention path: kvcredit's own attention through the execution policy (eager).
    pub attention: String,
    /// Cache-OFF prefill: one chunk of the whole sequence per step.
    pub off_chunking: String,
    /// Problems × dtypes in the spec.
    pub shards_total: usize,
    /// Problems × dtypes with a finished shard.
    pub shards_done: usize,
    /// Device seconds per step name, summed over shards.
    pub seconds: BTreeMap<String, f64>,
    /// Set by [`merge_finished`] on an unfinished run: the dtypes whose shards are all present
    /// and whose tables were merged (the others are missing from the tables).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merged_dtypes: Option<Vec<Dtype>>,
    /// sha256 of each table merged (file name → hex digest), recorded with the tables and
    /// verified by `analyze` before it reads them; empty before any merge.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub files_sha256: BTreeMap<String, String>,
    /// Dtypes that stopped on non-finite logits, with the one-line error (the other dtypes
    /// still ran; a rerun retries these).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub failed_dtypes: BTreeMap<Dtype, String>,
}

/// Per-shard bookkeeping.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ShardInfo {
    /// Problems decoded in this problem's batch.
    pub batch: Vec<usize>,
    /// Device seconds per step of the whole batch, divided by its problems.
    pub seconds: BTreeMap<String, f64>,
}

/// Where a study writes and how it reports.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Output folder.
    pub out_dir: PathBuf,
    /// Hide the per-batch progress lines.
    pub quiet: bool,
    /// Tiles as resolved from the command's arguments (`None`: the device's defaults).
    pub exec: Option<ExecSettings>,
    /// Where registry models are cached.
    pub registry: crate::registry::RegistryPaths,
}

fn shard_dir(out: &Path, dtype: Dtype, problem: usize) -> PathBuf {
    out.join("shards")
        .join(format!("{dtype}-problem-{problem:05}"))
}

/// Run (or resume) a study; returns the final manifest. Everything that can be checked —
/// the spec, the model, the layer ranges against its layer count, an existing run folder —
/// is checked before anything is written.
pub fn run_study(spec: &DivergenceSpec, spec_sha256: &str, opts: &RunOptions) -> Result<Manifest> {
    let out = &opts.out_dir;
    let device = runtime::parse_device(&spec.device)?;
    let source = ModelSource::resolve(&spec.model, &opts.registry)?;
    let (task, problems) = spec.task()?;
    let settings = opts.exec.unwrap_or_else(|| ExecSettings::defaults(device));
    let policy = settings.policy(spec.policy);
    let record = settings.record(spec.policy, Some(EngineMode::Eager));
    let manifest_path = out.join("manifest.json");
    let mut manifest = resume(out, spec_sha256, &record, &task)?;
    let batches: Vec<&[Problem]> = problems.chunks(spec.batch_size).collect();
    let mut lock = None;
    for &dtype in &spec.dtypes {
        let pending: Vec<&[Problem]> = batches
            .iter()
            .copied()
            .filter(|b| b.iter().any(|p| !shard_dir(out, dtype, p.index).exists()))
            .collect();
        if pending.is_empty() && manifest.is_some() {
            continue;
        }
        let load = |dtype| -> Result<runtime::LoadedModel> {
            let mut model = runtime::load(&source, dtype, device)?;
            model.decoder.use_settings(&settings);
            Ok(model)
        };
        let model = load(dtype)?;
        // The fp32 half of the fixed-prefix 2×2 (replay step of a 16-bit dtype).
        let fp32 = match (&spec.steps.replay, dtype) {
            (Some(_), Dtype::Fp16 | Dtype::Bf16) => Some(load(Dtype::Fp32)?),
            _ => None,
        };
        let sets = match &spec.steps.patch {
            Some(p) => p.layer_sets(model.decoder.config().num_layers())?,
            None => vec![],
        };
        // Prompts that cannot be encoded (no chat template for a chat format) fail here,
        // before anything is written.
        let mut longest = (0, 0);
        for p in &problems {
            let n = model.encode_prompt(&task.prompt(p))?.len();
            longest = longest.max((n, p.index));
        }
        // Refused before anything is written, like a campaign's positions.
        let (n, which) = longest;
        crate::study::bounds::check_positions(
            &model.decoder,
            n.saturating_add(spec.tokens_after_prompt()),
            &format!(
                "divergence `{}` (problem {which}: {n} prompt + {} tokens after it)",
                spec.name,
                spec.tokens_after_prompt()
            ),
        )?;
        // One process per run folder, from its first write until this returns.
        if lock.is_none() {
            lock = Some(lock_run(out)?);
        }
        let m = manifest.get_or_insert_with(|| {
            new_manifest(spec, spec_sha256, &model, &problems, record, &task)
        });
        write_json(&manifest_path, m)?;
        prepare_shards(out)?;
        m.failed_dtypes.remove(&dtype);
        for (b, batch) in pending.iter().enumerate() {
            let started = Instant::now();
            let where_ = format!(
                "{dtype}, problems {}..={}",
                batch[0].index,
                batch[batch.len() - 1].index
            );
            let shards = match run_batch(
                spec,
                policy,
                dtype,
                &model,
                &task,
                batch,
                &sets,
                fp32.as_ref(),
                opts.quiet,
            ) {
                Ok(s) => s,
                // Overflow of one dtype is a finding of the study, not the end of it: record
                // it, keep that dtype's finished shards and run the others.
                Err(Error::NonFinite(msg)) => {
                    let line = format!("{where_}: {msg}");
                    if !opts.quiet {
                        eprintln!("numerics: {line}; going on with the other dtypes");
                    }
                    m.failed_dtypes.insert(dtype, line);
                    write_json(&manifest_path, m)?;
                    break;
                }
                Err(e) => return Err(e.context(&where_)),
            };
            for (problem, (tables, info)) in batch.iter().zip(shards) {
                let named: Vec<(&str, &Table)> = tables.iter().map(|(n, t)| (*n, t)).collect();
                commit_shard(&shard_dir(out, dtype, problem.index), &named, &info)?;
            }
            if !opts.quiet {
                eprintln!(
                    "{dtype}: batch {}/{} (problems {}..={}) in {:.1} s",
                    b + 1,
                    pending.len(),
                    batch[0].index,
                    batch[batch.len() - 1].index,
                    started.elapsed().as_secs_f64()
                );
            }
            refresh(m, out, spec, &problems)?;
            write_json(&manifest_path, m)?;
        }
    }
    let Some(mut m) = manifest else {
        return Err(Error::Spec("nothing to run".into()));
    };
    if !m.failed_dtypes.is_empty() {
        return Err(failed_dtypes(&m, out));
    }
    m.files_sha256 = merge_tables(out, spec, &problems, &spec.dtypes)?;
    refresh(&mut m, out, spec, &problems)?;
    m.merged_dtypes = None;
    m.run.finished_at = Some(now_rfc3339());
    write_json(&manifest_path, &m)?;
    Ok(m)
}

/// The manifest of the run in `out` to resume, with this invocation's start recorded;
/// refused for another spec, numerical path or task; `None` without a run there.
fn resume(
    out: &Path,
    spec_sha256: &str,
    record: &ExecRecord,
    task: &SpecTask,
) -> Result<Option<Manifest>> {
    let manifest_path = out.join("manifest.json");
    if !manifest_path.exists() {
        return Ok(None);
    }
    let mut m: Manifest = read_json(&manifest_path)?;
    m.run.check_resume(spec_sha256, out)?;
    m.run.exec.resume_with(record, &out.display().to_string())?;
    if let Some(was) = &m.task {
        was.resume_with(&task.record(), &out.display().to_string())?;
    }
    m.run.resumed_at.push(now_rfc3339());
    Ok(Some(m))
}

/// The error of a study some of whose dtypes stopped on non-finite logits, once the tables
/// of the finished dtypes are merged.
fn failed_dtypes(m: &Manifest, out: &Path) -> Error {
    let failed: Vec<String> = m.failed_dtypes.values().cloned().collect();
    let merged = match merge_finished(out) {
        Ok(done) => {
            let names: Vec<String> = done
                .merged_dtypes
                .unwrap_or_default()
                .iter()
                .map(|d| d.to_string())
                .collect();
            format!("tables of {} merged", names.join(", "))
        }
        Err(_) => "no dtype finished".to_string(),
    };
    Error::NonFinite(format!(
        "{}; {merged} in {}",
        failed.join("; "),
        out.display()
    ))
}

/// The study's tables from the shards of `dtypes` (every problem of each); returns their
/// digests.
fn merge_tables(
    out: &Path,
    spec: &DivergenceSpec,
    problems: &[Problem],
    dtypes: &[Dtype],
) -> Result<BTreeMap<String, String>> {
    let dirs: Vec<PathBuf> = dtypes
        .iter()
        .flat_map(|&d| problems.iter().map(move |p| shard_dir(out, d, p.index)))
        .collect();
    let names = tables_of(spec);
    for name in &names {
        merge_table(&dirs, name, out)?;
    }
    table_hashes(out, &names)
}

fn tables_of(spec: &DivergenceSpec) -> Vec<&'static str> {
    TABLES
        .iter()
        .copied()
        .filter(|&t| match t {
            "forced" | "drift" => spec.steps.teacher_forced,
            "patches" => spec.steps.patch.is_some(),
            "replay" => spec.steps.replay.is_some(),
            _ => true,
        })
        .collect()
}

fn new_manifest(
    spec: &DivergenceSpec,
    sha: &str,
    model: &LoadedModel,
    problems: &[Problem],
    exec: ExecRecord,
    task: &SpecTask,
) -> Manifest {
    Manifest {
        run: RunHeader::start(
            RunOrigin {
                study: "divergence",
                name: &spec.name,
                spec_sha256: sha,
                model: &model.name,
                model_sha256: model.sha256.as_deref(),
                device: &spec.device,
            },
            exec,
        ),
        spec: spec.clone(),
        task: Some(task.record()),
        tf32: false,
        attention: "kvcredit eager attention via the execution policy".into(),
        off_chunking: "whole sequence in one forward per step".into(),
        shards_total: problems.len() * spec.dtypes.len(),
        shards_done: 0,
        seconds: BTreeMap::new(),
        merged_dtypes: None,
        files_sha256: BTreeMap::new(),
        failed_dtypes: BTreeMap::new(),
    }
}

/// Tables of an interrupted run from its finished shards: every dtype whose shards all exist
/// is merged (the manifest records which, and stays unfinished); a rerun of the spec still
/// resumes and, at the end, replaces these tables with the whole study's.
pub fn merge_finished(out: &Path) -> Result<Manifest> {
    let manifest_path = out.join("manifest.json");
    if !manifest_path.exists() {
        return Err(Error::Spec(format!(
            "{} holds no divergence run (no manifest.json)",
            out.display()
        )));
    }
    let mut m: Manifest = read_json(&manifest_path)?;
    let spec = m.spec.clone();
    let (_, problems) = spec.task()?;
    let complete: Vec<Dtype> = spec
        .dtypes
        .iter()
        .copied()
        .filter(|&d| {
            problems
                .iter()
                .all(|p| shard_dir(out, d, p.index).join("shard.json").exists())
        })
        .collect();
    if complete.is_empty() {
        return Err(Error::Spec(format!(
            "{}: no dtype has all {} of its shards yet",
            out.display(),
            problems.len()
        )));
    }
    m.files_sha256 = merge_tables(out, &spec, &problems, &complete)?;
    refresh(&mut m, out, &spec, &problems)?;
    m.merged_dtypes = if complete.len() == spec.dtypes.len() {
        None
    } else {
        Some(complete)
    };
    write_json(&manifest_path, &m)?;
    Ok(m)
}

fn refresh(
    m: &mut Manifest,
    out: &Path,
    spec: &DivergenceSpec,
    problems: &[Problem],
) -> Result<()> {
    let (mut done, mut seconds) = (0, BTreeMap::<String, f64>::new());
    for &d in &spec.dtypes {
        for p in problems {
            let path = shard_dir(out, d, p.index).join("shard.json");
            if path.exists() {
                let info: ShardInfo = read_json(&path)?;
                done += 1;
                for (k, v) in info.seconds {
                    *seconds.entry(format!("{d}/{k}")).or_default() += v;
                }
            }
        }
    }
    m.shards_done = done;
    m.seconds = seconds;
    Ok(())
}

type ShardTables = (Vec<(&'static str, Table)>, ShardInfo);

/// Everything of one batch; one shard's tables per problem.
#[allow(clippy::too_many_arguments)]
fn run_batch(
    spec: &DivergenceSpec,
    policy: ExecPolicy,
    dtype: Dtype,
    model: &LoadedModel,
    task: &SpecTask,
    batch: &[Problem],
    sets: &[LayerSet],
    fp32: Option<&LoadedModel>,
    quiet: bool,
) -> Result<Vec<ShardTables>> {
    let dec = &model.decoder;
    let prompts: Vec<Vec<i64>> = batch
        .iter()
        .map(|p| model.encode_prompt(&task.prompt(p)))
        .collect::<Result<_>>()?;
    let stops = task.stop_sequences();
    let text_stop = |ids: &[i64]| -> bool {
        model
            .decode(ids)
            .map(|t| stops.iter().any(|s| t.contains(s)))
            .unwrap_or(false)
    };
    let settings = |sampling: Sampling| Settings {
        model: dec,
        policy,
        sampling,
        max_new_tokens: spec.max_new_tokens,
        stop_tokens: &model.stop_tokens,
        text_stop: Some(&text_stop),
    };
    let mut seconds: BTreeMap<String, f64> = BTreeMap::new();
    let first = batch[0].index - spec.first_index();
    let mut timed = |name: String, t: Instant| {
        sync(dec.device());
        let took = t.elapsed().as_secs_f64();
        if !quiet {
            eprintln!(
                "{dtype}: problems {}..={} {name} in {took:.1} s",
                batch[0].index,
                batch[batch.len() - 1].index
            );
        }
        seconds.insert(name, took / batch.len() as f64);
    };
    // Rows of this batch whose position in the study is below `limit`.
    let rows_below = |limit: Option<usize>| -> Vec<usize> {
        let limit = limit.unwrap_or(usize::MAX);
        (0..batch.len()).filter(|&i| first + i < limit).collect()
    };
    // Lockstep over a subset of the batch's rows; `None` for the rows left out.
    let subset = |rows: &[usize],
                  s: Settings,
                  stream: u64,
                  mode: Mode|
     -> Result<Vec<Option<PairOutcome>>> {
        let mut outs: Vec<Option<PairOutcome>> = vec![None; batch.len()];
        if rows.is_empty() {
            return Ok(outs);
        }
        let sub: Vec<Vec<i64>> = rows.iter().map(|&i| prompts[i].clone()).collect();
        let keys: Vec<NoiseKey> = rows
            .iter()
            .map(|&i| NoiseKey::divergence(spec.seed, batch[i].index as u64, stream))
            .collect();
        for (&i, o) in rows.iter().zip(lockstep::run(&s, &sub, &keys, mode)?) {
            outs[i] = Some(o);
        }
        Ok(outs)
    };
    let st = &spec.steps;
    let mut free: Vec<(usize, Vec<Option<PairOutcome>>)> = Vec::new();
    for (si, &sampling) in spec.strategies.iter().enumerate() {
        let t = Instant::now();
        let (rows, mut set) = if sampling == Sampling::Greedy {
            (rows_below(None), settings(sampling))
        } else {
            (rows_below(st.sampled_max_problems), settings(sampling))
        };
        if sampling != Sampling::Greedy {
            set.max_new_tokens = st.sampled_max_new_tokens.unwrap_or(spec.max_new_tokens);
        }
        let phase = format!("free/{}", strategy_label(&sampling));
        let outs = subset(&rows, set, si as u64, Mode::Free).map_err(|e| e.context(&phase))?;
        timed(phase, t);
        free.push((si, outs));
    }
    let forced = if st.teacher_forced {
        let t = Instant::now();
        let mut set = settings(Sampling::Greedy);
        set.max_new_tokens = st.forced_max_new_tokens.unwrap_or(spec.max_new_tokens);
        let rows = rows_below(st.forced_max_problems);
        let outs = subset(&rows, set, u64::MAX, Mode::Forced { drift: true })
            .map_err(|e| e.context("teacher_forced"))?;
        timed("teacher_forced".into(), t);
        Some(outs)
    } else {
        None
    };
    let greedy = spec.strategies.iter().position(|s| *s == Sampling::Greedy);
    let mut patches: Vec<Option<(usize, PatchOutcome)>> = vec![None; batch.len()];
    if let Some(p) = &spec.steps.patch {
        let t = Instant::now();
        let greedy = greedy.expect("validated: patching needs the greedy strategy");
        let rows = rows_below(p.max_problems);
        patches = patch_rows(dec, &policy, &prompts, &free[greedy].1, &rows, sets, p)?;
        timed("patch".into(), t);
    }
    let mut replays: Vec<Vec<(usize, replay::StateResult)>> = vec![vec![]; batch.len()];
    if let Some(r) = &spec.steps.replay {
        let t = Instant::now();
        let greedy = greedy.expect("validated: replay needs the greedy strategy");
        let rows = rows_below(r.max_problems);
        let fp32 = fp32.map(|m| &m.decoder);
        replays = replay_rows(dec, fp32, &policy, &prompts, &free[greedy].1, &rows, r)?;
        timed("replay".into(), t);
    }
    let outcomes = Outcomes {
        free,
        forced,
        patches,
        replays,
    };
    let info = ShardInfo {
        batch: batch.iter().map(|p| p.index).collect(),
        seconds,
    };
    shard_tables(spec, dtype, model, task, batch, &prompts, &outcomes, &info)
}

/// What the phases of one batch produced, per row of the batch.
struct Outcomes {
    /// Per strategy (its index in the spec): each row's free-running pair, `None` if left out.
    free: Vec<(usize, Vec<Option<PairOutcome>>)>,
    /// The teacher-forced pair of each row, when the spec asks for it.
    forced: Option<Vec<Option<PairOutcome>>>,
    /// The divergence step and patch outcome of each row that diverged.
    patches: Vec<Option<(usize, PatchOutcome)>>,
    /// Each row's replay and transplant results, by boundary.
    replays: Vec<Vec<(usize, replay::StateResult)>>,
}

/// Residual-stream patching at τ for the `rows` whose greedy pair diverged at a step both
/// sequences reach.
fn patch_rows(
    dec: &Decoder,
    policy: &ExecPolicy,
    prompts: &[Vec<i64>],
    greedy: &[Option<PairOutcome>],
    rows: &[usize],
    sets: &[LayerSet],
    p: &PatchSpec,
) -> Result<Vec<Option<(usize, PatchOutcome)>>> {
    let mut patches: Vec<Option<(usize, PatchOutcome)>> = vec![None; prompts.len()];
    for &i in rows {
        if let Some(o) = &greedy[i]
            && let Some(tau) = o.first_divergence()
            && tau >= 1
            && tau < o.on.len()
            && tau < o.off.len()
        {
            let r = patch::run(
                dec,
                policy,
                &prompts[i],
                &o.on,
                &o.off,
                tau,
                sets,
                p.trajectory_tokens,
            )?;
            patches[i] = Some((tau, r));
        }
    }
    Ok(patches)
}

/// Live vs replay (every chunk size of the spec, one shot included) and the KV transplants at
/// each boundary within the greedy cache-ON sequence of the `rows`.
fn replay_rows(
    dec: &Decoder,
    fp32: Option<&Decoder>,
    policy: &ExecPolicy,
    prompts: &[Vec<i64>],
    greedy: &[Option<PairOutcome>],
    rows: &[usize],
    r: &ReplaySpec,
) -> Result<Vec<Vec<(usize, replay::StateResult)>>> {
    let mut replays: Vec<Vec<(usize, replay::StateResult)>> = vec![vec![]; prompts.len()];
    let mut chunks = r.chunks.clone();
    if !chunks.contains(&0) {
        chunks.push(0);
    }
    for &i in rows {
        let Some(o) = &greedy[i] else {
            continue;
        };
        for &b in r.boundaries.iter().filter(|&&b| b <= o.on.len()) {
            let rows = replay::run(
                dec,
                fp32,
                policy,
                &prompts[i],
                &o.on,
                b,
                &chunks,
                r.continuation_tokens,
            )?;
            replays[i].extend(rows.into_iter().map(|x| (b, x)));
        }
    }
    Ok(replays)
}

/// One shard's tables per problem of the batch (pairs, and forced, drift, patches and replay
/// where the spec runs those steps), each with the batch's shard info.
#[allow(clippy::too_many_arguments)]
fn shard_tables(
    spec: &DivergenceSpec,
    dtype: Dtype,
    model: &LoadedModel,
    task: &SpecTask,
    batch: &[Problem],
    prompts: &[Vec<i64>],
    o: &Outcomes,
    info: &ShardInfo,
) -> Result<Vec<ShardTables>> {
    let ctx = |i: usize| Ctx {
        config: &spec.name,
        model: &model.name,
        dtype: dtype.to_string(),
        policy: spec.policy.to_string(),
        problem: batch[i].index as u32,
    };
    let mut shards = Vec::with_capacity(batch.len());
    for (i, problem) in batch.iter().enumerate() {
        let c = ctx(i);
        let mut tables = vec![(
            "pairs",
            pairs_table(&c, spec, model, task, problem, &prompts[i], &o.free, i)?,
        )];
        if let Some(f) = &o.forced {
            let fo = f[i].as_ref();
            tables.push(("forced", forced_table(&c, fo)));
            tables.push(("drift", drift_table(&c, fo)));
        }
        if spec.steps.patch.is_some() {
            tables.push(("patches", patches_table(&c, &o.patches[i])));
        }
        if spec.steps.replay.is_some() {
            tables.push(("replay", replay_table(&c, &o.replays[i])));
        }
        shards.push((tables, info.clone()));
    }
    Ok(shards)
}

/// Columns every table starts with.
struct Ctx<'a> {
    config: &'a str,
    model: &'a str,
    dtype: String,
    policy: String,
    problem: u32,
}

impl Ctx<'_> {
    fn table(&self, n: usize) -> Table {
        Table::new()
            .with("config", Column::Str(vec![self.config.to_string(); n]))
            .with("model", Column::Str(vec![self.model.to_string(); n]))
            .with("dtype", Column::Str(vec![self.dtype.clone(); n]))
            .with("policy", Column::Str(vec![self.policy.clone(); n]))
            .with("problem", Column::U32(vec![self.problem; n]))
    }
}

fn stop_name(s: Stop) -> String {
    s.as_str().to_string()
}

#[allow(clippy::too_many_arguments)]
fn pairs_table(
    c: &Ctx,
    spec: &DivergenceSpec,
    model: &LoadedModel,
    task: &SpecTask,
    problem: &Problem,
    prompt: &[i64],
    free: &[(usize, Vec<Option<PairOutcome>>)],
    i: usize,
) -> Result<Table> {
    let ran: Vec<(usize, &PairOutcome)> = free
        .iter()
        .filter_map(|(si, outs)| outs[i].as_ref().map(|o| (*si, o)))
        .collect();
    let n = ran.len();
    let (mut strategy, mut on, mut off, mut stop_on, mut stop_off) =
        (vec![], vec![], vec![], vec![], vec![]);
    let (mut diverged, mut tau, mut ans_on, mut ans_off, mut ok_on, mut ok_off) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    let (mut compared, mut flips, mut max_abs) = (vec![], vec![], vec![]);
    for (si, o) in ran {
        strategy.push(strategy_label(&spec.strategies[si]));
        let g_on = task.grade(problem, &model.decode(&o.on)?);
        let g_off = task.grade(problem, &model.decode(&o.off)?);
        let t = o.first_divergence();
        diverged.push(t.is_some());
        tau.push(t.map(|t| t as i64));
        ans_on.push(g_on.predicted);
        ans_off.push(g_off.predicted);
        ok_on.push(g_on.correct);
        ok_off.push(g_off.correct);
        on.push(o.on.clone());
        off.push(o.off.clone());
        stop_on.push(stop_name(o.stop_on));
        stop_off.push(stop_name(o.stop_off));
        compared.push(o.compare.len() as i64);
        flips.push(
            o.compare
                .iter()
                .filter(|s| s.argmax_on != s.argmax_off)
                .count() as i64,
        );
        max_abs.push(o.compare.iter().map(|s| s.max_abs).fold(0.0, f64::max));
    }
    Ok(c.table(n)
        .with("strategy", Column::Str(strategy))
        .with("prompt_tokens", Column::I64(vec![prompt.len() as i64; n]))
        .with("prompt_ids", Column::ListI64(vec![prompt.to_vec(); n]))
        .with("gold", Column::Str(vec![problem.gold.clone(); n]))
        .with("diverged", Column::Bool(diverged))
        .with("tau", Column::OptI64(tau))
        .with("tokens_on", Column::ListI64(on))
        .with("tokens_off", Column::ListI64(off))
        .with("stop_on", Column::Str(stop_on))
        .with("stop_off", Column::Str(stop_off))
        .with("answer_on", Column::OptStr(ans_on))
        .with("answer_off", Column::OptStr(ans_off))
        .with("correct_on", Column::Bool(ok_on))
        .with("correct_off", Column::Bool(ok_off))
        .with("compared_steps", Column::I64(compared))
        .with("compared_flips", Column::I64(flips))
        .with("compared_max_abs", Column::F64(max_abs)))
}

fn forced_table(c: &Ctx, o: Option<&PairOutcome>) -> Table {
    let (s, on): (&[lockstep::StepCompare], &[i64]) = match o {
        Some(o) => (&o.compare, &o.on),
        None => (&[], &[]),
    };
    let n = s.len();
    let f = |g: fn(&lockstep::StepCompare) -> f64| Column::F64(s.iter().map(g).collect());
    c.table(n)
        .with(
            "step",
            Column::I64(s.iter().map(|x| x.step as i64).collect()),
        )
        .with("token", Column::I64(s.iter().map(|x| on[x.step]).collect()))
        .with("max_abs", f(|x| x.max_abs))
        .with("mse", f(|x| x.mse))
        .with("kl_off_on", f(|x| x.kl))
        .with(
            "argmax_on",
            Column::I64(s.iter().map(|x| x.argmax_on).collect()),
        )
        .with(
            "argmax_off",
            Column::I64(s.iter().map(|x| x.argmax_off).collect()),
        )
        .with(
            "flip",
            Column::Bool(s.iter().map(|x| x.argmax_on != x.argmax_off).collect()),
        )
        .with("margin_on", f(|x| x.margin_on))
        .with("margin_off", f(|x| x.margin_off))
}

fn drift_table(c: &Ctx, o: Option<&PairOutcome>) -> Table {
    let d: &[lockstep::Drift] = o.map_or(&[], |o| &o.drift);
    let f = |g: fn(&lockstep::Drift) -> f64| Column::F64(d.iter().map(g).collect());
    c.table(d.len())
        .with(
            "step",
            Column::I64(d.iter().map(|x| x.step as i64).collect()),
        )
        .with(
            "layer",
            Column::I64(d.iter().map(|x| x.layer as i64).collect()),
        )
        .with("resid_rel", f(|x| x.resid_rel))
        .with("resid_max_abs", f(|x| x.resid_max_abs))
        .with("k_rel", f(|x| x.k_rel))
        .with("k_max_abs", f(|x| x.k_max_abs))
        .with("v_rel", f(|x| x.v_rel))
        .with("v_max_abs", f(|x| x.v_max_abs))
}

fn patches_table(c: &Ctx, p: &Option<(usize, PatchOutcome)>) -> Table {
    let empty = PatchOutcome {
        m_off: 0.0,
        reproduced: false,
        rows: vec![],
    };
    let (tau, o) = match p {
        Some((t, o)) => (*t as i64, o),
        None => (0, &empty),
    };
    let r = &o.rows;
    let n = r.len();
    let m_on = r.first().map_or(0.0, |x| x.m);
    c.table(n)
        .with("tau", Column::I64(vec![tau; n]))
        .with("reproduced", Column::Bool(vec![o.reproduced; n]))
        .with(
            "label",
            Column::Str(r.iter().map(|x| x.label.clone()).collect()),
        )
        .with(
            "layer_start",
            Column::I64(r.iter().map(|x| x.layer_start as i64).collect()),
        )
        .with(
            "layer_end",
            Column::I64(r.iter().map(|x| x.layer_end as i64).collect()),
        )
        .with("m_on", Column::F64(vec![m_on; n]))
        .with("m_off", Column::F64(vec![o.m_off; n]))
        .with("m", Column::F64(r.iter().map(|x| x.m).collect()))
        .with(
            "recovery",
            Column::F64(r.iter().map(|x| x.recovery).collect()),
        )
        .with("token", Column::I64(r.iter().map(|x| x.token).collect()))
        .with(
            "follow_off",
            Column::F64(r.iter().map(|x| x.follow_off).collect()),
        )
        .with(
            "follow_on",
            Column::F64(r.iter().map(|x| x.follow_on).collect()),
        )
        .with(
            "off_prefix",
            Column::I64(r.iter().map(|x| x.off_prefix as i64).collect()),
        )
        .with(
            "continuation",
            Column::ListI64(r.iter().map(|x| x.continuation.clone()).collect()),
        )
}

fn replay_table(c: &Ctx, rows: &[(usize, replay::StateResult)]) -> Table {
    let col = |f: fn(&replay::StateResult) -> String| {
        Column::Str(rows.iter().map(|(_, r)| f(r)).collect())
    };
    let lists = |f: fn(&replay::StateResult) -> Vec<f64>| {
        Column::ListF64(rows.iter().map(|(_, r)| f(r)).collect())
    };
    let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    c.table(rows.len())
        .with(
            "boundary",
            Column::I64(rows.iter().map(|(b, _)| *b as i64).collect()),
        )
        .with("kind", col(|r| r.kind.clone()))
        .with(
            "chunk",
            Column::I64(rows.iter().map(|(_, r)| r.chunk).collect()),
        )
        .with("direction", col(|r| r.direction.clone()))
        .with("parts", col(|r| r.parts.clone()))
        .with(
            "layer_start",
            Column::I64(rows.iter().map(|(_, r)| r.layers.0 as i64).collect()),
        )
        .with(
            "layer_end",
            Column::I64(rows.iter().map(|(_, r)| r.layers.1 as i64).collect()),
        )
        .with(
            "replica_equal",
            Column::Bool(rows.iter().map(|(_, r)| r.replica_equal).collect()),
        )
        .with(
            "k_max_abs",
            Column::F64(rows.iter().map(|(_, r)| max(&r.k_max_abs)).collect()),
        )
        .with(
            "v_max_abs",
            Column::F64(rows.iter().map(|(_, r)| max(&r.v_max_abs)).collect()),
        )
        .with("k_max_abs_per_layer", lists(|r| r.k_max_abs.clone()))
        .with("v_max_abs_per_layer", lists(|r| r.v_max_abs.clone()))
        .with(
            "follows_live",
            Column::Bool(rows.iter().map(|(_, r)| r.follows_live).collect()),
        )
        .with(
            "follows_replay",
            Column::Bool(rows.iter().map(|(_, r)| r.follows_replay).collect()),
        )
        .with(
            "continuation",
            Column::ListI64(rows.iter().map(|(_, r)| r.continuation.clone()).collect()),
        )
}
