"""What a run of train / checkpoint / reload / resize actions leaves behind (torch-free).

A resumed run trains with interruptions: ``("train", k)`` runs the next ``k`` steps,
``("checkpoint", 0)`` saves, ``("reload", 0)`` rebuilds the model and optimizer from the
latest checkpoint on the same ranks, ``("resize", m)`` does so on ``m`` ranks. A reload
loses the steps since the checkpoint it loads (as a crash would) and they run again, on the
same batches: batches are indexed by step. With no checkpoint yet, a reload starts again
from the seeded initial state.

``plan`` splits the actions into the phases one World runs in one call, and gives the world
size of every step that survives to the end: uninterrupted training with that schedule must
end in the resumed run's state.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import check_int, check_one_of

ACTIONS = ("train", "checkpoint", "reload", "resize")


@dataclass(frozen=True)
class Resolved:
    """An action of a phase with what the ranks need to run it."""

    kind: str
    """``train``, ``checkpoint`` or ``reload``."""
    checkpoint: int | None
    """checkpoint: the index it is saved under; reload: the index loaded, None for the
    seeded initial state; train: None."""
    steps: tuple[int, int]
    """train: the step indices run, ``range(*steps)``; else ``(s, s)``, s the step count
    after the action."""


@dataclass(frozen=True)
class Phase:
    """What one World of ``world_size`` ranks runs in one call: start from checkpoint
    ``restore`` (None: the seeded initial state) at step ``first_step``, then ``actions``."""

    world_size: int
    restore: int | None
    first_step: int
    actions: tuple[Resolved, ...]


@dataclass(frozen=True)
class _Saved:
    index: int | None
    step: int
    history: tuple[int, ...]


def plan(
    start: int, actions: tuple[tuple[str, int], ...]
) -> tuple[tuple[Phase, ...], tuple[int, ...]]:
    """The phases of the resumed run, and the world size of each step that survives."""
    check_int("start", start)
    phases: list[Phase] = []
    world, restore, first = start, None, 0
    current: list[Resolved] = []
    step, history = 0, tuple[int, ...]()
    latest, saved = _Saved(None, 0, ()), 0
    for index, (kind, arg) in enumerate(actions):
        _check_action(index, kind, arg)
        if kind == "train":
            current.append(Resolved("train", None, (step, step + arg)))
            step, history = step + arg, history + (world,) * arg
        elif kind == "checkpoint":
            current.append(Resolved("checkpoint", saved, (step, step)))
            latest, saved = _Saved(saved, step, history), saved + 1
        elif kind == "reload":
            step, history = latest.step, latest.history
            current.append(Resolved("reload", latest.index, (step, step)))
        else:
            phases.append(Phase(world, restore, first, tuple(current)))
            world, restore, first, current = arg, latest.index, latest.step, []
            step, history = latest.step, latest.history
    phases.append(Phase(world, restore, first, tuple(current)))
    return tuple(phases), history


def segments(history: tuple[int, ...], final: int) -> tuple[tuple[int, int, int], ...]:
    """Uninterrupted training for ``history`` as ``(world_size, first, stop)`` runs of
    steps on one world size; no surviving step is one empty run on ``final`` ranks."""
    check_int("final", final)
    runs: list[tuple[int, int, int]] = []
    for step, world in enumerate(history):
        check_int(f"history[{step}]", world)
        if runs and runs[-1][0] == world:
            runs[-1] = (world, runs[-1][1], step + 1)
        else:
            runs.append((world, step, step + 1))
    return tuple(runs) or ((final, 0, 0),)


def _check_action(index: int, kind: str, arg: int) -> None:
    """``kind`` is an action; a train's step count and a resize's world size are >= 1."""
    check_one_of(f"actions[{index}][0]", kind, ACTIONS)
    if kind in ("train", "resize"):
        check_int(f"actions[{index}][1]", arg)


def step_after(start: int, actions: tuple[tuple[str, int], ...]) -> int:
    """The step count of the run's state after ``actions``."""
    phases, _ = plan(start, actions)
    last = phases[-1]
    return last.actions[-1].steps[1] if last.actions else last.first_step


# --- a state dict taken inside a training step ------------------------------------------------

MID_STEP_POINTS = ("between_steps", "after_zero_grad", "after_forward", "after_backward")
"""Where in step ``s`` (``zero_grad(); loss = loss_fn(model(x_s)); loss.backward();
optimizer.step()``) a state dict is taken: before its ``zero_grad`` (the gradients of step
``s - 1`` still held), after it, after the forward (the activations held; parameters left
unsharded by ``reshard_after_forward=False``), after the backward (gradients held, the
optimizer not yet stepped). After ``step()`` is between steps ``s`` and ``s + 1``."""


def resume_step(step: int, point: str) -> int:
    """The first step a run resumed from a state dict taken at ``point`` of ``step`` runs:
    ``step`` itself, whole. A state dict holds parameters, buffers and optimizer state,
    never gradients or activations, and at every point the optimizer has yet to take the
    step: what the step did before the point is lost and done again, on the same batch
    (``zero_grad`` of a fresh optimizer finds nothing to clear)."""
    check_int("step", step, 0)
    check_one_of("point", point, MID_STEP_POINTS)
    return step


def optimizer_is_empty(step: int, point: str) -> bool:
    """Whether the optimizer holds no state at ``point`` of ``step``: it has never stepped
    (step 0). SGD with momentum, Adam and AdamW create their state in their first ``step()``."""
    resume_step(step, point)
    return step == 0


def gradients_held(step: int, point: str, *, set_to_none: bool = True) -> bool:
    """Whether parameters hold gradients at ``point`` of ``step``: after the backward, and
    once a backward has run (step 1 on) before ``zero_grad`` or, when ``zero_grad`` keeps
    them as zeros (``set_to_none=False``), at every point."""
    resume_step(step, point)
    kept = point == "between_steps" or not set_to_none
    return point == "after_backward" or (step > 0 and kept)


def initialises_optimizer(step: int, point: str) -> bool:
    """Whether taking the optimizer state dict at ``point`` of ``step`` makes
    ``torch.distributed.checkpoint.state_dict`` create the optimizer's state with a zero-lr
    step (``_init_optim_state``: no state and no gradients), the known deviation of spec
    state_dict.optim.get_has_no_side_effect."""
    return optimizer_is_empty(step, point) and not gradients_held(step, point)
