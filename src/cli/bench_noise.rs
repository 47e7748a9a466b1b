//! `kvcredit bench noise`: which schedule dimensions (batch rows, key padding, engine, prefill
//! chunking) change a row's numerics bitwise, per linear shape and decode step
//! ([`kvcredit::bench::noise`]); a Markdown table on stdout, JSON and Markdown under `--out`.
use super::model_args::ModelArgs;
use super::run_args::{Defaults, RunArgs};
use anyhow::Context;
use kvcredit::PolicyKind;
use kvcredit::bench::noise::{self, NoiseConfig};
use kvcredit::runtime::Dtype;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Dtype (default bf16), device, policy (default stock), tiles.
    #[command(flatten)]
    run: RunArgs,
    /// Prompt length of every row.
    #[arg(long, default_value_t = 200)]
    prompt: usize,
    /// GEMM probe: every row count M in 1..=this.
    #[arg(long, default_value_t = 128)]
    gemm_max_rows: usize,
    /// Row counts of the decode-step probes.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8,12,16,24,32,48,64")]
    rows: Vec<usize>,
    /// Key paddings (positions) of the static step.
    #[arg(long, value_delimiter = ',', default_value = "8,16,64,256")]
    pads: Vec<i64>,
    /// Prefill chunk sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    chunks: Vec<usize>,
    /// Seed of prompts and inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output folder.
    #[arg(long, default_value = "runs/noise")]
    out: PathBuf,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let run = a.run.resolve(Defaults {
        dtype: Dtype::Bf16,
        policy: PolicyKind::Stock,
    })?;
    let chosen = a.model.load(run.dtype, run.device, &run.exec)?;
    let cfg = NoiseConfig {
        prompt: a.prompt,
        gemm_max_rows: a.gemm_max_rows,
        rows: a.rows,
        pads: a.pads,
        chunks: a.chunks,
        seed: a.seed,
    };
    let rows = noise::run(&chosen.decoder, &run.policy, &cfg)?;
    let head = format!(
        "noise probes: {}, {}, {}, {} policy, prompt {}\n\n",
        chosen.what,
        run.dtype,
        run.device_name,
        run.policy.kind(),
        a.prompt
    );
    let table = noise::table(&rows);
    print!("{head}{table}");
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let name = chosen.shape.unwrap_or_else(|| {
        PathBuf::from(&chosen.what)
            .file_stem()
            .map_or("model".into(), |s| s.to_string_lossy().into_owned())
    });
    let dev = run.device_name.replace(':', "");
    let stem = format!("noise-{name}-{}-{}-{dev}", run.dtype, run.policy.kind());
    let (json_path, md_path) = (
        a.out.join(format!("{stem}.json")),
        a.out.join(format!("{stem}.md")),
    );
    let json = serde_json::json!({
        "model": chosen.what,
        "dtype": run.dtype.to_string(),
        "device": run.device_name,
        "policy": run.policy.kind().to_string(),
        "prompt": a.prompt,
        "rows": rows,
    });
    kvcredit::io::write_atomic(&json_path, serde_json::to_string_pretty(&json)?.as_bytes())?;
    kvcredit::io::write_atomic(&md_path, format!("{head}{table}").as_bytes())?;
    println!("wrote {} and {}", json_path.display(), md_path.display());
    Ok(())
}
