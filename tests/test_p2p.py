"""Tier a, one process: what ``SliceP2P`` (runtime/execution/p2p.py) puts on the wire between two stages and
reads back, over a loopback that stands in for gloo's ``isend``/``irecv`` (the transfers themselves, deadlines
and faults are tier b: tests/test_fault_exit.py and every launch)."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from ds_terapipe.runtime.execution import p2p


class _Done:
    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@pytest.fixture
def loopback(monkeypatch) -> deque:
    """Messages in send order; a receive takes the oldest, which must fit its buffer."""
    wire: deque = deque()

    def isend(tensor: torch.Tensor, dst: int) -> _Done:
        wire.append((dst, tensor.clone()))
        return _Done()

    def irecv(buf: torch.Tensor, src: int) -> _Done:
        _, sent = wire.popleft()
        assert sent.shape == buf.shape and sent.dtype == buf.dtype, (sent.shape, sent.dtype, buf.shape, buf.dtype)
        buf.copy_(sent)
        return _Done()

    monkeypatch.setattr(p2p.dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(p2p.dist, "isend", isend)
    monkeypatch.setattr(p2p.dist, "irecv", irecv)
    return wire


def test_a_group_of_tensors_arrives_with_its_shapes_dtypes_and_values(loopback) -> None:
    """With a header the receiver learns each tensor's shape and dtype; a bool tensor travels as uint8 and is bool
    again on arrival; gradients of one's own outputs come back without a header, shaped like them."""
    link = p2p.SliceP2P([0, 1], torch.device("cpu"), timeout_s=5)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, 4, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, 50, (2, 3), generator=gen)
    mask = torch.rand(2, 3, generator=gen) > 0.5
    link.send([hidden, ids, mask], 1, "activations", header=True)
    assert [dst for dst, _ in loopback] == [1, 1, 1, 1]   # the header, then the three tensors, to stage 1's rank
    got = link.recv(1, "activations")
    assert [(t.dtype, tuple(t.shape)) for t in got] == [(torch.bfloat16, (2, 3, 4)), (torch.int64, (2, 3)),
                                                         (torch.bool, (2, 3))]
    for sent, received in zip((hidden, ids, mask), got):
        assert torch.equal(sent, received)
    grad = torch.randn(2, 3, 4, generator=gen)
    link.send([grad], 0, "gradients", header=False)
    assert torch.equal(link.recv_like([torch.empty(2, 3, 4)], 0, "gradients")[0], grad)
    assert not loopback
