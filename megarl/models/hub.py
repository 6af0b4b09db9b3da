"""A Hugging Face Hub model id where a local folder is expected (``model.init_from_hf``,
``data.tokenizer_path``): downloaded once with ``huggingface_hub`` into its cache.

megarl reads models from local folders. Where a hub is reachable, ``Qwen/Qwen2.5-0.5B-Instruct``
is accepted too: the files a run needs (config, generation config, safetensors weights,
tokenizer files, chat template) are fetched by ``huggingface_hub.snapshot_download`` (its cache,
its lock files, ``HF_TOKEN`` and ``HF_HUB_OFFLINE`` as usual) and the local snapshot folder is
used from then on. A path that exists always wins; nothing is downloaded for it.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger(__name__)

# owner/name, as the hub spells repository ids (no leading '.', '/' or '~': those are paths).
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model", "*.tiktoken"]
"""What is downloaded: everything megarl reads from a model folder, never .bin/.pt/.gguf files."""


def is_hub_id(value: str) -> bool:
    return bool(HUB_ID.match(value)) and not Path(value).expanduser().exists()


def resolve(value: str | None, key: str) -> str | None:
    """``value`` itself if it is a local path (or None); a hub id's downloaded snapshot folder
    otherwise. ValueError naming ``key`` if the download fails (no network, no such repo)."""
    if value is None or not is_hub_id(value):
        return value
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(value, allow_patterns=FILES)
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, gated repo: all end the same way
        raise ValueError(f"{key}={value!r} is not a local folder, and fetching it from the Hugging Face Hub failed "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); download it where the hub "
                         f"is reachable (`huggingface-cli download {value} --local-dir DIR`) and set {key}=DIR") from None
    log.info("%s=%s: using the hub snapshot in %s", key, value, local)
    return local
