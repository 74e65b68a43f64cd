"""`import trainckpt` stays cheap: DCP and DTensor (about a second to import) load on first use."""

from __future__ import annotations

import subprocess
import sys


def test_import_does_not_load_dcp_or_dtensor() -> None:
    code = (
        "import sys, trainckpt\n"
        "heavy = [m for m in ('torch.distributed.checkpoint', 'torch.distributed.tensor', "
        "'torchtitan') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"imported at `import trainckpt`: {out.stdout.strip()}"
