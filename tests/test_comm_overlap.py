"""lowbit.bench.comm_overlap's interval arithmetic on hand-built kernel timelines (the trace
reader itself needs a GPU's profile)."""

import pytest

from lowbit.bench.comm_overlap import summarize


def _ev(start_us, end_us, name):
    return (start_us * 1000, end_us * 1000, name)


def test_hidden_and_exposed_communication_add_up():
    # one step: a GEMM 0-100 us, NCCL 50-150 us (half hidden), a fusion 200-250 us, idle 150-200
    ev = [_ev(0, 100, "sm90_gemm"), _ev(50, 150, "ncclDevKernel_AllReduce"), _ev(200, 250, "loop_fusion")]
    s = summarize(ev, steps=1)
    assert s["span_ms"] == pytest.approx(0.25)
    assert s["compute_ms"] == pytest.approx(0.15)
    assert s["comm_ms"] == pytest.approx(0.10)
    assert s["comm_hidden_ms"] == pytest.approx(0.05)
    assert s["comm_exposed_ms"] == pytest.approx(0.05)
    assert s["idle_ms"] == pytest.approx(0.05)
    assert s["top"][0] == ("sm90_gemm", pytest.approx(0.10))


def test_overlapping_kernels_on_two_streams_count_once_and_steps_divide():
    ev = [_ev(0, 100, "a"), _ev(20, 80, "b"), _ev(10, 30, "ncclKernel_x"), _ev(25, 40, "ncclKernel_y")]
    s = summarize(ev, steps=2)
    assert s["compute_ms"] == pytest.approx(0.05)  # the union 0-100 us over two steps
    assert s["comm_ms"] == pytest.approx(0.015)  # 10-40 us
    assert s["comm_exposed_ms"] == pytest.approx(0.0)
    assert s["idle_ms"] == pytest.approx(0.0)
