"""Server mode: a rollout server holding vLLM, the GYMScheduler and the envs, and the trainer's client.

The document's server mode ("Server 模式"): `swift rollout ...` on one machine, the trainer with
`--vllm_mode server --vllm_server_pass_dataset true` on another. Here:

    python server.py --gym_env frozen_lake --max_turns 10                            # terminal 1
    python train.py --env frozen_lake --vllm_mode server --vllm_server_pass_dataset true   # terminal 2

1. GET /health -> {fingerprint, boot}: the trainer refuses a server whose model architecture or
   tokenizer differs from its own (the weights may differ: they are pushed), and notices a restart.
2. POST /rollout {rows, num_generations, temperature, max_turns, max_completion_length} -> {trajectories}: every trajectory is played
   by GYMScheduler.run(), all concurrently (turns that wait together share one vLLM call); each
   comes back whole, as in colocate mode: token ids, loss mask, logprobs, messages, rollout_infos.
3. POST /update_weights, body = the state dict in safetensors format (no pickle over the wire):
   loaded into vLLM in memory; rollouts use it from the next request on.

Why pass the dataset: the rows' env_config holds the map seed. Without it the server's envs draw a
fresh map per trajectory and the members of a GRPO group no longer play the same map (ms-swift's
own server example has this bug). The client therefore refuses rows with an env_config unless
--vllm_server_pass_dataset is true.

How far this carries: the whole fp32 state dict crosses HTTP after every step (0.5 GB for the 135M
model: about a second on loopback, several seconds per GB on a LAN; fine up to ~1B parameters).
TRL and ms-swift instead broadcast weights GPU to GPU over NCCL, in buckets. Left out: several
servers, asynchronous (off-policy) rollouts, TLS and authentication: it listens on 127.0.0.1 unless
--vllm_server_host says otherwise; only expose it on a network you trust.
"""
import asyncio
import dataclasses
import hashlib
import json
import time
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import List

from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

import train
from env import RolloutInferRequest, UserError, env_name, envs
from scheduler import GYMScheduler, Trajectory


def fingerprint(tokenizer, config) -> str:
    """What trainer and server must share: the architecture and the tokenizer (not the weights)."""
    arch = {k: getattr(config, k, None) for k in ('model_type', 'vocab_size', 'hidden_size', 'num_hidden_layers')}
    blob = json.dumps([arch, sorted(tokenizer.get_vocab().items()), tokenizer.chat_template])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def serve(args: train.Args):
    from transformers import AutoConfig, AutoTokenizer
    train.register_envs(args)
    path = args.model or train.embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = train.VLLMEngine(path, args)
    scheduler = GYMScheduler(engine, tokenizer, max_turns=args.max_turns, gym_env=args.gym_env,
                             max_completion_length=args.max_completion_length, max_model_len=args.vllm_max_model_len)
    identity = {'fingerprint': fingerprint(tokenizer, AutoConfig.from_pretrained(path)), 'boot': uuid.uuid4().hex}

    async def play(requests):
        return await asyncio.gather(*[scheduler.run(r) for r in requests])

    class Handler(BaseHTTPRequestHandler):
        def reply(self, code: int, body: dict):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header('Content-Type', 'application/json')
            self.send_header('Content-Length', str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == '/health':
                return self.reply(200, identity)
            self.reply(404, {'error': f'no route GET {self.path}'})

        def do_POST(self):
            try:
                body = self.rfile.read(int(self.headers.get('Content-Length') or 0))
                if self.path == '/rollout':
                    request = json.loads(body)
                    rows, group_size = request['rows'], int(request['num_generations'])
                    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows) or group_size < 1:
                        raise ValueError('rows must be a list of objects and num_generations at least 1')
                    for row in rows:
                        if env_name({'env_config': row.get('env_config') or {}}, args.gym_env) not in envs:
                            raise ValueError(f"unknown env in row {row}; registered: {', '.join(sorted(envs))}")
                    for key in ('temperature', 'max_turns', 'max_completion_length'):  # the trainer's settings win
                        setattr(scheduler, key, type(getattr(args, key))(request.get(key, getattr(args, key))))
                    trajectories = asyncio.run(play(train.requests_for(rows, group_size)))
                    return self.reply(200, {'boot': identity['boot'],
                                            'trajectories': [dataclasses.asdict(t) for t in trajectories]})
                if self.path == '/update_weights':
                    engine.load_weights(load_safetensors(body).items())
                    return self.reply(200, {'boot': identity['boot']})
                self.reply(404, {'error': f'no route POST {self.path}'})
            except Exception as e:  # a bad request gets its error; the server goes on serving
                bad_input = isinstance(e, (KeyError, TypeError, ValueError)) or 'Safetensor' in type(e).__name__
                self.reply(400 if bad_input else 500, {'error': f'{type(e).__name__}: {e}'})

        def log_message(self, *args):
            pass

    server = HTTPServer((args.vllm_server_host, args.vllm_server_port), Handler)
    print(f'rollout server on http://{args.vllm_server_host}:{args.vllm_server_port} ({path})', flush=True)
    server.serve_forever()


class RolloutClient:
    """The trainer's side: the same rollout / load_weights calls as train.Colocated, over HTTP."""

    def __init__(self, args: train.Args, tokenizer, config):
        self.args, self.url = args, f'http://{args.vllm_server_host}:{args.vllm_server_port}'
        deadline = time.time() + args.vllm_server_timeout
        while True:  # wait for a server that is still starting, but not forever
            try:
                health = self._call('GET', '/health')
                break
            except UserError:
                if time.time() > deadline:
                    raise
                time.sleep(2)
        if health['fingerprint'] != fingerprint(tokenizer, config):
            raise UserError(f'the rollout server at {self.url} serves another model architecture or tokenizer; '
                            'start it with the same --model as the trainer')
        self.boot = health['boot']

    def _call(self, method: str, route: str, body: bytes = None) -> dict:
        request = urllib.request.Request(self.url + route, data=body, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.args.vllm_server_timeout) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as e:
            raise UserError(f'rollout server {route}: HTTP {e.code}: {e.read().decode()[:500]}') from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise UserError(f'the rollout server at {self.url} did not answer {route} ({e}); the last checkpoint '
                            'is intact: restart the server and run again with --resume true') from None
        if 'boot' in answer and getattr(self, 'boot', answer['boot']) != answer['boot']:
            raise UserError(f'the rollout server at {self.url} restarted and lost the trained weights; '
                            'run again with --resume true')
        return answer

    def rollout(self, rows, group_size, temperature) -> List[Trajectory]:
        if not self.args.vllm_server_pass_dataset:
            if any(row.get('env_config') for row in rows):
                raise UserError('the rows carry env_config (e.g. the map seed) but --vllm_server_pass_dataset is false: '
                                'each trajectory of a group would play a different map; pass --vllm_server_pass_dataset true')
            rows = [{'messages': row.get('messages', [])} for row in rows]
        body = json.dumps({'rows': rows, 'num_generations': group_size, 'temperature': temperature,
                           'max_turns': self.args.max_turns, 'max_completion_length': self.args.max_completion_length})
        return [Trajectory(**{**t, 'request': RolloutInferRequest(**t['request'])})
                for t in self._call('POST', '/rollout', body.encode())['trajectories']]

    def load_weights(self, model):
        seen, weights = set(), {}
        for name, tensor in model.state_dict().items():
            # Tied embeddings share memory, which safetensors refuses: send a copy. Send both names,
            # as colocate mode does: vLLM's CPU backend keeps lm_head as its own tensor.
            weights[name] = tensor.detach().clone() if tensor.data_ptr() in seen else tensor.detach().contiguous()
            seen.add(tensor.data_ptr())
        self._call('POST', '/update_weights', save_safetensors(weights))

    def sleep(self):
        pass

    wake_up = sleep


if __name__ == '__main__':
    try:
        serve(train.parse_args())
    except UserError as e:
        raise SystemExit(f'error: {e}')
