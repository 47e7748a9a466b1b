//! Argument parsing (clap) and dispatch to the subcommands.
mod analyze;
mod bench;
mod bench_campaign;
mod bench_noise;
mod campaign;
mod check;
mod crosscheck;
mod divergence;
mod eval;
mod generate;
mod invariance;
mod model_args;
mod models;
mod run_args;
mod spectrum;

use clap::{Parser, Subcommand};

/// Numerics of KV-cache replay in LLM inference.
#[derive(Parser)]
#[command(name = "kvcredit", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// libtorch intra-op threads (default: libtorch's, from the cores or OMP_NUM_THREADS). CPU
    /// results depend on it (sums split by thread); CPU runs record it and resume only with it.
    #[arg(long, global = true, value_parser = clap::value_parser!(i32).range(1..=4096))]
    threads: Option<i32>,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt or token ids.
    Generate(generate::Args),
    /// Teacher-forced logits on a device/dtype against CPU fp32.
    Crosscheck(crosscheck::Args),
    /// The model registry: list and pull real models.
    #[command(subcommand)]
    Models(models::Cmd),
    /// Task evaluations.
    #[command(subcommand)]
    Eval(eval::Cmd),
    /// Counterfactual credit campaigns.
    #[command(subcommand)]
    Campaign(campaign::Cmd),
    /// Cache-ON vs cache-OFF divergence studies.
    #[command(subcommand)]
    Divergence(divergence::Cmd),
    /// Check batch invariance (decode vs prefill, rows of other batches) and time the policies.
    Invariance(invariance::Args),
    /// Throughput of prefill, decode steps and the continuation engine; snapshot memory;
    /// `bench campaign`: a real campaign's tokens/s per pass.
    Bench(bench::Args),
    /// Summarize campaign run dirs: summary.parquet, report.md, figures.
    Analyze(analyze::Args),
    /// Check a campaign run dir's invariants (CI gate): exit 1 naming the offending rows.
    Check(check::Args),
    /// SpectrumKV: tiered KV transfer, its evaluations and workers.
    #[command(subcommand)]
    Spectrum(spectrum::Cmd),
}

/// `kvcredit check` found invariant violations (exit code 1, unlike other errors).
#[derive(Debug, thiserror::Error)]
#[error("invariant: {0}")]
pub struct Violations(pub String);

/// An error and its causes on one line, outermost first. A cause whose text the message
/// already holds (the library's errors print their source inline) is not repeated, and
/// line breaks inside a message (libtorch's backtraces) are cut.
pub fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        let text = text.lines().next().unwrap_or("").trim();
        if text.is_empty() || line.contains(text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(text);
    }
    line
}

/// Parse the command line and run the chosen subcommand.
pub fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(n) = cli.threads {
        tch::set_num_threads(n);
    }
    match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Models(cmd) => models::run(cmd),
        Command::Crosscheck(args) => crosscheck::run(args),
        Command::Eval(cmd) => eval::run(cmd),
        Command::Campaign(cmd) => campaign::run(cmd),
        Command::Divergence(cmd) => divergence::run(cmd),
        Command::Invariance(args) => invariance::run(args),
        Command::Analyze(args) => analyze::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Check(args) => check::run(args),
        Command::Spectrum(cmd) => spectrum::run(cmd),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn one_line_joins_the_cause_chain_without_repeats() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let lib = kvcredit::Error::io("/x/spec.toml", io);
        let e = Err::<(), _>(lib).context("loading the spec").unwrap_err();
        assert_eq!(
            one_line(&e),
            "loading the spec: io: /x/spec.toml: no such file"
        );
        let multi = anyhow::anyhow!("torch: bad shape\nException raised from ...");
        assert_eq!(one_line(&multi), "torch: bad shape");
    }

    #[test]
    fn violations_are_told_apart_from_errors() {
        let v: anyhow::Error = Violations("2 rows".into()).into();
        assert!(v.is::<Violations>());
        assert!(!anyhow::anyhow!("spec: bad").is::<Violations>());
    }
}
