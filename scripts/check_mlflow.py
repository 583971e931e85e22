#!/usr/bin/env python3
"""A run logged to a real MLflow server (train.report_to = ["mlflow"]), read back with MLflow's
own client, against the run's metrics.jsonl and resolved recipe.toml.

    pip install mlflow
    mlflow server --host 127.0.0.1 --port 5055 --backend-store-uri sqlite:///mlflow.db &
    MLFLOW_TRACKING_URI=http://127.0.0.1:5055 MLFLOW_EXPERIMENT_NAME=tiny \
        lora-train --recipe recipes/tiny-cpu.toml --set 'train.report_to=["mlflow"]'
    MLFLOW_TRACKING_URI=http://127.0.0.1:5055 python3 scripts/check_mlflow.py adapters/tiny-cpu

The run is the one <run>/runs/mlflow.json names. Each metric's history (MlflowClient.
get_metric_history; the newest value of each step, as a resumed run sends again the steps a
crashed session logged after its last checkpoint) must equal the metrics.jsonl values under the tags of
scripts/check_tensorboard.py (exact: MLflow keeps doubles), the params must be recipe.toml's
fields flattened to dotted keys (lists as JSON text), and the status FINISHED. Exits 1 on a
difference.
"""
import json
import sys
import tomllib
from pathlib import Path

from mlflow.tracking import MlflowClient

sys.path.insert(0, str(Path(__file__).parent))
from check_tensorboard import number, tag_of  # noqa: E402


def flatten(prefix, v, out):
    if isinstance(v, dict):
        for k, x in v.items():
            flatten(f"{prefix}.{k}" if prefix else k, x, out)
    elif isinstance(v, str):
        out[prefix] = v
    elif isinstance(v, bool):
        out[prefix] = "true" if v else "false"
    else:
        out[prefix] = json.dumps(v, separators=(",", ":"))


def main():
    run_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "adapters/tiny-cpu")
    kept = json.loads((run_dir / "runs" / "mlflow.json").read_text())
    client = MlflowClient(kept["tracking_uri"])
    run = client.get_run(kept["run_id"])
    want = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for k, v in row.items():
            if k == "step":
                continue
            items = [(f"{k}/{a}", number(b)) for a, b in v.items()] if isinstance(v, dict) else [(tag_of(k), number(v))]
            for tag, x in items:
                if x is not None:
                    want.setdefault(tag, []).append((row["step"], x))
    bad = 0
    for tag in sorted(set(want) | set(run.data.metrics)):
        # A session that crashed after its last checkpoint sent some steps that the resumed
        # session sends again: MLflow keeps both; the newest value of a step is the run's.
        newest = {}
        for m in sorted(client.get_metric_history(run.info.run_id, tag), key=lambda m: m.timestamp):
            newest[m.step] = m.value
        got = sorted(newest.items())
        same = got == sorted(want.get(tag, []))
        bad += not same
        print(f"{'ok  ' if same else 'DIFF'} {tag}: {len(got)} values on the server, {len(want.get(tag, []))} in metrics.jsonl")
    params = {}
    flatten("", tomllib.loads((run_dir / "recipe.toml").read_text()), params)
    # TOML floats such as 1e-8 print as JSON does ("1e-08"): compare numbers as numbers.
    def same_param(a, b):
        try:
            return float(a) == float(b)
        except ValueError:
            return a == b
    # A resumed run's recipe says train.resume = true; the params are the first session's.
    diff = [k for k in set(params) | set(run.data.params)
            if k != "train.resume" and not same_param(params.get(k, "?"), run.data.params.get(k, "!"))]
    for k in sorted(diff):
        print(f"DIFF param {k}: server {run.data.params.get(k)!r}, recipe {params.get(k)!r}")
    bad += len(diff)
    print(f"params: {len(run.data.params)} on the server, {len(params)} in recipe.toml")
    print(f"status {run.info.status}, experiment {run.info.experiment_id}, run name {run.info.run_name}")
    bad += run.info.status != "FINISHED"
    print("server run equals metrics.jsonl and recipe.toml" if not bad else f"{bad} difference(s)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
