"""speculative_config in vLLM's names: parsing, vLLM's defaults, and refusals that name the bad key or value before
a model loads."""

from __future__ import annotations

import pytest

from compile_attn.engine import LLM
from compile_attn.engine.requests.errors import EngineOptionError
from compile_attn.engine.requests.speculative_config import SpeculativeConfig


def test_parse_dict_json_and_vllm_defaults() -> None:
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.topk, c.max_draft_tokens) == (5, 5, 1, 4)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "topk": 2}).max_draft_tokens == 6
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "topk": 2,
                                    "num_draft_tokens": 4}).max_draft_tokens == 4
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (2, 3, 3)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    assert SpeculativeConfig.parse(c) is c and SpeculativeConfig.parse(None) is None
    assert c.to_dict()["method"] == "ngram"


@pytest.mark.parametrize(("value", "match"), [
    ({"method": "ngram"}, "needs 'method' and 'num_speculative_tokens'"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method 'medusa' is not one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive int"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, r"unknown key\(s\) \['lookahead'\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 is larger"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_draft_tokens": 3}, "num_draft_tokens=3 caps a tree"),
    ({"method": "ngram", "num_speculative_tokens": 20, "topk": 4}, "cap it with num_draft_tokens"),
    ("{not json", "not valid JSON"),
    (["ngram"], "must be a dict"),
])
def test_bad_configs_are_refused_by_name(value, match: str) -> None:  # noqa: ANN001
    with pytest.raises(EngineOptionError, match=match):
        SpeculativeConfig.parse(value)


def test_llm_refuses_a_bad_config_before_loading_anything() -> None:
    with pytest.raises(EngineOptionError, match="num_speculative_tokens"):
        LLM("/nonexistent/model/dir", speculative_config={"method": "ngram", "num_speculative_tokens": -1})


def test_the_command_line_flag_is_checked_and_reaches_the_engine_config() -> None:
    import argparse

    from compile_attn.cli_options import add_engine_options, check_engine_options, engine_config

    p = argparse.ArgumentParser()
    add_engine_options(p, device_help="", max_batch_size=4, max_num_tokens=64)
    args = p.parse_args(["--device", "cpu", "--speculative-config",
                         '{"method": "ngram", "num_speculative_tokens": 3}'])
    check_engine_options(args)
    assert engine_config(args).speculative_config == SpeculativeConfig("ngram", 3)
    bad = p.parse_args(["--speculative-config", '{"method": "ngram"}'])
    with pytest.raises(ValueError, match="--speculative-config: speculative_config needs 'method'"):
        check_engine_options(bad)
