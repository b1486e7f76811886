"""What each rank runs in the distributed tests (module level, so spawned processes can import it).

Every rank builds the same seeded tiny model, keeps an unsharded HF eager copy as the reference, shards its own
copy, runs the three-step ragged scenario of ``tests.hf.hf_steps`` through the compile_attn attention path (its
own KV cache, sized by the sharded model's per-rank heads) and compares the logits with the reference's.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from tests.hf.hf_steps import random_sequences, run_scenario
from tests.hf.hf_tiny_models import build_pair
from tests.reference import max_rel_error

from compile_attn.distributed import all_reduce, load_sharded, shard_model, tp_rank
from compile_attn.hf import HFModelAdapter

TOL = 1e-5


def reference_logits(ref: torch.nn.Module, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [ref(seq[None]).logits[0] for seq in sequences]


def check_close(what: str, got: list[torch.Tensor], want: list[torch.Tensor], tol: float = TOL) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape, f"{what} request {i}: logits {tuple(g.shape)} vs reference {tuple(w.shape)}"
        err = max_rel_error(g, w)
        assert err <= tol, f"rank {tp_rank()}, {what} request {i}: relative error {err:.2e} > {tol}"


def run_adapter(adapter: Any, model: Any = None, seed: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the scenario's sequences, their logits from ``model`` or the adapter itself) on a fresh KV cache."""
    kv = adapter.make_kv_cache(max_batch_size=8, max_context=64, kv_cache_tokens=256)
    sequences = random_sequences(adapter.vocab_size, seed=seed)
    return sequences, run_scenario(adapter if model is None else model, kv, "torch_native", adapter.attention_layers(), sequences)


def sharded_families(rank: int, world_size: int, cases: list[tuple[str, dict[str, Any]]]) -> None:
    """Each (family, config overrides): the sharded model's logits equal the unsharded HF eager model's."""
    for family, overrides in cases:
        ours, ref = build_pair(family, attn="eager", **overrides)
        heads, kv_heads = ours.config.num_attention_heads, ours.config.num_key_value_heads
        adapter = HFModelAdapter(shard_model(copy.deepcopy(ours), rank, world_size))
        layer = adapter.attention_layers()[0]
        assert (layer.num_heads, layer.num_kv_heads) == (heads // world_size, max(1, kv_heads // world_size))
        assert adapter.make_kv_cache(max_batch_size=1, max_context=8, kv_cache_tokens=8).pool.num_kv_heads == layer.num_kv_heads
        sequences, logits = run_adapter(adapter)
        check_close(f"{family} {overrides}", logits, reference_logits(ref, sequences))


def compiled_family(rank: int, world_size: int, family: str, compiler: str) -> None:
    """``torch.compile(backend="compile_attn", fullgraph=True)`` of the sharded model: the all-reduces stay in the
    compiled pieces, attention alone is split out, and the logits equal the unsharded HF eager model's."""
    from compile_attn.compiler.backend import compile_attn_backend
    from compile_attn.passes.split import split_graph

    torch._dynamo.reset()
    ours, ref = build_pair(family, attn="eager")
    adapter = HFModelAdapter(shard_model(copy.deepcopy(ours), rank, world_size))
    graphs: list[list[tuple[bool, list[str]]]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        split = split_graph(copy.deepcopy(gm))
        graphs.append([(p.is_split_op, p.op_labels) for p in split.pieces])
        return compile_attn_backend(gm, example_inputs, options={"compiler": compiler, "cache_dir": None})

    compiled = torch.compile(adapter, backend=backend, fullgraph=True)
    sequences, logits = run_adapter(adapter, compiled, seed=5)
    check_close(f"compiled {family}", logits, reference_logits(ref, sequences))
    layers = ours.config.num_hidden_layers
    assert len(graphs) == 2, f"one static and one dynamic graph expected, got {len(graphs)}"  # tokens 21, 41, 4
    for graph in graphs:
        split_ops = [labels for is_split, labels in graph if is_split]
        assert split_ops == [["compile_attn::attention"]] * layers, split_ops
        in_pieces = sum(labels.count("compile_attn::tp_all_reduce") for is_split, labels in graph if not is_split)
        # per layer: o_proj and down_proj; plus the embedding
        assert in_pieces == 2 * layers + 1, graph
        gathers = sum(labels.count("compile_attn::tp_all_gather") for _, labels in graph)
        assert gathers == 1, graph


def loaded_checkpoint(rank: int, world_size: int, path: str, family: str) -> None:
    """``load_sharded`` of a checkpoint directory gives the unsharded model's logits."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    adapter = load_sharded(path, rank, world_size)
    sequences, logits = run_adapter(adapter)
    check_close(f"loaded {family}", logits, reference_logits(ref, sequences))


def step_messages(rank: int, world_size: int) -> None:
    """Rank 0 sends steps of each kind (host per-token fields, device ones, keep / feed, table rows, shutdown);
    every other rank checks what it received against the same steps built locally."""
    import numpy as np

    from compile_attn.batch import ForwardBatch, ForwardMode
    from compile_attn.distributed.state import tp_group, tp_host_group
    from compile_attn.distributed.step_message import ProfileControl, StepReceiver, StepSender

    def steps() -> list[tuple[ForwardBatch, Any, Any, list]]:
        decode = ForwardBatch.build(req_pool_indices=[3, 1], prefix_lens=[5, 9], extend_lens=[1, 1],
                                    out_cache_loc=torch.tensor([40, 41]), input_ids=[-1, 17],
                                    table_write_pending=True)
        extend = ForwardBatch.build(req_pool_indices=[2], prefix_lens=[4], extend_lens=[3],
                                    out_cache_loc=torch.tensor([7, 8, 9]), input_ids=[5, 6, 7])
        extend.host_tokens = None  # as a batch built from device slots: the per-token fields go as a device message
        verify = ForwardBatch.build(req_pool_indices=[0], prefix_lens=[6], extend_lens=[3],
                                    out_cache_loc=[20, 21, 22], input_ids=[1, 2, 3], draft_parents=[(-1, 0, 0)],
                                    forward_mode=ForwardMode.TARGET_VERIFY)
        return [(decode, None, torch.tensor([11]), []),
                (extend, torch.tensor([2]), None, [(2, np.array([30, 31, 32, 33]))]),
                (verify, torch.tensor([0, 1, 2]), None, [])]

    directory = "/tmp/tr\u00e4ces dir"  # any path: sent as UTF-8 bytes
    if rank == 0:
        sender = StepSender(tp_group(), tp_host_group(), torch.device("cpu"))
        sender.profile(directory)
        for fb, keep, feed, table in steps():
            sender.send(fb, keep, feed, table)
        sender.profile(None)
        sender.shutdown()
        return
    receiver = StepReceiver(tp_group(), tp_host_group(), torch.device("cpu"))
    assert receiver.receive() == ProfileControl(directory)
    for fb, keep, feed, table in steps():
        msg = receiver.receive()
        assert msg is not None
        assert msg.forward_mode == fb.forward_mode
        assert msg.input_ids.tolist() == fb.input_ids.tolist()
        assert msg.positions.tolist() == fb.positions.tolist()
        assert msg.out_cache_loc.tolist() == fb.out_cache_loc.tolist()
        assert (msg.req_pool_indices, msg.prefix_lens, msg.extend_lens) == (
            fb.req_pool_indices_cpu, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)
        assert msg.table_write_pending == fb.table_write_pending
        assert (None if msg.keep is None else msg.keep.tolist()) == (None if keep is None else keep.tolist())
        assert (None if msg.feed is None else msg.feed.tolist()) == (None if feed is None else feed.tolist())
        assert [(r, s.tolist()) for r, s in msg.table_rows] == [(r, s.tolist()) for r, s in table]
    assert receiver.receive() == ProfileControl(None)
    assert receiver.receive() is None


def fast_all_reduce_agreement(rank: int, world_size: int) -> None:
    """The Lamport all-reduce is set up on every rank or on none: rank 0 could take it (its check passes), the
    others cannot (the CPU), so no rank does; sums then go through the process group."""
    from compile_attn.distributed import lamport_all_reduce as lamport
    from compile_attn.distributed.state import tp_group, tp_group_name

    why_not = lamport._why_not
    if rank == 0:
        lamport._why_not = lambda *args: None  # this rank's own check passes
    try:
        on = lamport.setup_lamport_all_reduce(tp_group(), tp_group_name(), rank, world_size, hidden=8, max_tokens=4,
                                             dtype=torch.bfloat16, device=torch.device("cpu"))
    finally:
        lamport._why_not = why_not  # the checks that run after this one in the same process see the real check
    assert not on and lamport.active_workspace() is None
    x = torch.full((2, 8), float(rank + 1))
    assert torch.equal(all_reduce(x), torch.full((2, 8), float(sum(range(1, world_size + 1)))))
