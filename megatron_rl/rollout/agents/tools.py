"""ToolsAgent: the model calls plain Python functions (sync or async) described by a JSON schema.

    def add(a: int, b: int) -> str:
        return str(a + b)

    class Calculator(ToolsAgent):                     # rollout.agent=my_pkg.calc:Calculator
        tool_parser = "hermes"                       # any vllm.tool_parsers name
        def get_tools(self):
            return [Tool(add, {"name": "add", "description": "a + b",
                               "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                              "b": {"type": "integer"}}, "required": ["a", "b"]}})]

Every model turn is parsed by vLLM's own tool parser (`tool_parser`, or
rollout.agent_tool_parser), chosen by name. A turn without a tool call is the
final answer (the episode ends; data.reward scores it). Each call runs with a
timeout (rollout.agent_tool_timeout_s) and its result, or its failure, becomes
a `tool` message the episode goes on with:

* the tool raised: "error: <tool>: <ExceptionType>: <message>";
* it ran past the timeout: "error: <tool> timed out after <s> s" (a sync tool's
  thread is abandoned, an async one cancelled);
* it returned something other than a str: "error: <tool> returned <type>, not text";
* an unknown tool name or arguments that are not a JSON object / do not fit the
  function: "error: ..." naming the tool;
* a turn that starts a tool call the parser cannot read (malformed):
  "error: malformed tool call ...", or, where the class sets
  `malformed_ends_episode`, the end of the episode (that turn is its final answer).

Each kind is counted per tool (agent/tool_errors/<tool>, agent/malformed_tool_calls).
"""

from __future__ import annotations

import asyncio
import logging
import inspect
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from megatron_rl.rollout.agents.base import AgentError, Environment, ModelTurn, StepResult

_SYNC_TOOLS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="agent-tool")
"""Sync tools run here: a hung one holds a thread of this pool, never the episode loop."""


@dataclass
class Tool:
    """A function the model may call, with its JSON schema ({"name", "description", "parameters"})."""

    fn: Callable[..., Any]
    schema: dict

    @property
    def name(self) -> str:
        return str(self.schema.get("name") or getattr(self.fn, "__name__", "tool"))


def make_parser(name: str, tokenizer: Any) -> Any:
    """An instance of vLLM's tool parser `name` (AgentError naming the registered ones if unknown)."""
    from vllm.tool_parsers import ToolParserManager

    try:
        parser_cls = ToolParserManager.get_tool_parser(name)
    except KeyError:
        known = ", ".join(sorted(set(ToolParserManager.tool_parsers) | set(ToolParserManager.lazy_parsers)))
        raise AgentError(f"tool parser {name!r} is not one of vLLM's: set rollout.agent_tool_parser to one of {known}") from None
    # a malformed call is the model's (counted as agent/malformed_tool_calls and shown to it as the observation);
    # vLLM's parsers log each one with a traceback at ERROR, which would flood the trainer's log early in training
    logging.getLogger(parser_cls.__module__).setLevel(logging.CRITICAL)
    return parser_cls(getattr(tokenizer, "_tok", None) or tokenizer)


class ToolsAgent(Environment):
    """Environment whose steps are tool calls (see the module docstring). Override get_tools()."""

    observation_role = "tool"
    tool_parser: str = "hermes"
    """vLLM tool parser name; rollout.agent_tool_parser overrides it."""
    malformed_ends_episode: bool = False
    """A call the parser cannot read ends the episode, that turn its final answer (the task reward scores it),
    instead of an error observation the episode goes on with."""

    def get_tools(self) -> list[Tool]:
        """The tools of this episode (bound methods may read what reset() stored)."""
        return []

    def reset(self, prompt: Any):
        self.prompt = prompt
        return None

    def _parser(self) -> Any:
        parser = getattr(self, "_tool_parser_instance", None)
        if parser is None:
            name = getattr(self.context.config, "agent_tool_parser", "") or self.tool_parser
            parser = self._tool_parser_instance = make_parser(name, self.context.tokenizer)
        return parser

    def step(self, turn: ModelTurn) -> StepResult:
        parser = self._parser()
        info = parser.extract_tool_calls(turn.text, None)
        if not info.tools_called:
            if _starts_tool_call(parser, turn.text):
                self._record("", "malformed")
                if self.malformed_ends_episode:
                    return StepResult(done=True)
                return StepResult(observation=f"error: malformed tool call {turn.text.strip()[:200]!r}")
            return StepResult(done=True)
        tools = {t.name: t for t in self.get_tools()}
        results = asyncio.run(self._call_all(tools, [(c.function.name, c.function.arguments) for c in info.tool_calls]))
        return StepResult(observation=[{"role": self.observation_role, "content": r} for r in results])

    async def _call_all(self, tools: dict[str, Tool], calls: list[tuple[str, str]]) -> list[str]:
        return list(await asyncio.gather(*(self._call(tools, name, arguments) for name, arguments in calls)))

    async def _call(self, tools: dict[str, Tool], name: str, arguments: str) -> str:
        tool = tools.get(name)
        if tool is None:
            self._record(name, "unknown_tool")
            return f"error: no tool named {name!r} (tools: {', '.join(sorted(tools))})"
        try:
            kwargs = json.loads(arguments) if arguments else {}
        except json.JSONDecodeError as error:
            self._record(name, "bad_arguments")
            return f"error: {name}: arguments are not JSON ({error})"
        if not isinstance(kwargs, dict):
            self._record(name, "bad_arguments")
            return f"error: {name}: arguments must be a JSON object, got {type(kwargs).__name__}"
        timeout = float(getattr(self.context.config, "agent_tool_timeout_s", 30.0))
        start = time.perf_counter()
        try:
            if inspect.iscoroutinefunction(tool.fn):
                result = await asyncio.wait_for(tool.fn(**kwargs), timeout)
            else:
                call = asyncio.get_running_loop().run_in_executor(_SYNC_TOOLS, lambda: tool.fn(**kwargs))
                result = await asyncio.wait_for(call, timeout)
        except asyncio.TimeoutError:
            self._record(name, "timeout", time.perf_counter() - start)
            return f"error: {name} timed out after {timeout:g} s"
        except Exception as error:  # noqa: BLE001 - a tool may raise anything: the model reads what went wrong
            self._record(name, "raised", time.perf_counter() - start)
            return f"error: {name}: {type(error).__name__}: {error}"
        if not isinstance(result, str):
            self._record(name, "not_text", time.perf_counter() - start)
            return f"error: {name} returned {type(result).__name__}, not text"
        self._record(name, None, time.perf_counter() - start)
        return result

    def _record(self, name: str, error: str | None, seconds: float | None = None) -> None:
        stats = self.context.stats
        if stats is not None:
            stats.record_tool(name, error, seconds)


def _starts_tool_call(parser: Any, text: str) -> bool:
    """Whether a turn the parser found no call in still starts one (its start token, or a pythonic '[')."""
    start = getattr(parser, "tool_call_start_token", None)
    if isinstance(start, str) and start and start in text:
        return True
    return type(parser).__name__.startswith("Pythonic") and text.lstrip().startswith("[")
