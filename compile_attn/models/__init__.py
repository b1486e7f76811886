"""Small self-contained models that call the attention op (for tests, examples and benchmarks)."""

from compile_attn.models.toy_decoder import ToyDecoder, ToyDecoderConfig

__all__ = ["ToyDecoder", "ToyDecoderConfig"]
