// kvcredit's C++ shim over libtorch APIs that tch does not wrap:
//
// * CUDA graphs (`at::cuda::CUDAGraph`): capture a decode step on a side stream, replay it.
//   Compiled only with -DKVCREDIT_WITH_CUDA (build.rs defines it when libtorch's CUDA headers
//   and the CUDA runtime headers are found); otherwise the entry points report "not compiled".
// * An ATen op counter (RecordFunction callbacks): how many top-level, non-view ops a piece
//   of Rust code dispatches — the launches of an eager step. CPU and CUDA.
//
// Every entry point catches C++ exceptions and reports them through `err` (a buffer of
// `errlen` bytes) with a non-zero return, so nothing unwinds into Rust.
//
// No CUDA runtime function is called directly (that would make the binary need libcudart on
// its own): only c10/ATen exports, and `cudaGraphGetNodes` looked up with dlsym from the
// libcudart that libtorch_cuda has already loaded.
#include <ATen/record_function.h>

#include <atomic>
#include <cstring>
#include <exception>
#include <string>

#ifdef KVCREDIT_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <dlfcn.h>

#include <optional>
#endif

namespace {

void set_err(char* err, size_t errlen, const char* msg) {
  if (err != nullptr && errlen > 0) {
    std::strncpy(err, msg, errlen - 1);
    err[errlen - 1] = '\0';
  }
}

#define KVC_TRY(body)                                   \
  try {                                                 \
    body;                                               \
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

int kvc_graph_begin(void* g, char* err, size_t errlen) {
  KVC_TRY({ static_cast<KvcGraph*>(g)->graph.capture_begin(); })
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

#endif

}  // extern "C"
