"""What one transformer layer costs on an accelerator, kernel by kernel: the physics ``AnalyticCost`` adds up.

Every kernel takes the longest of three times: its FLOPs at the rate GEMMs (or attention kernels) reach, its bytes
at the bandwidth streaming kernels reach, and a launch floor (the host's dispatch of one eager PyTorch op, which
a GPU cannot hide when the op itself is short). Three consequences decide how finely a sequence pays to be cut:

* every GEMM reads its whole weight whatever the slice's length, so below a few hundred tokens a slice costs
  about one read of the layer's weights (a GPT-3-175B layer: 3.6 GB of bf16, ~1.2 ms on an H100), not its FLOPs;
* a backward that is not deferred computes the weight gradient per slice and adds it into ``.grad``: a write of
  the gradient and then a read of two and a write of one, per slice;
* the many small ops of an eager block (norms, rotary embeddings, activations, residual adds) cost their launch
  floor each at small slices and their activation bytes at large ones.

Attention is costed by its FLOPs (one score and one weighted value per (query, key) pair the runtime computes: the
cached prefix and the causal triangle of the slice) and its bytes (the slice's queries and outputs, the keys and
values it reads), so it grows with the context. With a sliding window of w keys (query t sees key k iff k <= t and
t - k < w) a slice [c, c + s) reads only the keys [max(0, c - w + 1), c + s), so its attention stops growing once
the prefix passes w; where the window hides keys the runtime runs SDPA calls under a band mask per block of
``max(w, WINDOW_QUERY_BLOCK)`` queries, each scoring its queries against every key from its first query's window
on (``computed_pairs``). With chunked attention of C tokens (Llama 4's local layers: query t sees key k iff k <= t
and k // C == t // C) a slice reads the keys from the start of its first query's chunk and attends causally within
each chunk, so its attention never grows past one chunk's. ``TransformerSpec.window`` gives each layer's window or
chunk (``Chunked``). The small ops of a block are costed as a group: the larger of their launch floors and their bytes.

``BLOCKS`` lists the block layouts: ``"gpt"`` (LayerNorm, GeLU MLP of two matrices, biases) and ``"llama"``
(RMSNorm, rotary positions, SwiGLU MLP of three matrices, no biases). Their kernel counts were counted by
dispatching the project's GPT block and a Hugging Face Llama block on small shapes, one slice with a prefix.

    python -c "from ds_terapipe.planner.roofline import *; help(layer_forward_ms)"
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from ._checks import check_int, check_number

__all__ = ["BLOCKS", "BlockKernels", "Chunked", "TransformerSpec", "DeviceSpec", "Roofline", "Windows",
           "computed_pairs", "visible_pairs", "visible_keys"]


@dataclass(frozen=True)
class BlockKernels:
    """Kernels of one eager block besides its GEMMs, its attention kernel and the gradients' accumulation."""

    forward: int          # small ops of a forward: norms, positions, activation, residual adds, KV-cache copies
    input_grad: int       # small ops of the backward that computes input gradients (their backward)
    norm_params: int      # parameter tensors of the norms (they are not Linear, so never deferred)
    biases: bool          # whether the Linears have biases (a bias gradient is a sum over tokens)


BLOCKS: dict[str, BlockKernels] = {
    "gpt": BlockKernels(forward=11, input_grad=8, norm_params=4, biases=True),
    "llama": BlockKernels(forward=35, input_grad=54, norm_params=2, biases=False),
}

# Flash attention's backward recomputes the scores: 5 matmuls of the forward's size against the forward's 2.
_ATTENTION_BACKWARD_FLOPS = 2.5


@dataclass(frozen=True)
class Chunked:
    """A layer of chunked attention (Llama 4's ``attention_chunk_size``): query t sees key k iff k <= t and
    k // size == t // size, chunks counted from the start of the sequence. An entry of ``TransformerSpec.window``
    beside a sliding window (an int) and full attention (None)."""

    size: int

    def __post_init__(self) -> None:
        check_int(self.size, "Chunked.size", minimum=1, wrong_type=ValueError,
                  fix="give the tokens of a chunk (Llama 4: 8192)")


#: One layer's attention: None (full causal), a sliding window of that many keys, or ``Chunked``.
Attention = Union[None, int, Chunked]


def visible_pairs(s: np.ndarray | float, c: np.ndarray | float, window: Attention = None) -> np.ndarray:
    """(query, key) pairs a slice of ``s`` queries after ``c`` cached tokens attends over: query t sees key k iff
    k <= t and, with a sliding ``window`` w, t - k < w (min(t + 1, w) keys), or with ``Chunked(C)`` k in t's chunk
    (t mod C + 1 keys).

    Summed over the slice's queries t = c .. c + s - 1 that is F(c + s) - F(c), with F(n) = sum of min(u, w) over
    u = 1 .. n = min(n, w) (min(n, w) + 1) / 2 + max(n - w, 0) w; chunked, F(n) = (n // C) C (C + 1) / 2 +
    r (r + 1) / 2 with r = n mod C; without either s c + s (s + 1) / 2."""
    s, c = np.asarray(s, float), np.asarray(c, float)
    if window is None:
        return s * c + s * (s + 1.0) / 2.0
    if isinstance(window, Chunked):
        size = float(window.size)

        def triangle(n: np.ndarray) -> np.ndarray:
            rest = np.mod(n, size)
            return np.floor_divide(n, size) * size * (size + 1.0) / 2.0 + rest * (rest + 1.0) / 2.0
    else:
        def triangle(n: np.ndarray) -> np.ndarray:
            low = np.minimum(n, window)
            return low * (low + 1.0) / 2.0 + np.maximum(n - window, 0.0) * window

    return triangle(c + s) - triangle(c)


def visible_keys(s: np.ndarray | float, c: np.ndarray | float, window: Attention = None) -> np.ndarray:
    """Keys (and values) a slice of ``s`` queries after ``c`` cached tokens reads: [max(0, c - w + 1), c + s), or
    chunked from the start of its first query's chunk."""
    s, c = np.asarray(s, float), np.asarray(c, float)
    if isinstance(window, Chunked):
        return s + np.mod(c, float(window.size))
    return s + (c if window is None else np.minimum(c, window - 1.0))


#: The fewest queries in a block of a windowed slice: the runtime's rule (runtime/slicing/attention.py), mirrored.
WINDOW_QUERY_BLOCK = 256

#: The most chunks a slice of chunked attention runs as blocks of their own; over it one dense-mask call scores every
#: query against every key the slice reads: the runtime's rule (runtime/slicing/blocks.py MAX_BLOCKS), mirrored.
MAX_CHUNK_BLOCKS = 32


def computed_pairs(s: np.ndarray | float, c: np.ndarray | float, window: Attention = None,
                   block: int = WINDOW_QUERY_BLOCK) -> np.ndarray:
    """(query, key) scores the runtime computes for a slice of ``s`` queries after ``c`` cached tokens: the visible
    pairs while the window hides no key from the slice (``c + s <= window``: the causal paths, which skip what the
    causal mask hides), else band-masked calls per block of ``max(window, block)`` queries, each scoring its
    queries against every key from its first query's window on: the first block ``b0 * (b0 + min(c, window - 1))``,
    every later one ``b * (b + window - 1)`` (a block of at least ``window`` queries leaves the next one's window
    wholly inside the slice's keys). Chunked attention runs each chunk of the slice as a causal block over its
    chunk's keys (the packed rows' paths): the visible pairs; a slice over more than ``MAX_CHUNK_BLOCKS`` chunks
    scores each query against every key it reads in one call under the dense mask."""
    pairs = visible_pairs(s, c, window)
    if isinstance(window, Chunked):
        s, keys = np.asarray(s, float), visible_keys(s, c, window)   # keys: the slice and its chunk's earlier part
        chunks = np.floor((keys - 1.0) / window.size) + 1.0
        return np.where(chunks > MAX_CHUNK_BLOCKS, s * keys, pairs)
    if window is None:
        return pairs
    s, c = np.asarray(s, float), np.asarray(c, float)
    size = float(max(window, block))
    first = np.minimum(s, size)
    rest = s - first
    full = np.floor(rest / size)
    tail = rest - full * size
    banded = (first * (first + np.minimum(c, window - 1.0)) + full * size * (size + window - 1.0)
              + tail * (tail + window - 1.0))
    return np.where(c + s > window, banded, pairs)


#: A model's windows: None (full causal attention on every layer), one window (or ``Chunked``) for every layer, or
#: one entry per layer (None for a layer of full attention).
Windows = Union[None, int, Chunked, Sequence[Attention]]


@dataclass(frozen=True)
class TransformerSpec:
    """A decoder-only transformer: ``num_layers`` blocks of width ``hidden``; ``vocab`` sizes the LM head.

    ``ffn_hidden``: the MLP's inner width (None: 4 * hidden, GPT's). ``num_kv_heads``: key/value heads of
    grouped-query attention (None: num_heads, i.e. multi-head attention); it must divide ``num_heads``.
    ``block``: the block layout, one of ``BLOCKS`` (``"gpt"``: LayerNorm, GeLU MLP of 2 matrices, biases;
    ``"llama"``: RMSNorm, rotary positions, SwiGLU MLP of 3 matrices, no biases): it sets the GEMMs and how many
    small kernels a block launches, which is what a short slice pays for.
    ``window``: sliding-window attention, query t seeing key k iff k <= t and t - k < w (``transformers``' mask):
    None for full causal attention on every layer, an int w for every layer (Mistral), or one entry per layer,
    None for a layer of full attention (Gemma 2/3, Qwen2/3 and others, whose ``layer_types`` mix
    ``'sliding_attention'`` and ``'full_attention'`` layers); an entry (or the whole) may be ``Chunked(C)`` for
    chunked attention (Llama 4's ``'chunked_attention'`` layers); ``layer_windows`` spells it out per layer.
    """

    num_layers: int
    hidden: int
    num_heads: int
    vocab: int
    seq_len: int
    ffn_hidden: Optional[int] = None
    num_kv_heads: Optional[int] = None
    block: str = "gpt"
    window: Windows = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "num_heads", "vocab", "seq_len"):
            check_int(getattr(self, name), f"TransformerSpec.{name}", minimum=1, wrong_type=ValueError)
        if self.hidden % self.num_heads:
            raise ValueError(f"TransformerSpec.hidden = {self.hidden} is not divisible by num_heads = "
                             f"{self.num_heads}; pick num_heads dividing hidden")
        if self.ffn_hidden is not None:
            check_int(self.ffn_hidden, "TransformerSpec.ffn_hidden", minimum=1, wrong_type=ValueError,
                      fix="give the MLP's inner width, or None for 4 * hidden")
        if self.num_kv_heads is not None:
            check_int(self.num_kv_heads, "TransformerSpec.num_kv_heads", minimum=1, wrong_type=ValueError,
                      fix="give the key/value heads, or None for num_heads")
            if self.num_heads % self.num_kv_heads:
                raise ValueError(f"TransformerSpec.num_kv_heads = {self.num_kv_heads} does not divide num_heads = "
                                 f"{self.num_heads}; grouped-query attention shares each K/V head among equal "
                                 "groups of query heads: pick a divisor")
        if self.block not in BLOCKS:
            raise ValueError(f"TransformerSpec.block = {self.block!r} is unknown; valid blocks: "
                             f"{', '.join(BLOCKS)}")
        object.__setattr__(self, "window", self._checked_window(self.window))

    def _checked_window(self, window: Windows) -> Windows:
        fix = "give a window of at least 1 key, or None for full causal attention"
        if window is None or isinstance(window, Chunked):
            return window
        if not isinstance(window, Sequence) or isinstance(window, str):
            return check_int(window, "TransformerSpec.window", fix=fix + " (a list: one per layer)",
                             wrong_type=ValueError)
        if len(window) != self.num_layers:
            raise ValueError(f"TransformerSpec.window has {len(window)} entries for num_layers = {self.num_layers}; "
                             "give one window (or None) per layer, or one int for every layer")
        return tuple(w if w is None or isinstance(w, Chunked) else
                     check_int(w, f"TransformerSpec.window[{i}]", fix=fix, wrong_type=ValueError)
                     for i, w in enumerate(window))

    @property
    def layer_windows(self) -> tuple[Attention, ...]:
        """Each layer's sliding window (or ``Chunked``), None for full causal attention."""
        if self.window is None or isinstance(self.window, (int, Chunked)):
            return (self.window,) * self.num_layers
        return tuple(self.window)

    def window_counts(self, first_layer: int, num_layers: int) -> tuple[tuple[Attention, int], ...]:
        """(window, how many layers) over the layers [first_layer, first_layer + num_layers), full attention first,
        then windows by size, then chunks: what a run of layers costs depends on this alone. A single window (or
        none) holds for any layer index."""
        if self.window is None or isinstance(self.window, (int, Chunked)):
            return ((self.window, num_layers),) if num_layers else ()
        if first_layer < 0 or first_layer + num_layers > self.num_layers:
            raise ValueError(f"layers [{first_layer}, {first_layer + num_layers}) are not all among the "
                             f"{self.num_layers} layers whose windows TransformerSpec.window gives; cost layers of "
                             "the model only")
        counts = Counter(self.window[first_layer:first_layer + num_layers])
        return tuple(sorted(counts.items(), key=lambda item: (0, 0) if item[0] is None else
                            (2, item[0].size) if isinstance(item[0], Chunked) else (1, item[0])))

    @property
    def ffn(self) -> int:
        return 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden

    @property
    def kv_width(self) -> int:
        """Width of the keys (and of the values): kv heads x head size."""
        kv_heads = self.num_heads if self.num_kv_heads is None else self.num_kv_heads
        return kv_heads * (self.hidden // self.num_heads)

    @property
    def linears(self) -> tuple[tuple[int, int], ...]:
        """(in, out) features of each Linear of a block."""
        h, f, kv = self.hidden, self.ffn, self.kv_width
        if self.block == "llama":
            return ((h, h), (h, kv), (h, kv), (h, h), (h, f), (h, f), (f, h))
        return ((h, h + 2 * kv), (h, h), (h, f), (f, h))

    def io_elements_per_token(self) -> float:
        """Elements the small ops of a block's forward read and write per token (in units of 16-bit values).

        gpt: 2 LayerNorms (2h each), 2 residual adds (3h), GeLU (2f), the K/V copy into the prefix cache (4kv).
        llama: 2 eager RMSNorms (about 19h each: an fp32 copy, square, mean, scale, back to 16 bit, weight),
        rotary positions on queries and keys (about 11 per element), 2 residual adds, SwiGLU's SiLU and product
        (5f), the K/V copy.
        """
        h, f, kv = self.hidden, self.ffn, self.kv_width
        if self.block == "llama":
            return 38.0 * h + 11.0 * (h + kv) + 6.0 * h + 5.0 * f + 4.0 * kv
        return 4.0 * h + 6.0 * h + 2.0 * f + 4.0 * kv


@dataclass(frozen=True)
class DeviceSpec:
    """An accelerator for the roofline estimate (see the module docstring for how the fields are used).

    ``peak_tflops``: dense peak in the training precision; ``mem_bw_gbps``: memory bandwidth in GB/s (bytes);
    ``efficiency``: fraction of peak a large GEMM reaches (0, 1]; ``per_layer_overhead_ms``: fixed host cost per
    layer per pass that is not a kernel (module calls, hooks); ``link_gbps``: stage-to-stage link in Gbit/s (bits,
    as network links are quoted); ``link_latency_ms``: per-message latency.

    The fields after these default to the plain roofline of peak and bandwidth. ``bandwidth_efficiency``:
    fraction of ``mem_bw_gbps`` a GEMM reaches when bound by reading its weight (a short slice's GEMMs are);
    ``stream_efficiency``: the fraction elementwise kernels and the gradients' accumulation reach (None:
    ``bandwidth_efficiency``); ``attention_efficiency``: fraction of peak the attention kernels reach (None:
    ``efficiency``; flash attention reaches less than a GEMM). ``kernel_launch_ms``: the least time one kernel
    dispatched from Python costs (an eager op's host dispatch and launch), what a short slice's many small ops
    cost; ``backward_launch_ms``: the same for the ops the autograd engine runs in a backward, which skips Python
    (None: ``kernel_launch_ms``).
    """

    name: str
    peak_tflops: float
    mem_bw_gbps: float
    per_layer_overhead_ms: float
    efficiency: float
    link_gbps: float
    link_latency_ms: float
    bandwidth_efficiency: float = 1.0
    stream_efficiency: Optional[float] = None
    attention_efficiency: Optional[float] = None
    kernel_launch_ms: float = 0.0
    backward_launch_ms: Optional[float] = None

    def __post_init__(self) -> None:
        fix = "use a finite number (see presets.py for examples)"
        for name in ("peak_tflops", "mem_bw_gbps", "link_gbps"):
            check_number(getattr(self, name), f"DeviceSpec.{name}", positive=True, fix=fix)
        for name in ("per_layer_overhead_ms", "link_latency_ms", "kernel_launch_ms", "backward_launch_ms"):
            if getattr(self, name) is not None:
                check_number(getattr(self, name), f"DeviceSpec.{name}", fix=fix)
        for name in ("efficiency", "bandwidth_efficiency", "stream_efficiency", "attention_efficiency"):
            value = getattr(self, name)
            if value is None and name != "efficiency":
                continue
            check_number(value, f"DeviceSpec.{name}", positive=True, fix=fix)
            if value > 1:
                raise ValueError(f"DeviceSpec.{name} = {value!r} must be in (0, 1]; it is a fraction of the "
                                 f"data sheet's {'bandwidth' if name == 'bandwidth_efficiency' else 'peak'}")


class Roofline:
    """Per-layer times of a ``TransformerSpec`` on a ``DeviceSpec``, vectorised over tokens and contexts (ms).

    ``m`` is new tokens in the pass (batch x slice), ``s`` the slice length, ``c`` the cached prefix, ``b`` the
    batch: numpy arrays that broadcast.
    """

    def __init__(self, model: TransformerSpec, device: DeviceSpec, bytes_per_element: int = 2) -> None:
        self.model, self.device = model, device
        self.e = float(bytes_per_element)
        self.flops_per_ms = device.peak_tflops * device.efficiency * 1e9
        attention = device.efficiency if device.attention_efficiency is None else device.attention_efficiency
        self.attention_flops_per_ms = device.peak_tflops * attention * 1e9
        self.bytes_per_ms = device.mem_bw_gbps * device.bandwidth_efficiency * 1e6
        stream = device.bandwidth_efficiency if device.stream_efficiency is None else device.stream_efficiency
        self.stream_bytes_per_ms = device.mem_bw_gbps * stream * 1e6
        self.launch = device.kernel_launch_ms
        self.backward_launch = device.kernel_launch_ms if device.backward_launch_ms is None else \
            device.backward_launch_ms
        self.kernels = BLOCKS[model.block]
        lin = np.array(model.linears, dtype=float)                      # (num_linears, 2): in, out
        self._k, self._n = lin[:, 0], lin[:, 1]
        self.linear_params = float((self._k * self._n).sum()) + (float(self._n.sum()) if self.kernels.biases else 0)
        self.norm_params = self.kernels.norm_params / 2 * model.hidden   # a weight (and a bias) per norm

    # -- kernels ----------------------------------------------------------------------------------------------
    def kernel(self, flops: np.ndarray | float, nbytes: np.ndarray | float, *, attention: bool = False,
               backward: bool = False) -> np.ndarray:
        """One kernel: the slowest of its FLOPs, its bytes and the launch floor (``backward``: launched by the
        autograd engine)."""
        rate = self.attention_flops_per_ms if attention else self.flops_per_ms
        return np.maximum(np.maximum(np.asarray(flops, float) / rate, np.asarray(nbytes, float) / self.bytes_per_ms),
                          self.backward_launch if backward else self.launch)

    def small_ops(self, count: float, nbytes: np.ndarray | float, *, backward: bool = False) -> np.ndarray:
        """A group of small kernels: their launch floors or their bytes, whichever is longer."""
        launch = self.backward_launch if backward else self.launch
        return np.maximum(count * launch, np.asarray(nbytes, float) / self.stream_bytes_per_ms)

    def gemm(self, m: np.ndarray, k: float, n: float, *, backward: bool = False) -> np.ndarray:
        """(m, k) @ (k, n) with a (k, n) operand read or written whole (a weight, or a weight's gradient)."""
        return self.kernel(2.0 * m * k * n, (k * n + m * (k + n)) * self.e, backward=backward)

    def _gemms(self, m: np.ndarray, *, transpose: bool = False, backward: bool = False) -> np.ndarray:
        return sum(self.gemm(m, *((n, k) if transpose else (k, n)), backward=backward)
                   for k, n in zip(self._k, self._n))

    # -- passes of one layer ----------------------------------------------------------------------------------
    def attention_flops(self, s: np.ndarray, c: np.ndarray, b: np.ndarray, window: Attention = None
                        ) -> np.ndarray:
        """Scores and weights @ V over the (query, key) pairs the runtime computes for the slice
        (``computed_pairs``: the c cached keys and the causal triangle of the slice; under a sliding ``window``
        that hides keys, every key the slice reads for every query), 2 per FMA."""
        return 4.0 * b * self.model.hidden * computed_pairs(s, c, window)

    def _attention_bytes(self, s: np.ndarray, c: np.ndarray, b: np.ndarray, window: Attention) -> np.ndarray:
        # queries in, outputs out (b*s*h each); keys and values the slice sees (b*visible_keys*kv each)
        return (2.0 * b * s * self.model.hidden + 2.0 * b * visible_keys(s, c, window) * self.model.kv_width) * self.e

    def layer_forward_ms(self, s: np.ndarray, c: np.ndarray, b: np.ndarray, window: Attention = None
                         ) -> np.ndarray:
        """One layer's forward whose attention has the sliding ``window`` (None: full causal attention)."""
        m = b * s
        attention = self.kernel(self.attention_flops(s, c, b, window), self._attention_bytes(s, c, b, window),
                                attention=True)
        small = self.small_ops(self.kernels.forward, self.model.io_elements_per_token() * m * self.e)
        return self._gemms(m) + attention + small + self.device.per_layer_overhead_ms

    def layer_input_grad_ms(self, s: np.ndarray, c: np.ndarray, b: np.ndarray, window: Attention = None
                            ) -> np.ndarray:
        """Backward without the Linears' weight gradients: dX GEMMs (each reads its weight), attention's
        backward (the visible prefix's K/V gradients added into the cache's: 3 more passes over them), the small
        ops' backward (twice the forward's bytes: saved inputs and gradients read, gradients written)."""
        m = b * s
        kv_grads = 6.0 * b * visible_keys(s, c, window) * self.model.kv_width * self.e
        attention = self.kernel(_ATTENTION_BACKWARD_FLOPS * self.attention_flops(s, c, b, window),
                                2.0 * self._attention_bytes(s, c, b, window) + kv_grads, attention=True,
                                backward=True)
        small = self.small_ops(self.kernels.input_grad, 2.0 * self.model.io_elements_per_token() * m * self.e,
                               backward=True)
        return self._gemms(m, transpose=True, backward=True) + attention + small + self.device.per_layer_overhead_ms

    def layer_weight_grad_ms(self, m: np.ndarray, *, backward: bool = True) -> np.ndarray:
        """The Linears' weight gradients of m tokens: one GEMM each writing its (in, out) gradient (reading the
        tokens' inputs and output gradients), and the bias gradients' sums over tokens. ``backward``: run by the
        autograd engine (a deferred W pass is launched from Python)."""
        bias = self.small_ops(len(self._n), m * self._n.sum() * self.e, backward=backward) \
            if self.kernels.biases else 0.0
        return self._gemms(m, backward=backward) + bias

    def gather_ms(self, m: np.ndarray) -> np.ndarray:
        """A W pass over several slices lays their inputs and output gradients end to end per Linear (one copy,
        read and written) before its GEMM."""
        return self.small_ops(2 * len(self._n), 2.0 * m * (self._k + self._n).sum() * self.e)

    def accumulate_ms(self, num_elements: float, num_tensors: int) -> float:
        """Adding a pass's gradients into ``.grad`` (autograd's AccumulateGrad): read both, write one."""
        return float(self.small_ops(num_tensors, 3.0 * num_elements * self.e, backward=True))

    def linear_accumulate_ms(self) -> float:
        return self.accumulate_ms(self.linear_params, len(self._n) * (2 if self.kernels.biases else 1))

    def norm_accumulate_ms(self) -> float:
        return self.accumulate_ms(self.norm_params, self.kernels.norm_params)
