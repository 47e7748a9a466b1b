//! `kvcredit divergence run SPEC.toml`: a cache-ON vs cache-OFF divergence study.
use kvcredit::divergence::{DivergenceSpec, RunOptions, run_study};
use std::path::PathBuf;

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// Run (or resume) the study described by a TOML spec.
    Run {
        /// Study spec (see experiments/).
        spec: PathBuf,
        /// Output folder (default: runs/<name>).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Override the spec's device (recorded in the manifest).
        #[arg(long)]
        device: Option<String>,
        /// Hide progress lines.
        #[arg(long)]
        quiet: bool,
    },
}

pub fn run(cmd: Cmd) -> anyhow::Result<()> {
    let Cmd::Run {
        spec,
        out,
        device,
        quiet,
    } = cmd;
    let (mut spec, sha) = DivergenceSpec::load(&spec)?;
    if let Some(d) = device {
        spec.device = d;
    }
    let out_dir = out.unwrap_or_else(|| PathBuf::from("runs").join(&spec.name));
    let m = run_study(
        &spec,
        &sha,
        &RunOptions {
            out_dir: out_dir.clone(),
            quiet,
        },
    )?;
    println!(
        "{} of {} shards; device seconds: {}",
        m.shards_done,
        m.shards_total,
        m.seconds
            .iter()
            .map(|(k, v)| format!("{k} {v:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("results: {}", out_dir.display());
    Ok(())
}
