"""GraphMode: which CUDA graphs run for decode batches and for mixed (extend / prefill) batches.

One vocabulary for four uses: the mode a user asks for (``GraphConfig.mode``), what an attention backend allows
(``AttentionBackend.graph_support``), what the graph runner plans per batch kind (``ModePlan``) and what the
step being run uses (the forward context's ``graph_mode``, read by the piecewise wrappers).
"""

from __future__ import annotations

import enum


class GraphMode(enum.Enum):
    """Graph execution modes.

    ========================  ==============  =====================
    mode                      decode          mixed (extend/prefill)
    ========================  ==============  =====================
    NONE                      eager           eager
    PIECEWISE                 piecewise       piecewise
    FULL                      full graph      eager
    FULL_AND_PIECEWISE        full graph      piecewise   (default)
    BREAKABLE                 breakable       breakable
    ========================  ==============  =====================

    Piecewise: the model's pieces between attention ops are captured per token-count bucket and attention runs
    eagerly between them (compiled models: the compile backend's wrappers). Breakable: one capture over the whole
    forward with eager breaks at every split op, no torch.compile needed. Full: one graph with attention inside
    (decode only: no backend captures mixed batches whole).

    ``decode_mode()`` and ``extend_mode()`` split a mode into what runs for each batch kind; those are single-routine
    modes (NONE, PIECEWISE, FULL, BREAKABLE), which is also what a step runs under. As a backend's declaration,
    NONE means attention cannot live in or between graphs, PIECEWISE that it runs eagerly between captured pieces,
    FULL_AND_PIECEWISE that decode attention can also be captured inside a full graph.
    """

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_AND_PIECEWISE = "full_and_piecewise"
    BREAKABLE = "breakable"

    @classmethod
    def parse(cls, value: GraphMode | str) -> GraphMode:
        """A GraphMode from itself or its value ("full_and_piecewise", any case); ValueError naming the choices."""
        if isinstance(value, GraphMode):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(
                f"unknown graph mode {value!r}; choose one of {', '.join(m.value for m in cls)}"
            ) from None

    def decode_mode(self) -> GraphMode:
        """What runs for decode batches: NONE, PIECEWISE, FULL or BREAKABLE."""
        return GraphMode.FULL if self is GraphMode.FULL_AND_PIECEWISE else self

    def extend_mode(self) -> GraphMode:
        """What runs for extend and mixed batches: NONE, PIECEWISE or BREAKABLE."""
        if self is GraphMode.FULL:
            return GraphMode.NONE
        return GraphMode.PIECEWISE if self is GraphMode.FULL_AND_PIECEWISE else self
