"""``transformer_engine.common``: only ``recipe`` (an alias of lowbit.recipe) is used by TE's JAX tests."""
