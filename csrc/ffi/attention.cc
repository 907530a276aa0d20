// FFI handlers of the fused attention (cuDNN, lowbit/attention.h): attention_fwd and
// attention_bwd. CUDA only: the CPU library has none (Python runs its reference path there).
//
// Optional operands are (0,) buffers. The scratch comes from XLA's scratch allocator or a
// stream-ordered allocation (its size is the graph's, known only once cuDNN has built it). Not
// command-buffer compatible: the first call of a shape builds a cuDNN graph, and as its own thunk
// the call runs inside lax.scan bodies where XLA's captured cuDNN calls crashed (issue 26).
#if LOWBIT_WITH_CUDA

#include <string>

#include "lowbit/attention.h"

#include "ffi_common.h"

namespace ffi = xla::ffi;
using namespace lowbit;
using namespace lowbit::ffi_util;

namespace {

Status fail(const std::string& m) { return Status::Invalid("attention: " + m); }

// (b, s, heads, d) of a BSHD operand, or (t, heads, d) of a ragged one (b and s from elsewhere).
bool dims_of(const ffi::AnyBuffer& x, bool ragged, int64_t* b, int64_t* s, int64_t* heads,
             int64_t* d) {
  auto dd = x.dimensions();
  if (ragged) {
    if (dd.size() != 3) return false;
    *heads = dd[1];
    *d = dd[2];
    return true;
  }
  if (dd.size() != 4) return false;
  *b = dd[0];
  *s = dd[1];
  *heads = dd[2];
  *d = dd[3];
  return true;
}

// Decodes the operands both directions share; max_sq/max_skv give the padded lengths of a
// ragged layout (BSHD takes them from the shapes).
Status decode_common(Buf q, Buf k, Buf v, Buf bias, Buf seqlens_q, Buf seqlens_kv, Buf ragged,
                     Buf seed, Buf offset, Buf sink, Buf fp8_scales, int32_t flags, float scale,
                     float dropout_rate, int64_t max_sq, int64_t max_skv, int scales_needed,
                     AttentionParams* p) {
  p->causal = flags & abi::kAttnCausal;
  p->padding = flags & abi::kAttnPadding;
  p->ragged = flags & abi::kAttnRagged;
  p->dropout = flags & abi::kAttnDropout;
  p->sink = flags & abi::kAttnSink;
  p->fp8 = flags & abi::kAttnFp8;
  p->deterministic = flags & abi::kAttnDeterministic;
  p->scale = scale;
  p->dropout_rate = dropout_rate;
  int64_t kb = 0, vb = 0, skv2 = 0, hv = 0, dk = 0;
  if (!dims_of(q, p->ragged, &p->b, &p->sq, &p->h, &p->d) ||
      !dims_of(k, p->ragged, &kb, &p->skv, &p->hk, &dk) ||
      !dims_of(v, p->ragged, &vb, &skv2, &hv, &p->dv))
    return fail(p->ragged ? "ragged q, k, v must be (tokens, heads, head_dim)"
                          : "q, k, v must be (batch, seq, heads, head_dim)");
  if (dk != p->d || hv != p->hk) return fail("k must match q's head_dim and v's heads");
  if (p->ragged) {
    p->b = static_cast<int64_t>(seqlens_q.element_count());
    p->sq = max_sq;
    p->skv = max_skv;
    p->ragged_stride = p->b > 0 ? static_cast<int64_t>(ragged.element_count()) / 4 : 0;
    if (ragged.element_type() != ffi::DataType::S32 || p->ragged_stride < p->b + 1)
      return fail("ragged offsets must be int32 (4, >= batch + 1)");
    p->ragged_offsets = static_cast<const int32_t*>(ragged.untyped_data());
  } else if (kb != p->b || vb != p->b || skv2 != p->skv) {
    return fail("q, k, v must share the batch, and k, v the sequence length");
  }
  if (!to_dtype(q.element_type(), &p->dtype)) return fail("unsupported q dtype");
  DType kt, vt;
  if (!to_dtype(k.element_type(), &kt) || !to_dtype(v.element_type(), &vt) || kt != p->dtype ||
      vt != p->dtype)
    return fail("q, k, v must share one dtype");
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  if (bias.element_count()) {
    auto bd = bias.dimensions();
    if (bd.size() != 4 || bd[2] != p->sq || bd[3] != p->skv ||
        !to_dtype(bias.element_type(), &p->bias_dtype))
      return fail("bias must be (1 or b, 1 or h, sq, skv) of a float dtype");
    p->bias_b = bd[0];
    p->bias_h = bd[1];
    p->bias = bias.untyped_data();
  }
  if (p->padding) {
    if (seqlens_q.element_type() != ffi::DataType::S32 ||
        seqlens_kv.element_type() != ffi::DataType::S32 ||
        static_cast<int64_t>(seqlens_q.element_count()) != p->b ||
        static_cast<int64_t>(seqlens_kv.element_count()) != p->b)
      return fail("seqlens_q and seqlens_kv must be int32 (batch,)");
    p->seqlens_q = static_cast<const int32_t*>(seqlens_q.untyped_data());
    p->seqlens_kv = static_cast<const int32_t*>(seqlens_kv.untyped_data());
  }
  if (p->dropout) {
    if (seed.size_bytes() != 8 || offset.size_bytes() != 8)
      return fail("dropout seed and offset must be 8 bytes each (one int64)");
    p->seed = seed.untyped_data();
    p->offset = offset.untyped_data();
  }
  if (p->sink) {
    if (sink.element_type() != ffi::DataType::F32 ||
        static_cast<int64_t>(sink.element_count()) != p->h)
      return fail("sink logits must be float32 (heads,)");
    p->sink_logits = static_cast<const float*>(sink.untyped_data());
  }
  if (p->fp8) {
    if (fp8_scales.element_type() != ffi::DataType::F32 ||
        static_cast<int64_t>(fp8_scales.element_count()) != scales_needed * abi::kAttnScaleStride)
      return fail("fp8 scales must be float32 (" + std::to_string(scales_needed) + ", " +
                  std::to_string(abi::kAttnScaleStride) + ")");
    p->fp8_scales = static_cast<const float*>(fp8_scales.untyped_data());
  }
  return Status::Ok();
}

// A stream-ordered allocation that lives until the handler returns (freed on the same stream,
// after the graph that uses it).
struct StreamWorkspace {
  cudaStream_t stream;
  void* ptr = nullptr;
  ~StreamWorkspace() {
    if (ptr != nullptr) cudaFreeAsync(ptr, stream);
  }
};

// The kernel's workspace: XLA's scratch allocator, else (it refused even 256 bytes under jax
// 0.11.2's PjRt client) a stream-ordered allocation from the device's default pool.
WorkspaceFn scratch_fn(ffi::ScratchAllocator& scratch, StreamWorkspace& owned) {
  return [&scratch, &owned](size_t bytes) -> void* {
    auto m = scratch.Allocate(bytes, 256);
    if (m.has_value()) return *m;
    void* p = nullptr;
    if (cudaMallocAsync(&p, bytes, owned.stream) != cudaSuccess) return nullptr;
    owned.ptr = p;
    return p;
  };
}

float* amax_or_null(Ret& amax, bool fp8, int rows, Status* st) {
  if (!fp8) return nullptr;
  if (amax->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(amax->element_count()) != rows * abi::kAttnScaleStride) {
    *st = fail("fp8 amax result must be float32 (" + std::to_string(rows) + ", 4)");
    return nullptr;
  }
  return static_cast<float*>(amax->untyped_data());
}

ffi::Error AttentionFwd(cudaStream_t stream, ffi::ScratchAllocator scratch, Buf q, Buf k, Buf v,
                        Buf bias, Buf seqlens_q, Buf seqlens_kv, Buf ragged, Buf seed, Buf offset,
                        Buf sink, Buf fp8_scales, Ret o, Ret stats, Ret amax, int32_t flags,
                        float scale, float dropout_rate, int64_t max_sq, int64_t max_skv) {
  AttentionParams p;
  Status st =
      decode_common(q, k, v, bias, seqlens_q, seqlens_kv, ragged, seed, offset, sink, fp8_scales,
                    flags, scale, dropout_rate, max_sq, max_skv, abi::kAttnFp8FwdScales, &p);
  if (!st.ok()) return to_error(st);
  if (!to_dtype(o->element_type(), &p.o_dtype)) return to_error(fail("unsupported o dtype"));
  if (static_cast<int64_t>(stats->element_count()) != p.b * p.h * p.sq ||
      stats->element_type() != ffi::DataType::F32)
    return to_error(fail("stats must be float32 (b, h, sq)"));
  p.o = o->untyped_data();
  p.stats = static_cast<float*>(stats->untyped_data());
  p.amax = amax_or_null(amax, p.fp8, abi::kAttnFp8FwdAmaxes, &st);
  if (!st.ok()) return to_error(st);
  StreamWorkspace owned{stream};
  return to_error(attention_fwd_cuda(p, stream, scratch_fn(scratch, owned)));
}

ffi::Error AttentionBwd(cudaStream_t stream, ffi::ScratchAllocator scratch, Buf q, Buf k, Buf v,
                        Buf o, Buf dout, Buf stats, Buf bias, Buf seqlens_q, Buf seqlens_kv,
                        Buf ragged, Buf seed, Buf offset, Buf sink, Buf fp8_scales, Ret dq, Ret dk,
                        Ret dv, Ret dbias, Ret dsink, Ret amax, int32_t flags, float scale,
                        float dropout_rate, int64_t max_sq, int64_t max_skv) {
  AttentionParams p;
  Status st =
      decode_common(q, k, v, bias, seqlens_q, seqlens_kv, ragged, seed, offset, sink, fp8_scales,
                    flags, scale, dropout_rate, max_sq, max_skv, abi::kAttnFp8BwdScales, &p);
  if (!st.ok()) return to_error(st);
  if (!to_dtype(o.element_type(), &p.o_dtype) || !to_dtype(dout.element_type(), &p.do_dtype) ||
      !to_dtype(dq->element_type(), &p.dqkv_dtype))
    return to_error(fail("unsupported o, dO or dq dtype"));
  if (o.element_count() != q.element_count() / p.d * p.dv ||
      dout.element_count() != o.element_count())
    return to_error(fail("o and dO must be (b, sq, h, dv)"));
  if (static_cast<int64_t>(stats.element_count()) != p.b * p.h * p.sq ||
      stats.element_type() != ffi::DataType::F32)
    return to_error(fail("stats must be float32 (b, h, sq)"));
  if (dq->element_count() != q.element_count() || dk->element_count() != k.element_count() ||
      dv->element_count() != v.element_count())
    return to_error(fail("dq, dk, dv must have q's, k's and v's shapes"));
  p.o = const_cast<void*>(o.untyped_data());
  p.dout = dout.untyped_data();
  p.stats = static_cast<float*>(const_cast<void*>(stats.untyped_data()));
  p.grad_q = dq->untyped_data();
  p.grad_k = dk->untyped_data();
  p.grad_v = dv->untyped_data();
  if (p.bias && dbias->element_count()) {
    if (dbias->element_count() != bias.element_count() ||
        dbias->element_type() != bias.element_type())
      return to_error(fail("dbias must have bias's shape and dtype"));
    p.grad_bias = dbias->untyped_data();
  }
  if (p.sink && dsink->element_count()) {
    if (static_cast<int64_t>(dsink->element_count()) != p.h ||
        dsink->element_type() != ffi::DataType::F32)
      return to_error(fail("dsink must be float32 (heads,)"));
    p.grad_sink = static_cast<float*>(dsink->untyped_data());
  }
  p.amax = amax_or_null(amax, p.fp8, abi::kAttnFp8BwdAmaxes, &st);
  if (!st.ok()) return to_error(st);
  StreamWorkspace owned{stream};
  return to_error(attention_bwd_cuda(p, stream, scratch_fn(scratch, owned)));
}

}  // namespace

#pragma GCC visibility push(default)

// No kCmdBufferCompatible trait (see the top of this file): plain XLA_FFI_DEFINE_HANDLER_SYMBOL.
XLA_FFI_DEFINE_HANDLER_SYMBOL(lowbit_attention_fwd_cuda, AttentionFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<Buf>()  // q (b, sq, h, d) or ragged (tq, h, d)
                                  .Arg<Buf>()  // k
                                  .Arg<Buf>()  // v
                                  .Arg<Buf>()  // bias (1|b, 1|h, sq, skv) or (0,)
                                  .Arg<Buf>()  // seqlens_q (b,) int32 or (0,)
                                  .Arg<Buf>()  // seqlens_kv
                                  .Arg<Buf>()  // ragged offsets (4, >= b+1) int32 or (0,)
                                  .Arg<Buf>()  // dropout seed: 8 bytes or (0,)
                                  .Arg<Buf>()  // dropout offset: 8 bytes or (0,)
                                  .Arg<Buf>()  // sink logits (h,) f32 or (0,)
                                  .Arg<Buf>()  // fp8 scales (6, 4) f32 or (0,)
                                  .Ret<Buf>()  // o
                                  .Ret<Buf>()  // stats (b, h, sq) f32
                                  .Ret<Buf>()  // fp8 amax (2, 4) f32 or (0,)
                                  .Attr<int32_t>("flags")
                                  .Attr<float>("scale")
                                  .Attr<float>("dropout_rate")
                                  .Attr<int64_t>("max_sq")
                                  .Attr<int64_t>("max_skv"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(lowbit_attention_bwd_cuda, AttentionBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<Buf>()  // q
                                  .Arg<Buf>()  // k
                                  .Arg<Buf>()  // v
                                  .Arg<Buf>()  // o
                                  .Arg<Buf>()  // dO
                                  .Arg<Buf>()  // stats
                                  .Arg<Buf>()  // bias or (0,)
                                  .Arg<Buf>()  // seqlens_q
                                  .Arg<Buf>()  // seqlens_kv
                                  .Arg<Buf>()  // ragged offsets
                                  .Arg<Buf>()  // dropout seed
                                  .Arg<Buf>()  // dropout offset
                                  .Arg<Buf>()  // sink logits
                                  .Arg<Buf>()  // fp8 scales (12, 4) f32 or (0,)
                                  .Ret<Buf>()  // dq
                                  .Ret<Buf>()  // dk
                                  .Ret<Buf>()  // dv
                                  .Ret<Buf>()  // dbias or (0,)
                                  .Ret<Buf>()  // dsink (h,) f32 or (0,)
                                  .Ret<Buf>()  // fp8 amax (4, 4) f32 or (0,)
                                  .Attr<int32_t>("flags")
                                  .Attr<float>("scale")
                                  .Attr<float>("dropout_rate")
                                  .Attr<int64_t>("max_sq")
                                  .Attr<int64_t>("max_skv"));

#pragma GCC visibility pop

// Loads libcudnn from `path` (the Python side passes the nvidia wheel's copy; NULL: the
// loader's path); 0 on success, else the reason in err.
LOWBIT_EXPORT int lowbit_attention_load_cudnn(const char* path, char* err, int err_len) {
  return lowbit::attention_cudnn_load(path, err, err_len);
}

// The loaded cuDNN's version (e.g. 91900), 0 when none is loaded or cuDNN attention is not built.
LOWBIT_EXPORT int64_t lowbit_attention_cudnn_version() { return lowbit::attention_cudnn_version(); }

#endif  // LOWBIT_WITH_CUDA
