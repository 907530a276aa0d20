"""lowbit.te.attention: TE's enum values and the mask helpers against direct numpy forms."""

import numpy as np
import pytest

from lowbit.te import attention as A


def test_enum_values_are_te_header_values():
    # Values of TE's NVTE_* C enums, which TE's Python enums wrap.
    assert [m.value for m in A.AttnMaskType] == [0, 1, 2, 3, 4, 5]
    assert [m.value for m in A.AttnBiasType] == [0, 1, 2]
    assert [m.value for m in A.AttnSoftmaxType] == [0, 1, 2]
    assert [m.value for m in A.QKVLayout] == [5, 7, 9, 10, 12, 14]
    assert [m.value for m in A.QKVFormat] == [0, 1, 2]
    assert A.ReorderStrategy.Striped.value == 1 and A.CPStrategy.RING.value == 2


def test_mask_predicates_and_names():
    pc = A.canonicalize_attn_mask_type("bottom_right_padding_causal")
    assert pc is A.AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK
    assert pc.is_causal() and pc.is_padding() and pc.is_bottom_right()
    assert not A.AttnMaskType.PADDING_MASK.is_causal()
    assert not A.AttnMaskType.CAUSAL_MASK.is_padding()
    with pytest.raises(ValueError, match="attn_mask_type"):
        A.canonicalize_attn_mask_type("diagonal")
    with pytest.raises(ValueError, match="softmax_type"):
        A.AttnSoftmaxType.from_str("sparse")


def test_layout_conversions():
    L = A.QKVLayout
    assert L.THD_T2HD.to_qkvpacked() is L.T3HD and L.BS3HD.to_separate() is L.BSHD_BSHD_BSHD
    assert A.get_qkv_format(L.T3HD) is A.QKVFormat.THD
    assert L.BSHD_BS2HD.is_kvpacked() and L.THD_THD_THD.is_separate()


def _run_lengths(row):
    out, i = [], 0
    while i < len(row):
        j = i
        while j < len(row) and row[j] == row[i]:
            j += 1
        out += [0 if row[i] == 0 else j - i] * (j - i)
        i = j
    return out


def test_run_length_fill_and_swa_mask():
    rng = np.random.default_rng(0)
    ids = np.sort(rng.integers(0, 4, (3, 12)), axis=-1)[:, ::-1]
    got = np.asarray(A.run_length_fill(ids))
    assert got.tolist() == [_run_lengths(r) for r in ids]
    pos = np.arange(6)[None]
    m = np.asarray(A.make_swa_mask(pos, pos, (2, 1)))[0, 0]
    i, j = np.meshgrid(np.arange(6), np.arange(6), indexing="ij")
    np.testing.assert_array_equal(m, ((j >= i - 2) & (j <= i + 1)).astype(np.float32))
    full = np.asarray(A.make_swa_mask(pos, pos, None))
    assert full.shape == (1, 1, 6, 6) and full.all()
