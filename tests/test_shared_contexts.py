"""harness.torchkit.shared_contexts: a process-wide context entered once, whatever the rank
threads."""

from __future__ import annotations

import contextlib
import threading

import pytest

from harness import open_world
from harness.torchkit import shared_contexts


def test_the_first_user_enters_and_the_last_leaves():
    events: list[str] = []

    @contextlib.contextmanager
    def global_switch():
        events.append("enter")
        yield
        events.append("exit")

    inside, release = threading.Barrier(3), threading.Event()

    def user():
        with shared_contexts.shared("switch", global_switch):
            inside.wait()
            release.wait()

    threads = [threading.Thread(target=user) for _ in range(2)]
    for thread in threads:
        thread.start()
    inside.wait()
    assert events == ["enter"] and shared_contexts.users("switch") == 2
    release.set()
    for thread in threads:
        thread.join()
    assert events == ["enter", "exit"] and shared_contexts.users("switch") == 0


def test_an_exception_inside_still_leaves():
    events: list[str] = []

    @contextlib.contextmanager
    def global_switch():
        events.append("enter")
        yield
        events.append("exit")

    with pytest.raises(KeyError), shared_contexts.shared("switch", global_switch):
        raise KeyError("x")
    assert events == ["enter", "exit"] and shared_contexts.users("switch") == 0


def _cross_entropy_under_loss_parallel(ctx):
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard, distribute_tensor

    logits = torch.arange(12, dtype=torch.float64).reshape(3, 4) / 7
    target = torch.tensor([0, 3, 1])
    sharded = distribute_tensor(logits, ctx.mesh((ctx.world_size,)), [Shard(1)])
    with shared_contexts.loss_parallel():
        loss = F.cross_entropy(sharded, target)
    return loss.full_tensor().item(), F.cross_entropy(logits, target).item()


def test_rank_threads_use_loss_parallel_at_once():
    with open_world("threads", world_size=2) as world:
        for _ in range(3):
            for got, want in world.run(_cross_entropy_under_loss_parallel):
                assert got == pytest.approx(want, rel=1e-12)
    assert shared_contexts.users("loss_parallel") == 0
