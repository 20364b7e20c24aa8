"""The Ray Serve deployment's pieces that need no cluster: resources, caps, health, load,
the autoscaling policy, the errors a client sees, and ``inlinelm serve --ray``."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from inlinelm.config import EngineConfig
from inlinelm.serve.ray import (
    EngineReplica,
    default_max_ongoing,
    engine_load_policy,
    replica_resources,
)
from inlinelm.serve.ray_ingress import replica_failure
from inlinelm.serve.ray_replica import replica_config
from tests.runtime.helpers import echo_engine
from tests.serve.cli_process import stop
from tests.serve.ray_import import RAY_MARKS, ray
from tests.test_cli import _wait_until_serving, serve_command

pytestmark = RAY_MARKS

CPU = EngineConfig(runner="echo")


def test_each_replica_asks_for_its_own_gpu_on_cuda_and_its_threads_on_a_cpu() -> None:
    assert replica_resources(EngineConfig(device="cuda:3")) == {"num_gpus": 1, "num_cpus": 1}
    assert replica_resources(CPU.with_options(num_threads=4)) == {"num_cpus": 4}
    assert replica_resources(CPU) == {"num_cpus": 1}


def test_a_replica_runs_its_gpu_as_device_0_and_its_cpu_threads_as_assigned() -> None:
    assert replica_config(EngineConfig(device="cuda:3"), None).device == "cuda"
    assert replica_config(CPU, 3).num_threads == 3
    assert replica_config(CPU.with_options(num_threads=2), 3).num_threads == 2
    assert replica_config(CPU, None).num_threads is None


def test_serves_cap_per_replica_is_the_engines_running_plus_queued_capacity() -> None:
    assert default_max_ongoing(CPU.with_options(max_num_seqs=8, max_queued_requests=4)) == 12
    assert default_max_ongoing(CPU.with_options(max_num_seqs=8)) == 16


class FakeConfig:
    def get_target_ongoing_requests(self) -> float:
        return 4.0


def context(metrics: dict[str, dict[str, float]] | None, current: int = 2) -> Any:
    from ray.serve.config import AutoscalingContext

    return AutoscalingContext(
        deployment_id=None,
        deployment_name="InlineLMReplica",
        app_name="llm",
        current_num_replicas=current,
        target_num_replicas=current,
        running_replicas=[],
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics=metrics,
        raw_metrics=None,
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=5,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=FakeConfig(),
    )


def test_the_autoscaling_policy_scales_on_the_engines_queued_and_running_requests() -> None:
    busy = {"running": {"a": 8.0, "b": 8.0}, "queued": {"a": 6.0, "b": 2.0}}
    assert engine_load_policy(context(busy))[0] == 5  # 24 / 4 = 6, capped at max 5
    calm = {"running": {"a": 5.0, "b": 0.0}, "queued": {"a": 0.0, "b": 0.0}}
    assert engine_load_policy(context(calm))[0] == 2
    idle = {"running": {"a": 0.0, "b": 0.0}, "queued": {"a": 0.0, "b": 0.0}}
    assert engine_load_policy(context(idle))[0] == 1  # the minimum
    assert engine_load_policy(context(None, current=3))[0] == 3  # nothing reported yet


def test_a_replicas_health_and_load_are_its_engines() -> None:
    async def main() -> None:
        replica = EngineReplica.__new__(EngineReplica)  # NOTE: no Serve context needed
        async with echo_engine(echo_step_s=0.01) as engine:
            replica.engine = engine
            replica.check_health()
            stream = engine.stream("busy", max_tokens=1000, ignore_eos=True)
            async for _ in stream:
                break
            assert replica.record_autoscaling_stats() == {"queued": 0, "running": 1}
            await stream.aclose()
        with pytest.raises(RuntimeError, match="the engine cannot serve: closed"):
            replica.check_health()

    asyncio.run(main())


def test_a_client_is_told_429_when_serve_is_full_and_503_when_its_replica_died() -> None:
    from ray.serve.exceptions import BackPressureError

    full = replica_failure(BackPressureError(num_queued_requests=4, max_queued_requests=4))
    assert (full.status, full.code, full.headers["Retry-After"]) == (429, "queue_full", "1")
    died = replica_failure(ray.exceptions.ActorDiedError())
    assert (died.status, died.code, died.headers["Retry-After"]) == (503, "replica_failed", "1")
    other = replica_failure(ValueError("boom"))
    assert (other.status, other.code) == (500, "replica_error")


def test_a_replica_class_of_ones_own_also_takes_http_for_serves_own_routing() -> None:
    from inlinelm.serve.ray import EngineServer, _http_server
    from tests.serve.faulty_replica import FaultyReplica

    assert _http_server(EngineReplica) is EngineServer
    server = _http_server(FaultyReplica)
    assert issubclass(server, FaultyReplica) and hasattr(server, "break_engine")
    assert hasattr(server, "__serve_build_asgi_app__")


@pytest.mark.timeout(600)
def test_inlinelm_serve_ray_streams_a_chat_from_two_replicas_and_stops_on_interrupt(
    tmp_path: Path,
) -> None:
    command, port = serve_command("--ray", "--replicas", "2", "--num-threads", "1")
    with (tmp_path / "serve.log").open("w") as log:
        process = subprocess.Popen(command, stderr=log, stdout=log, text=True, cwd=tmp_path)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_until_serving(url, process, timeout=180)
            body = {
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "max_tokens": 5,
            }
            with httpx.stream(
                "POST", f"{url}/v1/chat/completions", json=body, timeout=60
            ) as response:
                lines = [line for line in response.iter_lines() if line]
                replica = response.headers["x-inlinelm-replica"]
        finally:
            returncode, alive = stop(process, signal.SIGINT, set())
    log_text = (tmp_path / "serve.log").read_text()
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3
    assert replica
    assert returncode == 0, log_text[-3000:]
    assert alive == [], "Ray processes outlived inlinelm serve"
