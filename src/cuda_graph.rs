//! CUDA graph capture and replay, and an ATen op counter, through a small C++ shim
//! (`kernels/graph_shim.cpp`): `tch` does not wrap `at::cuda::CUDAGraph` or RecordFunction.
//!
//! `build.rs` compiles the shim against the same libtorch headers; its CUDA part only when the
//! CUDA headers are found. Without it [`compiled`] is false and [`CudaGraph::capture`] fails
//! with a clear error, so callers fall back to eager execution.
//!
//! A capture runs the step once on a side stream (warm-up: lazy cuBLAS/allocator set-up happens
//! outside the graph), then again under capture; the tensors the step returns live in the
//! graph's private memory pool and are rewritten by every [`CudaGraph::replay`]. The step must
//! only issue device work on tensors whose storage outlives the graph (no host syncs, no
//! host→device copies). The step's ops are fallible (`f_*` forms): an error inside the capture
//! is returned after the capture is closed.
use crate::{Error, Result};
use std::ffi::{c_char, c_int, c_long, c_void};
use tch::Device;

#[cfg(kvcredit_shim)]
unsafe extern "C" {
    fn kvc_graph_compiled() -> c_int;
    fn kvc_graph_new(device: c_int, err: *mut c_char, errlen: usize) -> *mut c_void;
    fn kvc_graph_enter(g: *mut c_void, err: *mut c_char, errlen: usize) -> c_int;
    fn kvc_graph_begin(g: *mut c_void, err: *mut c_char, errlen: usize) -> c_int;
    fn kvc_graph_end(g: *mut c_void, err: *mut c_char, errlen: usize) -> c_int;
    fn kvc_graph_leave(g: *mut c_void, err: *mut c_char, errlen: usize) -> c_int;
    fn kvc_graph_replay(g: *mut c_void, err: *mut c_char, errlen: usize) -> c_int;
    fn kvc_graph_nodes(g: *mut c_void) -> c_long;
    fn kvc_graph_free(g: *mut c_void);
    fn kvc_ops_count_start(err: *mut c_char, errlen: usize) -> c_int;
    fn kvc_ops_count_stop() -> c_long;
}

/// Stand-ins when the shim was not built at all (no libtorch headers at build time).
#[cfg(not(kvcredit_shim))]
mod stubs {
    use super::*;
    pub unsafe fn kvc_graph_compiled() -> c_int {
        0
    }
    pub unsafe fn kvc_graph_new(_: c_int, _: *mut c_char, _: usize) -> *mut c_void {
        std::ptr::null_mut()
    }
    pub unsafe fn kvc_graph_enter(_: *mut c_void, _: *mut c_char, _: usize) -> c_int {
        1
    }
    pub use kvc_graph_enter as kvc_graph_begin;
    pub use kvc_graph_enter as kvc_graph_end;
    pub use kvc_graph_enter as kvc_graph_leave;
    pub use kvc_graph_enter as kvc_graph_replay;
    pub unsafe fn kvc_graph_nodes(_: *mut c_void) -> c_long {
        -1
    }
    pub unsafe fn kvc_graph_free(_: *mut c_void) {}
    pub unsafe fn kvc_ops_count_start(_: *mut c_char, _: usize) -> c_int {
        1
    }
    pub unsafe fn kvc_ops_count_stop() -> c_long {
        -1
    }
}
#[cfg(not(kvcredit_shim))]
use stubs::*;

const ERR_LEN: usize = 1024;

/// Call a shim function taking an error buffer; map a non-zero return to an error.
fn call(what: &str, f: impl FnOnce(*mut c_char, usize) -> c_int) -> Result<()> {
    shim_call(
        &format!("CUDA graph {what}"),
        "CUDA graphs are not available in this build",
        f,
    )
    .map_err(Error::Spec)
}

/// Call a shim function taking an error buffer (`f` returns non-zero on failure); the error
/// is `what: <the shim's message>` (`unavailable` when it left none).
pub(crate) fn shim_call(
    what: &str,
    unavailable: &str,
    f: impl FnOnce(*mut c_char, usize) -> c_int,
) -> std::result::Result<(), String> {
    let mut buf = vec![0u8; ERR_LEN];
    let rc = f(buf.as_mut_ptr().cast(), ERR_LEN);
    if rc == 0 {
        return Ok(());
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let msg = String::from_utf8_lossy(&buf[..end]);
    let msg = if msg.is_empty() {
        unavailable.into()
    } else {
        msg
    };
    Err(format!("{what}: {msg}"))
}

/// Whether this binary can capture CUDA graphs (its shim was compiled with CUDA headers).
pub fn compiled() -> bool {
    // SAFETY: no arguments; returns a constant.
    unsafe { kvc_graph_compiled() == 1 }
}

/// A captured CUDA graph.
pub struct CudaGraph {
    ptr: *mut c_void,
}

impl CudaGraph {
    /// Capture `step` on `device`: run it once to warm up, then under capture. Returns the
    /// graph and what the captured run returned (tensors in the graph's memory pool, rewritten
    /// by each replay). The warm-up run really executes, so `step` must be idempotent given
    /// the same inputs (a decode step writing the same K/V rows twice is).
    pub fn capture<T>(
        device: Device,
        mut step: impl FnMut() -> Result<T>,
    ) -> Result<(CudaGraph, T)> {
        let Device::Cuda(index) = device else {
            return Err(Error::Spec(format!(
                "CUDA graphs need a CUDA device, not {device:?}"
            )));
        };
        if !compiled() {
            return Err(Error::Spec(
                "this kvcredit binary was built without the CUDA-graph shim (no CUDA headers at build time)"
                    .into(),
            ));
        }
        let mut raw: *mut c_void = std::ptr::null_mut();
        // SAFETY: the shim writes at most `errlen` bytes into the buffer.
        call("creation", |e, n| {
            raw = unsafe { kvc_graph_new(index as c_int, e, n) };
            c_int::from(raw.is_null())
        })?;
        let graph = CudaGraph { ptr: raw };
        // SAFETY (all calls below): `graph.ptr` is a live graph from `kvc_graph_new`.
        call("stream set-up", |e, n| unsafe {
            kvc_graph_enter(graph.ptr, e, n)
        })?;
        let captured: Result<T> = (|| {
            step()?;
            call("capture start", |e, n| unsafe {
                kvc_graph_begin(graph.ptr, e, n)
            })?;
            let out = step();
            // Close the capture whatever happened inside it.
            let ended = call("capture", |e, n| unsafe { kvc_graph_end(graph.ptr, e, n) });
            let out = out?;
            ended?;
            Ok(out)
        })();
        let left = call("stream restore", |e, n| unsafe {
            kvc_graph_leave(graph.ptr, e, n)
        });
        let out = captured?;
        left?;
        Ok((graph, out))
    }

    /// Launch the graph on the current stream.
    pub fn replay(&self) -> Result<()> {
        // SAFETY: `self.ptr` is a live, captured graph.
        call("replay", |e, n| unsafe { kvc_graph_replay(self.ptr, e, n) })
    }

    /// Kernel (and copy/memset) nodes in the graph, when the CUDA runtime could be asked.
    pub fn nodes(&self) -> Option<u64> {
        // SAFETY: `self.ptr` is a live graph.
        let n = unsafe { kvc_graph_nodes(self.ptr) };
        (n >= 0).then_some(n as u64)
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: `self.ptr` came from `kvc_graph_new` and is freed once.
        unsafe { kvc_graph_free(self.ptr) }
    }
}

/// Count the top-level, non-view ATen ops `f` dispatches on this thread (about the kernel
/// launches of an eager step). `None` when the shim is not built.
pub fn count_ops<T>(f: impl FnOnce() -> Result<T>) -> Result<(T, Option<u64>)> {
    // SAFETY: the shim writes at most `errlen` bytes.
    let started = call("op counter", |e, n| unsafe { kvc_ops_count_start(e, n) }).is_ok();
    let out = f();
    // SAFETY: no arguments; removes the callback if one was added.
    let n = unsafe { kvc_ops_count_stop() };
    Ok((out?, (started && n >= 0).then_some(n as u64)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor};

    #[test]
    fn op_counter_counts_top_level_non_view_ops() -> Result<()> {
        let a = Tensor::ones([4, 4], (Kind::Float, Device::Cpu));
        let (_, n) = count_ops(|| {
            let b = &a + 1.0;
            let c = b.view([16]).narrow(0, 0, 8);
            Ok((c * 2.0).sum(Kind::Float))
        })?;
        if cfg!(kvcredit_shim) {
            // add, mul, sum; the view and narrow are not counted.
            assert_eq!(n, Some(3));
        } else {
            assert_eq!(n, None);
        }
        Ok(())
    }

    #[test]
    fn capture_on_the_cpu_is_a_clear_error() {
        let err = CudaGraph::capture(Device::Cpu, || Ok(()))
            .err()
            .expect("refused");
        assert!(err.to_string().contains("need a CUDA device"), "{err}");
    }
}
