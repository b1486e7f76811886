"""Sampler: sampled frequencies against a float64 filtered softmax (no filter, top-k, top-p, both, min_p, mixed
rows), greedy rows, temperature, seeded tokens independent of the batch, the hash noise, the compiled path
(same tokens, no recompiles across batch sizes after warm-up), and FlashInfer's path on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from compile_attn.engine import LLM
from compile_attn.engine.execution.sampling import flashinfer_sampling
from compile_attn.engine.execution.sampling import sampler as sampler_module
from compile_attn.engine.execution.sampling.sampler import SamplingPlan, hashed_uniform, sample, warmup
from compile_attn.engine.requests.sampling_params import SamplingParams
from compile_attn.models import ToyDecoder, ToyDecoderConfig
from tests.stats_helpers import assert_chi_square_fits

Filters = tuple[float, int, float, float]  # temperature, top_k, top_p, min_p


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The distribution a row must follow, in float64 by a full sort: top-k and min_p on the softmax at the
    temperature, then top-p (the smallest prefix reaching top_p) over what is left, renormalised."""
    probs = (logits.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True, stable=True)
    p_sorted = probs[order]
    keep = torch.ones_like(p_sorted, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    keep &= p_sorted >= min_p * p_sorted[0]
    q = torch.where(keep, p_sorted, 0.0)
    q = q / q.sum()
    keep &= (q.cumsum(0) - q) < top_p
    out = torch.zeros_like(probs)
    out[order] = torch.where(keep, p_sorted, 0.0)
    return out / out.sum()


def batch_params(groups: list[Filters], per_group: int, device: str = "cpu", seed_base: int = 0) -> dict:
    """Tensors for ``per_group`` rows of each filter set, rows interleaved; distinct seeds per row."""
    rows = [g for _ in range(per_group) for g in groups]
    t, k, p, m = (list(col) for col in zip(*rows))
    n = len(rows)
    return dict(temperature=torch.tensor(t, device=device), top_k=torch.tensor(k, device=device),
                top_p=torch.tensor(p, device=device), min_p=torch.tensor(m, device=device),
                seeds=torch.arange(seed_base, seed_base + n, device=device),
                positions=torch.full((n,), 5, dtype=torch.int64, device=device))


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    """Chi-square goodness of fit of the sampled ``tokens`` to ``probs``; never a token outside the support."""
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    outside = counts[probs.cpu() == 0].sum()
    assert outside == 0, f"{what}: {int(outside)} samples outside the filtered support"
    assert_chi_square_fits(counts.numpy(), (probs.cpu().double() * tokens.numel()).numpy(), alpha=1e-6, what=what)


LOGITS = torch.randn(40, generator=torch.Generator().manual_seed(3)) * 1.5

CASES: dict[str, Filters] = {
    "no filter": (1.0, 0, 1.0, 0.0),
    "temperature 0.5": (0.5, 0, 1.0, 0.0),
    "temperature 2": (2.0, 0, 1.0, 0.0),
    "top-k 5": (1.0, 5, 1.0, 0.0),
    "top-p 0.7": (0.8, 0, 0.7, 0.0),
    "top-k 10 + top-p 0.8": (1.0, 10, 0.8, 0.0),
    "min_p 0.2": (1.0, 0, 1.0, 0.2),
    "top-k 12 + min_p 0.1": (1.3, 12, 1.0, 0.1),
    "top-k + top-p + min_p": (1.0, 15, 0.9, 0.05),
}


def sample_stats(groups: list[Filters], per_group: int, device: str = "cpu", logits_row: torch.Tensor = LOGITS,
                 **kw) -> None:
    params = batch_params(groups, per_group, device)
    logits = logits_row.to(device).repeat(len(groups) * per_group, 1)
    tokens = sample(logits, **params, **kw).cpu().view(per_group, len(groups))
    for j, g in enumerate(groups):
        assert_follows(tokens[:, j], reference_probs(logits_row, *g), f"{g}")


@pytest.mark.parametrize("case", list(CASES))
def test_samples_follow_the_filtered_softmax(case: str) -> None:
    sample_stats([CASES[case]], 20000)


def test_mixed_rows_in_one_batch_each_follow_their_filters() -> None:
    groups = list(CASES.values())
    sample_stats(groups, 6000)


def test_top_p_without_top_k_next_to_top_k_rows() -> None:
    # the full-sort candidates (a top-p-only row) and top-k rows in one batch
    sample_stats([CASES["top-p 0.7"], CASES["top-k 5"], CASES["no filter"]], 8000)


def test_large_vocabulary_rows_across_argmax_blocks() -> None:
    # mass on tokens spread over the first-stage argmax blocks, the last one padded
    vocab = 5000
    row = torch.full((vocab,), -30.0)
    hot = torch.tensor([3, 2047, 2048, 2500, 4095, 4096, 4998, 4999])
    row[hot] = torch.tensor([0.5, 1.0, 0.2, -0.3, 0.8, 0.0, 1.2, 0.4])
    sample_stats([(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.3), (1.0, 4, 1.0, 0.0)], 4000, logits_row=row)


def test_wide_batches_draw_what_each_row_draws_alone() -> None:
    # from WIDE_ROWS rows on, the argmax runs in one stage: every seeded row must still draw the token it draws
    # alone (one row: the two-stage argmax), across argmax blocks (vocab > 2048), ties to the first index included
    from compile_attn.engine.execution.sampling.portable import WIDE_ROWS

    gen = torch.Generator().manual_seed(5)
    rows, vocab = WIDE_ROWS + 3, 4500
    logits = torch.randn(rows, vocab, generator=gen)
    logits[:8, 4100] = logits[:8, 10] = 50.0  # greedy rows with a tie across blocks: the first index wins
    temperature = torch.where(torch.arange(rows) < 8, 0.0, 0.8)
    seeds, positions = torch.arange(rows) * 7 + 1, torch.arange(rows) % 5
    together = sample(logits, temperature, seeds=seeds, positions=positions)
    alone = torch.stack([sample(logits[i:i + 1], temperature[i:i + 1], seeds=seeds[i:i + 1],
                                positions=positions[i:i + 1])[0] for i in range(rows)])
    assert torch.equal(together, alone)
    assert together[:8].tolist() == [10] * 8
    assert len(set(together[8:].tolist())) > rows // 2  # sampled rows: spread, not one argmax


def test_greedy_rows_take_the_argmax_next_to_sampled_rows() -> None:
    n = 64
    logits = torch.randn(n, 3000, generator=torch.Generator().manual_seed(0))
    groups = [(0.0, 0, 1.0, 0.0), (0.0, 5, 0.5, 0.3), (1.0, 0, 1.0, 0.0), (1.0, 3, 0.9, 0.0)]
    params = batch_params(groups, n // 4)
    tokens = sample(logits, **params)
    greedy = params["temperature"] == 0
    assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])
    assert not torch.equal(tokens[~greedy], logits.argmax(-1)[~greedy])
    assert torch.equal(sample(logits, torch.zeros(n), seeds=params["seeds"]), logits.argmax(-1))


def test_seeded_rows_are_independent_of_their_batch() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(12, 300, generator=gen)
    groups = [(1.0, 0, 1.0, 0.0), (0.7, 20, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (1.2, 30, 0.8, 0.05), (0.9, 0, 1.0, 0.1),
              (1.0, 5, 1.0, 0.0)]
    params = batch_params(groups, 2, seed_base=100)
    alone = torch.stack([sample(logits[i : i + 1], **{k: v[i : i + 1] for k, v in params.items()})[0]
                         for i in range(12)])
    together = sample(logits, **params)
    assert torch.equal(alone, together)
    # the same rows reversed, among other rows with every kind of filter (a top-p-only row makes the
    # candidates the whole vocabulary; other top_k values change the candidate count)
    crowd_logits = torch.randn(7, 300, generator=gen)
    crowd = batch_params([(1.0, 200, 0.95, 0.0), (0.5, 0, 0.3, 0.0), (1.0, 0, 1.0, 0.0)], 2, seed_base=999)
    crowd = {k: torch.cat([v, v[:1]]) for k, v in crowd.items()}
    mixed = {k: torch.cat([crowd[k], params[k].flip(0)]) for k in params}
    assert torch.equal(sample(torch.cat([crowd_logits, logits.flip(0)]), **mixed)[7:].flip(0), together)
    # another seed or position changes the draws
    other = dict(params, seeds=params["seeds"] + 1)
    assert not torch.equal(sample(logits, **other), together)


def test_a_seeded_row_keeps_its_token_when_a_filter_keeps_it() -> None:
    # the noise is keyed by token id: top-k / top-p / min_p that keep the unfiltered draw do not change it
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(11)).repeat(300, 1)
    seeds = torch.arange(300)
    free = sample(logits, torch.ones(300), seeds=seeds)
    top_k = sample(logits, torch.ones(300), torch.full((300,), 499), seeds=seeds)
    assert torch.equal(free, top_k)


def test_plan_from_the_host_matches_the_rows() -> None:
    plan = SamplingPlan.for_rows([0.0, 1.0, 1.0, 0.7], [9, 0, 40, 0], [0.5, 1.0, 0.9, 0.8], [0.0, 0.2, 0.0, 0.0],
                                 [False, False, False, False])
    # row 0 is greedy (its filters ignored), row 1 plain with min_p, rows 2-3 filtered (row 3 top-p only)
    assert plan == SamplingPlan(plain_rows=True, filtered_rows=True, max_top_k=40, top_p_without_top_k=True,
                                top_p_rows=True, min_p_rows=True, flashinfer_eligible=True)
    assert not SamplingPlan.for_rows([1.0], [5], [1.0], [0.0], [True]).flashinfer_eligible
    assert not SamplingPlan.for_rows([1.0], [5], [1.0], [0.1], [False]).flashinfer_eligible
    assert SamplingPlan.for_rows([1.0, 0.0], None, None, None) == SamplingPlan()


def test_hashed_uniforms_equal_the_unsigned_32_bit_hash() -> None:
    mask = 0xFFFFFFFF

    def mix(h: torch.Tensor) -> torch.Tensor:
        h = ((h ^ (h >> 16)) * 0x045D9F3B) & mask
        h = ((h ^ (h >> 16)) * 0x045D9F3B) & mask
        return h ^ (h >> 16)

    seeds = torch.tensor([0, 1, 2**40 + 5, -3, 2**31 - 1])
    positions = torch.tensor([0, 7, 100000, 2**33, 5])
    h = mix(((seeds[:, None] & mask) * 0x2545F491 + (positions[:, None] & mask) * 0x6C8E9CF5) & mask)
    h = mix((h + torch.arange(70000)[None, :] * 0x1B873593) & mask)
    assert torch.equal(hashed_uniform(seeds, positions, 70000), ((h >> 8).float() + 0.5) / float(1 << 24))


def test_hashed_uniforms_are_deterministic_per_row_and_well_spread() -> None:
    u = hashed_uniform(torch.tensor([3, 3, 4]), torch.tensor([10, 10, 10]), 100000)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005


def test_sample_refuses_bad_shapes_and_backends() -> None:
    with pytest.raises(ValueError, match="rows, vocab"):
        sample(torch.zeros(5), torch.ones(5))
    with pytest.raises(ValueError, match="temperature must have shape"):
        sample(torch.zeros(2, 5), torch.ones(3))
    with pytest.raises(ValueError, match="backend"):
        sample(torch.zeros(2, 5), torch.ones(2), torch.tensor([2, 2]), backend="fast")
    if not flashinfer_sampling.available(torch.device("cpu")):
        with pytest.raises(ValueError, match="FlashInfer"):
            sample(torch.zeros(2, 5), torch.ones(2), torch.tensor([2, 2]), backend="flashinfer")


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), float("inf")])
def test_min_p_outside_0_1_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=bad)


def test_engine_filters_that_keep_one_token_give_the_greedy_tokens() -> None:
    # min_p 1, top_k 1 and a tiny top_p each keep only the most likely token: through LLM._sample's uploads
    # (a filter only some rows use, others absent) the sampled tokens must equal greedy decoding
    cfg = ToyDecoderConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                           intermediate_size=64)
    torch.manual_seed(0)
    llm = LLM(ToyDecoder(cfg).eval(), max_batch_size=4, max_num_tokens=32, kv_cache_tokens=256, max_context=64,
              page_size=4, graph_mode="none", compile=False, device="cpu")
    prompts = [[(5 * i + j) % 97 for j in range(n)] for i, n in enumerate([4, 9, 2, 6])]
    greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))]
    one_token = [SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.5, min_p=1.0),
                 SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.5, top_k=1, seed=3),
                 SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.5, top_p=1e-6),
                 SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.0, top_k=5)]
    assert [o.token_ids for o in llm.generate(prompts, one_token)] == greedy


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.fixture(autouse=True)
def _sampler_warm_state():
    """A compiled warm-up marks its device (later LLMs there then sample through the compiled graphs): undo it, so
    that tests run after this module see the sampler as a fresh process does."""
    warmed = set(sampler_module._warmed_compiled)
    yield
    sampler_module._warmed_compiled.clear()
    sampler_module._warmed_compiled.update(warmed)


def test_compiled_path_matches_eager_and_never_recompiles_after_warmup() -> None:
    vocab = 3000
    calls = warmup("cpu", vocab, max_rows=8, dtype=torch.float32, backend="portable", compiled=True)
    assert calls > 0
    built = _graphs()
    groups = [(1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (0.8, 7, 0.9, 0.0), (1.0, 0, 1.0, 0.2), (1.0, 0, 0.6, 0.0)]
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 3, 5, 8, 6, 2):
        params = batch_params(groups, 2)
        params = {k: v[:rows] for k, v in params.items()}
        with torch.inference_mode():
            logits = torch.randn(rows, vocab, generator=gen)
        plan = SamplingPlan.for_rows(*(params[k].tolist() for k in ("temperature", "top_k", "top_p", "min_p")))
        got = sample(logits, **params, plan=plan, compiled=True)
        assert torch.equal(got, sample(logits, **params, plan=plan, compiled=False)), rows
    assert _graphs() == built, "a batch size compiled after warm-up"


# --------------------------------------------------------------------------- GPU
GPU_BACKENDS = ["portable-eager", "portable-compiled", "flashinfer"]


def _gpu_kwargs(backend: str) -> dict:
    if backend == "flashinfer":
        if not flashinfer_sampling.available(torch.device("cuda")):
            pytest.skip("FlashInfer is not installed")
        return dict(backend="flashinfer")
    return dict(backend="portable", compiled=backend == "portable-compiled")


def _plan(params: dict, backend: str) -> SamplingPlan:
    """The host plan for ``params``; FlashInfer serves only rows without an explicit seed."""
    cols = (params[k].tolist() for k in ("temperature", "top_k", "top_p", "min_p"))
    return SamplingPlan.for_rows(*cols, seeded=backend != "flashinfer")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_samples_follow_the_filtered_softmax(backend: str, dtype: torch.dtype) -> None:
    kw = _gpu_kwargs(backend)
    groups = [CASES[c] for c in ("no filter", "temperature 0.5", "top-k 5", "top-p 0.7", "top-k 10 + top-p 0.8")]
    if backend != "flashinfer":
        groups += [CASES["min_p 0.2"], CASES["top-k + top-p + min_p"]]
    # distinct even in bf16 (a tie at the top-k boundary would make the kept set ambiguous); the reference
    # reads the same rounded logits
    row = (torch.randperm(40, generator=torch.Generator().manual_seed(3)) * 0.15 - 3.0).to(dtype)
    assert row.unique().numel() == row.numel()
    per_group = 20000
    params = batch_params(groups, per_group, "cuda")
    logits = row.cuda().repeat(len(groups) * per_group, 1)
    tokens = sample(logits, **params, plan=_plan(params, backend), **kw).cpu().view(per_group, len(groups))
    for j, g in enumerate(groups):
        assert_follows(tokens[:, j], reference_probs(row.float(), *g), f"{backend} {g}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_large_vocabulary_greedy_and_sampled_rows(backend: str) -> None:
    kw = _gpu_kwargs(backend)
    vocab = 128256
    row = torch.full((vocab,), -30.0)
    hot = torch.tensor([0, 2047, 2048, 65000, 128000, 128255])
    row[hot] = torch.tensor([0.5, 1.0, 0.2, -0.3, 0.8, 1.2])
    groups = [(1.0, 0, 1.0, 0.0), (1.0, 4, 1.0, 0.0), (1.0, 0, 0.8, 0.0)]
    per_group = 1000
    params = batch_params(groups, per_group, "cuda")
    tokens = sample(row.cuda().repeat(len(groups) * per_group, 1), **params, plan=_plan(params, backend), **kw)
    tokens = tokens.cpu().view(per_group, len(groups))
    for j, g in enumerate(groups):
        assert_follows(tokens[:, j], reference_probs(row, *g), f"{backend} {g}")
    logits = torch.randn(64, vocab, device="cuda", dtype=torch.bfloat16)
    params = batch_params([(0.0, 0, 1.0, 0.0), (1.0, 50, 0.9, 0.0)], 32, "cuda")
    assert torch.equal(sample(logits, **params, plan=_plan(params, backend), **kw)[::2], logits.argmax(-1)[::2])


@pytest.mark.gpu
def test_gpu_compiled_seeded_rows_are_independent_of_their_batch_without_recompiles() -> None:
    vocab = 128256
    warmup("cuda", vocab, max_rows=256, dtype=torch.bfloat16, backend="portable", compiled=True)
    built = _graphs()
    gen = torch.Generator().manual_seed(1)
    groups = [(1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (0.8, 50, 0.9, 0.0), (1.0, 0, 1.0, 0.1)]
    params = batch_params(groups, 64, "cuda")
    with torch.inference_mode():
        logits = torch.randn(256, vocab, generator=gen).to("cuda", torch.bfloat16)
    plan = SamplingPlan.for_rows(*(params[k].tolist() for k in ("temperature", "top_k", "top_p", "min_p")))
    together = sample(logits, **params, plan=plan, compiled=True)
    for lo, hi in ((0, 1), (3, 40), (100, 256)):
        part = {k: v[lo:hi] for k, v in params.items()}
        plan = SamplingPlan.for_rows(*(part[k].tolist() for k in ("temperature", "top_k", "top_p", "min_p")))
        assert torch.equal(sample(logits[lo:hi], **part, plan=plan, compiled=True), together[lo:hi])
    assert _graphs() == built, "a batch size compiled after warm-up"
