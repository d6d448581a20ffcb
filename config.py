"""The flags of train.py and server.py (`Args`, ms-swift's names) and every check that can run
before a model loads (`check_args`); an env class brings its train_defaults, rewards, eval rows."""
import argparse
import importlib.util
import json
import math
import os
from dataclasses import MISSING, dataclass, field, fields
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
    external_plugins: List[str] = flag([], 'python files that register envs, rewards, schedulers')
    multi_turn_scheduler: str = flag('gym_scheduler', 'a name in scheduler.multi_turns: '
                                     "gym_scheduler, hint_scheduler, window_scheduler, a plugin's")
    use_gym_env: bool = flag(True, "use the env's total_reward as the last reward column")
    dataset: str = flag('data.jsonl', 'JSONL rows with messages and env_config')
    split_dataset_ratio: float = flag(0.1, 'share of --dataset held out (envs with no eval_rows)')
    max_turns: int = flag(10, "most replies a game, tool calls too (server mode: the server's)")
    tool_timeout: float = flag(10.0, 'seconds before a tool call is answered with an error')
    # ---- model, engine, device ----
    model: Optional[str] = flag(None, 'folder or hub id; not given: embedded SmolLM2-135M-Instruct')
    tuner_type: str = flag('full', 'full fine-tuning or lora (peft; checkpoints hold the adapters)')
    lora_rank: int = flag(8, "with --tuner_type lora: the adapters' rank")
    lora_alpha: int = flag(32, 'with --tuner_type lora: their scale is lora_alpha / lora_rank')
    target_modules: List[str] = flag(['all-linear'], 'with --tuner_type lora: modules to adapt')
    device: str = flag('auto', 'where the trainer computes: auto (CUDA if available), cuda, or cpu')
    torch_dtype: str = flag('float32', 'float32, or bfloat16: bf16 compute on fp32 weights; the '
                            'engine samples in the same dtype')
    engine: str = flag('auto', 'rollout engine: vllm, hf, or auto (vllm when it can start)')
    vllm_mode: str = flag('colocate', 'colocate: vLLM in-process; server: rollouts from server.py')
    vllm_gpu_memory_utilization: float = flag(0.3, 'CUDA: share of GPU memory vLLM may take')
    vllm_kv_cache_gib: float = flag(0.5, 'CPU: GiB of RAM for the vLLM KV cache')
    vllm_server_host: str = flag('127.0.0.1', 'server mode: the rollout server address')
    vllm_server_port: int = flag(8000, 'server mode: the rollout server port')
    vllm_server_pass_dataset: bool = flag(False, "server mode: send rows' env_config to the server")
    vllm_server_timeout: float = flag(240.0, 'server mode: seconds to wait for an answer')
    vllm_max_model_len: int = flag(2048, 'longest trajectory, prompt included, in tokens')
    # ---- GRPO ----
    num_generations: int = flag(8, 'trajectories per row (the group size), at least 2')
    rows_per_step: int = flag(4, 'dataset rows per optimizer step')
    train_dataloader_shuffle: bool = flag(True, 'each step random rows (false: the next in order)')
    reward_funcs: Optional[List[str]] = flag(None, 'extra reward columns (registered names); not '
                                             "given: the env's own (FrozenLake's: safe_progress)")
    reward_weights: Optional[List[float]] = flag(None, 'a weight per column, the gym reward last; '
                                                 "not given: the env's own (FrozenLake's: "
                                                 'safe_progress 0.5, gym 1), else all 1')
    loss_type: str = flag('bnpo', "normaliser: bnpo (the batch's tokens), dapo (the same, overlong-"
                          "filtered too), grpo (per trajectory, ms-swift's default), dr_grpo")
    advantage_estimator: str = flag('grpo', 'grpo (group mean baseline), rloo (leave-one-out), or '
                                    'gigpo (grpo plus a step-level advantage per anchor state)')
    step_advantage_w: float = flag(1.0, "with gigpo: the step-level advantage's weight")
    gamma: float = flag(0.95, 'with gigpo: the discount of the step-level returns')
    scale_rewards: Optional[str] = flag(None, "divide advantages by the group's std, the batch's, "
                                        'or none; not given: group (rloo: none, as ms-swift)')
    dynamic_sample: bool = flag(False, 'DAPO: replace groups without reward spread by fresh rows')
    max_resample_times: int = flag(3, 'with --dynamic_sample: most extra rollout rounds a step')
    overlong_filter: bool = flag(False, 'leave trajectories cut by a length limit out of the loss')
    importance_sampling_level: str = flag('token', 'token or sequence (GSPO: a ratio per sequence)')
    rollout_importance_sampling_mode: Optional[str] = flag(
        None, 'engine/trainer mismatch correction: token_truncate, token_mask, sequence_truncate, '
        'sequence_mask; not given: off')
    rollout_importance_sampling_threshold: float = flag(2.0, 'upper bound of those weights')
    beta: float = flag(0.0, 'KL penalty to the starting model (0: no reference model kept)')
    epsilon: float = flag(0.2, 'lower clip range of the ratio')
    epsilon_high: Optional[float] = flag(None, 'upper clip range; not given: --epsilon')
    num_iterations: int = flag(1, 'optimizer passes over each batch')
    temperature: float = flag(0.8, 'sampling temperature of training rollouts (> 0)')
    max_completion_length: int = flag(16, 'most tokens in one reply')
    learning_rate: float = flag(2e-5, 'AdamW learning rate')
    warmup_ratio: float = flag(0.0, 'share of --max_steps in which the rate rises linearly from 0')
    micro_batch_size: int = flag(8, 'trajectory segments per forward/backward: memory, not math')
    share_prompt: bool = flag(True, 'compute shared prompts once: the same gradients, less work')
    gradient_checkpointing: bool = flag(True, 'recompute activations: less memory, ~1.2x the time')
    max_grad_norm: float = flag(1.0, 'gradient clipping')
    warm_start_learning_rate: Optional[float] = flag(None, 'not given: --learning_rate')
    warm_start_steps: int = flag(0, "supervised steps on Env.expert_reply's games before GRPO")
    warm_start_generations: int = flag(1, "the expert's games per picked row (column expert_game)")
    # ---- run ----
    max_steps: int = flag(26, 'optimizer steps')
    eval_steps: int = flag(0, 'evaluate every N steps and after a warm start (0: at start and end)')
    eval_size: int = flag(256, 'most held-out rows to evaluate on (0: no evaluation)')
    eval_temperature: float = flag(0.0, 'sampling temperature of evaluation (0: greedy)')
    eval_only: bool = flag(False, 'evaluate --model and stop')
    save_steps: int = flag(20, 'checkpoint every N steps (and at the end)')
    save_only_model: bool = flag(False, "checkpoints without AdamW's state (a third of the "
                                 'size; --resume then starts AdamW afresh)')
    output_dir: str = flag('output', 'metrics, completions, checkpoints, plot')
    resume: bool = flag(False, 'continue from the latest checkpoint in --output_dir')
    seed: int = flag(0, "picks each step's rows; seeds vLLM's sampler and torch")
    report_to: List[str] = flag([], 'dashboards beside metrics.jsonl: tensorboard, wandb (offline)')


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
    """A command line of Args' fields (all, or those named), each help ending with its default (if
    None, the help says what it means). A flag not given parses to None: `parse_args` fills it."""
    kinds = {bool: {'type': truth, 'metavar': 'true|false'}, Optional[str]: {'type': str},
             Optional[float]: {'type': float}, Optional[List[float]]: {'nargs': '*', 'type': float},
             List[str]: {'nargs': '*'}, Optional[List[str]]: {'nargs': '*'}}  # else: the type
    out = argparse.ArgumentParser(description=description)
    for f in fields(Args):
        if names is not None and f.name not in names:
            continue
        default = f.default_factory() if f.default is MISSING else f.default
        text = f.metadata['help'] + ('' if default is None else f' (default: {shown(default)})')
        text += ''.join(f" ({name}'s train_defaults: {shown(env.train_defaults[f.name])})"
                        for name, env in sorted(envs.items()) if f.name in env.train_defaults)
        out.add_argument('--' + f.name, *(['--env'] if f.name == 'gym_env' else []),
                         help=text.replace('%', '%%'),  # argparse formats help strings with %
                         **kinds.get(f.type, {'type': f.type}))
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
    'max_turns': (1, 'at least one reply'), 'vllm_max_model_len': (2, 'at least 2'),
    'num_generations': (2, 'a group needs at least 2 trajectories'),
    **dict.fromkeys(['rows_per_step', 'max_completion_length', 'num_iterations', 'micro_batch_size',
                     'warm_start_generations', 'save_steps', 'lora_rank', 'lora_alpha',
                     'rollout_importance_sampling_threshold'], (1, 'at least 1')),
    **dict.fromkeys(['max_steps', 'warm_start_steps', 'eval_steps', 'eval_size', 'beta', 'epsilon',
                     'eval_temperature', 'vllm_kv_cache_gib', 'max_resample_times'],
                    (0, 'not negative')),
}

CHOICES = {
    'vllm_mode': ['colocate', 'server'], 'engine': ['auto', 'vllm', 'hf'],
    'tuner_type': ['full', 'lora'], 'loss_type': ['bnpo', 'grpo', 'dr_grpo', 'dapo'],
    'advantage_estimator': ['grpo', 'rloo', 'gigpo'], 'device': ['auto', 'cpu', 'cuda'],
    'scale_rewards': [None, 'group', 'batch', 'none'], 'torch_dtype': ['float32', 'bfloat16'],
    'importance_sampling_level': ['token', 'sequence'],
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
        raise UserError(f'{dataset}: --split_dataset_ratio {ratio} holds out all {len(rows)} rows')
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
            raise UserError(f'--report_to {name}: not installed (pip install {name})')


def check_game(args):
    """The checks train.py and server.py share: flags, model folder, plugins, scheduler, env."""
    check_flags(args)
    if args.device == 'cuda':
        import torch  # here only: the other checks need no torch
        if not torch.cuda.is_available():
            raise UserError('--device cuda: torch sees no CUDA device (torch.cuda.is_available())')
    if args.model and not os.path.isdir(args.model) and args.model.startswith(('/', '.', '~')):
        raise UserError(f'--model {args.model}: no such folder')
    load_plugins(args.external_plugins)
    for option, registry in (('multi_turn_scheduler', multi_turns), ('gym_env', envs)):
        if getattr(args, option) not in registry:
            raise UserError(f'--{option} {getattr(args, option)}: not registered; registered: '
                            f'{", ".join(sorted(registry))}')
    name, cls = args.multi_turn_scheduler, multi_turns[args.multi_turn_scheduler]
    if not (isinstance(cls, type) and issubclass(cls, MultiTurnScheduler)):
        raise UserError(f"--multi_turn_scheduler {name}: multi_turns['{name}'] is {cls!r}, "
                        'not a MultiTurnScheduler subclass')


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
    scheduler = multi_turns[args.multi_turn_scheduler]
    plays_env = issubclass(scheduler, GYMScheduler)
    env_cls = envs[args.gym_env] if plays_env else Env
    rows = load_dataset(args.dataset, args.gym_env, plays_env)
    if hasattr(scheduler, 'check_rows'):  # e.g. its servers answer
        scheduler.check_rows(rows)
    games = args.rows_per_step * args.num_generations
    if args.warm_start_steps and args.warm_start_generations > games:
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
    train_rows, eval_rows = held_out(rows, env_cls if plays_env else None, args.eval_size,
                                     args.split_dataset_ratio, args.dataset)
    own = eval_rows if train_rows is rows else []  # the env's own held-out rows, not the dataset's
    names, weights = reward_setup(args, env_cls, {args.dataset: rows, 'the held-out rows': own})
    if args.rows_per_step > len(train_rows):
        raise UserError(f'--rows_per_step {args.rows_per_step}: there are {len(train_rows)} '
                        f'training rows in {args.dataset}')
    return Task(train_rows, eval_rows, env_cls, names, weights)


def reward_setup(args: Args, env_cls, rows: dict):
    """The reward columns (--reward_funcs, then the gym reward) and their weights; with neither
    flag, the env's `default_reward_funcs` (a plugin env gets no FrozenLake reward). An `orms` class
    (ms-swift's) is made once, with args; each of `rows` ({where: rows}) needs its columns."""
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
