//! What a study prints while it runs: a progress bar over its units (hidden with `quiet`),
//! one line per finished unit when stderr is not a terminal (logs of batch jobs), and the
//! closing line naming the run folder.
use crate::{Error, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::Path;

/// A bar over `len` units labelled `what`; hidden when `quiet`.
pub fn bar(len: usize, what: &str, quiet: bool) -> Result<ProgressBar> {
    let b = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(len as u64)
    };
    b.set_style(
        ProgressStyle::with_template(&format!(
            "{what} {{bar:30}} {{pos}}/{{len}} [{{elapsed_precise}}<{{eta_precise}}]"
        ))
        .map_err(|e| Error::Output(e.to_string()))?,
    );
    Ok(b)
}

/// One line on stderr per finished unit, only when stderr is not a terminal (where the bar
/// says the same) and not `quiet`.
pub fn unit_line(quiet: bool, line: std::fmt::Arguments) {
    use std::io::IsTerminal;
    if !quiet && !std::io::stderr().is_terminal() {
        eprintln!("{line}");
    }
}

/// The last line a study prints: where its outputs are.
pub fn outputs_line(out: &Path) -> String {
    format!("outputs are in {}", out.display())
}
