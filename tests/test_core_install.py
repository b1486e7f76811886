"""The core install (torch, numpy, tqdm: ``pip install compile-attn``) imports and runs, and ``import compile_attn``
stays light: Dynamo / Inductor, transformers, tokenizers and the server's packages load on first use.

Each check runs in a fresh interpreter (``sys.modules`` of this one already holds everything). The core install is
simulated by a finder, installed before anything else, that refuses to import the optional packages: what the
extras bring ([hf], [serve], [triton], [flashinfer], [fa3], [test]) is absent as far as compile_attn can tell.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.hidden_packages import ROOT
from tests.hidden_packages import run_python as run_hidden

# What only the extras install (torch itself requires sympy, jinja2, networkx, ...: those stay importable).
EXTRAS_PACKAGES = ("transformers", "tokenizers", "huggingface_hub", "safetensors", "accelerate", "fastapi", "uvicorn",
                   "starlette", "pydantic", "zmq", "uvloop", "httptools", "prometheus_client", "httpx", "openai",
                   "triton", "flashinfer", "sgl_kernel", "depyf", "scipy", "hypothesis", "pytest")
# Never imported by ``import compile_attn`` (nor by the CLI's --help), installed or not.
HEAVY = ("torch._dynamo", "torch._inductor", "transformers", "tokenizers", "huggingface_hub", "fastapi", "uvicorn",
         "zmq", "httpx", "triton", "sympy")

def run_python(code: str, *, blocked: tuple[str, ...] = (), timeout: float = 300) -> str:
    """Run ``code`` in a fresh interpreter (this checkout first on the path, ``blocked`` packages refused); its
    stdout, or the test fails with its stderr."""
    out = run_hidden(code, hidden=blocked, env={"TRITON_INTERPRET": "0"}, timeout=timeout)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stderr[-4000:]}"
    return out.stdout


def loaded_after(code: str, **kw) -> set[str]:
    """The HEAVY modules in ``sys.modules`` after ``code`` ran in a fresh interpreter."""
    out = run_python(code + f"\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))",
                     **kw)
    return set(json.loads(out.strip().splitlines()[-1]))


def test_import_compile_attn_imports_no_heavy_module() -> None:
    """``import compile_attn`` loads torch and the custom ops; the compiler, the engine, the HF integration and the
    server load when first used, whether or not their packages are installed."""
    assert loaded_after("import compile_attn") == set()


def test_the_command_line_help_imports_no_heavy_module() -> None:
    code = ("import contextlib, io\nfrom compile_attn.cli import build_parser\nparser = build_parser()\n"
            "for cmd in ([], ['generate'], ['serve'], ['throughput'], ['bench-serve']):\n"
            "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "        parser.parse_args([*cmd, '--help'])\n")
    assert loaded_after(code) == set()


def test_sampling_params_and_engine_config_do_not_import_the_compiler() -> None:
    assert loaded_after("from compile_attn import SamplingParams, EngineConfig\nEngineConfig(device='cpu')") == set()


def test_public_names_resolve_lazily() -> None:
    """The lazily exported names are the objects of their modules, listed by dir(); a wrong name still raises
    AttributeError."""
    import compile_attn
    from compile_attn.compiler import compile_attn_backend
    from compile_attn.engine.llm import LLM

    assert compile_attn.LLM is LLM and compile_attn.compile_attn_backend is compile_attn_backend
    assert set(compile_attn.__all__) <= set(dir(compile_attn))
    with pytest.raises(AttributeError, match="no_such_name"):
        compile_attn.no_such_name  # noqa: B018


def test_hf_registration_follows_a_later_import_of_transformers() -> None:
    """``attn_implementation="compile_attn"`` is registered when transformers is imported after compile_attn (and
    when before): ``import compile_attn`` no longer imports transformers to register it."""
    pytest.importorskip("transformers")
    check = ("from compile_attn.hf import is_registered\nassert is_registered()\n"
             "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS\n"
             "assert 'compile_attn' in ALL_ATTENTION_FUNCTIONS\nprint('registered')")
    assert "registered" in run_python("import compile_attn, sys\nassert 'compile_attn.hf' not in sys.modules\n"
                                      "import transformers\nassert 'compile_attn.hf' in sys.modules\n" + check)
    assert "registered" in run_python("import transformers\nimport compile_attn\n" + check)
    assert "registered" in run_python("import compile_attn\nfrom transformers import AutoConfig\n" + check)


CORE_RUN = """
import sys, torch
import compile_attn
from compile_attn import KVCache, ForwardBatch, create_backend, forward_context
from compile_attn.models import ToyDecoder, ToyDecoderConfig

cfg = ToyDecoderConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64)
torch.manual_seed(0)
model = ToyDecoder(cfg).eval()

def step(m):
    kv = KVCache(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_batch_size=4,
                 max_context=64, kv_cache_tokens=256, page_size=1, dtype=torch.float32, device="cpu")
    backend = create_backend("torch_native", kv, m.attention_layers())
    rows = [kv.alloc_request() for _ in range(2)]
    fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=[0, 0], extend_lens=[5, 3],
                            out_cache_loc=kv.alloc_extend(rows, [5, 3]), input_ids=torch.arange(8) % 64,
                            device="cpu")
    backend.init_forward_metadata(fb)
    with forward_context(fb, backend), torch.no_grad():
        return m(fb.input_ids, fb.positions)

eager = step(model)
compiled = torch.compile(model, backend="compile_attn", dynamic=True, options={{"compiler": "{compiler}",
                                                                               "cache_dir": None}})
torch.testing.assert_close(step(compiled), eager, rtol=1e-5, atol=1e-5)

from compile_attn import LLM, SamplingParams   # the engine on token ids: no tokenizer needed
llm = LLM(model, device="cpu", compile=False, graph_mode="none", max_batch_size=2, max_num_tokens=32,
          kv_cache_tokens=128, max_context=32)
out = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
assert len(out[0].token_ids) == 4
blocked = [m for m in {blocked!r} if m in sys.modules]
assert not blocked, blocked
print("core ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_core_install_compiles_and_generates_without_the_extras(compiler: str) -> None:
    """With every extra's package refused: ``import compile_attn``, the low-level API (KVCache, a backend, a
    ForwardBatch, a forward context), ``torch.compile(model, backend="compile_attn")`` (Dynamo, the split, Inductor's
    CPU code) and ``LLM`` on token ids run on the CPU."""
    out = run_python(CORE_RUN.format(compiler=compiler, blocked=EXTRAS_PACKAGES), blocked=EXTRAS_PACKAGES,
                     timeout=600)
    assert "core ok" in out


def test_the_hf_names_say_which_extra_to_install() -> None:
    code = ("import compile_attn\ntry:\n    compile_attn.load_model\nexcept ImportError as exc:\n    print(exc)\n")
    assert "pip install 'compile-attn[hf]'" in run_python(code, blocked=("transformers", "tokenizers"))


def test_each_extra_lists_what_its_commands_import() -> None:
    """pyproject's extras: [serve] runs ``compile-attn serve`` (the server's packages), bench-serve's httpx is in the
    extra that installs bench-serve's other needs, [hf] has what loading a checkpoint imports."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def names(extra: str) -> set[str]:
        out = set()
        for req in extras[extra]:
            if req.startswith("compile-attn["):
                for inner in req[len("compile-attn["):-1].split(","):
                    out |= names(inner)
            else:
                out.add(re.split(r"[;<>=\[ ]", req)[0].lower().replace("_", "-"))
        return out

    assert {"transformers", "tokenizers", "safetensors", "huggingface-hub", "jinja2"} <= names("hf")
    assert {"fastapi", "uvicorn", "pyzmq", "prometheus-client", "httpx", "transformers"} <= names("serve")
    assert names("hf") | names("serve") | {"triton"} <= names("test") | {"compile-attn"}
