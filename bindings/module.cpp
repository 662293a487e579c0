// flashgen._C: the only native entry point. It takes raw pointers, element strides and the CUDA stream as plain
// integers (no torch link), releases the GIL around every launch, and turns a failed Status into a Python exception.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#if defined(FLASHGEN_HAS_CUDA) && __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>  // header-only NVTX3 from the CUDA toolkit; no-ops unless a profiler is attached
#define FLASHGEN_NVTX 1
#endif

#include "build_info_gen.h"
#include "common/generation.h"
#include "common/kv_append.h"
#include "common/params.h"
#include "common/status.h"
#include "common/workspace.h"
#include "cpu/cpu_api.h"
#include "generations_gen.h"  // FLASHGEN_GPU_GENERATIONS(X) and the headers of their ops tables
#if defined(FLASHGEN_HAS_CUDA)
#include "bindings/kv_append_cuda.h"
#include "bindings/varlen_tail_cuda.h"
#endif

namespace py = pybind11;
using flashgen::AttnBwdParams;
using flashgen::AttnParams;
using flashgen::GenerationOps;
using flashgen::KvAppendParams;
using flashgen::Status;
using flashgen::StatusCode;
using flashgen::WorkspaceId;
using flashgen::WorkspaceSpec;

namespace {

// Registered below as Python's NotImplementedError.
struct NotImplemented : std::logic_error {
  using std::logic_error::logic_error;
};

void raise_if_failed(const Status& s) {
  switch (s.code) {
    case StatusCode::kOk: return;
    case StatusCode::kInvalidArgument: throw py::value_error(s.message);
    case StatusCode::kNotImplemented: throw NotImplemented(s.message);
    default: throw std::runtime_error(s.message);
  }
}

// A profiler timeline names each launch: "flashgen/v2/fwd bf16 d128 causal".
class NvtxRange {
 public:
  NvtxRange(const std::string& generation, const char* kind, const AttnParams& p) {
#if defined(FLASHGEN_NVTX)
    std::string name = "flashgen/" + generation + "/" + kind + " " + flashgen::dtype_name(p.dtype) + " d" +
                       std::to_string(p.head_dim);
    if (p.window_left < 0 && p.window_right == 0) {
      name += " causal";
    } else if (flashgen::has_window(p)) {
      name += " window";
    }
    if (p.cu_seqlens_q) name += " varlen";
    if (p.block_table) name += " paged";
    nvtxRangePushA(name.c_str());
#else
    (void)generation, (void)kind, (void)p;
#endif
  }
  ~NvtxRange() {
#if defined(FLASHGEN_NVTX)
    nvtxRangePop();
#endif
  }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

// Every generation compiled into this build, by name: the CPU backend and the generated registry's GPU generations.
const GenerationOps* find_ops(const std::string& generation) {
#define FG_OPS_ENTRY(ns) &flashgen::ns::ops(),
  static const GenerationOps* const kAll[] = {&flashgen::cpu::ops(), FLASHGEN_GPU_GENERATIONS(FG_OPS_ENTRY)};
#undef FG_OPS_ENTRY
  for (const GenerationOps* ops : kAll) {
    if (generation == ops->name) return ops;
  }
  return nullptr;
}

const GenerationOps& ops_or_throw(const std::string& generation) {
  const GenerationOps* ops = find_ops(generation);
  if (ops == nullptr) throw NotImplemented("generation '" + generation + "' was not compiled into this build");
  return *ops;
}

// V's own head dim (AttnParams::head_dim_v) reaches only a forward / backward whose ops table takes it (the API
// pads for the others: V, and for a backward out and dout too); before any launch, so a caller that skipped the API
// gets an error, not a read of V at the wrong width.
template <typename Params>
void check_value_dim(const GenerationOps& ops, const Params& p, bool (*takes)(const Params&), const char* direction) {
  if (p.head_dim_v < 0) throw py::value_error("head_dim_v: expected 0 (V has head_dim) or V's head dim, got " +
                                              std::to_string(p.head_dim_v));
  if (flashgen::value_dim(p) == p.head_dim) return;
  if (takes == nullptr || !takes(p)) {
    throw NotImplemented(std::string("head_dim_v: the ") + direction + " of '" + ops.name + "' takes head_dim " +
                         std::to_string(p.head_dim) + " for q and k only with V of the same width, got head_dim_v " +
                         std::to_string(p.head_dim_v) + " (the API pads V)");
  }
}

// Packed query rows (AttnParams::q_pack) reach only a forward whose ops table runs them: another one would read the
// rows as positions and mask them wrongly; read in place (q_pack_head_stride) only one that reads q that way.
void check_q_pack(const GenerationOps& ops, const AttnParams& p) {
  if (p.q_pack < 0) throw py::value_error("q_pack: expected 0 (off) or the query heads per KV head, got " +
                                          std::to_string(p.q_pack));
  if (p.q_pack > 1 && !ops.packs_rows) {
    throw NotImplemented(std::string("q_pack: the forward of '") + ops.name + "' does not run packed query rows");
  }
  if (p.q_pack_head_stride < 0) {
    throw py::value_error("q_pack_head_stride: expected 0 (q is _pack_rows' copy) or q's positive head stride, got " +
                          std::to_string(p.q_pack_head_stride));
  }
  if (p.q_pack_head_stride != 0 && p.q_pack <= 1) {
    throw py::value_error("q_pack_head_stride: set only with packed query rows (q_pack > 1), got q_pack " +
                          std::to_string(p.q_pack));
  }
  if (p.q_pack_head_stride != 0 && !ops.packs_rows_in_place) {
    throw NotImplemented(std::string("q_pack_head_stride: the forward of '") + ops.name +
                         "' reads packed query rows from _pack_rows' copy only");
  }
}

// A workspace spec as Python sees it: ((name, floats, zeroed), ...) for the workspaces asked for.
py::tuple workspaces_to_py(const WorkspaceSpec& spec) {
  py::list out;
  for (int i = 0; i < flashgen::kNumWorkspaces; ++i) {
    if (spec.floats[i] > 0) {
      out.append(py::make_tuple(flashgen::workspace_name(static_cast<WorkspaceId>(i)), spec.floats[i], spec.zeroed[i]));
    }
  }
  return py::tuple(out);
}

int workspace_index(const std::string& name) {
  for (int i = 0; i < flashgen::kNumWorkspaces; ++i) {
    if (name == flashgen::workspace_name(static_cast<WorkspaceId>(i))) return i;
  }
  throw py::value_error("workspace: no workspace named '" + name + "'");
}

// "80,90a" -> ["80", "90a"]; "" -> [].
py::list split_csv(const std::string& csv) {
  py::list out;
  size_t start = 0;
  while (start < csv.size()) {
    size_t end = csv.find(',', start);
    if (end == std::string::npos) end = csv.size();
    if (end > start) out.append(csv.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

py::dict build_info() {
  py::dict info;
  py::list instances;
  for (const FlashgenInstance* it = kFlashgenInstances; it->generation; ++it) {
    instances.append(py::make_tuple(it->generation, it->kind, it->dtype, it->head_dim));
  }
  // The CPU backend is not templated: any head dim up to kMaxHeadDim, fp32/fp16/bf16, forward and backward; both
  // take V at its own head dim, any up to kMaxHeadDim (kinds "fwd_v<bucket of V>" and "bwd_v<bucket of V>", as a GPU
  // generation's instances with V's own head-dim bucket are listed; python/flashgen/_native.py value_bucket).
  const std::string max_dim = std::to_string(flashgen::kMaxHeadDim);
  for (const char* dtype : {"fp32", "fp16", "bf16"}) {
    for (const std::string& kind : {std::string("fwd"), std::string("bwd"), "fwd_v" + max_dim, "bwd_v" + max_dim}) {
      instances.append(py::make_tuple("cpu", kind, dtype, flashgen::kMaxHeadDim));
    }
  }
  info["instances"] = instances;
  info["cuda_archs"] = split_csv(kFlashgenCudaArchs);
  // Per GPU generation, the archs its library was compiled for (cmake/flashgen.cmake flashgen_add_generation).
  py::dict generation_archs;
  for (const FlashgenGenerationArchs* it = kFlashgenGenerationArchs; it->generation; ++it) {
    generation_archs[it->generation] = split_csv(it->archs);
  }
  info["generation_archs"] = generation_archs;
  info["cuda_version"] = std::string(kFlashgenCudaVersion);
  info["max_head_dim"] = flashgen::kMaxHeadDim;
  return info;
}

// Element strides (batch, row, head) of a (batch, rows, heads, dim) tensor, or of a varlen (rows, heads, dim) one
// (no batch dimension: 0), from its stride tuple as torch gives it.
void set_strides(const py::tuple& stride, bool varlen, const char* name, int64_t* batch, int64_t* row,
                 int64_t* head) {
  const size_t rank = varlen ? 3 : 4;
  if (stride.size() != rank) {
    throw py::value_error(std::string(name) + ": expected " + std::to_string(rank) + " strides, got " +
                          std::to_string(stride.size()));
  }
  const size_t first = varlen ? 0 : 1;  // the row dimension
  *batch = varlen ? 0 : stride[0].cast<int64_t>();
  *row = stride[first].cast<int64_t>();
  *head = stride[first + 1].cast<int64_t>();
}

template <typename T>
T* pointer(std::uintptr_t v) {
  return reinterpret_cast<T*>(v);
}

// What every call sets: q, k, v, out and lse (pointers and stride tuples), the extents, dtypes, score and mask
// fields. One native call for the ~35 attribute sets a Python fill made (~0.1 us each, bench/NOTES.md session 38);
// the optional inputs (varlen offsets, KV cache, ALiBi, dropout, probabilities, block mask, FP8 descales) stay
// attributes, set only where a call has them.
void set_core(AttnParams& p, std::uintptr_t q, std::uintptr_t k, std::uintptr_t v, std::uintptr_t o,
              std::uintptr_t lse, const py::tuple& q_stride, const py::tuple& k_stride, const py::tuple& v_stride,
              const py::tuple& o_stride, const py::tuple& lse_stride, bool varlen_q, bool varlen_k, int batch,
              int seqlen_q, int seqlen_k, int num_heads, int num_heads_k, int head_dim, int dtype, int out_dtype,
              int64_t total_q, int64_t total_k, int batch_k, double softmax_scale, double softcap, int window_left,
              int window_right, int max_splits) {
  p.q = pointer<const void>(q);
  p.k = pointer<const void>(k);
  p.v = pointer<const void>(v);
  p.o = pointer<void>(o);
  p.lse = pointer<float>(lse);
  set_strides(q_stride, varlen_q, "q", &p.q_batch_stride, &p.q_row_stride, &p.q_head_stride);
  set_strides(k_stride, varlen_k, "k", &p.k_batch_stride, &p.k_row_stride, &p.k_head_stride);
  set_strides(v_stride, varlen_k, "v", &p.v_batch_stride, &p.v_row_stride, &p.v_head_stride);
  set_strides(o_stride, varlen_q, "out", &p.o_batch_stride, &p.o_row_stride, &p.o_head_stride);
  // lse: (batch, heads, rows), or varlen (heads, rows)
  if (lse_stride.size() != (varlen_q ? 2u : 3u)) {
    throw py::value_error("lse: expected " + std::to_string(varlen_q ? 2 : 3) + " strides, got " +
                          std::to_string(lse_stride.size()));
  }
  p.lse_batch_stride = varlen_q ? 0 : lse_stride[0].cast<int64_t>();
  p.lse_head_stride = lse_stride[varlen_q ? 0 : 1].cast<int64_t>();
  p.batch = batch;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.num_heads = num_heads;
  p.num_heads_k = num_heads_k;
  p.head_dim = head_dim;
  p.dtype = static_cast<flashgen::DType>(dtype);
  p.out_dtype = static_cast<flashgen::DType>(out_dtype);
  p.total_q = total_q;
  p.total_k = total_k;
  p.batch_k = batch_k;
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.scale_log2 = flashgen::scale_log2_for(softmax_scale, softcap);
  p.softcap = static_cast<float>(softcap);
  p.window_left = window_left;
  p.window_right = window_right;
  p.max_splits = max_splits;
}

// The backward's own tensors: dout, dq, dk, dv (pointers and stride tuples), dlse (0: none), deterministic.
void set_grads(AttnBwdParams& p, std::uintptr_t dout, std::uintptr_t dq, std::uintptr_t dk, std::uintptr_t dv,
               const py::tuple& do_stride, const py::tuple& dq_stride, const py::tuple& dk_stride,
               const py::tuple& dv_stride, bool varlen_q, bool varlen_k, std::uintptr_t dlse, bool deterministic) {
  p.dout = pointer<const void>(dout);
  p.dq = pointer<void>(dq);
  p.dk = pointer<void>(dk);
  p.dv = pointer<void>(dv);
  set_strides(do_stride, varlen_q, "dout", &p.do_batch_stride, &p.do_row_stride, &p.do_head_stride);
  set_strides(dq_stride, varlen_q, "dq", &p.dq_batch_stride, &p.dq_row_stride, &p.dq_head_stride);
  set_strides(dk_stride, varlen_k, "dk", &p.dk_batch_stride, &p.dk_row_stride, &p.dk_head_stride);
  set_strides(dv_stride, varlen_k, "dv", &p.dv_batch_stride, &p.dv_row_stride, &p.dv_head_stride);
  p.dlse = pointer<const float>(dlse);
  p.deterministic = deterministic;
}

}  // namespace

// Pointer fields travel as integers; the macro keeps the table in one place.
#define FG_PTR(cls, name, type)                                                                           \
  .def_property(                                                                                           \
      #name, [](const cls& s) { return reinterpret_cast<std::uintptr_t>(s.name); },                        \
      [](cls& s, std::uintptr_t v) { s.name = reinterpret_cast<type>(v); })
#define FG_RW(cls, name) .def_readwrite(#name, &cls::name)

PYBIND11_MODULE(_C, m) {
  m.doc() = "flashgen native module: attention kernels behind raw pointers (no torch link)";
  py::register_exception<NotImplemented>(m, "NotImplementedErrorNative", PyExc_NotImplementedError);

  py::enum_<flashgen::DType>(m, "DType")
      .value("float32", flashgen::DType::kFloat32)
      .value("float16", flashgen::DType::kFloat16)
      .value("bfloat16", flashgen::DType::kBFloat16)
      .value("float8_e4m3fn", flashgen::DType::kFloat8E4M3);

  py::class_<AttnParams>(m, "AttnParams")
      .def(py::init<>())
      FG_PTR(AttnParams, q, const void*) FG_PTR(AttnParams, k, const void*) FG_PTR(AttnParams, v, const void*)
      FG_PTR(AttnParams, o, void*) FG_PTR(AttnParams, lse, float*)
      FG_RW(AttnParams, q_batch_stride) FG_RW(AttnParams, q_row_stride) FG_RW(AttnParams, q_head_stride)
      FG_RW(AttnParams, k_batch_stride) FG_RW(AttnParams, k_row_stride) FG_RW(AttnParams, k_head_stride)
      FG_RW(AttnParams, v_batch_stride) FG_RW(AttnParams, v_row_stride) FG_RW(AttnParams, v_head_stride)
      FG_RW(AttnParams, o_batch_stride) FG_RW(AttnParams, o_row_stride) FG_RW(AttnParams, o_head_stride)
      FG_RW(AttnParams, lse_batch_stride) FG_RW(AttnParams, lse_head_stride)
      FG_RW(AttnParams, batch) FG_RW(AttnParams, seqlen_q) FG_RW(AttnParams, seqlen_k)
      FG_RW(AttnParams, num_heads) FG_RW(AttnParams, num_heads_k) FG_RW(AttnParams, head_dim)
      FG_RW(AttnParams, head_dim_v) FG_RW(AttnParams, q_pack) FG_RW(AttnParams, q_pack_head_stride)
      FG_RW(AttnParams, dtype) FG_RW(AttnParams, out_dtype)
      FG_RW(AttnParams, total_q) FG_RW(AttnParams, total_k) FG_RW(AttnParams, batch_k)
      FG_PTR(AttnParams, q_descale, const float*) FG_PTR(AttnParams, k_descale, const float*)
      FG_PTR(AttnParams, v_descale, const float*)
      FG_RW(AttnParams, q_descale_batch_stride) FG_RW(AttnParams, q_descale_head_stride)
      FG_RW(AttnParams, k_descale_batch_stride) FG_RW(AttnParams, k_descale_head_stride)
      FG_RW(AttnParams, v_descale_batch_stride) FG_RW(AttnParams, v_descale_head_stride)
      FG_RW(AttnParams, q_descale_block_stride) FG_RW(AttnParams, k_descale_block_stride)
      FG_RW(AttnParams, v_descale_block_stride) FG_RW(AttnParams, descale_block_tokens)
      FG_RW(AttnParams, softmax_scale) FG_RW(AttnParams, scale_log2) FG_RW(AttnParams, softcap)
      FG_RW(AttnParams, window_left) FG_RW(AttnParams, window_right)
      FG_PTR(AttnParams, cu_seqlens_q, const int*) FG_PTR(AttnParams, cu_seqlens_k, const int*)
      FG_PTR(AttnParams, seqused_k, const int*) FG_PTR(AttnParams, kv_batch_idx, const int*)
      FG_PTR(AttnParams, cache_leftpad, const int*) FG_PTR(AttnParams, block_table, const int*)
      FG_RW(AttnParams, block_table_batch_stride) FG_RW(AttnParams, page_block_size)
      FG_PTR(AttnParams, alibi_slopes, const float*) FG_RW(AttnParams, alibi_batch_stride)
      FG_RW(AttnParams, p_dropout) FG_RW(AttnParams, seed) FG_RW(AttnParams, offset)
      FG_PTR(AttnParams, p_out, void*)
      FG_RW(AttnParams, p_batch_stride) FG_RW(AttnParams, p_head_stride) FG_RW(AttnParams, p_row_stride)
      FG_PTR(AttnParams, block_mask, const uint8_t*)
      FG_RW(AttnParams, block_mask_head_stride) FG_RW(AttnParams, block_mask_row_stride)
      FG_RW(AttnParams, sparse_block_m) FG_RW(AttnParams, sparse_block_n)
      FG_PTR(AttnParams, sparse_order, const int*)
      FG_RW(AttnParams, num_threads) FG_RW(AttnParams, num_sms)
      FG_RW(AttnParams, num_splits) FG_RW(AttnParams, max_splits)
      .def("set_core", &set_core,
           "Set q, k, v, out, lse (pointers, stride tuples), extents, dtypes (DType values as ints), score and mask "
           "fields in one call; positional, in the order of _ops._fill.")
      .def(
          "set_workspace",
          [](AttnParams& s, const std::string& name, std::uintptr_t ptr, int64_t floats) {
            const int i = workspace_index(name);
            s.ws.ptr[i] = reinterpret_cast<float*>(ptr);
            s.ws.floats[i] = floats;
          },
          py::arg("name"), py::arg("ptr"), py::arg("floats"), "Point workspace `name` at ptr (fp32, `floats` long).")
      .def(
          "workspace",
          [](const AttnParams& s, const std::string& name) {
            const int i = workspace_index(name);
            return py::make_tuple(reinterpret_cast<std::uintptr_t>(s.ws.ptr[i]), s.ws.floats[i]);
          },
          py::arg("name"), "(pointer, floats) of workspace `name`.");

  py::class_<AttnBwdParams, AttnParams>(m, "AttnBwdParams")
      .def(py::init<>())
      FG_PTR(AttnBwdParams, dout, const void*) FG_PTR(AttnBwdParams, dq, void*)
      FG_PTR(AttnBwdParams, dk, void*) FG_PTR(AttnBwdParams, dv, void*)
      FG_RW(AttnBwdParams, do_batch_stride) FG_RW(AttnBwdParams, do_row_stride) FG_RW(AttnBwdParams, do_head_stride)
      FG_RW(AttnBwdParams, dq_batch_stride) FG_RW(AttnBwdParams, dq_row_stride) FG_RW(AttnBwdParams, dq_head_stride)
      FG_RW(AttnBwdParams, dk_batch_stride) FG_RW(AttnBwdParams, dk_row_stride) FG_RW(AttnBwdParams, dk_head_stride)
      FG_RW(AttnBwdParams, dv_batch_stride) FG_RW(AttnBwdParams, dv_row_stride) FG_RW(AttnBwdParams, dv_head_stride)
      FG_PTR(AttnBwdParams, dlse, const float*) FG_RW(AttnBwdParams, deterministic)
      .def("set_grads", &set_grads, "Set dout, dq, dk, dv (pointers, stride tuples), dlse (0: none), deterministic.");

  py::class_<KvAppendParams>(m, "KvAppendParams")
      .def(py::init<>())
      FG_PTR(KvAppendParams, k_cache, void*) FG_PTR(KvAppendParams, v_cache, void*)
      FG_PTR(KvAppendParams, k_new, const void*) FG_PTR(KvAppendParams, v_new, const void*)
      FG_RW(KvAppendParams, kc_batch_stride) FG_RW(KvAppendParams, kc_row_stride) FG_RW(KvAppendParams, kc_head_stride)
      FG_RW(KvAppendParams, vc_batch_stride) FG_RW(KvAppendParams, vc_row_stride) FG_RW(KvAppendParams, vc_head_stride)
      FG_RW(KvAppendParams, kn_batch_stride) FG_RW(KvAppendParams, kn_row_stride) FG_RW(KvAppendParams, kn_head_stride)
      FG_RW(KvAppendParams, vn_batch_stride) FG_RW(KvAppendParams, vn_row_stride) FG_RW(KvAppendParams, vn_head_stride)
      FG_PTR(KvAppendParams, cache_seqlens, const int*) FG_PTR(KvAppendParams, cache_batch_idx, const int*)
      FG_PTR(KvAppendParams, block_table, const int*) FG_RW(KvAppendParams, block_table_batch_stride)
      FG_RW(KvAppendParams, page_block_size) FG_RW(KvAppendParams, entries) FG_RW(KvAppendParams, capacity)
      FG_RW(KvAppendParams, batch) FG_RW(KvAppendParams, seqlen_new) FG_RW(KvAppendParams, num_heads_k)
      FG_RW(KvAppendParams, head_dim) FG_RW(KvAppendParams, elem_bytes)
      FG_PTR(KvAppendParams, seqlens_after, int*);

  m.def(
      "append_kv_cpu",
      [](const KvAppendParams& a) {
        Status s;
        {
          py::gil_scoped_release release;
          s = flashgen::cpu::append_kv(a);
        }
        raise_if_failed(s);
      },
      py::arg("params"),
      "flash_attn_with_kvcache's append on host memory: the new keys and values into the caches' rows "
      "(common/kv_append.h).");
#if defined(FLASHGEN_HAS_CUDA)
  m.def(
      "append_kv_cuda",
      [](const KvAppendParams& a, std::uintptr_t stream) {
        Status s;
        {
          py::gil_scoped_release release;
          s = flashgen::append_kv_cuda(a, reinterpret_cast<void*>(stream));
        }
        raise_if_failed(s);
      },
      py::arg("params"), py::arg("stream"),
      "flash_attn_with_kvcache's append on device memory, one launch on the given CUDA stream "
      "(bindings/kv_append_cuda.cu).");
#endif
  m.def(
      "fwd",
      [](const std::string& generation, const AttnParams& p, std::uintptr_t stream) {
        const GenerationOps& ops = ops_or_throw(generation);
        check_value_dim(ops, p, ops.value_head_dim, "forward");
        check_q_pack(ops, p);
        Status s;
        {
          py::gil_scoped_release release;
          NvtxRange range(generation, "fwd", p);
          s = ops.fwd(p, reinterpret_cast<void*>(stream));
#if defined(FLASHGEN_HAS_CUDA)
          // Varlen rows past the last sequence: 0 / +inf, as the CPU path gives them (bindings/varlen_tail_cuda.h).
          if (s.is_ok() && &ops != &flashgen::cpu::ops()) {
            s = flashgen::fill_varlen_tails_fwd(p, reinterpret_cast<void*>(stream));
          }
#endif
        }
        raise_if_failed(s);
      },
      py::arg("generation"), py::arg("params"), py::arg("stream") = 0,
      "Run a generation's forward on the pointers in params, on the given CUDA stream (0 for the CPU backend).");
  m.def(
      "bwd",
      [](const std::string& generation, const AttnBwdParams& p, std::uintptr_t stream) {
        const GenerationOps& ops = ops_or_throw(generation);
        if (ops.bwd == nullptr) throw NotImplemented("generation '" + generation + "' has no backward");
        check_value_dim(ops, p, ops.value_head_dim_bwd, "backward");
        if (p.q_pack > 1 || p.q_pack < 0) {  // packed rows are a forward's (_ops.forward packs; the backward never)
          throw NotImplemented("q_pack: no backward runs packed query rows, got " + std::to_string(p.q_pack));
        }
        Status s;
        {
          py::gil_scoped_release release;
          NvtxRange range(generation, "bwd", p);
          s = ops.bwd(p, reinterpret_cast<void*>(stream));
#if defined(FLASHGEN_HAS_CUDA)
          if (s.is_ok() && &ops != &flashgen::cpu::ops()) {
            s = flashgen::fill_varlen_tails_bwd(p, reinterpret_cast<void*>(stream));
          }
#endif
        }
        raise_if_failed(s);
      },
      py::arg("generation"), py::arg("params"), py::arg("stream") = 0, "Run a generation's backward.");
  m.def(
      "fwd_plan",
      [](const std::string& generation, const AttnParams& p) {
        const GenerationOps& ops = ops_or_throw(generation);
        check_q_pack(ops, p);
        const flashgen::FwdPlan plan = ops.plan_fwd ? ops.plan_fwd(p) : flashgen::FwdPlan{};
        return py::make_tuple(plan.num_splits, workspaces_to_py(plan.workspaces));
      },
      py::arg("generation"), py::arg("params"),
      "The generation's forward plan for params: (num_splits, ((workspace, floats, zeroed), ...)); num_splits 0 "
      "when it has no split-KV path for them.");
  m.def(
      "bwd_workspaces",
      [](const std::string& generation, const AttnBwdParams& p) {
        const GenerationOps& ops = ops_or_throw(generation);
        return workspaces_to_py(ops.bwd_workspaces ? ops.bwd_workspaces(p) : WorkspaceSpec{});
      },
      py::arg("generation"), py::arg("params"),
      "The workspaces the generation's backward needs for params: ((workspace, floats, zeroed), ...).");
  m.def("build_info", &build_info, "What this build compiled: instances (generation, kind, dtype, head dim), archs, CUDA.");
}
