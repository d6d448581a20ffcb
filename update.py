"""The update: README "The algorithm", steps 3-6, on one process's share of a step's trajectories.

`train_step` runs it in four phases, each a function below, on the model's device:
1. the normalisers' counts, summed over every process (`grpo.Counts`), and the micro-batches that
   train and the valid ones only measured (`step_batches`);
2. logp_old and the KL anchor's logprobs, without gradients (`reference_logprobs`);
3. a pass over the micro-batches that train: per-token losses (`grpo.token_loss`), one number
   (`grpo.aggregate`), backward (`one_pass`); the first pass also measures the others (`measure`),
   so that `entropy` and `logprob_gap` cover every valid sampled token;
4. the gradients summed over the processes, clipped, one optimizer step (`step_optimizer`).
3-4 run once per --num_iterations. Left out: gradient accumulation across steps, FSDP/DeepSpeed,
fused or 8-bit optimizers.
"""
import contextlib
import dataclasses

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import batching
import grpo
from config import Args

SUMS = ('loss', 'kl', 'clipped', 'entropy', 'gap', 'is_clipped', 'computed')  # what a pass adds up


def train_step(model, ref_model, optimizer, trajectories, scores: grpo.Scores, args: Args,
               pad_id: int) -> dict:
    """The four phases of the module's docstring; `updated`: whether any process trained."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    local = torch.tensor(dataclasses.astuple(grpo.count(trajectories, scores)), dtype=torch.float64)
    counts = grpo.Counts(*all_sum(local.to(model.device), world).tolist())
    budget = args.rows_per_step * args.num_generations * args.max_turns * args.max_completion_length
    denominator = counts.denominator(args.loss_type, budget)
    trained, measured = step_batches(model, trajectories, scores, args, pad_id)
    stats = {'loss': 0.0, 'kl': 0.0, 'clip_ratio': 0.0, 'grad_norm': 0.0, 'skipped': 0,
             'is_clipped': 0.0, 'updated': counts.n_trained > 0}
    model.train()  # gradient checkpointing is active in train mode only (Llama has no dropout)
    old, ref = reference_logprobs(model, ref_model, trained, args)
    is_weights, passes = [None] * len(trained), args.num_iterations if counts.n_trained else 0
    for iteration in range(max(passes, 1)):  # nothing trains anywhere: measure only, no step
        optimizer.zero_grad(set_to_none=True)
        sums = one_pass(model, trained, old, ref, is_weights, denominator, args)
        sums += measure(model, measured if iteration == 0 else [], args)
        sums = dict(zip(SUMS, all_sum(sums, world).tolist()))
        if iteration == 0:  # not later passes: the engine never sampled from their weights
            stats.update(entropy=sums['entropy'] / max(counts.sampled, 1),
                         logprob_gap=sums['gap'] / max(counts.sampled, 1),
                         is_clipped=sums['is_clipped'] / max(sums['computed'], 1))
        if passes:  # kl and clip_ratio: means over the passes
            stats['kl'] += sums['kl'] / max(counts.tokens, 1) / passes
            stats['clip_ratio'] += sums['clipped'] / max(counts.tokens, 1) / passes
            step_optimizer(model, optimizer, stats, sums['loss'] / passes, args.max_grad_norm,
                           world)
    model.eval()
    return stats


def step_batches(model, trajectories, scores: grpo.Scores, args: Args, pad_id: int):
    """(the micro-batches that train, those only measured: valid, with sampled tokens, not
    trained), on the model's device."""
    rest = [i for i, t in enumerate(trajectories)
            if scores.valid[i] and t.num_sampled and i not in scores.trained]
    # packing hands the model a 4D attention mask, which sdpa and eager attention take
    packed = args.share_prompt and model.config._attn_implementation in ('sdpa', 'eager')
    return ([b.to(model.device) for b in batching.micro_batches(
                [trajectories[i] for i in rows], advantages, size=args.micro_batch_size,
                pad_id=pad_id, share_prompt=packed)]
            for rows, advantages in ((scores.trained, scores.turn_advantages[scores.trained]),
                                     (rest, torch.zeros(len(rest)))))


def one_pass(model, batches, old, ref, is_weights, denominator: float, args: Args) -> torch.Tensor:
    """Forward and backward over the micro-batches that train; returns the pass's SUMS. The rollout
    importance weights (engine vs the policy that sampled) are made in the first pass, then kept."""
    sums = torch.zeros(len(SUMS), dtype=torch.float64, device=model.device)
    for k, b in enumerate(batches):
        mask = b.loss_mask
        with precision(args, model.device):
            logprobs, entropies = token_logprobs(model, b, args.temperature)  # (b, T)
        old_k = old[k] if old else logprobs.detach()  # one pass: logp_old is logp itself, ratio 1
        over = torch.zeros_like(mask, dtype=torch.bool)
        if args.rollout_importance_sampling_mode and is_weights[k] is None:
            weights, over = grpo.rollout_is_weights(
                old_k, b.engine_logprobs, mask, args.rollout_importance_sampling_mode,
                args.rollout_importance_sampling_threshold)
            is_weights[k] = weights
        per_token, kl, clipped = grpo.token_loss(
            logprobs, old_k, b.advantages, mask, epsilon=args.epsilon,
            epsilon_high=args.epsilon_high, beta=args.beta, ref_logprobs=ref[k] if ref else None,
            level=args.importance_sampling_level, is_weights=is_weights[k])
        loss = grpo.aggregate(per_token, mask, b.trajectory_tokens, args.loss_type, denominator)
        loss.backward()
        sums += torch.stack([loss.detach(), (kl.detach() * mask).sum(), (clipped * mask).sum(),
                             (entropies * mask).sum(), gap(logprobs, b), (over * mask).sum(),
                             mask.sum()]).double()
    return sums


def token_logprobs(model, batch: batching.MicroBatch, temperature: float = 1.0, chunk: int = 256):
    """(logprobs, entropies), both (b, T), 0 where loss_mask is 0: each sampled token's
    log-probability under softmax(logits / temperature), and that distribution's entropy at its
    position (TRL's `entropy`, without gradient). The vocabulary is large (49,152), so logits only
    at sampled tokens, `chunk` rows at a time under activation checkpointing: chunk x vocab."""
    # BEGIN SOLUTION exercise 4: token logprobs
    hidden = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 position_ids=batch.position_ids,
                                 use_cache=False).last_hidden_state  # (R, P, H)
    picked = batch.loss_mask.bool()  # (b, T)
    h = hidden.flatten(0, 1)[batch.predictor[picked]]  # (M, H): what predicts each sampled token
    targets = batch.targets[picked]  # (M,)
    head = model.get_output_embeddings()

    def chunk_logprobs(h, targets):
        logp = (head(h).float() / temperature).log_softmax(-1)  # (c, V)
        entropy = -(logp.exp() * logp).sum(-1)  # (c,)
        return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy  # (c,), (c,)

    pieces = [checkpoint(chunk_logprobs, h[i:i + chunk], targets[i:i + chunk], use_reentrant=False)
              for i in range(0, len(targets), chunk)]
    logprobs = torch.zeros(batch.targets.shape, device=batch.targets.device)  # (b, T), float32
    entropies = torch.zeros_like(logprobs)
    if pieces:
        logprobs[picked] = torch.cat([p[0] for p in pieces])
        entropies[picked] = torch.cat([p[1] for p in pieces]).detach()
    return logprobs, entropies
    # END SOLUTION


def reference_logprobs(model, ref_model, batches, args: Args):
    """(logp_old, the KL anchor's logprobs), per micro-batch, without gradients; None when not
    needed: logp_old (the policy before this step) only with --num_iterations > 1, the anchor
    (load_models) only with --beta > 0 (LoRA, no warm start: the same model, adapters off)."""
    old, ref = None, None
    with torch.no_grad(), precision(args, model.device):
        if args.num_iterations > 1:
            old = [token_logprobs(model, b, args.temperature)[0] for b in batches]
        if args.beta:
            with model.disable_adapter() if ref_model is None else contextlib.nullcontext():
                ref = [token_logprobs(ref_model or model, b, args.temperature)[0] for b in batches]
    return old, ref


def measure(model, batches, args: Args) -> torch.Tensor:
    """SUMS of the micro-batches that do not train: their entropy and logprob gap, no gradients."""
    sums = torch.zeros(len(SUMS), dtype=torch.float64, device=model.device)
    with torch.no_grad(), precision(args, model.device):
        for b in batches:
            logprobs, entropies = token_logprobs(model, b, args.temperature)
            sums[SUMS.index('entropy')] += (entropies * b.loss_mask).sum().double()
            sums[SUMS.index('gap')] += gap(logprobs, b).double()
    return sums


def gap(logprobs, b: batching.MicroBatch) -> torch.Tensor:
    """The summed |trainer - engine| logprob difference over a micro-batch's sampled tokens."""
    return ((logprobs.detach() - b.engine_logprobs).abs() * b.loss_mask).sum()


def precision(args: Args, device):
    """--torch_dtype bfloat16: the forward and backward in bf16 (autocast), the weights and AdamW's
    state in fp32, so that small updates are not rounded away."""
    if args.torch_dtype == 'bfloat16':
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def all_sum(values: torch.Tensor, world: int) -> torch.Tensor:
    """The sum of a tensor over the processes (one process: the tensor itself)."""
    if world > 1:
        dist.all_reduce(values)
    return values


def step_optimizer(model, optimizer, stats: dict, loss: float, max_norm: float, world: int):
    """Sum every trainable gradient over the processes (each divided by the whole batch's count: one
    big batch's gradient), clip, and step, unless the norm (the same everywhere) is not finite."""
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:  # a process with nothing to train this step still takes part
                p.grad = torch.zeros_like(p)
            all_sum(p.grad, world)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if torch.isfinite(grad_norm):
        optimizer.step()
        stats.update(loss=stats['loss'] + loss, grad_norm=grad_norm.item())
    else:
        print(f'warning: non-finite loss ({loss}) or gradient norm; update skipped')
        optimizer.zero_grad(set_to_none=True)
        stats['skipped'] += 1
