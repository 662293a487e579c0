// Result of a launch or a host-side check, returned to the binding, which raises it as a Python exception.
// Host-only (no device code returns a Status).
#pragma once

#include <string>
#include <utility>

namespace flashgen {

enum class StatusCode : int { kOk = 0, kInvalidArgument = 1, kNotImplemented = 2, kRuntimeError = 3 };

struct Status {
  StatusCode code = StatusCode::kOk;
  std::string message;

  static Status ok() { return {}; }
  static Status invalid(std::string msg) { return {StatusCode::kInvalidArgument, std::move(msg)}; }
  static Status not_implemented(std::string msg) { return {StatusCode::kNotImplemented, std::move(msg)}; }
  static Status runtime(std::string msg) { return {StatusCode::kRuntimeError, std::move(msg)}; }
  bool is_ok() const { return code == StatusCode::kOk; }
};

}  // namespace flashgen
