"""`identity(obj)`: a key for an object that holds as long as the object lives, as `id(obj)`,
for the dicts that map tensors and state values to what was found for them, once per state
entry.

`id()` is an audited operation (PEP 578): once any Python audit hook is installed, CPython
calls it at every `id()`. Importing `filelock` (which huggingface_hub, OLMo-core and many
training stacks import) installs one; each `id()` then took about 0.5 µs instead of 0.05 µs,
and a save of 64,000 state entries called it 300,000 times (docs/scale.md, "`id()` under an
audit hook"). `object.__hash__` is CPython's hash of the object's address (the address
rotated: distinct for distinct live objects, as `id()`) and is not audited: about 0.12 µs with
or without a hook. Called on: any rank, any thread.
"""

from __future__ import annotations

from collections.abc import Callable

identity: Callable[[object], int] = object.__hash__
