"""A step's sampling staging: the EOS and stop tokens banned for rows short of min_tokens."""

from __future__ import annotations

from typing import Any

import torch

from inlinelm.gpu.sampling.step_sampling import stage_early_stops
from inlinelm.gpu.staging import HostStaging
from inlinelm.sampling_params import SamplingParams
from inlinelm.sched.request import Request

EOS = 2


def _request(request_id: str, output: list[int], **params: Any) -> Request:
    request = Request(request_id, [10, 11], SamplingParams(**params), EOS)
    request.output_token_ids.extend(output)
    return request


def test_rows_short_of_min_tokens_ban_eos_and_their_stop_tokens() -> None:
    requests = [
        _request("short", [5], min_tokens=4, stop_token_ids=[7]),
        _request("plain", [], max_tokens=3),
        _request("reached", [5, 5, 5, 5], min_tokens=4),  # this step's sample is its 5th
        _request("no-eos", [], min_tokens=2, ignore_eos=True, stop_token_ids=[8]),
    ]
    for request in requests:
        request.num_pending_samples = 1  # this step's own sample
    staging = HostStaging(torch.device("cpu"))
    banned = stage_early_stops(requests, [0, 2, 3], staging)
    staging.send()
    assert banned is not None
    rows, tokens = banned
    assert list(zip(rows.get().tolist(), tokens.get().tolist(), strict=True)) == [
        (0, 7),
        (0, EOS),
        (3, 8),
    ]


def test_samples_in_flight_count_towards_min_tokens() -> None:
    request = _request("r", [5, 5], min_tokens=3)
    request.num_pending_samples = 2  # one in flight (the 3rd), then this step's (the 4th)
    assert stage_early_stops([request], [0], HostStaging(torch.device("cpu"))) is None
    request.num_pending_samples = 1
    assert stage_early_stops([request], [0], HostStaging(torch.device("cpu"))) is not None
