"""The check of one gradient-clipping case of a suite (``clip_result``, tests/suites/common.py), shared by the test
modules whose launches run such cases: the engine clipped every step by the norm of the whole model's gradient, as
the single-process reference's ``torch.nn.utils.clip_grad_norm_`` did, so its parameters end where the reference's
do.
"""

from __future__ import annotations

from typing import Any

import pytest

# The reference's norms must exceed the threshold this many times over at every step: clipping is active, and a
# coefficient from a wrong norm (stage 0's alone: about half here) moves the parameters far past the tolerance.
ACTIVE = 3.0


def assert_clipped_by_the_global_norm(case: dict[str, Any], rank: int, *, tol: float = 1e-5,
                                      norm_tol: float | None = None) -> None:
    """``tol``: the losses' and the parameters' relative error; ``norm_tol``: the reported norm's (default
    ``tol``). Parameters: the worst relative error over this rank's parameters (updates, for bf16)."""
    where = f"{case['case']} rank {rank} (stage {case['stage']})"
    assert case["max_norm"] > 0 and min(case["ref_norms"]) > ACTIVE * case["max_norm"], \
        f"{where}: clipping is not active at every step ({case['ref_norms']} vs {case['max_norm']})"
    assert case["norms"] == pytest.approx(case["ref_norms"], rel=norm_tol or tol), \
        f"{where}: the engine reported gradient norms {case['norms']}, the reference's are {case['ref_norms']}"
    assert case["losses"] == pytest.approx(case["ref_losses"], rel=tol), \
        f"{where}: losses {case['losses']} != reference {case['ref_losses']}"
    assert case["param_rel_err"] <= tol, \
        f"{where}: after {len(case['losses'])} clipped steps {case['param_worst']} off by {case['param_rel_err']}"
