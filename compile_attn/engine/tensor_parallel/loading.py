"""Each tensor-parallel rank's model: the checkpoint directory every rank reads its shard from, and the load.

Every rank calls ``load_sharded`` on one local directory and reads only its own slices. A model given as a
directory is read where it is; a transformers config or an HF model instance is first written once by rank 0 to a
temporary safetensors checkpoint (``prepare_checkpoint``), so that every rank holds exactly the weights that
``tensor_parallel_size=1`` would use (a config's random weights under the caller's seed included).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from compile_attn.engine.execution.model_loading import LoadedModel, eos_ids_of, load_for_engine
from compile_attn.engine.requests.config import EngineConfig
from compile_attn.errors import InvalidConfigError

logger = logging.getLogger(__name__)


class Checkpoint:
    """The directory the ranks load from; ``temporary`` when rank 0 wrote it (removed by ``cleanup``)."""

    def __init__(self, path: str, temporary: bool, tokenizer: Any = None) -> None:
        self.path, self.temporary, self.tokenizer = path, temporary, tokenizer

    def cleanup(self) -> None:
        if self.temporary:
            shutil.rmtree(self.path, ignore_errors=True)
            self.temporary = False


def check_split(model: Any, size: int) -> Any:
    """The HF config of ``model`` (a local HF directory, a transformers config or an HF model), checked to split over
    ``size`` ranks (UnsupportedConfigError naming the sizes that work); before any worker starts."""
    from transformers import AutoConfig

    from compile_attn.distributed.shard_hf import plan_for

    if isinstance(model, (str, os.PathLike)):
        if not (Path(model) / "config.json").is_file():
            raise FileNotFoundError(f"{os.fspath(model)!r} is not a local model directory with a config.json")
        hf_config = AutoConfig.from_pretrained(model, local_files_only=True)
    else:
        hf_config = getattr(getattr(model, "model", model), "config", model)
    if not hasattr(hf_config, "num_attention_heads"):
        raise InvalidConfigError(
            f"tensor_parallel_size={size} shards HF models only; got {type(model).__name__}. Pass a local HF "
            f"directory, a transformers config or an HF model, or use tensor_parallel_size=1")
    plan_for(hf_config, 0, size)
    return hf_config


def prepare_checkpoint(model: Any, tokenizer: Any, config: EngineConfig) -> Checkpoint:
    """The checkpoint directory for ``model`` (see ``check_split``): the directory itself, or a temporary one that
    a config's or an HF model's weights are written to."""
    if isinstance(model, (str, os.PathLike)):
        return Checkpoint(os.fspath(model), temporary=False, tokenizer=tokenizer)
    hf_config = getattr(getattr(model, "model", model), "config", model)
    start = time.perf_counter()
    if hf_config is model:  # a config: its random weights, made as tensor_parallel_size=1 makes them on the CPU
        loaded = load_for_engine(model, tokenizer=tokenizer, dtype=config.dtype, device=torch.device("cpu"))
        hf_model, tokenizer = loaded.model.model, loaded.tokenizer
    else:  # an HF model or adapter, saved where it is
        hf_model = getattr(model, "model", model) if not hasattr(model, "save_pretrained") else model
        tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    path = tempfile.mkdtemp(prefix="compile_attn_tp_")
    try:
        hf_model.save_pretrained(path, safe_serialization=True)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    logger.info("tensor parallel: wrote the model to %s for the ranks to load their shards (%.2f s)", path,
                time.perf_counter() - start)
    return Checkpoint(path, temporary=True, tokenizer=tokenizer)


def load_rank(path: str, rank: int, world_size: int, *, dtype: torch.dtype, device: torch.device,
              tokenizer: Any = None) -> LoadedModel:
    """Rank ``rank``'s shard of the checkpoint at ``path`` (``distributed.load_sharded``), as the engine loads a
    model; rank 0 also gets the tokenizer (``tokenizer``, else the directory's, if it has one)."""
    from compile_attn.distributed.load_hf import load_sharded
    from compile_attn.hf.loading import load_tokenizer

    start = time.perf_counter()
    adapter = load_sharded(path, rank, world_size, dtype=dtype, device=device)
    if rank == 0 and tokenizer is None:
        tokenizer = load_tokenizer(Path(path))
    logger.info("tensor parallel rank %d of %d: loaded its shard of %s on %s in %.2f s", rank, world_size,
                type(adapter.model).__name__, device, time.perf_counter() - start)
    hf_config = adapter.config
    plan = adapter.model.compile_attn_tp_plan
    return LoadedModel(adapter, tokenizer, eos_ids_of(hf_config, tokenizer),
                       getattr(hf_config, "max_position_embeddings", None), path,
                       kv_heads=(*plan.kv_heads, plan.num_kv_heads))
