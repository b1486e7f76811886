"""GraphMode: which CUDA graphs run for decode and for prefill/mixed batches."""

from __future__ import annotations

import enum


class GraphMode(enum.Enum):
    """Graph execution modes of the GraphRunner.

    ========================  ==============  =====================
    mode                      decode          prefill / mixed
    ========================  ==============  =====================
    NONE                      eager           eager
    PIECEWISE                 piecewise       piecewise
    FULL                      full graph      eager
    FULL_AND_PIECEWISE        full graph      piecewise   (default)
    BREAKABLE                 breakable       breakable
    ========================  ==============  =====================

    Piecewise means the model's pieces between attention ops are captured per token-count bucket
    and attention runs eagerly between them (compiled models: the compile backend's wrappers;
    eager models: the breakable capture). Breakable is one capture over the whole forward with
    eager breaks at every split op, no torch.compile needed.
    """

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_AND_PIECEWISE = "full_and_piecewise"
    BREAKABLE = "breakable"

    @classmethod
    def parse(cls, value: GraphMode | str) -> GraphMode:
        if isinstance(value, GraphMode):
            return value
        try:
            return cls(value.lower())
        except ValueError:
            raise ValueError(
                f"unknown graph mode {value!r}; choose one of {', '.join(m.value for m in cls)}"
            ) from None

    def decode_uses_full_graph(self) -> bool:
        return self in (GraphMode.FULL, GraphMode.FULL_AND_PIECEWISE)

    def extend_uses_piecewise(self) -> bool:
        return self in (GraphMode.PIECEWISE, GraphMode.FULL_AND_PIECEWISE)
