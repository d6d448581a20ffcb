"""Server mode: the rollout server, holding vLLM, the scheduler and the envs, on FastAPI.

The document's "Server 模式" (`swift rollout`; the trainer: `train.py --vllm_mode server`, whose
side is `RolloutClient`; the commands are in docs/ms-swift.md):
1. GET /health -> {fingerprint, boot, max_turns, gym_env, weight_pushes}: the trainer refuses
   another architecture, tokenizer or --max_turns, and notices a restart (a new boot id).
2. POST /rollout {rows, num_generations, temperature, max_completion_length} -> {trajectories}:
   each played by the scheduler's run(), all concurrently, returned whole (ids, masks, logprobs).
3. POST /update_weights: the state dict in safetensors format (no pickle over the wire).
The server owns the game (--gym_env, --max_turns, plugins); the trainer sends its sampling
settings with each request. Oversized requests get 413; /health answers during a rollout.
Left out: several servers, asynchronous rollouts, TLS and authentication (it listens on
127.0.0.1 unless --host says otherwise: expose it only on a network you trust).
"""
import asyncio
import dataclasses
import hashlib
import json
import os
import threading
import time
import urllib.error
import urllib.request
import uuid
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

from pydantic import BaseModel, Field, ValidationError

import config
import arithmetic  # noqa: F401  (registers envs['arithmetic'] and tools['calculator'])
import frozen_lake  # noqa: F401  (registers envs['frozen_lake'])
import openenv_gym  # noqa: F401  (registers multi_turns['openenv_scheduler'])
from env import RolloutInferRequest, UserError, env_name, envs
from scheduler import GYMScheduler, make_scheduler, requests_for
from trajectory import Segment, Trajectory

MAX_ROLLOUT_BYTES = 16 * 2**20  # a /rollout body: rows are small; this is thousands of them


class RolloutRequest(BaseModel):
    rows: List[Dict[str, Any]]
    num_generations: int = Field(ge=1)
    temperature: float = Field(ge=0)
    max_completion_length: int = Field(ge=1)


SHARED = ('model', 'gym_env', 'external_plugins', 'multi_turn_scheduler', 'max_turns',  # train.py's
          'vllm_max_model_len', 'vllm_kv_cache_gib', 'vllm_gpu_memory_utilization', 'torch_dtype',
          'tool_timeout', 'seed')


def parse_args(argv=None):
    """train.py's flags that concern the game and the engine (config.py), and the server's own."""
    parser = config.parser(__doc__.split('\n')[0], SHARED)
    parser.add_argument('--host', default='127.0.0.1',
                        help='address to listen on (default: 127.0.0.1)')
    parser.add_argument('--port', type=int, default=8000, help='port to listen on (default: 8000)')
    parser.add_argument('--max_trajectories', type=int, default=1024,
                        help='most trajectories one request may ask for (default: 1024)')
    given = vars(parser.parse_args(argv))
    own = {k: given.pop(k) for k in ('host', 'port', 'max_trajectories')}
    args = config.with_train_defaults({k: v for k, v in given.items() if v is not None})
    config.check_game(args)
    if own['max_trajectories'] < 1:
        raise UserError(f"--max_trajectories {own['max_trajectories']}: at least 1")
    return SimpleNamespace(**{k: getattr(args, k) for k in SHARED}, **own)


async def read_body(request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to pass `limit` bytes."""
    from fastapi import HTTPException
    too_big = HTTPException(413, f'request body over the limit of {limit} bytes')
    if int(request.headers.get('content-length') or 0) > limit:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    return bytes(body)


async def run_all(scheduler, requests):  # each trajectory by its own run(), as in ms-swift
    return await asyncio.gather(*[scheduler.run(r) for r in requests])


def checked_request(body: bytes, max_trajectories: int, gym_env: Optional[str]):
    """The /rollout request, or an HTTP error that says what is wrong with it; gym_env None: the
    scheduler plays no env, so rows need none."""
    from fastapi import HTTPException
    try:
        request = RolloutRequest.model_validate_json(body)
    except ValidationError as e:
        first = e.errors()[0]
        raise HTTPException(422, f'bad rollout request: {first["loc"]}: {first["msg"]}') from None
    if len(request.rows) * request.num_generations > max_trajectories:
        raise HTTPException(413, f'{len(request.rows)} rows x {request.num_generations} '
                                 f'generations is over the limit of {max_trajectories} '
                                 'trajectories per request (server.py --max_trajectories)')
    for i, row in enumerate(request.rows if gym_env else []):
        if env_name(row, gym_env) not in envs:
            raise HTTPException(422, f"row {i}: env {env_name(row, gym_env)!r} is not registered; "
                                     f"registered: {', '.join(sorted(envs))}")
    return request


def build_app(scheduler, engine, identity: dict, max_trajectories: int, max_weight_bytes: int):
    """The HTTP routes; rollouts and weight pushes take turns on the engine in a worker thread."""
    from fastapi import FastAPI, HTTPException, Request
    from safetensors.torch import load as load_safetensors
    app, engine_lock = FastAPI(), threading.Lock()
    gym_env = identity['gym_env'] if isinstance(scheduler, GYMScheduler) else None

    def play(request: RolloutRequest):
        with engine_lock:
            scheduler.temperature = request.temperature
            scheduler.max_completion_length = request.max_completion_length
            requests = requests_for(request.rows, request.num_generations)
            trajectories = asyncio.run(run_all(scheduler, requests))
        return [dataclasses.asdict(t) for t in trajectories]

    def push(body: bytes):
        with engine_lock:
            engine.load_weights(load_safetensors(body).items())
            identity['weight_pushes'] += 1

    app.get('/health')(lambda: identity)

    @app.post('/rollout')
    async def rollout(http: Request):
        request = checked_request(await read_body(http, MAX_ROLLOUT_BYTES), max_trajectories,
                                  gym_env)
        trajectories = await asyncio.to_thread(play, request)
        return {'boot': identity['boot'], 'trajectories': trajectories}

    @app.post('/update_weights')
    async def update_weights(http: Request):
        body = await read_body(http, max_weight_bytes)
        try:
            await asyncio.to_thread(push, body)  # a thread: the loop still answers /health
        except Exception as e:  # not safetensors, or tensors the model does not have
            raise HTTPException(400, f'bad weights: {type(e).__name__}: {e}') from None
        return {'boot': identity['boot']}

    return app


# ------------------------------------------------ the trainer's side: train.py --vllm_mode server

def fingerprint(tokenizer, config) -> str:
    """What trainer and server must share: the architecture and the tokenizer (not the weights)."""
    keys = ('model_type', 'vocab_size', 'hidden_size', 'num_hidden_layers')
    arch = {k: getattr(config, k, None) for k in keys}
    blob = json.dumps([arch, sorted(tokenizer.get_vocab().items()), tokenizer.chat_template])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class RolloutClient:
    """The trainer's side of server mode: the same calls as Colocated, over HTTP to server.py."""

    def __init__(self, url: str, tokenizer, config, max_turns: int, max_completion_length: int,
                 pass_dataset: bool, timeout: float):
        self.url, self.timeout, self.pass_dataset = url, timeout, pass_dataset
        self.max_completion_length = max_completion_length
        deadline = time.time() + timeout
        while True:  # wait for a server that is still starting, but not forever
            try:
                health = self._call('GET', '/health')
                break
            except UserError:
                if time.time() > deadline:
                    raise
                time.sleep(2)
        if health['fingerprint'] != fingerprint(tokenizer, config):
            raise UserError(f'the rollout server at {url} serves another model architecture or '
                            'tokenizer; start it with the same --model as the trainer')
        if health['max_turns'] != max_turns:
            raise UserError(f"--max_turns {max_turns}: the rollout server at {url} plays "
                            f"{health['max_turns']} turns; the server owns it: give both the same "
                            '--max_turns')
        self.boot = health['boot']

    def _call(self, method: str, route: str, body: bytes = None) -> dict:
        request = urllib.request.Request(self.url + route, data=body, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode()[:500]
            raise UserError(f'rollout server {route}: HTTP {e.code}: {detail}') from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise UserError(f'the rollout server at {self.url} did not answer {route} ({e}); the '
                            'last checkpoint is intact: restart the server and run again with '
                            '--resume true') from None
        if 'boot' in answer and getattr(self, 'boot', answer['boot']) != answer['boot']:
            raise UserError(f'the rollout server at {self.url} restarted and lost the trained '
                            'weights; run again with --resume true')
        return answer

    def rollout(self, rows, group_size, temperature) -> List[Trajectory]:
        if not self.pass_dataset and any(row.get('env_config') for row in rows):
            raise UserError('the rows carry env_config (e.g. the map seed) but '
                            '--vllm_server_pass_dataset is false: each trajectory of a group '
                            'would play a different map; pass --vllm_server_pass_dataset true')
        sent = rows if self.pass_dataset else [{'messages': r.get('messages', [])} for r in rows]
        body = json.dumps({'rows': sent, 'num_generations': group_size, 'temperature': temperature,
                           'max_completion_length': self.max_completion_length})
        games = [Trajectory(**{**t, 'request': RolloutInferRequest(**t['request']),
                               'segments': [Segment(**s) for s in t['segments']]})
                 for t in self._call('POST', '/rollout', body.encode())['trajectories']]
        for i, t in enumerate(games):  # the rows' columns, for the rewards, even if not sent
            t.request.data_dict = {**rows[i // group_size], **t.request.data_dict}
            t.request.data_dict.pop('messages', None)
        return games

    def load_weights(self, model):
        """Push the policy's weights to the server in safetensors format: under torchrun from rank
        0 only (every process holds the same weights), the others waiting until they are there."""
        import torch.distributed as dist
        from safetensors.torch import save
        from engines import policy_weights
        if not dist.is_initialized() or dist.get_rank() == 0:
            # tied embeddings share memory, which safetensors refuses: the second name gets a copy
            # (both names go, as in colocate mode: vLLM's CPU backend keeps lm_head as its own)
            seen, weights = set(), {}
            with policy_weights(model) as pairs:
                for name, tensor in pairs:
                    cpu = tensor.detach().cpu()
                    weights[name] = cpu.clone() if tensor.data_ptr() in seen else cpu.contiguous()
                    seen.add(tensor.data_ptr())
                body = save(weights)
            self._call('POST', '/update_weights', body)
        if dist.is_initialized():
            dist.barrier()  # no process rolls out on the old weights

    def sleep(self):
        pass

    wake_up = close = sleep  # (the server keeps its engine)


def serve(args):
    os.environ.setdefault('TORCH_CPP_LOG_LEVEL', 'ERROR')  # read as torch loads: quiets a NUMA line
    import torch
    import uvicorn
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from engines import VLLMEngine
    from models import embedded_model, quiet
    quiet()
    path = args.model or embedded_model()
    tokenizer, config = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    with torch.device('meta'):  # the size of an fp32 state dict, without allocating one
        shapes = AutoModelForCausalLM.from_config(config).state_dict().values()
        weight_bytes = sum(4 * t.numel() for t in shapes)
    engine = VLLMEngine(path, args.seed, args.vllm_max_model_len, args.vllm_kv_cache_gib,
                        args.vllm_gpu_memory_utilization, dtype=args.torch_dtype)
    scheduler = make_scheduler(args.multi_turn_scheduler, engine, tokenizer, gym_env=args.gym_env,
                               max_turns=args.max_turns, max_model_len=args.vllm_max_model_len,
                               tool_timeout=args.tool_timeout)
    identity = {'fingerprint': fingerprint(tokenizer, config), 'boot': uuid.uuid4().hex,
                'max_turns': args.max_turns, 'gym_env': args.gym_env, 'weight_pushes': 0}
    app = build_app(scheduler, engine, identity, args.max_trajectories, weight_bytes + 2**20)
    print(f'rollout server on http://{args.host}:{args.port} ({path})', flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level='warning')


if __name__ == '__main__':
    try:
        serve(parse_args())
    except UserError as e:
        raise SystemExit(f'error: {e}')
