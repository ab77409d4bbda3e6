"""Where a compiled step's time goes: trace a few calls with jax.profiler and rank XLA's operations by time,
each with the model code it came from (the op_name and source line that jax writes into the HLO metadata).

Used by bench/train_throughput.py --profile_dir. The trace is also left in the directory for TensorBoard's
profile tab or https://ui.perfetto.dev (perfetto_trace.json.gz).
"""
import collections
import gzip
import json
import pathlib
import re

import jax

# `name = type[shape] opcode(...), ..., metadata={op_name="..." source_file="..." source_line=N}` in the
# compiled HLO text (older XLA writes the names with a leading %; tuple types contain spaces; copies XLA
# adds itself carry no metadata).
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$')
_OPCODE = re.compile(r'(?:^|\s)([\w\-]+)\(')
_METADATA = re.compile(r'metadata=\{op_name="([^"]*)"(?:\s+source_file="([^"]*)"\s+source_line=(\d+))?')


def op_sources(hlo_text):
  """{instruction name: (opcode, op_name or '', 'file:line' or '')} for the instructions of the HLO text."""
  sources = {}
  for line in hlo_text.splitlines():
    instruction, opcode = _INSTRUCTION.match(line), None
    if instruction:
      opcode = _OPCODE.search(instruction.group(2))
    if not opcode:
      continue
    metadata = _METADATA.search(instruction.group(2))
    op_name, source_file, source_line = metadata.groups() if metadata else ('', None, None)
    where = f'{pathlib.Path(source_file).name}:{source_line}' if source_file else ''
    sources[instruction.group(1)] = (opcode.group(1), op_name, where)
  return sources


def trace(run_steps, steps, directory):
  """Traces run_steps(steps) (which runs a compiled, warm step that many times and waits for the results) with
  jax.profiler; returns the trace events (Chrome trace format)."""
  jax.profiler.start_trace(directory, create_perfetto_trace=True)
  run_steps(steps)
  jax.profiler.stop_trace()
  newest = max((pathlib.Path(directory) / 'plugins' / 'profile').iterdir(), key=lambda p: p.stat().st_mtime)
  with gzip.open(next(newest.glob('*perfetto_trace.json.gz')), 'rt') as f:
    data = json.load(f)
  return data['traceEvents'] if isinstance(data, dict) else data


# Kernels a GPU step runs from libraries, not from XLA's own fusions: their names do not name an HLO
# instruction (XLA wraps a step in CUDA graphs, so args.hlo_op only names the command buffer).
LIBRARY_KERNELS = (
    ('matmul: cuBLAS kernels', r'^nvjet|gemm|xmma|cutlass'),
    ('attention: cuDNN kernels', r'cudnn'),
)


def instruction_of(event, sources):
  """The HLO instruction an event ran, a library kernel's label, or None. A CPU names the event after the
  instruction; a GPU after the kernel, which is the instruction's name with '_' for its last '.'."""
  name = str(event.get('name', '')).lstrip('%')
  if name in sources:
    return name
  dotted = re.sub(r'_(\d+)$', r'.\1', name)
  if dotted in sources:
    return dotted
  if 'hlo_op' not in (event.get('args') or {}):  # not a device kernel (host events: Python, runtime)
    return None
  for label, pattern in LIBRARY_KERNELS:
    if re.search(pattern, name):
      return label
  return None


# Instructions whose events hold their bodies' ops: their time is counted in those ops already.
CONTAINERS = frozenset({'while', 'call', 'conditional'})


def rank_ops(events, sources, steps):
  """[(ms per step, calls per step, name)] of the trace's complete events that ran an HLO instruction (or a
  library kernel: LIBRARY_KERNELS), largest first. A container (CONTAINERS: a while loop) is listed with its
  body's ops, which are listed too: part_sums leaves containers out."""
  total_us, calls = collections.Counter(), collections.Counter()
  for event in events:
    name = instruction_of(event, sources) if event.get('ph') == 'X' else None
    if name is not None:
      total_us[name] += float(event.get('dur', 0.0))
      calls[name] += 1
  return [(us / 1e3 / steps, calls[name] / steps, name) for name, us in total_us.most_common()]


# Which part of the step an operation belongs to, from its op_name (the first pattern that matches; the
# output projection runs inside `attend`, so it is matched first).
COMPONENTS = (
    ('vocabulary projection', r'vocabulary_logits'),
    ('embedding', r'\.embed\b|shared_embedding'),
    ('attention: projection out', r'/output/'),
    ('attention: projections in', r'project_qkv|project_kv|project_q\b|/qkv/|/query/|/kv/'),
    ('attention: scores, softmax, values', r'\.attend|dot_product_attention|softmax'),
    ('feed-forward', r'feed_forward'),
    ('layer norm', r'norm'),
    ('dropout masks', r'[Dd]ropout'),
    ('model: residual adds and the rest', r'Transformer|encoder|decoder'),
    ('random keys', r'threefry|random'),
    # Outside the model but inside the gradient: the label-smoothed loss.
    ('loss', r'jvp\(|transpose\('),
)


def component_of(op_name, opcode):
  if opcode == 'library':
    return op_name
  if not op_name:
    return f'no op_name: {opcode}'  # copies XLA added, fusions of its own
  for label, pattern in COMPONENTS:
    if re.search(pattern, op_name):
      return label
  return 'optimizer update, NaN guard, metrics'  # what is left outside the gradient


def kind_of(name, opcode):
  """On a GPU: 'matmuls' (XLA's GEMM fusions, cuBLAS), 'attention kernels' (cuDNN) or 'the rest' (elementwise
  and reduction fusions, copies: memory-bound work that MFU does not count). A CPU's dots hide inside fusions
  and oneDNN calls, so the split is printed for GPU traces only."""
  if opcode == 'dot' or name.startswith('gemm_fusion') or name == LIBRARY_KERNELS[0][0]:
    return 'matmuls'
  return 'attention kernels' if name == LIBRARY_KERNELS[1][0] else 'the rest'


def print_profile(hlo_text, run_steps, *, steps, directory, top, step_ms):
  """Traces run_steps(steps) and prints the time a step spends in each part of the model, then the `top`
  costliest operations of the step compiled as `hlo_text` (saved beside the trace as step.hlo.txt)."""
  pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
  (pathlib.Path(directory) / 'step.hlo.txt').write_text(hlo_text)
  sources = op_sources(hlo_text)
  sources.update((label, ('library', label, '')) for label, _ in LIBRARY_KERNELS)
  events = trace(run_steps, steps, directory)
  ranked = rank_ops(events, sources, steps)
  if sum(ms for ms, _, _ in ranked) < 0.5 * step_ms:  # events this parser does not read: say what they hold
    names = collections.Counter(str(e.get('name', ''))[:60] for e in events if e.get('ph') == 'X')
    keys = collections.Counter(k for e in events if e.get('ph') == 'X' for k in (e.get('args') or {}))
    print(f'# profile: most trace time is in events not named after an HLO instruction; commonest names '
          f'{names.most_common(8)}; argument keys {keys.most_common(12)}')
  if not ranked:
    print(f'# profile: no XLA operations found in the trace (in {directory})')
    return
  leaves = [(ms, n, name) for ms, n, name in ranked if sources[name][0] not in CONTAINERS]
  traced_ms = sum(ms for ms, _, _ in leaves)
  print(f'# profile of {steps} steps ({directory}): {len(leaves)} operations took {traced_ms:.1f} ms a step '
        f'(while/call/conditional events left out: their bodies\' ops count) of a {step_ms:.1f} ms step')
  by_component, ops = collections.Counter(), collections.Counter()
  for ms, _, name in leaves:
    opcode, op_name, _ = sources[name]
    by_component[component_of(op_name, opcode)] += ms
    ops[component_of(op_name, opcode)] += 1
  if any(name in dict(LIBRARY_KERNELS) for _, _, name in leaves):  # a GPU: its fusions name their dots
    by_kind = collections.Counter()
    for ms, _, name in leaves:
      by_kind[kind_of(name, sources[name][0])] += ms
    print('# by kind: ' + ', '.join(f'{kind} {ms:.1f} ms ({ms / step_ms:.1%})' for kind, ms in by_kind.most_common()))
  print(f'# {"ms":>8} {"share":>6} {"ops":>5}  part of the step')
  for label, ms in by_component.most_common():
    print(f'# {ms:8.1f} {ms / step_ms:6.1%} {ops[label]:5d}  {label}')
  print(f'# the {top} costliest operations:')
  print(f'# {"ms":>8} {"share":>6} {"calls":>5}  {"operation":<22} {"opcode":<14} model code')
  for ms, n, name in ranked[:top]:
    opcode, op_name, where = sources[name]
    # The tail of the op_name says what it is (e.g. .../decoder/layer_2/ffn/wi/dot_general); trim the rest.
    short = '/'.join(op_name.split('/')[-4:])
    print(f'# {ms:8.2f} {ms / step_ms:6.1%} {n:5.0f}  {name:<22} {opcode:<14} {short} {where}')
