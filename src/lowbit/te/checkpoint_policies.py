"""``transformer_engine.jax.checkpoint_policies``: lowbit's policies under TE's names."""

from lowbit.checkpoint_policies import *  # noqa: F401,F403
from lowbit.checkpoint_policies import __all__ as _ours
from lowbit.checkpoint_policies import lowbit_gemms_saveable

#: TE's policy saving its GEMM outputs: lowbit's GEMMs (named for remat) here.
te_gemms_saveable = lowbit_gemms_saveable

__all__ = [*_ours, "te_gemms_saveable"]
