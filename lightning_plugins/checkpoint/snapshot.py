"""A recipe's ``model.path`` as a local directory: itself, or the hub id's snapshot in the Hugging Face cache.

A hub id is resolved once per cache: the first process of a node to take the cache's lock for that id downloads the
files a run reads (or finds them cached), and every other process waits on the lock, then finds them in the cache
and reads them. Every process then loads from the same directory through the same sharded path as a local
checkpoint (:mod:`.load`): no process loads the whole model because its path was a hub id.
"""

from __future__ import annotations

from pathlib import Path

from lightning_plugins.errors import CheckpointError

__all__ = ["WEIGHT_FILES", "local_checkpoint"]

#: What a run reads of a model repository: its configs, tokenizer and safetensors weights. Not the repository's
#: other copies of the weights (``original/`` in Meta's repositories: consolidated ``.pth`` files as large again).
WEIGHT_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"]
_NOT_READ = ["original/*", "*.pth", "*.bin", "*.pt", "*.gguf", "*.onnx", "*.msgpack", "*.h5"]


def local_checkpoint(path: str | Path, *, trust_remote_code: bool = False) -> Path:
    """The local directory of ``path``: ``path`` itself when it is a directory, else the snapshot of the hub id.

    Args:
        path: A local HF checkpoint directory or a hub id (``meta-llama/Llama-3.1-8B``).
        trust_remote_code: Whether the repository's ``*.py`` files are fetched too (the model's own code).

    Raises:
        CheckpointError: naming the id and the fix, when the id is neither cached nor downloadable here (offline,
            a gated repository without a token, no such repository).
    """
    if Path(path).is_dir():
        return Path(path)
    from filelock import FileLock
    from huggingface_hub import constants, snapshot_download

    repo_id = str(path)
    locks = Path(constants.HF_HUB_CACHE) / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    allow = WEIGHT_FILES if trust_remote_code else [pattern for pattern in WEIGHT_FILES if pattern != "*.py"]
    try:
        with FileLock(str(locks / f"lightning_plugins--{repo_id.replace('/', '--')}.lock")):
            return Path(snapshot_download(repo_id, allow_patterns=allow, ignore_patterns=_NOT_READ))
    except Exception as err:  # huggingface_hub's errors (offline, gated, missing) share no base class worth naming
        raise CheckpointError(
            f"model.path={repo_id!r} is no local directory, and its files are neither in the Hugging Face cache"
            f" ({constants.HF_HUB_CACHE}) nor downloadable here ({type(err).__name__}: {err}). Download it where there"
            f" is network (`hf download {repo_id}`, after `hf auth login` for a gated model) into the cache this"
            " machine reads (HF_HOME), or set model.path to a local checkpoint directory."
        ) from None
