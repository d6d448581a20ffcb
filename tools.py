"""Tools an agent may call: the `tools` registry, their schemas, and the answer to a call.

1. A tool is a function with type hints and a Google-style docstring (TRL's convention), from
   which transformers' `get_json_schema` makes its schema. An env names the tools it may call
   (`Env.tools`, or a row's `tools` column of registered names; ms-swift's holds the schemas).
2. GYMScheduler adds their schemas to the system message (`describe`) with Hermes' call format, as
   the Qwen2.5/Qwen3 templates, ms-swift's `hermes` agent template and verl do:
   <tool_call>{"name": ..., "arguments": {...}}</tool_call>
3. A reply with a call (`find_call`) gets the tool's answer (`answer`) as a {"role": "tool"}
   message (loss mask 0) instead of the env's step; a bad call gets an error message, counts as a
   failure, and the trajectory goes on.
Left out: several calls in one reply (the first is answered); stopping a plain tool that hangs (it
is left in a daemon thread; one holding the GIL in C code holds up everything). An async tool runs
on the rollout's event loop: it must await, never block (--tool_timeout cannot interrupt that),
and a thread it starts itself (asyncio.to_thread) is waited for when the rollout ends.
"""
import asyncio
import inspect
import json
import re
import threading
from typing import Callable, Dict, List, Optional, Tuple

from env import UserError

tools: Dict[str, Callable] = {}  # name -> function; a plugin adds its own: tools['search'] = search

CALL = re.compile(r'<tool_call>(.*?)(?:</tool_call>|$)', re.S)


def schema(name: str) -> dict:
    """The JSON schema of a registered tool, under its registered name."""
    from transformers.utils import get_json_schema
    spec = get_json_schema(tools[name])
    spec['function']['name'] = name
    return spec


def describe(system_message: str, names: List[str]) -> str:
    """The system message, followed by the tools' schemas and how to call one (none: unchanged)."""
    if not names:
        return system_message
    schemas = '\n'.join(json.dumps(schema(name)) for name in names)
    return (f'{system_message}\n\nYou may call these tools:\n<tools>\n{schemas}\n</tools>\n'
            'To call one, reply with <tool_call>{"name": NAME, "arguments": {...}}</tool_call> and '
            'nothing else; its answer comes back as the next message.')


def find_call(reply: str) -> Optional[str]:
    """The text of the reply's first tool call (None: the reply calls no tool)."""
    found = CALL.search(reply)
    return found.group(1).strip() if found else None


async def answer(call: str, names: List[str], timeout: float) -> Tuple[str, bool]:
    """(the answer, whether the call worked) to a call's text; `names`: the tools it may call."""
    try:
        request = json.loads(call)
    except (ValueError, RecursionError) as e:  # (JSONDecodeError is a ValueError)
        return (f'error: the call is not JSON ({getattr(e, "msg", e)}); write '
                '<tool_call>{"name": ..., "arguments": {...}}</tool_call>', False)
    if not isinstance(request, dict) or not isinstance(request.get('arguments', {}), dict):
        return 'error: a call is {"name": ..., "arguments": {...}}', False
    name, arguments = request.get('name'), request.get('arguments', {})
    if name not in names or name not in tools:
        return f'error: unknown tool {name!r}; the tools are: {", ".join(names)}', False
    function = tools[name]
    try:
        inspect.signature(function).bind(**arguments)
    except (TypeError, ValueError) as e:
        return f'error: wrong arguments for {name}: {e}', False
    try:  # an async tool runs on the event loop, a plain one in a thread of its own
        asynchronous = inspect.iscoroutinefunction(function)
        running = function(**arguments) if asynchronous else in_thread(function, arguments)
        return str(await asyncio.wait_for(running, timeout)), True
    except asyncio.TimeoutError:
        return f'error: {name} did not answer within {timeout:g} seconds', False
    except Exception as e:
        return f'error: {name} raised {type(e).__name__}: {e}', False


def in_thread(function: Callable, arguments: dict) -> asyncio.Future:
    """function(**arguments) in a daemon thread, so that the envs and other tools go on meanwhile
    and a tool that never returns holds up nothing (not even the program's exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error):
        if not future.done():
            future.set_exception(error) if error else future.set_result(result)

    def work():
        try:
            result, error = function(**arguments), None
        except Exception as e:
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the event loop is gone: nobody waits for this answer any more
            pass
    threading.Thread(target=work, daemon=True).start()
    return future


def check_tools(names, where: str):
    """Refuse, in one line, tools that are not a list of registered names."""
    if not isinstance(names, list) or not all(isinstance(n, str) and n in tools for n in names):
        raise UserError(f'{where}: tools must be a list of registered tool names; registered: '
                        f'{", ".join(sorted(tools)) or "none"} (got {str(names)[:80]})')
    for name in names:
        try:
            schema(name)
        except Exception as e:
            raise UserError(f'tool {name}: no JSON schema can be made of it ({type(e).__name__}: '
                            f'{str(e).splitlines()[0]})') from None
