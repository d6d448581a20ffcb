"""Benchmark (not a test): rollout throughput of the vLLM and transformers engines on the same
FrozenLake rows with the same sampling settings, in one run, and the time of a weight sync.

    .venv/bin/python bench.py --repeats 3

Prints the median sampled tokens per second of each engine, their ratio, and the median sync time.
"""
import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import train
from scheduler import GYMScheduler, rollout

parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
parser.add_argument('--repeats', type=int, default=3, help='timed rollouts per engine')
parser.add_argument('--rows', type=int, default=4, help='FrozenLake maps (seeds 0..rows-1)')
parser.add_argument('--num_generations', type=int, default=8, help='trajectories per map')
cli = parser.parse_args()

args = train.Args()
path = train.embedded_model()
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
rows = [{'messages': [], 'env_config': {'seed': s}} for s in range(cli.rows)]
engines = {'hf': train.TrainerEngine(model, tokenizer), 'vllm': train.VLLMEngine(path, args)}
speed = {}
for name, engine in engines.items():
    scheduler = GYMScheduler(engine, tokenizer, max_turns=args.max_turns, temperature=args.temperature,
                             max_completion_length=args.max_completion_length, gym_env='frozen_lake')
    runs = []
    for _ in range(cli.repeats):
        t0 = time.time()
        trajectories = rollout(scheduler, train.requests_for(rows, cli.num_generations))
        tokens = sum(sum(t.loss_mask) for t in trajectories)
        runs.append(tokens / (time.time() - t0))
        print(f'{name}: {tokens} sampled tokens, {runs[-1]:.1f} tokens/s, '
              f'{sum(t.num_turns for t in trajectories) / len(trajectories):.1f} turns per trajectory')
    speed[name] = statistics.median(runs)
syncs = []
for _ in range(cli.repeats):
    t0 = time.time()
    engines['vllm'].load_weights(model.state_dict().items())
    syncs.append(time.time() - t0)
print(f"median tokens/s: vllm {speed['vllm']:.1f}, hf {speed['hf']:.1f}, ratio {speed['vllm'] / speed['hf']:.1f}x; "
      f'median sync {statistics.median(syncs):.2f}s')
