"""Where an fp8 KV pool's scales come from: a quantised checkpoint, a JSON file, or the first prefill.

Scales follow ``kv/fp8.py``: ``stored = real / scale``, one float32 per layer and KV head for K and for V.

* Checkpoint (``checkpoint_scales``): the per-layer tensors vLLM's and SGLang's fp8 checkpoints carry in their
  safetensors files, under any of the names they use (``CHECKPOINT_SCALE_PATTERN``): ``...layers.{i}.self_attn.
  k_scale`` / ``v_scale`` (llm-compressor, compressed-tensors), ``...self_attn.attn.k_scale``, ``...self_attn.k_proj.
  k_scale`` / ``v_proj.v_scale`` (ModelOpt), ``...self_attn.qkv_proj.k_scale``, ``...self_attn.k_proj.output_scale``
  / ``v_proj.output_scale``, and the older ``...self_attn.kv_scale`` (one scale for K and V). A scalar serves every
  KV head; a tensor of ``num_kv_heads`` values gives one per head.
* JSON (``json_scales``): ``{"k_scale": [...], "v_scale": [...]}``, one entry per layer, each a number or a list of
  ``num_kv_heads`` numbers; or vLLM's former ``quantization_param_path`` file, ``{"kv_cache": {"scaling_factor":
  {"0": {"<layer>": s}}}}`` (tensor-parallel rank 0's table; one scale for K and V).
* First prefill (``FirstPrefillCalibration``): for every layer without a scale, the first extend step that holds a
  live request's tokens sets ``scale = CALIBRATION_MARGIN * amax / fp8_max`` per KV head (amax over that step's
  tokens, padding excluded; a head whose amax is 0 keeps 1.0), before the step's K/V are stored, so nothing is ever
  stored under another scale. Later values beyond ``fp8_max * scale`` saturate. Once every layer has its scales the
  calibration detaches from the pool: no work, and no host sync, on later steps.

With tensor parallelism a rank's pool holds a range of the model's KV heads (``setup_kv_scales(..., kv_heads=(first,
stop, of))``): the checkpoint's and the JSON file's per-head scales are read for all ``of`` heads and sliced; the
first-prefill calibration sees only the rank's own heads' K and V, which are the unsharded model's.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from compile_attn.batch import PAD_REQUEST
from compile_attn.errors import InvalidConfigError
from compile_attn.kv.fp8 import fp8_max

if TYPE_CHECKING:
    from compile_attn.batch import ForwardBatch
    from compile_attn.kv.pools import PagedKVPool

logger = logging.getLogger(__name__)

# scale = margin * amax / fp8_max: the first prefill's largest value lands at fp8_max / margin, leaving room for
# later tokens up to ``margin`` times larger before they saturate (cheap: fp8's relative precision is the same
# across its normal range).
CALIBRATION_MARGIN = 2.0
# layers.{i}.<attention module>.[attn.][k_proj. | v_proj. | qkv_proj.]<k_scale | v_scale | kv_scale | output_scale>
CHECKPOINT_SCALE_PATTERN = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|attention)\.(?:attn\.)?(?:(k_proj|v_proj|qkv_proj)\.)?"
    r"(k_scale|v_scale|kv_scale|output_scale)$"
)


@dataclass(frozen=True)
class KVScales:
    """Per-layer K and V scales (``stored = real / scale``): each a float32 tensor of ``num_kv_heads`` values;
    ``None`` for a layer the source has no scale for."""

    k: list[torch.Tensor | None]
    v: list[torch.Tensor | None]
    source: str  # for the log: "checkpoint <dir>", "JSON <path>"

    @property
    def complete(self) -> bool:
        return all(s is not None for s in (*self.k, *self.v))

    def heads(self, first: int, stop: int) -> KVScales:
        """The scales of KV heads ``first .. stop - 1`` (a tensor-parallel rank's)."""
        cut = [None if s is None else s[first:stop].clone() for s in self.k], [
            None if s is None else s[first:stop].clone() for s in self.v]
        return KVScales(cut[0], cut[1], f"{self.source}, KV heads {first}..{stop - 1}")


def _per_head(value: Any, num_kv_heads: int, what: str) -> torch.Tensor:
    """``value`` (a number, a list or a tensor of 1 or ``num_kv_heads`` positive finite values) as float32
    ``[num_kv_heads]``; InvalidConfigError naming ``what`` otherwise."""
    try:
        t = torch.as_tensor(value, dtype=torch.float32).flatten()
    except (TypeError, ValueError, RuntimeError):
        raise InvalidConfigError(f"{what} is {value!r}: expected a number or a list of numbers") from None
    if t.numel() == 1:
        t = t.expand(num_kv_heads)
    if t.numel() != num_kv_heads:
        raise InvalidConfigError(
            f"{what} has {t.numel()} values but the KV cache has {num_kv_heads} KV heads; give one scale (every "
            f"head) or one per KV head"
        )
    if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
        raise InvalidConfigError(f"{what} is {t.tolist()}: scales must be finite and > 0 (stored = real / scale)")
    return t.clone()


def _checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (those its index names, else every ``*.safetensors``)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        return [directory / n for n in names if (directory / n).is_file()]
    return sorted(directory.glob("*.safetensors"))


def checkpoint_scales(directory: str | os.PathLike[str], num_layers: int, num_kv_heads: int) -> KVScales | None:
    """The KV scales a quantised checkpoint directory carries (see the module docstring for the names), or None
    when it carries none. Reads only the scale tensors, not the weights."""
    directory = Path(directory)
    files = _checkpoint_files(directory) if directory.is_dir() else []
    if not files:
        return None
    try:
        from safetensors import safe_open
    except ImportError:
        logger.warning("safetensors is not installed: KV scales in %s are not read (pip install safetensors)",
                       directory)
        return None
    k: list[torch.Tensor | None] = [None] * num_layers
    v: list[torch.Tensor | None] = [None] * num_layers
    found = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                m = CHECKPOINT_SCALE_PATTERN.search(name)
                if m is None:
                    continue
                layer, proj, kind = int(m.group(1)), m.group(2), m.group(3)
                if kind == "output_scale" and proj not in ("k_proj", "v_proj"):
                    continue  # a q_proj / qkv_proj output scale is not a KV scale
                if layer >= num_layers:
                    raise InvalidConfigError(
                        f"{path.name} holds KV scale {name!r} for layer {layer}, but the model has {num_layers} "
                        f"layers; is this checkpoint for another model?"
                    )
                scale = _per_head(f.get_tensor(name), num_kv_heads, f"{path.name}: {name}")
                is_k = kind in ("k_scale", "kv_scale") or (kind == "output_scale" and proj == "k_proj")
                is_v = kind in ("v_scale", "kv_scale") or (kind == "output_scale" and proj == "v_proj")
                if is_k:
                    k[layer] = scale
                if is_v:
                    v[layer] = scale
                found += 1
    return KVScales(k, v, f"checkpoint {directory}") if found else None


def json_scales(path: str | os.PathLike[str], num_layers: int, num_kv_heads: int) -> KVScales:
    """KV scales from a JSON file (formats in the module docstring); InvalidConfigError naming what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise InvalidConfigError(f"cannot read the KV scales file {str(path)!r}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise InvalidConfigError(f"the KV scales file {str(path)!r} is not JSON: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("kv_cache"), dict):  # vLLM's quantization_param_path
        table = data["kv_cache"].get("scaling_factor", {})
        rank0 = table.get("0") if isinstance(table, dict) else None
        if not isinstance(rank0, dict):
            raise InvalidConfigError(
                f"{path}: kv_cache.scaling_factor must map tensor-parallel rank \"0\" to {{layer: scale}}, got "
                f"{table!r:.80}"
            )
        ks = [rank0.get(str(i)) for i in range(num_layers)]
        data = {"k_scale": ks, "v_scale": ks}
    if not isinstance(data, dict) or not {"k_scale", "v_scale"} <= set(data):
        raise InvalidConfigError(
            f"{path}: expected {{\"k_scale\": [...], \"v_scale\": [...]}} with one entry per layer (a number, or "
            f"a list of one per KV head); got keys {sorted(data) if isinstance(data, dict) else type(data).__name__}"
        )
    out: dict[str, list[torch.Tensor | None]] = {}
    for key in ("k_scale", "v_scale"):
        values = data[key]
        if not isinstance(values, list) or len(values) != num_layers:
            n = len(values) if isinstance(values, list) else type(values).__name__
            raise InvalidConfigError(f"{path}: {key} must be a list of {num_layers} entries (one per layer), got {n}")
        out[key] = [None if s is None else _per_head(s, num_kv_heads, f"{path}: {key}[{i}]")
                    for i, s in enumerate(values)]
    return KVScales(out["k_scale"], out["v_scale"], f"JSON {path}")


def apply_scales(pool: PagedKVPool, scales: KVScales) -> list[int]:
    """Copy ``scales`` into ``pool``'s scale tensors in place (graphs captured before read the new values) and take
    those layers off the calibration; returns the layers that still calibrate on the first prefill."""
    for layer in range(pool.num_layers):
        k, v = scales.k[layer], scales.v[layer]
        if k is not None and v is not None:
            pool.k_scales[layer].copy_(k)
            pool.v_scales[layer].copy_(v)
            if pool.scale_calibration is not None:
                pool.scale_calibration.done(layer)
    return [] if pool.scale_calibration is None else sorted(pool.scale_calibration.pending)


def describe(scales: Sequence[torch.Tensor]) -> str:
    """``min..max`` of a list of per-head scale tensors (a host read: for logs, once)."""
    flat = torch.cat([s.detach().float().cpu() for s in scales])
    return f"{float(flat.min()):.3g}..{float(flat.max()):.3g}"


def setup_kv_scales(pool: PagedKVPool, *, checkpoint_dir: str | os.PathLike[str] | None = None,
                    scales_path: str | os.PathLike[str] | None = None,
                    kv_heads: tuple[int, int, int] | None = None) -> str:
    """Give an fp8 ``pool`` its scales: from ``scales_path`` (a JSON file the user named: it wins), else from the
    checkpoint directory's scale tensors, else (and for any layer they leave out) from the first prefill. Returns
    a line saying where they came from (also logged). An unquantised pool with ``scales_path`` is refused.
    ``kv_heads`` = (first, stop, of): the pool holds KV heads ``first .. stop - 1`` of the model's ``of`` (a
    tensor-parallel rank; None: all of them)."""
    if not pool.quantized:
        if scales_path is not None:
            raise InvalidConfigError(
                f"kv_scales_path={str(scales_path)!r} was given but the KV cache is {pool.dtype}, not fp8; pass "
                f"kv_cache_dtype='fp8_e4m3' (or 'fp8_e5m2'), or drop kv_scales_path"
            )
        return "unquantised"
    first, stop, heads = kv_heads if kv_heads is not None else (0, pool.num_kv_heads, pool.num_kv_heads)
    if stop - first != pool.num_kv_heads:
        raise InvalidConfigError(f"KV heads {first}..{stop - 1} given for a KV pool of {pool.num_kv_heads} heads")
    scales = None
    if scales_path is not None:
        scales = json_scales(scales_path, pool.num_layers, heads)
        if checkpoint_dir is not None and checkpoint_scales(checkpoint_dir, pool.num_layers, heads):
            logger.info("KV scales from %s replace those of the checkpoint", scales_path)
    elif checkpoint_dir is not None:
        scales = checkpoint_scales(checkpoint_dir, pool.num_layers, heads)
    if scales is not None and (first, stop) != (0, heads):
        scales = scales.heads(first, stop)
    pending = apply_scales(pool, scales) if scales is not None else list(range(pool.num_layers))
    if scales is None:
        line = (f"KV scales: none given; calibrated on the first prefill (margin {CALIBRATION_MARGIN} x amax per "
                f"layer and KV head)")
    elif pending:
        line = (f"KV scales from {scales.source} for {pool.num_layers - len(pending)} layers; layers {pending} "
                f"calibrate on the first prefill")
    else:
        line = (f"KV scales from {scales.source}: K {describe(pool.k_scales)}, V {describe(pool.v_scales)}")
    logger.info("%s", line)
    return line


class FirstPrefillCalibration:
    """Sets each pending layer's scales from the first extend step with live tokens, before that step stores its
    K/V (``observe``, called by ``AttentionBackend.forward``); detaches from the pool when no layer is pending."""

    def __init__(self, pool: PagedKVPool, margin: float = CALIBRATION_MARGIN) -> None:
        if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin >= 1):
            raise InvalidConfigError(f"the KV scale calibration margin must be a finite number >= 1, got {margin!r}")
        self.pool = pool
        self.margin = float(margin)
        self.pending: set[int] = set(range(pool.num_layers))

    def done(self, layer_id: int) -> None:
        """``layer_id`` has its scales; the last one detaches the calibration from the pool."""
        self.pending.discard(layer_id)
        if not self.pending and self.pool.scale_calibration is self:
            self.pool.scale_calibration = None

    @staticmethod
    def has_live_tokens(fb: ForwardBatch) -> bool:
        """Whether ``fb`` holds a live request's tokens (start-up's dummy batches sit on the scratch row only).
        Reads the request rows on the host: the batch's host copy, else the device tensor (a sync, only while
        calibrating, never while a graph is being captured)."""
        if fb.num_request_tokens == 0:
            return False
        rows = fb.req_pool_indices_cpu
        if rows is None:
            if fb.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return False
            rows = fb.req_pool_indices[: fb.batch_size].tolist()
        return any(r != PAD_REQUEST for r in rows)

    def observe(self, layer_id: int, fb: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Set ``layer_id``'s scales from this step's ``k[T, Hkv, D]``, ``v[T, Hkv, Dv]`` if it is pending and the
        step is an extend with live tokens."""
        if layer_id not in self.pending or fb.forward_mode.is_decode() or not self.has_live_tokens(fb):
            return
        n = fb.num_request_tokens
        limit = fp8_max(self.pool.dtype)
        for x, scales in ((k, self.pool.k_scales), (v, self.pool.v_scales)):
            amax = x[:n].detach().float().abs().amax(dim=(0, 2))  # [Hkv]
            scale = torch.where((amax > 0) & torch.isfinite(amax), amax * (self.margin / limit), torch.ones_like(amax))
            scales[layer_id].copy_(scale)
        self.done(layer_id)
        if not self.pending:
            logger.info("KV scales calibrated on the first prefill (%d tokens, margin %s): K %s, V %s", n,
                        self.margin, describe(self.pool.k_scales), describe(self.pool.v_scales))
