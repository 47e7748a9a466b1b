//! Link glue for libtorch: keep `libtorch_cuda` as a NEEDED entry (rustc links with
//! `--as-needed`, which would otherwise drop it and silently disable CUDA), add an rpath to
//! the torch library folder so the binary runs without `LD_LIBRARY_PATH` on this machine, and
//! record the libtorch version for run manifests.
use std::path::PathBuf;

/// The torch install folder (holding `lib/`), from `LIBTORCH` or the active Python.
fn torch_dir() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("LIBTORCH") {
        return Some(PathBuf::from(dir));
    }
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let out = std::process::Command::new(python)
        .args([
            "-c",
            "import torch, os; print(os.path.dirname(torch.__file__))",
        ])
        .output()
        .ok()?;
    let dir = String::from_utf8(out.stdout).ok()?;
    let dir = dir.trim();
    (!dir.is_empty()).then(|| PathBuf::from(dir))
}

/// `2.11.0+cu130` from a wheel's `version.py` or a standalone libtorch's `build-version`.
fn torch_version(dir: &std::path::Path) -> Option<String> {
    if let Ok(text) = std::fs::read_to_string(dir.join("version.py")) {
        let line = text.lines().find(|l| l.starts_with("__version__"))?;
        return Some(line.split(['\'', '"']).nth(1)?.to_string());
    }
    std::fs::read_to_string(dir.join("build-version"))
        .ok()
        .map(|s| s.trim().to_string())
}

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_USE_PYTORCH");
    println!("cargo:rerun-if-env-changed=VIRTUAL_ENV");
    let dir = torch_dir();
    let version = dir
        .as_deref()
        .and_then(torch_version)
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=KVCREDIT_LIBTORCH_VERSION={version}");
    if let Some(lib) = dir.map(|d| d.join("lib")) {
        println!("cargo:rustc-link-search=native={}", lib.display());
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
        if lib.join("libtorch_cuda.so").exists() {
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
            println!("cargo:rustc-link-arg=-ltorch_cuda");
            println!("cargo:rustc-link-arg=-Wl,--as-needed");
        }
    }
}
