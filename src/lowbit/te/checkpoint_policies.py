"""``transformer_engine.jax.checkpoint_policies``: lowbit's policies under TE's names."""

from lowbit.checkpoint_policies import *  # noqa: F401,F403
from lowbit.checkpoint_policies import __all__  # noqa: F401
