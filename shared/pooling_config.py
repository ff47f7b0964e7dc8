"""How a model folder turns hidden states into one embedding: pooling, normalization, sizes.

Read once from the folder, as sentence-transformers declares it: `modules.json` lists the
pipeline (Transformer, then Pooling, maybe Normalize), `1_Pooling/config.json` (the Pooling
module's folder, wherever modules.json puts it) says which pooling. Without those files we do
what vLLM does: a decoder's last token, a BERT encoder's first (CLS) token, both L2-normalized.

Matryoshka sizes (a request's `dimensions`) come from config.json's `matryoshka_dimensions` /
`is_matryoshka` (vLLM's fields), or the same keys in `config_sentence_transformers.json`. An
embedding cut to `dimensions` is re-normalized when the model normalizes.

The engine (its runners) and the gateway (its `dimensions` check) both read this; it imports
nothing of ours but `shared/`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from shared.errors import ModelLoadError
from shared.model_config import ENCODER_MODEL_TYPES


class PoolingType(str, Enum):
    CLS = "cls"  # the first token's final hidden state
    MEAN = "mean"  # the mean over every token of the input
    LAST = "last"  # the last token's (a decoder's natural summary)


# 1_Pooling/config.json's flags -> our pooling; the other modes are refused by name.
_ST_MODES = {
    "pooling_mode_cls_token": PoolingType.CLS,
    "pooling_mode_mean_tokens": PoolingType.MEAN,
    "pooling_mode_lasttoken": PoolingType.LAST,
}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens")
_ST_PIPELINE = ("sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
                "sentence_transformers.models.Normalize")


@dataclass(frozen=True)
class PoolingConfig:
    pooling_type: PoolingType
    normalize: bool  # L2-normalize the pooled vector
    hidden_size: int  # the embedding's full size
    # Sizes a request may cut the embedding to (Matryoshka); None: none declared.
    matryoshka_dimensions: tuple[int, ...] | None = None
    is_matryoshka: bool = False  # any size up to hidden_size (no list declared)
    source: str = "default"  # "sentence-transformers" or "default"

    def check_dimensions(self, dimensions: int | None) -> str | None:
        """Why a request's `dimensions` cannot be served (None: it can)."""
        if dimensions is None:
            return None
        if not (self.is_matryoshka or self.matryoshka_dimensions):
            return "this model does not support `dimensions` (it declares no Matryoshka sizes)"
        if not 1 <= dimensions <= self.hidden_size:
            return f"`dimensions` must be between 1 and {self.hidden_size}, got {dimensions}"
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            return (f"`dimensions` {dimensions} is not one this model declares "
                    f"({', '.join(map(str, self.matryoshka_dimensions))})")
        return None


def read_pooling_config(folder: str | Path) -> PoolingConfig:
    """The pooling of the model folder `folder` (ModelLoadError on what we cannot run exactly)."""
    folder = Path(folder)
    config = _read_json(folder / "config.json") or {}
    model_type = config.get("model_type")
    hidden_size = int(config.get("hidden_size") or 0)
    st_config = _read_json(folder / "config_sentence_transformers.json") or {}
    dims = config.get("matryoshka_dimensions") or st_config.get("matryoshka_dimensions")
    is_matryoshka = bool(config.get("is_matryoshka") or st_config.get("is_matryoshka"))
    matryoshka = tuple(sorted(int(d) for d in dims)) if dims else None
    modules = _read_json(folder / "modules.json")
    if modules is None:
        default = PoolingType.CLS if model_type in ENCODER_MODEL_TYPES else PoolingType.LAST
        return PoolingConfig(default, True, hidden_size, matryoshka, is_matryoshka)
    types = [module.get("type", "") for module in modules]
    unknown = [t for t in types if t not in _ST_PIPELINE]
    if unknown:
        raise ModelLoadError(f"{folder}/modules.json has modules we do not run: {unknown} "
                             "(supported: Transformer, Pooling, Normalize)")
    pooling = next((m for m in modules if m.get("type") == _ST_PIPELINE[1]), None)
    if pooling is None:
        raise ModelLoadError(f"{folder}/modules.json has no Pooling module")
    pooling_path = folder / pooling.get("path", "1_Pooling") / "config.json"
    settings = _read_json(pooling_path)
    if settings is None:
        raise ModelLoadError(f"{pooling_path} is missing")
    asked = [name for name in _ST_UNSUPPORTED if settings.get(name)]
    if asked:
        raise ModelLoadError(f"{pooling_path}: {', '.join(asked)} is not supported "
                             "(supported: cls, mean, last token)")
    chosen = [kind for name, kind in _ST_MODES.items() if settings.get(name)]
    if len(chosen) != 1:
        raise ModelLoadError(f"{pooling_path} must choose exactly one pooling mode, got "
                             f"{[kind.value for kind in chosen]}")
    if settings.get("include_prompt") is False:
        raise ModelLoadError(f"{pooling_path}: include_prompt false (instructor-style) is not supported")
    size = int(settings.get("word_embedding_dimension") or hidden_size)
    return PoolingConfig(chosen[0], _ST_PIPELINE[2] in types, size, matryoshka, is_matryoshka,
                         source="sentence-transformers")


def _read_json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
