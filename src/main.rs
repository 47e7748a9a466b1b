//! The `kvcredit` command line. Exit codes follow ripgrep's convention: 0 success, 1 a `check`
//! found invariant violations, 2 an error. An error prints as one line on stderr: the whole
//! cause chain, outermost first.
mod cli;

use std::process::ExitCode;

fn main() -> ExitCode {
    kvcredit::io::install_panic_filter();
    match cli::run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", cli::one_line(&e));
            if e.is::<cli::Violations>() {
                ExitCode::from(1)
            } else {
                ExitCode::from(2)
            }
        }
    }
}
