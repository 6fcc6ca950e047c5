"""The gRPC front-end's hooks wired to the Prometheus metrics, and a sidecar's exporter.

`MetricsEvents` is the `ServerEvents` that forwards each hook to `SidecarMetrics` (record
fields in, metric updates out; it runs on the handler threads and only updates memory).
`SidecarExporter` is what `rlfeed serve` and `rlfeed demo` run: the metrics, those hooks, a
refresh that pulls the actor's levels before a scrape, and the HTTP endpoint. Order:

    exporter = SidecarExporter(config); sidecar = start_server(config, events=exporter.events)
    exporter.start(sidecar.actor) ... exporter.stop() before sidecar.stop()
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from rlfeed.service.config import SidecarConfig
from rlfeed.service.errors import reject_reason
from rlfeed.service.frontend.events import ServerEvents
from rlfeed.service.metrics.http import MetricsServer
from rlfeed.service.metrics.recorder import MetricsConfig, SidecarMetrics
from rlfeed.service.scheduler.records import IngestResult, SampleResult, StepRecord

# A scrape waits at most this long for the scheduler actor's levels (a busy or dead actor
# must not hang Prometheus; the failure is logged and the scrape serves what it has).
REFRESH_TIMEOUT_SECONDS = 5.0


def _layout_of(responses: Sequence[bytes], token_budget: int, step: int):
    from rlfeed.service.metrics.layout_plot import layout_from_batch_responses

    return layout_from_batch_responses(responses, token_budget=token_budget, step=step)


class MetricsEvents(ServerEvents):
    """Forwards the front-end's hooks to `metrics` (see rlfeed.service.metrics.recorder for what
    each metric means). Stale rollouts count both the batch's own and those of buffered groups the
    batch made stale, as the scheduler's `rollouts_stale` counter does."""

    def __init__(self, metrics: SidecarMetrics, config: SidecarConfig) -> None:
        self.metrics = metrics
        self._token_budget = config.batching.token_budget
        self._group_size = config.rollouts.group_size

    def on_ingest(self, result: IngestResult, *, tokens: int, seconds: float) -> None:
        self.metrics.on_ingest(
            accepted=result.accepted,
            accepted_tokens=result.accepted_tokens,
            duplicate=result.duplicate,
            stale=result.stale + result.stale_buffered,
            stale_tokens=result.stale_tokens,
            expired=result.expired,
            ack_seconds=seconds,
            buffered_rollouts=result.buffered_rollouts,
            newest_policy_version=result.newest_policy_version,
        )

    def on_reject(self, error: BaseException, *, rollouts: int, tokens: int) -> None:
        self.metrics.on_reject(reject_reason(error).value, rollouts=rollouts, tokens=tokens)

    def on_step(self, record: StepRecord, *, responses: list[bytes], ready_time: float) -> None:
        # The picture is drawn from what the ranks are served, and only when asked for.
        layout = functools.partial(_layout_of, responses, self._token_budget, record.step)
        self.metrics.on_step(record, ready_time=ready_time, layout=layout)

    def on_served(self, step: int, rank: int, response: bytes) -> None:
        self.metrics.on_served(step, rank)

    def on_task_sample(self, *, requested: int, result: SampleResult) -> None:
        self.metrics.on_task_sample(
            requested=requested,
            returned=len(result.task_ids),
            revisits=sum(map(bool, result.revisit)),
            group_size=self._group_size,
        )

    def on_trainer_report(self, rank: int, report: dict[str, float]) -> None:
        self.metrics.on_trainer_report(
            step=int(report["step"]),
            rank=rank,
            loss=report["loss"],
            ratio_outlier_share=report["ratio_outlier_share"],
            tokens_per_second=report["tokens_per_second"],
            step_seconds=report.get("step_seconds"),
        )


def scheduler_refresh(
    metrics: SidecarMetrics, actor: Any, *, timeout_s: float = REFRESH_TIMEOUT_SECONDS
) -> Callable[[], None]:
    """The `set_refresh` callable of a Ray-hosted scheduler: one round trip for its status
    and every task's pass-rate estimate, fed to `metrics.on_status`."""
    import ray

    def refresh() -> None:
        status, pass_rates = ray.get(
            [actor.status.remote(), actor.pass_rate_estimates.remote()], timeout=timeout_s
        )
        metrics.on_status(status, pass_rates=pass_rates)

    return refresh


class SidecarExporter:
    """The metrics of one sidecar: `events` for `start_server`, then `start(actor)` serves
    them over HTTP until `stop()`. `start(None)` binds the endpoint before there is an
    actor (a taken port fails before anything else starts); `attach(actor)` then adds the
    scheduler's levels."""

    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.metrics = SidecarMetrics(MetricsConfig.from_sidecar_config(config))
        self.events = MetricsEvents(self.metrics, config)
        self.http: MetricsServer | None = None

    def start(self, actor: Any | None, *, port: int | None = None) -> MetricsServer:
        """Refresh levels from `actor` (if given) before scrapes and serve on `[server]
        metrics_host` at `port` (default `[server] metrics_port`; 0 picks a free port).
        OSError naming the address when it cannot be served (e.g. the port is taken)."""
        if self.http is not None:
            raise RuntimeError("SidecarExporter already started")
        if actor is not None:
            self.attach(actor)
        host = self.config.server.metrics_host
        port = self.config.server.metrics_port if port is None else port
        try:
            self.http = MetricsServer(self.metrics, host=host, port=port).start()
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
        return self.http

    def attach(self, actor: Any) -> None:
        """Refresh the scheduler's levels from `actor` before each scrape from now on."""
        self.metrics.set_refresh(scheduler_refresh(self.metrics, actor))

    @property
    def url(self) -> str:
        """http://HOST:PORT of the running endpoint."""
        if self.http is None:
            raise RuntimeError("SidecarExporter not started")
        return self.http.url

    def stop(self) -> None:
        """Stop serving and stop pulling from the actor; safe to call twice."""
        self.metrics.set_refresh(None)
        http, self.http = self.http, None
        if http is not None:
            http.stop()
