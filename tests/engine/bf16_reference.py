"""The GPU engine tests' model and reference: a small random Llama in bf16 on CUDA, and HF's greedy tokens for a
prompt together with the first position a bf16 implementation may legitimately differ at.

Margin, measured on HF itself: teacher-force HF's greedy tokens through HF in bf16 and in fp32 (same weights); at
each position the bf16 rounding error is max |logits_bf16 - logits_fp32|. A position is decidable when the fp32
top-1/top-2 gap exceeds twice that error; beyond the first undecidable position tokens are not compared."""

from __future__ import annotations

import torch


def small_llama(seed: int = 0) -> torch.nn.Module:
    """A 4-layer Llama (vocab 1024, GQA 4/2) with seeded random weights, bf16 on CUDA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


def greedy_up_to_first_tie(model: torch.nn.Module, prompt: list[int], n_new: int) -> tuple[list[int], int]:
    """HF's greedy tokens for ``prompt`` (bf16 ``model``) and the first undecidable position among them."""
    ids = torch.tensor([prompt], device="cuda")  # explicit mask: token 0 in a prompt is not padding
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    ids = torch.tensor([prompt + ref], device="cuda")
    with torch.no_grad():
        bf16 = model(ids).logits[0, len(prompt) - 1 : -1].float()
        fp32 = model.float()(ids).logits[0, len(prompt) - 1 : -1]
    model.to(torch.bfloat16)
    top2 = fp32.topk(2, dim=-1).values
    decidable = (top2[:, 0] - top2[:, 1]) > 2 * (bf16 - fp32).abs().max(dim=-1).values
    return ref, int((~decidable).nonzero()[0]) if (~decidable).any() else n_new
