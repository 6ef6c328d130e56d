"""The tables and lines `ctl status` and `ctl list` print for people (`-o json|yaml` print the JSON form)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # ctl.status imports the Kubernetes client: not for `ctl --help`
    from ctl.progress import Progress
    from ctl.status import JobRow, JobStatus, PrepareStatus, QueueStatus


def status_table(status: JobStatus) -> str:
    lines = [f"{status.name} ({status.namespace}): {status.state.value}"]
    if status.cause:
        lines.append(f"  cause: {status.cause}")
    if status.progress:
        lines.append(f"  progress: {progress_text(status.progress)}")
    if status.trainer_status:
        lines.append(f"  trainer status: {trainer_status_text(status.trainer_status)}")
    if status.prepare:
        lines.append(f"  prepare: {prepare_text(status.prepare)}")
    if status.queue:
        lines.append(f"  queue: {queue_text(status.queue)}")
    lines += [
        f"  {c['type']:<11} {c['status']:<6} {c['reason'] or ''}: {one_line(c['message'])}" for c in status.conditions
    ]
    lines.append(f"  {'POD':<32} {'PHASE':<10} {'RESTARTS':>8} {'EXIT':>5}  REASON")
    lines += [
        f"  {p.name:<32} {p.phase:<10} {p.restarts:>8} {'' if p.exit_code is None else p.exit_code:>5}"
        f"  {p.reason or ''}"
        for p in status.pods
    ]
    lines += [f"  {p.name}: {one_line(p.message)}" for p in status.pods if p.message]
    lines += [f"  event: {e['object']} {e['type']} {e['reason']}: {one_line(e['message'])}" for e in status.events]
    return "\n".join(lines)


def one_line(text: str | None) -> str:
    """A message of several lines (an operator's event quotes a container's termination message whole; a condition
    may hold another controller's lines) as its first and last: one line of a table, or of a cause."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return " ... ".join(dict.fromkeys([lines[0], lines[-1]])) if lines else ""


def status_line(status: JobStatus) -> str:
    """`ctl status -w`'s line: state, the queue (while Kueue holds the job, or counts its time budget), progress and
    the pods."""
    pods = ", ".join(
        f"{p.node} {p.phase}"  # master-0, worker-0; node-0, node-1
        + (f" ({p.restarts} restarts)" if p.restarts else "")
        for p in status.pods
    )
    progress = status.progress and progress_text(status.progress)
    queue = status.queue
    queued = queue and (queue.pending or queue.time_budget_seconds) and queue_text(queue)
    return " | ".join(filter(None, [status.state.value, queued, progress, pods]))


def progress_text(progress: Progress) -> str:
    step = f"step {progress.step}" + (f"/{progress.planned_steps}" if progress.planned_steps else "")
    parts = [step]
    parts += [f"loss {progress.train_loss:.4f}"] if progress.train_loss is not None else []
    parts += [f"val loss {progress.eval_loss:.4f}"] if progress.eval_loss is not None else []
    parts += [f"{progress.tokens_per_second:,.0f} tok/s"] if progress.tokens_per_second is not None else []
    checkpoint = progress.checkpoint
    parts += [f"checkpoint step-{checkpoint.step} at {checkpoint.time}"] if checkpoint else []
    slowest = progress.slowest_rank
    if slowest:
        parts.append(f"slowest rank {slowest.rank} ({slowest.step_time_ratio_to_median:.2f}x the median)")
    return ", ".join(parts)


def prepare_text(prepare: PrepareStatus) -> str:
    """The prepare Job in one line: `job/NAME Failed (exit code 137; BackoffLimitExceeded: ...)`."""
    why = [f"exit code {prepare.pod.exit_code}"] if prepare.pod and prepare.pod.exit_code else []
    why += [f"{prepare.reason}: {one_line(prepare.message)}"] if prepare.reason else []
    return f"job/{prepare.name} {prepare.state.value}" + (f" ({'; '.join(why)})" if why else "")


def queue_text(queue: QueueStatus) -> str:
    """`team (Kueue): admitted`, or `team (Kueue): not admitted: couldn't assign flavors to pod set ...`."""
    admission = "admitted" if queue.admitted else f"not admitted: {one_line(queue.pending)}"
    if queue.admitted and queue.time_budget_seconds:
        admission += f", {age(queue.time_used_seconds or 0)} of its {age(queue.time_budget_seconds)} time budget used"
    return f"{queue.local_queue} (Kueue): {admission}"


def trainer_status_text(status: dict[str, Any]) -> str:
    """A TrainJob's `.status.trainerStatus` (what its trainer reported to Trainer v2) in one line."""
    parts = [f"{status['progressPercentage']}%"] if status.get("progressPercentage") is not None else []
    if status.get("estimatedRemainingSeconds") is not None:
        parts.append(f"about {status['estimatedRemainingSeconds']} s left")
    parts += [f"{m['name']} {m['value']}" for m in status.get("metrics") or []]
    if status.get("lastUpdatedTime"):
        parts.append(f"at {status['lastUpdatedTime']}")
    return ", ".join(parts)


def age(seconds: int) -> str:
    """A duration as kubectl's AGE column gives it (its HumanDuration): 45s, 5m30s, 42m, 3h20m, 20h, 5d4h, 336d,
    2y70d, 9y; a creation time ahead of this clock by a second is 0s, by more <invalid>."""
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if seconds < 0:
        return "0s" if seconds == -1 else "<invalid>"
    if seconds < 120:
        return f"{seconds}s"
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 192:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    if days < 730:
        return f"{days}d"
    return f"{days // 365}y{days % 365}d" if days < 2920 and days % 365 else f"{days // 365}y"


def list_table(rows: list[JobRow]) -> str:
    lines = [f"{'NAMESPACE':<20} {'NAME':<32} {'KIND':<10} {'STATE':<11} {'NODES x PROCS':<14} {'AGE':<8} PROGRESS"]
    lines += [
        f"{r.namespace:<20} {r.name:<32} {r.kind:<10} {r.state.value:<11}"
        f" {r.nodes} x {r.procs_per_node:<10} {age(r.age_seconds):<8}"
        f" {progress_text(r.progress) if r.progress else ''}"
        for r in rows
    ]
    return "\n".join(lines)
