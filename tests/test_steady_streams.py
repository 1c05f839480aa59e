"""The head-to-head benchmark's pure parts: a peer server's command line and row name, and the cached GGUF file."""

from __future__ import annotations

import os

import gguf
import pytest

from pagedserve.benchmarks import gguf_quants
from pagedserve.benchmarks.steady_streams import SHAPES, burst, main, peer_command, peer_labels
from pagedserve.engine.config import bundled_model_path

LLAMA = "/opt/llama.cpp/bin/llama-server -m {model} --port {port} -np 16 -t 2 -c 32768"


def test_peer_command_fills_model_and_port_in_each_word():
    assert peer_command(LLAMA, "/m/1b.gguf", 8123) == [
        "/opt/llama.cpp/bin/llama-server", "-m", "/m/1b.gguf", "--port", "8123", "-np", "16", "-t", "2", "-c", "32768"]


def test_peer_command_keeps_a_path_with_spaces_one_word_and_other_braces_as_they_are():
    argv = peer_command("srv --model={model} --host 127.0.0.1:{port} --json '{\"a\": 1}'", "/my models/x.gguf", 9)
    assert argv == ["srv", "--model=/my models/x.gguf", "--host", "127.0.0.1:9", "--json", '{"a": 1}']


def test_peer_labels_name_the_program_and_number_repeats():
    assert peer_labels([LLAMA]) == ["llama-server"]
    assert peer_labels([LLAMA, "vllm serve {model} --port {port}", LLAMA + " --flash-attn"]) == [
        "llama-server #1", "vllm", "llama-server #2"]


@pytest.mark.parametrize("bad", ["", "llama-server -m {model}", "llama-server --port {port}"])
def test_a_peer_command_without_its_model_or_port_is_refused_before_anything_starts(bad, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--sizes", "135m", "--peer-cmd", bad])
    assert e.value.code != 0
    assert "--peer-cmd needs" in capsys.readouterr().err


def test_an_unknown_size_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--sizes", "70b"])
    assert "unknown size '70b'" in capsys.readouterr().err


def test_a_smaller_burst_is_the_start_of_the_larger_one():
    """The 8B's shrunken burst serves the first requests of everyone else's."""
    assert burst(16, 0) == burst(64, 0)[:16]


def test_the_8b_shape_is_llama_3_1_8b_at_the_bundled_vocabulary():
    shape = gguf_quants.SHAPES[SHAPES["8b"]]
    assert shape == dict(vocab=49152, hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8)
    assert shape["vocab"] == gguf_quants.SHAPES[SHAPES["1b"]]["vocab"]


def test_cached_gguf_is_written_once_with_the_tokenizer_of_another_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(gguf_quants.SHAPES, "tiny-smolvocab", dict(gguf_quants.SHAPES["tiny"], vocab=49152))
    tok = bundled_model_path()
    path = gguf_quants.cached_gguf("tiny-smolvocab", "Q4_K_M", tokenizer_from=tok)
    assert path.startswith(str(tmp_path)) and os.listdir(os.path.dirname(path)) == [os.path.basename(path)]
    mtime = os.stat(path).st_mtime_ns
    assert gguf_quants.cached_gguf("tiny-smolvocab", "Q4_K_M", tokenizer_from=tok) == path
    assert os.stat(path).st_mtime_ns == mtime  # reused, not written again
    assert gguf_quants.cached_gguf("tiny-smolvocab", "Q8_0", tokenizer_from=tok) != path
    ours, theirs = gguf.GGUFReader(path).fields, gguf.GGUFReader(tok).fields
    keys = [k for k in theirs if k.startswith("tokenizer.")]
    assert "tokenizer.ggml.tokens" in keys and "tokenizer.ggml.merges" in keys
    for k in keys:
        assert ours[k].types == theirs[k].types and ours[k].contents() == theirs[k].contents(), k
    assert ours["llama.vocab_size"].contents() == len(ours["tokenizer.ggml.tokens"].contents())
