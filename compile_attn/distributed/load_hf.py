"""``load_sharded``: build one tensor-parallel rank's HF model from a checkpoint, reading only its shards.

The model is built with its parameters on the meta device (accelerate's ``init_empty_weights``; buffers such as
the rotary frequencies are real), sharded with ``shard_model``, and each parameter is then read from the
checkpoint's safetensors with ``safe_open(...).get_slice``: a rank reads only the rows or columns it holds, so no
rank ever has a full copy of the weights in host memory. Needs no process group.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from torch import nn

from compile_attn.distributed.partition import ShardSpec, read_shard
from compile_attn.distributed.shard_hf import shard_model
from compile_attn.errors import BackendUnavailableError
from compile_attn.hf.adapter import HFModelAdapter
from compile_attn.hf.attention import ATTN_IMPLEMENTATION
from compile_attn.hf.families import check_supported
from compile_attn.hf.registration import register

logger = logging.getLogger(__name__)

_INDEX = "model.safetensors.index.json"


def _checkpoint_files(path: Path) -> list[Path]:
    if (path / _INDEX).exists():
        weight_map = json.loads((path / _INDEX).read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}; load_sharded reads safetensors checkpoints only "
                                f"(convert the checkpoint with save_pretrained(..., safe_serialization=True))")
    return files


class _Slot:
    """One parameter object of the model and every (module, attribute) that holds it (tied weights: several)."""

    def __init__(self, spec: ShardSpec | None) -> None:
        self.spec = spec
        self.owners: list[tuple[nn.Module, str]] = []
        self.names: list[str] = []


def _slots(model: nn.Module) -> dict[str, _Slot]:
    """Checkpoint name -> slot, for every name of every parameter (a tied weight is found under any of its names)."""
    by_param: dict[int, _Slot] = {}
    by_name: dict[str, _Slot] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        specs: dict[str, ShardSpec] = getattr(module, "shard_specs", {})
        for attr, param in module.named_parameters(recurse=False, remove_duplicate=False):
            slot = by_param.setdefault(id(param), _Slot(specs.get(attr)))
            name = f"{module_name}.{attr}" if module_name else attr
            slot.owners.append((module, attr))
            slot.names.append(name)
            by_name[name] = slot
    return by_name


def _empty_model(config: object, dtype: torch.dtype) -> nn.Module:
    try:
        from accelerate import init_empty_weights  # type: ignore[import-untyped]
    except ImportError as exc:
        raise BackendUnavailableError(
            "load_sharded builds the model without allocating its weights through accelerate's init_empty_weights; "
            "pip install accelerate (or compile-attn[hf])"
        ) from exc
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION, dtype=dtype)


def load_sharded(
    path: str | os.PathLike[str],
    rank: int,
    world_size: int,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> HFModelAdapter:
    """Rank ``rank``'s part of the ``world_size``-way sharded model in the local directory ``path`` (config.json and
    safetensors), on ``device`` in ``dtype`` (None: the checkpoint's dtype), in eval mode, wrapped in an
    ``HFModelAdapter`` whose ``attention_layers()`` give this rank's heads. No tokenizer (workers need none)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    register()
    path = Path(path)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    check_supported(config)
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    model = shard_model(_empty_model(config, dtype), rank, world_size)
    slots = _slots(model)
    device = torch.device(device)
    filled: set[int] = set()
    unexpected: list[str] = []
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for key in reader.keys():
                slot = slots.get(key)
                if slot is None:
                    unexpected.append(key)
                    continue
                if id(slot) in filled:  # a tied weight saved under both names
                    continue
                owner, attr = slot.owners[0]
                data = read_shard(reader.get_slice(key), slot.spec, dtype).to(device)
                param = nn.Parameter(data, requires_grad=getattr(owner, attr).requires_grad)
                for module, name in slot.owners:
                    setattr(module, name, param)
                filled.add(id(slot))
    missing = sorted({slot.names[0] for slot in slots.values() if id(slot) not in filled})
    if missing:
        raise ValueError(f"the checkpoint in {path} has no tensor for {missing[:8]}"
                         f"{' and more' if len(missing) > 8 else ''}; it does not match {type(model).__name__}")
    if unexpected:
        logger.info("load_sharded: %d checkpoint tensors not used by the model (e.g. %s)", len(unexpected),
                    unexpected[:3])
    model.to(device)  # the buffers (rotary frequencies, embedding scales); parameters are there already
    return HFModelAdapter(model.eval())
