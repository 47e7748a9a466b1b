//! Device time per kernel over a piece of code: libtorch's Kineto profiler (CUPTI underneath)
//! through the C++ shim (`kernels/graph_shim.cpp`), which `tch` does not wrap.
//!
//! [`device_profile`] runs a closure with the profiler on and returns, per kernel name (and per
//! memcpy/memset kind), how many times it ran on the GPU and for how long, optionally saving
//! the Chrome trace (open it in Perfetto or `chrome://tracing`). Kernels launched outside ATen —
//! the NVRTC kernels of [`crate::exec`] — are seen as well. Without a GPU the list is empty.
use crate::cuda_graph::shim_call;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::ffi::{CString, c_char, c_int};
use std::path::Path;

#[cfg(kvcredit_shim)]
unsafe extern "C" {
    fn kvc_profile_start(err: *mut c_char, errlen: usize) -> c_int;
    fn kvc_profile_stop(
        trace: *const c_char,
        out: *mut c_char,
        outlen: usize,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
}

/// Stand-ins when the shim was not built.
#[cfg(not(kvcredit_shim))]
mod stubs {
    use super::*;
    pub unsafe fn kvc_profile_start(_: *mut c_char, _: usize) -> c_int {
        1
    }
    pub unsafe fn kvc_profile_stop(
        _: *const c_char,
        _: *mut c_char,
        _: usize,
        _: *mut c_char,
        _: usize,
    ) -> c_int {
        1
    }
}
#[cfg(not(kvcredit_shim))]
use stubs::*;

const UNAVAILABLE: &str = "the profiler is not available in this build (no C++ shim)";
/// Bytes for the per-kernel summary (about 1,000 distinct long template names).
const SUMMARY_LEN: usize = 1 << 20;

/// GPU time of one kernel name (or copy kind) over the profiled code.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KernelTime {
    /// Kernel name as CUPTI reports it (demangled), or `Memcpy …`/`Memset …`.
    pub name: String,
    /// What it computes, from its name ([`family`]).
    pub family: String,
    /// Times it ran.
    pub calls: u64,
    /// Total nanoseconds on the device.
    pub ns: u64,
}

/// A coarse class of a kernel by its name: `gemm`, `attention`, `norm`, `copy`, `sampling`,
/// `elementwise` or `other`.
pub fn family(name: &str) -> &'static str {
    let n = name.to_ascii_lowercase();
    let has = |keys: &[&str]| keys.iter().any(|k| n.contains(k));
    if has(&[
        "gemm", "nvjet", "cutlass", "xmma", "cublas", "gemv", "splitk",
    ]) {
        "gemm"
    } else if has(&["attention", "fmha", "flash", "sdpa", "softmax"]) {
        "attention"
    } else if has(&["rms", "norm"]) {
        "norm"
    } else if has(&[
        "memcpy", "memset", "copy", "cat", "index", "scatter", "gather",
    ]) {
        "copy"
    } else if has(&[
        "argmax",
        "sort",
        "topk",
        "multinomial",
        "exponential",
        "reduce",
    ]) {
        "sampling"
    } else if has(&["elementwise", "vectorized", "kvc_bi_act", "unrolled"]) {
        "elementwise"
    } else {
        "other"
    }
}

/// Run `f` under the profiler; the GPU time per kernel name, longest first. `trace`: also save
/// the Chrome trace there (written whole, then renamed into place).
pub fn device_profile<T>(
    trace: Option<&Path>,
    f: impl FnOnce() -> Result<T>,
) -> Result<(T, Vec<KernelTime>)> {
    // SAFETY: the shim writes at most `errlen` bytes.
    shim_call("profiler start", UNAVAILABLE, |e, n| unsafe {
        kvc_profile_start(e, n)
    })
    .map_err(Error::Torch)?;
    let out = f();
    let partial = trace.map(|p| p.with_extension("json.partial"));
    let path = partial
        .as_ref()
        .map(|p| CString::new(p.to_string_lossy().as_bytes()))
        .transpose()
        .map_err(|_| Error::Spec("trace path holds a NUL byte".into()))?;
    let mut buf = vec![0u8; SUMMARY_LEN];
    // SAFETY: `buf` has `SUMMARY_LEN` bytes and `path` (if any) is NUL-terminated; the shim
    // writes at most that many bytes into each buffer.
    let stopped = shim_call("profiler stop", UNAVAILABLE, |e, n| unsafe {
        kvc_profile_stop(
            path.as_ref().map_or(std::ptr::null(), |p| p.as_ptr()),
            buf.as_mut_ptr().cast(),
            SUMMARY_LEN,
            e,
            n,
        )
    })
    .map_err(Error::Torch);
    let out = out?;
    stopped?;
    if let (Some(partial), Some(trace)) = (&partial, trace) {
        std::fs::rename(partial, trace)
            .map_err(|e| Error::Output(format!("{}: {e}", trace.display())))?;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let mut kernels = parse_summary(&String::from_utf8_lossy(&buf[..end]))?;
    kernels.sort_by(|a, b| b.ns.cmp(&a.ns).then_with(|| a.name.cmp(&b.name)));
    Ok((out, kernels))
}

/// The shim's summary: `calls<TAB>ns<TAB>name` lines.
fn parse_summary(text: &str) -> Result<Vec<KernelTime>> {
    text.lines()
        .map(|line| {
            let mut parts = line.splitn(3, '\t');
            let bad = || Error::Torch(format!("profiler summary line {line:?}"));
            let calls = parts.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
            let ns = parts.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
            let name = parts.next().ok_or_else(bad)?.to_string();
            Ok(KernelTime {
                family: family(&name).into(),
                name,
                calls,
                ns,
            })
        })
        .collect()
}

/// Nanoseconds per family, largest first.
pub fn by_family(kernels: &[KernelTime]) -> Vec<(String, u64)> {
    let mut sums: Vec<(String, u64)> = Vec::new();
    for k in kernels {
        match sums.iter_mut().find(|(f, _)| *f == k.family) {
            Some((_, ns)) => *ns += k.ns,
            None => sums.push((k.family.clone(), k.ns)),
        }
    }
    sums.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    sums
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn summary_lines_parse_and_bad_ones_fail() {
        let k = parse_summary("3\t1500\tvoid gemm<a, b>(int)\n1\t20\tMemcpy HtoD\n").unwrap();
        assert_eq!(k.len(), 2);
        assert_eq!(
            (k[0].calls, k[0].ns, k[0].family.as_str()),
            (3, 1500, "gemm")
        );
        assert_eq!(k[1].family, "copy");
        assert!(parse_summary("x\t1\tname\n").is_err());
        assert!(parse_summary("1\t2\n").is_err());
    }

    #[test]
    fn families_group_and_sort() {
        let mk = |name: &str, ns| KernelTime {
            name: name.into(),
            family: family(name).into(),
            calls: 1,
            ns,
        };
        let ks = [
            mk("kvc_bi_attention", 5),
            mk("nvjet_tst_64x8", 7),
            mk("sm90_xmma_gemm", 4),
        ];
        assert_eq!(
            by_family(&ks),
            vec![("gemm".to_string(), 11), ("attention".to_string(), 5)]
        );
    }

    /// On the CPU the profiler runs (when the shim is built), returns the closure's value and
    /// sees no device kernels; the trace is written whole.
    #[test]
    fn cpu_profile_runs_and_writes_its_trace() {
        let dir = std::env::temp_dir().join(format!("kvc-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let trace = dir.join("trace.json");
        let got = device_profile(Some(&trace), || {
            let a = Tensor::ones([8, 8], (Kind::Float, Device::Cpu));
            Ok(a.matmul(&a).sum(Kind::Float).double_value(&[]))
        });
        if cfg!(kvcredit_shim) {
            let (v, kernels) = got.unwrap();
            assert_eq!(v, 64.0 * 8.0);
            assert!(kernels.is_empty(), "{kernels:?}");
            let text = std::fs::read_to_string(&trace).unwrap();
            assert!(text.contains("aten::matmul"), "trace lacks the op");
        } else {
            assert!(got.is_err());
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
