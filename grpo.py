"""GRPO, compactly: rewards -> group-relative advantages -> the clipped surrogate loss.

Implements "--use_gym_env" and "5. （可选）叠加自定义 reward" of the GYM-env document.
1. Reward columns: one per `--reward_funcs` name (registered in env.reward_funcs by the task's
   file), then the env's `total_reward` last; the reward r_i is their `--reward_weights` sum.
2. Advantage over a row's group of G trajectories (errored ones left out):
       A_i = (r_i - mean_j r_j) / (std_j r_j + eps)
   rloo (arXiv 2402.14740): r_i minus the mean of the others; --scale_rewards divides by the std
   of the group, of the batch, or not at all (Dr. GRPO, arXiv 2503.20783).
3. `trainable`: the trajectories the update uses (one place decides).
4. Per sampled token t of trajectory i, with ratio = exp(logp - logp_old):
       loss_t = -w_t min(ratio A_i, clip(ratio, 1 - epsilon, 1 + epsilon_high) A_i) + beta KL_t,
       KL_t = exp(ref - logp) - (ref - logp) - 1   (k3, against the starting model)
   and loss = sum_t weight_t loss_t / denominator (`normaliser`, by --loss_type). w_t is 1 unless
   --rollout_importance_sampling_mode (TIS/MIS: the trainer's over the engine's probability).
   With --num_iterations 1, logp_old = logp: ratio is 1 and the clip never acts.
5. `token_logprobs`: logp of the sampled tokens under the model, from one `MicroBatch`.
Left out: entropy bonuses, other estimators (REINFORCE++), reward models.
"""
import json
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch.utils.checkpoint import checkpoint

from env import reward_funcs


OVERLONG = ('length', 'context_limit')  # stop reasons of a trajectory cut by a length limit


# ---------------------------------------------------------------- 1-3: rewards, advantages, who trains

def reward_columns(trajectories, funcs: List[str], use_gym_env: bool) -> torch.Tensor:
    """(N, K): the --reward_funcs columns, then the gym `total_reward` column last."""
    rows = [[reward_funcs[name](t.request.messages) for name in funcs]
            + ([float(t.rollout_infos.get('total_reward', 0.0))] if use_gym_env else []) for t in trajectories]
    return torch.tensor(rows, dtype=torch.float32)


def group_advantages(rewards: torch.Tensor, group_size: int, valid: torch.Tensor = None, estimator: str = 'grpo',
                     scale: str = 'group', eps: float = 1e-4) -> torch.Tensor:
    """(N,) rewards, consecutive groups of group_size -> (N,) advantages (stds are sample stds).

    Only valid members (valid: (N,) bool; default all) enter the means and stds, and an invalid
    member gets A = 0: a trajectory whose env raised says nothing about the policy. A group with
    fewer than two valid members gets A = 0 throughout."""
    # BEGIN SOLUTION exercise 2: group-relative advantages
    v = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    r, g = rewards.view(-1, group_size), v.view(-1, group_size).float()  # (groups, G)
    n = g.sum(1, keepdim=True)  # (groups, 1) valid members
    centred = r - (r * g).sum(1, keepdim=True) / n.clamp(min=1)  # r - group mean
    if scale == 'group':
        std = (centred ** 2 * g).sum(1, keepdim=True).div((n - 1).clamp(min=1)).sqrt()  # (groups, 1)
    elif scale == 'batch':
        std = rewards[v].std() if v.sum() > 1 else torch.tensor(0.0)
    else:  # 'none'
        std, eps = torch.tensor(1.0), 0.0
    if estimator == 'rloo':  # r_i minus the mean of the other valid members
        centred = centred * n / (n - 1).clamp(min=1)
    advantages = torch.where(g.bool() & (n >= 2), centred / (std + eps), 0.0)  # (groups, G)
    return advantages.view(-1)  # (N,)
    # END SOLUTION


def with_spread(rewards: torch.Tensor, group_size: int, valid: torch.Tensor) -> torch.Tensor:
    """(N,) bool: valid members of groups whose valid rewards are not all equal."""
    r, v = rewards.view(-1, group_size), valid.view(-1, group_size)  # (groups, G)
    high = torch.where(v, r, torch.tensor(-float('inf'))).max(1).values
    low = torch.where(v, r, torch.tensor(float('inf'))).min(1).values
    spread = (v.sum(1) >= 2) & (high > low)  # (groups,)
    return spread.repeat_interleave(group_size) & valid


def valid(trajectories) -> torch.Tensor:
    """(N,) bool: the trajectories whose env did not raise."""
    return torch.tensor([t.stop_reason != 'error' for t in trajectories])


def trainable(trajectories, rewards: torch.Tensor, group_size: int, beta: float, overlong_filter: bool) -> List[int]:
    """The one place that decides which trajectories the update trains on:
    - never one whose env raised (it counts in no group either);
    - with beta = 0, none of a group without reward spread: A = 0 there, so they would add
      nothing to the gradient, only tokens to the normaliser and time to the update (DAPO's
      "dynamic sampling" without its refill; --dynamic_sample adds the refill, train.play);
    - with --overlong_filter, none cut by a length limit (they still count in their group's baseline);
    - never one without a sampled token."""
    ok = valid(trajectories)  # (N,)
    keep = with_spread(rewards, group_size, ok) if not beta else ok
    return [i for i in keep.nonzero().flatten().tolist()
            if any(m for s in trajectories[i].segments for m in s.loss_mask)
            and not (overlong_filter and trajectories[i].stop_reason in OVERLONG)]


def step_advantages(trajectories, group_size: int, gamma: float, scale: str, eps: float = 1e-4) -> torch.Tensor:
    """(N, T) GiGPO's step-level advantages (arXiv 2505.10978): turn k of trajectory i is judged
    by its discounted return from then on, G = r_k + gamma r_k+1 + ..., against the returns of
    every turn in its group that started from the same env state (an anchor state: the env's
    `state_key` before each reply, in rollout_infos['states']). A state met once gets 0."""
    # BEGIN SOLUTION exercise 6: step-level credit (GiGPO)
    out = torch.zeros(len(trajectories), max([t.num_turns for t in trajectories] + [1]))  # (N, T)
    for start in range(0, len(trajectories), group_size):
        anchors = {}  # state -> [(trajectory, turn, return)]
        for i in range(start, start + group_size):
            infos, returns = trajectories[i].rollout_infos, [0.0]
            if trajectories[i].stop_reason == 'error':
                continue
            for r in reversed(infos.get('step_rewards', [])):
                returns.insert(0, r + gamma * returns[0])
            for k, (state, g) in enumerate(zip(infos.get('states', []), returns[:-1])):
                anchors.setdefault(json.dumps(state), []).append((i, k, g))
        for members in anchors.values():
            g = torch.tensor([m[2] for m in members])  # (n,)
            a = (g - g.mean()) / (g.std() + eps) if scale == 'group' and len(g) > 1 else g - g.mean()
            for (i, k, _), value in zip(members, a.tolist()):
                out[i, k] = value
    return out
    # END SOLUTION


@dataclass
class Scores:
    """What step 2 of a training step computes from a batch of trajectories."""
    columns: torch.Tensor  # (N, K) reward columns
    rewards: torch.Tensor  # (N,) their weighted sum
    advantages: torch.Tensor  # (N,) group-relative advantages
    turn_advantages: torch.Tensor  # (N, T) each turn's: the trajectory's, plus gigpo's step-level one
    train: List[int]  # the trajectories the update uses


def score(trajectories, names, weights, *, use_gym_env: bool, group_size: int, beta: float, estimator: str = 'grpo',
          scale: str = 'group', overlong_filter: bool = False, step_advantage_w: float = 1.0, gamma: float = 0.95) -> Scores:
    columns = reward_columns(trajectories, names, use_gym_env)  # (N, K)
    rewards = columns @ torch.tensor(weights)  # (N,)
    ok = valid(trajectories)
    advantages = group_advantages(rewards, group_size, ok, 'rloo' if estimator == 'rloo' else 'grpo', scale)  # (N,)
    turns = advantages.unsqueeze(1).expand(-1, max([t.num_turns for t in trajectories] + [1]))  # (N, T)
    if estimator == 'gigpo':
        turns = turns + step_advantage_w * step_advantages(trajectories, group_size, gamma, scale)
    return Scores(columns, rewards, advantages, turns, trainable(trajectories, rewards, group_size, beta, overlong_filter))


# ---------------------------------------------------------------- 4: the loss

def normaliser(loss_mask: torch.Tensor, loss_type: str, num_trajectories: int, num_tokens: int, max_sampled: int,
               trajectory_tokens: torch.Tensor = None):
    """(token weights (b, T), denominator) of the loss for --loss_type: bnpo/dapo: each sampled
    token weighs 1, over the batch's sampled tokens (DAPO, arXiv 2503.14476); grpo: each
    trajectory's mean, then the mean over trajectories; dr_grpo: over trajectories x the most
    tokens a trajectory can sample. The counts are the whole batch's, so micro-batches add up to
    one big batch. trajectory_tokens: (b, 1) sampled tokens of each row's whole trajectory
    (default: the row's own)."""
    mask = loss_mask.float()
    if loss_type == 'grpo':
        per_trajectory = mask.sum(1, keepdim=True) if trajectory_tokens is None else trajectory_tokens.float()
        return mask / per_trajectory.clamp(min=1), num_trajectories
    return mask, num_trajectories * max_sampled if loss_type == 'dr_grpo' else num_tokens  # bnpo, dapo


def rollout_is_weights(old_logprobs, engine_logprobs, loss_mask, mode: str, threshold: float):
    """(B, T) detached weights pi_trainer / pi_engine of the sampled tokens (token modes) or of
    each sequence (sequence modes: the geometric mean), truncated at or masked above threshold;
    and the share of sampled tokens whose weight was truncated or masked."""
    mask = loss_mask.float()
    log_w = (old_logprobs - engine_logprobs) * mask  # (B, T)
    if mode.startswith('sequence'):
        log_w = (log_w.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(log_w)
    w = torch.exp(log_w).detach()
    over = (w > threshold) & loss_mask.bool()
    w = w.clamp(max=threshold) if mode.endswith('truncate') else w * ~over
    return w, (over.sum() / mask.sum().clamp(min=1)).item()


def grpo_loss(logprobs, old_logprobs, advantages, loss_mask, *, epsilon=0.2, epsilon_high=None, beta=0.0,
              ref_logprobs=None, token_weights=None, denominator=None, level='token', is_weights=None):
    """The clipped surrogate (+ beta * k3 KL), weighted sum over sampled tokens / denominator.

    logprobs, old_logprobs, ref_logprobs, loss_mask, token_weights, is_weights: (B, T);
    advantages: (B, T), each token's, or (B,), one per sequence. Defaults: token_weights =
    loss_mask, denominator = its sum (`normaliser` gives the others).
    Returns (loss, {'kl': mean KL, 'clip_ratio': share of tokens whose ratio was clipped}).
    """
    # BEGIN SOLUTION exercise 3: the clipped surrogate loss with the k3 KL
    mask = loss_mask.float()
    weights = mask if token_weights is None else token_weights
    n = mask.sum().clamp(min=1) if denominator is None else denominator
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    log_ratio = logprobs - old_logprobs  # (B, T)
    if level == 'sequence':  # GSPO (arXiv 2507.18071): one ratio per sequence, the geometric mean
        log_ratio = ((log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(mask)
    ratio = torch.exp(log_ratio)
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)  # (B, T) or (B, 1)
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)  # (B, T)
    if is_weights is not None:
        per_token = per_token * is_weights
    kl = torch.zeros_like(per_token)
    if beta:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
    loss = (per_token * weights).sum() / n
    stats = {'kl': ((kl * weights).sum() / n).item(), 'clip_ratio': (((ratio != clipped).float() * weights).sum() / n).item()}
    return loss, stats
    # END SOLUTION


# ---------------------------------------------------------------- 5: micro-batches and token logprobs

@dataclass
class MicroBatch:
    """The segments of one forward/backward and what the loss needs of them: every (b, T) tensor
    holds one segment a row, right-padded; the model's own input may be packed (`pack`)."""
    input_ids: torch.Tensor  # (R, P) what the model reads: the b segments, or them packed into R = 1 row
    attention_mask: torch.Tensor  # (R, P), or (1, 1, P, P) when packed
    position_ids: Optional[torch.Tensor]  # (R, P) when packed; None: 0, 1, 2, ... in each row
    predictor: torch.Tensor  # (b, T) the input position (flattened R x P) whose output predicts each token
    targets: torch.Tensor  # (b, T) each segment's token ids
    loss_mask: torch.Tensor  # (b, T) 1 on sampled tokens
    engine_logprobs: torch.Tensor  # (b, T) the engine's logprobs of the sampled tokens
    advantages: torch.Tensor  # (b, T) each sampled token's advantage
    token_weights: torch.Tensor  # (b, T) and
    denominator: float  # ... the loss normaliser (`normaliser`)


MAX_PACKED = 2048  # tokens of a packed row: its attention is a P x P matrix per head and layer


def shared_prefix(a, b) -> int:
    """The length of the longest common prefix of two token lists."""
    return next((p for p, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def pack(segments):
    """(input_ids (1, P), 4D attention mask, position_ids (1, P), predictor (b, T)) of the segments
    packed into one row in which every distinct prefix appears once: each segment adds only what
    follows its longest common prefix with the one before (sorted segments make this a prefix
    tree in depth-first order). A token attends to its own segment's earlier tokens, at the
    positions it has there, so every output equals the plain forward's, and a group's shared
    prompt is computed once, gradients included (Prefix Grouper, arXiv 2506.05433, shares one
    prefix per group; the tree also shares the system prompt across groups)."""
    tokens, positions, rows, cols, predictor = [], [], [], [], []
    before, path = [], []  # the previous segment, and where each of its tokens sits in the row
    width = max(len(s.token_ids) for s in segments)
    for s in segments:
        x = s.token_ids
        shared = shared_prefix(before, x)
        path = path[:shared] + list(range(len(tokens), len(tokens) + len(x) - shared))
        for p in range(shared, len(x)):  # a new token sees the tokens of its segment up to itself
            rows += [path[p]] * (p + 1)
            cols += path[:p + 1]
        tokens += x[shared:]
        positions += range(shared, len(x))
        predictor.append([0] + [path[t - 1] for t in range(1, len(x))] + [0] * (width - len(x)))  # token t from t-1
        before = x
    mask = torch.full((len(tokens), len(tokens)), torch.finfo(torch.float32).min)
    mask[rows, cols] = 0.0  # (P, P): 0 where attention is allowed
    return torch.tensor([tokens]), mask[None, None], torch.tensor([positions]), torch.tensor(predictor)


def micro_batches(trajectories, advantages: torch.Tensor, *, size: int, pad_id: int, loss_type: str,
                  num_tokens: int, max_sampled: int, share_prompt: bool = False) -> List[MicroBatch]:
    """Every segment of the trajectories, `size` at a time. advantages: (N, T), each trajectory's
    per turn (a sampled token takes its turn's), or (N,), one per trajectory;
    num_tokens: the normaliser's token count. share_prompt: sort by token ids, so that a group's
    members (which share their prompt) are neighbours, and pack each micro-batch (`pack`);
    otherwise shortest first, for less padding."""
    rows = [(i, s) for i, t in enumerate(trajectories) for s in t.segments]
    rows.sort(key=(lambda row: row[1].token_ids) if share_prompt else (lambda row: len(row[1].token_ids)))
    sampled = [sum(sum(s.loss_mask) for s in t.segments) for t in trajectories]  # per trajectory
    per_turn = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)  # (N, T)
    chunks, packed = [], 0  # at most `size` segments a micro-batch; packed, at most MAX_PACKED tokens
    for k, (i, s) in enumerate(rows):
        new = len(s.token_ids) - (shared_prefix(rows[k - 1][1].token_ids, s.token_ids) if k and share_prompt else 0)
        if not chunks or len(chunks[-1]) == size or (share_prompt and packed + new > MAX_PACKED):
            chunks.append([])
            new, packed = len(s.token_ids), 0
        chunks[-1].append((i, s))
        packed += new
    batches = []
    for chunk in chunks:
        width = max(len(s.token_ids) for _, s in chunk)

        def pad(values, fill):
            return torch.tensor([getattr(s, values) + [fill] * (width - len(s.token_ids)) for _, s in chunk])
        targets, loss_mask = pad('token_ids', pad_id), pad('loss_mask', 0)  # (b, T)
        if share_prompt:
            input_ids, attention_mask, position_ids, predictor = pack([s for _, s in chunk])
        else:
            input_ids, position_ids = targets, None
            attention_mask = torch.tensor([[1] * len(s.token_ids) + [0] * (width - len(s.token_ids)) for _, s in chunk])
            predictor = torch.arange(targets.numel()).view(targets.shape) - 1  # (b, T): the position before
        weights, denominator = normaliser(loss_mask, loss_type, len(trajectories), num_tokens, max_sampled,
                                          torch.tensor([[sampled[i]] for i, _ in chunk]))
        batches.append(MicroBatch(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, predictor=predictor,
            targets=targets, loss_mask=loss_mask, engine_logprobs=pad('logprobs', 0.0),
            advantages=per_turn[[i for i, _ in chunk]].gather(1, (pad('turns', 0) - 1).clamp(0, per_turn.shape[1] - 1)),
            token_weights=weights, denominator=denominator))
    return batches


def token_logprobs(model, batch: MicroBatch, temperature: float = 1.0, chunk: int = 256) -> torch.Tensor:
    """(b, T) log-probabilities of the batch's tokens under the model (softmax(logits /
    temperature)), on the loss-mask positions only, 0 elsewhere.

    The vocabulary is large (49,152 for SmolLM2), so logits are computed only where a token was
    sampled, `chunk` rows at a time under activation checkpointing: memory is then chunk x vocab,
    not batch x length x vocab.
    """
    # BEGIN SOLUTION exercise 4: token logprobs
    hidden = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 position_ids=batch.position_ids, use_cache=False).last_hidden_state  # (R, P, H)
    picked = batch.loss_mask.bool()  # (b, T)
    h, targets = hidden.flatten(0, 1)[batch.predictor[picked]], batch.targets[picked]  # (M, H), (M,)
    head = model.get_output_embeddings()

    def chunk_logprobs(h, targets):
        logits = head(h).float() / temperature  # (c, V)
        return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)  # (c,)

    pieces = [checkpoint(chunk_logprobs, h[i:i + chunk], targets[i:i + chunk], use_reentrant=False)
              for i in range(0, len(targets), chunk)]
    out = torch.zeros(batch.targets.shape, dtype=torch.float32, device=batch.targets.device)  # (b, T)
    out[picked] = torch.cat(pieces) if pieces else h.new_zeros(0)
    return out
    # END SOLUTION
