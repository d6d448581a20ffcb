"""Simple rules on FrozenLake's held-out maps, the fork datasets, a run's forks and losses.

`python baselines.py` (seconds; no model): what simple rules get, so that every trained number
stands next to them. Each plays every map once, at most --max_turns moves, by FrozenLake's own
rules (`frozen_lake.moved`): the 256 maps train.py evaluates on (seeds 100000..), and 10,000 of
them. "Toward G": a move that brings the player nearer G (a way the goal line names); optimal:
the shortest path (BFS).

`python baselines.py --forks N` writes a training dataset instead (JSONL on stdout): N maps whose
expert path meets a fork (a cell where both moves toward G are open and one of them is a hole),
half where the goal line's first word leads into the hole and half where its second word does,
so that only the hole tells the moves apart; its other flags add maps that need a detour and
shape the expert's replies. forks.jsonl, the default dataset, is `python baselines.py --forks
1024 --at_start --reason --coin_at_forks 0.25 --detours 256 --name_detours`.
`--completions FILE` and `--losses FILE` read a run's games instead (`fork_moves`, `losses`).
"""
import argparse
import json
import random
import re

from frozen_lake import (EVAL_SEED_BASE, MOVES, expert_move, find, fork_hole, generate_random_map,
                         goal_hint, moved, shortest_path)


def goal_words(grid, cell) -> list:
    """The moves the goal line names, in its order (rows before columns)."""
    return re.findall(r'up|down|left|right', goal_hint(grid, *cell))


def toward(grid, cell) -> list:
    """The moves that bring the player nearer G (those the goal line names), in MOVES' order."""
    return sorted(goal_words(grid, cell), key=list(MOVES).index)


def safe(grid, cell, moves) -> list:
    """The moves that do not lead into a hole."""
    return [m for m in moves if grid[moved(grid, *cell, m)[0]][moved(grid, *cell, m)[1]] != 'H']


POLICIES = {  # (grid, cell, rng) -> a move
    'uniform random': lambda grid, cell, rng: rng.choice(list(MOVES)),
    'toward G, blind to holes': lambda grid, cell, rng: rng.choice(toward(grid, cell)),
    "the goal line's first word": lambda grid, cell, rng: goal_words(grid, cell)[0],
    'the first word unless a hole': lambda grid, cell, rng: (
        safe(grid, cell, goal_words(grid, cell)) or goal_words(grid, cell))[0],
    'toward G, around holes': lambda grid, cell, rng: rng.choice(
        safe(grid, cell, toward(grid, cell)) or safe(grid, cell, list(MOVES)) or list(MOVES)),
    'optimal (shortest path)': lambda grid, cell, rng: shortest_path(grid, cell)[0],
}


def wins(grid, policy, rng, max_turns: int) -> bool:
    cell = find(grid, 'S')
    for _ in range(max_turns):
        cell = moved(grid, *cell, policy(grid, cell, rng))
        if grid[cell[0]][cell[1]] in 'GH':
            return grid[cell[0]][cell[1]] == 'G'
    return False


def fork(grid, cell):
    """'first' where both moves toward G are open and the goal line's first word leads into a
    hole, 'second' where its second word does, else None."""
    hole = fork_hole(grid, *cell)
    return None if hole is None else 'first' if hole == goal_words(grid, cell)[0] else 'second'


def needs_detour(grid, cell) -> bool:
    """Every move toward G leads into a hole."""
    return not safe(grid, cell, toward(grid, cell))


def expert_path(grid) -> list:
    """The cells the expert walks from, S first."""
    cell, path = find(grid, 'S'), []
    while grid[cell[0]][cell[1]] != 'G':
        path.append(cell)
        cell = moved(grid, *cell, expert_move(grid, cell))
    return path


def forks(grid) -> list:
    """The forks the expert's path meets, each 'first' or 'second'."""
    return [kind for kind in (fork(grid, cell) for cell in expert_path(grid)) if kind]


def dataset_rows(seeds, env_config: dict) -> list:
    return [{'messages': [{'role': 'user', 'content': '<placeholder>'}],
             'env_config': {'seed': s, **env_config}} for s in seeds]


def fork_rows(n: int, env_config: dict, at_start: bool = False, first_seed: int = 1000):
    """n dataset rows, half of maps whose expert path meets only 'first' forks, half 'second'
    (with at_start: maps whose S is a fork, of either kind alternately), seeds from first_seed."""
    picked, seed = {'first': [], 'second': []}, first_seed
    while min(len(v) for v in picked.values()) < n // 2:
        grid = generate_random_map(seed=seed)
        kinds = {fork(grid, find(grid, 'S'))} - {None} if at_start else set(forks(grid))
        if len(kinds) == 1 and len(picked[min(kinds)]) < n // 2:
            picked[min(kinds)].append(seed)
        seed += 1
    seeds = [s for pair in zip(picked['first'], picked['second']) for s in pair]
    return dataset_rows(seeds, env_config)


def detour_rows(n: int, env_config: dict, taken=(), first_seed: int = 1000, later=False):
    """n dataset rows of maps whose start needs a detour (each way the goal line names is a hole)
    or, `later`, whose expert path needs one after its first move; none of the seeds `taken`."""
    seeds, seed = [], first_seed
    while len(seeds) < n:
        if seed not in taken:  # (a map and its expert path only for seeds still free)
            grid = generate_random_map(seed=seed)
            cells = expert_path(grid)[1:] if later else [find(grid, 'S')]
            if any(needs_detour(grid, cell) for cell in cells):
                seeds.append(seed)
        seed += 1
    return dataset_rows(seeds, env_config)


def fork_moves(games) -> dict:
    """{step: [into the hole, around it, the goal line's first word, into a hole the reply had just
    named, then at detours: into a hole, onto ice]} over the moves made at forks (and at cells that
    need a detour) by the games of a completions.jsonl (each game's map and moves from its
    rollout_infos, its replies from its messages)."""
    steps = {}
    for game in games:
        grid = game['rollout_infos']['reset_info']['grid']
        cell = find(grid, 'S')
        replies = [m['content'] for m in game.get('messages', []) if m['role'] == 'assistant']
        for k, info in enumerate(game['rollout_infos']['step_infos']):
            hole, move = fork_hole(grid, *cell), info.get('action')
            to = tuple(info.get('position', cell))
            if move and not hole and to != cell and needs_detour(grid, cell):  # a bump: neither
                steps.setdefault(game['step'], [0] * 6)[4 if grid[to[0]][to[1]] == 'H' else 5] += 1
            if hole and move:
                words, counts = goal_words(grid, cell), steps.setdefault(game['step'], [0] * 6)
                counts[0] += move == hole
                counts[1] += move in words and move != hole
                counts[2] += move == words[0]
                said = replies[k] if k < len(replies) else ''  # FrozenLake: a reply a step
                counts[3] += move == hole and bool(re.search(rf'\b{move} is a hole', said, re.I))
            cell = to
    return steps


def losses(games) -> dict:
    """{(step, tag): {outcome: games}} over the FrozenLake games of an evals.jsonl. Outcomes:
    'won', 'unfinished', 'error', or the hole's place: 'fork' (another move toward G was open),
    'detour' (every move toward G led into a hole), 'away from G'."""
    steps = {}
    for game in games:
        infos = game['rollout_infos']
        grid, outcome = (infos.get('reset_info') or {}).get('grid'), 'error'
        if grid and not infos.get('error'):
            path = [find(grid, 'S')] + [tuple(i['position']) for i in infos.get('step_infos', [])
                                        if 'position' in i]
            outcome = {'G': 'won', 'H': None}.get(grid[path[-1][0]][path[-1][1]], 'unfinished')
        if outcome is None:
            ahead = [moved(grid, *path[-2], m) for m in toward(grid, path[-2])]
            outcome = ('away from G' if path[-1] not in ahead else
                       'detour' if needs_detour(grid, path[-2]) else 'fork')
        counts = steps.setdefault((game['step'], game.get('tag', '')), {})
        counts[outcome] = counts.get(outcome, 0) + 1
    return steps


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--max_turns', type=int, default=10, help='most moves a game')
    parser.add_argument('--seed', type=int, default=0, help="the random rules' seed")
    data = parser.add_argument_group('a dataset instead (JSONL on stdout)')
    data.add_argument('--forks', type=int, default=0, help='N maps whose expert path meets a fork')
    data.add_argument('--observation', default='around', help="the rows' observation")
    data.add_argument('--at_start', action='store_true', help='the fork is S (19%% of maps)')
    data.add_argument('--reason', action='store_true', help='replies say what lies toward G first')
    data.add_argument('--name_detours', action='store_true',
                      help="with --reason: replies also name the expert's way off the goal line")
    data.add_argument('--coin_at_forks', type=float, nargs='?', const=0.5, default=0.0,
                      help="the expert steps into a fork's hole this often (alone: 0.5)")
    data.add_argument('--detours', type=int, default=0, help='K maps whose S needs a detour (4%%)')
    data.add_argument('--later_detours', type=int, default=0,
                      help='K maps that need one after the first move (3%%)')
    parser.add_argument('--completions', help="count the fork moves of a run's completions.jsonl")
    parser.add_argument('--losses', help="sort the held-out games of a run's evals.jsonl")
    args = parser.parse_args()
    if (args.detours or args.later_detours) and not args.forks:
        parser.error('--detours, --later_detours: only with --forks N')
    if args.name_detours and not args.reason:
        parser.error('--name_detours: only with --reason')
    if args.losses:
        for (step, tag), counts in sorted(losses(map(json.loads, open(args.losses))).items()):
            shares = ', '.join(f'{n} {kind}' for kind, n in sorted(counts.items()))
            print(f'step {step} ({tag}): {shares}')
    elif args.completions:
        for step, (hole, around, first, named, fell, went) in sorted(
                fork_moves(map(json.loads, open(args.completions))).items()):
            print(f'step {step}: at forks, {hole} moves into the hole ({named} named a hole by its '
                  f"reply), {around} around it, {first} the goal line's first word; at detours, "
                  f'{fell} into a hole, {went} onto ice')
    elif args.forks:
        given = {k: getattr(args, k) for k in ('reason', 'name_detours', 'coin_at_forks')}
        config = {'observation': args.observation, **{k: v for k, v in given.items() if v}}
        rows = fork_rows(args.forks, config, args.at_start)
        for n, later in ((args.detours, False), (args.later_detours, True)):
            rows += detour_rows(n, config, {row['env_config']['seed'] for row in rows}, later=later)
        print('\n'.join(json.dumps(row) for row in rows))
    else:
        maps = [generate_random_map(seed=EVAL_SEED_BASE + i) for i in range(10_000)]
        for name, policy in POLICIES.items():
            rng = random.Random(args.seed)
            won = [wins(grid, policy, rng, args.max_turns) for grid in maps]
            print(f'{name:28} {sum(won[:256]) / 256:6.1%} of the 256 held-out maps, '
                  f'{sum(won) / len(won):6.1%} of 10,000')
