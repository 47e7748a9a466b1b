//! `kvcredit check`: the CI gate on a campaign's invariants. Verifies the tables against the
//! digests the manifest records, then prints every violation (rule, offending row, what
//! differs) on stdout and exits 1, or prints one pass line; a table that changed after the
//! run finished is a violation (exit 1), an unreadable run dir an error (exit 2).
use std::path::PathBuf;

use kvcredit::check::check_run;
use kvcredit::io::integrity::verify_run;

/// Violations printed per rule before the rest are counted.
const SHOW_PER_RULE: usize = 50;

#[derive(clap::Args)]
pub struct Args {
    /// Campaign run dirs.
    #[arg(required = true, value_name = "RUN_DIR")]
    run_dirs: Vec<PathBuf>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let mut failed = Vec::new();
    for dir in &a.run_dirs {
        // Tables whose bytes are not the ones the run finished with are not read at all.
        match verify_run(dir) {
            Err(kvcredit::Error::Integrity(msg)) => {
                println!("integrity: {msg}");
                failed.push(format!("integrity: {msg}"));
                continue;
            }
            other => other?,
        };
        let report = check_run(dir)?;
        if report.passed() {
            println!("{}", report.summary_line());
            continue;
        }
        for (rule, n) in report.violated() {
            let rows = report.violations.iter().filter(|v| v.rule == rule);
            for v in rows.take(SHOW_PER_RULE) {
                println!("{v}");
            }
            if n > SHOW_PER_RULE {
                println!("{rule}: … and {} more", n - SHOW_PER_RULE);
            }
        }
        failed.push(report.summary_line());
    }
    if !failed.is_empty() {
        return Err(super::Violations(failed.join("; ")).into());
    }
    Ok(())
}
