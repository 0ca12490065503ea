"""Offline checks of csi/deploy/monitoring: the PodMonitor, the alerts and the dashboard.

Their mistakes are silent: a PodMonitor that selects no pod, or scrapes the wrong port,
leaves Prometheus without a single tierfs series and no error anywhere; a metric name
misspelt in an alert makes an alert that never fires; a panel on a series that does not
exist stays empty. So this module checks, without a cluster or the network:

- the manifests against their schemas, strictly: the generated dashboard ConfigMap with
  kubernetes-validate, the PodMonitor (and the PrometheusRule docs/monitoring.md makes of
  alerts.yaml) against the Prometheus Operator's CRD schemas, vendored in schemas/;
- the PodMonitor against the DaemonSet: it selects the plugin's pods, and its relabelings
  turn their targets into the address the plugin's --metrics listens on;
- the alerts with promtool (`check rules`, then the unit tests of alerts_test.yaml);
- every expression of the alerts and the dashboard against the metric catalogue below;
- the folder against its kustomization, and docs/monitoring.md against all of it.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "csi" / "deploy"
MONITORING = DEPLOY / "monitoring"
SCHEMAS = Path(__file__).parent / "schemas"
DOCS = ROOT / "docs" / "monitoring.md"
NAMESPACE = "tierfs-system"
MIN_KUBERNETES = "1.25"  # as test_manifests.py: the oldest release tierfs supports
DASHBOARD = MONITORING / "tierfs-dashboard.json"
# Files of the folder that kustomize does not install: Prometheus and promtool read them.
NOT_APPLIED = {"alerts.yaml", "alerts_test.yaml"}
# The `job` the PodMonitor gives the plugin's own series and its `up`.
PLUGIN_JOB = "tierfs-csi"
# The largest object `kubectl apply` (client side) can record in its last-applied annotation.
ANNOTATION_LIMIT = 256 * 1024

# The metric catalogue (docs/monitoring.md explains each).
COUNTERS = {
    "tierfs_steps_committed",
    "tierfs_tier_sent_bytes",
    "tierfs_tier_dedup_bytes",
    "tierfs_tier_steps",
    "tierfs_tier_errors",
    "tierfs_tier_received_bytes",
    "tierfs_restores",
    "tierfs_failures",
    "tierfs_fuse_read_bytes",
    "tierfs_fuse_written_bytes",
    "tierfs_plugin_volume_calls",
    "tierfs_plugin_events",
}
HISTOGRAMS = {
    "tierfs_step_copy_duration_seconds",
    "tierfs_restore_duration_seconds",
    "tierfs_fuse_request_duration_seconds",
}
GAUGES = {
    "tierfs_newest_step",
    "tierfs_newest_step_timestamp_seconds",
    "tierfs_lag_seconds",
    "tierfs_ram_used_bytes",
    "tierfs_ram_capacity_bytes",
    "tierfs_peers",
    "tierfs_erasure_survivable_losses",
    "tierfs_erasure_parity_bytes",
    "tierfs_erasure_members_answering",
    "tierfs_erasure_grouped",
    "tierfs_restore_missing_bytes",
    "tierfs_info",
    "tierfs_start_time_seconds",
    "tierfs_checkpoint_interval_seconds",
    "tierfs_checkpoint_cost_seconds",
    "tierfs_checkpoint_overhead_ratio",
    "tierfs_work_at_risk_seconds",
    "tierfs_expected_loss_per_failure_seconds",
    "tierfs_mtbf_seconds",
    "tierfs_optimal_checkpoint_interval_seconds",
    "tierfs_goodput_ratio",
    "tierfs_plugin_info",
    "tierfs_plugin_volumes",
    "tierfs_plugin_daemons",
    "tierfs_plugin_job_pods",
}
CATALOGUE = COUNTERS | HISTOGRAMS | GAUGES
SERIES = (
    {f"{c}_total" for c in COUNTERS}
    | GAUGES
    | {f"{h}_{suffix}" for h in HISTOGRAMS for suffix in ("bucket", "count", "sum")}
)
# Label values the catalogue defines; a typo in a matcher selects nothing, silently.
LABEL_VALUES = {
    "tier": {"ram", "peers", "gcs", "disk"},
    "source": {"local", "peers", "gcs", "disk"},
    "state": {"up", "down", "unknown", "serving", "sick"},  # tierfs_peers also says unknown
}
PROMQL_WORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "inf",
    "nan",
}


# -- loading ---------------------------------------------------------------------------


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


# test_manifests.py has helpers like these; importing that module would tie this one's
# collection to every manifest it reads, so the few needed here are kept small and local.


def daemonset() -> dict:
    return load_yaml(DEPLOY / "daemonset.yaml")


def plugin() -> dict:
    (c,) = [c for c in daemonset()["spec"]["template"]["spec"]["containers"] if c["name"] == "tierfs"]
    return c


def flags(args: list[str]) -> dict[str, str]:
    """``--name=value`` arguments as a mapping."""
    return dict(arg[2:].partition("=")[::2] for arg in args if arg.startswith("--"))


def kubernetes_versions() -> list[str]:
    """Every release kubernetes-validate has strict schemas for, from MIN_KUBERNETES on."""
    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    versions = {m.group(1) for p in schemas.iterdir() if (m := re.match(r"^v(\d+\.\d+)\.\d+-local-strict$", p.name))}
    chosen = sorted((v for v in versions if Version(v) >= Version(MIN_KUBERNETES)), key=Version)
    assert chosen and chosen[0] == MIN_KUBERNETES
    return chosen


def kustomization() -> dict:
    return load_yaml(MONITORING / "kustomization.yaml")


def podmonitor() -> dict:
    return load_yaml(MONITORING / "podmonitor.yaml")


def alert_rules() -> list[dict]:
    return [rule for group in load_yaml(MONITORING / "alerts.yaml")["groups"] for rule in group["rules"]]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels() -> list[dict]:
    def walk(panels):
        for p in panels:
            yield p
            yield from walk(p.get("panels", []))  # a collapsed row holds its panels

    return list(walk(dashboard()["panels"]))


def dashboard_exprs() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    exprs = [(f"panel {p['title']!r}", t["expr"]) for p in dashboard_panels() for t in p.get("targets", [])]
    for v in dashboard()["templating"]["list"]:
        if v["type"] == "query":  # label_values(SERIES, LABEL): SERIES is the PromQL
            exprs.append((f"variable {v['name']}", re.fullmatch(r"label_values\((.*), *\w+\)", v["query"]).group(1)))
    return exprs


def generated_configmaps() -> list[dict]:
    """The ConfigMaps kustomize makes of configMapGenerator, as it makes them."""
    made = []
    for gen in kustomization().get("configMapGenerator", []):
        options = gen.get("options", {})
        assert options.get("disableNameSuffixHash") is True, f"{gen['name']}: its name is meant to be fixed"
        data = {}
        for entry in gen["files"]:
            key, _, name = entry.rpartition("=")
            data[key or Path(name).name] = (MONITORING / name).read_text()
        metadata = {"name": gen["name"], "namespace": gen["namespace"], "labels": options.get("labels", {})}
        made.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
    return made


def metric_names(expr: str) -> set[str]:
    """Names of the series a PromQL expression selects (not functions, keywords or labels)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals ($job, regexes)
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range and subquery windows
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.$])([A-Za-z_:][\w:]*)(\s*\()?", s):
        if not m.group(2) and m.group(1).lower() not in PROMQL_WORDS:
            names.add(m.group(1))
    return names


def matchers(expr: str) -> list[tuple[str, str, str]]:
    """(label, operator, value) of every label matcher in the expression."""
    return [
        m.groups()
        for block in re.findall(r"\{([^}]*)\}", expr)
        for m in re.finditer(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', block)
    ]


# -- the folder and its kustomization --------------------------------------------------


def test_kustomization_lists_every_file():
    k = kustomization()
    assert (k["apiVersion"], k["kind"]) == ("kustomize.config.k8s.io/v1beta1", "Kustomization")
    assert set(k) <= {"apiVersion", "kind", "resources", "configMapGenerator"}
    installed = list(k.get("resources", []))
    installed += [entry.rpartition("=")[2] for gen in k.get("configMapGenerator", []) for entry in gen["files"]]
    assert len(set(installed)) == len(installed), "a file listed twice"
    files = {p.name for p in MONITORING.iterdir() if p.is_file()} - {"kustomization.yaml"}
    assert set(installed) | NOT_APPLIED == files
    assert not set(installed) & NOT_APPLIED
    # The plugin installs on clusters without the Prometheus Operator's CRDs.
    parent = load_yaml(DEPLOY / "kustomization.yaml")
    assert not any("monitoring" in r for r in parent["resources"])


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed (it builds kustomizations)")
def test_kustomize_builds_what_this_module_checks():
    out = subprocess.run(["kubectl", "kustomize", str(MONITORING)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    built = sorted((d for d in yaml.safe_load_all(out.stdout) if d), key=lambda d: d["kind"])
    assert built == sorted([*generated_configmaps(), podmonitor()], key=lambda d: d["kind"])


# -- schemas ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", kubernetes_versions())
def test_generated_configmaps_validate_strictly(version):
    configmaps = generated_configmaps()
    assert configmaps
    for cm in configmaps:
        kubernetes_validate.validate(cm, version, strict=True)


def test_dashboard_configmap_is_found_by_grafana_and_fits_kubectl_apply():
    (cm,) = [cm for cm in generated_configmaps() if DASHBOARD.name in cm["data"]]
    # Grafana's dashboard sidecar (kube-prometheus-stack, the grafana chart) looks for this label.
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == NAMESPACE == daemonset()["metadata"]["namespace"]
    assert len(json.dumps(cm).encode()) < ANNOTATION_LIMIT


def strict(schema: dict) -> dict:
    """The CRD schema with unknown fields refused, as `kubectl apply --validate=strict` does."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@cache
def crd_validator(plural: str) -> jsonschema.Draft7Validator:
    schema = strict(load_yaml(SCHEMAS / f"monitoring.coreos.com_{plural}.v1.yaml"))
    # A well-formed schema; its patterns are not checked as Python regexes: they are Go's
    # (one puts `(?i)` after `^`, which Python refuses and Go accepts).
    jsonschema.Draft7Validator(jsonschema.Draft7Validator.META_SCHEMA).validate(schema)
    return jsonschema.Draft7Validator(schema)


def check_custom_resource(doc: dict, kind: str, plural: str) -> None:
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", kind)
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in crd_validator(plural).iter_errors(doc)]
    assert not errors, errors
    # The CRD leaves metadata to the API server: check what the API server would.
    metadata = doc["metadata"]
    assert set(metadata) <= {"name", "namespace", "labels", "annotations"}
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", metadata["name"])
    for key, value in {**metadata.get("labels", {}), **metadata.get("annotations", {})}.items():
        assert isinstance(key, str) and isinstance(value, str), (key, value)


def test_podmonitor_validates_against_its_crd():
    check_custom_resource(podmonitor(), "PodMonitor", "podmonitors")


def test_crd_validation_rejects_unknown_fields():
    """The check above is only worth something if a misspelt field fails it."""
    pm = podmonitor()
    pm["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    with pytest.raises(AssertionError, match="intervall"):
        check_custom_resource(pm, "PodMonitor", "podmonitors")
    pm = podmonitor()
    pm["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["action"] = "kept"
    with pytest.raises(AssertionError, match="kept"):
        check_custom_resource(pm, "PodMonitor", "podmonitors")


# The wrapping docs/monitoring.md gives Prometheus Operator users: alerts.yaml under a header.
PROMETHEUS_RULE_WRAP = (
    "{ printf 'apiVersion: monitoring.coreos.com/v1\\nkind: PrometheusRule\\nmetadata:\\n"
    "  name: tierfs\\n  namespace: tierfs-system\\nspec:\\n'\n"
    "  sed 's/^/  /' csi/deploy/monitoring/alerts.yaml; }"
)


@pytest.mark.skipif(not (shutil.which("bash") and shutil.which("sed")), reason="bash or sed is not installed")
def test_alerts_wrapped_as_a_prometheusrule_validate_against_its_crd():
    assert PROMETHEUS_RULE_WRAP in DOCS.read_text(), "docs/monitoring.md no longer wraps alerts.yaml this way"
    out = subprocess.run(
        ["bash", "-c", PROMETHEUS_RULE_WRAP], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
    ).stdout
    rule = yaml.safe_load(out)
    assert rule["spec"] == load_yaml(MONITORING / "alerts.yaml")  # the same rules, nothing added or lost
    assert rule["metadata"]["namespace"] == NAMESPACE
    check_custom_resource(rule, "PrometheusRule", "prometheusrules")


# -- the PodMonitor and the plugin -----------------------------------------------------


def relabel(labels: dict[str, str], configs: list[dict]) -> dict[str, str] | None:
    """Prometheus's relabeling of a target (the actions the PodMonitor uses); None: dropped."""
    labels = dict(labels)
    for c in configs:
        action = c.get("action", "replace").lower()
        value = c.get("separator", ";").join(labels.get(name, "") for name in c.get("sourceLabels", []))
        match = re.fullmatch(c.get("regex", "(.*)"), value)
        if action == "keep" and not match or action == "drop" and match:
            return None
        if action == "replace":
            if match:
                replacement = re.sub(r"\$\{?(\w+)\}?", r"\\g<\1>", c.get("replacement", "$1"))
                labels[c["targetLabel"]] = match.expand(replacement)
        elif action not in ("keep", "drop"):
            raise AssertionError(f"relabel action {action!r} is not simulated here")
    return labels


def test_podmonitor_selects_the_plugin_pods():
    pm, ds = podmonitor(), daemonset()
    assert pm["metadata"]["namespace"] == ds["metadata"]["namespace"]
    assert "namespaceSelector" not in pm["spec"]  # its own namespace: the plugin's
    selector = pm["spec"]["selector"]
    assert set(selector) == {"matchLabels"}
    assert selector["matchLabels"] == ds["spec"]["selector"]["matchLabels"]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert selector["matchLabels"].items() <= pod_labels.items()


def test_podmonitor_scrapes_the_plugins_metrics_address():
    (endpoint,) = podmonitor()["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"
    # The daemons' own `job` label must survive the target's.
    assert endpoint["honorLabels"] is True
    spec = daemonset()["spec"]["template"]["spec"]
    listen = flags(plugin()["args"])["metrics"]
    host, _, port = listen.rpartition(":")
    assert host == "0.0.0.0", "the pod IP (the node's) must reach it"
    # On the host network a declared port is a hostPort, which stalls a surge rollout; so
    # the PodMonitor names no port and builds the address itself.
    assert spec["hostNetwork"] is True
    assert not any(c.get("ports") for c in spec["containers"])
    assert not {"port", "portNumber", "targetPort"} & set(endpoint)
    relabelings = endpoint["relabelings"]
    # What Prometheus's pod discovery gives for a container without ports, after the
    # operator's own relabelings.
    for container in spec["containers"]:
        for pod_ip, address in (("10.1.2.3", f"10.1.2.3:{port}"), ("fd00::7", f"[fd00::7]:{port}")):
            target = relabel(
                {
                    "__address__": pod_ip,
                    "__meta_kubernetes_pod_ip": pod_ip,
                    "__meta_kubernetes_pod_container_name": container["name"],
                    "__meta_kubernetes_pod_node_name": "node-a",
                    "job": "tierfs-system/tierfs-csi-node",
                },
                relabelings,
            )
            if container["name"] == plugin()["name"]:
                assert target is not None, "the plugin's container is dropped"
                assert target["__address__"] == address
                assert target["job"] == PLUGIN_JOB and target["node"] == "node-a"
            else:
                assert target is None, f"{container['name']} is scraped too"


def test_the_plugin_down_alert_watches_the_podmonitors_job():
    ups = [rule for rule in alert_rules() if "up" in metric_names(rule["expr"])]
    assert ups and all(("job", "=", PLUGIN_JOB) in matchers(rule["expr"]) for rule in ups)


# -- alerts ----------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Prometheus) is not installed")
def test_promtool_accepts_the_rules():
    out = subprocess.run(
        ["promtool", "check", "rules", "alerts.yaml"], cwd=MONITORING, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Prometheus) is not installed")
def test_promtool_unit_tests_pass():
    out = subprocess.run(
        ["promtool", "test", "rules", "alerts_test.yaml"], cwd=MONITORING, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_says_how_bad_for_how_long_and_where():
    rules = alert_rules()
    names = [rule["alert"] for rule in rules]
    assert len(set(names)) == len(names) and all(name.startswith("Tierfs") for name in names)
    for rule in rules:
        name = rule["alert"]
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, name
        assert re.fullmatch(r"\d+[mh]", rule["for"]), f"{name}: for: {rule['for']}"
        assert rule["labels"] == {"severity": rule["labels"]["severity"]}, name
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert set(rule["annotations"]) == {"summary", "description"}, name
        text = " ".join(rule["annotations"].values())
        plugin_level = metric_names(rule["expr"]) <= {"up"} | {m for m in GAUGES if m.startswith("tierfs_plugin_")}
        wanted = ("$labels.node", "$labels.instance") if plugin_level else ("$labels.job", "$labels.rank")
        for label in wanted:
            assert label in text, f"{name}: its annotations do not say {label}"


def test_every_alert_is_tested_firing_and_silent():
    tests = load_yaml(MONITORING / "alerts_test.yaml")
    assert tests["rule_files"] == ["alerts.yaml"]
    firing, silent = set(), set()
    for case in tests["tests"]:
        for check in case["alert_rule_test"]:
            (firing if check["exp_alerts"] else silent).add(check["alertname"])
    names = {rule["alert"] for rule in alert_rules()}
    assert firing == names, f"never shown firing: {names - firing}"
    assert silent == names, f"never shown silent: {names - silent}"


# -- expressions and the catalogue -----------------------------------------------------


def test_metric_names_reads_promql():
    assert metric_names('sum by (job) (rate(a_total{x="y"}[5m])) > on (i) group_left b unless c') == {
        "a_total",
        "b",
        "c",
    }
    assert metric_names(
        'histogram_quantile(0.99, sum by (le) (increase(h_bucket{job=~"$job"}[$__rate_interval])))'
    ) == {"h_bucket"}
    assert metric_names('time() - t{tier="ram"} > 3600 and ignoring (tier) u offset 5m') == {"t", "u"}


def all_exprs() -> list[tuple[str, str]]:
    return dashboard_exprs() + [(f"alert {rule['alert']}", rule["expr"]) for rule in alert_rules()]


@pytest.mark.parametrize("where,expr", all_exprs(), ids=[where for where, _ in all_exprs()])
def test_expressions_name_only_catalogue_series(where, expr):
    names = metric_names(expr)
    assert names, f"{where}: no series in {expr!r}"
    unknown = names - SERIES - {"up"}
    assert not unknown, f"{where}: {sorted(unknown)} are not in the metric catalogue"
    for label, op, value in matchers(expr):
        if label in LABEL_VALUES and op == "=":
            assert value in LABEL_VALUES[label], f"{where}: {label}={value!r} is never exported"


def test_every_catalogue_metric_is_watched():
    """Each metric appears on the dashboard or in an alert: an operator sees it somewhere."""
    used = {re.sub(r"_(total|bucket|count|sum)$", "", name) for _, expr in all_exprs() for name in metric_names(expr)}
    assert CATALOGUE <= used, f"shown nowhere: {sorted(CATALOGUE - used)}"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Prometheus) is not installed")
def test_dashboard_expressions_parse(tmp_path):
    """promtool parses each panel's PromQL, Grafana's variables given values."""
    values = {"$__rate_interval": "1m", "$__range": "6h", "$__interval": "15s", "$job": ".*", "$rank": ".*"}
    rules = []
    for n, (_, expr) in enumerate(dashboard_exprs()):
        for var, value in values.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"a Grafana variable this test does not know: {expr}"
        rules.append({"record": f"panel:expr_{n}", "expr": expr})
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# -- the dashboard ---------------------------------------------------------------------


def test_dashboard_is_well_formed():
    d = dashboard()
    assert d["uid"] == "tierfs" and d["schemaVersion"] >= 36
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["job"]["query"] == "label_values(tierfs_info, job)"
    assert variables["rank"]["query"] == 'label_values(tierfs_info{job=~"$job"}, rank)'
    for name in ("job", "rank"):
        # "All" as a regex of every value would be enormous with thousands of ranks.
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*", name
    panels = dashboard_panels()
    ids = [p["id"] for p in panels]
    assert len(set(ids)) == len(ids), "panel ids repeat"
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & area, f"{p['title']} overlaps another panel"
        cells |= area
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and p.get("description"), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"], p["title"]


def test_daemon_panels_follow_the_job_and_rank_variables():
    for p in dashboard_panels():
        for t in p.get("targets", []):
            for name, selector in re.findall(r"\b(tierfs_\w+)(\{[^}]*\})?", t["expr"]):
                if name.startswith("tierfs_plugin_"):
                    continue  # the plugin's series belong to no job
                assert 'job=~"$job"' in selector and 'rank=~"$rank"' in selector, f"{p['title']}: {name}"


# -- docs ------------------------------------------------------------------------------


def test_docs_explain_every_metric_and_alert():
    text = DOCS.read_text()
    for name in sorted(CATALOGUE):
        assert re.search(rf"`{name}(_total)?[`{{]", text), f"docs/monitoring.md does not explain {name}"
    for rule in alert_rules():
        assert f"### {rule['alert']}" in text, f"docs/monitoring.md has no section on {rule['alert']}"
    assert "## Goodput\n\nSee [goodput.md](goodput.md).\n" in text
