"""SGLang's HTTP routes other than the batched /generate (see `rlhf.rollout.client`).

One function per route, each a blocking call that raises `SGLangAPIError` naming the server
and the route (or returns False for health). Weight sync, the log-prob probe, the server
group and the preflight checks call these; nothing else builds SGLang requests. This module
sits below both `rlhf.rollout` (which owns the servers) and `rlhf.weight_sync` (which moves
weights into them).

Authentication: a server bound to a reachable address would let anyone load weights into
it (`update_weights_from_disk`, ...), so servers and the router are given SGLang's
`--api-key` whenever `RLHF_SGLANG_API_KEY` is set (inside their process, from the
environment: `rlhf.rollout.keyed_launch`; never on their command line), and every request
here and in `rlhf.rollout.client` sends it as `Authorization: Bearer <key>`. SGLang then
refuses every route but /health*, /ready* and /metrics* without it (401). A run that
launches its own servers sets a random key for itself when none is given (`ensure_api_key`).
"""

from __future__ import annotations

import base64
import os
import secrets
from typing import Any

import requests

from rlhf.errors import ExternalError

HEALTH_TIMEOUT_S = 5.0
ADMIN_TIMEOUT_S = 600.0  # weight loads of a large model take minutes
API_KEY_ENV = "RLHF_SGLANG_API_KEY"


def api_key() -> str | None:
    """The key this process's SGLang servers and router require (None: they take anyone)."""
    return os.environ.get(API_KEY_ENV) or None


def ensure_api_key() -> str:
    """The run's key; when none is set, a random one, kept in this process's environment so
    every client here (and every server launched from here) uses the same one."""
    key = api_key()
    if key is None:
        key = secrets.token_urlsafe(32)
        os.environ[API_KEY_ENV] = key
    return key


def auth_headers() -> dict[str, str]:
    """The header every request to SGLang carries (none without a key)."""
    key = api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


class SGLangAPIError(RuntimeError, ExternalError):
    """An SGLang route was unreachable or answered with a failure.

    `unreachable`: no answer came (connection refused or reset, timeout): the server may
    have died, so the caller may restart it and try again; an answer that reports a
    failure is not retried."""

    kind = "rollout failed"

    def __init__(self, message: str, url: str, unreachable: bool):
        super().__init__(message)
        self.url = url
        self.unreachable = unreachable


class ServerUnavailable(ConnectionError, ExternalError):
    """An SGLang server that did not start, or an external one that does not answer."""

    kind = "rollout failed"


class ServerLost(RuntimeError, ExternalError):
    """A server is gone for good: out of restarts, an external one (never restarted), or
    restarted without a way to give it the current weights."""

    kind = "rollout failed"


def _post(url: str, route: str, payload: dict | None = None, timeout_s: float = ADMIN_TIMEOUT_S):
    """POST `payload` to `url/route`; the JSON answer, or an error naming both."""
    try:
        response = requests.post(
            f"{url}/{route}", json=payload or {}, headers=auth_headers(), timeout=timeout_s
        )
    except requests.RequestException as e:
        raise SGLangAPIError(f"{url}/{route} unreachable: {e}", url, unreachable=True) from e
    body = _json(response)
    failed = isinstance(body, dict) and body.get("success") is False
    if response.status_code != 200 or failed:
        message = body.get("message", response.text) if isinstance(body, dict) else response.text
        raise _answered(url, route, response.status_code, message)
    return body


def _get(url: str, route: str, timeout_s: float = 30.0) -> Any:
    try:
        response = requests.get(f"{url}/{route}", headers=auth_headers(), timeout=timeout_s)
    except requests.RequestException as e:
        raise SGLangAPIError(f"{url}/{route} unreachable: {e}", url, unreachable=True) from e
    if response.status_code != 200:
        raise _answered(url, route, response.status_code, response.text)
    return _json(response)


def _json(response: requests.Response) -> Any:
    """The answer's JSON; its text when it is none (a proxy's error page)."""
    if not response.content:
        return {}
    try:
        return response.json()
    except ValueError:
        return response.text[:300]


def _answered(url: str, route: str, status: int, message: str) -> SGLangAPIError:
    hint = ""
    if status in (401, 403):
        hint = f" (the server wants an API key: set {API_KEY_ENV} to the key it was started with)"
    return SGLangAPIError(f"{url}/{route} answered {status}: {message}{hint}", url, False)


def healthy(url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """Whether GET `url`/health answers 200 (SGLang server or router)."""
    try:
        response = requests.get(f"{url}/health", headers=auth_headers(), timeout=timeout_s)
        return response.status_code == 200
    except requests.RequestException:
        return False


def generates(url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """Whether a one-token /generate at `url` answers: the scheduler serves. SGLang's
    /health sends the same token but looks for it only after sleeping 1 s, so a server that
    has just started answers it a second late."""
    try:
        generate(url, {"input_ids": [0], "sampling_params": {"max_new_tokens": 1}}, timeout_s)
        return True
    except SGLangAPIError:
        return False


def router_healthy_workers(router_url: str) -> set[str]:
    """URLs of the workers an sglang-router reports healthy (none if it does not answer)."""
    try:
        workers = _get(router_url, "workers", HEALTH_TIMEOUT_S).get("workers", [])
    except (SGLangAPIError, ValueError, AttributeError):
        return set()
    return {w.get("url") for w in workers if w.get("is_healthy")}


def server_info(url: str) -> dict[str, Any]:
    """The server's arguments as it runs with them (GET /get_server_info)."""
    return _get(url, "get_server_info")


def weight_version(url: str) -> str | None:
    """The weight version a server reports (`/model_info`)."""
    return _get(url, "model_info").get("weight_version")


def generate(url: str, request: dict, timeout_s: float = ADMIN_TIMEOUT_S) -> Any:
    """One blocking /generate (the probe and tests; rollouts use the async client)."""
    return _post(url, "generate", request, timeout_s)


def prompt_logprobs(
    url: str, tokens: list[int], images: tuple[bytes, ...] = (), lora: str | None = None
) -> list[float]:
    """log p(token_t | tokens_<t) for t >= 1, from one prefill on the server; with `images`
    (encoded files, one image token for each in `tokens`), of the tokens as the server
    expands them; `lora`: with the LoRA adapter of that name."""
    request: dict[str, Any] = {
        "input_ids": tokens,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if lora is not None:
        request["lora_path"] = lora
    if images:
        request["image_data"] = [base64.b64encode(image).decode() for image in images]
    meta = generate(url, request)["meta_info"]
    return [lp for lp, _token, *_ in meta["input_token_logprobs"]][1:]


def begin_weight_update(url: str) -> None:
    """Open a weight-update window (SGLang refuses tensor/distributed updates outside one)."""
    _post(url, "begin_weight_update")


def end_weight_update(url: str) -> None:
    _post(url, "end_weight_update")


def pause_generation(url: str) -> None:
    """Stop generating (SGLang's abort mode): every /generate in flight is answered with the
    tokens it has, finish reason `abort`, before this returns; requests arriving meanwhile
    wait for `continue_generation`. Weight updates are accepted while paused."""
    _post(url, "pause_generation", {"mode": "abort"})


def abort_all_requests(url: str) -> None:
    """Answer every /generate in flight now with the tokens it has (finish reason `abort`);
    new requests are served as usual (`rlhf.rollout.partial.GenerationGate` holds ours)."""
    _post(url, "abort_request", {"abort_all": True})


def continue_generation(url: str) -> None:
    """Resume after `pause_generation` (no CUDA cache emptying: the CPU server has none)."""
    _post(url, "continue_generation", {"torch_empty_cache": False})


def update_weight_version(url: str, version: str) -> None:
    """Label the weights the server holds `version` from now on (requests in flight go on;
    their later tokens carry it in meta_info.weight_versions)."""
    _post(url, "update_weight_version", {"new_version": version, "abort_all_requests": False})


def _version_fields(flush_cache: bool, version: int | None) -> dict[str, Any]:
    return {"flush_cache": flush_cache, "weight_version": None if version is None else str(version)}


def update_weights_from_tensor(
    url: str, serialized: list[str], flush_cache: bool, version: int | None
) -> None:
    """Load one flattened bucket, serialized once per server TP rank (shared memory / IPC)."""
    request = {
        "serialized_named_tensors": serialized,
        "load_format": "flattened_bucket",
        **_version_fields(flush_cache, version),
    }
    _post(url, "update_weights_from_tensor", request)


def init_weights_update_group(url: str, request: dict[str, Any]) -> None:
    """Join the process group the trainer's sender opens (`master_address`, `master_port`,
    `rank_offset`, `world_size`, `group_name`, `backend`)."""
    _post(url, "init_weights_update_group", request)


def update_weights_from_distributed(
    url: str,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    group_name: str,
    flush_cache: bool,
    version: int | None,
) -> None:
    """Receive one flattened bucket by broadcast in `group_name` (called while it is sent)."""
    request = {
        "names": names,
        "dtypes": dtypes,
        "shapes": shapes,
        "group_name": group_name,
        "load_format": "flattened_bucket",
        **_version_fields(flush_cache, version),
    }
    _post(url, "update_weights_from_distributed", request)


def destroy_weights_update_group(url: str, group_name: str) -> None:
    _post(url, "destroy_weights_update_group", {"group_name": group_name})


def update_weights_from_disk(url: str, model_path: str, version: int) -> None:
    """Load an HF checkpoint directory the server can read."""
    request = {"model_path": model_path, **_version_fields(True, version)}
    _post(url, "update_weights_from_disk", request)


def load_lora_adapter_from_tensors(
    url: str, name: str, config: dict[str, Any], serialized: list[str]
) -> None:
    """Load a LoRA adapter as `name` from one flattened bucket of its PEFT-named tensors,
    serialized once per server TP rank; `config`: its PEFT adapter_config."""
    request = {
        "lora_name": name,
        "config_dict": config,
        "serialized_named_tensors": serialized,
        "load_format": "flattened_bucket",
    }
    _post(url, "load_lora_adapter_from_tensors", request)


def load_lora_adapter(url: str, name: str, path: str) -> None:
    """Load the PEFT adapter directory `path` (which the server can read) as `name`."""
    _post(url, "load_lora_adapter", {"lora_name": name, "lora_path": path})


def unload_lora_adapter(url: str, name: str) -> None:
    _post(url, "unload_lora_adapter", {"lora_name": name})


def release_memory_occupation(url: str, tags: list[str]) -> None:
    """GPU, a server started with --enable-memory-saver: free `tags` ("weights", "kv_cache")."""
    _post(url, "release_memory_occupation", {"tags": tags})


def resume_memory_occupation(url: str, tags: list[str]) -> None:
    """Allocate `tags` again (weights come back as they were; sync new ones afterwards)."""
    _post(url, "resume_memory_occupation", {"tags": tags})
