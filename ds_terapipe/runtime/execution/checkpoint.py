"""Checkpoints that cannot be half-written, silently mismatched, or lost.

DeepSpeed writes a pipeline checkpoint as one file per layer plus per-rank state files under
``save_dir/tag/``, then a ``latest`` file naming the tag. On top of that:

* a manifest (``terapipe_manifest.json``: every file's size and SHA-256, the plan, the terapipe config and the
  stage count) is written only after every rank finished writing, and ``latest`` only after the manifest,
  each by an atomic rename. A crash mid-save leaves ``latest`` on the previous complete checkpoint.
* loading checks the manifest first (a missing, truncated or altered file is refused, naming it) and checks
  the layer files' tensor shapes against this model before anything is loaded, so a checkpoint of a model with
  other dimensions is refused with both shapes and leaves the model untouched.
* bf16 with ZeRO stage 0 resumes exactly (:func:`load_bf16_optimizer_state`), which DeepSpeed's own load cannot.
* :func:`export_state_dict` turns a checkpoint into one plain state dict (``"{layer}.{param}"``), for inference
  or for loading into a single ``nn.Module``.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
from typing import Any, Optional

import torch

from ..._io import atomic_write_text
from .errors import CheckpointError

__all__ = ["MANIFEST", "write_manifest", "verify_manifest", "write_latest", "read_latest", "read_manifest",
           "check_layer_shapes", "export_state_dict", "bf16_optimizer_file", "load_bf16_optimizer_state",
           "CheckpointError"]

logger = logging.getLogger(__name__)

MANIFEST = "terapipe_manifest.json"
_LAYER_FILE = re.compile(r"layer_(\d+)-.*model_states\.pt$")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(tag_dir: str) -> list[str]:
    out = []
    for root, _, names in os.walk(tag_dir):
        for name in names:
            if name != MANIFEST and ".tmp" not in name:
                out.append(os.path.relpath(os.path.join(root, name), tag_dir))
    return sorted(out)


def write_manifest(tag_dir: str, meta: dict[str, Any]) -> None:
    """Record every file of a finished checkpoint (call once, after all ranks wrote theirs)."""
    files = {rel: {"bytes": os.path.getsize(os.path.join(tag_dir, rel)), "sha256": _sha256(os.path.join(tag_dir, rel))}
             for rel in _files(tag_dir)}
    atomic_write_text(os.path.join(tag_dir, MANIFEST), json.dumps({"files": files, **meta}, indent=1))


def read_manifest(tag_dir: str) -> dict[str, Any]:
    path = os.path.join(tag_dir, MANIFEST)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {tag_dir} has no {MANIFEST}: it is incomplete (a save was interrupted) "
                              "or was not written by ds_terapipe; load an earlier tag") from None
    except ValueError as err:
        raise CheckpointError(f"checkpoint {tag_dir}: {MANIFEST} is corrupt ({err}); load an earlier tag") from None


def verify_manifest(tag_dir: str) -> dict[str, Any]:
    """The manifest, after checking that every file it lists is present and unchanged."""
    manifest = read_manifest(tag_dir)
    for rel, info in manifest.get("files", {}).items():
        path = os.path.join(tag_dir, rel)
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint {tag_dir} is incomplete: {rel} is missing; load an earlier tag")
        size = os.path.getsize(path)
        if size != info["bytes"]:
            raise CheckpointError(f"checkpoint {tag_dir} is corrupt: {rel} has {size} bytes, the manifest says "
                                  f"{info['bytes']} (truncated write?); load an earlier tag")
        if _sha256(path) != info["sha256"]:
            raise CheckpointError(f"checkpoint {tag_dir} is corrupt: {rel} does not match its SHA-256 in the "
                                  "manifest; load an earlier tag")
    return manifest


def write_latest(save_dir: str, tag: str) -> None:
    atomic_write_text(os.path.join(save_dir, "latest"), tag)


def read_latest(load_dir: str) -> Optional[str]:
    path = os.path.join(load_dir, "latest")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip()


def check_layer_shapes(module: Any, tag_dir: str) -> Optional[str]:
    """Compare this rank's layers (every chunk's) with their files in the checkpoint; describe the first
    mismatch."""
    from ..features.vocab import layer_fills

    fills = layer_fills(tag_dir)   # what vocabulary parallelism keeps in its shards instead of layer files
    for _ in module.each_chunk() if hasattr(module, "each_chunk") else [None]:
        problem = _check_chunk_shapes(module, tag_dir, fills)
        if problem:
            return problem
    return None


def _check_chunk_shapes(module: Any, tag_dir: str, fills: dict[int, dict[str, torch.Tensor]]) -> Optional[str]:
    for local_idx, layer in enumerate(module.forward_funcs):
        if not hasattr(layer, "state_dict"):
            continue
        files = module.ckpt_layer_path_list(tag_dir, local_idx)
        idx = local_idx + module._local_start
        if not files and idx not in fills:
            return f"layer {idx} ({type(layer).__name__}) has no file in the checkpoint"
        saved = {**(torch.load(files[0], map_location="cpu", weights_only=True) if files else {}), **fills.get(idx, {})}
        current = layer.state_dict()
        missing = sorted(set(current) - set(saved))
        if missing:
            return f"layer {idx} ({type(layer).__name__}): the checkpoint lacks {missing[:3]}"
        for name, tensor in current.items():
            if tuple(saved[name].shape) != tuple(tensor.shape):
                return (f"layer {idx} {name} is {tuple(saved[name].shape)} in the checkpoint but "
                        f"{tuple(tensor.shape)} in this model")
    return None


def export_state_dict(checkpoint_dir: str, tag: Optional[str] = None) -> dict[str, torch.Tensor]:
    """One plain state dict ``{"<layer index>.<param>": tensor}`` from a pipeline checkpoint, on CPU.

    Needs no process group: it reads the per-layer files DeepSpeed wrote (any number of stages), after
    verifying the manifest. Tied layers appear under each index that uses them. An output layer split by
    ``terapipe.vocab_parallel`` appears whole, under its layer index, and so does a tied input embedding split
    with it, under its own (``runtime/features/vocab.py``).

    ``checkpoint_dir`` is the save directory (its ``latest`` file, or ``tag``, names the tag), or a tag directory
    itself (``ckpt/global_step3``: it holds the layer files or the manifest), which is exported as it is.
    """
    tag_dir = _export_tag_dir(checkpoint_dir, tag)
    verify_manifest(tag_dir)
    out: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(tag_dir, "layer_*model_states.pt"))):
        match = _LAYER_FILE.search(os.path.basename(path))
        if match is None:
            continue
        layer = int(match.group(1))
        for name, tensor in torch.load(path, map_location="cpu", weights_only=True).items():
            out.setdefault(f"{layer}.{name}", tensor)
    from ..features.vocab import layer_fills

    for layer, tensors in layer_fills(tag_dir).items():
        out.update({f"{layer}.{name}": tensor for name, tensor in tensors.items()})
    if not out:
        raise CheckpointError(f"checkpoint {tag_dir} holds no layer files (layer_XX-...model_states.pt)")
    return out


def _is_tag_dir(path: str) -> bool:
    """Whether ``path`` is one checkpoint tag's directory: it holds the manifest or DeepSpeed's layer files."""
    return os.path.isfile(os.path.join(path, MANIFEST)) or \
        any(_LAYER_FILE.search(name) for name in os.listdir(path))


def _tags(checkpoint_dir: str) -> list[str]:
    """The tag directories under a save directory."""
    return sorted(name for name in os.listdir(checkpoint_dir)
                  if os.path.isdir(os.path.join(checkpoint_dir, name)) and _is_tag_dir(os.path.join(checkpoint_dir,
                                                                                                    name)))


def _export_tag_dir(checkpoint_dir: str, tag: Optional[str]) -> str:
    """The tag directory :func:`export_state_dict` reads, each wrong path refused with what to pass instead."""
    if not os.path.isdir(checkpoint_dir):
        what = "is a file, not a directory" if os.path.exists(checkpoint_dir) else "does not exist"
        raise CheckpointError(f"checkpoint directory {checkpoint_dir} {what}; pass the directory the checkpoint was "
                              "saved to (save_checkpoint's save_dir) or one of its tag directories")
    if _is_tag_dir(checkpoint_dir):
        parent, name = os.path.split(os.path.normpath(checkpoint_dir))
        if tag is not None and tag != name:
            raise CheckpointError(f"{checkpoint_dir} is itself the checkpoint of tag {name!r}, but tag={tag!r} was "
                                  f"passed; pass tag={name!r} (or none), or the save directory {parent or '.'} with "
                                  f"tag={tag!r}")
        logger.info("terapipe: %s is a tag directory: exporting tag %r", checkpoint_dir, name)
        return checkpoint_dir
    tag = tag or read_latest(checkpoint_dir)
    if tag is None:
        raise CheckpointError(f"{checkpoint_dir} has no 'latest' file; pass tag= (one of {_tags(checkpoint_dir)})")
    tag_dir = os.path.join(checkpoint_dir, tag)
    if not os.path.isdir(tag_dir):
        raise CheckpointError(f"checkpoint directory {checkpoint_dir} has no tag {tag!r} ({tag_dir} does not exist); "
                              f"pass tag= one of {_tags(checkpoint_dir)}")
    return tag_dir


# -- bf16 with ZeRO stage 0 ------------------------------------------------------------------------------------
# DeepSpeed runs bf16 without ZeRO through its BF16_Optimizer, which keeps the fp32 master weights and the base
# optimizer's state partitioned over the data-parallel ranks like ZeRO stage 1 does, and saves them the same way:
# one ``bf16_zero_pp_rank_{dp}_mp_rank_{stage}_optim_states.pt`` per rank. DeepSpeed 0.19.8's load_checkpoint
# decides by ``zero_optimization()`` alone (false at stage 0) and hands BF16_Optimizer the one optimizer state dict
# of the model-states file where it expects the list of every data-parallel rank's (KeyError: 0); and with
# ``load_optimizer_states=False`` it leaves the fp32 masters at their initial values, so the first step after
# the load overwrites the loaded weights (so it does for fp16's FP16_Optimizer and FP16_UnfusedOptimizer: the
# engine refreshes their masters from the loaded weights). The engine therefore lets DeepSpeed load everything
# but the bf16 optimizer and loads that here, from the per-rank files, as DeepSpeed's ZeRO load does.


def bf16_optimizer_file(tag_dir: str, *, dp_rank: int, dp_world_size: int, mp_rank: int,
                        saved_dp_world_size: Optional[int]) -> str:
    """The file in which DeepSpeed's BF16_Optimizer saved data-parallel rank ``dp_rank``'s partition of stage
    (model-parallel rank) ``mp_rank``, after checking this run can load it (called before anything is loaded)."""
    if saved_dp_world_size is not None and saved_dp_world_size != dp_world_size:
        raise CheckpointError(
            f"checkpoint {tag_dir} holds bf16 optimizer state partitioned over {saved_dp_world_size} data-parallel "
            f"ranks, this run has {dp_world_size}: the partitions cannot be split again; resume with "
            f"{saved_dp_world_size} replicas, or load weights only (load_optimizer_states=False)")
    path = os.path.join(tag_dir, f"bf16_zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt")
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {tag_dir} lacks {os.path.basename(path)}, the bf16 optimizer state of "
                              f"data-parallel rank {dp_rank} of stage {mp_rank}: it was not saved with bf16 at ZeRO "
                              "stage 0; load weights only (load_optimizer_states=False)")
    return path


def load_bf16_optimizer_state(optimizer: Any, path: Optional[str], *, dp_rank: int, dp_world_size: int,
                              load_from_fp32_weights: bool) -> None:
    """Load DeepSpeed's BF16_Optimizer (bf16, ZeRO stage 0) once the model holds the checkpoint's weights: its
    fp32 master weights and base optimizer state from ``path`` (:func:`bf16_optimizer_file`), or with no path
    (weights only) the fp32 masters from the loaded bf16 weights.

    Why the masters are refreshed first: BF16_Optimizer copies the saved fp32 partition only with
    ``load_from_fp32_weights`` (``zero_optimization.load_from_fp32_weights``, on by default); without it the
    masters would keep their initial values. Only this rank's file is read: the optimizer indexes the list it is
    given by its own data-parallel rank and reads no other entry (DeepSpeed's ZeRO load reads every rank's).
    """
    optimizer.refresh_fp32_params()
    if path is None:
        return
    states: list[Optional[dict]] = [None] * dp_world_size
    states[dp_rank] = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    optimizer.load_state_dict(states, load_optimizer_states=True, load_from_fp32_weights=load_from_fp32_weights)
    logger.info("terapipe: bf16 optimizer state of data-parallel rank %d loaded from %s", dp_rank, path)
