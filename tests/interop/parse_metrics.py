"""Parses residentd's /metrics text with the reference Prometheus client's
OpenMetrics parser (it raises on anything malformed) and prints every
sample as one JSON object per line: name, labels, value.

Usage: parse_metrics.py < metrics.txt
"""

import json
import sys

from prometheus_client.openmetrics.parser import text_string_to_metric_families

for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        print(json.dumps({"family": family.name, "type": family.type, "name": s.name, "labels": s.labels, "value": s.value}))
