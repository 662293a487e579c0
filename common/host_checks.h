// Host-side precondition checks the GPU generations share (their host entry points call them before any launch).
// Host-only: returns a Status whose message names the argument and the generation.
#pragma once

#include <cstdint>
#include <string>

#include "common/generation.h"
#include "common/status.h"
#include "common/workspace.h"

namespace flashgen {

constexpr uintptr_t kRowAlignBytes = 16;  // 16-byte vector loads, cp.async and TMA all need it
constexpr int kRowAlignElems16 = 8;       // the same in 2-byte elements

// A (batch, row, head) strided 2-byte tensor whose rows the kernels read in 16-byte pieces: the data pointer
// 16-byte aligned and every non-last stride a multiple of 8 elements. `generation` names who needs it ("v2").
inline Status check_rows_aligned(const char* generation, const char* name, const void* ptr, int64_t batch_stride,
                                 int64_t row_stride, int64_t head_stride) {
  if (reinterpret_cast<uintptr_t>(ptr) % kRowAlignBytes != 0) {
    return Status::invalid(std::string(name) + ": " + generation + " needs a 16-byte aligned data pointer");
  }
  if (batch_stride % kRowAlignElems16 != 0 || row_stride % kRowAlignElems16 != 0 ||
      head_stride % kRowAlignElems16 != 0) {
    return Status::invalid(std::string(name) + ": " + generation +
                           " needs batch/row/head strides that are multiples of 8 elements, got (" +
                           std::to_string(batch_stride) + ", " + std::to_string(row_stride) + ", " +
                           std::to_string(head_stride) + ")");
  }
  return Status::ok();
}

// A launch's p.num_splits against the forward plan the generation makes for p (`plan`, its plan_fwd): 0 runs no split
// path; a count must be the plan's (its workspace sizes hold for that count only), with the plan's workspaces given.
inline Status check_split_plan(int num_splits, const FwdPlan& plan, const Workspaces& given, const char* generation) {
  if (num_splits == 0) return Status::ok();
  if (plan.num_splits == 0) {
    return Status::invalid(std::string("num_splits: this problem does not run ") + generation +
                           "'s split-KV decode path; leave num_splits 0 unless the forward plan gave a count");
  }
  if (num_splits != plan.num_splits) {
    return Status::invalid("num_splits: expected the forward plan's " + std::to_string(plan.num_splits) + ", got " +
                           std::to_string(num_splits));
  }
  const std::string ws = check_workspaces(plan.workspaces, given, generation);
  return ws.empty() ? Status::ok() : Status::invalid(ws);
}

}  // namespace flashgen
