"""A ToyDecoder driven through the GraphRunner with the triton backend, against the same random steps run
eagerly with torch_native on a twin KV cache (identical allocation history, independent of the runner).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from compile_attn import ForwardBatch, KVCache, forward_context
from compile_attn.attention.torch_native.backend import TorchNativeBackend
from compile_attn.attention.triton.backend import TritonBackend
from compile_attn.config import GraphConfig
from compile_attn.graph_runner import GraphRunner
from compile_attn.models import ToyDecoder, ToyDecoderConfig


class TwinCaches:
    """Two KV caches that allocate in lockstep; ``step`` builds the same batch on both."""

    def __init__(self, cfg: ToyDecoderConfig, device: str, dtype: torch.dtype, *, seed: int, max_batch_size: int,
                 max_context: int, kv_cache_tokens: int) -> None:
        self.cfg, self.device = cfg, device
        self.caches = [
            KVCache(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                    max_batch_size=max_batch_size, max_context=max_context, kv_cache_tokens=kv_cache_tokens, dtype=dtype,
                    device=device)
            for _ in range(2)
        ]
        self.rng = random.Random(seed)
        self.lens: dict[int, int] = {}  # live request row -> tokens cached

    def step(self, rows: list[int], extend_lens: list[int]) -> tuple[ForwardBatch, ForwardBatch]:
        prefix = [self.lens[r] for r in rows]
        locs = [kv.alloc_extend(rows, extend_lens) for kv in self.caches]
        ids = [self.rng.randrange(self.cfg.vocab_size) for _ in range(sum(extend_lens))]
        for r, e in zip(rows, extend_lens):
            self.lens[r] += e
        runner_fb, ref_fb = (
            ForwardBatch.build(req_pool_indices=rows, prefix_lens=prefix, extend_lens=extend_lens, out_cache_loc=loc,
                               input_ids=ids, device=self.device)
            for loc in locs
        )
        return runner_fb, ref_fb

    def new_requests(self, n: int) -> list[int]:
        rows = [[kv.alloc_request() for _ in range(n)] for kv in self.caches]
        assert rows[0] == rows[1]
        self.lens.update({r: 0 for r in rows[0]})
        return rows[0]

    def finish(self, rows: list[int]) -> None:
        for r in rows:
            for kv in self.caches:
                kv.free_request(r)
            del self.lens[r]


@dataclass
class ScenarioReport:
    decode_steps: int = 0
    extend_steps: int = 0
    worst_max_rel: float = 0.0  # max |out - ref| / max |ref| over steps
    worst_mean_rel: float = 0.0  # mean |out - ref| / mean |ref| over steps
    failures: list[str] = field(default_factory=list)


def make_runner(cfg: ToyDecoderConfig, device: str, dtype: torch.dtype, config: GraphConfig, *, max_batch_size: int,
                max_num_tokens: int, max_context: int, seed: int = 0, **backend_kwargs):
    """(model, runner, twin caches, eager torch_native backend on the twin's reference cache); captured."""
    torch.manual_seed(seed)
    model = ToyDecoder(cfg).to(device=device, dtype=dtype).eval()
    twin = TwinCaches(cfg, device, dtype, seed=seed, max_batch_size=3 * max_batch_size, max_context=max_context,
                      kv_cache_tokens=4 * max_batch_size * max_context)
    layers = model.attention_layers()
    runner = GraphRunner(model, TritonBackend(twin.caches[0], layers, **backend_kwargs), config,
                         max_batch_size=max_batch_size, max_num_tokens=max_num_tokens)
    runner.capture()
    return model, runner, twin, TorchNativeBackend(twin.caches[1], layers)


def run_random_steps(model, runner, twin: TwinCaches, ref_backend, decode_sizes: list[int], *,
                     max_prefill: int, max_rel: float, max_mean_rel: float) -> ScenarioReport:
    """For each size: prefill new requests if too few have room, then one decode step of that many requests;
    every step's runner output is compared with the eager reference. Requests finish at random."""
    report = ScenarioReport()
    max_context = twin.caches[0].max_context

    def check(runner_fb: ForwardBatch, ref_fb: ForwardBatch) -> None:
        out = runner.run(runner_fb).float()
        ref_backend.init_forward_metadata(ref_fb)
        with torch.no_grad(), forward_context(ref_fb, ref_backend):
            ref = model(ref_fb.input_ids, ref_fb.positions).float()
        assert out.shape == ref.shape, (out.shape, ref.shape)
        diff = (out - ref).abs()
        rel, mean_rel = float(diff.max() / ref.abs().max()), float(diff.mean() / ref.abs().mean())
        report.worst_max_rel = max(report.worst_max_rel, rel)
        report.worst_mean_rel = max(report.worst_mean_rel, mean_rel)
        if not (out.isfinite().all() and rel <= max_rel and mean_rel <= max_mean_rel):
            report.failures.append(f"{runner_fb.forward_mode.name} bs {runner_fb.batch_size}: rel {rel:.2e}, "
                                   f"mean rel {mean_rel:.2e}")
        if runner_fb.forward_mode.is_decode():
            report.decode_steps += 1
        else:
            report.extend_steps += 1

    for bs in decode_sizes:
        done = [r for r, n in twin.lens.items() if n >= max_context - 1 or twin.rng.random() < 0.15]
        twin.finish(done)
        live = [r for r, n in twin.lens.items() if n < max_context - 1]
        if len(live) < bs:
            rows = twin.new_requests(bs - len(live))
            check(*twin.step(rows, [twin.rng.randint(1, max_prefill) for _ in rows]))
            live = list(twin.lens)
        twin.rng.shuffle(live)
        check(*twin.step(sorted(live[:bs]), [1] * bs))
    return report
