"""load_model: build an HFModelAdapter from a local checkpoint directory or a transformers config.

Local only: config, safetensors weights and tokenizer are read from the directory with
``local_files_only=True``; nothing touches the network. Unsupported families are refused before any
weights are read.
"""

from __future__ import annotations

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

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _load_tokenizer(path: Path) -> Any | None:
    if not any((path / name).exists() for name in _TOKENIZER_FILES):
        logger.info("no tokenizer files in %s; the adapter has tokenizer=None", path)
        return None
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_model(
    path_or_config: str | os.PathLike[str] | PretrainedConfig,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
) -> HFModelAdapter:
    """Load an HF causal LM with ``attn_implementation="compile_attn"`` and wrap it.

    ``path_or_config``: a local directory (config.json + safetensors [+ tokenizer]) or a config, which
    gives a randomly initialised model. ``dtype``: None keeps the checkpoint's dtype (float32 for a
    config). The model is put in eval mode on ``device``.
    """
    register()
    if isinstance(path_or_config, PretrainedConfig):
        check_supported(path_or_config)
        model = AutoModelForCausalLM.from_config(
            path_or_config, attn_implementation=ATTN_IMPLEMENTATION, dtype=dtype or torch.float32
        )
        return HFModelAdapter(model.to(device).eval())

    path = Path(path_or_config)
    if not path.is_dir() or not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{str(path_or_config)!r} is not a local model directory with a config.json; compile_attn loads "
            f"from local directories only (download the checkpoint first, e.g. "
            f"`hf download REPO --local-dir DIR`)"
        )
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    check_supported(config)
    model = AutoModelForCausalLM.from_pretrained(
        path,
        config=config,
        dtype=dtype if dtype is not None else "auto",
        attn_implementation=ATTN_IMPLEMENTATION,
        local_files_only=True,
    )
    return HFModelAdapter(model.to(device).eval(), tokenizer=_load_tokenizer(path))
