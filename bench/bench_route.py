"""Routers side by side on real vLLM CPU engines, driven by a benchmark client nobody here wrote.

The rig of issue #25 (docs/benchmarks.md, "The front door against every peer"):

- **Engines**: ``KVEVENTS_BENCH_ROUTE_ENGINES`` (default 3) vLLM 0.32 CPU servers
  (``.venv-vllm``, ``make vllm``) of the tiny chat model of :mod:`kvevents.testing.chat_model`
  (a byte-level BPE tokenizer and a chat template, random weights), prefix caching,
  ``--enable-prompt-tokens-details``, KV events with replay; plus one "pooled" engine with the
  cluster's whole cache. Started once; every engine's prefix cache is reset before each router
  (and the reset waited for on its event stream). Each engine's cache is a third (1/N) of the
  chat workload's working set, so no single engine can hold it.
- **Workloads** (:mod:`route_workload`): multi-turn chat over shared system prompts, and the
  bundled Mooncake trace's shape as text.
- **Client** (:mod:`route_client`): aiperf 0.13.0 from PyPI, in its own venv; its reports stay
  in the run's directory (``bench/.work/route/runs/<stamp>/``).
- **Routers** (:mod:`route_peers`): vLLM Router 0.1.17 (``round_robin``, ``kv_aware``,
  ``cache_aware``), SGLang router 0.3.2 ``cache_aware``, each in a venv the benchmark installs
  (a peer that does not install is reported so); the references (the pooled engine; one engine
  of the cluster serving everything, the floor); ``kvevents route`` from this checkout, its
  default policy and every other (the cache-blind ``round_robin`` and ``random`` on the chat
  workload only).
- **Fault run** per peer and for ``kvevents route``'s default: the chat workload, one engine
  killed (SIGKILL) :data:`FAULT_PHASE` s after the first request and restarted on the same
  ports, the client running a phase past the restart.
- **Simulator** (:mod:`route_sim`): the prompts the engines saw, replayed closed-loop through
  the simulated cluster of the same shape, next to the real figures per policy.

``KVEVENTS_BENCH_ROUTE_QUICK=1`` (or ``python bench/bench_route.py --quick``): a smoke run of
about a minute once the engines are up: two engines, a small chat workload, one router of each
kind, no fault run (``KVEVENTS_BENCH_ROUTE_FAULTS=1``: with them), no pooled engine. Shorter
full runs: ``KVEVENTS_BENCH_ROUTE_ROUTERS=kvevents,pooled`` (the routers whose names contain
one of the words), ``KVEVENTS_BENCH_ROUTE_WORKLOADS=chat``, ``KVEVENTS_BENCH_ROUTE_FAULTS=0``,
``KVEVENTS_BENCH_ROUTE_FAULT_PHASE=S``. ``KVEVENTS_BENCH_ROUTE_REPEATS=N``: the chat workload N
times per router, interleaved (every router once, then again), reported together with each
run's cached fraction (one run moves by a few points with the machine's load). Skipped, with
the reason, where vLLM or aiperf cannot run.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Row
from kvevents.deadline import Deadline
from kvevents.testing.vllm_server import (
    VllmServerError,
    build_chat_model,
    find_vllm_python,
    vllm_unavailable,
)
from route_client import (
    CLIENT_GRACE,
    Client,
    ClientRun,
    aiperf_argv,
    client_env,
    history_carries_answers,
    read_records,
    run_client,
    sent_messages,
    strip_raw,
    tokenizer_alias,
)
from route_engines import (
    MODEL_NAME,
    BenchEngine,
    Cluster,
    Snapshot,
    describe,
    engine_phases,
    make_cluster,
    snapshot,
)
from route_peers import (
    AIPERF,
    CONFIG_NOTES,
    Router,
    RouterProcess,
    Venv,
    fetch_text,
    kvevents_route_unavailable,
    new_launch,
    routers,
    slug,
    start_router,
)
from route_report import FaultFigures, Outcome, fault_rows, merged, outcome_rows, summary
from route_sim import StepTimes, measure_step_times
from route_workload import (
    ChatShape,
    MooncakeShape,
    TextMaker,
    chat_records,
    chat_working_set_blocks,
    lru_hit_fraction,
    mooncake_records,
    mooncake_working_set_blocks,
    write_jsonl,
)

HERE = Path(__file__).resolve().parent
WORK = HERE / ".work" / "route"
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
MAX_NUM_SEQS = 16
MAX_NUM_BATCHED_TOKENS = 2048
#: The fault run's thirds: this long up, an engine down about as long (it is relaunched so as
#: to be back then: a start takes 30-60 s on a quiet machine here, minutes on a loaded one),
#: this long after it is back.
FAULT_PHASE = float(os.environ.get("KVEVENTS_BENCH_ROUTE_FAULT_PHASE", "45"))
#: A restart under traffic takes longer than the idle one timed before the fault runs. Unboosted
#: (before 2026-12-07's last runs) it took 186-193 s under the full rig's traffic against 30 s
#: idle, and with a 371 s client run the relaunched engine's worker did not start until the
#: traffic ended (4 min 22 s); relaunched boosted (``BenchEngine.relaunch(boost=True)``) it was
#: back 41 s after its relaunch (about twice the idle restart). The margin times the idle
#: restart is the estimate the relaunch is timed by, so that the engine is back about two
#: phases in, and the client runs a phase past it.
FAULT_RESTART_MARGIN = float(os.environ.get("KVEVENTS_BENCH_ROUTE_RESTART_MARGIN", "2.5"))
QUICK_CHAT = ChatShape(
    apps=3,
    system_tokens=512,
    conversations=12,
    turns=3,
    user_tokens=48,
    answer_tokens=16,
    concurrency=4,
)
#: kvevents route's cache-blind baselines run on the chat workload only (a shorter run): vLLM
#: Router's round_robin stands for them on every workload.
CHAT_ONLY = ("kvevents route round_robin", "kvevents route random")
SECTIONS = {
    "chat": "Routers on {n} vLLM CPU engines: multi-turn chat over shared system prompts (aiperf)",
    "mooncake": "Routers on {n} vLLM CPU engines: the Mooncake trace's shape as text (aiperf)",
    "fault": "Routers on {n} vLLM CPU engines: one engine killed at 1/3, restarted at 2/3 (aiperf)",
}


@dataclass(frozen=True)
class Settings:
    engines: int
    quick: bool
    chat: ChatShape
    mooncake: MooncakeShape | None
    faults: bool
    #: Runs of the chat workload per router, interleaved (every router once, then again):
    #: one run moves by a few points with the machine's load; the figures are of them all.
    repeats: int = 1

    @classmethod
    def from_env(cls, quick: bool | None = None) -> Settings:
        quick = os.environ.get("KVEVENTS_BENCH_ROUTE_QUICK") == "1" if quick is None else quick
        if quick:
            engines = int(os.environ.get("KVEVENTS_BENCH_ROUTE_ENGINES", "2"))
            faults = os.environ.get("KVEVENTS_BENCH_ROUTE_FAULTS") == "1"
            return cls(engines, True, QUICK_CHAT, None, faults)
        engines = int(os.environ.get("KVEVENTS_BENCH_ROUTE_ENGINES", "3"))
        # KVEVENTS_BENCH_ROUTE_WORKLOADS=chat and KVEVENTS_BENCH_ROUTE_FAULTS=0: a shorter run.
        workloads = os.environ.get("KVEVENTS_BENCH_ROUTE_WORKLOADS", "chat,mooncake")
        mooncake = MooncakeShape() if "mooncake" in workloads else None
        faults = os.environ.get("KVEVENTS_BENCH_ROUTE_FAULTS", "1") != "0"
        repeats = max(1, int(os.environ.get("KVEVENTS_BENCH_ROUTE_REPEATS", "1")))
        return cls(engines, False, ChatShape(), mooncake, faults, repeats)

    def engine_blocks(self) -> int:
        """Each engine's cache: 1/N of the chat working set (the pooled engine holds it all)."""
        return math.ceil(chat_working_set_blocks(self.chat, BLOCK_SIZE) / self.engines)

    def max_model_len(self) -> int:
        blocks = self.engine_blocks()
        longest = self.chat.history_tokens() + self.chat.answer_tokens
        if self.mooncake is not None:
            longest = max(
                longest, self.mooncake.max_blocks * BLOCK_SIZE + self.mooncake.output_tokens
            )
        limit = (blocks - 1) * BLOCK_SIZE
        if longest > limit:
            raise ValueError(
                f"the longest prompt ({longest} tokens) does not fit an engine of {blocks} blocks"
            )
        return limit


class Rig:
    """The engines, the client and the workloads of one run; measures one router at a time."""

    def __init__(self, settings: Settings, run_dir: Path, aiperf: Path, model_dir: Path) -> None:
        self.settings = settings
        self.run_dir = run_dir
        self.aiperf = aiperf
        self.model_dir = model_dir
        self.cluster: Cluster | None = None
        self._venv_status: dict[str, str | None] = {}
        self._route_status: str | bool | None = False  # False: not checked yet
        self.tokenizer = tokenizer_alias(model_dir, WORK / "hf")
        self.env = client_env(WORK / "hf")
        #: Seconds an engine took to come back the last time (the first guess: a quiet start).
        self.restart_estimate = 35.0
        #: The engines' step time, measured on the first alone (None: not measured).
        self.steps: StepTimes | None = None

    # ------------------------------------------------------------------ set-up

    def workloads(self) -> dict[str, ClientRun]:
        """The workload files, written into the run's directory."""
        maker = TextMaker(self.model_dir / "tokenizer.json")
        chat = self.settings.chat
        runs = {
            "chat": ClientRun(
                write_jsonl(self.run_dir / "chat.jsonl", chat_records(chat, maker)),
                "multi_turn",
                chat.requests,
                chat.concurrency,
                BLOCK_SIZE,
            )
        }
        if self.settings.mooncake is not None:
            records = mooncake_records(self.settings.mooncake, BLOCK_SIZE)
            runs["mooncake"] = ClientRun(
                write_jsonl(self.run_dir / "mooncake.jsonl", records),
                "mooncake_trace",
                len(records),
                self.settings.mooncake.concurrency,
                BLOCK_SIZE,
            )
        return runs

    def start_engines(self, python: str) -> Cluster:
        s = self.settings
        self.cluster = make_cluster(
            python,
            self.model_dir,
            count=s.engines,
            block_size=BLOCK_SIZE,
            blocks=s.engine_blocks(),
            pooled=not s.quick,
            max_model_len=s.max_model_len(),
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            log_dir=self.run_dir / "engines",
        )
        (self.run_dir / "engines").mkdir(parents=True, exist_ok=True)
        return self.cluster.start()

    # ------------------------------------------------------------------ routers

    def unavailable(self, router: Router) -> str | None:
        """Why ``router`` cannot run here (not installed, not built yet), or None."""
        if router.kind == "kvevents":
            if self._route_status is False:
                self._route_status = kvevents_route_unavailable()
            return f"not available yet ({self._route_status})" if self._route_status else None
        if router.target == "pooled" and (self.cluster is None or self.cluster.pooled is None):
            return "no pooled engine in this run"
        if router.venv is None:
            return None
        if router.venv.name not in self._venv_status:
            self._venv_status[router.venv.name] = router.venv.ensure()
        reason = self._venv_status[router.venv.name]
        return f"not installed ({reason})" if reason else None

    def targets(self, router: Router) -> list[BenchEngine]:
        assert self.cluster is not None
        if router.target == "pooled":
            assert self.cluster.pooled is not None
            return [self.cluster.pooled]
        if router.target == "floor":
            return self.cluster.engines[:1]
        return list(self.cluster.engines)

    def _front(self, router: Router, targets: list[BenchEngine], out: Path) -> RouterProcess | None:
        if router.command is None:
            return None
        launch = new_launch(targets, self.model_dir, BLOCK_SIZE)
        return start_router(router, launch, out / "router.log")

    def _router_metrics(self, process: RouterProcess | None, out: Path) -> str:
        if process is None:
            return ""
        text = fetch_text(process.port, "/metrics")
        if "# TYPE" not in text:
            text = fetch_text(process.metrics_port, "/metrics")
        (out / "router-metrics.txt").write_text(text)
        return text

    # ------------------------------------------------------------------ one run

    def measure(self, router: Router, workload: str, run: ClientRun, repeat: int = 0) -> Outcome:
        """``router`` in front of its engines for one client run of ``workload`` (``repeat``:
        which run of it, each in a directory of its own)."""
        out = (
            self.run_dir / workload / (slug(router.name) + (f"-run{repeat + 1}" if repeat else ""))
        )
        out.mkdir(parents=True, exist_ok=True)
        reason = self.unavailable(router)
        if reason:
            return Outcome(router.name, workload, reason)
        assert self.cluster is not None
        targets = self.targets(router)
        self.cluster.reset(self.cluster.all)
        before = self.cluster.snapshots(targets)
        load = os.getloadavg()[0]
        if router.kind == "kvevents":
            run = replace(run, http_trace=True)
        process = None
        try:
            process = self._front(router, targets, out)
            url = process.url if process else targets[0].url
            argv = aiperf_argv(self.aiperf, url, self.tokenizer, run, out)
            seconds = run_client(argv, out, self.env)
            metrics = self._router_metrics(process, out)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            return Outcome(router.name, workload, f"failed: {str(exc).splitlines()[0][:200]}")
        finally:
            if process is not None:
                process.stop()
        after = self.cluster.snapshots(targets)
        deltas = [a - b for a, b in zip(after, before, strict=True)]
        outcome = Outcome(
            router.name,
            workload,
            records=read_records(out),
            engines=deltas,
            seconds=seconds,
            router_metrics=metrics,
            extra={
                "load_average": [round(load, 2), round(os.getloadavg()[0], 2)],
                "engine_phases": engine_phases(deltas),
            },
        )
        outcome.extra["repeat"] = repeat
        if run.dataset_type == "multi_turn":
            outcome.extra["history_has_answers"] = history_carries_answers(sent_messages(out))
        strip_raw(out)
        cached = outcome.cached_fraction()
        print(
            f"bench_route: {workload} {router.name}: {len(outcome.records)} requests in "
            f"{seconds:.0f} s, cached fraction {cached}, load {load:.2f}",
            file=sys.stderr,
        )
        return outcome

    # ------------------------------------------------------------------ the fault run

    def fault(self, router: Router, run: ClientRun) -> Outcome:
        """``router`` while its first engine is killed (SIGKILL) :data:`FAULT_PHASE` s after
        the client's traffic began and relaunched on the same ports so as to be back at twice
        that (one restart earlier: the restart timed before the fault runs). The client runs
        for ``run.duration`` s of traffic and ends by itself (aiperf's own benchmark duration),
        however long the restart took."""
        out = self.run_dir / "fault" / slug(router.name)
        out.mkdir(parents=True, exist_ok=True)
        reason = self.unavailable(router)
        if reason:
            return Outcome(router.name, "fault", reason)
        assert self.cluster is not None and run.duration is not None
        engines = list(self.cluster.engines)
        self.cluster.reset(self.cluster.all)
        before = self.cluster.snapshots(engines)
        process = None
        try:
            process = self._front(router, engines, out)
            assert process is not None
            client = Client(
                aiperf_argv(self.aiperf, process.url, self.tokenizer, run, out), out, self.env
            )
            try:
                figures, victim_before, at_ready = self._kill_and_restart(engines, client, before)
            except BaseException:
                client.stop()
                raise
            seconds = client.wait()
            metrics = self._router_metrics(process, out)
            if at_ready is None:  # back only once the traffic ended, if at all
                self._revive(engines[0])
                at_ready = snapshot(engines[0])
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            self._revive(engines[0])
            return Outcome(router.name, "fault", f"failed: {str(exc).splitlines()[0][:200]}")
        finally:
            if process is not None:
                process.stop()
        after = self.cluster.snapshots(engines)
        deltas = [a - b for a, b in zip(after, before, strict=True)]
        deltas[0] = (victim_before - before[0]) + after[0]  # its counters restarted from zero
        records = read_records(out)
        if figures.ready_at is not None:
            back = client.started + figures.ready_at
            figures.after_restart = [r for r in records if r.start_s >= back]
        figures.victim_requests_after = round(after[0].requests - at_ready.requests)
        strip_raw(out)
        return Outcome(
            router.name,
            "fault",
            records=records,
            engines=deltas,
            seconds=seconds,
            router_metrics=metrics,
            fault=figures,
        )

    def _traffic_began(
        self, engines: list[BenchEngine], before: list[Snapshot], client: Client
    ) -> float:
        """Seconds after the client's start at which an engine first saw a prompt (aiperf
        takes a while to configure itself before it sends anything)."""
        deadline = Deadline(300)
        while client.running() and not deadline.expired:
            with contextlib.suppress(OSError, VllmServerError):
                now = self.cluster.snapshots(engines) if self.cluster else []
                if any(n.queries > b.queries for n, b in zip(now, before, strict=True)):
                    return client.elapsed()
            time.sleep(0.5)
        raise RuntimeError("the client sent nothing in 300 s")

    def _kill_and_restart(
        self, engines: list[BenchEngine], client: Client, before: list[Snapshot]
    ) -> tuple[FaultFigures, Snapshot, Snapshot | None]:
        """Kill the victim a phase into the traffic, relaunch it, and wait for it while the
        client runs: (the figures, its counters before the kill, its counters once back; None
        when it was not back before the client's run ended)."""
        victim = engines[0]
        began = self._traffic_began(engines, before, client)
        client.sleep_until(began + FAULT_PHASE)
        victim_before = snapshot(victim)
        victim.kill()
        killed = client.elapsed()
        client.sleep_until(max(killed + 5, began + 2 * FAULT_PHASE - self.restart_estimate))
        victim.relaunch(boost=True)
        restarted = client.elapsed()
        ready = _back_while(victim, client)
        victim.settle()
        at_ready = snapshot(victim) if ready is not None else None
        return FaultFigures(killed, restarted, ready, victim.url), victim_before, at_ready

    def time_restart(self) -> float:
        """Kill the first engine and start it again, idle: seconds until it answers."""
        assert self.cluster is not None
        victim = self.cluster.engines[0]
        victim.kill()
        began = time.monotonic()
        victim.relaunch()
        victim.wait_ready(Deadline(300))
        self.restart_estimate = time.monotonic() - began
        return self.restart_estimate

    def _revive(self, victim: BenchEngine) -> None:
        """After a failed fault run: the victim running again for the next router."""
        with contextlib.suppress(Exception):
            victim.metrics()
            return
        victim.stop()
        victim.relaunch()
        victim.wait_ready(Deadline(300))


def _back_while(victim: BenchEngine, client: Client) -> float | None:
    """Seconds into the client's run at which the relaunched ``victim`` answered /health;
    None when it did not while the client ran. (Under the rig's traffic a relaunched vLLM
    CPU engine's worker can wait for minutes to start: 4 min 22 s on 2026-12-07, until the
    traffic ended, against 12 s idle.)"""
    while client.running():
        try:
            victim.wait_ready(Deadline(2))
            return client.elapsed()
        except VllmServerError:
            time.sleep(0.5)  # not answering yet (or exited: revived after the run)
    return None


# ---------------------------------------------------------------------- the whole run


def fault_run(settings: Settings, rig: Rig, chat: list[Outcome]) -> ClientRun:
    """The fault run's workload: the chat's, with conversations enough for the longest fault run.

    The client runs until the rig stops it (see :meth:`Rig.fault`); the file holds twice the
    conversations the fastest chat run would finish in three phases and two restarts, so none
    is sent twice. The restart is timed here, once, on an idle engine (with a margin).
    """
    restart = rig.time_restart() * FAULT_RESTART_MARGIN
    rig.restart_estimate = restart
    # Traffic: a phase up, the kill, a restart (the estimate, with its margin), a phase after.
    duration = 2 * FAULT_PHASE + 5 + restart
    longest = duration + CLIENT_GRACE
    timed = [o for o in chat if o.status == "ok" and o.seconds]
    rate = max((len(o.records) / o.seconds for o in timed), default=5.0)
    conversations = math.ceil(2 * rate * longest / settings.chat.turns)
    shape = replace(settings.chat, conversations=max(settings.chat.conversations, conversations))
    maker = TextMaker(rig.model_dir / "tokenizer.json")
    path = write_jsonl(rig.run_dir / "fault.jsonl", chat_records(shape, maker))
    print(
        f"bench_route: fault runs: {FAULT_PHASE:.0f} s phases, a restart {restart:.0f} s "
        "with margin",
        file=sys.stderr,
    )
    return ClientRun(
        path, "multi_turn", shape.requests, shape.concurrency, BLOCK_SIZE, duration=duration
    )


def chosen(entries: list[Router], wanted: str | None) -> list[Router]:
    """The entries whose name contains one of ``wanted``'s comma-separated words (all without
    it): ``KVEVENTS_BENCH_ROUTE_ROUTERS=kvevents,pooled`` runs only those (a shorter run)."""
    if not wanted:
        return entries
    words = [w.strip() for w in wanted.split(",") if w.strip()]
    return [e for e in entries if any(w in e.name for w in words)]


def measure_all(settings: Settings, rig: Rig, runs: dict[str, ClientRun]) -> list[Outcome]:
    """Every router on every workload, then the fault runs."""
    entries = chosen(
        routers(WORK / "venvs", quick=settings.quick),
        os.environ.get("KVEVENTS_BENCH_ROUTE_ROUTERS"),
    )
    outcomes = [
        rig.measure(router, name, run, repeat)
        for name, run in runs.items()
        for repeat in range(settings.repeats if name == "chat" else 1)
        for router in entries
        if name == "chat" or router.name not in CHAT_ONLY
    ]
    if settings.faults:
        run = fault_run(settings, rig, [o for o in outcomes if o.workload == "chat"])
        for router in entries:
            # One fault run per router: kvevents route's with its default policy.
            if router.kind == "peer" or router.name == "kvevents route (default)":
                outcomes.append(rig.fault(router, run))
    return outcomes


def rig_rows(settings: Settings, rig: Rig, runs: dict[str, ClientRun], wall: float) -> list[Row]:
    """What the run was: engines, caches, workloads, yardsticks, time, machine load."""
    section = f"The route rig: {settings.engines} vLLM CPU engines, aiperf, block size {BLOCK_SIZE}"
    blocks = settings.engine_blocks()
    assert rig.cluster is not None
    rows = [
        Row(section, "each engine's cache", "blocks", float(blocks), ""),
        Row(
            section,
            "chat working set",
            "blocks",
            float(chat_working_set_blocks(settings.chat, BLOCK_SIZE)),
            "",
        ),
        Row(
            section,
            "engine start-up (slowest)",
            "seconds",
            max(e.startup for e in rig.cluster.all),
            "s",
        ),
        Row(section, "whole run", "minutes", wall / 60, "min"),
        Row(section, "load average at the end", "1 min", os.getloadavg()[0], ""),
    ]
    if rig.steps is not None:
        alone = "an engine's step, measured alone"
        rows.append(Row(section, alone, "decode step", rig.steps.base_s * 1e3, "ms"))
        rows.append(Row(section, alone, "prefill per token", rig.steps.token_s * 1e3, "ms"))
    for name, run in runs.items():
        rows.append(Row(section, f"{name} workload", "requests", float(run.requests), ""))
    if settings.mooncake is not None:
        records = mooncake_records(settings.mooncake, BLOCK_SIZE)
        prompts = [r["hash_ids"] for r in records]
        rows.append(
            Row(
                section,
                "mooncake workload",
                "reused blocks",
                float(mooncake_working_set_blocks(records)),
                "",
            )
        )
        for label, capacity in (("pooled", blocks * settings.engines), ("one engine's", blocks)):
            rows.append(
                Row(
                    section,
                    f"mooncake, LRU yardstick, {label} cache",
                    "hit fraction",
                    100 * lru_hit_fraction(prompts, capacity),
                    "%",
                )
            )
    return rows


def result_rows(settings: Settings, outcomes: list[Outcome]) -> list[Row]:
    rows: list[Row] = []
    for workload in ("chat", "mooncake", "fault"):
        section = SECTIONS[workload].format(n=settings.engines)
        chosen = merged([o for o in outcomes if o.workload == workload])
        pooled = next((o.cached_fraction() for o in chosen if o.router.startswith("pooled")), None)
        for outcome in chosen:
            rows += (
                fault_rows(section, outcome)
                if workload == "fault"
                else outcome_rows(section, outcome, pooled)
            )
    return rows


def run(quick: bool | None = None) -> list[Row]:
    settings = Settings.from_env(quick)
    skipped = SECTIONS["chat"].format(n=settings.engines)
    reason = vllm_unavailable()
    if reason is not None:
        return [Row(skipped, f"skipped: {reason}", "available", 0.0, "")]
    aiperf = Venv("aiperf", AIPERF, WORK / "venvs")
    why = aiperf.ensure()
    if why is not None:
        return [Row(skipped, f"skipped: the client did not install ({why})", "available", 0.0, "")]
    python = find_vllm_python()
    assert python is not None
    began = time.monotonic()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    run_dir = WORK / "runs" / (stamp + ("-quick" if settings.quick else ""))
    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir = build_chat_model(python, WORK / "model" / "chat")
    rig = Rig(settings, run_dir, aiperf.bin("aiperf"), model_dir)
    runs = rig.workloads()
    print(
        f"bench_route: load average at start {os.getloadavg()}; run in {run_dir}", file=sys.stderr
    )
    cluster = rig.start_engines(python)
    try:
        (run_dir / "engines.json").write_text(json.dumps(describe(cluster), indent=2))
        rig.steps = engine_steps(cluster.engines[0], model_dir)
        outcomes = measure_all(settings, rig, runs)
    finally:
        cluster.stop()
    rows = rig_rows(settings, rig, runs, time.monotonic() - began) + result_rows(settings, outcomes)
    sim = simulate_rows(settings, rig, outcomes)
    rows += sim
    write_summary(run_dir, settings, outcomes, rows, rig.steps)
    return rows


def engine_steps(engine: BenchEngine, model_dir: Path) -> StepTimes | None:
    """The engine's step time measured alone (:func:`route_sim.measure_step_times`), before
    any router runs (its caches are reset before each); None, and why on stderr, when the
    probe failed: the simulator then runs on its own step time, and says so."""
    budget = min(1024, MAX_NUM_BATCHED_TOKENS)
    try:
        vocabulary = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        steps = measure_step_times(engine.url, MODEL_NAME, vocabulary, prompt_tokens=budget)
    except (OSError, KeyError, RuntimeError, ValueError, httpx.HTTPError) as exc:
        print(f"bench_route: the engines' step time was not measured: {exc}", file=sys.stderr)
        return None
    print(f"bench_route: the engines' step time: {steps.label()}", file=sys.stderr)
    return steps


def simulate_rows(settings: Settings, rig: Rig, outcomes: list[Outcome]) -> list[Row]:
    """The chat runs' prompts through the simulator (see :mod:`route_sim`)."""
    return _simulated(
        settings.engines,
        settings.engine_blocks(),
        settings.chat.concurrency,
        settings.chat.answer_tokens,
        outcomes,
        rig.run_dir,
        rig.model_dir,
        rig.steps,
    )


def _simulated(
    engines: int,
    blocks: int,
    concurrency: int,
    answer_tokens: int,
    outcomes: list[Outcome],
    run_dir: Path,
    model_dir: Path,
    steps: StepTimes | None,
    *,
    answers: bool = False,
) -> list[Row]:
    from route_sim import SimShape, sim_rows

    shape = SimShape(
        engines=engines,
        blocks=blocks,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        concurrency=concurrency,
        answer_tokens=answer_tokens,
        steps=steps or StepTimes.simulator(),
        answers=answers,
    )
    timing = "measured on an engine alone" if steps else "the simulator's own: not measured"
    if answers:
        timing += "; each turn answering with the engine's answer as the next turn holds it"
    section = (
        f"Simulator vs the real engines: the chat run's prompts, closed loop at concurrency "
        f"{concurrency}, {engines} engines of {blocks} blocks, {shape.steps.label()} "
        f"({timing})"
    )
    return sim_rows(section, outcomes, run_dir, shape, model_dir)


def resimulate(
    run_dir: Path, steps: StepTimes | None = None, *, answers: bool = False
) -> list[Row]:
    """The simulator section again, from a finished run's directory (its ``summary.json``
    and the client's exports): the simulator checked against real runs already made, without
    the engines. The tiny chat model must be built (``bench/.work/route/model/chat``).
    ``steps``: the engines' step time (default: as the run measured it, if it did);
    ``answers``: each turn answers with the engine's answer as the next turn holds it
    (:attr:`route_sim.SimShape.answers`)."""
    data = json.loads((run_dir / "summary.json").read_text())
    chat = data["settings"]["chat"]
    outcomes = []
    for entry in data["outcomes"]:
        if entry["workload"] != "chat" or entry["status"] != "ok":
            continue
        repeat = int(entry.get("repeat") or 0)
        name = slug(entry["router"]) + (f"-run{repeat + 1}" if repeat else "")
        outcome = Outcome(entry["router"], "chat", records=read_records(run_dir / "chat" / name))
        outcome.engines = [Snapshot(requests=n) for n in entry.get("per_engine") or ()]
        outcome.extra["repeat"] = repeat
        if entry.get("engine_phases"):
            outcome.extra["engine_phases"] = entry["engine_phases"]
        outcomes.append(outcome)
    engines = int(data["settings"]["engines"])
    model_dir = WORK / "model" / "chat"
    args = (engines, int(data["engine_blocks"]), chat["concurrency"], chat["answer_tokens"])
    if steps is None and data.get("step_times"):
        steps = StepTimes(**data["step_times"])
    return _simulated(*args, outcomes, run_dir, model_dir, steps, answers=answers)


def write_summary(
    run_dir: Path,
    settings: Settings,
    outcomes: list[Outcome],
    rows: list[Row],
    steps: StepTimes | None = None,
) -> None:
    """The run's record next to the client's own reports: summary.json, rows.json, the chart."""
    from route_chart import route_svg

    data = {
        "settings": asdict(settings),
        "engine_blocks": settings.engine_blocks(),
        "config_notes": CONFIG_NOTES,
        "step_times": None if steps is None else asdict(steps),
        "outcomes": summary(outcomes),
    }
    (run_dir / "summary.json").write_text(json.dumps(data, indent=2, default=str))
    (run_dir / "rows.json").write_text(json.dumps([asdict(r) for r in rows], indent=2, default=str))
    (run_dir / "routers.svg").write_text(route_svg(rows, f"Routers side by side ({run_dir.name})"))
    latest = WORK / "runs" / "latest"
    with contextlib.suppress(OSError):
        latest.unlink(missing_ok=True)
        latest.symlink_to(run_dir.name)


def record(rows: list[Row], bench_dir: Path) -> list[Path]:
    """When ``bench/run.py`` records: the chart and the client's own summaries, committed.

    ``bench/RESULTS-route.svg`` shows the routers side by side; ``bench/route-results/``
    keeps aiperf's own summary (``profile_export_aiperf.csv``) of every run and our
    ``summary.json``, from the run that produced ``rows``.
    """
    from route_chart import route_svg

    written = [bench_dir / "RESULTS-route.svg"]
    written[0].write_text(route_svg(rows, "Routers side by side on real vLLM CPU engines"))
    latest = (WORK / "runs" / "latest").resolve()
    if not latest.is_dir():
        return written
    target = bench_dir / "route-results"
    shutil.rmtree(target, ignore_errors=True)
    for csv in sorted(latest.glob("*/*/profile_export_aiperf.csv")):
        copy = target / csv.parent.parent.name / f"{csv.parent.name}.aiperf.csv"
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(csv, copy)
        written.append(copy)
    for name in ("summary.json", "engines.json"):
        if (latest / name).exists():
            shutil.copyfile(latest / name, target / name)
            written.append(target / name)
    return written


if __name__ == "__main__":
    from run import render

    argv = [a for a in sys.argv[1:] if a != "--answers"]
    if len(argv) in (2, 3) and argv[0] == "--simulate":  # a finished run, again
        # [BASE_MS:TOKEN_MS]: the engines' step time, for a run that did not measure it;
        # --answers: each turn answers with the engine's answer (route_sim.with_answers)
        given = argv[2].split(":") if len(argv) == 3 else None
        steps = StepTimes(float(given[0]) / 1e3, float(given[1]) / 1e3) if given else None
        got = resimulate(Path(argv[1]), steps, answers="--answers" in sys.argv)
    else:
        got = run(quick="--quick" in sys.argv[1:] or None)
    print(render(got, ""))
