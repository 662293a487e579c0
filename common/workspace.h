// Workspaces: the fp32 scratch buffers a generation needs beside the tensors of a call. One protocol for all:
// the generation states, per call, how many floats of each named workspace it needs and whether they must be
// zeroed (WorkspaceSpec, from its ops table: common/generation.h); the caller allocates them and sets pointer and
// size (Workspaces, inside AttnParams); the generation checks the sizes before any launch. Layouts are the
// generation's own business and live in its folder only.
#pragma once

#include <cstdint>
#include <string>

#include "common/config.h"

namespace flashgen {

enum class WorkspaceId : int {
  kOAccum = 0,  // split-KV partial outputs, each normalized by its own sum (forward, decoding)
  kLseAccum,    // split-KV partial row states (m, l) (forward, decoding)
  kRowStats,    // running row statistics kept in device memory between key blocks (v1: m and l)
  kDSum,        // D = rowsum(dO * O) per row (backward)
  kDqAccum,     // fp32 dQ accumulator (backward)
  kGradParts,   // fp32 dK / dV of the pieces a key block's work is cut into (v3 backward's tail split)
};
constexpr int kNumWorkspaces = 6;

FH_HD const char* workspace_name(WorkspaceId id) {
  switch (id) {
    case WorkspaceId::kOAccum: return "oaccum";
    case WorkspaceId::kLseAccum: return "lse_accum";
    case WorkspaceId::kRowStats: return "row_stats";
    case WorkspaceId::kDSum: return "dsoftmax_sum";
    case WorkspaceId::kDqAccum: return "dq_accum";
    case WorkspaceId::kGradParts: return "grad_parts";
  }
  return "unknown";
}

// What a generation asks for: floats of each workspace (0 = not needed) and whether it must arrive zeroed.
struct WorkspaceSpec {
  int64_t floats[kNumWorkspaces] = {};
  bool zeroed[kNumWorkspaces] = {};

  void need(WorkspaceId id, int64_t n, bool zero) {
    floats[static_cast<int>(id)] = n;
    zeroed[static_cast<int>(id)] = zero;
  }
};

// What the caller gave: one pointer and its size in floats per workspace (null / 0 = none).
struct Workspaces {
  float* ptr[kNumWorkspaces] = {};
  int64_t floats[kNumWorkspaces] = {};

  FH_HD float* get(WorkspaceId id) const { return ptr[static_cast<int>(id)]; }
  FH_HD int64_t size(WorkspaceId id) const { return floats[static_cast<int>(id)]; }
};

// The generation's check, host side: every workspace spec asks for is present, 16-byte aligned and large
// enough. Returns "" when it is, else a message naming the workspace, the size needed and the size given.
inline std::string check_workspaces(const WorkspaceSpec& need, const Workspaces& have, const char* generation) {
  constexpr uintptr_t kAlignBytes = 16;
  for (int i = 0; i < kNumWorkspaces; ++i) {
    if (need.floats[i] == 0) continue;
    const std::string name = workspace_name(static_cast<WorkspaceId>(i));
    if (have.ptr[i] == nullptr || have.floats[i] < need.floats[i]) {
      return name + ": " + generation + " needs " + std::to_string(need.floats[i]) + " floats for this problem, got " +
             std::to_string(have.ptr[i] ? have.floats[i] : 0);
    }
    if (reinterpret_cast<uintptr_t>(have.ptr[i]) % kAlignBytes != 0) {
      return name + ": " + generation + " needs a 16-byte aligned workspace";
    }
  }
  return "";
}

}  // namespace flashgen
