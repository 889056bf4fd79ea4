"""A rollout batch of multi-turn trajectories: the environment and tool calls between the engine's turns.

:class:`Episodes` is the :class:`gspo.types.TurnEnds` the engine calls when every row still going has ended its turn.
For each row it reads the turn's text (the sampled ids stay as they are in the row; the text is only read), runs the
tool calls it holds, or else the environment's ``step``, in the workers (:mod:`gspo.envs.pool`), and answers the ids
to append (:class:`gspo.envs.turns.Turns`), or ``None`` when the trajectory is over: the environment said done, the
turn was an answer (tools only), ``env.max_turns`` were taken, the turn ended on another stop token than the
template's end of turn (the model ended the conversation), or an environment call failed (the trajectory's reward is
then NaN: left out of its group's baseline and counted in ``env/failures``, never the run's end).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from gspo import user_code
from gspo.envs.pool import LOST, EnvPool
from gspo.envs.tools import detect_format, parse_calls, system_text
from gspo.envs.turns import TemplateRenderer, Turns, check_template, check_vocabulary
from gspo.errors import UserError
from gspo.prompts import messages_for
from gspo.types import FINISH_LENGTH, Example, Rollout, SamplingParams

log = logging.getLogger("gspo")


SUMS = {"env/turns": "turns", "env/tool_calls": "tool_calls", "env/tool_errors": "tool_errors",
        "env/appended_tokens": "appended"}
COUNTS = (*SUMS, "env/failures", "env/trajectories")  # what a rollout batch adds up, over rounds and processes


def batch_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The logged ``env/*`` metrics of a rollout batch from its :data:`COUNTS`: per-trajectory means of turns and
    appended tokens, totals of tool calls, tool errors and failed trajectories."""
    n = max(1.0, sums["env/trajectories"])
    return {"env/turns_mean": sums["env/turns"] / n, "env/tool_calls": sums["env/tool_calls"],
            "env/tool_errors": sums["env/tool_errors"], "env/appended_tokens_mean": sums["env/appended_tokens"] / n,
            "env/failures": sums["env/failures"]}


@dataclass
class Trajectory:
    """What one row's episode has earned and done so far."""

    id: int
    example: Example
    reward: float = 0.0
    error: str | None = None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    appended: int = 0  # tokens of tool results, observations and template appended to the row
    step_rewards: list[float] = field(default_factory=list)  # per turn that ended on a stop token: its step reward
    messages: list[dict[str, str]] = field(default_factory=list)  # every message after the prompt, for the logs


@dataclass
class EpisodeResult:
    """The environment's side of a rollout batch: ``(N,)`` rewards (NaN where an environment call failed) and the
    :data:`COUNTS`."""

    rewards: torch.Tensor
    trajectories: list[Trajectory]
    metrics: dict[str, float]
    first_error: str | None


class Episodes:
    """Runs multi-turn rollout batches for one run (``[env]`` settings, the policy's tokenizer and stop ids)."""

    def __init__(self, env, tokenizer, stop_ids: list[int], system_prompt: str | None = None):
        self.env = env
        self.tokenizer = tokenizer
        self.pool = EnvPool(env.path, env.tools, env.workers, env.timeout_s)
        try:
            renderer = load_renderer(env, tokenizer)
            if isinstance(renderer, TemplateRenderer):
                template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
                auto, in_template = detect_format(template), "tools" in template  # the template renders tools= itself
            else:
                auto, in_template = getattr(renderer, "tool_format", "hermes"), False
            self.format = auto if env.tool_format == "auto" else env.tool_format
            schemas = self._schemas() if env.tools else []
            self.tool_names = {s["function"]["name"] for s in schemas}
            in_template = bool(schemas) and in_template
            system, tool_text = system_prompt, None
            if schemas and not in_template:
                tool_text = system_text(schemas, self.format)
                system = "\n\n".join(x for x in (system_prompt, tool_text) if x)
            self.turns = Turns(tokenizer, stop_ids, system=system, tools=schemas if in_template else None,
                               renderer=renderer, tool_text=tool_text)
            # the roles the template renders after an assistant turn: an observation of another role is refused
            self.roles = tuple(getattr(renderer, "roles", ("user", "tool")))
            check_template(self.turns, samples=100, roles=self.roles)
        except BaseException:
            self.pool.close()
            raise
        self.next_id = 0
        self.rows: list[Trajectory] = []

    def _schemas(self) -> list[dict]:
        (status, value), = self.pool.call([(0, "schemas", None)])
        if status != "ok":
            raise UserError(f"env.tools {self.env.tools}: the workers could not describe them ({value}); set "
                            "env.workers = 0 to debug in-process.")
        return value

    def encode(self, examples: list[Example]) -> list[list[int]]:
        """The first prompt of each example, with the tools' system message."""
        return [self.turns.prompt(messages_for(ex)) for ex in examples]

    def run(self, engine, examples: list[Example], prompt_ids: list[list[int]], n: int, params: SamplingParams,
            generator: torch.Generator | None) -> tuple[Rollout, EpisodeResult]:
        """``n`` trajectories of each example, sampled by ``engine`` turn by turn."""
        self.rows = [Trajectory(self.next_id + i, ex) for i, ex in enumerate(ex for ex in examples for _ in range(n))]
        self.next_id += len(self.rows)
        if self.env.path:
            prompt_ids = self._reset(examples, prompt_ids, n)
        turn_params = SamplingParams(**{**params.__dict__, "max_turn_tokens": self.env.max_turn_tokens})
        try:
            rollout = engine.generate(prompt_ids, n, turn_params, generator, turns=self)
        finally:
            if self.env.path:
                self.pool.forget([t.id for t in self.rows])
        for t, reason in zip(self.rows, rollout.finish_reasons):
            t.turns += reason == FINISH_LENGTH  # its last turn was cut off: the engine did not report it
        rollout.turn_rewards = [list(t.step_rewards) for t in self.rows]
        return rollout, self._result()

    def _reset(self, examples: list[Example], prompt_ids: list[list[int]], n: int) -> list[list[int]]:
        """Each trajectory's environment, made and reset; the prompts its ``reset`` returned (the rows of one example
        must agree: they share their prompt's prefill)."""
        answers = self.pool.call([(t.id, "reset", t.example) for t in self.rows])
        out = list(prompt_ids)
        for g in range(len(examples)):
            group = answers[g * n:(g + 1) * n]
            for t, (status, value) in zip(self.rows[g * n:(g + 1) * n], group):
                if status != "ok":
                    t.error = f"reset: {value}"
            messages = {repr(v) for s, v in group if s == "ok" and v is not None}
            if len(messages) > 1:
                raise UserError(f"env.path = {self.env.path!r}: reset returned different messages for the "
                                f"{n} trajectories of one example; return the same first messages for the same "
                                "example (keep per-trajectory randomness in the environment's state).")
            first = next((v for s, v in group if s == "ok" and v is not None), None)
            if first is not None:
                out[g] = self.turns.prompt(first)
        return out

    def __call__(self, rows: list[int], turn_ids: list[list[int]]) -> list[list[int] | None]:
        """The engine's turn ends: the ids each row appends, or None when its trajectory is over."""
        replies: dict[int, list[dict[str, str]]] = {}
        calls, owners = [], []
        for r, ids in zip(rows, turn_ids):
            t = self.rows[r]
            t.turns += 1
            t.step_rewards.append(0.0)
            if t.error is None and t.id in self.pool.lost:  # its environment died with a worker: whatever it would
                t.error = f"step: {LOST}"  # earn now, with tools or without, is not the episode's reward
            if t.error is not None or ids[-1] != self.turns.end_id:
                continue
            text = self.tokenizer.decode(ids[:-1], skip_special_tokens=True)
            t.messages.append({"role": "assistant", "content": text})
            parsed = parse_calls(text, self.format, self.tool_names) if self.tool_names else []
            replies[r] = []
            for call in parsed:
                t.tool_calls += 1
                if call.error:
                    t.tool_errors += 1
                    replies[r].append({"role": "tool", "content": f"error: {call.error}"})
                else:
                    calls.append((t.id, "tool", (call.name, call.arguments)))
                    owners.append((r, len(replies[r])))
                    replies[r].append({"role": "tool", "content": ""})
            if not parsed:
                if not self.env.path:  # tools only: a turn without a call is the answer
                    del replies[r]
                    continue
                calls.append((t.id, "step", text))
                owners.append((r, None))
        done: set[int] = set()
        for (r, slot), (status, value) in zip(owners, self.pool.call(calls)):
            t = self.rows[r]
            if slot is not None:  # a tool's result, or what went wrong, is the model's to read
                if status != "ok":
                    t.tool_errors += 1
                replies[r][slot]["content"] = value if status == "ok" else f"error: {value}"
            elif status != "ok":
                t.error = f"step: {value}"
            else:
                messages, reward, finished = value
                t.reward += reward
                t.step_rewards[-1] = reward
                odd = next((m["role"] for m in messages if m["role"] not in self.roles), None)
                if odd is not None:
                    t.error = (f"step returned a message of role {odd!r}, which this model's chat template does not "
                               f"render after an assistant turn; return the observation as {' or '.join(self.roles)}")
                replies[r].extend(messages)
                if finished:
                    done.add(r)
        out: list[list[int] | None] = []
        for r in rows:
            t = self.rows[r]
            if r not in replies or r in done or t.error is not None or t.turns >= self.env.max_turns:
                out.append(None)
                continue
            t.messages.extend(replies[r])
            try:
                ids = self.turns.after(replies[r])
            except UserError:  # a template that re-renders earlier turns: the run's to stop
                raise
            except Exception as e:  # noqa: BLE001 -- the template's own refusal of this conversation (Jinja)
                t.error = f"the chat template could not render the environment's reply ({type(e).__name__}: {e})"
                out.append(None)
                continue
            t.appended += len(ids)
            out.append(ids)
        return out

    def _result(self) -> EpisodeResult:
        rows = self.rows
        rewards = torch.tensor([float("nan") if t.error else t.reward for t in rows], dtype=torch.float32)
        metrics = {key: float(sum(getattr(t, attr) for t in rows)) for key, attr in SUMS.items()}
        metrics["env/failures"] = float(sum(t.error is not None for t in rows))
        metrics["env/trajectories"] = float(len(rows))
        first = next((t.error for t in rows if t.error), None)
        return EpisodeResult(rewards, rows, metrics, first)

    def close(self) -> None:
        self.pool.close()


RENDERER_EXAMPLE = "gspo.envs.renderers:llama3"


def load_renderer(env, tokenizer):
    """The renderer ``env.renderer`` names, built for ``tokenizer`` and checked to share its vocabulary, or unset, the
    tokenizer's own chat template; either way refused in one line when ``env.tools`` is set and it has no tool turns.
    It runs in this process: it renders the ids the engine is fed."""
    if not env.renderer:
        renderer = TemplateRenderer(tokenizer)
        if env.tools and "tool" not in renderer.roles:
            raise UserError("the chat template has no tool turns (it takes only user and assistant messages), and "
                            "env.tools is set; leave env.tools empty (the environment replies as the user), or use a "
                            "model whose template renders tool messages.")
        return renderer
    what = f"env.renderer = {env.renderer!r}"
    factory = user_code.load_function(env.renderer, what, RENDERER_EXAMPLE)
    try:
        renderer = factory(tokenizer)
    except UserError:
        raise
    except Exception as e:  # the user's factory: one line, not a traceback
        raise UserError(f"{what} failed to build a renderer ({type(e).__name__}: {e}); fix the factory.") from None
    missing = [m for m in ("render", "tokenize", "decode") if not callable(getattr(renderer, m, None))]
    if missing:
        raise UserError(f"{what} returned {type(renderer).__name__}, which has no {', '.join(missing)}; return a "
                        f"renderer (render(messages, tools, generation_prompt), tokenize(text), decode(ids)), as "
                        f"{RENDERER_EXAMPLE} does.")
    if env.tools and "tool" not in getattr(renderer, "roles", ("user", "tool")):
        raise UserError(f"{what} cannot render tool messages, and env.tools is set; leave env.tools empty (the "
                        "environment replies as the user), or use a renderer whose format has tool turns.")
    check_vocabulary(renderer, tokenizer, what)
    return renderer
