"""fp8 KV scales: read from a checkpoint directory the test writes (every name vLLM / SGLang checkpoints use), from
JSON, or calibrated on the first prefill (no clipping of that step, saturation not NaN beyond it, dummy start-up
batches ignored); the pool's bytes at one byte per element."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from compile_attn import AttentionLayer, ForwardBatch, KVCache, create_backend, forward_context
from compile_attn.errors import InvalidConfigError
from compile_attn.kv.fp8 import dequantize, fp8_max
from compile_attn.kv.kv_scales import (
    CALIBRATION_MARGIN,
    checkpoint_scales,
    json_scales,
    setup_kv_scales,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
LAYERS, HKV = 3, 2


def _kv(dtype: torch.dtype = E4M3, **kw: object) -> KVCache:
    args = dict(num_layers=LAYERS, num_kv_heads=HKV, head_dim=16, max_batch_size=4, max_context=64,
                kv_cache_tokens=128, page_size=1, dtype=dtype)
    args.update(kw)
    return KVCache(**args)


def _save(directory: Path, tensors: dict[str, torch.Tensor], name: str = "model.safetensors") -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4), **tensors}, str(directory / name))


# ---------------------------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_pool_bytes_halve_against_bf16(fp8: torch.dtype) -> None:
    assert _kv(fp8).pool.bytes * 2 == _kv(torch.bfloat16).pool.bytes
    assert _kv(fp8).pool.bytes * 4 == _kv(torch.float32).pool.bytes


# ---------------------------------------------------------------------------------------------- checkpoint
@pytest.mark.parametrize(("k_name", "v_name"), [
    ("model.layers.{i}.self_attn.k_scale", "model.layers.{i}.self_attn.v_scale"),  # llm-compressor
    ("model.layers.{i}.self_attn.attn.k_scale", "model.layers.{i}.self_attn.attn.v_scale"),
    ("model.layers.{i}.self_attn.k_proj.k_scale", "model.layers.{i}.self_attn.v_proj.v_scale"),  # ModelOpt
    ("model.layers.{i}.self_attn.qkv_proj.k_scale", "model.layers.{i}.self_attn.qkv_proj.v_scale"),
    ("model.layers.{i}.self_attn.k_proj.output_scale", "model.layers.{i}.self_attn.v_proj.output_scale"),
])
def test_checkpoint_scales_by_every_name(tmp_path: Path, k_name: str, v_name: str) -> None:
    tensors = {}
    for i in range(LAYERS):
        tensors[k_name.format(i=i)] = torch.tensor(0.5 + i)  # a scalar: every KV head
        tensors[v_name.format(i=i)] = torch.tensor([0.25 + i, 0.125 + i])  # one per KV head
        tensors[f"model.layers.{i}.self_attn.q_proj.output_scale"] = torch.tensor(9.0)  # not a KV scale
    _save(tmp_path, tensors)
    kv = _kv()
    line = setup_kv_scales(kv.pool, checkpoint_dir=tmp_path)
    assert "checkpoint" in line and kv.pool.scale_calibration is None
    for i in range(LAYERS):
        k, v = kv.pool.kv_scales(i)
        assert k.tolist() == [0.5 + i] * HKV and v.tolist() == [0.25 + i, 0.125 + i]


def test_checkpoint_kv_scale_serves_k_and_v_and_sharded_files(tmp_path: Path) -> None:
    _save(tmp_path, {"model.layers.0.self_attn.kv_scale": torch.tensor(2.0)}, "model-00001-of-00002.safetensors")
    _save(tmp_path, {"model.layers.1.self_attn.kv_scale": torch.tensor(3.0)}, "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.layers.0.self_attn.kv_scale": "model-00001-of-00002.safetensors",
        "model.layers.1.self_attn.kv_scale": "model-00002-of-00002.safetensors"}}))
    kv = _kv()
    line = setup_kv_scales(kv.pool, checkpoint_dir=tmp_path)
    assert kv.pool.kv_scales(0)[0].tolist() == kv.pool.kv_scales(0)[1].tolist() == [2.0, 2.0]
    assert kv.pool.kv_scales(1)[1].tolist() == [3.0, 3.0]
    # layer 2 has no scale in the checkpoint: it calibrates on the first prefill, and the log says so
    assert "layers [2]" in line and kv.pool.scale_calibration.pending == {2}


def test_checkpoint_without_scales_and_bad_scales(tmp_path: Path) -> None:
    _save(tmp_path / "plain", {})
    assert checkpoint_scales(tmp_path / "plain", LAYERS, HKV) is None
    assert checkpoint_scales(tmp_path / "missing", LAYERS, HKV) is None
    _save(tmp_path / "three", {"model.layers.0.self_attn.k_scale": torch.ones(3)})
    with pytest.raises(InvalidConfigError, match="has 3 values but the KV cache has 2 KV heads"):
        checkpoint_scales(tmp_path / "three", LAYERS, HKV)
    _save(tmp_path / "neg", {"model.layers.0.self_attn.k_scale": torch.tensor(-1.0)})
    with pytest.raises(InvalidConfigError, match="finite and > 0"):
        checkpoint_scales(tmp_path / "neg", LAYERS, HKV)
    _save(tmp_path / "deep", {"model.layers.7.self_attn.k_scale": torch.tensor(1.0)})
    with pytest.raises(InvalidConfigError, match="layer 7, but the model has 3 layers"):
        checkpoint_scales(tmp_path / "deep", LAYERS, HKV)


# ---------------------------------------------------------------------------------------------- JSON
def test_json_scales_per_layer_and_per_head(tmp_path: Path) -> None:
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"k_scale": [0.5, [0.125, 0.25], 1], "v_scale": [2, 3, [4, 5]]}))
    kv = _kv()
    setup_kv_scales(kv.pool, scales_path=path)
    assert [kv.pool.k_scales[i].tolist() for i in range(LAYERS)] == [[0.5, 0.5], [0.125, 0.25], [1.0, 1.0]]
    assert kv.pool.v_scales[2].tolist() == [4.0, 5.0]
    assert kv.pool.scale_calibration is None


def test_a_tensor_parallel_rank_reads_its_kv_heads(tmp_path: Path) -> None:
    """A rank's pool of 2 KV heads out of the model's 4 (``kv_heads=(2, 4, 4)``) takes heads 2 and 3 of the JSON
    file's and of the checkpoint's per-head scales; a head range that does not match the pool is refused."""
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"k_scale": [[1, 2, 3, 4]] * LAYERS, "v_scale": [5, [6, 7, 8, 9], 10]}))
    kv = _kv()
    setup_kv_scales(kv.pool, scales_path=path, kv_heads=(2, 4, 4))
    assert kv.pool.k_scales[0].tolist() == [3.0, 4.0] and kv.pool.v_scales[1].tolist() == [8.0, 9.0]
    assert kv.pool.v_scales[0].tolist() == [5.0, 5.0]
    _save(tmp_path / "ckpt", {f"model.layers.{i}.self_attn.{n}": torch.tensor([1.0, 2.0, 3.0, 4.0]) * (i + 1)
                              for i in range(LAYERS) for n in ("k_scale", "v_scale")})
    kv = _kv()
    setup_kv_scales(kv.pool, checkpoint_dir=tmp_path / "ckpt", kv_heads=(0, 2, 4))
    assert kv.pool.k_scales[2].tolist() == [3.0, 6.0]
    with pytest.raises(InvalidConfigError, match="KV heads 0..2 given for a KV pool of 2 heads"):
        setup_kv_scales(_kv().pool, scales_path=path, kv_heads=(0, 3, 4))


def test_json_scales_in_vllms_former_format(tmp_path: Path) -> None:
    path = tmp_path / "kv_cache_scales.json"
    path.write_text(json.dumps({"model_type": "llama", "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {
        "0": {"0": 0.25, "1": 0.5, "2": 0.75}}}}))
    scales = json_scales(path, LAYERS, HKV)
    assert [s.tolist() for s in scales.k] == [[0.25] * 2, [0.5] * 2, [0.75] * 2] and scales.v[2].tolist() == [0.75] * 2


def test_json_scales_win_over_the_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path / "ckpt", {f"model.layers.{i}.self_attn.{n}": torch.tensor(9.0)
                              for i in range(LAYERS) for n in ("k_scale", "v_scale")})
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"k_scale": [1, 1, 1], "v_scale": [2, 2, 2]}))
    kv = _kv()
    setup_kv_scales(kv.pool, checkpoint_dir=tmp_path / "ckpt", scales_path=path)
    assert kv.pool.k_scales[0].tolist() == [1.0, 1.0] and kv.pool.v_scales[1].tolist() == [2.0, 2.0]


@pytest.mark.parametrize(("text", "match"), [
    ('{"k_scale": [1, 1]}', r"expected \{\"k_scale\""),
    ('{"k_scale": [1, 1], "v_scale": [1, 1]}', "must be a list of 3 entries"),
    ('{"k_scale": [1, 1, "x"], "v_scale": [1, 1, 1]}', r"k_scale\[2\] is 'x'"),
    ('{"k_scale": [1, 1, 0], "v_scale": [1, 1, 1]}', "finite and > 0"),
    ("not json", "is not JSON"),
])
def test_bad_json_scales_are_refused_by_name(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(InvalidConfigError, match=match):
        json_scales(path, LAYERS, HKV)


def test_scales_for_an_unquantised_cache_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfigError, match="not fp8; pass kv_cache_dtype='fp8_e4m3'"):
        setup_kv_scales(_kv(torch.bfloat16).pool, scales_path=tmp_path / "s.json")


# ---------------------------------------------------------------------------------------------- calibration
def _prefill(kv: KVCache, backend, layers, lengths: list[int], k: torch.Tensor, v: torch.Tensor,  # noqa: ANN001
             rows: list[int] | None = None) -> torch.Tensor:
    """One prefill step of ``lengths`` through the op on every layer with the same ``k``/``v``; returns its slots."""
    rows = rows or [kv.alloc_request() for _ in lengths]
    loc = kv.alloc_extend(rows, lengths)
    fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=[0] * len(rows), extend_lens=lengths,
                            out_cache_loc=loc)
    backend.init_forward_metadata(fb)
    n = sum(lengths)
    q = torch.randn(n, 4, 16)
    with forward_context(fb, backend):
        for layer in layers:
            torch.ops.compile_attn.attention(q, k, v, torch.empty(n, 4, 16), layer.layer_id)
    return loc


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_first_prefill_calibrates_without_clipping_and_later_values_saturate(fp8: torch.dtype) -> None:
    kv = _kv(fp8)
    layers = [AttentionLayer(i, 4, HKV, 16) for i in range(LAYERS)]
    backend = create_backend("torch_native", kv, layers)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(10, HKV, 16, generator=gen) * torch.tensor([300.0, 0.01])[None, :, None]  # 1.0 would clip head 0
    v = torch.randn(10, HKV, 16, generator=gen) * 5
    loc = _prefill(kv, backend, layers, [4, 6], k, v)
    assert kv.pool.scale_calibration is None  # every layer set: nothing runs on later steps
    limit = fp8_max(fp8)
    for i in range(LAYERS):
        k_scale, v_scale = kv.pool.kv_scales(i)
        # the rule: margin * amax / fp8_max per KV head (computed here from the inputs, independently)
        torch.testing.assert_close(k_scale, CALIBRATION_MARGIN * k.abs().amax(dim=(0, 2)) / limit)
        torch.testing.assert_close(v_scale, CALIBRATION_MARGIN * v.abs().amax(dim=(0, 2)) / limit)
        stored = dequantize(kv.pool.k_buffers[i].view(torch.uint8)[loc].view(fp8), k_scale)
        # no clipping: every value within the format's relative precision of the original (2^-4 / 2^-3 of it,
        # plus the subnormal floor's absolute step)
        info = torch.finfo(fp8)
        rel = info.eps / 2  # half an ulp: 2^-4 (e4m3), 2^-3 (e5m2)
        floor = k_scale[None, :, None] * info.smallest_normal * info.eps  # the subnormal step
        assert bool(((stored - k).abs() <= rel * k.abs() + floor).all())
    # a later prefill with values 10x past the calibrated range saturates at fp8_max * scale, never NaN or inf
    big = k * 10
    loc2 = _prefill(kv, backend, layers, [10], big, v)
    k_scale = kv.pool.kv_scales(0)[0]
    stored = dequantize(kv.pool.k_buffers[0].view(torch.uint8)[loc2].view(fp8), k_scale)
    assert bool(torch.isfinite(stored).all())
    torch.testing.assert_close(stored.abs().amax(dim=(0, 2)), limit * k_scale)
    assert torch.equal(kv.pool.kv_scales(0)[0], k_scale)  # scales never change once set


def test_dummy_batches_do_not_calibrate() -> None:
    """Start-up's scratch batches (row PAD_REQUEST, slot PAD_SLOT) leave the scales pending; decode steps too."""
    kv = _kv()
    layers = [AttentionLayer(i, 4, HKV, 16) for i in range(LAYERS)]
    backend = create_backend("torch_native", kv, layers)
    fb = ForwardBatch.build_scratch([0], [5], "cpu")
    backend.init_forward_metadata(fb)
    with forward_context(fb, backend):
        for layer in layers:
            torch.ops.compile_attn.attention(torch.randn(5, 4, 16), torch.randn(5, HKV, 16) * 1e3,
                                             torch.randn(5, HKV, 16), torch.empty(5, 4, 16), layer.layer_id)
    assert kv.pool.scale_calibration is not None and kv.pool.scale_calibration.pending == set(range(LAYERS))
    assert all(s.tolist() == [1.0, 1.0] for s in kv.pool.k_scales)
