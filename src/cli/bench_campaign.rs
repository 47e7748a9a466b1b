//! `kvcredit bench campaign SPEC --out DIR`: run a campaign into a new folder, timed end to end,
//! and print tokens/s per pass and for the whole run (JSON: `DIR/bench-campaign.json`);
//! `kvcredit bench campaign --from DIR`: the same table from a finished run folder.
use super::campaign::{SpecRun, load_model, load_spec};
use super::run_args::RunArgs;
use anyhow::bail;
use kvcredit::bench::campaign::{self, CampaignBench, WallSource};
use kvcredit::credit::{RunOptions, run_campaign};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Campaign spec to run and time (see experiments/).
    #[arg(required_unless_present = "from", conflicts_with = "from")]
    spec: Option<PathBuf>,
    /// Output folder of the run: new or empty (a resumed run's time would be wrong).
    #[arg(long, required_unless_present = "from", conflicts_with = "from")]
    out: Option<PathBuf>,
    /// Run nothing: reprint the table of this finished run folder (wall time from the
    /// manifest's started_at/finished_at, n/a when the run was resumed or merged).
    #[arg(long, value_name = "DIR")]
    from: Option<PathBuf>,
    /// Run with this `passes.pool_problems` instead of the spec's (validated like the spec;
    /// recorded in the manifest).
    #[arg(long, value_name = "P", conflicts_with = "from")]
    pool_problems: Option<usize>,
    /// Run with `passes.refill = true` whatever the spec says (recorded in the manifest), to
    /// time refill against fixed batches on one spec.
    #[arg(long, conflicts_with = "from")]
    refill: bool,
    /// Also write the JSON report to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// `--device` overrides the spec's; `--tiles`, `--engine` (dtype and policy are the
    /// spec's).
    #[command(flatten)]
    run: RunArgs,
    /// Hide progress bars.
    #[arg(long, conflicts_with = "from")]
    quiet: bool,
    /// Run past the model's trained positions, which are refused by default.
    #[arg(long, conflicts_with = "from")]
    allow_extrapolation: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let report = match (&a.from, &a.spec, &a.out) {
        (Some(dir), _, _) => {
            let r = &a.run;
            if r.device.is_some()
                || r.dtype.is_some()
                || r.tiles.is_some()
                || !r.policy.is_empty()
                || !r.engine.is_empty()
            {
                bail!(
                    "bench campaign --from runs nothing; the run's settings come from its manifest"
                );
            }
            let report = CampaignBench::from_run_dir(dir)?;
            print!("{}", report.table());
            report
        }
        (None, Some(spec), Some(out)) => timed_run(&a, spec, out)?,
        _ => bail!("bench campaign: give SPEC and --out DIR, or --from DIR"),
    };
    if let Some(path) = &a.json {
        report.write(path)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Run the spec into `out`, timed, and write and print its report.
fn timed_run(a: &Args, spec: &Path, out: &Path) -> anyhow::Result<CampaignBench> {
    // Refused before the spec or model is read: a resumed run's wall time would be wrong.
    if out.join("manifest.json").exists() || out.join("shards").exists() {
        bail!(
            "{} already holds a campaign run (finished or partial); timing a resumed run would be wrong: use a new --out",
            out.display()
        );
    }
    let SpecRun { spec, sha, cfg } =
        load_spec(spec, &a.run, "bench campaign", a.pool_problems, a.refill)?;
    let loading = Instant::now();
    let model = load_model(&spec, &cfg, a.allow_extrapolation)?;
    let load_seconds = loading.elapsed().as_secs_f64();
    let started = Instant::now();
    let m = run_campaign(
        &spec,
        &sha,
        &model,
        &RunOptions {
            out_dir: out.to_path_buf(),
            quiet: a.quiet,
            shard: None,
            exec: Some(cfg.exec),
        },
    )?;
    // `run_campaign` synchronizes the device after every pass, so this is the run's wall time.
    let wall = started.elapsed().as_secs_f64();
    let mut report = CampaignBench::from_manifest(&m, out, Some(wall), WallSource::Measured);
    report.load_seconds = Some(load_seconds);
    let path = out.join(campaign::FILE_NAME);
    report.write(&path)?;
    print!("{}", report.table());
    println!("wrote {}; results: {}", path.display(), out.display());
    Ok(report)
}
