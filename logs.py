"""What a run measures and writes (README, "Outputs and metrics", defines every key).

1. Each step: a line under a progress bar, a metrics.jsonl record, and a completions.jsonl line
   per trajectory (the document: the env's info dicts go there).
2. Each evaluation: a line (success with its Wilson interval), two games decoded (the model's own
   tokens in [[...]]), a metrics.jsonl record and an evals.jsonl line per game.
3. At the end: curve.png, and agent.png when the env draws (`Env.draw`).
With --report_to, TensorBoard or wandb too. Under torchrun, rank 0 writes every process's records.
"""
import json
import math
import os
from itertools import groupby
from typing import Optional

import torch
from tqdm import tqdm

import grpo
from env import INVALID, env_name
from trajectory import Trajectory


def valid_share(trajectories) -> Optional[float]:
    """Share of env steps (tool calls aside) not `status: invalid`; None: the env says no status."""
    statuses = [i['status'] for t in trajectories for i in t.rollout_infos.get('step_infos', [])
                if i.get('status', 'tool_call') != 'tool_call']
    return sum(s not in INVALID for s in statuses) / len(statuses) if statuses else None


def tool_use(trajectories) -> dict:
    """TRL's tools/call_frequency and tools/failure_frequency, when some trajectory could call a
    tool. A call is a reply with a <tool_call> tag, a malformed one too (TRL counts parsed ones)."""
    if not any(t.rollout_infos.get('tools') for t in trajectories):
        return {}
    calls = [c for t in trajectories for c in t.rollout_infos.get('tool_calls', [])]
    failed = sum(not c['ok'] for c in calls)
    return {'tools/call_frequency': len(calls) / len(trajectories),
            'tools/failure_frequency': failed / len(calls) if calls else 0.0}


def success_interval(successes: int, n: int, z: float = 1.96):
    """Wilson 95% interval of a success rate."""
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def show(trajectory: Trajectory, tokenizer) -> str:
    """A trajectory decoded, the model's own tokens in [[...]], a line between its segments."""
    text = ''
    for k, segment in enumerate(trajectory.segments):
        text += f'\n---- segment {k + 1}\n' if k else ''
        for sampled, run in groupby(zip(segment.token_ids, segment.loss_mask), key=lambda p: p[1]):
            piece = tokenizer.decode([token for token, _ in run])
            text += f'[[{piece}]]' if sampled else piece
    infos = trajectory.rollout_infos
    return text + f"\n  -> {infos.get('stop_reason')}, reward {infos.get('total_reward')}"


def mean(values):
    """The mean over processes of a step's stat (one process: the value; None stays None)."""
    numbers = [v for v in values if v is not None]
    return values[0] if len(values) == 1 else sum(numbers) / len(numbers) if numbers else None


def fmt(value, spec: str) -> str:
    return 'n/a' if value is None else format(value, spec)


class RunLog:
    """Everything a run writes. Only rank 0 of a torchrun run writes (active); the others skip."""

    def __init__(self, output_dir: str, tokenizer, column_names, gym_env: str, report_to=(),
                 active: bool = True):
        self.output_dir, self.tokenizer, self.gym_env = output_dir, tokenizer, gym_env
        self.column_names, self.active, self.dashboards = column_names, active, []
        self.games = []  # (step, rollout_infos of its first games) per evaluation
        if not active:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.metrics = open(os.path.join(output_dir, 'metrics.jsonl'), 'a')
        self.completions = open(os.path.join(output_dir, 'completions.jsonl'), 'a')
        self.evals = open(os.path.join(output_dir, 'evals.jsonl'), 'a')
        if 'tensorboard' in report_to:  # `tensorboard --logdir OUTPUT_DIR/runs` shows it live
            from torch.utils.tensorboard import SummaryWriter
            self.dashboards.append(SummaryWriter(os.path.join(output_dir, 'runs')))
        if 'wandb' in report_to:  # offline: `wandb sync OUTPUT_DIR/wandb/offline-run-*` uploads it
            import wandb
            self.dashboards.append(wandb.init(dir=output_dir, mode='offline', project='gym-grpo'))

    def progress(self, steps, start: int, total: int):
        return tqdm(steps, desc='steps', initial=start, total=total) if self.active else steps

    def _write(self, record: dict, text: str = None):
        """One metrics.jsonl record, also to the dashboards (numbers as scalars, `text` as text)."""
        self.metrics.write(json.dumps(record) + '\n')
        self.metrics.flush()
        numbers = {k: v for k, v in record.items() if k != 'step' and isinstance(v, (int, float))}
        for board in self.dashboards:
            if hasattr(board, 'add_scalar'):  # TensorBoard
                for key, value in numbers.items():
                    board.add_scalar(key, value, record['step'])
                if text:
                    board.add_text('examples', text.replace('\n', '  \n'), record['step'])
                board.flush()
            else:  # wandb
                board.log({**numbers, **({'examples': text} if text else {})}, step=record['step'])

    def step(self, step: int, parts, group_size: int):
        """metrics.jsonl and completions.jsonl records of one step, and its line. parts: per
        process, (trajectories, grpo.Scores, update stats)."""
        if not self.active:
            return
        trajectories = sum((p[0] for p in parts), [])
        columns, rewards, valid = (torch.cat([getattr(p[1], k) for p in parts])
                                   for k in ('columns', 'rewards', 'valid'))
        stats = {k: mean([p[2][k] for p in parts]) for k in parts[0][2]}
        stats['overlong_filtered'] = sum(int((~p[1].in_loss & p[1].valid).sum()) for p in parts)
        spread = grpo.with_spread(rewards, group_size, valid).view(-1, group_size).any(1)
        record = {
            'step': step,
            'reward': rewards.mean().item(),
            **{f'reward/{n}': columns[:, i].nanmean().item()
               for i, n in enumerate(self.column_names)},
            'zero_adv_groups': 1 - spread.float().mean().item(),
            'env_errors': sum(t.stop_reason == 'error' for t in trajectories),
            'valid_actions': valid_share(trajectories),
            'turns': sum(t.num_turns for t in trajectories) / len(trajectories),
            'sampled_tokens': sum(t.num_sampled for t in trajectories),
            **tool_use(trajectories),
            **stats,
        }
        self._write(record)
        self._completions(step, parts)
        variants = ''.join(f' {key} {stats[key]:.3g}' for key in  # what a switched-on variant did
                           ('resample_rounds', 'overlong_filtered', 'is_clipped') if stats.get(key))
        tqdm.write(f"step {step}: reward {record['reward']:.3f} "
                   f"gym {fmt(record.get('reward/gym'), '.3f')} "
                   f"valid {fmt(record['valid_actions'], '.0%')} turns {record['turns']:.1f} "
                   f"zero-adv {record['zero_adv_groups']:.0%} env-errors {record['env_errors']} "
                   f"loss {stats['loss']:.4f} kl {stats['kl']:.4f} entropy {stats['entropy']:.3f} "
                   f"gap {stats['logprob_gap']:.2e}{variants} "
                   f"| rollout {stats['rollout_s']:.0f}s train {stats['train_s']:.0f}s "
                   f"sync {stats['sync_s']:.1f}s")

    def _completions(self, step: int, parts):
        """completions.jsonl: a line per trajectory of the step (README, "Outputs and metrics")."""
        for trajectories, scores, _ in parts:
            for k, t in enumerate(trajectories):
                line = {'step': step, 'env': env_name(t.request.data_dict, self.gym_env),
                        'env_config': t.request.data_dict.get('env_config'), 'messages': t.messages,
                        'rewards': dict(zip(self.column_names, scores.columns[k].tolist())),
                        'reward': scores.rewards[k].item(),
                        'advantage': scores.advantages[k].item(),
                        'turn_advantages': scores.turn_advantages[k, :t.num_turns].tolist(),
                        'rollout_infos': t.rollout_infos}
                if len(t.segments) > 1:  # a scheduler rewrote history: each segment's conversation
                    line['segments'] = [s.messages for s in t.segments]
                self.completions.write(json.dumps(line) + '\n')
        self.completions.flush()

    def evaluation(self, step: int, tag: str, result: dict, seconds: float):
        """An evaluation's line, two of its games decoded, and its metrics.jsonl record (`examples`
        and `games` leave the result: evals.jsonl gets the games, agent.png the first four)."""
        examples, games = result.pop('examples'), result.pop('games')
        self.games.append((step, games[:4]))
        self.evals.writelines(json.dumps({'step': step, 'tag': tag, 'rollout_infos': infos}) + '\n'
                              for infos in games)
        self.evals.flush()
        score = f"reward {result['reward']:.3f}"
        if 'success' in result:
            score = (f"success {result['success']:.1%} [{result['success_low']:.1%}, "
                     f"{result['success_high']:.1%}]")
        print(f"eval {tag} step {step}: {score}, "
              f"valid actions {fmt(result['valid_actions'], '.1%')}, "
              f"turns {result['turns']:.2f} ({seconds:.0f}s)")
        shown = [show(example, self.tokenizer) for example in examples]
        for text in shown:
            print('  example:', text.replace('\n', '\n  '))
        self._write({'step': step, **{f'eval/{k}': v for k, v in result.items()}},
                    '\n\n'.join(shown))

    def finish(self, before, after, env_cls):
        """The before/after line, curve.png and agent.png."""
        if not self.active:
            return
        for board in self.dashboards:
            board.close() if hasattr(board, 'close') else board.finish()
        if before and after:
            key, spec = ('success', '.1%') if 'success' in after else ('reward', '.3f')
            print(f'held-out {key}: before {before[key]:{spec}} -> after {after[key]:{spec}}')
        plot(self.output_dir)
        if self.games and env_cls.draw:  # before GRPO (after a warm start, if any) and after it
            before = [games for games in self.games if games[0] <= 0] or self.games[:1]
            draw_games(self.output_dir, [before[-1], self.games[-1]], env_cls)


def plot(output_dir: str):
    """curve.png: the training gym reward of each GRPO step, and held-out success (or reward)
    with its interval; a warm start's evaluations are at -warm_start_steps (the untrained model)
    and 0, its steps shaded."""
    from matplotlib.figure import Figure  # no pyplot: nothing is shown, the figure is saved
    records = [json.loads(line) for line in open(os.path.join(output_dir, 'metrics.jsonl'))]
    steps = [r for r in records if 'loss' in r]
    evals = [r for r in records if 'eval/reward' in r]
    key = 'reward/gym' if any('reward/gym' in r for r in steps) else 'reward'
    ax = Figure(figsize=(7, 4)).subplots()
    first = min([r['step'] for r in evals] + [0])
    if first < 0:
        ax.axvspan(first, 0, color='grey', alpha=0.15, label=f'supervised phase ({-first} steps)')
    ax.plot([r['step'] for r in steps], [r[key] for r in steps], alpha=0.5, marker='.',
            label=f'GRPO: training {key} (sampled)')
    if evals and 'eval/success' in evals[-1]:
        ax.errorbar([r['step'] for r in evals], [r['eval/success'] for r in evals], marker='o',
                    capsize=3, label='held-out success (95% CI)',
                    yerr=[[r['eval/success'] - r['eval/success_low'] for r in evals],
                          [r['eval/success_high'] - r['eval/success'] for r in evals]])
    elif evals:
        ax.plot([r['step'] for r in evals], [r['eval/reward'] for r in evals], marker='o',
                label='held-out reward')
    ax.set(xlabel='step (GRPO from 1)', title=os.path.basename(os.path.abspath(output_dir)))
    ax.legend()
    ax.figure.savefig(os.path.join(output_dir, 'curve.png'), dpi=120, bbox_inches='tight')


def draw_games(output_dir: str, evaluations, env_cls):
    """agent.png: one row per evaluation, its first held-out games drawn by the env."""
    from matplotlib.figure import Figure
    columns = max(len(games) for _, games in evaluations)
    fig = Figure(figsize=(2.2 * columns, 2.4 * len(evaluations)))
    axes = fig.subplots(len(evaluations), columns, squeeze=False)
    for row, (step, games) in zip(axes, evaluations):
        for ax, infos in zip(row, games):
            env_cls.draw(ax, infos)
        row[0].set_ylabel(f'step {step}')
    fig.savefig(os.path.join(output_dir, 'agent.png'), dpi=100, bbox_inches='tight')
