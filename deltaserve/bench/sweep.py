"""`deltaserve bench sweep`: `bench serve` at several concurrencies (or request rates), one JSON, one plot.

    deltaserve bench sweep --max-concurrency-list 1,4,16 --num-gpus 1 --random-input-len 1024 ...

Every `bench serve` flag is passed through unchanged to each point; only --max-concurrency (or
--request-rate) changes from point to point. The JSON holds the sweep parameters and every point's full
`bench serve` result; the PNG plots output throughput per GPU against median TPOT (left) and median TTFT
(right), one labelled marker per point: the usual throughput/latency Pareto picture, where a point up and
to the left is better.
"""

import argparse
import copy
import json
import math
import os
from datetime import datetime

from deltaserve.bench.errors import BenchInputError
from deltaserve.bench.serve import add_serve_args, run_serve

# How a point is labelled on the plot, by swept parameter: "c=4", "rate=2.0".
POINT_LABELS = {"max_concurrency": "c", "request_rate": "rate"}


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    """Every `bench serve` flag, plus the list to sweep over and where the sweep's JSON and PNG go."""
    add_serve_args(parser)
    sweep = parser.add_argument_group("sweep")
    values = sweep.add_mutually_exclusive_group()
    values.add_argument("--max-concurrency-list", default=None, metavar="N,N,...",
                        help="comma-separated --max-concurrency values, e.g. 1,4,16")
    values.add_argument("--request-rate-list", default=None, metavar="R,R,...",
                        help="comma-separated --request-rate values (req/s, or inf), e.g. 1,2,inf")
    sweep.add_argument("--num-gpus", type=int, default=1, help="GPUs the server uses; throughput is divided by it")
    sweep.add_argument("--sweep-output", default=None, metavar="PATH.json",
                       help="sweep JSON path; the plot goes next to it as .png "
                            "(default: <--result-dir or .>/sweep-<label>-<date>.json)")


def run_sweep(args: argparse.Namespace) -> dict:
    """Run `bench serve` once per sweep value; write the sweep JSON and PNG; return the JSON dict.

    Raises BenchInputError for a bad list, --num-gpus, a missing matplotlib, or any point's bad input.
    """
    parameter, values = parse_sweep_values(args)
    if args.num_gpus < 1:
        raise BenchInputError(f"--num-gpus must be >= 1, got {args.num_gpus}")
    if args.save_result and args.result_filename is not None:
        raise BenchInputError(
            f"--result-filename {args.result_filename!r} would be overwritten by every sweep point; "
            "drop it (each point gets vLLM's default name) or use --sweep-output for the sweep's JSON"
        )
    pyplot = import_pyplot()  # before the runs: a long sweep must not fail at the very end
    json_path = args.sweep_output or _default_output(args)

    results = []
    for value in values:
        print(f"=== sweep point {parameter} = {value} ===")
        point_args = copy.copy(args)  # run_serve fills derived fields; keep the original untouched
        setattr(point_args, parameter, value)
        results.append(run_serve(point_args))

    sweep = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "sweep_parameter": parameter,
        "sweep_values": [_json_number(v) for v in values],
        "num_gpus": args.num_gpus,
        "points": [summarize_point(parameter, value, result, args.num_gpus) for value, result in zip(values, results)],
        "results": results,
    }
    directory = os.path.dirname(json_path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(sweep, f, indent=1)
    png_path = os.path.splitext(json_path)[0] + ".png"
    plot_sweep(sweep["points"], parameter, args.num_gpus, png_path, pyplot)
    print(f"Sweep saved to {json_path} and {png_path}")
    return sweep


def parse_sweep_values(args: argparse.Namespace) -> tuple[str, list]:
    """("max_concurrency", [ints >= 1]) or ("request_rate", [floats > 0, inf allowed])."""
    if args.max_concurrency_list is not None:
        if args.max_concurrency is not None:
            raise BenchInputError(f"--max-concurrency {args.max_concurrency} conflicts with --max-concurrency-list "
                                  f"{args.max_concurrency_list!r}; give only the list")
        return "max_concurrency", [
            _parse_value(text, "--max-concurrency-list", int, lambda v: v >= 1, ">= 1")
            for text in _split(args.max_concurrency_list, "--max-concurrency-list")
        ]
    if args.request_rate_list is not None:
        return "request_rate", [
            _parse_value(text, "--request-rate-list", float, lambda v: v > 0, "> 0 (or inf)")
            for text in _split(args.request_rate_list, "--request-rate-list")
        ]
    raise BenchInputError("bench sweep needs --max-concurrency-list or --request-rate-list")


def summarize_point(parameter: str, value, result: dict, num_gpus: int) -> dict:
    """The numbers the plot uses, for reading the JSON at a glance."""
    return {
        parameter: _json_number(value),
        "completed": result["completed"],
        "failed": result["failed"],
        "output_throughput": result["output_throughput"],
        "output_throughput_per_gpu": result["output_throughput"] / num_gpus,
        "median_tpot_ms": result["median_tpot_ms"],
        "median_ttft_ms": result["median_ttft_ms"],
    }


def import_pyplot():
    """matplotlib.pyplot with the file-only Agg backend; BenchInputError with the fix if it is missing."""
    try:
        import matplotlib
    except ImportError:
        raise BenchInputError("bench sweep draws its plot with matplotlib, which is not installed: "
                              "pip install matplotlib") from None
    matplotlib.use("Agg")  # no display needed: the plot only goes to a file
    import matplotlib.pyplot as pyplot

    return pyplot


def plot_sweep(points: list[dict], parameter: str, num_gpus: int, path: str, pyplot) -> None:
    """Two panels, output tok/s per GPU against median TPOT and median TTFT, one labelled marker per point.

    Points without a finite latency (every request failed) are left out of the panels.
    """
    label_prefix = POINT_LABELS[parameter]
    figure, axes = pyplot.subplots(1, 2, figsize=(12, 5))
    for axis, key, title in ((axes[0], "median_tpot_ms", "TPOT"), (axes[1], "median_ttft_ms", "TTFT")):
        shown = [p for p in points if _finite(p[key]) and _finite(p["output_throughput_per_gpu"])]
        xs = [p[key] for p in shown]
        ys = [p["output_throughput_per_gpu"] for p in shown]
        axis.plot(xs, ys, marker="o")
        for point, x, y in zip(shown, xs, ys):
            axis.annotate(f"{label_prefix}={point[parameter]}", (x, y), textcoords="offset points", xytext=(5, 5))
        axis.set_xlabel(f"median {title} (ms)")
        axis.set_ylabel(f"output throughput per GPU (tok/s, {num_gpus} GPU{'s' if num_gpus > 1 else ''})")
        axis.set_title(f"throughput per GPU vs {title}")
        axis.grid(True, alpha=0.3)
        axis.margins(0.12)  # room for the labels of the outermost points
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def _split(text: str, flag: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise BenchInputError(f"{flag} {text!r} lists no value")
    return items


def _parse_value(text: str, flag: str, kind: type, is_valid, rule: str):
    try:
        value = kind(text)
    except ValueError:
        raise BenchInputError(f"{flag}: {text!r} is not a valid {kind.__name__}") from None
    if not is_valid(value):
        raise BenchInputError(f"{flag}: every value must be {rule}, got {text!r}")
    return value


def _json_number(value):
    """inf is not valid JSON: spell it "inf" as `bench serve` does for request_rate."""
    return "inf" if value == math.inf else value


def _finite(value) -> bool:
    return value is not None and math.isfinite(value)


def _default_output(args: argparse.Namespace) -> str:
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join(args.result_dir or ".", f"sweep-{args.label or args.backend}-{date}.json")
