"""The trajectories as the model reads them, and the trainer's logprobs of the sampled tokens.

1. `micro_batches`: every segment of a step's trajectories, a few at a time, as padded (b, T)
   tensors: token ids, loss mask, the engine's logprobs, each sampled token's advantage.
2. `pack` (with --share_prompt): a micro-batch's segments in one row in which every prefix they
   share (a group's prompt, the system prompt) appears once, with a 4D attention mask that gives
   every token exactly the outputs the plain forward gives it.
"""
from dataclasses import dataclass
from typing import List, Optional

import torch


@dataclass
class MicroBatch:
    """The segments of one forward/backward and what the loss needs of them: every (b, T) tensor
    holds one segment a row, right-padded; the model's own input may be packed (`pack`)."""
    input_ids: torch.Tensor  # (R, P) what the model reads: the b segments, or them packed (R = 1)
    attention_mask: torch.Tensor  # (R, P), or (1, 1, P, P) when packed
    position_ids: Optional[torch.Tensor]  # (R, P) when packed; None: 0, 1, 2, ... in each row
    predictor: torch.Tensor  # (b, T) the input position (R x P flat) whose output predicts a token
    targets: torch.Tensor  # (b, T) each segment's token ids
    loss_mask: torch.Tensor  # (b, T) 1 on sampled tokens
    engine_logprobs: torch.Tensor  # (b, T) the engine's logprobs of the sampled tokens
    advantages: torch.Tensor  # (b, T) each sampled token's advantage
    trajectory_tokens: torch.Tensor  # (b, 1) the sampled tokens of each row's whole trajectory

    def to(self, device) -> 'MicroBatch':
        """The same batch with every tensor on `device` (the model's)."""
        return MicroBatch(**{k: None if v is None else v.to(device) for k, v in vars(self).items()})


MAX_PACKED = 2048  # tokens of a packed row: its attention is a P x P matrix per head and layer


def shared_prefix(a, b) -> int:
    """The length of the longest common prefix of two token lists."""
    return next((p for p, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def pack(segments):
    """(input_ids (1, P), 4D attention mask, position_ids (1, P), predictor (b, T)) of the segments
    in one row where every distinct prefix appears once: each segment adds what follows its longest
    common prefix with the one before (sorted, they make a prefix tree in depth-first order). A
    token attends to its own segment's earlier tokens, at its positions there, so every output
    equals the plain forward's (Prefix Grouper, arXiv 2506.05433, shares one prefix per group; the
    tree also shares the system prompt across groups)."""
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
        # token t is predicted from token t - 1 (the first, from nothing: 0)
        predictor.append([0] + path[:-1] + [0] * (width - len(x)))
        before = x
    mask = torch.full((len(tokens), len(tokens)), torch.finfo(torch.float32).min)
    mask[rows, cols] = 0.0  # (P, P): 0 where attention is allowed
    return (torch.tensor([tokens]), mask[None, None], torch.tensor([positions]),
            torch.tensor(predictor))


def micro_batches(trajectories, advantages: torch.Tensor, *, size: int, pad_id: int,
                  share_prompt: bool = False) -> List[MicroBatch]:
    """Every segment of the trajectories, at most `size` at a time. advantages: (N, T), each
    trajectory's per turn (a sampled token takes its turn's), or (N,), one per trajectory.
    share_prompt: sort by token ids, so that a group's members (which share their prompt) are
    neighbours, and pack each micro-batch (`pack`) into at most MAX_PACKED new tokens (what follows
    the prefix a segment shares with the one before; a longer segment goes alone); otherwise
    shortest first, for less padding."""
    rows = [(i, s) for i, t in enumerate(trajectories) for s in t.segments]
    rows.sort(key=lambda row: row[1].token_ids if share_prompt else len(row[1].token_ids))
    chunks, packed = [], 0  # the micro-batches' (trajectory, segment) rows; the last's new tokens
    for k, (i, s) in enumerate(rows):
        shared = shared_prefix(rows[k - 1][1].token_ids, s.token_ids) if k and share_prompt else 0
        new = len(s.token_ids) - shared
        if not chunks or len(chunks[-1]) == size or (share_prompt and packed + new > MAX_PACKED):
            chunks.append([])
            new, packed = len(s.token_ids), 0
        chunks[-1].append((i, s))
        packed += new
    per_turn = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)  # (N, T)
    return [one_batch(chunk, [trajectories[i].num_sampled for i, _ in chunk],
                      per_turn[[i for i, _ in chunk]], pad_id, share_prompt) for chunk in chunks]


def padded(segments, name: str, fill, width: int) -> torch.Tensor:
    """(b, width): one of the segments' lists, right-padded with `fill`."""
    return torch.tensor([getattr(s, name) + [fill] * (width - len(s.token_ids)) for s in segments])


def one_batch(chunk, num_sampled, per_turn, pad_id: int, share_prompt: bool) -> MicroBatch:
    """A MicroBatch of (trajectory, segment) rows; per_turn: (b, turns) their advantages by turn."""
    segments = [s for _, s in chunk]
    width = max(len(s.token_ids) for s in segments)
    targets = padded(segments, 'token_ids', pad_id, width)  # (b, T)
    if share_prompt:
        input_ids, attention_mask, position_ids, predictor = pack(segments)
    else:
        input_ids, position_ids = targets, None
        attention_mask = torch.tensor([[1] * len(s.token_ids) + [0] * (width - len(s.token_ids))
                                       for s in segments])
        predictor = torch.arange(targets.numel()).view(targets.shape) - 1  # (b, T): the one before
    turns = (padded(segments, 'turns', 0, width) - 1).clamp(0, per_turn.shape[1] - 1)  # (b, T)
    return MicroBatch(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      predictor=predictor, targets=targets,
                      loss_mask=padded(segments, 'loss_mask', 0, width),
                      engine_logprobs=padded(segments, 'logprobs', 0.0, width),
                      advantages=per_turn.gather(1, turns),
                      trajectory_tokens=torch.tensor([[float(n)] for n in num_sampled]))
