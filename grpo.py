"""GRPO, compactly: rewards -> group-relative advantages -> per-token losses -> one number.

Implements "--use_gym_env" and "5. （可选）叠加自定义 reward" of the GYM-env document; the formulas
are the README's "The algorithm", steps 1-6, in that order:
1. `rewards`: one column per `--reward_funcs` name, the env's `total_reward` last; the reward
   is their `--reward_weights` sum.
2. `group_advantages` (and GiGPO's `step_advantages`): each trajectory against its group.
3-4. `token_loss`: the clipped surrogate and the k3 KL, per sampled token.
5. `aggregate`: the per-token losses summed and divided by `--loss_type`'s normaliser, whose
   count (`Counts`) is the whole batch's, so micro-batches and processes add up to one batch.
6. `Scores.trained`: which trajectories the update computes (the others add nothing).
`score` does 1, 2 and 6 for a step. Left out: entropy bonuses, REINFORCE++, reward models.
"""
import asyncio
import inspect
import json
from dataclasses import dataclass
from typing import List

import torch

from env import ORM, UserError, reward_funcs

OVERLONG = ('length', 'context_limit')  # stop reasons of a trajectory cut by a length limit


# ------------------------------------------------------ 1, 2, 6: rewards, advantages, who trains

def valid_mask(trajectories) -> torch.Tensor:
    """(N,) bool: the trajectories whose env did not raise."""
    return torch.tensor([t.stop_reason != 'error' for t in trajectories])


def rewards(trajectories, funcs: List[str], weights: List[float], use_gym_env: bool):
    """((N, K) reward columns, (N,) their weighted sum): the --reward_funcs columns, then the gym
    `total_reward` last. A function reads each whole conversation (`Trajectory.messages`); an ORM
    (ms-swift's protocol, env.ORM) scores the batch at once. A trajectory whose env raised scores
    0 (it counts in no group; its game may not have begun)."""
    ok = [i for i, t in enumerate(trajectories) if t.stop_reason != 'error']
    columns = torch.zeros(len(trajectories), len(funcs) + use_gym_env)  # (N, K)
    for k, name in enumerate(funcs):
        fn = reward_funcs[name]
        scored = [trajectories[i] for i in ok]
        values = [fn(t.messages) for t in scored] if not isinstance(fn, ORM) else (
            orm_call(fn, scored) if scored else [])
        columns[ok, k] = torch.tensor([float('nan') if v is None else float(v) for v in values])
    if use_gym_env:
        columns[:, -1] = torch.tensor([float(t.rollout_infos.get('total_reward', 0.0))
                                       for t in trajectories])
    return columns, columns.nan_to_num(0.0) @ torch.tensor(weights)  # None: no say (ms-swift's)


def orm_call(orm, trajectories) -> List[float]:
    """An ORM's rewards, called as ms-swift calls it: the last replies, then each dataset column,
    the conversations and the env's infos by keyword, a list each."""
    rows = [t.request.data_dict for t in trajectories]
    keys = dict.fromkeys(key for row in rows for key in row)  # every column, in order
    columns = {key: [row.get(key) for row in rows] for key in keys}
    completions = [next((m['content'] for m in t.messages[::-1] if m['role'] == 'assistant'), '')
                   for t in trajectories]
    values = orm(completions, **columns, messages=[t.messages for t in trajectories],
                 rollout_infos=[t.rollout_infos for t in trajectories])
    return asyncio.run(values) if inspect.isawaitable(values) else values


def check_columns(name: str, orm, rows, where: str):
    """Refuse, in one line, a row without a column the ORM's __call__ needs (its first parameter
    takes the completions, whatever its name; orm_call passes messages and rollout_infos too)."""
    params = [p for p in inspect.signature(orm.__call__).parameters.values()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    needed = [p.name for p in params[1:] if p.default is p.empty]
    for number, row in enumerate(rows, 1):
        missing = [c for c in needed if c not in ('messages', 'rollout_infos') and c not in row]
        if missing:
            raise UserError(f'--reward_funcs {name}: {type(orm).__name__}.__call__ needs the '
                            f"column '{missing[0]}', which row {number} of {where} does not have")


def group_advantages(rewards: torch.Tensor, group_size: int, valid: torch.Tensor = None,
                     estimator: str = 'grpo', scale: str = 'group', eps: float = 1e-4):
    """(N,) rewards, consecutive groups of group_size -> (N,) advantages.

    Only valid members (valid: (N,) bool; default all) enter a mean or a std, and an invalid
    member gets A = 0: a trajectory whose env raised says nothing about the policy. A group with
    fewer than two valid members gets A = 0 throughout. Every std is a *sample* std (n - 1).
    - centre: estimator 'grpo' subtracts the group's mean; 'rloo' the mean of the *other* valid
      members, which is the grpo centre times n / (n - 1);
    - scale: 'group' divides by (the group's std + eps), 'batch' by (the std of every valid
      reward of the batch + eps), 'none' by nothing (no eps either). The scale is the same for
      both estimators; the RLOO paper uses 'none' (ms-swift's default for rloo, and train.py's).
    A group whose rewards all agree comes out near 0 here; `score` then makes it exactly 0."""
    # BEGIN SOLUTION exercise 2: group-relative advantages
    member = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    r, m = rewards.view(-1, group_size), member.view(-1, group_size).float()  # (groups, G)
    n = m.sum(1, keepdim=True)  # (groups, 1) valid members
    centred = r - (r * m).sum(1, keepdim=True) / n.clamp(min=1)  # r - group mean
    if scale == 'group':
        std = ((centred ** 2 * m).sum(1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()  # (groups, 1)
    elif scale == 'batch':
        std = rewards[member].std() if member.sum() > 1 else torch.tensor(0.0)
    else:  # 'none'
        std, eps = torch.tensor(1.0), 0.0
    if estimator == 'rloo':  # r_i minus the mean of the other valid members
        centred = centred * n / (n - 1).clamp(min=1)
    advantages = torch.where(m.bool() & (n >= 2), centred / (std + eps), 0.0)  # (groups, G)
    return advantages.view(-1)  # (N,)
    # END SOLUTION


def with_spread(rewards: torch.Tensor, group_size: int, valid: torch.Tensor) -> torch.Tensor:
    """(N,) bool: valid members of groups whose valid rewards are not all equal."""
    r, v = rewards.view(-1, group_size), valid.view(-1, group_size)  # (groups, G)
    high = torch.where(v, r, torch.tensor(-float('inf'))).max(1).values
    low = torch.where(v, r, torch.tensor(float('inf'))).min(1).values
    spread = (v.sum(1) >= 2) & (high > low)  # (groups,)
    return spread.repeat_interleave(group_size) & valid


def turn_rewards(trajectories, funcs: List[str], weights: List[float], use_gym_env: bool,
                 columns: torch.Tensor = None):
    """Each trajectory's weighted reward split into its turns, for GiGPO: turn k earns the env's
    step reward and, for each --reward_funcs column whose function is marked `per_turn` (its value
    is a potential of where the game is, as FrozenLake's `progress`), how much that value changed
    with the k-th reply (from 0 before the first); any other column (`columns`, as `rewards` gives
    them) counts at the last turn. All weighted as in `rewards`, so that over a game they add up
    to its weighted reward."""
    columns = rewards(trajectories, funcs, weights, use_gym_env)[0] if columns is None else columns
    out = []
    for i, t in enumerate(trajectories):
        ends = [k + 1 for k, m in enumerate(t.messages) if m['role'] == 'assistant']
        gym = t.rollout_infos.get('step_rewards', [])
        turns = [weights[-1] * r if use_gym_env else 0.0 for r in gym]
        turns += [0.0] * (len(ends) - len(turns))  # a last reply the env never took (a tool call)
        out.append(turns)
        if not turns or t.stop_reason == 'error':
            continue
        for k, (w, name) in enumerate(zip(weights, funcs)):
            fn = reward_funcs[name]
            if getattr(fn, 'per_turn', False):
                values = [0.0] + [fn(t.messages[:end]) for end in ends[:-1]] + [fn(t.messages)]
                for turn in range(len(ends)):
                    turns[turn] += w * (values[turn + 1] - values[turn])
            else:
                turns[-1] += w * columns[i, k].nan_to_num(0.0).item()
    return out


def step_advantages(trajectories, group_size: int, gamma: float, scale: str,
                    eps: float = 1e-4, step_rewards=None) -> torch.Tensor:
    """(N, T) GiGPO's step-level advantages (arXiv 2505.10978): turn k of trajectory i is judged
    by its discounted return from then on, G = r_k + gamma r_k+1 + ..., against the returns of
    every turn in its group that started from the same env state (an anchor state: the env's
    `state_key` before each reply, in rollout_infos['states']). A state met once, or whose
    returns all agree, gets exactly 0; so does every turn of a trajectory whose env raised.
    step_rewards: each trajectory's r_k (`turn_rewards`); not given: the env's own,
    rollout_infos['step_rewards']."""
    # BEGIN SOLUTION exercise 6: step-level credit (GiGPO)
    out = torch.zeros(len(trajectories), max([t.num_turns for t in trajectories] + [1]))  # (N, T)
    for start in range(0, len(trajectories), group_size):
        anchors = {}  # state -> [(trajectory, turn, return)]
        for i in range(start, start + group_size):
            if trajectories[i].stop_reason == 'error':
                continue
            infos, future = trajectories[i].rollout_infos, [0.0]  # future[k]: return from turn k
            for r in reversed(step_rewards[i] if step_rewards else infos.get('step_rewards', [])):
                future.insert(0, r + gamma * future[0])
            for k, (state, ret) in enumerate(zip(infos.get('states', []), future[:-1])):
                anchors.setdefault(json.dumps(state), []).append((i, k, ret))
        for members in anchors.values():
            returns = torch.tensor([ret for _, _, ret in members])  # (n,)
            if returns.max() == returns.min():  # nothing to compare
                continue
            centred = returns - returns.mean()
            values = centred / (returns.std() + eps) if scale == 'group' else centred
            for (i, k, _), value in zip(members, values.tolist()):
                out[i, k] = value
    return out
    # END SOLUTION


@dataclass
class Scores:
    """What step 2 of a training step computes from a batch of trajectories."""
    columns: torch.Tensor  # (N, K) reward columns
    rewards: torch.Tensor  # (N,) their weighted sum
    advantages: torch.Tensor  # (N,) group-relative advantages
    turn_advantages: torch.Tensor  # (N, T) each turn's: the trajectory's, plus gigpo's step-level
    valid: torch.Tensor  # (N,) bool: the env did not raise
    in_loss: torch.Tensor  # (N,) bool: valid, and not left out by --overlong_filter
    trained: List[int]  # indices: the trajectories the update computes (README "The algorithm", 6)


def score(trajectories, names, weights, *, use_gym_env: bool, group_size: int, beta: float,
          estimator: str = 'grpo', scale: str = 'group', overlong_filter: bool = False,
          step_advantage_w: float = 1.0, gamma: float = 0.95, batch_std: float = None) -> Scores:
    """batch_std: with scale 'batch' under several processes, the std of every process's valid
    rewards (train.score_step gathers them, as ms-swift does), which replaces this process's own."""
    columns, reward = rewards(trajectories, names, weights, use_gym_env)  # (N, K), (N,)
    ok = valid_mask(trajectories)
    centre = 'rloo' if estimator == 'rloo' else 'grpo'
    advantages = group_advantages(reward, group_size, ok, centre,
                                  'none' if batch_std is not None else scale)
    if batch_std is not None:
        advantages = advantages / (batch_std + 1e-4)
    # A group whose rewards all agree gets exactly 0: the float mean of equal rewards need not
    # equal them, and that rounding, divided by a std near 0, would be trained on as a signal.
    advantages = advantages * with_spread(reward, group_size, ok)
    per_turn = advantages.unsqueeze(1).expand(-1, max([t.num_turns for t in trajectories] + [1]))
    if estimator == 'gigpo':  # (N, T)
        shaped = turn_rewards(trajectories, names, weights, use_gym_env, columns)
        per_turn = per_turn + step_advantage_w * step_advantages(trajectories, group_size, gamma,
                                                                 scale, step_rewards=shaped)
    cut = torch.tensor([overlong_filter and t.stop_reason in OVERLONG for t in trajectories])
    in_loss = ok & ~cut
    # Who is computed: with beta = 0 a trajectory whose every turn has A = 0 adds exactly 0 to the
    # loss and its gradient (it still counts in the normaliser, `Counts`), so the update skips it;
    # GiGPO's turns can be non-zero where the episode rewards agree, so this asks each turn.
    trained = [i for i, t in enumerate(trajectories)
               if in_loss[i] and t.num_sampled
               and (beta or per_turn[i, :max(t.num_turns, 1)].any())]
    return Scores(columns, reward, advantages, per_turn, ok, in_loss, trained)


# ------------------------------------------------------------------------ 3-5: the loss

def row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, 1): each row's mean of x over its mask-1 positions."""
    return (x * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)


def token_loss(logprobs, old_logprobs, advantages, loss_mask, *, epsilon=0.2, epsilon_high=None,
               beta=0.0, ref_logprobs=None, level='token', is_weights=None):
    """The per-token terms (B, T) of steps 3-4, before any aggregation: (loss_t, kl_t, clipped_t).

    logprobs, old_logprobs, ref_logprobs, loss_mask, is_weights: (B, T); advantages: (B, T), each
    token's, or (B,), one per row.
    - ratio_t = exp(logp_t - logp_old_t), logp_old a constant (detached); level 'sequence'
      (GSPO) gives every token of a row (one segment: one token sequence) the geometric mean of
      the ratios of that row's *sampled* tokens;
    - surrogate_t = -min(ratio_t A, clip(ratio_t, 1 - epsilon, 1 + epsilon_high) A), times the
      rollout importance weight w_t when given (it corrects the surrogate's sampling, not the KL);
      epsilon_high None means epsilon;
    - kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1 (k3), loss_t = surrogate_t + beta kl_t;
      with beta 0, kl_t = 0 and ref_logprobs may be None;
    - clipped_t: the clip acted, i.e. min() took the clipped term: ratio < 1 - epsilon with A < 0,
      or ratio > 1 + epsilon_high with A > 0 (TRL's clip_ratio/region).
    Values where loss_mask is 0 are computed but mean nothing; `aggregate` drops them."""
    # BEGIN SOLUTION exercise 3: the clipped surrogate loss with the k3 KL
    mask = loss_mask.float()
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    log_ratio = logprobs - old_logprobs.detach()  # (B, T); logp_old is a constant
    if level == 'sequence':  # GSPO (arXiv 2507.18071): one ratio per row, the geometric mean
        log_ratio = row_mean(log_ratio, mask).expand_as(mask)
    ratio = torch.exp(log_ratio)
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)  # (B, T) or (B, 1)
    surrogate = -torch.min(ratio * adv, ratio.clamp(1 - epsilon, 1 + epsilon_high) * adv)  # (B, T)
    if is_weights is not None:
        surrogate = surrogate * is_weights
    kl = torch.zeros_like(surrogate)
    if beta:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1
    clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))
    return surrogate + beta * kl, kl, clipped.expand_as(mask)
    # END SOLUTION


def aggregate(values, loss_mask, trajectory_tokens, loss_type: str, denominator) -> torch.Tensor:
    """One number from per-token values (B, T), README step 5. loss_mask: (B, T);
    trajectory_tokens: (B, 1) the sampled tokens of each row's whole trajectory; denominator:
    `Counts.denominator`, the whole batch's count, so that the sums of micro-batches and of
    processes add up to the batch's loss.
    - bnpo, dapo: sum_t L_t / the batch's sampled tokens (dapo's: --overlong_filter's too);
    - grpo: sum over trajectories of (sum_t L_t / that trajectory's tokens) / its trajectories;
    - dr_grpo: sum_t L_t / (trajectories x max_turns x max_completion_length)."""
    # BEGIN SOLUTION exercise 3: the clipped surrogate loss with the k3 KL
    per_token = values * loss_mask.float()  # (B, T)
    if loss_type == 'grpo':  # each trajectory's tokens weigh 1 in all
        per_token = per_token / trajectory_tokens.clamp(min=1)
    return per_token.sum() / denominator
    # END SOLUTION


@dataclass
class Counts:
    """What the normalisers count (README step 5), ms-swift's definitions: a trajectory with A = 0
    counts whether or not the update computes it. update.train_step adds up every process's."""
    tokens: float  # sampled tokens of the trajectories in the loss (bnpo)
    trajectories: float  # valid trajectories, those --overlong_filter leaves out included (grpo)
    sampled: float  # sampled tokens of every valid trajectory (dapo; the entropy and gap means)
    n_trained: float  # trajectories the update computes (none anywhere: no optimizer step)

    def denominator(self, loss_type: str, budget: float) -> float:
        """budget: the batch's trajectories x max_turns x max_completion_length (dr_grpo's)."""
        counts = {'bnpo': self.tokens, 'dapo': self.sampled, 'grpo': self.trajectories,
                  'dr_grpo': budget}
        return max(counts[loss_type], 1.0)


def count(trajectories, scores: Scores) -> Counts:
    """This process's counts."""
    n = [t.num_sampled for t in trajectories]
    return Counts(tokens=float(sum(k for k, ok in zip(n, scores.in_loss) if ok)),
                  trajectories=float(scores.valid.sum()),
                  sampled=float(sum(k for k, ok in zip(n, scores.valid) if ok)),
                  n_trained=float(len(scores.trained)))


def rollout_is_weights(old_logprobs, engine_logprobs, loss_mask, mode: str, threshold: float):
    """(B, T) detached weights pi_trainer / pi_engine of the sampled tokens, as ms-swift computes
    them: token_truncate caps each token's at threshold, token_mask zeroes those above it;
    sequence_truncate gives each row the geometric mean of its tokens' weights, capped;
    sequence_mask keeps the token weights of the rows whose geometric mean is within threshold
    and zeroes the others. And (B, T) bool: the sampled tokens whose weight was cut."""
    mask = loss_mask.float()
    log_w = ((old_logprobs - engine_logprobs) * mask).detach()  # (B, T)
    w = torch.exp(log_w)
    judged = torch.exp(row_mean(log_w, mask)).expand_as(w) if mode.startswith('sequence') else w
    over = (judged > threshold) & loss_mask.bool()
    return (judged.clamp(max=threshold) if mode.endswith('truncate') else w * ~over), over
