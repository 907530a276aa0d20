// lowbit's fused attention on cuDNN's frontend graph API (see lowbit/attention.h).
//
// Built with NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING: the library never links libcudnn; the first
// call dlopens it (the nvidia-cudnn wheel JAX installs, found by Python and passed in through
// lowbit_attention_load_cudnn, else the loader's path), so liblowbit_cuda still loads where
// cuDNN is absent and only attention reports the missing library.
//
// One cuDNN handle per (device, stream): a handle carries its stream, and one shared by several
// GPUs would run work on the wrong device (issue 24). Graphs are cached per device and per
// everything that shapes them (dims, dtypes, flags, scale, dropout rate); the first call of a
// shape builds the graph, so the handler is not command-buffer compatible (nor needs to be: it
// runs as its own thunk, which is what lets dropout run inside lax.scan).
#include "lowbit/attention.h"

#include <cstdio>

#if LOWBIT_HAVE_CUDNN_FRONTEND

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <cudnn_frontend.h>

namespace cudnn_frontend {
// The frontend's dynamic-loading mode reads libcudnn's symbols through this handle.
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace lowbit {
namespace {

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

// Tensor uids of the variant pack.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kBias,
  kSeqQ,
  kSeqKv,
  kOffQ,
  kOffK,
  kOffV,
  kOffO,
  kSeed,
  kOffset,
  kSink,
  kDO,
  kDQ,
  kDK,
  kDV,
  kDBias,
  kDSink,
  kScale0 = 100,  // + row of the FP8 scales
  kAmax0 = 200,   // + row of the amax results
};

std::mutex g_load_mu;
std::string g_load_error;

fe::DataType_t fe_dtype(DType t) {
  switch (t) {
    case DType::kF32: return fe::DataType_t::FLOAT;
    case DType::kBF16: return fe::DataType_t::BFLOAT16;
    case DType::kF16: return fe::DataType_t::HALF;
    case DType::kE4M3: return fe::DataType_t::FP8_E4M3;
    case DType::kE5M2: return fe::DataType_t::FP8_E5M2;
    default: return fe::DataType_t::NOT_SET;
  }
}

Status ensure_cudnn() {
  char err[512] = {0};
  if (attention_cudnn_load(nullptr, err, sizeof(err)) != 0) return Status::Invalid(err);
  return Status::Ok();
}

// One handle per (device, stream), created on first use and kept for the process.
Status handle_for(int device, cudaStream_t stream, cudnnHandle_t* out) {
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, cudnnHandle_t> handles;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_pair(device, stream);
  auto it = handles.find(key);
  if (it != handles.end()) {
    *out = it->second;
    return Status::Ok();
  }
  cudnnHandle_t h = nullptr;
  if (fe::detail::create_handle(&h) != CUDNN_STATUS_SUCCESS)
    return Status::Invalid("attention: cudnnCreate failed on device " + std::to_string(device));
  if (fe::detail::set_stream(h, stream) != CUDNN_STATUS_SUCCESS)
    return Status::Invalid("attention: cudnnSetStream failed");
  handles.emplace(key, h);
  *out = h;
  return Status::Ok();
}

// (b, heads, s, d) over a (b, s, heads, d) row-major buffer.
std::vector<int64_t> bshd(int64_t h, int64_t s, int64_t d) { return {s * h * d, d, h * d, 1}; }

TensorPtr tensor(fe::graph::Graph& g, const char* name, int64_t uid, std::vector<int64_t> dim,
                 std::vector<int64_t> stride, fe::DataType_t dt) {
  auto t = fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(std::move(dim));
  t.set_stride(std::move(stride));
  if (dt != fe::DataType_t::NOT_SET) t.set_data_type(dt);
  return g.tensor(t);
}

TensorPtr scalar(fe::graph::Graph& g, const char* name, int64_t uid, fe::DataType_t dt) {
  return tensor(g, name, uid, {1, 1, 1, 1}, {1, 1, 1, 1}, dt);
}

// The key of a graph: everything that changes it, and the device it was built for.
std::string graph_key(const AttentionParams& p, int device, bool backward) {
  char buf[512];
  uint32_t scale_bits, rate_bits;
  std::memcpy(&scale_bits, &p.scale, 4);
  std::memcpy(&rate_bits, &p.dropout_rate, 4);
  std::snprintf(buf, sizeof(buf),
                "%d|%d|%lld,%lld,%lld,%lld,%lld,%lld,%lld|%lld,%lld|%d,%d,%d,%d,%d|"
                "%d%d%d%d%d%d%d%d%d|%08x,%08x",
                device, backward ? 1 : 0, (long long)p.b, (long long)p.h, (long long)p.hk,
                (long long)p.sq, (long long)p.skv, (long long)p.d, (long long)p.dv,
                (long long)(p.bias ? p.bias_b : 0), (long long)(p.bias ? p.bias_h : 0),
                (int)p.dtype, (int)p.do_dtype, (int)p.o_dtype, (int)p.dqkv_dtype, (int)p.bias_dtype,
                p.causal, p.padding, p.ragged, p.dropout, p.sink, p.fp8, p.deterministic,
                p.grad_sink != nullptr, p.grad_bias != nullptr, scale_bits, rate_bits);
  return buf;
}

// Ragged offsets (b + 1 int32 element offsets) for a tensor of the packed (THD) layout.
void set_ragged(fe::graph::Graph& g, const AttentionParams& p, TensorPtr& t, const char* name,
                int64_t uid) {
  if (!p.ragged) return;
  t->set_ragged_offset(
      tensor(g, name, uid, {p.b + 1, 1, 1, 1}, {1, 1, 1, 1}, fe::DataType_t::INT32));
}

// Options shared by the forward, backward and FP8 backward attributes (same setter names).
template <typename Opts>
void common_options(fe::graph::Graph& g, const AttentionParams& p, Opts& o) {
  o.set_attn_scale(p.scale);
  if (p.causal) o.set_causal_mask(true);
  if (p.padding) {
    const auto i32 = fe::DataType_t::INT32;
    o.set_padding_mask(true)
        .set_seq_len_q(tensor(g, "seq_q", kSeqQ, {p.b, 1, 1, 1}, {1, 1, 1, 1}, i32))
        .set_seq_len_kv(tensor(g, "seq_kv", kSeqKv, {p.b, 1, 1, 1}, {1, 1, 1, 1}, i32));
  }
  if (p.dropout) {
    const auto i64 = fe::DataType_t::INT64;
    o.set_dropout(p.dropout_rate, scalar(g, "seed", kSeed, i64), scalar(g, "offset", kOffset, i64));
  }
  if (p.sink)
    o.set_sink_token(
        tensor(g, "sink", kSink, {1, p.h, 1, 1}, {p.h, 1, 1, 1}, fe::DataType_t::FLOAT));
}

TensorPtr bias_tensor(fe::graph::Graph& g, const AttentionParams& p, const char* name,
                      int64_t uid) {
  const int64_t n = p.sq * p.skv;
  return tensor(g, name, uid, {p.bias_b, p.bias_h, p.sq, p.skv}, {p.bias_h * n, n, p.skv, 1},
                fe_dtype(p.bias_dtype));
}

void amax_output(TensorPtr& t, int row) {
  t->set_output(true).set_uid(kAmax0 + row).set_dim({1, 1, 1, 1}).set_stride({1, 1, 1, 1});
  t->set_data_type(fe::DataType_t::FLOAT);
}

std::shared_ptr<fe::graph::Graph> new_graph(fe::DataType_t io) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(io)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

// q, k, v (and their ragged offsets) of either direction.
void qkv(fe::graph::Graph& g, const AttentionParams& p, TensorPtr* q, TensorPtr* k, TensorPtr* v) {
  const auto io = fe_dtype(p.dtype);
  *q = tensor(g, "q", kQ, {p.b, p.h, p.sq, p.d}, bshd(p.h, p.sq, p.d), io);
  *k = tensor(g, "k", kK, {p.b, p.hk, p.skv, p.d}, bshd(p.hk, p.skv, p.d), io);
  *v = tensor(g, "v", kV, {p.b, p.hk, p.skv, p.dv}, bshd(p.hk, p.skv, p.dv), io);
  set_ragged(g, p, *q, "off_q", kOffQ);
  set_ragged(g, p, *k, "off_k", kOffK);
  set_ragged(g, p, *v, "off_v", kOffV);
}

std::shared_ptr<fe::graph::Graph> build_fwd(const AttentionParams& p) {
  auto gp = new_graph(fe_dtype(p.dtype));
  auto& g = *gp;
  TensorPtr q, k, v, o, stats;
  qkv(g, p, &q, &k, &v);
  fe::graph::SDPA_attributes opts;
  opts.set_name("lowbit_sdpa_fwd").set_generate_stats(true);
  common_options(g, p, opts);
  if (p.bias) opts.set_bias(bias_tensor(g, p, "bias", kBias));
  if (p.fp8) {
    const auto f32 = fe::DataType_t::FLOAT;
    auto s = [&](int row, const char* name) { return scalar(g, name, kScale0 + row, f32); };
    auto r = g.sdpa_fp8(q, k, v, s(kFwdDescaleQ, "descale_q"), s(kFwdDescaleK, "descale_k"),
                        s(kFwdDescaleV, "descale_v"), s(kFwdDescaleS, "descale_s"),
                        s(kFwdScaleS, "scale_s"), s(kFwdScaleO, "scale_o"), opts);
    o = r[0];
    stats = r[1];
    amax_output(r[2], 0);
    amax_output(r[3], 1);
  } else {
    auto r = g.sdpa(q, k, v, opts);
    o = r[0];
    stats = r[1];
  }
  o->set_output(true).set_uid(kO).set_dim({p.b, p.h, p.sq, p.dv}).set_stride(bshd(p.h, p.sq, p.dv));
  o->set_data_type(fe_dtype(p.o_dtype));
  set_ragged(g, p, o, "off_o", kOffO);
  stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT);
  stats->set_dim({p.b, p.h, p.sq, 1}).set_stride({p.h * p.sq, p.sq, 1, 1});
  return gp;
}

std::shared_ptr<fe::graph::Graph> build_bwd(const AttentionParams& p) {
  auto gp = new_graph(fe_dtype(p.dtype));
  auto& g = *gp;
  TensorPtr q, k, v;
  qkv(g, p, &q, &k, &v);
  auto o = tensor(g, "o", kO, {p.b, p.h, p.sq, p.dv}, bshd(p.h, p.sq, p.dv), fe_dtype(p.o_dtype));
  auto dout =
      tensor(g, "dO", kDO, {p.b, p.h, p.sq, p.dv}, bshd(p.h, p.sq, p.dv), fe_dtype(p.do_dtype));
  set_ragged(g, p, o, "off_o", kOffO);
  if (p.ragged) dout->set_ragged_offset(o->get_ragged_offset());
  auto stats = tensor(g, "stats", kStats, {p.b, p.h, p.sq, 1}, {p.h * p.sq, p.sq, 1, 1},
                      fe::DataType_t::FLOAT);
  TensorPtr dq, dk, dv;
  auto dsink = [&](auto& opts) {
    if (p.sink && p.grad_sink)
      opts.set_dsink_token(
          tensor(g, "dsink", kDSink, {1, p.h, 1, 1}, {p.h, 1, 1, 1}, fe::DataType_t::FLOAT));
  };
  if (p.fp8) {
    const auto f32 = fe::DataType_t::FLOAT;
    auto s = [&](int row, const char* name) { return scalar(g, name, kScale0 + row, f32); };
    fe::graph::SDPA_fp8_backward_attributes opts;
    opts.set_name("lowbit_sdpa_fp8_bwd").set_deterministic_algorithm(p.deterministic);
    common_options(g, p, opts);
    if (p.bias) opts.set_bias(bias_tensor(g, p, "bias", kBias));
    dsink(opts);
    auto r = g.sdpa_fp8_backward(
        q, k, v, o, dout, stats, s(kBwdDescaleQ, "descale_q"), s(kBwdDescaleK, "descale_k"),
        s(kBwdDescaleV, "descale_v"), s(kBwdDescaleO, "descale_o"), s(kBwdDescaleDO, "descale_dO"),
        s(kBwdDescaleS, "descale_s"), s(kBwdDescaleDP, "descale_dP"), s(kBwdScaleS, "scale_s"),
        s(kBwdScaleDQ, "scale_dQ"), s(kBwdScaleDK, "scale_dK"), s(kBwdScaleDV, "scale_dV"),
        s(kBwdScaleDP, "scale_dP"), opts);
    dq = r[0];
    dk = r[1];
    dv = r[2];
    for (int i = 0; i < 4; ++i) amax_output(r[3 + i], i);
  } else {
    fe::graph::SDPA_backward_attributes opts;
    opts.set_name("lowbit_sdpa_bwd").set_deterministic_algorithm(p.deterministic);
    common_options(g, p, opts);
    if (p.bias) {
      opts.set_bias(bias_tensor(g, p, "bias", kBias));
      if (p.grad_bias) opts.set_dbias(bias_tensor(g, p, "dbias", kDBias));
    }
    dsink(opts);
    auto r = g.sdpa_backward(q, k, v, o, dout, stats, opts);
    dq = r[0];
    dk = r[1];
    dv = r[2];
  }
  const auto out = fe_dtype(p.dqkv_dtype);
  dq->set_output(true).set_uid(kDQ).set_dim({p.b, p.h, p.sq, p.d}).set_stride(bshd(p.h, p.sq, p.d));
  dk->set_output(true).set_uid(kDK).set_dim({p.b, p.hk, p.skv, p.d});
  dk->set_stride(bshd(p.hk, p.skv, p.d));
  dv->set_output(true).set_uid(kDV).set_dim({p.b, p.hk, p.skv, p.dv});
  dv->set_stride(bshd(p.hk, p.skv, p.dv));
  for (auto* t : {&dq, &dk, &dv}) (*t)->set_data_type(out);
  if (p.ragged) {
    dq->set_ragged_offset(q->get_ragged_offset());
    dk->set_ragged_offset(k->get_ragged_offset());
    dv->set_ragged_offset(v->get_ragged_offset());
  }
  return gp;
}

struct CachedGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;
};

// The graph for `p` on this device: from the cache, else built with `handle` and cached. A
// shape cuDNN rejects is not cached: the error names what the frontend said.
Status graph_for(const AttentionParams& p, int device, bool backward, cudnnHandle_t handle,
                 std::shared_ptr<CachedGraph>* out) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::shared_ptr<CachedGraph>> cache;
  const std::string key = graph_key(p, device, backward);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) {
      *out = it->second;
      return Status::Ok();
    }
  }
  auto c = std::make_shared<CachedGraph>();
  const char* what = backward ? "attention backward" : "attention forward";
  try {
    c->graph = backward ? build_bwd(p) : build_fwd(p);
    auto st = c->graph->build(handle, {fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
    if (!st.is_good())
      return Status::Invalid(std::string(what) + ": cuDNN " +
                             std::to_string(fe::detail::get_backend_version()) +
                             " does not support this case: " + st.get_message());
    st = c->graph->get_workspace_size(c->workspace);
    if (!st.is_good()) return Status::Invalid(std::string(what) + ": " + st.get_message());
  } catch (const std::exception& e) {
    return Status::Invalid(std::string(what) + ": cuDNN frontend: " + e.what());
  }
  std::lock_guard<std::mutex> lock(mu);
  *out = cache.emplace(key, c).first->second;  // a racing builder's graph wins; both are equal
  return Status::Ok();
}

void pack_common(const AttentionParams& p, std::unordered_map<int64_t, void*>& pack, int scales) {
  auto put = [&](int64_t uid, const void* ptr) { pack[uid] = const_cast<void*>(ptr); };
  put(kQ, p.q);
  put(kK, p.k);
  put(kV, p.v);
  put(kO, p.o);
  put(kStats, p.stats);
  if (p.bias) put(kBias, p.bias);
  if (p.padding) {
    put(kSeqQ, p.seqlens_q);
    put(kSeqKv, p.seqlens_kv);
  }
  if (p.ragged)
    for (int i = 0; i < 4; ++i) put(kOffQ + i, p.ragged_offsets + i * p.ragged_stride);
  if (p.dropout) {
    put(kSeed, p.seed);
    put(kOffset, p.offset);
  }
  if (p.sink) put(kSink, p.sink_logits);
  if (p.fp8)
    for (int i = 0; i < scales; ++i) put(kScale0 + i, p.fp8_scales + i * abi::kAttnScaleStride);
}

Status run(const AttentionParams& p, void* stream_ptr, const WorkspaceFn& ws, bool backward) {
  if (auto s = validate(p); !s.ok()) return s;
  if (auto s = ensure_cudnn(); !s.ok()) return s;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return Status::Invalid("attention: no CUDA device");
  cudnnHandle_t handle = nullptr;
  if (auto s = handle_for(device, stream, &handle); !s.ok()) return s;
  std::shared_ptr<CachedGraph> c;
  if (auto s = graph_for(p, device, backward, handle, &c); !s.ok()) return s;

  std::unordered_map<int64_t, void*> pack;
  pack_common(p, pack, backward ? 12 : 6);
  const int amaxes = backward ? 4 : 2;
  if (p.fp8)
    for (int i = 0; i < amaxes; ++i) pack[kAmax0 + i] = p.amax + i * abi::kAttnScaleStride;
  if (backward) {
    pack[kDO] = const_cast<void*>(p.dout);
    pack[kDQ] = p.grad_q;
    pack[kDK] = p.grad_k;
    pack[kDV] = p.grad_v;
    if (p.bias && p.grad_bias && !p.fp8) pack[kDBias] = p.grad_bias;
    if (p.sink && p.grad_sink) pack[kDSink] = p.grad_sink;
  }
  void* workspace = nullptr;
  if (c->workspace > 0) {
    workspace = ws(static_cast<size_t>(c->workspace));
    if (workspace == nullptr)
      return Status::Invalid("attention: could not allocate " + std::to_string(c->workspace) +
                             " bytes of cuDNN workspace");
  }
  try {
    auto st = c->graph->execute(handle, pack, workspace);
    if (!st.is_good())
      return Status::Invalid("attention: cuDNN execute failed: " + st.get_message());
  } catch (const std::exception& e) {
    return Status::Invalid(std::string("attention: cuDNN execute: ") + e.what());
  }
  return Status::Ok();
}

}  // namespace

int attention_cudnn_load(const char* path, char* err, int err_len) {
  std::lock_guard<std::mutex> lock(g_load_mu);
  if (fe::cudnn_dlhandle != nullptr) return 0;
  std::vector<std::string> tried;
  const char* env = std::getenv("LOWBIT_CUDNN_LIBRARY");
  for (const char* name : {path, env, "libcudnn.so.9"}) {
    if (name == nullptr || *name == '\0') continue;
    dlerror();
    void* h = dlopen(name, RTLD_NOW | RTLD_GLOBAL);
    if (h != nullptr) {
      fe::cudnn_dlhandle = h;
      return 0;
    }
    const char* e = dlerror();
    tried.push_back(std::string(name) + " (" + (e ? e : "not found") + ")");
  }
  g_load_error =
      "attention: cuDNN 9 was not found; install the nvidia-cudnn-cu13 (or -cu12) wheel that "
      "jax[cuda] brings, or set LOWBIT_CUDNN_LIBRARY to libcudnn.so.9. Tried:";
  for (auto& t : tried) g_load_error += " " + t;
  if (err != nullptr && err_len > 0) std::snprintf(err, err_len, "%s", g_load_error.c_str());
  return 1;
}

int64_t attention_cudnn_version() {
  char err[8];
  if (attention_cudnn_load(nullptr, err, sizeof(err)) != 0) return 0;
  try {
    return static_cast<int64_t>(fe::detail::get_backend_version());
  } catch (const std::exception&) {
    return 0;
  }
}

Status attention_fwd_cuda(const AttentionParams& p, void* stream, const WorkspaceFn& ws) {
  return run(p, stream, ws, false);
}

Status attention_bwd_cuda(const AttentionParams& p, void* stream, const WorkspaceFn& ws) {
  return run(p, stream, ws, true);
}

}  // namespace lowbit

#else  // built without the cuDNN frontend headers (LOWBIT_CUDNN_ATTENTION=OFF)

namespace lowbit {

namespace {
Status not_built() {
  return Status::Invalid(
      "attention: this liblowbit_cuda was built without cuDNN attention (LOWBIT_CUDNN_ATTENTION "
      "was OFF or the nvidia-cudnn-frontend headers were not found)");
}
}  // namespace

int attention_cudnn_load(const char*, char* err, int err_len) {
  if (err != nullptr && err_len > 0) std::snprintf(err, err_len, "%s", not_built().message.c_str());
  return 1;
}
int64_t attention_cudnn_version() { return 0; }
Status attention_fwd_cuda(const AttentionParams&, void*, const WorkspaceFn&) { return not_built(); }
Status attention_bwd_cuda(const AttentionParams&, void*, const WorkspaceFn&) { return not_built(); }

}  // namespace lowbit

#endif
