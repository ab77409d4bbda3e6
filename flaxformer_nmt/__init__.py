"""flaxformer_nmt: the Transformer of "Attention Is All You Need" for machine translation, in JAX and Flax.

Importing the package sets glibc's malloc to keep freed memory for reuse (host_memory.py says why: without it
XLA:CPU faults its whole working buffer in again at every step, and the recipe's train step is 1.4 times
slower). It must happen before jax starts its threads, hence here; FLAXFORMER_NMT_KEEP_FREED_MEMORY=0 turns it
off.
"""
from flaxformer_nmt import host_memory as _host_memory

_host_memory.keep_freed_memory()
