"""Metric names as each experiment tracker takes them.

The trainer's names are verl's (`actor/pg_loss`, `val-core/openai/gsm8k/reward/mean@4`) and
stay so in metrics.jsonl, on the console and in TensorBoard, which take any name. The remote
trackers do not all take them, and the rules are the ones their installed libraries apply:

- MLflow (`mlflow.utils.validation`) refuses a name with any character but letters, digits,
  `_ - . / : ` and space, a name that is not its own normalised path (`a//b`, `a/./b`,
  `a/`, `/a`, `..a`) and one over 250 characters; one refused name fails the whole step.
  `@` becomes `_at_` (as verl writes it: `mean_at_4`), any other refused character `_`,
  empty, `.` and `..` path parts are dropped or made `_`, a long name is cut with a hash of
  the whole name at its end (so two long names stay apart).
- SwanLab (`swanlab.sdk.internal.run.fmt`) drops a name with a control character (with an
  error on its console) and trims leading and trailing `.`, `/` and blanks and cuts a name
  at 512 characters (with a warning); here control characters become `_` and the same trim
  and cut happen quietly.
- W&B refuses no string name (its UI sorts and filters only by names of letters, digits
  and `_`, but sections come from the `/` in a name, as verl logs them): names are kept.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

MLFLOW_MAX_LENGTH = 250  # mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH
SWANLAB_MAX_LENGTH = 512  # swanlab's METRIC_KEY_MAX_LENGTH
MLFLOW_REFUSED = re.compile(r"[^\w./\- :]")  # its characters: word characters and `./- :`
SWANLAB_REFUSED = re.compile(r"[\x00-\x1f\x7f]")  # control characters
SWANLAB_EDGES = " \t\n\r./"


def _cut(name: str, limit: int, original: str) -> str:
    """`name` if short enough, else its start and 8 hex digits of `original`'s hash."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha1(original.encode()).hexdigest()[:8]
    return f"{name[: limit - 9]}_{digest}"


def mlflow_name(name: str) -> str:
    """`name` as MLflow takes it (see the module)."""
    text = MLFLOW_REFUSED.sub("_", name.replace("@", "_at_"))
    parts = [part if part not in (".", "..") else "_" * len(part) for part in text.split("/")]
    text = "/".join(part for part in parts if part)  # no empty parts: no leading/trailing `/`
    if text.startswith(".."):  # a path that would climb out of the run
        text = "__" + text[2:]
    return _cut(text or "_", MLFLOW_MAX_LENGTH, name)


def swanlab_name(name: str) -> str:
    """`name` as SwanLab takes it (see the module)."""
    text = SWANLAB_REFUSED.sub("_", name).strip(SWANLAB_EDGES)
    return _cut(text or "_", SWANLAB_MAX_LENGTH, name)


def _same(name: str) -> str:
    return name


# tracker -> its name for a metric name
TRACKER_NAMES: dict[str, Callable[[str], str]] = {
    "mlflow": mlflow_name,
    "swanlab": swanlab_name,
    "wandb": _same,
}


class NameMap:
    """One tracker's names for the run's metrics, each worked out once; says once which
    names it changed, and warns when two names become one (the later value wins)."""

    def __init__(self, tracker: str):
        self.tracker = tracker
        self._rule = TRACKER_NAMES[tracker]
        self._names: dict[str, str] = {}
        self._owner: dict[str, str] = {}  # tracker name -> the first metric name given it

    def name(self, metric: str) -> str:
        """The tracker's name of `metric`."""
        if metric not in self._names:
            new = self._names[metric] = self._rule(metric)
            first = self._owner.setdefault(new, metric)
            if first != metric:
                log.warning(
                    "%s: metrics %r and %r are both logged as %r; the latter's value is kept",
                    self.tracker,
                    first,
                    metric,
                    new,
                )
            elif new != metric:
                log.info("%s: metric %r is logged as %r", self.tracker, metric, new)
        return self._names[metric]

    def rename(self, values: Mapping[str, float]) -> dict[str, float]:
        """`values` under the tracker's names."""
        return {self.name(key): value for key, value in values.items()}

    def named_in(self, text: str) -> str | None:
        """The metric whose name (ours or the tracker's) `text` names: quoted, or at the end
        of a quoted path; the longest such, None if none."""
        found = [
            metric
            for metric, new in self._names.items()
            for candidate in {metric, new}
            if re.search(rf"""["'/]{re.escape(candidate)}["']""", text)
        ]
        return max(found, key=len, default=None)
