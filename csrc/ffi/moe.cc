// FFI handlers of the MoE kernels (lowbit/moe.h): router forward/backward, dispatch plan,
// permute (plain or FP8), combine forward/backward. Written once (ffi_common.h) for both
// platforms. Python (src/lowbit/ops/_ffi/moe.py) checks shapes first and names the argument.
#include "lowbit/moe.h"

#include "ffi_common.h"

namespace ffi = xla::ffi;
using namespace lowbit;
using namespace lowbit::ffi_util;

namespace {

Status check_dtype(const Buf& b, ffi::DataType t, const char* what) {
  return b.element_type() == t ? Status::Ok() : Status::Invalid(what);
}

ffi::Error RouterFwd(LOWBIT_PLATFORM_CTX Buf logits, Buf bias, Ret weights, Ret experts,
                     int32_t topk, int32_t score, bool pre_softmax, int32_t num_groups,
                     int32_t group_topk, float scaling) {
  MoeRouterParams p;
  if (!dims_2d(logits, &p.T, &p.E) || logits.element_type() != ffi::DataType::F32)
    return to_error(Status::Invalid("moe_router: logits must be 2-D float32"));
  p.logits = static_cast<const float*>(logits.untyped_data());
  p.bias = in_or_null<float>(bias);
  p.topk = topk;
  p.score = static_cast<MoeScore>(score);
  p.pre_softmax = pre_softmax;
  p.num_groups = num_groups;
  p.group_topk = group_topk;
  p.scaling = scaling;
  p.weights = static_cast<float*>(weights->untyped_data());
  p.experts = static_cast<int32_t*>(experts->untyped_data());
  if (auto err = to_error(validate(p)); err.failure()) return err;
  return to_error(LOWBIT_RUN(moe_router_fwd, p));
}

ffi::Error RouterBwd(LOWBIT_PLATFORM_CTX Buf logits, Buf experts, Buf dweights, Ret dlogits,
                     int32_t score, bool pre_softmax, float scaling) {
  MoeRouterBwdParams p;
  int64_t T2 = 0, k = 0;
  if (!dims_2d(logits, &p.T, &p.E) || !dims_2d(experts, &T2, &k) || T2 != p.T ||
      dweights.element_count() != experts.element_count())
    return to_error(Status::Invalid("moe_router_bwd: shapes do not match"));
  p.logits = static_cast<const float*>(logits.untyped_data());
  p.experts = static_cast<const int32_t*>(experts.untyped_data());
  p.dweights = static_cast<const float*>(dweights.untyped_data());
  p.topk = int32_t(k);
  p.score = static_cast<MoeScore>(score);
  p.pre_softmax = pre_softmax;
  p.scaling = scaling;
  p.dlogits = static_cast<float*>(dlogits->untyped_data());
  if (auto err = to_error(validate(p)); err.failure()) return err;
  return to_error(LOWBIT_RUN(moe_router_bwd, p));
}

ffi::Error Plan(LOWBIT_PLATFORM_CTX Buf experts, Ret dest, Ret src, Ret sizes, Ret offsets,
                Ret counts, Ret scratch, int64_t num_experts, int64_t align, int64_t capacity) {
  MoePlanParams p;
  if (!dims_2d(experts, &p.T, &p.k))
    return to_error(Status::Invalid("moe_plan: experts must be 2-D"));
  if (auto s = check_dtype(experts, ffi::DataType::S32, "moe_plan: experts must be int32"); !s.ok())
    return to_error(s);
  p.experts = static_cast<const int32_t*>(experts.untyped_data());
  p.E = num_experts;
  p.rows = src->element_count();
  p.align = align;
  p.capacity = capacity;
  p.dest = static_cast<int32_t*>(dest->untyped_data());
  p.src = static_cast<int32_t*>(src->untyped_data());
  p.sizes = static_cast<int32_t*>(sizes->untyped_data());
  p.offsets = static_cast<int32_t*>(offsets->untyped_data());
  p.counts = static_cast<int32_t*>(counts->untyped_data());
  p.scratch = ptr_or_null<int32_t>(scratch);
  p.scratch_len = scratch->element_count();
  if (auto err = to_error(validate(p)); err.failure()) return err;
  return to_error(LOWBIT_RUN(moe_plan, p));
}

// x (T, d); src (rows,); experts (T, k) int32; delayed (E,) or (0,). Results: out (rows, d)
// (x's dtype, or FP8; (0,) when only the colwise copy is wanted), out_col (d, rows) or (0,),
// scale_inv (E,), amax (E,), row_amax (T,) scratch; the last three (0,) without FP8.
ffi::Error Permute(LOWBIT_PLATFORM_CTX Buf x, Buf src, Buf experts, Buf delayed, Ret out,
                   Ret out_col, Ret scale_inv, Ret amax, Ret row_amax, int32_t mode, int32_t q,
                   int32_t flags) {
  MoePermuteParams p;
  int64_t T2 = 0;
  if (!dims_2d(x, &p.T, &p.d) || !dims_2d(experts, &T2, &p.k) || T2 != p.T)
    return to_error(Status::Invalid("moe_permute: x and experts must be 2-D with T rows"));
  if (!to_dtype(x.element_type(), &p.dtype))
    return to_error(Status::Invalid("moe_permute: unsupported dtype"));
  p.x = x.untyped_data();
  p.src = static_cast<const int32_t*>(src.untyped_data());
  p.rows = src.element_count();
  p.experts = static_cast<const int32_t*>(experts.untyped_data());
  p.E = scale_inv->element_count();
  p.mode = static_cast<ScalingMode>(mode);
  p.q = static_cast<DType>(q);
  p.delayed = in_or_null<float>(delayed);
  const bool fp8 = p.mode != ScalingMode::kNoScaling;
  p.out = (flags & abi::kMoePermuteRowwise) ? out->untyped_data() : nullptr;
  p.out_col = fp8 && (flags & abi::kMoePermuteColwise) ? ptr_or_null<uint8_t>(out_col) : nullptr;
  p.scale_inv = ptr_or_null<float>(scale_inv);
  p.amax = ptr_or_null<float>(amax);
  p.row_amax = ptr_or_null<float>(row_amax);
  if (!fp8 && !p.out) return to_error(Status::Invalid("moe_permute: nothing to write"));
  if (auto err = to_error(validate(p)); err.failure()) return err;
  return to_error(LOWBIT_RUN(moe_permute, p));
}

ffi::Error CombineFwd(LOWBIT_PLATFORM_CTX Buf y, Buf w, Buf dest, Ret out) {
  MoeCombineParams p;
  if (!dims_2d(y, &p.rows, &p.d) || !dims_2d(dest, &p.T, &p.k) ||
      w.element_count() != dest.element_count())
    return to_error(Status::Invalid("moe_combine: shapes do not match"));
  if (!to_dtype(y.element_type(), &p.y_dtype) || !to_dtype(out->element_type(), &p.out_dtype))
    return to_error(Status::Invalid("moe_combine: unsupported dtype"));
  p.y = y.untyped_data();
  p.w = static_cast<const float*>(w.untyped_data());
  p.dest = static_cast<const int32_t*>(dest.untyped_data());
  p.out = out->untyped_data();
  if (auto err = to_error(validate(p)); err.failure()) return err;
  return to_error(LOWBIT_RUN(moe_combine_fwd, p));
}

ffi::Error CombineBwd(LOWBIT_PLATFORM_CTX Buf g, Buf y, Buf w, Buf dest, Buf src, Ret dy, Ret dw) {
  MoeCombineBwdParams p;
  if (!dims_2d(y, &p.rows, &p.d) || !dims_2d(dest, &p.T, &p.k) ||
      w.element_count() != dest.element_count() || int64_t(src.element_count()) != p.rows ||
      int64_t(g.element_count()) != p.T * p.d)
    return to_error(Status::Invalid("moe_combine_bwd: shapes do not match"));
  if (!to_dtype(y.element_type(), &p.y_dtype) || !to_dtype(g.element_type(), &p.g_dtype))
    return to_error(Status::Invalid("moe_combine_bwd: unsupported dtype"));
  p.g = g.untyped_data();
  p.y = y.untyped_data();
  p.w = static_cast<const float*>(w.untyped_data());
  p.dest = static_cast<const int32_t*>(dest.untyped_data());
  p.src = static_cast<const int32_t*>(src.untyped_data());
  p.dy = dy->untyped_data();
  p.dw = static_cast<float*>(dw->untyped_data());
  if (auto err = to_error(validate(p)); err.failure()) return err;
  return to_error(LOWBIT_RUN(moe_combine_bwd, p));
}

}  // namespace

#pragma GCC visibility push(default)

LOWBIT_HANDLER(lowbit_moe_router_fwd, RouterFwd,
               LOWBIT_BIND()
                   .Arg<Buf>()  // logits (T, E) float32
                   .Arg<Buf>()  // expert bias (E,) float32 or (0,)
                   .Ret<Buf>()  // weights (T, k) float32
                   .Ret<Buf>()  // experts (T, k) int32
                   .Attr<int32_t>("topk")
                   .Attr<int32_t>("score")
                   .Attr<bool>("pre_softmax")
                   .Attr<int32_t>("num_groups")
                   .Attr<int32_t>("group_topk")
                   .Attr<float>("scaling"));

LOWBIT_HANDLER(lowbit_moe_router_bwd, RouterBwd,
               LOWBIT_BIND()
                   .Arg<Buf>()  // logits (T, E) float32
                   .Arg<Buf>()  // experts (T, k) int32
                   .Arg<Buf>()  // dweights (T, k) float32
                   .Ret<Buf>()  // dlogits (T, E) float32
                   .Attr<int32_t>("score")
                   .Attr<bool>("pre_softmax")
                   .Attr<float>("scaling"));

LOWBIT_HANDLER(lowbit_moe_plan, Plan,
               LOWBIT_BIND()
                   .Arg<Buf>()  // experts (T, k) int32
                   .Ret<Buf>()  // dest (T, k) int32
                   .Ret<Buf>()  // src (rows,) int32
                   .Ret<Buf>()  // group sizes (E,) int32
                   .Ret<Buf>()  // offsets (E,) int32
                   .Ret<Buf>()  // routed pairs per expert (E,) int32
                   .Ret<Buf>()  // scratch int32 (moe_plan_scratch_len; (0,) on CPU)
                   .Attr<int64_t>("num_experts")
                   .Attr<int64_t>("align")
                   .Attr<int64_t>("capacity"));

LOWBIT_HANDLER(lowbit_moe_permute, Permute,
               LOWBIT_BIND()
                   .Arg<Buf>()  // x (T, d)
                   .Arg<Buf>()  // src (rows,) int32
                   .Arg<Buf>()  // experts (T, k) int32
                   .Arg<Buf>()  // delayed scales (E,) float32 or (0,)
                   .Ret<Buf>()  // out (rows, d)
                   .Ret<Buf>()  // out_col (d, rows) FP8 or (0,)
                   .Ret<Buf>()  // scale_inv (E,) or (0,)
                   .Ret<Buf>()  // amax (E,) or (0,)
                   .Ret<Buf>()  // row amax scratch (T,) or (0,)
                   .Attr<int32_t>("mode")
                   .Attr<int32_t>("q")
                   .Attr<int32_t>("flags"));

LOWBIT_HANDLER(lowbit_moe_combine_fwd, CombineFwd,
               LOWBIT_BIND()
                   .Arg<Buf>()    // y (rows, d)
                   .Arg<Buf>()    // w (T, k) float32
                   .Arg<Buf>()    // dest (T, k) int32
                   .Ret<Buf>());  // out (T, d)

LOWBIT_HANDLER(lowbit_moe_combine_bwd, CombineBwd,
               LOWBIT_BIND()
                   .Arg<Buf>()    // g (T, d)
                   .Arg<Buf>()    // y (rows, d)
                   .Arg<Buf>()    // w (T, k) float32
                   .Arg<Buf>()    // dest (T, k) int32
                   .Arg<Buf>()    // src (rows,) int32
                   .Ret<Buf>()    // dy (rows, d), y's dtype
                   .Ret<Buf>());  // dw (T, k) float32

#pragma GCC visibility pop
