"""Reading a kernel's tuned launch table: a JSON object in the file an environment variable names, else in the
file shipped beside the kernel, each entry checked by the caller."""

import json
import os
from collections.abc import Callable
from pathlib import Path


def read_tuned_table(env_var: str, shipped: Path, check_entry: Callable[[str, str, object], None]) -> dict:
    """The table in the file `env_var` names (it must exist) or in `shipped` ({} where that is missing);
    `check_entry(where, key, entry)` raises ValueError on a bad entry, `where` naming the file."""
    named = os.environ.get(env_var)
    path = Path(named or shipped)
    where = f"{env_var}={named!r}" if named else str(path)
    if not path.exists():
        if named:
            raise ValueError(f"{where}: no such file")
        return {}
    try:
        table = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from None
    if not isinstance(table, dict):
        raise ValueError(f"{where}: the table must be a JSON object, got {type(table).__name__}")
    for key, entry in table.items():
        check_entry(where, key, entry)
    return table
