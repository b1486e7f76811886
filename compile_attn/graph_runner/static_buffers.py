"""StaticBuffers: the graph runner's input tensors, allocated once at the largest sizes, whose
addresses every captured graph reads.

Per-token buffers (input ids, positions, KV slots) hold ``max_num_tokens`` entries and per-request
buffers (request rows, lengths, start offsets) ``max_batch_size``. This module owns the tensors and
the dummy batches used at capture; copying a live batch in is ``replay_view``'s job.
"""

from __future__ import annotations

import torch

from compile_attn.batch import ForwardBatch, ForwardMode
from compile_attn.batch import PAD_REQUEST, PAD_SLOT


class StaticBuffers:
    """Device tensors sized for the largest bucket; views of them are what graphs capture."""

    def __init__(self, max_batch_size: int, max_num_tokens: int, device: torch.device | str) -> None:
        if max_batch_size <= 0 or max_num_tokens <= 0:
            raise ValueError(
                f"max_batch_size and max_num_tokens must be positive, got {max_batch_size}, {max_num_tokens}"
            )
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.device = torch.device(device)

        def tokens(fill: int) -> torch.Tensor:
            return torch.full((max_num_tokens,), fill, dtype=torch.int64, device=self.device)

        def requests(fill: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.full((max_batch_size,), fill, dtype=dtype, device=self.device)

        self.input_ids = tokens(0)
        self.positions = tokens(0)
        self.out_cache_loc = tokens(PAD_SLOT)
        self.req_pool_indices = requests(PAD_REQUEST, torch.int64)
        self.seq_lens = requests(1, torch.int32)
        self.extend_prefix_lens = requests(0, torch.int32)
        self.extend_seq_lens = requests(1, torch.int32)
        self.extend_start_loc = torch.arange(max_batch_size, dtype=torch.int32, device=self.device)
        self._slices: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # views of the buffers, by shape

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (
                self.input_ids,
                self.positions,
                self.out_cache_loc,
                self.req_pool_indices,
                self.seq_lens,
                self.extend_prefix_lens,
                self.extend_seq_lens,
                self.extend_start_loc,
            )
        )

    def view(
        self,
        *,
        forward_mode: ForwardMode,
        batch_size: int,
        num_tokens: int,
        seq_lens_cpu: torch.Tensor,
        extend_prefix_lens_cpu: list[int],
        extend_seq_lens_cpu: list[int],
        real_batch_size: int,
        bucket: int,
        seq_lens_sum: int | None = None,
    ) -> ForwardBatch:
        """A ForwardBatch whose tensors are the first ``batch_size`` / ``num_tokens`` buffer entries.

        ``seq_lens_sum`` defaults to ``seq_lens_cpu.sum()``; callers that know it pass it.
        """
        sliced = self._slices.get((batch_size, num_tokens))
        if sliced is None:  # slicing eight tensors costs host time: once per shape, not per step
            sliced = self._slices[(batch_size, num_tokens)] = (
                self.input_ids[:num_tokens], self.positions[:num_tokens], self.out_cache_loc[:num_tokens],
                self.req_pool_indices[:batch_size], self.seq_lens[:batch_size], self.extend_prefix_lens[:batch_size],
                self.extend_seq_lens[:batch_size], self.extend_start_loc[:batch_size],
            )
        input_ids, positions, out_cache_loc, req_pool_indices, seq_lens, prefix_lens, ext_lens, start_loc = sliced
        if seq_lens_sum is None:
            seq_lens_sum = int(seq_lens_cpu.sum()) if batch_size else 0
        return ForwardBatch(
            forward_mode=forward_mode,
            batch_size=batch_size,
            input_ids=input_ids,
            positions=positions,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens_cpu,
            out_cache_loc=out_cache_loc,
            seq_lens_sum=seq_lens_sum,
            extend_prefix_lens=prefix_lens,
            extend_seq_lens=ext_lens,
            extend_start_loc=start_loc,
            extend_prefix_lens_cpu=extend_prefix_lens_cpu,
            extend_seq_lens_cpu=extend_seq_lens_cpu,
            real_batch_size=real_batch_size,
            graph_bucket=bucket,
        )

    # ------------------------------------------------------------------ dummy batches for capture
    def dummy_decode(self, bucket: int, seq_len_fill: int) -> ForwardBatch:
        """``bucket`` padded requests (row PAD_REQUEST, seq_len ``seq_len_fill``), tokens at PAD_SLOT."""
        prefix = max(seq_len_fill - 1, 0)
        self.input_ids[:bucket].zero_()
        self.positions[:bucket].fill_(prefix)
        self.out_cache_loc[:bucket].fill_(PAD_SLOT)
        self.req_pool_indices[:bucket].fill_(PAD_REQUEST)
        self.seq_lens[:bucket].fill_(seq_len_fill)
        self.extend_prefix_lens[:bucket].fill_(prefix)
        self.extend_seq_lens[:bucket].fill_(1)
        self.extend_start_loc[:bucket].copy_(torch.arange(bucket, dtype=torch.int32))
        return self.view(
            forward_mode=ForwardMode.DECODE,
            batch_size=bucket,
            num_tokens=bucket,
            seq_lens_cpu=torch.full((bucket,), seq_len_fill, dtype=torch.int64),
            extend_prefix_lens_cpu=[prefix] * bucket,
            extend_seq_lens_cpu=[1] * bucket,
            real_batch_size=bucket,
            bucket=bucket,
        )

    def dummy_extend(self, bucket: int) -> ForwardBatch:
        """One request on row PAD_REQUEST adding ``bucket`` tokens from position 0, written to PAD_SLOT."""
        self.input_ids[:bucket].zero_()
        self.positions[:bucket].copy_(torch.arange(bucket))
        self.out_cache_loc[:bucket].fill_(PAD_SLOT)
        self.req_pool_indices[:1].fill_(PAD_REQUEST)
        self.seq_lens[:1].fill_(bucket)
        self.extend_prefix_lens[:1].fill_(0)
        self.extend_seq_lens[:1].fill_(bucket)
        self.extend_start_loc[:1].fill_(0)
        return self.view(
            forward_mode=ForwardMode.EXTEND,
            batch_size=1,
            num_tokens=bucket,
            seq_lens_cpu=torch.tensor([bucket], dtype=torch.int64),
            extend_prefix_lens_cpu=[0],
            extend_seq_lens_cpu=[bucket],
            real_batch_size=1,
            bucket=bucket,
        )
