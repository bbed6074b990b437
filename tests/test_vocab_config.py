"""Tier a: the vocab_parallel config key, the module keywords it asks for, and recognising the output layer."""

from __future__ import annotations

import pytest
import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from ds_terapipe import module_chunk_kwargs, parse_terapipe_config
from ds_terapipe.models.gpt import GPTConfig, GPTEmbedding, gpt_layer_specs
from ds_terapipe.runtime.features.vocab_shard import VocabShardHead, build_full, split_output_layer


def test_config_key_and_module_kwargs() -> None:
    cfg = parse_terapipe_config({"terapipe": {"enabled": True, "seq_len": 64, "slices": 4, "vocab_parallel": True}})
    assert cfg.vocab_parallel and module_chunk_kwargs(cfg) == {"vocab_parallel": True}
    assert not parse_terapipe_config({"terapipe": {"enabled": True, "seq_len": 64, "slices": 4}}).vocab_parallel
    # with virtual stages too: the module is built with the schedule's chunks and the vocabulary head
    for name in ("interleaved-1f1b", "looped-bfs", "dualpipev"):
        cfg = parse_terapipe_config({"terapipe": {"enabled": True, "seq_len": 64, "slices": 4, "vocab_parallel": True,
                                                  "schedule": name}})
        assert module_chunk_kwargs(cfg) == {"vocab_parallel": True, "virtual_stages": 2, "schedule": name}


def test_recognises_tied_and_linear_heads() -> None:
    cfg = GPTConfig(num_layers=1, hidden=16, num_heads=2, vocab_size=10, max_seq_len=8)
    rest, spec = split_output_layer(gpt_layer_specs(cfg))
    assert len(rest) == 3 and spec.tied_key == "embed" and spec.weight_name == "wte.weight" and spec.index == 3
    _, weight, bias = build_full(spec)
    assert weight.shape == (10, 16) and bias is None
    rest, spec = split_output_layer(gpt_layer_specs(cfg)[:-1] + [LayerSpec(torch.nn.Linear, 16, 10)])
    assert spec.tied_key is None and spec.bias_name == "bias" and build_full(spec)[2].shape == (10, )
    # a head written as a TiedLayerSpec whose key no other layer uses ties nothing: its weight is its own
    specs = gpt_layer_specs(cfg)
    rest, spec = split_output_layer([LayerSpec(GPTEmbedding, cfg)] + specs[1:])
    assert spec.tied_key is None and spec.weight_name == "wte.weight"


class _Wrapped(torch.nn.Module):
    """An output projection inside a module of its own (as a Hugging Face lm_head is): recognised by structure."""

    def __init__(self, hidden: int, vocab: int, bias: bool = False, extra: bool = False) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=bias)
        self.other = torch.nn.Linear(hidden, hidden) if extra else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(x if self.other is None else self.other(x))


def test_recognises_a_wrapped_projection_by_structure() -> None:
    for bias in (False, True):
        _, spec = split_output_layer([LayerSpec(_Wrapped, 16, 10, bias=bias)])
        assert spec.weight_name == "lm_head.weight" and spec.bias_name == ("lm_head.bias" if bias else None)
        _, weight, got_bias = build_full(spec)
        assert weight.shape == (10, 16) and (got_bias is not None) == bias
    # a module object works too; two matrices are not an output projection
    assert split_output_layer([_Wrapped(16, 10)])[1].weight_name == "lm_head.weight"
    with pytest.raises(ValueError, match=r"last layer \(_Wrapped\) is not a recognisable output layer"):
        split_output_layer([LayerSpec(_Wrapped, 16, 10, extra=True)])


def test_refuses_what_is_not_an_output_layer() -> None:
    cfg = GPTConfig(num_layers=1, hidden=16, num_heads=2, vocab_size=10, max_seq_len=8)
    with pytest.raises(ValueError, match=r"last layer \(GPTFinalNorm\) is not a recognisable output layer"):
        split_output_layer(gpt_layer_specs(cfg)[:-1])
    # a tied layer whose forward is not x @ W.T (here: the embedding lookup itself)
    _, spec = split_output_layer([TiedLayerSpec("embed", GPTEmbedding, cfg, tied_weight_attr="wte.weight"),
                                  TiedLayerSpec("embed", GPTEmbedding, cfg, forward_fn=lambda m, x: x.sum(-1, True) *
                                                torch.ones(10), tied_weight_attr="wte.weight")])
    with pytest.raises(ValueError, match=r"does not compute x @ wte.weight.T;"):
        build_full(spec)
    # a head with a logit scale (Granite's logits_scaling, Cohere's logit_scale): the message names the scale
    _, spec = split_output_layer([TiedLayerSpec("embed", GPTEmbedding, cfg, tied_weight_attr="wte.weight"),
                                  TiedLayerSpec("embed", GPTEmbedding, cfg, forward_fn=lambda m, x: 0.25 * (
                                      x @ m.wte.weight.T), tied_weight_attr="wte.weight")])
    with pytest.raises(ValueError, match=r"does not compute x @ wte.weight.T \(it computes 0.25 times that: a logit "
                                         r"scale, .*logits_scaling or logit_scale.*set it to 1 or turn "
                                         r"terapipe.vocab_parallel off\)"):
        build_full(spec)


# (7, 6): rows of 2, shards 4 and 5 hold padding only
@pytest.mark.parametrize("vocab, shards", [(10, 2), (10, 3), (10, 4), (4, 3), (7, 6)])
def test_shards_tile_the_vocabulary(vocab: int, shards: int) -> None:
    full = torch.arange(vocab * 2, dtype=torch.float32).reshape(vocab, 2)
    rows, spec = [], split_output_layer([LayerSpec(torch.nn.Linear, 2, vocab)])[1]
    for r in range(shards):
        head = VocabShardHead(torch.zeros(0, 2), None, vocab, r, shards, spec)
        part = head.take_rows(full)
        assert part.shape == (-(-vocab // shards), 2) and head.num_valid >= 0
        assert torch.equal(part[head.num_valid:], torch.zeros_like(part[head.num_valid:]))  # padding is zero
        rows.append(part[:head.num_valid])
    assert torch.equal(torch.cat(rows), full)


def test_the_config_takes_vocab_parallel_with_freezing() -> None:
    """Freezing is combined with vocabulary parallelism (tests/test_freeze_precision.py), as is cost-based
    partitioning with virtual stages (tests/test_partition_runtime.py): the config takes both."""
    cfg = parse_terapipe_config({"terapipe": {"enabled": True, "seq_len": 64, "slices": 4, "vocab_parallel": True,
                                              "freeze": {"schedule": [[1, 1]]}}})
    assert cfg.vocab_parallel and cfg.freeze is not None


def test_ids_outside_the_vocabulary_are_named_and_the_last_id_and_ignored_labels_pass() -> None:
    """``out_of_range_ids`` (checked before a step on the stages that read the batch): ``[0, vocab)`` and the ignored
    label pass; ``vocab`` itself and negatives are named with where they are."""
    from ds_terapipe.runtime.execution.batch_checks import IGNORE_INDEX, out_of_range_ids

    assert out_of_range_ids(torch.tensor([[0, 9, -100]]), 10, "label", ignore_index=IGNORE_INDEX) is None
    problem = out_of_range_ids(torch.tensor([[0, 10]]), 10, "label", ignore_index=IGNORE_INDEX)
    assert problem is not None and problem.startswith("label 10 at (0, 1) ") and "[0, 10)" in problem
    assert out_of_range_ids(torch.tensor([[3, -100]]), 10, "input id") == "input id -100 at (0, 1) of the next " \
        "batch is outside the vocabulary [0, 10)"
    assert out_of_range_ids(torch.tensor([[0.5]]), 10, "input id") is None   # other kinds: their own checks


def test_the_split_log_sum_exp_takes_one_all_reduce_and_equals_the_whole_vocabulary(monkeypatch) -> None:
    """VF's softmax statistics: each of 4 emulated shards of a 9-word vocabulary (3 rows each; the last shard holds
    padding rows only) puts its max, sum of exponentials and target into its row of one all-reduce; every shard then
    has the log-sum-exp and the target logit of the whole vocabulary (torch.logsumexp over the unsplit logits)."""
    from types import SimpleNamespace

    from ds_terapipe.runtime.features import vocab

    torch.manual_seed(3)
    shards, rows_per_shard, vocab_size = 4, 3, 9
    logits = torch.randn(2, 5, vocab_size) * 30   # spread out: the max matters
    labels = torch.randint(0, vocab_size, (2, 5))
    padded = torch.cat([logits, torch.full((2, 5, shards * rows_per_shard - vocab_size), float("-inf"))], dim=-1)
    calls, rows_of = [], {}

    def run(rank: int, reduce) -> tuple[torch.Tensor, ...]:
        monkeypatch.setattr(vocab.dist, "all_reduce", reduce)
        part = padded[..., rank * rows_per_shard:(rank + 1) * rows_per_shard]
        index = labels - rank * rows_per_shard
        mine = (index >= 0) & (index < rows_per_shard)
        target = torch.where(mine, part.gather(-1, index.clamp(0, rows_per_shard - 1).unsqueeze(-1)).squeeze(-1), 0.0)
        fake = SimpleNamespace(group=None, head=SimpleNamespace(rank=rank, num_shards=shards),
                               _wait=lambda works, what: None)
        return vocab.VocabParallel._log_sum_exp(fake, part, target, "test")

    for rank in range(shards):   # what each shard contributes
        run(rank, lambda rows, group=None, async_op=False: (calls.append(rank), rows_of.setdefault(rank, rows.clone())))
    total = sum(rows_of.values())
    assert calls == list(range(shards))   # one all-reduce per shard
    want_lse, want_target = torch.logsumexp(logits, dim=-1), logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    for rank in range(shards):
        lse, target = run(rank, lambda rows, group=None, async_op=False: rows.copy_(total))
        torch.testing.assert_close(lse, want_lse)
        assert torch.equal(target, want_target)
