"""BatchLoading: the micro-batches a step of the TokenPipelineEngine reads, loaded and checked.

What it owns: ``LoadMicroBatch`` (each micro-batch read once, before its first slice: the inputs on the rank of
the first chunk, the labels on the rank of the last, on the engine's device); the checks a micro-batch passes
before the step starts (token ids and labels inside the vocabulary, ``batch_checks.py``; the position ids of
packed rows); packed rows' documents, from the inputs or slice by slice from received activations; and
``put_back``, which returns the micro-batches peeked before a step to the front of the data iterator.

Why apart from the engine's core: this is the engine's boundary with the caller's data, and every rule here is
about what a batch must look like (each refusal names the rule, the value and the fix), none about running the
schedule. The read-ahead that calls the checks is plan selection's (``plan_selection.py``), since the lengths
it agrees on choose the plan; it runs the checks there so that every rank refuses a bad batch together.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

from ..slicing.documents import Documents, check_position_ids, positions_of
from .batch_checks import IGNORE_INDEX, out_of_range_ids

__all__ = ["BatchLoading", "put_back"]


class _PutBack:
    """An iterator with items put back in front of another iterator (see :func:`put_back`)."""

    def __init__(self, rest: Iterator) -> None:
        self.pending: list[Any] = []
        self.rest = rest

    def __iter__(self) -> "_PutBack":
        return self

    def __next__(self) -> Any:
        return self.pending.pop() if self.pending else next(self.rest)


def put_back(item: Any, iterator: Iterator) -> Iterator:
    """``iterator`` with ``item`` in front. Putting back into an iterator this returned reuses it: the engine's
    stored data iterator is peeked and put back every step, and a new ``itertools.chain`` around the last one
    each time nests one level deeper per step (each read walks every level; CPython crashes past ~200k steps)."""
    if not isinstance(iterator, _PutBack):
        iterator = _PutBack(iterator)
    iterator.pending.append(item)
    return iterator


def _first_tensor(value: Any) -> Optional[torch.Tensor]:
    if torch.is_tensor(value):
        return value
    if isinstance(value, (tuple, list)) and value:
        return _first_tensor(value[0])
    return None


class BatchLoading:
    """The micro-batches a step reads, loaded and checked: a mixin of ``TokenPipelineEngine`` (see the module
    docstring)."""

    def _exec_load_micro_batch(self, buffer_id: int, microbatch: int) -> None:
        batch = self._next_batch()
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError("token pipeline: each batch from the data iterator must be (inputs, labels), got "
                            f"{type(batch).__name__}")
        inputs, labels = batch
        loaded: dict[str, Any] = {}
        if self.is_first_stage():
            if self.terapipe.packed:
                inputs = self._load_documents(inputs, microbatch)
            loaded["inputs"] = self._to_device(inputs, "inputs", microbatch)
        if self.is_last_stage():
            loaded["labels"] = self._to_device(labels, "labels", microbatch)
        self.loaded[microbatch] = loaded

    def _token_ids_problem(self, item: Any) -> Optional[str]:
        """Why a peeked micro-batch's token ids cannot be run, or None (``runtime/execution/batch_checks.py``): on
        the first stage input ids outside the model's vocabulary, on the last stage labels outside it that are not
        -100 (with the project's ``causal_lm_loss`` or vocabulary parallelism, where labels are token ids)."""
        if self._vocab is not None:
            vocab = self._vocab.head.vocab_size
        else:
            vocab = getattr(self.module, "vocab_size", None)
        if vocab is None:
            return None
        if self.is_first_stage():
            ids = item[0][0] if self.terapipe.packed and isinstance(item[0], (tuple, list)) else item[0]
            problem = out_of_range_ids(ids, vocab, "input id")
            if problem is not None:
                return (f"token pipeline: {problem} (the module's vocab_size); fix the data, or build the module "
                        "with the tokenizer's vocabulary size")
        if self.is_last_stage():
            if self._vocab is not None:
                return self._vocab.labels_problem(item[1])
            from ...models.gpt import causal_lm_loss  # models build on runtime: imported when needed

            if self.module.loss_fn is causal_lm_loss:
                problem = out_of_range_ids(item[1], vocab, "label", ignore_index=IGNORE_INDEX)
                if problem is not None:
                    return (f"token pipeline: {problem}; causal_lm_loss would refuse it in the middle of the step: "
                            "fix the labels (-100 for a position that counts for nothing)")
        return None

    def _load_documents(self, inputs: Any, microbatch: int) -> Any:
        """Packed rows: ``(input_ids, position_ids)`` -> the ids, with the micro-batch's documents kept; plain
        ids are one document per row. The position ids were checked before the step (``_documents_problem``)."""
        positions = positions_of(inputs)
        if positions is None:
            got = type(inputs).__name__ if not torch.is_tensor(inputs) else f"a tensor {tuple(inputs.shape)}"
            raise ValueError(f"terapipe.packed: the inputs of micro-batch {microbatch} must be input_ids (batch, "
                             f"seq_len) or (input_ids, position_ids), got {got}; pass ((input_ids, position_ids), "
                             "labels) or set terapipe.packed to false")
        self.documents[microbatch] = Documents(positions.to(self.device, torch.int64).clone())
        return inputs[0] if isinstance(inputs, (tuple, list)) else inputs

    def _documents_problem(self, inputs: Any) -> Optional[str]:
        """Why a micro-batch's position ids cannot be run (None if they can, or rows are not packed):
        checked before the step, so every rank refuses together."""
        if not (isinstance(inputs, (tuple, list)) and len(inputs) == 2):
            return None
        try:
            check_position_ids(inputs[0], inputs[1], "the next batch")
        except ValueError as err:
            return str(err) if self.terapipe.packed else None
        if not self.terapipe.packed and int((inputs[1] == 0).sum()) > inputs[1].shape[0]:
            # position ids that restart: packed rows given to an engine that would hand them to the first layer
            return ("token pipeline: the next batch's inputs are (input_ids, position_ids) of packed documents (the "
                    "position ids restart at 0 inside rows); set \"packed\": true in the terapipe config so "
                    "attention stays within each document, or pass input_ids alone")
        return None

    def _documents_of(self, microbatch: int) -> Documents:
        """The micro-batch's documents on a rank that learns them slice by slice (from received activations)."""
        docs = self.documents.get(microbatch)
        if docs is None:
            docs = Documents.empty(self.micro_batch_size, self.seq_len_of(microbatch), self.device)
            self.documents[microbatch] = docs
        return docs

    def _batch_size_problem(self, first: Optional[torch.Tensor], microbatch: int) -> Optional[str]:
        """Why a peeked micro-batch (its first tensor) cannot run for its number of sequences, or None: stages
        exchange activation shapes once per slice length, so every micro-batch holds ``train_micro_batch_size_per_gpu``
        sequences."""
        if first is None or first.dim() < 2 or first.shape[0] == self.micro_batch_size:
            return None
        return (f"token pipeline: micro-batch {microbatch} of the next batch has {first.shape[0]} sequences, but "
                f"train_micro_batch_size_per_gpu = {self.micro_batch_size}; drop or pad the last incomplete batch "
                "(e.g. DataLoader(drop_last=True))")

    def _to_device(self, value: Any, what: str, microbatch: int = 0) -> Any:
        first = _first_tensor(value)
        if first is None or first.dim() < 2:
            got = None if first is None else tuple(first.shape)
            raise ValueError(f"token pipeline: batch {what} must be (batch, seq_len, ...) tensors; got shape {got} in "
                             f"micro-batch {microbatch}")
        if first.shape[1] != self.seq_len_of(microbatch):
            # Every micro-batch's length was agreed before the step started (read ahead from the iterator).
            raise ValueError(f"token pipeline: micro-batch {microbatch} has {what} of sequence length "
                             f"{first.shape[1]}, but it had {self.seq_len_of(microbatch)} when the step started; "
                             "the data iterator must yield the same batches when read again (no batch may change "
                             "after it is yielded)")
        if first.shape[0] != self.micro_batch_size:
            # Stages exchange activation shapes once per slice length: a micro-batch of another size must stop here.
            raise ValueError(f"token pipeline: a micro-batch of {what} has {first.shape[0]} sequences, but "
                             f"train_micro_batch_size_per_gpu = {self.micro_batch_size}; drop or pad the last "
                             "incomplete batch (e.g. DataLoader(drop_last=True))")
        if torch.is_tensor(value):
            return value.to(self.device).detach()
        return tuple(v.to(self.device).detach() if torch.is_tensor(v) else v for v in value)
