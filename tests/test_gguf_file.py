"""engine/models/gguf_file.py reads what gguf's own GGUFReader reads: every metadata value and every tensor's
type, shape and bytes, on the bundled model and on a file holding every value type and the block types we map
(arrays of arrays stay nested, where gguf's reader flattens them)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.benchmarks.gguf_quants import random_blocks
from pagedserve.engine.config import bundled_model_path
from pagedserve.engine.errors import ModelLoadError
from pagedserve.engine.models.gguf_file import GGUFFile
from pagedserve.engine.models.loader import load_config
from pagedserve.engine.quant.gguf_blocks import MAPPED

gguf = pytest.importorskip("gguf")


def assert_same_as_gguf(path: str) -> GGUFFile:
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(expected)
    for key, value in expected.items():
        if key != "test.nested":  # gguf's reader flattens an array of arrays
            assert ours.fields[key] == value, key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(int(d) for d in b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
    return ours


def test_the_bundled_model_reads_as_gguf_reads_it():
    ours = assert_same_as_gguf(bundled_model_path())
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152


def test_every_value_type_and_block_type(tmp_path):
    rng = np.random.default_rng(0)
    path = str(tmp_path / "all.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    for kind, value in [("uint8", 7), ("int8", -7), ("uint16", 65535), ("int16", -300), ("uint32", 2**32 - 1),
                        ("int32", -2**31), ("float32", 0.1), ("uint64", 2**64 - 1), ("int64", -2**63),
                        ("float64", 1e-300), ("bool", True), ("string", "héllo\nwörld")]:
        getattr(w, f"add_{kind}")(f"test.{kind}", value)
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, -1.25])
    w.add_array("test.bools", [True, False])
    w.add_array("test.strings", ["a", "", "ü" * 40])
    w.add_array("test.empty", [])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    w.add_tensor("vector", rng.standard_normal(9).astype(np.float32))
    for kind in ("BF16", *MAPPED):
        raw = random_blocks(kind, 4, 512, rng) if kind != "BF16" else rng.integers(0, 255, (4, 1024), np.uint8)
        w.add_tensor(kind.lower(), raw, raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = assert_same_as_gguf(path)
    assert ours.fields["general.alignment"] == 64 and ours.fields["test.nested"] == [[1, 2], [3]]


def test_a_truncated_file_is_a_load_error(tmp_path):
    data = open(bundled_model_path(), "rb").read(4 << 20)
    for n in (0, 10, 300_000, len(data)):  # empty, inside the header, inside the vocabulary, inside the tensors
        path = tmp_path / f"cut{n}.gguf"
        path.write_bytes(data[:n])
        with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
            load_config(str(path))
