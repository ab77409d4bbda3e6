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


def rank_ops(events, sources, steps):
  """[(ms per step, calls per step, name)] of the trace's complete events that name an HLO instruction,
  largest first. A thunk nested in another (a while body's ops) counts in both."""
  total_us, calls = collections.Counter(), collections.Counter()
  for event in events:
    name = str(event.get('name', '')).lstrip('%')
    if event.get('ph') == 'X' and name in sources:
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
  if not op_name:
    return f'no op_name: {opcode}'  # copies XLA added, fusions of its own
  for label, pattern in COMPONENTS:
    if re.search(pattern, op_name):
      return label
  return 'optimizer update, NaN guard, metrics'  # what is left outside the gradient


def print_profile(hlo_text, run_steps, *, steps, directory, top, step_ms):
  """Traces run_steps(steps) and prints the time a step spends in each part of the model, then the `top`
  costliest operations of the step compiled as `hlo_text` (saved beside the trace as step.hlo.txt)."""
  pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
  (pathlib.Path(directory) / 'step.hlo.txt').write_text(hlo_text)
  sources = op_sources(hlo_text)
  ranked = rank_ops(trace(run_steps, steps, directory), sources, steps)
  if not ranked:
    print(f'# profile: no XLA operations found in the trace (in {directory})')
    return
  traced_ms = sum(ms for ms, _, _ in ranked)
  print(f'# profile of {steps} steps ({directory}): {len(ranked)} operations took {traced_ms:.1f} ms a step '
        f'(nested thunks counted twice) of a {step_ms:.1f} ms step')
  by_component, ops = collections.Counter(), collections.Counter()
  for ms, _, name in ranked:
    opcode, op_name, _ = sources[name]
    by_component[component_of(op_name, opcode)] += ms
    ops[component_of(op_name, opcode)] += 1
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
