"""The record env -> scheduler -> grpo pass along: `Trajectory`, its token sequences (`Segment`),
and `TokenRecord`, which the scheduler writes them with (the README's "trajectory record").

Token-in, token-out: sampled ids go in verbatim (loss mask 1), only template text and observations
are tokenized (mask 0). A trajectory is one segment while the conversation only grows; when a
scheduler rewrites earlier messages, the model sees a new sequence: a new segment.
"""
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from env import Messages, RolloutInferRequest, UserError


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

    def render(self, messages: Messages, prompt=False) -> str:
        """The chat template's text; prompt: ready for the next reply (the assistant's header,
        or, when the last message is the assistant's, that message left open to continue)."""
        cont = prompt and messages[-1]['role'] == 'assistant'
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=prompt and not cont,
                                                  continue_final_message=cont)

    def renders_tools(self) -> bool:
        """Whether the chat template shows a {'role': 'tool'} message (some raise, some drop it)."""
        try:
            return 'PROBE' in self.render([{'role': 'user', 'content': 'x'},
                                           {'role': 'assistant', 'content': 'y'},
                                           {'role': 'tool', 'content': 'PROBE'}])
        except Exception:
            return False

    def encode(self, text: str) -> List[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def start(self, t: Trajectory, room: int) -> bool:
        """A new segment (the first, or after a rewrite): the conversation so far, ready for a
        reply (mask 0); False when it holds more than `room` ids (no reply would fit)."""
        ids = self.encode(self.render(t.request.messages, prompt=True))
        if len(ids) > room:
            return False
        t.segments.append(Segment(messages=deepcopy(t.request.messages)))
        self.add(t, ids)
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

    def follow(self, t: Trajectory, before: Messages, reply: List[int], room: int,
               continued: bool) -> bool:
        """After a step hook, the record follows the conversation, t.request.messages (`before`: as
        the hook found it, the reply included; `reply`: this turn's ids; `continued`: the hook gave
        them as response_token_ids). The reply continued (the same messages, the last the
        assistant's): the next reply adds to these ids (a hook that changed the reply must give the
        ids it added). Appended to: the turn is closed, the new messages' ids (mask 0) go at the
        end. Rewritten: the turn is closed, the segment ends as `before`, and a new one starts.
        False when the result would exceed `room` ids (the new messages' ids are not added, and the
        conversation is cut back)."""
        messages, segment = t.request.messages, t.segments[-1]
        if (len(messages) == len(before) and messages[:-1] == before[:-1]
                and messages[-1]['role'] == 'assistant'):
            if messages[-1] != before[-1] and not continued:
                raise UserError('a step hook changed the reply it continues without giving the '
                                'ids it added (response_token_ids, response_loss_mask)')
            return len(segment.token_ids) <= room
        self.close_turn(t, reply)
        if messages[:len(before)] == before and len(messages) > len(before):
            # appended to, and the template renders what the segment holds unchanged
            seen, closed = self.render(segment.messages, prompt=True), self.render(before)
            after = self.render(messages, prompt=True)
            if closed.startswith(seen) and after.startswith(closed):
                added = self.encode(after[len(closed):])
                if len(segment.token_ids) + len(added) > room:
                    del messages[len(before):]  # no room to answer what was added
                    return False
                self.add(t, added)
                segment.messages = deepcopy(messages)
                return True
        segment.messages = before  # rewritten
        if self.start(t, room):
            return True
        t.request.messages = before
        return False

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
            t.messages[-1] = deepcopy(after[n - 1])  # the continued reply
            new = after[n:]
        else:
            new = after[-1:]
        t.messages += deepcopy(new)
