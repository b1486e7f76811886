"""Model ids through huggingface_hub, offline: a tiny trained Llama laid out in a temporary Hugging Face cache
(``models--org--tiny/snapshots/<commit>/`` with ``refs/main`` and ``refs/dev``, the cache's documented layout, which
``huggingface_hub.snapshot_download(local_files_only=True)`` reads) with ``HF_HUB_OFFLINE=1``. ``LLM("org/tiny")``,
``load_model``, ``generate --model`` and ``serve`` load it; ``revision`` and ``tokenizer`` pick what they name; the
same mistake gets the same message on every command. And the quickstart's model ships a chat template, so
``LLM.chat`` and ``/v1/chat/completions`` work on it out of the box."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("transformers")
hub = pytest.importorskip("huggingface_hub")

from compile_attn import LLM, ModelNotFoundError, SamplingParams  # noqa: E402
from compile_attn.hub import resolve_model, resolve_tokenizer  # noqa: E402
from compile_attn.models.tiny_llama import CHAT_TEMPLATE, tiny_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAIN, DEV = "a" * 40, "b" * 40  # the commits of refs/main and refs/dev
ENGINE = dict(device="cpu", graph_mode="none", compile=False, max_batch_size=4, max_num_tokens=128,
              kv_cache_tokens=1024, page_size=4)
DEV_CONTEXT = 256  # refs/dev's config says so (main's: 512), to tell which revision loaded


@pytest.fixture(scope="module")
def model_dir(trained_tiny_llama: Callable[[int], Path]) -> Path:
    return trained_tiny_llama(20)


@pytest.fixture(scope="module")
def cache(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face cache holding org/tiny at two revisions."""
    root = tmp_path_factory.mktemp("hf-cache")
    repo = root / "models--org--tiny"
    for ref, commit in (("main", MAIN), ("dev", DEV)):
        snapshot = repo / "snapshots" / commit
        shutil.copytree(model_dir, snapshot)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    config = json.loads((repo / "snapshots" / DEV / "config.json").read_text())
    (repo / "snapshots" / DEV / "config.json").write_text(json.dumps({**config,
                                                                       "max_position_embeddings": DEV_CONTEXT}))
    return root


@pytest.fixture
def offline(cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process reads ``cache`` as the Hugging Face cache and never downloads."""
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def cli_env(cache: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_resolve_a_directory_a_cached_id_and_a_revision(offline: Path, model_dir: Path) -> None:
    assert resolve_model(model_dir) == str(model_dir)
    assert resolve_model("org/tiny") == str(offline / "models--org--tiny" / "snapshots" / MAIN)
    assert resolve_model("org/tiny", revision="dev") == str(offline / "models--org--tiny" / "snapshots" / DEV)
    assert resolve_model("org/tiny", revision=DEV).endswith(DEV)  # a commit
    assert resolve_tokenizer("org/tiny").endswith(MAIN)


@pytest.mark.parametrize(
    ("name", "revision", "message"),
    [
        ("org/missing", None, "model 'org/missing' is not a local directory ({cwd}/org/missing does not exist), and "
                              "the Hugging Face model org/missing is not in the local cache ({cache}) and "
                              "HF_HUB_OFFLINE is set, so it is not downloaded; download it first (`hf download "
                              "org/missing`, with network access), or pass a local directory"),
        ("org/tiny", "nope", "the Hugging Face model org/tiny at revision 'nope' is not in the local cache"),
        ("./no/such/dir", None, "model './no/such/dir' is not a local directory ({cwd}/no/such/dir does not exist), "
                                "nor a Hugging Face model id (org/name)"),
        ("{tmp}", None, "is a local directory without a config.json, so not an HF model directory"),
    ],
)
def test_a_wrong_name_says_what_was_tried_and_the_way_out(offline: Path, tmp_path: Path, name: str,
                                                          revision: str | None, message: str) -> None:
    name = name.format(tmp=tmp_path)
    with pytest.raises(ModelNotFoundError) as exc:
        LLM(name, revision=revision, **ENGINE)
    assert message.format(cwd=Path.cwd(), cache=offline) in str(exc.value)
    assert isinstance(exc.value, FileNotFoundError)


def test_llm_loads_a_cached_model_id_offline_at_its_revision(offline: Path) -> None:
    llm = LLM("org/tiny", **ENGINE)
    out = llm.generate(["The function returns"], SamplingParams(max_tokens=6))[0]
    assert len(out.token_ids) == 6 and out.text
    assert llm.kv_cache.max_context == 512
    assert LLM("org/tiny", revision="dev", **ENGINE).kv_cache.max_context == DEV_CONTEXT


def test_tokenizer_from_a_model_id(offline: Path, model_dir: Path, tmp_path: Path) -> None:
    """A checkpoint directory without tokenizer files takes its tokenizer from ``tokenizer=`` (an id or a path)."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in model_dir.iterdir():
        if f.name in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, bare / f.name)
    assert LLM(str(bare), **ENGINE).tokenizer is None
    for tokenizer in ("org/tiny", str(model_dir)):
        llm = LLM(str(bare), tokenizer=tokenizer, **ENGINE)
        assert llm.tokenizer is not None and llm.generate("The", SamplingParams(max_tokens=2))[0].text is not None
    with pytest.raises(ModelNotFoundError, match="tokenizer 'org/none' is not a local directory"):
        LLM(str(bare), tokenizer="org/none", **ENGINE)


def test_load_model_takes_a_model_id(offline: Path) -> None:
    from compile_attn import load_model

    adapter = load_model("org/tiny", revision="dev")
    assert adapter.config.max_position_embeddings == DEV_CONTEXT and adapter.tokenizer is not None


def test_the_same_mistake_gets_one_message_on_every_command(offline: Path) -> None:
    with pytest.raises(ModelNotFoundError) as exc:
        LLM("org/missing", **ENGINE)
    expected = f"ModelNotFoundError: {exc.value}"
    for argv in (["generate", "--model", "org/missing"], ["serve", "org/missing"],
                 ["throughput", "fixed", "--model", "org/missing"], ["bench-serve", "--model", "org/missing"]):
        out = subprocess.run([sys.executable, "-m", "compile_attn", *argv, "--device", "cpu"], capture_output=True,
                             text=True, env=cli_env(offline), cwd=Path.cwd(), timeout=300)
        assert out.returncode == 1, out.stderr
        assert out.stderr.strip() == f"compile-attn {argv[0]}: error: {expected}", out.stderr


def test_generate_runs_a_cached_model_id(cache: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "compile_attn", "generate", "--model", "org/tiny", "--revision", "dev",
                          "--device", "cpu", "--enforce-eager", "--max-new-tokens", "4", "--prompt", "The function"],
                         capture_output=True, text=True, env=cli_env(cache), cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "(4 tokens, length)" in out.stdout


# ------------------------------------------------------------------ the quickstart's chat template
def test_the_quickstart_model_chats_out_of_the_box(model_dir: Path) -> None:
    llm = LLM(str(model_dir), **ENGINE)
    assert llm.tokenizer.chat_template == CHAT_TEMPLATE
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]
    out = llm.chat(conversation, SamplingParams(max_tokens=5))[0]
    assert out.prompt == "<|bos|>Be brief. What is a list?"
    assert len(out.outputs[0].token_ids) == 5


def test_a_model_trained_before_the_template_gets_it_on_reuse(model_dir: Path, tmp_path: Path) -> None:
    old = tmp_path / "old"
    shutil.copytree(model_dir, old)
    (old / "chat_template.jinja").unlink()
    config = json.loads((old / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (old / "tokenizer_config.json").write_text(json.dumps(config))
    weights = (old / "model.safetensors").read_bytes()
    assert tiny_llama(old, steps=20) == old  # reused, not retrained
    assert (old / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert (old / "model.safetensors").read_bytes() == weights


def test_the_servers_error_names_its_own_flag(model_dir: Path) -> None:
    """A tokenizer without a template: the server says --chat-template (LLM.chat's keyword is no help there)."""
    pytest.importorskip("fastapi")
    from compile_attn.hf.loading import load_tokenizer
    from compile_attn.server import protocol

    tokenizer = load_tokenizer(model_dir)
    tokenizer.chat_template = None
    with pytest.raises(protocol.APIError) as exc:
        protocol._chat_ids({"messages": [{"role": "user", "content": "hi"}]}, tokenizer)
    assert "start the server with --chat-template FILE" in str(exc.value) and "LLM.chat" not in str(exc.value)


@pytest.fixture(scope="module")
def served_id(cache: Path) -> Iterator[str]:
    """``compile-attn serve org/tiny`` (offline, from the cache, no --chat-template) as a subprocess: its URL."""
    pytest.importorskip("uvicorn")
    from compile_attn.server.frontend import free_port, healthy

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "compile_attn", "serve", "org/tiny", "--device", "cpu",
                             "--enforce-eager", "--port", str(port), "--max-model-len", "256", "--max-num-seqs", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(cache), cwd=ROOT)
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 180
        while not any(line.startswith("compile-attn serve:") for line in output):
            assert proc.poll() is None, "".join(output)
            assert time.monotonic() < end, "the server did not start: " + "".join(output)
            time.sleep(0.2)
        assert healthy(url)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_serve_a_model_id_and_chat_without_a_template_flag(served_id: str) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served_id + "/v1", api_key="none", timeout=60, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["org/tiny"]
    chat = client.chat.completions.create(model="org/tiny", messages=[{"role": "user", "content": "What is a list?"}],
                                          max_tokens=5, temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 5
