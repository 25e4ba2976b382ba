"""The training loop keeps the garbage collector off the model's objects, and lets go after."""

from __future__ import annotations

import gc

from plora.train.heap import frozen_heap


def test_frozen_heap_freezes_what_exists_and_unfreezes_on_exit():
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with frozen_heap():  # re-entrant: the inner exit keeps the freeze
            pass
        # still frozen (an unfreeze empties the permanent generation); a thread another test
        # left running may free a few frozen objects meanwhile, which leave it
        assert frozen - 1000 < gc.get_freeze_count() <= frozen
        garbage = []
        garbage.append(garbage)  # a cycle made inside is still collectable
        del garbage
        assert gc.collect() >= 1
    assert gc.get_freeze_count() == 0


def test_frozen_heap_unfreezes_when_the_loop_raises():
    try:
        with frozen_heap():
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0
