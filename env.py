"""The GYM environment interface, its registries and plugin loading.

Implements "Gym 接口" and "3. 注册" of ms-swift's GYM-env page (ms-swift's
docs/source/Instruction/GRPO/DeveloperGuide/GYM环境训练.md; link in the README); config.py reads
the dataset of "4. 准备数据集".

1. An environment subclasses `Env` and implements three coroutines:
   `reset(config) -> (observation, info, system_message)`,
   `step(messages) -> (next_observation, reward, done, info)` and `close()`.
2. Its file registers it at import time: `envs['name'] = MyEnv`; extra reward columns go into
   `reward_funcs['name'] = fn` (fn(messages) -> float, of the whole conversation), beside it, or,
   written for ms-swift, into `orms['name'] = MyORM` (an `ORM` class, called once a batch);
   `fn.per_turn = True` says its value on the conversation so far depends only on where the game
   is, so that GiGPO may credit each reply with its change (`grpo.turn_rewards`).
3. `--external_plugins my_env.py` imports that file by path, so the registrations take effect.
4. Each dataset row carries `env_config` (config.load_dataset reads the rows); its `name`, when
   present, picks the env for that row and overrides `--gym_env`.

An env written for ms-swift runs here after changing only its import lines (README: "Write your
own env"). Left out: ms-swift's `ContextManager` and env vectorisation (one env object per
trajectory is what the document describes).
"""
import importlib.util
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

Messages = List[Dict[str, Any]]  # [{'role': 'system'|'user'|'assistant', 'content': str}, ...]
INVALID = ('invalid', 'invalid_action')  # statuses of an unreadable reply: ours, ms-swift's


class UserError(Exception):
    """Bad input from the user (a flag, a file, a row). The programs print it as one line."""


@dataclass
class RolloutInferRequest:
    """One trajectory's request, as `Env.reset` receives it.

    messages:  the conversation so far (the dataset row's `messages` at the start)
    data_dict: the row's other columns, e.g. {'env_config': {'seed': 3}}
    uuid:      unique per trajectory (the members of a GRPO group share data_dict, not uuid)
    """
    messages: Messages
    data_dict: Dict[str, Any] = field(default_factory=dict)
    uuid: str = field(default_factory=lambda: uuid.uuid4().hex)


class Env(ABC):
    """A multi-turn environment: one object per trajectory, created with the row's env_config.

    By convention an info dict with `status: 'invalid'` marks a reply the env could not read
    (ms-swift's FrozenLake says 'invalid_action'); train.py logs the share of the others.
    """

    # ---- optional task rules, read by train.py only (ms-swift ignores them) ----
    default_reward_funcs: Dict[str, float] = {}  # extra reward columns, weights (no --reward_funcs)
    tools: List[str] = []  # tools.tools names its trajectories may call (a row's `tools` overrides)
    train_defaults: Dict[str, Any] = {}  # train.py flag values where the command line gives none

    eval_seed_base: Optional[int] = None  # held-out rows: env_config seeds from this one on
    success_reward: Optional[float] = None  # a success: total_reward at least this

    @classmethod
    def eval_rows(cls, n: int, env_config: Dict[str, Any]) -> Optional[List[Dict[str, Any]]]:
        """n held-out rows to evaluate on, with the settings of a training row's env_config;
        None (no eval_seed_base): hold out rows of the training dataset."""
        if cls.eval_seed_base is None:
            return None
        return [{'messages': [], 'env_config': {**env_config, 'seed': cls.eval_seed_base + i}}
                for i in range(n)]

    @classmethod
    def is_success(cls, rollout_infos: Dict[str, Any]) -> Optional[bool]:
        """Whether a finished trajectory solved the task; None (no success_reward): evaluation
        gives the mean reward."""
        if cls.success_reward is None:
            return None
        return rollout_infos.get('total_reward', 0.0) >= cls.success_reward

    draw = None  # optional classmethod draw(ax, rollout_infos): a game on an axis (agent.png)

    def state_key(self):
        """A JSON-able key of the env's state now: --advantage_estimator gigpo compares the turns
        that start from equal keys. None: the observation text stands for the state."""
        return None

    def expert_reply(self, messages: Messages) -> Optional[str]:
        """What an expert would reply now, the conversation so far being `messages` (its last
        message is the env's observation, or a tool's answer). The conformance check plays it;
        --warm_start_steps learns from it. None: the env has no expert."""
        return None

    # ---- the interface of the document ----
    def __init__(self, env_config):
        """env_config comes from the dataset row's `env_config` column."""
        self.env_config = env_config

    @abstractmethod
    async def reset(self, config: RolloutInferRequest) -> Tuple[str, Dict[str, Any], str]:
        """Returns (observation: the first user message, info: logged, system_message)."""

    @abstractmethod
    async def step(self, action: Messages) -> Tuple[str, float, bool, Dict[str, Any]]:
        """`action` is the whole conversation so far; its last message is the model's newest reply.

        Returns (next_observation: the next user message, reward: this step's reward,
        done: whether the trajectory is over, info: logged)."""

    @abstractmethod
    async def close(self):
        """Release resources. Called exactly once per env, however its trajectory ended."""


class ORM:
    """ms-swift's reward class (`from swift.rewards import ORM, orms`), registered in `orms`:
    called once for a batch, `__call__(completions, **kwargs) -> List[float]`. completions: each
    trajectory's last reply; kwargs: every dataset column (the row's, a list with one value per
    trajectory; `solution`, `target`, `env_config`, ...), `messages` (each whole conversation)
    and `rollout_infos`. `args` is train.py's Args."""

    def __init__(self, args=None, **kwargs):
        self.args = args

    def __call__(self, completions, **kwargs) -> List[float]:
        raise NotImplementedError


class AsyncORM(ORM):
    """The same with `async def __call__`, for rewards that wait on I/O: it is awaited."""

    async def __call__(self, completions, **kwargs) -> List[float]:
        raise NotImplementedError


envs: Dict[str, Type[Env]] = {}
reward_funcs: Dict[str, Callable[[Messages], float]] = {}  # --reward_funcs names -> fn(messages)
orms: Dict[str, Type[ORM]] = {}  # --reward_funcs names -> an ORM class (ms-swift's protocol)


_loaded = set()  # the plugin files imported so far


def load_plugins(paths: List[str]) -> None:
    """Import each plugin file by path, once; its `envs['x'] = X` lines register its envs."""
    for path in paths:
        if Path(path).resolve() in _loaded:
            continue
        spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        if spec is None or not path.endswith('.py'):
            raise UserError(f'--external_plugins {path}: not a .py file')
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except FileNotFoundError:
            raise UserError(f'--external_plugins {path}: no such file') from None
        except Exception as e:
            raise UserError(f'--external_plugins {path}: import failed: {type(e).__name__}: '
                            f'{e}') from e
        _loaded.add(Path(path).resolve())


def env_name(row: Dict[str, Any], gym_env: str = None) -> str:
    """The env for a row: `env_config.name` when present, else the global --gym_env."""
    return (row.get('env_config') or {}).get('name') or gym_env
