"""The output layer as the vocabulary passes see it: which layer it is, and one rank's rows of it.

Why a module of its own: recognising the output layer (:func:`split_output_layer`, by structure: one (V, H)
matrix and at most a bias of V, checked to compute ``x @ W.T + b`` by :func:`build_full`) and the shard it becomes
(:class:`VocabShardHead`) are what the module build, the split input embedding (runtime/features/vocab_embedding.py),
the
vocabulary passes (runtime/features/vocab.py) and the cost probes (runtime/features/vocab_cost.py) all start from; here
they depend
on nothing else of the runtime.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec

__all__ = ["EmbeddingShard", "HeadSpec", "VocabRows", "VocabShardHead", "build_full", "get_dotted",
           "split_output_layer"]

_FIX_HEAD = ("make the last layer the output projection: an nn.Linear(hidden, vocab) (LayerSpec or module), or a "
             "TiedLayerSpec whose forward_fn computes x @ W.T with its tied weight; or set "
             "terapipe.vocab_parallel to false")

_PROBE_PEAK = 1e4   # how large build_full's second probe row makes the logits


@dataclass(frozen=True)
class HeadSpec:
    """The output layer as given (the last entry of ``layers``) and where its weight lives."""

    layer: Any              # LayerSpec, TiedLayerSpec or nn.Module
    index: int              # its layer index (for checkpoint files written without vocabulary parallelism)
    tied_key: Optional[str]  # TiedLayerSpec key shared with an earlier layer, else None
    weight_name: str        # state-dict name of the weight inside the layer ("weight", "wte.weight")
    bias_name: Optional[str]


def get_dotted(module: torch.nn.Module, dotted: str) -> Any:
    """``module.a.b.c`` for ``dotted`` = ``"a.b.c"`` (a state-dict name inside a layer)."""
    return functools.reduce(getattr, dotted.split("."), module)


def split_output_layer(layers: list) -> tuple[list, HeadSpec]:
    """``layers`` without the output layer, and the output layer; ValueError when the last layer is not one."""
    layers = list(layers)
    if not layers:
        raise ValueError(f"terapipe.vocab_parallel: the model has no layers; {_FIX_HEAD}")
    head, index = layers[-1], len(layers) - 1
    if isinstance(head, TiedLayerSpec):
        attrs = head.tied_weight_attr if isinstance(head.tied_weight_attr, (list, tuple)) else [head.tied_weight_attr]
        if len(attrs) != 1:
            raise ValueError(f"terapipe.vocab_parallel: the last layer (TiedLayerSpec {head.key!r}) ties "
                             f"{list(attrs)}; the output layer must tie exactly one (vocab, hidden) weight; "
                             f"{_FIX_HEAD}")
        tied = any(isinstance(s, TiedLayerSpec) and s.key == head.key for s in layers[:-1])
        return layers[:-1], HeadSpec(head, index, head.key if tied else None, attrs[0], None)
    if isinstance(head, LayerSpec) and isinstance(head.typename, type) and issubclass(head.typename, torch.nn.Linear) \
            or isinstance(head, torch.nn.Linear):
        return layers[:-1], HeadSpec(head, index, None, "weight", "bias")
    found = _projection_names(head)
    if found is not None:   # a module wrapping one projection (a Hugging Face lm_head): build_full checks x @ W.T
        return layers[:-1], HeadSpec(head, index, None, *found)
    name = getattr(getattr(head, "typename", None), "__name__", type(head).__name__)
    raise ValueError(f"terapipe.vocab_parallel: the last layer ({name}) is not a recognisable output layer; "
                     f"{_FIX_HEAD}")


def _projection_names(layer: Any) -> Optional[tuple[str, Optional[str]]]:
    """(weight name, bias name or None) when ``layer`` (a LayerSpec or a module) holds exactly one matrix and at
    most one vector of its rows: the shape of an output projection, recognised by structure rather than by class
    (a LayerSpec is built on the meta device: no memory, no initialisation). None otherwise."""
    if isinstance(layer, torch.nn.Module):
        module = layer
    elif isinstance(layer, LayerSpec):
        try:
            with torch.device("meta"):
                module = layer.build()
        except Exception:  # noqa: BLE001 - a layer that cannot be built on meta is not recognised here
            return None
    else:
        return None
    params = dict(module.named_parameters())
    matrices = [n for n, p in params.items() if p.dim() == 2]
    if len(matrices) != 1:
        return None
    rows = params[matrices[0]].shape[0]
    rest = [n for n in params if n != matrices[0]]
    if len(rest) > 1 or (rest and tuple(params[rest[0]].shape) != (rows, )):
        return None
    return matrices[0], rest[0] if rest else None


def build_full(spec: HeadSpec) -> tuple[torch.nn.Module, torch.Tensor, Optional[torch.Tensor]]:
    """The output layer built as given (CPU), its weight (V, H) and bias, after checking it computes x @ W.T + b."""
    layer = spec.layer
    module = layer if isinstance(layer, torch.nn.Module) else layer.build()
    weight = get_dotted(module, spec.weight_name)
    bias = get_dotted(module, spec.bias_name) if spec.bias_name else None
    if not torch.is_tensor(weight) or weight.dim() != 2:
        raise ValueError(f"terapipe.vocab_parallel: the output layer's {spec.weight_name} is not a (vocab, hidden) "
                         f"matrix; {_FIX_HEAD}")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, weight.shape[1], generator=gen, dtype=weight.dtype).to(weight.device)
    with torch.no_grad():
        # The second row's logits reach ~1e4 (the first's stay near the weights' scale): a softcap (cap * tanh(
        # logits / cap)) is indistinguishable from x @ W.T on small logits, not on those.
        peak = float(F.linear(x[:1], weight).abs().max())
        if peak > 0:
            x[1:] *= _PROBE_PEAK / peak
        fn = getattr(layer, "forward_fn", None)
        got = fn(module, x) if fn is not None else module(x)
        want = F.linear(x, weight, bias)
    if not torch.is_tensor(got) or got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        scaled = ""
        if torch.is_tensor(got) and got.shape == want.shape:
            factor = float((got * want).sum() / (want * want).sum())   # the best scalar fit of got by want
            cap = float(got.abs().max())   # a softcap's bound: the large row's logits saturate it
            if torch.allclose(got, want * factor, rtol=1e-4, atol=1e-5):   # a logit scale (Granite, Cohere)
                scaled = (f" (it computes {factor:.4g} times that: a logit scale, e.g. a Hugging Face config's "
                          "logits_scaling or logit_scale, which the split head does not apply; set it to 1 or turn "
                          "terapipe.vocab_parallel off)")
            elif cap > 0 and torch.allclose(got, cap * torch.tanh(want / cap), rtol=1e-3, atol=1e-3 * cap):
                scaled = (f" (it computes {cap:.4g} * tanh(that / {cap:.4g}): a final-logit softcap, e.g. a Hugging "
                          "Face config's final_logit_softcapping (Gemma 2), which the split head does not apply; set "
                          "it to None or turn terapipe.vocab_parallel off)")
        raise ValueError(f"terapipe.vocab_parallel: the output layer does not compute x @ {spec.weight_name}.T"
                         f"{' + bias' if bias is not None else ''}{scaled}; {_FIX_HEAD}")
    return module, weight.detach(), None if bias is None else bias.detach()


class VocabRows(torch.nn.Module):
    """One rank's rows of a (V, H) table split over the pipeline's p ranks: ``weight`` (R, H), rows ``[offset,
    offset + R)`` of the vocabulary padded to ``R * p``, ``R = ceil(V / p)``; the first ``num_valid`` are real
    tokens, the rest zero padding that nothing reads or updates."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, rank: int, num_shards: int) -> None:
        super().__init__()
        self.vocab_size, self.rank, self.num_shards = vocab_size, rank, num_shards
        self.rows = -(-vocab_size // num_shards)
        self.offset = rank * self.rows
        self.num_valid = max(0, min(self.rows, vocab_size - self.offset))
        self.weight = torch.nn.Parameter(weight)

    def extra_repr(self) -> str:
        return (f"rows [{self.offset}, {self.offset + self.rows}) of vocab {self.vocab_size} (padded to "
                f"{self.rows * self.num_shards}), hidden {self.weight.shape[1]}")

    def take_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This shard's rows of a (V, ...) tensor, zero-padded past V."""
        out = full.new_zeros((self.rows, *full.shape[1:]))
        out[:self.num_valid] = full[self.offset:self.offset + self.num_valid]
        return out

    def fill_rows(self, full: torch.Tensor) -> None:
        """Take this shard's rows of the whole table ``full`` (V, H) (from any device)."""
        with torch.no_grad():
            self.weight.copy_(self.take_rows(full.to(self.weight.device)))


class VocabShardHead(VocabRows):
    """This rank's rows of the output layer: ``weight`` (R, H), ``bias`` (R, ) or None (see :class:`VocabRows`)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], vocab_size: int, rank: int,
                 num_shards: int, spec: HeadSpec) -> None:
        super().__init__(weight, vocab_size, rank, num_shards)
        self.spec = spec
        self.bias = None if bias is None else torch.nn.Parameter(bias)
        # vocab_embedding.EmbeddingSplit: the input embedding, when it is split (tied: it uses these rows)
        self.embedding: Optional[Any] = None


class EmbeddingShard(VocabRows):
    """This rank's rows of an untied input embedding's table (the head's rows are another parameter): the table
    the split input embedding (runtime/features/vocab_embedding.py) looks tokens up in when the head does not
    share its weight."""
