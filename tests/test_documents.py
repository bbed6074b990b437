"""Tier a, one process: packed documents (runtime/slicing/documents.py) in sliced attention and positions.

A row of several documents (position ids restarting at 0) runs slice by slice, forward in order and backward
later slices first as the engine runs them, and must equal the unsliced forward under ``packed_documents`` with
the same position ids: outputs, input gradients and every parameter gradient, with learned and rotary positions,
grouped-query attention and document boundaries inside, at and across slice boundaries.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn

from ds_terapipe.models.gpt import GPTBlock, GPTConfig, GPTEmbedding
from ds_terapipe.runtime.slicing.attention import CausalSelfAttention, sliced_causal_attention
from ds_terapipe.runtime.slicing.context import MicroBatchState, SliceContext, slice_scope
from ds_terapipe.runtime.slicing.documents import Documents, check_position_ids, packed_documents


def packed_positions(batch: int, seq_len: int, rng: random.Random) -> torch.Tensor:
    """(B, L) position ids of rows cut into documents of random, skewed lengths."""
    rows = []
    for _ in range(batch):
        row: list[int] = []
        while len(row) < seq_len:
            length = max(1, int(rng.expovariate(1 / 7)))
            row += list(range(length))
        rows.append(row[:seq_len])
    return torch.tensor(rows)


def random_slices(seq_len: int, rng: random.Random) -> list[int]:
    cuts = sorted(rng.sample(range(1, seq_len), rng.randint(1, min(5, seq_len - 1))))
    bounds = [0, *cuts, seq_len]
    return [b - a for a, b in zip(bounds, bounds[1:])]


class Stack(nn.Module):
    """Embedding (learned positions) and two blocks, or two rotary attention layers on float inputs."""

    def __init__(self, rotary: bool) -> None:
        super().__init__()
        self.rotary = rotary
        if rotary:
            self.layers = nn.ModuleList([CausalSelfAttention(16, 4, rotary=True) for _ in range(2)])
        else:
            cfg = GPTConfig(num_layers=2, hidden=16, num_heads=4, vocab_size=50, max_seq_len=64, seed=3)
            self.embed = GPTEmbedding(cfg)
            self.layers = nn.ModuleList([GPTBlock(cfg, 0), GPTBlock(cfg, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.rotary:
            x = self.embed(x)
        for layer in self.layers:
            x = x + layer(x) if self.rotary else layer(x)
        return x


def _inputs(rotary: bool, batch: int, seq_len: int) -> torch.Tensor:
    if rotary:
        return torch.randn(batch, seq_len, 16, dtype=torch.double)
    return torch.randint(0, 50, (batch, seq_len))


@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_sliced_packed_rows_equal_the_unsliced_document_masked_forward(rotary: bool, seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    batch, seq_len = 2, rng.randint(12, 40)
    model = Stack(rotary).double()
    x = _inputs(rotary, batch, seq_len)
    positions = packed_positions(batch, seq_len, rng)
    weight = torch.randn(batch, seq_len, 16, dtype=torch.double)
    leaf = x.detach().requires_grad_() if rotary else x
    with packed_documents(positions):
        ref_out = model(leaf)
    (ref_out * weight).sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    ref_x = leaf.grad.clone() if rotary else None
    model.zero_grad(set_to_none=True)

    slices = random_slices(seq_len, rng)
    state, docs = MicroBatchState(0, seq_len, len(slices)), Documents(positions)
    units, start = [], 0
    for i, length in enumerate(slices):
        piece = x[:, start:start + length]
        piece = piece.detach().requires_grad_() if rotary else piece
        with slice_scope(SliceContext(0, i, start, start + length, state, documents=docs)):
            units.append((piece, model(piece), start, length))
        start += length
    out = torch.cat([u[1] for u in units], dim=1)
    assert torch.allclose(out, ref_out.detach(), atol=1e-10), slices
    for piece, y, start, length in reversed(units):
        y.backward(weight[:, start:start + length])
    for p, ref in zip(model.parameters(), ref_grads):
        assert torch.allclose(p.grad, ref, atol=1e-10), slices
    if rotary:
        assert torch.allclose(torch.cat([u[0].grad for u in units], dim=1), ref_x, atol=1e-10), slices


def test_the_document_mask_changes_the_result() -> None:
    """The documents matter (else the equality above would hold for an attention that ignored them)."""
    torch.manual_seed(0)
    model = Stack(rotary=False).double()
    ids = torch.randint(0, 50, (1, 16))
    packed = torch.tensor([list(range(6)) + list(range(10))])
    with packed_documents(packed):
        split = model(ids)
    whole = model(ids)
    assert torch.allclose(split[:, :6], whole[:, :6], atol=1e-12)   # the first document sees the same prefix
    assert not torch.allclose(split[:, 6:], whole[:, 6:], atol=1e-6)  # the second no longer sees the first
    with packed_documents(torch.arange(16).unsqueeze(0)):             # one document: plain causal attention
        assert torch.allclose(model(ids), whole, atol=1e-12)


def test_grouped_query_attention_with_documents() -> None:
    torch.manual_seed(1)
    q = torch.randn(2, 4, 12, 8, dtype=torch.double)
    k, v = torch.randn(2, 2, 12, 8, dtype=torch.double), torch.randn(2, 2, 12, 8, dtype=torch.double)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
    with packed_documents(positions):
        ref = sliced_causal_attention(q, k, v, cache_key="a")
    state, docs, outs, start = MicroBatchState(0, 12, 3), Documents(positions), [], 0
    for i, length in enumerate([5, 4, 3]):
        with slice_scope(SliceContext(0, i, start, start + length, state, documents=docs)):
            outs.append(sliced_causal_attention(q[:, :, start:start + length], k[:, :, start:start + length],
                                                v[:, :, start:start + length], cache_key="a"))
        start += length
    assert torch.allclose(torch.cat(outs, dim=2), ref, atol=1e-12)
    # row 1 is one document: plain causal attention
    plain = torch.nn.functional.scaled_dot_product_attention(q[1:], k[1:].repeat_interleave(2, 1),
                                                             v[1:].repeat_interleave(2, 1), is_causal=True)
    assert torch.allclose(ref[1:], plain, atol=1e-12)


def test_mask_rule() -> None:
    docs = Documents(torch.tensor([[0, 1, 0, 1, 2]]))
    visible = docs.mask(2, 5, torch.float32)[0, 0] == 0
    assert visible.tolist() == [[False, False, True, False, False],
                                [False, False, True, True, False],
                                [False, False, True, True, True]]
    assert docs.ids(5).tolist() == [[1, 1, 2, 2, 2]]
    # keys of documents that ended before a slice are skipped; a row whose document spans the start keeps them
    assert docs.first_visible(2) == 2 and docs.first_visible(4) == 2 and docs.first_visible(1) == 0
    assert Documents(torch.tensor([[0, 1, 0, 1, 2], [0, 1, 2, 3, 4]])).first_visible(3) == 0
    assert (docs.mask(2, 5, torch.float32, first_key=2)[0, 0] == 0).tolist() == [row[2:] for row in visible.tolist()]


@pytest.mark.parametrize("positions, match", [
    (torch.tensor([[1, 2, 3, 4]]), "start each row at 0"),
    (torch.tensor([[0, 1, 3, 4]]), "row 0 goes 1 -> 3 at token 2"),
    (torch.tensor([[0, 1, 2, 1]]), "row 0 goes 2 -> 1 at token 3"),
    (torch.tensor([[0, 1, 2]]), "differ in shape"),
    (torch.tensor([[0.0, 1.0, 2.0, 3.0]]), "must be an integer tensor"),
    (torch.tensor([[1, 1, 1, 1]]), "look like an attention mask"),
    (torch.tensor([[0, 0, 1, 1]]), "look like an attention mask"),
])
def test_bad_position_ids_are_refused(positions: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_position_ids(torch.zeros(1, 4, dtype=torch.long), positions)
    check_position_ids(torch.zeros(1, 4, dtype=torch.long), torch.tensor([[0, 1, 0, 0]]))  # documents of 2, 1, 1


def test_slices_of_a_row_must_arrive_in_order_without_overlap() -> None:
    """``Documents.write``: a slice repeated whole (a rank holding two chunks) is ignored; one that overlaps the
    known rows or leaves a gap is refused, never written over rows a layer may have saved."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    docs = Documents.empty(1, 8, torch.device("cpu"))
    docs.write(0, positions[:, :4])
    docs.write(0, positions[:, :4])
    for start, end in ((2, 6), (6, 8)):
        with pytest.raises(RuntimeError, match="must arrive in order"):
            docs.write(start, positions[:, start:end])
    assert docs.filled == 4
    docs.write(4, positions[:, 4:])
    assert torch.equal(docs.positions, positions)


@pytest.mark.parametrize("arch", ["llama", "llama4_text"])
def test_hugging_face_llama_sliced_packed_equals_transformers_packed_forward(arch: str) -> None:
    """The Hugging Face layers (Llama, grouped-query attention, rotary) over packed rows, sliced, against
    ``transformers``' own packed forward (``position_ids`` that restart, no attention mask, no cache):
    logits and every gradient. Llama 4: a chunked layer (chunks of 5 from each document's start, as its mask cuts
    packed rows) and a NoPE layer whose temperature tuning scales queries by their index in the row (transformers'
    ``arange``, not the position ids)."""
    transformers = pytest.importorskip("transformers")
    from deepspeed.pipe import TiedLayerSpec

    from ds_terapipe.models.hf import causal_lm_loss, causal_lm_specs, hf_param_name

    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**sizes)
    else:
        cfg = transformers.Llama4TextConfig(**sizes, head_dim=16, attention_chunk_size=5, no_rope_layers=[1, 0],
                                            floor_scale=2, attn_scale=0.5, num_local_experts=4, num_experts_per_tok=2,
                                            pad_token_id=0)
    layers, tied, named = [], {}, {}
    for index, spec in enumerate(causal_lm_specs(cfg, seed=5)):
        if isinstance(spec, TiedLayerSpec):
            module = tied.setdefault(spec.key, spec.build())
            layers.append((lambda x, m=module, f=spec.forward_fn: f(m, x)) if spec.forward_fn else module)
            prefix = f"tied_modules.{spec.key}"
        else:
            module, prefix = spec.build(), str(index)
            layers.append(module)
        named.update({f"{prefix}.{n}": p for n, p in module.named_parameters()})
    cfg._attn_implementation = "sdpa"
    reference = (transformers.LlamaForCausalLM if arch == "llama" else transformers.Llama4ForCausalLM)(cfg)
    reference.load_state_dict({hf_param_name(n, cfg): p.detach() for n, p in named.items()}, strict=True)
    gen = torch.Generator().manual_seed(3)
    ids, labels = torch.randint(0, 128, (2, 20), generator=gen), torch.randint(0, 128, (2, 20), generator=gen)
    positions = torch.tensor([list(range(7)) + list(range(13)), list(range(4)) + list(range(16))])
    ref_logits = reference(input_ids=ids, position_ids=positions, use_cache=False).logits
    causal_lm_loss(ref_logits, labels).backward()

    state, docs, start, outs = MicroBatchState(0, 20, 3), Documents(positions), 0, []
    for i, length in enumerate([5, 9, 6]):
        with slice_scope(SliceContext(0, i, start, start + length, state, documents=docs)):
            x = ids[:, start:start + length]
            for layer in layers:
                x = layer(x)
        outs.append((x, start, length))
        start += length
    logits = torch.cat([o[0] for o in outs], dim=1)
    assert torch.allclose(logits, ref_logits, atol=1e-5), float((logits - ref_logits).abs().max())
    for x, start, length in reversed(outs):   # each slice's share of the mean loss, later slices first
        (causal_lm_loss(x, labels[:, start:start + length]) * length / 20).backward()
    ref_grads = dict(reference.named_parameters())
    for name, param in named.items():
        ref = ref_grads[hf_param_name(name, cfg)].grad
        assert torch.allclose(param.grad, ref, atol=1e-5, rtol=1e-4), name


def test_packed_rows_follow_the_convention_and_predict_within_documents() -> None:
    """ds_terapipe.packed_rows: the position ids the engine accepts (check_position_ids), restarting where a
    document starts inside a window, and -100 exactly where the next token is another document's."""
    import numpy as np

    from ds_terapipe import packed_rows
    from ds_terapipe.runtime.slicing.documents import check_position_ids

    tokens, starts = np.arange(100) % 50, np.array([0, 10, 37, 60])
    (ids, positions), labels = packed_rows(tokens, starts, [5, 30, 61], 12)
    check_position_ids(ids, positions, "packed_rows")
    assert ids.dtype == torch.int64 and ids.shape == positions.shape == labels.shape == (3, 12)
    assert positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4],
                                  list(range(12))]
    assert ids[0].tolist() == list(range(5, 17))
    # labels: the next token, -100 before each document start (positions 10 and 37 of the corpus)
    assert labels.tolist() == [[6, 7, 8, 9, -100, 11, 12, 13, 14, 15, 16, 17],
                               [31, 32, 33, 34, 35, 36, -100, 38, 39, 40, 41, 42], list(range(12, 24))]


def test_an_embedding_compiles_once_for_every_slice_offset_and_still_refuses_too_many_positions() -> None:
    """The learned position embedding reads its slice's offset only inside ``slice_positions`` (outside
    torch.compile's graphs): compiled, slices of 16 tokens at offsets 16 and 32 compile no frame after the first
    slice's (the offset is no guard of the graph), and a slice reaching past ``max_seq_len`` is refused with the
    positions' end."""
    from torch._dynamo.utils import counters
    cfg = GPTConfig(num_layers=1, hidden=16, num_heads=2, vocab_size=32, max_seq_len=48, seed=5)
    emb = GPTEmbedding(cfg)
    compiled = torch.compile(emb, backend="aot_eager")
    ids = torch.randint(0, 32, (2, 48), generator=torch.Generator().manual_seed(0))
    state = MicroBatchState(0, 48, 3)
    torch._dynamo.reset()
    counters.clear()
    frames = []
    for i, (start, end) in enumerate(((0, 16), (16, 32), (32, 48))):
        with slice_scope(SliceContext(0, i, start, end, state)):
            out = compiled(ids[:, start:end])
        assert torch.equal(out, emb.wte(ids[:, start:end]) + emb.wpe(torch.arange(start, end)))
        frames.append(counters["frames"]["total"])
    assert frames[0] > 0 and frames[1:] == [frames[0]] * 2, frames
    for model in (emb, compiled):
        with slice_scope(SliceContext(0, 2, 40, 56, MicroBatchState(0, 56, 3))), pytest.raises(
                ValueError, match=r"positions up to 56 exceed max_seq_len=48; raise GPTConfig.max_seq_len"):
            model(torch.zeros(2, 16, dtype=torch.long))
