"""State dict files: the formats on disk, written and read without the engine.

Nothing here knows of process groups or parameter groups: these modules turn tensors into
files and files into tensors, so ``state_dict/`` (what walks the engine's groups) and
converters outside the engine share one implementation.

- :mod:`~shardkit.core.formats.file_writers`: writing safetensors and torch.save's format;
- :mod:`~shardkit.core.formats.file_readers`: reading them, the whole file checked first;
- :mod:`~shardkit.core.formats.safetensors_explain`: where a refused safetensors file is wrong;
- :mod:`~shardkit.core.formats.stream_file`: a file from tensors produced one at a time;
- :mod:`~shardkit.core.formats.torch_zip`, :mod:`~shardkit.core.formats.torch_pickle`,
  :mod:`~shardkit.core.formats.torch_legacy`, :mod:`~shardkit.core.formats.zip_directory`:
  torch's own formats, checked without unpickling.

``shardkit.core.state_dict`` and ``shardkit.core`` export the same public names as before.
"""

from shardkit.core.formats.file_readers import load_torch_file
from shardkit.core.formats.stream_file import write_state_dict_file

__all__ = ["load_torch_file", "write_state_dict_file"]
