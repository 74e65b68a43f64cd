"""A file added to a committed checkpoint after its commit, recorded in its manifest.

Trainers write beside the checkpoint once it is saved: OLMo-core's `ConfigSaverCallback` puts
`config.json` and `data_paths.txt` into every checkpoint folder (`Checkpointer.write_file`).
Left out of the manifest, such a file would make the checkpoint fail verification (an
unexpected file), and `load` would refuse it. So the file is written first, then the manifest is
rewritten (atomically) with its entry. A crash between the two leaves an unexpected file that
verification names; never a manifest entry without its file.
"""

from __future__ import annotations

import logging

from trainckpt.errors import ConfigurationError
from trainckpt.format.folder import is_committed
from trainckpt.format.layout import MANIFEST_FILE, METADATA_FILE, is_safe_relpath
from trainckpt.format.records import read_manifest
from trainckpt.storage import Storage
from trainckpt.storage.checksums import FileEntry, crc32c_bytes

log = logging.getLogger(__name__)


def write_file(storage: Storage, folder: str, rel: str, data: bytes, *, overwrite: bool) -> str:
    """Write `data` to `folder/rel` (create-only unless `overwrite`); when `folder` is a
    committed checkpoint with a manifest, add the file to the manifest. Returns the file's path.

    Called on: one rank per checkpoint at a time (two writers racing on one manifest could
    each drop the other's entry).
    """
    if not is_safe_relpath(rel) or rel in (MANIFEST_FILE, METADATA_FILE):
        raise ConfigurationError(
            f"cannot write '{rel}' into '{folder}': give a relative path inside the folder, "
            f"other than the checkpoint records {MANIFEST_FILE} and {METADATA_FILE}"
        )
    target = storage.join(folder, rel)
    committed = is_committed(storage, folder)
    storage.write_bytes(target, data, overwrite=overwrite)
    if not committed:
        return target
    manifest_at = storage.join(folder, MANIFEST_FILE)
    try:
        manifest = read_manifest(storage, folder)  # size-bounded, like every record read
    except FileNotFoundError:
        return target  # a checkpoint without manifest (OLMo-core's): nothing to keep complete
    entry = FileEntry(size=len(data), crc32c=crc32c_bytes(data))
    files = {**manifest.files, rel: entry}
    storage.write_bytes(
        manifest_at, manifest.model_copy(update={"files": files}).to_json(), overwrite=True
    )
    log.info("added '%s' to the manifest of checkpoint '%s'", rel, folder)
    return target
