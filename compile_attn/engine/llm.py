"""LLM: the user-facing engine. Builds the KV cache, backend, graph runner and scheduler, and runs
``generate`` as a loop of scheduled steps (continuous batching) until every request finishes.
"""

from __future__ import annotations

import array
import logging
import time
from collections import Counter
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import torch
from tqdm.auto import tqdm

from compile_attn.attention import check_backend_name, create_backend
from compile_attn.batch import ForwardBatch, ForwardMode
from compile_attn.engine.model_loading import LoadedModel, load_for_engine
from compile_attn.engine.request import Request, RequestOutput
from compile_attn.engine.sampler import SamplingPlan, sample
from compile_attn.engine.sampling_params import SamplingParams
from compile_attn.engine.scheduler import ScheduledStep, Scheduler
from compile_attn.engine.step_runner import StepRunner
from compile_attn.graph_runner.mode import GraphMode
from compile_attn.host_tensors import to_device, upload
from compile_attn.kv_cache import KVCache

logger = logging.getLogger(__name__)


class LLM:
    """Generate text with a model whose attention runs through compile_attn.

    ``model``: an HF model instance, a local HF directory, a ``transformers`` config, or any module
    following the model protocol (``model(input_ids[T], positions[T]) -> logits[T, V]`` and
    ``attention_layers()``). ``compile=True`` wraps it in ``torch.compile(backend="compile_attn")``;
    ``graph_mode`` picks the graphs (see GraphMode; CUDA only, the logic also runs on CPU).
    ``kv_cache_tokens`` defaults to ``max_batch_size * max_context``.
    """

    def __init__(
        self,
        model: Any,
        *,
        tokenizer: Any = None,
        attn_backend: str = "auto",
        graph_mode: str = "full_and_piecewise",
        compile: bool = True,
        max_batch_size: int = 32,
        max_num_tokens: int = 2048,
        kv_cache_tokens: int | None = None,
        max_context: int | None = None,
        page_size: int = 1,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        compile_options: dict | None = None,
        capture: bool = True,
    ) -> None:
        check_backend_name(attn_backend)  # a misspelt name or mode fails here, not after the model has loaded
        GraphMode.parse(graph_mode)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        loaded: LoadedModel = load_for_engine(model, tokenizer=tokenizer, dtype=dtype, device=device)
        self.model, self.tokenizer, self.eos_token_ids = loaded.model, loaded.tokenizer, loaded.eos_token_ids
        self.device, self.dtype = device, dtype
        layers = self.model.attention_layers()
        max_context = max_context or loaded.max_context or 4096
        kv_cache_tokens = kv_cache_tokens or max_batch_size * max_context
        first = layers[0]
        self.kv_cache = KVCache(
            num_layers=len(layers), num_kv_heads=first.num_kv_heads, head_dim=first.head_dim,
            v_head_dim=first.v_head_dim, max_requests=max_batch_size, max_context=max_context,
            num_tokens=kv_cache_tokens, page_size=page_size, dtype=dtype, device=device,
        )
        self.backend = create_backend(attn_backend, self.kv_cache, layers)
        self.scheduler = Scheduler(self.kv_cache, max_batch_size, max_num_tokens)
        self.step_runner = StepRunner(
            self.model, self.backend, graph_mode=graph_mode, compile=compile, compile_options=compile_options,
            max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
        )
        logger.info(
            "LLM ready: device %s, dtype %s, backend %s, graph mode %s, KV cache %d tokens (%.1f MiB), page size %d",
            device, dtype, self.backend.name, self.step_runner.graph_mode.value, kv_cache_tokens,
            self.kv_cache.pool.bytes / 2**20, page_size,
        )
        if capture:
            self.step_runner.capture()
        self._next_id = 0
        self.num_steps = 0
        self.steps_by_mode: Counter[ForwardMode] = Counter()

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings need a tokenizer; lists of ints are token ids)."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        requests = [self._make_request(p, sp) for p, sp in zip(prompts, params_list)]
        for req in requests:  # refuse the whole call before queueing anything
            self.scheduler.check_fits(req)
        for req in requests:
            self.scheduler.add(req)
        start = time.perf_counter()
        with tqdm(total=len(requests), desc="generate", disable=not use_tqdm) as bar:
            while self.scheduler.has_work():
                bar.update(len(self.step()))
        elapsed = time.perf_counter() - start
        logger.info("generated %d tokens for %d requests in %.2f s", sum(r.num_output for r in requests),
                    len(requests), elapsed)
        return [self._output(r) for r in requests]

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Request:
        """Queue a request; it runs in the following ``step()`` calls. Raises RequestTooLargeError if it
        can never fit the KV cache."""
        req = self._make_request(prompt, params or SamplingParams())
        self.scheduler.add(req)
        return req

    def _make_request(self, prompt: str | Sequence[int], params: SamplingParams) -> Request:
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        req = Request(self._next_id, self._encode(prompt), params, seed)
        self._next_id += 1
        return req

    def step(self) -> list[Request]:
        """Run one scheduled step; return the requests that finished in it."""
        step = self.scheduler.schedule()
        if step is None:
            return []
        self.num_steps += 1
        fb = ForwardBatch.build(
            req_pool_indices=[r.row for r in step.requests], prefix_lens=step.prefix_lens,
            extend_lens=step.extend_lens, out_cache_loc=step.out_cache_loc,
            input_ids=self._step_input_ids(step),
            device=self.device,
        )
        self.steps_by_mode[fb.forward_mode] += 1
        sampled = [i for i, (r, p, n) in enumerate(zip(step.requests, step.prefix_lens, step.extend_lens))
                   if p + n == len(r.token_ids)]
        next_ids = self._sample(step, fb, sampled)
        done = []
        for r, n in zip(step.requests, step.extend_lens):
            r.num_cached += n
        for i, tok in zip(sampled, next_ids):
            r = step.requests[i]
            r.token_ids.append(tok)
            reason = self._stop_reason(r, tok)
            if reason:
                done.append((r, reason))
        self.scheduler.finish_all(done)  # one free for the step's finished requests
        return [r for r, _ in done]

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _step_input_ids(step: ScheduledStep) -> array.array:
        """The step's tokens, request after request: one memory copy per request (a prefill has thousands); a
        decode step (one token each) reads each request's token at its prefix length in one comprehension."""
        if step.extend_lens.count(1) == len(step.extend_lens):
            return array.array("q", [r.token_ids[p] for r, p in zip(step.requests, step.prefix_lens)])
        ids = array.array("q")
        for r, p, n in zip(step.requests, step.prefix_lens, step.extend_lens):
            ids.extend(r.token_ids[p : p + n])
        return ids

    def _sample(self, step: ScheduledStep, fb: ForwardBatch, sampled: list[int]) -> list[int]:
        ends = list(accumulate(fb.extend_seq_lens_cpu))
        keep = [ends[i] - 1 for i in sampled]
        reqs = [step.requests[i] for i in sampled]
        every_row = len(keep) == fb.num_tokens  # the LM head runs on every row (a decode step): no index tensor
        temps = [r.params.temperature for r in reqs]
        if all(t <= 0 for t in temps):  # all greedy: skip the noise kernels and their inputs (a greedy decode
            # step uploads nothing here)
            keep_t = None if every_row else to_device([keep], torch.int64, self.device)[0]
            logits = self.step_runner.run(fb, keep_t)
            return logits.argmax(dim=-1).tolist() if sampled else []
        top_ks = [r.params.top_k for r in reqs]
        top_ps = [r.params.top_p for r in reqs]
        min_ps = [r.params.min_p for r in reqs]
        plan = SamplingPlan.for_rows(temps, top_ks, top_ps, min_ps, [r.params.seed is not None for r in reqs])
        # Two host-to-device copies for the step (one per dtype), not one per field; a filter that no row
        # uses is not uploaded (a batch without filters sends temperatures, seeds and positions only).
        ints = [[r.seed for r in reqs], [len(r.token_ids) for r in reqs]]
        ints += ([top_ks] if plan.max_top_k else []) + ([] if every_row else [keep])
        on_device = to_device(ints, torch.int64, self.device)
        seeds, positions = on_device[0], on_device[1]
        top_k = on_device[2] if plan.max_top_k else None
        logits = self.step_runner.run(fb, None if every_row else on_device[-1])
        floats = [temps] + ([top_ps] if plan.top_p_rows else []) + ([min_ps] if plan.min_p_rows else [])
        temperature, *filters = upload(torch.tensor(floats, dtype=torch.float32), self.device).unbind(0)
        top_p = filters.pop(0) if plan.top_p_rows else None
        min_p = filters.pop(0) if plan.min_p_rows else None
        tokens = sample(logits, temperature, top_k, top_p, seeds, positions, min_p=min_p, plan=plan)
        return tokens.tolist()  # the step's one host sync

    def _stop_reason(self, r: Request, tok: int) -> str | None:
        if tok in r.params.stop_token_ids or (not r.params.ignore_eos and tok in self.eos_token_ids):
            return "stop"
        if r.num_output >= r.params.max_new_tokens or len(r.token_ids) >= self.kv_cache.max_context:
            return "length"
        return None

    def _encode(self, prompt: str | Sequence[int]) -> array.array:
        """The prompt's token ids as an int64 ``array.array`` (see ``Request.token_ids``)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer; pass token id lists or LLM(..., tokenizer=...)")
            return array.array("q", self.tokenizer(prompt)["input_ids"])
        try:  # array.array converts in one C loop (a prefill's prompts are thousands of ids) and refuses non-ints
            return array.array("q", prompt)
        except (TypeError, OverflowError) as exc:
            bad = next((t for t in prompt if not _is_token_id(t)), None)
            raise ValueError(f"prompt token ids must be integers that fit int64, got {bad!r} "
                             f"({type(bad).__name__}); pass a list of ints or a string with a tokenizer") from exc

    def _output(self, r: Request) -> RequestOutput:
        text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True) if self.tokenizer else None
        return RequestOutput(r.request_id, r.prompt_ids.tolist(), r.output_ids, r.finish_reason or "length", text)


def _is_token_id(value: object) -> bool:
    try:
        array.array("q", [value])
    except (TypeError, OverflowError):
        return False
    return True
