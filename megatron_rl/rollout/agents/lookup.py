"""The agent demo's environment (rollout.agent=lookup, data.path=synthetic:lookup8): the answer is only in a tool.

    prompt:  "value of c is"
    model:   [lookup(key='c')]</s>            (a pythonic tool call, parsed by vLLM's `pythonic` parser)
    tool:    " f"                              (observation tokens, rendered by DEMO_CHAT_TEMPLATE: out of the loss)
    model:   "f</s>"                            (the final answer; the `exact` reward checks it)

The demo's tokenizer gets DEMO_CHAT_TEMPLATE (install_chat_template): a tool
message renders as its content after a space, so the observation is only the
value (the tiny model learns to copy it within the test suite's time).

Each row's value is a random letter independent of its key, so the model can
only answer right by calling the tool and copying what it returned. The demo's
warm-up (megatron_rl.demo --agent) teaches the call and the answer format with
random answer letters; GSPO then teaches the model to read the tool's answer.
"""

from __future__ import annotations

from megatron_rl.rollout.agents.tools import Tool, ToolsAgent

LOOKUP_SCHEMA = {
    "name": "lookup",
    "description": "The value stored under a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
}


DEMO_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}{{ ' ' + m['content'] }}{% else %}{{ m['content'] }}{% endif %}"
    "{% endfor %}"
)
"""The demo model's chat template: every message is its content; a tool message's after a space."""


def install_chat_template(model_dir) -> None:
    """Give the tokenizer in `model_dir` the demo's chat template (saved in its tokenizer_config.json)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.chat_template = DEMO_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(model_dir))


def tool_call_text(key: str) -> str:
    """The call the warm-up teaches, in the pythonic parser's syntax."""
    return f"[lookup(key='{key}')]"


class LookupAgent(ToolsAgent):
    """One tool, lookup(key): the row's value when the key is the row's, else 'none'."""

    tool_parser = "pythonic"
    malformed_ends_episode = True
    """With two turns, an error observation would leave the second only a guess: 1/8, as after a well-formed call
    until the model learns to copy the value. Then nothing favours a call the parser reads, and a run can drift
    into malformed calls and never leave them (seen: from 9 to 128 of 128 episodes in 40 steps, with one thread per
    process on an Intel Xeon). Ended there, a malformed call answers nothing and scores 0."""

    def get_tools(self) -> list[Tool]:
        return [Tool(self.lookup, LOOKUP_SCHEMA)]

    def lookup(self, key: str) -> str:
        row = self.prompt.row
        return str(self.prompt.answer) if str(key) == str(row.get("key")) else "none"


def warmup_episode(tokenizer, prompt_ids: list[int], key: str, value: str, answer: str) -> tuple[list[int], list[bool]]:
    """(token ids, model-token mask) of one episode in the demo's format: the call, the tool's `value`, `answer`.

    The warm-up draws `value` and `answer` independently, so it teaches the format but not to copy the value.
    The observation is rendered exactly as the runner renders it (agents.render), so the warm-up and the
    episodes of the RL run see the same tokens.
    """
    from megatron_rl.rollout.agents.render import ObservationRenderer

    call = list(tokenizer.encode(tool_call_text(key))) + [tokenizer.eos_id]
    observation = ObservationRenderer(tokenizer).render([{"role": LookupAgent.observation_role, "content": value}])
    final = list(tokenizer.encode(answer)) + [tokenizer.eos_id]
    ids = list(prompt_ids) + call + observation + final
    mask = [False] * len(prompt_ids) + [True] * len(call) + [False] * len(observation) + [True] * len(final)
    return ids, mask
