//! Link glue for libtorch: keep `libtorch_cuda` as a NEEDED entry (rustc links with
//! `--as-needed`, which would otherwise drop it and silently disable CUDA) and add an rpath
//! to the torch library folder so the binary runs without `LD_LIBRARY_PATH` on this machine.
use std::path::PathBuf;

fn torch_lib_dir() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("LIBTORCH") {
        return Some(PathBuf::from(dir).join("lib"));
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
    (!dir.is_empty()).then(|| PathBuf::from(dir).join("lib"))
}

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_USE_PYTORCH");
    println!("cargo:rerun-if-env-changed=VIRTUAL_ENV");
    if let Some(lib) = torch_lib_dir() {
        println!("cargo:rustc-link-search=native={}", lib.display());
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
        if lib.join("libtorch_cuda.so").exists() {
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
            println!("cargo:rustc-link-arg=-ltorch_cuda");
            println!("cargo:rustc-link-arg=-Wl,--as-needed");
        }
    }
}
