//! `kvcredit bench`: prefill, decode-step and continuation-engine throughput, and snapshot
//! memory, per execution policy and engine; a table on stdout, JSON and Parquet under `--out`.
//! `kvcredit bench campaign`: a real campaign's throughput (`super::bench_campaign`).
use super::model_args::{Chosen, ModelArgs};
use super::run_args::RunArgs;
use anyhow::Context;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvcredit::PolicyKind;
use kvcredit::bench::{self, BenchConfig, Progress};
use kvcredit::decode::engine::EngineMode;
use kvcredit::runtime::Dtype;
use kvcredit::sampling::Sampler;
use std::path::PathBuf;
use tch::Device;

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct Args {
    #[command(subcommand)]
    cmd: Option<Sub>,
    #[command(flatten)]
    model: ModelArgs,
    /// Dtype (default bf16), device, the policies (default stock,batch_invariant) and engines
    /// (default eager,auto on CUDA, eager on the CPU) to measure, tiles.
    #[command(flatten)]
    run: RunArgs,
    /// Prompt length: prefill length and cached context of the decode steps.
    #[arg(long, default_value_t = 256)]
    prompt: usize,
    /// Batch sizes of the decode-step timing.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    batches: Vec<usize>,
    /// Timed decode steps per batch size.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// Untimed decode steps first.
    #[arg(long, default_value_t = 2)]
    warmup_steps: usize,
    /// Timed prefills (median reported).
    #[arg(long, default_value_t = 3)]
    prefill_reps: usize,
    /// Tokens the rollout generates (pivots are spread over them).
    #[arg(long, default_value_t = 128)]
    rollout_tokens: usize,
    /// Pivots of the rollout.
    #[arg(long, default_value_t = 32)]
    pivots: usize,
    /// Continuations per branch (2 branches per pivot).
    #[arg(long, default_value_t = 2)]
    k: usize,
    /// Tokens sampled per continuation.
    #[arg(long, default_value_t = 128)]
    new_tokens: usize,
    /// Batch sizes of the continuation engine.
    #[arg(long, value_delimiter = ',', default_value = "64")]
    cont_batches: Vec<usize>,
    /// Skip the rollout, continuations and snapshot memory.
    #[arg(long)]
    no_continuations: bool,
    /// Continuation sampling temperature.
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    /// Samplers to time the continuations under: aten, fused (CUDA only), or both, whose
    /// tokens must then be identical (default: fused on CUDA, aten on the CPU).
    #[arg(long, value_delimiter = ',', value_parser = parse_sampler)]
    samplers: Vec<Sampler>,
    /// Device memory bandwidth in GB/s, for the decode roofline. Default: 4300 (H200) on
    /// CUDA, none on the CPU.
    #[arg(long)]
    bandwidth_gbs: Option<f64>,
    /// JSON from `benches/hf_generate.py` to compare against (matched on shape, dtype and
    /// device; a missing file is skipped with a warning). Default: the repository's
    /// `results/throughput/hf-generate-*.json` (static-cache compiled and eager `generate` on
    /// the H200); a run they do not match uses the eager reference numbers of the targets file,
    /// and the table says so ("vs eager HF generate (weak baseline)").
    #[arg(long)]
    hf: Vec<PathBuf>,
    /// Targets and reference baselines (TOML) replacing the built-in ones (the repository's
    /// benches/targets.toml, embedded at build time). Read before anything is measured; a bad
    /// file is an error.
    #[arg(long)]
    targets: Option<PathBuf>,
    /// Output folder of the JSON report.
    #[arg(long, default_value = "runs/bench")]
    out: PathBuf,
    /// Seed of prompts and sampling noise.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Batch sizes whose eager decode step is profiled on the device (GPU time per kernel,
    /// printed and in the JSON; Chrome traces `trace-<policy>-b<batch>.json` under `--out`).
    #[arg(long, value_delimiter = ',')]
    profile: Vec<usize>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

#[derive(clap::Subcommand)]
enum Sub {
    /// Time a real campaign end to end: tokens/s per pass and for the whole run.
    Campaign(Box<super::bench_campaign::Args>),
    /// Which schedule dimensions (batch rows, key padding, engine, prefill chunking) change a
    /// row's numerics bitwise.
    Noise(Box<super::bench_noise::Args>),
}

fn parse_sampler(s: &str) -> Result<Sampler, String> {
    Sampler::parse(s).map_err(|e| e.to_string())
}

struct Bar(ProgressBar);

impl Progress for Bar {
    fn start(&mut self, what: &str) {
        self.0.set_message(what.to_string());
    }
    fn done(&mut self) {
        self.0.inc(1);
    }
}

pub fn run(a: Args) -> anyhow::Result<()> {
    match a.cmd {
        Some(Sub::Campaign(c)) => return super::bench_campaign::run(*c),
        Some(Sub::Noise(n)) => return super::bench_noise::run(*n),
        None => {}
    }
    let (run, policies, engines) = a.run.resolve_bench(
        Dtype::Bf16,
        &[PolicyKind::Stock, PolicyKind::BatchInvariant],
        |device| match device {
            Device::Cpu => vec![EngineMode::Eager],
            _ => vec![EngineMode::Eager, EngineMode::Auto],
        },
    )?;
    let device = run.device;
    for s in &a.samplers {
        s.check_device(device)?;
    }
    let targets = match &a.targets {
        Some(path) => bench::TargetFile::load(path)?,
        None => bench::TargetFile::shipped()?,
    };
    let Chosen {
        decoder: mut model,
        what,
        shape,
    } = a.model.load(run.dtype, device, &run.exec)?;
    let cfg = BenchConfig {
        policies,
        tiles: Some(run.exec.tiles),
        engines,
        prompt: a.prompt,
        batches: a.batches.clone(),
        warmup_steps: a.warmup_steps,
        steps: a.steps,
        prefill_reps: a.prefill_reps,
        rollout_tokens: a.rollout_tokens,
        pivots: a.pivots,
        k: a.k,
        new_tokens: a.new_tokens,
        cont_batches: if a.no_continuations {
            vec![]
        } else {
            a.cont_batches.clone()
        },
        temperature: a.temperature,
        samplers: a.samplers.clone(),
        bandwidth_gbs: a
            .bandwidth_gbs
            .or((device != Device::Cpu).then_some(4300.0)),
        seed: a.seed,
        profile_batches: a.profile.clone(),
        trace_dir: (!a.profile.is_empty()).then(|| a.out.clone()),
    };
    let pb = ProgressBar::new(bench::measurement_count(&cfg));
    if a.quiet {
        pb.set_draw_target(ProgressDrawTarget::hidden());
    }
    pb.set_style(
        ProgressStyle::with_template("bench {bar:30} {pos}/{len} [{elapsed_precise}] {msg}")
            .expect("valid template"),
    );
    let mut bar = Bar(pb);
    let mut report = bench::run(&mut model, &what, shape.as_deref(), &cfg, &mut bar)?;
    bar.0.finish_and_clear();

    // Baselines: the files given (else the shipped ones), else the targets file's eager
    // reference numbers for this device and dtype.
    let dtype = run.dtype.to_string();
    let kind = if device == Device::Cpu { "cpu" } else { "cuda" };
    if let Some(shape) = &shape {
        let files = if a.hf.is_empty() {
            bench::default_hf_files()
        } else {
            a.hf.clone()
        };
        for path in &files {
            if !path.exists() {
                eprintln!(
                    "warning: HF baseline {} not found (was transformers installed?); skipping it",
                    path.display()
                );
                continue;
            }
            report
                .hf
                .extend(bench::read_hf_baselines(path, shape, &dtype, kind)?);
        }
        if report.hf.is_empty() {
            for b in a.cont_batches.iter().chain(&a.batches) {
                if let Some(base) = targets.reference_baseline(shape, *b, kind, &dtype)
                    && !report.hf.iter().any(|h| h.batch == *b)
                {
                    report.hf.push(base);
                }
            }
        }
    }
    report.evaluate_targets(&targets);
    print!("{}", report.table());

    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let name = shape.unwrap_or_else(|| {
        PathBuf::from(&what)
            .file_stem()
            .map_or("model".into(), |s| s.to_string_lossy().into_owned())
    });
    // `cuda:0` → `cuda0` in file names.
    let dev = report.device.replace(':', "").to_lowercase();
    let path = a.out.join(format!("bench-{name}-{dtype}-{dev}.json"));
    let json = serde_json::to_string_pretty(&report)?;
    kvcredit::io::write_atomic(&path, json.as_bytes())?;
    let table = path.with_extension("parquet");
    report.to_table().write(&table)?;
    println!("wrote {} and {}", path.display(), table.display());
    Ok(())
}
