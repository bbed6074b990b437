"""Tier a: which input embedding vocabulary parallelism splits, decided from the layer specs alone (every rank
the same), and the pieces the engine's passes and the profiler use, in one process.

The engine-level equivalence (tied and untied, every schedule, checkpoints, precisions, freezing, Hugging Face) is in
tests/test_vocab_parallel.py, test_vocab_precision.py, test_freeze_precision.py and test_hf.py.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from ds_terapipe.models.gpt import GPTConfig, gpt_layer_specs
from ds_terapipe.runtime.features.vocab_cost import link_terms, profiling_shard, share_runner, split_embedding_runner
from ds_terapipe.runtime.features.vocab_embedding import SplitTokenEmbedding, lookup_rows, plan_embedding_split
from ds_terapipe.runtime.features.vocab_shard import EmbeddingShard, build_full, split_output_layer

CFG = GPTConfig(num_layers=2, hidden=32, num_heads=4, vocab_size=63, max_seq_len=63, seed=7)


def vocab_layer_specs(cfg: GPTConfig, tied: bool) -> list:
    specs = gpt_layer_specs(cfg)
    return specs if tied else specs[:-1] + [LayerSpec(torch.nn.Linear, cfg.hidden, cfg.vocab_size)]


def _plan(layers: list, stage: int = 0):
    specs, head = split_output_layer(layers)
    full, weight, _ = build_full(head)
    return plan_embedding_split(full, head, specs, lambda layer: stage, tuple(weight.shape))


class TwoTables(torch.nn.Module):
    """Looks its input up in two (V, H) tables: which one is the token embedding is not decidable."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Embedding(vocab, hidden), torch.nn.Embedding(vocab, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.a(ids) + self.b(ids)


class Scaled(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, hidden, max_norm=1.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids)


def test_untied_gpt_embedding_is_split_and_told_from_its_position_table() -> None:
    # max_seq_len == vocab: the position table has the head's shape too; the probe finds the one fed the ids
    split = _plan(vocab_layer_specs(CFG, tied=False))
    assert split is not None and not split.tied
    assert (split.layer, split.path, split.name, split.key) == (0, "wte", "wte.weight", "embed")
    tied = _plan(vocab_layer_specs(CFG, tied=True))
    assert tied is not None and tied.tied and tied.path == "wte"


def test_untied_hugging_face_embedding_is_split() -> None:
    transformers = pytest.importorskip("transformers")
    from ds_terapipe.models.hf import causal_lm_specs

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                      max_position_embeddings=32)
    split = _plan(causal_lm_specs(config, seed=3))
    assert split is not None and not split.tied and (split.key, split.path) == (None, "embed_tokens")


@pytest.mark.parametrize("first, why", [
    (LayerSpec(TwoTables, 63, 32), "2 nn.Embedding modules"),
    (LayerSpec(Scaled, 63, 32), "max_norm"),
    (LayerSpec(torch.nn.Embedding, 63, 32, sparse=True), "max_norm, scale_grad_by_freq or sparse"),
    (LayerSpec(torch.nn.Embedding, 63, 32, scale_grad_by_freq=True), "max_norm, scale_grad_by_freq or sparse"),
    (LayerSpec(torch.nn.Embedding, 10, 32), "is 10 x 32, the output layer 63 x 32"),
    (LayerSpec(torch.nn.Linear, 32, 32), "has no nn.Embedding"),
])
def test_untied_embedding_that_cannot_be_split_stays_whole(first, why, caplog) -> None:
    layers = [first] + gpt_layer_specs(CFG)[1:-1] + [LayerSpec(torch.nn.Linear, 32, 63)]
    with caplog.at_level(logging.INFO, logger="ds_terapipe.runtime.features.vocab_embedding"):
        assert _plan(layers) is None
    assert why in caplog.text and "stays whole on the first stage" in caplog.text


def test_layer_zero_sharing_weights_with_a_later_layer_stays_whole(caplog) -> None:
    from ds_terapipe.models.gpt import GPTEmbedding

    layers = gpt_layer_specs(CFG)[:-1] + [TiedLayerSpec("embed", GPTEmbedding, CFG, tied_weight_attr="wpe.weight"),
                                          LayerSpec(torch.nn.Linear, 32, 63)]
    with caplog.at_level(logging.INFO, logger="ds_terapipe.runtime.features.vocab_embedding"):
        assert _plan(layers) is None
    assert "shares its weights with layers [4]" in caplog.text


def test_a_tied_embedding_is_split_on_the_first_stage_only(caplog) -> None:
    """EF and EB anchor on chunk 0: a tied input embedding another stage holds stays whole (ReduceTiedGrads)."""
    split = _plan(gpt_layer_specs(CFG))
    assert split is not None and split.tied and split.layer == 0 and split.name == "wte.weight"
    with caplog.at_level(logging.WARNING, logger="ds_terapipe.runtime.features.vocab_embedding"):
        assert _plan(gpt_layer_specs(CFG), stage=1) is None
    assert "the input embedding (layer 0) is not on the first stage" in caplog.text


def test_split_embedding_keeps_a_training_units_lookup_for_its_eb_and_frees_an_eval_one() -> None:
    """EF leaves a unit's lookup in ``pending``: in training EB takes it (its ``.grad`` is what EB hands out) and a
    recompute reads it again; a forward-only unit's is freed by its one use."""
    from ds_terapipe.runtime.slicing.context import slice_scope

    stub = SplitTokenEmbedding(torch.nn.Embedding(32, 4), EmbeddingShard(torch.randn(16, 4), 32, 0, 2))
    ids = torch.arange(6).view(1, 6)
    stub.live = True
    ctx = SimpleNamespace(microbatch=0, slice_index=1, start=0, end=6)
    looked = torch.randn(1, 6, 4)
    for training in (True, False):
        stub.pending[(0, 1)] = (ids, looked, training)
        with slice_scope(ctx):
            assert stub(ids) is looked
            assert ((0, 1) in stub.pending) == training
            if training:   # activation checkpointing runs the layer again in the backward
                assert stub(ids) is looked


def test_split_lookup_is_the_whole_lookup_summed_over_shards() -> None:
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(63, 8, generator=gen)
    edges = torch.tensor([[0, 15, 16, 31, 32, 47, 48, 62]])   # every shard's first and last token
    ids = torch.cat([torch.randint(0, 63, (2, 8), generator=gen), edges])
    parts, owners = [], torch.zeros_like(ids)
    for rank in range(4):   # 63 rows over 4 ranks: the last shard holds 15 real rows and one of padding
        shard = EmbeddingShard(torch.zeros(0, 8), 63, rank, 4)
        shard.weight = torch.nn.Parameter(shard.take_rows(table))
        part, _, mask = lookup_rows(shard, ids)
        parts.append(part)
        owners += mask
    torch.testing.assert_close(sum(parts), torch.nn.functional.embedding(ids, table), rtol=0, atol=0)
    assert torch.equal(owners, torch.ones_like(ids))   # each token is one shard's (its gradient goes there only)


def test_split_embedding_under_no_grad_hands_out_no_graph() -> None:
    """A frozen layer 0 runs under no_grad: what the split embedding returns must not carry a gradient back into
    the table (EB would add a frozen use's gradient)."""
    from ds_terapipe.runtime.slicing.context import slice_scope

    shard = EmbeddingShard(torch.randn(16, 4), 32, 0, 2)
    stub = SplitTokenEmbedding(torch.nn.Embedding(32, 4), shard)
    ids = torch.arange(6).view(1, 6)
    stub.live = True
    ctx = SimpleNamespace(microbatch=0, slice_index=0, start=0, end=6)   # what the stand-in reads of a slice
    for grad in (True, False):
        stub.pending[(0, 0)] = (ids, torch.randn(1, 6, 4).requires_grad_(True), False)
        with slice_scope(ctx), torch.set_grad_enabled(grad):
            out = stub(ids)
        assert out.requires_grad == grad


def test_profiling_an_untied_split_times_the_embedding_rows_of_its_own() -> None:
    layers = vocab_layer_specs(CFG, tied=False)
    specs, head_spec = split_output_layer(layers)
    module = SimpleNamespace(_layer_specs=specs, stage_id=1, num_stages=2)
    head, split, table = profiling_shard(module, head_spec, torch.device("cpu"))
    assert split is not None and not split.tied
    assert isinstance(table, EmbeddingShard) and table is not head and tuple(table.weight.shape) == (32, 32)
    assert (table.offset, table.num_valid) == (32, 31)
    layer = specs[0].build()
    split_embedding_runner(layer, split, table)
    assert isinstance(layer.wte, SplitTokenEmbedding) and layer.wte._head[0] is table
    labels = torch.randint(0, 63, (2, 8))
    run, params = share_runner(head, labels, labels.roll(1, dims=1), table)
    assert any(p is table.weight for p in params) and any(p is head.weight for p in params)
    loss, part = run(torch.randn(2, 8, 32))
    (loss + part.sum()).backward()
    assert table.weight.grad is not None and float(table.weight.grad.abs().sum()) > 0


def test_a_link_timed_no_slower_for_the_big_message_is_not_taken_as_free() -> None:
    # 8 Mbit broadcast: 2.0 ms against 0.5 ms for one value -> 1.5 ms of transfer, 5.33 Gbit/s, latency per hop
    assert link_terms(0.5, 2.0, 1, 8e6) == pytest.approx({"latency_ms": 0.5, "gbps": 8e6 / 1.5e6})
    # a stall among the small message's samples: its median above the big one's, or the difference a sliver of it;
    # the whole big time then bounds the link's speed from below (else ~1e7 Gbit/s: the collectives cost nothing)
    for small in (2.5, 1.95):
        assert link_terms(small, 2.0, 2, 8e6)["gbps"] == pytest.approx(8e6 / 2.0e6)
