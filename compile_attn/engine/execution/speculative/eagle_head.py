"""An EAGLE-1/2 draft head read from its checkpoint directory, seen through the model protocol so that a StepRunner
runs it (its KV cache, backend and graphs are the proposer's, ``eagle.py``). It owns the checkpoint format and the
head's forward; it must not hold batch state beyond the ``features`` input buffer the proposer fills before each run.

The format (SafeAILab/EAGLE ``eagle/model/cnets1.py`` and ``ea_model.py``; vLLM's ``llama_eagle.py`` reads the same):
``config.json`` shaped like a Llama of ``num_hidden_layers`` (usually 1) layers, with an optional ``"bias"`` (the
``fc`` bias, default true); weights in ``model.safetensors`` or ``pytorch_model.bin``: ``fc.weight`` [H, 2H] (and
``fc.bias``), ``layers.{i}.*`` Llama decoder layers, where layer 0 usually has no ``input_layernorm``, and optionally
``embed_tokens.weight`` (else the target's table is shared). No final norm and no LM head: token t + 1's input is
``fc(cat(embed(x_{t+1}), f_t))`` with f_t the target's final hidden state at t (after its final norm), and the
drafts come from the target's LM head applied to the layer output as it is.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
from torch import nn

from compile_attn.engine.requests.errors import EngineOptionError

logger = logging.getLogger(__name__)

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_EAGLE3_HINT = ("EAGLE-3 heads (fc over three target layers' hidden states, a draft vocabulary with d2t/t2d maps) "
                "are not supported; supported: EAGLE-1/2 heads (method 'eagle'), or method 'draft_model'")


class EagleHead(nn.Module):
    """``hidden_states(ids, positions)``: the head's layers over ``fc(cat(embed(ids), features[:T]))``;
    ``compute_logits``: the target's LM head. ``features`` is a static buffer (graphs read its address)."""

    def __init__(self, decoder: nn.Module, fc: nn.Linear, embed_tokens: nn.Module, target: Any) -> None:
        super().__init__()
        from compile_attn.hf.families import attention_layers

        self.decoder, self.fc, self.embed_tokens = decoder, fc, embed_tokens
        self._target_logits = target.compute_logits  # a bound method: the target is not a submodule
        self.vocab_size = int(target.config.vocab_size)
        self.hidden_size = fc.out_features
        self._layers = attention_layers(decoder)
        self.register_buffer("features", torch.zeros(0, self.hidden_size), persistent=False)

    def allocate_features(self, rows: int) -> None:
        """The input buffer of target (or draft) hidden states: ``rows`` >= the largest step or graph bucket."""
        w = self.fc.weight
        self.features = torch.zeros(rows, self.hidden_size, dtype=w.dtype, device=w.device)

    def attention_layers(self) -> list[Any]:
        return list(self._layers)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = torch.cat((self.embed_tokens(input_ids), self.features[: input_ids.shape[0]]), dim=-1)
        ones = torch.ones_like(input_ids, dtype=torch.bool)[None]  # as HFModelAdapter: no packed-sequence probe
        out = self.decoder(inputs_embeds=self.fc(x)[None], position_ids=positions[None], attention_mask=ones,
                           use_cache=False)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target_logits(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(self.hidden_states(input_ids, positions))


def read_checkpoint(path: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, weights without a leading ``model.``) of an EAGLE checkpoint directory; refused by name when
    it is not one or is an EAGLE-3 head."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise EngineOptionError(f"speculative_config: method 'eagle' needs 'model' to be an EAGLE checkpoint "
                                f"directory (config.json + {' or '.join(WEIGHT_FILES)}); got {path!r:.80}")
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise EngineOptionError(f"speculative_config: cannot read the EAGLE head's {config_path} ({exc})") from None
    if "draft_vocab_size" in config or any("eagle3" in str(a).lower() for a in config.get("architectures") or ()):
        raise EngineOptionError(f"speculative_config: {path} is an EAGLE-3 head; {_EAGLE3_HINT}")
    files = [os.path.join(path, name) for name in WEIGHT_FILES if os.path.isfile(os.path.join(path, name))]
    if not files:
        raise EngineOptionError(f"speculative_config: the EAGLE head directory {path} has no weights "
                                f"({' or '.join(WEIGHT_FILES)})")
    if files[0].endswith(".safetensors"):
        from safetensors.torch import load_file

        weights = load_file(files[0])
    else:
        weights = torch.load(files[0], map_location="cpu", weights_only=True)
    weights = {k.removeprefix("model."): v for k, v in weights.items()}
    if "d2t" in weights or any(k.startswith("midlayer.") for k in weights):
        raise EngineOptionError(f"speculative_config: {path} holds EAGLE-3 weights; {_EAGLE3_HINT}")
    return config, weights


def load_eagle_head(path: Any, target: Any, dtype: torch.dtype, device: torch.device) -> EagleHead:
    """The EAGLE-1/2 head in ``path`` for ``target`` (an HF model through ``HFModelAdapter``: its hidden size and
    vocabulary must be the head's), in ``dtype`` on ``device``. Missing or unexpected weights are refused by name."""
    from transformers import LlamaConfig, LlamaModel
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from compile_attn.hf.attention import ATTN_IMPLEMENTATION
    from compile_attn.hf.registration import register

    if not all(hasattr(target, a) for a in ("hidden_states", "compute_logits", "config", "model")):
        raise EngineOptionError(f"speculative_config: method 'eagle' needs an HF target model (it reads the "
                                f"target's hidden states and LM head); got {type(target).__name__}")
    config, weights = read_checkpoint(path)
    hidden, vocab = int(target.config.hidden_size), int(target.config.vocab_size)
    cfg = LlamaConfig.from_dict(config)
    if cfg.hidden_size != hidden:
        raise EngineOptionError(f"speculative_config: the EAGLE head in {path} has hidden_size {cfg.hidden_size} "
                                f"and the target {hidden}; an EAGLE head is trained for one target model")
    if cfg.vocab_size != vocab:
        raise EngineOptionError(f"speculative_config: the EAGLE head in {path} has vocab_size {cfg.vocab_size} and "
                                f"the target {vocab}; an EAGLE head shares the target's tokenizer and LM head")
    fc_weight = weights.pop("fc.weight", None)
    if fc_weight is None:
        raise EngineOptionError(f"speculative_config: the EAGLE head in {path} has no fc.weight; is it an "
                                f"EAGLE-1/2 checkpoint?")
    if tuple(fc_weight.shape) == (hidden, 3 * hidden):
        raise EngineOptionError(f"speculative_config: {path}'s fc.weight takes 3 x hidden inputs; {_EAGLE3_HINT}")
    if tuple(fc_weight.shape) != (hidden, 2 * hidden):
        raise EngineOptionError(f"speculative_config: {path}'s fc.weight is {tuple(fc_weight.shape)}, expected "
                                f"({hidden}, {2 * hidden}) (hidden, 2 x hidden)")
    fc_bias = weights.pop("fc.bias", None)
    fc = nn.Linear(2 * hidden, hidden, bias=fc_bias is not None)
    fc.load_state_dict({"weight": fc_weight, **({"bias": fc_bias} if fc_bias is not None else {})})
    embed_weight = weights.pop("embed_tokens.weight", None)
    if embed_weight is not None and tuple(embed_weight.shape) != (vocab, hidden):
        raise EngineOptionError(f"speculative_config: {path}'s embed_tokens.weight is {tuple(embed_weight.shape)}, "
                                f"expected ({vocab}, {hidden})")
    embed = (nn.Embedding.from_pretrained(embed_weight, freeze=True) if embed_weight is not None
             else target.model.get_input_embeddings())
    # The layers only: the embeddings come separately (its table would be vocab x hidden for nothing).
    small = LlamaConfig.from_dict({**config, "vocab_size": 1, "pad_token_id": None, "bos_token_id": None,
                                   "eos_token_id": None})
    register()
    decoder = LlamaModel(small)
    decoder.set_attn_implementation(ATTN_IMPLEMENTATION)
    decoder.norm = nn.Identity()  # EAGLE-1/2: the target's LM head reads the layer output as it is
    if "layers.0.input_layernorm.weight" not in weights:
        decoder.layers[0].input_layernorm = nn.Identity()
    expected = {k for k in decoder.state_dict() if k.startswith("layers.")}
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise EngineOptionError(f"speculative_config: the EAGLE head in {path} does not match its config.json "
                                f"({cfg.num_hidden_layers} Llama layers): missing {missing[:6]}, unexpected "
                                f"{unexpected[:6]}")
    decoder.load_state_dict(weights, strict=False)
    head = EagleHead(decoder, fc, embed, target).to(device=device, dtype=dtype).eval()
    decoder.rotary_emb = LlamaRotaryEmbedding(small).to(device)  # inv_freq in float32 whatever ``dtype``
    logger.info("EAGLE head from %s: %d layer(s), hidden %d, fc bias %s, %s embeddings", path,
                cfg.num_hidden_layers, hidden, fc_bias is not None, "its own" if embed_weight is not None else
                "the target's")
    return head
