"""The hang watchdog and the straggler ratio: a thread in every rank, talking only to the rendezvous store.

A rank stuck in a collective leaves every other rank waiting in theirs. The watchdog thread
notices that no step has completed for `hangFactor` x the recent step time (at least
`hangFloorSeconds`; `longWorkSeconds` during the first step, evaluations and checkpoint
saves), reads every rank's heartbeat from the store (a store read cannot hang on the stuck
rank the way a collective would), says which ranks are behind and at which step, dumps
every thread's Python stack, and exits with EXIT_HUNG, which the operator's restartPolicy
ExitCode retries: the pods restart and the run resumes from its last checkpoint.

Every `poll` seconds each rank's thread writes its heartbeat: last completed step, what
it is doing, and its busy time per step (step time less the wait for the other ranks'
gradients). Rank 0's thread reads all heartbeats and publishes each rank's busy time
relative to the median; every rank exports its own ratio. Each rank also reads the next
rank's heartbeat: one that stays the same past that rank's limit and its launcher's margin
is a frozen process (trainer.frozen), which ends the job as hung for ranks waiting where the
launcher's kill of it does not reach. The step itself only sets a few attributes: nothing
on the step path talks to the network. See docs/hangs.md.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from trainer.dist import Dist
from trainer.failures import Failure, first_line, write_record
from trainer.frozen import MARGIN_POLLS, Beat, beat_path, write_beat
from trainer.names import EXIT_HUNG, FREEZE_RANK_ENV, HEARTBEAT_DIR_ENV, SLOW_RANK_ENV
from trainer.tracking import finish as finish_tracking

HUNG = "hung"  # store key: the first rank to find the job hung writes its report here
RATIOS = "step-time-ratios"  # store key: rank 0's {rank: busy time / median}
STALE_POLLS = 3  # a heartbeat older than this many polls: the rank is frozen, stopped or gone
EXIT_GRACE_POLLS = 2  # the finder waits this long before exiting, so its peers exit hung too, not on a lost peer


def heartbeat_key(rank: int) -> str:
    return f"heartbeat/{rank}"


def test_hook(name: str, rank: int) -> float | None:
    """This rank's value of a test hook: the variable `name` holds "RANK:VALUE"."""
    hook_rank, _, value = os.environ.get(name, "").partition(":")
    return float(value) if hook_rank == str(rank) else None


def test_slowdown(rank: int) -> float:
    """Seconds this rank sleeps in every step: the straggler test hook (SLOW_RANK_ENV="RANK:SECONDS")."""
    return test_hook(SLOW_RANK_ENV, rank) or 0.0


class GradientSync:
    """How long this rank waited for the other ranks' gradients: DDP's all-reduce, registered as its comm hook.

    DDP calls the hook for each gradient bucket as soon as this rank has computed it; what
    passes between the last call and the end of backward is the wait for the slowest rank
    (and the transfer). On a GPU both ends are CUDA events, read once they have completed.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.ready: Any = 0.0
        self.pending: deque[tuple[Any, Any]] = deque()
        self.waited_seconds = 0.0  # in total, over the steps measured so far

    def hook(self, bucket):  # unannotated: DDP rejects annotations that are strings
        self.ready = self.now()
        return allreduce_hook(None, bucket)

    def now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def backward_done(self) -> None:
        """After the backward pass that synchronised gradients."""
        if not self.cuda:
            self.waited_seconds += time.perf_counter() - self.ready
            return
        self.pending.append((self.ready, self.now()))
        while self.pending and self.pending[0][1].query():
            ready, done = self.pending.popleft()
            self.waited_seconds += ready.elapsed_time(done) / 1000


class Watchdog:
    """Run the training loop inside `with Watchdog(...)`; call `step_done` after each step and wrap
    one-off work in `long_work`. Without a process group it only measures (there is no one to wait for)."""

    def __init__(self, dist: Dist, sync: GradientSync | None, metrics: Any) -> None:
        self.dist = dist
        self.spec = dist.timeouts
        self.sync = sync
        self.metrics = metrics
        # Four looks per floor, at most every 5 s: a hang is named within about a quarter of the floor.
        self.poll = min(5.0, max(0.5, self.spec.hang_floor_seconds / 4))
        self.step = 0
        self.one_off: str | None = None  # the one-off work under way (an evaluation, a checkpoint save)
        self.waiting = False  # for the next batch
        self.progress = time.monotonic()  # last completed step, or start or end of one-off work
        self.step_seconds: deque[float] = deque(maxlen=32)
        self.wall_seconds = 0.0  # all steps' wall time; with sync.waited_seconds: the busy time
        self.steps = 0
        self.published = (0.0, 0.0, 0)  # (wall, waited, steps) at the last heartbeat
        self.busy: float | None = None
        self.peer_report: str | None = None  # another rank found the job hung (read by the heartbeat thread)
        self.frozen_neighbour: str | None = None  # the next rank is frozen (found by the heartbeat thread)
        self.neighbour_beat: tuple[float, float] | None = None  # its last heartbeat's time, and when it was new here
        self.stopped = threading.Event()
        self.freeze_after = test_hook(FREEZE_RANK_ENV, dist.rank)  # the frozen-rank test hook: a step, or None
        # Where this rank's launcher looks for a rank that is frozen as a whole (trainer.frozen); unset without one.
        self.beats = Path(os.environ[HEARTBEAT_DIR_ENV]) if HEARTBEAT_DIR_ENV in os.environ else None
        self.beat_lock = threading.Lock()  # the watch thread and the end of one-off work both write the beat
        # Two threads: the store may be served by a rank that is frozen too (elastic jobs: rank 0's process),
        # and then a store call blocks; the watch itself never waits on the store for longer than a poll.
        self.threads = [
            threading.Thread(target=self.watch, name="ddpjob-watchdog", daemon=True),
            threading.Thread(target=self.heartbeat, name="ddpjob-heartbeat", daemon=True),
        ]

    # -- the training thread ------------------------------------------------------------------

    def __enter__(self) -> Watchdog:
        if self.dist.store is not None:
            self.publish()  # every rank's heartbeat exists before anyone could look for it
            for thread in self.threads:
                thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self.stopped.set()
        if self.threads[0].is_alive():  # started only with a store: not in a single process without torchrun
            self.threads[0].join()  # the heartbeat thread may be inside a store call: it ends with the process
        if self.beats is not None:  # what follows the loop (the final save) is not watched
            beat_path(self.beats, os.getpid()).unlink(missing_ok=True)
        if not isinstance(exc, Exception) or self.dist.store is None:
            return
        failed = first_line(exc)
        # A collective that failed because a peer found the job hung and exited: this rank is hung too.
        if report := self.read(HUNG):
            self.exit_hung(f"{report} (this rank's collective then failed: {failed})")
        # Or because a peer's launcher killed it, frozen (trainer.frozen): that comes first when this rank was held
        # to longWorkSeconds (an evaluation, a save) and the frozen one, by its last heartbeat, to the step's limit.
        with contextlib.suppress(Exception):  # the store's host is gone too: the failure stands as it is
            beats = self.heartbeats()
            if any(self.silent(beat) for beat in beats.values()):
                self.exit_hung(f"hang: rank {self.dist.rank}'s collective failed ({failed}); {self.behind(beats)}")

    def step_done(self, step: int, seconds: float) -> None:
        self.step_seconds.append(seconds)
        self.wall_seconds += seconds
        self.steps += 1
        self.step, self.progress = step, time.monotonic()
        if step == self.freeze_after:
            os.kill(os.getpid(), signal.SIGSTOP)  # the whole process, watchdog threads too, as a frozen one

    def waiting_for_data(self, waiting: bool) -> None:
        self.waiting = waiting

    @contextlib.contextmanager
    def long_work(self, what: str) -> Iterator[None]:
        """One-off work (an evaluation, a checkpoint save): bounded by longWorkSeconds, not by the step time."""
        self.one_off, self.progress = what, time.monotonic()
        try:
            yield
        finally:
            self.one_off, self.progress = None, time.monotonic()
            # At once, not at the next poll: a rank frozen right after must be held to the step's limit, not
            # longWorkSeconds (while the watch thread runs: the beat of a rank no longer watched is removed).
            if self.spec.watchdog and self.threads[0].is_alive():
                self.beat()

    @property
    def phase(self) -> str:
        if self.one_off:
            return self.one_off
        if not self.steps:
            return "first step"
        return "waiting for data" if self.waiting else "compute"

    # -- the watchdog thread ------------------------------------------------------------------

    def limit(self) -> tuple[float, str]:
        """(seconds without progress that mean a hang, why that many)."""
        if self.one_off or not self.steps:
            return self.spec.long_work_seconds, f"training.timeouts.longWorkSeconds, during the {self.phase}"
        recent = statistics.median(tuple(self.step_seconds))  # a copy: the training thread appends to it
        limit = max(self.spec.hang_floor_seconds, self.spec.hang_factor * recent)
        return limit, (
            f"{self.spec.hang_factor:g} x the recent step time of {recent:.2f} s,"
            f" at least training.timeouts.hangFloorSeconds = {self.spec.hang_floor_seconds}"
        )

    def heartbeat(self) -> None:
        while not self.stopped.wait(self.poll):
            try:
                self.publish()
                self.straggler_ratios()
                self.watch_neighbour()
            except Exception as exc:  # a store that does not answer must not end the heartbeats
                print(f"[rank {self.dist.rank}] watchdog: the rendezvous store: {exc}", file=sys.stderr, flush=True)
            self.peer_report = self.read(HUNG)

    def watch_neighbour(self) -> None:
        """Every rank reads the next rank's heartbeat (one store read a poll; each rank watched by one). One older than
        that rank's limit plus its launcher's margin is a frozen process, which its launcher kills now: the job is
        hung, for the ranks that wait where the kill does not reach them too (a barrier on the store, an NCCL
        collective), which would otherwise wait out longWorkSeconds."""
        if self.dist.world_size == 1 or not self.spec.watchdog or self.frozen_neighbour:
            return
        rank = (self.dist.rank + 1) % self.dist.world_size
        raw = self.read(heartbeat_key(rank))  # none yet: that rank has not reached the training loop
        if raw is None:
            return
        beat, now = json.loads(raw), time.monotonic()
        if self.neighbour_beat is None or beat["time"] != self.neighbour_beat[0]:
            self.neighbour_beat = (beat["time"], now)  # timed on this rank's clock: nodes' clocks may differ
        silent = now - self.neighbour_beat[1]
        if silent > beat["limit"] + MARGIN_POLLS * self.poll:
            report = (
                f"hang: rank {rank} stopped responding (no new heartbeat for {silent:.0f} s, the last after step"
                f" {beat['step']}; its limit {beat['limit']:.0f} s): process stopped or frozen, or its node is gone;"
                f" found by rank {self.dist.rank}"
            )
            self.dist.store.compare_set(HUNG, "", report)
            self.frozen_neighbour = report

    def watch(self) -> None:
        while not self.stopped.wait(self.poll):
            if self.frozen_neighbour:  # written into the store: the others exit as hung within a poll
                time.sleep(EXIT_GRACE_POLLS * self.poll)
                self.exit_hung(self.frozen_neighbour)
            if self.peer_report:
                self.exit_hung(f"{self.peer_report} (found by another rank)")
            stalled = time.monotonic() - self.progress
            if not self.spec.watchdog:
                continue
            limit, why = self.beat()  # from this thread: it never waits on the store, a frozen peer's or not
            if stalled > limit:
                self.found_hung(stalled, limit, why)

    def beat(self) -> tuple[float, str]:
        """The limit that holds now, with why; left for this rank's launcher too, where it has one."""
        limit, why = self.limit()
        if self.beats is not None:
            with self.beat_lock:
                write_beat(self.beats, Beat(os.getpid(), self.dist.rank, self.step, limit, why, self.poll))
        return limit, why

    def publish(self) -> None:
        waited = self.sync.waited_seconds if self.sync else 0.0
        wall0, waited0, steps0 = self.published
        if self.steps > steps0:
            self.busy = ((self.wall_seconds - wall0) - (waited - waited0)) / (self.steps - steps0)
            self.published = (self.wall_seconds, waited, self.steps)
        state = {
            "step": self.step,
            "phase": self.phase,
            "busy": self.busy,
            "limit": self.limit()[0],
            "time": time.time(),
        }
        self.dist.store.set(heartbeat_key(self.dist.rank), json.dumps(state))

    def heartbeats(self) -> dict[int, dict[str, Any]]:
        """Every rank's last heartbeat (ranks that never wrote one are left out)."""
        keys = [heartbeat_key(rank) for rank in range(self.dist.world_size)]
        if self.dist.store.check(keys):
            return {rank: json.loads(value) for rank, value in enumerate(self.dist.store.multi_get(keys))}
        return {
            rank: json.loads(self.dist.store.get(key)) for rank, key in enumerate(keys) if self.dist.store.check([key])
        }

    def straggler_ratios(self) -> None:
        """Rank 0 publishes every rank's busy time over the median; each rank exports its own."""
        if self.dist.is_main:
            busy = {rank: beat["busy"] for rank, beat in self.heartbeats().items() if beat["busy"]}
            if len(busy) == self.dist.world_size:
                median = statistics.median(busy.values())
                ratios = {rank: seconds / median for rank, seconds in busy.items()}
                self.dist.store.set(RATIOS, json.dumps(ratios))
                slowest = max(ratios, key=ratios.__getitem__)
                self.metrics.slowest_rank(slowest, ratios[slowest])
        ratios = self.read(RATIOS)
        if ratios:
            self.metrics.step_time_ratio(json.loads(ratios)[str(self.dist.rank)])

    def read(self, key: str) -> str | None:
        """A store value, or None when it is not there (or the store does not answer)."""
        with contextlib.suppress(Exception):
            if self.dist.store is not None and self.dist.store.check([key]):
                return self.dist.store.get(key).decode()
        return None

    def found_hung(self, stalled: float, limit: float, why: str) -> None:
        hang = f"hang: rank {self.dist.rank} completed no step for {stalled:.0f} s (limit {limit:.0f} s: {why})"
        behind: list[str] = []

        def tell_the_others() -> None:
            try:
                behind.append(self.behind(self.heartbeats()))
            except Exception as exc:  # the store's host is gone too
                behind.append(f"the other ranks' heartbeats are unreadable ({first_line(exc)})")
            with contextlib.suppress(Exception):  # the first finder's report is the one all ranks give
                self.dist.store.compare_set(HUNG, "", f"{hang}; {behind[0]}")

        # In a thread of its own: a store served by a frozen process does not answer at all.
        threading.Thread(target=tell_the_others, name="ddpjob-hang-report", daemon=True).start()
        time.sleep(EXIT_GRACE_POLLS * self.poll)
        silent = f"the rendezvous store did not answer within {EXIT_GRACE_POLLS * self.poll:g} s"
        self.exit_hung(f"{hang}; {behind[0] if behind else silent}")

    def silent(self, beat: dict[str, Any]) -> bool:
        """A heartbeat older than STALE_POLLS polls: its rank's process is stopped, frozen or gone (its heartbeats
        come from a thread of their own, whatever the training thread is doing). Its writer's clock against this
        rank's: nodes' clocks agree (NTP), as torch's rendezvous assumes for its keep-alives (docs/hangs.md)."""
        return time.time() - beat["time"] > STALE_POLLS * self.poll

    def behind(self, beats: dict[int, dict[str, Any]]) -> str:
        """Which ranks hold the others up: no heartbeat, an older step, or doing something else than most."""
        now = time.time()
        newest = max(beat["step"] for beat in beats.values())
        # What most ranks that still answer are doing: a silent rank's last phase is no longer true.
        answering = [beat for beat in beats.values() if not self.silent(beat)] or list(beats.values())
        phases = [beat["phase"] for beat in answering]
        usual = max(set(phases), key=phases.count)
        lines = []
        for rank in range(self.dist.world_size):
            beat = beats.get(rank)
            if beat is None:
                lines.append(f"rank {rank}: never reached the training loop")
                continue
            age = now - beat["time"]
            if self.silent(beat):
                # Its heartbeat may be a poll old; its gradients were in the others' last step (or they would lack it).
                lines.append(
                    f"rank {rank}: stopped responding after step {max(newest, beat['step'])} (it took part in that"
                    f" step's gradient all-reduce; no heartbeat for {age:.0f} s): process stopped or frozen,"
                    " or its node is gone"
                )
            elif beat["step"] < newest or beat["phase"] != usual:
                lines.append(f"rank {rank}: last step {beat['step']}, {beat['phase']}")
        others = self.dist.world_size - len(lines)
        rest = f"the other {others} rank(s): last step {newest}, {usual}"
        if not lines:
            return f"no rank stands out ({rest}): see each rank's stacks below"
        return f"behind: {'; '.join(lines)}; {rest}"

    def exit_hung(self, report: str) -> None:
        """Report, dump every thread's stack, exit EXIT_HUNG at once (the training thread is stuck in C++)."""
        print(f"[rank {self.dist.rank}] {report}", file=sys.stderr, flush=True)
        print(f"[rank {self.dist.rank}] Python stacks of every thread of this rank:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):  # the root cause torchrun and `ctl run` report
            write_record(Path(error_file), Failure(EXIT_HUNG, report, time.time(), self.dist.rank))
        finish_tracking(EXIT_HUNG, within=self.poll)  # os._exit skips the exit hooks that would close them
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_HUNG)
