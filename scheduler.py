"""Multi-turn rollouts: the hook-based `MultiTurnScheduler`, the `multi_turns` registry, the
document's `GYMScheduler` and two example schedulers.

Implements "启动训练" and "2. GYMScheduler 的 hook 实现" of the GYM-env document, with ms-swift's
scheduler protocol (swift/rollout/multi_turn.py): a scheduler written for ms-swift runs here
once its import lines are changed.
1. `on_trajectory_start(requests)`: set up each trajectory (GYMScheduler: make the env, `reset`).
2. Each turn the live trajectories' token ids go to the engine (engines.py): `run_multi_turn`
   makes one batched call per turn (colocate); concurrent `run`s share calls (server). The reply
   becomes a new assistant message, or continues the last one if the conversation ends in one.
3. `on_turn_end(req, response_choice, turn)` -> {'done'?, 'rollout_infos'?} (GYMScheduler:
   `env.step`). 'done', when given, overrides `check_finished(req, response_choice, turn)`, whose
   default ends a trajectory whose reply was cut by length, and at --max_turns in any case.
4. `step(req, response_choice, turn)` -> {'infer_request': req} and optionally
   'response_token_ids' / 'response_loss_mask' (this turn's ids, e.g. the reply plus a tool's
   output with mask 0), 'rollout_logprobs' (of its mask-1 ids), 'rollout_infos'.
5. `on_trajectory_end(requests)` runs once per trajectory however it ended (close the env).
Hooks may be `def` or `async def`; `response_choice` has .token_ids, .logprobs, .finish_reason
and .message.content. The envs' resets, and the steps of one turn, run concurrently.

Token-in, token-out: a trajectory is recorded as the token ids the model saw, sampled ids
verbatim (loss_mask 1), template text and observations tokenized (0). A hook that rewrites
earlier messages (compresses the history, replaces the system prompt) makes the model see a new
sequence from then on: the trajectory goes on in a new `Segment`, and each segment is trained on.
A trajectory ends 'done', 'max_turns', 'length', 'context_limit' or 'error' (the env raised).
Left out: overriding ms-swift's `run` (it needs ms-swift's engine API) and ID-backed messages.
"""
import asyncio
import inspect
from copy import deepcopy
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

from env import Messages, RolloutInferRequest, UserError, envs


@dataclass
class Segment:
    """One token sequence of a trajectory, exactly as the model saw it."""
    token_ids: List[int] = field(default_factory=list)
    loss_mask: List[int] = field(default_factory=list)  # 1 exactly on the tokens the model sampled
    logprobs: List[float] = field(default_factory=list)  # the engine's logprob of each sampled token, 0.0 elsewhere
    turns: List[int] = field(default_factory=list)  # the turn whose reply each sampled token is in (0 elsewhere)
    messages: Messages = field(default_factory=list)  # the conversation these tokens render


@dataclass
class Trajectory:
    """One trajectory, from rollout to loss: the record env -> scheduler -> grpo pass along."""
    request: RolloutInferRequest
    segments: List[Segment] = field(default_factory=list)  # one, unless a hook rewrote history
    rollout_infos: Dict[str, Any] = field(default_factory=dict)
    stop_reason: Optional[str] = None
    num_turns: int = 0
    messages: Messages = field(default_factory=list)  # the whole conversation, as it happened (rewards read it)

    @property
    def num_sampled(self) -> int:
        """How many tokens the model sampled in this trajectory (its loss-mask 1s)."""
        return sum(sum(s.loss_mask) for s in self.segments)


class MultiTurnScheduler:
    """Drives multi-turn rollouts through hooks; subclasses override the hooks, not the drivers.
    The arguments are ms-swift's (infer_engine, max_turns, tokenizer=...) plus our sampling ones."""

    def __init__(self, infer_engine=None, max_turns=10, *args, tokenizer=None, max_completion_length=16,
                 temperature=1.0, max_model_len=2048, **kwargs):
        self.infer_engine, self.max_turns = infer_engine, max_turns
        self.tokenizer = tokenizer or getattr(infer_engine, 'tokenizer', None)
        self.max_completion_length, self.temperature, self.max_model_len = max_completion_length, temperature, max_model_len
        self._queue = []  # (prompt, future) pairs waiting for the engine, see _generate_one
        # The tokens the template puts after an assistant reply ('<|im_end|>\n' for ChatML).
        probe = self._render([{'role': 'user', 'content': 'x'}, {'role': 'assistant', 'content': 'MARK'}])
        self.turn_closer = self._encode(probe[probe.rindex('MARK') + 4:])

    # ---- hooks (each may be def or async def) ----
    async def on_trajectory_start(self, requests: List[RolloutInferRequest]) -> Optional[Dict[str, str]]:
        """Prepare each request's messages (default: the dataset row's). May return {uuid: error}
        for requests that cannot start (ours; ms-swift's returns nothing)."""

    async def on_turn_end(self, infer_request, response_choice, current_turn: int) -> Dict[str, Any]:
        """Judge the newest reply: {'done': bool, 'rollout_infos': dict, 'stop_reason': str}, all optional."""
        return {}

    def check_finished(self, infer_request, response_choice, current_turn: int) -> bool:
        """ms-swift's default: a reply cut by length, or the last turn."""
        return response_choice.finish_reason == 'length' or current_turn >= self.max_turns

    def step(self, infer_request, response_choice, current_turn: int) -> Dict[str, Any]:
        """The request for the next turn: {'infer_request': req, ...} (module docstring, 4)."""
        raise NotImplementedError(f'{type(self).__name__} must implement step() (the request for the next turn)')

    async def on_trajectory_end(self, requests: List[RolloutInferRequest]) -> None:
        """Called once for every request, however its trajectory ended."""

    @staticmethod
    def _extract_logprobs_from_choice(response_choice) -> List[float]:
        """ms-swift's helper: the engine's logprobs of the sampled ids."""
        return list(response_choice.logprobs)

    # ---- drivers ----
    async def run(self, req: RolloutInferRequest) -> Trajectory:
        """One trajectory (the server-mode path). Run many with asyncio.gather: the turns that are
        waiting for the engine at the same moment share one batched engine call."""
        (t,) = await self._start([req])
        try:
            for turn in range(1, self.max_turns + 1):
                if t.stop_reason:
                    break
                await self._play_turn(t, await self._generate_one(t.segments[-1].token_ids), turn)
        finally:
            await self._end([t])
        return t

    async def run_multi_turn(self, requests: List[RolloutInferRequest]) -> List[Trajectory]:
        """All trajectories together, one batched engine call per turn (the colocate path)."""
        trajectories = await self._start(requests)
        try:
            for turn in range(1, self.max_turns + 1):
                live = [t for t in trajectories if not t.stop_reason]
                if not live:
                    break
                completions = self._complete(live)
                await asyncio.gather(*[self._play_turn(t, c, turn) for t, c in zip(live, completions)])
        finally:
            await self._end(trajectories)
        return trajectories

    def _complete(self, live: List[Trajectory]):
        """One batched engine call: a reply for each live trajectory."""
        return self.infer_engine.generate([t.segments[-1].token_ids for t in live], self.max_completion_length,
                                          self.temperature)

    # ---- plumbing shared by both drivers ----
    async def _generate_one(self, prompt: List[int]):
        """Queue a prompt; the first one queued schedules a flush, which runs once every coroutine
        that was ready has queued its own prompt (asyncio runs ready callbacks in order)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.append((prompt, future))
        if len(self._queue) == 1:
            loop.call_soon(self._flush)
        return await future

    def _flush(self):
        batch, self._queue = self._queue, []
        try:
            completions = self.infer_engine.generate([p for p, _ in batch], self.max_completion_length, self.temperature)
        except Exception as e:
            completions = [e] * len(batch)
        for (_, future), completion in zip(batch, completions):
            if future.cancelled():  # its run() was cancelled while it waited: the others still get theirs
                continue
            future.set_exception(completion) if isinstance(completion, Exception) else future.set_result(completion)

    async def _hook(self, name: str, *args):
        """Call a hook, def or async def; on_turn_end and step must answer with a dict."""
        result = getattr(self, name)(*args)
        result = await result if inspect.isawaitable(result) else result
        if name in ('on_turn_end', 'step') and not (isinstance(result, dict) and (name != 'step' or 'infer_request' in result)):
            raise UserError(f"{type(self).__name__}.{name} returned {type(result).__name__}: it must return a dict"
                            + (" with 'infer_request'" if name == 'step' else ''))
        return result

    def _render(self, messages, add_generation_prompt=False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _encode(self, text: str) -> List[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _open_segment(self, t: Trajectory, messages: Messages) -> bool:
        """Start a segment: the conversation rendered for the next reply (mask 0). False if no reply fits."""
        ids = self._encode(self._render(messages, add_generation_prompt=True))
        if len(ids) + self.max_completion_length > self.max_model_len:
            return False
        t.segments.append(Segment(ids, [0] * len(ids), [0.0] * len(ids), [0] * len(ids), deepcopy(messages)))
        return True

    @staticmethod
    def _append(segment: Segment, ids: List[int], mask=None, logprobs=(), turn: int = 0):
        """Add ids to a segment; `logprobs` are those of its mask-1 ids, in order."""
        mask = mask or [0] * len(ids)
        lp = iter(logprobs)
        segment.token_ids += ids
        segment.loss_mask += mask
        segment.logprobs += [next(lp) if m else 0.0 for m in mask]
        segment.turns += [turn * m for m in mask]

    def _close_turn(self, segment: Segment, ids: List[int]):
        """The template's turn closer after a reply, unless the reply already ends with its first token."""
        self._append(segment, self.turn_closer[1:] if ids[-1:] == self.turn_closer[:1] else self.turn_closer)

    async def _start(self, requests) -> List[Trajectory]:
        failed = await self._hook('on_trajectory_start', requests) or {}
        trajectories = [Trajectory(req, messages=deepcopy(req.messages)) for req in requests]
        for t in trajectories:
            if t.request.uuid in failed:
                t.stop_reason, t.rollout_infos = 'error', {'total_reward': 0.0, 'error': failed[t.request.uuid]}
            elif not self._open_segment(t, t.request.messages):
                t.stop_reason = 'context_limit'
        return trajectories

    async def _play_turn(self, t: Trajectory, completion, turn: int):
        segment, req, sampled = t.segments[-1], t.request, completion.token_ids
        text = self.tokenizer.decode(sampled, skip_special_tokens=True)
        completion.message = SimpleNamespace(role='assistant', content=text)  # ms-swift's response_choice.message
        for messages in (req.messages, t.messages):  # the model's view, and the whole conversation
            if messages[-1]['role'] == 'assistant':  # the reply continues the last assistant message
                messages[-1]['content'] += text
            else:
                messages.append({'role': 'assistant', 'content': text})
        t.num_turns = turn
        result = await self._hook('on_turn_end', req, completion, turn)
        t.rollout_infos.update(result.get('rollout_infos') or {})
        if 'done' in result:  # on_turn_end's verdict overrides check_finished, as in ms-swift
            done, reason = result['done'], result.get('stop_reason', 'done')
        else:
            done = await self._hook('check_finished', req, completion, turn)
            reason = 'length' if completion.finish_reason == 'length' else 'max_turns' if turn >= self.max_turns else 'done'
        if done or turn >= self.max_turns:
            t.stop_reason = reason if done else 'max_turns'
            self._append(segment, sampled, [1] * len(sampled), completion.logprobs, turn)
            self._close_turn(segment, sampled)
            return
        before = deepcopy(req.messages)
        ret = await self._hook('step', req, completion, turn)
        t.request = req = ret['infer_request']
        t.rollout_infos.update(ret.get('rollout_infos') or {})
        self._log_step(t, before)
        ids = list(ret.get('response_token_ids') or sampled)
        mask = list(ret.get('response_loss_mask') or [1] * len(ids))
        same = next((k for k, (a, b) in enumerate(zip(ids, sampled)) if a != b), min(len(ids), len(sampled)))
        trained = [k for k, m in enumerate(mask) if m]  # positions; each must hold the id sampled there
        logprobs = list(ret.get('rollout_logprobs') or [completion.logprobs[k] for k in trained if k < same])
        if len(mask) != len(ids) or any(k >= same for k in trained) or len(logprobs) != len(trained):
            raise UserError(f'{type(self).__name__}.step: response_loss_mask must be as long as response_token_ids '
                            'and put 1 only on sampled ids at their sampled positions (everything before them '
                            'unchanged), and rollout_logprobs one per such id')
        self._append(segment, ids, mask, logprobs, turn)
        if req.messages[-1]['role'] == 'assistant':  # the next reply continues this message, from these ids
            if len(segment.token_ids) + self.max_completion_length > self.max_model_len:
                t.stop_reason = 'context_limit'
            return
        self._close_turn(segment, ids)
        self._sync(t, before)

    @staticmethod
    def _log_step(t: Trajectory, before: Messages):
        """Add what the step hook added to the whole conversation: the messages it appended, or, when
        it rewrote history, its newest message; a continued reply replaces the last one."""
        after = t.request.messages
        if after[-1]['role'] == 'assistant':
            t.messages[-1] = deepcopy(after[-1])
        else:
            t.messages += deepcopy(after[len(before):] if after[:len(before)] == before else after[-1:])

    def _sync(self, t: Trajectory, before: Messages):
        """Append the new messages' tokens (mask 0) when the hooks only appended; otherwise close the
        segment as it was (`before` the step) and open a new one on the rewritten conversation."""
        segment, messages, n = t.segments[-1], t.request.messages, len(t.segments[-1].messages)
        if messages[:n] == segment.messages and len(messages) > n and messages[n]['role'] == 'assistant':
            closed, after = self._render(messages[:n + 1]), self._render(messages, add_generation_prompt=True)
            if closed.startswith(self._render(segment.messages, add_generation_prompt=True)) and after.startswith(closed):
                observation = self._encode(after[len(closed):])
                if len(segment.token_ids) + len(observation) + self.max_completion_length > self.max_model_len:
                    t.stop_reason, messages[n + 1:] = 'context_limit', []  # no room to answer it
                else:
                    self._append(segment, observation)
                    segment.messages = deepcopy(messages)
                return
        segment.messages = before
        if not self._open_segment(t, messages):
            t.stop_reason, t.request.messages = 'context_limit', before

    async def _end(self, trajectories: List[Trajectory]):
        await self._hook('on_trajectory_end', [t.request for t in trajectories])
        for t in trajectories:
            t.stop_reason = t.stop_reason or 'max_turns'
            t.rollout_infos.update(stop_reason=t.stop_reason, num_turns=t.num_turns)
            if t.segments:
                t.segments[-1].messages = t.request.messages


class GYMScheduler(MultiTurnScheduler):
    """The document's GYMScheduler: the env hands out observations and rewards through the hooks.

    The env is picked per row by `env_config.name`, else by `gym_env` (--gym_env).
    rollout_infos: total_reward, step_rewards, reset_info and step_infos (the env's info dicts),
    states (the env's state_key before each reply), plus stop_reason and num_turns from the
    driver, and `error` when the env raised.
    """

    def __init__(self, *args, gym_env: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.gym_env = gym_env
        self._envs, self._infos, self._pending_obs = {}, {}, {}

    async def on_trajectory_start(self, requests):
        errors = await asyncio.gather(*[self._reset(req) for req in requests])  # resets overlap
        return {req.uuid: error for req, error in zip(requests, errors) if error}

    async def _reset(self, req) -> Optional[str]:
        env_config = req.data_dict.get('env_config') or {}
        self._infos[req.uuid] = {'total_reward': 0.0, 'step_rewards': [], 'step_infos': []}
        try:
            self._envs[req.uuid] = env = envs[env_config.get('name') or self.gym_env](env_config)
            observation, info, system_message = await env.reset(req)
        except Exception as e:
            return f'reset: {type(e).__name__}: {e}'
        self._infos[req.uuid].update(reset_info=info, states=[self._state(env, observation)])
        req.messages = [{'role': 'system', 'content': system_message}, {'role': 'user', 'content': observation}]

    async def on_turn_end(self, req, response_choice, turn):
        infos = self._infos[req.uuid]
        try:
            observation, reward, done, info = await self._envs[req.uuid].step(deepcopy(req.messages))
        except Exception as e:
            infos.update(total_reward=0.0, error=f'step {turn}: {type(e).__name__}: {e}')
            return {'done': True, 'stop_reason': 'error', 'rollout_infos': infos}
        infos['total_reward'] += float(reward)
        infos['step_rewards'].append(float(reward))
        infos['step_infos'].append(info)
        infos['states'].append(self._state(self._envs[req.uuid], observation))
        self._pending_obs[req.uuid] = observation
        # Not done: check_finished decides (a reply cut by length ends it, as the last turn does).
        return {'done': True, 'rollout_infos': infos} if done else {'rollout_infos': infos}

    def step(self, req, response_choice, turn):
        req.messages.append({'role': 'user', 'content': self._pending_obs.pop(req.uuid)})
        return {'infer_request': req}

    @staticmethod
    def _state(env, observation):
        key = env.state_key()
        return observation if key is None else key

    async def on_trajectory_end(self, requests):
        for req in requests:
            self._infos.pop(req.uuid, None)
            self._pending_obs.pop(req.uuid, None)
            env = self._envs.pop(req.uuid, None)  # pop: each env is closed exactly once
            if env is not None:
                try:
                    await env.close()
                except Exception as e:  # a failing close must not take the batch down
                    print(f'warning: closing env for {req.uuid} failed: {type(e).__name__}: {e}')


class HintScheduler(GYMScheduler):
    """Example: after a reply the env could not read (status 'invalid'), the next observation ends
    with a reminder of the format. It only appends, so a trajectory stays one segment."""
    hint = 'Hint: your last reply could not be read. Reply exactly in the format the system message asks for.'

    def step(self, req, response_choice, turn):
        status = self._infos[req.uuid]['step_infos'][-1].get('status')
        ret = super().step(req, response_choice, turn)
        if status in ('invalid', 'invalid_action'):
            req.messages[-1]['content'] += '\n' + self.hint
        return ret


class WindowScheduler(GYMScheduler):
    """Example: the conversation keeps the system prompt, the first observation and the last
    `window` turns (reply and observation). Past that it rewrites history, so from then on each
    turn is a segment of its own (its window, then the reply)."""
    window = 2

    def step(self, req, response_choice, turn):
        # BEGIN SOLUTION exercise 5: a scheduler that rewrites history
        ret = super().step(req, response_choice, turn)
        req.messages = req.messages[:2] + req.messages[2:][-2 * self.window:]
        return ret
        # END SOLUTION


class ExpertScheduler(GYMScheduler):
    """The env's expert plays instead of the model (`Env.expert_reply`), making the token record a
    rollout makes, its replies where sampled tokens would be (mask 1, logprob 0: the expert is
    sure). train.py's --warm_start_steps trains on these games before GRPO."""

    def _complete(self, live):
        replies = [self._encode(self._envs[t.request.uuid].expert_reply()) + self.turn_closer[:1] for t in live]
        return [SimpleNamespace(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason='stop') for ids in replies]


# --multi_turn_scheduler names; a plugin adds its own: multi_turns['my_scheduler'] = MyScheduler
multi_turns = {'gym_scheduler': GYMScheduler, 'hint_scheduler': HintScheduler, 'window_scheduler': WindowScheduler}


def check_scheduler(name: str):
    """Refuse, in one line, a name that is not registered or not a MultiTurnScheduler."""
    if name not in multi_turns:
        raise UserError(f'--multi_turn_scheduler {name}: not registered; registered: {", ".join(sorted(multi_turns))}')
    if not (isinstance(multi_turns[name], type) and issubclass(multi_turns[name], MultiTurnScheduler)):
        raise UserError(f"--multi_turn_scheduler {name}: multi_turns['{name}'] is {multi_turns[name]!r}, "
                        'not a MultiTurnScheduler subclass')


def requests_for(rows, group_size) -> List[RolloutInferRequest]:
    """group_size requests per dataset row, consecutive, each with its own uuid and a copy of the row."""
    return [RolloutInferRequest(messages=deepcopy(row.get('messages', [])),
                                data_dict=deepcopy({k: v for k, v in row.items() if k != 'messages'}))
            for row in rows for _ in range(group_size)]


def rollout(scheduler: MultiTurnScheduler, requests: List[RolloutInferRequest]) -> List[Trajectory]:
    """Synchronous entry point for train.py: run_multi_turn on a fresh event loop."""
    return asyncio.run(scheduler.run_multi_turn(requests))
