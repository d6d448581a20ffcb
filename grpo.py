"""GRPO, compactly: rewards -> group-relative advantages -> clipped surrogate loss.

Implements "--use_gym_env" and "5. （可选）叠加自定义 reward" of the GYM-env document.

1. Reward columns per trajectory: one per `--reward_funcs` name (functions registered in
   env.reward_funcs by the task's file), then (with --use_gym_env) the env's `total_reward`
   last; the reward is their `--reward_weights`-weighted sum.
2. Advantage (one number per trajectory): A = (r - mean(group)) / (std(group) + eps), over the
   --num_generations trajectories of one dataset row, leaving out those whose env raised. A group
   whose rewards are all equal has A = 0 everywhere: it teaches nothing (`zero_adv_groups` in the
   logs; `with_spread` picks the others, and train.py updates on those alone when beta = 0).
3. Per token t the model sampled (loss_mask 1), with ratio = exp(logp - logp_old):
       loss_t = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A) + beta * KL_t
   KL_t is the k3 estimator exp(ref - logp) - (ref - logp) - 1 (Schulman, "Approximating KL
   divergence"), against a frozen copy of the starting model.
4. Normalisation: the sum over all sampled tokens of the batch divided by their count (the
   "token-level" mean of DAPO, arXiv 2503.14476). Every sampled token weighs the same; the
   per-sequence mean of the original GRPO paper would make a token of a 2-turn trajectory count
   five times a token of a 10-turn one. The count is computed once per batch, from the loss mask,
   so gradient accumulation over micro-batches gives the same gradient as one big batch.

Left out: the other loss variants (Dr. GRPO, GSPO, ...), entropy bonuses, importance weighting
for the engine/trainer logprob mismatch (train.py logs the mismatch instead), reward models.
"""
from typing import List

import torch
from torch.utils.checkpoint import checkpoint

from env import reward_funcs


def reward_columns(trajectories, funcs: List[str], use_gym_env: bool) -> torch.Tensor:
    """(N, K): the --reward_funcs columns, then the gym `total_reward` column last."""
    rows = [[reward_funcs[name](t.request.messages) for name in funcs]
            + ([float(t.rollout_infos.get('total_reward', 0.0))] if use_gym_env else []) for t in trajectories]
    return torch.tensor(rows, dtype=torch.float32)


def group_advantages(rewards: torch.Tensor, group_size: int, valid: torch.Tensor = None,
                     eps: float = 1e-4) -> torch.Tensor:
    """(N,) rewards, consecutive groups of group_size -> (N,) advantages (std is the sample std).

    Only valid members (valid: (N,) bool; default all) enter their group's mean and std, and an
    invalid member gets A = 0: a trajectory whose env raised says nothing about the policy. A group
    with fewer than two valid members gets A = 0 throughout."""
    r = rewards.view(-1, group_size)  # (groups, G)
    v = (torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid).view(-1, group_size).float()
    n = v.sum(1, keepdim=True)  # (groups, 1)
    mean = (r * v).sum(1, keepdim=True) / n.clamp(min=1)
    std = ((r - mean) ** 2 * v).sum(1, keepdim=True).div((n - 1).clamp(min=1)).sqrt()
    advantages = torch.where(v.bool() & (n >= 2), (r - mean) / (std + eps), 0.0)  # (groups, G)
    return advantages.view(-1)  # (N,)


def with_spread(rewards: torch.Tensor, group_size: int, valid: torch.Tensor = None) -> List[int]:
    """Indices of the valid trajectories whose group's valid rewards are not all equal. The others
    have A = 0: with beta = 0 they add nothing to the gradient, only tokens to the normaliser and
    time to the update. Training on these alone is DAPO's "dynamic sampling" without its refill."""
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    r, v = rewards.view(-1, group_size), valid.view(-1, group_size)  # (groups, G)
    high = torch.where(v, r, torch.tensor(-float('inf'))).max(1).values
    low = torch.where(v, r, torch.tensor(float('inf'))).min(1).values
    spread = (v.sum(1) >= 2) & (high > low)  # (groups,)
    return (spread.repeat_interleave(group_size) & valid).nonzero().flatten().tolist()


def token_logprobs(model, input_ids, attention_mask, loss_mask, temperature: float = 1.0,
                   chunk: int = 256) -> torch.Tensor:
    """(B, T) log-probabilities of input_ids under the model (softmax(logits / temperature)), on the
    loss-mask positions only, 0 elsewhere.

    The vocabulary is large (49,152 for SmolLM2), so logits are computed only where a token was
    sampled, `chunk` rows at a time under activation checkpointing: memory is then chunk x vocab,
    not batch x length x vocab.
    """
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
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
              ref_logprobs=None, num_tokens=None):
    """The clipped surrogate (+ beta * k3 KL), summed over loss-mask tokens / num_tokens.

    logprobs, old_logprobs, ref_logprobs, loss_mask: (B, T); advantages: (B,).
    num_tokens defaults to loss_mask.sum(); pass the whole batch's count when accumulating.
    Returns (loss, {'kl': mean KL, 'clip_ratio': share of tokens whose ratio was clipped}).
    """
    mask = loss_mask.float()
    n = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T)
    adv = advantages.unsqueeze(1)  # (B, 1)
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)  # (B, T)
    kl = torch.zeros_like(per_token)
    if beta:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
    loss = (per_token * mask).sum() / n
    stats = {'kl': ((kl * mask).sum() / n).item(),
             'clip_ratio': (((ratio != clipped).float() * mask).sum() / n).item()}
    return loss, stats
