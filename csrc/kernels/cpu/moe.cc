// CPU MoE kernels: the reference backend of lowbit/moe.h (router, dispatch plan, permute with
// optional FP8 tensor scaling, weighted combine and their backwards), one token at a time.
#include <algorithm>
#include <cmath>
#include <vector>

#include "../common/moe_math.h"
#include "cpu_common.h"
#include "lowbit/moe.h"

namespace lowbit {
namespace {

// The best not-yet-taken index among `allowed` by (value desc, index asc); -1 if none.
int pick_best(const std::vector<float>& v, const std::vector<char>& allowed, int n) {
  int best = -1;
  for (int j = 0; j < n; ++j)
    if (allowed[j] && (best < 0 || moe_before(v[j], j, v[best], best))) best = j;
  return best;
}

// softmax of z (n entries) into p.
void softmax_row(const float* z, int n, float* p) {
  float m = z[0];
  for (int j = 1; j < n; ++j) m = std::max(m, z[j]);
  float sum = 0.0f;
  for (int j = 0; j < n; ++j) sum += (p[j] = std::exp(z[j] - m));
  for (int j = 0; j < n; ++j) p[j] = p[j] / sum;
}

}  // namespace

Status moe_router_fwd_cpu(const MoeRouterParams& p) {
  if (auto s = validate(p); !s.ok()) return s;
  FpuExactGuard guard;
  const int E = int(p.E), k = p.topk;
  std::vector<float> score(E), choice(E);
  std::vector<char> allowed(E);
  for (int64_t t = 0; t < p.T; ++t) {
    const float* z = p.logits + t * E;
    const bool post = p.score == MoeScore::kSoftmax && !p.pre_softmax;
    if (p.score == MoeScore::kSoftmax) {
      if (!post) softmax_row(z, E, score.data());
      for (int j = 0; j < E; ++j) choice[j] = post ? z[j] : score[j];
    } else {
      for (int j = 0; j < E; ++j) {
        score[j] = moe_score(z[j], p.score);
        choice[j] = p.bias ? score[j] + p.bias[j] : score[j];
      }
    }
    std::fill(allowed.begin(), allowed.end(), 1);
    if (p.num_groups > 0) {  // the group_topk groups with the best sums of their top choices
      const int G = p.num_groups, per = E / G, n = k / p.group_topk;
      std::vector<float> gscore(G);
      for (int g = 0; g < G; ++g) {
        std::vector<char> in(E, 0);
        for (int j = g * per; j < (g + 1) * per; ++j) in[j] = 1;
        float sum = 0.0f;
        for (int i = 0; i < n; ++i) {
          const int b = pick_best(choice, in, E);
          sum += choice[b];
          in[b] = 0;
        }
        gscore[g] = sum;
      }
      std::vector<char> gin(G, 1), keep(G, 0);
      for (int i = 0; i < p.group_topk; ++i) {
        const int b = pick_best(gscore, gin, G);
        keep[b] = 1;
        gin[b] = 0;
      }
      for (int j = 0; j < E; ++j) allowed[j] = keep[j / per];
    }
    int* idx = p.experts + t * k;
    float* w = p.weights + t * k;
    for (int i = 0; i < k; ++i) {
      idx[i] = pick_best(choice, allowed, E);
      allowed[idx[i]] = 0;
    }
    if (post) {
      std::vector<float> zc(k);
      for (int i = 0; i < k; ++i) zc[i] = z[idx[i]];
      softmax_row(zc.data(), k, w);
    } else {
      float sum = 0.0f;
      for (int i = 0; i < k; ++i) sum += (w[i] = score[idx[i]]);
      if (p.score != MoeScore::kSoftmax && k > 1)
        for (int i = 0; i < k; ++i) w[i] = w[i] / (sum + 1e-20f);
    }
    if (p.scaling != 1.0f)
      for (int i = 0; i < k; ++i) w[i] = w[i] * p.scaling;
  }
  return Status::Ok();
}

Status moe_router_bwd_cpu(const MoeRouterBwdParams& p) {
  if (auto s = validate(p); !s.ok()) return s;
  FpuExactGuard guard;
  const int E = int(p.E), k = p.topk;
  std::vector<float> prob(E), wc(k), ds(k);
  for (int64_t t = 0; t < p.T; ++t) {
    const float* z = p.logits + t * E;
    const int* idx = p.experts + t * k;
    float* dz = p.dlogits + t * E;
    std::fill(dz, dz + E, 0.0f);
    for (int i = 0; i < k; ++i) ds[i] = p.dweights[t * k + i] * p.scaling;
    if (p.score == MoeScore::kSoftmax) {
      // dz_j = p_j (ds_j - sum_i ds_i p_i) over the softmax's inputs (all experts, or the k).
      if (p.pre_softmax) {
        softmax_row(z, E, prob.data());
        for (int i = 0; i < k; ++i) wc[i] = prob[idx[i]];
      } else {
        for (int i = 0; i < k; ++i) wc[i] = z[idx[i]];
        softmax_row(wc.data(), k, wc.data());
      }
      float dot = 0.0f;
      for (int i = 0; i < k; ++i) dot += ds[i] * wc[i];
      if (p.pre_softmax)
        for (int j = 0; j < E; ++j) dz[j] = prob[j] * (0.0f - dot);
      for (int i = 0; i < k; ++i) dz[idx[i]] = wc[i] * (ds[i] - dot);
    } else {
      float sum = 0.0f, dot = 0.0f;
      for (int i = 0; i < k; ++i) {
        wc[i] = moe_score(z[idx[i]], p.score);
        sum += wc[i];
        dot += ds[i] * wc[i];
      }
      const float S = sum + 1e-20f;
      for (int i = 0; i < k; ++i) {
        const float dsc = k > 1 ? ds[i] / S - dot / (S * S) : ds[i];
        dz[idx[i]] = dsc * moe_score_grad(z[idx[i]], wc[i], p.score);
      }
    }
  }
  return Status::Ok();
}

Status moe_plan_cpu(const MoePlanParams& p) {
  if (auto s = validate(p); !s.ok()) return s;
  const int64_t P = p.T * p.k, E = p.E;
  std::vector<int64_t> cnt(E, 0), rank(P);
  for (int64_t q = 0; q < P; ++q) {
    const int e = p.experts[q];
    if (e < 0 || e >= E) return Status::Invalid("moe_plan: expert id out of range");
    rank[q] = cnt[e]++;
  }
  int64_t off = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t kept = p.capacity >= 0 ? std::min(cnt[e], p.capacity) : cnt[e];
    p.counts[e] = int32_t(cnt[e]);
    p.sizes[e] = int32_t((kept + p.align - 1) / p.align * p.align);
    p.offsets[e] = int32_t(off);
    off += p.sizes[e];
  }
  if (off > p.rows) return Status::Invalid("moe_plan: rows too small for the groups");
  std::fill(p.src, p.src + p.rows, int32_t(P));
  for (int64_t q = 0; q < P; ++q) {
    const int e = p.experts[q];
    const int64_t kept = p.capacity >= 0 ? std::min(cnt[e], p.capacity) : cnt[e];
    p.dest[q] = rank[q] < kept ? int32_t(p.offsets[e] + rank[q]) : int32_t(p.rows);
    if (rank[q] < kept) p.src[p.dest[q]] = int32_t(q);
  }
  return Status::Ok();
}

Status moe_permute_cpu(const MoePermuteParams& p) {
  if (auto s = validate(p); !s.ok()) return s;
  FpuExactGuard guard;
  const int64_t P = p.T * p.k, d = p.d;
  if (p.mode == ScalingMode::kNoScaling) {
    const size_t b = dtype_bytes(p.dtype);
    for (int64_t r = 0; r < p.rows; ++r) {
      char* o = static_cast<char*>(p.out) + r * d * b;
      if (p.src[r] >= P) {
        std::fill(o, o + d * b, 0);
      } else {
        const char* x = static_cast<const char*>(p.x) + (p.src[r] / p.k) * d * b;
        std::copy(x, x + d * b, o);
      }
    }
    return Status::Ok();
  }
  for (int64_t t = 0; t < p.T; ++t) {
    float m = 0.0f;
    for (int64_t c = 0; c < d; ++c)
      m = std::max(m, abs_ignore_nan(load_value(p.x, p.dtype, t * d + c)));
    p.row_amax[t] = m;
  }
  std::fill(p.amax, p.amax + p.E, 0.0f);
  for (int64_t r = 0; r < p.rows; ++r)
    if (p.src[r] < P) {
      const int e = p.experts[p.src[r]];
      p.amax[e] = std::max(p.amax[e], p.row_amax[p.src[r] / p.k]);
    }
  const bool e4 = p.q == DType::kE4M3;
  const float fmax = e4 ? kE4M3Max : kE5M2Max;
  std::vector<float> scale(p.E);
  for (int64_t e = 0; e < p.E; ++e) {
    scale[e] =
        p.mode == ScalingMode::kDelayedTensor ? p.delayed[e] : scale_from_amax(p.amax[e], fmax);
    p.scale_inv[e] = 1.0f / scale[e];
  }
  uint8_t* out = static_cast<uint8_t*>(p.out);
  for (int64_t r = 0; r < p.rows; ++r) {
    const int32_t q = p.src[r];
    for (int64_t c = 0; c < d; ++c) {
      uint8_t b = 0;
      if (q < P) {
        const float v = load_value(p.x, p.dtype, (q / p.k) * d + c) * scale[p.experts[q]];
        b = uint8_t(encode_rne(v, e4 ? kE4M3 : kE5M2));
      }
      if (out) out[r * d + c] = b;
      if (p.out_col) p.out_col[c * p.rows + r] = b;
    }
  }
  return Status::Ok();
}

Status moe_combine_fwd_cpu(const MoeCombineParams& p) {
  if (auto s = validate(p); !s.ok()) return s;
  FpuExactGuard guard;
  std::vector<float> acc(p.d);
  for (int64_t t = 0; t < p.T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < p.k; ++j) {
      const int64_t r = p.dest[t * p.k + j];
      const float w = p.w[t * p.k + j];
      if (r >= p.rows) continue;  // a dropped pair adds zero
      for (int64_t c = 0; c < p.d; ++c) acc[c] += w * load_value(p.y, p.y_dtype, r * p.d + c);
    }
    for (int64_t c = 0; c < p.d; ++c) store_value(p.out, p.out_dtype, t * p.d + c, acc[c]);
  }
  return Status::Ok();
}

Status moe_combine_bwd_cpu(const MoeCombineBwdParams& p) {
  if (auto s = validate(p); !s.ok()) return s;
  FpuExactGuard guard;
  const int64_t P = p.T * p.k;
  for (int64_t r = 0; r < p.rows; ++r) {
    const int32_t q = p.src[r];
    for (int64_t c = 0; c < p.d; ++c) {
      const float v = q < P ? p.w[q] * load_value(p.g, p.g_dtype, (q / p.k) * p.d + c) : 0.0f;
      store_value(p.dy, p.y_dtype, r * p.d + c, v);
    }
  }
  for (int64_t q = 0; q < P; ++q) {
    const int64_t r = p.dest[q], t = q / p.k;
    float dot = 0.0f;
    if (r < p.rows)
      for (int64_t c = 0; c < p.d; ++c)
        dot += load_value(p.y, p.y_dtype, r * p.d + c) * load_value(p.g, p.g_dtype, t * p.d + c);
    p.dw[q] = dot;
  }
  return Status::Ok();
}

}  // namespace lowbit
