"""Speculative decoding in the engine: proposers of draft tokens (``ngram``), the acceptance walk that turns one
verify step's target tokens into each request's accepted tokens (``acceptance``), and the step's plan of which
rows sample at which positions (``verify_rows``). The options are ``engine/requests/speculative_config.py``; the
scheduler runs a request's drafts beside its last token (``Request.draft_ids``); see docs/speculative.md."""
