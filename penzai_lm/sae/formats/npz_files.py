"""Checks of a ``.npz`` member before its data is read (zip bombs).

A ``.npz`` file is a zip archive of ``.npy`` files. Reading a member
allocates what its ``.npy`` header claims (shape x item size) and inflates
what its zip entry claims, so both are checked first, from the headers
alone:

* the member is named ``<key>.npy`` and its ``.npy`` header parses, with a
  plain (not object or structured) dtype;
* the zip entry's declared uncompressed size is exactly the ``.npy``
  header's length plus shape x item size (a header that claims more data
  than the entry holds is refused before anything is allocated);
* a stored (uncompressed) entry lies inside the file, and a compressed
  entry of more than `_RATIO_FLOOR` bytes inflates at most `MAX_RATIO`
  times (trained float weights hardly compress; a small file that inflates
  to gigabytes is a zip bomb).
"""

from __future__ import annotations

from pathlib import Path
import zipfile

import numpy as np

from penzai_lm.sae.formats.errors import SAEFormatError

MAX_RATIO = 50
_RATIO_FLOOR = 16 << 20


def _header(archive: zipfile.ZipFile, info: zipfile.ZipInfo, where: str):
  """(shape, dtype, header length) of the member's ``.npy`` header."""
  with archive.open(info) as member:
    try:
      version = np.lib.format.read_magic(member)
      read = {(1, 0): np.lib.format.read_array_header_1_0,
              (2, 0): np.lib.format.read_array_header_2_0}.get(version)
      if read is None:
        raise ValueError(f".npy format version {version} is not supported")
      shape, _, dtype = read(member, max_header_size=10000)
    except (ValueError, EOFError, SyntaxError) as e:
      raise SAEFormatError(
          f"{where} is not a valid .npy array ({type(e).__name__}: {e}); the"
          " file is corrupt or not numpy's .npz.") from e
    return shape, dtype, member.tell()


def check_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path,
                 file_size: int) -> str:
  """Checks one member (module docstring) and returns its key (the name
  without ``.npy``).

  Raises:
    SAEFormatError: naming the file and member.
  """
  where = f"{path}: member {info.filename!r}"
  if not info.filename.endswith(".npy"):
    raise SAEFormatError(f"{where} is not a .npy array; a .npz of weights"
                         " holds only .npy members.")
  if info.compress_type == zipfile.ZIP_STORED:
    if (info.compress_size != info.file_size
        or info.header_offset + info.compress_size > file_size):
      raise SAEFormatError(
          f"{where} claims {info.file_size} bytes stored uncompressed, which"
          f" the {file_size}-byte file cannot hold; the file is truncated or"
          " corrupt.")
  elif (info.file_size > _RATIO_FLOOR
        and info.file_size > MAX_RATIO * max(info.compress_size, 1)):
    raise SAEFormatError(
        f"{where} inflates {info.compress_size} bytes to {info.file_size}"
        f" (more than {MAX_RATIO} times): that is a zip bomb, not weights;"
        " refused before decompressing.")
  shape, dtype, offset = _header(archive, info, where)
  if dtype.hasobject or dtype.fields is not None:
    raise SAEFormatError(f"{where} has dtype {dtype}; only plain numeric"
                         " arrays are read (nothing is unpickled).")
  nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
  if offset + nbytes != info.file_size:
    raise SAEFormatError(
        f"{where}: its .npy header claims shape {list(shape)} of {dtype}"
        f" ({nbytes} bytes), but the member holds {info.file_size - offset}"
        " bytes of data; the file is corrupt or forged. Refused before"
        " allocating anything.")
  return info.filename[:-len(".npy")]
