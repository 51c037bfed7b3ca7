"""Cases of the tensor-parallel properties: TP plans, tied weights, loss_parallel, a
Transformer. Training cases wrap a ``ParityCase``, as HSDP's do."""

from __future__ import annotations

from dataclasses import dataclass, fields

from harness.cases.training import ParityCase
from harness.errors import check_one_of, check_subset, fail, require
from specs.placements import Partial, Placement, Replicate, Shard


@dataclass(frozen=True)
class TPCase:
    """Colwise/Rowwise tensor parallelism of the MLP ``training.dims`` (two Linears) over all
    ranks, with or without sequence parallelism, trained as ``training`` says.

    ``training`` is a ParityCase of layout ``fsdp_tp`` on mesh ``(1, tp)``: FSDP+TP without
    data parallelism, which is plain TP; every rank's batch is the global batch of
    ``training.batch_per_rank`` rows, split by rows over the ranks under sequence
    parallelism.
    """

    sequence_parallel: bool
    training: ParityCase
    local_output: bool = True
    """``RowwiseParallel(use_local_output=...)``: False leaves the model's output a DTensor
    (Replicate, or Shard(0) under sequence parallelism), which the loss receives with a
    DTensor target of the same layout."""

    def __post_init__(self) -> None:
        check_one_of("training.layout", self.training.layout, ("fsdp_tp",))
        dp, tp = self.training.mesh_shape
        plain_tp = dp == 1 and len(self.training.dims) == 3
        require(plain_tp, "training", self.training, "a two-Linear MLP on a (1, tp) mesh")
        rows = self.training.batch_per_rank
        splits = not self.sequence_parallel or rows % tp == 0
        expected = f"a multiple of tp={tp} under sequence parallelism (split evenly)"
        require(splits, "training.batch_per_rank", rows, expected)

    @property
    def tp(self) -> int:
        return self.training.mesh_shape[1]

    def call(self) -> str:
        t = self.training
        plan = "sequence-parallel " if self.sequence_parallel else ""
        rowwise = "" if self.local_output else "(use_local_output=False)"
        return (
            f"{plan}Colwise/Rowwise{rowwise} TP over {self.tp} rank(s), MLP{t.dims} "
            f"bias={t.bias} "
            f"{t.dtype}, batch {t.batch_per_rank}, {t.steps} step(s) of {t.optim.describe()}"
        )


@dataclass(frozen=True)
class TiedCase:
    """Embedding(vocab, dim) (Colwise) feeding Linear(dim, vocab) (Rowwise), weights tied."""

    vocab: int
    dim: int
    tokens: int
    dtype: str
    seed: int

    def call(self) -> str:
        return (
            f"Embedding({self.vocab}, {self.dim}) -> Linear({self.dim}, {self.vocab}), "
            f"fc.weight = embedding.weight, {self.tokens} token(s), {self.dtype}"
        )


LOSS_REDUCTIONS = ("none", "mean", "sum")


@dataclass(frozen=True)
class LossCase:
    """``F.cross_entropy`` under ``loss_parallel()`` of an input of ``shape`` (batch, classes
    [, extra]) distributed over a mesh of ``mesh_shape``.

    ``placements`` has one entry per mesh axis: an int shards that tensor dim, None
    replicates, ``"partial"`` holds a ``Partial('sum')`` contribution; the target gets the
    input's placements with the class dim removed (Replicate on the axis that shards
    classes), as a DTensor unless ``target_plain``.
    """

    mesh_shape: tuple[int, ...]
    placements: tuple[int | str | None, ...]
    shape: tuple[int, ...]
    weighted: bool
    reduction: str
    replicated_grad_output: bool
    """Backward through ``torch.autograd.grad`` with a fully replicated ``grad_output``
    instead of ``loss.sum().backward()`` (reduction ``none``)."""
    dtype: str
    seed: int
    target_plain: bool = False

    def __post_init__(self) -> None:
        check_one_of("reduction", self.reduction, LOSS_REDUCTIONS)
        for p in self.placements:
            if not (p is None or p == "partial" or (isinstance(p, int) and p >= 0)):
                fail("placements", self.placements, f"None, 'partial' or dims >= 0, not {p!r}")
        one_each = len(self.placements) == len(self.mesh_shape)
        expected = f"one placement per axis of mesh_shape={self.mesh_shape!r}"
        require(one_each, "placements", self.placements, expected)

    @property
    def classes(self) -> int:
        return self.shape[1]

    def spec_placements(self) -> tuple[Placement, ...]:
        """The placements in the reference model's spelling."""
        return tuple(
            Replicate() if p is None else Partial("sum") if p == "partial" else Shard(int(p))
            for p in self.placements
        )

    def call(self) -> str:
        names = ", ".join(_placement_name(p) for p in self.placements)
        weight = ", weight" if self.weighted else ""
        grad = ", replicated grad_output" if self.replicated_grad_output else ""
        target = ", plain target" if self.target_plain else ""
        return (
            f"loss_parallel: cross_entropy(input {self.shape} {self.dtype} on mesh "
            f"{self.mesh_shape} [{names}]{weight}{target}, reduction={self.reduction!r}{grad})"
        )


def _placement_name(p: int | str | None) -> str:
    if p is None:
        return "Replicate()"
    return "Partial('sum')" if p == "partial" else f"Shard({p})"


def transformer_param_names(n_layers: int, weight_tying: bool) -> tuple[str, ...]:
    """``named_parameters()`` of ``harness.torchkit.models.Transformer``, in registration order (a
    tied output weight is the token embedding's)."""
    block = (
        "attention_norm.weight",
        "attention_norm.bias",
        "attention.wq.weight",
        "attention.wk.weight",
        "attention.wv.weight",
        "attention.wo.weight",
        "ffn_norm.weight",
        "ffn_norm.bias",
        "feed_forward.w1.weight",
        "feed_forward.w1.bias",
        "feed_forward.w2.weight",
        "feed_forward.w2.bias",
    )
    names = ["tok_embeddings.weight", "pos_embeddings.weight"]
    names += [f"layers.{i}.{name}" for i in range(n_layers) for name in block]
    names += ["norm.weight", "norm.bias"]
    if not weight_tying:
        names.append("output.weight")
    return tuple(names)


SEQUENCE_DIMS = (None, 1, -2)
"""How a ``TransformerCase`` spells ``SequenceParallel``'s sequence dim (None: not at all)."""

PLAN_OPTIONS = (
    *("wildcard_plan", "sharded_head", "norm_local_output", "sequence_dim"),
    *("prepare_input_output", "local_attention_input", "src_data_rank", "parallel_loss"),
)
"""The ways of spelling the tensor-parallel plan a ``TransformerCase`` draws (its fields)."""


@dataclass(frozen=True)
class TransformerCase:
    """``harness.torchkit.models.Transformer`` under upstream's tensor-parallel plan over ``tp``
    ranks (with or without sequence parallelism), trained ``steps`` steps of Adam on the
    sum of its output; only the ``trainable`` parameters require grad (None: all)."""

    sequence_parallel: bool
    tp: int
    vocab: int
    dim: int
    n_heads: int
    n_layers: int
    seq_len: int
    batch: int
    weight_tying: bool
    trainable: tuple[str, ...] | None
    lr: float
    foreach: bool
    steps: int
    dtype: str
    seed: int
    eps: float = 1e-3
    """Adam's eps: a rounding difference in a gradient moves Adam's first update by at
    most ``lr / eps`` times as much (at torch's 1e-8, near-zero gradients turn any
    difference into a jump of up to ``2 * lr``)."""
    wildcard_plan: bool = False
    """The blocks' plan given once at the root with ``layers.*.`` keys, instead of one
    ``parallelize_module`` call per block."""
    sharded_head: bool = False
    """The output head leaves its output a vocab-sharded DTensor (``ColwiseParallel(
    output_layouts=Shard(-1), use_local_output=False)``) instead of gathering it."""
    norm_local_output: bool = False
    """Under sequence parallelism, the norms hand on local tensors
    (``SequenceParallel(use_local_output=True)``)."""
    sequence_dim: int | None = None
    """Under sequence parallelism, ``SequenceParallel(sequence_dim=...)`` spelled out: 1, or
    -2, the same dim of the (batch, seq, dim) residual stream counted from the end; None
    leaves torch's default (1)."""
    prepare_input_output: bool = False
    """Under sequence parallelism, the attention's input prepared by
    ``PrepareModuleInputOutput`` (its output declared as the row-wise output it is) instead
    of ``PrepareModuleInput``."""
    local_attention_input: bool = False
    """Under sequence parallelism, the attention's gathered input handed on as the local
    (whole) tensor (``use_local_output`` / ``use_local_input=True`` of its prepare style),
    which the Colwise projections take as Replicate again."""
    src_data_rank: int | None = 0
    """``parallelize_module``'s: rank 0's values broadcast, or (None) each rank's own."""
    parallel_loss: bool = False
    """The sharded head's vocab-sharded DTensor logits go into ``F.cross_entropy`` against
    seeded target tokens under ``loss_parallel()``, instead of the output being summed."""

    def __post_init__(self) -> None:
        tp, heads = self.tp, self.n_heads
        require(heads % tp == 0, "n_heads", heads, f"a multiple of tp={tp} (split evenly)")
        require(self.dim % heads == 0, "dim", self.dim, f"a multiple of n_heads={heads}")
        require(self.vocab % tp == 0, "vocab", self.vocab, f"a multiple of tp={tp} (split evenly)")
        seq_splits = not self.sequence_parallel or self.seq_len % tp == 0
        expected = f"a multiple of tp={tp} under sequence parallelism"
        require(seq_splits, "seq_len", self.seq_len, expected)
        if self.trainable is not None:
            names = transformer_param_names(self.n_layers, self.weight_tying)
            check_subset("trainable", self.trainable, names)
        sp_only = ("norm_local_output", "prepare_input_output", "local_attention_input")
        for name in sp_only:
            turned = getattr(self, name)
            require(self.sequence_parallel or not turned, name, turned, "False without SP")
        check_one_of("sequence_dim", self.sequence_dim, SEQUENCE_DIMS)
        spelled = self.sequence_parallel or self.sequence_dim is None
        require(spelled, "sequence_dim", self.sequence_dim, "None without SP")
        check_one_of("src_data_rank", self.src_data_rank, (0, None))
        sharded = self.sharded_head or not self.parallel_loss
        require(sharded, "parallel_loss", self.parallel_loss, "False without sharded_head")

    @property
    def max_seq_len(self) -> int:
        """The position table: ``seq_len`` rounded up to split evenly (and not down to one
        row) over the TP degree, as the Rowwise position embedding of upstream's plan
        assumes."""
        rows = max(2, self.tp)
        return rows * -(-self.seq_len // rows)

    def requires_grad(self, name: str) -> bool:
        return self.trainable is None or name in self.trainable

    def call(self) -> str:
        plan = "sequence-parallel " if self.sequence_parallel else ""
        tied = ", tied output" if self.weight_tying else ""
        frozen = "" if self.trainable is None else f", trainable only {list(self.trainable)}"
        defaults = {f.name: f.default for f in fields(self)}
        turned = [n for n in PLAN_OPTIONS if getattr(self, n) != defaults[n]]
        options = ", ".join(f"{n}={getattr(self, n)}" for n in turned)
        frozen += f", plan options {options}" if options else ""
        return (
            f"{plan}TP over {self.tp} rank(s) of Transformer(vocab={self.vocab}, "
            f"dim={self.dim}, heads={self.n_heads}, layers={self.n_layers}{tied}) "
            f"{self.dtype}, tokens ({self.batch}, {self.seq_len}), {self.steps} step(s) of "
            f"Adam(lr={self.lr}, eps={self.eps}, foreach={self.foreach}){frozen}"
        )


PREPARE_STYLES = ("input", "output", "input_output", "sequence")
"""``PrepareModuleInput``, ``PrepareModuleOutput``, ``PrepareModuleInputOutput``, and
``SequenceParallel`` (which prepares its module's one input as ``Shard(sequence_dim)``)."""
CONVERTS_OUTPUTS = ("output", "input_output")

Layout = Placement | None
"""A placement a prepare style is given for one tensor; None: the tensor is left as it is."""


@dataclass(frozen=True)
class TensorState:
    """How a tensor reaches a rank: as a DTensor of ``placement`` or as this rank's local
    piece under it (the whole tensor for ``Replicate``)."""

    placement: Placement
    dtensor: bool


@dataclass(frozen=True)
class PrepareCase:
    """``SquareEach`` (``forward(x, *, y=None)``: ``x * x + x``, and ``y * y`` when ``y`` is
    given) under one prepare style over ``tp`` ranks, fed by every rank with its piece of
    the seeded global ``x`` (and ``y``) of ``shape`` under ``input_layout`` (``kwarg_layouts``'
    first), the whole tensor where that is None.

    ``input`` and ``input_output`` convert the inputs (``desired_input_layout``,
    ``use_local_input``, ``kwarg_layouts``: ``y``'s (given, desired) or None for none);
    ``output`` and ``input_output`` convert the outputs (one layout per output, None to
    leave one as it is; a local output's is the layout it has, so it is declared as it is).
    ``sequence``: ``SequenceParallel(sequence_dim=input_layout.dim,
    use_local_output=use_local_input)``, each rank feeding its piece of ``x`` along that dim.
    ``bare``: a single placement given as itself rather than as a one-tuple."""

    style: str
    tp: int
    shape: tuple[int, ...]
    keyword: bool
    input_layout: Layout
    desired_input_layout: Layout
    kwarg_layouts: tuple[Placement, Placement] | None
    use_local_input: bool
    output_layouts: tuple[Layout, ...]
    desired_output_layouts: tuple[Placement, ...]
    use_local_output: bool
    bare: bool
    named_mesh: bool
    """The mesh is the ``tp`` axis of a named (1, tp) mesh (``mesh["tp"]``), else a 1-D one."""
    dtype: str
    seed: int

    def __post_init__(self) -> None:
        check_one_of("style", self.style, PREPARE_STYLES)
        for dim in self.shape:
            require(dim % self.tp == 0, "shape", self.shape, f"dims that tp={self.tp} divides")
        converts_inputs = self.style != "output"
        converts_outputs = self.style in CONVERTS_OUTPUTS
        if self.style == "sequence":
            sequence = isinstance(self.input_layout, Shard) and not self.keyword
            expected = "Shard(sequence_dim) and no keyword input for SequenceParallel"
            require(sequence, "input_layout", self.input_layout, expected)
            same = self.desired_input_layout == self.input_layout
            require(same, "desired_input_layout", self.desired_input_layout, "the input_layout")
        if not converts_inputs:
            unused = self.desired_input_layout != self.input_layout or self.use_local_input
            require(not unused, "style", self.style, "with inputs left as each rank feeds them")
        both = (self.input_layout is None) == (self.desired_input_layout is None)
        require(both, "desired_input_layout", self.desired_input_layout, "None with input_layout")
        kwargs = self.keyword or self.kwarg_layouts is None
        require(kwargs, "kwarg_layouts", self.kwarg_layouts, "None without a keyword input")
        outputs = 2 if self.keyword else 1
        given = len(self.output_layouts) if converts_outputs else outputs
        require(given == outputs, "output_layouts", self.output_layouts, f"{outputs} layout(s)")
        paired = len(self.desired_output_layouts) == len(self.output_layouts)
        expected = "one per output layout"
        require(paired, "desired_output_layouts", self.desired_output_layouts, expected)
        for layout, state in zip(self.output_layouts, self.module_outputs(), strict=False):
            declared = layout is None or layout == state.placement
            require(declared, "output_layouts", self.output_layouts, "the outputs' own layouts")

    def fed(self) -> tuple[Placement, ...]:
        """The layout each rank feeds ``x`` (and ``y``) in."""
        y = () if not self.keyword else (self._given(self.kwarg_layouts),)
        return (self.input_layout or Replicate(), *y)

    @staticmethod
    def _given(layouts: tuple[Placement, Placement] | None) -> Placement:
        return Replicate() if layouts is None else layouts[0]

    def module_inputs(self) -> tuple[TensorState, ...]:
        """What the module receives for ``x`` (and ``y``)."""
        if self.style == "output":
            return tuple(TensorState(fed, False) for fed in self.fed())
        states = [self._prepared(self.input_layout, self.desired_input_layout)]
        if self.keyword:
            given, desired = self.kwarg_layouts or (None, None)
            states.append(self._prepared(given, desired))
        return tuple(states)

    def _prepared(self, given: Layout, desired: Layout) -> TensorState:
        if given is None or desired is None:
            return TensorState(given or Replicate(), False)
        return TensorState(desired, not self.use_local_input)

    def module_outputs(self) -> tuple[TensorState, ...]:
        """``x * x + x`` (and ``y * y``): elementwise, each keeps its input's layout."""
        return self.module_inputs()

    def results(self) -> tuple[TensorState, ...]:
        """What the forward hands back, per output."""
        outputs = self.module_outputs()
        if self.style not in CONVERTS_OUTPUTS:
            return outputs
        return tuple(
            state if layout is None else TensorState(desired, not self.use_local_output)
            for state, layout, desired in zip(
                outputs, self.output_layouts, self.desired_output_layouts, strict=True
            )
        )

    def call(self) -> str:
        return (
            f"parallelize_module(SquareEach(), {self._mesh()}, {self.style_call()}); "
            f"forward({self._inputs()}) over {self.tp} rank(s), {self.dtype}"
        )

    def _mesh(self) -> str:
        if self.named_mesh:
            return f"mesh((1, {self.tp}), ('dp', 'tp'))['tp']"
        return f"mesh(({self.tp},))"

    def _inputs(self) -> str:
        fed = [f"x {self.shape} {_fed(self.input_layout)}"]
        if self.keyword:
            given = self.kwarg_layouts[0] if self.kwarg_layouts else None
            fed.append(f"y={self.shape} {_fed(given)}")
        return ", ".join(fed)

    def style_call(self) -> str:
        """The style as it is constructed."""
        if self.style == "sequence":
            assert isinstance(self.input_layout, Shard)
            dim, local = self.input_layout.dim, self.use_local_input
            return f"SequenceParallel(sequence_dim={dim}, use_local_output={local})"
        options = []
        if self.style != "output":
            options += self._input_options()
        if self.style in CONVERTS_OUTPUTS:
            options.append(f"output_layouts={self._layouts(self.output_layouts)}")
            options.append(f"desired_output_layouts={self._layouts(self.desired_output_layouts)}")
            options.append(f"use_local_output={self.use_local_output}")
        name = {"input": "PrepareModuleInput", "output": "PrepareModuleOutput"}
        return f"{name.get(self.style, 'PrepareModuleInputOutput')}({', '.join(options)})"

    def _input_options(self) -> list[str]:
        options = [
            f"input_layouts={self._layouts((self.input_layout,))}",
            f"desired_input_layouts={self._layouts((self.desired_input_layout,))}",
        ]
        if self.kwarg_layouts is not None:
            given, desired = self.kwarg_layouts
            options.append(f"input_kwarg_layouts={{'y': {_spelled(given)}}}")
            options.append(f"desired_input_kwarg_layouts={{'y': {_spelled(desired)}}}")
        local = "use_local_output" if self.style == "input" else "use_local_input"
        return [*options, f"{local}={self.use_local_input}"]

    def _layouts(self, layouts: tuple[Layout, ...]) -> str:
        if self.bare and len(layouts) == 1 and layouts[0] is not None:
            return _spelled(layouts[0])
        return f"({', '.join(_spelled(p) for p in layouts)}{',' if len(layouts) == 1 else ''})"


def _spelled(layout: Layout) -> str:
    if layout is None:
        return "None"
    return f"Shard({layout.dim})" if isinstance(layout, Shard) else "Replicate()"


def _fed(layout: Layout) -> str:
    return "whole" if layout is None else f"as {_spelled(layout)}"
