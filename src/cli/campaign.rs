//! `kvcredit campaign run SPEC.toml`: a three-pass credit campaign.
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
        /// Override the spec's device (recorded in the manifest).
        #[arg(long)]
        device: Option<String>,
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
        device,
        quiet,
        allow_extrapolation,
    } = cmd;
    let (mut spec, sha) = CampaignSpec::load(&spec)?;
    if let Some(d) = device {
        spec.device = d;
    }
    let dev = runtime::parse_device(&spec.device)?;
    let mut model = runtime::load(&ModelSource::resolve(&spec.model)?, spec.dtype, dev)?;
    model.decoder.limit_context(!allow_extrapolation);
    let out_dir = out.unwrap_or_else(|| PathBuf::from("runs").join(&spec.name));
    let m = run_campaign(
        &spec,
        &sha,
        &model,
        &RunOptions {
            out_dir: out_dir.clone(),
            quiet,
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
