"""JSON POSTs to SGLang's admin routes, with errors that name the server and route."""

from __future__ import annotations

import requests


def post(url: str, route: str, payload: dict | None = None, timeout_s: float = 600.0):
    """POST `payload` to `url/route` and return the JSON answer; raise naming both on failure."""
    try:
        response = requests.post(f"{url}/{route}", json=payload or {}, timeout=timeout_s)
    except requests.RequestException as e:
        raise RuntimeError(f"{url}/{route} unreachable: {e}") from e
    body = response.json() if response.content else {}
    failed = isinstance(body, dict) and body.get("success") is False
    if response.status_code != 200 or failed:
        message = body.get("message", response.text) if isinstance(body, dict) else response.text
        raise RuntimeError(f"{url}/{route} answered {response.status_code}: {message}")
    return body


def get(url: str, route: str, timeout_s: float = 30.0) -> dict:
    try:
        response = requests.get(f"{url}/{route}", timeout=timeout_s)
        response.raise_for_status()
    except requests.RequestException as e:
        raise RuntimeError(f"{url}/{route} failed: {e}") from e
    return response.json()
