"""What simple rules get on FrozenLake's held-out maps, so that every trained number stands next
to them: `python baselines.py` (a few seconds; no model).

Each policy plays every map once, at most --max_turns moves, with FrozenLake's own rules
(`frozen_lake.moved`): the 256 maps train.py evaluates on (seeds 100000..), and 10,000 of them.
- uniform random: any of the four moves;
- toward G, blind to holes: a random move that brings the player nearer G (what the goal line says);
- the goal line's first word: always the first direction `goal_hint` names (rows before columns);
- the first word unless a hole: its other word where the first leads into an adjacent hole;
- toward G, around holes: the same, never into an adjacent hole (any other safe move if it must);
- optimal: the shortest path (BFS), which always exists.

`python baselines.py --forks N` writes a training dataset instead (JSONL on stdout): N maps whose
expert path meets a fork (a cell where both moves toward G are open and one of them is a hole),
half where the goal line's first word leads into the hole and half where its second word does,
so that no word-order rule wins them and only the hole tells the moves apart. With --at_start
the fork is the start itself (19% of maps). --detours K appends K maps whose start needs a
detour (every move toward G leads into a hole; 4% of maps). --name_detours: where the expert takes
a way the goal line does not name, its reply names it too ('Up is a hole. Right is ice.').
--later_detours K appends K maps whose expert path needs a detour after its first move (3%).
forks.jsonl, the default dataset, is `python baselines.py --forks 1024 --at_start --reason
--coin_at_forks 0.25 --detours 256 --name_detours`.

`python baselines.py --completions output/completions.jsonl` reads a run's training games
instead: per step, at the forks its walks met, the moves into the hole (and of them, those into a
hole the reply had just named), around it, and the goal line's first word; at the cells that
need a detour, the moves into a hole and onto ice (docs/results.md).
`python baselines.py --losses output/evals.jsonl` sorts a run's held-out games: won, unfinished,
or where the walk fell in: at a fork, where a detour was needed, or away from G.
"""
import argparse
import json
import random
import re

from frozen_lake import (EVAL_SEED_BASE, MOVES, expert_move, find, fork_hole, generate_random_map,
                         goal_hint, moved, shortest_path)


def toward(grid, cell, goal):
    """The moves that bring the player nearer the goal."""
    def distance(c):
        return abs(c[0] - goal[0]) + abs(c[1] - goal[1])
    return [m for m in MOVES if distance(moved(grid, *cell, m)) < distance(cell)]


def safe(grid, cell, moves):
    return [m for m in moves if grid[moved(grid, *cell, m)[0]][moved(grid, *cell, m)[1]] != 'H']


POLICIES = {
    'uniform random': lambda grid, cell, goal, rng: rng.choice(list(MOVES)),
    'toward G, blind to holes': lambda grid, cell, goal, rng: rng.choice(toward(grid, cell, goal)),
    "the goal line's first word": lambda grid, cell, goal, rng: first_word(grid, cell),
    'the first word unless a hole': lambda grid, cell, goal, rng: (
        safe(grid, cell, goal_words(grid, cell)) or [first_word(grid, cell)])[0],
    'toward G, around holes': lambda grid, cell, goal, rng: rng.choice(
        safe(grid, cell, toward(grid, cell, goal)) or safe(grid, cell, list(MOVES)) or list(MOVES)),
    'optimal (shortest path)': lambda grid, cell, goal, rng: shortest_path(grid, cell)[0],
}


def goal_words(grid, cell) -> list:
    return re.findall(r'up|down|left|right', goal_hint(grid, *cell))


def first_word(grid, cell) -> str:
    return goal_words(grid, cell)[0]


def fork(grid, cell):
    """'first' where both moves toward G are open and the goal line's first word leads into a
    hole, 'second' where its second word does, else None."""
    hole = fork_hole(grid, *cell)
    return None if hole is None else 'first' if hole == first_word(grid, cell) else 'second'


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


def dataset_rows(seeds, env_config: dict) -> list:
    return [{'messages': [{'role': 'user', 'content': '<placeholder>'}],
             'env_config': {'seed': s, **env_config}} for s in seeds]


def needs_detour(grid, cell) -> bool:
    """Every move toward G leads into a hole."""
    return all(grid[r][c] == 'H' for r, c in (moved(grid, *cell, m)
                                              for m in toward(grid, cell, find(grid, 'G'))))


def detour_rows(n: int, env_config: dict, taken=(), first_seed: int = 1000, later=False):
    """n dataset rows of maps whose start needs a detour (each way the goal line names is a hole)
    or, `later`, whose expert path needs one after its first move; none of the seeds `taken`."""
    seeds, seed = [], first_seed
    while len(seeds) < n:
        grid = generate_random_map(seed=seed)
        cells = expert_path(grid)[1:] if later else [find(grid, 'S')]
        if seed not in taken and any(needs_detour(grid, cell) for cell in cells):
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
            kind, move = fork(grid, cell), info.get('action')
            to = tuple(info.get('position', cell))
            if move and not kind and to != cell and needs_detour(grid, cell):  # a bump: neither
                steps.setdefault(game['step'], [0] * 6)[4 if grid[to[0]][to[1]] == 'H' else 5] += 1
            if kind and move:
                words, counts = goal_words(grid, cell), steps.setdefault(game['step'], [0] * 6)
                hole = words[0] if kind == 'first' else words[1]
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
            ahead = [moved(grid, *path[-2], m) for m in toward(grid, path[-2], find(grid, 'G'))]
            outcome = ('away from G' if path[-1] not in ahead else
                       'detour' if needs_detour(grid, path[-2]) else 'fork')
        counts = steps.setdefault((game['step'], game.get('tag', '')), {})
        counts[outcome] = counts.get(outcome, 0) + 1
    return steps


def wins(grid, policy, rng, max_turns: int) -> bool:
    cell, goal = find(grid, 'S'), find(grid, 'G')
    for _ in range(max_turns):
        cell = moved(grid, *cell, policy(grid, cell, goal, rng))
        if grid[cell[0]][cell[1]] in 'GH':
            return grid[cell[0]][cell[1]] == 'G'
    return False


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--max_turns', type=int, default=10, help='most moves a game')
    parser.add_argument('--seed', type=int, default=0, help="the random policies' seed")
    parser.add_argument('--forks', type=int, default=0,
                        help='write a dataset of this many fork maps instead')
    parser.add_argument('--observation', default='around',
                        help="with --forks: the rows' observation (default: around)")
    parser.add_argument('--at_start', action='store_true',
                        help='with --forks: maps whose start is the fork')
    parser.add_argument('--reason', action='store_true',
                        help='with --forks: rows whose replies say what lies toward G first')
    parser.add_argument('--name_detours', action='store_true',
                        help='with --reason: replies that also name a way the expert takes off '
                             'the goal line')
    parser.add_argument('--coin_at_forks', type=float, nargs='?', const=0.5, default=0.0,
                        help='with --forks: rows whose expert steps into the hole at a fork with '
                             'this probability (alone: 0.5, a fair coin)')
    parser.add_argument('--detours', type=int, default=0,
                        help='with --forks: append this many maps whose start needs a detour')
    parser.add_argument('--later_detours', type=int, default=0,
                        help='with --forks: append this many maps whose expert path needs a '
                             'detour after its first move')
    parser.add_argument('--completions', help="print the fork moves of a run's completions.jsonl")
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
        config = {'observation': args.observation, **({'reason': True} if args.reason else {}),
                  **({'name_detours': True} if args.name_detours else {}),
                  **({'coin_at_forks': args.coin_at_forks} if args.coin_at_forks else {})}
        rows = fork_rows(args.forks, config, args.at_start)
        rows += detour_rows(args.detours, config, {row['env_config']['seed'] for row in rows})
        rows += detour_rows(args.later_detours, config, {row['env_config']['seed'] for row in rows},
                            later=True)
        print('\n'.join(json.dumps(row) for row in rows))
    else:
        maps = [generate_random_map(seed=EVAL_SEED_BASE + i) for i in range(10_000)]
        for name, policy in POLICIES.items():
            rng = random.Random(args.seed)
            won = [wins(grid, policy, rng, args.max_turns) for grid in maps]
            print(f'{name:28} {sum(won[:256]) / 256:6.1%} of the 256 held-out maps, '
                  f'{sum(won) / len(won):6.1%} of 10,000')
