"""The trainer makes glibc keep a freed large buffer for reuse (host_memory.py): a second buffer of the same size,
taken in another thread as XLA:CPU's threads take theirs, faults no pages in again."""
import os
import platform
import subprocess
import sys

import pytest

PROBE = r'''
import ctypes, os, resource, sys, threading
if sys.argv[1] in ('keep', 'gpu'):  # as train.main does: after all the trainer's imports, before any computation
  from flaxformer_nmt.training import loop as train  # noqa: F401
  from flaxformer_nmt.runtime import host_memory
  if sys.argv[1] == 'gpu':  # a GPU plugin installed: the step's buffers are on the device, malloc is left alone
    host_memory._accelerator_plugins = lambda: ['jax-cuda13-plugin']
  assert host_memory.keep_freed_memory() == (os.environ.get(host_memory.ENV) != '0' and sys.argv[1] == 'keep')
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
SIZE = 256 * 2**20  # far above glibc's largest mmap threshold (32 MiB): served by mmap unless told otherwise

def touch_in_a_thread():  # malloc, write every page, free, as one run of a compiled program does
  faults = []
  def run():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = libc.malloc(SIZE)
    ctypes.memset(buffer, 1, SIZE)
    libc.free(buffer)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
  thread = threading.Thread(target=run)
  thread.start()
  thread.join()
  return faults[0]

first = touch_in_a_thread()
print(first, touch_in_a_thread())
'''


def faults(mode, **env):
  env = dict(os.environ, **env)
  env.pop('JAX_PLATFORMS', None)  # (=cpu would override the GPU plugin of the 'gpu' probe)
  result = subprocess.run([sys.executable, '-c', PROBE, mode], capture_output=True, text=True, timeout=120,
                          env=env)
  assert result.returncode == 0, result.stderr[-2000:]
  return [int(n) for n in result.stdout.split()]


@pytest.mark.skipif(platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc', reason='glibc only')
def test_a_freed_buffer_is_reused_without_faulting_its_pages_in_again():
  pages = 256 * 2**20 // os.sysconf('SC_PAGE_SIZE')
  first, second = faults('keep')
  assert first >= pages // 2  # the first touch faults (the kernel hands out zeroed pages)
  assert second < 100, (first, second)  # the same memory again: nothing to fault
  # Without the setting, or with it turned off, glibc unmaps the buffer at free and the next one faults again
  for mode, env in (('leave', {}), ('keep', {'FLAXFORMER_NMT_KEEP_FREED_MEMORY': '0'}), ('gpu', {})):
    first, second = faults(mode, **env)
    assert second >= pages // 2, (mode, env, first, second)


@pytest.mark.skipif(platform.system() != 'Linux', reason='reads /proc')
def test_resident_memory_grows_by_the_pages_a_process_touches():
  """resident_mb against 200 MB written in a child process: catches a reading in kB or pages taken for MB, or of
  VmSize (what is mapped, touched or not) instead of VmRSS."""
  script = ('import sys, numpy as np\n'
            'from flaxformer_nmt.runtime import host_memory\n'
            'before = host_memory.resident_mb()\n'
            'untouched = np.empty(400 * 2**20, np.uint8)\n'
            'touched = np.ones(200 * 2**20, np.uint8)\n'
            'print(host_memory.resident_mb() - before)\n')
  grown = float(subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, check=True).stdout)
  assert 190 < grown < 230, grown


ARENAS_PROBE = r'''
import ctypes, sys, threading
from flaxformer_nmt.runtime import host_memory
if sys.argv[1] == 'few':
  assert host_memory.few_malloc_arenas()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
held = threading.Barrier(6)

def allocate():  # each thread allocates while the others hold their arenas: glibc gives it a new one if it may
  libc.malloc(1000)
  held.wait()

threads = [threading.Thread(target=allocate) for _ in range(5)]
for thread in threads:
  thread.start()
held.wait()
libc.malloc_stats()  # to stderr: one 'Arena N:' section per arena
'''


@pytest.mark.skipif(platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc', reason='glibc only')
def test_the_decode_commands_threads_share_few_malloc_arenas():
  # Catches the cap not taken (a wrong mallopt parameter: -7 is M_ARENA_TEST) or a wrong count: five threads
  # allocating at once take arenas of their own by glibc's default, at most DECODE_ARENAS with the cap.
  from flaxformer_nmt.runtime import host_memory  # pylint: disable=g-import-not-at-top
  env = dict(os.environ)
  env.pop('MALLOC_ARENA_MAX', None)
  arenas = {}
  for mode in ('few', 'default'):
    result = subprocess.run([sys.executable, '-c', ARENAS_PROBE, mode], capture_output=True, text=True, timeout=120,
                            env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    arenas[mode] = result.stderr.count('Arena ')
  assert arenas == {'few': host_memory.DECODE_ARENAS, 'default': 6}, arenas
