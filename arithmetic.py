"""Arithmetic with a calculator: a task where a tool makes a 135M model strong (`--env arithmetic`).

1. A row's `env_config.seed` gives a problem the model cannot work out in its head: 'What is
   4732 * 86 + 119?' (a * b + c or a * b - c; a of three or four digits, b of two, c of three).
2. Its trajectories may call the `calculator` tool (`tools`), unless their row says `"tools": []`.
3. `step`: `<answer>N</answer>` ends the game, reward 1 when N is right, else 0; any other reply:
   status 'invalid', no reward, and the question asked again.
4. The expert (`expert_reply`) calls the calculator, then answers with its result (at once when the
   tool is withheld: it knows; a model must compute).
Beside the env: held-out problems (seeds 100000..), a win (the right answer), `draw` (agent.png).
"""
import ast
import json
import operator
import random
import re

from env import Env, envs
from tools import tools

SYSTEM_PROMPT = ('You solve arithmetic problems exactly. Give the final result as '
                 '<answer>NUMBER</answer> and nothing else.')
ANSWER = re.compile(r'<answer>\s*(-?\d+)\s*</answer>')
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
             ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression exactly: integers, +, -, * and parentheses.

    Args:
        expression: the expression to evaluate, for example "4732 * 86 + 119"
    """
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f'not allowed: {ast.unparse(node)!r} (integers, +, -, * and parentheses '
                         'only)')
    return str(value(ast.parse(expression, mode='eval').body))


class ArithmeticEnv(Env):
    tools = ['calculator']
    train_defaults = {'warm_start_steps': 8, 'max_steps': 8, 'max_turns': 3,  # docs/results.md
                      'max_completion_length': 48}
    eval_seed_base, success_reward = 100_000, 1.0  # held out: far from data.jsonl's 0..127

    @classmethod
    def draw(cls, ax, rollout_infos):
        """The problem, each tool call and its answer, and the model's answer."""
        info, steps = rollout_infos['reset_info'], rollout_infos.get('step_infos', [])
        lines = [f"{info['expression']} = {info['value']}"]
        lines += [f"calculator: {c['answer']}" if c['ok'] else 'a failed call'
                  for c in rollout_infos.get('tool_calls', [])]
        answered = steps and 'answer' in steps[-1]
        lines.append(f"answer: {steps[-1]['answer']}" if answered else 'no answer')
        ax.text(0.05, 0.5, '\n'.join(lines), va='center', family='monospace', fontsize=8)
        ax.set(xticks=[], yticks=[], title=rollout_infos.get('stop_reason'))
        ax.set_facecolor('#d9f2d9' if cls.is_success(rollout_infos) else '#f8d7d7')

    async def reset(self, config):
        rng = random.Random(self.env_config.get('seed'))
        a, b, c = rng.randint(100, 9999), rng.randint(10, 99), rng.randint(100, 999)
        self.expression = f'{a} * {b} {rng.choice("+-")} {c}'
        self.value = int(calculator(self.expression))
        self.question = f'What is {self.expression}?'
        return self.question, {'expression': self.expression, 'value': self.value}, SYSTEM_PROMPT

    async def step(self, action):
        found = ANSWER.search(action[-1]['content'])
        if not found:
            again = f'Give the result as <answer>NUMBER</answer>. {self.question}'
            return again, 0.0, False, {'status': 'invalid'}
        answer = int(found.group(1))
        info = {'status': 'right' if answer == self.value else 'wrong', 'answer': answer}
        return f"That is {info['status']}.", float(answer == self.value), True, info

    def expert_reply(self, messages=None):
        if 'calculator' in self.tools and (messages or [{}])[-1].get('role') != 'tool':
            call = {'name': 'calculator', 'arguments': {'expression': self.expression}}
            return f'<tool_call>{json.dumps(call)}</tool_call>'
        return f'<answer>{self.value}</answer>'

    async def close(self):
        pass


envs['arithmetic'] = ArithmeticEnv
tools['calculator'] = calculator
