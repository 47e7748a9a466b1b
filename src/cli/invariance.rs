//! `kvcredit invariance`: run the batch-invariance checks (decode vs prefill, chunked prefill,
//! the same sequence at different rows of batches of other sizes) on any model, dtype and
//! device, and optionally time the batch-invariant policy against stock.
use super::model_args::{Chosen, ModelArgs};
use anyhow::bail;
use kvcredit::exec::invariance::{self, CheckOptions};
use kvcredit::exec::{BiTiles, TileOverrides, set_tile_overrides};
use kvcredit::runtime::{self, Dtype, sync};
use kvcredit::{Decoder, ExecPolicy, LogitsAt};
use std::time::Instant;
use tch::Tensor;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Weights/activations dtype.
    #[arg(long, value_enum, default_value_t = Dtype::Fp32)]
    dtype: Dtype,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Execution policy to check.
    #[arg(long, value_enum, default_value_t = ExecPolicy::BatchInvariant)]
    policy: ExecPolicy,
    /// Probe sequences.
    #[arg(long, default_value_t = 3)]
    trials: usize,
    /// Seed of the probe tokens and lengths.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Longest probe (and neighbour) sequence.
    #[arg(long, default_value_t = 72)]
    max_len: usize,
    /// Most decode steps per trial.
    #[arg(long, default_value_t = 5)]
    decode_steps: usize,
    /// Batch-invariant tile overrides, e.g. `gemm_rows=64,key_chunk=256` (keys: gemm_rows,
    /// norm_rows, query_tile, key_chunk, units). Also read from KVCREDIT_BI_TILES.
    #[arg(long)]
    tiles: Option<String>,
    /// Also time stock vs batch-invariant (decode steps and prefill).
    #[arg(long)]
    bench: bool,
    /// Only time; skip the checks.
    #[arg(long, requires = "bench")]
    bench_only: bool,
    /// Batch sizes of the decode-step timing.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    bench_batches: Vec<usize>,
    /// Cached tokens per row before the timed decode steps.
    #[arg(long, default_value_t = 256)]
    bench_context: usize,
    /// Timed decode steps per batch size.
    #[arg(long, default_value_t = 8)]
    bench_steps: usize,
    /// Prompt length of the prefill timing (batch 1).
    #[arg(long, default_value_t = 512)]
    bench_prefill: usize,
    /// Interleaved repetitions of every timing (the best is reported).
    #[arg(long, default_value_t = 3)]
    bench_reps: usize,
}

/// Seconds per decode step at batch `b` after `ctx` cached tokens.
fn bench_decode(
    model: &Decoder,
    policy: ExecPolicy,
    b: usize,
    ctx: usize,
    steps: usize,
) -> anyhow::Result<f64> {
    let vocab = model.config().vocab_size as i64;
    let dev = model.device();
    let mut cache = model.new_cache(b, (ctx + steps + 1) as i64)?;
    let prompt = Tensor::randint(vocab, [b as i64, ctx as i64], (tch::Kind::Int64, dev));
    let _ = model.forward(&prompt, &mut cache, &policy, &LogitsAt::Last)?;
    let next = Tensor::randint(vocab, [b as i64, 1], (tch::Kind::Int64, dev));
    let _ = model.forward(&next, &mut cache, &policy, &LogitsAt::Last)?; // warm-up
    sync(dev);
    let start = Instant::now();
    for _ in 0..steps {
        let _ = model.forward(&next, &mut cache, &policy, &LogitsAt::Last)?;
    }
    sync(dev);
    Ok(start.elapsed().as_secs_f64() / steps as f64)
}

/// Seconds of one batch-1 prefill of `n` tokens (after a warm-up run).
fn bench_prefill(model: &Decoder, policy: ExecPolicy, n: usize) -> anyhow::Result<f64> {
    let vocab = model.config().vocab_size as i64;
    let dev = model.device();
    let prompt = Tensor::randint(vocab, [1, n as i64], (tch::Kind::Int64, dev));
    let run = || -> anyhow::Result<()> {
        let mut cache = model.new_cache(1, n as i64)?;
        let _ = model.forward(&prompt, &mut cache, &policy, &LogitsAt::Last)?;
        Ok(())
    };
    run()?; // warm-up
    sync(dev);
    let start = Instant::now();
    run()?;
    sync(dev);
    Ok(start.elapsed().as_secs_f64())
}

/// Best of `reps` interleaved runs of `f` under each policy: (stock, batch-invariant).
fn best_of(
    reps: usize,
    mut f: impl FnMut(ExecPolicy) -> anyhow::Result<f64>,
) -> anyhow::Result<(f64, f64)> {
    let (mut s, mut i) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..reps.max(1) {
        s = s.min(f(ExecPolicy::Stock)?);
        i = i.min(f(ExecPolicy::BatchInvariant)?);
    }
    Ok((s, i))
}

fn bench(model: &Decoder, a: &Args) -> anyhow::Result<()> {
    let _guard = tch::no_grad_guard();
    println!(
        "bench: decode step after {} cached tokens ({} timed steps), prefill of {} tokens at \
         batch 1; best of {} interleaved repetitions",
        a.bench_context, a.bench_steps, a.bench_prefill, a.bench_reps
    );
    println!(
        "{:<22} {:>14} {:>14} {:>8}",
        "", "stock", "batch_inv", "bi/stock"
    );
    for &b in &a.bench_batches {
        let (s, i) = best_of(a.bench_reps, |p| {
            bench_decode(model, p, b, a.bench_context, a.bench_steps)
        })?;
        println!(
            "{:<22} {:>11.2} ms {:>11.2} ms {:>7.2}x",
            format!("decode step, batch {b}"),
            s * 1e3,
            i * 1e3,
            i / s
        );
    }
    let (s, i) = best_of(a.bench_reps, |p| bench_prefill(model, p, a.bench_prefill))?;
    let n = a.bench_prefill as f64;
    println!(
        "{:<22} {:>10.0} t/s {:>10.0} t/s {:>7.2}x",
        "prefill tokens/s",
        n / s,
        n / i,
        i / s
    );
    Ok(())
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let device = runtime::parse_device(&a.device)?;
    if let Some(spec) = &a.tiles {
        set_tile_overrides(Some(TileOverrides::parse(spec)?));
    }
    let Chosen {
        decoder: model,
        what,
        ..
    } = a.model.load(a.dtype, device)?;
    if a.bench {
        model.check_context(
            (a.bench_context + a.bench_steps + 1).max(a.bench_prefill),
            "invariance --bench (--bench-context + --bench-steps, or --bench-prefill)",
        )?;
    }
    if !a.bench_only {
        model.check_context(
            a.max_len + a.decode_steps,
            "invariance (--max-len + --decode-steps)",
        )?;
    }
    let tiles = BiTiles::for_device(device);
    println!(
        "model {what}, {} {}, policy {}, libtorch threads {}; batch-invariant tiles {}",
        a.dtype,
        a.device,
        a.policy,
        tch::get_num_threads(),
        tiles.describe()
    );
    if a.bench {
        bench(&model, &a)?;
        if a.bench_only {
            return Ok(());
        }
    }
    let opts = CheckOptions {
        trials: a.trials,
        seed: a.seed,
        max_len: a.max_len,
        decode_steps: a.decode_steps,
        ..CheckOptions::default()
    };
    let start = Instant::now();
    let report = invariance::run(&model, a.policy, &opts)?;
    print!("{}", report.table());
    let failed = report.checks.iter().filter(|c| !c.passed()).count();
    println!(
        "{} trials in {:.1} s; {} of {} checks bitwise equal; max |Δlogit| {:.3e}",
        a.trials,
        start.elapsed().as_secs_f64(),
        report.checks.len() - failed,
        report.checks.len(),
        report.max_abs()
    );
    match (a.policy, failed) {
        (_, 0) => println!("{}: batch invariant on these checks", a.policy),
        (ExecPolicy::Stock, _) => {
            println!("stock: not batch invariant ({failed} checks differ), as expected")
        }
        (ExecPolicy::BatchInvariant, _) => {
            bail!(
                "batch_invariant: {failed} of {} checks differ",
                report.checks.len()
            )
        }
    }
    Ok(())
}
