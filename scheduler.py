"""Multi-turn rollouts: ms-swift's hook-based `MultiTurnScheduler` and `multi_turns` registry, the
document's `GYMScheduler` (with the tool loop) and example schedulers ("启动训练", "2. GYMScheduler
的 hook 实现"). A turn (`_play_turn`): one batched engine call for every live trajectory; each reply
joins its conversation; `on_turn_end` (the env's step, or a tool) or `check_finished` says whether
the game is over; if not, `step` makes the next request. Left out: overriding ms-swift's `run`.
"""
import asyncio
import inspect
from copy import deepcopy
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import tools
from env import INVALID, Messages, RolloutInferRequest, UserError, env_name, envs
from trajectory import TokenRecord, Trajectory


class MultiTurnScheduler:
    """Drives multi-turn rollouts through hooks; subclasses override the hooks, not the drivers.
    The arguments are ms-swift's (infer_engine, max_turns, tokenizer=...) plus our sampling ones."""

    def __init__(self, infer_engine=None, max_turns=10, *args, tokenizer=None,
                 max_completion_length=16, temperature=1.0, max_model_len=2048, **kwargs):
        self.infer_engine, self.max_turns = infer_engine, max_turns
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer or getattr(infer_engine, 'tokenizer', None)
        self.max_completion_length, self.temperature = max_completion_length, temperature
        self.record = TokenRecord(self.tokenizer)
        self._queue = []  # (trajectory, future) pairs waiting for the engine: `_generate`

    # ---- hooks (each may be def or async def) ----
    async def on_trajectory_start(self, requests: List[RolloutInferRequest]):
        """Prepare each request's messages (default: the dataset row's). May return {uuid: error}
        for requests that cannot start (ours; ms-swift's returns nothing)."""

    async def on_turn_end(self, infer_request, response_choice, current_turn: int) -> Dict:
        """Judge the newest reply: {'done', 'rollout_infos', 'stop_reason'}, each optional."""
        return {}

    def check_finished(self, infer_request, response_choice, current_turn: int) -> bool:
        """ms-swift's default: a reply cut by length, or the last turn."""
        return response_choice.finish_reason == 'length' or current_turn >= self.max_turns

    def step(self, infer_request, response_choice, current_turn: int) -> Dict[str, Any]:
        """The request for the next turn: {'infer_request': req, ...} (README)."""
        raise NotImplementedError(f'{type(self).__name__} must implement step() (the next request)')

    async def on_trajectory_end(self, requests: List[RolloutInferRequest]) -> None:
        """Called once for every request, however its trajectory ended."""

    @staticmethod
    def _extract_logprobs_from_choice(response_choice) -> List[float]:  # ms-swift's helper
        return list(response_choice.logprobs)

    # ---- the driver ----
    async def run(self, req: RolloutInferRequest) -> Trajectory:
        """One trajectory (server mode). Concurrent runs (asyncio.gather) share the engine calls."""
        (t,) = await self.run_multi_turn([req])
        return t

    async def run_multi_turn(self, requests: List[RolloutInferRequest]) -> List[Trajectory]:
        """The trajectories together, turn by turn (colocate mode): every live trajectory's prompt
        is queued at once, so a turn is one batched engine call."""
        trajectories = [Trajectory(req) for req in requests]
        try:  # on_trajectory_end runs however the rollout ends, on_trajectory_start's errors too
            await self._start(trajectories)
            for turn in range(1, self.max_turns + 1):
                live = [t for t in trajectories if not t.stop_reason]
                if not live:
                    break
                replies = await asyncio.gather(*[self._generate(t) for t in live])
                await asyncio.gather(*[self._play_turn(t, c, turn) for t, c in zip(live, replies)])
        finally:
            await self._end(trajectories)
        return trajectories

    async def _start(self, trajectories: List[Trajectory]):
        failed = await self._hook('on_trajectory_start', [t.request for t in trajectories]) or {}
        for t in trajectories:
            t.messages = deepcopy(t.request.messages)
            if t.request.uuid in failed:
                t.stop_reason = 'error'
                t.rollout_infos = {'total_reward': 0.0, 'error': failed[t.request.uuid]}
                continue
            if not self.record.start(t, self._room()):
                t.stop_reason = 'context_limit'

    async def _play_turn(self, t: Trajectory, completion, turn: int):
        """One turn, once the engine has replied: the reply joins the conversation; if the game
        goes on, step makes the next request, and the token record and conversation follow it."""
        self._take_reply(t, completion, turn)
        reason, sampled = await self._finished(t, completion, turn), list(completion.token_ids)
        if reason:
            t.stop_reason = reason
            self.record.add(t, sampled, [1] * len(sampled), completion.logprobs, turn)
            self.record.close_turn(t, sampled)
            return
        before = deepcopy(t.request.messages)  # the hook may edit them
        ret = await self._hook('step', t.request, completion, turn)
        t.request = ret['infer_request']
        t.rollout_infos.update(ret.get('rollout_infos') or {})
        ids, mask, logprobs = self._response(ret, completion, sampled)
        self.record.add(t, ids, mask, logprobs, turn)
        fits = self.record.follow(t, before, ids, self._room(), bool(ret.get('response_token_ids')))
        self.record.extend_conversation(t, before)
        t.stop_reason = None if fits else 'context_limit'

    def _room(self) -> int:  # the most ids a segment may hold before a reply: one must still fit
        return self.max_model_len - self.max_completion_length

    def _take_reply(self, t: Trajectory, completion, turn: int):
        """The reply as text (response_choice.message), in the model's view and the whole game."""
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        completion.message = SimpleNamespace(role='assistant', content=text)
        for messages in (t.request.messages, t.messages):
            if messages[-1]['role'] == 'assistant':  # the reply continues the last assistant one
                messages[-1]['content'] += text
            else:
                messages.append({'role': 'assistant', 'content': text})
        t.num_turns = turn

    async def _finished(self, t: Trajectory, completion, turn: int) -> Optional[str]:
        """The stop reason if this turn ends the trajectory, else None: on_turn_end's 'done' when
        it says, else check_finished's verdict; the last turn ends it in any case."""
        result = await self._hook('on_turn_end', t.request, completion, turn)
        t.rollout_infos.update(result.get('rollout_infos') or {})
        if 'done' in result:  # on_turn_end's verdict overrides check_finished, as in ms-swift
            done, reason = result['done'], result.get('stop_reason', 'done')
        else:
            done = await self._hook('check_finished', t.request, completion, turn)
            reason = 'length' if completion.finish_reason == 'length' else 'done'
            reason = 'max_turns' if reason == 'done' and turn >= self.max_turns else reason
        return reason if done else 'max_turns' if turn >= self.max_turns else None

    def _response(self, ret: dict, completion, sampled: List[int]):
        """This turn's (ids, loss mask, logprobs): the sampled reply, or what step returned,
        checked: 1 only on sampled ids at their sampled positions, one logprob per such id."""
        ids = list(ret.get('response_token_ids') or sampled)
        mask = list(ret.get('response_loss_mask') or [1] * len(ids))
        same = next((k for k, (a, b) in enumerate(zip(ids, sampled)) if a != b),
                    min(len(ids), len(sampled)))  # ids[:same] are still the sampled ones
        trained = [k for k, m in enumerate(mask) if m]  # positions: each must hold a sampled id
        lp = completion.logprobs
        logprobs = list(ret.get('rollout_logprobs') or [lp[k] for k in trained if k < same])
        if (len(mask) != len(ids) or any(k >= same for k in trained)
                or len(logprobs) != len(trained)):
            raise UserError(f'{type(self).__name__}.step: response_loss_mask must be as long as '
                            'response_token_ids, 1 only on sampled ids at their sampled positions '
                            '(all before them unchanged); rollout_logprobs one per such id')
        return ids, mask, logprobs

    async def _end(self, trajectories: List[Trajectory]):
        await self._hook('on_trajectory_end', [t.request for t in trajectories])
        for t in trajectories:
            t.stop_reason = t.stop_reason or 'max_turns'
            t.rollout_infos.update(stop_reason=t.stop_reason, num_turns=t.num_turns)
            if t.segments:
                t.segments[-1].messages = t.request.messages

    # ---- the engine, and the hooks' calling convention ----
    async def _generate(self, t: Trajectory):
        """Queue a trajectory for the engine; the first one queued schedules the call, which runs
        once every coroutine that was ready has queued its own (asyncio runs ready callbacks in
        order)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.append((t, future))
        if len(self._queue) == 1:
            loop.call_soon(self._flush)
        return await future

    def _flush(self):
        batch, self._queue = self._queue, []
        try:
            completions = self._complete([t for t, _ in batch])
        except Exception as e:
            completions = [e] * len(batch)
        for (_, future), completion in zip(batch, completions):
            if future.cancelled():  # its run was cancelled while it waited; the others go on
                continue
            failed = isinstance(completion, Exception)
            (future.set_exception if failed else future.set_result)(completion)

    def _complete(self, live: List[Trajectory]):
        """One batched engine call: a reply for each trajectory, from its last segment's ids."""
        return self.infer_engine.generate([t.segments[-1].token_ids for t in live],
                                          self.max_completion_length, self.temperature)

    async def _hook(self, name: str, *args):
        """Call a hook, def or async def; on_turn_end and step must answer with a dict."""
        result = getattr(self, name)(*args)
        result = await result if inspect.isawaitable(result) else result
        wanted = {'on_turn_end': (), 'step': ('infer_request',)}.get(name)
        good = isinstance(result, dict) and all(k in result for k in wanted or ())
        if wanted is not None and not good:
            raise UserError(f'{type(self).__name__}.{name} returned {type(result).__name__}: it '
                            'must return a dict' + (" with 'infer_request'" if wanted else ''))
        return result


class GYMScheduler(MultiTurnScheduler):
    """The document's GYMScheduler: the env (`env_config.name`, else --gym_env) hands out
    observations and rewards through the hooks; a reply that calls a tool the trajectory may call
    (the row's `tools`, else the env's) gets the tool's answer instead (tools.py). rollout_infos:
    total_reward, step_rewards, reset_info and step_infos (the env's info dicts), states (the
    env's state_key before each reply), tools, tool_calls, and `error` when the env raised."""

    def __init__(self, *args, gym_env: Optional[str] = None, tool_timeout: float = 10.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.gym_env, self.tool_timeout = gym_env, tool_timeout
        self._envs, self._infos, self._next = {}, {}, {}  # per uuid; _next: the next message

    async def on_trajectory_start(self, requests):
        errors = await asyncio.gather(*[self._reset(req) for req in requests])  # resets overlap
        return {req.uuid: error for req, error in zip(requests, errors) if error}

    async def _start(self, trajectories):
        await super()._start(trajectories)
        for t in trajectories:  # the env's infos from the start: a game may end before a turn does
            if t.stop_reason != 'error':
                t.rollout_infos.update(self._infos[t.request.uuid])

    async def _reset(self, req) -> Optional[str]:
        env_config = req.data_dict.get('env_config') or {}
        self._infos[req.uuid] = {'total_reward': 0.0, 'step_rewards': [], 'step_infos': [],
                                 'tool_calls': []}
        try:
            self._envs[req.uuid] = env = envs[env_name(req.data_dict, self.gym_env)](env_config)
            env.tools = list(req.data_dict.get('tools', env.tools))  # what this trajectory may call
            observation, info, system_message = await env.reset(req)
            system_message = tools.describe(system_message, env.tools)
            state = self._state(env, observation)
        except Exception as e:
            return f'reset: {type(e).__name__}: {e}'
        if env.tools and not self.record.renders_tools():
            raise UserError("the model's chat template cannot render a {'role': 'tool'} message; "
                            'a tool-using env needs one that can')
        self._infos[req.uuid].update(reset_info=info, states=[state], tools=env.tools)
        req.messages = [{'role': 'system', 'content': system_message},
                        {'role': 'user', 'content': observation}]

    async def on_turn_end(self, req, response_choice, turn):
        env, infos = self._envs[req.uuid], self._infos[req.uuid]
        call = tools.find_call(response_choice.message.content) if env.tools else None
        if call is not None and turn >= self.max_turns:
            return {}  # no turn left to read the answer: the call is not made (check_finished)
        try:
            if call is not None:  # a tool turn: the tool answers, the env waits
                answer, ok = await tools.answer(call, env.tools, self.tool_timeout)
                infos['tool_calls'].append({'turn': turn, 'call': call, 'answer': answer, 'ok': ok})
                observation, reward, done, info = answer, 0.0, False, {'status': 'tool_call'}
            else:
                observation, reward, done, info = await env.step(deepcopy(req.messages))
            state = self._state(env, observation)  # after a tool call: the env's, and the answer
            state = state if call is None else [state, observation]
        except Exception as e:
            infos.update(total_reward=0.0, error=f'step {turn}: {type(e).__name__}: {e}')
            return {'done': True, 'stop_reason': 'error', 'rollout_infos': infos}
        infos['total_reward'] += float(reward)
        infos['step_rewards'].append(float(reward))
        infos['step_infos'].append(info)
        infos['states'].append(state)
        role = 'tool' if call is not None else 'user'
        self._next[req.uuid] = {'role': role, 'content': observation}
        # Not done: check_finished decides (a reply cut by length ends it, as the last turn does).
        return {'done': True, 'rollout_infos': infos} if done else {'rollout_infos': infos}

    def step(self, req, response_choice, turn):
        req.messages.append(self._next.pop(req.uuid))
        return {'infer_request': req}

    @staticmethod
    def _state(env, observation):
        key = env.state_key()
        return observation if key is None else key

    async def on_trajectory_end(self, requests):
        for req in requests:
            self._infos.pop(req.uuid, None)
            self._next.pop(req.uuid, None)
            env = self._envs.pop(req.uuid, None)  # pop: each env is closed exactly once
            if env is not None:
                try:
                    await env.close()
                except Exception as e:  # a failing close must not take the batch down
                    print(f'warning: closing env for {req.uuid} failed: {type(e).__name__}: {e}')


class HintScheduler(GYMScheduler):
    """Example: after an unreadable reply (status 'invalid') the next observation ends with a
    reminder of the format; it only appends, so a trajectory stays one segment."""
    hint = ('Hint: your last reply could not be read. Reply exactly in the format the system '
            'message asks for.')

    def step(self, req, response_choice, turn):
        status = self._infos[req.uuid]['step_infos'][-1].get('status')
        ret = super().step(req, response_choice, turn)
        if status in INVALID:
            req.messages[-1]['content'] += '\n' + self.hint
        return ret


class WindowScheduler(GYMScheduler):
    """Example: the system prompt, the first observation and the last `window` turns (a reply and
    the observation after it); past that it rewrites history: each turn is a segment of its own."""
    window = 2

    def step(self, req, response_choice, turn):
        # BEGIN SOLUTION exercise 5: a scheduler that rewrites history
        ret = super().step(req, response_choice, turn)
        req.messages = req.messages[:2] + req.messages[2:][-2 * self.window:]
        return ret
        # END SOLUTION


class ExpertScheduler(GYMScheduler):
    """The env's expert plays instead of the model (`Env.expert_reply`): the token record a rollout
    makes, with its replies as the sampled tokens (logprob 0). For --warm_start_steps."""

    def _complete(self, live):
        closer = self.record.turn_closer[:1]
        replies = [self.record.encode(self._envs[t.request.uuid].expert_reply(t.request.messages))
                   + closer for t in live]
        return [SimpleNamespace(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason='stop')
                for ids in replies]


# --multi_turn_scheduler names; a plugin adds its own: multi_turns['my_scheduler'] = MyScheduler
multi_turns = {'gym_scheduler': GYMScheduler, 'hint_scheduler': HintScheduler,
               'window_scheduler': WindowScheduler}


def make_scheduler(name: str, engine, tokenizer, *, max_turns: int, gym_env: str,
                   max_model_len: int, max_completion_length: int = 16, tool_timeout: float = 10.0):
    return multi_turns[name](engine, max_turns, tokenizer=tokenizer, gym_env=gym_env,
                             max_model_len=max_model_len, tool_timeout=tool_timeout,
                             max_completion_length=max_completion_length)


def requests_for(rows, group_size) -> List[RolloutInferRequest]:
    """group_size requests per dataset row, consecutive, each with its own uuid and a row copy."""
    return [RolloutInferRequest(deepcopy(row.get('messages', [])),
                                deepcopy({k: v for k, v in row.items() if k != 'messages'}))
            for row in rows for _ in range(group_size)]


def rollout(scheduler: MultiTurnScheduler, requests: List[RolloutInferRequest]) -> List[Trajectory]:
    """run_multi_turn on a fresh event loop (the synchronous callers')."""
    return asyncio.run(scheduler.run_multi_turn(requests))
