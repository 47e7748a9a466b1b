//! `kvcredit divergence run SPEC.toml`: a cache-ON vs cache-OFF divergence study;
//! `kvcredit divergence analyze RUN_DIR...`: its report.
use super::run_args::{RunArgs, registry_paths};
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
        /// `--device` overrides the spec's; `--tiles` (recorded in the manifest; dtypes and
        /// policy are the spec's).
        #[command(flatten)]
        run: RunArgs,
        /// Hide progress lines.
        #[arg(long)]
        quiet: bool,
    },
    /// Merge the tables of an interrupted run from its finished shards (dtypes whose shards
    /// are all present); a rerun of the spec still resumes.
    Merge {
        /// Divergence run dir (with manifest.json and shards/).
        run_dir: PathBuf,
    },
    /// Write report.md for one or more run dirs (one per model).
    Analyze {
        /// Divergence run dirs (each with pairs.parquet).
        #[arg(required = true, value_name = "RUN_DIR")]
        run_dirs: Vec<PathBuf>,
        /// Output dir (default: the first run dir).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Confidence level of every interval.
        #[arg(long, default_value_t = 0.95)]
        level: f64,
    },
}

pub fn run(cmd: Cmd) -> anyhow::Result<()> {
    let (spec, out, run, quiet) = match cmd {
        Cmd::Run {
            spec,
            out,
            run,
            quiet,
        } => (spec, out, run, quiet),
        Cmd::Merge { run_dir } => {
            let m = kvcredit::divergence::run::merge_finished(&run_dir)?;
            let merged = m.merged_dtypes.as_ref().unwrap_or(&m.spec.dtypes);
            let names: Vec<String> = merged.iter().map(|d| d.to_string()).collect();
            println!(
                "{} of {} shards; tables of {} merged: {}",
                m.shards_done,
                m.shards_total,
                names.join(", "),
                run_dir.display()
            );
            return Ok(());
        }
        Cmd::Analyze {
            run_dirs,
            out,
            level,
        } => {
            // Tables are verified against their manifest's digests before any is read.
            for dir in &run_dirs {
                kvcredit::io::integrity::verify_run(dir)?;
            }
            let out = out.unwrap_or_else(|| run_dirs[0].clone());
            let path = kvcredit::divergence::report::write_report(&run_dirs, &out, level)?;
            println!("report: {}", path.display());
            return Ok(());
        }
    };
    let (mut spec, sha) = DivergenceSpec::load(&spec)?;
    let first = *spec
        .dtypes
        .first()
        .ok_or_else(|| anyhow::anyhow!("the spec lists no dtypes"))?;
    let cfg = run.resolve_spec("divergence run", &spec.device, first, spec.policy)?;
    spec.device = cfg.device_name.clone();
    let out_dir = out.unwrap_or_else(|| PathBuf::from("runs").join(&spec.name));
    let m = run_study(
        &spec,
        &sha,
        &RunOptions {
            out_dir: out_dir.clone(),
            quiet,
            exec: Some(cfg.exec),
            registry: registry_paths(),
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
    println!("{}", kvcredit::study::progress::outputs_line(&out_dir));
    Ok(())
}
