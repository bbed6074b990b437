"""An engine the script drops is freed: no reference DeepSpeed makes to it from a cycle the collector cannot see.

Why: Python's collector frees a cycle only when it can see every reference into it. A reference held by an autograd
node (a hook on a parameter's gradient accumulation, a hook on a graph's output) lives in C++, so a cycle through
one stays alive for the life of the process, and with it the engine's model, optimizer state and buffers. DeepSpeed
0.19.8 makes two such cycles around an engine:

* its forward hooks a stage's outputs with closures over the engine; the graph behind the last stage's loss holds
  them. The engine keeps the value of the loss, never its spent graph (``TokenPipelineEngine._exec_backward_pass``).
* its ZeRO optimizer (``DeepSpeedZeroOptimizer``) hooks every parameter's gradient accumulation with closures over
  itself, and the engine registers its ``_backward_post_hook`` (a bound method: the engine) with the optimizer.
  :func:`hold_engine_weakly` replaces that registration by one that calls the engine through a weak reference.
  Dropped, the engine is then freed, and DeepSpeed's ``__del__`` runs ``destroy()``, which removes the optimizer's
  hooks, so the optimizer is freed too.

``engine.destroy()`` frees all of it as well; DeepSpeed's own ``PipelineEngine`` stays alive after ``del engine``
(docs/training.md).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

__all__ = ["hold_engine_weakly"]


def _weakly_bound(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (bound) called through a weak reference to its object: nothing once the object is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)

    return call


def hold_engine_weakly(optimizer: Any, hook: Callable[[], Any]) -> bool:
    """Make ``optimizer``'s reference to ``hook`` (the engine's bound ``_backward_post_hook``) a weak one (see the
    module docstring); False where the optimizer holds no such hook (no ZeRO optimizer, or a DeepSpeed without
    the registry)."""
    hooks = getattr(optimizer, "_grad_acc_post_hooks", None)
    if not hooks or not hasattr(optimizer, "register_grad_acc_post_hook") or not any(h == hook for h in hooks):
        return False
    weak = _weakly_bound(hook)
    replaced = [weak if h == hook else h for h in hooks]   # in their order
    optimizer.unregister_grad_acc_post_hooks()
    for h in replaced:
        optimizer.register_grad_acc_post_hook(h)
    return True
