"""A context value that is part of ``jax.jit``'s cache key.

lowbit's recipe and sharding contexts are read at trace time, so a function traced under one
value must not be reused under another: each is a ``jax.make_user_context``, whose value JAX
keys its trace, lowering and compilation caches on. Values must be hashable.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax


class TraceKeyedContext:
    """``.value`` (thread-local) and ``with ctx(v):`` to set it for a block."""

    def __init__(self, default: Any = None):
        make = getattr(jax, "make_user_context", None)
        self._jax = make(default) if make is not None else None
        self._default, self._local = default, threading.local()  # fallback for older jax

    @property
    def value(self) -> Any:
        if self._jax is not None:
            return self._jax.value
        return getattr(self._local, "value", self._default)

    @contextlib.contextmanager
    def __call__(self, value: Any) -> Iterator[Any]:
        if self._jax is not None:
            with self._jax(value):
                yield value
            return
        prev = self.value
        self._local.value = value
        try:
            yield value
        finally:
            self._local.value = prev
