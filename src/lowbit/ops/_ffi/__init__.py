"""The FFI layer: one module per handler family (csrc/ffi/<family>.cc), each a few thin functions
that take arrays and plain ints and flags, build the result types and make the
:func:`lowbit._native.ffi_call`. No argument checks (the ops above check), no ScaledTensor in or
out, no gradients. Each module names its family's codes and flag bits, whose values come from
:mod:`lowbit.abi` (the same as csrc/include/lowbit/abi.h)."""
