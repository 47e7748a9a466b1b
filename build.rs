//! Link glue for libtorch: keep `libtorch_cuda` as a NEEDED entry (rustc links with
//! `--as-needed`, which would otherwise drop it and silently disable CUDA), add an rpath to
//! the torch library folder so the binary runs without `LD_LIBRARY_PATH` on this machine, and
//! record the libtorch version for run manifests.
//!
//! Also compiles `kernels/graph_shim.cpp` (CUDA graphs and an ATen op counter, which `tch`
//! does not wrap) against the same libtorch headers. Its CUDA part is compiled only when
//! libtorch's CUDA headers and the CUDA runtime headers (`cuda_runtime_api.h`: `CUDA_HOME`,
//! `/usr/local/cuda`, or the `nvidia/cu*` wheels next to torch) are found, and not when
//! `KVCREDIT_NO_CUDA_GRAPHS` is set; otherwise the shim's graph entry points report that
//! graphs are unavailable and the engine runs eagerly. Sets `cfg(kvcredit_shim)` when the shim
//! is built and `cfg(kvcredit_cuda_graphs)` when its CUDA part is.
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

/// Include folders for the CUDA runtime headers: one holding `cuda_runtime_api.h`, plus, when
/// it lacks the `crt/` headers `cuda_runtime.h` includes (the `nvidia-cuda-runtime` wheel does),
/// one that has them (a CUDA toolkit or the copy Triton bundles; host-side macros only).
fn cuda_includes(torch: &std::path::Path) -> Option<Vec<PathBuf>> {
    let main = cuda_include(torch)?;
    if main.join("crt/host_config.h").exists() {
        return Some(vec![main]);
    }
    let mut extra: Vec<PathBuf> = vec![PathBuf::from("/usr/local/cuda/include")];
    if let Some(site) = torch.parent() {
        extra.push(site.join("triton/backends/nvidia/include"));
        extra.push(site.join("nvidia/cuda_nvcc/include"));
        extra.push(site.join("nvidia/cu13/crt/include"));
    }
    let crt = extra
        .into_iter()
        .find(|d| d.join("crt/host_config.h").exists() && d.join("crt/host_defines.h").exists())?;
    Some(vec![main, crt])
}

/// A folder holding `cuda_runtime_api.h`.
fn cuda_include(torch: &std::path::Path) -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(dir) = std::env::var(var) {
            candidates.push(PathBuf::from(dir).join("include"));
        }
    }
    if let Some(site) = torch.parent() {
        for sub in ["cu13", "cu12", "cuda_runtime"] {
            candidates.push(site.join("nvidia").join(sub).join("include"));
        }
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    candidates
        .into_iter()
        .find(|d| d.join("cuda_runtime_api.h").exists())
}

/// `_GLIBCXX_USE_CXX11_ABI` of the torch build (1 unless the Python says otherwise).
fn cxx11_abi() -> String {
    if let Ok(v) = std::env::var("LIBTORCH_CXX11_ABI") {
        return v;
    }
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    std::process::Command::new(python)
        .args([
            "-c",
            "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))",
        ])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| s == "0" || s == "1")
        .unwrap_or_else(|| "1".into())
}

/// Compile the shim; returns whether its CUDA part was compiled (`None`: no shim at all).
fn build_shim(torch: &std::path::Path) -> Option<bool> {
    println!("cargo:rerun-if-changed=kernels/graph_shim.cpp");
    println!("cargo:rerun-if-env-changed=KVCREDIT_NO_CUDA_GRAPHS");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let include = torch.join("include");
    if !include.join("ATen/record_function.h").exists() {
        println!(
            "cargo:warning=libtorch headers not found under {}: building without the C++ shim",
            include.display()
        );
        return None;
    }
    let wanted = std::env::var_os("KVCREDIT_NO_CUDA_GRAPHS").is_none()
        && include.join("ATen/cuda/CUDAGraph.h").exists()
        && torch.join("lib/libtorch_cuda.so").exists();
    let cuda = if wanted { cuda_includes(torch) } else { None };
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .warnings(false)
        .opt_level(2)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={}", cxx11_abi()))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .file("kernels/graph_shim.cpp");
    if let Some(dirs) = &cuda {
        for dir in dirs {
            build.include(dir);
        }
        build.define("KVCREDIT_WITH_CUDA", None);
    }
    if let Err(e) = build.try_compile("kvcredit_shim") {
        println!("cargo:warning=kvcredit C++ shim failed to compile, building without it: {e}");
        return None;
    }
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
    for lib in ["torch_cpu", "c10"] {
        println!("cargo:rustc-link-arg=-l{lib}");
    }
    if cuda.is_some() {
        println!("cargo:rustc-link-arg=-lc10_cuda");
    }
    println!("cargo:rustc-link-arg=-Wl,--as-needed");
    Some(cuda.is_some())
}

fn main() {
    println!("cargo::rustc-check-cfg=cfg(kvcredit_shim)");
    println!("cargo::rustc-check-cfg=cfg(kvcredit_cuda_graphs)");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_USE_PYTORCH");
    println!("cargo:rerun-if-env-changed=VIRTUAL_ENV");
    let dir = torch_dir();
    let version = dir
        .as_deref()
        .and_then(torch_version)
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=KVCREDIT_LIBTORCH_VERSION={version}");
    if let Some(torch) = dir.as_deref()
        && let Some(cuda) = build_shim(torch)
    {
        println!("cargo:rustc-cfg=kvcredit_shim");
        if cuda {
            println!("cargo:rustc-cfg=kvcredit_cuda_graphs");
        }
    }
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
