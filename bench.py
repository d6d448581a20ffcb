"""Benchmarks (not tests): each part compares things in one run, so its ratios hold on any
machine. `.venv/bin/python bench.py PART` (docs/speed-and-scaling.md: the commands, the numbers):
- rollout: sampled tokens/s of vLLM and transformers, the same games;
- update: the update on the same trajectories, shared prompt or not, recomputed activations or
  not, against a plain fp32 matmul;
- eval: a held-out evaluation (256 maps, greedy), vLLM's counters;
- sync: a weight push into vLLM, full and LoRA merged;
- gpu (on a CUDA machine, `python bench.py gpu`): 3 steps of train.py, full and LoRA with --engine
  hf, and where vLLM is, --engine vllm in bf16 (sleep, wake, weight push each step);
- openenv: FrozenLake in process and served by openenv_gym.py: an env step, 2 training steps.
--model picks the policy: the embedded model (default) plays the short games of a run's first
steps, a trained run's checkpoint the longer games of its last ones.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

parser = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument('part', choices=['rollout', 'update', 'eval', 'sync', 'gpu', 'openenv'])
parser.add_argument('--model', help='model folder or checkpoint (default: the embedded model)')
parser.add_argument('--repeats', type=int, default=3, help='timed repeats of each variant')
parser.add_argument('--rows', type=int, default=4, help='FrozenLake maps to play (seeds 0..rows-1)')
parser.add_argument('--num_generations', type=int, default=8, help='games per map')
parser.add_argument('--micro_batch_size', type=int, default=8, help='update: segments per pass')
parser.add_argument('--block_size', type=int, default=32, help="eval: vLLM's KV cache block")
parser.add_argument('--chunks', default='256,32,128', help='eval: games played at a time, in turn')
parser.add_argument('--kv_cache_gib', type=float, default=0.5, help="eval: vLLM's KV cache (GiB)")
cli = parser.parse_args()
SHORT_GRPO = ('--warm_start_steps 0 --eval_size 0 --rows_per_step 4 --max_completion_length 16 '
              '--temperature 0.8 --beta 0').split()  # GRPO alone, short games: not the recipe's


def timed(fn, repeats=cli.repeats):
    """(median seconds, the last result) of fn() run `repeats` times."""
    seconds = []
    for _ in range(repeats):
        t0 = time.time()
        result = fn()
        seconds.append(time.time() - t0)
    return statistics.median(seconds), result


def run_train(label: str, flags: list, prefix: str) -> tuple:
    """train.py with SHORT_GRPO and these flags in a process of its own: (its output folder, a
    new one named prefix..., and its seconds)."""
    out = tempfile.mkdtemp(prefix=prefix)
    t0 = time.time()
    run = subprocess.run([sys.executable, 'train.py', *SHORT_GRPO, *flags, '--output_dir', out],
                         capture_output=True, text=True)
    if run.returncode:
        sys.exit(f'{label}: train.py failed: {(run.stderr or run.stdout)[-2000:]}')
    return out, time.time() - t0


if cli.part == 'gpu':  # before anything loads: train.py does the work
    import importlib.util
    from importlib.metadata import version
    print(', '.join(f'{name} {version(name)}' for name in ('torch', 'transformers', 'peft')))
    runs = [('full', 'hf', 'float32'), ('lora', 'hf', 'float32')]  # then, where vLLM is there,
    runs += [('full', 'vllm', 'bfloat16')] if importlib.util.find_spec('vllm') else []  # each
    for tuner, engine, dtype in runs:  # step's sleep -> update -> wake -> weight push, in bf16
        name = f'{tuner} {engine} {dtype}'
        flags = (f'--env frozen_lake --dataset data.jsonl --max_steps 3 --reward_funcs progress '
                 f'--reward_weights 0.5 1 --engine {engine} --device cuda --torch_dtype {dtype} '
                 f'--tuner_type {tuner}').split()
        out, seconds = run_train(tuner, flags + (['--model', cli.model] if cli.model else []),
                                 f'gpu-{tuner}-{engine}-')
        for m in map(json.loads, open(os.path.join(out, 'metrics.jsonl'))):
            print(f"{name} step {m['step']}: loss {m['loss']:.4f} logprob_gap "
                  f"{m['logprob_gap']:.2e} entropy {m['entropy']:.3f} | rollout "
                  f"{m['rollout_s']:.1f}s train {m['train_s']:.1f}s sync {m['sync_s']:.2f}s")
        print(f'{name}: {seconds:.0f}s in all, start-up included ({out})', flush=True)
    print('' if len(runs) > 2 else 'no vLLM here: the sleep, wake and push round trip was not run')
    sys.exit(0)

if cli.part == 'openenv':  # the server in its own venv
    import asyncio
    import urllib.request
    from env import RolloutInferRequest, envs
    from openenv_gym import OpenEnvWrapper
    import frozen_lake  # noqa: F401  (registers envs['frozen_lake'])
    if not os.path.exists('.venv-openenv/bin/python'):
        sys.exit('bench.py openenv: needs .venv-openenv (python3 -m venv .venv-openenv && '
                 '.venv-openenv/bin/pip install openenv==0.10.0)')
    port = 8000 + os.getpid() % 1000
    server = subprocess.Popen(['.venv-openenv/bin/python', 'openenv_gym.py', '--port', str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f'http://127.0.0.1:{port}'
    for _ in range(120):  # its start-up
        try:
            urllib.request.urlopen(url + '/health', timeout=2).read()
            break
        except OSError:
            time.sleep(1)

    async def local_steps(n):
        env = envs['frozen_lake']({'seed': 0})
        await env.reset(RolloutInferRequest([], {'env_config': {'seed': 0}}))
        wait = [{'role': 'assistant', 'content': 'wait'}]  # unreadable: nobody moves
        t0 = time.time()
        for _ in range(n):
            await env.step(wait)
        return (time.time() - t0) / n

    def served_steps(n):
        session = OpenEnvWrapper({'base_url': url, 'reset_kwargs': {'seed': 0}})
        session.reset()
        t0 = time.time()
        for _ in range(n):
            session.step({'message': 'wait'})
        session.close()
        return (time.time() - t0) / n

    try:
        local = statistics.median(asyncio.run(local_steps(200)) for _ in range(cli.repeats))
        served = statistics.median(served_steps(200) for _ in range(cli.repeats))
        print(f'an env step: {local * 1e3:.3f} ms in process, {served * 1e3:.3f} ms served '
              f'(median of {cli.repeats} x 200)')
        for name, config, flags in [  # the same maps (seeds 0..rows-1) both ways
                ('in process', lambda s: {'seed': s}, []),
                ('served', lambda s: {'base_url': url, 'reset_kwargs': {'seed': s}},
                 ['--multi_turn_scheduler', 'openenv_scheduler'])]:
            rows = os.path.join(tempfile.mkdtemp(prefix='bench-openenv-'), 'rows.jsonl')
            with open(rows, 'w') as f:
                f.writelines(json.dumps({'messages': [], 'env_config': config(s)}) + '\n'
                             for s in range(cli.rows))
            # one reply a game: the same work both ways; --reward_funcs, none: the env's alone
            _, seconds = run_train(name, ['--dataset', rows, '--max_steps', '2', '--max_turns', '1',
                                      '--save_only_model', 'true', *flags, '--reward_funcs'],
                                   'bench-openenv-')
            print(f'2 training steps, {name}: {seconds:.0f} s, start-up included')
    finally:
        server.kill()
    sys.exit(0)

os.environ.setdefault('TORCH_CPP_LOG_LEVEL', 'ERROR')  # read as torch loads: quiets a NUMA line
import torch  # noqa: E402  (after parsing, so that --help is instant)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import batching  # noqa: E402
import frozen_lake  # noqa: E402  (registers envs['frozen_lake'])
import grpo  # noqa: E402
import update  # noqa: E402
from config import Args, Task  # noqa: E402
from engines import Colocated, HFEngine, VLLMEngine, policy_weights  # noqa: E402
from models import embedded_model, quiet  # noqa: E402
from train import evaluate  # noqa: E402
from scheduler import GYMScheduler, requests_for, rollout  # noqa: E402

quiet()
path = cli.model or embedded_model()
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
args = Args()
rows = [{'messages': [], 'env_config': {'seed': s}} for s in range(cli.rows)]


def scheduler_on(engine):
    return GYMScheduler(engine, args.max_turns, tokenizer=tokenizer, temperature=args.temperature,
                        gym_env='frozen_lake', max_completion_length=args.max_completion_length)


def games():  # fresh requests: a rollout appends to their messages
    return requests_for(rows, cli.num_generations)


if cli.part == 'rollout':
    speed = {}
    for name, engine in (('vllm', VLLMEngine(path)), ('hf', HFEngine(model, tokenizer))):
        scheduler = scheduler_on(engine)
        seconds, trajectories = timed(lambda: rollout(scheduler, games()))
        tokens = sum(t.num_sampled for t in trajectories)
        speed[name] = tokens / seconds
        print(f'{name}: {tokens} sampled tokens in {seconds:.1f}s (median of {cli.repeats}): '
              f'{speed[name]:.1f} tokens/s')
    print(f"vllm / hf: {speed['vllm'] / speed['hf']:.1f}x")

if cli.part == 'update':
    trajectories = rollout(scheduler_on(VLLMEngine(path)), games())  # the engine is freed here
    every = torch.ones(len(trajectories), dtype=torch.bool)
    scores = grpo.Scores(columns=None, rewards=None, advantages=None,
                         turn_advantages=torch.randn(len(trajectories), 1), valid=every,
                         in_loss=every, trained=list(range(len(trajectories))))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: a step's work, weights kept
    body = sum(p.numel() for name, p in model.named_parameters() if 'embed' not in name)
    a = torch.randn(2048, 2048)
    matmuls = [2 * 2048 ** 3 / timed(lambda: a @ a, 1)[0] / 1e9 for _ in range(10)]  # GFLOP/s
    results = {}
    for recompute, switch in ((True, model.gradient_checkpointing_enable),
                              (False, model.gradient_checkpointing_disable)):
        switch()
        for share in (False, True):
            batches = batching.micro_batches(trajectories, scores.turn_advantages, pad_id=0,
                                             size=cli.micro_batch_size, share_prompt=share)
            computed = sum(b.input_ids.numel() for b in batches)  # what the model reads, padding
            step = Args(share_prompt=share, gradient_checkpointing=recompute,
                        micro_batch_size=cli.micro_batch_size)
            seconds, _ = timed(lambda: update.train_step(model, None, optimizer, trajectories,
                                                        scores, step, 0))
            results[recompute, share] = seconds
            flops = (8 if recompute else 6) * body * computed  # forward 2, backward 4, recompute 2
            print(f"gradient checkpointing {'on ' if recompute else 'off'}, shared prompt "
                  f"{'on ' if share else 'off'}: {computed} tokens computed, {seconds:.1f}s "
                  f'(median of {cli.repeats}), {flops / seconds / 1e9:.0f} GFLOP/s', flush=True)
    tokens = sum(len(s.token_ids) for t in trajectories for s in t.segments)
    print(f'{len(trajectories)} trajectories, {tokens} tokens; shared prompt: '
          f'{results[True, False] / results[True, True]:.2f}x with recomputation, '
          f'{results[False, False] / results[False, True]:.2f}x without; no recomputation: '
          f'{results[True, True] / results[False, True]:.2f}x (shared); both: '
          f'{results[True, False] / results[False, True]:.2f}x. '
          f'GFLOP/s count 8 (recomputing) or 6 x {body / 1e6:.0f}M non-embedding parameters x '
          f'tokens computed; a 2048x2048 fp32 matmul: {statistics.median(matmuls):.0f} GFLOP/s '
          '(median of 10)')

if cli.part == 'eval':
    engine = VLLMEngine(path, kv_cache_gib=cli.kv_cache_gib, block_size=cli.block_size,
                        disable_log_stats=False)
    lake = Colocated(engine, scheduler_on(engine))
    held_out = frozen_lake.FrozenLakeEnv.eval_rows(args.eval_size, {})
    task = Task([], held_out, frozen_lake.FrozenLakeEnv, [], [1.0])
    names = ('prompt_tokens', 'prefix_cache_hits', 'generation_tokens', 'num_preemptions')

    def counts():  # vLLM's own counters
        return {m.name[5:]: m.value for m in engine.llm.get_metrics() if m.name[5:] in names}
    for size in map(int, cli.chunks.split(',')):
        before = counts()
        seconds, result = timed(lambda: evaluate(lake, task, Args(rows_per_step=size,
                                                                  num_generations=1)), 1)
        done = {k: int(v - before[k]) for k, v in counts().items()}
        print(f"{len(held_out)} games, {size} at a time, KV blocks of {cli.block_size}: "
              f"{seconds:.1f}s; success {result['success']:.1%} [{result['success_low']:.1%}, "
              f"{result['success_high']:.1%}], {result['turns']:.2f} turns a game; prompt tokens "
              f"{done['prompt_tokens']:,} ({done['prefix_cache_hits']:,} from the prefix cache), "
              f"generated {done['generation_tokens']:,}, preemptions {done['num_preemptions']}",
              flush=True)

if cli.part == 'sync':
    engine = VLLMEngine(path)
    full, _ = timed(lambda: engine.load_weights(model.state_dict().items()))
    from peft import LoraConfig, get_peft_model
    lora = get_peft_model(model, LoraConfig(r=8, lora_alpha=32, target_modules='all-linear'))

    def push():  # merge the adapters, push the whole model, unmerge (engines.policy_weights)
        with policy_weights(lora) as weights:
            engine.load_weights(weights)
    merged, _ = timed(push)
    print(f'weight sync (median of {cli.repeats}): full {full:.2f}s, LoRA merged {merged:.2f}s')
