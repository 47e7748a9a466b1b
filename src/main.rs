//! The `kvcredit` command line. Errors print as one line on stderr with a non-zero exit.
mod cli;

use std::process::ExitCode;

fn main() -> ExitCode {
    kvcredit::io::install_panic_filter();
    match cli::run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
