//! `kvcredit campaign run SPEC.toml [--shard i/N]`: a three-pass credit campaign, or one shard
//! of its problems; `kvcredit campaign validate SPEC...`: check specs without running them;
//! `kvcredit campaign merge DIRS... --out DIR`: the shards' run folders as one.
use super::run_args::{RunArgs, RunConfig, registry_paths};
use anyhow::Context;
use kvcredit::credit::{
    CampaignSpec, RunOptions, ShardSpec, finished_run, merge_campaign, run_campaign,
};
use kvcredit::runtime::{self, LoadedModel, ModelSource};
use kvcredit::tasks::{SpecTask, Task};
use std::path::{Path, PathBuf};

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// Run (or resume) the campaign described by a TOML spec.
    Run {
        /// Campaign spec (see experiments/).
        spec: PathBuf,
        /// Output folder (default: runs/<name>).
        #[arg(long)]
        out: Option<PathBuf>,
        /// `--device` overrides the spec's; `--tiles`, `--engine` (all recorded in the
        /// manifest; dtype and policy are the spec's).
        #[command(flatten)]
        run: RunArgs,
        /// Hide progress bars.
        #[arg(long)]
        quiet: bool,
        /// Run past the model's trained positions (`max_position_embeddings` / GGUF
        /// `context_length`), which are refused by default.
        #[arg(long)]
        allow_extrapolation: bool,
        /// Run only shard i of N (0 <= i < N) of the spec's problems: those at 0-based
        /// positions j with j % N == i (round-robin). Recorded in the manifest; merge the
        /// shards' folders with `campaign merge`.
        #[arg(long, value_name = "i/N")]
        shard: Option<String>,
        /// Run with `passes.refill = true` whatever the spec says (recorded in the manifest).
        #[arg(long)]
        refill: bool,
    },
    /// Load and validate specs without running or writing anything: every check `run` makes
    /// before loading the model (settings, problem range, prompt format, model name).
    Validate {
        /// Campaign specs.
        #[arg(required = true)]
        specs: Vec<PathBuf>,
    },
    /// Merge the run folders of one spec's shards into one run folder whose tables are
    /// byte-identical to an unsharded run's.
    Merge {
        /// Run folders (`campaign run --shard i/N --out DIR`), in any order.
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
        /// Output folder.
        #[arg(long)]
        out: PathBuf,
    },
}

pub fn run(cmd: Cmd) -> anyhow::Result<()> {
    let (spec, out, run, quiet, allow_extrapolation, shard, refill) = match cmd {
        Cmd::Run {
            spec,
            out,
            run,
            quiet,
            allow_extrapolation,
            shard,
            refill,
        } => (spec, out, run, quiet, allow_extrapolation, shard, refill),
        Cmd::Merge { dirs, out } => return merge(&dirs, &out),
        Cmd::Validate { specs } => return validate(&specs),
    };
    // A bad --shard is refused before the spec or the model is read, so nothing is written.
    let shard = shard
        .map(|s| s.parse::<ShardSpec>().map_err(anyhow::Error::msg))
        .transpose()
        .context("--shard")?;
    let SpecRun { spec, sha, cfg } = load_spec(&spec, &run, "campaign run", None, refill)?;
    let out_dir = out.unwrap_or_else(|| PathBuf::from("runs").join(&spec.name));
    if let Some(m) = finished_run(&spec, &sha, &out_dir, shard)? {
        println!(
            "already finished at {}: {} problems; nothing to run",
            m.run.finished_at.as_deref().unwrap_or("?"),
            m.problems_done
        );
        println!("{}", kvcredit::study::progress::outputs_line(&out_dir));
        return Ok(());
    }
    let model = load_model(&spec, &cfg, allow_extrapolation)?;
    let m = run_campaign(
        &spec,
        &sha,
        &model,
        &RunOptions {
            out_dir: out_dir.clone(),
            quiet,
            shard,
            exec: Some(cfg.exec),
        },
    )?;
    let cont: u64 = m
        .cost
        .iter()
        .filter(|(k, _)| k.as_str() != "rollout")
        .map(|(_, c)| c.continuations)
        .sum();
    if let Some(s) = m.shard {
        print!("shard {s}: ");
    }
    println!(
        "{} problems, {} continuations, snapshot hit rate {:.1}% ({}/{})",
        m.problems_done,
        cont,
        100.0 * m.snapshot_hit_rate,
        m.snapshot_hits,
        m.snapshot_checks
    );
    println!("{}", kvcredit::study::progress::outputs_line(&out_dir));
    Ok(())
}

/// A spec ready to run: the spec (its device as resolved), the sha256 of its file and the run
/// configuration.
pub(super) struct SpecRun {
    /// The spec, `device` as resolved.
    pub spec: CampaignSpec,
    /// SHA-256 of the spec file.
    pub sha: String,
    /// Device, dtype, policy, tiles and engine.
    pub cfg: RunConfig,
}

/// Load and validate the spec at `path` for the command `what`, with `--pool-problems` in
/// place of `passes.pool_problems` when given and `passes.refill` on with `--refill`
/// (validated like the spec), and resolve its run configuration; nothing is loaded or written.
pub(super) fn load_spec(
    path: &Path,
    run: &RunArgs,
    what: &str,
    pool_problems: Option<usize>,
    refill: bool,
) -> anyhow::Result<SpecRun> {
    let (mut spec, sha) = CampaignSpec::load(path)?;
    if let Some(p) = pool_problems {
        spec.passes.pool_problems = p;
        spec.validate().context("--pool-problems")?;
    }
    if refill {
        spec.passes.refill = true;
        spec.validate().context("--refill")?;
    }
    let cfg = run.resolve_spec(what, &spec.device, spec.dtype, spec.policy)?;
    spec.device = cfg.device_name.clone();
    Ok(SpecRun { spec, sha, cfg })
}

/// Load the spec's model in the run's dtype on its device, its trained positions enforced
/// unless `allow_extrapolation`.
pub(super) fn load_model(
    spec: &CampaignSpec,
    cfg: &RunConfig,
    allow_extrapolation: bool,
) -> anyhow::Result<LoadedModel> {
    let mut model = runtime::load(
        &ModelSource::resolve(&spec.model, &registry_paths())?,
        cfg.dtype,
        cfg.device,
    )?;
    model.decoder.limit_context(!allow_extrapolation);
    model.decoder.use_settings(&cfg.exec);
    Ok(model)
}

fn merge(dirs: &[PathBuf], out: &Path) -> anyhow::Result<()> {
    let m = merge_campaign(dirs, out)?;
    println!(
        "merged {} shards ({}): {} problems, snapshot hit rate {:.1}% ({}/{})",
        m.merged_from.len(),
        m.merged_from
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        m.problems_done,
        100.0 * m.snapshot_hit_rate,
        m.snapshot_hits,
        m.snapshot_checks
    );
    println!("{}", kvcredit::study::progress::outputs_line(out));
    Ok(())
}

/// `campaign validate`: each spec is loaded and validated, its problems read and its model
/// name resolved against the registry (the file need not be pulled); one line per spec.
fn validate(specs: &[PathBuf]) -> anyhow::Result<()> {
    for path in specs {
        let (spec, sha) = CampaignSpec::load(path)?;
        let (task, problems) = spec.task().with_context(|| format!("{}", path.display()))?;
        if ModelSource::resolve(&spec.model, &registry_paths()).is_err() {
            kvcredit::registry::find(&spec.model)
                .with_context(|| format!("{}: model `{}`", path.display(), spec.model))?;
        }
        let passes: Vec<&str> = spec.passes.run.iter().map(|p| p.as_str()).collect();
        println!(
            "{}: ok: `{}` {} {} {} on {}, {} problems ({}), K = {}, <= {} pivots/rollout, passes {}, sha256 {}",
            path.display(),
            spec.name,
            spec.model,
            spec.dtype,
            spec.policy,
            spec.device,
            problems.len(),
            match &task {
                SpecTask::Gsm8k(_) => task.prompt_label(),
                SpecTask::File(_) => format!(
                    "task `{}`, grader {}, {}",
                    task.name(),
                    task.grader(),
                    task.prompt_label()
                ),
            },
            spec.continuations.k,
            spec.pivots.max_per_rollout,
            passes.join("+"),
            &sha[..12],
        );
    }
    Ok(())
}
