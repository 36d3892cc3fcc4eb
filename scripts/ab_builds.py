#!/usr/bin/env python3
"""A/B two builds of meshtrain through `meshtrain train` (run from the repository root).

  python3 scripts/ab_builds.py identity OLD NEW
      Trains the same short runs (LeNet, GPT, Llama, ResNet-18 on several layouts) with both binaries
      and compares every parameter, buffer and optimizer tensor of their final checkpoints
      byte for byte. Exits 1 if any differs.

  python3 scripts/ab_builds.py throughput OLD NEW [--pairs N] [config ...]
      Interleaved A/B (old, new, old, new, ...) of training throughput. Per run: the trainer's
      reported throughput (samples over the breakdown's step time) and the steady-state
      wall-clock samples/s (mean of the logging windows after the first, from
      metrics.jsonl). Per config: medians and the median of per-pair ratios new/old.

OLD and NEW are paths to meshtrain binaries (build the other commit with its own
CARGO_TARGET_DIR). Data: the Fashion-MNIST subset shipped in data/, 2 threads.
"""
import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile

DATA = ['--set', 'data.data_dir="data/fashion-mnist-subset"', '--set', 'train.threads=2']

LENET = ['--config', 'configs/lenet.toml', '--set', 'data.train_limit=2048',
         '--set', 'data.test_limit=500', '--set', 'train.max_steps=16']
GPT = ['--config', 'configs/gpt.toml', '--set', 'model.dim=32', '--set', 'model.layers=2',
       '--set', 'model.heads=2', '--set', 'model.seq=16', '--set', 'train.batch_size=8',
       '--set', 'train.steps=40', '--set', 'train.max_steps=12', '--set', 'train.eval_every=6',
       '--set', 'train.eval_batches=2']
LLAMA = ['--config', 'configs/llama.toml', '--set', 'model.dim=32', '--set', 'model.layers=2',
         '--set', 'model.heads=4', '--set', 'model.kv_heads=2', '--set', 'model.ffn=48',
         '--set', 'model.seq=16', '--set', 'train.batch_size=8', '--set', 'train.steps=40',
         '--set', 'train.max_steps=12', '--set', 'train.eval_every=6',
         '--set', 'train.eval_batches=2']
RESNET = ['--config', 'configs/resnet18.toml', '--set', 'model.width=4',
          '--set', 'train.batch_size=16', '--set', 'data.train_limit=512',
          '--set', 'data.test_limit=64', '--set', 'train.max_steps=8']
# ZeRO writes sharded checkpoints by default; the comparison reads one file.
WHOLE = 'train.checkpoint_format="whole"'
IDENTITY = {
    'lenet-dp1': LENET + ['--dp', '1'],
    'lenet-dp2': LENET + ['--dp', '2'],
    'lenet-dp2-single-master': LENET + ['--dp', '2', '--dp-mode', 'single-master'],
    'lenet-dp2-accumulate2': LENET + ['--dp', '2', '--set', 'train.accumulation_steps=2'],
    'lenet-dp2-bf16': LENET + ['--dp', '2', '--set', 'parallel.compression="bf16"'],
    'lenet-dp1-recompute': LENET + ['--dp', '1', '--set', 'train.recompute=true'],
    'gpt-dp1': GPT + ['--dp', '1'],
    'gpt-dp2': GPT + ['--dp', '2'],
    'gpt-pp2-1f1b': GPT + ['--pp', '2', '--schedule', '1f1b', '--micro-batches', '4'],
    'gpt-pp2-gpipe-recompute': GPT + ['--pp', '2', '--schedule', 'gpipe', '--micro-batches', '4',
                                      '--set', 'train.recompute=true'],
    'gpt-dp2-pp2-interleaved': GPT + ['--dp', '2', '--pp', '2', '--schedule', 'interleaved',
                                      '--micro-batches', '2'],
    'resnet-dp2-syncbn': RESNET + ['--dp', '2', '--set', 'parallel.sync_batch_norm=true'],
    'resnet-pp2': RESNET + ['--pp', '2', '--schedule', '1f1b', '--micro-batches', '2'],
    'gpt-dp2-zero1': GPT + ['--dp', '2', '--set', 'parallel.zero=1', '--set', WHOLE],
    'gpt-dp2-zero2': GPT + ['--dp', '2', '--set', 'parallel.zero=2', '--set', WHOLE],
    'gpt-dp2-zero3-accumulate2': GPT + ['--dp', '2', '--set', 'parallel.zero=3', '--set', WHOLE,
                                        '--set', 'train.accumulation_steps=2'],
    'gpt-tp2-sp': GPT + ['--set', 'parallel.tp=2', '--set', 'parallel.sequence_parallel=true'],
    'gpt-tp2': GPT + ['--set', 'parallel.tp=2'],
    'gpt-cp2-ring': GPT + ['--set', 'parallel.cp=2'],
    'llama-dp1': LLAMA + ['--dp', '1'],
    'llama-tp2': LLAMA + ['--set', 'parallel.tp=2'],
    'llama-cp2-ulysses': LLAMA + ['--set', 'parallel.cp=2', '--set', 'parallel.cp_mode="ulysses"'],
}

THROUGHPUT = {
    'lenet_dp1': ['--config', 'configs/lenet.toml', '--dp', '1', '--set', 'train.max_steps=180',
                  '--set', 'train.log_every=45'],
    'lenet_dp2': ['--config', 'configs/lenet.toml', '--dp', '2', '--set', 'train.max_steps=180',
                  '--set', 'train.log_every=45'],
    'resnet_dp1': ['--config', 'configs/resnet18.toml', '--dp', '1', '--set',
                   'train.max_steps=24', '--set', 'train.log_every=6'],
    'resnet_dp2': ['--config', 'configs/resnet18.toml', '--dp', '2', '--set',
                   'train.max_steps=24', '--set', 'train.log_every=6'],
    'gpt_dp1': ['--config', 'configs/gpt.toml', '--dp', '1', '--set', 'train.max_steps=40',
                '--set', 'train.log_every=10'],
    'gpt_dp2': ['--config', 'configs/gpt.toml', '--dp', '2', '--set', 'train.max_steps=40',
                '--set', 'train.log_every=10'],
    'gpt_pp2': ['--config', 'configs/gpt.toml', '--pp', '2', '--micro-batches', '8', '--set',
                'train.max_steps=40', '--set', 'train.log_every=10'],
    'gpt_tp2_sp': ['--config', 'configs/gpt.toml', '--set', 'parallel.tp=2', '--set',
                   'parallel.sequence_parallel=true', '--set', 'train.max_steps=40',
                   '--set', 'train.log_every=10'],
    'gpt_cp2_ring': ['--config', 'configs/gpt.toml', '--set', 'parallel.cp=2', '--set',
                     'train.max_steps=40', '--set', 'train.log_every=10'],
    'llama_dp1': ['--config', 'configs/llama.toml', '--dp', '1', '--set', 'train.max_steps=40',
                  '--set', 'train.log_every=10'],
    'gpt_dp2_zero3': ['--config', 'configs/gpt.toml', '--dp', '2', '--set', 'parallel.zero=3',
                      '--set', 'train.max_steps=40', '--set', 'train.log_every=10'],
}


def train(binary, args, out):
    """Runs `binary train args` into a fresh `out`; returns stdout."""
    subprocess.run(['rm', '-rf', out], check=True)
    cmd = [binary, 'train'] + args + DATA + ['--set', f'train.out_dir="{out}"']
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f'{" ".join(cmd)} failed:\n{done.stdout}\n{done.stderr}')
    return done.stdout


def tensors(path):
    """The tensors of a safetensors file, by name, as raw bytes."""
    data = open(path, 'rb').read()
    n = struct.unpack('<Q', data[:8])[0]
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    return {k: body[v['data_offsets'][0]:v['data_offsets'][1]]
            for k, v in header.items() if k != '__metadata__'}


def identity(old, new):
    root = tempfile.mkdtemp(prefix='meshtrain-ab-')
    differing = 0
    for name, args in IDENTITY.items():
        states = []
        for which, binary in (('old', old), ('new', new)):
            out = os.path.join(root, which, name)
            train(binary, args, out)
            states.append(tensors(os.path.join(out, 'checkpoint.safetensors')))
        a, b = states
        keys = [k for k in a if k.split('.')[0] in ('param', 'buffer', 'optimizer')]
        diff = [k for k in keys if a[k] != b.get(k)]
        verdict = 'bit-identical' if not diff else f'{len(diff)} differ: {diff[:4]}'
        print(f'{name}: {len(keys)} tensors, {verdict}', flush=True)
        differing += bool(diff)
    return 1 if differing else 0


def throughput(old, new, pairs, names):
    for name in names or list(THROUGHPUT):
        runs = {'old': [], 'new': []}
        for r in range(pairs):
            for which, binary in (('old', old), ('new', new)):
                out = f'/tmp/meshtrain-ab-{which}'
                text = train(binary, THROUGHPUT[name], out)
                trainer = float(text.split('throughput ')[1].split()[0])
                records = [json.loads(line) for line in open(f'{out}/metrics.jsonl')]
                windows = [x['samples_per_s'] for x in records if x['kind'] == 'train'][1:]
                wall = statistics.mean(windows)
                runs[which].append((trainer, wall))
                print(f'{name} {which} {r + 1}: trainer {trainer:.1f}, wall {wall:.1f}',
                      flush=True)
        for k, label in ((1, 'wall'), (0, 'trainer')):
            o = [x[k] for x in runs['old']]
            n = [x[k] for x in runs['new']]
            ratios = [b / a for a, b in zip(o, n)]
            print(f'{name} {label}: old median {statistics.median(o):.1f}, new median '
                  f'{statistics.median(n):.1f}, new/old per pair {statistics.median(ratios):.3f} '
                  f'({min(ratios):.3f}-{max(ratios):.3f})', flush=True)
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('what', choices=['identity', 'throughput'])
    parser.add_argument('old')
    parser.add_argument('new')
    parser.add_argument('configs', nargs='*', help=f'throughput configs: {", ".join(THROUGHPUT)}')
    parser.add_argument('--pairs', type=int, default=4)
    a = parser.parse_args()
    if a.what == 'identity':
        return identity(a.old, a.new)
    return throughput(a.old, a.new, a.pairs, a.configs)


if __name__ == '__main__':
    sys.exit(main())
