// kvcredit's C++ shim over libtorch APIs that tch does not wrap:
//
// * CUDA graphs (`at::cuda::CUDAGraph`): capture a decode step on a side stream, replay it.
//   Compiled only with -DKVCREDIT_WITH_CUDA (build.rs defines it when libtorch's CUDA headers
//   and the CUDA runtime headers are found); otherwise the entry points report "not compiled".
// * An ATen op counter (RecordFunction callbacks): how many top-level, non-view ops a piece
//   of Rust code dispatches — the launches of an eager step. CPU and CUDA.
// * NVRTC: compile CUDA C++ at run time (kernels/bi_kernels.cu) and launch it on the current
//   stream (so it is captured by CUDA graphs). libnvrtc is loaded with dlopen from the
//   directory of the libcudart libtorch loaded (the torch wheel ships both), the driver API
//   from libcuda.so.1; only their headers are needed at build time.
// * cuBLAS settings for M-invariant GEMMs: cuBLASLt preferred, reduced-precision reductions
//   and split-K off, set around a call and restored after it.
// * A device-time profile (libtorch's Kineto profiler, CUPTI underneath): GPU time per kernel
//   name over a piece of Rust code, and optionally its Chrome trace. CPU and CUDA.
//
// Every entry point catches C++ exceptions and reports them through `err` (a buffer of
// `errlen` bytes) with a non-zero return, so nothing unwinds into Rust.
//
// No CUDA runtime function is called directly (that would make the binary need libcudart on
// its own): only c10/ATen exports, and `cudaGraphGetNodes` looked up with dlsym from the
// libcudart that libtorch_cuda has already loaded.
#include <ATen/Context.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <atomic>
#include <map>
#include <set>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

#ifdef KVCREDIT_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/Context.h>
#include <cuda.h>
#include <dirent.h>
#include <dlfcn.h>
#include <nvrtc.h>

#include <map>
#include <mutex>
#include <optional>
#include <vector>
#endif

namespace {

void set_err(char* err, size_t errlen, const char* msg) {
  if (err != nullptr && errlen > 0) {
    std::strncpy(err, msg, errlen - 1);
    err[errlen - 1] = '\0';
  }
}

#define KVC_TRY(...)                                    \
  try {                                                 \
    __VA_ARGS__;                                        \
    return 0;                                           \
  } catch (const std::exception& e) {                   \
    set_err(err, errlen, e.what());                     \
    return 1;                                           \
  } catch (...) {                                       \
    set_err(err, errlen, "unknown C++ exception");      \
    return 1;                                           \
  }

// ---- op counter -------------------------------------------------------------------------

std::atomic<long> g_ops{0};
thread_local int t_depth = 0;
at::CallbackHandle g_handle = 0;

bool is_view(const char* name) {
  static const char* views[] = {
      "aten::view",      "aten::narrow",      "aten::slice",        "aten::select",
      "aten::transpose", "aten::permute",     "aten::expand",       "aten::unsqueeze",
      "aten::squeeze",   "aten::as_strided",  "aten::split_with_sizes", "aten::t",
      "aten::alias",     "aten::detach",      "aten::view_as",      "aten::lift_fresh",
      "aten::empty",     "aten::empty_strided", "aten::resize_",    "aten::_reshape_alias",
      "aten::unbind",    "aten::split",       "aten::chunk",        "aten::expand_as",
  };
  for (const char* v : views) {
    if (std::strcmp(name, v) == 0) {
      return true;
    }
  }
  return false;
}

}  // namespace

extern "C" {

int kvc_ops_count_start(char* err, size_t errlen) {
  KVC_TRY({
    if (g_handle != 0) {
      at::removeCallback(g_handle);
      g_handle = 0;
    }
    g_ops = 0;
    t_depth = 0;
    g_handle = at::addThreadLocalCallback(
        at::RecordFunctionCallback(
            [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
              if (t_depth++ == 0 && !is_view(fn.name())) {
                g_ops++;
              }
              return nullptr;
            },
            [](const at::RecordFunction&, at::ObserverContext*) { t_depth--; })
            .needsInputs(false)
            .scopes({at::RecordScope::FUNCTION}));
  })
}

long kvc_ops_count_stop() {
  try {
    if (g_handle != 0) {
      at::removeCallback(g_handle);
      g_handle = 0;
    }
  } catch (...) {
  }
  return g_ops.load();
}

// ---- device-time profile ----------------------------------------------------------------

int kvc_profile_start(char* err, size_t errlen) {
  KVC_TRY({
    namespace tp = torch::profiler::impl;
    tp::ProfilerConfig cfg(tp::ProfilerState::KINETO);
    std::set<tp::ActivityType> acts{tp::ActivityType::CPU};
    if (at::hasCUDA()) acts.insert(tp::ActivityType::CUDA);
    torch::autograd::profiler::prepareProfiler(cfg, acts);
    torch::autograd::profiler::enableProfiler(cfg, acts);
  })
}

// Stop the profiler started by kvc_profile_start. Writes one line per device event name,
// "count<TAB>total ns<TAB>name\n", into `out` (at most `outlen` bytes, NUL-terminated; a
// summary that does not fit is cut at a line end) and saves the Chrome trace to `trace`
// unless it is null or empty.
int kvc_profile_stop(const char* trace, char* out, size_t outlen, char* err, size_t errlen) {
  KVC_TRY({
    auto result = torch::autograd::profiler::disableProfiler();
    std::map<std::string, std::pair<long, unsigned long long>> by_name;
    for (const auto& e : result->events()) {
      if (e.deviceType() != c10::DeviceType::CUDA || e.isHiddenEvent()) continue;
      auto& slot = by_name[e.name()];
      slot.first += 1;
      slot.second += e.durationNs();
    }
    std::string text;
    for (const auto& [name, v] : by_name) {
      std::string line = std::to_string(v.first) + "\t" + std::to_string(v.second) + "\t";
      for (char c : name) line.push_back(c == '\t' || c == '\n' ? ' ' : c);
      line.push_back('\n');
      if (text.size() + line.size() + 1 > outlen) break;
      text += line;
    }
    if (outlen > 0) {
      std::memcpy(out, text.data(), text.size());
      out[text.size()] = '\0';
    }
    if (trace != nullptr && trace[0] != '\0') result->save(trace);
  })
}

#ifdef KVCREDIT_WITH_CUDA

struct KvcGraph {
  at::cuda::CUDAGraph graph;
  c10::cuda::CUDAStream side;
  std::optional<c10::cuda::CUDAStream> prev;
  c10::DeviceIndex device;
  long nodes = -1;
  explicit KvcGraph(c10::DeviceIndex d)
      : graph(/*keep_graph=*/true), side(c10::cuda::getStreamFromPool(false, d)), device(d) {}
};


}  // extern "C"

namespace {

// ---- NVRTC and the driver API, loaded at run time -----------------------------------------

struct Nvrtc {
  nvrtcResult (*create)(nvrtcProgram*, const char*, const char*, int, const char* const*,
                        const char* const*) = nullptr;
  nvrtcResult (*compile)(nvrtcProgram, int, const char* const*) = nullptr;
  nvrtcResult (*log_size)(nvrtcProgram, size_t*) = nullptr;
  nvrtcResult (*log)(nvrtcProgram, char*) = nullptr;
  nvrtcResult (*cubin_size)(nvrtcProgram, size_t*) = nullptr;
  nvrtcResult (*cubin)(nvrtcProgram, char*) = nullptr;
  nvrtcResult (*destroy)(nvrtcProgram*) = nullptr;
  const char* (*err_str)(nvrtcResult) = nullptr;
  CUresult (*module_load)(CUmodule*, const void*) = nullptr;
  CUresult (*get_function)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                     unsigned, CUstream, void**, void**) = nullptr;
  CUresult (*cu_err)(CUresult, const char**) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*device_attr)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*ctx_current)(CUcontext*) = nullptr;
  std::string error;
};

template <typename F>
bool sym(void* lib, const char* name, F& out, std::string& error) {
  out = reinterpret_cast<F>(dlsym(lib, name));
  if (out == nullptr) {
    error = std::string("symbol ") + name + " not found";
    return false;
  }
  return true;
}

// Load every libnvrtc-builtins of `dir` (NVRTC opens its builtins by name at compile time,
// which finds them only when they are already loaded or on the library path).
void preload_builtins(const std::string& dir) {
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      std::string name(e->d_name);
      if (name.rfind("libnvrtc-builtins.so", 0) == 0) {
        dlopen((dir + name).c_str(), RTLD_NOW | RTLD_GLOBAL);
      }
    }
    closedir(d);
  }
}

// libnvrtc next to the libcudart that libtorch_cuda loaded, else by name.
void* open_nvrtc() {
  const char* sonames[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"};
  Dl_info info;
  void* anchor = dlsym(RTLD_DEFAULT, "cudaGraphGetNodes");
  if (anchor != nullptr && dladdr(anchor, &info) != 0 && info.dli_fname != nullptr) {
    std::string path(info.dli_fname);
    auto slash = path.rfind('/');
    if (slash != std::string::npos) {
      std::string dir = path.substr(0, slash + 1);
      for (const char* n : sonames) {
        if (void* h = dlopen((dir + n).c_str(), RTLD_NOW | RTLD_GLOBAL)) {
          preload_builtins(dir);
          return h;
        }
      }
    }
  }
  for (const char* n : sonames) {
    if (void* h = dlopen(n, RTLD_NOW | RTLD_GLOBAL)) {
      return h;
    }
  }
  return nullptr;
}

const Nvrtc& nvrtc() {
  static Nvrtc api = [] {
    Nvrtc a;
    void* rtc = open_nvrtc();
    void* cu = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (rtc == nullptr) {
      a.error = "libnvrtc not found (it ships with the torch wheel, next to libcudart)";
      return a;
    }
    if (cu == nullptr) {
      a.error = "libcuda.so.1 (the CUDA driver) not found";
      return a;
    }
    std::string& e = a.error;
    bool ok = sym(rtc, "nvrtcCreateProgram", a.create, e) &&
              sym(rtc, "nvrtcCompileProgram", a.compile, e) &&
              sym(rtc, "nvrtcGetProgramLogSize", a.log_size, e) &&
              sym(rtc, "nvrtcGetProgramLog", a.log, e) &&
              sym(rtc, "nvrtcGetCUBINSize", a.cubin_size, e) &&
              sym(rtc, "nvrtcGetCUBIN", a.cubin, e) &&
              sym(rtc, "nvrtcDestroyProgram", a.destroy, e) &&
              sym(rtc, "nvrtcGetErrorString", a.err_str, e) &&
              sym(cu, "cuModuleLoadData", a.module_load, e) &&
              sym(cu, "cuModuleGetFunction", a.get_function, e) &&
              sym(cu, "cuLaunchKernel", a.launch, e) &&
              sym(cu, "cuGetErrorString", a.cu_err, e) &&
              sym(cu, "cuDeviceGet", a.device_get, e) &&
              sym(cu, "cuDeviceGetAttribute", a.device_attr, e) &&
              sym(cu, "cuCtxGetCurrent", a.ctx_current, e);
    if (!ok) {
      a.launch = nullptr;
    }
    return a;
  }();
  if (api.launch == nullptr) {
    throw std::runtime_error("NVRTC: " + api.error);
  }
  return api;
}

void cu_check(const Nvrtc& a, CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) {
    const char* msg = nullptr;
    a.cu_err(r, &msg);
    throw std::runtime_error(std::string(what) + ": " + (msg ? msg : "unknown CUDA error"));
  }
}

// The thread's current context is the device's primary one (torch made it current).
void ensure_context(const Nvrtc& a, int device) {
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
  CUcontext ctx = nullptr;
  cu_check(a, a.ctx_current(&ctx), "cuCtxGetCurrent");
  if (ctx == nullptr) {
    using Free = int (*)(void*);
    if (auto f = reinterpret_cast<Free>(dlsym(RTLD_DEFAULT, "cudaFree"))) {
      f(nullptr);
    }
  }
}

// ---- cuBLAS settings ---------------------------------------------------------------------

struct BlasState {
  at::BlasBackend backend;
  at::CuBLASReductionOption fp16;
  at::CuBLASReductionOption bf16;
};
thread_local std::vector<BlasState> t_blas;

void set_reduction(bool fp16, at::CuBLASReductionOption o) {
  using O = at::CuBLASReductionOption;
  bool reduced = o == O::AllowReducedPrecisionWithSplitK;
  bool splitk = o != O::DisallowReducedPrecisionDisallowSplitK;
  if (fp16) {
    at::globalContext().setAllowFP16ReductionCuBLAS(reduced, splitk);
  } else {
    at::globalContext().setAllowBF16ReductionCuBLAS(reduced, splitk);
  }
}

}  // namespace

extern "C" {

int kvc_graph_compiled() { return 1; }

void* kvc_graph_new(int device, char* err, size_t errlen) {
  try {
    return new KvcGraph(static_cast<c10::DeviceIndex>(device));
  } catch (const std::exception& e) {
    set_err(err, errlen, e.what());
  } catch (...) {
    set_err(err, errlen, "unknown C++ exception");
  }
  return nullptr;
}

// Make the side stream current (after all queued work finished): warm-up and capture run there.
int kvc_graph_enter(void* g, char* err, size_t errlen) {
  KVC_TRY({
    auto* s = static_cast<KvcGraph*>(g);
    c10::cuda::set_device(s->device);
    c10::cuda::device_synchronize();
    s->prev = c10::cuda::getCurrentCUDAStream(s->device);
    c10::cuda::setCurrentCUDAStream(s->side);
  })
}

// Thread-local capture mode: the snapshot-hashing threads copy device memory to the host while
// a step is captured, which the default global mode would refuse (and so abort the capture).
int kvc_graph_begin(void* g, char* err, size_t errlen) {
  KVC_TRY({
    static_cast<KvcGraph*>(g)->graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
  })
}

// End the capture, count the graph's nodes, instantiate it.
int kvc_graph_end(void* g, char* err, size_t errlen) {
  KVC_TRY({
    auto* s = static_cast<KvcGraph*>(g);
    s->graph.capture_end();
    using GetNodes = int (*)(void*, void*, size_t*);
    if (auto fn = reinterpret_cast<GetNodes>(dlsym(RTLD_DEFAULT, "cudaGraphGetNodes"))) {
      size_t n = 0;
      if (fn(static_cast<void*>(s->graph.raw_cuda_graph()), nullptr, &n) == 0) {
        s->nodes = static_cast<long>(n);
      }
    }
    s->graph.instantiate();
  })
}

// Restore the previous stream and wait for the side stream.
int kvc_graph_leave(void* g, char* err, size_t errlen) {
  KVC_TRY({
    auto* s = static_cast<KvcGraph*>(g);
    if (s->prev) {
      c10::cuda::setCurrentCUDAStream(*s->prev);
      s->prev.reset();
    }
    c10::cuda::device_synchronize();
  })
}

int kvc_graph_replay(void* g, char* err, size_t errlen) {
  KVC_TRY({ static_cast<KvcGraph*>(g)->graph.replay(); })
}

long kvc_graph_nodes(void* g) { return static_cast<KvcGraph*>(g)->nodes; }

void kvc_graph_free(void* g) {
  try {
    delete static_cast<KvcGraph*>(g);
  } catch (...) {
  }
}


// Compile `src` for `device`'s architecture (options: `nopts` strings, e.g. -DHD=64) and
// load it; returns the CUmodule, or null with the compile log in `err`.
void* kvc_nvrtc_module(int device, const char* src, const char* const* opts, int nopts,
                       char* err, size_t errlen) {
  try {
    const Nvrtc& a = nvrtc();
    ensure_context(a, device);
    CUdevice dev;
    cu_check(a, a.device_get(&dev, device), "cuDeviceGet");
    int major = 0, minor = 0;
    cu_check(a, a.device_attr(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
             "cuDeviceGetAttribute");
    cu_check(a, a.device_attr(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
             "cuDeviceGetAttribute");
    std::vector<std::string> all = {"--gpu-architecture=sm_" + std::to_string(major) +
                                        std::to_string(minor),
                                    "--std=c++17", "-default-device"};
    for (int i = 0; i < nopts; ++i) {
      all.emplace_back(opts[i]);
    }
    std::vector<const char*> ptrs;
    for (const auto& o : all) {
      ptrs.push_back(o.c_str());
    }
    nvrtcProgram prog;
    nvrtcResult r = a.create(&prog, src, "bi_kernels.cu", 0, nullptr, nullptr);
    if (r != NVRTC_SUCCESS) {
      throw std::runtime_error(std::string("nvrtcCreateProgram: ") + a.err_str(r));
    }
    r = a.compile(prog, static_cast<int>(ptrs.size()), ptrs.data());
    if (r != NVRTC_SUCCESS) {
      size_t n = 0;
      a.log_size(prog, &n);
      std::string log(n, '\0');
      if (n > 0) {
        a.log(prog, log.data());
      }
      a.destroy(&prog);
      for (auto& c : log) {
        if (c == '\n') c = ' ';
      }
      throw std::runtime_error(std::string("NVRTC compile failed (") + a.err_str(r) + "): " + log);
    }
    size_t n = 0;
    a.cubin_size(prog, &n);
    std::string cubin(n, '\0');
    a.cubin(prog, cubin.data());
    a.destroy(&prog);
    CUmodule module = nullptr;
    cu_check(a, a.module_load(&module, cubin.data()), "cuModuleLoadData");
    return module;
  } catch (const std::exception& e) {
    set_err(err, errlen, e.what());
  } catch (...) {
    set_err(err, errlen, "unknown C++ exception");
  }
  return nullptr;
}

void* kvc_nvrtc_function(void* module, const char* name, char* err, size_t errlen) {
  try {
    const Nvrtc& a = nvrtc();
    CUfunction f = nullptr;
    cu_check(a, a.get_function(&f, static_cast<CUmodule>(module), name), name);
    return f;
  } catch (const std::exception& e) {
    set_err(err, errlen, e.what());
  } catch (...) {
    set_err(err, errlen, "unknown C++ exception");
  }
  return nullptr;
}

// Launch `f` on `device`'s current stream (captured when a graph capture is in progress).
int kvc_nvrtc_launch(void* f, int device, unsigned grid, unsigned block, void** args, char* err,
                     size_t errlen) {
  KVC_TRY({
    const Nvrtc& a = nvrtc();
    auto stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
    cu_check(a,
             a.launch(static_cast<CUfunction>(f), grid, 1, 1, block, 1, 1, 0,
                      reinterpret_cast<CUstream>(stream.stream()), args, nullptr),
             "cuLaunchKernel");
  })
}

// enter = 1: save the cuBLAS settings and set the M-invariant ones; 0: restore the saved ones.
int kvc_blas_invariant(int enter, char* err, size_t errlen) {
  KVC_TRY({
    auto& c = at::globalContext();
    using O = at::CuBLASReductionOption;
    if (enter != 0) {
      t_blas.push_back({c.blasPreferredBackend(), c.allowFP16ReductionCuBLAS(),
                        c.allowBF16ReductionCuBLAS()});
      c.setBlasPreferredBackend(at::BlasBackend::Cublaslt);
      set_reduction(true, O::DisallowReducedPrecisionDisallowSplitK);
      set_reduction(false, O::DisallowReducedPrecisionDisallowSplitK);
    } else if (!t_blas.empty()) {
      BlasState was = t_blas.back();
      t_blas.pop_back();
      c.setBlasPreferredBackend(was.backend);
      set_reduction(true, was.fp16);
      set_reduction(false, was.bf16);
    }
  })
}

#else  // no CUDA headers at build time

int kvc_graph_compiled() { return 0; }

void* kvc_graph_new(int, char* err, size_t errlen) {
  set_err(err, errlen, "this kvcredit binary was built without the CUDA-graph shim");
  return nullptr;
}
int kvc_graph_enter(void*, char* err, size_t errlen) { set_err(err, errlen, "no CUDA graphs"); return 1; }
int kvc_graph_begin(void*, char* err, size_t errlen) { set_err(err, errlen, "no CUDA graphs"); return 1; }
int kvc_graph_end(void*, char* err, size_t errlen) { set_err(err, errlen, "no CUDA graphs"); return 1; }
int kvc_graph_leave(void*, char* err, size_t errlen) { set_err(err, errlen, "no CUDA graphs"); return 1; }
int kvc_graph_replay(void*, char* err, size_t errlen) { set_err(err, errlen, "no CUDA graphs"); return 1; }
long kvc_graph_nodes(void*) { return -1; }
void kvc_graph_free(void*) {}
void* kvc_nvrtc_module(int, const char*, const char* const*, int, char* err, size_t errlen) {
  set_err(err, errlen, "this kvcredit binary was built without CUDA headers (no NVRTC)");
  return nullptr;
}
void* kvc_nvrtc_function(void*, const char*, char* err, size_t errlen) {
  set_err(err, errlen, "no NVRTC");
  return nullptr;
}
int kvc_nvrtc_launch(void*, int, unsigned, unsigned, void**, char* err, size_t errlen) {
  set_err(err, errlen, "no NVRTC");
  return 1;
}
int kvc_blas_invariant(int, char* err, size_t errlen) {
  set_err(err, errlen, "this kvcredit binary was built without CUDA headers");
  return 1;
}

#endif

}  // extern "C"
