//! `kvcredit campaign run SPEC.toml`: a three-pass credit campaign.
use super::run_args::RunArgs;
use kvcredit::credit::{CampaignSpec, RunOptions, run_campaign};
use kvcredit::runtime::{self, ModelSource};
use std::path::PathBuf;

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
    },
}

pub fn run(cmd: Cmd) -> anyhow::Result<()> {
    let Cmd::Run {
        spec,
        out,
        run,
        quiet,
        allow_extrapolation,
    } = cmd;
    let (mut spec, sha) = CampaignSpec::load(&spec)?;
    let cfg = run.resolve_spec("campaign run", &spec.device, spec.dtype, spec.policy)?;
    spec.device = cfg.device_name.clone();
    let mut model = runtime::load(&ModelSource::resolve(&spec.model)?, cfg.dtype, cfg.device)?;
    model.decoder.limit_context(!allow_extrapolation);
    let out_dir = out.unwrap_or_else(|| PathBuf::from("runs").join(&spec.name));
    let m = run_campaign(
        &spec,
        &sha,
        &model,
        &RunOptions {
            out_dir: out_dir.clone(),
            quiet,
            exec: Some(cfg.exec),
        },
    )?;
    let cont: u64 = m
        .cost
        .iter()
        .filter(|(k, _)| k.as_str() != "rollout")
        .map(|(_, c)| c.continuations)
        .sum();
    println!(
        "{} problems, {} continuations, snapshot hit rate {:.1}% ({}/{})",
        m.problems_done,
        cont,
        100.0 * m.snapshot_hit_rate,
        m.snapshot_hits,
        m.snapshot_checks
    );
    println!("results: {}", out_dir.display());
    Ok(())
}
