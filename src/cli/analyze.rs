//! `kvcredit analyze`: summarize campaign run dirs into `summary.parquet`, `report.md` and
//! figures.
use std::path::PathBuf;

use kvcredit::analysis::{AnalyzeOptions, analyze};

#[derive(clap::Args)]
pub struct Args {
    /// Campaign run dirs (each with manifest.json and estimates.parquet).
    #[arg(required = true, value_name = "RUN_DIR")]
    run_dirs: Vec<PathBuf>,
    /// Output dir (required for several run dirs; default: the single run dir).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Cluster-bootstrap replicates per statistic.
    #[arg(long, default_value_t = AnalyzeOptions::default().reps)]
    reps: usize,
    /// Seed of every bootstrap.
    #[arg(long, default_value_t = AnalyzeOptions::default().seed)]
    seed: u64,
    /// Confidence level of every interval.
    #[arg(long, default_value_t = AnalyzeOptions::default().level)]
    level: f64,
    /// US dollars per GPU-hour for the cost columns (default: an assumed on-demand H200 hour,
    /// see `analysis::DEFAULT_USD_PER_GPU_HOUR`).
    #[arg(long, value_name = "USD", default_value_t = AnalyzeOptions::default().usd_per_gpu_hour)]
    usd_per_gpu_hour: f64,
    /// Also read unfinished run dirs from their finished shards, labelled
    /// `NAME (partial k/N)` (without it they are only listed in the report).
    #[arg(long)]
    partial: bool,
    /// Margin of the mean-zero equivalence test (TOST of |mean(Â_X − Â_exact)| < margin), on
    /// the Â scale.
    #[arg(long, value_name = "M", default_value_t = AnalyzeOptions::default().equivalence_margin)]
    equivalence_margin: f64,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let opts = AnalyzeOptions {
        reps: a.reps,
        seed: a.seed,
        level: a.level,
        usd_per_gpu_hour: a.usd_per_gpu_hour,
        partial: a.partial,
        equivalence_margin: a.equivalence_margin,
    };
    // Tables are verified against their manifest's digests before any is read.
    for dir in &a.run_dirs {
        kvcredit::io::integrity::verify_run(dir)?;
    }
    let out = analyze(&a.run_dirs, a.out.as_deref(), &opts)?;
    let configs: std::collections::BTreeSet<&str> = out
        .summaries
        .iter()
        .map(|s| s.meta.config.as_str())
        .collect();
    let tables: Vec<String> = out
        .tables
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    println!(
        "analyzed {} configuration(s) into {}: {}, {}, {} figure files",
        configs.len(),
        out.dir.display(),
        tables.join(", "),
        kvcredit::analysis::report::REPORT,
        out.plots.len()
    );
    Ok(())
}
