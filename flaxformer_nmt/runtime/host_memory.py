"""How the trainer holds host memory: a compiled step's freed buffer is kept for the next step, not handed back
to the operating system and faulted in again (keep_freed_memory); and how decoding does: in few malloc arenas
(few_malloc_arenas).

XLA:CPU runs a compiled program with one buffer for all its intermediates, allocated with malloc when the
program starts and freed when it ends: 997 MB for the recipe's train step (64 rows of 64 tokens; the logits
over 8,000 pieces and their gradients dominate). glibc serves an allocation that large with mmap (above its
mmap threshold, at most 32 MB; and from a thread's own arena, which cannot hold it, whatever the threshold)
and returns it with munmap when it is freed. So every step touched ~244,000 fresh pages, each a page fault
and a page zeroed by the kernel: on a 2-core Intel Xeon, ~290,000 faults a second, a quarter of the CPU time
in the kernel, and configs/multi30k.py's step took 810 ms against 572 ms with the buffer kept.

`keep_freed_memory()` asks glibc (mallopt) to serve every thread from the main heap (M_ARENA_MAX 1), never
with mmap (M_MMAP_MAX 0), and to give the heap's top back only beyond 2 GiB free (M_TRIM_THRESHOLD): the
buffer is then reused where it lies. The prices: the process keeps its peak heap until it exits (a training
loop reaches it again at its next step anyway), and threads that allocate much at once wait for each other:
compiling is slower (decoding Multi30k's valid without a compilation cache took 62 s against 48 s). So the
trainer sets it (train.main) and the train-step bench, not decoding. glibc fixes the number of arenas when a
thread other than the main one first allocates, which XLA's threads do when the backend starts: it must run
before the first computation. Where a GPU or TPU plugin of jax is installed (and JAX_PLATFORMS does not say
cpu) the step's buffers live on the device, so malloc is left as it is there; likewise with
FLAXFORMER_NMT_KEEP_FREED_MEMORY=0, and under C libraries other than glibc.
"""
import ctypes
import importlib.metadata
import os
import platform

# mallopt's parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int

ENV = 'FLAXFORMER_NMT_KEEP_FREED_MEMORY'


def _accelerator_plugins():
  """The installed distributions that give jax a GPU or TPU backend."""
  names = {(d.metadata['Name'] or '').lower() for d in importlib.metadata.distributions()}
  return sorted(n for n in names if n.startswith(('jax-cuda', 'jax-rocm', 'libtpu')))


def keep_freed_memory():
  """Sets glibc's malloc to keep freed memory for reuse (see above); True where it did."""
  if os.environ.get(ENV, '1') == '0':
    return False
  if os.environ.get('JAX_PLATFORMS', '').lower() != 'cpu' and _accelerator_plugins():
    return False
  settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
  return _mallopt(settings)


# Decoding's malloc arenas (M_ARENA_MAX; glibc's default: up to 8 per core, a new one for each thread that
# allocates while the others are taken). An arena keeps what its threads freed, so the search's threads and
# XLA's each held their own: the decode command of test2016 (warm, 2 cores) peaked at 413-432 MB greedy and
# 485-547 MB in beam search, with 2 arenas 388 and 445-465 MB, as fast. One arena (keep_freed_memory's) saves
# more, 360-420 MB, but compiles the search's programs 1-1.4 s slower.
DECODE_ARENAS = 2


def few_malloc_arenas():
  """Caps glibc's malloc arenas at DECODE_ARENAS (the decode command, before the backend starts, as
  keep_freed_memory); not where $MALLOC_ARENA_MAX says otherwise. True where it did."""
  if os.environ.get('MALLOC_ARENA_MAX'):
    return False
  return _mallopt(((_M_ARENA_MAX, DECODE_ARENAS),))


def _mallopt(settings):
  """glibc's mallopt(parameter, value) for each of `settings`; True where every one was taken (False under other C
  libraries)."""
  if platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc':
    return False
  try:
    mallopt = ctypes.CDLL(None).mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  return all([mallopt(parameter, value) == 1 for parameter, value in settings])


def resident_mb(pid='self'):
  """The resident memory (VmRSS) of process `pid` (default this one) now, in MB; Linux only."""
  with open(f'/proc/{pid}/status', encoding='utf-8') as f:
    return next(int(line.split()[1]) for line in f if line.startswith('VmRSS:')) / 1024
