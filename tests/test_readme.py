"""The README's Python snippets run as written, in order, in one namespace (as a reader pastes them)."""

from __future__ import annotations

import os
import re

import jax
import numpy as np

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")


def python_snippets() -> list[str]:
    with open(README) as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_has_snippets():
    assert len(python_snippets()) >= 3


def test_readme_snippets_run_and_give_what_they_say():
    ns: dict = {}
    for i, code in enumerate(python_snippets()):
        try:
            exec(compile(code, f"README.md snippet {i}", "exec"), ns)  # noqa: S102
        except Exception as e:  # name the snippet that broke
            raise AssertionError(f"README snippet {i} failed: {e!r}\n{code}") from e
    # What the comments promise.
    assert ns["qt"].data.shape == (256, 512) and ns["qt"].scale_inv.shape == (1,)
    assert ns["qt"].colwise_data.shape == (512, 256)
    x, y = np.asarray(ns["x"], np.float64), np.asarray(ns["y"], np.float64)
    assert np.linalg.norm(y - x) / np.linalg.norm(x) < 0.05
    assert "_overwrite_with_gradient" in ns["variables"]
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree_util.tree_leaves(ns["variables"]))
    ref = np.concatenate(
        [
            np.asarray(ns["tokens"], np.float64)[a:b] @ np.asarray(ns["experts"], np.float64)[g]
            for g, (a, b) in enumerate(zip(np.cumsum([0, 100, 0, 300])[:4], np.cumsum([100, 0, 300, 112])))
        ]
    )
    out = np.asarray(ns["out"], np.float64)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
