"""One GRPO step worked by hand: `python worked_step.py` (no model, about a second).

Four scripted walks play one FrozenLake map (the real env), and the real functions of grpo.py
compute each formula of README's "The algorithm" in turn, so this cannot drift from the trainer:
1. rewards; 2. advantages (GRPO's, RLOO's, GiGPO's step-level ones); 3. the loss (beta 0: no KL,
step 4) and which way each walk's tokens are pushed; 5. each --loss_type's weight of a token
(dapo's is bnpo's); then a second pass, where the clip acts. Step 6 drops nothing: every A != 0.
A reply counts one token per four characters, plus one (a real tokenizer splits differently).
"""
import argparse
import asyncio

import torch

import batching
import grpo
from env import RolloutInferRequest
from frozen_lake import MOVES, FrozenLakeEnv
from trajectory import Segment, Trajectory

WALKS = {  # seed 0: S at row 2, column 1; G at the bottom right; holes top left and in row 3
    'A': ['down', 'down', 'right', 'right', 'right'],  # the shortest way to G
    'B': ['right', 'right', 'down'],  # toward G, into the hole in row 3
    'C': ['up'],  # straight into the hole above S
    'D': ['hmm', 'down', 'right', 'hmm', 'hmm'],  # unreadable replies, and out of turns
}
PROMPT = 30  # tokens of the prompt (system message and first board), mask 0


async def play(replies, seed=0, max_turns=5) -> Trajectory:
    """One walk through the env, recorded as the scheduler records one (tokens counted roughly)."""
    env = FrozenLakeEnv({'seed': seed})
    observation, info, system = await env.reset(RolloutInferRequest([]))
    messages = [{'role': 'system', 'content': system}, {'role': 'user', 'content': observation}]
    turns, rewards, states = [0] * PROMPT, [], [env.state_key()]
    for turn, word in enumerate(replies[:max_turns], 1):
        reply = f'<action>{word}</action>' if word in MOVES else word
        turns += [turn] * (len(reply) // 4 + 1)  # the reply's tokens, its end-of-turn one included
        messages.append({'role': 'assistant', 'content': reply})
        observation, reward, done, _ = await env.step(messages)
        rewards.append(reward)
        states.append(env.state_key())
        messages.append({'role': 'user', 'content': observation})
        if done:
            break
    segment = Segment(token_ids=list(turns), loss_mask=[int(k > 0) for k in turns],
                      logprobs=[0.0] * len(turns), turns=turns)  # the ids: any would do
    infos = {'total_reward': sum(rewards), 'step_rewards': rewards, 'states': states,
             'reset_info': info}
    return Trajectory(RolloutInferRequest(messages), [segment], infos,
                      'done' if done else 'max_turns', turn, messages)


def table(title, header, rows):
    print(f'\n{title}\n  ' + ' '.join(f'{h:>12}' for h in header))
    for row in rows:
        print('  ' + ' '.join(f'{v:>12.4f}' if isinstance(v, float) else f'{v!s:>12}' for v in row))


def rewards_and_advantages(group, names, gamma: float) -> grpo.Scores:
    """Steps 1 and 2, with GiGPO's step-level advantages beside."""
    table('The group: one map, four walks of at most 5 replies (cells: row and column from 0)',
          ['walk', 'replies', 'tokens', 'ends', 'cells'],
          [(k, t.num_turns, t.num_sampled, t.stop_reason,
            ' '.join(f'{r}{c}' for r, c in t.rollout_infos['states']))
           for k, t in zip(names, group)])
    scores = grpo.score(group, ['progress'], [0.5, 1.0], use_gym_env=True, group_size=4, beta=0.0)
    table('1. Reward: r = 0.5 progress + 1 gym', ['walk', 'progress', 'gym', 'r'],
          [(k, *c.tolist(), r) for k, c, r in zip(names, scores.columns, scores.rewards.tolist())])
    rloo = grpo.group_advantages(scores.rewards, 4, estimator='rloo', scale='none')
    table('2. Advantage: grpo (r - mean) / (sample std + 1e-4); rloo: r - the mean of the others',
          ['walk', 'grpo', 'rloo'], zip(names, scores.advantages.tolist(), rloo.tolist()))
    shaped = grpo.turn_rewards(group, ['progress'], [0.5, 1.0], use_gym_env=True)
    table("   each turn's share of r: 0.5 x its change of progress + its gym step reward",
          ['walk'] + [f'turn {k + 1}' for k in range(max(len(r) for r in shaped))],
          [(k, *[f'{v:+.3f}' for v in r]) for k, r in zip(names, shaped)])
    try:
        step = grpo.step_advantages(group, 4, gamma=gamma, scale='group', step_rewards=shaped)
    except NotImplementedError as e:  # a student copy: exercise 6 need not come before the loss
        print(f'\n   gigpo: {e}: not written yet (worked_step.txt has its table)')
        return scores
    table(f'   gigpo adds, per turn: its return from these, discounted, against the turns '
          f'from the same cell (gamma {gamma})',
          ['walk'] + [f'turn {k + 1}' for k in range(step.shape[1])],
          [(k, *[f'{v:+.3f}' if j < t.num_turns else '' for j, v in enumerate(row.tolist())])
           for k, t, row in zip(names, group, step)])
    return scores


def the_loss(group, names, scores: grpo.Scores):
    """Steps 3-5: the first pass (ratio 1), each --loss_type's token weights, a second pass."""
    (b,) = batching.micro_batches(group, scores.turn_advantages, size=4, pad_id=0)  # shortest first
    order = sorted(names, key=lambda k: len(group[names.index(k)].segments[0].token_ids))
    counts, budget = grpo.count(group, scores), 4 * 5 * 16  # trajectories x max_turns x 16 tokens

    def first(x, i):  # row i's value at its first sampled token
        return x[i][b.loss_mask[i].bool()][0].item()

    def loss_of(logprobs, old):  # bnpo's
        per_token, _, clipped = grpo.token_loss(logprobs, old, b.advantages, b.loss_mask)
        return grpo.aggregate(per_token, b.loss_mask, b.trajectory_tokens, 'bnpo',
                              counts.denominator('bnpo', budget)), clipped
    logprobs = torch.full(b.loss_mask.shape, -0.5, requires_grad=True)  # any values: ratio 1
    loss, _ = loss_of(logprobs, logprobs.detach())
    loss.backward()
    table(f'3. First pass: ratio 1, L_t = -A; the bnpo loss is {loss.item():+.4f}; gradient '
          "descent makes each walk's tokens (shortest walk first, as micro-batches are)",
          ['walk', 'A', 'd loss/d logp', ''],
          [(k, first(b.advantages, i), first(logprobs.grad, i),
            'likelier' if first(logprobs.grad, i) < 0 else 'less likely')
           for i, k in enumerate(order)])
    rows = []  # 5: the weight each --loss_type gives one sampled token, d loss / d L_t
    for loss_type in ('bnpo', 'grpo', 'dr_grpo'):
        values = torch.zeros_like(b.advantages, requires_grad=True)  # per-token losses L_t
        grpo.aggregate(values, b.loss_mask, b.trajectory_tokens, loss_type,
                       counts.denominator(loss_type, budget)).backward()
        rows.append([loss_type] + [first(values.grad, i) for i in range(4)])
    table(f'5. The weight of one sampled token ({counts.tokens:.0f} tokens, '
          f'{counts.trajectories:.0f} trajectories, dr_grpo budget {budget} = 4 x 5 turns x 16)',
          ['loss_type'] + order, rows)
    shift = torch.tensor([[-0.3], [0.1], [0.3], [0.3]]) * b.advantages.sign()  # C: the wrong way
    moved = (logprobs.detach() + shift).requires_grad_()
    loss, clipped = loss_of(moved, logprobs.detach())
    loss.backward()
    table('   A second pass (--num_iterations 2), the ratios moved (log-ratios -0.3, 0.1, 0.3, 0.3 '
          'times the sign of A): where min() takes the clipped term, no gradient',
          ['walk', 'A', 'ratio', 'clipped', 'd loss/d logp'],
          [(k, first(b.advantages, i), first(torch.exp(moved - logprobs), i),
            bool(first(clipped, i)), first(moved.grad, i)) for i, k in enumerate(order)])


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--gamma', type=float, default=0.95, help="GiGPO's discount (0.95)")
    gamma = parser.parse_args().gamma
    walks = [asyncio.run(play(replies)) for replies in WALKS.values()]
    try:
        the_loss(walks, list(WALKS), rewards_and_advantages(walks, list(WALKS), gamma))
    except NotImplementedError as e:  # a student copy (student_copy.py) before the exercises
        raise SystemExit(f'{e}: not written yet. The reference tables: worked_step.txt')
