"""LLM: the user-facing engine. Builds the KV cache, backend, graph runner and scheduler, and runs
``generate`` as a loop of scheduled steps (continuous batching) until every request finishes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from compile_attn.batch import ForwardMode
from compile_attn.compiler.cuda_graph import graph_owner
from compile_attn.engine.execution.in_flight import InFlightStep
from compile_attn.engine.execution.memory_profile import check_memory_after_capture
from compile_attn.engine.execution.model_loading import LoadedModel, load_for_engine, resolve_sources
from compile_attn.engine.execution.profiling import EngineProfiler
from compile_attn.engine.execution.rank_parts import (build_kv_cache, build_step_runner, rank_kv_tokens,
                                                     setup_all_reduce)
from compile_attn.engine.execution.sampling import sampler
from compile_attn.engine.execution.sampling.grammar import GrammarCache
from compile_attn.engine.execution.speculative.penalties import record_accepted
from compile_attn.engine.execution.speculative.setup import load_draft
from compile_attn.engine.execution.speculative.speculator import Speculator
from compile_attn.engine.execution.speculative.step_plan import schedule_step
from compile_attn.engine.execution.sampling.logprobs import unpack as unpack_logprobs
from compile_attn.engine.execution.sampling.penalties import PenaltyState
from compile_attn.engine.execution.sampling.step import forward_and_sample
from compile_attn.engine.execution.step_inputs import build_batch, prepare_sampling
from compile_attn.engine.intake import admit, grammar_cache
from compile_attn.engine.requests.admission import find_vocab_size, split_prompts
from compile_attn.engine.requests.chat import render_chat, split_conversations
from compile_attn.engine.requests.config import EngineConfig
from compile_attn.engine.requests.errors import EngineBusyError, RequestTypeError
from compile_attn.engine.requests.request import Request, RequestOutput, RequestStatus, request_output
from compile_attn.engine.requests.sampling_params import SamplingParams
from compile_attn.engine.requests.scheduler import ScheduledStep, Scheduler
from compile_attn.engine.requests.token_writer import TokenWriter, seed_generator
from compile_attn.graph_runner import step_kernels
from compile_attn.kv.cache import KVCache
from compile_attn.kv.shared_prefix import engine_prefix_finder


logger = logging.getLogger(__name__)


class LLM:
    """Generate text with a model whose attention runs through compile_attn.

    ``model``: an HF model instance, a local HF directory, a Hugging Face model id (``"org/name"``: the copy in the
    local Hugging Face cache, else downloaded there; ``revision=`` picks a branch, tag or commit), a ``transformers``
    config, or any module following the model protocol (``model(input_ids[T], positions[T]) -> logits[T, V]`` and
    ``attention_layers()``). The options (backend, graph mode, compile, sizes, KV capacity, dtype, device) are
    EngineConfig's fields: pass them as keywords, ``LLM(model, max_batch_size=64)``, or as one
    ``LLM(model, config=EngineConfig(...))``, whose fields the keywords then replace; vLLM's names
    (``max_model_len``, ``max_num_seqs``, ``enforce_eager``, ...: docs/vllm_compat.md) are taken too. Every option is
    checked before the model loads; an unknown keyword is refused with the closest option names.
    ``tokenizer``: a tokenizer object, or a local directory / Hugging Face model id to load one from (default: the
    model's own).
    ``overlap`` (on by default) keeps one step in flight: the host schedules and launches step N+1 while the device
    runs step N, and reads step N's tokens after (see ``step`` and engine/execution/in_flight.py); ``overlap=False`` reads
    each step's tokens before scheduling the next. Both give the same tokens. ``enable_prefix_cache`` (on by
    default) keeps computed KV in a radix tree so that prompts starting alike reuse it (see kv/prefix_cache.py).
    """

    def __init__(self, model: Any, *, tokenizer: Any = None, config: EngineConfig | None = None,
                 **options: Any) -> None:
        self.config = config = EngineConfig.from_options(config, **options)
        model, tokenizer = resolve_sources(model, tokenizer if tokenizer is not None else config.tokenizer,
                                           config.revision)  # model ids -> local directories, before any loading
        self._tp: Any = None  # tensor parallelism: the workers' EngineGroup (engine/tensor_parallel)
        if config.tensor_parallel_size == 1:
            self._build(load_for_engine(model, tokenizer=tokenizer, dtype=config.dtype, device=config.device))
            return
        from compile_attn.engine.tensor_parallel.engine_group import EngineGroup

        self._tp, loaded = EngineGroup.start(model, tokenizer, config)
        weakref.finalize(self, self._tp.close)  # also at interpreter exit
        try:
            with graph_owner(self._tp.graph_owner):
                self._build(loaded)
        except BaseException:
            self._tp.close()
            raise

    def _build(self, loaded: LoadedModel) -> None:
        """The KV cache, backend, scheduler and step runner for ``loaded``; with tensor parallelism each worker
        builds its own in the same order (engine/tensor_parallel/worker.py), collectives included."""
        config = self.config
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.device, self.dtype = device, dtype = config.device, config.dtype
        layers = self.model.attention_layers()
        max_context = config.max_context or loaded.max_context or 4096
        self.vocab_size = find_vocab_size(self.model)  # None: prompts' token ids are only checked to be >= 0
        spec = config.speculative_config
        draft = load_draft(config, max_context, self.vocab_size, self.model)  # None without one; before sizing the KV
        if self._tp is not None:  # the fast all-reduce's buffers, before sizing the KV (the workers do the same)
            setup_all_reduce(self.model, config, self._tp.device)
        kv_cache_tokens, sized = rank_kv_tokens(self.model, layers, config, max_context)
        if sized and draft is not None:  # the draft's KV holds as many tokens: the two share what was sized
            kv_cache_tokens = draft.share_of(kv_cache_tokens, layers, config.page_size, config.kv_dtype)
        if self._tp is not None:  # every rank allocates the same pages: the smallest rank's size
            kv_cache_tokens = self._tp.agree_kv_tokens(kv_cache_tokens)
        self.kv_cache = build_kv_cache(KVCache, layers, loaded, config, max_context, kv_cache_tokens, device)
        self.kv_cache.enable_prefix_cache(config.enable_prefix_cache)  # reuse computed prompts' KV
        if self._tp is not None:  # the workers' request tables follow this one
            self._tp.attach(self.kv_cache)
        self.backend, self.step_runner = build_step_runner(self.model, layers, self.kv_cache, config)
        # Decode steps' KV slots go up with the batch and the table write rides in the step (GraphRunner.run).
        self.scheduler = Scheduler(self.kv_cache, config.max_batch_size, config.max_num_tokens,
                                   defer_table_write=True)
        # Shared-prefix groups of decode batches (None: not looked for); see EngineConfig.cascade_decode.
        cascade = False if self._tp is not None else config.cascade_decode  # not with tensor parallelism yet
        self.prefix_groups = engine_prefix_finder(cascade, self.kv_cache, self.backend.name,
                                                  self.backend.takes_shared_prefix_decode())
        self.step_runner.peers = self._tp  # each step goes to the other ranks first (None: one process)
        logger.info(
            "LLM ready: device %s, dtype %s, backend %s, graph mode %s, KV cache %d tokens (%.1f MiB, %s), page size "
            "%d", device, dtype, self.backend.name, self.step_runner.graph_mode.value, kv_cache_tokens,
            self.kv_cache.pool.bytes / 2**20, str(config.kv_dtype).removeprefix("torch."), config.page_size,
        )
        if draft is not None:
            draft.build(kv_cache_tokens)
        if config.capture:
            self.step_runner.capture(shared_prefix=self.prefix_groups is not None)
            if draft is not None:
                draft.capture()
            if sized:
                check_memory_after_capture(device, config.gpu_memory_utilization)
        self.writer = TokenWriter(loaded.eos_token_ids, self.vocab_size, max_context)  # finish checks
        self._seed_generator = seed_generator(config.seed, device)  # unseeded requests' seeds (EngineConfig.seed)
        if config.capture and device.type == "cuda" and self.vocab_size:  # the sampler's kernels, before traffic
            sampler.warmup(device, self.vocab_size, config.max_batch_size, dtype=dtype)
        if config.capture:  # the step's own kernels (the feed of in-flight tokens), before traffic
            step_kernels.warm_up(device, self.vocab_size)
        self.speculator = Speculator(spec, max_context, draft) if spec is not None else None
        self.step_runner.on_hidden = getattr(draft, "observe", None)  # EAGLE reads the target's hidden states
        self.overlap = config.overlap  # with speculation, steps that verify run serially (see _step)
        self.penalties: PenaltyState | None = None  # made when the first request with penalties arrives
        self.grammars: GrammarCache | None = None  # structured outputs: made (xgrammar imported) on the first use
        self._in_flight: deque[InFlightStep] = deque()  # launched steps whose tokens are not read yet (<= 1)
        self._lock = threading.Lock()  # held by each public call: one call at a time (see _exclusive)
        self._profiler = EngineProfiler(device, self._tp)  # LLM.start_profile / stop_profile
        self._next_id = 0
        self.num_steps = 0
        self.steps_by_mode: Counter[ForwardMode] = Counter()

    @property
    def tensor_parallel_size(self) -> int:
        return self.config.tensor_parallel_size

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (bounded: they are terminated if they do not exit); nothing to do in one
        process. The LLM cannot run steps afterwards. Also on ``with LLM(...) as llm:`` exit, when the LLM is
        collected, and at interpreter exit."""
        if self._tp is not None:
            self._tp.close()

    close = shutdown

    def start_profile(self, directory: str | None = None) -> None:
        """Start torch.profiler on every rank (host and device activity of the steps that follow); traces go to
        ``directory``, else ``$COMPILE_ATTN_TORCH_PROFILER_DIR`` (vLLM's ``$VLLM_TORCH_PROFILER_DIR`` too).
        ``stop_profile`` writes them (engine/execution/profiling.py)."""
        with self._exclusive("start_profile"):
            self._profiler.start(directory)

    def stop_profile(self) -> list[str]:
        """Stop the profilers; return the traces' paths, rank 0's first (workers write theirs as they stop)."""
        with self._exclusive("stop_profile"):
            return self._profiler.stop()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def eos_token_ids(self) -> Any:
        """The token ids that end a request (unless ``ignore_eos``); assignable."""
        return self.writer.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: Any) -> None:
        self.writer.eos_token_ids = ids

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]] | torch.Tensor | np.ndarray,
        sampling_params: SamplingParams | Mapping[str, Any] | Sequence[SamplingParams | Mapping[str, Any]]
        | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt: one RequestOutput per prompt, in order, holding ``SamplingParams.n``
        samples. A prompt is a string (needs a tokenizer), a list or tuple of token ids, or a 1-D integer tensor /
        NumPy array; ``sampling_params`` is one SamplingParams (or dict of its fields) for every prompt, or one per
        prompt. ``use_tqdm`` (a bar of finished requests) defaults to on for several prompts, off for one.

        The whole call is checked first: one malformed prompt or parameter raises an InvalidRequestError (a
        ValueError; RequestTypeError, also a TypeError, for a wrong type) naming it, and nothing is queued. If the
        call raises later (a failing step, KeyboardInterrupt), its requests are aborted and their KV freed; the
        LLM stays usable. Requests queued with ``add_request`` before the call run to completion in it too.
        """
        with self._exclusive("generate"):
            return self._run(split_prompts(prompts), sampling_params, use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Mapping[str, Any] | Sequence[SamplingParams | Mapping[str, Any]]
        | None = None,
        *,
        use_tqdm: bool | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation (a list of ``{"role": ..., "content": ...}``
        messages) or to each of a list of conversations: each is rendered with the tokenizer's chat template (or
        ``chat_template``) and ``add_generation_prompt=True``, then generated like ``generate``'s prompts (the
        RequestOutput's ``prompt`` is the rendered text). NoChatTemplateError without a tokenizer or a template.
        """
        with self._exclusive("chat"):
            texts = [render_chat(self.tokenizer, conv, chat_template) for conv in split_conversations(messages)]
            ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            return self._run(ids, sampling_params, use_tqdm, prompt_texts=texts)

    def _run(self, prompts: list[Any], params: Any, use_tqdm: bool | None,
             prompt_texts: list[str] | None = None) -> list[RequestOutput]:
        """Admit, then step until every request of this call (and any queued before) finishes."""
        groups = admit(self, prompts, params, prompt_texts=prompt_texts)  # checks all, then queues (engine/intake.py)
        requests = [r for group in groups for r in group]
        try:
            start = time.perf_counter()
            show = len(prompts) > 1 if use_tqdm is None else use_tqdm
            with tqdm(total=len(requests), desc="generate", disable=not show) as bar:
                while self.has_work():
                    bar.update(len(self._step()))
        except BaseException:
            self.scheduler.abort(requests)  # leave nothing of this call queued
            for r in requests:
                r.drop_unresolved()
            self._forget_finished_steps()
            raise
        elapsed = time.perf_counter() - start
        logger.info("generated %d tokens for %d requests in %.2f s", sum(r.num_output for r in requests),
                    len(requests), elapsed)
        return [request_output(group, self.tokenizer) for group in groups]

    def add_request(self, prompt: Any, params: SamplingParams | Mapping[str, Any] | None = None) -> Request:
        """Queue a request (a prompt as in ``generate``); it runs in the following ``step()`` calls. Checked like
        ``generate``'s prompts; RequestTooLargeError if it can never fit the KV cache. One request is one sample:
        ``SamplingParams.n`` > 1 is refused here (``generate`` takes it)."""
        with self._exclusive("add_request"):
            (group,) = admit(self, [prompt], params, one_sample=True)
        return group[0]

    def abort_request(self, req: Request) -> None:
        """Drop a queued or running request: its KV is freed and it finishes with reason "abort"."""
        if not isinstance(req, Request):
            raise RequestTypeError(f"abort_request takes a Request from add_request, got {req!r:.60}")
        with self._exclusive("abort_request"):
            self.scheduler.abort([req])
            req.drop_unresolved()
            self._forget_finished_steps()

    def step(self) -> list[Request]:
        """Run one scheduled step; return the requests that finished in it.

        With ``overlap`` (the default) a step is launched before the tokens of the step before it are read, and
        the returned requests are those the previous step's tokens finished: a request finishes one ``step()``
        call later than without overlap, its tokens are the same, and a token computed for it after it stopped
        is dropped. The last call, with nothing left to schedule, returns the last finished requests.

        A step is all-or-nothing: if it raises (including KeyboardInterrupt), its KV allocations are released and
        every request is back in the state it had before it, so the same step can run again. A request whose own
        output is the failure (the model sampled a token outside the vocabulary) finishes with reason "error"
        instead, and the others go on.
        """
        with self._exclusive("step"):
            return self._step()

    def _grammar_cache(self) -> GrammarCache:
        """The compiled grammars of structured outputs, made on first use (engine/intake.py)."""
        return grammar_cache(self)

    @contextlib.contextmanager
    def _exclusive(self, call: str) -> Iterator[None]:
        """One call at a time on this LLM: a second thread gets EngineBusyError instead of mixing batches."""
        if not self._lock.acquire(blocking=False):
            raise EngineBusyError(
                f"LLM.{call}() was called while another call on this LLM is running (from another thread, or "
                f"re-entered); an LLM runs one call at a time: give each thread its own LLM, or serialise the calls"
            )
        try:
            yield
        finally:
            self._lock.release()

    def has_work(self) -> bool:
        """Whether requests are queued or running, or a launched step's tokens are still to be read."""
        return self.scheduler.has_work() or bool(self._in_flight)

    def _step(self) -> list[Request]:
        """Launch the next step; then read the tokens of the step before it (with overlap) or of this one
        (without), write them into their requests and finish those that stop. Returns the finished requests."""
        done: list[Request] = []
        while len(self._in_flight) > 1:  # only after an interrupted read: settle the older step first
            done += self._resolve(self._in_flight[0])
        launched = self._launch()
        keep = 1 if self.overlap and launched is not None else 0
        if keep and launched.guided:
            keep = 0  # a grammar's next mask follows this step's tokens: read them first (docs/structured_outputs.md)
        if keep and self.speculator is not None and (launched.verify is not None or self.speculator.probe_due()):
            keep = 0  # the next step's drafts follow this step's tokens: read them first (docs/speculative.md)
        while len(self._in_flight) > keep:
            done += self._resolve(self._in_flight[0])
        if done and self.speculator is not None:
            self.speculator.settle(self.scheduler.running)
        return done

    def _forget_finished_steps(self) -> None:
        """Drop launched steps whose requests have all finished (aborted): nothing waits for their tokens."""
        self._in_flight = deque(s for s in self._in_flight
                                if any(r.status is not RequestStatus.FINISHED for r in s.requests))

    def _launch(self) -> InFlightStep | None:
        """Schedule a step and launch its forward and sampling without waiting for the device. All or nothing:
        if it raises, the scheduler and every request are as they were (see ``step``)."""
        state = self.scheduler.snapshot()
        step: ScheduledStep | None = None
        try:
            plan = schedule_step(self.scheduler, self.speculator, state)  # with drafts, where they are proposed
            if plan is None:
                return None
            step, rows = plan.step, plan.rows  # rows: which rows sample (several per request verifying drafts)
            in_flight = self._in_flight[-1].tokens if self._in_flight else None  # what placeholders stand for
            fb, feed = build_batch(plan, self.device, self.prefix_groups, in_flight, self.vocab_size)
            prep = prepare_sampling(step, rows, self.penalties, in_flight, self.vocab_size, self.device,
                                    eos_token_ids=self.writer.eos_token_ids, grammars=self.grammars)
            reqs, extras, guided = prep.reqs, prep.extras, prep.guided
            tokens, logprobs = forward_and_sample(self.step_runner, fb, reqs, prep.sampled, self.device, extras, feed,
                                                  rows=rows and rows.rows, positions=rows and rows.positions,
                                                  guided=guided)
        except BaseException:
            for r in step.requests if step is not None else ():
                r.penalty_row = None  # its statistics may hold part of this step: count them again
            try:
                self.scheduler.restore(state)
            except Exception:
                logger.exception("undoing a failed step failed too; this LLM's state may be inconsistent")
            raise
        for r, n in zip(step.requests, step.extend_lens):
            r.num_cached += n
        launched = InFlightStep.launch(reqs, tokens, logprobs, extras.logprob_at if extras else None, rows)
        launched.guided = guided is not None
        self._in_flight.append(launched)
        # A request at its length limit finishes with this token whatever it is: out of the next schedule now.
        if rows is None:
            self.scheduler.retire([r for r in reqs if self.writer.at_length_limit(r, len(r.token_ids))])
        self.num_steps += 1
        self.steps_by_mode[fb.forward_mode] += 1
        return launched

    def _resolve(self, launched: InFlightStep) -> list[Request]:
        """Read a launched step's tokens, write them over their placeholders and finish the requests that stop
        (their KV freed in one call; tokens computed for them by a later step are dropped)."""
        tokens = launched.read(None if self._tp is None else self._tp.check_alive)
        self._in_flight.popleft()
        logprobs = {}
        if launched.logprobs_host is not None:
            rows = [launched.requests[i] for i in launched.logprob_at]
            entries = unpack_logprobs(launched.logprobs_host.tolist(), [r.params.logprobs for r in rows])
            logprobs = dict(zip(launched.logprob_at, entries))
        if launched.verify is not None:
            assert self.speculator is not None
            done = self.speculator.resolve(launched.verify, tokens, logprobs, self.writer, self.kv_cache)
            self.scheduler.finish_all(done)
            if self.penalties is not None:  # the accepted tokens only (the verify step recorded none)
                record_accepted(self.penalties, launched.verify, self.device)
            return [r for r, _ in done]
        done = []
        for i, (r, at, tok) in enumerate(zip(launched.requests, launched.at, tokens)):
            if r.status is RequestStatus.FINISHED:  # aborted, or stopped by an earlier token: nothing to write
                continue
            reason = self.writer.write(r, at, tok, logprobs.get(i))
            if reason:
                done.append((r, reason))
        self.scheduler.finish_all(done)
        return [r for r, _ in done]
