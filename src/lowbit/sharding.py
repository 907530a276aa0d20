"""Which mesh axes carry which kind of parallelism, as TransformerEngine's ``MeshResource``,
the logical axis names of lowbit's Flax modules, and the shard plan of a dense.

lowbit's ops read the MeshResource to name their sharding; a user sets it once, globally, with
:func:`global_shard_guard` or through :func:`lowbit.autocast`'s ``mesh_resource``. This module
decides the layout (:func:`plan_dense`, column- or row-parallel as the caller's ``tp_layout``
says); lowbit.ops.dense_sharded runs it.

Sequence parallelism (TransformerEngine's ``tpsp_resource``): its axis is the tensor-parallel axis,
and it also splits the sequence of the activations between blocks (the residual stream). An
activation ``(b, s, ...)`` is then laid out ``P(batch axes, tpsp, None...)``: the row-wise ops on it
(norms) run per (batch, sequence) shard; a column-parallel dense all-gathers its FP8 input along
the sequence before the GEMM, a row-parallel one reduce-scatters its output along the sequence
(lowbit.ops.dense_sharded). Attention sees whole sequences with its heads split, as under plain
tensor parallelism.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Iterator, NamedTuple, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lowbit._trace_context import TraceKeyedContext
from lowbit.quantization.scaling_modes import ScalingMode


@dataclasses.dataclass(frozen=True)
class MeshResource:
    """Mesh axis names per parallelism kind; ``None`` where that kind is not used."""

    # TransformerEngine's positional order: MeshResource("dp", "tp") means what it means there.
    dp_resource: Optional[str] = None  # data parallel (batch)
    tp_resource: Optional[str] = None  # tensor parallel (features)
    tpsp_resource: Optional[str] = None  # tensor + sequence parallel
    fsdp_resource: Optional[str] = None  # fully sharded data parallel (parameters)
    pp_resource: Optional[str] = None  # pipeline stages
    cp_resource: Optional[str] = None  # context parallel (sequence)
    ep_resource: Optional[str] = None  # expert parallel (MoE dispatch)
    # lowbit: the dtype in which a GEMM whose contraction is split over devices (wgrad over the
    # batch axes, dgrad in a column layout, y in a row layout) has its partial sums all-reduced.
    # None: the GEMM's input dtype (bf16 for bf16 activations), as XLA does for a sharded dot
    # and as plain Flax moves them; "float32": exact to one rounding of the output, twice the bytes.
    partial_sum_dtype: Optional[str] = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "partial_sum_dtype":
                if v is not None and v not in PARTIAL_SUM_DTYPES:
                    raise ValueError(
                        f"MeshResource.partial_sum_dtype must be None or one of {PARTIAL_SUM_DTYPES}, "
                        f"got {v!r}"
                    )
            elif v is not None and not isinstance(v, str):
                raise TypeError(f"MeshResource.{f.name} must be a mesh axis name (str) or None, got {v!r}")


PARTIAL_SUM_DTYPES = ("float32", "bfloat16", "float16")

# ---------------------------------------------------------------------------------------------
# Logical axis names (TransformerEngine's strings): the Flax modules annotate their parameters
# with them; lowbit.te.sharding re-exports them and maps them onto the MeshResource's mesh axes.
# ---------------------------------------------------------------------------------------------
BATCH_AXES = "nvte_batch"
SEQLEN_AXES = "nvte_seqlen"
SEQLEN_TP_AXES = "nvte_seqlen_tp"
SEQLEN_CP_AXES = "nvte_seqlen_cp"
HEAD_AXES = "nvte_head"
HIDDEN_AXES = "nvte_hidden"
HIDDEN_TP_AXES = "nvte_hidden_tp"
JOINED_AXES = "nvte_joined"
W_NO_SHARD_AXES = "nvte_w_no_shard"
W_FSDP_AXES = "nvte_w_fsdp"
W_TP_AXES = "nvte_w_tp"
W_JOINED_AXES = "nvte_w_joined"

# Read at trace time, so both are part of jax.jit's cache key (lowbit._trace_context).
_RESOURCE = TraceKeyedContext(None)
_TP_LAYOUT = TraceKeyedContext(None)


def global_mesh_resource() -> MeshResource:
    """The MeshResource in effect (an empty one when none was set)."""
    return _RESOURCE.value or MeshResource()


@contextlib.contextmanager
def global_shard_guard(resource: Optional[MeshResource]) -> Iterator[MeshResource]:
    """Sets the MeshResource for the enclosed code (restored on exit)."""
    if resource is not None and not isinstance(resource, MeshResource):
        raise TypeError(f"resource must be a lowbit.MeshResource or None, got {type(resource).__name__}")
    with _RESOURCE(resource):
        yield global_mesh_resource()


# ---------------------------------------------------------------------------------------------
# Tensor-parallel layout of dense kernels, and the mesh in context
# ---------------------------------------------------------------------------------------------
#: "column": kernel P(None, tp), x P(dp, None), y P(dp, tp); "row": kernel P(tp, None),
#: x P(dp, tp), y P(dp, None) after a sum over tp. Chosen by the caller at trace time (jit cannot
#: see operand shardings then): operands laid out otherwise are resharded by XLA (correct, but
#: with communication).
TP_LAYOUTS = ("column", "row")


def check_tp_layout(layout: Optional[str], owner: str) -> Optional[str]:
    """``layout`` if it is None, "column" or "row"; else a ValueError naming ``tp_layout``."""
    if layout is not None and layout not in TP_LAYOUTS:
        raise ValueError(f"{owner}: tp_layout must be None, 'column' or 'row', got {layout!r}")
    return layout


def resolve_tp_layout(tp_layout: Optional[str]) -> str:
    """The layout a dense runs with: ``tp_layout`` when given; else that of the deprecated
    :func:`tensor_parallel_layout` context, else "column"."""
    return check_tp_layout(tp_layout, "tp_layout") or _TP_LAYOUT.value or "column"


def tp_layout() -> str:
    """The layout of a dense that passes no ``tp_layout`` (:func:`resolve_tp_layout`)."""
    return resolve_tp_layout(None)


@contextlib.contextmanager
def tensor_parallel_layout(layout: str) -> Iterator[str]:
    """Deprecated: pass ``tp_layout=`` to :func:`lowbit.dense` instead. Sets the layout of the
    enclosed dense calls that pass no ``tp_layout`` of their own."""
    warnings.warn(
        "lowbit.sharding.tensor_parallel_layout is deprecated; pass tp_layout='column' or 'row' "
        "to lowbit.dense (or the module) instead",
        DeprecationWarning,
        stacklevel=3,
    )
    if layout not in TP_LAYOUTS:
        raise ValueError(f"tensor_parallel_layout: tp_layout must be 'column' or 'row', got {layout!r}")
    with _TP_LAYOUT(layout):
        yield layout


def current_mesh():
    """The mesh in context, or None: ``jax.sharding.set_mesh`` / ``use_mesh``, else the legacy
    ``with mesh:``, else an abstract mesh (inside jit under ``use_abstract_mesh``)."""
    get = getattr(jax.sharding, "get_mesh", None)
    if get is not None:
        try:
            m = get()
            if m is not None and not m.empty:
                return m
        except Exception:  # no concrete mesh set in this jax version's sense
            pass
    try:
        from jax._src.mesh import thread_resources  # `with mesh:`; no public getter
    except ImportError:  # pragma: no cover
        thread_resources = None
    if thread_resources is not None:
        m = thread_resources.env.physical_mesh
        if not m.empty:
            return m
    get_abstract = getattr(jax.sharding, "get_abstract_mesh", None)
    if get_abstract is not None:
        m = get_abstract()
        if m is not None and not m.empty:
            return m
    return None


def shard_map(f, mesh, in_specs, out_specs):
    """``jax.shard_map`` without the replication check (lowbit's FFI calls carry no varying-axes
    rules, and the collectives inside make every replicated output truly replicated), under
    ``jax.jit``. Inputs replicated over an axis get their cotangents summed over it.

    The jit matters outside a traced step (an eager ``model.init`` under a mesh): an eager
    shard_map compiles each primitive of its body as its own manual computation, and on jax
    0.11.2 with CUDA, Shardy's canonicalizer crashed (SIGSEGV) on those holding an FFI call.
    Jitted, the body compiles as one program; inside an outer jit the call is inlined."""
    if hasattr(jax, "shard_map"):
        mapped = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    else:
        from jax.experimental.shard_map import shard_map as _legacy  # jax < 0.7

        mapped = _legacy(f, mesh, in_specs, out_specs, check_rep=False)
    return jax.jit(mapped)


# ---------------------------------------------------------------------------------------------
# The shard plan of a dense
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How a dense (M, K) x (K, N) is split over the mesh: the axes splitting each size.

    Under sequence parallelism (``seq`` non-empty) M is viewed as ``rows = (B, S)`` (x's leading
    axis, the product of the others: the batch and the sequence): the batch axes split B, the
    ``seq`` axes (the tp axis) split S between blocks: x's S in the column layout (gathered
    before the GEMM), y's in the row layout (reduce-scattered after it)."""

    mesh: Any
    batch: tuple  # mesh axes splitting M (B under sequence parallelism)
    k_axes: tuple  # mesh axes splitting K
    n_axes: tuple  # mesh axes splitting N
    partial_sum_dtype: Optional[str] = None  # MeshResource.partial_sum_dtype
    seq: tuple = ()  # sequence parallelism: the tp axes splitting S between blocks
    rows: tuple = ()  # sequence parallelism: (B, S), M = B * S
    overlap: bool = False  # lowbit.ops.collective_dense: the gather / scatter as a ppermute ring

    @staticmethod
    def _entry(axes):
        return None if not axes else (axes[0] if len(axes) == 1 else axes)

    def spec(self, *dims) -> P:
        return P(*(self._entry(getattr(self, d)) for d in dims))

    @property
    def x_seq(self) -> tuple:
        """The axes splitting x's sequence on arrival (column layout under sequence parallelism)."""
        return () if self.k_axes else self.seq

    @property
    def y_seq(self) -> tuple:
        """The axes splitting y's sequence on leaving (row layout under sequence parallelism)."""
        return self.seq if self.k_axes else ()

    @property
    def x_rows(self) -> tuple:
        """Every axis splitting the rows of an x shard (batch, then sequence)."""
        return self.batch + self.x_seq

    @property
    def y_rows(self) -> tuple:
        """Every axis splitting the rows of a y shard (batch, then sequence)."""
        return self.batch + self.y_seq

    @property
    def b_local(self) -> int:
        """B per shard (sequence parallelism): the rows of a shard are (b_local, S or S/tp)."""
        return self.rows[0] // _axis_size(self.mesh, self.batch) if self.rows else 0


class ShardingFallbackWarning(UserWarning):
    """A MeshResource asks to split a size its mesh axes do not divide: the op runs unsharded."""


def _axis_size(mesh, axes) -> int:
    return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


class _Axes(NamedTuple):
    mesh: Any
    batch: tuple  # dp, fsdp
    tp: tuple  # tp_resource or tpsp_resource
    seq: tuple  # tpsp_resource: the tp axis, also splitting the sequence between blocks


def _mesh_axes() -> Optional[_Axes]:
    """The mesh and the axes of the MeshResource in context (axes of size 1 dropped), or None: no
    MeshResource or mesh, or already inside a shard_map over its axes."""
    res = global_mesh_resource()
    named = {
        "dp_resource": res.dp_resource,
        "fsdp_resource": res.fsdp_resource,
        "tp_resource": res.tp_resource,
        "tpsp_resource": res.tpsp_resource,
    }
    used = [a for a in named.values() if a is not None]
    if not used:
        return None
    mesh = current_mesh()
    if mesh is None:
        return None
    names = tuple(mesh.axis_names)
    for field, a in named.items():
        if a is not None and a not in names:
            raise ValueError(
                f"lowbit: MeshResource.{field} names mesh axis {a!r}, but the mesh in context has "
                f"axes {names}"
            )
    tp, tpsp = res.tp_resource, res.tpsp_resource
    if tp is not None and tpsp is not None and mesh.shape[tp] > 1 and mesh.shape[tpsp] > 1:
        raise ValueError(
            f"lowbit: MeshResource sets both tp_resource={tp!r} and tpsp_resource={tpsp!r}; use one "
            "(tpsp_resource is tensor parallelism over its axis with sequence parallelism), as "
            "TransformerEngine requires"
        )
    get_abstract = getattr(jax.sharding, "get_abstract_mesh", None)
    manual = set(getattr(get_abstract(), "manual_axes", ()) or ()) if get_abstract else set()
    if manual & set(used):
        return None  # already inside a shard_map over these axes: the caller handles them
    batch = tuple(a for a in (res.dp_resource, res.fsdp_resource) if a is not None and mesh.shape[a] > 1)
    seq = (tpsp,) if tpsp is not None and mesh.shape[tpsp] > 1 else ()
    tp_axes = seq or ((tp,) if tp is not None and mesh.shape[tp] > 1 else ())
    return _Axes(mesh, batch, tp_axes, seq)


def seq_view(lead, n_batch: int, n_seq: int, block: int = 1) -> tuple:
    """(B, S): the (batch, sequence) view of the rows ``lead`` (x's leading axes) that sequence
    parallelism splits (B over ``n_batch`` shards, S over ``n_seq``), or () where it cannot:
    ``(b, s, ...)`` is ``(b, s * ...)`` with s split (so the layout is x's own
    ``P(batch, tp, None...)``); a flat ``(M,)`` is ``(n_batch, M / n_batch)``, the layout
    ``P((batch..., tp))``. Each shard's S must hold whole scaling blocks of ``block`` rows."""
    lead = tuple(int(d) for d in lead)
    if len(lead) >= 2:
        B, S = lead[0], int(np.prod(lead[1:]))
        ok = B % n_batch == 0 and lead[1] % n_seq == 0
    elif len(lead) == 1:
        B, S = n_batch, lead[0] // n_batch
        ok = lead[0] % (n_batch * n_seq) == 0
    else:
        return ()
    return (B, S) if ok and (S // n_seq) % block == 0 else ()


def plan_rows(shape, split_last: bool = False, split_seq: bool = False):
    """(mesh, PartitionSpec) for a row-wise op (norm, activation) on x of ``shape`` (..., C):
    the first axis split over the batch axes (dp, fsdp); with ``split_last`` (elementwise ops)
    the last axis over tp, as a column-parallel dense leaves its output; with ``split_seq`` (an
    op on the residual stream, a norm) the sequence over ``tpsp_resource`` too: axis 1 of a
    (b, s, ..., C) x, the rows of a 2-D one after the batch axes (:func:`seq_view`; dropped
    where it does not divide). None to run unsharded (no MeshResource or mesh, nothing to split,
    or uneven shards)."""
    found = _mesh_axes()
    if found is None or len(shape) < 2:
        return None
    mesh, batch, tp, seq = found
    tp = tp if split_last else ()
    seq = seq if split_seq and not split_last else ()
    if seq and not seq_view(shape[:-1], _axis_size(mesh, batch), _axis_size(mesh, seq)):
        seq = ()
    if not batch and not tp and not seq:
        return None
    if shape[0] % _axis_size(mesh, batch) or shape[-1] % _axis_size(mesh, tp):
        return None
    entry = ShardPlan._entry
    if seq and len(shape) == 2:
        return mesh, P(entry(batch + seq), None)
    if seq:
        return mesh, P(entry(batch), entry(seq), *([None] * (len(shape) - 2)))
    return mesh, P(entry(batch), *([None] * (len(shape) - 2)), entry(tp))


def constrain_sequence(x):
    """``x`` (b, s, ...) pinned to the layout sequence parallelism keeps between blocks, the one
    the ops read and leave (:func:`plan_rows` with ``split_seq``: ``P(batch, tpsp, None...)``):
    a sharding constraint under a MeshResource with ``tpsp_resource`` and a mesh in context, x
    as it is otherwise. What TransformerEngine's ``SEQLEN_TP_AXES`` constraints resolve to under
    its logical axis rules, for the Flax modules' ``enable_sequence_parallel``."""
    found = _mesh_axes()
    plan = plan_rows(x.shape, split_seq=True) if found is not None and found.seq else None
    if plan is None:
        return x
    mesh, spec = plan
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def spec_row_axes(spec) -> tuple:
    """The mesh axes of a :func:`plan_rows` spec that split rows (every entry but the last)."""
    out = []
    for e in tuple(spec)[:-1]:
        out += [] if e is None else ([e] if isinstance(e, str) else list(e))
    return tuple(out)


def plan_heads(batch: int, *heads: int):
    """(mesh, batch entry, head entry) to run a per-(sequence, head) op (attention, its softmax)
    per shard: ``batch`` over the batch axes (dp, fsdp), heads over tp where every count in
    ``heads`` (query heads, kv groups) divides (a column-parallel QKV projection leaves its heads
    so). None to run it as one op: no MeshResource or mesh, nothing to split, or uneven shards."""
    found = _mesh_axes()
    if found is None:
        return None
    mesh, batch_axes, tp, _ = found
    if batch % _axis_size(mesh, batch_axes):
        batch_axes = ()
    if any(h % _axis_size(mesh, tp) for h in heads):
        tp = ()
    if not batch_axes and not tp:
        return None
    return mesh, ShardPlan._entry(batch_axes), ShardPlan._entry(tp)


def batch_shards(batch: int) -> int:
    """How many batch shards :func:`plan_heads` splits ``batch`` into (1: none): the leading size
    of a bias built once per shard (:func:`bias_layout`)."""
    layout = bias_layout(batch)
    return 1 if layout is None else layout[0]


def bias_layout(batch: int, *heads: int):
    """How :func:`plan_heads` lays out an attention bias that is built rather than given (a
    relative position bias): ``(n, mesh, batch entry, head entry)``, one bias per batch shard
    (n of them, 1 where the batch is not split) with its heads split as the attention's; None
    when the attention runs as one op. Built on each device for its own shard
    (:func:`constrain_bias`), its gradient reaches the bias's source before any sum over the mesh."""
    plan = plan_heads(batch, *heads)
    if plan is None:
        return None
    mesh, b, h = plan
    return _axis_size(mesh, () if b is None else ((b,) if isinstance(b, str) else b)), mesh, b, h


def constrain_bias(x, layout):
    """``x`` (n, heads, ...) laid out as :func:`bias_layout` says."""
    _, mesh, b, h = layout
    spec = P(b, h, *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))


def plan_dense(
    recipe, M: int, K: int, N: int, tp_layout: Optional[str] = None, lead: tuple = ()
) -> Optional[ShardPlan]:
    """The shard plan for a (M, K) x (K, N) dense under ``recipe`` (None: BF16), tp splitting the kernel's N
    or K as ``tp_layout`` says (:func:`resolve_tp_layout`), or None to run unsharded (no
    MeshResource or mesh, already inside a shard_map over these axes, or uneven shards).

    Under ``tpsp_resource`` the plan is sequence-parallel where x's leading axes ``lead``
    (M = prod(lead)) have a :func:`seq_view` whose shards hold whole scaling blocks; elsewhere it
    is the plain tensor-parallel plan."""
    row = resolve_tp_layout(tp_layout) == "row"
    found = _mesh_axes()
    if found is None:
        return None
    mesh, batch, tp, seq = found
    plan = ShardPlan(
        mesh, batch, tp if row else (), () if row else tp, global_mesh_resource().partial_sum_dtype
    )
    if not (plan.batch or plan.k_axes or plan.n_axes):
        return None
    # Every shard must hold whole scaling blocks (MXFP8: 32 along each quantized axis; FP8 block
    # scaling: 128).
    modes = set() if recipe is None else {recipe.scaling_mode(r) for r in ("x", "kernel", "grad")}
    blk = 128 if any(m.is_fp8_block for m in modes) else 32 if ScalingMode.MXFP8_1D_SCALING in modes else 1
    for name, size, axes in (("M (x's rows)", M, plan.batch), ("K", K, plan.k_axes), ("N", N, plan.n_axes)):
        n = _axis_size(mesh, axes)
        if size % n:
            warnings.warn(
                f"lowbit: dense (M, K, N) = ({M}, {K}, {N}): mesh axes {axes} (size {n}) do not "
                f"divide {name} = {size}; this dense runs unsharded (XLA gathers its operands). "
                "Pad the dimension or leave those axes out of the MeshResource.",
                ShardingFallbackWarning,
                stacklevel=3,
            )
            return None
        if (size // n) % blk:
            return None
    rows = seq_view(lead, _axis_size(mesh, batch), _axis_size(mesh, seq), blk) if seq else ()
    if rows and int(np.prod(rows)) == M:
        plan = dataclasses.replace(plan, seq=seq, rows=rows)
    return plan
