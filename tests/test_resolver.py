"""From the name a user gives to the model's files: local paths, a Hugging Face cache laid out by hand (offline,
HF_HUB_OFFLINE=1, nothing mocked), and the server started by repo id, driven by the official openai client."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pagedserve.engine.config import make_config
from pagedserve.engine.errors import ModelLoadError
from pagedserve.engine.models.resolver import resolve_model

REPO = Path(__file__).resolve().parent.parent


def hub_repo(hf_home: Path, repo: str, files: dict[str, Path | bytes], commit: str = "0" * 40) -> Path:
    """A repo in the Hugging Face cache's own layout: refs/main -> snapshots/<commit>/<files>."""
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    for name, content in files.items():
        if isinstance(content, Path):
            shutil.copy(content, snap / name)
        else:
            (snap / name).write_bytes(content)
    return snap


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(home / "hub"))
    return home


def test_local_paths(tmp_path, smollm):
    bundled = resolve_model(None)
    assert bundled.path == smollm.path and bundled.name == "SmolLM2-135M-Instruct"
    assert resolve_model(smollm.path).path == smollm.path
    assert resolve_model("random:tiny").path == "random:tiny"
    folder = tmp_path / "ggufs"
    folder.mkdir()
    (folder / "m-Q4_K_M.gguf").write_bytes(b"")
    assert resolve_model(str(folder)).path == str(folder / "m-Q4_K_M.gguf")  # the only one
    (folder / "m-Q8_0.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="several .gguf files.*m-Q4_K_M.gguf, m-Q8_0.gguf"):
        resolve_model(str(folder))
    assert resolve_model(str(folder), gguf_file="m-Q8_0.gguf").path == str(folder / "m-Q8_0.gguf")
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        resolve_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_a_draft_model_is_not_looked_up_by_the_targets_file_name(tmp_path, smollm):
    """--gguf-file picks the target's file among several; the draft model is found by its own name."""
    from pagedserve.engine import LLMEngine, make_config

    target, draft = tmp_path / "target", tmp_path / "draft"
    target.mkdir()
    draft.mkdir()
    for name in ("m-Q4_1.gguf", "m-Q8_0.gguf"):
        (target / name).symlink_to(smollm.path)
    (draft / "small.gguf").symlink_to(smollm.path)
    engine = LLMEngine(make_config(model=str(target), gguf_file="m-Q4_1.gguf", speculative_method="draft",
                                   draft_model=str(draft), dtype="float32", device="cpu", num_blocks=32))
    assert engine.model_path == str(target / "m-Q4_1.gguf")


def test_repo_ids_from_a_laid_out_cache(offline_hub, tiny_hf_dir, smollm):
    snap = hub_repo(offline_hub, "org/tiny", {p.name: p for p in tiny_hf_dir.iterdir()})
    got = resolve_model("org/tiny")
    assert Path(got.path) == snap and got.name == "org/tiny"
    gguf = hub_repo(offline_hub, "org/tiny-GGUF", {"tiny-Q4_1.gguf": Path(smollm.path),
                                                   "tiny-Q8_0.gguf": b"", "tiny-Q4_K_M.gguf": b""})
    assert resolve_model("org/tiny-GGUF:Q4_1").path == str(gguf / "tiny-Q4_1.gguf")
    assert resolve_model("org/tiny-GGUF:q8_0").path == str(gguf / "tiny-Q8_0.gguf")  # tags match in any case
    with pytest.raises(ModelLoadError, match="no file tagged 'Q6_K'"):
        resolve_model("org/tiny-GGUF:Q6_K")
    with pytest.raises(ModelLoadError, match="ORG/NAME:QUANT"):
        resolve_model("org/tiny-GGUF")  # no config.json: a GGUF repo needs its tag
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE"):
        resolve_model("org/absent")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_by_repo_id_offline_through_the_openai_client(tmp_path, tiny_hf_dir):
    import openai

    home = tmp_path / "hf"
    hub_repo(home, "org/tiny-chat", {p.name: p for p in tiny_hf_dir.iterdir()})
    port = _free_port()
    env = dict(os.environ, HF_HOME=str(home), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    server = subprocess.Popen([sys.executable, "-m", "pagedserve.server.cli", "serve", "--model", "org/tiny-chat",
                               "--port", str(port), "--dtype", "float32", "--num-blocks", "64", "--log-level",
                               "warning"],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                assert server.poll() is None, server.stdout.read()
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == ["org/tiny-chat"]
        reply = client.chat.completions.create(model="org/tiny-chat", max_tokens=5, temperature=0,
                                               messages=[{"role": "user", "content": "Hi!"}])
        assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_model_that_cannot_load_ends_serve_before_the_port_is_bound(tmp_path):
    """Exit 1 with one line on stderr, and nothing ever listened on the port."""
    port = _free_port()
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    for model in ("nonexistent/repo", str(tmp_path / "missing.gguf")):
        out = subprocess.run([sys.executable, "-m", "pagedserve.server.cli", "serve", "--model", model, "--port",
                              str(port)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 1
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("pagedserve: error:"), out.stderr
        with socket.socket() as s:  # the port is still free: it was never bound
            s.bind(("127.0.0.1", port))


def test_bad_options_end_the_cli_in_one_line_before_the_model_loads(tmp_path):
    """A port out of range or in use, an engine option that cannot be (the rest: test_engine_options_are_checked),
    a sampling value the engine refuses: exit 1 with one line each, before the model loads (no "loaded" line) and
    before the port is bound."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        cases = [["serve", "--port", "70000"], ["serve", "--port", str(taken.getsockname()[1])],
                 ["serve", "--port", str(port), "--device", "foo"], ["generate", "hi", "--temperature", "-1"],
                 ["serve", "--port", str(port), "--max-model-len", "1000000"]]
        for args in cases:
            out = subprocess.run([sys.executable, "-m", "pagedserve.server.cli", *args], cwd=REPO, env=env,
                                 capture_output=True, text=True, timeout=120)
            lines = [line for line in out.stderr.splitlines() if line.strip()]
            assert out.returncode == 1 and len(lines) == 1 and lines[0].startswith("pagedserve: error:"), \
                (args, out.returncode, out.stderr)
    with socket.socket() as s:  # never bound by any of them
        s.bind(("127.0.0.1", port))


@pytest.fixture
def cli_checks_only(monkeypatch):
    """The CLI module, with the port check and the model's resolution replaced by a failure: a test of the option
    checks can neither bind a port nor load a model, whatever regresses."""
    from pagedserve.server import cli

    def too_far(*args):
        raise AssertionError("got past the option checks")

    monkeypatch.setattr(cli, "_check_listen", too_far)
    monkeypatch.setattr(cli, "_resolve_model", too_far)
    return cli


@pytest.mark.parametrize("argv", [
    [], ["nosuch"], ["serve", "--bogus"], ["serve", "--port", "abc"], ["serve", "--log-level", "foo"], ["generate"],
    ["chat", "--max-tokens", "x"], ["eval", "--quantization", "int3"], ["plan", "--kv-dtype", "fp7"],
    ["bench", "--request-rate", "-1"],
    # values the option's type admits but its bound does not, refused before the model loads or the port is bound
    ["serve", "--max-step-ms", "nan"], ["serve", "--kv-cache-gib", "inf"], ["serve", "--seed", str(2**70)],
    ["serve", "--max-waiting-requests", "0"], ["serve", "--max-queue-wait-s", "-1"], ["serve", "--replicas", "0"],
    ["serve", "--max-connections", "0"], ["serve", "--header-timeout-s", "nan"], ["serve", "--served-model-name", ""],
    ["serve", "--host", ""], ["serve", "--api-key", ","], ["serve", "--kernel-policy", "dense_gemv_max_rows=x"],
    ["serve", "--quant-group-size", "7"], ["serve", "--device", "cpu", "--attention-backend", "triton"],
    ["generate", "hi", "--max-num-seqs", "0"], ["plan", "--memory", "8XB"], ["plan", "--headroom-gib", "nan"],
    ["plan", "--model", "/nonexistent"], ["eval", "--tokens", "1"], ["eval", "--quantization", "none", "--dtype", "x"],
    ["eval", "--quantization", "none", "--text", "/nonexistent"]])
def test_a_bad_flag_ends_every_command_in_one_line(argv, capsys, cli_checks_only, monkeypatch):
    """argparse's own refusals too: exit 1 and one line, not the usage and exit 2, nor a traceback."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # conftest's: Triton on a CPU only in tests
    with pytest.raises(SystemExit) as e:
        cli_checks_only.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(lines) == 1 and lines[0].startswith("pagedserve"), (argv, lines)
    assert ": error: " in lines[0]


def test_an_empty_api_key_from_the_environment_is_refused_too(capsys, cli_checks_only, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_API_KEY", ",")  # read where --api-key is not given
    with pytest.raises(SystemExit) as e:
        cli_checks_only.main(["serve"])
    assert e.value.code == 1 and capsys.readouterr().err == "pagedserve: error: api_key must not be empty\n"


@pytest.mark.parametrize("option", [dict(dtype="foo"), dict(draft_dtype="fp8"), dict(device="foo"),
                                    dict(device="cuda:x"), dict(max_model_len=0), dict(max_model_len=-5)])
def test_engine_options_are_checked(option):
    with pytest.raises(ValueError, match=next(iter(option))):
        make_config(**option)


@pytest.mark.parametrize("option", [dict(num_blocks=10**12), dict(memory_gib=1e5)])
def test_a_kv_cache_larger_than_the_machine_is_refused(option):
    """One line naming the size and the options, instead of the allocator's traceback (or the OOM killer)."""
    from pagedserve.engine import LLMEngine

    with pytest.raises(ValueError, match=r"GiB, more than this machine's .* --kv-cache-gib or --num-blocks"):
        LLMEngine(make_config(model="random:tiny", device="cpu", dtype="float32", **option))
