//! Argument parsing (clap) and dispatch to the subcommands.
mod analyze;
mod check;
mod generate;

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
        Command::Analyze(args) => analyze::run(args),
        Command::Check(args) => check::run(args),
    }
}
