"""load_model: build an HFModelAdapter from a local checkpoint directory or a transformers config.

Local only: config, safetensors weights and tokenizer are read from the directory with
``local_files_only=True``; a Hugging Face model id is first resolved to its snapshot in the local cache
(``compile_attn.hub``, which downloads a missing one unless HF_HUB_OFFLINE is set). Unsupported families are refused before any
weights are read. Weights are created on the target device (a config's random initialisation runs there) and
checkpoints load straight to it with a ``device_map`` (which transformers supports where accelerate is
installed; without it they load to the CPU and move).
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from compile_attn.hf.adapter import HFModelAdapter
from compile_attn.hf.attention import ATTN_IMPLEMENTATION
from compile_attn.hf.families import check_supported
from compile_attn.hf.registration import register
from compile_attn.hub import TOKENIZER_FILES, resolve_model

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = TOKENIZER_FILES


def load_tokenizer(path: Path) -> Any | None:
    """The tokenizer of local directory ``path`` (None when it has no tokenizer files)."""
    if not any((path / name).exists() for name in _TOKENIZER_FILES):
        logger.info("no tokenizer files in %s; the adapter has tokenizer=None", path)
        return None
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _device_map(device: torch.device) -> dict[str, Any]:
    """``from_pretrained`` arguments that load the weights straight to ``device``: transformers needs accelerate
    for a ``device_map``; without it the weights load to the CPU and move (one log line says so)."""
    if importlib.util.find_spec("accelerate") is not None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return {"device_map": {"": device}}
    if device.type != "cpu":
        logger.info("accelerate is not installed: the checkpoint loads to the CPU, then moves to %s "
                    "(pip install accelerate to load it straight to the device)", device)
    return {}


def load_model(
    path_or_config: str | os.PathLike[str] | PretrainedConfig,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    revision: str | None = None,
) -> HFModelAdapter:
    """Load an HF causal LM with ``attn_implementation="compile_attn"`` and wrap it.

    ``path_or_config``: a local directory (config.json + safetensors [+ tokenizer]), a Hugging Face model id (its copy
    in the local Hugging Face cache at ``revision``, else downloaded there: compile_attn.hub) or a config, which
    gives a randomly initialised model. ``dtype``: None keeps the checkpoint's dtype (float32 for a
    config). The model is put in eval mode on ``device``.

    A config's weights are created on ``device`` in ``dtype`` (HF's own initialisation, run under
    ``torch.device(device)``): under one ``torch.manual_seed`` they equal those of
    ``AutoModelForCausalLM.from_config(config, dtype=dtype)`` built on the same device, so on the CPU they are
    HF's ordinary model; CUDA's random generator is another stream than the CPU's, so a CUDA model differs
    from a CPU-initialised one of the same seed.
    """
    register()
    device = torch.device(device)
    if isinstance(path_or_config, PretrainedConfig):
        check_supported(path_or_config)
        # A copy: the model keeps its config, and another model built from the caller's object (e.g. with
        # attn_implementation="eager") would otherwise switch this one's attention too.
        config = copy.deepcopy(path_or_config)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                config, attn_implementation=ATTN_IMPLEMENTATION, dtype=dtype or torch.float32
            )
        return HFModelAdapter(model.eval())

    path = Path(resolve_model(path_or_config, revision=revision))  # a local directory, or a model id's snapshot
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    check_supported(config)
    model = AutoModelForCausalLM.from_pretrained(
        path,
        config=config,
        dtype=dtype if dtype is not None else "auto",
        attn_implementation=ATTN_IMPLEMENTATION,
        local_files_only=True,
        **_device_map(device),
    )
    return HFModelAdapter(model.to(device).eval(), tokenizer=load_tokenizer(path))
