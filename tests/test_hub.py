"""Hub names: a repo id resolves through huggingface_hub against the local HF cache (offline),
and a repo that is neither cached nor downloadable is a ConfigError naming it."""

import hashlib
import shutil

import pytest

from mtpkit import LLM, SamplingParams
from mtpkit.errors import ConfigError
from mtpkit.checkpoint.hub import ASSETS, resolve_model

TINY = ASSETS / "tiny-qwen3-next"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_repo(cache, repo_id: str, files: dict) -> None:
    """Lay out `files` (name -> source path) as huggingface_hub's cache does after a download:
    models--{org}--{name}/blobs/<sha256> holds the bytes, snapshots/<commit>/<name> links to
    the blob, refs/main holds the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for name, src in files.items():
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        shutil.copyfile(src, blob)
        (snap / name).symlink_to(f"../../blobs/{blob.name}")


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty HF cache under tmp_path, offline. huggingface_hub reads its environment
    variables once, at import, so its constants are set too."""
    from huggingface_hub import constants
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_repo_id_resolves_from_offline_cache(offline_cache):
    from huggingface_hub import scan_cache_dir
    files = {p.name: p for p in TINY.iterdir() if p.name != "README.md"}
    _cache_repo(offline_cache, "mtpkit-test/tiny-qwen3-next", files)
    # huggingface_hub itself recognises the layout as a cached repo at that revision
    info = scan_cache_dir(offline_cache)
    assert not info.warnings
    [repo] = info.repos
    assert repo.repo_id == "mtpkit-test/tiny-qwen3-next"
    assert {r.commit_hash for r in repo.revisions} == {COMMIT}

    path = resolve_model("mtpkit-test/tiny-qwen3-next")
    assert path == offline_cache / "models--mtpkit-test--tiny-qwen3-next" / "snapshots" / COMMIT
    llm = LLM("mtpkit-test/tiny-qwen3-next", num_spec=2, max_model_len=64)
    ref = LLM("tiny-qwen3-next", num_spec=2, max_model_len=64)
    params = SamplingParams(max_tokens=8)
    assert llm.generate("def f(x):", params)[0].token_ids == ref.generate("def f(x):", params)[0].token_ids


def test_offline_not_cached_names_the_repo(offline_cache):
    with pytest.raises(ConfigError, match=r"'someorg/not-cached-model' is not in the Hugging Face cache.*"
                                          r"HF_HUB_OFFLINE=1"):
        LLM("someorg/not-cached-model")


def test_missing_path_is_not_a_repo(tmp_path):
    # a path that does not exist is reported as such, never sent to the hub
    with pytest.raises(ConfigError, match="neither a checkpoint directory"):
        resolve_model(str(tmp_path / "no" / "such" / "dir"))
