"""A reference GPT written as DeepSpeed LayerSpecs, the way DeepSpeed users write pipeline models.

    layers = gpt_layer_specs(GPTConfig(num_layers=8, hidden=512, num_heads=8, vocab_size=256, max_seq_len=1024))
    model = TokenPipelineModule(layers, num_stages=2, loss_fn=causal_lm_loss, vocab_size=256)

Input and output embeddings are tied through ``TiedLayerSpec("embed", ...)``. Every layer initialises its
parameters from ``seed + layer index``, so any partitioning into stages, and the single-process
:class:`GPTReference`, start from identical weights: that is what the equivalence tests compare against.
Nothing here knows about slicing except the two places that must: attention goes through
:func:`~ds_terapipe.runtime.slicing.attention.sliced_causal_attention` and positions add
:func:`~ds_terapipe.runtime.slicing.context.token_offset`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from ..runtime.slicing.attention import CausalSelfAttention
from ..runtime.slicing.documents import slice_positions

__all__ = ["GPTConfig", "GPTEmbedding", "GPTBlock", "GPTFinalNorm", "gpt_layer_specs", "causal_lm_loss",
           "GPTReference", "reference_param_name"]


@dataclass(frozen=True)
class GPTConfig:
    num_layers: int = 4
    hidden: int = 128
    num_heads: int = 4
    vocab_size: int = 256
    max_seq_len: int = 256
    dropout: float = 0.0
    seed: int = 1234

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "num_heads", "vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be >= 1")
        if self.hidden % self.num_heads:
            raise ValueError(f"GPTConfig: hidden={self.hidden} must be divisible by num_heads={self.num_heads}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _init_(module: nn.Module, seed: int, num_layers: int) -> None:
    """GPT-2 initialisation from a private generator, so weights depend only on (seed, layer)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif "ln" in name or "norm" in name:
                param.fill_(1.0)
            else:
                std = 0.02 / (2 * num_layers) ** 0.5 if name.endswith(("proj.weight", "fc_out.weight")) else 0.02
                param.copy_(torch.randn(param.shape, generator=gen) * std)


class GPTEmbedding(nn.Module):
    """Token + learned position embedding; also the (tied) output head via :meth:`head`."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        _init_(self, cfg.seed, cfg.num_layers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # (T,), or (B, T) within each packed document; ids: (B, T)
        pos = slice_positions(ids.shape[1], ids.device, self.cfg.max_seq_len,
                              "GPTEmbedding: positions up to {end} exceed max_seq_len={max_positions}; "
                              "raise GPTConfig.max_seq_len")
        return self.drop(self.wte(ids) + self.wpe(pos))  # (B, T, C)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.wte.weight)  # (B, T, V)


def _tied_head(embedding: GPTEmbedding, x: torch.Tensor) -> torch.Tensor:
    return embedding.head(x)


class GPTBlock(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg.hidden, cfg.num_heads, dropout=cfg.dropout)
        self.ln_2 = nn.LayerNorm(cfg.hidden)
        self.fc_in = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.fc_out = nn.Linear(4 * cfg.hidden, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        _init_(self, cfg.seed + 1 + layer_idx, cfg.num_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.fc_out(F.gelu(self.fc_in(self.ln_2(x)))))


class GPTFinalNorm(nn.LayerNorm):

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg.hidden)


def gpt_layer_specs(cfg: GPTConfig) -> list:
    """The GPT as a list of DeepSpeed layer specs: embed, blocks, final norm, tied head."""
    return [
        TiedLayerSpec("embed", GPTEmbedding, cfg, tied_weight_attr="wte.weight"),
        *[LayerSpec(GPTBlock, cfg, i) for i in range(cfg.num_layers)],
        LayerSpec(GPTFinalNorm, cfg),
        TiedLayerSpec("embed", GPTEmbedding, cfg, forward_fn=_tied_head, tied_weight_attr="wte.weight"),
    ]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over every label position: logits (B, T, V), labels (B, T).

    The sum over counted tokens divided by the number of label positions, so labels of -100 (ignored, the
    Hugging Face convention) add nothing but still count in the denominator. That keeps the loss additive over
    slices: the engine weights each slice's loss by its share of the tokens, which sums to exactly the unsliced
    loss only if each slice's loss is a sum over its positions divided by their number (a mean over the counted
    tokens alone would weight slices wrongly, and be NaN for a slice with nothing to count). Without -100 labels
    it is the ordinary mean."""
    flat = labels.reshape(-1)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat, ignore_index=-100, reduction="sum")
    return total / flat.numel()


class GPTReference(nn.Module):
    """The same GPT as one ordinary module, unsliced: the ground truth of the equivalence tests."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList([GPTEmbedding(cfg), *[GPTBlock(cfg, i) for i in range(cfg.num_layers)],
                                     GPTFinalNorm(cfg)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = ids
        for layer in self.layers:
            x = layer(x)
        return self.layers[0].head(x)


def reference_param_name(pipe_name: str) -> str:
    """Map a parameter name of the pipeline module (``"3.attn.qkv.weight"``, ``"tied_modules.embed.wte.weight"``)
    to :class:`GPTReference`'s (``"layers.3.attn.qkv.weight"``, ``"layers.0.wte.weight"``)."""
    if pipe_name.startswith("tied_modules.embed."):
        return "layers.0." + pipe_name[len("tied_modules.embed."):]
    return "layers." + pipe_name
