"""The trajectory record env -> scheduler -> grpo pass along: `Trajectory`, its token sequences
(`Segment`), and `TokenRecord`, which the scheduler writes them with.

Token-in, token-out: the ids the engine sampled go into a segment verbatim (loss mask 1), and only
template text and observations are tokenized (mask 0), so the trainer scores exactly what was
sampled. A trajectory is one segment while the conversation only grows; a scheduler that rewrites
earlier messages makes the model see a new sequence, and the trajectory goes on in a new segment.
"""
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from env import Messages, RolloutInferRequest


@dataclass
class Segment:
    """One token sequence of a trajectory, exactly as the model saw it."""
    token_ids: List[int] = field(default_factory=list)
    loss_mask: List[int] = field(default_factory=list)  # 1 exactly on the tokens the model sampled
    logprobs: List[float] = field(default_factory=list)  # the engine's, of sampled tokens; else 0.0
    turns: List[int] = field(default_factory=list)  # the turn each sampled token is in (else 0)
    messages: Messages = field(default_factory=list)  # the conversation these tokens render


@dataclass
class Trajectory:
    """One trajectory, from rollout to loss: the record env -> scheduler -> grpo pass along."""
    request: RolloutInferRequest
    segments: List[Segment] = field(default_factory=list)  # one, unless a hook rewrote history
    rollout_infos: Dict[str, Any] = field(default_factory=dict)
    stop_reason: Optional[str] = None
    num_turns: int = 0
    messages: Messages = field(default_factory=list)  # the whole conversation, as it happened

    @property
    def num_sampled(self) -> int:
        """How many tokens the model sampled in this trajectory (its loss-mask 1s)."""
        return sum(sum(s.loss_mask) for s in self.segments)


class TokenRecord:
    """Writes a trajectory's segments with the chat template of `tokenizer`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        probe = self.render([{'role': 'user', 'content': 'x'},
                             {'role': 'assistant', 'content': 'MARK'}])
        self.turn_closer = self.encode(probe[probe.rindex('MARK') + 4:])  # ChatML: '<|im_end|>\n'

    def render(self, messages: Messages, add_generation_prompt=False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> List[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def start(self, t: Trajectory, room: int) -> bool:
        """The first segment: the conversation so far, ready for a reply (mask 0); False when it
        holds more than `room` ids (no reply would fit)."""
        return self._open(t, t.request.messages, room)

    def _open(self, t: Trajectory, messages: Messages, room: int) -> bool:
        ids = self.encode(self.render(messages, add_generation_prompt=True))
        if len(ids) > room:
            return False
        n = len(ids)
        t.segments.append(Segment(ids, [0] * n, [0.0] * n, [0] * n, deepcopy(messages)))
        return True

    @staticmethod
    def add(t: Trajectory, ids: List[int], mask=None, logprobs=(), turn: int = 0):
        """Ids at the end of the last segment; `logprobs` are those of its mask-1 ids, in order."""
        segment, mask, lp = t.segments[-1], mask or [0] * len(ids), iter(logprobs)
        segment.token_ids += ids
        segment.loss_mask += mask
        segment.logprobs += [next(lp) if m else 0.0 for m in mask]
        segment.turns += [turn * m for m in mask]

    def close_turn(self, t: Trajectory, ids: List[int]):
        """The template's closer after a reply, unless the reply ends with its first token."""
        self.add(t, self.turn_closer[1:] if ids[-1:] == self.turn_closer[:1] else self.turn_closer)

    def follow(self, t: Trajectory, before: Messages, room: int) -> bool:
        """After a step hook, the record follows the conversation it left (t.request.messages):
        - appended to: the new messages' ids (mask 0) go at the end of the segment;
        - rewritten: the segment ends as it was (`before`), a new one starts on the new one.
        False when the result would hold more than `room` ids (then nothing is added, and the
        conversation is cut back to what the model has seen)."""
        messages, segment = t.request.messages, t.segments[-1]
        added = self._appended(segment, messages)
        if added is not None:
            if len(segment.token_ids) + len(added) > room:
                del messages[len(segment.messages) + 1:]  # no room to answer what was added
                return False
            self.add(t, added)
            segment.messages = deepcopy(messages)
            return True
        segment.messages = before
        if self._open(t, messages, room):
            return True
        t.request.messages = before
        return False

    def _appended(self, segment: Segment, messages: Messages) -> Optional[List[int]]:
        """The ids `messages` add after the segment's, when they only add to it (they begin with its
        conversation and its closed reply); None when they rewrote it."""
        n = len(segment.messages)
        if (messages[:n] != segment.messages or len(messages) <= n
                or messages[n]['role'] != 'assistant'):
            return None
        closed, after = self.render(messages[:n + 1]), self.render(messages, True)
        seen = self.render(segment.messages, True)
        if not (closed.startswith(seen) and after.startswith(closed)):
            return None
        return self.encode(after[len(closed):])

    @staticmethod
    def extend_conversation(t: Trajectory, before: Messages):
        """The whole conversation (t.messages) follows too: it gains the messages a step hook
        appended (after the reply, or after a continued reply, which replaces the last one), or,
        when the hook rewrote history, its newest message."""
        after, n = t.request.messages, len(before)
        if after[:n] == before:
            new = after[n:]
        elif (after[:n - 1] == before[:-1] and after[n - 1:n]
              and after[n - 1]['role'] == 'assistant'):
            t.messages[-1], new = deepcopy(after[n - 1]), after[n:]
        else:
            new = after[-1:]
        t.messages += deepcopy(new)
