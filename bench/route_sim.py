"""The simulator held to the real engines: the prompts a real run sent, through ``kvevents.sim``.

For each real run the client's raw export has every request as sent (the messages, history
and the engine's own answers included). Rendered with the model's chat template and tokenized
(``transformers``, as vLLM does; each prompt's length is checked against the engine's reported
``prompt_tokens``), they are the token ids the engines saw. They go through
:func:`kvevents.sim.run_conversations`, closed-loop at the client's concurrency, on a
simulated cluster of the real one's shape (engines, usable blocks per engine, block size,
prefill budget), and the simulated cached fraction and balance are set next to the real ones.

Each pair is reported for the first run of the router, then as the mean over every run of
it (the repeats' prompts simulated too): one run of three real engines sharing two cores
moves by a few points on its own.

Pairs: the references (one simulated engine with the pooled cache, or with one engine's),
vLLM Router ``round_robin`` against the simulator's ``round_robin``, and each ``kvevents
route`` policy against the same policy; the simulator's load-aware policies are also run on
the round-robin run's prompts with both load views (the engines' true load, as
``kvevents simulate`` gives it, and the router's own in-flight view).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from harness import Row
from kvevents.index import POLICIES
from kvevents.sim import (
    ClusterConfig,
    ConversationsRun,
    LoadView,
    PolicyReport,
    Request,
    SimulationConfig,
    run_conversations,
)
from route_client import read_records, sent_messages
from route_peers import kvevents_policies, slug
from route_report import Outcome


@dataclass(frozen=True)
class StepTimes:
    """A real engine's step time, measured alone (:func:`measure_step_times`): ``base_s``, a
    decode step (the time between two tokens of an answer), and ``token_s``, a prefill's time
    per token (a long prompt's time to its first token, less a step, over its tokens)."""

    base_s: float
    token_s: float

    @classmethod
    def simulator(cls) -> StepTimes:
        """The simulator's own step time (a GPU's shape), where none was measured."""
        default = ClusterConfig()
        return cls(default.step_base_s, default.step_token_s)

    def label(self) -> str:
        return f"steps of {self.base_s * 1e3:.1f} ms + {self.token_s * 1e3:.3f} ms a token"


def measure_step_times(
    url: str,
    model: str,
    vocabulary: int,
    *,
    prompt_tokens: int = 1024,
    answer_tokens: int = 33,
    tries: int = 3,
    timeout: float = 120.0,
) -> StepTimes:
    """The step time of the engine at ``url``, alone: ``tries`` prompts of ``prompt_tokens``
    random token ids (nothing cached; one prefill step, within the engine's budget), each
    answered with ``answer_tokens`` tokens, streamed; the medians of their time to the first
    token and of the time between their tokens."""
    rng = random.Random(7)
    firsts: list[float] = []
    steps: list[float] = []
    with httpx.Client(base_url=url, timeout=timeout) as client:
        for _ in range(tries):
            body = {
                "model": model,
                "prompt": [rng.randrange(16, vocabulary) for _ in range(prompt_tokens)],
                "max_tokens": answer_tokens,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            }
            began, stamps = time.perf_counter(), []
            with client.stream("POST", "/v1/completions", json=body) as answer:
                answer.raise_for_status()
                for line in answer.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if any(choice.get("text") for choice in event.get("choices", ())):
                            stamps.append(time.perf_counter())
            if len(stamps) < 2:
                raise RuntimeError(f"{url}: an answer of {len(stamps)} tokens to a step probe")
            firsts.append(stamps[0] - began)
            steps.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    base = statistics.median(steps)
    return StepTimes(base, max(0.0, statistics.median(firsts) - base) / prompt_tokens)


@dataclass(frozen=True)
class SimShape:
    """The simulated cluster: the real one's engines, caches and step time."""

    engines: int
    blocks: int  # per engine, as given to vLLM (one is its null block)
    block_size: int
    max_num_batched_tokens: int
    concurrency: int
    answer_tokens: int
    steps: StepTimes = field(default_factory=StepTimes.simulator)
    #: Each turn answers with the tokens the next turn's prompt holds after it (the engine's
    #: answer as sent back, re-tokenized: :func:`with_answers`) instead of the simulator's own.
    answers: bool = False

    def config(self, workers: int, blocks: int) -> SimulationConfig:
        cluster = ClusterConfig(
            workers=workers,
            block_size=self.block_size,
            capacity_blocks=blocks - 1,  # vLLM keeps one block back (its null block)
            max_num_batched_tokens=self.max_num_batched_tokens,
            transport="direct",
            step_base_s=self.steps.base_s,
            step_token_s=self.steps.token_s,
        )
        return SimulationConfig(cluster=cluster)


class Renderer:
    """Messages to the token ids vLLM's OpenAI server gives them (the model's chat template)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)

    def tokens(self, messages: list[dict[str, Any]]) -> list[int]:
        """The template rendered to text, then tokenized without special tokens (the template
        writes its own BOS), as vLLM's chat path does."""
        text = self._tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class Prompts:
    """A real run's requests as token ids, grouped into conversations; how many lengths agreed."""

    conversations: list[list[Request]]
    checked: int = 0
    mismatched: int = 0


def real_prompts(
    out: Path, renderer: Renderer, answer_tokens: int, *, answers: bool = False
) -> Prompts:
    """The requests a run sent, tokenized, checked against the engines' ``prompt_tokens``;
    with ``answers``, each turn answering as :func:`with_answers` says."""
    reported = {(r.conversation, r.turn): r.prompt_tokens for r in read_records(out)}
    turns: dict[str, list[tuple[int, Request]]] = defaultdict(list)
    prompts = Prompts([])
    for n, (conversation, turn, messages) in enumerate(sent_messages(out)):
        ids = renderer.tokens(messages)
        expected = reported.get((conversation, turn))
        if expected is not None:
            prompts.checked += 1
            prompts.mismatched += expected != len(ids)
        request = Request(f"{conversation}/{turn}/{n}", ids, answer_tokens)
        turns[conversation].append((turn, request))
    ordered = [[r for _, r in sorted(v, key=lambda x: x[0])] for v in turns.values()]
    prompts.conversations = [with_answers(c) for c in ordered] if answers else ordered
    return prompts


def with_answers(turns: list[Request]) -> list[Request]:
    """A conversation's turns, each answering with the tokens the next turn's prompt holds
    right after this one's: the engine's answer as the client sent it back, re-tokenized.
    Where those are the tokens the engine generated, the simulated engines cache what the real
    ones did and the next turn hits it too; where re-tokenizing changed them, the real engine
    misses what the simulated one hits (so it can count reuse the real engines did not have,
    and the simulator's own tokens, which no later prompt holds, none)."""
    out = []
    for turn, after in zip(turns, [*turns[1:], None], strict=True):
        ids = turn.token_ids
        given: tuple[int, ...] = ()
        if after is not None and list(after.token_ids[: len(ids)]) == list(ids):
            given = tuple(after.token_ids[len(ids) : len(ids) + turn.max_output_tokens])
        out.append(replace(turn, output_token_ids=given))
    return out


def simulate(
    prompts: Prompts,
    shape: SimShape,
    policy: str,
    *,
    workers: int,
    blocks: int,
    view: LoadView,
    speeds: Sequence[float] = (),
    first_token_delay: float = 0.0,
) -> ConversationsRun:
    return run_conversations(
        prompts.conversations,
        policy,
        shape.config(workers, blocks),
        concurrency=shape.concurrency,
        load_view=view,
        speeds=speeds,
        first_token_delay=first_token_delay,
    )


@dataclass(frozen=True)
class LoadedTiming:
    """How a real run's engines ran under the rig's load, for the simulator: each engine's
    step time as a multiple of the simulated engines' (``speeds``, in engine order), and the
    mean seconds between an engine making a request's first token and the client seeing it
    (``kvevents.sim.run_conversations``' ``first_token_delay``)."""

    speeds: tuple[float, ...]
    first_token_delay: float

    def label(self) -> str:
        speeds = "/".join(f"{v:.1f}" for v in self.speeds)
        delay = self.first_token_delay * 1e3
        return f"as the engines ran (steps x{speeds}, first tokens {delay:.0f} ms late)"


def loaded_timing(outcome: Outcome, simulated: ConversationsRun) -> LoadedTiming | None:
    """The timing of a real run's engines under load, from their own phase times (vLLM's
    histograms, per engine: ``outcome.extra["engine_phases"]``) and the client's records,
    set against the same prompts simulated at the step time measured alone (``simulated``).

    - Speeds: each engine's time per generated token after the first, over the simulated
      engines' (the simulated decode steps carry other requests' prefill chunks as the real
      ones do). On the rig's two shared cores the engines ran two to nine times slower
      than an engine measured alone.
    - The delay: the client's mean time to first token, less the engines' mean time waiting
      and prefilling. It is the time the serving front ends add (vLLM's API server, and the
      router), 0.2-0.9 s on the rig, and it is what moves ``prefix_load`` (see
      :mod:`kvevents.sim`'s ``run_conversations``).

    None where the run has no phase times (a record from before they were kept), an engine
    finished nothing, or no answer had a first token."""
    phases = outcome.extra.get("engine_phases")
    ttfts = [r.ttft_ms / 1000 for r in outcome.ok if r.ttft_ms is not None]
    sim_tokens = sum(max(0, r.output_tokens - 1) for r in simulated.finished)
    sim_decode = sum(r.finished_at - r.first_token_at for r in simulated.finished)
    if not phases or not ttfts or sim_tokens <= 0 or sim_decode <= 0:
        return None
    requests = sum(p["requests"] for p in phases)
    per_token = []
    for p in phases:
        tokens = p["output_tokens"] - p["requests"]
        if p["requests"] <= 0 or tokens <= 0:
            return None
        per_token.append(p["decode_s"] / tokens)
    waited = sum(p["queue_s"] + p["prefill_s"] for p in phases) / requests
    factor = sim_tokens / sim_decode
    return LoadedTiming(
        tuple(t * factor for t in per_token), max(0.0, statistics.mean(ttfts) - waited)
    )


def _pair_policy(router: str) -> tuple[str, int, bool] | None:
    """(simulated policy, workers factor, pooled) for a real router, or None (no counterpart)."""
    if router.startswith("pooled"):
        return "round_robin", 1, True
    if router.startswith("one engine"):
        return "round_robin", 1, False
    if router == "vllm-router round_robin":
        return "round_robin", 0, False
    if router.startswith("kvevents route (default"):
        return kvevents_policies()[0], 0, False
    if router.startswith("kvevents route "):
        return router.split()[-1], 0, False
    return None


def sim_rows(
    section: str,
    outcomes: Sequence[Outcome],
    run_dir: Path,
    shape: SimShape,
    model_dir: Path,
    workload: str = "chat",
) -> list[Row]:
    """Simulated next to real, per pair (the first run's, then the mean over every run of
    it: each run's prompts simulated, set next to that run's real figure), and the
    simulator's own policies (both load views)."""
    renderer = Renderer(model_dir)
    rows: list[Row] = []
    base: Prompts | None = None
    runs: dict[str, list[tuple[float, float]]] = defaultdict(list)  # pair -> (sim, real)
    for outcome in outcomes:
        pair = _pair_policy(outcome.router)
        if outcome.workload != workload or outcome.status != "ok" or pair is None:
            continue
        policy, factor, pooled = pair
        repeat = int(outcome.extra.get("repeat", 0))
        name = slug(outcome.router) + (f"-run{repeat + 1}" if repeat else "")
        prompts = real_prompts(
            run_dir / workload / name, renderer, shape.answer_tokens, answers=shape.answers
        )
        workers = shape.engines if factor == 0 else 1
        blocks = shape.blocks * (shape.engines if pooled else 1)
        plain = simulate(prompts, shape, policy, workers=workers, blocks=blocks, view="inflight")
        real = outcome.cached_fraction()
        case = f"{outcome.router} vs simulated {policy}"
        if real is not None:
            runs[case].append((plain.report.reuse, real))
        timing = loaded_timing(outcome, plain)
        loaded = None
        if timing is not None and len(timing.speeds) == workers:
            loaded = simulate(
                prompts,
                shape,
                policy,
                workers=workers,
                blocks=blocks,
                view="inflight",
                speeds=timing.speeds,
                first_token_delay=timing.first_token_delay,
            )
            if real is not None:
                runs[f"{case}, as the engines ran"].append((loaded.report.reuse, real))
        if repeat:
            continue
        if outcome.router == "vllm-router round_robin":
            base = prompts
        rows += _pair_rows(section, outcome, plain.report, prompts, policy)
        if loaded is not None and timing is not None:
            rows += _pair_rows(
                section,
                outcome,
                loaded.report,
                replace(prompts, mismatched=0),
                f"{policy}, {timing.label()}",
            )
    rows += mean_rows(section, runs)
    if base is not None:
        rows += _policy_rows(section, base, shape)
    return rows


def mean_rows(section: str, runs: dict[str, list[tuple[float, float]]]) -> list[Row]:
    """Per pair run more than once, the simulated cached fraction's mean over its runs next
    to the real one's (``runs``: case -> (simulated, real) of each run, as fractions)."""
    rows = []
    for case, pairs in runs.items():
        if len(pairs) > 1:
            sim, real = (100 * statistics.mean(p[i] for p in pairs) for i in (0, 1))
            reals = ", ".join(f"{100 * p[1]:.1f}" for p in pairs)
            metric = f"cached fraction, simulated, mean of {len(pairs)} runs (real {reals})"
            rows.append(Row(section, case, metric, sim, "%", real, "real mean"))
    return rows


def _pair_rows(
    section: str, real: Outcome, sim: PolicyReport, prompts: Prompts, policy: str
) -> list[Row]:
    case = f"{real.router} vs simulated {policy}"
    cached = real.cached_fraction()
    balance = real.balance()
    counts = "/".join(str(v) for v in sim.per_target.values())
    rows = [
        Row(
            section,
            case,
            "cached fraction, simulated",
            100 * sim.reuse,
            "%",
            None if cached is None else 100 * cached,
            "real",
        ),
        Row(
            section,
            case,
            f"balance, simulated (requests {counts})",
            sim.balance,
            "x",
            balance,
            "real",
        ),
    ]
    if prompts.mismatched:
        rows.append(
            Row(
                section,
                case,
                f"prompts whose length differs from the engine's ({prompts.checked} checked)",
                float(prompts.mismatched),
                "",
            )
        )
    return rows


def _policy_rows(section: str, prompts: Prompts, shape: SimShape) -> list[Row]:
    """Every simulator policy on the round-robin run's prompts, true load and own load."""
    rows = []
    for policy in POLICIES:
        for view in ("engine", "inflight"):
            report = simulate(
                prompts, shape, policy, workers=shape.engines, blocks=shape.blocks, view=view
            ).report
            case = f"simulated {policy}, {'engines true load' if view == 'engine' else 'own in-flight load'}"
            counts = "/".join(str(v) for v in report.per_target.values())
            rows.append(Row(section, case, "cached fraction", 100 * report.reuse, "%"))
            rows.append(Row(section, case, f"balance (requests {counts})", report.balance, "x"))
    return rows
