"""State dicts: full tensors group by group, files, and all-or-nothing validation.

- :mod:`~shardkit.core.state_dict.full`: the one generator of ``(key, full tensor)``;
- :mod:`~shardkit.core.state_dict.full_file`: one file, streamed through the coordinator;
- :mod:`~shardkit.core.state_dict.file_formats`: writing safetensors and torch.save's format;
- :mod:`~shardkit.core.state_dict.file_readers`: reading them, the whole file checked first;
- :mod:`~shardkit.core.state_dict.safetensors_explain`: where a refused safetensors file is wrong;
- :mod:`~shardkit.core.state_dict.stream_file`: a file from tensors produced one at a time;
- :mod:`~shardkit.core.state_dict.validation`: every key checked before anything is written.

The sharded state dict needs no code here: it is the sharded DTensors themselves.
"""

from shardkit.core.state_dict.file_readers import load_torch_file
from shardkit.core.state_dict.full import iter_full_state_dict
from shardkit.core.state_dict.full_file import load_full_state_dict, save_full_state_dict
from shardkit.core.state_dict.stream_file import write_state_dict_file

__all__ = [
    "iter_full_state_dict",
    "load_full_state_dict",
    "load_torch_file",
    "save_full_state_dict",
    "write_state_dict_file",
]
