"""Environments as services, through OpenEnv (huggingface/OpenEnv): play an env served elsewhere,
and serve any env of ours to ms-swift's or TRL's OpenEnv path.

1. `OpenEnvScheduler` (`--multi_turn_scheduler openenv_scheduler`; ms-swift's names, hooks, state
   and env_config keys `base_url`, `reset_kwargs`, `system_message`): each trajectory plays one
   session of a served env over OpenEnv's WebSocket `/ws` (`OpenEnvWrapper`, on `websockets`),
   replies through `parse_action`, observations through `format_observation`. At most
   `max_concurrent_envs` sessions open at once; each is closed however its trajectory ends; one
   that fails ends only its trajectory, as an env error (never trained).
2. `python openenv_gym.py --gym_env frozen_lake --port 8000` serves a registered `Env` with
   OpenEnv's own server (`create_app`; only this needs `pip install openenv==0.10.0`): a session
   per game, the conversation kept on the server, the reset kwargs its env_config.
Left out: OpenEnv's HTTP /reset and /step (a fresh env per request: no game), MCP tools.
"""
import argparse
import asyncio
import contextlib
import json
import time
import urllib.request
from typing import Optional

# Messages too: ms-swift's OpenEnv schedulers import it from where OpenEnvScheduler comes
from env import Messages, RolloutInferRequest, UserError, envs, load_plugins  # noqa: F401
from scheduler import MultiTurnScheduler, multi_turns


class OpenEnvWrapper:
    """One session of a served env (ms-swift's wrapper: its names and return shapes). A
    connection that fails before the game begins is retried (3 tries, 2 s then 4 s apart, as
    ms-swift); one lost mid-game is not: a new session would be a game that never began."""
    retries, timeout = 3, 60.0

    def __init__(self, env_config):
        self.base_url = env_config.get('base_url', 'http://localhost:8000')
        self.reset_kwargs = env_config.get('reset_kwargs', {})
        self.ws = None

    def _send(self, message: dict) -> dict:
        from websockets.exceptions import ConnectionClosed
        with contextlib.suppress(ConnectionClosed):  # what it said as it closed is read below
            self.ws.send(json.dumps(message))
        answer = json.loads(self.ws.recv(timeout=self.timeout))
        if answer['type'] == 'error':
            data = answer['data']
            raise RuntimeError(f"{self.base_url}: {data.get('message')} ({data.get('code')})")
        return answer['data']

    def reset(self):
        """(observation, metadata) of a new game on a new session."""
        from websockets.sync.client import connect
        for attempt in range(self.retries):
            self.close()
            try:
                self.ws = connect(self.base_url.replace('http', 'ws', 1).rstrip('/') + '/ws',
                                  open_timeout=10, legacy=True)  # kept open until close()
                data = self._send({'type': 'reset', 'data': self.reset_kwargs})
                return data['observation'], data.get('metadata') or {}
            except Exception:
                if attempt == self.retries - 1:
                    self.close()
                    raise
                time.sleep(2.0 * (attempt + 1))

    def step(self, action: dict):
        """(observation, reward, done, metadata) after one action."""
        data = self._send({'type': 'step', 'data': action})
        return (data['observation'], float(data.get('reward') or 0.0), bool(data.get('done')),
                data.get('metadata') or {})

    def close(self):
        """Close the session (the server closes its env); a second call does nothing."""
        ws, self.ws = self.ws, None
        if ws is not None:
            with contextlib.suppress(Exception):  # the server is gone: its side of the session too
                ws.send(json.dumps({'type': 'close'}))
            ws.close()


class OpenEnvScheduler(MultiTurnScheduler):
    """ms-swift's OpenEnvScheduler: a trajectory plays one session of a served env. rollout_infos:
    total_reward, step_rewards, gym_done (and `error`). Per uuid: _envs (the sessions),
    _total_rewards, _step_rewards, _pending_obs (the next user message)."""
    max_concurrent_envs = 4  # sessions opened at once (their resets); the server's cap is its own
    env_config_defaults = {}  # under every row's env_config

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._envs, self._total_rewards, self._step_rewards, self._pending_obs = {}, {}, {}, {}
        self._opening = None  # (event loop, semaphore): a rollout's loop owns the semaphore

    @classmethod
    def check_rows(cls, rows):
        """Before a model loads: every server the rows name answers, else one line naming it."""
        for url in sorted({OpenEnvWrapper(r.get('env_config') or {}).base_url for r in rows}):
            try:
                urllib.request.urlopen(url.rstrip('/') + '/health', timeout=10).read()
            except OSError as e:
                raise UserError(f'the OpenEnv server at {url} does not answer ({e}): start it, '
                                'e.g. python openenv_gym.py --gym_env frozen_lake') from None

    def _create_env(self, env_config) -> OpenEnvWrapper:
        return OpenEnvWrapper(env_config)

    async def _close_and_remove(self, uuid: str):
        wrapper = self._envs.pop(uuid, None)
        for table in (self._total_rewards, self._step_rewards, self._pending_obs):
            table.pop(uuid, None)
        if wrapper is not None:
            await asyncio.to_thread(wrapper.close)

    async def on_trajectory_start(self, requests):
        errors = await asyncio.gather(*[self._open(req) for req in requests])
        return {req.uuid: error for req, error in zip(requests, errors) if error}

    async def _open(self, req: RolloutInferRequest) -> Optional[str]:
        env_config = {**self.env_config_defaults, **(req.data_dict.get('env_config') or {})}
        self._envs[req.uuid] = wrapper = self._create_env(env_config)
        loop = asyncio.get_running_loop()
        if self._opening is None or self._opening[0] is not loop:
            self._opening = loop, asyncio.Semaphore(self.max_concurrent_envs)
        try:
            async with self._opening[1]:
                observation, _ = await asyncio.to_thread(wrapper.reset)
        except Exception as e:
            return f'reset: {type(e).__name__}: {e}'
        system = env_config.get('system_message') or (  # else the one our served envs send
            observation.get('system_message') if isinstance(observation, dict) else None)
        req.messages = ([{'role': 'system', 'content': system}] if system else []) + [
            {'role': 'user', 'content': self.format_observation(observation)}]
        self._total_rewards[req.uuid], self._step_rewards[req.uuid] = 0.0, []
        self._pending_obs[req.uuid] = None

    async def on_turn_end(self, req, response_choice, current_turn):
        wrapper, uuid = self._envs.get(req.uuid), req.uuid
        if wrapper is None:
            return {'done': True, 'rollout_infos': {}}
        try:
            action = self.parse_action(response_choice.message.content)
            observation, reward, done, _ = await asyncio.to_thread(wrapper.step, action)
        except Exception as e:  # the session is lost: this trajectory errs, the others go on
            await self._close_and_remove(uuid)
            return {'done': True, 'stop_reason': 'error', 'rollout_infos': {
                'total_reward': 0.0, 'error': f'step {current_turn}: {type(e).__name__}: {e}'}}
        self._total_rewards[uuid] += reward
        self._step_rewards[uuid].append(reward)
        self._pending_obs[uuid] = None if done else self.format_observation(observation)
        infos = {'total_reward': self._total_rewards[uuid],
                 'step_rewards': list(self._step_rewards[uuid]), 'gym_done': done}
        if done:
            await self._close_and_remove(uuid)
        return {'done': done, 'rollout_infos': infos}  # done False: only --max_turns ends it

    def step(self, infer_request, response_choice, current_turn):
        pending = self._pending_obs.get(infer_request.uuid)
        if pending is not None:
            infer_request.messages.append({'role': 'user', 'content': pending})
        return {'infer_request': infer_request}

    async def on_trajectory_end(self, requests):
        await asyncio.gather(*[self._close_and_remove(req.uuid) for req in requests])

    def parse_action(self, text: str) -> dict:
        """The action (ms-swift's rule): a JSON object (```-fenced too) as it is, else
        {'message': the reply, or str() of the JSON value}."""
        text = text.strip()
        body = '\n'.join(text.splitlines()[1:-1]) if text.startswith('```') else text
        try:
            value = json.loads(body)
        except ValueError:
            return {'message': text}
        return value if isinstance(value, dict) else {'message': str(value)}

    def format_observation(self, observation) -> str:
        """The user message: our served envs' `prompt`, else the observation as JSON (ms-swift)."""
        if isinstance(observation, dict) and isinstance(observation.get('prompt'), str):
            return observation['prompt']
        return json.dumps(observation, ensure_ascii=False, default=str)


multi_turns['openenv_scheduler'] = OpenEnvScheduler


# --------------------------------------------------------- serving our envs with OpenEnv's server

class GymSession:
    """One session's game, for OpenEnv's server (`served_app` mixes it into OpenEnv's
    `Environment`): `reset` kwargs are the env_config (`name` picks the env, else gym_env), `step`
    takes {'message': the newest reply}; the conversation stays here, since our `Env.step` reads
    all of it. `open` counts the sessions opened and not yet closed."""
    SUPPORTS_CONCURRENT_SESSIONS = True  # a session owns its env object
    gym_env, observation_cls, open = 'frozen_lake', None, 0  # set by served_app

    def __init__(self):
        super().__init__()
        self.env, self.loop, self.messages, self._state = None, None, [], None
        type(self).open += 1

    async def reset_async(self, seed=None, episode_id=None, **env_config):
        self.loop = asyncio.get_running_loop()
        await self._close_env()
        config = {**env_config, **({'seed': seed} if seed is not None else {})}
        self.env = envs[config.get('name') or self.gym_env](config)
        observation, info, system = await self.env.reset(
            RolloutInferRequest([], {'env_config': config}))
        self.messages = [{'role': 'system', 'content': system},
                         {'role': 'user', 'content': observation}]
        self._state = {'episode_id': episode_id, 'step_count': 0}
        return self.observation_cls(prompt=observation, system_message=system,
                                    metadata={'info': info})

    async def step_async(self, action, timeout_s=None, **kwargs):
        if self.env is None:
            raise RuntimeError('no game: send reset first')
        self.messages.append({'role': 'assistant', 'content': action.message})
        observation, reward, done, info = await self.env.step([*map(dict, self.messages)])
        self.messages.append({'role': 'user', 'content': observation})
        self._state['step_count'] += 1
        return self.observation_cls(prompt=observation, reward=float(reward), done=bool(done),
                                    metadata={'info': info})

    def reset(self, *args, **kwargs):  # abstract in OpenEnv; its server awaits the async ones
        raise NotImplementedError('reset_async')

    def step(self, *args, **kwargs):
        raise NotImplementedError('step_async')

    @property
    def state(self):
        from openenv.core.env_server import State
        return State(**(self._state or {}))

    async def _close_env(self):
        env, self.env = self.env, None
        if env is not None:
            await env.close()

    def close(self):
        """OpenEnv calls it from the session's worker thread (its HTTP routes, from the loop
        itself): our env closes on the loop it runs on."""
        type(self).open -= 1
        if self.env is None:  # never reset (an HTTP /step, say): nothing to close
            return
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self.loop.create_task(self._close_env())
        elif self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self._close_env(), self.loop).result(30)
        else:
            asyncio.run(self._close_env())


def served_app(gym_env: str, max_concurrent_envs: int):
    """OpenEnv's `create_app`, a `GymSession` per session; GET /sessions: how many are open."""
    from openenv.core.env_server import Action, Environment, Observation, create_app

    class GymAction(Action):
        message: str = ''

    class GymObservation(Observation):
        prompt: str = ''
        system_message: str = ''

    session = type('GymEnvironment', (GymSession, Environment),
                   {'gym_env': gym_env, 'observation_cls': GymObservation, 'open': 0})
    app = create_app(session, GymAction, GymObservation, env_name=gym_env,
                     max_concurrent_envs=max_concurrent_envs)
    app.get('/sessions')(lambda: {'open': session.open})
    return app


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description="Serve a registered env with OpenEnv's server.")
    parser.add_argument('--gym_env', default='frozen_lake', help='env for resets that name none')
    parser.add_argument('--external_plugins', nargs='*', default=[], help='files registering envs')
    parser.add_argument('--host', default='127.0.0.1', help='address to listen on')
    parser.add_argument('--port', type=int, default=8000, help='port to listen on')
    parser.add_argument('--max_concurrent_envs', type=int, default=64,
                        help="sessions at once: at least a step's rows x generations")
    cli = parser.parse_args()
    import arithmetic  # noqa: F401  (registers the built-in envs)
    import frozen_lake  # noqa: F401
    import uvicorn
    try:
        load_plugins(cli.external_plugins)
        if cli.gym_env not in envs:
            raise UserError(f'--gym_env {cli.gym_env}: not registered; registered: '
                            f'{", ".join(sorted(envs))}')
    except UserError as e:
        raise SystemExit(f'error: {e}')
    print(f'OpenEnv server for {cli.gym_env} on http://{cli.host}:{cli.port}', flush=True)
    uvicorn.run(served_app(cli.gym_env, cli.max_concurrent_envs), host=cli.host, port=cli.port,
                log_level='warning')
