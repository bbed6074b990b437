"""Tier a: the engine peeks at the next micro-batch every step and puts it back without nesting iterators."""
from __future__ import annotations

from ds_terapipe.runtime.execution.engine import put_back


def test_put_back_reuses_its_wrapper_so_steps_do_not_nest() -> None:
    source = iter(range(10_000))
    iterator = source
    wrappers = set()
    for expected in range(5_000):   # one peek and put-back per "step", as train_batch does with a stored iterator
        item = next(iterator)
        assert item == expected
        iterator = put_back(item, iterator)
        wrappers.add(id(iterator))
        assert next(iterator) == expected   # the step reads the put-back micro-batch first
    assert len(wrappers) == 1   # one wrapper for the whole run: reads stay O(1), no recursion depth
    assert next(iterator) == 5_000 and list(iterator)[-1] == 9_999
