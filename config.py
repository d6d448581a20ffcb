"""The flags of train.py (and server.py's share of them) and every check that can run before a
model loads: `Args` (one flat list of flags, ms-swift's names where the concept is the same),
`parser` (a command line of it), `check_args` (bad input refused in one line, UserError). The
task's own rules come from its env class: its `train_defaults` (`parse_args`), its reward columns
(`reward_setup`) and its held-out rows (`held_out`, else a share of the dataset).
"""
import argparse
import dataclasses
import importlib.util
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from env import Env, UserError, env_name, envs, load_plugins, orms, reward_funcs
import grpo
import tools
from scheduler import GYMScheduler, MultiTurnScheduler, multi_turns


def flag(default, text: str):
    """A field of Args: its default and its --help line."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={'help': text})
    return field(default=default, metadata={'help': text})


@dataclass
class Args:
    # ---- environment and data (flag names as in ms-swift) ----
    gym_env: str = flag('frozen_lake', 'env for rows without env_config.name (alias --env)')
    external_plugins: List[str] = flag([], 'python files that register envs, rewards and '
                                           'schedulers')
    multi_turn_scheduler: str = flag('gym_scheduler', 'a name in scheduler.multi_turns: '
                                                      'gym_scheduler, hint_scheduler, '
                                                      "window_scheduler, or a plugin's")
    use_gym_env: bool = flag(True, "use the env's total_reward as the last reward column")
    dataset: str = flag('data.jsonl', 'JSONL rows with messages and env_config')
    split_dataset_ratio: float = flag(0.1, 'share of --dataset held out for evaluation, for envs '
                                           'without held-out rows of their own')
    max_turns: int = flag(10, 'most model replies per trajectory, tool calls included (server '
                              "mode: must equal the server's)")
    tool_timeout: float = flag(10.0, 'seconds a tool may take before its call is answered with an '
                                     'error')
    # ---- model, engine, device ----
    model: Optional[str] = flag(None, 'local folder or hub id; not given: the embedded '
                                      'SmolLM2-135M-Instruct')
    tuner_type: str = flag('full', 'full fine-tuning, or lora (peft adapters; checkpoints hold '
                                   'the adapter)')
    lora_rank: int = flag(8, "with --tuner_type lora: the adapters' rank")
    lora_alpha: int = flag(32, 'with --tuner_type lora: their scale is lora_alpha / lora_rank')
    target_modules: List[str] = flag(['all-linear'], 'with --tuner_type lora: module names to '
                                                     'adapt (all-linear: every linear layer but '
                                                     'the output head)')
    device: str = flag('auto', 'where the trainer computes: auto (CUDA when torch sees it; under '
                               "torchrun each process's own GPU), cuda, or cpu")
    torch_dtype: str = flag('float32', 'float32, or bfloat16: the forward and backward in bf16 '
                                       '(weights and optimizer state stay fp32); the engine '
                                       'samples in the same dtype')
    engine: str = flag('auto', 'rollout engine: vllm, hf, or auto (vllm when it can start)')
    vllm_mode: str = flag('colocate', 'colocate: vLLM inside this process; server: rollouts from '
                                      'server.py')
    vllm_gpu_memory_utilization: float = flag(0.3, 'CUDA: share of GPU memory vLLM may take')
    vllm_kv_cache_gib: float = flag(0.5, 'CPU: GiB of RAM for the vLLM KV cache')
    vllm_server_host: str = flag('127.0.0.1', 'server mode: the rollout server address')
    vllm_server_port: int = flag(8000, 'server mode: the rollout server port')
    vllm_server_pass_dataset: bool = flag(False, "server mode: send each row's env_config to the "
                                                 "server's envs")
    vllm_server_timeout: float = flag(240.0, 'server mode: seconds to wait for an answer before '
                                             'giving up')
    vllm_max_model_len: int = flag(2048, 'longest trajectory, prompt included, in tokens')
    # ---- GRPO ----
    num_generations: int = flag(8, 'trajectories per row (the group size), at least 2')
    rows_per_step: int = flag(4, 'dataset rows per optimizer step')
    train_dataloader_shuffle: bool = flag(True, "each GRPO step a random sample of rows; false: "
                                                  "the dataset's next rows, in its order")
    reward_funcs: Optional[List[str]] = flag(None, 'extra reward columns (names the env files '
                                                   "register); not given: the env's own "
                                                   "default_reward_funcs (FrozenLakeEnv's: "
                                                   'progress)')
    reward_weights: Optional[List[float]] = flag(None, 'one weight per column, the gym reward '
                                                       "last; not given: the env's own "
                                                       "(FrozenLakeEnv's: progress 0.5, gym 1), "
                                                       'else all 1')
    loss_type: str = flag('bnpo', "loss normaliser: bnpo (the batch's sampled tokens), dapo (the "
                                  'same, overlong-filtered ones too), grpo (per trajectory; '
                                  "ms-swift's default), dr_grpo (a constant)")
    advantage_estimator: str = flag('grpo', 'grpo (group mean baseline), rloo (leave-one-out '
                                            'baseline), or gigpo (grpo plus a step-level '
                                            'advantage per anchor state)')
    step_advantage_w: float = flag(1.0, "with gigpo: the step-level advantage's weight")
    gamma: float = flag(0.95, 'with gigpo: the discount of the step-level returns')
    scale_rewards: Optional[str] = flag(None, 'divide advantages by the std of the group, the '
                                              'batch, or none; not given: group, and none for '
                                              'rloo (as ms-swift)')
    dynamic_sample: bool = flag(False, 'DAPO: replace groups without reward spread by fresh rows')
    max_resample_times: int = flag(3, 'with --dynamic_sample: most extra rollout rounds a step')
    overlong_filter: bool = flag(False, 'leave trajectories cut by a length limit out of the loss')
    importance_sampling_level: str = flag('token', 'token ratios, or sequence (GSPO: one ratio '
                                                   'per token sequence)')
    rollout_importance_sampling_mode: Optional[str] = flag(None, 'engine/trainer mismatch '
                                                                 'correction: token_truncate, '
                                                                 'token_mask, sequence_truncate, '
                                                                 'sequence_mask; not given: off')
    rollout_importance_sampling_threshold: float = flag(2.0, 'upper bound of those weights')
    beta: float = flag(0.0, 'KL penalty to the starting model (0: no reference model kept)')
    epsilon: float = flag(0.2, 'lower clip range of the ratio')
    epsilon_high: Optional[float] = flag(None, 'upper clip range; not given: --epsilon')
    num_iterations: int = flag(1, 'optimizer passes over each batch')
    temperature: float = flag(0.8, 'sampling temperature of training rollouts (> 0)')
    max_completion_length: int = flag(16, 'most tokens in one reply')
    learning_rate: float = flag(2e-5, 'AdamW learning rate')
    warmup_ratio: float = flag(0.0, 'share of --max_steps over which the rate rises linearly to '
                                    "--learning_rate (then constant): a fresh AdamW's first "
                                    'steps are as large as its rate, whatever the gradient')
    micro_batch_size: int = flag(8, 'segments (trajectories, unless a scheduler rewrote history) '
                                    'per forward/backward: memory, not math')
    share_prompt: bool = flag(True, "compute each prefix the micro-batch's segments share (a "
                                    "group's prompt) once: the same loss and gradients, less work")
    gradient_checkpointing: bool = flag(True, 'recompute activations in backward: less memory '
                                              '(without it a default run peaked at 10.2 GiB), '
                                              'about 1.2x more time')
    max_grad_norm: float = flag(1.0, 'gradient clipping')
    warm_start_learning_rate: Optional[float] = flag(None, "the warm start's learning rate; not "
                                                     'given: --learning_rate')
    warm_start_steps: int = flag(0, "supervised steps on the env's expert games "
                                    '(Env.expert_reply) before GRPO')
    warm_start_generations: int = flag(1, 'games the expert plays on each row a supervised step '
                                          'picks (it picks rows_per_step x num_generations // '
                                          'this rows, at most all), numbered in the column '
                                          'expert_game: an expert that decides by a coin tosses '
                                          'one a game (FrozenLake coin_at_forks), others play '
                                          'the same game again')
    # ---- run ----
    max_steps: int = flag(26, 'optimizer steps')
    eval_steps: int = flag(0, 'evaluate every N steps, and after a warm start (0: only before '
                                 'and after)')
    eval_size: int = flag(256, 'most held-out rows to evaluate on (0: no evaluation)')
    eval_temperature: float = flag(0.0, 'sampling temperature of evaluation (0: greedy)')
    eval_only: bool = flag(False, 'evaluate --model and stop')
    save_steps: int = flag(20, 'checkpoint every N steps (and at the end)')
    save_only_model: bool = flag(False, 'checkpoints without the optimizer state (a third of the '
                                        'size; --resume then starts AdamW afresh)')
    output_dir: str = flag('output', 'metrics, completions, checkpoints, plot')
    resume: bool = flag(False, 'continue from the latest checkpoint in --output_dir')
    seed: int = flag(0, "picks each step's rows; seeds vLLM's sampler and torch")
    report_to: List[str] = flag([], 'dashboards besides metrics.jsonl: tensorboard, wandb '
                                    '(offline)')

def truth(text: str) -> bool:
    if text.lower() in ('true', 'yes', '1', 'false', 'no', '0'):
        return text.lower() in ('true', 'yes', '1')
    raise argparse.ArgumentTypeError(f'{text!r}: say true or false')


def shown(value) -> str:
    """A default as --help shows it (and the test of --help reads it)."""
    if isinstance(value, list):
        return ' '.join(map(str, value)) or '[]'
    return str(value).lower() if isinstance(value, bool) else str(value)


def parser(description: str, names=None) -> argparse.ArgumentParser:
    """A command line of Args' fields (all, or those named): each flag's help ends with its
    default, unless the default is None, whose meaning the help says itself. A flag not given
    parses to None (the field's default, in `parse_args`)."""
    out = argparse.ArgumentParser(description=description)
    for f in dataclasses.fields(Args):
        if names is not None and f.name not in names:
            continue
        flags = ['--' + f.name] + (['--env'] if f.name == 'gym_env' else [])
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        text = f.metadata['help'] + ('' if default is None else f' (default: {shown(default)})')
        text += ''.join(f" ({name}'s train_defaults: {shown(env.train_defaults[f.name])})"
                        for name, env in sorted(envs.items()) if f.name in env.train_defaults)
        text = text.replace('%', '%%')  # argparse formats help strings with %
        if f.type == bool:
            out.add_argument(*flags, type=truth, metavar='true|false', help=text)
        elif f.type in (List[str], Optional[List[str]], Optional[List[float]]):
            kind = float if f.type == Optional[List[float]] else str
            out.add_argument(*flags, nargs='*', type=kind, help=text)
        else:
            kind = {Optional[str]: str, Optional[float]: float}.get(f.type, f.type)
            out.add_argument(*flags, type=kind, help=text)
    return out


def parse_args(argv=None) -> Args:
    """The flags given, then the env's `train_defaults` (FrozenLake's: its recipe), then Args'."""
    given = vars(parser('GRPO on GYM environments: train.py --env frozen_lake').parse_args(argv))
    return with_train_defaults({k: v for k, v in given.items() if v is not None})


def with_train_defaults(given: dict) -> Args:
    """Args of the flags given, the others from --gym_env's `train_defaults` if an env plays."""
    load_plugins(given.get('external_plugins', []))  # a plugin env may bring train_defaults too
    env_cls = envs.get(given.get('gym_env', Args.gym_env), Env)
    scheduler = multi_turns.get(given.get('multi_turn_scheduler', Args.multi_turn_scheduler))
    plays_env = isinstance(scheduler, type) and issubclass(scheduler, GYMScheduler)
    return Args(**{**(env_cls.train_defaults if plays_env else {}), **given})


# ------------------------------------------------------------ input checks, before anything heavy

LIMITS = {  # flag: (lowest allowed, what it means)
    'max_turns': (1, 'at least one reply'),
    'num_generations': (2, 'a group needs at least 2 trajectories'),
    'rows_per_step': (1, 'at least one row'), 'max_completion_length': (1, 'at least one token'),
    'micro_batch_size': (1, 'at least one trajectory'), 'num_iterations': (1, 'at least one pass'),
    'max_steps': (0, 'not negative'), 'warm_start_steps': (0, 'not negative'),
    'warm_start_generations': (1, 'at least one game a row'),
    'eval_steps': (0, 'not negative'), 'eval_size': (0, 'not negative'),
    'save_steps': (1, 'at least 1'), 'beta': (0, 'not negative'), 'epsilon': (0, 'not negative'),
    'eval_temperature': (0, 'not negative'), 'vllm_kv_cache_gib': (0, 'not negative'),
    'max_resample_times': (0, 'not negative'),
    'rollout_importance_sampling_threshold': (1, 'at least 1'), 'lora_rank': (1, 'at least 1'),
    'lora_alpha': (1, 'at least 1'), 'vllm_max_model_len': (2, 'at least 2'),
}

CHOICES = {
    'vllm_mode': ['colocate', 'server'], 'engine': ['auto', 'vllm', 'hf'],
    'tuner_type': ['full', 'lora'], 'loss_type': ['bnpo', 'grpo', 'dr_grpo', 'dapo'],
    'advantage_estimator': ['grpo', 'rloo', 'gigpo'],
    'scale_rewards': [None, 'group', 'batch', 'none'],
    'importance_sampling_level': ['token', 'sequence'],
    'device': ['auto', 'cpu', 'cuda'], 'torch_dtype': ['float32', 'bfloat16'],
    'rollout_importance_sampling_mode': [None, 'token_truncate', 'token_mask', 'sequence_truncate',
                                         'sequence_mask'],
}


def load_dataset(path: str, gym_env: str = None, plays_env: bool = True) -> List[Dict[str, Any]]:
    """Read a JSONL dataset; every row must have `messages` and, where an env plays (plays_env: a
    GYMScheduler), an `env_config` of a known env. Other columns stay, for the rewards."""
    rows = []
    try:
        lines = open(path, encoding='utf-8').read().splitlines()
    except OSError as e:
        raise UserError(f'--dataset {path}: {e.strerror}') from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f'{path}:{i}'
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f'{where}: malformed JSON ({e.msg})') from None
        if not isinstance(row, dict) or plays_env and not isinstance(row.get('env_config'), dict):
            raise UserError(f'{where}: the row has no env_config object')
        if not isinstance(row.get('messages', []), list):
            raise UserError(f'{where}: messages must be a list')
        name = env_name(row, gym_env)
        if plays_env and name not in envs:
            got = (f'env {name!r} is not registered' if name
                   else 'no env: set --gym_env or env_config.name')
            raise UserError(f'{where}: {got}; registered: {", ".join(sorted(envs)) or "none"}')
        rows.append(row)
    if not rows:
        raise UserError(f'--dataset {path}: no rows')
    return rows


def held_out(rows, env_cls, eval_size: int, ratio: float, dataset: str):
    """(training rows, evaluation rows): the env's own held-out rows, else the dataset's last."""
    if not eval_size:
        return rows, []
    own = env_cls.eval_rows(eval_size, rows[0]['env_config']) if env_cls else None
    if own is not None:  # with the training rows' settings, their `tools` column included
        column = {'tools': rows[0]['tools']} if 'tools' in rows[0] else {}
        return rows, [{**row, **column} for row in own]
    n = min(eval_size, math.ceil(len(rows) * ratio))
    if n >= len(rows):
        raise UserError(f'--split_dataset_ratio {ratio}: would hold out all {len(rows)} rows of '
                        f'{dataset}')
    return rows[:len(rows) - n], rows[len(rows) - n:]


def check_flags(args):
    """Ranges and choices of the flags given."""
    for name, (low, meaning) in LIMITS.items():
        if getattr(args, name) < low:
            raise UserError(f'--{name} {getattr(args, name)}: {meaning}')
    for name in ('temperature', 'learning_rate', 'warm_start_learning_rate', 'tool_timeout'):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise UserError(f'--{name} {value}: must be above 0')
    for name, choices in CHOICES.items():
        if getattr(args, name) not in choices:
            raise UserError(f'--{name} {getattr(args, name)}: choose from '
                            f'{", ".join(c for c in choices if c)}')
    if not 0 <= args.warmup_ratio <= 1:
        raise UserError(f'--warmup_ratio {args.warmup_ratio}: must be in [0, 1]')
    if not 0 <= args.split_dataset_ratio < 1:
        raise UserError(f'--split_dataset_ratio {args.split_dataset_ratio}: must be in [0, 1)')
    if args.dynamic_sample and not args.train_dataloader_shuffle:
        raise UserError('--dynamic_sample refills a step with random rows: it needs '
                        '--train_dataloader_shuffle true')
    for name in args.report_to:
        if name not in ('tensorboard', 'wandb'):
            raise UserError(f'--report_to {name}: choose from tensorboard, wandb')
        if importlib.util.find_spec(name) is None:
            raise UserError(f'--report_to {name}: the package is not installed '
                            f'(pip install {name})')


def check_game(args):
    """The checks train.py and server.py share: the flags, the model folder, the plugins, the
    scheduler and the env."""
    check_flags(args)
    if args.device == 'cuda':
        import torch  # here only: the other checks need no torch
        if not torch.cuda.is_available():
            raise UserError('--device cuda: torch sees no CUDA device (torch.cuda.is_available())')
    if args.model and not os.path.isdir(args.model) and args.model.startswith(('/', '.', '~')):
        raise UserError(f'--model {args.model}: no such folder')
    load_plugins(args.external_plugins)
    name = args.multi_turn_scheduler
    if name not in multi_turns:
        raise UserError(f'--multi_turn_scheduler {name}: not registered; registered: '
                        f'{", ".join(sorted(multi_turns))}')
    cls = multi_turns[name]
    if not (isinstance(cls, type) and issubclass(cls, MultiTurnScheduler)):
        raise UserError(f"--multi_turn_scheduler {name}: multi_turns['{name}'] is {cls!r}, "
                        'not a MultiTurnScheduler subclass')
    if args.gym_env not in envs:
        raise UserError(f'--gym_env {args.gym_env}: not registered; registered: '
                        f'{", ".join(sorted(envs))}')


@dataclass
class Task:
    """What a run plays and how it is scored, as check_args finds it."""
    rows: List[dict]  # the training rows
    eval_rows: List[dict]  # the held-out rows (none: no evaluation)
    env_cls: type  # whose rules apply: success, drawing (Env when the scheduler plays no env)
    reward_names: List[str]  # the --reward_funcs columns; the gym reward, if used, after them
    reward_weights: List[float]  # one per column, the gym reward's last


def check_args(args: Args) -> Task:
    """Every input check that can run before a model loads; fills in --scale_rewards."""
    check_game(args)
    if args.scale_rewards is None:
        args.scale_rewards = 'none' if args.advantage_estimator == 'rloo' else 'group'
    plays_env = issubclass(multi_turns[args.multi_turn_scheduler], GYMScheduler)
    env_cls = envs[args.gym_env] if plays_env else Env
    rows = load_dataset(args.dataset, args.gym_env, plays_env)
    if hasattr(multi_turns[args.multi_turn_scheduler], 'check_rows'):  # e.g. its servers answer
        multi_turns[args.multi_turn_scheduler].check_rows(rows)
    games = args.rows_per_step * args.num_generations
    if args.warm_start_generations > games:
        raise UserError(f'--warm_start_generations {args.warm_start_generations}: more than the '
                        f'games of a step (--rows_per_step x --num_generations = {games})')
    if args.warm_start_steps and not plays_env:
        raise UserError(f'--warm_start_steps {args.warm_start_steps}: no expert, since '
                        f'--multi_turn_scheduler {args.multi_turn_scheduler} plays no env')
    for name in {env_name(row, args.gym_env) for row in rows} | {args.gym_env} if plays_env else ():
        tools.check_tools(envs[name].tools, f'env {name}')
        if args.warm_start_steps and envs[name].expert_reply is Env.expert_reply:
            raise UserError(f'--warm_start_steps {args.warm_start_steps}: env {name} has no '
                            'expert (Env.expert_reply)')
    for number, row in enumerate(rows, 1):
        tools.check_tools(row.get('tools', []), f'{args.dataset}, row {number}')
    loaded = rows
    rows, eval_rows = held_out(loaded, env_cls if plays_env else None, args.eval_size,
                               args.split_dataset_ratio, args.dataset)
    own = eval_rows if rows is loaded else []  # the env's own held-out rows, not the dataset's
    names, weights = reward_setup(args, env_cls, {args.dataset: loaded, 'the held-out rows': own})
    if args.rows_per_step > len(rows):
        raise UserError(f'--rows_per_step {args.rows_per_step}: there are {len(rows)} training '
                        f'rows in {args.dataset}')
    return Task(rows, eval_rows, env_cls, names, weights)


def reward_setup(args: Args, env_cls, rows: dict):
    """The reward columns (--reward_funcs, then the gym reward) and their weights; with neither
    flag, the env's `default_reward_funcs` (a plugin env gets no FrozenLake reward). An `orms`
    class (ms-swift's) is made once, with args, and must find its __call__'s columns in each row
    of `rows` ({where: rows})."""
    own = args.reward_funcs is None
    names = list(env_cls.default_reward_funcs) if own else args.reward_funcs
    for name in names:
        if name in orms and name not in reward_funcs:
            reward_funcs[name] = orms[name](args=args)
            for where, some in rows.items():
                grpo.check_columns(name, reward_funcs[name], some, where)
        if name not in reward_funcs:
            raise UserError(f'--reward_funcs {name}: unknown; registered: '
                            f'{", ".join(sorted({*reward_funcs, *orms})) or "none"}')
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
