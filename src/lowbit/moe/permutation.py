"""Token dispatch / combine (lowbit's names); the implementation lives with the expert-parallel
engine in :mod:`lowbit.ops.fused.permutation`, which this module re-exports whole."""

from lowbit.ops.fused.permutation import *  # noqa: F403
from lowbit.ops.fused.permutation import __all__  # noqa: F401
