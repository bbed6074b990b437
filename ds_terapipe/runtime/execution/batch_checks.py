"""Token ids a batch may hold, checked before the step on the stage that reads them.

Why before the step: an input id outside the embedding or a label outside the vocabulary fails inside a layer or
the loss on one stage, in the middle of the schedule (an ``IndexError`` there, a device-side assert on a GPU),
and with vocabulary parallelism a label no shard holds would not fail at all (it would be trained against a
target logit of 0). The first and last stages read each step's micro-batches before it starts (the engine's
batch agreement), so they check them there, and every rank refuses the batch together, naming the value, where
it is and the fix.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["IGNORE_INDEX", "out_of_range_ids"]

#: The label that counts for nothing (``causal_lm_loss``, the Hugging Face convention).
IGNORE_INDEX = -100


def out_of_range_ids(ids: Any, vocab_size: int, what: str, *, ignore_index: Optional[int] = None) -> Optional[str]:
    """Why ``ids`` (a tensor of token ids) cannot be run, or None: a value outside ``[0, vocab_size)`` that is not
    ``ignore_index``. Anything that is not an integer tensor is left to the checks that know its kind."""
    if not torch.is_tensor(ids) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        return None
    bad = (ids < 0) | (ids >= vocab_size)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if not bool(bad.any()):
        return None
    where = tuple(bad.nonzero()[0].tolist())
    ignored = f" and is not {ignore_index} (ignored)" if ignore_index is not None else ""
    return f"{what} {int(ids[where])} at {where} of the next batch is outside the vocabulary [0, {vocab_size}){ignored}"
