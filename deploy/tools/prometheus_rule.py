"""Writes deploy/k8s/components/alerts/prometheusrule.yaml from deploy/prometheus/alerts.yml.

The plain rule file is the one source of the rules; the PrometheusRule wraps its groups for the
Prometheus Operator. Run after editing alerts.yml (tests/unit/deploy/test_alerts.py fails until you do):

    .venv/bin/python deploy/tools/prometheus_rule.py            # rewrite the PrometheusRule
    .venv/bin/python deploy/tools/prometheus_rule.py --check    # exit 1 if it is out of step
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
TARGET = ROOT / "deploy" / "k8s" / "components" / "alerts" / "prometheusrule.yaml"
HEADER = """\
# GENERATED from deploy/prometheus/alerts.yml by deploy/tools/prometheus_rule.py: edit that file
# (its comments explain every rule and default) and rerun the script. The component's
# kustomization.yaml sets the thresholds (settings.env) and swaps in the restart alert that reads
# kube-state-metrics.
"""


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # PromQL over several lines stays readable as a block.
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(rules_text: str) -> str:
    groups = yaml.safe_load(rules_text)["groups"]
    doc: dict[str, Any] = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "keyword-embedder",
            # Many Prometheus Operator installs select rules by a label such as `release: <name>`
            # (ruleSelector): add it here, or with a kustomize patch, if yours does.
            "labels": {"app.kubernetes.io/name": "keyword-embedder"},
        },
        "spec": {"groups": groups},
    }
    return HEADER + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the PrometheusRule is out of step")
    args = parser.parse_args(argv)
    wanted = render(RULES.read_text(encoding="utf-8"))
    if args.check:
        if not TARGET.is_file() or TARGET.read_text(encoding="utf-8") != wanted:
            print(f"{TARGET.relative_to(ROOT)} is out of step with {RULES.relative_to(ROOT)}: "
                  f"run {sys.executable} deploy/tools/prometheus_rule.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
