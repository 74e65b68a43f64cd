"""Local copies of remote files through `cached-path`, with a cache folder the caller chooses
(the checkpointer passes a folder under `work_dir`). cached-path keys its cache by URL and the
server's ETag, so a changed file is downloaded again and an unchanged one is reused."""

from __future__ import annotations

from pathlib import Path

from trainckpt.errors import CheckpointNotFoundError, StorageError


def cached_copy(url: str, cache_dir: Path) -> Path:
    """Download `url` into `cache_dir` (or reuse the cached copy); return the local path."""
    from cached_path import cached_path

    cache_dir.mkdir(parents=True, exist_ok=True)
    try:
        return Path(cached_path(url, cache_dir=cache_dir, quiet=True))
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"'{url}' does not exist") from e
    except Exception as e:  # cached-path lets any SDK or transport error through
        raise StorageError(
            f"downloading '{url}' into '{cache_dir}' failed ({type(e).__name__}: {e})"
        ) from e
