"""Files written whole or not at all."""
import os
import threading

from etils import epath


def write_atomically(path, data):
  """Writes `data` (str: UTF-8 text; or bytes) to a temporary name of this thread's own beside `path`, then renames
  it over `path`: readers (another process, a later run) see the file before or the new one, whole. A failed or
  interrupted write (a full disk, Ctrl-C) removes its temporary file and leaves `path` as it was."""
  path = epath.Path(path)
  tmp = path.parent / f'.{path.name}.{os.getpid()}-{threading.get_ident()}.tmp'
  try:
    if isinstance(data, str):
      tmp.write_text(data, encoding='utf-8')
    else:
      tmp.write_bytes(data)
    tmp.replace(path)  # over an existing file (rename refuses one)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
