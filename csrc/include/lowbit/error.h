// Status values kernels return instead of throwing or aborting; the FFI layer turns a non-empty
// message into an ffi::Error.
#pragma once

#include <string>

namespace lowbit {

struct Status {
  std::string message;  // empty: success
  bool ok() const { return message.empty(); }
  static Status Ok() { return {}; }
  static Status Invalid(std::string m) { return {std::move(m)}; }
};

}  // namespace lowbit
