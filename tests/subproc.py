"""Runs tables of malformed calls in a subprocess, so a crash or a hang fails a test instead of
killing pytest.

A test file holds ``CASES = {group: builder}``; a builder returns ``[(name, thunk, words)]``.
Run as a script with a group name, the file calls :func:`main`, which runs every thunk and prints
one line per case: PASS when it raised TypeError/ValueError/NotImplementedError (or the given
``ok_errors``) whose message
holds every word (case-insensitive), FAIL with the reason otherwise (a result, another error).
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback

OK_ERRORS = (TypeError, ValueError, NotImplementedError)


def main(cases: dict, ok_errors: tuple = OK_ERRORS) -> None:
    """``ok_errors``: the exception types that count as a clear refusal (the FFI handlers' own
    re-checks surface as JAX runtime errors)."""
    import jax

    group = sys.argv[1]
    for name, thunk, words in cases[group]():
        print(f"START {name}", flush=True)  # the last START names the case that crashed
        try:
            jax.block_until_ready(thunk())
            print(f"FAIL {name}: returned a result, no error", flush=True)
            continue
        except ok_errors as e:
            msg = str(e)
            missing = [w for w in words if w.lower() not in msg.lower()]
            verdict = f"FAIL {name}: message lacks {missing}: {msg!r}" if missing else f"PASS {name}"
        except Exception as e:  # noqa: BLE001 - any other error is the finding
            tb = traceback.format_exc(limit=3).replace("\n", " | ")
            verdict = f"FAIL {name}: {type(e).__name__}: {e} [{tb}]"
        print(verdict.replace("\n", " "), flush=True)
    print("DONE", flush=True)


def start(script: str, group: str) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, script, group], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(proc: subprocess.Popen, timeout: float = 120.0) -> list[str]:
    """The PASS/FAIL lines of a finished worker; AssertionError on a crash, a hang or a FAIL."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"worker hung (>{timeout}s); last lines: {out.splitlines()[-2:]}") from None
    lines = out.splitlines()
    started = [ln[6:] for ln in lines if ln.startswith("START ")]
    if proc.returncode != 0 or "DONE" not in lines:
        raise AssertionError(
            f"worker died (rc {proc.returncode}) in case {started[-1:]}; stderr: {err[-2000:]}"
        )
    verdicts = [ln for ln in lines if ln.startswith(("PASS ", "FAIL "))]
    assert len(verdicts) == len(started) > 0, lines
    fails = [ln for ln in verdicts if ln.startswith("FAIL ")]
    assert not fails, "\n".join(fails)
    return verdicts


def run(script: str, group: str, timeout: float = 120.0) -> list[str]:
    return finish(start(script, group), timeout)
