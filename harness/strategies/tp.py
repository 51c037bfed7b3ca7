"""Strategies for the tensor-parallel suite: TP MLP training, tied weights, loss_parallel."""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

from hypothesis import strategies as st

from harness.cases.tp import (
    CONVERTS_OUTPUTS,
    PREPARE_STYLES,
    SEQUENCE_DIMS,
    LossCase,
    PrepareCase,
    TiedCase,
    TPCase,
    TransformerCase,
    transformer_param_names,
)
from harness.errors import check_int, check_one_of, require
from harness.strategies._common import factorisations, sampled, seeds, takes_world_size
from harness.strategies.training import DTENSOR_UNSUPPORTED, parity_cases
from specs.chunking import shard_sizes
from specs.placements import Placement, Replicate, Shard

HIDDEN_KINDS = ("even", "uneven", "one")
CLASS_KINDS = ("nonempty", "empty")
LOSS_ERRORS = ("class dim not sharded", "mean on a 2-D mesh", "partial", "plain target")


@cache
def hidden_sizes(tp: int, kind: str) -> tuple[int, ...]:
    """Hidden sizes up to ``3 * tp + 1`` that ``tp`` divides (``even``, from 2) or does not
    (``uneven``); ``one``: the hidden size 1 on one rank (tp.mlp.hidden_one), which over
    more ranks is uneven."""
    check_int("tp", tp)
    check_one_of("kind", kind, HIDDEN_KINDS)
    if kind == "one":
        require(tp == 1, "tp", tp, "1 for hidden size 1 (over several ranks it is uneven)")
        return (1,)
    sizes = range(2, 3 * tp + 2) if kind == "even" else range(1, 3 * tp + 2)
    chosen = tuple(h for h in sizes if (h % tp == 0) == (kind == "even"))
    require(bool(chosen), "tp", tp, f">= 2 for an {kind} hidden size (every size divides by 1)")
    return chosen


def tp_cases(
    world_size: int, *, hidden: str = "even", sequence_parallel: bool | None = None
) -> st.SearchStrategy[TPCase]:
    """A two-Linear MLP with Colwise/Rowwise TP over all ranks, trained with a drawn
    optimizer config; ``hidden`` says whether TP divides its hidden size;
    ``sequence_parallel`` None draws it. Under sequence parallelism the batch splits
    evenly over the ranks. Hidden size 1 (``one``) comes with biases: without them the
    MLP never views a one-element sharded gradient (tp.mlp.hidden_one)."""
    check_int("world_size", world_size)
    hidden_sizes(world_size, hidden)  # validates
    return _tp_cases(world_size, hidden=hidden, sequence_parallel=sequence_parallel)


@takes_world_size
@st.composite
def _tp_cases(
    draw: st.DrawFn, world_size: int, *, hidden: str, sequence_parallel: bool | None
) -> TPCase:
    training = draw(parity_cases(world_size, layout="fsdp_tp", unsupported=DTENSOR_UNSUPPORTED))
    sp = draw(st.booleans()) if sequence_parallel is None else sequence_parallel
    d_in, _, d_out = training.dims
    dims = (d_in, draw(sampled(hidden_sizes(world_size, hidden))), d_out)
    rows = world_size * draw(st.integers(1, 3)) if sp else draw(st.integers(1, 2 * world_size + 1))
    training = dataclasses.replace(
        training,
        mesh_shape=(1, world_size),
        dims=dims,
        batch_per_rank=rows,
        bias=training.bias or hidden == "one",
    )
    return TPCase(sequence_parallel=sp, training=training, local_output=draw(st.booleans()))


@takes_world_size
@st.composite
def tied_cases(draw: st.DrawFn, world_size: int) -> TiedCase:
    """The embedding dim is a multiple of the TP degree (an uneven one fails like
    tp.mlp.uneven_hidden: the Rowwise input is assumed even)."""
    return TiedCase(
        vocab=draw(st.integers(1, 2 * world_size + 1)),
        dim=world_size * draw(st.integers(1, 3)),
        tokens=draw(st.integers(1, 6)),
        dtype=draw(sampled(("float64", "float32"))),
        seed=draw(seeds()),
    )


@cache
def class_counts(tp: int, kind: str) -> tuple[int, ...]:
    """Class counts up to ``3 * tp + 1`` whose ``Shard`` over ``tp`` ranks leaves no rank
    empty (``nonempty``) or some rank empty (``empty``)."""
    check_int("tp", tp)
    check_one_of("kind", kind, CLASS_KINDS)
    counts = tuple(
        c for c in range(1, 3 * tp + 2) if (0 in shard_sizes(c, tp)) == (kind == "empty")
    )
    require(bool(counts), "tp", tp, f">= 2 for an {kind} class count (a rank without classes)")
    return counts


def loss_cases(
    world_size: int, *, mesh_ndim: int, classes: str = "nonempty"
) -> st.SearchStrategy[LossCase]:
    """Inputs sharded on the class dim by one mesh axis; on a 2-D mesh the other axis
    shards the batch, the extra dim of a 3-D input, or replicates. Reductions: all three
    on a 1-D mesh, ``none`` and ``sum`` on a 2-D one (``mean`` is rejected there)."""
    check_int("world_size", world_size)
    check_one_of("mesh_ndim", mesh_ndim, (1, 2))
    check_one_of("classes", classes, CLASS_KINDS)
    return _loss_cases(world_size, mesh_ndim=mesh_ndim, classes=classes)


def _meshes(world_size: int, ndim: int) -> tuple[tuple[int, ...], ...]:
    return tuple(s for s in factorisations(world_size, ndim) if len(s) == ndim)


@takes_world_size
@st.composite
def _loss_cases(draw: st.DrawFn, world_size: int, *, mesh_ndim: int, classes: str) -> LossCase:
    mesh = draw(sampled(_meshes(world_size, mesh_ndim)))
    tp = draw(st.integers(0, mesh_ndim - 1))
    if classes == "empty" and mesh[tp] == 1:
        mesh = mesh[::-1]  # the class axis needs several ranks to leave one empty
    ndim = draw(st.integers(2, 3))
    placements: list[int | None] = [None] * mesh_ndim
    placements[tp] = 1
    if mesh_ndim == 2:
        placements[1 - tp] = draw(sampled((None, 0, 2) if ndim == 3 else (None, 0)))
    shape = [draw(st.integers(1, 6)), draw(sampled(class_counts(mesh[tp], classes)))]
    shape += [draw(st.integers(1, 4))] * (ndim - 2)
    reduction = draw(sampled(("none", "mean", "sum") if mesh_ndim == 1 else ("none", "sum")))
    return LossCase(
        mesh_shape=mesh,
        placements=tuple(placements),
        shape=tuple(shape),
        weighted=draw(st.booleans()),
        reduction=reduction,
        replicated_grad_output=reduction == "none" and draw(st.booleans()),
        dtype=draw(sampled(("float64", "float32"))),
        seed=draw(seeds()),
    )


@takes_world_size
@st.composite
def loss_error_cases(draw: st.DrawFn, world_size: int) -> tuple[str, LossCase]:
    """A layout loss_parallel must refuse, and which rule it breaks (``LOSS_ERRORS``)."""
    error = draw(sampled(LOSS_ERRORS))
    mesh_ndim = 1 if error == "class dim not sharded" and draw(st.booleans()) else 2
    case = draw(loss_cases(world_size, mesh_ndim=mesh_ndim))
    tp = case.placements.index(1)
    placements: list[int | str | None] = list(case.placements)
    reduction, plain = case.reduction, False
    if error == "class dim not sharded":
        placements[tp] = draw(sampled((0, 2) if len(case.shape) == 3 else (0,)))
    elif error == "mean on a 2-D mesh":
        reduction = "mean"
    elif error == "partial":
        placements[1 - tp] = "partial"
    else:
        placements[1 - tp], plain = 0, True
    case = dataclasses.replace(
        case,
        placements=tuple(placements),
        reduction=reduction,
        replicated_grad_output=False,
        target_plain=plain,
    )
    return error, case


@takes_world_size
@st.composite
def transformer_cases(draw: st.DrawFn, world_size: int, *, frozen: bool = False) -> TransformerCase:
    """The Transformer of tp.transformer.* over all ranks: heads, vocab and (under sequence
    parallelism) the sequence split evenly over the TP degree, as upstream's plan needs.
    float32 runs one step (as upstream does): beyond it, rounding amplified by Adam's
    first update feeds every later output. ``frozen``: a non-empty drawn subset of the
    parameters requires grad, else all. Sharded dims (vocab, model dim, sequence under
    SP) have at least 2 entries: DTensor cannot view a sharded dim of size 1 away
    (tp.mlp.hidden_one)."""
    sp = draw(st.booleans())
    dtype = draw(sampled(("float64", "float32")))
    n_heads = world_size * draw(st.integers(1, 2))
    n_layers = draw(st.integers(1, 2))
    tying = draw(st.booleans())
    trainable = None
    if frozen:
        names = transformer_param_names(n_layers, tying)
        chosen = draw(st.sets(sampled(names), min_size=1, max_size=len(names)))
        trainable = tuple(n for n in names if n in chosen)
    return TransformerCase(
        sequence_parallel=sp,
        tp=world_size,
        vocab=max(2, world_size) * draw(st.integers(1, 2)),
        dim=n_heads * draw(st.integers(1 if n_heads > 1 else 2, 2)),
        n_heads=n_heads,
        n_layers=n_layers,
        seq_len=world_size * draw(st.integers(1, 2))
        if sp
        else draw(st.integers(1, 2 * world_size)),
        batch=draw(st.integers(1, 2)),
        weight_tying=tying,
        trainable=trainable,
        lr=draw(sampled((0.01, 0.25))),
        foreach=draw(st.booleans()),
        steps=draw(st.integers(1, 3)) if dtype == "float64" else 1,
        dtype=dtype,
        seed=draw(seeds()),
        **_with_loss(draw, draw(_plan_options(sp))),
    )


def _with_loss(draw: st.DrawFn, options: dict[str, Any]) -> dict[str, Any]:
    """loss_parallel takes the logits only where the head leaves them vocab-sharded."""
    return {**options, "parallel_loss": options["sharded_head"] and draw(st.booleans())}


@cache
def _plan_options(sp: bool) -> st.SearchStrategy[dict[str, Any]]:
    """How the plan is spelled (``cases.tp.PLAN_OPTIONS``): the sequence-parallel ones
    only under sequence parallelism."""
    sp_only = st.booleans() if sp else st.just(False)
    return st.fixed_dictionaries(
        {
            "wildcard_plan": st.booleans(),
            "sharded_head": st.booleans(),
            "norm_local_output": sp_only,
            "sequence_dim": sampled(SEQUENCE_DIMS) if sp else st.none(),
            "prepare_input_output": sp_only,
            "local_attention_input": sp_only,
            "src_data_rank": sampled((0, None)),
        }
    )


@cache
def _placements(ndim: int) -> st.SearchStrategy[Placement]:
    """Replicate, or Shard of any dim of an ``ndim``-D tensor, negative spellings too."""
    shards = [Shard(d) for d in range(-ndim, ndim)]
    return sampled((Replicate(), *shards))


def _kwarg_layouts(
    placements: st.SearchStrategy[Placement], converts: bool
) -> st.SearchStrategy[tuple[Placement, Placement] | None]:
    """The keyword input's (given, desired) layouts: always where the style converts inputs
    (a tensor left as it is is ``x``'s None), else how it is fed, None for whole."""
    if converts:
        return st.tuples(placements, placements)
    return st.none() | placements.map(lambda p: (p, p))


@takes_world_size
@st.composite
def prepare_cases(draw: st.DrawFn, world_size: int) -> PrepareCase:
    """A prepare style with drawn layouts around ``SquareEach``: every dim splits evenly
    over the ranks (a local input is made a DTensor without its global shape, which
    assumes even pieces); a local output's layout is declared as the one it has (or
    None), the desired ones anything."""
    style = draw(sampled(PREPARE_STYLES))
    shape = tuple(world_size * draw(st.integers(1, 2)) for _ in range(draw(st.integers(1, 3))))
    placements = _placements(len(shape))
    converts = style != "output"
    sequence = style == "sequence"
    shards = tuple(Shard(d) for d in range(-len(shape), len(shape)))
    given = draw(sampled(shards) if sequence else st.none() | placements)
    keyword = not sequence and draw(st.booleans())
    redistributes = converts and not sequence and given is not None
    left = (None, None)[: 1 + keyword] if style in CONVERTS_OUTPUTS else ()  # replaced below
    case = PrepareCase(
        style=style,
        tp=world_size,
        shape=shape,
        keyword=keyword,
        input_layout=given,
        desired_input_layout=draw(placements) if redistributes else given,
        kwarg_layouts=draw(_kwarg_layouts(placements, converts)) if keyword else None,
        use_local_input=converts and draw(st.booleans()),
        output_layouts=left,
        desired_output_layouts=tuple(Replicate() for _ in left),
        use_local_output=False,
        bare=draw(st.booleans()),
        named_mesh=draw(st.booleans()),
        dtype=draw(sampled(("float64", "float32"))),
        seed=draw(seeds()),
    )
    if style not in CONVERTS_OUTPUTS:
        return case
    outputs = case.module_outputs()
    return dataclasses.replace(
        case,
        output_layouts=tuple(draw(st.sampled_from((None, o.placement))) for o in outputs),
        desired_output_layouts=tuple(draw(placements) for _ in outputs),
        use_local_output=draw(st.booleans()),
    )
