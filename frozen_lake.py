"""FrozenLake as a text env, every rule in one file: the document's example
("示例：从零写一个 FrozenLake 环境"). The dynamics equal Gymnasium's
`FrozenLake-v1(desc=..., is_slippery=False)` (test_all.py checks); left out: slippery ice and
ms-swift's reading of the *last* direction word of an untagged reply.

env_config keys: `size` (4), `p` (0.8: P(ice)), `seed` (None: a fresh map each reset),
`observation` ('goal': the grid and where the goal lies; 'around': that and what lies each way;
'position': the player's row and column instead, as ms-swift's plugin), `reason` (false; true:
the reply, and the expert's, first says what lies each way toward the goal, 'Down is a hole, left
is ice.', then the move), `name_detours` (false; true, with reason: where the expert takes a way
the goal line does not name, its reply names that one too: 'Down is a hole. Left is ice.'),
`coin_at_forks` (the expert steps into a fork's hole with this probability; true: 0.5)."""
import random
import re
from collections import deque
from typing import List, Optional

from env import Env, Messages, RolloutInferRequest, envs, reward_funcs

MOVES = {'left': (0, -1), 'down': (1, 0), 'right': (0, 1), 'up': (-1, 0)}  # (d_row, d_col)

SYSTEM_PROMPT = (
    'You are playing FrozenLake on a grid. P is you, G is the goal, H is a hole, F is safe ice, '
    'S is the start.\n'
    'Each turn, move one cell: up, down, left or right. Reach G to win. Falling into H loses. '
    'Moving off the grid leaves you where you are.\n'
    'Reply with your move inside action tags and nothing else, for example: <action>down</action>')
REASON_PROMPT = SYSTEM_PROMPT.split('Reply with')[0] + (  # env_config reason
    'Reply with what lies each way toward the goal, then your move inside action tags, for '
    'example: Down is ice, left is a hole. <action>down</action>')

_TAG = re.compile(r'<action>\s*(\w+)\s*</action>', re.IGNORECASE)
_WORD = re.compile(r'\b(up|down|left|right)\b', re.IGNORECASE)
EVAL_SEED_BASE = 100_000  # held-out maps use seeds 100000.. : far from data.jsonl's 0..127


def find(grid: List[str], cell: str):
    """(row, col) of the first `cell` on the grid."""
    return next((r, c) for r, line in enumerate(grid) for c, ch in enumerate(line) if ch == cell)


def moved(grid: List[str], row: int, col: int, move: str):
    """Where one move leads: one cell that way; off the grid, stay (as in Gymnasium)."""
    last = len(grid) - 1
    return min(max(row + MOVES[move][0], 0), last), min(max(col + MOVES[move][1], 0), last)


def shortest_path(grid: List[str], start=None) -> Optional[List[str]]:
    """BFS to G around the holes, from S or `start` (row, col): the moves; None if G is cut off."""
    start = start or find(grid, 'S')
    parent, queue = {start: None}, deque([start])
    while queue:
        r, c = queue.popleft()
        if grid[r][c] == 'G':
            path, cell = [], (r, c)
            while parent[cell] is not None:
                cell, move = parent[cell]
                path.append(move)
            return path[::-1]
        for move in MOVES:
            nxt = moved(grid, r, c, move)  # off the grid: (r, c) itself, already visited
            if nxt not in parent and grid[nxt[0]][nxt[1]] != 'H':
                parent[nxt] = ((r, c), move)
                queue.append(nxt)
    return None


def expert_move(grid: List[str], cell) -> str:
    """The expert's move from `cell`: one that starts a shortest path to G (BFS), the goal line's
    first word when that one does, else its second word, else the first in MOVES' order. So it is
    the goal line's first word unless that way is a hole (or a longer way round)."""
    words = _WORD.findall(goal_hint(grid, *cell))
    length = len(shortest_path(grid, cell))
    for move in words + list(MOVES):
        r, c = moved(grid, *cell, move)
        rest = shortest_path(grid, (r, c)) if grid[r][c] != 'H' and (r, c) != cell else None
        if rest is not None and len(rest) == length - 1:
            return move


def fork_hole(grid: List[str], row: int, col: int) -> Optional[str]:
    """At a fork, the goal line's way that is a hole; else None. A fork: the goal line names two
    ways and exactly one of them leads into a hole."""
    words = _WORD.findall(goal_hint(grid, row, col))
    holes = [m for m in words if (lambda r, c: grid[r][c])(*moved(grid, row, col, m)) == 'H']
    return holes[0] if len(words) == 2 and len(holes) == 1 else None


def generate_random_map(size: int = 4, p: float = 0.8, seed: Optional[int] = None) -> List[str]:
    """A solvable size x size map as a list of strings over S/G/H/F; p = P(safe ice)."""
    rng = random.Random(seed)
    while True:
        cells = [['F' if rng.random() < p else 'H' for _ in range(size)] for _ in range(size)]
        start, goal = rng.sample(range(size * size), 2)  # two distinct cells
        for cell, name in ((start, 'S'), (goal, 'G')):
            cells[cell // size][cell % size] = name
        grid = [''.join(row) for row in cells]
        if shortest_path(grid) is not None:
            return grid


def render(grid: List[str], row: int, col: int) -> str:
    """The grid as text, one row a line, cells separated by spaces, P where the player stands."""
    return '\n'.join(' '.join('P' if (r, c) == (row, col) else cell for c, cell in enumerate(line))
                     for r, line in enumerate(grid))


def goal_hint(grid: List[str], row: int, col: int) -> str:
    """Where G lies from the player, in the action words: 'The goal is 2 down and 1 left of you.'
    It restates what the grid shows; a 135M model learns to read it far sooner than the grid."""
    goal_row, goal_col = find(grid, 'G')
    d_row, d_col = goal_row - row, goal_col - col
    parts = [f'{abs(d)} {word}' for d, word in ((d_row, 'down' if d_row > 0 else 'up'),
                                                (d_col, 'right' if d_col > 0 else 'left')) if d]
    return f"The goal is {' and '.join(parts)} of you."


def toward_goal(grid: List[str], row: int, col: int) -> str:
    """What lies each way the goal line names, in its order: 'Down is a hole, left is ice.' The
    first half of a reply with env_config reason."""
    return lies(grid, row, col, _WORD.findall(goal_hint(grid, row, col))).capitalize() + '.'


def lies(grid: List[str], row: int, col: int, moves) -> str:
    """'up is ice, down is a hole, left is the edge': what each of `moves` leads to."""
    names, parts = {'S': 'ice', 'F': 'ice', 'H': 'a hole', 'G': 'the goal'}, []
    for move in moves:
        r, c = moved(grid, row, col, move)
        parts.append(f"{move} is {'the edge' if (r, c) == (row, col) else names[grid[r][c]]}")
    return ', '.join(parts)


def parse_action(reply: str) -> Optional[str]:
    """The one move a reply names, or None. `<action>x</action>` tags take precedence, all naming
    the same valid move; with no tag, exactly one direction word ('I go down.' -> 'down'). Several
    moves ('up or down') are invalid, so a model cannot win by listing every direction."""
    tags = _TAG.findall(reply)
    moves = {m.lower() for m in (tags or _WORD.findall(reply))}
    return moves.pop() if len(moves) == 1 and moves <= MOVES.keys() else None


def format_reward(messages: Messages) -> float:
    """The share of the assistant's replies that name one move (parse_action reads them)."""
    replies = [m['content'] for m in messages if m['role'] == 'assistant']
    return sum(parse_action(r) is not None for r in replies) / max(len(replies), 1)


def progress_reward(messages: Messages, falls_gain: bool = True) -> float:
    """How much nearer G the walk ended, as a share of the (Manhattan) distance it began at: 1 at
    G, 0 for no net progress (wandering, bumping an edge, unreadable replies), negative further
    away; replayed from the first board and the replies. A hole ends the walk (with `falls_gain`
    false keeping none of its gain: `safe_progress`). Not `format`: notebook.md, "Why seed 1"."""
    # BEGIN SOLUTION exercise 1: the progress reward
    board = next(m['content'] for m in messages if m['role'] == 'user').splitlines()
    grid = [''.join(cells) for cells in map(str.split, board)
            if cells and all(len(c) == 1 for c in cells)]
    (row, col), goal = find(grid, 'P'), find(grid, 'G')
    start = abs(goal[0] - row) + abs(goal[1] - col)
    for reply in (m['content'] for m in messages if m['role'] == 'assistant'):
        move = parse_action(reply)
        if move:
            row, col = moved(grid, row, col, move)
            if grid[row][col] in 'HG':
                break
    progress = (start - abs(goal[0] - row) - abs(goal[1] - col)) / start
    return progress if falls_gain or grid[row][col] != 'H' else min(progress, 0.0)
    # END SOLUTION


class FrozenLakeEnv(Env):
    default_reward_funcs = {'safe_progress': 0.5}  # what `train.py --env frozen_lake` trains with
    train_defaults = {  # and its recipe (docs/results.md, "The default run"): 12 supervised
        # steps, 4 games a map, the expert's coin at a quarter of forks; 10 GRPO steps of 16 maps
        'dataset': 'forks.jsonl', 'warm_start_steps': 12, 'warm_start_learning_rate': 1e-4,
        'warm_start_generations': 4, 'temperature': 1.0, 'beta': 0.1, 'rows_per_step': 16,
        'max_completion_length': 24, 'max_steps': 10, 'eval_steps': 10}
    eval_seed_base, success_reward = EVAL_SEED_BASE, 1.0  # held-out maps; a win: reaching G

    @classmethod
    def draw(cls, ax, rollout_infos):
        """The map and the path walked from S (invalid replies and bumps into the edge stay put)."""
        from matplotlib.patches import Rectangle  # here: the env itself needs no matplotlib
        grid = rollout_infos.get('reset_info', {}).get('grid')
        if grid is None:  # its env raised before a map was made
            return ax.set_title(rollout_infos.get('stop_reason'), fontsize=9)
        colours = {'S': '#cfe8fc', 'F': '#cfe8fc', 'H': '#1f3b57', 'G': '#ffd54f'}
        for r, line in enumerate(grid):
            for c, cell in enumerate(line):
                ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, facecolor=colours[cell],
                                       edgecolor='white', lw=2))
                if cell in 'SG':
                    ax.text(c, r, cell, ha='center', va='center', fontsize=14, weight='bold',
                            zorder=3)
        steps = rollout_infos.get('step_infos', [])
        path = [find(grid, 'S')] + [tuple(i['position']) for i in steps if 'position' in i]
        ax.plot([c for r, c in path], [r for r, c in path], '-o', color='#d62728', lw=3, ms=5,
                alpha=0.8)
        ax.set(xlim=(-0.5, len(grid) - 0.5), ylim=(len(grid) - 0.5, -0.5), xticks=[], yticks=[],
               aspect='equal')
        last = steps[-1].get('status') if steps else None
        end = last if last in ('goal', 'hole') else rollout_infos.get('stop_reason')
        ax.set_title(f'{end}, {len(steps)} replies', fontsize=9)

    def __init__(self, env_config):
        super().__init__(env_config)
        self.size = int(env_config.get('size', 4))
        self.p = float(env_config.get('p', 0.8))
        seed = env_config.get('seed')
        self.seed = int(seed) if seed is not None else None
        self.reason = bool(env_config.get('reason', False))
        self.name_detours = bool(env_config.get('name_detours', False))
        self.observation = env_config.get('observation', 'goal')
        coin = env_config.get('coin_at_forks', False)  # true: a fair coin; a number: P(the hole)
        self.coin_at_forks = 0.5 if coin is True else float(coin)
        if self.observation not in ('goal', 'around', 'position'):
            raise ValueError(f'env_config observation {self.observation!r}: choose goal, around or '
                             'position')

    def board(self) -> str:
        """The grid with the player, then (env_config observation) 'goal': where the goal lies;
        'around': that, and what lies each way; 'position': only where the player is, the
        information ms-swift's FrozenLake plugin gives."""
        goal = goal_hint(self.grid, self.row, self.col)
        around = lies(self.grid, self.row, self.col, ('up', 'down', 'left', 'right'))
        where = {'goal': goal, 'around': f'{goal} Around you: {around}.',
                 'position': f'You are in row {self.row + 1}, column {self.col + 1} (counting from '
                             'the top left).'}
        return f'{render(self.grid, self.row, self.col)}\n{where[self.observation]} Your move?'

    async def reset(self, config: RolloutInferRequest):
        self.grid = generate_random_map(self.size, self.p, self.seed)
        self.row, self.col = find(self.grid, 'S')
        game = config.data_dict.get('expert_game', 0) if config else 0  # the warm start's k-th
        # game's coin: a stream of its own (the map's, Random(seed), would tie it to the cells)
        self.coin = random.Random(None if self.seed is None else f'coin/{self.seed}/{game}')
        system = REASON_PROMPT if self.reason else SYSTEM_PROMPT
        return self.board(), {'seed': self.seed, 'grid': self.grid}, system

    async def step(self, action: Messages):
        move = parse_action(action[-1]['content'])
        if move is None:
            observation = ('Invalid reply. Answer with exactly one of <action>up</action>, '
                           '<action>down</action>, <action>left</action>, <action>right</action>.'
                           f'\n{self.board()}')
            return observation, 0.0, False, {'status': 'invalid', 'action': None}
        self.row, self.col = moved(self.grid, self.row, self.col, move)
        cell = self.grid[self.row][self.col]
        board = render(self.grid, self.row, self.col)
        info = {'action': move, 'position': [self.row, self.col]}
        if cell == 'G':
            return (f'You moved {move} and reached the goal.\n{board}', 1.0, True,
                    {**info, 'status': 'goal'})
        if cell == 'H':
            return (f'You moved {move} and fell into a hole.\n{board}', 0.0, True,
                    {**info, 'status': 'hole'})
        return f'You moved {move}.\n{self.board()}', 0.0, False, {**info, 'status': 'ok'}

    def state_key(self):
        return self.row, self.col  # the map is the group's: the cell is the state

    def expert_reply(self, messages=None):
        at = self.grid, self.row, self.col
        move = expert_move(self.grid, (self.row, self.col))
        hole = fork_hole(*at)
        if hole and self.coin_at_forks and self.coin.random() < self.coin_at_forks:
            move = hole  # a fork decided by a coin: the supervised phase leaves it to the reward
        if not self.reason:
            return f'<action>{move}</action>'
        where = goal_hint(*at) + ' ' if self.observation == 'position' else ''  # it shows none
        said = toward_goal(*at)
        if self.name_detours and move not in _WORD.findall(goal_hint(*at)):
            said += f' {lies(*at, [move]).capitalize()}.'  # a detour (or a longer way)
        return f'{where}{said} <action>{move}</action>'

    async def close(self):
        pass


envs['frozen_lake'] = FrozenLakeEnv
reward_funcs['format'] = format_reward
reward_funcs['progress'] = progress_reward
progress_reward.per_turn = True  # a potential of the cell reached: GiGPO may split it by turn
reward_funcs['safe_progress'] = lambda messages: progress_reward(messages, falls_gain=False)
reward_funcs['safe_progress'].per_turn = True
