//! CUDA C++ compiled at run time with NVRTC and launched on the current stream, through the
//! C++ shim (`kernels/graph_shim.cpp`): libnvrtc ships with the torch wheel and is loaded with
//! `dlopen`, so the binary needs no CUDA toolkit. Launches go to the current CUDA stream, so a
//! CUDA-graph capture records them like any ATen kernel.
//!
//! A module is compiled once per (device, source, options) and kept for the process.
use crate::cuda_graph::shim_call;
use crate::{Error, Result};
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::ffi::{CString, c_char, c_int, c_void};
use std::sync::Mutex;
use tch::Device;

#[cfg(kvcredit_shim)]
unsafe extern "C" {
    fn kvc_nvrtc_module(
        device: c_int,
        src: *const c_char,
        opts: *const *const c_char,
        nopts: c_int,
        err: *mut c_char,
        errlen: usize,
    ) -> *mut c_void;
    fn kvc_nvrtc_function(
        module: *mut c_void,
        name: *const c_char,
        err: *mut c_char,
        errlen: usize,
    ) -> *mut c_void;
    fn kvc_nvrtc_launch(
        f: *mut c_void,
        device: c_int,
        grid: u32,
        block: u32,
        args: *mut *mut c_void,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
    fn kvc_blas_invariant(enter: c_int, err: *mut c_char, errlen: usize) -> c_int;
}

/// Stand-ins when the shim was not built at all (no libtorch headers at build time).
#[cfg(not(kvcredit_shim))]
mod stubs {
    use super::*;
    pub unsafe fn kvc_nvrtc_module(
        _: c_int,
        _: *const c_char,
        _: *const *const c_char,
        _: c_int,
        _: *mut c_char,
        _: usize,
    ) -> *mut c_void {
        std::ptr::null_mut()
    }
    pub unsafe fn kvc_nvrtc_function(
        _: *mut c_void,
        _: *const c_char,
        _: *mut c_char,
        _: usize,
    ) -> *mut c_void {
        std::ptr::null_mut()
    }
    pub unsafe fn kvc_nvrtc_launch(
        _: *mut c_void,
        _: c_int,
        _: u32,
        _: u32,
        _: *mut *mut c_void,
        _: *mut c_char,
        _: usize,
    ) -> c_int {
        1
    }
    pub unsafe fn kvc_blas_invariant(_: c_int, _: *mut c_char, _: usize) -> c_int {
        1
    }
}
#[cfg(not(kvcredit_shim))]
use stubs::*;

const UNAVAILABLE: &str = "this kvcredit binary was built without the C++ shim";

fn torch_err(msg: String) -> Error {
    Error::Torch(msg)
}

/// One kernel argument, as the kernel declares it.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    /// A device pointer.
    Ptr(*mut c_void),
    /// `int`.
    I32(i32),
    /// `long long`.
    I64(i64),
    /// `float`.
    F32(f32),
}

/// A compiled kernel of a loaded module.
#[derive(Debug, Clone, Copy)]
pub struct Kernel {
    func: usize,
    device: c_int,
}

/// (device, source address, options): sources are `&'static` strings.
type Key = (c_int, usize, Vec<String>);

/// A loaded module and the kernels looked up in it so far.
struct Module {
    handle: usize,
    functions: HashMap<String, usize>,
}

fn modules() -> &'static Mutex<HashMap<Key, Module>> {
    static MODULES: std::sync::OnceLock<Mutex<HashMap<Key, Module>>> = std::sync::OnceLock::new();
    MODULES.get_or_init(Default::default)
}

fn cstring(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::Torch(format!("NVRTC input has a NUL byte: {s:?}")))
}

/// Compile `source` with `options` and load it on CUDA device `index`; the module's handle.
fn compile(index: c_int, source: &str, options: &[String]) -> Result<usize> {
    let src = cstring(source)?;
    let opts = options
        .iter()
        .map(|o| cstring(o))
        .collect::<Result<Vec<_>>>()?;
    let ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    let mut raw: *mut c_void = std::ptr::null_mut();
    // SAFETY: the strings outlive the call; the shim writes at most `n` bytes.
    shim_call("NVRTC", UNAVAILABLE, |e, n| {
        raw = unsafe {
            kvc_nvrtc_module(
                index,
                src.as_ptr(),
                ptrs.as_ptr(),
                ptrs.len() as c_int,
                e,
                n,
            )
        };
        c_int::from(raw.is_null())
    })
    .map_err(torch_err)?;
    Ok(raw as usize)
}

impl Kernel {
    /// Kernel `name` of `source` compiled with `options` for `device` (cached).
    pub fn get(
        device: Device,
        source: &'static str,
        options: &[String],
        name: &str,
    ) -> Result<Kernel> {
        let Device::Cuda(index) = device else {
            return Err(Error::Torch(format!(
                "NVRTC kernels need a CUDA device, not {device:?}"
            )));
        };
        let index = index as c_int;
        let key: Key = (index, source.as_ptr() as usize, options.to_vec());
        let mut mods = modules().lock().unwrap_or_else(|e| e.into_inner());
        let module = match mods.entry(key) {
            Entry::Occupied(m) => m.into_mut(),
            Entry::Vacant(slot) => slot.insert(Module {
                handle: compile(index, source, options)?,
                functions: HashMap::new(),
            }),
        };
        if let Some(&func) = module.functions.get(name) {
            return Ok(Kernel {
                func,
                device: index,
            });
        }
        let cname = cstring(name)?;
        let handle = module.handle;
        let mut func: *mut c_void = std::ptr::null_mut();
        // SAFETY: `handle` is a loaded module; the shim writes at most `n` bytes.
        shim_call("NVRTC kernel", UNAVAILABLE, |e, n| {
            func = unsafe { kvc_nvrtc_function(handle as *mut c_void, cname.as_ptr(), e, n) };
            c_int::from(func.is_null())
        })
        .map_err(torch_err)?;
        module.functions.insert(name.into(), func as usize);
        Ok(Kernel {
            func: func as usize,
            device: index,
        })
    }

    /// Launch on the current stream: `grid` blocks of `block` threads (one dimension each).
    /// The caller guarantees that `args` match the kernel's parameters and that the pointers
    /// are live device memory of the sizes the kernel reads and writes.
    pub fn launch(&self, grid: u32, block: u32, args: &[Arg]) -> Result<()> {
        if grid == 0 {
            return Ok(());
        }
        // One 8-byte slot per argument; the driver reads each parameter's size from the slot.
        let mut slots: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(p) => p as u64,
                Arg::I32(v) => u64::from(v as u32),
                Arg::I64(v) => v as u64,
                Arg::F32(v) => u64::from(v.to_bits()),
            })
            .collect();
        let mut ptrs: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| (s as *mut u64).cast::<c_void>())
            .collect();
        // SAFETY: `func` is a loaded kernel; the slots outlive the (asynchronous) launch call,
        // which copies the parameters before returning.
        shim_call("kernel launch", UNAVAILABLE, |e, n| unsafe {
            kvc_nvrtc_launch(
                self.func as *mut c_void,
                self.device,
                grid,
                block,
                ptrs.as_mut_ptr(),
                e,
                n,
            )
        })
        .map_err(torch_err)
    }
}

/// Whether NVRTC kernels can run on `device`: a CUDA device, and a binary built with the shim.
pub fn available(device: Device) -> bool {
    matches!(device, Device::Cuda(_)) && crate::cuda_graph::compiled()
}

/// Run `f` with cuBLAS set for GEMMs whose rows do not depend on M: cuBLASLt preferred,
/// reduced-precision reductions and split-K off. The previous settings are restored after.
pub fn with_invariant_blas<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    // SAFETY: the shim writes at most `n` bytes.
    shim_call("cuBLAS settings", UNAVAILABLE, |e, n| unsafe {
        kvc_blas_invariant(1, e, n)
    })
    .map_err(torch_err)?;
    let out = f();
    // SAFETY: as above; restores what the call above saved.
    let restored = shim_call("cuBLAS settings", UNAVAILABLE, |e, n| unsafe {
        kvc_blas_invariant(0, e, n)
    })
    .map_err(torch_err);
    let out = out?;
    restored?;
    Ok(out)
}
