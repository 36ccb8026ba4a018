"""Per-call cost of the Python tool's sandbox: seconds from `run(code)` to its result.

Three programs (an empty one, `print` of a sum, `import numpy` with numpy allowed) run
`--calls` times each, sequentially and `--concurrent` at a time, in the bubblewrap sandbox
and with `insecure_local` (a plain child process: the interpreter's own start-up cost).
Prints one JSON object: median and 90th-percentile seconds per call and calls per second.

    .venv/bin/python benchmarks/sandbox_call.py [--calls 30] [--concurrent 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from rlhf.tools.sandbox import PythonSandbox

SCHEMA = {"type": "function", "function": {"name": "python", "parameters": {}}}
PROGRAMS = {
    "empty": "",
    "print": "print(sum(range(1000)))",
    "numpy": "import numpy as np\nprint(np.arange(10).sum())",
}


async def timed(tool: PythonSandbox, code: str) -> float:
    start = time.perf_counter()
    result = await tool.run(code)
    assert result.error is None, result.text
    return time.perf_counter() - start


async def measure(tool: PythonSandbox, code: str, calls: int, concurrent: int) -> dict:
    sequential = [await timed(tool, code) for _ in range(calls)]
    start = time.perf_counter()
    limit = asyncio.Semaphore(concurrent)

    async def one() -> float:
        async with limit:
            return await timed(tool, code)

    await asyncio.gather(*(one() for _ in range(calls)))
    wall = time.perf_counter() - start
    return {
        "median_s": round(statistics.median(sequential), 4),
        "p90_s": round(statistics.quantiles(sequential, n=10)[-1], 4),
        f"calls_per_s_{concurrent}_concurrent": round(calls / wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--concurrent", type=int, default=8)
    args = parser.parse_args()
    report: dict[str, dict] = {}
    for mode, extra in (("sandbox", {}), ("insecure_local", {"insecure_local": True})):
        tool = PythonSandbox(SCHEMA, {"packages": ["numpy"], **extra})
        for name, code in PROGRAMS.items():
            report[f"{mode}/{name}"] = asyncio.run(measure(tool, code, args.calls, args.concurrent))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
