"""State dicts: full tensors group by group, their files, and all-or-nothing validation.

- :mod:`~shardkit.core.state_dict.full`: the one generator of ``(key, full tensor)``;
- :mod:`~shardkit.core.state_dict.full_file`: one file, streamed through the coordinator;
- :mod:`~shardkit.core.state_dict.validation`: every key checked before anything is written;
- :mod:`~shardkit.core.state_dict.cache`: torch's ``get_state_dict(model, optimizer)`` with
  the FQNs learned once (``StateDictCache``), for a loop that asks every step (a memory
  snapshot's ``Stateful``); it needs torch's function only, nothing of the engine.

The files' formats, which never touch the engine, are :mod:`shardkit.core.formats`'s; this
package still exports its public names (``load_torch_file``, ``write_state_dict_file``). The
sharded state dict needs no code here: it is the sharded DTensors themselves.
"""

from shardkit.core.formats.file_readers import load_torch_file
from shardkit.core.formats.stream_file import write_state_dict_file
from shardkit.core.state_dict.cache import StateDictCache
from shardkit.core.state_dict.full import iter_full_state_dict
from shardkit.core.state_dict.full_file import load_full_state_dict, save_full_state_dict

__all__ = [
    "StateDictCache",
    "iter_full_state_dict",
    "load_full_state_dict",
    "load_torch_file",
    "save_full_state_dict",
    "write_state_dict_file",
]
