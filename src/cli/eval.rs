//! `kvcredit eval gsm8k` and `kvcredit eval run SPEC` (any `[task]`): accuracy with a
//! confidence interval, per-problem rows to Parquet.
use super::run_args::{Defaults, RunArgs, registry_paths};
use indicatif::{ProgressBar, ProgressStyle};
use kvcredit::PolicyKind;
use kvcredit::eval::{self, EvalOptions, EvalSpec};
use kvcredit::runtime::{self, Dtype, ModelSource};
use kvcredit::sampling::Sampling;
use kvcredit::tasks::Task;
use kvcredit::tasks::gsm8k::{Gsm8k, PromptFormat};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// GSM8K test split.
    Gsm8k(Args),
    /// The `[task]` of an eval spec (a bundled task or your own JSONL/Parquet file).
    Run(SpecArgs),
}

#[derive(clap::Args)]
pub struct SpecArgs {
    /// Eval spec (TOML): `[task]`, and optionally model, max_new_tokens, batch_size.
    spec: PathBuf,
    /// Model: registry name, GGUF file or Hugging Face folder (default: the spec's).
    #[arg(long)]
    model: Option<String>,
    /// Token cap per answer (default: the spec's, else the task's).
    #[arg(long)]
    max_new_tokens: Option<usize>,
    /// Problems decoded together (default: the spec's, else 8).
    #[arg(long)]
    batch_size: Option<usize>,
    /// Dtype (default fp32), device, policy (default stock), tiles, engine.
    #[command(flatten)]
    run: RunArgs,
    /// Per-problem rows (Parquet; default `runs/eval-TASK.parquet`); the task record and
    /// accuracy go next to it as JSON (same name, `.json`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Run past the model's trained positions, which are refused by default.
    #[arg(long)]
    allow_extrapolation: bool,
}

#[derive(clap::Args)]
pub struct Args {
    /// Model: registry name, GGUF file or Hugging Face folder.
    #[arg(long)]
    model: String,
    /// First problem index.
    #[arg(long, default_value_t = 0)]
    start: usize,
    /// Number of problems.
    #[arg(long, default_value_t = 50)]
    limit: usize,
    /// zero-shot-chat or eight-shot-cot.
    #[arg(long, default_value = "zero-shot-chat")]
    format: String,
    /// Token cap per answer (default: the format's).
    #[arg(long)]
    max_new_tokens: Option<usize>,
    /// Problems decoded together.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Dtype (default fp32), device, policy (default stock), tiles, engine.
    #[command(flatten)]
    run: RunArgs,
    /// Per-problem rows (Parquet).
    #[arg(long, default_value = "runs/eval-gsm8k.parquet")]
    out: PathBuf,
    /// Run past the model's trained positions (`max_position_embeddings` / GGUF
    /// `context_length`), which are refused by default.
    #[arg(long)]
    allow_extrapolation: bool,
}

pub fn run(cmd: Cmd) -> anyhow::Result<()> {
    let a = match cmd {
        Cmd::Gsm8k(a) => a,
        Cmd::Run(a) => return run_spec(a),
    };
    let format: PromptFormat = a.format.parse()?;
    let task = Gsm8k::bundled(a.start..a.start + a.limit, format)?;
    let cfg = a.run.resolve(Defaults {
        dtype: Dtype::Fp32,
        policy: PolicyKind::Stock,
    })?;
    let mut model = runtime::load(
        &ModelSource::resolve(&a.model, &registry_paths())?,
        cfg.dtype,
        cfg.device,
    )?;
    model.decoder.limit_context(!a.allow_extrapolation);
    model.decoder.use_settings(&cfg.exec);
    let opts = EvalOptions {
        max_new_tokens: a.max_new_tokens.unwrap_or(task.max_new_tokens()),
        batch_size: a.batch_size,
        sampling: Sampling::Greedy,
        seed: 0,
        policy: cfg.policy,
        engine: cfg.exec.engine,
    };
    let bar = ProgressBar::new(a.limit as u64);
    bar.set_style(ProgressStyle::with_template(
        "gsm8k {bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}]",
    )?);
    let started = Instant::now();
    let rows = eval::evaluate(&model, &task, &opts, &mut |n| bar.inc(n as u64))?;
    bar.finish_and_clear();
    eval::table(&rows, &model.name).write(&a.out)?;
    let acc = eval::accuracy(&rows);
    println!(
        "gsm8k {} [{} {} {}] problems {}..{}: {acc} in {:.0} s",
        format,
        model.name,
        cfg.dtype,
        cfg.device_name,
        a.start,
        a.start + a.limit,
        started.elapsed().as_secs_f64()
    );
    println!("rows: {}", a.out.display());
    Ok(())
}

fn run_spec(a: SpecArgs) -> anyhow::Result<()> {
    let (spec, task, sha) = EvalSpec::load(&a.spec)?;
    let Some(model_name) = a.model.clone().or(spec.model.clone()) else {
        anyhow::bail!(
            "{}: no model (set `model` in the spec or pass --model)",
            a.spec.display()
        );
    };
    if a.max_new_tokens == Some(0) || a.batch_size == Some(0) {
        anyhow::bail!("--max-new-tokens and --batch-size must be positive");
    }
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("runs/eval-{}.parquet", task.name())));
    let cfg = a.run.resolve(Defaults {
        dtype: Dtype::Fp32,
        policy: PolicyKind::Stock,
    })?;
    let mut model = runtime::load(
        &ModelSource::resolve(&model_name, &registry_paths())?,
        cfg.dtype,
        cfg.device,
    )?;
    model.decoder.limit_context(!a.allow_extrapolation);
    model.decoder.use_settings(&cfg.exec);
    let opts = EvalOptions {
        max_new_tokens: a
            .max_new_tokens
            .or(spec.max_new_tokens)
            .unwrap_or(task.max_new_tokens()),
        batch_size: a.batch_size.or(spec.batch_size).unwrap_or(8),
        sampling: Sampling::Greedy,
        seed: 0,
        policy: cfg.policy,
        engine: cfg.exec.engine,
    };
    let n = task.problems().len();
    let bar = ProgressBar::new(n as u64);
    bar.set_style(ProgressStyle::with_template(
        "eval {bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}]",
    )?);
    let started = Instant::now();
    let rows = eval::evaluate(&model, &task, &opts, &mut |n| bar.inc(n as u64))?;
    bar.finish_and_clear();
    eval::table(&rows, &model.name).write(&out)?;
    let acc = eval::accuracy(&rows);
    let record = task.record();
    let summary = serde_json::json!({
        "spec": a.spec.display().to_string(),
        "spec_sha256": sha,
        "task": record,
        "model": model.name,
        "model_sha256": model.sha256,
        "dtype": cfg.dtype.to_string(),
        "device": cfg.device_name,
        "max_new_tokens": opts.max_new_tokens,
        "correct": acc.correct,
        "total": acc.total,
    });
    let json = out.with_extension("json");
    std::fs::write(&json, serde_json::to_string_pretty(&summary)? + "\n")
        .map_err(|e| kvcredit::Error::io(&json, e))?;
    println!(
        "task {} [{} {} {}] {n} problems: {acc} in {:.0} s",
        record.describe(),
        model.name,
        cfg.dtype,
        cfg.device_name,
        started.elapsed().as_secs_f64()
    );
    println!("rows: {}", out.display());
    Ok(())
}
