"""Tier a, one process: the slice check judges a bf16/fp16 model by what it computes, not by its rounding.

In bf16 the sliced and unsliced runs of a causal layer add the same terms in another order, and a gradient that
is a sum with cancellation (a LayerNorm bias) then differs by tens of percent: compared in bf16 the reference GPT
itself would be refused. The check runs such layers on fp32 copies. These tests hold both sides of that: causal
models (the reference GPT at the shapes the examples train, a Hugging Face Llama) pass at 2, 4 and 8 slices in
bf16 and fp16, while a weak token mixer behind them is refused as strictly as in fp32; and every wrong-attention
model the fp32 check refuses is still refused in bf16 and fp16, naming the layer.

    pytest tests/test_slice_check_precision.py
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn as nn

from ds_terapipe.models.gpt import GPTConfig, gpt_layer_specs
from ds_terapipe.runtime.slicing.attention import CausalSelfAttention, apply_rotary, sliced_causal_attention
from ds_terapipe.runtime.planning.slice_check import check_slicing_equivalence
from tests.test_attention import MeanMixer, PlainCausal, ZeroProjAttention

HALF = [torch.bfloat16, torch.float16]
BATCH, SEQ_LEN = 2, 128


def equal_slices(num_slices: int, seq_len: int = SEQ_LEN) -> list[int]:
    return [seq_len // num_slices] * num_slices


def gpt_layers(num_layers: int, hidden: int, num_heads: int, dtype: torch.dtype) -> list:
    """The reference GPT's pipeline layers as one stage holds them: embedding, blocks, final norm, tied head (the
    spec's ``forward_fn`` bound to the embedding, as DeepSpeed's ``PipelineModule`` binds a ``TiedLayerSpec``)."""
    specs = gpt_layer_specs(GPTConfig(num_layers=num_layers, hidden=hidden, num_heads=num_heads))
    embed = specs[0].build().to(dtype)
    return [embed, *[spec.build().to(dtype) for spec in specs[1:-1]], partial(specs[-1].forward_fn, embed)]


def token_ids(vocab_size: int = 256, seq_len: int = SEQ_LEN) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, seq_len), generator=torch.Generator().manual_seed(0))


class WeakMixer(nn.Module):
    """Adds a twentieth of the mean over all tokens: non-causal by 0.3-1.2% (relative, at 2-8 slices), which the
    fp32 check refuses (its tolerance is 0.1%) and a check loosened to half precision's rounding would let by."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.05 * x.mean(dim=1, keepdim=True)


def assert_as_strict_as_fp32(first_layer: nn.Module, num_slices: int) -> None:
    """A weak token mixer behind the model's first layer is refused: half precision does not blunt the check."""
    problem = check_slicing_equivalence([first_layer, WeakMixer()], 0, token_ids(), equal_slices(num_slices))
    assert problem is not None and "layer 1 (WeakMixer)" in problem, problem


# the reference GPT at the shapes examples/train_gpt.py trains: (layers, hidden, heads)
GPT_SHAPES = [(2, 64, 4), (4, 128, 4), (8, 512, 8)]
GPT_CASES = [(*shape, num_slices) for shape in GPT_SHAPES for num_slices in (2, 4, 8)]


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("num_layers,hidden,num_heads,num_slices", GPT_CASES)
def test_reference_gpt_passes_in_half_precision(num_layers: int, hidden: int, num_heads: int, num_slices: int,
                                               dtype: torch.dtype) -> None:
    layers = gpt_layers(num_layers, hidden, num_heads, dtype)
    problem = check_slicing_equivalence(layers, 0, token_ids(), equal_slices(num_slices))
    assert problem is None, problem
    assert_as_strict_as_fp32(layers[0], num_slices)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("num_slices", [2, 4, 8])
def test_hf_llama_passes_in_half_precision(num_slices: int, dtype: torch.dtype) -> None:
    transformers = pytest.importorskip("transformers", minversion="5")
    from ds_terapipe.models.hf import causal_lm_specs

    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=256)
    layers = [spec.build().to(dtype) for spec in causal_lm_specs(config)]
    problem = check_slicing_equivalence(layers, 0, token_ids(), equal_slices(num_slices))
    assert problem is None, problem
    assert_as_strict_as_fp32(layers[0], num_slices)


class NoOffsetEmbedding(nn.Module):
    """Learned positions from ``arange(T)`` without ``token_offset()``: every slice would get positions 0..."""

    def __init__(self, vocab_size: int, hidden: int, max_seq_len: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, hidden), nn.Embedding(max_seq_len, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))  # (B, T, C)


class NoOffsetRotary(CausalSelfAttention):
    """Sliced attention whose rotary positions start at 0 in every slice (``token_offset()`` left out)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, channels = x.shape  # (B, T, C)
        q, k, v = (t.view(batch, tokens, self.num_heads, -1).transpose(1, 2)  # (B, nh, T, hs)
                   for t in self.qkv(x).split(channels, dim=2))
        q, k = apply_rotary(q, 0), apply_rotary(k, 0)
        y = sliced_causal_attention(q, k, v, cache_key=self)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(batch, tokens, channels))


def wrong_models(hidden: int = 16) -> dict[str, tuple[list, int, str]]:
    """Each wrong model as (its layers, the index the check must name, the layer's name in the message). The
    float32 cases are the premise (tests/test_attention.py holds the first ones in fp32 too): the half-precision
    cases must be refused wherever fp32 is."""
    torch.manual_seed(0)
    cases: dict[str, tuple[list, int, str]] = {
        "plain SDPA": ([nn.Linear(hidden, hidden), PlainCausal()], 1, "PlainCausal"),
        "mean over all tokens": ([nn.Linear(hidden, hidden), MeanMixer()], 1, "MeanMixer"),
        "no offset, rotary": ([nn.LayerNorm(hidden), NoOffsetRotary(hidden, 4)], 1, "NoOffsetRotary"),
    }
    for mode in ("bidirectional", "slice-blind"):
        for zero_qkv in (False, True):
            label = f"{mode}, zero proj" + (" and qkv" if zero_qkv else "")
            cases[label] = ([nn.LayerNorm(hidden), ZeroProjAttention(hidden, mode, zero_qkv)], 1, "ZeroProjAttention")
    return cases


WRONG = list(wrong_models())


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
@pytest.mark.parametrize("case", WRONG)
def test_wrong_attention_is_refused_in_every_precision(case: str, dtype: torch.dtype) -> None:
    layers, index, name = wrong_models()[case]
    layers = [layer.to(dtype) for layer in layers]
    x = torch.randn(BATCH, 32, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    problem = check_slicing_equivalence(layers, 0, x, [8, 16, 8])
    assert problem is not None and f"layer {index} ({name})" in problem and "slices=1" in problem, problem


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_embedding_without_token_offset_is_refused(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    layers = [NoOffsetEmbedding(256, 64, SEQ_LEN).to(dtype), CausalSelfAttention(64, 4).to(dtype)]
    problem = check_slicing_equivalence(layers, 0, token_ids(), equal_slices(4))
    assert problem is not None and "layer 0 (NoOffsetEmbedding)" in problem, problem


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_the_fp32_copy_leaves_the_live_layer_alone(dtype: torch.dtype) -> None:
    # checked on a copy: the live bf16/fp16 weights (perturbed zero weights included), their .grad and the hooks
    # DeepSpeed puts on them stay as they were, and nothing the check computes reaches them
    torch.manual_seed(0)
    layers = [nn.LayerNorm(16).to(dtype), ZeroProjAttention(16, "sliced", zero_qkv=True).to(dtype)]
    params = [p for layer in layers for p in layer.parameters()]
    fired = []
    for p in params:
        p.grad = torch.full_like(p, 7.0)
        p.register_post_accumulate_grad_hook(lambda param: fired.append(param))
    before = [p.detach().clone() for p in params]
    x = torch.randn(BATCH, 32, 16).to(dtype)
    assert check_slicing_equivalence(layers, 0, x, [8, 16, 8]) is None
    assert all(p.dtype == dtype and torch.equal(p, b) for p, b in zip(params, before))
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in params) and not fired


def test_a_layer_that_cannot_be_copied_is_checked_in_its_own_precision(caplog) -> None:
    # a layer deepcopy refuses is still checked, in bf16, with a warning that says why and what to do
    class Uncopyable(nn.Module):

        def __deepcopy__(self, memo: dict) -> nn.Module:
            raise TypeError("holds a handle")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + x.mean(dim=1, keepdim=True)

    x = torch.randn(BATCH, 32, 16).bfloat16()
    with caplog.at_level("WARNING", logger="ds_terapipe.runtime.planning.slice_check"):
        problem = check_slicing_equivalence([Uncopyable()], 0, x, [8, 16, 8])
    assert problem is not None and "layer 0 (Uncopyable)" in problem, problem
    warned = [r.getMessage() for r in caplog.records]
    assert any("could not copy Uncopyable to fp32 (TypeError: holds a handle)" in m for m in warned), warned
