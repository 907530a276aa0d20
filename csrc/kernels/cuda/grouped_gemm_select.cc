// The router of the grouped GEMM's block-scaled ragged-M calls (fprop, dgrad with 1x128 x 128x128
// scales) between CUTLASS's ptr-array blockwise kernel (grouped_gemm.cu) and lowbit's own sm90
// kernel (grouped_gemm_sm90.cu): a measurement at the first call per key outside graph capture,
// a process-wide table of the winners, and LOWBIT_GROUPED_BLOCK_GEMM, read at every call:
//   auto (default)   measure CUTLASS and the sm90own variants, keep the fastest
//   cutlass          CUTLASS only
//   sm90own          lowbit's kernel only (an error where it cannot take the call)
//   sm90own:<name>   one variant, n128[_mc]/group<8|16> (benchmarks)
// The group sizes stay on the device: the table's key is the host-known shape, and a winner
// measured with the first call's sizes serves the later ones.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "candidate_timing.h"
#include "grouped_gemm_sm90.h"

namespace lowbit {
namespace gg {
namespace {

// backend 0: CUTLASS; 1: sm90own with `config`.
struct Choice {
  int backend = 0;
  Sm90GroupedConfig config;
};

std::string name(const Choice& c) {
  if (c.backend == 0) return "cutlass";
  return std::string("sm90own:n128") + (c.config.multicast ? "_mc" : "") + "/group" +
         std::to_string(c.config.group);
}

struct Mode {
  bool cutlass = true, own = true;
  std::string variant;  // sm90own:<variant>: only that one
  std::string text;
};

Status read_mode(Mode* m) {
  const char* e = std::getenv("LOWBIT_GROUPED_BLOCK_GEMM");
  m->text = e ? e : "auto";
  if (m->text.empty() || m->text == "auto") return Status::Ok();
  if (m->text == "cutlass") {
    m->own = false;
  } else if (m->text == "sm90own") {
    m->cutlass = false;
  } else if (m->text.rfind("sm90own:", 0) == 0) {
    m->cutlass = false;
    m->variant = m->text;
  } else {
    return Status::Invalid(
        "LOWBIT_GROUPED_BLOCK_GEMM must be auto, cutlass, sm90own or "
        "sm90own:n128[_mc]/group<8|16>, got '" +
        m->text + "'");
  }
  return Status::Ok();
}

// CUTLASS first: what a capture without a measured winner runs under auto.
std::vector<Choice> candidates(const GroupedGemmParams& p, const Mode& mode) {
  std::vector<Choice> c;
  if (mode.cutlass) c.push_back(Choice{});
  if (mode.own && sm90_grouped_eligible(p))
    for (int group : {8, 16})
      for (bool mc : {false, true}) {
        Choice o;
        o.backend = 1;
        o.config.multicast = mc;
        o.config.group = group;
        if (mode.variant.empty() || mode.variant == name(o)) c.push_back(o);
      }
  return c;
}

Status run(const GroupedGemmParams& p, const Choice& c, cudaStream_t s) {
  return c.backend == 0 ? cutlass_grouped(p, s) : sm90_grouped(p, c.config, s);
}

// Everything a winner depends on (the sizes excepted: device-only).
using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int, int64_t, int64_t, int64_t,
                       bool, std::string>;

struct Table {
  std::mutex mu;
  std::map<Key, Choice> winners;
};
Table& table() {
  static Table t;
  return t;
}

Status measure(const GroupedGemmParams& p, const std::vector<Choice>& cands, cudaStream_t s,
               Choice* out) {
  const int reps = candidate_reps(p.m, p.n, p.k);
  const bool log = std::getenv("LOWBIT_GROUPED_BLOCK_GEMM_LOG") != nullptr;
  double best = INFINITY;
  for (const Choice& c : cands) {
    const double t = time_candidate([&] { return run(p, c, s); }, s, reps);
    if (log)
      std::fprintf(stderr,
                   "lowbit grouped block GEMM M=%lld N=%lld K=%lld G=%lld %s: %.4f ms (%.0f "
                   "TFLOP/s)\n",
                   (long long)p.m, (long long)p.n, (long long)p.k, (long long)p.num_groups,
                   name(c).c_str(), t, 2.0 * double(p.m) * double(p.n) * double(p.k) / (t * 1e9));
    if (t < best) {
      best = t;
      *out = c;
    }
  }
  if (!std::isfinite(best)) return Status::Invalid("grouped_gemm: every block GEMM failed");
  if (log)
    std::fprintf(stderr, "lowbit grouped block GEMM M=%lld N=%lld K=%lld G=%lld -> %s\n",
                 (long long)p.m, (long long)p.n, (long long)p.k, (long long)p.num_groups,
                 name(*out).c_str());
  return Status::Ok();
}

}  // namespace

bool block_route_applies(const GroupedGemmParams& p) {
  return p.mode == GroupedGemmMode::kRaggedM && p.block_scaled && p.b_block_n == 128;
}

Status route_block(const GroupedGemmParams& p, cudaStream_t stream) {
  Mode mode;
  Status s = read_mode(&mode);
  if (!s.ok()) return s;
  const std::vector<Choice> cands = candidates(p, mode);
  if (cands.empty()) {
    if (sm90_grouped_eligible(p))
      return Status::Invalid("LOWBIT_GROUPED_BLOCK_GEMM=" + mode.text +
                             " names no sm90own variant (n128[_mc]/group<8|16>)");
    // sm90own asked for where it cannot run: its message says why (it launches nothing).
    s = sm90_grouped(p, Sm90GroupedConfig{}, stream);
    return Status::Invalid(s.message + " (LOWBIT_GROUPED_BLOCK_GEMM=" + mode.text + ")");
  }
  if (cands.size() == 1) return run(p, cands[0], stream);
  int dev = -1;
  if (cudaGetDevice(&dev) != cudaSuccess) cudaGetLastError();
  const Key key{dev,
                p.m,
                p.n,
                p.k,
                p.num_groups,
                int(p.a_dtype),
                p.lda,
                p.ldb,
                p.b_group_stride,
                sm90_grouped_eligible(p),
                mode.text};
  Table& t = table();
  {
    std::lock_guard<std::mutex> lock(t.mu);
    auto it = t.winners.find(key);
    if (it != t.winners.end()) return run(p, it->second, stream);
  }
  // Inside a CUDA-graph capture (XLA command buffers) nothing is timed: the first candidate runs.
  // In jitted programs the first executions ran outside any capture (the grouped goal probe's log
  // on the H200 shows the measurements and sm90own winners); a shape only ever called inside a
  // capture keeps the first candidate that runs.
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &cs) != cudaSuccess) {
    cudaGetLastError();
    cs = cudaStreamCaptureStatusActive;
  }
  if (cs != cudaStreamCaptureStatusNone) {  // the first candidate that runs (CUTLASS if built)
    for (const Choice& c : cands)
      if (s = run(p, c, stream); s.ok()) break;
    return s;
  }
  Choice win;
  if (s = measure(p, cands, stream, &win); !s.ok()) return s;
  {
    std::lock_guard<std::mutex> lock(t.mu);
    win = t.winners.emplace(key, win).first->second;  // another thread's result may be there
  }
  return run(p, win, stream);  // the measured runs left some candidate's output
}

}  // namespace gg
}  // namespace lowbit
