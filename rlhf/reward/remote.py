"""A remote reward endpoint (`reward.url`) for judges that run elsewhere.

Protocol: POST `url` with JSON `{"items": [{"data_source", "prompt", "response",
"ground_truth", "extra_info"}, ...]}`; the answer is `{"scores": [float, ...]}`, one per
item, in order. A connection error, timeout or 5xx is retried `retries` times with doubling
backoff; then, or on any other failure, a `RemoteRewardError` names the URL, the attempts
and the last problem.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import requests

from rlhf.errors import ExternalError


class RemoteRewardError(RuntimeError, ExternalError):
    """The reward endpoint could not score a batch."""

    kind = "reward failed"


@dataclass(frozen=True)
class RemoteReward:
    url: str
    timeout_s: float = 120.0
    retries: int = 3
    backoff_s: float = 1.0

    def __call__(self, items: list[dict[str, Any]]) -> list[float]:
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = requests.post(self.url, json={"items": items}, timeout=self.timeout_s)
            except requests.RequestException as e:
                problem = f"unreachable ({type(e).__name__}: {e})"
                continue
            if response.status_code >= 500:
                problem = f"answered {response.status_code}: {response.text[:200]}"
                continue
            return self._scores(response, len(items))
        raise RemoteRewardError(
            f"reward endpoint {self.url}: {problem} after {self.retries + 1} attempts"
        )

    def _scores(self, response: requests.Response, expected: int) -> list[float]:
        if response.status_code != 200:
            raise RemoteRewardError(
                f"reward endpoint {self.url} answered {response.status_code}: {response.text[:200]}"
            )
        try:
            scores = [float(s) for s in response.json()["scores"]]
        except (ValueError, KeyError, TypeError) as e:
            raise RemoteRewardError(
                f"reward endpoint {self.url}: expected {{'scores': [...]}}, got "
                f"{response.text[:200]!r} ({e})"
            ) from None
        if len(scores) != expected:
            raise RemoteRewardError(
                f"reward endpoint {self.url} returned {len(scores)} scores for {expected} items"
            )
        return scores
