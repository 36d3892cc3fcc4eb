#!/usr/bin/env python3
"""Check a run's TensorBoard events against its metrics.jsonl (run from anywhere).

  python3 scripts/check_tensorboard.py RUN_DIR [EVENTS_DIR]

RUN_DIR holds metrics.jsonl; EVENTS_DIR (default RUN_DIR/tensorboard, where
`--tensorboard DIR` put them) the event files. The events are read
with TensorBoard's own reader (the `tensorboard` pip package), so this checks that TensorBoard
shows what meshtrain logged: every finite number of every "train" and "eval" record, named
like meshtrain's `record_scalars` ("train/loss", "eval/accuracy", an object's fields one level
down as "train/OBJECT/FIELD"; "step" excluded, nulls, booleans and strings skipped), must be a
scalar at that record's step, equal within float32 rounding (TensorBoard stores f32).

Exit status: 0 all match, 1 something missing or different, 2 usage or no `tensorboard`.
"""
import json
import math
import os
import sys

KINDS = ('train', 'eval')
REL_TOL = 1e-6
ABS_TOL = 1e-30


def number(v):
    """v as a finite float, or None (bool is an int in Python, but not a scalar here)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def record_scalars(record):
    """(tag, value) pairs of one metrics.jsonl record, as meshtrain's record_scalars names them."""
    kind = record.get('kind')
    if not isinstance(kind, str):
        return []
    scalars = []
    for name, value in record.items():
        if name == 'step':
            continue
        if isinstance(value, dict):
            for field, v in value.items():
                x = number(v)
                if x is not None:
                    scalars.append((f'{kind}/{name}/{field}', x))
        else:
            x = number(value)
            if x is not None:
                scalars.append((f'{kind}/{name}', x))
    return scalars


def main():
    if len(sys.argv) not in (2, 3) or sys.argv[1] in ('-h', '--help'):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    run = sys.argv[1]
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as e:
        print(f'check_tensorboard: the `tensorboard` Python package is needed ({e}); '
              'install it with `pip install tensorboard`', file=sys.stderr)
        return 2

    metrics_path = os.path.join(run, 'metrics.jsonl')
    tb_dir = sys.argv[2] if len(sys.argv) == 3 else os.path.join(run, 'tensorboard')
    problems = []
    expected = []  # (line number, step, tag, value)
    try:
        with open(metrics_path) as f:
            lines = f.readlines()
    except OSError as e:
        print(f'check_tensorboard: {e}', file=sys.stderr)
        return 1
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            problems.append(f'{metrics_path}:{n}: not JSON ({e})')
            continue
        if not isinstance(record, dict) or record.get('kind') not in KINDS:
            continue
        step = record.get('step')
        if isinstance(step, bool) or not isinstance(step, int):
            problems.append(f'{metrics_path}:{n}: {record["kind"]} record without an integer step')
            continue
        expected.extend((n, step, tag, v) for tag, v in record_scalars(record))

    if not os.path.isdir(tb_dir) or not any('tfevents' in f for f in os.listdir(tb_dir)):
        problems.append(f'{tb_dir}: no event files')
        logged = {}
    else:
        acc = EventAccumulator(tb_dir, size_guidance={'scalars': 0})
        acc.Reload()
        logged = {}  # (tag, step) -> value; the last event wins, as TensorBoard shows it
        for tag in acc.Tags()['scalars']:
            for event in acc.Scalars(tag):
                logged[(tag, event.step)] = event.value

    for n, step, tag, v in expected:
        got = logged.get((tag, step))
        if got is None:
            problems.append(f'{metrics_path}:{n}: {tag} at step {step} ({v!r}) missing from {tb_dir}')
        elif not abs(got - v) <= max(REL_TOL * abs(v), ABS_TOL):
            problems.append(f'{metrics_path}:{n}: {tag} at step {step}: metrics.jsonl {v!r}, '
                            f'tensorboard {got!r}')
    if not expected and not problems:
        problems.append(f'{metrics_path}: no train or eval scalars to check')

    if problems:
        for p in problems:
            print(p)
        print(f'tensorboard: {len(problems)} problem(s) against metrics.jsonl')
        return 1
    steps = len({step for _, step, _, _ in expected})
    print(f'tensorboard: {len(expected)} scalars over {steps} steps match metrics.jsonl')
    return 0


if __name__ == '__main__':
    sys.exit(main())
