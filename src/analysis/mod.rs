//! Campaign analysis: `kvcredit analyze RUN_DIR...`.
//!
//! Reads the run dirs written by `kvcredit campaign run` ([`read`]), groups estimates by their
//! `config` label, computes per configuration and conditioning the disagreement rates, the
//! excess over the replica floor with problem-clustered inference, disagreement classes, the
//! mean-zero check and critical-set overlap ([`summary`], built on [`crate::stats`]), once per
//! treatment pass the configuration ran (refeed, spectrum: one code path, the pass a
//! parameter), and writes `summary.parquet` (refeed) and `summary-spectrum.parquet`
//! ([`table`]), `report.md` ([`report`]) and two figures per treatment as PNG and SVG
//! ([`plot`]), through the plumbing the studies share ([`crate::report::figure`],
//! [`crate::io::frame`]).
//!
//! ```no_run
//! use kvcredit::analysis::{analyze, AnalyzeOptions};
//! let out = analyze(&["runs/demo".into()], None, &AnalyzeOptions::default())?;
//! println!("{}", out.report.display());
//! # Ok::<(), kvcredit::Error>(())
//! ```
pub mod identity;
pub mod plot;
pub mod read;
pub mod report;
pub mod summary;
pub mod table;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use identity::{FloorStatus, TokenIdentity};
pub use read::{EstimateRow, Key, Manifest, OutputCounts, Pass, PassCost};
pub use summary::{
    AnalyzeOptions, Conditioning, ConfigMeta, ConfigSummary, DEFAULT_EQUIVALENCE_MARGIN,
    DEFAULT_USD_PER_GPU_HOUR, summarize,
};

use crate::{Error, Result};

/// One run dir's manifest and estimate rows.
#[derive(Debug, Clone)]
pub struct RunData {
    /// The run dir.
    pub dir: PathBuf,
    /// Its `manifest.json`.
    pub manifest: Manifest,
    /// Its `estimates.parquet`.
    pub estimates: Vec<EstimateRow>,
    /// Stop and extraction-rule counts of its continuations (and rollouts) per pass.
    pub outputs: BTreeMap<String, OutputCounts>,
    /// Per non-exact pass, its continuations' token identity with exact's.
    pub identity: BTreeMap<Pass, TokenIdentity>,
    /// `(problems done, problems in the spec)` when read from an unfinished run's shards.
    pub partial: Option<(usize, usize)>,
}

/// A run dir whose campaign has not finished: no tables yet, only the manifest and the
/// shards of the problems done so far.
#[derive(Debug, Clone)]
pub struct UnfinishedRun {
    /// The run dir.
    pub dir: PathBuf,
    /// Its `manifest.json` (`failure` says why the last invocation stopped, when it failed).
    pub manifest: Manifest,
    /// Whether its finished shards were read into the analysis (`--partial`).
    pub read_partial: bool,
}

/// Read a run dir's manifest, estimates and output counts ([`read::read_output_counts`]).
/// The estimates must carry exactly one `config` label (one run dir is one configuration).
pub fn load_run(dir: &Path) -> Result<RunData> {
    load_finished(dir, read::read_manifest(dir)?)
}

/// [`load_run`] with the manifest already read.
fn load_finished(dir: &Path, manifest: Manifest) -> Result<RunData> {
    let estimates = read::read_estimates(dir)?;
    let outputs = read::read_output_counts(dir)?;
    let same = identity::token_identical(dir)?;
    run_data(dir, manifest, estimates, (outputs, same), None)
}

fn run_data(
    dir: &Path,
    manifest: Manifest,
    estimates: Vec<EstimateRow>,
    (outputs, identity): (
        BTreeMap<String, OutputCounts>,
        BTreeMap<Pass, TokenIdentity>,
    ),
    partial: Option<(usize, usize)>,
) -> Result<RunData> {
    let Some(first) = estimates.first() else {
        return Err(Error::Output(format!(
            "{}: no estimate rows",
            dir.join(read::ESTIMATES).display()
        )));
    };
    if let Some(other) = estimates.iter().find(|r| r.config != first.config) {
        return Err(Error::Output(format!(
            "{}: several config labels (`{}`, `{}`); one run dir holds one configuration",
            dir.join(read::ESTIMATES).display(),
            first.config,
            other.config
        )));
    }
    Ok(RunData {
        dir: dir.to_path_buf(),
        manifest,
        estimates,
        outputs,
        identity,
        partial,
    })
}

/// Read an unfinished run's finished shards (`shards/problem-*/` with a `shard.json`) as one
/// run, its estimates relabelled `NAME (partial k/N)` so that no table or figure can pass
/// them off as the finished configuration.
fn load_partial(dir: &Path, manifest: Manifest) -> Result<RunData> {
    let shards = dir.join("shards");
    let mut done: Vec<PathBuf> = std::fs::read_dir(&shards)
        .map_err(|e| Error::io(&shards, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("problem-"))
                && p.join("shard.json").is_file()
        })
        .collect();
    done.sort();
    let label = format!(
        "{} (partial {}/{})",
        manifest.run.name,
        done.len(),
        manifest.problems_total
    );
    let mut estimates = Vec::new();
    let mut outputs: BTreeMap<String, OutputCounts> = BTreeMap::new();
    let mut same: BTreeMap<Pass, TokenIdentity> = BTreeMap::new();
    for shard in &done {
        estimates.extend(read::read_estimates(shard)?.into_iter().map(|mut r| {
            r.config.clone_from(&label);
            r
        }));
        for (pass, c) in read::read_output_counts(shard)? {
            outputs.entry(pass).or_default().merge(&c);
        }
        for (pass, n) in identity::token_identical(shard)? {
            same.entry(pass).or_default().merge(&n);
        }
    }
    let partial = Some((done.len(), manifest.problems_total));
    run_data(dir, manifest, estimates, (outputs, same), partial)
}

/// Read every run dir for `analyze`: finished runs as [`load_run`]; unfinished ones (no
/// `estimates.parquet` and no `finished_at` in the manifest) are listed, and with `partial`
/// also read from their finished shards ([`load_partial`]).
pub fn load_runs(dirs: &[PathBuf], partial: bool) -> Result<(Vec<RunData>, Vec<UnfinishedRun>)> {
    let (mut runs, mut unfinished) = (Vec::new(), Vec::new());
    for dir in dirs {
        let manifest = read::read_manifest(dir)?;
        if manifest.run.finished_at.is_some() || dir.join(read::ESTIMATES).exists() {
            runs.push(load_finished(dir, manifest)?);
            continue;
        }
        let read_partial = partial && manifest.problems_done > 0;
        if read_partial {
            runs.push(load_partial(dir, manifest.clone())?);
        }
        unfinished.push(UnfinishedRun {
            dir: dir.clone(),
            manifest,
            read_partial,
        });
    }
    Ok((runs, unfinished))
}

fn same<'a>(what: &str, cfg: &str, a: &'a str, b: &'a str) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(Error::Output(format!(
            "config `{cfg}`: rows or run dirs disagree on {what} (`{a}` vs `{b}`)"
        )))
    }
}

/// Group runs by `config` label (run dirs sharing a label are merged: rows concatenated,
/// snapshot counts, costs and output counts summed) and summarize each against every treatment
/// pass it ran (refeed, then spectrum), in label order.
pub fn summarize_runs(runs: &[RunData], opts: &AnalyzeOptions) -> Result<Vec<ConfigSummary>> {
    let mut groups: BTreeMap<&str, Vec<&RunData>> = BTreeMap::new();
    for r in runs {
        groups.entry(&r.estimates[0].config).or_default().push(r);
    }
    let mut out = Vec::with_capacity(groups.len());
    for (cfg, runs) in groups {
        let first = &runs[0].estimates[0];
        let mut meta = ConfigMeta {
            config: cfg.to_string(),
            model: first.model.clone(),
            dtype: first.dtype.clone(),
            policy: first.policy.clone(),
            replica_schedule: runs[0].manifest.replica_schedule.to_string(),
            task: runs[0].manifest.task.as_ref().map(|t| t.describe()),
            k: first.k,
            run_dirs: Vec::new(),
            n_problems: 0,
            n_keys: 0,
            n_incomplete: 0,
            snapshot_checks: 0,
            snapshot_hits: 0,
            cost: BTreeMap::new(),
            outputs: BTreeMap::new(),
            token_identity: BTreeMap::new(),
            spectrum_setting: None,
            spectrum: None,
            partial: runs[0].partial,
        };
        let mut rows = Vec::new();
        for run in runs {
            let m = &run.manifest;
            same(
                "replica_schedule",
                cfg,
                &meta.replica_schedule,
                m.replica_schedule.as_str(),
            )?;
            same("policy", cfg, &meta.policy, &m.run.exec.policy.to_string())?;
            let task = m.task.as_ref().map(|t| t.describe());
            if let (Some(was), Some(now)) = (&meta.task, &task) {
                same("task", cfg, was, now)?;
            }
            for r in &run.estimates {
                same("model", cfg, &meta.model, &r.model)?;
                same("dtype", cfg, &meta.dtype, &r.dtype)?;
                same("policy", cfg, &meta.policy, &r.policy)?;
            }
            if m.k != first.k {
                return Err(Error::Output(format!(
                    "config `{cfg}`: manifest of {} has k = {} but the estimates have k = {}",
                    run.dir.display(),
                    m.k,
                    first.k
                )));
            }
            meta.run_dirs.push(run.dir.clone());
            if let Some(sp) = &m.spectrum {
                meta.spectrum.get_or_insert_with(Default::default).add(sp);
            }
            if let crate::credit::schema::RecordedSpec::Full(spec) = &m.spec
                && let Some(label) = spec.spectrum_pass().and_then(|p| p.label().ok())
            {
                if let Some(was) = &meta.spectrum_setting {
                    same("spectrum setting", cfg, was, &label)?;
                }
                meta.spectrum_setting = Some(label);
            }
            meta.snapshot_checks += m.snapshot_checks;
            meta.snapshot_hits += m.snapshot_hits;
            for (pass, c) in &m.cost {
                let acc = meta.cost.entry(pass.clone()).or_default();
                acc.device_seconds += c.device_seconds;
                acc.tokens += c.tokens;
                acc.continuations += c.continuations;
            }
            for (pass, n) in &run.identity {
                meta.token_identity.entry(*pass).or_default().merge(n);
            }
            for (pass, c) in &run.outputs {
                match meta.outputs.get_mut(pass) {
                    Some(acc) => acc.merge(c),
                    None => {
                        meta.outputs.insert(pass.clone(), c.clone());
                    }
                }
            }
            rows.extend(run.estimates.iter().cloned());
        }
        let treatments = summary::treatments(&rows);
        if treatments.is_empty() {
            return Err(Error::Output(format!(
                "config `{cfg}`: no treatment pass (refeed or spectrum) to compare with exact"
            )));
        }
        for t in treatments {
            out.push(summarize(&rows, meta.clone(), t, opts)?);
        }
    }
    Ok(out)
}

/// What `analyze` wrote.
#[derive(Debug, Clone)]
pub struct AnalyzeOutput {
    /// The output dir.
    pub dir: PathBuf,
    /// `summary.parquet` (refeed), or the first treatment's table when no run has refeed.
    pub summary: PathBuf,
    /// Every summary table written, one per treatment present ([`table::summary_file`]).
    pub tables: Vec<PathBuf>,
    /// `report.md`.
    pub report: PathBuf,
    /// The figures (PNG and SVG of each).
    pub plots: Vec<PathBuf>,
    /// The numbers.
    pub summaries: Vec<ConfigSummary>,
}

/// Write `summary.parquet`, `report.md` and the figures of `summaries` into `dir`; the
/// report also lists the `unfinished` run dirs.
pub fn write_outputs(
    summaries: Vec<ConfigSummary>,
    unfinished: &[UnfinishedRun],
    dir: &Path,
    opts: &AnalyzeOptions,
) -> Result<AnalyzeOutput> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let mut tables = Vec::new();
    for t in Pass::TREATMENTS {
        let of: Vec<ConfigSummary> = summaries
            .iter()
            .filter(|s| s.treatment == t)
            .cloned()
            .collect();
        if !of.is_empty() {
            let path = dir.join(table::summary_file(t));
            table::write_summary(&of, opts, &path)?;
            tables.push(path);
        }
    }
    let summary = tables
        .first()
        .cloned()
        .ok_or_else(|| Error::Output("analyze: no configuration to summarize".into()))?;
    let report = dir.join(report::REPORT);
    std::fs::write(&report, report::render(&summaries, unfinished, opts))
        .map_err(|e| Error::io(&report, e))?;
    let plots = plot::write_plots(&summaries, dir)?;
    Ok(AnalyzeOutput {
        dir: dir.to_path_buf(),
        summary,
        tables,
        report,
        plots,
        summaries,
    })
}

fn check_options(opts: &AnalyzeOptions) -> Result<()> {
    if opts.reps == 0 {
        return Err(Error::Spec("analyze: --reps must be at least 1".into()));
    }
    if !(opts.usd_per_gpu_hour.is_finite() && opts.usd_per_gpu_hour >= 0.0) {
        return Err(Error::Spec(format!(
            "analyze: --usd-per-gpu-hour {} is not a non-negative number",
            opts.usd_per_gpu_hour
        )));
    }
    if !(opts.equivalence_margin.is_finite() && opts.equivalence_margin > 0.0) {
        return Err(Error::Spec(format!(
            "analyze: --equivalence-margin {} is not a positive number",
            opts.equivalence_margin
        )));
    }
    if !(opts.level > 0.0 && opts.level < 1.0) {
        return Err(Error::Spec(format!(
            "analyze: --level {} is not in (0, 1)",
            opts.level
        )));
    }
    Ok(())
}

/// `kvcredit analyze`: read `run_dirs`, summarize every configuration, and write the outputs
/// into `out` (required for several run dirs) or the single run dir.
pub fn analyze(
    run_dirs: &[PathBuf],
    out: Option<&Path>,
    opts: &AnalyzeOptions,
) -> Result<AnalyzeOutput> {
    check_options(opts)?;
    let dir = match (out, run_dirs) {
        (Some(o), _) => o.to_path_buf(),
        (None, [one]) => one.clone(),
        (None, []) => return Err(Error::Spec("analyze: no run dir given".into())),
        (None, _) => {
            return Err(Error::Spec(
                "analyze: several run dirs need --out DIR for the combined outputs".into(),
            ));
        }
    };
    let (runs, unfinished) = load_runs(run_dirs, opts.partial)?;
    if runs.is_empty() {
        return Err(Error::Output(format!(
            "analyze: no finished run dir among {} ({} unfinished{})",
            run_dirs.len(),
            unfinished.len(),
            if opts.partial {
                ", none with a finished problem"
            } else {
                "; --partial reads their finished shards"
            }
        )));
    }
    let summaries = summarize_runs(&runs, opts)?;
    write_outputs(summaries, &unfinished, &dir, opts)
}
