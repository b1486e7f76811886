"""Speculative decoding in the engine: proposers of draft tokens (``ngram``, ``draft_model``), the acceptance walk that
turns one verify step's target tokens into each request's accepted tokens (``acceptance``), the speculator that
proposes, plans which rows sample at which positions and counts (``speculator``), a step scheduled with drafts
(``step_plan``) and what the engine builds for a speculative config (``setup``). The options are
``engine/requests/speculative_config.py``; the scheduler runs a request's drafts beside its last token
(``Request.draft_ids``); see docs/speculative.md."""
