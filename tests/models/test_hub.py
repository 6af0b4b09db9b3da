"""Hub ids where a model folder is expected (megarl/models/hub.py). No hub is reachable from our
machines: the download itself is replaced by a local folder, and the offline failure is checked."""
import pytest

from megarl.models import hub


def test_local_paths_are_never_downloaded(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("downloaded"))
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub.resolve("org/name", "model.init_from_hf") == "org/name"  # an existing relative folder
    assert hub.resolve("./x/y", "k") == "./x/y" and hub.resolve("/abs/path", "k") == "/abs/path"
    assert hub.resolve("~/models/x", "k") == "~/models/x" and hub.resolve(None, "k") is None


def test_a_hub_id_becomes_its_snapshot_folder(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def fake(repo_id, allow_patterns=None):
        calls.append((repo_id, allow_patterns))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert hub.resolve("Qwen/Qwen2.5-0.5B-Instruct", "model.init_from_hf") == str(tmp_path)
    assert calls == [("Qwen/Qwen2.5-0.5B-Instruct", hub.FILES)]
    assert not any(p.endswith((".bin", ".gguf", ".pt")) for p in hub.FILES)


def test_unreachable_hub_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"model.init_from_hf='nobody/no-such-model' is not a local folder, and "
                                         r"fetching it from the Hugging Face Hub failed .*huggingface-cli download"):
        hub.resolve("nobody/no-such-model", "model.init_from_hf")
