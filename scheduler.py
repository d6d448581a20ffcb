"""Multi-turn rollouts: the hook-based `MultiTurnScheduler` and the document's `GYMScheduler`.

Implements "启动训练" and "2. GYMScheduler 的 hook 实现" of the GYM-env document.
1. `on_trajectory_start(requests)`: set up each trajectory (GYMScheduler: make the env, `reset`).
2. Each turn the live trajectories' token ids go to the engine (engines.py): `run_multi_turn` makes
   one batched call per turn (colocate); concurrent `run`s share calls (server). The envs' resets,
   and the steps of one turn, run concurrently: an env waiting on I/O waits once a turn.
3. `on_turn_end(req, completion, turn)` judges the reply: {'done', 'rollout_infos'} (`env.step`).
4. `step(req, completion, turn)` returns {'infer_request': req} for the next turn (GYMScheduler:
   append the next observation). Hooks may only *append* messages: token-in, token-out.
5. `on_trajectory_end(requests)` runs once per trajectory however it ended (close the env).
Sampled ids are kept verbatim (loss_mask 1); template text and observations are tokenized (0).
A trajectory ends 'done', 'max_turns', 'length', 'context_limit' or 'error' (the env raised).

Left out: rewriting history (ms-swift's ContextManager), which needs a training sequence per rewrite.
"""
import asyncio
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from env import RolloutInferRequest, envs


@dataclass
class Trajectory:
    """One trajectory, from rollout to loss: the record env -> scheduler -> grpo pass along."""
    request: RolloutInferRequest
    token_ids: List[int] = field(default_factory=list)  # the whole conversation as the model saw it
    loss_mask: List[int] = field(default_factory=list)  # 1 exactly on the tokens the model sampled
    logprobs: List[float] = field(default_factory=list)  # engine logprobs on sampled tokens, 0.0 elsewhere
    rollout_infos: Dict[str, Any] = field(default_factory=dict)
    stop_reason: Optional[str] = None
    num_turns: int = 0


class MultiTurnScheduler:
    """Drives multi-turn rollouts through hooks; subclasses override the hooks, not the drivers."""

    def __init__(self, engine, tokenizer, max_turns=10, max_completion_length=32, temperature=1.0,
                 max_model_len=2048):
        self.engine, self.tokenizer = engine, tokenizer
        self.max_turns, self.max_completion_length = max_turns, max_completion_length
        self.temperature, self.max_model_len = temperature, max_model_len
        self._queue = []  # (prompt, future) pairs waiting for the engine, see _generate_one
        # The tokens the template puts after an assistant reply ('<|im_end|>\n' for ChatML).
        probe = self._render([{'role': 'user', 'content': 'x'}, {'role': 'assistant', 'content': 'MARK'}])
        self.turn_closer = self._encode(probe[probe.rindex('MARK') + 4:])

    # ---- hooks ----
    async def on_trajectory_start(self, requests: List[RolloutInferRequest]) -> Optional[Dict[str, str]]:
        """Prepare each request's messages. May return {uuid: error} for requests that cannot start."""

    async def on_turn_end(self, req: RolloutInferRequest, completion, turn: int) -> Dict[str, Any]:
        """Judge the newest reply: {'done': bool, 'rollout_infos': dict, optional 'stop_reason'}."""
        return {'done': False}

    async def step(self, req: RolloutInferRequest, completion, turn: int) -> Dict[str, Any]:
        """The request for the next turn: {'infer_request': req}. Only append to req.messages."""
        return {'infer_request': req}

    async def on_trajectory_end(self, requests: List[RolloutInferRequest]) -> None:
        """Called once for every request, however its trajectory ended."""

    # ---- drivers ----
    async def run(self, req: RolloutInferRequest) -> Trajectory:
        """One trajectory (the server-mode path). Run many with asyncio.gather: the turns that are
        waiting for the engine at the same moment share one batched engine call."""
        (t,) = await self._start([req])
        try:
            for turn in range(1, self.max_turns + 1):
                if t.stop_reason:
                    break
                await self._play_turn(t, await self._generate_one(t.token_ids), turn)
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
                completions = self.engine.generate([t.token_ids for t in live], self.max_completion_length,
                                                   self.temperature)
                await asyncio.gather(*[self._play_turn(t, c, turn) for t, c in zip(live, completions)])
        finally:
            await self._end(trajectories)
        return trajectories

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
            completions = self.engine.generate([p for p, _ in batch], self.max_completion_length, self.temperature)
        except Exception as e:
            completions = [e] * len(batch)
        for (_, future), completion in zip(batch, completions):
            future.set_exception(completion) if isinstance(completion, Exception) else future.set_result(completion)

    def _render(self, messages, add_generation_prompt=False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _encode(self, text: str) -> List[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _append(self, t: Trajectory, ids: List[int], sampled=False, logprobs=None):
        t.token_ids += ids
        t.loss_mask += [int(sampled)] * len(ids)
        t.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    async def _start(self, requests) -> List[Trajectory]:
        failed = await self.on_trajectory_start(requests) or {}
        trajectories = [Trajectory(req) for req in requests]
        for t in trajectories:
            if t.request.uuid in failed:
                t.stop_reason, t.rollout_infos = 'error', {'total_reward': 0.0, 'error': failed[t.request.uuid]}
            else:
                self._append(t, self._encode(self._render(t.request.messages, add_generation_prompt=True)))
                if len(t.token_ids) + self.max_completion_length > self.max_model_len:
                    t.stop_reason = 'context_limit'
        return trajectories

    async def _play_turn(self, t: Trajectory, completion, turn: int):
        sampled = completion.token_ids
        self._append(t, sampled, sampled=True, logprobs=completion.logprobs)
        self._append(t, self.turn_closer[1:] if sampled[-1:] == self.turn_closer[:1] else self.turn_closer)
        t.num_turns = turn
        req = t.request
        req.messages.append({'role': 'assistant', 'content': self.tokenizer.decode(sampled, skip_special_tokens=True)})
        result = await self.on_turn_end(req, completion, turn)
        t.rollout_infos.update(result.get('rollout_infos') or {})
        if result.get('done'):
            t.stop_reason = result.get('stop_reason', 'done')
        elif completion.finish_reason == 'length':
            t.stop_reason = 'length'
        elif turn == self.max_turns:
            t.stop_reason = 'max_turns'
        if t.stop_reason:
            return
        history = deepcopy(req.messages)
        t.request = req = (await self.step(req, completion, turn))['infer_request']
        before, after = self._render(history), self._render(req.messages, add_generation_prompt=True)
        if req.messages[:len(history)] != history or not after.startswith(before):
            raise RuntimeError('step() changed earlier messages (or the chat template re-renders old turns); '
                               'token-in/token-out needs an append-only conversation')
        observation = self._encode(after[len(before):])
        if len(t.token_ids) + len(observation) + self.max_completion_length > self.max_model_len:
            t.stop_reason, req.messages[len(history):] = 'context_limit', []  # no room to answer it
        else:
            self._append(t, observation)

    async def _end(self, trajectories: List[Trajectory]):
        await self.on_trajectory_end([t.request for t in trajectories])
        for t in trajectories:
            t.stop_reason = t.stop_reason or 'max_turns'
            t.rollout_infos.update(stop_reason=t.stop_reason, num_turns=t.num_turns)


class GYMScheduler(MultiTurnScheduler):
    """The document's GYMScheduler: the env hands out observations and rewards through the hooks.

    The env is picked per row by `env_config.name`, else by `gym_env` (--gym_env).
    rollout_infos: total_reward, step_rewards, reset_info and step_infos (the env's info dicts),
    plus stop_reason and num_turns from the driver, and `error` when the env raised.
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
        self._infos[req.uuid]['reset_info'] = info
        req.messages = [{'role': 'system', 'content': system_message}, {'role': 'user', 'content': observation}]

    async def on_turn_end(self, req, completion, turn):
        infos = self._infos[req.uuid]
        try:
            observation, reward, done, info = await self._envs[req.uuid].step(deepcopy(req.messages))
        except Exception as e:
            infos.update(total_reward=0.0, error=f'step {turn}: {type(e).__name__}: {e}')
            return {'done': True, 'stop_reason': 'error', 'rollout_infos': infos}
        infos['total_reward'] += float(reward)
        infos['step_rewards'].append(float(reward))
        infos['step_infos'].append(info)
        self._pending_obs[req.uuid] = observation
        return {'done': bool(done), 'rollout_infos': infos}

    async def step(self, req, completion, turn):
        req.messages.append({'role': 'user', 'content': self._pending_obs.pop(req.uuid)})
        return {'infer_request': req}

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


def requests_for(rows, group_size) -> List[RolloutInferRequest]:
    """group_size requests per dataset row, consecutive, each with its own uuid and a copy of the row."""
    return [RolloutInferRequest(messages=deepcopy(row.get('messages', [])),
                                data_dict=deepcopy({k: v for k, v in row.items() if k != 'messages'}))
            for row in rows for _ in range(group_size)]


def rollout(scheduler: MultiTurnScheduler, requests: List[RolloutInferRequest]) -> List[Trajectory]:
    """Synchronous entry point for train.py: run_multi_turn on a fresh event loop."""
    return asyncio.run(scheduler.run_multi_turn(requests))
