"""Fused compositions of the differentiable ops: one custom VJP over several ops whose kernels
hand each other FP8 operands (mlp; split_dense, the fused QKV projection; the norm in front of
either, dense_norm; moe, the mixture-of-experts engine, with its permutation and the grouped
GEMM on pre-quantized expert weights). Each equals the unfused composition bit for bit and
falls back to it where the fusion does not apply."""
