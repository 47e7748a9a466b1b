//! Argument parsing (clap) and dispatch to the subcommands.
mod generate;
mod invariance;

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
    /// Check batch invariance (decode vs prefill, rows of other batches) and time the policies.
    Invariance(invariance::Args),
}

/// Parse the command line and run the chosen subcommand.
pub fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Invariance(args) => invariance::run(args),
    }
}
