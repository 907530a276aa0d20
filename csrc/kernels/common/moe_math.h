// Scalar pieces of the MoE router shared by the CPU and CUDA kernels (one definition, so the two
// backends differ only in the exp/log implementations and the order of their sums).
#pragma once

#include <cmath>

#include "lowbit/formats.h"
#include "lowbit/moe.h"

namespace lowbit {

// sigmoid(z) = 1 / (1 + exp(-z)); softplus(z) = max(z, 0) + log1p(exp(-|z|)) (jax.nn.softplus).
LOWBIT_HD float moe_sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }
LOWBIT_HD float moe_softplus(float z) { return fmaxf(z, 0.0f) + log1pf(expf(-fabsf(z))); }

// The score of one logit (not softmax, which needs the row).
LOWBIT_HD float moe_score(float z, MoeScore fn) {
  return fn == MoeScore::kSigmoid ? moe_sigmoid(z) : sqrtf(moe_softplus(z));
}

// d score / d z at z with score s (sigmoid: s (1 - s); sqrt(softplus): sigmoid(z) / (2 s)).
LOWBIT_HD float moe_score_grad(float z, float s, MoeScore fn) {
  return fn == MoeScore::kSigmoid ? s * (1.0f - s) : moe_sigmoid(z) / (2.0f * s);
}

// Ranking of the choice: a before b when its value is larger, or equal with the lower index.
LOWBIT_HD bool moe_before(float va, int a, float vb, int b) {
  return va > vb || (va == vb && a < b);
}

}  // namespace lowbit
