"""A tiny Llama (transformers ``LlamaForCausalLM``) trained briefly on the CPU, so a first run shows real text.

The text is English prose from Python's own installation (the reference-manual topics that ``pydoc`` ships in
``pydoc_data.topics``, else standard-library docstrings); nothing is downloaded. A byte-level BPE tokenizer is
trained on it with the ``tokenizers`` library and saved next to the model as a local HF directory that
``LLM(directory)`` loads like any checkpoint.

``tiny_llama_draft`` trains a smaller model (``DRAFT_RECIPE``) on the same text with the target's tokenizer, a
draft model for speculative decoding; ``held_out_paragraphs`` gives the paragraphs that neither model trains on.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from compile_attn import env
from compile_attn.errors import CompileAttnError

logger = logging.getLogger(__name__)

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# The model knows prose only (paragraphs, each BOS ... EOS): its chat template joins a conversation's messages into one
# paragraph that the model continues, so LLM.chat and /v1/chat/completions work on it; the roles are not marked.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if not loop.first %} {% endif %}"
                 "{{ message['content'] | trim }}{% endfor %}")
_CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers saves and finds a tokenizer's template
_DONE = "training.json"  # written last: a directory without it is an interrupted run, not a model
_FORMAT = 1  # bump when the recipe changes, so cached models of an older recipe are retrained

# Modules whose docstrings are the fallback text where pydoc_data is missing (some distributions strip it).
_DOC_MODULES = ("argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal",
                "email", "enum", "functools", "http.client", "inspect", "io", "itertools", "json", "logging",
                "os", "pathlib", "pickle", "random", "re", "shutil", "socket", "sqlite3", "string", "subprocess",
                "tempfile", "textwrap", "threading", "typing", "unittest", "urllib.request", "zipfile")


class OutDirInUseError(CompileAttnError, FileExistsError):
    """``train_tiny_llama`` was pointed at a directory that holds something other than a model."""


@dataclass(frozen=True)
class TinyLlamaRecipe:
    """What ``train_tiny_llama`` builds: model shape, tokenizer size and the optimisation schedule."""

    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 4  # head_dim 64: every attention backend's kernels support it
    num_kv_heads: int = 2
    max_position_embeddings: int = 512
    seq_len: int = 64
    batch_size: int = 16
    steps: int = 400
    lr: float = 4e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    held_out_fraction: float = 0.05


# A draft model for the quickstart's model: one layer, half the width, the same tokenizer and text (head_dim 64).
DRAFT_RECIPE = TinyLlamaRecipe(hidden_size=128, intermediate_size=256, num_layers=1, num_heads=2, num_kv_heads=1)


def python_docs_text() -> str:
    """English prose from this Python installation: pydoc's reference-manual topics, else module docstrings.

    Indented lines (grammar rules, code examples) and heading underlines are dropped; paragraphs are kept in a
    fixed order, so the same installation always gives the same text.
    """
    try:
        from pydoc_data.topics import topics

        docs = [topics[key] for key in sorted(topics)]
    except ImportError:
        docs = []
        for name in _DOC_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            docs.append(inspect.getdoc(module) or "")
            docs.extend(inspect.getdoc(obj) or "" for _, obj in sorted(vars(module).items())
                        if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == name)
    paragraphs: list[str] = []
    for doc in docs:
        for block in re.split(r"\n\s*\n", doc):
            lines = [ln for ln in block.splitlines() if ln.strip() and not ln[0].isspace()
                     and not re.fullmatch(r"[*=\-~^]+", ln.strip())]
            text = re.sub(r"\s+", " ", " ".join(lines)).strip()
            if len(text.split()) >= 8:  # a sentence or more, not a heading
                paragraphs.append(text)
    if not paragraphs:
        raise RuntimeError("found no English text in this Python installation (neither pydoc_data.topics nor "
                           "standard-library docstrings); pass texts=[...] to train_tiny_llama")
    return "\n\n".join(paragraphs)


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer (every string encodes) as a ``PreTrainedTokenizerFast`` that prepends BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    bpe.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bpe.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   chat_template=CHAT_TEMPLATE)


def load_tokenizer(directory: str | os.PathLike[str]) -> Any:
    """The tokenizer a trained model's directory holds (``train_tokenizer``'s, saved with the model)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)


def _token_stream(tokenizer: Any, paragraphs: list[str]) -> torch.Tensor:
    """Every paragraph as ``BOS ... EOS``, concatenated."""
    ids: list[int] = []
    for ids_one in tokenizer(paragraphs)["input_ids"]:
        ids.extend(ids_one)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def _split_at(stream_len: int, held_out_fraction: float) -> int:
    """Where the token stream splits: training takes the tokens before, the held-out loss the tokens after."""
    return int(stream_len * (1 - held_out_fraction))


def held_out_paragraphs(tokenizer: Any, paragraphs: list[str] | None = None,
                        held_out_fraction: float = TinyLlamaRecipe.held_out_fraction) -> list[str]:
    """The paragraphs (default: ``python_docs_text()``'s) whose tokens lie wholly in the held-out end of the token
    stream that ``train_tiny_llama`` trains on with ``tokenizer``: text no model of that recipe has trained on."""
    paragraphs = paragraphs if paragraphs is not None else python_docs_text().split("\n\n")
    lengths = [len(ids) + 1 for ids in tokenizer(paragraphs)["input_ids"]]  # + 1: the EOS after each
    start, split, out = 0, _split_at(sum(lengths), held_out_fraction), []
    for paragraph, length in zip(paragraphs, lengths):
        if start >= split:
            out.append(paragraph)
        start += length
    return out


def mean_loss(model: torch.nn.Module, stream: torch.Tensor, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-token cross-entropy (nats) of ``model`` over consecutive ``seq_len`` windows of ``stream``."""
    n = min(max_windows, (len(stream) - 1) // seq_len)
    if n < 1:
        raise ValueError(f"the stream has {len(stream)} tokens, fewer than one window of {seq_len} + 1")
    x = stream[: n * seq_len].view(n, seq_len)
    y = stream[1: n * seq_len + 1].view(n, seq_len)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)).item()


def _lr_at(step: int, recipe: TinyLlamaRecipe) -> float:
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _num_threads() -> int:
    """The cores this process may use that other work leaves idle (by the load average), 1 to 4. OpenMP threads
    that wait on cores busy with other work slow training down several-fold; the weights do not depend on it."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    try:
        idle = cores - os.getloadavg()[0] + 1  # + 1: this process's own share of the load
    except OSError:
        idle = cores
    return max(1, min(4, cores, int(idle + 0.5)))


def train_tiny_llama(out_dir: str | os.PathLike[str], *, steps: int | None = None, seed: int = 0,
                     texts: list[str] | None = None, recipe: TinyLlamaRecipe | None = None,
                     tokenizer_from: str | os.PathLike[str] | None = None) -> Path:
    """Train a tokenizer and a tiny ``LlamaForCausalLM`` on ``texts`` (default: ``python_docs_text()``) on the CPU;
    save both to ``out_dir`` (a model already there is replaced) and return it.

    ``steps`` overrides ``recipe.steps``. ``tokenizer_from``: a trained model's directory whose tokenizer is used
    instead of training one (a draft model must share its target's tokenizer). Everything is seeded, so the same
    ``seed``, texts and thread count give the same weights. ``out_dir/training.json`` records the recipe and the
    held-out loss before and after.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    recipe = recipe or TinyLlamaRecipe()
    if steps is not None:
        recipe = TinyLlamaRecipe(**{**asdict(recipe), "steps": steps})
    if recipe.steps < 1:
        raise ValueError(f"steps must be >= 1, got {recipe.steps}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not ((out / _DONE).exists() or (out / "config.json").exists()):
        raise OutDirInUseError(f"{str(out)!r} exists and holds something other than a model; train_tiny_llama "
                              f"replaces its out_dir, so pass a new or empty directory")
    start = time.perf_counter()
    paragraphs = (texts if texts is not None else python_docs_text().split("\n\n"))
    tokenizer = (load_tokenizer(tokenizer_from) if tokenizer_from is not None
                 else train_tokenizer(paragraphs, recipe.vocab_size))
    stream = _token_stream(tokenizer, paragraphs)
    split = _split_at(len(stream), recipe.held_out_fraction)
    train, held_out = stream[:split], stream[split:]
    if len(train) <= recipe.seq_len + 1 or len(held_out) <= recipe.seq_len + 1:
        raise ValueError(f"{len(stream)} tokens of text is too little for windows of {recipe.seq_len} tokens")

    threads, train_threads = torch.get_num_threads(), _num_threads()
    torch.set_num_threads(train_threads)
    try:
        torch.manual_seed(seed)
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
            num_hidden_layers=recipe.num_layers, num_attention_heads=recipe.num_heads,
            num_key_value_heads=recipe.num_kv_heads, max_position_embeddings=recipe.max_position_embeddings,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
        model = LlamaForCausalLM(config)
        model.eval()
        loss_before = mean_loss(model, held_out, recipe.seq_len)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95),
                                      weight_decay=recipe.weight_decay)
        generator = torch.Generator().manual_seed(seed)
        offsets = torch.arange(recipe.seq_len + 1)
        loss = torch.tensor(float("nan"))
        for step in range(recipe.steps):
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, recipe)
            starts = torch.randint(0, len(train) - recipe.seq_len - 1, (recipe.batch_size, 1), generator=generator)
            window = train[starts + offsets]
            loss = _window_loss(model, window)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if step % 50 == 0 or step == recipe.steps - 1:
                logger.info("tiny llama: step %d/%d, loss %.2f", step + 1, recipe.steps, loss.item())
        model.eval()
        loss_after = mean_loss(model, held_out, recipe.seq_len)
    finally:
        torch.set_num_threads(threads)

    # Written next to out_dir and moved into place, so an interrupted run never leaves a half-written model.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        record = {"format": _FORMAT, "seed": seed, "recipe": asdict(recipe), "text": "python_docs_text()"
                  if texts is None else f"{len(texts)} texts given", "tokens": len(stream),
                  "tokenizer": "trained" if tokenizer_from is None else str(tokenizer_from),
                  "held_out_loss_before": loss_before, "held_out_loss_after": loss_after,
                  "threads": train_threads, "seconds": time.perf_counter() - start}
        (tmp / _DONE).write_text(json.dumps(record, indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("tiny llama: held-out loss %.2f -> %.2f (uniform %.2f) after %d steps; saved to %s",
                loss_before, loss_after, math.log(len(tokenizer)), recipe.steps, out)
    return out


def _window_loss(model: torch.nn.Module, window: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=window[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))


def default_tiny_llama_dir() -> Path:
    """Where the trained tiny model is cached: ``<compile_attn cache>/tiny-llama`` (``env.cache_dir``)."""
    return Path(env.cache_dir()) / "tiny-llama"


def default_tiny_draft_dir() -> Path:
    """Where the trained draft model is cached: ``<compile_attn cache>/tiny-llama-draft`` (``env.cache_dir``)."""
    return Path(env.cache_dir()) / "tiny-llama-draft"


def is_trained(directory: str | os.PathLike[str], *, seed: int = 0, steps: int | None = None,
               recipe: TinyLlamaRecipe | None = None, tokenizer_from: str | os.PathLike[str] | None = None) -> bool:
    """Whether ``directory`` holds a finished model of ``recipe`` (default ``TinyLlamaRecipe()``), trained with
    ``seed`` for ``steps`` steps (default the recipe's); with ``tokenizer_from``, with that directory's tokenizer."""
    recipe = recipe or TinyLlamaRecipe()
    try:
        record = json.loads((Path(directory) / _DONE).read_text())
    except (OSError, ValueError):
        return False
    expected = {**asdict(recipe), "steps": steps or recipe.steps}
    return (record.get("format") == _FORMAT and record.get("seed") == seed and record.get("recipe") == expected
            and (Path(directory) / "config.json").exists()
            and (tokenizer_from is None or _same_tokenizer(Path(directory), Path(tokenizer_from))))


def _add_chat_template(directory: Path) -> None:
    """Give a model trained before its tokenizer had a chat template one (the weights stay)."""
    config = directory / "tokenizer_config.json"
    try:
        has_one = (directory / _CHAT_TEMPLATE_FILE).exists() or "chat_template" in json.loads(config.read_text())
    except (OSError, ValueError):
        return
    if not has_one:
        (directory / _CHAT_TEMPLATE_FILE).write_text(CHAT_TEMPLATE)


def _same_tokenizer(a: Path, b: Path) -> bool:
    try:
        return (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    except OSError:
        return False


def tiny_llama(out_dir: str | os.PathLike[str] | None = None, *, retrain: bool = False, seed: int = 0,
               steps: int | None = None, recipe: TinyLlamaRecipe | None = None,
               tokenizer_from: str | os.PathLike[str] | None = None) -> Path:
    """The trained tiny model's directory: reused if ``out_dir`` (default ``default_tiny_llama_dir()``) already
    holds one of ``recipe`` trained with ``seed`` and ``steps`` (and ``tokenizer_from``'s tokenizer, if given), else
    trained there first (``retrain=True`` always trains)."""
    out = Path(out_dir) if out_dir is not None else default_tiny_llama_dir()
    recipe = recipe or TinyLlamaRecipe()
    if not retrain and is_trained(out, seed=seed, steps=steps, recipe=recipe, tokenizer_from=tokenizer_from):
        logger.info("tiny llama: reusing %s (retrain=True trains it again)", out)
        _add_chat_template(out)
        return out
    tokenizer = "and its tokenizer" if tokenizer_from is None else f"with the tokenizer of {tokenizer_from}"
    logger.info("tiny llama: training a %d-layer %d-step model %s on the CPU into %s (once; later runs reuse it)",
                recipe.num_layers, steps or recipe.steps, tokenizer, out)
    return train_tiny_llama(out, steps=steps, seed=seed, recipe=recipe, tokenizer_from=tokenizer_from)


def tiny_llama_draft(target: str | os.PathLike[str] | None = None, out_dir: str | os.PathLike[str] | None = None,
                     *, retrain: bool = False, seed: int = 0, steps: int | None = None,
                     recipe: TinyLlamaRecipe = DRAFT_RECIPE) -> Path:
    """A draft model for the tiny model in ``target`` (default: ``tiny_llama()``, trained first if needed): a
    smaller model of ``recipe`` trained on the same text with ``target``'s tokenizer, in ``out_dir`` (default
    ``default_tiny_draft_dir()``); reused like ``tiny_llama``'s while the target's tokenizer is unchanged."""
    target = Path(target) if target is not None else tiny_llama()
    out = Path(out_dir) if out_dir is not None else default_tiny_draft_dir()
    return tiny_llama(out, retrain=retrain, seed=seed, steps=steps, recipe=recipe, tokenizer_from=target)
