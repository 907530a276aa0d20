"""``transformer_engine.jax.cpp_extensions.misc``: TE's reader of ``XLA_FLAGS`` (frameworks use
it to see how XLA was configured). TE's dtype converters and device queries are internals; use
``lowbit.capabilities`` for the device."""

from __future__ import annotations

import os


def get_xla_flag(flag: str, default=None, cast=str):
    """The value of ``flag`` in the ``XLA_FLAGS`` environment variable: ``True`` for a bare flag
    (``--xla_foo``), the text after ``=`` for an option (through ``cast`` unless None), else
    ``default``. A ``cast`` that fails raises (ValueError for ``int``)."""
    for item in sorted(os.environ.get("XLA_FLAGS", "").split()):
        name, eq, value = item.partition("=")
        if name == flag:
            if not eq:
                return True
            return value if cast is None else cast(value)
    return default


__all__ = ["get_xla_flag"]
