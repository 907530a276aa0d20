"""TE's mesh helpers in lowbit.te.sharding, on the CPU's device(s)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import lowbit.te.sharding as S


def test_without_a_mesh():
    x = jnp.ones((4, 8))
    assert not S.is_mesh_available() and S.get_all_mesh_axes() == ()
    assert S.get_num_devices_in_mesh() == 1 and S.num_of_devices() == len(jax.devices())
    assert S.with_sharding_constraint(x, PartitionSpec("dp", None)) is x
    assert S.with_sharding_constraint_by_logical_axes(x, None) is x
    assert S.get_mesh_axis_size(None) == 1 and S.get_mesh_axis_rank("dp") == 0
    assert S.get_padded_spec(("dp",), 3) == ("dp", None, None) and S.get_padded_spec(None, 2) == (None, None)
    assert S.get_active_resource_axis("dp_resource") is None


def test_with_a_mesh_and_mesh_resource():
    devices = np.array(jax.devices()[:1]).reshape(1, 1)
    mesh = Mesh(devices, ("data", "model"))
    res = S.MeshResource(dp_resource="data", tp_resource="model")
    x = jnp.arange(8.0).reshape(2, 4)
    with jax.set_mesh(mesh), S.global_shard_guard(res):
        assert S.is_mesh_available() and S.get_all_mesh_axes() == ("data", "model")
        assert S.get_mesh_axis_size("data") == 1 and S.get_num_devices_in_mesh() == 1
        assert S.dp_or_fsdp_axis_size() == 1 and S.tpsp_axis_size() == 1
        assert S.get_active_resource_axis("dp_resource") is None  # axis of size 1: inactive
        y = jax.jit(lambda x: S.with_sharding_constraint_by_logical_axes(x, (S.BATCH_AXES, S.HIDDEN_AXES)))(x)
        np.testing.assert_array_equal(y, x)
        with pytest.raises(ValueError, match="not an axis"):
            S.get_mesh_axis_size("pipe")
        summed = jax.shard_map(
            lambda v: S.all_reduce_sum_along_dp_fsdp(v, mesh),
            mesh=mesh,
            in_specs=PartitionSpec("data"),
            out_specs=PartitionSpec(),
            check_vma=False,
        )(x)
        np.testing.assert_array_equal(summed, x)


def test_logical_axis_map_and_recipe_queries():
    from lowbit import recipe
    from lowbit.te.quantize import TensorUsage, get_quantization_recipe, is_quantize_recipe_supported

    assert S.get_sharding_map_logic_axis_to_mesh_axis() == {}  # no mesh
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1), ("data",))
    with jax.set_mesh(mesh), S.global_shard_guard(S.MeshResource(dp_resource="data")):
        assert S.get_sharding_map_logic_axis_to_mesh_axis()[S.BATCH_AXES] == "data"
    assert isinstance(get_quantization_recipe("MXFP8BlockScaling"), recipe.MXFP8BlockScaling)
    with pytest.raises(ValueError, match="Valid options"):
        get_quantization_recipe("FP8")
    assert is_quantize_recipe_supported("DelayedScaling") == (True, None)
    assert [u.value for u in TensorUsage] == [0, 1, 2, 3]
