"""Offline checks of the Kubernetes manifests in csi/deploy: schemas, and their agreement.

The manifests are how tierfs gets onto a cluster, and their mistakes surface late and far
from their cause: a misspelt field is rejected (or, in a lenient client, silently dropped)
only when someone applies it; a registration path that differs from the plugin's socket
leaves the driver unregistered with no error anywhere near the manifest; a volume
attribute the plugin does not know fails the mount of every pod of a job; peers named in
the wrong namespace make replication quietly never happen. None of that needs a cluster
to find, so this module finds it without one (and without the network):

- every document is validated strictly (unknown fields are errors) with
  kubernetes-validate against the API schemas of every Kubernetes release from the oldest
  we support to the newest it ships. The JobSet is a custom resource those schemas do not
  know: its Job templates are validated as batch/v1 Jobs and its own fields by hand;
- the documents are checked against each other and against tierfs itself: the socket
  kubelet is told about is the one the plugin listens on, the paths the plugin is given
  are mounted at the same place as on the host, volume attributes and defaults are
  `tierfs mount` options the plugin accepts and build a valid configuration, the example
  jobs' ranks, peers and coordinator name their own pods, only the privileged container
  propagates mounts to the host, and the kustomization installs every file.
"""

from __future__ import annotations

import base64
import copy
import re
import shlex
from functools import cache
from pathlib import Path, PurePosixPath

import kubernetes_validate
import pytest
import yaml
from packaging.version import Version

import tierfs
from tierfs.config import OPTIONS, Config
from tierfs.core.parse import parse_address, parse_size
from tierfs.csi import ceilings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "csi" / "deploy"
EXAMPLES = DEPLOY / "examples"

DRIVER = "csi.tierfs.dev"
NAMESPACE = "tierfs-system"
# CSI ephemeral inline volumes are GA from 1.25 (and the oldest schemas kubernetes-validate has).
MIN_KUBERNETES = "1.25"
# Options naming paths on the host: the plugin's to set, never a pod's (nor a default's).
HOST_PATH_OPTIONS = {"ramdisk", "log-file", "secret-file"}
# Options that describe one job or one node: meaningless as cluster-wide defaults.
PER_JOB_OPTIONS = {"job", "rank", "nodes", "peers", "listen", "coordinator", "data-parallel", "topology"}
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
# Fields of JobSet v1alpha2 (sigs.k8s.io/jobset api/jobset/v1alpha2/jobset_types.go).
JOBSET_SPEC_FIELDS = {
    "replicatedJobs",
    "network",
    "successPolicy",
    "failurePolicy",
    "startupPolicy",
    "suspend",
    "coordinator",
    "managedBy",
    "ttlSecondsAfterFinished",
    "volumeClaimPolicies",
}
JOBSET_NETWORK_FIELDS = {"enableDNSHostnames", "subdomain", "publishNotReadyAddresses"}
JOBSET_FAILURE_POLICY_FIELDS = {"maxRestarts", "restartStrategy", "rules"}
JOBSET_REPLICATED_JOB_FIELDS = {"name", "groupName", "template", "replicas", "dependsOn"}
# Kinds that have no schema in kubernetes-validate, each checked by its own test here.
NOT_KUBERNETES_API = {"Kustomization", "JobSet"}
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
ENV_REF = re.compile(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


# -- loading ---------------------------------------------------------------------------


def yaml_files() -> list[Path]:
    # monitoring/ needs the Prometheus Operator's CRDs and holds Prometheus rule files:
    # tests/csi/test_monitoring.py checks it.
    return sorted(
        p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml") and DEPLOY / "monitoring" not in p.parents
    )


@cache
def _load(path: Path) -> tuple:
    return tuple(doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None)


def documents(path: Path) -> list[dict]:
    return copy.deepcopy(list(_load(path)))


def all_documents() -> list[tuple[Path, int, dict]]:
    return [(path, i, doc) for path in yaml_files() for i, doc in enumerate(documents(path))]


def one(kind: str, where: Path = DEPLOY, name: str | None = None) -> dict:
    found = [
        doc
        for path, _, doc in all_documents()
        if doc.get("kind") == kind
        and (name is None or doc.get("metadata", {}).get("name") == name)
        and (path.parent == where)
    ]
    assert len(found) == 1, f"expected one {kind}{' ' + name if name else ''} in {where}, found {len(found)}"
    return found[0]


def daemonset() -> dict:
    return one("DaemonSet")


def container(pod_spec: dict, name: str) -> dict:
    found = [c for c in pod_spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"no single container {name!r}"
    return found[0]


def plugin() -> dict:
    return container(daemonset()["spec"]["template"]["spec"], "tierfs")


def flags(args: list[str]) -> dict[str, str]:
    """``--name=value`` and ``--name value`` arguments as a mapping; bare words are kept under ''."""
    out: dict[str, str] = {}
    it = iter(args)
    for arg in it:
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            assert name not in out, f"--{name} given twice"
            out[name] = value if eq else next(it)
        else:
            out.setdefault("", arg)
    return out


def volume(pod_spec: dict, name: str) -> dict:
    found = [v for v in pod_spec.get("volumes", []) if v["name"] == name]
    assert len(found) == 1, f"no single volume {name!r}"
    return found[0]


def unix_path(endpoint: str) -> str:
    assert endpoint.startswith("unix:///"), endpoint
    return endpoint[len("unix://") :]


def pod_specs() -> list[tuple[str, dict]]:
    """Every pod template in the manifests and examples: (where, pod spec)."""
    specs = []
    for path, i, doc in all_documents():
        where = f"{path.relative_to(DEPLOY)}#{i} {doc['kind']}/{(doc.get('metadata') or {}).get('name')}"
        if doc["kind"] in ("DaemonSet", "Job"):
            specs.append((where, doc["spec"]["template"]["spec"]))
        elif doc["kind"] == "JobSet":
            for rj in doc["spec"]["replicatedJobs"]:
                specs.append((f"{where} {rj['name']}", rj["template"]["spec"]["template"]["spec"]))
    return specs


def config_values() -> tuple[dict, str]:
    """Every key of the ConfigMap's config.yaml: option defaults and ceilings."""
    cm = one("ConfigMap", name="tierfs-config")
    text = cm["data"]["config.yaml"]
    data = yaml.safe_load(text) or {}
    assert isinstance(data, dict), "config.yaml must be a mapping of option names to values"
    return data, text


def config_defaults() -> tuple[dict, str]:
    data, text = config_values()
    return {k: v for k, v in data.items() if k not in ceilings.KEYS}, text


def config_ceilings() -> ceilings.Ceilings:
    data, _ = config_values()
    return ceilings.Ceilings.parse({k: v for k, v in data.items() if k in ceilings.KEYS}, "config.yaml")


def example_workloads() -> list[dict]:
    return [doc for _, _, doc in all_documents() if doc["kind"] in ("Job", "JobSet")]


def tierfs_volumes(pod_spec: dict) -> list[dict]:
    return [v for v in pod_spec.get("volumes", []) if "csi" in v]


def secret_value(secret: dict, key: str) -> str:
    if key in secret.get("stringData", {}):
        return secret["stringData"][key]
    return base64.b64decode(secret["data"][key]).decode()


# -- schemas ---------------------------------------------------------------------------


def kubernetes_versions() -> list[str]:
    """Every release kubernetes-validate ships schemas for, from MIN_KUBERNETES on."""
    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    versions = {m.group(1) for p in schemas.iterdir() if (m := re.match(r"^v(\d+\.\d+)\.\d+-local-strict$", p.name))}
    chosen = sorted((v for v in versions if Version(v) >= Version(MIN_KUBERNETES)), key=Version)
    assert chosen and chosen[0] == MIN_KUBERNETES, f"kubernetes-validate has no strict schemas for {MIN_KUBERNETES}"
    return chosen


def schema_cases() -> list:
    cases = []
    for path, i, doc in all_documents():
        base = f"{path.relative_to(DEPLOY)}#{i}:{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
        if doc.get("kind") == "JobSet":
            for rj in doc["spec"]["replicatedJobs"]:
                job = {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "metadata": {
                        **rj["template"].get("metadata", {}),
                        "name": f"{doc['metadata']['name']}-{rj['name']}-0",
                        "namespace": doc["metadata"].get("namespace", "default"),
                    },
                    "spec": rj["template"]["spec"],
                }
                cases.append((f"{base}/replicatedJobs/{rj['name']}", job))
        elif doc.get("kind") not in NOT_KUBERNETES_API:
            cases.append((base, doc))
    return cases


@pytest.mark.parametrize("version", kubernetes_versions())
@pytest.mark.parametrize("where,doc", schema_cases(), ids=[c[0] for c in schema_cases()])
def test_strict_schema(where, doc, version):
    error = None
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:  # its str() is the whole schema: say less
        error = f"{where} is invalid for Kubernetes {version}: {'.'.join(map(str, e.path))}: {e.message}"
    if error:
        pytest.fail(error)


def test_strict_validation_rejects_unknown_fields():
    """The check above is only worth something if strict mode catches a misspelt field."""
    ds = daemonset()
    ds["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountPropogation"] = "Bidirectional"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, kubernetes_versions()[-1], strict=True)


def test_every_document_is_a_complete_object():
    assert yaml_files(), "no manifests found"
    kinds = set()
    for path, i, doc in all_documents():
        where = f"{path.relative_to(ROOT)}#{i}"
        assert isinstance(doc, dict) and doc.get("apiVersion") and doc.get("kind"), where
        kinds.add(doc["kind"])
        if doc["kind"] != "Kustomization":
            assert DNS_LABEL.match(doc["metadata"]["name"]) or doc["kind"] == "CSIDriver", where

        def no_nulls(node, at):  # `key:` with nothing after it passes the schemas (nullable)
            if isinstance(node, dict):
                for k, v in node.items():
                    assert v is not None, f"{where}: {at}.{k} is empty"
                    no_nulls(v, f"{at}.{k}")
            elif isinstance(node, list):
                for n, v in enumerate(node):
                    assert v is not None, f"{where}: {at}[{n}] is empty"
                    no_nulls(v, f"{at}[{n}]")

        no_nulls(doc, "")
    for path in yaml_files():
        assert documents(path), f"{path} holds no document"
    # Whatever has no schema is checked by hand below; nothing else may skip the schemas.
    assert kinds & NOT_KUBERNETES_API == NOT_KUBERNETES_API


# -- the JobSet, by hand ---------------------------------------------------------------


def test_jobset_fields():
    js = one("JobSet", EXAMPLES)
    assert js["apiVersion"] == JOBSET_API
    assert set(js) <= {"apiVersion", "kind", "metadata", "spec"}
    assert set(js["metadata"]) <= {"name", "namespace", "labels", "annotations"}
    assert DNS_LABEL.match(js["metadata"]["name"])
    spec = js["spec"]
    assert set(spec) <= JOBSET_SPEC_FIELDS, set(spec) - JOBSET_SPEC_FIELDS
    assert set(spec.get("network", {})) <= JOBSET_NETWORK_FIELDS
    for key in ("enableDNSHostnames", "publishNotReadyAddresses"):
        assert isinstance(spec.get("network", {}).get(key, True), bool), key
    policy = spec.get("failurePolicy", {})
    assert set(policy) <= JOBSET_FAILURE_POLICY_FIELDS
    assert isinstance(policy.get("maxRestarts", 0), int) and policy.get("maxRestarts", 0) >= 0
    names = [rj["name"] for rj in spec["replicatedJobs"]]
    assert names and len(set(names)) == len(names)
    for rj in spec["replicatedJobs"]:
        assert set(rj) <= JOBSET_REPLICATED_JOB_FIELDS, set(rj) - JOBSET_REPLICATED_JOB_FIELDS
        assert DNS_LABEL.match(rj["name"])
        assert isinstance(rj.get("replicas", 1), int) and rj.get("replicas", 1) >= 1
        assert set(rj["template"]) <= {"metadata", "spec"}
        # Pod hostnames <jobset>-<replicatedJob>-<jobIndex>-<podIndex> must be DNS labels.
        last_job, last_pod = rj.get("replicas", 1) - 1, rj["template"]["spec"]["completions"] - 1
        longest = f"{js['metadata']['name']}-{rj['name']}-{last_job}-{last_pod}"
        assert DNS_LABEL.match(longest), f"pod hostname {longest!r} is not a DNS label"


# -- the plugin and kubelet ------------------------------------------------------------


def test_csidriver_is_the_contract():
    driver = one("CSIDriver")
    assert driver["metadata"]["name"] == DRIVER
    assert driver["spec"] == {
        "attachRequired": False,
        "podInfoOnMount": True,
        "volumeLifecycleModes": ["Ephemeral"],
        "fsGroupPolicy": "None",
        "requiresRepublish": False,
    }
    from tierfs.csi import DRIVER_NAME  # what the plugin reports in GetPluginInfo

    assert DRIVER_NAME == DRIVER


def test_plugin_command_is_the_contract_and_the_cli_accepts_it():
    c = plugin()
    assert c["command"] == ["tierfs"]
    got = flags(c["args"])
    assert got == {
        "": "csi",
        "endpoint": f"unix:///var/lib/kubelet/plugins/{DRIVER}/csi.sock",
        "node-id": "$(NODE_NAME)",
        "node-ip": "$(NODE_IP)",
        "state-dir": f"/var/lib/kubelet/plugins/{DRIVER}",
        "ramdisk": "/dev/shm/tierfs",
        "config": "/etc/tierfs/config.yaml",
        "keeper-cgroup": "/sys/fs/cgroup/tierfs.slice",
        "metrics": "0.0.0.0:9809",
    }
    # The keepers' cgroup is the host's: its hierarchy is mounted where the flag names it.
    spec = daemonset()["spec"]["template"]["spec"]
    held = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert volume(spec, held["/sys/fs/cgroup"])["hostPath"]["path"] == "/sys/fs/cgroup"
    assert spec["hostPID"] is True  # PID 1's cgroup namespace, to move a keeper out of the container's
    from tierfs.commands.cli import build_parser

    args = build_parser().parse_args(c["args"])  # exits (fails the test) on a flag it does not know
    assert args.command == "csi" and args.endpoint == got["endpoint"] and args.state_dir == got["state-dir"]


def test_environment_references_are_defined():
    """Kubernetes leaves an undefined $(VAR) in place, literally: the plugin would get it as its node id."""
    for where, spec in pod_specs():
        for c in spec["containers"] + spec.get("initContainers", []):
            defined = {e["name"] for e in c.get("env", [])}
            for arg in c.get("command", []) + c.get("args", []):
                for ref in ENV_REF.findall(arg):
                    assert ref in defined, f"{where} {c['name']}: $({ref}) is not in env"
    env = {e["name"]: e for e in plugin()["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["NODE_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.hostIP"}}


def test_registrar_and_probe_reach_the_plugin_socket():
    spec = daemonset()["spec"]["template"]["spec"]
    socket = unix_path(flags(plugin()["args"])["endpoint"])
    registrar = container(spec, "node-driver-registrar")
    assert registrar["image"].startswith("registry.k8s.io/sig-storage/csi-node-driver-registrar:")
    reg = flags(registrar["args"])
    assert reg["kubelet-registration-path"] == socket  # the host path kubelet dials
    mounts = {m["mountPath"]: m for m in registrar["volumeMounts"]}
    assert volume(spec, mounts["/registration"]["name"])["hostPath"]["path"] == "/var/lib/kubelet/plugins_registry"
    for sidecar in (registrar,):
        address = flags(sidecar["args"])["csi-address"]
        holder = max(
            (m for m in sidecar["volumeMounts"] if address.startswith(m["mountPath"].rstrip("/") + "/")),
            key=lambda m: len(m["mountPath"]),
        )
        host_dir = volume(spec, holder["name"])["hostPath"]["path"]
        on_host = str(PurePosixPath(host_dir) / PurePosixPath(address).relative_to(holder["mountPath"]))
        assert on_host == socket, f"{sidecar['name']} dials {address}, which is {on_host} on the host, not {socket}"
    assert PurePosixPath(socket).parent.name == DRIVER


def test_plugin_sees_host_paths_where_the_host_has_them():
    """kubelet passes host paths (target paths under /var/lib/kubelet/pods), so they must mean the same inside."""
    spec = daemonset()["spec"]["template"]["spec"]
    c = plugin()
    got = flags(c["args"])

    def mount_of(path: str) -> tuple[dict, dict]:
        holders = [
            m for m in c["volumeMounts"] if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
        ]
        assert holders, f"{path} is not mounted into the plugin"
        m = max(holders, key=lambda m: len(m["mountPath"]))
        return m, volume(spec, m["name"])

    for path in (unix_path(got["endpoint"]), got["state-dir"], "/var/lib/kubelet/pods"):
        m, v = mount_of(path)
        assert v["hostPath"]["path"] == m["mountPath"], f"{path}: host {v['hostPath']['path']} at {m['mountPath']}"
        assert m.get("mountPropagation") == "Bidirectional", f"mounts under {path} must reach the host"
    m, v = mount_of(got["ramdisk"])
    assert m["mountPath"] == got["ramdisk"] == v["hostPath"]["path"] == "/dev/shm/tierfs"
    assert v["hostPath"]["type"] == "DirectoryOrCreate"
    m, v = mount_of("/dev/fuse")
    assert v["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    config = PurePosixPath(got["config"])
    m, v = mount_of(str(config))
    assert m["mountPath"] == str(config.parent) and m.get("readOnly") and "subPath" not in m
    cm = one("ConfigMap", name=v["configMap"]["name"])
    assert cm["metadata"]["namespace"] == daemonset()["metadata"]["namespace"]
    assert config.name in cm["data"]


def test_bidirectional_propagation_only_on_the_privileged_container():
    bidirectional = []
    for where, spec in pod_specs():
        for c in spec["containers"] + spec.get("initContainers", []):
            privileged = (c.get("securityContext") or {}).get("privileged") is True
            for m in c.get("volumeMounts", []):
                if m.get("mountPropagation") == "Bidirectional":
                    assert privileged, f"{where} {c['name']}: Bidirectional needs privileged: true"
                    bidirectional.append((where, c["name"]))
            if privileged:
                assert where.startswith("daemonset.yaml"), f"{where} {c['name']}: only the plugin is privileged"
    assert [name for _, name in bidirectional] == ["tierfs"]


def test_liveness_is_an_exec_probe_of_the_plugin_socket():
    """No port on the host network: a rollout's new pod must start beside the old one."""
    c = plugin()
    command = c["livenessProbe"]["exec"]["command"]
    assert command[:3] == ["tierfs", "csi", "--probe"]
    assert f"--endpoint={flags(c['args'])['endpoint']}" in command
    from tierfs.commands.cli import build_parser

    assert build_parser().parse_args(command[1:]).probe
    for where, spec in pod_specs():
        for cont in spec["containers"]:
            assert not cont.get("ports"), f"{where} {cont['name']}: a port on the host network blocks surge"


def test_daemonset_runs_everywhere_and_rolls_with_a_surge():
    ds = daemonset()
    spec = ds["spec"]["template"]["spec"]
    # The new pod takes the mounts over before the old one goes (tests/csi/test_rollout.py).
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in spec["tolerations"]  # every taint, every effect
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for c in spec["containers"]:
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"], c["name"]
    # The daemons' own memory and the RAM tier's pages they write are charged to the plugin's
    # container: it has a limit, which must at least hold the plugin and a daemon per job.
    resources = plugin()["resources"]
    request, limit = (parse_size(resources[k]["memory"].replace("i", "")) for k in ("requests", "limits"))
    jobs = config_ceilings().max_jobs_per_node
    assert request <= limit and limit >= ceilings_overhead(jobs), (request, limit)
    for c in spec["containers"]:
        image = c["image"]
        if c["name"] == "tierfs":
            assert image.rpartition(":")[2] == tierfs.__version__, f"{image} is not tierfs {tierfs.__version__}"
        else:
            assert re.fullmatch(r"registry\.k8s\.io/sig-storage/[a-z-]+:v\d+\.\d+\.\d+", image), image


def ceilings_overhead(jobs: int) -> int:
    """What docs/kubernetes.md budgets beside the RAM tier: 256 MiB for the plugin and for each daemon."""
    return (1 + jobs) * (256 << 20)


def test_rbac_grants_get_pods_to_the_plugin_only():
    ds = daemonset()
    sa = one("ServiceAccount", name=ds["spec"]["template"]["spec"]["serviceAccountName"])
    assert sa["metadata"] == {**sa["metadata"], "name": "tierfs-csi", "namespace": NAMESPACE}
    role = one("ClusterRole")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
    ]
    binding = one("ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tierfs-csi", "namespace": NAMESPACE}]


def test_everything_installs_into_its_namespace():
    ns = one("Namespace")
    assert ns["metadata"]["name"] == NAMESPACE
    # The DaemonSet is privileged: a restrictive Pod Security default would reject it.
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    # GKE admits system-*-critical pods only in a namespace whose quota covers their class.
    priority = daemonset()["spec"]["template"]["spec"]["priorityClassName"]
    quota = one("ResourceQuota")
    assert {"scopeName": "PriorityClass", "operator": "In", "values": [priority]} in quota["spec"]["scopeSelector"][
        "matchExpressions"
    ]
    assert int(quota["spec"]["hard"]["pods"]) >= 15000  # a node's plugin pod, on the largest clusters
    for path, _, doc in all_documents():
        if path.parent == DEPLOY and doc["kind"] in ("ServiceAccount", "ConfigMap", "DaemonSet", "ResourceQuota"):
            assert doc["metadata"]["namespace"] == NAMESPACE, f"{path.name}: {doc['kind']}"
        if path.parent == DEPLOY and doc["kind"] in ("CSIDriver", "ClusterRole", "ClusterRoleBinding", "Namespace"):
            assert "namespace" not in doc["metadata"], f"{path.name}: {doc['kind']} is cluster-scoped"


def test_kustomization_lists_every_file():
    kustomization = documents(DEPLOY / "kustomization.yaml")
    assert len(kustomization) == 1
    k = kustomization[0]
    assert (k["apiVersion"], k["kind"]) == ("kustomize.config.k8s.io/v1beta1", "Kustomization")
    assert set(k) <= {"apiVersion", "kind", "resources", "images", "namespace", "labels"}
    files = sorted(p.name for p in DEPLOY.iterdir() if p.suffix in (".yaml", ".yml") and p.name != "kustomization.yaml")
    assert len(set(k["resources"])) == len(k["resources"]), "a file listed twice"
    assert sorted(k["resources"]) == files  # and nothing from examples/: those are edited, then applied by hand


# -- volume attributes and defaults ----------------------------------------------------


def test_host_path_and_per_job_options_exist():
    """The sets this module reasons with name real `tierfs mount` options."""
    assert HOST_PATH_OPTIONS <= set(OPTIONS) and PER_JOB_OPTIONS <= set(OPTIONS)


def test_defaults_are_mount_options():
    values, text = config_values()
    data = {k: v for k, v in values.items() if k not in ceilings.KEYS}
    assert data, "config.yaml sets nothing"
    # Commented-out examples (`# gcs: gs://...`) must be right too: someone will uncomment them.
    commented = set(re.findall(r"^\s*#\s*([a-z][a-z-]*):\s", text, flags=re.MULTILINE)) - set(ceilings.KEYS)
    for key in set(data) | commented:
        assert key in OPTIONS, f"config.yaml: {key!r} is not a tierfs mount option"
        assert key not in HOST_PATH_OPTIONS, f"config.yaml: {key!r} is the plugin's (a host path)"
        assert key not in PER_JOB_OPTIONS, f"config.yaml: {key!r} differs per job or node, not a default"
    for key, value in values.items():
        assert isinstance(value, str), f"config.yaml: {key}: {value!r} is not a string (quote it)"


def test_ceilings_are_valid_and_the_commented_ones_too():
    """The plugin refuses to start on a bad ceiling: the shipped ones, set or commented, all parse."""
    values, text = config_values()
    assert set(ceilings.KEYS) & set(values), "config.yaml shows no ceiling"
    commented = dict(re.findall(r"^\s*#\s*([a-z][a-z-]*):\s*(.+)$", text, flags=re.MULTILINE))
    every = {
        **{k: yaml.safe_load(v) for k, v in commented.items() if k in ceilings.KEYS},
        **{k: v for k, v in values.items() if k in ceilings.KEYS},
    }
    assert set(every) == set(ceilings.KEYS), f"config.yaml does not show {set(ceilings.KEYS) - set(every)}"
    ceilings.Ceilings.parse({k: str(v) for k, v in every.items()}, "config.yaml")
    assert config_ceilings() == ceilings.Ceilings(), "the shipped ceilings are the plugin's documented defaults"


def test_example_attributes_are_mount_options():
    seen = 0
    for where, spec in pod_specs():
        for v in tierfs_volumes(spec):
            assert v["csi"]["driver"] == one("CSIDriver")["metadata"]["name"], where
            for key in v["csi"].get("volumeAttributes", {}):
                seen += 1
                assert key in OPTIONS, f"{where}: volume attribute {key!r} is not a tierfs mount option"
                assert key not in HOST_PATH_OPTIONS, f"{where}: {key!r} names a host path; the plugin sets it"
    assert seen


def test_examples_leave_the_bucket_to_the_cluster():
    """The plugin refuses a pod's `gcs` that differs from the ConfigMap's (no --allow-pod-gcs)."""
    for where, spec in pod_specs():
        for v in tierfs_volumes(spec):
            assert "gcs" not in v["csi"].get("volumeAttributes", {}), f"{where}: the bucket is the ConfigMap's"
    assert "allow-pod-gcs" not in flags(plugin()["args"])


def _pods(workload: dict) -> list[dict]:
    """The example's pods as the Job or JobSet controller names and labels them."""
    ns = workload["metadata"].get("namespace", "default")
    pods = []
    if workload["kind"] == "Job":
        spec = workload["spec"]
        for index in range(spec["completions"]):
            pods.append(
                {
                    "labels": {"batch.kubernetes.io/job-completion-index": str(index)},
                    "hostname": f"{workload['metadata']['name']}-{index}",
                    "subdomain": spec["template"]["spec"]["subdomain"],
                    "namespace": ns,
                    "spec": spec["template"]["spec"],
                }
            )
        return pods
    jobs = workload["spec"]["replicatedJobs"]
    global_replicas = sum(rj.get("replicas", 1) for rj in jobs)
    subdomain = workload["spec"].get("network", {}).get("subdomain") or workload["metadata"]["name"]
    global_index = 0
    for rj in jobs:
        for job_index in range(rj.get("replicas", 1)):
            job_spec = rj["template"]["spec"]
            for index in range(job_spec["completions"]):
                pods.append(
                    {
                        "labels": {
                            "batch.kubernetes.io/job-completion-index": str(index),
                            "jobset.sigs.k8s.io/job-global-index": str(global_index),
                            "jobset.sigs.k8s.io/global-replicas": str(global_replicas),
                        },
                        "hostname": f"{workload['metadata']['name']}-{rj['name']}-{job_index}-{index}",
                        "subdomain": subdomain,
                        "namespace": ns,
                        "spec": job_spec["template"]["spec"],
                    }
                )
            global_index += 1
    return pods


def _rank(attributes: dict, labels: dict) -> int:
    """The contract: attribute `rank`, else the JobSet's indexes, else the Job's completion index."""
    if "rank" in attributes:
        return int(attributes["rank"])
    index = int(labels["batch.kubernetes.io/job-completion-index"])
    if "jobset.sigs.k8s.io/job-global-index" in labels:
        nodes, jobs = int(attributes["nodes"]), int(labels["jobset.sigs.k8s.io/global-replicas"])
        assert nodes % jobs == 0, f"nodes={nodes} is not a multiple of the JobSet's {jobs} Jobs"
        return int(labels["jobset.sigs.k8s.io/job-global-index"]) * (nodes // jobs) + index
    return index


@pytest.mark.parametrize("workload", example_workloads(), ids=lambda w: f"{w['kind']}/{w['metadata']['name']}")
def test_example_ranks_peers_and_coordinator_name_the_pods(workload):
    pods = _pods(workload)
    attributes = [tierfs_volumes(p["spec"])[0]["csi"]["volumeAttributes"] for p in pods]
    attrs = attributes[0]
    assert all(a == attrs for a in attributes), "every pod of a job must ask for the same volume"
    nodes = int(attrs["nodes"])
    assert nodes == len(pods), f"nodes={nodes} but the example runs {len(pods)} pods"
    ranks = [_rank(attrs, p["labels"]) for p in pods]
    assert sorted(ranks) == list(range(nodes)), f"ranks {ranks} are not 0..{nodes - 1}"
    # The plugin resolves these from its own namespace: they must be qualified with the pods'.
    fqdn = {rank: f"{p['hostname']}.{p['subdomain']}.{p['namespace']}.svc" for rank, p in zip(ranks, pods, strict=True)}
    from tierfs.csi.settings import PEER_PORT  # where the plugin listens when `listen` is not set

    peers = [parse_address(a, "peers") for a in attrs["peers"].split(",")]
    assert sorted(peers) == sorted((host, PEER_PORT) for host in fqdn.values())
    assert parse_address(attrs["coordinator"], "coordinator")[0] == fqdn[0]  # rank 0's pod
    for p in pods:
        spec = p["spec"]
        # Peers listen on node IPs; the pods' names resolve to node IPs only with hostNetwork.
        assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert DNS_LABEL.match(p["hostname"]), p["hostname"]


def test_example_job_is_indexed_behind_a_headless_service():
    job = one("Job", EXAMPLES)
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"]
    service = one("Service", EXAMPLES)
    assert spec["template"]["spec"]["subdomain"] == service["metadata"]["name"]
    assert service["metadata"].get("namespace") == job["metadata"].get("namespace")
    assert service["spec"]["clusterIP"] == "None"
    # The names must resolve while the pods mount their volumes, before they are Ready.
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    js = one("JobSet", EXAMPLES)
    assert js["spec"]["network"]["enableDNSHostnames"] is True
    assert js["spec"]["network"].get("publishNotReadyAddresses", True) is True
    for rj in js["spec"]["replicatedJobs"]:
        job_spec = rj["template"]["spec"]
        assert job_spec["completionMode"] == "Indexed" and job_spec["parallelism"] == job_spec["completions"]


def test_example_pods_use_the_volume_as_the_contract_says():
    secret = one("Secret", EXAMPLES)
    for where, spec in pod_specs():
        if where.startswith("daemonset.yaml"):
            continue
        (v,) = tierfs_volumes(spec)
        assert v["csi"]["nodePublishSecretRef"] == {"name": secret["metadata"]["name"]}, where
        mounted = [m for c in spec["containers"] for m in c.get("volumeMounts", []) if m["name"] == v["name"]]
        assert mounted and all(m["mountPath"] == "/local" for m in mounted), where
        assert spec["securityContext"]["runAsUser"] == 1000, where
        assert not any(x.get("hostPath") for x in spec.get("volumes", [])), where
    for workload in example_workloads():
        # kubelet reads nodePublishSecretRef from the pod's own namespace.
        assert workload["metadata"].get("namespace") == secret["metadata"].get("namespace")
    assert len(secret_value(secret, "secret")) >= 16  # tierfs refuses shorter secrets


@pytest.mark.parametrize("workload", example_workloads(), ids=lambda w: f"{w['kind']}/{w['metadata']['name']}")
def test_example_volumes_build_valid_configurations(workload):
    """What the plugin will run: cluster defaults, then the pod's attributes, for every rank."""
    defaults, _ = config_defaults()
    secret = secret_value(one("Secret", EXAMPLES), "secret")
    for n, p in enumerate(_pods(workload)):
        attrs = tierfs_volumes(p["spec"])[0]["csi"]["volumeAttributes"]
        options = {**defaults, **attrs}
        options.setdefault("rank", str(_rank(attrs, p["labels"])))
        if options.get("peers") and not options.get("listen"):
            options["listen"] = f"192.0.2.{n + 1}:7420"  # the plugin's node IP
        limits = config_ceilings()  # the examples ask for nothing the shipped ceilings refuse
        if options.get("listen"):
            limits.check_listen(*parse_address(options["listen"], "listen"), f"192.0.2.{n + 1}")
        assert not {"data-path", "wake-cpus", "engine"} & set(attrs), (
            "pods take the ConfigMap's data-path, wake-cpus and engine"
        )
        limits.check_attributes(options, set(attrs))  # restore-wait, prefetch...: within the shipped bounds
        if "capacity" in attrs and limits.max_capacity is not None:
            assert parse_size(attrs["capacity"]) <= limits.max_capacity
        cfg = Config.build(
            mountpoint="/var/lib/kubelet/plugins/csi.tierfs.dev/mnt/job",
            secret=secret,
            **{k.replace("-", "_"): v for k, v in options.items()},
        )
        assert cfg.job == attrs["job"] and cfg.nodes == len(_pods(workload))


# -- the image -------------------------------------------------------------------------


def test_dockerfile_copies_what_exists_and_leaves_compilers_behind():
    lines = [line.strip() for line in (ROOT / "csi" / "Dockerfile").read_text().splitlines()]
    stages = [line for line in lines if line.upper().startswith("FROM ")]
    assert len(stages) == 2, "a build stage (compilers) and a runtime stage"
    runtime = lines[lines.index(stages[1]) :]
    for line in lines:
        if line.upper().startswith("COPY ") and "--from=" not in line:
            *sources, _dest = shlex.split(line)[1:]
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository (the build context)"
    runtime_text = "\n".join(runtime)
    for compiler in ("gcc", "libfuse3-dev", "build-essential"):
        assert compiler not in runtime_text, f"{compiler} in the final image"
    assert "fuse3" in runtime_text
    assert 'ENTRYPOINT ["tini", "--", "tierfs"]' in runtime  # PID 1 must reap the daemons
