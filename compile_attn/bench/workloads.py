"""Named, seeded serving workloads for the throughput benchmark: prompts as token ids, an output length per
request, one temperature, EOS ignored so every request generates exactly its output length.

``nanovllm`` draws what nano-vllm's ``bench.py`` draws, in the same order, from Python's ``random`` seeded with 0;
``fixed`` is N prompts of P random ids and O new tokens each, greedy; ``long-context`` is ``fixed`` at 32 x (7,680 +
256), a step that reads mostly KV (what an fp8 KV cache speeds up). Two exercise the prefix cache: ``shared-prefix``
(N prompts behind one system prompt) and ``multi-turn`` (conversations whose every turn resends the history and the
previous answer, so a turn's prompt exists only once the answer before it is generated). ``arrivals`` is traffic
over time: requests arrive as a Poisson process, with log-normal prompt and output lengths, so prefill happens in
chunks of any size beside the running requests' decode rows (the throughput driver adds each at its arrival time).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from compile_attn.errors import CompileAttnError

WORKLOADS = ("nanovllm", "fixed", "shared-prefix", "long-context")  # every prompt known up front: any client can send them
# a multi-turn prompt needs the answer before it; arrivals are timed (the throughput driver runs both)
ALL_WORKLOADS = (*WORKLOADS, "multi-turn", "arrivals")
PREFIX_WORKLOADS = ("shared-prefix", "multi-turn")  # run with the prefix cache on and off


class WorkloadError(CompileAttnError, ValueError):
    """A workload name or size that cannot be built."""


@dataclass(frozen=True)
class Workload:
    """``prompts[i]`` (token ids) generates ``output_lens[i]`` tokens at ``temperature`` (0: greedy). A multi-turn
    workload has ``follow_ups[i]``: the user's tokens of each later turn of conversation ``i``, whose prompt is the
    turn before's prompt, its answer (``output_lens[i]`` tokens) and these."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    temperature: float
    follow_ups: list[list[list[int]]] = field(default_factory=list)
    arrival_s: list[float] = field(default_factory=list)  # when request i arrives, from the round's start (empty: all at 0)

    def turns(self, i: int) -> int:
        return 1 + (len(self.follow_ups[i]) if self.follow_ups else 0)

    def _prompt_lens(self, i: int) -> list[int]:
        """The prompt length of each turn of conversation ``i`` (one turn without follow-ups)."""
        lens = [len(self.prompts[i])]
        for extra in self.follow_ups[i] if self.follow_ups else []:
            lens.append(lens[-1] + self.output_lens[i] + len(extra))
        return lens

    @property
    def num_seqs(self) -> int:
        """Requests (a conversation's turns each count)."""
        return sum(self.turns(i) for i in range(len(self.prompts)))

    @property
    def prompt_tokens(self) -> int:
        return sum(sum(self._prompt_lens(i)) for i in range(len(self.prompts)))

    @property
    def output_tokens(self) -> int:
        return sum(o * self.turns(i) for i, o in enumerate(self.output_lens))

    @property
    def longest(self) -> int:
        """Tokens the longest request holds at its end (prompt + output)."""
        return max(self._prompt_lens(i)[-1] + o for i, o in enumerate(self.output_lens))

    def summary(self) -> dict:
        out = dict(name=self.name, num_seqs=self.num_seqs, prompt_tokens=self.prompt_tokens,
                   output_tokens=self.output_tokens, temperature=self.temperature, ignore_eos=True,
                   longest=self.longest)
        if self.arrival_s:
            out["last_arrival_s"] = self.arrival_s[-1]
        return out


def nanovllm(num_seqs: int = 256, max_input: int = 1024, max_output: int = 1024, vocab_size: int = 10001,
             seed: int = 0) -> Workload:
    """nano-vllm's benchmark: ``num_seqs`` prompts of ``randint(100, max_input)`` ids drawn by ``randint(0, 10000)``,
    then ``num_seqs`` output lengths ``randint(100, max_output)``; temperature 0.6. A maximum below 100 (a scaled-down
    run) draws from half of it up to it instead. Ids are taken modulo ``vocab_size`` (no change for
    vocabularies above 10,000)."""
    if min(num_seqs, max_input, max_output, vocab_size) < 1:
        raise WorkloadError(f"nanovllm needs num_seqs, max_input, max_output and vocab_size >= 1, got "
                            f"{num_seqs}, {max_input}, {max_output}, {vocab_size}")
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) % vocab_size for _ in range(rng.randint(_low(max_input), max_input))]
               for _ in range(num_seqs)]
    output_lens = [rng.randint(_low(max_output), max_output) for _ in range(num_seqs)]
    return Workload("nanovllm", prompts, output_lens, temperature=0.6)


def _low(high: int) -> int:
    return 100 if high >= 100 else max(1, high // 2)


def fixed(num_seqs: int = 256, prompt_len: int = 256, output_len: int = 128, vocab_size: int = 10001,
          seed: int = 0) -> Workload:
    """``num_seqs`` x (``prompt_len`` random ids + ``output_len`` new tokens), greedy."""
    if min(num_seqs, prompt_len, output_len, vocab_size) < 1:
        raise WorkloadError(f"fixed needs num_seqs, prompt_len, output_len and vocab_size >= 1, got "
                            f"{num_seqs}, {prompt_len}, {output_len}, {vocab_size}")
    rng = random.Random(seed)
    high = min(10000, vocab_size - 1)
    prompts = [[rng.randint(0, high) for _ in range(prompt_len)] for _ in range(num_seqs)]
    return Workload("fixed", prompts, [output_len] * num_seqs, temperature=0.0)


def long_context(num_seqs: int = 32, prompt_len: int = 7680, output_len: int = 256, vocab_size: int = 10001,
                 seed: int = 0) -> Workload:
    """``fixed`` with long prompts: ``num_seqs`` x (``prompt_len`` random ids + ``output_len`` new tokens), greedy."""
    w = fixed(num_seqs, prompt_len, output_len, vocab_size, seed)
    return Workload("long-context", w.prompts, w.output_lens, temperature=0.0)


def shared_prefix(num_seqs: int = 256, prompt_len: int = 2048, unique_len: int = 32, output_len: int = 128,
                  vocab_size: int = 10001, seed: int = 0) -> Workload:
    """``num_seqs`` prompts of one system prompt (``prompt_len`` random ids) followed by ``unique_len`` random ids of
    their own, ``output_len`` new tokens each, greedy."""
    if min(num_seqs, prompt_len, unique_len, output_len, vocab_size) < 1:
        raise WorkloadError(f"shared-prefix needs num_seqs, prompt_len, unique_len, output_len and vocab_size >= 1, "
                            f"got {num_seqs}, {prompt_len}, {unique_len}, {output_len}, {vocab_size}")
    rng = random.Random(seed)
    high = min(10000, vocab_size - 1)
    system = [rng.randint(0, high) for _ in range(prompt_len)]
    prompts = [system + [rng.randint(0, high) for _ in range(unique_len)] for _ in range(num_seqs)]
    return Workload("shared-prefix", prompts, [output_len] * num_seqs, temperature=0.0)


def multi_turn(num_seqs: int = 64, prompt_len: int = 1024, turn_len: int | None = None, output_len: int = 128,
               turns: int = 4, vocab_size: int = 10001, seed: int = 0) -> Workload:
    """``num_seqs`` conversations of ``turns`` turns: the first prompt is ``prompt_len`` random ids, each later one
    the history (the turn before's prompt and its ``output_len``-token answer) and ``turn_len`` new random ids
    (default: an eighth of ``prompt_len``); greedy."""
    turn_len = max(1, prompt_len // 8) if turn_len is None else turn_len
    if min(num_seqs, prompt_len, turn_len, output_len, turns, vocab_size) < 1:
        raise WorkloadError(f"multi-turn needs num_seqs, prompt_len, turn_len, output_len, turns and vocab_size "
                            f">= 1, got {num_seqs}, {prompt_len}, {turn_len}, {output_len}, {turns}, {vocab_size}")
    rng = random.Random(seed)
    high = min(10000, vocab_size - 1)
    prompts = [[rng.randint(0, high) for _ in range(prompt_len)] for _ in range(num_seqs)]
    follow_ups = [[[rng.randint(0, high) for _ in range(turn_len)] for _ in range(turns - 1)] for _ in range(num_seqs)]
    return Workload("multi-turn", prompts, [output_len] * num_seqs, temperature=0.0, follow_ups=follow_ups)


def arrivals(num_seqs: int = 512, prompt_len: int = 1024, output_len: int = 192, request_rate: float = 128.0,
             vocab_size: int = 10001, seed: int = 0) -> Workload:
    """``num_seqs`` requests arriving as a Poisson process of ``request_rate`` per second (exponential gaps), each a
    prompt of log-normal length with median ``prompt_len`` (sigma 0.9, clipped to 16 .. 8 x the median) and a
    log-normal output length with median ``output_len`` (sigma 0.8, clipped to 8 .. 8 x the median); random ids,
    temperature 0.6. Which prompts land in one step is up to the engine's schedule, so prefill chunks take any size."""
    if min(num_seqs, prompt_len, output_len, vocab_size) < 1 or not (request_rate > 0 and math.isfinite(request_rate)):
        raise WorkloadError(f"arrivals needs num_seqs, prompt_len, output_len and vocab_size >= 1 and a finite "
                            f"request_rate > 0, got {num_seqs}, {prompt_len}, {output_len}, {vocab_size}, "
                            f"{request_rate}")
    rng = random.Random(seed)
    high = min(10000, vocab_size - 1)

    def length(median: int, sigma: float, low: int) -> int:
        return int(min(max(round(rng.lognormvariate(math.log(median), sigma)), min(low, median)), 8 * median))

    prompts = [[rng.randint(0, high) for _ in range(length(prompt_len, 0.9, 16))] for _ in range(num_seqs)]
    output_lens = [length(output_len, 0.8, 8) for _ in range(num_seqs)]
    times, t = [], 0.0
    for _ in range(num_seqs):
        times.append(t)
        t += rng.expovariate(request_rate)
    return Workload("arrivals", prompts, output_lens, temperature=0.6, arrival_s=times)


def build(name: str, vocab_size: int, *, num_seqs: int | None = None, prompt_len: int | None = None,
          output_len: int | None = None, request_rate: float | None = None) -> Workload:
    """Workload ``name`` with its defaults, or the given sizes (nanovllm: the maximum prompt and output lengths;
    shared-prefix: the shared system prompt; multi-turn: conversations and their first prompt; arrivals: the median
    prompt and output lengths, and ``request_rate`` per second)."""
    sizes = {k: v for k, v in dict(num_seqs=num_seqs, prompt_len=prompt_len, output_len=output_len).items()
             if v is not None}
    if name == "nanovllm":
        renamed = {"prompt_len": "max_input", "output_len": "max_output"}
        return nanovllm(vocab_size=vocab_size, **{renamed.get(k, k): v for k, v in sizes.items()})
    if name == "fixed":
        return fixed(vocab_size=vocab_size, **sizes)
    if name == "long-context":
        return long_context(vocab_size=vocab_size, **sizes)
    if name == "shared-prefix":
        return shared_prefix(vocab_size=vocab_size, **sizes)
    if name == "multi-turn":
        return multi_turn(vocab_size=vocab_size, **sizes)
    if name == "arrivals":
        return arrivals(vocab_size=vocab_size, **sizes, **({} if request_rate is None else {"request_rate": request_rate}))
    raise WorkloadError(f"unknown workload {name!r}; choose among {', '.join(ALL_WORKLOADS)}")
