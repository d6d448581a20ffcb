"""GRPO, compactly: rewards -> group-relative advantages -> clipped surrogate loss, and its variants.

Implements "--use_gym_env" and "5. （可选）叠加自定义 reward" of the GYM-env document.
1. Reward columns: one per `--reward_funcs` name (registered in env.reward_funcs by the task's
   file), then the env's `total_reward` last; the reward is their `--reward_weights` sum.
2. Advantage over a row's group, leaving out trajectories whose env raised (README: "Variants"):
   grpo: A = (r - mean) / (std + eps);  rloo (arXiv 2402.14740): r minus the mean of the others,
   = G/(G-1) (r - mean);  --scale_rewards: std of the group, of the batch, or none (Dr. GRPO,
   arXiv 2503.20783). A group without spread has A = 0: `with_spread` picks the others.
3. Per sampled token (loss_mask 1), with ratio = exp(logp - logp_old):
       loss_t = -w_t min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A) + beta * KL_t
   KL_t: k3 estimator against the starting model. sequence level (GSPO, arXiv 2507.18071): one
   ratio per trajectory, exp(mean over its tokens of logp - logp_old). w_t (TIS/MIS, Yao et al.
   2025, "Your efficient RL framework secretly brings you off-policy RL training"): the trainer's
   over the engine's probability, truncated at or masked above a threshold; 1 when off.
4. The sum over tokens is divided by (--loss_type): bnpo/dapo: the batch's sampled tokens (DAPO,
   arXiv 2503.14476); grpo: each trajectory's own token count x trajectories; dr_grpo:
   trajectories x the most tokens a trajectory can sample. Computed once per batch.
Left out: entropy bonuses, other estimators (REINFORCE++), reward models.
"""
from typing import List

import torch
from torch.utils.checkpoint import checkpoint

from env import reward_funcs


OVERLONG = ('length', 'context_limit')  # stop reasons of a trajectory cut by a length limit


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


def with_spread(rewards: torch.Tensor, group_size: int, valid: torch.Tensor = None) -> List[int]:
    """Indices of the valid trajectories whose group's valid rewards are not all equal. The others
    have A = 0: with beta = 0 they add nothing to the gradient, only tokens to the normaliser and
    time to the update. Training on these alone is DAPO's "dynamic sampling" without its refill
    (--dynamic_sample adds the refill, train.play)."""
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    r, v = rewards.view(-1, group_size), valid.view(-1, group_size)  # (groups, G)
    high = torch.where(v, r, torch.tensor(-float('inf'))).max(1).values
    low = torch.where(v, r, torch.tensor(float('inf'))).min(1).values
    spread = (v.sum(1) >= 2) & (high > low)  # (groups,)
    return (spread.repeat_interleave(group_size) & valid).nonzero().flatten().tolist()


def rewards_and_advantages(trajectories, names, weights, use_gym_env: bool, group_size: int, beta: float,
                            estimator: str = 'grpo', scale: str = 'group', overlong_filter: bool = False):
    """(reward columns (N, K), rewards (N,), advantages (N,), indices to train on). A trajectory whose
    env raised counts in no group and is never trained on; with beta = 0 neither are groups without
    spread; with overlong_filter neither are trajectories cut by a length limit (they still count
    in their group's mean and std)."""
    columns = reward_columns(trajectories, names, use_gym_env)  # (N, K)
    rewards = columns @ torch.tensor(weights)  # (N,)
    valid = torch.tensor([t.stop_reason != 'error' for t in trajectories])  # (N,)
    advantages = group_advantages(rewards, group_size, valid, estimator, scale)  # (N,)
    keep = with_spread(rewards, group_size, valid) if not beta else valid.nonzero().flatten().tolist()
    return columns, rewards, advantages, [i for i in keep if any(trajectories[i].loss_mask) and not (
        overlong_filter and trajectories[i].stop_reason in OVERLONG)]


def normaliser(loss_mask: torch.Tensor, loss_type: str, num_trajectories: int, num_tokens: int, max_sampled: int):
    """(token weights (b, T), denominator) of the loss for --loss_type (module docstring, 4); the
    counts are the whole batch's, so micro-batches add up to one big batch."""
    mask = loss_mask.float()
    if loss_type == 'grpo':  # each trajectory's mean, then the mean over trajectories
        return mask / mask.sum(1, keepdim=True).clamp(min=1), num_trajectories
    return mask, num_trajectories * max_sampled if loss_type == 'dr_grpo' else num_tokens  # bnpo, dapo


def rollout_is_weights(old_logprobs, engine_logprobs, loss_mask, mode: str, threshold: float):
    """(B, T) detached weights pi_trainer / pi_engine of the sampled tokens (token modes) or of
    each trajectory (sequence modes: the geometric mean), truncated at or masked above threshold;
    and the share of sampled tokens whose weight was truncated or masked."""
    mask = loss_mask.float()
    log_w = (old_logprobs - engine_logprobs) * mask  # (B, T)
    if mode.startswith('sequence'):
        log_w = (log_w.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(log_w)
    w = torch.exp(log_w).detach()
    over = (w > threshold) & loss_mask.bool()
    w = w.clamp(max=threshold) if mode.endswith('truncate') else w * ~over
    return w, (over.sum() / mask.sum().clamp(min=1)).item()


def token_logprobs(model, input_ids, attention_mask, loss_mask, temperature: float = 1.0,
                   chunk: int = 256) -> torch.Tensor:
    """(B, T) log-probabilities of input_ids under the model (softmax(logits / temperature)), on the
    loss-mask positions only, 0 elsewhere.

    The vocabulary is large (49,152 for SmolLM2), so logits are computed only where a token was
    sampled, `chunk` rows at a time under activation checkpointing: memory is then chunk x vocab,
    not batch x length x vocab.
    """
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                 use_cache=False).last_hidden_state  # (B, T, H)
    picked = loss_mask[:, 1:].bool()  # (B, T-1): token t+1 is predicted from position t
    h, targets = hidden[:, :-1][picked], input_ids[:, 1:][picked]  # (M, H), (M,)
    head = model.get_output_embeddings()

    def chunk_logprobs(h, targets):
        logits = head(h).float() / temperature  # (c, V)
        return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)  # (c,)

    pieces = [checkpoint(chunk_logprobs, h[i:i + chunk], targets[i:i + chunk], use_reentrant=False)
              for i in range(0, len(targets), chunk)]
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)  # (B, T)
    out[:, 1:][picked] = torch.cat(pieces) if pieces else h.new_zeros(0)
    return out


def grpo_loss(logprobs, old_logprobs, advantages, loss_mask, epsilon=0.2, epsilon_high=None, beta=0.0,
              ref_logprobs=None, denominator=None, token_weights=None, level='token', is_weights=None):
    """The clipped surrogate (+ beta * k3 KL), weighted sum over loss-mask tokens / denominator.

    logprobs, old_logprobs, ref_logprobs, loss_mask, token_weights, is_weights: (B, T); advantages:
    (B,). Defaults: token_weights = loss_mask, denominator = its sum (`normaliser` gives the others).
    Returns (loss, {'kl': mean KL, 'clip_ratio': share of tokens whose ratio was clipped}).
    """
    mask = loss_mask.float()
    weights = mask if token_weights is None else token_weights
    n = mask.sum().clamp(min=1) if denominator is None else denominator
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    log_ratio = logprobs - old_logprobs  # (B, T)
    if level == 'sequence':  # GSPO: one ratio per trajectory
        log_ratio = ((log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(mask)
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1)  # (B, 1)
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
