//! Argument parsing (clap) and dispatch to the subcommands.
mod analyze;
mod bench;
mod campaign;
mod check;
mod crosscheck;
mod divergence;
mod eval;
mod generate;
mod invariance;
mod model_args;
mod models;

use clap::{Parser, Subcommand};

/// Numerics of KV-cache replay in LLM inference.
#[derive(Parser)]
#[command(name = "kvcredit", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
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
    /// Throughput of prefill, decode steps and the continuation engine; snapshot memory.
    Bench(bench::Args),
    /// Summarize campaign run dirs: summary.parquet, report.md, figures.
    Analyze(analyze::Args),
    /// Check a campaign run dir's invariants (CI gate): exit 1 naming the offending rows.
    Check(check::Args),
}

/// Parse the command line and run the chosen subcommand.
pub fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
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
    }
}
